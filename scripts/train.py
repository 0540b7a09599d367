#!/usr/bin/env python
"""Train a small torchrec DLRM the way torchrec's DLRM example does, and save a DCP checkpoint.

    python scripts/train.py --out trained/                       # dot interaction, 2 ranks
    python scripts/train.py --out trained/ --interaction dcn --world-size 1
    python scripts/train.py --out trained/ --tsv day_0.tsv       # Criteo-format rows

The model is ``DLRMTrain(DLRM | DLRM_DCN | DLRM_Projection)`` with tables ``t_<feature>``, wrapped
in ``DistributedModelParallel`` over ``--world-size`` CPU processes (gloo). ``--out`` gets:

- ``checkpoint/``: ``torch.distributed.checkpoint.save`` of the DMP model's state_dict (the tables
  as ShardedTensor shards, one ``__<rank>_*.distcp`` file per rank, plus ``.metadata``);
- ``heldout.json``: held-out rows never trained on, as serving requests (``dense``, ``sparse``
  keys/values/lengths), their labels, and the trained model's own scores (sigmoid of the logit)
  computed here, in eval mode, through the same DMP model: what a server of this checkpoint must
  answer;
- ``verify.jsonl``: the same rows as ``build_mar.py --verify`` reads them, one ``instances``
  request of up to 100 rows a line with the trainer's scores and labels;
- ``calibration.jsonl``: the last 512 training rows as ``instances`` requests, for
  ``build_mar.py --calibrate`` (int8's static activation scales, fitted on rows --verify never judges).

Live updates (docs/live-updates.md): ``--resume DIR`` continues from a previous ``--out``'s
checkpoint (the one an archive was built from), and ``--publish-dir D --publish-every N
--publish-base B`` writes a delta (dlrmkit/live/) every N steps: the rows torchrec's delta
tracker saw looked up since the last one (ID_ONLY mode; their current values are read from the
local shards and gathered on rank 0) and every dense parameter. Publishing needs table-wise sharding.

Synthetic clicks (the default) carry a learnable signal: the click probability is
sigmoid(dense . w + sum over features of a per-id effect), with w and the effects drawn from
``--seed``; every rank draws the same stream and trains on its own slice of each batch.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent

from dlrmkit.accuracy import auc  # noqa: E402
from dlrmkit.dense import CALIBRATION_ROWS  # noqa: E402  (the rows --calibrate keeps)
from scripts.tsctl import free_port  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for checkpoint/, heldout.json and verify.jsonl")
    ap.add_argument(
        "--world-size", type=int, default=2, choices=[1, 2], help="trainer processes (default: %(default)s)"
    )
    ap.add_argument(
        "--sharding",
        default="table_wise",
        choices=["table_wise", "column_wise"],
        help="how DMP places the tables on the ranks (default: %(default)s)",
    )
    ap.add_argument(
        "--interaction",
        default="dot",
        choices=["dot", "dcn", "projection"],
        help="torchrec DLRM, DLRM_DCN or DLRM_Projection (default: %(default)s)",
    )
    ap.add_argument("--num-dense", type=int, default=13, help="dense features int_0.. (default: %(default)s)")
    ap.add_argument("--num-sparse", type=int, default=4, help="sparse features cat_0.. (default: %(default)s)")
    ap.add_argument(
        "--sparse-features",
        metavar="F1,F2,...",
        help="name the sparse features (tables t_<name>, in this order) instead of cat_0..",
    )
    ap.add_argument("--rows", type=int, default=100, help="rows per table (default: %(default)s)")
    ap.add_argument("--dim", type=int, default=8, help="embedding_dim D (default: %(default)s)")
    ap.add_argument(
        "--bag-size",
        type=int,
        default=1,
        metavar="K",
        help="synthetic clicks: ids per bag drawn uniformly from 1..K (multi-hot, sum-pooled; a bag's "
        "effect on the click is its ids' mean) (default: %(default)s, one id per feature)",
    )
    ap.add_argument("--dense-arch", default="32,8", help="dense arch sizes, last = D (default: %(default)s)")
    ap.add_argument("--over-arch", default="32,16,1", help="over arch sizes, last = 1 (default: %(default)s)")
    ap.add_argument("--dcn-num-layers", type=int, default=2, help="dcn: cross layers (default: %(default)s)")
    ap.add_argument("--dcn-low-rank-dim", type=int, default=4, help="dcn: low rank (default: %(default)s)")
    ap.add_argument("--branch1", default="16,8", help="projection: branch 1 sizes (default: %(default)s)")
    ap.add_argument("--branch2", default="16,8", help="projection: branch 2 sizes (default: %(default)s)")
    ap.add_argument(
        "--steps",
        type=int,
        default=300,
        help="training steps on synthetic clicks (a --tsv file is read once) (default: %(default)s)",
    )
    ap.add_argument("--batch-size", type=int, default=256, help="global batch per step (default: %(default)s)")
    ap.add_argument("--lr", type=float, default=0.05, help="Adagrad learning rate (default: %(default)s)")
    ap.add_argument("--heldout", type=int, default=1000, help="held-out rows (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="data and init seed (default: %(default)s)")
    ap.add_argument(
        "--tsv",
        help="Criteo-format TSV (label, 13 ints, 26 hex ids) instead of synthetic clicks, "
        "transformed as torchrec's tsv_to_npys does and as the handler serves raw lines (dlrmkit.criteo: "
        "dense ln(x + 2 - min), ids int(hex, 16) %% rows); the last --heldout lines are held out and "
        "saved raw in heldout.json (lines, dense_shift)",
    )
    ap.add_argument(
        "--resume", metavar="DIR", help="start from DIR/checkpoint (a previous --out) instead of a fresh init"
    )
    ap.add_argument("--publish-dir", metavar="D", help="write live-update deltas into D (docs/live-updates.md)")
    ap.add_argument("--publish-every", type=int, default=10, metavar="N", help="steps per delta (default: %(default)s)")
    ap.add_argument("--publish-base", metavar="B", help="the served archive's base version (its delta-base.txt)")
    ap.add_argument("--publish-model", default="dlrm", help="the served model's name (default: %(default)s)")
    args = ap.parse_args(argv)
    if args.publish_dir and not args.publish_base:
        ap.error("--publish-dir needs --publish-base (the served archive's delta-base.txt)")
    if args.publish_dir and args.sharding != "table_wise":
        ap.error("--publish-dir reads each table whole from its rank: use --sharding table_wise")
    args.dense_arch = [int(x) for x in args.dense_arch.split(",")]
    args.over_arch = [int(x) for x in args.over_arch.split(",")]
    args.branch1 = [int(x) for x in args.branch1.split(",")]
    args.branch2 = [int(x) for x in args.branch2.split(",")]
    if args.tsv:
        args.num_dense, args.num_sparse = 13, 26
    args.sparse_features = args.sparse_features.split(",") if args.sparse_features else None
    if args.sparse_features and len(args.sparse_features) != args.num_sparse:
        if args.tsv:
            ap.error(f"--tsv rows have 26 sparse features, --sparse-features names {len(args.sparse_features)}")
        args.num_sparse = len(args.sparse_features)
    if args.bag_size < 1 or (args.tsv and args.bag_size != 1):
        ap.error("--bag-size must be >= 1, and 1 with --tsv (Criteo rows have one id per feature)")
    if args.dense_arch[-1] != args.dim:
        ap.error(f"--dense-arch must end in --dim ({args.dim}), got {args.dense_arch}")
    return args


def features(args) -> tuple[list[str], list[str]]:
    """torchrec's Criteo names: dense int_0.., sparse cat_0.. (tables t_cat_0..) or --sparse-features."""
    return [f"int_{i}" for i in range(args.num_dense)], args.sparse_features or [
        f"cat_{i}" for i in range(args.num_sparse)
    ]


