#!/usr/bin/env python
"""Benchmark the serving path against the model's own speed and TorchServe's own ceiling.

    python bench/benchmark.py                  # what `make bench` runs; ~15 minutes
    python bench/benchmark.py --duration 3     # a quick look

One run, one machine, five parts (the Criteo-layout config by default; `make bench` runs
bench/server_scenario.py after it, MLPerf's Server scenario under LoadGen):
  1. raw model forward as served (fp32 tables in fbgemm's fused kernel, dense and over arch
     jit-frozen): rows/s and p50/p99 per call at batch 1, 32, 128, 512;
  2. the handler in-process (bench.fakes.FakeContext, no server): microseconds per request and
     per row in parse+validation, KJT collation, forward and response building, for single-row
     requests, 128-row `instances` requests, 128-row ranking-form requests (context + candidates),
     the same rows as context + columns, the instances' rows as columns, and v2 binary tensors;
  3. served by a real TorchServe on 127.0.0.1: requests/s, rows/s, p50/p90/p99, errors and CPU
     per request at concurrency 1, 16, 64 for single-row and 128-row requests (instances,
     ranking, context + columns);
  4. the same load against a trivial echo handler served with the same TorchServe settings;
  5. both sides of every served target back to back, in turns: the DLRM and echo points, the
     served model's raw forward in this process and the host's raw forward on every CPU
     (common.HostForward).
Writes benchmark.json, .md, .png and run.json to results/<date>-benchmark/ (--out DIR), and
computes the targets from this run's own figures (ratios within one run; the served ones from
part 5), with the CPU ceiling of the ranking ratios beside them (cpu_ceiling).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import (
    COLUMNS,
    COLUMNS_ALL,
    CRITEO_TSV,
    HERE,
    RANKING,
    RANKING_ROWS,
    ROOT,
    V2_BINARY,
    HostForward,
    build_archive,
    serving,
    cpu_seconds,
    form_of,
    frontend_pid,
    jit_cpu_seconds,
    jit_cpu_since,
    log,
    machine,
    make_kind,
    md_table,
    measure_load,
    metric_value,
    raw_caller,
    request_loop,
    rows_of,
    run_dir,
    timed_calls,
    unpack,
    write_report,
)
from bench.fakes import FakeContext
from bench.load import percentile, run_load
from scripts.tsctl import Server, post

BATCHES = (1, 32, 128, 512)
CONCURRENCY = (1, 16, 64)
RAW_SECONDS = 4.0  # per raw / in-process point
WARM_UP_S = 40.0  # of load over every served model before the first measured point
TURNS, TURN_SECONDS = 3, 4.0  # both sides of every served target back to back; seconds per point in a turn


def said(row: dict, *skip: str) -> str:
    """A row's figures for the log: ``key value, ...`` less the keys ``skip``."""
    return ", ".join(f"{k} {v}" for k, v in row.items() if k not in skip)


# --- 1. raw forward ------------------------------------------------------------------------------


def paced_p50(call, seconds: float) -> float:
    """p50 seconds of ``call`` with the core idle 2 ms before each, as at concurrency 1 where the
    worker waits for each request: how much of that latency is a cache-cold forward."""

    def paced():
        time.sleep(0.002)
        t0 = time.perf_counter()
        call()
        return time.perf_counter() - t0

    return percentile([paced() for _ in range(max(50, int(seconds / 0.003)))], 50)


@contextlib.contextmanager
def torchrec_parts(model):
    """``model`` with torchrec's own SparseArch and InteractionArch for a while, where it serves the
    kit's faster ones (dlrmkit/parts.py, each a subclass of torchrec's): the same objects, their
    class swapped back to its base."""
    from dlrmkit.parts import FlatDotInteraction, PooledSparseArch

    mods = [getattr(model, n, None) for n in ("sparse_arch", "inter_arch")]
    kit = [(m, type(m)) for m in mods if type(m) in (PooledSparseArch, FlatDotInteraction)]
    for m, cls in kit:
        m.__class__ = cls.__base__
    try:
        yield
    finally:
        for m, cls in kit:
            m.__class__ = cls


