"""The model config: the ``handler:`` section of ``model-config.yaml``, validated in one place.

TorchServe reads the top-level keys of ``model-config.yaml`` (workers, batching, timeouts) and hands
the whole file to the handler as ``context.model_yaml_config``; this module owns ``handler:``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

from dlrmkit.errors import ConfigError

POOLINGS = ("sum", "mean")
OUTPUTS = ("probability", "logit")
ID_OVERFLOW = ("error", "modulo")
RAW_INPUTS = ("criteo_tsv",)  # handler.raw_input: request forms of untransformed features (dlrmkit.criteo)
EMBEDDING_DTYPES = ("fp32", "fp16", "int8", "int4")  # torchrec's inference quantization, all run on CPU
DENSE_PRECISIONS = ("fp32", "bf16", "int8")  # the dense half: fp32, or compiled bf16 / int8 (dlrmkit/dense.py)
# handler.dense_precision's values in a config a build reads: the above, or auto (scripts/build_mar.py
# --verify writes the fastest that keeps the accuracy contract into the archive's config; a worker
# never sees auto)
DENSE_PRECISION_CHOICES = (*DENSE_PRECISIONS, "auto")
# handler.interaction -> the keys only that variant takes (torchrec's DLRM, DLRM_DCN, DLRM_Projection)
INTERACTIONS = {
    "dot": (),
    "dcn": ("dcn_num_layers", "dcn_low_rank_dim"),
    "projection": ("interaction_branch1_layer_sizes", "interaction_branch2_layer_sizes"),
}
INT64_MAX = 2**63 - 1
# Keys the handler once took, and what to set instead: a config that still sets one is refused by name.
REMOVED = {
    "large_batch_rows": "use handler.split_rows (a large forward as parts at once, docs/model-config.md)",
}


@dataclass(frozen=True)
class Build:
    """What the archive is built with (scripts/build_mar.py), and the worker then holds."""

    seed: int = 0  # seeds the random weights the build script makes when no checkpoint is given
    # How the archive stores the tables and the worker holds them, all in fbgemm's fused
    # table-batched kernel: fp32, or quantized (fp16 2x, int8 ~3.2x, int4 ~5x smaller at D=64).
    embedding_dtype: str = "fp32"
    # How the dense half (bottom MLP, interaction, top MLP) runs on CPU (dlrmkit/dense.py): fp32 as
    # always, or bf16 / int8 compiled by Inductor under the accuracy contract build_mar --verify checks.
    dense_precision: str = "fp32"
    # Which checkpoint table serves which feature when the names are neither <feature> nor
    # t_<feature> (scripts/build_mar.py --checkpoint): (feature, table) pairs, from a list in
    # sparse_features order or a mapping feature -> table. The archive names tables after features.
    table_names: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Requests:
    """What a worker checks and answers per request."""

    output: str = "probability"  # sigmoid(logit), or the raw logit
    id_overflow: str = "error"  # an id >= rows: 400, or id % rows (the hashing trick)
    max_instances_per_request: int = 4096
    max_ids_per_request: int = 65536


@dataclass(frozen=True)
class RawInput:
    """The Criteo transform. criteo_tsv: a text/tab-separated-values request is Criteo log lines,
    transformed in the handler as torchrec's tsv_to_npys did for training (dlrmkit/criteo.py): dense
    ln(x + dense_shift), with dense_shift = 2 - (the training file's minimum dense value); ids by
    ``requests.id_overflow``. None, None: JSON requests only."""

    raw_input: str | None = None
    dense_shift: float | None = None


@dataclass(frozen=True)
class Threads:
    """How a worker spends its CPUs."""

    torch_threads: int = 0  # intra-op threads per worker; 0 = the worker's share of the cores
    # A forward of more than this many rows runs as parts of about this many rows, at once, on
    # threads of the worker (each part on torch_threads; at most one part per torch_threads CPUs
    # the process may use): the CPUs the worker alone would leave idle score its large query. 0 = never.
    split_rows: int = 0
    # glibc's malloc keeps a forward's freed buffers for the next forward instead of giving them
    # back to the kernel, which zeroes every page of them again (dlrmkit/malloc.py). false: glibc's own
    keep_freed_memory: bool = True


@dataclass(frozen=True)
class Live:
    """Live updates (dlrmkit/live/, docs/live-updates.md): a directory of deltas (a volume shared
    by the replicas) that every worker follows, polling every delta_poll_s seconds; None: off."""

    delta_dir: str | None = None
    delta_poll_s: float = 0.5


@dataclass(frozen=True)
class Hot:
    """Hot rows (dlrmkit/hot.py, docs/scale.md): ``hot_rows`` redirects lookups of a packed
    model's hot ids to their copies (false: every id read where it lies, as unpacked, to compare);
    ``count_ids_dir``: where each worker writes the ids it looks up (one forward in
    ``count_ids_every``) as a counts file for ``scripts/build_big.py --hot-counts``; None: off.
    ``prefetch``: before each forward, the pages its lookups read in tables of 256 MiB or more are
    asked of the disk at once (tables larger than memory), rather than faulted in one by one."""

    hot_rows: bool = True
    prefetch: bool = True
    count_ids_dir: str | None = None
    count_ids_every: int = 16


# DLRMConfig's group fields -> their classes. The YAML stays flat: each field of a group is a
# ``handler.<key>`` of its own name (handler.split_rows, not handler.threads), and from_dict
# distributes the keys into the groups.
GROUPS: dict[str, type] = {
    "build": Build,
    "requests": Requests,
    "raw": RawInput,
    "threads": Threads,
    "live": Live,
    "hot": Hot,
}


@dataclass(frozen=True)
class DLRMConfig:
    """A DLRM's layout (top-level), plus by concern: how it is built (``build``), what a worker
    checks per request (``requests``), the Criteo transform (``raw``), its threads (``threads``),
    live updates (``live``) and hot rows (``hot``).

    F sparse features, one embedding table each (``num_embeddings[f]`` rows of D floats);
    ``num_dense_features`` floats per row go through the dense arch, whose last size must be D.
    ``interaction`` picks how the F pooled embeddings and the dense arch's output meet: torchrec's
    ``DLRM`` (pairwise dot products), ``DLRM_DCN`` (a low-rank DCN-v2 cross network over the
    (F+1) x D concatenation) or ``DLRM_Projection`` (two MLP branches over it whose outputs,
    reshaped to [F1, D] and [D, F2], are multiplied).
    """

    num_dense_features: int
    sparse_features: tuple[str, ...]
    num_embeddings: tuple[int, ...]  # rows per table, in sparse_features order
    embedding_dim: int
    dense_arch_layer_sizes: tuple[int, ...]
    over_arch_layer_sizes: tuple[int, ...]
    pooling: str = "sum"
    interaction: str = "dot"  # dot | dcn | projection
    dcn_num_layers: int | None = None  # dcn only: cross layers
    dcn_low_rank_dim: int | None = None  # dcn only: rank of each layer's W V factorisation
    interaction_branch1_layer_sizes: tuple[int, ...] | None = None  # projection only; last = F1 x D
    interaction_branch2_layer_sizes: tuple[int, ...] | None = None  # projection only; last = F2 x D
    build: Build = field(default_factory=Build)
    requests: Requests = field(default_factory=Requests)
    raw: RawInput = field(default_factory=RawInput)
    threads: Threads = field(default_factory=Threads)
    live: Live = field(default_factory=Live)
    hot: Hot = field(default_factory=Hot)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | None) -> DLRMConfig:
        """Validate a ``handler:`` mapping; every message names the key and shows a valid value."""
        if not isinstance(raw, Mapping):
            raise ConfigError(
                "model-config.yaml: expected a 'handler:' mapping with the DLRM layout "
                "(e.g. handler: {num_dense_features: 5, sparse_features: [feature_0], ...})"
            )
        removed = next((key for key in raw if key in REMOVED), None)
        if removed is not None:
            raise ConfigError(f"handler.{removed}: removed; {REMOVED[removed]}")
        known = set(KEYS)
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(f"handler.{unknown[0]}: unknown key; valid keys are {', '.join(sorted(known))}")
        missing = [
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and f.name not in raw
        ]
        if missing:
            raise ConfigError(f"handler.{missing[0]}: required key is missing")

        names = raw["sparse_features"]
        if not isinstance(names, list) or not names or not all(isinstance(n, str) and n and n.isascii() for n in names):
            raise ConfigError(
                "handler.sparse_features: expected a non-empty list of ASCII names, "
                f"got {names!r} (e.g. sparse_features: [feature_0, feature_1])"
            )
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise ConfigError(f"handler.sparse_features: {dup!r} appears twice; names must be unique")

        rows = raw["num_embeddings"]
        if isinstance(rows, list):
            if len(rows) != len(names):
                raise ConfigError(
                    f"handler.num_embeddings: expected one row count per sparse feature "
                    f"({len(names)}), got {len(rows)} (or one integer for every table)"
                )
            rows_t = tuple(_positive_int(r, f"num_embeddings[{i}]", "1000") for i, r in enumerate(rows))
        else:
            rows_t = (_positive_int(rows, "num_embeddings", "1000"),) * len(names)

        dim = _positive_int(raw["embedding_dim"], "embedding_dim", "8")
        dense_sizes = _layer_sizes(raw["dense_arch_layer_sizes"], "dense_arch_layer_sizes", "[32, 8]")
        over_sizes = _layer_sizes(raw["over_arch_layer_sizes"], "over_arch_layer_sizes", "[32, 16, 1]")
        if dense_sizes[-1] != dim:
            raise ConfigError(
                f"handler.dense_arch_layer_sizes: the last size must equal embedding_dim ({dim}), "
                f"got {list(dense_sizes)} (e.g. [32, {dim}])"
            )
        if len(over_sizes) < 2 or over_sizes[-1] != 1:
            raise ConfigError(
                "handler.over_arch_layer_sizes: expected at least two sizes ending in 1 (one score "
                f"per row), got {list(over_sizes)} (e.g. [32, 16, 1])"
            )
        _choice(raw, "pooling", POOLINGS)
        num_dense = _positive_int(raw["num_dense_features"], "num_dense_features", "5")
        requests, build = _requests(raw), _build(raw, names, dim)
        variant = _interaction(raw, dim)
        return cls(
            num_dense_features=num_dense,
            sparse_features=tuple(names),
            num_embeddings=rows_t,
            embedding_dim=dim,
            dense_arch_layer_sizes=dense_sizes,
            over_arch_layer_sizes=over_sizes,
            pooling=raw.get("pooling", "sum"),
            interaction=raw.get("interaction", "dot"),
            **variant,
            build=build,
            requests=requests,
            threads=_threads(raw),
            raw=_raw_input(raw, len(names)),
            live=_live(raw),
            hot=_hot(raw),
        )

    @classmethod
    def from_yaml(cls, path: str | Path) -> DLRMConfig:
        """Read the ``handler:`` section of a model-config.yaml file."""
        path = Path(path)
        try:
            doc = yaml.safe_load(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: model config file not found") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
        return cls.from_dict((doc or {}).get("handler") if isinstance(doc, dict) else None)

    def to_dict(self) -> dict[str, Any]:
        """The flat ``handler:`` mapping this config is read from (``from_dict(c.to_dict()) == c``):
        lists for tuples, ``table_names`` as a mapping, keys left at None left out."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in GROUPS:
                out.update((g.name, getattr(value, g.name)) for g in dataclasses.fields(value))
            else:
                out[f.name] = value
        out["table_names"] = dict(self.build.table_names)
        return {key: _plain(value) for key, value in out.items() if value is not None and value != {}}

    def with_changes(self, **changes: Any) -> DLRMConfig:
        """This config with some flat ``handler:`` keys changed, validated again as from_dict does
        (``config.with_changes(split_rows=4, embedding_dtype="int8")``)."""
        return DLRMConfig.from_dict({**self.to_dict(), **{key: _plain(value) for key, value in changes.items()}})

    @property
    def num_features(self) -> int:
        """F, the number of sparse features (and embedding tables)."""
        return len(self.sparse_features)


# Every flat ``handler:`` key, in DLRMConfig's order: the layout's, then each group's.
KEYS = tuple(
    g.name
    for f in dataclasses.fields(DLRMConfig)
    for g in (dataclasses.fields(GROUPS[f.name]) if f.name in GROUPS else (f,))
)


def _plain(value: Any) -> Any:
    """A config value as YAML holds it: tuples as lists (table_names' pairs as a mapping)."""
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def _choice(raw: Mapping[str, Any], key: str, choices: tuple[str, ...]) -> None:
    if key in raw and raw[key] not in choices:
        raise ConfigError(f"handler.{key}: expected one of {', '.join(choices)}, got {raw[key]!r}")


def _requests(raw: Mapping[str, Any]) -> Requests:
    """``output``, ``id_overflow`` and the per-request limits."""
    _choice(raw, "output", OUTPUTS)
    _choice(raw, "id_overflow", ID_OVERFLOW)
    values: dict[str, Any] = {key: raw[key] for key in ("output", "id_overflow") if key in raw}
    for key, example in (("max_instances_per_request", "4096"), ("max_ids_per_request", "65536")):
        if key in raw:
            values[key] = _positive_int(raw[key], key, example)
    return Requests(**values)


def _build(raw: Mapping[str, Any], features: list[str], dim: int) -> Build:
    """``seed``, ``embedding_dtype``, ``dense_precision`` and ``table_names``."""
    _choice(raw, "embedding_dtype", EMBEDDING_DTYPES)
    _choice(raw, "dense_precision", DENSE_PRECISION_CHOICES)
    if raw.get("embedding_dtype") == "int4" and dim % 2:
        raise ConfigError(
            f"handler.embedding_dtype: int4 packs two values per byte and needs an even embedding_dim, "
            f"got {dim} (e.g. embedding_dtype: int8)"
        )
    if "seed" in raw and (not isinstance(raw["seed"], int) or isinstance(raw["seed"], bool)):
        raise ConfigError(f"handler.seed: expected an integer, got {raw['seed']!r} (e.g. seed: 0)")
    values: dict[str, Any] = {key: raw[key] for key in ("seed", "embedding_dtype", "dense_precision") if key in raw}
    if "table_names" in raw:
        values["table_names"] = _table_names(raw["table_names"], features)
    return Build(**values)


def _threads(raw: Mapping[str, Any]) -> Threads:
    """``torch_threads`` and ``split_rows``: 0 or a positive integer each; ``keep_freed_memory``: a bool."""
    for key, expected, example in (
        ("torch_threads", "0 (auto) or a positive integer", "0"),
        ("split_rows", "0 (never) or a positive number of rows", "350"),
    ):
        value = raw.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"handler.{key}: expected {expected}, got {value!r} (e.g. {key}: {example})")
    return Threads(
        torch_threads=raw.get("torch_threads", 0),
        split_rows=raw.get("split_rows", 0),
        keep_freed_memory=_flag(raw, "keep_freed_memory", True),
    )


