"""Turn byte budgets per tier into token capacities per tiered layer.

A budget is the bytes of K+V that one tier may hold across all tiered layers and
all sequences of the batch (what a user sizes against their RAM/VRAM). Tiers
move whole blocks of `block_tokens` tokens, so capacities are whole blocks.
"""

from dataclasses import dataclass

from kvtier.errors import ConfigError, setting
from kvtier.units import format_size


@dataclass(frozen=True)
class TierCapacity:
    """Tokens per layer per sequence that each volatile tier may hold."""

    device_tokens: int
    host_tokens: int
    block_tokens: int


def tier_capacity(
    device_budget: int,
    host_budget: int,
    token_bytes: int,
    block_tokens: int,
    batch_size: int = 1,
) -> TierCapacity:
    """Capacities from byte budgets.

    `token_bytes` is K+V of one token over all tiered layers. The device tier
    must hold at least one block (new tokens land there); the host tier may be
    0 (no host tier), but a non-zero host budget smaller than one block is
    almost certainly a typo, so it is refused too.
    """
    block_bytes = token_bytes * block_tokens * batch_size
    device_blocks = device_budget // block_bytes
    host_blocks = host_budget // block_bytes
    if device_blocks < 1:
        raise ConfigError(
            f"device KV budget {format_size(device_budget)} is smaller than one KV block "
            f"({format_size(block_bytes)} = {block_tokens} tokens x {batch_size} sequence(s)); raise {setting('device_kv_budget')}"
        )
    if host_budget and host_blocks < 1:
        raise ConfigError(
            f"host KV budget {format_size(host_budget)} is smaller than one KV block "
            f"({format_size(block_bytes)}); raise {setting('host_kv_budget')} or set it to 0 for no host tier"
        )
    return TierCapacity(device_blocks * block_tokens, host_blocks * block_tokens, block_tokens)
