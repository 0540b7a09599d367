"""The TorchServe-free core: parse a request, collate a batch, score it, build the responses.

    parse_request(body) -> ParsedRequest          one request, validated; raises RequestError
    collate(requests)   -> Batch, {idx: error}    every row of every request: one dense tensor
                                                  [B, F_dense] and one KeyedJaggedTensor
    scores(model, batch) -> list of score lists   one list per request, in order
    response_body(scores) / error_body(error)     JSON bytes

Request forms (a body may hold one instance, or several under ``instances``)::

    {"dense": [0.1, 0.2], "sparse": {"keys": ["f1", "f0"], "values": [7, 3, 4], "lengths": [1, 2]}}
    {"instances": [<instance>, <instance>, ...]}
    {"context": {"dense": [...], "sparse": {...}}, "candidates": [{"sparse": {...}}, ...]}
                                                       # one row per candidate: context + its own
    {"columns": {"dense": [[...], ...], "sparse": {"f0": {"values": [...], "lengths": [...]}}}}
                                                       # rows feature by feature (+ a context)
    {"float_features": [...], "id_list_features.lengths": [<one per feature, model order>],
     "id_list_features.values": [...]}                 # the pytorch/serve torchrec_dlrm format

A key that an instance omits is an empty bag. The batch's KJT is key-major: with features
(f0, f1) and rows b0 = the instance above, b1 = {"f0": [5]}, lengths are [2, 1 | 1, 0] and
values [3, 4, 5 | 7].
"""

from __future__ import annotations

import bisect
import functools
import itertools
import json
import math
import operator
import re
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Mapping, Sequence

import msgspec
import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dlrm_config import INT64_MAX, DLRMConfig
from dlrm_errors import BadRequest, PayloadTooLarge, RequestError

FLOAT32_MAX = 3.4028234663852886e38
MAX_KEY_CHARS = 256

# The request schema, decoded by msgspec straight from bytes. msgspec's strict mode already
# refuses booleans for numbers, fractional ids and lengths, NaN/Infinity literals, and non-UTF-8;
# the bounds below make it refuse negative lengths/ids, ids past int64 and floats past float32.
_Float32 = Annotated[float, msgspec.Meta(ge=-FLOAT32_MAX, le=FLOAT32_MAX)]
_Count = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]
_Key = Annotated[str, msgspec.Meta(max_length=MAX_KEY_CHARS)]


def _schema(Float: Any, Count: Any, Keys: Any, Bags: Any, Lengths: Any = None) -> type:
    """The request type: a row's fields, plus ``instances``, ``context`` + ``candidates``, or
    ``columns`` (with or without ``context``)."""
    def struct(name, fields, bases=()):
        return msgspec.defstruct(name, fields, bases=bases, forbid_unknown_fields=True)

    sparse = struct("Sparse", [("keys", Keys), ("values", list[Count]), ("lengths", Lengths or list[Count])])
    columns = struct("Columns", [("dense", list[list[Float]] | None, None), ("sparse", Bags | None, None)])
    instance = struct("Instance", [
        ("dense", list[Float] | None, None),
        ("sparse", sparse | None, None),
        ("float_features", list[Float] | None, None),
        ("id_list_lengths", list[Count] | None, msgspec.field(default=None, name="id_list_features.lengths")),
        ("id_list_values", list[Count] | None, msgspec.field(default=None, name="id_list_features.values")),
    ])
    return struct("Request", [("instances", list[instance] | None, None), ("context", instance | None, None),
                              ("candidates", list[instance] | None, None), ("columns", columns | None, None)],
                  bases=(instance,))


def _bag(Count: Any) -> type:
    """One feature's column: ``lengths`` (one per row; left out: one id per row) and ``values``."""
    return msgspec.defstruct("Bag", [("values", list[Count]), ("lengths", list[Count] | None, None)],
                             forbid_unknown_fields=True)


_Bag = _bag(_Count)
_Request = _schema(_Float32, _Count, list[_Key], dict[_Key, _Bag])
_DECODER = msgspec.json.Decoder(_Request)
# The hot path's schema: the same fields without the bounds (the parser checks ranges on the
# decoded arrays) and with each key list and lengths list kept as raw JSON (a key list is
# decoded and validated once per distinct list; rows whose lengths are byte-for-byte alike,
# as single-hot rows are, decode one of them): ~35% less decoding for a 128-row request. A
# request that any check refuses is parsed again with the strict schema, so every message is
# the strict one.
_FAST_DECODER = msgspec.json.Decoder(_schema(float, int, msgspec.Raw, dict[str, _bag(int)], msgspec.Raw))
_COUNTS = msgspec.json.Decoder(list[int])
_FAST_MIN_BYTES = 4096
_KEY_LIST = msgspec.json.Decoder(list[_Key])
_DENSE, _SPARSE = operator.attrgetter("dense"), operator.attrgetter("sparse")
_KEYS, _VALUES, _LENGTHS = (operator.attrgetter(a) for a in ("keys", "values", "lengths"))
_ROW_FORM = operator.attrgetter("float_features", "id_list_lengths", "id_list_values")
_ID_VALUES = operator.attrgetter("id_list_values")


def _counts(lengths: list[int] | msgspec.Raw) -> list[int]:
    """A lengths list; from the fast schema, its raw JSON decoded (bounds: _check_ranges)."""
    return _COUNTS.decode(lengths) if isinstance(lengths, msgspec.Raw) else lengths


class _Recheck(BadRequest):
    """A value the fast schema let through (e.g. a negative id): parse with the strict one."""


