"""The dense half of a DLRM at reduced precision: bottom MLP, interaction, top MLP.

``handler.dense_precision`` picks how the dense half runs on CPU; the embedding tables
(``embedding_dtype``) are a separate choice:

- ``fp32`` (default): as before this module existed, the bottom and top MLPs ``torch.jit.freeze``-d
  where that is bit-for-bit equal (``DLRMFactory.freeze_dense``), scores unchanged.
- ``bf16``: ``torch.autocast`` to bfloat16 compiled by Inductor with freezing (oneDNN's bf16
  GEMMs: AMX or AVX512-BF16).
- ``int8``: PT2E quantization with torchao's ``X86InductorQuantizer`` (int8 weights per channel,
  uint8 activations), compiled by Inductor with freezing into oneDNN's fused int8 linears (AMX or
  VNNI). Static activation scales when the archive carries calibration inputs
  (``dense-calibration.pt``, written by ``scripts/build_mar.py --calibrate`` from a sample of the
  training data, never the rows ``--verify`` judges), else dynamic ones computed per batch. A
  calibrated build also archives int8's plan (``PLAN_FILE``, ``plan_int8``: the activation observer,
  SmoothQuant on the top MLP's first layer, any layer whose int8 costs the most kept fp32), which
  the worker follows; an archive without one is quantized as before plans.
- ``auto`` exists only in the config a build reads: ``build_mar.py --verify`` serves the fastest of
  the above (and "mixed": int8 with the plan's costliest layers fp32) that keeps the contract and
  writes it into the archive's config; a worker refuses ``auto``.

Reduced precision ships under MLPerf's accuracy contract: served AUC >= 99.9% of the fp32 AUC,
checked by ``build_mar.py --verify`` (``dlrmkit.accuracy.contract``). The compiled code is made on the serving CPU
at worker start, never carried in the archive, so an archive built on an AMX machine serves on an
AVX2 one; a CPU without the precision's instructions (or a worker that cannot compile) serves fp32
and says so in the log (``unsupported``). Inductor keeps what it compiled in its cache
(``TORCHINDUCTOR_CACHE_DIR``, default ``/tmp/torchinductor_<user>``): a restarted worker loads it.

torchrec's ``LowRankCrossNet`` (DLRM_DCN) multiplies its raw ``W``/``V`` parameters; it is rewritten
as Linear pairs of the same weights (``LinearCrossNet``) so that the quantizer sees its GEMMs.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import time
import warnings
from pathlib import Path
from typing import cast

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dlrmkit.config import DENSE_PRECISIONS as PRECISIONS  # noqa: F401  (one list, validated there)
from dlrmkit.errors import ConfigError

logger = logging.getLogger(__name__)

CALIBRATION_FILE = "dense-calibration.pt"
# What the build decided for a static int8 dense half (``plan_int8``), beside the calibration rows
# the worker recomputes its scales from: {"smooth": {layer: alpha}, "keep": [layers kept fp32], ...}.
PLAN_FILE = "dense-plan.json"
# SmoothQuant's migration strengths the build tries on the over arch's first layer (0: none), and
# the activation observers (torchao's default histogram; MinMax).
SMOOTH_ALPHAS = (0.0, 0.5, 0.75)
OBSERVERS = ("histogram", "minmax")
# A layer is kept fp32 ("mixed") when int8 there alone costs >= this share of the whole half's
# error on the calibration rows; at most MAX_KEEP layers, the costliest first.
KEEP_SHARE = 0.3
MAX_KEEP = 2
# Rows kept for calibration: the observers' min/max settle within a few hundred rows, and the
# file stays small (DLRMv2: 512 x (13 + 26 x 128) floats = 6.8 MB).
CALIBRATION_ROWS = 512
# Instructions a precision needs to run natively: without them oneDNN emulates (bf16, many times
# slower) or rounds differently (int8 on AVX2 without VNNI saturates its int16 sums).
NEEDS = {
    "bf16": (("amx_bf16",), ("avx512_bf16",)),
    "int8": (("amx_int8",), ("avx512_vnni",), ("avx_vnni",)),
}
# Flags that count only when ATen (and Inductor, which follows ATEN_CPU_CAPABILITY) may use
# AVX-512: capped at avx2, the CPU is an AVX2 one to the compiled code.
_AVX512 = ("avx512", "amx")


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo", capability: str | None = None) -> set[str]:
    """The CPU's flags as the compiled code may use them: /proc/cpuinfo's, less those above
    ATen's capability (``ATEN_CPU_CAPABILITY=avx2`` or a CPU torch runs at AVX2)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    flags = set(line.partition(":")[2].split())
    capability = (capability or torch.backends.cpu.get_cpu_capability()).upper()
    if capability == "DEFAULT":  # no vector ISA at all
        return set()
    if capability != "AVX512":
        flags = {f for f in flags if not f.startswith(_AVX512)}
    return flags


