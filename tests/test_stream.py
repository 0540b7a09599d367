"""The streaming build (dlrmkit/stream.py, scripts/build_big.py): tables written chunk by chunk are byte
for byte what build_mar.py archives, from random weights and from checkpoints."""

from __future__ import annotations

import ctypes
import os
import resource

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dlrmkit import stream
from conftest import tiny_config
from dlrmkit.checkpoint import import_checkpoint
from dlrmkit.errors import ConfigError
from dlrmkit.model import DLRMFactory
from dlrmkit.scale import fused_tables, quant_ebc
from helpers import refuse_mmap, batch

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
DTYPES = ["fp32", "fp16", "int8", "int4"]


def fp32_model(config, source):
    """The fp32 model holding ``source``'s rows and dense layers (what build_mar.py would quantize)."""
    factory = DLRMFactory(config.with_changes(embedding_dtype="fp32"))
    model = factory.build("cpu")
    with torch.no_grad():
        for t, name in enumerate(config.sparse_features):
            model.sparse_arch.embedding_bag_collection.embedding_bags[name].weight.copy_(
                source.rows(t, 0, config.num_embeddings[t])
            )
        model.load_state_dict(source.dense(), strict=False)
    return model.eval()


def assert_same_archive(got, want):
    assert set(got) == set(want)
    for k, v in want.items():
        assert (
            got[k].dtype == v.dtype
            and got[k].shape == v.shape
            and got[k].stride() == v.stride()
            and got[k].storage_offset() == v.storage_offset()
        ), k
        assert torch.equal(got[k], v), k


@pytest.mark.parametrize("dtype", DTYPES)
def test_layout_is_the_kernels(dtype):
    config = tiny_config(embedding_dtype=dtype, num_embeddings=[1000, 37, 513])
    qebc = quant_ebc(DLRMFactory(config).tables(dtype), torch.device("cpu"))
    tables = fused_tables(qebc)
    slots, host = stream.layout(config)
    assert host == next(iter(tables.values())).untyped_storage().nbytes()
    for s in slots:
        t = tables[f"{stream.TABLES}{s.name}.weight"]
        assert (t.storage_offset(), tuple(t.shape)) == (s.offset, (s.rows, s.row_bytes))


@pytest.mark.parametrize("dtype", DTYPES)
def test_random_build_is_the_normal_build_of_the_same_weights(tmp_path, dtype):
    config = tiny_config(embedding_dtype=dtype, num_embeddings=[300, 37, 513])
    path = tmp_path / "dlrm.pt"
    # 64 rows a chunk: every table spans several chunks, one ends mid-chunk
    stream.write_weights(path, config, stream.RandomSource(config), chunk_bytes=64 * 8 * 4)
    got = torch.load(path, mmap=True, weights_only=True)
    want = DLRMFactory(config).archive_state(fp32_model(config, stream.RandomSource(config)))
    assert_same_archive(got, want)
    # and it serves: every input moves the score, as with build_mar's random weights
    model = DLRMFactory(config).load(path)
    dense, kjt = batch(64)
    with torch.no_grad():
        scores = torch.sigmoid(model(dense, kjt)).squeeze(1)
    assert scores.std() > 0.05 and len(set(scores.tolist())) > 32


def test_random_rows_do_not_depend_on_the_chunk_size():
    config = tiny_config(num_embeddings=[300, 37, 513])
    a, b = stream.RandomSource(config), stream.RandomSource(config)
    whole = a.rows(2, 0, 513)
    parts = torch.cat([b.rows(2, 0, 7), b.rows(2, 7, 500), b.rows(2, 507, 6)])
    assert torch.equal(whole, parts)
    with pytest.raises(RuntimeError, match="in order"):
        b.rows(0, 5, 3)


@pytest.mark.parametrize("form", ["dcp", "pt"])
@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_checkpoint_build_is_build_mars_checkpoint_build(tmp_path, model, form, dtype):
    config = tiny_config(embedding_dtype=dtype)
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    if form == "dcp":
        ckpt = tmp_path / "ckpt"
        dcp.save(state, checkpoint_id=ckpt, no_dist=True)
    else:
        ckpt = tmp_path / "trained.pt"
        torch.save(state, ckpt)
    path = tmp_path / "dlrm.pt"
    source = stream.CheckpointSource(ckpt, config, log=lambda _: None)
    stream.write_weights(path, config, source, chunk_bytes=7 * 8 * 4, log=lambda _: None)
    factory = DLRMFactory(config)
    want = factory.archive_state(factory.load_fp32(import_checkpoint(ckpt, config, log=lambda _: None)))
    assert_same_archive(torch.load(path, mmap=True, weights_only=True), want)


