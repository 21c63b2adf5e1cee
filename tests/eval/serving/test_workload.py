import pytest

from kvtier.errors import ConfigError
from kvtier.eval.serving.workload import Workload


def fake_encode(text: str) -> list[int]:
    return [ord(char) for char in text]


def test_prompts_are_deterministic_windows_of_the_requested_lengths():
    workload = Workload(requests=5, min_prompt_tokens=100, max_prompt_tokens=300, new_tokens=20)
    prompts = workload.prompts(fake_encode)
    assert prompts == workload.prompts(fake_encode)
    assert len(prompts) == 5 and all(100 <= len(prompt) <= 300 for prompt in prompts)


def test_pool_is_a_fraction_of_demand_but_holds_the_largest_request():
    workload = Workload(requests=4, new_tokens=64, pool_fraction=0.25)
    prompts = [[0] * 192] * 4  # 256 tokens each = 4 blocks of 64
    assert workload.device_blocks(prompts, 64) == 4
    assert Workload(pool_fraction=0.5, new_tokens=64).device_blocks(prompts, 64) == 8


def test_scaling_shrinks_prompts_but_keeps_requests_and_growth():
    scaled = Workload().scaled(1 / 32)
    dimensions = (scaled.requests, scaled.min_prompt_tokens, scaled.max_prompt_tokens, scaled.new_tokens)
    assert dimensions == (32, 64, 256, 32)
    assert Workload().scaled(0.5).new_tokens == 64
    with pytest.raises(ConfigError):
        Workload().scaled(0)
