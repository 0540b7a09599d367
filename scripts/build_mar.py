#!/usr/bin/env python
"""Build a TorchServe model archive (.mar) for a DLRM described by a model-config.yaml.

    python scripts/build_mar.py                                  # seeded random weights
    python scripts/build_mar.py --checkpoint trained.pt          # your trained state_dict
    python scripts/build_mar.py --config model-config.criteo.yaml --force
    python scripts/build_mar.py --checkpoint ckpt/ --write-config my.yaml   # a config that fits; builds nothing
    python scripts/build_mar.py --checkpoint ckpt/ --write-config my.yaml --feature-order user,item,ctx
    python scripts/build_mar.py --config my.yaml --checkpoint ckpt/ --verify eval.jsonl --force
    python scripts/build_mar.py --fit-dense-shift day_0.tsv --config model-config.criteo.yaml --write-config my.yaml

--fit-dense-shift reads training TSV files and computes ``handler.dense_shift`` as torchrec's
tsv_to_npys did (2 - the file's minimum dense value, per file), then writes --config (or, with
--checkpoint, the config derived from it) with raw_input: criteo_tsv and that shift to
--write-config; it builds nothing.

--checkpoint takes a .pt/.pth state_dict (or a dict holding one under model / model_state_dict /
state_dict) or a torch.distributed.checkpoint directory, from DLRMTrain / DistributedModelParallel
(dlrmkit/checkpoint/). The weights are checked against the config before anything is archived: a
key or table whose name or shape does not fit is an error that names it, and so is a feature order
the checkpoint contradicts. A DCP directory does not record the trainer's table order: unless its
tables are one numbered sequence (cat_0 ... cat_25), --feature-order gives it. --verify proves the
built archive against the trainer's own scores and leaves no archive when they differ.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Shipped beside the handler in the archive, whose root TorchServe puts on the worker's sys.path:
# the kit's package (every module of dlrmkit/, as dlrmkit/ in the archive).
PACKAGE = "dlrmkit"


def extra_files(tmp: Path) -> list[str]:
    """torch-model-archiver's --extra-files: a folder in ``tmp`` holding the
    package (the archiver copies a directory's entries to the archive's root, so the package
    sits in a folder of its own to land as dlrmkit/)."""
    stage = tmp / "package"
    shutil.rmtree(stage, ignore_errors=True)
    shutil.copytree(ROOT / PACKAGE, stage / PACKAGE, ignore=shutil.ignore_patterns("__pycache__"))
    return [str(stage)]


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--config",
        default=str(ROOT / "model-config.yaml"),
        help="model-config.yaml with a handler: section (default: %(default)s)",
    )
    ap.add_argument(
        "--checkpoint",
        help="a trained fp32 DLRM: a .pt/.pth state_dict file or a DCP directory "
        "(docs/trained-models.md), quantized here when handler.embedding_dtype is fp16/int8/int4; "
        "default: seeded random weights from handler.seed",
    )
    ap.add_argument(
        "--write-config",
        metavar="OUT.yaml",
        help="with --checkpoint: write a complete model config derived from the checkpoint's keys "
        "and shapes to OUT.yaml, print what was derived and assumed, and build nothing",
    )
    ap.add_argument(
        "--feature-order",
        metavar="F1,F2,...",
        help="with --checkpoint: the trainer's feature order (its EmbeddingBagConfig list), which a "
        "DCP directory does not record and the interaction depends on; --write-config lists "
        "sparse_features in it, a build checks the config against it",
    )
    ap.add_argument(
        "--verify",
        metavar="FILE.jsonl",
        help='after building, score every request of FILE (JSON lines {"request": {...}, "scores": '
        '[...], "labels": [...]}, as scripts/train.py writes verify.jsonl) with the archive loaded as '
        "a worker loads it; differences over --verify-tolerance fail the build and leave no archive",
    )
    ap.add_argument(
        "--calibrate",
        metavar="FILE.jsonl",
        help="handler.dense_precision int8: requests like the traffic (JSON lines of /predictions "
        'bodies, or of {"request": body} lines as a --verify file has) whose dense-half inputs the archive carries for int8\'s static '
        "activation scales (at most 512 rows): a sample of the training data, as scripts/train.py writes "
        "calibration.jsonl, never the --verify file (the contract would be judged on the rows the "
        "scales were fitted to); without it int8 computes its activation scales per batch (dynamic)",
    )
    ap.add_argument(
        "--verify-tolerance",
        type=float,
        default=1e-5,
        metavar="T",
        help="largest |served - trainer| score --verify accepts (default: %(default)s)",
    )
    ap.add_argument(
        "--auc-ratio",
        type=float,
        default=0.999,
        metavar="R",
        help="with --verify and a dense_precision other than fp32: the accuracy contract, served AUC >= "
        "R x the trainer's fp32 AUC (default %(default)s, MLPerf's dlrm-v2-99.9; 0.99 is its looser class)",
    )
    ap.add_argument(
        "--fit-dense-shift",
        nargs="+",
        metavar="TSV",
        help="with --write-config: fit handler.dense_shift on these training TSV files as torchrec's "
        "tsv_to_npys does (per file) and write a config serving raw Criteo lines (raw_input: criteo_tsv)",
    )
    ap.add_argument(
        "--output-dir", default=str(ROOT / "model_store"), help="where the .mar goes (default: %(default)s)"
    )
    ap.add_argument("--model-name", default="dlrm", help="archive and endpoint name (default: %(default)s)")
    ap.add_argument("--version", default="1.0", help="model version recorded in the archive (default: %(default)s)")
    ap.add_argument("--force", action="store_true", help="overwrite an existing archive")
    args = ap.parse_args(argv)

    import torch

    from dlrmkit.accuracy import int8_calibration
    from dlrmkit.checkpoint import import_checkpoint, verify_archive, write_config
    from dlrmkit import dense
    from dlrmkit.dense import CALIBRATION_FILE
    from dlrmkit.config import DLRMConfig
    from dlrmkit.live import BASE_FILE, base_version
    from dlrmkit.errors import BadRequest, ConfigError
    from dlrmkit.model import DLRMFactory
    from dlrmkit.protocols import METADATA_FILE, model_metadata
    from scripts import as_worker

    order = [f.strip() for f in args.feature_order.split(",")] if args.feature_order else None
    if order is not None and not args.checkpoint:
        ap.error("--feature-order needs --checkpoint PATH")
    if args.fit_dense_shift:
        if not args.write_config:
            ap.error("--fit-dense-shift needs --write-config OUT.yaml")
        try:
            if args.checkpoint:
                write_config(args.checkpoint, args.write_config, feature_order=order)
            fit_dense_shift(
                args.fit_dense_shift, args.write_config if args.checkpoint else args.config, args.write_config
            )
        except (ConfigError, BadRequest) as e:
            sys.exit(f"error: {getattr(e, 'message', e)}")
        return Path(args.write_config)
    if args.write_config:
        if not args.checkpoint:
            ap.error("--write-config needs --checkpoint PATH")
        if args.verify:
            ap.error("--verify proves a built archive; --write-config builds nothing")
        try:
            write_config(args.checkpoint, args.write_config, feature_order=order)
        except ConfigError as e:
            sys.exit(f"error: {e}")
        return Path(args.write_config)
    out_dir = Path(args.output_dir)
    mar = out_dir / f"{args.model_name}.mar"
    if mar.exists() and not args.force:
        sys.exit(f"error: {mar} exists; pass --force to overwrite it")
    try:
        if args.calibrate and args.verify and Path(args.calibrate).resolve() == Path(args.verify).resolve():
            sys.exit(
                f"error: --calibrate {args.calibrate} is the --verify file: the contract would be judged on the "
                "rows the int8 scales were fitted to; calibrate on a sample of the training data "
                "(scripts/train.py writes calibration.jsonl); no archive written"
            )
        config = DLRMConfig.from_yaml(args.config)
        if config.build.dense_precision == "auto" and not args.verify:
            sys.exit(
                "error: handler.dense_precision: auto picks the fastest precision that keeps the accuracy contract, "
                "which only --verify FILE (labelled held-out rows, as scripts/train.py writes verify.jsonl) can judge: "
                "build with --verify, or set one (e.g. dense_precision: int8); no archive written"
            )
        if config.build.dense_precision == "auto":
            precision_config(Path(args.config).read_text(), "int8")  # the line the build will rewrite
        if (
            args.verify
            and config.build.dense_precision != "auto"
            and (cannot := dense.unsupported(config.build.dense_precision, dense.cpu_flags()))
        ):
            # The verify child would serve the fp32 fallback and prove nothing about the precision
            # the archive names (measured on an AVX2 host: int8 there moves a score by up to 0.45).
            sys.exit(
                f"error: --verify: dense_precision {config.build.dense_precision} cannot run on this CPU "
                f"({cannot}), so its accuracy contract cannot be checked here: verify on a CPU of the "
                f"serving kind, or build without --verify (unchecked); no archive written"
            )
        factory = DLRMFactory(config)
        with tempfile.TemporaryDirectory(prefix="dlrm-mar-") as tmp:
            weights = Path(tmp) / "dlrm.pt"
            started = time.perf_counter()
            if args.checkpoint:
                print(f"[build] checking {args.checkpoint} against {args.config}", flush=True)
                # Every key and shape is checked before any data is read; a file is memory-mapped, a
                # DCP directory read into one full-size tensor per key.
                model = factory.load_fp32(import_checkpoint(args.checkpoint, config, feature_order=order))
            else:
                print(
                    f"[build] random weights, seed {config.build.seed}: {sum(config.num_embeddings):,} rows "
                    f"x D={config.embedding_dim}",
                    flush=True,
                )
                model = factory.random()
            if config.build.embedding_dtype != "fp32":
                print(
                    f"[build] quantizing the tables to {config.build.embedding_dtype} (torchrec quantize_inference_model)",
                    flush=True,
                )
            precision = config.build.dense_precision
            auto = precision == "auto"
            extra, inputs = [], None
            if precision in ("int8", "auto") and (args.calibrate or not args.checkpoint):
                inputs, source = int8_calibration(model, config, args.calibrate)
                torch.save(inputs, calibration := Path(tmp) / CALIBRATION_FILE)
                extra.append(str(calibration))
                print(
                    f"[build] int8 dense half: static activation scales from {source} ({CALIBRATION_FILE})", flush=True
                )
            elif precision in ("int8", "auto"):
                print(
                    "[build] int8 dense half without --calibrate: activation scales per batch (dynamic int8)",
                    flush=True,
                )
            if precision != "fp32" and not args.verify:
                print(
                    f"[build] warning: dense_precision {precision} without --verify: the accuracy "
                    "contract (AUC >= 99.9% of fp32) is not checked for this archive",
                    flush=True,
                )
            # int8's plan (dlrmkit.dense.plan_int8): the sensitivity pass on the calibration rows
            plan = dense.plan_int8(model, config, inputs, log=print) if inputs is not None else None
            candidates = dense_candidates(precision, plan)
            timings: dict[str, float] = {}
            if auto:
                candidates, timings = fastest_first(model, config, candidates, inputs)
                print(
                    "[build] dense_precision auto: raw forward of 256 rows on this CPU: "
                    + ", ".join(f"{name} {timings[name]:.2f} ms" for name, _ in candidates)
                    + f"; tried fastest first under the contract: {', '.join(n for n, _ in candidates)}",
                    flush=True,
                )
            state = factory.archive_state(model)
            del model
            torch.save(state, weights)
            # The archive's identity, which live-update deltas name (dlrmkit/live/)
            (base := Path(tmp) / BASE_FILE).write_text(base_version(weights) + "\n")
            extra.append(str(base))
            print(
                f"[build] weights {weights.stat().st_size / 1e6:.1f} MB in {time.perf_counter() - started:.1f} s",
                flush=True,
            )
            refused: list[dict] = []
            for n, (name, cplan) in enumerate(candidates):
                served = "int8" if name == "mixed" else name  # mixed: int8 with the plan's fp32 layers
                stage = Path(tmp) / f"candidate-{n}"
                stage.mkdir()
                files = [f for f in extra if served == "int8" or not f.endswith(CALIBRATION_FILE)]
                config_file = Path(args.config).resolve()
                if auto:  # the worker never sees auto: the archive's config names what was chosen
                    config_file = stage / config_file.name
                    config_file.write_text(precision_config(Path(args.config).read_text(), served))
                facts: dict = {"precision": name}
                if auto:
                    facts["auto"] = {
                        "order": [c for c, _ in candidates],
                        "forward_ms_256_rows": timings,
                        "refused": refused,
                        "isa": dense.isa_summary(),
                    }
                if served == "int8" and cplan is not None:
                    facts.update(cplan)
                if served == "int8" and cplan is not None or auto:
                    (plan_file := stage / dense.PLAN_FILE).write_text(json.dumps(facts, indent=1))
                    files.append(str(plan_file))
                # The v2 metadata the OIP endpoint plugin serves, from the config just validated.
                meta = model_metadata(config)
                meta["parameters"] = {"dense_precision": served}  # what the dense half serves as
                if auto:
                    meta["parameters"]["dense_precision_chosen_from"] = "auto"
                    if name == "mixed":
                        meta["parameters"]["dense_fp32_layers"] = ",".join(cplan["keep"])
                (metadata := stage / METADATA_FILE).write_text(json.dumps(meta, indent=1))
                files.append(str(metadata))
                # Built beside the weights and moved into place only once proven: a failed --verify
                # leaves no archive, and an earlier one of the same name stays as it was.
                built = stage / "out"
                built.mkdir()
                archive(args, weights, config_file, [*extra_files(Path(tmp)), *files], built, tmp)
                if not args.verify:
                    break
                result = verify_archive(
                    built / mar.name,
                    args.verify,
                    as_worker.command(),
                    args.verify_tolerance,
                    precision=served,
                    logits=config.requests.output == "logits",
                    auc_ratio=args.auc_ratio,
                )
                if served != "fp32":
                    # Reduced precision moves every score a little: MLPerf's AUC rule is the gate,
                    # not the per-row tolerance.
                    if result.contract is None:
                        sys.exit(
                            f"error: --verify: dense_precision {precision} is checked by the "
                            f"accuracy contract (served AUC >= 99.9% of fp32), which needs labels on every "
                            f"line of {args.verify} (scripts/train.py writes them); no archive written"
                        )
                    c = result.contract
                    if c["holds"]:
                        if auto:
                            print(f"[build] dense_precision auto: {name} keeps the contract: serving {name}")
                        break
                    broken = (
                        f"dense_precision {name} breaks the accuracy contract: AUC {c['auc']:.6f} is "
                        f"{c['auc_ratio']:.5f} of fp32's {c['auc_fp32']:.6f} (needs >= {args.auc_ratio:g})"
                    )
                    if not auto:
                        sys.exit(
                            f"error: --verify: {broken}; serve a higher precision (dense_precision: auto serves the fastest that keeps it); no archive written"
                        )
                    print(f"[build] dense_precision auto: {broken}; trying the next", flush=True)
                    refused.append({"precision": name, **{k: c[k] for k in ("auc_ratio", "max_dp", "p99_dp")}})
                elif auto and config.build.embedding_dtype != "fp32" and result.auc:
                    # quantized tables move fp32's scores too: the contract judges, not the tolerance
                    served_auc, trainer_auc = result.auc
                    if served_auc < args.auc_ratio * trainer_auc:
                        sys.exit(
                            f"error: --verify: dense_precision auto: even fp32 breaks the accuracy contract with "
                            f"handler.embedding_dtype {config.build.embedding_dtype} (AUC {served_auc:.6f} vs the "
                            f"trainer's {trainer_auc:.6f}); serve higher-precision tables; no archive written"
                        )
                    print("[build] dense_precision auto: serving fp32")
                    break
                elif result.over:
                    sys.exit(
                        f"error: --verify: {result.over} of {result.rows} rows differ from the trainer's "
                        f"scores by more than {args.verify_tolerance:g} (worst {result.max_delta:.3g}, "
                        f"{result.worst}); no archive written. The usual causes: handler.sparse_features "
                        f"not in the trainer's order (--feature-order), pooling, output, or requests whose "
                        f"dense features are not preprocessed as in training (docs/trained-models.md)"
                    )
                else:
                    if auto:
                        print("[build] dense_precision auto: serving fp32")
                    break
            out_dir.mkdir(parents=True, exist_ok=True)
            shutil.move(built / mar.name, mar)
    except ConfigError as e:
        sys.exit(f"error: {e}")
    print(f"[build] {mar} ({mar.stat().st_size / 1e6:.1f} MB)")
    return mar


# dense_precision auto: the layers "mixed" keeps fp32, the costliest int8 first (plan_int8's ranking)
MIXED_KEEP = 3
# auto's raw forward: rows per forward and timed repeats (median), after the compile's warm-up
TIMED_ROWS, TIMED_REPEATS = 256, 7


def archive(args, weights: Path, config_file: Path, files: list[str], built: Path, tmp: str) -> None:
    """torch-model-archiver: ``weights``, the handler, ``files`` and ``config_file`` as
    ``built/<model name>.mar``."""
    cmd = [
        str(Path(sys.executable).parent / "torch-model-archiver"),
        "--model-name",
        args.model_name,
        "--version",
        args.version,
        "--handler",
        str(ROOT / "dlrm_handler.py"),
        "--serialized-file",
        str(weights),
        "--extra-files",
        ",".join(files),
        "--config-file",
        str(config_file),
        "--export-path",
        str(built),
        # Random floats do not compress; storing them makes building and loading faster.
        "--archive-format",
        "zip-store",
    ]
    if args.force:
        cmd.append("--force")
    # The archiver stages files in $TMPDIR/<model name>; a private TMPDIR keeps two builds
    # of the same model name on one machine (tests, benchmarks) from clobbering each other.
    subprocess.run(cmd, check=True, env={**os.environ, "TMPDIR": tmp})


def dense_candidates(precision: str, plan: dict | None) -> list[tuple[str, dict | None]]:
    """(name, int8 plan) per dense half the build may archive: ``precision`` itself, or for auto
    every one this CPU runs natively: int8 (the plan), mixed (int8 with the plan's ``MIXED_KEEP``
    costliest layers fp32, when there is a plan), bf16 and fp32."""
    from dlrmkit import dense

    if precision != "auto":
        return [(precision, plan)]
    out: list[tuple[str, dict | None]] = [("int8", plan)]
    if plan is not None and plan["ranked"][:MIXED_KEEP] != plan["keep"]:
        out.append(("mixed", {**plan, "keep": plan["ranked"][:MIXED_KEEP]}))
    out += [("bf16", None), ("fp32", None)]
    flags = dense.cpu_flags()
    return [(name, p) for name, p in out if dense.unsupported("int8" if name == "mixed" else name, flags) is None]


def fastest_first(model, config, candidates, calibration) -> tuple[list, dict[str, float]]:
    """``candidates`` ordered by their raw forward on this CPU (the whole model, ``TIMED_ROWS``
    rows on one thread, median of ``TIMED_REPEATS`` rounds over them all after a warm-up), and the
    milliseconds measured: the order
    auto tries them in. Tests replace this function (timing decides no test)."""
    import torch

    from dlrmkit import dense

    gen = torch.Generator().manual_seed(config.build.seed)
    from dlrmkit.model import DLRMFactory

    batch = DLRMFactory(config).probe_batch(TIMED_ROWS, gen)
    served = {}
    for name, plan in candidates:
        precision = "int8" if name == "mixed" else name
        served[name], _ = dense.compile_dense(
            model, config, precision, calibration if precision == "int8" else None, (TIMED_ROWS,), plan=plan
        )
    # Rounds over every candidate, so that a busy moment of a shared host costs each of them alike.
    runs: dict[str, list[float]] = {name: [] for name in served}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a worker runs under the CPU rule: one thread per worker per CPU
    with torch.inference_mode():
        for m in served.values():
            m(*batch)
        for _ in range(TIMED_REPEATS):
            for name, m in served.items():
                t = time.perf_counter()
                m(*batch)
                runs[name].append((time.perf_counter() - t) * 1e3)
    torch.set_num_threads(threads)
    timings = {name: sorted(r)[len(r) // 2] for name, r in runs.items()}
    return sorted(candidates, key=lambda c: timings[c[0]]), timings


def precision_config(text: str, precision: str) -> str:
    """A model config's text with handler.dense_precision: auto as ``precision`` (its other lines
    and comments kept), saying who chose it."""
    import re

    line = re.compile(r"^(\s+)dense_precision:\s*['\"]?auto['\"]?\s*(#.*)?$", re.M)
    if not line.search(text):
        from dlrmkit.errors import ConfigError

        raise ConfigError(
            "handler.dense_precision: auto must be a line of its own in the handler: section "
            "(e.g. '  dense_precision: auto') for the build to write the precision it chose there"
        )
    return line.sub(
        lambda m: f"{m.group(1)}dense_precision: {precision}  # auto: chosen by build_mar.py --verify", text, count=1
    )


def fit_dense_shift(files: list[str], config: str, out: str) -> float:
    """Fit dense_shift on each training file, write ``config`` with raw_input: criteo_tsv and
    the shift to ``out`` (its other lines and comments kept), say what each file got."""
    import re
    from collections import Counter

    from dlrmkit import criteo
    from dlrmkit.config import DLRMConfig
    from dlrmkit.errors import ConfigError

    shifts = {}
    for path in files:
        print(f"[fit] {path}", flush=True)
        shifts[path], lines = criteo.fit_dense_shift(
            path, progress=lambda n: print(f"[fit]   {n:,} lines", flush=True) if n >= 1_000_000 else None
        )
        print(f"[fit] {path}: {lines:,} lines, min dense {2 - shifts[path]}, dense_shift {shifts[path]}", flush=True)
    # tsv_to_npys shifts each file by its own minimum: a model trained on files that disagree saw
    # differently shifted days. The shift most files got is written; the others are named.
    shift = Counter(shifts.values()).most_common(1)[0][0]
    if len(set(shifts.values())) > 1:
        others = ", ".join(f"{p}: {s}" for p, s in shifts.items() if s != shift)
        print(
            f"[fit] warning: the files' shifts disagree (tsv_to_npys shifted each by its own minimum); writing "
            f"dense_shift {shift}, which {sum(s == shift for s in shifts.values())} of {len(shifts)} files got "
            f"(the others: {others})",
            flush=True,
        )
    text = Path(config).read_text()
    # Ids fold into their tables as torchrec's InMemoryBinaryCriteoIterDataPipe(hashes=...) does,
    # unless the config says otherwise.
    fold = [] if re.search(r"^\s+id_overflow:", text, re.M) else [("id_overflow", "modulo")]
    for key, value in (("raw_input", "criteo_tsv"), ("dense_shift", str(shift)), *fold):
        pattern = re.compile(rf"^(\s+){key}:.*$", re.M)
        if pattern.search(text):
            text = pattern.sub(lambda m, key=key, value=value: f"{m.group(1)}{key}: {value}", text, count=1)
        else:
            m = re.search(r"^handler:[^\n]*\n(\s+)", text, re.M)
            if not m:
                raise ConfigError(f"{config}: no handler: section to write dense_shift into")
            text = text[: m.end()] + f"{key}: {value}\n{m.group(1)}" + text[m.end() :]
    Path(out).write_text(text)
    written = DLRMConfig.from_yaml(out)
    print(
        f"[fit] wrote raw_input: criteo_tsv, dense_shift: {shift} to {out} (id_overflow: {written.requests.id_overflow})",
        flush=True,
    )
    return shift


if __name__ == "__main__":
    main()
