"""Helpers for the strategy tests: a tiny model, a recorder callback, and a 2-process fork run.

Every rank writes what the tests need (parameters, residuals, statistics, warnings per batch)
to ``out_dir/rank{r}.pt``; :func:`fit` returns those records, rank by rank.
"""

from __future__ import annotations

import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

from gtc_lightning import GTCStrategy

FEATURES, HIDDEN, CLASSES = 16, 32, 4
SAMPLES, BATCH = 64, 8  # 2 ranks x 4 batches of 8 per epoch
TIMEOUT = timedelta(seconds=60)  # a hung collective fails the test instead of blocking for 30 min


def dataset() -> TensorDataset:
    """``x [64, 16]`` float32, ``y [64]`` class ids from a fixed random teacher."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    teacher = torch.randn(FEATURES, CLASSES, generator=g)
    return TensorDataset(x, (x @ teacher).argmax(dim=1))


class TinyMLP(L.LightningModule):
    """16 -> 32 -> 4 MLP trained with SGD + momentum on cross-entropy.

    Args:
        lr: learning rate.
        nan_on: ``(rank, first_step, last_step)``: make that rank's loss NaN on those global steps.
        perturb_on: ``(rank, global_step)``: after that batch, nudge one weight on that rank only.
    """

    def __init__(self, lr: float = 0.5, nan_on: tuple | None = None, perturb_on: tuple | None = None):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(FEATURES, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, CLASSES)
        )
        self.lr, self.nan_on, self.perturb_on = lr, nan_on, perturb_on

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        if (
            self.nan_on
            and self.global_rank == self.nan_on[0]
            and self.nan_on[1] <= self.global_step <= self.nan_on[2]
        ):
            loss = loss * float("nan")
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.perturb_on and (self.global_rank, self.global_step) == tuple(self.perturb_on):
            with torch.no_grad():
                self.net[0].weight[0, 0] += 1e-3

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(dataset(), batch_size=BATCH, shuffle=False)


class Recorder(L.Callback):
    """Per batch: step, parameters, residuals, GTC statistics, loss; saved per rank at the end."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = Path(out_dir)
        self.records: list[dict] = []
        self.start: dict[str, Any] = {}

    def setup(self, trainer, pl_module, stage):
        # pytest records warnings in the parent; the forked child must catch its own.
        self._catcher = warnings.catch_warnings(record=True)
        self._warnings = self._catcher.__enter__()
        warnings.simplefilter("always")

    def on_train_start(self, trainer, pl_module):
        state = getattr(trainer.strategy, "gtc_state", None)
        self.start = {
            "params": torch.cat([p.detach().reshape(-1) for p in pl_module.parameters()]).clone(),
            "residual": state.residual_vector().clone() if state is not None else None,
            "step": state.step if state is not None else 0,
        }

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        state = getattr(trainer.strategy, "gtc_state", None)
        self.records.append(
            {
                "global_step": trainer.global_step,
                "step": state.step if state is not None else trainer.global_step,
                "params": torch.cat([p.detach().reshape(-1) for p in pl_module.parameters()]).clone(),
                "residual": state.residual_vector().clone() if state is not None else None,
                "stats": trainer.strategy.gtc_stats if state is not None else None,
                "buckets": len(state._flats) if state is not None else 0,
                "loss": float(outputs["loss"]),
            }
        )

    def on_train_end(self, trainer, pl_module):
        self._catcher.__exit__(None, None, None)
        out = {
            "records": self.records,
            "start": self.start,
            "warnings": [str(w.message) for w in self._warnings],
        }
        torch.save(out, self.out_dir / f"rank{trainer.global_rank}.pt")


def fit(
    out_dir: Path,
    strategy: str = "gtc",
    devices: int = 2,
    max_epochs: int = 2,
    model_kwargs: dict | None = None,
    trainer_kwargs: dict | None = None,
    ckpt_path: str | None = None,
    **strategy_kwargs: Any,
) -> tuple[L.Trainer, list[dict]]:
    """Train :class:`TinyMLP` on ``devices`` CPU processes started by fork.

    Args:
        out_dir: where the ranks write ``rank{r}.pt`` (and loggers/checkpoints go).
        strategy: ``"gtc"`` for :class:`GTCStrategy`, ``"ddp"`` for dense DDP.
        **strategy_kwargs: for the strategy (``tau``, ``warmup_steps``, ``bucket_cap_mb``, ...).

    Returns:
        the parent's trainer and, per rank, ``{"records": [per batch], "start", "warnings"}``.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cls = GTCStrategy if strategy == "gtc" else DDPStrategy
    if strategy == "gtc":
        strategy_kwargs.setdefault("tau", 0.01)
    kwargs = {
        "accelerator": "cpu",
        "devices": devices,
        "strategy": cls(start_method="fork", timeout=TIMEOUT, **strategy_kwargs),
        "max_epochs": max_epochs,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "callbacks": [Recorder(out_dir)],
        "default_root_dir": out_dir,
        "log_every_n_steps": 1,
    }
    kwargs.update(trainer_kwargs or {})
    if "callbacks" in (trainer_kwargs or {}):
        kwargs["callbacks"] = [Recorder(out_dir), *trainer_kwargs["callbacks"]]
    trainer = L.Trainer(**kwargs)
    trainer.fit(TinyMLP(**(model_kwargs or {})), ckpt_path=ckpt_path)
    ranks = [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(devices)]
    return trainer, ranks
