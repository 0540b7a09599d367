"""The measuring library (bench/common.py, bench/mlperf.py) and the Server scenario under LoadGen.

Unit: config overlays, report writing, the rate search on fake verdicts, LoadGen's summary as
LoadGen itself writes it (a fake system under test in this process), the request bodies against
the kit's own parser; bench/bigtables.py's queries, the workers' "hot rows" line it reads, the
unpacked twin of a packed model directory, its ratios and report on fake figures. Integration:
bench/server_scenario.py end to end, a few seconds per rate, against a real TorchServe serving the
tiny seed config.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import ROOT, TINY, FakeContext, tiny_config, variant

from bench import bigtables, common
from bench import mlperf
from bench import server_scenario


def test_overlay_sends_each_key_where_it_belongs():
    doc = {"batchSize": 64, "handler": {"seed": 0}}
    items = {"handler.dense_precision": "int8", "workers": 1, "OMP_NUM_THREADS": 2, "maxBatchDelay": 5}
    got, env = common.overlay(doc, items)
    assert got == {
        "batchSize": 64,
        "handler": {"seed": 0, "dense_precision": "int8"},
        "maxBatchDelay": 5,
        "minWorkers": 1,
        "maxWorkers": 1,
    }
    assert env == {"OMP_NUM_THREADS": "2"}
    assert doc == {"batchSize": 64, "handler": {"seed": 0}}  # the caller's document is left alone


def test_parse_variant():
    assert common.parse_variant("int8:handler.dense_precision=int8,batchSize=1") == (
        "int8",
        {"handler.dense_precision": "int8", "batchSize": 1},
    )
    assert common.parse_variant("fp32:") == ("fp32", {})


def test_write_report_writes_json_md_and_the_plot(tmp_path):
    def plot(report, path):
        path.write_bytes(b"png of " + json.dumps(report).encode())

    common.write_report(tmp_path / "r", {"rows": [1, 2], "wall_s": 3}, ["| a |", "|---|"], plot)
    assert json.loads((tmp_path / "r.json").read_text()) == {"rows": [1, 2], "wall_s": 3}
    assert (tmp_path / "r.md").read_text() == "| a |\n|---|\n"
    assert (tmp_path / "r.png").read_bytes().startswith(b"png of ")


def test_write_report_without_matplotlib_skips_only_the_plot(tmp_path):
    def plot(report, path):
        raise ImportError("no matplotlib")

    common.write_report(tmp_path / "r", {"wall_s": 0}, ["x"], plot)
    assert (tmp_path / "r.json").exists() and (tmp_path / "r.md").exists()
    assert not (tmp_path / "r.png").exists()


def fake_sut(threshold: float, noise: dict | None = None):
    """A run that passes below ``threshold`` q/s (``noise``: rates whose verdict is flipped)."""

    def run_at(rate):
        ok = rate <= threshold
        return {"ok": ok != (rate in (noise or {})), "p99_ms": 30.0 if ok else 200.0 * rate / threshold}

    return run_at


@pytest.mark.parametrize("threshold", [0.7, 23.0, 400.0])
def test_search_brackets_the_highest_passing_rate(threshold):
    found = mlperf.search(fake_sut(threshold), start=20.0, steps=12, tol=1.05)
    best = found["best"]["target_qps"]
    failed_above = min(r["target_qps"] for r in found["runs"] if not r["ok"])
    assert best <= threshold < failed_above <= best * 1.05


def test_search_with_a_noisy_failure_reports_the_best_run_that_passed():
    found = mlperf.search(fake_sut(23.0, noise={40.0 / 2**0.5}), start=20.0, steps=7)
    best = found["best"]
    assert best["ok"] and best["target_qps"] == max(r["target_qps"] for r in found["runs"] if r["ok"])


def test_search_stops_when_a_lower_rate_no_longer_lowers_p99():
    found = mlperf.search(lambda rate: {"ok": False, "p99_ms": 300.0 + rate}, start=8.0, steps=7)
    assert found["best"] is None
    assert [r["target_qps"] for r in found["runs"]] == [8.0, 4.0]
    assert "no longer lowers p99" in found["runs"][-1]["note"]


def test_search_gives_up_below_the_floor():
    found = mlperf.search(lambda rate: {"ok": False, "p99_ms": 1000.0 * rate}, start=0.4, steps=9, floor=0.1)
    assert found["best"] is None and [r["target_qps"] for r in found["runs"]] == [0.4, 0.2, 0.1]


def loadgen_summary(tmp_path, latency_s: float, qps: float = 200.0) -> str:
    """A real LoadGen Server run in this process against a SUT that answers after ``latency_s``."""
    import mlperf_loadgen as lg

    def issue(samples):
        for s in samples:
            t = threading.Timer(latency_s, lg.QuerySamplesComplete, [[lg.QuerySampleResponse(s.id, 0, 0)]])
            t.start()

    sut = lg.ConstructSUT(issue, lambda: None)
    qsl = lg.ConstructQSL(8, 8, lambda s: None, lambda s: None)
    log = lg.LogSettings()
    log.log_output.outdir = str(tmp_path)
    log.log_output.copy_summary_to_stdout = False
    lg.StartTestWithLogSettings(sut, qsl, mlperf.settings(qps, 1.0, 100, 10.0), log)
    lg.DestroyQSL(qsl)
    lg.DestroySUT(sut)
    time.sleep(latency_s)  # the last timers
    return (tmp_path / "mlperf_log_summary.txt").read_text()


def test_parse_summary_of_a_fast_sut_is_valid_under_the_bound(tmp_path):
    got = mlperf.parse_summary(loadgen_summary(tmp_path, 0.002, qps=500.0))
    assert got["valid"] and "unsatisfied" not in got
    assert 2 <= got["p50_ms"] <= got["p99_ms"] < mlperf.P99_BOUND_MS
    assert got["scheduled_qps"] > 0 and got["completed_qps"] > 0


def test_parse_summary_of_a_slow_sut_is_invalid_and_says_why(tmp_path):
    got = mlperf.parse_summary(loadgen_summary(tmp_path, 0.08))
    assert not got["valid"] and "Performance constraints" in got["unsatisfied"]
    assert got["p99_ms"] >= 80


def test_parse_summary_refuses_other_text():
    with pytest.raises(ValueError, match="not a LoadGen summary"):
        mlperf.parse_summary("99.00 percentile latency (ns) : 5\n")


def test_request_bodies_parse_with_the_kits_parser():
    from dlrmkit.forms import RequestParser

    cfg = tiny_config(max_instances_per_request=1024, max_ids_per_request=1 << 16)
    parser, rng = RequestParser(cfg), random.Random(0)
    for kind in (1, 128, common.RANKING, common.COLUMNS, common.COLUMNS_ALL):
        assert parser.parse(common.make_kind(kind, cfg, rng)) is not None, kind
    pool = mlperf.query_pool(cfg, 20)
    assert all(mlperf.PAIRS[0] <= q.pairs <= mlperf.PAIRS[1] and q.parts == () for q in pool)
    for n, body, *_ in pool[:3]:
        assert len(json.loads(body)["columns"]["dense"]) == n
        parser.parse(body)


def test_a_v2_binary_query_carries_the_same_pairs_as_its_columns_twin():
    """The Server scenario's binary form: the same draws as the `columns` query of the same seed,
    as OIP v2 tensors (INT32 ids and lengths) the kit's v2 parser reads to the same rows."""
    from dlrmkit.batch import collate
    from dlrmkit.forms import RequestParser
    from dlrmkit.protocols import OIPv2

    cfg = tiny_config(**variant("dcn"), max_instances_per_request=1024, max_ids_per_request=1 << 16)
    bags = [1, 3, 2][: cfg.num_features] + [1] * max(0, cfg.num_features - 3)
    as_json = mlperf.make_query(cfg, random.Random(4), 120, bags)
    binary = mlperf.make_query(cfg, random.Random(4), 120, bags, "v2-binary")
    assert binary.pairs == as_json.pairs == 120 and mlperf.path("v2-binary", "m") == "/v2/models/m/infer"
    want = collate([RequestParser(cfg).parse(as_json.body)], cfg)[0]
    header = int(binary.headers[mlperf.BINARY_HEADER])
    got = collate([OIPv2(binary.body, RequestParser(cfg), header, ("m", "1")).parse()], cfg)[0]
    import torch

    assert torch.equal(got.dense, want.dense) and torch.equal(got.sparse.values(), want.sparse.values())
    assert torch.equal(got.sparse.lengths(), want.sparse.lengths())


