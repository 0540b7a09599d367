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
highest rate LoadGen calls VALID (p99 <= 60 ms) with no failed query is the result. LoadGen's
summary of every run is kept in results/loadgen/. Writes results/server-scenario.json, .md, and
.png (p99 against the offered rate per config and variant, the 60 ms bound drawn).
"""

from __future__ import annotations

import argparse
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

import mlperf
from common import HostForward, ROOT, build_archive, frontend_pid, load_served, log, machine, serving, unpack
from common import write_report

HOST_BATCH = 256
# Issue 29's targets per config: pairs/s at the bound over an anchor measured in the same run.
# criteo: 0.6 x the host's raw forward of the served archive; dlrmv2: 2.5 x stock torchrec's fp32
# forward (its DLRM_DCN and EmbeddingBagCollection, one single-thread process per CPU, batch 256).
TARGETS = {"criteo": ("host", 0.6), "dlrmv2": ("stock", 2.5)}
VARIANTS = {
    "dlrmv2": ["fp32:handler.dense_precision=fp32", "bf16:handler.dense_precision=bf16", "int8:"]
}  # the default variants per config


def parse_variant(text: str) -> tuple[str, dict]:
    """``NAME:k=v,k=v`` -> (NAME, {k: v}), values read as YAML (``batchSize=1`` -> 1)."""
    import yaml

    name, _, rest = text.partition(":")
    items = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
    return name or "shipped", {k: yaml.safe_load(v) for k, v in items.items()}


def measure(cfg_path: Path, variant: str, items: dict, tmp: Path, args) -> dict:
    """Build, serve and search one config + variant; the host's forward before and after."""
    import torch

    from dlrmkit.config import DLRMConfig

    key = cfg_path.stem.removeprefix("model-config").strip(".") or "seed"
    tag = f"{key}-{variant}" + ("" if args.form == "columns" else f"-{args.form}")
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
    host = HostForward(source, model_dir, model, cfg)
    stock = HostForward(source, None, None, cfg) if TARGETS.get(key, ("",))[0] == "stock" else None
    pool = mlperf.query_pool(cfg, args.queries, form=args.form)
    mean_pairs = sum(q.pairs for q in pool) / len(pool)
    try:
        before = host.measure(HOST_BATCH, args.host_seconds)
        log(f"{tag}: dense half {dense}; host raw forward at B={HOST_BATCH}: {before['rows_per_s']:,} rows/s")
        stock_before = stock.measure(HOST_BATCH, args.host_seconds) if stock else None
        if stock_before:
            log(f"{tag}: stock torchrec fp32 forward at B={HOST_BATCH}: {stock_before['rows_per_s']:,} rows/s")
        start = args.start_qps or 0.3 * before["rows_per_s"] / mean_pairs
        probe = mlperf.make_query(cfg, random.Random(0), 1, mlperf.mlperf_bags(cfg)).body
        with serving(tmp / f"home-{name}", tmp / "store", {name: probe}, env) as srv:
            url = srv.url + mlperf.path(args.form, name)
            procs = lambda: {"frontend": [frontend_pid(srv)], "workers": srv.worker_pids(name)}  # noqa: E731
            # The frontend's JIT compiles its paths for these large bodies over many seconds of load.
            mlperf.run(url, pool, start / 2, args.warm_up, min_queries=1, max_seconds=args.warm_up)

            def run_at(qps: float) -> dict:
                out = Path(args.loadgen_dir) / f"{tag}-{qps:.2f}qps.txt"
                r = mlperf.run(url, pool, qps, args.seconds, args.min_queries, args.max_seconds, out, procs)
                why = f" ({', '.join(r['unsatisfied'])} not satisfied)" if r.get("unsatisfied") else ""
                log(
                    f"  {tag} {qps:.2f} q/s: {'VALID' if r['valid'] else 'INVALID'}{why}, p99 {r.get('p99_ms')} ms, "
                    f"{r['pairs_per_s']:,} pairs/s, {r['errors']} failed"
                )
                return r

            # below min queries / max seconds a rate cannot reach LoadGen's query count: INVALID by the cap
            found = mlperf.search(run_at, start, steps=args.steps, floor=args.min_queries / args.max_seconds)
            workers = len(srv.worker_pids(name))
        after = host.measure(HOST_BATCH, args.host_seconds)
        stock_after = stock.measure(HOST_BATCH, args.host_seconds) if stock else None
    finally:
        host.close()
        if stock:
            stock.close()
    host_rows = (before["rows_per_s"] + after["rows_per_s"]) / 2
    best = found["best"] or {"target_qps": 0, "pairs_per_s": 0, "p99_ms": None}
    row = {"config": cfg_path.name, "variant": variant, "form": args.form, "overlay": items, "dense": dense}
    row["workers"] = workers
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
    log(f"{tag}: highest VALID rate {row['valid_qps']} q/s, {row['pairs_per_s']:,} pairs/s ({row['vs_host']} of host)")
    return row


def short(dense: str) -> str:
    """dense.prepare's line without its details: ``int8 static``, ``fp32 (FALLING BACK from int8)``.

    >>> short("bf16 (autocast), Inductor with freezing"), short("fp32 (FALLING BACK from int8: no VNNI)")
    ('bf16', 'fp32 (FALLING BACK from int8)')
    """
    if "FALLING BACK" in dense:
        return dense.split(": ")[0] + (")" if ": " in dense else "")
    return dense.split(" (")[0]


