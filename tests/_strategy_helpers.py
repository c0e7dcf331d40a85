"""Helpers for the strategy tests: tiny models, a recorder callback, and multi-process fork runs.

Every rank writes what the tests need (parameters, residuals, local gradients, statistics,
warnings per batch) to ``out_dir/rank{r}.pt``; :func:`fit` returns those records, rank by rank.
"""

from __future__ import annotations

import os
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

from gtc_lightning import GTCStrategy

FEATURES, HIDDEN, CLASSES = 16, 32, 4
SAMPLES, BATCH = 64, 8  # 2 ranks x 4 batches of 8 per epoch
TIMEOUT = timedelta(seconds=60)  # a hung collective fails the test instead of blocking for 30 min


@pytest.fixture(scope="module", autouse=True)
def keep_master_port():
    """The fork launcher writes MASTER_PORT into the parent's environment; don't leak it (autouse in
    every test module that imports it)."""
    before = os.environ.get("MASTER_PORT")
    yield
    if before is None:
        os.environ.pop("MASTER_PORT", None)
    else:
        os.environ["MASTER_PORT"] = before


def dataset(samples: int = SAMPLES) -> TensorDataset:
    """``x [samples, 16]`` float32, ``y [samples]`` class ids from a fixed random teacher."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(samples, FEATURES, generator=g)
    teacher = torch.randn(FEATURES, CLASSES, generator=g)
    return TensorDataset(x, (x @ teacher).argmax(dim=1))


class TinyMLP(L.LightningModule):
    """16 -> 32 -> 4 MLP trained with SGD on cross-entropy.

    Args:
        lr: learning rate.
        momentum: SGD momentum (0: the update is exactly ``-lr * gradient``).
        nan_on: ``(rank, first_step, last_step)``: make that rank's loss NaN on those global steps.
        perturb_on: ``(rank, global_step)``: after that batch, nudge one weight on that rank only.
        spike_on: ``(rank, global_step, factor)``: multiply that rank's loss by ``factor`` then.
        samples: size of the training set.
    """

    def __init__(
        self,
        lr: float = 0.5,
        momentum: float = 0.9,
        nan_on: tuple | None = None,
        perturb_on: tuple | None = None,
        spike_on: tuple | None = None,
        samples: int = SAMPLES,
    ):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(FEATURES, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, CLASSES)
        )
        self.lr, self.momentum, self.samples = lr, momentum, samples
        self.nan_on, self.perturb_on, self.spike_on = nan_on, perturb_on, spike_on

    def loss(self, batch):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        step = (self.global_rank, self.global_step)
        if self.nan_on and step[0] == self.nan_on[0] and self.nan_on[1] <= step[1] <= self.nan_on[2]:
            loss = loss * float("nan")
        if self.spike_on and step == tuple(self.spike_on[:2]):
            loss = loss * self.spike_on[2]
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.perturb_on and (self.global_rank, self.global_step) == tuple(self.perturb_on):
            with torch.no_grad():
                self.net[0].weight[0, 0] += 1e-3

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)

    def train_dataloader(self):
        return DataLoader(dataset(self.samples), batch_size=BATCH, shuffle=False)


class AdamMLP(TinyMLP):
    """:class:`TinyMLP` with AdamW (each rank's moments differ under ``compress="update"``)."""

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)


class SAMSGD(torch.optim.SGD):
    """Sharpness-aware SGD (Foret et al. 2021): the closure is evaluated at the parameters, then at a point
    ``rho`` along the normalised gradient, whose gradient the step takes from the parameters; each step's
    gradient there (what the optimizer wants: its direction) is kept in ``wanted``."""

    def __init__(self, params, lr, rho=0.05):
        super().__init__(params, lr=lr)
        self.rho, self.wanted = rho, []

    @torch.no_grad()
    def step(self, closure):
        with torch.enable_grad():
            loss = closure()
        params = [p for group in self.param_groups for p in group["params"]]
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))
        shifts = [p.grad * (self.rho / (norm + 1e-12)) for p in params]
        for p, shift in zip(params, shifts):
            p.add_(shift)
        with torch.enable_grad():
            closure()
        for p, shift in zip(params, shifts):
            p.sub_(shift)
        self.wanted.append(torch.cat([p.grad.float().reshape(-1) for p in params]))
        super().step()
        return loss


