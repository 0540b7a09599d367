#!/usr/bin/env python
"""Load time and peak RSS of building an archive from a ~1 GB DCP checkpoint (docs/trained-models.md).

    python bench/measure_import.py                    # 26 tables x 160,000 rows x D=64: 1.06 GB
    python bench/measure_import.py --rows 20000       # a quick run

1. scripts/train.py (2 DMP ranks, a few steps) writes the DCP checkpoint: 26 tables, whole tables
   spread over the two ranks' files;
2. build_mar.py --write-config derives the config;
3. in this process, with torch/torchrec already imported and the peak RSS reset (VmHWM, via
   /proc/self/clear_refs): build_mar.main(--checkpoint) reads the checkpoint, checks it, saves the
   archive's weights and runs the archiver (a child process, not counted: it streams the file).
   Peak RSS growth / table bytes is 1.0 when the tables are held exactly once.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def status(field: str) -> int:
    """A /proc/self/status memory field in bytes (VmRSS, VmHWM)."""
    return int(Path("/proc/self/status").read_text().split(f"{field}:")[1].split()[0]) * 1024


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=160_000, help="rows per table (default: %(default)s)")
    ap.add_argument("--dim", type=int, default=64, help="embedding_dim (default: %(default)s)")
    ap.add_argument("--tables", type=int, default=26, help="tables (default: %(default)s)")
    ap.add_argument("--json", default=str(ROOT / "results" / "import-dcp.json"), help="where the figures go")
    args = ap.parse_args(argv)

    import subprocess

    from scripts import build_mar

    with tempfile.TemporaryDirectory(prefix="measure-import-") as tmp:
        tmp = Path(tmp)
        print(f"[measure] training to write a DCP checkpoint of {args.tables} x {args.rows:,} x D={args.dim}", flush=True)
        subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), "--out", str(tmp / "train"),
                        "--world-size", "2", "--num-sparse", str(args.tables), "--rows", str(args.rows),
                        "--dim", str(args.dim), "--dense-arch", f"32,{args.dim}", "--steps", "2",
                        "--heldout", "64"], check=True)
        ckpt, config = tmp / "train" / "checkpoint", tmp / "config.yaml"
        # Also imports everything the build needs (torchrec, DCP) before the baseline is taken.
        build_mar.main(["--checkpoint", str(ckpt), "--write-config", str(config)])
        table_bytes = args.tables * args.rows * args.dim * 4
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        baseline = status("VmRSS")
        started = time.perf_counter()
        build_mar.main(["--config", str(config), "--checkpoint", str(ckpt), "--force",
                        "--output-dir", str(tmp / "store")])
        res = {
            "table_bytes": table_bytes,
            "checkpoint_bytes": sum(p.stat().st_size for p in ckpt.iterdir()),
            "build_s": round(time.perf_counter() - started, 2),
            "baseline_rss_bytes": baseline,
            "peak_rss_growth_bytes": status("VmHWM") - baseline,
        }
    res["growth_over_tables"] = round(res["peak_rss_growth_bytes"] / table_bytes, 3)
    print(f"[measure] tables {table_bytes / 1e9:.2f} GB: build {res['build_s']} s, peak RSS growth "
          f"{res['peak_rss_growth_bytes'] / 1e9:.2f} GB = {res['growth_over_tables']} x the table bytes")
    Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    return res


if __name__ == "__main__":
    main()
