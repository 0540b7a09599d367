"""Integration: live updates through a real TorchServe (two int8 workers following one delta
directory): deltas applied in order on every worker, bad ones refused with the model unchanged and
the workers alive, a killed worker restarted with every delta, the sequence in the OIP metadata,
the response header and the metrics, and no torn score under load, checked by a checker that is
shown to catch the torn scores of a deliberately unguarded apply (tests/unguarded_handler.py)."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
import zipfile
from pathlib import Path

import pytest
import torch
import yaml

from conftest import TINY
from dlrmkit.batch import collate, scores
from dlrmkit.config import DLRMConfig
from dlrmkit.forms import RequestParser
from dlrmkit.live import BASE_FILE, DeltaApplier, delta_path, target_for, write_delta
from dlrmkit.model import DLRMFactory
from helpers import DENSE, instance, wait_until
from scripts.tsctl import Server, get, post

pytestmark = pytest.mark.integration
TESTS = Path(__file__).resolve().parent

IDS = [1, 2, 3, 5, 8]  # rows every delta rewrites in every table; one probe request per id
REQUESTS = [json.dumps(instance(DENSE, feature_0=[i], feature_1=[i], feature_2=[i])).encode() for i in IDS]


class DeltaReferences:
    """In-process references for live updates: the archive's weights loaded as a worker loads them,
    following the same delta directory, and its scores for ``requests`` (bodies) at every sequence
    it applied. A served answer is untorn when it equals one of them (``sequences``)."""

    def __init__(
        self, mar: Path, handler: dict, directory: Path, requests: list[bytes], workdir: Path, tol: float = 1e-5
    ):
        self.tmp = workdir  # the archive's weights are unpacked here
        self.tmp.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(mar) as z:
            z.extract("dlrm.pt", self.tmp)
            base = z.read(BASE_FILE).decode().strip()
        self.config = DLRMConfig.from_dict(handler)
        factory = DLRMFactory(self.config)
        model = factory.load(self.tmp / "dlrm.pt")
        factory.freeze_dense(model)
        target = target_for(self.config, factory, "dlrm", base)
        self.applier = DeltaApplier(model, self.config, factory, directory, target)
        self.parser, self.requests, self.tol = RequestParser(self.config), requests, tol
        self.scores = {0: self._score()}

    def follow(self) -> int:
        """Apply what is visible; returns the sequence reached."""
        while self.applier.poll_once():
            self.scores[self.applier.applied] = self._score()
        return self.applier.applied

    def _score(self) -> list[list[float]]:
        batch, bad = collate([self.parser.parse(r) for r in self.requests], self.config)
        assert not bad
        return scores(self.applier.model, batch, self.config)

    def sequences(self, i: int, got: list[float]) -> list[int]:
        """The sequences whose reference score for request ``i`` equals ``got``."""
        return [
            s
            for s, ref in self.scores.items()
            if len(ref[i]) == len(got) and all(abs(a - b) <= self.tol for a, b in zip(ref[i], got))
        ]


def rows_delta(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.tensor(IDS)
    return {
        t: (ids, torch.rand(len(IDS), TINY["embedding_dim"], generator=gen) * 2 - 1) for t in TINY["sparse_features"]
    }


def with_handler(mar: Path, handler: str, *modules: str) -> None:
    """The archive ``mar`` served by ``handler`` (a file of tests/) instead of dlrm_handler.py, which
    stays in it for ``handler`` to subclass, shipped with ``modules`` (files of tests/)."""
    with zipfile.ZipFile(mar) as z:
        files = {n: z.read(n) for n in z.namelist()}
    manifest = json.loads(files["MAR-INF/MANIFEST.json"])
    manifest["model"]["handler"] = handler
    files["MAR-INF/MANIFEST.json"] = json.dumps(manifest).encode()
    for name in (handler, *modules):
        files[name] = (TESTS / name).read_bytes()
    with zipfile.ZipFile(mar, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)


def start(tmp, workers: int, dtype: str, handler_file: str | None = None):
    """A server of ``workers`` workers following ``tmp``/deltas; ``handler_file``: a test's handler file
    (tests/unguarded_handler.py) instead of the kit's."""
    from scripts import build_mar

    handler = {**TINY, "embedding_dtype": dtype, "delta_dir": str(tmp / "deltas"), "delta_poll_s": 0.05}
    config = tmp / "model-config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "minWorkers": workers,
                "maxWorkers": workers,
                "batchSize": 8,
                "maxBatchDelay": 2,
                "responseTimeout": 60,
                "handler": handler,
            }
        )
    )
    mar = build_mar.main(["--config", str(config), "--output-dir", str(tmp / "store"), "--force"])
    with zipfile.ZipFile(mar) as z:
        base = z.read("delta-base.txt").decode().strip()
    if handler_file:
        with_handler(mar, handler_file, "unguarded.py")
    srv = Server.on_free_ports(tmp / "home", model_store=tmp / "store")
    srv.start()
    srv.wait_ready("dlrm", REQUESTS[0], timeout=240)
    srv.wait_workers_ready("dlrm", workers, timeout=240)
    return srv, DeltaReferences(mar, handler, tmp / "deltas", REQUESTS, tmp / "reference"), base


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    srv, refs, base = start(tmp_path_factory.mktemp("delta-live"), 2, "int8")
    try:
        yield srv, refs, base
    finally:
        srv.stop()


