"""Hand-written stand-ins that tests and bench share (bench never imports tests/).

- ``DeltaReferences``: a served answer's in-process references while live deltas apply.
"""

from __future__ import annotations

from pathlib import Path

from dlrmkit.model import DLRMFactory


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
        return [s for s, ref in self.scores.items()
                if len(ref[i]) == len(got) and all(abs(a - b) <= self.tol for a, b in zip(ref[i], got))]