@pytest.mark.parametrize("form", mlperf.FORMS)
def test_a_split_query_carries_its_rows_in_order_in_nearly_equal_parts(form):
    """``split``: a query of more pairs than that also as ceil(pairs / split) requests, which the
    kit's parsers read to the whole query's rows, in order."""
    import torch

    from dlrmkit.batch import collate
    from dlrmkit.forms import RequestParser
    from dlrmkit.protocols import open_request

    cfg = tiny_config(**variant("dcn"), max_instances_per_request=1024, max_ids_per_request=1 << 16)
    bags = [1, 3, 2][: cfg.num_features] + [1] * max(0, cfg.num_features - 3)

    def batch(body, headers):
        req = open_request(body, form == "v2-binary", headers.get(mlperf.BINARY_HEADER), RequestParser(cfg), ("m", "1"))
        return collate([req.parse()], cfg)[0]

    whole = mlperf.make_query(cfg, random.Random(4), 701, bags, form)
    split = mlperf.make_query(cfg, random.Random(4), 701, bags, form, split=350)
    assert whole.parts == () and (split.pairs, split.body) == (701, whole.body)  # the same draws
    parts = [batch(*p) for p in split.parts]
    assert [p.dense.shape[0] for p in parts] == [233, 234, 234]
    want = batch(whole.body, whole.headers)
    assert torch.equal(torch.cat([p.dense for p in parts]), want.dense)
    for f in cfg.sparse_features:  # each feature's ids: the parts' in order are the whole's
        got = torch.cat([p.sparse[f].values() for p in parts])
        assert torch.equal(got, want.sparse[f].values()), f
    assert mlperf.make_query(cfg, random.Random(4), 350, bags, form, split=350).parts == ()


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_load_served_runs_the_dense_half_the_handler_serves(tmp_path, precision):
    import torch

    from dlrm_handler import TorchRecDLRMHandler
    from dlrmkit.config import DLRMConfig

    cfg_path = tmp_path / "model-config.yaml"
    cfg_path.write_text(yaml.safe_dump({"handler": dict(TINY)}))
    source, doc, _ = common.build_archive(cfg_path, tmp_path / "store", "m", {"handler.dense_precision": precision})
    model_dir = common.unpack(tmp_path / "store" / "m.mar", tmp_path / "m")
    cfg = DLRMConfig.from_yaml(source)
    model, what = common.load_served(cfg, model_dir)
    # dlrmkit.dense.prepare's own line: the precision, or fp32 saying it fell back from it on this CPU
    assert what.startswith(precision) or f"FALLING BACK from {precision}" in what
    # random weights have no training data: an int8 build calibrates on the kit's random rows (static)
    assert (model_dir / "dense-calibration.pt").is_file() == (precision == "int8")
    assert not what.startswith("int8") or what.startswith("int8 static"), what
    handler = TorchRecDLRMHandler()
    handler.initialize(FakeContext(model_dir, doc["handler"]))
    forward = common.raw_caller(cfg, 16, random.Random(1))
    torch.testing.assert_close(forward(model)(), forward(handler.model)(), rtol=0, atol=1e-6)


LARGEST = {
    "pairs": 700,
    "client_ms": 55.0,
    "outside_worker_ms": 9.0,
    "stages_ms": {"parse": 7.0, "collate": 1.0, "lookup": 14.0, "dense": 20.0, "respond": 0.1},
}


def test_next_lever_reads_the_profile():
    cpu = {"frontend": 8.0, "workers": 24.0, "client": 1.0}
    # the largest query alone nearly fills the bound: its largest part is named
    text = server_scenario.next_lever(LARGEST, cpu, 0.9)
    assert text.startswith("the time of one query: the 700-pair query alone takes 55 ms of the 60 ms bound")
    assert "its largest part dense (20 ms)" in text
    # the server already runs it as parts at once (handler.split_rows), or the client sends it as requests
    split = server_scenario.next_lever({**LARGEST, "server_parts": 2}, cpu, 0.9)
    assert "55 ms of the 60 ms bound as 2 parts at once, its largest part dense (20 ms)" in split
    assert split.endswith("no rate can pass while it does: cut dense")
    assert "as 2 requests at once" in server_scenario.next_lever({**LARGEST, "requests": 2}, cpu, 0.9)
    assert text.endswith("split one query's rows across the CPUs, or cut dense")
    slow_frontend = {**LARGEST, "outside_worker_ms": 30.0}
    assert "its largest part frontend and transport (30 ms)" in server_scenario.next_lever(slow_frontend, cpu, 0.9)
    fast = {**LARGEST, "client_ms": 20.0}
    # quick alone, the CPUs busy at the target rate: the biggest CPU share is named
    assert server_scenario.next_lever(fast, cpu, 0.9) == (
        "CPU per query: at the target rate the CPUs would be 90% busy (frontend 8 ms, workers 24 ms, client 1 ms "
        "per query); cut the workers' CPU per query first"
    )
    assert server_scenario.next_lever(fast, {**cpu, "frontend": 30.0}, 0.9).endswith(
        "cut the frontend's CPU per query first"
    )
    # neither: queueing
    assert server_scenario.next_lever(fast, cpu, 0.4).startswith("queueing: one 700-pair query alone takes 20 ms")
    assert "CPUs unknown busy" in server_scenario.next_lever(fast, cpu, None)


