"""The config by concern: flat ``handler:`` keys in, the layout top-level and the rest in groups."""

from __future__ import annotations

import dataclasses

import pytest

from conftest import ROOT, TINY, tiny_config, variant
from dlrmkit.config import GROUPS, KEYS, Build, DLRMConfig, Live, RawInput, Requests, Threads
from dlrmkit.errors import ConfigError

CRITEO = DLRMConfig.from_yaml(ROOT / "model-config.criteo.yaml").to_dict()


def test_flat_keys_land_in_their_groups():
    c = tiny_config(
        output="logit",
        id_overflow="modulo",
        embedding_dtype="int8",
        dense_precision="bf16",
        table_names={"feature_1": "t1"},
        torch_threads=2,
        split_rows=350,
        delta_dir="/deltas",
        delta_poll_s=2,
    )
    assert c.build == Build(seed=3, embedding_dtype="int8", dense_precision="bf16", table_names=(("feature_1", "t1"),))
    assert c.requests == Requests(
        output="logit", id_overflow="modulo", max_instances_per_request=8, max_ids_per_request=64
    )
    assert c.threads == Threads(torch_threads=2, split_rows=350)
    assert c.live == Live(delta_dir="/deltas", delta_poll_s=2)
    assert c.raw == RawInput()
    assert (c.num_dense_features, c.embedding_dim, c.num_features, c.pooling) == (5, 8, 3, "sum")
    raw = DLRMConfig.from_dict({**CRITEO, "raw_input": "criteo_tsv", "dense_shift": 3})
    assert raw.raw == RawInput(raw_input="criteo_tsv", dense_shift=3)


def test_defaults_are_the_groups_defaults():
    c = tiny_config()
    assert c.requests == Requests(max_instances_per_request=8, max_ids_per_request=64)
    assert c.threads == Threads() and c.live == Live() and c.raw == RawInput() and c.build == Build(seed=3)
    assert (c.requests.output, c.requests.id_overflow, c.threads.split_rows, c.live.delta_poll_s) == (
        "probability",
        "error",
        0,
        0.5,
    )


def test_every_key_is_one_field_and_the_unknown_key_message_lists_them_all():
    fields = [f.name for f in dataclasses.fields(DLRMConfig) if f.name not in GROUPS]
    fields += [g.name for cls in GROUPS.values() for g in dataclasses.fields(cls)]
    assert sorted(KEYS) == sorted(fields) and len(set(KEYS)) == len(KEYS)
    assert not set(GROUPS) & set(KEYS)  # a group's name is never a YAML key
    with pytest.raises(ConfigError) as info:
        tiny_config(threads=2)
    assert str(info.value) == f"handler.threads: unknown key; valid keys are {', '.join(sorted(KEYS))}"


@pytest.mark.parametrize("interaction", ["dot", "dcn", "projection"])
def test_to_dict_reads_back_as_the_same_config(interaction):
    c = tiny_config(**variant(interaction), table_names=["a", "b", "c"], split_rows=4, delta_dir="/d")
    assert DLRMConfig.from_dict(c.to_dict()) == c
    assert DLRMConfig.from_dict(DLRMConfig.from_dict(CRITEO).to_dict()) == DLRMConfig.from_dict(CRITEO)
    withraw = DLRMConfig.from_dict({**CRITEO, "raw_input": "criteo_tsv", "dense_shift": -1.5})
    assert DLRMConfig.from_dict(withraw.to_dict()) == withraw


def test_with_changes_takes_flat_keys_and_validates_them_again():
    c = tiny_config()
    changed = c.with_changes(split_rows=3, embedding_dtype="int8", num_embeddings=(5, 6, 7))
    assert changed.threads.split_rows == 3 and changed.build.embedding_dtype == "int8"
    assert changed.num_embeddings == (5, 6, 7) and changed.requests == c.requests and c.threads.split_rows == 0
    with pytest.raises(ConfigError, match=r"^handler.split_rows: expected 0 \(never\) or a positive number of rows"):
        c.with_changes(split_rows=-1)
    with pytest.raises(ConfigError, match="^handler.embedding_dtype: int4 packs two values per byte"):
        c.with_changes(embedding_dim=7, dense_arch_layer_sizes=[16, 7], embedding_dtype="int4")
    with pytest.raises(ConfigError, match="^handler.large_batch_rows: removed; use handler.split_rows"):
        c.with_changes(large_batch_rows=100)


def test_groups_are_frozen():
    c = tiny_config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.threads.split_rows = 4  # type: ignore[misc]
    assert TINY["seed"] == c.build.seed


@pytest.mark.parametrize("key", ["hot_rows", "prefetch", "keep_freed_memory"])
def test_a_flag_is_true_or_false(key):
    group = "threads" if key == "keep_freed_memory" else "hot"
    assert getattr(getattr(tiny_config(**{key: False}), group), key) is False
    with pytest.raises(ConfigError, match=rf"^handler.{key}: expected true or false, got 1 \(e.g. {key}: true\)$"):
        tiny_config(**{key: 1})
