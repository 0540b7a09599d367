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
from dlrmkit import dense
from dlrmkit.errors import ConfigError
from dlrm_factory import DLRMFactory


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
    config = tiny_config(**variant("dcn"), dense_precision="int8")
    model = DLRMFactory(config).random().eval()
    dense_x, kjt = probe(config)
    calibration = dense.calibration_inputs(model, [probe(config, seed=s) for s in (2, 3)])
    served, what = dense._compile(model, config, "int8", calibration, (2, 8))
    assert what.startswith("int8 static (PT2E X86InductorQuantizer, calibrated on 128 rows"), what
    with torch.inference_mode():
        got, want = served(dense_x, kjt), model(dense_x, kjt)
    assert got.shape == want.shape and bool(torch.isfinite(got).all())


def test_a_worker_whose_torch_may_use_no_vector_instructions_serves_fp32_and_says_so():
    """ATEN_CPU_CAPABILITY caps ATen and Inductor (a real torch setting): at 'default' the compiled
    code could use no SIMD, so the dense half stays fp32 with the reason in the log line."""
    code = (
        "import sys, torch; sys.path[:0] = [sys.argv[1], sys.argv[1] + '/tests']; from conftest import tiny_config;"
        "from dlrm_factory import DLRMFactory; from dlrmkit import dense;"
        "c = tiny_config(dense_precision='int8'); m = DLRMFactory(c).random();"
        "s, what = dense.compile_dense(m, c, 'int8'); print(what); assert s is m"
    )
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
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
    with pytest.raises(ConfigError, match=r"^handler.dense_precision: expected one of fp32, bf16, int8, got 'fp8'$"):
        tiny_config(dense_precision="fp8")
    assert tiny_config().dense_precision == "fp32"


def test_the_contract_is_mlperfs_auc_ratio_with_the_probability_deltas():
    labels = [0, 1] * 50
    ref = [0.1 + 0.8 * y + 0.001 * i for i, y in enumerate(labels)]
    same = dense.contract(ref, ref, labels)
    assert same["auc_ratio"] == 1.0 and same["holds"] and same["max_dp"] == 0 and same["rows"] == 100
    swapped = [1 - s for s in ref]  # every order reversed: AUC 0
    worse = dense.contract(swapped, ref, labels)
    assert not worse["holds"] and worse["auc_ratio"] < 0.999
    assert json.dumps(worse)  # goes into reports as it is
