"""The delta file: one safetensors file per sequence in a directory, made visible by a marker.

A **delta** is ``delta-<sequence:08d>.safetensors`` in a directory (a volume shared by every
replica), made visible by a marker ``delta-<sequence:08d>.ready`` written last: a reader never sees
a half-written delta. It holds, per table it changes, ``<table>.ids`` (int64 [n]) and
``<table>.rows`` (float32 [n, D], the trainer's rows), optionally ``dense.<key>`` for every dense
parameter, and in its metadata the model name, the **base** it applies to (the archive's identity,
``base_version``), its sequence number (1, 2, ... on each base) and a sha256 over its tensors.

    >>> import tempfile
    >>> d = tempfile.mkdtemp()  # the deltas' directory
    >>> ids, rows = torch.tensor([3, 7]), torch.zeros(2, 16)  # rows 3 and 7 of feature_0, D = 16
    >>> write_delta(d, model="dlrm", base="0123456789abcdef", sequence=1, tables={"feature_0": (ids, rows)}).name
    'delta-00000001.safetensors'
    >>> sorted(ready_sequences(d)), read_delta(delta_path(d, 1)).rows
    ([1], 2)
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import torch
from safetensors import safe_open
from safetensors.torch import load, save_file

from dlrmkit.errors import DeltaError

FORMAT = "dlrm-delta/1"
BASE_FILE = "delta-base.txt"  # the archive's identity, written by scripts/build_mar.py
DENSE = "dense."  # the key prefix of a dense parameter in a delta
_NAME = re.compile(r"delta-(\d{8})\.ready$")

Tables = Mapping[str, tuple[torch.Tensor, torch.Tensor]]  # table -> (ids int64 [n], fp32 rows [n, D])


def delta_path(directory: str | Path, sequence: int, suffix: str = ".safetensors") -> Path:
    return Path(directory) / f"delta-{sequence:08d}{suffix}"


def base_version(weights: str | Path) -> str:
    """The archive's identity: sha256 of its weights file, 16 hex digits. Deltas name it, so a delta
    made for another archive (or after a rollout to a new one) is refused."""
    h = hashlib.sha256()
    with open(weights, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()[:16]


def checksum(tensors: Mapping[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for key in sorted(tensors):
        h.update(key.encode())
        h.update(tensors[key].contiguous().view(torch.uint8).reshape(-1).numpy().tobytes())
    return h.hexdigest()


def ready_sequences(directory: str | Path) -> dict[int, Path]:
    """Sequence -> marker of every visible delta in ``directory``."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return {}
    return {int(m.group(1)): Path(directory) / n for n in names if (m := _NAME.match(n))}


def next_sequence(directory: str | Path) -> int:
    return max(ready_sequences(directory), default=0) + 1


def write_delta(
    directory: str | Path,
    model: str,
    base: str,
    sequence: int,
    tables: Tables,
    dense: Mapping[str, torch.Tensor] | None = None,
    extra: Mapping[str, str] | None = None,
) -> Path:
    """Write delta ``sequence`` atomically: the file under a temporary name, renamed into place,
    then its ``.ready`` marker, also renamed into place. ``tables``: name -> (ids, fp32 rows)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}  # own copies: safetensors refuses tensors that share memory
    for name, (ids, rows) in tables.items():
        tensors[f"{name}.ids"] = torch.as_tensor(ids, dtype=torch.int64).reshape(-1).clone()
        tensors[f"{name}.rows"] = torch.as_tensor(rows).detach().to(torch.float32).clone()
    for key, value in (dense or {}).items():
        tensors[DENSE + key] = value.detach().to(torch.float32).clone()
    meta = {
        "format": FORMAT,
        "model": model,
        "base": base,
        "sequence": str(sequence),
        "tables": ",".join(tables),
        "created": repr(time.time()),
        "checksum": checksum(tensors),
        **(extra or {}),
    }
    final = delta_path(directory, sequence)
    tmp = directory / f".{final.name}.{os.getpid()}.tmp"
    save_file(tensors, str(tmp), metadata=meta)
    _fsync_replace(tmp, final)
    marker = delta_path(directory, sequence, ".ready")
    tmp = directory / f".{marker.name}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps({"sequence": sequence, "rows": sum(len(i) for i, _ in tables.values())}))
    _fsync_replace(tmp, marker)
    return final


def _fsync_replace(tmp: Path, final: Path) -> None:
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)


@dataclass
class Delta:
    """A delta read back: ``tables`` table -> (ids, fp32 rows), ``dense`` key -> fp32 parameter."""

    path: Path
    model: str
    base: str
    sequence: int
    created: float
    tables: dict[str, tuple[torch.Tensor, torch.Tensor]]
    dense: dict[str, torch.Tensor]
    meta: dict[str, str] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return sum(len(ids) for ids, _ in self.tables.values())


def read_delta(path: str | Path) -> Delta:
    """Read and check a delta file's integrity (not yet whether it fits a model:
    ``dlrmkit.live.validate.Target.check``); raises DeltaError."""
    path = Path(path)
    try:
        data = path.read_bytes()
        tensors = load(data)
        n = int.from_bytes(data[:8], "little")
        meta = json.loads(data[8 : 8 + n]).get("__metadata__") or {}
    except Exception as e:  # safetensors raises its own error type for a truncated or foreign file
        raise DeltaError("corrupt", f"not a readable safetensors file ({type(e).__name__}: {e})") from None
    if meta.get("format") != FORMAT:
        raise DeltaError("format", f"metadata format is {meta.get('format')!r}, expected {FORMAT!r}")
    if checksum(tensors) != meta.get("checksum"):
        raise DeltaError("checksum", "the tensors' sha256 differs from the metadata's checksum")
    names = [t for t in (meta.get("tables") or "").split(",") if t]
    want = {f"{t}.{part}" for t in names for part in ("ids", "rows")}
    stray = sorted(k for k in tensors if k not in want and not k.startswith(DENSE))
    if stray or not want <= set(tensors):
        raise DeltaError(
            "format", f"tensors {stray or sorted(want - set(tensors))} do not match the tables {names} of the metadata"
        )
    try:
        sequence, created = int(meta["sequence"]), float(meta.get("created", "0"))
    except (KeyError, ValueError):
        raise DeltaError("format", f"metadata sequence {meta.get('sequence')!r} is not an integer") from None
    return Delta(
        path,
        meta.get("model", ""),
        meta.get("base", ""),
        sequence,
        created,
        {t: (tensors[f"{t}.ids"], tensors[f"{t}.rows"]) for t in names},
        {k[len(DENSE) :]: v for k, v in tensors.items() if k.startswith(DENSE)},
        meta,
    )


def read_dense(path: str | Path) -> dict[str, torch.Tensor]:
    """A delta's dense parameters alone (its rows are not read), {} if it has none. For a delta
    that was validated already."""
    with safe_open(str(path), framework="pt") as f:
        return {k[len(DENSE) :]: f.get_tensor(k) for k in f.keys() if k.startswith(DENSE)}
