"""TorchServe handler for torchrec DLRM models.

Thin wiring over the TorchServe-free core (``dlrm_core``): parse each request, collate the
whole TorchServe batch into one dense tensor and one KeyedJaggedTensor, run one forward pass,
and answer every request on its own: a bad request gets its own 4xx and JSON error body while
the good requests of the same batch get their scores. TorchServe imports this file and wants
exactly one class in it.
"""

from __future__ import annotations

import logging
import os
import time
from abc import ABC

import torch
from ts.torch_handler.base_handler import BaseHandler
from ts.utils.util import PredictionException

from dlrm_config import DLRMConfig
from dlrm_core import RequestParser, collate, error_body, response_body, scores
from dlrm_errors import BadRequest, ConfigError, RequestError
from dlrm_factory import DLRMFactory
from dlrm_scale import worker_devices

logger = logging.getLogger(__name__)

JSON = "application/json"


class TorchRecDLRMHandler(BaseHandler, ABC):
    """Scores DLRM requests; see README.md for the request and response formats."""

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
        started = time.perf_counter()
        self.model = DLRMFactory(self.config).load(os.path.join(model_dir, serialized), devices)
        self.parser = RequestParser(self.config)
        self.initialized = True
        logger.info(
            "DLRM loaded on %s in %.1f s: %d dense, %d sparse features, %d embedding rows (%s), output %s",
            ", ".join(map(str, devices)) + (" (tables sharded)" if len(devices) > 1 else ""),
            time.perf_counter() - started, self.config.num_dense_features, self.config.num_features,
            sum(self.config.num_embeddings), self.config.embedding_dtype, self.config.output,
        )

    def handle(self, data, context):
        """One TorchServe batch in, exactly one response per request out, in order."""
        started = time.perf_counter()
        self.context = context
        out = self.postprocess(self.inference(self.preprocess(data)))
        context.metrics.add_time("HandlerTime", round((time.perf_counter() - started) * 1000, 2), None, "ms")
        return out

    def preprocess(self, data):
        """Requests -> (Batch or None, {request index: RequestError}, number of requests)."""
        parsed, index, errors = [], [], {}
        for i, row in enumerate(data):
            try:
                parsed.append(self.parser.parse(_body(row, self.context, i)))
                index.append(i)
            except RequestError as e:
                errors[i] = e
        batch = None
        if parsed:
            batch, bad = collate(parsed, self.config, self.device)
            errors.update({index[j]: e for j, e in bad.items()})
            index = [i for j, i in enumerate(index) if j not in bad]
        return batch, index, errors, len(data)

    def inference(self, data, *args, **kwargs):
        """One forward pass for every good row of the batch, under inference_mode."""
        batch, index, errors, n = data
        if batch is None:
            return {}, errors, n
        try:
            per_request = scores(self.model, batch, self.config)
        except Exception as e:  # the server's fault, not a request's: fail this batch only
            rows = batch.dense.shape[0]
            if isinstance(e, MemoryError) or "out of memory" in str(e).lower():
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
                logger.error("out of memory scoring a batch of %d rows: %s", rows, e)
                raise PredictionException(f"Out of memory scoring a batch of {rows} rows", 507) from None
            logger.exception("forward pass failed for a batch of %d rows", rows)
            raise PredictionException(f"Internal error scoring a batch: {type(e).__name__}", 500) from None
        return dict(zip(index, per_request)), errors, n

    def postprocess(self, data):
        """One JSON body per request; a bad request gets its own status and an error body."""
        results, errors, n = data
        out = []
        ctx = self.context
        for i in range(n):
            ctx.set_response_content_type(i, JSON)
            if i in results:
                out.append(response_body(results[i]))
                continue
            err = errors[i]
            ctx.set_response_status(err.status, err.phrase, i)
            # Never log headers: they carry the client's token.
            logger.info("rejected request %s (%d): %s", _request_id(ctx, i), err.status, err.message)
            out.append(error_body(err))
        return out


def _body(row: dict, ctx, idx: int):
    """The request body from TorchServe's row. A form post (curl -d without a Content-Type)
    arrives split into form fields, or as nothing at all: never a DLRM request."""
    for key in ("body", "data"):
        if row.get(key) is not None:
            return row[key]
    try:
        content_type = (ctx.get_request_header(idx, "Content-Type")
                        or ctx.get_request_header(idx, "content-type") or "").lower()
    except Exception:  # header lookups differ across TorchServe versions and fakes
        content_type = ""
    if row or content_type.startswith(("application/x-www-form-urlencoded", "multipart/form-data")):
        raise BadRequest(
            "body: expected JSON with Content-Type: application/json, got a form post "
            "(add -H 'Content-Type: application/json' to curl)"
        )
    return None


def _request_id(ctx, idx):
    ids = getattr(ctx, "request_ids", None) or {}
    return ids.get(idx, f"#{idx}")
