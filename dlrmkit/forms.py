"""The /predictions JSON forms: one body -> one ParsedRequest; scores -> the JSON answer.

    RequestParser(config).parse(body) -> ParsedRequest    raises BadRequest / PayloadTooLarge
    response_body(scores) / error_body(error)              the answer's JSON bytes

Forms (a body may hold one instance, or several under ``instances``)::

    {"dense": [0.1, 0.2], "sparse": {"keys": ["f1", "f0"], "values": [7, 3, 4], "lengths": [1, 2]}}
    {"instances": [<instance>, <instance>, ...]}
    {"context": {"dense": [...], "sparse": {...}}, "candidates": [{"sparse": {...}}, ...]}
                                                       # one row per candidate: context + its own
    {"columns": {"dense": [[...], ...], "sparse": {"f0": {"values": [...], "lengths": [...]}}}}
                                                       # rows feature by feature (+ a context)
    {"float_features": [...], "id_list_features.lengths": [<one per feature, model order>],
     "id_list_features.values": [...]}                 # the pytorch/serve torchrec_dlrm format

A key that an instance omits is an empty bag. Decoding and its messages are dlrmkit.schema's; the
layout the rows end in is dlrmkit.request's.
"""

from __future__ import annotations

import bisect
import itertools
import operator
from typing import Any, Sequence

import msgspec
import numpy as np

from dlrmkit.config import INT64_MAX, DLRMConfig
from dlrmkit.errors import BadRequest, PayloadTooLarge, RequestError
from dlrmkit.schema import (
    FAST_DECODER,
    FAST_MIN_BYTES,
    FLOAT32_MAX,
    KEY_LIST,
    Recheck,
    decode,
    decoded_counts,
    name_list,
    show,
)
from dlrmkit.request import Context, Floats, ParsedRequest, hot_request

