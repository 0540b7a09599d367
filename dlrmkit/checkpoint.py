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

What a checkpoint does not record is never guessed where it changes the scores: the feature order
comes from the file (a state_dict keeps it), a numbered sequence or ``--feature-order``; the rest
(pooling, the dense features' order and preprocessing) is proven by ``verify_archive``
(``--verify``): the built archive loaded as a TorchServe worker loads it, scoring the trainer's own
requests against the trainer's own scores.

The archive names every table after its feature, so the handler's load path is the same for all.
Nothing here imports TorchServe; the archive does not ship this file.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import tempfile
import time
import zipfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from dlrmkit.config import DLRMConfig
from dlrmkit.errors import ConfigError
from dlrmkit.scale import TABLES

ROOT = Path(__file__).resolve().parent.parent  # the repository: the shipped model-config.yaml, metrics.yaml

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
    _source: dict[str, object] = field(default_factory=dict, repr=False)  # key -> checkpoint key or tensor

    @property
    def tables(self) -> dict[str, tuple[int, int]]:
        """Table name -> (rows, D), in the checkpoint's order (a DCP directory keeps none: natural sort)."""
        return {k[len(TABLES):-len(".weight")]: (s[0], s[1]) for k, (s, _) in self.shapes.items()
                if k.startswith(TABLES) and k.endswith(".weight")}

    @property
    def records_order(self) -> bool:
        """Whether the tables come in the trainer's order: a state_dict file keeps the insertion
        order of torchrec's ``embedding_bags`` (the ``EmbeddingBagConfig`` list, sharded or not);
        a DCP directory's ``.metadata`` is a dict of keys with no order of its own."""
        return not self.kind.startswith("DCP")

    def load(self, keys: dict[str, str]) -> dict[str, torch.Tensor]:
        """``{new_key: tensor}`` for ``keys = {new_key: key}``."""
        if not self.kind.startswith("DCP"):
            return {new: self._source[old] for new, old in keys.items()}  # type: ignore[misc]  # tensors here
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


def plan_import(ckpt: Checkpoint, config: DLRMConfig, feature_order: list[str] | None = None) -> dict[str, str]:
    """``{archive key: checkpoint key}`` for every tensor of the DLRM that ``config`` describes,
    checked against the config's shapes before any tensor data is read. The first key that does
    not fit is a ConfigError naming it (a table by its checkpoint name and feature), its shape and
    what the config expects; so is a feature order that contradicts the checkpoint's or
    ``feature_order`` (``--feature-order``)."""
    from dlrmkit.model import DLRMFactory

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
    _check_order(ckpt, config, tables, feature_order)
    # Layer names, shapes and dtypes, with the factory's messages (meta tensors: no data read).
    factory.check_state_dict({new: torch.empty(ckpt.shapes[old][0], dtype=ckpt.shapes[old][1], device="meta")
                              for new, old in keys.items()}, model, expected)
    return keys


def import_checkpoint(path: str | Path, config: DLRMConfig, log: Callable[[str], None] = print,
                      feature_order: list[str] | None = None) -> dict[str, torch.Tensor]:
    """The fp32 state_dict of the DLRM that ``config`` describes, its tables named after their
    features, read from a trained checkpoint once every key, shape and the feature order has been
    checked."""
    ckpt = open_checkpoint(path)
    _say_ignored(ckpt, log)
    keys = plan_import(ckpt, config, feature_order)
    started = time.perf_counter()
    state = ckpt.load(keys)
    renamed = [(old[len(TABLES):-7], new[len(TABLES):-7]) for new, old in keys.items() if new != old]
    table_bytes = sum(v.nbytes for k, v in state.items() if k.startswith(TABLES))
    log(f"[import] {ckpt.kind} {ckpt.path}: {len(state)} tensors, {config.num_features} tables "
        f"({table_bytes / 1e6:,.1f} MB) read in {time.perf_counter() - started:.2f} s"
        + (f"; tables renamed after their features: {', '.join(f'{o} -> {n}' for o, n in renamed[:3])}"
           f"{', ...' if len(renamed) > 3 else ''}" if renamed else ""))
    return state


def derive_config(ckpt: Checkpoint, feature_order: list[str] | None = None) -> tuple[dict, list[str], list[str]]:
    """The ``handler:`` section that fits ``ckpt``, read off its key names and shapes, plus what
    was derived and what had to be assumed (one line each). The feature order is never assumed
    (``feature_order_of``)."""
    tables = ckpt.tables
    if not tables:
        raise ConfigError(f"{ckpt.path}: no embedding tables ({TABLES}<table>.weight) in the checkpoint; "
                          f"its keys: {', '.join(list(ckpt.shapes)[:5]) or 'none'}")
    dims = {d for _, d in tables.values()}
    if len(dims) > 1:
        raise ConfigError(f"{ckpt.path}: the tables have different embedding dims {sorted(dims)}; a torchrec DLRM "
                          f"needs one embedding_dim")
    strip = all(t.startswith("t_") for t in tables)
    table_of = {(t[2:] if strip else t): t for t in tables}  # feature -> table, in the checkpoint's order
    features, source = feature_order_of(ckpt, list(table_of), feature_order)
    rows = [tables[table_of[f]][0] for f in features]
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
        f"feature order {', '.join(features[:6])}{', ...' if len(features) > 6 else ''}: {source}",
        f"{dense_in} dense features, dense arch {handler['dense_arch_layer_sizes']}, over arch "
        f"{handler['over_arch_layer_sizes']} from the MLP weights",
    ]
    assumed = [
        f"feature names = table names{' without their t_ prefix' if strip else ''}; requests send them as keys "
        "(a wrong name is a 400 naming it, never a wrong score)",
        "pooling sum (torchrec's default; a checkpoint does not record it: set pooling: mean if the trainer "
        "did, and prove the archive with --verify)",
        "the dense features' order and preprocessing are the trainer's (a checkpoint records only their count; "
        "--verify with requests built as your clients build them checks it)",
        "output probability (sigmoid of the logit), fp32 tables, serving settings of model-config.yaml",
    ]
    return handler, derived, assumed


