"""Live model updates: a trainer's changed embedding rows (and dense parameters) applied to a
serving model in order, versioned, never mixing old and new rows within one score.

A **delta** is one safetensors file ``delta-<sequence:08d>.safetensors`` in a directory (a volume
shared by every replica), made visible by a marker ``delta-<sequence:08d>.ready`` written last:
a reader never sees a half-written delta. It holds, per table it changes, ``<table>.ids`` (int64
[n]) and ``<table>.rows`` (float32 [n, D], the trainer's rows), optionally ``dense.<key>`` for every
dense parameter, and in its metadata the model name, the **base** it applies to (the archive's
identity, ``base_version``), its sequence number (1, 2, ... on each base) and a sha256 over its
tensors.

    >>> write_delta(d, model="dlrm", base=base, sequence=1, tables={"feature_0": (ids, rows)})
    PosixPath('d/delta-00000001.safetensors')

``DeltaApplier`` is the serving side (TorchServe-free): ``catch_up`` applies every visible delta
in sequence, ``start`` keeps polling in a thread. Each delta is read, validated and converted to
the tables' dtype exactly as the archive build converts them (``fused_rows``: torchrec's quantizer
for fp16/int8/int4, row-wise, so a row's bytes do not depend on its neighbours). CPU tables are
``SharedTables``: two sides mapped shared by every worker of the machine, written by one writer
(a process of its own, ``writer_main``, run by whichever worker holds the writer's flock) only
into the side no worker reads; a worker flips to the newer side under ``lock``, which the
handler holds for each whole batch's forward (``serving``): every request is scored entirely
before or entirely after a delta. Without a model directory (tests' references) or on a GPU, the
applier writes its own tables in place under the same lock. See docs/live-updates.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch

logger = logging.getLogger(__name__)

FORMAT = "dlrm-delta/1"
BASE_FILE = "delta-base.txt"  # the archive's identity, written by scripts/build_mar.py
STATE_DIR = "delta-state"  # per-worker <pid>.json in the model dir: what the OIP plugin reports
_NAME = re.compile(r"delta-(\d{8})\.ready$")
DENSE = "dense."
# Test only: apply without the lock, pausing this many seconds between tables, so that a test can
# prove its torn-score check catches a torn apply (tests/test_delta_server.py). Never set in serving.
UNGUARDED_ENV = "DLRM_DELTA_TEST_UNGUARDED_PAUSE_S"
WRITER_NICE = 10  # the shared tables' writer process: below the serving workers (writer_main)
COUNTS_FILE = "writer.counts"  # in delta-state/: the writer process's rows and refusals, for its worker's metrics
HANDOVER_S = 0.1  # how long a prepared delta waits for the next batch to write it (DeltaApplier.apply)
REASONS = (
    "format",
    "model",
    "base",
    "sequence",
    "table",
    "shape",
    "dtype",
    "range",
    "duplicate",
    "nonfinite",
    "corrupt",
    "checksum",
    "dense",
)


class DeltaError(Exception):
    """A delta refused: ``reason`` is one of REASONS (the metric's dimension), the message says why."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


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
    tables: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    dense: Mapping[str, torch.Tensor] | None = None,
    extra: Mapping[str, str] | None = None,
) -> Path:
    """Write delta ``sequence`` atomically: the file under a temporary name, renamed into place,
    then its ``.ready`` marker, also renamed into place. ``tables``: name -> (ids, fp32 rows)."""
    from safetensors.torch import save_file

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
    """Read and check a delta file's integrity (not yet whether it fits a model: ``Target.check``)."""
    from safetensors.torch import load

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


def changes(old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]) -> tuple[dict, dict | None]:
    """What a delta from serving state_dict ``old`` to ``new`` (fp32, as dlrmkit.checkpoint imports
    them) carries: per table the rows that differ, and every dense parameter if any of them differs."""
    from dlrmkit.scale import EBC

    prefix = EBC + "embedding_bags."
    tables = {}
    for key, w in new.items():
        if key.startswith(prefix):
            ids = torch.nonzero((w != old[key]).any(dim=1)).reshape(-1)
            if len(ids):
                tables[key[len(prefix) : -len(".weight")]] = (ids, w[ids])
    dense = {k: v for k, v in new.items() if not k.startswith(EBC)}
    moved = any(not torch.equal(v, old[k]) for k, v in dense.items())
    return tables, dense if moved else None


