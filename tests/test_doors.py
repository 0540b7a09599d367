"""Integration: one archive served by both front doors at once, TorchServe (dlrm_handler.py and the
OIP plugin) and KServe's own model server (dlrm_kserve.py), answers every form both accept with the
same scores (max |d| <= 1e-6) on a few hundred mixed rows, and both as the archive's model in this
process scores them."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import yaml

from bench.common import RANKING, expected_scores, make_body, random_body, unpack, v2_binary
from conftest import TINY
from dlrmkit.config import DLRMConfig
from scripts.tsctl import Server
from test_kserve_door import start_door, stop_door
from test_kserve_server import rest

pytestmark = pytest.mark.integration

TOL = 1e-6


def scores_of(status: int, raw: bytes, headers: dict) -> np.ndarray:
    """The scores of an answer of any route: the kit's {"scores"}, v1's {"predictions"}, v2 JSON's
    outputs[0].data or v2 binary's tail (its JSON header's length in Inference-Header-Content-Length)."""
    assert status == 200, raw[:500]
    if "inference-header-content-length" in headers:
        n = int(headers["inference-header-content-length"])
        return np.frombuffer(raw[n:], "<f4").astype(np.float64)
    doc = json.loads(raw)
    found = doc.get("scores", doc.get("predictions"))
    if found is None:
        found = doc["outputs"][0]["data"]
    return np.asarray(found, np.float64).reshape(-1)


def v2_json(binary: bytes) -> bytes:
    """The same tensors as a v2 binary body, as JSON data."""
    n = binary.index(b'"binary_data_output": true}}') + len(b'"binary_data_output": true}}')
    head, tail, at = json.loads(binary[:n]), binary[n:], 0
    for t in head["inputs"]:
        size = t["parameters"].pop("binary_data_size")
        t["data"] = np.frombuffer(tail[at : at + size], "<f4" if t["datatype"] == "FP32" else "<i8").tolist()
        at += size
        del t["parameters"]
    del head["parameters"]
    return json.dumps(head).encode()


def test_both_doors_score_every_form_alike(tmp_path):
    from scripts import build_mar

    config = tmp_path / "model-config.yaml"
    handler = {**TINY, "max_instances_per_request": 64, "max_ids_per_request": 4096}
    doc = {"minWorkers": 1, "maxWorkers": 1, "batchSize": 8, "maxBatchDelay": 5, "handler": handler}
    config.write_text(yaml.safe_dump(doc))
    mar = build_mar.main(["--config", str(config), "--output-dir", str(tmp_path / "store"), "--force"])
    cfg = DLRMConfig.from_yaml(config)
    rng = random.Random(46)
    # (route, body, headers): 100 single rows (random multi-hot subsets), then 64-row requests of
    # every other form: instances (also as KServe v1), ranking, columns, OIP v2 binary and JSON
    sent: list[tuple[str, bytes, dict]] = [("/predictions/dlrm", random_body(rng, cfg, 1), {}) for _ in range(100)]
    instances = random_body(rng, cfg, 64)
    sent += [("/predictions/dlrm", instances, {}), ("/v1/models/dlrm:predict", instances, {})]
    sent += [("/predictions/dlrm", make_body(cfg, rng, 64, form), {}) for form in (RANKING, "columns")]
    binary = v2_binary(cfg, rng, 64)
    length = str(binary.index(b'"binary_data_output": true}}') + len(b'"binary_data_output": true}}'))
    octets = {"Inference-Header-Content-Length": length, "Content-Type": "application/octet-stream"}
    sent += [("/v2/models/dlrm/infer", binary, octets), ("/v2/models/dlrm/infer", v2_json(binary), {})]

    torchserve = Server.on_free_ports(tmp_path / "home", model_store=mar.parent)
    door = None
    try:
        torchserve.start()
        torchserve.wait_ready("dlrm", random_body(rng, cfg, 1), timeout=180)
        door = start_door(tmp_path, mar, "--workers", "1")
        got: dict[str, list[np.ndarray]] = {"torchserve": [], "kserve": []}
        for name, srv in (("torchserve", torchserve), ("kserve", door)):
            for path, body, headers in sent:
                got[name].append(scores_of(*rest(srv, path, body, headers)))
    finally:
        torchserve.stop()
        if door is not None:
            stop_door(door)
    total = sum(len(s) for s in got["torchserve"])
    assert total == 100 + 6 * 64  # 484 rows, each scored by both doors
    for i, (a, b) in enumerate(zip(got["torchserve"], got["kserve"])):
        assert a.shape == b.shape and np.abs(a - b).max() <= TOL, (sent[i][0], a, b)
    # and both as the archive's model in this process (the kit's JSON forms on /predictions)
    kit = [i for i, (path, _, _) in enumerate(sent) if path == "/predictions/dlrm"]
    want = expected_scores(cfg, unpack(mar, tmp_path / "model") / "dlrm.pt", [sent[i][1] for i in kit])
    for i, w in zip(kit, want):
        assert np.abs(got["kserve"][i] - np.asarray(w, np.float64)).max() <= TOL, sent[i][0]
