#!/usr/bin/env python
"""Does torch.compile (inductor, CPU) of the dense parts beat the served jit-frozen ones?

    python bench/try_compile.py            # ~3-5 minutes, most of it compiling

The served model (fused fp32 tables, dense arch and over arch jit-frozen) against the same
weights with the dense arch and over arch torch.compile-d (inductor; dynamic=False, one
compile per batch size, as a worker would see a few) and against eager: forward rows/s at
batch 1, 32, 128, the three interleaved call by call so a drift of the shared machine hits
each alike; max |logit difference| to eager; compile time. Writes results/compile.json. The
served path keeps whichever is faster and scores identically (docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "scripts")]
from benchmark import log  # noqa: E402
from tsctl import ROOT  # noqa: E402

sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "model-config.criteo.yaml"), help="model config (default: %(default)s)")
    ap.add_argument("--calls", type=int, default=200, help="timed calls per variant and batch (default: %(default)s)")
    ap.add_argument("--out", default=str(ROOT / "results" / "compile.json"), help="output (default: %(default)s)")
    args = ap.parse_args()

    import torch

    from dlrmkit.config import DLRMConfig
    from dlrm_factory import DLRMFactory

    torch.set_num_threads(1)  # as served (model-config: one torch thread per worker)
    cfg = DLRMConfig.from_yaml(args.config)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "dlrm.pt"
        log("building the model as build_mar.py does (seeded weights)")
        factory = DLRMFactory(cfg)
        torch.save(factory.archive_state(factory.random()), path)
        eager = DLRMFactory(cfg).load(path)
        frozen = DLRMFactory(cfg).load(path)
        compiled = DLRMFactory(cfg).load(path)
    DLRMFactory(cfg).freeze_dense(frozen)
    for name in ("dense_arch", "over_arch"):
        setattr(compiled, name, torch.compile(getattr(compiled, name), backend="inductor", dynamic=False))
    variants = {"eager": eager, "jit_frozen": frozen, "compiled": compiled}
    rows = []
    for batch in (1, 32, 128):
        dense, kjt = DLRMFactory(cfg).probe_batch(batch, torch.Generator().manual_seed(batch))
        with torch.inference_mode():
            t0 = time.perf_counter()
            compiled(dense, kjt)
            compile_s = time.perf_counter() - t0
            want = eager(dense, kjt)
            diff = {k: float((m(dense, kjt) - want).abs().max()) for k, m in variants.items()}
            times = {k: [] for k in variants}
            for i in range(args.calls):
                for k in (list(variants) if i % 2 == 0 else list(variants)[::-1]):
                    t0 = time.perf_counter()
                    variants[k](dense, kjt)
                    times[k].append(time.perf_counter() - t0)
        med = {k: statistics.median(v[5:]) for k, v in times.items()}
        row = {"batch": batch, "compile_s": round(compile_s, 1),
               **{f"{k}_rows_per_s": round(batch / v) for k, v in med.items()},
               "compiled_vs_frozen": round(med["jit_frozen"] / med["compiled"], 3),
               "frozen_vs_eager": round(med["eager"] / med["jit_frozen"], 3),
               **{f"{k}_max_abs_logit_diff": v for k, v in diff.items()}}
        rows.append(row)
        log(f"batch {batch}: " + ", ".join(f"{k} {batch / v:,.0f} rows/s" for k, v in med.items())
            + f"; compiled/frozen {row['compiled_vs_frozen']}, compile {compile_s:.1f} s, "
            f"max |diff| compiled {diff['compiled']:.1e}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": "python bench/try_compile.py " + " ".join(sys.argv[1:]),
                               "config": Path(args.config).name, "torch": torch.__version__, "rows": rows},
                              indent=2) + "\n")
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
