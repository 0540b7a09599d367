"""Big tables: quantized dtypes, zero-copy loading, CPU sharding, the id check on every layout,
device choice, sizing, and a 10M-row table served without its fp32 copy."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from conftest import ROOT, TINY, FakeContext, call, tiny_config
from dlrmkit.config import DLRMConfig
from dlrmkit.errors import ConfigError
from dlrmkit.model import DLRMFactory
from dlrmkit.scale import EBC, quantize, shard, sharded_placement, table_bytes, worker_devices
from helpers import DENSE, archive, batch, body, forward, instance, mapped_file

QUANTIZED = ["fp16", "int8", "int4"]
# max |logit - fp32 logit| on the tiny model (U(-1, 1) tables, logits of std 1): the error
# grows with coarser steps; int4 has 16 levels over each row's range.
LOGIT_TOL = {"fp16": 0.02, "int8": 0.1, "int4": 1.5}


# --- config -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change,message",
    [
        ({"embedding_dtype": "int16"}, "handler.embedding_dtype: expected one of fp32, fp16, int8, int4, got 'int16'"),
        (
            {"embedding_dtype": "int4", "embedding_dim": 7, "dense_arch_layer_sizes": [16, 7]},
            "handler.embedding_dtype: int4 packs two values per byte and needs an even embedding_dim, got 7",
        ),
    ],
)
def test_embedding_dtype_errors_name_the_key(change, message):
    with pytest.raises(ConfigError) as info:
        DLRMConfig.from_dict({**TINY, **change})
    assert str(info.value).startswith(message), str(info.value)


def test_embedding_dtype_defaults_to_fp32():
    assert tiny_config().build.embedding_dtype == "fp32"
    assert DLRMConfig.from_yaml(ROOT / "model-config.yaml").build.embedding_dtype == "fp32"


# --- quantized archives -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_quantized_archive_loads_exactly_torchrec_quantized_model(tmp_path, model, dtype):
    """The archive round trip is lossless: the loaded model equals torchrec's own quantization
    of the fp32 model bit for bit, and stays near the fp32 scores."""
    dense, kjt = batch()
    want = forward(quantize(copy.deepcopy(model), dtype), dense, kjt)
    loaded = DLRMFactory(tiny_config(embedding_dtype=dtype)).load(archive(tmp_path, model, dtype))
    got = forward(loaded, dense, kjt)
    assert torch.equal(got, want)
    fp32 = forward(model, dense, kjt)
    assert (got - fp32).abs().max() < LOGIT_TOL[dtype]
    assert not torch.equal(got, fp32)  # it really is the quantized kernel


def test_fp32_tables_run_in_the_fused_kernel_and_score_as_nn_embedding_bag(tmp_path, model):
    """fp32 goes through fbgemm's table-batched kernel like the quantized dtypes; its scores
    equal the nn.EmbeddingBag model's (within 1e-6: the same sums in another order)."""
    loaded = DLRMFactory(tiny_config()).load(archive(tmp_path, model, "fp32"))
    assert type(loaded.sparse_arch.embedding_bag_collection).__module__ == "torchrec.quant.embedding_modules"
    for seed in (1, 2):
        dense, kjt = batch(seed=seed)
        assert (forward(loaded, dense, kjt) - forward(model, dense, kjt)).abs().max() <= 1e-6


def test_an_archive_from_before_the_fused_kernel_is_refused_naming_its_first_table(tmp_path, model):
    """fp32 tables archived as nn.EmbeddingBag weights (built before fp32 went through the fused
    kernel) no longer load: the error names the first table and says to build the archive again."""
    with pytest.raises(
        ConfigError,
        match=r"^checkpoint: table 'feature_0' holds float32 values, handler.embedding_dtype "
        r"fp32 stores uint8; build the archive with this config",
    ):
        DLRMFactory(tiny_config()).load(_unfused_fp32(tmp_path, model))