_DENSE, _SPARSE = operator.attrgetter("dense"), operator.attrgetter("sparse")
_KEYS, _VALUES, _LENGTHS = (operator.attrgetter(a) for a in ("keys", "values", "lengths"))
_ROW_FORM = operator.attrgetter("float_features", "id_list_lengths", "id_list_values")
_ID_VALUES = operator.attrgetter("id_list_values")


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
        if isinstance(body, (bytes, bytearray, memoryview)) and len(body) >= FAST_MIN_BYTES:
            try:
                return self._parse(FAST_DECODER.decode(body), checked=False)
            except (msgspec.MsgspecError, RequestError, OverflowError):
                pass  # the strict pass below names the field
        return self._parse(decode(body), checked=True)

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
                raise BadRequest(
                    "instances: put every field inside the instances; no other top-level field is allowed beside it"
                )
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
        if len(rows) > c.requests.max_instances_per_request:
            raise PayloadTooLarge(
                f"{name}: at most {c.requests.max_instances_per_request} instances per request "
                f"(handler.max_instances_per_request), got {len(rows)}"
            )
        if len(rows) == 1:  # the common single-row request: no iterator chain
            r = rows[0]
            n_ids = shared_ids + (len(r.sparse.values) if r.sparse is not None else len(r.id_list_values or ()))
        else:
            n_ids = (
                shared_ids * len(rows)
                + sum(map(len, map(_VALUES, filter(None, map(_SPARSE, rows)))))
                + sum(map(len, filter(None, map(_ID_VALUES, rows))))
            )
        if n_ids > c.requests.max_ids_per_request:
            raise PayloadTooLarge(
                f"sparse.values: at most {c.requests.max_ids_per_request} ids per request "
                f"(handler.max_ids_per_request), got {n_ids}"
            )

    def _rows(
        self,
        rows: Sequence[Any],
        name: str,
        shared_dense: Floats | None,
        shared_features: Sequence[int],
        candidate: bool,
    ) -> ParsedRequest:
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
            values_field.append(
                self._add_row(
                    inst,
                    row,
                    f"{name}[{row}]." if name else "",
                    out,
                    shared_dense is not None,
                    shared_features,
                    candidate,
                )
            )

        def id_field(pos: int) -> str:
            row = bisect.bisect_right(value_start, pos) - 1
            return f"{f'{name}[{row}].' if name else ''}{values_field[row]}[{pos - value_start[row]}]"

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
                    dense = np.fromiter(
                        itertools.chain.from_iterable(dense_lists), np.float32, n * c.num_dense_features
                    )
            alike = all(map(lengths_lists[0].__eq__, lengths_lists))  # e.g. single-hot
            if not alike:
                lengths_lists = list(map(decoded_counts, lengths_lists))
            first = decoded_counts(lengths_lists[0])
            if alike:
                if len(first) != k or (k and min(first) < 0) or set(map(len, values_lists)) != {sum(first)}:
                    return None
                if k and set(first) == {1}:  # id j of a row is its key j's
                    values = np.fromiter(itertools.chain.from_iterable(values_lists), np.int64, n * k)
                    return hot_request(
                        n,
                        dense,
                        [(features, values.reshape(n, k).T, lambda j, row: f"{name}[{row}].sparse.values[{j}]")],
                    )
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

        return ParsedRequest(
            n,
            dense,
            values,
            np.tile(np.array(features, dtype=np.int64), n),
            lengths,
            np.repeat(np.arange(n, dtype=np.int64), k),
            id_field,
        )

    def _ranking(self, req: Any, row_fields: tuple) -> ParsedRequest:
        """``{"context": {...}, "candidates": [{...}, ...]}``: one row per candidate, each the
        context's features plus its own. E.g. context {dense: d, sparse: {user: [7]}} and
        candidates [{sparse: {item: [3]}}, {sparse: {item: [5]}}] are the rows
        {dense: d, user: [7], item: [3]} and {dense: d, user: [7], item: [5]}."""
        if req.instances is not None or any(v is not None for v in row_fields):
            raise BadRequest(
                "context: put every field inside context and candidates; no other top-level field "
                "is allowed beside them"
            )
        candidates = req.candidates
        if req.context is None:
            raise BadRequest(
                "context: required field is missing (the features all candidates share, "
                'e.g. {"dense": [...], "sparse": {...}})'
            )
        if candidates is None:
            raise BadRequest(
                "candidates: required field is missing (one object per item to score, "
                'e.g. [{"sparse": {...}}, ...], or columns: {...})'
            )
        if not candidates:
            raise BadRequest("candidates: expected a non-empty array of candidates, got []")
        ctx = self._context(req.context)
        self._check_sizes(candidates, "candidates", len(ctx.values))
        own = self._rows(candidates, "candidates", ctx.dense, ctx.features, candidate=True)
        if ctx.features and own.n > 1 and (own.onehot is not None or isinstance(own.seg_feature, np.ndarray)):
            # the common path skipped this
            sent = (
                own.onehot[0] if own.onehot is not None else own.seg_feature[: len(own.seg_feature) // own.n].tolist()
            )
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
            raise BadRequest(
                "columns: send columns alone or with a context; no other top-level field is allowed beside it"
            )
        c, cols = self.config, req.columns
        ctx = self._context(req.context) if req.context is not None else Context()
        sparse = cols.sparse or {}
        if cols.dense is not None:
            n, n_field = len(cols.dense), "columns.dense"
        elif sparse:
            key, bag = next(iter(sparse.items()))
            n, n_field = (
                (len(bag.values), f"columns.sparse.{key}.values")
                if bag.lengths is None
                else (len(bag.lengths), f"columns.sparse.{key}.lengths")
            )
        else:
            raise BadRequest(
                'columns: expected a dense and/or a sparse column, e.g. {"dense": [[...], ...], '
                '"sparse": {"<feature>": {"values": [...], "lengths": [...]}}}'
            )
        if n == 0:
            raise BadRequest(f"{n_field}: expected at least one row, got []")
        if n > c.requests.max_instances_per_request:
            raise PayloadTooLarge(
                f"{n_field}: at most {c.requests.max_instances_per_request} rows per request "
                f"(handler.max_instances_per_request), got {n}"
            )
        n_ids = sum(len(bag.values) for bag in sparse.values()) + n * len(ctx.values)
        if n_ids > c.requests.max_ids_per_request:
            raise PayloadTooLarge(
                f"columns.sparse: at most {c.requests.max_ids_per_request} ids per request "
                f"(handler.max_ids_per_request), got {n_ids}"
            )
        if cols.dense is not None:
            if ctx.dense is not None:
                raise BadRequest(
                    "columns.dense: context.dense is given already; send dense once in the context or as a column"
                )
            width = c.num_dense_features
            if set(map(len, cols.dense)) != {width}:
                j = next(j for j, row in enumerate(cols.dense) if len(row) != width)
                raise BadRequest(f"columns.dense[{j}]: expected {width} numbers, got {len(cols.dense[j])}")
            with np.errstate(over="ignore"):  # past float32: inf, which _check_ranges refuses
                dense = np.array(cols.dense, dtype=np.float32)
        elif ctx.dense is not None:
            dense = np.zeros((n, 0), dtype=np.float32)  # the context's, added by join
        else:
            raise BadRequest(
                "columns.dense: required field is missing (one array of "
                f"{c.num_dense_features} numbers per row, or once in context.dense)"
            )
        feats, names, value_lists, length_lists = [], [], [], []
        for key, bag in sparse.items():
            f = self.feature_index.get(key)
            where = f"columns.sparse.{key}"
            if f is None:
                raise BadRequest(
                    f"columns.sparse: unknown feature {show(key)}; expected one of {name_list(c.sparse_features, 32)}"
                )
            if f in ctx.features:
                raise BadRequest(
                    f"{where}: feature {show(key)} is also in context.sparse.keys; send each feature "
                    f"in the context or as a column, not both"
                )
            if bag.lengths is None and len(bag.values) != n:
                raise BadRequest(
                    f"{where}.values: expected one id per row ({n}) when {where}.lengths is left "
                    f"out, got {len(bag.values)}"
                )
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
            lengths = np.fromiter(
                itertools.chain.from_iterable(itertools.repeat(1, n) if x is None else x for x in length_lists),
                np.int64,
                k * n,
            )
            sums = lengths.reshape(k, n).sum(1)
            if (sums != counts).any():
                j = int(np.argmax(sums != counts))
                raise BadRequest(
                    f"{names[j]}.values: expected sum({names[j]}.lengths) = {int(sums[j])} ids, got {counts[j]}"
                )
            single_hot = bool((lengths == 1).all())
        dense = dense.reshape(-1)
        if single_hot:  # one id per row: the id of row r is at r
            return ctx.join(
                hot_request(n, dense, [(feats, values.reshape(k, n), lambda j, row: f"{names[j]}.values[{row}]")])
            )
        starts = list(itertools.accumulate(counts, initial=0))

        def id_field(pos: int) -> str:
            j = bisect.bisect_right(starts, pos) - 1
            return f"{names[j]}.values[{pos - starts[j]}]"

        return ctx.join(
            ParsedRequest(
                n,
                dense,
                values,
                np.repeat(np.array(feats, dtype=np.int64), n),
                lengths,
                np.tile(np.arange(n, dtype=np.int64), k),
                id_field,
            )
        )

    def _context(self, ctx: Any) -> Context:
        """The ``context`` of the ranking or columns form, checked."""
        for field, value in (
            ("float_features", ctx.float_features),
            ("id_list_features.lengths", ctx.id_list_lengths),
            ("id_list_features.values", ctx.id_list_values),
        ):
            if value is not None:
                raise BadRequest(f"context.{field}: the context takes dense and sparse")
        if ctx.dense is not None and len(ctx.dense) != self.config.num_dense_features:
            raise BadRequest(f"context.dense: expected {self.config.num_dense_features} numbers, got {len(ctx.dense)}")
        if ctx.sparse is None:
            return Context(ctx.dense)
        keys, values, lengths = ctx.sparse.keys, ctx.sparse.values, decoded_counts(ctx.sparse.lengths)
        features = self._features(keys, "context.")
        if len(lengths) != len(features):
            raise BadRequest(
                f"context.sparse.lengths: expected one length per key ({len(features)}), got {len(lengths)}"
            )
        if sum(lengths) != len(values):
            raise BadRequest(
                f"context.sparse.values: expected sum(context.sparse.lengths) = {sum(lengths)} ids, got {len(values)}"
            )
        return Context(ctx.dense, features, values, lengths)

    def _clash(self, cand: Any, row: int, shared: Sequence[int]) -> str:
        keys = self._key_list(cand.sparse.keys, f"candidates[{row}].")
        j = next(j for j, key in enumerate(keys) if self.feature_index[key] in shared)
        return (
            f"candidates[{row}].sparse.keys[{j}]: feature {show(keys[j])} is also in context.sparse.keys; "
            f"send each feature in the context or per candidate, not both"
        )

    def _add_row(
        self,
        inst: Any,
        row: int,
        p: str,
        out: ParsedRequest,
        shared_dense: bool,
        shared_features: Sequence[int],
        candidate: bool,
    ) -> str:
        """Append one instance's (or candidate's) row to ``out``; returns the name of its ids' field."""
        c = self.config
        if candidate and (
            inst.float_features is not None or inst.id_list_lengths is not None or inst.id_list_values is not None
        ):
            raise BadRequest(f"{p}float_features: the ranking form takes dense and sparse")
        if candidate or inst.sparse is not None or inst.dense is not None:
            if inst.float_features is not None or inst.id_list_lengths is not None or inst.id_list_values is not None:
                raise BadRequest(
                    f"{p}dense: use either dense + sparse or float_features + id_list_features.*, not both"
                )
            dense, dense_field = inst.dense, "dense"
            if shared_dense and dense is not None:
                raise BadRequest(
                    f"{p}dense: context.dense is given already; send dense once in the context or in every candidate"
                )
            if dense is None and not shared_dense:
                raise BadRequest(
                    f"{p}dense: required field is missing"
                    + (" (send it in every candidate or once in the context)" if candidate else "")
                )
            values_field, lengths_field = "sparse.values", "sparse.lengths"
            if inst.sparse is None:
                if not candidate:
                    raise BadRequest(
                        f'{p}sparse: required field is missing (expected {{"keys": [...], "values": [...], "lengths": [...]}})'
                    )
                keys, values, lengths, features = [], [], [], []
            else:
                keys, values, lengths = inst.sparse.keys, inst.sparse.values, decoded_counts(inst.sparse.lengths)
                features = self._features(keys, p)
                if len(lengths) != len(features):
                    raise BadRequest(
                        f"{p}sparse.lengths: expected one length per key ({len(features)}), got {len(lengths)}"
                    )
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
                    f"({c.num_features}: {name_list(c.sparse_features)}), got {len(lengths)}"
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
                return KEY_LIST.decode(keys)
            except msgspec.MsgspecError:
                raise Recheck(f"{p}sparse.keys: expected an array of feature names") from None
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
                    f"{p}sparse.keys[{j}]: unknown feature {show(key)}; expected one of "
                    f"{name_list(self.config.sparse_features, 32)}"
                )
            if f in features:
                raise BadRequest(f"{p}sparse.keys[{j}]: feature {show(key)} appears more than once")
            features.append(f)
        if len(self._known_keys) >= 1024:  # bounded: clients may send any key orders
            self._known_keys.clear()
        self._known_keys[cache_key] = features
        return features


