#!/usr/bin/env python
"""Score requests with an unpacked archive loaded as a TorchServe worker loads it: the child that
``build_mar.py --verify`` runs (``dlrmkit.checkpoint.verify_archive``).

    python scripts/as_worker.py METRICS_YAML MODEL_DIR REQUESTS ANSWERS

MODEL_DIR (an unpacked .mar) goes first on ``sys.path``, so the handler and the kit load from the
archive's own files; TorchServe's model loader and service load it, and each batch of the
archive's ``batchSize`` requests of REQUESTS (a JSON list of /predictions bodies) goes through the
service's entry point with the context TorchServe builds. ANSWERS gets ``[[status, body], ...]``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def command(metrics_yaml: str | Path = ROOT / "metrics.yaml") -> list[str]:
    """What ``verify_archive`` runs, MODEL_DIR REQUESTS ANSWERS appended: this script, with the
    repository's metrics.yaml (which the archive does not carry)."""
    return [sys.executable, str(Path(__file__).resolve()), str(metrics_yaml)]


def score_as_worker(model_dir: str, requests: str, answers: str, metrics_yaml: str) -> None:
    """Load ``model_dir`` with TorchServe's model loader, as ``ts.model_service_worker`` does, and
    answer each request of ``requests`` through the service's entry point with the context
    TorchServe builds, ``batchSize`` requests per call; writes ``[[status, body], ...]`` to
    ``answers``."""
    # TorchServe loads only here, in the child, once sys.path puts the archive's files first.
    from ts.metrics.metric_cache_yaml_impl import MetricsCacheYamlImpl
    from ts.model_loader import ModelLoaderFactory
    from ts.service import Service
    from ts.utils.util import get_yaml_config

    manifest = json.loads((Path(model_dir) / "MAR-INF" / "MANIFEST.json").read_text())["model"]
    batch_size = int(get_yaml_config(str(Path(model_dir) / manifest["configFile"])).get("batchSize") or 1)
    metrics = MetricsCacheYamlImpl(config_file_path=metrics_yaml)
    metrics.initialize_cache()
    service = ModelLoaderFactory.get_model_loader().load(
        manifest["modelName"], model_dir, manifest["handler"], None, batch_size, None, True, metrics
    )
    bodies = json.loads(Path(requests).read_text())
    out = []
    for lo in range(0, len(bodies), batch_size):
        # The frontend's message, as the worker decodes it: an application/json body arrives parsed.
        batch = [
            {
                "requestId": f"verify-{lo + i}".encode(),
                "parameters": [{"name": "body", "value": b, "contentType": "application/json"}],
            }
            for i, b in enumerate(bodies[lo : lo + batch_size])
        ]
        headers, inputs, ids = Service.retrieve_data_for_inference(batch)
        context = service.context
        context.request_ids, context.request_processor, context.metrics.request_ids = ids, headers, ids
        bodies_out = service._entry_point(inputs, context)
        for i, body in enumerate(bodies_out):
            body = body.decode() if isinstance(body, (bytes, bytearray)) else body
            out.append([context.get_response_status(i)[0], body])
    Path(answers).write_text(json.dumps(out))


if __name__ == "__main__":
    metrics_yaml, model_dir, requests, answers = sys.argv[1:]
    # The archive's own code first, in place of this script's folder (scripts/ holds no module
    # the worker should see).
    sys.path[0] = model_dir
    score_as_worker(model_dir, requests, answers, metrics_yaml)
