"""Cold-pool writes taken off the decode step's critical path.

Promotions and demotions rewrite cold slots (a read-modify-write of each page
they touch, in the K|V file and in the sketch file). Done inline they cost a
step tens of milliseconds of synchronous disk round trips; queued here they run
on one background thread, in order, while the model computes the next layers.

A layer is read again only at its next decode step: `settle(layer)` waits for
that layer's queued writes first (by then they are normally done) and raises
the first failure, so nothing reads a slot whose bytes are not on disk, and a
failed write stops the generation with its error instead of being lost.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor


class BackgroundWrites:
    """One writer thread; writes queued per layer, waited for per layer."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-cold-writes")
        self._pending: dict[int, list[Future]] = {}

    def submit(self, layer: int, write: Callable[[], None], on_done: Callable[[float], None] | None = None) -> None:
        """Queue `write` (which touches only `layer`'s regions) after every write queued before it;
        `on_done(seconds)` is called on the writer thread once it has succeeded."""

        def timed() -> None:
            started = time.perf_counter()
            write()
            if on_done is not None:
                on_done(time.perf_counter() - started)

        self._pending.setdefault(layer, []).append(self._pool.submit(timed))

    def settle(self, layer: int) -> None:
        """Wait until `layer`'s queued writes are on disk; re-raise the first that failed."""
        for future in self._pending.pop(layer, ()):
            future.result()

    def close(self) -> None:
        """Finish the queued writes (their failures no longer matter: the files are about to go)."""
        self._pool.shutdown(wait=True)
        self._pending.clear()
