#!/usr/bin/env python
"""KServe deployment files for a DLRM config.

    python scripts/kserve_deploy.py layout --out build/kserve        # then copy it to object storage:
    aws s3 cp --recursive build/kserve s3://BUCKET/dlrm              # storageUri: s3://BUCKET/dlrm
    python scripts/kserve_deploy.py sizing > deploy/kserve/base/sizing.yaml
    python scripts/kserve_deploy.py sizing --kind Deployment > deploy/kserve/plain/sizing.yaml
    python scripts/kserve_deploy.py sizing --door kserve > deploy/kserve/kserve-door/sizing.yaml

``layout`` writes what KServe's TorchServe runtime reads from ``storageUri`` (mounted at
/mnt/models): ``config/config.properties`` (enable_envvars_config=true, a model_snapshot naming
the archive with the config's batchSize / maxBatchDelay / timeouts), ``config/metrics.yaml``
and ``model-store/dlrm.mar`` (built from the config, or copied with --mar).
``sizing`` writes the kustomize patch of the predictor's resources and probe timings from
scripts/sizing.py for the config and a pod of --cpus CPUs (the CPU rule's workers for them,
dlrmkit.cpus.cpu_rule: one single-threaded worker per CPU; memory for those workers and the chosen
embedding dtype; startupProbe allowing the config's startupTimeout). ``layout`` writes the same
worker count into the runtime's model_snapshot: give both the same --cpus (default 2).
``sizing --door kserve`` sizes the second door's InferenceService (dlrm_kserve.py: its REST
processes by the same CPU rule, plus the server's own, each loading the model): its port and
kserve's health paths.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

MOUNT = "/mnt/models"  # where KServe's storage initializer puts storageUri's files
INFERENCE_PORT = 8085  # KServe's TorchServe sample config; the runtime's container port
FRONTEND_BYTES = 1 << 30  # TorchServe's Java frontend (heap + threads), beside the workers
GIB = 1 << 30
POD_CPUS = 2  # the pod's CPU request and limit, unless --cpus says otherwise
PLUGIN = "build/plugins/dlrm-oip.jar"  # `make plugin`
DOOR_PORT = 8080  # the second door's REST port (dlrm_kserve.py --http-port), its runtime's containerPort
DOOR_SERVER_BYTES = 512 << 20  # kserve's server in the door's process (FastAPI, uvicorn, gRPC), beside the model
DOOR_NAME = "dlrm-kserve"  # the second door's InferenceService (deploy/kserve/kserve-door)


def pod_workers(top: dict, cpus: int) -> int:
    """TorchServe's workers: the config's maxWorkers when it pins one, else the CPU rule's count for
    the pod's CPUs (dlrmkit.cpus.model_workers)."""
    from dlrmkit.cpus import model_workers

    return model_workers(top.get("maxWorkers"), cpus)


def door_processes(top: dict, config, cpus: int) -> int:
    """The second door's processes that each load the model in a pod of ``cpus`` CPUs: its REST
    processes (dlrm_kserve.py's --workers default, the same rule) and the server's own (gRPC)."""
    from dlrmkit.cpus import model_workers

    return model_workers(top.get("maxWorkers"), cpus, config.threads.torch_threads) + 1


