"""Hot rows: each table's most looked-up rows copied together at its end, so that most lookups
read a few dense pages instead of one scattered page per row (tables larger than memory).

A packed table of ``R`` rows with ``H`` hot rows is ``R + H`` kernel rows::

    rows 0 .. R-1        every row, where it always was (a cold lookup reads it here)
    rows R .. R+H-1      the H hot rows' copies in id order: kernel row R + j is row hot[j]

A lookup of id ``i`` reads row ``R + j`` when ``i == hot[j]``, else row ``i`` (``HotIndex.redirect``:
a bit per row says whether it is hot, and j is the number of hot rows before it, a popcount: two
reads of a few MiB per table instead of a search). The copies are the rows byte for byte, so a
score is the same whichever copy a lookup reads, and a path that does not redirect (the dense
half's warm-up, a probe) still scores right, only from colder pages. Live deltas write both
copies (``HotIndex.expand``).

Which rows are hot comes from id counts (``read_counts``): a counts file per table of (ids, times
looked up), written by serving workers (``IdCounter``, handler.count_ids_dir), or by
``scripts/count_ids.py`` from a sample of training data. ``choose`` takes the most counted rows of
all tables until a byte budget is spent. The weights file keeps each table's hot ids under
``HOT + table`` (int64, ascending); a file without them is an unpacked model.

``warm`` reads the hot rows' pages into the page cache before the worker reports ready, on 2 MiB
pages where the kernel maps a file so (``huge_pages``), and locks them (``mlock``) where the process
may: a read-only mapping (tables larger than memory) under a ``RLIMIT_MEMLOCK`` at least their size
(``docker run --ulimit memlock=-1``, or CAP_IPC_LOCK).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import logging
import mmap
import os
import resource
import threading
import time
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dlrmkit.errors import ConfigError

logger = logging.getLogger(__name__)

HOT = "hot_rows."  # a table's hot ids in the weights file: HOT + table -> int64 [H], ascending
COLD = "cold_lookups."  # the counted lookups of a table's other rows: COLD + table -> int64 [1] (Fill's order)
COUNTS_FORMAT = "dlrmkit-id-counts/1"
Counts = dict[str, tuple[torch.Tensor, torch.Tensor]]  # table -> (ids int64 [N], times looked up int64 [N])
Write = tuple[str, torch.Tensor, torch.Tensor]  # (table, ids, rows): dlrmkit.live's row writes
_PAGE = mmap.PAGESIZE
PREFETCH_MIN_BYTES = 256 << 20  # a table this large (its own rows) is prefetched and filled; smaller ones stay cached


# --- counts ---------------------------------------------------------------------------------------


def merge(parts: Iterable[Counts]) -> Counts:
    """Counts summed table by table (an id in several parts: its counts added)."""
    ids: dict[str, list[torch.Tensor]] = {}
    counts: dict[str, list[torch.Tensor]] = {}
    for part in parts:
        for table, (i, c) in part.items():
            ids.setdefault(table, []).append(i.to(torch.int64))
            counts.setdefault(table, []).append(c.to(torch.int64))
    out: Counts = {}
    for table in ids:
        unique, inverse = torch.unique(torch.cat(ids[table]), return_inverse=True)
        out[table] = (
            unique,
            torch.zeros(len(unique), dtype=torch.int64).index_add_(0, inverse, torch.cat(counts[table])),
        )
    return out


def count(values: Mapping[str, torch.Tensor]) -> Counts:
    """Table -> looked-up ids (any order, repeats counted) as counts."""
    out: Counts = {}
    for table, v in values.items():
        unique, n = torch.unique(v.to(torch.int64), return_counts=True)
        out[table] = (unique, n)
    return out


def write_counts(path: str | Path, counts: Counts, source: str = "") -> None:
    """A counts file (atomically: readers never see half of one)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save(
        {
            "format": COUNTS_FORMAT,
            "source": source,
            "tables": {t: {"ids": i, "counts": c} for t, (i, c) in counts.items()},
        },
        tmp,
    )
    os.replace(tmp, path)


