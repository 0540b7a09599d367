"""TorchServe handler for torchrec DLRM models.

Thin wiring over the TorchServe-free core (dlrmkit.worker.Worker, which KServe's door,
dlrm_kserve.py, serves too). A request's way through one TorchServe batch::

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
import functools
import logging
import os
import re
import time
from abc import ABC
from typing import Any

from ts.metrics.dimension import Dimension
from ts.metrics.metric_type_enum import MetricTypes
from ts.service import PREDICTION_METRIC
from ts.torch_handler.base_handler import BaseHandler
from ts.utils.util import PredictionException

from dlrmkit.batch import Batch, RequestBatch
from dlrmkit.errors import ConfigError, RequestError, ServerError
from dlrmkit.protocols import BINARY_HEADER, open_request
from dlrmkit.tally import GAUGE, Tally, TalliedGauges
from dlrmkit.worker import DELTA_HEADER, Worker, form_post

logger = logging.getLogger(__name__)

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
# TorchServe's metrics are lines on the worker's stdout that its frontend reads back, matches and
# logs again: eight a batch (seven of them the handler's), plus the worker's receipt line. Under
# MLPerf's Server scenario that reading was 30% of the frontend's sampled CPU, so the handler's
# metrics are summed and emitted every METRICS_SECONDS (docs/operations.md#metrics), TorchServe's
# own PredictionTime with them, and the receipt line, which says only the time, is dropped. 0: all
# per batch, as TorchServe's own handlers.
METRICS_SECONDS_ENV, METRICS_SECONDS = "DLRM_METRICS_SECONDS", 0.25
RECEIPT = "Backend received inference at: %d"  # ts/protocol/otf_message_handler.py, per batch


class TorchRecDLRMHandler(Worker, BaseHandler, ABC):
    """Scores DLRM requests; see docs/requests-and-errors.md for the request and response formats.

    The worker itself (loading, grouping, forwards, replies) is ``dlrmkit.worker.Worker``; this
    class adds what TorchServe speaks: its context (manifest, properties, header fields, per-request
    statuses), its metrics objects and PredictionException. ``close`` stops what ``initialize``
    started beside the serving thread (the split pool, the live watcher and its writer process)."""

    def initialize(self, context):
        self.manifest = context.manifest
        metrics = getattr(context, "metrics", None)
        seconds = _metrics_seconds(os.environ.get(METRICS_SECONDS_ENV))  # a bad value fails before the load
        self.load(
            context.system_properties.get("model_dir") or ".",
            self.manifest,
            context.model_yaml_config,
            context.system_properties.get("gpu_id"),
            functools.partial(_live_metric, metrics) if metrics is not None else None,
        )
        self.sink = metrics  # the metrics object of the latest batch's context: where the tally emits
        self.tally = Tally(self._emit, seconds)  # after the load: a worker that fails to load starts no thread
        if metrics is not None and seconds:
            # TorchServe's service records PredictionTime after every batch, on the context's metrics
            context.metrics = TalliedGauges(metrics, self.tally, (PREDICTION_METRIC,))
        # the worker's own module logs the receipt line on the root logger (one handler per process)
        (logging.getLogger().addFilter if seconds else logging.getLogger().removeFilter)(_no_receipt)
        atexit.register(self.close)  # the worker's own exit (its frontend's socket closed: sys.exit(0)); see close
        self.initialized = True

    def close(self) -> None:
        """Stop the live watcher (its thread, and its writer process where it runs one) and the split
        pool's threads (``Worker.close``). Safe to call twice. Registered with atexit by initialize: it
        runs when the worker exits on its own, as TorchServe's message loop does (sys.exit(0)) once its
        frontend's socket closes.

        TorchServe 0.12 itself stops a worker (scale down, unregister, ``torchserve --stop``) by closing
        that socket and killing the process at once (Process.destroyForcibly: SIGKILL); measured, no
        Python exit hook ran on any of the three. There the kernel releases the same: the threads end
        with the process, the writer process with its parent (PR_SET_PDEATHSIG, dlrmkit/live/writer.py);
        tests/test_variants_server.py checks that nothing is left."""
        atexit.unregister(self.close)
        tally = getattr(self, "tally", None)
        if tally is not None:
            tally.close()  # what is pending goes out
        super().close()
        self.initialized = False

    def handle(self, data, context):
        """One TorchServe batch in, exactly one response per request out, in order."""
        t = [time.perf_counter()]
        metrics = context.metrics
        self.sink = metrics.inner if isinstance(metrics, TalliedGauges) else metrics
        work = self.preprocess(data, context)
        t.append(time.perf_counter())
        # The whole batch scored under one delta sequence: never between a delta's rows (dlrmkit/live/)
        with self.serving() as sequence:
            work = self.inference(work)
        t.append(time.perf_counter())
        out = self.postprocess(work, context)
        if sequence is not None:
            for i in range(len(data)):
                context.set_response_header(i, DELTA_HEADER, str(sequence))
        t.append(time.perf_counter())
        _record_metrics(
            self.tally,
            len(data),
            work.forwards,
            work.errors,
            t,
            sum(getattr(work.requests[i], "clipped", 0) for i in work.scores),
        )
        return out

    def preprocess(self, data, context) -> RequestBatch:
        """TorchServe's rows -> their protocol objects (dlrmkit.protocols), grouped for the forward
        by ``Worker.group``: the good rows collated in groups, the bad requests' errors."""
        errors: dict[int, RequestError] = {}
        requests: list[Any] = []
        for i, row in enumerate(data):
            kserve_route = _header(context, i, URL_PATH) is None and _header(context, i, HOST) is not None
            try:
                body = _body(row, context, i)
            except RequestError as e:
                errors[i] = e
                body = None
            requests.append(
                open_request(
                    body,
                    kserve_route,
                    _header(context, i, BINARY_SPELLINGS),
                    self.parser,
                    self.model_id,
                    _header(context, i, CONTENT_TYPE),
                )
            )
        return self.group(requests, errors)

    def inference(self, data: RequestBatch, *args, **kwargs) -> RequestBatch:
        """One forward pass per group of good rows (``Worker.infer``); a failed forward fails this
        TorchServe batch with its status (507 out of memory, else 500)."""
        try:
            return self.infer(data)
        except ServerError as e:
            raise PredictionException(e.message, e.status) from None

    def postprocess(self, data: RequestBatch, ctx) -> list:
        """One body per request, shaped by its protocol; a bad request gets its own status and
        an error body."""
        out = []
        for i, (reply, err) in enumerate(self.replies(data)):
            client_id = _client_request_id(ctx, i)
            if client_id:
                ctx.set_response_header(i, CLIENT_ID_ECHO, client_id)
            if err is not None:
                ctx.set_response_status(err.status, err.phrase, i)
                # Never log headers: they carry the client's token. The client's id is vetted ASCII.
                logger.info(
                    "rejected request %s%s (%d): %s",
                    _request_id(ctx, i),
                    f" client {client_id}" if client_id else "",
                    err.status,
                    err.message,
                )
            ctx.set_response_content_type(i, reply.content_type)
            for name, value in reply.header_fields.items():
                ctx.set_response_header(i, name, value)
            out.append(reply.body)
        return out

    def _emit(self, name: str, value: float, unit: str, kind: str, dims: tuple) -> None:
        """One summed metric into TorchServe's metrics API (the tally's thread, or this one with 0
        seconds). Fresh Dimension lists: TorchServe's metrics API appends to the list it is given."""
        dimensions = [Dimension(k, v) for k, v in dims]
        if kind == GAUGE:
            self.sink.add_time(name, value, None, unit, dimensions)
        elif unit == "count":
            self.sink.add_counter(name, value, None, dimensions)
        else:
            self.sink.add_metric(name, round(value, 3), unit, None, dimensions)


