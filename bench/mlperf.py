"""MLPerf Inference's Server scenario, run by MLPerf's own LoadGen against a served model over HTTP.

    from bench import mlperf
    pool = mlperf.query_pool(cfg, 256, seed=11)                 # (pairs, body, headers) queries, 100-700 pairs
    r = mlperf.run(url, pool, qps=20, seconds=25, out=Path("results/loadgen/criteo-20qps"))
    r["valid"], r["p99_ms"], r["pairs_per_s"]                   # LoadGen's verdict and percentiles
    best = mlperf.search(lambda q: mlperf.run(url, pool, q, 25), start=30)["best"]

LoadGen (``mlperf_loadgen``, the ``mlcommons-loadgen`` wheel) schedules the queries (Poisson
arrivals at ``server_target_qps``), times each from its scheduled issue to its completion, and
judges the run: VALID when the 99th percentile stays within ``server_target_latency_ns`` (60 ms,
DLRMv2's bound), the run lasted ``min_duration_ms`` and issued ``min_query_count`` queries, and
its early-stopping estimate agrees (a p99 needs a few hundred queries: ~460 with none over the
bound). Each LoadGen sample is one query: one HTTP request of 100-700 user-item pairs in the
``columns`` form (a truncated exponential, mean ~270; MLPerf draws from its own trace), multi-hot
with MLPerf's bag sizes for a DCN config. A query answered with anything but 200 fails the run
here (``ok``) whatever LoadGen says. The summary LoadGen writes (``mlperf_log_summary.txt``) is
kept under ``out``; ``parse_summary`` reads the verdict and percentiles from it.
"""

from __future__ import annotations

import concurrent.futures as cf
import heapq
import http.client
import json
import random
import re
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import NamedTuple
from urllib.parse import urlsplit

from bench.common import ROOT, cpu_snapshot, make_instance
from bench.load import self_cpu

BINARY_HEADER = "Inference-Header-Content-Length"

P99_BOUND_MS = 60.0  # MLPerf DLRMv2 Server
# MLPerf's own CPU results, the context for a per-core figure (bench/dense.py, the Server scenario's report).
PUBLISHED_PAIRS_PER_CORE = 20_000
PUBLISHED = (
    "MLPerf Inference DLRMv2 (dlrm-v2-99.9, closed division, Intel Xeon, int8 on AMX): ~70-78 samples/s "
    f"per core at p99 <= 60 ms, about {PUBLISHED_PAIRS_PER_CORE:,} user-item pairs/s per core (issue 29's reading "
    "of the results)"
)
PAIRS = (100, 700)
PAIRS_SCALE = 200  # 100 + an exponential of this mean, redrawn above 700: mean ~269
MIN_QUERIES = 500  # LoadGen's early stopping needs ~460 queries under the bound to call a p99 VALID


def query_pairs(rng: random.Random, scale: float = 1.0) -> int:
    """User-item pairs of one query (times ``scale``, at least 1)."""
    while True:
        n = PAIRS[0] + round(rng.expovariate(1 / PAIRS_SCALE))
        if n <= PAIRS[1]:
            return max(1, round(n * scale))


