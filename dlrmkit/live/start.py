"""What the handler calls after loading: ``start_watcher``, TorchServe-free (the handler hands in
its metrics as a plain ``emit`` and sets the response header itself)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Sequence

import torch

from dlrmkit.config import DLRMConfig
from dlrmkit.errors import ConfigError
from dlrmkit.live.applier import DeltaApplier, Emit
from dlrmkit.live.format import BASE_FILE, base_version
from dlrmkit.live.validate import target_for
from dlrmkit.model import DLRMFactory
from dlrmkit.scale import fused_rows, mapped_read_only

logger = logging.getLogger(__name__)


def start_watcher(
    config: DLRMConfig,
    model: torch.nn.Module,
    model_dir: str | Path,
    weights: str | Path,
    name: str,
    devices: Sequence[torch.device],
    emit: Emit | None = None,
    applier: type[DeltaApplier] = DeltaApplier,
) -> DeltaApplier | None:
    """None without handler.delta_dir; else every visible delta applied (before the worker reports
    ready) and a watcher thread started. ``model_dir``: the archive's directory (its base file, the
    workers' state); ``weights``: its weights file (the base of an archive built without one);
    ``name``: the served model's; ``applier``: the DeltaApplier class (tests inject another)."""
    if not config.live.delta_dir:
        return None
    model_dir = Path(model_dir)
    if len(devices) > 1:
        raise ConfigError("handler.delta_dir: live updates take an unsharded model (one device per worker)")
    if mapped_read_only() and devices[0].type != "cpu":
        raise ConfigError(
            "handler.delta_dir: the tables are mapped read-only (larger than memory) and copied to a GPU; "
            "live updates there write rows in place and need them writable"
        )
    base_file = model_dir / BASE_FILE
    if base_file.is_file():
        base = base_file.read_text().strip()
    else:
        base = base_version(weights)
        logger.warning(
            "the archive has no %s (built before live updates): its base %s computed from the weights", BASE_FILE, base
        )
    factory = DLRMFactory(config)
    target = target_for(config, factory, name, base)
    live = applier(model, config, factory, config.live.delta_dir, target, config.live.delta_poll_s, emit, model_dir)
    started = time.perf_counter()
    # The first conversion pays ~1 s of imports and set-up (measured: 1.1 s for 1,000 int8 rows, then
    # 7 ms for 10,000): paid here, before the worker reports ready, not beside the first delta's batches
    fused_rows({"warm": torch.zeros(1, config.embedding_dim)}, config.build.embedding_dtype)
    n = live.catch_up()
    logger.info(
        "live updates from %s (base %s): %d delta(s) applied at start in %.1f s, now at sequence %d",
        config.live.delta_dir,
        base,
        n,
        time.perf_counter() - started,
        live.applied,
    )
    live.start()
    return live
