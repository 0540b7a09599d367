"""Hot rows (dlrmkit/hot.py, scripts/build_big.py --hot-counts): a packed model scores exactly as the
unpacked one, every dtype; the build, the worker's redirect, its warm-up, live deltas and the id
counter."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest
import torch
import yaml

from conftest import ROOT, TINY, tiny_config
from dlrmkit import hot, stream
from dlrmkit.errors import ConfigError
from dlrmkit.model import DLRMFactory
from dlrmkit.scale import TABLES, fused_tables
from helpers import refuse_mmap

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
DTYPES = ["fp32", "fp16", "int8", "int4"]
ROWS = [300, 37, 513]


def skewed_batch(config, n=96, seed=5):
    """n rows whose ids lean on a few rows of each table (the hot ones), 1-4 ids per feature."""
    gen = torch.Generator().manual_seed(seed)
    dense = torch.randn(n, config.num_dense_features, generator=gen)
    lengths = torch.randint(1, 5, (config.num_features * n,), generator=gen)
    values = []
    for f, rows in enumerate(config.num_embeddings):
        k = int(lengths[f * n : (f + 1) * n].sum())
        hot_part = torch.randint(0, 8, (k,), generator=gen) * 7 % rows  # rows 0, 7, 14, ... 49
        cold_part = torch.randint(0, rows, (k,), generator=gen)
        values.append(torch.where(torch.rand(k, generator=gen) < 0.6, hot_part, cold_part))
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    return dense, KeyedJaggedTensor(keys=list(config.sparse_features), values=torch.cat(values), lengths=lengths)


def bodies_of(config, dense, kjt) -> list[dict]:
    """The rows of (dense, kjt) as the kit's seed requests, one a row."""
    feats = kjt.to_dict()
    bodies = []
    for r in range(dense.shape[0]):
        sparse: dict[str, list] = {"keys": [], "values": [], "lengths": []}
        for name in config.sparse_features:
            v = feats[name]
            ids = v.values()[v.offsets()[r] : v.offsets()[r + 1]].tolist()
            sparse["keys"].append(name)
            sparse["values"].extend(ids)
            sparse["lengths"].append(len(ids))
        bodies.append({"dense": dense[r].tolist(), "sparse": sparse})
    return bodies


def counts_of(config, kjt) -> hot.Counts:
    return hot.count({k: v.values() for k, v in kjt.to_dict().items()})


def build(tmp_path, config, chosen=None, name="dlrm.pt"):
    path = tmp_path / name
    stream.write_weights(
        path, config, stream.RandomSource(config), chunk_bytes=64 * 8 * 4, log=lambda _: None, hot=chosen
    )
    return path


