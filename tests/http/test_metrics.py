"""/metrics parsed by prometheus-client's own parser: the counters move as requests run."""

import asyncio

import openai
import pytest
from http_server import MODEL, moved, running_server, scrape

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def server(llm, tmp_path_factory):
    # 7 blocks of 16 tokens: two chat prompts (3 blocks each) fit, but not their growth into a 4th block.
    with running_server(llm, tmp_path_factory.mktemp("metrics"), device_blocks=7, swap="flash",
                        swap_space="16MiB") as (thread, _):
        yield thread


def test_token_and_latency_metrics_count_each_request(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    before = scrape(server.url)
    stream = client.completions.create(model=MODEL, prompt="Count: one, two, three,", max_tokens=8, temperature=0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    usage = [chunk.usage for chunk in stream if chunk.usage][0]
    after = scrape(server.url)
    assert moved(before, after, "kvtier:prompt_tokens_total") == usage.prompt_tokens
    assert moved(before, after, "kvtier:generation_tokens_total") == usage.completion_tokens == 8
    assert moved(before, after, "kvtier:requests_total", path="paged") == 1
    assert moved(before, after, "kvtier:request_success_total", finished_reason="length") == 1
    assert moved(before, after, "kvtier:time_to_first_token_seconds_count") == 1
    assert moved(before, after, "kvtier:inter_token_latency_seconds_count") == 7
    assert moved(before, after, "kvtier:e2e_request_latency_seconds_count") == 1
    assert moved(before, after, "kvtier:time_to_first_token_seconds_sum") > 0


def test_swap_metrics_move_under_pressure_and_everything_returns_afterwards(server):
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)

    async def ask(number: int):
        return await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Write a line about the number {number}."}],
            max_tokens=24, temperature=0, extra_body={"ignore_eos": True})

    async def ask_all():
        return await asyncio.gather(*(ask(number) for number in range(4)))

    before = scrape(server.url)
    replies = asyncio.run(ask_all())
    after = scrape(server.url)
    assert [reply.usage.completion_tokens for reply in replies] == [24] * 4
    assert moved(before, after, "kvtier:swap_outs_total") > 0
    assert moved(before, after, "kvtier:swap_ins_total") == moved(before, after, "kvtier:swap_outs_total")
    assert moved(before, after, "kvtier:swap_out_bytes_total") > 0
    assert moved(before, after, "kvtier:swap_in_bytes_total") == moved(before, after, "kvtier:swap_out_bytes_total")
    assert moved(before, after, "kvtier:preemptions_total") > 0
    # Everything is back: no request queued, every device block free, no swap slot held.
    assert after[("kvtier:device_blocks_free", ())] == after[("kvtier:device_blocks_total", ())] == 7
    assert after[("kvtier:swap_slots_used", ())] == 0
    assert all(after[("kvtier:kv_bytes", (("path", path), ("tier", tier)))] == 0
               for path, tier in (("paged", "device"), ("paged", "flash"), ("tiered", "device"), ("tiered", "host"),
                                  ("tiered", "storage")))
    for name in ("kvtier:num_requests_running", "kvtier:num_requests_waiting"):
        assert after[(name, (("path", "paged"),))] == 0
    assert after[("kvtier:flash_file_bytes", ())] >= 15 << 20  # the file holds the 16 MiB of slots
    assert ("kvtier:tiered_cold_read_bytes_total", ()) in after and ("kvtier:tiered_scorer_restarts_total", ()) in after
    assert ("kvtier:tiered_guard_events_total", ()) in after
    assert ("kvtier:tiered_attention_mass_kept_count", ()) in after
    assert moved(before, after, "kvtier:request_queue_time_seconds_count") == 4  # each request's wait, once
