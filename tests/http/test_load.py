"""A bounded load test on loopback: 64 concurrent streaming requests with a device pool small enough to swap.

Every request completes exactly once with the greedy text the offline engine (`kvtier batch`'s)
gives for the same prompt; afterwards every device block and swap slot is free again. Then 8 of 64
concurrent clients disconnect mid-stream: their sequences are aborted and nothing leaks.
"""

import asyncio

import openai
import pytest
from http_server import MODEL, moved, running_server, scrape, settled

from kvtier.engine.serving_engine import EngineConfig, LLMEngine
from kvtier.engine.sequence import SamplingParams

pytestmark = pytest.mark.model

CLIENTS = 64
NEW_TOKENS = 8
LEAVING = 8  # clients that disconnect mid-stream in the second test
LEAVER_TOKENS = 200  # what a leaving client asks for: far more than it waits for (and within the pool)
TIME_LIMIT_S = 600  # bound on each burst: a hang fails the test instead of stalling the suite
# Chat prompts of ~40 tokens take 3 blocks of 16 and grow into a 4th; 16 blocks hold four of them.
ENGINE = {"device_blocks": 16, "swap": "flash", "swap_space": "64MiB", "max_num_seqs": 32, "max_batched_tokens": 256}
PROMPTS = [f"In one short sentence, what is special about the number {number}?" for number in range(CLIENTS)]


@pytest.fixture(scope="module")
def offline(llm, tmp_path_factory):
    """The offline engine's greedy texts for PROMPTS under the same pool and swap settings (before any server)."""
    config = EngineConfig(block_tokens=16, io_threads=2, flash_path=str(tmp_path_factory.mktemp("offline") / "f.kvc"),
                          **ENGINE)
    with LLMEngine.from_llm(llm, config) as engine:
        outputs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    return [output.text for output in outputs]


@pytest.fixture(scope="module")
def server(llm, offline, tmp_path_factory):
    with running_server(llm, tmp_path_factory.mktemp("load"), **ENGINE) as (thread, _):
        yield thread


async def stream_chat(client: openai.AsyncOpenAI, prompt: str, max_tokens: int, leave_after: int | None = None):
    """(id, text, finish reasons seen, usage) of one streamed chat; `leave_after` chunks, then disconnect."""
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    ids, text, reasons, usage = set(), [], [], None
    async for chunk in stream:
        ids.add(chunk.id)
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            reasons += [choice.finish_reason] if choice.finish_reason else []
        usage = chunk.usage or usage
        if leave_after is not None and len(text) >= leave_after:
            await stream.close()  # the client goes away mid-stream
            break
    return ids, "".join(text), reasons, usage


def burst(url: str, leavers: int = 0):
    """All CLIENTS requests at once; the first `leavers` disconnect after two chunks."""
    async def run():
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                                      timeout=TIME_LIMIT_S) as client:
            return await asyncio.wait_for(asyncio.gather(*(
                stream_chat(client, prompt, LEAVER_TOKENS, leave_after=2) if number < leavers
                else stream_chat(client, prompt, NEW_TOKENS) for number, prompt in enumerate(PROMPTS))), TIME_LIMIT_S)

    return asyncio.run(run())


def assert_nothing_held(metrics: dict) -> None:
    assert metrics[("kvtier:device_blocks_free", ())] == metrics[("kvtier:device_blocks_total", ())] == 16
    assert metrics[("kvtier:swap_slots_used", ())] == 0


def test_64_concurrent_streams_complete_once_with_the_offline_engines_outputs(server, offline):
    before = scrape(server.url)
    results = burst(server.url)
    after = settled(server.url)
    ids = [next(iter(chunk_ids)) for chunk_ids, *_ in results]
    assert all(len(chunk_ids) == 1 for chunk_ids, *_ in results) and len(set(ids)) == CLIENTS  # none mixed up
    assert [reasons for _, _, reasons, _ in results] == [["length"]] * CLIENTS  # each finished exactly once
    assert [usage.completion_tokens for *_, usage in results] == [NEW_TOKENS] * CLIENTS
    assert [text for _, text, _, _ in results] == offline
    assert moved(before, after, "kvtier:swap_outs_total") > 0  # the pool was small enough to swap
    assert moved(before, after, "kvtier:request_success_total", finished_reason="length") == CLIENTS
    assert moved(before, after, "kvtier:generation_tokens_total") == CLIENTS * NEW_TOKENS
    assert_nothing_held(after)


def test_clients_that_disconnect_mid_stream_are_aborted_and_leak_nothing(server, offline):
    before = scrape(server.url)
    results = burst(server.url, leavers=LEAVING)
    after = settled(server.url)
    stayed = results[LEAVING:]
    assert [text for _, text, _, _ in stayed] == offline[LEAVING:]
    assert all(reasons == [] for _, _, reasons, _ in results[:LEAVING])
    # The leavers asked for 200 tokens each; aborted, they generated a small part of that.
    leaver_tokens = moved(before, after, "kvtier:generation_tokens_total") - (CLIENTS - LEAVING) * NEW_TOKENS
    assert LEAVING * 2 <= leaver_tokens < LEAVING * LEAVER_TOKENS / 4
    assert moved(before, after, "kvtier:request_success_total", finished_reason="length") == CLIENTS - LEAVING
    assert_nothing_held(after)
