"""Operations, without a server: the handler's metrics and request tracing, metrics.yaml, the
model-config timeouts, and the readiness and rollout scripts' own logic."""

from __future__ import annotations

import collections
import json
import logging
import re
import zipfile
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, TINY, FakeContext, call
from dlrmkit.config import DLRMConfig
from helpers import DENSE, body, instance

PHASES = ("dlrm_preprocess_ms_total", "dlrm_inference_ms_total", "dlrm_postprocess_ms_total")


@pytest.fixture
def modulo_handler(tmp_path, archived):
    from dlrm_handler import TorchRecDLRMHandler

    (tmp_path / "dlrm.pt").symlink_to(archived)
    h = TorchRecDLRMHandler()
    h.initialize(FakeContext(tmp_path, {**TINY, "id_overflow": "modulo"}))
    return h


def mixed_batch() -> list[bytes]:
    return [
        body(instance(DENSE, feature_0=[1, 2])),  # 1 row
        b"{not json",  # BadRequest
        body({"instances": [instance(DENSE, feature_1=[3]), instance(DENSE)]}),  # 2 rows
        body({"instances": [instance(DENSE)] * 9}),  # PayloadTooLarge (max 8)
        body(instance(DENSE, feature_0=[20])),  # id out of range: BadRequest
    ]


def test_handler_counts_batches_requests_instances_and_rejections(handler):
    _, ctx = call(handler, mixed_batch())
    m = ctx.metrics
    assert m.total("dlrm_batches_total") == 1
    assert m.total("dlrm_requests_total") == 5
    assert m.total("dlrm_instances_total") == 3
    assert m.total("dlrm_rejected_requests_total", ErrorType="BadRequest") == 2
    assert m.total("dlrm_rejected_requests_total", ErrorType="PayloadTooLarge") == 1
    assert "dlrm_remapped_ids_total" not in {n for n, _, _ in m.recorded}  # id_overflow: error
    phases = {n: (v, unit) for n, v, unit in m.recorded if n in PHASES}
    assert set(phases) == set(PHASES) and all(unit == "ms" and 0 <= v < 10_000 for v, unit in phases.values())
    handler_time = next(v for n, v, _ in m.recorded if n == "HandlerTime")
    assert sum(v for v, _ in phases.values()) <= handler_time + 0.01


def test_handler_counts_remapped_ids_with_modulo(modulo_handler):
    # tables of 20, 30, 40 rows: 20 -> 0, 45 -> 5 and 99 -> 19 are folded; 19 and 39 are not
    out, ctx = call(
        modulo_handler,
        [body(instance(DENSE, feature_0=[20, 19, 99], feature_2=[45, 39])), body(instance(DENSE, feature_1=[29]))],
    )
    assert [json.loads(o).get("code") for o in out] == [None, None]
    assert ctx.metrics.total("dlrm_remapped_ids_total") == 3
    assert ctx.metrics.total("dlrm_instances_total") == 2


def test_a_batch_of_only_bad_requests_counts_zero_instances(handler):
    _, ctx = call(handler, [b"", b"[]"])
    assert ctx.metrics.total("dlrm_instances_total") == 0
    assert ctx.metrics.total("dlrm_rejected_requests_total", ErrorType="BadRequest") == 2


