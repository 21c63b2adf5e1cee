"""Sparse path (the HillInfer paper): `--kv sparse`.

Tiers per full-attention layer and sequence:
    device   sink + recent window + the new token (always attended)
    hot      host DRAM, full-precision K/V (HotPool), scored by the host
    cold     storage dir: K|V records + INT8/INT4 key sketches (ColdPool), scored by the scorer process

Per decode step and layer (overlapped, not in sequence):
    host: query -> scorer (shared memory + pipe), then q.k over the hot pool (raw dots per query head)
    scorer: scores the layer's cold sketches from their codes, read (prepared) while the host computed
            up to this layer's attention
    the sketches only draw up a shortlist of cold tokens (candidate_margin x the cold tokens they would
          pick); its K/V are read in full precision (checked per page) and scored with the real query,
          and the global top-alpha of hot pool + shortlist by exact q.k is attended: one exact softmax
          over window + hot + shortlist's chosen, the chosen hot tokens' logits picked out of the dots
          above -> hit table, migration plan, bounded promotions and window retirement, whose disk
          writes run on a background thread while the next layers compute.
    who draws up and reads the shortlist:
      lookahead (default, from the third tiered layer on, for cold pools of >= 256 tokens per sequence):
          once a layer has its candidates, the scorer scores the next layer's cold pool with that
          layer's query predicted from this layer's input, then reads the best candidates' K/V and
          checks them (page crcs the host keeps in the shared segment) into shared memory, with
          neither the scoring nor the cold reads on the host's critical path or core;
      the layers it does not predict (the first two tiered layers, the first step, no lookahead): the
          host, from the scorer's streamed scores (kernel AIO reads submitted from a pool thread).

Files (one concept each):
    settings.py        SparseSettings: every knob, validated
    sketch.py          INT8/INT4 key sketches with per-group scales; raw inner-product scoring from the codes
    sketch_scores.c    that scoring, compiled (AVX2 where present): one call per score block
    hot_dots.c         the hot pool's q.k, compiled (AVX2): the CPU path's host scores and hot logits
    chosen_values.c    a decode step's softmax over window, chosen hot and candidates and its weighted sums, compiled (AVX2),
                       the values read where they lie
    summed_query.c     the lookahead's predicted query (norm, folded product, rotation) in one compiled call
    avx2_module.h      what the AVX2 kernels share: the CPU check and their module set-up
    top_share.py       each row's top scores as ascending indices (top_share.c, compiled): the top-alpha, the
                       scorer's candidates
    record_file.py     per-token records in page-aligned (layer, sequence) regions; page read-modify-write
    protocol.py        shared-memory channel layout (with the K|V file's page crcs and two candidate areas) and the
                       24/16-byte pipe messages
    sketch_scorer.py   next-layer preparation, scoring into streamed score blocks (scorer process and host fallback)
    scorer_process.py  the storage-side scorer process (`python -m kvtier.sparse.scorer.process`): scoring, and
                       for the lookahead, its candidates' reads
    candidate_reads.py the scorer's reads of the lookahead's candidates: best-scored slots, K/V checked, handed over
    candidates_first.py the scorer's disk: the next layer's sketch read waits while candidate reads are in flight
    slot_reads.py      reading cold slots' K/V where they lie (own file or a stored image's), host and scorer alike
    scorer_client.py   host side, the layers' one seam to the scorer: start, request/scores, death/hang
                       detection, host fallback, restart
    hot_pool.py        HotPool (torch, host DRAM)
    cold_pool.py       ColdPool: host bookkeeping and I/O of the cold files, crc32c per page; a stored image's files
                       as a read-only base under them
    cold_image.py      a placed prompt's cold pool, placement and hit table stored with a document KV store entry,
                       checked and opened for use in place
    stored_sketches.py the scorer's reads of sketches lying in a stored image and the run's own file
    background_writes.py  the moves' cold writes off the critical path; a layer settles its own before reading
    hit_table.py       HKM hit table, 2 bytes per token (hits with decay, step of the last selection)
    migration.py       BKP policies (hit table vs naive instantaneous scores), ping-pong meter
    promotion_price.py the hits a promotion needs to pay for its writes, from measured write and fetch costs
    placement.py       the initial hot/cold split by the observation window's selection scores (SnapKV-style window)
    planner.py         APP: latency model, beta by eq. (4) with skew correction, calibration cache
    layer.py           SparseLayer (on kv.windowed's skeleton): hot/cold placement, the overlapped decode step,
                       migration
    lookahead.py       the next layer's query predicted from this layer's input; its cold candidates scored and
                       read by the scorer while this layer computes
    selection.py       the shortlist, the step's picks, attention segments (window, chosen hot, fetched cold), one
                       exact softmax
    attention.py       the attention function hand-off (registered as `kvtier_sparse_<inner>`)
    runtime.py         SparseRuntime: what the layers share (pools' files, scorer client, policy, plan, stats)
    cache.py           SparseCache, make_sparse_cache (budgets)
    stats.py           per-step breakdown: scoring, fetch, attention, migration, rest; APP predicted vs measured
    recall.py          recall of importance estimates vs exact top-k (benchmark)

Decisions and why:
- alpha is the share of the *pooled* (hot + cold) tokens attended per step; the
  sink and recent window come on top. At alpha = 1 every token is attended, so
  the output equals the dense cache up to float rounding (same greedy tokens).
- The scorer is a subprocess started with `python -m`, not multiprocessing: the
  shared segment is a memfd passed by descriptor (no name another process's
  resource tracker could unlink), the scorer imports no torch (starts fast),
  and it runs numpy single-threaded like the small accelerator it stands for.
- Scoring is one compiled call per block that reads the codes as they lie
  (sketch_scores.c), independent of any thread count, so the scorer and the
  host fallback produce bit-identical scores: a scorer death changes no token
  of the output. Dequantizing first cost ~4x more (docs/decisions.md).
- Attention is computed here, not by the model's attention function: the hot
  pool's q.k are already the logits, so the hot keys are read once per step.
  At alpha = 1 the output equals dense up to float rounding (same tokens).
- Cold records are per token (selection is per token) and the cold pool is
  written in position order at placement, so neighbouring selected tokens share
  pages; the benchmark reports the pages read per step.
- GQA token importance is "sum" (the group's queries summed into one query per KV head), not
  "max" over the group's heads: the selections are as good where it matters (attention mass), and
  sum sends and scores one query per KV head instead of one per query head.
- INT4 sketches are the default: they only draw up the shortlist, which exact scores rank, and so
  re-ranked they lose no recall against INT8 or full-precision keys, at half INT8's reads.
- Always-kept tokens: sink 4 (insurance for models with more than one sink token) and recent 64
  (the knee of the attention mass the last tokens hold).
- Score blocks are 1024 tokens (SparseSettings.score_block_tokens): each block is one numpy call
  in the scorer, and small blocks pay more call overhead than inner products.
- Cold reads go to the disk as one kernel AIO batch per layer (all sequences), checked with a
  crc32c per read unit (512 B sectors where O_DIRECT takes them, else 4 KiB; all of a batch in
  one compiled call); tokens leave the recent window `retire_batch` at a time.
- The lookahead's candidates are read and checked by the scorer, not the host: the host's page
  plans, submissions, checks and record cutting were fixed per-layer work on the decoding core
  (docs/decisions.md); the K|V pages' crcs live in the shared segment for it.
- The hit policy promotes a cold token only when its hits pay for the swap's writes at the
  measured costs (promotion_price.py): on the development VM's disk they almost never do.
The measurements behind these choices, with their commands and dates: docs/decisions.md.
- Prefill attention is dense (the model's own); its K/V accumulate in host
  memory until the first decode step distributes them. The prompt KV must
  therefore fit in host memory once during prefill.
"""
