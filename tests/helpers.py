"""Request builders shared by the tests."""

from __future__ import annotations

import json
from pathlib import Path


def instance(dense, **bags) -> dict:
    """A seed-format instance: instance([..5 floats..], feature_0=[1, 2], feature_2=[7])."""
    return {
        "dense": list(dense),
        "sparse": {
            "keys": list(bags),
            "values": [i for ids in bags.values() for i in ids],
            "lengths": [len(ids) for ids in bags.values()],
        },
    }


def body(obj) -> bytes:
    return json.dumps(obj).encode()


DENSE = [0.5, -1.0, 0.25, 2.0, 0.0]


def mapped_file(ptr: int) -> str | None:
    """The file mapped at address ``ptr`` in this process, from /proc/self/maps."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        if lo <= ptr < hi:
            return parts[5] if len(parts) == 6 else None
    return None