def unsupported(precision: str, flags: set[str]) -> str | None:
    """Why ``precision`` cannot run natively on a CPU with ``flags``, or None if it can."""
    if precision == "fp32":
        return None
    if any(all(f in flags for f in need) for need in NEEDS[precision]):
        return None
    wanted = " or ".join("+".join(n) for n in NEEDS[precision])
    return f"this CPU has no {wanted} (as torch may use it: {torch.backends.cpu.get_cpu_capability()})"


def isa_summary(flags: set[str] | None = None) -> str:
    """The instructions the precisions care about, for logs and reports."""
    flags = cpu_flags() if flags is None else flags
    want = ("amx_int8", "amx_bf16", "avx512_bf16", "avx512_vnni", "avx_vnni", "avx512f", "avx2")
    return ",".join(f for f in want if f in flags) or "none"


class LinearCrossNet(nn.Module):
    """torchrec's ``LowRankCrossNet`` as Linear pairs, same parameters, same math:
    ``x_{l+1} = x_0 * (W_l (V_l x_l) + b_l) + x_l``. A quantizer that looks for linear layers
    finds all 2 x L of them here; in torchrec's module they are hidden in raw parameters."""

    def __init__(self, crossnet: nn.Module):
        super().__init__()
        self.v = nn.ModuleList()
        self.w = nn.ModuleList()
        kernels = (cast(nn.ParameterList, getattr(crossnet, name)) for name in ("V_kernels", "W_kernels", "bias"))
        for v, w, b in zip(*kernels):
            lv = nn.Linear(v.shape[1], v.shape[0], bias=False)
            lw = nn.Linear(w.shape[1], w.shape[0])
            lv.weight, lw.weight, lw.bias = nn.Parameter(v.detach()), nn.Parameter(w.detach()), nn.Parameter(b.detach())
            self.v.append(lv)
            self.w.append(lw)

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        x = x0
        for v, w in zip(self.v, self.w):
            x = x0 * w(v(x)) + x
        return x


class SmoothedLinear(nn.Module):
    """``linear`` with SmoothQuant's per-input-channel migration: ``(x / s) @ (W * s)^T + b``, the same
    math; ``s_j = amax(x_j)^alpha / amax(W_:j)^(1 - alpha)`` flattens the input's channels (the
    interaction's concatenation: dense arch outputs beside sum-pooled multi-hot embeddings, ranges
    apart by 10-100x) so that one per-tensor uint8 scale fits them all, and moves the spread into
    the weights, whose scales are per output channel. The division is an elementwise op Inductor
    fuses into the quantization of x."""

    def __init__(self, linear: nn.Linear, input_amax: torch.Tensor, alpha: float):
        super().__init__()
        w = linear.weight.detach().abs().amax(0).clamp(min=1e-5)
        scale = (input_amax.clamp(min=1e-5) ** alpha / w ** (1 - alpha)).clamp(1e-4, 1e4)
        self.inv_scale: torch.Tensor
        self.register_buffer("inv_scale", 1 / scale)
        self.linear = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None)
        with torch.no_grad():
            self.linear.weight.copy_(linear.weight * scale)
            if linear.bias is not None:
                self.linear.bias.copy_(linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x * self.inv_scale)