def read_counts(paths: Sequence[str | Path]) -> Counts:
    """The counts of every file named, or of every ``*.pt`` file in a directory named, summed."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files.extend(sorted(p.glob("*.pt")))
        elif p.is_file():
            files.append(p)
        else:
            raise ConfigError(f"--hot-counts: {p}: no such file or directory")
    if not files:
        raise ConfigError(f"--hot-counts: no counts file (*.pt) in {', '.join(map(str, paths))}")
    parts = []
    for f in files:
        try:
            doc = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:  # torch raises several types for a file that is not its own
            raise ConfigError(f"--hot-counts: {f}: not a counts file ({type(e).__name__}: {e})") from None
        if not isinstance(doc, dict) or doc.get("format") != COUNTS_FORMAT:
            raise ConfigError(
                f"--hot-counts: {f}: not a counts file (expected format {COUNTS_FORMAT!r}; "
                "write one with scripts/count_ids.py or handler.count_ids_dir)"
            )
        part = {}
        for table, entry in doc["tables"].items():
            i, c = entry["ids"], entry["counts"]
            if i.shape != c.shape or i.dim() != 1:
                raise ConfigError(f"--hot-counts: {f}: table {table!r}: ids {list(i.shape)} and counts {list(c.shape)}")
            part[table] = (i, c)
        parts.append(part)
    return merge(parts)


def choose(counts: Counts, rows: Mapping[str, int], row_bytes: int, budget_bytes: int) -> dict[str, torch.Tensor]:
    """Table -> its hot ids (ascending): the most counted rows of all tables together (every
    table's rows cost ``row_bytes``) until ``budget_bytes`` is spent; ids outside their table are
    left out, a table the model does not have is refused. Ties go to the earlier table, then the
    lower id."""
    unknown = sorted(set(counts) - set(rows))
    if unknown:
        raise ConfigError(
            f"--hot-counts: table {unknown[0]!r} is not in the model config (its tables: {', '.join(list(rows)[:5])}...)"
        )
    keep = budget_bytes // row_bytes
    names = [t for t in rows if t in counts]
    per: list[tuple[torch.Tensor, torch.Tensor]] = []
    for t in names:
        i, c = counts[t]
        ok = (i >= 0) & (i < rows[t])
        per.append((i[ok], c[ok]))
    if keep <= 0 or not per:
        return {}
    all_counts = torch.cat([c for _, c in per])
    table_of = torch.cat([torch.full((len(c),), k, dtype=torch.int64) for k, (_, c) in enumerate(per)])
    ids = torch.cat([i for i, _ in per])
    # hottest first; ties: table order, then id (ids are sorted within a table by merge/unique)
    order = torch.argsort(-all_counts, stable=True)[:keep]
    out = {}
    for k, t in enumerate(names):
        mine = order[table_of[order] == k]
        if len(mine):
            out[t] = torch.sort(ids[mine]).values
    return out


# --- serving ----------------------------------------------------------------------------------------


class HotIndex:
    """Where each table's hot rows' copies lie: redirects looked-up ids to them, and makes a row
    write (a live delta) write both copies.

    >>> index = HotIndex({"t": 10}, {"t": torch.tensor([2, 7])})
    >>> index.kernel_row("t", torch.tensor([2, 3, 7]))
    tensor([10,  3, 11])
    """

    def __init__(self, rows: Mapping[str, int], hot: Mapping[str, torch.Tensor], cold: Mapping[str, int] | None = None):
        self.rows = dict(rows)
        self.cold = dict(cold or {})  # table -> the counts' lookups outside its hot rows (the build's)
        self.hot = {t: h.to(torch.int64) for t, h in hot.items() if len(h)}
        # per table: a bit per row (hot or not) in 64-bit words, and the hot rows before each word
        self._rank: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for t, h in self.hot.items():
            if t not in self.rows:
                raise ConfigError(f"the weights' hot rows name table {t!r}, which the model config does not have")
            ids = h.numpy()
            if len(ids) > 1 and not bool((ids[1:] > ids[:-1]).all()):
                raise ConfigError(f"table {t!r}: the weights' hot rows are not in ascending id order without repeats")
            if int(ids[0]) < 0 or int(ids[-1]) >= self.rows[t]:
                raise ConfigError(f"table {t!r}: a hot row id is outside the table's {self.rows[t]} rows")
            words = np.zeros((self.rows[t] + 63) // 64, dtype=np.uint64)
            np.bitwise_or.at(words, ids >> 6, np.left_shift(np.uint64(1), (ids & 63).astype(np.uint64)))
            before = np.zeros(len(words), dtype=np.int64)
            np.cumsum(np.bitwise_count(words)[:-1], out=before[1:])
            self._rank[t] = (words, before)

    def __len__(self) -> int:
        return sum(len(h) for h in self.hot.values())

    def kernel_row(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """The kernel row each id of ``table`` reads: its hot copy where it has one, else itself."""
        if table not in self._rank or not len(ids):
            return ids
        words, before = self._rank[table]
        i = ids.detach().cpu().numpy()  # the ids of a batch on a GPU come back to it below
        word = i >> 6
        bits = words[word]
        shift = (i & 63).astype(np.uint64)
        hit = ((bits >> shift) & np.uint64(1)).astype(bool)
        slot = before[word] + np.bitwise_count(bits & ((np.uint64(1) << shift) - np.uint64(1)))
        return torch.from_numpy(np.where(hit, self.rows[table] + slot, i)).to(ids.device)

    def redirect(self, kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """The batch with every hot id pointing at its copy (keys are tables: one per feature)."""
        values = kjt.values()
        out = values
        at = 0
        for key, n in zip(kjt.keys(), kjt.length_per_key()):
            if key in self._rank and n:
                if out is values:
                    out = values.clone()
                out[at : at + n] = self.kernel_row(key, values[at : at + n])
            at += n
        if out is values:
            return kjt
        return KeyedJaggedTensor(keys=kjt.keys(), values=out, lengths=kjt.lengths(), weights=kjt.weights_or_none())

    def expand(self, writes: Sequence[Write]) -> list[Write]:
        """Row writes plus the same rows written to their hot copies."""
        out = list(writes)
        for table, ids, src in writes:
            got = self.kernel_row(table, ids)
            moved = got != ids
            if bool(moved.any()):
                out.append((table, got[moved], src[moved.to(src.device)]))
        return out

    def regions(self, views: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """The hot copies of each table (table -> its kernel rows, uint8 [R + H, row bytes])."""
        return [views[t][self.rows[t] :] for t in self.hot if t in views]


def huge_pages(root: str | Path = "/sys/kernel/mm/transparent_hugepage") -> bool:
    """Whether a mapping advised MADV_HUGEPAGE may get 2 MiB pages (transparent huge pages
    ``always`` or ``madvise``; ``never``, or a kernel without them: no). ``root`` is for tests."""
    try:
        chosen = Path(root, "enabled").read_text().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return False
    return chosen in ("always", "madvise")


def pmd_mapped(rollup: str | Path = "/proc/self/smaps_rollup") -> int:
    """Bytes of files this process maps with 2 MiB page-table entries (FilePmdMapped)."""
    try:
        for line in Path(rollup).read_text().splitlines():
            if line.startswith("FilePmdMapped:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def warm(regions: Sequence[torch.Tensor], lock: bool, advice_after: int = mmap.MADV_NORMAL) -> dict:
    """Read ``regions`` (views of mapped tables) into the page cache, and with ``lock`` mlock them.
    Each region is advised MADV_SEQUENTIAL while it is read (a fault reads ahead a window of pages,
    not the one page a MADV_RANDOM mapping's fault reads: 12 GiB of hot rows took 392 s page by
    page), then ``advice_after`` (the mapping's own: MADV_RANDOM for ``load_read_only``'s).

    Where the kernel allows (``huge_pages``) each region is also advised MADV_HUGEPAGE, and for good:
    a fault then reads 2 MiB at once, and where the file system caches large folios (ext4 since
    Linux 6.16, xfs) the region is mapped with 2 MiB page-table entries, so a lookup's address
    translation misses the TLB far less. The full DLRMv2's 16 GiB of hot rows on an AMD EPYC (Zen 4,
    Linux 6.18, ext4): read in 27 s against 47 s (MADV_WILLNEED), all of them PMD-mapped, the
    packed model's forward 6% faster on the mean (``bench/bigtables.py profile``). Without that
    support the regions are asked for with MADV_WILLNEED (the reads queued at once) as before.
    Returns what it did: bytes, seconds, locked (bool) and why not, huge_bytes (PMD-mapped)."""
    started = time.perf_counter()
    huge = huge_pages()
    pmd_before = pmd_mapped() if huge else 0
    total = 0
    spans = []
    for r in regions:
        if r.numel() == 0:
            continue
        first = r.data_ptr()
        last = r[-1].data_ptr() + r.shape[1]
        lo, hi = first - first % _PAGE, last + (-last) % _PAGE
        spans.append((lo, hi - lo))
        total += hi - lo
        _madvise(lo, hi - lo, mmap.MADV_SEQUENTIAL)
        if huge:  # kept after the read: the 2 MiB mappings stay (MADV_WILLNEED would read small pages)
            _madvise(lo, hi - lo, mmap.MADV_HUGEPAGE)
        else:
            _madvise(lo, hi - lo, mmap.MADV_WILLNEED)
        flat = r.reshape(-1) if r.is_contiguous() else r.contiguous().view(-1)
        int(flat[:: max(1, _PAGE)].sum())  # one byte of every page: each is read now, not by a request
        _madvise(lo, hi - lo, advice_after)
    result: dict = {"bytes": total, "regions": len(spans), "locked": False}
    result["huge_bytes"] = max(0, pmd_mapped() - pmd_before) if huge else 0
    if lock and spans:
        result.update(_mlock(spans, total))
    elif spans:
        result["why_not_locked"] = (
            "the tables are a private mapping (tables that fit memory): the page cache keeps them"
        )
    result["seconds"] = round(time.perf_counter() - started, 3)
    return result


def lock_said(result: dict) -> str:
    """What ``warm`` did about 2 MiB pages and the lock, for the worker's log line."""
    huge = f"{result.get('huge_bytes', 0) / 2**20:.1f} MiB on 2 MiB pages, "
    return huge + ("locked in memory" if result["locked"] else f"not locked: {result['why_not_locked']}")


