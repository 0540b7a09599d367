#!/usr/bin/env python
"""Scale benchmark: speed per embedding dtype, load cost vs table size, memory of 1/2/4 workers.

    python bench/bench_scale.py                         # all three parts (~15 min on 2 cores)
    python bench/bench_scale.py --parts speed load      # a subset
    python bench/bench_scale.py --device cuda           # speed and load on a GPU

Writes results/scale.json and results/scale.md (a run of some --parts replaces those parts and
keeps the others; each part's ratios come from one run on one machine, absolute times move with
the machine's load). Archives and servers live under results/tmp/ and are
deleted afterwards.

speed    The Criteo-layout config (model-config.criteo.yaml) per dtype: rows/s and p50/p99 latency
         of score() (collated batch -> probabilities, what the handler runs) at batch 1/32/256
         (rows/s = batch / median latency; the dtypes take turns batch by batch),
         and the score difference vs fp32 on a fixed set of 4,096 requests.
load     Three sizes of the Criteo layout (tables capped at --caps rows): per dtype, archive
         size, load time and the RSS of a fresh process after loading and after scoring 200
         random batches of 256 rows.
workers  A real TorchServe with 1, 2, 4 CPU workers of the largest fp32 model (tables >= 2 GB),
         and of its int8 version: per-worker RSS, PSS and USS (psutil memory_full_info) after
         every worker scored requests that read every table row. RSS counts a shared page in
         every process that touched it; PSS splits it between them (their sum is the real
         cost); USS is what a worker alone holds (the marginal cost of one more worker).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The Criteo 1TB table sizes (torchrec's DLRM example, DEFAULT_CAT_NAMES order).
CRITEO_1TB_ROWS = [45833188, 36746, 17245, 7413, 20243, 3, 7114, 1441, 62, 29275261, 1572176, 345138, 10, 2209,
                   11267, 128, 4, 974, 14, 48937457, 11316796, 40094537, 452104, 12606, 104, 35]
DTYPES = ["fp32", "fp16", "int8", "int4"]


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def criteo_doc(cap: int, dtype: str = "fp32") -> dict:
    import yaml

    doc = yaml.safe_load((ROOT / "model-config.criteo.yaml").read_text())
    doc["handler"]["num_embeddings"] = [min(r, cap) for r in CRITEO_1TB_ROWS]
    doc["handler"]["embedding_dtype"] = dtype
    doc["handler"]["id_overflow"] = "error"
    return doc


def write_archives(tmp: Path, cap: int, dtypes: list[str]) -> dict[str, Path]:
    """dlrm.pt per dtype from one seeded fp32 model (quantized from it, as build_mar.py does)."""
    import torch
    import yaml

    from dlrmkit.config import DLRMConfig
    from dlrmkit.model import DLRMFactory

    out = {}
    fp32 = None
    for i, dtype in enumerate(dtypes):
        path = tmp / f"cap{cap}-{dtype}.pt"
        doc = criteo_doc(cap, dtype)
        (tmp / f"cap{cap}-{dtype}.yaml").write_text(yaml.safe_dump(doc))
        if not path.exists():
            if fp32 is None:
                log(f"random fp32 weights, tables capped at {cap:,} rows")
                fp32 = DLRMFactory(DLRMConfig.from_dict(doc["handler"])).random()
            factory = DLRMFactory(DLRMConfig.from_dict(doc["handler"]))
            # quantize() works in place: copy the fp32 model unless nothing needs it afterwards
            source = fp32 if dtype == "fp32" or i == len(dtypes) - 1 else _copy(fp32)
            torch.save(factory.archive_state(source), path)
            log(f"wrote {path.name}: {path.stat().st_size / 1e9:.2f} GB")
        out[dtype] = path
    return out


def _copy(model):
    import copy

    return copy.deepcopy(model)


# --- speed ------------------------------------------------------------------------------------

def bench_speed(tmp: Path, device: str, reps: int) -> dict:
    import torch

    from dlrmkit.config import DLRMConfig
    from dlrmkit.batch import Batch, scores
    from dlrmkit.model import DLRMFactory

    archives = write_archives(tmp, 100_000, DTYPES)
    cfg = {d: DLRMConfig.from_dict(criteo_doc(100_000, d)["handler"]) for d in DTYPES}
    gen = torch.Generator().manual_seed(7)
    fixed = DLRMFactory(cfg["fp32"]).probe_batch(4096, gen)
    batches = {b: [DLRMFactory(cfg["fp32"]).probe_batch(b, gen) for _ in range(8)] for b in (1, 32, 256)}
    out: dict = {"threads": torch.get_num_threads(), "device": device, "dtypes": {}}
    models = {d: DLRMFactory(cfg[d]).load(archives[d], device) for d in DTYPES}

    def run(dtype, dense, kjt):
        return scores(models[dtype], Batch(dense.to(device), kjt.to(torch.device(device)), [dense.shape[0]]), cfg[dtype])[0]

    ref = torch.tensor(run("fp32", *fixed))
    for dtype in DTYPES:
        diff = (torch.tensor(run(dtype, *fixed)) - ref).abs()
        out["dtypes"][dtype] = {"max_abs_diff_vs_fp32": float(diff.max()), "mean_abs_diff_vs_fp32": float(diff.mean()),
                                "batch": {}}
    # The dtypes take turns batch by batch, so a burst of load from other processes on a
    # shared machine hits all of them alike and the ratios hold.
    for b, bs in batches.items():
        wait_quiet()
        times: dict[str, list[float]] = {d: [] for d in DTYPES}
        for i in range(reps + 3):
            dense, kjt = bs[i % len(bs)]
            for dtype in DTYPES:
                t0 = time.perf_counter()
                run(dtype, dense, kjt)
                if i >= 3:  # the first calls warm up caches and lazily built state
                    times[dtype].append(time.perf_counter() - t0)
        for dtype, ts in times.items():
            ts.sort()
            p50, p99 = ts[len(ts) // 2], ts[min(len(ts) - 1, int(len(ts) * 0.99))]
            out["dtypes"][dtype]["batch"][b] = {"rows_per_s": b / p50, "p50_ms": p50 * 1e3, "p99_ms": p99 * 1e3}
        log(f"speed B={b}: " + ", ".join(f"{d} {times[d][len(times[d]) // 2] * 1e3:.2f} ms" for d in DTYPES))
    return out


def wait_quiet(limit_s: float = 120, busy: float = 30.0) -> None:
    """Wait (bounded) until other processes use under ``busy`` % of the CPUs."""
    import psutil

    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        load = psutil.cpu_percent(interval=2.0)
        if load < busy:
            return
        log(f"machine busy ({load:.0f}% CPU), waiting")
    log("machine still busy; measuring anyway (ratios stay fair, absolute times do not)")


# --- load cost vs size --------------------------------------------------------------------------

LOAD_CHILD = r"""
import json, sys, time
sys.path[:0] = [sys.argv[1]]
import psutil, torch
from dlrmkit.config import DLRMConfig
from dlrmkit.batch import Batch, scores
from dlrmkit.model import DLRMFactory
import yaml
def hwm():  # this process's peak RSS (ru_maxrss would include the parent's: kept across exec)
    return int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) * 1024
