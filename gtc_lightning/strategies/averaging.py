"""Periodic model averaging (``"ma"``) as a Lightning strategy, and the wiring every strategy of the
averaging family shares.

Long file: model averaging and the family's shared wiring (the shards, the sync after each step, the end
of fit, the evaluation and checkpoints of the mean of the ranks' models), which every scheme extends.

Model averaging follows Su, Chen & Xu, "Experiments on Parallel Training of Deep Neural Network
using Model Averaging" (2015). The state and the hook are in
:mod:`gtc_lightning.algorithms.averaging.model_averaging`; per optimizer step and per rank:

1. Dense warmup: for the first ``warmup_steps`` steps the hook (``local_hook``) averages the gradients
   as DDP's default hook does, so that the replicas stay identical while the model moves fastest.
2. Local steps: afterwards the hook sends nothing; each rank's optimizer steps on its own gradient
   and the replicas drift apart.
3. Exchange, after every ``period``-th local step: one all-reduce of a flat copy of the trainable
   parameters (``2 (W-1)/W`` of it sent per rank in a ring) and the mean written back, identical
   on every rank. The optimizer state is then kept, reset or averaged (``optimizer_state``).

:mod:`gtc_lightning.strategies.bmuf` and :mod:`gtc_lightning.strategies.dpsgd` build BMUF, the
BMUF-GTC hybrid and D-PSGD from the same pieces: :class:`RankShards` keeps every rank's own
parameters and optimizer state beside a checkpoint, since between syncs they differ from the mean
of the ranks' models (the one the checkpoint holds), and :class:`LocalStepsMixin` wires the state and the shards into a
Lightning strategy the same way for every scheme. DDP's own buffer broadcast
(``broadcast_buffers``) and unused-parameter bitmap are not counted in the bytes, as for GTC.
"""

import contextlib
import logging
import os
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy, Strategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from gtc_lightning.algorithms.averaging.model_averaging import (
    OPTIMIZER_STATES,
    AveragingState,
    all_mean,
    flatten,
    local_hook,
    unflatten_,
)
from gtc_lightning.algorithms.common import all_gather_equal, check_int, parameter_checksums
from gtc_lightning.strategies.checkpoint import remove_empty_folder, resolve_link
from gtc_lightning.strategies.common import (
    add_callback,
    drop_hook_args,
    hint_unused_parameters,
    register_names,
)
from gtc_lightning.strategies.loggers import SyncStatsLogger

log = logging.getLogger(__name__)


# ---- every rank's own state beside a checkpoint -----------------------------------------------------


