#!/usr/bin/env python
"""Live updates under load and end to end (docs/live-updates.md): results/deltas.{json,md}.

    python bench/deltas.py                       # ~10 minutes on 2 CPUs
    python bench/deltas.py --seconds 20 --skip-freshness

**Under load**, per table dtype (fp32, int8): a real TorchServe with two workers follows a delta
directory while ranking requests (``--instances`` rows each) arrive at c=16. The run alternates
5-s windows without and with deltas (one a second, cycling ``--sizes`` rows): p99 during updates vs
without, in the same run. Every answer is checked against in-process references of the model
before and after each delta (tests/helpers.py DeltaReferences, the worker's own loading and
applying code): it must equal the reference of the sequence its X-Delta-Sequence header names;
one that equals none is torn. Apply latency: the delta's marker visible -> every worker serving it
(the ``applied_at`` the workers write to delta-state/<pid>.json, polled every 5 ms).

**Freshness**: scripts/train.py trains A, an archive is built from it and served; the trainer then
resumes from A on new data and publishes a delta every ``--publish-every`` steps. The AUC on the
newest held-out rows (the resumed trainer's), served before the first delta (stale) and after the
last (live), and the lag from a trainer step to every worker serving it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "scripts", ROOT / "tests", ROOT / "bench"):
    sys.path.insert(0, str(p))

from dlrmkit.delta import delta_path, write_delta  # noqa: E402
from helpers import DeltaReferences  # noqa: E402
from common import machine  # noqa: E402
from load import percentile, run_load  # noqa: E402
from tsctl import Server, post  # noqa: E402

HOT = 200  # rows per table that every request looks up and every delta rewrites
WINDOW_S = 5.0


def log(msg: str) -> None:
    print(f"[deltas] {msg}", flush=True)


def serve(tmp: Path, doc: dict, workers: int, checkpoint: Path | None = None):
    """Build the archive of ``doc`` (a model-config) and serve it; returns (server, mar, base)."""
    import build_mar

    doc = {**doc, "minWorkers": workers, "maxWorkers": workers, "batchSize": 16, "maxBatchDelay": 2}
    (tmp / "model-config.yaml").write_text(yaml.safe_dump(doc))
    args = ["--config", str(tmp / "model-config.yaml"), "--output-dir", str(tmp / "store"), "--force"]
    mar = build_mar.main(args + (["--checkpoint", str(checkpoint)] if checkpoint else []))
    with zipfile.ZipFile(mar) as z:
        base = z.read("delta-base.txt").decode().strip()
    srv = Server.on_free_ports(tmp / "home", model_store=tmp / "store").start()
    probe = {"dense": [0.0] * doc["handler"]["num_dense_features"], "sparse": {"keys": [], "values": [], "lengths": []}}
    srv.wait_ready("dlrm", json.dumps(probe).encode(), timeout=600)
    srv.wait_workers_ready("dlrm", workers, timeout=600)
    return srv, mar, base


class Applied(threading.Thread):
    """Polls the workers' delta-state files: (pid, sequence) -> when that worker applied it."""

    def __init__(self, pids: list[int]):
        super().__init__(daemon=True)
        self.pids, self.seen, self.locked, self.stop = pids, {}, {}, threading.Event()

    def run(self):
        # a TorchServe worker runs in its model's directory, where it writes delta-state/<pid>.json
        files = [Path(f"/proc/{p}/cwd/delta-state/{p}.json") for p in self.pids]
        while not self.stop.wait(0.005):
            for f in files:
                try:
                    s = json.loads(f.read_text())
                except (OSError, ValueError):
                    continue
                self.seen.setdefault((s["pid"], s["sequence"]), s["applied_at"])
                self.locked.setdefault((s["pid"], s["sequence"]), s.get("locked_ms"))

    def everywhere(self, seq: int, pids: list[int]) -> float | None:
        times = [self.seen.get((p, seq)) for p in pids]
        return None if None in times else max(times)


