"""Big tables: quantized embeddings, zero-copy loading, table-wise sharding, device choice, sizing.

Everything here is torchrec's own machinery, wired for serving:

* ``quantize``: ``torchrec.inference.modules.quantize_inference_model`` (fp16 / int8 / int4) with
  the split scale/bias state_dict that torchrec's sharded modules load.
* ``quant_ebc`` + ``adopt_tables``: the quantized EmbeddingBagCollection (one fbgemm
  ``IntNBitTableBatchedEmbeddingBagsCodegen`` per pooling) built without filling its weight buffer,
  which then takes the memory-mapped archive storage as that buffer: no copy, and workers of one
  model on one machine share the pages.
* ``shard``: ``shard_quant_model`` (``EmbeddingShardingPlanner`` + ``Topology`` + the sharded
  quantized EBC), table-wise, then the archived state_dict loaded into the new kernels.
* ``fused_rows``: fp32 rows as the kernel's fused rows, the one conversion of every build and delta.
* ``worker_devices``: which devices TorchServe gave this worker.
* ``table_bytes``: exact bytes of a table per dtype, for the sizing script.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import warnings
from typing import Any, Iterator, Mapping, Sequence, cast

import torch
from fbgemm_gpu.split_embedding_configs import SparseType
from fbgemm_gpu.split_table_batched_embeddings_ops_inference import (
    align_to_cacheline,
    rounded_row_size_in_bytes,
)
from torch.overrides import TorchFunctionMode
from torch.serialization import _load, _open_zipfile_reader, _weights_only_unpickler
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.fused_params import FUSED_PARAM_QUANT_STATE_DICT_SPLIT_SCALE_BIAS
from torchrec.distributed.global_settings import set_propogate_device
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.quant_embeddingbag import QuantEmbeddingBagCollectionSharder
from torchrec.distributed.types import ShardingType
from torchrec.inference.modules import DEFAULT_FUSED_PARAMS, quantize_inference_model, shard_quant_model
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.quant.embedding_modules import DEFAULT_ROW_ALIGNMENT
from torchrec.quant.embedding_modules import EmbeddingBagCollection as QuantEBC
from torchrec.tensor_types import UInt4Tensor

from dlrmkit.errors import InternalError

# handler.embedding_dtype -> (torchrec table data type, the dtype torchrec's quantizer takes)
DTYPES: dict[str, tuple[DataType, torch.dtype]] = {
    "fp32": (DataType.FP32, torch.float32),
    "fp16": (DataType.FP16, torch.float16),
    "int8": (DataType.INT8, torch.qint8),
    "int4": (DataType.INT4, torch.quint4x2),
}
_SPARSE_TYPE = {"fp32": SparseType.FP32, "fp16": SparseType.FP16, "int8": SparseType.INT8, "int4": SparseType.INT4}
EBC = "sparse_arch.embedding_bag_collection."
TABLES = EBC + "embedding_bags."  # a table's key in a DLRM's state_dict: TABLES + <table> + ".weight"
_LAZY_MIN_BYTES = 1 << 20


def table_bytes(rows: int, dim: int, dtype: str) -> int:
    """Bytes one table takes in memory (and in the archive) as this kit stores it.

    Every dtype is stored as fbgemm rows: D values, plus a 4-byte fp16 scale/bias for
    int8/int4, padded to 16 bytes, and the table padded to a 128-byte cache line (what
    ``nbit_construct_split_state`` allocates); fp32 at D % 4 == 0: rows x D x 4, rounded up to 128.
    """
    row = rounded_row_size_in_bytes(dim, _SPARSE_TYPE[dtype], DEFAULT_ROW_ALIGNMENT)
    return align_to_cacheline(rows * row)


def quantize(model: torch.nn.Module, dtype: str) -> torch.nn.Module:
    """Swap the fp32 EBC for torchrec's quantized one, in place (``quantize_inference_model``)."""
    return quantize_inference_model(model, quantization_dtype=DTYPES[dtype][1])


def saved_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state_dict to archive from a ``quantize``d model: each table as fbgemm's fused rows
    (uint8 ``[rows, row bytes]``: scale/bias + values + padding), all views of one kernel
    buffer, so ``torch.save`` writes that buffer once, byte for byte as the kernel reads it.
    Plain uint8 (no torchrec tensor subclass: ``torch.load(weights_only=True)`` reads it);
    the kernels' bookkeeping buffers (``tbes.*``) are left out, the config rebuilds them."""
    return {k: _plain(v) for k, v in model.state_dict().items() if ".tbes." not in k}


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.elem if hasattr(t, "elem") else t  # torchrec's UInt4Tensor wraps the uint8 bytes