def _flag(raw: Mapping[str, Any], key: str, default: bool) -> bool:
    """``handler.<key>``: true or false (``default`` when absent)."""
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"handler.{key}: expected true or false, got {value!r} (e.g. {key}: {str(default).lower()})")
    return value


def _live(raw: Mapping[str, Any]) -> Live:
    """``delta_dir`` (None: off) and ``delta_poll_s``."""
    if raw.get("delta_dir") is not None and (not isinstance(raw["delta_dir"], str) or not raw["delta_dir"]):
        raise ConfigError(
            f"handler.delta_dir: expected a directory path, got {raw['delta_dir']!r} (e.g. delta_dir: /deltas/dlrm)"
        )
    poll = raw.get("delta_poll_s", 0.5)
    if isinstance(poll, bool) or not isinstance(poll, (int, float)) or not 0.01 <= poll <= 3600:
        raise ConfigError(
            f"handler.delta_poll_s: expected seconds between 0.01 and 3600, got {poll!r} (e.g. delta_poll_s: 0.5)"
        )
    return Live(delta_dir=raw.get("delta_dir"), delta_poll_s=poll)


def _hot(raw: Mapping[str, Any]) -> Hot:
    """``hot_rows``, ``prefetch`` (bools), ``count_ids_dir`` (None: off) and ``count_ids_every`` (>= 1)."""
    hot_rows, prefetch = _flag(raw, "hot_rows", True), _flag(raw, "prefetch", True)
    where = raw.get("count_ids_dir")
    if where is not None and (not isinstance(where, str) or not where):
        raise ConfigError(
            f"handler.count_ids_dir: expected a directory path, got {where!r} (e.g. count_ids_dir: /counts)"
        )
    every = raw.get("count_ids_every", 16)
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ConfigError(
            f"handler.count_ids_every: expected a positive integer (one forward in N counted), got {every!r} "
            "(e.g. count_ids_every: 16)"
        )
    return Hot(
        hot_rows=hot_rows,
        prefetch=prefetch,
        count_ids_dir=where,
        count_ids_every=every,
    )


