"""The measuring library every bench/ scenario imports: requests, archives, servers, CPU, reports.

    from bench.common import ROOT, build_archive, serving, measure_load, write_report

- requests: ``make_kind`` (single rows, 128-row instances / ranking / columns forms, raw Criteo
  lines, v2 binary), ``raw_caller`` (one forward of a model on random rows);
- archives: ``build_archive`` (scripts/build_mar.py from a config with an overlay: a variant),
  ``load_served`` (the archive's model in this process, as a worker serves it: dense half at the
  archive's precision), ``HostForward`` (that model's raw forward on every CPU);
- servers: ``serving`` (a private TorchServe on free ports, stopped on exit);
- load and CPU: ``measure_load`` (closed loop, bench/load.py), ``cpu_seconds``, ``frontend_pid``,
  ``jit_cpu_seconds``, ``jit_cpu_since``, ``metric_value``;
- processes: ``memory_mb`` (RSS / PSS / USS), ``open_fds``;
- reports: ``run_dir`` (a run's own folder, results/<date>-<slug>/, with its run.json),
  ``write_report`` (OUT.json, OUT.md, and OUT.png when given a plot), ``machine`` (the CPU model
  and ISA every figure is named with).

Nothing here imports a scenario script: scenarios import this, never each other.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import os
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

from bench.load import percentile, run_load  # noqa: E402, F401  (percentile: for the scenarios)
from scripts.tsctl import Server, get  # noqa: E402

RANKING_ROWS = 128
RANKING = "ranking"  # the 128-row ranking form, beside the 128-row instances form
COLUMNS = "columns"  # the same 128 rows as RANKING: the context plus the candidates as columns
COLUMNS_ALL = "columns-all"  # the same 128 rows as instances (every feature), as columns
CRITEO_TSV = "criteo-tsv"  # 128 raw Criteo lines (handler.raw_input: criteo_tsv)
V2_BINARY = "v2-binary"  # 128 rows as Open Inference Protocol v2 binary tensors


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --- requests ------------------------------------------------------------------------------------


def make_instance(cfg, rng: random.Random) -> dict:
    """A Criteo-like row: every feature present, one id each (ids within the table)."""
    return {
        "dense": [round(rng.uniform(-2, 2), 4) for _ in range(cfg.num_dense_features)],
        "sparse": {
            "keys": list(cfg.sparse_features),
            "values": [rng.randrange(n) for n in cfg.num_embeddings],
            "lengths": [1] * cfg.num_features,
        },
    }


def _context(cfg, rng, half: int) -> dict:
    user = make_instance(cfg, rng)
    sparse = {
        "keys": list(cfg.sparse_features[:half]),
        "values": user["sparse"]["values"][:half],
        "lengths": [1] * half,
    }
    return {"dense": user["dense"], "sparse": sparse}


def make_body(cfg, rng, rows: int, form: str = "instances") -> bytes:
    """``rows`` random rows in ``form``: ``instances`` (one row alone when rows == 1);
    ``ranking`` (one user: the dense and the first half of the sparse features once in the
    context, the other half per candidate); ``columns`` (the ranking rows, the candidates as
    columns); ``columns-all`` (every feature a column, no context)."""
    half = cfg.num_features // 2
    if form == "instances":
        if rows == 1:
            return json.dumps(make_instance(cfg, rng)).encode()
        return json.dumps({"instances": [make_instance(cfg, rng) for _ in range(rows)]}).encode()
    if form == RANKING:
        keys, tables = list(cfg.sparse_features[half:]), cfg.num_embeddings[half:]
        candidates = [
            {"sparse": {"keys": keys, "values": [rng.randrange(n) for n in tables], "lengths": [1] * len(keys)}}
            for _ in range(rows)
        ]
        return json.dumps({"context": _context(cfg, rng, half), "candidates": candidates}).encode()
    first = half if form == COLUMNS else 0
    sparse = {
        f: {"values": [rng.randrange(n) for _ in range(rows)]}
        for f, n in zip(cfg.sparse_features[first:], cfg.num_embeddings[first:])
    }
    if form == COLUMNS:
        return json.dumps({"context": _context(cfg, rng, half), "columns": {"sparse": sparse}}).encode()
    dense = [make_instance(cfg, rng)["dense"] for _ in range(rows)]
    return json.dumps({"columns": {"dense": dense, "sparse": sparse}}).encode()


def rows_of(kind) -> int:
    """Rows per request of a request kind: an int (instances form) or a form's name."""
    return kind if isinstance(kind, int) else RANKING_ROWS


