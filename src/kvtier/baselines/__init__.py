"""The HillInfer paper's baselines, and Quest, under the tiers, budgets and I/O layer of --kv sparse:
`--kv h2o|infinigen|leoam|quest`.

Every baseline keeps the KV where the other modes do (device window, host
DRAM, a KVBlockFile read with O_DIRECT through the IOEngine, the same block
size and byte budgets), attends the same number of tokens per step (sink +
ceil(alpha x pooled) + recent window, alpha/sink/recent shared with the sparse
path) and differs only in how it picks the pooled tokens and what it reads for
that. Prefill is dense in every mode. docs/baselines.md says what each one
keeps from its paper, what it simplifies, and why that does not favour
kvtier's sparse mode.

Files (one concept each):
    store.py      SelectiveStore: TieredStore's whole-block appends + reads of chosen blocks into fixed slots
    runtime.py    TierSetup (a resolved KVConfig), budgets -> capacities, SelectiveRuntime (I/O engine, files, hooks)
    selective.py  SelectiveLayer / SelectiveCache: device window + pool (host, disk), subset attention hand-off
    host_tokens.py HostTokens: the pool's newest tokens in host DRAM, a token-major queue
    h2o.py        H2O-like: accumulated exact attention, all keys read every step (host-centric)
    infinigen.py  InfiniGen-like: partial key cache, speculation from the previous layer, prefetch
    chunks.py     LeoAM's variable-size chunks and min/max key abstracts (Quest-style upper bound)
    leoam.py      LeoAM-like: abstracts on disk, whole chunks loaded by upper bound

Each cache is a `kvtier.kv.contract.SelectiveKVCache`, as the sparse cache is:
`watch_attended(callback)` (positions attended per decode step and layer),
`io_stats()`, per-layer `tier_tokens()`, and `close()` (removes hooks and files).
"""

from kvtier.baselines.h2o import make_h2o_cache
from kvtier.baselines.infinigen import make_infinigen_cache
from kvtier.baselines.leoam import make_leoam_cache
from kvtier.baselines.quest import make_quest_cache

BASELINES = {"h2o": make_h2o_cache, "infinigen": make_infinigen_cache, "leoam": make_leoam_cache,
             "quest": make_quest_cache}

__all__ = ["BASELINES", "make_h2o_cache", "make_infinigen_cache", "make_leoam_cache", "make_quest_cache"]
