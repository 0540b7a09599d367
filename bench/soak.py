#!/usr/bin/env python
"""Soak: a bounded mixed good/bad load against a real TorchServe, every answer checked.

    python bench/soak.py --duration 600 --concurrency 64        # starts its own server
    python bench/soak.py --url http://127.0.0.1:8080 ...         # or uses a running one

Writes soak.json, soak.md and run.json to results/<date>-soak/ (--out DIR).

Good requests (one or several instances, multi-hot, random key subsets) are first scored one at
a time; under load each answer must be 200 with those solo scores (to 1e-5). Bad requests must
get their own 4xx. Reports requests sent, answered, wrong status, wrong scores and worker
restarts (worker pids from the management API, polled throughout). Loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import tempfile
from pathlib import Path

from bench.common import ROOT, log, md_table, random_body, run_dir, same_scores, serving, write_report
from bench.load import p50_p99, run_load
from scripts.tsctl import post, worker_pids

POOL = 400  # distinct good requests
BAD_FRACTION = 0.25  # the share of bad requests


def bad_requests(features, rows, n_dense) -> list[tuple[bytes, int]]:
    ok = {"dense": [0.0] * n_dense, "sparse": {"keys": [features[0]], "values": [1], "lengths": [1]}}

    def with_(**kw):
        return json.dumps({**ok, "sparse": {**ok["sparse"], **kw}}).encode()

    return [
        (b"{", 400),
        (b"", 400),
        (b"\xff\xfe\x00", 400),
        (b"[" * 100_000, 400),
        (json.dumps({**ok, "dense": [1.0] * (n_dense + 1)}).encode(), 400),
        (json.dumps({**ok, "dense": [True] * n_dense}).encode(), 400),
        (with_(lengths=[-1]), 400),
        (with_(values=[1, 2]), 400),
        (with_(values=[rows[0]]), 400),
        (with_(values=[2**64]), 400),
        (with_(keys=["féature_0"]), 400),
        (with_(keys=["x" * 10_000]), 400),
        (json.dumps({"instances": []}).encode(), 400),
        (json.dumps({"instances": [ok] * 4097}).encode(), 413),
        (with_(values=[1] * 65_537, lengths=[65_537]), 413),
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running TorchServe inference URL (default: start a private one on free ports)")
    ap.add_argument("--model", default="dlrm", help="model name (default: %(default)s)")
    ap.add_argument("--config", default=str(ROOT / "model-config.yaml"), help="the model's config, for valid ids")
    ap.add_argument("--model-store", default=str(ROOT / "model_store"), help="archives for a private server")
    ap.add_argument("--concurrency", type=int, default=64, help="clients in flight (default: %(default)s)")
    ap.add_argument("--duration", type=float, default=60, help="seconds of load (default: %(default)s)")
    ap.add_argument("--out", help="write soak.json, soak.md and run.json here (default: results/<date>-soak/)")
    args = ap.parse_args()

    from dlrmkit.config import DLRMConfig

    cfg = DLRMConfig.from_yaml(args.config)
    rng = random.Random(0)
    # one instance (60%) or 2-16 instances each, multi-hot, random key subsets
    pool = [random_body(rng, cfg, 1 if rng.random() < 0.6 else rng.randint(2, 16)) for _ in range(POOL)]
    with contextlib.ExitStack() as stack:
        if args.url:
            url, mgmt = args.url.rstrip("/"), args.url.replace(":8080", ":8081").rstrip("/")
        else:
            home = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="dlrm-soak-")))
            srv = stack.enter_context(serving(home, Path(args.model_store), {args.model: pool[0]}, timeout=300))
            url, mgmt = srv.url, srv.management_url
        endpoint = f"{url}/predictions/{args.model}"
        log(f"scoring {len(pool)} good requests one at a time")
        solo = []
        for body in pool:
            status, answer, _ = post(endpoint, body)
            if status != 200:
                raise SystemExit(f"a good request failed alone: HTTP {status} {answer[:200]!r}")
            solo.append(json.loads(answer)["scores"])
        bad = bad_requests(list(cfg.sparse_features), list(cfg.num_embeddings), cfg.num_dense_features)

        pids_seen = set(pids_or_none(mgmt, args.model))
        start_pids = sorted(pids_seen)
        wrong_status, wrong_scores, examples = 0, 0, []

        def next_request(i):
            if rng.random() < BAD_FRACTION:
                body, want = rng.choice(bad)
                expected = None
            else:
                k = rng.randrange(len(pool))
                body, want, expected = pool[k], 200, solo[k]

            def check(status, answer):
                nonlocal wrong_status, wrong_scores
                if status != want:
                    wrong_status += 1
                    if len(examples) < 5:
                        examples.append(f"want {want}, got {status}: {answer[:160]!r}")
                    return
                if expected is not None:
                    got = json.loads(answer)["scores"]
                    if not same_scores(got, expected):
                        wrong_scores += 1
                        if len(examples) < 5:
                            examples.append(f"scores {got[:3]} != solo {expected[:3]}")
                elif not json.loads(answer).get("message"):
                    wrong_status += 1

            return body, check

        def progress(res, elapsed):
            pids_seen.update(pids_or_none(mgmt, args.model))
            log(
                f"{elapsed:5.0f} s: sent {res.sent}, answered {res.answered}, wrong status {wrong_status}, "
                f"wrong scores {wrong_scores}, worker pids seen {len(pids_seen)}"
            )

        log(f"{args.duration:.0f} s at concurrency {args.concurrency}, {BAD_FRACTION:.0%} bad")
        res = asyncio.run(run_load(endpoint, next_request, args.concurrency, args.duration, 10**8, progress=progress))
        end_pids = pids_or_none(mgmt, args.model)
        pids_seen.update(end_pids)
        report = {
            "wall_s": round(res.wall_s, 1),
            "concurrency": args.concurrency,
            "sent": res.sent,
            "answered": res.answered,
            "lost": res.sent - res.answered,
            "statuses": {str(k): v for k, v in sorted(res.statuses.items())},
            "wrong_status": wrong_status,
            "wrong_scores": wrong_scores,
            "worker_restarts": len(pids_seen) - len(start_pids),
            "worker_pids_start": start_pids,
            "worker_pids_end": end_pids,
            "requests_per_s": round(res.answered / res.wall_s, 1),
            "latency_ms_p50_p99": p50_p99(res.latencies_ms),
            "client_cpu_s": round(res.client_cpu_s, 1),
            "examples": examples,
        }
    clean = report["lost"] == 0 and wrong_status == 0 and wrong_scores == 0 and report["worker_restarts"] == 0
    keys = ("sent", "answered", "lost", "wrong_status", "wrong_scores", "worker_restarts", "requests_per_s")
    cells = [report[k] for k in keys] + [report["statuses"], " / ".join(map(str, report["latency_ms_p50_p99"]))]
    lines = md_table([*keys, "statuses", "p50 / p99 ms"], [cells], right=True) + ["", "PASS" if clean else "FAIL"]
    write_report(
        run_dir(__file__, "soak", "Soak: mixed good/bad load, every answer checked", args.out) / "soak", report, lines
    )
    return 0 if clean else 1


def pids_or_none(mgmt: str, model: str) -> list[int]:
    """Worker pids, or [] while the management API does not answer for the model."""
    try:
        return worker_pids(mgmt, model)
    except (RuntimeError, OSError):
        return []


if __name__ == "__main__":
    sys.exit(main())
