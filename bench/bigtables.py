#!/usr/bin/env python
"""The full MLPerf DLRMv2 (204,184,588 rows) on this machine: build, accuracy, serving under LoadGen.

    python bench/bigtables.py build      --big-dir /work/big   # int8 (27.4 GiB) + int4 (15.2 GiB)
    python bench/bigtables.py accuracy   --big-dir /work/big   # |dp| vs fp32, table by table
    python bench/bigtables.py serve      --big-dir /work/big   # TorchServe + LoadGen Server scenario
    python bench/bigtables.py squeeze    --big-dir /work/big   # the same in docker run --memory 8g

``build`` says the disk it needs for both archives first and refuses to start without it (plus
2 GiB kept free); each is a scripts/build_big.py model directory under BIG_DIR/store, written
table by table (peak RSS, time and progress printed; results/bigtables-build-<dtype>.json).

``accuracy``: the quantization error of the full-size tables per dtype, computed table by table:
every table's rows are drawn chunk by chunk (the seeded random rows of the build), only the rows
a probe batch reads are kept, in fp32 and quantized by the build's own quantizer (row-wise: the
same bytes as in the archive); the probe is scored through the real fused kernel with all tables
quantized, and with one table at a time quantized (which table the error comes from).

``serve``: each model directory served by a real TorchServe from where it lies (no copy), then
MLPerf LoadGen (``mlperf_loadgen``) in the Server scenario (p99 <= 60 ms): queries of MLPerf's
user-item pair counts (100-700, mean ~270, scaled by --pairs-scale), MLPerf's multi-hot bag sizes,
ids either uniform over each table (the worst case for a page cache) or a power law (Zipf,
exponent --zipf over each table's rows, the hot ranks scattered over the table by a fixed
bijective hash, as hashed categorical ids are). Measured per run: LoadGen's result and latencies,
pairs/s, the workers' major page faults per query, the disk's read MB/s (/proc/diskstats), the
workers' RSS (anonymous and file-backed) and the page cache's share of the table file
(fincore). The first run after a cold start (the file's pages dropped before the server starts)
is the cold minute; later runs at the same rate are warm.

``squeeze``: the int8 model in the kit's image under ``docker run --memory 8g`` (cgroup v1 here:
the page cache is charged to the container), the same LoadGen run: scores equal to the host's,
and the container's OOM-kill count.

Writes results/bigtables.json and results/bigtables.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
from bench import mlperf  # noqa: E402

RESULTS = ROOT / "results"
DTYPES = ("int8", "int4")


def log(msg: str) -> None:
    print(f"[bigtables {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def full_config(dtype: str):
    from dlrmkit.config import DLRMConfig
    from scripts.sizing import full_rows

    path = ROOT / "model-config.dlrmv2.yaml"
    c = DLRMConfig.from_yaml(path)
    return dataclasses.replace(c, num_embeddings=full_rows(path, c), embedding_dtype=dtype)


def cpu_isa() -> str:
    flags = set()
    name = "?"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            name = line.split(":", 1)[1].strip()
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx512_fp16", "amx_int8", "amx_bf16")
           if f in flags]
    return f"{name} ({os.cpu_count()} CPUs; {', '.join(isa)})"


def previous(section: str) -> dict:
    path = RESULTS / "bigtables.json"
    return json.loads(path.read_text()).get(section, {}) if path.exists() else {}


def save(section: str, data) -> dict:
    path = RESULTS / "bigtables.json"
    doc = json.loads(path.read_text()) if path.exists() else {}
    doc[section] = data
    doc["cpu"] = cpu_isa()
    path.write_text(json.dumps(doc, indent=1))
    return doc


# --- build ---------------------------------------------------------------------------------------

def cmd_build(args) -> None:
    from dlrmkit import stream
    store = Path(args.big_dir) / "store"
    store.mkdir(parents=True, exist_ok=True)
    todo = [d for d in args.dtypes if args.force or not (store / f"dlrmv2-{d}" / "dlrm.pt").exists()]
    need = sum(stream.file_bytes(full_config(d)) for d in todo)
    log(f"build {', '.join(todo) or 'nothing (both built; --force rebuilds)'}: needs {need / 2**30:.1f} GiB "
        f"of disk at {store}")
    try:
        free = stream.check_disk(store / "x", need)
    except Exception as e:
        sys.exit(f"error: {e}")
    log(f"{free / 2**30:.1f} GiB free")
    builds = {}
    for d in todo:
        out = RESULTS / f"bigtables-build-{d}.json"
        cmd = [sys.executable, str(ROOT / "scripts" / "build_big.py"), "--config", str(ROOT / "model-config.dlrmv2.yaml"),
               "--full", "--dtype", d, "--out", str(store / f"dlrmv2-{d}"), "--force", "--json", str(out)]
        subprocess.run(cmd, check=True)
        builds[d] = json.loads(out.read_text())
    save("build", {**previous("build"), **builds})


# --- accuracy ------------------------------------------------------------------------------------

def cmd_accuracy(args) -> None:
    import numpy as np
    import torch

    from dlrmkit import stream
    from dlrmkit.model import DLRMFactory
    from dlrmkit.scale import DTYPES, copy_tables, fused_rows, quant_ebc
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    base = full_config("fp32") if not args.capped else dataclasses.replace(
        __import__("dlrmkit.config").DLRMConfig.from_yaml(ROOT / "model-config.dlrmv2.yaml"), embedding_dtype="fp32")
    bags = mlperf.mlperf_bags(base)
    rng = np.random.default_rng(args.seed)
    B = args.rows
    lengths = np.repeat(np.array(bags), B)  # key-major
    ids = {}
    for f, (name, n) in enumerate(zip(base.sparse_features, base.num_embeddings)):
        ids[name] = sample_ids(rng, n, B * bags[f], args.zipf)
    wanted = {name: np.unique(v) for name, v in ids.items()}
    source = stream.RandomSource(base)
    dense_state = None
    kept = {name: torch.empty(len(w), base.embedding_dim) for name, w in wanted.items()}
    started, chunk = time.perf_counter(), stream.CHUNK_BYTES // (base.embedding_dim * 4)
    total = sum(base.num_embeddings)
    done = 0
    for t, start, rows in stream.iter_tables(base, source, chunk):
        name = base.sparse_features[t]
        w = torch.from_numpy(wanted[name])
        hit = (w >= start) & (w < start + rows.shape[0])
        if hit.any():
            kept[name][hit] = rows[w[hit] - start]
        done += rows.shape[0]
        if done % (chunk * 40) < rows.shape[0]:
            log(f"accuracy: {done:,}/{total:,} rows drawn ({time.perf_counter() - started:.0f} s)")
    dense_state = source.dense()
    # the probe over the kept rows only (ids renumbered), scored through the serving kernel
    small = dataclasses.replace(base, num_embeddings=tuple(len(w) for w in wanted.values()))
    values = torch.cat([torch.from_numpy(np.searchsorted(wanted[n], ids[n])) for n in base.sparse_features])
    kjt = KeyedJaggedTensor(keys=list(base.sparse_features), values=values, lengths=torch.from_numpy(lengths))
    dense = torch.randn(B, base.num_dense_features, generator=torch.Generator().manual_seed(args.seed))

    def score(per_table_dtype: dict[str, str]) -> torch.Tensor:
        """The probe's probabilities with each table in its dtype, through the serving kernel."""
        factory = DLRMFactory(small)
        model = factory.build("cpu", tables_on_meta=True)
        model.load_state_dict(dense_state, strict=False, assign=True)
        tables = [dataclasses.replace(t, data_type=DTYPES[per_table_dtype.get(t.name, "fp32")][0])
                  for t in factory.tables("fp32")]
        qebc = quant_ebc(tables, torch.device("cpu"))
        copy_tables(qebc, {f"{stream.TABLES}{n}.weight": fused_rows({n: kept[n]}, per_table_dtype.get(n, "fp32"))[n]
                           for n in base.sparse_features})
        model.sparse_arch.embedding_bag_collection = qebc
        with torch.no_grad():
            return torch.sigmoid(model.eval()(dense, kjt)).squeeze(1)

    fp32 = score({})
    out = {"rows": B, "zipf": args.zipf, "ids_per_row": sum(bags), "seconds_drawing": round(time.perf_counter() - started),
           "dtypes": {}}
    for d in args.dtypes:
        allq = score({n: d for n in base.sparse_features})
        dp = (allq - fp32).abs()
        per_table = {}
        for n in base.sparse_features:
            per_table[n] = float((score({n: d}) - fp32).abs().max())
        worst = sorted(per_table.items(), key=lambda kv: -kv[1])[:5]
        out["dtypes"][d] = {"max_abs_dp": float(dp.max()), "mean_abs_dp": float(dp.mean()),
                            "p99_abs_dp": float(dp.quantile(0.99)), "per_table_max_abs_dp": per_table,
                            "worst_tables": worst}
        log(f"accuracy {d}: max |dp| {float(dp.max()):.3g}, mean {float(dp.mean()):.3g}; worst tables {worst[:3]}")
    save("accuracy", out)


