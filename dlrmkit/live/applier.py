"""The serving side: ``DeltaApplier`` follows a delta directory for one worker, in a thread, and puts
each delta into the served model between two batches, under the lock every batch's forward holds.

    applier = DeltaApplier(model, config, factory, directory, target, state_dir=model_dir)
    applier.catch_up()                  # every visible delta, before the worker reports ready
    applier.start()                     # then a watcher thread
    with applier.serving() as sequence: # per batch: scored entirely before or after a delta
        scores = model(dense, kjt)

CPU tables with a model directory are ``SharedTables`` (the writer worker's ``WriterProcess``
writes them; a worker flips to the newer side under the lock); without one (tests' references) or
on a GPU, the applier writes its own tables in place under the same lock. Each worker records
what it serves in ``<model dir>/delta-state/<pid>.json`` (read by the OIP plugin and the writer).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Mapping, Protocol

import torch

from dlrmkit import dense as dense_half
from dlrmkit.config import DLRMConfig
from dlrmkit.errors import ConfigError
from dlrmkit.live.format import Delta, delta_path, read_dense, ready_sequences
from dlrmkit.live.tables import SharedTables, write_all
from dlrmkit.live.validate import Target
from dlrmkit.live.writer import Prepared, TableWriter, WriterProcess, class_path, log_applied
from dlrmkit.model import DLRMFactory
from dlrmkit.hot import HotIndex
from dlrmkit.scale import fused_tables

logger = logging.getLogger(__name__)

STATE_DIR = "delta-state"  # per-worker <pid>.json in the model dir: what the OIP plugin reports
HANDOVER_S = 0.1  # how long a prepared delta waits for the next batch to write it (DeltaApplier.apply)
DENSE_PARTS = ("dense_arch", "inter_arch", "over_arch")


class Emit(Protocol):
    """A metric out (the handler's: TorchServe's metrics): ``*_total`` names are counters, the rest
    gauges; ``dims`` its dimensions, e.g. ``emit("dlrm_deltas_refused_total", 1, "Count", Reason="range")``."""

    def __call__(self, name: str, value: float, unit: str, **dims: str) -> None: ...


class DeltaApplier:
    """Follows a delta directory for one served model (one per worker).

    ``model``: the served DLRM (or dlrmkit.dense.ServedDLRM), unsharded, tables in fbgemm's fused
    kernel. ``factory``: a DLRMFactory, to rebuild the dense half for dense deltas. ``emit``: where
    its metrics go (from any thread), or None. ``state_dir``: the model directory, where each
    worker records what it serves; with it, CPU tables are shared by the workers
    (``SharedTables``), without it (or on a GPU) each applier writes its own tables in place.
    ``Writer``: the TableWriter class, this worker's and its writer process's.
    """

    JOIN_WAIT_S = 120.0  # how long a starting worker waits for the writer to catch up
    Writer: type[TableWriter] = TableWriter

    def __init__(
        self,
        model: torch.nn.Module,
        config: DLRMConfig,
        factory: DLRMFactory,
        directory: str | Path,
        target: Target,
        poll_s: float = 0.5,
        emit: Emit | None = None,
        state_dir: str | Path | None = None,
        worker: str | None = None,
    ):
        self.model, self.config, self.factory = model, config, factory
        self.target, self.poll_s, self.emit = target, poll_s, emit
        qebc = model.get_submodule("sparse_arch.embedding_bag_collection")
        self.views = {k.rsplit(".", 2)[-2]: v for k, v in fused_tables(qebc).items()}
        self.lock = threading.Lock()
        self.applied = 0
        self.rows_applied = 0
        self.model_dir = Path(state_dir) if state_dir else Path(".")  # the archive's files (calibration)
        self.state_file = Path(state_dir) / STATE_DIR / f"{worker or os.getpid()}.json" if state_dir else None
        shared = state_dir is not None and SharedTables.usable(qebc)
        self.shared = SharedTables.of(qebc, Path(state_dir) / STATE_DIR, target.base) if shared else None
        self.side: int | None = None  # the shared side this worker reads (None: its own tables)
        widths = {t: v.shape[1] for t, v in self.views.items()}
        self.hot: HotIndex | None = getattr(model, "hot_index", None)  # a packed model: both copies written
        self.writer = self.Writer(
            directory,
            target,
            config.build.embedding_dtype,
            widths,
            self.shared,
            self._count_rows,
            self._count_refused,
            self.hot,
        )
        self.process = WriterProcess(self.shared, self._count_rows, self._count_refused) if self.shared else None
        self._started = time.time()
        self._joined = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_gauges = 0.0
        self._locked_ms = 0.0
        self._pending: Prepared | None = None  # prepared, to be written by the next batch (apply)
        self._taken = threading.Event()
        self._last_served = -1e9
        self.applied_at = time.time()
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
        if self.process is not None:
            self.process.stop()

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
        child process at a lower priority (``WriterProcess``), started again if it exits."""
        if self.process is None or self._stop.is_set() or not self.shared.take_writer():
            return
        if self.process.tend(self._writer_spec):
            self._write_state()

    def _writer_spec(self) -> dict[str, Any]:
        sh = self.shared
        return {
            "directory": str(self.directory),
            "state_dir": str(sh.dir),
            "base": sh.base,
            "layout": sh.layout,
            "sizes": sh.sizes,
            "dtype": self.config.build.embedding_dtype,
            "poll_s": self.poll_s,
            "target": dataclasses.asdict(self.target),
            "writer": class_path(type(self.writer)),
            "hot": self._hot_file(),
        }

    def _hot_file(self) -> str | None:
        """A packed model's hot ids for the writer process (it loads no model): a file beside the sides."""
        if self.hot is None or self.shared is None:
            return None
        path = self.shared.dir / f"hot-{self.shared.base}.pt"
        if not path.is_file():
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            torch.save(self.hot.hot, tmp)
            os.replace(tmp, path)
        return str(path)

    def _count_rows(self, n: int) -> None:
        self.rows_applied += n
        self._emit("dlrm_delta_rows_total", n, "Count")

    def _count_refused(self, reason: str) -> None:
        self._emit("dlrm_deltas_refused_total", 1, "Count", Reason=reason)

    def lag_seconds(self) -> float:
        """Seconds since the oldest visible delta not yet applied became visible (0: caught up)."""
        ready = ready_sequences(self.directory)
        pending = [s for s in ready if s > self.applied]
        if not pending:
            return 0.0
        try:
            return max(0.0, time.time() - ready[min(pending)].stat().st_mtime)
        except FileNotFoundError:
            return 0.0

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
        prepared = self.writer.checked(self.applied + 1, ready_sequences(self.directory), self.prepare)
        if prepared is None:
            return False
        self.apply(prepared)
        log_applied(prepared.delta, started, f" ({self._locked_ms:.1f} ms under the lock)")
        self._count_rows(prepared.delta.rows)
        self._gauges(force=True)
        return True

    # -- shared tables -------------------------------------------------------------------------

    def _join(self) -> None:
        """Start serving the shared tables: the writer makes them if need be; another worker waits
        (bounded) for the writer to have looked at the directory since this worker started."""
        sh = self.shared
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
                raise ConfigError(
                    f"handler.delta_dir: live updates: no worker made the shared tables in {sh.dir} in "
                    f"{self.JOIN_WAIT_S:.0f} s (the worker holding {sh.dir / sh.LOCK} is stuck?)"
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
        for seq in range(upto, after, -1):
            dense = read_dense(delta_path(self.directory, seq))
            if dense:
                return dense
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
        shell.register_module("sparse_arch", live.get_submodule("sparse_arch"))
        device = next(iter(self.views.values())).device
        for name in DENSE_PARTS:
            shell.get_submodule(name).to(device)
        shell.eval()
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
        if any(isinstance(live.get_submodule(n), torch.jit.ScriptModule) for n in ("dense_arch", "over_arch")):
            self.factory.freeze_dense(shell)
        return {n: shell.get_submodule(n) for n in DENSE_PARTS}

    def apply(self, p: Prepared) -> None:
        """Write ``p`` (or flip to its side) under the lock: all of one delta or none of it, between
        two batches.

        While batches are being served, the work is handed to the serving thread (``serving``
        does it before its next forward, at the serving thread's priority: a low-priority watcher
        holding the lock would stall the batches waiting for it); when idle, or if no batch comes
        within HANDOVER_S, the watcher does it itself."""
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
                self.shared.flip(p.side)
                self.side = p.side
            write_all(self.views, p.writes)
        for name, part in p.dense_parts.items():
            setattr(self.model, name, part)
        self.applied = p.delta.sequence if p.delta is not None else p.sequence
        self.applied_at = time.time()
        self._pending = None
        self._locked_ms = (time.perf_counter() - t0) * 1000
        self._taken.set()

    def _write_state(self) -> None:
        """<model dir>/delta-state/<pid>.json: this worker's sequence, for the OIP metadata, and
        the shared side it reads, for the writer."""
        if self.state_file is None:
            return
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".tmp")
        state = {
            "sequence": self.applied,
            "base": self.target.base,
            "pid": os.getpid(),
            "buffer": self.side,
            "applied_at": self.applied_at,
            "locked_ms": round(self._locked_ms, 3),
            "rows_applied": self.rows_applied,
        }
        tmp.write_text(json.dumps(state))
        os.replace(tmp, self.state_file)

    def _gauges(self, force: bool = False) -> None:
        """The per-worker gauges, on every apply and at most every 5 s otherwise."""
        now = time.monotonic()
        if self.emit is None or (not force and now - self._last_gauges < 5):
            return
        self._last_gauges = now
        worker = str(os.getpid())
        self._emit("dlrm_delta_sequence", self.applied, "count", Worker=worker)
        self._emit("dlrm_delta_lag_seconds", round(self.lag_seconds(), 3), "s", Worker=worker)

    def _emit(self, name: str, value: float, unit: str, **dims: str) -> None:
        if self.emit is None:
            return
        try:
            self.emit(name, value, unit, **dims)
        except Exception as e:  # a metric must never stop a delta
            logger.warning("metric %s: %s", name, e)
