"""Periodic model averaging, torch only: local optimizer steps, and every K of them the ranks'
parameters averaged (Su, Chen & Xu, "Experiments on Parallel Training of Deep Neural Network using
Model Averaging", 2015). The steps are numbered in
:mod:`gtc_lightning.strategies.averaging`, which wires this state and hook into Lightning.

The flat copies and collectives here (:func:`flatten`, :func:`all_mean`, :func:`broadcast_`), the
statistics (:class:`SyncStats`) and the state (:class:`AveragingState`, whose :meth:`~AveragingState.update`
turns the ranks' mean into the model the next period starts from) are what BMUF
(:mod:`.bmuf`) and D-PSGD (:mod:`.dpsgd`) build on. Bytes are counted as the collectives put them on
the wire per rank, as for GTC's :class:`~gtc_lightning.algorithms.gtc.stats.StepStats`.
"""

import functools
import logging
import math
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.optim import Optimizer

from gtc_lightning.algorithms.common import all_gather_equal, allreduce_bytes, check_int
from gtc_lightning.algorithms.hooks import no_comm_hook

log = logging.getLogger(__name__)

OPTIMIZER_STATES = ("keep", "reset", "average")
TOTAL_KEYS = (
    "steps",
    "syncs",
    "warmup_steps",
    "bytes_sent",
    "bytes_received",
    "allreduce_fp32_bytes",
    "exchange_s",
)


# ---- flat copies and the collectives on them -------------------------------------------------------


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``[sum of numels]``: the tensors back to back in their common dtype (one collective for all)."""
    dtype = functools.reduce(torch.promote_types, (t.dtype for t in tensors))
    return torch.cat([t.detach().reshape(-1).to(dtype) for t in tensors])


def unflatten_(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy ``flat`` back into ``tensors`` (each in its own dtype)."""
    with torch.no_grad():
        for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
            t.copy_(part.view_as(t))


def all_mean(tensors: list[torch.Tensor], group: dist.ProcessGroup | None) -> tuple[torch.Tensor, int]:
    """The mean over ``group`` of ``tensors``, flat (divided before the sum, as torch's model
    averager does, so that low-precision sums do not overflow), and the bytes this rank sent (as
    many as it received) in a ring all-reduce."""
    flat = flatten(tensors)
    size = dist.get_world_size(group)
    flat.div_(size)
    dist.all_reduce(flat, group=group)
    return flat, allreduce_bytes(flat.numel(), size, flat.element_size())


def broadcast_(tensors: list[torch.Tensor], src: int, group: dist.ProcessGroup | None) -> tuple[int, int]:
    """Overwrite ``tensors`` with global rank ``src``'s, within ``group``; returns (sent, received)
    bytes: the source sends the flat copy to each of the others (gloo's one-to-all; NCCL's ring
    pipelines it, each rank forwarding it once: the same total)."""
    flat = flatten(tensors)
    dist.broadcast(flat, src=src, group=group)
    unflatten_(flat, tensors)
    size = flat.numel() * flat.element_size()
    if dist.get_rank() == src:
        return (dist.get_world_size(group) - 1) * size, 0
    return 0, size


def optimizer_moments(optimizers: Iterable[Optimizer]) -> list[torch.Tensor]:
    """The optimizers' per-element state (momentum buffers, Adam's moments: floating tensors shaped
    like their parameter), in parameter order; scalars such as step counts are left out."""
    out = []
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = optimizer.state.get(p, {})
                out += [
                    state[key]
                    for key in sorted(state)
                    if torch.is_tensor(state[key])
                    and state[key].is_floating_point()
                    and state[key].shape == p.shape
                ]
    return out


# ---- statistics -------------------------------------------------------------------------------------


