#!/usr/bin/env python
"""The two front doors side by side, in one run: the same archive, the same client, TorchServe and
KServe's own model server (dlrm_kserve.py).

    python bench/doors.py                                  # Criteo config, both doors from this install
    python bench/doors.py --image ghcr.io/example/dlrm-torchserve:0.1.0-cpu   # both from the kit's image

Per door, one after the other on the same machine (nothing else running): the door is started on
the archive, warmed, then measured on

* MLPerf's Server scenario under LoadGen (bench/mlperf.py): queries of 100-700 pairs, once as the
  kit's ``columns`` JSON (``/predictions/<m>``) and once as Open Inference Protocol v2 binary
  tensors as tritonclient sends them (``/v2/models/<m>/infer``): the highest rate LoadGen calls
  VALID (p99 <= 60 ms), its p99 and pairs/s;
* single rows at concurrency 64 and 128-row ranking requests at concurrency 16 (closed loop,
  bench/load.py, on /predictions/<m>): requests and rows per second, p50 / p99;

and, for each, the CPU per query (request) of the front end and of the workers: TorchServe's
frontend JVM and its worker processes; the KServe door's scoring threads (named ``dlrm-score``)
as its workers, the rest of its processes (event loop, HTTP, gRPC) as its front end. Writes
doors.json, doors.md and run.json to results/<date>-doors/ (--out DIR).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from bench import mlperf
from bench.common import RANKING, ROOT, build_archive, frontend_pid, log, machine, make_body, make_kind, md_table
from bench.common import cpu_seconds, measure_load, run_dir, serving, write_report
from scripts.tsctl import free_port, post

DOORS = ("torchserve", "kserve")
SINGLE = (1, 64)  # rows per request, concurrency
RANKING_LOAD = (RANKING, 16)
MODEL = "doors"  # the archive's model name
IMAGE_MODEL = "/opt/dlrm/model"  # where the kit's image keeps its model's layout (Dockerfile)
SCORING_THREAD = "dlrm-score"  # the KServe door names its scoring threads so (dlrm_kserve.py)


# --- CPU per group of processes and threads -----------------------------------------------------------


def _ticks(path: Path) -> int:
    """utime + stime of a /proc stat file, in clock ticks (0 when it is gone)."""
    try:
        text = path.read_text()
    except OSError:
        return 0
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[11]) + int(fields[12])


def thread_cpu(pids: list[int], name: str) -> tuple[float, float]:
    """(CPU seconds of ``pids``' threads whose name starts with ``name``, CPU seconds of all their
    threads), from /proc/<pid>/task/<tid>/stat (live threads only: take both around a run)."""
    hz = os.sysconf("SC_CLK_TCK")
    named = total = 0
    for pid in pids:
        tasks = Path(f"/proc/{pid}/task")
        for task in tasks.iterdir() if tasks.is_dir() else ():
            try:
                comm = (task / "comm").read_text().strip()
            except OSError:
                continue
            t = _ticks(task / "stat")
            total += t
            named += t if comm.startswith(name) else 0
    return named / hz, total / hz


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (kserve's REST processes are spawned children)."""
    import psutil

    try:
        p = psutil.Process(pid)
        return [pid, *(c.pid for c in p.children(recursive=True))]
    except psutil.NoSuchProcess:
        return []


class Door:
    """A started door: its base URL, the model's name, and the CPU seconds of its front end and workers."""

    def __init__(self, kind: str, url: str, model: str, cpu):
        self.kind, self.url, self.model, self._cpu = kind, url, model, cpu

    def cpu(self) -> dict[str, float]:
        return self._cpu()


def torchserve_cpu(srv, model: str):
    def cpu() -> dict[str, float]:
        return {"frontend": cpu_seconds([frontend_pid(srv)]), "workers": cpu_seconds(srv.worker_pids(model))}

    return cpu


def kserve_cpu(pid: int):
    def cpu() -> dict[str, float]:
        named, total = thread_cpu(process_tree(pid), SCORING_THREAD)
        return {"frontend": total - named, "workers": named}

    return cpu


