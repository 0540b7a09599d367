"""KServe v1 and Open Inference Protocol v2 through the handler, with a fake TorchServe context
(the real-server tests with real clients are in test_kserve_server.py)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest

from conftest import TINY, FakeContext
from helpers import instance

ROWS = [
    instance([0.5, -1.0, 0.25, 2.0, 0.0], feature_0=[3, 4], feature_1=[7]),
    instance([1.0, 0.0, -0.5, 0.125, 3.0], feature_0=[5], feature_2=[1]),
]
DENSE = [r["dense"] for r in ROWS]


def v2_inputs(rows=DENSE, **changes):
    """The two ROWS as v2 inputs; ``feature_0__values={"data": [...]}`` changes an input's
    fields, ``=None`` leaves it out."""
    inputs = [
        {"name": "dense", "datatype": "FP32", "shape": [len(rows), 5], "data": rows},
        {"name": "feature_0.lengths", "datatype": "INT64", "shape": [2], "data": [2, 1]},
        {"name": "feature_0.values", "datatype": "INT64", "shape": [3], "data": [3, 4, 5]},
        {"name": "feature_1.lengths", "datatype": "INT32", "shape": [2], "data": [1, 0]},
        {"name": "feature_1.values", "datatype": "INT32", "shape": [1], "data": [7]},
        {"name": "feature_2.lengths", "datatype": "INT64", "shape": [2], "data": [0, 1]},
        {"name": "feature_2.values", "datatype": "INT64", "shape": [1], "data": [1]},
    ]
    for name, change in changes.items():
        name = name.replace("__", ".")
        inputs = [
            {**i, **change} if i["name"] == name else i for i in inputs if change is not None or i["name"] != name
        ]
    return inputs


def binary(inputs, **request):
    """The binary tensor data extension: JSON header, then each input's bytes."""
    raws = []
    for i in inputs:
        dtype = {"FP32": "<f4", "INT64": "<i8", "INT32": "<i4"}[i["datatype"]]
        raw = np.asarray(i.pop("data"), dtype=dtype).tobytes()
        i["parameters"] = {"binary_data_size": len(raw)}
        raws.append(raw)
    header = json.dumps({"inputs": inputs, **request}).encode()
    return header + b"".join(raws), len(header)


def run(handler, requests):
    """requests: (route, body, headers); route "predictions" or "kserve"."""
    ctx = FakeContext(Path("."), dict(TINY))
    ctx.request_ids = {i: f"req-{i}" for i in range(len(requests))}
    for i, (route, _, headers) in enumerate(requests):
        if route == "kserve":
            ctx.kserve.add(i)
        ctx.headers[i] = dict(headers)
    out = handler.handle([{"body": body} for _, body, _ in requests], ctx)
    return out, ctx


def test_one_batch_of_every_protocol_scores_alike(handler):
    raw, n = binary(v2_inputs(), id="b-1", parameters={"binary_data_output": True})
    out, ctx = run(
        handler,
        [
            ("predictions", json.dumps({"instances": ROWS}).encode(), {}),
            ("kserve", json.dumps({"instances": ROWS}).encode(), {}),
            ("kserve", json.dumps({"id": "j-1", "inputs": v2_inputs()}).encode(), {}),
            ("kserve", raw, {"Inference-Header-Content-Length": str(n)}),
            (
                "kserve",
                bytearray(binary(v2_inputs())[0]),
                {"inference-header-content-length": str(binary(v2_inputs())[1])},
            ),
        ],
    )
    assert ctx.statuses == {}
    want = json.loads(out[0])["scores"]
    assert json.loads(out[1]) == {"predictions": want}
    v2 = json.loads(out[2])
    assert v2 == {
        "model_name": "dlrm",
        "model_version": "1.0",
        "id": "j-1",
        "outputs": [{"name": "scores", "datatype": "FP32", "shape": [2, 1], "data": want}],
    }
    head = int(ctx.response_headers[3]["Inference-Header-Content-Length"])
    assert ctx.content_types[3] == "application/octet-stream"
    assert json.loads(out[3][:head])["outputs"][0]["parameters"] == {"binary_data_size": 8}
    assert json.loads(out[3][:head])["id"] == "b-1"
    assert np.frombuffer(out[3][head:], "<f4").tolist() == want  # float32 both ways: exact
    assert ctx.content_types[4] == "application/json" and json.loads(out[4])["outputs"][0]["data"] == want
    assert {ctx.content_types[i] for i in (0, 1, 2)} == {"application/json"}


