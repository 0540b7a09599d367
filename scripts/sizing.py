#!/usr/bin/env python
"""How big a DLRM config is per embedding dtype, how many workers fit a memory budget, and
the startupTimeout it needs.

    python scripts/sizing.py --config model-config.criteo.yaml --memory 64GiB
    python scripts/sizing.py --config my-config.yaml --memory 24GiB --json

Bytes are exact for this kit's layouts: fp32 tables are rows x D x 4; fp16/int8/int4 tables are
fbgemm rows (int8/int4 add a 4-byte scale/bias; rows padded to 16 bytes, tables to 128).

Workers per budget, two rules:
  unshared  floor(budget / (tables + dense + worker)): every worker holds its own copy of the
            tables (the seed's rule; true on GPU, where each worker copies the tables to its
            device, and for any loader that copies)
  shared    floor((budget - tables) / (dense + worker)): on CPU this kit memory-maps the
            archive, so all workers of a model read one copy of the tables from the page cache
            and each extra worker costs only its process (worker = --worker-overhead; see
            bench/bench_scale.py for a measurement)

  paged     when the tables do not fit beside the workers, the memory-mapped tables are a page
            cache over the disk: what must stay resident is the working set for a hit rate
            (--hit-rate of lookups served from memory), not the whole table. Ids are taken to
            follow a power law (Zipf, exponent --zipf) over each table's rows, with the hot rows
            scattered over the file (hashed ids), so the working set is the pages holding the
            table's hottest rows covering --hit-rate of its lookups: working_set(); then
            floor((budget - working set) / (dense + worker)) workers, and every byte beyond the
            workers caches more of the tables (a higher hit rate than asked).

Workers for --cpus CPUs (default: the CPUs this process may use: affinity capped by the cgroup
CPU quota, dlrmkit.cpus.available_cpus): the CPU rule's count (one single-threaded worker per CPU,
dlrmkit.cpus.cpu_rule), capped by what fits the budget (the shared rule on CPU), and the memory
they need: tables once + workers x (dense + worker).

startupTimeout: worker start (--base-seconds) plus reading every table byte at --disk-mbps,
times 1.5. That is the GPU / cold-cache bound; a CPU worker maps the file and reads rows
lazily, so it starts in about --base-seconds.

A config whose tables are capped copies of a bigger model's may list the uncapped row counts
in a comment, ``# full: [rows, ...]`` (one per sparse feature; model-config.dlrmv2.yaml does):
the report then sizes those too ("uncapped"; ``full`` in --json).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected a size like 24GiB, 64G or 500MB, got {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


PAGE = 4096


def zipf_mass(k: float, s: float, exact: int = 2000) -> float:
    """sum_{i=1..k} i^-s: exact up to ``exact`` terms, then Euler-Maclaurin's integral (error
    below 1e-9 of the sum for the table sizes here)."""
    k = float(k)
    head = min(int(k), exact)
    total = math.fsum(i**-s for i in range(1, head + 1))
    if k > head:
        a, b = head + 0.5, k + 0.5
        total += math.log(b / a) if s == 1 else (b ** (1 - s) - a ** (1 - s)) / (1 - s)
    return total


def hot_rows(rows: int, s: float, hit_rate: float) -> int:
    """The fewest of a table's rows (the most looked-up first) that take ``hit_rate`` of its
    lookups when the row of rank i is looked up in proportion to i^-s."""
    if hit_rate >= 1:
        return rows
    want = hit_rate * zipf_mass(rows, s)
    lo, hi = 1, rows
    while lo < hi:
        mid = (lo + hi) // 2
        if zipf_mass(mid, s) >= want:
            hi = mid
        else:
            lo = mid + 1
    return lo


def working_set(rows: int, row_bytes: int, s: float, hit_rate: float, page: int = PAGE) -> int:
    """Resident bytes a memory-mapped table needs to serve ``hit_rate`` of its lookups from
    memory: the pages holding its ``hot_rows``. Hashed ids scatter the hot rows over the file,
    so k hot rows among P pages touch P (1 - (1 - 1/P)^k) pages on average (every hot row
    costs a page until the pages fill up), never more than the table."""
    table = rows * row_bytes
    pages = max(1, math.ceil(table / page))
    k = hot_rows(rows, s, hit_rate)
    touched = pages * -math.expm1(k * math.log1p(-1 / pages)) if pages > 1 else 1
    return min(table, int(math.ceil(touched)) * page)


def report(
    config,
    budget: int,
    worker: int,
    base_s: float,
    disk_mbps: float,
    cpus: int | None = None,
    hit_rate: float = 0.9,
    zipf: float = 1.05,
) -> dict:
    from dlrmkit.config import EMBEDDING_DTYPES
    from dlrmkit.scale import table_bytes

    c = config
    dense = 4 * _dense_params(c)
    out = {
        "budget_bytes": budget,
        "worker_overhead_bytes": worker,
        "dense_bytes": dense,
        "hit_rate": hit_rate,
        "zipf": zipf,
        "tables": [],
        "dtypes": {},
    }
    for name, rows in zip(c.sparse_features, c.num_embeddings):
        out["tables"].append(
            {"name": name, "rows": rows, **{d: table_bytes(rows, c.embedding_dim, d) for d in EMBEDDING_DTYPES}}
        )
    for d in EMBEDDING_DTYPES:
        tables = sum(t[d] for t in out["tables"])
        per_worker = dense + worker
        row = table_bytes(1, c.embedding_dim, d) if d == "fp32" else _row(c.embedding_dim, d)
        ws = sum(working_set(t["rows"], row, zipf, hit_rate) for t in out["tables"])
        shared = max(0, (budget - tables) // per_worker) if budget > tables else 0
        startup = 1.5 * (base_s + tables / (disk_mbps * 1e6))
        out["dtypes"][d] = {
            "table_bytes": tables,
            "model_bytes": tables + dense,
            "workers_unshared": max(0, budget // (tables + per_worker)),
            "workers_shared": shared,
            # tables that do not fit beside one worker: the page cache holds the working set
            "working_set_bytes": ws,
            "workers_paged": shared if shared >= 1 else max(0, (budget - ws) // per_worker) if budget > ws else 0,
            "startup_timeout_s": max(60, int(math.ceil(startup / 10) * 10)),
        }
    if cpus:
        from dlrmkit.cpus import cpu_rule

        rule = cpu_rule(cpus)
        d = out["dtypes"][c.build.embedding_dtype]
        out["cpus"] = {
            "cpus": cpus,
            "rule_workers": rule.workers,
            "torch_threads": rule.threads,
            "workers": min(rule.workers, d["workers_shared"] or d["workers_paged"]),
            "paged": d["workers_shared"] < 1,
            "memory_bytes": (d["table_bytes"] if d["workers_shared"] >= 1 else d["working_set_bytes"])
            + rule.workers * (dense + worker),
        }
    return out


def _row(dim: int, dtype: str) -> int:
    from fbgemm_gpu.split_embedding_configs import SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_inference import rounded_row_size_in_bytes
    from torchrec.quant.embedding_modules import DEFAULT_ROW_ALIGNMENT

    kind = {"fp32": SparseType.FP32, "fp16": SparseType.FP16, "int8": SparseType.INT8, "int4": SparseType.INT4}[dtype]
    return rounded_row_size_in_bytes(dim, kind, DEFAULT_ROW_ALIGNMENT)


def _dense_params(c) -> int:
    """Parameter count of the dense arch, interaction and over arch (what each worker copies),
    read off the config's model built on ``meta`` (no memory): exact for every interaction."""
    import torch

    from dlrmkit.model import DLRMFactory
    from dlrmkit.scale import EBC

    with torch.device("meta"):
        model = DLRMFactory(c).build("meta", tables_on_meta=True)
    return sum(p.numel() for name, p in model.named_parameters() if not name.startswith(EBC))