@contextlib.contextmanager
def start_door(
    kind: str, mar: Path, name: str, probe: bytes, home: Path, env: dict, image: str | None
) -> Iterator[Door]:
    """``kind``'s server on ``mar``, on free ports, ready (``probe`` scores 200); stopped on exit."""
    if kind == "torchserve" and image is None:
        with serving(home, mar.parent, {name: probe}, env) as srv:
            yield Door(kind, srv.url, name, torchserve_cpu(srv, name))
        return
    http, grpc = free_port(), free_port()
    log_file = home / f"{kind}.log"
    home.mkdir(parents=True, exist_ok=True)
    if image is None:
        cmd = [sys.executable, str(ROOT / "dlrm_kserve.py"), "--model-path", str(mar)]
        cmd += ["--http-port", str(http), "--grpc-port", str(grpc)]
    else:
        cmd = docker_command(kind, image, mar.parent.parent / "layout", http, grpc, env)
    log(f"starting the {kind} door: {' '.join(cmd)} (log {log_file})")
    with open(log_file, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env})
    try:
        url = f"http://127.0.0.1:{http}"
        wait_scoring(url, name, probe, proc, log_file)
        pid = proc.pid if image is None else container_pid(f"dlrm-doors-{kind}")
        yield Door(kind, url, name, kserve_cpu(pid) if kind == "kserve" else container_torchserve_cpu(pid))
    finally:
        if image is None:
            proc.send_signal(signal.SIGTERM)
        else:
            subprocess.run(["docker", "stop", "-t", "30", f"dlrm-doors-{kind}"], capture_output=True)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def docker_command(kind: str, image: str, layout: Path, http: int, grpc: int, env: dict) -> list[str]:
    """The kit's image running ``kind`` on ``layout`` (scripts/kserve_deploy.py's, mounted where the
    image's own model lies) as a pod runs it: read-only root, uid 1000, /tmp writable; on the host's
    network (no proxy between the client and the door), every port free."""
    cmd = ["docker", "run", "--rm", "--name", f"dlrm-doors-{kind}", "--network", "host", "--read-only"]
    cmd += ["--tmpfs", "/tmp", "--user", "1000:1000", "-v", f"{layout}:{IMAGE_MODEL}:ro"]
    if kind == "torchserve":  # enable_envvars_config: TS_<PROPERTY> overrides the layout's ports
        env = {**env, "TS_INFERENCE_ADDRESS": f"http://127.0.0.1:{http}"}
        env.update(TS_MANAGEMENT_ADDRESS=f"http://127.0.0.1:{free_port()}", TS_GRPC_INFERENCE_PORT=str(grpc))
        env.update(TS_METRICS_ADDRESS=f"http://127.0.0.1:{free_port()}", TS_GRPC_MANAGEMENT_PORT=str(free_port()))
    for k, v in env.items():
        cmd += ["-e", f"{k}={v}"]
    if kind == "kserve":
        mar = f"{IMAGE_MODEL}/model-store/{MODEL}.mar"
        return [*cmd, image, "kserve", "--model-path", mar, "--http-port", str(http), "--grpc-port", str(grpc)]
    return [*cmd, image]


def container_pid(name: str) -> int:
    out = subprocess.run(["docker", "inspect", "-f", "{{.State.Pid}}", name], capture_output=True, text=True)
    return int(out.stdout.strip() or 0)


def container_torchserve_cpu(pid: int):
    """TorchServe in a container: the JVM is the front end, its Python processes the workers."""
    import psutil

    def cpu() -> dict[str, float]:
        groups: dict[str, list[int]] = {"frontend": [], "workers": []}
        for p in process_tree(pid):
            with contextlib.suppress(psutil.NoSuchProcess):
                name = psutil.Process(p).name()
                if name == "java":
                    groups["frontend"].append(p)
                elif name.startswith("python"):
                    groups["workers"].append(p)
        return {k: cpu_seconds(v) for k, v in groups.items()}

    return cpu


def wait_scoring(url: str, model: str, probe: bytes, proc: subprocess.Popen, log_file: Path, timeout: float = 600):
    """Until ``probe`` POSTed to /predictions/<model> answers 200; the door's log tail if it exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_file.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"the door exited ({proc.returncode}) before it was ready:\n{tail}")
        with contextlib.suppress(OSError):
            status, _, _ = post(f"{url}/predictions/{model}", probe, timeout=30)
            if status == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(f"{url}: {model} did not score within {timeout:.0f} s ({log_file})")


# --- the measurements -------------------------------------------------------------------------------


def per_query(door: Door, before: dict[str, float], n: int) -> dict[str, float]:
    """CPU ms per query (request) of the door's front end and workers since ``before``."""
    after = door.cpu()
    return {k: round((after[k] - before[k]) / max(1, n) * 1e3, 2) for k in before}