@dataclass
class SyncStats:
    """What one optimizer step communicated on this rank, counted as the collectives send it.

    Attributes:
        step: 1-based optimizer step.
        mode: ``"warmup"`` (DDP's dense gradient all-reduce), ``"local"`` (nothing sent) or
            ``"sync"`` (parameters averaged, or BMUF's block update).
        numel: trainable parameter elements of the model.
        world_size: ranks training the model (what a dense all-reduce would span).
        bytes_sent: bytes this rank sent (the all-reduces of the sync, a broadcast, a header).
        bytes_received: bytes this rank received.
        exchange_s: host seconds in the sync (on CUDA the collectives may still run after it).
    """

    step: int
    mode: str
    numel: int
    world_size: int
    bytes_sent: int
    bytes_received: int
    exchange_s: float

    @property
    def allreduce_fp32_bytes(self) -> int:
        """What DDP's fp32 ring all-reduce of the gradient sends per rank on every step."""
        return allreduce_bytes(self.numel, self.world_size, 4)

    def as_dict(self) -> dict:
        return {**asdict(self), "allreduce_fp32_bytes": self.allreduce_fp32_bytes}


# ---- the state and the hook -------------------------------------------------------------------------


class AveragingState:
    """State of periodic model averaging: hyper-parameters, the step counter and statistics.

    Args:
        period: K, local optimizer steps between two syncs.
        warmup_steps: optimizer steps of dense gradient all-reduce before the local steps start.
        optimizer_state: at a sync, ``"keep"`` each rank's optimizer state, ``"reset"`` it (momentum
            and Adam's moments restart from zero) or ``"average"`` its per-element tensors too.
        process_group: the group the parameters are averaged over (``None``: all ranks).
        member: whether this rank takes part in the averaging (BMUF-GTC: the representatives).
        spread: ``(source global rank, group)``: after the averaging the source broadcasts the model
            within that group (BMUF-GTC: the representative to its group); ``None``: no broadcast.
        world_size: ranks training the model, for the dense baseline; ``None``: ``process_group``'s.
    """

    def __init__(
        self,
        period: int,
        warmup_steps: int = 0,
        optimizer_state: str = "keep",
        process_group: dist.ProcessGroup | None = None,
        member: bool = True,
        spread: tuple[int, dist.ProcessGroup] | None = None,
        world_size: int | None = None,
    ) -> None:
        check_int("period", period, 1, "local optimizer steps between two syncs")
        check_int("warmup_steps", warmup_steps, 0, "dense gradient all-reduce steps; 0 starts local at once")
        if optimizer_state not in OPTIMIZER_STATES:
            raise ValueError(f"Expect optimizer_state in {OPTIMIZER_STATES}, got {optimizer_state!r}")
        # The hyper-parameters.
        self.period = period
        self.sync_interval = period  # optimizer steps between two syncs (BMUF's fragments sync more often)
        self.warmup_steps = warmup_steps
        self.optimizer_state = optimizer_state
        self.process_group = process_group
        self.member = member
        self.spread = spread
        self.world_size = world_size if world_size is not None else dist.get_world_size(process_group)
        # The internal state.
        self.step = 0
        # The statistics.
        self.last: SyncStats | None = None
        self.totals: dict[str, float] = {key: 0 for key in TOTAL_KEYS}

    def begin(self, parameters: list[torch.Tensor]) -> None:
        """The replicas are identical and the first period starts from ``parameters`` (at setup, or
        after the dense warmup). Model averaging keeps nothing of it; BMUF keeps it as W_global."""

    def update(self, mean: torch.Tensor) -> torch.Tensor:
        """The flat model the next period starts from, given the flat mean of the ranks' models:
        for model averaging, the mean itself."""
        return mean

    def after_step(self, params: list[torch.Tensor], optimizers: list[Optimizer]) -> SyncStats:
        """Count one optimizer step (call it after the step on every rank); sync when it ends a period.

        Args:
            params: the trainable parameters as they were at setup, the same list every step
                (``toggle_optimizer`` turns ``requires_grad`` off for a while; the whole model is averaged).
            optimizers: the strategy's optimizers (their state is reset or averaged at a sync).
        """
        self.step += 1
        numel = sum(p.numel() for p in params)
        record = functools.partial(SyncStats, step=self.step, numel=numel, world_size=self.world_size)
        if self.step <= self.warmup_steps:
            dense = allreduce_bytes(numel, self.world_size)
            stats = record(mode="warmup", bytes_sent=dense, bytes_received=dense, exchange_s=0.0)
            if self.step == self.warmup_steps:
                self.begin(params)
        elif (self.step - self.warmup_steps) % self.sync_interval:
            stats = record(mode="local", bytes_sent=0, bytes_received=0, exchange_s=0.0)
        else:
            start = time.perf_counter()
            sent, received = self.exchange(params, optimizers)
            stats = record(
                mode="sync", bytes_sent=sent, bytes_received=received, exchange_s=time.perf_counter() - start
            )
        self._record(stats)
        return stats

    def exchange(self, params: list[torch.Tensor], optimizers: list[Optimizer]) -> tuple[int, int]:
        """Step 3: average (and update) the model, then the optimizer state; returns (sent, received)."""
        sent = received = 0
        moments = optimizer_moments(optimizers) if self.optimizer_state == "average" else []
        if self.member:
            mean, n = all_mean(params, self.process_group)
            unflatten_(self.update(mean), params)
            sent, received = n, n
            if self.optimizer_state == "average":
                n = self._check_moments(moments, params[0].device)
                sent, received = sent + n, received + n
                if moments:
                    mean, n = all_mean(moments, self.process_group)
                    unflatten_(mean, moments)
                    sent, received = sent + n, received + n
        if self.spread is not None:
            n_sent, n_received = broadcast_(params + moments, *self.spread)
            sent, received = sent + n_sent, received + n_received
        if self.optimizer_state == "reset":
            for optimizer in optimizers:
                optimizer.state.clear()
        return sent, received

    def _check_moments(self, moments: list[torch.Tensor], device: torch.device) -> int:
        """A header of every rank's moment count, so that ranks whose optimizers hold different
        state (one has not stepped yet) raise instead of hanging in the all-reduce."""
        size = dist.get_world_size(self.process_group)
        mine = torch.tensor([sum(m.numel() for m in moments)], dtype=torch.int64, device=device)
        everyone = torch.empty(size, dtype=torch.int64, device=mine.device)
        all_gather_equal(everyone, mine, group=self.process_group)
        counts = everyone.tolist()
        if len(set(counts)) > 1:
            raise RuntimeError(
                f"optimizer_state='average' at step {self.step}: the ranks' optimizers hold {counts} state elements; "
                "they must hold the same state (has one rank's optimizer not stepped yet, e.g. a skipped fp16 step?). "
                "Use optimizer_state='keep' or 'reset'"
            )
        return (size - 1) * 8

    def _record(self, stats: SyncStats) -> None:
        self.last = stats
        self.totals["steps"] += 1
        self.totals["syncs"] += stats.mode == "sync"
        self.totals["warmup_steps"] += stats.mode == "warmup"
        for key in ("bytes_sent", "bytes_received", "exchange_s", "allreduce_fp32_bytes"):
            self.totals[key] += getattr(stats, key)

    def stats(self) -> dict:
        """``{"step", "last": {...} or None, "total": {...}}``; ``total["ratio_fp32"]``: what DDP's fp32
        all-reduce would have sent over the same steps, per byte sent."""
        total = dict(self.totals)
        total["ratio_fp32"] = (
            total["allreduce_fp32_bytes"] / total["bytes_sent"] if total["bytes_sent"] else math.inf
        )
        return {"step": self.step, "last": self.last.as_dict() if self.last else None, "total": total}

    def state_dict(self) -> dict:
        """The step counter and statistics, for this rank's checkpoint shard."""
        return {"step": self.step, "totals": dict(self.totals)}

    def load_state_dict(self, saved: dict) -> None:
        self.step = int(saved["step"])
        self.totals.update(saved["totals"])

    def __getstate__(self) -> dict:
        """Everything but the process groups (``process_group`` becomes the default group, ``spread``
        None): they do not pickle. An unpickled state is for reading; a fit builds its own."""
        if self.process_group is not None or self.spread is not None:
            log.warning("%s: the process groups are not picklable and are dropped", type(self).__name__)
        return {**self.__dict__, "process_group": None, "spread": None}


def local_hook(state: AveragingState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook of the local steps: DDP's dense all-reduce during the warmup (step 1),
    then nothing at all (step 2: each rank keeps its own gradient)."""
    if state.step < state.warmup_steps:
        return allreduce_hook(state.process_group, bucket)
    return no_comm_hook(None, bucket)