@dataclass
class Target:
    """What a served model accepts: its name, base, tables (name -> (rows, D)), dense parameter
    shapes, and why dense deltas are refused (None: they are taken)."""

    model: str
    base: str
    tables: dict[str, tuple[int, int]]
    dense: dict[str, tuple[int, ...]] = field(default_factory=dict)
    dense_refused: str | None = None

    def check(self, d: Delta, sequence: int) -> None:
        """Raise DeltaError naming the first thing in ``d`` that does not fit, else return."""
        if d.model != self.model:
            raise DeltaError("model", f"made for model {d.model!r}, this is {self.model!r}")
        if d.base != self.base:
            raise DeltaError(
                "base",
                f"made for base {d.base!r}, this archive is {self.base!r} (a delta stream belongs to one archive)",
            )
        if d.sequence != sequence:
            raise DeltaError("sequence", f"its metadata says sequence {d.sequence}, its file name {sequence}")
        for name, (ids, rows) in d.tables.items():
            if name not in self.tables:
                raise DeltaError("table", f"table {name!r} is not in the model (tables: {', '.join(self.tables)})")
            n, dim = self.tables[name]
            if ids.dtype != torch.int64 or ids.dim() != 1:
                raise DeltaError("dtype", f"{name}.ids: expected int64 [n], got {str(ids.dtype)[6:]} {list(ids.shape)}")
            if rows.dtype != torch.float32:
                raise DeltaError("dtype", f"{name}.rows: expected float32, got {str(rows.dtype)[6:]}")
            if tuple(rows.shape) != (len(ids), dim):
                raise DeltaError(
                    "shape", f"{name}.rows: expected [{len(ids)}, {dim}] (ids x embedding_dim), got {list(rows.shape)}"
                )
            if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= n):
                bad = int(ids[(ids < 0) | (ids >= n)][0])
                raise DeltaError("range", f"{name}.ids: id {bad} is out of range [0, {n})")
            if len(torch.unique(ids)) != len(ids):
                raise DeltaError("duplicate", f"{name}.ids: an id appears twice (which row would win?)")
            if not bool(torch.isfinite(rows).all()):
                raise DeltaError("nonfinite", f"{name}.rows: NaN or Inf values")
        if d.dense:
            if self.dense_refused:
                raise DeltaError("dense", self.dense_refused)
            if set(d.dense) != set(self.dense):
                odd = sorted(set(d.dense) ^ set(self.dense))
                raise DeltaError(
                    "dense",
                    f"dense parameters must be complete and the model's own; {len(odd)} differ, e.g. {odd[0]!r}",
                )
            for key, value in d.dense.items():
                if tuple(value.shape) != self.dense[key]:
                    raise DeltaError("shape", f"dense {key}: expected {list(self.dense[key])}, got {list(value.shape)}")
                if not bool(torch.isfinite(value).all()):
                    raise DeltaError("nonfinite", f"dense {key}: NaN or Inf values")


def fused_rows(rows: Mapping[str, torch.Tensor], dtype: str) -> dict[str, torch.Tensor]:
    """Table name -> the fused kernel's bytes (uint8 [n, row bytes]) of fp32 ``rows``, made as
    ``DLRMFactory.archive_state`` makes a whole table's: the same torchrec quantizer (row-wise,
    so a subset of rows converts to exactly the bytes those rows have in a full build)."""
    from torch import nn
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from dlrmkit.scale import EBC, copy_tables, fused_tables, quant_ebc, quantize, saved_state

    rows = {t: r for t, r in rows.items() if len(r)}
    if not rows:
        return {}
    tables = [
        EmbeddingBagConfig(name=t, embedding_dim=r.shape[1], num_embeddings=r.shape[0], feature_names=[t])
        for t, r in rows.items()
    ]
    prefix = EBC + "embedding_bags."
    if dtype == "fp32":
        qebc = quant_ebc(tables, torch.device("cpu"))
        copy_tables(qebc, {f"{prefix}{t}.weight": r.contiguous().view(torch.uint8) for t, r in rows.items()})
        out = fused_tables(qebc)
    else:
        ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
        ebc.load_state_dict({f"embedding_bags.{t}.weight": r.contiguous() for t, r in rows.items()}, assign=True)
        shell = nn.Module()
        shell.sparse_arch = nn.Module()
        shell.sparse_arch.embedding_bag_collection = ebc
        out = saved_state(quantize(shell, dtype))
    return {k[len(prefix) : -len(".weight")]: v for k, v in out.items() if k.startswith(prefix)}


Write = tuple[str, torch.Tensor, torch.Tensor]  # (table, ids, fused rows as wide as the table's rows)


@dataclass
class Prepared:
    """What ``apply`` does under the lock: write a converted delta into this worker's own tables
    (``side`` None), or flip to shared side ``side``, which holds ``sequence``."""

    delta: Delta | None
    writes: list[Write]
    dense_parts: dict[str, torch.nn.Module]
    side: int | None = None
    sequence: int = 0


def _write(view: torch.Tensor, ids: torch.Tensor, src: torch.Tensor) -> None:
    if view.shape[1] % 8 == 0 and view.data_ptr() % 8 == 0:  # rows are 8-byte aligned: copy
        view, src = view.view(torch.int64), src.view(torch.int64)  # 8 bytes at a time (~2x)
    view.index_copy_(0, ids.to(view.device), src.to(view.device))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