def metadata(srv) -> dict:
    status, body, _ = get(f"{srv.url}/v2/models/dlrm")
    assert status == 200, body
    return json.loads(body)


def at(srv, seq: int, workers: int = 2) -> dict:
    """Wait until ``workers`` workers report delta ``seq`` in the OIP metadata."""
    return wait_until(
        lambda: metadata(srv), lambda m: list(m.get("delta_sequences", {}).values()) == [seq] * workers, timeout=60
    )


def answers(srv) -> list[tuple[int, list[float]]]:
    out = []
    for body in REQUESTS:
        status, reply, headers = post(f"{srv.url}/predictions/dlrm", body)
        assert status == 200, reply
        out.append((int({k.lower(): v for k, v in headers.items()}["x-delta-sequence"]), json.loads(reply)["scores"]))
    return out


def assert_serving(srv, refs, seq: int) -> None:
    assert refs.follow() == seq
    for i, (header, got) in enumerate(answers(srv)):
        assert header == seq and seq in refs.sequences(i, got), (i, header, got, refs.scores[seq][i])


def delta_metrics(srv) -> dict:
    """dlrm_delta* samples of /metrics: {(name, (dimension=value, ...) without ModelName/Level/Hostname): value}."""
    _, text, _ = get(f"{srv.metrics_url}/metrics")
    out = {}
    for line in text.decode().splitlines():
        m = re.match(r"(dlrm_delta\w*)\{(.*)\} (\S+)$", line)
        if m:
            dims = tuple(
                d
                for d in re.findall(r'(\w+="[^"]*")', m.group(2))
                if not d.startswith(("ModelName", "Level", "Hostname"))
            )
            out[(m.group(1), dims)] = float(m.group(3))
    return out


def test_every_worker_applies_the_deltas_in_order(live):
    srv, refs, base = live
    assert metadata(srv)["delta_sequences"] and set(metadata(srv)["delta_sequences"].values()) == {0}
    assert_serving(srv, refs, 0)
    write_delta(refs.applier.directory, "dlrm", base, 1, rows_delta(1))
    write_delta(refs.applier.directory, "dlrm", base, 2, rows_delta(2))
    assert at(srv, 2)["delta_sequence"] == 2
    assert_serving(srv, refs, 2)
    # One copy of the tables for both workers: each maps the shared side files, one of them wrote
    pids = srv.worker_pids("dlrm")
    state_dir = Path(os.readlink(f"/proc/{pids[0]}/cwd")) / "delta-state"
    # the writer worker counts its writer process's rows at its next poll
    states = wait_until(
        lambda: [json.loads((state_dir / f"{pid}.json").read_text()) for pid in pids],
        lambda states: sorted(s["rows_applied"] > 0 for s in states) == [False, True],
    )
    assert len({s["buffer"] for s in states}) == 1 and None not in {s["buffer"] for s in states}, states
    assert sorted(s["rows_applied"] > 0 for s in states) == [False, True], states
    for pid in pids:
        maps = Path(f"/proc/{pid}/maps").read_text()
        assert all(f"-{i}-{side}.bin" in maps for i in (0,) for side in (0, 1)), maps[-2000:]
    assert refs.scores[2] != refs.scores[0]  # the deltas move these scores
    # A dense-parameter delta: every dense parameter, moved
    dense = {
        k: torch.randn(s, generator=torch.Generator().manual_seed(3)) * 0.2
        for k, s in refs.applier.target.dense.items()
    }
    write_delta(refs.applier.directory, "dlrm", base, 3, rows_delta(3), dense)
    at(srv, 3)
    assert_serving(srv, refs, 3)


def test_bad_deltas_are_refused_and_the_stream_resumes(live):
    srv, refs, base = live
    pids = srv.worker_pids("dlrm")
    bad = rows_delta(4)
    bad["feature_1"][1][0, 0] = float("nan")
    before = delta_metrics(srv)
    write_delta(refs.applier.directory, "dlrm", base, 4, bad)
    write_delta(refs.applier.directory, "dlrm", base, 6, rows_delta(6))  # after a gap: waits for 4 and 5
    key = ("dlrm_deltas_refused_total", ('Reason="nonfinite"',))
    seen = wait_until(lambda: delta_metrics(srv), lambda m: m.get(key, 0) - before.get(key, 0) >= 1, timeout=60)
    time.sleep(0.5)  # ten polls more: still counted once
    seen = delta_metrics(srv)
    assert seen[key] - before.get(key, 0) == 1, seen  # by the writer, once: not per worker, not per poll
    assert srv.worker_pids("dlrm") == pids  # alive
    assert_serving(srv, refs, 3)  # unchanged: neither 4 nor the later 6
    log = "".join(p.read_text(errors="replace") for p in srv.log_dir.glob("model_log*.log"))
    assert "delta-00000004.safetensors REFUSED (nonfinite)" in log
    write_delta(refs.applier.directory, "dlrm", base, 4, rows_delta(40))  # the good one, renamed over it
    write_delta(refs.applier.directory, "dlrm", base, 5, rows_delta(5))
    at(srv, 6)
    assert_serving(srv, refs, 6)