def markdown(report: dict) -> list[str]:
    m, bound = report["machine"], mlperf.P99_BOUND_MS
    lines = [
        f"**Server scenario under MLPerf LoadGen** ({m['cpu']}, {m['available_cpus']} CPUs, ISA {m['isa']}, torch's "
        f"kernels {m['isa_served']}; load average {m['load_average_at_start'][0]} at the start, "
        f"{m['load_average'][0]} at the end: a shared machine): queries of {mlperf.PAIRS[0]}-{mlperf.PAIRS[1]} pairs "
        f"(`{report.get('form', 'columns')}` form), Poisson arrivals, runs of at least {report['seconds']:g} s and {report['min_queries']} "
        f"queries, at most {report['max_seconds']:g} s (a rate below {report['min_queries'] / report['max_seconds']:.1f} "
        f"q/s cannot send that many: INVALID by the cap, the search goes no lower); the highest offered rate LoadGen calls VALID (p99 <= {bound:.0f} ms) "
        "with no failed query. LoadGen's summaries: `results/loadgen/`.",
        "",
        "| config | variant | dense half | workers | VALID q/s | pairs/s | per core | p99 ms | host raw forward "
        f"B={HOST_BATCH} rows/s | pairs/s / host | runs (q/s: p99 ms, V = VALID) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in report["rows"]:
        runs = ", ".join(f"{x['target_qps']}: {x.get('p99_ms')}{' V' if x['ok'] else ''}" for x in r["runs"])
        lines.append(
            f"| {r['config']} | {r['variant']} | {short(r['dense'])} | {r['workers']} | {r['valid_qps'] or 'none'} | "
            f"{r['pairs_per_s']:,} | {r['pairs_per_s'] // r['cpus']:,} | {r['p99_ms'] or ''} | "
            f"{r['host_rows_per_s']:,} | {r['vs_host']} | {runs} |"
        )
    anchors = {"host": "the host's raw forward of the served archive", "stock": "stock torchrec's fp32 forward"}
    stock = [r for r in report["rows"] if r.get("stock_rows_per_s")]
    lines += [
        "",
        *(
            f"Stock torchrec's fp32 forward ({r['config']}, {r['variant']} run; torchrec's own modules, one "
            f"single-thread process per CPU, B={HOST_BATCH}): {r['stock_rows_per_s']:,} rows/s "
            f"({r['stock_before']['rows_per_s']:,} before, {r['stock_after']['rows_per_s']:,} after the search)."
            for r in stock
        ),
        "",
        *(
            f"Target ({r['config']}, {r['variant']}): pairs/s >= {t['bound']} x {anchors[t['anchor']]}: "
            f"{t['ratio']}, {'met' if t['met'] else 'missed'}."
            for r in report["rows"]
            if (t := r.get("target"))
        ),
    ]
    return lines + ["", "p99 against the offered rate: [server-scenario.png](server-scenario.png)."]


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in report["rows"]:
        runs = sorted((x for x in r["runs"] if x.get("p99_ms")), key=lambda x: x["target_qps"])
        label = (
            f"{r['config'].removeprefix('model-config.').removesuffix('.yaml')} {r['variant']} ({short(r['dense'])})"
        )
        (line,) = ax.plot([x["target_qps"] for x in runs], [x["p99_ms"] for x in runs], "-", alpha=0.6, label=label)
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
    ("--start-qps", float, None, "first rate; default: 0.3 x the host's raw forward / mean pairs"),
    ("--queries", int, 256, "distinct queries LoadGen draws from"),
    ("--form", str, "columns", f"how queries go over the wire: {' or '.join(mlperf.FORMS)}"),
    ("--warm-up", float, 15.0, "seconds of load before the search"),
    ("--host-seconds", float, 3.0, "seconds per raw-forward measurement, each way"),
    ("--out", str, str(ROOT / "results" / "server-scenario"), "output path without suffix"),
    ("--loadgen-dir", str, str(ROOT / "results" / "loadgen"), "where LoadGen's summary of every run is kept"),
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=["model-config.criteo.yaml", "model-config.dlrmv2.yaml"])
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE,...", help="repeatable")
    for flag, kind, default, text in OPTIONS:
        ap.add_argument(flag, type=kind, default=default, help=f"{text} (default: %(default)s)")
    args = ap.parse_args(argv)
    if args.form not in mlperf.FORMS:
        ap.error(f"--form: expected one of {', '.join(mlperf.FORMS)}, got {args.form!r}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # killed: the finally blocks stop the server
    started, rows, load_at_start = time.perf_counter(), [], machine()["load_average"]
    with tempfile.TemporaryDirectory(prefix="dlrm-server-scenario-") as tmp:
        for c in args.configs:
            path = (Path(c) if Path(c).is_file() else ROOT / c).resolve()
            key = path.stem.removeprefix("model-config").strip(".")
            for variant, items in map(parse_variant, args.variant or VARIANTS.get(key, ["shipped:"])):
                rows.append(measure(path, variant, items, Path(tmp), args))
    command = "python bench/server_scenario.py " + " ".join(sys.argv[1:] if argv is None else argv)
    report = {"command": command, "machine": machine(), "seconds": args.seconds, "min_queries": args.min_queries}
    report.update(max_seconds=args.max_seconds, form=args.form)
    report["machine"]["load_average_at_start"] = load_at_start
    report.update(rows=rows, wall_s=round(time.perf_counter() - started))
    write_report(Path(args.out), report, markdown(report), plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
