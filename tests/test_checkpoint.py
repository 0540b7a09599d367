"""Checkpoint import (dlrmkit/checkpoint/, build_mar.py --checkpoint / --write-config) on the tiny model."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml

from scripts import build_mar
from conftest import TINY, call, tiny_config, variant
from dlrmkit.checkpoint import TABLES, import_checkpoint
from dlrmkit.config import DLRMConfig
from dlrmkit.errors import ConfigError
from dlrmkit.model import DLRMFactory

# dcp.save / load in one process warn that they assume one: that is the point here.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def trained_keys(model, prefix: str = "model.", table: str = "t_{}") -> dict[str, torch.Tensor]:
    """The tiny model's state_dict as a torchrec trainer saves it: wrapper prefix, t_<feature> tables."""
    out = {}
    for key, value in model.state_dict().items():
        if key.startswith(TABLES):
            name = key[len(TABLES) : -len(".weight")]
            key = f"{TABLES}{table.format(name)}.weight"
        out[prefix + key] = value
    return out


def same_scores(state, model, config=None) -> bool:
    served = DLRMFactory(config or tiny_config()).load_fp32(state)
    dense, kjt = DLRMFactory(config or tiny_config()).probe_batch(64, torch.Generator().manual_seed(1))
    with torch.no_grad():
        return torch.equal(served(dense, kjt), model(dense, kjt))


