"""JSON request bodies -> typed structs, and msgspec's complaints -> messages naming the field.

The /predictions JSON forms (dlrmkit.forms reads their meaning) are decoded by msgspec straight from
bytes into the structs of ``_schema``: one pass, in C. A body that does not fit gets a BadRequest
whose message starts with the field's path, e.g. ``Expected `int` >= 0 - at `$.sparse.lengths[1]```
-> ``sparse.lengths[1]: expected a non-negative integer, got -1``.

    decode(body)          bytes, str or an already-decoded dict -> the strict Request struct
    FAST_DECODER          the hot path's schema (no bounds; key and lengths lists kept raw)
    show(value), name_list(names)   values and names as messages quote them
"""

from __future__ import annotations

import json
import math
import re
from typing import Annotated, Any, Sequence

import msgspec

from dlrmkit.config import INT64_MAX
from dlrmkit.errors import BadRequest

FLOAT32_MAX = 3.4028234663852886e38
MAX_KEY_CHARS = 256

# The request schema, decoded by msgspec straight from bytes. msgspec's strict mode already
# refuses booleans for numbers, fractional ids and lengths, NaN/Infinity literals, and non-UTF-8;
# the bounds below make it refuse negative lengths/ids, ids past int64 and floats past float32.
_Float32 = Annotated[float, msgspec.Meta(ge=-FLOAT32_MAX, le=FLOAT32_MAX)]
_Count = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]
_Key = Annotated[str, msgspec.Meta(max_length=MAX_KEY_CHARS)]


# The structs are made at run time (msgspec.defstruct), so they are typed Any where they stand in
# a type expression such as list[instance]: a static checker cannot know a class made by a call.
def _schema(Float: Any, Count: Any, Keys: Any, Bags: Any, Lengths: Any = None) -> type[msgspec.Struct]:
    """The request type: a row's fields, plus ``instances``, ``context`` + ``candidates``, or
    ``columns`` (with or without ``context``)."""

    def struct(name: str, fields: list, bases: tuple = ()) -> Any:
        return msgspec.defstruct(name, fields, bases=bases, forbid_unknown_fields=True)

    sparse = struct("Sparse", [("keys", Keys), ("values", list[Count]), ("lengths", Lengths or list[Count])])
    columns = struct("Columns", [("dense", list[list[Float]] | None, None), ("sparse", Bags | None, None)])
    instance: Any = struct(
        "Instance",
        [
            ("dense", list[Float] | None, None),
            ("sparse", sparse | None, None),
            ("float_features", list[Float] | None, None),
            ("id_list_lengths", list[Count] | None, msgspec.field(default=None, name="id_list_features.lengths")),
            ("id_list_values", list[Count] | None, msgspec.field(default=None, name="id_list_features.values")),
        ],
    )
    return struct(
        "Request",
        [
            ("instances", list[instance] | None, None),
            ("context", instance | None, None),
            ("candidates", list[instance] | None, None),
            ("columns", columns | None, None),
        ],
        bases=(instance,),
    )


def _bag(Count: Any) -> Any:
    """One feature's column: ``lengths`` (one per row; left out: one id per row) and ``values``."""
    return msgspec.defstruct(
        "Bag", [("values", list[Count]), ("lengths", list[Count] | None, None)], forbid_unknown_fields=True
    )


_Bag: Any = _bag(_Count)
_FastBag: Any = _bag(int)  # FAST_DECODER's
_Request = _schema(_Float32, _Count, list[_Key], dict[_Key, _Bag])
_DECODER: msgspec.json.Decoder[Any] = msgspec.json.Decoder(_Request)
# The hot path's schema: the same fields without the bounds (the parser checks ranges on the
# decoded arrays) and with each key list and lengths list kept as raw JSON (a key list is
# decoded and validated once per distinct list; rows whose lengths are byte-for-byte alike,
# as single-hot rows are, decode one of them): ~35% less decoding for a 128-row request. A
# request that any check refuses is parsed again with the strict schema, so every message is
# the strict one.
FAST_DECODER: msgspec.json.Decoder[Any] = msgspec.json.Decoder(
    _schema(float, int, msgspec.Raw, dict[str, _FastBag], msgspec.Raw)
)
_COUNTS = msgspec.json.Decoder(list[int])
FAST_MIN_BYTES = 4096
KEY_LIST = msgspec.json.Decoder(list[_Key])


def decoded_counts(lengths: list[int] | msgspec.Raw) -> list[int]:
    """A lengths list; from the fast schema, its raw JSON decoded (bounds: _check_ranges)."""
    return _COUNTS.decode(lengths) if isinstance(lengths, msgspec.Raw) else lengths


class Recheck(BadRequest):
    """A value the fast schema let through (e.g. a negative id): parse with the strict one."""


def decode(body: Any) -> Any:
    """A body as TorchServe hands it over -> the strict schema's Request; raises BadRequest."""
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
_PLAIN = re.compile(r"[\w.\-]+")  # a field name that reads as one in "<name>: unknown field"
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
        name = text[text.index("`") + 1 : text.rindex("`")]  # the whole name, backticks and all
        if not _PLAIN.fullmatch(name):  # e.g. "" or ": []": quoted where it sits (found by fuzzing)
            return f"{where or 'body'}: unknown field {show(name)}; expected {_expected_fields(where)}"
        return (
            f"{where + '.' if where else ''}{name[:MAX_KEY_CHARS]}: unknown field; expected {_expected_fields(where)}"
        )
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
    return show(obj)


def show(value: Any, limit: int = 64) -> str:
    """JSON text of a value, cut short; never raises."""
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=True)
    except (TypeError, ValueError, RecursionError):
        text = repr(value)
    if isinstance(value, float) and not math.isfinite(value):
        text = str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def name_list(names: Sequence[str], limit: int = 6) -> str:
    shown = ", ".join(names[:limit])
    return shown + (", ..." if len(names) > limit else "")


def _lower(text: str) -> str:
    """msgspec's sentence as a clause: "Input data was truncated" -> "input data was truncated";
    an acronym keeps its case ("JSON is malformed")."""
    word = text.split(" ", 1)[0]
    return text if len(word) > 1 and word.isupper() else text[:1].lower() + text[1:]
