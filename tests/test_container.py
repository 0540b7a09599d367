"""Container: the image `make image` builds, run as deploy/kserve's pods run it (the
ServingRuntime's args, the layout of scripts/kserve_deploy.py mounted read-only at /mnt/models,
uid 1000, read-only root, /tmp a tmpfs, all capabilities dropped, base/sizing.yaml's CPU and
memory), answering the seed curl, tritonclient's binary v2 and TorchServe's gRPC with the
in-process model's scores; stopped with SIGTERM under load without losing a request. The image's
second door (its `kserve` command, deploy/kserve/kserve-door's ServingRuntime) is run the same way.

Needs a Docker engine: without one these tests skip (start one: `dockerd &`, or run `.ci/run`,
which installs and starts it); on CI (CI=true) they fail instead."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import zipfile
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import ROOT, TINY, tiny_config, variant
from helpers import grpc_modules, instance
from test_kserve_server import DENSE_ROWS, ROWS, triton

pytestmark = pytest.mark.container

DEPLOY = ROOT / "deploy" / "kserve"
IMAGE = yaml.safe_load((DEPLOY / "base" / "servingruntime.yaml").read_text())["spec"]["containers"][0]["image"]
SEED = {
    "dense": DENSE_ROWS[0].tolist(),
    "sparse": {"keys": ["feature_0", "feature_1"], "values": [3, 4, 7], "lengths": [2, 1]},
}


def docker(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], check=check, capture_output=True, text=True, timeout=900)


def run_args(image: str, name: str, port: int, container_port: int = 8080) -> list[str]:
    """`docker run` as deploy/kserve's securityContext runs the image. /tmp as the pods' emptyDir
    is: writable and executable (Docker's --tmpfs is noexec unless told, and Inductor loads the
    dense half it compiles from its cache there)."""
    return [
        "run",
        "-d",
        "--name",
        name,
        "--user",
        "1000:1000",
        "--read-only",
        "--tmpfs",
        "/tmp:exec",
        "--cap-drop",
        "ALL",
        "--security-opt",
        "no-new-privileges",
        "-p",
        f"127.0.0.1:{port}:{container_port}",
        image,
    ]


def address(container: str) -> str:
    """The container's own address on docker's bridge: the clients talk to TorchServe, not to
    docker-proxy (which accepts, then resets, connections for a server that has stopped)."""
    return docker("inspect", "-f", "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}", container).stdout.strip()


def one(host: str, port: int, body: bytes, timeout: float = 60.0) -> str:
    """'answered', 'lost' or 'refused' for one request on a fresh connection."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.connect()
    except OSError:
        return "refused"
    try:
        conn.request("POST", "/predictions/dlrm", body, {"Content-Type": "application/json"})
    except OSError:
        conn.close()
        return "refused"
    try:
        resp = conn.getresponse()
        data = resp.read()
        return "answered" if resp.status == 200 and b"score" in data else "lost"
    except (OSError, http.client.HTTPException):
        return "lost"
    finally:
        conn.close()


def load_and_stop(
    container: str, host: str, port: int, concurrency: int, load_s: float, body: bytes, grace_s: int = 30
) -> dict:
    """Clients loop on host:port, each request on a fresh connection, until the container has
    exited; `docker stop` (SIGTERM, the Kubernetes default 30 s grace) after `load_s`. Each request
    is answered (a 200 with a score), lost (sent, then the connection broke or an error status
    came) or refused (before it was sent: the server had stopped accepting).
    `before_sigterm`: requests sent before the SIGTERM (the accepted ones: none may be lost),
    `in_flight`: those of them still unanswered at the SIGTERM, `after_sigterm`: sent after it."""
    before = {"answered": 0, "lost": 0, "refused": 0}
    after = {"answered": 0, "lost": 0, "refused": 0}
    in_flight = {"answered": 0, "lost": 0, "refused": 0}
    lock = threading.Lock()
    stop_at: list[float] = []
    done = threading.Event()

    def client():
        while not done.is_set():
            started = time.monotonic()
            outcome = one(host, port, body)
            with lock:
                (after if stop_at and started >= stop_at[0] else before)[outcome] += 1
                if stop_at and started < stop_at[0]:
                    in_flight[outcome] += 1
            if outcome == "refused":
                time.sleep(0.05)  # bounded retry loop while the container goes away

    threads = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    time.sleep(load_s)
    with lock:
        stop_at.append(time.monotonic())
    docker("stop", "-t", str(grace_s), container)
    exit_s = time.monotonic() - stop_at[0]
    done.set()
    for t in threads:
        t.join(timeout=70)
    code = int(docker("inspect", "-f", "{{.State.ExitCode}}", container).stdout.strip())
    return {
        "concurrency": concurrency,
        "load_s": load_s,
        "before_sigterm": before,
        "in_flight": in_flight,
        "after_sigterm": after,
        "exit_code": code,
        "sigterm_to_exit_s": round(exit_s, 2),
    }