def test_single_id_form_is_one_id_per_row(handler):
    one = v2_inputs(feature_1__lengths=None, feature_1__values=None) + [
        {"name": "feature_1", "datatype": "INT64", "shape": [2], "data": [7, 9]}
    ]
    rows = [
        instance(ROWS[0]["dense"], feature_0=[3, 4], feature_1=[7]),
        instance(ROWS[1]["dense"], feature_0=[5], feature_1=[9], feature_2=[1]),
    ]
    out, ctx = run(
        handler,
        [
            ("kserve", json.dumps({"inputs": one}).encode(), {}),
            ("predictions", json.dumps({"instances": rows}).encode(), {}),
        ],
    )
    assert json.loads(out[0])["outputs"][0]["data"] == json.loads(out[1])["scores"]


def single_hot_inputs(f0=(3, 5), f2=(1, 0)):
    """Every feature one id per row (INT32 and INT64 mixed): the single-hot shortcut's input."""
    return [
        {"name": "dense", "datatype": "FP32", "shape": [2, 5], "data": DENSE},
        {"name": "feature_2", "datatype": "INT32", "shape": [2], "data": list(f2)},
        {"name": "feature_0", "datatype": "INT64", "shape": [2, 1], "data": [[i] for i in f0]},
    ]


def test_all_single_id_inputs_score_as_rows_and_name_bad_ids(handler):
    rows = [instance(DENSE[0], feature_0=[3], feature_2=[1]), instance(DENSE[1], feature_0=[5], feature_2=[0])]
    raw, n = binary(single_hot_inputs())
    bad_neg, n_neg = binary(single_hot_inputs(f2=(1, -2)))
    out, ctx = run(
        handler,
        [
            ("kserve", raw, {"Inference-Header-Content-Length": str(n)}),
            ("predictions", json.dumps({"instances": rows}).encode(), {}),
            ("kserve", json.dumps({"inputs": single_hot_inputs(f0=(3, 20))}).encode(), {}),
            ("kserve", bad_neg, {"Inference-Header-Content-Length": str(n_neg)}),
        ],
    )
    assert ctx.statuses == {2: (400, "Bad Request"), 3: (400, "Bad Request")}
    assert json.loads(out[0])["outputs"][0]["data"] == json.loads(out[1])["scores"]
    assert json.loads(out[2])["error"].startswith("feature_0[1]: id 20 is out of range for feature 'feature_0'")
    assert json.loads(out[3])["error"] == "feature_2[1]: expected a non-negative integer, got -2"


def int64_inputs(f0=(3, 5), f2=(1, 0), dense=DENSE, dense_at=0):
    """tritonclient's usual request: FP32 dense and one INT64 id input per feature (features out
    of model order, one shaped [n, 1]); ``dense_at``: the position of the dense input."""
    ids = [
        {"name": "feature_2", "datatype": "INT64", "shape": [2], "data": list(f2)},
        {"name": "feature_0", "datatype": "INT64", "shape": [2, 1], "data": [[i] for i in f0]},
    ]
    return ids[:dense_at] + [{"name": "dense", "datatype": "FP32", "shape": [2, 5], "data": dense}] + ids[dense_at:]


def test_binary_int64_single_hot_is_read_whole_and_matches_the_general_path(handler):
    """The usual binary request is read in a few array operations (_binary_single_hot); every
    other layout (dense between the id inputs, INT32 ids, JSON data) takes the input-by-input
    path. Both give the same scores and the same messages."""
    from dlrmkit.protocols import _INFER, _binary_single_hot

    def fast(inputs):
        raw, n = binary(inputs)
        return _binary_single_hot(_INFER.decode(raw[:n]), memoryview(raw)[n:], handler.parser) is not None

    assert fast(int64_inputs()) and fast(int64_inputs(dense_at=2))
    assert not fast(int64_inputs(dense_at=1)) and not fast(single_hot_inputs())

    def kserve(inputs, as_binary=True):
        if not as_binary:
            return ("kserve", json.dumps({"inputs": inputs}).encode(), {})
        raw, n = binary(copy.deepcopy(inputs))  # binary() moves each input's data into the tail
        return ("kserve", raw, {"Inference-Header-Content-Length": str(n)})

    rows = [instance(DENSE[0], feature_0=[3], feature_2=[1]), instance(DENSE[1], feature_0=[5], feature_2=[0])]
    out, ctx = run(
        handler,
        [("predictions", json.dumps({"instances": rows}).encode(), {})]
        + [kserve(int64_inputs(dense_at=at)) for at in (0, 2, 1)]
        + [kserve(int64_inputs(), False)],
    )
    assert ctx.statuses == {}
    want = json.loads(out[0])["scores"]
    assert len(set(want)) == 2 and all(json.loads(o)["outputs"][0]["data"] == want for o in out[1:])

    nan = [list(DENSE[0]), [1.0, 0.0, float("nan"), 0.125, 3.0]]
    for bad, message in (
        (int64_inputs(f2=(1, -2)), "feature_2[1]: expected a non-negative integer, got -2"),
        (int64_inputs(f0=(3, 20)), "feature_0[1]: id 20 is out of range for feature 'feature_0'"),
        (int64_inputs(dense=nan), "dense: expected finite FP32 numbers, got nan at [1, 2]"),
    ):
        out, ctx = run(handler, [kserve(bad), kserve(bad, as_binary=False)] if "nan" not in message else [kserve(bad)])
        assert set(ctx.statuses.values()) == {(400, "Bad Request")} and len(ctx.statuses) == len(out)
        assert all(json.loads(o)["error"].startswith(message) for o in out), out