def _interaction(raw: Mapping[str, Any], dim: int) -> dict[str, Any]:
    """The interaction variant and its own keys: all of them present, and no other variant's."""
    kind = raw.get("interaction", "dot")
    if not isinstance(kind, str) or kind not in INTERACTIONS:
        raise ConfigError(
            f"handler.interaction: expected one of {', '.join(INTERACTIONS)}, got {kind!r} (e.g. interaction: dcn)"
        )
    own = INTERACTIONS[kind]
    for other, keys in INTERACTIONS.items():
        for key in keys:
            if key in raw and key not in own:
                raise ConfigError(
                    f"handler.{key}: only used with interaction: {other}, got interaction: {kind} "
                    f"(drop it, or set interaction: {other})"
                )
    # torchrec's example defaults (dcn 3 / 512, MLPerf DLRMv2's too); branch sizes fitted to D
    examples = {
        "dcn_num_layers": "3",
        "dcn_low_rank_dim": "512",
        **dict.fromkeys(INTERACTIONS["projection"], f"[{4 * dim}, {2 * dim}]"),
    }
    for key in own:
        if key not in raw:
            raise ConfigError(f"handler.{key}: required with interaction: {kind} (e.g. {key}: {examples[key]})")
    out: dict[str, Any] = {}
    for key in own:
        if key.endswith("_layer_sizes"):
            sizes = _layer_sizes(raw[key], key, examples[key])
            if sizes[-1] % dim:
                raise ConfigError(
                    f"handler.{key}: the last size must be a multiple of embedding_dim ({dim}), got "
                    f"{list(sizes)} (e.g. [{4 * dim}, {2 * dim}])"
                )
            out[key] = sizes
        else:
            out[key] = _positive_int(raw[key], key, examples[key])
    return out