doc = yaml.safe_load(open(sys.argv[3]))
cfg = DLRMConfig.from_dict(doc["handler"])
p = psutil.Process()
rss0 = p.memory_info().rss
t0 = time.perf_counter()
model = DLRMFactory(cfg).load(sys.argv[2], sys.argv[4])
load_s = time.perf_counter() - t0
rss_loaded = p.memory_info().rss
peak_loaded = hwm()
gen = torch.Generator().manual_seed(0)
t0 = time.perf_counter()
dense, kjt = DLRMFactory(cfg).probe_batch(256, gen)
scores(model, Batch(dense.to(sys.argv[4]), kjt.to(torch.device(sys.argv[4])), [256]), cfg)
first_s = time.perf_counter() - t0
for _ in range(199):
    dense, kjt = DLRMFactory(cfg).probe_batch(256, gen)
    scores(model, Batch(dense.to(sys.argv[4]), kjt.to(torch.device(sys.argv[4])), [256]), cfg)
m = p.memory_full_info()
print(json.dumps({"load_s": load_s, "first_batch_s": first_s, "rss_before": rss0, "rss_loaded": rss_loaded,
                  "peak_loaded": peak_loaded, "rss_served": m.rss, "uss_served": m.uss,
                  "peak": hwm()}))
"""


def bench_load(tmp: Path, device: str, caps: list[int]) -> dict:
    from dlrmkit.config import DLRMConfig
    from dlrmkit.scale import table_bytes

    out = {}
    for cap in caps:
        archives = write_archives(tmp, cap, ["fp32", "int8"])
        cfg = DLRMConfig.from_dict(criteo_doc(cap)["handler"])
        row = {"rows": sum(cfg.num_embeddings), "dtypes": {}}
        for dtype, path in archives.items():
            res = subprocess.run([sys.executable, "-c", LOAD_CHILD, str(ROOT), str(path),
                                  str(tmp / f"cap{cap}-{dtype}.yaml"), device],
                                 check=True, capture_output=True, text=True)
            r = json.loads(res.stdout.strip().splitlines()[-1])
            r["table_bytes"] = sum(table_bytes(n, cfg.embedding_dim, dtype) for n in cfg.num_embeddings)
            r["archive_bytes"] = path.stat().st_size
            row["dtypes"][dtype] = r
            log(f"load cap {cap:,} {dtype}: tables {r['table_bytes'] / 1e9:.2f} GB, load {r['load_s']:.2f} s, "
                f"RSS +{(r['rss_loaded'] - r['rss_before']) / 1e6:.0f} MB loaded, "
                f"+{(r['rss_served'] - r['rss_before']) / 1e6:.0f} MB after 200 batches")
        out[cap] = row
        if cap != max(caps):  # the largest is reused by the worker test
            for path in archives.values():
                path.unlink()
    return out


# --- workers ------------------------------------------------------------------------------------

def sweep_requests(cfg, max_ids: int) -> list[bytes]:
    """Requests that together read every row of every table once (one bag per request)."""
    reqs = []
    for name, rows in zip(cfg.sparse_features, cfg.num_embeddings):
        for start in range(0, rows, max_ids):
            ids = list(range(start, min(rows, start + max_ids)))
            reqs.append(json.dumps({"dense": [0.0] * cfg.num_dense_features,
                                    "sparse": {"keys": [name], "values": ids, "lengths": [len(ids)]}}).encode())
    return reqs


def bench_workers(tmp: Path, cap: int, counts: list[int]) -> dict:
    import psutil
    import yaml

    from scripts import build_mar
    from dlrmkit.config import DLRMConfig
    from scripts.tsctl import Server, post

    out = {}
    archives = write_archives(tmp, cap, ["fp32", "int8"])
    for dtype, weights in archives.items():
        doc = criteo_doc(cap, dtype)
        cfg = DLRMConfig.from_dict(doc["handler"])
        sweep = sweep_requests(cfg, cfg.max_ids_per_request)
        probe = sweep[0]
        out[dtype] = {"table_bytes": weights.stat().st_size, "workers": {}}
        for n in counts:
            doc.update(minWorkers=n, maxWorkers=n, startupTimeout=600, responseTimeout=600)
            cfg_path = tmp / f"workers-{dtype}.yaml"
            cfg_path.write_text(yaml.safe_dump(doc))
            store = tmp / "store"
            shutil.rmtree(store, ignore_errors=True)
            log(f"workers: archive {dtype}, {n} worker(s)")
            _archive(build_mar, cfg_path, weights, store)
            srv = Server.on_free_ports(tmp / "home", model_store=store,
                                       overrides={"default_workers_per_model": n})
            try:
                srv.start()
                srv.wait_ready("dlrm", probe, timeout=900, progress=log)
                pids = srv.worker_pids("dlrm")
                # Every worker should read every row: send the sweep once per worker, concurrently.
                from concurrent.futures import ThreadPoolExecutor

                with ThreadPoolExecutor(max(2, n)) as pool:
                    statuses = list(pool.map(lambda r: post(f"{srv.url}/predictions/dlrm", r, timeout=600)[0],
                                             sweep * n))
                assert all(s == 200 for s in statuses), statuses[:5]
                mem = [psutil.Process(p).memory_full_info() for p in pids]
                row = {"rss": [m.rss for m in mem], "pss": [m.pss for m in mem], "uss": [m.uss for m in mem]}
                out[dtype]["workers"][n] = row
                log(f"  {n} worker(s): sum RSS {sum(row['rss']) / 1e9:.2f} GB, sum PSS {sum(row['pss']) / 1e9:.2f} GB, "
                    f"USS per worker {max(row['uss']) / 1e9:.2f} GB")
            finally:
                srv.stop()
                srv.wipe()
    return out


def _archive(build_mar, cfg_path: Path, weights: Path, store: Path) -> None:
    """build_mar.py's archive around already-written weights (rebuilding GBs per run is slow)."""
    store.mkdir(parents=True, exist_ok=True)
    # The archiver stages files in $TMPDIR/<model name>: a private TMPDIR keeps concurrent
    # builds of a "dlrm" on one machine from clobbering each other.
    staging = store.parent / "archiver-tmp"
    staging.mkdir(exist_ok=True)
    subprocess.run([str(Path(sys.executable).parent / "torch-model-archiver"), "--model-name", "dlrm",
                    "--version", "1.0", "--handler", str(ROOT / "dlrm_handler.py"), "--serialized-file", str(weights),
                    "--extra-files", ",".join(build_mar.extra_files(staging)),
                    "--config-file", str(cfg_path), "--export-path", str(store), "--archive-format", "zip-store",
                    "--force"], check=True, env={**os.environ, "TMPDIR": str(staging)})


