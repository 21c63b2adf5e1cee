"""End-to-end mechanics on a tiny random Llama: outputs never depend on where the KV went."""

import os

import pytest
import serve_pressure
import torch
from serve_pressure import LONG, PRESSURE

from kvtier.errors import ConfigError
from kvtier.engine.serving_engine import EngineConfig, LLMEngine
from kvtier.engine.sequence import SamplingParams

BLOCK = 16


@pytest.fixture(scope="module")
def short_prompts() -> list[list[int]]:
    return serve_pressure.short_prompts()


@pytest.fixture(scope="module")
def reference(tiny_llama, short_prompts, run_engine) -> list[list[int]]:
    outputs, engine = run_engine(tiny_llama, short_prompts, LONG, device_blocks=64, swap="recompute")
    assert engine.stats()["scheduler"]["preemptions"] == 0
    return outputs


def test_unpressured_engine_matches_transformers_generate(tiny_llama, short_prompts, reference):
    for prompt, output in zip(short_prompts[:3], reference):
        expected = tiny_llama.generate(torch.tensor([prompt]), max_new_tokens=60, min_new_tokens=60,
                                       do_sample=False)[0, len(prompt):].tolist()
        assert output == expected


def test_flash_and_dram_swapping_give_identical_outputs_and_swaps(tiny_llama, run_engine, short_prompts, reference,
                                                                  tmp_path):
    flash, flash_engine = run_engine(tiny_llama, short_prompts, LONG, swap="flash",
                                     flash_path=str(tmp_path / "f.kvc"), **PRESSURE)
    dram, dram_engine = run_engine(tiny_llama, short_prompts, LONG, swap="dram", **PRESSURE)
    assert flash == dram == reference
    flash_stats, dram_stats = flash_engine.stats(), dram_engine.stats()
    assert flash_stats["scheduler"]["swap_outs"] >= 8
    assert flash_stats["scheduler"] == dram_stats["scheduler"]
    assert flash_stats["scheduler"]["recomputes"] == 0
    assert flash_stats["swap"]["out_blocks"] == dram_stats["swap"]["out_blocks"] > 0
    assert flash_stats["swap"]["sequential_share"] == 1.0
    assert sum(output.swap_outs for output in flash_engine.outputs) == flash_stats["scheduler"]["swap_outs"]
    assert not any(output.warnings for output in flash_engine.outputs)


def test_recompute_only_preemption_gives_identical_outputs(tiny_llama, run_engine, short_prompts, reference):
    outputs, engine = run_engine(tiny_llama, short_prompts, LONG, swap="recompute", device_blocks=8)
    assert outputs == reference
    assert engine.stats()["scheduler"]["recomputes"] >= 5


def test_full_flash_falls_back_to_recompute(tiny_llama, run_engine, short_prompts, reference, tmp_path):
    # 4 slots: most victims do not fit, some do.
    outputs, engine = run_engine(tiny_llama, short_prompts, LONG, swap="flash", flash_path=str(tmp_path / "f.kvc"),
                                 device_blocks=8, swap_space=str(4 * 4 * 4096), segment_slots=2)
    stats = engine.stats()["scheduler"]
    assert outputs == reference
    assert stats["swap_full_fallbacks"] > 0 and stats["recomputes"] == stats["swap_full_fallbacks"]


def test_a_corrupted_flash_block_is_recomputed_and_reported(tiny_llama, short_prompts, reference, tmp_path):
    path = str(tmp_path / "f.kvc")
    engine = LLMEngine(tiny_llama, EngineConfig(block_tokens=BLOCK, max_batched_tokens=64, segment_slots=4,
                                                io_threads=2, swap="flash", flash_path=path, **PRESSURE))
    with engine:
        ids = [engine.add_request(prompt, LONG) for prompt in short_prompts]
        done = {}
        corrupted = None
        while engine.has_unfinished():
            if corrupted is None and engine.scheduler.swapped:
                victim = engine.scheduler.swapped[0]
                corrupted = victim.request_id
                with open(path, "r+b") as raw:
                    raw.seek(engine.swap.file.layout.offset(0, 0, victim.swap_slots[0]))
                    raw.write(os.urandom(256))
            done.update((output.request_id, output) for output in engine.step())
    assert corrupted is not None
    assert [done[i].token_ids for i in ids] == reference
    assert engine.stats()["scheduler"]["checksum_failures"] == 1
    assert any("checksum mismatch" in warning for warning in done[corrupted].warnings)
    assert done[corrupted].recomputes >= 1


