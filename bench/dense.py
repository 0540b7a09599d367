#!/usr/bin/env python
"""Raw forward speed of the dense half per handler.dense_precision (dlrmkit/dense.py, issue 29).

    python bench/dense.py   # ~25 min on 2 CPUs: results/dense-precision.{json,md}

Rows/s at batch 256 of the dense half (pooled embeddings in) and of the whole served model (fused
fp32 tables) per variant: fp32 eager, fp32 with the jit.freeze path served today, fp32 Inductor
(freezing), bf16, int8 static (calibrated), int8 dynamic, and stock torchrec (DLRM / DLRM_DCN with
its EmbeddingBagCollection, no server). One single-thread process per CPU, pinned to it: "one core"
is CPU 0's process alone (the others wait at a barrier), "all cores" the sum while all run. Variants,
parts and modes take turns chunk by chunk in every round, so the shared host's drift hits all alike.
Then each variant's setup in a fresh process, cold (empty TORCHINDUCTOR_CACHE_DIR) and warm (same
dir). A precision this CPU has no instructions for is served as fp32 (dlrmkit.dense.unsupported);
it is compiled anyway here ("forced") to show what that rule avoids. The accuracy side:
scripts/dense_contract.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.mlperf import PUBLISHED as MLPERF

ROOT = Path(__file__).resolve().parent.parent

VARIANTS = ("fp32_eager", "fp32_jit_freeze", "fp32_inductor", "bf16", "int8_static", "int8_dynamic", "torchrec_stock")
CONFIGS = ("model-config.yaml", "model-config.criteo.yaml", "model-config.dlrmv2.yaml")


def log(msg: str) -> None:
    print(f"[dense {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def load_config(path: str, rows_cap: int, **changes):
    from dlrmkit.config import DLRMConfig

    cfg = DLRMConfig.from_yaml(path)
    return dataclasses.replace(cfg, num_embeddings=tuple(min(n, rows_cap) for n in cfg.num_embeddings), **changes)


def setup(variant: str, model, cfg, calibration=None):
    """``model`` (served fp32, fused tables) as ``variant`` runs it: (module, what, forced). A
    precision without native instructions here is compiled regardless (forced)."""
    import torch

    from dlrmkit.model import DLRMFactory
    from dlrmkit import dense

    if variant in ("fp32_eager", "torchrec_stock"):
        return model, variant, False
    if variant == "fp32_jit_freeze":
        return model, "frozen: " + ",".join(DLRMFactory(cfg).freeze_dense(model)), False
    if variant == "fp32_inductor":  # as dense._compile does for bf16, without autocast
        torch._inductor.config.freezing = True
        half = torch.compile(dense.DenseHalf(model).eval(), dynamic=True)
        with torch.no_grad():
            for rows in (2, 64):
                half(*dense._probe(model, cfg, rows))
        return dense.ServedDLRM(model, half, "fp32"), "fp32 Inductor (freezing)", False
    precision = variant.split("_")[0]
    calibration = calibration if variant == "int8_static" else None
    if dense.unsupported(precision, dense.cpu_flags()) is None:
        return *dense.compile_dense(model, cfg, precision, calibration), False
    return *dense._compile(model, cfg, precision, calibration, (2, 64)), True


def build(variant: str, cfg, weights: str):
    """The model of ``variant``: the archive's weights loaded as a worker loads them, or stock
    torchrec (the same seeded weights in torchrec's own modules)."""
    import torch

    from dlrmkit.model import DLRMFactory
    from dlrmkit import dense

    factory = DLRMFactory(cfg)
    if variant == "torchrec_stock":
        return factory.random(), "torchrec stock", False
    model = factory.load(weights)
    gen = torch.Generator().manual_seed(11)
    calibration = dense.calibration_inputs(model, [factory.probe_batch(256, gen) for _ in range(2)])
    return setup(variant, model, cfg, calibration)


def half_of(model):
    """The dense half of ``model`` as a function of (dense, pooled)."""
    if hasattr(model, "dense") and hasattr(model, "precision"):  # dlrmkit.dense.ServedDLRM
        return model.dense
    return lambda d, p: model.over_arch(model.inter_arch(dense_features=model.dense_arch(d), sparse_features=p))


def speed_worker(rank, cpu, cfg_path, weights, args, barrier, queue) -> None:
    os.sched_setaffinity(0, {cpu})
    import torch

    from dlrmkit.model import DLRMFactory

    torch.set_num_threads(1)
    cfg = load_config(cfg_path, args.rows_cap)
    say = log if rank == 0 else (lambda msg: None)
    d, kjt = DLRMFactory(cfg).probe_batch(args.batch, torch.Generator().manual_seed(7))
    models, info, fns = {}, {}, {}
    for v in args.variants:
        started = time.perf_counter()
        models[v], what, forced = build(v, cfg, weights)
        info[v] = {"what": what, "forced": forced, "setup_s": round(time.perf_counter() - started, 1)}
        say(f"{Path(cfg_path).name} {v}: {what} ({info[v]['setup_s']} s)")
    with torch.inference_mode():
        pooled = models["fp32_eager"].sparse_arch(kjt)
        want = models["fp32_eager"](d, kjt)
        for v, m in models.items():
            got = m(d, kjt)
            info[v]["max_abs_logit_diff"] = float((got - want).abs().max())
            info[v]["max_abs_prob_diff"] = float((torch.sigmoid(got) - torch.sigmoid(want)).abs().max())
            fns[(v, "dense_half")] = lambda m=m: half_of(m)(d, pooled)
            fns[(v, "whole")] = lambda m=m: m(d, kjt)
        calls = {}
        for key, fn in fns.items():
            fn()
            t = time.perf_counter()
            fn()
            calls[key] = max(1, round(args.chunk_s / (time.perf_counter() - t)))
        times: dict = {f"{v}|{part}|{mode}": [] for v, part in fns for mode in ("one", "all")}
        barrier.wait()
        for r in range(args.rounds):
            keys = list(fns)[r % len(fns) :] + list(fns)[: r % len(fns)]
            for v, part in keys if r % 2 == 0 else keys[::-1]:
                for mode in ("one", "all") if r % 2 == 0 else ("all", "one"):
                    barrier.wait()
                    if mode == "one" and rank:
                        continue
                    t = time.perf_counter()
                    for _ in range(calls[(v, part)]):
                        fns[(v, part)]()
                    times[f"{v}|{part}|{mode}"].append((time.perf_counter() - t) / calls[(v, part)])
            say(f"{Path(cfg_path).name}: round {r + 1}/{args.rounds}")
    queue.put((rank, info, {k: args.batch / statistics.median(ts) for k, ts in times.items() if ts}))


def speed_config(cfg_path: str, args) -> dict:
    import multiprocessing as mp

    import torch

    from dlrmkit.model import DLRMFactory

    cpus = sorted(os.sched_getaffinity(0))
    cfg = load_config(cfg_path, args.rows_cap)
    with tempfile.TemporaryDirectory() as tmp:
        weights = str(Path(tmp) / "dlrm.pt")
        factory = DLRMFactory(cfg)
        torch.save(factory.archive_state(factory.random()), weights)
        ctx = mp.get_context("spawn")
        barrier, queue = ctx.Barrier(len(cpus), timeout=1800), ctx.Queue()
        procs = [
            ctx.Process(target=speed_worker, args=(i, c, cfg_path, weights, args, barrier, queue))
            for i, c in enumerate(cpus)
        ]
        for p in procs:
            p.start()
        results = sorted(queue.get(timeout=3600) for _ in procs)
        for p in procs:
            p.join()
            if p.exitcode:
                sys.exit(f"a speed worker failed (exit {p.exitcode})")
        info, rates = results[0][1], [r[2] for r in results]
        start = (
            {}
            if args.no_start
            else {
                v: worker_start(cfg_path, v, weights, args)
                for v in args.variants
                if v not in ("fp32_eager", "torchrec_stock")
            }
        )
    rows = table_rows(args.variants, info, rates, start)
    return {"config": Path(cfg_path).name, "rows_cap": args.rows_cap, "cpus": cpus, "rows": rows}


def table_rows(variants, info: dict, rates: list[dict], start: dict) -> list[dict]:
    """One row per variant: ``info`` (CPU 0's), rows/s of the dense half and the whole model on one
    core (CPU 0's process, ``rates[0]``) and on all (the sum), each also as a ratio to fp32 eager."""
    rows = []
    for v in variants:
        row = {"variant": v, **info[v], "start": start.get(v)}
        for part in ("dense_half", "whole"):
            row[f"{part}_one_core"] = rates[0][f"{v}|{part}|one"]
            row[f"{part}_all_cores"] = sum(r[f"{v}|{part}|all"] for r in rates)
        rows.append(row)
    base = next(r for r in rows if r["variant"] == "fp32_eager")
    for row in rows:
        for k in [k for k in row if k.endswith(("_one_core", "_all_cores"))]:
            row[f"{k}_vs_eager"] = row[k] / base[k]
    return rows


def worker_start(cfg_path: str, variant: str, weights: str, args) -> dict:
    """A fresh single-thread process on CPU 0 that loads ``weights`` and sets up ``variant``:
    cold (empty Inductor cache) then warm (the same cache). Seconds of the setup (what the handler's
    dlrmkit.dense.prepare + freeze_dense do) and of the whole process."""
    out = {}
    with tempfile.TemporaryDirectory(prefix="inductor-") as cache:
        for kind in ("cold", "warm"):
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "OMP_NUM_THREADS": "1"}
            cmd = [
                "taskset",
                "-c",
                str(min(os.sched_getaffinity(0))),
                sys.executable,
                __file__,
                "--start-child",
                cfg_path,
                variant,
                weights,
                str(args.rows_cap),
            ]
            started = time.perf_counter()
            run = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            if run.returncode:
                sys.exit(f"{' '.join(cmd)} failed:\n{run.stderr[-3000:]}")
            out[kind] = {
                **json.loads(run.stdout.strip().splitlines()[-1]),
                "process_s": round(time.perf_counter() - started, 1),
            }
    log(
        f"{Path(cfg_path).name} {variant} worker start: setup cold {out['cold']['setup_s']} s, warm {out['warm']['setup_s']} s"
    )
    return out


