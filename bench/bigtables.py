#!/usr/bin/env python
"""Issue 44, tables larger than memory with their hot rows packed: a packed model directory served
by TorchServe under MLPerf LoadGen's Server scenario, beside the same weights read unpacked and
beside the capped DLRMv2.

    python bench/bigtables.py serve --compare-capped             # /work/big/store/dlrmv2-int8, Zipf 1.05
    python bench/bigtables.py serve --dists 0.9 1.05 1.2 uniform --compare-capped
    python bench/bigtables.py squeeze                            # the same in docker run --memory 8g
    python bench/bigtables.py report --from-json results/DATE-bigtables/bigtables.json
    python bench/bigtables.py profile --capped-dir /work/big/store/dlrmv2-capped   # where a query's time goes
    python bench/bigtables.py turns --capped-dir /work/big/store/dlrmv2-capped --form v2-binary --turns 4

The packed model: scripts/build_big.py with --hot-counts (a counts file of bench/ids.py, seed 7; for a
hot set of many GiB, ``--law``: the counts such a sample converges to):

    python bench/ids.py --config model-config.dlrmv2.yaml --full --zipf 1.05 --out /work/big/counts-zipf1.05.pt
    python scripts/build_big.py --config model-config.dlrmv2.yaml --full --dtype int8 \\
        --hot-counts /work/big/counts-zipf1.05.pt --out /work/big/store/dlrmv2-int8

``serve``: per id distribution (--dists: Zipf exponents and/or ``uniform``), the variants one after
the other, each on a TorchServe of its own started after the page cache was dropped (sync, then 3
into /proc/sys/vm/drop_caches; where that is refused, posix_fadvise DONTNEED on the weights file,
and the report says so):

- packed: the directory as built (the worker reads its hot rows into the page cache at load, and
  locks them where it may: the log line "hot rows: ...");
- unpacked: DIR-unpacked beside it, symbolic links to the same files but a model-config.yaml with
  ``handler.hot_rows: false``: every id is read where it lies, the unpacked layout's lookups from
  the same weights file;
- capped (--compare-capped): model-config.dlrmv2.yaml as shipped (tables capped at 200,000 rows),
  built by scripts/build_big.py without --full into a temporary store (--capped-dir: one built
  before): the same kind of model directory, the issue's yardstick (packed warm p99 <= 1.25x its).

Each: TorchServe's time until every worker (the CPU rule's count) is ready, the workers' "hot rows"
line, then LoadGen Server at --qps with MLPerf's queries (100-700 pairs, MLPerf's bag sizes, ids of
bench/ids.py drawn afresh for every query, seeded --seed; --form, `columns` by default): the first --cold-s
seconds right after ready (cold), then --warm-s seconds (warm), each a LoadGen run of at least
that long and qps x seconds queries. Per phase: LoadGen's verdict, p50 / p99 / max, the workers'
major page faults per query, the disk's reads (MB/s), the page cache's share of the weights file
(fincore), the workers' RSS (anonymous / file). Ratios: packed / unpacked (p99, faults per query),
packed / capped (p99).

``turns``: the packed model (started cold, its background fill waited for) and the capped model
(--capped-dir) served at once, each by its own TorchServe; each variant's first --cold-s seconds, then
--turns turns of a --warm-s LoadGen run against each, the order rotated by one each turn: the
packed / capped p99 per turn (LoadGen's) and over every query of the turns (at the client), the
issue's bound on both, within one stretch of a host whose speed drifts.

``--form``: the queries' body for serve and turns, `columns` JSON (default) or the Open Inference
Protocol's binary tensors (v2-binary, what tritonclient sends, to /v2/models/NAME/infer).

``squeeze``: the packed model, the first distribution, in the kit's image (``make image``) under
``docker run --memory 8g``, with the default ulimits and with ``--ulimit memlock=-1`` (--lock-args; the
hot rows can be locked): the same phases, the worker's "hot rows" line and the container's OOM kills.
A host that cannot raise the limit (runc: "setting rlimit ... operation not permitted": a docker
inside a container) records that variant as not started; ``--lock-args "--user 0:0 --cap-add
IPC_LOCK"`` locks without the limit there.

``profile``: in this process, through the served Worker (no HTTP, no queue), --queries queries a turn
one after another, the packed model (after its fill) with and without the per-forward prefetch and
the capped model (--capped-dir), in --turns turns with fresh ids: per query the parse and collate,
the redirect, the prefetch, the forward (lookups and dense half), major faults and disk reads.

Writes results/<date>-bigtables/ (squeeze: <date>-bigtables-squeeze/, turns: -bigtables-turns/, profile:
-bigtables-profile/; --out DIR elsewhere): run.json, the command's .json and .md, and loadgen/
(LoadGen's summary of every run).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import math
import os
import random
import re
import shutil
import resource
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch
import yaml

from bench import ids, mlperf
from bench.common import ROOT, log, machine, md_table, percentile, run_dir, write_report
from dlrmkit.config import DLRMConfig
from dlrmkit.cpus import cpu_rule
from dlrmkit.protocols import open_request
from dlrmkit.worker import Worker, read_model_dir
from scripts.tsctl import Server, free_port, get, post

TITLE = "Issue 44: tables larger than memory, hot rows packed, under LoadGen (packed / unpacked / capped)"
TARGET = 1.25  # the bound: packed warm p99 within this of the capped model's
HOT_LINE = re.compile(
    r"hot rows: (?P<rows>\d+) rows(?: \((?P<mib>[\d.]+) MiB\) of (?P<tables>\d+) tables, read in "
    r"(?P<seconds>[\d.]+) s, (?:(?P<huge>[\d.]+) MiB on 2 MiB pages, )?(?:locked in memory|not locked: "
    r"(?P<why>.*))|, (?P<note>.*))$"
)


def dist_name(text: str) -> str:
    """``uniform`` or a Zipf exponent (``1.05`` -> ``zipf 1.05``)."""
    return "uniform" if text == "uniform" else f"zipf {float(text):g}"


class Queries:
    """MLPerf-shaped queries of ``form`` (mlperf.FORMS: `columns` JSON or the Open Inference
    Protocol's binary tensors), each sent once: every LoadGen index hands out the next one, drawn
    before the run (drawing is not timed); one drawn on the spot past those counts as late."""

    def __init__(self, cfg, dist: str, seed: int, ahead: int, form: str = "columns"):
        self.cfg, self.bags, self.form = cfg, mlperf.mlperf_bags(cfg), form
        self.zipf = None if dist == "uniform" else float(dist.split()[1])
        self.rng, self.prng = np.random.default_rng(seed), random.Random(seed)
        self.lock, self.late = threading.Lock(), 0
        self.ready = collections.deque(self.draw() for _ in range(ahead))

    def __len__(self) -> int:
        return 1024

    def __getitem__(self, _index: int) -> mlperf.Query:
        with self.lock:
            if self.ready:
                return self.ready.popleft()
            self.late += 1
            return self.draw()

    def draw(self) -> mlperf.Query:
        rows, cfg = mlperf.query_pairs(self.prng), self.cfg
        dense = np.round(self.rng.uniform(0, 5, (rows, cfg.num_dense_features)), 3).tolist()
        cols = {}
        for f, (name, n) in enumerate(zip(cfg.sparse_features, cfg.num_embeddings)):
            k = self.bags[f] if self.bags else 1
            cols[name] = (k, ids.sample_ids(self.rng, n, rows * k, self.zipf).tolist())
        body, headers = mlperf.encode(dense, cols, 0, rows, True, self.form)
        return mlperf.Query(rows, body, headers)


# --- the model directories and the machine's counters ---------------------------------------------


# variant -> (its directory's suffix, the handler keys it changes)
VARIANTS = {
    "packed": ("", {}),
    "no-prefetch": ("-noprefetch", {"prefetch": False}),
    "unpacked": ("-unpacked", {"hot_rows": False, "prefetch": False}),
}


def unpacked_sibling(packed: Path, variant: str = "unpacked") -> Path:
    """DIR-<variant> beside ``packed``: relative symbolic links to its files (the same weights, the
    same page cache), its own model-config.yaml with the variant's handler keys (unpacked:
    handler.hot_rows and handler.prefetch false, as before hot rows) and its own manifest."""
    suffix, changes = VARIANTS[variant]
    if not suffix:
        return packed
    out = packed.with_name(packed.name + suffix)
    shutil.rmtree(out, ignore_errors=True)
    (out / "MAR-INF").mkdir(parents=True)
    for p in packed.iterdir():
        if p.name not in ("model-config.yaml", "MAR-INF"):
            (out / p.name).symlink_to(Path("..") / packed.name / p.name)
    doc = yaml.safe_load((packed / "model-config.yaml").read_text())
    doc["handler"].update(changes)
    head = f"# bench/bigtables.py: {packed.name}'s config with {changes}\n"
    (out / "model-config.yaml").write_text(head + yaml.safe_dump(doc, sort_keys=False, width=100))
    manifest = json.loads((packed / "MAR-INF" / "MANIFEST.json").read_text())
    manifest["model"]["modelName"] = out.name
    (out / "MAR-INF" / "MANIFEST.json").write_text(json.dumps(manifest, indent=2))
    return out


def build_capped(store: Path, dtype: str) -> Path:
    """model-config.dlrmv2.yaml's capped tables at ``dtype``: scripts/build_big.py without --full."""
    out = store / "dlrmv2-capped"
    cmd = [sys.executable, str(ROOT / "scripts" / "build_big.py"), "--config", str(ROOT / "model-config.dlrmv2.yaml")]
    subprocess.run([*cmd, "--dtype", dtype, "--out", str(out), "--force"], check=True, stdout=subprocess.DEVNULL)
    return out


