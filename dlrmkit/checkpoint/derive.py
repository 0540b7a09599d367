"""The model config a checkpoint implies (``scripts/build_mar.py --write-config``): read off its key
names and shapes, with what had to be assumed said in the written file. The feature order is never
assumed (``feature_order_of``).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Callable

import yaml

from dlrmkit.checkpoint.read import TABLES, Checkpoint, check_names, open_checkpoint, plan_import, say_ignored
from dlrmkit.config import DLRMConfig
from dlrmkit.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]  # the repository: the shipped model-config.yaml


def derive_config(ckpt: Checkpoint, feature_order: list[str] | None = None) -> tuple[dict, list[str], list[str]]:
    """The ``handler:`` section that fits ``ckpt``, read off its key names and shapes, plus what
    was derived and what had to be assumed (one line each). The feature order is never assumed
    (``feature_order_of``)."""
    tables = ckpt.tables
    if not tables:
        raise ConfigError(
            f"{ckpt.path}: no embedding tables ({TABLES}<table>.weight) in the checkpoint; "
            f"its keys: {', '.join(list(ckpt.shapes)[:5]) or 'none'}"
        )
    dims = {d for _, d in tables.values()}
    if len(dims) > 1:
        raise ConfigError(
            f"{ckpt.path}: the tables have different embedding dims {sorted(dims)}; a torchrec DLRM "
            f"needs one embedding_dim"
        )
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
        handler.update(
            interaction_branch1_layer_sizes=_mlp(ckpt, "inter_arch.interaction_branch1.model._mlp"),
            interaction_branch2_layer_sizes=_mlp(ckpt, "inter_arch.interaction_branch2.model._mlp"),
        )
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
        check_names(given, features, "--feature-order", "the checkpoint's features")
        differs = ckpt.records_order and list(given) != features
        return list(given), "given with --feature-order" + (
            f" (the checkpoint's table order is {', '.join(features)})" if differs else ""
        )
    if ckpt.records_order:
        return features, "the checkpoint's table order (a state_dict file keeps the trainer's EmbeddingBagConfig order)"
    if numbered(features):
        return features, (
            "one numbered sequence in natural order (a DCP directory keeps no order; "
            "torchrec's DLRM example numbers its tables)"
        )
    raise ConfigError(
        f"{ckpt.path}: a DCP directory does not record the trainer's table order, and its tables "
        f"({', '.join(features)}) are no numbered sequence (like cat_0 ... cat_25) to read it from. The "
        f"interaction reads the embeddings in that order, so any other order serves a plausible, wrong score for "
        f"every row. Name them in the order of the trainer's EmbeddingBagConfig list: --feature-order "
        f"{','.join(['NAME'] * min(len(features), 3))}{',...' if len(features) > 3 else ''}"
    )


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


def config_text(ckpt: Checkpoint, handler: dict, derived: list[str], assumed: list[str]) -> str:
    """A complete model-config.yaml: model-config.yaml's serving settings, timeouts by its rule."""
    c = DLRMConfig.from_dict(handler)
    weights_mb = sum(c.num_embeddings) * c.embedding_dim * 4 / 1e6
    shipped = yaml.safe_load((ROOT / "model-config.yaml").read_text())
    top = {k: shipped[k] for k in ("minWorkers", "maxWorkers", "batchSize", "maxBatchDelay") if k in shipped}
    top.update(
        startupTimeout=max(120, math.ceil(2 * (30 + weights_mb / 100))),
        responseTimeout=max(60, math.ceil(10 * (5 + weights_mb / 100))),
    )
    lines = [
        f"# Written by scripts/build_mar.py --write-config from {ckpt.path} ({ckpt.kind}).",
        *(f"# derived: {d}" for d in derived),
        *(f"# assumed: {a}" for a in assumed),
        "# Serving settings as in model-config.yaml (docs/performance.md); timeouts by its rule for",
        f"# W = {weights_mb:,.1f} MB of weights: startupTimeout >= max(120, 2 x (30 + W / 100)),",
        "# responseTimeout >= max(60, 10 x (5 + W / 100)).",
        yaml.safe_dump(top, sort_keys=False).rstrip(),
        yaml.safe_dump({"handler": handler}, sort_keys=False, default_flow_style=None, width=120).rstrip(),
    ]
    return "\n".join(lines) + "\n"


def write_config(
    path: str | Path, out: str | Path, log: Callable[[str], None] = print, feature_order: list[str] | None = None
) -> DLRMConfig:
    """``--write-config``: derive the config, check that the checkpoint fits it, write ``out``."""
    ckpt = open_checkpoint(path)
    say_ignored(ckpt, log)
    handler, derived, assumed = derive_config(ckpt, feature_order)
    config = DLRMConfig.from_dict(handler)
    plan_import(ckpt, config, feature_order)  # every key and shape fits, or the message says which does not
    Path(out).write_text(config_text(ckpt, handler, derived, assumed))
    for line in derived:
        log(f"[config] derived: {line}")
    for line in assumed:
        log(f"[config] assumed: {line}")
    log(
        f"[config] wrote {out}; build and prove it with: scripts/build_mar.py --config {out} --checkpoint {path} "
        f"--verify EVAL.jsonl --force (docs/trained-models.md)"
    )
    return config


def _shape(ckpt: Checkpoint, key: str) -> tuple[int, ...]:
    if key not in ckpt.shapes:
        raise ConfigError(
            f"{ckpt.path}: key {key!r} is missing: not a torchrec DLRM checkpoint "
            f"(keys: {', '.join(list(ckpt.shapes)[:5])}, ...)"
        )
    return ckpt.shapes[key][0]


def _mlp(ckpt: Checkpoint, prefix: str) -> list[int]:
    """Output sizes of torchrec's MLP layers ``<prefix>.<i>._linear.weight [out, in]``."""
    sizes: list[int] = []
    while f"{prefix}.{len(sizes)}._linear.weight" in ckpt.shapes:
        sizes.append(ckpt.shapes[f"{prefix}.{len(sizes)}._linear.weight"][0][0])
    if not sizes:
        _shape(ckpt, f"{prefix}.0._linear.weight")
    return sizes
