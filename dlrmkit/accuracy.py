"""How served scores are judged against the trainer's: the AUC, MLPerf's accuracy contract for a
reduced-precision dense half, and the calibration inputs that fit int8's static scales.

``scripts/build_mar.py --verify`` judges an archive with ``contract`` (through
``dlrmkit.checkpoint.verify_archive``), ``--calibrate FILE`` reads its rows with
``calibration_inputs``; ``scripts/train.py`` and the benchmarks report ``auc``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import torch

from dlrmkit.batch import collate
from dlrmkit.config import DLRMConfig
from dlrmkit.dense import CALIBRATION_ROWS
from dlrmkit.dense import calibration_inputs as dense_inputs
from dlrmkit.errors import ConfigError, RequestError
from dlrmkit.forms import RequestParser
from dlrmkit.model import DLRMFactory

# MLPerf's rule for dlrm-v2-99.9: served AUC >= 99.9% of the fp32 reference's.
AUC_RATIO = 0.999


def auc(scores: Sequence[float], labels: Sequence[int]) -> float:
    """Exact ROC AUC: the chance that a random positive outscores a random negative (ties count
    half); torchmetrics, which torchrec already needs. scripts/train.py reports the same.

    >>> auc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1])
    0.75
    """
    # torchmetrics loads lazily: importing it costs about a second, which only a judge pays.
    from torchmetrics.functional.classification import binary_auroc

    return float(binary_auroc(torch.as_tensor(scores, dtype=torch.float64), torch.as_tensor(labels).long()))


def contract(served: list[float], reference: list[float], labels: list[int], ratio: float = AUC_RATIO) -> dict:
    """MLPerf's accuracy rule for one precision: AUC of ``served`` vs AUC of the fp32
    ``reference`` scores on the same rows, with the max and p99 |delta probability|."""
    s, r = torch.tensor(served, dtype=torch.float64), torch.tensor(reference, dtype=torch.float64)
    delta = (s - r).abs()
    a_served, a_ref = auc(served, labels), auc(reference, labels)
    return {
        "auc": a_served,
        "auc_fp32": a_ref,
        "auc_ratio": a_served / a_ref if a_ref else float("nan"),
        "max_dp": float(delta.max()),
        "p99_dp": float(torch.quantile(delta, 0.99)),
        "holds": a_served >= ratio * a_ref,
        "rows": len(served),
    }


def calibration_inputs(path: str | Path, model: torch.nn.Module, config: DLRMConfig) -> dict[str, torch.Tensor]:
    """``--calibrate FILE``: the dense half's inputs for int8's static scales, from JSON lines that
    are /predictions bodies or ``{"request": body, ...}`` (a --verify file), parsed and collated as
    the handler does and looked up in ``model``'s tables (dlrmkit.dense.calibration_inputs)."""
    parser, batches = RequestParser(config), []
    for n, line in json_lines(path, "--calibrate"):
        try:
            doc = json.loads(line)
            body = doc["request"] if isinstance(doc, dict) and isinstance(doc.get("request"), dict) else doc
            batch, bad = collate([parser.parse(body)], config)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--calibrate {path}, line {n}: not JSON ({e.msg} at column {e.colno})") from None
        except RequestError as e:
            raise ConfigError(f"--calibrate {path}, line {n}: {e.message}") from None
        if bad:
            raise ConfigError(f"--calibrate {path}, line {n}: {bad[0].message}")
        batches.append((batch.dense, batch.sparse))
    if not batches:
        raise ConfigError(f"--calibrate {path}: no requests in the file")
    return dense_inputs(model, batches)


def int8_calibration(
    model: torch.nn.Module, config: DLRMConfig, requests: str | Path | None = None
) -> tuple[dict[str, torch.Tensor], str]:
    """The dense half's inputs an archive carries for int8's static scales, and where they came
    from: ``requests`` (``--calibrate FILE``, a sample of the training data), else, for random
    weights, which have no training data, CALIBRATION_ROWS of the kit's own random rows (seeded)."""
    if requests:
        return calibration_inputs(requests, model, config), str(requests)
    factory, gen = DLRMFactory(config), torch.Generator().manual_seed(config.build.seed)
    probes = [factory.probe_batch(256, gen) for _ in range(-(-CALIBRATION_ROWS // 256))]
    return dense_inputs(model, probes), f"{CALIBRATION_ROWS} random rows"


def json_lines(path: str | Path, option: str) -> list[tuple[int, str]]:
    """The non-blank lines of ``path`` with their 1-based numbers; a file that cannot be read is a
    ConfigError naming ``option``."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"{option} {path}: {e.strerror}") from None
    return [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
