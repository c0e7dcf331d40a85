"""GTC across HSDP's replicate dimension against plain HSDP, side by side on forked CPU ranks.

The model suite's transformer (:class:`~gtc_lightning.tools.suite_models.TransformerLM`), each encoder
layer an FSDP2 module and the rest in the root's, trained on ``replicas x shards`` gloo ranks by:

- ``hsdp``: plain HSDP, torch's own: ``fully_shard`` on the 2-D mesh, FSDP all-reduces each gradient
  shard across the replicate dimension (fp32, dense), through Lightning's ``ModelParallelStrategy``
  with every rank a data-parallel worker;
- ``gtc_hsdp``: :class:`~gtc_lightning.strategies.hsdp.GTCHSDPStrategy` at its defaults (automatic tau
  at a density of 1e-2, Rice coding, Strom's gradient mode), ``fully_shard`` on the shard dimension;
- ``gtc_hsdp_update``: the same with ``compress="update"`` (each replica's optimizer step compressed);
- ``gtc_ddp``: no sharding at all, :class:`~gtc_lightning.strategies.gtc.GTCStrategy` at its defaults over
  every rank (DDP's replicas of the whole model, GTC across all of them).

Both see the same samples in the same order (seeded), the same initial weights and schedule. Per run:
the held-out loss at the end, the bytes each rank sent across the replicate dimension (a dense run: the
ring all-reduce's ``2 (R-1)/R * 4`` bytes per element of its padded shard and step), the median step time,
GTC's own state per rank (bytes, and per element of the rank's shard), the model's state per rank
(parameters, gradients and optimizer state, local shards), and the peak RSS.

    python -m gtc_lightning.tools.bench_hsdp --seeds 0 1 2 --steps 200 --optimizers adamw sgd \\
        --densities 0.01 0.04 --out docs/benchmarks/hsdp
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import statistics
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method

from gtc_lightning.algorithms.common import allreduce_bytes
from gtc_lightning.strategies.gtc import GTCStrategy
from gtc_lightning.strategies.hsdp import GTCHSDPStrategy, ShardedResultsLauncher
from gtc_lightning.tools.model_suite import TIMEOUT, own_memory_bytes, quiet_lightning, restore_environment
from gtc_lightning.tools.suite_models import TransformerLM, heldout_loss

METHODS = ("hsdp", "gtc_hsdp", "gtc_hsdp_update", "gtc_ddp")


class ShardedTransformerLM(TransformerLM):
    """The suite's transformer with ``configure_model``: each encoder layer, then the root, sharded
    on the shard dimension (``gtc_hsdp``) or on the whole 2-D mesh (torch's HSDP, ``hsdp``)."""

    def __init__(self, *args, optimizer: str = "adamw", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.optimizer = optimizer

    def configure_model(self) -> None:
        if self._device_mesh is None:  # gtc_ddp: the whole model on every rank
            return
        mesh = self.device_mesh
        if "shard" in mesh.mesh_dim_names:
            mesh = mesh["shard"]
        for layer in self.blocks.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self, mesh=mesh)
        register_fsdp_forward_method(self, "loss")  # the suite calls loss(), not forward()

    def configure_optimizers(self):
        if self.optimizer == "adamw":
            return super().configure_optimizers()
        opt = torch.optim.SGD(self.parameters(), lr=self.lr * 100, momentum=0.9, weight_decay=self.weight_decay / 100)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / self.steps)))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class _NativeHSDP(ModelParallelStrategy):
    """Lightning's FSDP2 strategy on a (replicate, shard) mesh, every rank a data-parallel worker (as
    under GTC), started by fork."""

    @property
    def distributed_sampler_kwargs(self):
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def _configure_launcher(self) -> None:
        self._launcher = ShardedResultsLauncher(self, start_method="fork")