def test_target_cpu_takes_the_highest_rate_with_cpu_figures():
    runs = [
        {
            "target_qps": 10,
            "frontend_cpu_us_per_query": 5000,
            "workers_cpu_us_per_query": 20000,
            "client_cpu_us_per_query": 1000,
        },
        {
            "target_qps": 20,
            "frontend_cpu_us_per_query": 6000,
            "workers_cpu_us_per_query": 22000,
            "client_cpu_us_per_query": 2000,
        },
        {"target_qps": 40},  # a worker was replaced meanwhile: no CPU figures
    ]
    row = {
        "runs": runs,
        "cpus": 2,
        "pairs_mean": 250.0,
        "stock_rows_per_s": 7000,
        "host_rows_per_s": 40000,
        "target": {"anchor": "stock", "bound": 2.5},
    }
    cpu, busy = server_scenario.target_cpu(row)
    assert cpu == {"frontend": 6.0, "workers": 22.0, "client": 2.0}
    assert busy == round(0.030 * (2.5 * 7000 / 250) / 2, 3)  # 70 q/s x 30 ms over 2 CPUs
    row["target"] = {"anchor": "host", "bound": 0.6}
    assert server_scenario.target_cpu(row)[1] == round(0.030 * (0.6 * 40000 / 250) / 2, 3)
    assert server_scenario.target_cpu({**row, "target": None})[1] is None
    assert server_scenario.target_cpu({**row, "runs": runs[2:]}) == ({}, None)


def test_dlrmv2_without_amx_is_judged_by_its_rate_and_the_compute_floor():
    runs = [
        {"target_qps": 5.0, "ok": False, "frontend_cpu_us_per_query": 4000, "workers_cpu_us_per_query": 31000}
        | {"client_cpu_us_per_query": 3000},
        {"target_qps": 2.5, "ok": True},
    ]
    row = {
        "runs": runs,
        "valid_qps": 2.5,
        "cpus": 2,
        "pairs_mean": 270.0,
        "host_rows_per_s": 20_000,
        "stock_rows_per_s": 5_000,
        "target": {"anchor": "stock", "bound": 2.5, "ratio": 0.1, "met": False},
        "profile": [{**LARGEST, "client_ms": 47.0}],
    }
    server_scenario.judge(row, "dlrmv2", "avx512_bf16,avx512_vnni,avx512f,avx2")
    assert row["rate_target"] == {"qps": 5.0, "met": False}
    # the largest query alone: 47 ms against its 700 pairs' 35 ms at the raw forward
    assert row["floor"] == [
        {"qps": 5.0, "p99_ms": 40.5, "over_ms": 12.0, "busy_with_over": 0.13, "p99_with_over_ms": 74.2}
    ]
    assert row["busy_at_target"] == round(0.038 * 5.0 / 2, 3)  # the rate target's CPU, not the AMX target's
    assert row["next_lever"].startswith("the server's time over the compute floor: the 700-pair query alone took 12 ms")
    text = "\n".join(server_scenario.target_lines([{**row, "config": "model-config.dlrmv2.yaml", "variant": "int8"}]))
    assert "Target (model-config.dlrmv2.yaml, int8, a host without AMX): VALID at >= 5 q/s" in text
    assert "missed (highest VALID rate 2.5); the compute floor allows it (p99 40.5 ms at 5 q/s" in text
    assert "(the target of a host with AMX; this one has none: the rate target below)." in text

    amx = {k: v for k, v in row.items() if k not in ("rate_target", "floor", "next_lever")}
    server_scenario.judge(amx, "dlrmv2", "amx_int8,amx_bf16,avx512_bf16,avx512_vnni,avx512f,avx2")
    assert "rate_target" not in amx and [f["qps"] for f in amx["floor"]] == [5.0]  # the lowest INVALID rate
    assert amx["busy_at_target"] == round(0.038 * (2.5 * 5_000 / 270) / 2, 3)
    assert not amx["next_lever"].startswith("the server's time over")
    server_scenario.judge(met := {**amx, "valid_qps": 5.0, "runs": runs[:1]}, "dlrmv2", "avx512f")
    assert met["rate_target"]["met"] and met["floor"][0]["qps"] == 5.0  # the target's rate only
    server_scenario.judge(crit := {**amx, "target": {**amx["target"], "met": True}}, "criteo", "avx512f")
    assert "rate_target" not in crit and "next_lever" not in crit


