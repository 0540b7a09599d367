"""Tables larger than memory: the archive's weights file written table by table, chunk by chunk.

``build_mar.py`` holds the fp32 model whole and quantizes it at once: fine for the capped
configs, impossible for the full MLPerf DLRMv2 (204,184,588 rows, 97.4 GiB fp32) on a 24 GiB
machine. ``write_weights`` writes the same file without ever holding an fp32 table:

1. the file's skeleton: ``torch.save`` of the state_dict the normal build archives (the dense
   layers, and every table as a uint8 ``[rows, row bytes]`` view of the fused kernel's one
   weight buffer, at the kernel's offsets) under ``torch.serialization.skip_data``, with the
   buffer a FakeTensor: the file is written with its records in place and the 27 GiB of table
   bytes left as a hole (a sparse file), in milliseconds;
2. each table's rows, a chunk of fp32 rows at a time (seeded random, or read from a trained
   checkpoint), quantized by the normal build's own quantizer (``dlrmkit.scale.quantize``:
   torchrec's ``quantize_inference_model``, row-wise, so a chunk's rows are byte for byte the
   whole table's) and written with ``os.pwrite`` where the loader will map them.

The result is an ordinary ``torch.load(mmap=True)`` file: ``DLRMFactory.load`` adopts its
buffer as the kernel's weights (no copy), as it does for a normal build.

Seeded random weights here are drawn per table (``random_rows``: one generator per table, so any
chunking gives the same rows) rather than from the one generator ``DLRMFactory.random`` threads
through the whole fp32 model; the dense layers are drawn as ``random`` draws them, and the last
layer is rescaled on a probe batch whose rows are gathered while the tables stream by.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import resource
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Callable, Iterator, Mapping, cast

import torch
import torch.distributed.checkpoint as dcp  # torchrec imports it anyway: no cost to load it here
from fbgemm_gpu.split_embedding_configs import SparseType
from fbgemm_gpu.split_table_batched_embeddings_ops_inference import rounded_row_size_in_bytes
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torchrec.quant.embedding_modules import DEFAULT_ROW_ALIGNMENT
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dlrmkit.checkpoint import open_checkpoint, plan_import, say_ignored
from dlrmkit.config import DLRMConfig
from dlrmkit.errors import ConfigError, InternalError
from dlrmkit.hot import COLD, HOT
from dlrmkit.model import DLRMFactory
from dlrmkit.scale import EBC, TABLES, fused_rows, load_read_only, table_bytes

CHUNK_BYTES = 256 << 20  # fp32 bytes of rows quantized at once: the build's working set
_RESERVE = 2 << 30  # disk left free for everyone else on the machine


@dataclass(frozen=True)
class Slot:
    """Where one table's fused rows lie in the kernel's weight buffer."""

    name: str
    rows: int
    row_bytes: int
    offset: int


def layout(config: DLRMConfig, hot: Mapping[str, int] | None = None) -> tuple[list[Slot], int]:
    """The fused kernel's buffer for ``config``: one slot per table, in the config's order, each
    table ``rows x row_bytes`` padded to a 128-byte cache line (fbgemm's
    ``nbit_construct_split_state``), and the buffer's size. ``hot``: table -> its hot rows'
    copies, kernel rows after its own (dlrmkit/hot.py). ``tests/test_stream.py`` checks it
    against the kernel torchrec builds."""
    slots, offset, row = [], 0, row_bytes(config)
    for name, rows in zip(config.sparse_features, config.num_embeddings):
        rows += (hot or {}).get(name, 0)
        slots.append(Slot(name, rows, row, offset))
        offset += table_bytes(rows, config.embedding_dim, config.build.embedding_dtype)
    return slots, offset


def row_bytes(config: DLRMConfig) -> int:
    """Bytes of one fused row of ``config``'s tables (values, scale/bias, padding)."""
    kind = {"fp32": SparseType.FP32, "fp16": SparseType.FP16, "int8": SparseType.INT8, "int4": SparseType.INT4}
    return rounded_row_size_in_bytes(config.embedding_dim, kind[config.build.embedding_dtype], DEFAULT_ROW_ALIGNMENT)


# --- where fp32 rows come from -----------------------------------------------------------------


