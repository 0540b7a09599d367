"""One serving worker, front-door-free: load an archive's model directory, score opened requests.

What every front door needs of a worker (the TorchServe handler, dlrm_handler.py, and KServe's
model server, dlrm_kserve.py): the door opens each request in its protocol
(``dlrmkit.protocols.open_request``) and hands the list over; the worker answers it::

    w = Worker()
    w.load(model_dir, manifest, model_yaml)     the handler: section, the weights, devices and torch
                                                threads, the dense half, the split pool, the live watcher
    data, sequence = w.score(requests)          parse -> collate in groups -> one forward per group, all
                                                under one live-delta sequence (dlrmkit/live/)
    for reply, err in w.replies(data): ...      per request its answer, or its RequestError's body
    w.close()                                   the split pool's threads and the live watcher stopped

A bad request fails alone: its ``RequestError`` is in ``data.errors`` and its reply carries the
error body, while the others get their scores. A forward that fails is the server's fault and fails
every request of that call: ``ServerError`` (507 out of memory, else 500).

Front-door specifics stay with the door: TorchServe's context (headers, statuses, metrics objects)
in the handler, which subclasses ``Worker``; a door that composes one works the same.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import yaml

from dlrmkit import dense as dense_half
from dlrmkit.batch import RequestBatch, collate, scores
from dlrmkit.config import DLRMConfig
from dlrmkit.cpus import PartsPool, available_cpus, split_parts, torch_threads
from dlrmkit.errors import BadRequest, ConfigError, OutOfMemory, RequestError, ServerError
from dlrmkit.forms import RequestParser
from dlrmkit.hot import Fill, HotIndex, IdCounter, Prefetch, lock_said, small_tables, warm
from dlrmkit.live import DeltaApplier, start_watcher
from dlrmkit.live.applier import Emit
from dlrmkit.malloc import keep_freed
from dlrmkit.model import DLRMFactory
from dlrmkit.protocols import Reply
from dlrmkit.request import ParsedRequest
from dlrmkit.scale import TABLES, file_mappings, fused_tables, mapped_advice, mapped_read_only, worker_devices

logger = logging.getLogger(__name__)

# Rows per forward pass at most; a door's batch of requests is split into groups of whole requests.
# The compiled dense half makes every batch size up to this at worker start (dlrmkit/dense.py).
MAX_ROWS_PER_FORWARD = dense_half.WARM_ROWS
DELTA_HEADER = "X-Delta-Sequence"  # on every answer of either door: the live-update sequence it was scored under
MANIFEST = "MAR-INF/MANIFEST.json"  # in a model directory: the archive's manifest (modelName, serializedFile, ...)


def read_model_dir(model_dir: str | Path) -> tuple[dict, dict]:
    """The manifest and the parsed model-config.yaml (``configFile``) of an archive's model
    directory: an unpacked .mar or what scripts/build_big.py wrote. TorchServe reads the same two
    files for the handler (its context's ``manifest`` and ``model_yaml_config``)."""
    model_dir = Path(model_dir)
    try:
        manifest = json.loads((model_dir / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"{model_dir}: not a model directory ({MANIFEST}: {e}); give a .mar or a directory that "
            "scripts/build_mar.py or scripts/build_big.py built"
        ) from None
    config_file = (manifest.get("model") or {}).get("configFile")
    if not config_file:
        raise ConfigError(f"{model_dir / MANIFEST}: no model.configFile (build the archive with scripts/build_mar.py)")
    with open(model_dir / config_file) as f:
        model_yaml = yaml.safe_load(f) or {}
    return manifest, model_yaml


def form_post() -> BadRequest:
    """A form post (curl -d without a Content-Type) is never a DLRM request: this says what to add."""
    return BadRequest(
        "body: expected JSON with Content-Type: application/json, got a form post "
        "(add -H 'Content-Type: application/json' to curl)"
    )


class Worker:
    """A loaded model and what serves it; ``load`` in named steps, ``close`` stops what it started
    beside the serving thread (the split pool, the live watcher and its writer process)."""

    config: DLRMConfig
    model: torch.nn.Module
    parser: RequestParser
    model_id: tuple[str, str]  # (modelName, modelVersion) from the manifest
    device: torch.device  # where the dense part and the batches go
    threads = 1  # torch intra-op threads of the serving thread
    cpus = 1  # the CPUs this process may use (dlrmkit.cpus)
    deltas: DeltaApplier | None = None  # with handler.delta_dir: the DeltaApplier following it
    delta_applier = DeltaApplier  # its class (tests/unguarded_handler.py injects one without the lock)
    split_pool: ThreadPoolExecutor | None = None  # with handler.split_rows: the threads a large forward's parts run on
    split_parts = 1  # the most parts one forward runs as
    hot: HotIndex | None = None  # a packed model's hot rows, where lookups are redirected (handler.hot_rows)
    warmed: dict | None = None  # what warming the hot rows did (bytes, seconds, locked)
    small: dict | None = None  # tables larger than memory: what warming the small tables whole did
    counter: IdCounter | None = None  # with handler.count_ids_dir: counts the looked-up ids
    prefetch: Prefetch | None = None  # handler.prefetch: the pages of a forward's lookups asked for at once
    fill: Fill | None = None  # handler.prefetch, tables larger than memory: the rest read into the cache once ready
    allocator = ""  # what load did to the C allocator (dlrmkit/malloc.py, handler.keep_freed_memory)

    def load(
        self,
        model_dir: str | Path,
        manifest: Mapping[str, Any] | None,
        model_yaml: Mapping[str, Any] | None,
        gpu_id: Any = None,
        emit: Emit | None = None,
        workers: int | None = None,
    ) -> None:
        """Load the archive's model directory. ``gpu_id``: the GPU the door gave this worker (None:
        CPU); ``emit``: dlrmkit.live's metrics; ``workers``: the door's processes of this model for the
        CPU rule (None: model_yaml's maxWorkers, else the rule's count)."""
        started = time.perf_counter()
        self.config, weights = self._read_config(model_dir, manifest, model_yaml)
        self.allocator = (
            keep_freed() if self.config.threads.keep_freed_memory else "glibc's own (handler.keep_freed_memory: false)"
        )
        logger.info("allocator: %s", self.allocator)
        devices = self._place(gpu_id, model_yaml, workers)
        dense, frozen = self._load_model(weights, devices)
        self._start_split_pool()
        self.parser = RequestParser(self.config)
        try:
            # handler.delta_dir: every visible delta applied now, before the worker reports ready; then a watcher
            self.deltas = start_watcher(
                self.config,
                self.model,
                os.path.dirname(weights),
                weights,
                self.model_id[0],
                devices,
                emit,
                self.delta_applier,
            )
        except BaseException:
            self.close()  # the pool's threads too: a worker that fails to load leaves nothing running
            raise
        self._say_loaded(devices, time.perf_counter() - started, frozen, dense)
        if self.fill is not None:
            self.fill.start()  # after load: the worker reports ready while it reads

    def _read_config(
        self, model_dir: str | Path, manifest: Mapping[str, Any] | None, model_yaml: Mapping[str, Any] | None
    ) -> tuple[DLRMConfig, str]:
        """The validated ``handler:`` section and the archive's weights file."""
        model = (manifest or {}).get("model", {})
        self.model_id = (model.get("modelName", "dlrm"), str(model.get("modelVersion", "1.0")))
        config = DLRMConfig.from_dict((model_yaml or {}).get("handler"))
        serialized = model.get("serializedFile")
        if not serialized:
            raise ConfigError(
                "the archive has no weights: build it with scripts/build_mar.py "
                "(torch-model-archiver --serialized-file dlrm.pt)"
            )
        return config, os.path.join(model_dir or ".", serialized)

    def _place(self, gpu_id: Any, model_yaml: Mapping[str, Any] | None, workers: int | None) -> list[torch.device]:
        """The worker's devices and torch threads. Several GPUs for one worker (parallelType: custom):
        the tables are sharded across them and the dense part and batches go to the first."""
        cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
        devices = worker_devices(gpu_id, model_yaml, cuda)
        self.device = devices[0]
        # maxWorkers when the config pins it, else the CPU rule's count (tsctl starts that many)
        workers = workers or (model_yaml or {}).get("maxWorkers")
        torch.set_num_threads(torch_threads(self.config.threads.torch_threads, workers))
        self.threads, self.cpus = torch.get_num_threads(), available_cpus()
        return devices

    def _load_model(self, weights: str, devices: list[torch.device]) -> tuple[str, list[str]]:
        """The served model: the archive's weights, its dense half as configured (compiled and made at
        every batch size it will see, dlrmkit/dense.py), the fp32 dense half frozen. Returns what the
        dense half runs as and what was frozen."""
        factory = DLRMFactory(self.config)
        model_dir = os.path.dirname(weights)
        loaded = factory.load(weights, devices)
        self._hot_rows(loaded, weights, single=len(devices) == 1)
        self.model, dense = dense_half.prepare(loaded, self.config, model_dir, devices)
        frozen = factory.freeze_dense(self.model) if len(devices) == 1 and dense.startswith("fp32") else []
        return dense, frozen

    def _hot_rows(self, model: torch.nn.Module, weights: str, single: bool) -> None:
        """A packed model (dlrmkit/hot.py): its hot rows read into the page cache (and locked where the
        process may) before the worker reports ready; lookups redirected to them (handler.hot_rows).
        handler.count_ids_dir: the counter of looked-up ids started. handler.prefetch: tables of 256 MiB
        or more get their pages asked for before each forward."""
        c = self.config.hot
        index: HotIndex | None = getattr(model, "hot_index", None)
        local = single and self.device.type == "cpu"  # the kernels read the mapped weights file
        qebc = model.get_submodule("sparse_arch.embedding_bag_collection")
        if c.prefetch and local:
            prefetch = Prefetch(qebc, dict(zip(self.config.sparse_features, self.config.num_embeddings)))
            if prefetch:
                self.prefetch = prefetch
                logger.info(
                    "prefetch: the pages of each forward's lookups in %s asked for at once", ", ".join(prefetch.tables)
                )
                self.fill = self._fill(weights, prefetch, index.cold if index is not None else None)
        if index is not None and c.hot_rows and local:
            views = {k[len(TABLES) : -len(".weight")]: v for k, v in fused_tables(qebc).items()}
            ro, after = mapped_read_only(), mapped_advice()  # tables larger than memory: MADV_RANDOM
            self.hot, self.warmed = index, warm(index.regions(views), lock=ro, advice_after=after)
            if ro:
                # tables larger than memory: the tables too small to prefetch are read and locked whole
                # (else cold pages evict them and every query faults a few of their pages back in)
                small = small_tables(views, index.rows)
                self.small = warm(small, lock=True, advice_after=after)
                logger.info(
                    "small tables: %d tables read whole (%.1f MiB) in %.2f s, %s",
                    len(small),
                    self.small["bytes"] / 2**20,
                    self.small["seconds"],
                    lock_said(self.small),
                )
            logger.info(
                "hot rows: %d rows (%.1f MiB) of %d tables, read in %.2f s, %s",
                len(index),
                self.warmed["bytes"] / 2**20,
                len(index.hot),
                self.warmed["seconds"],
                lock_said(self.warmed),
            )
        elif index is not None:
            self.hot = index if c.hot_rows else None
            logger.info(
                "hot rows: %d rows, %s",
                len(index),
                "redirected" if c.hot_rows else "not used (handler.hot_rows: false)",
            )
        if c.count_ids_dir:
            self.counter = IdCounter(c.count_ids_dir, c.count_ids_every, worker=f"{self.model_id[0]}-{os.getpid()}")

    @staticmethod
    def _fill(weights: str, prefetch: Prefetch, cold: Mapping[str, int] | None) -> Fill | None:
        """The reader of the prefetched tables' other rows, started once the worker is ready, keeping
        max(1 GiB, a tenth of the machine's memory) free; None when the tables are not mapped from
        ``weights`` (copied onto a device)."""
        maps = file_mappings(weights)
        regions = {}
        for table, (tbe, offset, stride, _, own) in prefetch.tables.items():
            at = tbe.weights_host.data_ptr() + offset  # type: ignore[attr-defined]  # fbgemm's kernel
            for start, end, file_offset in maps:
                if start <= at < end:
                    regions[table] = (at - start + file_offset, own * stride)
        if not regions:
            return None
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return Fill(weights, regions, prefetch, floor=max(1 << 30, total // 10), cold=cold)

    def _start_split_pool(self) -> None:
        """handler.split_rows: a large forward's parts run at once, on the pool's threads and this one."""
        self.split_parts = split_parts(self.threads, self.cpus) if self.device.type == "cpu" else 1
        if self.config.threads.split_rows and self.split_parts > 1:
            # each pool thread on the worker's own thread count (OpenMP's count is per calling thread);
            # single-threaded parts each on a CPU of their own (PartsPool)
            pool = PartsPool if self.threads == 1 else ThreadPoolExecutor
            self.split_pool = pool(self.split_parts - 1, "dlrm-split", torch.set_num_threads, (self.threads,))
        elif self.config.threads.split_rows:
            logger.warning(
                "handler.split_rows %d: nothing to split onto (%s): every forward runs whole",
                self.config.threads.split_rows,
                f"{self.cpus} CPU(s), {self.threads} torch thread(s) per part"
                if self.device.type == "cpu"
                else f"the model is on {self.device}",
            )

    def _say_loaded(self, devices: list[torch.device], seconds: float, frozen: list[str], dense: str) -> None:
        c = self.config
        logger.info(
            "DLRM loaded on %s in %.1f s: %d dense, %d sparse features, %d embedding rows (%s), output %s, "
            "%d torch threads%s, frozen: %s; dense half: %s",
            ", ".join(map(str, devices)) + (" (tables sharded)" if len(devices) > 1 else ""),
            seconds,
            c.num_dense_features,
            c.num_features,
            sum(c.num_embeddings),
            c.build.embedding_dtype,
            c.requests.output,
            self.threads,
            f"; a forward of more than {c.threads.split_rows} rows split into up to {self.split_parts} parts at once"
            if self.split_pool
            else "",
            ", ".join(frozen) or "nothing",
            dense,
        )

    def close(self) -> None:
        """Stop the live watcher (its thread, and its writer process where it runs one) and the split
        pool's threads. Safe to call twice."""
        deltas, self.deltas = self.deltas, None
        if deltas is not None:
            deltas.stop()
        pool, self.split_pool = self.split_pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        counter, self.counter = self.counter, None
        if counter is not None:
            counter.close()
        fill, self.fill = self.fill, None
        if fill is not None:
            fill.stop()

    # --- serving -------------------------------------------------------------------------------

    def score(
        self, requests: Sequence[Any], errors: dict[int, RequestError] | None = None
    ) -> tuple[RequestBatch, int | None]:
        """Opened requests (dlrmkit.protocols) -> their RequestBatch with scores and errors, and the
        live-delta sequence every score was made under (None without handler.delta_dir).
        ``errors``: requests the door refused before opening them (index -> error)."""
        data = self.group(requests, errors)
        with self.serving() as sequence:
            self.infer(data)
        return data, sequence

    def serving(self) -> contextlib.AbstractContextManager[int | None]:
        """Hold for one whole call's forwards: never between a delta's rows (dlrmkit/live/). Yields
        the delta sequence they are scored under, None without live updates."""
        return self.deltas.serving() if self.deltas else contextlib.nullcontext()

    def group(self, requests: Sequence[Any], errors: dict[int, RequestError] | None = None) -> RequestBatch:
        """Requests -> the good rows collated in groups, the bad requests' errors.

        Requests are collated in groups of at most MAX_ROWS_PER_FORWARD rows (a bigger request
        is a group of its own), so a batch of large ranking requests never becomes one forward
        pass of hundreds of thousands of rows."""
        errors = dict(errors or {})
        groups: list[list[tuple[int, ParsedRequest]]] = []
        group: list[tuple[int, ParsedRequest]] = []
        rows = 0
        for i, req in enumerate(requests):
            if i in errors:
                continue
            try:
                parsed = req.parse()
            except RequestError as e:
                errors[i] = e
                continue
            if group and rows + parsed.n > MAX_ROWS_PER_FORWARD:
                groups.append(group)
                group, rows = [], 0
            group.append((i, parsed))
            rows += parsed.n
        if group:
            groups.append(group)
        forwards = []
        for group in groups:
            batch, bad = collate([p for _, p in group], self.config, self.device)
            errors.update({group[j][0]: e for j, e in bad.items()})
            if batch is not None and self.counter is not None:
                self.counter.observe(batch.sparse)
            if batch is not None and self.hot is not None:
                batch.sparse = self.hot.redirect(batch.sparse)
            if batch is not None:
                forwards.append((batch, [i for j, (i, _) in enumerate(group) if j not in bad]))
        return RequestBatch(list(requests), forwards, errors)

    def infer(self, data: RequestBatch) -> RequestBatch:
        """One forward pass per group of good rows. A failed forward is the server's fault, not a
        request's: ``ServerError`` (``OutOfMemory``, 507, or 500) fails this call only."""
        for batch, index in data.forwards:
            if self.prefetch is not None:
                self.prefetch(batch.sparse)
            try:
                per_request = scores(self.model, batch, self.config, self.split_pool, self.split_parts)
            except Exception as e:
                rows = batch.dense.shape[0]
                if isinstance(e, MemoryError) or "out of memory" in str(e).lower():
                    if self.device.type == "cuda":
                        torch.cuda.empty_cache()
                    logger.error("out of memory scoring a batch of %d rows: %s", rows, e)
                    raise OutOfMemory(f"Out of memory scoring a batch of {rows} rows") from None
                logger.exception("forward pass failed for a batch of %d rows", rows)
                raise ServerError(f"Internal error scoring a batch: {type(e).__name__}") from None
            data.scores.update(zip(index, per_request))
        return data

    @staticmethod
    def replies(data: RequestBatch) -> Iterator[tuple[Reply, RequestError | None]]:
        """Per request, in order: its answer and None, or its error's reply and the error."""
        for i, req in enumerate(data.requests):
            if i in data.scores:
                yield req.answer(data.scores[i]), None
            else:
                err = data.errors[i]
                yield req.error(err), err