def feature_order_of(ckpt: Checkpoint, features: list[str], given: list[str] | None) -> tuple[list[str], str]:
    """The trainer's feature order and where it came from: ``given`` (``--feature-order``), else
    the checkpoint's own (a state_dict file), else a numbered sequence (``cat_0 ... cat_25`` in
    natural order); anything else is a ConfigError saying why the order matters and how to give
    it. The interaction reads the embeddings in this order: a guess scores every row wrong."""
    if given is not None:
        _check_names(given, features, "--feature-order", "the checkpoint's features")
        differs = ckpt.records_order and list(given) != features
        return list(given), "given with --feature-order" + (f" (the checkpoint's table order is {', '.join(features)})"
                                                  if differs else "")
    if ckpt.records_order:
        return features, "the checkpoint's table order (a state_dict file keeps the trainer's EmbeddingBagConfig order)"
    if numbered(features):
        return features, ("one numbered sequence in natural order (a DCP directory keeps no order; "
                          "torchrec's DLRM example numbers its tables)")
    raise ConfigError(
        f"{ckpt.path}: a DCP directory does not record the trainer's table order, and its tables "
        f"({', '.join(features)}) are no numbered sequence (like cat_0 ... cat_25) to read it from. The "
        f"interaction reads the embeddings in that order, so any other order serves a plausible, wrong score for "
        f"every row. Name them in the order of the trainer's EmbeddingBagConfig list: --feature-order "
        f"{','.join(['NAME'] * min(len(features), 3))}{',...' if len(features) > 3 else ''}")


def numbered(names: list[str]) -> bool:
    """Whether ``names`` are one unambiguous numbered sequence: one prefix and the numbers 0..N-1 or
    1..N (``cat_0, cat_1, ..., cat_25``). One name has one order."""
    if len(names) == 1:
        return True
    parts = [re.fullmatch(r"(.*?)(\d+)", n) for n in names]
    if not all(parts) or len({p.group(1) for p in parts}) != 1:
        return False
    numbers = sorted(int(p.group(2)) for p in parts)
    return numbers in (list(range(len(names))), list(range(1, len(names) + 1)))


def _check_names(given: list[str], want: list[str], what: str, against: str) -> None:
    """``given`` names each of ``want`` once, or a ConfigError names the difference."""
    twice = sorted({n for n in given if given.count(n) > 1})
    stray = [n for n in given if n not in want]
    missing = [n for n in want if n not in given]
    if twice or stray or missing:
        problems = [f"not in {against}: {', '.join(stray)}" if stray else "",
                    f"missing: {', '.join(missing)}" if missing else "",
                    f"named twice: {', '.join(twice)}" if twice else ""]
        raise ConfigError(f"{what} {','.join(given)} does not match {against} ({', '.join(want)}): "
                          f"{'; '.join(p for p in problems if p)}")