@pytest.mark.parametrize("dtype", QUANTIZED + ["fp32"])
def test_quantized_tables_are_the_archive_pages(tmp_path, model, dtype):
    """No copy: the kernel reads the memory-mapped archive file itself (shared across workers)."""
    path = archive(tmp_path, model, dtype)
    loaded = DLRMFactory(tiny_config(embedding_dtype=dtype)).load(path)
    tbe = loaded.sparse_arch.embedding_bag_collection._emb_modules[0]
    assert mapped_file(tbe.weights_host.data_ptr()) == str(path)
    # state_dict shows the adopted buffer, and the table views lie inside it
    sd = loaded.state_dict()
    w = sd[EBC + "embedding_bags.feature_1.weight"]
    assert mapped_file(getattr(w, "elem", w).data_ptr()) == str(path)


def test_archive_is_much_smaller_than_fp32(tmp_path, model):
    sizes = {d: archive(tmp_path, model, d).stat().st_size for d in QUANTIZED}
    fp32 = tmp_path / "fp32.pt"
    torch.save(model.state_dict(), fp32)
    # Tiny D=8 tables pad rows to 16 bytes, so all three take 16 B/row vs fp32's 32 B/row.
    for d, size in sizes.items():
        assert size < fp32.stat().st_size, d


def test_fp32_archive_into_an_int8_config_names_the_dtype(tmp_path, weights):
    with pytest.raises(ConfigError) as info:
        DLRMFactory(tiny_config(embedding_dtype="int8")).load(weights)
    assert "handler.embedding_dtype int8" in str(info.value) and "--checkpoint" in str(info.value)


def test_int8_archive_with_wrong_rows_names_the_table(tmp_path, model):
    path = archive(tmp_path, model, "int8")
    with pytest.raises(ConfigError, match="table 'feature_1' has shape"):
        DLRMFactory(tiny_config(embedding_dtype="int8", num_embeddings=[20, 31, 40])).load(path)


def test_build_mar_quantizes_a_checkpoint(tmp_path, model, weights):
    import zipfile

    from scripts import build_mar
    import yaml

    doc = yaml.safe_load((ROOT / "model-config.yaml").read_text())
    doc["handler"] = {**TINY, "embedding_dtype": "int8"}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(doc))
    mar = build_mar.main(
        ["--config", str(tmp_path / "cfg.yaml"), "--checkpoint", str(weights), "--output-dir", str(tmp_path / "store")]
    )
    with zipfile.ZipFile(mar) as z:
        z.extract("dlrm.pt", tmp_path / "x")
        assert "dlrmkit/scale.py" in z.namelist()
    state = torch.load(tmp_path / "x" / "dlrm.pt", mmap=True, weights_only=True)
    assert state[EBC + "embedding_bags.feature_0.weight"].dtype == torch.uint8
    dense, kjt = batch()
    loaded = DLRMFactory(tiny_config(embedding_dtype="int8")).load(tmp_path / "x" / "dlrm.pt")
    assert torch.equal(forward(loaded, dense, kjt), forward(quantize(copy.deepcopy(model), "int8"), dense, kjt))


# --- sharding on CPU "devices" ----------------------------------------------------------------


@pytest.mark.parametrize("dtype,world", [(d, w) for d in ["int8", "fp16", "int4", "fp32"] for w in [1, 2, 4]])
def test_cpu_sharding_places_every_table_and_matches_unsharded(tmp_path, model, dtype, world):
    """torchrec's planner + sharded quantized EBC in one process on CPU: the same code the
    multi-GPU worker runs. Every table placed table-wise, scores bit-identical."""
    cfg = tiny_config(embedding_dtype=dtype)
    path = archive(tmp_path, model, dtype)
    dense, kjt = batch()
    unsharded = forward(DLRMFactory(cfg).load(path), dense, kjt)
    if world == 1:  # the factory never shards one device; drive the sharder directly
        sharded, plan = shard(DLRMFactory(cfg).load(path), [torch.device("cpu")])
    else:
        sharded = DLRMFactory(cfg).load(path, ["cpu"] * world)
        plan = None
    assert torch.equal(forward(sharded, dense, kjt), unsharded)
    assert set(sharded_placement(sharded)) == set(cfg.sparse_features)
    if plan is not None:
        tables = plan.plan[EBC.rstrip(".")]
        assert set(tables) == set(cfg.sparse_features)
        assert all(p.sharding_type == "table_wise" and len(p.ranks) == 1 for p in tables.values())