@dataclass(slots=True)
class ParsedRequest:
    """One validated request of n rows, laid out for collation.

    ``values`` holds its ids; segment s (one bag: one feature of one row) covers the next
    ``seg_length[s]`` of them, for feature ``seg_feature[s]`` of row ``seg_row[s]``. Segments
    may come in any order (row by row from instances, feature by feature from columns): collate
    sorts them into the KJT's key-major order. E.g. rows b0 = {f1: [7], f0: [3, 4]}, b1 = {f0: [5]}:
    values [7, 3, 4, 5], seg_feature [1, 0, 0], seg_row [0, 0, 1], seg_length [1, 2, 1].
    The sequences are lists or numpy arrays.

    Single-hot rows (every feature sent has exactly one id in every row, as in Criteo) come as
    ``onehot`` = (the features sent, ascending; ids ``[k, n]``, row j of it for features[j]),
    from which collate builds the KJT directly; their segments are then left None until
    ``segments()`` derives them (key-major: feature by feature, row by row).
    """

    n: int
    dense: Sequence[float]  # n * F_dense floats, row-major
    values: Sequence[int] | None
    seg_feature: Sequence[int] | None
    seg_length: Sequence[int] | None
    seg_row: Sequence[int] | None
    # For error messages only: the position of an id in ``values`` -> the field that holds it,
    # e.g. "instances[1].sparse.values[0]".
    id_field: Callable[[int], str] = str
    onehot: tuple[tuple[int, ...], np.ndarray] | None = None

    def segments(self) -> "ParsedRequest":
        """Fill in the segments of a single-hot request that left them out; returns self."""
        if self.values is None:
            features, ids = self.onehot
            k, n = len(features), self.n
            self.values = ids.reshape(-1)
            self.seg_feature = np.repeat(np.array(features, dtype=np.int64), n)
            self.seg_length = np.ones(k * n, dtype=np.int64)
            self.seg_row = np.tile(np.arange(n, dtype=np.int64), k)
        return self

    @classmethod
    def single_hot(cls, dense: np.ndarray, ids: Mapping[int, np.ndarray], fields: Mapping[int, str]) -> "ParsedRequest":
        """n rows with one id per row of each feature sent: ``dense`` ``[n, F_dense]``,
        ``ids[f]`` ``[n]`` (any integer dtype), ``fields[f]`` its name for messages. Raises
        BadRequest naming a negative id, e.g. ``feature_1[3]: expected a non-negative integer``."""
        n, feats = int(dense.shape[0]), list(ids)
        matrix = (np.stack([ids[f] for f in feats]).astype(np.int64, copy=False) if feats
                  else np.zeros((0, n), dtype=np.int64))
        return cls.single_hot_matrix(dense, feats, matrix, [fields[f] for f in feats])

    @classmethod
    def single_hot_matrix(cls, dense: np.ndarray, features: Sequence[int], ids: np.ndarray,
                          names: Sequence[str]) -> "ParsedRequest":
        """single_hot's rows with the ids already in one int64 ``[k, n]`` array: row j holds
        the ids of features[j], named ``names[j]`` in messages (features in any order)."""
        n = int(dense.shape[0])
        if ids.size and int(ids.min()) < 0:
            j, row = divmod(int(np.argmax(ids.reshape(-1) < 0)), n)
            raise BadRequest(f"{names[j]}[{row}]: expected a non-negative integer, got {int(ids[j, row])}")
        return _hot_request(n, np.ascontiguousarray(dense, dtype=np.float32).reshape(-1),
                            [(features, ids, lambda j, row: f"{names[j]}[{row}]")])

    @classmethod
    def columnar(
        cls,
        dense: np.ndarray,
        bags: Mapping[int, tuple[np.ndarray, np.ndarray]],
        fields: Mapping[int, tuple[str, str]],
    ) -> "ParsedRequest":
        """n rows given feature by feature: ``dense`` float32 ``[n, F_dense]``; ``bags[f]`` =
        (lengths ``[n]``, values ``[sum(lengths)]``), int64, for each feature sent (a feature
        left out is an empty bag in every row); ``fields[f]`` = the request's names of that
        feature's (lengths, values), for messages. Raises BadRequest naming the field.

        E.g. f0 lengths [2, 1] values [3, 4, 5] and f1 lengths [1, 0] values [7] is the example
        of the class docstring.
        """
        n = int(dense.shape[0])
        feats = list(bags)
        single_hot = n > 0
        for f in feats:
            lengths, values = bags[f]
            lengths_field, values_field = fields[f]
            if lengths.shape != (n,):
                raise BadRequest(f"{lengths_field}: expected one length per row ({n}), got shape {list(lengths.shape)}")
            shortest = int(lengths.min()) if n else 0
            if shortest < 0:
                raise BadRequest(f"{lengths_field}[{int(np.argmax(lengths < 0))}]: expected a non-negative integer, "
                                 f"got {int(lengths[lengths < 0][0])}")
            total = int(lengths.sum())
            single_hot = single_hot and shortest == 1 and total == n  # then every length is 1
            if values.shape != (total,):
                raise BadRequest(f"{values_field}: expected sum({lengths_field}) = {total} ids, got shape "
                                 f"{list(values.shape)}")
            if total and int(values.min()) < 0:
                raise BadRequest(f"{values_field}[{int(np.argmax(values < 0))}]: expected a non-negative integer, "
                                 f"got {int(values[values < 0][0])}")
        if single_hot:
            return cls.single_hot(dense, {f: bags[f][1] for f in feats}, {f: fields[f][1] for f in feats})
        starts = list(itertools.accumulate((len(bags[f][1]) for f in feats), initial=0))

        def id_field(pos: int) -> str:
            k = bisect.bisect_right(starts, pos) - 1
            return f"{fields[feats[k]][1]}[{pos - starts[k]}]"

        empty = np.zeros(0, dtype=np.int64)
        return cls(
            n,
            np.ascontiguousarray(dense, dtype=np.float32).reshape(-1),
            np.concatenate([bags[f][1] for f in feats]).astype(np.int64, copy=False) if feats else empty,
            np.repeat(np.array(feats, dtype=np.int64), n),
            np.concatenate([bags[f][0] for f in feats]).astype(np.int64, copy=False) if feats else empty,
            np.tile(np.arange(n, dtype=np.int64), len(feats)),
            id_field,
        )


@dataclass(slots=True)
class _Context:
    """The features every row of a ranking or columns request shares, sent once."""

    dense: Sequence[float] | None = None
    features: Sequence[int] = ()
    values: Sequence[int] = ()
    lengths: Sequence[int] = ()

    def join(self, own: ParsedRequest) -> ParsedRequest:
        """``own``'s rows, each with the context's dense (when ``own`` has none) and sparse
        features added."""
        n, k = own.n, len(self.features)
        dense = own.dense if self.dense is None else self.dense_rows(n)
        if not k:
            return ParsedRequest(n, dense, own.values, own.seg_feature, own.seg_length, own.seg_row, own.id_field,
                                 own.onehot)
        if own.onehot is not None and self.single_hot():
            own_features, own_ids = own.onehot
            return _hot_request(n, dense, [(own_features, own_ids, lambda j, row: own.id_field(j * n + row)),
                                           self.part()])
        own.segments()
        n_ctx, n_own = len(self.values), len(own.values)

        def id_field(pos: int) -> str:
            if pos < n_own:
                return own.id_field(pos)
            return f"context.sparse.values[{(pos - n_own) % n_ctx}]"

        return ParsedRequest(
            n, dense,
            np.concatenate([np.asarray(own.values, dtype=np.int64), np.tile(np.asarray(self.values, dtype=np.int64), n)]),
            np.concatenate([np.asarray(own.seg_feature, dtype=np.int64), np.tile(np.array(self.features, dtype=np.int64), n)]),
            np.concatenate([np.asarray(own.seg_length, dtype=np.int64), np.tile(np.asarray(self.lengths, dtype=np.int64), n)]),
            np.concatenate([np.asarray(own.seg_row, dtype=np.int64), np.repeat(np.arange(n, dtype=np.int64), k)]),
            id_field,
        )

    def single_hot(self) -> bool:
        return all(x == 1 for x in self.lengths)

    def dense_rows(self, n: int) -> np.ndarray:
        """The context's dense, once per row, row-major."""
        return np.asarray(self.dense, dtype=np.float32)[None, :].repeat(n, axis=0).reshape(-1)

    def part(self) -> tuple:
        """The context as a part of _hot_request (single-hot: id j is key j's)."""
        return (self.features, np.asarray(self.values, dtype=np.int64),
                lambda j, row: f"context.sparse.values[{j}]")


