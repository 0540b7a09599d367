"""int8 on a model it was not tuned on, and ``dense_precision: auto`` (dlrmkit/dense.py plan_int8,
scripts/build_mar.py): a DLRM_DCN trained by scripts/train.py with DistributedModelParallel on 2 CPU
ranks (three multi-hot features), made heavy-tailed without changing its function (one hidden unit
of the top MLP scaled by 1024 in and 1/1024 out: ReLU passes the factor through, powers of two round
nothing), then built as a user would: int8 with --calibrate on training rows, --verify on held-out
ones. Every layer int8 (one activation scale for a layer whose input has a 1024x channel) breaks
MLPerf's contract (AUC ratio 0.632 before plans, refused); the build's sensitivity pass finds the
layer and keeps it fp32, and int8 holds. auto
tries the precisions fastest first (the order injected here: timing decides no test) and serves
the first that keeps the contract, recorded in the archive's config, plan and metadata."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile

import pytest
import torch
import yaml

from conftest import ROOT, tiny_config, variant
from dlrmkit import dense
from dlrmkit.errors import ConfigError
from dlrmkit.model import DLRMFactory
from scripts import build_mar
from scripts.build_big import model_directory

HEAVY = "over_arch.model.0._mlp.1._linear"  # the layer whose input carries the 1024x channel
SCALE = 1024.0


def runs() -> set[str]:
    """The reduced precisions this CPU runs natively: what --verify can judge and auto may offer."""
    flags = dense.cpu_flags()
    return {p for p in ("int8", "bf16") if dense.unsupported(p, flags) is None}


def order_here(order: list[str]) -> list[str]:
    """``order`` less what this CPU cannot run (mixed is int8 with fp32 layers)."""
    return [p for p in order if p == "fp32" or ("int8" if p == "mixed" else p) in runs()]


@pytest.fixture(scope="module")
def heavy(tmp_path_factory):
    """(training folder, heavy-tailed checkpoint .pt, its config with int8 tables)."""
    from dlrmkit.checkpoint import import_checkpoint
    from dlrmkit.config import DLRMConfig

    out = tmp_path_factory.mktemp("heavy")
    argv = ["--out", str(out), "--world-size", "2", "--interaction", "dcn", "--num-sparse", "3", "--bag-size", "8"]
    argv += ["--steps", "300", "--heldout", "600", "--seed", "4"]
    subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), *argv], check=True, timeout=300)
    config = out / "config.yaml"
    build_mar.main(["--checkpoint", str(out / "checkpoint"), "--write-config", str(config)])
    doc = yaml.safe_load(config.read_text())
    doc["handler"]["embedding_dtype"] = "int8"
    config.write_text(yaml.safe_dump(doc))
    state = dict(import_checkpoint(out / "checkpoint", DLRMConfig.from_yaml(config), log=lambda _: None))
    w1, b1, w2 = "over_arch.model.0._mlp.0._linear.weight", "over_arch.model.0._mlp.0._linear.bias", f"{HEAVY}.weight"
    unit = int(state[w2].abs().sum(0).argmax())  # a hidden unit the next layer listens to
    state = {k: v.clone() for k, v in state.items()}
    state[w1][unit] *= SCALE
    state[b1][unit] *= SCALE
    state[w2][:, unit] /= SCALE
    torch.save(state, ckpt := out / "heavy.pt")
    return out, ckpt, config


def with_precision(config, precision: str, tmp_path):
    doc = yaml.safe_load(config.read_text())
    doc["handler"]["dense_precision"] = precision
    tmp_path.mkdir(parents=True, exist_ok=True)
    (path := tmp_path / f"{precision}.yaml").write_text(yaml.safe_dump(doc))
    return path


def build(heavy, precision, tmp_path, *extra, verify=True):
    out, ckpt, config = heavy
    argv = ["--config", str(with_precision(config, precision, tmp_path)), "--checkpoint", str(ckpt)]
    argv += ["--verify", str(out / "verify.jsonl")] if verify else []
    argv += ["--output-dir", str(tmp_path / "store"), *extra]
    return build_mar.main(argv)


def cannot_verify(precision: str) -> str:
    """build_mar's refusal where this CPU cannot run ``precision``: --verify would judge fp32."""
    return f"error: --verify: dense_precision {precision} cannot run on this CPU (this CPU has no "


def archived(mar) -> dict:
    with zipfile.ZipFile(mar) as z:
        names = z.namelist()
        config = next(n for n in names if n.endswith(".yaml"))
        return {
            "config": z.read(config).decode(),
            "plan": json.loads(z.read(dense.PLAN_FILE)) if dense.PLAN_FILE in names else None,
            "metadata": json.loads(z.read("oip-metadata.json")),
        }


