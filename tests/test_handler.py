"""The TorchServe handler driven in-process with a fake Context; and the archive build script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest
import torch

from conftest import ROOT, TINY, FakeContext, call
from dlrmkit.batch import collate, scores
from dlrmkit.config import DLRMConfig
from dlrmkit.forms import RequestParser
from dlrmkit.errors import ConfigError
from helpers import DENSE, body, instance, wait_until


def test_handler_scores_equal_a_direct_model_call(handler, model, config):
    reqs = [
        body(instance(DENSE, feature_0=[1, 2], feature_2=[39])),
        body({"instances": [instance([1] * 5, feature_1=[3]), instance([0] * 5)]}),
    ]
    out, ctx = call(handler, reqs)
    assert len(out) == 2
    parsed = [RequestParser(config).parse(r) for r in reqs]
    want = scores(model, collate(parsed, config)[0], config)
    first, second = json.loads(out[0]), json.loads(out[1])
    assert torch.allclose(torch.tensor(first["scores"]), torch.tensor(want[0]), atol=1e-6)
    assert first["score"] == first["scores"][0]
    assert "score" not in second and torch.allclose(torch.tensor(second["scores"]), torch.tensor(want[1]), atol=1e-6)
    assert ctx.statuses == {}
    assert ctx.content_types == {0: "application/json", 1: "application/json"}
    assert any(name == "HandlerTime" for name, _, _ in ctx.metrics.recorded)


def test_bad_requests_fail_alone_and_good_ones_keep_their_scores(handler):
    good = [body(instance(DENSE, feature_0=[1])), body(instance([2] * 5, feature_1=[2, 29]))]
    solo = [json.loads(call(handler, [g])[0][0]) for g in good]
    batch = [
        good[0],
        b"{not json",
        body(instance(DENSE, feature_0=[20])),  # out of range id: found in collation
        good[1],
        body({"instances": [instance(DENSE)] * 9}),  # too many instances: 413
        body(instance(DENSE, **{"féature_0": [1]})),
    ]
    out, ctx = call(handler, batch)
    assert len(out) == len(batch)
    assert json.loads(out[0]) == solo[0] and json.loads(out[3]) == solo[1]
    assert ctx.statuses == {
        1: (400, "Bad Request"),
        2: (400, "Bad Request"),
        4: (413, "Payload Too Large"),
        5: (400, "Bad Request"),
    }
    errors = {i: json.loads(out[i]) for i in ctx.statuses}
    assert errors[1]["code"] == 400 and errors[1]["type"] == "BadRequest" and errors[1]["message"].startswith("body:")
    assert errors[2]["message"].startswith("sparse.values[0]: id 20 is out of range")
    assert errors[4] == {"code": 413, "type": "PayloadTooLarge", "message": errors[4]["message"]}
    assert "féature_0" in errors[5]["message"]
    assert all(phrase.isascii() for _, phrase in ctx.statuses.values())


def test_a_batch_of_only_bad_requests(handler):
    out, ctx = call(handler, [b"", body(instance(DENSE, feature_2=[40]))])
    assert [json.loads(o)["code"] for o in out] == [400, 400]
    assert set(ctx.statuses) == {0, 1}


def test_form_post_gets_a_hint(handler):
    ctx = FakeContext(Path("."), dict(TINY))
    ctx.headers = {1: {"Content-Type": "application/x-www-form-urlencoded"}}
    out = handler.handle([{"a": bytearray(b"1")}, {}, {}], ctx)  # TorchServe's rows for form posts
    assert ctx.statuses == {0: (400, "Bad Request"), 1: (400, "Bad Request"), 2: (400, "Bad Request")}
    assert "Content-Type: application/json" in json.loads(out[0])["message"]
    assert "Content-Type: application/json" in json.loads(out[1])["message"]
    assert json.loads(out[2])["message"] == "body: expected a JSON object, got an empty body"


def test_server_side_failure_fails_the_batch_with_5xx(handler):
    from ts.utils.util import PredictionException

    class Boom(torch.nn.Module):
        def __init__(self, exc):
            super().__init__()
            self.exc = exc

        def forward(self, *a):
            raise self.exc

    good = body(instance(DENSE, feature_0=[1]))
    real_model, want = handler.model, call(handler, [good])[0]
    for exc, code in [
        (RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried... out of memory"), 507),
        (MemoryError(), 507),
        (RuntimeError("bad kernel"), 500),
    ]:
        handler.model = Boom(exc)
        with pytest.raises(PredictionException) as info:
            call(handler, [good])
        assert info.value.error_code == code
    handler.model = real_model  # the next batch is served as before: nothing is left wedged
    assert call(handler, [good])[0] == want


def test_initialize_errors_say_what_to_fix(tmp_path, weights):
    from dlrm_handler import TorchRecDLRMHandler

    with pytest.raises(ConfigError, match="expected a 'handler:' mapping"):
        TorchRecDLRMHandler().initialize(FakeContext(tmp_path, None))
    with pytest.raises(ConfigError, match="the archive has no weights"):
        TorchRecDLRMHandler().initialize(FakeContext(tmp_path, dict(TINY), serialized=None))
    with pytest.raises(ConfigError, match="weights file not found"):
        TorchRecDLRMHandler().initialize(FakeContext(tmp_path, dict(TINY)))
    with pytest.raises(ConfigError, match="handler.embedding_dim"):
        TorchRecDLRMHandler().initialize(FakeContext(tmp_path, {**TINY, "embedding_dim": -1}))


def test_handler_uses_cpu_without_cuda_even_with_a_gpu_id(tmp_path, archived):
    from dlrm_handler import TorchRecDLRMHandler

    (tmp_path / "dlrm.pt").symlink_to(archived)
    h = TorchRecDLRMHandler()
    h.initialize(FakeContext(tmp_path, dict(TINY), gpu_id=0))
    want = "cuda:0" if torch.cuda.is_available() else "cpu"
    assert str(h.device) == want
    assert {t.device.type for t in [*h.model.parameters(), *h.model.buffers()]} == {torch.device(want).type}


def test_modules_define_exactly_one_class():
    # TorchServe's loader refuses a handler file with more or fewer classes.
    import inspect

    import dlrm_handler

    for mod in (dlrm_handler,):
        own = [c for _, c in inspect.getmembers(mod, inspect.isclass) if c.__module__ == mod.__name__]
        assert len(own) == 1, (mod.__name__, own)


def test_build_script_makes_a_mar_with_manifest(tmp_path, model, weights):
    from scripts import build_mar

    config = tmp_path / "tiny.yaml"
    config.write_text(json.dumps({"batchSize": 4, "handler": TINY}))  # JSON is YAML
    mar = build_mar.main(
        ["--config", str(config), "--output-dir", str(tmp_path / "store"), "--checkpoint", str(weights)]
    )
    with zipfile.ZipFile(mar) as z:
        manifest = json.loads(z.read("MAR-INF/MANIFEST.json"))
        names = set(z.namelist())
        z.extract("dlrm.pt", tmp_path / "x")
    assert manifest["model"]["handler"] == "dlrm_handler.py"
    assert manifest["model"]["serializedFile"] == "dlrm.pt"
    assert manifest["model"]["configFile"] == "tiny.yaml"
    assert {
        "dlrm_handler.py",
        "dlrmkit/model.py",
        "dlrmkit/batch.py",
        "dlrmkit/config.py",
        "dlrmkit/errors.py",
        "dlrmkit/request.py",
        "dlrmkit/schema.py",
        "dlrmkit/forms.py",
        "dlrmkit/protocols.py",
        "dlrmkit/criteo.py",
        "tiny.yaml",
        "dlrm.pt",
    } <= names
    archived = torch.load(tmp_path / "x" / "dlrm.pt", weights_only=True)
    for k, v in model.state_dict().items():  # tables as the fused kernel's rows: the fp32 bytes
        assert torch.equal(archived[k].view(v.dtype), v), k
    # an existing archive needs --force
    with pytest.raises(SystemExit, match="pass --force"):
        build_mar.main(["--config", str(config), "--output-dir", str(tmp_path / "store")])


def test_build_script_rejects_a_mismatched_checkpoint(tmp_path, model):
    from scripts import build_mar

    state = dict(model.state_dict())
    state["sparse_arch.embedding_bag_collection.embedding_bags.feature_0.weight"] = torch.zeros(21, 8)
    ckpt = tmp_path / "bad.pt"
    torch.save(state, ckpt)
    config = tmp_path / "tiny.yaml"
    config.write_text(json.dumps({"handler": TINY}))
    with pytest.raises(SystemExit) as info:
        build_mar.main(["--config", str(config), "--output-dir", str(tmp_path), "--checkpoint", str(ckpt)])
    assert "table 'feature_0' (feature 'feature_0') has shape [21, 8], the config expects [20, 8]" in str(info.value)
    assert not (tmp_path / "dlrm.mar").exists()


def test_large_batches_are_scored_in_groups_with_the_same_scores(handler, monkeypatch):
    from dlrmkit import worker

    reqs = [body({"instances": [instance([k] * 5, feature_0=[k]), instance([0] * 5, feature_1=[k])]}) for k in range(6)]
    reqs.insert(3, body({"instances": [instance([1] * 5, feature_2=[j]) for j in range(7)]}))  # alone > cap
    whole, _ = call(handler, reqs)
    monkeypatch.setattr(worker, "MAX_ROWS_PER_FORWARD", 5)
    groups = handler.preprocess([{"body": r} for r in reqs], FakeContext(Path("."), dict(TINY))).forwards
    assert [sum(b.rows) for b, _ in groups] == [4, 2, 7, 4, 2]
    split, _ = call(handler, reqs)
    for a, b in zip(whole, split):
        assert torch.allclose(torch.tensor(json.loads(a)["scores"]), torch.tensor(json.loads(b)["scores"]), atol=1e-5)


def test_large_batch_rows_is_refused_by_name_pointing_to_split_rows(tmp_path, archived):
    """handler.large_batch_rows (a large forward on a thread per CPU) measured worse than split_rows on
    every host and is gone: a config that still sets it fails at load, naming the key and what to set."""
    from dlrm_handler import TorchRecDLRMHandler

    message = (
        "handler.large_batch_rows: removed; use handler.split_rows (a large forward as parts at once, "
        "docs/model-config.md)"
    )
    for value in (256, 0):
        with pytest.raises(ConfigError) as info:
            DLRMConfig.from_dict({**TINY, "large_batch_rows": value})
        assert str(info.value) == message
    (tmp_path / "dlrm.pt").symlink_to(archived)
    with pytest.raises(ConfigError) as info:
        TorchRecDLRMHandler().initialize(FakeContext(tmp_path, {**TINY, "split_rows": 350, "large_batch_rows": 4}))
    assert str(info.value) == message


def test_a_forward_of_more_than_split_rows_runs_as_parts_on_the_workers_threads(
    tmp_path, archived, monkeypatch, caplog
):
    """handler.split_rows: with CPUs for more than one part (3 here, one torch thread each), a batch
    of more rows than that runs as parts at once on the handler's pool; a smaller one whole; the
    scores are the whole forward's. With one CPU it says so."""
    import logging

    from dlrm_handler import TorchRecDLRMHandler
    from dlrmkit import worker

    monkeypatch.setattr(worker, "available_cpus", lambda: 3)  # as on a 3-CPU host
    (tmp_path / "dlrm.pt").symlink_to(archived)
    section = {**TINY, "split_rows": 2, "torch_threads": 1}
    h = TorchRecDLRMHandler()
    with caplog.at_level(logging.INFO, logger="dlrmkit.worker"):
        h.initialize(FakeContext(tmp_path, section))
    assert "a forward of more than 2 rows split into up to 3 parts at once" in caplog.text
    submitted = []
    real = h.split_pool.submit
    h.split_pool.submit = lambda fn, model, dense, *a: submitted.append(dense.shape[0]) or real(fn, model, dense, *a)
    big = body({"instances": [instance([k, 1, -k, 0.5, k / 3], feature_0=[k], feature_2=[k, 7]) for k in range(7)]})
    small = body({"instances": [instance([1] * 5, feature_1=[2])]})
    out, _ = call(h, [big, small], section)
    assert submitted == [3, 3]  # 8 rows in 3 parts: rows 0-1 on this thread, 2-4 and 5-7 on the pool
    plain = TorchRecDLRMHandler()
    plain.initialize(FakeContext(tmp_path, {**TINY, "torch_threads": 1}))
    want, _ = call(plain, [big, small])
    for got, expected in zip(out, want):
        assert json.loads(got)["scores"] == pytest.approx(json.loads(expected)["scores"], abs=1e-6)
    submitted.clear()
    call(h, [small], section)
    assert submitted == []  # 1 row: whole, on this thread

    monkeypatch.setattr(worker, "available_cpus", lambda: 1)
    caplog.clear()
    one = TorchRecDLRMHandler()
    with caplog.at_level(logging.WARNING, logger="dlrmkit.worker"):
        one.initialize(FakeContext(tmp_path, section))
    assert one.split_pool is None
    assert "handler.split_rows 2: nothing to split onto (1 CPU(s), 1 torch thread(s) per part)" in caplog.text
    with pytest.raises(
        ConfigError,
        match=r"handler.split_rows: expected 0 \(never\) or a positive number of rows, "
        r"got -1 \(e.g. split_rows: 350\)",
    ):
        TorchRecDLRMHandler().initialize(FakeContext(tmp_path, {**section, "split_rows": -1}))


