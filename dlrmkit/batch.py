"""The TorchServe-free core's batch half: collate the parsed requests of a batch, score them.

A request's way (dlrm_handler wires these, one TorchServe batch at a time)::

    open_request(body, route, ...)  dlrmkit.protocols    its protocol: /predictions JSON, Criteo TSV, KServe v1, OIP v2
    .parse()     -> ParsedRequest   dlrmkit.forms / dlrmkit.criteo / dlrmkit.protocols   raises RequestError (4xx)
    collate(requests) -> Batch, {idx: error}        here: one dense [B, F_dense] + one KeyedJaggedTensor
    scores(model, batch) -> [[score, ...], ...]     here: one forward (or parts at once: split_rows), split back per request
    .answer(scores) / .error(err) -> Reply          the protocol's body (dlrmkit.forms.response_body, ...)

The batch's KJT is key-major: with features (f0, f1) and rows b0 = {f0: [3, 4], f1: [7]},
b1 = {f0: [5]}, lengths are [2, 1 | 1, 0] and values [3, 4, 5 | 7].
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import itertools
from concurrent.futures import Executor, wait
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dlrmkit.config import DLRMConfig
from dlrmkit.cpus import PartsPool
from dlrmkit.errors import BadRequest, RequestError
from dlrmkit.request import ParsedRequest


@dataclass
class Batch:
    """Every row of the requests that passed: B rows, F features."""

    dense: torch.Tensor  # [B, F_dense] float32
    sparse: KeyedJaggedTensor  # keys in model order, key-major lengths [F * B], int64 values
    rows: list[int]  # rows per request, in order
    remapped_ids: int = 0  # ids folded by id_overflow: modulo


@dataclass
class RequestBatch:
    """One TorchServe batch on its way through the handler's preprocess, inference and postprocess:
    each step hands it to the next, so nothing of a batch is left on the handler."""

    requests: list[Any]  # per request: its protocol object (dlrmkit.protocols), which parses it and shapes its answer
    forwards: list[tuple[Batch, list[int]]]  # the good rows in groups, one forward each: (batch, its request indices)
    errors: dict[int, RequestError]  # request index -> why it fails (its own status and body)
    scores: dict[int, list[float]] = field(default_factory=dict)  # request index -> its scores, once scored


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
        if config.requests.id_overflow != "modulo":
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
    ids = requests[0].onehot[1] if len(requests) == 1 else np.concatenate([r.onehot[1] for r in requests], axis=1)
    if features and (ids >= _feature_rows(config, features)).any():
        return None
    B = ids.shape[1]
    lengths = np.zeros((config.num_features, B), dtype=np.int64)
    lengths[list(features)] = 1
    dense = (
        np.concatenate([np.asarray(r.dense, dtype=np.float32) for r in requests])
        if len(requests) > 1
        else np.asarray(requests[0].dense, dtype=np.float32)
    )
    kjt = KeyedJaggedTensor(
        keys=list(config.sparse_features),
        values=_on(torch.from_numpy(np.ascontiguousarray(ids).reshape(-1)), device),
        lengths=_on(torch.from_numpy(lengths.reshape(-1)), device),
    )
    return Batch(
        _on(torch.from_numpy(dense.reshape(B, config.num_dense_features)), device), kjt, [r.n for r in requests]
    )


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


def row_spans(rows: int, split_rows: int, most: int) -> list[tuple[int, int]]:
    """The [start, end) rows of each part a forward of ``rows`` rows runs as: ceil(rows /
    split_rows) parts of nearly equal size, at most ``most`` (``handler.split_rows``; 0 = one part).

    >>> row_spans(671, 350, 2), row_spans(350, 350, 2), row_spans(1400, 350, 2), row_spans(5, 0, 2)
    ([(0, 335), (335, 671)], [(0, 350)], [(0, 700), (700, 1400)], [(0, 5)])
    """
    n = min(most, -(-rows // split_rows)) if split_rows else 1
    bounds = [rows * k // n for k in range(n + 1)] if n > 1 else [0, rows]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a] or [(0, rows)]


def rows_of(kjt: KeyedJaggedTensor, start: int, end: int) -> KeyedJaggedTensor:
    """Rows [start, end) of a key-major KJT. F=2, B=3, lengths [1, 2, 0 | 0, 1, 1], values
    [a, b, c | d, e]: rows [1, 3) are lengths [2, 0 | 1, 1], values [b, c | d, e]."""
    b, f = kjt.stride(), len(kjt.keys())
    offsets = kjt.offsets().tolist()
    values, weights = kjt.values(), kjt.weights_or_none()
    spans = [(offsets[k * b + start], offsets[k * b + end]) for k in range(f)]
    return KeyedJaggedTensor(
        keys=kjt.keys(),
        values=torch.cat([values[x:y] for x, y in spans]),
        lengths=kjt.lengths().view(f, b)[:, start:end].reshape(-1),
        weights=None if weights is None else torch.cat([weights[x:y] for x, y in spans]),
    )


def _logits(model: torch.nn.Module, dense: torch.Tensor, sparse: KeyedJaggedTensor, config: DLRMConfig):
    with torch.inference_mode():  # per thread: a part on the pool's thread needs its own
        logits = model(dense, sparse).squeeze(1)
        if config.requests.output == "probability":
            logits = torch.sigmoid(logits)
        return logits.float().cpu()


def scores(
    model: torch.nn.Module, batch: Batch, config: DLRMConfig, pool: Executor | None = None, parts: int = 1
) -> list[list[float]]:
    """Forward the whole batch once; split its scores back per request.

    With ``pool`` and more than ``config.threads.split_rows`` rows, the forward runs as ``row_spans``'
    parts (at most ``parts``) at once: the first on this thread, the others on the pool's. Each row
    is scored on its own, so the parts' scores are the whole forward's (up to the rounding of
    another GEMM blocking where a part's size differs)."""
    if pool is None or len(spans := row_spans(batch.dense.shape[0], config.threads.split_rows, parts)) == 1:
        logits = _logits(model, batch.dense, batch.sparse, config)
    else:
        # a PartsPool holds this thread on its CPU and runs the other parts on the others
        with pool.apart() if isinstance(pool, PartsPool) else contextlib.nullcontext():
            later = [
                pool.submit(_logits, model, batch.dense[a:b], rows_of(batch.sparse, a, b), config) for a, b in spans[1:]
            ]
            try:
                (a, b) = spans[0]
                first = _logits(model, batch.dense[a:b], rows_of(batch.sparse, a, b), config)
            finally:  # never leave a part running on the model after this batch is answered
                wait(later)
        logits = torch.cat([first, *(f.result() for f in later)])
    flat = logits.tolist()
    out, start = [], 0
    for n in batch.rows:
        out.append(flat[start : start + n])
        start += n
    return out
