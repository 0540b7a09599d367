"""Unit: the delta format, every refusal, conversion per dtype, ordering and idempotence
(dlrmkit/live/), and the handler's wiring with a fake TorchServe context."""

from __future__ import annotations

import copy
import json
import os
import time

import pytest
import torch

from conftest import TINY, FakeContext, tiny_config
from dlrmkit.model import DLRMFactory
from dlrmkit.live import (
    BASE_FILE,
    DeltaApplier,
    base_version,
    changes,
    delta_path,
    read_delta,
    ready_sequences,
    target_for,
    write_delta,
)
from dlrmkit.config import DLRMConfig
from dlrmkit.errors import ConfigError
from dlrmkit.scale import EBC, TABLES, fused_rows, fused_tables
from helpers import refuse_mmap, archive, batch, forward

DTYPES = ("fp32", "fp16", "int8", "int4")
TABLE = TABLES + "{}.weight"


def trained_further(model, seed: int = 7, rows: int = 5):
    """A copy of ``model`` whose first ``rows`` rows of every table (and every dense parameter) moved."""
    new = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in new.sparse_arch.embedding_bag_collection.embedding_bags.values():
            t.weight[:rows] = torch.rand(rows, t.weight.shape[1], generator=gen) * 2 - 1
        for k, p in new.named_parameters():
            if not k.startswith(EBC):
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return new


def diff(old, new, dense: bool = True):
    """What scripts/publish_delta.py writes for ``old`` -> ``new``: (tables, dense)."""
    a, b = old.state_dict(), new.state_dict()
    tables = {}
    for key, w in b.items():
        if key.startswith(EBC):
            ids = torch.nonzero((w != a[key]).any(dim=1)).reshape(-1)
            tables[key[len(TABLES) : -len(".weight")]] = (ids, w[ids])
    rest = {k: v for k, v in b.items() if not k.startswith(EBC)} if dense else None
    return tables, rest


