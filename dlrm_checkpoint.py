"""Trained checkpoints in, the archive's state_dict out: what ``scripts/build_mar.py --checkpoint`` reads.

Accepted, with no code from the user:

- a ``.pt`` / ``.pth`` file of a state_dict, or of a dict holding one under ``model`` /
  ``model_state_dict`` / ``state_dict`` (optimizer state and the like are ignored, said in one line);
- a ``torch.distributed.checkpoint`` (DCP) directory (``.metadata`` + ``__<rank>_*.distcp``) from any
  number of ranks, read in this one process without a process group: each tensor is read straight
  into one preallocated full-size tensor, so the tables are never held twice;
- keys under any mix of the ``model.`` (``DLRMTrain``), ``module.`` / ``_dmp_wrapped_module.``
  (``DistributedModelParallel``, DDP) prefixes;
- tables named ``<feature>`` or ``t_<feature>`` (torchrec's examples), else ``handler.table_names``.

The archive names every table after its feature, so the handler's load path is the same for all.
Nothing here imports TorchServe; the archive does not ship this file.
"""

from __future__ import annotations

import math
import re
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from dlrm_config import DLRMConfig
from dlrm_errors import ConfigError

PREFIXES = ("model.", "module.", "_dmp_wrapped_module.")
PARTS = ("sparse_arch.", "dense_arch.", "inter_arch.", "over_arch.")  # a torchrec DLRM's children
TABLES = "sparse_arch.embedding_bag_collection.embedding_bags."
HOLDERS = ("model", "model_state_dict", "state_dict")  # where training scripts nest the state_dict