@pytest.fixture(scope="session")
def engine():
    """A Docker engine that answers: skipped without one, failed on CI."""
    if shutil.which("docker") is None or docker("info", check=False).returncode != 0:
        why = (
            "no Docker engine: start dockerd (as root: apt-get install docker.io mmdebstrap; dockerd &) or run .ci/run"
        )
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)


@pytest.fixture(scope="session")
def image(engine):
    """`make image`, once per session."""
    subprocess.run(["make", "-C", str(ROOT), "image"], check=True, timeout=1800)
    return IMAGE


class Container:
    """One `docker run`, removed at the end whatever happens."""

    def __init__(
        self,
        image: str,
        args: list[str] = (),
        mount: Path | None = None,
        ports=(8085, 7070, 8082),
        sizing_path: str = "base/sizing.yaml",
    ):
        self.name = f"dlrm-test-{uuid.uuid4().hex[:8]}"
        run = run_args(image, self.name, 0)[:-3]  # as the pods run it, ports below
        for p in ports:
            run += ["-p", f"127.0.0.1::{p}"]
        sizing = yaml.safe_load((DEPLOY / sizing_path).read_text())
        limits = sizing["spec"]["predictor"]["model"]["resources"]["limits"]
        run += ["--cpus", str(limits["cpu"]), "--memory", limits["memory"].replace("Gi", "g")]
        if mount:
            run += ["-v", f"{mount}:/mnt/models:ro"]
        docker(*run, image, *args)

    def port(self, p: int) -> int:
        return int(docker("port", self.name, str(p)).stdout.split(":")[-1].split()[0])

    def url(self, p: int = 8085) -> str:
        return f"http://127.0.0.1:{self.port(p)}"

    def logs(self) -> str:
        out = docker("logs", self.name, check=False)
        return out.stdout + out.stderr

    def remove(self):
        docker("rm", "-f", self.name, check=False)


def post(url: str, body: bytes, path: str = "/predictions/dlrm") -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url + path, body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def ready(c: Container, port: int = 8085, body: bytes | None = None, timeout: float = 180):
    """Wait (bounded) until the model scores a request and says it is ready (/v2/models/dlrm/ready:
    the image's TorchServe warms its frontend first); the container's log on failure."""
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if post(c.url(port), body or json.dumps(SEED).encode())[0] == 200:
                with urllib.request.urlopen(c.url(port) + "/v2/models/dlrm/ready", timeout=10) as r:
                    if r.status == 200:
                        return
        except OSError:  # HTTPError (503 while warming) included
            pass
        time.sleep(1)
    raise AssertionError(f"{c.name} never answered:\n{c.logs()[-4000:]}")


