"""Token ids -> visible text: stop strings cut it, and nothing shown is ever taken back."""

from kvtier.http.text import TextAssembler

# A toy tokenizer: each id is a piece of text; 9 is the first half of a two-token character.
PIECES = {1: "Hello", 2: ",", 3: " wor", 4: "ld", 5: "!", 6: " E", 7: "ND", 8: "\x82", 9: "\xe2"}


def decode(ids: list[int]) -> str:
    text = "".join(PIECES.get(token, "") for token in ids)
    return text.replace("\xe2\x82", "\u20ac").replace("\xe2", "\ufffd")  # 9 then 8 -> the euro sign


def feed(ids: list[int], stop: list[str]) -> tuple[list[str], TextAssembler]:
    text = TextAssembler(decode, stop)
    return [text.add(token) for token in ids] + [text.finish()], text


def test_without_stop_strings_every_token_shows_at_once():
    pieces, text = feed([1, 2, 3, 4, 5], [])
    assert pieces == ["Hello", ",", " wor", "ld", "!", ""] and not text.stopped


def test_a_stop_string_cuts_the_text_before_it_and_ends():
    pieces, text = feed([1, 3, 4, 6, 7, 5], [" END"])
    assert "".join(pieces) == text.text == "Hello world"
    assert text.stopped and text.add(1) == ""


def test_a_possible_stop_prefix_is_held_back_until_settled():
    text = TextAssembler(decode, ["ld!"])
    assert text.add(1) == "Hello"
    assert text.add(3) == " wor"
    assert text.add(4) == ""  # "ld" may start "ld!"
    assert text.add(2) == "ld,"  # it did not
    text = TextAssembler(decode, ["ld!"])
    assert [text.add(token) for token in (1, 3, 4)] == ["Hello", " wor", ""]
    assert text.add(5) == "" and text.stopped and text.text == "Hello wor"


def test_a_partial_character_waits_for_its_second_token():
    text = TextAssembler(decode, [])
    assert text.add(1) == "Hello"
    assert text.add(9) == ""
    assert text.add(8) == "\u20ac"
    assert text.finish() == ""


def test_held_back_text_is_shown_when_generation_ends():
    text = TextAssembler(decode, [" E!"])
    assert text.add(1) == "Hello" and text.add(6) == ""
    assert text.finish() == " E"