@dataclass
class Checkpoint:
    """The DLRM tensors of a checkpoint, by key with the wrapper prefixes stripped, before any
    tensor data is read: ``shapes[key] = (shape, dtype)``. ``load`` reads them."""

    path: Path
    kind: str  # "DCP directory (N ranks)" or "state_dict file"
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]
    ignored: list[str] = field(default_factory=list)  # keys that are no DLRM tensor (optimizer state, step)
    _source: dict[str, object] = field(default_factory=dict, repr=False)  # key -> checkpoint key or tensor

    @property
    def tables(self) -> dict[str, tuple[int, int]]:
        """Table name -> (rows, D), in the checkpoint's order (a DCP directory keeps none: natural sort)."""
        return {k[len(TABLES):-len(".weight")]: tuple(s) for k, (s, _) in self.shapes.items()
                if k.startswith(TABLES) and k.endswith(".weight")}

    def load(self, keys: dict[str, str]) -> dict[str, torch.Tensor]:
        """``{new_key: tensor}`` for ``keys = {new_key: key}``."""
        if not self.kind.startswith("DCP"):
            return {new: self._source[old] for new, old in keys.items()}
        import torch.distributed.checkpoint as dcp

        # Full-size targets, filled in place shard by shard: DCP reshards whatever the ranks wrote.
        targets = {self._source[old]: torch.empty(self.shapes[old][0], dtype=self.shapes[old][1])
                   for old in keys.values()}
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(targets, storage_reader=dcp.FileSystemReader(str(self.path)), no_dist=True)
        return {new: targets[self._source[old]] for new, old in keys.items()}


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Read a checkpoint's keys and shapes (a DCP directory's ``.metadata``; a file memory-mapped)."""
    path = Path(path)
    if path.is_dir():
        return _open_dcp(path)
    if not path.is_file():
        raise ConfigError(f"{path}: checkpoint not found (a .pt/.pth file or a DCP directory)")
    try:
        obj = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as e:  # torch raises several types for a corrupt or foreign file
        raise ConfigError(f"{path}: not a torch.save file of tensors ({type(e).__name__}: {e})") from None
    ignored: list[str] = []
    if isinstance(obj, dict) and not any(isinstance(v, torch.Tensor) for v in obj.values()):
        holder = next((h for h in HOLDERS if isinstance(obj.get(h), dict)), None)
        if holder is None:
            raise ConfigError(f"{path}: no state_dict: expected tensors at the top level or a dict under "
                              f"{' / '.join(HOLDERS)}, got keys {sorted(map(str, obj))[:8]}")
        ignored = [f"{k} (beside {holder!r})" for k in obj if k != holder]
        obj = obj[holder]
    if not isinstance(obj, dict):
        raise ConfigError(f"{path}: expected a state_dict (dict of tensors), got {type(obj).__name__}")
    ckpt = Checkpoint(path, "state_dict file", {}, ignored)
    for key, value in obj.items():
        _add(ckpt, str(key), value, tuple(value.shape) if isinstance(value, torch.Tensor) else None,
             getattr(value, "dtype", None))
    return ckpt


def _open_dcp(path: Path) -> Checkpoint:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if not (path / ".metadata").is_file():
        raise ConfigError(f"{path}: a directory without .metadata is no torch.distributed.checkpoint (DCP)")
    meta = FileSystemReader(str(path)).read_metadata()
    ranks = len({m.relative_path.split("_")[2] for m in (meta.storage_data or {}).values()
                 if re.match(r"__\d+_", m.relative_path)}) or "?"
    ckpt = Checkpoint(path, f"DCP directory ({ranks} rank{'s' if ranks != 1 else ''})", {})
    natural = sorted(meta.state_dict_metadata, key=lambda k: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", k)])
    for key in natural:
        m = meta.state_dict_metadata[key]
        tensor = isinstance(m, TensorStorageMetadata)
        _add(ckpt, key, key, tuple(m.size) if tensor else None, m.properties.dtype if tensor else None)
    return ckpt


def _add(ckpt: Checkpoint, key: str, source: object, shape, dtype) -> None:
    stripped = key
    while not stripped.startswith(PARTS):
        prefix = next((p for p in PREFIXES if stripped.startswith(p)), None)
        if prefix is None:
            break
        stripped = stripped[len(prefix):]
    if shape is None or not stripped.startswith(PARTS):
        ckpt.ignored.append(key)
        return
    if stripped in ckpt.shapes:
        raise ConfigError(f"{ckpt.path}: two keys are {stripped!r} once the wrapper prefixes "
                          f"({', '.join(PREFIXES)}) are stripped; keep one model per checkpoint")
    ckpt.shapes[stripped] = (shape, dtype)
    ckpt._source[stripped] = source


def table_for_features(ckpt: Checkpoint, config: DLRMConfig) -> dict[str, str]:
    """Feature -> the checkpoint table that serves it: ``handler.table_names``, else ``<feature>``,
    else ``t_<feature>``. Raises ConfigError naming the feature and the tables it could have been."""
    tables = ckpt.tables
    given = dict(config.table_names)
    out = {}
    for feature in config.sparse_features:
        if feature in given:
            if given[feature] not in tables:
                raise ConfigError(
                    f"checkpoint: table {given[feature]!r} (handler.table_names for feature {feature!r}) is not "
                    f"in the checkpoint; its tables are {', '.join(tables)}"
                )
            out[feature] = given[feature]
        else:
            out[feature] = next((t for t in (feature, f"t_{feature}") if t in tables), None)
            if out[feature] is None:
                raise ConfigError(
                    f"checkpoint: no table for feature {feature!r} (looked for {feature!r} and 't_{feature}'; "
                    f"the checkpoint's tables are {', '.join(tables)}); map it with handler.table_names"
                )
    return out


def plan_import(ckpt: Checkpoint, config: DLRMConfig) -> dict[str, str]:
    """``{archive key: checkpoint key}`` for every tensor of the DLRM that ``config`` describes,
    checked against the config's shapes before any tensor data is read. The first key that does
    not fit is a ConfigError naming it (a table by its checkpoint name and feature), its shape and
    what the config expects."""
    from dlrm_factory import DLRMFactory

    factory = DLRMFactory(config)
    model = factory.build("cpu", tables_on_meta=True)
    expected = {k: v.to("meta") for k, v in model.state_dict().items()}
    tables = table_for_features(ckpt, config)
    keys = {f"{TABLES}{f}.weight": f"{TABLES}{t}.weight" for f, t in tables.items()}
    for new, old in keys.items():
        shape, want = ckpt.shapes[old][0], tuple(expected[new].shape)
        if shape != want:
            raise ConfigError(
                f"checkpoint: table {old[len(TABLES):-len('.weight')]!r} (feature {new[len(TABLES):-len('.weight')]!r}) "
                f"has shape {list(shape)}, the config expects {list(want)} (num_embeddings x embedding_dim)"
            )
    used = set(keys.values())
    for key, (shape, _) in ckpt.shapes.items():
        if key in used:
            continue
        if key.startswith(TABLES):
            raise ConfigError(
                f"checkpoint: table {key[len(TABLES):].rsplit('.', 1)[0]!r} {list(shape)} serves no feature of "
                f"handler.sparse_features; add its feature or map it with handler.table_names"
            )
        if key not in expected:
            raise ConfigError(
                f"checkpoint: key {key!r} {list(shape)} does not fit the config: it has no such layer (another "
                f"interaction or arch? scripts/build_mar.py --checkpoint PATH --write-config OUT.yaml writes a "
                f"config that fits)"
            )
        keys[key] = key
    # Layer names, shapes and dtypes, with the factory's messages (meta tensors: no data read).
    factory.check_state_dict({new: torch.empty(ckpt.shapes[old][0], dtype=ckpt.shapes[old][1], device="meta")
                              for new, old in keys.items()}, model, expected)
    return keys


def import_checkpoint(path: str | Path, config: DLRMConfig, log: Callable[[str], None] = print) -> dict[str, torch.Tensor]:
    """The fp32 state_dict of the DLRM that ``config`` describes, its tables named after their
    features, read from a trained checkpoint once every key and shape has been checked."""
    ckpt = open_checkpoint(path)
    _say_ignored(ckpt, log)
    keys = plan_import(ckpt, config)
    started = time.perf_counter()
    state = ckpt.load(keys)
    renamed = [(old[len(TABLES):-7], new[len(TABLES):-7]) for new, old in keys.items() if new != old]
    table_bytes = sum(v.nbytes for k, v in state.items() if k.startswith(TABLES))
    log(f"[import] {ckpt.kind} {ckpt.path}: {len(state)} tensors, {config.num_features} tables "
        f"({table_bytes / 1e6:,.1f} MB) read in {time.perf_counter() - started:.2f} s"
        + (f"; tables renamed after their features: {', '.join(f'{o} -> {n}' for o, n in renamed[:3])}"
           f"{', ...' if len(renamed) > 3 else ''}" if renamed else ""))
    return state


def derive_config(ckpt: Checkpoint) -> tuple[dict, list[str], list[str]]:
    """The ``handler:`` section that fits ``ckpt``, read off its key names and shapes, plus what
    was derived and what had to be assumed (one line each)."""
    tables = ckpt.tables
    if not tables:
        raise ConfigError(f"{ckpt.path}: no embedding tables ({TABLES}<table>.weight) in the checkpoint; "
                          f"its keys: {', '.join(list(ckpt.shapes)[:5]) or 'none'}")
    dims = {d for _, d in tables.values()}
    if len(dims) > 1:
        raise ConfigError(f"{ckpt.path}: the tables have different embedding dims {sorted(dims)}; a torchrec DLRM "
                          f"needs one embedding_dim")
    strip = all(t.startswith("t_") for t in tables)
    features = [t[2:] if strip else t for t in tables]
    rows = [r for r, _ in tables.values()]
    dense_in = _shape(ckpt, "dense_arch.model._mlp.0._linear.weight")[1]
    handler = {
        "num_dense_features": dense_in,
        "sparse_features": features,
        "num_embeddings": rows if len(set(rows)) > 1 else rows[0],
        "embedding_dim": dims.pop(),
        "dense_arch_layer_sizes": _mlp(ckpt, "dense_arch.model._mlp"),
        "over_arch_layer_sizes": _mlp(ckpt, "over_arch.model.0._mlp") + [_shape(ckpt, "over_arch.model.1.weight")[0]],
    }
    interaction = "dot"
    if any(k.startswith("inter_arch.crossnet.") for k in ckpt.shapes):
        interaction = "dcn"
        w = [k for k in ckpt.shapes if re.fullmatch(r"inter_arch\.crossnet\.W_kernels\.\d+", k)]
        handler.update(dcn_num_layers=len(w), dcn_low_rank_dim=_shape(ckpt, "inter_arch.crossnet.W_kernels.0")[1])
    elif any(k.startswith("inter_arch.interaction_branch1.") for k in ckpt.shapes):
        interaction = "projection"
        handler.update(interaction_branch1_layer_sizes=_mlp(ckpt, "inter_arch.interaction_branch1.model._mlp"),
                       interaction_branch2_layer_sizes=_mlp(ckpt, "inter_arch.interaction_branch2.model._mlp"))
    handler = {"interaction": interaction, **handler}
    handler.update(pooling="sum", output="probability", embedding_dtype="fp32")
    derived = [
        f"interaction {interaction} ({'no inter_arch weights' if interaction == 'dot' else 'inter_arch keys'})",
        f"{len(features)} sparse features from the table names ({', '.join(features[:4])}"
        f"{', ...' if len(features) > 4 else ''}), rows per table and embedding_dim {handler['embedding_dim']} "
        f"from their shapes",
        f"{dense_in} dense features, dense arch {handler['dense_arch_layer_sizes']}, over arch "
        f"{handler['over_arch_layer_sizes']} from the MLP weights",
    ]
    assumed = [
        f"feature names = table names{' without their t_ prefix' if strip else ''}; requests send them as keys",
        "feature order: " + ("the order of the checkpoint's tables" if not ckpt.kind.startswith("DCP") else
                             "table names in natural order (a DCP directory does not keep the trainer's order); "
                             "the over arch depends on it: list sparse_features in the trainer's table order if "
                             "that differs"),
        "pooling sum (torchrec's default; a checkpoint does not record it)",
        "output probability (sigmoid of the logit), fp32 tables, serving settings of model-config.yaml",
    ]
    return handler, derived, assumed


def config_text(ckpt: Checkpoint, handler: dict, derived: list[str], assumed: list[str]) -> str:
    """A complete model-config.yaml: model-config.yaml's serving settings, timeouts by its rule."""
    import yaml

    c = DLRMConfig.from_dict(handler)
    weights_mb = sum(c.num_embeddings) * c.embedding_dim * 4 / 1e6
    shipped = yaml.safe_load((Path(__file__).resolve().parent / "model-config.yaml").read_text())
    top = {k: shipped[k] for k in ("minWorkers", "maxWorkers", "batchSize", "maxBatchDelay") if k in shipped}
    top.update(startupTimeout=max(120, math.ceil(2 * (30 + weights_mb / 100))),
               responseTimeout=max(60, math.ceil(10 * (5 + weights_mb / 100))))
    lines = [f"# Written by scripts/build_mar.py --write-config from {ckpt.path} ({ckpt.kind}).",
             *(f"# derived: {d}" for d in derived), *(f"# assumed: {a}" for a in assumed),
             "# Serving settings as in model-config.yaml (docs/performance.md); timeouts by its rule for",
             f"# W = {weights_mb:,.1f} MB of weights: startupTimeout >= max(120, 2 x (30 + W / 100)),",
             "# responseTimeout >= max(60, 10 x (5 + W / 100)).",
             yaml.safe_dump(top, sort_keys=False).rstrip(),
             yaml.safe_dump({"handler": handler}, sort_keys=False, default_flow_style=None, width=120).rstrip()]
    return "\n".join(lines) + "\n"


