"""Compressed block syncs side by side: held-out loss and bytes of ``sparseloco`` (1-bit, 2-bit and
float32 values) against dense block syncs (``bmuf`` without outer momentum, DiLoCo's outer step) and
DDP, on the model suite's transformer LM (AdamW inner steps, warm-up + cosine), forked CPU ranks.

    python -m gtc_lightning.tools.bench_sparseloco --steps 300 --period 10 --seeds 0 1

Every run is a ``Trainer.fit`` of the same seeded model on the same samples; ``steps`` is a multiple of
``period`` so that every block method ends on a sync, with bit-identical replicas (checked; with
``fragments=2`` the part synced first keeps each rank's last half-period, so they differ), and rank 0
scores the suite's held-out set. Bytes are what each rank put on the wire for the model (the strategy's
``sync_stats``; DDP: a fp32 ring all-reduce of the gradient each step); "per sync" divides them by the
syncs, against one dense fp32 ring all-reduce of the model. Writes ``results.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy

from gtc_lightning import BMUFStrategy, SparseLoCoStrategy
from gtc_lightning.algorithms.common import allreduce_bytes, parameter_checksums
from gtc_lightning.tools.model_suite import restore_environment
from gtc_lightning.tools.suite_models import TransformerLM, heldout_loss

TIMEOUT = timedelta(seconds=300)


def methods(period: int, density: float) -> dict:
    """name -> a function of ``(start_method, timeout)`` building the strategy."""
    sparse = {"period": period, "density": density}
    return {
        "ddp": lambda **kw: DDPStrategy(**kw),
        "bmuf_plain": lambda **kw: BMUFStrategy(period=period, block_momentum=0.0, block_lr=1.0, **kw),
        "diloco": lambda **kw: BMUFStrategy(
            period=period, block_momentum=0.9, block_lr=0.7, nesterov=True, **kw
        ),
        "sparseloco_2bit": lambda **kw: SparseLoCoStrategy(values="2bit", **sparse, **kw),
        "sparseloco_sign": lambda **kw: SparseLoCoStrategy(values="sign", **sparse, **kw),
        "sparseloco_float32": lambda **kw: SparseLoCoStrategy(values="float32", **sparse, **kw),
        "sparseloco_2bit_diloco_outer": lambda **kw: SparseLoCoStrategy(
            values="2bit", block_momentum=0.9, block_lr=0.7, **sparse, **kw
        ),
        # Streaming DiLoCo's options: the exchange one sync interval late, and the model in 2 parts in turn.
        "diloco_overlap": lambda **kw: BMUFStrategy(
            period=period, block_momentum=0.9, block_lr=0.7, nesterov=True, overlap=True, **kw
        ),
        "diloco_2parts_overlap": lambda **kw: BMUFStrategy(
            period=period, block_momentum=0.9, block_lr=0.7, nesterov=True, fragments=2, overlap=True, **kw
        ),
        "sparseloco_2bit_overlap": lambda **kw: SparseLoCoStrategy(values="2bit", overlap=True, **sparse, **kw),
        "sparseloco_2bit_2parts_overlap": lambda **kw: SparseLoCoStrategy(
            values="2bit", fragments=2, overlap=True, **sparse, **kw
        ),
    }


class Probe(L.Callback):
    """Every rank writes its bytes, syncs, words and parameter checksum; rank 0 the held-out loss."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir

    def on_train_end(self, trainer, pl_module):
        strategy = trainer.strategy
        numel = sum(p.numel() for p in pl_module.parameters() if p.requires_grad)
        total = strategy.sync_stats["total"] if hasattr(strategy, "sync_stats") else None
        record = {
            "numel": numel,
            "bytes_sent": total["bytes_sent"]
            if total
            else trainer.global_step * allreduce_bytes(numel, trainer.world_size),
            "syncs": total["syncs"] if total else trainer.global_step,
            "words": total.get("words", 0) if total else 0,
            "checksum": parameter_checksums(pl_module.parameters()).tolist(),
            "loss": heldout_loss(pl_module) if trainer.global_rank == 0 else None,
        }
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def run(method: str, build, world: int, seed: int, steps: int, out: Path) -> dict:
    run_dir = out / "runs" / f"{method}-s{seed}"
    run_dir.mkdir(parents=True, exist_ok=True)
    with restore_environment("MASTER_PORT", "PL_GLOBAL_SEED"):
        L.seed_everything(seed, verbose=False)
        model = TransformerLM(train_size=steps * 16 * world, seed=seed, steps=steps)
        trainer = L.Trainer(
            accelerator="cpu", devices=world, strategy=build(start_method="fork", timeout=TIMEOUT),
            max_steps=steps, max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, num_sanity_val_steps=0, callbacks=[Probe(run_dir)], default_root_dir=run_dir,
        )  # fmt: skip
        start = time.perf_counter()
        trainer.fit(model)
        wall = time.perf_counter() - start
    ranks = [json.loads((run_dir / f"rank{r}.json").read_text()) for r in range(world)]
    numel = ranks[0]["numel"]
    sent = statistics.mean(r["bytes_sent"] for r in ranks)
    syncs = ranks[0]["syncs"]
    return {
        "method": method,
        "seed": seed,
        "world": world,
        "steps": steps,
        "numel": numel,
        "best_loss": model.task.best_loss,
        "loss": ranks[0]["loss"],
        "bytes_per_rank": sent,
        "syncs": syncs,
        "bytes_per_sync": sent / syncs,
        "dense_sync_bytes": allreduce_bytes(numel, world),
        "fewer_than_ddp": steps * allreduce_bytes(numel, world) / sent,
        "words_per_sync": statistics.mean(r["words"] for r in ranks) / syncs,
        "replicas_identical": all(r["checksum"] == ranks[0]["checksum"] for r in ranks),
        "wall_s": wall,
    }