class RandomSource:
    """Seeded random weights for ``config``, drawn without the fp32 model: each table from its
    own generator (seed, table index) in U(-1, 1), row-major, so ``rows(t, start, n)`` called
    chunk after chunk gives the same rows whatever the chunk size; the dense layers as
    ``DLRMFactory.random`` draws them, the last one rescaled on a probe batch (``finish``)."""

    def __init__(self, config: DLRMConfig, seed: int | None = None):
        self.config, self.seed = config, config.build.seed if seed is None else seed
        self.factory = DLRMFactory(config.with_changes(embedding_dtype="fp32"))
        gen = torch.Generator().manual_seed(self.seed)
        self.model = self.factory.build("cpu", tables_on_meta=True)
        with torch.no_grad():
            for part in (self.model.dense_arch, self.model.inter_arch, self.model.over_arch):
                for p in part.parameters():
                    bound = p.shape[1] ** -0.5 if p.dim() == 2 else 0.1
                    p.uniform_(-bound, bound, generator=gen)
        self.probe = self.factory.probe_batch(256, gen)
        ids = self.probe[1].to_dict()
        # per table: the probe's ids, their rows gathered as the table streams by
        self._wanted = {name: torch.unique(ids[name].values()) for name in config.sparse_features}
        self._gathered = {name: torch.empty(len(w), config.embedding_dim) for name, w in self._wanted.items()}
        self._gens: dict[str, tuple[torch.Generator, int]] = {}

    def describe(self) -> str:
        return f"seeded random weights (seed {self.seed}, one generator per table)"

    def rows(self, table: int, start: int, n: int) -> torch.Tensor:
        name = self.config.sparse_features[table]
        gen, at = self._gens.get(name) or (torch.Generator().manual_seed(self.seed * 1_000_003 + table + 1), 0)
        if at != start:
            raise InternalError(f"table {name}: rows must be drawn in order (at {at}, asked for {start})")
        out = torch.empty(n, self.config.embedding_dim).uniform_(-1.0, 1.0, generator=gen)
        self._gens[name] = (gen, start + n)
        want = self._wanted[name]
        hit = (want >= start) & (want < start + n)
        if hit.any():
            self._gathered[name][hit] = out[want[hit] - start]
        return out

    def dense(self) -> dict[str, torch.Tensor]:
        """The dense layers with the last one rescaled: call after every table's rows were drawn."""
        c = self.config
        dense, kjt = self.probe
        # the probe scored by the fp32 model over only the rows it reads (ids renumbered)
        small = c.with_changes(
            num_embeddings=tuple(max(1, len(w)) for w in self._wanted.values()), embedding_dtype="fp32"
        )
        model = DLRMFactory(small).build("cpu")
        model.load_state_dict({k: v for k, v in self.model.state_dict().items() if not k.startswith(EBC)}, strict=False)
        values = []
        feats = kjt.to_dict()
        with torch.no_grad():
            for name in c.sparse_features:
                model.sparse_arch.embedding_bag_collection.embedding_bags[name].weight[: len(self._wanted[name])] = (
                    self._gathered[name]
                )
                values.append(torch.searchsorted(self._wanted[name], feats[name].values()))
            small_kjt = KeyedJaggedTensor(keys=list(c.sparse_features), values=torch.cat(values), lengths=kjt.lengths())
            logits = model.eval()(dense, small_kjt).squeeze(1)
            std, mean = logits.std().clamp_min(1e-6), logits.mean()
            last = self.model.over_arch.model[-1]
            last.weight.div_(std)
            last.bias.sub_(mean).div_(std)
        return {k: v.detach() for k, v in self.model.state_dict().items() if not k.startswith(EBC)}