@pytest.mark.parametrize(
    "inputs, message",
    [
        (v2_inputs(dense={"shape": [5, 2]}), "dense: expected FP32 shape [B, 5], got FP32 [5, 2]"),
        (
            v2_inputs(dense={"datatype": "INT64", "data": [[1] * 5] * 2}),
            "dense: expected FP32 shape [B, 5], got INT64 [2, 5]",
        ),
        (v2_inputs(dense={"data": [[0.5, 1.0]]}), "dense: data: expected 10 numbers for shape [2, 5], got 2"),
        (v2_inputs(feature_0__values={"data": [3, 4, 5.5]}), "feature_0.values: data: expected INT64 numbers, got 5.5"),
        (
            v2_inputs(feature_0__values={"data": [3, 4, True]}),
            "feature_0.values: data: expected INT64 numbers, got true",
        ),
        (
            v2_inputs(feature_0__values={"data": [3, 4]}),
            "feature_0.values: data: expected 3 numbers for shape [3], got 2",
        ),
        (
            v2_inputs(feature_0__lengths={"data": [2, 2]}),
            "feature_0.values: expected sum(feature_0.lengths) = 4 ids, got shape [3]",
        ),
        (
            v2_inputs(feature_0__lengths={"data": [3, -1]}),
            "feature_0.lengths[1]: expected a non-negative integer, got -1",
        ),
        (
            v2_inputs(feature_0__values={"data": [3, 4, 99]}),
            "feature_0.values[2]: id 99 is out of range for feature 'feature_0'",
        ),
        (
            v2_inputs(feature_0__values=None),
            "feature_0.values: required input is missing (it goes with feature_0.lengths)",
        ),
        (v2_inputs(dense=None), "dense: required input is missing (FP32 [B, 5])"),
        (
            v2_inputs(feature_1__lengths={"datatype": "BYTES"}),
            "feature_1.lengths: datatype 'BYTES' is not accepted here",
        ),
        (
            v2_inputs() + [{"name": "feature_7", "datatype": "INT64", "shape": [2], "data": [1, 2]}],
            "feature_7: unknown input",
        ),
        (
            v2_inputs() + [{"name": "feature_1", "datatype": "INT64", "shape": [2], "data": [1, 2]}],
            "feature_1: send either feature_1 or feature_1.lengths + feature_1.values, not both",
        ),
        (v2_inputs()[:1] * 2, "dense: input appears more than once"),
    ],
)
def test_malformed_v2_gets_400_naming_the_input(handler, inputs, message):
    out, ctx = run(
        handler,
        [
            ("kserve", json.dumps({"inputs": inputs}).encode(), {}),
            ("kserve", json.dumps({"inputs": v2_inputs()}).encode(), {}),
        ],
    )
    assert ctx.statuses == {0: (400, "Bad Request")}
    assert set(json.loads(out[0])) == {"error"} and json.loads(out[0])["error"].startswith(message), out[0]
    assert "outputs" in json.loads(out[1])


