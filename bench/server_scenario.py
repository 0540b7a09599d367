#!/usr/bin/env python
"""The host's raw-forward limit, and an MLPerf-shaped Server scenario against a real TorchServe.

    python bench/server_scenario.py                      # both configs and criteo_b1, ~5 minutes
    python bench/server_scenario.py --probe-seconds 5 --configs model-config.criteo.yaml

``HostForward``: the served model's forward using every CPU this process may use
(dlrmkit.cpus.available_cpus): N processes x 1 thread (each pinned to one CPU) and 1 process x N
threads, measured back to back; the better of the two is the host's limit, the anchor of the
served ranking targets (bench/benchmark.py) and of this scenario's.

The Server scenario, shaped as MLPerf Inference DLRMv2's: each query is one request of 100-700
user-item pairs (a truncated exponential, mean ~270; MLPerf draws from its own trace) in the
`columns` form (every feature a column; multi-hot for DLRMv2 with MLPerf's bag sizes), sent at
open-loop Poisson arrival times (bench/loadgen.run_open_loop: latency from each query's
scheduled send time); a search for the highest query rate whose p99 latency stays <= 60 ms
(probes of --probe-seconds each, far shorter than MLPerf's 10 minutes). Per config: queries/s,
pairs/s, pairs/s per core, the host's raw forward at B=256 beside it, and the ratio's CPU ceiling
(``ceiling``); with --ranking-batch-size (default 1) the first config once more, served with that
TorchServe batchSize (``criteo_b1``: a deployment for ranking queries only). Writes
results/server-scenario.json and .md (bench/benchmark.py folds the same rows into its report).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "scripts")]
from benchmark import cpu_seconds, frontend_pid, log, make_instance, raw_caller, timed_calls, write_report  # noqa: E402
from loadgen import percentile, run_open_loop  # noqa: E402
from tsctl import ROOT, Server  # noqa: E402

sys.path.insert(0, str(ROOT))

P99_BOUND_MS = 60.0  # MLPerf DLRMv2 Server
PAIRS = (100, 700)
PAIRS_SCALE = 200  # 100 + an exponential of this mean, redrawn above 700: mean ~269
HOST_BATCH = 256
# Published MLPerf Inference DLRMv2 closed-division figures (/work/shared/reference: torchrec-1.8.md,
# serving-landscape.md), full-size model on other hardware: context only, never a target.
MLPERF_PUBLISHED = [
    ("8x H100-SXM-80GB, TensorRT (v4.1)", "Server", 510_155),
    ("2-socket Xeon Granite Rapids, PyTorch (v4.1)", "Server (99.9%)", 17_750),
    ("2-socket Xeon Emerald Rapids (v4.0)", "Server", 9_000),
]


# --- the host's raw forward --------------------------------------------------------------------

def _host_child(conn, cfg_path: str, model_path: str, cpu: int) -> None:
    """One single-threaded process on one CPU holding the served model (as a worker loads it)."""
    import torch

    from dlrmkit.config import DLRMConfig
    from dlrm_factory import DLRMFactory

    os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)
    cfg = DLRMConfig.from_yaml(cfg_path)
    factory = DLRMFactory(cfg)
    model = factory.load(model_path)
    factory.freeze_dense(model)
    callers = {}
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg is None:
            return
        batch, seconds = msg
        if batch not in callers:
            callers[batch] = raw_caller(cfg, batch, random.Random(cpu))(model)
            callers[batch]()
        t = timed_calls(callers[batch], seconds)
        conn.send((batch * len(t), sum(t)))


class HostForward:
    """The served model's raw forward on every CPU this process may use: N pinned processes x 1
    thread, and ``model`` in this process with N threads; ``measure`` runs both back to back."""

    def __init__(self, cfg_path: Path, model_path: Path, model, cfg):
        import multiprocessing

        from dlrmkit.cpus import available_cpus

        self.cpus = sorted(os.sched_getaffinity(0))[:available_cpus()]
        self.model, self.cfg = model, cfg
        ctx = multiprocessing.get_context("spawn")  # no fork of a process holding torch threads
        self.conns, self.procs = [], []
        for cpu in self.cpus:
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_host_child, args=(child, str(cfg_path), str(model_path), cpu), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        for c in self.conns:
            if c.recv() != "ready":
                raise RuntimeError("a host-forward process failed to load the model")

    def measure(self, batch: int, seconds: float) -> dict:
        import torch

        n = len(self.cpus)
        for c in self.conns:  # all start together
            c.send((batch, seconds))
        got = [c.recv() for c in self.conns]
        procs = sum(rows / s for rows, s in got)
        before = torch.get_num_threads()
        torch.set_num_threads(n)
        try:
            t = timed_calls(raw_caller(self.cfg, batch, random.Random(7))(self.model), seconds)
        finally:
            torch.set_num_threads(before)
        threads = batch * len(t) / sum(t)
        best = max(procs, threads)
        return {"batch": batch, "cpus": n, "processes_rows_per_s": round(procs), "threads_rows_per_s": round(threads),
                "rows_per_s": round(best), "rows_per_s_per_core": round(best / n),
                "best": f"{n} processes x 1 thread" if procs >= threads else f"1 process x {n} threads"}

    def close(self) -> None:
        for c in self.conns:
            c.send(None)
        for p in self.procs:
            p.join(timeout=10)


# --- queries ------------------------------------------------------------------------------------

def query_pairs(rng: random.Random) -> int:
    while True:
        n = PAIRS[0] + round(rng.expovariate(1 / PAIRS_SCALE))
        if n <= PAIRS[1]:
            return n


def make_query(cfg, rng: random.Random, rows: int, bags: list[int] | None) -> bytes:
    """``rows`` pairs as one `columns` request, every feature a column; with ``bags`` (ids per
    row, per feature) multi-hot, else one id per row."""
    dense = [make_instance(cfg, rng)["dense"] for _ in range(rows)]
    sparse = {}
    for f, (name, n) in enumerate(zip(cfg.sparse_features, cfg.num_embeddings)):
        k = bags[f] if bags else 1
        col = {"values": [rng.randrange(n) for _ in range(rows * k)]}
        if bags:
            col["lengths"] = [k] * rows
        sparse[name] = col
    return json.dumps({"columns": {"dense": dense, "sparse": sparse}}).encode()


def mlperf_bags(cfg) -> list[int] | None:
    """MLPerf DLRMv2's multi-hot bag sizes (sample_requests/dlrmv2.json) for a DCN config."""
    if cfg.interaction != "dcn":
        return None
    sample = json.loads((ROOT / "sample_requests" / "dlrmv2.json").read_text())["sparse"]
    return [sample["lengths"][sample["keys"].index(f)] for f in cfg.sparse_features]


