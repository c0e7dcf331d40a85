"""Decentralised parallel SGD (``"dpsgd"``) as a Lightning strategy (the ring, the exchange and its
state: :mod:`gtc_lightning.algorithms.averaging.dpsgd`): every step, each rank averages its parameters with its
ring neighbours instead of all-reducing gradients (Lian et al., "Can Decentralized Algorithms
Outperform Centralized Algorithms?", NeurIPS 2017; the synchronous form of IBM's ADPSGD, Zhang et al., ICASSP 2019).

Per optimizer step k and per rank i, as in the paper's Algorithm 1 (the update is applied to the
neighbour average, with the gradient computed at the rank's own model, *instead of* a local step
followed by an averaging):

1. Dense warmup: for the first ``warmup_steps`` steps DDP's all-reduce averages the gradients (the
   replicas stay identical) and nothing else is sent.
2. Exchange: before the forward pass, send a flat copy of x_i(k) (the parameters the optimizer
   updates) to the ring neighbours ``i - 1`` and ``i + 1`` and receive theirs (``batch_isend_irecv``,
   the receives posted first; asynchronous: it runs while the forward and backward passes compute the gradient at x_i(k)).
3. Average, after the backward pass: x_i ← x_i + ((x_{i-1} - x_i) + (x_{i+1} - x_i)) / 3 in the
   parameters' dtype, i.e. weights 1/3 for self, left and right (a symmetric, doubly stochastic
   mixing matrix); a rank that agrees with its neighbours keeps its parameters bit for bit.
   With 2 ranks the one neighbour is both left and right: x_i ← x_i + (x_j - x_i) / 2, weights 1/2
   and 1/2 (the 2-ring's mixing matrix; 1/3 and 2/3 would swing past the mean).
4. Local step: the optimizer applies the rank's own gradient (DDP sends none: its hook is
   ``no_comm_hook`` after the warmup) to the averaged parameters:
   x_i(k+1) = Σ_j W_ij x_j(k) - lr · g_i(x_i(k)).

Each rank sends and receives 2 copies of the model per step (1 with 2 ranks), against a ring
all-reduce's 2 (W-1)/W: D-PSGD's gain is not bytes but a fixed, small number of neighbours (no
global synchronisation; latency independent of W), which pays off on slow or uneven networks.

The replicas differ by design. Their spread, the RMS distance of each rank's parameters from the
mean over ranks, is measured on the Trainer's logging steps (one all-reduce of the parameters, its
bytes counted apart as ``spread_bytes``) and logged as ``dpsgd/spread`` (over all ranks) and
``dpsgd/distance`` (this rank); ``exchange_s`` is the host time of the launch, the wait and the
average (the transfer that overlapped the passes is not in it). Validation, test and predict loops
evaluate the average of all ranks' parameters (``average_eval``; each rank's own come back
afterwards), and at the end of fit every rank's parameters become that average (``average_at_end``), so that the trained model is the
consensus one. Checkpoints keep every rank's own parameters and optimizer state in
``<checkpoint>.dpsgd/rank<r>.pt`` (:class:`~gtc_lightning.strategies.averaging.RankShards`) for a bit-exact
resume; the checkpoint itself holds the average (one all-reduce per save): the model that
validation evaluates and ``load_from_checkpoint`` gives, and where every rank starts from when a fit
resumes with ``restore_shards=False``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from gtc_lightning.algorithms.averaging.dpsgd import DPSGDState, check_ring_size
from gtc_lightning.algorithms.averaging.model_averaging import (
    local_hook,
)
from gtc_lightning.algorithms.common import check_int
from gtc_lightning.strategies.averaging import LocalStepsMixin, RankShards
from gtc_lightning.strategies.common import add_callback, drop_hook_args
from gtc_lightning.strategies.loggers import SyncStatsLogger

log = logging.getLogger(__name__)




class _SpreadLogger(SyncStatsLogger):
    """:class:`SyncStatsLogger`, plus the replicas' spread measured and logged on the same steps."""

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        state = self._state_of()
        connector = getattr(trainer, "_logger_connector", None)
        due = (
            state is not None
            and state.last is not None
            and state.last.step != self._logged_step
            and (connector is None or connector.should_update_logs)
        )
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if not due:
            return
        spread = state.measure_spread([p for p in pl_module.parameters() if p.requires_grad])
        values = {f"{self.prefix}/spread": spread["spread"], f"{self.prefix}/distance": spread["distance"]}
        pl_module.log_dict(values, on_step=True, on_epoch=False, batch_size=1)
        bar = {f"{self.prefix}_spread": spread["spread"]}
        pl_module.log_dict(bar, on_step=True, on_epoch=False, prog_bar=True, logger=False, batch_size=1)


