"""KVConfig and the KV modes by name, without torch: what the command line checks before it imports a model."""

import subprocess
import sys

import pytest

from kvtier.errors import ConfigError
from kvtier.kv_config import KV_MODES, KVConfig


def test_every_mode_named_here_is_one_kvtier_modes_builds():
    from kvtier.baselines import BASELINES

    assert set(KV_MODES) == {"dense", "offload", "sparse", *BASELINES}


@pytest.mark.parametrize("fields, message", [({"kv": "tape"}, r"^kv \(--kv\): unknown KV mode 'tape'"),
                                             ({"alpha": 0}, r"^alpha \(--alpha\) must be in"),
                                             ({"beta": "soon"}, r"^beta \(--beta\) must be"),
                                             ({"sink": -1}, r"^sink \(--sink\) must be"),
                                             ({"device_kv_budget": "12 parsecs"},
                                              r"^device_kv_budget \(--device-kv-budget\): cannot parse size")])
def test_bad_settings_are_refused_naming_the_field_and_its_flag(fields, message):
    with pytest.raises(ConfigError, match=message):
        KVConfig(**fields).validated()


def test_validating_imports_neither_torch_nor_transformers():
    code = ("import sys; from kvtier.kv_config import KVConfig; KVConfig(kv='sparse').validated(); "
            "print(sorted(name for name in ('torch', 'transformers') if name in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert done.stdout.strip() == "[]"
