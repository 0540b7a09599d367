#!/usr/bin/env python
"""Two model archives served side by side by one TorchServe: did a change make serving faster?

    python bench/ab_archives.py --a before.mar --b after.mar --out results/ab-single-row
    # an archive of an older commit: git worktree add /tmp/old <commit>, then in /tmp/old
    #   .venv/bin/python scripts/build_mar.py --config model-config.criteo.yaml --output-dir /tmp/a

Both archives are registered in one TorchServe (the CPU rule's workers each, idle while the
other is loaded; the shipped config.properties, with each archive's own model config) and loaded
in turn, point by point, the order of A and B swapped every round, so that a drift of the shared
machine hits both alike. A point is a request kind and a concurrency: single-row requests
(``1``) or 128-row ranking-form requests (``ranking``) of the archive's config, closed-loop; or
``scenario:RATE``, the MLPerf-shaped Server scenario's queries (bench/mlperf.py:
100-700 pairs, MLPerf's LoadGen in the Server scenario) offered at RATE queries/s. Reports per point the median req/s
and p50/p99 of each and the median over rounds of B's req/s over A's from the same round (for a
scenario point, whose req/s is its rate, B's p99 over A's, and the rounds whose p99 stayed
<= 60 ms). Writes OUT.json and OUT.md.

    python bench/ab_archives.py --a b64.mar --b b1.mar --points scenario:60 scenario:90 --out /tmp/ab
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench import mlperf
from bench.common import RANKING, ROOT, log, make_kind, measure_load, rows_of, serving, write_report


SCENARIO = "scenario"  # KIND of an open-loop point: its number is a query rate


def point_of(text: str) -> tuple:
    kind, _, c = text.partition(":")
    return (int(kind) if kind.isdigit() else kind, float(c) if kind == SCENARIO else int(c))


def summarize(ab: dict, base: str, new: str) -> tuple[dict, list[float], int]:
    """Per side the medians over rounds of req/s, p50 and p99; per round new's req/s over
    base's; and the errors of both."""
    med = {n: {k: statistics.median(x[k] for x in ab[n]) for k in ("requests_per_s", "p50_ms", "p99_ms")} for n in ab}
    ratios = [b["requests_per_s"] / a["requests_per_s"] for a, b in zip(ab[base], ab[new])]
    return med, ratios, sum(x["errors"] for n in ab for x in ab[n])


def cells(med: dict, base: str, new: str) -> tuple[str, str]:
    """The table's "req/s | req/s" and "p50 / p99 | p50 / p99" cells of both sides."""
    return (f"{med[base]['requests_per_s']:,.1f} | {med[new]['requests_per_s']:,.1f}",
            " | ".join(f"{med[n]['p50_ms']:.2f} / {med[n]['p99_ms']:.1f}" for n in (base, new)))


