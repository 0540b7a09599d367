"""KServe v1 and Open Inference Protocol (v2) requests and answers; TorchServe-free.

TorchServe 0.12 routes ``POST /v1/models/<m>:predict`` and ``POST /v2/models/<m>/infer`` to the
handler like ``/predictions/<m>``. Its own KServe envelopes decode only the first request of a
batch, so the kit speaks the protocols itself, per request: ``open_request`` picks the protocol,
the protocol's ``parse`` gives a ``dlrmkit.request.ParsedRequest`` (so requests of every protocol share
one collate and one forward pass), and its ``answer`` / ``error`` give that request's reply.

    Predictions  /predictions/<m> and gRPC Predictions: dlrmkit.forms's JSON forms, unchanged
    KServeV1     {"instances": [<instance>, ...]}  ->  {"predictions": [s_1, ...]}
    OIPv2        {"inputs": [{"name": "dense", "datatype": "FP32", "shape": [2, 5], "data": [...]},
                             {"name": "feature_0.lengths", "datatype": "INT64", "shape": [2], "data": [2, 1]},
                             {"name": "feature_0.values", "datatype": "INT64", "shape": [3], "data": [3, 4, 5]},
                             {"name": "feature_1", "datatype": "INT64", "shape": [2], "data": [7, 0]}]}
                 ->  {"model_name": "dlrm", "model_version": "1.0", "outputs": [{"name": "scores",
                      "datatype": "FP32", "shape": [2, 1], "data": [s_1, s_2]}]}

A sparse feature ``f`` is either ``f`` ([B], one id per row) or the pair ``f.lengths`` ([B]) +
``f.values`` ([sum(lengths)]); a feature left out is an empty bag. v2 inputs may also come in
the binary tensor data extension (header ``Inference-Header-Content-Length: n``: n bytes of JSON,
then each input's raw little-endian bytes, sized by its ``parameters.binary_data_size``); the
answer is binary when the request asks for it (``binary_data_output`` or an output's
``binary_data``). KServe routes answer errors as ``{"error": "<message naming the input>"}``.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from dlrmkit import criteo
from dlrmkit.forms import RequestParser, error_body, response_body
from dlrmkit.request import ParsedRequest
from dlrmkit.errors import BadRequest, PayloadTooLarge, RequestError

JSON = "application/json"
BINARY = "application/octet-stream"
BINARY_HEADER = "Inference-Header-Content-Length"
OUTPUT = "scores"
_DTYPES = {"FP32": np.float32, "FP64": np.float64, "INT32": np.int32, "INT64": np.int64}
_FLOATS, _INTS = ("FP32", "FP64"), ("INT64", "INT32")


@dataclass
class Reply:
    """One request's answer: body, Content-Type, extra response header fields."""

    body: bytes
    content_type: str = JSON
    header_fields: dict = field(default_factory=dict)


class Predictions:
    """TorchServe's own API (``/predictions/<m>``, gRPC Predictions): dlrmkit.forms's JSON forms."""

    def __init__(self, body: Any, parser: RequestParser):
        self.body, self.parser = body, parser

    def parse(self) -> ParsedRequest:
        return self.parser.parse(self.body)

    def answer(self, row_scores: list[float]) -> Reply:
        return Reply(response_body(row_scores))

    def error(self, err: RequestError) -> Reply:
        return Reply(error_body(err))


