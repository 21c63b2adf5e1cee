"""Sparse path (HillInfer, hillinfer.txt): `--kv sparse`.

Tiers per full-attention layer and sequence:
    device   sink + recent window + the new token (always attended)
    hot      host DRAM, full-precision K/V (HotPool), scored by the host
    cold     storage dir: K|V records + INT8/INT4 key sketches (ColdPool), scored by the scorer process

Per decode step and layer: query -> channel (shared memory) + pipe signal ->
storage scorer streams <position, score> blocks while the host scores the hot
pool -> global top-alpha -> fetch selected K/V (hot from DRAM, cold from the
K|V file) in position order -> the model's own attention over sink + selected
+ recent -> hit table + bounded swaps.

Files (one concept each):
    settings.py        SparseSettings: every knob, validated
    sketch.py          INT8/INT4 key sketches with per-group scales; raw inner-product scoring (numpy only)
    record_file.py     per-token records in page-aligned (layer, sequence) regions; page read-modify-write
    protocol.py        shared-memory channel layout and the 24/16-byte pipe messages
    sketch_scorer.py   streamed sketch reading + scoring into score blocks (scorer process and host fallback)
    scorer_process.py  the storage-side scorer process (`python -m kvtier.sparse.scorer_process`)
    scorer_client.py   host side: start, request/wait, death/hang detection, host fallback, restart
    hot_pool.py        HotPool (torch, host DRAM)
    cold_pool.py       ColdPool: host bookkeeping and I/O of the cold files, crc32c per record
    hit_table.py       HKM hit table, 2 bytes per token (hits with decay, idle steps)
    migration.py       BKP policies (hit table vs naive instantaneous scores), ping-pong meter
    placement.py       SnapKV-style observation-window importance for the initial hot/cold split
    planner.py         APP: latency model, beta by eq. (4) with skew correction, calibration cache
    layer.py           SparseLayer: the per-layer tiers, selection, fetch, exact attention, migration
    attention.py       the attention function hand-off (registered as `kvtier_sparse_<inner>`)
    cache.py           SparseCache, SparseRuntime, make_sparse_cache (budgets)
    stats.py           per-step breakdown: scoring, fetch, attention, migration, rest; APP predicted vs measured
    recall.py          recall of importance estimates vs exact top-k (benchmark)

Decisions and why:
- alpha is the share of the *pooled* (hot + cold) tokens attended per step; the
  sink and recent window come on top. At alpha = 1 the attended tokens are every
  token in position order, so the output equals the dense cache bit for bit.
- The scorer is a subprocess started with `python -m`, not multiprocessing: the
  shared segment is a memfd passed by descriptor (no name another process's
  resource tracker could unlink), the scorer imports no torch (starts fast),
  and it runs numpy single-threaded like the small accelerator it stands for.
- Scoring uses einsum, not BLAS, so the scorer and the host fallback produce
  bit-identical scores: a scorer death changes no token of the output.
- Cold records are per token (selection is per token) and the cold pool is
  written in position order at placement, so neighbouring selected tokens share
  pages; the benchmark reports the pages read per step.
- GQA token importance is "sum" (the group's queries summed into one query per
  KV head), not "max" over the group's heads. Measured by `kvtier bench sparse
  --context 8000` (smollm2-135m, 3 query heads per KV head, mean over the 30
  layers of one decode step): top-k recall sum 0.811 vs max 0.839, but recall of
  attention mass, which bounds the attention output error, 0.992 vs 0.993. The
  selections are equally good where it matters, and sum sends and scores one
  query per KV head instead of three. qwen2.5-0.5b at 32K (7 query heads per KV
  head, `--model qwen2.5-0.5b --context 32000`): sum is the better one, top-k
  recall 0.744 vs 0.735, attention mass 0.976 vs 0.944.
- INT8 sketches lose nothing measurable against full-precision keys (recall
  0.811 both, sum); INT4 loses little (0.808): INT8 is the default, INT4 halves
  the scorer's reads.
- Always-kept tokens, same run (share of attention mass, mean over layers):
  the first token alone holds 18.8% and sink 4/16/64 add nothing more; the last
  16/64/256/1024 tokens hold 36.9/50.8/56.9/67.2%. Defaults sink 4 (free
  insurance for models with more than one sink token) and recent 64 (the knee:
  256 costs 4x the device tokens for 6 more points).
- Score blocks are 1024 tokens (SparseSettings.score_block_tokens): each block
  is one numpy call in the scorer, and blocks of 64 made the call overhead
  cost more than the inner products (2.6 vs 1.0 ms per 4800 INT8 sketches).
- A layer's selected tokens are copied once, straight into the attended K/V
  in position order, and the cold reads of all sequences are in flight
  together. Both measured with `kvtier bench sparse --context 8000` (full-speed
  VM): the sparse step went from 381 to 254 ms (fetch 130 -> 94 ms, attention
  25 -> 12 ms, scoring 136 -> 72 ms with the larger score blocks).
- Prefill attention is dense (the model's own); its K/V accumulate in host
  memory until the first decode step distributes them. The prompt KV must
  therefore fit in host memory once during prefill.
"""
