"""Per-batch counters summed in the worker and handed on a few times a second, not after every batch.

A door whose metrics cost something per emission (TorchServe's: every metric is a line on the
worker's stdout that the frontend reads back, matches and logs again) adds to a ``Tally`` on the
serving thread, which is a dict update under a lock; a thread of the tally's own emits the sums at
most every ``seconds``. Counters are summed, so their totals (and Prometheus' ``rate``) are what
one emission per batch gives, at most ``seconds`` later; a gauge keeps its last value, what a
scrape would have sampled anyway. ``seconds=0`` emits on the serving thread at once, per batch.

>>> lines = []
>>> t = Tally(lambda *metric: lines.append(metric), seconds=0)
>>> t.add("dlrm_requests_total", 3)
>>> lines
[('dlrm_requests_total', 3, 'count', 'counter', ())]
>>> t = Tally(lambda *metric: lines.append(metric), seconds=60)
>>> t.add("dlrm_requests_total", 3); t.add("dlrm_requests_total", 2); t.add("HandlerTime", 4.5, "ms", GAUGE)
>>> t.add("HandlerTime", 1.25, "ms", GAUGE)
>>> t.close()  # what is pending goes out
>>> lines[1:]
[('dlrm_requests_total', 5, 'count', 'counter', ()), ('HandlerTime', 1.25, 'ms', 'gauge', ())]

A gauge the server itself records per batch (TorchServe's ``PredictionTime``, after the handler
returns) goes the same way through ``TalliedGauges``, which the door puts where the server looks
for its metrics object.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)

COUNTER, GAUGE = "counter", "gauge"
# emit(name, value, unit, kind, dims): dims a tuple of (dimension, value) pairs
Emit = Callable[[str, float, str, str, tuple], None]


class Tally:
    """Sums per (name, unit, kind, dims), in the order first added since the last emission."""

    def __init__(self, emit: Emit, seconds: float):
        if not seconds >= 0:
            raise ValueError(f"seconds: expected 0 (every batch) or more, got {seconds!r}")
        self.emit, self.seconds = emit, seconds
        self._pending: dict[tuple[str, str, str, tuple], float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if seconds > 0:
            self._thread = threading.Thread(target=self._run, name="dlrm-metrics", daemon=True)
            self._thread.start()

    def add(self, name: str, value: float, unit: str = "count", kind: str = COUNTER, dims: tuple = ()) -> None:
        key = (name, unit, kind, dims)
        with self._lock:
            self._pending[key] = self._pending.get(key, 0) + value if kind == COUNTER else value
        if self._thread is None:
            self.flush()

    def flush(self) -> None:
        """Emit what is pending now, in the order it was first added."""
        with self._lock:
            pending, self._pending = self._pending, {}
        for (name, unit, kind, dims), value in pending.items():
            self.emit(name, value, unit, kind, dims)

    def _run(self) -> None:
        while not self._stop.wait(self.seconds):
            try:
                self.flush()
            except Exception:  # a failing emission loses its sums, never the thread
                logger.exception("emitting metrics failed")

    def close(self) -> None:
        """Stop the thread and emit what is pending. Safe to call twice."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.flush()


class TalliedGauges:
    """A metrics object (TorchServe's metrics API: ``add_time(name, value, idx, unit, dimensions)``)
    whose ``add_time`` of one of ``names``, for no single request and with no dimensions of its own,
    goes into ``tally`` as a gauge; every other call and attribute, set or read, is ``inner``'s.

    >>> class Sink:
    ...     def __init__(self): self.lines = []
    ...     def add_time(self, name, value, idx=None, unit="ms", dimensions=None): self.lines.append((name, value))
    >>> sink, lines = Sink(), []
    >>> tally = Tally(lambda *metric: lines.append(metric), seconds=60)
    >>> metrics = TalliedGauges(sink, tally, ("PredictionTime",))
    >>> metrics.add_time("PredictionTime", 3.5); metrics.add_time("PredictionTime", 2.0)
    >>> metrics.add_time("Other", 1.0); metrics.request_ids = {0: "a"}
    >>> sink.lines, sink.request_ids, metrics.inner is sink
    ([('Other', 1.0)], {0: 'a'}, True)
    >>> tally.close(); lines
    [('PredictionTime', 2.0, 'ms', 'gauge', ())]
    """

    def __init__(self, inner, tally: Tally, names: tuple[str, ...]):
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "_tally", tally)
        object.__setattr__(self, "_names", frozenset(names))

    def add_time(self, name: str, value: float, idx=None, unit: str = "ms", dimensions=None, *rest, **kw) -> None:
        if name in self._names and idx is None and not dimensions and not rest and not kw:
            self._tally.add(name, value, unit, GAUGE)
        else:
            self.inner.add_time(name, value, idx, unit, [] if dimensions is None else dimensions, *rest, **kw)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self.inner, name, value)
