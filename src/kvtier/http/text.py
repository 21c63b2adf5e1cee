"""Generated token ids -> the text a client may see so far, cut at the first stop string.

Text is decoded from all ids each time (a token can change how the previous ones decode, and a
multi-byte character can span tokens), and what has been shown is never taken back. So the tail
that could still turn into a stop string, or that ends in an incomplete character, is held back
until the next token settles it or the generation ends.
"""

from __future__ import annotations

from collections.abc import Callable

INCOMPLETE = "\ufffd"  # what the tokenizer decodes a partial UTF-8 sequence to


class TextAssembler:
    """Feed tokens with `add`; each call returns the newly visible text. `stopped` once a stop string matched.

    Before `min_tokens` tokens no stop string counts (vLLM's rule): a match must end in text that
    came after them.
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: list[str], min_tokens: int = 0) -> None:
        self._decode = decode
        self._stop = stop
        self._min_tokens = min_tokens
        self._floor = 0  # a stop string must end past this many characters
        self._ids: list[int] = []
        self._shown = 0
        self.text = ""
        self.stopped = False

    def add(self, token_id: int) -> str:
        if self.stopped:
            return ""
        self._ids.append(token_id)
        text = self._decode(self._ids)
        if len(self._ids) < self._min_tokens:
            self._floor = len(text.rstrip(INCOMPLETE))
        cut = self._first_stop(text)
        if cut is not None:
            self.stopped = True
            self.text = text[:cut]
            return self._reveal(len(self.text))
        self.text = text
        return self._reveal(len(text) - self._held_back(text))

    def finish(self) -> str:
        """The generation ended: show whatever was held back."""
        return self._reveal(len(self.text))

    def _reveal(self, upto: int) -> str:
        upto = max(upto, self._shown)
        piece = self.text[self._shown:upto]
        self._shown = upto
        return piece

    def _first_stop(self, text: str) -> int | None:
        # Only text not shown yet (plus a stop string's length before it) can hold a new match.
        start = max(0, self._shown - max((len(s) for s in self._stop), default=0))
        found = [index for index in (text.find(stop, max(start, self._floor - len(stop) + 1)) for stop in self._stop)
                 if index >= 0]
        return min(found) if found else None

    def _held_back(self, text: str) -> int:
        """Characters at the end of `text` to keep back: a partial character, or a possible stop-string start."""
        partial = len(text) - len(text.rstrip(INCOMPLETE))
        prefix = max((size for stop in self._stop for size in range(1, len(stop)) if text.endswith(stop[:size])),
                     default=0)
        return max(partial, prefix)