def form_of(kind) -> str:
    return kind if isinstance(kind, str) else "instances"


def make_kind(kind, cfg, rng):
    """One request body of ``kind`` (see rows_of); a Criteo TSV body is a str, as TorchServe hands it over."""
    if kind == V2_BINARY:
        return v2_binary(cfg, rng, RANKING_ROWS)
    if kind == CRITEO_TSV:
        line = lambda: "\t".join(  # noqa: E731
            [str(rng.randrange(2))]
            + [str(rng.randrange(-3, 1000)) for _ in range(13)]
            + [format(rng.getrandbits(32), "08x") for _ in range(26)]
        )
        return "\n".join(line() for _ in range(RANKING_ROWS)) + "\n"
    return make_body(cfg, rng, rows_of(kind), form_of(kind))


def v2_binary(cfg, rng, rows: int) -> bytes:
    """One request as Open Inference Protocol v2 binary tensors (tritonclient's default): a JSON
    header (the same for every request of one shape), then the tensors' bytes."""
    import numpy as np

    dense = np.array([[rng.uniform(-2, 2) for _ in range(cfg.num_dense_features)] for _ in range(rows)], np.float32)
    ids = {
        f: np.array([rng.randrange(n) for _ in range(rows)], np.int64)
        for f, n in zip(cfg.sparse_features, cfg.num_embeddings)
    }
    tensors = [("dense", "FP32", [rows, cfg.num_dense_features], dense)]
    tensors += [(f, "INT64", [rows], v) for f, v in ids.items()]
    raws = [a.astype(a.dtype.newbyteorder("<")).tobytes() for *_, a in tensors]
    inputs = [
        {"name": n, "datatype": t, "shape": s, "parameters": {"binary_data_size": len(r)}}
        for (n, t, s, _), r in zip(tensors, raws)
    ]
    header = json.dumps({"inputs": inputs, "parameters": {"binary_data_output": True}}).encode()
    return header + b"".join(raws)


# --- the model in this process -------------------------------------------------------------------


def random_instance(rng: random.Random, cfg) -> dict:
    """One random multi-hot instance: a random subset of the features, 0-4 ids each (soak, faults)."""
    n, tables = cfg.num_features, cfg.num_embeddings
    keys = rng.sample(range(n), rng.randint(0, n))
    bags = {cfg.sparse_features[f]: [rng.randrange(tables[f]) for _ in range(rng.randint(0, 4))] for f in keys}
    return {
        "dense": [round(rng.uniform(-2, 2), 4) for _ in range(cfg.num_dense_features)],
        "sparse": {
            "keys": list(bags),
            "values": [i for b in bags.values() for i in b],
            "lengths": [len(b) for b in bags.values()],
        },
    }


def random_body(rng: random.Random, cfg, rows: int) -> bytes:
    """``rows`` random_instance rows as one request: the instance alone, or ``instances``."""
    insts = [random_instance(rng, cfg) for _ in range(rows)]
    return json.dumps(insts[0] if rows == 1 else {"instances": insts}).encode()


def expected_scores(config, weights: Path, bodies: list[bytes]) -> list[list[float]]:
    """Each body scored alone in this process, through the handler's own core (parse -> collate
    -> score) and the archive's weights: what a correct server must answer under any load."""
    from dlrmkit.batch import collate, scores
    from dlrmkit.forms import RequestParser
    from dlrmkit.model import DLRMFactory

    model, parser = DLRMFactory(config).load(weights), RequestParser(config)
    out = []
    for body in bodies:
        batch, errors = collate([parser.parse(body)], config)
        if errors:
            raise ValueError(f"not a good request: {errors[0]}")
        out.append(scores(model, batch, config)[0])
    return out


def same_scores(got: list[float], expected: list[float]) -> bool:
    """Equal to 1e-5: batching changes the order of float sums, never more."""
    return len(got) == len(expected) and all(abs(a - b) <= 1e-5 for a, b in zip(got, expected))