def shared_p99_ms(qps: float, rows_per_s: float, extra_ms: float = 0.0, queries: int = 20_000, seed: int = 1) -> float:
    """The p99 latency (ms) of this scenario's traffic on an ideal server of the machine: a model,
    not a measurement. Poisson arrivals at ``qps``, queries of ``query_pairs``' sizes, each needing
    its pairs at ``rows_per_s`` (the host's raw forward on all its CPUs) plus ``extra_ms`` of the
    whole machine; the queries in flight share the machine equally (one alone has every CPU) and
    nothing else costs time. What the compute floor allows at a rate: a p99 above the bound here
    means no server of this archive can be VALID at that rate on this machine; under it, the
    server's own costs are what a missed rate is made of.

    >>> shared_p99_ms(0.01, 20_000)  # each alone: the p99 query's ~666 pairs at 20,000 rows/s
    33.3
    >>> shared_p99_ms(5, 20_000), shared_p99_ms(5, 20_000, extra_ms=6.0)
    (40.5, 55.5)
    """
    arrivals, sizes = random.Random(seed), random.Random(seed + 1)
    heap: list[tuple[float, float]] = []  # (the service the query will have had when done, its arrival)
    served = now = at = 0.0  # the service each query in flight has had since time 0; the clock
    latencies = []

    def finish_until(t: float) -> None:
        nonlocal served, now
        while heap and now + (heap[0][0] - served) * len(heap) <= t:
            now += (heap[0][0] - served) * len(heap)
            served, arrived = heapq.heappop(heap)
            latencies.append(now - arrived)
        if heap:
            served += (t - now) / len(heap)
        now = t

    for _ in range(queries):
        at += arrivals.expovariate(qps)
        finish_until(at)
        heapq.heappush(heap, (served + query_pairs(sizes) / rows_per_s + extra_ms / 1000, at))
    finish_until(float("inf"))
    latencies.sort()
    return round(latencies[int(0.99 * len(latencies))] * 1000, 1)


def mlperf_bags(cfg) -> list[int] | None:
    """MLPerf DLRMv2's multi-hot bag sizes (sample_requests/dlrmv2.json) for a DCN config."""
    if cfg.interaction != "dcn":
        return None
    sample = json.loads((ROOT / "sample_requests" / "dlrmv2.json").read_text())["sparse"]
    return [sample["lengths"][sample["keys"].index(f)] for f in cfg.sparse_features]


# How a query goes over the wire: the kit's `columns` JSON on /predictions, or Open Inference
# Protocol v2 binary tensors on /v2/models/{m}/infer (tritonclient's encoding: a JSON header, then
# raw little-endian arrays; ids and bag lengths as INT32, which the kit accepts).
FORMS = ("columns", "v2-binary")


class Query(NamedTuple):
    pairs: int
    body: bytes
    headers: dict[str, str]
    # with ``split``: the query as requests of at most that many pairs, sent at once ((), one request)
    parts: tuple[tuple[bytes, dict[str, str]], ...] = ()


