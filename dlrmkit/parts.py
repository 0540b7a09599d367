"""Two of torchrec's DLRM parts read faster, bit for bit: the same numbers, fewer copies.

- ``PooledSparseArch``: torchrec's ``SparseArch`` splits the tables' output (a ``KeyedTensor``,
  ``[B, F * D]``, key by key) into one tensor per feature and concatenates them again before the
  reshape to ``[B, F, D]``: a copy of every pooled float. When the keys come in the model's
  feature order that concatenation is the tensor itself, so it is read as a view.
- ``FlatDotInteraction``: torchrec's dot ``InteractionArch`` picks the upper triangle of the
  ``[B, F + 1, F + 1]`` products with two index tensors (a general advanced-indexing kernel); here
  one ``index_select`` on the flattened ``[B, (F + 1)^2]`` products picks the same ones in the same
  order.

On the Criteo layout (26 tables, D=64) and one core these took ~1.5 ms of a 698-row forward's
~17.8 ms (the copy ~0.6, the gather ~1.0; docs/performance.md). Each is swapped in by class
(``__class__``): the module keeps its identity, children and state_dict keys, so every path that
names ``sparse_arch`` or ``inter_arch`` (table views, deltas, hot rows) sees the same object. Only
modules of exactly torchrec's class are swapped: DCN's and the projection's interactions are left
as they are (their sparse arch is torchrec's and is read as a view), and ``DLRMFactory.load``
leaves a sharded model's sparse arch alone.

>>> import torch
>>> from torchrec.models.dlrm import InteractionArch
>>> inter = InteractionArch(num_sparse_features=3)
>>> dense, pooled = torch.randn(5, 4), torch.randn(5, 3, 4)
>>> want = inter(dense, pooled)
>>> flat_interaction(inter), type(inter).__name__
(True, 'FlatDotInteraction')
>>> torch.equal(inter(dense, pooled), want)
True
"""

from __future__ import annotations

from typing import cast

import torch
from torchrec.models.dlrm import InteractionArch, SparseArch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


class PooledSparseArch(SparseArch):
    """torchrec's SparseArch whose ``[B, F, D]`` output is a view of the tables' output whenever
    its keys are the model's features in order (else torchrec's own split and concatenation)."""

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.embedding_bag_collection(features)
        if pooled.keys() == self._sparse_feature_names:
            return pooled.values().reshape(-1, self.F, self.D)
        by_key = pooled.to_dict()  # as torchrec does it
        return torch.cat([by_key[name] for name in self._sparse_feature_names], dim=1).reshape(-1, self.F, self.D)


class FlatDotInteraction(InteractionArch):
    """torchrec's dot interaction, its upper triangle picked by one ``index_select``."""

    flat: torch.Tensor  # positions of the upper triangle in the flattened [F + 1, F + 1] products

    def forward(self, dense_features: torch.Tensor, sparse_features: torch.Tensor) -> torch.Tensor:
        if self.F <= 0:
            return dense_features
        combined = torch.cat((dense_features.unsqueeze(1), sparse_features), dim=1)
        products = torch.bmm(combined, torch.transpose(combined, 1, 2))
        return torch.cat((dense_features, products.flatten(1).index_select(1, self.flat)), dim=1)


def pooled_view(sparse_arch: torch.nn.Module) -> bool:
    """``sparse_arch`` made a ``PooledSparseArch`` where it is torchrec's own; whether it was."""
    if type(sparse_arch) is not SparseArch:
        return False
    sparse_arch.__class__ = PooledSparseArch
    return True


def flat_interaction(inter_arch: torch.nn.Module) -> bool:
    """``inter_arch`` made a ``FlatDotInteraction`` where it is torchrec's dot interaction;
    whether it was."""
    if type(inter_arch) is not InteractionArch:
        return False
    rows, cols = cast(torch.Tensor, inter_arch.triu_indices)
    inter_arch.register_buffer("flat", rows * (cast(int, inter_arch.F) + 1) + cols, persistent=False)
    inter_arch.__class__ = FlatDotInteraction
    return True
