"""Integration: raw Criteo lines from training to a real TorchServe. scripts/train.py trains on a
TSV file through dlrmkit.criteo (the handler's own transform); build_mar.py --fit-dense-shift writes
the config; the server scores the held-out raw lines as the trainer did, scores every raw line as
torchrec's preprocessed row sent as JSON, with lines of one request and of concurrent requests
sharing batches, and answers bad lines 400 without failing the good traffic beside them."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import yaml

from scripts import build_mar
from conftest import ROOT
from helpers import metrics_delta, settled
from test_criteo import MIN_DENSE, TSV, criteo_line, torchrec_rows
from scripts.tsctl import Server, post

pytestmark = pytest.mark.integration
TABLE_ROWS = 50


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("train-tsv")
    rng = random.Random(7)
    lines = [criteo_line(rng, label=True) for _ in range(1200)]
    lines[5] = "\t".join(["0"] + [str(MIN_DENSE)] * 13 + [""] * 26)  # the training minimum
    (out / "day_0.tsv").write_text("\n".join(lines) + "\n")
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "train.py"),
            "--out",
            str(out),
            "--world-size",
            "1",
            "--tsv",
            str(out / "day_0.tsv"),
            "--rows",
            str(TABLE_ROWS),
            "--heldout",
            "200",
            "--batch-size",
            "128",
            "--seed",
            "2",
        ],
        check=True,
        timeout=300,
    )
    return out


@pytest.fixture(scope="module")
def server(trained, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ts-tsv")
    config = tmp / "model-config.yaml"
    ckpt = str(trained / "checkpoint")
    build_mar.main(
        ["--checkpoint", ckpt, "--fit-dense-shift", str(trained / "day_0.tsv"), "--write-config", str(config)]
    )
    doc = yaml.safe_load(config.read_text())
    doc["maxBatchDelay"] = 20  # lets concurrent requests meet in a batch on a busy machine
    config.write_text(yaml.safe_dump(doc))
    store = tmp / "store"
    build_mar.main(["--config", str(config), "--checkpoint", ckpt, "--force", "--output-dir", str(store)])
    srv = Server.on_free_ports(tmp / "home", model_store=store)
    try:
        srv.start()
        srv.wait_ready(
            "dlrm",
            json.dumps({"dense": [0.0] * 13, "sparse": {"keys": [], "values": [], "lengths": []}}).encode(),
            timeout=180,
        )
        yield srv, doc
    finally:
        srv.stop()
        assert not srv.running()


def send(srv, body, content_type=TSV):
    status, out, _ = post(
        f"{srv.url}/predictions/dlrm", body if isinstance(body, bytes) else body.encode(), content_type
    )
    return status, json.loads(out)


def test_held_out_raw_lines_score_as_the_trainer_scored_them(trained, server):
    srv, config = server
    held = json.loads((trained / "heldout.json").read_text())
    assert config["handler"]["dense_shift"] == held["dense_shift"] == 2 - MIN_DENSE
    assert config["handler"]["raw_input"] == "criteo_tsv" and config["handler"]["id_overflow"] == "modulo"
    before = settled(srv)
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda line: send(srv, line + "\n"), held["lines"]))
    assert all(status == 200 for status, _ in answers), answers[:3]
    delta = metrics_delta(srv, {"dlrm_requests_total": len(answers)}, before)
    assert 0 < delta["dlrm_batches_total"] < len(answers), delta  # concurrent lines shared batches
    worst = max(abs(a["score"] - s) for (_, a), s in zip(answers, held["scores"]))
    assert worst <= 1e-5, worst
    status, many = send(srv, "\n".join(held["lines"][:64]))  # one request of 64 lines
    assert status == 200 and max(abs(a - s) for a, s in zip(many["scores"], held["scores"][:64])) <= 1e-5


def test_raw_lines_score_as_torchrecs_rows_sent_as_json_and_bad_lines_fail_alone(trained, server, tmp_path):
    srv, config = server
    rng = random.Random(3)
    lines = [criteo_line(rng, label=rng.random() < 0.5) for _ in range(120)]
    lines[0] = "\t".join([str(MIN_DENSE)] * 13 + ["A"] * 26)  # the minimum: tsv_to_npys' shift is 5 too
    labelled, unlabelled = [x for x in lines if x.count("\t") == 39], [x for x in lines if x.count("\t") == 38]
    (tmp_path / "day_1.tsv").write_text("\n".join(labelled + ["1\t" + lines[0]]) + "\n")
    (tmp_path / "kaggle_test.tsv").write_text("\n".join(unlabelled) + "\n")
    rows = {}
    for name, dataset, group in (
        ("day_1.tsv", "criteo_1tb", labelled),
        ("kaggle_test.tsv", "criteo_kaggle", unlabelled),
    ):
        dense, ids = torchrec_rows(tmp_path / name, dataset, [TABLE_ROWS] * 26)
        rows.update({line: (dense[i], ids[i]) for i, line in enumerate(group)})
    bad = {
        "\t".join(
            ["1"] * 13 + ["a"] * 7 + ["zz12"] + ["a"] * 18
        ): "line 1, field 21 (cat_7): expected hex digits, got 'zz12'",
        lines[1] + "\n" + "\t".join(["1"] * 12): "line 2: expected 39 tab-separated fields (13 integers, 26 hex "
        "ids) or 40 (the label first), got 12",
        "": "body: expected Criteo TSV lines (39 tab-separated fields, or 40 with the label first), got an empty body",
    }

    def as_json(line):
        dense, ids = rows[line]
        return json.dumps(
            {
                "dense": dense.tolist(),
                "sparse": {"keys": [f"cat_{j}" for j in range(26)], "values": ids.tolist(), "lengths": [1] * 26},
            }
        )

    jobs = [(line, TSV) for line in lines] + [(as_json(line), "application/json") for line in lines]
    jobs += [(b, TSV) for b in bad] * 5 + [("\n".join(lines[:40]), TSV)]
    random.Random(1).shuffle(jobs)
    before = settled(srv)
    with ThreadPoolExecutor(16) as pool:
        answers = dict(zip(jobs, pool.map(lambda job: send(srv, *job), jobs)))
    delta = metrics_delta(srv, {"dlrm_requests_total": len(jobs)}, before)
    assert delta["dlrm_batches_total"] < len(jobs), delta
    assert delta["dlrm_rejected_requests_total[BadRequest]"] == 3 * 5, delta
    for body, message in bad.items():
        assert answers[(body, TSV)] == (400, {"code": 400, "type": "BadRequest", "message": message})
    for line in lines:
        (s1, raw), (s2, js) = answers[(line, TSV)], answers[(as_json(line), "application/json")]
        assert s1 == s2 == 200 and abs(raw["score"] - js["score"]) <= 1e-5, (line, raw, js)
    status, many = answers[("\n".join(lines[:40]), TSV)]
    assert status == 200 and max(abs(a - answers[(x, TSV)][1]["score"]) for a, x in zip(many["scores"], lines)) <= 1e-5


def test_invalid_utf8_and_too_many_lines(server):
    srv, config = server
    good = "\t".join(["1"] * 13 + ["a"] * 26)
    status, body = send(srv, (good + "\n1\t\xff\t").encode("latin-1"))
    assert (status, body["message"]) == (400, "line 2, field 2: expected UTF-8 text, got the invalid byte 0xff")
    limit = config["handler"].get("max_instances_per_request", 4096)
    ids_limit = config["handler"].get("max_ids_per_request", 65536)
    n = min(limit, ids_limit // 26) + 1
    status, body = send(srv, "\n".join([good] * n))
    assert status == 413, body
    before = settled(srv)
    status, body = send(srv, "\t".join(["-40"] + ["1"] * 12 + ["a"] * 26))
    assert status == 200 and np.isfinite(body["score"])
    assert metrics_delta(srv, {"dlrm_clipped_dense_total": 1}, before)["dlrm_clipped_dense_total"] == 1
