#!/usr/bin/env python
"""MLPerf's Server scenario under MLPerf's LoadGen, per config and variant, against a real TorchServe.

    python bench/server_scenario.py                                   # criteo; dlrmv2 fp32, bf16, int8
    python bench/server_scenario.py --configs model-config.criteo.yaml --variant b1:batchSize=1
    python bench/server_scenario.py --configs model-config.dlrmv2.yaml --variant fp32: \\
        --variant int8:handler.dense_precision=int8 --max-seconds 40 --steps 4

Per config and variant (``NAME:key=value,...``: a handler key as ``handler.KEY``, a TorchServe
per-model key such as batchSize or maxBatchDelay, ``workers`` for min = max workers, or an
upper-case environment variable such as OMP_NUM_THREADS; ``NAME:`` alone is the config as it
is): the archive is built with that overlay and served by a private TorchServe; the host's raw
forward of the same archive at batch 256 (bench/common.HostForward: the dense half at the
archive's precision) is measured before and after; LoadGen (bench/mlperf.py) offers queries of
100-700 pairs at a rate found by bisection, each run at least --seconds and 500 queries, and the
highest rate LoadGen calls VALID (p99 <= 60 ms) with no failed query is the result. Writes
server-scenario.json, .md, .png (p99 against the offered rate per config and variant, the 60 ms
bound drawn), run.json and loadgen/ (LoadGen's summary of every run) to results/<date>-server-scenario/
(--out DIR).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench import mlperf
from bench.common import HostForward, ROOT, build_archive, frontend_pid, jit_cpu_seconds, jit_cpu_since, load_served
from bench.common import clock_mhz, dense_macs_per_row, int8_peak, log, machine, md_table, metric_value, run_dir
from bench.common import parse_variant, serving, unpack, write_report
from scripts.tsctl import WARMUP_KEY

HOST_BATCH = 256
# The targets per config (issue 45's): pairs/s at the bound over an anchor measured in the same run.
# criteo: 0.5 x the host's raw forward of the served archive; dlrmv2: 2.5 x stock torchrec's fp32
# forward (its DLRM_DCN and EmbeddingBagCollection, one single-thread process per CPU, batch 256).
TARGETS = {"criteo": ("host", 0.5), "dlrmv2": ("stock", 2.5)}
# dlrmv2 on a host without AMX (2 cores, AVX-512): a VALID rate of at least this many queries/s, or the
# compute floor (mlperf.shared_p99_ms) over the bound at that rate; on an AMX host TARGETS' stands.
RATE_TARGETS = {"dlrmv2": 5.0}
# The default variants per config. DLRMv2's `int8` is the config as shipped (its worker runs a forward of
# more than 350 rows as parts at once: handler.split_rows); `int8-whole` the same server with every forward
# whole, on one thread (docs/performance.md#both-cores-for-a-large-query).
# `binary` variants: the same archive, the queries as Open Inference Protocol v2 binary tensors (as
# tritonclient sends them) rather than the kit's columns JSON.
VARIANTS = {
    "criteo": ["shipped:", "binary:form=v2-binary"],
    "dlrmv2": [
        "fp32:handler.dense_precision=fp32",
        "bf16:handler.dense_precision=bf16",
        "int8:",
        "int8-binary:form=v2-binary",
        "int8-whole:handler.split_rows=0",
    ],
}


def measure(cfg_path: Path, variant: str, items: dict, tmp: Path, args) -> dict:
    """Build, serve and search one config + variant; the host's forward before and after."""
    import torch

    from dlrmkit.config import DLRMConfig
    from dlrmkit.cpus import split_parts, torch_threads
    from dlrmkit.dense import isa_summary

    key = cfg_path.stem.removeprefix("model-config").strip(".") or "seed"
    items = dict(items)
    split = int(items.pop("split", args.split_pairs))  # the load generator's, not the server's
    form = mlperf.pop_form(variant, items, args.form)  # how the load generator sends the queries
    tag = f"{key}-{variant}" + ("" if form == "columns" else f"-{form}") + (f"-split{split}" if split else "")
    name = tag.replace("-", "_").replace(".", "_")
    # An int8 dense half takes static activation scales from a sample of the traffic: the random
    # model's traffic is the queries themselves, so the sample is drawn like them (another seed).
    calibrate = tmp / f"calibration-{key}.jsonl"
    if not calibrate.exists():
        sample = mlperf.query_pool(DLRMConfig.from_yaml(cfg_path), 8, seed=5)
        calibrate.write_bytes(b"\n".join(q.body for q in sample) + b"\n")
    source, doc, env = build_archive(cfg_path, tmp / "store", name, items, calibrate)
    cfg = DLRMConfig.from_yaml(source)
    model_dir = unpack(tmp / "store" / f"{name}.mar", tmp / name)
    torch.set_num_threads(1)
    model, dense = load_served(cfg, model_dir)
    # both forwards run the queries' shape: MLPerf's multi-hot bags for a DCN config
    bags = mlperf.mlperf_bags(cfg)
    host = HostForward(source, model_dir, model, cfg, bags)
    stock = HostForward(source, None, None, cfg, bags) if TARGETS.get(key, ("",))[0] == "stock" else None
    pool = mlperf.query_pool(cfg, args.queries, form=form, split=split)
    mean_pairs = sum(q.pairs for q in pool) / len(pool)
    try:
        before = host.measure(HOST_BATCH, args.host_seconds)
        log(f"{tag}: dense half {dense}; host raw forward at B={HOST_BATCH}: {before['rows_per_s']:,} rows/s")
        stock_before = stock.measure(HOST_BATCH, args.host_seconds) if stock else None
        if stock_before:
            log(f"{tag}: stock torchrec fp32 forward at B={HOST_BATCH}: {stock_before['rows_per_s']:,} rows/s")
        # a rate target (DLRMv2 without AMX) is where the search starts: its own run decides it
        start = args.start_qps or rate_target(key, isa_summary()) or 0.3 * before["rows_per_s"] / mean_pairs
        probe = mlperf.probe(cfg)
        with serving(tmp / f"home-{name}", tmp / "store", {name: probe}, env) as srv:
            url = srv.url + mlperf.path(form, name)
            procs = lambda: {"frontend": [frontend_pid(srv)], "workers": srv.worker_pids(name)}  # noqa: E731

            def warm_load(s: float) -> dict:  # s seconds at half the search's first rate
                return mlperf.run(url, pool, start / 2, s, min_queries=1, max_seconds=s)

            warm = warm_up(warm_load, frontend_pid(srv), args.warm_up, args.warm_up_max)

            def run_once(qps: float, min_queries: int, max_seconds: float) -> dict:
                out = Path(args.loadgen_dir) / f"{tag}-{qps:.2f}qps.txt"
                jit0 = jit_cpu_seconds(frontend_pid(srv))
                r = mlperf.run(url, pool, qps, args.seconds, min_queries, max_seconds, out, procs)
                jit = jit_cpu_since(frontend_pid(srv), jit0)
                r["frontend_jit_cpu_us_per_query"] = round(jit / max(1, r["queries"]) * 1e6)
                why = f" ({', '.join(r['unsatisfied'])} not satisfied)" if r.get("unsatisfied") else ""
                log(
                    f"  {tag} {qps:.2f} q/s: {'VALID' if r['valid'] else 'INVALID'}{why}, p99 {r.get('p99_ms')} ms, "
                    f"{r['queries']} queries, {r['pairs_per_s']:,} pairs/s, {r['errors']} failed"
                )
                return r

            def run_at(qps: float) -> dict:
                first = run_once(qps, args.min_queries, args.max_seconds)
                if mlperf.more_queries(first) is not None:
                    log(f"  {tag} {qps:.2f} q/s: early stopping undecided ({first['early_stopping']})")
                return mlperf.decide(run_once, qps, first, args.max_seconds, args.decide_max_seconds)

            # below min queries / max seconds a rate cannot reach LoadGen's query count: INVALID by the cap
            found = mlperf.search(run_at, start, steps=args.steps, floor=args.min_queries / args.max_seconds)
            workers = len(srv.worker_pids(name))
            most = split_parts(torch_threads(cfg.threads.torch_threads, workers))
            profile = query_profile(srv, name, url, pool, model, cfg, form, args.profile_reps, most)
        ready_runs = []
        if args.ready_run and found["best"]:
            qps = found["best"]["target_qps"] / 2
            # as shipped (ready once the plugin's warm-up ended: the properties' dlrm_warmup_seconds) and
            # with the warm-up off (ready when a worker has loaded), args.ready_run fresh servers each,
            # in turns and the order swapped each turn
            for i in range(args.ready_run):
                for off in (False, True) if i % 2 == 0 else (True, False):
                    how = "off" if off else "shipped"
                    overrides = {WARMUP_KEY: 0} if off else {}
                    home = tmp / f"home-{name}-ready-{i}-{how}"
                    x = ready_run(
                        lambda home=home, overrides=overrides: serving(home, tmp / "store", {name: probe}, env, overrides=overrides),
                        form, name, pool, qps, args, f"{tag}-{i}-warm-up-{how}", frontend_pid,
                    )  # fmt: skip
                    ready_runs.append({"warm_up": how, **x})
        after = host.measure(HOST_BATCH, args.host_seconds)
        stock_after = stock.measure(HOST_BATCH, args.host_seconds) if stock else None
    finally:
        host.close()
        if stock:
            stock.close()
    host_rows = (before["rows_per_s"] + after["rows_per_s"]) / 2
    best = found["best"] or {"target_qps": 0, "pairs_per_s": 0, "p99_ms": None}
    row = {"config": cfg_path.name, "variant": variant, "form": form, "overlay": items, "dense": dense}
    with contextlib.suppress(ValueError):  # an interaction it does not count: no MACs, no peak share
        row["dense_macs_per_row"] = dense_macs_per_row(cfg)
    row.update(split_pairs=split, workers=workers, warm_up=warm, ready_runs=ready_runs)
    row.update(batch_size=doc.get("batchSize"), pairs_mean=round(mean_pairs, 1), host_before=before, host_after=after)
    row.update(host_rows_per_s=round(host_rows), cpus=before["cpus"], runs=found["runs"], valid_qps=best["target_qps"])
    row.update(
        pairs_per_s=best["pairs_per_s"], p99_ms=best["p99_ms"], vs_host=round(best["pairs_per_s"] / host_rows, 3)
    )
    if stock_before and stock_after:
        stock_rows = (stock_before["rows_per_s"] + stock_after["rows_per_s"]) / 2
        row.update(stock_before=stock_before, stock_after=stock_after, stock_rows_per_s=round(stock_rows))
        row["vs_stock"] = round(best["pairs_per_s"] / stock_rows, 3)
    anchor, bound = TARGETS.get(key, (None, None))
    if anchor:
        row["target"] = {"anchor": anchor, "bound": bound, "ratio": row[f"vs_{anchor}"]}
        row["target"]["met"] = row["target"]["ratio"] >= bound
    row["profile"] = profile
    judge(row, key, isa_summary())
    if row.get("next_lever"):
        log(f"{tag}: target missed; next lever: {row['next_lever']}")
    log(f"{tag}: highest VALID rate {row['valid_qps']} q/s, {row['pairs_per_s']:,} pairs/s ({row['vs_host']} of host)")
    return row


