"""Proving a built archive against the trainer's own scores (``scripts/build_mar.py --verify``).

What a checkpoint does not record (pooling, the dense features' order and preprocessing, a DCP
directory's feature order) is proven here: the built archive, loaded as a TorchServe worker loads
it, scores the trainer's own requests, and every row is compared with the trainer's score; a
reduced-precision dense half is judged by the accuracy contract (``dlrmkit.accuracy.contract``).

The kit never loads TorchServe itself: the caller hands ``verify_archive`` the command of a child
process that does (``scripts/as_worker.py``).
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from dlrmkit.accuracy import AUC_RATIO, auc, contract, json_lines
from dlrmkit.errors import ConfigError


@dataclass
class Verified:
    """What ``verify_archive`` found: rows checked, the largest |served - trainer| and where."""

    rows: int
    requests: int
    max_delta: float
    worst: str  # "line L, row R: served S, trainer T"
    over: int  # rows off by more than the tolerance
    auc: tuple[float, float] | None  # (served, trainer) when the file has labels
    # dense_precision bf16 / int8: dlrmkit.accuracy.contract's AUC ratio, max and p99 |dp| vs the trainer
    contract: dict | None = None


def read_verify_file(path: str | Path) -> list[dict]:
    """``--verify FILE``: JSON lines ``{"request": <a /predictions JSON body>, "scores": [...],
    "labels": [...]}`` (labels optional), one trainer score per row of the request."""
    lines = []
    for n, line in json_lines(path, "--verify"):
        where = f"--verify {path}, line {n}"
        try:
            doc = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where}: not JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("request"), dict):
            raise ConfigError(
                f'{where}: expected {{"request": {{...}}, "scores": [...]}}, got keys '
                f"{sorted(doc) if isinstance(doc, dict) else type(doc).__name__}"
            )
        for key in ("scores", "labels"):
            value = doc.get(key)
            if key == "labels" and value is None:
                continue
            if (
                not isinstance(value, list)
                or not value
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
            ):
                raise ConfigError(f"{where}: {key!r}: expected a non-empty list of numbers, one per row")
        if doc.get("labels") is not None and len(doc["labels"]) != len(doc["scores"]):
            raise ConfigError(f"{where}: {len(doc['labels'])} labels for {len(doc['scores'])} scores")
        lines.append({"line": n, **doc})
    if not lines:
        raise ConfigError(f"--verify {path}: no requests in the file")
    if len({d.get("labels") is None for d in lines}) > 1:
        raise ConfigError(f"--verify {path}: some lines have labels and some do not; give them on every line or none")
    return lines


def verify_archive(
    mar: str | Path,
    path: str | Path,
    worker: Sequence[str],
    tolerance: float = 1e-5,
    log: Callable[[str], None] = print,
    precision: str = "fp32",
    logits: bool = False,
    auc_ratio: float = AUC_RATIO,
) -> Verified:
    """Score every request of ``path`` (``read_verify_file``) with the archive ``mar`` loaded as a
    TorchServe worker loads it, and compare each row with the trainer's score. The archive is
    unpacked, and ``worker + [MODEL_DIR, REQUESTS, ANSWERS]`` runs in it as a child process: it
    loads MODEL_DIR as a worker does (``scripts/as_worker.py``: its ``sys.path`` starting with the
    archive's own files, TorchServe's own model loader and service, batches of the archive's
    ``batchSize``) and writes ``[[status, body], ...]`` for the JSON list of request bodies
    REQUESTS to ANSWERS. A request the handler refuses is a ConfigError naming its line and the
    handler's answer."""
    lines = read_verify_file(path)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dlrm-verify-") as tmp:
        model_dir, requests, answers = Path(tmp) / "model", Path(tmp) / "requests.json", Path(tmp) / "answers.json"
        with zipfile.ZipFile(mar) as z:
            z.extractall(model_dir)
        requests.write_text(json.dumps([d["request"] for d in lines]))
        # The child's output is the worker's log; shown only when it fails.
        run = subprocess.run(
            [*worker, str(model_dir), str(requests), str(answers)], cwd=model_dir, capture_output=True, text=True
        )
        if run.returncode != 0:
            raise ConfigError(
                f"--verify: the archive did not load or score as a worker "
                f"(exit {run.returncode}):\n{run.stderr[-3000:]}"
            )
        answered = json.loads(answers.read_text())
    deltas: list[tuple] = []  # (|d|, line, row, served, trainer)
    served_all: list[float] = []
    trainer_all: list[float] = []
    labels_all: list[int] = []
    for doc, (status, body) in zip(lines, answered):
        where = f"--verify {path}, line {doc['line']}"
        if status != 200:
            raise ConfigError(f"{where}: the archive answered {status}: {body}")
        served = json.loads(body)["scores"]
        if len(served) != len(doc["scores"]):
            raise ConfigError(
                f"{where}: the archive answered {len(served)} scores for {len(doc['scores'])} "
                f"trainer scores (one per row of the request)"
            )
        deltas += [(abs(s - t), doc["line"], r, s, t) for r, (s, t) in enumerate(zip(served, doc["scores"]))]
        served_all += served
        trainer_all += doc["scores"]
        labels_all += doc.get("labels") or []
    worst = max(deltas)
    aucs = (auc(served_all, labels_all), auc(trainer_all, labels_all)) if labels_all else None
    terms = None
    if precision != "fp32" and labels_all:
        prob = (lambda v: torch.sigmoid(torch.tensor(v, dtype=torch.float64)).tolist()) if logits else list
        terms = contract(prob(served_all), prob(trainer_all), labels_all, auc_ratio)
    result = Verified(
        len(deltas),
        len(lines),
        worst[0],
        f"line {worst[1]}, row {worst[2]}: served {worst[3]:.7g}, trainer {worst[4]:.7g}",
        sum(d[0] > tolerance for d in deltas),
        aucs,
        terms,
    )
    log(
        f"[verify] {result.rows} rows in {result.requests} requests of {path} scored by the archive as a worker "
        f"loads it in {time.perf_counter() - started:.1f} s: max |served - trainer| {result.max_delta:.3g} "
        f"(tolerance {tolerance:g}; {result.worst})"
        + (f"; AUC served {aucs[0]:.6f} vs trainer {aucs[1]:.6f}" if aucs else "")
    )
    if terms:
        log(
            f"[verify] dense_precision {precision}: AUC ratio {terms['auc_ratio']:.5f} (contract >= {auc_ratio:g}: "
            f"{'holds' if terms['holds'] else 'BROKEN'}), |dp| max {terms['max_dp']:.4g}, p99 {terms['p99_dp']:.4g}"
        )
    return result