def under_load(tmp: Path, dtype: str, a) -> dict:
    gen = torch.Generator().manual_seed(0)
    names = [f"f{i}" for i in range(a.tables)]
    handler = {
        "num_dense_features": 13,
        "sparse_features": names,
        "num_embeddings": a.rows,
        "embedding_dim": a.dim,
        "dense_arch_layer_sizes": [64, a.dim],
        "over_arch_layer_sizes": [64, 32, 1],
        "embedding_dtype": dtype,
        "delta_dir": str(tmp / "deltas"),
        "delta_poll_s": 0.05,
    }
    srv, mar, base = serve(tmp, {"handler": handler}, 2)
    try:
        requests = [
            json.dumps(
                {
                    "instances": [
                        {
                            "dense": torch.randn(13, generator=gen).tolist(),
                            "sparse": {
                                "keys": names,
                                "values": torch.randint(0, HOT, (a.tables,), generator=gen).tolist(),
                                "lengths": [1] * a.tables,
                            },
                        }
                        for _ in range(a.instances)
                    ]
                }
            ).encode()
            for _ in range(32)
        ]
        refs = DeltaReferences(mar, handler, tmp / "deltas", requests, tol=a.tol)
        pids = srv.worker_pids("dlrm")
        applied = Applied(pids)
        applied.start()
        answers, published, done = [], [], threading.Event()
        # Made beforehand (a trainer makes them elsewhere): publishing is two renames, as write_delta's last steps
        staged = tmp / "staged"
        for seq in range(1, int(a.seconds) // 2 + 2):
            per = a.sizes[(seq - 1) % len(a.sizes)] // a.tables
            tables = {}
            for t in names:
                ids = torch.cat([torch.arange(HOT), HOT + torch.randperm(a.rows - HOT, generator=gen)[: per - HOT]])
                tables[t] = (ids, torch.rand(len(ids), a.dim, generator=gen) * 2 - 1)
            write_delta(staged, "dlrm", base, seq, tables)
        log(f"{dtype}: {seq} deltas staged")
        (tmp / "deltas").mkdir()

        def publisher():
            seq, t0 = 1, time.perf_counter()
            while not done.is_set():
                now = time.perf_counter() - t0
                if int(now // WINDOW_S) % 2 == 1 and delta_path(staged, seq, ".ready").is_file():  # odd windows only
                    os.replace(delta_path(staged, seq), delta_path(tmp / "deltas", seq))
                    os.replace(delta_path(staged, seq, ".ready"), delta_path(tmp / "deltas", seq, ".ready"))
                    published.append((seq, a.sizes[(seq - 1) % len(a.sizes)], time.time(), now))
                    seq += 1
                done.wait(max(0.0, 1.0 - (time.perf_counter() - t0 - now)))

        def next_request(i):
            k = i % len(requests)
            return requests[k], lambda status, body, headers: answers.append(
                (k, status, headers.get("x-delta-sequence"), body if status == 200 else None)
            )

        pub = threading.Thread(target=publisher, daemon=True)
        pub.start()
        log(
            f"{dtype}: c={a.concurrency} for {a.seconds:.0f} s, deltas of {a.sizes} rows in every other {WINDOW_S:.0f}-s window"
        )
        result = asyncio.run(
            run_load(
                srv.url + "/predictions/dlrm",
                next_request,
                a.concurrency,
                a.seconds,
                10**9,
                record=True,
                with_headers=True,
            )
        )
        done.set()
        pub.join()
        last = published[-1][0]
        deadline = time.time() + 60
        while applied.everywhere(last, pids) is None and time.time() < deadline:
            time.sleep(0.05)
        applied.stop.set()
        assert refs.follow() == last, "the in-process references did not reach the last delta"
        torn = failed = 0
        for k, status, seq, body in answers:
            if status != 200 or seq is None:
                failed += 1
            elif int(seq) not in refs.sequences(k, json.loads(body)["scores"]):
                torn += 1
        start = result.events[0][0] if result.events else 0
        lat = {0: [], 1: []}
        for t0, t1, status in result.events:
            w = int((t0 - start) // WINDOW_S)
            if 0 < w < a.seconds // WINDOW_S:  # the first window warms up
                lat[w % 2].append((t1 - t0) * 1000)
        per_size, locked = {}, {}
        for seq, n, visible, _ in published:
            when = applied.everywhere(seq, pids)
            if when is not None:
                per_size.setdefault(n, []).append((when - visible) * 1000)
                locked.setdefault(n, []).extend(applied.locked[(p, seq)] for p in pids)
        out = {
            "dtype": dtype,
            "answers": len(answers),
            "failed": failed,
            "torn": torn,
            "deltas": len(published),
            "p99_ms_without": percentile(lat[0], 99),
            "p99_ms_during": percentile(lat[1], 99),
            "p50_ms_without": percentile(lat[0], 50),
            "p50_ms_during": percentile(lat[1], 50),
            "apply_ms_median": {n: percentile(v, 50) for n, v in sorted(per_size.items())},
            "apply_ms_max": {n: max(v) for n, v in sorted(per_size.items())},
            "locked_ms_median": {n: percentile([x for x in v if x is not None], 50) for n, v in sorted(locked.items())},
            "host_loadavg_1m": os.getloadavg()[0],  # this host is shared: the load the figures were made under
            "sequences_seen": len({s for _, _, s, _ in answers}),
        }
        out["p99_ratio"] = out["p99_ms_during"] / out["p99_ms_without"]
        log(json.dumps(out))
        return out
    finally:
        srv.stop()


def freshness(tmp: Path, a) -> dict:
    import train

    common = ["--world-size", "1", "--rows", "1000", "--num-sparse", "4", "--heldout", "2000", "--seed", "1"]
    py = [sys.executable, str(ROOT / "scripts" / "train.py")]
    subprocess.run([*py, "--out", str(tmp / "a"), *common, "--steps", str(a.stale_steps)], check=True)
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "build_mar.py"),
            "--checkpoint",
            str(tmp / "a" / "checkpoint"),
            "--write-config",
            str(tmp / "served.yaml"),
        ],
        check=True,
    )
    doc = yaml.safe_load((tmp / "served.yaml").read_text())
    doc["handler"].update(delta_dir=str(tmp / "deltas"), delta_poll_s=0.05)
    srv, mar, base = serve(tmp, doc, 2, tmp / "a" / "checkpoint")
    try:
        b_args = [
            "--out",
            str(tmp / "b"),
            "--resume",
            str(tmp / "a"),
            *common,
            "--steps",
            str(a.live_steps),
            "--publish-dir",
            str(tmp / "deltas"),
            "--publish-every",
            str(a.publish_every),
            "--publish-base",
            base,
        ]
        data = train.Clicks(train.parse_args(b_args))  # the resumed trainer's stream: its held-out rows are the newest
        names = train.features(train.parse_args(b_args))[1]
        rows = [
            {"dense": d, "sparse": {"keys": names, "values": i, "lengths": [1] * len(i)}}
            for d, i in zip(data.dense[-2000:].tolist(), data.ids[-2000:].tolist())
        ]
        labels = data.labels[-2000:].tolist()

        def served_auc() -> tuple[float, set]:
            from dlrmkit.checkpoint import auc

            scores, seqs = [], set()
            for i in range(0, len(rows), 100):
                status, body, headers = post(
                    f"{srv.url}/predictions/dlrm", json.dumps({"instances": rows[i : i + 100]}).encode()
                )
                assert status == 200, body
                scores += json.loads(body)["scores"]
                seqs.add({k.lower(): v for k, v in headers.items()}["x-delta-sequence"])
            return auc(torch.tensor(scores), torch.tensor(labels)), seqs

        stale, _ = served_auc()
        pids = srv.worker_pids("dlrm")
        applied = Applied(pids)
        applied.start()
        subprocess.run([*py, *b_args], check=True)
        from dlrmkit.delta import read_delta, ready_sequences

        ready = ready_sequences(tmp / "deltas")
        last = max(ready)
        deadline = time.time() + 120
        while applied.everywhere(last, pids) is None and time.time() < deadline:
            time.sleep(0.05)
        applied.stop.set()
        live, seqs = served_auc()
        lags = []
        for s in sorted(ready):
            when, d = applied.everywhere(s, pids), read_delta(ready[s].with_suffix(".safetensors"))
            if when is not None:
                lags.append((when - float(d.meta["step_time"])) * 1000)
        out = {
            "auc_stale": stale,
            "auc_live": live,
            "deltas": len(ready),
            "served_sequences": sorted(seqs),
            "stale_steps": a.stale_steps,
            "live_steps": a.live_steps,
            "publish_every": a.publish_every,
            "step_to_serving_ms_median": percentile(lags, 50),
            "step_to_serving_ms_max": max(lags),
        }
        log(json.dumps(out))
        return out
    finally:
        srv.stop()