def timed_calls(fn, min_s: float, max_calls: int = 2000) -> list[float]:
    """Seconds of each call of ``fn`` over ``min_s`` (at most ``max_calls``), after 3 warm-up calls."""
    for _ in range(3):
        fn()
    out, t_end = [], time.perf_counter() + min_s
    while time.perf_counter() < t_end and len(out) < max_calls:
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def raw_caller(cfg, b: int, rng: random.Random, bags: list[int] | None = None):
    """``caller(model)``: a function that runs one forward of ``model`` on b random rows, one id
    per feature, or with ``bags`` (ids per row, per feature: MLPerf's multi-hot) that many."""
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    bodies = [make_instance(cfg, rng) for _ in range(b)]
    dense = torch.tensor([i["dense"] for i in bodies], dtype=torch.float32)
    if bags is None:
        values = torch.tensor([i["sparse"]["values"] for i in bodies], dtype=torch.int64).t().reshape(-1)
        lengths = torch.ones(cfg.num_features * b, dtype=torch.int64)
    else:  # key-major: feature f's b x bags[f] ids, then the next feature's
        values = torch.tensor([rng.randrange(n) for n, k in zip(cfg.num_embeddings, bags) for _ in range(b * k)])
        lengths = torch.tensor([k for k in bags for _ in range(b)], dtype=torch.int64)
    kjt = KeyedJaggedTensor(keys=list(cfg.sparse_features), values=values, lengths=lengths)

    def caller(m):
        def call():
            with torch.inference_mode():
                return m(dense, kjt)

        return call

    return caller


def load_served(cfg, model_dir: Path, freeze: bool = True):
    """The model of an unpacked archive (``model_dir``: dlrm.pt and whatever the archive carries)
    as a CPU worker serves it: the dense half at ``handler.dense_precision``
    (dlrmkit.dense.prepare, with the archive's calibration inputs), fp32 dense parts jit-frozen
    (``freeze``), the allocator as the worker sets it (handler.keep_freed_memory); a host-forward
    reference of a reduced-precision archive thus runs what is served.
    Returns (model, what runs: dense.prepare's line)."""
    import torch

    from dlrmkit.model import DLRMFactory
    from dlrmkit import dense
    from dlrmkit.malloc import keep_freed

    if cfg.threads.keep_freed_memory:
        keep_freed()
    factory = DLRMFactory(cfg)
    model = factory.load(Path(model_dir) / "dlrm.pt")
    model, what = dense.prepare(model, cfg, model_dir, [torch.device("cpu")])
    if freeze and what.startswith("fp32"):
        factory.freeze_dense(model)
    return model, what


def unpack(mar: Path, into: Path) -> Path:
    """The archive's files (weights, calibration inputs) in ``into``."""
    subprocess.run(["unzip", "-q", "-o", str(mar), "-d", str(into)], check=True)
    return into


def _host_child(conn, cfg_path: str, model_dir: str | None, cpu: int, bags: list[int] | None = None) -> None:
    """One single-threaded process on one CPU holding the served model (as a worker loads it),
    or with no ``model_dir`` stock torchrec's fp32 model of the config (its DLRM / DLRM_DCN with an
    unfused EmbeddingBagCollection, eager: what torchrec alone runs, no kit, no server)."""
    import torch

    from dlrmkit.model import DLRMFactory
    from dlrmkit.config import DLRMConfig

    os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)
    cfg = DLRMConfig.from_yaml(cfg_path)
    model = load_served(cfg, Path(model_dir))[0] if model_dir else DLRMFactory(cfg).random().eval()
    callers = {}
    conn.send("ready")
    while (msg := conn.recv()) is not None:
        batch, seconds = msg
        if batch not in callers:
            callers[batch] = raw_caller(cfg, batch, random.Random(cpu), bags)(model)
            callers[batch]()
        t = timed_calls(callers[batch], seconds)
        conn.send((batch * len(t), sum(t)))


