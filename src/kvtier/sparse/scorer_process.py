"""The storage-side scorer: a separate OS process that owns reading the cold pool's sketches.

It plays the SmartSSD's FPGA (the HillInfer paper's HIE + CEC): per request it reads
one layer's key sketches next to the data, computes raw inner products with
the query found in shared memory, and streams `<position, score>` blocks back.
It never sends keys to the host.

Started by `ScorerClient` as `python -m kvtier.sparse.scorer_process CONFIG`,
with the shared segment and both pipes inherited as file descriptors. It
imports numpy and kvtier's storage layer only (no torch), so it starts in a
fraction of a second, and it runs numpy single-threaded: it stands for a small
accelerator beside the disk, not for a second copy of the host's cores.

It knows the layer order: once it has answered layer l it reads layer
l + 1's sketches (sketch_scorer.py), so a query finds them ready. On start it
answers request id 0 (ready). It exits when the request pipe closes (the host
is gone) or on a stop request.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

from kvtier.sparse.protocol import OP_STOP, REQUEST, RESPONSE, STATUS_FAILED, STATUS_OK, Channel, ChannelSpec, read_exact
from kvtier.sparse.record_file import RecordLayout, open_for_reading
from kvtier.sparse.sketch import SketchFormat
from kvtier.sparse.sketch_scorer import SketchScorer
from kvtier.sparse.stored_sketches import StoredSketches
from kvtier.storage import IOEngine


def build_scorer(config: dict, channel: Channel, fd: int, io: IOEngine) -> SketchScorer:
    """The SketchScorer described by a ScorerClient config (also used for the host fallback)."""
    return SketchScorer(
        fd,
        RecordLayout(**config["layout"]),
        SketchFormat(**config["format"]),
        channel,
        config["aggregation"],
        config["block_tokens"],
        io,
        memory_budget=config["memory_budget"],
        crash_after_blocks=config.get("crash_after_blocks", -1),
        stored=StoredSketches(config["stored"]) if config.get("stored") else None,
    )


def serve(config: dict) -> None:
    channel = Channel(ChannelSpec(**config["channel"]), config["channel_fd"])
    requests, responses = config["request_fd"], config["response_fd"]
    fd, _ = open_for_reading(config["sketch_path"])
    with IOEngine(config["io_threads"]) as io:
        scorer = build_scorer(config, channel, fd, io)
        os.write(responses, RESPONSE.pack(0, STATUS_OK))
        while True:
            message = read_exact(requests, REQUEST.size)
            if not message:
                return
            request_id, layer, op = REQUEST.unpack(message)
            if op == OP_STOP:
                return
            try:
                scorer.score_layer(layer)
                status = STATUS_OK
            except Exception:  # reported to the host, which scores this layer itself
                traceback.print_exc(file=sys.stderr)
                status = STATUS_FAILED
            os.write(responses, RESPONSE.pack(request_id, status))
            _prepare_next(scorer, (layer + 1) % channel.spec.layers)


def _prepare_next(scorer: SketchScorer, layer: int) -> None:
    """Read the next layer's sketches while the host computes up to its attention."""
    try:
        scorer.prepare(layer)
    except Exception:  # the request for that layer reads again and reports its own failure
        traceback.print_exc(file=sys.stderr)


if __name__ == "__main__":
    serve(json.loads(sys.argv[1]))
