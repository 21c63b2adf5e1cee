import json

import pytest

from kvtier.storage.sealed_json import BrokenSeal, seal, unseal


def test_a_sealed_value_comes_back():
    value = {"b": [1, 2], "a": "x"}
    assert unseal(seal(value)) == value
    assert json.loads(seal(value))["body"] == '{"a": "x", "b": [1, 2]}'  # keys sorted: equal values, equal bytes


def test_a_changed_body_breaks_the_seal():
    wrapper = json.loads(seal({"tokens": 100}))
    wrapper["body"] = wrapper["body"].replace("100", "101")
    with pytest.raises(BrokenSeal, match="fails its checksum"):
        unseal(json.dumps(wrapper).encode())


@pytest.mark.parametrize("data", [b"not json", b'{"crc32c": 1}', b"[1, 2]"])
def test_what_is_not_a_seal_is_refused(data):
    with pytest.raises((ValueError, KeyError, TypeError)):
        unseal(data)