def _check_ranges(out: ParsedRequest) -> None:
    """What the fast schema does not check: ids and lengths in 0..int64 max, dense within
    float32 (a larger number became inf). Raises Recheck (the strict pass names the field)."""
    if out.values is None:  # single-hot: lengths are all 1
        ids = out.onehot[1]
        if ids.size and ids.min() < 0:
            raise Recheck("values: out of range")
    for name in ("values", "seg_length") if out.values is not None else ():
        seq = getattr(out, name)
        if isinstance(seq, np.ndarray):  # int64 already: only the sign is left to check
            bad = len(seq) and seq.min() < 0
        else:
            bad = len(seq) and (min(seq) < 0 or max(seq) > INT64_MAX)
        if bad:
            raise Recheck(f"{name}: out of range")
    dense = out.dense
    if len(dense):
        if isinstance(dense, np.ndarray):
            bad = not np.isfinite(dense).all()
        else:
            bad = max(dense) > FLOAT32_MAX or min(dense) < -FLOAT32_MAX
        if bad:
            raise Recheck("dense: out of range")


def response_body(row_scores: list[float]) -> bytes:
    """``{"scores": [...]}``, plus ``"score"`` when the request has one row."""
    if len(row_scores) == 1:
        return msgspec.json.encode({"score": row_scores[0], "scores": row_scores})
    return msgspec.json.encode({"scores": row_scores})


def error_body(error: RequestError) -> bytes:
    return msgspec.json.encode(error.body())
