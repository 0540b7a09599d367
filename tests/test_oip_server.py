"""Integration: the Open Inference Protocol's health, metadata, readiness and model config, as
the kit's frontend plugin (plugin/, `make plugin`) answers them inside a real TorchServe, to
clients no one here wrote: tritonclient.http, tritonclient.grpc and the kserve SDK's v2 REST
client. Readiness follows the workers' real state: scaled to 0 it is false, scaled back true."""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np
import pytest

from conftest import TINY
from helpers import tiny_mar
from scripts.tsctl import ROOT, Server, get, post

pytestmark = pytest.mark.integration

PLUGIN = ROOT / "build" / "plugins" / "dlrm-oip.jar"
F = TINY["num_dense_features"]


def put(url: str) -> int:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="PUT"), timeout=120) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    assert PLUGIN.is_file(), f"{PLUGIN} is missing: run `make plugin` (make test builds it)"
    tmp = tmp_path_factory.mktemp("oip")
    tiny_mar(tmp, minWorkers=1, maxWorkers=1, batchSize=8, maxBatchDelay=20, responseTimeout=60)
    # TorchServe's own OIP mode on too: its gRPC service is then up, for the gRPC test below.
    srv = Server.on_free_ports(
        tmp / "home", model_store=tmp / "store", overrides={"ts_open_inference_protocol": "true"}
    )
    try:
        srv.start()
        srv.wait_ready(
            "dlrm",
            json.dumps({"dense": [0.0] * F, "sparse": {"keys": [], "values": [], "lengths": []}}).encode(),
            timeout=120,
        )
        yield srv
    finally:
        srv.stop()
        assert not srv.running()


def triton(srv):
    import tritonclient.http as httpclient

    return httpclient.InferenceServerClient(srv.url.removeprefix("http://"), network_timeout=60)


def sdk(srv, call: str, *args):
    from kserve import InferenceRESTClient, RESTConfig

    async def go():
        client = InferenceRESTClient(RESTConfig(protocol="v2", timeout=60))
        try:
            return await getattr(client, call)(srv.url, *args)
        finally:
            await client.close()

    return asyncio.run(go())


def test_server_live_ready_and_metadata(server):
    client = triton(server)
    assert client.is_server_live() and client.is_server_ready()
    meta = client.get_server_metadata()
    assert meta["name"] == "torchserve" and meta["version"] == "0.12.0"
    assert meta["extensions"] == ["binary_tensor_data", "model_configuration"]
    assert sdk(server, "is_server_live") is True and sdk(server, "is_server_ready") is True
    status, body, _ = get(server.url + "/v2/health/ready")
    assert (status, json.loads(body)) == (200, {"ready": True})


def test_model_metadata_ready_and_config_from_the_archive(server):
    client = triton(server)
    expected_inputs = [{"name": "dense", "datatype": "FP32", "shape": [-1, F]}] + [
        {"name": f, "datatype": "INT64", "shape": [-1]} for f in TINY["sparse_features"]
    ]
    outputs = [{"name": "scores", "datatype": "FP32", "shape": [-1, 1]}]
    for version in ("", "1.0"):
        assert client.is_model_ready("dlrm", version)
        meta = client.get_model_metadata("dlrm", version)
        assert meta == {
            "name": "dlrm",
            "versions": ["1.0"],
            "platform": "pytorch_torchserve",
            "inputs": expected_inputs,
            "outputs": outputs,
            "parameters": {"dense_precision": "fp32"},  # build_mar.py's record of what the dense half serves as
        }
    assert sdk(server, "is_model_ready", "dlrm") is True
    config = client.get_model_config("dlrm")
    assert config["max_batch_size"] == TINY["max_instances_per_request"]
    assert config["dynamic_batching"] == {"max_queue_delay_microseconds": 20_000}
    assert config["parameters"]["torchserve_batch_size"] == {"string_value": "8"}
    assert [(i["name"], i["data_type"], i["dims"]) for i in config["input"]] == [("dense", "TYPE_FP32", [F])] + [
        (f, "TYPE_INT64", [1]) for f in TINY["sparse_features"]
    ]
    assert config["output"] == [{"name": "scores", "data_type": "TYPE_FP32", "dims": [1]}]


def test_infer_built_from_the_metadata_alone_scores_as_predictions(server):
    import tritonclient.http as httpclient

    client = triton(server)
    meta = client.get_model_metadata("dlrm")
    rng = np.random.default_rng(7)
    rows, inputs, arrays = 3, [], {}
    for spec in meta["inputs"]:  # only what the metadata says: names, datatypes, shapes
        shape = [rows if d == -1 else d for d in spec["shape"]]
        arr = (
            rng.normal(size=shape).astype(np.float32)
            if spec["datatype"] == "FP32"
            else rng.integers(0, 20, size=shape, dtype=np.int64)
        )
        arrays[spec["name"]] = arr
        t = httpclient.InferInput(spec["name"], shape, spec["datatype"])
        t.set_data_from_numpy(arr, binary_data=True)
        inputs.append(t)
    out = client.infer("dlrm", inputs, outputs=[httpclient.InferRequestedOutput("scores", binary_data=True)])
    v2 = out.as_numpy(meta["outputs"][0]["name"]).reshape(-1)

    features = [s["name"] for s in meta["inputs"] if s["name"] != "dense"]
    seed = [
        {
            "dense": arrays["dense"][r].tolist(),
            "sparse": {
                "keys": features,
                "values": [int(arrays[f][r]) for f in features],
                "lengths": [1] * len(features),
            },
        }
        for r in range(rows)
    ]
    predicted = [
        json.loads(post(server.url + "/predictions/dlrm", json.dumps(s).encode())[1])["scores"][0] for s in seed
    ]
    np.testing.assert_allclose(v2, predicted, rtol=1e-6)

    from kserve import InferInput, InferRequest

    req = InferRequest(
        "dlrm",
        [InferInput(n, list(a.shape), "FP32" if a.dtype == np.float32 else "INT64", a) for n, a in arrays.items()],
    )
    res = sdk(server, "infer", req, "dlrm")
    np.testing.assert_allclose(np.asarray(res.outputs[0].data, dtype=np.float32), predicted, rtol=1e-6)


