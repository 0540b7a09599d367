"""DLRMFactory: a torchrec DLRM from a ``DLRMConfig``: seeded random weights or archived weights.

TorchServe imports this file from the archive; it defines exactly one class, as TorchServe's
model loader requires.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torchrec.models.dlrm import DLRM
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dlrm_config import DLRMConfig
from dlrm_errors import ConfigError

_EBC_PREFIX = "sparse_arch.embedding_bag_collection.embedding_bags."


class DLRMFactory:
    """Builds the DLRM that a config describes.

    >>> model = DLRMFactory(DLRMConfig.from_yaml("model-config.yaml")).random(seed=0)
    >>> model(dense, kjt).shape  # raw logits, one per row
    torch.Size([B, 1])
    """

    def __init__(self, config: DLRMConfig):
        self.config = config

    def tables(self) -> list[EmbeddingBagConfig]:
        """One table per sparse feature, named after it: ``feature_0`` -> table ``feature_0``."""
        c = self.config
        pooling = PoolingType.SUM if c.pooling == "sum" else PoolingType.MEAN
        return [
            EmbeddingBagConfig(
                name=name,
                embedding_dim=c.embedding_dim,
                num_embeddings=rows,
                feature_names=[name],
                pooling=pooling,
            )
            for name, rows in zip(c.sparse_features, c.num_embeddings)
        ]

    def build(self, device: torch.device | str = "cpu", tables_on_meta: bool = False) -> DLRM:
        """The DLRM with torchrec's default init. ``tables_on_meta`` allocates no table memory.

        Only the embedding tables may live on ``meta``: a whole DLRM built there keeps its
        non-persistent ``triu_indices`` buffer on meta and silently returns garbage logits.
        """
        c = self.config
        ebc = EmbeddingBagCollection(
            tables=self.tables(), device=torch.device("meta" if tables_on_meta else device)
        )
        return DLRM(
            embedding_bag_collection=ebc,
            dense_in_features=c.num_dense_features,
            dense_arch_layer_sizes=list(c.dense_arch_layer_sizes),
            over_arch_layer_sizes=list(c.over_arch_layer_sizes),
            dense_device=torch.device(device),
        )

    def random(self, seed: int | None = None) -> DLRM:
        """Seeded random weights under which every input visibly moves the score.

        torchrec's default table init (about +-1/sqrt(rows)) leaves every score near 0.5 whatever
        the ids, which would hide a mis-packed batch. Tables are drawn from U(-1, 1) instead, and
        the last layer is rescaled so that logits on random inputs have mean 0 and std 1: far
        from the sigmoid's flat ends.
        """
        c = self.config
        gen = torch.Generator().manual_seed(c.seed if seed is None else seed)
        model = self.build("cpu")
        with torch.no_grad():
            # Redraw everything from our generator, so the seed alone fixes the weights.
            for mlp in (model.dense_arch, model.over_arch):
                for p in mlp.parameters():
                    bound = p.shape[1] ** -0.5 if p.dim() == 2 else 0.1  # weight: 1/sqrt(fan_in)
                    p.uniform_(-bound, bound, generator=gen)
            for table in model.sparse_arch.embedding_bag_collection.embedding_bags.values():
                table.weight.uniform_(-1.0, 1.0, generator=gen)
            dense, kjt = self.probe_batch(256, gen)
            logits = model(dense, kjt).squeeze(1)
            std, mean = logits.std().clamp_min(1e-6), logits.mean()
            last = model.over_arch.model[-1]
            last.weight.div_(std)
            last.bias.sub_(mean).div_(std)
        return model.eval()

    def probe_batch(self, batch: int, gen: torch.Generator) -> tuple[torch.Tensor, KeyedJaggedTensor]:
        """B random rows: N(0,1) dense, 0-3 random ids per feature (key-major lengths)."""
        c = self.config
        dense = torch.randn(batch, c.num_dense_features, generator=gen)
        lengths = torch.randint(0, 4, (c.num_features * batch,), generator=gen)
        rows = torch.tensor(c.num_embeddings).repeat_interleave(batch).repeat_interleave(lengths)
        values = (torch.rand(int(lengths.sum()), generator=gen) * rows).long()
        return dense, KeyedJaggedTensor(keys=list(c.sparse_features), values=values, lengths=lengths)

    def load(self, weights: str | Path, device: torch.device | str = "cpu") -> DLRM:
        """The DLRM with archived weights, on ``device``, in eval mode.

        Tables are built on ``meta`` and take the memory-mapped checkpoint tensors as they are
        (``assign=True``), so peak memory stays about one model: nothing is allocated twice, and
        on CPU the tables stay file-backed pages that workers of the same model share.
        """
        path = Path(weights)
        if not path.is_file():
            raise ConfigError(f"{path}: weights file not found (build the archive with scripts/build_mar.py)")
        try:
            state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except Exception as e:  # torch raises several types for a corrupt or foreign file
            raise ConfigError(f"{path}: not a torch state_dict file ({type(e).__name__}: {e})") from None
        model = self.build("cpu", tables_on_meta=True)
        self.check_state_dict(state, model)
        model.load_state_dict(state, assign=True)
        return model.to(torch.device(device)).eval()

    def check_state_dict(self, state: object, model: DLRM) -> None:
        """Raise ConfigError naming the first table or layer whose name or shape does not fit."""
        if not isinstance(state, dict):
            raise ConfigError(f"checkpoint: expected a state_dict (dict of tensors), got {type(state).__name__}")
        expected = model.state_dict()
        for key, want in expected.items():
            what = _describe(key)
            if key not in state:
                raise ConfigError(f"checkpoint: {what} is missing (key {key!r}); is it the same model config?")
            got = state[key]
            if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(want.shape):
                shape = list(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
                raise ConfigError(
                    f"checkpoint: {what} has shape {shape}, the config expects {list(want.shape)}"
                    + (" (num_embeddings x embedding_dim)" if key.startswith(_EBC_PREFIX) else "")
                )
        extra = sorted(set(state) - set(expected))
        if extra:
            raise ConfigError(
                f"checkpoint: {_describe(extra[0])} is not in the model config (key {extra[0]!r}); "
                f"add its feature to handler.sparse_features or drop it from the checkpoint"
            )


def _describe(key: str) -> str:
    if key.startswith(_EBC_PREFIX):
        return f"table {key[len(_EBC_PREFIX):].rsplit('.', 1)[0]!r}"
    return f"layer {key!r}"
