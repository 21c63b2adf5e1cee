"""A tiered request's response reports what its sparse selection kept (`attention_budget`), read through the real
`openai` client and checked against /metrics' count of the same decode steps; a paged one carries nothing new."""

import openai
import pytest
from http_server import MODEL, moved, running_server, scrape

from kvtier.http.attention_budget import BudgetUpdate, RequestBudget
from kvtier.sparse.stats import BudgetTotals

LONG = [{"role": "user", "content": "Paris is the capital of France. " * 60 + "\nWhat is the capital of France? "
         "Answer in one word."}]  # ~460 tokens: beyond the pool, a tiered sequence
SHORT = [{"role": "user", "content": "What is the capital of France?"}]
TOKENS = 8  # with ignore_eos: the first from the prompt's forward, then 7 sparse decode steps per choice


@pytest.fixture(scope="module")
def server(llm, tmp_path_factory):
    # 24 blocks of 16 tokens: short prompts are paged, LONG is tiered, under the adaptive budget (top-p 0.9).
    with running_server(llm, tmp_path_factory.mktemp("budget"), sparse=True, top_p=0.9, device_blocks=24,
                        swap="recompute") as served:
        yield served


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0].url + "/v1", api_key="none", max_retries=0)


def test_a_requests_figure_adds_each_choices_latest_sums():
    budget = RequestBudget()
    assert budget.report() == {"mass_kept_mean": None, "mass_kept_min": None, "attended_share": None,
                               "guard_events": 0}  # no sparse decode step yet
    budget.update(BudgetUpdate(0, BudgetTotals(1.8, 2, 0.85, 10, 40, 1)))
    budget.update(BudgetUpdate(1, BudgetTotals(0.5, 1, 0.5, 1, 10, 0)))
    budget.update(BudgetUpdate(1, BudgetTotals(2.4, 3, 0.7, 6, 60, 0)))  # choice 1 later: its sums so far
    assert budget.report() == {"mass_kept_mean": pytest.approx(4.2 / 5), "mass_kept_min": 0.7,
                               "attended_share": pytest.approx(16 / 100), "guard_events": 1}


def assert_counted(budget: dict, before: dict, after: dict, steps: int) -> None:
    """`budget` is the decode steps /metrics counted between `before` and `after`: `steps` of them, each the mean
    over the same layers (so the mean of their means is the mean over every layer step)."""
    assert moved(before, after, "kvtier:tiered_attention_mass_kept_count") == steps
    mean = moved(before, after, "kvtier:tiered_attention_mass_kept_sum") / steps
    assert budget["mass_kept_mean"] == pytest.approx(mean, rel=1e-6)
    assert 0 < budget["mass_kept_min"] <= budget["mass_kept_mean"] <= 1 + 1e-6
    assert budget["guard_events"] == moved(before, after, "kvtier:tiered_guard_events_total")
    assert 0.02 <= budget["attended_share"] <= 0.3 or budget["guard_events"]  # floor and ceiling, unless guarded


@pytest.mark.model
def test_a_tiered_answer_reports_the_mass_its_decode_steps_kept(client, server):
    before = scrape(server[0].url)
    reply = client.chat.completions.create(model=MODEL, messages=LONG, max_tokens=TOKENS, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == TOKENS
    assert_counted(reply.attention_budget, before, scrape(server[0].url), TOKENS - 1)


@pytest.mark.model
def test_a_streamed_tiered_answer_reports_every_choice_in_its_usage_chunk(client, server):
    before = scrape(server[0].url)
    chunks = list(client.chat.completions.create(model=MODEL, messages=LONG, max_tokens=TOKENS, temperature=1.0,
                                                 seed=5, n=2, stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    carrying = [chunk for chunk in chunks if "attention_budget" in chunk.model_dump()]
    assert carrying == [chunks[-1]] and chunks[-1].usage.completion_tokens == 2 * TOKENS
    assert_counted(chunks[-1].attention_budget, before, scrape(server[0].url), 2 * (TOKENS - 1))


@pytest.mark.model
def test_without_usage_the_chunk_that_ends_the_answer_carries_it(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=LONG, max_tokens=TOKENS, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True}))
    carrying = [chunk for chunk in chunks if "attention_budget" in chunk.model_dump()]
    assert carrying == [chunks[-1]] and chunks[-1].choices[0].finish_reason == "length"
    assert 0 < chunks[-1].attention_budget["mass_kept_mean"] <= 1 + 1e-6


@pytest.mark.model
def test_a_paged_answer_carries_nothing_new(client):
    reply = client.chat.completions.create(model=MODEL, messages=SHORT, max_tokens=4, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt="One, two,", max_tokens=4, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "attention_budget" not in reply.model_dump()
    assert not any("attention_budget" in chunk.model_dump() for chunk in chunks)
