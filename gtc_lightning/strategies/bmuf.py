"""Blockwise model-update filtering (``"bmuf"``) and its two-tier hybrid with GTC (``"bmuf_gtc"``) as
Lightning strategies; the block update and its state are in :mod:`gtc_lightning.algorithms.averaging.bmuf`.

BMUF (K. Chen and Q. Huo, "Scalable training of deep learning machines by incremental block
training with intra-block parallel optimization and blockwise model-update filtering", ICASSP
2016): N learners take K local optimizer steps from the same start point W_g(t-1) (a block), then,
on every learner from the same all-reduced mean,

1. G(t) = mean of the learners' models - W_g(t-1)    (the block's model update)
2. Δ(t) = η Δ(t-1) + ζ G(t)                          (filtered: block momentum η, block learning rate ζ)
3. W(t) = W(t-1) + Δ(t)                              (the global model, ``global_params``)
4. the next block starts from W_g(t) = W(t) (classical block momentum, ``nesterov=False``) or
   W_g(t) = W(t) + η Δ(t) (Nesterov block momentum, ``nesterov=True``).

G is measured from the point the block started from, as in the paper; without Nesterov that is
W(t-1) itself. Chen & Huo recommend ζ = 1 and η = 1 - 1/N for N learners: the filter's steady
gain ζ / (1 - η) = N makes up for averaging N learners' updates (what Su et al. make up for by
scaling the learning rate by N). That holds when every learner keeps its own batch size; when the
global batch is split N ways instead, each learner's block already moves about as far as the
single learner would, and the gain N overshoots: on the recipe at 32 workers of 16 frames, η = 1 -
1/32 did not train and η = 0.75 did (docs/experiments/simulated_workers.md). Both forms of block momentum are
theirs; the Nesterov form is the default here, as in DiLoCo's outer optimizer.

DiLoCo (Douillard et al., 2023) is BMUF with Nesterov block momentum under other names: its outer
gradient is θ - mean (θ = W_g, the model the workers start from: DiLoCo's global parameters), its
outer optimizer SGD with Nesterov momentum, so the **outer learning rate is ζ** and the **outer
momentum is η** (DiLoCo: 0.7 and 0.9 over H = 500 inner AdamW steps, i.e.
``BMUFStrategy(period=500, block_lr=0.7, block_momentum=0.9, nesterov=True)`` with AdamW in
``configure_optimizers``). With torch's ``SGD(nesterov=True)`` as the outer optimizer, its momentum
buffer is -Δ/ζ and its parameters W_g, step for step (tests/test_bmuf.py checks it on numbers
computed by hand).

BMUF-GTC (Ladkat, Strom et al., Interspeech 2019): the ranks form groups of
``group_size`` consecutive ranks; GTC runs within each group every step (the GTC hook on the group's
process group), BMUF across the groups every K steps through one representative per group (its first
rank), which then broadcasts the new start point within its group. GTC's residuals carry over a block
sync: their pending update is applied from the new start point.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from gtc_lightning.algorithms.averaging.bmuf import (
    BMUFState,
    check_block_args,
    check_stream_args,
    default_block_momentum,
    group_ranks,
)
from gtc_lightning.algorithms.averaging.model_averaging import OPTIMIZER_STATES, broadcast_
from gtc_lightning.algorithms.common import check_int
from gtc_lightning.strategies.averaging import LocalStepsMixin, ModelAveragingStrategy, RankShards
from gtc_lightning.strategies.common import add_callback
from gtc_lightning.strategies.gtc import GTCStrategy
from gtc_lightning.strategies.loggers import SyncStatsLogger

log = logging.getLogger(__name__)




class _LandInFlight(Callback):
    """At the end of fit, before the other callbacks: the exchange in flight (``overlap=True``) lands."""

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if isinstance(trainer.strategy, BMUFStrategy):
            trainer.strategy._land()


class BMUFStrategy(ModelAveragingStrategy):
    """DDP whose ranks take K local optimizer steps (any torch optimizer), then a BMUF block update.

    Args:
        period: K, local optimizer steps in a block. The BMUF-GTC write-up's example (Amazon, 2019) is 50.
        block_momentum: η in [0, 1); ``None``: Chen & Huo's 1 - 1/N for N ranks (0.5 at 2, 0.75 at 4).
        block_lr: ζ > 0; Chen & Huo use 1. (DiLoCo's outer learning rate.)
        nesterov: Nesterov block momentum (the default, as in CNTK's BMUF and in DiLoCo).
        fragments: F > 1 syncs F contiguous parts of the model in turn, one every ``period // F`` steps
            (Streaming DiLoCo's fragments: each part still every ``period`` steps, 1/F of the bytes at a time);
            F must divide ``period``.
        overlap: each sync's exchange runs in a thread (on a process group of its own) while the next
            ``period // F`` local steps do, and lands at the next sync: the outer step is that much late, the
            transfer hidden under compute. Each rank keeps what its local steps did meanwhile. The exchange in
            flight lands at the end of fit and is in every checkpoint shard.
            ``fragments`` and ``overlap`` need ``optimizer_state="keep"``.
        warmup_steps, optimizer_state, scale_lr, restore_shards, average_at_end, kwargs: as for
            :class:`~gtc_lightning.strategies.averaging.ModelAveragingStrategy`; the first block starts after
            the warmup (``scale_lr`` with the default η makes up for the averaging twice). Every
            rank's checkpoint shard (``<checkpoint>.bmuf/rank<r>.pt``) holds its model, optimizer
            state, W and Δ.
    """

    name = "bmuf"
    description = "DDP with local steps and blockwise model-update filtering"

    def __init__(
        self,
        period: int = 50,
        block_momentum: float | None = None,
        block_lr: float = 1.0,
        nesterov: bool = True,
        fragments: int = 1,
        overlap: bool = False,
        warmup_steps: int = 0,
        optimizer_state: Literal["keep", "reset", "average"] = "keep",
        **kwargs: Any,
    ) -> None:
        check_block_args(block_momentum, block_lr)
        check_int("period", period, 1, "local optimizer steps in a block")
        check_stream_args(period, fragments, overlap, optimizer_state)
        if overlap and kwargs.get("process_group") is not None:
            raise ValueError(
                f"{type(self).__name__}: overlap=True makes a process group of its own over all ranks, which a "
                "process_group given to DDP would not match; leave process_group out, or use overlap=False"
            )
        super().__init__(period=period, warmup_steps=warmup_steps, optimizer_state=optimizer_state, **kwargs)
        self._block_momentum = block_momentum
        self._block_lr = float(block_lr)
        self._nesterov = bool(nesterov)
        self._fragments = fragments
        self._overlap = overlap

    @property
    def block_momentum(self) -> float | None:
        """η: as given, or 1 - 1/N once fit knows N; ``None`` before."""
        if self._block_momentum is None and isinstance(self._state, BMUFState):
            return self._state.block_momentum
        return self._block_momentum

    @property
    def block_lr(self) -> float:
        return self._block_lr

    @property
    def nesterov(self) -> bool:
        return self._nesterov

    @property
    def fragments(self) -> int:
        return self._fragments

    @property
    def overlap(self) -> bool:
        return self._overlap

    def _land(self) -> None:
        if isinstance(self._state, BMUFState):
            self._state.finish(self._params)

    @override
    def setup(self, trainer: Trainer) -> None:
        super().setup(trainer)
        # First of the callbacks at the end of fit, so that every other one sees the landed model.
        landing = any(isinstance(cb, _LandInFlight) for cb in trainer.callbacks)
        if trainer.state.fn == TrainerFn.FITTING and self._overlap and not landing:
            trainer.callbacks.insert(0, _LandInFlight())

    @override
    def on_train_end(self) -> None:
        """The exchange in flight (``overlap``) lands, if no callback landed it: no block update is left out."""
        self._land()
        super().on_train_end()

    @override
    def _new_state(self) -> BMUFState:
        if self._overlap and (self._block_momentum is None or self._block_momentum > 0) and self.global_rank == 0:
            log.warning(
                "%s: overlap=True lands each outer step %d steps late; with outer momentum (block_momentum=%s) a "
                "late step overshoots (DiLoCo's 0.9 lost 9 %% held-out loss a whole period late on the model suite's "
                "transformer, 1.3 %% half a period late). Keep the delay short (fragments) or block_momentum=0",
                self.name, self._period // self._fragments, self._block_momentum,
            )  # fmt: skip
        group = self._ddp_kwargs.get("process_group")
        eta = self._block_momentum
        eta = default_block_momentum(dist.get_world_size(group)) if eta is None else eta
        return BMUFState(
            period=self._period, block_momentum=eta,
            block_lr=self._block_lr, nesterov=self._nesterov, fragments=self._fragments, overlap=self._overlap,
            warmup_steps=self._warmup_steps, optimizer_state=self._optimizer_state, process_group=group,
        )  # fmt: skip

    @override
    def _describe(self) -> str:
        block = (
            f"block_momentum={self.block_momentum}, block_lr={self._block_lr}, nesterov={self._nesterov}, "
            f"fragments={self._fragments}, overlap={self._overlap}"
        )
        return f"{super()._describe()}, {block}"




class BMUFGTCStrategy(LocalStepsMixin, GTCStrategy):
    """Two tiers: GTC within groups of ``group_size`` ranks every step, BMUF across the groups every
    ``period`` steps through one representative per group, then a broadcast within each group.

    Args:
        group_size: ranks per group (consecutive global ranks); it must divide the world size into
            at least 2 groups. 1 is allowed: every rank its own group, BMUF over GTC-quantised local
            steps (the residual still holds what was not yet applied).
        period: K, optimizer steps between two block syncs.
        block_momentum: η in [0, 1); ``None``: 1 - 1/N for N groups (the BMUF learners).
        block_lr: ζ > 0.
        nesterov: Nesterov block momentum.
        optimizer_state: at a block sync, the representatives' optimizer state is kept, reset or
            averaged; the broadcast then gives the whole group the representative's.
        restore_shards: restore every rank's model, optimizer state and block state from
            ``<checkpoint>.bmuf_gtc/rank<r>.pt`` on resume (GTC's residuals: ``restore_residuals``).
        average_at_end: a fit that ends between two block syncs leaves every rank the mean of all ranks'
            models (as :class:`~gtc_lightning.strategies.averaging.ModelAveragingStrategy`'s).
        average_eval: evaluation loops between two block syncs see the mean of all ranks' models (as
            :class:`~gtc_lightning.strategies.averaging.ModelAveragingStrategy`'s).
        tau, coding: as for :class:`~gtc_lightning.strategies.gtc.GTCStrategy`, with the defaults this
            strategy was measured with (a fixed ``tau=1e-2``, 32-bit words).
        compress: always Strom's gradient compression within the groups (``"auto"`` means it too).
        **kwargs: as for :class:`~gtc_lightning.strategies.gtc.GTCStrategy` (``warmup_steps`` of dense
            all-reduce within the groups, ``exchange``, ... and DDP's arguments); the
            ``process_group`` is the strategy's own.
    """

    name = "bmuf_gtc"
    description = "GTC within groups of ranks, BMUF across the groups"

    def __init__(
        self,
        group_size: int = 2,
        period: int = 50,
        block_momentum: float | None = None,
        block_lr: float = 1.0,
        nesterov: bool = True,
        optimizer_state: Literal["keep", "reset", "average"] = "keep",
        restore_shards: bool = True,
        average_at_end: bool = True,
        average_eval: bool = True,
        tau: float | Literal["auto"] = 1e-2,
        coding: Literal["none", "rice"] = "none",
        compress: Literal["auto", "gradient"] = "gradient",
        **kwargs: Any,
    ) -> None:
        check_int("group_size", group_size, 1, "ranks per GTC group; it must divide the world size")
        check_int("period", period, 1, "optimizer steps between two block syncs")
        check_block_args(block_momentum, block_lr)
        if optimizer_state not in OPTIMIZER_STATES:
            raise ValueError(f"Expect optimizer_state in {OPTIMIZER_STATES}, got {optimizer_state!r}")
        if kwargs.get("process_group") is not None:
            raise ValueError(
                "BMUFGTCStrategy makes its own process groups (group_size); remove process_group"
            )
        kwargs.pop("process_group", None)
        # The two tiers as the seed describes them: Strom's gradient compression within a group (with
        # the threshold of this strategy's measurements), BMUF's filter over the groups' local steps.
        if compress not in ("auto", "gradient"):
            raise ValueError(
                f"BMUFGTCStrategy compresses gradients within its groups; compress={compress!r} is not supported "
                "(leave it out)"
            )
        super().__init__(tau=tau, coding=coding, compress="gradient", **kwargs)
        self._group_size = group_size
        self._period = period
        self._block_momentum = block_momentum
        self._block_lr = float(block_lr)
        self._nesterov = bool(nesterov)
        self._optimizer_state = optimizer_state
        self._state: BMUFState | None = None  # the block tier's
        self._params: list[torch.nn.Parameter] = []  # the trainable ones at setup, averaged at each sync
        self._shards = RankShards(self.name, restore_shards)
        self._average_at_end = bool(average_at_end)
        self._average_eval = bool(average_eval)
        self._groups: tuple[list[int], dist.ProcessGroup, dist.ProcessGroup, dist.ProcessGroup] | None = (
            None  # (my group's ranks, it, representatives, the world group they were made in)
        )

    @override
    def _average_group(self) -> dist.ProcessGroup | None:
        return None  # every rank (DDP's process_group is the rank's GTC group)

    @property
    def group_size(self) -> int:
        return self._group_size

    @property
    def period(self) -> int:
        return self._period

    @property
    def block_momentum(self) -> float | None:
        """η: as given, or 1 - 1/N once fit knows the N groups; ``None`` before."""
        if self._block_momentum is None and self._state is not None:
            return self._state.block_momentum
        return self._block_momentum

    @property
    def block_lr(self) -> float:
        return self._block_lr

    @property
    def nesterov(self) -> bool:
        return self._nesterov

    @property
    def block_state(self) -> BMUFState | None:
        """The block tier's state (W and Δ on representatives, counters); ``None`` before ``fit``."""
        return self._state

    @override
    def _configure_launcher(self) -> None:
        # As the Trainer is built, before any process starts (each rank checks again at setup).
        group_ranks(self.num_nodes * self.num_processes, self._group_size)
        super()._configure_launcher()

    @override
    def setup_distributed(self) -> None:
        # Checked before the process group starts, identically on every rank.
        groups = group_ranks(self.num_nodes * self.num_processes, self._group_size)
        super().setup_distributed()
        world = dist.group.WORLD
        if self._groups is not None and self._groups[3] is world:
            return  # a later fit in the same processes: the groups of the first
        # Every rank creates every group, in the same order, as torch requires; with the strategy's
        # timeout (a group's own default is torch's 30 minutes, whatever the world group has).
        handles = [dist.new_group(ranks, timeout=self._timeout) for ranks in groups]
        representatives = dist.new_group([ranks[0] for ranks in groups], timeout=self._timeout)
        mine = self.global_rank // self._group_size
        self._groups = (groups[mine], handles[mine], representatives, world)
        self._ddp_kwargs["process_group"] = handles[mine]

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state["_groups"] = None  # process groups do not pickle; setup_distributed makes them again
        state["_ddp_kwargs"] = {key: v for key, v in self._ddp_kwargs.items() if key != "process_group"}
        return state

    @override
    def setup(self, trainer: Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            add_callback(trainer, SyncStatsLogger(lambda: self._state, "bmuf"))

    @override
    def _register_ddp_hooks(self) -> None:
        super()._register_ddp_hooks()  # (GTCStrategy carries GTC's state over a fit that continues)
        assert self._groups is not None and self.model is not None
        ranks, group, representatives, _ = self._groups
        module = self.model.module
        if not self._continuing:
            # DDP made each group's replicas identical (from its first rank); all groups start from rank 0's.
            broadcast_([t for t in module.state_dict().values() if t.is_floating_point()], src=0, group=None)
        learners = self.world_size // self._group_size
        eta = default_block_momentum(learners) if self._block_momentum is None else self._block_momentum
        member, spread = self.global_rank == ranks[0], (ranks[0], group) if len(ranks) > 1 else None
        self._state = self._setup_state(lambda: BMUFState(
            period=self._period, block_momentum=eta, block_lr=self._block_lr, nesterov=self._nesterov,
            optimizer_state=self._optimizer_state, process_group=representatives, member=member, spread=spread,
            world_size=self.world_size,
        ))  # fmt: skip
        self._state.process_group, self._state.spread = representatives, spread  # (pickled: dropped)
        if self.global_rank == 0 and not self._continuing:
            log.info(
                "bmuf_gtc config: %d groups of %d ranks, period=%d, block_momentum=%g, block_lr=%g, nesterov=%s",
                learners, self._group_size, self._period, eta, self._block_lr, self._nesterov,
            )  # fmt: skip
