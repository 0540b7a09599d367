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
