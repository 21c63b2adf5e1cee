"""`kvtier bench sparse`'s experiment: decode speed of `--kv sparse` side by side with `--kv offload`
(and dense), plus selection quality; the command (kvtier.commands.bench_sparse) says what is measured.

One run, same prompt, same budgets (kvtier.eval.accuracy.budgets). The model runs over the prompt once
(kvtier.eval.sparse.prefill_tape; rows the document store holds are read back instead, kvtier.eval.sparse.stored_rows)
and every mode's cache is fed the recorded K/V; modes run in alternating
rounds and the result keeps each round's ratios. Recall of the selected set against exact top-k
comes from one dense decode step with the attention probe (kvtier.eval.accuracy.mass_recall).
"""

from __future__ import annotations

import json
import math
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from kvtier.data.corpus import load_corpus
from kvtier.eval.accuracy.mass_recall import DenseAttentionProbe
from kvtier.eval.accuracy.budgets import BudgetShares, budget_bytes, kv_bytes_per_token
from kvtier.eval.sparse.decode_timing import measure_decode
from kvtier.eval.sparse.prefill_tape import PrefillTape, record, recorded_tokens
from kvtier.eval.record import machine_info
from kvtier.eval.sparse.stored_rows import StoredRows
from kvtier.eval.sparse.traffic import sparse_details
from kvtier.kv.contract import SparseView
from kvtier.kv.model_geometry import full_attention_layers, model_geometry, text_config
from kvtier.kv.offload import OffloadCache
from kvtier.modes import KVConfig, make_cache
from kvtier.sparse import SCORE_BITS, SparseSettings, decoding, describe_threads, thread_settings
from kvtier.sparse.lookahead import QueryForecast, is_predicted
from kvtier.sparse.planner import load_or_calibrate
from kvtier.eval.accuracy.recall import ESTIMATES, edge_mass, estimate, exact_mass, recall_at, shortlisted
from kvtier.docstore import DocumentStore
from kvtier.units import format_size


@dataclass(frozen=True)
class SparseBench:
    """What one run compares (the command's options of the same names)."""

    context: int  # prompt tokens per sequence
    batch: int
    new_tokens: int  # decode steps timed per mode and round
    repeats: int  # alternating rounds of every mode
    alpha: float
    score_bits: int
    beta: str
    host_share: float  # host budget as a share of the prompt's KV
    policies: str  # migration policies the sparse path runs with
    lookahead: str  # "on", "off" or "both": the sparse path with, without or with and without its lookahead
    top_p: float | None  # also the sparse path with the adaptive budget at this mass (rows '<mode>-top-p')
    skip_offload: bool
    skip_dense: bool
    corpus: str
    prefill_chunk: int
    recalibrate: bool  # measure APP's throughputs again


def run_sparse_benchmark(llm, bench: SparseBench, storage_dir: str, device: str, dtype: str,
                         store: DocumentStore | None = None) -> dict:
    """Every mode of `bench` over one recorded prompt (its rows from `store` where it holds them), in alternating
    rounds; the result record."""
    model = llm.model
    started = time.perf_counter()
    ids = _prompt(llm, bench.context, bench.batch, bench.corpus).to(model.device)
    tape, stored = _record_prompt(llm, ids, bench.prefill_chunk, store)
    kv_bytes = kv_bytes_per_token(model) * bench.context * bench.batch
    device_budget, host_budget = budget_bytes(model, bench.context, BudgetShares(host=bench.host_share), bench.batch)
    result = {"model": llm.name, "device": device, "dtype": dtype, "corpus": bench.corpus,
              "context": bench.context, "batch": bench.batch, "new_tokens": bench.new_tokens,
              "alpha": bench.alpha, "top_p": bench.top_p, "score_bits": bench.score_bits, "prompt_kv_bytes": kv_bytes,
              "host_budget_bytes": host_budget, "device_budget_bytes": device_budget, "torch_threads": thread_settings(),
              "machine": machine_info(storage_dir), "modes": {},
              "prefill": {"recorded_once": True, "record_s": time.perf_counter() - started,
                          "rows_from_store": stored.rows_read if stored else 0,
                          "bytes_from_store": stored.bytes_read if stored else 0}}
    if bench.recalibrate:
        geometry = model_geometry(model)
        with decoding("sparse"):  # the rates of the threads and cores the sparse path decodes on
            result["calibration"] = vars(load_or_calibrate(storage_dir, geometry.num_kv_heads, geometry.head_dim,
                                                           model.dtype, bench.score_bits, "sum", refresh=True))
    builders = _mode_builders(model, llm.model_id, tape, bench, storage_dir, device_budget, host_budget)
    rounds = [{label: _measure(model, build(), tape, bench, label) for label, build in builders.items()}
              for _ in range(bench.repeats)]
    result["repeats"] = bench.repeats
    result["modes"] = {label: _over_rounds([measured[label] for measured in rounds]) for label in builders}
    result["round_ratios"] = _round_ratios(rounds)
    result["recall"] = selection_recall(model, tape.rows(slice(0, 1)), bench.alpha)
    return result


