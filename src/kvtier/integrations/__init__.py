"""kvtier's tiers inside other inference engines.

    vllm/   the HiFC flash log as a secondary offloading tier of vLLM's tiering connector
"""
