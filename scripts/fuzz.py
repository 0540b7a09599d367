#!/usr/bin/env python3
"""Coverage-guided fuzzing (atheris, libFuzzer) of every parser that faces the network.

Targets, each one request body as the handler gets it:

    json        /predictions JSON forms (instance, instances, ranking, columns, pytorch/serve row)
    criteo      /predictions Content-Type: text/tab-separated-values (Criteo log lines)
    kserve_v1   POST /v1/models/<m>:predict
    oip_json    POST /v2/models/<m>/infer, JSON tensors
    oip_binary  POST /v2/models/<m>/infer, binary tensor data: the input is the
                Inference-Header-Content-Length value, a newline, then the body

The invariant (``check``): the request either parses into a request whose collated batch scores
(one finite score per row) and whose answer encodes, or raises the kit's RequestError with a 4xx
status and a message naming a field (``<field>: ...``); nothing else.

    scripts/fuzz.py smoke                       # CI: every target, seeded, a few seconds each
    scripts/fuzz.py campaign --minutes 15       # every target for 15 minutes: results/fuzz.{json,md}
    scripts/fuzz.py run json -- -runs=1000      # one target, libFuzzer's own flags after --
    scripts/fuzz.py replay FILE...              # check saved inputs (tests/fuzz/<target>/*)

Seeds: sample_requests/ (and its malformed/), plus a few bodies per protocol built here. The
regression inputs the campaign found are kept in tests/fuzz/<target>/ and replayed by
tests/test_fuzz.py.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGETS = ("json", "criteo", "kserve_v1", "oip_json", "oip_binary")
REGRESSIONS = ROOT / "tests" / "fuzz"
# "<field>: <what is wrong>": a field name may hold any character (a client's key), but not none.
NAMED = re.compile(r"(?!: ).+?: \S", re.S)


# --- the parsers under test -------------------------------------------------------------------


def _configs() -> dict:
    """Small models of the shipped layouts (so sample_requests/ fit): model-config.yaml and
    model-config.criteo.yaml with D = 8, small tables and small request limits."""
    import yaml

    from dlrmkit.config import DLRMConfig

    def small(name: str, **changes) -> DLRMConfig:
        handler = yaml.safe_load((ROOT / name).read_text())["handler"]
        handler.update(
            embedding_dim=8,
            dense_arch_layer_sizes=[16, 8],
            over_arch_layer_sizes=[16, 1],
            max_instances_per_request=64,
            max_ids_per_request=512,
            embedding_dtype="fp32",
            torch_threads=1,
            **changes,
        )
        return DLRMConfig.from_dict(handler)

    return {"json": small("model-config.yaml"), "criteo": small("model-config.criteo.yaml", num_embeddings=[50] * 26)}


class Harness:
    """The parsers, the batch and the forward of one config, as the handler runs them."""

    def __init__(self, target: str):
        import torch

        from dlrmkit.model import DLRMFactory
        from dlrmkit.forms import RequestParser

        torch.set_num_threads(1)
        self.target = target
        self.config = _configs()["criteo" if target == "criteo" else "json"]
        self.parser = RequestParser(self.config)
        self.model = DLRMFactory(self.config).random()

    def requests(self, data: bytes):
        """The protocol objects the handler would make of ``data`` (several body types where
        TorchServe may hand over either)."""
        from dlrmkit.protocols import open_request

        model = ("dlrm", "1.0")
        t = self.target
        if t == "oip_binary":
            length, _, body = data.partition(b"\n")
            yield open_request(body, True, length.decode("latin-1"), self.parser, model)
            return
        kserve = t in ("kserve_v1", "oip_json")
        content_type = "text/tab-separated-values" if t == "criteo" else "application/json"
        yield open_request(data, kserve, None, self.parser, model, content_type)
        try:  # TorchServe hands text/* bodies over as str, and may decode JSON into a dict
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            return
        if t == "criteo":
            yield open_request(text, False, None, self.parser, model, content_type)
            return
        try:
            decoded = json.loads(text)
        except (ValueError, RecursionError):
            return
        if isinstance(decoded, dict):
            yield open_request(decoded, kserve, None, self.parser, model, content_type)

    def check(self, data: bytes) -> None:
        """The invariant; raises AssertionError (or what the kit let escape) otherwise."""
        for req in self.requests(data):
            self._check(req)

    def _check(self, req) -> None:
        from dlrmkit.batch import collate, scores
        from dlrmkit.errors import RequestError

        try:
            parsed = req.parse()
        except RequestError as e:
            _refusal(e)
            assert isinstance(req.error(e).body, bytes)
            return
        assert parsed.n >= 1, f"a request of {parsed.n} rows"
        batch, errors = collate([parsed], self.config)
        if errors:
            assert batch is None and list(errors) == [0], errors
            _refusal(errors[0])
            return
        out = scores(self.model, batch, self.config)
        assert len(out) == 1 and len(out[0]) == parsed.n, (len(out), parsed.n)
        assert all(math.isfinite(s) for s in out[0]), out[0]
        assert isinstance(req.answer(out[0]).body, bytes)


def _refusal(e) -> None:
    assert 400 <= e.status < 500, (e.status, e.message)
    assert NAMED.match(e.message), f"names no field: {e.message!r}"
    assert e.phrase.isascii()


# --- seeds --------------------------------------------------------------------------------------


def seeds(target: str) -> list[bytes]:
    samples = ROOT / "sample_requests"
    json_samples = [p.read_bytes() for p in sorted(samples.glob("*.json")) if p.stem not in ("criteo", "dlrmv2")]
    malformed = [p.read_bytes() for p in sorted((samples / "malformed").glob("*.json"))]
    if target == "json":
        return (
            json_samples
            + malformed
            + [
                json.dumps(
                    {
                        "float_features": [0.1] * 5,
                        "id_list_features.lengths": [1, 2, 0],
                        "id_list_features.values": [3, 4, 5],
                    }
                ).encode(),
                b'{"columns": {"dense": [[1,2,3,4,5],[1,2,3,4,5]], "sparse": {"feature_0": {"values": [1, 2]}}}}',
            ]
        )
    if target == "criteo":
        lines = (samples / "criteo.tsv").read_bytes().splitlines(keepends=True)
        return [lines[0], b"".join(lines[:3]), lines[0].rstrip(b"\n").replace(b"\t", b"\t\t", 1), b"\n", b"1\t2\n"]
    if target == "kserve_v1":
        return [p for p in json_samples if b'"instances"' in p] + malformed + [b'{"instances": []}', b"{}"]
    inputs = _v2_inputs()
    if target == "oip_json":
        return [
            json.dumps({"inputs": inputs}).encode(),
            json.dumps(
                {
                    "id": "a",
                    "inputs": inputs[:1]
                    + [
                        {"name": f"feature_{f}", "datatype": "INT64", "shape": [2], "data": [f, f + 1]}
                        for f in range(3)
                    ],
                    "outputs": [{"name": "scores"}],
                }
            ).encode(),
            b'{"inputs": [{"name": "dense", "datatype": "FP64", "shape": [1, 5], "data": [[1, 2, 3, 4, NaN]]}]}',
        ]
    single = inputs[:1] + [
        {"name": f"feature_{f}", "datatype": "INT64", "shape": [2], "data": [f, f + 1]} for f in range(3)
    ]
    return [
        _binary(inputs),
        _binary(single),
        _binary(single, parameters={"binary_data_output": True}),
        _binary(single)[:-3],
        b"12x\n" + _binary(single).partition(b"\n")[2],
    ]


def _v2_inputs() -> list[dict]:
    return [
        {"name": "dense", "datatype": "FP32", "shape": [2, 5], "data": [[0.5, 1.0, 0.0, -1.0, 2.0]] * 2},
        {"name": "feature_0.lengths", "datatype": "INT64", "shape": [2], "data": [2, 1]},
        {"name": "feature_0.values", "datatype": "INT64", "shape": [3], "data": [3, 4, 5]},
        {"name": "feature_1.lengths", "datatype": "INT32", "shape": [2], "data": [1, 0]},
        {"name": "feature_1.values", "datatype": "INT32", "shape": [1], "data": [7]},
        {"name": "feature_2", "datatype": "INT64", "shape": [2], "data": [8, 9]},
    ]


def _binary(inputs: list[dict], **request) -> bytes:
    """The binary tensor data extension, as this target reads it: header length, newline, body."""
    import numpy as np

    raws, header_inputs = [], []
    for i in inputs:
        dtype = {"FP32": "<f4", "INT64": "<i8", "INT32": "<i4"}[i["datatype"]]
        raw = np.asarray(i["data"], dtype=dtype).tobytes()
        header_inputs.append(
            {k: v for k, v in i.items() if k != "data"} | {"parameters": {"binary_data_size": len(raw)}}
        )
        raws.append(raw)
    header = json.dumps({"inputs": header_inputs, **request}).encode()
    return str(len(header)).encode() + b"\n" + header + b"".join(raws)


# --- running --------------------------------------------------------------------------------


def fuzz(target: str, libfuzzer_args: list[str], crashes: Path | None) -> None:
    """One target under atheris, in this process (atheris ends it). With ``crashes``, an input
    that breaks the invariant is saved there (its traceback beside it) and the run goes on;
    without, the first one stops the run (libFuzzer writes it as crash-<sha1>)."""
    import atheris

    # The libraries are imported before instrumenting: coverage is measured in the kit only.
    import msgspec  # noqa: F401
    import numpy  # noqa: F401
    import torch  # noqa: F401
    import torchrec  # noqa: F401
    import yaml  # noqa: F401

    kit = [
        "dlrmkit.batch",
        "dlrmkit.request",
        "dlrmkit.schema",
        "dlrmkit.forms",
        "dlrmkit.protocols",
        "dlrmkit.criteo",
        "dlrmkit.errors",
    ]
    with atheris.instrument_imports(include=["dlrmkit"]):
        for name in kit:
            importlib.import_module(name)
    harness = Harness(target)
    seen: set[str] = set()

    def one_input(data: bytes) -> None:
        if crashes is None:
            harness.check(data)
            return
        try:
            harness.check(data)
        except Exception as e:  # kept and counted: the campaign goes on
            # One of each kind: where the kit raised (for a refusal the invariant refused, the
            # refusal's own raise), and what.
            cause = e.__context__ if isinstance(e, AssertionError) and e.__context__ else e
            tb = traceback.extract_tb(cause.__traceback__)
            where = (
                f"{type(e).__name__} ({type(cause).__name__}) at {tb[-1].filename.rsplit('/', 1)[-1]}:{tb[-1].lineno}"
            )
            if where not in seen:
                seen.add(where)
                name = hashlib.sha1(data).hexdigest()[:16]
                (crashes / f"{target}-{name}.bin").write_bytes(data)
                (crashes / f"{target}-{name}.txt").write_text(f"{where}\n{traceback.format_exc()}")
                print(f"[fuzz] {target}: NEW FAILURE {where}", file=sys.stderr, flush=True)

    atheris.Setup([sys.argv[0], *libfuzzer_args], one_input)
    atheris.Fuzz()


_STAT = re.compile(r"^stat::(\w+):\s+(\d+)", re.M)
_PROGRESS = re.compile(r"#(\d+)\s+\w+\s+cov: (\d+) ft: (\d+) corp: (\d+)/")


def run_target(
    target: str, seconds: float, corpus: Path, crashes: Path | None, runs: int | None = None, seed: int = 1
) -> dict:
    """One target in a subprocess for ``seconds``, corpus seeded; returns libFuzzer's figures."""
    corpus.mkdir(parents=True, exist_ok=True)
    for data in seeds(target) + [p.read_bytes() for p in sorted((REGRESSIONS / target).glob("*"))]:
        (corpus / hashlib.sha1(data).hexdigest()).write_bytes(data)
    args = [
        f"-max_total_time={max(1, int(seconds))}",
        f"-seed={seed}",
        "-print_final_stats=1",
        "-max_len=8192",
        "-timeout=20",
        "-rss_limit_mb=4096",
        str(corpus),
    ]
    if runs is not None:
        args.insert(0, f"-runs={runs}")
    cmd = [sys.executable, str(Path(__file__).resolve()), "run"]
    if crashes is not None:
        crashes.mkdir(parents=True, exist_ok=True)
        cmd += ["--crashes", str(crashes)]
    cmd.append(target)
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run([*cmd, "--", *args], cwd=tmp, capture_output=True, text=True, errors="replace")
        crash_files = sorted(Path(tmp).glob("crash-*"))
        found = [p.read_bytes() for p in crash_files]
    log = proc.stdout + proc.stderr
    stats = {k: int(v) for k, v in _STAT.findall(log)}
    progress = _PROGRESS.findall(log)
    last = progress[-1] if progress else ("0", "0", "0", "0")
    result = {
        "target": target,
        "seconds": round(time.monotonic() - started, 1),
        "returncode": proc.returncode,
        "inputs_tried": stats.get("number_of_executed_units", int(last[0])),
        "exec_per_sec": stats.get("average_exec_per_sec"),
        "coverage_edges": int(last[1]),
        "features": int(last[2]),
        "corpus_units": len(list(corpus.iterdir())),
        "seed_units": len(seeds(target)),
        "new_units_added": stats.get("new_units_added"),
        "peak_rss_mb": stats.get("peak_rss_mb"),
        "failures": sorted(
            {p.read_text().splitlines()[0] for p in (crashes or Path("/nonexistent")).glob(f"{target}-*.txt")}
        ),
    }
    if proc.returncode != 0:
        result["log_tail"] = log[-3000:]
        result["crash_inputs"] = [d.hex() for d in found]
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="one target under atheris in this process; libFuzzer flags after --")
    r.add_argument("target", choices=TARGETS)
    r.add_argument("--crashes", type=Path, help="save failing inputs here and go on (campaign mode)")
    r.add_argument("libfuzzer", nargs="*", help="libFuzzer flags and corpus directories")
    s = sub.add_parser("smoke", help="every target, seeded, for a few seconds each (CI); exit 1 on a failure")
    s.add_argument("--seconds", type=float, default=4, help="per target (default 4)")
    s.add_argument("--runs", type=int, default=3000, help="inputs per target at most (default 3000)")
    s.add_argument("--targets", nargs="+", choices=TARGETS, default=list(TARGETS))
    c = sub.add_parser("campaign", help="every target for --minutes each; figures to results/fuzz.{json,md}")
    c.add_argument("--minutes", type=float, default=15, help="per target (default 15)")
    c.add_argument("--targets", nargs="+", choices=TARGETS, default=list(TARGETS))
    c.add_argument("--work", type=Path, default=ROOT / "build" / "fuzz", help="corpus and failures (build/fuzz)")
    c.add_argument("--json", type=Path, default=ROOT / "results" / "fuzz.json")
    c.add_argument("--table", type=Path, default=ROOT / "results" / "fuzz.md")
    y = sub.add_parser("replay", help="check saved inputs against the invariant; exit 1 on a failure")
    y.add_argument("files", nargs="+", type=Path, help="tests/fuzz/<target>/<name>: the folder names the target")
    a = p.parse_args()

    if a.cmd == "run":
        fuzz(a.target, a.libfuzzer, a.crashes)
    elif a.cmd == "smoke":
        bad = 0
        with tempfile.TemporaryDirectory() as tmp:
            for t in a.targets:
                res = run_target(t, a.seconds, Path(tmp) / t, None, runs=a.runs)
                print(
                    f"[fuzz] {t}: {res['inputs_tried']} inputs in {res['seconds']} s, cov {res['coverage_edges']}, "
                    f"exit {res['returncode']}",
                    flush=True,
                )
                if res["returncode"] != 0:
                    bad += 1
                    print(res["log_tail"], file=sys.stderr)
        sys.exit(1 if bad else 0)
    elif a.cmd == "campaign":
        results = []
        shutil.rmtree(a.work / "crashes", ignore_errors=True)
        for t in a.targets:
            print(f"[fuzz] {t}: {a.minutes} min ...", flush=True)
            res = run_target(t, a.minutes * 60, a.work / "corpus" / t, a.work / "crashes")
            print(
                f"[fuzz] {t}: {res['inputs_tried']} inputs, cov {res['coverage_edges']}, "
                f"{len(res['failures'])} failure kinds",
                flush=True,
            )
            results.append(res)
            write_report(results, a.json, a.table)
    else:
        failed = 0
        for path in a.files:
            try:
                Harness(path.parent.name).check(path.read_bytes())
            except Exception:
                failed += 1
                print(f"{path}: FAILED\n{traceback.format_exc()}", file=sys.stderr)
        sys.exit(1 if failed else 0)


