"""tritonclient.grpc and Triton's own gRPC stubs against the KServe door, in a process of their own.

    PYTHONPATH=tests python tests/door_grpc.py PORT CHECK        # CHECK: forms | health | bad | delta | repository

Triton's generated protos (tritonclient.grpc.service_pb2) and kserve's (kserve.protocol.grpc) both
define the package ``inference`` in different files: one process cannot hold both in protobuf's
default pool ("duplicate symbol 'inference.ServerLiveRequest'"). The tests import kserve's SDK, so
the gRPC clients run here, in a child that never imports kserve, and print what they saw as JSON;
tests/test_kserve_door.py asserts on it.
"""

from __future__ import annotations

import json
import sys
import threading

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from test_kserve_server import (
    DENSE_ROWS,
    DTYPES,
    TENSORS,
)  # the TorchServe door's two rows (run with tests/ on PYTHONPATH)


def raw(port: int, tensors=TENSORS):
    """tritonclient.grpc: raw_input_contents (its only way)."""
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    inputs = []
    for name, arr in tensors.items():
        t = grpcclient.InferInput(name, list(arr.shape), DTYPES[arr.dtype])
        t.set_data_from_numpy(arr)
        inputs.append(t)
    try:
        return client.infer("dlrm", inputs, request_id="tg-1", client_timeout=60)
    finally:
        client.close()


def typed(port: int, tensors=TENSORS):
    """Typed contents (fp32_contents, int64_contents, ...), through Triton's own generated stubs."""
    field = {"FP32": "fp32_contents", "INT32": "int_contents", "INT64": "int64_contents"}
    req = service_pb2.ModelInferRequest(model_name="dlrm", id="typed-1")
    for name, arr in tensors.items():
        t = req.inputs.add(name=name, datatype=DTYPES[arr.dtype], shape=list(arr.shape))
        getattr(t.contents, field[DTYPES[arr.dtype]]).extend(arr.reshape(-1).tolist())
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(req, timeout=60)


def forms(port: int) -> dict:
    result, answer = raw(port), typed(port)
    return {
        "raw": {"id": result.get_response().id, "scores": result.as_numpy("scores").tolist()},
        "typed": {
            "id": answer.id,
            "model_version": answer.model_version,
            "shape": list(answer.outputs[0].shape),
            "scores": list(answer.outputs[0].contents.fp32_contents),
        },
    }


def failure(call) -> dict:
    """What a call that should fail raised: its status and message."""
    try:
        call()
    except InferenceServerException as e:
        return {"status": e.status(), "message": e.message()}
    except grpc.RpcError as e:
        return {"status": str(e.code()), "message": e.details()}
    return {"status": "OK", "message": ""}


def health(port: int) -> dict:
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        return {
            "live": client.is_server_live(),
            "ready": client.is_model_ready("dlrm"),
            "unknown": failure(lambda: client.is_model_ready("no-such-model")),
            "metadata": client.get_model_metadata("dlrm", as_json=True),
        }
    finally:
        client.close()


def bad(port: int) -> dict:
    """Bad requests sent at once beside a good one."""
    out_of_range = {**TENSORS, "feature_0.values": np.array([3, 4, 25])}
    short = {**TENSORS, "dense": DENSE_ROWS[:, :4].copy()}
    calls = {
        "grpc_raw_range": lambda: failure(lambda: raw(port, out_of_range)),
        "grpc_typed_short": lambda: failure(lambda: typed(port, short)),
        "good_grpc": lambda: raw(port).as_numpy("scores")[:, 0].tolist(),
    }
    results: dict = {}
    threads = [threading.Thread(target=lambda n=n: results.__setitem__(n, calls[n]())) for n in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results


def delta(port: int) -> dict:
    """The two rows' scores and the answer's delta_sequence parameter (None when absent)."""
    result = raw(port)
    params = result.get_response().parameters
    sequence = params["delta_sequence"].int64_param if "delta_sequence" in params else None
    return {"scores": result.as_numpy("scores")[:, 0].tolist(), "delta_sequence": sequence}


def repository(port: int) -> dict:
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        return {"unload": failure(lambda: client.unload_model("dlrm")), "ready": client.is_model_ready("dlrm")}
    finally:
        client.close()


if __name__ == "__main__":
    port, check = int(sys.argv[1]), sys.argv[2]
    print(
        json.dumps(
            {"forms": forms, "health": health, "bad": bad, "delta": delta, "repository": repository}[check](port)
        )
    )
