#!/usr/bin/env python
"""The kit's second front door: an archive served by KServe's own Python model server (kserve 0.21).

    python dlrm_kserve.py --model-path model-store/dlrm.mar            # REST :8080, gRPC :8081
    python dlrm_kserve.py --model-path /data/store/dlrm --http-port 9080 --grpc-port 9081

``--model-path``: what scripts/build_mar.py built (a .mar: unpacked into a temporary directory) or a
model directory (scripts/build_big.py's, or an unpacked .mar: loaded where it lies). The same file
TorchServe serves, no rebuild. The model is served under the archive's model name.

What it answers (docs/kserve-door.md):

* REST, read by the kit's own parsers (dlrmkit.protocols) on routes registered before kserve's, so a
  body is parsed once and answers are byte for byte the TorchServe door's: KServe v1
  ``POST /v1/models/<m>:predict``, Open Inference Protocol v2 ``POST /v2/models/<m>/infer`` (JSON
  and binary tensors), and the kit's ``POST /predictions/<m>`` (its JSON forms, Criteo TSV);
* gRPC, Open Inference Protocol v2 (kserve's servicer): ``ModelInfer`` with typed contents or
  ``raw_input_contents``, read by the same parsers; ``ServerLive``, ``ModelReady``, ``ModelMetadata``;
* kserve's health and metadata: ``/v2/health/live``, ``/v2/models/<m>/ready`` (the model's real
  state), ``GET /v2/models/<m>`` (the inputs the TorchServe door declares), ``/metrics``.

Requests wait in one bounded queue and are scored in batches, as TorchServe batches its queue: one
call of the worker takes what is waiting, at most the model config's ``batchSize``, with no wait to
fill a batch. A bad request gets 400 (413 when too large) and the kit's error body naming the field,
its neighbours in the batch their scores; over gRPC INVALID_ARGUMENT with the same message. A full
queue (4 x batchSize requests waiting) answers 503 at once (gRPC UNAVAILABLE). /metrics adds
dlrm_door_batch_requests (requests per call) and dlrm_door_queue_full_total. kserve's
unauthenticated repository routes (load and unload, REST and gRPC) are refused.

``--workers N``: N REST processes (kserve's, spawned), each loading the model from the same
directory (tables memory-mapped: one copy in the page cache) and answering 503 until loaded; gRPC
is served by the server's own process. Unset, it follows the TorchServe door's CPU rule: the model
config's maxWorkers, else one process per CPU (per handler.torch_threads CPUs when set), torch
threads per process from the same rule. With handler.delta_dir every process follows the deltas:
REST answers carry X-Delta-Sequence, gRPC answers the parameter delta_sequence.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import ctypes
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
import zipfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from grpc_interceptor.exceptions import Internal, ResourceExhausted, Unavailable
from kserve import InferOutput, InferRequest, InferResponse, Model, ModelServer, model_server
from kserve.errors import InvalidInput, ModelNotReady
from kserve.model_repository import ModelRepository
from kserve.protocol.rest.multiprocess import server as rest_processes
from prometheus_client import Counter, Histogram

from dlrmkit.config import DLRMConfig
from dlrmkit.cpus import available_cpus, model_workers
from dlrmkit.errors import Busy, OutOfMemory, RequestError, ServerError
from dlrmkit.protocols import BINARY_HEADER, OUTPUT, model_metadata, open_request
from dlrmkit.worker import DELTA_HEADER, Worker, form_post, read_model_dir

logger = logging.getLogger("dlrm_kserve")  # also in kserve's spawned REST processes (there __mp_main__)

FORM_TYPES = ("application/x-www-form-urlencoded", "multipart/form-data")
DOORS: dict[str, DLRMDoor] = {}  # this process's loaded models by name, for the kit's routes
QUEUE_BATCHES = 4  # requests waiting for the scoring thread, at most: this many batches' worth (batchSize each)

# On kserve's /metrics (prometheus_client's default registry), per process: a scrape reaches one
# process, ``pid`` says which (with --workers N each REST process keeps its own counts).
BATCH_REQUESTS = Histogram(
    "dlrm_door_batch_requests",
    "Requests scored together in one call of the worker (one batch of the KServe door)",
    ["pid"],
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
)
QUEUE_FULL = Counter("dlrm_door_queue_full", "Requests answered 503 because the door's queue was full", ["pid"])

# Per-request log lines (uvicorn's access line, kserve's two timing lines): off unless --request-log.
# Three formatted lines a request cost a fifth of single-row throughput (one process, concurrency 64,
# 1,930-1,974 vs 2,364-2,518 req/s, runs alternated). A filter on the loggers themselves, which
# kserve's logging configuration (the server's and each REST process's) keeps: it resets levels and
# handlers, not a logger's filters.
REQUEST_LOGGERS = ("uvicorn.access", "kserve.trace")
REQUEST_LOG = {"on": False}


def _request_log(record: logging.LogRecord) -> bool:
    return REQUEST_LOG["on"]


for _name in REQUEST_LOGGERS:
    logging.getLogger(_name).addFilter(_request_log)

SCORING_THREAD = "dlrm-score"  # the scoring thread's name, in /proc too (bench/doors.py counts its CPU)


def scoring_thread(threads: int) -> None:
    """The scoring thread's start: its torch threads (OpenMP's count is per thread) and its name as
    the kernel shows it (``/proc/<pid>/task/<tid>/comm``), so its CPU is told from the server's."""
    torch.set_num_threads(threads)
    try:
        ctypes.CDLL(None).prctl(15, ctypes.c_char_p(SCORING_THREAD.encode()), 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):  # not Linux: the name is only for measuring
        pass


