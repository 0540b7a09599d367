"""Integration, operations: Prometheus metrics, request tracing, readiness and rollouts on a real
TorchServe (the production config: token authorization and the model API on, loopback ports)."""

from __future__ import annotations

import json
import re
import threading
import time
import zipfile
from pathlib import Path

import pytest
import yaml

from conftest import ROOT
from helpers import body, instance, metrics_delta as wait_for, scrape, settled, wait_until
from test_server import SAMPLES, build_archive
from scripts.tsctl import Server, get, post

pytestmark = pytest.mark.integration

PROBE = (SAMPLES / "seed_single.json").read_bytes()
GOOD = body(instance([0.1, 0.2, 0.3, 0.4, 0.5], feature_0=[1, 2], feature_2=[999]))
OUT_OF_RANGE = body(instance([0.1, 0.2, 0.3, 0.4, 0.5], feature_0=[1000, 2500]))  # tables of 1,000 rows


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ops")
    store = build_archive(tmp)
    srv = Server.on_free_ports(tmp / "home", properties=ROOT / "config.production.properties", model_store=store)
    try:
        srv.start()
        srv.wait_ready("dlrm", PROBE, timeout=180)
        yield srv
    finally:
        srv.stop()


def predict(srv, raw: bytes, version: str = "", headers: dict | None = None):
    url = f"{srv.url}/predictions/dlrm" + (f"/{version}" if version else "")
    status, answer, hdrs = post(url, raw, headers={**srv.auth(), **(headers or {})})
    return status, json.loads(answer), {k.lower(): v for k, v in hdrs.items()}


def versions(srv) -> list[tuple[str, str]]:
    status, answer, _ = get(f"{srv.management_url}/models/dlrm/all", headers=srv.auth("management"))
    assert status == 200, answer
    return sorted((v["modelVersion"], v["modelUrl"]) for v in json.loads(answer))


def default_version(srv) -> str:
    status, answer, _ = get(f"{srv.management_url}/models/dlrm", headers=srv.auth("management"))
    return json.loads(answer)[0]["modelVersion"]


def test_custom_metrics_appear_in_prometheus_text(server):
    before = settled(server)
    sent = [
        GOOD,
        body({"instances": [instance([0] * 5)] * 3}),
        b"{",
        OUT_OF_RANGE,
        body({"instances": [instance([0] * 5)] * 4097}),
    ]
    statuses = [predict(server, raw)[0] for raw in sent]  # one at a time: one batch each
    assert statuses == [200, 200, 400, 400, 413]
    delta = wait_for(server, {"dlrm_batches_total": 5, "dlrm_rejected_requests_total[PayloadTooLarge]": 1}, before)
    assert delta["dlrm_batches_total"] == 5
    assert delta["dlrm_requests_total"] == 5
    assert delta["dlrm_instances_total"] == 4
    assert delta["dlrm_rejected_requests_total[BadRequest]"] == 2
    assert delta["dlrm_rejected_requests_total[PayloadTooLarge]"] == 1
    assert delta.get("dlrm_remapped_ids_total", 0) == 0  # id_overflow: error here (see the rollout test)
    for phase in ("preprocess", "inference", "postprocess"):
        assert 0 < delta[f"dlrm_{phase}_ms_total"] < 30_000, phase
    status, text, _ = get(f"{server.metrics_url}/metrics")
    assert b"ts_inference_requests_total" in text and b"# TYPE dlrm_batches_total counter" in text


