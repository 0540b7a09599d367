"""What a delta may touch: a served model's ``Target`` (its tables and dense shapes) and the check
of a delta against it; ``changes``, what a delta between two state_dicts carries.

    >>> import tempfile
    >>> from dlrmkit.live.format import read_delta, write_delta
    >>> config = DLRMConfig.from_yaml("model-config.yaml")  # 3 tables of 1,000 rows, D = 16
    >>> target = target_for(config, DLRMFactory(config), "dlrm", "0123456789abcdef")
    >>> rows = {"feature_0": (torch.tensor([999, 1000]), torch.zeros(2, 16))}
    >>> path = write_delta(tempfile.mkdtemp(), "dlrm", "0123456789abcdef", 1, rows)
    >>> target.check(read_delta(path), 1)
    Traceback (most recent call last):
    dlrmkit.errors.DeltaError: feature_0.ids: id 1000 is out of range [0, 1000)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import torch

from dlrmkit.config import DLRMConfig
from dlrmkit.errors import DeltaError
from dlrmkit.live.format import Delta
from dlrmkit.model import DLRMFactory
from dlrmkit.scale import EBC, TABLES


@dataclass
class Target:
    """What a served model accepts: its name, base, tables (name -> (rows, D)) and dense parameter
    shapes (key -> shape)."""

    model: str
    base: str
    tables: dict[str, tuple[int, int]]
    dense: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def check(self, d: Delta, sequence: int) -> None:
        """Raise DeltaError naming the first thing in ``d`` that does not fit, else return."""
        if d.model != self.model:
            raise DeltaError("model", f"made for model {d.model!r}, this is {self.model!r}")
        if d.base != self.base:
            raise DeltaError(
                "base",
                f"made for base {d.base!r}, this archive is {self.base!r} (a delta stream belongs to one archive)",
            )
        if d.sequence != sequence:
            raise DeltaError("sequence", f"its metadata says sequence {d.sequence}, its file name {sequence}")
        for name, (ids, rows) in d.tables.items():
            self._check_table(name, ids, rows)
        if d.dense:
            self._check_dense(d.dense)

    def _check_table(self, name: str, ids: torch.Tensor, rows: torch.Tensor) -> None:
        if name not in self.tables:
            raise DeltaError("table", f"table {name!r} is not in the model (tables: {', '.join(self.tables)})")
        n, dim = self.tables[name]
        if ids.dtype != torch.int64 or ids.dim() != 1:
            raise DeltaError("dtype", f"{name}.ids: expected int64 [n], got {str(ids.dtype)[6:]} {list(ids.shape)}")
        if rows.dtype != torch.float32:
            raise DeltaError("dtype", f"{name}.rows: expected float32, got {str(rows.dtype)[6:]}")
        if tuple(rows.shape) != (len(ids), dim):
            raise DeltaError(
                "shape", f"{name}.rows: expected [{len(ids)}, {dim}] (ids x embedding_dim), got {list(rows.shape)}"
            )
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= n):
            bad = int(ids[(ids < 0) | (ids >= n)][0])
            raise DeltaError("range", f"{name}.ids: id {bad} is out of range [0, {n})")
        if len(torch.unique(ids)) != len(ids):
            raise DeltaError("duplicate", f"{name}.ids: an id appears twice (which row would win?)")
        if not bool(torch.isfinite(rows).all()):
            raise DeltaError("nonfinite", f"{name}.rows: NaN or Inf values")

    def _check_dense(self, dense: Mapping[str, torch.Tensor]) -> None:
        if set(dense) != set(self.dense):
            odd = sorted(set(dense) ^ set(self.dense))
            raise DeltaError(
                "dense", f"dense parameters must be complete and the model's own; {len(odd)} differ, e.g. {odd[0]!r}"
            )
        for key, value in dense.items():
            if tuple(value.shape) != self.dense[key]:
                raise DeltaError("shape", f"dense {key}: expected {list(self.dense[key])}, got {list(value.shape)}")
            if not bool(torch.isfinite(value).all()):
                raise DeltaError("nonfinite", f"dense {key}: NaN or Inf values")


def target_for(config: DLRMConfig, factory: DLRMFactory, name: str, base: str) -> Target:
    """The Target of model ``name`` (archive ``base``) served from ``config``."""
    tables = dict(zip(config.sparse_features, zip(config.num_embeddings, [config.embedding_dim] * config.num_features)))
    skeleton = factory.build("cpu", tables_on_meta=True).state_dict()
    return Target(name, base, tables, {k: tuple(v.shape) for k, v in skeleton.items() if not k.startswith(EBC)})


def changes(
    old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]
) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, torch.Tensor] | None]:
    """What a delta from serving state_dict ``old`` to ``new`` (fp32, as dlrmkit.checkpoint imports
    them) carries: per table the rows that differ, and every dense parameter if any of them differs."""
    tables = {}
    for key, w in new.items():
        if key.startswith(TABLES):
            ids = torch.nonzero((w != old[key]).any(dim=1)).reshape(-1)
            if len(ids):
                tables[key[len(TABLES) : -len(".weight")]] = (ids, w[ids])
    dense = {k: v for k, v in new.items() if not k.startswith(EBC)}
    moved = any(not torch.equal(v, old[k]) for k, v in dense.items())
    return tables, dense if moved else None
