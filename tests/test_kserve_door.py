"""Integration: the second front door, dlrm_kserve.py: the archive scripts/build_mar.py builds, served
by a real KServe model server process (kserve 0.21), to clients no one here wrote (tritonclient.http,
tritonclient.grpc and Triton's own gRPC stubs). Every form scores as the in-process reference; a bad
request gets its own 400 / INVALID_ARGUMENT naming the field beside a good one that gets its scores."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import yaml

from conftest import ROOT, TINY
from helpers import instance, wait_until
from scripts.tsctl import free_port, get, request
from test_kserve_server import DTYPES, ROWS, TENSORS, V2_JSON, dense_binary, rest  # the TorchServe door's

pytestmark = pytest.mark.integration

TOL = 1e-6
BATCH = 8  # the archive's batchSize: the most queued requests one call of the worker scores


@pytest.fixture(scope="module")
def reference():
    """The two rows' scores from the in-process model the archive was built from (as test_kserve_server's)."""
    from conftest import tiny_config
    from dlrmkit.batch import collate, scores
    from dlrmkit.forms import RequestParser
    from dlrmkit.model import DLRMFactory

    config = tiny_config()
    batch, bad = collate([RequestParser(config).parse(json.dumps({"instances": ROWS}))], config)
    assert not bad
    return np.asarray(scores(DLRMFactory(config).random(), batch, config)[0])


class Door:
    def __init__(self, proc: subprocess.Popen, http: int, grpc: int, log):
        self.proc, self.http, self.grpc, self.log = proc, http, grpc, log
        self.url = f"http://127.0.0.1:{http}"

    def tail(self) -> str:
        return self.log.read_text()[-4000:]


def start_door(tmp, model_path, *args: str, timeout: float = 180, model: str = "dlrm") -> Door:
    """dlrm_kserve.py serving ``model_path`` (a .mar or a model directory) with ``args``, ready (its
    REST readiness 200) or the test fails with the door's log."""
    http, grpc = free_port(), free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    log = tmp / f"door-{http}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "dlrm_kserve.py"), "--model-path", str(model_path)]
            + ["--http-port", str(http), "--grpc-port", str(grpc), *args],
            cwd=tmp,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    srv = Door(proc, http, grpc, log)
    try:
        deadline = time.monotonic() + timeout
        while True:
            assert proc.poll() is None, f"the door exited ({proc.returncode}):\n{srv.tail()}"
            try:
                if get(srv.url + f"/v2/models/{model}/ready", timeout=2)[0] == 200:
                    return srv
            except OSError:
                pass
            assert time.monotonic() < deadline, f"the door was not ready in {timeout:.0f} s:\n{srv.tail()}"
            time.sleep(0.3)
    except BaseException:
        stop_door(srv)
        raise


def stop_door(srv: Door) -> None:
    srv.proc.terminate()
    try:
        srv.proc.wait(60)
    except subprocess.TimeoutExpired:
        srv.proc.kill()
        srv.proc.wait()


def build(tmp, handler: dict | None = None, **config):
    """The tiny archive (build_mar.py) with ``handler`` (TINY's by default) and model-config ``config``."""
    from scripts import build_mar

    path = tmp / "model-config.yaml"
    path.write_text(yaml.safe_dump({"minWorkers": 1, "maxWorkers": 1, **config, "handler": handler or TINY}))
    return build_mar.main(["--config", str(path), "--output-dir", str(tmp / "store"), "--force"])