def test_every_metric_the_handler_sends_is_declared_with_its_dimensions(modulo_handler, caplog):
    """TorchServe's own metrics cache over the shipped metrics.yaml: whatever the handler emits
    must be declared there with the same dimension names in the same order, or the frontend
    drops it without a word."""
    from ts.metrics.metric_cache_yaml_impl import MetricsCacheYamlImpl

    declared = {}
    for kind, metrics in yaml.safe_load((ROOT / "metrics.yaml").read_text())["model_metrics"].items():
        for m in metrics:
            declared[m["name"]] = (kind, m["dimensions"])
    cache = MetricsCacheYamlImpl(str(ROOT / "metrics.yaml"))
    cache.initialize_cache()
    cache.model_name = "dlrm"
    batch = mixed_batch() + [body(instance(DENSE, feature_0=[25]))]
    ctx = FakeContext(Path("."), dict(TINY))
    ctx.metrics = cache
    ctx.request_ids = {i: f"req-{i}" for i in range(len(batch))}
    cache.set_request_ids(ctx.request_ids)
    with caplog.at_level(logging.INFO):
        modulo_handler.handle([{"body": b} for b in batch], ctx)
        modulo_handler.tally.flush()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("[METRICS]")]
    assert not [line for line in lines if "Failed" in line], lines
    emitted = {}
    for line in lines:
        m = re.match(r"\[METRICS\](\w+)\.\w+:([\d.]+)\|#([^|]*)\|#type:(\w+)", line)
        assert m, line
        name, value, dims, kind = m.groups()
        emitted.setdefault(name, []).append(float(value))
        assert name in declared, f"{name} is not declared in metrics.yaml"
        assert kind.lower() == declared[name][0], name
        assert [d.split(":")[0] for d in dims.split(",")] == declared[name][1], name
    want = {
        "HandlerTime",
        "dlrm_batches_total",
        "dlrm_requests_total",
        "dlrm_instances_total",
        "dlrm_rejected_requests_total",
        "dlrm_remapped_ids_total",
        *PHASES,
    }
    assert set(emitted) == want
    # with modulo, the out-of-range id of mixed_batch() is folded too: 5 rows, 2 ids remapped
    assert emitted["dlrm_requests_total"] == [6] and emitted["dlrm_instances_total"] == [5]
    assert emitted["dlrm_remapped_ids_total"] == [2] and emitted["dlrm_rejected_requests_total"] == [1, 1]


def handler_with(tmp_path, archived, monkeypatch, seconds: str, ctx: FakeContext | None = None):
    """A handler initialized with DLRM_METRICS_SECONDS=``seconds`` on ``ctx`` (a fresh context by default)."""
    from dlrm_handler import TorchRecDLRMHandler

    monkeypatch.setenv("DLRM_METRICS_SECONDS", seconds)
    (tmp_path / "dlrm.pt").symlink_to(archived)
    h = TorchRecDLRMHandler()
    h.initialize(ctx or FakeContext(tmp_path, dict(TINY)))
    return h


def test_the_handlers_metrics_go_out_summed_not_once_a_batch(tmp_path, archived, monkeypatch):
    """Every metric line costs TorchServe's frontend a read, a match and a log line: the handler
    sums a batch's counters with the batches before and emits them every DLRM_METRICS_SECONDS
    (here 60, so nothing goes out until close); the totals are what per-batch emission gives."""
    h = handler_with(tmp_path, archived, monkeypatch, "60")
    ctx = FakeContext(Path("."), dict(TINY))
    batches = [mixed_batch(), [body(instance(DENSE))], [b"{"]]
    for batch in batches:
        h.handle([{"body": b} for b in batch], ctx)
    assert ctx.metrics.recorded == []  # none yet: one line each after 3 batches, not 3
    h.close()
    m = ctx.metrics
    lines = collections.Counter(n for n, _, _ in m.recorded)
    assert lines.pop("dlrm_rejected_requests_total") == 2  # one per ErrorType
    assert set(lines.values()) == {1}, lines  # one line per metric
    assert m.total("dlrm_batches_total") == 3
    assert m.total("dlrm_requests_total") == 7
    assert m.total("dlrm_instances_total") == 4
    assert m.total("dlrm_rejected_requests_total", ErrorType="BadRequest") == 3
    assert m.total("dlrm_rejected_requests_total", ErrorType="PayloadTooLarge") == 1
    handler_time = [v for n, v, _ in m.recorded if n == "HandlerTime"]
    phases = sum(v for n, v, _ in m.recorded if n in PHASES)
    assert len(handler_time) == 1 and phases > handler_time[0]  # a gauge: the last batch's, the phases: all 3