# --- ids and queries ----------------------------------------------------------------------------

def _multiplier(n: int) -> int:
    a = 2654435761 % n or 1
    while math.gcd(a, n) != 1:
        a += 1
    return a


def sample_ids(rng, n: int, k: int, zipf: float | None):
    """``k`` ids of a table of ``n`` rows: uniform (zipf None) or rank ~ i^-zipf (continuous
    inverse CDF on [1, n+1)), the rank scattered by id = (rank - 1) * a mod n (a coprime to n)."""
    import numpy as np

    if not zipf:
        return rng.integers(0, n, k)
    u = rng.random(k)
    s = zipf
    if abs(s - 1) < 1e-9:
        x = np.exp(u * np.log(n + 1.0))
    else:
        x = ((n + 1.0) ** (1 - s) * u + (1 - u)) ** (1 / (1 - s))
    rank = np.minimum(np.floor(x).astype(np.int64), n) - 1
    return (rank * _multiplier(n)) % n


class Queries:
    """MLPerf-shaped `columns` requests drawn fresh per query (no body repeats): a query pool
    for mlperf.run whose every index is a new query."""

    def __init__(self, cfg, zipf: float | None, pairs_scale: float, seed: int):
        self.cfg, self.zipf, self.scale = cfg, zipf, pairs_scale
        self.bags = mlperf.mlperf_bags(cfg)
        self.local = threading.local()
        self.seed = seed
        self.counter = 0
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return 1024

    def __getitem__(self, _index: int) -> tuple[int, bytes]:
        return self.make()

    def make(self) -> tuple[int, bytes]:
        import numpy as np

        if not hasattr(self.local, "rng"):
            with self.lock:
                self.counter += 1
                n = self.counter
            self.local.rng = np.random.default_rng(self.seed * 1000 + n)
            self.local.prng = random.Random(self.seed * 1000 + n)
        rng, prng = self.local.rng, self.local.prng
        rows = mlperf.query_pairs(prng, self.scale)
        dense = np.round(rng.uniform(0, 5, (rows, self.cfg.num_dense_features)), 3).tolist()
        sparse = {}
        for f, (name, n) in enumerate(zip(self.cfg.sparse_features, self.cfg.num_embeddings)):
            k = self.bags[f]
            sparse[name] = {"values": sample_ids(rng, n, rows * k, self.zipf).tolist(), "lengths": [k] * rows}
        return rows, json.dumps({"columns": {"dense": dense, "sparse": sparse}}).encode()


