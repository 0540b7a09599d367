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

Hot rows (a packed model: scripts/build_big.py --hot-counts, dlrmkit/hot.py). The K rows that
take --hit-rate of a table's lookups are copied together after its rows, so they take K x row
bytes, rounded up to 4 KiB pages ('packed'), instead of about a page per hot row while they lie
scattered over the file ('working set'); 'workers, packed' is then floor((budget - packed) /
(dense + worker)) when the tables do not fit. --hot prints it table by table.

    python scripts/sizing.py --config model-config.dlrmv2.yaml --memory 24GiB --hot --dtype int8
    python scripts/sizing.py --config my.yaml --counts counts/ --hot-mib 512 2048

--counts PATH... (id counts files, or directories of them, from handler.count_ids_dir or
scripts/count_ids.py) measures instead of assuming: each table's exponent is fitted to its counts
(least squares of log count on log rank, over the ranks 1..r counted at least --fit-min-count
times, where a sample is dense enough to rank ids; the ranks thinned to log-spaced points so
that every decade weighs the same), printed beside the assumed one, and used for every paged
and packed figure (the assumed --zipf where a table has too few counted rows to fit). It also
prints what a hot set of each --hot-mib buys: the share of the counted lookups its rows take,
the rows chosen across tables as build_big --hot-counts chooses them (dlrmkit.hot.choose: the
most counted first), and the share the fitted laws predict for the same bytes (the
rows of all tables taken by their expected share of lookups, the tables weighted by their share
of the counted lookups), which also covers rows the sample never saw.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import re
import sys
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

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


@functools.lru_cache(maxsize=4096)
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


def packed_bytes(rows: int, row_bytes: int, s: float, hit_rate: float, page: int = PAGE) -> int:
    """Resident bytes a packed table needs to serve ``hit_rate`` of its lookups from memory: its
    ``hot_rows``' copies, side by side after its rows, rounded up to whole pages (the copies start
    wherever the table's rows end, so they may straddle one page more)."""
    return math.ceil(hot_rows(rows, s, hit_rate) * row_bytes / page) * page


FIT_MIN_COUNT = 16  # a rank is fitted when its id was counted this often (Poisson noise ~25%)
FIT_MIN_RANKS = 10  # fewer ranks than this: no fit, the assumed exponent stands


def fit_zipf(counts: np.ndarray, min_count: int = FIT_MIN_COUNT, min_ranks: int = FIT_MIN_RANKS) -> dict:
    """The exponent s of count ~ rank^-s for one table's id counts (any order): least squares of
    log count on log rank over ranks 1..r, r the last rank counted at least ``min_count`` times
    (beyond it a sample is too thin to rank its ids: ties and noise flatten the curve), the
    ranks thinned to about 100 log-spaced points so each decade weighs the same. ``s`` is None
    when fewer than ``min_ranks`` ranks qualify. Also returns the ranks fitted, the ids and
    lookups counted."""
    c = np.sort(np.asarray(counts, dtype=np.int64)[np.asarray(counts) > 0])[::-1]
    dense = int(np.count_nonzero(c >= min_count))
    out: dict = {"s": None, "ranks": [1, dense] if dense else None, "ids": len(c), "lookups": int(c.sum())}
    if dense < min_ranks:
        return out
    ranks = np.unique(np.geomspace(1, dense, num=100).round().astype(np.int64))
    slope, _ = np.polyfit(np.log(ranks), np.log(c[ranks - 1].astype(np.float64)), 1)
    if -slope > 0:
        out["s"] = round(float(-slope), 4)
    return out


def zipf_budget_hit_rate(tables: Sequence[tuple[int, float, float]], budget_rows: int) -> tuple[list[int], float]:
    """The rows of each table (rows R, exponent s, share of all lookups w) a hot set of
    ``budget_rows`` rows holds when it takes the rows of all tables with the largest expected
    share of lookups (w i^-s / sum_{j<=R} j^-s for rank i), and the share of all lookups they take."""
    live = [(r, s, w) for r, s, w in tables if w > 0 and r > 0]
    total_w = sum(w for _, _, w in live)
    if not live or budget_rows <= 0:
        return [0] * len(tables), 0.0
    mass = [zipf_mass(r, s) for r, s, _ in live]

    def take(log_lam: float) -> list[int]:
        # rank i is taken while w i^-s / Z >= lam: i <= (w / (Z lam))^(1/s)
        return [
            min(r, int(math.floor(math.exp((math.log(w / z) - log_lam) / s) + 1e-9)))
            for (r, s, w), z in zip(live, mass)
        ]

    if sum(r for r, _, _ in live) <= budget_rows:
        ks = [r for r, _, _ in live]
    else:
        probs = [math.log(w / z) - s * math.log(r) for (r, s, w), z in zip(live, mass)]
        lo, hi = min(probs) - 1, max(math.log(w / z) for (_, _, w), z in zip(live, mass)) + 1
        for _ in range(200):  # lo: takes too many rows, hi: fits
            mid = (lo + hi) / 2
            if sum(take(mid)) > budget_rows:
                lo = mid
            else:
                hi = mid
        ks = take(hi)
    hit = sum(w * zipf_mass(k, s) / z for k, (_, s, w), z in zip(ks, live, mass)) / total_w
    it = iter(ks)
    return [next(it) if w > 0 and r > 0 else 0 for r, _, w in tables], min(1.0, hit)