def test_torchserves_own_prediction_time_goes_out_with_the_handlers_sums(tmp_path, archived, monkeypatch):
    """TorchServe's service records PredictionTime on the context's metrics after every batch, a
    line each: the handler puts its tally there, so it goes out with the handler's sums (the last
    batch's, a gauge); any other metric, and PredictionTime with dimensions, passes at once."""
    from ts.metrics.dimension import Dimension
    from ts.service import PREDICTION_METRIC

    ctx = FakeContext(tmp_path, dict(TINY))
    sink = ctx.metrics
    h = handler_with(tmp_path, archived, monkeypatch, "60", ctx)
    try:
        for ms in (4.5, 1.25):  # as ts/service.py's Service.predict does after each batch
            h.handle([{"body": body(instance(DENSE))}], ctx)
            ctx.metrics.request_ids = {0: "req"}
            ctx.metrics.add_time(PREDICTION_METRIC, ms)
        ctx.metrics.add_time("WorkerLoadTime", 7.0)
        ctx.metrics.add_time(PREDICTION_METRIC, 3.0, None, "ms", [Dimension("Stage", "x")])
        assert sink.recorded == [("WorkerLoadTime", 7.0, "ms"), (PREDICTION_METRIC, 3.0, "ms")]
        assert sink.dimensions[-1] == {"Stage": "x"} and sink.request_ids == {0: "req"}
    finally:
        h.close()
    assert [(n, v) for n, v, _ in sink.recorded if n == PREDICTION_METRIC] == [
        (PREDICTION_METRIC, 3.0),
        (PREDICTION_METRIC, 1.25),
    ]
    assert sink.total("dlrm_batches_total") == 2


def test_with_zero_seconds_every_batch_emits_its_own_metrics_and_the_receipt_line(tmp_path, archived, monkeypatch):
    from dlrm_handler import RECEIPT

    h = handler_with(tmp_path, archived, monkeypatch, "0")
    try:
        ctx = FakeContext(Path("."), dict(TINY))
        for _ in range(2):
            h.handle([{"body": body(instance(DENSE))}], ctx)
        assert [v for n, v, _ in ctx.metrics.recorded if n == "dlrm_batches_total"] == [1, 1]
        assert type(h.sink).__name__ == "FakeMetrics"  # TorchServe's PredictionTime per batch too: not wrapped
        assert logging.getLogger().filter(logging.makeLogRecord({"msg": RECEIPT, "args": (1,)}))
    finally:
        h.close()


def test_the_workers_receipt_line_is_dropped_and_only_it(handler):
    """TorchServe's worker logs a line per batch that says only the time (on the root logger); the
    frontend matches it against two patterns and logs it again. Dropped once the handler is up."""
    from dlrm_handler import RECEIPT

    root = logging.getLogger()
    assert not root.filter(logging.makeLogRecord({"msg": RECEIPT, "args": (1796643641,)}))
    assert root.filter(logging.makeLogRecord({"msg": "Backend worker process died.", "args": ()}))


@pytest.mark.parametrize("raw", ["-1", "soon", "61", "nan"])
def test_a_bad_metrics_interval_fails_the_worker_naming_the_variable(tmp_path, archived, monkeypatch, raw):
    from dlrmkit.errors import ConfigError

    with pytest.raises(ConfigError, match=f"DLRM_METRICS_SECONDS='{raw}': expected seconds from 0"):
        handler_with(tmp_path, archived, monkeypatch, raw)


def test_client_request_id_is_echoed_and_rejections_are_logged_without_headers(handler, caplog):
    secret = "Bearer s3cr3t-t0ken"
    ctx = FakeContext(Path("."), dict(TINY))
    ctx.request_ids = {i: f"ts-{i}" for i in range(5)}
    ids = {
        0: {"X-Request-Id": "trace-0"},
        1: {"x-request-id": "trace-1"},
        2: {"X-Request-Id": "has space"},
        3: {"X-Request-Id": "x" * 129},
        4: {},
    }
    ctx.headers = {i: {**h, "Authorization": secret} for i, h in ids.items()}
    good, bad = body(instance(DENSE, feature_0=[1])), b"{"
    with caplog.at_level(logging.INFO, logger="dlrm_handler"):
        handler.handle([{"body": b} for b in (good, bad, bad, good, bad)], ctx)
    # only short visible-ASCII ids come back; TorchServe itself sends its id as x-request-id
    assert ctx.response_headers == {0: {"X-Client-Request-Id": "trace-0"}, 1: {"X-Client-Request-Id": "trace-1"}}
    rejected = [r.getMessage() for r in caplog.records if r.getMessage().startswith("rejected request")]
    assert rejected == [
        "rejected request ts-1 client trace-1 (400): body: expected a JSON object, got malformed JSON "
        "(input data was truncated)",
        "rejected request ts-2 (400): body: expected a JSON object, got malformed JSON (input data was truncated)",
        "rejected request ts-4 (400): body: expected a JSON object, got malformed JSON (input data was truncated)",
    ]
    assert "s3cr3t" not in caplog.text and "has space" not in caplog.text


