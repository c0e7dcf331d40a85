"""Decentralised parallel SGD (``"dpsgd"``): every step, each rank averages its parameters with its
ring neighbours instead of all-reducing gradients (Lian et al., "Can Decentralized Algorithms
Outperform Centralized Algorithms?", NeurIPS 2017; the synchronous form of IBM's ADPSGD, ``seeds/003_…``).

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
``<checkpoint>.dpsgd/rank<r>.pt`` (:class:`~gtc_lightning.averaging.RankShards`) for a bit-exact
resume; the checkpoint itself holds the average (one all-reduce per save): the model that
validation evaluates and ``load_from_checkpoint`` gives, and where every rank starts from when a fit
resumes with ``restore_shards=False``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from gtc_lightning.averaging import (
    AveragingState,
    LocalStepsMixin,
    RankShards,
    SyncStats,
    SyncStatsLogger,
    add_callback,
    all_mean,
    drop_hook_args,
    flatten,
    local_hook,
    unflatten_,
)
from gtc_lightning.hook import allreduce_bytes
from gtc_lightning.strategy import _check_int

log = logging.getLogger(__name__)


def ring_neighbours(rank: int, world: int) -> list[int]:
    """The ring neighbours of ``rank`` among ``world`` ranks: ``[left, right]``, or the one other
    rank when ``world == 2``."""
    if world < 2:
        raise ValueError(f"a ring needs at least 2 ranks, got {world}")
    left, right = (rank - 1) % world, (rank + 1) % world
    return [left] if left == right else [left, right]


def check_ring_size(world: int) -> None:
    if world < 2:
        raise ValueError(
            f"dpsgd averages each rank with its ring neighbours, so it needs at least 2 ranks; got {world}. "
            "Train with more devices (or num_nodes), or with a single-device strategy"
        )


def neighbour_ops(sent: torch.Tensor, received: list[torch.Tensor], peers: list[int], group=None) -> list:
    """The point-to-point ops of one neighbour exchange, every receive posted before any send.

    On gloo the order decides the speed: with the sends first, two ranks that send to each other
    take turns on the link (measured on 2 and 4 emulated nodes at 100 Mbit/s, 6.2 MB to each
    neighbour: 0.9-1.0 s on 2 nodes, 1.9-2.1 s on 4, about twice the wire time); with the receives
    posted first both directions flow at once (0.53 s and 1.07 s, the wire time). What arrives is
    the same either way."""
    ops = [dist.P2POp(dist.irecv, buf, peer, group) for peer, buf in zip(peers, received)]
    return ops + [dist.P2POp(dist.isend, sent, peer, group) for peer in peers]


class DPSGDState(AveragingState):
    """State of D-PSGD: the ring, the exchange in flight and the statistics of
    :class:`~gtc_lightning.averaging.AveragingState` (a sync every step, ``period=1``), plus the
    newest spread measurement.

    Args:
        warmup_steps: optimizer steps of dense gradient all-reduce before the neighbour averaging starts.
        process_group: the ring's ranks (``None``: all ranks), at least 2.
    """

    def __init__(self, warmup_steps: int = 0, process_group: dist.ProcessGroup | None = None) -> None:
        world = dist.get_world_size(process_group)
        check_ring_size(world)
        super().__init__(period=1, warmup_steps=warmup_steps, process_group=process_group)
        rank = dist.get_rank(process_group)
        to_global = (lambda r: r) if process_group is None else (lambda r: dist.get_global_rank(process_group, r))
        self.neighbours = [to_global(r) for r in ring_neighbours(rank, world)]
        # The internal state.
        self._works: list = []
        self._buffers: dict[tuple, list[torch.Tensor]] = {}  # (numel, dtype, device) -> [sent, received...]
        self._current: tuple | None = None  # (parameters, sent, received) of the exchange in flight
        self._host_s = 0.0  # host seconds of the launch, the wait and the average
        self._done: tuple[int, float] | None = None  # (bytes, host seconds) of this step's exchange
        # The statistics.
        self.totals["spread_bytes"] = 0
        self.measured: dict | None = None  # the newest spread: {"step", "spread", "distance"}

    @property
    def averaging(self) -> bool:
        """Whether the step about to run averages with the neighbours (the warmup is over)."""
        return self.step >= self.warmup_steps

    def launch(self, params: list[torch.Tensor]) -> None:
        """Step 2: send a flat copy of ``params`` to the neighbours and receive theirs, asynchronously."""
        started = time.perf_counter()
        numel = sum(p.numel() for p in params)
        dtype = functools.reduce(torch.promote_types, (p.dtype for p in params))
        key = (numel, dtype, params[0].device)
        buffers = self._buffers.get(key)
        if buffers is None:
            buffers = [torch.empty(numel, dtype=dtype, device=params[0].device) for _ in range(1 + len(self.neighbours))]
            self._buffers = {key: buffers}
        sent, received = buffers[0], buffers[1:]
        with torch.no_grad():
            torch.cat([p.detach().reshape(-1).to(dtype) for p in params], out=sent)
        self._works = dist.batch_isend_irecv(neighbour_ops(sent, received, self.neighbours, self.process_group))
        self._current = (params, sent, received)
        self._host_s = time.perf_counter() - started

    def complete(self) -> None:
        """Step 3: wait for the neighbours' copies and write the neighbour average into the parameters."""
        if self._current is None:  # (once, should an optimizer call the closure again)
            return
        started = time.perf_counter()
        params, sent, received = self._current
        self._current = None
        for work in self._works:
            work.wait()
        self._works = []
        # x + ((l - x) + (r - x)) / 3: differences first, so that agreeing ranks keep their bits.
        for buf in received:
            buf.sub_(sent)
        for buf in received[1:]:
            received[0].add_(buf)
        sent.add_(received[0].div_(len(received) + 1))
        unflatten_(sent, params)
        size = sent.numel() * sent.element_size() * len(self.neighbours)
        self._done = (size, self._host_s + time.perf_counter() - started)

    @override
    def after_step(self, params: list[torch.Tensor], optimizers: list[Optimizer]) -> SyncStats:
        """Count one optimizer step: a dense warmup step, or the exchange :meth:`complete` did."""
        if self._done is None:
            return super().after_step(params, optimizers)
        (size, seconds), self._done = self._done, None
        self.step += 1
        stats = SyncStats(
            step=self.step, mode="sync", numel=sum(p.numel() for p in params), world_size=self.world_size,
            bytes_sent=size, bytes_received=size, exchange_s=seconds,
        )  # fmt: skip
        self._record(stats)
        return stats

    @override
    def exchange(self, params: list[torch.Tensor], optimizers: list[Optimizer]) -> tuple[int, int]:
        """Nothing after the step: the averaging happened inside it (an optimizer without parameters)."""
        return 0, 0

    def measure_spread(self, params: list[torch.Tensor]) -> dict:
        """The RMS distance of each rank's ``params`` from their mean over the ranks (a collective:
        call it on every rank). Returns ``{"step", "spread" (all ranks), "distance" (this rank)}``."""
        with torch.no_grad():
            mean, size = all_mean(params, self.process_group)
            squared = (flatten(params).to(mean.dtype) - mean).double().pow(2).mean().reshape(1)
            distance = math.sqrt(float(squared))
            dist.all_reduce(squared, group=self.process_group)
        self.totals["spread_bytes"] += size + allreduce_bytes(1, self.world_size, 8)
        spread = math.sqrt(float(squared) / self.world_size)
        self.measured = {"step": self.step, "spread": spread, "distance": distance}
        return self.measured

    def average_(self, params: list[torch.Tensor]) -> None:
        """Overwrite every rank's ``params`` with their mean over the ranks (a collective)."""
        with torch.no_grad():
            mean, _ = all_mean(params, self.process_group)
            unflatten_(mean, params)

    @override
    def __getstate__(self) -> dict:
        """As :class:`AveragingState`'s, without the exchange's buffers and requests."""
        return {**super().__getstate__(), "_works": [], "_buffers": {}, "_current": None}

    @override
    def stats(self) -> dict:
        """``{"step", "last", "total", "spread"}``; ``total["ratio_fp32"]``: DDP's fp32 all-reduce bytes
        over the same steps per byte sent (1 with 2 ranks, below 1 with 3: D-PSGD sends more, to fewer
        peers)."""
        return {**super().stats(), "spread": self.measured}


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
        _check_int("warmup_steps", warmup_steps, 0, "dense gradient all-reduce steps; 0 averages from the start")
        drop_hook_args(kwargs, type(self).__name__)
        super().__init__(**kwargs)
        self._warmup_steps = warmup_steps
        self._average_eval = bool(average_eval)
        self._average_at_end = bool(average_at_end)
        self._state: DPSGDState | None = None
        self._params: list[torch.nn.Parameter] = []  # the trainable ones at setup (statistics)
        self._shards = RankShards(self.name, restore_shards)
        self._own: torch.Tensor | None = None  # this rank's parameters while the average is evaluated
        self._at_end: tuple[torch.Tensor, torch.Tensor] | None = None  # (own, average) after average_at_end

    @property
    def warmup_steps(self) -> int:
        return self._warmup_steps

    @property
    def average_eval(self) -> bool:
        return self._average_eval

    @property
    def average_at_end(self) -> bool:
        return self._average_at_end

    @property
    def dpsgd_state(self) -> DPSGDState | None:
        """The ring, step counter and statistics; ``None`` before ``fit`` configured DDP."""
        return self._state

    def _trainable(self) -> list[torch.Tensor]:
        assert self.lightning_module is not None
        return [p for p in self.lightning_module.parameters() if p.requires_grad]

    @override
    def _configure_launcher(self) -> None:
        check_ring_size(self.num_nodes * self.num_processes)  # as the Trainer is built, before any process starts
        super()._configure_launcher()

    @override
    def setup(self, trainer: Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            add_callback(trainer, _SpreadLogger(lambda: self._state, self.name))
            self._continue_own_model()

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

    # ---- evaluating the average ---------------------------------------------------------------

    def _evaluate_average(self) -> None:
        if not self._average_eval or self._own is not None or self.world_size < 2:
            return
        params = self._trainable()
        self._own = flatten(params)
        with torch.no_grad():
            mean, _ = all_mean(params, self._ddp_kwargs.get("process_group"))
            unflatten_(mean, params)

    def _restore_own(self) -> None:
        if self._own is not None:
            unflatten_(self._own, self._trainable())
            self._own = None

    def _averaged_state_dict(self) -> dict[str, Any]:
        """The module's state dict with the mean over the ranks in place of each trainable parameter."""
        assert self.lightning_module is not None
        params = self._trainable()
        with torch.no_grad():
            mean, _ = all_mean(params, self._ddp_kwargs.get("process_group"))
        averaged = {id(p): part.view_as(p) for p, part in zip(params, mean.split([p.numel() for p in params]))}
        state = self.lightning_module.state_dict(keep_vars=True)  # tied weights: one tensor under two keys
        return {key: averaged.get(id(value), value).detach() for key, value in state.items()}

    @contextlib.contextmanager
    def _own_parameters(self) -> Iterator[None]:
        """This rank's own parameters in place for the duration (inside an evaluation loop)."""
        if self._own is None:
            yield
            return
        params = self._trainable()
        mean = flatten(params)
        unflatten_(self._own, params)
        try:
            yield
        finally:
            unflatten_(mean, params)

    @override
    def on_validation_start(self) -> None:
        self._evaluate_average()

    @override
    def on_validation_end(self) -> None:
        self._restore_own()

    @override
    def on_test_start(self) -> None:
        self._evaluate_average()

    @override
    def on_test_end(self) -> None:
        self._restore_own()

    @override
    def on_predict_start(self) -> None:
        self._evaluate_average()

    @override
    def on_predict_end(self) -> None:
        self._restore_own()

    @override
    def on_train_end(self) -> None:
        if self._average_at_end and self._state is not None:
            params = self._trainable()
            own = flatten(params).cpu()  # (kept off the accelerator: the model may be used after fit)
            self._state.average_(params)
            self._at_end = (own, flatten(params).cpu())

    def _continue_own_model(self) -> None:
        """A fit that continues one that ended with the average goes on from each rank's own model,
        as the uninterrupted fit would; unless the model was changed since (its weights loaded)."""
        at_end, self._at_end = self._at_end, None
        if at_end is None or not self._continuing:
            return
        own, average = at_end
        params = self._trainable()
        if torch.equal(flatten(params).cpu(), average):
            unflatten_(own, params)

    # ---- checkpoints: every rank's own state in its shard (LocalStepsMixin), the average in the checkpoint

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        if self._state is not None and "state_dict" in checkpoint and self._own is None:
            checkpoint["state_dict"] = self._averaged_state_dict()  # (in an evaluation loop it is already)
        with self._own_parameters():
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