class CriteoLines(Predictions):
    """``Content-Type: text/tab-separated-values`` on /predictions with ``handler.raw_input:
    criteo_tsv``: one Criteo log line per row, transformed as in training (dlrmkit.criteo), answered
    as ``{"scores": [...]}`` like the JSON forms. ``clipped``: the dense values the parse clipped
    to the training minimum (a metric)."""

    clipped = 0

    def parse(self) -> ParsedRequest:
        c = self.parser.config
        if c.raw.raw_input != "criteo_tsv":
            raise BadRequest(
                f"Content-Type: {criteo.CONTENT_TYPE} is Criteo log lines, which this model "
                "does not take (handler.raw_input is not set); send JSON with Content-Type: "
                "application/json"
            )
        raw = criteo.to_bytes(self.body)
        n = criteo.count_lines(raw)
        if n > c.requests.max_instances_per_request:
            raise PayloadTooLarge(
                f"body: at most {c.requests.max_instances_per_request} lines per request "
                f"(handler.max_instances_per_request), got {n}"
            )
        if n * c.num_features > c.requests.max_ids_per_request:
            raise PayloadTooLarge(
                f"body: at most {c.requests.max_ids_per_request} ids per request "
                f"(handler.max_ids_per_request: {c.num_features} per line), got {n * c.num_features}"
            )
        lines = criteo.parse(raw, c.sparse_features)
        dense, self.clipped = criteo.dense_features(lines.dense, c.raw.dense_shift)
        return ParsedRequest.single_hot_matrix(
            dense, range(c.num_features), np.ascontiguousarray(lines.ids.T), c.sparse_features
        )


class KServeV1(Predictions):
    """KServe v1: ``{"instances": [...]}`` -> ``{"predictions": [...]}``; errors ``{"error": ...}``."""

    def parse(self) -> ParsedRequest:
        if self.body is not None and not _has(self.body, "instances"):
            raise BadRequest('instances: required field is missing (KServe v1: {"instances": [...]})')
        return self.parser.parse(self.body)

    def answer(self, row_scores: list[float]) -> Reply:
        return Reply(msgspec.json.encode({"predictions": row_scores}))

    def error(self, err: RequestError) -> Reply:
        return Reply(msgspec.json.encode(err.oip_body()))


# --- Open Inference Protocol v2 -------------------------------------------------------------


class _Tensor(msgspec.Struct):
    name: str
    datatype: str
    shape: list[int]
    parameters: dict | None = None
    data: msgspec.Raw = msgspec.Raw(b"")  # kept as JSON text until the datatype is checked


class _Output(msgspec.Struct):
    name: str
    parameters: dict | None = None


class _InferRequest(msgspec.Struct):
    inputs: list[_Tensor]
    id: str | None = None
    parameters: dict | None = None
    outputs: list[_Output] | None = None


class _Envelope(msgspec.Struct):
    """Just enough of a body to tell v1 from v2; values are skipped, not built."""

    inputs: msgspec.Raw = msgspec.Raw(b"")  # b"" when the field is absent
    instances: msgspec.Raw = msgspec.Raw(b"")


_ENVELOPE = msgspec.json.Decoder(_Envelope)
_INFER = msgspec.json.Decoder(_InferRequest)


