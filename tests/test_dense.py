"""The dense half at reduced precision (dlrmkit/dense.py): the rewrite is exact in fp32, bf16 and
int8 move scores a little and only under the CPU rule, a CPU without the instructions serves fp32."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torchrec.modules.crossnet import LowRankCrossNet

from conftest import ROOT, tiny_config, variant
from dlrmkit import accuracy, dense
from dlrmkit.errors import ConfigError
from dlrmkit.model import DLRMFactory


def probe(config, rows=64, seed=1):
    return DLRMFactory(config).probe_batch(rows, torch.Generator().manual_seed(seed))


def test_the_cross_network_as_linear_pairs_computes_torchrecs_own():
    torch.manual_seed(0)
    net = LowRankCrossNet(in_features=24, num_layers=3, low_rank=5)
    with torch.no_grad():
        for p in net.parameters():
            p.uniform_(-0.3, 0.3)
    x = torch.randn(17, 24)
    pairs = dense.LinearCrossNet(net)
    assert len(list(pairs.modules())) == 1 + 2 + 6  # itself, two lists, 2 x 3 Linear layers the quantizer sees
    torch.testing.assert_close(pairs(x), net(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("interaction", ["dot", "dcn", "projection"])
def test_the_dense_half_after_the_lookup_is_the_models_forward(interaction):
    config = tiny_config(**variant(interaction))
    model = DLRMFactory(config).random()
    d, kjt = probe(config)
    half = dense.DenseHalf(model)
    with torch.no_grad():
        torch.testing.assert_close(half(d, model.sparse_arch(kjt)), model(d, kjt), rtol=1e-5, atol=1e-6)
        assert torch.equal(dense.ServedDLRM(model, half, "fp32")(d, kjt), half(d, model.sparse_arch(kjt)))
    if interaction == "dcn":  # the model keeps torchrec's module; only the half holds the pairs
        assert isinstance(model.inter_arch.crossnet, LowRankCrossNet)


def test_batches_are_padded_to_a_few_sizes_each_made_at_worker_start():
    """8 sizes an octave: a new size is a new oneDNN kernel (a slow first forward), so every size up
    to WARM_ROWS is made at start and no batch needs another; the padding stays under 1/8."""
    sizes = dense.warm_sizes()
    assert sizes[:5] == [2, 4, 8, 16, 18] and sizes[-1] == dense.WARM_ROWS and len(sizes) == 4 + 8 * 8
    for rows in range(1, dense.WARM_ROWS + 1):
        padded = dense.padded_rows(rows)
        assert padded in sizes and rows <= padded and (rows <= 16 or (padded - rows) * 8 < rows), rows
    assert dense.padded_rows(5000) == 5120 and dense.padded_rows(1 << 20) == 1 << 20


@pytest.mark.parametrize("rows", [1, 3, 17, 45])
def test_a_padded_batch_scores_its_own_rows_as_the_model_does(rows):
    """The empty rows added (a zero dense row, an empty bag per feature) change no real row's score
    and never come back; a key-major KJT keeps its values and gains zero lengths."""
    config = tiny_config(**variant("dcn"))
    model = DLRMFactory(config).random()
    d, kjt = probe(config, rows, seed=rows)
    padded = dense.pad_kjt(kjt, rows, dense.padded_rows(rows))
    assert torch.equal(padded.values(), kjt.values())
    assert torch.equal(padded.lengths().view(config.num_features, -1)[:, :rows], kjt.lengths().view(-1, rows))
    assert int(padded.lengths().view(config.num_features, -1)[:, rows:].abs().sum()) == 0
    with torch.inference_mode():
        got = dense.ServedDLRM(model, dense.DenseHalf(model), "fp32")(d, kjt)
        want = model(d, kjt)
    assert got.shape == (rows, 1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_reduced_precision_moves_scores_a_little_and_says_what_runs(precision):
    """Compiled and quantized for real on this CPU; a CPU without the instructions serves fp32
    (the same scores) and says FALLING BACK."""
    config = tiny_config(**variant("dcn"), dense_precision=precision)
    model = DLRMFactory(config).random()
    d, kjt = probe(config, 256)
    with torch.inference_mode():
        want = torch.sigmoid(model(d, kjt))
    calibration = dense.calibration_inputs(model, [probe(config, 256, seed=s) for s in (5, 6)])
    assert calibration["dense"].shape == (dense.CALIBRATION_ROWS, 5)
    served, what = dense.compile_dense(model, config, precision, calibration if precision == "int8" else None)
    with torch.inference_mode():
        got = torch.sigmoid(served(d, kjt))
        one = torch.sigmoid(served(d[:1], probe(config, 1)[1]))  # B = 1 runs the B >= 2 graph padded
        with_one = torch.sigmoid(model(d[:1], probe(config, 1)[1]))
    delta = float((got - want).abs().max())
    if dense.unsupported(precision, dense.cpu_flags()):
        assert what.startswith(f"fp32 (FALLING BACK from {precision}: this CPU has no "), what
        assert served is model and delta == 0
        return
    assert what.startswith(
        {
            "bf16": "bf16 (autocast), Inductor with freezing",
            "int8": "int8 static (PT2E X86InductorQuantizer, calibrated on 512 rows",
        }[precision]
    ), what
    mean = float((got - want).abs().mean())
    assert 0 < delta and mean <= 0.02, (delta, mean)  # it ran reduced, and close (tiny layers quantize coarsely)
    assert float((one - with_one).abs().max()) <= 0.25
    assert served.sparse_arch is model.sparse_arch  # the tables are the model's: no copy


def test_int8_without_calibration_is_dynamic_and_says_so():
    config = tiny_config(dense_precision="int8")
    model = DLRMFactory(config).random()
    served, what = dense.compile_dense(model, config, "int8", None)
    if dense.unsupported("int8", dense.cpu_flags()):
        assert "FALLING BACK" in what
    else:
        assert what.startswith(
            "int8 dynamic (PT2E X86InductorQuantizer, activation scales per batch: the archive "
            "has no dense-calibration.pt"
        ), what


def test_the_int8_compile_itself_runs_on_any_x86_cpu():
    """The compile and calibration machinery, past the CPU check, on whatever CPU runs the tests
    (on an AVX2 one its scores are not served: the worker falls back), so every CI host covers it."""
    from dlrmkit.parts import pooled_view

    config = tiny_config(**variant("dcn"), dense_precision="int8")
    model = DLRMFactory(config).random().eval()
    assert pooled_view(model.sparse_arch)  # as DLRMFactory.load serves it
    dense_x, kjt = probe(config)
    calibration = dense.calibration_inputs(model, [probe(config, seed=s) for s in (2, 3)])
    served, what = dense._compile(model, config, "int8", calibration, (2, 8))
    assert what.startswith("int8 static (PT2E X86InductorQuantizer, calibrated on 128 rows"), what
    with torch.inference_mode():
        got, want = served(dense_x, kjt), model(dense_x, kjt)
    assert got.shape == want.shape and bool(torch.isfinite(got).all())


def test_served_batches_never_compile_the_half_again(monkeypatch):
    """Dynamo guards each input's dispatch keys: the half is made at start under inference_mode as
    scores() serves it, and a batch of a made size (a tensor from outside inference_mode) or a
    handler.split_rows part (a view of one) is handed over as an inference tensor, as a padded batch
    is: no recompile (~2 s each in the middle of serving, measured on DLRMv2 before)."""
    from concurrent.futures import ThreadPoolExecutor

    import torch._dynamo

    from dlrmkit.batch import Batch, scores
    from dlrmkit.parts import pooled_view

    config = tiny_config(**variant("dcn"))
    model = DLRMFactory(config).random().eval()
    assert pooled_view(model.sparse_arch)  # as DLRMFactory.load serves it: the pooled rows a view
    served, _ = dense._compile(model, config, "bf16", None, (2, 4, 8, 16))
    monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)
    split = config.with_changes(split_rows=4)
    with ThreadPoolExecutor(1) as pool:
        for rows in (8, 5, 16, 13, 2):  # made sizes and padded ones, whole and as parts of 4-8 rows
            d, kjt = probe(config, rows, seed=rows)
            batch = Batch(d, kjt, [rows])
            whole = scores(served, batch, config)
            parts = scores(served, batch, split, pool, 2)
            assert parts[0] == pytest.approx(whole[0], abs=1e-2)


def test_a_worker_whose_torch_may_use_no_vector_instructions_serves_fp32_and_says_so():
    """ATEN_CPU_CAPABILITY caps ATen and Inductor (a real torch setting): at 'default' the compiled
    code could use no SIMD, so the dense half stays fp32 with the reason in the log line."""
    code = (
        "import sys, torch; from conftest import tiny_config;"
        "from dlrmkit.model import DLRMFactory; from dlrmkit import dense;"
        "c = tiny_config(dense_precision='int8'); m = DLRMFactory(c).random();"
        "s, what = dense.compile_dense(m, c, 'int8'); print(what); assert s is m"
    )
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default", "PYTHONPATH": str(ROOT / "tests")}
    run = subprocess.run([sys.executable, "-c", code, str(ROOT)], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == (
        "fp32 (FALLING BACK from int8: this CPU has no amx_int8 or avx512_vnni or avx_vnni "
        "(as torch may use it: DEFAULT))"
    )


@pytest.mark.parametrize(
    ("flags", "capability", "bf16", "int8"),
    [
        ("avx2 avx512f avx512_vnni avx512_bf16 amx_int8 amx_bf16", "AVX512", None, None),  # Sapphire Rapids
        ("avx2 avx512f avx512_vnni avx512_bf16", "AVX512", None, None),  # AMD EPYC Zen 4
        ("avx2 avx512f avx512_vnni avx512_bf16 amx_int8 amx_bf16", "AVX2", "no", None),  # capped at avx2: avx_vnni?
        ("avx2 avx_vnni", "AVX2", "no", None),  # an AVX2 client CPU with VNNI
        ("avx2 fma", "AVX2", "no", "no"),  # Haswell-class
    ],
)
def test_the_cpu_rule_reads_the_flags_as_torch_may_use_them(tmp_path, flags, capability, bf16, int8):
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nflags\t\t: fpu sse {flags}\n")
    have = dense.cpu_flags(info, capability)
    if capability == "AVX2":
        assert not any(f.startswith(("avx512", "amx")) for f in have)
    if flags.startswith("avx2 avx512f avx512_vnni avx512_bf16 amx") and capability == "AVX2":
        int8 = "no"  # without avx_vnni nothing int8 is left at AVX2
    assert (dense.unsupported("bf16", have) is None) == (bf16 is None)
    assert (dense.unsupported("int8", have) is None) == (int8 is None)
    assert dense.unsupported("fp32", set()) is None
    assert dense.cpu_flags(info, "DEFAULT") == set()


def test_dense_precision_is_validated_with_the_key_named():
    with pytest.raises(
        ConfigError, match=r"^handler.dense_precision: expected one of fp32, bf16, int8, auto, got 'fp8'$"
    ):
        tiny_config(dense_precision="fp8")
    assert tiny_config().build.dense_precision == "fp32"


def test_the_contract_is_mlperfs_auc_ratio_with_the_probability_deltas():
    labels = [0, 1] * 50
    ref = [0.1 + 0.8 * y + 0.001 * i for i, y in enumerate(labels)]
    same = accuracy.contract(ref, ref, labels)
    assert same["auc_ratio"] == 1.0 and same["holds"] and same["max_dp"] == 0 and same["rows"] == 100
    swapped = [1 - s for s in ref]  # every order reversed: AUC 0
    worse = accuracy.contract(swapped, ref, labels)
    assert not worse["holds"] and worse["auc_ratio"] < 0.999
    assert json.dumps(worse)  # goes into reports as it is


def _load(path: str, name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_contract_report_has_a_row_per_precision_and_calibration():
    script = _load("scripts/dense_contract.py", "dense_contract")
    labels = [0, 1] * 20
    ref = [0.2 + 0.6 * y + 0.001 * i for i, y in enumerate(labels)]
    rows = [
        {
            "tables": t,
            "precision": p,
            "calibration": s,
            "plan": k,
            "forced": True,
            "forward_ms": 1.0 + (k != "-"),
            **accuracy.contract(ref, ref, labels),
        }
        for t, p, s, k in script.PRECISIONS
    ]
    doc = {
        "command": "x",
        "host": {"cpu": "C", "cpus": 2, "isa": "avx2", "torch": "t"},
        "models": [
            {
                "model": "dcn",
                "train_args": ["--interaction", "dcn"],
                "rows_scored": 40,
                "auc_fp32": 1.0,
                "fp32_vs_trainer_max_dp": 0.0,
                "precisions": rows,
            }
        ],
    }
    table = [line for line in script.contract_md(doc).splitlines() if "**forced**" in line and line.startswith("|")]
    assert [line.split(" | ")[2] for line in table] == [s for _, _, s, _ in script.PRECISIONS]
    assert [line.split(" | ")[3] for line in table] == [k for *_, k in script.PRECISIONS]
    assert [line.split(" | ")[0] for line in table] == [f"| {t}" for t, *_ in script.PRECISIONS]
    assert all(" | yes | " in line for line in table)
    # the plan's forward against every layer int8, per kind of tables (2 ms vs 1 ms: 0.50x)
    assert "- int8 tables: raw forward of the int8 plan's dense half vs every layer int8 plan 0.50x, mixed 0.50x" in (
        script.contract_md(doc)
    )