class HSDPProbe(L.Callback):
    """Every rank: step times, bytes across the replicate dimension, memory; the held-out loss at the end
    (every rank evaluates: FSDP's forward needs them all); writes ``rank{r}.json``."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = Path(out_dir)
        self.step_seconds: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._started = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.step_seconds.append(time.perf_counter() - self._started)

    def on_train_end(self, trainer, pl_module):
        strategy = trainer.strategy
        sharded = getattr(strategy, "device_mesh", None) is not None
        replicas = strategy.device_mesh.size(0) if sharded else trainer.world_size
        local = [p.to_local() if hasattr(p, "to_local") else p for p in pl_module.parameters()]
        shard_numel = sum(t.numel() for t in local)
        padded = sum(  # what the reduce-scatter hands each rank per module and step (FSDP pads dim 0)
            sum(fp.padded_sharded_param_size.numel() for fp in m._get_fsdp_state()._fsdp_param_group.fsdp_params)
            for m in pl_module.modules()
            if isinstance(m, FSDPModule) and m._get_fsdp_state()._fsdp_param_group is not None
        )
        model_bytes = 0
        for p, t in zip(pl_module.parameters(), local):
            model_bytes += t.numel() * p.element_size() * (2 if p.grad is not None else 1)
        for opt in trainer.optimizers:
            for state in opt.state.values():
                for v in state.values():
                    if isinstance(v, torch.Tensor):
                        local = v.to_local() if hasattr(v, "to_local") else v
                        model_bytes += local.numel() * local.element_size()
        gtc = getattr(strategy, "gtc_state", None) if sharded else None
        if not sharded:  # gtc_ddp: GTC over DDP's replicas of the whole model
            total = strategy.gtc_stats["total"]
            sent, dense = total["bytes_sent"], total["allreduce_fp32_bytes"]
        elif gtc is not None:
            sent, dense = gtc.totals["bytes_sent"], gtc.totals["bytes_dense"]
        else:
            sent = dense = trainer.global_step * allreduce_bytes(padded, replicas)
        record = {
            "rank": trainer.global_rank,
            "heldout_loss": heldout_loss(pl_module),
            "steps": trainer.global_step,
            "shard_numel": shard_numel,
            "numel": sum(p.numel() for p in pl_module.parameters()),
            "bytes_sent": sent,
            "bytes_dense": dense,
            "words": gtc.totals["words"] if gtc is not None else (total["words"] if not sharded else None),
            "gtc_state_bytes": gtc.nbytes() if gtc is not None else (own_memory_bytes(strategy) if not sharded else 0),
            "model_state_bytes": model_bytes,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "step_seconds": self.step_seconds,
        }
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def run(
    method: str, seed: int, steps: int, replicas: int, shards: int, optimizer: str, out_dir: Path,
    density: float | None = None,
) -> dict:
    """One run on ``replicas x shards`` forked CPU ranks (``density``: GTC's target density, None: its
    default); the ranks' records and a summary."""
    run_dir = out_dir / "runs" / f"{method}-{optimizer}-d{density}-s{seed}"
    run_dir.mkdir(parents=True, exist_ok=True)
    world = replicas * shards
    with restore_environment("MASTER_PORT", "PL_GLOBAL_SEED"):
        L.seed_everything(seed, verbose=False)
        model = ShardedTransformerLM(train_size=steps * 16 * world, seed=seed, steps=steps, optimizer=optimizer)
        if method == "hsdp":
            strategy = _NativeHSDP(data_parallel_size=replicas, tensor_parallel_size=shards, timeout=TIMEOUT)
        elif method == "gtc_ddp":
            strategy = GTCStrategy(target_density=density, start_method="fork", timeout=TIMEOUT)
        else:
            compress = "update" if method == "gtc_hsdp_update" else "gradient"
            strategy = GTCHSDPStrategy(
                replicate_size=replicas, shard_size=shards, target_density=density, compress=compress,
                start_method="fork", timeout=TIMEOUT,
            )  # fmt: skip
        trainer = L.Trainer(
            accelerator="cpu", devices=world, strategy=strategy, max_steps=steps, max_epochs=1, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=0, callbacks=[HSDPProbe(run_dir)], default_root_dir=run_dir,
        )  # fmt: skip
        start = time.perf_counter()
        trainer.fit(model)
        wall = time.perf_counter() - start
    ranks = [json.loads((run_dir / f"rank{r}.json").read_text()) for r in range(world)]
    steady = [s for r in ranks for s in r["step_seconds"][5:]]
    return {
        "method": method, "optimizer": optimizer, "target_density": density if method != "hsdp" else None, "seed": seed, "steps": steps, "replicas": replicas, "shards": shards,
        "numel": ranks[0]["numel"], "best_loss": model.task.best_loss,
        "heldout_loss": ranks[0]["heldout_loss"],
        "bytes_sent_per_rank": statistics.mean(r["bytes_sent"] for r in ranks),
        "bytes_dense_per_rank": statistics.mean(r["bytes_dense"] for r in ranks),
        "density": (statistics.mean(r["words"] for r in ranks) / (steps * ranks[0]["shard_numel"])
                    if ranks[0]["words"] is not None else None),
        "step_s_median": statistics.median(steady),
        "gtc_state_bytes_per_rank": max(r["gtc_state_bytes"] for r in ranks),
        "gtc_state_bytes_per_shard_element": max(r["gtc_state_bytes"] / r["shard_numel"] for r in ranks),
        "model_state_bytes_per_rank": max(r["model_state_bytes"] for r in ranks),
        "peak_rss_bytes_per_rank": max(r["peak_rss_bytes"] for r in ranks),
        "wall_s": wall,
    }  # fmt: skip