# --- counters ------------------------------------------------------------------------------------

def disk_sectors(path: Path) -> int:
    """Sectors read so far from the block device holding ``path``."""
    dev = os.stat(path).st_dev
    major, minor = os.major(dev), os.minor(dev)
    for line in Path("/proc/diskstats").read_text().splitlines():
        p = line.split()
        if int(p[0]) == major and int(p[1]) == minor:
            return int(p[5])
    # a partition-less virtual disk: the whole-disk line of that major
    for line in Path("/proc/diskstats").read_text().splitlines():
        p = line.split()
        if int(p[0]) == major and int(p[1]) == 0:
            return int(p[5])
    return 0


def proc_counters(pids) -> dict:
    out = {"majflt": 0, "rss_anon": 0, "rss_file": 0}
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            out["majflt"] += int(stat[9])
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("RssAnon:"):
                    out["rss_anon"] += int(line.split()[1]) * 1024
                elif line.startswith("RssFile:"):
                    out["rss_file"] += int(line.split()[1]) * 1024
        except FileNotFoundError:
            pass
    return out


def resident_share(path: Path) -> float:
    """The share of ``path``'s pages in the page cache (util-linux fincore)."""
    done = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES,SIZE", str(path)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        return float("nan")
    res, size = (int(x) for x in done.stdout.split()[:2])
    return res / size if size else 0.0