def logits(model, dense, kjt):
    with torch.inference_mode():
        return model(dense, kjt).squeeze(1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_packed_model_scores_exactly_as_the_unpacked_one(tmp_path, dtype):
    config = tiny_config(embedding_dtype=dtype, num_embeddings=ROWS)
    dense, kjt = skewed_batch(config)
    rows = dict(zip(config.sparse_features, config.num_embeddings))
    chosen = hot.choose(counts_of(config, skewed_batch(config, seed=9)[1]), rows, stream.row_bytes(config), 1 << 20)
    assert all(len(h) >= 8 for h in chosen.values())
    plain = DLRMFactory(config).load(build(tmp_path, config))
    packed = DLRMFactory(config).load(build(tmp_path, config, chosen, "packed.pt"))
    assert plain.hot_index is None and packed.hot_index is not None
    index = packed.hot_index
    redirected = index.redirect(kjt)
    moved = redirected.values() != kjt.values()
    assert moved.float().mean() > 0.3  # most lookups read a copy
    want = logits(plain, dense, kjt)
    assert torch.equal(logits(packed, dense, redirected), want)
    assert torch.equal(logits(packed, dense, kjt), want)  # the rows where they lie: the same
    # the copies are the rows, byte for byte
    views = fused_tables(packed.sparse_arch.embedding_bag_collection)
    for t, ids in chosen.items():
        table = views[f"{TABLES}{t}.weight"]
        assert table.shape[0] == rows[t] + len(ids)
        assert torch.equal(table[rows[t] :], table[ids])
    # ids sent one copy off move the scores: the check above can fail
    t = config.sparse_features[0]
    off_by_one = hot.HotIndex({**rows, t: rows[t] - 1}, {t: chosen[t][chosen[t] < rows[t] - 1]}).redirect(kjt)
    assert not torch.equal(logits(packed, dense, off_by_one), want)


def test_choose_takes_the_most_counted_rows_of_all_tables_within_the_budget():
    counts = {
        "a": (torch.tensor([1, 2, 3, 9]), torch.tensor([50, 3, 1, 7])),
        "b": (torch.tensor([0, 5, 99]), torch.tensor([20, 7, 100])),
    }
    rows = {"a": 10, "b": 10, "c": 4}
    # b:99 is outside table b; ties (7) go to table order
    got = hot.choose(counts, rows, row_bytes=16, budget_bytes=16 * 4)
    assert {t: h.tolist() for t, h in got.items()} == {"a": [1, 9], "b": [0, 5]}
    got = hot.choose(counts, rows, row_bytes=16, budget_bytes=16 * 100)
    assert {t: h.tolist() for t, h in got.items()} == {"a": [1, 2, 3, 9], "b": [0, 5]}
    got = hot.choose(counts, rows, row_bytes=16, budget_bytes=16 * 2)
    assert {t: h.tolist() for t, h in got.items()} == {"a": [1], "b": [0]}
    with pytest.raises(ConfigError, match="table 'zz' is not in the model config"):
        hot.choose({"zz": counts["a"]}, rows, 16, 64)


def test_counts_files_and_directories_are_summed(tmp_path):
    hot.write_counts(tmp_path / "one.pt", {"a": (torch.tensor([1, 2]), torch.tensor([3, 4]))})
    (tmp_path / "d").mkdir()
    hot.write_counts(
        tmp_path / "d" / "two.pt",
        {"a": (torch.tensor([2, 7]), torch.tensor([1, 1])), "b": (torch.tensor([0]), torch.tensor([5]))},
    )
    got = hot.read_counts([tmp_path / "one.pt", tmp_path / "d"])
    assert {t: (i.tolist(), c.tolist()) for t, (i, c) in got.items()} == {"a": ([1, 2, 7], [3, 5, 1]), "b": ([0], [5])}
    (tmp_path / "bad.pt").write_bytes(b"no")
    with pytest.raises(ConfigError, match=r"bad\.pt: not a counts file"):
        hot.read_counts([tmp_path / "bad.pt"])
    torch.save({"a": 1}, tmp_path / "other.pt")
    with pytest.raises(ConfigError, match="expected format 'dlrmkit-id-counts/1'"):
        hot.read_counts([tmp_path / "other.pt"])
    with pytest.raises(ConfigError, match="no such file"):
        hot.read_counts([tmp_path / "missing"])


def test_a_row_written_is_written_to_its_copy_too():
    index = hot.HotIndex({"a": 10, "b": 5}, {"a": torch.tensor([2, 7])})
    src = torch.arange(12, dtype=torch.uint8).view(3, 4)
    writes = index.expand([("a", torch.tensor([2, 3, 7]), src), ("b", torch.tensor([2]), src[:1])])
    assert [(t, i.tolist(), s.tolist()) for t, i, s in writes] == [
        ("a", [2, 3, 7], src.tolist()),
        ("b", [2], src[:1].tolist()),
        ("a", [10, 11], [src[0].tolist(), src[2].tolist()]),
    ]
    with pytest.raises(ConfigError, match="outside the table"):
        hot.HotIndex({"a": 10}, {"a": torch.tensor([10])})
    with pytest.raises(ConfigError, match="ascending id order without repeats"):
        hot.HotIndex({"a": 10}, {"a": torch.tensor([1, 1])})


def test_warm_reads_the_hot_pages_and_locks_them_where_it_may(tmp_path):
    path = tmp_path / "rows.bin"
    path.write_bytes(bytes(64 * mmap.PAGESIZE))
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        table = torch.frombuffer(mapped, dtype=torch.uint8).view(-1, 128)
    region = table[100:300]  # 200 rows of 128 bytes from byte 12,800: pages 3..9
    got = hot.warm([region], lock=False)
    assert got["bytes"] == 7 * mmap.PAGESIZE and not got["locked"] and "private mapping" in got["why_not_locked"]
    got = hot.warm([region], lock=True)
    # root (CI) may lock any amount; elsewhere RLIMIT_MEMLOCK decides, and the reason is said
    assert got["locked"] or "RLIMIT_MEMLOCK" in got["why_not_locked"]
    # read with read-ahead (MADV_SEQUENTIAL), then given back the mapping's own advice: a
    # MADV_RANDOM mapping's hot pages stay random for the lookups' faults ("rr" in smaps' VmFlags)
    mapped.madvise(mmap.MADV_RANDOM)
    hot.warm([region], lock=False, advice_after=mmap.MADV_RANDOM)
    assert vm_flags(region.data_ptr()) & {"rr", "sr"} == {"rr"}
    hot.warm([region], lock=False)
    assert not vm_flags(region.data_ptr()) & {"rr", "sr"}


def test_warm_maps_the_hot_rows_on_2mib_pages_where_the_kernel_may(tmp_path, monkeypatch):
    path = tmp_path / "rows.bin"
    path.write_bytes(bytes(8 << 20))
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # read anew by the warm-up, not left from the write
    try:
        mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        table = torch.frombuffer(mapped, dtype=torch.uint8).view(-1, 128)
    region = table[8192:57344]  # bytes 1 MiB .. 7 MiB: two whole 2 MiB blocks inside
    assert hot.huge_pages(), "this kernel has transparent huge pages off: the test needs them"
    got = hot.warm([region], lock=False, advice_after=mmap.MADV_RANDOM)
    # MADV_HUGEPAGE kept ("hg"), the blocks read and mapped 2 MiB a page-table entry (ext4, Linux >= 6.16)
    assert {"hg", "rr"} <= vm_flags(region.data_ptr())
    assert got["huge_bytes"] >= 4 << 20 and "MiB on 2 MiB pages" in hot.lock_said(got)
    # without transparent huge pages: small pages, asked for at once (MADV_WILLNEED), as before
    monkeypatch.setattr(hot, "huge_pages", lambda root=None: False)
    other = table[:8]
    got = hot.warm([other], lock=False)
    assert got["huge_bytes"] == 0 and "hg" not in vm_flags(other.data_ptr())


def test_huge_pages_reads_the_kernels_choice(tmp_path):
    for text, want in (
        ("always [madvise] never", True),
        ("[always] madvise never", True),
        ("always madvise [never]", False),
    ):
        (tmp_path / "enabled").write_text(text + "\n")
        assert hot.huge_pages(tmp_path) is want
    assert hot.huge_pages(tmp_path / "absent") is False


def vm_flags(address: int) -> set[str]:
    """The VmFlags /proc/self/smaps gives the mapping holding ``address``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_the_counter_writes_what_it_sampled(tmp_path):
    config = tiny_config()
    counter = hot.IdCounter(tmp_path / "counts", every=2, flush_s=3600)
    batches = [skewed_batch(config, n=8, seed=s)[1] for s in range(6)]
    for kjt in batches:
        counter.observe(kjt)
    counter.close()
    got = hot.read_counts([tmp_path / "counts"])
    want = hot.merge(counts_of(config, kjt) for kjt in batches[1::2])  # every second forward
    assert set(got) == set(want)
    for t in want:
        assert torch.equal(got[t][0], want[t][0]) and torch.equal(got[t][1], want[t][1]), t


def test_build_big_packs_from_counts_and_the_worker_serves_it_warm(tmp_path):
    from scripts import build_big

    from dlrmkit.protocols import open_request
    from dlrmkit.worker import Worker, read_model_dir

    config = tiny_config(num_embeddings=ROWS)
    hot.write_counts(tmp_path / "counts.pt", counts_of(config, skewed_batch(config, n=256, seed=2)[1]))
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({"handler": {**TINY, "num_embeddings": ROWS}}))
    packed, plain = tmp_path / "store" / "packed", tmp_path / "store" / "plain"
    args = ["--config", str(cfg), "--dtype", "int8"]
    result = build_big.main(
        [*args, "--out", str(packed), "--hot-counts", str(tmp_path / "counts.pt"), "--hot-mib", "1"]
    )
    assert result["hot_rows"] > 0
    assert build_big.main([*args, "--out", str(plain)])["hot_rows"] == 0
    with pytest.raises(SystemExit, match="--hot-mib: expected a positive number"):
        build_big.main(
            [*args, "--out", str(tmp_path / "x"), "--hot-counts", str(tmp_path / "counts.pt"), "--hot-mib", "0"]
        )

    dense, kjt = skewed_batch(config, n=8, seed=11)
    bodies = bodies_of(config, dense, kjt)
    answers = {}
    for name, where in (("packed", packed), ("plain", plain)):
        w = Worker()
        manifest, model_yaml = read_model_dir(where)
        w.load(where, manifest, model_yaml)
        try:
            if name == "packed":
                assert w.hot is not None and w.warmed is not None and w.warmed["bytes"] > 0
            else:
                assert w.hot is None
            data, _ = w.score([open_request(b, False, None, w.parser, w.model_id, "application/json") for b in bodies])
            assert not data.errors, data.errors
            answers[name] = [data.scores[i] for i in range(len(bodies))]
        finally:
            w.close()
    assert answers["packed"] == answers["plain"]


def resident(addr: int, length: int) -> list[bool]:
    """mincore: which pages of [addr, addr + length) are in the page cache (addr page-aligned)."""
    import ctypes

    pages = (length + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * pages)()
    assert hot._libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(length), vec) == 0
    return [bool(b & 1) for b in vec]


@pytest.mark.parametrize("call", ["process_madvise", "madvise"])
def test_prefetch_asks_for_exactly_the_pages_a_forward_reads_and_they_arrive(tmp_path, monkeypatch, call):
    import os

    if call == "madvise":  # process_madvise refused (a seccomp profile, an old kernel): a madvise call a page
        monkeypatch.setattr(hot, "_pidfd", (os.getpid(), -1))
    from helpers import wait_until

    config = tiny_config(
        embedding_dtype="int8", num_embeddings=[40_000, 30, 40], embedding_dim=64, dense_arch_layer_sizes=[16, 64]
    )
    path = build(tmp_path, config)
    model = DLRMFactory(config).load(path)
    qebc = model.sparse_arch.embedding_bag_collection
    rows = dict(zip(config.sparse_features, config.num_embeddings))
    prefetch = hot.Prefetch(qebc, rows, min_bytes=1 << 20)
    assert list(prefetch.tables) == ["feature_0"]  # 40,000 rows x 80 bytes; the small tables stay cached
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    table = fused_tables(qebc)[f"{TABLES}feature_0.weight"]
    ids = torch.tensor([5, 6, 20_000, 39_999, 12_345])
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    kjt = KeyedJaggedTensor(
        keys=list(config.sparse_features),
        values=torch.cat([ids, torch.tensor([1, 2])]),
        lengths=torch.tensor([5, 1, 1]),
    )
    start = table.data_ptr()
    lo = start - start % mmap.PAGESIZE
    want = sorted(
        {(start + int(i) * table.stride(0) + d) // mmap.PAGESIZE for i in ids for d in (0, table.shape[1] - 1)}
    )
    before = resident(lo, table.numel() + (start - lo))
    assert sum(before) < len(before) // 2  # dropped
    assert prefetch(kjt) == len(want)
    first = lo // mmap.PAGESIZE
    got = wait_until(
        lambda: resident(lo, table.numel() + (start - lo)), lambda r: all(r[p - first] for p in want), timeout=30
    )
    assert all(got[p - first] for p in want)


def test_live_deltas_write_the_hot_copies_too_in_the_worker_and_in_the_writer_process(tmp_path):
    """A packed model under live updates scores as the unpacked model under the same deltas: the
    catch-up at start writes in the worker; later deltas, in the writer process, which learns the
    hot rows from a file beside the shared sides."""
    from dlrmkit.live import DeltaApplier, base_version, target_for, write_delta
    from helpers import wait_until

    config = tiny_config(embedding_dtype="int8", num_embeddings=ROWS)
    rows = dict(zip(config.sparse_features, config.num_embeddings))
    # rows 0-9 of every table are the hot ones (and some others): the deltas below write them
    counts = {t: (torch.arange(0, n, 3), torch.full((len(range(0, n, 3)),), 5)) for t, n in rows.items()}
    counts = hot.merge([counts, {t: (torch.arange(10), torch.full((10,), 100)) for t in rows}])
    chosen = hot.choose(counts, rows, stream.row_bytes(config), 1 << 20)
    appliers = {}
    for name, pack in (("plain", None), ("packed", chosen)):
        where = tmp_path / name
        where.mkdir()
        path = build(where, config, pack)
        factory = DLRMFactory(config)
        model = factory.load(path)
        target = target_for(config, factory, "dlrm", base_version(path))
        appliers[name] = DeltaApplier(model, config, factory, where / "deltas", target, state_dir=where)
    gen = torch.Generator().manual_seed(4)

    def delta(seq):
        tables = {t: (torch.tensor([0, 3, 7, n - 1]), torch.rand(4, 8, generator=gen) * 2 - 1) for t, n in rows.items()}
        for app in appliers.values():
            write_delta(app.directory, "dlrm", app.target.base, seq, tables)

    dense, kjt = skewed_batch(config, n=64, seed=3)
    index = appliers["packed"].model.hot_index
    assert index is not None and appliers["packed"].hot is index

    def scores():
        return logits(appliers["plain"].model, dense, kjt), logits(appliers["packed"].model, dense, index.redirect(kjt))

    before = scores()
    delta(1)
    for app in appliers.values():
        assert app.catch_up() == 1
    plain, packed = scores()
    assert not torch.equal(plain, before[0]) and torch.equal(packed, plain)
    for app in appliers.values():
        app.poll_s = 0.02
        app.start()
    try:
        delta(2)
        for app in appliers.values():
            wait_until(lambda app=app: app.applied, lambda s: s == 2)
            assert app.catch_up() in (0, 1)  # flipped to the side the writer process wrote
        plain, packed = scores()
        assert appliers["packed"].rows_applied > 0 and torch.equal(packed, plain)
    finally:
        for app in appliers.values():
            app.stop()


# --- sizing a packed model (scripts/sizing.py --counts) and counting a sample (scripts/count_ids.py) -------


def zipf_counts(rows: int, s: float, draws: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts of ``draws`` lookups of a table whose row of rank i is looked up in proportion to
    i^-s, the ranks scattered over the ids (hashed ids)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    p = np.arange(1, rows + 1, dtype=np.float64) ** -s
    ids = rng.permutation(rows)[rng.choice(rows, size=draws, p=p / p.sum())]
    unique, n = np.unique(ids, return_counts=True)
    return torch.from_numpy(unique), torch.from_numpy(n)


def test_the_exponent_fitted_to_counts_of_a_known_zipf_law():
    from scripts.sizing import fit_zipf

    for s in (0.8, 1.05, 1.3):
        _, n = zipf_counts(1_000_000, s, 2_000_000, seed=int(s * 100))
        fit = fit_zipf(n.numpy())
        assert abs(fit["s"] - s) < 0.1, (s, fit)
        assert fit["ranks"][0] == 1 and 100 < fit["ranks"][1] < 100_000 and fit["lookups"] == 2_000_000
    assert fit_zipf(torch.tensor([40, 30, 3, 1]).numpy())["s"] is None  # too few dense ranks


def test_sizing_with_counts_fits_each_table_and_says_what_a_hot_set_buys(tmp_path):
    """--counts: the fitted exponent beside the assumed one, the hot rows packed in fewer bytes than
    scattered, and each --hot-mib's share of the counted lookups as build_big would choose them."""
    from scripts import sizing

    big, small = zipf_counts(1_000_000, 1.05, 2_000_000, seed=7), zipf_counts(3000, 1.3, 1000, seed=8)
    hot.write_counts(tmp_path / "c.pt", {"feature_0": big, "feature_2": small}, source="test")
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({"handler": {**TINY, "num_embeddings": [1_000_000, 30, 3000]}}))
    args = ["--config", str(cfg), "--memory", "1GiB", "--cpus", "1", "--dtype", "int8", "--json"]
    rep = sizing.main([*args, "--counts", str(tmp_path / "c.pt"), "--hot-mib", "1", "4"])
    tables = {t["name"]: t for t in rep["hot"]["tables"]}
    assert (
        abs(tables["feature_0"]["s_counts"] - 1.05) < 0.1
        and tables["feature_0"]["s"] == tables["feature_0"]["s_counts"]
    )
    assert tables["feature_1"]["s_counts"] is None and tables["feature_1"]["s"] == 1.05  # no counts: assumed
    row = rep["hot"]["row_bytes"]
    assert row == stream.row_bytes(tiny_config(embedding_dtype="int8"))
    t = tables["feature_0"]
    assert t["hot_rows"] == sizing.hot_rows(1_000_000, t["s"], 0.9)
    assert t["packed_bytes"] == -(-t["hot_rows"] * row // 4096) * 4096 < t["scattered_bytes"]
    for d in rep["dtypes"].values():
        assert d["packed_bytes"] < d["working_set_bytes"]
    # the counts' share: the top rows of both tables (rows counted once never), over every counted lookup
    total = int(big[1].sum() + small[1].sum())
    ranked = torch.sort(torch.cat([big[1], small[1]]), descending=True).values
    shares = [b["hit_rate_counts"] for b in rep["hot"]["budgets"]]
    for b, mib in zip(rep["hot"]["budgets"], (1, 4)):
        assert b["rows_counted"] == min(len(ranked), (mib << 20) // row)
        assert b["hit_rate_counts"] == round(int(ranked[: b["rows_counted"]].sum()) / total, 4)
    assert shares[0] < shares[1] and 0 < rep["hot"]["budgets"][0]["hit_rate_zipf"] < 1
    # without counts the assumed exponent and today's working set stand
    plain = sizing.main(args)
    assert plain["hot"]["tables"][0]["s"] == 1.05 and plain["hot"]["budgets"] == []
    assert plain["dtypes"]["int8"]["working_set_bytes"] == sum(
        sizing.working_set(r, row, 1.05, 0.9) for r in (1_000_000, 30, 3000)
    )


def test_the_zipf_share_of_a_budget_matches_the_brute_force_choice():
    from scripts.sizing import zipf_budget_hit_rate

    tables = [(500, 1.1, 3.0), (80, 0.7, 1.0), (40, 1.5, 0.0)]  # rows, s, share of lookups
    probs = []
    for k, (rows, s, w) in enumerate(tables):
        z = sum(i**-s for i in range(1, rows + 1))
        probs += [(w / 4.0 * i**-s / z, k) for i in range(1, rows + 1)]
    probs.sort(reverse=True)
    for budget in (1, 37, 200, 579, 1000):
        ks, hit = zipf_budget_hit_rate(tables, budget)
        taken = probs[:budget]
        assert ks == [sum(1 for _, k in taken if k == j) if tables[j][2] else 0 for j in range(3)], budget
        assert hit == pytest.approx(sum(p for p, _ in taken), abs=1e-9)


CRITEO_LINES = [
    # label, 13 integers, 26 hex ids (an empty field is 0)
    "1\t" + "\t".join(["1"] * 13) + "\t" + "\t".join(["0a"] * 25 + ["ff"]),
    "\t".join(["2"] * 13) + "\t" + "\t".join(["3e8"] + [""] * 25),  # no label; 0x3e8 = 1000
    "0\t" + "\t".join([""] * 13) + "\t" + "\t".join(["0a"] * 26),
]


def criteo_config(tmp_path, **changes):
    doc = yaml.safe_load((ROOT / "model-config.criteo.yaml").read_text())
    doc["handler"].update({"num_embeddings": [300] * 26, **changes})
    path = tmp_path / "criteo.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_count_ids_counts_criteo_lines_as_the_handler_reads_them(tmp_path):
    from scripts import count_ids

    cfg = criteo_config(tmp_path)  # id_overflow: modulo, 300 rows per table
    (tmp_path / "day.tsv").write_text("\n".join(CRITEO_LINES) + "\n")
    out = tmp_path / "counts.pt"
    got = count_ids.main(["--config", str(cfg), "--criteo", str(tmp_path / "day.tsv"), "--out", str(out)])
    assert got["lines"] == 3 and got["lookups"] == 78
    counts = hot.read_counts([out])
    as_dict = {t: dict(zip(i.tolist(), c.tolist())) for t, (i, c) in counts.items()}
    assert as_dict["cat_0"] == {10: 2, 1000 % 300: 1}  # 0x0a twice; 0x3e8 folded
    assert as_dict["cat_25"] == {255: 1, 0: 1, 10: 1}  # 0xff, empty = 0, 0x0a
    for t in [f"cat_{k}" for k in range(1, 25)]:
        assert as_dict[t] == {10: 2, 0: 1}, t
    doc = torch.load(out, weights_only=True)
    assert doc["format"] == "dlrmkit-id-counts/1" and "day.tsv" in doc["source"]
    # --limit: the first lines only
    got = count_ids.main(
        ["--config", str(cfg), "--criteo", str(tmp_path / "day.tsv"), "--limit", "1", "--out", str(out)]
    )
    assert got["lines"] == 1 and got["lookups"] == 26

    bad = [*CRITEO_LINES[:2], CRITEO_LINES[2].replace("0a", "zz", 1)]
    (tmp_path / "bad.tsv").write_text("\n".join(bad) + "\n")
    with pytest.raises(SystemExit, match=r"bad\.tsv: line 3, field 15 \(cat_0\): expected hex digits, got 'zz'"):
        count_ids.main(["--config", str(cfg), "--criteo", str(tmp_path / "bad.tsv"), "--out", str(tmp_path / "x.pt")])
    strict = criteo_config(tmp_path, id_overflow="error")
    with pytest.raises(SystemExit, match=r"line 2 \(cat_0\): id 1000 is out of range for table 'cat_0' of 300 rows"):
        count_ids.main(
            ["--config", str(strict), "--criteo", str(tmp_path / "day.tsv"), "--out", str(tmp_path / "x.pt")]
        )
    assert not (tmp_path / "x.pt").exists()
    with pytest.raises(SystemExit, match="does not take Criteo lines"):
        count_ids.main(["--criteo", str(tmp_path / "day.tsv"), "--out", str(tmp_path / "x.pt")])


def test_count_ids_counts_json_request_bodies_as_the_handler_parses_them(tmp_path):
    import json

    from scripts import count_ids

    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({"handler": {**TINY, "id_overflow": "modulo"}}))  # rows 20, 30, 40
    bodies = [
        {"dense": [0.0] * 5, "sparse": {"keys": ["feature_1", "feature_0"], "values": [7, 3, 4], "lengths": [1, 2]}},
        {
            "instances": [
                {"dense": [0.0] * 5, "sparse": {"keys": ["feature_0"], "values": [3], "lengths": [1]}},
                {"dense": [0.0] * 5, "sparse": {"keys": ["feature_2"], "values": [45, 5], "lengths": [2]}},
            ]
        },
        {
            "context": {"dense": [0.0] * 5, "sparse": {"keys": ["feature_0"], "values": [4], "lengths": [1]}},
            "columns": {"sparse": {"feature_1": {"values": [7, 8]}}},
        },
    ]
    lines = [json.dumps(b) for b in bodies]
    (tmp_path / "req.jsonl").write_text(lines[0] + "\n\n" + "\n".join(lines[1:]) + "\n")
    out = tmp_path / "counts.pt"
    got = count_ids.main(["--config", str(cfg), "--requests", str(tmp_path / "req.jsonl"), "--out", str(out)])
    assert got["lines"] == 3
    as_dict = {t: dict(zip(i.tolist(), c.tolist())) for t, (i, c) in hot.read_counts([out]).items()}
    # feature_0: 3, 4 | 3 | the context's 4 once per row (2 rows); feature_2: 45 % 40 = 5, and 5
    assert as_dict == {"feature_0": {3: 2, 4: 3}, "feature_1": {7: 2, 8: 1}, "feature_2": {5: 2}}

    (tmp_path / "bad.jsonl").write_text(lines[0] + "\n\n" + '{"dense": [0.0]}\n')
    with pytest.raises(SystemExit, match=r"bad\.jsonl: line 3: sparse: required field is missing"):
        count_ids.main(["--config", str(cfg), "--requests", str(tmp_path / "bad.jsonl"), "--out", str(out)])
    cfg.write_text(yaml.safe_dump({"handler": TINY}))  # id_overflow: error
    with pytest.raises(
        SystemExit, match=r"req\.jsonl: line 3: instances\[1\]\.sparse\.values\[0\]: id 45 is out of range"
    ):
        count_ids.main(["--config", str(cfg), "--requests", str(tmp_path / "req.jsonl"), "--out", str(out)])


def test_repack_copies_the_rows_and_packs_them_from_new_counts(tmp_path):
    from scripts import build_big

    config = tiny_config(embedding_dtype="int4", num_embeddings=ROWS)
    rows = dict(zip(config.sparse_features, config.num_embeddings))
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({"handler": {**TINY, "num_embeddings": ROWS}}))
    old_counts = {t: (torch.arange(5), torch.full((5,), 9)) for t in rows}
    new_counts = {t: (torch.arange(n - 7, n), torch.full((7,), 9)) for t, n in rows.items()}
    hot.write_counts(tmp_path / "old.pt", old_counts)
    hot.write_counts(tmp_path / "new.pt", new_counts)
    first, second = tmp_path / "store" / "first", tmp_path / "store" / "second"
    build_big.main(
        ["--config", str(cfg), "--dtype", "int4", "--hot-counts", str(tmp_path / "old.pt"), "--out", str(first)]
    )
    with pytest.raises(SystemExit, match="--repack takes the model's own config"):
        build_big.main(["--repack", str(first), "--dtype", "int8", "--out", str(second)])
    result = build_big.main(["--repack", str(first), "--hot-counts", str(tmp_path / "new.pt"), "--out", str(second)])
    assert "byte for byte" in result["source"] and result["hot_rows"] == 21
    a = torch.load(first / "dlrm.pt", mmap=True, weights_only=True)
    b = torch.load(second / "dlrm.pt", mmap=True, weights_only=True)
    for t, n in rows.items():
        key = f"{TABLES}{t}.weight"
        assert torch.equal(a[key][:n], b[key][:n])  # every row as it was
        assert b[f"{hot.HOT}{t}"].tolist() == list(range(n - 7, n))  # the new hot set
        assert torch.equal(b[key][n:], b[key][n - 7 : n])  # and its copies
    for k in a:
        if not k.startswith((TABLES, hot.HOT)):
            assert torch.equal(a[k], b[k]), k
    dense, kjt = skewed_batch(config, n=32, seed=8)
    m1, m2 = DLRMFactory(config).load(first / "dlrm.pt"), DLRMFactory(config).load(second / "dlrm.pt")
    assert torch.equal(logits(m1, dense, m1.hot_index.redirect(kjt)), logits(m2, dense, m2.hot_index.redirect(kjt)))


