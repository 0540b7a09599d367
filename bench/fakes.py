"""Hand-written stand-ins that tests and bench share (bench never imports tests/).

- ``FakeContext`` (with ``FakeMetrics``): what the handler uses of TorchServe's context, recording
  statuses, content types, headers and metrics: the unit tests' and benchmark.py's in-process handler.
"""

from __future__ import annotations

from pathlib import Path


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

    def __init__(self, model_dir: Path, handler_section: dict | None, serialized: str | None = "dlrm.pt", gpu_id=None):
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