def fits_in_cache(path: Path) -> bool:
    """Whether the file fits in what the machine has available (MemAvailable) with a margin."""
    avail = next(int(ln.split()[1]) * 1024 for ln in Path("/proc/meminfo").read_text().splitlines()
                 if ln.startswith("MemAvailable:"))
    return path.stat().st_size < 0.9 * avail


def prewarm(path: Path) -> float:
    """Read the file once, sequentially, into the page cache (what a resident model's warm
    start is); returns the seconds it took."""
    t0 = time.perf_counter()
    buf = bytearray(16 << 20)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    return round(time.perf_counter() - t0, 1)


def drop_file_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


# --- LoadGen Server scenario ---------------------------------------------------------------------

def loadgen_server(url: str, queries: Queries, qps: float, seconds: float, min_queries: int, pids_fn,
                   weights: Path) -> dict:
    """One LoadGen Server run at ``qps`` (mlperf.run: each sample one HTTP request of a fresh
    query), with the workers' page faults, the disk's reads and the page cache around it."""
    before, sectors0 = proc_counters(pids_fn()), disk_sectors(weights)
    res = mlperf.run(url, queries, qps, seconds, min_queries, max_seconds=seconds * 4)
    after, sectors1 = proc_counters(pids_fn()), disk_sectors(weights)
    q, took = max(1, res["queries"]), res["seconds"]
    res.update(majflt_per_query=round((after["majflt"] - before["majflt"]) / q, 1),
               disk_read_mb_s=round((sectors1 - sectors0) * 512 / 1e6 / took, 1),
               rss_anon_mib=round(after["rss_anon"] / 2**20), rss_file_mib=round(after["rss_file"] / 2**20),
               page_cache_share=round(resident_share(weights), 3))
    return res


# --- serve ---------------------------------------------------------------------------------------

def start_server(store: Path, model: str, home: Path, workers: int):
    from scripts.tsctl import Server

    srv = Server.on_free_ports(home, model_store=store, overrides={
        "load_models": f"{model}={model}", "default_workers_per_model": str(workers)})
    t0 = time.perf_counter()
    srv.start()
    probe = (ROOT / "sample_requests" / "dlrmv2.json").read_bytes()
    srv.wait_ready(model, probe, timeout=600)
    return srv, time.perf_counter() - t0