def bench_raw(model, cfg, seconds: float) -> list[dict]:
    """Rows/s and p50/p99 ms per call of ``model`` per batch size; at batch 1 also paced 2 ms apart.
    Beside it, in alternating halves of the time, the same model with torchrec's own sparse arch
    and interaction (``torchrec_parts``): what dlrmkit/parts.py's two parts are worth."""
    rows, rng = [], random.Random(1)
    for b in BATCHES:
        call = raw_caller(cfg, b, rng)(model)
        t, own = [], []
        for _ in range(2):
            t += timed_calls(call, seconds / 2)
            with torchrec_parts(model):
                own += timed_calls(call, seconds / 2)
        rows.append(
            {
                "batch": b,
                "calls": len(t),
                "rows_per_s": round(b * len(t) / sum(t)),
                "p50_ms": round(percentile(t, 50) * 1e3, 3),
                "p99_ms": round(percentile(t, 99) * 1e3, 3),
                "torchrec_parts_rows_per_s": round(b * len(own) / sum(own)),
                "vs_torchrec_parts": round(sum(own) / len(own) / (sum(t) / len(t)), 3),
            }
        )
        if b == 1:
            rows[-1]["paced_2ms_p50_ms"] = round(paced_p50(call, seconds) * 1e3, 3)
        log(f"raw forward B={b}: " + said(rows[-1], "batch"))
    return rows


# --- 2. handler in-process -----------------------------------------------------------------------


def bench_handler(handler, cfg, seconds: float) -> list[dict]:
    """Whole handle() per batch, plus the same core stages timed one by one."""
    rng = random.Random(2)
    # 10 x 128 rows: as TorchServe batches ranking requests at c=16 (~10 per batch, section 3)
    raw = (CRITEO_TSV,) if cfg.raw.raw_input == "criteo_tsv" else ()
    points = [(1, k) for k in (1, RANKING_ROWS, RANKING, COLUMNS, COLUMNS_ALL, *raw, V2_BINARY)]
    points += [(32, 1), (32, RANKING_ROWS), (10, RANKING), (10, COLUMNS)]
    return [
        handler_point(handler, cfg, n_req, kind, [make_kind(kind, cfg, rng) for _ in range(n_req)], seconds)
        for n_req, kind in points
    ]


def handler_point(handler, cfg, n_req: int, kind, bodies: list, seconds: float) -> dict:
    """One batch of ``n_req`` requests of ``kind`` through handle() (a fake context), then its
    stages one by one: parse, collate, forward, respond."""
    from dlrmkit.batch import collate, scores
    from dlrmkit.criteo import CONTENT_TYPE as TSV
    from dlrmkit.forms import response_body
    from dlrmkit.protocols import BINARY_HEADER, open_request

    data, ctx, headers, parse = [{"body": b} for b in bodies], FakeContext(".", None), {}, handler.parser.parse
    if kind == V2_BINARY:  # as on KServe's v2 route: a Host header, no url_path
        length = str(json.JSONDecoder().raw_decode(bodies[0].decode("latin-1"))[1])  # the JSON header's
        headers, ctx.kserve = {"Host": "127.0.0.1", BINARY_HEADER: length}, set(range(n_req))

        def parse(b):
            return open_request(b, True, length, handler.parser, ("dlrm", "1.0")).parse()
    elif kind == CRITEO_TSV:  # Content-Type: text/tab-separated-values on /predictions
        headers = {"Content-Type": TSV}

        def parse(b):
            return open_request(b, False, None, handler.parser, ("dlrm", "1.0"), TSV).parse()

    ctx.headers = {i: headers for i in range(n_req)}
    # Overhead from the same calls: handle()'s wall time less the forward phase that the
    # handler itself timed in that call (no noise from pairing separate samples).
    paired = []

    def handle_once():
        t0 = time.perf_counter()
        handler.handle(data, ctx)
        wall = time.perf_counter() - t0
        if ctx.statuses:
            raise AssertionError(f"benchmark requests were refused: {ctx.statuses}")
        handler.tally.flush()  # the call's counters into ctx now (the handler's thread emits them every 0.25 s)
        inference_ms = next(v for n, v, _ in reversed(ctx.metrics.recorded) if n == "dlrm_inference_ms_total")
        paired.append((wall, inference_ms / 1e3))

    timed_calls(handle_once, seconds / 2, 400)
    paired = paired[3:]  # timed_calls' warm-up calls
    stage = {"parse": [], "collate": [], "forward": [], "respond": []}

    def staged_record():
        t = [time.perf_counter()]
        parsed = [parse(b) for b in bodies]
        t.append(time.perf_counter())
        batch, _ = collate(parsed, cfg, handler.device)
        t.append(time.perf_counter())
        answers = scores(handler.model, batch, cfg)
        t.append(time.perf_counter())
        [response_body(x) for x in answers]
        t.append(time.perf_counter())
        for k, t0, t1 in zip(stage, t, t[1:]):
            stage[k].append(t1 - t0)

    timed_calls(staged_record, seconds / 2, 400)
    med = {k: statistics.median(v) * 1e6 for k, v in stage.items()}
    total = statistics.median(w for w, _ in paired) * 1e6
    share = statistics.median((w - f) / f for w, f in paired)
    prep_share = [(p + c) / f for p, c, f in zip(stage["parse"], stage["collate"], stage["forward"])]
    rows = rows_of(kind)
    row = {
        "requests": n_req,
        "rows_per_request": rows,
        "form": form_of(kind),
        "body_bytes": round(statistics.mean(map(len, bodies))),
        **{f"{k}_us_per_request": round(v / n_req, 1) for k, v in med.items()},
        **{f"{k}_us_per_row": round(v / (n_req * rows), 2) for k, v in med.items()},
        "handle_us": round(total),
        "forward_us": round(med["forward"]),
        "overhead_share_of_forward": round(share, 3),
        "parse_collate_share_of_forward": round(statistics.median(prep_share), 3),
    }
    log(f"handler, {n_req} request(s): " + said(row, "requests"))
    return row


