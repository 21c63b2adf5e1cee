#!/usr/bin/env bash
# vLLM on a CUDA machine with kvtier's flash tier behind its CPU tier, against the CPU tier alone and
# vLLM's own fs tier: the same workload (documents whose KV overflows the GPU blocks and the CPU tier,
# asked twice), throughput of the second pass and whether the generated tokens agree.
#   OUT=bench/results/gpu MODEL_DIR=<dir with config.json + tokenizer> FLASH_DIR=<dir on the NVMe> bench/gpu/vllm.sh
# Needs vLLM 0.33 with its CUDA torch (pip install 'kvtier[vllm]'); MODEL_DIR needs no weights (dummy weights).
# NOT RUN YET: no CUDA machine was available when it was written.
set -uo pipefail
OUT=${OUT:-bench/results/gpu}
MODEL_DIR=${MODEL_DIR:-.gpu/smollm2-135m}
FLASH_DIR=${FLASH_DIR:-$PWD/.flash/vllm}
mkdir -p "$OUT" "$FLASH_DIR"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
{
    nvidia-smi -L
    df -hT "$FLASH_DIR"
    python3 -c "import torch, vllm; print('torch', torch.__version__, torch.cuda.get_device_name(), '| vllm', vllm.__version__)"
} 2>&1 | tee "$OUT/vllm-machine.txt"

for mode in cpu fs kvtier; do  # each in its own process: vLLM holds the GPU until exit
    rm -rf "${FLASH_DIR:?}"/*
    timeout "${RUN_TIMEOUT:-300}" python3 bench/gpu/vllm_tiers.py --mode "$mode" --model "$MODEL_DIR" \
        --flash-dir "$FLASH_DIR" --out "$OUT/vllm-$mode.json" ${VLLM_ARGS:-} 2>&1 | tee "$OUT/vllm-$mode.log" | tail -3
done

python3 - "$OUT" <<'PY' | tee "$OUT/vllm.md"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
runs = {mode: json.loads((out / f"vllm-{mode}.json").read_text()) for mode in ("cpu", "fs", "kvtier")
        if (out / f"vllm-{mode}.json").exists()}
print("| mode | pass 2 tok/s | pass 2 s | outputs equal to the CPU-tier run |")
print("|---|---|---|---|")
for mode, run in runs.items():
    same = "n/a" if "cpu" not in runs else sum(a == b for a, b in zip(run["outputs"], runs["cpu"]["outputs"]))
    print(f"| {mode} | {run['second_pass_tokens_per_s']:.0f} | {run['second_pass_s']:.2f} | {same} of {len(run['outputs'])} |")
PY
