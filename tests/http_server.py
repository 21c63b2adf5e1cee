"""A real server for the server tests and the load test: smollm2-135m behind uvicorn on 127.0.0.1, on a thread."""

from __future__ import annotations

import time

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvtier.kv_config import KVConfig
from kvtier.engine.serving_engine import EngineConfig
from kvtier.http.app import create_app
from kvtier.http.backend import Backend, ServerSettings, build_backend
from kvtier.http.runner import ServerThread
from kvtier.docstore.document_store import DocumentStore
from kvtier.tiered_kv import SparseTiers

MODEL = "smollm2-135m"


@contextmanager
def running_server(llm, directory: Path, api_key: str | None = None, sparse: bool = False, top_p: float | None = None,
                   **engine: object) -> Iterator[tuple[ServerThread, Backend]]:
    """Serve `llm` with `engine` (EngineConfig fields; flash file under `directory`) until the block ends; `top_p`:
    the tiered sequences' adaptive budget (else alpha 0.2)."""
    # With `sparse`, long prompts are tiered: 4 MiB of host each, so a few hundred tokens already reach the cold pool.
    config = EngineConfig(**({"block_tokens": 16, "io_threads": 2, "flash_path": str(directory / "flash.kvc"),
                              "host_kv_budget": "16MiB", "max_tiered_seqs": 4} | engine))
    tiers = None
    if sparse:
        kv = KVConfig(kv="sparse", storage_dir=str(directory), top_p=top_p)
        tiers = SparseTiers(llm, kv, DocumentStore(directory / "store"))
    backend = build_backend(llm, config, ServerSettings(MODEL, api_key), tiers)
    with ServerThread(create_app(backend), grace_over=backend.fail_unfinished) as server:
        yield server, backend


def scrape(url: str, api_key: str | None = None) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics as {(name, sorted labels): value}."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    text = httpx.get(url + "/metrics", headers=headers).text
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def moved(before: dict, after: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def settled(url: str, api_key: str | None = None) -> dict:
    """The metrics once no request is running, waiting or swapped (aborts land on the engine thread)."""
    for _ in range(600):
        now = scrape(url, api_key)
        busy = sum(value for (name, _), value in now.items()
                   if name in ("kvtier:num_requests_running", "kvtier:num_requests_waiting",
                               "kvtier:num_requests_swapped"))
        if busy == 0:
            return now
        time.sleep(0.1)
    raise AssertionError("the server never went idle")