def finish(out: str, report: dict, lines: list[str], started: float) -> int:
    """Writes OUT.json and OUT.md with the run's wall time."""
    report["wall_s"] = round(time.perf_counter() - started)
    write_report(Path(out), report, lines)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", required=True, help="archive A (.mar), e.g. built from the previous commit")
    ap.add_argument("--b", required=True, help="archive B (.mar), e.g. built from this change")
    ap.add_argument("--config", default=str(ROOT / "model-config.criteo.yaml"),
                    help="the model config both archives were built from, for the requests (default: %(default)s)")
    ap.add_argument("--points", nargs="+", default=["1:1", "1:64", f"{RANKING}:16"], metavar="KIND:C",
                    help="request kind (1 = single row, ranking = 128-row ranking form) and concurrency, or "
                         "scenario:RATE (the Server scenario's queries, open loop at RATE/s) (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds (default: %(default)s)")
    ap.add_argument("--duration", type=float, default=6.0, help="seconds per load (default: %(default)s)")
    ap.add_argument("--out", required=True, help="output path without suffix: writes OUT.json and OUT.md")
    args = ap.parse_args()

    from dlrmkit.config import DLRMConfig

    cfg = DLRMConfig.from_yaml(args.config)
    points = [point_of(p) for p in args.points]
    rng = random.Random(7)
    pools = {kind: [make_kind(kind, cfg, rng) for _ in range(256 if kind == 1 else 16)]
             for kind, _ in points if kind != SCENARIO}
    if any(kind == SCENARIO for kind, _ in points):
        pools[SCENARIO] = mlperf.query_pool(cfg, 256)
    first = pools[points[0][0]][0]
    started = time.perf_counter()
    runs = {p: {"a": [], "b": []} for p in points}
    with tempfile.TemporaryDirectory(prefix="dlrm-ab-") as tmp:
        store = Path(tmp) / "store"
        store.mkdir()
        for name in ("a", "b"):
            shutil.copy(getattr(args, name), store / f"{name}.mar")
        probe = first[1] if isinstance(first, tuple) else first
        with serving(Path(tmp) / "home", store, {"a": probe, "b": probe}, timeout=300) as srv:
            if SCENARIO in pools:  # the frontend's JIT warms up on these large bodies before round 1
                for name in ("a", "b"):
                    rate = min(c for k, c in points if k == SCENARIO)
                    mlperf.run(f"{srv.url}/predictions/{name}", pools[SCENARIO], rate, args.duration, min_queries=1)
            for r in range(args.rounds):
                for point in points:
                    kind, c = point
                    for name in ("a", "b") if r % 2 == 0 else ("b", "a"):
                        url = f"{srv.url}/predictions/{name}"
                        if kind == SCENARIO:
                            p = mlperf.run(url, pools[kind], c, args.duration, min_queries=1)
                            got = {"requests_per_s": p["queries_per_s"], "p50_ms": p["p50_ms"], "p99_ms": p["p99_ms"],
                                   "errors": p["errors"], "ok": p["p99_ms"] <= mlperf.P99_BOUND_MS and not p["errors"]}
                        else:
                            got = measure_load(url, pools[kind], rows_of(kind), c, args.duration)
                        runs[point][name].append(got)
                        log(f"round {r + 1}/{args.rounds} {kind}:{c} {name.upper()}: {got['requests_per_s']:,.1f} req/s, "
                            f"p50 {got['p50_ms']:.2f} ms, p99 {got['p99_ms']:.1f} ms")

    report = {"command": "python bench/ab_archives.py " + " ".join(sys.argv[1:]), "a": args.a, "b": args.b,
              "rounds": args.rounds, "duration_s": args.duration, "points": []}
    lines = [f"A = `{args.a}`, B = `{args.b}`; one TorchServe, {args.rounds} rounds of {args.duration:g} s per "
             "point, A and B in turn (order swapped every round); `B / A`: median over rounds of B's req/s over "
             "A's in the same round.", "",
             "| requests | concurrency | A req/s | B req/s | B / A | A p50 / p99 ms | B p50 / p99 ms | errors |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for (kind, c), ab in runs.items():
        med, ratios, errors = summarize(ab, "a", "b")
        rates, latencies = cells(med, "a", "b")
        if kind == SCENARIO:
            ratios = [b["p99_ms"] / a["p99_ms"] for a, b in zip(ab["a"], ab["b"])]
            passed = {n: sum(x["ok"] for x in ab[n]) for n in ab}
            what = (f"scenario queries, LoadGen at {c:g}/s (B / A: p99; p99 <= {mlperf.P99_BOUND_MS:.0f} ms in A "
                    f"{passed['a']}/{len(ab['a'])}, B {passed['b']}/{len(ab['b'])} rounds)")
        else:
            passed = None
            what = "single row" if kind == 1 else f"{rows_of(kind)} rows ({kind})"
        ratio = statistics.median(ratios)
        report["points"].append({"kind": kind, "concurrency": c, "a": med["a"], "b": med["b"],
                                 "b_over_a": round(ratio, 3), "errors": errors,
                                 **({"rounds_within_p99_bound": passed} if passed else {})})
        lines.append(f"| {what} | {'' if kind == SCENARIO else c} | {rates} | {ratio:.3f} | {latencies} | {errors} |")
    return finish(args.out, report, lines, started)


if __name__ == "__main__":
    sys.exit(main())
