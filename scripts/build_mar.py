#!/usr/bin/env python
"""Build a TorchServe model archive (.mar) for a DLRM described by a model-config.yaml.

    python scripts/build_mar.py                                  # seeded random weights
    python scripts/build_mar.py --checkpoint trained.pt          # your trained state_dict
    python scripts/build_mar.py --config model-config.criteo.yaml --force
    python scripts/build_mar.py --checkpoint ckpt/ --write-config my.yaml   # a config that fits; builds nothing
    python scripts/build_mar.py --config my.yaml --checkpoint ckpt/ --force

--checkpoint takes a .pt/.pth state_dict (or a dict holding one under model / model_state_dict /
state_dict) or a torch.distributed.checkpoint directory, from DLRMTrain / DistributedModelParallel
(dlrm_checkpoint.py). The weights are checked against the config before anything is archived: a
key or table whose name or shape does not fit is an error that names it.
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
sys.path.insert(0, str(ROOT))

# Shipped beside the handler in the archive; TorchServe puts them on the worker's sys.path.
EXTRA_FILES = ["dlrm_factory.py", "dlrm_core.py", "dlrm_config.py", "dlrm_errors.py", "dlrm_scale.py", "dlrm_kserve.py"]


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "model-config.yaml"),
                    help="model-config.yaml with a handler: section (default: %(default)s)")
    ap.add_argument("--checkpoint", help="a trained fp32 DLRM: a .pt/.pth state_dict file or a DCP directory "
                    "(docs/trained-models.md), quantized here when handler.embedding_dtype is fp16/int8/int4; "
                    "default: seeded random weights from handler.seed")
    ap.add_argument("--write-config", metavar="OUT.yaml",
                    help="with --checkpoint: write a complete model config derived from the checkpoint's keys "
                    "and shapes to OUT.yaml, print what was derived and assumed, and build nothing")
    ap.add_argument("--output-dir", default=str(ROOT / "model_store"), help="where the .mar goes (default: %(default)s)")
    ap.add_argument("--model-name", default="dlrm", help="archive and endpoint name (default: %(default)s)")
    ap.add_argument("--version", default="1.0", help="model version recorded in the archive (default: %(default)s)")
    ap.add_argument("--force", action="store_true", help="overwrite an existing archive")
    args = ap.parse_args(argv)

    import torch

    from dlrm_checkpoint import import_checkpoint, write_config
    from dlrm_config import DLRMConfig
    from dlrm_errors import ConfigError
    from dlrm_factory import DLRMFactory
    from dlrm_kserve import METADATA_FILE, model_metadata

    if args.write_config:
        if not args.checkpoint:
            ap.error("--write-config needs --checkpoint PATH")
        try:
            write_config(args.checkpoint, args.write_config)
        except ConfigError as e:
            sys.exit(f"error: {e}")
        return Path(args.write_config)
    out_dir = Path(args.output_dir)
    mar = out_dir / f"{args.model_name}.mar"
    if mar.exists() and not args.force:
        sys.exit(f"error: {mar} exists; pass --force to overwrite it")
    try:
        config = DLRMConfig.from_yaml(args.config)
        factory = DLRMFactory(config)
        with tempfile.TemporaryDirectory(prefix="dlrm-mar-") as tmp:
            weights = Path(tmp) / "dlrm.pt"
            started = time.perf_counter()
            if args.checkpoint:
                print(f"[build] checking {args.checkpoint} against {args.config}", flush=True)
                # Every key and shape is checked before any data is read; a file is memory-mapped, a
                # DCP directory read into one full-size tensor per key.
                model = factory.load_fp32(import_checkpoint(args.checkpoint, config))
            else:
                print(f"[build] random weights, seed {config.seed}: {sum(config.num_embeddings):,} rows "
                      f"x D={config.embedding_dim}", flush=True)
                model = factory.random()
            if config.embedding_dtype != "fp32":
                print(f"[build] quantizing the tables to {config.embedding_dtype} (torchrec quantize_inference_model)",
                      flush=True)
            state = factory.archive_state(model)
            del model
            torch.save(state, weights)
            # The v2 metadata the OIP endpoint plugin serves, from the config just validated.
            metadata = Path(tmp) / METADATA_FILE
            metadata.write_text(json.dumps(model_metadata(config), indent=1))
            print(f"[build] weights {weights.stat().st_size / 1e6:.1f} MB in {time.perf_counter() - started:.1f} s",
                  flush=True)
            out_dir.mkdir(parents=True, exist_ok=True)
            cmd = [
                str(Path(sys.executable).parent / "torch-model-archiver"),
                "--model-name", args.model_name,
                "--version", args.version,
                "--handler", str(ROOT / "dlrm_handler.py"),
                "--serialized-file", str(weights),
                "--extra-files", ",".join([*(str(ROOT / f) for f in EXTRA_FILES), str(metadata)]),
                "--config-file", str(Path(args.config).resolve()),
                "--export-path", str(out_dir),
                # Random floats do not compress; storing them makes building and loading faster.
                "--archive-format", "zip-store",
            ]
            if args.force:
                cmd.append("--force")
            # The archiver stages files in $TMPDIR/<model name>; a private TMPDIR keeps two builds
            # of the same model name on one machine (tests, benchmarks) from clobbering each other.
            subprocess.run(cmd, check=True, env={**os.environ, "TMPDIR": tmp})
    except ConfigError as e:
        sys.exit(f"error: {e}")
    print(f"[build] {mar} ({mar.stat().st_size / 1e6:.1f} MB)")
    return mar


if __name__ == "__main__":
    main()