class Clicks:
    """Rows as (dense [N, num_dense], ids [N, F, K] with lengths [N, F] in 1..K (K = --bag-size;
    ids past a bag's length unused), labels [N])."""

    def __init__(self, args):
        self.args = args
        if args.tsv:
            self.dense, ids, self.labels = self._read_tsv(Path(args.tsv))
            self.ids, self.lengths = ids.unsqueeze(-1), torch.ones(ids.shape, dtype=torch.int64)
            return
        n = args.steps * args.batch_size + args.heldout
        gen = torch.Generator().manual_seed(args.seed)
        w = torch.randn(args.num_dense, generator=gen) / math.sqrt(args.num_dense)
        effect = torch.randn(args.num_sparse, args.rows, generator=gen)
        self.dense = torch.randn(n, args.num_dense, generator=gen)
        k = args.bag_size
        self.ids = torch.randint(
            0, args.rows, (n, args.num_sparse, k) if k > 1 else (n, args.num_sparse), generator=gen
        )
        if k == 1:  # the one-id stream as it always was (same seed, same rows)
            self.ids, self.lengths = self.ids.unsqueeze(-1), torch.ones(n, args.num_sparse, dtype=torch.int64)
        else:
            self.lengths = torch.randint(1, k + 1, (n, args.num_sparse), generator=gen)
        used = (torch.arange(k) < self.lengths.unsqueeze(-1)).float()
        per_id = effect.gather(1, self.ids.permute(1, 0, 2).reshape(args.num_sparse, -1)).view(args.num_sparse, n, k)
        bag = (per_id * used.permute(1, 0, 2)).sum(-1) / self.lengths.T  # [F, N]: each bag's mean effect
        logit = 1.5 * (self.dense @ w + bag.sum(0) / math.sqrt(args.num_sparse))
        self.labels = torch.bernoulli(torch.sigmoid(logit), generator=gen)

    def _read_tsv(self, path: Path):
        """The file through the handler's own transform, shifted by the file's minimum as
        tsv_to_npys does (``self.dense_shift``); the held-out lines kept raw in ``self.lines``."""
        from dlrmkit import criteo

        parsed = criteo.read_file(path)
        self.dense_shift = criteo.MIN_SHIFTED - int(parsed.dense.min())
        dense, _ = criteo.dense_features(parsed.dense, self.dense_shift)
        self.lines = path.read_text().rstrip("\r\n").split("\n")[-self.args.heldout :]
        return (
            torch.from_numpy(dense),
            torch.from_numpy(parsed.ids % self.args.rows),
            torch.from_numpy(parsed.labels.clip(0)).float(),
        )

    def sparse_row(self, row: int, sparse_names: list[str]) -> dict:
        """Row ``row``'s sparse features as a request row's ``{"keys", "values", "lengths"}``."""
        lengths = self.lengths[row].tolist()
        values = [i for f, n in enumerate(lengths) for i in self.ids[row, f, :n].tolist()]
        return {"keys": sparse_names, "values": values, "lengths": lengths}

    def __len__(self) -> int:
        return len(self.labels)

    def batch(self, lo: int, hi: int, sparse_names: list[str]):
        """Rows lo..hi as DLRMTrain's input: dense [B, num_dense], a KJT (key-major), labels [B]."""
        from torchrec.datasets.utils import Batch
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        ids, lengths = self.ids[lo:hi].transpose(0, 1), self.lengths[lo:hi].T  # [F, B, K], [F, B]
        kjt = KeyedJaggedTensor(
            keys=sparse_names,
            values=ids[torch.arange(ids.shape[-1]) < lengths.unsqueeze(-1)],  # key-major, each bag's ids
            lengths=lengths.reshape(-1),
        )
        return Batch(dense_features=self.dense[lo:hi], sparse_features=kjt, labels=self.labels[lo:hi])