# One request's outcome from a batch: its reply, its error or None, the delta sequence, its scores
Result = tuple[Any, RequestError | None, int | None, Any]


class Batcher:
    """Requests waiting for the scoring thread, grouped as TorchServe groups its queue.

    ``submit`` queues one opened request (with the door's own error for it, if any) and waits for
    its result. One loop takes the first request waiting, then whatever else is queued, at most
    ``batch_size`` requests, and hands them to ``run`` in one call on ``pool`` (the scoring thread):
    no wait for a batch to fill, so a lone request goes at once, and under load the requests queued
    during one call are the next call's batch. The queue holds ``max_queued`` requests; one more is
    refused at once (``Busy``: 503, gRPC UNAVAILABLE) instead of waiting without bound."""

    def __init__(
        self,
        run: Callable[[Sequence[Any], dict[int, RequestError]], list[Result]],
        pool: ThreadPoolExecutor,
        batch_size: int,
        max_queued: int,
    ):
        self.run, self.pool = run, pool
        self.batch_size, self.max_queued = max(1, batch_size), max(1, max_queued)
        self.queue: asyncio.Queue[tuple[Any, RequestError | None, asyncio.Future]] = asyncio.Queue(self.max_queued)
        self.task: asyncio.Task | None = None
        self.pid = str(os.getpid())

    async def submit(self, req: Any, error: RequestError | None = None) -> Result:
        loop = asyncio.get_running_loop()
        if self.task is None or self.task.done():
            self.task = loop.create_task(self._serve(), name="dlrm-batcher")
        future = loop.create_future()
        try:
            self.queue.put_nowait((req, error, future))
        except asyncio.QueueFull:
            QUEUE_FULL.labels(self.pid).inc()
            raise Busy(
                f"the server is busy: {self.max_queued} requests are already waiting to be scored; retry later"
            ) from None
        return await future

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            items = [await self.queue.get()]
            while len(items) < self.batch_size and not self.queue.empty():
                items.append(self.queue.get_nowait())
            items = [item for item in items if not item[2].done()]  # a client that went away: not scored
            if not items:
                continue
            errors = {i: e for i, (_, e, _) in enumerate(items) if e is not None}
            BATCH_REQUESTS.labels(self.pid).observe(len(items))
            try:
                results = await loop.run_in_executor(self.pool, self.run, [r for r, _, _ in items], errors)
            except Exception as e:  # the server's fault: every request of this call fails, the next call is served
                if not isinstance(e, ServerError):
                    logger.exception("scoring a batch of %d requests failed", len(items))
                    e = ServerError(f"Internal error scoring a batch: {type(e).__name__}")
                for _, _, future in items:
                    if not future.done():
                        future.set_exception(e)
                continue
            for (_, _, future), result in zip(items, results):
                if not future.done():
                    future.set_result(result)


