"""Torch threads per phase and mode: every mode decodes on every core; the sparse path's helpers yield to its scorer."""

import os
import threading

import pytest
import torch

from kvtier.sparse.threads import (
    decode_threads, decoding, describe_threads, machine_threads, scorer_core, thread_settings, torch_helpers,
    torch_threads,
)


def test_every_mode_decodes_on_every_core(monkeypatch):
    for mode in ("sparse", "sparse-naive", "dense", "offload", "h2o", "infinigen", "leoam"):
        assert decode_threads(mode) == machine_threads()
    monkeypatch.setattr("kvtier.sparse.threads.machine_threads", lambda: 16)
    assert decode_threads("sparse") == decode_threads("offload") == 16


def test_torch_threads_restores_the_count_even_after_an_error():
    before = torch.get_num_threads()
    try:
        with torch_threads(before + 1):
            assert torch.get_num_threads() == before + 1
            raise RuntimeError("inside")
    except RuntimeError:
        pass
    assert torch.get_num_threads() == before


def test_recorded_threads_read_back_as_text():
    cores = machine_threads()
    assert describe_threads(thread_settings()) == (f"prefill {cores}; decode sparse {cores}, other modes {cores}; "
                                                   "sparse: torch's helper threads yield to the scorer (SCHED_IDLE)")
    earlier = {"prefill": 2, "decode": {"sparse": 1, "other modes": 2}}  # results from before the helpers yielded
    assert describe_threads(earlier) == "prefill 2; decode sparse 1, other modes 2"
    assert describe_threads(1) == "1 (prefill and decode, every mode)"  # results from before per-phase threads


def test_decoding_a_mode_uses_its_threads_and_restores_the_count():
    before = torch.get_num_threads()
    with decoding("sparse-hit"):
        assert torch.get_num_threads() == decode_threads("sparse")
    with decoding("offload"):
        assert torch.get_num_threads() == machine_threads()
    assert torch.get_num_threads() == before


def test_decoding_without_a_mode_changes_nothing():
    threads = torch.get_num_threads()
    with decoding(None):
        assert torch.get_num_threads() == threads


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="keeping a core free needs two")
def test_a_scorer_mode_decodes_off_the_scorer_core_and_gives_it_back():
    cores, core = os.sched_getaffinity(0), scorer_core()
    assert core == max(cores)
    with decoding("sparse-hit"):
        assert os.sched_getaffinity(0) == cores - {core}
        assert machine_threads() == len(cores) and scorer_core() == core  # as seen from outside the decode
        with decoding("sparse"):  # nested (the APP calibration inside a decode): the same split
            assert os.sched_getaffinity(0) == cores - {core} and torch.get_num_threads() == len(cores)
        assert os.sched_getaffinity(0) == cores - {core}
    assert os.sched_getaffinity(0) == cores
    with decoding("offload"):
        assert os.sched_getaffinity(0) == cores  # no scorer: every core


def test_a_single_core_keeps_no_core_for_a_scorer(monkeypatch):
    monkeypatch.setattr("kvtier.sparse.threads.os.sched_getaffinity", lambda _pid: {3})
    pinned = []
    monkeypatch.setattr("kvtier.sparse.threads.os.sched_setaffinity", lambda *args: pinned.append(args))
    assert scorer_core() is None
    with decoding("sparse"):
        assert pinned == []


def _policies(threads):
    return {tid: os.sched_getscheduler(tid) for tid in threads}


def _placement(threads):
    return {tid: (os.sched_getscheduler(tid), os.sched_getaffinity(tid)) for tid in threads}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="helper threads need two cores")
def test_torch_helpers_are_the_threads_python_did_not_start():
    with torch_threads(2):
        helpers = torch_helpers()
    assert helpers and threading.get_native_id() not in helpers
    assert not set(helpers) & {thread.native_id for thread in threading.enumerate()}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="helper threads need two cores")
def test_a_scorer_modes_helpers_yield_while_it_decodes_and_get_their_policy_back():
    with torch_threads(2):
        before = _placement(torch_helpers())
    assert {policy for policy, _ in before.values()} == {os.SCHED_OTHER}
    cores, core = os.sched_getaffinity(0), scorer_core()
    with decoding("sparse-hit"):
        *others, yielding = sorted(torch_helpers())
        assert _policies([yielding]) == {yielding: os.SCHED_IDLE} and os.sched_getaffinity(yielding) == {core}
        assert all(os.sched_getaffinity(tid) == cores - {core} for tid in others)
        assert set(_policies([threading.get_native_id(), *others]).values()) == {os.SCHED_OTHER}
        with decoding("sparse"):  # nested: still yielding after the inner decode ends
            pass
        assert _policies([yielding]) == {yielding: os.SCHED_IDLE} and os.sched_getaffinity(yielding) == {core}
    assert _placement([yielding, *others]) == before
    with decoding("offload"):
        assert set(_policies(torch_helpers()).values()) == {os.SCHED_OTHER}