class _NoHostZeroFill(TorchFunctionMode):
    """fbgemm allocates a CPU table buffer with ``torch.zeros``, which touches every page; the
    archive's pages replace it at once, so allocate it untouched instead (``torch.empty``)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (
            func is torch.zeros
            and kwargs.get("dtype") == torch.uint8
            and args
            and isinstance(args[0], int)
            and args[0] >= _LAZY_MIN_BYTES
            and torch.device(kwargs.get("device") or "cpu").type == "cpu"
        ):
            try:
                return torch.empty(*args, **kwargs)
            except RuntimeError:  # more than the commit limit allows (tables larger than memory)
                return _uncommitted(args[0])
        return func(*args, **kwargs)


def _uncommitted(nbytes: int) -> torch.Tensor:
    """A uint8 buffer of ``nbytes`` that reserves no memory (MAP_NORESERVE): a placeholder that
    ``adopt_tables`` replaces before a page of it is touched."""
    noreserve = getattr(mmap, "MAP_NORESERVE", 0x4000)  # Linux's value; Python 3.11 does not name it
    placeholder = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | noreserve)
    return torch.frombuffer(placeholder, dtype=torch.uint8)


def quant_ebc(tables: Sequence[EmbeddingBagConfig], device: torch.device, lazy: bool = False):
    """torchrec's quantized EBC for ``tables`` (their ``data_type`` set), with registered kernels
    (fx keeps them as leaves) and the split scale/bias state_dict that sharding loads.
    ``lazy``: leave the CPU weight buffer untouched; ``adopt_tables`` or ``copy_tables`` must
    fill it."""
    with _NoHostZeroFill() if lazy else contextlib.nullcontext():
        return QuantEBC(
            list(tables),
            is_weighted=False,
            device=torch.device(device),
            register_tbes=True,
            quant_state_dict_split_scale_bias=True,
            cache_features_order=True,
        )


def fused_tables(qebc: QuantEBC) -> dict[str, torch.Tensor]:
    """Archive key -> the kernel's fused rows of that table (a view of its weight buffer)."""
    return {f"{TABLES}{name}.weight": rows for name, rows in _kernel_rows(qebc)}


def _kernel_rows(qebc: QuantEBC) -> Iterator[tuple[str, torch.Tensor]]:
    """(table, its fused rows in the kernel's weight buffer) of every table of a quantized EBC."""
    for tables, tbe in zip(qebc._key_to_tables.values(), qebc._emb_modules):
        for cfg, (rows, _, _) in zip(tables, tbe.split_embedding_weights_with_scale_bias(split_scale_bias_mode=0)):
            yield cfg.name, rows


def fused_rows(rows: Mapping[str, torch.Tensor], dtype: str) -> dict[str, torch.Tensor]:
    """Table -> fbgemm's fused rows (uint8 ``[n, row bytes]``, the kernel's padded rows) of fp32
    ``rows`` (table -> ``[n, D]``) stored as ``dtype``: the one conversion of the archive build
    (``DLRMFactory.archive_state``), the streamed build (``dlrmkit.stream``) and live deltas.

    fp32: the rows' bytes copied into the kernel's rows; fp16/int8/int4: torchrec's quantizer
    (``quantize``), row-wise, so any subset of a table's rows converts to exactly the bytes those
    rows have in a whole build. The tables come out as views of one kernel buffer, which
    ``torch.save`` writes once. Tables without rows are left out.
    """
    rows = {t: r for t, r in rows.items() if len(r)}
    if not rows:
        return {}
    tables = [
        EmbeddingBagConfig(name=t, embedding_dim=r.shape[1], num_embeddings=r.shape[0], feature_names=[t])
        for t, r in rows.items()
    ]
    if dtype == "fp32":
        qebc = quant_ebc(tables, torch.device("cpu"))
        out = dict(_kernel_rows(qebc))
        with torch.no_grad():
            for t, r in rows.items():
                out[t][:, : r.shape[1] * 4].copy_(r.detach().to(torch.float32).contiguous().view(torch.uint8))
        return out
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    for t, r in rows.items():
        ebc.embedding_bags[t].weight = torch.nn.Parameter(r.detach(), requires_grad=False)
    holder = torch.nn.Module()
    holder.ebc = ebc
    return dict(_kernel_rows(cast(QuantEBC, quantize(holder, dtype).get_submodule("ebc"))))