class RankShards:
    """Every rank's own training state in ``<checkpoint>.<name>/rank<r>.pt``: its parameters and
    buffers, its optimizers' and AMP scaler's state and its averaging state. Between syncs these
    differ from the mean of the ranks' models, the one in Lightning's checkpoint, so a resume needs them to be
    bit-exact. The checkpoint gets an entry ``name`` with the world size and counters. Every rank
    writes and removes its own shard; a resume through a link (``last.ckpt`` of
    ``ModelCheckpoint(save_last="link")``) reads the shards beside the link's target.

    Args:
        name: the strategy's name: the checkpoint entry and the shard folder's suffix.
        restore: restore every rank's shard on resume; ``False`` starts every rank from the
            checkpoint (the mean of the ranks' models, rank 0's optimizer state) and a new period from there.
    """

    def __init__(self, name: str, restore: bool = True) -> None:
        self.name = name
        self.restore = bool(restore)
        self._pending: tuple[dict, _PATH] | None = None  # a fit's checkpoint entry, waiting for setup

    def path(self, checkpoint_path: _PATH, rank: int) -> str:
        return os.path.join(f"{checkpoint_path}.{self.name}", f"rank{rank}.pt")

    def save(self, strategy: Strategy, state: AveragingState, checkpoint: dict, filepath: _PATH) -> None:
        """On every rank (Lightning saves the checkpoint itself on rank 0 only)."""
        checkpoint[self.name] = {"format": 1, "world_size": strategy.world_size, **state.state_dict()}
        shard = {
            "rank": strategy.global_rank,
            "world_size": strategy.world_size,
            "state_dict": strategy.lightning_module.state_dict(),
            "optimizers": [optimizer.state_dict() for optimizer in strategy.optimizers],
            "precision": strategy.precision_plugin.state_dict(),
            "averaging": state.state_dict(),
        }
        strategy.checkpoint_io.save_checkpoint(shard, self.path(filepath, strategy.global_rank))

    def remove(self, strategy: Strategy, filepath: _PATH) -> None:
        """On every rank: its own shard, through the strategy's CheckpointIO (on several nodes each
        rank may have written to a disk of its own), then the folder once empty. A link's removal
        (``save_last="link"``) removes nothing of its target: its own path has no shards."""
        where = self.path(filepath, strategy.global_rank)
        if get_filesystem(where).exists(where):
            strategy.checkpoint_io.remove_checkpoint(where)
        remove_empty_folder(os.path.dirname(where))

    def remember(self, strategy: Strategy, checkpoint: dict, path: _PATH) -> None:
        """From ``load_checkpoint``: only a fit resumes the ranks' state (a validate/test with a
        checkpoint must not leave it for a later fit). The shards are beside the file a linked
        ``last.ckpt`` points to."""
        module = strategy.lightning_module
        fitting = (
            module is not None
            and module._trainer is not None
            and module.trainer.state.fn == TrainerFn.FITTING
        )
        entry = checkpoint.get(self.name)
        self._pending = (entry, resolve_link(path)) if fitting and entry is not None else None

    def restore_into(self, strategy: Strategy, state: AveragingState) -> None:
        """After Lightning restored rank 0's optimizer state: this rank's own state replaces it."""
        if self._pending is None:
            return
        entry, path = self._pending
        self._pending = None
        rank, old_world = strategy.global_rank, entry["world_size"]
        params = [p for p in strategy.lightning_module.parameters() if p.requires_grad]
        if not self.restore:
            state.load_state_dict(entry)
            if state.step >= state.warmup_steps:
                state.begin(params)
            log.info(
                "%s: restore_shards=False: every rank starts from the checkpoint at step %d",
                self.name,
                state.step,
            )
            return
        if old_world != strategy.world_size:
            raise RuntimeError(
                f"{self.name}: the checkpoint {path} was saved by {old_world} ranks but this run has "
                f"{strategy.world_size}; every rank's own model and optimizer state cannot be mapped onto another number "
                f"of ranks. Resume with {old_world} ranks, or with restore_shards=False to start every rank from the "
                "checkpoint's (rank 0's) model and optimizer state"
            )
        where = self.path(path, rank)
        if not get_filesystem(where).exists(where):
            raise RuntimeError(
                f"{self.name}: the checkpoint {path} was saved by {old_world} ranks, but the shard of rank {rank} is "
                f"missing: {where}. Each rank writes its shard beside the checkpoint; copy it there from the machine "
                f"that ran rank {rank}, or resume with restore_shards=False to start every rank from the checkpoint's "
                "(rank 0's) model and optimizer state"
            )
        shard = strategy.checkpoint_io.load_checkpoint(where)
        strategy.lightning_module.load_state_dict(shard["state_dict"])
        for optimizer, saved in zip(strategy.optimizers, shard["optimizers"]):
            optimizer.load_state_dict(saved)
        if shard["precision"]:
            strategy.precision_plugin.load_state_dict(shard["precision"])
        state.load_state_dict(shard["averaging"])
        log.info(
            "%s: restored rank %d's model, optimizer and averaging state at step %d",
            self.name,
            rank,
            state.step,
        )


# ---- pieces every strategy of the family wires the same way ------------------------------------------