def test_a_dcp_directory_with_wrapper_prefixes_and_t_tables(tmp_path, model, capsys):
    # One process, no process group: the 2-rank DMP form is covered by tests/test_train_serve.py.
    state = trained_keys(model, "_dmp_wrapped_module.model.")
    dcp.save({**state, "optim.step": torch.tensor(7)}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    got = import_checkpoint(tmp_path / "ckpt", tiny_config(), log=print)
    assert set(got) == set(model.state_dict())
    assert same_scores(got, model)
    out = capsys.readouterr().out
    assert "[import] ignored 1 entries that are no DLRM weights (optimizer state and the like): optim.step" in out
    assert "DCP directory (1 rank)" in out and "t_feature_0 -> feature_0" in out


def test_a_pt_file_holding_the_state_dict_beside_optimizer_state(tmp_path, model, capsys):
    path = tmp_path / "trained.pth"
    torch.save({"model_state_dict": trained_keys(model, "module.model."), "optimizer": {"lr": 0.1}, "epoch": 3}, path)
    got = import_checkpoint(path, tiny_config(), log=print)
    assert same_scores(got, model)
    assert (
        "[import] ignored 2 entries that are no DLRM weights (optimizer state and the like): "
        "optimizer (beside 'model_state_dict'), epoch (beside 'model_state_dict')"
    ) in capsys.readouterr().out


def test_a_plain_state_dict_with_feature_named_tables(tmp_path, model):
    torch.save(model.state_dict(), tmp_path / "plain.pt")
    assert same_scores(import_checkpoint(tmp_path / "plain.pt", tiny_config(), log=lambda _: None), model)


def test_table_names_maps_other_names_as_a_list_or_a_mapping(tmp_path, model):
    torch.save(trained_keys(model, table="emb_{}"), tmp_path / "t.pt")
    names = [f"emb_{f}" for f in TINY["sparse_features"]]
    for table_names in (names, dict(zip(TINY["sparse_features"], names))):
        state = import_checkpoint(tmp_path / "t.pt", tiny_config(table_names=table_names), log=lambda _: None)
        assert same_scores(state, model)


@pytest.mark.parametrize(
    "changes, message",
    [
        # A wrong mapping: feature_0 (20 rows) pointed at feature_1's table (30 rows).
        (
            {"table_names": {"feature_0": "t_feature_1", "feature_1": "t_feature_0"}},
            "checkpoint: table 't_feature_1' (feature 'feature_0') has shape [30, 8], the config expects [20, 8] "
            "(num_embeddings x embedding_dim)",
        ),
        # A wrong shape: the config's rows differ from the trained table's.
        (
            {"num_embeddings": [20, 31, 40]},
            "checkpoint: table 't_feature_1' (feature 'feature_1') has shape [30, 8], the config expects [31, 8] "
            "(num_embeddings x embedding_dim)",
        ),
        (
            {"table_names": {"feature_2": "t_cat_2"}},
            "checkpoint: table 't_cat_2' (handler.table_names for feature 'feature_2') is not in the checkpoint; "
            "its tables are t_feature_0, t_feature_1, t_feature_2",
        ),
        (
            {"sparse_features": ["feature_0", "feature_1", "f2"]},
            "checkpoint: no table for feature 'f2' (looked for 'f2' and 't_f2'; the checkpoint's tables are "
            "t_feature_0, t_feature_1, t_feature_2); map it with handler.table_names",
        ),
        (
            {"sparse_features": ["feature_0", "feature_1"], "num_embeddings": [20, 30]},
            "checkpoint: table 't_feature_2' [40, 8] serves no feature of handler.sparse_features; add its feature "
            "or map it with handler.table_names",
        ),
        (
            {"dense_arch_layer_sizes": [32, 8]},
            "checkpoint: layer 'dense_arch.model._mlp.0._linear.weight' has shape [16, 5], the config expects [32, 5]",
        ),
    ],
)
def test_a_checkpoint_that_does_not_fit_is_refused_before_anything_is_archived(tmp_path, model, changes, message):
    torch.save(trained_keys(model), tmp_path / "t.pt")
    config = tmp_path / "model-config.yaml"
    config.write_text(yaml.safe_dump({"handler": {**TINY, **changes}}))
    with pytest.raises(SystemExit) as exc:
        build_mar.main(
            ["--config", str(config), "--checkpoint", str(tmp_path / "t.pt"), "--output-dir", str(tmp_path / "store")]
        )
    assert exc.value.code == f"error: {message}"
    assert not (tmp_path / "store").exists()


def test_write_config_derives_a_config_that_builds_and_serves_the_same_scores(tmp_path, model, capsys):
    state = trained_keys(model, "_dmp_wrapped_module.model.")
    dcp.save(state, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    out = tmp_path / "derived.yaml"
    build_mar.main(
        ["--checkpoint", str(tmp_path / "ckpt"), "--write-config", str(out), "--output-dir", str(tmp_path / "store")]
    )
    assert not (tmp_path / "store").exists()  # builds nothing
    printed = capsys.readouterr().out
    assert "[config] derived: 3 sparse features from the table names (feature_0, feature_1, feature_2)" in printed
    assert "[config] assumed: pooling sum" in printed
    doc = yaml.safe_load(out.read_text())
    layout = ("num_dense_features", "sparse_features", "num_embeddings", "embedding_dim")
    layout += ("dense_arch_layer_sizes", "over_arch_layer_sizes")
    assert {k: doc["handler"][k] for k in layout} == {k: TINY[k] for k in layout}
    assert doc["batchSize"] > 1 and doc["startupTimeout"] >= 120 and doc["responseTimeout"] >= 60
    mar = build_mar.main(
        [
            "--config",
            str(out),
            "--checkpoint",
            str(tmp_path / "ckpt"),
            "--force",
            "--output-dir",
            str(tmp_path / "store"),
        ]
    )
    assert mar.is_file()


def test_make_serve_probes_a_written_config_with_a_request_built_from_it(tmp_path, handler):
    """serve.py --config (make serve CONFIG=... CHECKPOINT=...): a config written from a checkpoint
    has no sample request; the probe is one row of it, which the model scores."""
    from scripts import serve

    config = tmp_path / "derived.yaml"
    config.write_text(yaml.safe_dump({"handler": TINY}))
    probe = serve.probe_from_config(str(config), tmp_path / "home")
    outputs, ctx = call(handler, [probe.read_bytes()])
    assert ctx.statuses == {} and 0 < json.loads(outputs[0])["score"] < 1


@pytest.mark.parametrize("interaction", ["dcn", "projection"])
def test_write_config_reads_the_variant_and_its_sizes_off_the_keys(tmp_path, interaction, capsys):
    keys = variant(interaction)
    model = DLRMFactory(tiny_config(**keys)).random()
    torch.save(trained_keys(model), tmp_path / "t.pt")
    build_mar.main(["--checkpoint", str(tmp_path / "t.pt"), "--write-config", str(tmp_path / "c.yaml")])
    handler = yaml.safe_load((tmp_path / "c.yaml").read_text())["handler"]
    assert {k: handler[k] for k in keys} == keys
    assert f"[config] derived: interaction {interaction} (inter_arch keys)" in capsys.readouterr().out
    config = tiny_config(**keys)
    assert same_scores(import_checkpoint(tmp_path / "t.pt", config, log=lambda _: None), model, config)


def test_a_variant_checkpoint_against_a_dot_config_names_the_first_key_that_does_not_fit(tmp_path):
    torch.save(trained_keys(DLRMFactory(tiny_config(**variant("dcn"))).random()), tmp_path / "t.pt")
    with pytest.raises(ConfigError) as exc:
        import_checkpoint(tmp_path / "t.pt", tiny_config(), log=lambda _: None)
    assert str(exc.value) == (
        "checkpoint: key 'inter_arch.crossnet.W_kernels.0' [32, 4] does not fit the config: it has no such layer "
        "(another interaction or arch? scripts/build_mar.py --checkpoint PATH --write-config OUT.yaml writes a "
        "config that fits)"
    )


def test_write_config_refuses_what_is_no_dlrm(tmp_path, capsys):
    torch.save({"step": torch.zeros(3)}, tmp_path / "x.pt")
    with pytest.raises(SystemExit) as exc:
        build_mar.main(["--checkpoint", str(tmp_path / "x.pt"), "--write-config", str(tmp_path / "o.yaml")])
    assert exc.value.code == (
        f"error: {tmp_path / 'x.pt'}: no embedding tables "
        "(sparse_arch.embedding_bag_collection.embedding_bags.<table>.weight) in the "
        "checkpoint; its keys: none"
    )
    with pytest.raises(SystemExit):
        build_mar.main(["--write-config", str(tmp_path / "o.yaml")])
    assert "error: --write-config needs --checkpoint PATH" in capsys.readouterr().err
    assert not (tmp_path / "o.yaml").exists()


@pytest.mark.parametrize(
    "value, message",
    [
        (
            ["a"],
            "handler.table_names: expected one table name per sparse feature (3), got 1 "
            "(e.g. table_names: {feature_0: t_feature_0})",
        ),
        (
            {"cat_9": "a"},
            "handler.table_names: 'cat_9' is not in handler.sparse_features (valid: feature_0, "
            "feature_1, feature_2) (e.g. table_names: {feature_0: t_feature_0})",
        ),
        (["a", "a", "b"], "handler.table_names: table 'a' is named for two features; each feature has its own table"),
        (
            7,
            "handler.table_names: expected a list of table names in sparse_features order or a mapping feature -> "
            "table name, got 7 (e.g. table_names: {feature_0: t_feature_0})",
        ),
    ],
)
def test_table_names_is_validated_with_the_key_named(value, message):
    with pytest.raises(ConfigError) as exc:
        tiny_config(table_names=value)
    assert str(exc.value) == message


TRAINER_ORDER = ["user", "item", "ctx"]  # not alphabetical, no numbered sequence


def named_model():
    """The tiny DCN with features user, item, ctx (20, 30, 40 rows) in the trainer's order."""
    return DLRMFactory(tiny_config(sparse_features=TRAINER_ORDER, **variant("dcn"))).random()


def test_a_state_dict_file_records_the_trainers_order_and_needs_no_flag(tmp_path, model, capsys):
    trained = named_model()
    torch.save(trained_keys(trained), tmp_path / "t.pt")
    build_mar.main(["--checkpoint", str(tmp_path / "t.pt"), "--write-config", str(tmp_path / "c.yaml")])
    assert (
        "[config] derived: feature order user, item, ctx: the checkpoint's table order (a state_dict file "
        "keeps the trainer's EmbeddingBagConfig order)"
    ) in capsys.readouterr().out
    assert "# derived: feature order user, item, ctx: the checkpoint's table order" in (tmp_path / "c.yaml").read_text()
    config = DLRMConfig.from_yaml(tmp_path / "c.yaml")
    assert config.sparse_features == tuple(TRAINER_ORDER) and config.num_embeddings == (20, 30, 40)
    assert same_scores(import_checkpoint(tmp_path / "t.pt", config, log=lambda _: None), trained, config)


def test_a_config_that_contradicts_the_order_a_state_dict_records_is_refused(tmp_path):
    torch.save(trained_keys(named_model()), tmp_path / "t.pt")
    config = tiny_config(sparse_features=["ctx", "item", "user"], num_embeddings=[40, 30, 20], **variant("dcn"))
    with pytest.raises(ConfigError) as exc:
        import_checkpoint(tmp_path / "t.pt", config, log=lambda _: None)
    assert str(exc.value) == (
        "checkpoint: handler.sparse_features (ctx, item, user) are not in the order of the checkpoint's tables "
        "(t_user, t_item, t_ctx), which is the trainer's: the interaction reads the embeddings in sparse_features "
        "order, so this order serves a wrong score for every row. List them as [user, item, ctx] (or pass "
        "--feature-order if the file's order is not the trainer's)"
    )
    # Said explicitly, the order is the user's (the file's order is named where it is derived).
    state = import_checkpoint(tmp_path / "t.pt", config, log=lambda _: None, feature_order=["ctx", "item", "user"])
    assert list(state)[0] == f"{TABLES}ctx.weight"


def test_a_build_checks_the_config_against_feature_order(tmp_path):
    dcp.save(trained_keys(named_model()), checkpoint_id=tmp_path / "ckpt", no_dist=True)
    config = tiny_config(sparse_features=TRAINER_ORDER, **variant("dcn"))
    import_checkpoint(tmp_path / "ckpt", config, log=lambda _: None, feature_order=TRAINER_ORDER)
    for order, message in [
        (
            ["item", "user", "ctx"],
            "--feature-order item,user,ctx differs from handler.sparse_features (user, item, "
            "ctx): the interaction reads the embeddings in sparse_features order; list them in "
            "the trainer's order",
        ),
        (
            ["user", "item"],
            "--feature-order user,item does not match handler.sparse_features (user, item, ctx): missing: ctx",
        ),
        (
            ["user", "user", "item", "ctx"],
            "--feature-order user,user,item,ctx does not match "
            "handler.sparse_features (user, item, ctx): named twice: user",
        ),
    ]:
        with pytest.raises(ConfigError) as exc:
            import_checkpoint(tmp_path / "ckpt", config, log=lambda _: None, feature_order=order)
        assert str(exc.value) == message


@pytest.mark.parametrize(
    "names, expected",
    [
        (["cat_0", "cat_1", "cat_2"], True),
        (["cat_2", "cat_10", "cat_1", "cat_0"], False),
        ([f"cat_{i}" for i in range(26)], True),
        (["f1", "f2", "f3"], True),
        (["user"], True),
        (["user", "item"], False),
        (["a_0", "b_1"], False),
        (["cat_0", "cat_00"], False),
        (["cat_0", "cat_2"], False),
    ],
)
def test_only_one_unambiguous_numbered_sequence_gives_the_order(names, expected):
    from dlrmkit.checkpoint import numbered

    assert numbered(names) is expected


def write_verify(path, lines) -> str:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return str(path)


@pytest.mark.parametrize(
    "lines, message",
    [
        (["{nope"], "line 1: not JSON (Expecting property name enclosed in double quotes at column 2)"),
        ([{"scores": [0.5]}], 'line 1: expected {"request": {...}, "scores": [...]}, got keys [\'scores\']'),
        ([{"request": {}, "scores": []}], "line 1: 'scores': expected a non-empty list of numbers, one per row"),
        ([{"request": {}, "scores": [0.5], "labels": [1, 0]}], "line 1: 2 labels for 1 scores"),
        (
            ["", {"request": {}, "scores": [0.5], "labels": ["1"]}],
            "line 2: 'labels': expected a non-empty list of numbers, one per row",
        ),
    ],
)
def test_a_verify_file_is_checked_line_by_line(tmp_path, lines, message):
    from dlrmkit.checkpoint import read_verify_file

    path = write_verify(tmp_path / "v.jsonl", lines)
    with pytest.raises(ConfigError) as exc:
        read_verify_file(path)
    assert str(exc.value) == f"--verify {path}, {message}"


def test_verify_names_the_request_the_archive_refuses(tmp_path, model):
    """A request the handler answers 400 (an id past its table) fails the proof with the handler's
    own answer; the archive is not written."""
    from helpers import DENSE, instance

    torch.save(model.state_dict(), tmp_path / "t.pt")
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"batchSize": 4, "handler": TINY}))
    path = write_verify(
        tmp_path / "v.jsonl",
        [
            {"request": instance(DENSE, feature_0=[1]), "scores": [0.5]},
            {"request": instance(DENSE, feature_0=[20]), "scores": [0.5]},
        ],
    )
    with pytest.raises(SystemExit) as exc:
        build_mar.main(
            [
                "--config",
                str(config),
                "--checkpoint",
                str(tmp_path / "t.pt"),
                "--verify",
                path,
                "--output-dir",
                str(tmp_path / "store"),
            ]
        )
    assert exc.value.code.startswith(f"error: --verify {path}, line 2: the archive answered 400: "), exc.value.code
    assert "feature_0" in exc.value.code
    assert not (tmp_path / "store" / "dlrm.mar").exists()