def _check_order(ckpt: Checkpoint, config: DLRMConfig, table_of: dict[str, str], given: list[str] | None) -> None:
    """The config's sparse_features order is the trainer's: it equals ``given`` (``--feature-order``),
    else the order a state_dict file records. A DCP directory records none: ``--verify`` proves it."""
    configured = list(config.sparse_features)
    if given is not None:
        _check_names(given, configured, "--feature-order", "handler.sparse_features")
        if list(given) != configured:
            raise ConfigError(
                f"--feature-order {','.join(given)} differs from handler.sparse_features ({', '.join(configured)}): "
                f"the interaction reads the embeddings in sparse_features order; list them in the trainer's order")
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
            f"the trainer's)")


def config_text(ckpt: Checkpoint, handler: dict, derived: list[str], assumed: list[str]) -> str:
    """A complete model-config.yaml: model-config.yaml's serving settings, timeouts by its rule."""
    import yaml

    c = DLRMConfig.from_dict(handler)
    weights_mb = sum(c.num_embeddings) * c.embedding_dim * 4 / 1e6
    shipped = yaml.safe_load((ROOT / "model-config.yaml").read_text())
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


def write_config(path: str | Path, out: str | Path, log: Callable[[str], None] = print,
                 feature_order: list[str] | None = None) -> DLRMConfig:
    """``--write-config``: derive the config, check that the checkpoint fits it, write ``out``."""
    ckpt = open_checkpoint(path)
    _say_ignored(ckpt, log)
    handler, derived, assumed = derive_config(ckpt, feature_order)
    config = DLRMConfig.from_dict(handler)
    plan_import(ckpt, config, feature_order)  # every key and shape fits, or the message says which does not
    Path(out).write_text(config_text(ckpt, handler, derived, assumed))
    for line in derived:
        log(f"[config] derived: {line}")
    for line in assumed:
        log(f"[config] assumed: {line}")
    log(f"[config] wrote {out}; build and prove it with: scripts/build_mar.py --config {out} --checkpoint {path} "
        f"--verify EVAL.jsonl --force (docs/trained-models.md)")
    return config


def _shape(ckpt: Checkpoint, key: str) -> tuple[int, ...]:
    if key not in ckpt.shapes:
        raise ConfigError(f"{ckpt.path}: key {key!r} is missing: not a torchrec DLRM checkpoint "
                          f"(keys: {', '.join(list(ckpt.shapes)[:5])}, ...)")
    return ckpt.shapes[key][0]


def _mlp(ckpt: Checkpoint, prefix: str) -> list[int]:
    """Output sizes of torchrec's MLP layers ``<prefix>.<i>._linear.weight [out, in]``."""
    sizes: list[int] = []
    while f"{prefix}.{len(sizes)}._linear.weight" in ckpt.shapes:
        sizes.append(ckpt.shapes[f"{prefix}.{len(sizes)}._linear.weight"][0][0])
    if not sizes:
        _shape(ckpt, f"{prefix}.0._linear.weight")
    return sizes


def _say_ignored(ckpt: Checkpoint, log: Callable[[str], None]) -> None:
    if ckpt.ignored:
        shown = ", ".join(ckpt.ignored[:4]) + (f" and {len(ckpt.ignored) - 4} more" if len(ckpt.ignored) > 4 else "")
        log(f"[import] ignored {len(ckpt.ignored)} entries that are no DLRM weights (optimizer state and the like): {shown}")


@dataclass
class Verified:
    """What ``verify_archive`` found: rows checked, the largest |served - trainer| and where."""

    rows: int
    requests: int
    max_delta: float
    worst: str  # "line L, row R: served S, trainer T"
    over: int  # rows off by more than the tolerance
    auc: tuple[float, float] | None  # (served, trainer) when the file has labels
    # dense_precision bf16 / int8: dlrmkit.dense.contract's AUC ratio, max and p99 |dp| vs the trainer
    contract: dict | None = None


