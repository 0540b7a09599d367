"""DLRMFactory: a torchrec DLRM from a ``DLRMConfig``: seeded random weights or archived weights.

The handler builds the served model with it; the build scripts, checkpoint import and live
updates use it to lay out the same model.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Mapping, cast

import torch
from torchrec.models.dlrm import DLRM, DLRM_DCN, DLRM_Projection, InteractionArch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dlrmkit.config import DLRMConfig
from dlrmkit.errors import ConfigError
from dlrmkit.hot import COLD, HOT, HotIndex
from dlrmkit.parts import flat_interaction, pooled_view
from dlrmkit.scale import (
    DTYPES,
    EBC,
    TABLES,
    adopt_tables,
    copy_tables,
    fused_rows,
    fused_tables,
    load_read_only,
    quant_ebc,
    shard,
)

logger = logging.getLogger(__name__)


class DLRMFactory:
    """Builds the DLRM that a config describes.

    >>> factory = DLRMFactory(DLRMConfig.from_yaml("model-config.yaml"))
    >>> model = factory.random(seed=0).eval()
    >>> dense, kjt = factory.probe_batch(4, torch.Generator().manual_seed(0))  # B = 4 rows
    >>> model(dense, kjt).shape  # raw logits, one per row
    torch.Size([4, 1])
    """

    def __init__(self, config: DLRMConfig):
        self.config = config

    def tables(self, dtype: str = "fp32", hot: Mapping[str, int] | None = None) -> list[EmbeddingBagConfig]:
        """One table per sparse feature, named after it: ``feature_0`` -> table ``feature_0``.

        ``dtype`` (an ``embedding_dtype``) sets torchrec's ``data_type``: the quantized EBC reads
        it; the fp32 EBC must get fp32 (it would build fp16 tables for anything else). ``hot``:
        table -> its hot rows' copies, kernel rows after the table's own (dlrmkit/hot.py).
        """
        c = self.config
        hot = hot or {}
        pooling = PoolingType.SUM if c.pooling == "sum" else PoolingType.MEAN
        return [
            EmbeddingBagConfig(
                name=name,
                embedding_dim=c.embedding_dim,
                num_embeddings=rows + hot.get(name, 0),
                feature_names=[name],
                pooling=pooling,
                data_type=DTYPES[dtype][0],
            )
            for name, rows in zip(c.sparse_features, c.num_embeddings)
        ]

    def build(self, device: torch.device | str = "cpu", tables_on_meta: bool = False) -> DLRM:
        """The DLRM of ``handler.interaction`` (torchrec's ``DLRM``, ``DLRM_DCN`` or
        ``DLRM_Projection``, all ``DLRM`` subclasses) with torchrec's default init.
        ``tables_on_meta`` allocates no table memory.

        Only the embedding tables may live on ``meta``: a whole DLRM built there keeps its
        non-persistent ``triu_indices`` buffer on meta and silently returns garbage logits.
        """
        c = self.config
        ebc = EmbeddingBagCollection(
            tables=self.tables("fp32"), device=torch.device("meta" if tables_on_meta else device)
        )
        common = dict(
            embedding_bag_collection=ebc,
            dense_in_features=c.num_dense_features,
            dense_arch_layer_sizes=list(c.dense_arch_layer_sizes),
            over_arch_layer_sizes=list(c.over_arch_layer_sizes),
            dense_device=torch.device(device),
        )
        if c.interaction == "dcn":
            model = DLRM_DCN(**common, dcn_num_layers=c.dcn_num_layers, dcn_low_rank_dim=c.dcn_low_rank_dim)
            # torchrec builds the cross network on the default device, whatever dense_device says
            model.inter_arch.to(device)
            return model
        if c.interaction == "projection":
            return DLRM_Projection(
                **common,
                interaction_branch1_layer_sizes=list(c.interaction_branch1_layer_sizes),
                interaction_branch2_layer_sizes=list(c.interaction_branch2_layer_sizes),
            )
        return DLRM(**common)

    def random(self, seed: int | None = None) -> DLRM:
        """Seeded random weights under which every input visibly moves the score.

        torchrec's default table init (about +-1/sqrt(rows)) leaves every score near 0.5 whatever
        the ids, which would hide a mis-packed batch. Tables are drawn from U(-1, 1) instead, and
        the last layer is rescaled so that logits on random inputs have mean 0 and std 1: far
        from the sigmoid's flat ends. Every dense parameter (bottom MLP, the interaction's cross
        network or projection branches, top MLP) is redrawn too, so the seed alone fixes them.
        """
        c = self.config
        gen = torch.Generator().manual_seed(c.build.seed if seed is None else seed)
        model = self.build("cpu")
        with torch.no_grad():
            for part in (model.dense_arch, model.inter_arch, model.over_arch):
                for p in part.parameters():
                    # Linear weights [out, in] and the cross network's W [in, rank] / V [rank, in]
                    # all multiply along dim 1: +-1/sqrt(fan_in) keeps each layer's scale.
                    bound = p.shape[1] ** -0.5 if p.dim() == 2 else 0.1
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

    def archive_state(self, model: DLRM) -> dict[str, torch.Tensor]:
        """What ``scripts/build_mar.py`` saves for a trained or random fp32 ``model``: the dense
        layers as they are and the tables as fbgemm's fused rows, the layout the serving kernel
        reads (uint8 ``[rows, row bytes]``, all views of one buffer): fp32 rows byte for byte,
        or for a quantized ``embedding_dtype`` torchrec's quantized rows (split scale/bias), so
        loading never sees fp32 tables."""
        state = model.state_dict()
        rows = fused_rows(
            {k[len(TABLES) : -len(".weight")]: v for k, v in state.items() if k.startswith(TABLES)},
            self.config.build.embedding_dtype,
        )
        tables = {f"{TABLES}{t}.weight": r for t, r in rows.items()}
        dense = {k: v for k, v in state.items() if not k.startswith(EBC)}
        # in the order the archives always had (the same file, so the same base_version)
        return {**dense, **tables} if self.config.build.embedding_dtype == "fp32" else {**tables, **dense}

    def load(self, weights: str | Path, device: torch.device | str | list = "cpu") -> torch.nn.Module:
        """The DLRM with archived weights, in eval mode; ``device`` may be a list of devices.

        Every ``embedding_dtype`` runs fbgemm's fused table-batched kernel (torchrec's quantized
        EBC; fp32 is one of its types): one call for all tables instead of one ``nn.EmbeddingBag``
        per table, ~3-4x faster on the Criteo layout (docs/performance.md). One device: the
        kernel's weight buffer is built untouched and takes the memory-mapped archive buffer as
        it is, so nothing is allocated twice and on CPU the tables stay file-backed pages that
        workers of the same model share. Several devices: the tables are sharded table-wise
        across them (``dlrmkit.scale.shard``), the dense part runs on the first.

        A packed model's weights (``scripts/build_big.py --hot-counts``) hold each table's hot rows'
        copies after its rows; the model's ``hot_index`` (``dlrmkit.hot.HotIndex``, None when the
        weights hold none) says where they lie.
        """
        devices = [torch.device(d) for d in (device if isinstance(device, (list, tuple)) else [device])]
        dtype, sharded = self.config.build.embedding_dtype, len(devices) > 1
        # a dict of tensors: check_state_dict proves it before anything is taken from it
        state = cast(dict[str, torch.Tensor], _read(weights))
        keys = list(state) if isinstance(state, dict) else []
        hot = {k[len(HOT) :]: state.pop(k) for k in keys if isinstance(k, str) and k.startswith(HOT)}
        cold = {k[len(COLD) :]: int(state.pop(k).sum()) for k in keys if isinstance(k, str) and k.startswith(COLD)}
        rows = dict(zip(self.config.sparse_features, self.config.num_embeddings))
        index = HotIndex(rows, hot, cold) if hot else None
        home = torch.device("cpu") if sharded else devices[0]
        model = self.build("cpu", tables_on_meta=True)
        # On CPU the kernels take the archive's buffer as theirs: no zero-filled copy first.
        kernel_rows = {t: len(h) for t, h in hot.items()}
        qebc = quant_ebc(self.tables(dtype, kernel_rows), home, lazy=home.type == "cpu")
        model.sparse_arch.embedding_bag_collection = qebc
        dense = {k: v for k, v in model.state_dict().items() if not k.startswith(EBC)}
        self.check_state_dict(state, model, {**dense, **fused_tables(qebc)})
        model.load_state_dict({k: v for k, v in state.items() if not k.startswith(EBC)}, strict=False, assign=True)
        for part in (model.dense_arch, model.inter_arch, model.over_arch):
            part.to(devices[0])
        if not adopt_tables(qebc, state):
            copy_tables(qebc, state)
        if not sharded:  # the pooled embeddings read as a view, not copied (dlrmkit/parts.py)
            pooled_view(model.sparse_arch)
        served = (shard(model, devices)[0] if sharded else model).eval()
        served.hot_index = index  # the packed tables' hot rows (dlrmkit/hot.py), None when unpacked
        return served

    def freeze_dense(self, model: DLRM) -> list[str]:
        """Swap the dense arch and the over arch for ``torch.jit.freeze``-d traces of themselves:
        the forward at batch 1-32 took ~8-10% less on CPU (docs/performance.md). Each is traced
        on a probe batch and kept only if its output there equals the eager module's bit for bit
        (else left eager). The dot interaction then picks its products with one index_select
        (``dlrmkit.parts.FlatDotInteraction``), kept only if the model's logits on the probe stay
        those of the model before this call. Returns the names of the parts swapped. A frozen part
        has no parameters left: call this on a model to serve, not one to save or shard."""
        c, n = self.config, 8
        dense = torch.randn(n, c.num_dense_features, generator=torch.Generator().manual_seed(0))
        # id 0 of every table: random ids would page in (and count in RSS) scattered table pages
        kjt = KeyedJaggedTensor(
            keys=list(c.sparse_features),
            values=torch.zeros(c.num_features * n, dtype=torch.int64),
            lengths=torch.ones(c.num_features * n, dtype=torch.int64),
        )
        device = next(model.over_arch.parameters()).device
        seen: dict[str, tuple] = {}

        def keep(name):
            def hook(module, args, out):
                seen[name] = (args, out)  # returns None: the output stays as it is

            return hook

        hooks = [getattr(model, name).register_forward_hook(keep(name)) for name in ("dense_arch", "over_arch")]
        try:
            with torch.no_grad():
                logits = model(dense.to(device), kjt.to(device))
        finally:
            for h in hooks:
                h.remove()
        frozen = []
        for name, (args, want) in seen.items():
            try:
                with torch.no_grad():
                    part = torch.jit.freeze(torch.jit.trace(getattr(model, name).eval(), args))
                    same = torch.equal(part(*args), want)
            except Exception as e:  # a part tracing cannot take: it stays eager
                logger.info("%s stays eager: %s", name, e)
                continue
            if same:
                setattr(model, name, part)
                frozen.append(name)
        inter = model.inter_arch
        if flat_interaction(inter):
            with torch.no_grad():
                if torch.equal(model(dense.to(device), kjt.to(device)), logits):
                    frozen.append("inter_arch")
                else:  # never seen: the same products picked in the same order
                    inter.__class__ = InteractionArch
        return frozen

    def load_fp32(self, state: dict[str, torch.Tensor]) -> DLRM:
        """A trained fp32 state_dict (``--checkpoint``, via dlrmkit.checkpoint), whatever
        ``embedding_dtype`` says, on CPU; its tensors become the model's (no copy)."""
        model = self.build("cpu", tables_on_meta=True)
        self.check_state_dict(state, model)
        model.load_state_dict(state, assign=True)
        return model.eval()

    def check_state_dict(self, state: object, model: torch.nn.Module, expected: dict | None = None) -> None:
        """Raise ConfigError naming the first table or layer whose name, shape or dtype does not
        fit ``expected`` (default: ``model``'s state_dict)."""
        if not isinstance(state, dict):
            raise ConfigError(f"checkpoint: expected a state_dict (dict of tensors), got {type(state).__name__}")
        if expected is None:
            expected = model.state_dict()
        for key, want in expected.items():
            what = _describe(key)
            if key not in state:
                raise ConfigError(f"checkpoint: {what} is missing (key {key!r}); is it the same model config?")
            got = state[key]
            if isinstance(got, torch.Tensor) and got.dtype != want.dtype:
                raise ConfigError(
                    f"checkpoint: {what} holds {str(got.dtype)[6:]} values, handler.embedding_dtype "
                    f"{self.config.build.embedding_dtype} stores {str(want.dtype)[6:]}; build the archive with this "
                    f"config (scripts/build_mar.py --checkpoint takes the fp32 state_dict)"
                )
            if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(want.shape):
                shape = list(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
                unit = "embedding_dim" if want.dtype == torch.float32 else "bytes per row"
                other_dtype = (
                    key.startswith(TABLES)
                    and isinstance(got, torch.Tensor)
                    and got.dim() == 2
                    and got.shape[0] == want.shape[0]
                )
                raise ConfigError(
                    f"checkpoint: {what} has shape {shape}, the config expects {list(want.shape)}"
                    + (f" (num_embeddings x {unit})" if key.startswith(TABLES) else "")
                    + (
                        f"; was the archive built for another handler.embedding_dtype than "
                        f"{self.config.build.embedding_dtype}?"
                        if other_dtype
                        else ""
                    )
                )
        extra = sorted(set(state) - set(expected))
        if extra:
            raise ConfigError(
                f"checkpoint: {_describe(extra[0])} is not in the model config (key {extra[0]!r}); "
                f"add its feature to handler.sparse_features or drop it from the checkpoint"
            )


def _read(weights: str | Path) -> object:
    """The archived state_dict, memory-mapped: tensors are file-backed until written."""
    path = Path(weights)
    if not path.is_file():
        raise ConfigError(f"{path}: weights file not found (build the archive with scripts/build_mar.py)")
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except RuntimeError as e:
        if "Cannot allocate memory" not in str(e):
            raise ConfigError(f"{path}: not a torch state_dict file ({type(e).__name__}: {e})") from None
        # larger than the commit limit allows for a copy-on-write mapping: map it read-only
        logger.info("%s: %.1f GiB, mapped read-only (tables larger than memory)", path, path.stat().st_size / 2**30)
        return load_read_only(path)
    except Exception as e:  # torch raises several types for a corrupt or foreign file
        raise ConfigError(f"{path}: not a torch state_dict file ({type(e).__name__}: {e})") from None


def _describe(key: str) -> str:
    if key.startswith(TABLES):
        return f"table {key[len(TABLES) :].rsplit('.', 1)[0]!r}"
    return f"layer {key!r}"
