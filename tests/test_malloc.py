"""The worker's allocator (dlrmkit/malloc.py, handler.keep_freed_memory): a forward's freed buffers
stay with the process, so a repeated forward does not fault its pages back in.

The served measure is a real worker in a fresh process (glibc's settings are per process and
cannot be unset): its minor page faults per scored request, read from getrusage."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import TINY
from dlrmkit.config import DLRMConfig
from dlrmkit.errors import ConfigError
from dlrmkit.malloc import M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, MMAP_THRESHOLD, TRIM_THRESHOLD, keep_freed

ROOT = Path(__file__).resolve().parent.parent


class Glibc:
    """A C library that answers mallopt with ``answer`` and records what it was asked."""

    def __init__(self, answer: int = 1):
        self.answer, self.set = answer, []

    def gnu_get_libc_version(self) -> bytes:
        return b"2.36"

    def mallopt(self, param: int, value: int) -> int:
        self.set.append((param, value))
        return self.answer


def test_glibc_gets_both_thresholds():
    libc = Glibc()
    said = keep_freed(libc, environ={"PATH": "/usr/bin", "GLIBC_TUNABLES": "glibc.pthread.rseq=0"})
    assert libc.set == [(M_MMAP_THRESHOLD, 32 << 20), (M_TRIM_THRESHOLD, 1 << 30)]
    assert (
        said == "freed buffers kept for the next forward (glibc 2.36: mmap threshold 32 MiB, trim threshold 1024 MiB)"
    )


@pytest.mark.parametrize(
    "env, name",
    [
        ({"MALLOC_MMAP_THRESHOLD_": "65536"}, "MALLOC_MMAP_THRESHOLD_"),
        ({"MALLOC_TRIM_THRESHOLD_": "0"}, "MALLOC_TRIM_THRESHOLD_"),
        ({"MALLOC_TOP_PAD_": "0"}, "MALLOC_TOP_PAD_"),
        ({"MALLOC_MMAP_MAX_": "0"}, "MALLOC_MMAP_MAX_"),
        ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}, "GLIBC_TUNABLES"),
    ],
)
def test_the_users_setting_decides(env, name):
    libc = Glibc()
    assert keep_freed(libc, environ=env) == f"left as the environment sets it ({name})"
    assert libc.set == []


def test_another_libc_or_a_refusal_is_said():
    class Musl:
        def mallopt(self, param: int, value: int) -> int:  # musl's is a stub
            raise AssertionError("not called")

    assert keep_freed(Musl(), environ={}) == "left as it is (not glibc: no mallopt thresholds to set)"
    refusing = Glibc(answer=0)
    said = keep_freed(refusing, environ={})
    assert said == f"not all kept (glibc 2.36 refused mallopt({M_MMAP_THRESHOLD}, {MMAP_THRESHOLD}))"
    assert refusing.set == [(M_MMAP_THRESHOLD, MMAP_THRESHOLD)]
    assert TRIM_THRESHOLD == 1 << 30


def test_the_key_is_a_bool_defaulting_on():
    assert DLRMConfig.from_dict(TINY).threads.keep_freed_memory is True
    assert DLRMConfig.from_dict({**TINY, "keep_freed_memory": False}).threads.keep_freed_memory is False
    with pytest.raises(
        ConfigError,
        match=r"^handler.keep_freed_memory: expected true or false, got 'no' \(e.g. keep_freed_memory: true\)$",
    ):
        DLRMConfig.from_dict({**TINY, "keep_freed_memory": "no"})


# In a fresh process: a worker loads the model directory and scores requests of 4,096, 1,024, 2,048
# and 1,365 rows in turn (as served queries vary: the model's activations are up to 17 MB a
# forward), 15 rounds after 3 unrecorded; prints its allocator line and the minor page faults of
# each forward of the 4,096-row request (hooks on the served model: parsing's Python objects fault
# pages of CPython's own arenas, which glibc's thresholds do not govern).
CHILD = """
import json, resource, sys
from dlrmkit.protocols import open_request
from dlrmkit.worker import Worker, read_model_dir
w = Worker()
w.load(sys.argv[1], *read_model_dir(sys.argv[1]))
bodies = [open(p, "rb").read() for p in sys.argv[2:]]
faults, at = [], [0]
def minflt():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
w.model.register_forward_pre_hook(lambda module, args: at.__setitem__(0, minflt()))
w.model.register_forward_hook(lambda module, args, out: faults.append(minflt() - at[0]))
for _ in range(18):
    for body in bodies:
        data, _ = w.score([open_request(body, False, None, w.parser, w.model_id, "application/json")])
        assert not data.errors and data.scores[0], data.errors
w.close()
print(json.dumps({"allocator": w.allocator, "faults": faults[3 * len(bodies) :: len(bodies)]}))
"""


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A model directory of the tiny layout (embedding_dim 256, requests of up to 4,096 rows) and
    requests of it; returns a function (keep_freed_memory) -> the child's report."""
    from scripts import build_big

    tmp = tmp_path_factory.mktemp("malloc")
    handler = {**TINY, "embedding_dim": 256, "dense_arch_layer_sizes": [1024, 256], "max_instances_per_request": 4096}
    handler["max_ids_per_request"] = 3 * 4096
    bodies = []
    for rows in (4096, 1024, 2048, 1365):
        body = {
            "columns": {
                "dense": [[(r % 7) * 0.1] * 5 for r in range(rows)],
                "sparse": {
                    f: {"values": [(r * (i + 1)) % n for r in range(rows)]}
                    for i, (f, n) in enumerate(zip(TINY["sparse_features"], TINY["num_embeddings"]))
                },
            }
        }
        bodies.append(tmp / f"body-{rows}.json")
        bodies[-1].write_text(json.dumps(body))

    def run(keep: bool) -> dict:
        cfg = tmp / f"cfg-{keep}.yaml"
        cfg.write_text(yaml.safe_dump({"handler": {**handler, "keep_freed_memory": keep}}))
        out = tmp / f"model-{keep}"
        build_big.main(["--config", str(cfg), "--out", str(out)])
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
        child = subprocess.run(
            [sys.executable, "-c", CHILD, str(out), *map(str, bodies)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert child.returncode == 0, child.stderr[-3000:]
        return json.loads(child.stdout.strip().splitlines()[-1])

    return run


def test_a_repeated_forward_faults_no_pages_back_in(served):
    kept, own = served(True), served(False)
    assert kept["allocator"].startswith("freed buffers kept for the next forward (glibc ")
    assert own["allocator"] == "glibc's own (handler.keep_freed_memory: false)"
    # glibc's own: the largest forward's freed activations are unmapped or trimmed, and their pages
    # fault (zeroed) again on most requests (thousands: 17 MB is 4,096 pages); kept: none, but for
    # the odd forward that finds no free block large enough and grows the heap
    assert len(kept["faults"]) == len(own["faults"]) == 15
    assert statistics.median(own["faults"]) >= 1024, (own, kept)
    assert statistics.median(kept["faults"]) <= 16, (own, kept)
