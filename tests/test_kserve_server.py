"""Integration: TorchServe started the way KServe's TorchServe runtime starts it, on the storage
layout scripts/kserve_deploy.py writes, answering KServe v1, Open Inference Protocol v2 (JSON
and binary) and TorchServe's own /predictions and gRPC in shared batches, to clients no one here
wrote: tritonclient[http], the kserve SDK's v2 REST client, and gRPC stubs generated from the
inference.proto inside TorchServe's frontend jar."""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading

import numpy as np
import pytest
import yaml

from conftest import tiny_config
from helpers import grpc_modules, instance, metrics_delta, settled
from scripts.tsctl import BIN, Server, post

pytestmark = pytest.mark.integration

BATCH_DELAY_MS = 1500  # long: a burst of concurrent requests lands in one batch
DENSE_ROWS = np.array([[0.5, -1.0, 0.25, 2.0, 0.0], [1.0, 0.0, -0.5, 0.125, 3.0]], dtype=np.float32)
TENSORS = {  # the two rows as v2 tensors: feature_0 and feature_1 multi-hot, feature_2 as one bag each
    "dense": DENSE_ROWS,
    "feature_0.lengths": np.array([2, 1]),
    "feature_0.values": np.array([3, 4, 5]),
    "feature_1.lengths": np.array([1, 0], np.int32),
    "feature_1.values": np.array([7], np.int32),
    "feature_2.lengths": np.array([0, 1]),
    "feature_2.values": np.array([1]),
}
DTYPES = {np.dtype(np.float32): "FP32", np.dtype(np.int32): "INT32", np.dtype(np.int64): "INT64"}  # v2 datatypes
# The same two rows per protocol: row 0 {f0: [3, 4], f1: [7]}, row 1 {f0: [5], f2: [1]}.
ROWS = [
    instance(DENSE_ROWS[0].tolist(), feature_0=[3, 4], feature_1=[7]),
    instance(DENSE_ROWS[1].tolist(), feature_0=[5], feature_2=[1]),
]
V2_JSON = {
    "id": "req-42",
    "inputs": [
        {"name": "dense", "datatype": "FP32", "shape": [2, 5], "data": DENSE_ROWS.reshape(-1).tolist()},
        {"name": "feature_0.lengths", "datatype": "INT64", "shape": [2], "data": [2, 1]},
        {"name": "feature_0.values", "datatype": "INT64", "shape": [3], "data": [3, 4, 5]},
        {"name": "feature_1.lengths", "datatype": "INT32", "shape": [2], "data": [1, 0]},
        {"name": "feature_1.values", "datatype": "INT32", "shape": [1], "data": [7]},
        {"name": "feature_2.lengths", "datatype": "INT64", "shape": [2], "data": [0, 1]},
        {"name": "feature_2.values", "datatype": "INT64", "shape": [1], "data": [1]},
    ],
}