def _hot_request(n: int, dense: Sequence[float], parts: Sequence[tuple]) -> ParsedRequest:
    """n single-hot rows from parts (features, ids, field): ids ``[k, n]``, or ``[k]`` when
    every row has the same id; ``field(j, row)`` names the field of the id of features[j] in
    that row. The ParsedRequest's segments are left to ParsedRequest.segments(); its id_field
    reads positions in their key-major order."""
    features = [f for part in parts for f in part[0]]
    order = sorted(range(len(features)), key=features.__getitem__)
    if len(parts) == 1 and order == list(range(len(features))):  # e.g. keys sent in model order
        ids = np.ascontiguousarray(parts[0][1], dtype=np.int64)
    else:
        rank = [0] * len(features)
        for r, i in enumerate(order):
            rank[i] = r
        ids = np.empty((len(features), n), dtype=np.int64)
        start = 0
        for part_features, part_ids, _ in parts:
            k = len(part_features)
            ids[rank[start : start + k]] = part_ids if part_ids.ndim == 2 else part_ids[:, None]
            start += k
    source = [(p, j) for p, part in enumerate(parts) for j in range(len(part[0]))]
    source = [source[i] for i in order]

    def id_field(pos: int) -> str:
        p, j = source[pos // n]
        return parts[p][2](j, pos % n)

    return ParsedRequest(n, dense, None, None, None, None, id_field, (tuple(features[i] for i in order), ids))


@dataclass
class Batch:
    """Every row of the requests that passed: B rows, F features."""

    dense: torch.Tensor  # [B, F_dense] float32
    sparse: KeyedJaggedTensor  # keys in model order, key-major lengths [F * B], int64 values
    rows: list[int]  # rows per request, in order
    remapped_ids: int = 0  # ids folded by id_overflow: modulo


class RequestParser:
    """Validates request bodies against one model config."""

    def __init__(self, config: DLRMConfig):
        self.config = config
        self.feature_index = {name: f for f, name in enumerate(config.sparse_features)}
        self._all_features = list(range(config.num_features))
        self._known_keys: dict[tuple[str, ...] | bytes, list[int]] = {}

    def parse(self, body: Any) -> ParsedRequest:
        """A TorchServe body (bytes, str, or an already-decoded dict) -> ParsedRequest.

        Raises BadRequest (400) or PayloadTooLarge (413) naming the field.
        """
        # A small body (a row or a few) decodes as fast with the strict schema, and its bounds
        # then need no second look.
        if isinstance(body, (bytes, bytearray, memoryview)) and len(body) >= _FAST_MIN_BYTES:
            try:
                return self._parse(_FAST_DECODER.decode(body), checked=False)
            except (msgspec.MsgspecError, RequestError, OverflowError):
                pass  # the strict pass below names the field
        return self._parse(_decode(body), checked=True)

    def _parse(self, req: Any, checked: bool) -> ParsedRequest:
        """``checked``: decoded with the strict schema (bounds checked)."""
        row_fields = (req.dense, req.sparse, req.float_features, req.id_list_lengths, req.id_list_values)
        if req.columns is not None or req.context is not None or req.candidates is not None:
            out = (self._columns if req.columns is not None else self._ranking)(req, row_fields)
            if not checked:
                _check_ranges(out)
            return out
        if req.instances is not None:
            if any(v is not None for v in row_fields):
                raise BadRequest("instances: put every field inside the instances; no other top-level field is allowed beside it")
            instances, wrapped = req.instances, True
            if not instances:
                raise BadRequest("instances: expected a non-empty array of instances, got []")
        else:
            instances, wrapped = [req], False
        self._check_sizes(instances, "instances", 0)
        out = self._rows(instances, "instances" if wrapped else "", None, (), candidate=False)
        if not checked:
            _check_ranges(out)
        return out

    def _check_sizes(self, rows: Sequence[Any], name: str, shared_ids: int) -> None:
        c = self.config
        if len(rows) > c.max_instances_per_request:
            raise PayloadTooLarge(
                f"{name}: at most {c.max_instances_per_request} instances per request "
                f"(handler.max_instances_per_request), got {len(rows)}"
            )
        if len(rows) == 1:  # the common single-row request: no iterator chain
            r = rows[0]
            n_ids = shared_ids + (len(r.sparse.values) if r.sparse is not None else len(r.id_list_values or ()))
        else:
            n_ids = (shared_ids * len(rows) + sum(map(len, map(_VALUES, filter(None, map(_SPARSE, rows)))))
                     + sum(map(len, filter(None, map(_ID_VALUES, rows)))))
        if n_ids > c.max_ids_per_request:
            raise PayloadTooLarge(
                f"sparse.values: at most {c.max_ids_per_request} ids per request "
                f"(handler.max_ids_per_request), got {n_ids}"
            )

    def _rows(self, rows: Sequence[Any], name: str, shared_dense: Sequence[float] | None,
              shared_features: Sequence[int], candidate: bool) -> ParsedRequest:
        """The rows of ``instances`` or ``candidates`` (``name``; "" for a bare instance).
        ``shared_dense``: the context's dense, which the rows then must not send;
        ``shared_features``: the context's features, which the rows must not send."""
        if len(rows) > 1:
            out = self._common_rows(rows, name, shared_dense is not None)
            if out is not None:
                return out
        out = ParsedRequest(len(rows), [], [], [], [], [])
        # Per row, for messages only: where its ids start in out.values and their field's name.
        value_start, values_field = [], []
        for row, inst in enumerate(rows):
            value_start.append(len(out.values))
            values_field.append(self._add_row(inst, row, f"{name}[{row}]." if name else "", out,
                                              shared_dense is not None, shared_features, candidate))

        def id_field(pos: int) -> str:
            row = bisect.bisect_right(value_start, pos) - 1
            return f"{name + '[%d].' % row if name else ''}{values_field[row]}[{pos - value_start[row]}]"

        out.id_field = id_field
        return out

    def _common_rows(self, rows: Sequence[Any], name: str, shared_dense: bool) -> ParsedRequest | None:
        """The common case without a Python loop per row: every row sends ``dense`` (unless the
        context does) and ``sparse`` with one key list, and all is well. None otherwise: the
        row-by-row path then handles it, or names what is wrong."""
        c = self.config
        n = len(rows)
        sparse = list(map(_SPARSE, rows))
        if None in sparse or set(map(_ROW_FORM, rows)) != {(None, None, None)}:
            return None
        keys = sparse[0].keys
        if not all(map(keys.__eq__, map(_KEYS, sparse))):
            return None
        try:
            features = self._features(keys, "")
            k = len(features)
            lengths_lists = list(map(_LENGTHS, sparse))
            values_lists = list(map(_VALUES, sparse))
            if shared_dense:
                if any(map(_DENSE, rows)):
                    return None
                dense = np.zeros(0, dtype=np.float32)
            else:
                dense_lists = list(map(_DENSE, rows))
                if None in dense_lists or set(map(len, dense_lists)) != {c.num_dense_features}:
                    return None
                with np.errstate(over="ignore"):  # past float32: inf, which _check_ranges refuses
                    dense = np.fromiter(itertools.chain.from_iterable(dense_lists), np.float32,
                                        n * c.num_dense_features)
            alike = all(map(lengths_lists[0].__eq__, lengths_lists))  # e.g. single-hot
            if not alike:
                lengths_lists = list(map(_counts, lengths_lists))
            first = _counts(lengths_lists[0])
            if alike:
                if len(first) != k or (k and min(first) < 0) or set(map(len, values_lists)) != {sum(first)}:
                    return None
                if k and set(first) == {1}:  # id j of a row is its key j's
                    values = np.fromiter(itertools.chain.from_iterable(values_lists), np.int64, n * k)
                    return _hot_request(n, dense, [(features, values.reshape(n, k).T,
                                                    lambda j, row: f"{name}[{row}].sparse.values[{j}]")])
            counts = np.fromiter(map(len, values_lists), np.int64, n)
            if alike:
                lengths = np.tile(np.array(first, dtype=np.int64), n)
            else:
                if set(map(len, lengths_lists)) != {k}:
                    return None
                lengths = np.fromiter(itertools.chain.from_iterable(lengths_lists), np.int64, n * k)
                if (k and lengths.min() < 0) or not np.array_equal(lengths.reshape(n, k).sum(1), counts):
                    return None
            values = np.fromiter(itertools.chain.from_iterable(values_lists), np.int64, int(counts.sum()))
        except (RequestError, OverflowError, ValueError, TypeError):
            return None
        value_start = np.concatenate(([0], np.cumsum(counts)[:-1])).tolist()

        def id_field(pos: int) -> str:
            row = bisect.bisect_right(value_start, pos) - 1
            return f"{name}[{row}].sparse.values[{pos - value_start[row]}]"

        return ParsedRequest(n, dense, values, np.tile(np.array(features, dtype=np.int64), n), lengths,
                             np.repeat(np.arange(n, dtype=np.int64), k), id_field)

    def _ranking(self, req: Any, row_fields: tuple) -> ParsedRequest:
        """``{"context": {...}, "candidates": [{...}, ...]}``: one row per candidate, each the
        context's features plus its own. E.g. context {dense: d, sparse: {user: [7]}} and
        candidates [{sparse: {item: [3]}}, {sparse: {item: [5]}}] are the rows
        {dense: d, user: [7], item: [3]} and {dense: d, user: [7], item: [5]}."""
        if req.instances is not None or any(v is not None for v in row_fields):
            raise BadRequest("context: put every field inside context and candidates; no other top-level field "
                             "is allowed beside them")
        candidates = req.candidates
        if req.context is None:
            raise BadRequest("context: required field is missing (the features all candidates share, "
                             "e.g. {\"dense\": [...], \"sparse\": {...}})")
        if candidates is None:
            raise BadRequest("candidates: required field is missing (one object per item to score, "
                             "e.g. [{\"sparse\": {...}}, ...], or columns: {...})")
        if not candidates:
            raise BadRequest("candidates: expected a non-empty array of candidates, got []")
        ctx = self._context(req.context)
        self._check_sizes(candidates, "candidates", len(ctx.values))
        own = self._rows(candidates, "candidates", ctx.dense, ctx.features, candidate=True)
        if ctx.features and own.n > 1 and (own.onehot is not None or isinstance(own.seg_feature, np.ndarray)):
            # the common path skipped this
            sent = own.onehot[0] if own.onehot is not None else own.seg_feature[: len(own.seg_feature) // own.n].tolist()
            if set(ctx.features) & set(sent):
                raise BadRequest(self._clash(candidates[0], 0, ctx.features))
        return ctx.join(own)

    def _columns(self, req: Any, row_fields: tuple) -> ParsedRequest:
        """``{"columns": {"dense": [[...], ...], "sparse": {"<feature>": {"values": [...],
        "lengths": [...]}}}}``: n rows given feature by feature (one body for a whole candidate
        list, no key repeated per row), optionally with a ``context`` that every row shares.
        A feature's ``lengths`` has one entry per row; left out, every row has one id. E.g.
        {"dense": [d0, d1], "sparse": {"f0": {"values": [3, 4, 5], "lengths": [2, 1]},
        "f1": {"values": [7, 8]}}} is the rows {dense: d0, f0: [3, 4], f1: [7]} and
        {dense: d1, f0: [5], f1: [8]}."""
        if req.instances is not None or req.candidates is not None or any(v is not None for v in row_fields):
            raise BadRequest("columns: send columns alone or with a context; no other top-level field is allowed "
                             "beside it")
        c, cols = self.config, req.columns
        ctx = self._context(req.context) if req.context is not None else _Context()
        sparse = cols.sparse or {}
        if cols.dense is not None:
            n, n_field = len(cols.dense), "columns.dense"
        elif sparse:
            key, bag = next(iter(sparse.items()))
            n, n_field = ((len(bag.values), f"columns.sparse.{key}.values") if bag.lengths is None
                          else (len(bag.lengths), f"columns.sparse.{key}.lengths"))
        else:
            raise BadRequest('columns: expected a dense and/or a sparse column, e.g. {"dense": [[...], ...], '
                             '"sparse": {"<feature>": {"values": [...], "lengths": [...]}}}')
        if n == 0:
            raise BadRequest(f"{n_field}: expected at least one row, got []")
        if n > c.max_instances_per_request:
            raise PayloadTooLarge(f"{n_field}: at most {c.max_instances_per_request} rows per request "
                                  f"(handler.max_instances_per_request), got {n}")
        n_ids = sum(len(bag.values) for bag in sparse.values()) + n * len(ctx.values)
        if n_ids > c.max_ids_per_request:
            raise PayloadTooLarge(f"columns.sparse: at most {c.max_ids_per_request} ids per request "
                                  f"(handler.max_ids_per_request), got {n_ids}")
        if cols.dense is not None:
            if ctx.dense is not None:
                raise BadRequest("columns.dense: context.dense is given already; send dense once in the context "
                                 "or as a column")
            width = c.num_dense_features
            if set(map(len, cols.dense)) != {width}:
                j = next(j for j, row in enumerate(cols.dense) if len(row) != width)
                raise BadRequest(f"columns.dense[{j}]: expected {width} numbers, got {len(cols.dense[j])}")
            with np.errstate(over="ignore"):  # past float32: inf, which _check_ranges refuses
                dense = np.array(cols.dense, dtype=np.float32)
        elif ctx.dense is not None:
            dense = np.zeros((n, 0), dtype=np.float32)  # the context's, added by join
        else:
            raise BadRequest("columns.dense: required field is missing (one array of "
                             f"{c.num_dense_features} numbers per row, or once in context.dense)")
        feats, names, value_lists, length_lists = [], [], [], []
        for key, bag in sparse.items():
            f = self.feature_index.get(key)
            where = f"columns.sparse.{key}"
            if f is None:
                raise BadRequest(f"columns.sparse: unknown feature {_show(key)}; expected one of "
                                 f"{_names(c.sparse_features, 32)}")
            if f in ctx.features:
                raise BadRequest(f"{where}: feature {_show(key)} is also in context.sparse.keys; send each feature "
                                 f"in the context or as a column, not both")
            if bag.lengths is None and len(bag.values) != n:
                raise BadRequest(f"{where}.values: expected one id per row ({n}) when {where}.lengths is left "
                                 f"out, got {len(bag.values)}")
            if bag.lengths is not None and len(bag.lengths) != n:
                raise BadRequest(f"{where}.lengths: expected one length per row ({n}), got {len(bag.lengths)}")
            feats.append(f)
            names.append(where)
            value_lists.append(bag.values)
            length_lists.append(bag.lengths)
        # All features at once, in the order sent (already key-major within the request).
        k, counts = len(feats), list(map(len, value_lists))
        values = np.fromiter(itertools.chain.from_iterable(value_lists), np.int64, sum(counts))
        single_hot = all(lengths is None for lengths in length_lists)
        if not single_hot:
            lengths = np.fromiter(itertools.chain.from_iterable(
                itertools.repeat(1, n) if x is None else x for x in length_lists), np.int64, k * n)
            sums = lengths.reshape(k, n).sum(1)
            if (sums != counts).any():
                j = int(np.argmax(sums != counts))
                raise BadRequest(f"{names[j]}.values: expected sum({names[j]}.lengths) = {int(sums[j])} ids, got "
                                 f"{counts[j]}")
            single_hot = bool((lengths == 1).all())
        dense = dense.reshape(-1)
        if single_hot:  # one id per row: the id of row r is at r
            return ctx.join(_hot_request(n, dense, [(feats, values.reshape(k, n),
                                                     lambda j, row: f"{names[j]}.values[{row}]")]))
        starts = list(itertools.accumulate(counts, initial=0))

        def id_field(pos: int) -> str:
            j = bisect.bisect_right(starts, pos) - 1
            return f"{names[j]}.values[{pos - starts[j]}]"

        return ctx.join(ParsedRequest(n, dense, values, np.repeat(np.array(feats, dtype=np.int64), n), lengths,
                                      np.tile(np.arange(n, dtype=np.int64), k), id_field))

    def _context(self, ctx: Any) -> "_Context":
        """The ``context`` of the ranking or columns form, checked."""
        for field, value in (("float_features", ctx.float_features), ("id_list_features.lengths", ctx.id_list_lengths),
                             ("id_list_features.values", ctx.id_list_values)):
            if value is not None:
                raise BadRequest(f"context.{field}: the context takes dense and sparse")
        if ctx.dense is not None and len(ctx.dense) != self.config.num_dense_features:
            raise BadRequest(f"context.dense: expected {self.config.num_dense_features} numbers, got {len(ctx.dense)}")
        if ctx.sparse is None:
            return _Context(ctx.dense)
        keys, values, lengths = ctx.sparse.keys, ctx.sparse.values, _counts(ctx.sparse.lengths)
        features = self._features(keys, "context.")
        if len(lengths) != len(features):
            raise BadRequest(f"context.sparse.lengths: expected one length per key ({len(features)}), got {len(lengths)}")
        if sum(lengths) != len(values):
            raise BadRequest(f"context.sparse.values: expected sum(context.sparse.lengths) = {sum(lengths)} ids, "
                             f"got {len(values)}")
        return _Context(ctx.dense, features, values, lengths)

    def _clash(self, cand: Any, row: int, shared: Sequence[int]) -> str:
        keys = self._key_list(cand.sparse.keys, f"candidates[{row}].")
        j = next(j for j, key in enumerate(keys) if self.feature_index[key] in shared)
        return (f"candidates[{row}].sparse.keys[{j}]: feature {_show(keys[j])} is also in context.sparse.keys; "
                f"send each feature in the context or per candidate, not both")

    def _add_row(self, inst: Any, row: int, p: str, out: ParsedRequest, shared_dense: bool,
                 shared_features: Sequence[int], candidate: bool) -> str:
        """Append one instance's (or candidate's) row to ``out``; returns the name of its ids' field."""
        c = self.config
        if candidate and (inst.float_features is not None or inst.id_list_lengths is not None
                          or inst.id_list_values is not None):
            raise BadRequest(f"{p}float_features: the ranking form takes dense and sparse")
        if candidate or inst.sparse is not None or inst.dense is not None:
            if inst.float_features is not None or inst.id_list_lengths is not None or inst.id_list_values is not None:
                raise BadRequest(f"{p}dense: use either dense + sparse or float_features + id_list_features.*, not both")
            dense, dense_field = inst.dense, "dense"
            if shared_dense and dense is not None:
                raise BadRequest(f"{p}dense: context.dense is given already; send dense once in the context "
                                 f"or in every candidate")
            if dense is None and not shared_dense:
                raise BadRequest(f"{p}dense: required field is missing" + (" (send it in every candidate or once "
                                                                          "in the context)" if candidate else ""))
            values_field, lengths_field = "sparse.values", "sparse.lengths"
            if inst.sparse is None:
                if not candidate:
                    raise BadRequest(f"{p}sparse: required field is missing (expected {{\"keys\": [...], \"values\": [...], \"lengths\": [...]}})")
                keys, values, lengths, features = [], [], [], []
            else:
                keys, values, lengths = inst.sparse.keys, inst.sparse.values, _counts(inst.sparse.lengths)
                features = self._features(keys, p)
                if len(lengths) != len(features):
                    raise BadRequest(f"{p}sparse.lengths: expected one length per key ({len(features)}), got {len(lengths)}")
                if shared_features and not set(features).isdisjoint(shared_features):
                    raise BadRequest(self._clash(inst, row, shared_features))
        else:
            dense, dense_field = inst.float_features, "float_features"
            lengths, values = inst.id_list_lengths, inst.id_list_values
            values_field, lengths_field = "id_list_features.values", "id_list_features.lengths"
            if dense is None and lengths is None and values is None:
                raise BadRequest(f"{p}dense: required field is missing (expected dense and sparse)")
            for name, v in ((dense_field, dense), (lengths_field, lengths), (values_field, values)):
                if v is None:
                    raise BadRequest(f"{p}{name}: required field is missing")
            if len(lengths) != c.num_features:
                raise BadRequest(
                    f"{p}{lengths_field}: expected one length per sparse feature in model order "
                    f"({c.num_features}: {_names(c.sparse_features)}), got {len(lengths)}"
                )
            features = self._all_features

        if dense is not None and len(dense) != c.num_dense_features:
            raise BadRequest(f"{p}{dense_field}: expected {c.num_dense_features} numbers, got {len(dense)}")
        total = sum(lengths)
        if total != len(values):
            raise BadRequest(f"{p}{values_field}: expected sum({lengths_field}) = {total} ids, got {len(values)}")
        if dense is not None:
            out.dense.extend(dense)
        out.values.extend(values)
        out.seg_feature.extend(features)
        out.seg_length.extend(lengths)
        out.seg_row.extend(itertools.repeat(row, len(lengths)))
        return values_field

    def _key_list(self, keys: list[str] | msgspec.Raw, p: str) -> list[str]:
        if isinstance(keys, msgspec.Raw):
            try:
                return _KEY_LIST.decode(keys)
            except msgspec.MsgspecError:
                raise _Recheck(f"{p}sparse.keys: expected an array of feature names") from None
        return keys

    def _features(self, keys: list[str] | msgspec.Raw, p: str) -> list[int]:
        """Feature indices of a key list (strict: a list; fast: its raw JSON), validated once
        per distinct list: the instances of a ranking request usually share one."""
        cache_key = bytes(keys) if isinstance(keys, msgspec.Raw) else tuple(keys)
        features = self._known_keys.get(cache_key)
        if features is not None:
            return features
        features = []
        for j, key in enumerate(self._key_list(keys, p)):
            f = self.feature_index.get(key)
            if f is None:
                raise BadRequest(
                    f"{p}sparse.keys[{j}]: unknown feature {_show(key)}; expected one of "
                    f"{_names(self.config.sparse_features, 32)}"
                )
            if f in features:
                raise BadRequest(f"{p}sparse.keys[{j}]: feature {_show(key)} appears more than once")
            features.append(f)
        if len(self._known_keys) >= 1024:  # bounded: clients may send any key orders
            self._known_keys.clear()
        self._known_keys[cache_key] = features
        return features


def _check_ranges(out: ParsedRequest) -> None:
    """What the fast schema does not check: ids and lengths in 0..int64 max, dense within
    float32 (a larger number became inf). Raises _Recheck (the strict pass names the field)."""
    if out.values is None:  # single-hot: lengths are all 1
        ids = out.onehot[1]
        if ids.size and ids.min() < 0:
            raise _Recheck("values: out of range")
    for name in ("values", "seg_length") if out.values is not None else ():
        seq = getattr(out, name)
        if isinstance(seq, np.ndarray):  # int64 already: only the sign is left to check
            bad = len(seq) and seq.min() < 0
        else:
            bad = len(seq) and (min(seq) < 0 or max(seq) > INT64_MAX)
        if bad:
            raise _Recheck(f"{name}: out of range")
    dense = out.dense
    if len(dense):
        if isinstance(dense, np.ndarray):
            bad = not np.isfinite(dense).all()
        else:
            bad = max(dense) > FLOAT32_MAX or min(dense) < -FLOAT32_MAX
        if bad:
            raise _Recheck("dense: out of range")


def collate(
    requests: Sequence[ParsedRequest], config: DLRMConfig, device: torch.device | str = "cpu"
) -> tuple[Batch | None, dict[int, RequestError]]:
    """All rows of all requests -> one Batch; requests with an out-of-range id become errors.

    A few numpy ops per batch, no Python loop over ids. When some requests hold an out-of-range
    id, the rest are collated again without them (that second pass is clean). Returns
    (None, errors) when no request is left.
    """
    errors: dict[int, RequestError] = {}
    keep = list(range(len(requests)))
    while True:
        batch, bad = _collate([requests[i] for i in keep], config, device)
        if not bad:
            return batch, errors
        for j, err in bad.items():
            errors[keep[j]] = err
        keep = [i for i in keep if i not in errors]
        if not keep:
            return None, errors


def _collate(
    requests: Sequence[ParsedRequest], config: DLRMConfig, device: torch.device | str
) -> tuple[Batch | None, dict[int, RequestError]]:
    # Index math in numpy: on arrays of a few thousand ids np.array(list) is ~5x and np.repeat
    # ~50x faster than their torch twins (per-op dispatch cost); torch takes the result as is.
    F = config.num_features
    rows = [r.n for r in requests]
    B = sum(rows)
    hot = [r.onehot for r in requests]
    if None not in hot and len({h[0] for h in hot}) == 1:
        batch = _collate_onehot(requests, config, device)
        if batch is not None:
            return batch, {}
    for r in requests:
        r.segments()

    def cat(name: str, dtype=np.int64) -> np.ndarray:
        parts = [getattr(r, name) for r in requests]
        if len(parts) == 1:
            return np.asarray(parts[0], dtype=dtype)  # read only below: no copy needed
        if all(isinstance(p, list) for p in parts):
            return np.array(list(itertools.chain.from_iterable(parts)), dtype=dtype)
        return np.concatenate([np.asarray(p, dtype=dtype) for p in parts])

    dense = cat("dense", np.float32).reshape(B, config.num_dense_features)
    values = cat("values")
    seg_feature, seg_length = cat("seg_feature"), cat("seg_length")
    # Each request's local rows, offset by the rows of the requests before it.
    seg_row = cat("seg_row")
    if len(requests) > 1:
        seg_row = seg_row + np.repeat(np.cumsum([0] + rows[:-1]), [len(r.seg_row) for r in requests])

    # Bounds first, in request order: every id must name a row of its feature's table.
    limit = _table_rows(config)[np.repeat(seg_feature, seg_length)]
    over = values >= limit
    remapped = 0
    if over.any():
        if config.id_overflow != "modulo":
            return None, _out_of_range_errors(requests, config, np.flatnonzero(over), values[over])
        remapped = int(over.sum())
        values = np.remainder(values, limit)

    # Key-major slot of each segment (feature f, row b -> f * B + b; unique per segment). Each
    # segment's ids move, in order, to where its slot starts in the KJT's values: a scatter,
    # no sort.
    slot = seg_feature * B + seg_row
    lengths = np.zeros(F * B, dtype=np.int64)
    lengths[slot] = seg_length
    slot_start = np.cumsum(lengths) - lengths
    seg_start = np.cumsum(seg_length) - seg_length
    dst = np.repeat(slot_start[slot] - seg_start, seg_length) + np.arange(len(values))
    kjt_values = np.empty_like(values)
    kjt_values[dst] = values
    values = kjt_values
    kjt = KeyedJaggedTensor(
        keys=list(config.sparse_features),
        values=_on(torch.from_numpy(values), device),
        lengths=_on(torch.from_numpy(lengths), device),
    )
    return Batch(_on(torch.from_numpy(dense), device), kjt, rows, remapped), {}


def _collate_onehot(requests: Sequence[ParsedRequest], config: DLRMConfig, device: torch.device | str) -> Batch | None:
    """The batch when every request is single-hot in the same features (ParsedRequest.onehot):
    the KJT's values are the ids [k, B] read row by row, its lengths 1 for those features and 0
    for the rest. E.g. features (0, 2) of F = 3, rows b0, b1: lengths [1, 1 | 0, 0 | 1, 1],
    values [f0 ids of b0, b1 | f2 ids of b0, b1]. None when an id is out of range: the general
    path names it (or folds it)."""
    features = requests[0].onehot[0]
    ids = (requests[0].onehot[1] if len(requests) == 1
           else np.concatenate([r.onehot[1] for r in requests], axis=1))
    if features and (ids >= _feature_rows(config, features)).any():
        return None
    B = ids.shape[1]
    lengths = np.zeros((config.num_features, B), dtype=np.int64)
    lengths[list(features)] = 1
    dense = np.concatenate([np.asarray(r.dense, dtype=np.float32) for r in requests]) if len(requests) > 1 \
        else np.asarray(requests[0].dense, dtype=np.float32)
    kjt = KeyedJaggedTensor(
        keys=list(config.sparse_features),
        values=_on(torch.from_numpy(np.ascontiguousarray(ids).reshape(-1)), device),
        lengths=_on(torch.from_numpy(lengths.reshape(-1)), device),
    )
    return Batch(_on(torch.from_numpy(dense.reshape(B, config.num_dense_features)), device), kjt,
                 [r.n for r in requests])


def _on(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t.to(device)``; skipped for the CPU, where it is a no-op that still costs ~5 µs."""
    return t if str(device) == "cpu" else t.to(device)


def _out_of_range_errors(
    requests: Sequence[ParsedRequest], config: DLRMConfig, src_pos: np.ndarray, ids: np.ndarray
) -> dict[int, RequestError]:
    """Name the first out-of-range id of each offending request (the rare path)."""
    value_offset = list(itertools.accumulate((len(r.values) for r in requests), initial=0))
    req_of = np.searchsorted(value_offset[1:], src_pos, side="right")
    errors: dict[int, RequestError] = {}
    for i in np.unique(req_of).tolist():
        first = int(np.flatnonzero(req_of == i)[0])  # positions are ascending
        pos, id_ = int(src_pos[first]), int(ids[first])
        r, local = requests[i], pos - value_offset[i]
        s = bisect.bisect_right(list(itertools.accumulate(r.seg_length)), local)
        f = int(r.seg_feature[s])
        name, n_rows = config.sparse_features[f], config.num_embeddings[f]
        errors[i] = BadRequest(
            f"{r.id_field(local)}: "
            f"id {id_} is out of range for feature {name!r} (table of {n_rows} rows: expected 0..{n_rows - 1}; "
            f"handler.id_overflow: modulo folds ids instead)"
        )
    return errors


@functools.lru_cache(maxsize=64)
def _feature_rows(config: DLRMConfig, features: tuple[int, ...]) -> np.ndarray:
    """Rows of the tables of ``features``, as a column ``[k, 1]`` to compare ids ``[k, B]`` with."""
    return _table_rows(config)[list(features)][:, None]


@functools.lru_cache(maxsize=8)
def _table_rows(config: DLRMConfig) -> np.ndarray:
    """Rows per table, as an array made once per config."""
    return np.array(config.num_embeddings, dtype=np.int64)


def scores(model: torch.nn.Module, batch: Batch, config: DLRMConfig) -> list[list[float]]:
    """Forward the whole batch once; split its scores back per request."""
    with torch.inference_mode():
        logits = model(batch.dense, batch.sparse).squeeze(1)
        if config.output == "probability":
            logits = torch.sigmoid(logits)
        flat = logits.float().cpu().tolist()
    out, start = [], 0
    for n in batch.rows:
        out.append(flat[start : start + n])
        start += n
    return out


def response_body(row_scores: list[float]) -> bytes:
    """``{"scores": [...]}``, plus ``"score"`` when the request has one row."""
    if len(row_scores) == 1:
        return msgspec.json.encode({"score": row_scores[0], "scores": row_scores})
    return msgspec.json.encode({"scores": row_scores})


def error_body(error: RequestError) -> bytes:
    return msgspec.json.encode(error.body())


# --- decoding and msgspec error translation -------------------------------------------------

def _decode(body: Any) -> _Request:
    if body is None:
        raise BadRequest("body: expected a JSON object, got an empty body")
    if isinstance(body, (bytes, bytearray, memoryview)):
        raw = bytes(body)
    elif isinstance(body, str):
        raw = body.encode("utf-8", "surrogatepass")
    else:  # TorchServe already decoded it (Content-Type: application/json, decoding on)
        try:
            return msgspec.convert(body, _Request)
        except msgspec.ValidationError as e:
            raise BadRequest(_explain(str(e), lambda: body)) from None
    if not raw.strip():
        raise BadRequest("body: expected a JSON object, got an empty body")
    try:
        return _DECODER.decode(raw)
    except msgspec.MsgspecError as e:
        # Only now, on the error path, is it worth telling bad encoding from bad content.
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as u:
            raise BadRequest(f"body: expected UTF-8 JSON, got an invalid byte at position {u.start}") from None
        if isinstance(e, msgspec.ValidationError):
            raise BadRequest(_explain(str(e), lambda: msgspec.json.decode(raw))) from None
        where = _non_finite_literal(raw, str(e))
        if where:
            raise BadRequest(f"{where}: NaN and Infinity are not numbers in JSON; send a finite number") from None
        raise BadRequest(f"body: expected a JSON object, got malformed JSON ({_lower(str(e))})") from None


_AT_BYTE = re.compile(r"\(byte (\d+)\)$")
# What clients' encoders write for non-finite floats (Python's json: NaN, Infinity, -Infinity).
_NON_FINITE = re.compile(rb"-?(?:NaN|nan|Infinity|infinity|inf|Inf)")


def _non_finite_literal(raw: bytes, error: str) -> str | None:
    """The path of a NaN/Infinity literal that made ``raw`` malformed JSON, e.g. ``dense[2]``.

    The literal is swapped for a string of the same name and the body decoded again: the schema
    then refuses the string at its path. None when the error is something else.
    """
    m = _AT_BYTE.search(error)
    if not m:
        return None
    # msgspec points at, or a few bytes past, the literal's start (it reads "nan," as a "null").
    pos = int(m.group(1))
    lit = None
    for found in _NON_FINITE.finditer(raw, max(0, pos - 9), pos + 10):
        if found.start() <= pos:
            lit = found
    if lit is None:
        return None
    try:
        _DECODER.decode(raw[: lit.start()] + b'"' + lit.group() + b'"' + raw[lit.end() :])
    except msgspec.ValidationError as v:
        at = _AT.search(str(v))
        return at.group("path").lstrip(".") if at else None
    except msgspec.MsgspecError:
        return None
    return None


_AT = re.compile(r" - at `\$(?P<path>[^`]*)`$")
_RULES = [  # msgspec's wording -> ours
    (re.compile(r"Expected `int` >= 0$"), "expected a non-negative integer"),
    (re.compile(r"Expected `int` <= \d+$"), f"expected an integer that fits int64 (at most {INT64_MAX})"),
    (re.compile(r"Expected `float` [<>]= \S+$"), "expected a number within float32 range (|x| <= 3.4e38)"),
    (re.compile(r"Number out of range$"), "expected a number within float32 range (|x| <= 3.4e38)"),
    (re.compile(r"Expected `int`, got `float`$"), "expected an integer"),
    (re.compile(r"Expected `int`, got `(\w+)`$"), "expected an integer"),
    (re.compile(r"Expected `float`, got `(\w+)`$"), "expected a number"),
    (re.compile(r"Expected `str` of length <= \d+$"), f"expected a feature name of at most {MAX_KEY_CHARS} characters"),
    (re.compile(r"Expected `str`, got `(\w+)`$"), "expected a string"),
    (re.compile(r"Expected `array \| null`, got `(\w+)`$"), "expected an array"),
    (re.compile(r"Expected `array`, got `(\w+)`$"), "expected an array"),
    (re.compile(r"Expected `object \| null`, got `(\w+)`$"), "expected an object"),
    (re.compile(r"Expected `object`, got `(\w+)`$"), "expected a JSON object"),
]


def _explain(msg: str, whole: Any, prefix: str = "") -> str:
    """``Expected `int` >= 0 - at `$.sparse.lengths[1]``` -> ``sparse.lengths[1]: expected a
    non-negative integer, got -1``. ``prefix``: where ``whole`` sits in the request."""
    m = _AT.search(msg)
    path = m.group("path").lstrip(".") if m else ""
    text = msg[: m.start()] if m else msg
    if path.startswith("columns.sparse[...]") and not prefix:  # msgspec does not say which feature
        named = _name_column(whole)
        if named:
            return named
    where = ".".join(filter(None, (prefix, path))).replace(".[", "[")
    if text.startswith("Object missing required field"):
        name = text.split("`")[1]
        return f"{where + '.' if where else ''}{name}: required field is missing"
    if text.startswith("Object contains unknown field"):
        name = text.split("`")[1]
        return f"{where + '.' if where else ''}{name[:MAX_KEY_CHARS]}: unknown field; expected {_expected_fields(where)}"
    for rule, ours in _RULES:
        m = rule.match(text)
        if m:
            got = _value_at(whole, path)
            if got is None and m.groups():
                got = f"{'an' if m.group(1)[0] in 'aeiou' else 'a'} {m.group(1)}"  # msgspec's type name
            return f"{where or 'body'}: {ours}" + (f", got {got}" if got is not None else "")
    return f"{where or 'body'}: {_lower(text)}"


def _name_column(whole: Any) -> str | None:
    """The message for the first column of ``columns.sparse`` that does not fit, named by its
    feature, e.g. ``columns.sparse.feature_0.values[1]: expected a non-negative integer, got -1``."""
    try:
        columns = whole()["columns"]["sparse"]
        items = list(columns.items())
    except (Exception, RecursionError):
        return None
    for key, bag in items:
        try:
            msgspec.convert(bag, _Bag)
        except msgspec.ValidationError as e:
            return _explain(str(e), lambda bag=bag: bag, f"columns.sparse.{str(key)[:MAX_KEY_CHARS]}")
    return None


def _expected_fields(path: str) -> str:
    if path.endswith("columns"):
        return "dense, sparse"
    if path.startswith("columns.sparse"):
        return "values, lengths"
    if path.endswith("sparse"):
        return "keys, values, lengths"
    fields = "dense, sparse, float_features, id_list_features.lengths, id_list_features.values"
    return fields if path else fields + ", instances, context, candidates, columns"


def _value_at(whole: Any, path: str) -> str | None:
    """The offending value, shown briefly; None where it cannot be had cheaply and safely."""
    try:
        obj = whole()
        for part in re.findall(r"[^.\[\]]+|\[\d+\]", path):
            obj = obj[int(part[1:-1])] if part.startswith("[") else obj[part]
    except (Exception, RecursionError):  # e.g. too deeply nested to decode untyped
        return None
    return _show(obj)


def _show(value: Any, limit: int = 64) -> str:
    """JSON text of a value, cut short; never raises."""
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=True)
    except (TypeError, ValueError, RecursionError):
        text = repr(value)
    if isinstance(value, float) and not math.isfinite(value):
        text = str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _names(names: Sequence[str], limit: int = 6) -> str:
    shown = ", ".join(names[:limit])
    return shown + (", ..." if len(names) > limit else "")


def _lower(text: str) -> str:
    """msgspec's sentence as a clause: "Input data was truncated" -> "input data was truncated";
    an acronym keeps its case ("JSON is malformed")."""
    word = text.split(" ", 1)[0]
    return text if len(word) > 1 and word.isupper() else text[:1].lower() + text[1:]
