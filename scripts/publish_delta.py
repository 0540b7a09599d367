#!/usr/bin/env python
"""Write the next live-update delta from two checkpoints: the rows that differ, and the dense
parameters if any changed (docs/live-updates.md).

    python scripts/publish_delta.py --config my.yaml --old ckpt-1/ --new ckpt-2/ \\
        --archive model_store/dlrm.mar --out /deltas/dlrm

``--old`` is what the served archive holds (or the previous delta's checkpoint), ``--new`` the
trainer's newer one; both are read as scripts/build_mar.py reads a checkpoint (.pt state_dict or
DCP directory, dlrmkit/checkpoint/). The delta's base is the archive's delta-base.txt (or
``--base``), its sequence the next one in ``--out`` (or ``--sequence``). A live trainer publishes
itself instead: scripts/train.py --publish-dir.
"""

from __future__ import annotations

import argparse
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def archive_base(mar: str | Path) -> str:
    """The base version a built archive carries (scripts/build_mar.py writes delta-base.txt)."""
    from dlrmkit.live import BASE_FILE

    with zipfile.ZipFile(mar) as z:
        try:
            return z.read(BASE_FILE).decode().strip()
        except KeyError:
            sys.exit(f"error: {mar} has no {BASE_FILE} (built before live updates): rebuild it, or pass --base")


def main(argv: list[str] | None = None) -> Path | None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="the served model-config.yaml (its handler: section)")
    ap.add_argument("--old", required=True, help="the checkpoint the server holds now")
    ap.add_argument("--new", required=True, help="the newer checkpoint")
    ap.add_argument("--out", required=True, help="the delta directory the servers follow (handler.delta_dir)")
    base = ap.add_mutually_exclusive_group(required=True)
    base.add_argument("--archive", help="the served .mar, whose delta-base.txt names the base")
    base.add_argument("--base", help="the base version itself")
    ap.add_argument("--model-name", default="dlrm", help="the served model's name (default: %(default)s)")
    ap.add_argument("--feature-order", metavar="F1,F2,...", help="as for build_mar.py --checkpoint")
    ap.add_argument("--sequence", type=int, help="default: one past the newest delta in --out")
    args = ap.parse_args(argv)

    from dlrmkit.checkpoint import import_checkpoint
    from dlrmkit.config import DLRMConfig
    from dlrmkit.live import changes, next_sequence, write_delta
    from dlrmkit.errors import ConfigError

    try:
        config = DLRMConfig.from_yaml(args.config)
        order = args.feature_order.split(",") if args.feature_order else None
        old = import_checkpoint(args.old, config, feature_order=order)
        new = import_checkpoint(args.new, config, feature_order=order)
    except ConfigError as e:
        sys.exit(f"error: {e}")
    tables, dense = changes(old, new)
    if not tables and dense is None:
        print(f"[delta] {args.old} and {args.new} hold the same weights: no delta written")
        return None
    sequence = args.sequence or next_sequence(args.out)
    path = write_delta(args.out, args.model_name, args.base or archive_base(args.archive), sequence, tables, dense)
    rows = sum(len(ids) for ids, _ in tables.values())
    print(f"[delta] {path}: {rows} rows in {len(tables)} table(s)" + (", dense parameters" if dense else ""))
    return path


if __name__ == "__main__":
    main()
