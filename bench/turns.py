#!/usr/bin/env python
"""Variants of one config under MLPerf's LoadGen at fixed rates, in turns: which one serves the
Server scenario's tail better on a machine whose speed drifts.

    python bench/turns.py --config model-config.criteo.yaml --variant whole:handler.split_rows=0 \\
        --variant shipped: --rates 90 120 --turns 4

bench/server_scenario.py's search runs one variant after another, minutes apart; on a shared host
whose rates move by 2x within the hour that cannot tell apart two variants a few tenths apart.
Here every variant (``NAME:key=value,...`` as in server_scenario.py; ``form=`` and ``split=N`` are
the load generator's: the queries' form, and a query of more than N pairs sent as requests of at
most N at once) is built and served at once, each by its own TorchServe (an idle one costs the
others nothing), and LoadGen (bench/mlperf.py, queries of 100-700 pairs, Poisson arrivals, at
least --seconds and --min-queries per run) runs against one at a time: per turn, each rate, each
variant (after --prime seconds of the same load, unrecorded), the variants' order rotated by one
each turn, so a drift of the host and the place in the order hit every variant alike. Reported
per variant and rate: p99 per turn, how many runs LoadGen called VALID, the median over turns of
its p99 over the first variant's in the same turn, the workers' and the frontend's CPU per query
and the most a worker held of its own after a run (USS). Writes turns.json, turns.md, run.json
and loadgen/ to results/<date>-turns/ (--out DIR).
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench import mlperf
from bench.common import ROOT, build_archive, frontend_pid, log, machine, md_table, memory_mb, parse_variant, run_dir
from bench.common import serving
from bench.common import write_report

# What a run's report keeps of LoadGen's result (mlperf.run), beside the CPU per query of each group.
KEPT = ("target_qps", "valid", "ok", "p50_ms", "p99_ms", "max_ms", "queries", "errors", "pairs_per_s")


def served(cfg_path: Path, variants: list[tuple[str, dict]], tmp: Path, args) -> list[dict]:
    """Per variant: its archive built (overlay applied), its queries' form and pool."""
    from dlrmkit.config import DLRMConfig

    out = []
    for variant, items in variants:
        items = dict(items)
        form = mlperf.pop_form(variant, items, args.form)
        split = int(items.pop("split", 0))  # the load generator's, not the server's: as server_scenario.py's
        name = variant.replace("-", "_").replace(".", "_")
        source, doc, env = build_archive(cfg_path, tmp / "store", name, items)
        cfg = DLRMConfig.from_yaml(source)
        probe = mlperf.probe(cfg)
        pool = mlperf.query_pool(cfg, args.queries, form=form, split=split)  # the same queries for every variant
        out.append(
            {
                "variant": variant,
                "overlay": items,
                "form": form,
                "split": split,
                "name": name,
                "env": env,
                "probe": probe,
                "pool": pool,
            }
        )
    return out


def in_turns(
    cfg_path: Path, variants: list[tuple[str, dict]], tmp: Path, args, loadgen_dir: Path
) -> tuple[list[dict], list[dict]]:
    """Every variant served at once; LoadGen at each rate against each, in turns. Returns what was
    served (each variant's name, overlay and form) and the runs."""
    runs = []
    with contextlib.ExitStack() as stack:
        vs = served(cfg_path, variants, tmp, args)
        for v in vs:
            srv = stack.enter_context(
                serving(tmp / f"home-{v['name']}", tmp / "store", {v["name"]: v["probe"]}, v["env"])
            )
            v["url"] = srv.url + mlperf.path(v["form"], v["name"])
            v["procs"] = lambda srv=srv, name=v["name"]: {
                "frontend": [frontend_pid(srv)],
                "workers": srv.worker_pids(name),
            }
            log(f"{v['variant']}: ready at {srv.url}")
        for turn in range(args.turns):
            for rate in args.rates:
                for v in vs[turn % len(vs) :] + vs[: turn % len(vs)]:  # each variant in each place alike
                    if args.prime:  # a server idle while the others ran is loaded a moment first, unrecorded
                        mlperf.run(v["url"], v["pool"], rate, args.prime, 1, args.prime)
                    out = loadgen_dir / f"{v['variant']}-{rate:g}qps-turn{turn}.txt"
                    r = mlperf.run(
                        v["url"], v["pool"], rate, args.seconds, args.min_queries, args.max_seconds, out, v["procs"]
                    )
                    log(
                        f"  turn {turn} {v['variant']} {rate:g} q/s: {'VALID' if r['ok'] else 'INVALID'}, "
                        f"p99 {r.get('p99_ms')} ms, max {r.get('max_ms')} ms, {r['queries']} queries"
                    )
                    runs.append({"turn": turn, "variant": v["variant"], **{k: r.get(k) for k in KEPT}})
                    runs[-1].update({k: r[k] for k in r if k.endswith("_cpu_us_per_query")})
                    # what a worker holds of its own after the run (USS: its heap, not the shared tables)
                    runs[-1]["workers_uss_mb"] = memory_mb(v["procs"]()["workers"], ("uss",))["uss"]
    return [{k: v[k] for k in ("variant", "overlay", "form", "split")} for v in vs], runs