class SharedTables:
    """A model's CPU tables as two files, sides 0 and 1, that every worker on the machine maps
    shared: deltas keep one machine-wide copy per side instead of making each worker's written
    pages private.

    Only the **writer** (whichever worker holds ``writer.lock``, an flock the kernel drops when it
    dies) writes, and only into the side no worker reads: it brings that side up to the active
    one, writes the next deltas, then makes it the active side in ``tables.meta``. Each worker
    flips to the active side between two batches (a pointer swap under its batch lock) and then
    records the side it reads in its state file; the writer touches a side again only once no live
    worker records it. A worker joins by recording the active side and reading ``tables.meta``
    again: it serves that side only once the side was still active after it was recorded.

        sides:   0: seq 4 (active, read by workers 11 and 12)   1: seq 3 (free)
        writer:  1 <- deltas 4 and 5; tables.meta: active 1 (seq 5)
        workers: flip to 1 one by one; once neither records 0, side 0 is free for delta 6
    """

    META = "tables.meta"
    LOCK = "writer.lock"

    def __init__(
        self,
        layout: Mapping[str, tuple[int, int, tuple[int, int], int]],
        sizes: list[int],
        directory: str | Path,
        base: str,
        tbes: list | None = None,
    ):
        # table -> (kernel, byte offset in its weight buffer, (rows, row bytes), row stride)
        self.layout = {
            t: (i, off, (int(shape[0]), int(shape[1])), stride) for t, (i, off, shape, stride) in layout.items()
        }
        self.sizes = list(sizes)  # bytes of each kernel's weight buffer
        self.dir, self.base = Path(directory), base
        self.dir.mkdir(parents=True, exist_ok=True)
        self.tbes = tbes or []  # a worker's kernels (flip, create); the writer process has none
        self.initial = [tbe.weights_host for tbe in self.tbes]  # the archive's mapping, until the first flip
        self._maps: dict[int, list[tuple[Any, torch.Tensor]]] = {}
        self._fd: int | None = None
        self.is_writer = False

    @classmethod
    def of(cls, qebc: torch.nn.Module, directory: str | Path, base: str) -> SharedTables:
        """The shared tables of a worker's (unsharded, host-memory) quantized EBC."""
        tbes = list(qebc._emb_modules)  # type: ignore[union-attr,arg-type]
        layout = {}
        for i, (tables, tbe) in enumerate(zip(qebc._key_to_tables.values(), tbes)):  # type: ignore
            start = tbe.weights_host.data_ptr()
            for cfg, (rows, _, _) in zip(tables, tbe.split_embedding_weights_with_scale_bias(split_scale_bias_mode=0)):
                layout[cfg.name] = (i, rows.data_ptr() - start, tuple(rows.shape), rows.stride(0))
        return cls(layout, [tbe.host_size for tbe in tbes], directory, base, tbes)

    @staticmethod
    def usable(qebc: torch.nn.Module) -> bool:
        """Tables in host memory (not on a GPU): the kernels read ``weights_host``."""
        return all(getattr(t, "host_size", 0) > 0 for t in qebc._emb_modules)  # type: ignore[union-attr]

    def path(self, i: int, side: int) -> Path:
        return self.dir / f"tables-{self.base}-{i}-{side}.bin"

    def buffers(self, side: int) -> list[torch.Tensor]:
        import mmap
        import warnings

        if side not in self._maps:
            maps = []
            for i, size in enumerate(self.sizes):
                with open(self.path(i, side), "r+b") as f:
                    m = mmap.mmap(f.fileno(), size)  # MAP_SHARED: every worker's view of one page cache
                m.madvise(mmap.MADV_RANDOM)  # lookups are random: no read-ahead of rows nobody asked for
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)
                    maps.append((m, torch.frombuffer(m, dtype=torch.uint8)))
            self._maps[side] = maps
        return [t for _, t in self._maps[side]]

    def views(self, side: int) -> dict[str, torch.Tensor]:
        bufs = self.buffers(side)
        return {t: bufs[i].as_strided(shape, (stride, 1), off) for t, (i, off, shape, stride) in self.layout.items()}

    def meta(self) -> dict | None:
        try:
            m = json.loads((self.dir / self.META).read_text())
        except (FileNotFoundError, ValueError):
            return None
        return m if m.get("base") == self.base else None

    def set_meta(self, **changes: Any) -> None:
        m = {**(self.meta() or {"base": self.base}), **changes}
        tmp = self.dir / f".{self.META}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(m))
        os.replace(tmp, self.dir / self.META)

    def take_writer(self) -> bool:
        """Hold (or take over) the writer's flock; True while this worker is the writer."""
        import fcntl

        if not self.is_writer:
            if self._fd is None:
                self._fd = os.open(self.dir / self.LOCK, os.O_CREAT | os.O_RDWR, 0o644)
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self.is_writer = True
            except BlockingIOError:
                return False
        return True

    def create(self) -> None:
        """The writer, on a fresh model directory: both sides from this worker's loaded tables."""
        m = self.meta()
        if m is not None and all(
            self.path(i, s).is_file() and self.path(i, s).stat().st_size == size
            for i, size in enumerate(self.sizes)
            for s in (0, 1)
        ):
            return
        assert self.tbes, "only a worker, which holds the loaded tables, makes the sides"
        need = 2 * sum(self.sizes)
        st = os.statvfs(self.dir)
        if st.f_bavail * st.f_frsize < need + (64 << 20):
            from dlrmkit.errors import ConfigError

            raise ConfigError(
                f"handler.delta_dir: live updates keep two shared copies of the tables ({need / 2**30:.2f} GiB) in "
                f"{self.dir}, which has {st.f_bavail * st.f_frsize / 2**30:.2f} GiB free"
            )
        started = time.perf_counter()
        for side in (0, 1):
            for i, size in enumerate(self.sizes):
                with open(self.path(i, side), "wb") as f:
                    f.truncate(size)
                self._copy(self.initial[i], self.buffers(side)[i])
        self.set_meta(active=0, seq=[0, 0], checked=time.time())
        logger.info(
            "live updates: the tables shared as 2 x %.1f MiB in %s (%.1f s)",
            need / 2 / 2**20,
            self.dir,
            time.perf_counter() - started,
        )

    @staticmethod
    def _copy(src: torch.Tensor, dst: torch.Tensor, chunk: int = 1 << 28) -> None:
        for a in range(0, src.numel(), chunk):  # in pieces: tables larger than memory stream through
            dst[a : a + chunk].copy_(src[a : a + chunk])

    def copy_side(self, src: int, dst: int) -> None:
        for a, b in zip(self.buffers(src), self.buffers(dst)):
            self._copy(a, b)

    def flip(self, side: int) -> None:
        for tbe, buf in zip(self.tbes, self.buffers(side)):
            tbe.weights_host = buf

    def readers(self) -> set[int]:
        """The sides the live workers record in their state files."""
        sides = set()
        for f in self.dir.glob("*.json"):
            try:
                state = json.loads(f.read_text())
            except (OSError, ValueError):  # being replaced right now: read it again
                try:
                    state = json.loads(f.read_text())
                except (OSError, ValueError):
                    continue
            if state.get("buffer") is not None and _alive(int(state.get("pid", 0))):
                sides.add(int(state["buffer"]))
        return sides