def report(results: list[dict]) -> str:
    """A markdown table: per optimizer, method and target density, the mean over seeds (and each seed's
    held-out loss), against plain HSDP with the same optimizer."""
    lines = [
        (
            "| optimizer | method | target density | seeds | held-out loss (mean; per seed) | vs hsdp "
            "| bytes/rank/step across replicas | fewer bytes than hsdp | step (ms, median) | GTC state/rank "
            "| B per shard element | model state/rank | peak RSS/rank |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    keys = sorted({(r["optimizer"], METHODS.index(r["method"]), r.get("target_density") or 0.0) for r in results})
    for optimizer, order, density in keys:
        method = METHODS[order]
        is_gtc = method != "hsdp"
        base = [r for r in results if r["method"] == "hsdp" and r["optimizer"] == optimizer]
        base_loss = statistics.mean(r["heldout_loss"] for r in base) if base else None
        base_bytes = statistics.mean(r["bytes_sent_per_rank"] / r["steps"] for r in base) if base else None
        runs = [r for r in results if r["optimizer"] == optimizer and r["method"] == method
                and (r.get("target_density") or 0.0) == density]  # fmt: skip
        loss = statistics.mean(r["heldout_loss"] for r in runs)
        per_step = statistics.mean(r["bytes_sent_per_rank"] / r["steps"] for r in runs)
        vs = f"{100 * (loss / base_loss - 1):+.2f} %" if base_loss and is_gtc else "-"
        fewer = f"{base_bytes / per_step:.0f}x" if base_bytes and is_gtc else "-"
        seeds = ", ".join(f"{r['heldout_loss']:.4f}" for r in runs)
        shown = (f"{density:g}" if density else "1e-2 (default)") if is_gtc else "-"
        lines.append(
            f"| {optimizer} | {runs[0]['method']} | {shown} | {len(runs)} | {loss:.4f}; {seeds} | {vs} "
            f"| {per_step / 1e3:.1f} kB | {fewer} | {1e3 * statistics.mean(r['step_s_median'] for r in runs):.1f} "
            f"| {runs[0]['gtc_state_bytes_per_rank'] / 1e3:.0f} kB | {runs[0]['gtc_state_bytes_per_shard_element']:.2f} "
            f"| {runs[0]['model_state_bytes_per_rank'] / 1e3:.0f} kB | {runs[0]['peak_rss_bytes_per_rank'] / 2**20:.0f} MiB |"
        )  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="one run per seed and method")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps per run")
    parser.add_argument("--replicas", type=int, default=2, help="ranks that hold the same shard")
    parser.add_argument("--shards", type=int, default=2, help="ranks a shard group spans")
    parser.add_argument("--optimizers", nargs="+", default=["adamw"], choices=["adamw", "sgd"],
                        help="adamw: the suite's; sgd: momentum 0.9, 100x the rate, cosine")  # fmt: skip
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--densities", type=float, nargs="+", default=[None],
                        help="gtc_hsdp's target_density, one run per value (default: its default, 1e-2)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("hsdp_bench"), help="results.json, report.md, runs/")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    with quiet_lightning():
        for optimizer in args.optimizers:
            for seed in args.seeds:
                cells = [(m, d) for m in args.methods for d in (args.densities if m != "hsdp" else [None])]
                for method, density in cells:
                    result = run(method, seed, args.steps, args.replicas, args.shards, optimizer, args.out, density)
                    results.append(result)
                    print(f"{method} {optimizer} density {density} seed {seed}: held-out {result['heldout_loss']:.4f}, "
                          f"{result['bytes_sent_per_rank'] / 1e6:.3f} MB/rank, {1e3 * result['step_s_median']:.1f} ms/step, "
                          f"{result['wall_s']:.0f} s", flush=True)  # fmt: skip
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    table = report(results)
    (args.out / "report.md").write_text(table + "\n")
    print(table)
    return results


if __name__ == "__main__":
    main()