def write_report(results: list[dict], json_path: Path, table_path: Path) -> None:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        "unknown CPU",
    )
    head = {
        "command": "nice -n 15 .venv/bin/python scripts/fuzz.py campaign " + " ".join(sys.argv[2:]),
        "cpu": cpu,
        "atheris": _version("atheris"),
        "kit": _kit_version(),
        "targets": results,
        "total_seconds": round(sum(r["seconds"] for r in results), 1),
        "total_inputs": sum(r["inputs_tried"] for r in results),
    }
    json_path.write_text(json.dumps(head, indent=2) + "\n")
    rows = [
        "| target | minutes | inputs tried | inputs/s | coverage (edges) | features | corpus | failures |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        rows.append(
            f"| {r['target']} | {r['seconds'] / 60:.1f} | {r['inputs_tried']:,} | {r['exec_per_sec']} | "
            f"{r['coverage_edges']} | {r['features']} | {r['corpus_units']} | "
            f"{'; '.join(r['failures']) or 'none'} |"
        )
    table_path.write_text(
        f"# Fuzz campaign\n\n`{head['command']}` on {cpu} (atheris {head['atheris']}): "
        f"{head['total_inputs']:,} inputs in {head['total_seconds'] / 60:.0f} minutes.\n\n" + "\n".join(rows) + "\n"
    )


def _kit_version() -> str:
    """The commit the campaign ran on, or the FUZZ_KIT environment variable's description."""
    if os.environ.get("FUZZ_KIT"):
        return os.environ["FUZZ_KIT"]
    out = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


if __name__ == "__main__":
    main()
