"""Start, probe and stop one TorchServe instance; shared by serve.py, the tests and benchmarks.

Each instance gets its own TMPDIR (TorchServe keeps its pid file there, so ``torchserve --stop``
only ever stops the instance it belongs to), its own log folder, and a properties file derived
from ``config.properties`` with the ports it was asked for.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = ROOT / ".venv" / "bin"


def default_workers() -> int:
    """Workers per model when neither the properties nor the model's config set them: the CPU
    rule for the CPUs this process (and so the TorchServe it starts) may use (dlrmkit/cpus.py)."""
    from dlrmkit.cpus import available_cpus, cpu_rule

    return cpu_rule(available_cpus()).workers


_PORTS = random.Random()  # its own generator: tests seed the module's
_GIVEN: set[int] = set()


def free_port(range_file: str | Path = "/proc/sys/net/ipv4/ip_local_port_range") -> int:
    """A loopback port free now, below the kernel's ephemeral range and not given before by this
    process. A port from that range (what binding port 0 gives) can be taken by any outgoing
    connection before TorchServe binds it, seconds later (its gRPC ports bind only after the
    models load): a CI run failed so with 'Address already in use'."""
    try:
        low = int(Path(range_file).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    span = range(max(1024, low - 12000), max(1025, low))
    for _ in range(100):
        port = _PORTS.choice(span)
        if port in _GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _GIVEN.add(port)
        return port
    with socket.socket() as s:  # nothing free below the range: the kernel's pick
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The frontend plugin's warm-up budget in seconds (config.properties; plugin/.../Warmup.java: 60 when
# unset, 0 = none). DLRM_WARMUP_SECONDS in the environment sets it on the servers this module starts
# (the test suite's servers run with 0 unless a test asks for the warm-up).
WARMUP_KEY, WARMUP_ENV = "dlrm_warmup_seconds", "DLRM_WARMUP_SECONDS"
# The plugin's batch budget in bytes of request bodies (plugin/.../BatchBudget.java; 0 = TorchServe's
# own batching by count alone); DLRM_BATCH_BYTES in the environment sets it likewise.
BATCH_BYTES_KEY, BATCH_BYTES_ENV = "dlrm_batch_bytes", "DLRM_BATCH_BYTES"


@dataclass
class Server:
    """A TorchServe started from ``properties``; its pid file, key file and logs live under ``home``.

    The server runs from a copy of ``properties`` with paths made absolute and ``overrides``
    applied (tests use them for free ports).
    """

    home: Path  # cwd of the server: tmp/ (pid file), key_file.json, derived properties
    properties: Path = ROOT / "config.properties"
    model_store: Path = ROOT / "model_store"
    log_dir: Path | None = None  # default: home/logs
    overrides: dict = field(default_factory=dict)

    def __post_init__(self):
        self.home = Path(self.home).resolve()
        self.log_dir = Path(self.log_dir or self.home / "logs").resolve()

    @classmethod
    def attach(cls, home: Path) -> Server:
        """The server already started from ``home``: its ports, model store and keys, from the
        properties file ``start`` wrote there (rollout.py and ``serve.py ready`` use this)."""
        props = Path(home) / "config.properties"
        if not props.is_file():
            raise FileNotFoundError(f"no server was started from {home} ({props} is missing)")
        logs = Path(home) / "log_dir"
        return cls(
            home=home,
            properties=props,
            model_store=Path(read_properties(props)["model_store"]),
            log_dir=Path(logs.read_text()) if logs.is_file() else None,
        )

    @classmethod
    def on_free_ports(cls, home: Path, **kw) -> Server:
        """A server whose every port is a free loopback port, for tests and benchmarks."""
        ports = {
            "inference_address": f"http://127.0.0.1:{free_port()}",
            "management_address": f"http://127.0.0.1:{free_port()}",
            "metrics_address": f"http://127.0.0.1:{free_port()}",
            "grpc_inference_port": free_port(),
            "grpc_management_port": free_port(),
            # the workers' sockets, /tmp/.ts.sock.<port> whatever TMPDIR says: servers at once apart
            "initial_worker_port": free_port(),
        }
        ports.update(kw.pop("overrides", None) or {})
        return cls(home=home, overrides=ports, **kw)

    def _address(self, key: str, default: str) -> str:
        props = read_properties(self.properties)
        props.update({k: str(v) for k, v in self.overrides.items()})
        return props.get(key, default).replace("0.0.0.0", "127.0.0.1").rstrip("/")

    @property
    def url(self) -> str:
        return self._address("inference_address", "http://127.0.0.1:8080")

    @property
    def management_url(self) -> str:
        return self._address("management_address", "http://127.0.0.1:8081")

    @property
    def metrics_url(self) -> str:
        return self._address("metrics_address", "http://127.0.0.1:8082")

    def token(self, kind: str = "inference") -> str | None:
        """The ``inference`` or ``management`` key from key_file.json, when token auth is on."""
        try:
            return json.loads((self.home / "key_file.json").read_text())[kind]["key"]
        except (OSError, KeyError, ValueError):
            return None

    def auth(self, kind: str = "inference") -> dict:
        key = self.token(kind)
        return {"Authorization": f"Bearer {key}"} if key else {}

    def env(self) -> dict:
        env = dict(os.environ)
        env["TMPDIR"] = str(self.home / "tmp")  # pid file, worker sockets, extracted archives
        env["LOG_LOCATION"] = str(self.log_dir)
        env["METRICS_LOCATION"] = str(self.log_dir)
        env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
        # The workers inherit it: an idle OpenMP thread sleeps instead of spinning on a core that the
        # frontend or another worker needs (a worker of handler.torch_threads > 1; docs/performance.md).
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        return env

    def write_properties(self) -> Path:
        """A copy of ``properties``: absolute paths (the server's cwd is ``home``), overrides."""
        props = read_properties(self.properties)
        props["model_store"] = str(self.model_store.resolve())
        for key in ("metrics_config", "plugins_path"):  # relative to the properties file
            if props.get(key):
                props[key] = str((self.properties.parent / props[key]).resolve())
        for key, name in ((WARMUP_KEY, WARMUP_ENV), (BATCH_BYTES_KEY, BATCH_BYTES_ENV)):
            if os.environ.get(name):  # below the overrides: a test's own override wins
                props[key] = os.environ[name]
        props.update({k: str(v) for k, v in self.overrides.items()})
        props.setdefault("default_workers_per_model", str(default_workers()))
        path = self.home / "config.properties"
        path.write_text("".join(f"{k}={v}\n" for k, v in props.items()))
        return path

    def start(self) -> Server:
        """Start in the background; output goes to logs/ (never a pipe: the daemon keeps it open)."""
        (self.home / "tmp").mkdir(parents=True, exist_ok=True)
        try:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.log_dir / "torchserve.out", "ab")
        except OSError as e:  # TorchServe would start and log nothing: refuse instead
            raise RuntimeError(
                f"cannot write TorchServe's logs in {self.log_dir}: {e.strerror}; "
                "free or remount it, or start with another log folder"
            ) from None
        props = self.write_properties()
        plugins = read_properties(props).get("plugins_path")
        if plugins and not any(Path(plugins).glob("*.jar")):  # TorchServe would start without /v2's GETs
            raise RuntimeError(
                f"plugins_path={plugins} holds no plugin jar: run `make plugin` (the Open Inference Protocol endpoints)"
            )
        (self.home / "log_dir").write_text(str(self.log_dir))  # for attach (rollout.py)
        with out:
            subprocess.run(
                [
                    str(BIN / "torchserve"),
                    "--start",
                    "--ts-config",
                    str(props),
                    "--model-store",
                    str(self.model_store.resolve()),
                    "--ncs",
                ],
                check=True,
                cwd=self.home,
                env=self.env(),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        return self

    def stop(self) -> None:
        """Stop this instance (its own pid file) and wait for it to exit; a no-op if not running."""
        if not (self.home / "tmp").is_dir():
            return
        with open(self.log_dir / "torchserve.out", "ab") as out:
            subprocess.run(
                [str(BIN / "torchserve"), "--stop", "--foreground"],
                check=False,
                cwd=self.home,
                env=self.env(),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                timeout=90,
            )

    def running(self) -> bool:
        pid_file = self.home / "tmp" / ".model_server.pid"
        try:
            os.kill(int(pid_file.read_text().split()[0]), 0)
            return True
        except (OSError, ValueError):
            return False

    def ready(self, model: str, probe: bytes, timeout: float = 30.0) -> tuple[bool, int, str]:
        """Readiness, checked once: ``model`` (or ``model/version``) answers ``probe`` with 200
        and finite scores. ``/ping`` says Healthy even when a model failed to load, so it cannot
        tell. Returns (ready, HTTP status or 0 for no answer, what was seen)."""
        try:
            status, body, _ = post(f"{self.url}/predictions/{model}", probe, headers=self.auth(), timeout=timeout)
        except OSError as e:
            return False, 0, f"no answer: {e}"
        if status != 200:
            return False, status, f"HTTP {status}: {body[:200]!r}"
        try:
            answer = json.loads(body)
            ok = len(answer["scores"]) > 0 and all(math.isfinite(s) for s in answer["scores"])
        except (ValueError, KeyError, TypeError):
            ok = False
        return (True, status, body.decode()) if ok else (False, status, f"HTTP 200 without scores: {body[:200]!r}")

    def warm(self, model: str) -> tuple[bool, str]:
        """The plugin's readiness, /v2/models/{model}/ready: 200 once a worker has loaded the model
        and the frontend's warm-up ended (plugin/.../Warmup.java); 404: no plugin, nothing to wait
        for. Returns (warm, what was seen)."""
        name, _, version = model.partition("/")
        path = f"/v2/models/{name}" + (f"/versions/{version}" if version else "") + "/ready"
        try:
            status, body, _ = get(self.url + path, headers=self.auth(), timeout=10)
        except OSError as e:
            return False, f"{path}: no answer: {e}"
        return status in (200, 404), f"{path}: HTTP {status}: {body[:300].decode(errors='replace')}"

    def wait_ready(self, model: str, probe: bytes, timeout: float = 180.0, progress=None) -> dict:
        """Poll ``ready`` until it holds and the model is warm (``warm``); returns the decoded answer
        of the probe."""
        deadline = time.monotonic() + timeout
        last = "no answer yet"
        answer = None
        while time.monotonic() < deadline:
            if not self.running():
                raise RuntimeError(
                    f"TorchServe exited during startup; see {self.log_dir}/torchserve.out and ts_log.log"
                )
            if answer is None:
                ok, _, last = self.ready(model, probe)
                answer = json.loads(last) if ok else None
            if answer is not None:
                warm, last = self.warm(model)
                if warm:
                    return answer
            if progress and int(time.monotonic() - deadline + timeout) % 5 == 0:
                progress(f"waiting for {model} to {'answer' if answer is None else 'warm up'} ({last})")
            time.sleep(1.0)
        raise TimeoutError(f"{model} did not answer within {timeout:.0f} s (last: {last}); see {self.log_dir}/")

    def worker_pids(self, model: str) -> list[int]:
        """The pids of the model's workers, from the management API."""
        return worker_pids(self.management_url, model, self.auth("management"))

    def worker_error(self, model: str, version: str, since: int = 0) -> str | None:
        """The last exception a worker of ``model`` ``version`` printed to model_log.log after
        byte ``since`` (e.g. the handler's ConfigError naming dlrm.pt): TorchServe's own answer
        to a failed registration only says "Failed to start workers"."""
        try:
            with open(self.log_dir / "model_log.log", "rb") as f:
                f.seek(since)
                text = f.read().decode(errors="replace")
        except OSError:
            return None
        tag = re.escape(f"-{model}_{version}-stdout MODEL_LOG - ")
        found = re.findall(rf"W-\d+{tag}([\w.]+(?:Error|Exception): .*)", text)
        return found[-1].strip() if found else None

    def log_size(self) -> int:
        try:
            return (self.log_dir / "model_log.log").stat().st_size
        except OSError:
            return 0

    def wait_workers_ready(self, model: str, count: int, timeout: float = 180.0) -> list[int]:
        """Poll the management API until ``count`` workers of ``model`` are READY (a model answers
        as soon as one worker is); returns their pids."""
        deadline = time.monotonic() + timeout
        while True:
            status, body, _ = get(f"{self.management_url}/models/{model}", headers=self.auth("management"))
            workers = [w for m in json.loads(body) for w in m["workers"]] if status == 200 else []
            ready = sorted(w["pid"] for w in workers if w.get("status") == "READY")
            if len(ready) >= count:
                return ready
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{model}: {len(ready)} of {count} workers READY after {timeout:.0f} s "
                    f"({[w.get('status') for w in workers]}); see {self.log_dir}/"
                )
            time.sleep(0.5)

    def wipe(self) -> None:
        shutil.rmtree(self.home, ignore_errors=True)


