"""Integration: a DLRM_DCN (fp32) and a DLRM_Projection (int8) in one real TorchServe, batching
on: concurrent mixed requests to both get the in-process scores, a bad one its own 400; the
projection's large batches as parts at once (split_rows), the DCN's whole; unregistering the DCN
(which follows a delta directory) leaves none of its worker processes nor their writer behind."""

from __future__ import annotations

import json
import random
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, variant
from dlrmkit.config import DLRMConfig
from dlrmkit.batch import collate, scores
from dlrmkit.forms import RequestParser
from dlrmkit.model import DLRMFactory
from helpers import instance, metrics_delta, settled, wait_until
from scripts.tsctl import Server, post, request

pytestmark = pytest.mark.integration

MODELS = {"dlrm_dcn": ("dcn", "fp32"), "dlrm_projection": ("projection", "int8")}
PROBE = (ROOT / "sample_requests" / "seed_multi_hot.json").read_bytes()


def build(tmp: Path, name: str, interaction: str, dtype: str) -> Path:
    """The shipped model-config.yaml as ``interaction`` with ``dtype`` tables; a long batch
    delay makes concurrent requests share TorchServe batches."""
    from scripts import build_mar

    doc = yaml.safe_load((ROOT / "model-config.yaml").read_text())
    doc.update(batchSize=8, maxBatchDelay=100)
    doc["handler"].update(variant(interaction, doc["handler"]["embedding_dim"]), embedding_dtype=dtype)
    if interaction != "dcn":  # batches of more than 3 rows as parts at once on the worker's threads: both paths
        doc["handler"]["split_rows"] = 3
    else:  # following an (empty) delta directory: a watcher thread, and the shared tables' writer process
        (tmp / "deltas").mkdir(exist_ok=True)
        doc["handler"]["delta_dir"] = str(tmp / "deltas")
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    build_mar.main(["--config", str(path), "--output-dir", str(tmp / "store"), "--model-name", name])
    return path


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(server, {model name: (config, the in-process model of its archive, the config file)})."""
    tmp = tmp_path_factory.mktemp("ts-variants")
    local = {}
    for name, (interaction, dtype) in MODELS.items():
        path = build(tmp, name, interaction, dtype)
        config = DLRMConfig.from_yaml(path)
        local[name] = (config, load_archive(config, tmp / "store" / f"{name}.mar", tmp / name), path)
    srv = Server.on_free_ports(
        tmp / "home", model_store=tmp / "store", overrides={"load_models": ",".join(f"{n}={n}.mar" for n in MODELS)}
    )
    try:
        srv.start()
        for name in MODELS:
            srv.wait_ready(name, PROBE, timeout=240)
        yield srv, local
    finally:
        srv.stop()
        assert not srv.running()


def load_archive(config: DLRMConfig, mar: Path, tmp: Path):
    """The model of ``mar``, loaded in this process as the worker loads it."""
    with zipfile.ZipFile(mar) as z:
        z.extract("dlrm.pt", tmp)
    return DLRMFactory(config).load(tmp / "dlrm.pt")


def in_process(config, model, raw: bytes) -> list[float]:
    return scores(model, collate([RequestParser(config).parse(raw)], config)[0], config)[0]


def random_request(rng: random.Random) -> bytes:
    def one():
        keys = rng.sample(["feature_0", "feature_1", "feature_2"], rng.randint(0, 3))
        return instance(
            [round(rng.uniform(-2, 2), 3) for _ in range(5)],
            **{k: [rng.randrange(1000) for _ in range(rng.randint(0, 4))] for k in keys},
        )

    return json.dumps(
        one() if rng.random() < 0.6 else {"instances": [one() for _ in range(rng.randint(1, 5))]}
    ).encode()


def test_in_process_model_is_the_variant(served):
    _, local = served
    assert type(local["dlrm_dcn"][1]).__name__ == "DLRM_DCN"
    assert type(local["dlrm_projection"][1]).__name__ == "DLRM_Projection"
    qebc = local["dlrm_projection"][1].sparse_arch.embedding_bag_collection
    assert type(qebc).__module__ == "torchrec.quant.embedding_modules"


def test_concurrent_mixed_requests_to_both_variants_score_as_in_process(served):
    srv, local = served
    rng = random.Random(3)
    good = [(name, random_request(rng), None) for _ in range(20) for name in MODELS]
    bad = [
        (
            name,
            b'{"dense":[1,2,3,4,5],"sparse":{"keys":["feature_2"],"values":[7, 1000],"lengths":[2]}}',
            "sparse.values[1]: id 1000 is out of range for feature 'feature_2'",
        )
        for name in MODELS
    ]
    bad += [(name, b'{"dense":[1,2,3],"sparse":{"keys":[],"values":[],"lengths":[]}}', "dense:") for name in MODELS]
    mixed = good + bad
    rng.shuffle(mixed)
    before = {name: settled(srv, model=name) for name in MODELS}
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda m: post(f"{srv.url}/predictions/{m[0]}", m[1]), mixed))
    for name in MODELS:  # the handler's counters, once every request is counted
        sent = sum(m[0] == name for m in mixed)
        delta = metrics_delta(srv, {"dlrm_requests_total": sent}, before[name], model=name)
        assert delta["dlrm_requests_total"] == sent, (name, delta)
        assert delta["dlrm_batches_total"] < sent, f"{name}: no two requests shared a TorchServe batch"
    for (name, raw, error), (status, body, _) in zip(mixed, answers):
        answer = json.loads(body)
        if error:
            assert status == 400 and answer["code"] == 400 and answer["message"].startswith(error), (name, answer)
            continue
        assert status == 200, (name, raw, answer)
        want = in_process(*local[name][:2], raw)
        assert len(answer["scores"]) == len(want)
        assert max(abs(a - b) for a, b in zip(answer["scores"], want)) <= 1e-5, (name, answer, want)


def test_large_batches_run_as_parts_at_once_where_cpus_allow(served):
    """handler.split_rows: each worker says how many parts a batch of more than 3 rows runs as (one
    per CPU of its own, TorchServe's workers one thread each), or that one CPU leaves nothing to
    split onto; test_concurrent_mixed_requests_... checks the scores of batches of both sizes."""
    from dlrmkit.cpus import split_parts, torch_threads

    srv, _ = served
    log = (srv.log_dir / "model_log.log").read_text()
    parts = split_parts(torch_threads(0, None))
    said = (
        f"a forward of more than 3 rows split into up to {parts} parts at once"
        if parts > 1
        else "handler.split_rows 3: nothing to split onto"
    )
    assert said in log, log[-3000:]


def test_rollout_and_rollback_of_a_variant(served, tmp_path):
    """scripts/rollout.py builds the next version of the int8 projection model from its config
    with another seed, which then serves its own in-process scores; --rollback restores 1.0's."""
    from scripts import rollout

    srv, local = served
    name = "dlrm_projection"
    config, model, path = local[name]
    doc = yaml.safe_load(path.read_text())
    doc["handler"]["seed"] = 1
    (tmp_path / "next.yaml").write_text(yaml.safe_dump(doc))
    common = [
        "--home",
        str(srv.home),
        "--model",
        name,
        "--timeout",
        "180",
        "--sample",
        str(ROOT / "sample_requests" / "seed_multi_hot.json"),
    ]
    raws = [random_request(random.Random(i)) for i in range(6)]

    def served_as(want_model):
        for raw in raws:
            status, body, _ = post(f"{srv.url}/predictions/{name}", raw)
            assert status == 200, body
            got, want = json.loads(body)["scores"], in_process(config, want_model, raw)
            assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-5, (got, want)

    assert rollout.main([*common, "--config", str(tmp_path / "next.yaml")]) == 0
    served_as(load_archive(config, srv.model_store / f"{name}-v2.0.mar", tmp_path))
    assert rollout.main([*common, "--rollback"]) == 0
    served_as(model)


def test_unregistering_a_model_leaves_none_of_its_worker_processes(served):
    """TorchServe 0.12 stops a worker by closing its socket and killing it at once (SIGKILL, before
    the handler's close() can run): afterwards neither the worker nor any process it started (the
    live watcher's writer) is left. Last in the module: the model is gone after it."""
    srv, _ = served
    name = "dlrm_dcn"
    pids = srv.worker_pids(name)
    assert pids
    children = wait_until(lambda: {pid: _children(pid) for pid in pids}, lambda c: any(c.values()))
    assert any(children.values()), children  # the live watcher's writer process
    status, body, _ = request("DELETE", f"{srv.management_url}/models/{name}", headers=srv.auth("management"))
    assert status == 200, body
    left = wait_until(lambda: [p for p in pids + sum(children.values(), []) if _alive(p)], lambda alive: not alive)
    assert left == [], (left, children)


def _children(pid: int) -> list[int]:
    """The processes ``pid`` started, from any of its threads (each thread lists its own)."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie waiting for its parent to reap it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
