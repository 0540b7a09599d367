"""Integration: from training to serving. scripts/train.py trains a tiny DLRM_DCN with torchrec's
DistributedModelParallel on 2 CPU ranks, its features named user, item, ctx (no numbered sequence,
not alphabetical), and saves a DCP checkpoint; build_mar.py writes the config from it (refusing to
guess the order a DCP directory does not keep) and builds; a real TorchServe with batching serves
the held-out rows, sent concurrently; --verify proves the archive against the trainer's scores."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml

from scripts import build_mar
from conftest import ROOT
from helpers import metrics_delta, settled
from scripts.train import auc
from scripts.tsctl import Server, post

pytestmark = pytest.mark.integration

TRAINER_ORDER = ["user", "item", "ctx"]  # the trainer's EmbeddingBagConfig order (natural order: ctx, item, user)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("train")
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "train.py"),
            "--out",
            str(out),
            "--world-size",
            "2",
            "--interaction",
            "dcn",
            "--sparse-features",
            ",".join(TRAINER_ORDER),
            "--steps",
            "120",
            "--heldout",
            "600",
            "--seed",
            "4",
            # Each table split along D over both ranks' files: the import reassembles it.
            "--sharding",
            "column_wise",
        ],
        check=True,
        timeout=300,
    )
    return out


def write_config(trained, config) -> None:
    """The model config scripts/build_mar.py derives from the trainer's checkpoint, in its feature order."""
    build_mar.main(
        ["--checkpoint", str(trained / "checkpoint"), "--write-config", str(config)]
        + ["--feature-order", ",".join(TRAINER_ORDER)]
    )


