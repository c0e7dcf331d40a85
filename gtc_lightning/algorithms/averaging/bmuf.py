"""Blockwise model-update filtering (BMUF), torch only: the block update and its state.

N learners take K local optimizer steps from the same start point W_g(t-1) (a block), then, on every
learner from the same all-reduced mean (K. Chen and Q. Huo, ICASSP 2016; the derivation, the
defaults and DiLoCo's names for the same filter are in :mod:`gtc_lightning.strategies.bmuf`):

1. G(t) = mean of the learners' models - W_g(t-1)    (the block's model update)
2. Δ(t) = η Δ(t-1) + ζ G(t)                          (filtered: block momentum η, block learning rate ζ)
3. W(t) = W(t-1) + Δ(t)                              (the global model, ``global_params``)
4. the next block starts from W_g(t) = W(t) (classical block momentum, ``nesterov=False``) or
   W_g(t) = W(t) + η Δ(t) (Nesterov block momentum, ``nesterov=True``).

Streaming and overlap (Streaming DiLoCo, Douillard et al. 2025), both off by default:

- ``fragments=F``: the flat model is cut into F contiguous parts of equal size, synced in turn, one every
  ``period // F`` steps, so that each part is still synced every ``period`` steps and a sync sends 1/F of the
  model (the peak bandwidth falls F-fold, the bytes per step stay the same).
- ``overlap=True``: a sync launches its exchange (a dedicated process group, in a thread of its own) and
  returns at once; the ranks go on with their local steps, and the next sync lands it: the filter on the
  decoded mean gives the part's new start point, and each rank adds back what its own local steps moved
  the part by since the launch (nothing is lost: that progress is in its next block update). The outer step
  is one sync interval late, and a slow link's transfer hides under that interval's compute. The pending
  exchange lands at the end of fit, and before a checkpoint is written (its result is in the shard).

:func:`group_ranks` forms BMUF-GTC's groups (GTC within each, BMUF across them).
"""

import math
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer
from typing_extensions import override

from gtc_lightning.algorithms.averaging.model_averaging import AveragingState, flatten, unflatten_
from gtc_lightning.algorithms.common import allreduce_bytes, check_int


def check_block_args(block_momentum: float | None, block_lr: float) -> None:
    """η in [0, 1) (or None for 1 - 1/N) and ζ > 0, with the reasons."""
    if block_momentum is not None and (
        isinstance(block_momentum, bool)
        or not isinstance(block_momentum, (int, float))
        or not 0 <= block_momentum < 1
    ):
        raise ValueError(
            f"Expect block_momentum (η) in [0, 1) or None for Chen & Huo's 1 - 1/N, got {block_momentum!r}: Δ keeps "
            "η^k of the update k blocks back, which never fades at η >= 1"
        )
    if (
        isinstance(block_lr, bool)
        or not isinstance(block_lr, (int, float))
        or not math.isfinite(block_lr)
        or block_lr <= 0
    ):
        raise ValueError(
            f"Expect block_lr (ζ) to be a finite number > 0, got {block_lr!r}: it scales each block's model update "
            "(Chen & Huo use 1)"
        )


def check_stream_args(period: int, fragments: Any, overlap: Any, optimizer_state: str = "keep") -> None:
    """``fragments`` divides ``period``; ``overlap`` a bool; both keep the optimizer state."""
    check_int("fragments", fragments, 1, "parts of the model synced in turn, one every period // fragments steps")
    if period % fragments:
        divisors = [d for d in range(1, min(period, 64) + 1) if period % d == 0]
        raise ValueError(
            f"Expect fragments to divide period={period} (one part synced every period // fragments steps, each "
            f"part every period steps), got fragments={fragments}; use one of {divisors}"
        )
    if not isinstance(overlap, bool):
        raise ValueError(f"Expect overlap to be True or False, got {overlap!r}")  # noqa: TRY004  (as every option's)
    if (fragments > 1 or overlap) and optimizer_state != "keep":
        raise ValueError(
            f"optimizer_state={optimizer_state!r} with fragments={fragments}, overlap={overlap}: a streamed sync "
            "moves a part of the model at a time, which no reset or average of the whole optimizer state fits; use "
            "optimizer_state='keep' (DiLoCo's), or fragments=1 and overlap=False"
        )