def _mode_builders(model, model_id: str, tape: PrefillTape, bench: SparseBench, storage_dir: str,
                   device_budget: int, host_budget: int) -> dict:
    """label -> a function making that mode's fresh cache, in the order a round runs them."""
    max_tokens = tape.ids.shape[1] + bench.new_tokens + 1
    builders = {}
    if not bench.skip_dense:  # what removing all KV I/O gains over offload on this machine
        builders["dense"] = lambda: make_cache(model, KVConfig(), max_tokens, bench.batch)
    if not bench.skip_offload:
        offload = KVConfig(kv="offload", device_kv_budget=device_budget, host_kv_budget=host_budget,
                           storage_dir=storage_dir)
        builders["offload"] = lambda: make_cache(model, offload, max_tokens, bench.batch, model_id)
    lookaheads = {"on": [True], "off": [False], "both": [True, False]}[bench.lookahead]
    for policy in bench.policies.split(","):
        for lookahead in lookaheads:
            sparse = KVConfig(kv="sparse", device_kv_budget=device_budget, host_kv_budget=host_budget,
                              storage_dir=storage_dir, alpha=bench.alpha, score_bits=bench.score_bits, beta=bench.beta,
                              policy=policy, lookahead=lookahead)
            label = f"sparse-{policy}" + ("" if lookahead else "-no-lookahead")
            builders[label] = lambda sparse=sparse: make_cache(model, sparse, max_tokens, bench.batch, model_id)
            if bench.top_p is not None:
                adaptive = replace(sparse, top_p=bench.top_p)
                builders[f"{label}-top-p"] = lambda adaptive=adaptive: make_cache(model, adaptive, max_tokens,
                                                                                  bench.batch, model_id)
    return builders


