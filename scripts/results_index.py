#!/usr/bin/env python
"""results/README.md, the index of the committed measurements, written from each run's run.json.

    python scripts/results_index.py           # write results/README.md
    python scripts/results_index.py --check   # exit 1 if it is stale or results/ is out of shape

Every committed run lives in a folder of its own, ``results/<YYYY-MM-DD>-<slug>/``, with the
files it wrote and a ``run.json``::

    {"title": "...", "date": "YYYY-MM-DD", "commit": "<short sha that added the files>",
     "cpu": "<CPU model>", "isa": "<e.g. AVX-512 VNNI/BF16, no AMX>", "command": "<what made it>"}

The index lists the runs newest first, each with its title, date, CPU, ISA, command, commit and
a link to every file in its folder. ``--check`` fails when the index is not what this script
would write, when a file lies under results/ outside a run folder, or when a run folder has no
(or an incomplete) run.json. ``results/tmp/`` (gitignored scratch) is left out.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"
INDEX = "README.md"
SCRATCH = "tmp"
FIELDS = ("title", "date", "commit", "cpu", "isa", "command")
RUN_DIR = re.compile(r"\d{4}-\d{2}-\d{2}-[a-z0-9][a-z0-9-]*")

HEADER = """# Results

The committed measurements, one folder per run (`<date>-<slug>/`, with the run's files and a
`run.json`: title, date, commit, CPU, ISA, command), newest first. What the figures mean and
which ones the shipped configs rest on: [docs/performance.md](../docs/performance.md).
Compare figures within one run; runs on different CPUs or days are not comparable.

This file is written by `python scripts/results_index.py` from the `run.json` files;
`python scripts/results_index.py --check` (run by `tests/test_results.py`) fails when it is stale
or when a file under results/ lies outside a run folder listed here.
"""


def run_folders(results: Path) -> list[Path]:
    """The run folders under ``results``, newest first (by date, then by name)."""
    found = [p for p in results.iterdir() if p.is_dir() and p.name != SCRATCH]
    return sorted(sorted(found, key=lambda p: p.name), key=lambda p: p.name[:10], reverse=True)


def read_run(folder: Path) -> dict[str, str]:
    """The folder's run.json, every field a string (raises ValueError naming what is wrong)."""
    path = folder / "run.json"
    if not path.is_file():
        raise ValueError(f"{folder.name}/ has no run.json")
    try:
        run = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{folder.name}/run.json is not JSON: {e}") from None
    if not isinstance(run, dict):
        raise ValueError(f"{folder.name}/run.json is not an object")
    missing = [k for k in FIELDS if not isinstance(run.get(k), str) or not run[k].strip()]
    if missing:
        raise ValueError(f"{folder.name}/run.json lacks {', '.join(missing)}")
    if run["date"] != folder.name[:10]:
        raise ValueError(f"{folder.name}/run.json: date {run['date']} is not the folder's")
    return {k: run[k] for k in FIELDS}


def run_files(folder: Path) -> list[str]:
    """Every file of a run folder, relative to it, run.json first."""
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    return ["run.json"] + [f for f in files if f != "run.json"]


def problems(results: Path) -> list[str]:
    """What is out of shape under ``results``: stray files, badly named folders, bad run.json."""
    out = []
    for p in sorted(results.iterdir()):
        if p.name in (INDEX, SCRATCH):
            continue
        if not p.is_dir():
            out.append(f"{p.name} is not inside a run folder (results/<YYYY-MM-DD>-<slug>/)")
        elif not RUN_DIR.fullmatch(p.name):
            out.append(f"{p.name}/ is not named <YYYY-MM-DD>-<slug>")
        else:
            try:
                read_run(p)
            except ValueError as e:
                out.append(str(e))
    return out


def render(results: Path) -> str:
    """The index's text for the run folders under ``results`` (every run.json must be valid)."""
    parts = [HEADER]
    for folder in run_folders(results):
        run = read_run(folder)
        files = ", ".join(f"[{f}]({folder.name}/{f})" for f in run_files(folder))
        parts.append(
            f"## {run['date']}: {run['title']}\n\n"
            f"- folder: [{folder.name}/]({folder.name}/)\n"
            f"- CPU: {run['cpu']}; ISA: {run['isa']}\n"
            f"- command: `{run['command']}`\n"
            f"- commit: {run['commit']}\n"
            f"- files: {files}\n"
        )
    return "\n".join(parts)


def check(results: Path) -> list[str]:
    """Everything ``--check`` reports; empty when results/ and its index are in order."""
    found = problems(results)
    if found:
        return found
    index = results / INDEX
    if not index.is_file() or index.read_text() != render(results):
        return [f"results/{INDEX} is stale: run python scripts/results_index.py"]
    return []


def main(argv: list[str] | None = None, results: Path = RESULTS) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the index is stale or results/ is out of shape")
    args = ap.parse_args(argv)
    if args.check:
        found = check(results)
        for line in found:
            print(f"results: {line}", file=sys.stderr)
        return 1 if found else 0
    found = problems(results)
    if found:
        for line in found:
            print(f"results: {line}", file=sys.stderr)
        return 1
    (results / INDEX).write_text(render(results))
    print(f"wrote {results / INDEX} ({len(run_folders(results))} runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
