"""Request builders shared by the tests."""

from __future__ import annotations

import json
import re


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


def batches_so_far(srv) -> int:
    """How many handler calls the worker has logged (TorchServe's own log line per batch)."""
    log = (srv.log_dir / "model_log.log").read_text(errors="replace")
    return len(re.findall(r"Backend received inference at", log))