@dataclass
class Pending:
    """An exchange in flight (``overlap=True``): the part it syncs, this rank's copy of the part at the launch,
    and the thread's future, or once landed (or loaded from a shard) its result ``(mean update, sent,
    received)``."""

    fragment: int
    launched: torch.Tensor
    future: Future | None = None
    result: tuple[torch.Tensor, int, int] | None = None

    def get(self) -> tuple[torch.Tensor, int, int]:
        if self.result is None:
            assert self.future is not None
            self.result, self.future = self.future.result(), None
        return self.result


def default_block_momentum(learners: int) -> float:
    """Chen & Huo's η = 1 - 1/N for N learners (0 for one)."""
    return 1.0 - 1.0 / learners


def block_update_(
    global_params: torch.Tensor,
    delta: torch.Tensor,
    mean: torch.Tensor,
    block_momentum: float,
    block_lr: float,
    nesterov: bool,
) -> torch.Tensor:
    """One BMUF block update (steps 1-4 of the module docstring), in place on W and Δ.

    Args:
        global_params: ``[n]`` W(t-1), the global model; becomes W(t).
        delta: ``[n]`` Δ(t-1), the filtered update; becomes Δ(t).
        mean: ``[n]`` the mean of the learners' models after the block, in W's dtype; overwritten.
        block_momentum: η.
        block_lr: ζ.
        nesterov: Nesterov block momentum (the block started from W + ηΔ, the next starts from there).

    Returns:
        ``[n]`` the model the next block starts from (W(t) itself without Nesterov).
    """
    start = torch.add(global_params, delta, alpha=block_momentum) if nesterov else global_params
    update = mean.sub_(start)
    delta.mul_(block_momentum).add_(update, alpha=block_lr)
    global_params.add_(delta)
    return torch.add(global_params, delta, alpha=block_momentum) if nesterov else global_params