def scale_learning_rates(strategy: Strategy, factor: float) -> None:
    """Multiply every parameter group's learning rate and the schedulers' base rates by ``factor``."""
    for optimizer in strategy.optimizers:
        for group in optimizer.param_groups:
            for key in ("lr", "initial_lr"):
                if key in group:
                    group[key] = group[key] * factor
    for config in strategy.lr_scheduler_configs:
        scheduler = config.scheduler
        for key in ("base_lrs", "_last_lr"):
            if isinstance(getattr(scheduler, key, None), list):
                setattr(scheduler, key, [lr * factor for lr in getattr(scheduler, key)])


# ---- the strategy -----------------------------------------------------------------------------------


class LocalStepsMixin:
    """The wiring every strategy of the family whose ranks take local steps shares: the sync after
    each optimizer step, every rank's own checkpoint shard (:class:`RankShards`), ``sync_stats``,
    the unused-parameter hint and the registered names.

    Mixed in before the Lightning strategy it extends (``class X(LocalStepsMixin, DDPStrategy)``);
    the class sets ``name`` (registered name, statistics prefix, shard suffix) and ``description``,
    and keeps its :class:`AveragingState` in ``_state``, the parameters it averages in ``_params``
    (the trainable ones at setup) and its :class:`RankShards` in ``_shards``.

    A fit that continues the previous one (``trainer.fit`` again on the same Trainer and model, in
    ranks that outlive a fit: torchrun, SLURM, the popen launcher's) keeps the state: the strategy
    builds its state through :meth:`_setup_state`. Lightning makes every rank's model rank 0's
    when it sets up any loop (DDP's broadcast as it wraps the model; ``validate``/``test`` sync the
    module), which would drop the other ranks' local steps: each rank's own tensors are put back.
    A parameter frozen when fit sets up must stay frozen until it ends (a gradient on it raises:
    nothing would keep its copies together); unfreeze it between two fits.
    """

    name = ""
    description = ""
    _state: AveragingState | None = None
    _params: list[torch.nn.Parameter]
    _shards: RankShards
    _frozen: tuple[tuple[str, torch.nn.Parameter], ...] = ()  # frozen at setup: they must get no gradient
    _continuing = False  # this fit continues the last one: keep the state
    _carried: dict | None = None  # the last fit's counters, for a fit that keeps only them
    _fitted: tuple | None = None  # weak references to the last fit's Trainer and model, its trainable layout
    _average_at_end = False  # the class's default; the strategies take it as an argument
    _at_end: tuple[torch.Tensor, torch.Tensor] | None = None  # (own, average) after average_at_end
    _average_eval = False  # the class's default; the strategies take it as an argument
    _own: torch.Tensor | None = None  # this rank's parameters while an evaluation loop sees the mean

    @property
    def average_eval(self) -> bool:
        """Whether validation, test and predict loops evaluate the mean of the ranks' models."""
        return self._average_eval

    @property
    def average_at_end(self) -> bool:
        """Whether a fit that ends with the ranks' models apart leaves every rank their mean."""
        return self._average_at_end

    @property
    def sync_stats(self) -> dict:
        """This rank's statistics: ``{"step", "last": {...} or None, "total": {...}}`` (:class:`SyncStats`)."""
        return self._state.stats() if self._state is not None else {"step": 0, "last": None, "total": None}

    def _trainable_layout(self, module: torch.nn.Module) -> list[tuple[str, tuple[int, ...]]]:
        return [(name, tuple(p.shape)) for name, p in module.named_parameters() if p.requires_grad]

    def _continues(self, trainer: Trainer) -> bool:
        """Whether this run continues the last fit: the same Trainer and model with the same trainable
        parameters, and no checkpoint to restore (a checkpoint restores every rank's state itself). A
        fit whose trainable parameters changed starts from rank 0's model and a new period, with the
        step counter and totals of the last fit (``_carried``)."""
        self._carried = None
        module = self.lightning_module
        if self._state is None or self._fitted is None or module is None or self._shards._pending is not None:
            return False
        trainer_ref, module_ref, layout = self._fitted
        if trainer_ref() is not trainer or module_ref() is not module:
            return False
        if self._trainable_layout(module) == layout:
            return True
        if trainer.state.fn == TrainerFn.FITTING:
            log.warning(
                "%s: the trainable parameters changed since the last fit; every rank starts from rank 0's model and "
                "a new period (the step counter goes on)", self.name,
            )  # fmt: skip
            self._carried = AveragingState.state_dict(self._state)  # the counters, not BMUF's W and Δ
        return False

    def _setup_state(self, new: Callable[[], AveragingState]) -> AveragingState:
        """From ``_register_ddp_hooks``, once the replicas are identical: the last fit's state when this
        fit continues it, else ``new()``, which starts its first period from the model unless the dense
        warmup comes first. Sets ``_params``, the parameters trainable now."""
        assert isinstance(self.model, DistributedDataParallel)
        module = self.model.module
        self._params = [p for p in module.parameters() if p.requires_grad]
        self._frozen = tuple((name, p) for name, p in module.named_parameters() if not p.requires_grad)
        self._fitted = (weakref.ref(module.trainer), weakref.ref(module), self._trainable_layout(module))
        if self._continuing:
            assert self._state is not None
            return self._state
        state = new()
        if self._carried is not None:
            state.load_state_dict(self._carried)
            self._carried = None
        if state.step >= state.warmup_steps:
            state.begin(self._params)
        return state

    @override
    def setup(self, trainer: Trainer) -> None:
        self._continuing = self._continues(trainer)
        module = self.lightning_module
        own = (
            {key: t.detach().clone() for key, t in module.state_dict().items() if torch.is_tensor(t)}
            if self._continuing
            else None
        )
        super().setup(trainer)  # type: ignore[misc]
        if own is not None:  # DDP (fit) or Lightning (validate, test) made them rank 0's
            with torch.no_grad():
                for key, t in self.lightning_module.state_dict().items():
                    if key in own:
                        t.copy_(own[key])
            log.info("%s: rank %d continues from its own model of the last fit", self.name, self.global_rank)
        if trainer.state.fn == TrainerFn.FITTING:
            self._continue_own_model()

    @override
    def on_train_end(self) -> None:
        """``average_at_end``: a fit that ended while the ranks' models differ (between two syncs, or any
        step of D-PSGD) leaves every rank the mean of them, the consensus model fit returns; each rank's
        own is kept for a fit that continues this one. Replicas that agree to the bit are left alone."""
        super().on_train_end()  # type: ignore[misc]
        params = self._params if self._state is not None else []
        if not self._average_at_end or not params or self.world_size < 2:
            return
        own = self._put_mean(params)
        if own is None:
            return
        self._at_end = (own.cpu(), flatten(params).cpu())  # (kept off the accelerator: the model may be used after fit)
        if self.global_rank == 0:
            log.info("%s: fit ended with the ranks' models apart; each is now their mean (average_at_end)", self.name)

    def _average_group(self) -> dist.ProcessGroup | None:
        """The ranks whose models ``average_at_end``, ``average_eval`` and the checkpoints average: DDP's
        ``process_group`` (None: all)."""
        return self._ddp_kwargs.get("process_group")  # type: ignore[attr-defined]

    def _replicas_agree(self, params: list[torch.Tensor]) -> bool:
        """Whether every rank of :meth:`_average_group` holds ``params`` bit for bit as this one does (their
        checksums gathered: every rank of the group must call it)."""
        group = self._average_group()
        sums = parameter_checksums(params)
        everyone = torch.empty(dist.get_world_size(group) * sums.numel(), dtype=sums.dtype, device=sums.device)
        all_gather_equal(everyone, sums, group=group)
        return bool((everyone.view(-1, sums.numel()) == sums).all())

    def _put_mean(self, params: list[torch.Tensor]) -> torch.Tensor | None:
        """Write the mean over :meth:`_average_group` into ``params`` and return this rank's own (flat);
        None, and nothing written, when the replicas agree (every rank of the group must call it)."""
        if self._replicas_agree(params):
            return None
        own = flatten(params)
        with torch.no_grad():
            mean, _ = all_mean(params, self._average_group())
            unflatten_(mean, params)
        return own

    # ---- evaluating and checkpointing the mean of the ranks' models ---------------------------------

    def _trainable(self) -> list[torch.Tensor]:
        module = self.lightning_module  # type: ignore[attr-defined]
        return [p for p in module.parameters() if p.requires_grad] if module is not None else []

    def _evaluate_average(self) -> None:
        """``average_eval``: put the mean of the ranks' trainable parameters in place for an evaluation
        loop, this rank's own kept aside (one all-reduce; nothing when the replicas agree)."""
        if not self._average_eval or self._own is not None or self.world_size < 2:  # type: ignore[attr-defined]
            return
        params = self._trainable()
        if params and dist.is_initialized():
            self._own = self._put_mean(params)

    def _restore_own(self) -> None:
        if self._own is not None:
            unflatten_(self._own, self._trainable())
            self._own = None

    def _averaged_state_dict(self, saved: dict[str, Any]) -> dict[str, Any] | None:
        """``saved`` (a checkpoint's ``state_dict``) with the mean over the ranks of each trainable
        parameter's entry: the live parameters', or what a callback put there instead (Lightning's
        ``WeightAveraging`` puts its average model's: then the mean of the ranks' averages). None when
        the ranks' entries agree (every rank must call it)."""
        module = self.lightning_module  # type: ignore[attr-defined]
        if self.world_size < 2 or module is None:  # type: ignore[attr-defined]
            return None
        live = module.state_dict(keep_vars=True)  # tied weights: one parameter under two keys
        keys: dict[int, list[str]] = {}
        for key, value in live.items():
            if isinstance(value, torch.nn.Parameter) and value.requires_grad and torch.is_tensor(saved.get(key)):
                keys.setdefault(id(value), []).append(key)
        entries = [saved[names[0]].detach() for names in keys.values()]
        if not entries or self._replicas_agree(entries):
            return None
        with torch.no_grad():
            mean, _ = all_mean(entries, self._average_group())
        averaged = dict(saved)
        for names, part, entry in zip(keys.values(), mean.split([e.numel() for e in entries]), entries):
            for key in names:
                averaged[key] = part.view_as(entry).clone()
        return averaged

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
        super().on_validation_start()  # type: ignore[misc]
        self._evaluate_average()

    @override
    def on_validation_end(self) -> None:
        self._restore_own()
        super().on_validation_end()  # type: ignore[misc]

    @override
    def on_test_start(self) -> None:
        super().on_test_start()  # type: ignore[misc]
        self._evaluate_average()

    @override
    def on_test_end(self) -> None:
        self._restore_own()
        super().on_test_end()  # type: ignore[misc]

    @override
    def on_predict_start(self) -> None:
        super().on_predict_start()  # type: ignore[misc]
        self._evaluate_average()

    @override
    def on_predict_end(self) -> None:
        self._restore_own()
        super().on_predict_end()  # type: ignore[misc]

    def _continue_own_model(self) -> None:
        """A fit that continues one that ended with the average goes on from each rank's own model,
        as the uninterrupted fit would; unless the model was changed since (its weights loaded)."""
        at_end, self._at_end = self._at_end, None
        if at_end is None or not self._continuing:
            return
        own, average = at_end
        if torch.equal(flatten(self._params).cpu(), average):
            unflatten_(own, self._params)

    def __getstate__(self) -> dict:
        state = super().__getstate__()  # type: ignore[misc]
        state["_fitted"] = None  # weak references do not pickle
        return state

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        def closure_then_check() -> Any:
            result = closure()
            self._check_unfrozen()
            return result

        output = super().optimizer_step(optimizer, closure_then_check, model, **kwargs)
        assert self._state is not None
        self._state.after_step(self._params, self.optimizers)
        return output

    def _unfrozen_diverges(self) -> str | None:
        """Why a parameter frozen at setup that gets a gradient would drift apart on the ranks (None:
        it would not)."""
        return "it is in none of DDP's buckets and not among the parameters averaged"

    def _check_unfrozen(self) -> None:
        """Raise for a parameter that got a gradient but was frozen when fit set up (unfrozen by
        Lightning's ``BaseFinetuning``, say): its copies would drift apart without a word."""
        for name, p in self._frozen:
            if p.grad is None:
                continue
            why = self._unfrozen_diverges()
            if why is None:
                return
            raise RuntimeError(
                f"{self.name}: parameter {name!r} got a gradient but did not require one when fit set up the model: "
                f"{why}, so its copies on the ranks would drift apart. Unfreezing during fit (e.g. BaseFinetuning) "
                "is not supported: make it trainable before trainer.fit (with a zero learning rate until it should "
                "train), or unfreeze between two trainer.fit calls (the next fit starts from rank 0's model)"
            )

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None
    ) -> None:
        """Every rank's own model and state go to its shard; the checkpoint itself holds the mean of the
        ranks' models (one all-reduce when they differ; with Lightning's ``WeightAveraging`` callback, the
        mean of the ranks' average models it put there): what ``load_from_checkpoint`` gives and where
        every rank starts when a fit resumes with ``restore_shards=False``."""
        if self._state is not None and "state_dict" in checkpoint:
            averaged = self._averaged_state_dict(checkpoint["state_dict"])
            if averaged is not None:
                checkpoint["state_dict"] = averaged
        with self._own_parameters():
            if self._state is not None:
                self._shards.save(self, self._state, checkpoint, filepath)
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        super().remove_checkpoint(filepath)
        self._shards.remove(self, filepath)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._shards.remember(self, checkpoint, checkpoint_path)
        return checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        super().load_optimizer_state_dict(checkpoint)
        assert self._state is not None
        self._shards.restore_into(self, self._state)

    @override
    def on_exception(self, exception: BaseException) -> None:
        hint_unused_parameters(exception, self.name)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        register_names(strategy_registry, cls, cls.name, cls.description)


