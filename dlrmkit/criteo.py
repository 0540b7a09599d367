"""Criteo TSV lines -> the rows torchrec's Criteo preprocessing makes: ONE transform, imported by
the handler (``handler.raw_input: criteo_tsv``) and by scripts/train.py (``--tsv``).

A line is 40 tab-separated fields (the label first, ignored here) or 39 (no label): 13 integer
dense fields int_0..int_12, then 26 hex categorical fields; an empty field means 0. As
``torchrec.datasets.criteo.BinaryCriteoUtils.tsv_to_npys`` does::

    dense = np.log(x + dense_shift, dtype=np.float32)      # tsv_to_npys: dense_shift = 2 - min(x)
    ids   = int(field, 16)                                  # then % num_embeddings (torchrec's
                                                            # ``hashes``): the config's id_overflow

E.g. with dense_shift 3 the line ``1 \\t 5 \\t (11 more) \\t 0a \\t (25 more)`` has dense[0] =
ln(8) and cat_0 id 10. ``x + dense_shift`` below 2 (below the training minimum) is clipped to 2:
never NaN or -inf. Parsing is vectorised over bytes (no Python loop per field or line).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from dlrmkit.errors import BadRequest

NUM_DENSE, NUM_CAT = 13, 26  # torchrec.datasets.criteo.INT_FEATURE_COUNT, CAT_FEATURE_COUNT
DENSE_NAMES = tuple(f"int_{i}" for i in range(NUM_DENSE))  # torchrec's DEFAULT_INT_NAMES
CAT_NAMES = tuple(f"cat_{i}" for i in range(NUM_CAT))  # torchrec's DEFAULT_CAT_NAMES
CONTENT_TYPE = "text/tab-separated-values"
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1  # tsv_to_npys holds dense as int32
INT64_MAX = 2**63 - 1
MIN_SHIFTED = 2  # tsv_to_npys maps the training minimum to 2 (ln 2)

# Byte -> digit value; 99 for a byte that is not a digit of that base.
_HEX = np.full(256, 99, dtype=np.uint64)
_HEX[np.frombuffer(b"0123456789", np.uint8)] = np.arange(10, dtype=np.uint64)
_HEX[np.frombuffer(b"abcdef", np.uint8)] = np.arange(10, 16, dtype=np.uint64)
_HEX[np.frombuffer(b"ABCDEF", np.uint8)] = np.arange(10, 16, dtype=np.uint64)
_DEC = np.full(256, 99, dtype=np.int64)
_DEC[np.frombuffer(b"0123456789", np.uint8)] = np.arange(10)


@dataclass
class Lines:
    """n parsed lines: ``dense`` int64 ``[n, 13]`` (the raw counts), ``ids`` int64 ``[n, 26]``
    (before folding), ``labels`` int64 ``[n]`` (-1 where a line has none)."""

    dense: np.ndarray
    ids: np.ndarray
    labels: np.ndarray

    def __len__(self) -> int:
        return len(self.labels)


def to_bytes(body: str | bytes | bytearray | memoryview | None) -> bytes:
    """The body as UTF-8 bytes; raises BadRequest naming the line of an invalid byte.

    TorchServe hands a ``text/*`` body over as str, or as bytes when it is not valid UTF-8."""
    if body is None:
        raise BadRequest(_EMPTY)
    if isinstance(body, str):
        return body.encode("utf-8", "surrogatepass")
    raw = bytes(body)
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as u:
        line = raw.count(b"\n", 0, u.start) + 1
        col = u.start - (raw.rfind(b"\n", 0, u.start) + 1)
        field = raw.count(b"\t", u.start - col, u.start) + 1
        raise BadRequest(
            f"line {line}, field {field}: expected UTF-8 text, got the invalid byte 0x{raw[u.start]:02x}"
        ) from None
    return raw


_EMPTY = (
    f"body: expected Criteo TSV lines ({NUM_DENSE + NUM_CAT} tab-separated fields, or "
    f"{NUM_DENSE + NUM_CAT + 1} with the label first), got an empty body"
)


def count_lines(raw: bytes) -> int:
    """Lines in a body (a final newline ends the last line, it does not start another)."""
    raw = raw.rstrip(b"\r\n")
    return raw.count(b"\n") + 1 if raw else 0


def parse(raw: bytes, cat_names: Sequence[str] = CAT_NAMES, first_line: int = 1) -> Lines:
    """Criteo lines (UTF-8 bytes, ``\\n`` or ``\\r\\n`` ends) -> Lines. Raises BadRequest naming
    the first bad field, e.g. ``line 3, field 21 (cat_7): expected hex digits, got 'zz12'``.
    ``cat_names``: the categorical fields' names in messages; ``first_line``: the number of the
    first line (a chunk of a file)."""
    raw = raw.rstrip(b"\r\n")
    if not raw:
        raise BadRequest(_EMPTY)
    if b"\r" in raw:
        raw = raw.replace(b"\r\n", b"\n")  # a lone \r stays, and is refused as a field's byte
    a = np.frombuffer(raw, dtype=np.uint8)
    seps = np.flatnonzero((a == 9) | (a == 10))
    starts = np.concatenate(([0], seps + 1))
    ends = np.concatenate((seps, [len(a)]))
    line_of = np.concatenate(([0], np.cumsum(a[seps] == 10)))  # the line of each field
    n = int(line_of[-1]) + 1
    counts = np.bincount(line_of, minlength=n)
    wide = NUM_DENSE + NUM_CAT
    bad = (counts != wide) & (counts != wide + 1)
    if bad.any():
        i = int(np.argmax(bad))
        raise BadRequest(
            f"line {first_line + i}: expected {wide} tab-separated fields ({NUM_DENSE} integers, "
            f"{NUM_CAT} hex ids) or {wide + 1} (the label first), got {int(counts[i])}"
        )
    label = (counts == wide + 1).astype(np.int64)
    first = np.cumsum(counts) - counts  # each line's first field
    col = first[:, None] + label[:, None] + np.arange(wide)[None, :]  # [n, 39]: the 39 feature fields
    dense, dense_bad = _decimal(a, starts[col[:, :NUM_DENSE]], ends[col[:, :NUM_DENSE]])
    ids, ids_bad = _hex(a, starts[col[:, NUM_DENSE:]], ends[col[:, NUM_DENSE:]])
    if dense_bad is not None or ids_bad is not None:
        bad = np.concatenate(
            [
                dense_bad if dense_bad is not None else np.zeros_like(col[:, :NUM_DENSE], bool),
                ids_bad if ids_bad is not None else np.zeros_like(col[:, NUM_DENSE:], bool),
            ],
            axis=1,
        )
        i, j = divmod(int(np.argmax(bad.reshape(-1))), wide)
        s, e = int(starts[col[i, j]]), int(ends[col[i, j]])
        text = raw[s:e].decode("utf-8", "replace")
        shown = repr(text if len(text) <= 32 else text[:29] + "...")
        if j < NUM_DENSE:
            what = (
                "expected an integer that fits int32 (torchrec's dense dtype)"
                if _is_decimal(text)
                else "expected an integer"
            )
            name = DENSE_NAMES[j]
        else:
            what = (
                "expected a hex id that fits int64 (at most 7fffffffffffffff)"
                if _is_hex(text)
                else "expected hex digits"
            )
            name = cat_names[j - NUM_DENSE]
        raise BadRequest(f"line {first_line + i}, field {j + 1 + int(label[i])} ({name}): {what}, got {shown}")
    labels = np.full(n, -1, dtype=np.int64)
    if label.any():
        got, lbad = _decimal(a, starts[first[label == 1]], ends[first[label == 1]])
        labels[label == 1] = np.where(lbad, -1, got) if lbad is not None else got
    return Lines(dense, ids, labels)


def _is_decimal(text: str) -> bool:
    digits = text[1:] if text[:1] in "+-" else text
    return digits.isascii() and digits.isdigit()


def _is_hex(text: str) -> bool:
    return bool(text) and text.isascii() and all(c in "0123456789abcdefABCDEF" for c in text)


def _chars(a: np.ndarray, starts: np.ndarray, ends: np.ndarray, width: int):
    """The fields' bytes right-aligned in ``[..., width]`` (0 to the left), their mask, and
    which fields are longer than ``width``."""
    lengths = ends - starts
    too_long = lengths > width
    lengths = np.minimum(lengths, width)
    # As wide as the longest field only (Criteo ids: 8 hex digits): half the work of 16.
    width = max(1, int(lengths.max())) if lengths.size else 1
    pos = np.arange(width) - width  # -width .. -1, from the field's end
    mask = pos >= -lengths[..., None]
    idx = np.where(mask, ends[..., None] + pos, 0)
    return a[idx], mask, too_long


def _decimal(a: np.ndarray, starts: np.ndarray, ends: np.ndarray):
    """Signed decimal fields (empty = 0) that fit int32 -> (int64 values, bad mask or None)."""
    chars, mask, bad = _chars(a, starts, ends, 11)  # sign + 10 digits
    w = chars.shape[-1]
    lead = np.arange(w) - w == -np.minimum(ends - starts, w)[..., None]  # each field's first byte
    signed = lead & ((chars == ord("-")) | (chars == ord("+")))
    digits = _DEC[chars]
    bad = bad | ((digits == 99) & mask & ~signed).any(-1)
    bad |= signed.any(-1) & (ends - starts == 1)  # a sign alone
    powers = 10 ** np.arange(w - 1, -1, -1, dtype=np.int64)
    value = (np.where(mask & ~signed & (digits != 99), digits, 0) * powers).sum(-1)
    value = np.where((signed & (chars == ord("-"))).any(-1), -value, value)
    bad |= (value < INT32_MIN) | (value > INT32_MAX)
    return value, (bad if bad.any() else None)


def _hex(a: np.ndarray, starts: np.ndarray, ends: np.ndarray):
    """Hex fields (empty = 0) that fit int64 -> (int64 values, bad mask or None)."""
    chars, mask, bad = _chars(a, starts, ends, 16)
    digits = _HEX[chars]
    bad = bad | ((digits == 99) & mask).any(-1)
    w = chars.shape[-1]
    if w == 16:  # 16 digits: past int64 from 8000000000000000 on
        bad |= mask[..., 0] & (digits[..., 0] >= 8) & (digits[..., 0] != 99)
    powers = np.uint64(16) ** np.arange(w - 1, -1, -1, dtype=np.uint64)
    value = (np.where(mask & (digits != 99), digits, np.uint64(0)) * powers).sum(-1, dtype=np.uint64)
    value = np.where(bad, np.uint64(0), value).astype(np.int64)
    return value, (bad if bad.any() else None)


def dense_features(dense: np.ndarray, dense_shift: float) -> tuple[np.ndarray, int]:
    """Raw counts ``[n, 13]`` -> (float32 ``ln(max(x + dense_shift, 2))``, how many were clipped).

    tsv_to_npys computes ``np.log(int32(x - min + 2), dtype=float32)``: the sum is exact in
    float64 here (|x + shift| < 2**53), then rounded to float32 like its int32 -> float32 cast."""
    shifted = dense.astype(np.float64) + dense_shift
    low = shifted < MIN_SHIFTED
    clipped = int(low.sum())
    if clipped:
        shifted[low] = MIN_SHIFTED
    return np.log(shifted.astype(np.float32), dtype=np.float32), clipped


def fit_dense_shift(path: str | Path, chunk_bytes: int = 64 << 20, progress=None) -> tuple[int, int]:
    """``dense_shift`` as tsv_to_npys computes it for one file: ``2 - min`` over all 13 dense
    columns of every line (missing = 0). Returns (dense_shift, lines). Streams the file."""
    low, lines = None, 0
    for first_line, chunk in _chunks(Path(path), chunk_bytes):
        try:
            parsed = parse(chunk, first_line=first_line)
        except BadRequest as e:
            raise BadRequest(f"{path}: {e.message}") from None
        m = int(parsed.dense.min())
        low = m if low is None else min(low, m)
        lines += len(parsed)
        if progress:
            progress(lines)
    if low is None:
        raise BadRequest(f"{path}: no lines")
    return MIN_SHIFTED - low, lines


def read_file(path: str | Path, chunk_bytes: int = 64 << 20) -> Lines:
    """Every line of a TSV file, parsed."""
    parts = [parse(chunk, first_line=first) for first, chunk in _chunks(Path(path), chunk_bytes)]
    return Lines(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("dense", "ids", "labels")))


def _chunks(path: Path, chunk_bytes: int) -> Iterator[tuple[int, bytes]]:
    """(number of its first line, whole lines) of about chunk_bytes each."""
    line, rest = 1, b""
    with path.open("rb") as f:
        while True:
            block = f.read(chunk_bytes)
            data = rest + block
            if not block:
                if data.strip(b"\r\n"):
                    yield line, to_bytes(data)
                return
            cut = data.rfind(b"\n") + 1
            if cut:
                yield line, to_bytes(data[:cut])
                line += data.count(b"\n", 0, cut)
                rest = data[cut:]
            else:
                rest = data