def linear_names(half: nn.Module) -> list[str]:
    """The dense half's Linear layers, in forward order (bottom MLP, interaction, top MLP)."""
    return [name for name, m in half.named_modules() if isinstance(m, nn.Linear)]


def smoothed(half: nn.Module, calibration: dict, smooth: dict[str, float]) -> nn.Module:
    """A copy of ``half`` whose layers in ``smooth`` are ``SmoothedLinear`` at their alpha, the input's
    per-channel absolute maxima read from the calibration rows (so a worker rebuilds the same
    scales from the archive's file)."""
    smooth = {name: alpha for name, alpha in smooth.items() if alpha > 0}
    if not smooth:
        return half
    half = copy.deepcopy(half)  # the model's own modules stay as they are
    amax: dict[str, torch.Tensor] = {}

    def hook(name):
        def record(_module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).abs().amax(0)
            amax[name] = torch.maximum(amax[name], x) if name in amax else x

        return record

    hooks = [half.get_submodule(name).register_forward_pre_hook(hook(name)) for name in smooth]
    with torch.no_grad():
        half(calibration["dense"], calibration["pooled"])
    for h in hooks:
        h.remove()
    for name, alpha in smooth.items():
        parent, _, leaf = name.rpartition(".")
        holder = half.get_submodule(parent) if parent else half
        holder._modules[leaf] = SmoothedLinear(cast(nn.Linear, holder._modules[leaf]), amax[name], alpha)
    return half


class DenseHalf(nn.Module):
    """Everything of a torchrec DLRM after the embedding lookup: (dense [B, F_dense], pooled
    embeddings [B, F, D]) -> logits [B, 1]; the three DLRM variants alike."""

    def __init__(self, model: nn.Module):
        super().__init__()
        # torchrec's DenseArch, InteractionArch (or its DCN / projection kind) and OverArch
        self.dense_arch, self.inter_arch, self.over_arch = (
            cast(nn.Module, getattr(model, name)) for name in ("dense_arch", "inter_arch", "over_arch")
        )
        crossnet = getattr(self.inter_arch, "crossnet", None)
        if crossnet is not None and hasattr(crossnet, "V_kernels"):
            # A shallow copy with its own child table: the model's module keeps torchrec's crossnet.
            self.inter_arch = copy.copy(self.inter_arch)
            self.inter_arch._modules = dict(self.inter_arch._modules)
            self.inter_arch.crossnet = LinearCrossNet(crossnet)

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        return self.over_arch(self.inter_arch(dense_features=self.dense_arch(dense), sparse_features=pooled))


# A compiled dense half pays once per new batch size: oneDNN makes its GEMM kernels for each M on
# first use (measured on AMX: +10 ms int8, +35-50 ms bf16 on a 300-700-row forward, and over a
# second for the first size above the compile's warm-up). MLPerf-like traffic (queries of 100-700
# pairs, merged by TorchServe's batching) meets hundreds of sizes, so each of those was a slow
# outlier at the p99. Batches are padded instead to one of 8 sizes an octave (< 12.5% more rows)
# and every size up to WARM_ROWS is made at worker start.
WARM_ROWS = 4096  # also the handler's MAX_ROWS_PER_FORWARD: only one larger request runs past it


