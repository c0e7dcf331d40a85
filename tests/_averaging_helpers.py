"""Helpers for the tests of the local-step strategies (``ma``, ``bmuf``, ``bmuf_gtc``, ``dpsgd``): a
recorder of their statistics and optimizer state per batch, the recomputation of their local steps,
and ranks that outlive a fit (:func:`run_ranks`).

Runs go through ``_strategy_helpers.fit`` (2 or 4 CPU ranks started by fork); :class:`SyncRecorder`
writes ``out_dir/sync{r}.pt`` beside the ``rank{r}.pt`` of ``_strategy_helpers.Recorder``.
"""

from __future__ import annotations

import multiprocessing
import os
import traceback
from collections.abc import Callable
from pathlib import Path

import lightning as L
import torch
from _strategy_helpers import TinyMLP, fit
from lightning.fabric.plugins.environments.lightning import find_free_network_port

LR = 0.5  # TinyMLP's learning rate


class Validated(TinyMLP):
    """Validates on the training data after each epoch and saves the parameters it validated."""

    def __init__(self, out_dir: Path, **kwargs):
        super().__init__(**kwargs)
        self.out_dir, self.seen = Path(out_dir), []

    def val_dataloader(self):
        return self.train_dataloader()

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch), sync_dist=True)

    def on_validation_end(self):  # runs before the strategy puts each rank's own parameters back
        self.seen.append(torch.cat([p.detach().reshape(-1) for p in self.parameters()]).clone())
        torch.save(self.seen, self.out_dir / f"seen{self.global_rank}.pt")


class SyncRecorder(L.Callback):
    """Per batch: the strategy's newest :class:`~gtc_lightning.SyncStats` (as a dict), the
    optimizer's momentum buffers (flat, or None when it holds none) and its learning rate."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = Path(out_dir)
        self.records: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        optimizer = trainer.optimizers[0]
        buffers = [optimizer.state.get(p, {}).get("momentum_buffer") for p in pl_module.parameters()]
        momentum = (
            None if any(b is None for b in buffers) else torch.cat([b.reshape(-1) for b in buffers]).clone()
        )
        self.records.append({
            "last": trainer.strategy.sync_stats["last"],
            "total": trainer.strategy.sync_stats["total"],
            "momentum": momentum,
            "lr": optimizer.param_groups[0]["lr"],
        })  # fmt: skip

    def on_train_end(self, trainer, pl_module):
        torch.save(self.records, self.out_dir / f"sync{trainer.global_rank}.pt")


def fit_recorded(
    out_dir: Path, strategy: type, devices: int = 2, trainer_kwargs: dict | None = None, **kwargs
):
    """``_strategy_helpers.fit`` with a :class:`SyncRecorder`; returns (trainer, ranks, syncs per rank)."""
    out_dir = Path(out_dir)
    trainer_kwargs = dict(trainer_kwargs or {})
    trainer_kwargs["callbacks"] = [SyncRecorder(out_dir), *trainer_kwargs.get("callbacks", [])]
    trainer, ranks = fit(out_dir, strategy=strategy, devices=devices, trainer_kwargs=trainer_kwargs, **kwargs)
    syncs = [torch.load(out_dir / f"sync{r}.pt", weights_only=False) for r in range(devices)]
    return trainer, ranks, syncs


def local_step(params: torch.Tensor, grad: torch.Tensor, lr: float = LR) -> torch.Tensor:
    """What ``torch.optim.SGD`` without momentum does: ``p - lr * g``, in float32."""
    return params.add(grad, alpha=-lr)


def mean(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The ranks' mean as the strategy's all-reduce forms it: each divided by W, then summed (in
    rank order: the order a 2-rank all-reduce cannot change; with more ranks compare with a tolerance)."""
    total = tensors[0] / len(tensors)
    for t in tensors[1:]:
        total = total + t / len(tensors)
    return total


# ---- ranks that outlive a fit: the processes torchrun (or SLURM) starts ---------------------------


def _rank_main(rank: int, world: int, port: int, out_dir: Path, target: Callable, kwargs: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODE_RANK="0", LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))  # fmt: skip
    try:
        torch.save(target(rank, out_dir, **kwargs), out_dir / f"result{rank}.pt")
    except Exception:  # noqa: BLE001  (the parent raises it, with the traceback)
        (out_dir / f"error{rank}.txt").write_text(traceback.format_exc())
        os._exit(1)


def run_ranks(out_dir: Path, target: Callable, devices: int = 2, timeout: float = 120.0, **kwargs) -> list:
    """Call ``target(rank, out_dir, **kwargs)`` in ``devices`` forked processes with the environment
    torchrun gives its workers (``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_PORT``): Lightning launches
    nothing, and each process's Trainer and strategy live on after ``fit`` returns, as in a script
    that calls ``fit`` twice (the fork launcher of :func:`_strategy_helpers.fit` refuses a second
    ``fit``). Returns what each rank's ``target`` returned."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    port = find_free_network_port()
    context = multiprocessing.get_context("fork")
    procs = [
        context.Process(target=_rank_main, args=(r, devices, port, out_dir, target, kwargs)) for r in range(devices)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    errors = [(out_dir / f"error{r}.txt") for r in range(devices)]
    failed = [f"rank {r}:\n{e.read_text()}" for r, e in enumerate(errors) if e.exists()]
    if failed or any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"exit codes {[p.exitcode for p in procs]}\n" + "\n".join(failed))
    return [torch.load(out_dir / f"result{r}.pt", weights_only=False) for r in range(devices)]


def check_checkpoints_hold_the_validated_mean(out_dir: Path, name: str, seen: list, ranks: list[dict]) -> None:
    """The checkpoints under ``out_dir/best`` and ``out_dir/every`` (saved after steps 4 and 8) hold the
    model validated then (``seen``, rank 0's :class:`Validated` record: the mean of the ranks' models);
    their shards (``<ckpt>.<name>/rank<r>.pt``) each rank's own parameters after that step."""
    out_dir = Path(out_dir)
    for ckpt in [*(out_dir / "best").glob("*.ckpt"), *(out_dir / "every").glob("*.ckpt")]:
        step = int(ckpt.stem.split("step=")[1]) - 1
        state = torch.load(ckpt, weights_only=False)["state_dict"]
        assert torch.equal(torch.cat([v.reshape(-1) for v in state.values()]), seen[step // 4]), ckpt.name
        for r, rank in enumerate(ranks):
            shard = torch.load(f"{ckpt}.{name}/rank{r}.pt", weights_only=False)["state_dict"]
            flat = torch.cat([v.reshape(-1) for v in shard.values()])
            assert torch.equal(flat, rank["records"][step]["params"]), f"{ckpt.name}: rank {r}'s shard"