# --- the Server scenario ------------------------------------------------------------------------

def probe(srv: Server, model: str, pool: list[tuple[int, bytes]], rate: float, seconds: float, seed: int) -> dict:
    """One open-loop run at ``rate``: long enough for 100 queries (p99 then is not one query's
    latency), at most 2x ``seconds``; with the frontend's and the workers' CPU per query."""
    seconds = min(2 * seconds, max(seconds, 100 / rate))
    procs = {"frontend": [frontend_pid(srv)], "workers": srv.worker_pids(model)}
    cpu0 = _cpu(procs)
    res, answered = asyncio.run(run_open_loop(f"{srv.url}/predictions/{model}", [b for _, b in pool], rate, seconds,
                                              seed=seed))
    cpu1 = _cpu(procs)
    # a worker replaced meanwhile (its pid gone): no CPU figure for this probe
    cpu = {k: cpu1[k] - cpu0[k] for k in procs} if cpu0 and cpu1 else {k: 0.0 for k in procs}
    pairs = sum(pool[i][0] for i in answered)
    ok = res.statuses.get(200, 0)
    bad = res.sent - ok
    p99 = res.percentile(99)
    return {"rate": round(rate, 2), "seconds": round(seconds, 1), "sent": res.sent, "answered_200": ok, "failed": bad,
            "queries_per_s": round(ok / seconds, 2), "pairs_per_s": round(pairs / seconds),
            "p50_ms": round(res.percentile(50), 1), "p99_ms": round(p99, 1),
            **{f"{k}_cpu_us_per_query": round(v / max(1, ok) * 1e6) for k, v in cpu.items()},
            "client_cpu_us_per_query": round(res.client_cpu_s / max(1, ok) * 1e6),
            "ok": bad == 0 and p99 <= P99_BOUND_MS}