def test_a_run_undecided_by_early_stopping_alone_runs_again_with_the_queries_loadgen_asks_for():
    summary = (
        "Result is : INVALID\n  Performance constraints satisfied : Yes\n  Early stopping satisfied: NO\n"
        " * Would need to run at least 162 more queries,\n99.00 percentile latency (ns)   : 41893595\n"
        "Max latency (ns)                : 60969932\n"
    )
    first = {**mlperf.parse_summary(summary), "queries": 500}
    assert mlperf.more_queries(first) == 162
    calls = []

    def run_once(qps, min_queries, max_seconds):
        calls.append((qps, min_queries, max_seconds))
        return {"valid": True, "queries": min_queries, "p99_ms": 40.0}

    got = mlperf.decide(run_once, 8.0, first, 90.0, 180.0)
    n = -(-3 * (500 + 162) // 2)  # 993: what LoadGen asks for, and half again
    assert calls == [(8.0, n, 1.2 * n / 8.0)] and got["valid"] and got["queries"] == n
    assert got["undecided_first"] == {
        "queries": 500,
        "p99_ms": 41.9,
        "max_ms": 61.0,
        "early_stopping": "Would need to run at least 162 more queries,",
    }
    assert mlperf.decide(run_once, 8.0, first, 90.0, 100.0) is first and len(calls) == 1  # 124 s: past the limit
    for r in (  # failed for other reasons, or over the bound: a second run would not change it
        {**first, "p99_ms": 61.0},
        {**first, "unsatisfied": ["Performance constraints", "Early stopping"]},
        {**first, "valid": True, "unsatisfied": []},
    ):
        assert mlperf.more_queries(r) is None and mlperf.decide(run_once, 8.0, r, 90.0, 180.0) is r
    assert len(calls) == 1


def test_forward_lines_give_each_archive_per_core_beside_stock_and_mlperf():
    rows = [
        {"config": "model-config.criteo.yaml", "dense": "fp32", "host_rows_per_s": 72376, "cpus": 2},
        {
            "config": "model-config.dlrmv2.yaml",
            "dense": "int8 static (PT2E: ...)",
            "host_rows_per_s": 19216,
            "cpus": 2,
            "stock_rows_per_s": 5234,
            "dense_macs_per_row": 16_030_464,
        },
        {
            "config": "model-config.dlrmv2.yaml",
            "dense": "int8 static (PT2E: ...)",
            "host_rows_per_s": 18834,
            "cpus": 2,
            "stock_rows_per_s": 4914,
            "split_pairs": 350,
        },  # the same archive: left out
    ]
    peak = common.int8_peak({"avx512_vnni"}, 2000.0)
    lines = server_scenario.forward_lines({"rows": rows, "machine": {"int8_peak": peak}})
    assert mlperf.PUBLISHED in lines[1]
    table = [x for x in lines if x.startswith("| model-config")]
    assert table == [
        "| model-config.criteo.yaml | fp32 | 72,376 | 36,188 | n/a | n/a | n/a | n/a | n/a |",
        f"| model-config.dlrmv2.yaml | int8 static | 19,216 | 9,608 | 2,617 | {19216 / 5234:.2f} | "
        f"{9608 / mlperf.PUBLISHED_PAIRS_PER_CORE:.2f} | 16.03 M | {9608 * 16_030_464 / (128 * 2000e6):.3f} |",
    ]
    assert "128 int8 multiply-accumulates per cycle per core at the 2,000 MHz" in lines[-1]


def test_bigtables_reads_the_workers_hot_rows_line():
    prefix = "2026-12-06T02:56:40 [INFO ] W-9000-m_1.0-stdout MODEL_LOG - "
    got = bigtables.hot_rows(
        "other line\n" + prefix + "hot rows: 215301 rows (29.7 MiB) of 26 tables, read in 0.03 s, not locked: "
        "mlock: Cannot allocate memory (RLIMIT_MEMLOCK 8.0 MiB, hot rows 29.7 MiB; ...)\n" + prefix + "hot rows: 1 rows"
    )
    assert got == {"rows": 215301, "mib": 29.7, "tables": 26, "seconds": 0.03, "locked": False} | {
        "why_not": "mlock: Cannot allocate memory (RLIMIT_MEMLOCK 8.0 MiB, hot rows 29.7 MiB; ...)"
    }
    locked = bigtables.hot_rows(prefix + "hot rows: 5 rows (0.1 MiB) of 2 tables, read in 1.50 s, locked in memory")
    assert locked["locked"] and locked["why_not"] is None and locked["seconds"] == 1.5
    huge = bigtables.hot_rows(
        prefix + "hot rows: 5 rows (4.1 MiB) of 2 tables, read in 0.50 s, 4.0 MiB on 2 MiB pages, locked in memory"
    )
    assert huge["locked"] and huge["huge_mib"] == 4.0 and huge["mib"] == 4.1 and "huge_mib" not in locked
    unused = bigtables.hot_rows(prefix + "hot rows: 5 rows, not used (handler.hot_rows: false)")
    assert unused == {"rows": 5, "note": "not used (handler.hot_rows: false)", "locked": False}
    assert bigtables.hot_rows("DLRM loaded on cpu") is None


def test_bigtables_unpacked_sibling_links_the_packed_files_with_hot_rows_off(tmp_path):
    packed = tmp_path / "store" / "big"
    (packed / "MAR-INF").mkdir(parents=True)
    (packed / "dlrm.pt").write_bytes(b"weights")
    (packed / "dlrmkit").mkdir()
    (packed / "model-config.yaml").write_text(yaml.safe_dump({"batchSize": 1, "handler": {"seed": 0}}))
    (packed / "MAR-INF" / "MANIFEST.json").write_text(json.dumps({"model": {"modelName": "big", "x": 1}}))
    out = bigtables.unpacked_sibling(packed)
    assert out == tmp_path / "store" / "big-unpacked"
    assert (out / "dlrm.pt").is_symlink() and (out / "dlrm.pt").resolve() == packed / "dlrm.pt"
    assert not Path(os.readlink(out / "dlrm.pt")).is_absolute()  # also inside a container's mount
    assert (out / "dlrmkit").resolve() == packed / "dlrmkit"
    assert yaml.safe_load((out / "model-config.yaml").read_text()) == {
        "batchSize": 1,
        "handler": {"seed": 0, "hot_rows": False, "prefetch": False},
    }
    assert json.loads((out / "MAR-INF" / "MANIFEST.json").read_text()) == {
        "model": {"modelName": "big-unpacked", "x": 1}
    }
    assert bigtables.unpacked_sibling(packed) == out  # made again over the old one
    assert bigtables.unpacked_sibling(packed, "packed") == packed
    assert yaml.safe_load((bigtables.unpacked_sibling(packed, "no-prefetch") / "model-config.yaml").read_text())[
        "handler"
    ] == {"seed": 0, "prefetch": False}


def test_bigtables_queries_are_mlperf_shaped_each_drawn_once_and_parse():
    from dlrmkit.config import DLRMConfig
    from dlrmkit.forms import RequestParser

    cfg = DLRMConfig.from_yaml(ROOT / "model-config.dlrmv2.yaml")
    pool = bigtables.Queries(cfg, "zipf 1.05", seed=11, ahead=2)
    got = [pool[0] for _ in range(3)]  # any index: the next query; the third drawn on the spot
    assert pool.late == 1 and len({q.body for q in got}) == 3
    again = bigtables.Queries(cfg, "zipf 1.05", seed=11, ahead=3)
    assert [again[5].body for _ in range(3)] == [q.body for q in got]  # seeded
    bags = mlperf.mlperf_bags(cfg)
    for q in got:
        assert mlperf.PAIRS[0] <= q.pairs <= mlperf.PAIRS[1]
        cols = json.loads(q.body)["columns"]
        for f, n, k in zip(cfg.sparse_features, cfg.num_embeddings, bags):
            assert cols["sparse"][f]["lengths"] == [k] * q.pairs and max(cols["sparse"][f]["values"]) < n
        RequestParser(cfg).parse(q.body)
    uniform = bigtables.Queries(cfg, "uniform", seed=11, ahead=1)[0]
    assert uniform.pairs == got[0].pairs and uniform.body != got[0].body


def test_bigtables_binary_queries_hold_the_same_rows_as_columns():
    from dlrmkit.config import DLRMConfig

    cfg = DLRMConfig.from_yaml(ROOT / "model-config.dlrmv2.yaml")
    cols = bigtables.Queries(cfg, "zipf 1.05", seed=5, ahead=1)[0]
    binary = bigtables.Queries(cfg, "zipf 1.05", seed=5, ahead=1, form="v2-binary")[0]
    assert binary.pairs == cols.pairs and binary.headers["Content-Type"] == "application/octet-stream"
    n = int(binary.headers[mlperf.BINARY_HEADER])
    header, at, got = json.loads(binary.body[:n]), n, {}
    for x in header["inputs"]:
        size = x["parameters"]["binary_data_size"]
        dtype = {"FP32": "<f4", "INT32": "<i4"}[x["datatype"]]
        got[x["name"]] = np.frombuffer(binary.body[at : at + size], dtype).reshape(x["shape"])
        at += size
    assert at == len(binary.body)
    want = json.loads(cols.body)["columns"]
    np.testing.assert_allclose(got["dense"], np.array(want["dense"], "<f4"))
    for f in cfg.sparse_features:
        assert got[f"{f}.values"].tolist() == want["sparse"][f]["values"]
        assert got[f"{f}.lengths"].tolist() == want["sparse"][f]["lengths"]


def bigtables_turn(variant: str, turn: int, p99: float, ms: list[float]) -> dict:
    return bigtables_phase(p99, 1.0) | {"turn": turn, "variant": variant, "form": "v2-binary", "latencies_ms": ms}


def test_bigtables_turns_ratio_per_turn_and_pooled_and_report():
    runs = [
        bigtables_turn("capped", -1, 500.0, [500.0]),  # the first run: not in the ratios
        bigtables_turn("packed", -1, 900.0, [900.0]),
        bigtables_turn("packed", 0, 60.0, [float(x) for x in range(1, 101)]),
        bigtables_turn("capped", 0, 50.0, [float(x) for x in range(1, 101)]),
        bigtables_turn("capped", 1, 40.0, [x / 2 for x in range(1, 101)]),
        bigtables_turn("packed", 1, 60.0, [x * 1.0 for x in range(1, 101)]),
    ]
    other = bigtables_turn("packed", 0, 99.0, [99.0]) | {"form": "columns"}  # another form's: not in these
    summary = bigtables.turns_summary([*runs, other], ["v2-binary", "columns"])
    sm = summary["v2-binary"]
    assert summary["columns"]["variants"]["packed"]["p99_ms"] == [99.0] and summary["columns"]["target_met"] is None
    assert sm["p99_ratio_per_turn"] == [1.2, 1.5] and sm["p99_ratio_median"] == 1.35
    packed, capped = sm["variants"]["packed"], sm["variants"]["capped"]
    assert packed["queries"] == capped["queries"] == 200 and packed["p99_ms"] == [60.0, 60.0]
    assert packed["pooled_p99_ms"] == round(bigtables.percentile(sorted(list(range(1, 101)) * 2), 99), 1)
    assert sm["p99_ratio_pooled"] == round(packed["pooled_p99_ms"] / capped["pooled_p99_ms"], 2)
    assert sm["target_met"] is False  # the median per turn is over 1.25
    m = {"cpu": "Xeon", "available_cpus": 2, "isa": "avx512f", "load_average": [1.0, 1.0, 1.0]}
    settings = {"qps": 1.0, "cold_s": 60.0, "warm_s": 120.0, "seed": 11, "dists": ["zipf 1.05"], "form": ["v2-binary"]}
    settings["turns"] = 2
    rows = [bigtables_row("packed", "zipf 1.05", (1.0, 1.0), (1.0, 1.0), None) | {"startup_s": 125.0}]
    report = {"title": "t", "machine": m, "memory_gib": 23.6, "settings": settings, "rows": rows, "runs": runs}
    md = bigtables.turns_markdown(report | {"summary": {"v2-binary": sm}})
    assert "| first | packed | v2-binary | INVALID | 60 | 40.0 / 900.0 / 90.0 | 0 | 1.0 | 1.5 | 0.1 |" in md
    assert "| 2 | capped | v2-binary | INVALID | 60 | 40.0 / 40.0 / 90.0 | 0 | 1.0 | 1.5 | 0.1 |" in md
    assert any("`v2-binary`:** per turn 1.2, 1.5 (median 1.35)" in ln and "both: missed" in ln for ln in md)
    assert any("with its bag sizes (`v2-binary`)" in line for line in md)


def bigtables_phase(p99: float | None, faults: float, valid: bool = False) -> dict:
    r = {"valid": valid, "queries": 60, "p50_ms": 40.0, "p99_ms": p99, "max_ms": 90.0, "errors": 0}
    r.update(majflt_per_query=faults, disk_read_mb_s=1.5, page_cache_share=0.1, rss_anon_mib=600, rss_file_mib=300)
    return r if valid else r | {"unsatisfied": ["Early stopping"]}


def bigtables_row(variant: str, dist: str, cold: tuple, warm: tuple, hot: dict | None) -> dict:
    row = {"variant": variant, "dist": dist, "model_dir": f"/s/{variant}", "weights_gib": 27.44, "cache_drop": "x"}
    return row | {
        "workers": 2,
        "startup_s": 20.0,
        "hot": hot,
        "cold": bigtables_phase(*cold),
        "warm": bigtables_phase(*warm),
    }


def test_bigtables_ratios_and_report():
    hot = {"rows": 9, "mib": 2048.0, "tables": 26, "seconds": 4.0, "locked": True, "why_not": None}
    rows = [
        bigtables_row("packed", "zipf 1.05", (200.0, 30.0), (70.0, 2.0), hot),
        bigtables_row(
            "unpacked", "zipf 1.05", (400.0, 60.0), (140.0, 0.0), {"rows": 9, "note": "not used", "locked": False}
        ),
        bigtables_row("capped", "zipf 1.05", (100.0, 1.0), (50.0, 0.0, True), None),
        bigtables_row("packed", "uniform", (None, 10.0), (90.0, 5.0), hot),
    ]
    got = bigtables.ratios(rows)
    assert got == [
        {"dist": "zipf 1.05", "phase": "cold", "p99_vs_unpacked": 0.5, "faults_vs_unpacked": 0.5, "p99_vs_capped": 2.0},
        {"dist": "zipf 1.05", "phase": "warm", "p99_vs_unpacked": 0.5, "faults_vs_unpacked": None}
        | {"p99_vs_capped": 1.4, "target_met": False},
        {"dist": "uniform", "phase": "cold"},
        {"dist": "uniform", "phase": "warm"},
    ]
    m = {"cpu": "Xeon", "available_cpus": 2, "isa": "avx512f", "load_average": [1.0, 1.0, 1.0]}
    settings = {"qps": 1.0, "cold_s": 60.0, "warm_s": 120.0, "seed": 11, "dists": ["zipf 1.05", "uniform"]}
    report = {"title": "t", "machine": m, "memory_gib": 23.6, "settings": settings, "rows": rows, "ratios": got}
    md = bigtables.markdown(report)
    assert "| packed | zipf 1.05 | packed | 27.44 | x | 2 | 20.0 | 9 rows (2048.0 MiB), read in 4.0 s, locked |" in md
    assert "| unpacked | zipf 1.05 | unpacked | 27.44 | x | 2 | 20.0 | 9 rows, not used |" in md
    assert "| capped | zipf 1.05 | capped | 27.44 | x | 2 | 20.0 | none (no hot rows in the weights) |" in md
    assert (
        "| packed | zipf 1.05 | warm | INVALID (Early stopping) | 60 | 40.0 / 70.0 / 90.0 | 0 | 2.0 | 1.5 | 0.1 | 600 / 300 |"
        in md
    )
    assert "| capped | zipf 1.05 | warm | VALID | 60 | 40.0 / 50.0 / 90.0 | 0 | 0.0 | 1.5 | 0.1 | 600 / 300 |" in md
    assert "| zipf 1.05 | warm | 0.5 | n/a | 1.4, missed |" in md and "| uniform | cold | n/a | n/a | n/a |" in md
    assert sum(line.startswith("| packed |") for line in md) == 2 + 4  # a start row per variant, a row per phase


def test_bigtables_refuses_a_distribution_it_cannot_draw(capsys):
    with pytest.raises(SystemExit):
        bigtables.main(["serve", "--dists", "1.05", "zipf"])
    assert "--dists: expected Zipf exponents (e.g. 1.05) or uniform" in capsys.readouterr().err


def test_law_counts_are_what_a_growing_sample_of_ids_converges_to(tmp_path):
    # bench/ids.py --law: each rank's expected count under sample_ids' law, at the id the rank is
    # scattered to; a sample of 200,000 draws agrees on the ids and (within sampling noise) the counts
    from bench import ids

    n, s = 1000, 1.05
    share = ids.rank_share(n, s, np.arange(1, n + 1))
    assert abs(share.sum() - 1) < 1e-9 and np.all(np.diff(share) < 0)
    drawn = np.bincount(ids.sample_ids(np.random.default_rng(3), n, 200_000, s), minlength=n)
    cfg = tiny_config(sparse_features=["a", "b"], num_embeddings=[n, 7])
    law = ids.law_counts(cfg, s, 200_000, min_count=30)
    got_ids, got = law["a"]
    assert got.min() >= 30 and len(got_ids) == len(set(got_ids.tolist())) < n  # the rarest ranks left out
    assert got_ids[0] == 0 and got[0] == round(200_000 * share[0])  # rank 1 is id 0
    sampled = drawn[got_ids.numpy()]
    assert np.all(np.abs(sampled - got.numpy()) <= 5 * np.sqrt(got.numpy()) + 1)  # a Poisson count's 5 sigma
    assert law["b"][1].sum() == pytest.approx(200_000, abs=4)  # 7 rows: every rank expected >= 30 times
    with pytest.raises(SystemExit):  # uniform ids have no hot rows
        ids.main(["--config", str(ROOT / "model-config.yaml"), "--zipf", "0", "--law", "--out", str(tmp_path / "x.pt")])


@pytest.mark.integration
def test_server_scenario_under_loadgen_against_a_real_torchserve(tmp_path):
    # named as the DLRMv2 config so that its target's anchor, stock torchrec's forward, is measured too
    cfg = tmp_path / "model-config.dlrmv2.yaml"
    doc = yaml.safe_load((ROOT / "model-config.yaml").read_text())
    cfg.write_text(yaml.safe_dump(doc))
    args = [
        "--configs",
        str(cfg),
        "--variant",
        "b8:batchSize=8,split=300",
        "--seconds",
        "2",
        "--max-seconds",
        "8",
        "--min-queries",
        "20",
        "--steps",
        "2",
        "--start-qps",
        "10",
        "--queries",
        "16",
        "--warm-up",
        "2",
        "--warm-up-max",
        "4",
        "--host-seconds",
        "0.3",
        "--decide-max-seconds",  # 20-query runs are all undecided: no second run of each here
        "0",
        "--out",
        str(tmp_path / "scenario"),
    ]
    assert server_scenario.main(args) == 0
    out = tmp_path / "scenario"
    run = json.loads((out / "run.json").read_text())
    assert run["command"] == "python bench/server_scenario.py " + " ".join(args) and len(run["date"]) == 10
    report = json.loads((out / "server-scenario.json").read_text())
    (row,) = report["rows"]
    assert row["variant"] == "b8" and row["batch_size"] == 8 and row["dense"] == "fp32" and row["split_pairs"] == 300
    assert len(row["runs"]) == 2 and row["runs"][0]["target_qps"] == 10
    for r in row["runs"]:
        summary = (out / "loadgen" / f"dlrmv2-b8-split300-{r['target_qps']:.2f}qps.txt").read_text()
        assert mlperf.parse_summary(summary)["valid"] == r["valid"]
        assert r["errors"] == 0 and r["p99_ms"] > 0
        # LoadGen stops a rate at --max-seconds: then, and only then, too few queries were sent
        assert ("Min queries" in r.get("unsatisfied", [])) == (r["queries"] < 20)
    assert row["stock_before"]["rows_per_s"] > 0 and row["stock_after"]["rows_per_s"] > 0
    assert row["target"] == {
        "anchor": "stock",
        "bound": 2.5,
        "ratio": round(row["pairs_per_s"] / row["stock_rows_per_s"], 3),
        "met": row["pairs_per_s"] / row["stock_rows_per_s"] >= 2.5,
    }
    from dlrmkit.config import DLRMConfig

    # the profile: the largest and the smallest query alone, the worker's counters and the stages
    largest, smallest = row["profile"]
    assert largest["pairs"] == max(q.pairs for q in mlperf.query_pool(DLRMConfig.from_yaml(cfg), 16))
    assert smallest["pairs"] == min(q.pairs for q in mlperf.query_pool(DLRMConfig.from_yaml(cfg), 16))
    assert (
        largest["requests"] == -(-largest["pairs"] // 300) and smallest["requests"] == 1
    )  # as the load generator sends them
    for q in (largest, smallest):
        assert set(q["worker_ms"]) == {"preprocess", "inference", "postprocess"}
        assert all(v > 0 for v in q["worker_ms"].values()) and all(v > 0 for v in q["stages_ms"].values())
        assert q["outside_worker_ms"] == round(q["client_ms"] - sum(q["worker_ms"].values()), 2)
    assert set(row["cpu_ms_per_query"]) == {"frontend", "workers", "client"} and row["busy_at_target"] > 0
    # warm-up rounds of 2 s until the frontend's JIT settles, 4 s at most (a round may run past it)
    warm = row["warm_up"]
    assert 1 <= warm["rounds"] <= 2 and len(warm["jit_shares"]) == warm["rounds"]
    assert all(x >= server_scenario.JIT_SETTLED for x in warm["jit_shares"][:-1])  # went on only while not settled
    assert warm["jit_share"] == warm["jit_shares"][-1] and (
        warm["jit_share"] < server_scenario.JIT_SETTLED or warm["rounds"] == 2
    )
    assert all(r["frontend_jit_cpu_us_per_query"] >= 0 for r in row["runs"])
    md = (out / "server-scenario.md").read_text()
    assert md.count("| model-config.dlrmv2.yaml | b8 split 300 |") == 3  # the result and the profile's two queries
    judged = row.get("rate_target", row["target"])  # a host without AMX: the rate target (issue 45)
    assert ("Next lever (model-config.dlrmv2.yaml, b8 split 300): " in md) == (not judged["met"])
    verdict = "met" if row["target"]["met"] else "missed"
    target = "Target (model-config.dlrmv2.yaml, b8 split 300): pairs/s >= 2.5 x stock torchrec's fp32 forward"
    # without AMX the line points on to the rate target; with it, it ends there
    after = (
        " (the target of a host with AMX; this one has none: the rate target below)." if "rate_target" in row else "."
    )
    assert f"{target}: {row['target']['ratio']}, {verdict}{after}" in md
    from dlrmkit.dense import isa_summary

    assert ("rate_target" in row) == ("amx" not in isa_summary())
    assert bool(row["floor"]) == ("rate_target" in row or any(not r["ok"] for r in row["runs"]))
    assert ("Compute floor (model-config.dlrmv2.yaml, b8 split 300; a model" in md) == bool(row["floor"])
    assert (out / "server-scenario.png").stat().st_size > 0
    # the report again from the run's JSON alone: the same lines
    again = tmp_path / "again"
    assert server_scenario.main(["--from-json", str(out / "server-scenario.json"), "--out", str(again)]) == 0
    assert (again / "server-scenario.md").read_text() == md and (again / "server-scenario.png").stat().st_size > 0


def test_thread_cpu_counts_named_threads_apart_from_the_rest():
    """bench/doors.py's split of a door's CPU: threads named like the KServe door's scoring threads
    are its workers, every other thread of the process its front end."""
    import ctypes

    from bench import doors

    libc = ctypes.CDLL(None)
    done, spun = threading.Event(), threading.Event()

    def spin(name: bytes):
        libc.prctl(15, ctypes.c_char_p(name), 0, 0, 0)  # PR_SET_NAME: the name /proc shows
        deadline = time.monotonic() + 20  # 0.3 s of this thread's own CPU, on a busy machine too
        while time.thread_time() < 0.3 and time.monotonic() < deadline:
            pass
        spun.set()
        done.wait(10)

    t = threading.Thread(target=spin, args=(doors.SCORING_THREAD.encode() + b"_0",))
    t.start()
    try:
        assert spun.wait(30)
        named, total = doors.thread_cpu([os.getpid()], doors.SCORING_THREAD)
    finally:
        done.set()
        t.join()
    assert 0.25 <= named <= total, (named, total)
    assert doors.thread_cpu([os.getpid()], "no-such-thread")[0] == 0


def test_doors_report_puts_the_doors_side_by_side():
    from bench import doors

    def door(name, qps, rows):
        cpu = {"frontend": 1.0, "workers": 2.0}
        lg = [
            {"form": f, "valid_qps": qps, "p99_ms": 50.0, "pairs_per_s": 100, "cpu_ms_per_query": cpu}
            for f in mlperf.FORMS
        ]
        loads = [{"rows_per_s": rows, "p99_ms": 9.0, "cpu_ms_per_request": cpu} for _ in range(2)]
        return {"door": name, "ready_s": 10, "loadgen": lg, "closed_loop": loads}

    m = {"cpu": "x", "available_cpus": 2, "isa": "avx2", "load_average_at_start": [0, 0, 0]}
    report = {"machine": m, "config": "c.yaml", "how": "from this install", "seconds": 25, "min_queries": 500}
    report["rows"] = [door("torchserve", 20.0, 1000), door("kserve", 30.0, 500)]
    text = "\n".join(doors.markdown(report))
    assert "| LoadGen `columns`: VALID q/s (p99 ms) | 20.0 (50.0) | 30.0 (50.0) | 1.50 |" in text
    assert "| single rows, concurrency 64: rows/s (p99 ms) | 1,000 (9.0) | 500 (9.0) | 0.50 |" in text


@pytest.mark.parametrize("interaction", ["dot", "dcn"])
def test_dense_macs_per_row_counts_every_weight_of_the_dense_half(interaction):
    """Each weight of a dense matrix is one multiply-accumulate per row: the count equals the model's
    own 2-D dense parameters (plus the pairwise dots, which have no weights)."""
    from dlrmkit.model import DLRMFactory

    cfg = tiny_config(**variant(interaction))
    model = DLRMFactory(cfg).build()
    weights = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embedding" not in n)
    f = len(cfg.sparse_features) + 1
    dots = f * (f - 1) // 2 * cfg.embedding_dim if interaction == "dot" else 0
    assert common.dense_macs_per_row(cfg) == weights + dots


def test_int8_peak_takes_the_fastest_path_the_cpu_has():
    assert common.int8_peak({"avx2", "avx512_vnni", "amx_int8"}, 2000)["macs_per_cycle"] == 1024
    assert common.int8_peak({"avx2", "avx512_vnni"}, 2000)["macs_per_s"] == 128 * 2000e6
    assert common.int8_peak({"avx2"}, 2000)["macs_per_cycle"] == 32
    assert common.int8_peak({"sse4_2"}, 2000) is None and common.int8_peak({"avx2"}, None) is None


def test_a_variant_sent_as_binary_tensors_says_so_in_the_tables():
    assert server_scenario.label({"variant": "int8-binary", "form": "v2-binary"}) == "int8-binary"
    assert server_scenario.label({"variant": "int8", "form": "v2-binary", "split_pairs": 350}) == (
        "int8 (v2-binary) split 350"
    )
    assert server_scenario.label({"variant": "int8", "form": "columns"}) == "int8"


def test_the_ready_run_reports_the_cold_queries_of_a_fresh_server(tmp_path):
    """server_scenario.ready_run: a real LoadGen run against a server started for it; its first
    queries are slow (as a cold server's are): the slowest list names them, sent first, and max / p99."""
    import contextlib
    import http.server
    import types

    answered = []

    class Slow(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            answered.append(1)
            time.sleep(0.15 if len(answered) <= 2 else 0.001)  # the two first: cold
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *a):
            pass

    @contextlib.contextmanager
    def start():
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Slow)
        t = threading.Thread(target=srv.serve_forever, daemon=True)
        t.start()
        try:
            yield types.SimpleNamespace(url=f"http://127.0.0.1:{srv.server_address[1]}", log_dir=tmp_path / "logs")
        finally:
            srv.shutdown()

    pool = [mlperf.Query(100 + i, b"{}", {"Content-Type": "application/json"}) for i in range(8)]
    args = types.SimpleNamespace(seconds=1.0, min_queries=200, max_seconds=20.0, loadgen_dir=tmp_path)
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "ts_log.log").write_text(  # as plugin/.../Warmup.java logs the end of its warm-up
        "2026-12-06T09:26:11,114 [INFO ] oip-warmup-m/1.0 dlrmkit.oip.Warmup - m 1.0: warm-up ended after 3214 "
        "requests in 13 round(s), 13.5 s, the JIT at 0.030 of a CPU in the last round\n"
    )
    r = server_scenario.ready_run(start, "columns", "m", pool, 200.0, args, "t", lambda srv: os.getpid())
    assert r["plugin_warm_up"] == {"requests": 3214, "rounds": 13, "seconds": 13.5, "jit_share": 0.03}
    assert r["queries"] >= 200 and r["ready_s"] >= 0
    assert [q["ms"] >= 150 for q in r["slowest"][:2]] == [True, True]
    assert all(q["at_s"] < 1.0 for q in r["slowest"][:2])
    assert r["max_over_p99"] == round(r["max_ms"] / r["p99_ms"], 2) and r["max_ms"] >= 150
    # the cold ones are counted in the first 5 s (the run lasts ~1 s: nothing after)
    assert r["first_5s"]["max_ms"] >= 150 and r["first_5s"]["over_bound"] >= 2
    assert r["first_5s"]["queries"] + r["after_5s"]["queries"] == r["queries"]
    assert (tmp_path / "t-200.00qps-at-ready.txt").is_file()
    # this process has no JIT compiler threads: sampled, and none found busy
    assert r["jit_cpus_first_10s"] == 0.0 and all(q["jit_cpus"] in (0.0, None) for q in r["slowest"])


