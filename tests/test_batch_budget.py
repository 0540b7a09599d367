"""Integration: batches bounded. A real TorchServe with the kit's plugin and a model whose config
sets a batch budget (batchBytes) of two large bodies: six large requests queued at once (one
worker, a batch delay long enough for all of them to arrive) are scored as three handler calls of
two, each answered with its own scores; TorchServe alone merges them into one. An instances body
counts 40% of its bytes. Small requests still
merge. The model's key wins over the server's dlrm_batch_bytes."""

from __future__ import annotations

import json
import random
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor

import pytest

from bench.common import expected_scores
from conftest import TINY, tiny_config
from helpers import instance, metrics_delta, settled, tiny_mar
from scripts.tsctl import Server, post

pytestmark = pytest.mark.integration

F = TINY["num_dense_features"]
ROWS = TINY["max_instances_per_request"]


def large(rng: random.Random) -> dict:
    """A request of the most rows a request may have, every row its own, as instances."""
    rows = [
        instance(
            [round(rng.uniform(-2, 2), 2) for _ in range(F)],
            feature_0=[rng.randrange(20)],
            feature_1=[rng.randrange(30)],
            feature_2=[rng.randrange(40)],
        )
        for _ in range(ROWS)
    ]
    return {"instances": rows}


def as_columns(request: dict, size: int) -> bytes:
    """The same rows as columns JSON, padded with spaces to ``size`` bytes."""
    rows = request["instances"]
    sparse = {
        f: {"values": [v for r in rows for k, v in zip(r["sparse"]["keys"], r["sparse"]["values"]) if k == f]}
        for f in ("feature_0", "feature_1", "feature_2")
    }
    body = json.dumps({"columns": {"dense": [r["dense"] for r in rows], "sparse": sparse}}).encode()
    assert len(body) <= size, (len(body), size)
    return body + b" " * (size - len(body))


def test_queued_large_requests_are_scored_as_batches_within_the_budget(tmp_path):
    """instances bodies count 40% of their bytes (they name every feature in every row), other
    bodies their bytes: six bodies of one weight, alternating forms, budget two and a half of them."""
    rng = random.Random(7)
    instances = [json.dumps(large(rng)).encode() for _ in range(3)]
    weight = max(len(b) * 40 // 100 for b in instances)
    columns = [as_columns(large(rng), weight) for _ in range(3)]
    bodies = [b for pair in zip(instances, columns) for b in pair]
    budget = 2 * weight + weight // 2  # two bodies fit, three never
    assert min(map(len, instances)) + weight > budget  # by bytes alone, each body would go alone
    mar = tiny_mar(
        tmp_path, minWorkers=1, maxWorkers=1, batchSize=64, maxBatchDelay=1500, responseTimeout=60, batchBytes=budget
    )
    with zipfile.ZipFile(mar) as z:
        z.extract("dlrm.pt", tmp_path)
    expected = expected_scores(tiny_config(), tmp_path / "dlrm.pt", bodies)
    srv = Server.on_free_ports(tmp_path / "home", model_store=tmp_path / "store", overrides={"dlrm_batch_bytes": 1})
    try:
        srv.start()
        srv.wait_ready("dlrm", bodies[0], timeout=180)
        log = (srv.log_dir / "ts_log.log").read_text()
        assert f"dlrm: batches stop at {budget} bytes of bodies (batchBytes)" in log

        before = settled(srv)
        url = f"{srv.url}/predictions/dlrm"
        with ThreadPoolExecutor(len(bodies)) as pool:
            answers = []
            for b in bodies:  # in this order, each on its way before the next
                answers.append(pool.submit(post, url, b, timeout=60))
                time.sleep(0.02)
            answers = [a.result() for a in answers]
        delta = metrics_delta(srv, {"dlrm_requests_total": len(bodies)}, before)
        assert delta["dlrm_requests_total"] == len(bodies)
        assert delta["dlrm_batches_total"] == 3, delta  # TorchServe alone: 1; instances by bytes: 6
        assert delta["dlrm_instances_total"] == len(bodies) * ROWS
        for (status, body, _), want in zip(answers, expected):
            assert status == 200, body
            got = json.loads(body)["scores"]
            assert got == pytest.approx(want, abs=1e-5)

        # small requests merge as before: 12 one-row bodies well under the budget, one batch or two
        small = [json.dumps(json.loads(b)["instances"][0]).encode() for b in instances * 4]
        before = settled(srv)
        with ThreadPoolExecutor(len(small)) as pool:
            got = list(pool.map(lambda b: post(url, b, timeout=60)[0], small))
        assert got == [200] * len(small)
        delta = metrics_delta(srv, {"dlrm_requests_total": len(small)}, before)
        assert delta["dlrm_batches_total"] <= 2, delta
    finally:
        srv.stop()


def test_a_bad_batch_budget_is_named_in_the_log_and_the_servers_applies(tmp_path):
    tiny_mar(tmp_path, minWorkers=1, maxWorkers=1, batchBytes="lots")
    srv = Server.on_free_ports(tmp_path / "home", model_store=tmp_path / "store", overrides={"dlrm_batch_bytes": 4096})
    probe = json.dumps(instance([0.5] * F, feature_1=[3])).encode()
    try:
        srv.start()
        srv.wait_ready("dlrm", probe, timeout=180)
        log = (srv.log_dir / "ts_log.log").read_text()
    finally:
        srv.stop()
    assert "dlrm: batchBytes: lots is not a number of bytes >= 0 (e.g. batchBytes: 131072); using 4096" in log
    assert "dlrm: batches stop at 4096 bytes of bodies (dlrm_batch_bytes)" in log
