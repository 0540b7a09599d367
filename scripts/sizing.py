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
sys.path.insert(0, str(ROOT))

_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


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


def report(config, budget: int, worker: int, base_s: float, disk_mbps: float, cpus: int | None = None) -> dict:
    from dlrmkit.config import EMBEDDING_DTYPES
    from dlrmkit.scale import table_bytes

    c = config
    dense = 4 * _dense_params(c)
    out = {"budget_bytes": budget, "worker_overhead_bytes": worker, "dense_bytes": dense,
           "tables": [], "dtypes": {}}
    for name, rows in zip(c.sparse_features, c.num_embeddings):
        out["tables"].append({"name": name, "rows": rows,
                              **{d: table_bytes(rows, c.embedding_dim, d) for d in EMBEDDING_DTYPES}})
    for d in EMBEDDING_DTYPES:
        tables = sum(t[d] for t in out["tables"])
        per_worker = dense + worker
        startup = 1.5 * (base_s + tables / (disk_mbps * 1e6))
        out["dtypes"][d] = {
            "table_bytes": tables,
            "model_bytes": tables + dense,
            "workers_unshared": max(0, budget // (tables + per_worker)),
            "workers_shared": max(0, (budget - tables) // per_worker) if budget > tables else 0,
            "startup_timeout_s": max(60, int(math.ceil(startup / 10) * 10)),
        }
    if cpus:
        from dlrmkit.cpus import cpu_rule

        rule = cpu_rule(cpus)
        d = out["dtypes"][c.embedding_dtype]
        out["cpus"] = {"cpus": cpus, "rule_workers": rule.workers, "torch_threads": rule.threads,
                       "workers": min(rule.workers, d["workers_shared"]),
                       "memory_bytes": d["table_bytes"] + rule.workers * (dense + worker)}
    return out


def _dense_params(c) -> int:
    """Parameter count of the dense arch, interaction and over arch (what each worker copies),
    read off the config's model built on ``meta`` (no memory): exact for every interaction."""
    import torch

    from dlrm_factory import DLRMFactory
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
        sys.exit(f"error: {path}: '# full:' must list one positive row count per sparse feature "
                 f"({config.num_features}), got {rows!r}")
    return tuple(rows)


def _print_budget(rep: dict, dtypes: list[str]) -> None:
    print(f"{'':<16}{'':>14}" + "".join(f"{d:>13}" for d in dtypes))
    for key, label in (("workers_unshared", "workers, copies"), ("workers_shared", "workers, mmap"),
                       ("startup_timeout_s", "startupTimeout")):
        print(f"{label:<30}" + "".join(f"{rep['dtypes'][d][key]:>13}" for d in dtypes))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "model-config.yaml"),
                    help="model-config.yaml with a handler: section (default: %(default)s)")
    ap.add_argument("--memory", type=parse_bytes, default=None,
                    help="memory budget for this model's workers, e.g. 24GiB (default: this machine's RAM)")
    ap.add_argument("--worker-overhead", type=parse_bytes, default=parse_bytes("450MiB"),
                    help="memory of one worker process besides the model: Python, torch, torchrec, TorchServe "
                         "(default: %(default)s bytes, a margin over the ~0.3 GB each extra CPU worker added in "
                         "bench/bench_scale.py's measurement)")
    ap.add_argument("--base-seconds", type=float, default=20.0,
                    help="worker start without the tables: imports, TorchServe handshake (default: %(default)s)")
    ap.add_argument("--disk-mbps", type=float, default=200.0,
                    help="read rate for the startupTimeout bound, MB/s (default: %(default)s)")
    ap.add_argument("--cpus", type=int, default=None,
                    help="CPUs to size the workers for (default: the CPUs this process may use: affinity and "
                         "cgroup quota)")
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
    rep = report(config, args.memory, args.worker_overhead, args.base_seconds, args.disk_mbps, args.cpus)
    full = full_rows(args.config, config)
    if full:
        rep["full"] = report(dataclasses.replace(config, num_embeddings=full), args.memory, args.worker_overhead,
                             args.base_seconds, args.disk_mbps)
    if args.json:
        print(json.dumps(rep, indent=2))
        return rep
    dtypes = list(rep["dtypes"])
    print(f"{args.config}: {config.num_features} tables, {sum(config.num_embeddings):,} rows, D={config.embedding_dim}")
    print(f"{'table':<16}{'rows':>14}" + "".join(f"{d:>13}" for d in dtypes))
    for t in rep["tables"]:
        print(f"{t['name']:<16}{t['rows']:>14,}" + "".join(f"{human(t[d]):>13}" for d in dtypes))
    print(f"{'total':<16}{sum(config.num_embeddings):>14,}" + "".join(f"{human(rep['dtypes'][d]['table_bytes']):>13}" for d in dtypes))
    print(f"\ndense part {human(rep['dense_bytes'])}; budget {human(args.memory)}, "
          f"{human(args.worker_overhead)} per worker process")
    _print_budget(rep, dtypes)
    c = rep["cpus"]
    print(f"\n{c['cpus']} CPU(s): the CPU rule's {c['rule_workers']} worker(s) x {c['torch_threads']} torch thread(s) "
          f"need {human(c['memory_bytes'])} with {config.embedding_dtype} tables"
          + ("" if c["workers"] == c["rule_workers"] else f"; the budget holds only {c['workers']}: set maxWorkers"))
    if full:
        capped = sum(f != r for f, r in zip(full, config.num_embeddings))
        print(f"\nuncapped: the config's '# full:' rows ({capped} of {config.num_features} tables are capped "
              f"in the config)")
        print(f"{'total':<16}{sum(full):>14,}"
              + "".join(f"{human(rep['full']['dtypes'][d]['table_bytes']):>13}" for d in dtypes))
        _print_budget(rep["full"], dtypes)
    print("\n'copies': each worker holds the tables (GPU, or the seed's floor(memory / model) rule); "
          "'mmap': CPU workers share one page-cache copy of the archive's tables.")
    return rep


if __name__ == "__main__":
    main()