class TableWriter:
    """Reads, validates and converts deltas (``checked``, ``convert``) and, for shared tables, writes
    them into the free side (``write_round``). A worker uses one for its own tables and for its
    catch-up at start; while the workers serve, a machine's shared tables are written by one in a
    process of its own (``writer_main``), so that its Python never holds a serving worker's GIL.

    ``widths``: table -> bytes of a row in the fused kernel. ``on_rows(n)`` / ``on_refused(reason)``:
    what to count (the worker's metrics, or the writer process's counts file).
    """

    def __init__(
        self,
        directory: str | Path,
        target: Target,
        dtype: str,
        widths: Mapping[str, int],
        shared: SharedTables | None = None,
        on_rows: Any = None,
        on_refused: Any = None,
    ):
        self.directory, self.target, self.dtype, self.widths = Path(directory), target, dtype, dict(widths)
        self.shared = shared
        self.on_rows = on_rows or (lambda n: None)
        self.on_refused = on_refused or (lambda reason: None)
        self.refused: dict[int, tuple[tuple[int, int], str]] = {}  # sequence -> (file stat, reason)
        self._gap_logged = 0
        self._cache: dict[int, list[Write]] = {}  # converted deltas, for the other side
        pause = os.environ.get(UNGUARDED_ENV)
        self.unguarded_pause = float(pause) if pause else None

    def convert(self, d: Delta, sequence: int) -> list[Write]:
        """Validate ``d`` against the model and convert its rows to the tables' bytes."""
        self.target.check(d, sequence)
        fused = fused_rows({t: rows for t, (_, rows) in d.tables.items()}, self.dtype)
        writes = []
        for t, (ids, _) in d.tables.items():
            if t in fused:
                src, width = fused[t], self.widths[t]
                if src.shape[1] > width:
                    raise DeltaError("shape", f"{t}: converted rows are {src.shape[1]} bytes, the table's {width}")
                # Whole rows, the kernel's padding zero-filled as the build leaves it: one contiguous
                # row copy each (a strided write of part rows took ~10x longer under the lock)
                writes.append((t, ids, torch.nn.functional.pad(src, (0, width - src.shape[1]))))
        return writes

    def checked(self, seq: int, ready: dict[int, Path], prepare: Any = None) -> Prepared | None:
        """Delta ``seq`` read and made ready by ``prepare(delta, seq)`` (default: converted rows), or
        None (missing, or refused: logged, counted)."""
        if seq not in ready:
            later = [s for s in ready if s > seq]
            if later and self._gap_logged != seq:
                logger.warning("delta %08d is missing while %d later ones are visible: waiting for it", seq, len(later))
                self._gap_logged = seq
            return None
        path = delta_path(self.directory, seq)
        try:
            st = path.stat()
            stamp = (st.st_size, st.st_mtime_ns)
        except FileNotFoundError:
            stamp = (-1, 0)
        if seq in self.refused and self.refused[seq][0] == stamp:
            return None  # refused as it is: wait for a replacement (renamed over it)
        try:
            if stamp[0] < 0:
                raise DeltaError("corrupt", "its .ready marker is there but the delta file is not")
            d = read_delta(path)
            return prepare(d, seq) if prepare else Prepared(d, self.convert(d, seq), {})
        except DeltaError as e:
            self.refused[seq] = (stamp, e.reason)
            logger.error(
                "delta %s REFUSED (%s): %s; the model is unchanged, waiting for a valid delta %08d",
                path.name,
                e.reason,
                e,
                seq,
            )
            self.on_refused(e.reason)
            return None

    def write_round(self) -> bool:
        """The next visible deltas (up to 16) into the free side, which becomes active."""
        sh = self.shared
        assert sh is not None and sh.is_writer
        sh.create()
        m = sh.meta()
        assert m is not None
        active, seqs = m["active"], list(m["seq"])
        cur = seqs[active]
        ready = ready_sequences(self.directory)
        target = active if self.unguarded_pause is not None else 1 - active
        if cur + 1 not in ready or (target != active and target in sh.readers()):
            sh.set_meta(checked=time.time())  # nothing to do, or a worker still reads the free side: next poll
            return False
        started = time.perf_counter()
        batch: list[Prepared] = []
        while len(batch) < 16 and (p := self.checked(cur + 1 + len(batch), ready)) is not None:
            batch.append(p)
        if not batch:
            sh.set_meta(checked=time.time())
            return False
        views = sh.views(target)
        if target != active:
            sh.set_meta(seq=[None if s == target else q for s, q in enumerate(seqs)])  # being written
            if not self._replay(views, seqs[target], cur):
                sh.copy_side(active, target)
        for p in batch:
            for table, ids, src in p.writes:
                _write(views[table], ids, src)
                if self.unguarded_pause is not None:  # the test-only torn apply: the active side, pausing
                    time.sleep(self.unguarded_pause)
            self._cache[p.delta.sequence] = p.writes  # type: ignore[union-attr]
        seqs[target] = batch[-1].delta.sequence  # type: ignore[union-attr]
        sh.set_meta(active=target, seq=seqs, checked=time.time())
        self._cache = {s: w for s, w in self._cache.items() if s > cur}
        for p in batch:
            d = p.delta
            assert d is not None
            self.on_rows(d.rows)
            _log_applied(d, started, f" into shared tables side {target}")
        return True

    def _replay(self, views: dict[str, torch.Tensor], have: int | None, want: int) -> bool:
        """Bring a side from sequence ``have`` to ``want`` (the deltas the other side already has);
        False: it cannot (half written, or a delta no longer readable): copy the other side instead."""
        if have is None or have > want:
            return False
        for seq in range(have + 1, want + 1):
            writes = self._cache.get(seq)
            if writes is None:
                try:
                    writes = self.convert(read_delta(delta_path(self.directory, seq)), seq)
                except DeltaError:
                    return False
            for table, ids, src in writes:
                _write(views[table], ids, src)
        return True


