"""Reading a trained checkpoint: its keys and shapes first, checked against the config, then its
tensors (``import_checkpoint``; ``dlrmkit.checkpoint`` says what is accepted).

A ``.pt`` / ``.pth`` file is memory-mapped; a ``torch.distributed.checkpoint`` (DCP) directory is
read in this one process without a process group, each tensor straight into one preallocated
full-size tensor, so the tables are never held twice.
"""

from __future__ import annotations

import re
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, cast

import torch
import torch.distributed.checkpoint as dcp  # torchrec imports it anyway: no cost to load it here
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from dlrmkit.config import DLRMConfig
from dlrmkit.errors import ConfigError
from dlrmkit.model import DLRMFactory
from dlrmkit.scale import TABLES

PREFIXES = ("model.", "module.", "_dmp_wrapped_module.")
PARTS = ("sparse_arch.", "dense_arch.", "inter_arch.", "over_arch.")  # a torchrec DLRM's children
HOLDERS = ("model", "model_state_dict", "state_dict")  # where training scripts nest the state_dict


@dataclass
class Checkpoint:
    """The DLRM tensors of a checkpoint, by key with the wrapper prefixes stripped, before any
    tensor data is read: ``shapes[key] = (shape, dtype)``. ``load`` reads them."""

    path: Path
    kind: str  # "DCP directory (N ranks)" or "state_dict file"
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]
    ignored: list[str] = field(default_factory=list)  # keys that are no DLRM tensor (optimizer state, step)
    # key -> its tensor (a state_dict file, memory-mapped) or its key in a DCP directory
    sources: dict[str, torch.Tensor | str] = field(default_factory=dict, repr=False)

    @property
    def tables(self) -> dict[str, tuple[int, int]]:
        """Table name -> (rows, D), in the checkpoint's order (a DCP directory keeps none: natural sort)."""
        return {
            k[len(TABLES) : -len(".weight")]: (s[0], s[1])
            for k, (s, _) in self.shapes.items()
            if k.startswith(TABLES) and k.endswith(".weight")
        }

    @property
    def records_order(self) -> bool:
        """Whether the tables come in the trainer's order: a state_dict file keeps the insertion
        order of torchrec's ``embedding_bags`` (the ``EmbeddingBagConfig`` list, sharded or not);
        a DCP directory's ``.metadata`` is a dict of keys with no order of its own."""
        return not self.kind.startswith("DCP")

    def load(self, keys: dict[str, str]) -> dict[str, torch.Tensor]:
        """``{new_key: tensor}`` for ``keys = {new_key: key}``."""
        if not self.kind.startswith("DCP"):
            return {new: cast(torch.Tensor, self.sources[old]) for new, old in keys.items()}
        # Full-size targets, filled in place shard by shard: DCP reshards whatever the ranks wrote.
        targets: dict[str, torch.Tensor] = {
            cast(str, self.sources[old]): torch.empty(self.shapes[old][0], dtype=self.shapes[old][1])
            for old in keys.values()
        }
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(targets, storage_reader=dcp.FileSystemReader(str(self.path)), no_dist=True)
        return {new: targets[cast(str, self.sources[old])] for new, old in keys.items()}


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
            raise ConfigError(
                f"{path}: no state_dict: expected tensors at the top level or a dict under "
                f"{' / '.join(HOLDERS)}, got keys {sorted(map(str, obj))[:8]}"
            )
        ignored = [f"{k} (beside {holder!r})" for k in obj if k != holder]
        obj = obj[holder]
    if not isinstance(obj, dict):
        raise ConfigError(f"{path}: expected a state_dict (dict of tensors), got {type(obj).__name__}")
    ckpt = Checkpoint(path, "state_dict file", {}, ignored)
    for key, value in obj.items():
        if isinstance(value, torch.Tensor):
            _add(ckpt, str(key), value, tuple(value.shape), value.dtype)
        else:  # a step counter, a config: no weight
            ckpt.ignored.append(str(key))
    return ckpt


