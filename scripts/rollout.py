#!/usr/bin/env python
"""Roll a new DLRM model version out to a running TorchServe with no failed requests.

    python scripts/rollout.py                          # build version N+1 from model-config.yaml, roll out
    python scripts/rollout.py --checkpoint trained.pt  # the same, with your trained weights
    python scripts/rollout.py --archive dlrm-v7.mar    # roll out an archive already in the model store
    python scripts/rollout.py --model big --archive big-v2   # or a model directory (build_big.py --repack)
    python scripts/rollout.py --rollback               # back to the version before the last rollout

Steps, each checked before the next: build -> register (the old version keeps serving) ->
verify (the new version's workers are up and it scores a probe through
/predictions/<model>/<version>) -> promote (make it the default) -> retire (drain the old
version, then unregister it). A failed step stops with an error; before promote it also
unregisters the new version, so the old one is left serving exactly as before.

It talks to the server started from --home (scripts/serve.py's .serve/ by default): the
management API must be on (enable_model_api=true, 127.0.0.1 only), and with token authorization
on it reads the management and inference keys from key_file.json there. It records the versions
in <home>/rollout.json for --rollback.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import urllib.parse
import zipfile
from pathlib import Path

from scripts.tsctl import ROOT, Server, request  # noqa: E402


class RolloutError(Exception):
    """A step failed; the message says which and what still serves."""


def say(msg: str) -> None:
    print(f"[rollout] {msg}", flush=True)


class Rollout:
    def __init__(self, srv: Server, model: str, probe: bytes, timeout: float, drain: float):
        self.srv, self.model, self.probe, self.timeout, self.drain = srv, model, probe, timeout, drain
        self.state_file = srv.home / "rollout.json"

    # --- management API ---------------------------------------------------------------------

    def call(self, method: str, path: str, timeout: float = 30.0) -> tuple[int, object]:
        status, body, _ = request(
            method, f"{self.srv.management_url}{path}", headers=self.srv.auth("management"), timeout=timeout
        )
        try:
            answer = json.loads(body)
        except ValueError:
            answer = body.decode(errors="replace")
        return status, answer

    def versions(self) -> list[dict]:
        status, answer = self.call("GET", f"/models/{self.model}/all")
        if status == 404:
            return []
        if status != 200:
            raise RolloutError(f"GET /models/{self.model}/all: HTTP {status} {_message(answer)}")
        return answer

    def default(self) -> dict:
        status, answer = self.call("GET", f"/models/{self.model}")
        if status != 200:
            raise RolloutError(
                f"no model {self.model!r} is serving (GET /models/{self.model}: HTTP {status} "
                f"{_message(answer)}); start it first (make serve)"
            )
        return answer[0]

    # --- steps ------------------------------------------------------------------------------

    def run(self, archive: str, version: str) -> None:
        """Register ``archive`` (a bare name in the model store) as ``version``, verify, promote, retire."""
        old = self.default()
        if old["modelVersion"] == version:
            raise RolloutError(f"{self.model} {version} is already the default version")
        say(f"{self.model} {old['modelVersion']} ({old['modelUrl']}) is serving; rolling out {version} ({archive})")
        # Registered but not the default: an earlier rollout stopped after registering, or
        # failed to retire it. Verify and promote it as it is; only discard what we registered.
        registered = [v for v in self.versions() if v["modelVersion"] == version]
        if registered and registered[0]["modelUrl"] != archive:
            raise RolloutError(
                f"{self.model} {version} is already registered from {registered[0]['modelUrl']}, "
                f"not {archive}; unregister it first: "
                f"curl -X DELETE {self.srv.management_url}/models/{self.model}/{version}"
            )
        ours = not registered
        if registered:
            say(f"{version} is registered already (not as default): verifying it")
        else:
            say(f"register {archive}: starting its workers (up to {self.timeout:.0f} s)")
            # Not synchronous=true: TorchServe then blocks one of its netty threads until the
            # workers are up, and every inference connection served by that thread waits too
            # (bench/faults.py measured requests held 6.9 s, the whole worker start).
            query = urllib.parse.urlencode({"url": archive, "model_name": self.model, "synchronous": "false"})
            since = self.srv.log_size()
            status, answer = self.call("POST", f"/models?{query}", timeout=self.timeout)
            try:
                if status not in (200, 202):
                    raise RolloutError(f"HTTP {status} {_message(answer)}")
                self.wait_workers(version, since)
            except RolloutError as e:
                self.discard(version)
                raise RolloutError(
                    f"register {archive}: {e}. {self.model} {old['modelVersion']} is still serving"
                ) from None

        say(f"verify {version}: workers up and a probe scored through /predictions/{self.model}/{version}")
        try:
            self.verify(version)
        except RolloutError as e:
            if ours:
                self.discard(version)
            raise RolloutError(f"verify {version}: {e}. {self.model} {old['modelVersion']} is still serving") from None

        say(f"promote {version} to the default version")
        status, answer = self.call("PUT", f"/models/{self.model}/{version}/set-default")
        if status != 200:
            if ours:
                self.discard(version)
            raise RolloutError(
                f"promote {version}: HTTP {status} {_message(answer)}. "
                f"{self.model} {old['modelVersion']} is still serving"
            )
        self.save(previous=old, current={"modelVersion": version, "modelUrl": archive})

        say(f"retire {old['modelVersion']}: drain its queue, then unregister it")
        self.retire(old["modelVersion"])
        say(f"done: {self.model} {version} is the default; rollback with: scripts/rollout.py --rollback")

    def wait_workers(self, version: str, since: int) -> None:
        """Until every worker of ``version`` is READY; a worker's exception in model_log.log
        (written after byte ``since``) ends the wait at once, since TorchServe would only retry."""
        deadline = time.monotonic() + self.timeout
        seen = "none yet"
        while time.monotonic() < deadline:
            why = self.srv.worker_error(self.model, version, since)
            if why:
                raise RolloutError(f"its worker failed to start: {why}")
            status, answer = self.call("GET", f"/models/{self.model}/{version}")
            workers = answer[0]["workers"] if status == 200 else []
            if workers and all(w["status"] == "READY" for w in workers):
                return
            seen = f"workers {[w['status'] for w in workers]}"
            time.sleep(0.5)
        raise RolloutError(f"workers not ready within {self.timeout:.0f} s (last: {seen}); see model_log.log")

    def verify(self, version: str) -> None:
        deadline = time.monotonic() + self.timeout
        seen = "no answer yet"
        while time.monotonic() < deadline:
            status, answer = self.call("GET", f"/models/{self.model}/{version}")
            workers = answer[0]["workers"] if status == 200 else []
            if workers and all(w["status"] == "READY" for w in workers):
                ok, status, seen = self.srv.ready(f"{self.model}/{version}", self.probe)
                if ok:  # it answers; promoted once warm too, or the model's readiness would dip
                    answer = seen
                    warm, seen = self.srv.warm(f"{self.model}/{version}")
                    if warm:
                        say(f"{version} answers: {answer}")
                        return
                    time.sleep(0.2)
                    continue
                if 400 <= status < 500:  # the model refuses the probe: waiting will not help
                    raise RolloutError(f"the probe got {seen}")
            else:
                seen = f"workers {[w['status'] for w in workers]}"
            time.sleep(1.0)
        raise RolloutError(f"not ready within {self.timeout:.0f} s (last: {seen})")

    def retire(self, version: str) -> None:
        # TorchServe 0.12 drops the requests still queued for a version it unregisters: they
        # never get an answer. So wait for the queue to empty first. The probe is queued behind
        # every request that reached this version before promote; once it is answered, they
        # have all been taken by a worker, and `drain` seconds let the last batch finish.
        self.srv.ready(f"{self.model}/{version}", self.probe, timeout=self.timeout)
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            status, answer = self.call("GET", f"/models/{self.model}/{version}")
            if status != 200 or answer[0].get("jobQueueStatus", {}).get("pendingRequests", 0) == 0:
                break
            time.sleep(0.1)
        time.sleep(self.drain)
        status, answer = self.call("DELETE", f"/models/{self.model}/{version}", timeout=self.timeout)
        if status != 200:
            raise RolloutError(
                f"retire {version}: HTTP {status} {_message(answer)}. The new version is the "
                f"default and serving; unregister {version} by hand: curl -X DELETE "
                f"{self.srv.management_url}/models/{self.model}/{version}"
            )

    def discard(self, version: str) -> None:
        """Unregister a new version that failed a step (if TorchServe kept it registered)."""
        if any(v["modelVersion"] == version for v in self.versions()):
            status, answer = self.call("DELETE", f"/models/{self.model}/{version}", timeout=self.timeout)
            say(
                f"unregistered the failed {version}"
                if status == 200
                else f"could not unregister the failed {version}: HTTP {status} {_message(answer)}"
            )

    def save(self, previous: dict, current: dict) -> None:
        keep = ("modelVersion", "modelUrl")
        self.state_file.write_text(
            json.dumps(
                {
                    "model": self.model,
                    "previous": {k: previous[k] for k in keep},
                    "current": {k: current[k] for k in keep},
                },
                indent=2,
            )
            + "\n"
        )

    def previous(self) -> tuple[str, str]:
        try:
            state = json.loads(self.state_file.read_text())
            prev = state["previous"]
        except (OSError, ValueError, KeyError):
            raise RolloutError(f"nothing to roll back to: {self.state_file} records no earlier rollout") from None
        if state.get("model") != self.model:
            raise RolloutError(f"{self.state_file} is about model {state.get('model')!r}, not {self.model!r}")
        return prev["modelUrl"], prev["modelVersion"]


def archive_version(path: Path, model: str) -> str:
    """The version in an archive's manifest (a .mar, or a model directory that scripts/build_big.py
    wrote); its model name must be ``model``."""
    try:
        if path.is_dir():
            manifest = json.loads((path / "MAR-INF" / "MANIFEST.json").read_text())["model"]
        else:
            with zipfile.ZipFile(path) as z:
                manifest = json.loads(z.read("MAR-INF/MANIFEST.json"))["model"]
    except (OSError, KeyError, ValueError, zipfile.BadZipFile) as e:
        raise RolloutError(f"{path}: not a model archive ({e})") from None
    if manifest.get("modelName") != model:
        raise RolloutError(f"{path}: archive of model {manifest.get('modelName')!r}, not {model!r}")
    return str(manifest["modelVersion"])


def next_version(version: str) -> str:
    """N+1 of a version: 1.0 -> 2.0, 7 -> 8, 2.3 -> 3.0."""
    major = version.split(".")[0]
    if not major.isdigit():
        raise RolloutError(f"cannot count on from version {version!r}; pass --version")
    return f"{int(major) + 1}.0" if "." in version else str(int(major) + 1)


def build(args, store: Path, version: str) -> str:
    """Build the archive for ``version`` into the model store as <model>-v<version>.mar."""
    name = f"{args.model}-v{version}.mar"
    target = store / name
    if target.exists():
        raise RolloutError(f"{target} exists already; roll it out with --archive {name}, or remove it")
    # build_mar names the file after the model; build beside the store, then rename into it,
    # so the store never holds a half-written archive.
    with tempfile.TemporaryDirectory(dir=store, prefix=".build-") as tmp:
        cmd = [
            sys.executable,
            str(ROOT / "scripts" / "build_mar.py"),
            "--config",
            args.config,
            "--model-name",
            args.model,
            "--version",
            version,
            "--output-dir",
            tmp,
        ]
        if args.checkpoint:
            cmd += ["--checkpoint", args.checkpoint]
        if args.verify:
            cmd += ["--verify", args.verify]
        if args.calibrate:
            cmd += ["--calibrate", args.calibrate]
        say(f"build {name} from {args.config}")
        try:
            subprocess.run(cmd, check=True)
        except subprocess.CalledProcessError as e:
            raise RolloutError(f"build failed (exit {e.returncode}); nothing was registered") from None
        (Path(tmp) / f"{args.model}.mar").rename(target)
    return name


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--home", default=str(ROOT / ".serve"), help="folder the running server was started from (default: %(default)s)"
    )
    ap.add_argument("--model", default="dlrm", help="model name (default: %(default)s)")
    ap.add_argument(
        "--config", default=str(ROOT / "model-config.yaml"), help="model config to build (default: %(default)s)"
    )
    ap.add_argument(
        "--checkpoint",
        help="trained checkpoint to build with: .pt/.pth or a DCP directory (default: seeded random weights)",
    )
    ap.add_argument(
        "--verify",
        metavar="FILE.jsonl",
        help="prove the built archive against the trainer's scores "
        "before anything is registered (build_mar.py --verify)",
    )
    ap.add_argument(
        "--calibrate",
        metavar="FILE.jsonl",
        help="handler.dense_precision int8: requests like the "
        "training data for static activation scales (build_mar.py --calibrate)",
    )
    ap.add_argument("--version", help="version to build (default: the serving version's major + 1, e.g. 1.0 -> 2.0)")
    ap.add_argument(
        "--archive",
        help="roll out this archive (a .mar or a scripts/build_big.py model directory in the model store) "
        "instead of building one",
    )
    ap.add_argument("--rollback", action="store_true", help="return to the version before the last rollout")
    ap.add_argument(
        "--sample",
        default=str(ROOT / "sample_requests" / "seed_single.json"),
        help="probe request the new version must score (default: %(default)s)",
    )
    ap.add_argument(
        "--timeout",
        type=float,
        default=600,
        help="seconds for each slow step: workers starting, verify, drain (default: %(default)s)",
    )
    ap.add_argument(
        "--drain",
        type=float,
        default=1.0,
        help="seconds the retired version gets to finish its last batch (default: %(default)s)",
    )
    args = ap.parse_args(argv)
    if sum(map(bool, (args.archive, args.rollback, args.version or args.checkpoint))) > 1:
        ap.error("choose one of --archive, --rollback, or a build (--version/--checkpoint)")
    if args.calibrate and (args.archive or args.rollback):
        ap.error("--calibrate goes with a build, not with --archive or --rollback")

    try:
        try:
            srv = Server.attach(Path(args.home))
        except FileNotFoundError as e:
            raise RolloutError(f"{e}; start the server first (make serve) or pass --home") from None
        ro = Rollout(srv, args.model, Path(args.sample).read_bytes(), args.timeout, args.drain)
        store = srv.model_store
        if args.rollback:
            archive, version = ro.previous()
            if not (store / archive).is_file():
                raise RolloutError(f"cannot roll back to {version}: {store / archive} is gone")
            say(f"rollback to {args.model} {version} ({archive})")
        elif args.archive:
            archive = args.archive
            if "/" in archive or not (store / archive).exists():
                raise RolloutError(
                    f"--archive: expected the name of a .mar or a model directory in {store}, got {archive!r}"
                )
            version = archive_version(store / archive, args.model)
        else:
            version = args.version or next_version(ro.default()["modelVersion"])
            archive = build(args, store, version)
        ro.run(archive, version)
    except RolloutError as e:
        print(f"[rollout] error: {e}", file=sys.stderr)
        return 1
    return 0


def _message(answer) -> str:
    return answer.get("message", "") if isinstance(answer, dict) else str(answer)[:300]


if __name__ == "__main__":
    sys.exit(main())
