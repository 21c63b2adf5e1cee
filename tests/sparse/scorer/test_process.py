"""When the scorer process starts reading the next layer's sketches: after its answer unless it falls behind."""

from kvtier.sparse.scorer.process import PrepareTiming


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _request(timing: PrepareTiming, clock: _Clock, gap_s: float, read_s: float) -> None:
    """An answer, then the next request `gap_s` later, the last sketch read having taken `read_s`."""
    timing.answered()
    clock.now += gap_s
    timing.arrived(read_s)


def test_reads_follow_the_answer_until_they_would_not_finish_before_the_next_request():
    clock = _Clock()
    timing = PrepareTiming(clock)
    assert not timing.overlap()  # nothing measured: the request's candidate reads get the disk alone
    _request(timing, clock, gap_s=0.010, read_s=0.004)
    assert not timing.overlap()
    for _ in range(3):  # reads longer than the gaps between requests: the scorer is behind
        _request(timing, clock, gap_s=0.010, read_s=0.030)
    assert timing.overlap()
    for _ in range(10):  # the host slows down (reads shorter than the gaps again): back to after the answer
        _request(timing, clock, gap_s=0.050, read_s=0.030)
    assert not timing.overlap()


def test_a_request_before_any_answer_changes_nothing():
    timing = PrepareTiming(_Clock())
    timing.arrived(read_s=60.0)
    assert timing.slack_s == 0.0


def test_a_request_that_comes_before_the_last_answer_counts_the_scorer_behind():
    clock = _Clock()
    timing = PrepareTiming(clock)
    _request(timing, clock, gap_s=0.010, read_s=0.004)  # time to spare: reads follow the answer
    assert not timing.overlap()
    for _ in range(3):
        timing.arrived(read_s=0.004, busy=True)  # queued behind a request still waiting for its reads
    assert timing.overlap()