def wait_for(predicate, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "the state did not change in time"
        time.sleep(0.5)


def test_readiness_follows_the_workers(server):
    client = triton(server)
    try:
        # synchronous=true: TorchServe answers once the worker has stopped.
        assert put(f"{server.management_url}/models/dlrm?min_worker=0&max_worker=0&synchronous=true") == 200
        wait_for(lambda: not server.worker_pids("dlrm"))
        assert client.is_model_ready("dlrm") is False
        assert sdk(server, "is_model_ready", "dlrm") is False
        status, body, _ = get(server.url + "/v2/models/dlrm/ready")
        assert (status, json.loads(body)) == (503, {"name": "dlrm", "ready": False})
        assert not client.is_server_ready()
        status, body, _ = get(server.url + "/v2/health/ready")
        assert (status, json.loads(body)) == (503, {"ready": False})
        assert client.is_server_live()
    finally:
        assert put(f"{server.management_url}/models/dlrm?min_worker=1&max_worker=1&synchronous=true") == 200
    # READY in the management API and ready here are the same state: wait on the one, check the other.
    server.wait_workers_ready("dlrm", 1)
    assert client.is_model_ready("dlrm") and client.is_server_ready()
    assert sdk(server, "is_model_ready", "dlrm") is True


@pytest.mark.parametrize(
    "path, method, code",
    [
        ("/v2/models/nope", "GET", 404),
        ("/v2/models/nope/ready", "GET", 404),
        ("/v2/models/dlrm/versions/9.9", "GET", 404),
        ("/v2/models/dlrm/versions/9.9/ready", "GET", 404),
        ("/v2/models/nope/config", "GET", 404),
        ("/v2/models/nope/infer", "POST", 404),
        ("/v2/models/dlrm/versions/9.9/infer", "POST", 404),
        ("/v2/nothing", "GET", 404),
        ("/v2/models/dlrm/infer", "GET", 405),
        ("/v2/models/dlrm/ready", "POST", 405),
    ],
)
def test_unknown_model_version_or_path_gets_an_error_body(server, path, method, code):
    status, body, _ = get(server.url + path) if method == "GET" else post(server.url + path, b"{}")
    assert status == code
    answer = json.loads(body)
    assert list(answer) == ["error"] and answer["error"]
    if "nope" in path:
        assert "nope" in answer["error"]
    if "9.9" in path:
        assert "9.9" in answer["error"]


def test_grpc_clients_find_no_oip_service_on_torchserve(server):
    """Evidence for docs/kubernetes.md: even with TorchServe's OIP mode on, its gRPC port serves
    the service as org.pytorch.serve.grpc.openinference.GRPCInferenceService (the package of the
    open_inference_grpc.proto in its jar), never inference.GRPCInferenceService, the name every
    OIP gRPC client (tritonclient.grpc, the kserve SDK) calls: each of their calls is
    UNIMPLEMENTED. (Raw calls here: tritonclient.grpc's and kserve's generated protos clash in
    one process.)"""
    import zipfile

    import grpc

    from scripts.tsctl import BIN

    jar = next((BIN.parent / "lib").glob("python3*/site-packages/ts/frontend/model-server.jar"))
    with zipfile.ZipFile(jar) as z:
        assert "package org.pytorch.serve.grpc.openinference;" in z.read("open_inference_grpc.proto").decode()
    with grpc.insecure_channel(f"127.0.0.1:{server.overrides['grpc_inference_port']}") as channel:
        for method in ("ServerLive", "ServerReady", "ServerMetadata", "ModelReady", "ModelMetadata", "ModelInfer"):
            call = channel.unary_unary(f"/inference.GRPCInferenceService/{method}")
            with pytest.raises(grpc.RpcError) as err:
                call(b"", timeout=30)
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED, method
        # TorchServe's own name answers: its ServerReady says true whatever the workers do.
        ready = channel.unary_unary("/org.pytorch.serve.grpc.openinference.GRPCInferenceService/ServerReady")
        assert ready(b"", timeout=30) == b"\x08\x01"  # ServerReadyResponse{ready: true}


def test_model_is_not_ready_while_its_crashed_worker_restarts(server):
    import os
    import signal

    client = triton(server)
    pid = server.wait_workers_ready("dlrm", 1)[0]
    os.kill(pid, signal.SIGKILL)
    # TorchServe restarts the worker after a backoff and a model load (seconds): not ready meanwhile.
    wait_for(lambda: not client.is_model_ready("dlrm"), timeout=60)
    assert not client.is_server_ready()
    wait_for(lambda: client.is_model_ready("dlrm"), timeout=180)
    assert server.worker_pids("dlrm") != [pid] and client.is_server_ready()
