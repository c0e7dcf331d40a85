"""Blockwise model-update filtering (BMUF), torch only: the block update and its state.

N learners take K local optimizer steps from the same start point W_g(t-1) (a block), then, on every
learner from the same all-reduced mean (K. Chen and Q. Huo, ICASSP 2016; the derivation, the
defaults and DiLoCo's names for the same filter are in :mod:`gtc_lightning.strategies.bmuf`):

1. G(t) = mean of the learners' models - W_g(t-1)    (the block's model update)
2. Δ(t) = η Δ(t-1) + ζ G(t)                          (filtered: block momentum η, block learning rate ζ)
3. W(t) = W(t-1) + Δ(t)                              (the global model, ``global_params``)
4. the next block starts from W_g(t) = W(t) (classical block momentum, ``nesterov=False``) or
   W_g(t) = W(t) + η Δ(t) (Nesterov block momentum, ``nesterov=True``).

:func:`group_ranks` forms BMUF-GTC's groups (GTC within each, BMUF across them).
"""

import math
from typing import Any

import torch
from typing_extensions import override

from gtc_lightning.algorithms.averaging.model_averaging import AveragingState, flatten


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
        **kwargs: as for :class:`AveragingState` (warmup, optimizer state, groups).
    """

    def __init__(
        self, period: int, block_momentum: float, block_lr: float = 1.0, nesterov: bool = True, **kwargs: Any
    ) -> None:
        check_block_args(block_momentum, block_lr)
        super().__init__(period, **kwargs)
        # The hyper-parameters.
        self.block_momentum = float(block_momentum)
        self.block_lr = float(block_lr)
        self.nesterov = bool(nesterov)
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
        if self.global_params.device != mean.device:  # loaded from a shard: on the CPU
            self.global_params, self.delta = self.global_params.to(mean.device), self.delta.to(mean.device)
        return block_update_(
            self.global_params, self.delta, mean.to(self.global_params.dtype),
            self.block_momentum, self.block_lr, self.nesterov,
        )  # fmt: skip

    @override
    def state_dict(self) -> dict:
        return {**super().state_dict(), "global_params": self.global_params, "delta": self.delta}

    @override
    def load_state_dict(self, saved: dict) -> None:
        """W and Δ as saved, where the checkpoint IO put them (Lightning's maps a shard to the CPU);
        the first block moves them to the model's device, where the mean is."""
        super().load_state_dict(saved)
        if "global_params" in saved:
            self.global_params, self.delta = saved["global_params"], saved["delta"]


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
