"""The shared double-buffered tables: a model's CPU tables as two sides that every worker of the
machine maps shared, written by one writer (an flock) into the side no worker reads.

``write_rows`` is the one row write of every path (shared sides, a worker's own tables).
"""

from __future__ import annotations

import fcntl
import json
import logging
import mmap
import os
import time
import warnings
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from dlrmkit.errors import ConfigError

logger = logging.getLogger(__name__)

Write = tuple[str, torch.Tensor, torch.Tensor]  # (table, ids, fused rows as wide as the table's rows)


def write_rows(view: torch.Tensor, ids: torch.Tensor, src: torch.Tensor) -> None:
    """Rows ``ids`` of table ``view`` (uint8 [rows, row bytes]) <- ``src`` (whole fused rows)."""
    if view.shape[1] % 8 == 0 and view.data_ptr() % 8 == 0:  # rows are 8-byte aligned: copy
        view, src = view.view(torch.int64), src.view(torch.int64)  # 8 bytes at a time (~2x)
    view.index_copy_(0, ids.to(view.device), src.to(view.device))


def write_all(views: Mapping[str, torch.Tensor], writes: Sequence[Write]) -> None:
    """Every write of a converted delta into the tables ``views`` (table -> fused rows)."""
    for table, ids, src in writes:
        write_rows(views[table], ids, src)


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

    ``layout``: table -> (kernel, byte offset in its weight buffer, (rows, row bytes), row stride);
    ``sizes``: bytes of each kernel's weight buffer; ``tbes``: a worker's kernels (fbgemm's, which
    it flips and makes the sides from); the writer process has none.
    """

    META = "tables.meta"
    LOCK = "writer.lock"

    def __init__(
        self,
        layout: Mapping[str, tuple[int, int, Sequence[int], int]],
        sizes: list[int],
        directory: str | Path,
        base: str,
        tbes: list[Any] | None = None,
        fd: int | None = None,
    ):
        self.layout = {
            t: (i, off, (int(shape[0]), int(shape[1])), stride) for t, (i, off, shape, stride) in layout.items()
        }
        self.sizes = list(sizes)
        self.dir, self.base = Path(directory), base
        self.dir.mkdir(parents=True, exist_ok=True)
        self.tbes = tbes or []
        self.initial = [tbe.weights_host for tbe in self.tbes]  # the archive's mapping, until the first flip
        self._maps: dict[int, list[tuple[mmap.mmap, torch.Tensor]]] = {}
        self.fd = fd  # the writer's flock (the writer process inherits its worker's: held while either lives)
        self.is_writer = fd is not None

    @classmethod
    def of(cls, qebc: Any, directory: str | Path, base: str) -> SharedTables:
        """The shared tables of a worker's (unsharded, host-memory) quantized EBC (torchrec's, whose
        kernels are fbgemm's, untyped)."""
        tbes = list(qebc._emb_modules)
        layout = {}
        for i, (tables, tbe) in enumerate(zip(qebc._key_to_tables.values(), tbes)):
            start = tbe.weights_host.data_ptr()
            for cfg, (rows, _, _) in zip(tables, tbe.split_embedding_weights_with_scale_bias(split_scale_bias_mode=0)):
                layout[cfg.name] = (i, rows.data_ptr() - start, tuple(rows.shape), rows.stride(0))
        return cls(layout, [tbe.host_size for tbe in tbes], directory, base, tbes)

    @staticmethod
    def usable(qebc: Any) -> bool:
        """Tables in host memory (not on a GPU): the kernels read ``weights_host``."""
        return all(getattr(t, "host_size", 0) > 0 for t in qebc._emb_modules)

    def path(self, i: int, side: int) -> Path:
        return self.dir / f"tables-{self.base}-{i}-{side}.bin"

    def buffers(self, side: int) -> list[torch.Tensor]:
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

    def meta(self) -> dict[str, Any] | None:
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
        if not self.is_writer:
            if self.fd is None:
                self.fd = os.open(self.dir / self.LOCK, os.O_CREAT | os.O_RDWR, 0o644)
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
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
