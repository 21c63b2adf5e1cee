"""The scorer's sketch read ahead waits while candidate reads are in flight, and only then."""

from kvtier.sparse.scorer.candidates_first import CandidatesFirst


def test_with_nothing_in_flight_the_wait_returns(quiet_waiter):
    assert quiet_waiter(CandidatesFirst()).wait(10)


def test_the_wait_lasts_until_every_batch_in_flight_has_landed(quiet_waiter):
    first = CandidatesFirst()
    first.begin()
    first.begin()
    returned = quiet_waiter(first)
    first.end()
    assert not returned.wait(0.2)  # one batch still in flight
    first.end()
    assert returned.wait(10)