def _log_applied(d: Delta, started: float, extra: str) -> None:
    logger.info(
        "delta %s applied: %d rows in %d table(s)%s, %.1f ms%s",
        d.path.name,
        d.rows,
        len(d.tables),
        ", dense parameters" if d.dense else "",
        (time.perf_counter() - started) * 1000,
        extra,
    )


def writer_main(argv: list[str] | None = None) -> None:
    """The shared tables' writer, a process of its own (``DeltaApplier._tend_writer`` starts it with
    a spec file and the flock it holds): write rounds every ``poll_s`` until its worker exits."""
    import ctypes
    import signal

    spec = json.loads(Path((argv if argv is not None else sys.argv[1:])[0]).read_text())
    try:  # PR_SET_PDEATHSIG: killed with its worker, so that it never writes for a dead one
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s delta writer: %(message)s")
    logger.setLevel(logging.INFO)  # its own lines; the libraries' at WARNING
    os.nice(WRITER_NICE)  # the whole process below the serving workers (no GIL shared with them)
    torch.set_num_threads(1)
    t = spec["target"]
    target = Target(
        t["model"],
        t["base"],
        {k: (int(v[0]), int(v[1])) for k, v in t["tables"].items()},
        {k: tuple(v) for k, v in t["dense"].items()},
        t["dense_refused"],
    )
    shared = SharedTables(spec["layout"], spec["sizes"], spec["state_dir"], spec["base"])
    shared._fd, shared.is_writer = spec["fd"], True  # the worker's flock, inherited: held while either lives
    counts: dict[str, Any] = {"pid": os.getpid(), "rows": 0, "refused": {}}

    def save() -> None:
        tmp = shared.dir / f".{COUNTS_FILE}.tmp"
        tmp.write_text(json.dumps(counts))
        os.replace(tmp, shared.dir / COUNTS_FILE)

    def on_rows(n: int) -> None:
        counts["rows"] += n
        save()

    def on_refused(reason: str) -> None:
        counts["refused"][reason] = counts["refused"].get(reason, 0) + 1
        save()

    widths = {name: shape[1] for name, (_, _, shape, _) in shared.layout.items()}
    writer = TableWriter(spec["directory"], target, spec["dtype"], widths, shared, on_rows, on_refused)
    dim = next(iter(target.tables.values()))[1]
    fused_rows({"warm": torch.zeros(1, dim)}, spec["dtype"])  # its imports and set-up before the first delta
    save()
    logger.info("writing the shared tables in %s for worker %d (pid %d)", shared.dir, spec["parent"], os.getpid())
    while os.getppid() == spec["parent"]:
        try:
            while writer.write_round():
                pass
        except Exception:  # never let the writer die: log, wait, retry
            logger.exception("unexpected error (retrying in %.1f s)", spec["poll_s"])
        time.sleep(spec["poll_s"])