def _cpu(procs: dict) -> dict | None:
    import psutil

    try:
        return {k: cpu_seconds(v) for k, v in procs.items()}
    except (psutil.NoSuchProcess, FileNotFoundError):
        return None


def search(srv: Server, model: str, pool: list[tuple[int, bytes]], start_rate: float, seconds: float,
           steps: int = 7) -> dict:
    """The highest Poisson query rate whose p99 stays <= P99_BOUND_MS with no failed query: from a
    light rate (``start_rate`` / 4; if even that and one 4x lighter fail, no rate meets the bound:
    the largest queries alone take longer), up by 1.6x until the bound is bracketed, then
    bisection; ``steps`` probes at most. On a shared machine a probe can fail below one that
    passed: the higher pass stands."""
    probes, lo, hi, rate = [], None, None, start_rate / 4
    for floor in (rate, rate / 4):
        p = probe(srv, model, pool, floor, seconds, seed=100)
        probes.append(p)
        log(f"  light rate {floor:.2f} q/s ({p['seconds']} s): p50 {p['p50_ms']} ms, p99 {p['p99_ms']} ms -> "
            f"{'ok' if p['ok'] else 'over'}")
        if p["ok"]:
            lo, rate = p, floor * 1.6
            break
    else:
        return {"best": None, "probes": probes}
    for k in range(steps - len(probes)):
        p = probe(srv, model, pool, rate, seconds, seed=k)
        probes.append(p)
        log(f"  rate {rate:.1f} q/s ({p['seconds']} s): p50 {p['p50_ms']} ms, p99 {p['p99_ms']} ms, "
            f"{p['pairs_per_s']:,} pairs/s, failed {p['failed']}, CPU us/query: frontend {p['frontend_cpu_us_per_query']:,}, "
            f"workers {p['workers_cpu_us_per_query']:,} -> {'ok' if p['ok'] else 'over'}")
        if p["ok"] and (lo is None or p["rate"] > lo["rate"]):
            lo = p
            if hi is not None and hi["rate"] <= p["rate"]:
                hi = None
        elif not p["ok"] and (lo is None or p["rate"] > lo["rate"]) and (hi is None or p["rate"] < hi["rate"]):
            hi = p
        if lo and hi:
            if hi["rate"] / lo["rate"] < 1.08:
                break
            rate = (lo["rate"] * hi["rate"]) ** 0.5
        else:
            rate = rate * 1.6 if hi is None else rate / 1.6
            if rate < 0.2:
                break
    return {"best": lo, "probes": probes}


def scenario(srv: Server, model: str, cfg, host: HostForward, seconds: float, host_seconds: float,
             queries: int = 48, warm_up_s: float = 15.0) -> dict:
    """The Server scenario for ``model`` on ``srv`` after ``warm_up_s`` of its queries at half the
    search's first rate, and the host's raw forward at B=256 before and after it (the mean is
    the anchor)."""
    rng = random.Random(11)
    bags = mlperf_bags(cfg)
    pool = [(n, make_query(cfg, rng, n, bags)) for n in (query_pairs(rng) for _ in range(queries))]
    mean_pairs = statistics.mean(n for n, _ in pool)
    before = host.measure(HOST_BATCH, host_seconds)
    log(f"{model}: host raw forward at B={HOST_BATCH}: {before['rows_per_s']:,} rows/s ({before['best']}; "
        f"{before['processes_rows_per_s']:,} as processes, {before['threads_rows_per_s']:,} as threads)")
    start = 0.3 * before["rows_per_s"] / mean_pairs
    # The frontend's JIT compiles its paths for these large bodies over many seconds of load: a
    # server started for this scenario would otherwise lose its first probes to it (measured: 3.9
    # ms of frontend CPU per query at the best rate after a 2 s warm-up, 0.9 ms after 40 s).
    probe(srv, model, pool, start / 2, warm_up_s, seed=99)
    found = search(srv, model, pool, start, seconds)
    after = host.measure(HOST_BATCH, host_seconds)
    host_rows = (before["rows_per_s"] + after["rows_per_s"]) / 2
    best = found["best"]
    row = {"model": model, "pairs_mean": round(mean_pairs, 1), "pairs_p50": percentile([n for n, _ in pool], 50),
           "bags": bags, "body_bytes_mean": round(statistics.mean(len(b) for _, b in pool)),
           "host_before": before, "host_after": after, "host_rows_per_s": round(host_rows), "cpus": before["cpus"],
           "probes": found["probes"], "probe_seconds": seconds}
    if best:
        row.update(queries_per_s=best["queries_per_s"], pairs_per_s=best["pairs_per_s"], p99_ms=best["p99_ms"],
                   p50_ms=best["p50_ms"], frontend_cpu_us_per_query=best["frontend_cpu_us_per_query"],
                   workers_cpu_us_per_query=best["workers_cpu_us_per_query"],
                   client_cpu_us_per_query=best["client_cpu_us_per_query"],
                   pairs_per_s_per_core=round(best["pairs_per_s"] / before["cpus"]),
                   vs_host=round(best["pairs_per_s"] / host_rows, 3),
                   ceiling=ceiling(best, mean_pairs, host_rows, before["cpus"]))
    else:
        lowest = min(found["probes"], key=lambda p: p["rate"])
        row.update(queries_per_s=0, pairs_per_s=0, p99_ms=None, pairs_per_s_per_core=0, vs_host=0.0,
                   lowest_rate_p99_ms=lowest["p99_ms"], lowest_rate=lowest["rate"])
    log(f"{model}: highest rate with p99 <= {P99_BOUND_MS:.0f} ms: {row['queries_per_s']} q/s, "
        f"{row['pairs_per_s']:,} pairs/s ({row['vs_host']} of the host's raw forward)")
    return row