def _raw_input(raw: Mapping[str, Any], num_sparse: int) -> RawInput:
    """``raw_input`` and its ``dense_shift``: both or neither, fitting a Criteo line's layout."""
    kind, shift = raw.get("raw_input"), raw.get("dense_shift")
    fit = "scripts/build_mar.py --fit-dense-shift day_0.tsv --write-config model-config.yaml"
    if kind is None:
        if shift is not None:
            raise ConfigError(
                "handler.dense_shift: only used with raw_input: criteo_tsv (drop it, or set raw_input: criteo_tsv)"
            )
        return RawInput()
    if kind not in RAW_INPUTS:
        raise ConfigError(
            f"handler.raw_input: expected one of {', '.join(RAW_INPUTS)}, got {kind!r} (e.g. raw_input: criteo_tsv)"
        )
    if raw["num_dense_features"] != 13 or num_sparse != 26:
        raise ConfigError(
            f"handler.raw_input: criteo_tsv needs a Criteo line's layout, num_dense_features: 13 "
            f"and 26 sparse_features, got {raw['num_dense_features']!r} and {num_sparse}"
        )
    if shift is None:
        raise ConfigError(
            f"handler.dense_shift: required with raw_input: criteo_tsv (2 - the training data's "
            f"minimum dense value, e.g. dense_shift: 3; fit it with {fit})"
        )
    if isinstance(shift, bool) or not isinstance(shift, (int, float)) or not abs(shift) < 2**31:
        raise ConfigError(
            f"handler.dense_shift: expected a finite number, got {shift!r} (e.g. dense_shift: 3; fit it with {fit})"
        )
    return RawInput(raw_input=kind, dense_shift=shift)


