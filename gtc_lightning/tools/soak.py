"""``python -m gtc_lightning.tools.soak``: a long run that checks the replicas stay bit-identical.

Trains the recipe's acoustic DNN (or ``--model LxH:K``) with each strategy that promises identical
replicas (``gtc``, ``gtc_stale``, ``ddp``, ``ddp_bf16``) for ``--steps`` optimizer steps on 2 (``--world``)
forked CPU ranks, on a fixed set of random frames labelled by a random teacher (cycled, so that the
loss keeps falling and the gradients stay realistic). Every ``--every`` steps each rank hashes its
parameters (SHA-256 of the bytes) and the ranks compare the hashes; a difference is recorded with
its step (and the run goes on, so that the report says whether it persists). Writes a JSON report
and prints one line per strategy: steps, checks, mismatches, wall time, first and last loss.

Example (the README's run)::

    python -m gtc_lightning.tools.soak --steps 10000 --every 100 --out exp/soak/report.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path

from gtc_lightning.tools.bench_step import INPUT_DIM, free_port, make_dnn, make_strategy, parse_model

IDENTICAL = ("gtc", "gtc_stale", "ddp", "ddp_bf16")  # the strategies that promise identical replicas


def _soak_one(args, name: str) -> dict:
    import lightning as L
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    spec = parse_model(args.model)
    outputs = spec[2]
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(args.batches * args.batch, INPUT_DIM, generator=g)
    teacher = torch.randn(INPUT_DIM, outputs, generator=g)
    y = (x @ teacher).argmax(dim=1)
    start = time.monotonic()

    class ReplicaCheck(L.Callback):
        def __init__(self):
            self.checks = 0
            self.mismatches: list[int] = []
            self.losses: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            step = trainer.global_step
            if step == args.perturb_at and trainer.global_rank == 1:  # for the test: a replica that drifts
                with torch.no_grad():
                    next(pl_module.parameters()).view(-1)[0] += 1e-3
            if step % args.every and step != args.steps:
                return
            flat = torch.cat([p.detach().reshape(-1) for p in pl_module.parameters()])
            digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()
            hashes = [None] * dist.get_world_size()
            dist.all_gather_object(hashes, digest)
            self.checks += 1
            if len(set(hashes)) != 1:
                self.mismatches.append(step)
            self.losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))
            if trainer.global_rank == 0 and args.progress and step % args.progress == 0:
                print(f"soak {name}: step {step}/{args.steps}, {self.checks} checks, "
                      f"{len(self.mismatches)} mismatches, loss {self.losses[-1]:.3f}, "
                      f"{time.monotonic() - start:.0f} s", flush=True)  # fmt: skip

    check = ReplicaCheck()
    trainer = L.Trainer(
        accelerator="cpu", devices=args.world, strategy=make_strategy(name, args.tau, "auto"),
        max_steps=args.steps, max_epochs=-1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[check], use_distributed_sampler=True,
    )  # fmt: skip
    data = DataLoader(TensorDataset(x, y), batch_size=args.batch, shuffle=False)
    trainer.fit(make_dnn(spec, args.lr), data)
    stats = getattr(trainer.strategy, "gtc_stats", None)
    return {
        "strategy": name,
        "steps": trainer.global_step,
        "checks": check.checks,
        "mismatches": check.mismatches,
        "identical": not check.mismatches,
        "wall_s": round(time.monotonic() - start, 1),
        "first_loss": check.losses[0] if check.losses else None,
        "last_loss": check.losses[-1] if check.losses else None,
        "gtc": {k: stats["total"][k] for k in ("sparse_steps", "dense_steps", "skips", "ratio_fp32")}
        if stats and stats.get("total") else None,
    }  # fmt: skip


def _rank_main(local_rank: int, args, port: int) -> None:
    import torch

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODE_RANK="0", LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(args.world), OMP_NUM_THREADS=str(args.threads),
    )  # fmt: skip
    torch.set_num_threads(args.threads)
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("gtc_lightning").setLevel(logging.WARNING)
    report = {"args": vars(args), "runs": []}
    for name in args.strategies:
        report["runs"].append(_soak_one(args, name))
        if local_rank == 0:  # after every strategy, so that a stopped soak keeps what it measured
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(report, indent=1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategies", nargs="+", default=["gtc"], choices=IDENTICAL,
                   help="strategies that promise identical replicas (default gtc)")
    p.add_argument("--steps", type=int, default=10_000, help="optimizer steps per strategy (default 10000)")
    p.add_argument("--every", type=int, default=100, help="steps between replica checks (default 100)")
    p.add_argument("--model", default="recipe", help="recipe (5 x 512, 150 outputs), strom or LxH:K")
    p.add_argument("--batch", type=int, default=256, help="frames per rank and step (default 256)")
    p.add_argument("--batches", type=int, default=64, help="distinct batches in the cycled data (default 64)")
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--tau", type=float, default=0.01)
    p.add_argument("--world", type=int, default=2, help="ranks forked on this machine (default 2)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--progress", type=int, default=1000, help="print a line every N steps (0: none)")
    p.add_argument("--out", default="exp/soak/report.json")
    p.add_argument("--perturb-at", type=int, default=None, help=argparse.SUPPRESS)  # tests: rank 1 drifts there
    args = p.parse_args(argv)
    if args.steps < 1 or args.every < 1 or args.world < 2 or args.batches < args.world:
        p.error(f"need --steps >= 1, --every >= 1, --world >= 2, --batches >= --world; got {args.steps}, "
                f"{args.every}, {args.world}, {args.batches}")  # fmt: skip
    parse_model(args.model)
    import torch.multiprocessing as mp

    mp.start_processes(_rank_main, args=(args, free_port()), nprocs=args.world, start_method="fork")
    report = json.loads(Path(args.out).read_text())
    ok = True
    for run in report["runs"]:
        ok &= run["identical"] and run["steps"] == args.steps
        first = "none" if run["identical"] else f"first at step {run['mismatches'][0]}"
        print(f"{run['strategy']}: {run['steps']} steps, {run['checks']} replica checks, "
              f"{len(run['mismatches'])} mismatches ({first}), loss {run['first_loss']:.3f} -> "
              f"{run['last_loss']:.3f}, {run['wall_s']:.0f} s")  # fmt: skip
    print(f"report: {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