def adopt_tables(qebc: QuantEBC, state: Mapping[str, torch.Tensor]) -> bool:
    """Make the archived table storage the kernels' own weight buffer, without copying.

    Works when the archive holds each kernel's buffer as ``saved_state`` wrote it (the tables
    are views of one storage at the kernel's offsets): ``torch.load(mmap=True)`` then hands
    back that storage file-backed, and every worker of the model on this machine reads the
    same page cache. Returns False (nothing changed) when the layout differs or the weights
    live on a GPU; ``copy_tables`` then applies.
    """
    plans = []
    for tables, tbe in zip(qebc._key_to_tables.values(), qebc._emb_modules):
        if tbe.host_size == 0:
            return False
        storage = None
        for cfg, (want, _, _) in zip(tables, tbe.split_embedding_weights_with_scale_bias(split_scale_bias_mode=0)):
            got = state.get(f"{TABLES}{cfg.name}.weight")
            if (
                got is None
                or got.dtype != want.dtype
                or got.shape != want.shape
                or got.stride() != want.stride()
                or got.storage_offset() != want.storage_offset()
            ):
                return False
            if storage is None:
                storage = got.untyped_storage()
            elif got.untyped_storage().data_ptr() != storage.data_ptr():
                return False
        if storage is None or storage.nbytes() != tbe.host_size:
            return False
        plans.append((tables, tbe, storage))
    for tables, tbe, storage in plans:
        tbe.weights_host = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
        _reregister(qebc, tables, tbe)
    return True


def copy_tables(qebc: QuantEBC, state: Mapping[str, torch.Tensor]) -> None:
    """Copy archived fused rows into the kernels' buffers (GPU, or a layout ``adopt_tables``
    cannot take). A source row may be narrower than the kernel's padded row."""
    with torch.no_grad():
        for key, dst in fused_tables(qebc).items():
            src = state[key]
            dst[:, : src.shape[1]].copy_(src)


def split_tables(qebc: QuantEBC, prefix: str = EBC) -> dict[str, torch.Tensor]:
    """The tables in torchrec's split scale/bias state_dict format (views, no copy): what the
    sharded quantized EBC loads for int8/int4."""
    return {k: v for k, v in qebc.state_dict(prefix=prefix).items() if ".tbes." not in k}


def _has_qparams(qebc: QuantEBC) -> bool:
    return all(t.data_type in (DataType.INT8, DataType.INT4) for t in qebc.embedding_bag_configs())


def _reregister(qebc, tables, tbe) -> None:
    """Point the ``embedding_bags.<table>.*`` buffers at the new weight buffer, so state_dict
    shows it and nothing keeps the old allocation alive."""
    for cfg, (w, scale, bias) in zip(tables, tbe.split_embedding_weights_with_scale_bias(split_scale_bias_mode=2)):
        module = qebc.embedding_bags[cfg.name]
        module.register_buffer("weight", UInt4Tensor(w) if cfg.data_type == DataType.INT4 else w)
        if "weight_qscale" in module._buffers:
            module.register_buffer("weight_qscale", scale)
            module.register_buffer("weight_qbias", bias)


def shard(model: torch.nn.Module, devices: Sequence[torch.device]) -> tuple[torch.nn.Module, Any]:
    """Spread the quantized tables of ``model`` (loaded, on CPU) table-wise over ``devices``
    with torchrec's planner and its sharded quantized EBC; rank r runs on ``devices[r]``, the
    dense part stays where it is (``devices[0]``). Returns the model and torchrec's plan.

    Sharding re-creates the kernels without weights, so the tables are then loaded in the
    split scale/bias format, as views of the unsharded model's (memory-mapped) buffer. On
    "cpu" devices in one process this is the same code path, which is how CI covers it.
    """
    kind = devices[0].type
    # torchrec's input dist moves ids to CUDA unless told to keep the input's device
    # (its own "BUG" comment in dist_data.py); needed for CPU "devices".
    set_propogate_device(True)
    qebc: QuantEBC = model.get_submodule("sparse_arch.embedding_bag_collection")
    # torchrec's default sharder stores split scale/bias, and fails for fp16/fp32 tables,
    # which have none (torchrec 1.8 quant_state.py reads the missing qparam's shape):
    # those are sharded with whole rows instead.
    split = _has_qparams(qebc)
    tables = split_tables(qebc) if split else fused_tables(qebc)
    sharder = QuantEmbeddingBagCollectionSharder(
        fused_params={**DEFAULT_FUSED_PARAMS, FUSED_PARAM_QUANT_STATE_DICT_SPLIT_SCALE_BIAS: split}
    )
    constraints = {
        t.name: ParameterConstraints(
            sharding_types=[ShardingType.TABLE_WISE.value], compute_kernels=[EmbeddingComputeKernel.QUANT.value]
        )
        for t in qebc.embedding_bag_configs()
    }
    sharded, plan = shard_quant_model(
        model,
        world_size=len(devices),
        compute_device=kind,
        sharding_device=kind,
        sharders=[sharder],
        constraints=constraints,
    )
    result = sharded.load_state_dict(tables, strict=False)
    missing = [k for k in result.missing_keys if k.startswith(EBC) and ".tbes." not in k]
    if result.unexpected_keys or missing:
        raise InternalError(
            f"the sharded tables did not take the weights: missing {missing[:3]}, "
            f"unexpected {result.unexpected_keys[:3]}"
        )
    return sharded, plan