class ModelAveragingStrategy(LocalStepsMixin, DDPStrategy):
    """DDP whose ranks take local optimizer steps and average their parameters every ``period`` steps.

    Args:
        period: K, local optimizer steps between two averagings. Su et al. compare 10 and 20
            minibatches of 1024 frames on 16 GPUs: 10 gave the better WER (15.1 vs 15.8 on SWB).
        warmup_steps: optimizer steps of dense gradient averaging (DDP's all-reduce) before the local
            steps start (Su et al. start local at once, and note a warmup might help).
        scale_lr: multiply every learning rate (and the schedulers' base rates) by the number of
            ranks W when fit starts. Su et al. (section 5.6) raise the initial learning rate in
            proportion to the number of workers: each of the W models takes 1/W of the updates a
            single model would, and averaging aggregates what they learnt rather than summing it,
            so "the absolute change of model shall be compensated by m times". Off by default: it
            is a learning-rate choice (it also scales the dense warmup steps, like the linear
            scaling rule of large-batch training).
        optimizer_state: at a sync, ``"keep"`` each rank's optimizer state (momentum, Adam's moments:
            they go on describing the rank's own trajectory; torch's PostLocalSGD does this), ``"reset"``
            it (they restart from zero, as for a new optimizer: Adam's bias correction starts again) or
            ``"average"`` its per-element tensors over the ranks as well (one more all-reduce of their
            size, counted), so that every rank continues from the same state.
        restore_shards: on resume, restore every rank's own model and optimizer state from
            ``<checkpoint>.ma/rank<r>.pt``; ``False`` starts every rank from the checkpoint's (rank
            0's) and a new period from there (also the way to resume on another number of ranks).
        average_at_end: a fit that ends between two syncs (its steps not a multiple of the period)
            leaves every rank the mean of the ranks' models, the consensus model fit returns (one
            all-reduce of the model); ``False`` keeps each rank's own. A later ``fit`` of the same Trainer
            goes on from each rank's own, as one uninterrupted fit would (unless the model's weights were
            changed in between).
        average_eval: validation, test and predict loops between two syncs evaluate the mean of the ranks'
            models (one all-reduce as the loop starts; each rank's own comes back as it ends; nothing when
            the replicas agree, as after a sync); ``False``: each rank evaluates its own.
        **kwargs: as for ``DDPStrategy`` (``accelerator``, ``cluster_environment``, ``precision_plugin``,
            ``process_group_backend``, ``timeout``, ``start_method``, ...) and for
            ``DistributedDataParallel`` (``find_unused_parameters``, ``static_graph``,
            ``process_group``: the averaging runs in that group). DDP's own communication-hook
            arguments may only be ``None``.

    Gradient clipping acts on each rank's local gradient (on warmup steps on the averaged one, as
    under DDP). The replicas are identical after every sync and differ between syncs; between syncs
    Lightning's evaluation loops see the mean of the ranks' models (``average_eval``), a checkpoint holds
    that mean and every rank's shard its own model.
    """

    name = "ma"
    description = "DDP with local steps and periodic model averaging"

    def __init__(
        self,
        period: int = 10,
        warmup_steps: int = 0,
        scale_lr: bool = False,
        optimizer_state: Literal["keep", "reset", "average"] = "keep",
        restore_shards: bool = True,
        average_at_end: bool = True,
        average_eval: bool = True,
        **kwargs: Any,
    ) -> None:
        check_int("period", period, 1, "local optimizer steps between two syncs")
        check_int("warmup_steps", warmup_steps, 0, "dense gradient all-reduce steps; 0 starts local at once")
        if optimizer_state not in OPTIMIZER_STATES:
            raise ValueError(f"Expect optimizer_state in {OPTIMIZER_STATES}, got {optimizer_state!r}")
        drop_hook_args(kwargs, type(self).__name__)
        super().__init__(**kwargs)
        self._period = period
        self._warmup_steps = warmup_steps
        self._scale_lr = bool(scale_lr)
        self._optimizer_state = optimizer_state
        self._state: AveragingState | None = None
        self._params: list[torch.nn.Parameter] = []  # the trainable ones at setup, averaged at each sync
        self._shards = RankShards(self.name, restore_shards)
        self._average_at_end = bool(average_at_end)
        self._average_eval = bool(average_eval)

    @property
    def period(self) -> int:
        return self._period

    @property
    def warmup_steps(self) -> int:
        return self._warmup_steps

    @property
    def scale_lr(self) -> bool:
        return self._scale_lr

    @property
    def averaging_state(self) -> AveragingState | None:
        """The step counter and statistics; ``None`` before ``fit`` configured DDP."""
        return self._state

    def _new_state(self) -> AveragingState:
        return AveragingState(
            period=self._period, warmup_steps=self._warmup_steps, optimizer_state=self._optimizer_state,
            process_group=self._ddp_kwargs.get("process_group"),
        )  # fmt: skip

    @override
    def setup(self, trainer: Trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            if self._scale_lr:  # a resumed fit then loads the scaled rates saved in the checkpoint
                scale_learning_rates(self, self.world_size)
                log.info("%s: learning rates x%d (scale_lr)", self.name, self.world_size)
            add_callback(trainer, SyncStatsLogger(lambda: self._state, self.name))

    @override
    def _register_ddp_hooks(self) -> None:
        # DDPStrategy registers hooks on CUDA only; the local steps need theirs on every device.
        assert isinstance(self.model, DistributedDataParallel)
        self._state = state = self._setup_state(self._new_state)
        if self.global_rank == 0 and not self._continuing:
            log.info("%s config: %s", self.name, self._describe())
        self.model.register_comm_hook(state, local_hook)

    def _describe(self) -> str:
        return (
            f"period={self._period}, warmup_steps={self._warmup_steps}, "
            f"optimizer_state={self._optimizer_state}, scale_lr={self._scale_lr}, average_at_end={self._average_at_end}, "
            f"average_eval={self._average_eval}, "
            f"world_size={self.world_size}"
        )