@pytest.fixture(scope="module")
def reference():
    """The two rows' scores from the in-process model the archive was built from."""
    from dlrmkit.batch import collate, scores
    from dlrmkit.forms import RequestParser
    from dlrmkit.model import DLRMFactory

    config = tiny_config()
    batch, bad = collate([RequestParser(config).parse(json.dumps({"instances": ROWS}))], config)
    assert not bad
    return scores(DLRMFactory(config).random(), batch, config)[0]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The layout and the runtime's command line (deploy/kserve's ServingRuntime adds
    --foreground to keep the container's process; here TorchServe daemonizes as with the stock
    runtime); TS_* variables move the ports to loopback, as enable_envvars_config allows."""
    from scripts import kserve_deploy
    from conftest import TINY

    tmp = tmp_path_factory.mktemp("kserve")
    config = tmp / "model-config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "minWorkers": 1,
                "maxWorkers": 1,
                "batchSize": 16,
                "maxBatchDelay": BATCH_DELAY_MS,
                "responseTimeout": 60,
                "handler": TINY,
            }
        )
    )
    mount = tmp / "models"  # stands for /mnt/models
    kserve_deploy.main(["layout", "--out", str(mount), "--config", str(config), "--mount", str(mount)])
    props = mount / "config" / "config.properties"
    srv = Server.on_free_ports(tmp / "home", properties=props, model_store=mount / "model-store")
    env = srv.env()
    env.update({f"TS_{k.upper()}": str(v) for k, v in srv.overrides.items()})
    env["TS_SERVICE_ENVELOPE"] = ""  # what the InferenceService sets over the runtime's kservev2
    (srv.home / "tmp").mkdir(parents=True, exist_ok=True)
    srv.log_dir.mkdir(parents=True, exist_ok=True)
    try:
        with open(srv.log_dir / "torchserve.out", "ab") as out:
            subprocess.run(
                [str(BIN / "torchserve"), "--start", f"--model-store={mount}/model-store", f"--ts-config={props}"],
                check=True,
                cwd=srv.home,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        srv.wait_ready("dlrm", json.dumps(ROWS[0]).encode(), timeout=120)
        yield srv
    finally:
        srv.stop()
        assert not srv.running()


@pytest.fixture(scope="module")
def grpc_stub(tmp_path_factory, server):
    """Stubs generated now from the inference.proto TorchServe ships in its frontend jar."""
    import grpc

    inference_pb2, inference_pb2_grpc = grpc_modules(tmp_path_factory.mktemp("grpc"))
    channel = grpc.insecure_channel(f"127.0.0.1:{server.overrides['grpc_inference_port']}")
    yield inference_pb2_grpc.InferenceAPIsServiceStub(channel), inference_pb2
    channel.close()


def rest(srv, path: str, body: bytes, headers=None):
    headers = dict(headers or {})  # the caller's dict left as it was
    status, raw, hdrs = post(srv.url + path, body, headers.pop("Content-Type", "application/json"), headers)
    return status, raw, {k.lower(): v for k, v in hdrs.items()}


F0 = (np.array([2, 1]), np.array([3, 4, 5]))  # feature_0's lengths and values of the two rows


def triton(srv, binary: bool, rows=DENSE_ROWS, f0=F0):
    """tritonclient.http: binary inputs and outputs by default, JSON with binary=False."""
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(srv.url.removeprefix("http://"), network_timeout=60)
    tensors = {
        "dense": rows,
        "feature_0.lengths": f0[0],
        "feature_0.values": f0[1],
        "feature_1.lengths": np.array([1, 0], np.int32),
        "feature_1.values": np.array([7], np.int32),
        "feature_2.lengths": np.array([0, 1]),
        "feature_2.values": np.array([1]),
    }
    inputs = []
    for name, arr in tensors.items():
        arr = np.asarray(arr, dtype=np.float32 if name == "dense" else arr.dtype)
        t = httpclient.InferInput(
            name,
            list(arr.shape),
            "FP32" if arr.dtype == np.float32 else ("INT32" if arr.dtype == np.int32 else "INT64"),
        )
        t.set_data_from_numpy(arr, binary_data=binary)
        inputs.append(t)
    outputs = [httpclient.InferRequestedOutput("scores", binary_data=binary)]
    try:
        return client.infer("dlrm", inputs, outputs=outputs, request_id="tc-1")
    finally:
        client.close()


def kserve_sdk(srv, body=V2_JSON):
    from kserve import InferenceRESTClient, RESTConfig

    async def go():
        client = InferenceRESTClient(RESTConfig(protocol="v2", timeout=60))
        try:
            return await client.infer(srv.url, body, model_name="dlrm")
        finally:
            await client.close()

    return asyncio.run(go())


def test_every_protocol_shares_one_batch_and_gets_the_reference_scores(server, grpc_stub, reference):
    stub, pb = grpc_stub
    calls = {
        "predictions": lambda: rest(server, "/predictions/dlrm", json.dumps({"instances": ROWS}).encode()),
        "v1": lambda: rest(server, "/v1/models/dlrm:predict", json.dumps({"instances": ROWS}).encode()),
        "v2_json": lambda: rest(server, "/v2/models/dlrm/infer", json.dumps(V2_JSON).encode()),
        "triton_binary": lambda: triton(server, binary=True),
        "triton_json": lambda: triton(server, binary=False),
        "kserve_sdk": lambda: kserve_sdk(server),
        "grpc": lambda: stub.Predictions(
            pb.PredictionsRequest(model_name="dlrm", input={"data": json.dumps({"instances": ROWS}).encode()}),
            timeout=60,
        ),
    }
    results, errors = {}, {}

    def run(name):
        try:
            results[name] = calls[name]()
        except Exception as e:  # reported below with the protocol's name
            errors[name] = e

    before = settled(server)
    threads = [threading.Thread(target=run, args=(n,)) for n in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    # The handler's own counters, once all the requests are counted (the frontend reads them late).
    delta = metrics_delta(server, {"dlrm_requests_total": len(calls)}, before)
    assert delta["dlrm_requests_total"] == len(calls), delta
    assert 1 <= delta["dlrm_batches_total"] < len(calls), f"no two of {len(calls)} requests shared a batch: {delta}"

    status, raw, hdrs = results["predictions"]
    assert status == 200 and np.allclose(json.loads(raw)["scores"], reference, atol=1e-5, rtol=0)
    status, raw, hdrs = results["v1"]
    assert status == 200 and set(json.loads(raw)) == {"predictions"}
    assert np.allclose(json.loads(raw)["predictions"], reference, atol=1e-5, rtol=0)
    status, raw, hdrs = results["v2_json"]
    answer = json.loads(raw)
    assert status == 200 and hdrs["content-type"] == "application/json"
    assert answer["model_name"] == "dlrm" and answer["model_version"] == "1.0" and answer["id"] == "req-42"
    [out] = answer["outputs"]
    assert out["name"] == "scores" and out["datatype"] == "FP32" and out["shape"] == [2, 1]
    assert np.allclose(out["data"], reference, atol=1e-5, rtol=0)
    for name in ("triton_binary", "triton_json"):
        got = results[name].as_numpy("scores")
        assert got.dtype == np.float32 and got.shape == (2, 1), name
        assert np.allclose(got[:, 0], reference, atol=1e-5, rtol=0), name
        assert results[name].get_response()["id"] == "tc-1"
    assert "binary_data_size" in results["triton_binary"].get_output("scores")["parameters"]
    assert "data" in results["triton_json"].get_output("scores")
    sdk = results["kserve_sdk"]
    assert sdk.model_name == "dlrm" and sdk.id == "req-42"
    assert np.allclose(sdk.outputs[0].as_numpy().reshape(-1), reference, atol=1e-5, rtol=0)
    assert np.allclose(json.loads(results["grpc"].prediction)["scores"], reference, atol=1e-5, rtol=0)


def test_malformed_requests_of_each_protocol_get_their_own_errors(server, grpc_stub):
    """One burst: every bad request gets its protocol's error, the good one beside them its scores."""
    from tritonclient.utils import InferenceServerException

    stub, pb = grpc_stub
    nan_rows = DENSE_ROWS.copy()
    nan_rows[1, 2] = np.nan
    bad_v2 = {
        **V2_JSON,
        "inputs": V2_JSON["inputs"][:1] + [{"name": "feature_9", "datatype": "INT64", "shape": [2], "data": [1, 2]}],
    }
    short = json.dumps(instance([1, 2])).encode()
    calls = {
        "predictions": lambda: rest(server, "/predictions/dlrm", short),
        "v1": lambda: rest(
            server, "/v1/models/dlrm:predict", json.dumps({"instances": [ROWS[0], instance([])]}).encode()
        ),
        "v1_no_instances": lambda: rest(server, "/v1/models/dlrm:predict", json.dumps(ROWS[0]).encode()),
        "v2_json": lambda: rest(server, "/v2/models/dlrm/infer", json.dumps(bad_v2).encode()),
        "triton_nan": lambda: triton(server, binary=True, rows=nan_rows),
        "triton_lengths": lambda: triton(server, binary=True, f0=(np.array([2, 2]), np.array([3, 4, 5]))),
        "triton_range": lambda: triton(server, binary=True, f0=(np.array([2, 1]), np.array([3, 4, 25]))),
        "kserve_sdk": lambda: kserve_sdk(server, bad_v2),
        "grpc": lambda: stub.Predictions.with_call(
            pb.PredictionsRequest(model_name="dlrm", input={"data": short}), timeout=60
        ),
        "good": lambda: rest(server, "/v1/models/dlrm:predict", json.dumps({"instances": ROWS}).encode()),
    }
    results = {}

    def run(name):
        try:
            results[name] = calls[name]()
        except Exception as e:
            results[name] = e

    threads = [threading.Thread(target=run, args=(n,)) for n in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)

    status, raw, _ = results["predictions"]
    assert status == 400 and json.loads(raw) == {
        "code": 400,
        "type": "BadRequest",
        "message": "dense: expected 5 numbers, got 2",
    }
    status, raw, hdrs = results["v1"]
    assert status == 400 and hdrs["content-type"] == "application/json"
    assert json.loads(raw) == {"error": "instances[1].dense: expected 5 numbers, got 0"}
    status, raw, _ = results["v1_no_instances"]
    assert status == 400 and json.loads(raw)["error"].startswith("instances: required field is missing")
    status, raw, _ = results["v2_json"]
    assert status == 400 and json.loads(raw)["error"].startswith("feature_9: unknown input")
    for name, want in (
        ("triton_nan", "dense: expected finite FP32 numbers, got nan at [1, 2]"),
        ("triton_lengths", "feature_0.values: expected sum(feature_0.lengths) = 4 ids, got shape [3]"),
        ("triton_range", "feature_0.values[2]: id 25 is out of range for feature 'feature_0'"),
    ):
        err = results[name]
        assert isinstance(err, InferenceServerException), (name, err)
        assert err.status() == "400" and err.message().startswith(want), (name, err.message())
    err = results["kserve_sdk"]
    assert err.response.status_code == 400 and "feature_9: unknown input" in str(err)
    # gRPC: TorchServe 0.12 maps no handler status to gRPC: the call is OK, the error is the body.
    response, call = results["grpc"]
    assert call.code().name == "OK"
    assert json.loads(response.prediction) == {
        "code": 400,
        "type": "BadRequest",
        "message": "dense: expected 5 numbers, got 2",
    }
    status, raw, _ = results["good"]
    assert status == 200 and len(json.loads(raw)["predictions"]) == 2