# --- 3 + 4. served -------------------------------------------------------------------------------


def build_archives(cfg_path: Path, store: Path) -> None:
    """The DLRM archive (as configured) and an echo archive with the same TorchServe settings."""
    import yaml

    build_archive(cfg_path, store, "dlrm")
    doc = yaml.safe_load(cfg_path.read_text())
    doc.pop("handler", None)
    echo_cfg = store / "echo-config.yaml"
    echo_cfg.write_text(yaml.safe_dump(doc))
    cmd = [str(Path(sys.executable).parent / "torch-model-archiver"), "--model-name", "echo", "--version", "1.0"]
    cmd += ["--handler", str(HERE / "echo_handler.py"), "--config-file", str(echo_cfg), "--export-path", str(store)]
    # the archiver stages (and first deletes) $TMPDIR/<model name>: keep it private
    subprocess.run([*cmd, "--force"], check=True, env={**os.environ, "TMPDIR": str(store)})


def warm_up_server(srv: Server, models: list[str], bodies: dict, seconds: float) -> None:
    """Load every model with single-row and 128-row requests before the first measured point.
    The frontend's JVM compiles its hot paths under load for minutes: on a 2-core machine its
    compiler threads took ~2 ms of CPU per request at the first point (the DLRM's c=1) without
    this, ~1.2 ms after 40 s of it, and tens of µs at the echo points measured last (column
    "its JIT")."""
    if seconds <= 0:
        return
    log(f"warming TorchServe up: {seconds:.0f} s of load over {len(models)} models")
    for m, kind in [(m, kind) for m in models for kind in (1, RANKING_ROWS)]:
        url, share = f"{srv.url}/predictions/{m}", seconds / (2 * len(models))
        asyncio.run(run_load(url, request_loop(bodies[kind])[0], 16, share, 2_000_000))


def server_counters(srv: Server, model: str):
    """A ``measure_load`` probe: the frontend's and the worker's CPU, the frontend JVM's JIT
    compiler threads' and the handler's batch counters, per request answered over the run."""
    procs = {"frontend": [frontend_pid(srv)], "worker": srv.worker_pids(model)}
    names = ("dlrm_batches_total", "dlrm_requests_total")
    counts0, cpu0 = [metric_value(srv, model, n) for n in names], {k: cpu_seconds(v) for k, v in procs.items()}
    jit0 = jit_cpu_seconds(procs["frontend"][0])

    def after(got: dict) -> dict:
        per_request = {k: cpu_seconds(v) - cpu0[k] for k, v in procs.items()}
        per_request["jit"] = jit_cpu_since(procs["frontend"][0], jit0)
        us = {k: round(v / max(1, got["requests"]) * 1e6) for k, v in per_request.items()}
        batches, requests = (metric_value(srv, model, n) - c for n, c in zip(names, counts0))
        return {
            # CPU time per answered request: where the two cores go
            "frontend_cpu_us_per_request": us["frontend"],
            # of which the JVM's JIT compiler threads: still warming up if large
            "frontend_jit_cpu_us_per_request": us["jit"],
            "worker_cpu_us_per_request": us["worker"],
            # from the handler's own metrics (dlrm only): is TorchServe batching?
            "requests_per_batch": round(requests / batches, 1) if batches and requests else None,
        }

    return after