def counts_hit_rate(counts, rows: Mapping[str, int], row_bytes: int, budget_bytes: int) -> tuple[int, float]:
    """The rows ``dlrmkit.hot.choose`` packs within ``budget_bytes`` and the share of the counted
    lookups (every table's, rows counted once included) they take."""
    import torch

    from dlrmkit import hot

    chosen = hot.choose(counts, rows, row_bytes, budget_bytes)
    total = sum(int(c.sum()) for _, c in counts.values())
    covered = sum(int(counts[t][1][torch.isin(counts[t][0], h)].sum()) for t, h in chosen.items())
    return sum(len(h) for h in chosen.values()), covered / max(total, 1)


def fits(counts, names: Sequence[str], rows: Sequence[int], min_count: int = FIT_MIN_COUNT) -> dict[str, dict]:
    """Table -> ``fit_zipf`` of its counted ids inside the table (tables without counts: none)."""
    out = {}
    for name, r in zip(names, rows):
        if name in counts:
            ids, c = (x.numpy() for x in counts[name])
            out[name] = fit_zipf(c[(ids >= 0) & (ids < r)], min_count)
    return out


def hot_report(
    config, dtype: str, hit_rate: float, zipf: float, table_fits: dict | None, counts, hot_mib: Sequence[int]
) -> dict:
    """The hot rows of ``config``'s tables in ``dtype``: per table the exponent (fitted where
    ``table_fits`` has one, else ``zipf``), the rows that take ``hit_rate`` of its lookups and
    their bytes packed and scattered; per ``hot_mib`` budget, the share of lookups it takes by
    the Zipf laws and (with ``counts``) by the counts."""
    row = _row(config.embedding_dim, dtype)
    names, rows = list(config.sparse_features), list(config.num_embeddings)
    table_fits = table_fits or {}
    tables = []
    for name, r in zip(names, rows):
        fit = table_fits.get(name)
        s = fit["s"] if fit and fit["s"] else zipf
        tables.append(
            {
                "name": name,
                "rows": r,
                "s_assumed": zipf,
                "s_counts": fit["s"] if fit else None,
                "fit_ranks": fit["ranks"] if fit else None,
                "counted_lookups": fit["lookups"] if fit else 0,
                "s": s,
                "hot_rows": hot_rows(r, s, hit_rate),
                "packed_bytes": packed_bytes(r, row, s, hit_rate),
                "scattered_bytes": working_set(r, row, s, hit_rate),
            }
        )
    if counts is not None:
        weights = [t["counted_lookups"] for t in tables]
    else:
        weights = [1.0] * len(tables)  # tables looked up alike (one id per table per row: Criteo)
    budgets = []
    for mib in hot_mib:
        cap = (mib << 20) // row
        _, zipf_hit = zipf_budget_hit_rate([(t["rows"], t["s"], w) for t, w in zip(tables, weights)], cap)
        entry = {"mib": mib, "rows": min(cap, sum(rows)), "hit_rate_zipf": round(zipf_hit, 4)}
        if counts is not None:
            chosen, counted = counts_hit_rate(counts, dict(zip(names, rows)), row, mib << 20)
            entry.update(rows_counted=chosen, hit_rate_counts=round(counted, 4))
        budgets.append(entry)
    return {
        "dtype": dtype,
        "row_bytes": row,
        "hit_rate": hit_rate,
        "zipf_assumed": zipf,
        "fitted": counts is not None,
        "tables": tables,
        "hot_rows": sum(t["hot_rows"] for t in tables),
        "packed_bytes": sum(t["packed_bytes"] for t in tables),
        "scattered_bytes": sum(t["scattered_bytes"] for t in tables),
        "budgets": budgets,
    }