def worker_pids(management_url: str, model: str, headers: dict | None = None) -> list[int]:
    """The pids of a model's workers on any TorchServe, from its management API."""
    status, body, _ = get(f"{management_url}/models/{model}", headers=headers)
    if status != 200:
        raise RuntimeError(f"GET /models/{model}: HTTP {status} {body[:200]!r}")
    return sorted(w["pid"] for m in json.loads(body) for w in m["workers"])


def post(
    url: str, body: bytes, content_type: str = "application/json", headers: dict | None = None, timeout: float = 30.0
) -> tuple[int, bytes, dict]:
    req = urllib.request.Request(
        url, data=body, method="POST", headers={"Content-Type": content_type, **(headers or {})}
    )
    return _send(req, timeout)


def get(url: str, headers: dict | None = None, timeout: float = 30.0) -> tuple[int, bytes, dict]:
    return _send(urllib.request.Request(url, headers=headers or {}), timeout)


def request(method: str, url: str, headers: dict | None = None, timeout: float = 30.0) -> tuple[int, bytes, dict]:
    """A body-less PUT, DELETE, POST or GET, e.g. the management API's."""
    return _send(urllib.request.Request(url, method=method, headers=headers or {}), timeout)


def _send(req: urllib.request.Request, timeout: float) -> tuple[int, bytes, dict]:
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)


def _read_properties(path: Path) -> list[tuple[str, str]]:
    out = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            k, v = line.split("=", 1)
            out.append((k.strip(), v.strip()))
    return out


def read_properties(path: Path) -> dict:
    return dict(_read_properties(path))
