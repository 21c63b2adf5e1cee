"""The answer on stdout and log lines on stderr, seen together (a terminal, or `2>&1`): never one inside the other."""

import io
import logging
import sys

import pytest

from kvtier.commands import console


@pytest.fixture
def logger():
    logger = logging.getLogger("kvtier.test_console")
    logger.propagate = False
    yield logger
    logger.handlers.clear()
    logger.propagate = True


def _screen(monkeypatch, logger) -> io.StringIO:
    """One stream for stdout and the stderr handler, as a terminal shows them (set in the test: pytest's capture
    replaces sys.stdout between a fixture and the test)."""
    shared = io.StringIO()
    monkeypatch.setattr(sys, "stdout", shared)
    logger.addHandler(console.StderrHandler(shared))
    return shared


def test_log_lines_of_a_streamed_answer_follow_it(monkeypatch, logger):
    screen = _screen(monkeypatch, logger)
    logger.warning("before")
    console.write_answer("The code")
    logger.warning("while streaming")
    console.write_answer(" is 42.")
    console.end_answer()
    logger.warning("after")
    assert screen.getvalue() == "before\nThe code is 42.\nwhile streaming\nafter\n"


def test_ending_no_answer_writes_nothing(monkeypatch, logger):
    screen = _screen(monkeypatch, logger)
    console.end_answer()
    logger.warning("alone")
    assert screen.getvalue() == "alone\n"