@pytest.fixture(scope="module")
def server(trained, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ts")
    config = tmp / "model-config.yaml"
    write_config(trained, config)
    store = tmp / "store"
    build_mar.main(
        ["--config", str(config), "--checkpoint", str(trained / "checkpoint"), "--force", "--output-dir", str(store)]
    )
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
    assert config["handler"]["sparse_features"] == TRAINER_ORDER and config["handler"]["interaction"] == "dcn"
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


def test_write_config_refuses_to_guess_the_order_a_dcp_directory_does_not_keep(trained, tmp_path):
    with pytest.raises(SystemExit) as exc:
        build_mar.main(["--checkpoint", str(trained / "checkpoint"), "--write-config", str(tmp_path / "c.yaml")])
    assert exc.value.code == (
        f"error: {trained / 'checkpoint'}: a DCP directory does not record the trainer's table order, and its "
        "tables (ctx, item, user) are no numbered sequence (like cat_0 ... cat_25) to read it from. The "
        "interaction reads the embeddings in that order, so any other order serves a plausible, wrong score for "
        "every row. Name them in the order of the trainer's EmbeddingBagConfig list: --feature-order NAME,NAME,NAME"
    )
    assert not (tmp_path / "c.yaml").exists()
    with pytest.raises(SystemExit) as exc:
        build_mar.main(
            [
                "--checkpoint",
                str(trained / "checkpoint"),
                "--write-config",
                str(tmp_path / "c.yaml"),
                "--feature-order",
                "user,item,context",
            ]
        )
    assert exc.value.code == (
        "error: --feature-order user,item,context does not match the checkpoint's features "
        "(ctx, item, user): not in the checkpoint's features: context; missing: ctx"
    )


def test_verify_proves_the_archive_and_refuses_a_wrong_order(trained, tmp_path, capsys):
    """The trainer's verify.jsonl (6 instances requests of 100 rows, with labels) against the archive
    as a worker loads it: the trainer's order passes; the alphabetical one, which a DCP directory
    would suggest, fails the build and leaves no archive."""
    ckpt = str(trained / "checkpoint")
    for order in (TRAINER_ORDER, sorted(TRAINER_ORDER)):
        config = tmp_path / f"{'-'.join(order)}.yaml"
        build_mar.main(["--checkpoint", ckpt, "--write-config", str(config), "--feature-order", ",".join(order)])
    capsys.readouterr()
    store = tmp_path / "store"
    mar = build_mar.main(
        [
            "--config",
            str(tmp_path / "user-item-ctx.yaml"),
            "--checkpoint",
            ckpt,
            "--verify",
            str(trained / "verify.jsonl"),
            "--output-dir",
            str(store),
        ]
    )
    printed = capsys.readouterr().out
    assert mar.is_file()
    held = json.loads((trained / "heldout.json").read_text())
    line = next(x for x in printed.splitlines() if x.startswith("[verify] "))
    assert line.startswith(
        f"[verify] 600 rows in 6 requests of {trained / 'verify.jsonl'} scored by the archive as a worker loads it in "
    ), line
    delta = float(line.split("max |served - trainer| ")[1].split(" ")[0])
    assert delta <= 1e-5 and f"AUC served {held['auc']:.6f} vs trainer {held['auc']:.6f}" in line, line

    wrong = tmp_path / "wrong"
    with pytest.raises(SystemExit) as exc:
        build_mar.main(
            [
                "--config",
                str(tmp_path / "ctx-item-user.yaml"),
                "--checkpoint",
                ckpt,
                "--verify",
                str(trained / "verify.jsonl"),
                "--output-dir",
                str(wrong),
            ]
        )
    assert exc.value.code.startswith("error: --verify: "), exc.value.code
    over = int(exc.value.code.split("--verify: ")[1].split(" of 600 rows")[0])
    assert over > 300, exc.value.code  # nearly every row moves: the over arch reads the tables in this order
    assert "; no archive written." in exc.value.code
    assert not (wrong / "dlrm.mar").exists()
    # A failed proof never replaces a proven archive of the same name.
    proven = mar.read_bytes()
    with pytest.raises(SystemExit):
        build_mar.main(
            [
                "--config",
                str(tmp_path / "ctx-item-user.yaml"),
                "--checkpoint",
                ckpt,
                "--force",
                "--verify",
                str(trained / "verify.jsonl"),
                "--output-dir",
                str(store),
            ]
        )
    assert mar.read_bytes() == proven


@pytest.mark.parametrize("interaction", ["dot", "projection"])
def test_every_variant_imports_to_the_trained_models_scores(tmp_path, interaction):
    """train.py (DMP, one rank) -> --write-config (tables cat_0.., one numbered sequence: no flag
    needed) -> the import the build runs -> the archive's model scores the held-out rows as the
    trainer did (the tests above cover DCN and TorchServe)."""
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from dlrmkit.checkpoint import import_checkpoint
    from dlrmkit.config import DLRMConfig
    from dlrmkit.model import DLRMFactory

    subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "train.py"),
            "--out",
            str(tmp_path),
            "--world-size",
            "1",
            "--interaction",
            interaction,
            "--steps",
            "40",
            "--heldout",
            "200",
        ],
        check=True,
        timeout=300,
    )
    config_path = tmp_path / "model-config.yaml"
    build_mar.main(["--checkpoint", str(tmp_path / "checkpoint"), "--write-config", str(config_path)])
    config = DLRMConfig.from_yaml(config_path)
    assert config.interaction == interaction
    model = DLRMFactory(config).load_fp32(import_checkpoint(tmp_path / "checkpoint", config, log=lambda _: None))
    held = json.loads((tmp_path / "heldout.json").read_text())
    dense = torch.tensor([r["dense"] for r in held["rows"]])
    ids = torch.tensor([r["sparse"]["values"] for r in held["rows"]])
    kjt = KeyedJaggedTensor(
        keys=held["sparse_features"],
        values=ids.T.reshape(-1),  # key-major
        lengths=torch.ones(ids.numel(), dtype=torch.long),
    )
    with torch.no_grad():
        scores = torch.sigmoid(model(dense, kjt).squeeze(1))
    assert torch.allclose(scores, torch.tensor(held["scores"]), atol=1e-5, rtol=0)