def properties(
    config_path: Path, mount: str, model: str = "dlrm", cpus: int = POD_CPUS, port: int = INFERENCE_PORT
) -> str:
    """config.properties as KServe's TorchServe runtime reads it, for a pod of ``cpus`` CPUs."""
    import yaml

    top = yaml.safe_load(config_path.read_text()) or {}
    workers = pod_workers(top, cpus)
    version = {
        "defaultVersion": True,
        "marName": f"{model}.mar",
        "minWorkers": int(top.get("minWorkers") or workers),
        "maxWorkers": workers,
        "batchSize": top.get("batchSize", 1),
        "maxBatchDelay": top.get("maxBatchDelay", 100),
        "responseTimeout": top.get("responseTimeout", 120),
    }
    if "startupTimeout" in top:
        version["startupTimeout"] = top["startupTimeout"]
    snapshot = {"name": "startup.cfg", "modelCount": 1, "models": {model: {"1.0": version}}}
    lines = [
        "# Written by scripts/kserve_deploy.py layout for KServe's TorchServe runtime, which starts",
        f"#   torchserve --start --model-store={mount}/model-store --ts-config={mount}/config/config.properties",
        "# TS_<PROPERTY> variables override these (enable_envvars_config); the InferenceService",
        "# empties TS_SERVICE_ENVELOPE: the handler speaks KServe v1 / v2 itself, batch by batch.",
        f"inference_address=http://0.0.0.0:{port}",
        f"management_address=http://0.0.0.0:{port}",
        "metrics_address=http://0.0.0.0:8082",
        # In a pod, the pod's interface (TorchServe's gRPC binds 127.0.0.1 unless told).
        "grpc_inference_address=0.0.0.0",
        "grpc_inference_port=7070",
        "grpc_management_port=7071",
        "enable_envvars_config=true",
        "install_py_dep_per_model=false",
        # KServe's ingress and the pod network are the boundary; its clients send no TorchServe token.
        "disable_token_authorization=true",
        "enable_model_api=false",
        "decode_input_request=false",
        "metrics_mode=prometheus",
        f"metrics_config={mount}/config/metrics.yaml",
        f"model_store={mount}/model-store",
        f"plugins_path={mount}/plugins",  # the OIP endpoints (GET /v2/...; docs/kubernetes.md)
        "model_snapshot=" + json.dumps(snapshot, separators=(",", ":")),
    ]
    return "\n".join(lines) + "\n"


def layout(args) -> Path:
    out = Path(args.out)
    (out / "config").mkdir(parents=True, exist_ok=True)
    (out / "model-store").mkdir(parents=True, exist_ok=True)
    mar = out / "model-store" / f"{args.model_name}.mar"
    if args.mar:
        shutil.copyfile(args.mar, mar)
    else:
        from scripts import build_mar

        build_mar.main(
            ["--config", str(args.config), "--output-dir", str(mar.parent), "--model-name", args.model_name, "--force"]
        )
    (out / "config" / "config.properties").write_text(
        properties(Path(args.config), args.mount, args.model_name, args.cpus, args.port)
    )
    # The OIP endpoint plugin travels with the layout, so KServe's stock runtime image serves it.
    # A checkout builds it (`make plugin`); the image's build stage has no make or JDK and is
    # handed the jar `make image` built (Dockerfile).
    if (ROOT / "Makefile").is_file():
        subprocess.run(["make", "-C", str(ROOT), "--no-print-directory", "plugin"], check=True, stdout=sys.stderr)
    if not (ROOT / PLUGIN).is_file():
        sys.exit(f"error: {ROOT / PLUGIN} is missing: build it with `make plugin`")
    (out / "plugins").mkdir(exist_ok=True)
    shutil.copyfile(ROOT / PLUGIN, out / "plugins" / Path(PLUGIN).name)
    shutil.copyfile(ROOT / "metrics.yaml", out / "config" / "metrics.yaml")
    print(f"[layout] {out}: config/config.properties, config/metrics.yaml, plugins/, model-store/{mar.name}")
    return out


