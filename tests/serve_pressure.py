"""A workload that keeps the serving engine's tiny pool under pressure (tests/serve's tiny_llama).

Short prompts and long answers: demand grows during decode (8 x up to 7 blocks of 16 tokens) far
past the 8-block pool, so sequences are preempted and resumed over and over.
"""

import torch

from kvtier.engine.sequence import SamplingParams

PRESSURE = {"device_blocks": 8, "swap_space": str(64 * 4 * 4096)}  # 64 slots of 4 pages (2 layers x K/V)
LONG = SamplingParams(max_new_tokens=60, ignore_eos=True)


def short_prompts() -> list[list[int]]:
    """Eight prompts of 8-39 random token ids, the same every time."""
    generator = torch.Generator().manual_seed(2)
    lengths = torch.randint(8, 40, (8,), generator=generator).tolist()
    return [torch.randint(0, 128, (n,), generator=generator).tolist() for n in lengths]