def model_dir(path: str | Path) -> tuple[Path, Path | None]:
    """The model directory of ``path`` and the temporary directory to remove at stop (None when
    ``path`` is a directory already). A .mar is a zip (build_mar.py stores it uncompressed)."""
    path = Path(path)
    if path.is_dir():
        return path, None
    if not zipfile.is_zipfile(path):
        raise SystemExit(f"error: --model-path {path}: not a .mar or a model directory")
    tmp = Path(tempfile.mkdtemp(prefix="dlrm-mar-"))
    with zipfile.ZipFile(path) as z:
        z.extractall(tmp)
    return tmp, tmp


class DLRMDoor(Model):
    """One archive's model in KServe's model server. ``load`` is idempotent and cheap once loaded
    (kserve's gRPC ModelInfer calls it again whenever ``healthy()`` is False).

    With ``--workers N`` kserve pickles the door into each of its N REST processes (spawned): the
    copy carries the model directory, not the loaded model; each process loads its own (``load`` in
    a thread at unpickling, so kserve's liveness pings are answered meanwhile) and answers 503
    until it has. The tables are memory-mapped from the same files, shared through the page cache."""

    def __init__(self, path: str | Path, workers: int = 1):
        self.dir, self._tmp = model_dir(path)
        self.manifest, self.model_yaml = read_model_dir(self.dir)
        self.config = DLRMConfig.from_dict(self.model_yaml.get("handler"))  # fails early, naming the key
        model = self.manifest.get("model", {})
        super().__init__(str(model.get("modelName", "dlrm")))
        self.version = str(model.get("modelVersion", "1.0"))
        self.workers = workers  # the server's REST processes: the CPU rule's share of torch threads
        self.request_log = False  # --request-log, carried to the REST processes
        # TorchServe's batchSize (its default 1): the most queued requests one call of the worker scores
        self.batch_size = max(1, int(self.model_yaml.get("batchSize") or 1))
        self.max_queued = QUEUE_BATCHES * self.batch_size
        self.worker: Worker | None = None
        # Scoring runs off the event loop, one call at a time (as one TorchServe worker), so health
        # checks and gRPC stay answered during a forward. OpenMP's thread count is per thread: set there.
        self.pool: ThreadPoolExecutor | None = None
        self.batcher: Batcher | None = None
        if self._tmp is not None:  # the unpacked .mar: removed by this process only, at its exit, after stop
            atexit.register(shutil.rmtree, self._tmp, True)
        atexit.register(self.stop)

    def __getstate__(self) -> dict:
        """A copy for a spawned REST process: the model directory, not what this process loaded."""
        state = self.__dict__.copy()
        state.update(worker=None, pool=None, batcher=None, ready=False, _tmp=None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        REQUEST_LOG["on"] = self.request_log
        DOORS[self.name] = self  # the kit's routes answer 503 until loaded, not 404
        atexit.register(self.stop)
        threading.Thread(target=self._load_here, name="dlrm-load", daemon=True).start()

    def _load_here(self) -> None:
        say_how()
        try:
            self.load()
        except Exception:
            logger.exception(
                "process %d could not load model %s from %s: it answers 503", os.getpid(), self.name, self.dir
            )

    def load(self) -> bool:
        if self.worker is None:
            worker = Worker()
            device = 0 if torch.cuda.is_available() else None
            worker.load(self.dir, self.manifest, self.model_yaml, device, workers=self.workers)
            self.pool = ThreadPoolExecutor(1, SCORING_THREAD, scoring_thread, (worker.threads,))
            self.batcher = Batcher(self._run, self.pool, self.batch_size, self.max_queued)
            self.worker = worker
            logger.info("process %d serves model %s", os.getpid(), self.name)
        DOORS[self.name] = self
        self.ready = True
        return True

    async def healthy(self) -> bool:
        return self.ready and self.worker is not None

    def stop(self) -> None:
        """SIGTERM (kserve unloads every model): the live watcher, the split pool, the scoring thread."""
        self.ready = False
        DOORS.pop(self.name, None)
        worker, self.worker = self.worker, None
        pool, self.pool = self.pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        if worker is not None:
            worker.close()

    def get_input_types(self) -> list[dict]:
        return model_metadata(self.config)["inputs"]

    def get_output_types(self) -> list[dict]:
        return model_metadata(self.config)["outputs"]

    def _run(self, requests: Sequence[Any], errors: dict[int, RequestError]) -> list[Result]:
        """One batch on the scoring thread: one ``Worker.score`` call, then each request's result."""
        worker = self.worker
        if worker is None:
            raise ServerError(f"Model {self.name} was stopped")
        data, sequence = worker.score(requests, errors)
        return [(reply, err, sequence, data.scores.get(i)) for i, (reply, err) in enumerate(worker.replies(data))]

    async def score(self, req: Any, error: RequestError | None = None) -> Result:
        """One opened request, queued to be scored with the others waiting (``Batcher``): its reply,
        its error or None, the delta sequence, its scores."""
        batcher = self.batcher
        if self.worker is None or batcher is None:
            raise ModelNotReady(self.name)
        return await batcher.submit(req, error)

    async def predict(self, payload: InferRequest, headers: dict | None = None) -> InferResponse:
        """gRPC ModelInfer (REST goes to the kit's routes): the tensors as the kit's v2 body."""
        worker = self.worker
        if worker is None:
            raise ModelNotReady(self.name)
        body, json_length = grpc_body(payload)
        req = open_request(body, True, json_length, worker.parser, worker.model_id)
        try:
            reply, err, sequence, row_scores = await self.score(req)
        except Busy as e:
            raise Unavailable(e.message) from None
        except OutOfMemory as e:
            raise ResourceExhausted(e.message) from None
        except ServerError as e:
            raise Internal(e.message) from None
        if err is not None:
            raise InvalidInput(err.message)  # INVALID_ARGUMENT, the kit's message naming the field
        scores = np.asarray(row_scores, dtype=np.float32).reshape(-1, 1)
        out = InferOutput(OUTPUT, list(scores.shape), "FP32")
        out.set_data_from_numpy(scores, binary_data=payload.use_binary_outputs)
        return InferResponse(
            payload.id or "",
            self.name,
            [out],
            model_version=worker.model_id[1],
            parameters={"delta_sequence": sequence} if sequence is not None else None,
            use_binary_outputs=payload.use_binary_outputs,
            requested_outputs=payload.request_outputs,
        )


def grpc_body(req: InferRequest) -> tuple[bytes, str | None]:
    """A gRPC ModelInfer request as the kit's OIP v2 REST body and its Inference-Header-Content-Length
    (None: all JSON): raw_input_contents become the binary tail, typed contents the inputs' data,
    so dlrmkit.protocols checks sizes, datatypes and ids with the REST messages."""
    inputs, tail = [], []
    for t in req.inputs:
        tensor: dict[str, Any] = {"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}
        raw = t._raw_data  # kserve 0.21 keeps raw_input_contents here and has no public getter
        if raw is not None:
            tensor["parameters"] = {"binary_data_size": len(raw)}
            tail.append(bytes(raw))
        else:
            tensor["data"] = list(t.data or [])
        inputs.append(tensor)
    head: dict[str, Any] = {"inputs": inputs}
    if req.id:
        head["id"] = req.id
    if req.request_outputs:
        head["outputs"] = [{"name": o.name} for o in req.request_outputs]
    header = msgspec.json.encode(head)
    return header + b"".join(tail), (str(len(header)) if tail else None)


# --- the kit's REST routes, ahead of kserve's (Starlette serves the first match) ---------------


async def kit_route(request: Request, model_name: str, model_version: str | None = None) -> Response:
    """/predictions/<m>, /v1/models/<m>:predict, /v2/models/<m>[/versions/<v>]/infer: the raw body to
    the kit's parsers; the answer as the TorchServe door gives it."""
    kserve_route = not request.url.path.startswith("/predictions/")
    door = DOORS.get(model_name)
    if door is None or (model_version is not None and model_version != door.version):
        message = f"Model with name {model_name}{f' version {model_version}' if model_version else ''} does not exist."
        return JSONResponse({"error": message}, 404)
    worker, h = door.worker, request.headers
    if worker is None:
        message = f"Model with name {model_name} is not ready."  # this process is still loading it
        loading = {"code": 503, "type": "ServiceUnavailable", "message": message}
        return JSONResponse({"error": message} if kserve_route else loading, 503)
    content_type = h.get("content-type")
    error = form_post() if (content_type or "").lower().startswith(FORM_TYPES) else None
    body = await request.body()
    req = open_request(body or None, kserve_route, h.get(BINARY_HEADER), worker.parser, worker.model_id, content_type)
    try:
        reply, err, sequence, _ = await door.score(req, error)
    except ServerError as e:  # the server's fault or a full queue: this request fails with 503 / 507 / 500
        body_ = (
            {"error": e.message} if kserve_route else {"code": e.status, "type": type(e).__name__, "message": e.message}
        )
        return JSONResponse(body_, e.status)
    headers = dict(reply.header_fields)
    if sequence is not None:
        headers[DELTA_HEADER] = str(sequence)
    if err is not None:
        logger.info("rejected request on %s (%d): %s", request.url.path, err.status, err.message)
    return Response(reply.body, err.status if err else 200, headers, reply.content_type)


async def refused(request: Request, model_name: str) -> JSONResponse:
    return JSONResponse({"error": "model load and unload are disabled on this server"}, 403)


async def validation_error(request: Request, exc: Exception) -> JSONResponse:
    """FastAPI's 422 for a body it could not read, as the kit's 400 naming the field."""
    errors = exc.errors() if isinstance(exc, RequestValidationError) else []
    message = "; ".join(f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg', '')}" for e in errors) or str(exc)
    return JSONResponse({"error": message}, 400)


class Refused(NotImplementedError):
    """kserve's gRPC interceptor answers a NotImplementedError UNIMPLEMENTED with its ``reason``."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class PinnedRepository(ModelRepository):
    """kserve's registry with its repository extension refused (REST and gRPC load / unload carry no
    authentication); the server's own stop still unloads (``stopping``)."""

    stopping = False

    def load(self, name: str) -> bool:
        raise Refused("model load is disabled on this server")

    def unload(self, name: str) -> None:
        if not self.stopping:
            raise Refused("model unload is disabled on this server")
        super().unload(name)


class DoorServer(ModelServer):
    def stop(self, sig: int) -> None:
        """SIGTERM, once uvicorn has answered the REST requests it accepted (it takes the signal first,
        then hands it on): the models turn not ready, the gRPC server stops taking calls and finishes
        those it took (kserve's grace period), and only then do the models unload. kserve's own stop
        unloads at once, under gRPC calls still running (NOT_FOUND, or a closed worker). Should the
        loop end before the unload, each model's atexit stop does it."""
        if isinstance(self.registered_models, PinnedRepository):
            self.registered_models.stopping = True
        for model in self.registered_models.get_models().values():
            model.ready = False
        # kserve's stop must not stop it again; kserve leaves the attribute untyped (getattr: Any)
        grpc_server = getattr(self, "_grpc_server", None)
        self._grpc_server = None

        async def drain() -> None:
            if grpc_server is not None:
                await grpc_server.stop(sig)
            ModelServer.stop(self, sig)  # the rest of kserve's stop, then the unload

        self._draining = asyncio.get_running_loop().create_task(drain())


class PatientProcess(rest_processes.RESTServerProcess):
    """kserve's REST process (--workers N), given time to start. kserve pings each process every
    0.5 s and kills one that does not answer within 5 s; a spawned process can answer only once it
    has imported this file (torch, kserve: ~4 s on an idle 2-CPU machine), so on a busy machine kserve
    killed new processes and spawned others (seen: each of two killed once). Until a process first
    answers (at most STARTUP_S) a missed answer does not count; after, kserve's rule holds."""

    STARTUP_S = 300.0

    def start(self) -> None:
        self._born, self._pinged, self._answered = time.monotonic(), False, False
        super().start()

    def is_alive(self, timeout: float = 5) -> bool:
        if self._answered or not self._process.is_alive():
            return super().is_alive(timeout)
        if not self._pinged:
            self._parent_conn.send(b"ping")
            self._pinged = True
        if self._parent_conn.poll(0):  # never blocks kserve's event loop (gRPC) while a process starts
            self._parent_conn.recv()
            self._answered = True
            return True
        return time.monotonic() - self._born < self.STARTUP_S


def register_routes(app=model_server.app) -> None:
    """The kit's routes on kserve's app, before kserve adds its own in ``start`` (module level: a
    spawned worker process re-imports this file and needs them too)."""
    for path in (
        "/predictions/{model_name}",
        "/v1/models/{model_name}:predict",
        "/v2/models/{model_name}/infer",
        "/v2/models/{model_name}/versions/{model_version}/infer",
    ):
        app.add_api_route(path, kit_route, methods=["POST"])
    for path in ("/v2/repository/models/{model_name}/load", "/v2/repository/models/{model_name}/unload"):
        app.add_api_route(path, refused, methods=["POST"])
    app.add_exception_handler(RequestValidationError, validation_error)


register_routes()


def default_workers(model_yaml: dict, config: DLRMConfig) -> int:
    """The CPU rule (dlrmkit.cpus.model_workers) for the CPUs this process may use: the model
    config's maxWorkers when it pins them, else one process per handler.torch_threads CPUs when
    those are set, else one per CPU."""
    return model_workers(model_yaml.get("maxWorkers"), available_cpus(), config.threads.torch_threads)


def say_how() -> None:
    """The kit's own lines (DLRM loaded ..., rejected request ...) beside kserve's, which configures
    only its own; in the server and in each REST process. ``force``: an import has already given
    the root logger a handler at WARNING, which would drop them."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[model_server.parser],  # kserve's own flags (--enable_latency_logging, --log_config_file, ...)
    )
    ap.add_argument("--model-path", required=True, help="a .mar or a model directory (scripts/build_mar.py)")
    ap.add_argument("--http-port", dest="http_port", type=int, default=8080, help="REST port (default: %(default)s)")
    ap.add_argument("--grpc-port", dest="grpc_port", type=int, default=8081, help="gRPC port (default: %(default)s)")
    ap.add_argument(
        "--request-log",
        action="store_true",
        help="a line per request (uvicorn's access line, kserve's wall and CPU timings); off by default: "
        "they cost about a fifth of single-row throughput",
    )
    # --workers is kserve's own flag (REST processes); unset, it follows the CPU rule (default_workers)
    ap.set_defaults(workers=None)
    args = ap.parse_args(argv)
    if args.workers is not None and args.workers < 1:
        sys.exit(f"error: --workers {args.workers}: give 1 or more REST processes (unset: one per CPU)")
    say_how()
    door = DLRMDoor(args.model_path)
    door.workers = args.workers or default_workers(door.model_yaml, door.config)
    door.request_log = REQUEST_LOG["on"] = args.request_log
    door.load()  # kserve registers only models that are ready; with --workers N, gRPC's model
    logger.info("serving %s with %d REST process(es)", door.name, door.workers)
    rest_processes.RESTServerProcess = PatientProcess  # type: ignore[misc]  # kserve makes them by this name
    DoorServer(
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        workers=door.workers,
        registered_models=PinnedRepository(),
        enable_grpc=args.enable_grpc,
    ).start([door])


if __name__ == "__main__":
    main()
