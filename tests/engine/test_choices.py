"""Several choices per request (n, best_of) forked over shared blocks, and sampling that survives preemption."""

import dataclasses

import pytest
import serve_pressure
import torch
from serve_pressure import PRESSURE

from kvtier.engine.block_manager import blocks_for
from kvtier.engine.serving_engine import EngineConfig, LLMEngine
from kvtier.engine.sequence import SamplingParams

BLOCK = 16
PROMPT = list(range(3, 43))  # 40 tokens: two whole blocks and a shared partial one
SAMPLED = SamplingParams(max_new_tokens=40, ignore_eos=True, temperature=2.0, seed=5)
# every logits processor and sampling limit at once
PROCESSED = dataclasses.replace(SAMPLED, top_k=20, min_p=0.02, top_p=0.95, repetition_penalty=1.3,
                                presence_penalty=0.4, frequency_penalty=0.2, logit_bias={7: 2.0}, min_tokens=3)


def engine(model, **config) -> LLMEngine:
    return LLMEngine(model, EngineConfig(**({"block_tokens": BLOCK, "max_batched_tokens": 64, "io_threads": 2,
                                             "segment_slots": 4, "device_blocks": 64, "swap": "recompute"} | config)))


def used(engine: LLMEngine) -> int:
    return engine.block_manager.num_blocks - engine.block_manager.num_free


def test_two_choices_hold_one_prompts_blocks_until_they_write_and_sample_as_two_seeded_requests(tiny_llama,
                                                                                                 run_engine):
    prompt_blocks = blocks_for(len(PROMPT), BLOCK)
    with engine(tiny_llama) as llm:
        request = llm.add_request(PROMPT, dataclasses.replace(SAMPLED, n=2))
        first = llm.step_events()
        assert [(event.request_id, event.index) for event in first] == [(request, 0), (request, 1)]
        tables = [seq.block_table for seq in llm._sequences.values()]
        assert tables[0] == tables[1] and used(llm) == prompt_blocks  # one prompt's worth for both
        llm.step_events()  # each writes its first token into the prompt's last block: one copies it
        tables = [seq.block_table for seq in llm._sequences.values()]
        assert tables[0][:2] == tables[1][:2] and tables[0][2] != tables[1][2]
        assert used(llm) == prompt_blocks + 1
        outputs = []
        while llm.has_unfinished():
            outputs += llm.step()
        assert used(llm) == 0
    outputs = sorted(outputs, key=lambda output: output.index)
    separate = [run_engine(tiny_llama, [PROMPT], dataclasses.replace(SAMPLED, seed=seed), device_blocks=64,
                           swap="recompute")[0][0] for seed in (5, 6)]
    assert [first[0].token_id] + outputs[0].token_ids[1:] == separate[0]
    assert [output.token_ids for output in outputs] == separate
    assert separate[0] != separate[1]


@pytest.mark.parametrize("swap", ["flash", "dram", "recompute"])
def test_choices_under_preemption_give_what_separate_unpressured_requests_give(tiny_llama, run_engine, swap,
                                                                              flash_path):
    prompts = serve_pressure.short_prompts()[:4]
    forked, llm = run_engine(tiny_llama, prompts, dataclasses.replace(PROCESSED, n=2), swap=swap,
                             flash_path=flash_path, **PRESSURE)
    assert llm.stats()["scheduler"]["preemptions"] >= 4
    separate = []
    for prompt in prompts:
        for seed in (5, 6):
            separate += run_engine(tiny_llama, [prompt], dataclasses.replace(PROCESSED, seed=seed), device_blocks=64,
                                   swap="recompute")[0]
    assert forked == separate
    assert [output.index for output in llm.outputs] == [0, 1] * 4


def test_penalties_cut_repeats_and_a_preempted_sampled_sequence_continues_identically(tiny_llama, run_engine,
                                                                                     flash_path):
    prompts = serve_pressure.short_prompts()
    calm, _ = run_engine(tiny_llama, prompts, PROCESSED, device_blocks=64, swap="recompute")
    pressed, llm = run_engine(tiny_llama, prompts, PROCESSED, swap="flash", flash_path=flash_path, **PRESSURE)
    assert llm.stats()["scheduler"]["swap_outs"] >= 4
    assert pressed == calm
    greedy = dataclasses.replace(SamplingParams(max_new_tokens=40, ignore_eos=True))
    plain, _ = run_engine(tiny_llama, prompts, greedy, device_blocks=64, swap="recompute")
    penalized, _ = run_engine(tiny_llama, prompts, dataclasses.replace(greedy, repetition_penalty=3.0),
                              device_blocks=64, swap="recompute")
    assert sum(len(set(out)) for out in penalized) > sum(len(set(out)) for out in plain)  # fewer repeats


def test_prompt_logprobs_match_the_models_log_softmax_over_chunked_and_recomputed_prefills(tiny_llama, run_engine):
    prompts = [list(range(5, 85)), serve_pressure.short_prompts()[0]]  # 80 tokens: two 64-token chunks
    sampling = SamplingParams(max_new_tokens=30, ignore_eos=True, prompt_logprobs=2, logprobs=1)
    with engine(tiny_llama, device_blocks=8, max_batched_tokens=64) as llm:
        ids = [llm.add_request(prompt, sampling) for prompt in prompts]
        firsts, outputs = {}, {}
        while llm.has_unfinished():
            for event in llm.step_events():
                if event.prompt_logprobs is not None:
                    firsts[event.request_id] = event.prompt_logprobs
                if event.output is not None:
                    outputs[event.request_id] = event.output
        assert llm.stats()["scheduler"]["recomputes"] >= 1
    for request, prompt in zip(ids, prompts):
        with torch.no_grad():
            expected = torch.log_softmax(tiny_llama(torch.tensor([prompt])).logits[0].float(), dim=-1)
        entries = firsts[request]
        assert [entry.token_id for entry in entries] == prompt[1:]
        for position, entry in enumerate(entries):
            assert entry.logprob == pytest.approx(float(expected[position, prompt[position + 1]]), abs=1e-4)
            assert [token for token, _ in entry.top] == expected[position].topk(2).indices.tolist()
        assert outputs[request].cumulative_logprob is not None


def test_best_of_generates_every_candidate_with_its_cumulative_logprob(tiny_llama):
    with engine(tiny_llama) as llm:
        request = llm.add_request(PROMPT, dataclasses.replace(SAMPLED, max_new_tokens=8, n=1, best_of=3))
        logprobs: dict[int, float] = {}
        outputs = []
        while llm.has_unfinished():
            for event in llm.step_events():
                assert event.logprobs is not None  # ranking needs them, asked for or not
                logprobs[event.index] = logprobs.get(event.index, 0.0) + event.logprobs.logprob
                outputs += [event.output] if event.output else []
    assert sorted(output.index for output in outputs) == [0, 1, 2]
    assert {output.request_id for output in outputs} == {request}
    for output in outputs:
        assert output.cumulative_logprob == pytest.approx(logprobs[output.index])


def test_aborting_a_request_ends_every_choice_and_frees_shared_blocks(tiny_llama):
    with engine(tiny_llama) as llm:
        request = llm.add_request(PROMPT, dataclasses.replace(SAMPLED, n=3))
        llm.step_events()
        llm.step_events()
        assert len(llm._sequences) == 3
        assert llm.abort(request).finish_reason == "abort"
        assert not llm.has_unfinished() and used(llm) == 0
