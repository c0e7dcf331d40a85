"""Asynchronous decentralised parallel SGD (``"adpsgd"``) as a Lightning strategy (the pairing, the
background exchange and its state: :mod:`gtc_lightning.algorithms.averaging.adpsgd`). Lian et al.,
"Asynchronous Decentralized Parallel Stochastic Gradient Descent", ICML 2018, as IBM trains its
Switchboard LSTM with it (Zhang et al., ICASSP 2019): the asynchronous form of :mod:`.dpsgd`, which tolerates a
slow rank.

Per rank, between two global synchronisation points:

1. Dense warmup: for the first ``warmup_steps`` optimizer steps DDP's all-reduce averages the
   gradients (the replicas stay identical), as for ``dpsgd``.
2. Local steps: afterwards DDP reduces nothing (its gradient synchronisation is off, as inside
   ``no_sync``: no collective runs in the forward or backward pass), and each rank's optimizer
   steps on its own gradient, at its own pace.
3. Pair averaging in the background, after each local step: even ranks start an exchange with an
   odd peer from a fixed schedule (``peering``), odd ranks answer whoever asks; the mean of the two
   models is applied at the next step boundary on top of the steps taken since. A rank whose
   exchange is ``max_staleness`` steps old waits for it (either side of it: the staleness of every
   mean is at most ``max_staleness``); a slow rank delays only the exchanges with it (a slow odd rank
   not even those: its communication thread answers at once, also while a step computes on a GPU).

The global synchronisation points are the ends of the training epochs, validation, test and
predict loops, checkpoints and the end of fit: there every rank finishes its exchanges
(:meth:`~gtc_lightning.algorithms.averaging.adpsgd.ADPSGDState.drain`) before anything global runs, and the
spread between the replicas is measured (``adpsgd/spread``, ``adpsgd/distance``, logged at each
epoch end). As for ``dpsgd``: validation evaluates the average of all ranks' parameters, fit ends
with every rank on that average (``average_at_end``), the checkpoint holds the average and
``<checkpoint>.adpsgd/rank<r>.pt`` every rank's own parameters, optimizer state and schedule
position (:class:`~gtc_lightning.strategies.averaging.RankShards`), taken after the drain: a resume
restores each rank's state bit for bit. What happens after it depends, as in the uninterrupted run,
on which exchange lands at which step: the runs are not reproducible step for step. Only the
trainable parameters are averaged: buffers (BatchNorm's running statistics) stay each rank's own,
DDP broadcasting none after the warmup, so after fit the ranks' buffers differ and the checkpoint
holds the averaged parameters with rank 0's buffers (a 16-32-4 MLP with ``BatchNorm1d``, 2 ranks, 8
steps: ``running_mean`` differed by up to 0.14 and ``running_var`` by 0.47 between the ranks).

Each rank runs the same number of batches per epoch (Lightning's sampler), so the fast ranks wait
for a slow one at the next synchronisation point: between two of them they run at their own pace.
Nothing else synchronises them: DDP runs no collective after the warmup, and the Trainer's
broadcast of rank 0's SIGTERM flag before every batch is skipped (:func:`no_sigterm_broadcast`;
each rank still stops on a SIGTERM of its own). So a SIGTERM to every rank stops each at the end of
the batch it is in, not at the same step: a checkpoint saved then (``OnExceptionCheckpoint``) holds
shards of different steps (6 and 7 in one such run) while the Trainer resumes from rank 0's progress,
and a rank whose shard is ahead repeats its batches of that gap and keeps its step counter ahead (the
resume logs a warning). Checkpoints that ``ModelCheckpoint`` saves are taken at the same step on
every rank. A ``self.log(..., sync_dist=True)`` in ``training_step`` is a collective per step, and
makes every rank wait for the slowest again (the exchanges go on: a passive rank's copies to and from
the device run outside the lock its communication thread takes).
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from gtc_lightning.algorithms.averaging.adpsgd import ADPSGDState, check_compression
from gtc_lightning.algorithms.averaging.model_averaging import local_hook
from gtc_lightning.algorithms.averaging.pairing import PEERINGS, check_world
from gtc_lightning.algorithms.common import check_int
from gtc_lightning.strategies.averaging import LocalStepsMixin
from gtc_lightning.strategies.common import add_callback
from gtc_lightning.strategies.dpsgd import DPSGDStrategy
from gtc_lightning.strategies.loggers import StalenessLogger

log = logging.getLogger(__name__)


def no_sigterm_broadcast(trainer: Trainer) -> None:
    """Lightning broadcasts rank 0's SIGTERM flag before every training batch (a collective: a global
    barrier per step, which would make every rank wait for the slowest). This trainer's epoch loop
    skips it; each rank still stops on its own SIGTERM at the end of its batch (Lightning's own check)."""
    loop = trainer.fit_loop.epoch_loop
    if hasattr(loop, "_broadcast_sigterm_tensor"):
        loop._broadcast_sigterm_tensor = lambda: None


class ADPSGDStrategy(DPSGDStrategy):
    """DDP whose ranks take local optimizer steps at their own pace and average their parameters
    with one peer after each, in the background (asynchronous D-PSGD).

    Args:
        max_staleness: local steps an exchange may stay in flight before the rank waits for it, on
            the even rank that started it and on the odd rank that answers it (>= 1; an odd rank
            applies a mean at the earliest one step after the model it sent).
        peering: ``"ring"``: each even rank alternates between its right and left ring neighbours
            (needs an even number of ranks; Zhang et al.'s pairing); ``"random"``: each even rank draws
            an odd peer per exchange from a hash of ``seed``, its rank and the exchange's number.
        seed: the seed of ``peering="random"``.
        warmup_steps: optimizer steps of dense gradient averaging (DDP's all-reduce) first.
        compress: ``"none"``: each exchange sends the whole model; ``"gtc"``: after each pair's first
            exchange following a synchronisation point, Strom's threshold words of the difference
            from a reference the pair shares (``density`` of the parameters, one reference per peer in
            host memory: 1 or 2 with the ring, up to W/2 with ``peering="random"``;
            :mod:`gtc_lightning.algorithms.averaging.adpsgd`), for slow links.
        density: the share of the parameters a coded exchange sends (``compress="gtc"``).
        average_eval: evaluation loops see the mean of all ranks' parameters (as for ``dpsgd``).
        average_at_end: at the end of fit every rank's parameters become the mean over the ranks.
        restore_shards: on resume, restore every rank's own parameters, optimizer state and
            schedule position from ``<checkpoint>.adpsgd/rank<r>.pt``; ``False`` starts every rank
            from the checkpoint's average.
        **kwargs: as for ``DDPStrategy`` (``timeout`` also bounds each exchange). DDP's own
            communication-hook arguments and ``process_group`` may only be ``None``, ``static_graph``
            only ``False``.

    The exchange runs on a gloo group of its own, created on every rank as fit sets up.
    """

    name = "adpsgd"
    description = "asynchronous decentralised parallel SGD (background pair averaging)"

    def __init__(
        self,
        max_staleness: int = 2,
        peering: Literal["ring", "random"] = "ring",
        seed: int = 0,
        warmup_steps: int = 0,
        compress: Literal["none", "gtc"] = "none",
        density: float = 0.01,
        average_eval: bool = True,
        average_at_end: bool = True,
        restore_shards: bool = True,
        **kwargs: Any,
    ) -> None:
        check_int(
            "max_staleness", max_staleness, 1,
            "local steps an exchange may stay in flight; the odd ranks apply each mean at the earliest one step "
            "after the model they sent, so 0 cannot be kept: use dpsgd for the synchronous form",
        )  # fmt: skip
        if peering not in PEERINGS:
            raise ValueError(f"Expect peering in {PEERINGS} (the schedule of each even rank's peers), got {peering!r}")
        check_int("seed", seed, 0, "the seed of peering='random'")
        check_compression(compress, density)
        if kwargs.get("process_group") is not None:
            raise ValueError(
                f"adpsgd pairs all ranks over a gloo group of its own; process_group={kwargs['process_group']!r} "
                "cannot restrict it. Remove process_group (or use dpsgd, whose ring is that group's ranks)"
            )
        if kwargs.get("static_graph"):
            raise ValueError(
                "adpsgd: static_graph=True cannot be kept: after the warmup DDP reduces no gradient (as inside "
                "no_sync), which DDP's static graph does not support, and the static graph only speeds up that "
                "reduction. Remove static_graph (or set it False)"
            )
        super().__init__(
            warmup_steps=warmup_steps, average_eval=average_eval, average_at_end=average_at_end,
            restore_shards=restore_shards, **kwargs,
        )  # fmt: skip
        self._max_staleness = max_staleness
        self._peering = peering
        self._seed = seed
        self._compress = compress
        self._density = float(density)
        self._comm_group: dist.ProcessGroup | None = None

    @property
    def max_staleness(self) -> int:
        return self._max_staleness

    @property
    def peering(self) -> str:
        return self._peering

    @property
    def seed(self) -> int:
        return self._seed

    @property
    def compress(self) -> str:
        return self._compress

    @property
    def density(self) -> float:
        return self._density

    @property
    def adpsgd_state(self) -> ADPSGDState | None:
        """The pairing, step counter, schedule position and statistics; ``None`` before ``fit``."""
        return self._state  # type: ignore[return-value]

    @override
    def _configure_launcher(self) -> None:
        check_world(self.num_nodes * self.num_processes, self._peering)  # as the Trainer is built
        super(DPSGDStrategy, self)._configure_launcher()

    @override
    def setup(self, trainer: Trainer) -> None:
        super(DPSGDStrategy, self).setup(trainer)  # LocalStepsMixin's, without dpsgd's per-step spread
        if trainer.state.fn == TrainerFn.FITTING:
            add_callback(trainer, StalenessLogger(lambda: self._state, self.name, self._sync_point, self._resume))
            no_sigterm_broadcast(trainer)
            state = self._state
            if isinstance(state, ADPSGDState) and state.compress == "gtc":  # (no thread runs yet, on any rank)
                state.measure_spread(self._params)  # (a collective: every edge's reference, the ranks' mean)

    @override
    def _register_ddp_hooks(self) -> None:
        assert isinstance(self.model, DistributedDataParallel)
        if self._comm_group is None:  # (collective: every rank, once per strategy)
            timeout = self._timeout if isinstance(self._timeout, timedelta) else None
            self._comm_group = dist.new_group(backend="gloo", timeout=timeout)
        group = self._comm_group
        self._state = state = self._setup_state(
            lambda: ADPSGDState(group, self._max_staleness, self._peering, self._seed, self._warmup_steps,
                                self._compress, self._density)
        )
        state.comm_group = group  # (a continued fit's state: the group of this fit)
        if self.global_rank == 0 and not self._continuing:
            log.info(
                "%s config: max_staleness=%d, peering=%s, seed=%d, warmup_steps=%d, compress=%s, density=%g, "
                "average_eval=%s, average_at_end=%s, world_size=%d",
                self.name, self._max_staleness, self._peering, self._seed, self._warmup_steps, self._compress,
                self._density, self._average_eval, self._average_at_end, state.world_size,
            )  # fmt: skip
        self.model.register_comm_hook(state, local_hook)  # the dense warmup's all-reduce
        self.model.require_forward_param_sync = False  # no buffer broadcast in the forward pass
        self._sync_gradients()

    def _sync_gradients(self) -> None:
        """DDP reduces gradients during the warmup only (afterwards as inside ``no_sync``: no collective)."""
        if isinstance(self.model, DistributedDataParallel) and self._state is not None:
            self.model.require_backward_grad_sync = not self._state.averaging

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Any,
        model: LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        self._resume()  # (the batch's start did, unless the optimizer steps without a Trainer's batch)
        output = super(DPSGDStrategy, self).optimizer_step(optimizer, closure, model, **kwargs)
        self._sync_gradients()
        return output

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        super().load_optimizer_state_dict(checkpoint)  # (LocalStepsMixin's: this rank's shard)
        entry, state = checkpoint.get(self.name), self._state
        if isinstance(entry, dict) and isinstance(state, ADPSGDState) and state.step != entry.get("step", state.step):
            gap = state.step - int(entry["step"])
            log.warning(
                "%s: rank %d's shard is at step %d, the checkpoint (rank 0's, whose progress the Trainer resumes) at "
                "step %d: the ranks stopped at different steps (each rank stops on its own SIGTERM). This rank %s %d "
                "batch(es) of the epoch and its step counter stays %d apart. Resume from a checkpoint that "
                "ModelCheckpoint saved (every rank at the same step), or with restore_shards=False",
                self.name, self.global_rank, state.step, int(entry["step"]), "repeats" if gap > 0 else "skips",
                abs(gap), gap,
            )  # fmt: skip

    @override
    def _unfrozen_diverges(self) -> str | None:
        return "it is not among the parameters exchanged (those trainable when fit set up)"

    # ---- the global synchronisation points ----------------------------------------------------------

    def _resume(self) -> None:
        """The communication thread again after a synchronisation point (no-op while it runs): at the
        start of each training epoch and batch, so that a slow rank answers before its first step is done."""
        state = self._state
        if isinstance(state, ADPSGDState) and state.averaging:
            state.start(self._params)

    def _sync_point(self) -> None:
        """Finish every exchange on this rank (every rank calls it at the same points), then measure
        the replicas' spread."""
        state = self._state
        if isinstance(state, ADPSGDState) and state.drain(self._params):
            state.measure_spread(self._params)

    @override
    def on_validation_start(self) -> None:
        self._sync_point()
        super().on_validation_start()

    @override
    def on_test_start(self) -> None:
        self._sync_point()
        super().on_test_start()

    @override
    def on_predict_start(self) -> None:
        self._sync_point()
        super().on_predict_start()

    @override
    def on_train_end(self) -> None:
        self._sync_point()
        super().on_train_end()

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        self._sync_point()
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def on_exception(self, exception: BaseException) -> None:
        state = self._state
        if isinstance(state, ADPSGDState):
            state.abandon()
        LocalStepsMixin.on_exception(self, exception)

    @override
    def teardown(self) -> None:
        state = self._state
        idle = not (isinstance(state, ADPSGDState) and self._comm_group is not None and state.uses(self._comm_group))
        if self._comm_group is not None and dist.is_initialized() and idle:
            dist.destroy_process_group(self._comm_group)
        self._comm_group = None
        super().teardown()

    @override
    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state["_comm_group"] = None  # process groups do not pickle
        return state