def cmd_serve(args) -> None:
    store = Path(args.big_dir) / "store"
    results = previous("serve")
    for d in args.dtypes:
        model = f"dlrmv2-{d}"
        weights = store / model / "dlrm.pt"
        cfg = full_config(d)
        drop_file_cache(weights)
        log(f"{model}: page cache share before start {resident_share(weights):.3f}")
        home = Path(tempfile.mkdtemp(prefix="bigtables-"))
        srv, startup = start_server(store, model, home, args.workers)
        try:
            pids = lambda: srv.worker_pids(model)  # noqa: E731
            c = proc_counters(pids())
            row = {"startup_s": round(startup, 1), "workers": len(pids()),
                   "rss_anon_mib_per_worker": round(c["rss_anon"] / 2**20 / max(1, len(pids()))),
                   "rss_file_mib_per_worker": round(c["rss_file"] / 2**20 / max(1, len(pids()))),
                   "page_cache_share_at_start": round(resident_share(weights), 4),
                   "file_gib": round(weights.stat().st_size / 2**30, 2), "runs": []}
            log(f"{model}: ready in {startup:.1f} s; {row}")
            for dist in args.dists:
                zipf = args.zipf if dist == "zipf" else None
                queries = Queries(cfg, zipf, args.pairs_scale, seed=7)
                for phase, qps in [("cold", args.qps[0])] + [("warm", q) for q in args.qps]:
                    if phase == "warm" and "prewarm_s" not in row and fits_in_cache(weights):
                        row["prewarm_s"] = prewarm(weights)
                        row["page_cache_share_after_prewarm"] = round(resident_share(weights), 3)
                        log(f"{model}: read into the page cache in {row['prewarm_s']} s "
                            f"(share {row['page_cache_share_after_prewarm']})")
                    r = loadgen_server(f"{srv.url}/predictions/{model}", queries, qps, args.seconds, args.min_queries,
                                       pids, weights)
                    r.update(dist=dist, phase=phase)
                    row["runs"].append(r)
                    log(f"{model} {dist} {phase} {qps} q/s: valid {r.get('valid')}, p99 {r.get('p99_ms')} ms, "
                        f"{r['pairs_per_s']} pairs/s, {r['majflt_per_query']} major faults/query, "
                        f"{r['disk_read_mb_s']} MB/s read, cache share {r['page_cache_share']}, errors {r['errors']}")
            results[d] = row
            save("serve", {**results, "settings": {"zipf": args.zipf, "pairs_scale": args.pairs_scale,
                                                    "seconds": args.seconds, "min_queries": args.min_queries}})
        finally:
            srv.stop()
            shutil.rmtree(home, ignore_errors=True)


