"""TorchServe handler for torchrec DLRM models.

Thin wiring over the TorchServe-free core. A request's way through one TorchServe batch::

    req = open_request(body, header fields)     dlrmkit.protocols: its protocol (/predictions JSON, Criteo
                                                TSV, KServe v1, OIP v2 JSON or binary)
    parsed = req.parse()                        -> dlrmkit.request.ParsedRequest, or a RequestError (4xx)
    batch, bad = collate(parsed requests)       dlrmkit.batch: one dense tensor + one KeyedJaggedTensor
    per_request = scores(model, batch)          dlrmkit.batch: one forward (one per MAX_ROWS_PER_FORWARD rows)
    req.answer(scores) / req.error(err)         the protocol's reply: body, Content-Type, header fields

Every request is answered on its own: a bad request gets its own 4xx and error body while the
good requests of the same batch get their scores, and requests of every protocol share the
batch's forward pass. TorchServe imports this file and wants exactly one class in it.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import functools
import logging
import os
import re
import time
from abc import ABC
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from ts.metrics.dimension import Dimension
from ts.metrics.metric_type_enum import MetricTypes
from ts.torch_handler.base_handler import BaseHandler
from ts.utils.util import PredictionException

from dlrmkit.config import DLRMConfig
from dlrmkit.batch import Batch, RequestBatch, collate, scores
from dlrmkit.forms import RequestParser
from dlrmkit.cpus import available_cpus, split_parts, torch_threads
from dlrmkit import dense as dense_half
from dlrmkit.errors import BadRequest, ConfigError, RequestError
from dlrmkit.live import DeltaApplier, start_watcher
from dlrmkit.model import DLRMFactory
from dlrmkit.protocols import BINARY_HEADER, open_request
from dlrmkit.request import ParsedRequest
from dlrmkit.scale import worker_devices

logger = logging.getLogger(__name__)

# Rows per forward pass at most; TorchServe's batch is split into groups of whole requests. The
# compiled dense half makes every batch size up to this at worker start (dlrmkit/dense.py).
MAX_ROWS_PER_FORWARD = dense_half.WARM_ROWS
# TorchServe 0.12 answers every request with its own id in x-request-id, replacing any value the
# handler sets there, so a client's X-Request-Id comes back under this name instead.
# Request header names reach the handler with the client's spelling; these are the usual ones.
CLIENT_ID_SPELLINGS = ("X-Request-Id", "x-request-id", "X-Request-ID", "X-REQUEST-ID")
CLIENT_ID_ECHO = "X-Client-Request-Id"
_CLIENT_ID = re.compile(r"[!-~]{1,128}")  # visible ASCII: safe to log and to send back
# How a request's protocol is chosen. TorchServe 0.12 gives a REST request its HTTP header fields and
# a /predictions/<model>[/<version>] request also the header ``url_path`` (what follows the model
# in the path, usually ""); /v1/models/<m>:predict and /v2/models/<m>/infer get no url_path and
# otherwise reach the handler alike. gRPC Predictions passes no HTTP header fields (no Host). So: a
# request with a Host header and no url_path came on a KServe route; all others are answered
# in the /predictions formats (so are in-process callers that set no header).
URL_PATH = ("url_path",)
HOST = ("Host", "host", "HOST")
BINARY_SPELLINGS = (BINARY_HEADER, BINARY_HEADER.lower())
CONTENT_TYPE = ("Content-Type", "content-type", "Content-type", "CONTENT-TYPE")
DELTA_HEADER = "X-Delta-Sequence"  # on every answer: the live-update delta sequence its score was made under


class TorchRecDLRMHandler(BaseHandler, ABC):
    """Scores DLRM requests; see docs/requests-and-errors.md for the request and response formats.

    ``initialize`` loads the worker in named steps; ``close`` stops what it started beside the
    serving thread (the split pool, the live watcher and its writer process) when the worker exits."""

    deltas = None  # with handler.delta_dir: the dlrmkit.live.DeltaApplier following it
    delta_applier = DeltaApplier  # its class (tests/unguarded_handler.py injects one without the lock)
    split_pool: ThreadPoolExecutor | None = None  # with handler.split_rows: the threads a large forward's parts run on
    split_parts = 1  # the most parts one forward runs as

    def initialize(self, context):
        started = time.perf_counter()
        self.config, weights = self._read_config(context)
        devices = self._place(context)
        dense, frozen = self._load_model(weights, devices)
        self._start_split_pool()
        self.parser = RequestParser(self.config)
        try:
            # handler.delta_dir: every visible delta applied now, before the worker reports ready; then a watcher
            self.deltas = self._start_watcher(context, weights, devices)
        except BaseException:
            self.close()  # the pool's threads too: a worker that fails to load leaves nothing running
            raise
        atexit.register(self.close)  # the worker's own exit (its frontend's socket closed: sys.exit(0)); see close
        self.initialized = True
        self._say_loaded(devices, time.perf_counter() - started, frozen, dense)

    def _read_config(self, context) -> tuple[DLRMConfig, str]:
        """The validated ``handler:`` section and the archive's weights file."""
        self.manifest = context.manifest
        model = (self.manifest or {}).get("model", {})
        self.model_id = (model.get("modelName", "dlrm"), str(model.get("modelVersion", "1.0")))
        config = DLRMConfig.from_dict((context.model_yaml_config or {}).get("handler"))
        serialized = model.get("serializedFile")
        if not serialized:
            raise ConfigError(
                "the archive has no weights: build it with scripts/build_mar.py "
                "(torch-model-archiver --serialized-file dlrm.pt)"
            )
        return config, os.path.join(context.system_properties.get("model_dir") or ".", serialized)

    def _place(self, context) -> list[torch.device]:
        """The worker's devices and torch threads. Several GPUs for one worker (parallelType: custom):
        the tables are sharded across them and the dense part and batches go to the first."""
        cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
        devices = worker_devices(context.system_properties.get("gpu_id"), context.model_yaml_config, cuda)
        self.device = devices[0]
        # maxWorkers when the config pins it, else the CPU rule's count (tsctl starts that many)
        workers = (context.model_yaml_config or {}).get("maxWorkers")
        torch.set_num_threads(torch_threads(self.config.threads.torch_threads, workers))
        self.threads, self.cpus = torch.get_num_threads(), available_cpus()
        return devices

    def _load_model(self, weights: str, devices: list[torch.device]) -> tuple[str, list[str]]:
        """The served model: the archive's weights, its dense half as configured (compiled and made at
        every batch size it will see, dlrmkit/dense.py), the fp32 dense half frozen. Returns what the
        dense half runs as and what was frozen."""
        factory = DLRMFactory(self.config)
        model_dir = os.path.dirname(weights)
        self.model, dense = dense_half.prepare(factory.load(weights, devices), self.config, model_dir, devices)
        frozen = factory.freeze_dense(self.model) if len(devices) == 1 and dense.startswith("fp32") else []
        return dense, frozen

    def _start_split_pool(self) -> None:
        """handler.split_rows: a large forward's parts run at once, on the pool's threads and this one."""
        self.split_parts = split_parts(self.threads, self.cpus) if self.device.type == "cpu" else 1
        if self.config.threads.split_rows and self.split_parts > 1:
            # each pool thread on the worker's own thread count (OpenMP's count is per calling thread)
            self.split_pool = ThreadPoolExecutor(
                self.split_parts - 1, "dlrm-split", torch.set_num_threads, (self.threads,)
            )
        elif self.config.threads.split_rows:
            logger.warning(
                "handler.split_rows %d: nothing to split onto (%s): every forward runs whole",
                self.config.threads.split_rows,
                f"{self.cpus} CPU(s), {self.threads} torch thread(s) per part"
                if self.device.type == "cpu"
                else f"the model is on {self.device}",
            )

    def _start_watcher(self, context, weights: str, devices: list[torch.device]):
        """handler.delta_dir: the live watcher (dlrmkit/live/), its metrics handed in as a plain emit."""
        metrics = getattr(context, "metrics", None)
        emit = functools.partial(_live_metric, metrics) if metrics is not None else None
        return start_watcher(
            self.config,
            self.model,
            os.path.dirname(weights),
            weights,
            self.model_id[0],
            devices,
            emit,
            self.delta_applier,
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
        pool's threads. Safe to call twice. Registered with atexit by initialize: it runs when the worker
        exits on its own, as TorchServe's message loop does (sys.exit(0)) once its frontend's socket closes.

        TorchServe 0.12 itself stops a worker (scale down, unregister, ``torchserve --stop``) by closing
        that socket and killing the process at once (Process.destroyForcibly: SIGKILL); measured, no
        Python exit hook ran on any of the three. There the kernel releases the same: the threads end
        with the process, the writer process with its parent (PR_SET_PDEATHSIG, dlrmkit/live/writer.py);
        tests/test_variants_server.py checks that nothing is left."""
        atexit.unregister(self.close)
        deltas, self.deltas = self.deltas, None
        if deltas is not None:
            deltas.stop()
        pool, self.split_pool = self.split_pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        self.initialized = False

    def handle(self, data, context):
        """One TorchServe batch in, exactly one response per request out, in order."""
        t = [time.perf_counter()]
        work = self.preprocess(data, context)
        t.append(time.perf_counter())
        # The whole batch scored under one delta sequence: never between a delta's rows (dlrmkit/live/)
        with self.deltas.serving() if self.deltas else contextlib.nullcontext() as sequence:
            work = self.inference(work)
        t.append(time.perf_counter())
        out = self.postprocess(work, context)
        if sequence is not None:
            for i in range(len(data)):
                context.set_response_header(i, DELTA_HEADER, str(sequence))
        t.append(time.perf_counter())
        _record_metrics(
            context.metrics,
            len(data),
            work.forwards,
            work.errors,
            t,
            sum(getattr(work.requests[i], "clipped", 0) for i in work.scores),
        )
        return out

    def preprocess(self, data, context) -> RequestBatch:
        """Requests -> their protocol objects, the good rows collated in groups, the bad requests' errors.

        Requests are collated in groups of at most MAX_ROWS_PER_FORWARD rows (a bigger request
        is a group of its own), so a batch of large ranking requests never becomes one forward
        pass of hundreds of thousands of rows."""
        errors: dict[int, RequestError] = {}
        requests: list[Any] = []
        groups: list[list[tuple[int, ParsedRequest]]] = []
        group: list[tuple[int, ParsedRequest]] = []
        rows = 0
        for i, row in enumerate(data):
            kserve_route = _header(context, i, URL_PATH) is None and _header(context, i, HOST) is not None
            try:
                body = _body(row, context, i)
            except RequestError as e:
                errors[i] = e
                body = None
            req = open_request(
                body,
                kserve_route,
                _header(context, i, BINARY_SPELLINGS),
                self.parser,
                self.model_id,
                _header(context, i, CONTENT_TYPE),
            )
            requests.append(req)
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
            if batch is not None:
                forwards.append((batch, [i for j, (i, _) in enumerate(group) if j not in bad]))
        return RequestBatch(requests, forwards, errors)

    def inference(self, data: RequestBatch, *args, **kwargs) -> RequestBatch:
        """One forward pass per group of good rows, under inference_mode."""
        for batch, index in data.forwards:
            try:
                per_request = scores(self.model, batch, self.config, self.split_pool, self.split_parts)
            except Exception as e:  # the server's fault, not a request's: fail this batch only
                rows = batch.dense.shape[0]
                if isinstance(e, MemoryError) or "out of memory" in str(e).lower():
                    if self.device.type == "cuda":
                        torch.cuda.empty_cache()
                    logger.error("out of memory scoring a batch of %d rows: %s", rows, e)
                    raise PredictionException(f"Out of memory scoring a batch of {rows} rows", 507) from None
                logger.exception("forward pass failed for a batch of %d rows", rows)
                raise PredictionException(f"Internal error scoring a batch: {type(e).__name__}", 500) from None
            data.scores.update(zip(index, per_request))
        return data

    def postprocess(self, data: RequestBatch, ctx) -> list:
        """One body per request, shaped by its protocol; a bad request gets its own status and
        an error body."""
        out = []
        for i, req in enumerate(data.requests):
            client_id = _client_request_id(ctx, i)
            if client_id:
                ctx.set_response_header(i, CLIENT_ID_ECHO, client_id)
            if i in data.scores:
                reply = req.answer(data.scores[i])
            else:
                err = data.errors[i]
                ctx.set_response_status(err.status, err.phrase, i)
                # Never log headers: they carry the client's token. The client's id is vetted ASCII.
                logger.info(
                    "rejected request %s%s (%d): %s",
                    _request_id(ctx, i),
                    f" client {client_id}" if client_id else "",
                    err.status,
                    err.message,
                )
                reply = req.error(err)
            ctx.set_response_content_type(i, reply.content_type)
            for name, value in reply.header_fields.items():
                ctx.set_response_header(i, name, value)
            out.append(reply.body)
        return out


def _record_metrics(
    metrics, n_requests: int, batches: list[tuple[Batch, list[int]]], errors: dict, t: list[float], clipped: int = 0
) -> None:
    """One batch's counters; each is declared in metrics.yaml with exactly these dimensions
    (TorchServe appends ModelName and Level) or TorchServe drops it. Fresh Dimension lists:
    TorchServe's metrics API appends to the list it is given."""
    metrics.add_time("HandlerTime", round((t[-1] - t[0]) * 1000, 2), None, "ms")
    metrics.add_counter("dlrm_batches_total", 1, None, [])
    metrics.add_counter("dlrm_requests_total", n_requests, None, [])
    metrics.add_counter("dlrm_instances_total", sum(sum(b.rows) for b, _ in batches), None, [])
    for phase, start, end in zip(("preprocess", "inference", "postprocess"), t, t[1:]):
        metrics.add_metric(f"dlrm_{phase}_ms_total", round((end - start) * 1000, 3), "ms", None, [])
    remapped = sum(b.remapped_ids for b, _ in batches)
    if remapped:
        metrics.add_counter("dlrm_remapped_ids_total", remapped, None, [])
    if clipped:
        metrics.add_counter("dlrm_clipped_dense_total", clipped, None, [])
    for kind, count in collections.Counter(type(e).__name__ for e in errors.values()).items():
        metrics.add_counter("dlrm_rejected_requests_total", count, None, [Dimension("ErrorType", kind)])


def _live_metric(metrics, name: str, value: float, unit: str, **dims: str) -> None:
    """dlrmkit.live's metrics into TorchServe's: ``*_total`` a counter, the rest gauges (metrics.yaml)."""
    dimensions = [Dimension(k, v) for k, v in dims.items()]
    if name.endswith("_total"):
        metrics.add_counter(name, value, None, dimensions)
    else:
        metrics.add_metric(name, value, unit, None, dimensions, MetricTypes.GAUGE)


def _body(row: dict, ctx, idx: int):
    """The request body from TorchServe's row. A form post (curl -d without a Content-Type)
    arrives split into form fields, or as nothing at all: never a DLRM request."""
    for key in ("body", "data"):
        if row.get(key) is not None:
            return row[key]
    content_type = (_header(ctx, idx, CONTENT_TYPE) or "").lower()
    if row or content_type.startswith(("application/x-www-form-urlencoded", "multipart/form-data")):
        raise BadRequest(
            "body: expected JSON with Content-Type: application/json, got a form post "
            "(add -H 'Content-Type: application/json' to curl)"
        )
    return None


def _client_request_id(ctx, idx: int) -> str | None:
    """The client's X-Request-Id if it is a short visible-ASCII token, else None."""
    value = _header(ctx, idx, CLIENT_ID_SPELLINGS)
    return value if value is not None and _CLIENT_ID.fullmatch(value) else None


def _header(ctx, idx: int, spellings) -> str | None:
    """A request header under the first of its spellings the client used: TorchServe hands
    header names over as the client spelled them."""
    for name in spellings:
        value = ctx.get_request_header(idx, name)
        if value is not None:
            return value
    return None


def _request_id(ctx, idx):
    ids = getattr(ctx, "request_ids", None) or {}
    return ids.get(idx, f"#{idx}")
