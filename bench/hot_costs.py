"""What hot rows cost a worker per forward, on a packed model (scripts/build_big.py --hot-counts):
the redirect of hot ids, the prefetch of the other pages (all cached: its floor), the id counter's
sampling on the serving thread and its counting on its own thread, beside the forward itself.

    python bench/hot_costs.py /work/big/store/dlrmv2-int8 --zipf 1.05

MLPerf-sized queries (100-700 pairs, MLPerf's bag sizes), ids from bench/ids.py (seed 11: not the
counts' seed); the pages are made resident first (a forward of each query), so the figures are what
the steps cost on top of a warm forward, not what a page fault costs (bench/bigtables.py measures
that under LoadGen).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from bench import ids as bench_ids
from bench import mlperf
from bench.common import md_table, run_dir, write_report
from dlrmkit import hot
from dlrmkit.config import DLRMConfig
from dlrmkit.model import DLRMFactory


def query(cfg: DLRMConfig, pairs: int, zipf: float | None, rng: np.random.Generator):
    bags = mlperf.mlperf_bags(cfg) or [1] * cfg.num_features
    values = [torch.from_numpy(bench_ids.sample_ids(rng, n, pairs * k, zipf)) for n, k in zip(cfg.num_embeddings, bags)]
    lengths = torch.tensor([k for k in bags for _ in range(pairs)])
    dense = torch.from_numpy(rng.uniform(0, 5, (pairs, cfg.num_dense_features)).astype(np.float32))
    return dense, KeyedJaggedTensor(keys=list(cfg.sparse_features), values=torch.cat(values), lengths=lengths)


def ms(repeat: int, fn, *args) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn(*args)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", help="a packed model directory (scripts/build_big.py --hot-counts)")
    ap.add_argument("--zipf", type=float, default=1.05, help="0: uniform ids (default: %(default)s)")
    ap.add_argument("--queries", type=int, default=20, help="queries per size (default: %(default)s)")
    ap.add_argument(
        "--counts", nargs="*", default=[], help="a counts file: the counter's total at a flush, merged once (timed)"
    )
    ap.add_argument("--out", help="folder to write (default: results/<date>-hot-costs/)")
    args = ap.parse_args(argv)
    started = time.perf_counter()
    model_dir = Path(args.model_dir)
    cfg = DLRMConfig.from_yaml(model_dir / "model-config.yaml")
    torch.set_num_threads(1)  # a worker's share of 2 CPUs (the CPU rule: 2 workers x 1 thread)
    model = DLRMFactory(cfg).load(model_dir / "dlrm.pt")
    index = model.hot_index
    if index is None:
        raise SystemExit(f"{model_dir}: not a packed model (build it with scripts/build_big.py --hot-counts)")
    qebc = model.sparse_arch.embedding_bag_collection
    prefetch = hot.Prefetch(qebc, dict(zip(cfg.sparse_features, cfg.num_embeddings)))
    rng = np.random.default_rng(11)
    rows = []
    report: dict = {"model_dir": str(model_dir), "hot_rows": len(index), "zipf": args.zipf, "sizes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        counter = hot.IdCounter(tmp, every=1, flush_s=3600)
        for pairs in (100, 270, 700):
            qs = [query(cfg, pairs, args.zipf or None, rng) for _ in range(args.queries)]
            got: dict[str, list[float]] = {k: [] for k in ("forward", "redirect", "prefetch", "observe", "count")}
            share = []
            for dense, kjt in qs:
                redirected = index.redirect(kjt)
                with torch.inference_mode():
                    model(dense, redirected)  # its pages resident
                share.append(float((redirected.values() != kjt.values()).float().mean()))
                with torch.inference_mode():
                    got["forward"].append(ms(3, model, dense, redirected))
                got["redirect"].append(ms(3, index.redirect, kjt))
                got["prefetch"].append(ms(3, prefetch, redirected))
                got["observe"].append(ms(3, counter.observe, kjt))
                split = dict(zip(kjt.keys(), torch.split(kjt.values(), kjt.length_per_key())))
                got["count"].append(ms(1, hot.count, split))
            med = {k: round(statistics.median(v), 3) for k, v in got.items()}
            med["hot_share"] = round(statistics.median(share), 3)
            report["sizes"][pairs] = med
            rows.append(
                [
                    pairs,
                    med["forward"],
                    med["redirect"],
                    med["prefetch"],
                    med["observe"],
                    med["count"],
                    med["hot_share"],
                ]
            )
        counter.close()
        recent = hot.read_counts([counter.path])
    if args.counts:
        total = hot.read_counts(args.counts)
        t = time.perf_counter()
        hot.merge([total, recent])
        report["flush_merge_s"] = round(time.perf_counter() - t, 2)
        report["flush_total_ids"] = sum(len(i) for i, _ in total.values())
    report["wall_s"] = round(time.perf_counter() - started, 1)
    out = run_dir(__file__, "hot-costs", "What hot rows cost a worker per forward", args.out, argv)
    lines = [
        f"# What hot rows cost a worker per forward ({len(index):,} hot rows, ids Zipf s={args.zipf})",
        "",
        "Median ms per query on one thread, pages resident; count: the counter thread's work per sampled forward.",
        "",
        *md_table(
            ["pairs", "forward ms", "redirect ms", "prefetch ms", "observe ms", "count ms", "lookups to hot copies"],
            rows,
            right=True,
        ),
    ]
    if "flush_merge_s" in report:
        lines += [
            "",
            f"The counter's flush (every 60 s): the recent counts merged into a total of "
            f"{report['flush_total_ids']:,} distinct ids in {report['flush_merge_s']} s on its own thread.",
        ]
    write_report(out / "hot-costs", report, lines)


if __name__ == "__main__":
    main()