def test_a_dcp_shard_is_read_from_its_offset_not_whole(tmp_path, model):
    config = tiny_config(embedding_dtype="int8")
    dcp.save({k: v for k, v in model.state_dict().items()}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    source = stream.CheckpointSource(tmp_path / "ckpt", config, log=lambda _: None)
    # rows 5..11 of feature_1 straight from the .distcp file
    assert torch.equal(
        source.rows(1, 5, 7), model.sparse_arch.embedding_bag_collection.embedding_bags["feature_1"].weight[5:12]
    )
    (shards,) = [v for k, v in source._shards.items() if "feature_1" in k]
    assert [s[0:2] for s in shards] == [(0, 30)] and shards[0][2].__qualname__.startswith("_pread_rows")


def test_a_checkpoint_that_does_not_fit_is_refused_before_a_file_is_written(tmp_path, model):
    dcp.save(dict(model.state_dict()), checkpoint_id=tmp_path / "ckpt", no_dist=True)
    with pytest.raises(ConfigError, match="feature_0.*shape"):
        stream.CheckpointSource(tmp_path / "ckpt", tiny_config(num_embeddings=[21, 30, 40]))
    assert not list(tmp_path.glob("*.pt*"))


def test_the_disk_check_names_what_is_needed(tmp_path):
    with pytest.raises(ConfigError, match=r"needs 1000000\.0 GiB of disk .* free there"):
        stream.check_disk(tmp_path / "dlrm.pt", 10**6 * 2**30)
    assert stream.check_disk(tmp_path / "dlrm.pt", 1) > 0


def test_build_big_writes_a_no_archive_model_directory(tmp_path):
    from scripts import build_big
    import yaml

    from conftest import TINY

    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({"handler": dict(TINY)}))
    out = tmp_path / "store" / "big"
    result = build_big.main(["--config", str(cfg), "--dtype", "int8", "--out", str(out)])
    manifest = (out / "MAR-INF" / "MANIFEST.json").read_text()
    assert '"serializedFile": "dlrm.pt"' in manifest and '"modelName": "big"' in manifest
    written = yaml.safe_load((out / "model-config.yaml").read_text())["handler"]
    assert written["embedding_dtype"] == "int8" and written["num_embeddings"] == [20, 30, 40]
    assert result["peak_rss_bytes"] > 0 and (out / "dlrm.pt").stat().st_size == result["file_bytes"]
    with pytest.raises(SystemExit, match="exists"):
        build_big.main(["--config", str(cfg), "--out", str(out)])


def test_rows_paged_out_between_requests_come_back_from_disk_with_the_same_scores(tmp_path):
    """The tables are file-backed pages: dropped (madvise + fadvise DONTNEED), the next request
    reads them from the file again (major faults) and scores the same."""
    config = tiny_config(
        embedding_dtype="int8", num_embeddings=[40_000, 30, 40], embedding_dim=64, dense_arch_layer_sizes=[16, 64]
    )
    path = tmp_path / "dlrm.pt"
    stream.write_weights(path, config, stream.RandomSource(config), log=lambda _: None)
    model = DLRMFactory(config).load(path)
    buf = model.sparse_arch.embedding_bag_collection._emb_modules[0].weights_host
    dense, kjt = DLRMFactory(config).probe_batch(256, torch.Generator().manual_seed(5))
    with torch.no_grad():
        before = model(dense, kjt)
    libc = ctypes.CDLL(None, use_errno=True)
    page = os.sysconf("SC_PAGE_SIZE")
    lo = buf.data_ptr() // page * page
    hi = buf.data_ptr() + buf.numel()
    assert libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), 4) == 0  # MADV_DONTNEED
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
    with torch.no_grad():
        after = model(dense, kjt)
    assert torch.equal(before, after)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_majflt > faults


# --- sizing's rule for memory-mapped tables larger than memory -----------------------------------


def test_zipf_mass_and_hot_rows_match_the_brute_force_sums():
    from scripts.sizing import hot_rows, zipf_mass

    for s in (0.8, 1.0, 1.05, 1.3):
        exact = [0.0]
        for i in range(1, 50_001):
            exact.append(exact[-1] + i**-s)
        assert abs(zipf_mass(50_000, s, exact=100) - exact[-1]) < 1e-6 * exact[-1]
        for h in (0.3, 0.8, 0.95):
            k = hot_rows(50_000, s, h)
            assert exact[k] >= h * exact[-1] > exact[k - 1]
    assert hot_rows(1000, 1.05, 1.0) == 1000


def test_working_set_counts_the_pages_the_hot_rows_scatter_over():
    from scripts.sizing import hot_rows, working_set

    # 1,000 hot rows of 144 bytes among 100,000 pages: ~995 distinct pages, not 144 KB
    rows = 100_000 * 4096 // 144
    k = hot_rows(rows, 1.2, 0.9)
    pages = 100_000
    assert working_set(rows, 144, 1.2, 0.9) == pytest.approx(pages * (1 - (1 - 1 / pages) ** k) * 4096, rel=1e-3)
    assert working_set(rows, 144, 1.2, 0.9) > k * 144 * 10  # a page per hot row, not a row
    assert working_set(rows, 144, 1.05, 1.0) == rows * 144  # every row: the whole table
    assert working_set(10, 144, 1.05, 0.5) == 1440  # never more than the table
    # a higher hit rate or a flatter law needs more
    assert working_set(rows, 144, 1.05, 0.8) < working_set(rows, 144, 1.05, 0.9) < working_set(rows, 144, 0.9, 0.9)


