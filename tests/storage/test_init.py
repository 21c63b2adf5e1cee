import subprocess
import sys

import kvtier.storage


def test_public_names_are_exported():
    assert sorted(kvtier.storage.__all__) == sorted(set(kvtier.storage.__all__))
    for name in kvtier.storage.__all__:
        assert getattr(kvtier.storage, name) is not None
    assert (kvtier.storage.K, kvtier.storage.V, kvtier.storage.PAGE) == (0, 1, 4096)


def test_storage_imports_neither_torch_nor_transformers():
    code = ("import sys, kvtier.storage; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