def test_int8_finds_the_costly_layer_and_keeps_the_contract(heavy, tmp_path, capsys):
    """Before plans this build was refused (AUC ratio 0.63193: every layer int8, histogram scales).
    The sensitivity pass runs on any CPU (PT2E's reference ops, eagerly); the contract is judged
    only where the int8 half runs natively, and elsewhere --verify refuses before any work."""
    out = heavy[0]
    calibrate = ("--calibrate", str(out / "calibration.jsonl"))
    if "int8" in runs():
        mar = build(heavy, "int8", tmp_path, *calibrate)
    else:
        with pytest.raises(SystemExit) as refused:
            build(heavy, "int8", tmp_path, *calibrate)
        assert refused.value.code.startswith(cannot_verify("int8")), refused.value.code
        assert refused.value.code.endswith("or build without --verify (unchecked); no archive written")
        assert not (tmp_path / "store" / "dlrm.mar").exists()
        mar = build(heavy, "int8", tmp_path, *calibrate, verify=False)
    printed = capsys.readouterr().out
    assert f"kept fp32: {HEAVY}" in printed, printed
    verified = [x for x in printed.splitlines() if x.startswith("[verify] dense_precision int8: AUC ratio ")]
    if "int8" in runs():
        assert len(verified) == 1 and "(contract >= 0.999: holds)" in verified[0], printed
    else:
        assert verified == [] and "the accuracy contract (AUC >= 99.9% of fp32) is not checked" in printed
    plan = archived(mar)["plan"]
    assert plan["precision"] == "int8" and plan["keep"] == [HEAVY] and plan["ranked"][0] == HEAVY
    assert set(plan["sensitivity"]) == set(plan["ranked"]) and len(plan["ranked"]) == 2 + 4 + 3
    assert "dense_precision: int8" in archived(mar)["config"]


def test_int8_that_breaks_the_contract_is_refused(heavy, tmp_path):
    """Without --calibrate there is no plan (dynamic scales per batch): the 1024x channel costs the
    AUC and the build says so, leaving no archive. A CPU without int8 refuses to judge it at all."""
    with pytest.raises(SystemExit) as refused:
        build(heavy, "int8", tmp_path)
    if "int8" in runs():
        assert refused.value.code.startswith("error: --verify: dense_precision int8 breaks the accuracy contract: AUC ")
        assert refused.value.code.endswith(
            "(needs >= 0.999); serve a higher precision (dense_precision: auto serves the fastest that keeps it); no archive written"
        )
    else:
        assert refused.value.code.startswith(cannot_verify("int8")), refused.value.code
    assert not (tmp_path / "store" / "dlrm.mar").exists()


def in_order(order: list[str]):
    """A build_mar.fastest_first that orders the candidates as ``order`` says, with made-up timings."""

    def fastest_first(model, config, candidates, calibration):
        ranked = sorted(candidates, key=lambda c: order.index(c[0]))
        return ranked, {name: float(order.index(name) + 1) for name, _ in ranked}

    return fastest_first


def test_auto_serves_the_fastest_precision_that_keeps_the_contract(heavy, tmp_path, monkeypatch, capsys):
    """auto offers only what this CPU runs natively: on one with neither int8 nor bf16 (AVX2) it
    verifies and serves fp32, whatever the order says."""
    order = ["int8", "mixed", "bf16", "fp32"]
    monkeypatch.setattr(build_mar, "fastest_first", in_order(order))
    out = heavy[0]
    # With a plan int8 holds: chosen first.
    mar = build(heavy, "auto", tmp_path / "calibrated", "--calibrate", str(out / "calibration.jsonl"))
    got = archived(mar)
    first = order_here(order)[0]
    assert f"dense_precision: {first}  # auto: chosen by build_mar.py --verify" in got["config"]
    assert got["plan"]["precision"] == first and got["plan"]["auto"]["refused"] == []
    assert got["plan"]["auto"]["order"] == order_here(order)
    if first == "int8":
        assert got["plan"]["keep"] == [HEAVY]
    assert got["metadata"]["parameters"] == {"dense_precision": first, "dense_precision_chosen_from": "auto"}
    printed = capsys.readouterr().out
    if first == "fp32":
        assert "[build] dense_precision auto: serving fp32" in printed, printed
    else:
        assert f"[build] dense_precision auto: {first} keeps the contract: serving {first}" in printed, printed
    if first != "int8":
        return  # without int8 a plan changes nothing auto offers: the build below would choose the same
    # Without one, int8 (dynamic) breaks it, there is no mixed candidate, and bf16 is next.
    mar = build(heavy, "auto", tmp_path / "dynamic")
    got = archived(mar)
    printed = capsys.readouterr().out
    assert got["plan"]["auto"]["order"] == order_here(["int8", "bf16", "fp32"])
    assert "[build] dense_precision auto: dense_precision int8 breaks the accuracy contract" in printed, printed
    assert [r["precision"] for r in got["plan"]["auto"]["refused"]] == ["int8"]
    assert got["plan"]["auto"]["refused"][0]["auc_ratio"] < 0.999
    chosen = order_here(["bf16", "fp32"])[0]  # the next this CPU runs
    assert f"dense_precision: {chosen}  # auto: chosen by build_mar.py --verify" in got["config"]
    assert got["plan"]["precision"] == chosen
    assert got["metadata"]["parameters"]["dense_precision"] == chosen
    with zipfile.ZipFile(mar) as z:
        assert dense.CALIBRATION_FILE not in z.namelist()