def small_tables(views: Mapping[str, torch.Tensor], rows: Mapping[str, int]) -> list[torch.Tensor]:
    """The own rows of every table under ``PREFETCH_MIN_BYTES`` (table -> its kernel rows): the
    tables neither prefetched nor filled, which a worker of tables larger than memory warms whole."""
    return [v[: rows[t]] for t, v in views.items() if rows[t] * v.stride(0) < PREFETCH_MIN_BYTES]


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _madvise(addr: int, length: int, advice: int) -> None:
    _libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length), ctypes.c_int(advice))  # advice: failure is harmless


_SYS_PIDFD_OPEN, _SYS_PROCESS_MADVISE = 434, 440  # the same number on every architecture (syscalls >= 424)
_IOV_MAX = 1024
_pidfd: tuple[int, int] = (-1, -1)  # (pid, its pidfd; -1: process_madvise unavailable, one madvise a page)


def _willneed(addresses: np.ndarray) -> None:
    """MADV_WILLNEED for the pages at ``addresses`` (uint64, page-aligned): one process_madvise call a
    1,024 pages (Linux >= 5.10; ~5x fewer microseconds a page than a madvise call each), else a
    madvise call a page (a seccomp profile that refuses it, an older kernel)."""
    global _pidfd
    pid = os.getpid()
    if _pidfd[0] != pid:
        _pidfd = (pid, _libc.syscall(_SYS_PIDFD_OPEN, ctypes.c_int(pid), ctypes.c_uint(0)))
    start = 0
    if _pidfd[1] >= 0:
        iov = np.empty((len(addresses), 2), dtype=np.uint64)
        iov[:, 0], iov[:, 1] = addresses, _PAGE
        while start < len(iov):
            chunk = iov[start : start + _IOV_MAX]
            done = _libc.syscall(
                _SYS_PROCESS_MADVISE,
                ctypes.c_int(_pidfd[1]),
                ctypes.c_void_p(chunk.ctypes.data),
                ctypes.c_size_t(len(chunk)),
                ctypes.c_int(mmap.MADV_WILLNEED),
                ctypes.c_uint(0),
            )
            if done < 0:
                _pidfd = (pid, -1)
                break
            start += len(chunk)
    for address in addresses[start:].tolist():
        _madvise(address, _PAGE, mmap.MADV_WILLNEED)


