"""Small metadata files sealed with their own crc32c: damage is detected before anything is parsed from them.

    {"body": "<the JSON of the value, keys sorted>", "crc32c": <crc32c of that text>}

Used by the document store's meta.json and the sparse tier image's image.json.
"""

from __future__ import annotations

import json
from typing import Any

from kvtier.storage.checksum import checksum


class BrokenSeal(ValueError):
    """The body does not match its crc32c."""


def seal(value: Any) -> bytes:
    """The sealed file bytes of the JSON-serializable `value`."""
    body = json.dumps(value, sort_keys=True)
    return json.dumps({"body": body, "crc32c": checksum(body.encode())}).encode()


def unseal(data: bytes) -> Any:
    """The value `seal` wrote. BrokenSeal when the body fails its crc; ValueError, KeyError or TypeError when
    `data` is not a sealed file at all."""
    wrapper = json.loads(data)
    body = wrapper["body"]
    if checksum(body.encode()) != wrapper["crc32c"]:
        raise BrokenSeal("fails its checksum")
    return json.loads(body)