def cmd_squeeze(args) -> None:
    """The int8 model in the kit's image with a memory limit well below its tables."""
    store = Path(args.big_dir) / "store"
    model = "dlrmv2-int8"
    weights = store / model / "dlrm.pt"
    cfg = full_config("int8")
    conf = Path(tempfile.mkdtemp(prefix="bigtables-docker-"))
    port = 18080 + random.randrange(1000)
    (conf / "config.properties").write_text(
        "inference_address=http://0.0.0.0:8080\nmanagement_address=http://0.0.0.0:8081\n"
        "metrics_address=http://0.0.0.0:8082\ndisable_token_authorization=true\ndecode_input_request=false\n"
        f"default_workers_per_model={args.workers}\nload_models={model}={model}\n")
    conf.chmod(0o755)  # the image runs as uid 1000
    (conf / "config.properties").chmod(0o644)
    name = f"bigtables-squeeze-{os.getpid()}"
    drop_file_cache(weights)
    cmd = ["docker", "run", "-d", "--name", name, "--memory", args.memory, "--memory-swap", args.memory,
           "--cpus", "2", "-p", f"127.0.0.1:{port}:8080", "-v", f"{store}:/mnt/store:ro", "-v", f"{conf}:/mnt/conf:ro",
           args.image, "torchserve", "--start", "--foreground", "--model-store=/mnt/store",
           "--ts-config=/mnt/conf/config.properties", "--disable-token-auth"]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    url = f"http://127.0.0.1:{port}/predictions/{model}"
    probe = (ROOT / "sample_requests" / "dlrmv2.json").read_bytes()
    try:
        host_scores = host_probe_scores(store / model, probe)
        got = None
        while time.perf_counter() - t0 < 600:
            if subprocess.run(["docker", "inspect", "-f", "{{.State.Running}}", name], capture_output=True,
                              text=True).stdout.strip() != "true":
                break
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
                c.request("POST", f"/predictions/{model}", probe, {"Content-Type": "application/json"})
                r = c.getresponse()
                body = r.read()
                if r.status == 200:
                    got = json.loads(body)["scores"]
                    break
            except (ConnectionError, http.client.HTTPException, OSError):
                pass
            time.sleep(2)
        startup = time.perf_counter() - t0
        if got is None:
            raise RuntimeError("the container's model never answered: " + subprocess.run(
                ["docker", "logs", "--tail", "30", name], capture_output=True, text=True).stdout)
        row = {"memory_limit": args.memory, "startup_s": round(startup, 1),
               "probe_max_abs_diff_vs_host": max(abs(a - b) for a, b in zip(got, host_scores)), "runs": []}
        log(f"squeeze: answered after {startup:.0f} s, |score - host| {row['probe_max_abs_diff_vs_host']:.2g}")
        cid = subprocess.run(["docker", "inspect", "-f", "{{.Id}}", name], capture_output=True, text=True,
                             check=True).stdout.strip()
        cg = Path(f"/sys/fs/cgroup/memory/docker/{cid}")

        def worker_pids():
            return [int(p) for p in (cg / "cgroup.procs").read_text().split()
                    if "model_service_worker" in Path(f"/proc/{p}/cmdline").read_text(errors="replace")] \
                if cg.exists() else []

        for dist in args.dists:
            zipf = args.zipf if dist == "zipf" else None
            queries = Queries(cfg, zipf, args.pairs_scale, seed=11)
            for phase, qps in [("cold", args.qps[0]), ("warm", args.qps[0])]:
                r = loadgen_server(url, queries, qps, args.seconds, args.min_queries, worker_pids, weights)
                r.update(dist=dist, phase=phase)
                if cg.exists():
                    r["cgroup_usage_mib"] = round(int((cg / "memory.usage_in_bytes").read_text()) / 2**20)
                    r["cgroup_failcnt"] = int((cg / "memory.failcnt").read_text())
                row["runs"].append(r)
                log(f"squeeze {dist} {phase} {qps} q/s: valid {r.get('valid')}, p99 {r.get('p99_ms')} ms, "
                    f"{r['pairs_per_s']} pairs/s, {r['majflt_per_query']} majflt/query, {r['disk_read_mb_s']} MB/s, "
                    f"errors {r['errors']}, cgroup {r.get('cgroup_usage_mib')} MiB")
        state = json.loads(subprocess.run(["docker", "inspect", name], capture_output=True, text=True,
                                          check=True).stdout)[0]["State"]
        row["oom_killed"] = state.get("OOMKilled")
        row["running"] = state.get("Running")
        if cg.exists():
            oom = (cg / "memory.oom_control").read_text()
            row["oom_kills"] = int(next((ln.split()[1] for ln in oom.splitlines() if ln.startswith("oom_kill ")), "0"))
        save(f"squeeze-{args.memory}", row)
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True)
        shutil.rmtree(conf, ignore_errors=True)


def host_probe_scores(model_dir: Path, probe: bytes) -> list[float]:
    from dlrmkit.config import DLRMConfig
    from dlrmkit.batch import RequestParser, collate, scores
    from dlrmkit.model import DLRMFactory

    config = DLRMConfig.from_yaml(model_dir / "model-config.yaml")
    model = DLRMFactory(config).load(model_dir / "dlrm.pt")
    return scores(model, collate([RequestParser(config).parse(probe)], config)[0], config)[0]