@pytest.fixture(scope="module")
def door(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("door")
    srv = start_door(tmp, build(tmp, batchSize=BATCH))
    try:
        yield srv
    finally:
        stop_door(srv)
    assert srv.proc.returncode is not None


def triton_http(srv, binary: bool, tensors=TENSORS):
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(f"127.0.0.1:{srv.http}", network_timeout=60)
    inputs = []
    for name, arr in tensors.items():
        t = httpclient.InferInput(name, list(arr.shape), DTYPES[arr.dtype])
        t.set_data_from_numpy(arr, binary_data=binary)
        inputs.append(t)
    try:
        return client.infer(
            "dlrm", inputs, outputs=[httpclient.InferRequestedOutput("scores", binary_data=binary)], request_id="tc-1"
        )
    finally:
        client.close()


def grpc_check(srv, check: str) -> subprocess.Popen:
    """tests/door_grpc.py's CHECK (tritonclient.grpc and Triton's stubs) against the door, started now in
    a child: Triton's and kserve's generated protos cannot share this process (door_grpc.py says why)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests")}
    return subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "door_grpc.py"), str(srv.grpc), check],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def grpc_result(child: subprocess.Popen) -> dict:
    """What the child saw, once it is done (bounded)."""
    out, err = child.communicate(timeout=300)
    assert child.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_every_form_scores_as_the_in_process_reference(door, reference):
    v1 = json.dumps({"instances": ROWS}).encode()
    status, raw, hdrs = rest(door, "/predictions/dlrm", v1)
    assert status == 200 and hdrs["content-type"] == "application/json", raw
    got = {"predictions": json.loads(raw)["scores"]}
    status, raw, hdrs = rest(door, "/v1/models/dlrm:predict", v1)
    assert status == 200 and set(json.loads(raw)) == {"predictions"}, raw
    got["v1"] = json.loads(raw)["predictions"]
    status, raw, hdrs = rest(door, "/v2/models/dlrm/infer", json.dumps(V2_JSON).encode())
    answer = json.loads(raw)
    assert status == 200 and hdrs["content-type"] == "application/json", raw
    assert {k: answer[k] for k in ("id", "model_name", "model_version")} == {
        "id": "req-42",
        "model_name": "dlrm",
        "model_version": "1.0",
    }
    [out] = answer["outputs"]
    assert (out["name"], out["datatype"], out["shape"]) == ("scores", "FP32", [2, 1])
    got["v2_json"] = out["data"]
    status, raw, _ = rest(door, "/v2/models/dlrm/versions/1.0/infer", json.dumps(V2_JSON).encode())
    got["v2_version"] = json.loads(raw)["outputs"][0]["data"]
    for binary in (True, False):
        result = triton_http(door, binary)
        assert result.get_response()["id"] == "tc-1"
        assert ("binary_data_size" in result.get_output("scores").get("parameters", {})) is binary
        got[f"triton_http_{'binary' if binary else 'json'}"] = result.as_numpy("scores")[:, 0]
    seen = grpc_result(grpc_check(door, "forms"))
    result, typed = seen["raw"], seen["typed"]
    assert result["id"] == "tg-1" and np.asarray(result["scores"]).shape == (2, 1)
    got["triton_grpc_raw"] = np.asarray(result["scores"])[:, 0]
    assert (typed["id"], typed["model_version"], typed["shape"]) == ("typed-1", "1.0", [2, 1])
    got["grpc_typed"] = typed["scores"]
    for name, scores in got.items():
        assert np.abs(np.asarray(scores, np.float64) - np.asarray(reference, np.float64)).max() <= TOL, (name, scores)


def test_binary_v2_answer_is_the_kits_layout(door):
    """A binary request asking for a binary answer gets the TorchServe door's exact layout: JSON header,
    then the raw little-endian scores, its length in Inference-Header-Content-Length."""
    status, body, hdrs = dense_binary(door, binary_output=True)
    n = int(hdrs["inference-header-content-length"])
    assert status == 200 and hdrs["content-type"] == "application/octet-stream", body
    assert json.loads(body[:n]) == {
        "model_name": "dlrm",
        "model_version": "1.0",
        "outputs": [{"name": "scores", "datatype": "FP32", "shape": [2, 1], "parameters": {"binary_data_size": 8}}],
    }
    assert np.frombuffer(body[n:], "<f4").shape == (2,)


def test_health_readiness_and_metadata_answer_truthfully(door):
    seen = grpc_result(grpc_check(door, "health"))
    assert seen["live"] and seen["ready"]
    assert seen["unknown"]["status"] == "StatusCode.NOT_FOUND", seen["unknown"]
    meta = seen["metadata"]
    inputs = [{"name": "dense", "datatype": "FP32", "shape": [-1, TINY["num_dense_features"]]}] + [
        {"name": f, "datatype": "INT64", "shape": [-1]} for f in TINY["sparse_features"]
    ]
    as_strings = [{**i, "shape": [str(d) for d in i["shape"]]} for i in inputs]  # proto3 int64 in JSON
    assert meta["name"] == "dlrm" and meta["inputs"] == as_strings
    assert meta["outputs"] == [{"name": "scores", "datatype": "FP32", "shape": ["-1", "1"]}]
    assert get(door.url + "/v2/health/live")[:2] == (200, b'{"live":true}')
    status, body, _ = get(door.url + "/v2/models/dlrm/ready")
    assert (status, json.loads(body)) == (200, {"name": "dlrm", "ready": True})
    status, body, _ = get(door.url + "/v2/models/dlrm")
    assert status == 200 and json.loads(body)["inputs"] == inputs


def test_bad_requests_get_400_naming_the_field_beside_a_good_one(door, reference):
    from tritonclient.utils import InferenceServerException

    out_of_range = {**TENSORS, "feature_0.values": np.array([3, 4, 25])}
    calls = {
        "predictions": lambda: rest(door, "/predictions/dlrm", json.dumps(instance([1, 2])).encode()),
        "v1": lambda: rest(
            door, "/v1/models/dlrm:predict", json.dumps({"instances": [ROWS[0], instance([])]}).encode()
        ),
        "v2_unknown": lambda: rest(
            door,
            "/v2/models/dlrm/infer",
            json.dumps(
                {
                    "inputs": V2_JSON["inputs"][:1]
                    + [{"name": "feature_9", "datatype": "INT64", "shape": [2], "data": [1, 2]}]
                }
            ).encode(),
        ),
        "v2_no_shape": lambda: rest(
            door, "/v2/models/dlrm/infer", json.dumps({"inputs": [{"name": "dense", "datatype": "FP32"}]}).encode()
        ),
        "v2_malformed": lambda: rest(door, "/v2/models/dlrm/infer", b'{"inputs": ['),
        "form": lambda: rest(door, "/predictions/dlrm", b"a=1", {"Content-Type": "application/x-www-form-urlencoded"}),
        "triton_http_range": lambda: triton_http(door, True, out_of_range),
        "good": lambda: rest(door, "/v1/models/dlrm:predict", json.dumps({"instances": ROWS}).encode()),
    }
    child = grpc_check(door, "bad")  # bad gRPC requests and a good one, at once, beside these
    results: dict = {}

    def run(name):
        try:
            results[name] = calls[name]()
        except Exception as e:  # checked below, by name
            results[name] = e

    threads = [threading.Thread(target=run, args=(n,)) for n in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert set(results) == set(calls)
    results.update(grpc_result(child))

    def error(name, key="error"):
        status, raw, hdrs = results[name]
        assert status == 400 and hdrs["content-type"] == "application/json", (name, status, raw)
        return json.loads(raw)[key]

    status, raw, _ = results["predictions"]
    assert (status, json.loads(raw)) == (
        400,
        {"code": 400, "type": "BadRequest", "message": "dense: expected 5 numbers, got 2"},
    )
    assert error("v1") == "instances[1].dense: expected 5 numbers, got 0"
    assert error("v2_unknown").startswith("feature_9: unknown input")
    assert error("v2_no_shape") == "inputs[0].shape: required field is missing"
    assert error("v2_malformed").startswith("body: expected an inference request in JSON, got malformed JSON")
    assert error("form", "message").startswith("body: expected JSON with Content-Type: application/json")
    err = results["triton_http_range"]
    assert isinstance(err, InferenceServerException) and err.status() == "400", err
    assert err.message().startswith("feature_0.values[2]: id 25 is out of range for feature 'feature_0'")
    err = results["grpc_raw_range"]
    assert err["status"] == "StatusCode.INVALID_ARGUMENT", err
    assert err["message"].startswith("feature_0.values[2]: id 25 is out of range for feature 'feature_0'"), err
    err = results["grpc_typed_short"]
    assert err["status"] == "StatusCode.INVALID_ARGUMENT", err
    assert err["message"] == "dense: expected FP32 shape [B, 5], got FP32 [2, 4]", err
    status, raw, _ = results["good"]
    assert status == 200 and np.abs(np.array(json.loads(raw)["predictions"]) - reference).max() <= TOL
    assert np.abs(np.asarray(results["good_grpc"]) - reference).max() <= TOL


def batches(srv) -> dict[str, tuple[float, float, float]]:
    """The door's dlrm_door_batch_requests histogram from its /metrics, per process (pid): (batches,
    batches of one request, requests)."""
    _, text, _ = get(srv.url + "/metrics")
    seen: dict[str, dict[str, float]] = {}
    for line in text.decode().splitlines():
        m = re.match(r"dlrm_door_batch_requests_(count|sum|bucket)\{(.*)\} (\S+)$", line)
        if m and (m.group(1) != "bucket" or 'le="1.0"' in m.group(2)):
            pid = re.search(r'pid="(\d+)"', m.group(2)).group(1)  # type: ignore[union-attr]
            seen.setdefault(pid, {})[m.group(1)] = float(m.group(3))
    return {pid: (v.get("count", 0), v.get("bucket", 0), v.get("sum", 0)) for pid, v in seen.items()}


def concurrently(srv, reference, n: int = 24) -> tuple[int, int]:
    """``n`` requests at once, every third a bad one: each gets its own answer (a good one the
    reference's scores, a bad one its 400 naming the field). Returns (batches, batches of more than
    one request) the door scored them in, from its /metrics (summed over its processes)."""
    good = json.dumps({"instances": ROWS}).encode()
    bad = json.dumps({"instances": [ROWS[0], instance([])]}).encode()
    before = batches(srv)
    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(lambda i: rest(srv, "/v1/models/dlrm:predict", bad if i % 3 == 0 else good), range(n)))
    for i, (status, raw, _) in enumerate(results):
        if i % 3 == 0:
            assert (status, json.loads(raw)) == (400, {"error": "instances[1].dense: expected 5 numbers, got 0"}), raw
        else:
            assert status == 200 and np.abs(np.array(json.loads(raw)["predictions"]) - reference).max() <= TOL, raw
    after = batches(srv)
    delta = [np.subtract(after[p], before.get(p, (0, 0, 0))) for p in after]
    assert sum(d[2] for d in delta) == n, (before, after)  # every request scored once, in some batch
    return int(sum(d[0] for d in delta)), int(sum(d[0] - d[1] for d in delta))


def test_queued_requests_are_scored_together_each_answered_alone(door, reference):
    """Requests that queue while a batch is scored are the next call's batch (at most batchSize):
    each still gets its own answer. Rounds until one batch held several requests (bounded)."""
    deadline = time.monotonic() + 60
    while True:
        scored, grouped = concurrently(door, reference)
        if grouped:
            break
        assert time.monotonic() < deadline, f"no batch of more than one request in 60 s ({scored} batches)"
    assert scored < 24
    status, body, _ = get(door.url + "/metrics")
    assert status == 200 and b'dlrm_door_queue_full_total{pid="' not in body  # nothing refused at 24 < 4 x 8


def test_a_full_queue_answers_busy_at_once_and_errors_stay_per_request():
    """The door's Batcher with a fake worker: batches of at most batch_size taken from the queue; a
    request beyond max_queued refused at once with Busy (503; gRPC UNAVAILABLE); a request's own
    error stays its own; a failed call fails its requests only."""
    from dlrm_kserve import Batcher
    from dlrmkit.errors import BadRequest, Busy, OutOfMemory

    started, release = threading.Event(), threading.Event()
    calls: list = []

    def run(reqs, errors):
        calls.append((list(reqs), dict(errors)))
        started.set()
        assert release.wait(30)
        if "boom" in reqs:
            raise OutOfMemory("Out of memory scoring a batch of 9 rows")
        return [(r, errors.get(i), 7, None) for i, r in enumerate(reqs)]

    err = BadRequest("body: expected JSON")

    async def scenario():
        with ThreadPoolExecutor(1) as pool:
            batcher = Batcher(run, pool, batch_size=2, max_queued=3)
            first = asyncio.ensure_future(batcher.submit("a"))
            deadline = time.monotonic() + 30
            while not started.is_set():  # "a" is being scored: what follows waits in the queue
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            queued = [asyncio.ensure_future(batcher.submit(r, err if r == "c" else None)) for r in "bcd"]
            await asyncio.sleep(0)
            with pytest.raises(Busy, match="3 requests are already waiting to be scored"):
                await batcher.submit("e")
            release.set()
            done = await asyncio.gather(first, *queued)
            boom = await asyncio.gather(batcher.submit("boom"), return_exceptions=True)
            after = await batcher.submit("f")
        return done, boom, after

    done, boom, after = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert done == [("a", None, 7, None), ("b", None, 7, None), ("c", err, 7, None), ("d", None, 7, None)]
    assert [c[0] for c in calls] == [["a"], ["b", "c"], ["d"], ["boom"], ["f"]]
    assert calls[1][1] == {1: err}
    assert isinstance(boom[0], OutOfMemory) and boom[0].status == 507
    assert after == ("f", None, 7, None)
    assert Busy("x").status == 503


def test_a_loading_process_and_a_full_queue_answer_503_at_once():
    """The kit's routes in this process (kserve's app): a model still loading (a REST process of
    --workers N) and a full queue answer 503 with a message, never wait."""
    from types import SimpleNamespace

    from fastapi.testclient import TestClient
    from kserve import model_server

    import dlrm_kserve
    from dlrmkit.config import DLRMConfig
    from dlrmkit.errors import Busy
    from dlrmkit.forms import RequestParser

    async def busy(req, error=None):
        raise Busy("the server is busy: 32 requests are already waiting to be scored; retry later")

    worker = SimpleNamespace(parser=RequestParser(DLRMConfig.from_dict(TINY)), model_id=("ghost", "1.0"))
    client = TestClient(model_server.app)
    body = json.dumps({"instances": ROWS})
    try:
        dlrm_kserve.DOORS["ghost"] = SimpleNamespace(worker=None, version="1.0")  # type: ignore[assignment]
        answer = client.post("/v1/models/ghost:predict", content=body)
        assert (answer.status_code, answer.json()) == (503, {"error": "Model with name ghost is not ready."})
        answer = client.post("/predictions/ghost", content=body)
        assert answer.status_code == 503 and answer.json()["message"] == "Model with name ghost is not ready."
        dlrm_kserve.DOORS["ghost"] = SimpleNamespace(worker=worker, version="1.0", score=busy)  # type: ignore[assignment]
        answer = client.post("/v2/models/ghost/infer", content=json.dumps(V2_JSON))
        assert answer.status_code == 503 and answer.json()["error"].startswith("the server is busy: 32 requests")
        answer = client.post("/v2/models/ghost/versions/2.0/infer", content=json.dumps(V2_JSON))
        assert answer.status_code == 404
    finally:
        dlrm_kserve.DOORS.pop("ghost", None)


def test_the_repository_routes_are_refused_and_the_model_stays(door):
    for verb in ("load", "unload"):
        status, body, _ = request("POST", f"{door.url}/v2/repository/models/dlrm/{verb}")
        assert (status, json.loads(body)) == (403, {"error": "model load and unload are disabled on this server"})
    seen = grpc_result(grpc_check(door, "repository"))
    assert seen["unload"]["status"] == "StatusCode.UNIMPLEMENTED", seen["unload"]
    assert "model unload is disabled on this server" in seen["unload"]["message"], seen["unload"]
    assert seen["ready"]


def test_the_command_says_how():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run(
        [sys.executable, str(ROOT / "dlrm_kserve.py"), "--model-path", "x.mar", "--workers", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert run.returncode == 1 and "error: --workers 0: give 1 or more REST processes" in run.stderr, run.stderr
    run = subprocess.run(
        [sys.executable, str(ROOT / "dlrm_kserve.py"), "--help"], capture_output=True, text=True, timeout=120, env=env
    )
    assert run.returncode == 0 and "--model-path" in run.stdout and "--grpc-port" in run.stdout, run.stderr
    assert "--workers N" in run.stdout and "one process per CPU" in run.stdout


def test_workers_default_to_the_cpu_rule(monkeypatch):
    import dlrm_kserve
    from dlrmkit.config import DLRMConfig

    monkeypatch.setattr(dlrm_kserve, "available_cpus", lambda: 4)
    assert dlrm_kserve.default_workers({}, DLRMConfig.from_dict(TINY)) == 4  # one per CPU
    assert dlrm_kserve.default_workers({}, DLRMConfig.from_dict({**TINY, "torch_threads": 2})) == 2
    assert dlrm_kserve.default_workers({"maxWorkers": 3}, DLRMConfig.from_dict(TINY)) == 3  # pinned


def test_a_build_big_model_directory_is_served_where_it_lies(tmp_path):
    """A scripts/build_big.py model directory (int8 tables streamed to disk, no .mar) served as it
    lies: its weights mapped from the directory, every answer equal to the in-process model's."""
    from scripts import build_big
    from dlrmkit.batch import collate, scores
    from dlrmkit.config import DLRMConfig
    from dlrmkit.forms import RequestParser
    from dlrmkit.model import DLRMFactory
    from test_delta_server import REQUESTS

    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({"batchSize": BATCH, "maxWorkers": 1, "handler": dict(TINY)}))
    out = tmp_path / "store" / "big"
    build_big.main(["--config", str(cfg), "--dtype", "int8", "--out", str(out)])
    config = DLRMConfig.from_yaml(out / "model-config.yaml")
    model = DLRMFactory(config).load(out / "dlrm.pt")
    bodies = [*REQUESTS, json.dumps({"instances": ROWS}).encode()]
    wants = [scores(model, collate([RequestParser(config).parse(b)], config)[0], config)[0] for b in bodies]
    srv = start_door(tmp_path, out, model="big")
    try:
        assert str(out / "dlrm.pt") in open(f"/proc/{srv.proc.pid}/maps").read()
        for body, want in zip(bodies, wants):
            routes = [("/predictions/big", "scores")]
            if b'"instances"' in body:  # KServe v1 takes instances only
                routes.append(("/v1/models/big:predict", "predictions"))
            for path, key in routes:
                status, raw, _ = rest(srv, path, body)
                assert status == 200, raw
                assert np.abs(np.asarray(json.loads(raw)[key]) - np.asarray(want)).max() <= TOL, (path, raw, want)
        # the scoring thread by the name the kernel shows (bench/doors.py counts its CPU apart)
        tasks = Path(f"/proc/{srv.proc.pid}/task")
        assert "dlrm-score" in {(t / "comm").read_text().strip() for t in tasks.iterdir()}
    finally:
        stop_door(srv)
    assert out.is_dir() and (out / "dlrm.pt").is_file()  # a model directory is never removed


