"""Integration: a real TorchServe on free loopback ports, real HTTP, the shipped configs."""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from conftest import ROOT
from helpers import instance, metrics_delta, settled
from scripts.tsctl import Server, get, post, request

pytestmark = pytest.mark.integration

SAMPLES = ROOT / "sample_requests"


def build_archive(tmp: Path, **top_level) -> Path:
    """The shipped model-config.yaml, with TorchServe keys changed for the test."""
    from scripts import build_mar

    doc = yaml.safe_load((ROOT / "model-config.yaml").read_text())
    doc.update(top_level)
    config = tmp / "model-config.yaml"
    config.write_text(yaml.safe_dump(doc))
    store = tmp / "store"
    build_mar.main(["--config", str(config), "--output-dir", str(store)])
    return store


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ts")
    # A long batch delay makes concurrent requests share a TorchServe batch.
    store = build_archive(tmp, batchSize=8, maxBatchDelay=100)
    srv = Server.on_free_ports(tmp / "home", model_store=store)
    try:
        srv.start()
        srv.wait_ready("dlrm", (SAMPLES / "seed_single.json").read_bytes(), timeout=180)
        yield srv
    finally:
        srv.stop()
        assert not srv.running()


def predict(srv, raw: bytes, content_type="application/json", headers=None):
    status, body, hdrs = post(f"{srv.url}/predictions/dlrm", raw, content_type, headers)
    return status, json.loads(body), {k.lower(): v for k, v in hdrs.items()}


def batches_for(srv, send, n_requests: int) -> int:
    """Run ``send`` (which makes ``n_requests`` requests) and return how many handler calls
    (TorchServe batches) served them, from the handler's counters once all are counted."""
    before = settled(srv)
    result = send()
    delta = metrics_delta(srv, {"dlrm_requests_total": n_requests}, before)
    assert delta["dlrm_requests_total"] == n_requests, delta
    return result, int(delta["dlrm_batches_total"])


def random_request(rng: random.Random) -> dict:
    """One or several instances, multi-hot bags of different lengths, random key subsets."""

    def one():
        keys = rng.sample(["feature_0", "feature_1", "feature_2"], rng.randint(0, 3))
        return instance(
            [round(rng.uniform(-2, 2), 3) for _ in range(5)],
            **{k: [rng.randrange(1000) for _ in range(rng.randint(0, 4))] for k in keys},
        )

    return one() if rng.random() < 0.6 else {"instances": [one() for _ in range(rng.randint(1, 5))]}


def test_sample_requests_answer(server):
    for name in ["seed_single.json", "seed_multi_hot.json"]:
        status, answer, headers = predict(server, (SAMPLES / name).read_bytes())
        assert status == 200, answer
        assert headers["content-type"] == "application/json"
        assert set(answer) == {"score", "scores"} and 0 < answer["score"] < 1
    status, answer, _ = predict(server, (SAMPLES / "instances.json").read_bytes())
    assert status == 200 and len(answer["scores"]) == 3
    for bad in sorted((SAMPLES / "malformed").glob("*.json")):
        status, answer, headers = predict(server, bad.read_bytes())
        assert status == 400, bad.name
        assert answer["code"] == 400 and answer["type"] == "BadRequest" and answer["message"], bad.name
        assert headers["content-type"] == "application/json"


def test_ranking_form_scores_as_the_same_instances(server):
    ranking = json.loads((SAMPLES / "ranking.json").read_bytes())
    ctx = ranking["context"]
    rows = [
        {"dense": ctx["dense"], "sparse": {k: ctx["sparse"][k] + c["sparse"][k] for k in ("keys", "values", "lengths")}}
        for c in ranking["candidates"]
    ]
    status, got, _ = predict(server, (SAMPLES / "ranking.json").read_bytes())
    assert status == 200 and len(got["scores"]) == 3
    assert got == predict(server, json.dumps({"instances": rows}).encode())[1]
    status, answer, _ = predict(server, (SAMPLES / "malformed" / "ranking_feature_twice.json").read_bytes())
    assert status == 400 and answer["message"].startswith(
        'candidates[0].sparse.keys[0]: feature "feature_1" is also in'
    )


def test_columns_form_scores_as_the_same_instances(server):
    """sample_requests/columns.json: a context plus columns (one single-hot column, one with
    lengths) over HTTP, concurrently with its rows sent as instances."""
    cols = json.loads((SAMPLES / "columns.json").read_bytes())
    ctx, sparse = cols["context"], cols["columns"]["sparse"]
    rows = [
        {
            "dense": ctx["dense"],
            "sparse": {
                "keys": ["feature_0", "feature_1", "feature_2"],
                "values": ctx["sparse"]["values"] + [sparse["feature_1"]["values"][i]] + f2,
                "lengths": [2, 1, len(f2)],
            },
        }
        for i, f2 in enumerate([[4], [6, 9]])
    ]
    with ThreadPoolExecutor(8) as pool:
        answers = list(
            pool.map(
                lambda raw: predict(server, raw),
                [(SAMPLES / "columns.json").read_bytes(), json.dumps({"instances": rows}).encode()] * 4,
            )
        )
    assert {a[0] for a in answers} == {200}
    want = answers[1][1]["scores"]  # batches differ: equal to 1e-5, as any request's scores
    assert all(a[1]["scores"] == pytest.approx(want, abs=1e-5) for a in answers) and len(set(want)) == 2
    bad = dict(cols, columns={"sparse": {"feature_2": {"values": [4, 6], "lengths": [1, 2]}}})
    status, answer, _ = predict(server, json.dumps(bad).encode())
    assert status == 400 and answer["message"] == (
        "columns.sparse.feature_2.values: expected sum(columns.sparse.feature_2.lengths) = 3 ids, got 2"
    )


