"""Shared fixtures: a tiny seeded DLRM (tables of tens of rows, D=8), a fake TorchServe context."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent

from dlrmkit.config import DLRMConfig  # noqa: E402
from dlrmkit.model import DLRMFactory  # noqa: E402

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
        "projection": {"interaction": "projection", "interaction_branch1_layer_sizes": [2 * dim, 2 * dim],
                       "interaction_branch2_layer_sizes": [3 * dim]},
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


class FakeMetrics:
    """Records context.metrics calls: ``recorded`` as (name, value, unit), ``dimensions`` the
    {name: value} of each call's own dimensions (TorchServe appends ModelName and Level)."""

    def __init__(self):
        self.recorded = []
        self.dimensions = []

    def _add(self, name, value, unit, dimensions):
        self.recorded.append((name, value, unit))
        self.dimensions.append({d.name: d.value for d in dimensions or []})

    def add_time(self, name, value, idx=None, unit="ms", dimensions=None, metric_type=None):
        self._add(name, value, unit, dimensions)

    def add_counter(self, name, value, idx=None, dimensions=None):
        self._add(name, value, "count", dimensions)

    def add_metric(self, name, value, unit, idx=None, dimensions=None, metric_type=None):
        self._add(name, value, unit, dimensions)

    def total(self, name, **dims):
        """The sum of the values recorded for ``name`` with exactly these dimensions."""
        return sum(v for (n, v, _), d in zip(self.recorded, self.dimensions) if n == name and d == dims)


class FakeContext:
    """What the handler uses of ts.context.Context, recording per-request statuses and types."""

    def __init__(self, model_dir: Path, handler_section: dict | None, serialized: str | None = "dlrm.pt",
                 gpu_id=None):
        self.system_properties = {"model_dir": str(model_dir), "gpu_id": gpu_id, "batch_size": 8}
        model = {"modelName": "dlrm", "handler": "dlrm_handler.py"}
        if serialized:
            model["serializedFile"] = serialized
        self.manifest = {"model": model}
        self.model_yaml_config = {"handler": handler_section} if handler_section is not None else {}
        self.metrics = FakeMetrics()
        self.request_ids = {}
        self.statuses = {}
        self.content_types = {}
        self.headers = {}  # idx -> {name: value}
        self.response_headers = {}  # idx -> {name: value}
        self.kserve = set()  # idx of requests sent on /v1 or /v2 (TorchServe gives them no url_path)

    def get_request_header(self, idx, key):
        if key == "url_path" and idx in self.kserve:  # TorchServe sets it on /predictions/<m> only
            return None
        default = {"url_path": "", "Host": "127.0.0.1:8080"}.get(key)  # what TorchServe gives REST requests
        return self.headers.get(idx, {}).get(key, default)

    def set_response_header(self, idx, key, value):
        self.response_headers.setdefault(idx, {})[key] = value

    def set_response_status(self, code, phrase, idx=0):
        self.statuses[idx] = (code, phrase)

    def set_response_content_type(self, idx, value):
        self.content_types[idx] = value


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
    """Run one TorchServe batch through handler.handle; returns (outputs, context)."""
    ctx = FakeContext(Path("."), handler_section or dict(TINY))
    ctx.request_ids = {i: f"req-{i}" for i in range(len(bodies))}
    return handler.handle([{"body": b} for b in bodies], ctx), ctx
