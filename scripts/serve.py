#!/usr/bin/env python
"""Start TorchServe with the DLRM archive in the background, wait until it answers, show a score.

    python scripts/serve.py start      # what `make serve` runs (after building the archive)
    python scripts/serve.py ready      # readiness probe: exit 0 if the model answers, else 1
    python scripts/serve.py stop       # what `make stop` runs

State lives in .serve/ (pid file, key_file.json when token auth is on) and logs in logs/.
Starting again first stops the server this script started before, so repeating is safe.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from scripts.tsctl import ROOT, Server  # noqa: E402


def server(args) -> Server:
    return Server(
        home=ROOT / ".serve",
        properties=Path(args.properties),
        model_store=Path(args.model_store),
        log_dir=ROOT / "logs",
    )


def start(args) -> int:
    srv = server(args)
    if srv.running():
        print("[serve] stopping the server started before")
        srv.stop()
    try:
        srv.start()
    except RuntimeError as e:
        print(f"[serve] error: {e}", file=sys.stderr)
        return 1
    print(f"[serve] TorchServe starting: {srv.url} (logs in {srv.log_dir}/)", flush=True)
    sample = Path(args.sample).read_bytes()
    shown = os.path.relpath(args.sample)
    try:
        answer = srv.wait_ready(
            args.model, sample, timeout=args.timeout, progress=lambda msg: print(f"[serve] {msg}", flush=True)
        )
    except (RuntimeError, TimeoutError) as e:
        print(f"[serve] error: {e}", file=sys.stderr)
        return 1
    url = f"{srv.url}/predictions/{args.model}"
    # The readiness probe was this very request: show its answer rather than send it again.
    print(f"[serve] POST {url} < {shown}\n[serve] HTTP 200: {json.dumps(answer, separators=(',', ':'))}")
    if srv.token():
        print(
            f"[serve] token authorization is on: send 'Authorization: Bearer <inference key>' "
            f"from {srv.home / 'key_file.json'}"
        )
    print(f"[serve] Open Inference Protocol: {srv.url}/v2/models/{args.model} (metadata), .../ready, .../infer")
    print(
        f'[serve] ready. Try: curl -X POST {url} -H "Content-Type: application/json" '
        f"-d @{shown}\n[serve] stop with: make stop"
    )
    return 0


def ready(args) -> int:
    """One readiness check of the running server (a Kubernetes exec readiness probe): the model
    scores the sample request and its frontend is warm (/v2/models/{m}/ready). Liveness is /ping; it cannot tell a failed model (docs/operations.md)."""
    try:
        srv = Server.attach(Path(args.home))
    except FileNotFoundError as e:
        print(f"[serve] not ready: {e}")
        return 1
    ok, _, seen = srv.ready(args.model, Path(args.sample).read_bytes(), timeout=args.probe_timeout)
    print(f"[serve] {'ready' if ok else 'not ready'}: {srv.url}/predictions/{args.model}: {seen}")
    if ok:  # it answers; ready once its frontend is warm too (the plugin's warm-up)
        ok, seen = srv.warm(args.model)
        print(f"[serve] {'warm' if ok else 'not ready, warming up'}: {seen}")
    return 0 if ok else 1


def stop(args) -> int:
    srv = server(args)
    if not srv.running():
        print("[serve] TorchServe is not running")
        return 0
    srv.stop()
    print("[serve] TorchServe stopped" if not srv.running() else "[serve] TorchServe did not stop")
    return 1 if srv.running() else 0


def probe_from_config(config: str, home: Path) -> Path:
    """A one-row request any model of ``config`` scores: dense zeros, id 0 in every table (for a
    config written from a checkpoint, which has no sample request of its own)."""
    from dlrmkit.config import DLRMConfig

    c = DLRMConfig.from_yaml(config)
    path = home / "probe.json"
    home.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {
                "dense": [0.0] * c.num_dense_features,
                "sparse": {
                    "keys": list(c.sparse_features),
                    "values": [0] * c.num_features,
                    "lengths": [1] * c.num_features,
                },
            }
        )
    )
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=["start", "ready", "stop"])
    ap.add_argument(
        "--properties",
        default=str(ROOT / "config.properties"),
        help="TorchServe config.properties (default: %(default)s)",
    )
    ap.add_argument(
        "--model-store", default=str(ROOT / "model_store"), help="folder of .mar files (default: %(default)s)"
    )
    ap.add_argument("--model", default="dlrm", help="model name to probe (default: %(default)s)")
    ap.add_argument(
        "--sample",
        help="request sent once the server is up (default: one built from --config, "
        "else sample_requests/seed_single.json)",
    )
    ap.add_argument(
        "--config",
        help="model config to build the probe request from when no --sample is given "
        "(make serve CONFIG=... CHECKPOINT=...)",
    )
    ap.add_argument("--timeout", type=float, default=300, help="seconds to wait for the model (default: %(default)s)")
    ap.add_argument(
        "--home",
        default=str(ROOT / ".serve"),
        help="ready: the folder the server was started from (default: %(default)s)",
    )
    ap.add_argument(
        "--probe-timeout", type=float, default=10, help="ready: seconds to wait for the answer (default: %(default)s)"
    )
    args = ap.parse_args(argv)
    if args.sample is None:
        args.sample = str(
            probe_from_config(args.config, Path(args.home))
            if args.config
            else ROOT / "sample_requests" / "seed_single.json"
        )
    return {"start": start, "ready": ready, "stop": stop}[args.action](args)


if __name__ == "__main__":
    sys.exit(main())
