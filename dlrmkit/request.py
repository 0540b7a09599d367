"""One request as collation reads it: ``ParsedRequest`` (ids and their bags, no tensors yet).

Every request form and protocol (dlrmkit.forms, dlrmkit.protocols) parses into this one type, so requests
of every kind share one collate and one forward pass (dlrmkit.batch). ``Context`` holds the features
a ranking or columns request shares across its rows; ``hot_request`` lays out single-hot rows.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from dlrmkit.errors import BadRequest

# A column of floats or ids: a list while a parser appends to it, an array once laid out in
# numpy (an ndarray is no typing.Sequence, and a union of the two would allow neither's methods).
Floats = Any
Ints = Any


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
    dense: Floats  # n * F_dense floats, row-major
    values: Ints | None
    seg_feature: Ints | None
    seg_length: Ints | None
    seg_row: Ints | None
    # For error messages only: the position of an id in ``values`` -> the field that holds it,
    # e.g. "instances[1].sparse.values[0]".
    id_field: Callable[[int], str] = str
    onehot: tuple[tuple[int, ...], np.ndarray] | None = None

    def segments(self) -> ParsedRequest:
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
    def single_hot(cls, dense: np.ndarray, ids: Mapping[int, np.ndarray], fields: Mapping[int, str]) -> ParsedRequest:
        """n rows with one id per row of each feature sent: ``dense`` ``[n, F_dense]``,
        ``ids[f]`` ``[n]`` (any integer dtype), ``fields[f]`` its name for messages. Raises
        BadRequest naming a negative id, e.g. ``feature_1[3]: expected a non-negative integer``."""
        n, feats = int(dense.shape[0]), list(ids)
        matrix = (
            np.stack([ids[f] for f in feats]).astype(np.int64, copy=False)
            if feats
            else np.zeros((0, n), dtype=np.int64)
        )
        return cls.single_hot_matrix(dense, feats, matrix, [fields[f] for f in feats])

    @classmethod
    def single_hot_matrix(
        cls, dense: np.ndarray, features: Sequence[int], ids: np.ndarray, names: Sequence[str]
    ) -> ParsedRequest:
        """single_hot's rows with the ids already in one int64 ``[k, n]`` array: row j holds
        the ids of features[j], named ``names[j]`` in messages (features in any order)."""
        n = int(dense.shape[0])
        if ids.size and int(ids.min()) < 0:
            j, row = divmod(int(np.argmax(ids.reshape(-1) < 0)), n)
            raise BadRequest(f"{names[j]}[{row}]: expected a non-negative integer, got {int(ids[j, row])}")
        return hot_request(
            n,
            np.ascontiguousarray(dense, dtype=np.float32).reshape(-1),
            [(features, ids, lambda j, row: f"{names[j]}[{row}]")],
        )

    @classmethod
    def columnar(
        cls,
        dense: np.ndarray,
        bags: Mapping[int, tuple[np.ndarray, np.ndarray]],
        fields: Mapping[int, tuple[str, str]],
    ) -> ParsedRequest:
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
                raise BadRequest(
                    f"{lengths_field}[{int(np.argmax(lengths < 0))}]: expected a non-negative integer, "
                    f"got {int(lengths[lengths < 0][0])}"
                )
            total = int(lengths.sum())
            single_hot = single_hot and shortest == 1 and total == n  # then every length is 1
            if values.shape != (total,):
                raise BadRequest(
                    f"{values_field}: expected sum({lengths_field}) = {total} ids, got shape {list(values.shape)}"
                )
            if total and int(values.min()) < 0:
                raise BadRequest(
                    f"{values_field}[{int(np.argmax(values < 0))}]: expected a non-negative integer, "
                    f"got {int(values[values < 0][0])}"
                )
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
class Context:
    """The features every row of a ranking or columns request shares, sent once."""

    dense: Floats | None = None
    features: Sequence[int] = ()
    values: Ints = ()
    lengths: Ints = ()

    def join(self, own: ParsedRequest) -> ParsedRequest:
        """``own``'s rows, each with the context's dense (when ``own`` has none) and sparse
        features added."""
        n, k = own.n, len(self.features)
        dense = own.dense if self.dense is None else self.dense_rows(n)
        if not k:
            return ParsedRequest(
                n, dense, own.values, own.seg_feature, own.seg_length, own.seg_row, own.id_field, own.onehot
            )
        if own.onehot is not None and self.single_hot():
            own_features, own_ids = own.onehot
            return hot_request(
                n, dense, [(own_features, own_ids, lambda j, row: own.id_field(j * n + row)), self.part()]
            )
        own.segments()
        n_ctx, n_own = len(self.values), len(own.values)

        def id_field(pos: int) -> str:
            if pos < n_own:
                return own.id_field(pos)
            return f"context.sparse.values[{(pos - n_own) % n_ctx}]"

        return ParsedRequest(
            n,
            dense,
            np.concatenate(
                [np.asarray(own.values, dtype=np.int64), np.tile(np.asarray(self.values, dtype=np.int64), n)]
            ),
            np.concatenate(
                [np.asarray(own.seg_feature, dtype=np.int64), np.tile(np.array(self.features, dtype=np.int64), n)]
            ),
            np.concatenate(
                [np.asarray(own.seg_length, dtype=np.int64), np.tile(np.asarray(self.lengths, dtype=np.int64), n)]
            ),
            np.concatenate([np.asarray(own.seg_row, dtype=np.int64), np.repeat(np.arange(n, dtype=np.int64), k)]),
            id_field,
        )

    def single_hot(self) -> bool:
        return all(x == 1 for x in self.lengths)

    def dense_rows(self, n: int) -> np.ndarray:
        """The context's dense, once per row, row-major."""
        return np.asarray(self.dense, dtype=np.float32)[None, :].repeat(n, axis=0).reshape(-1)

    def part(self) -> tuple:
        """The context as a part of hot_request (single-hot: id j is key j's)."""
        return (self.features, np.asarray(self.values, dtype=np.int64), lambda j, row: f"context.sparse.values[{j}]")


def hot_request(n: int, dense: Floats, parts: Sequence[tuple]) -> ParsedRequest:
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