def drop_cache(weights: Path) -> str:
    """The page cache emptied before a cold start; returns how."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "sync; echo 3 > /proc/sys/vm/drop_caches"
    except OSError as e:
        fd = os.open(weights, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        return f"posix_fadvise DONTNEED on the weights file only (drop_caches refused: {e.strerror})"


def disk_sectors(path: Path) -> int:
    """Sectors read so far from the block device holding ``path`` (or its whole disk)."""
    dev = os.stat(path).st_dev
    lines = [ln.split() for ln in Path("/proc/diskstats").read_text().splitlines()]
    for minor in (os.minor(dev), 0):
        for p in lines:
            if (int(p[0]), int(p[1])) == (os.major(dev), minor):
                return int(p[5])
    return 0


def proc_counters(pids: list[int]) -> dict:
    """Major faults and RSS (anonymous, file-backed) of ``pids``, summed."""
    out = {"majflt": 0, "rss_anon": 0, "rss_file": 0}
    for pid in pids:
        try:
            out["majflt"] += int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[9])
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                key, _, value = line.partition(":")
                if key in ("RssAnon", "RssFile"):
                    out["rss_" + key[3:].lower()] += int(value.split()[0]) * 1024
        except FileNotFoundError:  # a worker gone: its counts with it
            pass
    return out


def resident_share(path: Path) -> float | None:
    """The share of ``path``'s pages in the page cache (util-linux fincore), None without it."""
    try:
        done = subprocess.run(["fincore", "-b", "-n", "-o", "RES,SIZE", str(path)], capture_output=True, text=True)
        res, size = (int(x) for x in done.stdout.split()[:2])
    except (OSError, ValueError):
        return None
    return round(res / size, 4) if size else 0.0


def hot_rows(text: str) -> dict | None:
    """The first worker's "hot rows:" line in ``text`` (a log), read into its figures."""
    for line in text.splitlines():
        if m := HOT_LINE.search(line):
            g = m.groupdict()
            if g["note"] is not None:
                return {"rows": int(g["rows"]), "note": g["note"], "locked": False}
            out = {"rows": int(g["rows"]), "mib": float(g["mib"]), "tables": int(g["tables"])}
            out |= {"seconds": float(g["seconds"]), "locked": g["why"] is None, "why_not": g["why"]}
            return out | ({"huge_mib": float(g["huge"])} if g["huge"] is not None else {})
    return None


# --- one variant: start, cold, warm ---------------------------------------------------------------


def measured(url: str, args, pids, weights: Path, tag: str, loadgen: Path, pool: Queries, seconds: float) -> dict:
    """One LoadGen run of ``seconds`` at --qps with the counters around it (and every query's ms)."""
    before, sectors, late = proc_counters(pids()), disk_sectors(weights), pool.late
    n = math.ceil(args.qps * seconds)
    r = mlperf.run(url, pool, args.qps, seconds, n, 2 * seconds + 30, loadgen / f"{tag}.txt", latencies=True)
    after, q = proc_counters(pids()), max(1, r["queries"])
    r.update(
        majflt_per_query=round((after["majflt"] - before["majflt"]) / q, 1),
        disk_read_mb_s=round((disk_sectors(weights) - sectors) * 512 / 1e6 / r["seconds"], 2),
        page_cache_share=resident_share(weights),
        rss_anon_mib=round(after["rss_anon"] / 2**20),
        rss_file_mib=round(after["rss_file"] / 2**20),
        drawn_late=pool.late - late,
    )
    log(
        f"{tag}: {'VALID' if r['valid'] else 'INVALID'}, p50/p99/max {r.get('p50_ms')}/{r.get('p99_ms')}/"
        f"{r.get('max_ms')} ms, {r['queries']} queries, {r['majflt_per_query']} major faults/query, "
        f"{r['disk_read_mb_s']} MB/s read, page cache {r['page_cache_share']}, {r['errors']} errors"
    )
    return r


