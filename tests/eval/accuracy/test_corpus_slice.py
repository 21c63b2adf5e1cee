"""Seed-dependent corpus stretches start at paragraph breaks and leave room for the context."""

from kvtier.eval.accuracy.corpus_slice import CHARS_PER_TOKEN_BOUND, corpus_slice


def test_seed_zero_and_short_corpora_read_from_the_start():
    text = "One.\n\nTwo.\n\nThree."
    assert corpus_slice(text, 0, 10) == text
    assert corpus_slice(text, 3, 10) == text  # too short to move


def test_other_seeds_start_at_a_paragraph_with_room_left():
    paragraphs = [f"Paragraph {i} " + "word " * 200 for i in range(2000)]
    text = "\n\n".join(paragraphs)
    tokens = 1000
    for seed in (1, 2, 7):
        piece = corpus_slice(text, seed, tokens)
        assert piece.startswith("Paragraph ") and piece != text
        assert len(piece) >= CHARS_PER_TOKEN_BOUND * tokens
    assert corpus_slice(text, 1, tokens) != corpus_slice(text, 2, tokens)