def _over_rounds(rows: list[dict]) -> dict:
    """One mode's rounds as one row: the round with the median step time, plus every round's median."""
    medians = [row["median_step_ms"] for row in rows]
    middle = rows[sorted(range(len(rows)), key=medians.__getitem__)[len(rows) // 2]]
    return middle | {"round_median_step_ms": medians, "median_step_ms": float(np.median(medians))}


def _round_ratios(rounds: list[dict]) -> dict[str, list[float]]:
    """Per round, offload's median step time over each other mode's (speed relative to offload)."""
    ratios: dict[str, list[float]] = {}
    for measured in rounds:
        if "offload" not in measured:
            continue
        for label, row in measured.items():
            if label != "offload":
                ratios.setdefault(label, []).append(measured["offload"]["median_step_ms"] / row["median_step_ms"])
    return ratios


def _prompt(llm, tokens: int, batch: int, corpus: str) -> torch.Tensor:
    """`batch` different stretches of the corpus, `tokens` tokens each."""
    text = load_corpus(corpus, min_chars=tokens * 6 * batch, progress=False).text
    all_ids = llm.tokenizer(text)["input_ids"]
    if len(all_ids) < tokens * batch:
        all_ids = all_ids * math.ceil(tokens * batch / len(all_ids))
    return torch.tensor([all_ids[i * tokens : (i + 1) * tokens] for i in range(batch)], dtype=torch.long)


def _record_prompt(llm, ids: torch.Tensor, chunk: int,
                   store: DocumentStore | None) -> tuple[PrefillTape, StoredRows | None]:
    """The one real prefill of the run (rows the store holds are read back instead), with a progress bar (it is
    most of a long-context run's time)."""
    passes = ids.shape[0] * recorded_tokens(ids.shape[1], chunk) // chunk
    with tqdm(total=passes, desc="prefill (once, every row)", unit="pass", file=sys.stderr, leave=False) as bar:
        stored = StoredRows(llm, store, chunk, bar.update) if store is not None else None
        return record(llm.model, ids, chunk, bar.update, stored), stored


def _measure(model, cache, tape: PrefillTape, bench: SparseBench, label: str) -> dict:
    """Prefill from the tape, one untimed step (the sparse cache places its tiers), then `new_tokens` timed steps."""
    try:
        measured = measure_decode(model, cache, tape.ids, bench.new_tokens, bench.prefill_chunk, label=label,
                                  decode_mode=label, tape=tape)
        measured.pop("token_ids")
        sparse = cache.sparse_view()
        if sparse is not None:
            measured |= _sparse_details(sparse, direct=cache.storage_files()[0].direct)
        elif isinstance(cache, OffloadCache):
            measured["direct"] = cache.storage_files()[0].direct
        return measured
    finally:
        cache.close()


def _sparse_details(sparse: SparseView, direct: bool) -> dict:
    """The sparse step summary the latency suite records too (kvtier.eval.sparse.traffic), plus the scorer's health
    and `direct` (the cold pool's K|V reads bypass the page cache)."""
    return sparse_details(sparse) | {
        "direct": direct,
        "io_backend": sparse.io_backend,
        "scorer_round_trip_us": sparse.scorer_round_trip_s(repeats=200) * 1e6,
        "scorer_host_fallbacks": sparse.scorer_host_fallbacks,
    }


def _prefill_text(result: dict) -> str:
    """How the prompt went in (results from 2026-11-30 on record it; before, every mode ran its own prefill)."""
    recorded = result.get("prefill")
    if not recorded:
        return ""
    minutes, stored, rows = recorded["record_s"] / 60, recorded.get("rows_from_store", 0), result["batch"]
    if not stored:
        source = "the model prefilled the prompt once"
    elif stored == rows:
        source = "the prompt's K/V were read back from the document store, every record's checksum verified"
    else:
        source = f"the model prefilled {rows - stored} of the prompt's {rows} rows once, the others came from the store"
    return (f"; {source} ({minutes:.1f} min) and each mode's cache was fed its K/V, the last chunk running through "
            "the model in each mode (kvtier.eval.sparse.prefill_tape)")


def _speedup_text(result: dict, mode: str, row: dict, offload: dict) -> str:
    """Speed relative to offload (per round where recorded), and the share of the step that scoring, fetch and
    migration take."""
    ratios = result.get("round_ratios", {}).get(mode)
    if ratios:
        text = (f"{float(np.median(ratios)):.2f}x the decode speed of offload (median of {len(ratios)} rounds, "
                f"{min(ratios):.2f}-{max(ratios):.2f})")
    else:
        text = f"{offload['median_step_ms'] / row['median_step_ms']:.2f}x the decode speed of offload (medians)"
    dense = result["modes"].get("dense")
    if dense:
        text += f", {row['median_step_ms'] / dense['median_step_ms']:.2f}x dense's step time"
    parts = row.get("breakdown_ms", {})
    total = sum(parts.values())
    if total:
        overhead = parts.get("score", 0.0) + parts.get("fetch", 0.0) + parts.get("migrate", 0.0)
        text += f"; score + fetch + migrate {overhead / total:.0%} of the step"
    return text


def _rates_text(row: dict) -> str:
    """APP's planned selection rates of the two pools next to the measured ones (results from 2026-11-30 on)."""
    planned = row.get("planned_selection_rates")
    if not planned:
        return ""
    return (f"; selection rate hot / cold planned {planned['hot']:.3f} / {planned['cold']:.3f}, measured "
            f"{row['hot_selection_rate']:.3f} / {row['cold_selection_rate']:.3f}")


def selection_recall(model, tape: PrefillTape, alpha: float) -> dict:
    """Recall of each importance estimate vs exact top-k, averaged over the layers of one decode step
    after the (batch-1) prompt of `tape`; "lookahead-sum-int8" ranks with the query the lookahead predicts from the
    previous layer's input, over the layers it predicts (kvtier.sparse.lookahead). The "shortlist" rows are the
    path's own choice: the exact top-k among the candidate margin x k tokens the sketches rank best. The "step-ahead"
    rows are the first tiered layers' (those asked for a step ahead) at the next decode step, shortlisted with the
    query of the step before; "own query" the same layers and step with their own query."""
    with DenseAttentionProbe(model) as probe, _predicted_queries(model, probe) as predicted, torch.inference_mode():
        cache = make_cache(model, KVConfig(), tape.ids.shape[1] + 2)  # chunked prefill needs the causal mask
        logits = tape.prefill(model, cache)
        with probe.capturing():
            logits = model(input_ids=logits.argmax(-1, keepdim=True), cache=cache).logits[:, -1]
        captured, predicted = _host_copies(probe.captured), dict(predicted)
        with probe.capturing():
            model(input_ids=logits.argmax(-1, keepdim=True), cache=cache)
        following = _host_copies(probe.captured)
    table: dict[str, list[tuple[float, float]]] = {}
    tiered = full_attention_layers(text_config(model))
    skip = SparseSettings().lookahead_skip
    looked_ahead = {layer for tier, layer in enumerate(tiered[1:], start=1)
                    if is_predicted(tier, tiered[tier - 1], layer, skip)}
    margin = SparseSettings().candidate_margin
    masses = []
    for layer, (query, keys, scaling) in captured.items():
        mass = exact_mass(query, keys, scaling)
        masses.append(mass)
        k = math.ceil(alpha * len(mass))
        estimates = {(aggregation, bits): estimate(query, keys, aggregation, bits) for aggregation, bits in ESTIMATES}
        for (aggregation, bits), importance in estimates.items():
            name = f"{aggregation}-{'fp' if bits is None else f'int{bits}'}"
            table.setdefault(name, []).append(recall_at(mass, importance, k))
        exact = estimates["sum", None]
        guess = predicted[layer][0, :, 0].float().cpu() if layer in looked_ahead else None
        guessed = {} if guess is None else {bits: estimate(guess, keys, "sum", bits) for bits in SCORE_BITS}
        for bits in SCORE_BITS:
            table.setdefault(f"sum-int{bits} shortlist", []).append(
                recall_at(mass, shortlisted(estimates["sum", bits], exact, k, margin), k))
            if guessed:
                table.setdefault(f"lookahead-sum-int{bits} shortlist", []).append(
                    recall_at(mass, shortlisted(guessed[bits], exact, k, margin), k))
        if guessed:
            table.setdefault("lookahead-sum-int8", []).append(recall_at(mass, guessed[8], k))
    for layer in tiered[:skip]:
        _step_ahead_recall(table, captured[layer][0], *following[layer], alpha, margin)
    recall = {name: {"recall": float(np.mean([r for r, _ in rows])), "mass_recall": float(np.mean([m for _, m in rows]))}
              for name, rows in table.items()}
    return recall | {"edge_mass": _edge_mass(masses)}


def _host_copies(captured: dict) -> dict:
    """The probe's captures {layer: (query [Hq, D], keys [Hkv, N, D], scaling)}, sequence 0's, float32 on the host."""
    return {layer: (query[0, :, 0].float().cpu(), keys[0].float().cpu(), scaling)
            for layer, (query, keys, scaling) in captured.items()}


def _step_ahead_recall(table: dict, query_before: torch.Tensor, query: torch.Tensor, keys: torch.Tensor,
                       scaling: float, alpha: float, margin: float) -> None:
    """A layer asked for a step ahead: its shortlist drawn up with the query of the step before, and with its own."""
    mass = exact_mass(query, keys, scaling)
    k = math.ceil(alpha * len(mass))
    exact = estimate(query, keys, "sum", None)
    for bits in SCORE_BITS:
        for name, by in (("step-ahead", query_before), ("step-ahead layers, own query,", query)):
            table.setdefault(f"{name} sum-int{bits} shortlist", []).append(
                recall_at(mass, shortlisted(estimate(by, keys, "sum", bits), exact, k, margin), k))


@contextmanager
def _predicted_queries(model, probe: DenseAttentionProbe):
    """While the probe captures, each layer's decode query as the lookahead predicts it from the previous
    layer's input: {layer: [B, Hq, 1, D]}."""
    forecast = QueryForecast(model, model_geometry(model).num_kv_heads, summed=False)
    predicted: dict[int, torch.Tensor] = {}

    def predict_next(layer: int):
        def hook(_module, _args, _kwargs) -> None:  # runs after the forecast's own hook captured the input
            if probe.active and layer + 1 < len(forecast.decoders):
                predicted[layer + 1] = forecast.predict(layer + 1)
        return hook

    hooks = [decoder.register_forward_pre_hook(predict_next(layer), with_kwargs=True)
             for layer, decoder in enumerate(forecast.decoders)]
    try:
        yield predicted
    finally:
        for hook in hooks:
            hook.remove()
        forecast.close()


def _edge_mass(masses: list[np.ndarray]) -> dict[str, float]:
    """Mean share of attention mass on the first (sink) and last (recent) tokens, per window size."""
    sizes = {"sink": (1, 4, 16, 64), "recent": (16, 64, 256, 1024)}
    shares = {f"sink={n}": float(np.mean([edge_mass(m, n, 0) for m in masses])) for n in sizes["sink"]}
    return shares | {f"recent={n}": float(np.mean([edge_mass(m, 0, n) for m in masses])) for n in sizes["recent"]}


def write_results(result: dict, out: Path, suffix: str = "") -> None:
    """`<stem>.json` and `<stem>.md` under `out` (the stem names model, context, batch, a device other than the CPU,
    a score precision other than the default, then `suffix`), the markdown printed too."""
    out.mkdir(parents=True, exist_ok=True)
    stem = f"sparse-{result['model']}-{result['context']}-b{result['batch']}"  # names may hold dots: qwen2.5-0.5b
    if result.get("device", "cpu") != "cpu":
        stem += f"-{result['device'].replace(':', '')}"
    if result["score_bits"] != SparseSettings.score_bits:  # another precision's run sits beside the default's, not over it
        stem += f"-int{result['score_bits']}"
    stem += suffix
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    (out / f"{stem}.md").write_text(markdown(result))
    print(markdown(result))
    print(f"wrote {out / stem}.json and {out / stem}.md")


def markdown(result: dict) -> str:
    lines = [f"# sparse vs offload: {result['model']}, {result['context']} tokens x {result['batch']}",
             "", f"alpha {result['alpha']}, INT{result['score_bits']} sketches, host budget "
             f"{format_size(result['host_budget_bytes'])} of {format_size(result['prompt_kv_bytes'])} prompt KV, "
             f"{result['new_tokens']} timed decode steps per mode and round, {result.get('repeats', 1)} alternating "
             f"round(s) (median of the rounds' medians; mean of the median round), torch threads: "
             f"{describe_threads(result['torch_threads'])}{_prefill_text(result)}", "",
             "| mode | median ms/step | mean ms/step | disk read/step | O_DIRECT | cold sel. rate | K/V fetched/step | "
             "ping-pong rate | score / fetch / attention / migrate / rest ms |",
             "|---|---|---|---|---|---|---|---|---|"]
    for mode, row in result["modes"].items():
        parts = row.get("breakdown_ms")
        breakdown = " / ".join(f"{value:.1f}" for value in parts.values()) if parts else "-"
        lines.append(f"| {mode} | {row['median_step_ms']:.1f} | {row['ms_per_token']:.1f} | "
                     f"{format_size(int(row['disk_read_bytes_per_step']))} | "
                     f"{row.get('direct', '-')} | {row.get('cold_selection_rate', float('nan')):.3f} | "
                     f"{_size_or_dash(row.get('cold_bytes_fetched_per_step'))} | "
                     f"{row.get('ping_pong_rate', float('nan')):.3f} | "
                     f"{breakdown} |")
    offload, dense = result["modes"].get("offload"), result["modes"].get("dense")
    if offload and dense:
        lines.append(f"\ndense (every token in memory, full attention) decodes at "
                     f"{offload['median_step_ms'] / dense['median_step_ms']:.2f}x offload's speed: what removing all KV "
                     "I/O gains on this machine (a sparse mode adds only what attending fewer tokens saves)")
    for mode, row in result["modes"].items():
        if offload and mode.startswith("sparse"):
            lines.append(f"\n{mode}: {_speedup_text(result, mode, row, offload)}, "
                         f"{row['disk_read_bytes_per_step'] / max(offload['disk_read_bytes_per_step'], 1):.1%} of its "
                         f"disk bytes per step; scorer round trip {row['scorer_round_trip_us']:.0f} us; "
                         f"APP predicted T_CPU {row['predicted_ms']['T_CPU']:.1f} ms / T_storage "
                         f"{row['predicted_ms']['T_storage']:.1f} ms, measured {row['measured_ms']['T_CPU']:.1f} / "
                         f"{row['measured_ms']['T_storage']:.1f} ms (beta {row['beta']}){_rates_text(row)}"
                         f"{_lookahead_text(row)}")
    lines += _budget_lines(result)
    lines += ["", "| estimate (aggregation-precision) | recall vs exact top-k | attention-mass recall |", "|---|---|---|"]
    estimates = {name: row for name, row in result["recall"].items() if name != "edge_mass"}
    lines += [f"| {name} | {row['recall']:.3f} | {row['mass_recall']:.3f} |" for name, row in estimates.items()]
    if any(name.endswith("shortlist") for name in estimates):
        lines += ["", "a shortlist row is the sparse path's own choice: the exact top-k among the "
                      f"{SparseSettings().candidate_margin} x k tokens its sketches rank best"]
    if any(name.startswith("step-ahead") for name in estimates):
        lines += ["", f"the step-ahead rows are the first {SparseSettings().lookahead_skip} tiered layers' at the next "
                      "decode step, whose candidates the path asks for at the end of the step before with the query "
                      "they attended with there; the 'own query' rows, the same layers and step with their own query"]
    edges = result["recall"].get("edge_mass")
    if edges:
        lines += ["", "attention mass on always-kept tokens (mean over layers): " +
                  ", ".join(f"{window} {share:.1%}" for window, share in edges.items())]
    return "\n".join(lines) + "\n"


def _budget_lines(result: dict) -> list[str]:
    """Per adaptive-budget row ('<mode>-top-p'): its step time over its fixed-share row's in the same rounds (median
    [min, max] of the rounds), and both rows' estimated mass kept, share attended and cold K/V fetched per step."""
    lines = []
    ratios = result.get("round_ratios", {})
    for mode, row in result["modes"].items():
        fixed = mode.removesuffix("-top-p")
        if fixed == mode or fixed not in result["modes"]:
            continue
        other = result["modes"][fixed]
        text = (f"\n{mode} (top-p {result['top_p']}) vs {fixed} (alpha {result['alpha']}): estimated mass kept "
                f"{row['mass_kept']:.3f} vs {other['mass_kept']:.3f}, share attended {row['attended_share']:.3f} vs "
                f"{other['attended_share']:.3f}, cold K/V fetched {_size_or_dash(row['cold_bytes_fetched_per_step'])}"
                f" vs {_size_or_dash(other['cold_bytes_fetched_per_step'])} per step, guard events "
                f"{row['guard_events_per_step']:.1f} per step")
        if mode in ratios and fixed in ratios:  # offload's step over each: their quotient is fixed's over top-p's
            speed = [own / theirs for own, theirs in zip(ratios[mode], ratios[fixed])]
            text += (f"; speed {np.median(speed):.3f}x {fixed}'s (rounds {min(speed):.3f}-{max(speed):.3f}, "
                     "same rounds)")
        lines.append(text)
    return lines


def _lookahead_text(row: dict) -> str:
    """How many layers per step took candidates the lookahead prefetched, and how much of the fetch the others spent
    (each absent in results from before it was recorded)."""
    layers, unpredicted = row.get("lookahead_layers_per_step"), row.get("unpredicted_fetch_ms")
    text = "" if layers is None else f"; {layers:.1f} layers per step took prefetched candidates"
    if unpredicted is not None and layers is not None:
        text += f", the others spent {unpredicted:.1f} of the {row['breakdown_ms']['fetch']:.1f} ms fetch"
    return text


def _size_or_dash(nbytes: float | None) -> str:
    return "-" if nbytes is None else format_size(int(nbytes))
