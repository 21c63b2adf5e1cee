"""What a user may ask of the KV cache: the KV modes by name and `KVConfig`, validated without torch.

The command line checks its options against these before it imports torch and transformers (seconds
on a small machine), so a bad option is refused at once. Building the cache a config describes is
kvtier.modes' job, which imports every mode.
"""

from dataclasses import dataclass
from pathlib import Path

from kvtier.errors import ConfigError, setting
from kvtier.paths import cache_dir
from kvtier.sparse.settings import SparseSettings, parse_beta
from kvtier.units import parse_size

# kvtier.modes builds each: "dense", "offload", "sparse", the HillInfer paper's baselines and Quest (kvtier.baselines).
KV_MODES = ("dense", "offload", "sparse", "h2o", "infinigen", "leoam", "quest")
# The modes that attend every position exactly: their attention-mass recall is 1.0 by definition
# (kvtier.eval.accuracy.mass_recall), and an importance rate (alpha) changes nothing in them.
EXACT_MODES = ("dense", "offload")


@dataclass(frozen=True)
class KVConfig:
    """Where the KV cache may live. Sizes accept units (`64MiB`)."""

    kv: str = "dense"
    device_kv_budget: int | str = "64MiB"
    host_kv_budget: int | str = "256MiB"
    storage_dir: str | None = None  # default: ~/.cache/kvtier/kv
    block_tokens: int = 64  # HiFC's best block size (the HiFC paper, Fig. 6); 4 KiB-aligned for every packaged model
    io_threads: int = 8
    # sparse mode and baselines (kvtier.sparse.settings.SparseSettings documents each)
    alpha: float = 0.2
    top_p: float | None = None  # sparse: the adaptive budget's attention mass (None: the fixed share alpha)
    score_bits: int = SparseSettings.score_bits
    beta: str | float = "auto"
    sink: int = 4
    recent: int = 64
    policy: str = "hit"  # sparse migration policy
    lookahead: bool = True  # sparse: prefetch the next layer's cold candidates with a predicted query

    def validated(self) -> "KVConfig":
        if self.kv not in KV_MODES:
            raise ConfigError(f"{setting('kv')}: unknown KV mode {self.kv!r}; choose one of {', '.join(KV_MODES)}")
        if not 1 <= self.block_tokens <= 4096:
            raise ConfigError(f"{setting('block_tokens')} must be between 1 and 4096, got {self.block_tokens}")
        if self.io_threads < 1:
            raise ConfigError(f"{setting('io_threads')} must be at least 1, got {self.io_threads}")
        for name in ("device_kv_budget", "host_kv_budget"):  # unparsable sizes fail before any model load
            try:
                parse_size(getattr(self, name))
            except ConfigError as error:
                raise ConfigError(f"{setting(name)}: {error}") from None
        if self.top_p is not None and self.kv != "sparse":
            raise ConfigError(f"{setting('top_p')} is the sparse mode's adaptive budget; --kv {self.kv} attends the "
                              f"fixed share {setting('alpha')}")
        self.sparse_settings()
        return self

    def sparse_settings(self) -> SparseSettings:
        """The sparse-mode settings these options describe (validated)."""
        return SparseSettings(alpha=self.alpha, top_p=self.top_p, score_bits=self.score_bits,
                              beta=parse_beta(self.beta), sink=self.sink, recent=self.recent, policy=self.policy,
                              lookahead=self.lookahead).validated()


def default_storage_dir() -> Path:
    return cache_dir() / "kv"
