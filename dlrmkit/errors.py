"""The kit's error vocabulary. Each request error carries its HTTP status.

TorchServe-free: the core raises these, the handler turns a ``RequestError`` into a per-request
status (``context.set_response_status``) and a JSON body, so one bad request never fails the
other requests of its TorchServe batch.
"""

from __future__ import annotations


class RequestError(Exception):
    """A problem with one request; only that request fails. Subclasses set the status."""

    status = 400
    phrase = "Bad Request"  # HTTP reason phrase: short ASCII (TorchServe 0.12 frames it by chars)

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def body(self) -> dict:
        """The JSON error body, shaped like TorchServe's own error bodies."""
        return {"code": self.status, "type": type(self).__name__, "message": self.message}

    def oip_body(self) -> dict:
        """The error body of KServe's v1 and v2 (Open Inference Protocol) REST APIs."""
        return {"error": self.message}


class BadRequest(RequestError):
    """400: the body is not a well-formed DLRM request (bad JSON, wrong type, wrong count, bad id)."""


class PayloadTooLarge(RequestError):
    """413: more instances or ids than the configured per-request maximum."""

    status = 413
    phrase = "Payload Too Large"


class ConfigError(ValueError):
    """The model config or archive is wrong; raised at build or load time, never per request.

    The message names the key and shows a valid value, e.g.
    ``handler.embedding_dim: expected a positive integer, got 0 (e.g. embedding_dim: 8)``.
    """


class InternalError(RuntimeError):
    """A step of the kit broke its own rule (a source read out of order, a kernel laid out other
    than planned, sharded tables that did not take their weights): a bug to report with the
    message, never a config to change."""


class DeltaError(Exception):
    """A live-update delta refused (dlrmkit.live); never a request's error: the model stays as it
    was and the worker waits for a valid delta of that sequence.

    ``reason`` is the ``Reason`` dimension of ``dlrm_deltas_refused_total``: format, model, base,
    sequence, table, shape, dtype, range, duplicate, nonfinite, corrupt, checksum or dense; the
    message says what is wrong, e.g. ``feature_0.ids: id 20 is out of range [0, 20)``.
    """

    reason: str  # a refusal's status, one of the reasons above

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message


class ServerError(RuntimeError):
    """500: a forward pass failed: the server's fault, not a request's. Every request of the
    failed call fails with ``status``; the worker serves the next call as before."""

    status = 500

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class Busy(ServerError):
    """503: the server's queue of requests waiting to be scored is full; the client may retry."""

    status = 503


class OutOfMemory(ServerError):
    """507: the forward ran out of memory (host or GPU)."""

    status = 507