def bench_served(srv: Server, model: str, bodies: dict, duration: float) -> list[dict]:
    """Each (request kind, concurrency) point: every kind in ``bodies`` (1 and RANKING_ROWS:
    instances; RANKING, COLUMNS: those forms) at every concurrency."""
    out = []
    for kind, c in [(k, c) for k in bodies for c in CONCURRENCY]:
        row = {"model": model, "rows_per_request": rows_of(kind), "form": form_of(kind), "concurrency": c}
        url = f"{srv.url}/predictions/{model}"
        got = measure_load(url, bodies[kind], rows_of(kind), c, duration, lambda: server_counters(srv, model))
        row |= got | {
            "requests_per_s": round(got["requests_per_s"], 1),
            "rows_per_s": round(got["rows_per_s"]),
            **{k: round(got[k], 2) for k in ("p50_ms", "p90_ms", "p99_ms", "client_cpu_share")},
        }
        out.append(row)
        log(f"{model} c={c}: " + said(row, "model", "concurrency"))
    return out


# The served targets' sides, measured back to back in turns: (name, model, request kind, concurrency);
# a kind of None is the raw forward in this process at that batch size (1: paced 2 ms apart).
TURN_STEPS = (
    ("dlrm c=1", "dlrm", 1, 1),
    ("echo c=1", "echo", 1, 1),
    ("raw B=1 paced", None, None, 1),
    ("dlrm c=64", "dlrm", 1, 64),
    ("echo c=64", "echo", 1, 64),
    ("raw B=32", None, None, 32),
    ("ranking c=16", "dlrm", RANKING, 16),
    ("columns c=16", "dlrm", COLUMNS, 16),
    ("instances c=16", "dlrm", RANKING_ROWS, 16),
    ("raw B=128", None, None, RANKING_ROWS),
    ("host B=128", "host", None, RANKING_ROWS),
)


def bench_turns(srv: Server, model, cfg, bodies: dict, turns: int, seconds: float, host) -> list[dict]:
    """Both sides of every served target, back to back, in ``turns`` turns (the order reversed
    every other turn): the DLRM and echo single-row points at c=1 and c=64, the 128-row forms at
    c=16, and ``model`` (the served one, loaded in this process) at batch 1 (paced), 32 and 128.
    The single pass of part 3 measures the raw forward minutes before the served points and
    the echo points minutes after them: a burst of other work on the shared machine in between
    moved its ratios (ranking form at c=16: 0.72-1.03 over eight runs of one commit); here it
    moves both sides of a ratio alike. The 128-row forms divide by ``host`` (common.HostForward:
    the forward on every CPU, the better of N processes and N threads). Returns, per turn, each
    step's figure (p50 ms at c=1, else req/s or rows/s) and the targets' ratios."""
    rng = random.Random(4)
    callers = {b: raw_caller(cfg, b, rng)(model) for _, _, kind, b in TURN_STEPS if kind is None}
    out = []
    for turn in range(turns):
        got = {}
        for name, served, kind, c in TURN_STEPS if turn % 2 == 0 else TURN_STEPS[::-1]:
            if served == "host":
                got[name] = host.measure(c, seconds / 2)["rows_per_s"]
            elif served is None and c == 1:
                got[name] = round(paced_p50(callers[c], seconds / 2) * 1e3, 3)
            elif served is None:
                t = timed_calls(callers[c], seconds / 2)
                got[name] = round(c * len(t) / sum(t))
            else:
                res = measure_load(f"{srv.url}/predictions/{served}", bodies[kind], rows_of(kind), c, seconds)
                if res["errors"]:
                    raise SystemExit(f"{name}: {res['errors']} requests failed")
                key = "p50_ms" if c == 1 else "requests_per_s" if kind == 1 else "rows_per_s"
                got[name] = round(res[key], 3 if c == 1 else None)
        ratios = {
            "c1": got["dlrm c=1"] / (got["echo c=1"] + got["raw B=1 paced"]),
            "c64": got["dlrm c=64"] * (1 / got["echo c=64"] + 1 / got["raw B=32"]),
            **{form: got[f"{form} c=16"] / got["host B=128"] for form in ("ranking", "columns", "instances")},
        }
        out.append({"turn": turn + 1, "figures": got, "ratios": {k: round(v, 3) for k, v in ratios.items()}})
        log(f"turn {turn + 1}/{turns}: {said(got)} -> {said(out[-1]['ratios'])}")
    return out


