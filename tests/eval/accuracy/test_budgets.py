"""Cell budgets: shares of the prompt's KV with a device floor, in bytes of the model's tiered layers."""

from kvtier.eval.accuracy.budgets import MIN_DEVICE_TOKENS, BudgetShares, cell_kv_config, kv_bytes_per_token


def test_kv_bytes_per_token_counts_keys_and_values_of_every_tiered_layer(tiny_llm):
    assert kv_bytes_per_token(tiny_llm.model) == 2 * 2 * 2 * 16 * 4  # K+V, 2 layers, 2 KV heads, head_dim 16, fp32


def test_host_is_a_share_of_the_prompt_kv_and_device_has_a_floor(tiny_llm):
    per_token = kv_bytes_per_token(tiny_llm.model)
    config = cell_kv_config("offload", tiny_llm.model, 4096, BudgetShares(host=0.4, device=0.02), storage_dir="/tmp")
    assert config.kv == "offload" and config.storage_dir == "/tmp"
    assert config.host_kv_budget == int(0.4 * 4096 * per_token)
    assert config.device_kv_budget == MIN_DEVICE_TOKENS * per_token  # 2% of 4096 tokens is below the floor
    wide = cell_kv_config("offload", tiny_llm.model, 4096, BudgetShares(host=0.4, device=0.5))
    assert wide.device_kv_budget == 2048 * per_token


def test_shares_are_recorded_with_the_floor():
    assert BudgetShares(0.3, 0.01).as_dict() == {"host_share": 0.3, "device_share": 0.01,
                                                 "min_device_tokens": MIN_DEVICE_TOKENS}
