"""Clients that go away before their first token: queued or prefilling, their requests are aborted there.

The server runs one engine sequence at a time (max_num_seqs=1), so a second request, paged or
tiered, waits in the engine's queue. Each test closes a real connection (httpx) early, then checks
that the request never ran (or stopped in its prefill), that nothing is held (device blocks, swap
slots, a tiered sequence's tiers), and that the server still serves.
"""

import logging
import threading
import time

import httpx
import pytest
from http_server import MODEL, moved, running_server, scrape, settled

pytestmark = pytest.mark.model

# What the request holding the engine (paged, or tiered: ~10x slower a token) generates meanwhile: seconds of work.
PAGED_HOLDER_TOKENS, TIERED_HOLDER_TOKENS = 200, 60


@pytest.fixture(scope="module")
def server(llm, tmp_path_factory):
    with running_server(llm, tmp_path_factory.mktemp("disconnect"), sparse=True, device_blocks=24, swap="flash",
                        swap_space="16MiB", max_num_seqs=1) as (thread, backend):
        yield thread.url, backend


@pytest.fixture
def server_errors():
    """ERROR records uvicorn logs while the test runs (an exception escaping a request handler)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append
    logger = logging.getLogger("uvicorn.error")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def body(prompt: str, max_tokens: int, stream: bool) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}


def wait_for(url: str, name: str, path: str, value: int) -> dict:
    for _ in range(1200):
        metrics = scrape(url)
        if metrics[(name, (("path", path),))] == value:
            return metrics
        time.sleep(0.05)
    raise AssertionError(f"{name}{{path={path}}} never reached {value}")


def in_background(url: str, prompt: str, tokens: int) -> tuple[threading.Thread, list]:
    """A request that keeps its path busy for `tokens` tokens; its reply lands in the list."""
    replies: list = []
    thread = threading.Thread(target=lambda: replies.append(
        httpx.post(url + "/v1/completions", json=body(prompt, tokens, False), timeout=600).json()))
    thread.start()
    return thread, replies


def leave_while_queued(url: str, prompt: str, path: str) -> None:
    """A streamed request and a whole-answer one, each closed by its client while it waits in `path`'s queue."""
    with httpx.stream("POST", url + "/v1/completions", json=body(prompt, 50, True), timeout=600) as response:
        assert response.status_code == 200  # headers sent, no token yet
        wait_for(url, "kvtier:num_requests_waiting", path, 1)
    wait_for(url, "kvtier:num_requests_waiting", path, 0)
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(url + "/v1/completions", json=body(prompt, 50, False), timeout=1.5)
    wait_for(url, "kvtier:num_requests_waiting", path, 0)


def test_paged_requests_whose_clients_leave_in_the_queue_never_run(server, server_errors):
    url, backend = server
    before, forwarded = scrape(url), backend.engine.forward_tokens
    holder, replies = in_background(url, "Tell me about lighthouses.", PAGED_HOLDER_TOKENS)
    wait_for(url, "kvtier:num_requests_running", "paged", 1)
    leave_while_queued(url, "Tell me about ships.", "paged")
    holder.join()
    after = settled(url)
    usage = replies[0]["usage"]
    assert usage["completion_tokens"] == PAGED_HOLDER_TOKENS
    # Only the holder went through the model: its prompt, then one step per token after the first.
    assert backend.engine.forward_tokens - forwarded == usage["prompt_tokens"] + PAGED_HOLDER_TOKENS - 1
    assert moved(before, after, "kvtier:requests_total", path="paged") == 3
    assert moved(before, after, "kvtier:request_success_total", finished_reason="abort") == 2
    assert moved(before, after, "kvtier:request_success_total", finished_reason="length") == 1
    assert after[("kvtier:device_blocks_free", ())] == after[("kvtier:device_blocks_total", ())] == 24
    assert after[("kvtier:swap_slots_used", ())] == 0
    assert not server_errors  # a whole-answer client leaving is no server error
    reply = httpx.post(url + "/v1/completions", json=body("Hello", 3, False), timeout=600).json()
    assert reply["usage"]["completion_tokens"] == 3


def test_tiered_requests_whose_clients_leave_in_the_queue_never_run(server, server_errors):
    url, backend = server
    store = backend.engine.tiers.provider.store
    before, stored = scrape(url), len(store.entries())
    holder, replies = in_background(url, "The tide rises over the old harbour wall every evening. " * 40,
                                    TIERED_HOLDER_TOKENS)
    wait_for(url, "kvtier:num_requests_running", "tiered", 1)
    leave_while_queued(url, "Gulls circle the fishing boats as they come home at dusk. " * 40, "tiered")
    holder.join()
    after = settled(url)
    assert replies[0]["usage"]["completion_tokens"] == TIERED_HOLDER_TOKENS
    assert moved(before, after, "kvtier:requests_total", path="tiered") == 3
    assert moved(before, after, "kvtier:tiered_requests_total") == 1  # the queued two never started
    assert len(store.entries()) == stored + 1  # only the holder's prompt was prefilled and stored
    assert moved(before, after, "kvtier:request_success_total", finished_reason="abort") == 2
    assert not server_errors


def test_a_client_that_leaves_during_a_long_tiered_prefill_stops_it_there(server):
    url, backend = server
    store = backend.engine.tiers.provider.store
    before, stored = scrape(url), len(store.entries())
    prompt = "Every harbour light has a keeper and a logbook. " * 600  # ~6000 tokens: prefilled in many chunks
    with httpx.stream("POST", url + "/v1/completions", json=body(prompt, 50, True), timeout=600) as response:
        assert response.status_code == 200
        wait_for(url, "kvtier:num_requests_running", "tiered", 1)
    after = wait_for(url, "kvtier:num_requests_running", "tiered", 0)
    assert moved(before, after, "kvtier:generation_tokens_total") == 0  # no token: it ended in the prefill
    assert len(store.entries()) == stored  # a prompt whose prefill did not finish is not stored
    assert moved(before, after, "kvtier:request_success_total", finished_reason="abort") == 1
    assert all(after[("kvtier:kv_bytes", (("path", "tiered"), ("tier", tier)))] == 0
               for tier in ("device", "host", "storage"))
    assert after[("kvtier:device_blocks_free", ())] == after[("kvtier:device_blocks_total", ())]
    reply = httpx.post(url + "/v1/completions", json=body("Sails on the horizon, far out at sea. " * 60, 3, False),
                       timeout=600).json()
    assert reply["usage"]["completion_tokens"] == 3
    assert moved(after, scrape(url), "kvtier:tiered_requests_total") == 1  # the next long one is served
