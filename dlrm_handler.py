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

import collections
import contextlib
import functools
import logging
import os
import re
import time
from abc import ABC
from concurrent.futures import ThreadPoolExecutor

import torch
from ts.metrics.dimension import Dimension
from ts.metrics.metric_type_enum import MetricTypes
from ts.torch_handler.base_handler import BaseHandler
from ts.utils.util import PredictionException

from dlrmkit.config import DLRMConfig
from dlrmkit.batch import collate, scores
from dlrmkit.forms import RequestParser
from dlrmkit.cpus import available_cpus, forward_threads, split_parts, torch_threads
from dlrmkit import dense as dense_half
from dlrmkit.errors import BadRequest, ConfigError, RequestError
from dlrmkit.live import DeltaApplier, start_watcher
from dlrmkit.model import DLRMFactory
from dlrmkit.protocols import BINARY_HEADER, open_request
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
    """Scores DLRM requests; see docs/requests-and-errors.md for the request and response formats."""

    deltas = None  # with handler.delta_dir: the dlrmkit.live.DeltaApplier following it
    delta_applier = DeltaApplier  # its class (tests/unguarded_handler.py injects one without the lock)

    def initialize(self, context):
        props = context.system_properties
        model_dir = props.get("model_dir") or "."
        self.manifest = context.manifest
        self.config = DLRMConfig.from_dict((context.model_yaml_config or {}).get("handler"))
        serialized = (self.manifest or {}).get("model", {}).get("serializedFile")
        if not serialized:
            raise ConfigError(
                "the archive has no weights: build it with scripts/build_mar.py "
                "(torch-model-archiver --serialized-file dlrm.pt)"
            )
        # Several GPUs for one worker (parallelType: custom): the tables are sharded across
        # them and the dense part and batches go to the first; otherwise one device.
        cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
        devices = worker_devices(props.get("gpu_id"), context.model_yaml_config, cuda)
        self.device = devices[0]
        # maxWorkers when the config pins it, else the CPU rule's count (tsctl starts that many)
        workers = (context.model_yaml_config or {}).get("maxWorkers")
        torch.set_num_threads(torch_threads(self.config.torch_threads, workers))
        self.threads, self.cpus = torch.get_num_threads(), available_cpus()
        if self.config.large_batch_rows and os.environ.get("OMP_WAIT_POLICY", "").upper() != "PASSIVE":
            logger.warning("handler.large_batch_rows without OMP_WAIT_POLICY=PASSIVE in the worker's environment: "
                           "OpenMP's threads spin on cores the other workers need (scripts/tsctl.py sets it)")
        started = time.perf_counter()
        factory = DLRMFactory(self.config)
        self.model = factory.load(os.path.join(model_dir, serialized), devices)
        self.model, dense = dense_half.prepare(self.model, self.config, model_dir, devices)
        frozen = factory.freeze_dense(self.model) if len(devices) == 1 and dense.startswith("fp32") else []
        if self.config.large_batch_rows and not dense.startswith("fp32"):
            logger.warning("handler.large_batch_rows with a compiled dense half: measured worse than %d thread(s) "
                           "per forward even with its kernels for more made at start (DLRMv2 int8 on AMX: p99 120 vs "
                           "75 ms at 10 q/s, docs/performance.md)", self.threads)
        # handler.split_rows: a large forward's parts run at once, on the pool's threads and this one
        self.split_parts = split_parts(self.threads, self.cpus) if self.device.type == "cpu" else 1
        self.split_pool = (
            # each pool thread on the worker's own thread count (OpenMP's count is per calling thread)
            ThreadPoolExecutor(self.split_parts - 1, "dlrm-split", torch.set_num_threads, (self.threads,))
            if self.config.split_rows and self.split_parts > 1 else None
        )
        if self.config.split_rows and self.split_pool is None:
            logger.warning("handler.split_rows %d: nothing to split onto (%s): every forward runs whole",
                           self.config.split_rows, f"{self.cpus} CPU(s), {self.threads} torch thread(s) per part"
                           if self.device.type == "cpu" else f"the model is on {self.device}")
        self.parser = RequestParser(self.config)
        model = (self.manifest or {}).get("model", {})
        self.model_id = (model.get("modelName", "dlrm"), str(model.get("modelVersion", "1.0")))
        # handler.delta_dir: every visible delta applied now, before the worker reports ready; then a watcher
        metrics = getattr(context, "metrics", None)
        emit = functools.partial(_live_metric, metrics) if metrics is not None else None
        self.deltas = start_watcher(self.config, self.model, model_dir, os.path.join(model_dir, serialized),
                                    self.model_id[0], devices, emit, self.delta_applier)
        self.initialized = True
        logger.info(
            "DLRM loaded on %s in %.1f s: %d dense, %d sparse features, %d embedding rows (%s), output %s, "
            "%d torch threads%s%s, frozen: %s; dense half: %s",
            ", ".join(map(str, devices)) + (" (tables sharded)" if len(devices) > 1 else ""),
            time.perf_counter() - started, self.config.num_dense_features, self.config.num_features,
            sum(self.config.num_embeddings), self.config.embedding_dtype, self.config.output, self.threads,
            f" ({self.cpus} from {self.config.large_batch_rows} rows, OMP_WAIT_POLICY "
            f"{os.environ.get('OMP_WAIT_POLICY', 'unset')})" if self.config.large_batch_rows else "",
            f"; a forward of more than {self.config.split_rows} rows split into up to {self.split_parts} parts at once"
            if self.split_pool else "",
            ", ".join(frozen) or "nothing", dense,
        )

    def handle(self, data, context):
        """One TorchServe batch in, exactly one response per request out, in order."""
        t = [time.perf_counter()]
        self.context = context
        pre = self.preprocess(data)
        t.append(time.perf_counter())
        # The whole batch scored under one delta sequence: never between a delta's rows (dlrmkit/live/)
        with self.deltas.serving() if self.deltas else contextlib.nullcontext() as sequence:
            scored = self.inference(pre)
        t.append(time.perf_counter())
        out = self.postprocess(scored)
        if sequence is not None:
            for i in range(len(data)):
                context.set_response_header(i, DELTA_HEADER, str(sequence))
        t.append(time.perf_counter())
        _record_metrics(context.metrics, len(data), pre[0], scored[1], t,
                        sum(getattr(self.requests[i], "clipped", 0) for i in scored[0]))
        return out

    def preprocess(self, data):
        """Requests -> (groups of (Batch, request indices), {request index: RequestError}, count).

        Requests are collated in groups of at most MAX_ROWS_PER_FORWARD rows (a bigger request
        is a group of its own), so a batch of large ranking requests never becomes one forward
        pass of hundreds of thousands of rows."""
        errors, groups, group, rows = {}, [], [], 0
        self.requests = []  # per request: its protocol, which parses it and shapes its answer
        for i, row in enumerate(data):
            kserve_route = _header(self.context, i, URL_PATH) is None and _header(self.context, i, HOST) is not None
            try:
                body = _body(row, self.context, i)
            except RequestError as e:
                errors[i] = e
                body = None
            req = open_request(body, kserve_route, _header(self.context, i, BINARY_SPELLINGS), self.parser,
                               self.model_id, _header(self.context, i, CONTENT_TYPE))
            self.requests.append(req)
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
        batches = []
        for group in groups:
            batch, bad = collate([p for _, p in group], self.config, self.device)
            errors.update({group[j][0]: e for j, e in bad.items()})
            if batch is not None:
                batches.append((batch, [i for j, (i, _) in enumerate(group) if j not in bad]))
        return batches, errors, len(data)

    def inference(self, data, *args, **kwargs):
        """One forward pass per group of good rows, under inference_mode."""
        batches, errors, n = data
        results = {}
        for batch, index in batches:
            threads = forward_threads(batch.dense.shape[0], self.threads, self.config.large_batch_rows, self.cpus)
            if threads != torch.get_num_threads():
                torch.set_num_threads(threads)
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
            results.update(zip(index, per_request))
        return results, errors, n

    def postprocess(self, data):
        """One body per request, shaped by its protocol; a bad request gets its own status and
        an error body."""
        results, errors, n = data
        out = []
        ctx = self.context
        for i in range(n):
            client_id = _client_request_id(ctx, i)
            if client_id:
                ctx.set_response_header(i, CLIENT_ID_ECHO, client_id)
            if i in results:
                reply = self.requests[i].answer(results[i])
            else:
                err = errors[i]
                ctx.set_response_status(err.status, err.phrase, i)
                # Never log headers: they carry the client's token. The client's id is vetted ASCII.
                logger.info("rejected request %s%s (%d): %s", _request_id(ctx, i),
                            f" client {client_id}" if client_id else "", err.status, err.message)
                reply = self.requests[i].error(err)
            ctx.set_response_content_type(i, reply.content_type)
            for name, value in reply.header_fields.items():
                ctx.set_response_header(i, name, value)
            out.append(reply.body)
        return out


def _record_metrics(metrics, n_requests: int, batches: list, errors: dict, t: list[float], clipped: int = 0) -> None:
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
    try:
        content_type = (_header(ctx, idx, CONTENT_TYPE) or "").lower()
    except Exception:  # header lookups differ across TorchServe versions and fakes
        content_type = ""
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