def phases(url: str, args, pids, weights: Path, tag: str, loadgen: Path, pool: Queries) -> dict:
    """The cold and the warm LoadGen runs, each with the counters around it."""
    out = {}
    for phase, seconds in (("cold", args.cold_s), ("warm", args.warm_s)):
        out[phase] = measured(url, args, pids, weights, f"{tag}-{phase}", loadgen, pool, seconds)
        del out[phase]["latencies_ms"]
    return out


@contextlib.contextmanager
def started(variant: str, model_dir: Path, cfg: DLRMConfig, dist: str, args, drop: bool = True):
    """``model_dir`` (its config ``cfg``) on a TorchServe of its own started after the page cache was dropped (``drop``),
    until every worker is ready; yields (the server, the variant's row so far: startup, hot rows,
    page cache)."""
    model, weights = model_dir.name, model_dir / "dlrm.pt"
    row = {"variant": variant, "dist": dist, "model_dir": str(model_dir), "weights_gib": weights.stat().st_size / 2**30}
    row["cache_drop"] = drop_cache(weights) if drop else "not dropped (another model served beside it)"
    row["page_cache_share_before"] = resident_share(weights)
    home = Path(tempfile.mkdtemp(prefix="bigtables-"))
    srv = Server.on_free_ports(home, model_store=model_dir.parent, overrides={"load_models": f"{model}={model}"})
    t0 = time.perf_counter()
    try:
        srv.start()
        srv.wait_ready(model, mlperf.probe(cfg), timeout=args.start_timeout)
        pids = srv.wait_workers_ready(model, len(srv.worker_pids(model)), timeout=args.start_timeout)
        row.update(startup_s=round(time.perf_counter() - t0, 1), workers=len(pids))
        row["hot"] = hot_rows((srv.log_dir / "model_log.log").read_text(errors="replace"))
        row["page_cache_share_at_ready"] = resident_share(weights)
        log(f"{variant} {dist}: {len(pids)} workers ready in {row['startup_s']} s; hot rows {row['hot']}")
        yield srv, row
    finally:
        srv.stop()
        shutil.rmtree(home, ignore_errors=True)


def serve_variant(variant: str, model_dir: Path, dist: str, args, loadgen: Path) -> dict:
    """One variant on a TorchServe of its own, started cold: its cold and warm runs."""
    cfg, model = DLRMConfig.from_yaml(model_dir / "model-config.yaml"), model_dir.name
    form = args.form[0]
    pool = Queries(cfg, dist, args.seed, math.ceil(1.25 * args.qps * (args.cold_s + args.warm_s)) + 10, form)
    with started(variant, model_dir, cfg, dist, args) as (srv, row):
        tag, url = f"{variant}-{dist.replace(' ', '')}", srv.url + mlperf.path(form, model)
        row.update(phases(url, args, lambda: srv.worker_pids(model), model_dir / "dlrm.pt", tag, loadgen, pool))
    return row


def ratio(a, b) -> float | None:
    return round(a / b, 2) if a is not None and b else None


def ratios(rows: list[dict]) -> list[dict]:
    """Per distribution and phase: packed / unpacked (p99, major faults per query) and packed /
    capped (p99; the issue's target on the warm phase: at most TARGET)."""
    by = {(r["variant"], r["dist"]): r for r in rows}
    out = []
    for dist in dict.fromkeys(r["dist"] for r in rows):
        packed, unpacked, capped = (by.get((v, dist)) for v in ("packed", "unpacked", "capped"))
        for phase in ("cold", "warm") if packed else ():
            p = packed[phase]
            row = {"dist": dist, "phase": phase}
            if unpacked:
                u = unpacked[phase]
                row["p99_vs_unpacked"] = ratio(p.get("p99_ms"), u.get("p99_ms"))
                row["faults_vs_unpacked"] = ratio(p["majflt_per_query"], u["majflt_per_query"])
            if capped:
                row["p99_vs_capped"] = ratio(p.get("p99_ms"), capped[phase].get("p99_ms"))
                if phase == "warm" and row["p99_vs_capped"] is not None:
                    row["target_met"] = row["p99_vs_capped"] <= TARGET
            out.append(row)
    return out


def hot_text(r: dict) -> str:
    """A variant's "hot rows" cell (and a container's OOM kills)."""
    h, oom = r.get("hot"), f"; OOM kills {r['oom_kills']}, OOMKilled {r['oom_killed']}" if "oom_kills" in r else ""
    if "error" in r:
        return r["error"]
    if not h:
        return "none (no hot rows in the weights)" + oom
    if "note" in h:
        return f"{h['rows']:,} rows, {h['note']}" + oom
    locked = "locked" if h["locked"] else f"not locked: {h['why_not']}"
    huge = f", {h['huge_mib']} MiB on 2 MiB pages" if "huge_mib" in h else ""
    return f"{h['rows']:,} rows ({h['mib']} MiB), read in {h['seconds']} s{huge}, {locked}" + oom


def heading(report: dict, text: str) -> list[str]:
    """A report's title and its machine line, ``text`` after the load average."""
    m = report["machine"]
    return [
        f"# {report['title']}",
        "",
        f"CPU: {m['cpu']}, {m['available_cpus']} CPUs, ISA {m['isa']}; {report['memory_gib']} GiB of memory; "
        f"load average {m['load_average'][0]} at the end{text}",
    ]


