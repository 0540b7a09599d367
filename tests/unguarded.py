"""Test only: live updates applied WITHOUT the lock, pausing between tables, so that a test can show
that its torn-score check catches a torn apply (tests/test_delta_server.py through
tests/unguarded_handler.py; tests/test_delta.py). Injected as subclasses: the kit has no switch."""

from __future__ import annotations

import dataclasses
import time
from typing import Mapping, Sequence

import torch

from dlrmkit.live.applier import DeltaApplier
from dlrmkit.live.tables import Write, write_all
from dlrmkit.live.writer import Prepared, TableWriter

PAUSE_S = 0.3  # between two tables' writes: long enough for batches to score half-written deltas


class UnguardedWriter(TableWriter):
    """Writes the shared tables' deltas into the side the workers read (no flip, so no lock guards a
    batch), pausing after each table. Runs in the writer process too (the spec names this class)."""

    def side_to_write(self, active: int) -> int:
        return active

    def write(self, views: Mapping[str, torch.Tensor], writes: Sequence[Write]) -> None:
        for w in writes:
            write_all(views, [w])
            time.sleep(PAUSE_S)


class UnguardedApplier(DeltaApplier):
    """Its own tables written outside the lock, pausing after each table; shared tables through
    UnguardedWriter."""

    Writer = UnguardedWriter

    def apply(self, p: Prepared) -> None:
        if p.side is None:
            for w in p.writes:
                write_all(self.views, [w])
                time.sleep(PAUSE_S)
            p = dataclasses.replace(p, writes=[])  # the rest (sequence, dense parts) as the kit does it
        super().apply(p)
