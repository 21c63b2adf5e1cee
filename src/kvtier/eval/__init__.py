"""The evaluation: every benchmark's experiment, its result records and its report; `kvtier bench ...` only parses.

    record, report, report_plots, report_text   result files (machine, medians, spread), REPORT.md and its plots
    budgets, corpus_slice, decode_timing, prefill_tape, traffic, attention_mass   shared measuring pieces
    accuracy, needle_grid, perplexity           `bench accuracy`
    latency, latency_grid                       `bench latency` (the HillInfer paper's experiments a-f)
    sparse_bench, stored_rows                   `bench sparse` (its prefill's rows kept in the document store)
    serve_bench, workload, costmodel            `bench serve`, `kvtier cost` (HiFC)
    http_bench, load_client                     `bench http`
    store_bench                                 `bench store`
    vllm_tier, vllm_tier_report                 `bench vllm-tier`
"""