def padded_rows(rows: int) -> int:
    """The batch size a compiled dense half runs ``rows`` rows at: a power of two up to 16, then
    a multiple of 1/8 of the octave.

    >>> [padded_rows(n) for n in (1, 3, 16, 17, 300, 700, 4096)]
    [2, 4, 16, 18, 320, 704, 4096]
    """
    if rows <= 16:
        return max(2, 1 << (rows - 1).bit_length())
    step = 1 << ((rows - 1).bit_length() - 4)
    return -(-rows // step) * step


def warm_sizes(limit: int = WARM_ROWS) -> list[int]:
    """Every ``padded_rows`` size up to ``limit``, in order."""
    sizes, rows = [], 1
    while (size := padded_rows(rows)) <= limit:
        sizes.append(size)
        rows = size + 1
    return sizes


def pad_kjt(kjt, rows: int, padded: int):
    """``kjt`` of ``rows`` rows with ``padded - rows`` empty rows after them (key-major lengths:
    a zero per feature per new row; no value added). F=2, 2 rows padded to 3:
    lengths [1, 2 | 0, 1] -> [1, 2, 0 | 0, 1, 0], values unchanged."""
    lengths = nn.functional.pad(kjt.lengths().view(-1, rows), (0, padded - rows)).reshape(-1)
    return KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values(), lengths=lengths, weights=kjt.weights_or_none())


class ServedDLRM(nn.Module):
    """A DLRM whose dense half is ``dense``, a compiled module: ``model(dense, kjt)`` as before.
    The sparse arch (fbgemm's table-batched kernel) stays as it is. A batch runs padded with empty
    rows to ``padded_rows`` (the sizes made at worker start); only its own rows come back. Each row
    is scored on its own (bf16, static int8): the padding changes no score beyond the rounding of
    another blocking; dynamic int8 scales its activations per batch, so there the padding is one
    more row in the batch, as any request batched with it is."""

    def __init__(self, model: nn.Module, dense: nn.Module, precision: str):
        super().__init__()
        self.sparse_arch = cast(nn.Module, model.sparse_arch)  # torchrec's SparseArch: kjt -> pooled [B, F, D]
        self.dense, self.precision = dense, precision

    def forward(self, dense_features: torch.Tensor, sparse_features) -> torch.Tensor:
        rows = dense_features.shape[0]
        padded = padded_rows(rows)
        if padded != rows:
            dense_features = nn.functional.pad(dense_features, (0, 0, 0, padded - rows))
            sparse_features = pad_kjt(sparse_features, rows, padded)
        elif torch.is_inference_mode_enabled() and not dense_features.is_inference():
            # Dynamo guards each input's dispatch keys: a tensor made outside inference_mode (or a
            # view of one, as handler.split_rows' parts are) would compile the half once more, ~2 s
            # in the middle of serving; the padded ones are inference tensors, so this one is too.
            dense_features = dense_features.clone()
        return self.dense(dense_features, self.sparse_arch(sparse_features))[:rows].float()