class OIPv2(KServeV1):
    """Open Inference Protocol v2 over REST, JSON or binary tensor data."""

    def __init__(self, body: Any, parser: RequestParser, json_length: int | None, model: tuple[str, str]):
        super().__init__(body, parser)
        self.json_length, self.model = json_length, model
        self.id: str | None = None
        self.binary_output = False

    def parse(self) -> ParsedRequest:
        req, raw = self._decode()
        self.id = req.id
        self.binary_output = _flag(req.parameters, "binary_data_output")
        for out in req.outputs or []:
            if out.name != OUTPUT:
                raise BadRequest(f"outputs: unknown output {out.name!r}; this model has one output, {OUTPUT!r}")
            self.binary_output = _flag(out.parameters, "binary_data")
        return _columns(req, raw, self.parser)

    def answer(self, row_scores: list[float]) -> Reply:
        out = {"name": OUTPUT, "datatype": "FP32", "shape": [len(row_scores), 1]}
        head = {"model_name": self.model[0], "model_version": self.model[1]}
        if self.id is not None:
            head["id"] = self.id
        if not self.binary_output:
            return Reply(msgspec.json.encode({**head, "outputs": [{**out, "data": row_scores}]}))
        raw = np.asarray(row_scores, dtype="<f4").tobytes()
        header = msgspec.json.encode({**head, "outputs": [{**out, "parameters": {"binary_data_size": len(raw)}}]})
        return Reply(header + raw, BINARY, {BINARY_HEADER: str(len(header))})

    def _decode(self) -> tuple[_InferRequest, memoryview]:
        """The JSON header as an _InferRequest and the binary tail (empty without the extension)."""
        body = self.body
        if isinstance(body, dict):
            # TorchServe decoded it (decode_input_request=true, its default): encoded again, as
            # _Tensor keeps each input's data as raw JSON until its datatype is checked (a dict
            # converted straight to _InferRequest refused every request; found by fuzzing).
            body = msgspec.json.encode(body)
        raw = memoryview(body if isinstance(body, (bytes, bytearray)) else str(body).encode())
        n = len(raw) if self.json_length is None else self.json_length
        if n > len(raw):
            raise BadRequest(f"{BINARY_HEADER}: {n} is past the end of the {len(raw)}-byte body")
        try:
            return _INFER.decode(raw[:n]), raw[n:]
        except msgspec.ValidationError as e:
            raise BadRequest(_v2_message(str(e))) from None
        except msgspec.MsgspecError as e:
            name = _non_finite_input(bytes(raw[:n]))
            if name:
                raise BadRequest(
                    f"{name}: data: NaN and Infinity are not numbers in JSON; send finite numbers"
                ) from None
            raise BadRequest(f"body: expected an inference request in JSON, got malformed JSON ({e})") from None


# What clients' encoders write for non-finite floats (Python's json: NaN, Infinity, -Infinity).
_NON_FINITE = re.compile(rb'(?<![\w"])-?(?:NaN|nan|Infinity|inf)(?![\w"])')


def _non_finite_input(header: bytes) -> str | None:
    """The input whose data holds a NaN/Infinity literal that made the JSON malformed, if any."""
    try:
        req = _INFER.decode(_NON_FINITE.sub(b"null", header))
    except msgspec.MsgspecError:
        return None
    return next((t.name for t in req.inputs if b"null" in bytes(t.data)), None)


def _flag(params: dict | None, name: str) -> bool:
    return bool(params) and params.get(name) is True


def _v2_message(msgspec_error: str) -> str:
    text, _, at = msgspec_error.partition(" - at `$")
    where = at.rstrip("`").lstrip(".") or "body"
    if text.startswith("Object missing required field"):
        return f"{where + '.' if where != 'body' else ''}{text.split('`')[1]}: required field is missing"
    return f"{where}: {text[:1].lower()}{text[1:]}"


