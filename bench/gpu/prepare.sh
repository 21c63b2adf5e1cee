#!/usr/bin/env bash
# Run here, from the repository root after `make install`, before a GPU session: writes what bench/gpu/check.sh
# needs on a bare GPU machine that reaches no network, as ignored paths for the device run to carry:
#   .gpu/<model>/  each model's config and tokenizer (no weights: the GPU runs use --load-format dummy)
#   .whl/          wheels for that machine's Python (GPU_PYTHON, default 3.12): kvikio, the kvtier
#                  dependencies its image lacks (crc32c, gguf), and a setuptools that reads pyproject.toml's
#                  license field (check.sh builds kvtier's compiled parts there)
# Then, on the GPU machine (carry .gpu and .whl):
#   SPARSE_MODEL_DIR=.gpu/qwen2.5-0.5b SPARSE_CONTEXT=32000 bench/gpu/check.sh
set -euo pipefail
GPU_PYTHON=${GPU_PYTHON:-3.12}
PYTHON=${PYTHON:-.venv/bin/python}

for model in smollm2-135m qwen2.5-0.5b; do
    "$PYTHON" - "$model" <<'EOF'
import shutil
import sys
from pathlib import Path

import kvtier
from kvtier.models import REGISTRY
from kvtier.models.loader import converted_path

name = sys.argv[1]
source = converted_path(REGISTRY[name].sha256)
if not source.is_dir():
    kvtier.load_model(name)  # pulls and converts it once; the converted copy holds config and tokenizer
target = Path(".gpu") / name
target.mkdir(parents=True, exist_ok=True)
kept = [path for path in source.iterdir() if path.suffix in (".json", ".jinja")]  # every file but the weights
for path in kept:
    shutil.copy2(path, target / path.name)
print(f"{target}: {', '.join(sorted(path.name for path in kept))}")
EOF
done

mkdir -p .whl
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$GPU_PYTHON" \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl kvikio-cu13 libkvikio-cu13 rapids-logger crc32c gguf 'setuptools>=77'
ls -l .whl
du -sh .gpu .whl