def test_any_content_type_carrying_json_works(server):
    raw = (SAMPLES / "seed_single.json").read_bytes()
    want = predict(server, raw)[1]
    for ct in ["text/plain", "application/json; charset=utf-8", "application/octet-stream"]:
        assert predict(server, raw, ct)[1] == want, ct
    status, answer, _ = predict(server, raw, "application/x-www-form-urlencoded")  # curl -d without -H
    assert status == 400 and "Content-Type: application/json" in answer["message"]


def test_concurrent_mixed_requests_get_their_solo_scores(server):
    rng = random.Random(11)
    reqs = [json.dumps(random_request(rng)).encode() for _ in range(48)]
    solo = [predict(server, r) for r in reqs]
    assert all(s == 200 for s, _, _ in solo), solo
    with ThreadPoolExecutor(16) as pool:
        together, batches = batches_for(server, lambda: list(pool.map(lambda r: predict(server, r), reqs)), len(reqs))
    assert batches < len(reqs), "no two requests shared a TorchServe batch"
    for (_, a1, _), (s2, a2, _) in zip(solo, together):
        assert s2 == 200
        assert len(a1["scores"]) == len(a2["scores"])
        assert all(abs(x - y) <= 1e-5 for x, y in zip(a1["scores"], a2["scores"])), (a1, a2)


def test_bad_requests_in_a_batch_fail_alone_and_the_worker_survives(server):
    pids = server.worker_pids("dlrm")
    rng = random.Random(5)
    good = [json.dumps(random_request(rng)).encode() for _ in range(12)]
    solo = [predict(server, g)[1] for g in good]
    bad = [
        (b"{", 400, "body:"),
        (
            '{"dense":[1,2,3,4,5],"sparse":{"keys":["féature_0"],"values":[1],"lengths":[1]}}'.encode(),
            400,
            "sparse.keys[0]:",
        ),
        (
            b'{"dense":[1,2,3,4,5],"sparse":{"keys":["feature_0"],"values":[1000],"lengths":[1]}}',
            400,
            "sparse.values[0]: id 1000 is out of range",
        ),
        (b"[" * 200_000, 400, "body:"),
        (
            b'{"dense":[1,2,3,4,5],"sparse":{"keys":["feature_0"],"values":[1],"lengths":[true]}}',
            400,
            "sparse.lengths[0]:",
        ),
        (json.dumps({"instances": [instance([0] * 5)] * 4097}).encode(), 413, "instances:"),
        (b"\xff\xfe{", 400, "body:"),
    ]
    mixed = [(g, 200, s) for g, s in zip(good, solo)] + bad
    rng.shuffle(mixed)
    with ThreadPoolExecutor(16) as pool:
        answers, batches = batches_for(
            server, lambda: list(pool.map(lambda m: predict(server, m[0]), mixed)), len(mixed)
        )
    assert batches < len(mixed), "no two requests shared a TorchServe batch"
    for (raw, want_status, want), (status, answer, headers) in zip(mixed, answers):
        assert status == want_status, (raw[:80], answer)
        assert headers["content-type"] == "application/json"
        if want_status == 200:
            assert all(abs(x - y) <= 1e-5 for x, y in zip(answer["scores"], want["scores"]))
        else:
            assert answer["code"] == want_status and answer["message"].startswith(want), answer
    assert server.worker_pids("dlrm") == pids  # no worker died or restarted


def test_management_and_metrics_are_loopback_only_and_model_api_is_store_only(server):
    status, body, _ = get(f"{server.management_url}/models/dlrm")
    assert status == 200 and json.loads(body)[0]["modelName"] == "dlrm"
    # The model API is on (scripts/rollout.py) but loads only archives from the model store.
    for url, why in [
        ("http://127.0.0.1:9/dlrm.mar", "does not match any allowed URL"),
        ("file:///etc/dlrm.mar", "does not match any allowed URL"),
        ("missing.mar", "Model not found at: missing.mar"),
    ]:
        status, body, _ = request("POST", f"{server.management_url}/models?url={url}")
        assert status == 404 and why in json.loads(body)["message"], url
    status, body, _ = get(f"{server.metrics_url}/metrics")
    assert status == 200 and b"ts_inference_requests_total" in body


def test_rollout_and_rollback_with_token_auth_off(server, tmp_path):
    """scripts/rollout.py on the development config (tests/test_ops_server.py covers token auth
    on, a rollout under load and broken archives). Leaves 1.0 serving, as it found it."""
    from scripts import build_mar
    from scripts import rollout

    build_mar.main(["--output-dir", str(tmp_path), "--version", "1.1"])
    (tmp_path / "dlrm.mar").rename(server.model_store / "dlrm-v1.1.mar")
    assert server.token() is None
    for args, want in [(["--archive", "dlrm-v1.1.mar"], "1.1"), (["--rollback"], "1.0")]:
        assert rollout.main(["--home", str(server.home), "--timeout", "120", *args]) == 0, args
        status, body, _ = get(f"{server.management_url}/models/dlrm/all")
        assert [v["modelVersion"] for v in json.loads(body)] == [want]
        assert predict(server, (SAMPLES / "seed_single.json").read_bytes())[0] == 200