def markdown(report: dict) -> list[str]:
    s = report["settings"]
    lines = heading(report, " (a shared machine runs other work).") + [
        "",
        f"LoadGen Server at {s['qps']} q/s, queries of MLPerf's {mlperf.PAIRS[0]}-{mlperf.PAIRS[1]} pairs with its bag "
        f"sizes (`{s.get('form', ['columns'])[0]}` form), ids of bench/ids.py drawn afresh per query (seed {s['seed']}); cold: the first "
        f"{s['cold_s']:g} s right after every worker is ready, warm: the next {s['warm_s']:g} s (each its own LoadGen "
        "run, min_query_count = q/s x seconds: a short run is INVALID by early stopping alone, its percentiles stand). "
        "Each variant on a TorchServe of its own, started after the page cache was dropped. Faults, RSS: the workers' "
        "(summed); disk: every read of the weights' device (other processes' too); page cache: the weights file's "
        "share after the phase. packed: the model directory as built; unpacked: the same weights with "
        "handler.hot_rows: false (every id read where it lies); capped: model-config.dlrmv2.yaml as shipped "
        "(200,000-row tables), built by scripts/build_big.py without --full.",
        "",
    ]
    header = "variant | ids | model | weights GiB | cache dropped by | workers | ready s | hot rows (worker log)"
    cells = [
        [r["variant"], r["dist"], Path(r["model_dir"]).name, f"{r['weights_gib']:.2f}", r["cache_drop"]]
        + [r.get("workers"), r.get("startup_s"), hot_text(r)]
        for r in report["rows"]
    ]
    lines += md_table(header.split(" | "), cells, align="llllllrl") + [""]
    header = "variant | ids | phase | LoadGen | queries | p50 / p99 / max ms | errors | major faults/query | "
    header += "disk read MB/s | page cache share | workers RSS anon / file MiB"
    cells = []
    for r, phase in ((r, p) for r in report["rows"] for p in ("cold", "warm") if p in r):
        x = r[phase]
        verdict = ("VALID" if x["valid"] else "INVALID") + (
            f" ({', '.join(x['unsatisfied'])})" if "unsatisfied" in x else ""
        )
        cells.append([r["variant"], r["dist"], phase, verdict, x["queries"], f"{x.get('p50_ms')} / {x.get('p99_ms')}"])
        cells[-1][-1] += f" / {x.get('max_ms')}"
        cells[-1] += [x["errors"], x["majflt_per_query"], x["disk_read_mb_s"], x["page_cache_share"]]
        cells[-1].append(f"{x['rss_anon_mib']} / {x['rss_file_mib']}")
    lines += md_table(header.split(" | "), cells, align="llllrrrrrrr")
    if report.get("ratios"):
        header = "ids | phase | p99 packed / unpacked | faults/query packed / unpacked | "
        header += f"p99 packed / capped (target: warm <= {TARGET})"
        met = {True: ", met", False: ", missed", None: ""}
        cells = [
            [x["dist"], x["phase"], *(na(x.get(k)) for k in ("p99_vs_unpacked", "faults_vs_unpacked", "p99_vs_capped"))]
            for x in report["ratios"]
        ]
        for c, x in zip(cells, report["ratios"]):
            c[-1] += met[x.get("target_met")]
        lines += ["", "**Ratios** (n/a: a figure missing, or the denominator 0)", ""]
        lines += md_table(header.split(" | "), cells, align="llrrr")
    return lines


def na(x) -> str:
    return "n/a" if x is None else str(x)


def finish(out: Path, report: dict, started: float) -> None:
    report.update(machine=machine(), ratios=ratios(report["rows"]), wall_s=round(time.perf_counter() - started))
    write_report(out / "bigtables", report, markdown(report))


def settings(args) -> dict:
    return {k: getattr(args, k) for k in ("qps", "cold_s", "warm_s", "seed", "dists", "form")}