def test_auto_records_a_mixed_choice_for_the_worker_to_rebuild(heavy, tmp_path, monkeypatch, capsys):
    """Mixed first (as on a CPU where it measured fastest): verified as the worker builds it from
    the archive, whose plan keeps the 3 costliest layers fp32 and whose config says int8. A CPU
    without int8 is never offered mixed."""
    if "int8" not in runs():
        plan = {"ranked": [HEAVY, "a", "b", "c"], "keep": [HEAVY]}
        offered = [name for name, _ in build_mar.dense_candidates("auto", plan)]
        assert offered == order_here(["int8", "mixed", "bf16", "fp32"]) and "mixed" not in offered
        return
    monkeypatch.setattr(build_mar, "fastest_first", in_order(["mixed", "int8", "bf16", "fp32"]))
    mar = build(heavy, "auto", tmp_path, "--calibrate", str(heavy[0] / "calibration.jsonl"))
    got = archived(mar)
    assert got["plan"]["auto"]["order"] == ["mixed", "int8", "bf16", "fp32"]
    assert "dense_precision: int8  # auto: chosen by build_mar.py --verify" in got["config"]
    assert got["plan"]["precision"] == "mixed" and got["plan"]["keep"] == got["plan"]["ranked"][:3]
    assert got["plan"]["keep"][0] == HEAVY
    assert got["metadata"]["parameters"]["dense_fp32_layers"] == ",".join(got["plan"]["keep"])
    assert "[build] dense_precision auto: mixed keeps the contract: serving mixed" in capsys.readouterr().out


def test_auto_without_verify_is_refused_and_never_reaches_a_worker(tmp_path, monkeypatch):
    config = ROOT / "model-config.yaml"
    doc = yaml.safe_load(config.read_text())
    doc["handler"]["dense_precision"] = "auto"
    (path := tmp_path / "auto.yaml").write_text(yaml.safe_dump(doc))
    with pytest.raises(SystemExit, match=r"^error: handler.dense_precision: auto picks the fastest precision .* only "):
        build_mar.main(["--config", str(path), "--output-dir", str(tmp_path / "store")])
    assert not (tmp_path / "store").exists()
    cfg = tiny_config(dense_precision="auto")
    assert cfg.build.dense_precision == "auto"  # a build reads it
    with pytest.raises(ConfigError, match=r"^handler.dense_precision: auto is decided when the archive is built"):
        dense.prepare(DLRMFactory(cfg).random(), cfg, tmp_path, [torch.device("cpu")])
    with pytest.raises(ConfigError, match=r"handler.dense_precision: auto needs scripts/build_mar.py --verify"):
        model_directory(tmp_path / "big", path, "dlrm", "1.0")


def test_a_smoothed_layer_computes_the_same_and_the_plan_is_read_back(tmp_path):
    torch.manual_seed(0)
    linear = torch.nn.Linear(12, 5)
    x = torch.randn(30, 12) * torch.logspace(-2, 2, 12)  # channels 10^4 apart
    smoothed = dense.SmoothedLinear(linear, x.abs().amax(0), 0.5)
    torch.testing.assert_close(smoothed(x), linear(x), rtol=1e-5, atol=1e-5)
    config = tiny_config(**variant("dcn"))
    model = DLRMFactory(config).random()
    d, kjt = DLRMFactory(config).probe_batch(64, torch.Generator().manual_seed(1))
    calibration = dense.calibration_inputs(model, [(d, kjt)])
    half = dense.DenseHalf(model)
    first = next(n for n in dense.linear_names(half) if n.startswith("over_arch."))
    with torch.no_grad():
        again = dense.smoothed(half, calibration, {first: 0.75})
        torch.testing.assert_close(again(calibration["dense"], calibration["pooled"]), half(d, model.sparse_arch(kjt)))
    assert isinstance(half.get_submodule(first), torch.nn.Linear)  # the model's own layer is untouched
    assert dense.read_plan(tmp_path) is None
    (tmp_path / dense.PLAN_FILE).write_text(json.dumps({"smooth": {first: 0.5}, "keep": ["x"], "observer": "minmax"}))
    assert dense.read_plan(tmp_path)["keep"] == ["x"]
    assert dense.describe(dense.read_plan(tmp_path)) == (
        f"; minmax activation scales; smoothed: {first} alpha 0.5; fp32 layers (mixed): x"
    )
    (tmp_path / dense.PLAN_FILE).write_text(json.dumps({"keep": "x"}))
    with pytest.raises(ConfigError, match="expected a JSON object with smooth"):
        dense.read_plan(tmp_path)