def _open_dcp(path: Path) -> Checkpoint:
    if not (path / ".metadata").is_file():
        raise ConfigError(f"{path}: a directory without .metadata is no torch.distributed.checkpoint (DCP)")
    meta = dcp.FileSystemReader(str(path)).read_metadata()
    ranks = (
        len(
            {
                m.relative_path.split("_")[2]
                for m in (meta.storage_data or {}).values()
                if re.match(r"__\d+_", m.relative_path)
            }
        )
        or "?"
    )
    ckpt = Checkpoint(path, f"DCP directory ({ranks} rank{'s' if ranks != 1 else ''})", {})
    natural = sorted(
        meta.state_dict_metadata, key=lambda k: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", k)]
    )
    for key in natural:
        m = meta.state_dict_metadata[key]
        if isinstance(m, TensorStorageMetadata):
            _add(ckpt, key, key, tuple(m.size), m.properties.dtype)
        else:  # bytes: a step counter, a pickled object
            _add(ckpt, key, key, None, None)
    return ckpt


def _add(
    ckpt: Checkpoint, key: str, source: torch.Tensor | str, shape: tuple[int, ...] | None, dtype: torch.dtype | None
) -> None:
    stripped = key
    while not stripped.startswith(PARTS):
        prefix = next((p for p in PREFIXES if stripped.startswith(p)), None)
        if prefix is None:
            break
        stripped = stripped[len(prefix) :]
    if shape is None or not stripped.startswith(PARTS):
        ckpt.ignored.append(key)
        return
    if stripped in ckpt.shapes:
        raise ConfigError(
            f"{ckpt.path}: two keys are {stripped!r} once the wrapper prefixes "
            f"({', '.join(PREFIXES)}) are stripped; keep one model per checkpoint"
        )
    ckpt.shapes[stripped] = (shape, dtype)
    ckpt.sources[stripped] = source


def table_for_features(ckpt: Checkpoint, config: DLRMConfig) -> dict[str, str]:
    """Feature -> the checkpoint table that serves it: ``handler.table_names``, else ``<feature>``,
    else ``t_<feature>``. Raises ConfigError naming the feature and the tables it could have been."""
    tables = ckpt.tables
    given = dict(config.build.table_names)
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


def plan_import(ckpt: Checkpoint, config: DLRMConfig, feature_order: list[str] | None = None) -> dict[str, str]:
    """``{archive key: checkpoint key}`` for every tensor of the DLRM that ``config`` describes,
    checked against the config's shapes before any tensor data is read. The first key that does
    not fit is a ConfigError naming it (a table by its checkpoint name and feature), its shape and
    what the config expects; so is a feature order that contradicts the checkpoint's or
    ``feature_order`` (``--feature-order``)."""
    factory = DLRMFactory(config)
    model = factory.build("cpu", tables_on_meta=True)
    expected = {k: v.to("meta") for k, v in model.state_dict().items()}
    tables = table_for_features(ckpt, config)
    keys = {f"{TABLES}{f}.weight": f"{TABLES}{t}.weight" for f, t in tables.items()}
    for new, old in keys.items():
        shape, want = ckpt.shapes[old][0], tuple(expected[new].shape)
        if shape != want:
            raise ConfigError(
                f"checkpoint: table {old[len(TABLES) : -len('.weight')]!r} (feature {new[len(TABLES) : -len('.weight')]!r}) "
                f"has shape {list(shape)}, the config expects {list(want)} (num_embeddings x embedding_dim)"
            )
    used = set(keys.values())
    for key, (shape, _) in ckpt.shapes.items():
        if key in used:
            continue
        if key.startswith(TABLES):
            raise ConfigError(
                f"checkpoint: table {key[len(TABLES) :].rsplit('.', 1)[0]!r} {list(shape)} serves no feature of "
                f"handler.sparse_features; add its feature or map it with handler.table_names"
            )
        if key not in expected:
            raise ConfigError(
                f"checkpoint: key {key!r} {list(shape)} does not fit the config: it has no such layer (another "
                f"interaction or arch? scripts/build_mar.py --checkpoint PATH --write-config OUT.yaml writes a "
                f"config that fits)"
            )
        keys[key] = key
    _check_order(ckpt, config, tables, feature_order)
    # Layer names, shapes and dtypes, with the factory's messages (meta tensors: no data read).
    factory.check_state_dict(
        {new: torch.empty(ckpt.shapes[old][0], dtype=ckpt.shapes[old][1], device="meta") for new, old in keys.items()},
        model,
        expected,
    )
    return keys


