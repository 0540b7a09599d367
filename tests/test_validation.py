"""Every rejection: the exact status, and a message that names the field and what was expected."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import tiny_config
from dlrmkit.batch import collate
from dlrmkit.forms import RequestParser
from dlrmkit.errors import RequestError
from helpers import DENSE, instance

OK = instance(DENSE, feature_0=[1], feature_1=[2, 3], feature_2=[4])


def js(obj) -> bytes:
    return json.dumps(obj).encode()


def with_sparse(**sparse):
    return js({"dense": DENSE, "sparse": {"keys": ["feature_0"], "values": [1], "lengths": [1], **sparse}})


def ranking(cands, ctx_sparse=None, cand_dense=None) -> dict:
    """A ranking-form request: context dense (and ``ctx_sparse`` bags), one candidate per
    bags dict in ``cands`` (``cand_dense``: the dense every candidate sends too)."""
    ctx = instance(DENSE, **(ctx_sparse or {}))
    if not ctx_sparse:
        del ctx["sparse"]
    out = []
    for bags in cands:
        c = instance(cand_dense or [], **bags)
        if cand_dense is None:
            del c["dense"]
        out.append(c)
    return {"context": ctx, "candidates": out}


def columns(**bags) -> dict:
    """A two-row columns-form request: columns(feature_0=([2, 1], [3, 4, 5])); lengths None:
    left out (one id per row)."""
    sparse = {
        f: {"values": v} if lengths is None else {"values": v, "lengths": lengths} for f, (lengths, v) in bags.items()
    }
    return {"columns": {"dense": [DENSE, DENSE], "sparse": sparse}}


# (case, body, status, the message starts with, and contains)
CASES = [
    ("not json", b"dense=1", 400, "body:", "malformed JSON"),
    ("not utf-8", b'{"dense": "\xff\xfe"}', 400, "body:", "UTF-8"),
    ("empty", b"", 400, "body:", "empty body"),
    ("whitespace only", b"  \n", 400, "body:", "empty body"),
    ("deeply nested", b"[" * 100_000 + b"]" * 100_000, 400, "body:", "expected a JSON object"),
    ("nested in instances", b'{"instances": ' + b"[" * 50_000, 400, "instances[0]:", "expected a JSON object"),
    ("top level array", b"[1, 2]", 400, "body:", "expected a JSON object, got [1, 2]"),
    ("top level string", b'"hi"', 400, "body:", "expected a JSON object"),
    ("trailing garbage", js(OK) + b" x", 400, "body:", "malformed JSON"),
    ("unknown top-level field", js({**OK, "dnese": [1]}), 400, "dnese:", "unknown field"),
    ("missing dense", js({"sparse": OK["sparse"]}), 400, "dense:", "required field is missing"),
    ("missing sparse", js({"dense": DENSE}), 400, "sparse:", "required field is missing"),
    ("dense not array", js({**OK, "dense": "1,2"}), 400, "dense:", 'expected an array, got "1,2"'),
    ("dense wrong count", js({**OK, "dense": [1, 2]}), 400, "dense:", "expected 5 numbers, got 2"),
    ("dense string item", js({**OK, "dense": [1, 2, "3", 4, 5]}), 400, "dense[2]:", 'expected a number, got "3"'),
    ("dense boolean", js({**OK, "dense": [1, 2, True, 4, 5]}), 400, "dense[2]:", "expected a number, got true"),
    (
        "dense NaN",
        b'{"dense": [1, NaN, 1, 1, 1], "sparse": {"keys": [], "values": [], "lengths": []}}',
        400,
        "dense[1]:",
        "NaN and Infinity are not numbers in JSON; send a finite number",
    ),
    (
        "dense Infinity",
        b'{"dense": [Infinity, 1, 1, 1, 1], "sparse": {"keys": [], "values": [], "lengths": []}}',
        400,
        "dense[0]:",
        "NaN and Infinity are not numbers in JSON; send a finite number",
    ),
    (
        "dense -Infinity",
        b'{"dense": [1, 1, 1, 1, -Infinity], "sparse": {"keys": [], "values": [], "lengths": []}}',
        400,
        "dense[4]:",
        "NaN and Infinity are not numbers in JSON",
    ),
    (
        "instance dense nan",
        b'{"instances": [{"dense": [1, 1, nan, 1, 1], "sparse": {"keys": [], "values": [], "lengths": []}}]}',
        400,
        "instances[0].dense[2]:",
        "NaN and Infinity",
    ),
    (
        "id NaN",
        b'{"dense": [1, 1, 1, 1, 1], "sparse": {"keys": ["feature_0"], "values": [NaN], "lengths": [1]}}',
        400,
        "sparse.values[0]:",
        "NaN and Infinity",
    ),
    ("malformed JSON keeps acronyms", b'{"dense": [1] x', 400, "body:", "(JSON is malformed: expected"),
    (
        "dense overflows float64",
        b'{"dense": [1e999, 1, 1, 1, 1], "sparse": {"keys": [], "values": [], "lengths": []}}',
        400,
        "dense[0]:",
        "float32",
    ),
    ("dense overflows float32", js({**OK, "dense": [1, 1, 1, 1, -1e39]}), 400, "dense[4]:", "float32"),
    ("sparse not object", js({"dense": DENSE, "sparse": [1]}), 400, "sparse:", "expected an object"),
    ("sparse unknown field", with_sparse(ids=[1]), 400, "sparse.ids:", "expected keys, values, lengths"),
    (
        "keys missing",
        js({"dense": DENSE, "sparse": {"values": [1], "lengths": [1]}}),
        400,
        "sparse.keys:",
        "required field is missing",
    ),
    (
        "values missing",
        js({"dense": DENSE, "sparse": {"keys": ["feature_0"], "lengths": [1]}}),
        400,
        "sparse.values:",
        "required field is missing",
    ),
    (
        "lengths missing",
        js({"dense": DENSE, "sparse": {"keys": ["feature_0"], "values": [1]}}),
        400,
        "sparse.lengths:",
        "required field is missing",
    ),
    ("keys not array", with_sparse(keys="feature_0"), 400, "sparse.keys:", "expected an array"),
    ("key not string", with_sparse(keys=[0]), 400, "sparse.keys[0]:", "expected a string, got 0"),
    ("values not array", with_sparse(values=1), 400, "sparse.values:", "expected an array, got 1"),
    ("lengths not array", with_sparse(lengths={"a": 1}), 400, "sparse.lengths:", "expected an array"),
    ("keys/lengths mismatch", with_sparse(lengths=[1, 0]), 400, "sparse.lengths:", "one length per key (1), got 2"),
    (
        "sum(lengths) != len(values)",
        with_sparse(values=[1, 2]),
        400,
        "sparse.values:",
        "sum(sparse.lengths) = 1 ids, got 2",
    ),
    (
        "negative length",
        with_sparse(lengths=[-1], values=[]),
        400,
        "sparse.lengths[0]:",
        "expected a non-negative integer, got -1",
    ),
    ("fractional length", with_sparse(lengths=[1.5]), 400, "sparse.lengths[0]:", "expected an integer, got 1.5"),
    ("string length", with_sparse(lengths=["1"]), 400, "sparse.lengths[0]:", 'expected an integer, got "1"'),
    ("boolean length", with_sparse(lengths=[True]), 400, "sparse.lengths[0]:", "expected an integer, got true"),
    ("negative id", with_sparse(values=[-1]), 400, "sparse.values[0]:", "expected a non-negative integer, got -1"),
    ("fractional id", with_sparse(values=[1.0]), 400, "sparse.values[0]:", "expected an integer, got 1.0"),
    ("string id", with_sparse(values=["1"]), 400, "sparse.values[0]:", 'expected an integer, got "1"'),
    ("boolean id", with_sparse(values=[True]), 400, "sparse.values[0]:", "expected an integer, got true"),
    ("null id", with_sparse(values=[None]), 400, "sparse.values[0]:", "expected an integer, got null"),
    (
        "id past int64",
        b'{"dense": [1,1,1,1,1], "sparse": {"keys": ["feature_0"], "values": [9223372036854775808], "lengths": [1]}}',
        400,
        "sparse.values[0]:",
        "fits int64",
    ),
    (
        "id past uint64",
        b'{"dense": [1,1,1,1,1], "sparse": {"keys": ["feature_0"], "values": [99999999999999999999999], "lengths": [1]}}',
        400,
        "sparse.values[0]:",
        "fits int64",
    ),
    (
        "unknown key",
        with_sparse(keys=["feature_9"]),
        400,
        "sparse.keys[0]:",
        'unknown feature "feature_9"; expected one of feature_0, feature_1, feature_2',
    ),
    (
        "duplicate key",
        with_sparse(keys=["feature_0", "feature_0"], values=[1, 2], lengths=[1, 1]),
        400,
        "sparse.keys[1]:",
        "appears more than once",
    ),
    ("non-ascii key", with_sparse(keys=["féature_0"]), 400, "sparse.keys[0]:", 'unknown feature "féature_0"'),
    ("absurdly long key", with_sparse(keys=["k" * 100_000]), 400, "sparse.keys[0]:", "at most 256 characters"),
    (
        "id == rows",
        with_sparse(values=[20]),
        400,
        "sparse.values[0]:",
        "id 20 is out of range for feature 'feature_0' (table of 20 rows: expected 0..19",
    ),
    (
        "id >> rows",
        js(instance(DENSE, feature_0=[1], feature_2=[3, 4000])),
        400,
        "sparse.values[2]:",
        "id 4000 is out of range for feature 'feature_2'",
    ),
    ("empty instances", js({"instances": []}), 400, "instances:", "non-empty array"),
    ("instances not array", js({"instances": {"dense": DENSE}}), 400, "instances:", "expected an array"),
    (
        "instances with top-level dense",
        js({"instances": [OK], "dense": DENSE}),
        400,
        "instances:",
        "no other top-level field",
    ),
    ("instance not object", js({"instances": [OK, 5]}), 400, "instances[1]:", "expected a JSON object, got 5"),
    (
        "instance bad dense",
        js({"instances": [OK, {**OK, "dense": [1]}]}),
        400,
        "instances[1].dense:",
        "expected 5 numbers, got 1",
    ),
    ("instance unknown field", js({"instances": [OK, {**OK, "x": 1}]}), 400, "instances[1].x:", "unknown field"),
    (
        "instance missing sparse",
        js({"instances": [OK, {"dense": DENSE}]}),
        400,
        "instances[1].sparse:",
        "required field is missing",
    ),
    (
        "instance bad id",
        js({"instances": [OK, OK, instance(DENSE, feature_1=[1, 30])]}),
        400,
        "instances[2].sparse.values[1]:",
        "id 30 is out of range for feature 'feature_1'",
    ),
    ("nested instances", js({"instances": [{"instances": [OK]}]}), 400, "instances[0].instances:", "unknown field"),
    (
        "too many instances",
        js({"instances": [OK] * 9}),
        413,
        "instances:",
        "at most 8 instances per request (handler.max_instances_per_request), got 9",
    ),
    (
        "too many ids",
        js(instance(DENSE, feature_0=[1] * 65)),
        413,
        "sparse.values:",
        "at most 64 ids per request (handler.max_ids_per_request), got 65",
    ),
    (
        "too many ids across instances",
        js({"instances": [instance(DENSE, feature_0=[1] * 40)] * 2}),
        413,
        "sparse.values:",
        "got 80",
    ),
    (
        "criteo lengths count",
        js({"float_features": DENSE, "id_list_features.lengths": [1], "id_list_features.values": [1]}),
        400,
        "id_list_features.lengths:",
        "one length per sparse feature in model order (3",
    ),
    (
        "criteo values missing",
        js({"float_features": DENSE, "id_list_features.lengths": [0, 0, 0]}),
        400,
        "id_list_features.values:",
        "required field is missing",
    ),
    (
        "criteo float count",
        js({"float_features": [1], "id_list_features.lengths": [0, 0, 0], "id_list_features.values": []}),
        400,
        "float_features:",
        "expected 5 numbers, got 1",
    ),
    (
        "criteo bad id",
        js({"float_features": DENSE, "id_list_features.lengths": [0, 1, 1], "id_list_features.values": [3, 40]}),
        400,
        "id_list_features.values[1]:",
        "id 40 is out of range for feature 'feature_2'",
    ),
    ("mixed forms", js({**OK, "float_features": DENSE}), 400, "dense:", "not both"),
    # the ranking form: {"context": {...}, "candidates": [...]}
    (
        "feature in context and candidate",
        js(ranking(ctx_sparse={"feature_1": [2]}, cands=[{"feature_0": [1]}, {"feature_1": [3], "feature_2": [4]}])),
        400,
        "candidates[1].sparse.keys[0]:",
        'feature "feature_1" is also in context.sparse.keys',
    ),
    (
        "feature in context and all candidates",
        js(ranking(ctx_sparse={"feature_1": [2]}, cands=[{"feature_2": [1], "feature_1": [2]}] * 3)),
        400,
        "candidates[0].sparse.keys[1]:",
        'feature "feature_1" is also in context.sparse.keys',
    ),
    (
        "dense in context and candidate",
        js(ranking(cands=[{"feature_0": [1]}, {"feature_0": [1]}], cand_dense=[1])),
        400,
        "candidates[0].dense:",
        "context.dense is given already",
    ),
    (
        "dense nowhere",
        js({"context": {}, "candidates": [instance(DENSE, feature_0=[1]), {"sparse": OK["sparse"]}]}),
        400,
        "candidates[1].dense:",
        "required field is missing",
    ),
    (
        "context dense count",
        js({"context": {"dense": [1]}, "candidates": [{}]}),
        400,
        "context.dense:",
        "expected 5 numbers, got 1",
    ),
    ("context missing", js({"candidates": [OK]}), 400, "context:", "required field is missing"),
    ("candidates missing", js({"context": OK}), 400, "candidates:", "required field is missing"),
    ("no candidates", js({"context": OK, "candidates": []}), 400, "candidates:", "non-empty"),
    ("ranking beside row fields", js({**OK, "context": {}, "candidates": [{}]}), 400, "context:", "no other top-level"),
    (
        "candidate negative id",
        js(ranking(cands=[{"feature_0": [1]}, {"feature_0": [-1]}])),
        400,
        "candidates[1].sparse.values[0]:",
        "expected a non-negative integer, got -1",
    ),
    (
        "candidate id out of range",
        js(ranking(cands=[{"feature_0": [1]}, {"feature_0": [2, 20]}])),
        400,
        "candidates[1].sparse.values[1]:",
        "id 20 is out of range for feature 'feature_0'",
    ),
    (
        "context id out of range",
        js(ranking(ctx_sparse={"feature_2": [4, 40]}, cands=[{"feature_0": [1]}] * 2)),
        400,
        "context.sparse.values[1]:",
        "id 40 is out of range for feature 'feature_2'",
    ),
    (
        "candidate criteo form",
        js({"context": {"dense": DENSE}, "candidates": [{"float_features": DENSE}]}),
        400,
        "candidates[0].float_features:",
        "the ranking form takes dense and sparse",
    ),
    (
        "candidate unknown field",
        js({"context": {"dense": DENSE}, "candidates": [{"sprase": {}}]}),
        400,
        "candidates[0].sprase:",
        "unknown field",
    ),
    ("too many candidates", js(ranking(cands=[{"feature_0": [1]}] * 9)), 413, "candidates:", "at most 8 instances"),
    (
        "too many ids via the context",
        js(ranking(ctx_sparse={"feature_2": [1] * 10}, cands=[{"feature_0": [1]}] * 6)),
        413,
        "sparse.values:",
        "at most 64 ids per request",
    ),
    # the columns form: {"columns": {"dense": [[...], ...], "sparse": {"<feature>": {"values", "lengths"}}}}
    (
        "columns negative id",
        js(columns(feature_0=([2, 1], [3, -4, 5]))),
        400,
        "columns.sparse.feature_0.values[1]:",
        "expected a non-negative integer, got -4",
    ),
    (
        "columns fractional length",
        js(columns(feature_1=([1.5, 1], [3, 4]))),
        400,
        "columns.sparse.feature_1.lengths[0]:",
        "expected an integer, got 1.5",
    ),
    (
        "columns id past int64",
        js(columns(feature_0=(None, [2**64, 1]))),
        400,
        "columns.sparse.feature_0.values[0]:",
        "fits int64",
    ),
    (
        "columns unknown bag field",
        js({"columns": {"dense": [DENSE], "sparse": {"feature_0": {"values": [1], "ids": []}}}}),
        400,
        "columns.sparse.feature_0.ids:",
        "unknown field; expected values, lengths",
    ),
    (
        "columns bag missing values",
        js({"columns": {"dense": [DENSE], "sparse": {"feature_0": {"lengths": [0]}}}}),
        400,
        "columns.sparse.feature_0.values:",
        "required field is missing",
    ),
    (
        "columns unknown field",
        js({"columns": {"dense": [DENSE], "rows": 1}}),
        400,
        "columns.rows:",
        "unknown field; expected dense, sparse",
    ),
    (
        "columns unknown feature",
        js(columns(feature_9=(None, [1, 2]))),
        400,
        "columns.sparse:",
        'unknown feature "feature_9"; expected one of feature_0, feature_1, feature_2',
    ),
    (
        "columns lengths per row",
        js(columns(feature_0=([1, 1, 1], [1, 2, 3]))),
        400,
        "columns.sparse.feature_0.lengths:",
        "expected one length per row (2)",
    ),
    (
        "columns ids vs lengths",
        js(columns(feature_0=([1, 1], [1, 2, 3]))),
        400,
        "columns.sparse.feature_0.values:",
        "expected sum(columns.sparse.feature_0.lengths) = 2 ids",
    ),
    (
        "columns single-hot count",
        js(columns(feature_0=(None, [1]))),
        400,
        "columns.sparse.feature_0.values:",
        "expected one id per row (2) when columns.sparse.feature_0.lengths is left out, got 1",
    ),
    (
        "columns dense width",
        js({"columns": {"dense": [DENSE, DENSE[:4]]}}),
        400,
        "columns.dense[1]:",
        "expected 5 numbers, got 4",
    ),
    (
        "columns dense not a number",
        js({"columns": {"dense": [DENSE, [True] * 5]}}),
        400,
        "columns.dense[1][0]:",
        "expected a number, got true",
    ),
    (
        "columns dense missing",
        js({"columns": {"sparse": {"feature_0": {"values": [1]}}}}),
        400,
        "columns.dense:",
        "required field is missing",
    ),
    ("columns empty", js({"columns": {}}), 400, "columns:", "expected a dense and/or a sparse column"),
    ("columns no rows", js({"columns": {"dense": []}}), 400, "columns.dense:", "expected at least one row, got []"),
    (
        "columns beside instances",
        js({"columns": {"dense": [DENSE]}, "instances": [OK]}),
        400,
        "columns:",
        "no other top-level field",
    ),
    (
        "columns dense in context too",
        js({"context": {"dense": DENSE}, "columns": {"dense": [DENSE]}}),
        400,
        "columns.dense:",
        "context.dense is given already",
    ),
    (
        "columns feature in context too",
        js({"context": instance(DENSE, feature_1=[1]), "columns": {"sparse": {"feature_1": {"values": [2]}}}}),
        400,
        "columns.sparse.feature_1:",
        'feature "feature_1" is also in context.sparse.keys',
    ),
    (
        "columns id out of range",
        js(columns(feature_2=([0, 2], [1, 40]))),
        400,
        "columns.sparse.feature_2.values[1]:",
        "id 40 is out of range for feature 'feature_2'",
    ),
    # single-hot requests (one id per feature per row) take collate's shortcut; a bad id still names its field
    (
        "single-hot instance id out of range",
        js(
            {
                "instances": [instance(DENSE, feature_1=[1], feature_0=[2])] * 2
                + [instance(DENSE, feature_1=[30], feature_0=[2])]
            }
        ),
        400,
        "instances[2].sparse.values[0]:",
        "id 30 is out of range for feature 'feature_1'",
    ),
    (
        "single-hot candidate id out of range",
        js(ranking(ctx_sparse={"feature_2": [4]}, cands=[{"feature_0": [1]}, {"feature_0": [20]}])),
        400,
        "candidates[1].sparse.values[0]:",
        "id 20 is out of range for feature 'feature_0'",
    ),
    (
        "single-hot context id out of range",
        js(ranking(ctx_sparse={"feature_1": [3], "feature_2": [40]}, cands=[{"feature_0": [1]}, {"feature_0": [2]}])),
        400,
        "context.sparse.values[1]:",
        "id 40 is out of range for feature 'feature_2'",
    ),
    (
        "single-hot column id out of range",
        js(columns(feature_0=(None, [1, 2]), feature_2=(None, [3, 40]))),
        400,
        "columns.sparse.feature_2.values[1]:",
        "id 40 is out of range for feature 'feature_2'",
    ),
    (
        "single-hot column beside a context",
        js({"context": instance(DENSE, feature_2=[5]), "columns": {"sparse": {"feature_1": {"values": [3, 30]}}}}),
        400,
        "columns.sparse.feature_1.values[1]:",
        "id 30 is out of range for feature 'feature_1'",
    ),
    (
        "single-hot context id beside columns",
        js(
            {
                "context": {
                    "dense": DENSE,
                    "sparse": {"keys": ["feature_2", "feature_1"], "values": [4, 40], "lengths": [1, 1]},
                },
                "columns": {"sparse": {"feature_0": {"values": [3, 5]}}},
            }
        ),
        400,
        "context.sparse.values[1]:",
        "id 40 is out of range for feature 'feature_1'",
    ),
    (
        "single-hot negative candidate id",
        js(ranking(cands=[{"feature_0": [1]}, {"feature_0": [-2]}])),
        400,
        "candidates[1].sparse.values[0]:",
        "expected a non-negative integer, got -2",
    ),
    ("too many columns rows", js({"columns": {"dense": [DENSE] * 9}}), 413, "columns.dense:", "at most 8 rows"),
    (
        "too many columns ids",
        js(columns(feature_0=([40, 30], list(range(20)) * 3 + [1] * 10))),
        413,
        "columns.sparse:",
        "at most 64 ids per request",
    ),
]


@pytest.mark.parametrize("case,raw,status,starts,contains", CASES, ids=[c[0] for c in CASES])
def test_rejection(case, raw, status, starts, contains):
    cfg = tiny_config()
    with pytest.raises(RequestError) as info:
        parsed = RequestParser(cfg).parse(raw)
        _, errors = collate([parsed], cfg)  # the id bounds check lives in collation
        raise errors[0]
    err = info.value
    assert err.status == status
    assert err.message.startswith(starts), err.message
    assert contains in err.message, err.message
    assert err.phrase.isascii() and len(err.phrase) < 32
    assert err.body() == {"code": status, "type": type(err).__name__, "message": err.message}
    assert len(err.message) < 600  # an absurd input is never echoed whole
    assert not re.search(r"\b[a-z][A-Z]{2,}", err.message), err.message  # never "jSON"


def test_messages_never_echo_huge_values():
    err_msg = _message(with_sparse(keys=["x" * 300]))
    assert len(err_msg) < 300


def _message(raw):
    try:
        RequestParser(tiny_config()).parse(raw)
    except RequestError as e:
        return e.message
    raise AssertionError("accepted")


def test_dict_bodies_from_torchserve_get_the_same_checks():
    # With TorchServe's own JSON decoding on, NaN arrives as a float: still refused.
    p = RequestParser(tiny_config())
    for obj, field in [
        ({**OK, "dense": [float("nan"), 1, 1, 1, 1]}, "dense[0]"),
        ({**OK, "dense": [float("inf"), 1, 1, 1, 1]}, "dense[0]"),
        ({"dense": DENSE, "sparse": {"keys": ["feature_0"], "values": [True], "lengths": [1]}}, "sparse.values[0]"),
        ({"instances": [OK, {**OK, "dense": None}]}, "instances[1].dense"),
    ]:
        with pytest.raises(RequestError) as info:
            p.parse(obj)
        assert info.value.message.startswith(field), info.value.message


# --- property tests: the parser accepts, or raises one of our errors; never anything else ---------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=30,
)
keys = st.sampled_from(["feature_0", "feature_1", "feature_2", "feature_3", "féature_0", ""])
near_valid = st.fixed_dictionaries(
    {
        "dense": st.lists(st.floats(allow_nan=False, width=64) | st.integers(), max_size=7),
        "sparse": st.fixed_dictionaries(
            {
                "keys": st.lists(keys, max_size=4),
                "values": st.lists(st.integers(min_value=-5, max_value=2**64), max_size=8),
                "lengths": st.lists(st.integers(min_value=-1, max_value=4), max_size=4),
            }
        ),
    }
)


def _accepts_or_refuses(raw):
    cfg = tiny_config()
    try:
        parsed = RequestParser(cfg).parse(raw)
    except RequestError as e:
        assert e.status in (400, 413) and e.message
        return
    batch, errors = collate([parsed], cfg)
    if errors:
        assert set(errors) == {0} and errors[0].status == 400
    else:
        assert batch.dense.shape == (parsed.n, 5)
        assert batch.sparse.lengths().numel() == 3 * parsed.n
        assert int(batch.sparse.lengths().sum()) == batch.sparse.values().numel()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(json_values)
def test_any_json_value(value):
    _accepts_or_refuses(json.dumps(value).encode())
    _accepts_or_refuses(value)  # as TorchServe's own decoder would hand it over


@settings(max_examples=300, deadline=None)
@given(near_valid | st.fixed_dictionaries({"instances": st.lists(near_valid, max_size=3)}))
def test_near_valid_requests(value):
    _accepts_or_refuses(json.dumps(value).encode())


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes(raw):
    _accepts_or_refuses(raw)


@pytest.mark.parametrize("case,raw,status,starts,contains", CASES, ids=[c[0] for c in CASES])
def test_large_bodies_take_the_fast_decoder_and_get_the_same_answer(case, raw, status, starts, contains):
    """Bodies of 4 KB or more are decoded with the lean schema (bounds checked afterwards, a
    refused request parsed again strictly): the answer is the small body's, word for word."""

    def answer(body):
        cfg = tiny_config()
        try:
            parsed = RequestParser(cfg).parse(body)
        except RequestError as e:
            return e.status, e.message
        _, errors = collate([parsed], cfg)
        return (errors[0].status, errors[0].message) if errors else (200, "")

    assert answer(raw + b" " * 4096) == answer(raw)
