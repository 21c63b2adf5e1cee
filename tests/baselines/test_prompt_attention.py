import torch

from kvtier.baselines.prompt_attention import attention_mass


def test_attention_mass_is_causal_attention_mass():
    torch.manual_seed(0)
    queries, keys = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 10, 8)  # 2 query heads per KV head
    importance = attention_mass(queries, keys, scaling=0.5)
    expected = torch.zeros(10)
    for head in range(4):
        for i in range(3):
            visible = 10 - 3 + i + 1
            logits = queries[0, head, i] @ keys[0, head // 2, :visible].T * 0.5
            expected[:visible] += logits.softmax(-1)
    torch.testing.assert_close(importance[0], expected)
    assert importance.sum().item() == torch.tensor(12.0).item()  # each of 4 x 3 query rows sums to 1