def _mlock(spans: Sequence[tuple[int, int]], total: int) -> dict:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    done: list[tuple[int, int]] = []
    for addr, length in spans:
        if _libc.mlock(ctypes.c_void_p(addr), ctypes.c_size_t(length)) != 0:
            err = ctypes.get_errno()
            for a, n in done:
                _libc.munlock(ctypes.c_void_p(a), ctypes.c_size_t(n))
            limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft / 2**20:.1f} MiB"
            return {
                "locked": False,
                "why_not_locked": f"mlock: {os.strerror(err)} (RLIMIT_MEMLOCK {limit}, hot rows "
                f"{total / 2**20:.1f} MiB; docker run --ulimit memlock=-1 or CAP_IPC_LOCK lifts it)",
            }
        done.append((addr, length))
    return {"locked": True}


class Prefetch:
    """Tables larger than memory: before a forward, every page its lookups read outside the hot rows
    is asked of the disk at once (``MADV_WILLNEED`` per page: the reads queued together), so the
    forward's page faults wait on reads already in flight instead of one read after another. Only
    tables of at least ``min_bytes`` (the others stay in the page cache); a page already cached
    costs a lookup in it.

    ``qebc``: torchrec's quantized EBC (fbgemm kernels over mapped weights); ``rows``: table -> its
    own rows (the hot copies after them are warm already). The kernel's buffer is read at each call,
    so a live update's flip to another buffer is followed."""

    def __init__(self, qebc, rows: Mapping[str, int], min_bytes: int | None = None):
        min_bytes = PREFETCH_MIN_BYTES if min_bytes is None else min_bytes
        self.tables: dict[str, tuple[object, int, int, int, int]] = {}
        self.asked: dict[str, int] = {}  # table -> pages asked for so far (Fill reads the busiest first)
        for tables, tbe in zip(qebc._key_to_tables.values(), qebc._emb_modules):
            start = tbe.weights_host.data_ptr()
            for cfg, (view, _, _) in zip(tables, tbe.split_embedding_weights_with_scale_bias(split_scale_bias_mode=0)):
                own = rows[cfg.name]
                if own * view.stride(0) >= min_bytes:
                    self.tables[cfg.name] = (tbe, view.data_ptr() - start, view.stride(0), view.shape[1], own)

    def __bool__(self) -> bool:
        return bool(self.tables)

    def __call__(self, kjt: KeyedJaggedTensor) -> int:
        """Ask for the pages ``kjt``'s lookups will read; returns how many pages were asked for."""
        values = kjt.values()
        asked = 0
        at = 0
        for key, n in zip(kjt.keys(), kjt.length_per_key()):
            entry = self.tables.get(key)
            if entry is not None and n:
                tbe, offset, stride, width, own = entry
                ids = values[at : at + n]
                ids = ids[ids < own]
                base = tbe.weights_host.data_ptr() + offset  # type: ignore[attr-defined]  # fbgemm's kernel
                first = (base + ids * stride) // _PAGE
                pages = torch.unique(torch.cat([first, (base + ids * stride + width - 1) // _PAGE]))
                _willneed(pages.numpy().astype(np.uint64) * np.uint64(_PAGE))
                asked += len(pages)
                self.asked[key] = self.asked.get(key, 0) + len(pages)
            at += n
        return asked


def memory_room(meminfo: str | Path = "/proc/meminfo", cgroup: str | Path = "/sys/fs/cgroup") -> int:
    """Bytes the page cache may still grow by without evicting anything: the machine's free memory
    and, under a cgroup memory limit (v2 ``memory.max``, v1 ``memory/memory.limit_in_bytes``), the
    limit less the cgroup's usage. ``meminfo`` and ``cgroup`` are for tests."""
    room = 0
    for line in Path(meminfo).read_text().splitlines():
        if line.startswith("MemFree:"):
            room = int(line.split()[1]) * 1024
    root = Path(cgroup)
    for limit, usage in (
        ("memory.max", "memory.current"),
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"),
    ):
        try:
            cap, used = (root / limit).read_text().strip(), int((root / usage).read_text())
        except (OSError, ValueError):
            continue
        if cap.isdigit() and int(cap) < 1 << 60:
            room = min(room, int(cap) - used)
    return room


class Fill:
    """Tables larger than memory: once the worker is ready, the rest of their rows is read into the
    page cache in the background, a chunk at a time in file order (plain sequential reads: the disk
    streams them), the table with the most cold lookups per byte first (the build's counts,
    ``cold``; without them the pages this worker's lookups asked for), at most
    ``rate`` bytes a second, until the memory left (``memory_room``) falls to ``floor``. Without it
    the cache fills one random page fault at a time (~16 MB a query at MLPerf's sizes). One worker
    of a machine fills (an flock on the weights file); the others share its page cache."""

    def __init__(
        self,
        path: str,
        regions: Mapping[str, tuple[int, int]],
        prefetch: Prefetch,
        floor: int,
        chunk: int = 32 << 20,
        rate: int = 256 << 20,
        cold: Mapping[str, int] | None = None,
    ):
        self.path, self.regions, self.prefetch = path, dict(regions), prefetch
        self.cold = {t: n for t, n in (cold or {}).items() if t in self.regions}
        self.floor, self.chunk, self.rate = floor, chunk, rate
        self.read = 0
        self.order: list[str] = []  # the table of each chunk read, in order
        self.seconds = 0.0
        self.stopped_by = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dlrm-fill", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        started = time.perf_counter()
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError as e:
            self.stopped_by = f"cannot open {self.path}: {e}"
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                self.stopped_by = "another worker fills"
                return
            buf = bytearray(self.chunk)
            done = {t: 0 for t in self.regions}
            while not self._stop.is_set():
                left = [t for t in self.regions if done[t] < self.regions[t][1]]
                if not left:
                    self.stopped_by = "every table read"
                    break
                if memory_room() < self.floor:
                    self.stopped_by = f"memory left at the floor ({self.floor / 2**30:.1f} GiB)"
                    break
                seen = self.cold or self.prefetch.asked
                table = max(left, key=lambda t: seen.get(t, 0) / self.regions[t][1])
                offset, length = self.regions[table]
                n = min(self.chunk, length - done[table])
                t0 = time.perf_counter()
                got = os.preadv(fd, [memoryview(buf)[:n]], offset + done[table])
                done[table] += n
                self.order.append(table)
                self.read += got
                self._stop.wait(max(0.0, n / self.rate - (time.perf_counter() - t0)))
        finally:
            os.close(fd)
            self.seconds = time.perf_counter() - started
            logger.info(
                "prefetch: %.1f GiB of the large tables read into the page cache in %.0f s (%s)",
                self.read / 2**30,
                self.seconds,
                self.stopped_by or "stopped",
            )

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def wait(self, timeout: float) -> bool:
        """Wait for the reader to end (every table read, or the floor); True if it did."""
        self._thread.join(timeout)
        return not self._thread.is_alive()


class IdCounter:
    """Counts the ids a worker looks up, one forward in ``every``, into ``directory``/counts-<worker>.pt
    (a counts file ``read_counts`` reads) every ``flush_s`` seconds. The serving thread only keeps
    a reference to the sampled forward's ids; a daemon thread counts them (every 64 samples, into
    the recent counts) and merges those into the total it writes (every ``flush_s``): the merge over
    every id counted so far runs once a flush, not once a sample."""

    def __init__(self, directory: str | Path, every: int, flush_s: float = 60.0, worker: str | None = None):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / f"counts-{worker or os.getpid()}.pt"
        self.every, self.flush_s = every, flush_s
        self.seen = 0
        self.sampled = 0
        self._pending: list[Mapping[str, torch.Tensor]] = []
        self._recent: Counts = {}
        self._total: Counts = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dlrm-count-ids", daemon=True)
        self._thread.start()

    def observe(self, kjt: KeyedJaggedTensor) -> None:
        """A forward's ids (before any redirect): every ``every``-th call is kept for counting."""
        self.seen += 1
        if self.seen % self.every:
            return
        self.sampled += 1
        with self._lock:
            self._pending.append(dict(zip(kjt.keys(), torch.split(kjt.values(), kjt.length_per_key()))))
            if len(self._pending) >= 64:
                self._wake.set()

    def _count_pending(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        if pending:
            self._recent = merge([self._recent, *(count(p) for p in pending)])

    def flush(self) -> Path:
        """Count what is pending, merge it into the total and write the file, now."""
        self._count_pending()
        if self._recent:
            self._total, self._recent = merge([self._total, self._recent]), {}
        write_counts(self.path, self._total, source=f"serving worker {os.getpid()}, one forward in {self.every}")
        return self.path

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.is_set():
            self._wake.wait(timeout=max(0.05, self.flush_s - (time.monotonic() - last)))
            self._wake.clear()
            self._count_pending()
            if time.monotonic() - last >= self.flush_s:
                try:
                    self.flush()
                except OSError as e:
                    logger.warning("handler.count_ids_dir: cannot write %s: %s", self.path, e)
                last = time.monotonic()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)
        try:
            self.flush()
        except OSError as e:
            logger.warning("handler.count_ids_dir: cannot write %s: %s", self.path, e)