def ceiling(p: dict, pairs: float, host_rows_per_s: float, cpus: int) -> float | None:
    """The most (to 3 places) ``probe`` ``p``'s CPU costs let this host reach of its raw forward: the forward's
    CPU per query (``pairs`` rows at the host's rate, all ``cpus`` busy) over all the CPU a query
    took (frontend, workers, the load generator: they share these cores), i.e. pairs/s over the
    host's forward if every core were kept busy, which Poisson arrivals under a p99 bound never do."""
    if not p["workers_cpu_us_per_query"]:  # no CPU figure for that probe (a worker was replaced)
        return None
    forward_us = cpus * pairs / host_rows_per_s * 1e6
    spent = p["frontend_cpu_us_per_query"] + p["workers_cpu_us_per_query"] + p["client_cpu_us_per_query"]
    return round(forward_us / spent, 3)


def markdown(rows: list[dict]) -> list[str]:
    lines = ["", f"**MLPerf-shaped Server scenario** (open-loop Poisson queries of {PAIRS[0]}-{PAIRS[1]} pairs, `columns` "
             f"form; the highest rate with p99 <= {P99_BOUND_MS:.0f} ms and no failed query; probes of "
             f"{rows[0]['probe_seconds']:g} s)", "",
             "| model | TorchServe batchSize | pairs/query mean | CPUs | queries/s | pairs/s | pairs/s per core | p50 / p99 ms | CPU µs/query "
             f"frontend / workers / load generator | host raw forward B={HOST_BATCH} rows/s (processes / threads) | pairs/s / host | "
             "ceiling: forward CPU / all CPU per query |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        p99 = (f"{r['p50_ms']} / {r['p99_ms']}" if r["p99_ms"] is not None
               else f"none met (p99 {r['lowest_rate_p99_ms']} ms at {r['lowest_rate']} q/s)")
        cpu = " / ".join(f"{r.get(f'{k}_cpu_us_per_query', 0):,}" for k in ("frontend", "workers", "client"))
        lines.append(f"| {r['model']} | {r.get('batch_size', '')}{' (override)' if r.get('batch_size_override') else ''} | "
                     f"{r['pairs_mean']} | {r['cpus']} | {r['queries_per_s']} | {r['pairs_per_s']:,} | "
                     f"{r['pairs_per_s_per_core']:,} | {p99} | {cpu} | {r['host_rows_per_s']:,} "
                     f"({r['host_before']['processes_rows_per_s']:,} / {r['host_before']['threads_rows_per_s']:,}) | "
                     f"{r['vs_host']} | {r.get('ceiling', '')} |")
    lines += ["", "Probes (rate q/s: p99 ms): " + "; ".join(
        f"{r['model']}: " + ", ".join(f"{p['rate']}: {p['p99_ms']}" for p in r["probes"]) for r in rows), "",
        "Published MLPerf Inference DLRMv2 figures (full-size model, other hardware; MLPerf's samples/s count "
        "pairs): context only, not a target: " + "; ".join(f"{s} {sc} {v:,}" for s, sc, v in MLPERF_PUBLISHED) + "."]
    return lines