class BMUFState(AveragingState):
    """State of BMUF: the averaging state plus the global model W and the filtered update Δ.

    Args:
        period: K, local optimizer steps in a block.
        block_momentum: η in [0, 1).
        block_lr: ζ > 0.
        nesterov: Nesterov block momentum.
        fragments: F parts of the model synced in turn, one every ``period // F`` steps (module docstring).
        overlap: each sync's exchange runs while the next interval's local steps do, and lands at the next sync.
        **kwargs: as for :class:`AveragingState` (warmup, optimizer state, groups).
    """

    def __init__(
        self,
        period: int,
        block_momentum: float,
        block_lr: float = 1.0,
        nesterov: bool = True,
        fragments: int = 1,
        overlap: bool = False,
        **kwargs: Any,
    ) -> None:
        check_block_args(block_momentum, block_lr)
        super().__init__(period, **kwargs)
        check_stream_args(period, fragments, overlap, self.optimizer_state)
        # The hyper-parameters.
        self.block_momentum = float(block_momentum)
        self.block_lr = float(block_lr)
        self.nesterov = bool(nesterov)
        self.fragments = fragments
        self.overlap = overlap
        self.sync_interval = period // fragments
        # The exchange in flight, the thread and the process group it runs in (overlap=True).
        self.pending: Pending | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._side_group: dist.ProcessGroup | None = None
        # The internal state: flat, float32 (float64 when the model is), on the model's device;
        # None on ranks that take no part in the block update (BMUF-GTC's non-representatives).
        self.global_params: torch.Tensor | None = None  # [n] W(t)
        self.delta: torch.Tensor | None = None  # [n] Δ(t)

    @override
    def begin(self, parameters: list[torch.Tensor]) -> None:
        if not self.member:
            return
        flat = flatten(parameters)
        self.global_params = flat.to(torch.promote_types(flat.dtype, torch.float32))
        self.delta = torch.zeros_like(self.global_params)

    @override
    def update(self, mean: torch.Tensor) -> torch.Tensor:
        assert self.global_params is not None and self.delta is not None, (
            "begin() sets W before the first block"
        )
        self._move_to(mean.device)  # (loaded from a shard: on the CPU)
        return block_update_(
            self.global_params, self.delta, mean.to(self.global_params.dtype),
            self.block_momentum, self.block_lr, self.nesterov,
        )  # fmt: skip

    # ---- streaming and overlap ------------------------------------------------------------------------

    @property
    def streamed(self) -> bool:
        return self.fragments > 1 or self.overlap

    def part(self, fragment: int) -> slice:
        """Fragment ``fragment``'s elements of the flat model: F contiguous parts of (nearly) equal size."""
        assert self.global_params is not None
        n = self.global_params.numel()
        return slice(fragment * n // self.fragments, (fragment + 1) * n // self.fragments)

    def start_point(self, part: slice) -> torch.Tensor:
        """Where the part's block starts: W, or W + ηΔ with Nesterov block momentum. Read it, do not write
        to it: without a momentum term it is W's own part (a pass over the model saved at each sync)."""
        assert self.global_params is not None and self.delta is not None
        w = self.global_params[part]
        if self.nesterov and self.block_momentum != 0.0:
            return torch.add(w, self.delta[part], alpha=self.block_momentum)
        return w

    def mean_update(
        self, update: torch.Tensor, part: slice, group: dist.ProcessGroup | None, step: int
    ) -> tuple[torch.Tensor, int, int]:
        """The mean over the ranks of ``update`` (this rank's block update of ``part``, at the sync of optimizer
        step ``step``) and the bytes sent and received: a dense all-reduce here; :class:`~gtc_lightning.algorithms.sparseloco.SparseLoCoState`
        sends it compressed."""
        size = dist.get_world_size(group)
        update.div_(size)
        dist.all_reduce(update, group=group)
        n = allreduce_bytes(update.numel(), size, update.element_size())
        return update, n, n

    def _filter_(self, part: slice, mean: torch.Tensor) -> None:
        """BMUF's filter on one part: Δ = ηΔ + ζ mean, W = W + Δ."""
        assert self.global_params is not None and self.delta is not None
        delta = self.delta[part]
        delta.mul_(self.block_momentum).add_(mean.to(delta.dtype), alpha=self.block_lr)
        self.global_params[part].add_(delta)

    def _launch(self, update: torch.Tensor, part: slice) -> Future:
        if self._side_group is None:  # every rank's first overlapped sync: the same step on every rank
            ranks = None if self.process_group is None else dist.get_process_group_ranks(self.process_group)
            self._side_group = dist.new_group(ranks)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bmuf-sync")
        group, step = self._side_group, self.step  # (the main thread's step goes on)

        def run() -> tuple[torch.Tensor, int, int]:
            if update.is_cuda:
                with torch.cuda.device(update.device):
                    return self.mean_update(update, part, group, step)
            return self.mean_update(update, part, group, step)

        return self._executor.submit(run)

    def _land(self, local: torch.Tensor) -> tuple[int, int]:
        """The pending exchange's outer step on its part of ``local`` (flat, this rank's model): the new start
        point plus what this rank's local steps moved the part by since the launch."""
        assert self.pending is not None
        mean, sent, received = self.pending.get()
        part = self.part(self.pending.fragment)
        progress = local[part] - self.pending.launched.to(local.device)
        self._filter_(part, mean.to(local.device))
        local[part] = self.start_point(part).to(local.dtype) + progress
        self.pending = None
        return sent, received

    def _move_to(self, device: torch.device) -> None:
        """W and Δ (loaded from a shard: on the CPU) to the model's device."""
        assert self.global_params is not None and self.delta is not None
        if self.global_params.device != device:
            self.global_params, self.delta = self.global_params.to(device), self.delta.to(device)

    @override
    def exchange(self, params: list[torch.Tensor], optimizers: list[Optimizer]) -> tuple[int, int]:
        if not self.streamed:
            return super().exchange(params, optimizers)
        assert self.member and self.spread is None, "streaming is for BMUF over all its ranks (not BMUF-GTC)"
        local = flatten(params)
        self._move_to(local.device)
        local = local.to(self.global_params.dtype)
        sent = received = 0
        if self.pending is not None:
            sent, received = self._land(local)
        fragment = ((self.step - self.warmup_steps) // self.sync_interval - 1) % self.fragments
        part = self.part(fragment)
        update = local[part] - self.start_point(part)
        if self.overlap:
            self.pending = Pending(fragment, local[part].clone(), future=self._launch(update, part))
        else:
            mean, sent_now, received_now = self.mean_update(update, part, self.process_group, self.step)
            self._filter_(part, mean)
            local[part] = self.start_point(part)
            sent, received = sent + sent_now, received + received_now
        unflatten_(local, params)
        return sent, received

    def finish(self, params: list[torch.Tensor]) -> None:
        """At the end of fit: land the exchange in flight, so that no block update is left unapplied (its
        bytes join the totals)."""
        if self.pending is None:
            return
        local = flatten(params)
        self._move_to(local.device)
        local = local.to(self.global_params.dtype)
        sent, received = self._land(local)
        unflatten_(local, params)
        self.totals["bytes_sent"] += sent
        self.totals["bytes_received"] += received

    @override
    def state_dict(self) -> dict:
        """W, Δ and the exchange in flight, landed here: its mean update and this rank's part at the launch."""
        saved = {**super().state_dict(), "global_params": self.global_params, "delta": self.delta}
        if self.pending is not None:
            mean, sent, received = self.pending.get()
            saved["pending"] = {
                "fragment": self.pending.fragment, "launched": self.pending.launched, "mean": mean,
                "sent": sent, "received": received,
            }  # fmt: skip
        return saved

    @override
    def load_state_dict(self, saved: dict) -> None:
        """W and Δ as saved, where the checkpoint IO put them (Lightning's maps a shard to the CPU);
        the first block moves them to the model's device, where the mean is."""
        super().load_state_dict(saved)
        if "global_params" in saved:
            self.global_params, self.delta = saved["global_params"], saved["delta"]
        entry = saved.get("pending")
        self.pending = (
            None
            if entry is None
            else Pending(
                entry["fragment"], entry["launched"], result=(entry["mean"], entry["sent"], entry["received"])
            )
        )

    def __getstate__(self) -> dict:
        """As :class:`AveragingState`'s, without the thread and its group; an exchange in flight is landed."""
        if self.pending is not None:
            self.pending.get()
        state = super().__getstate__()
        return {**state, "_executor": None, "_side_group": None}


def group_ranks(world_size: int, group_size: int) -> list[list[int]]:
    """The global ranks of each group, consecutive (on a cluster with ``group_size`` = processes per
    node, one group per node: GTC on the fast links inside it, BMUF between nodes).

    Raises:
        ValueError: ``group_size`` does not divide ``world_size``, or makes fewer than 2 groups.
    """
    divisors = [d for d in range(1, world_size // 2 + 1) if world_size % d == 0]
    if world_size % group_size:
        raise ValueError(
            f"bmuf_gtc: group_size={group_size} does not divide the {world_size} ranks into groups of equal size; "
            f"use one of {divisors}"
        )
    if world_size // group_size < 2:
        raise ValueError(
            f"bmuf_gtc: group_size={group_size} of {world_size} ranks makes one group, and BMUF needs at least two to "
            f"average across (with one group and η = 1 - 1/1 = 0 it is GTC with a spare copy of the model: use "
            f"strategy='gtc'); use group_size in {divisors}" + ("" if divisors else ", i.e. at least 2 ranks")
        )
    return [list(range(start, start + group_size)) for start in range(0, world_size, group_size)]
