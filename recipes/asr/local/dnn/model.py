"""Strom's acoustic DNN: a stack of affine + sigmoid layers, softmax over pdf-ids, cross-entropy.

Batch schema (from ``local.dnn.datamodule``): ``x`` ``[B, 17*F]`` float32 windows, ``y`` ``[B]``
int64 pdf-ids. Learning rate: plain SGD, halved after each epoch (Strom 2015, Table 1), or
Kaldi's "newbob" (keep the rate while dev frame accuracy improves by at least
``newbob_threshold``, then halve it after every epoch), or Kaldi nnet1's rule on the cross-validation
cross-entropy with rejection of a worse epoch (``local.dnn.schedule``).

Validation sets: ``dev``, and ``cv`` when the data module holds training speakers out
(``--data.cv_speakers``); the schedules then read ``cv`` in place of ``dev``.
"""

from __future__ import annotations

import copy
import itertools
import logging
import math
import time
from typing import Literal

import torch
from lightning.pytorch import LightningModule
from torch import nn

from local.dnn.schedule import Nnet1Schedule

log = logging.getLogger(__name__)


class AcousticModel(LightningModule):
    """Feed-forward sigmoid DNN over spliced fbank frames.

    Args:
        input_dim: ``17*F`` (linked from the data module by the CLI).
        num_pdfs: number of output classes (linked from the data module by the CLI).
        hidden_dim: units per hidden layer (512 on CPU; 1536 gives Strom's ~14.6 M weights).
        num_layers: hidden layers (Strom uses 5).
        lr: SGD learning rate of the first epoch (for mean-over-batch cross-entropy).
        momentum: SGD momentum (Strom: none).
        schedule: ``"halve"`` halves the rate after each epoch past ``hold_epochs``;
            ``"newbob"`` halves only once dev accuracy stops improving by ``newbob_threshold``
            (absolute, as a fraction), then after every epoch; ``"nnet1"`` is Kaldi nnet1's
            ``train_scheduler.sh`` on the cross-validation cross-entropy (``local.dnn.schedule``): an
            epoch that makes it worse than the best accepted epoch is rejected (the weights of that
            epoch restored) and halving starts, or training stops if it had started; halving starts
            when the relative gain falls below ``start_halving_impr``, training stops when it falls
            below ``end_halving_impr`` after that, or at ``--trainer.max_epochs`` (nnet1: 20).
            ``newbob`` and ``nnet1`` read the held-out training speakers (``--data.cv_speakers``)
            when there are some, else dev.
        hold_epochs: epochs trained at ``lr`` before halving starts (Strom's Table 1: 1); with
            ``nnet1`` these epochs are also always accepted (nnet1's ``keep_lr_iters``).
        newbob_threshold: improvement of dev frame accuracy below which newbob starts halving.
        start_halving_impr: ``nnet1``: relative gain of the cross-validation loss below which halving
            starts (nnet1: 0.01).
        end_halving_impr: ``nnet1``: relative gain below which training stops once halving has
            started (nnet1: 0.001).
        init_gain: Xavier gain on hidden layers; sigmoid stacks need ~4, or training sits at the
            class prior for an epoch.
        sam_rho: sharpness-aware minimisation (Foret et al., 2021) when > 0: each step's gradient is
            taken at the weights moved by ``sam_rho`` (Euclidean length, all parameters together)
            along the rank's own batch gradient, then applied to the unmoved weights. One more
            forward and backward a step; the first gradient never leaves the rank (no words, no
            all-reduce). A diagnostic for GTC's sharpness (docs/experiments/auto_tau_rice.md, "Sharpness").
    """

    def __init__(
        self,
        input_dim: int = 680,
        num_pdfs: int = 200,
        hidden_dim: int = 512,
        num_layers: int = 5,
        lr: float = 1.0,
        momentum: float = 0.0,
        schedule: Literal["halve", "newbob", "nnet1"] = "halve",
        hold_epochs: int = 0,
        newbob_threshold: float = 0.005,
        start_halving_impr: float = 0.01,
        end_halving_impr: float = 0.001,
        init_gain: float = 4.0,
        sam_rho: float = 0.0,
    ) -> None:
        super().__init__()
        if min(input_dim, num_pdfs, hidden_dim, num_layers) < 1:
            raise ValueError(
                f"input_dim={input_dim}, num_pdfs={num_pdfs}, hidden_dim={hidden_dim}, "
                f"num_layers={num_layers} must all be >= 1"
            )
        if sam_rho < 0:
            raise ValueError(f"sam_rho={sam_rho}: use 0 (plain SGD) or a positive radius")
        if schedule not in ("halve", "newbob", "nnet1"):
            raise ValueError(f"schedule={schedule!r}; use 'halve', 'newbob' or 'nnet1'")
        self._nnet1 = Nnet1Schedule(start_halving_impr, end_halving_impr, hold_epochs) if schedule == "nnet1" else None
        self.save_hyperparameters()
        self._sam_saved: list[torch.Tensor] | None = None
        layers: list[nn.Module] = []
        dims = [input_dim] + [hidden_dim] * num_layers
        for d_in, d_out in itertools.pairwise(dims):
            affine = nn.Linear(d_in, d_out)
            nn.init.xavier_uniform_(affine.weight, gain=init_gain)
            nn.init.zeros_(affine.bias)
            layers += [affine, nn.Sigmoid()]
        output = nn.Linear(dims[-1], num_pdfs)
        nn.init.xavier_uniform_(output.weight)
        nn.init.zeros_(output.bias)
        self.net = nn.Sequential(*layers, output)
        self.dev_acc_history: list[float] = []  # dev frame accuracy after each epoch
        self.cv_acc_history: list[float] = []  # held-out training speakers' frame accuracy (--data.cv_speakers)
        self.loss_history: dict[str, list[float]] = {"dev": [], "cv": []}  # frame-averaged cross-entropy
        self._newbob_halving = False  # newbob: once it starts halving it halves every epoch
        self._accepted: dict | None = None  # nnet1: parameters and optimizer state of the last accepted epoch
        self._val_counts: dict[str, torch.Tensor] = {}  # per set: correct, total frames, summed cross-entropy
        self._epoch_frames = 0
        self._epoch_start = self._last_batch_end = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[B, 17*F]`` -> logits ``[B, num_pdfs]`` (log-softmax of them is the log posterior)."""
        return self.net(x)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.hparams.sam_rho > 0:
            self._sam_ascend(batch)
        loss = nn.functional.cross_entropy(self(batch["x"]), batch["y"])
        self._epoch_frames += batch["y"].numel()
        self.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True, batch_size=batch["y"].numel())
        return loss

    def _sam_ascend(self, batch: dict[str, torch.Tensor]) -> None:
        """Move the weights by ``sam_rho`` along this rank's batch gradient (``torch.autograd.grad``:
        no ``.grad``, no DDP or GTC hook), keeping an exact copy for ``on_before_optimizer_step``."""
        params = [p for p in self.parameters() if p.requires_grad]
        grads = torch.autograd.grad(nn.functional.cross_entropy(self(batch["x"]), batch["y"]), params)
        norm = torch.sqrt(sum((g.float() ** 2).sum() for g in grads))
        with torch.no_grad():
            self._sam_saved = [p.detach().clone() for p in params]
            if norm > 0:
                for p, g in zip(params, grads):
                    p.add_(g.to(p.dtype), alpha=float(self.hparams.sam_rho / norm))

    def _check_sam(self) -> None:
        if self.hparams.sam_rho > 0 and self.trainer.accumulate_grad_batches != 1:
            raise ValueError(f"sam_rho={self.hparams.sam_rho} with accumulate_grad_batches="
                             f"{self.trainer.accumulate_grad_batches}: the weights are restored once per optimizer "
                             "step; use accumulate_grad_batches=1 (a larger --data.batch_size instead)")

    def on_before_optimizer_step(self, optimizer) -> None:
        if self._sam_saved is not None:  # the step starts from the unmoved weights, bit for bit
            with torch.no_grad():
                for p, saved in zip((p for p in self.parameters() if p.requires_grad), self._sam_saved):
                    p.copy_(saved)
            self._sam_saved = None

    def on_train_epoch_start(self) -> None:
        self._epoch_frames = 0
        self._epoch_start = self._last_batch_end = time.perf_counter()
        self.log("lr", self.optimizers().param_groups[0]["lr"], on_epoch=True, on_step=False)

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        self._last_batch_end = time.perf_counter()

    def on_train_epoch_end(self) -> None:
        # frames of all ranks per second of training (dev evaluation excluded); ranks run in
        # lockstep under DDP/GTC
        seconds = max(self._last_batch_end - self._epoch_start, 1e-9)
        self.log("frames_per_sec", self._epoch_frames * self.trainer.world_size / seconds, sync_dist=True)
        if self._nnet1 is not None:
            self._nnet1_epoch_end()
        elif self.halve_after_epoch(self.current_epoch):
            for group in self.optimizers().param_groups:
                group["lr"] *= 0.5

    def halve_after_epoch(self, epoch: int) -> bool:
        """Whether the schedule halves the learning rate after ``epoch`` (0-based), given the
        accuracies in ``cv_acc_history``, else ``dev_acc_history`` (newbob: once it starts halving it
        halves every epoch)."""
        hp, history = self.hparams, self.cv_acc_history or self.dev_acc_history
        if hp.schedule == "nnet1":
            raise ValueError("schedule='nnet1' decides in on_train_epoch_end (it restores weights and may stop "
                             "training), inside a Lightning fit only; use 'newbob' or 'halve' here")
        if hp.schedule == "newbob":
            gain = history[-1] - history[-2] if len(history) >= 2 else float("inf")
            self._newbob_halving |= gain < hp.newbob_threshold and epoch >= hp.hold_epochs
            return self._newbob_halving
        return epoch >= hp.hold_epochs

    @property
    def schedule_decisions(self) -> list[dict]:
        """``nnet1``: each epoch's decision (``local.dnn.schedule.Decision`` as a dict, the first epoch's
        relative gain None); else empty."""
        decisions = self._nnet1.state_dict()["decisions"] if self._nnet1 is not None else []
        return [{**d, "rel_impr": d["rel_impr"] if math.isfinite(d["rel_impr"]) else None} for d in decisions]

    def on_fit_start(self) -> None:
        self._check_sam()
        if self._nnet1 is not None and self._accepted is None:  # the initial weights: nnet1's mlp_init
            self._accepted = self._weights()

    def _weights(self) -> dict:
        """A copy of the parameters and of the optimizer's state (SGD's momentum buffers); a strategy's
        own state (GTC's residuals) is not the model's and stays as it is on a rejection."""
        optimizer = self.optimizers()
        optimizer = getattr(optimizer, "optimizer", optimizer)  # Lightning's wrapper, or a plain one in tests
        return {"params": [p.detach().clone() for p in self.parameters()],
                "optimizer": copy.deepcopy(optimizer.state_dict())}

    def _nnet1_epoch_end(self) -> None:
        """Apply nnet1's decision after this epoch: keep or restore the weights, halve, stop."""
        which = "cv" if self.loss_history["cv"] else "dev"
        losses = self.loss_history[which]
        if len(losses) != len(self._nnet1.decisions) + 1:
            if 0 < self.trainer.max_steps <= self.trainer.global_step:  # cut short mid-epoch: no validation ran
                log.info("nnet1 schedule: epoch %d ended at max_steps before its validation; no decision",
                         self.current_epoch)
                return
            raise RuntimeError(f"schedule='nnet1' after epoch {self.current_epoch}: no new cross-validation loss "
                               f"({len(losses)} for {len(self._nnet1.decisions) + 1} epochs); it needs a validation "
                               "pass after every epoch over a set with aligned frames: hold training speakers out "
                               "(--data.cv_speakers 0.1) or give dev aligned utterances, with "
                               "--trainer.check_val_every_n_epoch 1 and --trainer.limit_val_batches above 0")
        decision = self._nnet1.step(losses[-1])
        optimizer = self.optimizers()
        if decision.accepted:
            self._accepted = self._weights()
        else:
            with torch.no_grad():
                for p, saved in zip(self.parameters(), self._accepted["params"]):
                    p.copy_(saved)
            lrs = [g["lr"] for g in optimizer.param_groups]
            getattr(optimizer, "optimizer", optimizer).load_state_dict(self._accepted["optimizer"])
            for group, lr in zip(optimizer.param_groups, lrs):  # the rate is the schedule's, not the copy's
                group["lr"] = lr
        lr_before = optimizer.param_groups[0]["lr"]
        if decision.halve:
            for group in optimizer.param_groups:
                group["lr"] *= 0.5
        if decision.stop:
            self.trainer.should_stop = True
        if self.trainer.is_global_zero:  # every rank decides the same
            log.info("nnet1 schedule on %s: %s", which, decision.describe(lr_before, optimizer.param_groups[0]["lr"]))
        self.log("cv_accepted", float(decision.accepted), on_epoch=True, on_step=False)
        if math.isfinite(decision.rel_impr):
            self.log("cv_rel_impr", decision.rel_impr, on_epoch=True, on_step=False)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["dev_acc_history"] = list(self.dev_acc_history)
        checkpoint["newbob_halving"] = self._newbob_halving
        if self.cv_acc_history or self._nnet1 is not None:
            checkpoint["cv_acc_history"] = list(self.cv_acc_history)
            checkpoint["loss_history"] = {k: list(v) for k, v in self.loss_history.items()}
        if self._nnet1 is not None:
            checkpoint["nnet1_schedule"] = self._nnet1.state_dict()
            checkpoint["nnet1_accepted"] = self._accepted

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.dev_acc_history = list(checkpoint.get("dev_acc_history", []))
        self._newbob_halving = bool(checkpoint.get("newbob_halving", False))
        self.cv_acc_history = list(checkpoint.get("cv_acc_history", []))
        self.loss_history = {"dev": [], "cv": [], **checkpoint.get("loss_history", {})}
        if self._nnet1 is not None and "nnet1_schedule" in checkpoint:
            self._nnet1.load_state_dict(checkpoint["nnet1_schedule"])
            self._accepted = checkpoint["nnet1_accepted"]

    def _val_set(self, dataloader_idx: int) -> str:
        datamodule = self._trainer.datamodule if self._trainer is not None else None
        return getattr(datamodule, "val_sets", ("dev",))[dataloader_idx]

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int, dataloader_idx: int = 0) -> None:
        name = self._val_set(dataloader_idx)
        logits = self(batch["x"])
        loss = nn.functional.cross_entropy(logits, batch["y"])
        self.log(f"{name}_loss", loss, on_epoch=True, sync_dist=True, batch_size=batch["y"].numel(),
                 add_dataloader_idx=False)
        correct = (logits.argmax(dim=-1) == batch["y"]).sum().item()
        counts = self._val_counts.setdefault(name, torch.zeros(3, dtype=torch.float64))
        counts += torch.tensor([correct, batch["y"].numel(), loss.item() * batch["y"].numel()], dtype=torch.float64)

    def on_validation_epoch_end(self) -> None:
        # ranks hold disjoint shards of each set: sum the counts, not the per-rank accuracies
        for name in getattr(self._trainer.datamodule, "val_sets", ("dev",)):
            local = self._val_counts.pop(name, torch.zeros(3, dtype=torch.float64))
            counts = self.trainer.strategy.reduce(local.to(self.device), reduce_op="sum")
            if name != "dev" and counts[1] == 0:
                continue
            acc = float(counts[0] / counts[1].clamp(min=1))
            self.log(f"{name}_frame_acc", acc, prog_bar=True, sync_dist=True)  # equal on all ranks
            if not self.trainer.sanity_checking:
                (self.dev_acc_history if name == "dev" else self.cv_acc_history).append(acc)
                if counts[1] > 0:
                    self.loss_history[name].append(float(counts[2] / counts[1]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=self.hparams.momentum)