def _columns(req: _InferRequest, tail: memoryview, parser: RequestParser) -> ParsedRequest:
    """The v2 inputs -> ParsedRequest.columnar; every message names the input."""
    config = parser.config
    if len(tail):
        fast = _binary_single_hot(req, tail, parser)
        if fast is not None:
            return fast
    arrays: dict[str, np.ndarray] = {}
    offset = 0
    for i, t in enumerate(req.inputs):
        if not t.name:  # every message below starts with the input's name (found by fuzzing)
            raise BadRequest(f'inputs[{i}].name: expected the name of an input, got ""')
        if t.name in arrays:
            raise BadRequest(f"{t.name}: input appears more than once")
        arrays[t.name], offset = _tensor(t, tail, offset)
    if offset != len(tail):
        raise BadRequest(
            f"{BINARY_HEADER}: {len(tail) - offset} bytes after the JSON header belong to no input "
            f"(each binary input gives its parameters.binary_data_size)"
        )

    dense = arrays.pop("dense", None)
    if dense is None:
        raise BadRequest(f"dense: required input is missing (FP32 [B, {config.num_dense_features}])")
    if dense.dtype.kind != "f" or dense.ndim != 2 or dense.shape[1] != config.num_dense_features:
        raise BadRequest(
            f"dense: expected FP32 shape [B, {config.num_dense_features}], got {_name(dense.dtype)} {list(dense.shape)}"
        )
    n = dense.shape[0]
    if n < 1:
        raise BadRequest("dense: expected at least one row, got shape [0, ...]")
    if n > config.requests.max_instances_per_request:
        raise PayloadTooLarge(
            f"dense: at most {config.requests.max_instances_per_request} rows per request "
            f"(handler.max_instances_per_request), got {n}"
        )
    dense = dense.astype(np.float32)  # FP64 past float32's range becomes inf: refused below
    if not np.isfinite(dense).all():
        bad = np.flatnonzero(~np.isfinite(dense.reshape(-1)))[0]
        raise BadRequest(
            f"dense: expected finite FP32 numbers, got {dense.reshape(-1)[bad]} at "
            f"[{bad // dense.shape[1]}, {bad % dense.shape[1]}]"
        )

    index = parser.feature_index
    bags, ones, fields = {}, {}, {}  # ones: features sent as one id per row
    for name in list(arrays):
        base, dot, part = name.rpartition(".")
        feature = base if dot and part in ("lengths", "values") else name
        if feature not in index:
            raise BadRequest(
                f"{name}: unknown input; expected dense and, per sparse feature f of "
                f"{', '.join(config.sparse_features[:6])}{', ...' if config.num_features > 6 else ''}: "
                "f (one id per row) or f.lengths + f.values"
            )
        f = index[feature]
        if f in fields:
            continue
        one, lengths, values = (arrays.get(feature), arrays.get(feature + ".lengths"), arrays.get(feature + ".values"))
        for got, what in ((one, feature), (lengths, feature + ".lengths"), (values, feature + ".values")):
            if got is not None and got.dtype.kind != "i":
                raise BadRequest(f"{what}: expected INT64 or INT32 ids, got {_name(got.dtype)}")
        if one is not None:
            if lengths is not None or values is not None:
                raise BadRequest(f"{feature}: send either {feature} or {feature}.lengths + {feature}.values, not both")
            if one.shape not in ((n,), (n, 1)):
                raise BadRequest(f"{feature}: expected shape [{n}] (one id per row), got {list(one.shape)}")
            ones[f] = one.reshape(-1)
            fields[f] = (feature, feature)
        else:
            if lengths is None or values is None:
                missing = feature + (".values" if values is None else ".lengths")
                raise BadRequest(
                    f"{missing}: required input is missing (it goes with "
                    f"{feature}{'.lengths' if values is None else '.values'})"
                )
            if values.ndim != 1:
                raise BadRequest(f"{feature}.values: expected shape [sum({feature}.lengths)], got {list(values.shape)}")
            bags[f] = (
                (lengths.reshape(-1) if lengths.shape == (n, 1) else lengths).astype(np.int64, copy=False),
                values.astype(np.int64, copy=False),
            )
            fields[f] = (feature + ".lengths", feature + ".values")
    n_ids = sum(v.size for _, v in bags.values()) + n * len(ones)
    if n_ids > config.requests.max_ids_per_request:
        raise PayloadTooLarge(
            f"inputs: at most {config.requests.max_ids_per_request} ids per request "
            f"(handler.max_ids_per_request), got {n_ids}"
        )
    if not bags:  # the usual single-hot request: checked and laid out in a few array operations
        return ParsedRequest.single_hot(dense, ones, {f: names[1] for f, names in fields.items()})
    bags.update({f: (np.ones(n, dtype=np.int64), ids.astype(np.int64, copy=False)) for f, ids in ones.items()})
    return ParsedRequest.columnar(dense, bags, fields)