def summary(report: dict) -> list[dict]:
    """Per rate and variant: p99 per turn, VALID runs, median p99 / the first variant's, CPU per query."""
    runs, names, out = report["runs"], [v["variant"] for v in report["variants"]], []
    for rate in report["rates"]:
        at = {n: [r for r in runs if r["variant"] == n and r["target_qps"] == round(rate, 2)] for n in names}
        base = {r["turn"]: r["p99_ms"] for r in at[names[0]]}
        for n in names:
            ratios = [r["p99_ms"] / base[r["turn"]] for r in at[n] if r["p99_ms"] and base.get(r["turn"])]
            cpu = [r.get("workers_cpu_us_per_query") for r in at[n] if r.get("workers_cpu_us_per_query")]
            front = [r.get("frontend_cpu_us_per_query") for r in at[n] if r.get("frontend_cpu_us_per_query")]
            uss = [r["workers_uss_mb"] for r in at[n] if r.get("workers_uss_mb")]
            out.append(
                {
                    "rate": rate,
                    "variant": n,
                    "p99_ms": [r["p99_ms"] for r in at[n]],
                    "max_ms": [r["max_ms"] for r in at[n]],
                    "valid": sum(bool(r["ok"]) for r in at[n]),
                    "runs": len(at[n]),
                    "p99_ratio": round(statistics.median(ratios), 3) if ratios else None,
                    "workers_cpu_ms": round(statistics.median(cpu) / 1000, 2) if cpu else None,
                    "frontend_cpu_ms": round(statistics.median(front) / 1000, 2) if front else None,
                    "workers_uss_mb": max(uss) if uss else None,
                }
            )
    return out


def said(v: dict) -> str:
    """A variant's queries as the load generator sends them."""
    split = v.get("split")
    return v["form"] + (f"; a query of more than {split} pairs as requests sent at once" if split else "")


def markdown(report: dict) -> list[str]:
    m, first = report["machine"], report["variants"][0]["variant"]
    lines = [
        f"**Variants in turns under MLPerf LoadGen** ({report['config']}; {m['cpu']}, {m['available_cpus']} CPUs, ISA "
        f"{m['isa']}; load average {m['load_average'][0]} at the end: a shared machine): every variant served at once "
        f"by its own TorchServe, LoadGen (queries of {mlperf.PAIRS[0]}-{mlperf.PAIRS[1]} pairs, Poisson arrivals, runs "
        f"of at least {report['seconds']:g} s and {report['min_queries']} queries) against one at a time, "
        f"{report['turns']} turns, the order rotated by one each turn, each run after {report.get('prime', 0):g} s of the "
        "same load unrecorded. VALID: LoadGen's verdict (p99 <= "
        f"{mlperf.P99_BOUND_MS:.0f} ms) with no failed query. p99 / {first}: the median over turns of the variant's "
        f"p99 over {first}'s in the same turn. LoadGen's summaries: loadgen/.",
        "",
        "Variants: "
        + "; ".join(f"`{v['variant']}` {v['overlay'] or 'as shipped'} ({said(v)})" for v in report["variants"]),
        "",
    ]
    cells = [
        [f"{s['rate']:g}", s["variant"], f"{s['valid']} / {s['runs']}", ", ".join(str(x) for x in s["p99_ms"])]
        + [", ".join(str(x) for x in s["max_ms"]), s["p99_ratio"], s["workers_cpu_ms"], s.get("frontend_cpu_ms")]
        + [s.get("workers_uss_mb")]
        for s in report["summary"]
    ]
    header = [
        "q/s",
        "variant",
        "VALID",
        "p99 ms per turn",
        "max ms per turn",
        f"p99 / {first}",
        "workers CPU ms / query",
        "frontend CPU ms / query",
        "a worker's own MB (USS, max)",
    ]
    return lines + md_table(header, cells, align="llrllrrrr")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="model-config.criteo.yaml")
    ap.add_argument(
        "--variant",
        action="append",
        required=True,
        metavar="NAME:KEY=VALUE,...",
        help="repeatable; the first is the reference",
    )
    ap.add_argument("--rates", type=float, nargs="+", required=True, help="offered queries per second")
    ap.add_argument("--turns", type=int, default=3, help="the variants' order rotates by one each turn")
    ap.add_argument("--prime", type=float, default=5.0, help="seconds of unrecorded load at the rate before each run")
    ap.add_argument("--seconds", type=float, default=25.0, help="LoadGen's min duration per run")
    ap.add_argument("--max-seconds", type=float, default=60.0, help="LoadGen's max duration per run")
    ap.add_argument("--min-queries", type=int, default=mlperf.MIN_QUERIES, help="LoadGen's min query count per run")
    ap.add_argument("--queries", type=int, default=256, help="distinct queries LoadGen draws from")
    ap.add_argument("--form", default="columns", help=f"{' or '.join(mlperf.FORMS)}; a variant's form=... wins")
    ap.add_argument("--out", default=None, help="output folder; default: results/<date>-turns/")
    args = ap.parse_args(argv)
    variants = [parse_variant(v) for v in args.variant]
    if len({v for v, _ in variants}) != len(variants):
        ap.error("--variant: the names must differ")
    path = (Path(args.config) if Path(args.config).is_file() else ROOT / args.config).resolve()
    out = run_dir(__file__, "turns", "Variants in turns under MLPerf's LoadGen", args.out, argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # killed: the finally blocks stop the servers
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dlrm-turns-") as tmp:
        served_as, runs = in_turns(path, variants, Path(tmp), args, out / "loadgen")
    report = {"machine": machine(), "config": path.name, "rates": args.rates, "turns": args.turns}
    report.update(seconds=args.seconds, min_queries=args.min_queries, max_seconds=args.max_seconds, prime=args.prime)
    report["variants"] = served_as
    report.update(runs=runs, wall_s=round(time.perf_counter() - started))
    report["summary"] = summary(report)
    write_report(out / "turns", report, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
