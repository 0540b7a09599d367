"""Integration: from training to serving. scripts/train.py trains a tiny DLRM with torchrec's
DistributedModelParallel on 2 CPU ranks and saves a DCP checkpoint; build_mar.py writes the config
from it and builds; a real TorchServe with batching serves the held-out rows, sent concurrently."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml

import build_mar
from conftest import ROOT
from helpers import metrics_delta, settled
from train import auc
from tsctl import Server, post

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("train")
    subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), "--out", str(out), "--world-size", "2",
                    "--steps", "120", "--heldout", "600", "--seed", "4",
                    # Each table split along D over both ranks' files: the import reassembles it.
                    "--sharding", "column_wise"], check=True, timeout=300)
    return out


@pytest.fixture(scope="module")
def server(trained, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ts")
    config = tmp / "model-config.yaml"
    build_mar.main(["--checkpoint", str(trained / "checkpoint"), "--write-config", str(config)])
    store = tmp / "store"
    build_mar.main(["--config", str(config), "--checkpoint", str(trained / "checkpoint"), "--force",
                    "--output-dir", str(store)])
    srv = Server.on_free_ports(tmp / "home", model_store=store)
    rows = json.loads((trained / "heldout.json").read_text())["rows"]
    try:
        srv.start()
        srv.wait_ready("dlrm", json.dumps(rows[0]).encode(), timeout=180)
        yield srv, yaml.safe_load(config.read_text())
    finally:
        srv.stop()
        assert not srv.running()


def test_served_scores_are_the_trained_models_own(trained, server):
    srv, config = server
    assert config["batchSize"] > 1  # the written config batches
    assert config["handler"]["sparse_features"] == ["cat_0", "cat_1", "cat_2", "cat_3"]
    held = json.loads((trained / "heldout.json").read_text())
    assert len(held["rows"]) >= 500

    def score(row):
        status, body, _ = post(f"{srv.url}/predictions/dlrm", json.dumps(row).encode(), "application/json")
        assert status == 200, body
        return json.loads(body)["score"]

    before = settled(srv)
    with ThreadPoolExecutor(16) as pool:
        served = list(pool.map(score, held["rows"]))
    # The handler's counters, once every request is counted: fewer batches than requests.
    delta = metrics_delta(srv, {"dlrm_requests_total": len(served)}, before)
    assert delta["dlrm_requests_total"] == len(served), delta
    assert 0 < delta["dlrm_batches_total"] < len(served), f"no two of {len(served)} requests shared a batch: {delta}"
    worst = max(abs(s - t) for s, t in zip(served, held["scores"]))
    assert worst <= 1e-5, worst
    offline, online = auc(held["scores"], held["labels"]), auc(served, held["labels"])
    assert abs(online - offline) <= 1e-6 and online == pytest.approx(held["auc"], abs=1e-6)
    assert online > 0.7, online  # the synthetic clicks carry a signal the model learned


@pytest.mark.parametrize("interaction", ["dcn", "projection"])
def test_every_variant_imports_to_the_trained_models_scores(tmp_path, interaction):
    """train.py (DMP, one rank) -> --write-config -> the import the build runs -> the archive's
    model scores the held-out rows as the trainer did (the test above covers TorchServe)."""
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from dlrm_checkpoint import import_checkpoint
    from dlrm_config import DLRMConfig
    from dlrm_factory import DLRMFactory

    subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), "--out", str(tmp_path), "--world-size", "1",
                    "--interaction", interaction, "--steps", "40", "--heldout", "200"], check=True, timeout=300)
    config_path = tmp_path / "model-config.yaml"
    build_mar.main(["--checkpoint", str(tmp_path / "checkpoint"), "--write-config", str(config_path)])
    config = DLRMConfig.from_yaml(config_path)
    assert config.interaction == interaction
    model = DLRMFactory(config).load_fp32(import_checkpoint(tmp_path / "checkpoint", config, log=lambda _: None))
    held = json.loads((tmp_path / "heldout.json").read_text())
    dense = torch.tensor([r["dense"] for r in held["rows"]])
    ids = torch.tensor([r["sparse"]["values"] for r in held["rows"]])
    kjt = KeyedJaggedTensor(keys=held["sparse_features"], values=ids.T.reshape(-1),  # key-major
                            lengths=torch.ones(ids.numel(), dtype=torch.long))
    with torch.no_grad():
        scores = torch.sigmoid(model(dense, kjt).squeeze(1))
    assert torch.allclose(scores, torch.tensor(held["scores"]), atol=1e-5, rtol=0)