def _binary_single_hot(req: _InferRequest, tail: memoryview, parser: RequestParser) -> ParsedRequest | None:
    """The usual binary request (tritonclient's), read in a few array operations: FP32 dense
    ``[n, F_dense]`` and, per feature sent, an INT64 input of shape ``[n]`` or ``[n, 1]`` (one id
    per row), the id inputs back to back in the tail. Reading input by input costs ~5 numpy
    calls each (over 100 for Criteo's 26 features), and right after a forward each call costs
    ~10-20 µs. None when the request is anything else or anything in it is wrong: the general
    path then reads it or names what is wrong."""
    config, index = parser.config, parser.feature_index
    F = config.num_dense_features
    spans, offset = [], 0  # (input, where its data starts in the tail, its size)
    for t in req.inputs:
        size = t.parameters.get("binary_data_size") if t.parameters else None
        if type(size) is not int or len(t.data):
            return None
        spans.append((t, offset, size))
        offset += size
    dense_spans = [s for s in spans if s[0].name == "dense"]
    if offset != len(tail) or len(dense_spans) != 1:
        return None
    t, dense_at, size = dense_spans[0]
    n = t.shape[0] if t.datatype == "FP32" and len(t.shape) == 2 and t.shape[1] == F else 0
    if not 1 <= n <= config.requests.max_instances_per_request or size != 4 * n * F:
        return None
    id_spans = [s for s in spans if s[0].name != "dense"]
    ids_at = id_spans[0][1] if id_spans else 0
    features, names = [], []
    for j, (t, at, size) in enumerate(id_spans):
        f = index.get(t.name)
        if (
            f is None
            or f in features
            or t.datatype != "INT64"
            or t.shape not in ([n], [n, 1])
            or size != 8 * n
            or at != ids_at + 8 * n * j
        ):  # the id inputs back to back
            return None
        features.append(f)
        names.append(t.name)
    k = len(features)
    if n * k > config.requests.max_ids_per_request:
        return None
    dense = np.frombuffer(tail, "<f4", n * F, dense_at).astype(np.float32)  # a copy: torch wants it writable
    if not np.isfinite(dense).all():
        return None
    ids = np.frombuffer(tail, "<i8", n * k, ids_at).astype(np.int64).reshape(k, n)
    return ParsedRequest.single_hot_matrix(dense.reshape(n, F), features, ids, names)


def _tensor(t: _Tensor, tail: memoryview, offset: int) -> tuple[np.ndarray, int]:
    """One input as an array of its shape; ``offset`` walks the binary tail."""
    dtype = _DTYPES.get(t.datatype)
    if dtype is None:
        raise BadRequest(
            f"{t.name}: datatype {t.datatype!r} is not accepted here; expected "
            f"{' or '.join(_FLOATS)} for dense, {' or '.join(_INTS)} for ids"
        )
    if any(d < 0 for d in t.shape):
        raise BadRequest(f"{t.name}: shape {t.shape} has a negative dimension")
    count = math.prod(t.shape)
    size = (t.parameters or {}).get("binary_data_size")
    if size is not None:
        if len(t.data):
            raise BadRequest(f"{t.name}: give either data or parameters.binary_data_size, not both")
        itemsize = np.dtype(dtype).itemsize
        if not isinstance(size, int) or isinstance(size, bool) or size != count * itemsize:
            raise BadRequest(
                f"{t.name}: parameters.binary_data_size: expected {count * itemsize} "
                f"({count} x {t.datatype} of shape {t.shape}), got {size!r}"
            )
        if offset + size > len(tail):
            raise BadRequest(f"{t.name}: the body ends {offset + size - len(tail)} bytes short of its binary data")
        arr = np.frombuffer(tail[offset : offset + size], dtype=np.dtype(dtype).newbyteorder("<"))
        return arr.astype(dtype).reshape(t.shape), offset + size
    if not len(t.data):
        raise BadRequest(f"{t.name}: data: required field is missing (or parameters.binary_data_size)")
    try:
        flat = np.array(msgspec.json.decode(t.data), dtype=object).reshape(-1)
    except (msgspec.MsgspecError, ValueError) as e:
        raise BadRequest(f"{t.name}: data: expected a (nested) array of numbers ({e})") from None
    if flat.size != count:
        raise BadRequest(f"{t.name}: data: expected {count} numbers for shape {t.shape}, got {flat.size}")
    want = int if t.datatype in _INTS else (int, float)
    bad = [v for v in flat if not isinstance(v, want) or isinstance(v, bool)][:1]
    if bad:
        raise BadRequest(f"{t.name}: data: expected {t.datatype} numbers, got {json.dumps(bad[0])[:64]}")
    try:
        return np.array(flat.tolist(), dtype=dtype).reshape(t.shape), offset
    except OverflowError:
        raise BadRequest(f"{t.name}: data: a number does not fit {t.datatype}") from None