# --- report --------------------------------------------------------------------------------------


def cpu_ceiling(served_row: dict, host_rows_per_s: float, cpus: int) -> float:
    """The most a served point could reach of the host's raw forward on this host: the forward's
    CPU per request (the host's rate, all ``cpus`` busy) over all the CPU one request took at that
    point (frontend, worker and the load generator's share: they all run on these cores). A
    bound above it is out of reach here however busy the cores are kept."""
    forward_us = cpus * served_row["rows_per_request"] / host_rows_per_s * 1e6
    client_us = served_row["client_cpu_share"] / served_row["requests_per_s"] * 1e6
    spent = served_row["frontend_cpu_us_per_request"] + served_row["worker_cpu_us_per_request"] + client_us
    return forward_us / spent


def targets(handler_rows, turns, served_rows=(), cpus=None) -> list[dict]:
    """The issue's targets, each a ratio of this run's own figures: the served ones the median
    over the turns of bench_turns (each turn's two sides measured back to back), with their
    range. Context rows (no bound): the ranking forms' CPU ceiling (cpu_ceiling, from part 3's
    CPU per request)."""

    def served(key, target, bound, higher_is_better=True):
        values = [t["ratios"][key] for t in turns]
        return {
            "target": f"{target} (median of {len(values)} turns)",
            "value": round(statistics.median(values), 3),
            "range": [min(values), max(values)],
            "bound": bound,
            "higher_is_better": higher_is_better,
        }

    out = [
        served("c1", "c=1 single row: p50 <= 1.2 x (echo p50 + raw forward p50 at B=1, paced 2 ms)", 1.2, False),
        served("c64", "single-row c=64: served req/s >= 0.85 x 1 / (1/echo c=64 req/s + 1/raw rows/s at B=32)", 0.85),
    ]
    host128 = statistics.median(t["figures"]["host B=128"] for t in turns)
    c16 = {
        r["form"]: r for r in served_rows if (r["model"], r["rows_per_request"], r["concurrency"]) == ("dlrm", 128, 16)
    }
    ceiling = "the forward's CPU / all the CPU per request at part 3's c=16 point (frontend + worker + load generator)"
    for form in ("ranking", "columns", "instances"):
        text = f"ranking (128 rows, {form} form) c=16: served rows/s >= 0.75 x the host's raw forward rows/s at B=128"
        out.append(served(form, text + " (all CPUs)", 0.75))
        if (row := c16.get(form)) and cpus:
            text = f"context: the ceiling of that ratio on this host ({form} form): {ceiling}"
            out.append({"target": text, "value": round(cpu_ceiling(row, host128, cpus), 3), "bound": None})
    for form in ("ranking", "columns", "instances", "columns-all", "v2-binary"):
        h = next(r for r in handler_rows if (r["requests"], r["rows_per_request"], r["form"]) == (1, 128, form))
        text = f"parse + collate of one 128-row request ({form} form) <= 0.10 x its forward"
        out.append(
            {"target": text, "value": h["parse_collate_share_of_forward"], "bound": 0.10, "higher_is_better": False}
        )
    return out


def table(head: str, keys: str, rows: list[dict]) -> list[str]:
    """``rows`` as a markdown table: ``head`` (its columns, "|"-separated), ``keys`` (the cells' keys)."""
    return md_table(head.split(" | "), [[cell(r.get(k)) for k in keys.split()] for r in rows], right=True)


def cell(v) -> str:
    return "" if v is None else f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else str(v)


