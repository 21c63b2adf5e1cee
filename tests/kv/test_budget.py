import pytest

from kvtier.errors import ConfigError
from kvtier.kv.budget import tier_capacity


def test_capacities_are_whole_blocks_of_the_budget():
    # 1000 bytes per token, 16-token blocks -> 16,000 bytes per block.
    cap = tier_capacity(device_budget=40_000, host_budget=100_000, token_bytes=1000, block_tokens=16)
    assert (cap.device_tokens, cap.host_tokens, cap.block_tokens) == (32, 96, 16)


def test_batch_divides_the_budget():
    cap = tier_capacity(device_budget=64_000, host_budget=0, token_bytes=1000, block_tokens=16, batch_size=2)
    assert (cap.device_tokens, cap.host_tokens) == (32, 0)


def test_device_budget_below_one_block_is_refused():
    with pytest.raises(ConfigError, match="device KV budget .* smaller than one KV block"):
        tier_capacity(device_budget=15_999, host_budget=0, token_bytes=1000, block_tokens=16)


def test_nonzero_host_budget_below_one_block_is_refused():
    with pytest.raises(ConfigError, match="host KV budget"):
        tier_capacity(device_budget=16_000, host_budget=100, token_bytes=1000, block_tokens=16)
