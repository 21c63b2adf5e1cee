"""Lookahead: its requests in flight across steps and its settings (end to end: test_cache.py)."""

import numpy as np
import pytest

from kvtier.errors import ConfigError
from kvtier.sparse.lookahead import Lookahead
from kvtier.sparse.settings import SparseSettings


@pytest.mark.parametrize("settings", [{"candidate_margin": 0.5}, {"lookahead_skip": 0}, {"lookahead_min_cold": 0}])
def test_bad_lookahead_settings_are_refused(settings):
    with pytest.raises(ConfigError, match="lookahead"):
        SparseSettings(**settings).validated()


class _Scorer:
    """Takes candidates requests and answers them in order, with nothing."""

    def __init__(self) -> None:
        self.asked, self.answered = [], 0

    def request(self, tier: int, _query, _cold_tokens: int, _counts) -> None:
        self.asked.append(tier)

    def candidates(self):
        self.answered += 1
        return [], np.empty((1, 0, 0), dtype=np.uint8), np.zeros(1, dtype=np.int64)


def test_a_step_keeps_what_the_step_before_asked_for_it_and_drops_the_rest():
    scorer, query, counts = _Scorer(), np.zeros((1, 1, 1, 8), dtype=np.float32), np.array([16])
    lookahead = Lookahead(1.5, 2, 1, scorer, None)
    for tier in (0, 1):  # the end of a step asks for the next step's first layers
        lookahead.start(tier, query, 100, counts, next_step=True)
    lookahead.open_step()
    assert lookahead.in_flight == (0, 1) and scorer.answered == 0
    lookahead.open_step()  # asked for the step before: that step ended midway
    assert lookahead.in_flight == () and scorer.answered == 2
    lookahead.start(5, query, 100, counts)  # a step that ended midway, with a layer's request still out
    lookahead.start(0, query, 100, counts, next_step=True)
    lookahead.open_step()
    assert lookahead.in_flight == () and scorer.answered == 4 and scorer.asked == [0, 1, 5, 0]
