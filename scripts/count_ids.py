#!/usr/bin/env python
"""An id counts file (dlrmkit-id-counts/1, dlrmkit/hot.py) from a sample of training data or
requests: which rows of each table the sample looks up, and how often. scripts/build_big.py
--hot-counts packs the most counted rows together; scripts/sizing.py --counts fits each table's
law to them and says what a hot set of a size buys.

    python scripts/count_ids.py --config model-config.criteo.yaml --criteo day_23.tsv --limit 1000000 \\
        --out counts/day_23.pt
    python scripts/count_ids.py --config my.yaml --requests requests.jsonl --out counts/requests.pt

--criteo FILE: Criteo TSV lines (13 integers, 26 hex ids, the label first or left out), for a
config with handler.raw_input: criteo_tsv. Each line is read as the handler reads a
text/tab-separated-values request (dlrmkit.criteo.parse: ids int(field, 16)); a blank line
is refused as the handler refuses it.

--requests FILE: JSON lines, one /predictions body per line (any of the kit's JSON forms:
instances, context + candidates, columns, the torchrec_dlrm format), parsed as the handler
parses them (dlrmkit.forms.RequestParser). Blank lines are skipped.

Either way the parsed rows are collated as a worker collates a batch (dlrmkit.batch.collate:
handler.id_overflow modulo folds an id past its table, id % rows), so the counts are the ids the
worker looks up, exactly what handler.count_ids_dir counts while serving. A line the handler
would refuse (a bad field; an id past its table under id_overflow: error) is refused naming its
line number, and nothing is written. --limit N counts the first N lines (--requests: blank
lines aside).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Iterator

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
BLOCK_LINES = 16384  # lines parsed and collated at once
MERGE_EVERY = 64  # blocks counted before their counts are summed (bounds the memory)


def _lines(path: Path, limit: int | None, skip_blank: bool) -> Iterator[tuple[int, bytes]]:
    """(line number, line without its newline) of the file's first ``limit`` lines (blank lines
    skipped and not counted with ``skip_blank``)."""
    taken = 0
    with path.open("rb") as f:
        for number, line in enumerate(f, start=1):
            line = line.rstrip(b"\r\n")
            if skip_blank and not line.strip():
                continue
            if limit is not None and taken >= limit:
                return
            taken += 1
            yield number, line


def _blocks(path: Path, limit: int | None, skip_blank: bool) -> Iterator[list[tuple[int, bytes]]]:
    block: list[tuple[int, bytes]] = []
    for item in _lines(path, limit, skip_blank):
        block.append(item)
        if len(block) == BLOCK_LINES:
            yield block
            block = []
    if block:
        yield block


def _ids(batch) -> dict:
    """Table -> the ids a collated batch looks up (its KJT's keys are the tables)."""
    import torch

    kjt = batch.sparse
    return dict(zip(kjt.keys(), torch.split(kjt.values(), kjt.length_per_key())))


def criteo_requests(config, block: list[tuple[int, bytes]], path: Path):
    """The lines of ``block`` (Criteo TSV, consecutive) as one ParsedRequest, as the handler's
    Criteo path makes one of a body; exits naming the line of a bad field or, under
    id_overflow: error, of an id past its table."""
    from dlrmkit import criteo
    from dlrmkit.errors import RequestError
    from dlrmkit.request import ParsedRequest

    first = block[0][0]
    try:
        lines = criteo.parse(b"\n".join(line for _, line in block), config.sparse_features, first_line=first)
    except RequestError as e:
        sys.exit(f"error: {path}: {e.message}")
    over = lines.ids >= np.asarray(config.num_embeddings)[None, :]
    if over.any() and config.requests.id_overflow != "modulo":
        i, f = divmod(int(np.argmax(over.reshape(-1))), config.num_features)
        name, rows = config.sparse_features[f], config.num_embeddings[f]
        sys.exit(
            f"error: {path}: line {first + i} ({name}): id {int(lines.ids[i, f])} is out of range for table "
            f"{name!r} of {rows} rows (the handler answers 400; handler.id_overflow: modulo folds ids instead)"
        )
    return [
        ParsedRequest.single_hot_matrix(
            np.zeros((len(lines), config.num_dense_features), np.float32),
            range(config.num_features),
            np.ascontiguousarray(lines.ids.T),
            config.sparse_features,
        )
    ]


def json_requests(parser, block: list[tuple[int, bytes]], path: Path):
    """One ParsedRequest per line of ``block`` (a /predictions JSON body each); raises
    SystemExit naming the line of a body the handler would refuse."""
    from dlrmkit.errors import RequestError

    out = []
    for number, line in block:
        try:
            out.append(parser.parse(line))
        except RequestError as e:
            sys.exit(f"error: {path}: line {number}: {e.message}")
    return out


def count_file(config, path: Path, kind: str, limit: int | None = None) -> tuple[dict, int]:
    """The counts of the ids the first ``limit`` lines of ``path`` (``kind`` "criteo" or
    "requests") look up, and the lines read."""
    from dlrmkit import hot
    from dlrmkit.batch import collate
    from dlrmkit.forms import RequestParser

    parser = RequestParser(config)
    total: dict = {}
    parts: list = []
    lines = 0
    for block in _blocks(path, limit, skip_blank=kind == "requests"):
        requests = criteo_requests(config, block, path) if kind == "criteo" else json_requests(parser, block, path)
        batch, errors = collate(requests, config)
        if errors:  # out of range under id_overflow: error (a Criteo block's were named above)
            i = min(errors)
            sys.exit(f"error: {path}: line {block[i][0]}: {errors[i].message}")
        parts.append(hot.count(_ids(batch)))
        lines += len(block)
        if len(parts) >= MERGE_EVERY:
            total, parts = hot.merge([total, *parts]), []
    if not lines:
        sys.exit(f"error: {path}: no lines to count")
    return hot.merge([total, *parts]), lines


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--config",
        default=str(ROOT / "model-config.yaml"),
        help="the model config whose tables the ids are of (default: %(default)s)",
    )
    source = ap.add_mutually_exclusive_group(required=True)
    source.add_argument("--criteo", metavar="FILE", help="Criteo TSV lines (the config's raw_input: criteo_tsv)")
    source.add_argument("--requests", metavar="FILE", help="JSON lines: one /predictions request body per line")
    ap.add_argument("--limit", type=int, metavar="N", help="count the first N lines only (default: every line)")
    ap.add_argument("--out", required=True, help="the counts file to write (e.g. counts/train.pt)")
    args = ap.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        ap.error(f"--limit: expected a positive number of lines, got {args.limit} (e.g. --limit 1000000)")

    from dlrmkit import hot
    from dlrmkit.config import DLRMConfig
    from dlrmkit.errors import ConfigError

    try:
        config = DLRMConfig.from_yaml(args.config)
    except ConfigError as e:
        sys.exit(f"error: {e}")
    kind, path = ("criteo", Path(args.criteo)) if args.criteo else ("requests", Path(args.requests))
    if kind == "criteo" and config.raw.raw_input != "criteo_tsv":
        sys.exit(
            f"error: --criteo: {args.config} does not take Criteo lines (handler.raw_input is not criteo_tsv); "
            "set raw_input: criteo_tsv, or count JSON request bodies with --requests"
        )
    if not path.is_file():
        sys.exit(f"error: --{kind}: {path}: no such file")
    counts, lines = count_file(config, path, kind, args.limit)
    what = "Criteo TSV" if kind == "criteo" else "JSON request bodies"
    source_text = f"scripts/count_ids.py: {lines:,} lines of {path.resolve()} ({what})"
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    hot.write_counts(out, counts, source=source_text)
    lookups = sum(int(c.sum()) for _, c in counts.values())
    distinct = sum(len(i) for i, _ in counts.values())
    print(
        f"{out}: {lookups:,} lookups of {distinct:,} distinct rows in {len(counts)} tables, "
        f"from {lines:,} lines of {path} ({what})",
        flush=True,
    )
    return {"out": str(out), "lines": lines, "lookups": lookups, "rows": distinct, "source": source_text}


if __name__ == "__main__":
    main()