def memory_gib() -> float:
    total = next(ln for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemTotal:"))
    return round(int(total.split()[1]) / 2**20, 1)


def cmd_serve(args, argv) -> int:
    packed = Path(args.model_dir).resolve()
    if not (packed / "dlrm.pt").is_file():
        print(
            f"serve: no model directory at {packed}: build it (see python bench/bigtables.py --help)", file=sys.stderr
        )
        return 2
    out = run_dir(__file__, "bigtables", TITLE, args.out, argv)
    started, tmp = time.perf_counter(), Path(tempfile.mkdtemp(prefix="bigtables-capped-"))
    report = {"title": TITLE, "memory_gib": memory_gib(), "settings": settings(args), "rows": []}
    try:
        variants = [(v, unpacked_sibling(packed, v)) for v in args.variants]
        if args.compare_capped:
            dtype = DLRMConfig.from_yaml(packed / "model-config.yaml").build.embedding_dtype
            capped = Path(args.capped_dir).resolve() if args.capped_dir else build_capped(tmp / "store", dtype)
            variants.append(("capped", capped))
        for dist in args.dists:
            for variant, model_dir in variants:
                report["rows"].append(serve_variant(variant, model_dir, dist, args, out / "loadgen"))
                finish(out, report, started)  # kept after each variant: a run cut short keeps what it measured
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


# --- turns: packed and capped served at once, LoadGen against each in turns ---------------------

TURNS_TITLE = "Issue 44: packed full-size against capped, served at once, in turns under LoadGen"


def cmd_turns(args, argv) -> int:
    """The packed model (started cold, after the page cache was dropped) and the capped model, each
    on its own TorchServe at once; each model's first --cold-s seconds (unrecorded in the ratios),
    then --turns turns of a --warm-s run against each model in each --form, the order rotated: the
    ratio within one stretch of the host, not two runs minutes apart."""
    dirs = {"packed": args.model_dir, "capped": args.capped_dir}
    for v, d in dirs.items():
        if not d or not (Path(d) / "dlrm.pt").is_file():
            print(f"turns: no {v} model directory at {d} (--model-dir, --capped-dir)", file=sys.stderr)
            return 2
    out, dist, forms = run_dir(__file__, "bigtables-turns", TURNS_TITLE, args.out, argv), args.dists[0], args.form
    seconds = args.cold_s + args.turns * args.warm_s
    started_at, ahead = time.perf_counter(), math.ceil(1.25 * args.qps * seconds) + 10
    report = {"title": TURNS_TITLE, "memory_gib": memory_gib(), "settings": settings(args) | {"turns": args.turns}}
    report.update(rows=[], runs=[])
    with contextlib.ExitStack() as stack:
        served = []  # per model and form: (model, form, url, pids, directory, queries)
        for k, (v, d) in enumerate(dirs.items()):
            d = Path(d).resolve()
            cfg = DLRMConfig.from_yaml(d / "model-config.yaml")
            srv, row = stack.enter_context(started(v, d, cfg, dist, args, drop=k == 0))
            if v == "packed":  # warm: the page cache as a served model has it, filled
                row["fill"] = wait_fill(srv.log_dir / "model_log.log", args.start_timeout)
                log(f"packed: fill {row['fill']}")
            report["rows"].append(row)
            pids = lambda s=srv, m=d.name: s.worker_pids(m)  # noqa: E731
            for j, form in enumerate(forms):  # ids of their own: none finds another's pages cached
                pool = Queries(cfg, dist, args.seed + 100 * k + 10 * j, ahead, form)
                served.append((v, form, srv.url + mlperf.path(form, d.name), pids, d, pool))
        first = [x for x in served if x[1] == forms[0]]
        for turn in range(-1, args.turns):  # -1: each model's first --cold-s seconds
            at = turn % len(served)
            for v, form, url, pids, d, pool in first[::-1] if turn < 0 else served[at:] + served[:at]:
                name = v if len(forms) == 1 else f"{v}-{form}"
                seconds, tag = (args.cold_s, f"{name}-first") if turn < 0 else (args.warm_s, f"{name}-turn{turn}")
                r = measured(url, args, pids, d / "dlrm.pt", tag, out / "loadgen", pool, seconds)
                report["runs"].append({"turn": turn, "variant": v, "form": form} | r)
                finish_turns(out, report, started_at)  # kept after each run: a run cut short keeps what it measured
    return 0


FILL_LINE = re.compile(r"prefetch: .* read into the page cache in .*$", re.M)


def wait_fill(log_file: Path, timeout: float) -> str | None:
    """The workers' background fill of the page cache (hot.Fill) ended: its log line (the filler's:
    the others log "another worker fills"), or None if no worker prefetches (no table large enough:
    the log has no "asked for at once") or it outlasts ``timeout``. Called once the workers are ready."""
    deadline = time.monotonic() + timeout
    while True:
        text = log_file.read_text(errors="replace") if log_file.exists() else ""
        done = [m.group(0) for m in FILL_LINE.finditer(text) if "another worker fills" not in m.group(0)]
        if done or "asked for at once" not in text or time.monotonic() > deadline:
            return done[0] if done else None
        time.sleep(2)


def turns_summary(runs: list[dict], forms: list[str]) -> dict:
    """Per form: per model its recorded turns' p99s and every query's ms pooled; packed / capped per
    turn (LoadGen's p99s) and pooled, the issue's target on both."""
    out = {}
    for form in forms:
        kept = [r for r in runs if r["turn"] >= 0 and r["form"] == form]
        got: dict = {"variants": {}}
        for v in ("packed", "capped"):
            mine = [r for r in kept if r["variant"] == v]
            ms = sorted(x for r in mine for x in r.get("latencies_ms", []))
            got["variants"][v] = {
                "turns": len(mine),
                "p99_ms": [r.get("p99_ms") for r in mine],
                "queries": len(ms),
                "pooled_p50_ms": round(percentile(ms, 50), 1) if ms else None,
                "pooled_p99_ms": round(percentile(ms, 99), 1) if ms else None,
                "majflt_per_query": [r["majflt_per_query"] for r in mine],
                "disk_read_mb_s": [r["disk_read_mb_s"] for r in mine],
            }
        p99 = {(r["variant"], r["turn"]): r.get("p99_ms") for r in kept}
        per_turn = [ratio(p99[("packed", t)], p99.get(("capped", t))) for v, t in p99 if v == "packed"]
        per_turn = got["p99_ratio_per_turn"] = [x for x in per_turn if x is not None]
        got["p99_ratio_median"] = round(statistics.median(per_turn), 2) if per_turn else None
        pv = got["variants"]
        got["p99_ratio_pooled"] = ratio(pv["packed"]["pooled_p99_ms"], pv["capped"]["pooled_p99_ms"])
        both = (got["p99_ratio_median"], got["p99_ratio_pooled"])
        got["target_met"] = None if None in both else max(both) <= TARGET
        out[form] = got
    return out


def finish_turns(out: Path, report: dict, started_at: float) -> None:
    report.update(machine=machine(), summary=turns_summary(report["runs"], report["settings"]["form"]))
    report["wall_s"] = round(time.perf_counter() - started_at)
    slim = report | {"runs": [{k: x for k, x in r.items() if k != "latencies_ms"} for r in report["runs"]]}
    write_report(out / "bigtables-turns", slim, turns_markdown(report))


def turns_markdown(report: dict) -> list[str]:
    s = report["settings"]
    lines = heading(report, ".")
    lines[-1] += (
        " Both models served at once, each by its own TorchServe (the "
        "packed one started after the page cache was dropped, its background fill waited for); LoadGen Server at "
        f"{s['qps']:g} q/s, MLPerf's {mlperf.PAIRS[0]}-{mlperf.PAIRS[1]}-pair queries with its bag sizes "
        f"({', '.join(f'`{f}`' for f in s['form'])}), ids {s['dists'][0]} drawn afresh per query, each model and form "
        f"its own seed: each model's first {s['cold_s']:g} s (not in the ratios), then {s['turns']} turns of a "
        f"{s['warm_s']:g} s run against each model in each form, the order rotated by one each turn. pooled: every "
        "query of a variant's turns, at the client. LoadGen's summaries: loadgen/."
    )
    lines.append("")
    cells = [
        [r["variant"], Path(r["model_dir"]).name, f"{r['weights_gib']:.2f}", r.get("startup_s"), hot_text(r)]
        + [r.get("fill") or "none"]
        for r in report["rows"]
    ]
    header = ["variant", "model", "weights GiB", "ready s", "hot rows (worker log)", "fill (worker log)"]
    lines += md_table(header, cells, align="lllrll")
    cells = []
    for r in report["runs"]:
        verdict = "VALID" if r["valid"] else "INVALID"
        cells.append(["first" if r["turn"] < 0 else r["turn"] + 1, r["variant"], r["form"], verdict, r["queries"]])
        cells[-1] += [f"{r.get('p50_ms')} / {r.get('p99_ms')} / {r.get('max_ms')}", r["errors"], r["majflt_per_query"]]
        cells[-1] += [r["disk_read_mb_s"], r["page_cache_share"]]
    header = ["turn", "variant", "form", "LoadGen", "queries", "p50 / p99 / max ms", "errors", "major faults / query"]
    lines += [""] + md_table(header + ["disk read MB/s", "page cache share"], cells, align="llllrrrrrr")
    for form, sm in report["summary"].items():
        pv = sm["variants"]
        met = {True: "met", False: "missed", None: "undecided"}[sm["target_met"]]
        lines += [
            "",
            f"**packed / capped p99, `{form}`:** per turn {', '.join(str(x) for x in sm['p99_ratio_per_turn'])} "
            f"(median {sm['p99_ratio_median']}); pooled over {pv['packed']['queries']} and {pv['capped']['queries']} "
            f"queries {pv['packed']['pooled_p99_ms']} / {pv['capped']['pooled_p99_ms']} ms = {sm['p99_ratio_pooled']} "
            f"(p50 {pv['packed']['pooled_p50_ms']} / {pv['capped']['pooled_p50_ms']} ms). Target <= {TARGET} on both: "
            f"{met}.",
        ]
    return lines


# --- profile: where a query's time goes, in this process ----------------------------------------

PROFILE_TITLE = "Issue 44: where an MLPerf-sized query's time goes, packed full-size against capped (in process)"
PHASES = ("parse_collate", "redirect", "prefetch", "forward", "total")


class Timed:
    """A worker's redirect and prefetch, timed into ``self.t`` (phase -> seconds of the last query)."""

    def __init__(self, worker):
        self.t: dict[str, float] = {}
        self.original = worker.prefetch
        if worker.hot is not None:
            worker.hot.redirect = self._wrap("redirect", worker.hot.redirect)
        if worker.prefetch is not None:
            worker.prefetch = self._wrap("prefetch", worker.prefetch)
        self.wrapped = worker.prefetch

    def _wrap(self, phase: str, fn):
        def timed(*a):
            t0 = time.perf_counter()
            try:
                return fn(*a)
            finally:
                self.t[phase] = self.t.get(phase, 0.0) + time.perf_counter() - t0

        return timed


def profile_turn(worker, timed: Timed, pool: Queries, n: int, warmup: int, weights: Path) -> dict:
    """``warmup`` then ``n`` queries one after another through ``worker``; per phase mean / p50 / p99 ms."""
    got: dict[str, list[float]] = {p: [] for p in PHASES}
    pairs, faults, sectors = 0, 0, 0
    for k in range(warmup + n):
        q = pool[k]
        timed.t = {}
        f0, s0 = resource.getrusage(resource.RUSAGE_SELF).ru_majflt, disk_sectors(weights)
        t0 = time.perf_counter()
        data = worker.group([open_request(q.body, False, None, worker.parser, worker.model_id, "application/json")])
        t1 = time.perf_counter()
        with torch.inference_mode():
            worker.infer(data)
        t2 = time.perf_counter()
        if data.errors:
            raise RuntimeError(f"query {k}: {data.errors}")
        if k < warmup:
            continue
        pairs += q.pairs
        faults += resource.getrusage(resource.RUSAGE_SELF).ru_majflt - f0
        sectors += disk_sectors(weights) - s0
        for phase, seconds in (
            ("parse_collate", t1 - t0 - timed.t.get("redirect", 0.0)),
            ("redirect", timed.t.get("redirect", 0.0)),
            ("prefetch", timed.t.get("prefetch", 0.0)),
            ("forward", t2 - t1 - timed.t.get("prefetch", 0.0)),
            ("total", t2 - t0),
        ):
            got[phase].append(seconds * 1000)
    out = {"queries": n, "pairs_mean": round(pairs / n, 1), "majflt_per_query": round(faults / n, 1)}
    out["disk_read_kb_per_query"] = round(sectors * 512 / 1024 / n, 1)
    for phase, xs in got.items():
        out[phase] = {"mean": round(statistics.mean(xs), 2), "p50": round(percentile(xs, 50), 2)}
        out[phase]["p99"] = round(percentile(xs, 99), 2)
    return out


def cmd_profile(args, argv) -> int:
    """The packed model (after its fill is done) with and without the per-forward prefetch, and the
    capped model, in turns (the order rotated, fresh ids for each variant in each turn), queries one after
    another in this process through the served Worker (no HTTP, no queueing)."""
    out = run_dir(__file__, "bigtables-profile", PROFILE_TITLE, args.out, argv)
    started, workers = time.perf_counter(), cpu_rule(len(os.sched_getaffinity(0))).workers
    loaded = {}
    for name, d in (("packed", args.model_dir), ("capped", args.capped_dir)):
        if d is None:
            continue
        w, d = Worker(), Path(d).resolve()
        t0 = time.perf_counter()
        w.load(d, *read_model_dir(d), workers=workers)
        fill = w.fill.wait(args.start_timeout) if w.fill is not None else None
        log(f"{name}: loaded in {time.perf_counter() - t0:.0f} s, hot rows {w.warmed}, fill done {fill}")
        loaded[name] = (w, Timed(w), d / "dlrm.pt")
    variants = [v for v in ("packed", "packed, no per-forward prefetch", "capped") if v.split(",")[0] in loaded]
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for turn in range(args.turns):
        for v in variants[turn % len(variants) :] + variants[: turn % len(variants)]:
            w, timed, weights = loaded[v.split(",")[0]]
            w.prefetch = None if "no per-forward" in v else timed.wrapped
            # ids of their own: a variant after another on the same ids would find its pages cached
            pool = Queries(
                w.config, args.dists[0], args.seed + 1000 * turn + 100 * variants.index(v), args.queries + 20
            )
            r = profile_turn(w, timed, pool, args.queries, 20, weights)
            runs[v].append(r)
            log(f"turn {turn + 1} {v}: " + ", ".join(f"{p} {r[p]['mean']}/{r[p]['p99']}" for p in PHASES))
    for w, timed, _ in loaded.values():
        w.prefetch = timed.original
        w.close()
    rows = []
    for v, rs in runs.items():
        row = {"variant": v, "turns": rs}
        for p in PHASES:
            row[p] = {k: round(statistics.median(r[p][k] for r in rs), 2) for k in ("mean", "p50", "p99")}
        for k in ("pairs_mean", "majflt_per_query", "disk_read_kb_per_query"):
            row[k] = round(statistics.median(r[k] for r in rs), 1)
        rows.append(row)
    report = {"title": PROFILE_TITLE, "memory_gib": memory_gib(), "machine": machine(), "dist": args.dists[0]}
    report.update(queries=args.queries, turns=args.turns, seed=args.seed, rows=rows)
    report["wall_s"] = round(time.perf_counter() - started)
    lines = [
        f"# {PROFILE_TITLE}",
        "",
        f"CPU: {report['machine']['cpu']}, ISA {report['machine']['isa']}; {report['memory_gib']} GiB of memory. "
        f"In one process, through the served Worker ({workers} worker(s) by the CPU rule, as TorchServe would "
        f"start), {args.queries} MLPerf-sized `columns` queries a turn one after another (after 20 unrecorded), "
        f"ids {args.dists[0]} drawn afresh for each variant in each turn; {args.turns} turns, the variants' order rotated; medians "
        "over turns. The packed model after its fill ended (the page cache as served warm). parse_collate: "
        "the body to a batch; redirect: hot ids to their copies; prefetch: the cold pages asked of the disk; "
        "forward: the lookups (waiting for pages still on their way) and the dense half. Disk: every read of "
        "the weights' device.",
        "",
    ]
    header = ["variant", "pairs", *[f"{p} ms mean / p99" for p in PHASES], "major faults / query", "disk KiB / query"]
    cells = [
        [r["variant"], r["pairs_mean"], *[f"{r[p]['mean']} / {r[p]['p99']}" for p in PHASES]]
        + [r["majflt_per_query"], r["disk_read_kb_per_query"]]
        for r in rows
    ]
    lines += md_table(header, cells, right=True)
    if "capped" in runs and "packed" in runs:
        by = {r["variant"]: r for r in rows}
        lines += [
            "",
            "packed / capped: total mean {:.2f}x, p99 {:.2f}x.".format(
                by["packed"]["total"]["mean"] / by["capped"]["total"]["mean"],
                by["packed"]["total"]["p99"] / by["capped"]["total"]["p99"],
            ),
        ]
    write_report(out / "bigtables-profile", report, lines)
    return 0


# --- squeeze: the kit's image under a memory limit ------------------------------------------------


def docker(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=300)
    if check and done.returncode:
        raise RuntimeError(f"docker {args[0]} failed: {done.stderr.strip()[-1000:]}")
    return done


def cgroup_of(pid: int) -> Path:
    """The memory cgroup folder of a process (cgroup v1's memory hierarchy, or v2's unified one)."""
    found = Path("/sys/fs/cgroup")
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, ctrl, path = line.split(":", 2)
        if ctrl == "memory":
            return Path("/sys/fs/cgroup/memory") / path.lstrip("/")
        if ctrl == "":
            found = Path("/sys/fs/cgroup") / path.lstrip("/")
    return found


def cgroup_figures(cg: Path) -> dict:
    """OOM kills and the peak memory use of a cgroup (v1 or v2 files, whichever are there)."""
    out: dict = {}
    for name in ("memory.oom_control", "memory.events"):
        if (cg / name).is_file() and (m := re.search(r"^oom_kill (\d+)", (cg / name).read_text(), re.M)):
            out["oom_kills"] = int(m.group(1))
    for name in ("memory.max_usage_in_bytes", "memory.peak"):
        if (cg / name).is_file():
            out["peak_mib"] = round(int((cg / name).read_text()) / 2**20)
    return out


def cgroup_workers(cg: Path) -> list[int]:
    """The host pids of the TorchServe workers in a container's cgroup."""
    out = []
    for pid in (cg / "cgroup.procs").read_text().split():
        try:
            if b"model_service_worker" in Path(f"/proc/{pid}/cmdline").read_bytes():
                out.append(int(pid))
        except FileNotFoundError:
            pass
    return out


def container_logs(name: str) -> str:
    out = docker("logs", name, check=False)
    return out.stdout + out.stderr


def wait_container(name: str, port: int, mport: int, model: str, cfg, deadline: float) -> list:
    """Until every worker of ``model`` is READY and the probe scores (docker's proxy accepts, then
    resets, connections while TorchServe is not up yet); the workers."""
    body = mlperf.probe(cfg)
    while time.perf_counter() < deadline:
        if docker("inspect", "-f", "{{.State.Running}}", name).stdout.strip() != "true":
            raise RuntimeError(f"{name} stopped during startup:\n{container_logs(name)[-3000:]}")
        try:
            status, body, _ = get(f"http://127.0.0.1:{mport}/models/{model}")
            workers = [w for m in json.loads(body) for w in m["workers"]] if status == 200 else []
            ready = workers and all(w["status"] == "READY" for w in workers)
            if ready and post(f"http://127.0.0.1:{port}/predictions/{model}", body, timeout=60)[0] == 200:
                return workers
        except (OSError, ValueError):
            pass
        time.sleep(1)
    raise TimeoutError(f"{name} not ready in time:\n{container_logs(name)[-3000:]}")


def container_variant(variant: str, extra: list[str], packed: Path, args, loadgen: Path) -> dict:
    """The packed model in the kit's image, as ``docker run`` with ``extra`` starts it."""
    cfg, weights, model = DLRMConfig.from_yaml(packed / "model-config.yaml"), packed / "dlrm.pt", packed.name
    dist = args.dists[0]
    pool = Queries(cfg, dist, args.seed, math.ceil(1.25 * args.qps * (args.cold_s + args.warm_s)) + 10)
    conf = Path(tempfile.mkdtemp(prefix="bigtables-docker-"))
    conf.chmod(0o755)  # the image runs as uid 1000
    props = {"inference_address": "http://0.0.0.0:8080", "management_address": "http://0.0.0.0:8081",
             "metrics_address": "http://0.0.0.0:8082", "disable_token_authorization": "true",
             "decode_input_request": "false", "load_models": f"{model}={model}",
             "default_workers_per_model": cpu_rule(args.cpus).workers}  # fmt: skip
    (conf / "config.properties").write_text("".join(f"{k}={v}\n" for k, v in props.items()))
    port, mport, name = free_port(), free_port(), f"bigtables-{os.getpid()}-{variant.replace(' ', '-')}"
    row = {"variant": variant, "dist": dist, "model_dir": str(packed), "weights_gib": weights.stat().st_size / 2**30}
    row.update(cache_drop=drop_cache(weights), memory_limit=args.memory, docker_args=" ".join(extra))
    run = ["run", "-d", "--name", name, "--memory", args.memory, "--memory-swap", args.memory, "--cpus", str(args.cpus)]
    run += ["--user", "1000:1000", "--read-only", "--tmpfs", "/tmp:exec", *extra, "-p", f"127.0.0.1:{port}:8080"]
    run += ["-p", f"127.0.0.1:{mport}:8081", "-v", f"{packed.parent}:/mnt/store:ro", "-v", f"{conf}:/mnt/conf:ro"]
    run += [args.image, "torchserve", "--start", "--foreground", "--model-store=/mnt/store"]
    t0 = time.perf_counter()
    try:
        started = docker(*run, "--ts-config=/mnt/conf/config.properties", "--disable-token-auth", check=False)
        if started.returncode:  # e.g. a limit this host may not give (runc: setting rlimit ... not permitted)
            log(f"{variant}: docker run failed: {started.stderr.strip()}")
            return row | {"error": f"docker run failed: {started.stderr.strip().splitlines()[0]}"}
        workers = wait_container(name, port, mport, model, cfg, t0 + args.start_timeout)
        row.update(startup_s=round(time.perf_counter() - t0, 1), workers=len(workers))
        row["hot"] = hot_rows(container_logs(name))
        cg = cgroup_of(int(docker("inspect", "-f", "{{.State.Pid}}", name).stdout))
        pids = lambda: cgroup_workers(cg)  # noqa: E731
        log(f"{variant}: {len(workers)} workers ready in {row['startup_s']} s; hot rows {row['hot']}")
        tag = f"container-{variant.replace(' ', '-')}"
        row.update(phases(f"http://127.0.0.1:{port}/predictions/{model}", args, pids, weights, tag, loadgen, pool))
        row.update(cgroup_figures(cg), oom_killed=docker("inspect", "-f", "{{.State.OOMKilled}}", name).stdout.strip())
        row.setdefault("oom_kills", "n/a")
    finally:
        docker("rm", "-f", name, check=False)
        shutil.rmtree(conf, ignore_errors=True)
    return row


def cmd_squeeze(args, argv) -> int:
    packed = Path(args.model_dir).resolve()
    if not shutil.which("docker") or docker("info", check=False).returncode != 0:
        print(
            "squeeze: no Docker engine answers (docker info failed): start dockerd, then run this again",
            file=sys.stderr,
        )
        return 2
    if docker("image", "inspect", args.image, check=False).returncode != 0:
        print(f"squeeze: no image {args.image}: build it with `make image` (docs/kubernetes.md)", file=sys.stderr)
        return 2
    out = run_dir(__file__, "bigtables-squeeze", f"{TITLE}: docker run --memory {args.memory}", args.out, argv)
    started = time.perf_counter()
    report = {"title": f"{TITLE}: the kit's image under docker run --memory {args.memory}",
              "memory_gib": memory_gib(), "settings": {**settings(args), "image": args.image}, "rows": []}  # fmt: skip
    for variant, extra in ((f"docker {args.memory}", []), (f"docker {args.memory} lock", shlex.split(args.lock_args))):
        report["rows"].append(container_variant(variant, extra, packed, args, out / "loadgen"))
        finish(out, report, started)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["serve", "turns", "squeeze", "report", "profile"])
    ap.add_argument(
        "--model-dir", default="/work/big/store/dlrmv2-int8", help="the packed model (default: %(default)s)"
    )
    ap.add_argument("--dists", nargs="+", default=["1.05"], metavar="S|uniform",
                    help="Zipf exponents and/or uniform (default: %(default)s)")  # fmt: skip
    ap.add_argument(
        "--variants",
        nargs="+",
        default=["packed", "unpacked"],
        choices=list(VARIANTS),
        help="serve: packed (as built), no-prefetch (handler.prefetch: false), unpacked (hot_rows and prefetch "
        "false: as before hot rows) (default: %(default)s)",
    )
    ap.add_argument("--qps", type=float, default=1.0, help="LoadGen's server_target_qps (default: %(default)s)")
    ap.add_argument("--cold-s", type=float, default=60.0, help="the cold run's seconds (default: %(default)s)")
    ap.add_argument("--warm-s", type=float, default=120.0, help="the warm run's seconds (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=11, help="the queries' (not the counts' 7; default: %(default)s)")
    ap.add_argument(
        "--compare-capped", action="store_true", help="serve: also the capped DLRMv2 (model-config.dlrmv2.yaml)"
    )
    ap.add_argument(
        "--capped-dir",
        help="serve: the capped model directory, built before (default: built in a temp store); profile: the "
        "capped model to set beside the packed one (default: none)",
    )
    ap.add_argument("--start-timeout", type=float, default=900.0, help="seconds to ready (default: %(default)s)")
    ap.add_argument("--memory", default="8g", help="squeeze: docker --memory (default: %(default)s)")
    ap.add_argument("--lock-args", default="--ulimit memlock=-1", help="squeeze: docker run arguments of the variant "
                    "that may lock the hot rows; where the host cannot raise the limit (runc: setting rlimit: operation "
                    "not permitted), '--user 0:0 --cap-add IPC_LOCK' (default: %(default)s)")  # fmt: skip
    ap.add_argument("--cpus", type=int, default=2, help="squeeze: docker --cpus (default: %(default)s)")
    ap.add_argument(
        "--image", default="ghcr.io/example/dlrm-torchserve:0.1.0-cpu", help="squeeze (default: %(default)s)"
    )
    ap.add_argument("--form", nargs="+", default=["columns"], choices=mlperf.FORMS, help="the queries' body: `columns` "
                    "JSON or the Open Inference Protocol's binary tensors; turns: one or more, each in turns; serve: "
                    "one; squeeze, profile: columns (default: %(default)s)")  # fmt: skip
    ap.add_argument("--queries", type=int, default=150, help="profile: queries a turn (default: %(default)s)")
    ap.add_argument(
        "--turns", type=int, default=2, help="profile, turns: turns over the variants (default: %(default)s)"
    )
    ap.add_argument("--out", help="output folder (default: results/<date>-bigtables[-squeeze|-profile]/)")
    ap.add_argument("--from-json", help="report: write the .md again from this bigtables.json (to --out)")
    args = ap.parse_args(argv)
    try:
        args.dists = [dist_name(d) for d in args.dists]
    except ValueError:
        ap.error(f"--dists: expected Zipf exponents (e.g. 1.05) or uniform, got {' '.join(args.dists)}")
    if args.command == "report":
        if not args.from_json:
            ap.error("report: --from-json FILE (a bigtables.json) is required")
        report = json.loads(Path(args.from_json).read_text())
        write_report(Path(args.out or Path(args.from_json).parent) / "bigtables", report, markdown(report))
        return 0
    if args.command in ("squeeze", "profile") and args.form != ["columns"]:
        ap.error(f"--form {' '.join(args.form)}: {args.command} sends `columns` queries only")
    if args.command == "serve" and len(args.form) != 1:
        ap.error(f"--form {' '.join(args.form)}: serve sends one form (turns serves several in turns)")
    if len(set(args.form)) != len(args.form):
        ap.error(f"--form {' '.join(args.form)}: each form once")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # killed: the finally blocks stop the server
    commands = {"serve": cmd_serve, "turns": cmd_turns, "squeeze": cmd_squeeze, "profile": cmd_profile}
    return commands[args.command](args, argv)


if __name__ == "__main__":
    sys.exit(main())