def dense_binary(srv, binary_output: bool):
    """POST the two rows' dense features as one OIP v2 binary tensor (JSON header, then the raw
    little-endian floats), asking for a binary answer or not: (status, body, lower-cased headers)."""
    raw = DENSE_ROWS.astype("<f4").tobytes()
    inputs = [{"name": "dense", "datatype": "FP32", "shape": [2, 5], "parameters": {"binary_data_size": len(raw)}}]
    doc: dict = {"inputs": inputs}
    if binary_output:
        doc["parameters"] = {"binary_data_output": True}
    header = json.dumps(doc).encode()
    return rest(
        srv,
        "/v2/models/dlrm/infer",
        header + raw,
        {"Inference-Header-Content-Length": str(len(header)), "Content-Type": "application/octet-stream"},
    )


def test_binary_answer_only_when_asked(server, reference):
    """A v2 body with binary inputs but no binary output request gets JSON scores back."""
    status, body, hdrs = dense_binary(server, binary_output=False)
    assert status == 200 and hdrs["content-type"] == "application/json", body
    assert json.loads(body)["outputs"][0]["shape"] == [2, 1]
    status, body, hdrs = dense_binary(server, binary_output=True)
    n = int(hdrs["inference-header-content-length"])
    assert status == 200 and hdrs["content-type"] == "application/octet-stream"
    assert np.frombuffer(body[n:], "<f4").shape == (2,)
    assert json.loads(body[:n])["outputs"][0]["parameters"] == {"binary_data_size": 8}