def test_the_jit_sampler_gives_the_cpus_used_between_two_times():
    sampler = server_scenario.JitSampler(os.getpid(), every=0.01)
    sampler.stop()
    sampler.samples = [(10.0, 1.0), (10.5, 1.25), (11.0, 1.5), (12.0, 1.5)]
    assert sampler.share(10.0, 11.0) == 0.5 and sampler.share(11.0, 12.0) == 0.0
    assert sampler.share(10.6, 10.9) is None  # one sample or none: no figure


def test_turns_runs_each_variant_at_each_rate_in_turns_against_real_torchservers(tmp_path):
    from bench import turns

    args = [
        "--config",
        "model-config.yaml",
        "--variant",
        "b64:",
        "--variant",
        "b8:batchSize=8,batchBytes=4096,split=256",
    ]
    args += ["--rates", "10", "--turns", "2", "--seconds", "2", "--max-seconds", "4", "--min-queries", "10"]
    args += ["--queries", "16", "--prime", "1", "--out", str(tmp_path / "turns")]
    assert turns.main(args) == 0
    out = tmp_path / "turns"
    report = json.loads((out / "turns.json").read_text())
    # turn 0 in the given order, turn 1 rotated by one: a drift of the host hits both alike
    assert [(r["turn"], r["variant"]) for r in report["runs"]] == [(0, "b64"), (0, "b8"), (1, "b8"), (1, "b64")]
    for r in report["runs"]:
        assert r["errors"] == 0 and r["p99_ms"] > 0 and r["workers_cpu_us_per_query"] > 0
        assert r["frontend_cpu_us_per_query"] > 0
        assert 10 < r["workers_uss_mb"] < 4096  # a worker's own pages: torch's and the model's, not nothing
        summary = (out / "loadgen" / f"{r['variant']}-10qps-turn{r['turn']}.txt").read_text()
        assert mlperf.parse_summary(summary)["p99_ms"] == r["p99_ms"]
    b64, b8 = report["summary"]
    assert b64["p99_ratio"] == 1.0 and b64["runs"] == b8["runs"] == 2
    front = statistics.median(r["frontend_cpu_us_per_query"] for r in report["runs"] if r["variant"] == "b8")
    assert b8["frontend_cpu_ms"] == round(front / 1000, 2)
    assert b8["workers_uss_mb"] == max(r["workers_uss_mb"] for r in report["runs"] if r["variant"] == "b8")
    by_turn = {(r["variant"], r["turn"]): r["p99_ms"] for r in report["runs"]}
    assert b8["p99_ratio"] == round(statistics.median(by_turn["b8", t] / by_turn["b64", t] for t in (0, 1)), 3)
    md = (out / "turns.md").read_text()
    assert f"| 10 | b8 | {b8['valid']} / 2 | {by_turn['b8', 0]}, {by_turn['b8', 1]} |" in md
    # split=256 is the load generator's: b8's queries over 256 pairs went as requests sent at once
    assert [v["split"] for v in report["variants"]] == [0, 256]
    assert "`b8` {'batchSize': 8, 'batchBytes': 4096} (columns; a query of more than 256 pairs as requests" in md
    assert "`b64` as shipped (columns);" in md


