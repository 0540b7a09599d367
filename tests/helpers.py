"""Request builders and tiny-model helpers shared by the tests."""

from __future__ import annotations

import copy
import importlib.util
import json
import re
import sys
import os
import time
from pathlib import Path
from typing import Callable, TypeVar

import torch

from conftest import tiny_config
from dlrmkit.model import DLRMFactory

T = TypeVar("T")


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


def tiny_mar(tmp: Path, **settings) -> Path:
    """scripts/build_mar.py's archive of the tiny model (conftest.TINY) with these TorchServe
    ``settings`` (minWorkers, batchSize, ...) in its model config: tmp/store/dlrm.mar."""
    import yaml

    from conftest import TINY
    from scripts import build_mar

    config = tmp / "model-config.yaml"
    config.write_text(yaml.safe_dump({**settings, "handler": TINY}))
    build_mar.main(["--config", str(config), "--output-dir", str(tmp / "store"), "--force"])
    return tmp / "store" / "dlrm.mar"


def batch(n=64, seed=1):
    """B = n rows of the tiny config: (dense, KJT)."""
    return DLRMFactory(tiny_config()).probe_batch(n, torch.Generator().manual_seed(seed))


def forward(model, dense, kjt):
    with torch.inference_mode():
        return model(dense, kjt)


def wait_until(probe: Callable[[], T], done: Callable[[T], bool], timeout: float = 30.0, every: float = 0.2) -> T:
    """Call ``probe`` until ``done(result)`` or ``timeout`` s have passed; returns the last result,
    so the caller's assertion shows what was seen. Tests wait for what they check, never race it."""
    deadline = time.monotonic() + timeout
    while True:
        result = probe()
        if done(result) or time.monotonic() > deadline:
            return result
        time.sleep(every)


def scrape(srv, model: str = "dlrm") -> dict[str, float]:
    """dlrm_* samples of /metrics (Prometheus text, no token): {'name' or 'name[ErrorType]': value}."""
    from scripts.tsctl import get

    status, text, _ = get(f"{srv.metrics_url}/metrics")
    assert status == 200
    out = {}
    for line in text.decode().splitlines():
        m = re.match(
            r'(dlrm_\w+)\{(?:ErrorType="(\w+)",)?ModelName="'
            + re.escape(model)
            + r'",Level="Model",Hostname="[^"]*",\} (\S+)$',
            line,
        )
        if m:
            out[m.group(1) + (f"[{m.group(2)}]" if m.group(2) else "")] = float(m.group(3))
    return out


def metrics_delta(
    srv, want: dict[str, float], before: dict[str, float], timeout: float = 30.0, model: str = "dlrm"
) -> dict[str, float]:
    """The frontend reads the worker's metric lines asynchronously: poll until the counters have
    moved by at least ``want`` (bounded); the caller asserts exact values on the returned deltas."""

    def delta(now):
        return {k: now.get(k, 0) - before.get(k, 0) for k in set(now) | set(want)}

    return delta(
        wait_until(lambda: scrape(srv, model), lambda now: all(delta(now)[k] >= v for k, v in want.items()), timeout)
    )


def settled(srv, timeout: float = 30.0, model: str = "dlrm") -> dict[str, float]:
    """The counters once earlier requests' metric lines have been read: no change in 1 s (the
    handler emits its sums every 0.25 s, dlrm_handler.METRICS_SECONDS)."""
    last = [scrape(srv, model)]

    def same(now):
        changed, last[0] = now != last[0], now
        return not changed

    time.sleep(1.0)  # the first comparison a second after the first scrape, not at once
    return wait_until(lambda: scrape(srv, model), same, timeout, every=1.0)


def grpc_modules(out: Path):
    """inference_pb2 and inference_pb2_grpc, generated now into `out` from the inference.proto
    TorchServe ships in its frontend jar (its google/rpc/status.proto only as an include)."""
    import zipfile

    from grpc_tools import protoc

    from scripts.tsctl import BIN

    jar = next((BIN.parent / "lib").glob("python3*/site-packages/ts/frontend/model-server.jar"))
    with zipfile.ZipFile(jar) as z:
        for name in ("inference.proto", "google/rpc/status.proto"):
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            (out / name).write_bytes(z.read(name))
    well_known = Path(protoc.__file__).parent / "_proto"
    rc = protoc.main(
        [
            "protoc",
            f"-I{out}",
            f"-I{well_known}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            str(out / "inference.proto"),
        ]
    )
    assert rc == 0
    # The stub imports its messages as a top-level `inference_pb2` (and google.rpc.status_pb2, from
    # googleapis-common-protos): both loaded from `out` by file, the messages registered first.
    modules = []
    for name in ("inference_pb2", "inference_pb2_grpc"):
        spec = importlib.util.spec_from_file_location(name, out / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        modules.append(module)
    return tuple(modules)


def refuse_mmap(monkeypatch) -> None:
    """torch.load(mmap=True) fails as it does for a file larger than the commit limit allows: the
    factory then maps the weights read-only (tables larger than memory)."""
    real_load = torch.load

    def refuse(f, *a, **kw):
        if kw.get("mmap"):
            raise RuntimeError(
                f"unable to mmap {os.path.getsize(f)} bytes from file <{f}>: Cannot allocate memory (12)"
            )
        return real_load(f, *a, **kw)

    monkeypatch.setattr(torch, "load", refuse)