def test_nan_literal_in_v2_json_names_the_input(handler):
    body = json.dumps({"inputs": v2_inputs([[0.5, float("nan"), 0, 0, 0], DENSE[1]])}).encode()  # Python writes NaN
    out, ctx = run(handler, [("kserve", body, {})])
    assert json.loads(out[0]) == {"error": "dense: data: NaN and Infinity are not numbers in JSON; send finite numbers"}
    body = json.dumps({"inputs": v2_inputs([[0.5, None, 0, 0, 0], DENSE[1]])}).encode()  # orjson writes null
    out, ctx = run(handler, [("kserve", body, {})])
    assert json.loads(out[0]) == {"error": "dense: data: expected FP32 numbers, got null"}
    out, ctx = run(
        handler, [("kserve", json.dumps({"inputs": v2_inputs(feature_0__values={"data": [3, None, 5]})}).encode(), {})]
    )
    assert json.loads(out[0]) == {"error": "feature_0.values: data: expected INT64 numbers, got null"}


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda raw, n: (raw[:-4], n), "feature_2.values: the body ends 4 bytes short of its binary data"),
        (
            lambda raw, n: (raw + b"xx", n),
            "Inference-Header-Content-Length: 2 bytes after the JSON header belong to no input",
        ),
        (lambda raw, n: (raw, n + 10**6), "Inference-Header-Content-Length: 1000"),
        (
            lambda raw, n: (raw, "12a"),
            "Inference-Header-Content-Length: expected the JSON header's length in bytes, got '12a'",
        ),
    ],
)
def test_malformed_binary_gets_400(handler, mutate, message):
    raw, n = mutate(*binary(v2_inputs()))
    out, ctx = run(handler, [("kserve", raw, {"Inference-Header-Content-Length": str(n)})])
    assert ctx.statuses[0][0] == 400 and json.loads(out[0])["error"].startswith(message), out[0]


@pytest.mark.parametrize("bad, shown", [(float("nan"), "nan"), (float("inf"), "inf")])
def test_binary_non_finite_dense_is_refused(handler, bad, shown):
    dense = [list(r) for r in DENSE]
    dense[1][3] = bad
    raw, n = binary(v2_inputs(dense))
    out, ctx = run(handler, [("kserve", raw, {"Inference-Header-Content-Length": str(n)})])
    assert json.loads(out[0]) == {"error": f"dense: expected finite FP32 numbers, got {shown} at [1, 3]"}


def test_v1_needs_instances_and_answers_errors_in_kserve_shape(handler):
    out, ctx = run(
        handler,
        [
            ("kserve", json.dumps(ROWS[0]).encode(), {}),
            ("kserve", b"{not json", {}),
            ("predictions", json.dumps(ROWS[0]).encode(), {}),
        ],
    )
    assert json.loads(out[0]) == {"error": 'instances: required field is missing (KServe v1: {"instances": [...]})'}
    assert json.loads(out[1])["error"].startswith("body: ")
    assert ctx.statuses == {0: (400, "Bad Request"), 1: (400, "Bad Request")}
    assert set(json.loads(out[2])) == {"score", "scores"}  # /predictions answers as before


def test_grpc_and_in_process_requests_keep_the_predictions_formats(handler):
    """No Host header (gRPC Predictions, in-process callers): /predictions answers, even for
    an instances body and without url_path."""
    ctx = FakeContext(Path("."), dict(TINY))
    ctx.kserve.update({0, 1})
    ctx.headers = {0: {"Host": None}, 1: {}}  # 0: like gRPC; 1: a REST request on /v1
    out = handler.handle(
        [{"data": json.dumps({"instances": ROWS}).encode()}, {"body": json.dumps({"instances": ROWS}).encode()}], ctx
    )
    assert set(json.loads(out[0])) == {"scores"}
    assert json.loads(out[1]) == {"predictions": json.loads(out[0])["scores"]}


def test_model_metadata_describes_a_request_the_parser_takes(config):
    """The inputs the OIP plugin serves (from the archive's oip-metadata.json) build a v2
    request the handler's parser reads: every listed input, with its datatype and shape."""
    from dlrmkit.forms import RequestParser
    from dlrmkit.protocols import OIPv2, model_metadata

    meta = model_metadata(config)
    assert [i["name"] for i in meta["inputs"]] == ["dense", *config.sparse_features]
    assert meta["outputs"] == [{"name": "scores", "datatype": "FP32", "shape": [-1, 1]}]
    assert meta["max_batch_size"] == config.requests.max_instances_per_request
    rows = 2
    inputs = [
        {
            "name": i["name"],
            "datatype": i["datatype"],
            "shape": [rows if d == -1 else d for d in i["shape"]],
            "data": [0.5] * rows * i["shape"][-1] if i["datatype"] == "FP32" else [1] * rows,
        }
        for i in meta["inputs"]
    ]
    parsed = OIPv2(json.dumps({"inputs": inputs}).encode(), RequestParser(config), None, ("dlrm", "1.0")).parse()
    assert parsed.n == rows