def test_cpu_sharding_spreads_tables_over_ranks(model, tmp_path):
    cfg = tiny_config(embedding_dtype="int8")
    _, plan = shard(DLRMFactory(cfg).load(archive(tmp_path, model, "int8")), [torch.device("cpu")] * 2)
    ranks = {p.ranks[0] for p in plan.plan[EBC.rstrip(".")].values()}
    assert ranks == {0, 1}


def _unfused_fp32(tmp_path, model) -> Path:
    """An fp32 archive as built before the fused kernel: the nn.EmbeddingBag state_dict."""
    path = tmp_path / "fp32.pt"
    torch.save(model.state_dict(), path)
    return path


# --- the id check holds for every layout ------------------------------------------------------


class Recorder(torch.nn.Module):
    """Counts the rows that reach the model."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.rows = inner, 0

    def forward(self, dense, kjt):
        self.rows += dense.shape[0]
        return self.inner(dense, kjt)


LAYOUTS = ["fp32", "fp16", "int8", "int4", "sharded-int8"]


@pytest.fixture(params=LAYOUTS)
def layout_handler(request, tmp_path, model):
    from dlrm_handler import TorchRecDLRMHandler

    dtype = request.param.split("-")[-1]
    section = {**TINY, "embedding_dtype": dtype}
    archive(tmp_path, model, dtype).rename(tmp_path / "dlrm.pt")
    h = TorchRecDLRMHandler()
    h.initialize(FakeContext(tmp_path, section))
    if request.param.startswith("sharded"):
        h.model = DLRMFactory(DLRMConfig.from_dict(section)).load(tmp_path / "dlrm.pt", ["cpu", "cpu"])
        assert type(h.model.sparse_arch.embedding_bag_collection).__name__ == "ShardedQuantEmbeddingBagCollection"
    h.model = Recorder(h.model)
    return h, section


def test_out_of_range_ids_get_400_and_never_reach_the_model(layout_handler):
    h, section = layout_handler
    bad = [
        body(instance(DENSE, feature_0=[20])),  # == rows: a silent row 0 / padding read
        body(instance(DENSE, feature_2=[1, 40])),
        body(instance(DENSE, feature_1=[10**12])),
        body(instance(DENSE, feature_0=[-1])),  # -1: a silent zero vector in fbgemm
        body({"instances": [instance(DENSE, feature_0=[1]), instance(DENSE, feature_1=[30])]}),
    ]
    out, ctx = call(h, bad, section)
    assert {i: c for i, (c, _) in ctx.statuses.items()} == {i: 400 for i in range(len(bad))}
    assert h.model.rows == 0
    assert "id 20 is out of range for feature 'feature_0'" in json.loads(out[0])["message"]
    assert "non-negative" in json.loads(out[3])["message"]


def test_good_rows_score_next_to_bad_ones_on_every_layout(layout_handler):
    h, section = layout_handler
    good = body(instance(DENSE, feature_0=[19], feature_1=[0, 29], feature_2=[39]))
    solo = json.loads(call(h, [good], section)[0][0])
    out, ctx = call(h, [body(instance(DENSE, feature_0=[20])), good], section)
    assert ctx.statuses == {0: (400, "Bad Request")}
    assert json.loads(out[1]) == solo
    assert h.model.rows == 2  # the bad row never did


# --- devices ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "gpu_id,yaml,count,env,want",
    [
        (None, {}, 0, {}, ["cpu"]),
        (0, {}, 0, {}, ["cpu"]),  # TorchServe thinks GPU, no CUDA here
        (None, {"parallelType": "custom", "parallelLevel": 2}, 4, {}, ["cpu"]),  # no GPU assigned
        (1, {}, 4, {}, ["cuda:1"]),  # one GPU per worker: no sharding
        (2, {"parallelType": "custom", "parallelLevel": 2}, 2, {"CUDA_VISIBLE_DEVICES": "2,3"}, ["cuda:0", "cuda:1"]),
        (0, {"parallelType": "custom", "parallelLevel": 4}, 2, {"CUDA_VISIBLE_DEVICES": "0,1"}, ["cuda:0", "cuda:1"]),
        (0, {"parallelType": "custom", "parallelLevel": 1}, 1, {"CUDA_VISIBLE_DEVICES": "5"}, ["cuda:0"]),
        (0, {"parallelType": "pp", "parallelLevel": 2}, 2, {}, ["cuda:0"]),  # torchrun types: one device per rank
    ],
)
def test_worker_devices(gpu_id, yaml, count, env, want):
    assert [str(d) for d in worker_devices(gpu_id, yaml, count, env)] == want


# --- sizing -----------------------------------------------------------------------------------


def test_table_bytes_match_what_the_kernels_allocate():
    from dlrmkit.scale import quant_ebc

    f = DLRMFactory(tiny_config())
    for dtype in QUANTIZED:
        qebc = quant_ebc(f.tables(dtype), torch.device("cpu"))
        tbe = qebc._emb_modules[0]
        want = sum(table_bytes(r, 8, dtype) for r in (20, 30, 40))
        assert tbe.host_size == want, dtype
    assert table_bytes(1000, 64, "fp32") == 256_000
    assert table_bytes(1000, 64, "int8") == 1000 * 80  # 64 + 4 scale/bias, padded to 16
    assert table_bytes(1000, 64, "fp16") == 1000 * 128
    assert table_bytes(1000, 64, "int4") == 1000 * 48


def test_sizing_script(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "sizing.py"),
            "--config",
            str(ROOT / "model-config.criteo.yaml"),
            "--memory",
            "8GiB",
            "--json",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    report = json.loads(out)
    assert report["dtypes"]["fp32"]["table_bytes"] == sum(
        r * 64 * 4 for r in DLRMConfig.from_yaml(ROOT / "model-config.criteo.yaml").num_embeddings
    )
    assert report["dtypes"]["int8"]["table_bytes"] < report["dtypes"]["fp32"]["table_bytes"] / 3
    for d in report["dtypes"].values():
        assert d["workers_shared"] >= d["workers_unshared"] >= 1
        assert d["startup_timeout_s"] >= 30


# --- a big table, served without its fp32 copy --------------------------------------------------

SERVE_BIG = textwrap.dedent("""
    import json, sys
    import torch
    from conftest import FakeContext, call
    def hwm():  # this process's peak RSS (ru_maxrss would include the parent's: kept across exec)
        return int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) * 1024
    from dlrm_handler import TorchRecDLRMHandler
    section = json.loads(sys.argv[3])
    peak0 = hwm()
    h = TorchRecDLRMHandler()
    h.initialize(FakeContext(__import__("pathlib").Path(sys.argv[2]), section))
    req = {"dense": [0.1] * 5, "sparse": {"keys": ["feature_0", "feature_1"],
           "values": [9_999_999, 0, 5_000_000, 3], "lengths": [3, 1]}}
    bad = dict(req, sparse=dict(req["sparse"], values=[10_000_000, 0, 1, 3]))
    out, ctx = call(h, [json.dumps(req).encode(), json.dumps(bad).encode()], section)
    peak1 = hwm()
    print(json.dumps({"grew": peak1 - peak0, "out": [json.loads(o) for o in out],
                      "statuses": {str(k): v[0] for k, v in ctx.statuses.items()}}))
