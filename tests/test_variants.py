"""Model variants (handler.interaction: dot | dcn | projection): config validation, what the
factory builds, seeded weights, and every serving path per variant: fp32 and quantized
archives, zero-copy tables, table-wise sharding on CPU "devices", the handler's batches."""

from __future__ import annotations

import copy
import json
import random

import pytest
import torch
from torchrec.models.dlrm import DLRM, DLRM_DCN, DLRM_Projection

from conftest import ROOT, TINY, FakeContext, call, tiny_config, variant
from dlrmkit.config import INTERACTIONS, DLRMConfig
from dlrmkit.errors import ConfigError
from dlrmkit.model import DLRMFactory
from dlrmkit.scale import EBC, quantize, sharded_placement
from helpers import archive, batch, body, forward, instance, mapped_file

VARIANTS = list(INTERACTIONS)
QUANTIZED = ["fp16", "int8", "int4"]
# max |logit - fp32 logit| (logits of std 1): int4 has 16 levels over each table row's range
LOGIT_TOL = {"fp16": 0.01, "int8": 0.05, "int4": 1.0}
DCN, PROJECTION = variant("dcn"), variant("projection")


def cfg(interaction: str, **changes) -> DLRMConfig:
    return tiny_config(**{**variant(interaction), **changes})


@pytest.fixture(scope="module")
def models():
    return {v: DLRMFactory(cfg(v)).random() for v in VARIANTS}


# --- config -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change,message",
    [
        (
            {"interaction": "dnc"},
            "handler.interaction: expected one of dot, dcn, projection, got 'dnc' (e.g. interaction: dcn)",
        ),
        (
            {"interaction": ["dcn"]},
            "handler.interaction: expected one of dot, dcn, projection, got ['dcn'] (e.g. interaction: dcn)",
        ),
        (
            {"interaction": "dcn", "dcn_num_layers": 3},
            "handler.dcn_low_rank_dim: required with interaction: dcn (e.g. dcn_low_rank_dim: 512)",
        ),
        ({"interaction": "dcn"}, "handler.dcn_num_layers: required with interaction: dcn (e.g. dcn_num_layers: 3)"),
        (
            {"interaction": "projection", "interaction_branch1_layer_sizes": [16]},
            "handler.interaction_branch2_layer_sizes: required with interaction: projection "
            "(e.g. interaction_branch2_layer_sizes: [32, 16])",
        ),
        (
            {"dcn_num_layers": 3},
            "handler.dcn_num_layers: only used with interaction: dcn, got interaction: dot "
            "(drop it, or set interaction: dcn)",
        ),
        (
            {**DCN, "interaction_branch1_layer_sizes": [16]},
            "handler.interaction_branch1_layer_sizes: only used with interaction: projection, got interaction: dcn "
            "(drop it, or set interaction: projection)",
        ),
        (
            {**PROJECTION, "dcn_low_rank_dim": 4},
            "handler.dcn_low_rank_dim: only used with interaction: dcn, got interaction: projection "
            "(drop it, or set interaction: dcn)",
        ),
        (
            {**DCN, "dcn_num_layers": 0},
            "handler.dcn_num_layers: expected a positive integer, got 0 (e.g. dcn_num_layers: 3)",
        ),
        (
            {**DCN, "dcn_low_rank_dim": "512"},
            "handler.dcn_low_rank_dim: expected a positive integer, got '512' (e.g. dcn_low_rank_dim: 512)",
        ),
        (
            {**PROJECTION, "interaction_branch1_layer_sizes": [16, 12]},
            "handler.interaction_branch1_layer_sizes: the last size must be a multiple of embedding_dim (8), "
            "got [16, 12] (e.g. [32, 16])",
        ),
        (
            {**PROJECTION, "interaction_branch2_layer_sizes": []},
            "handler.interaction_branch2_layer_sizes: expected a list of layer sizes, got [] "
            "(e.g. interaction_branch2_layer_sizes: [32, 16])",
        ),
        (
            {**PROJECTION, "interaction_branch2_layer_sizes": [16, -8]},
            "handler.interaction_branch2_layer_sizes[1]: expected a positive integer, got -8 "
            "(e.g. interaction_branch2_layer_sizes: [32, 16])",
        ),
    ],
)
def test_variant_config_errors_name_the_key_and_a_valid_value(change, message):
    with pytest.raises(ConfigError) as info:
        DLRMConfig.from_dict({**TINY, **change})
    assert str(info.value) == message


