"""The ids a benchmark looks up: uniform over a table (the worst case for a page cache) or a power
law (Zipf) whose hot ranks are scattered over the table as hashed categorical ids are; and a counts
file of such ids, drawn with another seed, as the sample of traffic a packed build learns from.

    python bench/ids.py --config model-config.dlrmv2.yaml --full --zipf 1.05 --pairs 1000000 --out counts.pt
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np
import torch

from bench import mlperf
from dlrmkit import hot
from dlrmkit.config import DLRMConfig


def _multiplier(n: int) -> int:
    a = 2654435761 % n or 1
    while math.gcd(a, n) != 1:
        a += 1
    return a


def sample_ids(rng: np.random.Generator, n: int, k: int, zipf: float | None) -> np.ndarray:
    """``k`` ids of a table of ``n`` rows: uniform (zipf None) or rank ~ i^-zipf (continuous
    inverse CDF on [1, n+1)), the rank scattered by id = (rank - 1) * a mod n (a coprime to n)."""
    if not zipf:
        return rng.integers(0, n, k)
    u = rng.random(k)
    s = zipf
    if abs(s - 1) < 1e-9:
        x = np.exp(u * np.log(n + 1.0))
    else:
        x = ((n + 1.0) ** (1 - s) * u + (1 - u)) ** (1 / (1 - s))
    rank = np.minimum(np.floor(x).astype(np.int64), n) - 1
    return (rank * _multiplier(n)) % n


def rank_share(n: int, zipf: float, r: np.ndarray) -> np.ndarray:
    """The share of a table's lookups that go to rank ``r`` (1-based) under ``sample_ids``' law.

    >>> bool(abs(rank_share(1000, 1.05, np.arange(1, 1001)).sum() - 1) < 1e-9)
    True
    """
    r = np.asarray(r, dtype=np.float64)
    if abs(zipf - 1) < 1e-9:
        return np.log((r + 1) / r) / np.log(n + 1.0)
    e = 1 - zipf
    return ((r + 1) ** e - r**e) / ((n + 1.0) ** e - 1)


def law_counts(cfg: DLRMConfig, zipf: float, pairs: int, min_count: int, chunk: int = 1 << 24) -> hot.Counts:
    """Each id's expected count in ``pairs`` pairs (rounded), for the ranks expected at least
    ``min_count`` times: what ``counts`` converges to as its sample grows."""
    bags = mlperf.mlperf_bags(cfg) or [1] * cfg.num_features
    out: hot.Counts = {}
    for name, n, bag in zip(cfg.sparse_features, cfg.num_embeddings, bags):
        lo, hi = 0, n  # the most ranks expected at least min_count times (shares fall with the rank)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if pairs * bag * rank_share(n, zipf, np.array([mid]))[0] >= min_count else (lo, mid - 1)
        ids, got = [], []
        for a in range(1, lo + 1, chunk):
            r = np.arange(a, min(lo, a + chunk - 1) + 1, dtype=np.int64)
            got.append(torch.from_numpy(np.rint(pairs * bag * rank_share(n, zipf, r)).astype(np.int64)))
            ids.append(torch.from_numpy(((r - 1) * _multiplier(n)) % n))
        if ids:
            out[name] = (torch.cat(ids), torch.cat(got))
    return out


def counts(cfg: DLRMConfig, zipf: float | None, pairs: int, seed: int, chunk: int = 1 << 24) -> hot.Counts:
    """The ids ``pairs`` user-item pairs look up (MLPerf's bag sizes; one id per feature without
    them), counted per table, drawn in chunks of ``chunk`` ids."""
    bags = mlperf.mlperf_bags(cfg) or [1] * cfg.num_features
    rng = np.random.default_rng(seed)
    out: hot.Counts = {}
    for name, n, bag in zip(cfg.sparse_features, cfg.num_embeddings, bags):
        parts = []
        left = pairs * bag
        while left:
            k = min(chunk, left)
            parts.append(hot.count({name: torch.from_numpy(sample_ids(rng, n, k, zipf))}))
            left -= k
        out.update(hot.merge(parts))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--full", action="store_true", help="the config's '# full: [...]' row counts")
    ap.add_argument("--zipf", type=float, default=1.05, help="0 for uniform ids (default: %(default)s)")
    ap.add_argument("--pairs", type=int, default=1_000_000, help="user-item pairs sampled (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=7, help="not the seed of the queries measured (default: %(default)s)")
    ap.add_argument("--law", action="store_true", help="the law's expected counts in --pairs pairs, not a sample")
    ap.add_argument("--min-count", type=int, default=1, help="with --law: ranks expected fewer times are left out")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.law and not args.zipf:
        ap.error("--law needs --zipf above 0: uniform ids have no hot rows")
    cfg = DLRMConfig.from_yaml(args.config)
    if args.full:
        from scripts.sizing import full_rows

        cfg = cfg.with_changes(num_embeddings=full_rows(args.config, cfg))
    started = time.perf_counter()
    if args.law:
        got = law_counts(cfg, args.zipf, args.pairs, args.min_count)
        source = f"bench/ids.py: Zipf s={args.zipf}, expected counts in {args.pairs:,} pairs, at least {args.min_count}"
    else:
        got = counts(cfg, args.zipf or None, args.pairs, args.seed)
        source = (
            f"bench/ids.py: {args.pairs:,} pairs, "
            + (f"Zipf s={args.zipf}" if args.zipf else "uniform")
            + f", seed {args.seed}"
        )
    hot.write_counts(args.out, got, source=source)
    print(
        f"{args.out}: {sum(len(i) for i, _ in got.values()):,} distinct ids of {sum(int(c.sum()) for _, c in got.values()):,} "
        f"lookups in {time.perf_counter() - started:.0f} s ({source})"
    )


if __name__ == "__main__":
    main()
