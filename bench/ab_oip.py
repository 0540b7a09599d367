#!/usr/bin/env python
"""Does the OIP endpoint plugin slow inference? TorchServe without it (before) and with it
(after), the same archive, side by side in one run.

    python bench/ab_oip.py --out results/ab-oip

Two TorchServes from the shipped config.properties on free loopback ports, one with
``plugins_path`` empty (stock TorchServe 0.12), one with the kit's build/plugins (`make plugin`),
each serving the same archive with one worker. Points: ``v2`` = 128-row Open Inference Protocol
binary requests to /v2/models/dlrm/infer (tritonclient's layout), ``1`` = single-row
/predictions requests; the two servers in turn, point by point, the order swapped every round,
so a drift of the shared machine hits both alike. Reports per point the median req/s and p50/p99
of each and the median (and range) over rounds of after's req/s over before's from the same
round. Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "scripts")]
from benchmark import RANKING_ROWS, log, make_kind, request_loop, v2_bodies, v2_header_length  # noqa: E402
from ab_archives import cells, finish, summarize  # noqa: E402
from loadgen import run_load  # noqa: E402
from tsctl import ROOT, Server  # noqa: E402

PLUGIN = ROOT / "build" / "plugins" / "dlrm-oip.jar"


def measure(url: str, pool: list[bytes], headers: dict, concurrency: int, duration: float) -> dict:
    next_request, errors = request_loop(pool)
    asyncio.run(run_load(url, next_request, concurrency, min(2.0, duration), 100_000, headers=headers))
    errors[0] = 0
    res = asyncio.run(run_load(url, next_request, concurrency, duration, 2_000_000, headers=headers))
    return {"requests_per_s": res.answered / res.wall_s, "p50_ms": res.percentile(50),
            "p99_ms": res.percentile(99), "errors": errors[0] + res.transport_errors}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "model-config.yaml"), help="model config (default: %(default)s)")
    ap.add_argument("--points", nargs="+", default=["v2:16", "1:64"], metavar="KIND:C",
                    help="v2 (128-row binary /v2 infer) or 1 (single-row /predictions), and concurrency "
                         "(default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds (default: %(default)s)")
    ap.add_argument("--duration", type=float, default=6.0, help="seconds per load (default: %(default)s)")
    ap.add_argument("--out", required=True, help="output path without suffix: writes OUT.json and OUT.md")
    args = ap.parse_args()
    if not PLUGIN.is_file():
        sys.exit(f"error: {PLUGIN} is missing: run `make plugin`")

    import build_mar
    from dlrmkit.config import DLRMConfig

    cfg = DLRMConfig.from_yaml(args.config)
    rng = random.Random(7)
    points = [(k, int(c)) for k, _, c in (p.partition(":") for p in args.points)]
    pools, headers = {}, {}
    for kind, _ in points:
        if kind == "v2":
            bodies = [v2_bodies(cfg, rng, RANKING_ROWS)[1] for _ in range(16)]
            pools[kind], headers[kind] = bodies, {"Inference-Header-Content-Length": str(v2_header_length(bodies[0]))}
            assert len({v2_header_length(b) for b in bodies}) == 1
        else:
            pools[kind], headers[kind] = [make_kind(int(kind), cfg, rng) for _ in range(256)], {}
    path = {"v2": "/v2/models/dlrm/infer", "1": "/predictions/dlrm"}
    started = time.perf_counter()
    runs = {p: {"before": [], "after": []} for p in points}
    with tempfile.TemporaryDirectory(prefix="dlrm-ab-oip-") as tmp:
        store = Path(tmp) / "store"
        build_mar.main(["--config", args.config, "--output-dir", str(store), "--force"])
        servers = {"before": Server.on_free_ports(Path(tmp) / "before", model_store=store,
                                                  overrides={"plugins_path": ""}),
                   "after": Server.on_free_ports(Path(tmp) / "after", model_store=store)}
        try:
            for name, srv in servers.items():
                log(f"starting TorchServe ({name})")
                srv.start()
            for srv in servers.values():
                srv.wait_ready("dlrm", pools["1"][0] if "1" in pools else make_kind(1, cfg, rng), timeout=300)
            for r in range(args.rounds):
                for point in points:
                    kind, c = point
                    for name in ("before", "after") if r % 2 == 0 else ("after", "before"):
                        got = measure(servers[name].url + path[kind], pools[kind], headers[kind], c, args.duration)
                        runs[point][name].append(got)
                        log(f"round {r + 1}/{args.rounds} {kind}:{c} {name}: {got['requests_per_s']:,.1f} req/s, "
                            f"p50 {got['p50_ms']:.2f} ms, p99 {got['p99_ms']:.1f} ms, errors {got['errors']}")
        finally:
            for srv in servers.values():
                srv.stop()

    report = {"command": "python bench/ab_oip.py " + " ".join(sys.argv[1:]), "config": args.config,
              "rounds": args.rounds, "duration_s": args.duration, "points": []}
    lines = [f"before = stock TorchServe 0.12 (no plugin), after = with the OIP endpoint plugin; same archive "
             f"({Path(args.config).name}), one worker each, {args.rounds} rounds of {args.duration:g} s per point, "
             "in turn (order swapped every round); `after / before`: median (range) over rounds of the same "
             "round's req/s ratio.", "",
             "| requests | concurrency | before req/s | after req/s | after / before (range) | before p50 / p99 ms "
             "| after p50 / p99 ms | errors |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for (kind, c), ab in runs.items():
        med, ratios, errors = summarize(ab, "before", "after")
        report["points"].append({"kind": kind, "concurrency": c, "before": med["before"], "after": med["after"],
                                 "after_over_before": round(statistics.median(ratios), 3),
                                 "range": [round(min(ratios), 3), round(max(ratios), 3)], "errors": errors})
        what = f"{RANKING_ROWS}-row v2 binary /v2/models/dlrm/infer" if kind == "v2" else "single-row /predictions"
        rates, latencies = cells(med, "before", "after")
        lines.append(f"| {what} | {c} | {rates} | {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}) "
                     f"| {latencies} | {errors} |")
    return finish(args.out, report, lines, started)


if __name__ == "__main__":
    sys.exit(main())