""")


def test_ten_million_row_int8_table_is_served_without_its_fp32_copy(tmp_path):
    rows = 10_000_000
    section = {**TINY, "num_embeddings": [rows, 30, 40], "embedding_dtype": "int8"}
    cfg = DLRMConfig.from_dict(section)
    # The build (in a child, so its fp32 tables never count here) writes the int8 archive.
    subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
        import sys, json, torch
        from dlrmkit.config import DLRMConfig
        from dlrmkit.model import DLRMFactory
        f = DLRMFactory(DLRMConfig.from_dict(json.loads({json.dumps(section)!r})))
        torch.save(f.archive_state(f.random()), {str(tmp_path / "dlrm.pt")!r})
    """),
        ],
        check=True,
    )
    fp32_table = rows * cfg.embedding_dim * 4
    int8_table = table_bytes(rows, cfg.embedding_dim, "int8")
    assert (tmp_path / "dlrm.pt").stat().st_size >= int8_table
    res = subprocess.run(
        [sys.executable, "-c", SERVE_BIG, str(ROOT), str(tmp_path), json.dumps(section)],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT / "tests")},
    )  # conftest; the kit is installed
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert report["statuses"] == {"1": 400}
    assert 0 < report["out"][0]["score"] < 1
    # Loading + scoring grew the peak by far less than the fp32 table (320 MB), and less than
    # even the int8 table (160 MB): its pages stay in the file until a row is read.
    assert report["grew"] < int8_table / 4, report["grew"]
    assert report["grew"] < fp32_table / 8