class DPSGDStrategy(LocalStepsMixin, DDPStrategy):
    """DDP whose ranks average their parameters with their ring neighbours every optimizer step
    (synchronous D-PSGD) instead of all-reducing their gradients.

    Args:
        warmup_steps: optimizer steps of dense gradient averaging (DDP's all-reduce) before the
            neighbour averaging starts.
        average_eval: validation, test and predict loops evaluate the mean of all ranks' parameters
            (one all-reduce as the loop starts; each rank's own parameters come back as it ends);
            ``False``: each rank evaluates its own.
        average_at_end: at the end of fit, every rank's parameters become the mean over the ranks
            (the consensus model is what fit returns); ``False`` keeps each rank's own. A later
            ``fit`` of the same Trainer goes on from each rank's own, as one uninterrupted fit would
            (unless the model's weights were changed in between).
        restore_shards: on resume, restore every rank's own parameters and optimizer state from
            ``<checkpoint>.dpsgd/rank<r>.pt``; ``False`` starts every rank from the checkpoint's
            (the average, with rank 0's optimizer state), also on another number of ranks.
        **kwargs: as for ``DDPStrategy`` (``accelerator``, ``precision_plugin``, ``timeout``,
            ``start_method``, ...) and for ``DistributedDataParallel`` (``find_unused_parameters``,
            ``static_graph``, ``process_group``: the ring is that group's ranks). DDP's own
            communication-hook arguments may only be ``None``.

    Each optimizer step averages the parameters that optimizer updates (manual optimization with
    several optimizers: each of its steps). Gradient clipping acts on each rank's local gradient.
    A world of 1 rank is refused as the Trainer is built: there are no neighbours.
    """

    name = "dpsgd"
    description = "decentralised parallel SGD (ring-neighbour parameter averaging)"

    def __init__(
        self,
        warmup_steps: int = 0,
        average_eval: bool = True,
        average_at_end: bool = True,
        restore_shards: bool = True,
        **kwargs: Any,
    ) -> None:
        check_int("warmup_steps", warmup_steps, 0, "dense gradient all-reduce steps; 0 averages from the start")
        drop_hook_args(kwargs, type(self).__name__)
        super().__init__(**kwargs)
        self._warmup_steps = warmup_steps
        self._average_eval = bool(average_eval)
        self._average_at_end = bool(average_at_end)
        self._state: DPSGDState | None = None
        self._params: list[torch.nn.Parameter] = []  # the trainable ones at setup (statistics)
        self._shards = RankShards(self.name, restore_shards)

    @property
    def warmup_steps(self) -> int:
        return self._warmup_steps

    @property
    def dpsgd_state(self) -> DPSGDState | None:
        """The ring, step counter and statistics; ``None`` before ``fit`` configured DDP."""
        return self._state

    @override
    def _configure_launcher(self) -> None:
        check_ring_size(self.num_nodes * self.num_processes)  # as the Trainer is built, before any process starts
        super()._configure_launcher()

    @override
    def setup(self, trainer: Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            add_callback(trainer, _SpreadLogger(lambda: self._state, self.name))

    @override
    def _register_ddp_hooks(self) -> None:
        # DDPStrategy registers hooks on CUDA only; D-PSGD needs its own on every device.
        assert isinstance(self.model, DistributedDataParallel)
        group = self._ddp_kwargs.get("process_group")
        self._state = state = self._setup_state(lambda: DPSGDState(self._warmup_steps, group))
        if self.global_rank == 0 and not self._continuing:
            log.info(
                "%s config: warmup_steps=%d, average_eval=%s, average_at_end=%s, world_size=%d",
                self.name, self._warmup_steps, self._average_eval, self._average_at_end, state.world_size,
            )  # fmt: skip
        self.model.register_comm_hook(state, local_hook)

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        state = self._state
        params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        if state is None or not params or not state.averaging:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        state.launch(params)  # x(k) travels while the forward and backward passes run

        def closure_then_average() -> Any:
            result = closure()
            state.complete()
            return result

        return super().optimizer_step(optimizer, closure_then_average, model, **kwargs)

    @override
    def _unfrozen_diverges(self) -> str | None:
        if self._state is not None and self._state.averaging:
            return None  # the neighbour averaging takes each step's trainable parameters
        return "it is in none of DDP's buckets, whose all-reduce keeps the replicas identical during the warmup"