def report(res: dict, path: Path) -> None:
    path.with_suffix(".json").write_text(json.dumps(res, indent=1))
    lines = [
        f"# Live updates: {res['cpu']}",
        "",
        f"`{res['command']}`",
        "",
        "| tables | answers | failed | torn | deltas | p99 without / during (ms) | ratio | apply ms median by rows (max) | lock held ms median |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["load"]:
        apply = ", ".join(f"{n}: {m:.0f} ({r['apply_ms_max'][n]:.0f})" for n, m in r["apply_ms_median"].items())
        held = ", ".join(f"{n}: {m:.1f}" for n, m in r["locked_ms_median"].items())
        lines.append(
            f"| {r['dtype']} | {r['answers']} | {r['failed']} | {r['torn']} | {r['deltas']} | "
            f"{r['p99_ms_without']:.1f} / {r['p99_ms_during']:.1f} | {r['p99_ratio']:.2f} | {apply} | {held} |"
        )
    if res.get("freshness"):
        f = res["freshness"]
        lines += [
            "",
            f"Freshness: AUC on the newest held-out rows **{f['auc_live']:.4f} live** vs "
            f"{f['auc_stale']:.4f} stale ({f['deltas']} deltas, one per {f['publish_every']} trainer steps); "
            f"trainer step -> every worker serving it: median {f['step_to_serving_ms_median']:.0f} ms, "
            f"max {f['step_to_serving_ms_max']:.0f} ms.",
        ]
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "results" / "deltas"), help="results/deltas (.json, .md)")
    ap.add_argument("--dtypes", default="fp32,int8", help="table dtypes (default: %(default)s)")
    ap.add_argument("--tables", type=int, default=4, help="tables (default: %(default)s)")
    ap.add_argument("--rows", type=int, default=250_000, help="rows per table (default: %(default)s)")
    ap.add_argument("--dim", type=int, default=32, help="embedding_dim (default: %(default)s)")
    ap.add_argument("--sizes", default="1000,10000,100000", help="rows per delta, cycled (default: %(default)s)")
    ap.add_argument("--instances", type=int, default=32, help="rows per ranking request (default: %(default)s)")
    ap.add_argument("--concurrency", type=int, default=16, help="(default: %(default)s)")
    ap.add_argument("--seconds", type=float, default=60, help="load per dtype (default: %(default)s)")
    ap.add_argument(
        "--tol", type=float, default=1e-6, help="|answer - reference| that still equals (default: %(default)s)"
    )
    ap.add_argument("--stale-steps", type=int, default=60, help="freshness: steps of A (default: %(default)s)")
    ap.add_argument(
        "--live-steps",
        type=int,
        default=400,
        help="freshness: steps the resumed trainer publishes (default: %(default)s)",
    )
    ap.add_argument("--publish-every", type=int, default=20, help="freshness: steps per delta (default: %(default)s)")
    ap.add_argument("--skip-freshness", action="store_true")
    a = ap.parse_args(argv)
    a.sizes = [int(s) for s in a.sizes.split(",")]
    torch.set_num_threads(1)  # the references compute as a worker does (one thread each on this machine)
    m = machine()
    res = {
        "cpu": f"{m['cpu']}, {m['cpus']} CPUs, {m['isa_served']}, load average {m['load_average'][0]} at the start",
        "machine": m,
        "command": " ".join(["python bench/deltas.py", *(argv or sys.argv[1:])]),
        "load": [],
    }
    with tempfile.TemporaryDirectory(prefix="dlrm-deltas-") as tmp:
        for dtype in a.dtypes.split(","):
            (Path(tmp) / dtype).mkdir()
            res["load"].append(under_load(Path(tmp) / dtype, dtype, a))
        if not a.skip_freshness:
            (Path(tmp) / "fresh").mkdir()
            res["freshness"] = freshness(Path(tmp) / "fresh", a)
    report(res, Path(a.out))
    log(f"wrote {a.out}.json and {a.out}.md")
    return res


if __name__ == "__main__":
    main()
