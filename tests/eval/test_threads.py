"""Torch threads per phase and mode: the sparse path decodes on one thread, every other mode on every core."""

from kvtier.eval.threads import decode_threads, describe_threads, machine_threads, thread_settings


def test_only_modes_with_a_scorer_process_decode_on_one_thread():
    assert decode_threads("sparse") == decode_threads("sparse-naive") == 1
    for mode in ("dense", "offload", "h2o", "infinigen", "leoam"):
        assert decode_threads(mode) == machine_threads()


def test_recorded_threads_read_back_as_text():
    assert describe_threads(thread_settings()) == (f"prefill {machine_threads()}; decode sparse 1, "
                                                   f"other modes {machine_threads()}")
    assert describe_threads(1) == "1 (prefill and decode, every mode)"  # results from before per-phase threads