def test_variant_config_defaults_and_values():
    dot = tiny_config()
    assert (dot.interaction, dot.dcn_num_layers, dot.interaction_branch1_layer_sizes) == ("dot", None, None)
    assert (cfg("dcn").dcn_num_layers, cfg("dcn").dcn_low_rank_dim) == (2, 4)
    assert cfg("projection").interaction_branch1_layer_sizes == (16, 16)
    assert cfg("projection").interaction_branch2_layer_sizes == (24,)


def test_dlrmv2_config_is_mlperf_layout():
    c = DLRMConfig.from_yaml(ROOT / "model-config.dlrmv2.yaml")
    assert (c.interaction, c.dcn_num_layers, c.dcn_low_rank_dim, c.embedding_dim) == ("dcn", 3, 512, 128)
    assert c.sparse_features == tuple(f"cat_{i}" for i in range(26)) and c.num_dense_features == 13
    assert (c.dense_arch_layer_sizes, c.over_arch_layer_sizes) == ((512, 256, 128), (1024, 1024, 512, 256, 1))
    assert c.requests.id_overflow == "modulo" and max(c.num_embeddings) <= 200_000
    sample = json.loads((ROOT / "sample_requests" / "dlrmv2.json").read_text())
    assert sample["sparse"]["keys"] == list(c.sparse_features)
    assert sample["sparse"]["lengths"] == [
        3,
        2,
        1,
        2,
        6,
        1,
        1,
        1,
        1,
        7,
        3,
        8,
        1,
        6,
        9,
        5,
        1,
        1,
        1,
        12,
        100,
        27,
        10,
        3,
        1,
        1,
    ]  # MLPerf DLRMv2's multi-hot bag sizes


# --- what the factory builds ------------------------------------------------------------------


def linears(module):
    return [(m.in_features, m.out_features) for m in module.modules() if isinstance(m, torch.nn.Linear)]


