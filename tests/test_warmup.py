"""Integration: ready means warm. A real TorchServe with the kit's plugin, token authorization on
(config.production.properties) and a warm-up budget: once its workers have loaded the model, the
plugin sends every form a client uses through the frontend's own inference port until the JVM's
compilers settle or the budget is spent; meanwhile the Open Inference Protocol's readiness answers
503 with what the warm-up has done, although the model already scores; tsctl's wait_ready (make
serve, the benchmarks) returns only once it is warm."""

from __future__ import annotations

import json
import re
import threading
import time

import pytest

from conftest import TINY
from helpers import tiny_mar
from scripts.tsctl import ROOT, Server, get, post

pytestmark = pytest.mark.integration

F = TINY["num_dense_features"]
BUDGET = 8  # seconds: dlrm_warmup_seconds for this server
SEED = json.dumps({"dense": [0.5] * F, "sparse": {"keys": ["feature_1"], "values": [3], "lengths": [1]}}).encode()


def test_the_model_is_ready_only_once_its_frontend_is_warm(tmp_path):
    tiny_mar(tmp_path, minWorkers=2, maxWorkers=2, batchSize=8, maxBatchDelay=5, responseTimeout=60)
    srv = Server.on_free_ports(
        tmp_path / "home",
        properties=ROOT / "config.production.properties",
        model_store=tmp_path / "store",
        overrides={"dlrm_warmup_seconds": BUDGET},
    )
    seen: list[tuple[int, dict, int]] = []  # (ready status, its body, the seed request's status)
    done = threading.Event()

    def watch() -> None:  # the readiness as a probe sees it, from the start
        while not done.is_set():
            try:
                status, body, _ = get(srv.url + "/v2/models/dlrm/ready", headers=srv.auth(), timeout=10)
                scored = post(srv.url + "/predictions/dlrm", SEED, headers=srv.auth(), timeout=30)[0]
                seen.append((status, json.loads(body), scored))
            except (OSError, ValueError):
                pass
            time.sleep(0.1)

    try:
        srv.start()
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        answer = srv.wait_ready("dlrm", SEED, timeout=180)
        # wait_ready returned: the model scores and the plugin says ready, at once
        assert len(answer["scores"]) == 1
        status, body, _ = get(srv.url + "/v2/models/dlrm/ready", headers=srv.auth())
        assert (status, json.loads(body)) == (200, {"name": "dlrm", "ready": True})
        assert get(srv.url + "/v2/health/ready", headers=srv.auth())[0] == 200
        done.set()
        watcher.join(timeout=60)
        log = (srv.log_dir / "ts_log.log").read_text()
        access = (srv.log_dir / "access_log.log").read_text()
        metrics = get(srv.metrics_url + "/metrics")[1].decode()
    finally:
        done.set()
        srv.stop()
    ended = re.findall(
        r"dlrm 1\.0: warm-up ended after (\d+) requests in (\d+) round\(s\), ([0-9.]+) s, "
        r"the JIT at ([0-9.]+|n/a) of a CPU in the last round(?: \((.*)\))?$",
        log,
        re.M,
    )
    assert len(ended) == 1, log[-3000:]
    requests, rounds, seconds, jit, note = ended[0]
    requests, rounds, seconds = int(requests), int(rounds), float(seconds)
    # at least two rounds of a second; then settled, or stopped by the budget (and it says so)
    assert rounds >= 2 and requests > 0 and seconds <= BUDGET + 2
    assert float(jit) < 0.03 or note == "the budget (dlrm_warmup_seconds) ran out before the JIT settled", ended
    # while warming: 503 with the warm-up's progress, though the model already scored the seed request
    # (before the warm-up starts, with one of the two workers loaded: 503 without it)
    unready = [b for status, b, scored in seen if status == 503 and scored == 200]
    warming = [b["warm_up"] for b in unready if "warm_up" in b]
    assert warming and all(w["done"] is False for w in warming) and all(b["ready"] is False for b in unready), seen
    assert all(w["rounds"] <= rounds and w["requests"] <= requests and w["seconds"] <= seconds for w in warming)
    assert max(w["seconds"] for w in warming) > 0  # how long so far, while it runs
    # no 200 before a 503 once the model scores: readiness never flaps back
    first_ok = (
        next(i for i, (status, _, _) in enumerate(seen) if status == 200)
        if any(s == 200 for s, _, _ in seen)
        else len(seen)
    )
    assert all(status == 200 for status, _, _ in seen[first_ok:])
    # every form went through the frontend with the inference token, and was answered 200
    lines = [ln for ln in access.splitlines() if '"POST /' in ln]
    paths = {re.search(r'"POST (\S+) HTTP', ln).group(1) for ln in lines}
    assert {"/predictions/dlrm/1.0", "/v2/models/dlrm/versions/1.0/infer"} <= paths, paths
    warm_lines = [ln for ln in lines if "/1.0" in ln]  # the watcher posts /predictions/dlrm, unversioned
    assert len(warm_lines) == requests and all(re.search(r'HTTP/1\.1" 200 ', ln) for ln in warm_lines)
    # and reached the workers: the handler counted them (the watcher's seed requests beside them)
    counted = float(
        re.search(r'^dlrm_requests_total\{[^}]*ModelName="dlrm"[^}]*\} ([0-9.eE+]+)$', metrics, re.M).group(1)
    )
    assert counted >= requests
    # the production properties set no batch budget: the plugin's default bounds its batches (BatchBudget)
    assert log.count("dlrm: batches stop at 131072 bytes of bodies (dlrm_batch_bytes)") == 2  # one per worker