def test_a_run_of_batches_costs_the_frontend_a_few_metric_lines_not_eight_a_batch(server):
    """TorchServe's frontend reads every line a worker writes, matches it and logs it again: the
    handler sums its metrics and emits them every 0.25 s (DLRM_METRICS_SECONDS), so 60 batches
    in a row are a few lines each, not one a batch, TorchServe's PredictionTime too; the worker's
    receipt line is gone; the totals are exact."""
    ts_log, model_log = server.log_dir / "ts_log.log", server.log_dir / "model_log.log"
    before = settled(server)

    def emissions(metric: str = "dlrm_batches_total") -> set[str]:
        # the frontend logs each line it reads twice (INFO and DEBUG): distinct ones
        return {line for line in ts_log.read_text().splitlines() if f"[METRICS]{metric}." in line}

    earlier, predictions = emissions(), emissions("PredictionTime")
    n, started = 60, time.monotonic()
    assert [predict(server, GOOD)[0] for _ in range(n)] == [200] * n  # one at a time: one batch each
    delta = wait_for(server, {"dlrm_batches_total": n, "dlrm_requests_total": n, "dlrm_instances_total": n}, before)
    assert (delta["dlrm_batches_total"], delta["dlrm_requests_total"], delta["dlrm_instances_total"]) == (n, n, n)
    lines = len(emissions() - earlier)
    # at most one emission per worker every 0.25 s over the run, however slow the machine; per batch: n
    most = len(server.worker_pids("dlrm")) * ((time.monotonic() - started) / 0.25 + 1)
    assert 1 <= lines < n and lines <= most, f"{lines} dlrm_batches_total lines for {n} batches (at most {most:.0f})"
    # TorchServe's own per-batch gauge goes out with them (distinct lines: each names its request)
    lines = len(emissions("PredictionTime") - predictions)
    assert 1 <= lines < n and lines <= most, f"{lines} PredictionTime lines for {n} batches (at most {most:.0f})"
    status, text, _ = get(f"{server.metrics_url}/metrics")
    gauge = [ln for ln in text.splitlines() if ln.startswith(b'PredictionTime{ModelName="dlrm",Level="Model"')]
    assert status == 200 and len(gauge) == 1 and float(gauge[0].rsplit(b" ", 1)[1]) > 0, gauge
    assert "Backend received inference at" not in model_log.read_text()


def test_rejections_are_logged_with_both_request_ids_and_client_ids_are_echoed(server):
    status, answer, headers = predict(server, b"{", headers={"X-Request-Id": "trace-7f3a"})
    assert status == 400 and headers["x-client-request-id"] == "trace-7f3a"
    ts_id = headers["x-request-id"]  # TorchServe's own id, never the client's
    assert re.fullmatch(r"[0-9a-f-]{36}", ts_id)
    status, _, headers = predict(server, GOOD, headers={"x-request-id": "trace-ok"})
    assert status == 200 and headers["x-client-request-id"] == "trace-ok"
    status, _, headers = predict(server, GOOD)
    assert status == 200 and "x-client-request-id" not in headers
    log = server.log_dir / "model_log.log"
    text = wait_until(log.read_text, lambda t: f"rejected request {ts_id}" in t)
    line = next(ln for ln in text.splitlines() if f"rejected request {ts_id}" in ln)
    assert line.endswith(
        f"rejected request {ts_id} client trace-7f3a (400): body: expected a JSON object, "
        "got malformed JSON (input data was truncated)"
    )
    assert server.token("inference") not in log.read_text()


def test_readiness_probe_and_liveness(server, capsys):
    from scripts import serve

    assert serve.main(["ready", "--home", str(server.home)]) == 0
    assert "ready: " in capsys.readouterr().out
    assert serve.main(["ready", "--home", str(server.home), "--model", "nope"]) == 1
    assert "not ready: " in capsys.readouterr().out
    status, answer, _ = get(f"{server.url}/ping", headers=server.auth())
    assert status == 200 and json.loads(answer)["status"] == "Healthy"


