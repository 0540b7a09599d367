"""Live model updates: a trainer's changed embedding rows (and dense parameters) applied to a
serving model in order, versioned, never mixing old and new rows within one score
(docs/live-updates.md). One job per module:

- ``format``: the delta file (write_delta, read_delta, delta_path, ready_sequences, base_version)
- ``validate``: what a delta may touch (Target, target_for) and what one carries (changes)
- ``tables``: the shared double-buffered tables (SharedTables: two sides, one writer's flock)
- ``writer``: reading, checking, converting and writing deltas (TableWriter), the writer process
- ``applier``: the worker's watcher thread, its lock, the hand-over and state files (DeltaApplier)
- ``start``: what the handler calls after loading (start_watcher)
"""

from dlrmkit.live.applier import DeltaApplier
from dlrmkit.live.format import (
    BASE_FILE,
    Delta,
    base_version,
    delta_path,
    next_sequence,
    read_delta,
    ready_sequences,
    write_delta,
)
from dlrmkit.live.start import start_watcher
from dlrmkit.live.validate import Target, changes, target_for
from dlrmkit.live.writer import TableWriter

__all__ = [
    "BASE_FILE",
    "Delta",
    "DeltaApplier",
    "TableWriter",
    "Target",
    "base_version",
    "changes",
    "delta_path",
    "next_sequence",
    "read_delta",
    "ready_sequences",
    "start_watcher",
    "target_for",
    "write_delta",
]
