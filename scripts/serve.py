#!/usr/bin/env python
"""Start TorchServe with the DLRM archive in the background, wait until it answers, show a score.

    python scripts/serve.py start      # what `make serve` runs (after building the archive)
    python scripts/serve.py stop       # what `make stop` runs

State lives in .serve/ (pid file, key_file.json when token auth is on) and logs in logs/.
Starting again first stops the server this script started before, so repeating is safe.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tsctl import ROOT, Server, post  # noqa: E402


def server(args) -> Server:
    return Server(home=ROOT / ".serve", properties=Path(args.properties), model_store=Path(args.model_store),
                  log_dir=ROOT / "logs")


def start(args) -> int:
    srv = server(args)
    if srv.running():
        print("[serve] stopping the server started before")
        srv.stop()
    srv.start()
    print(f"[serve] TorchServe starting: {srv.url} (logs in {srv.log_dir}/)", flush=True)
    sample = Path(args.sample).read_bytes()
    shown = os.path.relpath(args.sample)
    try:
        srv.wait_ready(args.model, sample, timeout=args.timeout,
                       progress=lambda msg: print(f"[serve] {msg}", flush=True))
    except (RuntimeError, TimeoutError) as e:
        print(f"[serve] error: {e}", file=sys.stderr)
        return 1
    url = f"{srv.url}/predictions/{args.model}"
    status, body, _ = post(url, sample, headers=srv.auth())
    print(f"[serve] POST {url} < {shown}\n[serve] HTTP {status}: {body.decode()}")
    if srv.token():
        print(f"[serve] token authorization is on: send 'Authorization: Bearer <inference key>' "
              f"from {srv.home / 'key_file.json'}")
    print(f"[serve] ready. Try: curl -X POST {url} -H \"Content-Type: application/json\" "
          f"-d @{shown}\n[serve] stop with: make stop")
    return 0 if status == 200 else 1


def stop(args) -> int:
    srv = server(args)
    if not srv.running():
        print("[serve] TorchServe is not running")
        return 0
    srv.stop()
    print("[serve] TorchServe stopped" if not srv.running() else "[serve] TorchServe did not stop")
    return 1 if srv.running() else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=["start", "stop"])
    ap.add_argument("--properties", default=str(ROOT / "config.properties"),
                    help="TorchServe config.properties (default: %(default)s)")
    ap.add_argument("--model-store", default=str(ROOT / "model_store"), help="folder of .mar files (default: %(default)s)")
    ap.add_argument("--model", default="dlrm", help="model name to probe (default: %(default)s)")
    ap.add_argument("--sample", default=str(ROOT / "sample_requests" / "seed_single.json"),
                    help="request sent once the server is up (default: %(default)s)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds to wait for the model (default: %(default)s)")
    args = ap.parse_args()
    return start(args) if args.action == "start" else stop(args)


if __name__ == "__main__":
    sys.exit(main())
