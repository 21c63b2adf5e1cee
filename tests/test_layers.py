"""The declared layering ([tool.importlinter] in pyproject.toml) holds: layers import downward only,
`kvtier.storage`, `kvtier.kernels` and the storage scorer process import neither torch nor transformers,
and no modules import each other in a circle."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = "from importlinter.cli import lint_imports_command; lint_imports_command()"


def test_every_import_contract_is_kept():
    source = str(ROOT / "src")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [source, os.environ.get("PYTHONPATH")])))
    run = subprocess.run([sys.executable, "-c", LINT_IMPORTS, "--no-cache"], cwd=ROOT, env=env,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