def _name(dtype: np.dtype) -> str:
    return {v: k for k, v in _DTYPES.items()}.get(dtype.type, str(dtype))


# --- choosing the protocol ------------------------------------------------------------------


def open_request(
    body: Any,
    kserve_route: bool,
    json_length: str | None,
    parser: RequestParser,
    model: tuple[str, str],
    content_type: str | None = None,
) -> Predictions:
    """The protocol object of one request. ``kserve_route``: it came on /v1 or /v2 rather than
    /predictions or gRPC; ``json_length``: its Inference-Header-Content-Length, if any;
    ``content_type``: its Content-Type (text/tab-separated-values: Criteo lines).
    On a KServe route, a binary header or an ``inputs`` field means v2, anything else v1."""
    if not kserve_route:
        if content_type and content_type.split(";")[0].strip().lower() == criteo.CONTENT_TYPE:
            return CriteoLines(body, parser)
        return Predictions(body, parser)
    if json_length is not None:
        n = _byte_count(json_length)
        if n < 0:
            return _Refused(
                body,
                parser,
                BadRequest(f"{BINARY_HEADER}: expected the JSON header's length in bytes, got {json_length[:32]!r}"),
            )
        return OIPv2(body, parser, n, model)
    is_v2 = body is not None and _has(body, "inputs")
    return OIPv2(body, parser, None, model) if is_v2 else KServeV1(body, parser)


def _byte_count(text: str) -> int:
    """A header's count of bytes as ``int`` reads it, or -1 when it is none."""
    try:
        return int(text)
    except ValueError:
        return -1


def _has(body: Any, name: str) -> bool:
    """Whether a JSON body has a top-level field; False when it is not a JSON object at all."""
    if isinstance(body, dict):
        return name in body
    try:
        return len(getattr(_ENVELOPE.decode(bytes(body) if not isinstance(body, str) else body.encode()), name)) > 0
    except msgspec.MsgspecError:
        return True  # malformed: let the parser say what is wrong


class _Refused(KServeV1):
    """A KServe request refused before its body is read."""

    def __init__(self, body: Any, parser: RequestParser, err: RequestError):
        super().__init__(body, parser)
        self.err = err

    def parse(self) -> ParsedRequest:
        raise self.err


# --- what the v2 metadata says ------------------------------------------------------------

METADATA_FILE = "oip-metadata.json"  # in the archive; the OIP endpoint plugin serves it


def model_metadata(config) -> dict:
    """The v2 model metadata's inputs and outputs, and the rows one request may carry
    (Triton's max_batch_size), for the plugin's GET /v2/models/{m}[/config]. Per sparse feature
    it lists ``f`` (INT64 [-1], one id per row), the form a client can build from the metadata
    alone; ``f.lengths`` + ``f.values`` (multi-hot) are accepted in its place (_columns)."""
    return {
        "inputs": [{"name": "dense", "datatype": "FP32", "shape": [-1, config.num_dense_features]}]
        + [{"name": f, "datatype": "INT64", "shape": [-1]} for f in config.sparse_features],
        "outputs": [{"name": OUTPUT, "datatype": "FP32", "shape": [-1, 1]}],
        "max_batch_size": config.requests.max_instances_per_request,
    }