def test_sizing_no_longer_says_zero_workers_for_the_full_dlrmv2_at_int8(capsys):
    from scripts import sizing

    from conftest import ROOT

    rep = sizing.main(
        ["--config", str(ROOT / "model-config.dlrmv2.yaml"), "--memory", "24GiB", "--cpus", "2", "--json"]
    )
    full = rep["full"]["dtypes"]["int8"]
    assert full["table_bytes"] > 24 * 2**30 and full["workers_shared"] == 0  # the tables do not fit
    assert full["working_set_bytes"] < 24 * 2**30 and full["workers_paged"] >= 1
    assert full["workers_paged"] == (24 * 2**30 - full["working_set_bytes"]) // (rep["dense_bytes"] + 450 * 2**20)
    # resident int4 keeps the shared rule
    int4 = rep["full"]["dtypes"]["int4"]
    assert int4["workers_paged"] == int4["workers_shared"] >= 1


def test_a_file_the_commit_limit_refuses_to_map_privately_loads_read_only(tmp_path, monkeypatch):
    """torch.load(mmap=True) maps copy-on-write, which Linux charges in full to the commit limit:
    a file larger than memory fails with ENOMEM. The factory then maps it read-only (charged
    nothing) and scores the same; the tables then are read-only pages of the file."""
    config = tiny_config(embedding_dtype="int8", num_embeddings=[5000, 30, 40])
    path = tmp_path / "dlrm.pt"
    stream.write_weights(path, config, stream.RandomSource(config), log=lambda _: None)
    dense, kjt = batch(64)
    with torch.no_grad():
        want = DLRMFactory(config).load(path)(dense, kjt)
    refuse_mmap(monkeypatch)
    model = DLRMFactory(config).load(path)
    with torch.no_grad():
        assert torch.equal(model(dense, kjt), want)
    buf = model.sparse_arch.embedding_bag_collection._emb_modules[0].weights_host
    maps = open("/proc/self/maps").read().splitlines()
    (line,) = [ln for ln in maps if int(ln.split("-")[0], 16) <= buf.data_ptr() < int(ln.split()[0].split("-")[1], 16)]
    assert line.split()[1].startswith("r--") and line.endswith(str(path))


def test_the_placeholder_buffer_of_a_lazy_kernel_commits_no_memory():
    from dlrmkit.scale import _uncommitted

    buf = _uncommitted(3 << 30)
    assert buf.numel() == 3 << 30 and buf.dtype == torch.uint8
    assert int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") < 3 << 30


def test_build_big_gives_an_int8_dense_half_static_scales_as_build_mar_does(tmp_path, caplog):
    """dense_precision int8: random weights calibrate on the kit's random rows, --calibrate on its
    requests looked up in the written tables; the worker then runs int8 static, not dynamic."""
    import json
    import logging

    import yaml
    from scripts import build_big

    from conftest import TINY
    from dlrmkit import dense
    from dlrmkit.dense import CALIBRATION_FILE
    from dlrmkit.worker import Worker, read_model_dir

    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({"handler": {**TINY, "dense_precision": "int8"}}))
    random_rows, sample = tmp_path / "random", tmp_path / "sample"
    build_big.main(["--config", str(cfg), "--dtype", "int8", "--out", str(random_rows)])
    assert torch.load(random_rows / CALIBRATION_FILE)["dense"].shape[0] > 8
    requests = tmp_path / "calibration.jsonl"

    def columns(lo: int) -> dict:  # rows lo, lo + 1: dense 0.5 x row, one id per feature
        ids = {f"feature_{f}": {"values": [lo + f, lo + f + 1]} for f in range(3)}
        return {"columns": {"dense": [[0.5 * i] * 5 for i in (lo, lo + 1)], "sparse": ids}}

    requests.write_text("\n".join(json.dumps(columns(lo)) for lo in (0, 2, 4)) + "\n")
    build_big.main(["--config", str(cfg), "--dtype", "int8", "--out", str(sample), "--calibrate", str(requests)])
    inputs = torch.load(sample / CALIBRATION_FILE)
    assert inputs["dense"].shape == (6, 5) and torch.equal(inputs["dense"][:, 0], torch.arange(6) * 0.5)
    w = Worker()
    with caplog.at_level(logging.INFO, logger="dlrmkit"):
        w.load(sample, *read_model_dir(sample))
    w.close()
    # where the CPU runs int8 (VNNI or AMX) the static scales are what runs; on AVX2 the CPU check
    # falls back to fp32 and says why (dlrmkit.dense.unsupported), whatever the archive carries
    why = dense.unsupported("int8", dense.cpu_flags())
    assert (
        "dense half: int8 static" if why is None else f"dense half: fp32 (FALLING BACK from int8: {why})"
    ) in caplog.text