class CheckpointSource:
    """A trained fp32 checkpoint (``dlrmkit.checkpoint``: a state_dict file or a DCP directory),
    checked against the config before any data is read (``plan_import``), then read a chunk of
    rows at a time. A DCP directory's shards are torch.save blobs inside its ``.distcp`` files:
    each shard's rows are read straight from the file at their offset (``os.preadv``), never the
    whole shard; a shard stored any other way (a DCP transform such as compression) is read
    whole through DCP, said once."""

    def __init__(
        self,
        path: str | Path,
        config: DLRMConfig,
        feature_order: list[str] | None = None,
        log: Callable[[str], None] = print,
    ):
        self.config, self.log = config, log
        self.ckpt = open_checkpoint(path)
        say_ignored(self.ckpt, log)
        self.keys = plan_import(self.ckpt, config, feature_order)
        self._dcp = self.ckpt.kind.startswith("DCP")
        self._shards: dict[str, list] = {}
        self._whole: dict[str, torch.Tensor] = {}
        if self._dcp:
            self._meta = dcp.FileSystemReader(str(self.ckpt.path)).read_metadata()

    def describe(self) -> str:
        return f"{self.ckpt.kind} {self.ckpt.path}"

    def dense(self) -> dict[str, torch.Tensor]:
        keys = {new: old for new, old in self.keys.items() if not new.startswith(TABLES)}
        return {k: v.detach().clone() for k, v in self.ckpt.load(keys).items()}

    def rows(self, table: int, start: int, n: int) -> torch.Tensor:
        name = self.config.sparse_features[table]
        key = self.keys[f"{TABLES}{name}.weight"]
        if not self._dcp:
            # a state_dict file is memory-mapped: a slice reads only its pages
            return cast(torch.Tensor, self.ckpt.sources[key])[start : start + n].to(torch.float32)
        out = torch.empty(n, self.config.embedding_dim, dtype=torch.float32)
        for row0, rows, read in self._dcp_shards(cast(str, self.ckpt.sources[key])):
            lo, hi = max(start, row0), min(start + n, row0 + rows)
            if lo < hi:
                read(lo - row0, out[lo - start : hi - start])
        return out

    def _dcp_shards(self, fqn: str) -> list:
        if fqn in self._shards:
            return self._shards[fqn]
        shards = []
        for index, info in self._meta.storage_data.items():
            if index.fqn != fqn:
                continue
            if index.offset is None or any(index.offset[1:]):
                raise ConfigError(
                    f"checkpoint: table {fqn!r} is sharded column-wise; only row-wise or whole "
                    "tables stream (build it with scripts/build_mar.py --checkpoint)"
                )
            path = self.ckpt.path / info.relative_path
            stored = None if info.transform_descriptors else _stored_rows(path, info.offset, info.length)
            chunk = next(c for c in self._tensor_meta(fqn).chunks if tuple(c.offsets) == tuple(index.offset))
            rows = int(chunk.sizes[0])
            if stored is None:
                shards.append((int(index.offset[0]), rows, self._whole_shard(fqn, index, rows)))
            else:
                shards.append((int(index.offset[0]), rows, _pread_rows(path, *stored)))
        self._shards[fqn] = shards
        return shards

    def _tensor_meta(self, fqn: str) -> TensorStorageMetadata:
        # a table's key: plan_import took only tensors (DCP's bytes entries are ignored)
        return cast(TensorStorageMetadata, self._meta.state_dict_metadata[fqn])

    def _whole_shard(self, fqn, index, rows):
        def read(first: int, dst: torch.Tensor) -> None:
            if fqn not in self._whole:
                self.log(f"[stream] {fqn}: a DCP shard stored with a transform is read whole through DCP")
                full = torch.empty(self._tensor_meta(fqn).size, dtype=torch.float32)
                dcp.load({fqn: full}, storage_reader=dcp.FileSystemReader(str(self.ckpt.path)), no_dist=True)
                self._whole = {fqn: full}
            dst.copy_(self._whole[fqn][int(index.offset[0]) + first :][: dst.shape[0]])

        return read