def test_memory_room_is_free_memory_capped_by_the_cgroup_limit(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 24000000 kB\nMemFree: 1000 kB\nMemAvailable: 9000000 kB\n")
    assert hot.memory_room(meminfo, tmp_path / "none") == 1000 * 1024  # free, not available: the cache counts
    meminfo.write_text("MemFree: 8000000 kB\n")
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text("4294967296\n")
    (v2 / "memory.current").write_text(str(3 << 30))
    assert hot.memory_room(meminfo, v2) == 1 << 30
    (v2 / "memory.max").write_text("max\n")
    assert hot.memory_room(meminfo, v2) == 8000000 * 1024
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text(str(8 << 30))
    (v1 / "memory" / "memory.usage_in_bytes").write_text(str(6 << 30))
    assert hot.memory_room(meminfo, v1) == 2 << 30


def test_fill_reads_the_busiest_table_first_until_the_floor_and_one_worker_fills(tmp_path):
    path = tmp_path / "weights"
    path.write_bytes(bytes(6 << 20))

    class Asked:
        asked = {"b": 10}

    regions = {"a": (0, 2 << 20), "b": (2 << 20, 3 << 20)}
    fill = hot.Fill(str(path), regions, Asked(), floor=0, chunk=1 << 20, rate=1 << 40)
    fill.start()
    assert fill.wait(30)
    assert fill.read == 5 << 20 and fill.stopped_by == "every table read"
    assert fill.order == ["b", "b", "b", "a", "a"]  # b: asked for most per byte
    counted = hot.Fill(str(path), regions, Asked(), floor=0, chunk=1 << 20, rate=1 << 40, cold={"a": 100, "b": 1})
    counted.start()
    assert counted.wait(30) and counted.order == ["a", "a", "b", "b", "b"]  # the build's counts decide
    full = hot.Fill(str(path), regions, Asked(), floor=1 << 60)
    full.start()
    assert full.wait(30) and full.read == 0 and full.stopped_by.startswith("memory left at the floor")
    import fcntl
    import os

    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another worker's reader holds it
        other = hot.Fill(str(path), regions, Asked(), floor=0)
        other.start()
        assert other.wait(30) and other.read == 0 and other.stopped_by == "another worker fills"
    finally:
        os.close(fd)


def test_a_worker_of_tables_larger_than_memory_locks_prefetches_and_fills(tmp_path, monkeypatch):
    """The read-only path (forced as tests/test_delta.py forces it): the hot rows locked (root) or
    the reason said, the large table's pages prefetched and its rows read into the cache once the
    worker is ready, the scores those of the unpacked model."""

    from scripts import build_big

    from dlrmkit import scale
    from dlrmkit.protocols import open_request
    from dlrmkit.worker import Worker, read_model_dir

    rows_big = [40_000, 30, 40]
    config = tiny_config(num_embeddings=rows_big)
    hot.write_counts(tmp_path / "counts.pt", counts_of(config, skewed_batch(config, n=256, seed=2)[1]))
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({"handler": {**TINY, "num_embeddings": rows_big}}))
    packed = tmp_path / "store" / "packed"
    build_big.main(
        ["--config", str(cfg), "--dtype", "int8", "--out", str(packed), "--hot-counts", str(tmp_path / "counts.pt")]
    )
    refuse_mmap(monkeypatch)
    monkeypatch.setattr(hot, "memory_room", lambda: 1 << 50)  # whatever this machine's cache holds now
    monkeypatch.setattr(hot, "PREFETCH_MIN_BYTES", 256 << 10)  # feature_0: 40,000 rows x 16 bytes
    monkeypatch.setattr(scale, "_MAPPINGS", [])
    w = Worker()
    w.load(packed, *read_model_dir(packed))
    try:
        assert scale.mapped_read_only() and w.hot is not None and w.warmed is not None
        assert scale.mapped_advice() == mmap.MADV_RANDOM  # what warm() put back on the hot regions
        assert w.warmed["locked"] or "RLIMIT_MEMLOCK" in w.warmed["why_not_locked"]
        assert w.prefetch is not None and list(w.prefetch.tables) == ["feature_0"]
        assert w.small is not None and w.small["bytes"] > 0  # feature_1 and feature_2 read whole
        assert w.fill is not None and w.fill.wait(30)
        assert w.fill.stopped_by == "every table read" and w.fill.read == 40_000 * 16
        dense, kjt = skewed_batch(config, n=4, seed=1)
        bodies = bodies_of(config, dense, kjt)
        redirected, redirect = [], w.hot.redirect
        w.hot.redirect = lambda k: redirected.append(k.stride()) or redirect(k)
        data, _ = w.score([open_request(b, False, None, w.parser, w.model_id, "application/json") for b in bodies])
        assert not data.errors and w.prefetch.asked.get("feature_0", 0) > 0, (w.prefetch.asked, bodies[0])
        assert redirected == [4]  # the forward's rows redirected (then prefetched) as it was scored
        plain = DLRMFactory(config.with_changes(embedding_dtype="int8"))
        monkeypatch.undo()
        model = plain.load(packed / "dlrm.pt")
        from dlrmkit.batch import collate, scores

        want = [scores(model, collate([w.parser.parse(b)], w.config)[0], w.config)[0] for b in bodies]
        # the worker's own threads and frozen dense half: equal to float rounding
        assert max(abs(a - b) for i in range(4) for a, b in zip(data.scores[i], want[i])) < 1e-6
    finally:
        w.close()


def test_file_mappings_say_where_a_mapped_tensor_lies_in_its_file(tmp_path):
    from dlrmkit.scale import file_mappings

    path = tmp_path / "w.pt"
    torch.save({"t": torch.arange(100_000, dtype=torch.int64)}, path)
    t = torch.load(path, mmap=True, weights_only=True)["t"]  # torch's copy-on-write mapping
    (start, end, offset), *_ = [m for m in file_mappings(path) if m[0] <= t.data_ptr() < m[1]]
    at = t.data_ptr() - start + offset
    with open(path, "rb") as f:
        f.seek(at + 8 * 777)
        assert int.from_bytes(f.read(8), "little") == 777