class JitSampler:
    """The frontend JVM's JIT compiler threads' CPU seconds, read every ``every`` s on a thread of
    its own: what the compilers took while a given query waited (``share``, CPUs busy compiling)."""

    def __init__(self, pid: int, every: float = 0.05):
        self.pid, self.every = pid, every
        self.samples: list[tuple[float, float]] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.is_set():
            with contextlib.suppress(Exception):  # the JVM gone at the end
                self.samples.append((time.monotonic(), sum(jit_cpu_seconds(self.pid).values())))
            time.sleep(self.every)

    def stop(self) -> None:
        self.done.set()
        self.thread.join()

    def share(self, a: float, b: float) -> float | None:
        """Mean CPUs the compilers used between monotonic times ``a`` and ``b`` (None: too few samples)."""
        win = [s for s in self.samples if a <= s[0] <= b]
        if len(win) < 2 or win[-1][0] <= win[0][0]:
            return None
        return round((win[-1][1] - win[0][1]) / (win[-1][0] - win[0][0]), 2)


def ready_run(start, form: str, name: str, pool: list, qps: float, args, tag: str, jit_pid=None) -> dict:
    """Ready means warm: a fresh server (``start()``, a context manager that yields it once it
    reports ready: a probe scored), LoadGen at ``qps`` (half the highest VALID rate) the moment it
    is ready, no warm-up, one run: LoadGen's verdict, p99, max and max / p99, how long the server
    took to be ready, and the slowest queries with when they were sent (s after the run began).
    ``jit_pid(srv)``: the frontend JVM, whose JIT compilers' CPU is sampled meanwhile: per slow
    query the CPUs they used from 0.3 s before it was sent to its answer, and over the run's first
    10 s against its last 10 (what attributes the stragglers of a server just made ready)."""
    t0 = time.perf_counter()
    with start() as srv:
        ready_s = round(time.perf_counter() - t0, 1)
        warmed = plugin_warm_up(srv)
        jit = JitSampler(jit_pid(srv)) if jit_pid else None
        out = Path(args.loadgen_dir) / f"{tag}-{qps:.2f}qps-at-ready.txt"
        try:
            url = srv.url + mlperf.path(form, name)
            r = mlperf.run(url, pool, qps, args.seconds, args.min_queries, args.max_seconds, out)
        finally:
            if jit:
                jit.stop()
    r.update(ready_s=ready_s, max_over_p99=round(r["max_ms"] / r["p99_ms"], 2) if r.get("p99_ms") else None)
    if warmed:
        r["plugin_warm_up"] = warmed
    if jit:
        t, end = r["started_at"], jit.samples[-1][0] if jit.samples else r["started_at"]
        for q in r["slowest"]:
            q["jit_cpus"] = jit.share(t + q["at_s"] - 0.3, t + q["at_s"] + q["ms"] / 1000)
        r["jit_cpus_first_10s"], r["jit_cpus_last_10s"] = jit.share(t, t + 10), jit.share(end - 10, end)
    log(
        f"  {tag} at ready, {qps:.2f} q/s: {'VALID' if r['valid'] else 'INVALID'}, p99 {r.get('p99_ms')} ms, "
        f"max {r.get('max_ms')} ms; slowest: {r['slowest'][:3]}"
    )
    return r