class ModelSource:
    """The tables and dense layers of a built model's weights file (``scripts/build_big.py`` or
    ``build_mar.py``, the same config and dtype), read as they are: its fused rows copied byte for
    byte (no quantization), a chunk at a time from the mapped file; hot copies it holds are left
    behind (``write_weights`` makes the new ones). What re-packing a model with new counts reads."""

    def __init__(self, weights: str | Path, config: DLRMConfig):
        self.path, self.config = Path(weights), config
        if not self.path.is_file():
            raise ConfigError(f"--repack: {self.path}: no weights file (a model directory holds dlrm.pt)")
        try:
            self.state = torch.load(self.path, map_location="cpu", mmap=True, weights_only=True)
        except RuntimeError as e:
            if "Cannot allocate memory" not in str(e):
                raise ConfigError(f"--repack: {self.path}: not a torch state_dict file ({e})") from None
            self.state = load_read_only(self.path, random_access=False)  # larger than memory: read in order
        width = row_bytes(config)
        for name, rows in zip(config.sparse_features, config.num_embeddings):
            got = self.state.get(f"{TABLES}{name}.weight")
            if (
                got is None
                or got.dtype != torch.uint8
                or got.dim() != 2
                or got.shape[0] < rows
                or got.shape[1] != width
            ):
                shape = None if got is None else list(got.shape)
                raise ConfigError(
                    f"--repack: {self.path}: table {name!r} is {shape}, the config needs {rows} rows of {width} bytes "
                    f"({config.build.embedding_dtype}); re-pack with the model's own model-config.yaml"
                )

    def describe(self) -> str:
        return f"the rows of {self.path}, byte for byte"

    def fused(self, table: int, start: int, n: int) -> torch.Tensor:
        return self.state[f"{TABLES}{self.config.sparse_features[table]}.weight"][start : start + n]

    def rows(self, table: int, start: int, n: int) -> torch.Tensor:
        raise InternalError("ModelSource holds fused rows: write_weights reads fused()")

    def dense(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.state.items() if not k.startswith((EBC, HOT, COLD))}


def _stored_rows(path: Path, offset: int, length: int):
    """Where a torch.save blob at ``offset`` in ``path`` keeps its one tensor's fp32 bytes, as
    (absolute byte offset of the tensor's first element, row bytes), or None when the tensor is
    not a dense row-major fp32 table (the caller then reads it whole)."""
    with open(path, "rb") as f:
        f.seek(offset)
        blob = _Window(f, offset, length)
        try:
            reader = torch._C.PyTorchFileReader(cast(IO[bytes], blob))  # a file-like window, as it reads one
            found = _tensor_in_pickle(reader.get_record("data.pkl"))
        except Exception:
            return None
        if found is None:
            return None
        key, dtype, storage_offset, size, stride = found
        if dtype != torch.float32 or len(size) != 2 or tuple(stride) != (size[1], 1):
            return None
        data = _record_offset(reader, f"data/{key}")
    return offset + data + storage_offset * 4, size[1] * 4


def _record_offset(reader: torch._C.PyTorchFileReader, name: str) -> int:
    """Where record ``name`` of a torch.save file starts in it."""
    return reader.get_record_offset(name)  # type: ignore[attr-defined]  # torch._C has it; its stubs do not


def _pread_rows(path: Path, first_byte: int, row_bytes: int):
    def read(first: int, dst: torch.Tensor) -> None:
        view = dst.numpy().data.cast("B")
        with open(path, "rb", buffering=0) as f:
            got = os.preadv(f.fileno(), [view], first_byte + first * row_bytes)
        if got != len(view):
            raise ConfigError(f"{path}: short read ({got} of {len(view)} bytes): the checkpoint is truncated")

    return read


class _Window(io.RawIOBase):
    """A read-only file view of ``length`` bytes from ``start`` (PyTorchFileReader seeks in it)."""

    def __init__(self, f, start: int, length: int):
        self.f, self.start, self.length, self.pos = f, start, length, 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def seek(self, pos, whence=0):
        self.pos = {0: pos, 1: self.pos + pos, 2: self.length + pos}[whence]
        return self.pos

    def tell(self):
        return self.pos

    def readinto(self, b):
        n = max(0, min(len(b), self.length - self.pos))
        self.f.seek(self.start + self.pos)
        got = self.f.readinto(memoryview(b)[:n])
        self.pos += got
        return got


def _tensor_in_pickle(data: bytes):
    """(storage key, dtype, storage offset, size, stride) of the one tensor a DCP shard blob
    pickles, without reading its storage."""
    found = []

    class Storage:
        def __init__(self, key, dtype):
            self.key, self.dtype = key, dtype

    def rebuild(storage, offset, size, stride, *rest):
        found.append((storage.key, storage.dtype, offset, tuple(size), tuple(stride)))
        return None

    class Unpickler(pickle.Unpickler):
        def find_class(self, module, name):
            if module == "torch._utils" and name in ("_rebuild_tensor_v2", "_rebuild_tensor_v3"):
                return rebuild
            if module == "torch" and name.endswith("Storage"):
                return name  # the class's name: reading its .dtype warns that TypedStorage is deprecated
            if module == "collections" and name == "OrderedDict":
                return collections.OrderedDict
            raise pickle.UnpicklingError(f"{module}.{name}")

        def persistent_load(self, pid):
            _, kind, key, _location, _numel = pid
            return Storage(key, {"FloatStorage": torch.float32}.get(kind))

    Unpickler(io.BytesIO(data)).load()
    return found[0] if len(found) == 1 else None