def tiny_big_models(tmp_path: Path) -> tuple[Path, Path]:
    """Two tiny model directories built as the full-size one is (scripts/build_big.py): one packed
    from a counts file, one plain."""
    from scripts import build_big

    from dlrmkit import hot

    rows = [300, 37, 513]
    handler = {**TINY, "num_embeddings": rows, "max_instances_per_request": 1024, "max_ids_per_request": 4096}
    rng = random.Random(3)
    hot.write_counts(
        tmp_path / "counts.pt",
        hot.count(
            {f: torch.tensor([rng.randrange(n) for _ in range(500)]) for f, n in zip(TINY["sparse_features"], rows)}
        ),
    )
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({"handler": handler}))
    packed, plain = tmp_path / "store" / "packed", tmp_path / "store" / "plain"
    args = ["--config", str(cfg), "--dtype", "int8"]
    build_big.main([*args, "--out", str(packed), "--hot-counts", str(tmp_path / "counts.pt"), "--hot-mib", "1"])
    build_big.main([*args, "--out", str(plain)])
    return packed, plain


@pytest.mark.integration
def test_bigtables_turns_serves_both_models_at_once_in_turns_with_binary_queries(tmp_path):
    """bigtables.py turns against two real TorchServes (tiny models built as the full-size one is),
    OIP v2 binary bodies: every query answered, the turns rotated, LoadGen's p99 kept per run."""
    packed, plain = tiny_big_models(tmp_path)
    out = tmp_path / "turns"
    argv = ["turns", "--model-dir", str(packed), "--capped-dir", str(plain), "--form", "v2-binary", "columns"]
    argv += ["--qps", "10", "--cold-s", "1", "--warm-s", "2", "--turns", "2", "--start-timeout", "300"]
    assert bigtables.main([*argv, "--out", str(out)]) == 0
    report = json.loads((out / "bigtables-turns.json").read_text())
    order = [(r["turn"], r["variant"], r["form"][0]) for r in report["runs"]]
    assert order[:2] == [(-1, "capped", "v"), (-1, "packed", "v")]  # each model's first seconds, in the first form
    served = [("packed", "v"), ("packed", "c"), ("capped", "v"), ("capped", "c")]
    assert order[2:] == [(0, *x) for x in served] + [(1, *x) for x in served[1:] + served[:1]]  # rotated
    for r in report["runs"]:
        assert r["errors"] == 0 and r["queries"] >= 10 and r["p99_ms"] > 0 and "latencies_ms" not in r
        tag = f"{r['variant']}-{r['form']}-" + ("first" if r["turn"] < 0 else f"turn{r['turn']}")
        assert mlperf.parse_summary((out / "loadgen" / f"{tag}.txt").read_text())["p99_ms"] == r["p99_ms"]
    packed_row, plain_row = report["rows"]
    assert packed_row["hot"]["rows"] > 0 and plain_row["hot"] is None
    assert packed_row["fill"] is None  # tables this small are never prefetched: no fill to wait for
    for form, sm in report["summary"].items():
        assert len(sm["p99_ratio_per_turn"]) == 2 and sm["variants"]["packed"]["queries"] >= 20, form
        assert f"**packed / capped p99, `{form}`:**" in (out / "bigtables-turns.md").read_text()


