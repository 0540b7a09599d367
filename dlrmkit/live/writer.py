"""The writer: reads, validates and converts deltas (``TableWriter``), and for the shared tables writes
them into the free side, in a process of its own (``writer_main``) that the writer worker starts.

    python -c "from dlrmkit.live.writer import writer_main; writer_main()" <spec file>
"""

from __future__ import annotations

import ctypes
import importlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from dlrmkit.errors import DeltaError
from dlrmkit.live.format import Delta, delta_path, read_delta, ready_sequences
from dlrmkit.hot import HotIndex
from dlrmkit.live.tables import SharedTables, Write, write_all
from dlrmkit.live.validate import Target
from dlrmkit.scale import fused_rows

logger = logging.getLogger(__name__)

WRITER_NICE = 10  # the shared tables' writer process: below the serving workers (writer_main)
COUNTS_FILE = "writer.counts"  # in delta-state/: the writer process's rows and refusals, for its worker's metrics
ROUND = 16  # deltas written into a side at most per round


@dataclass
class Prepared:
    """What ``DeltaApplier.apply`` does under the lock: write a converted delta into this worker's own
    tables (``side`` None), or flip to shared side ``side``, which holds ``sequence``."""

    delta: Delta | None
    writes: list[Write]
    dense_parts: dict[str, torch.nn.Module]
    side: int | None = None
    sequence: int = 0


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
        on_rows: Callable[[int], None] | None = None,
        on_refused: Callable[[str], None] | None = None,
        hot: HotIndex | None = None,
    ):
        self.directory, self.target, self.dtype, self.widths = Path(directory), target, dtype, dict(widths)
        self.hot = hot  # a packed model's hot rows: a row written is written to its copy too
        self.shared = shared
        self.on_rows = on_rows or (lambda n: None)
        self.on_refused = on_refused or (lambda reason: None)
        self.refused: dict[int, tuple[tuple[int, int], str]] = {}  # sequence -> (file stat, reason)
        self._gap_logged = 0
        self._cache: dict[int, list[Write]] = {}  # converted deltas, for the other side

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
        return self.hot.expand(writes) if self.hot is not None else writes

    def checked(
        self, seq: int, ready: Mapping[int, Path], prepare: Callable[[Delta, int], Prepared] | None = None
    ) -> Prepared | None:
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

    def side_to_write(self, active: int) -> int:
        """The side the next deltas go into: the free one (the workers read ``active``)."""
        return 1 - active

    def write(self, views: Mapping[str, torch.Tensor], writes: Sequence[Write]) -> None:
        """One converted delta into a side's tables."""
        write_all(views, writes)

    def write_round(self) -> bool:
        """The next visible deltas (up to ROUND) into the free side, which becomes active."""
        sh = self.shared
        assert sh is not None and sh.is_writer
        sh.create()
        m = sh.meta()
        assert m is not None
        active, seqs = m["active"], list(m["seq"])
        cur = seqs[active]
        ready = ready_sequences(self.directory)
        target = self.side_to_write(active)
        if cur + 1 not in ready or (target != active and target in sh.readers()):
            sh.set_meta(checked=time.time())  # nothing to do, or a worker still reads the free side: next poll
            return False
        started = time.perf_counter()
        batch: list[tuple[Delta, list[Write]]] = []
        while len(batch) < ROUND and (p := self.checked(cur + 1 + len(batch), ready)) is not None:
            batch.append((p.delta, p.writes))
        if not batch:
            sh.set_meta(checked=time.time())
            return False
        views = sh.views(target)
        if target != active:
            sh.set_meta(seq=[None if s == target else q for s, q in enumerate(seqs)])  # being written
            if not self._replay(views, seqs[target], cur):
                sh.copy_side(active, target)
        for d, writes in batch:
            self.write(views, writes)
            self._cache[d.sequence] = writes
        seqs[target] = batch[-1][0].sequence
        sh.set_meta(active=target, seq=seqs, checked=time.time())
        self._cache = {s: w for s, w in self._cache.items() if s > cur}
        for d, _ in batch:
            self.on_rows(d.rows)
            log_applied(d, started, f" into shared tables side {target}")
        return True

    def _replay(self, views: Mapping[str, torch.Tensor], have: int | None, want: int) -> bool:
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
            write_all(views, writes)
        return True


def log_applied(d: Delta, started: float, extra: str) -> None:
    logger.info(
        "delta %s applied: %d rows in %d table(s)%s, %.1f ms%s",
        d.path.name,
        d.rows,
        len(d.tables),
        ", dense parameters" if d.dense else "",
        (time.perf_counter() - started) * 1000,
        extra,
    )


