#!/usr/bin/env python
"""The image's entrypoint (under tini, PID 1): runs its command line and stops TorchServe
gracefully on SIGTERM; `kserve [ARG...]` starts the second front door instead.

`torchserve --start --foreground` is a Python launcher that runs TorchServe's Java frontend as its
child and waits; a SIGTERM that reaches only the launcher kills it and orphans the JVM, and a
SIGTERM to the whole group kills the launcher before the JVM has stopped. So on SIGTERM/SIGINT
this process signals the JVM itself, waits for it (the launcher then returns), and exits 0 for a
stop it was asked for. Any other command line is exec'd as it is.

`kserve [ARG...]` runs the second door, KServe's own model server (dlrm_kserve.py, docs/kserve-door.md),
in place of this process: `python /opt/dlrm/dlrm_kserve.py --model-path <the default model's .mar>
--http-port 8080 --grpc-port 8081 ARG...`. ARGs come after the defaults and win over them (the last
value of an option counts), e.g. `kserve --model-path /mnt/models/model-store/dlrm.mar` for a
ServingRuntime's layout. It needs no help to stop: on SIGTERM it answers what it accepted, then exits 0.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil


DOOR = "/opt/dlrm/dlrm_kserve.py"
DOOR_DEFAULTS = ["--model-path", "/opt/dlrm/model/model-store/dlrm.mar", "--http-port", "8080", "--grpc-port", "8081"]


def door_command(args: list[str]) -> list[str]:
    """The second door's command line for `kserve ARG...`: the defaults, then ARGs (argparse keeps an
    option's last value)."""
    return [sys.executable, DOOR, *DOOR_DEFAULTS, *args]


def java_of(launcher: psutil.Process) -> psutil.Process | None:
    for child in launcher.children(recursive=False):
        try:
            if "org.pytorch.serve.ModelServer" in child.cmdline():
                return child
        except psutil.NoSuchProcess:
            continue
    return None


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: container_entrypoint.py COMMAND [ARG...] | kserve [ARG...]", file=sys.stderr)
        return 2
    if argv[0] == "kserve":
        argv = door_command(argv[1:])
        os.execv(argv[0], argv)
    if os.path.basename(argv[0]) != "torchserve" or "--foreground" not in argv:
        os.execvp(argv[0], argv)
    launcher = subprocess.Popen(argv)
    stopping: list[int] = []

    def on_signal(signum, _frame):
        stopping.append(signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    while launcher.poll() is None and not stopping:
        time.sleep(0.1)
    if not stopping:
        return launcher.returncode
    started = time.monotonic()
    print(f"[entrypoint] {signal.Signals(stopping[0]).name}: stopping TorchServe", file=sys.stderr, flush=True)
    java = java_of(psutil.Process(launcher.pid))
    if java is not None:
        java.send_signal(signal.SIGTERM)
    else:
        launcher.send_signal(signal.SIGTERM)
    code = launcher.wait()
    print(
        f"[entrypoint] TorchServe stopped in {time.monotonic() - started:.1f} s (launcher exit {code})",
        file=sys.stderr,
        flush=True,
    )
    return 0 if code in (0, -signal.SIGTERM, 128 + signal.SIGTERM) else code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
