"""Hand-written stand-ins that tests and bench share (bench never imports tests/).

- ``FakeContext`` (with ``FakeMetrics``): what the handler uses of TorchServe's context, recording
  statuses, content types, headers and metrics: the unit tests' and benchmark.py's in-process handler;
- ``DeltaReferences``: a served answer's in-process references while live deltas apply.
"""

from __future__ import annotations

from pathlib import Path

from dlrmkit.model import DLRMFactory


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


class DeltaReferences:
    """In-process references for live updates: the archive's weights loaded as a worker loads them,
    following the same delta directory, and its scores for ``requests`` (bodies) at every sequence
    it applied. A served answer is untorn when it equals one of them (``sequences``)."""

    def __init__(self, mar: Path, handler: dict, directory: Path, requests: list[bytes], tol: float = 1e-5):
        import tempfile
        import zipfile

        from dlrmkit.config import DLRMConfig
        from dlrmkit.live import BASE_FILE, DeltaApplier, target_for
        from dlrmkit.forms import RequestParser

        self.tmp = Path(tempfile.mkdtemp(prefix="delta-ref-"))
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
        from dlrmkit.batch import collate, scores

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
