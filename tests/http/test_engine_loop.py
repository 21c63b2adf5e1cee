"""The engine on its own thread: tokens reach asyncio in order, aborts and shutdown free everything."""

import asyncio

import pytest
import serve_pressure
import tiny_models
from serve_pressure import LONG, PRESSURE

from kvtier.engine.serving_engine import EngineConfig, LLMEngine
from kvtier.http.engine_loop import EngineLoop
from kvtier.http.token_stream import Finished, TokenStream


@pytest.fixture(scope="module")
def model():
    return tiny_models.tiny_llama(head_dim=16, initializer_range=0.5, tie_word_embeddings=False)


def engine(model, tmp_path) -> LLMEngine:
    return LLMEngine(model, EngineConfig(block_tokens=16, max_batched_tokens=64, io_threads=2, swap="flash",
                                         flash_path=str(tmp_path / "f.kvc"), **PRESSURE))


def submit_all(loop: EngineLoop, prompts) -> list[TokenStream]:
    """One stream per prompt, each submitted to `loop` (called inside the running event loop)."""
    streams = [TokenStream(asyncio.get_running_loop()) for _ in prompts]
    for prompt, stream in zip(prompts, streams):
        loop.submit(prompt, LONG, stream)
    return streams


async def drain(stream: TokenStream) -> tuple[list[int], Finished]:
    tokens = []
    while not isinstance(item := await stream.get(), Finished):
        tokens.append(item.token_id)
    return tokens, item


def test_streams_get_every_token_then_the_finish_reason(model, tmp_path):
    prompts = serve_pressure.short_prompts()
    with LLMEngine(model, EngineConfig(block_tokens=16, device_blocks=64, swap="recompute")) as offline:
        expected = [output.token_ids for output in offline.generate(prompts, LONG)]
    served = engine(model, tmp_path)
    loop = EngineLoop(served)

    async def run():
        streams = submit_all(loop, prompts)
        return await asyncio.gather(*(drain(stream) for stream in streams))

    try:
        results = asyncio.run(run())
    finally:
        loop.stop()
        served.close()
    assert [tokens for tokens, _ in results] == expected
    assert {finished.reason for _, finished in results} == {"length"}
    assert loop.snapshot.swap_outs > 0 and loop.snapshot.device_blocks_free == loop.snapshot.device_blocks


def test_an_aborted_stream_ends_with_abort_and_stop_fails_the_rest(model, tmp_path):
    prompts = serve_pressure.short_prompts()
    served = engine(model, tmp_path)
    loop = EngineLoop(served)

    async def run():
        streams = submit_all(loop, prompts)
        first = await streams[0].get()
        streams[0].cancel()
        loop.abort(streams[0])
        aborted = await drain(streams[0])
        await asyncio.to_thread(loop.stop)  # the others are still generating
        return first, aborted, await asyncio.gather(*(drain(stream) for stream in streams[1:]))

    try:
        first, (_, aborted), rest = asyncio.run(run())
    finally:
        served.close()
    assert isinstance(first.token_id, int) and aborted == Finished("abort")
    assert all(finished == Finished("abort", "the server is shutting down") for _, finished in rest)
    assert all(len(tokens) < LONG.max_new_tokens for tokens, _ in rest)
    assert loop.snapshot.device_blocks_free == loop.snapshot.device_blocks and loop.snapshot.swap_slots_live == 0