# --- report -------------------------------------------------------------------------------------

def markdown(res: dict) -> str:
    lines = []
    if "speed" in res:
        s = res["speed"]
        lines += [f"### Speed: Criteo layout (tables capped at 100k rows), {s['device']}, {s['threads']} threads", "",
                  "| dtype | B=1 rows/s | B=1 p99 ms | B=32 rows/s | B=32 p99 ms | B=256 rows/s | B=256 p99 ms | max \\|Δp\\| vs fp32 | mean \\|Δp\\| |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for d, r in s["dtypes"].items():
            b = r["batch"]
            lines.append(f"| {d} | " + " | ".join(f"{b[k]['rows_per_s']:,.0f} | {b[k]['p99_ms']:.2f}" for k in b)
                         + f" | {r['max_abs_diff_vs_fp32']:.1e} | {r['mean_abs_diff_vs_fp32']:.1e} |")
        lines.append("")
    if "load" in res:
        lines += ["### Load cost vs table size (fresh process; RSS growth over the process before loading)", "",
                  "| rows | dtype | tables GB | load s | RSS after load MB | RSS after 200×256 rows MB | peak RSS growth MB |",
                  "|---|---|---|---|---|---|---|"]
        for cap, row in res["load"].items():
            for d, r in row["dtypes"].items():
                lines.append(f"| {row['rows']:,} | {d} | {r['table_bytes'] / 1e9:.2f} | {r['load_s']:.2f} | "
                             f"{(r['rss_loaded'] - r['rss_before']) / 1e6:.0f} | {(r['rss_served'] - r['rss_before']) / 1e6:.0f} | "
                             f"{(r['peak'] - r['rss_before']) / 1e6:.0f} |")
        lines.append("")
    if "workers" in res:
        lines += ["### CPU workers of one model (after every worker read every row)", "",
                  "| dtype | tables GB | workers | sum RSS GB | sum PSS GB | USS per worker GB (max) | sum PSS / 1 worker |",
                  "|---|---|---|---|---|---|---|"]
        for d, r in res["workers"].items():
            one = sum(r["workers"][min(r["workers"])]["pss"])
            for n, w in r["workers"].items():
                lines.append(f"| {d} | {r['table_bytes'] / 1e9:.2f} | {n} | {sum(w['rss']) / 1e9:.2f} | "
                             f"{sum(w['pss']) / 1e9:.2f} | {max(w['uss']) / 1e9:.2f} | {sum(w['pss']) / one:.2f}× |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="+", default=["speed", "load", "workers"], choices=["speed", "load", "workers"])
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N] for speed and load (default: %(default)s)")
    ap.add_argument("--caps", type=int, nargs=3, default=[100_000, 500_000, 1_500_000],
                    help="row caps of the three load sizes; the last is the worker model (default: %(default)s)")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4], help="worker counts (default: %(default)s)")
    ap.add_argument("--reps", type=int, default=300, help="timed batches per dtype and size (default: %(default)s)")
    ap.add_argument("--out", default=str(ROOT / "results"), help="results folder (default: %(default)s)")
    args = ap.parse_args(argv)

    out_dir = Path(args.out)
    tmp = out_dir / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    name = "scale" if args.device == "cpu" else f"scale-{args.device.replace(':', '')}"
    # A run of some parts replaces those parts in the results file and keeps the others.
    previous = out_dir / f"{name}.json"
    res: dict = json.loads(previous.read_text()) if previous.exists() else {}
    res["machine"] = {"cpus": os.cpu_count(), "python": sys.version.split()[0]}
    try:
        if "speed" in args.parts:
            res["speed"] = bench_speed(tmp, args.device, args.reps)
        if "load" in args.parts:
            res["load"] = bench_load(tmp, args.device, args.caps)
        if "workers" in args.parts:
            res["workers"] = bench_workers(tmp, args.caps[-1], args.workers)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # GBs of archives
    (out_dir / f"{name}.json").write_text(json.dumps(res, indent=1))
    (out_dir / f"{name}.md").write_text(markdown(res))
    print(markdown(res))
    return res


if __name__ == "__main__":
    main()