def sizing_patch(
    config_path: Path, kind: str = "InferenceService", cpus: int = POD_CPUS, door: str = "torchserve"
) -> str:
    """The kustomize strategic-merge patch of the InferenceService's predictor, or of the plain
    Deployment's container, for a pod of ``cpus`` CPUs. ``door`` kserve: the second door's
    InferenceService (its REST processes and its server's own, each holding the model beside
    kserve's server, on DOOR_PORT)."""
    import yaml

    from scripts import sizing
    from dlrmkit.config import DLRMConfig

    config = DLRMConfig.from_yaml(config_path)
    top = yaml.safe_load(config_path.read_text()) or {}
    workers = door_processes(top, config, cpus) if door == "kserve" else pod_workers(top, cpus)
    overhead = sizing.parse_bytes("450MiB")
    # The budget only feeds the report's worker counts, unused here: replicas scale out instead.
    rep = sizing.report(config, 64 * GIB, overhead, 20.0, 200.0)["dtypes"][config.build.embedding_dtype]
    # CPU workers share one mmapped copy of the tables; each worker adds its process.
    server = DOOR_SERVER_BYTES if door == "kserve" else FRONTEND_BYTES
    need = rep["table_bytes"] + workers * (rep["model_bytes"] - rep["table_bytes"] + overhead) + server
    memory_gib = max(2, math.ceil(need * 1.25 / GIB))  # 25% headroom for batches in flight
    cpu = cpus  # the frontend shares them: one worker per CPU served the most (docs/performance.md)
    startup_s = max(rep["startup_timeout_s"], int(top.get("startupTimeout", 0)))
    resources = {
        "requests": {"cpu": str(cpu), "memory": f"{memory_gib}Gi"},
        "limits": {"cpu": str(cpu), "memory": f"{memory_gib}Gi"},
    }

    # TorchServe: its frontend's /ping. The second door starts listening once the model is loaded;
    # kserve's /v2/health/live answers from then on.
    port, live = (DOOR_PORT, "/v2/health/live") if door == "kserve" else (INFERENCE_PORT, "/ping")

    def ping():  # a fresh dict each time: no YAML anchors in the patch
        return {"httpGet": {"path": live, "port": port}, "periodSeconds": 10, "timeoutSeconds": 5}

    container = {
        "resources": resources,
        # The model may take startupTimeout to load; liveness waits for this probe.
        "startupProbe": {**ping(), "failureThreshold": math.ceil(startup_s / 10)},
        # Liveness stays the frontend's cheap /ping; traffic follows the model's real workers:
        # the OIP plugin's model-ready answers 503 while no worker of the model is READY (the second
        # door: kserve's, from the loaded model's state).
        "livenessProbe": {**ping(), "failureThreshold": 3},
        "readinessProbe": {
            "httpGet": {"path": "/v2/models/dlrm/ready", "port": port},
            "periodSeconds": 5,
            "timeoutSeconds": 5,
            "failureThreshold": 1,
        },
    }
    if kind == "InferenceService":
        patch = {
            "apiVersion": "serving.kserve.io/v1beta1",
            "kind": kind,
            "metadata": {"name": DOOR_NAME if door == "kserve" else "dlrm"},
            "spec": {"predictor": {"model": container}},
        }
    else:
        patch = {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "dlrm"},
            "spec": {"template": {"spec": {"containers": [{"name": "torchserve", **container}]}}},
        }
    head = (
        f"# Generated by scripts/kserve_deploy.py sizing --kind {kind}"
        f"{' --door kserve' if door == 'kserve' else ''} --config {config_path.name}"
        f"{'' if cpus == POD_CPUS else f' --cpus {cpus}'}: "
        f"{config.build.embedding_dtype} tables {sizing.human(rep['table_bytes'])}, "
        f"{f'{workers} processes' if door == 'kserve' else f'{workers} worker(s)'},\n"
        f"# startupTimeout {startup_s} s. Regenerate it when the config changes (a test compares).\n"
    )
    return head + yaml.safe_dump(patch, sort_keys=False)


def main(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    lay = sub.add_parser("layout", help="write the storage layout KServe's TorchServe runtime reads")
    lay.add_argument("--out", required=True, help="folder to write (copy it to the storageUri)")
    lay.add_argument("--config", default=str(ROOT / "model-config.yaml"), help="model config (default: %(default)s)")
    lay.add_argument("--mar", help="an archive already built from --config (default: build one)")
    lay.add_argument("--model-name", default="dlrm", help="model and archive name (default: %(default)s)")
    lay.add_argument("--mount", default=MOUNT, help="where the pod sees the layout (default: %(default)s)")
    lay.add_argument(
        "--port",
        type=int,
        default=INFERENCE_PORT,
        help="inference (and management) port; the runtime's containerPort (default: %(default)s)",
    )
    siz = sub.add_parser("sizing", help="print the InferenceService resources/probes patch for a config")
    siz.add_argument("--config", default=str(ROOT / "model-config.yaml"), help="model config (default: %(default)s)")
    siz.add_argument(
        "--kind",
        choices=["InferenceService", "Deployment"],
        default="InferenceService",
        help="patch the KServe predictor or the plain Deployment (default: %(default)s)",
    )
    siz.add_argument(
        "--door",
        choices=["torchserve", "kserve"],
        default="torchserve",
        help="the front door sized: kserve for deploy/kserve/kserve-door's InferenceService (default: %(default)s)",
    )
    for p in (lay, siz):
        p.add_argument(
            "--cpus",
            type=int,
            default=POD_CPUS,
            help="the pod's CPUs (request = limit); workers follow them (default: %(default)s)",
        )
    args = ap.parse_args(argv)
    if args.command == "layout":
        return layout(args)
    if args.door == "kserve" and args.kind != "InferenceService":
        ap.error("--door kserve: sizes the InferenceService only (use --kind InferenceService)")
    sys.stdout.write(sizing_patch(Path(args.config), args.kind, args.cpus, args.door))


if __name__ == "__main__":
    main()