def test_rollout_under_load_loses_no_request(server, tmp_path):
    """The default path: build version N+1 (2.0) from a model config, roll it out while clients
    keep sending. 2.0 folds out-of-range ids (id_overflow: modulo), so it tells itself apart from
    1.0, which answers them with 400."""
    from scripts import rollout

    assert default_version(server) == "1.0"
    doc = yaml.safe_load((ROOT / "model-config.yaml").read_text())
    doc["handler"]["id_overflow"] = "modulo"
    config = tmp_path / "modulo.yaml"
    config.write_text(yaml.safe_dump(doc))
    results, stop = [], threading.Event()

    def client():
        while not stop.is_set():
            try:
                status, answer, _ = predict(server, GOOD)
                results.append(status if "scores" in answer else -1)
            except OSError as e:  # a dropped or hung request counts as failed
                results.append(repr(e))

    clients = [threading.Thread(target=client) for _ in range(2)]
    for c in clients:
        c.start()
    try:
        wait_until(lambda: len(results), lambda n: n >= 5)  # the clients are sending
        rc = rollout.main(["--home", str(server.home), "--config", str(config), "--timeout", "120"])
        time.sleep(0.5)
    finally:
        stop.set()
        for c in clients:
            c.join(timeout=60)
    assert rc == 0
    failed = [r for r in results if r != 200]
    assert len(results) >= 20 and not failed, (len(results), failed[:5])
    assert default_version(server) == "2.0"
    assert versions(server) == [("2.0", "dlrm-v2.0.mar")]
    before = scrape(server)
    status, _, _ = predict(server, OUT_OF_RANGE)  # 2.0 folds ids; 1.0 answered 400
    assert status == 200
    assert wait_for(server, {"dlrm_remapped_ids_total": 2}, before)["dlrm_remapped_ids_total"] == 2
    state = json.loads((server.home / "rollout.json").read_text())
    assert state["previous"] == {"modelVersion": "1.0", "modelUrl": "dlrm.mar"}


def broken_archives(srv, tmp: Path) -> dict[str, str]:
    """Two ways to be broken, as version 3.0: weights that do not load; a model that loads but
    cannot score the probe (13 dense features, the probe has 5)."""
    from scripts import build_mar

    src = srv.model_store / "dlrm.mar"
    with zipfile.ZipFile(src) as z:
        files = {n: z.read(n) for n in z.namelist()}
    manifest = json.loads(files["MAR-INF/MANIFEST.json"])
    manifest["model"]["modelVersion"] = "3.0"
    files["MAR-INF/MANIFEST.json"] = json.dumps(manifest).encode()
    files["dlrm.pt"] = b"not a checkpoint"
    with zipfile.ZipFile(srv.model_store / "dlrm-unloadable.mar", "w") as z:
        for name, data in files.items():
            z.writestr(name, data)

    doc = yaml.safe_load((ROOT / "model-config.yaml").read_text())
    doc["handler"].update(num_dense_features=13)
    config = tmp / "wide.yaml"
    config.write_text(yaml.safe_dump(doc))
    build_mar.main(["--config", str(config), "--output-dir", str(tmp), "--version", "3.0"])
    (tmp / "dlrm.mar").rename(srv.model_store / "dlrm-wrong-layout.mar")
    return {"unloadable": "dlrm-unloadable.mar", "wrong layout": "dlrm-wrong-layout.mar"}


def test_rollout_to_a_broken_archive_fails_cleanly(server, tmp_path, capsys):
    from scripts import rollout

    serving = default_version(server)
    before = versions(server)
    for why, archive in broken_archives(server, tmp_path).items():
        assert rollout.main(["--home", str(server.home), "--archive", archive, "--timeout", "120"]) == 1, why
        err = capsys.readouterr().err
        assert f"dlrm {serving} is still serving" in err, (why, err)
        assert (
            "register dlrm-unloadable.mar: its worker failed to start: dlrmkit.errors.ConfigError: "
            if why == "unloadable"
            else "verify 3.0: the probe got HTTP 400"
        ) in err, (why, err)
        assert versions(server) == before, why  # nothing half-registered is left behind
        assert default_version(server) == serving
        assert predict(server, GOOD)[0] == 200


def test_rollback_returns_to_the_previous_version(server):
    from scripts import rollout

    assert default_version(server) == "2.0"
    assert rollout.main(["--home", str(server.home), "--rollback", "--timeout", "120"]) == 0
    assert versions(server) == [("1.0", "dlrm.mar")]
    assert predict(server, OUT_OF_RANGE)[0] == 400  # 1.0 again: ids are not folded
    state = json.loads((server.home / "rollout.json").read_text())
    assert state["previous"]["modelVersion"] == "2.0"  # a second --rollback goes forward again