# --- several processes (--workers 2), following live deltas ------------------------------------


def family(pid: int) -> dict[int, str]:
    """The live descendants of ``pid`` (from /proc): {pid: command line}."""
    parents: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = open(f"/proc/{d}/stat").read()
                state, ppid = stat.rsplit(")", 1)[1].split()[:2]
                if state != "Z":
                    parents[int(d)] = int(ppid)
            except (OSError, ValueError):
                pass
    out, todo = {}, [pid]
    while todo:
        p = todo.pop()
        for child, parent in parents.items():
            if parent == p and child not in out:
                try:
                    out[child] = open(f"/proc/{child}/cmdline").read().replace("\0", " ")
                except OSError:
                    continue
                todo.append(child)
    return out


def running(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def rest_processes(srv) -> list[int]:
    """kserve's spawned REST processes of the door."""
    return sorted(p for p, cmd in family(srv.proc.pid).items() if "multiprocessing.spawn" in cmd)


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    """A model directory (the unpacked .mar, int8 tables) following a delta directory, served by
    --workers 2: two REST processes and the server's own (gRPC). Yields (door, references, base, dir)."""
    from test_delta_server import REQUESTS, DeltaReferences

    tmp = tmp_path_factory.mktemp("door-workers")
    handler = {**TINY, "embedding_dtype": "int8", "delta_dir": str(tmp / "deltas"), "delta_poll_s": 0.05}
    mar = build(tmp, handler, batchSize=BATCH)
    model = tmp / "model"
    with zipfile.ZipFile(mar) as z:
        z.extractall(model)
        base = z.read("delta-base.txt").decode().strip()
    refs = DeltaReferences(
        mar, handler, tmp / "deltas", [*REQUESTS, json.dumps({"instances": ROWS}).encode()], tmp / "reference"
    )
    srv = start_door(tmp, model, "--workers", "2", "--request-log")
    try:
        # each REST process loads its own model (503 until then): wait for the three "serves" lines
        log = wait_until(srv.log.read_text, lambda t: len(re.findall(r"process \d+ serves model dlrm", t)) >= 3, 180)
        assert len(re.findall(r"process \d+ serves model dlrm", log)) >= 3, srv.tail()
        yield srv, refs, base, model
    finally:
        stop_door(srv)


def test_several_processes_answer_rest_and_the_server_grpc(workers):
    srv, refs, _, _ = workers
    log = srv.log.read_text()
    assert "serving dlrm with 2 REST process(es)" in log and "died" not in log, srv.tail()
    children = rest_processes(srv)
    assert len(children) == 2, family(srv.proc.pid)
    expected = np.asarray(refs.scores[0][-1])
    good = json.dumps({"instances": ROWS}).encode()
    seen: dict[str, float] = {}  # batches scored per process, from its /metrics (a scrape reaches one)
    deadline = time.monotonic() + 120
    while not all(seen.get(str(p), 0) > 0 for p in children):
        assert time.monotonic() < deadline, (seen, children)
        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(lambda _: rest(srv, "/v1/models/dlrm:predict", good), range(32)))
        for status, raw, _ in results:
            assert status == 200 and np.abs(np.array(json.loads(raw)["predictions"]) - expected).max() <= TOL, raw
        for _ in range(10):
            seen.update({p: v[0] for p, v in batches(srv).items()})
    grpc = grpc_result(grpc_check(srv, "forms"))
    assert np.abs(np.asarray(grpc["raw"]["scores"])[:, 0] - expected).max() <= TOL
    assert rest_processes(srv) == children  # none restarted
    # --request-log: every REST process writes its access lines (kserve's logging in each kept the filter's answer)
    log = wait_until(srv.log.read_text, lambda t: t.count('"POST /v1/models/dlrm:predict HTTP/1.1" 200') >= 32, 30)
    assert log.count('"POST /v1/models/dlrm:predict HTTP/1.1" 200') >= 32 and "kserve.trace" in log, srv.tail()