def cmd_report(args) -> None:
    """results/bigtables.md from results/bigtables.json."""
    doc = json.loads((RESULTS / "bigtables.json").read_text())
    lines = ["# Full-size MLPerf DLRMv2 (204,184,588 rows) on one machine", "", f"CPU: {doc.get('cpu')}", ""]
    if doc.get("build"):
        lines += ["## Build (scripts/build_big.py, seeded random weights, table by table)", "",
                  "| dtype | file GiB | seconds | peak RSS MiB | chunk rows |", "|---|---:|---:|---:|---:|"]
        for d, b in doc["build"].items():
            lines.append(f"| {d} | {b['file_bytes'] / 2**30:.2f} | {b['seconds']} | {b['peak_rss_bytes'] / 2**20:.0f} | "
                         f"{b['chunk_rows']:,} |")
        lines.append("")
    if doc.get("accuracy"):
        a = doc["accuracy"]
        lines += [f"## Quantization error vs fp32 ({a['rows']} probe rows, MLPerf bag sizes ({a['ids_per_row']} ids "
                  f"per row), ids Zipf s={a['zipf']}; every table quantized / the worst single tables)", "",
                  "| dtype | max \\|Δp\\| | p99 \\|Δp\\| | mean \\|Δp\\| | worst tables alone (max \\|Δp\\|) |",
                  "|---|---:|---:|---:|---|"]
        for d, r in a["dtypes"].items():
            worst = ", ".join(f"{n} {v:.2g}" for n, v in r["worst_tables"][:3])
            lines.append(f"| {d} | {r['max_abs_dp']:.3g} | {r['p99_abs_dp']:.3g} | {r['mean_abs_dp']:.3g} | {worst} |")
        lines.append("")
    serve = doc.get("serve", {})
    st = serve.get("settings", {})
    for key, title in (("serve", "TorchServe on the host"), ("squeeze", "docker run --memory")):
        rows = {k: v for k, v in (serve if key == "serve" else {f"int8, {k[8:]}": v for k, v in doc.items()
                                                                   if k.startswith("squeeze-")}).items()
                if k != "settings" and v}
        if not rows:
            continue
        lines += [f"## {title}: LoadGen Server scenario (p99 <= 60 ms), queries of MLPerf's 100-700 pairs x "
                  f"{st.get('pairs_scale')}, runs of >= {st.get('seconds')} s", ""]
        for d, r in rows.items():
            extra = {k: v for k, v in r.items() if k != "runs"}
            lines.append(f"- {d}: " + ", ".join(f"{k} {v}" for k, v in extra.items()))
        lines += ["", "| dtype | ids | phase | target q/s | LoadGen | p50 / p99 ms | pairs/s | major faults/query | "
                  "disk read MB/s | page cache share of the file | workers RSS anon / file MiB | errors |",
                  "|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
        for d, r in rows.items():
            for x in r["runs"]:
                lines.append(f"| {d} | {x['dist']} | {x['phase']} | {x['target_qps']} | "
                             f"{'VALID' if x.get('valid') else 'INVALID'} | {x.get('p50_ms')} / {x.get('p99_ms')} | "
                             f"{x['pairs_per_s']} | {x['majflt_per_query']} | {x['disk_read_mb_s']} | "
                             f"{x['page_cache_share']} | {x['rss_anon_mib']} / {x['rss_file_mib']} | {x['errors']} |")
        lines.append("")
    (RESULTS / "bigtables.md").write_text("\n".join(lines) + "\n")
    print((RESULTS / "bigtables.md").read_text())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["build", "accuracy", "serve", "squeeze", "report"])
    ap.add_argument("--big-dir", default="/work/big", help="where the model directories go, outside any checkout "
                    "(default: %(default)s)")
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=["fp16", "int8", "int4"])
    ap.add_argument("--force", action="store_true", help="build: rebuild what exists")
    ap.add_argument("--zipf", type=float, default=1.05, help="power-law exponent of the skewed ids (default: %(default)s)")
    ap.add_argument("--dists", nargs="+", default=["zipf", "uniform"], choices=["zipf", "uniform"])
    ap.add_argument("--qps", nargs="+", type=float, default=[4.0], help="LoadGen server_target_qps values (warm)")
    ap.add_argument("--seconds", type=float, default=60.0, help="LoadGen min_duration per run (default: %(default)s)")
    ap.add_argument("--min-queries", type=int, default=100, help="LoadGen min_query_count (default: %(default)s)")
    ap.add_argument("--pairs-scale", type=float, default=1.0, help="scale MLPerf's 100-700 pairs per query")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rows", type=int, default=2048, help="accuracy: probe rows (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--capped", action="store_true", help="accuracy: the config's capped tables (a quick check)")
    ap.add_argument("--memory", default="8g", help="squeeze: docker --memory (default: %(default)s)")
    ap.add_argument("--image", default="ghcr.io/example/dlrm-torchserve:0.1.0-cpu")
    args = ap.parse_args(argv)
    RESULTS.mkdir(exist_ok=True)
    {"build": cmd_build, "accuracy": cmd_accuracy, "serve": cmd_serve, "squeeze": cmd_squeeze,
     "report": cmd_report}[args.command](args)


if __name__ == "__main__":
    main()