def full_rows(path: str | Path, config) -> tuple[int, ...] | None:
    """The uncapped rows of a ``# full: [...]`` comment in the config file (it may run over
    several comment lines), or None when there is none."""
    import yaml

    m = re.search(r"^#\s*full:\s*(\[[^\]]*\])", Path(path).read_text(), re.M)
    if not m:
        return None
    rows = yaml.safe_load(re.sub(r"\n\s*#", " ", m.group(1)))
    if len(rows) != config.num_features or not all(isinstance(r, int) and r > 0 for r in rows):
        sys.exit(
            f"error: {path}: '# full:' must list one positive row count per sparse feature "
            f"({config.num_features}), got {rows!r}"
        )
    return tuple(rows)


def _print_budget(rep: dict, dtypes: list[str]) -> None:
    print(f"{'':<16}{'':>14}" + "".join(f"{d:>13}" for d in dtypes))
    for key, label in (
        ("workers_unshared", "workers, copies"),
        ("workers_shared", "workers, mmap"),
        ("working_set_bytes", "working set"),
        ("workers_paged", "workers, paged"),
        ("startup_timeout_s", "startupTimeout"),
    ):
        cell = (lambda v: human(v)) if key == "working_set_bytes" else (lambda v: v)
        print(f"{label:<30}" + "".join(f"{cell(rep['dtypes'][d][key]):>13}" for d in dtypes))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--config",
        default=str(ROOT / "model-config.yaml"),
        help="model-config.yaml with a handler: section (default: %(default)s)",
    )
    ap.add_argument(
        "--memory",
        type=parse_bytes,
        default=None,
        help="memory budget for this model's workers, e.g. 24GiB (default: this machine's RAM)",
    )
    ap.add_argument(
        "--worker-overhead",
        type=parse_bytes,
        default=parse_bytes("450MiB"),
        help="memory of one worker process besides the model: Python, torch, torchrec, TorchServe "
        "(default: %(default)s bytes, a margin over the ~0.3 GB each extra CPU worker added in "
        "bench/bench_scale.py's measurement)",
    )
    ap.add_argument(
        "--base-seconds",
        type=float,
        default=20.0,
        help="worker start without the tables: imports, TorchServe handshake (default: %(default)s)",
    )
    ap.add_argument(
        "--disk-mbps",
        type=float,
        default=200.0,
        help="read rate for the startupTimeout bound, MB/s (default: %(default)s)",
    )
    ap.add_argument(
        "--cpus",
        type=int,
        default=None,
        help="CPUs to size the workers for (default: the CPUs this process may use: affinity and cgroup quota)",
    )
    ap.add_argument(
        "--hit-rate",
        type=float,
        default=0.9,
        help="share of lookups the page cache must serve when the tables do not fit (the 'paged' "
        "rule; default: %(default)s)",
    )
    ap.add_argument(
        "--zipf",
        type=float,
        default=1.05,
        help="power-law exponent s of the ids' frequencies (row of rank i looked up in proportion to "
        "i^-s) for the 'paged' rule (default: %(default)s; docs/scale.md says why)",
    )
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args(argv)

    from dlrmkit.config import DLRMConfig
    from dlrmkit.errors import ConfigError

    try:
        config = DLRMConfig.from_yaml(args.config)
    except ConfigError as e:
        sys.exit(f"error: {e}")
    if args.memory is None:
        import psutil

        args.memory = psutil.virtual_memory().total
    if args.cpus is None:
        from dlrmkit.cpus import available_cpus

        args.cpus = available_cpus()
    if not 0 < args.hit_rate <= 1 or args.zipf <= 0:
        ap.error("--hit-rate must be in (0, 1] and --zipf > 0")
    rep = report(
        config,
        args.memory,
        args.worker_overhead,
        args.base_seconds,
        args.disk_mbps,
        args.cpus,
        args.hit_rate,
        args.zipf,
    )
    full = full_rows(args.config, config)
    if full:
        rep["full"] = report(
            dataclasses.replace(config, num_embeddings=full),
            args.memory,
            args.worker_overhead,
            args.base_seconds,
            args.disk_mbps,
            hit_rate=args.hit_rate,
            zipf=args.zipf,
        )
    if args.json:
        print(json.dumps(rep, indent=2))
        return rep
    dtypes = list(rep["dtypes"])
    print(f"{args.config}: {config.num_features} tables, {sum(config.num_embeddings):,} rows, D={config.embedding_dim}")
    print(f"{'table':<16}{'rows':>14}" + "".join(f"{d:>13}" for d in dtypes))
    for t in rep["tables"]:
        print(f"{t['name']:<16}{t['rows']:>14,}" + "".join(f"{human(t[d]):>13}" for d in dtypes))
    print(
        f"{'total':<16}{sum(config.num_embeddings):>14,}"
        + "".join(f"{human(rep['dtypes'][d]['table_bytes']):>13}" for d in dtypes)
    )
    print(
        f"\ndense part {human(rep['dense_bytes'])}; budget {human(args.memory)}, "
        f"{human(args.worker_overhead)} per worker process"
    )
    _print_budget(rep, dtypes)
    c = rep["cpus"]
    print(
        f"\n{c['cpus']} CPU(s): the CPU rule's {c['rule_workers']} worker(s) x {c['torch_threads']} torch thread(s) "
        f"need {human(c['memory_bytes'])} with {config.build.embedding_dtype} tables"
        + ("" if c["workers"] == c["rule_workers"] else f"; the budget holds only {c['workers']}: set maxWorkers")
    )
    if full:
        capped = sum(f != r for f, r in zip(full, config.num_embeddings))
        print(
            f"\nuncapped: the config's '# full:' rows ({capped} of {config.num_features} tables are capped "
            f"in the config)"
        )
        print(
            f"{'total':<16}{sum(full):>14,}"
            + "".join(f"{human(rep['full']['dtypes'][d]['table_bytes']):>13}" for d in dtypes)
        )
        _print_budget(rep["full"], dtypes)
    print(
        "\n'copies': each worker holds the tables (GPU, or the seed's floor(memory / model) rule); "
        "'mmap': CPU workers share one page-cache copy of the archive's tables; "
        f"'paged': tables larger than memory, the page cache holding the working set that serves "
        f"{args.hit_rate:g} of the lookups (ids Zipf s={args.zipf:g}, hot rows scattered over 4 KiB pages)."
    )
    return rep


if __name__ == "__main__":
    main()
