"""Shared fixtures: a tiny seeded DLRM (tables of tens of rows, D=8); the fake TorchServe context
(bench/fakes.py, shared with bench/)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
# The frontend plugin's warm-up (plugin/.../Warmup.java) off on the servers tests start: its load would
# run beside what they count; tests/test_warmup.py turns it on where it is what is checked.
os.environ.setdefault("DLRM_WARMUP_SECONDS", "0")

from dlrmkit.config import DLRMConfig  # noqa: E402
from dlrmkit.model import DLRMFactory  # noqa: E402
from bench.fakes import FakeContext  # noqa: E402, F401  (the tests import it from here)

TINY = {
    "num_dense_features": 5,
    "sparse_features": ["feature_0", "feature_1", "feature_2"],
    "num_embeddings": [20, 30, 40],
    "embedding_dim": 8,
    "dense_arch_layer_sizes": [16, 8],
    "over_arch_layer_sizes": [16, 8, 1],
    "seed": 3,
    "max_instances_per_request": 8,
    "max_ids_per_request": 64,
}


def tiny_config(**changes) -> DLRMConfig:
    return DLRMConfig.from_dict({**TINY, **changes})


def variant(interaction: str, dim: int = 8) -> dict:
    """The handler keys of a small ``interaction`` variant fitted to embedding_dim ``dim``:
    dcn 2 layers of rank 4; projection branches ending in 2 x D and 3 x D (F1 = 2, F2 = 3)."""
    return {
        "dot": {},
        "dcn": {"interaction": "dcn", "dcn_num_layers": 2, "dcn_low_rank_dim": 4},
        "projection": {
            "interaction": "projection",
            "interaction_branch1_layer_sizes": [2 * dim, 2 * dim],
            "interaction_branch2_layer_sizes": [3 * dim],
        },
    }[interaction]


@pytest.fixture(scope="session")
def config() -> DLRMConfig:
    return tiny_config()


@pytest.fixture(scope="session")
def model(config):
    return DLRMFactory(config).random()


@pytest.fixture(scope="session")
def weights(tmp_path_factory, model) -> Path:
    """The tiny model's fp32 state_dict: a trained checkpoint (build_mar.py --checkpoint)."""
    path = tmp_path_factory.mktemp("weights") / "dlrm.pt"
    torch.save(model.state_dict(), path)
    return path


@pytest.fixture(scope="session")
def archived(tmp_path_factory, model, config) -> Path:
    """The tiny model as build_mar.py archives it (tables as the fused kernel's rows)."""
    path = tmp_path_factory.mktemp("archived") / "dlrm.pt"
    torch.save(DLRMFactory(config).archive_state(model), path)
    return path


@pytest.fixture
def handler(tmp_path, archived):
    """An initialized handler over the tiny model's weights."""
    from dlrm_handler import TorchRecDLRMHandler

    (tmp_path / "dlrm.pt").symlink_to(archived)
    h = TorchRecDLRMHandler()
    h.initialize(FakeContext(tmp_path, dict(TINY)))
    yield h
    h.close()


def call(handler, bodies, handler_section=None):
    """Run one TorchServe batch through handler.handle; returns (outputs, context), the batch's
    metrics emitted into the context (the handler's tally would within DLRM_METRICS_SECONDS)."""
    ctx = FakeContext(Path("."), handler_section or dict(TINY))
    ctx.request_ids = {i: f"req-{i}" for i in range(len(bodies))}
    out = handler.handle([{"body": b} for b in bodies], ctx)
    handler.tally.flush()
    return out, ctx