def served(tmp_path, model, dtype):
    """The model as a worker serves it: the archive loaded (memory-mapped), dense half frozen."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = archive(tmp_path, model, dtype)
    factory = DLRMFactory(tiny_config(embedding_dtype=dtype))
    live = factory.load(path)
    factory.freeze_dense(live)
    return live, factory, base_version(path)


def applier(tmp_path, model, dtype="fp32", name="dlrm", **cfg):
    live, factory, base = served(tmp_path, model, dtype)
    config = tiny_config(embedding_dtype=dtype, **cfg)
    target = target_for(config, factory, name, base)
    return DeltaApplier(live, config, factory, tmp_path / "deltas", target, state_dir=tmp_path), base


def table_bytes(model):
    return {k: v.clone() for k, v in fused_tables(model.sparse_arch.embedding_bag_collection).items()}


def test_a_delta_is_written_atomically_and_reads_back(tmp_path):
    ids, rows = torch.tensor([3, 1]), torch.randn(2, 8)
    path = write_delta(tmp_path, "dlrm", "abc", 1, {"feature_0": (ids, rows)}, {"dense_arch.w": torch.ones(2)})
    assert path == delta_path(tmp_path, 1) and delta_path(tmp_path, 1, ".ready").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["delta-00000001.ready", "delta-00000001.safetensors"]
    d = read_delta(path)
    assert (d.model, d.base, d.sequence, d.rows) == ("dlrm", "abc", 1, 2)
    assert torch.equal(d.tables["feature_0"][0], ids) and torch.equal(d.tables["feature_0"][1], rows)
    assert torch.equal(d.dense["dense_arch.w"], torch.ones(2))
    assert list(ready_sequences(tmp_path)) == [1]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_convert_to_the_bytes_a_full_build_makes(dtype):
    model = DLRMFactory(tiny_config()).random()
    full = DLRMFactory(tiny_config(embedding_dtype=dtype)).archive_state(copy.deepcopy(model))
    ids = torch.tensor([0, 7, 19])
    weights = model.state_dict()[TABLE.format("feature_0")]
    got = fused_rows({"feature_0": weights[ids]}, dtype)["feature_0"]
    want = full[TABLE.format("feature_0")][ids]
    assert torch.equal(got, want[:, : got.shape[1]])


@pytest.mark.parametrize("dtype", DTYPES)
def test_applied_delta_serves_what_a_rebuilt_archive_serves(tmp_path, model, dtype):
    new = trained_further(model)
    app, base = applier(tmp_path, model, dtype)
    rebuilt, _, _ = served(tmp_path / "new", new, dtype)
    dense, kjt = batch(64, seed=5)
    before = forward(app.model, dense, kjt)
    tables, params = diff(model, new)
    write_delta(app.directory, "dlrm", base, 1, tables, params)
    assert app.catch_up() == 1 and app.applied == 1
    after = forward(app.model, dense, kjt)
    assert not torch.allclose(before, after, atol=1e-3)  # the delta moved the scores
    torch.testing.assert_close(after, forward(rebuilt, dense, kjt), atol=1e-6, rtol=1e-6)
    rebuilt_bytes = table_bytes(rebuilt)  # byte for byte, padding included
    assert all(torch.equal(v, rebuilt_bytes[k]) for k, v in table_bytes(app.model).items())
    assert json.loads((tmp_path / "delta-state").glob("*.json").__next__().read_text())["sequence"] == 1


BAD = {
    "model": lambda t, d: ({"model": "other"}, t, d),
    "base": lambda t, d: ({"base": "0123456789abcdef"}, t, d),
    "table": lambda t, d: ({}, {**t, "feature_9": (torch.tensor([1]), torch.zeros(1, 8))}, d),
    "shape": lambda t, d: ({}, {"feature_0": (torch.tensor([1]), torch.zeros(1, 4))}, d),
    "range": lambda t, d: ({}, {"feature_0": (torch.tensor([20]), torch.zeros(1, 8))}, d),
    "duplicate": lambda t, d: ({}, {"feature_0": (torch.tensor([2, 2]), torch.zeros(2, 8))}, d),
    "nonfinite": lambda t, d: ({}, {"feature_1": (torch.tensor([2]), torch.full((1, 8), float("nan")))}, d),
    "dense": lambda t, d: ({}, t, {k: v for k, v in list(d.items())[1:]}),
    "sequence": lambda t, d: ({"sequence": 2}, t, d),
}


@pytest.mark.parametrize("reason", sorted(BAD))
def test_a_bad_delta_is_refused_and_changes_nothing(tmp_path, model, reason):
    app, base = applier(tmp_path, model, "int8")
    tables, params = diff(model, trained_further(model))
    meta, tables, params = BAD[reason](tables, params)
    args = {"model": "dlrm", "base": base, "sequence": 1, **meta}
    path = write_delta(app.directory, args["model"], args["base"], args["sequence"], tables, params)
    if reason == "sequence":  # a file whose name and metadata disagree
        path.rename(delta_path(app.directory, 1))
        delta_path(app.directory, 2, ".ready").rename(delta_path(app.directory, 1, ".ready"))
    before, dense_before = table_bytes(app.model), app.model.dense_arch
    assert app.catch_up() == 0
    assert app.applied == 0 and app.refused[1][1] == reason
    assert all(torch.equal(v, before[k]) for k, v in table_bytes(app.model).items())
    assert app.model.dense_arch is dense_before


@pytest.mark.parametrize("damage", ["truncated", "checksum", "marker without file"])
def test_a_damaged_file_is_refused(tmp_path, model, damage):
    app, base = applier(tmp_path, model)
    tables, _ = diff(model, trained_further(model))
    path = write_delta(app.directory, "dlrm", base, 1, tables)
    data = bytearray(path.read_bytes())
    if damage == "truncated":
        path.write_bytes(data[: len(data) - 10])
    elif damage == "checksum":
        data[-1] ^= 0xFF  # the last byte of the last tensor
        path.write_bytes(bytes(data))
    else:
        path.unlink()
    assert app.catch_up() == 0 and app.applied == 0
    assert app.refused[1][1] == {"truncated": "corrupt", "checksum": "checksum"}.get(damage, "corrupt")


def test_a_dense_delta_compiles_a_compiled_dense_half_again(tmp_path, model, monkeypatch):
    """bf16 (compiled past the CPU check, so that an AVX2 host runs it too): a dense delta is
    compiled into a new dense half that serves the new weights; rows-only deltas keep the old one."""
    from dlrmkit import dense as dense_half

    monkeypatch.setattr(dense_half, "unsupported", lambda precision, flags: None)
    live, factory, base = served(tmp_path, model, "fp32")
    config = tiny_config(dense_precision="bf16")
    live, line = dense_half.compile_dense(live, config, "bf16")
    assert isinstance(live, dense_half.ServedDLRM), line
    target = target_for(config, factory, "dlrm", base)
    app = DeltaApplier(live, config, factory, tmp_path / "d", target, state_dir=tmp_path)
    new = trained_further(model)
    tables, params = diff(model, new)
    old_half = live.dense
    write_delta(app.directory, "dlrm", base, 1, tables)  # rows only
    assert app.catch_up() == 1 and app.model.dense is old_half
    write_delta(app.directory, "dlrm", base, 2, {}, params)
    assert app.catch_up() == 1 and app.model.dense is not old_half
    rebuilt, _, _ = served(tmp_path / "new", new, "fp32")
    dense, kjt = batch(64, seed=5)
    got, want = torch.sigmoid(forward(app.model, dense, kjt)), torch.sigmoid(forward(rebuilt, dense, kjt))
    assert float((got - want).abs().mean()) <= 0.02, (got - want).abs().max()  # bf16 of the new weights
    before = torch.sigmoid(forward(served(tmp_path / "old", model, "fp32")[0], dense, kjt))
    assert float((got - before).abs().mean()) > 3 * float((got - want).abs().mean())  # not the old ones


def test_deltas_apply_in_order_wait_for_a_gap_and_never_twice(tmp_path, model):
    app, base = applier(tmp_path, model, "int8")
    steps = [trained_further(model, seed=s, rows=3 + s) for s in range(3)]
    deltas = [diff(a, b, dense=False)[0] for a, b in zip([model, *steps], steps)]
    write_delta(app.directory, "dlrm", base, 2, deltas[1])
    write_delta(app.directory, "dlrm", base, 3, deltas[2])
    assert app.catch_up() == 0 and app.applied == 0  # 1 is missing: wait, apply nothing out of order
    assert app.lag_seconds() >= 0
    write_delta(app.directory, "dlrm", base, 1, deltas[0])
    assert app.catch_up() == 3 and app.applied == 3
    state = table_bytes(app.model)
    assert app.catch_up() == 0  # nothing applied twice
    # A restarted worker (a fresh load of the same archive) comes up with the same tables.
    again, _ = applier(tmp_path / "restart", model, "int8")
    again.directory = app.directory
    assert again.catch_up() == 3
    assert all(torch.equal(v, state[k]) for k, v in table_bytes(again.model).items())


def test_a_refused_delta_replaced_by_a_good_one_resumes_the_stream(tmp_path, model):
    app, base = applier(tmp_path, model)
    tables, _ = diff(model, trained_further(model))
    write_delta(app.directory, "dlrm", "wrong", 1, tables)
    assert app.catch_up() == 0 and app.catch_up() == 0  # refused once, then not re-read
    write_delta(app.directory, "dlrm", base, 1, tables)
    assert app.catch_up() == 1


def test_serving_holds_the_lock_and_yields_the_sequence(tmp_path, model):
    app, base = applier(tmp_path, model)
    with app.serving() as seq:
        assert seq == 0 and app.lock.locked()
    assert not app.lock.locked()


@pytest.mark.parametrize("guarded", [True, False])
def test_a_batch_in_flight_sees_no_delta_unless_the_lock_is_off(tmp_path, model, guarded):
    """The lock keeps a delta out of a batch in flight: with the kit's applier the tables do not move
    while a batch holds ``serving``; with the test-only unguarded one (tests/unguarded.py, injected
    as a subclass, which tests/test_delta_server.py's torn-score check must catch) they do."""
    import threading

    from helpers import wait_until
    from unguarded import UnguardedApplier

    live, factory, base = served(tmp_path, model, "fp32")
    config = tiny_config()
    kind = DeltaApplier if guarded else UnguardedApplier
    app = kind(live, config, factory, tmp_path / "deltas", target_for(config, factory, "dlrm", base))
    tables, _ = diff(model, trained_further(model), dense=False)
    write_delta(app.directory, "dlrm", base, 1, tables)
    fused_rows({"warm": torch.zeros(1, 8)}, "fp32")  # the first conversion's set-up, before the clock
    before = table_bytes(app.model)

    def moved() -> bool:
        return not all(torch.equal(v, before[k]) for k, v in table_bytes(app.model).items())

    with app.serving() as seq:
        watcher = threading.Thread(target=app.catch_up)
        watcher.start()
        if guarded:
            time.sleep(1.5)
            assert not moved() and app.applied == 0
        else:
            assert wait_until(moved, bool, timeout=10)
        assert seq == 0
    watcher.join()
    assert app.applied == 1 and moved()


def test_config_keys():
    assert tiny_config(delta_dir="/d", delta_poll_s=2).live.delta_dir == "/d"
    for bad in ({"delta_dir": ""}, {"delta_dir": 3}, {"delta_poll_s": 0}, {"delta_poll_s": "1"}):
        with pytest.raises(ConfigError, match=f"handler.{next(iter(bad))}"):
            tiny_config(**bad)


def test_the_handler_applies_deltas_at_start_and_tags_answers(tmp_path, model, archived):
    from dlrm_handler import TorchRecDLRMHandler

    (tmp_path / "dlrm.pt").symlink_to(archived)
    (tmp_path / BASE_FILE).write_text(base_version(archived))
    tables, params = diff(model, trained_further(model))
    write_delta(tmp_path / "deltas", "dlrm", base_version(archived), 1, tables, params)
    h = TorchRecDLRMHandler()
    ctx = FakeContext(tmp_path, {**TINY, "delta_dir": str(tmp_path / "deltas")})
    h.initialize(ctx)
    try:
        assert h.deltas.applied == 1  # before initialize returned: before the worker reports ready
        req = {"dense": [0.1] * 5, "sparse": {"keys": ["feature_0"], "values": [1], "lengths": [1]}}
        out = h.handle([{"body": json.dumps(req).encode()}], ctx)
        assert len(out) == 1 and ctx.response_headers[0]["X-Delta-Sequence"] == "1"
        assert ctx.metrics.total("dlrm_delta_rows_total") == sum(len(i) for i, _ in tables.values())
    finally:
        h.deltas.stop()


def test_no_delta_dir_no_watcher(handler):
    assert handler.deltas is None and handler.config.live.delta_dir is None


def test_publish_delta_from_two_checkpoints(tmp_path, model):
    from scripts import publish_delta

    new = trained_further(model)
    torch.save(model.state_dict(), tmp_path / "old.pt")
    torch.save(new.state_dict(), tmp_path / "new.pt")
    (tmp_path / "c.yaml").write_text(json.dumps({"handler": TINY}))
    args = ["--config", str(tmp_path / "c.yaml"), "--old", str(tmp_path / "old.pt"), "--out", str(tmp_path / "d")]
    path = publish_delta.main([*args, "--new", str(tmp_path / "new.pt"), "--base", "b1"])
    d = read_delta(path)
    want, dense = changes(model.state_dict(), new.state_dict())
    assert d.sequence == 1 and d.base == "b1" and set(d.tables) == set(want) and set(d.dense) == set(dense)
    assert all(torch.equal(d.tables[t][0], ids) for t, (ids, _) in want.items())
    assert publish_delta.main([*args, "--new", str(tmp_path / "old.pt"), "--base", "b1"]) is None  # no change
    assert publish_delta.main([*args, "--new", str(tmp_path / "new.pt"), "--base", "b1"]).name.startswith(
        "delta-00000002"
    )


def test_a_trainer_publishing_every_n_steps_reproduces_its_checkpoint(tmp_path):
    """checkpoint A + every delta the resumed trainer published == its checkpoint B, bit for bit."""
    from scripts import train

    from dlrmkit.checkpoint import import_checkpoint, write_config

    common = ["--world-size", "1", "--steps", "8", "--heldout", "64", "--rows", "40"]
    train.main(["--out", str(tmp_path / "a"), *common])
    train.main(
        [
            "--out",
            str(tmp_path / "b"),
            "--resume",
            str(tmp_path / "a"),
            *common,
            "--publish-dir",
            str(tmp_path / "d"),
            "--publish-every",
            "3",
            "--publish-base",
            "b1",
        ]
    )
    write_config(tmp_path / "a" / "checkpoint", tmp_path / "c.yaml", log=lambda m: None)
    config = DLRMConfig.from_yaml(tmp_path / "c.yaml")
    state = import_checkpoint(tmp_path / "a" / "checkpoint", config, log=lambda m: None)
    want = import_checkpoint(tmp_path / "b" / "checkpoint", config, log=lambda m: None)
    assert sorted(ready_sequences(tmp_path / "d")) == [1, 2, 3]  # steps 3, 6 and the last, 8
    for seq in (1, 2, 3):
        d = read_delta(delta_path(tmp_path / "d", seq))
        assert d.meta["step"] == str(min(3 * seq, 8)) and d.rows > 0
        for t, (ids, rows) in d.tables.items():
            state[TABLE.format(t)][ids] = rows
        state.update(d.dense)
    assert not torch.equal(
        state[TABLE.format("cat_0")],
        import_checkpoint(tmp_path / "a" / "checkpoint", config, log=lambda m: None)[TABLE.format("cat_0")],
    )
    assert all(torch.equal(state[k], v) for k, v in want.items())


def second_worker(tmp_path, first, dtype="int8", **kw):
    """Another worker of the same archive and model directory (as TorchServe starts one)."""
    factory = DLRMFactory(tiny_config(embedding_dtype=dtype))
    live = factory.load(next(tmp_path.glob("dlrm-*.pt")))
    factory.freeze_dense(live)
    return DeltaApplier(live, first.config, factory, first.directory, first.target, state_dir=tmp_path, **kw)


def test_workers_share_one_writer_and_it_never_writes_the_side_a_worker_reads(tmp_path, model):
    """Two workers, one set of shared tables: the first is the writer; the second serves the rows the
    writer wrote without writing a byte; a side one worker still serves is not written until it
    flips; when the writer's process is gone, the other worker takes over."""
    import subprocess
    import sys

    from helpers import wait_until

    a, base = applier(tmp_path, model, "int8")
    a.poll_s, a.worker = 0.02, "a"
    a.catch_up()
    a.start()
    b = second_worker(tmp_path, a, worker="b")
    try:
        assert b.catch_up() == 0 and a.shared.is_writer and not b.shared.is_writer
        steps = [trained_further(model, seed=s, rows=2 + s) for s in range(4)]
        deltas = [diff(x, y, dense=False)[0] for x, y in zip([model, *steps], steps)]
        dense, kjt = batch(64, seed=5)
        write_delta(a.directory, "dlrm", base, 1, deltas[0])
        wait_until(lambda: a.applied, lambda s: s == 1)
        writer = a.process.child  # a's writes run in a process of its own, not in a thread beside its batches
        assert writer is not None and writer.poll() is None and writer.pid != os.getpid()
        assert b.catch_up() == 1 and b.rows_applied == 0  # b wrote nothing: it reads a's writes
        torch.testing.assert_close(forward(b.model, dense, kjt), forward(a.model, dense, kjt))
        assert {a.side, b.side} == {1} and a.model is not b.model

        with b.serving() as seq:  # a batch of b's in flight on side 1, at sequence 1
            frozen = {k: v.clone() for k, v in a.shared.views(1).items()}
            write_delta(a.directory, "dlrm", base, 2, deltas[1])  # into side 0: free
            wait_until(lambda: a.applied, lambda s: s == 2)
            write_delta(a.directory, "dlrm", base, 3, deltas[2])  # into side 1: b reads it, must wait
            time.sleep(0.3)  # a polls ~15 times meanwhile
            assert a.shared.meta()["seq"] == [2, 1] and a.applied == 2
            assert all(torch.equal(v, a.shared.views(1)[k]) for k, v in frozen.items())
            assert seq == 1
        assert b.catch_up() == 1 and b.side == 0  # flips to 2; then side 1 is free for 3
        wait_until(lambda: a.applied, lambda s: s == 3)
        assert b.catch_up() == 1 and b.applied == 3
        torch.testing.assert_close(forward(b.model, dense, kjt), forward(a.model, dense, kjt))

        # The writer's process is gone: its flock released, its state file naming a pid that exited
        a.stop()
        os.close(a.shared.fd)
        gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
        state = json.loads(a.state_file.read_text())
        a.state_file.write_text(json.dumps({**state, "pid": int(gone.stdout)}))
        write_delta(a.directory, "dlrm", base, 4, deltas[3])
        assert b.catch_up() == 1 and b.shared.is_writer and b.applied == 4
        want = copy.deepcopy(model)  # the model's dense half (row deltas only) with step 3's tables
        ebc = want.sparse_arch.embedding_bag_collection
        ebc.load_state_dict(steps[3].sparse_arch.embedding_bag_collection.state_dict())
        ref, _, _ = served(tmp_path / "ref", want, "int8")
        torch.testing.assert_close(forward(b.model, dense, kjt), forward(ref, dense, kjt), atol=1e-6, rtol=1e-6)
    finally:
        a.stop()
        b.stop()


def test_the_writer_process_is_started_again_when_it_exits(tmp_path, model):
    """A writer process that dies (killed, out of memory) is replaced by its worker, which still
    holds the writer's flock; the stream goes on from where it was."""
    from helpers import wait_until

    a, base = applier(tmp_path, model, "int8")
    a.poll_s = 0.02
    a.catch_up()
    a.start()
    try:
        first = wait_until(lambda: a.process.child, lambda c: c is not None)
        first.kill()
        first.wait()
        step = trained_further(model, seed=1, rows=3)
        write_delta(a.directory, "dlrm", base, 1, diff(model, step, dense=False)[0])
        assert wait_until(lambda: a.applied, lambda s: s == 1) == 1
        assert a.process.child.pid != first.pid and a.process.child.poll() is None and a.shared.is_writer
        assert a.rows_applied == 3 * 3  # relayed from the new process: 3 rows in each of 3 tables
    finally:
        a.stop()
    assert a.process.child.poll() is not None  # stopped with its worker


def test_tables_mapped_read_only_take_deltas_into_the_shared_sides(tmp_path, monkeypatch):
    """Tables larger than memory are mapped read-only (tests/test_stream.py forces that path as
    here): the archive file is only read, the deltas go into the shared sides, and the scores are
    those of a privately loaded model with the same delta written in place."""
    from dlrmkit import stream

    config = tiny_config(embedding_dtype="int8", num_embeddings=[5000, 30, 40])
    path = tmp_path / "dlrm.pt"
    stream.write_weights(path, config, stream.RandomSource(config), log=lambda _: None)
    before = base_version(path)
    factory = DLRMFactory(config)
    private = factory.load(path)
    refuse_mmap(monkeypatch)
    mapped = factory.load(path)
    monkeypatch.undo()
    target = target_for(config, factory, "dlrm", before)
    shared = DeltaApplier(mapped, config, factory, tmp_path / "deltas", target, state_dir=tmp_path / "model")
    own = DeltaApplier(private, config, factory, tmp_path / "deltas", target)
    assert shared.shared is not None and own.shared is None
    gen = torch.Generator().manual_seed(3)
    ids = torch.tensor([0, 7, 4999, 1234])
    write_delta(shared.directory, "dlrm", before, 1, {"feature_0": (ids, torch.rand(4, 8, generator=gen) * 2 - 1)})
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    dense, kjt = batch(64)
    kjt_ids = kjt.values().clone()
    kjt_ids[: len(ids)] = ids  # the batch looks up the changed rows (key-major: feature_0's first)
    kjt = KeyedJaggedTensor(keys=kjt.keys(), values=kjt_ids, lengths=kjt.lengths())
    old = forward(mapped, dense, kjt)
    assert shared.catch_up() == 1 and own.catch_up() == 1
    new = forward(shared.model, dense, kjt)
    assert torch.equal(new, forward(own.model, dense, kjt)) and not torch.equal(new, old)
    assert base_version(path) == before  # the archive file was never written
    buf = mapped.sparse_arch.embedding_bag_collection._emb_modules[0].weights_host
    (line,) = [
        ln
        for ln in open("/proc/self/maps").read().splitlines()
        if int(ln.split("-")[0], 16) <= buf.data_ptr() < int(ln.split()[0].split("-")[1], 16)
    ]
    assert line.split()[1] == "rw-s" and f"tables-{before}-0-" in line, line