@pytest.mark.parametrize("name", ["model-config.yaml", "model-config.criteo.yaml"])
def test_timeouts_are_sized_from_the_model(name):
    """The rule in model-config.yaml's comment: startup = imports + one read of the weights,
    doubled; response = the slowest batch plus paging the tables in, with a wide margin."""
    doc = yaml.safe_load((ROOT / name).read_text())
    c = DLRMConfig.from_dict(doc["handler"])
    weights_mb = sum(c.num_embeddings) * c.embedding_dim * 4 / 1e6
    assert doc["startupTimeout"] >= max(120, 2 * (30 + weights_mb / 100))
    assert doc["responseTimeout"] >= max(60, 10 * (5 + weights_mb / 100))


def test_next_version_counts_on_from_the_major():
    from scripts.rollout import RolloutError, next_version

    assert [next_version(v) for v in ("1.0", "7", "2.3", "9.0")] == ["2.0", "8", "3.0", "10.0"]
    with pytest.raises(RolloutError, match="pass --version"):
        next_version("latest")


def test_archive_version_reads_the_manifest(tmp_path):
    from scripts.rollout import RolloutError, archive_version

    mar = tmp_path / "dlrm-v4.mar"
    with zipfile.ZipFile(mar, "w") as z:
        z.writestr("MAR-INF/MANIFEST.json", json.dumps({"model": {"modelName": "dlrm", "modelVersion": "4.0"}}))
    assert archive_version(mar, "dlrm") == "4.0"
    with pytest.raises(RolloutError, match="archive of model 'dlrm', not 'other'"):
        archive_version(mar, "other")
    (tmp_path / "junk.mar").write_bytes(b"junk")
    with pytest.raises(RolloutError, match="not a model archive"):
        archive_version(tmp_path / "junk.mar", "dlrm")
    big = tmp_path / "big-v2" / "MAR-INF"  # a scripts/build_big.py model directory (--repack writes one)
    big.mkdir(parents=True)
    (big / "MANIFEST.json").write_text(json.dumps({"model": {"modelName": "big", "modelVersion": "2.0"}}))
    assert archive_version(tmp_path / "big-v2", "big") == "2.0"
    with pytest.raises(RolloutError, match="not a model archive"):
        archive_version(tmp_path, "big")


def test_scripts_say_when_no_server_was_started(tmp_path, capsys):
    from scripts import rollout
    from scripts import serve

    assert serve.main(["ready", "--home", str(tmp_path)]) == 1
    assert "not ready: no server was started from" in capsys.readouterr().out
    assert rollout.main(["--home", str(tmp_path), "--archive", "x.mar"]) == 1
    assert "start the server first" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        rollout.main(["--rollback", "--archive", "x.mar"])


def test_free_ports_lie_below_the_ephemeral_range_and_are_never_given_twice(tmp_path):
    """An outgoing connection takes its port from the ephemeral range: a server's port from that
    range could be taken between the choice and TorchServe's bind (a CI run failed so)."""
    import socket

    from scripts import tsctl

    ports = [tsctl.free_port() for _ in range(50)]
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert len(set(ports)) == 50 and all(1024 <= p < low for p in ports)
    with socket.socket() as s:  # free when given
        s.bind(("127.0.0.1", ports[-1]))
    # another range, as a host may set it
    odd = tmp_path / "range"
    odd.write_text("40000\t50000\n")
    assert all(28000 <= tsctl.free_port(odd) < 40000 for _ in range(20))