WARM_UP_ENDED = re.compile(
    r"warm-up ended after (?P<requests>\d+) requests in (?P<rounds>\d+) round\(s\), (?P<seconds>[0-9.]+) s, "
    r"the JIT at (?P<jit_share>[0-9.]+|n/a) of a CPU in the last round"
)


def plugin_warm_up(srv) -> dict | None:
    """What the plugin's warm-up did before the server said ready (plugin/.../Warmup.java's line in
    ts_log.log): requests, rounds, seconds, the JIT's share of a CPU in its last round; None when
    there was none (dlrm_warmup_seconds=0) or no log (not a TorchServe)."""
    log_dir = getattr(srv, "log_dir", None)
    try:
        m = WARM_UP_ENDED.search((Path(log_dir) / "ts_log.log").read_text()) if log_dir else None
    except OSError:
        return None
    if not m:
        return None
    d = m.groupdict()
    jit = None if d["jit_share"] == "n/a" else float(d["jit_share"])
    return {
        "requests": int(d["requests"]),
        "rounds": int(d["rounds"]),
        "seconds": float(d["seconds"]),
        "jit_share": jit,
    }


READY_HOW = {"shipped": "as shipped", "off": "with the warm-up off (dlrm_warmup_seconds=0)"}
JIT_SETTLED = 0.03  # of one CPU: the frontend's JIT compilers at about this share once its paths are compiled


def warm_up(load, frontend: int, seconds: float, most: float) -> dict:
    """``load(seconds)`` in rounds until the frontend JVM's compiler threads spent under
    JIT_SETTLED of a CPU in a round, or ``most`` seconds in all: a server that has run a while is
    what is measured. The JVM compiles its paths for these large bodies over tens of seconds of
    load (on 2 CPUs ~1.5 s of compiler CPU in the first 10 s of DLRMv2 queries, ~0.15 s per 10 s
    after ~50 s), taking a CPU from the workers meanwhile."""
    rounds, spent, share, shares = 0, 0.0, None, []
    while spent < most:
        jit0, t0 = jit_cpu_seconds(frontend), time.perf_counter()
        load(seconds)
        took = time.perf_counter() - t0
        share = jit_cpu_since(frontend, jit0) / took
        rounds, spent = rounds + 1, spent + took
        shares.append(round(share, 4))
        log(f"  warm-up round {rounds}: {took:.0f} s, the frontend's JIT at {share:.1%} of a CPU")
        if share < JIT_SETTLED:
            break
    return {"seconds": round(spent), "rounds": rounds, "jit_share": round(share or 0.0, 4), "jit_shares": shares}


STAGES = ("parse", "collate", "lookup", "dense", "respond")


def _stage_ms(model, cfg, query: mlperf.Query, form: str, reps: int) -> dict[str, float]:
    """Median ms of each stage of one query in this process, on the served model (as a worker
    loads it, one thread): the kit's own parse (dlrmkit.protocols), collate, the sparse arch
    (lookup), the rest of the forward (dense: bottom MLP, interaction, top MLP), the answer."""
    import torch

    from dlrmkit.batch import collate, scores
    from dlrmkit.forms import RequestParser
    from dlrmkit.protocols import open_request

    times, h = {k: [] for k in STAGES}, query.headers
    how = (form == "v2-binary", h.get(mlperf.BINARY_HEADER), RequestParser(cfg), ("m", "1"), h.get("Content-Type"))
    for i in range(reps + 1):  # the first is a warm-up
        t0 = time.perf_counter()
        req = open_request(query.body, *how)
        parsed = req.parse()
        t1 = time.perf_counter()
        batch, bad = collate([parsed], cfg)
        if bad:
            raise RuntimeError(f"the profile's query was refused: {bad}")
        t2 = time.perf_counter()
        with torch.inference_mode():
            model.sparse_arch(batch.sparse)
        t3 = time.perf_counter()
        (answer,) = scores(model, batch, cfg)
        t4 = time.perf_counter()
        req.answer(answer)
        t5 = time.perf_counter()
        if i:
            for k, v in zip(STAGES, (t1 - t0, t2 - t1, t3 - t2, (t4 - t3) - (t3 - t2), t5 - t4)):
                times[k].append(v * 1000)
    return {k: round(statistics.median(v), 2) for k, v in times.items()}


PHASES = ("preprocess", "inference", "postprocess")  # the handler's own counters, dlrm_<phase>_ms_total


def counted(srv, name: str, counters: list, at_least: float = 0, wait_s: float = 15) -> dict:
    """The model's ``counters`` once ``dlrm_requests_total`` has reached ``at_least`` and then held
    still for one more read (a worker's counters reach the frontend's metrics a little after its
    answers, and not all at once); what they are at ``wait_s`` if that never happens."""
    deadline, last = time.monotonic() + wait_s, None
    while True:
        now = {c: metric_value(srv, name, c) for c in counters}
        if (now["dlrm_requests_total"] >= at_least and now == last) or time.monotonic() > deadline:
            return now
        last = now
        time.sleep(0.2)


