#!/usr/bin/env python
"""Stop a serving container under load and count what the clients saw.

    python bench/container_stop.py --image ghcr.io/example/dlrm-torchserve:0.1.0-cpu --json results/container-stop.json

Starts the image as deploy/kserve's pods run it (uid 1000, read-only root, /tmp a tmpfs, all
capabilities dropped; its default model on 8080, published on 127.0.0.1 only), keeps
--concurrency clients posting the seed request in a loop, sends SIGTERM (`docker stop` with the
Kubernetes default 30 s grace) after --load-s seconds, and classifies every request:
answered (a 200 with a score), lost (sent, then the connection broke or an error status came:
a request the server accepted and dropped), refused (the connection was refused or reset before
the request was sent: the server had stopped accepting; a client retries these elsewhere).
Also reports the container's exit code and the seconds from SIGTERM to exit.
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SEED = (ROOT / "sample_requests" / "seed_single.json").read_bytes()


def docker(*args: str, check: bool = True) -> str:
    return subprocess.run(["docker", *args], check=check, capture_output=True, text=True).stdout.strip()


def one(host: str, port: int, body: bytes, timeout: float = 60.0) -> str:
    """'answered', 'lost' or 'refused' for one request on a fresh connection."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.connect()
    except OSError:
        return "refused"
    try:
        conn.request("POST", "/predictions/dlrm", body, {"Content-Type": "application/json"})
    except OSError:
        conn.close()
        return "refused"
    try:
        resp = conn.getresponse()
        data = resp.read()
        return "answered" if resp.status == 200 and b"score" in data else "lost"
    except (OSError, http.client.HTTPException):
        return "lost"
    finally:
        conn.close()


def load_and_stop(container: str, host: str, port: int, concurrency: int, load_s: float, grace_s: int = 30,
                  body: bytes = SEED) -> dict:
    """Clients loop on host:port until the container has exited; SIGTERM after `load_s`.
    `before_sigterm`: requests sent before the SIGTERM (the accepted ones: none may be lost),
    `in_flight`: those of them still unanswered at the SIGTERM, `after_sigterm`: sent after it."""
    before = {"answered": 0, "lost": 0, "refused": 0}
    after = {"answered": 0, "lost": 0, "refused": 0}
    in_flight = {"answered": 0, "lost": 0, "refused": 0}
    lock = threading.Lock()
    stop_at: list[float] = []
    done = threading.Event()

    def client():
        while not done.is_set():
            started = time.monotonic()
            outcome = one(host, port, body)
            with lock:
                (after if stop_at and started >= stop_at[0] else before)[outcome] += 1
                if stop_at and started < stop_at[0]:
                    in_flight[outcome] += 1
            if outcome == "refused":
                time.sleep(0.05)  # bounded retry loop while the container goes away

    threads = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    time.sleep(load_s)
    with lock:
        stop_at.append(time.monotonic())
    docker("stop", "-t", str(grace_s), container)
    exit_s = time.monotonic() - stop_at[0]
    done.set()
    for t in threads:
        t.join(timeout=70)
    code = int(docker("inspect", "-f", "{{.State.ExitCode}}", container))
    return {"concurrency": concurrency, "load_s": load_s, "before_sigterm": before, "in_flight": in_flight,
            "after_sigterm": after, "exit_code": code, "sigterm_to_exit_s": round(exit_s, 2)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(host: str, port: int, timeout: float = 180.0, path: str = "/predictions/dlrm") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if one(host, port, SEED, timeout=5) == "answered":
            return
        time.sleep(1)
    raise TimeoutError(f"no answer on {host}:{port} within {timeout:.0f} s")


def address(container: str) -> str:
    """The container's own address on docker's bridge: the clients talk to TorchServe, not to
    docker-proxy (which accepts, then resets, connections for a server that has stopped)."""
    return docker("inspect", "-f", "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}", container)


def run_args(image: str, name: str, port: int, container_port: int = 8080) -> list[str]:
    """`docker run` as deploy/kserve's securityContext runs the image. /tmp as the pods' emptyDir
    is: writable and executable (Docker's --tmpfs is noexec unless told, and Inductor loads the
    dense half it compiles from its cache there)."""
    return ["run", "-d", "--name", name, "--user", "1000:1000", "--read-only", "--tmpfs", "/tmp:exec",
            "--cap-drop", "ALL", "--security-opt", "no-new-privileges", "-p", f"127.0.0.1:{port}:{container_port}", image]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--image", default="ghcr.io/example/dlrm-torchserve:0.1.0-cpu", help="image (default: %(default)s)")
    ap.add_argument("--concurrency", type=int, default=32, help="client loops (default: %(default)s)")
    ap.add_argument("--load-s", type=float, default=5.0, help="seconds of load before SIGTERM (default: %(default)s)")
    ap.add_argument("--runs", type=int, default=3, help="start/load/stop cycles (default: %(default)s)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    runs = []
    for i in range(args.runs):
        name, port = f"dlrm-stop-{int(time.time())}-{i}", free_port()
        docker(*run_args(args.image, name, port))
        try:
            host = address(name)
            print(f"[stop] run {i + 1}/{args.runs}: waiting for {name} on {host}:8080", file=sys.stderr)
            wait_ready(host, 8080)
            result = load_and_stop(name, host, 8080, args.concurrency, args.load_s)
            print(f"[stop] {json.dumps(result)}", file=sys.stderr)
            runs.append(result)
        finally:
            docker("rm", "-f", name, check=False)
    out = {"image": args.image, "runs": runs}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
