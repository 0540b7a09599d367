#!/usr/bin/env python
"""TorchServe's settings, measured: which knob values serve the most on this machine.

    python bench/knobs.py                   # what `make knobs` runs; ~10 minutes
    python bench/knobs.py --rounds 1 --duration 3    # a quick look

Each setting is a fresh TorchServe (the shipped config.properties plus the setting's
overrides) serving the Criteo-layout archive; each is measured at the two headline points
(single-row requests at concurrency 64, 128-row ranking-form requests at concurrency 16), in
``--rounds`` rounds, the settings' order reversed every other round, so that a drift of the
shared machine hits every setting alike. Reported per setting: the median over rounds of
req/s, rows/s and p99, and each as a ratio to the shipped setting measured in the same rounds.
Writes results/knobs.json and results/knobs.md (--out).
The shipped settings were chosen from the run in results/knobs-focus.* (docs/performance.md).
"""

from __future__ import annotations

import argparse
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
from benchmark import RANKING, log, make_kind, measure_load, rows_of, write_report  # noqa: E402
from tsctl import ROOT, Server  # noqa: E402

sys.path.insert(0, str(ROOT))

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
}
POINTS = ((1, 64), (RANKING, 16))  # (request kind, concurrency)


def build(cfg_path: Path, store: Path, chosen: list[str]) -> dict[str, str]:
    """One archive per distinct model-config override; returns setting -> archive name."""
    import yaml

    names = {}
    for name in chosen:
        model_kw = SETTINGS[name][1]
        key = "dlrm" if not model_kw else "dlrm_" + "_".join(f"{k}{v}" for k, v in model_kw.items())
        names[name] = key
        if (store / f"{key}.mar").exists():
            continue
        doc = yaml.safe_load(cfg_path.read_text())
        doc.update(model_kw)
        cfg = store / f"{key}.yaml"
        cfg.write_text(yaml.safe_dump(doc))
        log(f"building {key}.mar")
        subprocess.run([sys.executable, str(ROOT / "scripts" / "build_mar.py"), "--config", str(cfg),
                        "--output-dir", str(store), "--model-name", key, "--force"], check=True,
                       stdout=subprocess.DEVNULL)
    return names


def measure(srv: Server, model: str, bodies: dict, duration: float) -> dict:
    url = f"{srv.url}/predictions/{model}"
    return {f"{'single' if kind == 1 else 'ranking'}_c{c}": measure_load(url, bodies[kind], rows_of(kind), c, duration)
            for kind, c in POINTS}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "model-config.criteo.yaml"), help="model config (default: %(default)s)")
    ap.add_argument("--duration", type=float, default=6.0, help="seconds per load point (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds over all settings (default: %(default)s)")
    ap.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS), metavar="NAME",
                    help="settings to measure, beside 'shipped' (default: all: %(choices)s)")
    ap.add_argument("--out", default=str(ROOT / "results" / "knobs"),
                    help="output path without suffix: writes OUT.json and OUT.md (default: %(default)s)")
    args = ap.parse_args()
    chosen = ["shipped"] + [name for name in args.settings if name != "shipped"]

    from dlrm_config import DLRMConfig

    cfg_path = Path(args.config).resolve()
    cfg = DLRMConfig.from_yaml(cfg_path)
    rng = random.Random(5)
    bodies = {1: [make_kind(1, cfg, rng) for _ in range(256)], RANKING: [make_kind(RANKING, cfg, rng) for _ in range(16)]}
    started = time.perf_counter()
    runs: dict[str, list[dict]] = {name: [] for name in chosen}
    with tempfile.TemporaryDirectory(prefix="dlrm-knobs-") as tmp:
        tmp = Path(tmp)
        store = tmp / "store"
        store.mkdir()
        archives = build(cfg_path, store, chosen)
        order = chosen
        for r in range(args.rounds):
            for name in order if r % 2 == 0 else order[::-1]:
                props, _ = SETTINGS[name]
                model = archives[name]
                srv = Server.on_free_ports(tmp / f"home-{r}-{len(runs[name])}-{model}", model_store=store,
                                           overrides={"load_models": f"{model}={model}.mar", **props})
                srv.start()
                try:
                    srv.wait_ready(model, bodies[1][0], timeout=300)
                    got = measure(srv, model, bodies, args.duration)
                finally:
                    srv.stop()
                runs[name].append(got)
                log(f"round {r + 1}/{args.rounds} {name}: " + ", ".join(
                    f"{k} {v['requests_per_s']:,.0f} req/s p99 {v['p99_ms']:.1f} ms" for k, v in got.items()))

    report = {"command": "python bench/knobs.py " + " ".join(sys.argv[1:]), "config": cfg_path.name,
              "cpus": os.cpu_count(), "rounds": args.rounds, "duration_s": args.duration, "settings": {}}
    base = runs["shipped"]
    for name, rs in runs.items():
        row = {}
        for point in rs[0]:
            med = {k: statistics.median(x[point][k] for x in rs) for k in ("requests_per_s", "rows_per_s", "p99_ms")}
            # ratio to the shipped setting, round by round (the same stretch of machine time)
            ratio = statistics.median(x[point]["requests_per_s"] / b[point]["requests_per_s"] for x, b in zip(rs, base))
            row[point] = {**{k: round(v, 1) for k, v in med.items()}, "vs_shipped": round(ratio, 3),
                          "errors": sum(x[point]["errors"] for x in rs)}
        report["settings"][name] = row
    report["wall_s"] = round(time.perf_counter() - started)
    lines = [f"TorchServe settings on {report['cpus']} CPUs, `{report['config']}`, 1 worker; median of "
             f"{args.rounds} rounds of {args.duration:g} s per point; `vs shipped`: req/s over the shipped "
             "setting's in the same round (median).", "",
             "| setting | single row c=64 req/s | vs shipped | p99 ms | ranking 128 rows c=16 rows/s | vs shipped | "
             "p99 ms | errors |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, row in report["settings"].items():
        s, k = row["single_c64"], row["ranking_c16"]
        lines.append(f"| {name} | {s['requests_per_s']:,.0f} | {s['vs_shipped']} | {s['p99_ms']} | "
                     f"{k['rows_per_s']:,.0f} | {k['vs_shipped']} | {k['p99_ms']} | {s['errors'] + k['errors']} |")
    write_report(Path(args.out), report, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
