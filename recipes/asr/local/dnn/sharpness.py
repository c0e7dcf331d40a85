"""Sharpness: the largest eigenvalue of the training loss's Hessian, by power iteration on
Hessian-vector products (double backward; the Hessian itself is never formed).

Why the recipe measures it: plain SGD at rate η cannot stay where the loss's sharpness exceeds
2/η (the step overshoots along the sharpest direction and the oscillation grows until the weights
leave for a flatter region, "the edge of stability"), so a baseline trained at lr 2 ends near 1.
GTC applies only the elements whose residual crossed τ, each by at most ``lr·τ`` a step, and
an oscillation smaller than τ per element cancels in the residual before it is sent: nothing stops
it in sharper regions. ``SharpnessMonitor`` follows it during training; ``recipes/asr/research/sharpness.py``
measures finished runs (docs/experiments/auto_tau_rice.md, "Sharpness").
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

import torch
from lightning.pytorch import Callback
from torch import nn

log = logging.getLogger(__name__)


def _dot(a: list[torch.Tensor], b: list[torch.Tensor]) -> torch.Tensor:
    return sum((x * y).sum() for x, y in zip(a, b))


def top_hessian_eigenvalue(model: nn.Module, batches: list[dict[str, torch.Tensor]], iters: int = 30,
                           tol: float = 1e-3, seed: int = 0) -> dict:
    """The eigenvalue of largest magnitude of the Hessian of the mean cross-entropy over
    ``batches`` (each ``{"x", "y"}``, equally weighted) with respect to ``model``'s trainable
    parameters (in the batches' and the model's dtype), without touching their ``.grad``. Stops after ``iters``
    power iterations or when the estimate changes by less than ``tol`` (relative).

    Returns ``{"lambda_max", "loss", "iterations", "converged", "seconds"}``; ``lambda_max`` is
    the Rayleigh quotient of the last iterate (negative if the dominant eigenvalue is)."""
    if not batches:
        raise ValueError("no batches: give at least one {'x', 'y'} batch to measure the loss on")
    if iters < 1 or tol <= 0:
        raise ValueError(f"iters={iters} (>= 1), tol={tol} (> 0)")
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters")
    gen = torch.Generator().manual_seed(seed)  # the global RNG (data order, init) stays untouched
    v = [torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p) for p in params]
    norm = torch.sqrt(_dot(v, v))
    v = [x / norm for x in v]
    start, lam, loss_value, converged, it = time.perf_counter(), math.nan, math.nan, False, 0
    for it in range(1, iters + 1):
        hv = [torch.zeros_like(p) for p in params]
        loss_value = 0.0
        for b in batches:
            loss = nn.functional.cross_entropy(model(b["x"]), b["y"].long()) / len(batches)
            grads = torch.autograd.grad(loss, params, create_graph=True)
            for acc, h in zip(hv, torch.autograd.grad(_dot(grads, v), params)):
                acc += h
            loss_value += float(loss.detach())
        new = float(_dot(hv, v))
        norm = torch.sqrt(_dot(hv, hv))
        if norm == 0:
            lam, converged = 0.0, True
            break
        v = [h / norm for h in hv]
        if it > 1 and abs(new - lam) <= tol * max(abs(new), 1e-12):
            lam, converged = new, True
            break
        lam = new
    return {"lambda_max": lam, "loss": loss_value, "iterations": it, "converged": converged,
            "seconds": round(time.perf_counter() - start, 2)}


def first_batches(loader, num: int) -> list[dict[str, torch.Tensor]]:
    """Copies of ``x`` and ``y`` of the first ``num`` batches of ``loader`` (fewer if it ends first)."""
    batches = []
    for batch in loader:
        if not isinstance(batch, dict) or not {"x", "y"} <= batch.keys():
            raise TypeError("SharpnessMonitor needs batches {'x': features, 'y': targets} (the recipe's); got "
                            + type(batch).__name__ + (f" with keys {sorted(batch)}" if isinstance(batch, dict) else ""))
        batches.append({"x": batch["x"].clone(), "y": batch["y"].clone()})
        if len(batches) == num:
            break
    return batches


class SharpnessMonitor(Callback):
    """Every ``every_n_steps`` optimizer steps, rank 0 measures the top Hessian eigenvalue of the
    training loss on the first ``num_batches`` batches of its epoch-0 training data (the same frames
    every time), writes ``{"step", "epoch", "lr", "lambda_max", "lr_x_lambda", ...}`` as a line of
    ``<log_dir>/sharpness.jsonl`` and logs ``sharpness`` to the trainer's loggers. It reads the
    weights only: the replicas, their gradients and the global RNG are left as they were.
    ``lr_x_lambda`` above 2 is where plain SGD at that rate is unstable.

    Add it to a recipe run with ``'--trainer.callbacks+=local.dnn.sharpness.SharpnessMonitor'``
    (``--trainer.callbacks.every_n_steps 200`` after it to set its arguments).
    """

    def __init__(self, every_n_steps: int = 200, num_batches: int = 4, iters: int = 20, tol: float = 1e-3) -> None:
        if every_n_steps < 1 or num_batches < 1 or iters < 1:
            raise ValueError(f"every_n_steps={every_n_steps}, num_batches={num_batches}, iters={iters}: each >= 1")
        self.every_n_steps, self.num_batches, self.iters, self.tol = every_n_steps, num_batches, iters, tol
        self._batches: list[dict[str, torch.Tensor]] | None = None
        self._last_step = -1

    def _fixed_batches(self, trainer) -> list[dict[str, torch.Tensor]]:
        if self._batches is None:
            datamodule = getattr(trainer, "datamodule", None)
            loader = datamodule.train_dataloader() if datamodule is not None else trainer.train_dataloader
            if loader is None:
                raise RuntimeError("SharpnessMonitor found no training data: fit with a datamodule or with "
                                   "train_dataloaders, and measure from on_train_start on")
            with torch.random.fork_rng(devices=[]):  # a shuffling loader draws its seed from the global RNG
                self._batches = first_batches(loader, self.num_batches)
        return self._batches

    def measure(self, trainer, pl_module) -> dict | None:
        step = trainer.global_step
        if trainer.global_rank != 0 or step == self._last_step:
            return None
        self._last_step = step
        batches = [{k: t.to(pl_module.device) for k, t in b.items()} for b in self._fixed_batches(trainer)]
        was_training = pl_module.training
        pl_module.eval()
        try:
            with torch.enable_grad(), torch.autocast(pl_module.device.type, enabled=False):
                res = top_hessian_eigenvalue(pl_module, batches, self.iters, self.tol, seed=step)
        finally:
            pl_module.train(was_training)
        lr = float(trainer.optimizers[0].param_groups[0]["lr"])
        row = {"step": step, "epoch": trainer.current_epoch, "lr": lr, **res, "lr_x_lambda": lr * res["lambda_max"]}
        for logger in trainer.loggers:
            logger.log_metrics({"sharpness": res["lambda_max"]}, step=step)
        log_dir = Path(getattr(trainer.logger, "log_dir", None) or trainer.default_root_dir)  # no collective: rank 0 only
        log_dir.mkdir(parents=True, exist_ok=True)
        with open(log_dir / "sharpness.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        log.info("step %d: sharpness %.3f (lr x sharpness %.2f, %d power iterations, %.1f s)", step,
                 res["lambda_max"], row["lr_x_lambda"], res["iterations"], res["seconds"])
        return row

    def on_train_start(self, trainer, pl_module) -> None:
        self.measure(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if trainer.global_step % self.every_n_steps == 0:
            self.measure(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        self.measure(trainer, pl_module)