def report(
    config,
    budget: int,
    worker: int,
    base_s: float,
    disk_mbps: float,
    cpus: int | None = None,
    hit_rate: float = 0.9,
    zipf: float = 1.05,
    counts=None,
    hot_mib: Sequence[int] = (),
    hot_dtype: str | None = None,
    fit_min_count: int = FIT_MIN_COUNT,
) -> dict:
    """``counts`` (``dlrmkit.hot.read_counts``): each table's exponent fitted to them where they
    allow, ``zipf`` elsewhere; ``hot``: the hot rows in ``hot_dtype`` (default: the config's)
    per table and what each of ``hot_mib`` MiB of hot rows buys."""
    from dlrmkit.config import EMBEDDING_DTYPES
    from dlrmkit.scale import table_bytes

    c = config
    dense = 4 * _dense_params(c)
    table_fits = fits(counts, c.sparse_features, c.num_embeddings, fit_min_count) if counts is not None else None
    exponent = {
        t: (table_fits[t]["s"] if table_fits and table_fits.get(t, {}).get("s") else zipf) for t in c.sparse_features
    }
    out: dict = {
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
        row = _row(c.embedding_dim, d)
        ws = sum(working_set(t["rows"], row, exponent[t["name"]], hit_rate) for t in out["tables"])
        packed = sum(packed_bytes(t["rows"], row, exponent[t["name"]], hit_rate) for t in out["tables"])
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
            # the same hit rate from a packed model: the hot rows' copies (build_big --hot-counts)
            "packed_bytes": packed,
            "workers_packed": shared
            if shared >= 1
            else max(0, (budget - packed) // per_worker)
            if budget > packed
            else 0,
            "startup_timeout_s": max(60, int(math.ceil(startup / 10) * 10)),
        }
    out["hot"] = hot_report(c, hot_dtype or c.build.embedding_dtype, hit_rate, zipf, table_fits, counts, hot_mib)
    out["hot"]["fit_min_count"] = fit_min_count if counts is not None else None
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
        ("packed_bytes", "hot rows, packed"),
        ("workers_packed", "workers, packed"),
        ("startup_timeout_s", "startupTimeout"),
    ):
        cell = (lambda v: human(v)) if key.endswith("_bytes") else (lambda v: v)
        print(f"{label:<30}" + "".join(f"{cell(rep['dtypes'][d][key]):>13}" for d in dtypes))