def test_bigtables_profile_times_a_packed_and_a_plain_model_in_turns(tmp_path):
    """bigtables.py profile on tiny models built as the full-size one is (scripts/build_big.py, one
    packed from counts, one plain): every variant timed per phase; only the packed one redirects."""
    packed, plain = tiny_big_models(tmp_path)

    out = tmp_path / "profile"
    argv = ["profile", "--model-dir", str(packed), "--capped-dir", str(plain), "--queries", "4", "--turns", "2"]
    assert bigtables.main([*argv, "--out", str(out)]) == 0
    report = json.loads((out / "bigtables-profile.json").read_text())
    by = {r["variant"]: r for r in report["rows"]}
    assert list(by) == ["packed", "packed, no per-forward prefetch", "capped"]
    for v, r in by.items():
        assert len(r["turns"]) == 2 and all(t["queries"] == 4 for t in r["turns"]), v
        assert 100 <= r["pairs_mean"] <= 700, v  # MLPerf's query sizes
        assert r["total"]["mean"] >= r["forward"]["mean"] > 0, v
        assert (r["redirect"]["mean"] > 0) == v.startswith("packed"), v
        assert r["prefetch"]["mean"] == 0, v  # tables this small are never prefetched
    assert "packed / capped: total mean" in (out / "bigtables-profile.md").read_text()


def test_the_raw_forward_reports_the_kits_parts_against_torchrecs_own(archived, config):
    """benchmark.py's raw forward times the served model and, in alternating halves, the same model
    with torchrec's own sparse arch and interaction; the kit's parts are back afterwards."""
    from torchrec.models.dlrm import InteractionArch, SparseArch

    from bench import benchmark
    from dlrmkit.model import DLRMFactory
    from dlrmkit.parts import FlatDotInteraction, PooledSparseArch

    served = DLRMFactory(config).load(archived)
    DLRMFactory(config).freeze_dense(served)
    with benchmark.torchrec_parts(served):
        assert (type(served.sparse_arch), type(served.inter_arch)) == (SparseArch, InteractionArch)
    assert (type(served.sparse_arch), type(served.inter_arch)) == (PooledSparseArch, FlatDotInteraction)
    rows = benchmark.bench_raw(served, config, 0.02)
    assert [r["batch"] for r in rows] == list(benchmark.BATCHES)
    for r in rows:
        assert r["torchrec_parts_rows_per_s"] > 0
        assert r["vs_torchrec_parts"] == pytest.approx(r["rows_per_s"] / r["torchrec_parts_rows_per_s"], rel=0.01)
    assert type(served.inter_arch) is FlatDotInteraction