def table(results: list[dict]) -> str:
    """Means over seeds per method: held-out loss (and per seed), bytes per sync and ratios."""
    lines = [
        (
            "| method | held-out loss (mean; per seed) | bytes/rank/sync | vs a dense fp32 sync "
            "| fewer bytes than DDP | bits a word | replicas identical |"
        ),
        "|---|---|---|---|---|---|---|",
    ]
    for method in dict.fromkeys(r["method"] for r in results):
        rows = [r for r in results if r["method"] == method]
        loss = statistics.mean(r["loss"] for r in rows)
        per_sync = statistics.mean(r["bytes_per_sync"] for r in rows)
        dense = rows[0]["dense_sync_bytes"]
        words = statistics.mean(r["words_per_sync"] for r in rows)
        bits = (
            f"{8 * (per_sync - 48 * (rows[0]['world'] - 1)) / words / (rows[0]['world'] - 1):.1f}"
            if words
            else "–"
        )
        seeds = ", ".join(f"{r['loss']:.4f}" for r in rows)
        lines.append(
            f"| {method} | {loss:.4f} ({seeds}) | {per_sync:,.0f} | {dense / per_sync:.0f}x fewer | "
            f"{statistics.mean(r['fewer_than_ddp'] for r in rows):.0f}x | {bits} | "
            f"{all(r['replicas_identical'] for r in rows)} |"
        )
    best = results[0]["best_loss"]
    return "\n".join(lines) + f"\n\nbest possible loss {best:.4f}; {results[0]['numel']:,} parameters"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--steps", type=int, default=300, help="optimizer steps per run (a multiple of --period)"
    )
    parser.add_argument("--period", type=int, default=10, help="local steps per block")
    parser.add_argument("--density", type=float, default=1 / 64, help="sparseloco's density")
    parser.add_argument("--world", type=int, default=2, help="ranks")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--methods", nargs="+", default=None, help=f"default: all of {list(methods(1, 0.1))}")
    parser.add_argument("--out", type=Path, default=Path("bench_sparseloco"))
    args = parser.parse_args(argv)
    if args.steps % args.period:
        parser.error(
            f"--steps {args.steps} is not a multiple of --period {args.period}: end every run on a sync"
        )
    torch.set_num_threads(1)  # forked ranks: single-threaded parent (GNU OpenMP is not fork-safe)
    builders = methods(args.period, args.density)
    chosen = args.methods or list(builders)
    unknown = sorted(set(chosen) - set(builders))
    if unknown:
        parser.error(f"unknown methods {unknown}; choose from {list(builders)}")
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for seed in args.seeds:
        for method in chosen:
            results.append(run(method, builders[method], args.world, seed, args.steps, args.out))
            print(
                f"{method} seed {seed}: loss {results[-1]['loss']:.4f}, {results[-1]['wall_s']:.0f} s",
                flush=True,
            )
            (args.out / "results.json").write_text(json.dumps(results, indent=1))
    print(table(results))


if __name__ == "__main__":
    main()
