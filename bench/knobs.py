#!/usr/bin/env python
"""TorchServe's settings, measured: which knob values serve the most on this machine.

    python bench/knobs.py                   # what `make knobs` runs; ~10 minutes
    python bench/knobs.py --rounds 1 --duration 3    # a quick look
    python bench/knobs.py --placements --cpus 1 2 --rounds 3 --duration 5
                                            # workers x threads on 1 and 2 CPUs (dlrmkit.cpus.cpu_rule)

Each setting is a fresh TorchServe (the shipped config.properties plus the setting's
overrides) serving the Criteo-layout archive; each is measured at the two headline points
(single-row requests at concurrency 64, 128-row ranking-form requests at concurrency 16), in
``--rounds`` rounds, the settings' order reversed every other round, so that a drift of the
shared machine hits every setting alike. Reported per setting: the median over rounds of
req/s, rows/s and p99, and each as a ratio to the shipped setting measured in the same rounds.
Writes knobs.json, knobs.md and run.json to results/<date>-knobs/ (--out DIR). With ``--cpus``, every setting is also
measured with TorchServe (frontend and workers) pinned to the first N CPUs of this process
(sched_setaffinity before the start; the load generator is not pinned), each CPU count with its
own reference setting; with ``--placements`` the settings are workers x torch threads.
The shipped settings were chosen from the run in results/knobs-focus.* (docs/performance.md).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.common import RANKING, ROOT, build_archive, log, make_kind, measure_load, md_table, memory_mb, rows_of
from bench.common import run_dir, serving, write_report

# name -> (config.properties overrides, model-config overrides). "shipped" is the kit's own.
SETTINGS = {
    "shipped": ({}, {}),
    "number_of_netty_threads=1": ({"number_of_netty_threads": 1}, {}),
    "number_of_netty_threads=4": ({"number_of_netty_threads": 4}, {}),
    "netty_client_threads=1": ({"netty_client_threads": 1}, {}),
    "netty_client_threads=4": ({"netty_client_threads": 4}, {}),
    "job_queue_size=1000": ({"job_queue_size": 1000}, {}),
    "batchSize=32": ({}, {"batchSize": 32}),
    "batchSize=128": ({}, {"batchSize": 128}),
    "maxBatchDelay=5": ({}, {"maxBatchDelay": 5}),
    "batchSize=128 + netty_client_threads=1": ({"netty_client_threads": 1}, {"batchSize": 128}),
    # the kit's plugin: batches by count alone, as TorchServe without it (docs/performance.md#batches-bounded)
    "dlrm_batch_bytes=0": ({"dlrm_batch_bytes": 0}, {}),
}
HANDLER_KEYS = ("torch_threads",)
# workers x torch threads per worker (the CPU rule's candidates, dlrmkit.cpus.cpu_rule)
PLACEMENTS = {
    f"{w} worker(s) x {t} thread(s)": ({}, {"minWorkers": w, "maxWorkers": w, "torch_threads": t})
    for w, t in ((1, 1), (2, 1), (1, 2))
}
POINTS = ((1, 64), (RANKING, 16))  # (request kind, concurrency)


def build(cfg_path: Path, store: Path, chosen: list[str], settings: dict) -> dict[str, str]:
    """One archive per distinct model-config override; returns setting -> archive name."""
    names = {}
    for name in chosen:
        model_kw = settings[name][1]
        key = "dlrm" if not model_kw else "dlrm_" + "_".join(f"{k}{v}" for k, v in model_kw.items())
        names[name] = key
        if not (store / f"{key}.mar").exists():
            items = {("handler." if k in HANDLER_KEYS else "") + k: v for k, v in model_kw.items()}
            build_archive(cfg_path, store, key, items)
    return names


def measure(srv, model: str, bodies: dict, duration: float) -> dict:
    """The POINTS, and MB per worker (the mapped tables are shared: USS is what one more costs)."""
    url = f"{srv.url}/predictions/{model}"
    out = {
        f"{'single' if kind == 1 else 'ranking'}_c{c}": measure_load(url, bodies[kind], rows_of(kind), c, duration)
        for kind, c in POINTS
    }
    out["memory"] = memory_mb(srv.worker_pids(model), ("rss", "pss", "uss"))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--config", default=str(ROOT / "model-config.criteo.yaml"), help="model config (default: %(default)s)"
    )
    ap.add_argument("--duration", type=float, default=6.0, help="seconds per load point (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds over all settings (default: %(default)s)")
    ap.add_argument(
        "--settings",
        nargs="+",
        choices=list(SETTINGS) + list(PLACEMENTS),
        default=None,
        metavar="NAME",
        help="settings to measure, beside 'shipped' (default: all of SETTINGS, or of PLACEMENTS "
        "with --placements: %(choices)s)",
    )
    ap.add_argument(
        "--placements",
        action="store_true",
        help="measure workers x torch threads (PLACEMENTS) instead of TorchServe's knobs; the first is the reference",
    )
    ap.add_argument(
        "--cpus",
        type=int,
        nargs="+",
        default=[None],
        help="pin TorchServe to the first N CPUs, for each N given (default: no pinning)",
    )
    ap.add_argument("--out", help="write knobs.json, knobs.md and run.json here (default: results/<date>-knobs/)")
    args = ap.parse_args()
    settings = PLACEMENTS if args.placements else SETTINGS
    names = args.settings or list(settings)
    ref = names[0] if args.placements else "shipped"
    chosen = [ref] + [name for name in names if name != ref]

    from dlrmkit.config import DLRMConfig

    cfg_path = Path(args.config).resolve()
    cfg = DLRMConfig.from_yaml(cfg_path)
    rng = random.Random(5)
    bodies = {
        1: [make_kind(1, cfg, rng) for _ in range(256)],
        RANKING: [make_kind(RANKING, cfg, rng) for _ in range(16)],
    }
    started = time.perf_counter()
    # (CPUs, setting) -> one result per round; 1-CPU placements that need 2 CPUs are left out
    cases = [
        (n, name)
        for n in args.cpus
        for name in chosen
        if not (args.placements and n == 1 and settings[name][1]["torch_threads"] > 1)
    ]
    runs: dict[tuple, list[dict]] = {case: [] for case in cases}
    with tempfile.TemporaryDirectory(prefix="dlrm-knobs-") as tmp:
        tmp = Path(tmp)
        store = tmp / "store"
        store.mkdir()
        archives = build(cfg_path, store, chosen, settings)
        for r in range(args.rounds):
            for n, name in cases if r % 2 == 0 else cases[::-1]:
                model, home = archives[name], tmp / f"home-{r}-{len(runs[n, name])}-{n}-{archives[name]}"
                cpus = set(sorted(os.sched_getaffinity(0))[:n]) if n else None  # the first n CPUs
                with serving(home, store, {model: bodies[1][0]}, None, 300, cpus, overrides=settings[name][0]) as srv:
                    got = measure(srv, model, bodies, args.duration)
                runs[n, name].append(got)
                uss, pts = got["memory"]["uss"], [(k, v) for k, v in got.items() if k != "memory"]
                said = ", ".join(f"{k} {v['requests_per_s']:,.0f} req/s p99 {v['p99_ms']:.1f} ms" for k, v in pts)
                log(f"round {r + 1}/{args.rounds} {name} on {n or 'all'} CPU(s): {said}; worker USS {uss} MB")

    report = {
        "config": cfg_path.name,
        "cpus": len(os.sched_getaffinity(0)),
        "rounds": args.rounds,
        "duration_s": args.duration,
        "reference": ref,
        "settings": {},
    }
    for (n, name), rs in runs.items():
        base = runs[n, ref]
        row = {"pinned_cpus": n, "memory_mb_per_worker": rs[-1]["memory"]}
        for point in (p for p in rs[0] if p != "memory"):
            med = {k: statistics.median(x[point][k] for x in rs) for k in ("requests_per_s", "rows_per_s", "p99_ms")}
            # ratio to the reference setting, round by round (the same stretch of machine time)
            ratios = [x[point]["requests_per_s"] / b[point]["requests_per_s"] for x, b in zip(rs, base)]
            rows_s, p99s = [x[point]["rows_per_s"] for x in rs], [x[point]["p99_ms"] for x in rs]
            row[point] = {k: round(v, 1) for k, v in med.items()} | {
                "vs_shipped": round(statistics.median(ratios), 3),
                "vs_range": [round(min(ratios), 3), round(max(ratios), 3)],
                "range": [round(min(rows_s)), round(max(rows_s))],
                "p99_range": [round(min(p99s), 1), round(max(p99s), 1)],
                "errors": sum(x[point]["errors"] for x in rs),
            }
        report["settings"][name if n is None else f"{name} on {n} CPU(s)"] = row
    report["wall_s"] = round(time.perf_counter() - started)
    lines = [
        f"TorchServe settings on {report['cpus']} CPUs, `{report['config']}`; median of {args.rounds} rounds of "
        f"{args.duration:g} s per point, the cases' order reversed every round; `vs {ref}`: req/s over "
        f"{ref}'s in the same round (median, range){' on the same CPUs' if args.cpus != [None] else ''}. "
        "Worker memory: MB per worker (RSS / PSS / USS, the last the pages no other process shares).",
        "",
    ]
    header = f"setting | single row c=64 req/s | vs {ref} | p99 ms | ranking 128 rows c=16 rows/s (range) | vs {ref} | "
    header += "p99 ms (range) | errors | worker MB RSS / PSS / USS"

    def cells(name: str, row: dict) -> list:
        s, k, m = row["single_c64"], row["ranking_c16"], row["memory_mb_per_worker"]
        vs_s, vs_k = (f"{x['vs_shipped']} ({'-'.join(map(str, x['vs_range']))})" for x in (s, k))
        rows_s = f"{k['rows_per_s']:,.0f} ({k['range'][0]:,}-{k['range'][1]:,})"
        p99_k = f"{k['p99_ms']} ({k['p99_range'][0]}-{k['p99_range'][1]})"
        req_s, mb = f"{s['requests_per_s']:,.0f}", f"{m['rss']} / {m['pss']} / {m['uss']}"
        return [name, req_s, vs_s, s["p99_ms"], rows_s, vs_k, p99_k, s["errors"] + k["errors"], mb]

    lines += md_table(header.split(" | "), [cells(*x) for x in report["settings"].items()], right=True)
    write_report(run_dir(__file__, "knobs", "TorchServe's settings, measured", args.out) / "knobs", report, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
