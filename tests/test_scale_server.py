"""Integration: int8 and fp16 archives end to end through a real TorchServe; two int8 workers
read one memory-mapped copy of the tables."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from conftest import ROOT
from dlrmkit.config import DLRMConfig
from dlrmkit.batch import collate, scores
from dlrmkit.forms import RequestParser
from dlrmkit.model import DLRMFactory
from helpers import wait_until
from scripts.tsctl import Server, post

pytestmark = pytest.mark.integration

SAMPLE = (ROOT / "sample_requests" / "seed_single.json").read_bytes()
TOL = {"int8": 0.02, "fp16": 1e-3}  # max |probability - fp32 probability| on the shipped config


def build(tmp: Path, dtype: str, **top) -> None:
    from scripts import build_mar

    doc = yaml.safe_load((ROOT / "model-config.yaml").read_text())
    doc["handler"]["embedding_dtype"] = dtype
    doc.update(top)
    cfg = tmp / f"model-config-{dtype}.yaml"
    cfg.write_text(yaml.safe_dump(doc))
    build_mar.main(["--config", str(cfg), "--output-dir", str(tmp / "store"), "--model-name", f"dlrm_{dtype}"])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ts-scale")
    build(tmp, "int8", minWorkers=2, maxWorkers=2)
    build(tmp, "fp16")
    srv = Server.on_free_ports(
        tmp / "home",
        model_store=tmp / "store",
        overrides={"load_models": "dlrm_int8=dlrm_int8.mar,dlrm_fp16=dlrm_fp16.mar"},
    )
    try:
        srv.start()
        for dtype in TOL:
            srv.wait_ready(f"dlrm_{dtype}", SAMPLE, timeout=240)
        yield srv
    finally:
        srv.stop()


def test_quantized_models_answer_close_to_fp32(server):
    config = DLRMConfig.from_yaml(ROOT / "model-config.yaml")
    fp32 = DLRMFactory(config).random()
    raws = [
        SAMPLE,
        (ROOT / "sample_requests" / "seed_multi_hot.json").read_bytes(),
        (ROOT / "sample_requests" / "instances.json").read_bytes(),
    ]
    for raw in raws:
        want = scores(fp32, collate([RequestParser(config).parse(raw)], config)[0], config)[0]
        for dtype, tol in TOL.items():
            status, body, _ = post(f"{server.url}/predictions/dlrm_{dtype}", raw)
            assert status == 200, body
            got = json.loads(body)["scores"]
            assert max(abs(a - b) for a, b in zip(got, want)) < tol, (dtype, got, want)


def test_out_of_range_id_is_refused_by_quantized_models(server):
    for dtype in TOL:
        for bad in (1000, 10**9):
            raw = json.dumps({"dense": [0.1] * 5, "sparse": {"keys": ["feature_0"], "values": [bad], "lengths": [1]}})
            status, body, _ = post(f"{server.url}/predictions/dlrm_{dtype}", raw.encode())
            assert status == 400 and f"id {bad} is out of range" in json.loads(body)["message"], (dtype, body)


def test_two_workers_map_one_archive_file(server):
    # The model answers once one worker is up; the second may still be loading: wait for both.
    pids = server.wait_workers_ready("dlrm_int8", 2, timeout=240)
    assert len(pids) == 2

    def mapped(pid):
        return {
            line.split(maxsplit=5)[5]
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
            if line.rstrip().endswith("/dlrm.pt")
        }

    files = wait_until(lambda: [mapped(p) for p in pids], lambda f: all(f), timeout=60)
    assert files[0] and files[0] == files[1], files  # one file, the page cache holds it once