def make_query(
    cfg, rng: random.Random, rows: int, bags: list[int] | None, form: str = "columns", split: int = 0
) -> Query:
    """``rows`` pairs as one request of ``form``, every feature a column; with ``bags`` (ids per
    row, per feature) multi-hot (``f.lengths`` + ``f.values`` in v2), else one id per row. With
    ``split`` and more rows than that, ``parts`` holds the same rows as ceil(rows / split)
    requests of nearly equal size, in order (a client that spreads a large query over workers)."""
    dense = [make_instance(cfg, rng)["dense"] for _ in range(rows)]
    ids = {}
    for f, (name, n) in enumerate(zip(cfg.sparse_features, cfg.num_embeddings)):
        k = bags[f] if bags else 1
        ids[name] = (k, [rng.randrange(n) for _ in range(rows * k)])
    body, headers = encode(dense, ids, 0, rows, bags is not None, form)
    parts = ()
    if split and rows > split:
        n = -(-rows // split)
        cuts = [rows * i // n for i in range(n + 1)]
        parts = tuple(encode(dense, ids, a, b, bags is not None, form) for a, b in zip(cuts, cuts[1:]))
    return Query(rows, body, headers, parts)


def probe(cfg) -> bytes:
    """A one-pair `columns` query of ``cfg``'s shape: what must score before a server counts as ready."""
    return make_query(cfg, random.Random(0), 1, mlperf_bags(cfg)).body


def encode(dense: list, ids: dict, a: int, b: int, multi_hot: bool, form: str) -> tuple[bytes, dict[str, str]]:
    """Rows ``a:b`` of a query as one request body of ``form`` and its headers."""
    sparse: dict[str, dict] = {}
    for name, (k, values) in ids.items():
        sparse[name] = {"values": values[a * k : b * k]}
        if multi_hot:
            sparse[name]["lengths"] = [k] * (b - a)
    if form == "columns":
        body = json.dumps({"columns": {"dense": dense[a:b], "sparse": sparse}}).encode()
        return body, {"Content-Type": "application/json"}
    import numpy as np

    arrays = [("dense", "FP32", np.array(dense[a:b], "<f4"))]
    for name, col in sparse.items():
        if "lengths" in col:
            arrays += [(f"{name}.lengths", "INT32", np.array(col["lengths"], "<i4"))]
            arrays += [(f"{name}.values", "INT32", np.array(col["values"], "<i4"))]
        else:
            arrays += [(name, "INT32", np.array(col["values"], "<i4"))]
    inputs = [
        {"name": n, "datatype": t, "shape": list(x.shape), "parameters": {"binary_data_size": x.nbytes}}
        for n, t, x in arrays
    ]
    header = json.dumps({"inputs": inputs, "parameters": {"binary_data_output": True}}).encode()
    body = header + b"".join(x.tobytes() for *_, x in arrays)
    return body, {"Content-Type": "application/octet-stream", BINARY_HEADER: str(len(header))}


def query_pool(cfg, n: int, seed: int = 11, scale: float = 1.0, form: str = "columns", split: int = 0) -> list[Query]:
    """``n`` queries: LoadGen's sample library, drawn from by index."""
    rng, bags = random.Random(seed), mlperf_bags(cfg)
    return [make_query(cfg, rng, k, bags, form, split) for k in (query_pairs(rng, scale) for _ in range(n))]


def pop_form(variant: str, items: dict, default: str) -> str:
    """A variant's ``form=`` (taken out of ``items``: the load generator's, not the server's), else
    ``default``; one that is not in FORMS ends the run, naming the variant."""
    form = str(items.pop("form", default))
    if form not in FORMS:
        raise SystemExit(f"error: variant {variant}: form={form}: expected one of {', '.join(FORMS)}")
    return form


def path(form: str, model: str) -> str:
    """The route a query of ``form`` goes to."""
    return f"/v2/models/{model}/infer" if form == "v2-binary" else f"/predictions/{model}"


class HttpSUT:
    """LoadGen's system under test: each issued sample is the query ``pool[index]`` POSTed on a
    keep-alive connection of one of ``threads`` sender threads; the sample completes when its
    answer is read. Counts the pairs answered and the answers other than 200."""

    def __init__(self, url: str, pool: list[Query], threads: int = 64):
        parts = urlsplit(url)
        self.host, self.port, self.path = parts.hostname, parts.port or 80, parts.path
        self.pool = pool
        self.senders = cf.ThreadPoolExecutor(threads)
        self.part_senders = cf.ThreadPoolExecutor(threads)
        self.local = threading.local()
        self.lock = threading.Lock()
        self.queries = self.pairs = self.errors = 0
        self.times: list[tuple[float, float, int]] = []  # per query: sent, answered (monotonic s), pairs

    def post_all(self, requests) -> int:
        """``requests`` ((body, headers) pairs: one query) sent at once, the first on this thread,
        the rest on the parts' own: 200, or the first other status."""
        rest = [self.part_senders.submit(self._post, *r) for r in requests[1:]]
        statuses = [self._post(*requests[0]), *(f.result() for f in rest)]
        return next((x for x in statuses if x != 200), 200)

    def _post(self, body: bytes, headers: dict[str, str]) -> int:
        for attempt in (0, 1):  # a connection the server closed is reopened once
            try:
                if not hasattr(self.local, "conn"):
                    self.local.conn = http.client.HTTPConnection(self.host, self.port, timeout=300)
                self.local.conn.request("POST", self.path, body, headers)
                resp = self.local.conn.getresponse()
                resp.read()
                return resp.status
            except (OSError, http.client.HTTPException):
                self.local.__dict__.pop("conn", None)
                if attempt:
                    return 0
        return 0

    def _send(self, sample_id: int, index: int) -> None:
        import mlperf_loadgen as lg

        pairs, status, sent = 0, 0, time.monotonic()
        try:
            pairs, body, headers, parts = self.pool[index]
            status = self.post_all(parts or ((body, headers),))
        finally:  # always completed (a failure counts as one): LoadGen waits for every sample it issued
            with self.lock:
                self.queries += 1
                self.pairs += pairs
                self.errors += status != 200
                self.times.append((sent, time.monotonic(), pairs))
            lg.QuerySamplesComplete([lg.QuerySampleResponse(sample_id, 0, 0)])

    def issue(self, samples) -> None:
        for s in samples:
            self.senders.submit(self._send, s.id, s.index)


def settings(qps: float, seconds: float, min_queries: int, max_seconds: float | None):
    """LoadGen's Server-scenario settings: Poisson arrivals at ``qps``, p99 <= 60 ms, at least
    ``seconds`` and ``min_queries``, at most ``max_seconds`` (then INVALID: too few queries)."""
    import mlperf_loadgen as lg

    s = lg.TestSettings()
    s.scenario = lg.TestScenario.Server
    s.mode = lg.TestMode.PerformanceOnly
    s.server_target_qps = qps
    s.server_target_latency_ns = int(P99_BOUND_MS * 1e6)
    s.server_target_latency_percentile = 0.99
    s.min_duration_ms = int(seconds * 1000)
    s.min_query_count = min_queries
    if max_seconds:
        s.max_duration_ms = int(max_seconds * 1000)
    return s


def run(
    url: str,
    pool: list[Query],
    qps: float,
    seconds: float,
    min_queries: int = MIN_QUERIES,
    max_seconds: float | None = None,
    out: Path | None = None,
    procs=None,
    latencies: bool = False,
) -> dict:
    """One LoadGen Server run at ``qps`` against ``url``: LoadGen's verdict and latencies
    (parse_summary), queries and pairs answered per second, failed answers, and the client's CPU
    (LoadGen and the senders) per query; with ``procs`` (a callable returning {group: pids},
    e.g. the frontend and the workers) each group's CPU per query too. With ``out`` LoadGen's
    summary is kept in that file. With ``latencies`` every query's ms at the client, sorted, too
    (``latencies_ms``: runs pooled into one percentile)."""
    import mlperf_loadgen as lg

    sut = HttpSUT(url, pool)
    lg_sut = lg.ConstructSUT(sut.issue, lambda: None)
    qsl = lg.ConstructQSL(len(pool), len(pool), lambda s: None, lambda s: None)
    logs = Path(tempfile.mkdtemp(prefix="loadgen-"))
    log_settings = lg.LogSettings()
    log_settings.log_output.outdir = str(logs)
    log_settings.log_output.copy_summary_to_stdout = False
    groups = procs() if procs else {}
    cpu0, client0, t0, started = cpu_snapshot(groups), self_cpu(), time.perf_counter(), time.monotonic()
    try:
        lg.StartTestWithLogSettings(lg_sut, qsl, settings(qps, seconds, min_queries, max_seconds), log_settings)
    finally:
        took = time.perf_counter() - t0
        sut.senders.shutdown(wait=True)
        sut.part_senders.shutdown(wait=True)
        lg.DestroyQSL(qsl)
        lg.DestroySUT(lg_sut)
    cpu1, client = cpu_snapshot(groups), self_cpu() - client0
    text = (logs / "mlperf_log_summary.txt").read_text()
    shutil.rmtree(logs, ignore_errors=True)
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text)
    res = {"target_qps": round(qps, 2), "seconds": round(took, 1), **parse_summary(text)}
    q = max(1, sut.queries)
    res.update(
        queries=sut.queries,
        errors=sut.errors,
        pairs_mean=round(sut.pairs / q, 1),
        queries_per_s=round(sut.queries / took, 2),
        pairs_per_s=round(sut.pairs / took),
        client_cpu_us_per_query=round(client / q * 1e6),
        summary=str(Path(out).relative_to(ROOT) if out and Path(out).is_relative_to(ROOT) else out or ""),
        slowest=slowest(sut.times, started),
        first_5s=window(sut.times, started, 0, 5),  # a server just made ready: its cold start
        after_5s=window(sut.times, started, 5, float("inf")),
        started_at=started,  # time.monotonic() when LoadGen began: the origin of slowest's at_s
    )
    if cpu0 and cpu1:  # a worker replaced meanwhile (its pid gone): no CPU figure for this run
        res.update({f"{k}_cpu_us_per_query": round((cpu1[k] - cpu0[k]) / q * 1e6) for k in groups})
    if latencies:
        res["latencies_ms"] = sorted(round((e - s) * 1000, 1) for s, e, _ in sut.times)
    res["ok"] = bool(res.get("valid")) and sut.errors == 0
    return res


def slowest(times: list[tuple[float, float, int]], started: float, n: int = 5) -> list[dict]:
    """The ``n`` slowest queries at the client: when each was sent (s after ``started``), its ms and pairs.

    >>> slowest([(10.0, 10.05, 300), (11.0, 11.2, 700), (12.0, 12.01, 100)], 10.0, 2)
    [{'at_s': 1.0, 'ms': 200.0, 'pairs': 700}, {'at_s': 0.0, 'ms': 50.0, 'pairs': 300}]
    """
    top = sorted(times, key=lambda t: t[0] - t[1])[:n]
    return [{"at_s": round(a - started, 2), "ms": round((b - a) * 1000, 1), "pairs": p} for a, b, p in top]


def window(times: list[tuple[float, float, int]], started: float, a: float, b: float, bound_ms: float = 60.0) -> dict:
    """The queries sent from ``a`` to ``b`` s after ``started``: how many, the slowest's ms, and how
    many took longer than ``bound_ms`` (MLPerf's p99 bound for DLRM).

    >>> window([(10.0, 10.05, 300), (11.0, 11.2, 700), (16.0, 16.01, 100)], 10.0, 0, 5)
    {'queries': 2, 'max_ms': 200.0, 'over_bound': 1}
    >>> window([(10.0, 10.05, 300)], 10.0, 5, 10)
    {'queries': 0, 'max_ms': None, 'over_bound': 0}
    """
    ms = [(e - s) * 1000 for s, e, _ in times if a <= s - started < b]
    return {
        "queries": len(ms),
        "max_ms": round(max(ms), 1) if ms else None,
        "over_bound": sum(m > bound_ms for m in ms),
    }


_LATENCIES = {"50.00": "p50_ms", "90.00": "p90_ms", "99.00": "p99_ms", "99.90": "p999_ms"}


def parse_summary(text: str) -> dict:
    """LoadGen's mlperf_log_summary.txt: the verdict (``valid``), which constraints failed,
    scheduled and completed samples/s, and the latency percentiles in ms.

    >>> parse_summary("Result is : INVALID\\n  Min queries satisfied : NO\\n99.00 percentile latency (ns)   : 61500000")
    {'valid': False, 'unsatisfied': ['Min queries'], 'p99_ms': 61.5}
    """
    out: dict = {}
    for line in text.splitlines():
        key, _, value = (part.strip() for part in line.partition(":"))
        if key == "Result is":
            out["valid"] = value == "VALID"
        elif key.endswith("satisfied") and value.upper() == "NO":
            out.setdefault("unsatisfied", []).append(key.removesuffix(" satisfied"))
        elif key == "Scheduled samples per second":
            out["scheduled_qps"] = float(value)
        elif key == "Completed samples per second":
            out["completed_qps"] = float(value)
        elif key.endswith("percentile latency (ns)") and key.split()[0] in _LATENCIES:
            out[_LATENCIES[key.split()[0]]] = round(int(value) / 1e6, 1)
        elif key == "Max latency (ns)":
            out["max_ms"] = round(int(value) / 1e6, 1)
        elif line.startswith(" * Would need to run at least"):
            out["early_stopping"] = line.strip(" *")
    if "valid" not in out:
        raise ValueError("not a LoadGen summary: no 'Result is' line")
    return out


def more_queries(r: dict) -> int | None:
    """How many more queries LoadGen says would decide a run that failed on early stopping alone
    with its p99 under the bound (one query past the bound in a short run is enough for that:
    evidence too thin, not a rate too high); None for any other run.

    >>> more_queries({"valid": False, "unsatisfied": ["Early stopping"], "p99_ms": 41.9,
    ...               "early_stopping": "Would need to run at least 162 more queries,"})
    162
    """
    if r.get("valid") or r.get("unsatisfied") != ["Early stopping"] or (r.get("p99_ms") or 1e9) > P99_BOUND_MS:
        return None
    m = re.search(r"at least (\d+) more queries", r.get("early_stopping", ""))
    return int(m.group(1)) if m else None


def decide(run_once, qps: float, first: dict, max_seconds: float, limit_s: float) -> dict:
    """``first`` (a run at ``qps``), or, when early stopping alone left it undecided
    (``more_queries``), the rate run again by ``run_once(qps, min_queries, max_seconds)`` with the
    queries LoadGen asks for and half again (the new run may have its own query past the bound),
    if that takes at most ``limit_s``: its verdict stands, the first run kept in it."""
    more = more_queries(first)
    if more is None:
        return first
    n = -(-3 * (first.get("queries", 0) + more) // 2)
    if n / qps > limit_s:
        return first
    again = run_once(qps, n, max(max_seconds, 1.2 * n / qps))
    again["undecided_first"] = {k: first.get(k) for k in ("queries", "p99_ms", "max_ms", "early_stopping")}
    return again


def next_rate(lo: float | None, hi: float | None, rate: float, step: float, tol: float, floor: float) -> float | None:
    """The next offered rate of ``search``, or None when done: up by ``step`` from the highest
    valid rate ``lo`` until a rate fails, down from the lowest failed one ``hi`` until one passes
    (None below ``floor``: no rate meets the bound), then the geometric midpoint until
    hi / lo < ``tol``.

    >>> next_rate(10, None, 10, 2, 1.1, 0.1), next_rate(None, 10, 10, 2, 1.1, 0.1), next_rate(10, 20, 20, 2, 1.1, 0.1)
    (20, 5.0, 14.142135623730951)
    """
    if lo is None and hi is None:
        return rate
    if hi is None:
        return lo * step
    if lo is None:
        return hi / step if hi / step >= floor else None
    return (lo * hi) ** 0.5 if hi / lo >= tol else None


def search(run_at, start: float, steps: int = 7, step: float = 2.0, tol: float = 1.1, floor: float = 0.1) -> dict:
    """The highest offered rate ``run_at(rate)`` (a dict with ``ok``) passes: from ``start``,
    ``next_rate`` after each run, ``steps`` runs at most. Going down with no pass yet, it stops
    once halving the rate cut p99 by less than 20% (queueing is not what breaks the bound: the
    queries' own time is, or other work on the machine).
    Returns {"best": the best passing run or None, "runs": every run in order}."""
    runs: list[dict] = []
    lo = hi = None
    rate: float | None = start
    while rate is not None and len(runs) < steps:
        r = run_at(rate)
        r.setdefault("target_qps", rate)
        runs.append(r)
        if r["ok"]:  # next_rate only goes above lo ...
            lo = rate
        else:  # ... or below hi
            hi = rate
        rate = next_rate(lo, hi, rate, step, tol, floor)
        failed = [x.get("p99_ms") for x in runs if not x["ok"]]
        if lo is None and len(failed) > 1 and None not in failed[-2:] and failed[-1] >= 0.8 * failed[-2]:
            runs[-1]["note"] = (
                "a lower rate no longer lowers p99: not queueing breaks the bound (the queries' own time, or other work)"
            )
            rate = None
    passed = [r for r in runs if r["ok"]]
    return {"best": max(passed, key=lambda r: r["target_qps"]) if passed else None, "runs": runs}