def _print_hot(hot: dict, counts_from: str | None) -> None:
    """The hot rows table by table, and what each --hot-mib buys."""
    fitted = hot["fitted"]
    law = (
        f"s fitted to the counts of {counts_from} (ranks counted >= {hot['fit_min_count']} times), "
        f"s={hot['zipf_assumed']:g} where too few"
        if fitted
        else f"ids Zipf s={hot['zipf_assumed']:g} assumed"
    )
    print(
        f"\nhot rows for a {hot['hit_rate']:g} hit rate, {hot['dtype']} rows of {hot['row_bytes']} B ({law}): the rows that "
        "take that share of each table's lookups, packed (copies side by side) vs scattered (a page per row)"
    )
    head = f"{'table':<16}{'rows':>14}"
    if fitted:
        head += f"{'s assumed':>10}{'s counts':>10}{'fit ranks':>14}"
    else:
        head += f"{'s':>10}"
    print(head + f"{'hot rows':>14}{'packed':>13}{'scattered':>13}")
    for t in hot["tables"]:
        line = f"{t['name']:<16}{t['rows']:>14,}"
        if fitted:
            ranks = f"1-{t['fit_ranks'][1]:,}" if t["s_counts"] else "too few" if t["counted_lookups"] else "no counts"
            s_counts = f"{t['s_counts']:.3f}" if t["s_counts"] else "-"
            line += f"{t['s_assumed']:>10g}{s_counts:>10}{ranks:>14}"
        else:
            line += f"{t['s']:>10g}"
        print(line + f"{t['hot_rows']:>14,}{human(t['packed_bytes']):>13}{human(t['scattered_bytes']):>13}")
    print(
        f"{'total':<16}{sum(t['rows'] for t in hot['tables']):>14,}"
        + " " * (34 if fitted else 10)
        + f"{hot['hot_rows']:>14,}{human(hot['packed_bytes']):>13}{human(hot['scattered_bytes']):>13}"
    )
    if not hot["budgets"]:
        return
    print(
        f"\nhot set of --hot-mib MiB ({hot['dtype']}): the share of lookups its rows take"
        + (
            ", by the counts (rows chosen as build_big --hot-counts chooses them, the most counted "
            "first) and by the fitted laws (tables weighted by their counted lookups)"
            if fitted
            else " by the assumed law (every table looked up alike)"
        )
    )
    print(f"{'hot MiB':>10}{'rows':>14}" + (f"{'rows counted':>14}{'counts':>10}" if fitted else "") + f"{'Zipf':>10}")
    for b in hot["budgets"]:
        line = f"{b['mib']:>10,}{b['rows']:>14,}"
        if fitted:
            line += f"{b['rows_counted']:>14,}{b['hit_rate_counts']:>10.1%}"
        print(line + f"{b['hit_rate_zipf']:>10.1%}")


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
    ap.add_argument(
        "--counts",
        nargs="+",
        metavar="PATH",
        help="id counts files (or directories of them) from handler.count_ids_dir or scripts/count_ids.py: "
        "each table's exponent fitted to them instead of --zipf, and what each --hot-mib buys by the counts",
    )
    ap.add_argument(
        "--hot-mib",
        type=int,
        nargs="+",
        metavar="MIB",
        help="hot set sizes (build_big.py --hot-mib) to say the hit rate of (default with --counts: "
        + " ".join(map(str, HOT_MIB))
        + ")",
    )
    ap.add_argument(
        "--hot",
        action="store_true",
        help="print the hot rows table by table (implied by --counts and --hot-mib)",
    )
    ap.add_argument(
        "--dtype",
        choices=["fp32", "fp16", "int8", "int4"],
        help="the embedding_dtype of the hot rows' section (default: the config's)",
    )
    ap.add_argument(
        "--fit-min-count",
        type=int,
        default=FIT_MIN_COUNT,
        help="with --counts: fit the ranks whose id was counted at least this often (default: %(default)s)",
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
    if args.hot_mib and min(args.hot_mib) <= 0:
        ap.error(f"--hot-mib: expected positive MiB, got {min(args.hot_mib)} (e.g. --hot-mib 512 2048)")
    if args.fit_min_count < 2:
        ap.error(f"--fit-min-count: expected at least 2, got {args.fit_min_count} (e.g. --fit-min-count 16)")
    counts = None
    if args.counts:
        from dlrmkit.hot import read_counts

        try:
            counts = read_counts(args.counts)
        except ConfigError as e:
            sys.exit(f"error: {str(e).replace('--hot-counts', '--counts')}")
        unknown = sorted(set(counts) - set(config.sparse_features))
        if unknown:
            sys.exit(
                f"error: --counts: table {unknown[0]!r} is not in {args.config} "
                f"(its tables: {', '.join(config.sparse_features[:5])}...)"
            )
    hot_mib = args.hot_mib or (HOT_MIB if counts is not None else ())
    common = dict(
        hit_rate=args.hit_rate,
        zipf=args.zipf,
        counts=counts,
        hot_dtype=args.dtype,
        fit_min_count=args.fit_min_count,
    )
    rep = report(
        config,
        args.memory,
        args.worker_overhead,
        args.base_seconds,
        args.disk_mbps,
        args.cpus,
        hot_mib=_ladder(hot_mib, config, args.dtype, args.hot_mib is not None),
        **common,
    )
    full = full_rows(args.config, config)
    if full:
        full_config = dataclasses.replace(config, num_embeddings=full)
        rep["full"] = report(
            full_config,
            args.memory,
            args.worker_overhead,
            args.base_seconds,
            args.disk_mbps,
            hot_mib=_ladder(hot_mib, full_config, args.dtype, args.hot_mib is not None),
            **common,
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
    show_hot = args.hot or counts is not None or args.hot_mib is not None
    counts_from = " ".join(args.counts) if args.counts else None
    if show_hot:
        _print_hot(rep["hot"], counts_from)
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
        if show_hot:
            _print_hot(rep["full"]["hot"], counts_from)
    law = (
        f"s fitted per table to the counts, s={args.zipf:g} where too few"
        if counts is not None
        else f"ids Zipf s={args.zipf:g}"
    )
    print(
        "\n'copies': each worker holds the tables (GPU, or the seed's floor(memory / model) rule); "
        "'mmap': CPU workers share one page-cache copy of the archive's tables; "
        f"'paged': tables larger than memory, the page cache holding the working set that serves "
        f"{args.hit_rate:g} of the lookups ({law}, hot rows scattered over 4 KiB pages); "
        "'packed': the same hit rate from a packed model (build_big.py --hot-counts), the hot rows' "
        "copies side by side" + ("" if show_hot else " (--hot: table by table)") + "."
    )
    return rep


HOT_MIB = (64, 256, 1024, 2048, 4096)  # --hot-mib's default ladder with --counts


def _ladder(mib: Sequence[int], config, dtype: str | None, given: bool) -> list[int]:
    """``mib`` as asked; the default ladder stops at the first size that holds every row."""
    if given:
        return list(mib)
    whole = sum(config.num_embeddings) * _row(config.embedding_dim, dtype or config.build.embedding_dtype)
    out = []
    for m in mib:
        out.append(m)
        if m << 20 >= whole:
            break
    return out


if __name__ == "__main__":
    main()