def start_child(cfg_path: str, variant: str, weights: str, cap: str) -> int:
    import torch

    torch.set_num_threads(1)
    cfg = load_config(cfg_path, int(cap))
    started = time.perf_counter()
    build(variant, cfg, weights)
    print(json.dumps({"setup_s": round(time.perf_counter() - started, 1)}))
    return 0


def host() -> dict:
    from dlrmkit import dense
    import torch

    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    model = next((ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if ln.startswith("Model name")), "?")
    return {
        "cpu": model,
        "cpus": len(os.sched_getaffinity(0)),
        "isa": dense.isa_summary(),
        "torch_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
    }


# --- reports --------------------------------------------------------------------------------------
def fmt(x, digits=0) -> str:
    return "—" if x is None else f"{x:,.{digits}f}"


def speed_md(doc: dict) -> str:
    h = doc["host"]
    out = [
        f"# The dense half per precision: raw forward rows/s at batch {doc['batch']}",
        "",
        f"`{doc['command']}`, {doc['rounds']} interleaved rounds. Host: {h['cpu']}, {h['cpus']} CPUs, ISA as torch "
        f"may use it: {h['isa']} (ATen capability {h['torch_capability']}), torch {h['torch']}. One single-thread "
        "process per CPU pinned to it: *one core* is CPU 0's process alone, *all cores* the sum of every "
        "process running at once. Ratios are against fp32 eager of the same run, part and mode. "
        "**forced**: this CPU lacks the precision's instructions, so the handler serves fp32 here "
        "(dlrmkit.dense.unsupported); the figure is what that rule avoids. Start: the variant's setup "
        "in a fresh worker-like process, cold (empty TORCHINDUCTOR_CACHE_DIR) / warm (the same cache).",
        "",
        f"Context: {MLPERF}.",
        "",
    ]
    for c in doc["configs"]:
        cap = f" (tables capped at {c['rows_cap']:,} rows; the dense half is the config's)" if c["rows_cap"] else ""
        out += [
            f"## {c['config']}{cap}",
            "",
            "| variant | dense half, one core | vs eager | dense half, all cores | vs eager | whole model, one core "
            "| vs eager | whole model, all cores | vs eager | max abs logit diff | start s, cold / warm |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in c["rows"]:
            s = r.get("start")
            start = f"{s['cold']['setup_s']} / {s['warm']['setup_s']}" if s else "—"
            cells = [
                f"{fmt(r[k])} | {r[k + '_vs_eager']:.2f}"
                for k in ("dense_half_one_core", "dense_half_all_cores", "whole_one_core", "whole_all_cores")
            ]
            name = r["variant"] + (" **forced**" if r["forced"] else "")
            out.append(f"| {name} | {' | '.join(cells)} | {r['max_abs_logit_diff']:.2g} | {start} |")
        out.append("")
    out += [f"- {line}" for line in doc.get("reading", [])] + ["", doc.get("note", "")]
    return "\n".join(out) + "\n"


def write(doc: dict, out: str, md) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out + ".json").write_text(json.dumps(doc, indent=1) + "\n")
    Path(out + ".md").write_text(md(doc))
    log(f"wrote {out}.json and {out}.md")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=[str(ROOT / c) for c in CONFIGS], help="model configs")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS, help="(with fp32_eager)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default: %(default)s)")
    ap.add_argument("--chunk-s", type=float, default=0.3, help="seconds per timed chunk (default: %(default)s)")
    ap.add_argument("--batch", type=int, default=256, help="rows per forward (default: %(default)s)")
    ap.add_argument("--dlrmv2-rows", type=int, default=20_000, help="cap on dlrmv2's table rows (default: %(default)s)")
    ap.add_argument("--no-start", action="store_true", help="skip the worker-start measurement")
    ap.add_argument("--note", help="a markdown file appended to the report (the reading of these figures)")
    ap.add_argument("--out", default=str(ROOT / "results" / "dense-precision"), help="stem of .json/.md")
    ap.add_argument("--start-child", nargs=4, metavar=("CONFIG", "VARIANT", "WEIGHTS", "CAP"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.start_child:
        return start_child(*args.start_child)
    configs = []
    for path in args.configs:
        args.rows_cap = args.dlrmv2_rows if "dlrmv2" in Path(path).name else 1 << 40
        configs.append({**speed_config(path, args), "rows_cap": args.rows_cap if args.rows_cap < 1 << 40 else None})
    doc = {
        "command": "python bench/dense.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "host": host(),
        "batch": args.batch,
        "rounds": args.rounds,
        "configs": configs,
    }
    doc["reading"] = reading(doc)
    doc["note"] = Path(args.note).read_text() if args.note else ""
    write(doc, args.out, speed_md)
    return 0


def reading(doc: dict) -> list[str]:
    """What the figures say, computed from them: Inductor vs jit.freeze in fp32, and the fastest variant."""
    lines = []
    for c in doc["configs"]:
        r = {row["variant"]: row for row in c["rows"]}
        if "fp32_inductor" in r and "fp32_jit_freeze" in r:
            ratio = r["fp32_inductor"]["whole_one_core"] / r["fp32_jit_freeze"]["whole_one_core"]
            diff = r["fp32_inductor"]["max_abs_logit_diff"]
            lines.append(
                f"{c['config']}: fp32 Inductor / jit.freeze whole model, one core: {ratio:.2f}x, max abs "
                f"logit diff to eager {diff:.2g} ({'equal' if diff == 0 else 'not bit-equal'})"
            )
        best = max(c["rows"], key=lambda row: row["whole_one_core"])
        lines.append(
            f"{c['config']}: fastest whole model on one core: {best['variant']}"
            f"{' (forced)' if best['forced'] else ''}, {best['whole_one_core_vs_eager']:.2f}x fp32 eager"
        )
    return lines


if __name__ == "__main__":
    sys.exit(main())