def loadgen(door: Door, cfg, form: str, args, loadgen_dir: Path) -> dict:
    """The highest VALID rate of ``form`` on ``door`` (bench/mlperf.py's search, decided as the
    Server scenario decides an undecided rate)."""
    pool = mlperf.query_pool(cfg, args.queries, form=form)
    url = door.url + mlperf.path(form, door.model)
    tag = f"{door.kind}-{form}"
    mlperf.run(url, pool, args.start_qps / 2, args.warm_up, min_queries=1, max_seconds=args.warm_up)  # warm

    def run_once(qps: float, min_queries: int, max_seconds: float) -> dict:
        before = door.cpu()
        r = mlperf.run(url, pool, qps, args.seconds, min_queries, max_seconds, loadgen_dir / f"{tag}-{qps:.2f}qps.txt")
        r["cpu_ms_per_query"] = per_query(door, before, r["queries"])
        log(
            f"  {tag} {qps:.2f} q/s: {'VALID' if r['valid'] else 'INVALID'}, p99 {r.get('p99_ms')} ms, "
            f"{r['pairs_per_s']:,} pairs/s, {r['errors']} failed, CPU ms/query {r['cpu_ms_per_query']}"
        )
        return r

    def run_at(qps: float) -> dict:
        return mlperf.decide(run_once, qps, run_once(qps, args.min_queries, args.max_seconds), args.max_seconds, 120)

    found = mlperf.search(run_at, args.start_qps, steps=args.steps, floor=args.min_queries / args.max_seconds)
    best = found["best"] or {}
    return {
        "form": form,
        "valid_qps": best.get("target_qps", 0),
        "p99_ms": best.get("p99_ms"),
        "pairs_per_s": best.get("pairs_per_s", 0),
        "cpu_ms_per_query": best.get("cpu_ms_per_query"),
        "runs": found["runs"],
    }


def closed_loop(door: Door, cfg, kind, concurrency: int, seconds: float) -> dict:
    """Closed-loop load of ``kind`` requests (1: single rows; RANKING: 128-row ranking) on /predictions."""
    rng = random.Random(3)
    pool = [make_body(cfg, rng, 1, "instances") if kind == 1 else make_kind(kind, cfg, rng) for _ in range(64)]
    rows = 1 if kind == 1 else 128

    def probe():
        before = door.cpu()
        return lambda out: {"cpu_ms_per_request": per_query(door, before, out["requests"])}

    r = measure_load(f"{door.url}/predictions/{door.model}", pool, rows, concurrency, seconds, probe)
    r = {k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()}
    r.update(requests_per_s=round(r["requests_per_s"]), rows_per_s=round(r["rows_per_s"]))
    log(
        f"  {door.kind} {'single rows' if kind == 1 else 'ranking'} at concurrency {concurrency}: "
        f"{r['requests_per_s']:,} req/s, {r['rows_per_s']:,} rows/s, p99 {r['p99_ms']} ms, {r['errors']} failed"
    )
    return {"kind": "single" if kind == 1 else "ranking", "concurrency": concurrency, **r}


def measure_door(kind: str, mar: Path, cfg, env: dict, args, tmp: Path, loadgen_dir: Path) -> dict:
    probe = make_body(cfg, random.Random(0), 1, "instances")
    t0 = time.perf_counter()
    with start_door(kind, mar, mar.stem, probe, tmp / f"home-{kind}", env, args.image) as door:
        ready_s = round(time.perf_counter() - t0, 1)
        log(f"{kind}: ready in {ready_s} s")
        row: dict = {"door": kind, "ready_s": ready_s}
        row["loadgen"] = [loadgen(door, cfg, form, args, loadgen_dir) for form in mlperf.FORMS]
        row["closed_loop"] = [closed_loop(door, cfg, k, c, args.load_seconds) for k, c in (SINGLE, RANKING_LOAD)]
    return row


# --- the report ---------------------------------------------------------------------------------------


def ratio(a, b) -> str:
    return f"{a / b:.2f}" if a and b else ""