def make_layout(handler: dict) -> Path:
    """scripts/kserve_deploy.py layout of a tiny config, readable by uid 1000 (under a temp folder)."""
    from scripts import kserve_deploy

    out = Path(tempfile.mkdtemp(prefix="dlrm-layout-"))
    config = out / "model-config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "minWorkers": 1,
                "maxWorkers": 1,
                "batchSize": 8,
                "maxBatchDelay": 5,
                "responseTimeout": 60,
                "handler": handler,
            }
        )
    )
    kserve_deploy.main(["layout", "--out", str(out / "models"), "--config", str(config)])
    for p in [out, *out.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    return out / "models"


@pytest.fixture(scope="module")
def layout():
    models = make_layout(TINY)
    try:
        yield models
    finally:
        shutil.rmtree(models.parent, ignore_errors=True)


@pytest.fixture(scope="module")
def runtime_args():
    return yaml.safe_load((DEPLOY / "base" / "servingruntime.yaml").read_text())["spec"]["containers"][0]["args"]


@pytest.fixture(scope="module")
def served(image, layout, runtime_args):
    c = Container(image, runtime_args, layout)
    try:
        ready(c)
        yield c
    finally:
        c.remove()


def reference(rows: list[dict]) -> np.ndarray:
    from dlrmkit.batch import collate, scores
    from dlrmkit.forms import RequestParser
    from dlrmkit.model import DLRMFactory

    config = tiny_config()
    batch, bad = collate([RequestParser(config).parse(json.dumps({"instances": rows}))], config)
    assert not bad
    return np.asarray(scores(DLRMFactory(config).random(), batch, config)[0])


class _Url:
    def __init__(self, url):
        self.url = url


def test_seed_triton_and_grpc_give_the_in_process_scores(served, tmp_path):
    import grpc

    want = reference(ROWS)
    status, body = post(served.url(), json.dumps(SEED).encode())
    assert status == 200 and np.allclose(
        body["scores"],
        reference([instance(DENSE_ROWS[0].tolist(), feature_0=[3, 4], feature_1=[7])]),
        atol=1e-5,
        rtol=0,
    )
    result = triton(_Url(served.url()), binary=True)
    assert np.allclose(result.as_numpy("scores")[:, 0], want, atol=1e-5, rtol=0)
    pb, pb_grpc = grpc_modules(tmp_path)
    with grpc.insecure_channel(f"127.0.0.1:{served.port(7070)}") as channel:
        answer = pb_grpc.InferenceAPIsServiceStub(channel).Predictions(
            pb.PredictionsRequest(model_name="dlrm", input={"data": json.dumps({"instances": ROWS}).encode()}),
            timeout=60,
        )
    assert np.allclose(json.loads(answer.prediction)["scores"], want, atol=1e-5, rtol=0)


def test_probe_paths_metrics_and_logs(served):
    import urllib.request

    sizing = yaml.safe_load((DEPLOY / "base" / "sizing.yaml").read_text())["spec"]["predictor"]["model"]
    answers = {}
    for probe in (sizing["livenessProbe"], sizing["startupProbe"], sizing["readinessProbe"]):
        path = probe["httpGet"]["path"]
        with urllib.request.urlopen(served.url(probe["httpGet"]["port"]) + path, timeout=10) as r:
            assert r.status == 200
            answers[path] = json.loads(r.read())
    # Liveness and startup on TorchServe's /ping; readiness on the OIP plugin's model-ready path.
    assert answers == {"/ping": {"status": "Healthy"}, "/v2/models/dlrm/ready": {"name": "dlrm", "ready": True}}, (
        answers
    )
    with urllib.request.urlopen(served.url(8085) + "/v2/models/dlrm", timeout=10) as r:
        meta = json.loads(r.read())
    assert meta["name"] == "dlrm" and {"dense", "scores"} <= {t["name"] for t in meta["inputs"] + meta["outputs"]}
    with urllib.request.urlopen(served.url(8082) + "/metrics", timeout=10) as r:
        assert b"ts_inference_requests_total" in r.read()
    logs = served.logs()
    assert "DLRM loaded on cpu" in logs, logs[-4000:]  # the handler's own log line, on stdout


def test_the_open_inference_protocol_checks_pass_against_the_container(served):
    """tests/test_oip_server.py's checks, through the image's plugin: server live, ready and
    metadata (tritonclient and the kserve SDK), model ready, and an infer request built from the
    model metadata alone scoring as /predictions does."""
    import test_oip_server as oip

    srv = _Url(served.url())
    oip.test_server_live_ready_and_metadata(srv)
    assert oip.triton(srv).is_model_ready("dlrm") and oip.sdk(srv, "is_model_ready", "dlrm") is True
    oip.test_infer_built_from_the_metadata_alone_scores_as_predictions(srv)


def test_two_replicas_on_one_layout_both_answer(image, layout, runtime_args, served):
    other = Container(image, runtime_args, layout)
    try:
        ready(other)
        a, b = (post(c.url(), json.dumps({"instances": ROWS}).encode()) for c in (served, other))
        assert a[0] == b[0] == 200 and np.allclose(a[1]["scores"], b[1]["scores"], atol=1e-6, rtol=0)
    finally:
        other.remove()


def stopped_under_load_losing_nothing(c, port: int) -> None:
    """``docker stop`` of ready ``c`` (SIGTERM, 30 s grace) under 16 clients sending the seed request
    to ``port``: every request sent before it, those in flight included, answered 200; exit 0 in time."""
    result = load_and_stop(c.name, address(c.name), port, concurrency=16, load_s=3, body=json.dumps(SEED).encode())
    assert result["exit_code"] == 0, (result, c.logs()[-4000:])
    assert result["before_sigterm"]["lost"] == 0 and result["before_sigterm"]["answered"] > 0, result
    assert result["in_flight"]["answered"] == result["concurrency"], result
    assert result["sigterm_to_exit_s"] < 30, result


def test_sigterm_under_load_answers_every_accepted_request_and_exits_0(image, layout, runtime_args):
    c = Container(image, runtime_args, layout)
    try:
        ready(c)
        stopped_under_load_losing_nothing(c, 8085)
    finally:
        c.remove()


COMPILE_IN_IMAGE = """
import json, sys, torch
from dlrmkit.model import DLRMFactory
from dlrmkit import dense
from dlrmkit.config import DLRMConfig
config = DLRMConfig.from_dict(json.loads(sys.argv[1]))
model = DLRMFactory(config).random().eval()
served, what = dense._compile(model, config, "int8", None, (2, 4))
with torch.inference_mode():
    out = served.dense(*dense._probe(model, config, 4))
print("COMPILED", what, bool(torch.isfinite(out).all()), tuple(out.shape))
"""


def test_the_image_compiles_the_dense_half_as_the_pods_run_it(image):
    """Inductor's C++ toolchain (g++, omp.h, Python.h) is in the image and works for uid 1000 with
    a read-only root and /tmp its only writable place. The compile itself is called, not the CPU
    check before it, so this holds on every x86 host (an AVX2 one serves such an archive as fp32)."""
    run = run_args(image, f"dlrm-compile-{uuid.uuid4().hex[:8]}", 0)
    run = [a for a in run[:-3] if a != "-d"] + ["--rm", "-v", f"{ROOT}:/kit:ro", "-e", "PYTHONPATH=/kit"]
    run += ["--entrypoint", "/opt/venv/bin/python"]
    out = docker(*run, image, "-c", COMPILE_IN_IMAGE, json.dumps({**TINY, **variant("dcn")}), check=False)
    assert out.returncode == 0 and "COMPILED int8 dynamic" in out.stdout, (out.stdout[-2000:], out.stderr[-4000:])
    assert out.stdout.rstrip().endswith("True (4, 1)"), out.stdout


def test_an_int8_archive_serves_in_the_image_as_in_process(image, runtime_args):
    """An int8 dense half served by the image, as the pods run it: compiled at worker start where
    the CPU has the instructions, scoring as the same int8 model compiled here; on a CPU without
    them the log says FALLING BACK and the scores are fp32's."""
    from dlrmkit import dense
    from dlrmkit.batch import collate, scores
    from dlrmkit.forms import RequestParser
    from dlrmkit.model import DLRMFactory
    import torch

    handler = {**TINY, **variant("dcn"), "dense_precision": "int8"}
    models = make_layout(handler)
    c = Container(image, runtime_args, models)
    try:
        ready(c, timeout=300)
        status, body = post(c.url(), json.dumps({"instances": ROWS}).encode())
        logs = c.logs()
        assert status == 200, (status, body, logs[-4000:])
        config = tiny_config(**variant("dcn"), dense_precision="int8")
        batch, bad = collate([RequestParser(config).parse(json.dumps({"instances": ROWS}))], config)
        # the archive's own calibration rows (a random-weights build makes them) and its int8 plan
        # (observer, smoothing, fp32 layers, chosen at build): the same static scales, the same layers
        (mar,) = models.rglob("*.mar")
        unpacked = models.parent / "unpacked"
        with zipfile.ZipFile(mar) as z:
            z.extract(dense.CALIBRATION_FILE, unpacked)
            z.extract(dense.PLAN_FILE, unpacked)
        model, what = dense.prepare(DLRMFactory(config).random(), config, unpacked, [torch.device("cpu")])
        want = np.asarray(scores(model, batch, config)[0])
        fp32 = np.asarray(scores(DLRMFactory(tiny_config(**variant("dcn"))).random(), batch, config)[0])
        assert np.allclose(body["scores"], want, atol=1e-5, rtol=0), (body["scores"], want)
        if dense.unsupported("int8", dense.cpu_flags()) is None:
            assert what.startswith("int8 static"), what
            assert "dense half: int8 static" in logs and "FALLING BACK" not in logs, logs[-4000:]
            assert not np.allclose(want, fp32, atol=1e-7, rtol=0)  # int8 did run: not the fp32 scores
        else:
            assert "dense half: fp32 (FALLING BACK from int8: this CPU has no " in logs, logs[-4000:]
            assert np.allclose(want, fp32, atol=1e-6, rtol=0)
    finally:
        c.remove()
        shutil.rmtree(models.parent, ignore_errors=True)


def seed_request_scored_as_the_default_model(c) -> None:
    """The README's seed request on port 8080 of ``c`` (the image's own model): once ready, answered
    with the default model's score (model-config.yaml's seeded weights, scored here)."""
    from dlrmkit.config import DLRMConfig
    from dlrmkit.batch import collate, scores
    from dlrmkit.forms import RequestParser
    from dlrmkit.model import DLRMFactory

    body = (ROOT / "sample_requests" / "seed_single.json").read_bytes()
    ready(c, 8080, body)
    status, answer = post(c.url(8080), body)
    config = DLRMConfig.from_yaml(ROOT / "model-config.yaml")
    batch, bad = collate([RequestParser(config).parse(body)], config)
    want = scores(DLRMFactory(config).random(), batch, config)[0]
    assert status == 200 and np.allclose(answer["scores"], want, atol=1e-5, rtol=0), answer


def test_default_docker_run_serves_the_readme_seed_request(image):
    c = Container(image, ports=(8080,))
    try:
        seed_request_scored_as_the_default_model(c)
    finally:
        c.remove()


def path_without(tool: str, into: Path) -> str:
    """A PATH of every command on this one but ``tool``: a machine where it was never installed."""
    into.mkdir()
    for d in os.environ["PATH"].split(os.pathsep):
        for f in Path(d).glob("*") if Path(d).is_dir() else []:
            if f.name != tool and not (into / f.name).exists() and os.access(f, os.X_OK):
                (into / f.name).symlink_to(f)
    assert shutil.which(tool, path=str(into)) is None
    return str(into)


def make_image(base: str, path: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["make", "-C", str(ROOT), "image", f"BASE={base}"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PATH": path},
    )


def exists(image: str) -> bool:
    return docker("image", "inspect", image, check=False).returncode == 0


MISSING = (
    "cannot be pulled and mmdebstrap (which makes it locally) is missing: install it "
    "(Debian: apt-get install mmdebstrap), then run make image again"
)


def test_make_image_without_mmdebstrap_stops_first_and_tags_nothing(engine, tmp_path):
    base = f"debian:bookworm-dlrmtest-{uuid.uuid4().hex[:8]}"  # no registry has it: the local fallback
    out = make_image(base, path_without("mmdebstrap", tmp_path / "bin"))
    assert out.returncode != 0
    assert f"[image] {base} {MISSING}" in out.stderr
    assert "[install]" not in out.stdout + out.stderr  # stopped before the wheelhouse and the build
    assert not exists(base)


def test_an_empty_base_is_removed_and_made_again_never_reused(engine, tmp_path):
    """What an unchecked `mmdebstrap ... - | docker import -` left behind: a 0-byte image."""
    base = f"debian:bookworm-dlrmtest-{uuid.uuid4().hex[:8]}"
    subprocess.run(["docker", "import", "-", base], input=b"", check=True, capture_output=True, timeout=60)
    try:
        assert exists(base)
        out = make_image(base, path_without("mmdebstrap", tmp_path / "bin"))
        assert out.returncode != 0
        assert f"[image] {base} exists but cannot run /bin/sh (an empty or broken image): removing it" in out.stdout
        assert f"[image] {base} {MISSING}" in out.stderr
        assert not exists(base)
        if shutil.which("mmdebstrap") is None and os.environ.get("CI") != "true":
            pytest.skip("mmdebstrap is not installed: the rebuild half needs it (apt-get install mmdebstrap)")
        # With the tool installed the same call makes a base that runs a shell: no manual cleanup.
        subprocess.run(["docker", "import", "-", base], input=b"", check=True, capture_output=True, timeout=60)
        out = subprocess.run(
            ["bash", str(ROOT / "scripts" / "base_image.sh"), base], capture_output=True, text=True, timeout=600
        )
        assert out.returncode == 0, out.stderr
        assert f"[image] {base} made locally" in out.stdout
        assert docker("run", "--rm", "--network", "none", base, "/bin/sh", "-c", "echo ok").stdout == "ok\n"
    finally:
        docker("image", "rm", "-f", base, check=False)


def superseded(tmp_path: Path, label: str) -> str:
    """An image built twice under one tag: the first build's id, left untagged (dangling)."""
    (tmp_path / "Dockerfile").write_text(f"FROM debian:bookworm-slim\nARG N\nLABEL {label}=$N\n")
    tag = f"dlrmkit-test-superseded:{uuid.uuid4().hex[:8]}"
    ids = []
    for n in (1, 2):
        docker("build", "-q", "--build-arg", f"N={n}", "-t", tag, str(tmp_path))
        ids.append(docker("image", "inspect", "-f", "{{.Id}}", tag).stdout.strip())
    docker("image", "rm", tag)
    assert ids[0] != ids[1] and exists(ids[0])
    return ids[0]


def test_a_rebuild_drops_the_images_it_superseded_and_keeps_its_cache(image, tmp_path):
    """Each rebuild left the old image and build stage untagged, ~4 GB: CI's disk filled up."""
    ours = superseded(tmp_path, "dlrmkit.stage")
    theirs = superseded(tmp_path, "someone.else")
    try:
        out = subprocess.run(["make", "-C", str(ROOT), "image"], capture_output=True, text=True, timeout=1800)
        assert out.returncode == 0, out.stderr[-2000:]
        assert not exists(ours)
        assert exists(theirs)  # another project's untagged image is not ours to remove
        dangling = docker("images", "-q", "-f", "dangling=true", "-f", "label=dlrmkit.stage").stdout.split()
        assert dangling == []
        # The build stage stays, tagged, and is the cache: nothing rebuilt, the venv layer reused.
        assert (
            docker(
                "image", "inspect", "-f", '{{index .Config.Labels "dlrmkit.stage"}}', "dlrmkit-build-cache:cpu"
            ).stdout
            == "build\n"
        )
        assert "Running in" not in out.stdout
        assert exists(image)
    finally:
        docker("image", "rm", "-f", ours, theirs, check=False)


# --- the second door: KServe's own model server in the same image --------------------------------

DOOR_RUNTIME = DEPLOY / "kserve-door" / "servingruntime.yaml"
DOOR_SIZING = "kserve-door/sizing.yaml"


@pytest.fixture(scope="module")
def door_args():
    """deploy/kserve/kserve-door's ServingRuntime args (`kserve --model-path=/mnt/models/... ...`)
    and its ports by name (http1: REST, h2c: gRPC)."""
    (container,) = yaml.safe_load(DOOR_RUNTIME.read_text())["spec"]["containers"]
    return container["args"], {p["name"]: p["containerPort"] for p in container["ports"]}


def door_container(image: str, layout: Path | None, args: list[str], ports: dict) -> Container:
    return Container(image, args, layout, ports=(ports["http1"], ports["h2c"]), sizing_path=DOOR_SIZING)


def door_grpc(port: int, check: str) -> dict:
    """tests/door_grpc.py's CHECK against the door, in a child that never imports kserve (its protos
    and tritonclient.grpc's cannot share a process); what it saw, once done (bounded)."""
    child = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "door_grpc.py"), str(port), check],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT / "tests")},
    )
    assert child.returncode == 0, child.stderr[-3000:]
    return json.loads(child.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def door_served(image, layout, door_args):
    args, ports = door_args
    c = door_container(image, layout, args, ports)
    try:
        ready(c, ports["http1"])
        yield c
    finally:
        c.remove()


def test_the_second_door_answers_rest_v2_and_grpc_with_the_in_process_scores(door_served, door_args, tmp_path):
    """The ServingRuntime's args on the layout, as the pod runs them (uid 1000, read-only root, /tmp
    a tmpfs): the seed request on /predictions, tritonclient's binary v2 over REST and
    tritonclient.grpc's ModelInfer (raw and typed contents) score as the in-process model."""
    _, ports = door_args
    url = door_served.url(ports["http1"])
    want = reference(ROWS)
    status, body = post(url, json.dumps(SEED).encode())
    assert status == 200 and np.allclose(
        body["scores"],
        reference([instance(DENSE_ROWS[0].tolist(), feature_0=[3, 4], feature_1=[7])]),
        atol=1e-5,
        rtol=0,
    ), (status, body)
    result = triton(_Url(url), binary=True)
    assert np.allclose(result.as_numpy("scores")[:, 0], want, atol=1e-5, rtol=0)
    status, body = post(url, json.dumps({"instances": ROWS}).encode(), "/v1/models/dlrm:predict")
    assert status == 200 and np.allclose(body["predictions"], want, atol=1e-5, rtol=0), body
    seen = door_grpc(door_served.port(ports["h2c"]), "forms")
    assert seen["raw"]["id"] == "tg-1" and np.allclose(np.asarray(seen["raw"]["scores"])[:, 0], want, atol=1e-5)
    assert seen["typed"]["model_version"] == "1.0" and np.allclose(seen["typed"]["scores"], want, atol=1e-5)


def test_the_second_doors_probe_paths_answer(door_served, door_args):
    """kserve-door/sizing.yaml's probes, on the port it names; gRPC's ServerLive and ModelReady too."""
    import urllib.request

    _, ports = door_args
    model = yaml.safe_load((DEPLOY / DOOR_SIZING).read_text())["spec"]["predictor"]["model"]
    answers = {}
    for probe in (model["startupProbe"], model["livenessProbe"], model["readinessProbe"]):
        get = probe["httpGet"]
        assert get["port"] == ports["http1"]
        with urllib.request.urlopen(door_served.url(get["port"]) + get["path"], timeout=10) as r:
            assert r.status == 200
            answers[get["path"]] = json.loads(r.read())
    assert answers == {"/v2/health/live": {"live": True}, "/v2/models/dlrm/ready": {"name": "dlrm", "ready": True}}
    seen = door_grpc(door_served.port(ports["h2c"]), "health")
    assert seen["live"] and seen["ready"], seen


def test_the_images_kserve_command_serves_the_default_model(image, door_args):
    """`docker run IMAGE kserve`: the second door on the image's own model, REST 8080 and gRPC 8081,
    answering the README's seed request with the default model's score."""
    c = door_container(image, None, ["kserve"], {"http1": 8080, "h2c": 8081})
    try:
        seed_request_scored_as_the_default_model(c)
        assert door_grpc(c.port(8081), "health")["live"]
    finally:
        c.remove()


def test_the_second_door_drains_on_sigterm_and_exits_0(image, layout, door_args):
    """`docker stop` (SIGTERM, 30 s grace) under 16 concurrent clients: every request sent before it,
    those in flight included, answered 200; the container exits 0 within the grace period."""
    args, ports = door_args
    c = door_container(image, layout, args, ports)
    try:
        ready(c, ports["http1"])
        stopped_under_load_losing_nothing(c, ports["http1"])
    finally:
        c.remove()
