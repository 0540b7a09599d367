"""Config validation, the factory's shapes and weights, checkpoint loading and its errors."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from conftest import ROOT, TINY, tiny_config
from dlrmkit.config import DLRMConfig
from dlrmkit.errors import ConfigError
from dlrmkit.model import DLRMFactory


@pytest.mark.parametrize(
    "change,message",
    [
        ({"embedding_dim": 0}, "handler.embedding_dim: expected a positive integer, got 0 (e.g. embedding_dim: 8)"),
        ({"embedding_dim": True}, "handler.embedding_dim: expected a positive integer, got True"),
        ({"num_embeddings": [20, 30]}, "handler.num_embeddings: expected one row count per sparse feature (3), got 2"),
        ({"num_embeddings": [20, -1, 5]}, "handler.num_embeddings[1]: expected a positive integer, got -1"),
        ({"sparse_features": []}, "handler.sparse_features: expected a non-empty list of ASCII names"),
        ({"sparse_features": ["a", "a", "b"]}, "handler.sparse_features: 'a' appears twice"),
        (
            {"dense_arch_layer_sizes": [16, 4]},
            "handler.dense_arch_layer_sizes: the last size must equal embedding_dim (8)",
        ),
        ({"over_arch_layer_sizes": [16, 2]}, "handler.over_arch_layer_sizes: expected at least two sizes ending in 1"),
        ({"over_arch_layer_sizes": [1]}, "handler.over_arch_layer_sizes: expected at least two sizes ending in 1"),
        ({"pooling": "max"}, "handler.pooling: expected one of sum, mean, got 'max'"),
        ({"output": "prob"}, "handler.output: expected one of probability, logit, got 'prob'"),
        ({"id_overflow": "wrap"}, "handler.id_overflow: expected one of error, modulo, got 'wrap'"),
        ({"max_ids_per_request": 0}, "handler.max_ids_per_request: expected a positive integer, got 0"),
        ({"embeding_dim": 8}, "handler.embeding_dim: unknown key; valid keys are"),
        ({"seed": "x"}, "handler.seed: expected an integer, got 'x'"),
    ],
)
def test_config_errors_name_the_key(change, message):
    with pytest.raises(ConfigError) as info:
        DLRMConfig.from_dict({**TINY, **change})
    assert str(info.value).startswith(message), str(info.value)


def test_config_missing_key_and_section():
    raw = dict(TINY)
    del raw["embedding_dim"]
    with pytest.raises(ConfigError, match="handler.embedding_dim: required key is missing"):
        DLRMConfig.from_dict(raw)
    with pytest.raises(ConfigError, match="expected a 'handler:' mapping"):
        DLRMConfig.from_dict(None)


def test_shipped_configs_are_valid():
    seed = DLRMConfig.from_yaml(ROOT / "model-config.yaml")
    assert seed.num_dense_features == 5
    assert seed.sparse_features == ("feature_0", "feature_1", "feature_2")
    assert min(seed.num_embeddings) >= 1000
    assert (
        seed.requests.id_overflow == "error"
        and seed.requests.max_instances_per_request <= 4096
        and seed.requests.max_ids_per_request <= 65536
    )
    criteo = DLRMConfig.from_yaml(ROOT / "model-config.criteo.yaml")
    from torchrec.datasets.criteo import DEFAULT_CAT_NAMES

    assert criteo.sparse_features == tuple(DEFAULT_CAT_NAMES)
    assert (criteo.num_dense_features, criteo.embedding_dim) == (13, 64)
    assert criteo.dense_arch_layer_sizes == (512, 256, 64)
    assert criteo.over_arch_layer_sizes == (512, 512, 256, 1)
    assert max(criteo.num_embeddings) <= 100_000


def test_factory_builds_the_configured_shapes(model, config):
    tables = model.sparse_arch.embedding_bag_collection.embedding_bags
    assert {name: tuple(t.weight.shape) for name, t in tables.items()} == {
        "feature_0": (20, 8),
        "feature_1": (30, 8),
        "feature_2": (40, 8),
    }
    linears = [m for m in model.dense_arch.modules() if isinstance(m, torch.nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(5, 16), (16, 8)]
    over = [m for m in model.over_arch.modules() if isinstance(m, torch.nn.Linear)]
    assert [m.out_features for m in over] == [16, 8, 1]


def test_random_weights_are_seeded_and_spread(config):
    a, b = DLRMFactory(config).random(), DLRMFactory(config).random()
    c = DLRMFactory(config).random(seed=4)
    for (k, va), vb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(va, vb), k
    assert not torch.equal(a.state_dict()["over_arch.model.1.weight"], c.state_dict()["over_arch.model.1.weight"])
    table = a.sparse_arch.embedding_bag_collection.embedding_bags["feature_0"].weight
    assert table.abs().max() > 0.9  # U(-1, 1), not torchrec's +-1/sqrt(rows)


def test_load_matches_the_archived_model(model, archived, config):
    loaded = DLRMFactory(config).load(archived)
    got = loaded.state_dict()
    for k, v in model.state_dict().items():
        assert torch.equal(got[k].view(v.dtype), v), k  # tables: the fused kernel's fp32 rows
    assert loaded.inter_arch.triu_indices.device.type == "cpu"  # not left on meta
    dense, kjt = DLRMFactory(config).probe_batch(16, torch.Generator().manual_seed(1))
    with torch.inference_mode():
        assert (model(dense, kjt) - loaded(dense, kjt)).abs().max() <= 1e-6


def test_load_errors_name_the_table(tmp_path, model, config):
    state = DLRMFactory(config).archive_state(model)  # as build_mar.py archives it: tables as fused rows
    bad_shape = dict(state)
    key = "sparse_arch.embedding_bag_collection.embedding_bags.feature_1.weight"
    row = state[key].shape[1]  # bytes per fused row
    bad_shape[key] = torch.zeros(31, row, dtype=torch.uint8)
    missing = {k: v for k, v in state.items() if "feature_2" not in k}
    extra = {**state, "sparse_arch.embedding_bag_collection.embedding_bags.feature_9.weight": torch.zeros(5, row)}
    cases = [
        (bad_shape, f"checkpoint: table 'feature_1' has shape [31, {row}], the config expects [30, {row}]"),
        (missing, "checkpoint: table 'feature_2' is missing"),
        (extra, "checkpoint: table 'feature_9' is not in the model config"),
        ([1, 2], "checkpoint: expected a state_dict"),
    ]
    for i, (obj, message) in enumerate(cases):
        path = tmp_path / f"ckpt{i}.pt"
        torch.save(obj, path)
        with pytest.raises(ConfigError) as info:
            DLRMFactory(config).load(path)
        assert str(info.value).startswith(message), str(info.value)
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match="not a torch state_dict file"):
        DLRMFactory(config).load(tmp_path / "junk.pt")
    with pytest.raises(ConfigError, match="weights file not found"):
        DLRMFactory(config).load(tmp_path / "nope.pt")


def test_mean_pooling_config_builds_and_differs(model):
    cfg = tiny_config(pooling="mean")
    mean_model = DLRMFactory(cfg).random()
    dense, kjt = DLRMFactory(cfg).probe_batch(8, torch.Generator().manual_seed(2))
    with torch.inference_mode():
        assert not torch.allclose(mean_model(dense, kjt), model(dense, kjt))


def test_repo_layout_has_the_user_files():
    for name in [
        "dlrm_handler.py",
        "dlrmkit/model.py",
        "model-config.yaml",
        "config.properties",
        "README.md",
        "pyproject.toml",
        "Makefile",
        ".ci/run",
    ]:
        assert (ROOT / name).is_file(), name
    assert Path(ROOT / "sample_requests").is_dir()


def test_freeze_dense_keeps_scores_identical(archived, config):
    """The handler serves jit.freeze-d dense and over arches: same scores at any batch size."""
    eager = DLRMFactory(config).load(archived)
    frozen = DLRMFactory(config).load(archived)
    assert DLRMFactory(config).freeze_dense(frozen) == ["dense_arch", "over_arch", "inter_arch"]
    assert isinstance(frozen.over_arch, torch.jit.ScriptModule)
    for n in (1, 5, 64):
        dense, kjt = DLRMFactory(config).probe_batch(n, torch.Generator().manual_seed(n))
        with torch.inference_mode():
            assert torch.equal(frozen(dense, kjt), eager(dense, kjt))


def test_the_served_parts_read_faster_and_score_bit_for_bit(archived, config, model):
    """The loaded model reads its pooled embeddings as a view and its dot interaction with one
    index_select (dlrmkit/parts.py): the same scores as torchrec's own parts, bit for bit, at
    batch sizes 1 to 700, empty bags included (probe_batch draws 0-3 ids a feature)."""
    from torchrec.models.dlrm import InteractionArch, SparseArch

    from dlrmkit.parts import FlatDotInteraction, PooledSparseArch

    served = DLRMFactory(config).load(archived)
    assert type(served.sparse_arch) is PooledSparseArch
    DLRMFactory(config).freeze_dense(served)
    assert type(served.inter_arch) is FlatDotInteraction
    assert not any("flat" in k for k in served.state_dict())  # nothing saved or loaded changes
    for n in (1, 2, 5, 64, 700):
        dense, kjt = DLRMFactory(config).probe_batch(n, torch.Generator().manual_seed(n))
        with torch.inference_mode():
            pooled = served.sparse_arch(kjt)
            assert torch.equal(pooled, SparseArch.forward(served.sparse_arch, kjt))  # torchrec's split + cat
            bottom = served.dense_arch(dense)
            mine = served.inter_arch(bottom, pooled)
            assert torch.equal(mine, InteractionArch.forward(served.inter_arch, bottom, pooled))
            assert torch.equal(served(dense, kjt), model(dense, kjt))  # the fp32 model as trained
    # tables whose keys come in another order than the model's: torchrec's split and concatenation
    other = copy.copy(served.sparse_arch)
    other._sparse_feature_names = served.sparse_arch._sparse_feature_names[::-1]
    dense, kjt = DLRMFactory(config).probe_batch(3, torch.Generator().manual_seed(3))
    with torch.inference_mode():
        by_key = served.sparse_arch.embedding_bag_collection(kjt).to_dict()
        want = torch.stack([by_key[f] for f in other._sparse_feature_names], dim=1)
        assert torch.equal(other(kjt), want) and not torch.equal(want, served.sparse_arch(kjt))