class _Autocast(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.inner(dense, pooled)


def calibration_inputs(model: nn.Module, batches) -> dict[str, torch.Tensor]:
    """The dense half's inputs for ``batches`` of (dense, kjt) through ``model``'s fp32 sparse
    arch, at most CALIBRATION_ROWS rows: what ``build_mar.py --calibrate`` puts in the archive."""
    dense, pooled, rows = [], [], 0
    sparse_arch = cast(nn.Module, model.sparse_arch)
    with torch.inference_mode():
        for d, kjt in batches:
            dense.append(d)
            pooled.append(sparse_arch(kjt))
            rows += d.shape[0]
            if rows >= CALIBRATION_ROWS:
                break
    if not dense:
        raise ConfigError("no calibration rows")
    return {
        "dense": torch.cat(dense)[:CALIBRATION_ROWS].contiguous(),
        "pooled": torch.cat(pooled)[:CALIBRATION_ROWS].contiguous(),
    }


def _probe(model: nn.Module, config, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random dense-half inputs of ``rows`` rows (export and warm-up shapes, not calibration)."""
    gen = torch.Generator().manual_seed(0)
    dense = torch.randn(rows, config.num_dense_features, generator=gen)
    pooled = torch.randn(rows, config.num_features, config.embedding_dim, generator=gen)
    return dense, pooled


def _int8(half: nn.Module, example: tuple, calibration: dict | None, plan: dict | None = None) -> nn.Module:
    """PT2E: export with a dynamic batch, annotate for x86 Inductor, calibrate (static) or not
    (dynamic activation scales), convert. Importing the quantizer's module is what registers
    Inductor's int8 fusion passes (torchao issue 4823): without it int8 runs as plain aten ops.
    ``plan`` (static only, ``plan_int8``): layers smoothed first, layers left fp32."""
    plan = plan or {}
    keep = list(plan.get("keep", ()))
    if calibration is not None:
        half = smoothed(half, calibration, {k: a for k, a in plan.get("smooth", {}).items() if k not in keep})
    # torchao: the maintained home of PT2E quantization (torch.ao.quantization is deprecated).
    # Its import warns once per CUDA kernel library a CPU host cannot load: not ours, and noise in every worker log.
    logging.getLogger("torchao").setLevel(logging.ERROR)
    # Loaded lazily: only an int8 dense half needs torchao, and importing it takes over a second.
    import torchao.quantization.pt2e.quantizer.x86_inductor_quantizer as xiq
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    batch = torch.export.Dim("B", min=2, max=1 << 16)
    exported = torch.export.export(half, example, dynamic_shapes=({0: batch}, {0: batch})).module()
    quantizer = xiq.X86InductorQuantizer()
    qconfig = xiq.get_default_x86_inductor_quantization_config(is_dynamic=calibration is None)
    if calibration is not None and plan.get("observer") == "minmax":
        qconfig = _minmax(qconfig)
    quantizer.set_global(qconfig)
    for name in keep:  # mixed precision: these layers run fp32 between int8 ones
        quantizer.set_module_name_qconfig(name, None)
    prepared = prepare_pt2e(exported, quantizer)
    with torch.no_grad():
        if calibration is not None:
            for lo in range(0, calibration["dense"].shape[0], 128):
                prepared(calibration["dense"][lo : lo + 128], calibration["pooled"][lo : lo + 128])
        else:
            prepared(*example)
    return convert_pt2e(prepared)


def _minmax(qconfig):
    """``qconfig`` with its activations' scales from the calibration rows' whole range (MinMax)
    instead of the histogram's clipped one, which fits the bulk best but clips the tails."""
    import dataclasses

    from torchao.quantization.pt2e import MinMaxObserver

    act = dataclasses.replace(qconfig.input_activation, observer_or_fake_quant_ctr=MinMaxObserver.with_args(eps=2**-12))
    return dataclasses.replace(qconfig, input_activation=act, output_activation=act)


def compile_dense(
    model: nn.Module,
    config,
    precision: str,
    calibration: dict | None = None,
    warm_rows: tuple[int, ...] | None = None,
    plan: dict | None = None,
) -> tuple[nn.Module, str]:
    """``model`` (an fp32 torchrec DLRM on CPU, eval) with its dense half at ``precision``,
    compiled and warmed at ``warm_rows`` batch sizes (default: every ``warm_sizes()``); and a
    line saying what runs. ``plan``: static int8's smoothing and fp32 layers (``plan_int8``). On a CPU
    without the precision's instructions, or when compiling fails, the model comes back as it
    was (fp32) and the line says FALLING BACK and why."""
    if precision == "fp32":
        return model, "fp32"
    reason = unsupported(precision, cpu_flags())
    if reason is None:
        try:
            return _compile(model, config, precision, calibration, warm_rows, plan)
        except Exception as e:  # a worker without a C++ compiler, an export the version cannot do
            reason = f"compiling failed ({type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e) else ''})"
    return _fall_back(model, precision, reason)


def _fall_back(model: nn.Module, precision: str, reason: str) -> tuple[nn.Module, str]:
    """``model`` as it is (fp32), with the warning and the line saying so."""
    logger.warning("dense_precision %s: FALLING BACK to fp32: %s", precision, reason)
    return model, f"fp32 (FALLING BACK from {precision}: {reason})"


def _compile(model, config, precision, calibration, warm_rows, plan=None) -> tuple[nn.Module, str]:
    started = time.perf_counter()
    # Inductor's own int8 lowering copy-constructs a tensor (torch 2.13): not ours to fix, and noise in every log.
    warnings.filterwarnings("ignore", message="To copy construct from a tensor", category=UserWarning)
    half: nn.Module = DenseHalf(model).eval()
    example = _probe(model, config, 32)
    if precision == "int8":
        half = _int8(half, example, calibration, plan)
        what = (
            "int8 static (PT2E X86InductorQuantizer, calibrated on "
            f"{calibration['dense'].shape[0]} rows of the archive's {CALIBRATION_FILE}{describe(plan)})"
            if calibration is not None
            else "int8 dynamic (PT2E X86InductorQuantizer, activation scales per batch: the archive has no "
            f"{CALIBRATION_FILE}; build it with --calibrate for static scales)"
        )
    else:
        half = _Autocast(half)
        what = "bf16 (autocast)"
    # freezing: weights become constants that oneDNN prepacks (without it int8 keeps fp32 GEMMs,
    # torchao issue 4566); dynamic: one graph for every batch size.
    # Set for the process, not per call: Inductor reads it at every (re)compile, and
    # torch.compile(options={"freezing": True}) fails on PT2E's int8 prepack ops (torch 2.13).
    torch._inductor.config.freezing = True
    compiled: nn.Module = torch.compile(half, dynamic=True)  # type: ignore[assignment]  # an OptimizedModule
    served = ServedDLRM(model, compiled, precision)  # no .eval(): an exported graph refuses it; all is eval
    warm = warm_sizes() if warm_rows is None else warm_rows
    # under inference_mode, as dlrmkit.batch.scores serves it: the same dispatch keys, no recompile later
    with torch.inference_mode():
        for rows in warm:
            compiled(*_probe(model, config, rows))
    what += (
        f", Inductor with freezing on {isa_summary()}, compiled and made at {len(warm)} batch sizes "
        f"({warm[0]}-{warm[-1]} rows) in {time.perf_counter() - started:.1f} s"
    )
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if cache:
        what += f" (cache {cache})"
    return served, what


def prepare(model: nn.Module, config, model_dir: str | Path, devices: list) -> tuple[nn.Module, str]:
    """What the worker serves: ``model`` with its dense half at ``config.build.dense_precision``
    (the archive's calibration inputs for static int8), and the line saying what runs."""
    precision = config.build.dense_precision
    if precision == "fp32":
        return model, "fp32"
    if precision == "auto":
        raise ConfigError(
            "handler.dense_precision: auto is decided when the archive is built (scripts/build_mar.py --verify "
            "writes the precision it chose into the archive's config); rebuild it so, or set one of "
            + ", ".join(PRECISIONS)
        )
    if len(devices) != 1 or devices[0].type != "cpu":
        return _fall_back(
            model, precision, "the compiled dense half is for CPU workers (on a GPU the dense half runs fp32)"
        )
    calibration = read_calibration(model_dir) if precision == "int8" else None
    plan = read_plan(model_dir) if calibration is not None else None
    return compile_dense(model, config, precision, calibration, plan=plan)


def read_plan(model_dir: str | Path) -> dict | None:
    """The archive's int8 plan (``PLAN_FILE``), or None when it carries none (an archive built
    before plans: int8 everywhere, as it was built)."""
    path = Path(model_dir) / PLAN_FILE
    if not path.is_file():
        return None
    plan = json.loads(path.read_text())
    if (
        not isinstance(plan, dict)
        or not isinstance(plan.get("smooth", {}), dict)
        or not isinstance(plan.get("keep", []), list)
    ):
        raise ConfigError(f"{path}: expected a JSON object with smooth (layer -> alpha) and keep (layers)")
    return plan


def describe(plan: dict | None) -> str:
    """``plan``'s observer, smoothing and fp32 layers for the line saying what runs ("" for none)."""
    if not plan:
        return ""
    smooth = ", ".join(f"{k} alpha {a:g}" for k, a in plan.get("smooth", {}).items() if a > 0)
    keep = ", ".join(plan.get("keep", ()))
    return "".join(
        (
            f"; {plan['observer']} activation scales" if plan.get("observer") else "",
            f"; smoothed: {smooth}" if smooth else "",
            f"; fp32 layers (mixed): {keep}" if keep else "",
        )
    )


def plan_int8(model: nn.Module, config, calibration: dict, log=lambda _msg: None) -> dict:
    """The build's sensitivity pass for static int8, quantized eagerly (PT2E's reference ops, no
    compiler: any build CPU runs it). Scales are fitted on the calibration rows' even half and the
    error measured on the odd half, rows they never saw (as served rows are: tails beyond the
    calibrated range are clipped), as mean |delta probability| against the fp32 half. In turn:
    the activation observer (``OBSERVERS``: the histogram fits the bulk, MinMax covers the tails
    seen), SmoothQuant's strength for the over arch's first layer (the interaction's concatenation,
    whose channels' ranges differ most: ``SMOOTH_ALPHAS``), then each Linear left fp32 alone; the
    layers whose int8 costs >= ``KEEP_SHARE`` of the error are kept fp32 (mixed, at most
    ``MAX_KEEP``). Returns the plan ``PLAN_FILE`` holds (the worker fits its scales on all the rows):
    ``observer``, ``smooth``, ``keep``, the errors (``error``; ``sensitivity``: layer -> error with
    it fp32) and ``ranked`` (the layers, costliest int8 first)."""
    logging.getLogger("torchao").setLevel(logging.ERROR)
    half = DenseHalf(model).eval()
    example = _probe(model, config, 32)
    fit = {k: v[0::2] for k, v in calibration.items()}
    dense, pooled = calibration["dense"][1::2], calibration["pooled"][1::2]
    with torch.no_grad():
        reference = torch.sigmoid(half(dense, pooled).float())

    def error(plan: dict) -> float:
        quantized = _int8(half, example, fit, plan)
        with torch.no_grad():
            return float((torch.sigmoid(quantized(dense, pooled).float()) - reference).abs().mean())

    names = linear_names(half)
    plan: dict = {"observer": "histogram", "smooth": {}}
    observed = {observer: error({**plan, "observer": observer}) for observer in OBSERVERS}
    plan["observer"] = min(OBSERVERS, key=lambda o: observed[o])
    log("[int8] activation observer: mean |dp| " + ", ".join(f"{o} {e:.3g}" for o, e in observed.items()))
    first = next((n for n in names if n.startswith("over_arch.")), None)
    if first is not None:
        tried = {alpha: error({**plan, "smooth": {first: alpha}}) for alpha in SMOOTH_ALPHAS}
        alpha = min(tried, key=lambda a: (tried[a], a))
        log(f"[int8] smoothing {first}: mean |dp| " + ", ".join(f"alpha {a:g} {e:.3g}" for a, e in tried.items()))
        plan["smooth"] = {first: alpha} if alpha > 0 else {}
    base = error(plan)
    sensitivity = {name: error({**plan, "keep": [name]}) for name in names}
    ranked = sorted(names, key=lambda n: sensitivity[n])
    keep = [n for n in ranked[:MAX_KEEP] if base - sensitivity[n] >= KEEP_SHARE * base > 0]
    log(
        f"[int8] sensitivity (mean |dp| with one layer fp32; all int8 {base:.3g}): "
        + ", ".join(f"{n} {sensitivity[n]:.3g}" for n in ranked)
        + (f"; kept fp32: {', '.join(keep)}" if keep else "; every layer int8")
    )
    return {
        **plan,
        "keep": keep,
        "error": base,
        "sensitivity": sensitivity,
        "ranked": ranked,
        "rows": int(calibration["dense"].shape[0]),
    }


def read_calibration(model_dir: str | Path) -> dict | None:
    """The archive's calibration inputs, or None when it carries none."""
    path = Path(model_dir) / CALIBRATION_FILE
    if not path.is_file():
        return None
    data = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(data, dict) or not {"dense", "pooled"} <= set(data):
        raise ConfigError(f"{path}: expected a dict with dense and pooled tensors")
    return data
