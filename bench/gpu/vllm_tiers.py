"""One vLLM run for bench/gpu/vllm.sh: a workload whose prefixes overflow the GPU and the CPU KV tiers.

    python3 bench/gpu/vllm_tiers.py --mode cpu|fs|kvtier --model DIR --flash-dir DIR --out FILE.json

The model directory needs config.json and a tokenizer; the weights are vLLM's dummy weights
(`load_format="dummy"`, seeded), so outputs are meaningless text but a deterministic function of
the KV: the same tokens across modes mean the KV promoted from a tier was the KV computed.
Pass 1 prefills every document (their KV cascades GPU -> CPU -> secondary tier); pass 2 asks
every document again in another order, so most prefixes must come back from a lower tier (or be
recomputed, with the CPU tier alone). Throughput is pass 2's generated + prompt tokens per second.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402

from kvtier.integrations.vllm.config import flash_tier_entry  # noqa: E402


def transfer_config(mode: str, flash_dir: Path, cpu_bytes: int, flash_bytes: int) -> KVTransferConfig:
    tiers = {"cpu": [], "fs": [{"type": "fs", "root_dir": str(flash_dir / "fs")}],
             "kvtier": [flash_tier_entry(flash_dir / "kvtier.flash", flash_bytes)]}[mode]
    return KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                            kv_connector_extra_config={"spec_name": "TieringOffloadingSpec",
                                                       "cpu_bytes_to_use": cpu_bytes, "secondary_tiers": tiers})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("cpu", "fs", "kvtier"), required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--flash-dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--documents", type=int, default=64)
    parser.add_argument("--document-tokens", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--gpu-blocks", type=int, default=2048, help="GPU KV blocks of 16 tokens (overflowed)")
    parser.add_argument("--cpu-bytes", type=int, default=2 << 30, help="CPU tier bytes (overflowed)")
    parser.add_argument("--flash-bytes", type=int, default=32 << 30)
    args = parser.parse_args()
    args.flash_dir.mkdir(parents=True, exist_ok=True)
    llm = LLM(model=args.model, load_format="dummy", dtype="bfloat16", seed=0, enable_prefix_caching=True,
              num_gpu_blocks_override=args.gpu_blocks, max_model_len=args.document_tokens + 256,
              kv_transfer_config=transfer_config(args.mode, args.flash_dir, args.cpu_bytes, args.flash_bytes))
    vocab = llm.get_tokenizer().vocab_size
    rng = random.Random(0)
    documents = [[rng.randrange(100, vocab - 100) for _ in range(args.document_tokens)] for _ in range(args.documents)]
    sampling = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    prompt = lambda doc: {"prompt_token_ids": doc + [rng.randrange(100, vocab - 100) for _ in range(16)]}  # noqa: E731
    started = time.perf_counter()
    llm.generate([prompt(doc) for doc in documents], sampling, use_tqdm=False)
    first_pass = time.perf_counter() - started
    order = list(range(args.documents))
    random.Random(1).shuffle(order)
    rng = random.Random(2)
    requests = [prompt(documents[index]) for index in order]
    started = time.perf_counter()
    outputs = llm.generate(requests, sampling, use_tqdm=False)
    second_pass = time.perf_counter() - started
    tokens = sum(len(r["prompt_token_ids"]) for r in requests) + sum(len(o.outputs[0].token_ids) for o in outputs)
    args.out.write_text(json.dumps({
        "mode": args.mode, "documents": args.documents, "document_tokens": args.document_tokens,
        "gpu_blocks": args.gpu_blocks, "cpu_bytes": args.cpu_bytes, "first_pass_s": first_pass,
        "second_pass_s": second_pass, "second_pass_tokens_per_s": tokens / second_pass,
        "outputs": [list(o.outputs[0].token_ids) for o in outputs]}, indent=1) + "\n")
    print(f"{args.mode}: pass 1 {first_pass:.1f} s, pass 2 {second_pass:.1f} s ({tokens / second_pass:.0f} tok/s)")


if __name__ == "__main__":
    main()