def write_config(path: str | Path, out: str | Path, log: Callable[[str], None] = print) -> DLRMConfig:
    """``--write-config``: derive the config, check that the checkpoint fits it, write ``out``."""
    ckpt = open_checkpoint(path)
    _say_ignored(ckpt, log)
    handler, derived, assumed = derive_config(ckpt)
    config = DLRMConfig.from_dict(handler)
    plan_import(ckpt, config)  # every key and shape fits, or the message says which does not
    Path(out).write_text(config_text(ckpt, handler, derived, assumed))
    for line in derived:
        log(f"[config] derived: {line}")
    for line in assumed:
        log(f"[config] assumed: {line}")
    log(f"[config] wrote {out}; build with: scripts/build_mar.py --config {out} --checkpoint {path} --force")
    return config


def _shape(ckpt: Checkpoint, key: str) -> tuple[int, ...]:
    if key not in ckpt.shapes:
        raise ConfigError(f"{ckpt.path}: key {key!r} is missing: not a torchrec DLRM checkpoint "
                          f"(keys: {', '.join(list(ckpt.shapes)[:5])}, ...)")
    return ckpt.shapes[key][0]


def _mlp(ckpt: Checkpoint, prefix: str) -> list[int]:
    """Output sizes of torchrec's MLP layers ``<prefix>.<i>._linear.weight [out, in]``."""
    sizes = []
    while f"{prefix}.{len(sizes)}._linear.weight" in ckpt.shapes:
        sizes.append(ckpt.shapes[f"{prefix}.{len(sizes)}._linear.weight"][0][0])
    if not sizes:
        _shape(ckpt, f"{prefix}.0._linear.weight")
    return sizes


def _say_ignored(ckpt: Checkpoint, log: Callable[[str], None]) -> None:
    if ckpt.ignored:
        shown = ", ".join(ckpt.ignored[:4]) + (f" and {len(ckpt.ignored) - 4} more" if len(ckpt.ignored) > 4 else "")
        log(f"[import] ignored {len(ckpt.ignored)} entries that are no DLRM weights (optimizer state and the like): {shown}")