def _record_metrics(
    tally: Tally,
    n_requests: int,
    batches: list[tuple[Batch, list[int]]],
    errors: dict,
    t: list[float],
    clipped: int = 0,
) -> None:
    """One batch's counters, into the tally (emitted by ``TorchRecDLRMHandler._emit``). Each is
    declared in metrics.yaml with exactly these dimensions (TorchServe appends ModelName and Level)
    or TorchServe drops it."""
    tally.add("HandlerTime", round((t[-1] - t[0]) * 1000, 2), "ms", GAUGE)
    tally.add("dlrm_batches_total", 1)
    tally.add("dlrm_requests_total", n_requests)
    tally.add("dlrm_instances_total", sum(sum(b.rows) for b, _ in batches))
    for phase, start, end in zip(("preprocess", "inference", "postprocess"), t, t[1:]):
        tally.add(f"dlrm_{phase}_ms_total", (end - start) * 1000, "ms")
    remapped = sum(b.remapped_ids for b, _ in batches)
    if remapped:
        tally.add("dlrm_remapped_ids_total", remapped)
    if clipped:
        tally.add("dlrm_clipped_dense_total", clipped)
    for kind, count in collections.Counter(type(e).__name__ for e in errors.values()).items():
        tally.add("dlrm_rejected_requests_total", count, dims=(("ErrorType", kind),))


def _metrics_seconds(raw: str | None) -> float:
    """DLRM_METRICS_SECONDS: how often the handler's metrics go out (default METRICS_SECONDS)."""
    if raw is None or raw.strip() == "":
        return METRICS_SECONDS
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds <= 60:
        raise ConfigError(
            f"{METRICS_SECONDS_ENV}={raw!r}: expected seconds from 0 (every batch) to 60, e.g. {METRICS_SECONDS}"
        )
    return seconds


def _no_receipt(record: logging.LogRecord) -> bool:
    return record.msg != RECEIPT


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
        raise form_post()
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