def serve_and_measure(cfg_path: Path, tmp: Path, seconds: float, host_seconds: float,
                      batch_size: int | None = None) -> dict:
    """Build ``cfg_path``'s archive, serve it (the shipped worker rule), run the scenario. With
    ``batch_size``, the archive carries that TorchServe batchSize instead of the config's."""
    import torch
    import yaml

    from dlrmkit.config import DLRMConfig
    from dlrm_factory import DLRMFactory

    cfg = DLRMConfig.from_yaml(cfg_path)
    name = cfg_path.stem.replace("model-config.", "").replace("model-config", "seed")
    source = cfg_path
    if batch_size is not None:
        name += f"_b{batch_size}"
        doc = yaml.safe_load(cfg_path.read_text())
        doc["batchSize"] = batch_size
        source = tmp / f"{name}.yaml"
        source.write_text(yaml.safe_dump(doc, sort_keys=False))
    store = tmp / f"store-{name}"
    log(f"{cfg_path.name}: building the archive{f' (batchSize {batch_size})' if batch_size is not None else ''}")
    subprocess.run([sys.executable, str(ROOT / "scripts" / "build_mar.py"), "--config", str(source), "--output-dir",
                    str(store), "--model-name", name, "--force"], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["unzip", "-q", "-o", str(store / f"{name}.mar"), "dlrm.pt", "-d", str(tmp / name)], check=True)
    factory = DLRMFactory(cfg)
    model = factory.load(tmp / name / "dlrm.pt")
    factory.freeze_dense(model)
    torch.set_num_threads(1)
    host = HostForward(cfg_path, tmp / name / "dlrm.pt", model, cfg)
    srv = Server.on_free_ports(tmp / f"home-{name}", model_store=store, overrides={"load_models": f"{name}={name}.mar"})
    srv.start()
    try:
        probe_body = make_query(cfg, random.Random(0), 1, mlperf_bags(cfg))
        srv.wait_ready(name, probe_body, timeout=600)
        row = scenario(srv, name, cfg, host, seconds, host_seconds)
        row["workers"] = len(srv.worker_pids(name))
    finally:
        srv.stop()
        host.close()
    row["config"] = cfg_path.name
    row["batch_size"] = yaml.safe_load(source.read_text()).get("batchSize")
    row["batch_size_override"] = batch_size is not None
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=[str(ROOT / "model-config.criteo.yaml"),
                                                      str(ROOT / "model-config.dlrmv2.yaml")],
                    help="model configs (default: %(default)s)")
    ap.add_argument("--probe-seconds", type=float, default=8.0, help="seconds per probed rate (default: %(default)s)")
    ap.add_argument("--host-seconds", type=float, default=3.0,
                    help="seconds per raw-forward measurement, each way (default: %(default)s)")
    ap.add_argument("--ranking-batch-size", type=int, default=1,
                    help="also serve the first config with this TorchServe batchSize, as a deployment that serves "
                         "only ranking queries would (one query per batch: no query waits behind another in a "
                         "worker while the other idles); 0 leaves it out (default: %(default)s)")
    ap.add_argument("--out", default=str(ROOT / "results" / "server-scenario"),
                    help="output path without suffix (default: %(default)s)")
    args = ap.parse_args()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dlrm-server-scenario-") as tmp:
        rows = [serve_and_measure(Path(c).resolve(), Path(tmp), args.probe_seconds, args.host_seconds)
                for c in args.configs]
        if args.ranking_batch_size:
            rows.append(serve_and_measure(Path(args.configs[0]).resolve(), Path(tmp), args.probe_seconds,
                                          args.host_seconds, args.ranking_batch_size))
    report = {"command": "python bench/server_scenario.py " + " ".join(sys.argv[1:]), "rows": rows,
              "mlperf_published": MLPERF_PUBLISHED, "wall_s": round(time.perf_counter() - started)}
    write_report(Path(args.out), report, markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