class HostForward:
    """The served model's raw forward on every CPU this process may use (dlrmkit.cpus): N
    processes x 1 thread (each pinned to one CPU) and ``model`` in this process with N threads;
    ``measure`` runs both back to back and the better is the host's limit. With ``model_dir``
    and ``model`` None: stock torchrec's fp32 forward of the config, N processes x 1 thread only
    (issue 29's anchor for the DLRMv2 target). Rows carry one id per feature, or with ``bags``
    that many ids per feature (raw_caller): a multi-hot config is measured on its queries' shape."""

    def __init__(self, cfg_path: Path, model_dir: Path | None, model, cfg, bags: list[int] | None = None):
        import multiprocessing

        from dlrmkit.cpus import available_cpus

        self.cpus = sorted(os.sched_getaffinity(0))[: available_cpus()]
        self.model, self.cfg, self.bags = model, cfg, bags
        ctx = multiprocessing.get_context("spawn")  # no fork of a process holding torch threads
        self.conns, self.procs = [], []
        for cpu in self.cpus:
            parent, child = ctx.Pipe()
            args = (child, str(cfg_path), model_dir and str(model_dir), cpu, bags)
            p = ctx.Process(target=_host_child, args=args, daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        for c in self.conns:
            if c.recv() != "ready":
                raise RuntimeError("a host-forward process failed to load the model")

    def measure(self, batch: int, seconds: float) -> dict:
        import torch

        n = len(self.cpus)
        for c in self.conns:  # all start together
            c.send((batch, seconds))
        procs = sum(rows / s for rows, s in (c.recv() for c in self.conns))
        threads = 0.0
        if self.model is not None:
            before = torch.get_num_threads()
            torch.set_num_threads(n)
            try:
                t = timed_calls(raw_caller(self.cfg, batch, random.Random(7), self.bags)(self.model), seconds)
            finally:
                torch.set_num_threads(before)
            threads = batch * len(t) / sum(t)
        best = max(procs, threads)
        return {
            "batch": batch,
            "cpus": n,
            "processes_rows_per_s": round(procs),
            "threads_rows_per_s": round(threads),
            "rows_per_s": round(best),
            "rows_per_s_per_core": round(best / n),
            "best": f"{n} processes x 1 thread" if procs >= threads else f"1 process x {n} threads",
        }

    def close(self) -> None:
        for c in self.conns:
            c.send(None)
        for p in self.procs:
            p.join(timeout=10)


# --- archives and servers ------------------------------------------------------------------------


def overlay(doc: dict, items: dict) -> tuple[dict, dict]:
    """A model-config document with ``items`` applied, and the environment they ask for:
    ``handler.KEY`` goes into the handler section, ``workers`` sets minWorkers = maxWorkers, an
    upper-case key (``OMP_NUM_THREADS``) is an environment variable of the server, any other key
    is a TorchServe per-model key (``batchSize``, ``maxBatchDelay``, ...).

    >>> overlay({"batchSize": 64, "handler": {}}, {"handler.dense_precision": "int8", "workers": 1})[0]
    {'batchSize': 64, 'handler': {'dense_precision': 'int8'}, 'minWorkers': 1, 'maxWorkers': 1}
    """
    doc = json.loads(json.dumps(doc))
    env = {}
    for key, value in items.items():
        if key.startswith("handler."):
            doc.setdefault("handler", {})[key.removeprefix("handler.")] = value
        elif key == "workers":
            doc["minWorkers"] = doc["maxWorkers"] = value
        elif key.isupper():
            env[key] = str(value)
        else:
            doc[key] = value
    return doc, env


def parse_variant(text: str) -> tuple[str, dict]:
    """``NAME:k=v,k=v`` -> (NAME, {k: v}), values read as YAML (``batchSize=1`` -> 1)."""
    import yaml

    name, _, rest = text.partition(":")
    items = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
    return name or "shipped", {k: yaml.safe_load(v) for k, v in items.items()}


def build_archive(
    cfg_path: Path, store: Path, name: str, items: dict | None = None, calibrate: Path | None = None
) -> tuple[Path, dict, dict]:
    """``cfg_path``'s archive with ``items`` overlaid (see ``overlay``) as ``store/name.mar``
    (``calibrate``: build_mar.py's --calibrate file, for an int8 dense half's static scales).
    Returns (the config file it was built from, that document, the environment asked for)."""
    import yaml

    store.mkdir(parents=True, exist_ok=True)
    doc, env = overlay(yaml.safe_load(Path(cfg_path).read_text()), items or {})
    source = store / f"{name}.yaml"
    source.write_text(yaml.safe_dump(doc, sort_keys=False))
    log(f"building {name}.mar from {Path(cfg_path).name}" + (f" with {items}" if items else ""))
    cmd = [sys.executable, str(ROOT / "scripts" / "build_mar.py"), "--config", str(source)]
    cmd += ["--output-dir", str(store), "--model-name", name, "--force"]
    if calibrate and doc.get("handler", {}).get("dense_precision") == "int8":
        cmd += ["--calibrate", str(calibrate)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return source, doc, env


@contextlib.contextmanager
def serving(
    home: Path, store: Path, models: dict[str, bytes], env: dict | None = None, timeout: float = 600, cpus=None, **kw
):
    """A private TorchServe on free ports serving ``store``'s ``models`` (name -> the probe body
    that must score before it counts as ready), with ``env`` set for it and its workers, pinned to
    ``cpus`` (a CPU set; the load generator is not); stopped on exit. ``kw`` goes to tsctl.Server
    (``overrides=``, ``properties=``)."""
    overrides = {"load_models": ",".join(f"{m}={m}.mar" for m in models), **kw.pop("overrides", {})}
    srv = Server.on_free_ports(home, model_store=store, overrides=overrides, **kw)
    saved, mine = {k: os.environ.get(k) for k in env or {}}, os.sched_getaffinity(0)
    os.environ.update(env or {})
    os.sched_setaffinity(0, cpus or mine)  # the frontend and its workers inherit both
    log(f"starting TorchServe for {', '.join(models)} (logs in {srv.log_dir})")
    try:
        srv.start()
    finally:  # the server has its environment: this process gets its own back
        os.sched_setaffinity(0, mine)
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    try:
        for m, probe in models.items():
            srv.wait_ready(m, probe, timeout=timeout)
        yield srv
    finally:
        srv.stop()


# --- load and CPU accounting ---------------------------------------------------------------------


def request_loop(pool: list[bytes]):
    """``next_request`` for run_load, cycling through ``pool``, and a list whose [0] counts the
    answers other than 200."""
    errors = [0]

    def next_request(i):
        def check(status, _answer):
            errors[0] += status != 200

        return pool[i % len(pool)], check

    return next_request, errors


def measure_load(url: str, pool: list[bytes], rows: int, concurrency: int, duration: float, probe=None) -> dict:
    """A 2 s warm-up, then ``duration`` s of closed-loop load: requests answered, req/s, rows/s,
    p50, p90, p99, errors and the load generator's share of a CPU. ``probe()`` (counters read
    around the measured run: CPU, the server's metrics), called just before it, returns a
    function called just after it with those figures, whose dict joins them."""
    next_request, errors = request_loop(pool)
    asyncio.run(run_load(url, next_request, concurrency, min(2.0, duration), 100_000))
    errors[0] = 0
    after = probe() if probe else lambda _: {}
    res = asyncio.run(run_load(url, next_request, concurrency, duration, 2_000_000))
    out = {
        "requests": res.answered,
        "requests_per_s": res.answered / res.wall_s,
        "rows_per_s": res.answered * rows / res.wall_s,
        **{f"p{q}_ms": res.percentile(q) for q in (50, 90, 99)},
        "errors": errors[0] + res.transport_errors,
        "client_cpu_share": res.client_cpu_s / res.wall_s,
    }
    return out | after(out)


def frontend_pid(srv: Server) -> int:
    return int((srv.home / "tmp" / ".model_server.pid").read_text().split()[0])


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of ``pids`` and their waited-for children."""
    import psutil  # comes with torchserve

    total = 0.0
    for pid in pids:
        t = psutil.Process(pid).cpu_times()
        total += t.user + t.system + t.children_user + t.children_system
    return total


def memory_mb(pids: list[int], kinds=("rss",)) -> dict[str, float]:
    """MB per process of ``pids`` (mean): RSS, PSS (shared pages split among the processes mapping
    them), USS (pages only that process holds: what one more worker costs)."""
    import psutil

    mem = [psutil.Process(p).memory_full_info() for p in pids]
    return {k: round(sum(getattr(m, k) for m in mem) / max(1, len(mem)) / 2**20, 1) for k in kinds}


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def cpu_snapshot(procs: dict[str, list[int]]) -> dict[str, float] | None:
    """``cpu_seconds`` per group of pids, or None when one of them is gone (a replaced worker)."""
    import psutil

    try:
        return {k: cpu_seconds(v) for k, v in procs.items()}
    except (psutil.NoSuchProcess, FileNotFoundError):
        return None


def jit_cpu_seconds(pid: int) -> dict[int, float]:
    """CPU seconds of each JIT compiler thread (C1/C2) of a JVM, by thread id. The JVM starts
    and ends these threads as needed: one that ended between two calls is not counted."""
    import psutil

    out = {}
    for t in psutil.Process(pid).threads():
        try:
            name = Path(f"/proc/{pid}/task/{t.id}/comm").read_text()
        except OSError:  # ended meanwhile, or no /proc (not Linux)
            continue
        if name.startswith(("C1 CompilerThre", "C2 CompilerThre")):
            out[t.id] = t.user_time + t.system_time
    return out


def jit_cpu_since(pid: int, before: dict[int, float]) -> float:
    """CPU seconds the JVM's JIT compiler threads spent since ``before`` (a ``jit_cpu_seconds``
    reading); a thread started since counts from zero."""
    return sum(t - before.get(tid, 0.0) for tid, t in jit_cpu_seconds(pid).items())


def metric_value(srv: Server, model: str, name: str) -> float:
    """A model's counter from TorchServe's Prometheus text (0 if absent, e.g. for echo)."""
    import re

    _, body, _ = get(f"{srv.metrics_url}/metrics")
    m = re.search(rf'^{name}{{[^}}]*ModelName="{model}"[^}}]*}} ([0-9.eE+-]+)$', body.decode(), re.M)
    return float(m.group(1)) if m else 0.0


# --- the machine's limit -------------------------------------------------------------------------

# int8 multiply-accumulates per cycle per core at the ISA's peak (the instruction's MACs times how many
# the core starts per cycle): AMX's TDPBUSD, 16x16x64 MACs in 16 cycles (Intel's Optimization Reference
# Manual, "Intel AMX"); AVX-512 VNNI's VPDPBUSD on a zmm, 64 MACs, two per cycle on a core with two
# 512-bit FMA units (Intel Xeon Scalable) and one on AMD Zen 4 (512-bit ops on 256-bit units);
# AVX-VNNI on a ymm, 32 MACs, two per cycle; AVX2 without VNNI, VPMADDUBSW + VPMADDWD + VPADDD for 32
# MACs on a ymm, about 32 per cycle at two of each per cycle.
INT8_MACS_PER_CYCLE = (
    ("amx_int8", 1024, "AMX (TDPBUSD)"),
    ("avx512_vnni", 128, "AVX-512 VNNI, 2 x VPDPBUSD zmm per cycle (Xeon; Zen 4: 1 per cycle, half this)"),
    ("avx_vnni", 64, "AVX-VNNI, 2 x VPDPBUSD ymm per cycle"),
    ("avx2", 32, "AVX2 without VNNI (VPMADDUBSW + VPMADDWD + VPADDD)"),
)


def dense_macs_per_row(cfg) -> int:
    """Multiply-accumulates of the dense half for one row: the bottom MLP, the interaction (torchrec's
    pairwise dots of the F+1 vectors, or DCN's low-rank cross layers: V then W, each in x rank) and
    the over arch. The embedding lookups are memory, not MACs; biases and activations are left out.

    >>> from types import SimpleNamespace as C
    >>> dense_macs_per_row(C(num_dense_features=2, dense_arch_layer_sizes=[4, 3], embedding_dim=3,
    ...     sparse_features=["a", "b"], interaction="dot", over_arch_layer_sizes=[5, 1]))
    64
    """
    mlp = lambda sizes: sum(a * b for a, b in zip(sizes, sizes[1:]))  # noqa: E731
    d, f = cfg.embedding_dim, len(cfg.sparse_features) + 1  # the dense arch's output is one more vector
    macs = mlp([cfg.num_dense_features, *cfg.dense_arch_layer_sizes])
    if cfg.interaction == "dcn":
        width = f * d
        macs += cfg.dcn_num_layers * 2 * width * cfg.dcn_low_rank_dim
    elif cfg.interaction == "dot":
        pairs = f * (f - 1) // 2
        width = d + pairs
        macs += pairs * d
    else:
        raise ValueError(f"dense_macs_per_row: interaction {cfg.interaction!r} is not counted")
    return macs + mlp([width, *cfg.over_arch_layer_sizes])


def clock_mhz(cpuinfo: str | Path = "/proc/cpuinfo") -> float | None:
    """The clock /proc/cpuinfo reports (under KVM the host's nominal clock; a turbo may run above it)."""
    try:
        line = next(ln for ln in Path(cpuinfo).read_text().splitlines() if ln.startswith("cpu MHz"))
    except (OSError, StopIteration):
        return None
    return float(line.partition(":")[2])


def int8_peak(flags: set[str], mhz: float | None) -> dict | None:
    """The fastest int8 path the CPU has: {isa, macs_per_cycle, macs_per_s} per core at ``mhz``."""
    for flag, per_cycle, isa in INT8_MACS_PER_CYCLE:
        if flag in flags and mhz:
            return {"isa": isa, "macs_per_cycle": per_cycle, "mhz": mhz, "macs_per_s": per_cycle * mhz * 1e6}
    return None


# --- reports -------------------------------------------------------------------------------------


def machine() -> dict:
    """The CPU every figure is named with: model name (lscpu), the CPUs this process may use,
    its ISA (the flags the precisions care about) and what torch's kernels may use of it
    (``isa_served``: capped at AVX2 where ATen runs at AVX2; dlrmkit.dense.cpu_flags)."""
    from dlrmkit.cpus import available_cpus
    from dlrmkit.dense import cpu_flags, isa_summary

    try:
        lines = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines()
        name = next(ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        name = platform.processor() or platform.machine()
    isa, served = isa_summary(cpu_flags(capability="AVX512")), isa_summary()
    load = [round(x, 2) for x in os.getloadavg()]  # the shared machine's other work, 1/5/15 min
    return {
        "cpu": name,
        "cpus": os.cpu_count(),
        "available_cpus": available_cpus(),
        "isa": isa,
        "isa_served": served,
        "load_average": load,
    }


def run_dir(script: str, slug: str, title: str, out: str | Path | None = None, argv: list[str] | None = None) -> Path:
    """The folder a run writes to: ``out``, or a committed run's own results/<YYYY-MM-DD>-<slug>/,
    created with its run.json (title, date, commit, cpu, isa, and the command: ``script``, the
    scenario's file, with ``argv``, by default this process's arguments)."""
    date = datetime.date.today().isoformat()
    folder = Path(out) if out else ROOT / "results" / f"{date}-{slug}"
    folder.mkdir(parents=True, exist_ok=True)
    sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    m, args = machine(), sys.argv[1:] if argv is None else argv
    command = " ".join(["python", os.path.relpath(script, ROOT), *args])
    run = {"title": title, "date": date, "commit": sha.stdout.strip(), "cpu": m["cpu"], "isa": m["isa"]}
    run["command"] = command
    (folder / "run.json").write_text(json.dumps(run, indent=2) + "\n")
    return folder


def md_table(header: list[str], rows: list[list], right: bool = False, align: str = "") -> list[str]:
    """A markdown table: ``header`` (the columns' names) and a line per row of cells (None: empty);
    ``right``: every column but the first aligned right; ``align``: each column's, ``l`` or ``r``."""
    align = align or "l" + ("r" if right else "l") * (len(header) - 1)
    return [
        "| " + " | ".join(header) + " |",
        "|" + "".join("---:|" if a == "r" else "---|" for a in align),
        *("| " + " | ".join("" if c is None else str(c) for c in row) + " |" for row in rows),
    ]


def write_report(out: Path, report: dict, lines, plot=None) -> None:
    """OUT.json (the report), OUT.md (its lines, also printed) and, with ``plot``
    (``plot(report, path)``), OUT.png; a missing matplotlib skips the plot and says so. ``lines``:
    the markdown's lines, or ``lines(report)`` makes them once the JSON is written (a run that took
    long is never lost to a bug in its report: ``--from-json`` renders it again)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    if callable(lines):
        lines = lines(report)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    written = [out.with_suffix(".json").name, out.with_suffix(".md").name]
    if plot is not None:
        try:
            plot(report, out.with_suffix(".png"))
            written.append(out.with_suffix(".png").name)
        except ImportError:
            log("matplotlib is not installed: no plot (pip install -e '.[bench]')")
    log(f"done in {report.get('wall_s', 0)} s: {out.parent}/ " + ", ".join(written))
