"""The block syncs of DiLoCo and SparseLoCo as Lightning strategies: ``"diloco"`` (BMUF with DiLoCo's
defaults) and ``"sparseloco"`` (the block update sent as GTC words with error feedback,
:mod:`gtc_lightning.algorithms.sparseloco`).

DiLoCo (A. Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models",
2023): every worker takes H = 500 inner AdamW steps, then the outer optimizer, SGD with
Nesterov momentum 0.9 and learning rate 0.7, steps on the mean pseudo-gradient. That is BMUF with
Nesterov block momentum (:mod:`gtc_lightning.strategies.bmuf` shows the correspondence), so ``"diloco"``
is :class:`~gtc_lightning.strategies.bmuf.BMUFStrategy` registered with
``period=500, block_lr=0.7, block_momentum=0.9, nesterov=True``; the inner AdamW is the model's
``configure_optimizers``.

SparseLoCo (A. Sarfi, B. Thérien, J. Lidin, E. Belilovsky, "Communication Efficient LLM Pre-training with
SparseLoCo", 2025, arXiv:2508.15706): each worker sends only the top 1-3 % of its error-feedback
accumulated pseudo-gradient, quantised to 2 bits, every H = 30-50 inner steps, and the outer step is
plain SGD at a learning rate of about 1 without outer momentum (the error feedback stands in for it).
``"sparseloco"`` is :class:`SparseLoCoStrategy` with those defaults; the selection is GTC's threshold
at a density target, the indices Golomb-Rice coded.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import torch.distributed as dist
from lightning.fabric.strategies import _StrategyRegistry
from typing_extensions import override

from gtc_lightning.algorithms.averaging.bmuf import default_block_momentum
from gtc_lightning.algorithms.sparseloco import SparseLoCoState, check_sparse_args
from gtc_lightning.strategies.bmuf import BMUFStrategy
from gtc_lightning.strategies.common import register_names

log = logging.getLogger(__name__)

# DiLoCo's outer step and period (Douillard et al. 2023): H = 500, outer Nesterov SGD at lr 0.7, momentum 0.9.
DILOCO_DEFAULTS = {"period": 500, "block_lr": 0.7, "block_momentum": 0.9, "nesterov": True}
DILOCO_DESCRIPTION = "DiLoCo (Douillard et al. 2023): BMUF with H=500 local steps and an outer Nesterov SGD at lr 0.7, momentum 0.9"


def register_diloco(strategy_registry: _StrategyRegistry) -> None:
    """``"diloco"`` and its ``_spawn``/``_fork``/``_notebook``/``_find_unused_parameters_*`` variants:
    :class:`BMUFStrategy` with :data:`DILOCO_DEFAULTS` (any argument given by the user wins)."""
    register_names(strategy_registry, BMUFStrategy, "diloco", DILOCO_DESCRIPTION, **DILOCO_DEFAULTS)


class SparseLoCoStrategy(BMUFStrategy):
    """DDP whose ranks take ``period`` local optimizer steps, then a block sync that sends each rank's block
    update (DiLoCo's pseudo-gradient, with the opposite sign) as GTC words with error feedback, and BMUF's
    filter on their decoded mean (SparseLoCo, Sarfi et al. 2025; the steps are in
    :mod:`gtc_lightning.algorithms.sparseloco`).

    Args:
        period: H, local optimizer steps in a block (SparseLoCo: 30-50; Covenant-72B: 30).
        density: share of the elements each rank sends per sync, in (0, 1] (SparseLoCo: 1-3 %; the default
            1/64 is Covenant-72B's 1.56 %).
        values: what a word's element is worth: ``"2bit"`` (the sign and one of two magnitudes, as
            SparseLoCo's 2-bit quantisation), ``"sign"`` (Strom's 1 bit: ±tau) or ``"float32"`` (the exact
            value: at ``density=1`` this is :class:`BMUFStrategy`).
        coding: ``"rice"`` (Golomb-Rice coded index gaps, 8-11 bits a word at these densities) or ``"none"``.
        block_momentum: η (outer momentum) in [0, 1); SparseLoCo's 0 by default (``None``: 1 - 1/N).
            With ``block_lr=0.7, block_momentum=0.9`` it is DiLoCo's outer step on the compressed update.
        block_lr: ζ > 0, the outer learning rate (SparseLoCo: about 1).
        nesterov: Nesterov block momentum (no effect at η = 0).
        error_decay: β in ``residual = β residual + update`` at each sync; 1 (the default) loses nothing,
            below 1 forgets old unsent updates, as SparseLoCo's decayed accumulator.
        exchange: ``"auto"`` (all-to-all on gloo, a padded all-gather elsewhere), ``"alltoall"``, ``"allgather"``.
        busy_wait: poll the sync's collectives (``None``: on gloo when each rank has a core).
        fragments, overlap: as for :class:`BMUFStrategy` (Streaming DiLoCo's parts synced in turn, and the
            exchange overlapped with the next local steps); each part keeps its own slice of the residual.
        warmup_steps, optimizer_state, kwargs: as for :class:`BMUFStrategy` (``scale_lr``, ``average_at_end``,
            ``restore_shards``, DDP's arguments). ``optimizer_state="average"`` is refused: it all-reduces
            the moments densely. Every rank's checkpoint shard (``<checkpoint>.sparseloco/rank<r>.pt``)
            holds its model, optimizer state, W, Δ and its own residual.
    """

    name = "sparseloco"
    description = "SparseLoCo (Sarfi et al. 2025): local steps, then the block update sent as GTC words with error feedback"

    def __init__(
        self,
        period: int = 30,
        density: float = 1 / 64,
        values: Literal["2bit", "sign", "float32"] = "2bit",
        coding: Literal["rice", "none"] = "rice",
        block_momentum: float | None = 0.0,
        block_lr: float = 1.0,
        nesterov: bool = True,
        error_decay: float = 1.0,
        exchange: Literal["auto", "alltoall", "allgather"] = "auto",
        busy_wait: bool | None = None,
        fragments: int = 1,
        overlap: bool = False,
        warmup_steps: int = 0,
        optimizer_state: Literal["keep", "reset"] = "keep",
        **kwargs: Any,
    ) -> None:
        check_sparse_args(density, values, coding, error_decay, exchange)
        if optimizer_state == "average":
            raise ValueError(
                "SparseLoCoStrategy: optimizer_state='average' all-reduces the optimizers' moments densely at every "
                "sync, which a compressed sync exists to avoid; use 'keep' (DiLoCo, SparseLoCo) or 'reset', or "
                "strategy='bmuf' for dense syncs"
            )
        super().__init__(
            period=period, block_momentum=block_momentum, block_lr=block_lr, nesterov=nesterov,
            fragments=fragments, overlap=overlap, warmup_steps=warmup_steps, optimizer_state=optimizer_state,
            **kwargs,
        )  # fmt: skip
        self._density = float(density)
        self._values = values
        self._coding = coding
        self._error_decay = float(error_decay)
        self._exchange = exchange
        self._busy_wait = busy_wait

    @property
    def density(self) -> float:
        return self._density

    @property
    def values(self) -> str:
        return self._values

    @property
    def coding(self) -> str:
        return self._coding

    @property
    def error_decay(self) -> float:
        return self._error_decay

    @property
    def sparse_state(self) -> SparseLoCoState | None:
        """W, Δ, this rank's residual and the counters; ``None`` before ``fit`` configured DDP."""
        return self._state if isinstance(self._state, SparseLoCoState) else None

    @override
    def _new_state(self) -> SparseLoCoState:
        group = self._ddp_kwargs.get("process_group")
        eta = self._block_momentum
        eta = default_block_momentum(dist.get_world_size(group)) if eta is None else eta
        return SparseLoCoState(
            period=self._period, block_momentum=eta, block_lr=self._block_lr, nesterov=self._nesterov,
            density=self._density, values=self._values, coding=self._coding, error_decay=self._error_decay,
            exchange=self._exchange, busy_wait=self._busy_wait, fragments=self._fragments, overlap=self._overlap,
            warmup_steps=self._warmup_steps,
            optimizer_state=self._optimizer_state, process_group=group,
        )  # fmt: skip

    @override
    def _describe(self) -> str:
        sparse = f"density={self._density:g}, values={self._values}, coding={self._coding}, error_decay={self._error_decay}"
        return f"{super()._describe()}, {sparse}"
