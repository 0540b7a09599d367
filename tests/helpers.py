"""Request builders and tiny-model helpers shared by the tests."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from conftest import tiny_config
from dlrm_factory import DLRMFactory


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


def archive(tmp_path: Path, model, dtype: str, **changes) -> Path:
    """What build_mar.py writes as dlrm.pt for the fp32 ``model`` of ``tiny_config(**changes)``
    with ``dtype`` tables."""
    path = tmp_path / f"dlrm-{changes.get('interaction', 'dot')}-{dtype}.pt"
    factory = DLRMFactory(tiny_config(**changes, embedding_dtype=dtype))
    torch.save(factory.archive_state(copy.deepcopy(model)), path)
    return path


def batch(n=64, seed=1):
    """B = n rows of the tiny config: (dense, KJT)."""
    return DLRMFactory(tiny_config()).probe_batch(n, torch.Generator().manual_seed(seed))


def forward(model, dense, kjt):
    with torch.inference_mode():
        return model(dense, kjt)