def lifecycle_section(tmp_path: Path) -> dict:
    """A worker that starts everything close() stops: a split pool (3 CPUs, split_rows 2) and a live
    watcher over an empty delta directory, whose shared tables run a writer process."""
    (tmp_path / "deltas").mkdir(exist_ok=True)
    return {**TINY, "split_rows": 2, "torch_threads": 1, "delta_dir": str(tmp_path / "deltas"), "delta_poll_s": 0.05}


def test_close_stops_the_split_pool_the_live_watcher_its_writer_process_and_the_metrics(
    tmp_path, archived, monkeypatch
):
    from dlrm_handler import TorchRecDLRMHandler
    from dlrmkit import worker

    monkeypatch.setattr(worker, "available_cpus", lambda: 3)
    (tmp_path / "dlrm.pt").symlink_to(archived)
    section = lifecycle_section(tmp_path)
    before = set(threading.enumerate())
    h = TorchRecDLRMHandler()
    h.initialize(FakeContext(tmp_path, section))
    big = body({"instances": [instance([k] * 5, feature_0=[k]) for k in range(7)]})
    out, ctx = call(h, [big], section)  # parts on the pool: its threads start
    assert ctx.statuses == {} and len(json.loads(out[0])["scores"]) == 7
    writer = wait_until(lambda: h.deltas.process.child, lambda child: child is not None)
    assert writer is not None and writer.poll() is None
    helpers = [t for t in threading.enumerate() if t not in before]  # this handler's (the pool's start when used)
    assert {t.name.split("_")[0] for t in helpers} == {"dlrm-delta-watcher", "dlrm-split", "dlrm-metrics"}, helpers
    h.close()
    assert [t.name for t in helpers if t.is_alive()] == []
    assert writer.poll() is not None  # killed and reaped
    assert h.deltas is None and h.split_pool is None and not h.initialized
    h.close()  # twice: nothing left to stop