def markdown(report) -> str:
    m, ts = report["machine"], report["torchserve"]
    lines = [
        f"Machine: {m['cpus']} CPUs ({m.get('available_cpus', m['cpus'])} available to the benchmark: affinity and "
        f"cgroup quota; {m['processor']}), torch {m['torch']}, {m['torch_threads']} torch threads per worker; "
        f"config `{report['config']}`; TorchServe batchSize {ts['batchSize']}, maxBatchDelay {ts['maxBatchDelay']} "
        f"ms, {ts['workers']} worker(s); served points after {ts.get('warm_up_s', 0):.0f} s of warm-up load.",
        "",
        "**1. Raw forward** (the model as served: fp32 tables in fbgemm's fused kernel, dense and over arch "
        "jit-frozen, the pooled embeddings read as a view, the interaction's products picked by one index_select; "
        "beside it, in alternating halves of the time, the same model with torchrec's own sparse arch and "
        "interaction)",
        "",
    ]
    lines += table(
        "batch | rows/s | p50 ms | p99 ms | with torchrec's parts, rows/s | served / torchrec's parts",
        "batch rows_per_s p50_ms p99_ms torchrec_parts_rows_per_s vs_torchrec_parts",
        report["raw_forward"],
    )
    paced = report["raw_forward"][0].get("paced_2ms_p50_ms")
    if paced:
        lines += ["", f"Batch 1 with the core idle 2 ms between calls (as at concurrency 1): p50 {paced} ms."]
    lines += ["", "**2. Handler in-process** (µs per request; shares of the forward in the last columns)", ""]
    lines += table(
        "requests | rows | form | body bytes | parse | collate | forward | respond | handle() total µs | "
        "overhead / forward | parse + collate / forward",
        "requests rows_per_request form body_bytes parse_us_per_request collate_us_per_request forward_us_per_request "
        "respond_us_per_request handle_us overhead_share_of_forward parse_collate_share_of_forward",
        report["handler"],
    )
    lines += ["", "**3-4. Served** (DLRM handler vs echo handler, same TorchServe settings)", ""]
    lines += table(
        "model | rows/request | form | concurrency | req/s | rows/s | p50 ms | p90 ms | p99 ms | errors | "
        "CPU µs/request: frontend | its JIT | worker | client CPU (cores) | requests/batch",
        "model rows_per_request form concurrency requests_per_s rows_per_s p50_ms p90_ms p99_ms errors "
        "frontend_cpu_us_per_request frontend_jit_cpu_us_per_request worker_cpu_us_per_request client_cpu_share "
        "requests_per_batch",
        report["served"],
    )
    turns = report.get("turns") or []
    if turns:
        lines += [
            "",
            f"**5. The served targets' sides, back to back in {len(turns)} turns** (order reversed every "
            "other turn; p50 ms at c=1, req/s for single rows at c=64, rows/s for the 128-row forms and the raw "
            "forward)",
            "",
        ]
        cells = [[name, *(f"{t['figures'][name]:,}" for t in turns)] for name in turns[0]["figures"]]
        cells += [[f"ratio: {name}", *(t["ratios"][name] for t in turns)] for name in turns[0]["ratios"]]
        lines += md_table(["", *(f"turn {t['turn']}" for t in turns)], cells, right=True)
        cpus = m.get("available_cpus", m["cpus"])
        per_core = {
            name: statistics.median(t["figures"][name] for t in turns) / cpus
            for name in ("host B=128", "ranking c=16", "columns c=16", "instances c=16")
        }
        per_core_text = ", ".join(f"{name} {v:,.0f} rows/s" for name, v in per_core.items())
        lines += ["", f"Per core ({cpus} CPUs, medians over the turns): {per_core_text}."]

    def target_row(t: dict) -> list:  # a bound met or missed; no bound: context
        v, b, span = t["value"], t["bound"], "-".join(map(str, t.get("range", ())))
        ok = b is not None and (v >= b if t["higher_is_better"] else v <= b)
        return [t["target"], v, span, b, "context" if b is None else "met" if ok else "missed"]

    cells = [target_row(t) for t in report["targets"]]
    lines += ["", "**Targets**", ""]
    lines += md_table(["target", "measured", "range over turns", "bound", ""], cells, right=True)
    return "\n".join(lines) + "\n"