def query_profile(
    srv, name: str, url: str, pool: list, model, cfg, form: str, reps: int, split_most: int = 1
) -> list[dict]:
    """Where one query's time goes, for the pool's largest and smallest query: each sent alone
    ``reps`` times (no other load: no queueing; a split query's requests at once, as LoadGen's
    client sends them), its latency at the client (median), the worker's own time per request
    and phase (the handler's counters in TorchServe's metrics), the rest (frontend, transport,
    TorchServe's batching), and the stages of its (first) request in this process, whole on one
    thread. ``server_parts``: the parts the worker runs its (first) request as at once
    (``handler.split_rows``; ``split_most``: the worker's CPUs over its threads)."""
    from dlrmkit.batch import row_spans

    sut = mlperf.HttpSUT(url, [], threads=8)
    counters = ["dlrm_requests_total", *(f"dlrm_{p}_ms_total" for p in PHASES)]
    out = []
    try:
        for q in (max(pool, key=lambda q: q.pairs), min(pool, key=lambda q: q.pairs)):
            reqs = q.parts or ((q.body, q.headers),)

            def send(reqs=reqs) -> float:
                t0 = time.perf_counter()
                if (status := sut.post_all(reqs)) != 200:
                    raise RuntimeError(f"the profile's query was answered {status}")
                return (time.perf_counter() - t0) * 1000

            # the workers' counters reach the frontend's metrics a little after their answers: count
            # from where the two warm-up sends have landed, to where the timed sends have
            start = counted(srv, name, counters)
            send(), send()
            before = counted(srv, name, counters, start["dlrm_requests_total"] + 2 * len(reqs))
            client = [send() for _ in range(reps)]
            want = reps * len(reqs)
            after = counted(srv, name, counters, before["dlrm_requests_total"] + want)
            n = after["dlrm_requests_total"] - before["dlrm_requests_total"]
            worker = {p: round((after[f"dlrm_{p}_ms_total"] - before[f"dlrm_{p}_ms_total"]) / n, 2) for p in PHASES}
            row = {
                "pairs": q.pairs,
                "requests": len(reqs),
                "server_parts": len(row_spans(-(-q.pairs // len(reqs)), cfg.threads.split_rows, split_most)),
                "reps": reps,
                "client_ms": round(statistics.median(client), 2),
            }
            if n == want:  # else another request was counted, or a count is missing: no worker figures
                row.update(worker_ms=worker, outside_worker_ms=round(row["client_ms"] - sum(worker.values()), 2))
            row["stages_ms"] = _stage_ms(model, cfg, mlperf.Query(0, *reqs[0]), form, reps)
            out.append(row)
    finally:
        sut.part_senders.shutdown(wait=True)
        sut.senders.shutdown(wait=True)
    return out


def next_lever(
    largest: dict, cpu_ms: dict[str, float], busy_at_target: float | None, bound_ms: float = mlperf.P99_BOUND_MS
) -> str:
    """What to change first, read off the profile: the largest query's time alone when it nearly
    fills the bound (no rate can pass), else the CPU per query when the target rate would keep
    the CPUs busy, else the queueing between them.

    >>> q = {"pairs": 700, "client_ms": 55.0, "outside_worker_ms": 9.0,
    ...      "stages_ms": {"parse": 7.0, "collate": 1.0, "lookup": 14.0, "dense": 20.0, "respond": 0.1}}
    >>> next_lever(q, {"frontend": 8.0, "workers": 24.0}, 0.9).split(":")[0]
    'the time of one query'
    >>> next_lever({**q, "client_ms": 20.0}, {"frontend": 8.0, "workers": 24.0}, 0.9).split(":")[0]
    'CPU per query'
    >>> next_lever({**q, "client_ms": 20.0}, {"frontend": 8.0, "workers": 24.0}, 0.4).split(":")[0]
    'queueing'
    """
    parts = {**largest["stages_ms"]}
    if largest.get("outside_worker_ms") is not None:
        parts["frontend and transport"] = largest["outside_worker_ms"]
    top = max(parts, key=lambda k: parts[k])
    if largest["client_ms"] >= 0.8 * bound_ms:
        n, pieces = largest.get("requests", 1), largest.get("server_parts", 1)
        how = f"as {n} requests at once" if n > 1 else f"as {pieces} parts at once" if pieces > 1 else "on one core"
        cure = f"split one query's rows across the CPUs, or cut {top}" if n == pieces == 1 else f"cut {top}"
        return (
            f"the time of one query: the {largest['pairs']}-pair query alone takes {largest['client_ms']:g} ms of the "
            f"{bound_ms:g} ms bound {how}, its largest part {top} ({parts[top]:g} ms); no rate can pass while it "
            f"does: {cure}"
        )
    spent = ", ".join(f"{k} {v:g} ms" for k, v in cpu_ms.items())
    if busy_at_target is not None and busy_at_target >= 0.7:
        most = max(cpu_ms, key=lambda k: cpu_ms[k])
        whose = {"frontend": "the frontend's", "workers": "the workers'", "client": "the load generator's"}
        return (
            f"CPU per query: at the target rate the CPUs would be {busy_at_target:.0%} busy ({spent} per query); "
            f"cut {whose.get(most, most)} CPU per query first"
        )
    busy = "unknown" if busy_at_target is None else f"{busy_at_target:.0%}"
    return (
        f"queueing: one {largest['pairs']}-pair query alone takes {largest['client_ms']:g} ms and the target rate "
        f"would keep the CPUs {busy} busy ({spent} per query): keep a large query from waiting behind another"
    )


def target_cpu(row: dict) -> tuple[dict[str, float], float | None]:
    """CPU ms per query by group (frontend, workers, client) at the highest offered rate that has
    them, and how busy the CPUs would be at the target's rate (a rate target's, else the target's
    pairs/s over the mean pairs per query) if the CPU per query stayed as measured."""
    runs = [r for r in row["runs"] if "workers_cpu_us_per_query" in r]
    if not runs:
        return {}, None
    r = max(runs, key=lambda r: r["target_qps"])
    cpu = {g: round(r[f"{g}_cpu_us_per_query"] / 1000, 1) for g in ("frontend", "workers", "client")}
    t = row.get("target")
    if row.get("rate_target"):
        target_qps = row["rate_target"]["qps"]
    elif t:
        anchor_rows = row["stock_rows_per_s"] if t["anchor"] == "stock" else row["host_rows_per_s"]
        target_qps = t["bound"] * anchor_rows / row["pairs_mean"]
    else:
        return cpu, None
    return cpu, round(sum(cpu.values()) / 1000 * target_qps / row["cpus"], 3)


def short(dense: str) -> str:
    """dense.prepare's line without its details: ``int8 static``, ``fp32 (FALLING BACK from int8)``.

    >>> short("bf16 (autocast), Inductor with freezing"), short("fp32 (FALLING BACK from int8: no VNNI)")
    ('bf16', 'fp32 (FALLING BACK from int8)')
    """
    if "FALLING BACK" in dense:
        return dense.split(": ")[0] + (")" if ": " in dense else "")
    return dense.split(" (")[0]


def label(row: dict) -> str:
    """A row's variant as the tables name it: ``int8``, ``b1 split 350``."""
    form = f" ({row['form']})" if row.get("form", "columns") != "columns" and "binary" not in row["variant"] else ""
    return row["variant"] + form + (f" split {row['split_pairs']}" if row.get("split_pairs") else "")


def markdown(report: dict) -> list[str]:
    m, bound = report["machine"], mlperf.P99_BOUND_MS
    split = ""
    if any(r.get("split_pairs") for r in report["rows"]):
        split = "; a variant marked `split N`: a query of more than N pairs goes as ceil(pairs / N) requests of "
        split += "nearly equal size at once, done when all are answered (the load generator's doing: a client "
        split += "spreading a large query over the workers)"
    lines = [
        f"**Server scenario under MLPerf LoadGen** ({m['cpu']}, {m['available_cpus']} CPUs, ISA {m['isa']}, torch's "
        f"kernels {m['isa_served']}; load average {m['load_average_at_start'][0]} at the start, "
        f"{m['load_average'][0]} at the end: a shared machine): queries of {mlperf.PAIRS[0]}-{mlperf.PAIRS[1]} pairs "
        f"(`{report.get('form', 'columns')}` form{split}), Poisson arrivals, runs of at least {report['seconds']:g} s and {report['min_queries']} "
        f"queries, at most {report['max_seconds']:g} s (a rate below {report['min_queries'] / report['max_seconds']:.1f} "
        f"q/s cannot send that many: INVALID by the cap, the search goes no lower; a rate LoadGen's early stopping alone "
        "leaves undecided, p99 under the bound, runs again with the queries LoadGen asks for and half again: that "
        f"run's verdict stands); the highest offered rate LoadGen calls VALID (p99 <= {bound:.0f} ms) "
        "with no failed query. LoadGen's summaries: loadgen/ beside this report.",
        "",
    ]
    header = "config | variant | dense half | workers | VALID q/s | pairs/s | per core | p99 ms | host raw forward "
    header += f"B={HOST_BATCH} rows/s | pairs/s / host | runs (q/s: p99 ms, V = VALID)"
    cells = [
        [r["config"], label(r), short(r["dense"]), r["workers"], r["valid_qps"] or "none", f"{r['pairs_per_s']:,}"]
        + [f"{r['pairs_per_s'] // r['cpus']:,}", r["p99_ms"] or "", f"{r['host_rows_per_s']:,}", r["vs_host"]]
        + [", ".join(f"{x['target_qps']}: {x.get('p99_ms')}{' V' if x['ok'] else ''}" for x in r["runs"])]
        for r in report["rows"]
    ]
    lines += md_table(header.split(" | "), cells, align="lllrrrrrrrl")
    stock = [r for r in report["rows"] if r.get("stock_rows_per_s")]
    lines += [
        "",
        *(
            f"Stock torchrec's fp32 forward ({r['config']}, {label(r)} run; torchrec's own modules, one "
            f"single-thread process per CPU, B={HOST_BATCH}): {r['stock_rows_per_s']:,} rows/s "
            f"({r['stock_before']['rows_per_s']:,} before, {r['stock_after']['rows_per_s']:,} after the search)."
            for r in stock
        ),
        "",
        *target_lines(report["rows"]),
    ]
    return (
        lines
        + forward_lines(report)
        + profile_lines(report)
        + ["", "p99 against the offered rate: [server-scenario.png](server-scenario.png)."]
    )


def floor_said(row: dict, qps: float) -> str:
    """Whether the compute floor forbids ``qps`` (``row['floor']``, floor_rates), in words.

    >>> print(floor_said({"floor": [{"qps": 5.0, "p99_ms": 41.5}]}, 5.0))
    the compute floor allows it (p99 41.5 ms at 5 q/s under the 60 ms bound): the server's own costs are what misses it.
    >>> print(floor_said({"floor": [{"qps": 5.0, "p99_ms": 71.0}]}, 5.0))
    the compute floor forbids it (p99 71 ms at 5 q/s over the 60 ms bound).
    """
    f = floor_at(row, qps)
    if f is None:
        return "the compute floor not computed (no raw forward measured)."
    if f["p99_ms"] > mlperf.P99_BOUND_MS:
        return f"the compute floor forbids it (p99 {f['p99_ms']:g} ms at {qps:g} q/s over the {mlperf.P99_BOUND_MS:g} ms bound)."
    return (
        f"the compute floor allows it (p99 {f['p99_ms']:g} ms at {qps:g} q/s under the {mlperf.P99_BOUND_MS:g} ms "
        "bound): the server's own costs are what misses it."
    )


def target_lines(rows: list[dict]) -> list[str]:
    """Each row's targets, met or missed, and its compute floor (judge)."""
    anchors = {"host": "the host's raw forward of the served archive", "stock": "stock torchrec's fp32 forward"}
    return [
        *(
            f"Target ({r['config']}, {label(r)}): pairs/s >= {t['bound']} x {anchors[t['anchor']]}: "
            f"{t['ratio']}, {'met' if t['met'] else 'missed'}"
            + (
                " (the target of a host with AMX; this one has none: the rate target below)."
                if r.get("rate_target")
                else "."
            )
            for r in rows
            if (t := r.get("target"))
        ),
        *(
            f"Target ({r['config']}, {label(r)}, a host without AMX): VALID at >= {t['qps']:g} q/s, or the compute "
            f"floor forbidding it: {'met' if t['met'] else 'missed'} (highest VALID rate {r['valid_qps'] or 'none'}); "
            + floor_said(r, t["qps"])
            for r in rows
            if (t := r.get("rate_target"))
        ),
        *(
            f"Compute floor ({r['config']}, {label(r)}; a model, bench/mlperf.py's shared_p99_ms: these queries at "
            f"the host's raw forward of {r['host_rows_per_s']:,} rows/s on all CPUs, shared by the queries in "
            f"flight, no other cost): "
            + "; ".join(
                f"at {f['qps']:g} q/s p99 {f['p99_ms']:g} ms, "
                + (
                    f"{f['p99_with_over_ms']:g} ms"
                    if f["p99_with_over_ms"] is not None
                    else f"no steady state (the machine {f['busy_with_over']:g}x busy)"
                )
                + f" with the {f['over_ms']:g} ms "
                "the largest query alone took over its floor added to each query"
                for f in r["floor"]
            )
            + f" (bound {mlperf.P99_BOUND_MS:g} ms)."
            for r in rows
            if r.get("floor")
        ),
    ]


def forward_lines(report: dict) -> list[str]:
    """The raw forwards of the run per config and precision, all cores and per core, beside MLPerf's
    published per-core figure (a split or binary variant serves the same archive as its twin: left out)."""
    rows, seen = [], set()
    for r in report["rows"]:  # each archive once: a split or binary variant serves its twin's archive
        archive = (r["config"], json.dumps(r.get("overlay") or {}, sort_keys=True))
        if not r.get("split_pairs") and archive not in seen:
            rows.append(r)
            seen.add(archive)
    peak = report.get("machine", {}).get("int8_peak")
    lines = [
        "",
        f"**The raw forward per precision** (no server, B={HOST_BATCH}, one single-thread process per CPU, mean of "
        "before and after the search; per core: all cores / CPUs). Context: " + mlperf.PUBLISHED + ".",
        "",
    ]
    header = "config | dense half | served archive, all cores rows/s | per core | stock torchrec fp32, per core | "
    header += "vs stock | per core / MLPerf's per core | dense MACs per row | per core, share of the int8 peak"
    cells = []
    for r in rows:
        per_core, stock = r["host_rows_per_s"] // r["cpus"], r.get("stock_rows_per_s")
        # Only the DLRMv2 config has the stock anchor, and only it is MLPerf's model.
        mlperf_cells = ["n/a"] * 3
        if stock:
            mlperf_cells = [f"{stock // r['cpus']:,}", f"{r['host_rows_per_s'] / stock:.2f}"]
            mlperf_cells.append(f"{per_core / mlperf.PUBLISHED_PAIRS_PER_CORE:.2f}")
        macs = r.get("dense_macs_per_row")
        share = f"{per_core * macs / peak['macs_per_s']:.3f}" if macs and peak else "n/a"
        cells.append(
            [r["config"], short(r["dense"]), f"{r['host_rows_per_s']:,}", f"{per_core:,}", *mlperf_cells]
            + [f"{macs / 1e6:.2f} M" if macs else "n/a", share]
        )
    lines += md_table(header.split(" | "), cells, align="llrrrrrrr")
    if peak:
        lines += [
            "",
            f"The int8 peak: {peak['isa']}, {peak['macs_per_cycle']:,} int8 multiply-accumulates per cycle per core "
            f"at the {peak['mhz']:,.0f} MHz /proc/cpuinfo reports = {peak['macs_per_s'] / 1e9:,.0f} G MACs/s per "
            "core. The share: the dense half's MACs (bottom MLP, interaction, over arch) at the per-core rate over "
            "that peak; the rate is the whole forward's (embedding lookups included), so the dense half alone is "
            "at least this near the machine's limit, whatever precision it runs at.",
        ]
    return lines


def floor_ms(q: dict, row: dict) -> float:
    """A profiled query's compute floor: its pairs at the host's raw forward of the served archive on
    every CPU (ms).

    >>> floor_ms({"pairs": 700}, {"host_rows_per_s": 20_000})
    35.0
    """
    return round(q["pairs"] / row["host_rows_per_s"] * 1000, 2)


def rate_target(key: str, isa: str) -> float | None:
    """The queries/s config ``key`` must pass on a host whose ``isa`` has no AMX (RATE_TARGETS), else None.

    >>> rate_target("dlrmv2", "avx512_vnni,avx512f"), rate_target("dlrmv2", "amx_int8,avx512f"), rate_target("criteo", "avx2")
    (5.0, None, None)
    """
    return RATE_TARGETS.get(key) if "amx" not in isa else None


def floor_at(row: dict, qps: float) -> dict | None:
    """``row``'s compute floor at ``qps`` (floor_rates), or None where it was not computed."""
    return next((f for f in row.get("floor") or [] if f["qps"] == qps), None)


def judge(row: dict, key: str, isa: str) -> None:
    """``row``'s rate target (rate_target), its compute floor (floor_rates), the CPU at the target
    (target_cpu) and a missed target's next lever, from what the row measured: a run's report read
    back gets them too."""
    if (qps := rate_target(key, isa)) is not None:
        row["rate_target"] = {"qps": qps, "met": (row["valid_qps"] or 0) >= qps}
    row["floor"] = floor_rates(row)
    row["cpu_ms_per_query"], row["busy_at_target"] = target_cpu(row)
    row.pop("next_lever", None)
    if row.get("profile") and not row.get("rate_target", row.get("target", {})).get("met", True):
        row["next_lever"] = next_lever(row["profile"][0], row["cpu_ms_per_query"], row["busy_at_target"])
        at = floor_at(row, row["rate_target"]["qps"]) if row.get("rate_target") else None
        if at and at["p99_ms"] <= mlperf.P99_BOUND_MS < (at["p99_with_over_ms"] or float("inf")):
            row["next_lever"] = (
                f"the server's time over the compute floor: the {row['profile'][0]['pairs']}-pair query alone took "
                f"{at['over_ms']:g} ms more than its floor; at the floor {at['qps']:g} q/s has a p99 of "
                f"{at['p99_ms']:g} ms, with that much more a query "
                + (f"{at['p99_with_over_ms']:g} ms" if at["p99_with_over_ms"] is not None else "no steady state")
                + " (bench/mlperf.py's "
                "shared_p99_ms): cut what a query costs beyond its forward (parse, transport, the split's imperfect overlap)"
            )


def floor_rates(row: dict) -> list[dict]:
    """The compute floor's p99 (``mlperf.shared_p99_ms``: the host's raw forward shared by the queries
    in flight, a model) at the rates that decide ``row``: its rate target, and the lowest rate
    LoadGen called INVALID above the highest VALID one; alone, and with the largest profiled
    query's time over its own floor (``over_ms``: what the server adds to a query) added to each.

    >>> row = {"host_rows_per_s": 20_000, "pairs_mean": 270.0, "valid_qps": 0, "rate_target": {"qps": 5.0, "met": False},
    ...        "runs": [{"target_qps": 5.0, "ok": False}], "profile": [{"pairs": 700, "client_ms": 41.0}]}
    >>> floor_rates(row)
    [{'qps': 5.0, 'p99_ms': 40.5, 'over_ms': 6.0, 'busy_with_over': 0.1, 'p99_with_over_ms': 55.5}]
    >>> floor_rates({**row, "profile": [{"pairs": 700, "client_ms": 235.0}]})[0]["p99_with_over_ms"] is None  # 1.03 busy
    True
    """
    if not row.get("host_rows_per_s"):
        return []
    invalid = [x["target_qps"] for x in row["runs"] if not x["ok"] and x["target_qps"] > (row["valid_qps"] or 0)]
    rates = sorted(
        {*([row["rate_target"]["qps"]] if row.get("rate_target") else []), *([min(invalid)] if invalid else [])}
    )
    largest = (row.get("profile") or [None])[0]
    over = round(max(0.0, largest["client_ms"] - floor_ms(largest, row)), 2) if largest else 0.0
    out = []
    for q in rates:
        # the machine's share busy with ``over`` added: at 1 or more no p99 exists (the queue grows)
        busy = round(q * (row["pairs_mean"] / row["host_rows_per_s"] + over / 1000), 2)
        with_over = mlperf.shared_p99_ms(q, row["host_rows_per_s"], over) if busy < 1 else None
        out.append(
            {
                "qps": q,
                "p99_ms": mlperf.shared_p99_ms(q, row["host_rows_per_s"]),
                "over_ms": over,
                "busy_with_over": busy,
                "p99_with_over_ms": with_over,
            }
        )
    return out


def parts_note(q: dict) -> str:
    """``, 2 parts`` when the server ran a profiled request as parts at once (handler.split_rows)."""
    return f", {q['server_parts']} parts" if q.get("server_parts", 1) > 1 else ""


def profile_lines(report: dict) -> list[str]:
    """The profile of each row (query_profile, target_cpu) and the next lever of a missed target."""
    rows = [r for r in report["rows"] if r.get("profile")]
    if not rows:
        return []
    lines = [
        "",
        "**Where one query's time goes** (after the search: the pool's largest and smallest query, each sent alone "
        "(no queueing), median ms; the worker's phases from the handler's own counters; outside the worker: the "
        "frontend, the transport, TorchServe's batching; the stages: the same query in the bench's process on the "
        "served model, one thread; the compute floor: the query's pairs at the host's raw forward on all its "
        "CPUs, what no server of this archive can beat on this machine)",
        "",
    ]
    header = (
        "config | variant | pairs (requests, parts in the worker) | at the client | compute floor (client / floor) | "
        "worker, per request: preprocess / "
    )
    header += (
        "inference / postprocess | outside the worker | parse / collate / lookup / dense / respond (first request)"
    )
    cells = []
    for r in rows:
        for q in r["profile"]:
            worker = " / ".join(f"{q['worker_ms'][p]:g}" for p in PHASES) if q.get("worker_ms") else "n/a"
            stages = " / ".join(f"{q['stages_ms'][k]:g}" for k in STAGES)
            pairs, client = f"{q['pairs']} ({q.get('requests', 1)}{parts_note(q)})", f"{q['client_ms']:g}"
            floor = f"{floor_ms(q, r):g} ({q['client_ms'] / floor_ms(q, r):.2f})" if r.get("host_rows_per_s") else "n/a"
            cells.append(
                [r["config"], label(r), pairs, client, floor, worker, q.get("outside_worker_ms", "n/a"), stages]
            )
    lines += md_table(header.split(" | "), cells, align="llrrrlrl") + [""]
    for r in rows:
        cpu, busy = r.get("cpu_ms_per_query") or {}, r.get("busy_at_target")
        warm = r.get("warm_up")
        if warm:
            lines.append(
                f"Warm-up ({r['config']}, {label(r)}): {warm['seconds']} s in {warm['rounds']} round(s), the "
                f"frontend's JIT at {warm['jit_share']:.1%} of a CPU in the last (settled below {JIT_SETTLED:.0%})."
            )
        runs = r.get("ready_runs") or (  # a report from before the turns: one run, as shipped
            [{"warm_up": "shipped", **r["ready_run"]}] if r.get("ready_run") else []
        )
        for how in ("shipped", "off"):
            each = [x for x in runs if x["warm_up"] == how]
            if each:
                first = [x["first_5s"] for x in each if x.get("first_5s")]
                cold = (
                    f"; queries over 60 ms among those sent in the first 5 s: "
                    f"{sum(w['over_bound'] for w in first)} of {sum(w['queries'] for w in first)}, after: "
                    f"{sum(x['after_5s']['over_bound'] for x in each if x.get('after_5s'))} of "
                    f"{sum(x['after_5s']['queries'] for x in each if x.get('after_5s'))}"
                    if first
                    else ""
                )
                lines.append(
                    f"Ready means warm ({r['config']}, {label(r)}), {READY_HOW[how]}: {len(each)} fresh server(s), "
                    f"VALID in {sum(x['valid'] for x in each)}, max <= 2x p99 in "
                    f"{sum((x.get('max_over_p99') or 99) <= 2 for x in each)}, ready in "
                    + ", ".join(f"{x['ready_s']:g}" for x in each)
                    + f" s{cold}."
                )
        for x in runs:
            how = READY_HOW[x["warm_up"]]
            slow = "; ".join(
                f"{q['ms']:g} ms at {q['at_s']:g} s ({q['pairs']} pairs"
                + (f", the frontend's JIT at {q['jit_cpus']:g} CPUs meanwhile" if q.get("jit_cpus") is not None else "")
                + ")"
                for q in x["slowest"][:3]
            )
            if x.get("jit_cpus_first_10s") is not None:
                slow += (
                    f". The frontend's JIT compilers: {x['jit_cpus_first_10s']:g} CPUs over the first 10 s, "
                    f"{x.get('jit_cpus_last_10s')} over the last 10"
                )
            w = x.get("plugin_warm_up")
            spent = f" ({w['seconds']:g} s of it the plugin's warm-up, {w['requests']:,} requests)" if w else ""
            lines.append(
                f"Ready means warm ({r['config']}, {label(r)}), {how}: a fresh server, ready in {x['ready_s']:g} s{spent}, then "
                f"LoadGen at {x['target_qps']:g} q/s (half the highest VALID rate) at once: "
                f"{'VALID' if x['valid'] else 'INVALID'}, p99 {x.get('p99_ms')} ms, max {x.get('max_ms')} ms "
                f"({x.get('max_over_p99')}x p99; the target: at most 2x, VALID in one run)"
                + (
                    f"; the first 5 s: max {x['first_5s']['max_ms']} ms, after: max {x['after_5s']['max_ms']} ms"
                    if x.get("first_5s") and x.get("after_5s")
                    else ""
                )
                + f"; slowest: {slow}."
            )
        if cpu:
            run = max((x for x in r["runs"] if "workers_cpu_us_per_query" in x), key=lambda x: x["target_qps"])
            jit = run.get("frontend_jit_cpu_us_per_query")
            spent = ", ".join(f"{k} {v:g}" for k, v in cpu.items())
            spent += f" (the frontend's JIT {jit / 1000:g})" if jit is not None else ""
            at = f"; at the target's rate the {r['cpus']} CPUs would be {busy:.0%} busy" if busy is not None else ""
            lines.append(f"CPU ms per query ({r['config']}, {label(r)}, at {run['target_qps']} q/s): {spent}{at}.")
        if r.get("next_lever"):
            lines.append(f"Next lever ({r['config']}, {label(r)}): {r['next_lever']}.")
    return lines


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in report["rows"]:
        runs = sorted((x for x in r["runs"] if x.get("p99_ms")), key=lambda x: x["target_qps"])
        name = f"{r['config'].removeprefix('model-config.').removesuffix('.yaml')} {label(r)} ({short(r['dense'])})"
        (line,) = ax.plot([x["target_qps"] for x in runs], [x["p99_ms"] for x in runs], "-", alpha=0.6, label=name)
        for ok in (True, False):
            pts = [(x["target_qps"], x["p99_ms"]) for x in runs if x["ok"] == ok]
            if pts:
                ax.plot(*zip(*pts), "o", color=line.get_color(), fillstyle="full" if ok else "none")
    ax.axhline(mlperf.P99_BOUND_MS, color="red", linestyle="--", label=f"p99 bound {mlperf.P99_BOUND_MS:.0f} ms")
    ax.set(xscale="log", yscale="log", xlabel="offered rate (queries/s, LoadGen Server)", ylabel="p99 latency (ms)")
    ax.set_ylim(bottom=mlperf.P99_BOUND_MS / 3)
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        axis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    m = report["machine"]
    ax.set_title(
        f"Server scenario under LoadGen, {m['cpu']} ({m['isa']}), load average {m['load_average'][0]} (filled: VALID)",
        fontsize=9,
    )
    ax.margins(x=0.15)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


OPTIONS = (  # flag, type, default, help
    ("--seconds", float, 25.0, "LoadGen's min duration per rate"),
    ("--max-seconds", float, 90.0, "LoadGen's max duration per rate: a slow rate stops there, INVALID"),
    ("--min-queries", int, mlperf.MIN_QUERIES, "LoadGen's min query count per rate"),
    ("--steps", int, 7, "rates tried per config and variant"),
    (
        "--start-qps",
        float,
        None,
        "first rate; default: a rate target (DLRMv2 on a host without AMX: 5), else 0.3 x the host's raw forward / mean pairs",
    ),
    ("--queries", int, 256, "distinct queries LoadGen draws from"),
    ("--form", str, "columns", f"how queries go over the wire: {' or '.join(mlperf.FORMS)}"),
    ("--split-pairs", int, 0, "a query of more pairs goes as requests of at most this many, at once (0: one request)"),
    (
        "--decide-max-seconds",
        float,
        180.0,
        "a rate failed on early stopping alone (p99 under the bound) runs again with the queries LoadGen asks for "
        "and half again, if that takes at most this long (0: never)",
    ),
    ("--warm-up", float, 10.0, "seconds of load per warm-up round before the search"),
    (
        "--ready-run",
        int,
        1,
        "after the search, this many fresh servers as shipped and as many with the plugin's warm-up off, in turns, "
        "each run at half the highest VALID rate the moment it is ready (0: none)",
    ),
    ("--warm-up-max", float, 90.0, "warm-up rounds stop here if the frontend's JIT has not settled"),
    ("--host-seconds", float, 3.0, "seconds per raw-forward measurement, each way"),
    ("--profile-reps", int, 20, "times the largest and the smallest query are sent alone for the profile"),
    ("--out", str, None, "output folder; default: results/<date>-server-scenario/"),
    ("--from-json", str, None, "write the .md and .png again (to --out) from this run's JSON, measuring nothing"),
)


def main(argv: list[str] | None = None) -> int:
    from dlrmkit.dense import cpu_flags

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=["model-config.criteo.yaml", "model-config.dlrmv2.yaml"])
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE,...", help="repeatable")
    for flag, kind, default, text in OPTIONS:
        ap.add_argument(flag, type=kind, default=default, help=f"{text} (default: %(default)s)")
    args = ap.parse_args(argv)
    if args.form not in mlperf.FORMS:
        ap.error(f"--form: expected one of {', '.join(mlperf.FORMS)}, got {args.form!r}")
    if args.from_json:
        report = json.loads(Path(args.from_json).read_text())
        for r in report["rows"]:  # judged again from what it measured (a report from before the floor too)
            judge(
                r,
                Path(r["config"]).stem.removeprefix("model-config").strip(".") or "seed",
                report["machine"]["isa"],
            )
        write_report(Path(args.out or Path(args.from_json).parent) / "server-scenario", report, markdown(report), plot)
        return 0
    out = run_dir(__file__, "server-scenario", "MLPerf's Server scenario under LoadGen", args.out, argv)
    args.loadgen_dir = out / "loadgen"
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # killed: the finally blocks stop the server
    started, rows, load_at_start = time.perf_counter(), [], machine()["load_average"]
    with tempfile.TemporaryDirectory(prefix="dlrm-server-scenario-") as tmp:
        for c in args.configs:
            path = (Path(c) if Path(c).is_file() else ROOT / c).resolve()
            key = path.stem.removeprefix("model-config").strip(".")
            for variant, items in map(parse_variant, args.variant or VARIANTS.get(key, ["shipped:"])):
                rows.append(measure(path, variant, items, Path(tmp), args))
    report = {"machine": machine(), "seconds": args.seconds, "min_queries": args.min_queries}
    report.update(max_seconds=args.max_seconds, form=args.form, split_pairs=args.split_pairs)
    report["machine"]["load_average_at_start"] = load_at_start
    report["machine"]["int8_peak"] = int8_peak(cpu_flags(), clock_mhz())
    report.update(rows=rows, wall_s=round(time.perf_counter() - started))
    write_report(out / "server-scenario", report, markdown, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