# --- the writer ------------------------------------------------------------------------------


def file_bytes(config: DLRMConfig, hot: Mapping[str, int] | None = None) -> int:
    """About what the weights file takes on disk: the tables' buffer (with ``hot`` rows' copies,
    table -> rows) plus the dense layers and the hot rows' ids."""
    dense = sum(
        p.numel() * 4
        for k, p in DLRMFactory(config).build("cpu", tables_on_meta=True).state_dict().items()
        if not k.startswith(EBC)
    )
    return layout(config, hot)[1] + dense + 8 * sum((hot or {}).values()) + (1 << 20)


def check_disk(path: str | Path, need: int, reserve: int = _RESERVE) -> int:
    """Raise ConfigError unless ``path``'s file system has ``need`` bytes free plus ``reserve``
    for everyone else; returns the free bytes."""
    free = shutil.disk_usage(Path(path).parent).free
    if free < need + reserve:
        raise ConfigError(
            f"{path}: needs {need / 2**30:.1f} GiB of disk (+ {reserve / 2**30:.0f} GiB kept free), "
            f"{free / 2**30:.1f} GiB free there; free some or pick another --big-dir"
        )
    return free


def rss() -> dict[str, int]:
    """This process's resident memory (bytes): anonymous (what the build holds), file-backed
    (mapped pages, which the kernel may drop), and the peak of their sum (VmHWM)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmHWM", "RssAnon", "RssFile", "VmRSS"):
                out[k] = int(v.split()[0]) * 1024
    return out


def write_weights(
    path: str | Path,
    config: DLRMConfig,
    source,
    chunk_bytes: int = CHUNK_BYTES,
    log: Callable[[str], None] = print,
    every_s: float = 10.0,
    hot: Mapping[str, torch.Tensor] | None = None,
    cold: Mapping[str, int] | None = None,
) -> dict:
    """Write the weights file ``DLRMFactory(config).load`` reads, table by table from
    ``source`` (``RandomSource`` or ``CheckpointSource``), in ``config.build.embedding_dtype``,
    never holding more than ``chunk_bytes`` of fp32 rows. ``hot``: table -> its hot ids, in id
    order (``dlrmkit.hot.choose``): their rows' copies go after the table's rows, gathered as
    the chunks pass (held whole: the hot region's bytes). Returns what it measured."""
    path = Path(path)
    hot = {t: h.to(torch.int64) for t, h in (hot or {}).items() if len(h)}
    slots, host = layout(config, {t: len(h) for t, h in hot.items()})
    dim, dtype = config.embedding_dim, config.build.embedding_dtype
    started = time.perf_counter()
    log(
        f"[stream] {path}: {len(slots)} tables, {sum(s.rows for s in slots):,} rows x D={dim} -> {dtype}, "
        f"{host / 2**30:.2f} GiB of fused rows; from {source.describe()}"
    )
    tmp = path.with_name(path.name + ".partial")
    tmp.unlink(missing_ok=True)
    with FakeTensorMode():
        buf = torch.empty(host, dtype=torch.uint8)
        views = {
            f"{TABLES}{s.name}.weight": buf.as_strided((s.rows, s.row_bytes), (s.row_bytes, 1), s.offset) for s in slots
        }
    # The dense layers' shapes first (their values come from the source after the tables).
    skeleton = DLRMFactory(config).build("cpu", tables_on_meta=True).state_dict()
    dense_keys = [k for k in skeleton if not k.startswith(EBC)]
    # a packed model's hot ids and cold lookups per table, written after the dense layers
    extra = {
        **{f"{HOT}{t}": h.contiguous() for t, h in hot.items()},
        **{f"{COLD}{t}": torch.tensor([int(n)]) for t, n in (cold or {}).items() if t in hot},
    }
    state = {
        **views,
        **{k: torch.empty_like(skeleton[k], device="cpu") for k in dense_keys},
        **{k: torch.empty_like(v) for k, v in extra.items()},
    }
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(state, tmp)
    reader = torch._C.PyTorchFileReader(str(tmp))
    # storages are numbered in the order the pickler first meets them: the table buffer, then each dense tensor
    base = _record_offset(reader, "data/0")
    dense_at = {k: _record_offset(reader, f"data/{i + 1}") for i, k in enumerate([*dense_keys, *extra])}
    del reader
    total_rows = sum(config.num_embeddings)
    done_rows, last = 0, time.perf_counter()
    chunk_rows = max(1, chunk_bytes // (dim * 4))
    fd = os.open(tmp, os.O_WRONLY)
    try:
        for t, s in enumerate(slots):
            t0 = time.perf_counter()
            own = config.num_embeddings[t]
            ids = hot.get(s.name)
            copies = None if ids is None else torch.empty(len(ids), s.row_bytes, dtype=torch.uint8)
            for start in range(0, own, chunk_rows):
                n = min(chunk_rows, own - start)
                if hasattr(source, "fused"):  # already the kernel's rows (ModelSource): copied as they are
                    fused = source.fused(t, start, n)
                else:
                    fused = fused_rows({s.name: source.rows(t, start, n)}, dtype)[s.name]
                if fused.shape != (n, s.row_bytes):
                    raise InternalError(
                        f"table {s.name}: quantized rows {tuple(fused.shape)}, layout {n} x {s.row_bytes}"
                    )
                _pwrite(fd, fused, base + s.offset + start * s.row_bytes)
                if ids is not None and copies is not None:
                    here = (ids >= start) & (ids < start + n)
                    copies[here] = fused[ids[here] - start]
                done_rows += n
                now = time.perf_counter()
                if now - last >= every_s:
                    last, el = now, now - started
                    m = rss()
                    log(
                        f"[stream]   {done_rows:,}/{total_rows:,} rows ({100 * done_rows / total_rows:.1f}%), "
                        f"{el:.0f} s, ETA {el * (total_rows - done_rows) / max(done_rows, 1):.0f} s, "
                        f"RSS anon {m.get('RssAnon', 0) / 2**20:.0f} MiB"
                    )
            if copies is not None:
                _pwrite(fd, copies, base + s.offset + own * s.row_bytes)
            if own >= chunk_rows:
                log(f"[stream] table {s.name}: {own:,} rows in {time.perf_counter() - t0:.1f} s")
        dense = source.dense()
        for k in dense_keys:
            v = dense[k]
            if v.shape != skeleton[k].shape or v.dtype != torch.float32:
                raise ConfigError(
                    f"checkpoint: layer {k!r} has shape {list(v.shape)}, expected {list(skeleton[k].shape)}"
                )
            _pwrite(fd, v.contiguous(), dense_at[k])
        for k, tensor in extra.items():
            _pwrite(fd, tensor, dense_at[k])
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    m = rss()
    took = time.perf_counter() - started
    result = {
        "path": str(path),
        "dtype": dtype,
        "rows": total_rows,
        "table_bytes": host,
        "file_bytes": path.stat().st_size,
        "seconds": round(took, 1),
        "peak_rss_bytes": m.get("VmHWM"),
        "rss_anon_bytes": m.get("RssAnon"),
        "peak_rss_self_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        "chunk_rows": chunk_rows,
        "source": source.describe(),
        "hot_rows": sum(len(h) for h in hot.values()),
        "hot_bytes": sum(len(h) for h in hot.values()) * row_bytes(config),
    }
    log(
        f"[stream] wrote {path} ({result['file_bytes'] / 2**30:.2f} GiB) in {took:.1f} s, "
        f"peak RSS {result['peak_rss_bytes'] / 2**20:.0f} MiB"
    )
    return result


def _pwrite(fd: int, t: torch.Tensor, at: int) -> None:
    view = t.contiguous().view(torch.uint8).reshape(-1).numpy().data
    while len(view):
        n = os.pwrite(fd, view, at)
        view, at = view[n:], at + n


def iter_tables(config: DLRMConfig, source, chunk_rows: int) -> Iterator[tuple[int, int, torch.Tensor]]:
    """(table index, first row, fp32 rows) chunk after chunk: what ``write_weights`` quantizes
    (``bench/bigtables.py`` measures the quantization error with it, table by table)."""
    for t, rows in enumerate(config.num_embeddings):
        for start in range(0, rows, chunk_rows):
            yield t, start, source.rows(t, start, min(chunk_rows, rows - start))
