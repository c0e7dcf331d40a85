"""Model suite: GTC against DDP, a bf16 all-reduce and PowerSGD on models Lightning users train.
Long file: the runs, their measures, the report and its plots of one command (models: suite_models.py).

    python -m gtc_lightning.tools.model_suite            # 4 models x 8 methods x 3 seeds x 2, 4 ranks
    python -m gtc_lightning.tools.model_suite --quick    # CI smoke test: 2 models, 1 seed, 2 ranks
    python -m gtc_lightning.tools.model_suite --models cnn gru --methods ddp gtc --world-sizes 2 --seeds 0
    python -m gtc_lightning.tools.model_suite --profile long --resume --out docs/benchmarks/model_suite_long
    python -m gtc_lightning.tools.model_suite --profile long --methods ddp gtc ma diloco sparseloco bmuf_gtc
    python -m gtc_lightning.tools.model_suite --out docs/benchmarks/model_suite_long --merge runs/lm_seed1 runs/lm_seed2

Every run is a ``Trainer.fit`` on ``W`` CPU ranks started by fork, gloo, with a fixed batch per
rank (the global batch grows with W, as DDP users run it) from Lightning's DistributedSampler,
on a synthetic task whose best possible loss is known (:mod:`gtc_lightning.tools.suite_data`).
All runs of one invocation are measured side by side on the same machine. Per run:

- held-out loss: rank 0 scores the full held-out set with the final parameters, and a few times
  during training for the curve, as a validation loop would see the model (the strategy's
  ``on_validation_start``/``on_validation_end`` around it: the local-step family evaluates the mean of
  the ranks' models, ``average_eval``); the run records whether the ranks' own parameters are
  bit-identical at the end;
- bytes on the wire per rank and optimizer step, as the collectives put them there (ring all-reduce:
  ``2 (W-1)/W`` of the tensor's bytes, :func:`gtc_lightning.algorithms.common.allreduce_bytes`): DDP and bf16
  from the gradient's size; PowerSGD by counting every all-reduce torch's hook issues (P, Q and
  the uncompressed tensors, the dense warm-up steps included); GTC from its ``gtc_stats``; the
  family (``FAMILY``: model averaging, DiLoCo, SparseLoCo, BMUF-GTC, D-PSGD, AD-PSGD) from its
  ``sync_stats``, a block sync's bytes amortised over its block's steps; each against a dense fp32 and bf16 ring all-reduce of the same gradient;
- the method's own memory in bytes per trainable parameter, beyond DDP's: GTC's state's tensors
  (residuals, message and count buffers), PowerSGD's error feedback and P/Q buffers, the
  family's state (block start, block momentum, residuals) at the end of fit; 0 for DDP
  and bf16 (bf16's cast copy of a bucket lives only during the all-reduce);
- the median wall time of an optimizer step on rank 0, for information only: the ranks share
  this machine's cores, and loopback is no network.

Writes ``results.json`` (every run), ``results.md`` (a table per world size) and
``loss_vs_bytes_<model>.png`` (held-out loss against bytes sent per rank, largest world size)
into ``--out``; ``--merge`` joins runs made apart (in pieces, on other machines) into one such record
and renders it again. The runtime package never imports this module.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import logging
import math
import os
import re
import statistics
import time
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, Strategy

from gtc_lightning import (
    ADPSGDStrategy,
    BF16AllReduceStrategy,
    BMUFGTCStrategy,
    BMUFStrategy,
    DPSGDStrategy,
    GTCStrategy,
    ModelAveragingStrategy,
    PowerSGDStrategy,
    SparseLoCoStrategy,
    parameter_checksums,
)
from gtc_lightning.algorithms.common import allreduce_bytes
from gtc_lightning.algorithms.gtc.config import resolve_density_warmup
from gtc_lightning.tools.suite_models import MODELS, heldout_loss

# GTC as every record of the suite's GTC methods measured it, whatever GTCStrategy's defaults are now: density
# 1e-2 with no density warm-up (the defaults until the warm-up became one), each rank's own Adam moments and
# words of tau alone.
# Each method pins what it measured, so that a name means one setting in every results file.
GTC = partial(GTCStrategy, density_warmup_steps=0, mean_variance=False, word_levels=1)

# Each builds a strategy from the launch settings (start_method, timeout); a GTC mode is one more line.
METHODS: dict[str, Callable[..., Strategy]] = {
    "ddp": DDPStrategy,
    "ddp_bf16": BF16AllReduceStrategy,
    # start_powerSGD_iter=2: the fewest dense steps torch allows with error feedback (GTC has none)
    "powersgd_r1": partial(PowerSGDStrategy, matrix_approximation_rank=1, start_powerSGD_iter=2),
    "powersgd_r4": partial(PowerSGDStrategy, matrix_approximation_rank=4, start_powerSGD_iter=2),
    "gtc": GTC,  # the former defaults
    # GTCStrategy() as it is now: the density warm-up over 5 % of the run (gtc_density_warmup's setting)
    "gtc_defaults": GTCStrategy,
    "gtc_5e-4": partial(GTC, target_density=5e-4),
    "gtc_1e-3": partial(GTC, target_density=1e-3),
    "gtc_3e-3": partial(GTC, target_density=3e-3),
    # Strom's GTC as the paper has it, whatever the defaults: the gradient, fixed tau, 32-bit words
    "gtc_strom_1e-2": partial(GTC, compress="gradient", tau=1e-2, coding="none"),
    # The density sweep: the update mode (the defaults' mode) and Strom's gradient mode, automatic tau, Rice
    "gtc_1e-2": partial(GTC, target_density=1e-2),
    "gtc_3e-2": partial(GTC, target_density=3e-2),
    "gtc_1e-1": partial(GTC, target_density=1e-1),
    "gtc_3e-1": partial(GTC, target_density=3e-1),
    "gtc_gradient_1e-2": partial(GTC, compress="gradient", target_density=1e-2),
    "gtc_gradient_3e-3": partial(GTC, compress="gradient", target_density=3e-3),
    "gtc_gradient_3e-2": partial(GTC, compress="gradient", target_density=3e-2),
}

# Optimizer steps per run: where DDP's held-out loss has stopped improving (see the printed curves).
STEPS = {"transformer": 200, "cnn": 400, "gru": 200, "speech_dnn": 500}
# What the suite runs unless --methods says otherwise: the dense baselines, PowerSGD, GTC's defaults, GTC
# denser and sparser, and Strom's own setting (the rest of METHODS are density points for --methods).
DEFAULT_METHODS = [
    "ddp",
    "ddp_bf16",
    "powersgd_r1",
    "powersgd_r4",
    "gtc",
    "gtc_3e-3",
    "gtc_3e-2",
    "gtc_strom_1e-2",
]


def block_period(steps: int) -> int:
    """Inner steps per block sync of the block methods on a run of ``steps``: 40 syncs a run, at least
    10 steps. DiLoCo's H = 500 comes from runs of ~88,000 steps (~180 syncs); a 2,000-step run at
    H = 500 would sync 4 times, so H follows the run's length instead (50 at 2,000 steps)."""
    return max(10, steps // 40)


# The seeds' family and the block syncs, each built for a run of ``steps`` on ``world`` ranks (their
# period follows the run's length; bmuf_gtc's GTC groups are half the ranks, BMUF across the two).
FAMILY: dict[str, Callable[..., Strategy]] = {
    "ma": lambda steps, world, **kw: ModelAveragingStrategy(period=block_period(steps), **kw),
    # DiLoCo's outer step (Nesterov SGD, lr 0.7, momentum 0.9); the inner optimizer is the model's own
    "diloco": lambda steps, world, **kw: BMUFStrategy(
        period=block_period(steps), block_lr=0.7, block_momentum=0.9, nesterov=True, **kw
    ),
    "sparseloco": lambda steps, world, **kw: SparseLoCoStrategy(period=block_period(steps), **kw),
    # SparseLoCo syncing 5x as often: at density 1/64 a 2,000-step run at H = 50 sends each element less than
    # once; at H = steps / 200 about three times
    "sparseloco_h10": lambda steps, world, **kw: SparseLoCoStrategy(period=max(2, steps // 200), **kw),
    # The same bytes per step (density / H = 1.5-1.6e-3) spent the two other ways: syncs twice as often at half
    # the density, or half as often at twice the density; on the LM they bracket sparseloco_h10's point
    "sparseloco_h5_8e-3": lambda steps, world, **kw: SparseLoCoStrategy(
        period=max(2, steps // 400), density=8e-3, **kw
    ),
    # Four times those bytes per step, at H = 5: where a compressed sync might reach DiLoCo's loss (H = 50,
    # dense) at fewer bytes than DiLoCo sends
    "sparseloco_h5_3e-2": lambda steps, world, **kw: SparseLoCoStrategy(
        period=max(2, steps // 400), density=3e-2, **kw
    ),
    "sparseloco_h20_3e-2": lambda steps, world, **kw: SparseLoCoStrategy(
        period=max(2, steps // 100), density=3e-2, **kw
    ),
    "bmuf_gtc": lambda steps, world, **kw: BMUFGTCStrategy(
        group_size=max(1, world // 2), period=block_period(steps), **kw
    ),
    "dpsgd": lambda steps, world, **kw: DPSGDStrategy(**kw),
    "adpsgd": lambda steps, world, **kw: ADPSGDStrategy(**kw),
}
FAMILY_METHODS = list(FAMILY)
def warmup(steps: int) -> int:
    """The suite's density warm-up on a run of ``steps``: what ``density_warmup_steps="auto"`` gives a Trainer."""
    return resolve_density_warmup("auto", steps)[0]


# The update mode's options under test, beside the defaults: what the residual keeps, DGC's density
# warm-up over the first 5 % of the run (DGC: 4 of ImageNet's 90 epochs), DGC's momentum masking.
MECHANISMS: dict[str, Callable[..., Strategy]] = {
    "gtc_displacement": lambda steps, world, **kw: GTC(conserve="displacement", **kw),
    "gtc_density_warmup": lambda steps, world, **kw: GTC(
        density_warmup_steps=warmup(steps), **kw
    ),
    # The same at density 3e-3, the sparsest setting within 1 % of DDP on three of the long profile's models
    # Words of 2^k tau (k < 4) beside the defaults: what an element holds far above tau drains in fewer steps
    "gtc_word_levels": lambda steps, world, **kw: GTC(density_warmup_steps=warmup(steps), word_levels=4, **kw),
    "gtc_3e-3_word_levels": lambda steps, world, **kw: GTC(
        target_density=3e-3, density_warmup_steps=warmup(steps), word_levels=4, **kw
    ),
    "gtc_1e-3_word_levels": lambda steps, world, **kw: GTC(
        target_density=1e-3, density_warmup_steps=warmup(steps), word_levels=4, **kw
    ),
    # The same with the warm-up over 1 % of the run: the 5 % warm-up's first 100 steps (a quarter of the elements
    # at first) send more than the other 1,900 at 1e-3
    "gtc_1e-3_word_levels_short_warmup": lambda steps, world, **kw: GTC(
        target_density=1e-3, density_warmup_steps=max(1, steps // 100), word_levels=4, **kw
    ),
    "gtc_3e-3_displacement": lambda steps, world, **kw: GTC(
        target_density=3e-3, conserve="displacement", **kw
    ),
    "gtc_3e-3_density_warmup": lambda steps, world, **kw: GTC(
        target_density=3e-3, density_warmup_steps=warmup(steps), **kw
    ),
    # The update mode without compression: each rank steps its own optimizer on its own gradient, and the
    # parameters are averaged densely after every step. What stays between it and DDP is the ranks' own
    # optimizer moments (a rank's Adam second moment holds its gradient's noise, W times the mean's)
    "local_moments_dense": lambda steps, world, **kw: ModelAveragingStrategy(period=1, **kw),
    # Adam's steps with an estimate of the mean gradient's second moment (the Adam models; SGD is left as it is)
    "gtc_mean_variance": lambda steps, world, **kw: GTC(mean_variance=True, **kw),
    "gtc_3e-3_mean_variance": lambda steps, world, **kw: GTC(target_density=3e-3, mean_variance=True, **kw),
    "gtc_1e-3_mean_variance": lambda steps, world, **kw: GTC(target_density=1e-3, mean_variance=True, **kw),
    # The two that helped, together
    "gtc_density_warmup_mean_variance": lambda steps, world, **kw: GTC(
        density_warmup_steps=warmup(steps), mean_variance=True, **kw
    ),
    # DGC's momentum factor masking: each rank's momentum zeroed at the elements it sent
    "gtc_momentum_masking": lambda steps, world, **kw: GTC(momentum_masking=True, **kw),
    "gtc_3e-3_momentum_masking": lambda steps, world, **kw: GTC(
        target_density=3e-3, momentum_masking=True, **kw
    ),
}
# Gradient clipping by norm (the Trainer's gradient_clip_val), per model: DDP clips the averaged gradient at c,
# GTC each rank's own gradient before it enters the residual, at c (GTC's rule) or at sqrt(N) c (DGC's
# N^-1/2 of the global threshold, in the units of a rank's mean gradient). c is the 90th percentile of the
# averaged gradient's norm over a DDP run (cnn: 0.74, seed 0), so DDP clips its spikes; a rank's own gradient
# is about twice as long on 4 ranks (median 1.16), so GTC's rule clips nearly every local step.
CLIP_NORM = {"cnn": 0.75}
# method -> (its strategy, the Trainer's gradient_clip_val in multiples of c). GTC scales the Trainer's c by
# local_clip_scale for each rank's own gradient: pinned here, so that a name means one setting whatever the
# default is.
CLIPPED: dict[str, tuple[Callable[..., Strategy], float]] = {
    "ddp_clip": (DDPStrategy, 1.0),
    "gtc_defaults_clip": (partial(GTCStrategy, local_clip_scale=1.0), 1.0),
    "gtc_defaults_clip_dgc": (partial(GTCStrategy, local_clip_scale="sqrt_world"), 1.0),
}
BUILT_FOR_THE_RUN = {**FAMILY, **MECHANISMS}
QUICK_STEPS = {"transformer": 20, "cnn": 20, "gru": 20, "speech_dnn": 40}
QUICK_MODELS = ["gru", "speech_dnn"]
STANDARD_MODELS = ["transformer", "cnn", "gru", "speech_dnn"]
# The long profile: runs long enough for a sparse method to catch up (each element is sent tens of
# times at density 1e-2), and a language model of >= 2 M parameters. Its runs are 4-15x the
# standard's; it is meant to run on its own (with --resume across sessions), 4 ranks. The CNN's task
# draws fresh images every step and DDP's held-out loss keeps falling with its budget (seed 0: 0.2214 at
# 2,000 steps, 0.1832 at 6,000, 0.1767 at 8,000), so it runs three times the others' steps; its
# 2,000-step runs stay in results.json as cells of their own.
LONG_STEPS = {"transformer": 2000, "cnn": 6000, "gru": 2000, "speech_dnn": 2000, "transformer_lm": 2000}
LONG_MODELS = list(LONG_STEPS)
TIMEOUT = timedelta(seconds=180)  # a hung collective fails the run instead of blocking for 30 min

log = logging.getLogger(__name__)


# ---- what each rank measures ---------------------------------------------------------------


class _CountingDist:
    """Stands in for ``torch.distributed`` inside torch's hook modules: every ``all_reduce`` adds
    what it puts on the wire per rank to ``counter[0]``, then runs as usual."""

    def __init__(self, counter: list[int]) -> None:
        self._counter = counter

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
        world = dist.get_world_size(group)
        self._counter[0] += allreduce_bytes(tensor.numel(), world, tensor.element_size())
        return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


@contextmanager
def count_hook_allreduces():
    """Count the bytes of every all-reduce torch's PowerSGD hook issues (also its dense warm-up
    through ``default_hooks``); yields the one-element counter. Only in the rank's process."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    counter = [0]
    saved = (powerSGD_hook.dist, default_hooks.dist)
    powerSGD_hook.dist = default_hooks.dist = _CountingDist(counter)
    try:
        yield counter
    finally:
        powerSGD_hook.dist, default_hooks.dist = saved


def tensor_bytes(root: Any) -> int:
    """Bytes of the distinct tensor storages reachable from ``root`` (through its own attributes,
    then dicts, lists, tuples and dataclasses); each storage once."""
    seen_storages: set[int] = set()
    seen_objects: set[int] = set()
    total = 0
    stack = [root]
    while stack:
        obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            if storage.data_ptr() not in seen_storages:
                seen_storages.add(storage.data_ptr())
                total += storage.nbytes()
            continue
        if id(obj) in seen_objects or isinstance(obj, (str, bytes, int, float, bool, type(None))):
            continue
        seen_objects.add(id(obj))
        if isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set)):
            stack.extend(obj)
        elif dataclasses.is_dataclass(obj):
            stack.extend(getattr(obj, f.name) for f in dataclasses.fields(obj))
        elif hasattr(obj, "__dict__") and obj is root:
            stack.extend(vars(obj).values())
    return total


def own_memory_bytes(strategy: Strategy) -> int:
    """The method's own buffers beyond DDP's, in bytes on this rank."""
    if isinstance(strategy, GTCStrategy):
        state = strategy.gtc_state
        # _applied holds references to DDP's own gradient buckets (the last decode), not GTC's memory.
        return tensor_bytes({k: v for k, v in vars(state).items() if k != "_applied"})
    if isinstance(strategy, PowerSGDStrategy):
        state = strategy.powersgd_state
        return tensor_bytes([state.error_dict, state.p_memory_dict, state.q_memory_dict])
    family = getattr(strategy, "_state", None)  # the family's state: block start, Δ, residuals, copies
    if family is not None and hasattr(type(strategy), "sync_stats"):
        return tensor_bytes(vars(family))
    return 0  # DDP; bf16's cast copy of a bucket exists only while it is all-reduced


STATS = ("gtc_stats", "sync_stats")  # a strategy's own counts of what it sent


def stats_bytes_sent(strategy: Strategy) -> float | None:
    """The bytes a strategy that counts them has sent on this rank (the sum over its ``gtc_stats`` and
    ``sync_stats``: GTC's words, the family's syncs, both for BMUF-GTC); ``None`` for one that does not."""
    names = [name for name in STATS if hasattr(type(strategy), name)]
    if not names:
        return None
    totals = [getattr(strategy, name)["total"] for name in names]
    return float(sum(t["bytes_sent"] for t in totals if t is not None))


def registered_hook(strategy: Strategy) -> str:
    """The name of the communication hook DDP ran (its own logging data), so a run shows which
    exchange it measured; ``"allreduce"`` for DDP's built-in one."""
    try:
        return strategy.model._get_ddp_logging_data().get("comm_hook", "allreduce")
    except AttributeError:  # not DDP, or a torch without the logging data
        return "unknown"


class SuiteProbe(L.Callback):
    """Runs in every rank: held-out loss (rank 0), bytes sent, step times, memory, a parameter
    checksum; writes ``rank{r}.json`` into ``out_dir`` at the end of fit.

    Args:
        out_dir: where the ranks write their records.
        eval_steps: optimizer steps after which rank 0 scores the held-out set (0: before training).
    """

    def __init__(self, out_dir: Path, eval_steps: list[int]) -> None:
        self.out_dir = Path(out_dir)
        self.eval_steps = set(eval_steps)
        self.curve: list[tuple[int, float, float]] = []  # (step, held-out loss, bytes sent so far)
        self._evaluated_at: int | None = None  # the step of the last evaluation
        self.step_seconds: list[float] = []
        self._counting = None
        self._counter = [0]

    def setup(self, trainer, pl_module, stage):
        # Lightning's advice on loader workers and its own deprecations, once per run and rank: noise here.
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        warnings.filterwarnings("ignore", ".*treespec.*")
        if isinstance(trainer.strategy, PowerSGDStrategy):
            self._counting = count_hook_allreduces()
            self._counter = self._counting.__enter__()

    def teardown(self, trainer, pl_module, stage):
        if self._counting is not None:
            self._counting.__exit__(None, None, None)
            self._counting = None

    def numel(self, pl_module) -> int:
        return sum(p.numel() for p in pl_module.parameters() if p.requires_grad)

    def bytes_sent(self, trainer, pl_module) -> float:
        """Bytes this rank has put on the wire for gradients since the start of fit."""
        strategy, world = trainer.strategy, trainer.world_size
        counted = stats_bytes_sent(strategy)
        if counted is not None:
            return counted
        if isinstance(strategy, PowerSGDStrategy):
            return float(self._counter[0])
        element = 2 if isinstance(strategy, BF16AllReduceStrategy) else 4
        return float(trainer.global_step * allreduce_bytes(self.numel(pl_module), world, element))

    def _evaluate(self, trainer, pl_module) -> None:
        """Rank 0 scores the model a validation loop would see: every rank calls the strategy's
        ``on_validation_start``/``on_validation_end`` around it (the local-step family's
        ``average_eval``: the mean of the ranks' models; AD-PSGD first finishes its exchanges)."""
        strategy = trainer.strategy
        self._evaluated_at = trainer.global_step  # on every rank (the curve is rank 0's)
        strategy.on_validation_start()
        try:
            if trainer.global_rank == 0:
                self.curve.append(
                    (trainer.global_step, heldout_loss(pl_module), self.bytes_sent(trainer, pl_module))
                )
        finally:
            strategy.on_validation_end()

    def on_train_start(self, trainer, pl_module):
        if 0 in self.eval_steps:
            self._evaluate(trainer, pl_module)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._started = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.step_seconds.append(time.perf_counter() - self._started)
        if trainer.global_step in self.eval_steps:
            self._evaluate(trainer, pl_module)

    def on_train_end(self, trainer, pl_module):
        if self._evaluated_at != trainer.global_step:
            self._evaluate(trainer, pl_module)
        strategy = trainer.strategy
        record = {
            "rank": trainer.global_rank,
            "steps": trainer.global_step,
            "numel": self.numel(pl_module),
            "bytes_sent": self.bytes_sent(trainer, pl_module),
            "memory_bytes": own_memory_bytes(strategy),
            "step_seconds": self.step_seconds,
            "curve": self.curve,
            "checksum": parameter_checksums(pl_module.parameters()).tolist(),
            "gtc_total": strategy.gtc_stats["total"] if isinstance(strategy, GTCStrategy) else None,
            "comm_hook": registered_hook(strategy),
        }
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


# ---- one run in the parent ----------------------------------------------------------------


@contextmanager
def restore_environment(*names: str):
    """Put these environment variables back as they were: the fork launcher writes MASTER_PORT
    into the parent's environment (the next run must pick a free port of its own) and
    ``seed_everything`` writes PL_GLOBAL_SEED."""
    before = {name: os.environ.get(name) for name in names}
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def run_cell(
    model_name: str, method: str, world_size: int, seed: int, steps: int, evals: int, out_dir: Path
) -> dict:
    """Train one model with one method on ``world_size`` forked CPU ranks; return its record.

    Returns:
        model, method, world_size, seed, steps, numel, best_loss, final_loss, curve, bytes per
        step and per run (mean over ranks), the fp32 / bf16 ring all-reduce's bytes per step and the
        ratios to them, step time, memory per parameter, replicas_identical, comm_hook, wall_s; for
        GTC the mean density (words per rank and gradient element per step) and its dense steps.
    """
    run_dir = out_dir / "runs" / f"{model_name}-{method}-w{world_size}-s{seed}"
    run_dir.mkdir(parents=True, exist_ok=True)
    eval_steps = sorted({round(k * steps / evals) for k in range(evals + 1)})
    with restore_environment("MASTER_PORT", "PL_GLOBAL_SEED"):
        model, trainer = _build(model_name, method, world_size, seed, steps, SuiteProbe(run_dir, eval_steps))
        start = time.perf_counter()
        trainer.fit(model)
        wall = time.perf_counter() - start
    ranks = [json.loads((run_dir / f"rank{r}.json").read_text()) for r in range(world_size)]
    return summarise(model_name, method, world_size, seed, model.task.best_loss, ranks, wall)


def clip_threshold(model_name: str, method: str) -> float | None:
    """The Trainer's ``gradient_clip_val`` for this run: None unless ``method`` is one of :data:`CLIPPED`."""
    if method not in CLIPPED:
        return None
    return CLIP_NORM[model_name] * CLIPPED[method][1]


def _build(
    model_name: str, method: str, world_size: int, seed: int, steps: int, probe: SuiteProbe
) -> tuple[L.LightningModule, L.Trainer]:
    """The seeded model, its task drawn for this run, and a Trainer on ``world_size`` forked CPU ranks."""
    L.seed_everything(seed, verbose=False)  # PL_GLOBAL_SEED: the DistributedSampler's shuffling
    # exactly the samples the run consumes: no sample seen twice
    model = MODELS[model_name](train_size=steps * batch_size(model_name) * world_size, seed=seed, steps=steps)
    clip = clip_threshold(model_name, method)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=(
            BUILT_FOR_THE_RUN[method](steps, world_size, start_method="fork", timeout=TIMEOUT)
            if method in BUILT_FOR_THE_RUN
            else CLIPPED[method][0](start_method="fork", timeout=TIMEOUT)
            if method in CLIPPED
            else METHODS[method](start_method="fork", timeout=TIMEOUT)
        ),
        max_steps=steps,
        max_epochs=1,
        gradient_clip_val=clip,
        gradient_clip_algorithm="norm",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[probe],
        default_root_dir=probe.out_dir,
    )
    return model, trainer


def batch_size(model_name: str) -> int:
    """The model's batch per rank (its ``batch_size`` default)."""
    return inspect.signature(MODELS[model_name]).parameters["batch_size"].default


def summarise(
    model_name: str, method: str, world_size: int, seed: int, best_loss: float, ranks: list[dict], wall: float
) -> dict:
    """One run's record from its ranks' records (bytes: the mean over ranks; the rest: rank 0's)."""
    rank0 = ranks[0]
    steps, numel = rank0["steps"], rank0["numel"]
    per_step = statistics.fmean(r["bytes_sent"] for r in ranks) / steps
    fp32, bf16 = allreduce_bytes(numel, world_size, 4), allreduce_bytes(numel, world_size, 2)
    record = {
        "model": model_name,
        "method": method,
        "world_size": world_size,
        "seed": seed,
        "steps": steps,
        "numel": numel,
        "best_loss": best_loss,
        "initial_loss": rank0["curve"][0][1] if rank0["curve"][0][0] == 0 else None,
        "final_loss": rank0["curve"][-1][1],
        "curve": rank0["curve"],  # (step, held-out loss, rank 0's bytes sent so far)
        "bytes_per_step": per_step,
        "bytes_total": per_step * steps,
        "allreduce_fp32_bytes_per_step": fp32,
        "allreduce_bf16_bytes_per_step": bf16,
        "ratio_fp32": fp32 / per_step if per_step else math.inf,
        "ratio_bf16": bf16 / per_step if per_step else math.inf,
        "step_seconds": statistics.median(rank0["step_seconds"]),
        "memory_bytes_per_param": rank0["memory_bytes"] / numel,
        "replicas_identical": all(r["checksum"] == rank0["checksum"] for r in ranks),
        "comm_hook": rank0["comm_hook"],
        "wall_s": wall,
    }
    if rank0["gtc_total"] is not None:
        record["gtc_bytes_sent"] = [r["gtc_total"]["bytes_sent"] for r in ranks]
        record["gtc_allreduce_fp32_bytes"] = rank0["gtc_total"]["allreduce_fp32_bytes"]
        record["density"] = statistics.fmean(r["gtc_total"]["words"] for r in ranks) / (steps * numel)
        record["gtc_dense_steps"] = rank0["gtc_total"]["dense_steps"]  # the dense fallback's steps
    return record


# ---- reports ----------------------------------------------------------------------------------


def _human(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def _model_names(results: list[dict]) -> list[str]:
    """Each successful run's model, with its budget (``"cnn (6000 steps)"``) where ``results`` hold runs of
    that model at more than one number of steps (a budget that grew keeps its earlier runs beside the new)."""
    ok = [r for r in results if "error" not in r]
    budgets: dict[str, set[int]] = {}
    for r in ok:
        budgets.setdefault(r["model"], set()).add(r["steps"])
    return [f"{r['model']} ({r['steps']} steps)" if len(budgets[r["model"]]) > 1 else r["model"] for r in ok]


def _group(results: list[dict]) -> dict[tuple, list[dict]]:
    """Successful runs by (world size, model, method), in the order they ran; the model as
    :func:`_model_names` names it."""
    groups: dict[tuple, list[dict]] = {}
    for r, name in zip([r for r in results if "error" not in r], _model_names(results)):
        groups.setdefault((r["world_size"], name, r["method"]), []).append(r)
    return groups


def _table_row(name: str, runs: list[dict], ddp_mean: float | None) -> str:
    """One method on one model (``name``) and world size, over its seeds."""
    losses = [r["final_loss"] for r in runs]
    mean = statistics.fmean(losses)
    vs = f"{100 * (mean - ddp_mean) / ddp_mean:+.1f} %" if ddp_mean else "-"
    cells = [
        name,
        runs[0]["method"],
        f"{mean:.4f} [{min(losses):.4f}-{max(losses):.4f}]",
        vs,
        _human(statistics.fmean(r["bytes_per_step"] for r in runs)),
        f"{statistics.fmean(r['ratio_fp32'] for r in runs):.1f}",
        f"{statistics.fmean(r['ratio_bf16'] for r in runs):.1f}",
        f"{1000 * statistics.median(r['step_seconds'] for r in runs):.1f}",
        f"{statistics.fmean(r['memory_bytes_per_param'] for r in runs):.2f}",
    ]
    return "| " + " | ".join(cells) + " |"


def report_markdown(results: list[dict]) -> str:
    """The models, then one table per world size (rows: model x method), then DDP's last
    evaluations (whether it reached a plateau) and any failed runs."""
    groups = _group(results)
    models = list(dict.fromkeys(_model_names(results)))
    worlds = sorted({r["world_size"] for r in results})
    lines = [
        "## Models",
        "",
        "| model | parameters | steps | batch per rank | best possible loss | initial loss |",
        "|---|---|---|---|---|---|",
    ]
    for m in models:
        runs = [r for (_, gm, _), group in groups.items() if gm == m for r in group]
        if runs:
            initial = statistics.fmean(r["initial_loss"] for r in runs)
            lines.append(
                f"| {m} | {runs[0]['numel']:,} | {runs[0]['steps']} | {batch_size(runs[0]['model'])} | "
                f"{runs[0]['best_loss']:.4f} | {initial:.4f} |"
            )
    for w in worlds:
        header = (
            "| model | method | held-out loss mean [min-max] | vs DDP | bytes/step/rank | x fewer than fp32 "
            "| x fewer than bf16 | step ms | own memory B/param |"
        )
        lines += ["", f"## {w} ranks", "", header, "|---|---|---|---|---|---|---|---|---|"]
        for m in models:
            ddp = groups.get((w, m, "ddp"))
            ddp_mean = statistics.fmean(r["final_loss"] for r in ddp) if ddp else None
            lines += [
                _table_row(m, runs, ddp_mean) for (gw, gm, _), runs in groups.items() if (gw, gm) == (w, m)
            ]
    fallback = [
        f"- {m} {method}, {w} ranks: {statistics.fmean(r['gtc_dense_steps'] for r in runs):.0f} "
        f"of {runs[0]['steps']}"
        for (w, m, method), runs in groups.items()
        if runs[0].get("gtc_dense_steps")
    ]
    if fallback:
        lines += [
            "",
            "GTC's dense fallback (steps where words would have outweighed an all-reduce; mean):",
            "",
        ]
        lines += fallback
    lines += ["", "## DDP's held-out loss at its last evaluations (mean over seeds)", ""]
    for (w, m, method), runs in groups.items():
        if method == "ddp":
            points = zip(*[r["curve"][-4:] for r in runs])
            shown = ", ".join(f"step {p[0][0]}: {statistics.fmean(q[1] for q in p):.4f}" for p in points)
            lines.append(f"- {m}, {w} ranks: {shown}")
    failed = [r for r in results if "error" in r]
    if failed:
        lines += ["", "## Failed runs", ""]
        lines += [
            f"- {r['model']} {r['method']} W={r['world_size']} seed {r['seed']}: {r['error']}" for r in failed
        ]
    not_identical = [r for r in results if "error" not in r and not r["replicas_identical"]]
    if not_identical:
        lines += [
            "",
            "Replicas not bit-identical at the end: "
            + ", ".join(
                f"{r['model']} {r['method']} W={r['world_size']} seed {r['seed']}" for r in not_identical
            ),
        ]
    return "\n".join(lines) + "\n"


def plot_loss_vs_bytes(results: list[dict], out_dir: Path) -> list[Path]:
    """One PNG per model: held-out loss against bytes sent per rank (log x) at the largest world
    size; per method the seeds' mean curve and its final point with the seeds' range."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = _group(results)
    paths = []
    for m in dict.fromkeys(gm for (_, gm, _) in groups):
        worlds = [w for (w, gm, _) in groups if gm == m]
        if not worlds:
            continue
        w = max(worlds)
        fig, ax = plt.subplots(figsize=(6.4, 4.4))
        for (gw, gm, method), runs in groups.items():
            if (gw, gm) != (w, m):
                continue
            # the seeds' mean curve (the step-0 point has sent nothing: no place on a log axis)
            points = [list(p) for p in zip(*[r["curve"] for r in runs])]
            xs = [statistics.fmean(q[2] for q in p) for p in points if p[0][0] > 0]
            ys = [statistics.fmean(q[1] for q in p) for p in points if p[0][0] > 0]
            line = ax.plot(xs, ys, lw=0.8, alpha=0.6)[0]
            losses, sent = [r["final_loss"] for r in runs], [r["bytes_total"] for r in runs]
            mean_loss, mean_sent = statistics.fmean(losses), statistics.fmean(sent)
            ax.errorbar(
                mean_sent,
                mean_loss,
                yerr=[[mean_loss - min(losses)], [max(losses) - mean_loss]],
                xerr=[[mean_sent - min(sent)], [max(sent) - mean_sent]],
                fmt="o",
                color=line.get_color(),
                capsize=3,
                label=method,
            )
        best = next(runs[0]["best_loss"] for (gw, gm, _), runs in groups.items() if (gw, gm) == (w, m))
        ax.axhline(best, ls="--", color="grey", lw=0.8, label=f"best possible {best:.3f}")
        # the final points matter: show the curves' ends, down to the best possible loss
        worst = max(
            r["final_loss"] for (gw, gm, _), runs in groups.items() if (gw, gm) == (w, m) for r in runs
        )
        ax.set_ylim(best - 0.05 * (worst - best), best + 2 * (worst - best))
        ax.set_xscale("log")
        ax.set_xlabel(f"bytes sent per rank in the run ({w} ranks)")
        ax.set_ylabel("held-out loss (nats)")
        ax.set_title(f"{m}: held-out loss against bytes sent (seeds' mean, range)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"loss_vs_bytes_{re.sub(r'[^A-Za-z0-9_]+', '_', m).strip('_')}.png"  # "cnn_6000_steps"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


# ---- the command --------------------------------------------------------------------------------


@contextmanager
def quiet_lightning():
    """Lightning's per-run banners and the strategies' configuration lines at WARNING, for the run."""
    names = ("lightning.pytorch", "lightning.fabric", "gtc_lightning")
    levels = {name: logging.getLogger(name).level for name in names}
    for name in names:
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        yield
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def progress_line(record: dict) -> str:
    """One finished run: its cell, held-out loss, bytes per step and ratios, step time."""
    cell = f"{record['model']:<11} {record['method']:<14} W={record['world_size']} seed={record['seed']}"
    if "error" in record:
        return f"{cell}: FAILED {record['error']}"
    return (
        f"{cell}: held-out {record['final_loss']:.4f} (best {record['best_loss']:.4f}), "
        f"{_human(record['bytes_per_step'])}/step, {record['ratio_fp32']:.1f}x fewer than fp32, "
        f"{record['ratio_bf16']:.1f}x than bf16, {1000 * record['step_seconds']:.1f} ms/step, "
        f"{record['wall_s']:.1f} s"
    )


def _cell(record: dict) -> tuple:
    """A run's cell: model, method, world size, seed and budget (runs of one model at two budgets are two cells)."""
    return (record["model"], record["method"], record["world_size"], record["seed"], record.get("steps"))


def resumed(path: Path, cells: list[tuple]) -> list[dict]:
    """The records of ``path`` (an earlier run's results.json) to keep: those of this invocation's
    cells (a cell names its budget), without an error. A missing file keeps nothing.

    Raises:
        ValueError: when ``path`` is not a list of run records (naming it and the fix).
    """
    if not path.is_file():
        return []
    try:
        records = json.loads(path.read_text())
        kept = [
            r
            for r in records
            if "error" not in r and _cell(r) in set(cells)
        ]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise ValueError(
            f"--resume: {path} is not a model suite's results.json ({error}); move it away or drop --resume"
        ) from None
    return kept


def merged(target: list[dict], sources: dict[Path, list[dict]]) -> tuple[list[dict], list[str]]:
    """``target``'s records with every error-free record of ``sources`` merged in: a record of a cell
    ``target`` holds replaces it in place (the newer run wins), any other is appended. Failed runs of
    the sources are left out.

    Returns:
        the merged records and one line per source record (what became of it).
    """
    records = list(target)
    where = {_cell(r): i for i, r in enumerate(records)}
    lines = []
    for path, runs in sources.items():
        for record in runs:
            cell = _cell(record)
            name = "/".join(str(part) for part in cell)
            if "error" in record:
                lines.append(f"{path}: {name} left out (failed: {record['error']})")
            elif cell in where:
                records[where[cell]] = record
                lines.append(f"{path}: {name} replaces the run of the same cell")
            else:
                where[cell] = len(records)
                records.append(record)
                lines.append(f"{path}: {name} added")
    return records, lines


def _records(path: Path, flag: str) -> list[dict]:
    """The run records of a results.json, or a ValueError naming ``path``, ``flag`` and the fix."""
    try:
        records = json.loads(path.read_text())
        for r in records:
            _cell(r)
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as error:
        raise ValueError(
            f"{flag}: {path} is not a model suite's results.json ({type(error).__name__}: {error}); "
            "give the --out directory of a model suite run"
        ) from None
    return records


def merge_main(out: Path, sources: list[Path]) -> list[dict]:
    """``--merge``: the runs of other invocations' ``--out`` directories merged into ``out``'s
    results.json, and its results.md and plots rendered again; nothing is run."""
    target = _records(out / "results.json", "--out") if (out / "results.json").exists() else []
    found = {src: _records(src / "results.json" if src.is_dir() else src, "--merge") for src in sources}
    results, lines = merged(target, found)
    print("\n".join(lines), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text(report_markdown(results))
    plots = plot_loss_vs_bytes(results, out)
    print(f"wrote {out / 'results.json'} ({len(results)} runs), {out / 'results.md'} and {len(plots)} plots")
    return results


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add(
        "--quick",
        action="store_true",
        help=f"smoke test: models {QUICK_MODELS}, seed 0, 2 ranks, a tenth of the steps, 2 evaluations",
    )
    add(
        "--profile",
        choices=["standard", "long"],
        default="standard",
        help=f"standard: models {STANDARD_MODELS} at {STEPS} steps; long: models {LONG_MODELS} at "
        f"{LONG_STEPS} steps (hours on a 2-core machine: use --resume)",
    )
    add("--out", type=Path, default=Path("model_suite"), help="where results.json/.md and the plots go")
    add(
        "--resume",
        action="store_true",
        help="keep the runs already in OUT/results.json (those without an error) and run the rest",
    )
    add(
        "--merge",
        nargs="+",
        type=Path,
        metavar="DIR",
        help="run nothing: merge the runs of these --out directories (or results.json files) into OUT's "
        "results.json (a cell run again replaces the old run) and render OUT's results.md and plots again",
    )
    add("--models", nargs="+", choices=list(MODELS), help="default: the profile's (--quick: a fast two)")
    add(
        "--methods",
        nargs="+",
        choices=[*METHODS, *BUILT_FOR_THE_RUN, *CLIPPED],
        default=DEFAULT_METHODS,
        help=f"default: {' '.join(DEFAULT_METHODS)}; the family and the block syncs: {' '.join(FAMILY_METHODS)} "
        f"(periods: block_period); the update mode's options under test: {' '.join(MECHANISMS)}; clipped by norm "
        f"(models {sorted(CLIP_NORM)}): {' '.join(CLIPPED)}",
    )
    add("--world-sizes", nargs="+", type=int, help="ranks per run (default 2 4; --quick: 2)")
    add("--seeds", nargs="+", type=int, help="default 0 1 2 (--quick: 0)")
    add("--evals", type=int, help="held-out evaluations during a run, for the curve (default 6; --quick: 2)")
    return parser


def main(argv: list[str] | None = None) -> list[dict]:
    """Run every (world size, model, seed, method) cell, print one line per run and the tables.

    Returns:
        every run's record (a failed run: its cell and ``error``).
    """
    # Forked ranks hang in their first parallel op if the parent ran a multi-threaded OpenMP op.
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    args = build_parser().parse_args(argv)
    if args.merge:
        return merge_main(args.out, args.merge)
    long = args.profile == "long"
    if args.quick and long:
        raise ValueError(
            "--quick and --profile long: choose one (--quick is the CI smoke test of the standard profile)"
        )
    models = args.models or (QUICK_MODELS if args.quick else LONG_MODELS if long else STANDARD_MODELS)
    worlds = args.world_sizes or ([2] if args.quick else [4] if long else [2, 4])
    seeds = args.seeds if args.seeds is not None else ([0] if args.quick else [0, 1, 2])
    evals = args.evals or (2 if args.quick else 10 if long else 6)
    steps = QUICK_STEPS if args.quick else LONG_STEPS if long else STEPS
    if min(worlds) < 2:
        raise ValueError(f"--world-sizes {worlds}: every run needs at least 2 ranks to exchange anything")
    missing = [m for m in models if m not in steps]
    if missing:
        raise ValueError(f"--models {missing}: not in the {args.profile} profile; use --profile long")
    unclipped = sorted({m for m in models for meth in args.methods if meth in CLIPPED and m not in CLIP_NORM})
    if unclipped:
        clipped = [meth for meth in args.methods if meth in CLIPPED]
        raise ValueError(
            f"--methods {clipped} on --models {unclipped}: no clipping threshold for these models "
            f"(CLIP_NORM has {sorted(CLIP_NORM)}); run the clipped methods on those models only"
        )
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    # Seed by seed: a suite stopped part way has every method of the seeds it finished.
    cells = [(m, meth, w, s, steps[m]) for w in worlds for s in seeds for m in models for meth in args.methods]
    results: list[dict] = resumed(out / "results.json", cells) if args.resume else []
    done = {_cell(r) for r in results}
    shape = f"{len(models)} models x {len(args.methods)} methods x {len(seeds)} seeds x world sizes {worlds}"
    print(f"model suite ({args.profile}): {len(cells)} runs ({shape}), {len(done)} kept -> {out}", flush=True)
    start = time.perf_counter()
    with quiet_lightning():
        for i, cell in enumerate(cells, 1):
            if cell in done:
                continue
            try:
                record = run_cell(*cell, evals, out)
            except Exception as error:  # noqa: BLE001  (one failed cell must not lose the others)
                record = dict(zip(("model", "method", "world_size", "seed", "steps"), cell))
                record["error"] = f"{type(error).__name__}: {error}"
            print(f"[{i}/{len(cells)}] {progress_line(record)}", flush=True)
            results.append(record)
            (out / "results.json").write_text(json.dumps(results, indent=1))  # partial results survive
    table = report_markdown(results)
    (out / "results.md").write_text(table)
    plots = plot_loss_vs_bytes(results, out)
    print(table)
    print(
        f"wrote {out / 'results.json'}, {out / 'results.md'} and {len(plots)} plots in "
        f"{time.perf_counter() - start:.0f} s",
        flush=True,
    )
    return results


def cli() -> None:
    """The ``gtc-model-suite`` command: :func:`main` without its return value (an exit status of 0)."""
    main()


if __name__ == "__main__":
    main()