def import_checkpoint(
    path: str | Path, config: DLRMConfig, log: Callable[[str], None] = print, feature_order: list[str] | None = None
) -> dict[str, torch.Tensor]:
    """The fp32 state_dict of the DLRM that ``config`` describes, its tables named after their
    features, read from a trained checkpoint once every key, shape and the feature order has been
    checked."""
    ckpt = open_checkpoint(path)
    say_ignored(ckpt, log)
    keys = plan_import(ckpt, config, feature_order)
    started = time.perf_counter()
    state = ckpt.load(keys)
    renamed = [(old[len(TABLES) : -7], new[len(TABLES) : -7]) for new, old in keys.items() if new != old]
    table_bytes = sum(v.nbytes for k, v in state.items() if k.startswith(TABLES))
    log(
        f"[import] {ckpt.kind} {ckpt.path}: {len(state)} tensors, {config.num_features} tables "
        f"({table_bytes / 1e6:,.1f} MB) read in {time.perf_counter() - started:.2f} s"
        + (
            f"; tables renamed after their features: {', '.join(f'{o} -> {n}' for o, n in renamed[:3])}"
            f"{', ...' if len(renamed) > 3 else ''}"
            if renamed
            else ""
        )
    )
    return state


def say_ignored(ckpt: Checkpoint, log: Callable[[str], None]) -> None:
    """One line naming what the checkpoint holds besides the DLRM's tensors, if anything."""
    if ckpt.ignored:
        shown = ", ".join(ckpt.ignored[:4]) + (f" and {len(ckpt.ignored) - 4} more" if len(ckpt.ignored) > 4 else "")
        log(
            f"[import] ignored {len(ckpt.ignored)} entries that are no DLRM weights (optimizer state and the like): {shown}"
        )


def check_names(given: list[str], want: list[str], what: str, against: str) -> None:
    """``given`` names each of ``want`` once, or a ConfigError names the difference."""
    twice = sorted({n for n in given if given.count(n) > 1})
    stray = [n for n in given if n not in want]
    missing = [n for n in want if n not in given]
    if twice or stray or missing:
        problems = [
            f"not in {against}: {', '.join(stray)}" if stray else "",
            f"missing: {', '.join(missing)}" if missing else "",
            f"named twice: {', '.join(twice)}" if twice else "",
        ]
        raise ConfigError(
            f"{what} {','.join(given)} does not match {against} ({', '.join(want)}): "
            f"{'; '.join(p for p in problems if p)}"
        )


def _check_order(ckpt: Checkpoint, config: DLRMConfig, table_of: dict[str, str], given: list[str] | None) -> None:
    """The config's sparse_features order is the trainer's: it equals ``given`` (``--feature-order``),
    else the order a state_dict file records. A DCP directory records none: ``--verify`` proves it."""
    configured = list(config.sparse_features)
    if given is not None:
        check_names(given, configured, "--feature-order", "handler.sparse_features")
        if list(given) != configured:
            raise ConfigError(
                f"--feature-order {','.join(given)} differs from handler.sparse_features ({', '.join(configured)}): "
                f"the interaction reads the embeddings in sparse_features order; list them in the trainer's order"
            )
        return
    if not ckpt.records_order:
        return
    trained = [t for t in ckpt.tables if t in table_of.values()]
    feature_of = {t: f for f, t in table_of.items()}
    if [table_of[f] for f in configured] != trained:
        raise ConfigError(
            f"checkpoint: handler.sparse_features ({', '.join(configured)}) are not in the order of the "
            f"checkpoint's tables ({', '.join(trained)}), which is the trainer's: the interaction reads the "
            f"embeddings in sparse_features order, so this order serves a wrong score for every row. List them as "
            f"[{', '.join(feature_of[t] for t in trained)}] (or pass --feature-order if the file's order is not "
            f"the trainer's)"
        )
