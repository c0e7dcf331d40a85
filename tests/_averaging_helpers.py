"""Helpers for the tests of the local-step strategies (``ma``, ``bmuf``, ``bmuf_gtc``): a recorder of
their statistics and optimizer state per batch, and the recomputation of their local steps.

Runs go through ``_strategy_helpers.fit`` (2 or 4 CPU ranks started by fork); :class:`SyncRecorder`
writes ``out_dir/sync{r}.pt`` beside the ``rank{r}.pt`` of ``_strategy_helpers.Recorder``.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
from _strategy_helpers import fit

LR = 0.5  # TinyMLP's learning rate


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
