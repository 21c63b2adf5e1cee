"""The terminal's two streams kept apart: the answer streamed to stdout, log lines (`-v`) on stderr.

A log record that comes while an answer is being streamed waits for the answer's end: a terminal
showing both streams (or `2>&1`) would otherwise print it in the middle of the answer's words.
"""

import logging
import sys

# (handler, record) of the records that came while an answer was streaming; None: no answer is open
_held: list[tuple["StderrHandler", logging.LogRecord]] | None = None


class StderrHandler(logging.StreamHandler):
    """Log records to stderr, but those that come while an answer streams only after it (`end_answer`)."""

    def emit(self, record: logging.LogRecord) -> None:
        if _held is not None:
            _held.append((self, record))
        else:
            super().emit(record)


def write_answer(piece: str) -> None:
    """Stream a piece of the answer to stdout now; log records wait until `end_answer`."""
    global _held
    if _held is None:
        _held = []
    sys.stdout.write(piece)
    sys.stdout.flush()


def end_answer() -> None:
    """End the answer's line (if one was streamed) and write the log records held meanwhile."""
    global _held
    if _held is None:
        return
    held, _held = _held, None
    sys.stdout.write("\n")
    sys.stdout.flush()
    for handler, record in held:
        handler.emit(record)