class DeltaApplier:
    """Follows a delta directory for one served model (one per worker).

    ``model``: the served DLRM (or dlrmkit.dense.ServedDLRM), unsharded, tables in fbgemm's fused
    kernel. ``factory``: a DLRMFactory, to rebuild the dense half for dense deltas. ``metrics``:
    TorchServe's context.metrics (its lines go out at once, from any thread), or None.
    ``state_dir``: the model directory, where each worker records what it serves; with it, CPU
    tables are shared by the workers (``SharedTables``), without it (or on a GPU) each applier
    writes its own tables in place.
    """

    JOIN_WAIT_S = 120.0  # how long a starting worker waits for the writer to catch up

    def __init__(
        self,
        model: torch.nn.Module,
        config: Any,
        factory: Any,
        directory: str | Path,
        target: Target,
        poll_s: float = 0.5,
        metrics: Any = None,
        state_dir: str | Path | None = None,
        worker: str | None = None,
    ):
        from dlrmkit.scale import fused_tables

        self.model, self.config, self.factory = model, config, factory
        self.target, self.poll_s, self.metrics = target, poll_s, metrics
        qebc: Any = model.sparse_arch.embedding_bag_collection  # type: ignore[union-attr]
        self.views = {k.rsplit(".", 2)[-2]: v for k, v in fused_tables(qebc).items()}
        self.lock = threading.Lock()
        self.applied = 0
        self.rows_applied = 0
        self.model_dir = Path(state_dir) if state_dir else Path(".")  # the archive's files (calibration)
        self.state_file = Path(state_dir) / STATE_DIR / f"{worker or os.getpid()}.json" if state_dir else None
        self.shared = (
            SharedTables.of(qebc, Path(state_dir) / STATE_DIR, target.base)
            if (state_dir and SharedTables.usable(qebc))
            else None
        )
        self.side: int | None = None  # the shared side this worker reads (None: its own tables)
        widths = {t: v.shape[1] for t, v in self.views.items()}
        self.writer = TableWriter(
            directory, target, config.embedding_dtype, widths, self.shared, self._count_rows, self._count_refused
        )
        self._started = time.time()
        self._joined = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._child: subprocess.Popen | None = None  # shared tables: the writer process (_tend_writer)
        self._child_counts: dict[str, Any] = {}  # what its counts file said when last relayed
        self._last_gauges = 0.0
        self._locked_ms = 0.0
        self._pending: Prepared | None = None  # prepared, to be written by the next batch (apply)
        self._taken = threading.Event()
        self._last_served = -1e9
        self.applied_at = time.time()
        self.unguarded_pause = self.writer.unguarded_pause
        if self.unguarded_pause is not None:
            logger.warning(
                "%s is set: deltas are applied WITHOUT the lock (a test of the torn-score check)", UNGUARDED_ENV
            )
        self._write_state()

    @contextlib.contextmanager
    def serving(self) -> Iterator[int]:
        """Hold for one whole batch's forward: yields the delta sequence it is scored under. A
        delta the watcher has prepared is written (or flipped to) first, here, on the serving
        thread (see ``apply``)."""
        with self.lock:
            self._last_served = time.monotonic()
            if self._pending is not None:
                self._apply_locked(self._pending)
            yield self.applied

    def catch_up(self) -> int:
        """Apply every delta that is visible and next in sequence; returns how many."""
        before = self.applied
        while self.poll_once():
            pass
        return self.applied - before

    @property
    def directory(self) -> Path:
        return self.writer.directory

    @directory.setter
    def directory(self, path: str | Path) -> None:  # one directory for the applier and its writer
        self.writer.directory = Path(path)

    @property
    def refused(self) -> dict[int, tuple[tuple[int, int], str]]:
        """Sequence -> (file stat, reason) of the deltas this worker refused."""
        return self.writer.refused

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="dlrm-delta-watcher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=10)
        if self._child is not None and self._child.poll() is None:
            self._child.kill()
            self._child.wait(timeout=10)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.catch_up()
                self._tend_writer()
                self._gauges()
            except Exception:  # never let the watcher die: log, wait, retry
                logger.exception("delta watcher: unexpected error (retrying in %.1f s)", self.poll_s)
            self._stop.wait(self.poll_s)

    def _tend_writer(self) -> None:
        """Shared tables, once serving: the worker that holds the writer's flock runs the writes in a
        child process at a lower priority (``writer_main``), started again if it exits. A thread of
        this worker did it before: measured, its Python held the serving thread's GIL while the
        scheduler ran other processes first (a batch stalled up to 86 ms with both CPUs busy,
        9 ms from a process; results/deltas.md)."""
        if self.shared is None or self._stop.is_set() or not self.shared.take_writer():
            return
        if self._child is not None:
            self._relay_counts()
            if self._child.poll() is None:
                return
            logger.error(
                "delta writer process %d exited (%s): starting another", self._child.pid, self._child.returncode
            )
        spec = {
            "directory": str(self.directory),
            "state_dir": str(self.shared.dir),
            "base": self.shared.base,
            "layout": self.shared.layout,
            "sizes": self.shared.sizes,
            "dtype": self.config.embedding_dtype,
            "poll_s": self.poll_s,
            "parent": os.getpid(),
            "fd": self.shared._fd,
            "target": dataclasses.asdict(self.target),
        }
        path = self.shared.dir / f"writer-{os.getpid()}.spec"
        path.write_text(json.dumps(spec))
        # the worker's import path (its model directory holds the handler's modules)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        code = "from dlrmkit.delta import writer_main; writer_main()"
        self._child = subprocess.Popen([sys.executable, "-c", code, str(path)], pass_fds=(spec["fd"],), env=env)
        self._child_counts = {}

    def _relay_counts(self) -> None:
        """The writer process's new rows and refusals since the last look, into this worker's metrics."""
        assert self.shared is not None and self._child is not None
        try:
            now = json.loads((self.shared.dir / COUNTS_FILE).read_text())
        except (OSError, ValueError):
            return
        if now.get("pid") != self._child.pid:
            return  # not yet written by this child
        seen = self._child_counts or {"rows": 0, "refused": {}}
        if now["rows"] > seen["rows"]:
            self._count_rows(now["rows"] - seen["rows"])
        for reason, n in now["refused"].items():
            for _ in range(n - seen["refused"].get(reason, 0)):
                self._count_refused(reason)
        if now != seen:
            self._child_counts = now
            self._write_state()

    def _count_rows(self, n: int) -> None:
        self.rows_applied += n
        self._emit_counter("dlrm_delta_rows_total", n)

    def _count_refused(self, reason: str) -> None:
        self._emit_counter("dlrm_deltas_refused_total", 1, Reason=reason)

    def lag_seconds(self, ready: dict[int, Path] | None = None) -> float:
        """Seconds since the oldest visible delta not yet applied became visible (0: caught up)."""
        ready = ready_sequences(self.directory) if ready is None else ready
        pending = [s for s in ready if s > self.applied]
        if not pending:
            return 0.0
        try:
            return max(0.0, time.time() - ready[min(pending)].stat().st_mtime)
        except FileNotFoundError:
            return 0.0

    def _checked(self, seq: int, ready: dict[int, Path]) -> Prepared | None:
        return self.writer.checked(seq, ready, self.prepare)

    def poll_once(self) -> bool:
        """Look at the directory once; apply the next delta if it is there and valid (shared tables:
        write it if this worker is the writer, and flip to the newest shared side). True: progress."""
        if self.shared is not None:
            if not self._joined:
                self._join()
            # before ``start`` (the catch-up at start) the writer worker writes itself; once serving,
            # its writer process does (_tend_writer)
            wrote = self._thread is None and self.shared.take_writer() and self.writer.write_round()
            return self._follow() or wrote
        started = time.perf_counter()
        prepared = self._checked(self.applied + 1, ready_sequences(self.directory))
        if prepared is None:
            return False
        self.apply(prepared)
        _log_applied(prepared.delta, started, f" ({self._locked_ms:.1f} ms under the lock)")  # type: ignore[arg-type]
        self._count_rows(prepared.delta.rows)  # type: ignore[union-attr]
        self._gauges(force=True)
        return True

    # -- shared tables -------------------------------------------------------------------------

    def _join(self) -> None:
        """Start serving the shared tables: the writer makes them if need be; another worker waits
        (bounded) for the writer to have looked at the directory since this worker started."""
        sh = self.shared
        assert sh is not None
        deadline = time.monotonic() + self.JOIN_WAIT_S
        while True:
            if sh.take_writer():
                sh.create()
                break
            m = sh.meta()
            if m is not None and m.get("checked", 0) > self._started:
                break
            if time.monotonic() > deadline:
                if m is not None:
                    logger.warning(
                        "live updates: the writer has not caught up in %.0f s; serving its tables as they are",
                        self.JOIN_WAIT_S,
                    )
                    break
                raise RuntimeError(
                    f"live updates: no worker made the shared tables in {sh.dir} in {self.JOIN_WAIT_S} s"
                )
            time.sleep(0.05)
        while True:  # record the active side, then make sure it was still active after that
            m = sh.meta()
            assert m is not None
            side = m["active"]
            seq = m["seq"][side]
            self._flip_to(side, seq)
            again = sh.meta() or {}
            if again.get("active") == side and again.get("seq", [None, None])[side] == seq:
                break
        self._joined = True

    def _follow(self) -> bool:
        """Flip to the active side if it holds a newer sequence than this worker serves."""
        m = self.shared.meta() if self.shared else None
        if not m or not self._joined:
            return False
        side, seq = m["active"], m["seq"][m["active"]]
        if seq is None or (seq <= self.applied and side == self.side):
            return False
        self._flip_to(side, seq)
        return True

    def _flip_to(self, side: int, seq: int) -> None:
        started = time.perf_counter()
        dense = self._newest_dense(self.applied, seq) if seq != self.applied else None
        self.apply(Prepared(None, [], self._dense_parts(dense) if dense else {}, side, seq))
        logger.info(
            "serving delta sequence %d (shared tables side %d%s); %.1f ms, %.3f ms under the lock",
            seq,
            side,
            ", new dense parameters" if dense else "",
            (time.perf_counter() - started) * 1000,
            self._locked_ms,
        )
        self._gauges(force=True)

    def _newest_dense(self, after: int, upto: int) -> dict[str, torch.Tensor] | None:
        """The dense parameters of the newest delta in (after, upto] that has them (the writer
        validated them)."""
        from safetensors import safe_open

        for seq in range(upto, after, -1):
            with safe_open(str(delta_path(self.directory, seq)), framework="pt") as f:
                keys = [k for k in f.keys() if k.startswith(DENSE)]
                if keys:
                    return {k[len(DENSE) :]: f.get_tensor(k) for k in keys}
        return None

    # -- both ----------------------------------------------------------------------------------

    def prepare(self, d: Delta, sequence: int) -> Prepared:
        """Validate ``d`` against the model and convert it; nothing served changes."""
        writes = self.writer.convert(d, sequence)
        for table, ids, _ in writes:
            view = self.views[table]
            if self.shared is None and view.device.type == "cpu":
                # The first write to a page of the memory-mapped archive copies it (copy on write):
                # rewrite the rows' current bytes now, outside the lock, so the locked write only
                # copies. Safe while serving: the bytes a forward may read do not change.
                view.index_copy_(0, ids, view.index_select(0, ids))
        dense = self._dense_parts(d.dense) if d.dense and self.shared is None else {}
        return Prepared(d, writes, dense)

    def _dense_parts(self, dense: Mapping[str, torch.Tensor]) -> dict[str, torch.nn.Module]:
        """New dense modules holding ``dense``, frozen as the served ones are."""
        live = self.model
        shell = self.factory.build("cpu", tables_on_meta=True)
        shell.load_state_dict(dict(dense), strict=False)
        shell.sparse_arch = live.sparse_arch
        device = next(iter(self.views.values())).device
        for name in ("dense_arch", "inter_arch", "over_arch"):
            getattr(shell, name).to(device)
        shell.eval()
        from dlrmkit import dense as dense_half

        if isinstance(live, dense_half.ServedDLRM):
            # A compiled dense half (bf16/int8) is compiled again with the new weights, as the worker
            # compiled it at start (int8: the archive's calibration inputs), here in the watcher
            calibration = dense_half.read_calibration(self.model_dir) if live.precision == "int8" else None
            served, line = dense_half.compile_dense(shell, self.config, live.precision, calibration)
            if isinstance(served, dense_half.ServedDLRM):
                logger.info("dense delta: the dense half compiled again: %s", line)
                return {"dense": served.dense}
            logger.warning("dense delta: %s; its dense parameters are served in fp32", line)
            return {"dense": dense_half.DenseHalf(shell).eval()}
        if any(isinstance(getattr(live, n), torch.jit.ScriptModule) for n in ("dense_arch", "over_arch")):
            self.factory.freeze_dense(shell)
        return {n: getattr(shell, n) for n in ("dense_arch", "inter_arch", "over_arch")}

    def apply(self, p: Prepared) -> None:
        """Write ``p`` (or flip to its side) under the lock: all of one delta or none of it, between
        two batches.

        While batches are being served, the work is handed to the serving thread (``serving``
        does it before its next forward, at the serving thread's priority: a low-priority watcher
        holding the lock would stall the batches waiting for it); when idle, or if no batch comes
        within HANDOVER_S, the watcher does it itself."""
        if self.unguarded_pause is not None and p.side is None:  # the test-only torn apply: no lock, pauses
            for table, ids, src in p.writes:
                _write(self.views[table], ids, src)
                time.sleep(self.unguarded_pause)
            self._swap(p)
        else:
            self._taken.clear()
            with self.lock:
                busy = time.monotonic() - self._last_served < 1.0
                if not busy:
                    self._apply_locked(p)
                else:
                    self._pending = p
            if busy and not self._taken.wait(HANDOVER_S):
                with self.lock:
                    if self._pending is p:
                        self._apply_locked(p)
        self._write_state()  # after the flip: the writer reads it to know which side is free

    def _apply_locked(self, p: Prepared) -> None:
        t0 = time.perf_counter()
        with torch.no_grad():
            if p.side is not None:
                self.shared.flip(p.side)  # type: ignore[union-attr]
                self.side = p.side
            for table, ids, src in p.writes:
                _write(self.views[table], ids, src)
        self._swap(p)
        self._pending = None
        self._locked_ms = (time.perf_counter() - t0) * 1000
        self._taken.set()

    def _swap(self, p: Prepared) -> None:
        for name, part in p.dense_parts.items():
            setattr(self.model, name, part)
        self.applied = p.delta.sequence if p.delta is not None else p.sequence
        self.applied_at = time.time()

    def _write_state(self) -> None:
        """<model dir>/delta-state/<pid>.json: this worker's sequence, for the OIP metadata, and
        the shared side it reads, for the writer."""
        if self.state_file is None:
            return
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(
            json.dumps(
                {
                    "sequence": self.applied,
                    "base": self.target.base,
                    "pid": os.getpid(),
                    "buffer": self.side,
                    "applied_at": self.applied_at,
                    "locked_ms": round(self._locked_ms, 3),
                    "rows_applied": self.rows_applied,
                }
            )
        )
        os.replace(tmp, self.state_file)

    def _gauges(self, force: bool = False) -> None:
        """The per-worker gauges, on every apply and at most every 5 s otherwise."""
        now = time.monotonic()
        if self.metrics is None or (not force and now - self._last_gauges < 5):
            return
        self._last_gauges = now
        self._emit("dlrm_delta_sequence", self.applied, "count")
        self._emit("dlrm_delta_lag_seconds", round(self.lag_seconds(), 3), "s")

    def _emit(self, name: str, value: float, unit: str) -> None:
        from ts.metrics.dimension import Dimension
        from ts.metrics.metric_type_enum import MetricTypes

        try:
            self.metrics.add_metric(name, value, unit, None, [Dimension("Worker", str(os.getpid()))], MetricTypes.GAUGE)
        except Exception as e:  # a metric must never stop a delta
            logger.warning("metric %s: %s", name, e)

    def _emit_counter(self, name: str, value: float, **dims: str) -> None:
        if self.metrics is None:
            return
        from ts.metrics.dimension import Dimension

        try:
            self.metrics.add_counter(name, value, None, [Dimension(k, v) for k, v in dims.items()])
        except Exception as e:
            logger.warning("metric %s: %s", name, e)