def test_no_line_per_request_unless_asked(door):
    """A line per request (uvicorn's access line, kserve's timing lines) costs a fifth of single-row
    throughput: the door writes none by default (--request-log turns them on, above)."""
    status, raw, _ = rest(door, "/predictions/dlrm", json.dumps({"instances": ROWS}).encode())
    assert status == 200, raw
    status, _, _ = rest(door, "/predictions/dlrm", b'{"nope": 1}')
    log = wait_until(door.log.read_text, lambda t: "rejected request on /predictions/dlrm" in t, 30)
    assert status == 400 and "rejected request on /predictions/dlrm" in log  # the kit's own lines stay
    assert "uvicorn.access" not in log and "kserve.trace" not in log and "HTTP/1.1" not in log, door.tail()


def delta_states(model) -> dict[int, int]:
    """Each process's applied delta sequence, from its state file (<model dir>/delta-state/<pid>.json)."""
    out = {}
    for f in (model / "delta-state").glob("*.json"):
        try:
            out[int(f.stem)] = json.loads(f.read_text())["sequence"]
        except (OSError, ValueError, KeyError):
            pass
    return out


def test_a_delta_reaches_every_process_rest_and_grpc(workers):
    """A delta published to handler.delta_dir is applied by the server process and both REST
    processes (one writer, dlrmkit/live/): REST answers carry X-Delta-Sequence 1 and the delta's
    scores, gRPC answers the parameter delta_sequence 1 and the delta's scores."""
    from dlrmkit.live import write_delta
    from test_delta_server import REQUESTS, rows_delta

    srv, refs, base, model = workers
    processes = [srv.proc.pid, *rest_processes(srv)]
    assert wait_until(lambda: delta_states(model), lambda s: all(s.get(p) == 0 for p in processes), 60)
    write_delta(refs.applier.directory, "dlrm", base, 1, rows_delta(1))
    assert refs.follow() == 1 and refs.scores[1] != refs.scores[0]
    states = wait_until(lambda: delta_states(model), lambda s: all(s.get(p) == 1 for p in processes), 60)
    assert all(states.get(p) == 1 for p in processes), (states, processes)
    calls = [i % len(REQUESTS) for i in range(30)]  # each probe many times: every REST process answers some
    with ThreadPoolExecutor(10) as pool:
        results = list(pool.map(lambda i: rest(srv, "/predictions/dlrm", REQUESTS[i]), calls))
    for i, (status, raw, headers) in zip(calls, results):
        got = json.loads(raw)["scores"] if status == 200 else raw
        assert status == 200 and headers["x-delta-sequence"] == "1" and refs.sequences(i, got) == [1], (i, got)
    grpc = grpc_result(grpc_check(srv, "delta"))
    assert grpc["delta_sequence"] == 1, grpc
    assert refs.sequences(len(REQUESTS), grpc["scores"]) == [1], (grpc, refs.scores[1][-1])


def test_sigterm_stops_every_process(workers):
    """Last on this server: SIGTERM to the server stops its REST processes, the live writer, kserve's
    resource tracker; nothing is left (no orphans)."""
    srv = workers[0]
    left = family(srv.proc.pid)
    assert len(left) >= 3, left  # two REST processes and the live writer at least
    srv.proc.terminate()
    srv.proc.wait(90)
    alive = wait_until(lambda: [p for p in left if running(p)], lambda a: not a, timeout=60)
    assert not alive, {p: left[p] for p in alive}