# --- GPU (`make test` leaves these out; `make test-gpu` runs them and fails without the devices) ----


def gpus(n: int) -> None:
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < n:
        pytest.fail(f"needs {n} CUDA device(s), found {have}: run make test-gpu on a machine that has them")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", QUANTIZED)
def test_quantized_model_on_one_gpu_matches_cpu(tmp_path, model, dtype):
    gpus(1)
    path = archive(tmp_path, model, dtype)
    dense, kjt = batch()
    want = forward(DLRMFactory(tiny_config(embedding_dtype=dtype)).load(path), dense, kjt)
    gpu = DLRMFactory(tiny_config(embedding_dtype=dtype)).load(path, "cuda:0")
    got = forward(gpu, dense.cuda(), kjt.to(torch.device("cuda:0")))
    assert torch.allclose(got.cpu(), want, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["int8", "fp16", "fp32"])
def test_tables_sharded_over_two_gpus_match_cpu(tmp_path, model, dtype):
    gpus(2)
    path = archive(tmp_path, model, dtype)
    cfg = tiny_config(embedding_dtype=dtype)
    dense, kjt = batch()
    want = forward(DLRMFactory(cfg).load(path), dense, kjt)
    sharded = DLRMFactory(cfg).load(path, ["cuda:0", "cuda:1"])
    assert set(map(str, sharded_placement(sharded).values())) == {"cuda:0", "cuda:1"}
    assert next(sharded.over_arch.parameters()).device == torch.device("cuda:0")
    got = forward(sharded, dense.cuda(), kjt.to(torch.device("cuda:0")))
    assert torch.allclose(got.cpu(), want, atol=1e-4)


@pytest.mark.gpu
def test_handler_given_two_gpus_shards_and_still_checks_ids(tmp_path, model):
    from dlrm_handler import TorchRecDLRMHandler

    gpus(2)
    archive(tmp_path, model, "int8").rename(tmp_path / "dlrm.pt")
    section = {**TINY, "embedding_dtype": "int8"}
    ctx = FakeContext(tmp_path, section, gpu_id=0)
    ctx.model_yaml_config.update(parallelType="custom", parallelLevel=2)
    h = TorchRecDLRMHandler()
    h.initialize(ctx)
    assert set(map(str, sharded_placement(h.model).values())) == {"cuda:0", "cuda:1"}
    out, c = call(
        h, [body(instance(DENSE, feature_0=[20])), body(instance(DENSE, feature_0=[19], feature_2=[39]))], section
    )
    assert c.statuses == {0: (400, "Bad Request")} and 0 < json.loads(out[1])["score"] < 1


def test_archive_of_another_dtype_names_the_dtype(tmp_path, model):
    with pytest.raises(ConfigError, match="another handler.embedding_dtype than fp32"):
        DLRMFactory(tiny_config()).load(archive(tmp_path, model, "int8"))
