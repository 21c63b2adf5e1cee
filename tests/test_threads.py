"""Torch threads per phase and mode: the sparse path leaves one core to its scorer, every other mode uses all."""

import os

import pytest
import torch

from kvtier.threads import (
    decode_threads, decoding, describe_threads, machine_threads, scorer_core, thread_settings, torch_threads,
)


def test_only_modes_with_a_scorer_process_leave_a_core_free():
    assert decode_threads("sparse") == decode_threads("sparse-naive") == max(1, machine_threads() - 1)
    for mode in ("dense", "offload", "h2o", "infinigen", "leoam"):
        assert decode_threads(mode) == machine_threads()


def test_a_scorer_mode_keeps_one_thread_on_one_core(monkeypatch):
    monkeypatch.setattr("kvtier.threads.machine_threads", lambda: 1)
    assert decode_threads("sparse") == 1
    monkeypatch.setattr("kvtier.threads.machine_threads", lambda: 16)
    assert decode_threads("sparse") == 15 and decode_threads("offload") == 16


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
    sparse = max(1, machine_threads() - 1)
    assert describe_threads(thread_settings()) == (f"prefill {machine_threads()}; decode sparse {sparse}, "
                                                   f"other modes {machine_threads()}")
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
            assert os.sched_getaffinity(0) == cores - {core} and torch.get_num_threads() == len(cores) - 1
        assert os.sched_getaffinity(0) == cores - {core}
    assert os.sched_getaffinity(0) == cores
    with decoding("offload"):
        assert os.sched_getaffinity(0) == cores  # no scorer: every core


def test_a_single_core_keeps_no_core_for_a_scorer(monkeypatch):
    monkeypatch.setattr("kvtier.threads.os.sched_getaffinity", lambda _pid: {3})
    pinned = []
    monkeypatch.setattr("kvtier.threads.os.sched_setaffinity", lambda *args: pinned.append(args))
    assert scorer_core() is None
    with decoding("sparse"):
        assert pinned == []