def class_path(cls: type) -> str:
    """``module:qualname`` of a class, for ``load_class`` in another process."""
    return f"{cls.__module__}:{cls.__qualname__}"


def load_class(path: str) -> Any:
    module, _, name = path.partition(":")
    found: Any = importlib.import_module(module)
    for part in name.split("."):
        found = getattr(found, part)
    return found


def writer_main(argv: list[str] | None = None) -> None:
    """The shared tables' writer, a process of its own (``DeltaApplier`` starts it with a spec file,
    the flock it holds and its import path): write rounds every ``poll_s`` until its worker exits.
    The spec names the TableWriter class the worker uses (``writer``)."""
    spec = json.loads(Path((argv if argv is not None else sys.argv[1:])[0]).read_text())
    try:  # PR_SET_PDEATHSIG: killed with its worker, so that it never writes for a dead one
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s delta writer: %(message)s")
    logging.getLogger("dlrmkit.live").setLevel(logging.INFO)  # its own lines; the libraries' at WARNING
    os.nice(WRITER_NICE)  # the whole process below the serving workers (no GIL shared with them)
    torch.set_num_threads(1)
    t = spec["target"]
    target = Target(
        t["model"],
        t["base"],
        {k: (int(v[0]), int(v[1])) for k, v in t["tables"].items()},
        {k: tuple(v) for k, v in t["dense"].items()},
    )
    shared = SharedTables(spec["layout"], spec["sizes"], spec["state_dir"], spec["base"], fd=spec["fd"])
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
    writer_class = load_class(spec["writer"])
    hot = None
    if spec.get("hot"):
        ids = torch.load(spec["hot"], map_location="cpu", weights_only=True)
        hot = HotIndex({t: rows for t, (rows, _) in target.tables.items()}, ids)
    writer = writer_class(spec["directory"], target, spec["dtype"], widths, shared, on_rows, on_refused, hot)
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


class WriterProcess:
    """The writer worker's side of ``writer_main``: the child process started (again, if it exits)
    by ``tend``, its rows and refusals relayed to ``on_rows`` / ``on_refused`` from its counts file.

    A thread of the worker wrote before: measured, its Python held the serving thread's GIL while
    the scheduler ran other processes first (a batch stalled up to 86 ms with both CPUs busy, 9 ms
    from a process; results/deltas.md)."""

    def __init__(self, shared: SharedTables, on_rows: Callable[[int], None], on_refused: Callable[[str], None]):
        self.shared, self.on_rows, self.on_refused = shared, on_rows, on_refused
        self.child: subprocess.Popen[bytes] | None = None
        self._seen: dict[str, Any] = {}  # what its counts file said when last relayed

    def tend(self, spec: Callable[[], dict[str, Any]]) -> bool:
        """Relay the child's new counts, start it if it is not running (with the spec ``spec()``
        makes). True: its counts moved."""
        moved = False
        if self.child is not None:
            moved = self._relay()
            if self.child.poll() is None:
                return moved
            logger.error("delta writer process %d exited (%s): starting another", self.child.pid, self.child.returncode)
        s = {**spec(), "parent": os.getpid(), "fd": self.shared.fd}
        path = self.shared.dir / f"writer-{os.getpid()}.spec"
        path.write_text(json.dumps(s))
        # the worker's import path (its model directory holds the handler's modules)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        code = "from dlrmkit.live.writer import writer_main; writer_main()"
        self.child = subprocess.Popen([sys.executable, "-c", code, str(path)], pass_fds=(s["fd"],), env=env)
        self._seen = {}
        return moved

    def _relay(self) -> bool:
        assert self.child is not None
        try:
            now = json.loads((self.shared.dir / COUNTS_FILE).read_text())
        except (OSError, ValueError):
            return False
        if now.get("pid") != self.child.pid:
            return False  # not yet written by this child
        seen = self._seen or {"rows": 0, "refused": {}}
        if now["rows"] > seen["rows"]:
            self.on_rows(now["rows"] - seen["rows"])
        for reason, n in now["refused"].items():
            for _ in range(n - seen["refused"].get(reason, 0)):
                self.on_refused(reason)
        self._seen = now
        return now != seen

    def stop(self) -> None:
        if self.child is not None and self.child.poll() is None:
            self.child.kill()
            self.child.wait(timeout=10)