def markdown(report: dict) -> list[str]:
    m = report["machine"]
    by = {r["door"]: r for r in report["rows"]}
    lines = [
        "# The two front doors side by side",
        "",
        f"{m['cpu']}, {m['available_cpus']} CPUs, {m['isa']}; load average at start {m['load_average_at_start']}. "
        f"Config {report['config']}, one archive, both doors {report['how']}; one client (bench/doors.py), "
        "one door at a time. LoadGen: MLPerf's Server scenario, p99 <= 60 ms, queries of 100-700 pairs, "
        f"runs of at least {report['seconds']:g} s and {report['min_queries']} queries. CPU ms per query: "
        "the front end (TorchServe's JVM; the KServe door's event loop, HTTP and gRPC) and the workers "
        "(TorchServe's worker processes; the KServe door's scoring threads).",
        "",
    ]
    head = ["workload", *(f"{d}" for d in by), "kserve / torchserve"]
    rows = []
    for i, form in enumerate(mlperf.FORMS):
        cells = [by[d]["loadgen"][i] for d in by]
        rows.append(
            [f"LoadGen `{form}`: VALID q/s (p99 ms)"]
            + [f"{c['valid_qps']} ({c['p99_ms']})" for c in cells]
            + [ratio(*(c["valid_qps"] for c in cells[::-1]))]
        )
        rows.append([f"LoadGen `{form}`: pairs/s"] + [f"{c['pairs_per_s']:,}" for c in cells] + [""])
        rows.append(
            [f"LoadGen `{form}`: CPU ms/query front end / workers"]
            + [
                f"{c['cpu_ms_per_query']['frontend']} / {c['cpu_ms_per_query']['workers']}"
                if c.get("cpu_ms_per_query")
                else ""
                for c in cells
            ]
            + [""]
        )
    for i, title in enumerate(("single rows, concurrency 64", "128-row ranking, concurrency 16")):
        cells = [by[d]["closed_loop"][i] for d in by]
        rows.append(
            [f"{title}: rows/s (p99 ms)"]
            + [f"{c['rows_per_s']:,} ({c['p99_ms']})" for c in cells]
            + [ratio(*(c["rows_per_s"] for c in cells[::-1]))]
        )
        rows.append(
            [f"{title}: CPU ms/request front end / workers"]
            + [f"{c['cpu_ms_per_request']['frontend']} / {c['cpu_ms_per_request']['workers']}" for c in cells]
            + [""]
        )
    rows.append(["ready after start (s)", *(by[d]["ready_s"] for d in by), ""])
    lines += md_table(head, rows)
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="model-config.criteo.yaml")
    ap.add_argument("--image", help="run both doors from this image (the kit's, `make image`); default: this install")
    ap.add_argument("--doors", nargs="+", default=list(DOORS), choices=DOORS)
    ap.add_argument(
        "--seconds", type=float, default=25.0, help="LoadGen's min duration per rate (default: %(default)s)"
    )
    ap.add_argument("--max-seconds", type=float, default=90.0, help="LoadGen's max duration per rate")
    ap.add_argument("--min-queries", type=int, default=mlperf.MIN_QUERIES)
    ap.add_argument("--steps", type=int, default=6, help="rates tried per door and form (default: %(default)s)")
    ap.add_argument("--start-qps", type=float, default=30.0, help="the search's first rate (default: %(default)s)")
    ap.add_argument("--queries", type=int, default=256, help="distinct LoadGen queries (default: %(default)s)")
    ap.add_argument("--warm-up", type=float, default=20.0, help="seconds of queries before each search")
    ap.add_argument("--load-seconds", type=float, default=20.0, help="seconds per closed-loop load")
    ap.add_argument("--out", help="output folder; default: results/<date>-doors/")
    args = ap.parse_args(argv)
    from dlrmkit.config import DLRMConfig

    cfg_path = (Path(args.config) if Path(args.config).is_file() else ROOT / args.config).resolve()
    out = run_dir(__file__, "doors", "The two front doors side by side", args.out, argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started, load_at_start = time.perf_counter(), machine()["load_average"]
    rows = []
    with tempfile.TemporaryDirectory(prefix="dlrm-doors-") as tmp:
        # the layout a pod mounts (scripts/kserve_deploy.py): its model store holds the archive
        store, layout = Path(tmp) / "store", Path(tmp) / "layout"
        _, doc, env = build_archive(cfg_path, store, MODEL, {})
        mar = store / f"{MODEL}.mar"
        subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "kserve_deploy.py"), "layout", "--out", str(layout)]
            + ["--config", str(store / f"{MODEL}.yaml"), "--mar", str(mar), "--model-name", MODEL]
            + ["--mount", IMAGE_MODEL, "--port", "8080"],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        os.chmod(tmp, 0o755)  # a container's uid 1000 reads the layout
        cfg = DLRMConfig.from_dict(doc.get("handler"))
        for kind in args.doors:
            rows.append(measure_door(kind, mar, cfg, env, args, Path(tmp), out / "loadgen"))
    report = {
        "machine": machine(),
        "config": cfg_path.name,
        "how": f"from {args.image}" if args.image else "from this install",
    }
    report["machine"]["load_average_at_start"] = load_at_start
    report.update(
        seconds=args.seconds, min_queries=args.min_queries, rows=rows, wall_s=round(time.perf_counter() - started)
    )
    write_report(out / "doors", report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