def writer_processes() -> dict[int, int]:
    """The shared tables' writer processes on this machine (dlrmkit.live.writer.writer_main): pid -> parent pid."""
    out = {}
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and b"writer_main" in (p / "cmdline").read_bytes():
                out[int(p.name)] = int(re.search(r"PPid:\s+(\d+)", (p / "status").read_text()).group(1))
        except (OSError, AttributeError):  # exited meanwhile
            continue
    return out


def test_a_restarted_worker_comes_up_with_every_delta(live):
    """The writer worker killed: its writer process goes with it (never writing for a dead worker),
    the other worker or the new one takes over, and the new worker serves every delta."""
    srv, refs, base = live
    old = srv.worker_pids("dlrm")
    writers = wait_until(writer_processes, lambda w: len(w) == 1)
    assert len(writers) == 1 and set(writers.values()) <= set(old), (writers, old)
    ((child, parent),) = writers.items()
    os.kill(parent, signal.SIGKILL)
    wait_until(lambda: srv.worker_pids("dlrm"), lambda p: parent not in p and len(p) == 2, timeout=120)
    pids = srv.wait_workers_ready("dlrm", 2, timeout=240)
    assert parent not in pids
    now = wait_until(writer_processes, lambda w: child not in w and len(w) == 1 and set(w.values()) <= set(pids))
    assert child not in now and len(now) == 1 and set(now.values()) <= set(pids), (now, pids)
    meta = at(srv, 6)
    assert sorted(map(int, meta["delta_sequences"])) == sorted(pids)
    for _ in range(3):  # both workers answer (TorchServe spreads the requests)
        assert_serving(srv, refs, 6)


def test_metrics_show_each_workers_sequence(live):
    srv, refs, base = live
    pids = srv.wait_workers_ready("dlrm", 2)

    def per_worker(m):
        return {int(d[0][8:-1]): v for (n, d), v in m.items() if n == "dlrm_delta_sequence" and d}

    m = wait_until(lambda: delta_metrics(srv), lambda m: all(per_worker(m).get(p) == 6 for p in pids), timeout=60)
    assert all(per_worker(m)[p] == 6 for p in pids), m
    # every delta's rows, written once into the tables both workers share
    assert m[("dlrm_delta_rows_total", ())] >= 6 * len(IDS) * 3
    lag = {int(d[0][8:-1]): v for (n, d), v in m.items() if n == "dlrm_delta_lag_seconds"}
    assert all(lag[p] == 0 for p in pids), lag


def load_during_deltas(srv, refs, base, first: int, count: int, pause: float) -> list[tuple[int, int, list[float]]]:
    """Four clients post the probe requests without pause while ``count`` deltas land; returns
    (request index, X-Delta-Sequence, scores) of every answer."""
    got, stop, errors = [], threading.Event(), []

    def client(k):
        i = k
        while not stop.is_set():
            status, reply, headers = post(f"{srv.url}/predictions/dlrm", REQUESTS[i % len(REQUESTS)])
            if status != 200:
                errors.append((status, reply))
            else:
                seq = int({h.lower(): v for h, v in headers.items()}["x-delta-sequence"])
                got.append((i % len(REQUESTS), seq, json.loads(reply)["scores"]))
            i += 1

    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    try:
        for seq in range(first, first + count):
            write_delta(refs.applier.directory, "dlrm", base, seq, rows_delta(seq))
            time.sleep(pause)
        at(srv, first + count - 1, workers=len(srv.worker_pids("dlrm")))
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors[:3]
    assert refs.follow() == first + count - 1
    return got


def torn(refs, got) -> list:
    """Answers equal to no reference of the sequence their header names."""
    return [(i, seq, s) for i, seq, s in got if seq not in refs.sequences(i, s)]


def test_no_torn_score_under_load(live):
    srv, refs, base = live
    got = load_during_deltas(srv, refs, base, 7, 8, 0.3)
    assert len({seq for _, seq, _ in got}) >= 4, "the load did not span the deltas"
    assert torn(refs, got) == []


def test_the_torn_check_catches_an_unguarded_apply(tmp_path_factory):
    """The same check against a server that applies without the lock, pausing between tables (the
    test-only handler, tests/unguarded_handler.py): it must find torn scores, or it proves nothing above."""
    srv, refs, base = start(tmp_path_factory.mktemp("delta-torn"), 1, "fp32", "unguarded_handler.py")
    try:
        got = load_during_deltas(srv, refs, base, 1, 4, 0.8)
        bad = torn(refs, got)
        assert bad, f"no torn score among {len(got)} answers"
        assert any(refs.sequences(i, s) == [] for i, _, s in bad)  # a mix of old and new rows: no reference
        assert delta_path(refs.applier.directory, 4).is_file()
    finally:
        srv.stop()