class Recorder(L.Callback):
    """Per batch: step, parameters, residuals, local gradients, GTC statistics, loss; saved per
    rank at the end. Local gradients are captured by tensor hooks, before DDP sees them."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = Path(out_dir)
        self.records: list[dict] = []
        self.start: dict[str, Any] = {}
        self._local: dict[int, torch.Tensor] = {}

    def setup(self, trainer, pl_module, stage):
        # pytest records warnings in the parent; the forked child must catch its own.
        self._catcher = warnings.catch_warnings(record=True)
        self._warnings = self._catcher.__enter__()
        warnings.simplefilter("always")

    def on_train_start(self, trainer, pl_module):
        state = getattr(trainer.strategy, "gtc_state", None)
        self.params = list(pl_module.parameters())
        for i, p in enumerate(self.params):
            if p.requires_grad:
                p.register_hook(lambda g, i=i: self._accumulate(i, g))
        self.start = {
            "params": self._flat(self.params),
            "residual": state.residual_vector().clone() if state is not None else None,
            "step": state.step if state is not None else 0,
        }

    def _accumulate(self, i: int, grad: torch.Tensor) -> None:
        grad = grad.detach().float().clone()
        self._local[i] = self._local[i] + grad if i in self._local else grad

    @staticmethod
    def _flat(tensors) -> torch.Tensor:
        return torch.cat([t.detach().float().reshape(-1) for t in tensors]).clone()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        state = getattr(trainer.strategy, "gtc_state", None)
        local = self._flat(
            [self._local.get(i, torch.zeros_like(p, dtype=torch.float32)) for i, p in enumerate(self.params)]
        )
        used = [i in self._local for i in range(len(self.params))]
        self._local = {}
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.records.append(
            {
                "global_step": trainer.global_step,
                "step": state.step if state is not None else trainer.global_step,
                "params": self._flat(self.params),
                "residual": state.residual_vector().clone() if state is not None else None,
                "local_grad": local,
                "used": used,
                "stats": trainer.strategy.gtc_stats if state is not None else None,
                "buckets": len(state._keys) if state is not None else 0,
                "loss": float(outputs["loss"]) if outputs is not None and "loss" in outputs else float("nan"),
                "scale": float(scaler.get_scale()) if scaler is not None else None,
            }
        )

    def on_train_end(self, trainer, pl_module):
        self._catcher.__exit__(None, None, None)
        out = {
            "records": self.records,
            "start": self.start,
            "warnings": [str(w.message) for w in self._warnings],
            "numels": [p.numel() for p in self.params],
        }
        torch.save(out, self.out_dir / f"rank{trainer.global_rank}.pt")


def fit(
    out_dir: Path,
    strategy: str | type = "gtc",
    devices: int = 2,
    max_epochs: int = 2,
    model_kwargs: dict | None = None,
    trainer_kwargs: dict | None = None,
    ckpt_path: str | None = None,
    model: L.LightningModule | None = None,
    **strategy_kwargs: Any,
) -> tuple[L.Trainer, list[dict]]:
    """Train :class:`TinyMLP` (or ``model``) on ``devices`` CPU processes started by fork.

    Args:
        out_dir: where the ranks write ``rank{r}.pt`` (and loggers/checkpoints go).
        strategy: ``"gtc"`` for :class:`GTCStrategy`, ``"ddp"`` for dense DDP, or a strategy class.
        **strategy_kwargs: for the strategy (``tau``, ``warmup_steps``, ``bucket_cap_mb``, ...).

    Returns:
        the parent's trainer and, per rank, ``{"records": [per batch], "start", "warnings"}``.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cls = {"gtc": GTCStrategy, "ddp": DDPStrategy}.get(strategy, strategy) if isinstance(strategy, str) else strategy
    if issubclass(cls, GTCStrategy):
        # The tests of Strom's gradient mode run it whatever the optimizer; compress="update" is asked for.
        strategy_kwargs.setdefault("tau", 0.01)
        strategy_kwargs.setdefault("coding", "none")
        if not strategy_kwargs.get("stale"):
            strategy_kwargs.setdefault("compress", "gradient")
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
    trainer.fit(model if model is not None else TinyMLP(**(model_kwargs or {})), ckpt_path=ckpt_path)
    ranks = [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(devices)]
    return trainer, ranks


def expected_sparse_step(residuals: list[torch.Tensor], grads: list[torch.Tensor], tau: float) -> tuple:
    """Strom's step computed independently of the package, in float32 as the kernels do.

    Args:
        residuals: each rank's ``[n]`` residual before the step.
        grads: each rank's ``[n]`` local gradient.
        tau: the threshold.

    Returns:
        ``(update, new_residuals, words per rank)``: the averaged update ``tau/N * (#plus -
        #minus)`` the optimizer must see, and each rank's residual after the step.
    """
    tau32 = torch.tensor(tau, dtype=torch.float32)
    votes = torch.zeros_like(grads[0], dtype=torch.int32)
    new, words = [], []
    for r, g in zip(residuals, grads):
        out = r + g
        plus, minus = out > tau32, out < -tau32
        votes += plus.int() - minus.int()
        new.append(torch.where(plus, out - tau32, torch.where(minus, out + tau32, out)))
        words.append(int(plus.sum() + minus.sum()))
    scale = (tau32 / len(grads)).to(torch.float32)
    return votes.to(torch.float32) * scale, new, words


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(target, world: int, *args: Any, timeout: float = 120.0) -> None:
    """Run ``target(rank, *args)`` in ``world`` processes forked here, each one node of a
    ``num_nodes=world, devices=1`` Trainer launched from outside (as torchrun or SLURM would): the
    same processes live through every ``trainer.fit`` a target calls. Raises if a rank failed."""
    import multiprocessing

    port = free_port()
    context = multiprocessing.get_context("fork")

    def main(rank: int) -> None:
        os.environ.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODE_RANK=str(rank), LOCAL_RANK="0",
            WORLD_SIZE=str(world), GLOBAL_RANK=str(rank),
        )  # fmt: skip
        target(rank, *args)

    processes = [context.Process(target=main, args=(rank,)) for rank in range(world)]
    for p in processes:
        p.start()
    for p in processes:
        p.join(timeout)
    for p in processes:
        if p.is_alive():
            p.kill()
    codes = [p.exitcode for p in processes]
    if any(code != 0 for code in codes):
        raise RuntimeError(f"ranks exited with {codes}")


def unscaled_grads(ranks: list[dict], init_scale: float) -> list[list[torch.Tensor]]:
    """Per step, every rank's local gradient divided by the loss scale its backward pass used (the
    scale before the step: ``init_scale``, then the scale the previous step left)."""
    steps = []
    for t in range(len(ranks[0]["records"])):
        scale = init_scale if t == 0 else ranks[0]["records"][t - 1]["scale"]
        steps.append([rank["records"][t]["local_grad"] / scale for rank in ranks])
    return steps