def target_for(model: torch.nn.Module, config: Any, factory: Any, name: str, base: str, sharded: bool) -> Target:
    """The Target of a served model."""
    tables = dict(zip(config.sparse_features, zip(config.num_embeddings, [config.embedding_dim] * config.num_features)))
    from dlrmkit.scale import EBC

    shapes = {
        k: tuple(v.shape)
        for k, v in factory.build("cpu", tables_on_meta=True).state_dict().items()
        if not k.startswith(EBC)
    }
    refused = "dense-parameter deltas are not taken by a sharded (multi-GPU) worker" if sharded else None
    return Target(name, base, tables, shapes, refused)


def start_watcher(handler: Any, context: Any, dense: str, devices: list) -> DeltaApplier | None:
    """What the handler calls after loading: None without handler.delta_dir; else every visible
    delta applied (before the worker reports ready) and a watcher thread started."""
    config = handler.config
    if not config.delta_dir:
        return None
    from dlrmkit.errors import ConfigError
    from dlrmkit.scale import _MAPPINGS

    model_dir = Path(context.system_properties.get("model_dir") or ".")
    if len(devices) > 1:
        raise ConfigError("handler.delta_dir: live updates take an unsharded model (one device per worker)")
    if _MAPPINGS and devices[0].type != "cpu":
        raise ConfigError(
            "handler.delta_dir: the tables are mapped read-only (larger than memory) and copied to a GPU; "
            "live updates there write rows in place and need them writable"
        )
    base_file = model_dir / BASE_FILE
    if base_file.is_file():
        base = base_file.read_text().strip()
    else:
        serialized = (handler.manifest or {}).get("model", {}).get("serializedFile", "dlrm.pt")
        base = base_version(model_dir / serialized)
        logger.warning(
            "the archive has no %s (built before live updates): its base %s computed from the weights", BASE_FILE, base
        )
    from dlrmkit.model import DLRMFactory

    factory = DLRMFactory(config)
    target = target_for(handler.model, config, factory, handler.model_id[0], base, len(devices) > 1)
    applier = DeltaApplier(
        handler.model,
        config,
        factory,
        config.delta_dir,
        target,
        config.delta_poll_s,
        getattr(context, "metrics", None),
        model_dir,
    )
    started = time.perf_counter()
    # The first conversion pays ~1 s of imports and set-up (measured: 1.1 s for 1,000 int8 rows, then
    # 7 ms for 10,000): paid here, before the worker reports ready, not beside the first delta's batches
    fused_rows({"warm": torch.zeros(1, config.embedding_dim)}, config.embedding_dtype)
    n = applier.catch_up()
    logger.info(
        "live updates from %s (base %s): %d delta(s) applied at start in %.1f s, now at sequence %d",
        config.delta_dir,
        base,
        n,
        time.perf_counter() - started,
        applier.applied,
    )
    applier.start()
    return applier


def tag_responses(context: Any, n: int, sequence: int | None) -> None:
    """X-Delta-Sequence on every response of a batch: the delta sequence its score was made under."""
    if sequence is None:
        return
    for i in range(n):
        context.set_response_header(i, "X-Delta-Sequence", str(sequence))
