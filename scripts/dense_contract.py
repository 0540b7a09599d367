#!/usr/bin/env python
"""MLPerf's accuracy contract per handler.dense_precision on trained models (issue 29).

    python scripts/dense_contract.py   # ~10 min on 2 CPUs: results/dense-contract.{json,md}

scripts/train.py trains each model (synthetic clicks with a learnable signal); its held-out rows
(verify.jsonl, parsed and collated as the handler does) are scored by the served fp32 model (the
archive's fused tables, as a worker loads them) and by its dense half at bf16, int8 static
(calibrated on the verify file itself, the optimistic reading build_mar.py refuses, or on 512 training
rows) and int8 dynamic (no calibration), and with int8 tables (row-wise, as the archive build
quantizes them) under an fp32 and an int8 dense half: dlrmkit.accuracy.contract, AUC >= 99.9% of fp32 with the max
and p99 |delta probability|. A precision this CPU has no instructions for would be served as fp32
(dlrmkit.dense.unsupported); it is compiled anyway here ("forced"): what the rule guards against.
In-process rather than through build_mar.py --verify: the same functions, without one archive per row.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# scripts/train.py arguments: its default DCN; the Criteo layout (13 dense, 26 sparse, D 64, the
# criteo config's MLPs, dot interaction; 1,000 rows a table: train.py takes one row count for all);
# DLRMv2's dense half (the dlrmv2 config's cross network and MLPs) on tables of 1,000 rows, at a
# tenth of train.py's learning rate (at 0.05 this deep cross network diverges: held-out AUC 0.51).
MODELS = {
    "dcn": "--interaction dcn",
    "criteo": "--num-sparse 26 --rows 1000 --dim 64 --dense-arch 512,256,64 --over-arch 512,512,256,1",
    "dlrmv2": "--interaction dcn --num-sparse 26 --rows 1000 --dim 128 --dense-arch 512,256,128 "
    "--over-arch 1024,1024,512,256,1 --dcn-num-layers 3 --dcn-low-rank-dim 512 --steps 150 --lr 0.005",
}
# (tables' embedding_dtype, dense precision, where int8's static activation scales come from)
PRECISIONS = (
    ("fp32", "bf16", "-"),
    ("fp32", "int8", "the verify file itself (optimistic: build_mar.py refuses it)"),
    ("fp32", "int8", "512 training rows"),
    ("fp32", "int8", "none: dynamic, scales per batch"),
    ("int8", "fp32", "-"),
    ("int8", "int8", "512 training rows"),
)


def log(msg: str) -> None:
    print(f"[contract {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def compiled(model, cfg, precision: str, calibration):
    """(module, what runs, forced): dlrmkit.dense.compile_dense, or on a CPU without the
    instructions the same compilation regardless of its rule."""
    from dlrmkit import dense

    if dense.unsupported(precision, dense.cpu_flags()) is None:
        return *dense.compile_dense(model, cfg, precision, calibration), False
    return *dense._compile(model, cfg, precision, calibration, (2, 64)), True


def contract_model(name: str, heldout: int, tmp: Path) -> dict:
    import torch

    from scripts import train
    from dlrmkit.model import DLRMFactory
    from dlrmkit import accuracy, checkpoint, dense
    from dlrmkit.batch import collate
    from dlrmkit.config import DLRMConfig
    from dlrmkit.forms import RequestParser

    out = tmp / name
    argv = ["--out", str(out), "--world-size", "1", "--heldout", str(heldout), *MODELS[name].split()]
    log(f"{name}: training (scripts/train.py {' '.join(argv[2:])})")
    subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), *argv], check=True)
    checkpoint.write_config(out / "checkpoint", out / "config.yaml", log=lambda m: None)
    cfg = DLRMConfig.from_yaml(out / "config.yaml")
    factory, weights, verify = DLRMFactory(cfg), out / "dlrm.pt", out / "verify.jsonl"
    state = checkpoint.import_checkpoint(out / "checkpoint", cfg, log)
    torch.save(factory.archive_state(factory.load_fp32(state)), weights)
    lines = checkpoint.read_verify_file(verify)
    parser = RequestParser(cfg)
    batches = [collate([parser.parse(doc["request"])], cfg)[0] for doc in lines]
    labels = [y for doc in lines for y in doc["labels"]]
    targs = train.parse_args(argv)  # the trainer's own data stream: its first rows are training rows
    sample = train.Clicks(targs).batch(0, dense.CALIBRATION_ROWS, train.features(targs)[1])

    def scores(model) -> list[float]:
        with torch.inference_mode():
            return [float(s) for b in batches for s in torch.sigmoid(model(b.dense, b.sparse)).squeeze(1)]

    fp32 = scores(factory.load(weights))
    trainer = [s for doc in lines for s in doc["scores"]]
    # the same trained weights in an archive with int8 tables, loaded as a worker loads it
    cfg8 = cfg.with_changes(embedding_dtype="int8")
    factory8, weights8 = DLRMFactory(cfg8), out / "dlrm-int8-tables.pt"
    torch.save(factory8.archive_state(factory8.load_fp32(state)), weights8)
    rows = []
    for tables, precision, source in PRECISIONS:
        model = (factory8 if tables == "int8" else factory).load(weights8 if tables == "int8" else weights)
        calibration = None
        if source.startswith("the verify"):
            calibration = accuracy.calibration_inputs(verify, model, cfg)
        elif source.startswith("512"):
            calibration = dense.calibration_inputs(model, [(sample.dense_features, sample.sparse_features)])
        served, what, forced = compiled(model, cfg8 if tables == "int8" else cfg, precision, calibration)
        c = accuracy.contract(scores(served), fp32, labels)
        rows.append(
            {"tables": tables, "precision": precision, "calibration": source, "forced": forced, "what": what, **c}
        )
        log(
            f"{name} tables {tables}, dense {precision} ({source}): AUC {c['auc']:.5f} vs fp32 {c['auc_fp32']:.5f}, ratio "
            f"{c['auc_ratio']:.5f} ({'holds' if c['holds'] else 'BROKEN'}), |dp| max {c['max_dp']:.3g} "
            f"p99 {c['p99_dp']:.3g}"
        )
    return {
        "model": name,
        "train_args": argv[2:],
        "rows_scored": len(labels),
        "auc_fp32": rows[0]["auc_fp32"],
        "fp32_vs_trainer_max_dp": max(abs(a - b) for a, b in zip(fp32, trainer)),
        "precisions": rows,
    }


def host() -> dict:
    import torch

    from dlrmkit import dense

    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    cpu = next((ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if ln.startswith("Model name")), "?")
    return {"cpu": cpu, "cpus": len(os.sched_getaffinity(0)), "isa": dense.isa_summary(), "torch": torch.__version__}


def contract_md(doc: dict) -> str:
    h = doc["host"]
    out = [
        "# The accuracy contract on trained models (served AUC >= 99.9% of fp32)",
        "",
        f"`{doc['command']}` on {h['cpu']} ({h['cpus']} CPUs; ISA as torch may use it: {h['isa']}; torch "
        f"{h['torch']}). Each model trained by scripts/train.py (synthetic clicks with a learnable signal), "
        "scored on its held-out rows (verify.jsonl, parsed and collated as the handler does) at each precision "
        "against the served fp32 scores. **forced**: this CPU lacks the precision's instructions, so the handler "
        "would serve fp32 here; the row is the compiled kernel regardless.",
        "",
    ]
    for m in doc["models"]:
        out += [
            f"## {m['model']}: `scripts/train.py {' '.join(m['train_args'])}`",
            "",
            f"{m['rows_scored']:,} held-out rows; fp32 AUC {m['auc_fp32']:.5f}; served fp32 vs the trainer's "
            f"scores: max |dp| {m['fp32_vs_trainer_max_dp']:.2g}.",
            "",
            "| tables | dense | calibration | AUC | fp32 AUC | ratio | holds | max abs dp | p99 abs dp |",
            "|---|---|---|---:|---:|---:|---|---:|---:|",
        ]
        for r in m["precisions"]:
            out.append(
                f"| {r.get('tables', 'fp32')} | {r['precision']}{' **forced**' if r['forced'] else ''} | {r['calibration']} | "
                f"{r['auc']:.5f} | {r['auc_fp32']:.5f} | {r['auc_ratio']:.5f} | "
                f"{'yes' if r['holds'] else '**no**'} | {r['max_dp']:.3g} | {r['p99_dp']:.3g} |"
            )
        out.append("")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS), help="(default: all)")
    ap.add_argument("--heldout", type=int, default=5000, help="held-out rows per model (default: %(default)s)")
    ap.add_argument("--out", default=str(ROOT / "results" / "dense-contract"), help="stem of .json/.md")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="dense-contract-") as tmp:
        models = [contract_model(name, args.heldout, Path(tmp)) for name in args.models]
    command = "python scripts/dense_contract.py " + " ".join(sys.argv[1:] if argv is None else argv)
    doc = {"command": command, "host": host(), "models": models}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps(doc, indent=1) + "\n")
    Path(args.out + ".md").write_text(contract_md(doc))
    log(f"wrote {args.out}.json and {args.out}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
