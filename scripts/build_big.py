#!/usr/bin/env python
"""Build a model whose tables may be larger than memory, as a TorchServe model directory that
workers load where it lies (no .mar, no copy).

    python scripts/build_big.py --config model-config.dlrmv2.yaml --full --dtype int8 --out /work/big/store/dlrmv2-int8
    python scripts/build_big.py --config my.yaml --checkpoint ckpt_dir/ --out /data/store/dlrm
    python scripts/build_big.py --repack /data/store/dlrm --hot-counts counts/ --out /data/store/dlrm-2

The tables are written table by table, a chunk of rows at a time, straight into the quantized
row layout (dlrmkit/stream.py): fp32 tables are never held, so memory stays at about --chunk-mib
plus the process, whatever the model's size. Rows are byte for byte what scripts/build_mar.py
archives for the same fp32 weights (tests/test_stream.py). --full takes the row counts of the
config's ``# full: [...]`` comment (model-config.dlrmv2.yaml lists the MLPerf DLRMv2 tables).

The output is what ``torch-model-archiver --archive-format no-archive`` makes: a directory with
MAR-INF/MANIFEST.json, the handler and its modules, the config (with the rows and dtype built)
and the weights file. Put it in TorchServe's model store (or pass its parent as --model-store)
and register it by its directory name: TorchServe 0.12 loads a directory through a temporary
directory of symbolic links to its files, so the workers memory-map the weights in place.

Hot rows (``--hot-counts``): the most looked-up rows of all tables, up to ``--hot-mib``, are copied
together after their tables' rows, so that most lookups read a few dense pages (dlrmkit/hot.py,
docs/scale.md). The counts come from serving workers (handler.count_ids_dir) or from a sample of
training data (scripts/count_ids.py); without them every row stays in id order (unpacked).

    python scripts/build_big.py --config model-config.dlrmv2.yaml --full --dtype int8 \
        --hot-counts counts/ --hot-mib 2048 --out /work/big/store/dlrmv2-int8

``--repack DIR``: a new model directory from a built one (its config, dtype and rows, byte for
byte: no checkpoint read, nothing quantized again) with the hot rows chosen from new counts: what
traffic that has shifted calls for, followed by a rollout (scripts/rollout.py).

The disk needed is printed first; the build refuses to start without it (plus 2 GiB kept free).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def derived_config(src: Path, out: Path, rows, dtype: str) -> None:
    """``src`` with handler.num_embeddings = ``rows`` and handler.embedding_dtype = ``dtype``."""
    import yaml

    doc = yaml.safe_load(src.read_text())
    doc["handler"]["num_embeddings"] = list(rows)
    doc["handler"]["embedding_dtype"] = dtype
    # a worker of a model larger than memory reads its hot rows and compiles before it is ready
    doc["startupTimeout"] = max(int(doc.get("startupTimeout") or 0), 600)
    out.write_text(
        f"# Written by scripts/build_big.py from {src.name}: {sum(rows):,} rows, {dtype} tables.\n"
        + yaml.safe_dump(doc, sort_keys=False, default_flow_style=None, width=100)
    )


def model_directory(out: Path, config_file: Path, model_name: str, version: str, log=print) -> Path:
    """The no-archive directory at ``out`` with a placeholder weights file (replaced next)."""
    from scripts.build_mar import extra_files
    from dlrmkit.config import DLRMConfig
    from dlrmkit.errors import ConfigError
    from dlrmkit.protocols import METADATA_FILE, model_metadata

    config = DLRMConfig.from_yaml(config_file)
    if config.build.dense_precision == "auto":
        raise ConfigError(
            f"{config_file}: handler.dense_precision: auto needs scripts/build_mar.py --verify, which picks the "
            "fastest precision that keeps the accuracy contract; this build verifies nothing: set int8, bf16 "
            "or fp32 (e.g. dense_precision: int8)"
        )
    with tempfile.TemporaryDirectory(prefix="dlrm-big-") as tmp:
        placeholder = Path(tmp) / "dlrm.pt"
        placeholder.write_bytes(b"")
        metadata = Path(tmp) / METADATA_FILE
        metadata.write_text(json.dumps(model_metadata(config), indent=1))
        export = Path(tmp) / "out"
        export.mkdir()
        cmd = [
            str(Path(sys.executable).parent / "torch-model-archiver"),
            "--model-name",
            model_name,
            "--version",
            version,
            "--handler",
            str(ROOT / "dlrm_handler.py"),
            "--serialized-file",
            str(placeholder),
            "--extra-files",
            ",".join([*extra_files(Path(tmp)), str(metadata)]),
            "--config-file",
            str(config_file),
            "--export-path",
            str(export),
            "--archive-format",
            "no-archive",
        ]
        subprocess.run(cmd, check=True, env={**os.environ, "TMPDIR": tmp})
        if out.exists():
            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(export / model_name), out)
    log(f"[build] model directory {out} (handler, modules, config, MAR-INF/MANIFEST.json)")
    return out


def hot_rows(args, config) -> dict:
    """Table -> hot ids (ascending) from ``--hot-counts`` within ``--hot-mib``, and table -> the counted
    lookups outside them; ({}, {}) without counts."""
    import torch

    from dlrmkit import hot, stream

    if not args.hot_counts:
        print("[build] no --hot-counts: rows stay in id order (unpacked; docs/scale.md)", flush=True)
        return {}, {}
    if args.hot_mib <= 0:
        from dlrmkit.errors import ConfigError

        raise ConfigError(f"--hot-mib: expected a positive number of MiB, got {args.hot_mib} (e.g. --hot-mib 2048)")
    counts = hot.read_counts(args.hot_counts)
    rows = dict(zip(config.sparse_features, config.num_embeddings))
    chosen = hot.choose(counts, rows, stream.row_bytes(config), args.hot_mib << 20)
    n = sum(len(h) for h in chosen.values())
    total = sum(int(c.sum()) for _, c in counts.values())
    covered = 0
    cold = {}
    for t, (ids, c) in counts.items():
        inside = int(c[torch.isin(ids, chosen[t])].sum()) if t in chosen else 0
        covered += inside
        cold[t] = int(c.sum()) - inside
    print(
        f"[build] hot rows: {n:,} rows of {len(chosen)} tables ({n * stream.row_bytes(config) / 2**20:.1f} MiB), "
        f"{covered / max(total, 1):.1%} of the {total:,} counted lookups",
        flush=True,
    )
    return chosen, cold


def calibrate(out: Path, config, args) -> None:
    """An int8 dense half's static activation scales, as scripts/build_mar.py makes them: the dense
    half's inputs for ``--calibrate``'s requests (else, for random weights, the kit's random rows)
    looked up in the tables just written (memory-mapped: a few thousand pages read), saved in the
    model directory where the worker reads them (dlrmkit/dense.py). A re-pack keeps the model's own."""
    import torch

    from dlrmkit import dense
    from dlrmkit.accuracy import int8_calibration
    from dlrmkit.model import DLRMFactory

    target = out / dense.CALIBRATION_FILE
    if config.build.dense_precision != "int8" or target.is_file():
        return
    if not args.calibrate and args.checkpoint:
        print("[build] int8 dense half without --calibrate: activation scales per batch (dynamic int8)", flush=True)
        return
    inputs, source = int8_calibration(DLRMFactory(config).load(out / "dlrm.pt"), config, args.calibrate)
    torch.save(inputs, target)
    print(f"[build] int8 dense half: static activation scales from {source} ({dense.CALIBRATION_FILE})", flush=True)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "model-config.yaml"), help="model config (default: %(default)s)")
    ap.add_argument("--full", action="store_true", help="the row counts of the config's '# full: [...]' comment")
    ap.add_argument(
        "--dtype", choices=["fp32", "fp16", "int8", "int4"], help="embedding_dtype to build (default: the config's)"
    )
    ap.add_argument(
        "--checkpoint", help="a trained fp32 DLRM (.pt state_dict or DCP directory) instead of seeded random weights"
    )
    ap.add_argument("--feature-order", metavar="F1,F2,...", help="with --checkpoint: as in build_mar.py")
    ap.add_argument(
        "--repack",
        metavar="MODEL_DIR",
        help="the rows of this built model directory, copied as they are (its model-config.yaml; "
        "with --hot-counts: packed anew)",
    )
    ap.add_argument(
        "--out",
        required=True,
        help="the model directory to write (outside any git checkout "
        "for big models); its name is the model name unless --model-name",
    )
    ap.add_argument("--model-name", help="default: the --out directory's name")
    ap.add_argument("--version", default="1.0")
    ap.add_argument(
        "--chunk-mib", type=int, default=256, help="fp32 MiB of rows quantized at once (default: %(default)s)"
    )
    ap.add_argument(
        "--hot-counts",
        nargs="+",
        metavar="PATH",
        help="id counts files (or directories of them) from handler.count_ids_dir or scripts/count_ids.py: "
        "the most looked-up rows are packed together (default: none, rows in id order)",
    )
    ap.add_argument(
        "--hot-mib",
        type=int,
        default=2048,
        help="with --hot-counts: MiB of hot rows' copies (scripts/sizing.py --counts says what a size "
        "buys; default: %(default)s)",
    )
    ap.add_argument(
        "--calibrate",
        metavar="FILE.jsonl",
        help="handler.dense_precision int8: requests like the traffic, as build_mar.py's --calibrate (a sample "
        "of the training data), looked up in the written tables for int8's static activation scales; without "
        "it, random weights calibrate on the kit's random rows as build_mar.py's do, and a checkpoint's "
        "int8 dense half computes its scales per batch (dynamic)",
    )
    ap.add_argument("--json", metavar="FILE", help="write the build's measurements (time, peak RSS, sizes) here")
    ap.add_argument("--force", action="store_true", help="replace an existing --out")
    args = ap.parse_args(argv)

    from dlrmkit.config import DLRMConfig
    from dlrmkit.dense import CALIBRATION_FILE
    from dlrmkit.errors import ConfigError
    from dlrmkit import stream

    out = Path(args.out).resolve()
    if out.exists() and not args.force:
        sys.exit(f"error: {out} exists; pass --force to replace it")
    if args.repack and (args.checkpoint or args.full or args.dtype):
        sys.exit("error: --repack takes the model's own config, rows and dtype: drop --checkpoint, --full and --dtype")
    if args.repack:
        args.config = str(Path(args.repack) / "model-config.yaml")
    try:
        config = DLRMConfig.from_yaml(args.config)
        rows = config.num_embeddings
        if args.full:
            from scripts.sizing import full_rows

            rows = full_rows(args.config, config)
            if rows is None:
                sys.exit(f"error: --full: {args.config} has no '# full: [...]' comment")
        config = config.with_changes(
            num_embeddings=tuple(rows), embedding_dtype=args.dtype or config.build.embedding_dtype
        )
        hot, cold = hot_rows(args, config)
        need = stream.file_bytes(config, {t: len(h) for t, h in hot.items()})
        print(
            f"[build] {out}: {sum(rows):,} rows, {config.build.embedding_dtype}: needs {need / 2**30:.2f} GiB of disk",
            flush=True,
        )
        out.parent.mkdir(parents=True, exist_ok=True)
        free = stream.check_disk(out, need)
        print(f"[build] {free / 2**30:.1f} GiB free at {out.parent}", flush=True)
        if args.repack:
            source = stream.ModelSource(Path(args.repack) / "dlrm.pt", config)
        elif args.checkpoint:
            source = stream.CheckpointSource(
                args.checkpoint, config, args.feature_order.split(",") if args.feature_order else None
            )
        else:
            source = stream.RandomSource(config)
        with tempfile.TemporaryDirectory(prefix="dlrm-big-cfg-") as tmp:
            cfg = Path(tmp) / "model-config.yaml"
            derived_config(Path(args.config), cfg, rows, config.build.embedding_dtype)
            model_directory(out, cfg, args.model_name or out.name, args.version)
        if args.repack and (Path(args.repack) / CALIBRATION_FILE).is_file():
            shutil.copy2(Path(args.repack) / CALIBRATION_FILE, out / CALIBRATION_FILE)
        result = stream.write_weights(
            out / "dlrm.pt",
            config,
            source,
            chunk_bytes=args.chunk_mib << 20,
            log=lambda m: print(m, flush=True),
            hot=hot,
            cold=cold,
        )
        calibrate(out, config, args)
    except ConfigError as e:
        sys.exit(f"error: {e}")
    result["model_dir"] = str(out)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