def test_close_runs_when_torchserve_closes_the_workers_socket(tmp_path, archived):
    """A worker whose frontend's socket closes exits on its own: TorchServe's message loop calls
    sys.exit(0) (ts.protocol.otf_message_handler), and that exit runs close(). Here that loop reads a
    closed socket in a worker process. (When TorchServe stops a worker it also kills it at once, before
    any exit hook runs: tests/test_variants_server.py checks that nothing is left then.)"""
    (tmp_path / "dlrm.pt").symlink_to(archived)
    code = f"""
import socket, sys
from pathlib import Path
import dlrm_handler
import dlrmkit.worker
from conftest import FakeContext
from helpers import wait_until
from ts.protocol.otf_message_handler import retrieve_msg

close = dlrm_handler.TorchRecDLRMHandler.close
def said(self):
    watcher, writer, pool = self.deltas._thread, self.deltas.process.child, self.split_pool
    close(self)
    print("closed:", watcher.is_alive(), writer.poll() is not None, pool._shutdown, flush=True)
dlrm_handler.TorchRecDLRMHandler.close = said
dlrmkit.worker.available_cpus = lambda: 3
h = dlrm_handler.TorchRecDLRMHandler()
h.initialize(FakeContext(Path({str(tmp_path)!r}), {lifecycle_section(tmp_path)!r}))
wait_until(lambda: h.deltas.process.child, lambda child: child is not None)
print("serving", h.deltas.process.child.pid, flush=True)
frontend, worker = socket.socketpair()
frontend.close()
retrieve_msg(worker)
"""
    # conftest, helpers, and this tree's kit and handler (ahead of an installed one)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "serving" in run.stdout and run.stdout.rstrip().endswith("closed: False True True"), run.stdout