def test_an_int8_dense_half_is_built_under_the_accuracy_contract_and_served(trained, tmp_path, capsys):
    """The trained DCN with handler.dense_precision int8: static scales from the trainer's
    calibration.jsonl (training rows, never the verify file); --verify checks MLPerf's AUC rule
    and refuses an archive under a contract it breaks; a real TorchServe serves the archive
    within the contract, its workers saying what runs."""
    from dlrmkit import accuracy, dense

    config = tmp_path / "int8.yaml"
    write_config(trained, config)
    doc = yaml.safe_load(config.read_text())
    doc["handler"]["dense_precision"] = "int8"
    config.write_text(yaml.safe_dump(doc))
    native = dense.unsupported("int8", dense.cpu_flags()) is None
    build = [
        "--config",
        str(config),
        "--checkpoint",
        str(trained / "checkpoint"),
        "--verify",
        str(trained / "verify.jsonl"),
    ]
    # Every order kept is AUC ratio 1.0: a contract of 1.0 refuses int8 unless it changed nothing.
    with pytest.raises(SystemExit) as refused:
        build_mar.main([*build, "--auc-ratio", "1.0", "--output-dir", str(tmp_path / "strict")])
    assert not (tmp_path / "strict" / "dlrm.mar").exists()
    if native:
        assert refused.value.code.startswith(
            "error: --verify: dense_precision int8 breaks the accuracy contract: AUC "
        ), refused.value.code
        assert refused.value.code.endswith(
            "(needs >= 1); serve a higher precision (dense_precision: auto serves the fastest that keeps it); no archive written"
        )
    else:  # this CPU would verify its fp32 fallback, not int8: refused before anything is built
        assert refused.value.code.startswith(
            "error: --verify: dense_precision int8 cannot run on this CPU (this CPU "
            "has no amx_int8 or avx512_vnni or avx_vnni"
        ), refused.value.code
    capsys.readouterr()
    store = tmp_path / "store"
    # Calibrating on the rows the contract is judged on would flatter it: refused.
    with pytest.raises(SystemExit, match="is the --verify file: the contract would be judged on the rows"):
        build_mar.main([*build, "--calibrate", str(trained / "verify.jsonl"), "--output-dir", str(store)])
    # Without the instructions the archive is built unverified (the build says so) and served as fp32.
    mar = build_mar.main(
        [
            *(build if native else build[:-2]),
            "--calibrate",
            str(trained / "calibration.jsonl"),
            "--output-dir",
            str(store),
        ]
    )
    printed = capsys.readouterr().out
    assert f"[build] int8 dense half: static activation scales from {trained / 'calibration.jsonl'}" in printed
    if native:
        line = next(x for x in printed.splitlines() if x.startswith("[verify] dense_precision int8: AUC ratio "))
        assert "(contract >= 0.999: holds)" in line, line
    else:
        assert "[build] warning: dense_precision int8 without --verify: the accuracy contract" in printed
    with zipfile.ZipFile(mar) as z:
        assert dense.CALIBRATION_FILE in z.namelist()

    srv = Server.on_free_ports(tmp_path / "home", model_store=store)
    held = json.loads((trained / "heldout.json").read_text())
    try:
        srv.start()
        srv.wait_ready("dlrm", json.dumps(held["rows"][0]).encode(), timeout=300)

        def score(row):
            # 120 s: on a loaded 2-core host the compiled workers' first batches take seconds
            status, body, _ = post(
                f"{srv.url}/predictions/dlrm", json.dumps(row).encode(), "application/json", timeout=120
            )
            assert status == 200, body
            return json.loads(body)["score"]

        with ThreadPoolExecutor(16) as pool:
            served = list(pool.map(score, held["rows"]))
        log = (srv.log_dir / "model_log.log").read_text()
    finally:
        srv.stop()
    terms = accuracy.contract(served, held["scores"], held["labels"])
    assert terms["holds"], terms
    if native:
        assert "dense half: int8 static (PT2E X86InductorQuantizer, calibrated on " in log
        # the contract is the bound; a row of this small trained model moves by up to ~0.16
        assert 0 < terms["max_dp"] <= 0.25, terms
    else:
        assert "FALLING BACK to fp32" in log and terms["max_dp"] <= 1e-5