def test_tritonclient_single_hot_request_is_read_whole_and_scores_as_its_rows(server):
    """tritonclient's usual Criteo-style request (FP32 dense, one INT64 id per row for each
    feature, binary) has the layout of the parser's whole-tail path (_binary_single_hot), and
    over a real TorchServe it scores as the same rows sent to /predictions."""
    import tritonclient.http as httpclient
    from dlrmkit.forms import RequestParser
    from dlrmkit.protocols import _INFER, _binary_single_hot

    tensors = {
        "dense": DENSE_ROWS,
        "feature_2": np.array([1, 0], np.int64),
        "feature_0": np.array([[3], [5]], np.int64),
    }
    inputs = []
    for name, arr in tensors.items():
        t = httpclient.InferInput(name, list(arr.shape), "FP32" if name == "dense" else "INT64")
        t.set_data_from_numpy(arr)
        inputs.append(t)
    body, n = httpclient.InferenceServerClient.generate_request_body(inputs)
    assert _binary_single_hot(_INFER.decode(body[:n]), memoryview(body)[n:], RequestParser(tiny_config())) is not None
    client = httpclient.InferenceServerClient(server.url.removeprefix("http://"), network_timeout=60)
    try:
        got = client.infer("dlrm", inputs).as_numpy("scores")[:, 0]
    finally:
        client.close()
    rows = [
        instance(DENSE_ROWS[0].tolist(), feature_0=[3], feature_2=[1]),
        instance(DENSE_ROWS[1].tolist(), feature_0=[5], feature_2=[0]),
    ]
    status, raw, _ = rest(server, "/predictions/dlrm", json.dumps({"instances": rows}).encode())
    want = json.loads(raw)["scores"]
    assert status == 200 and len(set(want)) == 2
    assert np.allclose(got, want, atol=1e-6, rtol=0), (got, want)


def test_the_layout_carries_the_oip_endpoints(server):
    """kserve_deploy.py layout copies the plugin into plugins/ and points plugins_path there."""
    from scripts.tsctl import get

    status, body, _ = get(server.url + "/v2/models/dlrm/ready")
    assert (status, json.loads(body)) == (200, {"name": "dlrm", "ready": True})
    status, body, _ = get(server.url + "/v2/models/dlrm")
    assert status == 200 and [i["name"] for i in json.loads(body)["inputs"]][:2] == ["dense", "feature_0"]