def _positive_int(value: Any, key: str, example: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= INT64_MAX:
        raise ConfigError(
            f"handler.{key}: expected a positive integer, got {value!r} (e.g. {key.split('[')[0]}: {example})"
        )
    return value


def _layer_sizes(value: Any, key: str, example: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not value:
        raise ConfigError(f"handler.{key}: expected a list of layer sizes, got {value!r} (e.g. {key}: {example})")
    return tuple(_positive_int(v, f"{key}[{i}]", example) for i, v in enumerate(value))


def _table_names(value: Any, features: list[str]) -> tuple[tuple[str, str], ...]:
    """``handler.table_names`` as (feature, table) pairs: a list in sparse_features order, or a
    mapping feature -> table (features left out keep the default lookup)."""
    example = f"(e.g. table_names: {{{features[0]}: t_{features[0]}}})"
    if isinstance(value, list):
        if len(value) != len(features):
            raise ConfigError(
                f"handler.table_names: expected one table name per sparse feature ({len(features)}), "
                f"got {len(value)} {example}"
            )
        pairs = list(zip(features, value))
    elif isinstance(value, Mapping) and value:
        stray = next((f for f in value if f not in features), None)
        if stray is not None:
            raise ConfigError(
                f"handler.table_names: {stray!r} is not in handler.sparse_features "
                f"(valid: {', '.join(features)}) {example}"
            )
        pairs = [(f, value[f]) for f in features if f in value]
    else:
        raise ConfigError(
            "handler.table_names: expected a list of table names in sparse_features order or a mapping "
            f"feature -> table name, got {value!r} {example}"
        )
    for feature, table in pairs:
        if not isinstance(table, str) or not table:
            raise ConfigError(
                f"handler.table_names: feature {feature!r}: expected a non-empty table name, got {table!r} {example}"
            )
    tables = [t for _, t in pairs]
    dup = next((t for t in tables if tables.count(t) > 1), None)
    if dup is not None:
        raise ConfigError(
            f"handler.table_names: table {dup!r} is named for two features; each feature has its own table"
        )
    return tuple(pairs)