def sharded_placement(model: torch.nn.Module) -> dict[str, torch.device]:
    """Table -> the device its kernel runs on, read from the sharded module."""
    out = {}
    for m in model.modules():
        specs = getattr(m, "embedding_specs", None)
        if specs is not None and hasattr(m, "current_device"):
            for spec in specs:
                out[spec[0]] = cast(torch.device, m.current_device)  # torchrec's sharded kernel's device
    return out


def worker_devices(
    gpu_id: Any, model_yaml: Mapping[str, Any] | None, cuda_count: int, env: Mapping[str, str] = os.environ
) -> list[torch.device]:
    """The devices TorchServe gave this worker, first = where the dense part and batches go.

    * no CUDA, or TorchServe assigned no GPU: ``[cpu]``;
    * ``parallelType: custom`` with ``parallelLevel: N``: TorchServe starts one process per
      worker with ``CUDA_VISIBLE_DEVICES`` = its N ``deviceIds``, so they are ``cuda:0..N-1``
      here (gpu_id is then a physical id and must not be used as an index);
    * otherwise one GPU, ``cuda:<gpu_id>`` (BaseHandler's rule).
    """
    if cuda_count <= 0 or gpu_id is None:
        return [torch.device("cpu")]
    yaml = model_yaml or {}
    level = yaml.get("parallelLevel")
    if str(yaml.get("parallelType", "")).lower() == "custom" and isinstance(level, int) and level >= 1:
        visible = env.get("CUDA_VISIBLE_DEVICES")
        n = min(level, cuda_count, len(visible.split(",")) if visible else cuda_count)
        return [torch.device(f"cuda:{i}") for i in range(n)]
    return [torch.device(f"cuda:{int(gpu_id)}")]


_MAPPINGS: list[tuple[mmap.mmap, int]] = []  # (read-only mapping handed to torch, its advice): as long as the worker


def mapped_read_only() -> bool:
    """Whether this process mapped an archive read-only (``load_read_only``: tables larger than
    memory), so that its tables cannot be written in place."""
    return bool(_MAPPINGS)


def mapped_advice() -> int:
    """The madvise advice the tables' mapping carries (MADV_RANDOM for ``load_read_only``'s, else
    the kernel's default): what code that advises a region otherwise for a while puts back."""
    return _MAPPINGS[-1][1] if _MAPPINGS else mmap.MADV_NORMAL


def file_mappings(path: str | os.PathLike, maps: str | os.PathLike = "/proc/self/maps") -> list[tuple[int, int, int]]:
    """(start, end, file offset) of every mapping of ``path`` in this process (``torch.load(mmap=True)``'s
    copy-on-write one or ``load_read_only``'s): where a table's bytes lie in the file."""
    want = os.path.realpath(path)
    out = []
    with open(maps) as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].rstrip("\n") == want:  # the kernel writes the resolved path
                start, end = (int(x, 16) for x in parts[0].split("-"))
                out.append((start, end, int(parts[2], 16)))
    return out


def load_read_only(path: str | os.PathLike, random_access: bool = True) -> dict:
    """``torch.load(path, mmap=True, weights_only=True)`` over a read-only mapping of the file.

    torch maps a file copy-on-write (MAP_PRIVATE, writable), which Linux charges in full to the
    commit limit: under the default heuristic overcommit a file larger than memory cannot be
    mapped at all ("Cannot allocate memory"). A read-only mapping is charged nothing; the
    tables are only ever read (a stray write faults instead of changing the file).
    ``random_access``: MADV_RANDOM, so a fault reads its page, not a read-ahead window of
    neighbours no lookup asked for (table rows are looked up at random).
    """
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    advice = mmap.MADV_RANDOM if random_access else mmap.MADV_NORMAL
    mapped.madvise(advice)
    _MAPPINGS.append((mapped, advice))
    with warnings.catch_warnings():  # "The given buffer is not writable": that is the point
        warnings.simplefilter("ignore", UserWarning)
        storage = torch.frombuffer(mapped, dtype=torch.uint8).untyped_storage()
    with _open_zipfile_reader(os.fspath(path)) as zip_file:
        return _load(zip_file, "cpu", _weights_only_unpickler, overall_storage=storage, encoding="utf-8")