def plot(report, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    raw = report["raw_forward"]
    axes[0].plot([r["batch"] for r in raw], [r["rows_per_s"] for r in raw], "o-", label="raw forward")
    for rows, form, style in (
        (1, "instances", "s--"),
        (RANKING_ROWS, "instances", "^--"),
        (RANKING_ROWS, "ranking", "v--"),
        (RANKING_ROWS, "columns", "d--"),
    ):
        pts = [r for r in report["served"] if (r["model"], r["rows_per_request"], r["form"]) == ("dlrm", rows, form)]
        label = f"served, {rows}-row {form} requests (x: rows in flight)"
        axes[0].plot([r["concurrency"] * rows for r in pts], [r["rows_per_s"] for r in pts], style, label=label)
    axes[0].set(xscale="log", xlabel="batch (rows)", ylabel="rows/s", title="Rows per second")
    axes[0].legend(fontsize=7, loc="upper left")
    for ax, key, title in (
        (axes[1], "requests_per_s", "Requests/s, single-row"),
        (axes[2], "p99_ms", "p99 latency (ms), single-row"),
    ):
        for model in ("dlrm", "echo"):
            pts = [r for r in report["served"] if r["model"] == model and r["rows_per_request"] == 1]
            ax.plot([r["concurrency"] for r in pts], [r[key] for r in pts], "o-", label=model)
        ax.set(xscale="log", xlabel="concurrency", title=title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--config", default=str(ROOT / "model-config.criteo.yaml"), help="model config (default: %(default)s)"
    )
    ap.add_argument("--duration", type=float, default=10.0, help="seconds per served load point (default: %(default)s)")
    ap.add_argument("--out", help="output folder (default: results/<date>-benchmark/)")
    args = ap.parse_args()

    import torch
    import yaml

    from dlrm_handler import TorchRecDLRMHandler
    from dlrmkit.config import DLRMConfig

    cfg_path = Path(args.config).resolve()
    cfg = DLRMConfig.from_yaml(cfg_path)
    ts_doc = yaml.safe_load(cfg_path.read_text())
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dlrm-bench-") as tmp:
        tmp = Path(tmp)
        log(f"building archives from {cfg_path.name} (random weights)")
        store = tmp / "store"
        build_archives(cfg_path, store)

        log("in-process: loading the model as the handler does")
        unpack(store / "dlrm.mar", tmp / "model")
        handler = TorchRecDLRMHandler()
        handler.initialize(FakeContext(tmp / "model", ts_doc["handler"]))
        raw = bench_raw(handler.model, cfg, RAW_SECONDS)
        handler_rows = bench_handler(handler, cfg, RAW_SECONDS)
        threads = torch.get_num_threads()
        served_model = handler.model  # the served model, for the raw side of the turns
        del handler
        log("the host's raw forward: one process per CPU, beside one process with a thread per CPU")
        host = HostForward(cfg_path, tmp / "model", served_model, cfg)

        rng = random.Random(3)
        kinds = (1, RANKING_ROWS, RANKING, COLUMNS)
        bodies = {k: [make_kind(k, cfg, rng) for _ in range(256 if k == 1 else 16)] for k in kinds}
        models = ["dlrm", "echo"]
        try:
            with serving(tmp / "home", store, {m: bodies[1][0] for m in models}) as srv:
                for kind in (RANKING_ROWS, RANKING, COLUMNS):
                    status, _, _ = post(f"{srv.url}/predictions/dlrm", bodies[kind][0])
                    assert status == 200, status
                warm_up_server(srv, models, bodies, WARM_UP_S)
                served = bench_served(srv, "dlrm", bodies, args.duration)
                served += bench_served(srv, "echo", {k: bodies[k] for k in (1, RANKING_ROWS)}, args.duration)
                log(f"the served targets' sides back to back: {TURNS} turns of {TURN_SECONDS:.0f} s per point")
                turns = bench_turns(srv, served_model, cfg, bodies, TURNS, TURN_SECONDS, host)
                workers = len(srv.worker_pids("dlrm"))
        finally:
            host.close()

    report = {
        "config": cfg_path.name,
        "machine": {
            **(mach := machine()),
            "processor": f"{mach['cpu']}, ISA {mach['isa']}",
            "torch": torch.__version__,
            "torch_threads": threads,
        },
        "torchserve": {k: ts_doc.get(k) for k in ("batchSize", "maxBatchDelay")}
        | {"workers": workers, "warm_up_s": WARM_UP_S},
        "raw_forward": raw,
        "handler": handler_rows,
        "served": served,
        "turns": turns,
        "wall_s": round(time.perf_counter() - started),
    }
    report["targets"] = targets(handler_rows, turns, served, len(host.cpus))
    out = run_dir(
        __file__, "benchmark", "The serving path against the model's own speed and TorchServe's ceiling", args.out
    )
    write_report(out / "benchmark", report, markdown(report).splitlines(), plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