def build_model(args, sparse_names: list[str]):
    from torchrec.models.dlrm import DLRM, DLRM_DCN, DLRM_Projection, DLRMTrain
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    tables = [
        EmbeddingBagConfig(name=f"t_{f}", embedding_dim=args.dim, num_embeddings=args.rows, feature_names=[f])
        for f in sparse_names
    ]
    # Tables on meta: DMP allocates each shard on its rank (torchrec's example does the same).
    common = dict(
        embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
        dense_in_features=args.num_dense,
        dense_arch_layer_sizes=args.dense_arch,
        over_arch_layer_sizes=args.over_arch,
        dense_device=torch.device("cpu"),
    )
    if args.interaction == "dcn":
        model = DLRM_DCN(**common, dcn_num_layers=args.dcn_num_layers, dcn_low_rank_dim=args.dcn_low_rank_dim)
    elif args.interaction == "projection":
        model = DLRM_Projection(
            **common, interaction_branch1_layer_sizes=args.branch1, interaction_branch2_layer_sizes=args.branch2
        )
    else:
        model = DLRM(**common)
    return DLRMTrain(model)


def worker(rank: int, args, port: int) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.types import ShardingType
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import KeyedOptimizerWrapper

    torch.manual_seed(args.seed)  # the same dense init on every rank (DDP also broadcasts it)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world_size)
    log = (lambda msg: print(f"[train] {msg}", flush=True)) if rank == 0 else (lambda msg: None)
    dense_names, sparse_names = features(args)
    data = Clicks(args)
    train_rows = len(data) - args.heldout
    model = build_model(args, sparse_names)
    # The tables learn in the backward pass (fused Adagrad in fbgemm's CPU kernels), as in torchrec's example.
    apply_optimizer_in_backward(torch.optim.Adagrad, model.model.sparse_arch.parameters(), {"lr": args.lr})
    # table_wise: each table whole on one rank; column_wise: each table split along D across the
    # ranks (min_partition 4), so every DCP file holds a slice of every table. Row-wise and
    # table-row-wise are not offered on CPU: torchrec's planner finds "no available sharding type
    # and compute kernel combination" for them with fbgemm-gpu-cpu.
    kind = {"table_wise": ShardingType.TABLE_WISE, "column_wise": ShardingType.COLUMN_WISE}[args.sharding]
    constraints = {f"t_{f}": ParameterConstraints(sharding_types=[kind.value], min_partition=4) for f in sparse_names}
    sharders = [EmbeddingBagCollectionSharder()]
    plan = EmbeddingShardingPlanner(
        topology=Topology(world_size=args.world_size, compute_device="cpu"),
        constraints=constraints,
    ).collective_plan(model, sharders, dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=sharders)
    dense_opt = KeyedOptimizerWrapper(dict(dmp.named_parameters()), lambda ps: torch.optim.Adagrad(ps, lr=args.lr))
    if args.resume:
        state = dmp.state_dict()
        dcp.load(state, checkpoint_id=Path(args.resume) / "checkpoint")
        dmp.load_state_dict(state)
        log(f"resumed from {Path(args.resume) / 'checkpoint'}")
    publish = None
    if args.publish_dir:
        from torchrec.distributed.model_tracker.types import DeltaTrackerConfig, TrackingMode

        dmp.init_torchrec_delta_tracker(DeltaTrackerConfig(tracking_mode=TrackingMode.ID_ONLY, delete_on_read=True))
        publish = Publisher(args, dmp, rank, log)
    per_rank = args.batch_size // args.world_size
    started = time.perf_counter()
    dmp.train()
    steps = train_rows // args.batch_size
    for step in range(steps):
        lo = step * args.batch_size + rank * per_rank
        loss, _ = dmp(data.batch(lo, lo + per_rank, sparse_names))  # DLRMTrain: (loss, (loss, logits, labels))
        dense_opt.zero_grad()
        loss.backward()
        dense_opt.step()
        if publish and ((step + 1) % args.publish_every == 0 or step == steps - 1):
            publish(step + 1)
        if step % max(1, steps // 5) == 0 or step == steps - 1:
            log(f"step {step + 1}/{steps}: loss {loss.item():.4f}")
    log(
        f"trained {steps} steps of {args.batch_size} rows on {args.world_size} rank(s) "
        f"in {time.perf_counter() - started:.1f} s"
    )

    # Every rank scores the whole held-out set (each rank's local batch), so rank 0 holds all of it.
    dmp.eval()
    with torch.no_grad():
        batch = data.batch(train_rows, len(data), sparse_names)
        _, (_, logits, _) = dmp(batch)
    dense, labels = batch.dense_features, batch.labels
    scores = torch.sigmoid(logits.squeeze(-1))
    out = Path(args.out)
    dcp.save(dmp.state_dict(), checkpoint_id=out / "checkpoint")
    if rank == 0:
        rows = [
            {"dense": d, "sparse": data.sparse_row(r, sparse_names)} for r, d in enumerate(dense.tolist(), train_rows)
        ]
        doc = {
            "dense_features": dense_names,
            "sparse_features": sparse_names,
            "interaction": args.interaction,
            "rows": rows,
            "labels": labels.tolist(),
            "scores": scores.tolist(),
            "auc": auc(scores, labels),
        }
        if args.tsv:  # what a server with raw_input: criteo_tsv is sent, and the shift it needs
            doc.update(lines=[line.rstrip("\r") for line in data.lines], dense_shift=data.dense_shift)
        (out / "heldout.json").write_text(json.dumps(doc))
        (out / "verify.jsonl").write_text(
            "".join(
                json.dumps(
                    {
                        "request": {"instances": rows[i : i + 100]},
                        "scores": doc["scores"][i : i + 100],
                        "labels": doc["labels"][i : i + 100],
                    }
                )
                + "\n"
                for i in range(0, len(rows), 100)
            )
        )
        # The last training rows as /predictions bodies: build_mar.py --calibrate's sample for int8's
        # static scales, disjoint from the held-out rows --verify judges the contract on.
        lo = max(0, train_rows - CALIBRATION_ROWS)
        sample = data.batch(lo, train_rows, sparse_names)
        calib = [
            {"dense": d, "sparse": data.sparse_row(r, sparse_names)}
            for r, d in enumerate(sample.dense_features.tolist(), lo)
        ]
        (out / "calibration.jsonl").write_text(
            "".join(json.dumps({"instances": calib[i : i + 128]}) + "\n" for i in range(0, len(calib), 128))
        )
        log(
            f"held-out AUC {doc['auc']:.4f} on {len(rows)} rows; saved {out / 'checkpoint'} "
            f"(DCP, {args.world_size} rank(s)), {out / 'heldout.json'}, {out / 'verify.jsonl'} and "
            f"{out / 'calibration.jsonl'} ({len(calib)} training rows)"
        )
    dist.destroy_process_group()


class Publisher:
    """Every --publish-every steps: the tables' rows looked up since the last delta (torchrec's delta
    tracker, ID_ONLY: EMBEDDING mode is refused for the sharded EBC, so the rows are read from the
    local shards), gathered on rank 0 with every dense parameter and written as the next delta."""

    PREFIX = "model.sparse_arch.embedding_bag_collection.embedding_bags."

    def __init__(self, args, dmp, rank: int, log):
        from dlrmkit.live import next_sequence

        self.args, self.dmp, self.rank, self.log = args, dmp, rank, log
        self.sequence = next_sequence(args.publish_dir)

    def __call__(self, step: int) -> None:
        import torch.distributed as dist

        from dlrmkit.live import write_delta

        stepped = time.time()  # the step is done: freshness lag counts from here
        tracked = self.dmp.get_delta_tracker().get_unique()
        state = self.dmp.state_dict()
        mine = {}
        for fqn, unique in tracked.items():
            shards = state[f"{fqn}.weight"].local_shards()
            if shards and len(unique.ids):  # table-wise: the owning rank holds the whole table
                ids = unique.ids.to(torch.int64)
                mine[fqn[len(self.PREFIX) + 2 :]] = (ids, shards[0].tensor[ids].detach().clone())  # t_<f> -> f
        gathered = [None] * self.args.world_size
        dist.all_gather_object(gathered, mine)
        if self.rank != 0:
            return
        tables = {t: rows for part in gathered for t, rows in part.items()}
        dense = {k[len("model.") :]: v for k, v in state.items() if not k.startswith(self.PREFIX)}
        path = write_delta(
            self.args.publish_dir,
            self.args.publish_model,
            self.args.publish_base,
            self.sequence,
            tables,
            dense,
            extra={"step": str(step), "step_time": repr(stepped)},
        )
        self.log(f"step {step}: delta {path.name}, {sum(len(i) for i, _ in tables.values())} rows")
        self.sequence += 1


def main(argv=None) -> Path:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.world_size == 1:
        worker(0, args, port)
    else:
        torch.multiprocessing.spawn(worker, args=(args, port), nprocs=args.world_size, join=True)
    return out


if __name__ == "__main__":
    main()
    sys.exit(0)