def read_verify_file(path: str | Path) -> list[dict]:
    """``--verify FILE``: JSON lines ``{"request": <a /predictions JSON body>, "scores": [...],
    "labels": [...]}`` (labels optional), one trainer score per row of the request."""
    lines = []
    for n, line in _json_lines(path, "--verify"):
        where = f"--verify {path}, line {n}"
        try:
            doc = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where}: not JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("request"), dict):
            raise ConfigError(f'{where}: expected {{"request": {{...}}, "scores": [...]}}, got keys '
                              f"{sorted(doc) if isinstance(doc, dict) else type(doc).__name__}")
        for key in ("scores", "labels"):
            value = doc.get(key)
            if key == "labels" and value is None:
                continue
            if not isinstance(value, list) or not value or not all(
                    isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
                raise ConfigError(f"{where}: {key!r}: expected a non-empty list of numbers, one per row")
        if doc.get("labels") is not None and len(doc["labels"]) != len(doc["scores"]):
            raise ConfigError(f"{where}: {len(doc['labels'])} labels for {len(doc['scores'])} scores")
        lines.append({"line": n, **doc})
    if not lines:
        raise ConfigError(f"--verify {path}: no requests in the file")
    if len({d.get("labels") is None for d in lines}) > 1:
        raise ConfigError(f"--verify {path}: some lines have labels and some do not; give them on every line or none")
    return lines


def verify_archive(mar: str | Path, path: str | Path, tolerance: float = 1e-5,
                   log: Callable[[str], None] = print, precision: str = "fp32",
                   logits: bool = False, auc_ratio: float = 0.999) -> Verified:
    """Score every request of ``path`` (``read_verify_file``) with the archive ``mar`` loaded as a
    TorchServe worker loads it, and compare each row with the trainer's score. The archive is
    unpacked and loaded in a child process whose ``sys.path`` starts with the archive's own files,
    by TorchServe's own model loader and service, in batches of the archive's ``batchSize``; a
    request the handler refuses is a ConfigError naming its line and the handler's answer."""
    lines = read_verify_file(path)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dlrm-verify-") as tmp:
        model_dir, requests, answers = Path(tmp) / "model", Path(tmp) / "requests.json", Path(tmp) / "answers.json"
        with zipfile.ZipFile(mar) as z:
            z.extractall(model_dir)
        requests.write_text(json.dumps([d["request"] for d in lines]))
        # The archive's own code first (its dlrmkit/ holds this module too); the repository's
        # metrics.yaml, which the archive does not carry, passed along.
        child = (f"import sys; sys.path[:0] = [{str(model_dir)!r}]; "
                 f"from dlrmkit import checkpoint as c; c._score_as_worker(*sys.argv[1:])")
        # The child's output is the worker's log; shown only when it fails.
        run = subprocess.run([sys.executable, "-c", child, str(model_dir), str(requests), str(answers),
                              str(ROOT / "metrics.yaml")],
                             cwd=model_dir, capture_output=True, text=True)
        if run.returncode != 0:
            raise ConfigError(f"--verify: the archive did not load or score as a worker "
                              f"(exit {run.returncode}):\n{run.stderr[-3000:]}")
        answers = json.loads(answers.read_text())
    deltas: list[tuple] = []  # (|d|, line, row, served, trainer)
    served_all: list[float] = []
    trainer_all: list[float] = []
    labels_all: list[int] = []
    for doc, (status, body) in zip(lines, answers):
        where = f"--verify {path}, line {doc['line']}"
        if status != 200:
            raise ConfigError(f"{where}: the archive answered {status}: {body}")
        served = json.loads(body)["scores"]
        if len(served) != len(doc["scores"]):
            raise ConfigError(f"{where}: the archive answered {len(served)} scores for {len(doc['scores'])} "
                              f"trainer scores (one per row of the request)")
        deltas += [(abs(s - t), doc["line"], r, s, t) for r, (s, t) in enumerate(zip(served, doc["scores"]))]
        served_all += served
        trainer_all += doc["scores"]
        labels_all += doc.get("labels") or []
    worst = max(deltas)
    aucs = (auc(served_all, labels_all), auc(trainer_all, labels_all)) if labels_all else None
    terms = None
    if precision != "fp32" and labels_all:
        from dlrmkit.dense import contract

        prob = (lambda v: torch.sigmoid(torch.tensor(v, dtype=torch.float64)).tolist()) if logits else list
        terms = contract(prob(served_all), prob(trainer_all), labels_all, auc_ratio)
    result = Verified(len(deltas), len(lines), worst[0],
                      f"line {worst[1]}, row {worst[2]}: served {worst[3]:.7g}, trainer {worst[4]:.7g}",
                      sum(d[0] > tolerance for d in deltas), aucs, terms)
    log(f"[verify] {result.rows} rows in {result.requests} requests of {path} scored by the archive as a worker "
        f"loads it in {time.perf_counter() - started:.1f} s: max |served - trainer| {result.max_delta:.3g} "
        f"(tolerance {tolerance:g}; {result.worst})"
        + (f"; AUC served {aucs[0]:.6f} vs trainer {aucs[1]:.6f}" if aucs else ""))
    if terms:
        log(f"[verify] dense_precision {precision}: AUC ratio {terms['auc_ratio']:.5f} (contract >= {auc_ratio:g}: "
            f"{'holds' if terms['holds'] else 'BROKEN'}), |dp| max {terms['max_dp']:.4g}, p99 {terms['p99_dp']:.4g}")
    return result


def calibration_inputs(path: str | Path, model: torch.nn.Module, config: DLRMConfig) -> dict[str, torch.Tensor]:
    """``--calibrate FILE``: the dense half's inputs for int8's static scales, from JSON lines that
    are /predictions bodies or ``{"request": body, ...}`` (a --verify file), parsed and collated as
    the handler does and looked up in ``model``'s tables (dlrmkit.dense.calibration_inputs)."""
    from dlrmkit import dense
    from dlrmkit.batch import collate
    from dlrmkit.errors import RequestError
    from dlrmkit.forms import RequestParser

    parser, batches = RequestParser(config), []
    for n, line in _json_lines(path, "--calibrate"):
        try:
            doc = json.loads(line)
            body = doc["request"] if isinstance(doc, dict) and isinstance(doc.get("request"), dict) else doc
            batch, bad = collate([parser.parse(body)], config)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--calibrate {path}, line {n}: not JSON ({e.msg} at column {e.colno})") from None
        except RequestError as e:
            raise ConfigError(f"--calibrate {path}, line {n}: {e.message}") from None
        if bad:
            raise ConfigError(f"--calibrate {path}, line {n}: {bad[0].message}")
        batches.append((batch.dense, batch.sparse))
    if not batches:
        raise ConfigError(f"--calibrate {path}: no requests in the file")
    return dense.calibration_inputs(model, batches)


def _json_lines(path: str | Path, option: str) -> list[tuple[int, str]]:
    """The non-blank lines of ``path`` with their 1-based numbers; a file that cannot be read is a
    ConfigError naming ``option``."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"{option} {path}: {e.strerror}") from None
    return [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]


def auc(scores, labels) -> float:
    """Exact ROC AUC: the chance that a random positive outscores a random negative (ties count
    half); torchmetrics, which torchrec already needs. scripts/train.py reports the same."""
    from torchmetrics.functional.classification import binary_auroc

    return float(binary_auroc(torch.as_tensor(scores, dtype=torch.float64), torch.as_tensor(labels).long()))


def _score_as_worker(model_dir: str, requests: str, answers: str, metrics_yaml: str) -> None:
    """In ``verify_archive``'s child: load ``model_dir`` with TorchServe's model loader, as
    ``ts.model_service_worker`` does, and answer each request of ``requests`` through the service's
    entry point with the context TorchServe builds, ``batchSize`` requests per call; writes
    ``[[status, body], ...]`` to ``answers``."""
    from ts.metrics.metric_cache_yaml_impl import MetricsCacheYamlImpl
    from ts.model_loader import ModelLoaderFactory
    from ts.service import Service
    from ts.utils.util import get_yaml_config

    manifest = json.loads((Path(model_dir) / "MAR-INF" / "MANIFEST.json").read_text())["model"]
    batch_size = int(get_yaml_config(str(Path(model_dir) / manifest["configFile"])).get("batchSize") or 1)
    metrics = MetricsCacheYamlImpl(config_file_path=metrics_yaml)
    metrics.initialize_cache()
    service = ModelLoaderFactory.get_model_loader().load(
        manifest["modelName"], model_dir, manifest["handler"], None, batch_size, None, True, metrics)
    bodies = json.loads(Path(requests).read_text())
    out = []
    for lo in range(0, len(bodies), batch_size):
        # The frontend's message, as the worker decodes it: an application/json body arrives parsed.
        batch = [{"requestId": f"verify-{lo + i}".encode(),
                  "parameters": [{"name": "body", "value": b, "contentType": "application/json"}]}
                 for i, b in enumerate(bodies[lo:lo + batch_size])]
        headers, inputs, ids = Service.retrieve_data_for_inference(batch)
        context = service.context
        context.request_ids, context.request_processor, context.metrics.request_ids = ids, headers, ids
        bodies_out = service._entry_point(inputs, context)
        for i, body in enumerate(bodies_out):
            body = body.decode() if isinstance(body, (bytes, bytearray)) else body
            out.append([context.get_response_status(i)[0], body])
    Path(answers).write_text(json.dumps(out))
