"""RULER-style synthetic long-context tasks, generated offline and deterministic by seed (after RULER: "What's
the Real Context Size of Your Long-Context Language Models?").

    sample = make_sample("niah_multikey", seed=3, context_tokens=4096, measure=count, corpus_text=text)
    string_match_all(answer, sample.expected)      # RULER's score: share of the expected strings named

Files: sample.py (a sample, fitting to a context, the score), haystacks.py (essay, noise, random tokens),
niah.py (needle tasks), tracking.py (variable tracking), aggregation.py (common and frequent words),
tasks.py (the tasks by name and family).
"""

from kvtier.data.ruler.sample import RulerSample, string_match_all
from kvtier.data.ruler.tasks import FAMILIES, TASKS, family, make_sample

__all__ = ["FAMILIES", "TASKS", "RulerSample", "family", "make_sample", "string_match_all"]