def test_a_request_larger_than_the_pool_is_refused_up_front(tiny_llama):
    with LLMEngine(tiny_llama, EngineConfig(block_tokens=BLOCK, device_blocks=2, swap="recompute")) as engine:
        with pytest.raises(ConfigError, match="pool has 2"):
            engine.add_request(list(range(30)), SamplingParams(max_new_tokens=10))


def test_text_prompts_need_a_tokenizer(tiny_llama):
    with LLMEngine(tiny_llama, EngineConfig(block_tokens=BLOCK, device_blocks=4, swap="recompute")) as engine:
        with pytest.raises(ConfigError, match="no tokenizer"):
            engine.add_request("hello")


def test_the_model_gets_its_attention_back_on_close(tiny_llama):
    before = tiny_llama.config._attn_implementation
    LLMEngine(tiny_llama, EngineConfig(block_tokens=BLOCK, device_blocks=4, swap="recompute")).close()
    assert tiny_llama.config._attn_implementation == before


def test_sliding_window_layers_stay_correct(tiny_gemma3, run_engine, short_prompts):
    sampling = SamplingParams(max_new_tokens=24, ignore_eos=True)
    outputs, _ = run_engine(tiny_gemma3, short_prompts[:3], sampling, device_blocks=32, swap="recompute")
    for prompt, output in zip(short_prompts[:3], outputs):
        expected = tiny_gemma3.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24,
                                        do_sample=False)[0, len(prompt):].tolist()
        assert output == expected


def test_step_events_report_every_token_of_every_request_once(tiny_llama, short_prompts, reference):
    with LLMEngine(tiny_llama, EngineConfig(block_tokens=BLOCK, max_batched_tokens=64, io_threads=2,
                                            swap="dram", **PRESSURE)) as engine:
        ids = [engine.add_request(prompt, LONG) for prompt in short_prompts]
        streamed: dict[int, list[int]] = {request_id: [] for request_id in ids}
        finished = {}
        while engine.has_unfinished():
            for event in engine.step_events():
                streamed[event.request_id].append(event.token_id)
                if event.output is not None:
                    finished[event.request_id] = event.output.token_ids
    assert [streamed[request_id] for request_id in ids] == [finished[request_id] for request_id in ids] == reference


@pytest.mark.parametrize("swap", ["flash", "dram"])
def test_aborting_requests_in_every_state_frees_their_blocks_and_slots(tiny_llama, short_prompts, swap, flash_path):
    config = EngineConfig(block_tokens=BLOCK, max_batched_tokens=64, segment_slots=4, io_threads=2, swap=swap,
                          flash_path=flash_path, **PRESSURE)
    with LLMEngine(tiny_llama, config) as engine:
        ids = [engine.add_request(prompt, LONG) for prompt in short_prompts]
        aborted: dict[str, int] = {}
        while engine.has_unfinished() and len(aborted) < 4:
            engine.step()
            for seq in list(engine._sequences.values()):
                state = seq.status.value
                if state not in aborted:
                    aborted[state] = seq.request_id
                    output = engine.abort(seq.request_id)
                    assert output.finish_reason == "abort" and output.token_ids == seq.output_ids
        assert set(aborted) == {"waiting", "running", "swapping_out", "swapped"}
        assert engine.abort(aborted["running"]) is None  # a second abort is a no-op
        finished = []
        while engine.has_unfinished():
            finished += engine.step()
        assert sorted([output.request_id for output in finished] + list(aborted.values())) == ids
        assert engine.block_manager.num_free == engine.block_manager.num_blocks
        assert engine.swap.allocator.live == 0


def test_a_seeded_sampled_request_repeats_and_differs_from_greedy(tiny_llama, short_prompts, reference, run_engine):
    sampled = SamplingParams(max_new_tokens=60, ignore_eos=True, temperature=1.5, top_p=0.9, seed=7)
    first, _ = run_engine(tiny_llama, short_prompts[:2], sampled, device_blocks=64, swap="recompute")
    again, _ = run_engine(tiny_llama, short_prompts[:2], sampled, device_blocks=64, swap="recompute")
    assert first == again
    assert first != reference[:2]
