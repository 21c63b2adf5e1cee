"""The long-documents workload of `kvtier bench http` (documents_bench.py runs it): its sizes and budgets.

Apart from the benchmark, which imports the server and torch, so that the command line reads its defaults
and checks its options at once.
"""

from __future__ import annotations

from dataclasses import dataclass

WORKLOADS = ("short", "documents")


@dataclass(frozen=True)
class DocumentsWorkload:
    """Stored documents, two questions each, streamed at once. The default budgets hold about a third of the
    questions' KV for smollm2-135m (8 x 8K tokens): the device window reservations and 112 MiB of host per
    tiered sequence."""

    documents: int = 4
    document_tokens: int = 8000
    new_tokens: int = 64
    device_kv_budget: str = "64MiB"
    host_kv_budget: str = "448MiB"
    max_tiered_seqs: int = 4
    repeats: int = 2
    tiered_slice: int = 16  # the "sliced" server's --tiered-slice