def test_build_makes_each_variant_with_its_shapes():
    F, D = 3, 8
    dot = DLRMFactory(cfg("dot")).build()
    assert type(dot) is DLRM and linears(dot.over_arch)[0] == (D + F * (F + 1) // 2, 16)
    dcn = DLRMFactory(cfg("dcn")).build()
    assert type(dcn) is DLRM_DCN
    cross = dcn.inter_arch.crossnet
    assert [tuple(w.shape) for w in cross.W_kernels] == [((F + 1) * D, 4)] * 2
    assert [tuple(v.shape) for v in cross.V_kernels] == [(4, (F + 1) * D)] * 2
    assert linears(dcn.over_arch)[0] == ((F + 1) * D, 16)
    proj = DLRMFactory(cfg("projection")).build()
    assert type(proj) is DLRM_Projection
    assert linears(proj.inter_arch.interaction_branch1) == [((F + 1) * D, 16), (16, 16)]
    assert linears(proj.inter_arch.interaction_branch2) == [((F + 1) * D, 24)]
    assert linears(proj.over_arch)[0] == (D + 2 * 3, 16)  # D + F1 x F2


@pytest.mark.parametrize("interaction", VARIANTS)
def test_only_tables_on_meta_and_dense_parts_on_the_device(interaction):
    model = DLRMFactory(cfg(interaction)).build("cpu", tables_on_meta=True)
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        assert t.device.type == ("meta" if name.startswith(EBC) else "cpu"), name
    # torchrec builds DLRM_DCN's cross network on the default device whatever dense_device
    # says; the factory moves it (on a GPU it would otherwise stay on the CPU)
    on_meta = DLRMFactory(cfg(interaction)).build("meta")
    assert {t.device.type for t in on_meta.parameters()} == {"meta"}


# --- seeded weights ---------------------------------------------------------------------------


@pytest.mark.parametrize("interaction", VARIANTS)
def test_random_weights_come_from_the_seed_alone(interaction):
    """torchrec's own init draws from the global RNG: a parameter it left would differ here."""
    torch.manual_seed(0)
    a = DLRMFactory(cfg(interaction)).random()
    torch.manual_seed(1)
    b = DLRMFactory(cfg(interaction)).random()
    c = DLRMFactory(cfg(interaction)).random(seed=4)
    for (k, va), vb, vc in zip(a.state_dict().items(), b.state_dict().values(), c.state_dict().values()):
        assert torch.equal(va, vb), k
        if va.is_floating_point():
            assert not torch.equal(va, vc), k
    if interaction == "dcn":  # torchrec initialises the cross biases to 0
        assert all(bias.abs().min() > 0 for bias in a.inter_arch.crossnet.bias)


@pytest.mark.parametrize("interaction", VARIANTS)
def test_every_input_moves_the_score(models, interaction):
    model = models[interaction]
    dense, kjt = batch(256, seed=5)
    logits = forward(model, dense, kjt).squeeze(1)
    assert 0.5 < logits.std() < 2 and logits.mean().abs() < 0.5  # rescaled: far from the flat ends
    f = DLRMFactory(cfg(interaction))
    base = forward(model, *f.probe_batch(1, torch.Generator().manual_seed(0)))
    dense1, kjt1 = f.probe_batch(1, torch.Generator().manual_seed(0))
    assert not torch.equal(forward(model, dense1 + 0.5, kjt1), base)
    for i, name in enumerate(tiny_config().sparse_features):
        lengths = torch.zeros(3, dtype=torch.long)
        lengths[i] = 1
        scores = {
            float(forward(model, dense1, type(kjt1)(keys=kjt1.keys(), values=torch.tensor([row]), lengths=lengths)))
            for row in range(5)
        }
        assert len(scores) == 5, (name, scores)  # each of 5 rows of this table scores differently


# --- archives: fp32, quantized, zero-copy, sharded --------------------------------------------


@pytest.mark.parametrize("interaction", VARIANTS)
def test_fp32_archive_round_trip_scores_as_in_process(tmp_path, models, interaction):
    model = models[interaction]
    path = tmp_path / "dlrm.pt"
    factory = DLRMFactory(cfg(interaction))
    torch.save(factory.archive_state(copy.deepcopy(model)), path)  # what build_mar.py archives
    loaded = factory.load(path)
    assert type(loaded) is type(model)
    got = loaded.state_dict()
    for k, v in model.state_dict().items():
        if not k.startswith("sparse_arch."):  # the tables live in the fused kernel's rows
            assert torch.equal(v, got[k]), k
    dense, kjt = batch()
    assert torch.allclose(forward(loaded, dense, kjt), forward(model, dense, kjt), atol=1e-6, rtol=0)


def test_archive_of_another_variant_names_the_first_layer_that_does_not_fit(tmp_path, models):
    path = tmp_path / "dot.pt"
    torch.save(models["dot"].state_dict(), path)
    with pytest.raises(ConfigError) as info:
        DLRMFactory(cfg("dcn")).load(path)
    assert str(info.value).startswith("checkpoint: layer 'inter_arch.crossnet.W_kernels.0' is missing"), info.value
    torch.save(models["projection"].state_dict(), path)
    with pytest.raises(ConfigError) as info:
        DLRMFactory(cfg("projection", interaction_branch2_layer_sizes=[16])).load(path)
    assert str(info.value).startswith(
        "checkpoint: layer 'inter_arch.interaction_branch2.model._mlp.0._linear.weight' has shape [24, 32], "
        "the config expects [16, 32]"
    ), info.value


@pytest.mark.parametrize("interaction", VARIANTS)
@pytest.mark.parametrize("dtype", QUANTIZED)
def test_quantized_archive_is_torchrec_quantization_and_zero_copy(tmp_path, models, interaction, dtype):
    """The loaded model equals torchrec's own quantization of the fp32 one bit for bit, stays
    near the fp32 scores, and its kernel reads the memory-mapped archive file itself."""
    model = models[interaction]
    path = archive(tmp_path, model, dtype, **variant(interaction))
    loaded = DLRMFactory(cfg(interaction, embedding_dtype=dtype)).load(path)
    dense, kjt = batch()
    got = forward(loaded, dense, kjt)
    assert torch.equal(got, forward(quantize(copy.deepcopy(model), dtype), dense, kjt))
    fp32 = forward(model, dense, kjt)
    assert (got - fp32).abs().max() < LOGIT_TOL[dtype] and not torch.equal(got, fp32)
    tbe = loaded.sparse_arch.embedding_bag_collection._emb_modules[0]
    assert mapped_file(tbe.weights_host.data_ptr()) == str(path)


@pytest.mark.parametrize("interaction", VARIANTS)
@pytest.mark.parametrize("dtype", ["fp32", *QUANTIZED])
def test_tables_sharded_on_two_cpu_devices_score_as_unsharded(tmp_path, models, interaction, dtype):
    path = archive(tmp_path, models[interaction], dtype, **variant(interaction))
    c = cfg(interaction, embedding_dtype=dtype)
    dense, kjt = batch()
    sharded = DLRMFactory(c).load(path, ["cpu", "cpu"])
    assert type(sharded.sparse_arch.embedding_bag_collection).__name__ == "ShardedQuantEmbeddingBagCollection"
    assert set(sharded_placement(sharded)) == set(c.sparse_features)
    assert torch.equal(forward(sharded, dense, kjt), forward(DLRMFactory(c).load(path), dense, kjt))


# --- the handler: batches of mixed requests, a bad one among them -----------------------------


def random_instance(rng: random.Random) -> dict:
    bags = {
        f: [rng.randrange(rows) for _ in range(rng.randint(0, 3))]
        for f, rows in zip(TINY["sparse_features"], TINY["num_embeddings"])
        if rng.random() < 0.8
    }
    return instance([rng.uniform(-2, 2) for _ in range(5)], **bags)


@pytest.mark.parametrize("interaction", VARIANTS)
@pytest.mark.parametrize("layout", ["fp32", "int8", "sharded-int4"])
def test_handler_batch_scores_each_request_as_alone(tmp_path, models, interaction, layout):
    from dlrm_handler import TorchRecDLRMHandler

    dtype = layout.split("-")[-1]
    section = {**TINY, **variant(interaction), "embedding_dtype": dtype}
    archive(tmp_path, models[interaction], dtype, **variant(interaction)).rename(tmp_path / "dlrm.pt")
    h = TorchRecDLRMHandler()
    h.initialize(FakeContext(tmp_path, section))
    if layout.startswith("sharded"):
        h.model = DLRMFactory(DLRMConfig.from_dict(section)).load(tmp_path / "dlrm.pt", ["cpu", "cpu"])
    rng = random.Random(7)
    reqs = [
        body(random_instance(rng)) if i % 3 else body({"instances": [random_instance(rng) for _ in range(3)]})
        for i in range(8)
    ]
    alone = [json.loads(call(h, [r], section)[0][0])["scores"] for r in reqs]
    bad = body(instance([0.0] * 5, feature_1=[30]))  # == rows: past the table
    out, ctx = call(h, reqs[:4] + [bad] + reqs[4:], section)
    assert ctx.statuses == {4: (400, "Bad Request")}
    assert "id 30 is out of range for feature 'feature_1'" in json.loads(out[4])["message"]
    got = [json.loads(o)["scores"] for o in out[:4] + out[5:]]
    for a, b in zip(got, alone):
        assert len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < 1e-5, (a, b)


def test_sizing_counts_the_cross_network_and_sizes_the_uncapped_dlrmv2(capsys):
    from scripts import sizing

    rep = sizing.main(["--config", str(ROOT / "model-config.dlrmv2.yaml"), "--memory", "24GiB", "--json"])
    capsys.readouterr()

    def mlp(sizes):
        return sum(a * b + b for a, b in zip(sizes, sizes[1:]))

    n = 27 * 128  # (F + 1) x D, the cross network's width
    dense = mlp([13, 512, 256, 128]) + 3 * (2 * n * 512 + n) + mlp([n, 1024, 1024, 512, 256, 1])
    assert rep["dense_bytes"] == 4 * dense
    assert rep["full"]["dtypes"]["fp32"]["table_bytes"] == 204_184_588 * 128 * 4  # MLPerf's 97.4 GiB
    assert [t["rows"] for t in rep["full"]["tables"]][:3] == [40_000_000, 39_060, 17_295]
    assert rep["full"]["dtypes"]["int8"]["table_bytes"] < rep["full"]["dtypes"]["fp32"]["table_bytes"] / 3
    assert (
        rep["dtypes"]["fp32"]["table_bytes"]
        == sum(DLRMConfig.from_yaml(ROOT / "model-config.dlrmv2.yaml").num_embeddings) * 128 * 4
    )


@pytest.mark.parametrize(
    "config,sample",
    [
        ("model-config.dlrmv2.yaml", "--sample sample_requests/dlrmv2.json"),
        ("model-config.criteo.yaml", "--sample sample_requests/criteo.json"),
        ("model-config.yaml", None),  # serve.py's default, the seed layout's request
    ],
)
def test_make_probes_each_shipped_config_with_its_own_sample(config, sample):
    import subprocess

    for target in ("serve", "ready", "rollout", "rollback"):
        out = subprocess.run(
            ["make", "-n", "-B", target, f"CONFIG={config}"], cwd=ROOT, check=True, capture_output=True, text=True
        ).stdout
        probe = next(
            line
            for line in out.splitlines()
            if "scripts/serve.py start" in line or "scripts/serve.py ready" in line or "scripts/rollout.py" in line
        )
        assert (sample in probe) if sample else "--sample" not in probe, (target, probe)
