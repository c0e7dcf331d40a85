"""GTC for Lightning Fabric: ``Fabric(strategy="gtc")``.

Fabric's ``DDPStrategy`` registers no communication hook; :class:`GTCFabricStrategy` wraps the
module in DDP with :func:`~gtc_lightning.algorithms.gtc.hook.gtc_hook` on CPU/gloo and CUDA/NCCL alike, applies
each step's skip decision in ``optimizer.step()``, and keeps every rank's residuals in
``fabric.save`` / ``fabric.load`` checkpoints (shards beside the file, as the Lightning strategy
does)::

    import lightning as L
    import gtc_lightning  # registers "gtc" for Fabric too

    fabric = L.Fabric(accelerator="cuda", devices=8, strategy="gtc")  # or GTCFabricStrategy(tau=...)
    fabric.launch()
    model, optimizer = fabric.setup(model, optimizer)
    for batch in loader:
        loss = model(batch).mean()
        fabric.backward(loss)      # compressed, exchanged and decoded here
        optimizer.step()           # skipped on every rank when a rank's gradient was non-finite
        optimizer.zero_grad()
    print(fabric.strategy.gtc_stats["total"]["ratio_bf16"])

What is compressed (``compress``, as for the Trainer's ``GTCStrategy``): with one optimizer set up
by Fabric, ``"auto"`` compresses the step that each rank's optimizer makes on its own gradient
(:mod:`~gtc_lightning.algorithms.gtc.update`; ``fabric.backward`` leaves the local gradient and
``optimizer.step()`` exchanges); with several, Strom's gradient (exchanged in ``fabric.backward``).
Set up every optimizer before the first step (``fabric.setup(model, opt_a, opt_b)`` or
``fabric.setup_optimizers(opt_a, opt_b)``): a second optimizer after steps in the update mode is
refused, and so is a second one with ``compress="update"``.

One module per strategy (set up one model; use the Lightning Trainer's ``GTCStrategy`` or several
Fabric instances for more). Gradient clipping acts on each rank's local gradient: give it to the
strategy, ``GTCFabricStrategy(gradient_clip_val=1.0, gradient_clip_algorithm="norm" | "value")``,
which clips it before it enters the residual at sqrt(N) times the threshold (``local_clip_scale``, as
the Trainer's ``GTCStrategy`` does with the Trainer's clipping). In the gradient mode
``fabric.clip_gradients`` after ``backward`` would only see the decoded update and is refused with that
advice; in the update mode it clips each rank's own gradient at ``local_clip_scale`` times its
threshold (on dense warm-up steps the average, at the threshold, as under DDP). In the update mode a non-finite gradient on any rank is found (one flag per
rank, all-reduced) before anything unscales or clips: the step is skipped on every rank, and under
an fp16 ``GradScaler`` every rank's scaler records the overflow, so the loss scales stay equal. The
one-step-stale exchange is an option of the Lightning strategy only.
"""

from __future__ import annotations

import itertools
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, Precision
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import DDPStrategy, _StrategyRegistry
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.fabric.utilities.types import _PATH
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from gtc_lightning.algorithms.gtc import update as update_mode
from gtc_lightning.algorithms.gtc.config import (
    check_local_clip_scale,
    check_options,
    local_clip_threshold,
    sparse_gradient_parameters,
    unused_update_options,
)
from gtc_lightning.algorithms.gtc.hook import gtc_hook
from gtc_lightning.algorithms.gtc.state import GTCState
from gtc_lightning.strategies import checkpoint
from gtc_lightning.strategies.common import (
    gradient_closure_once,
    refuse_optimizers,
    warn_gradient_mode_for_adaptive,
)


class GTCFabricStrategy(DDPStrategy):
    """Fabric's DDP with Strom's gradient threshold compression instead of dense all-reduce.

    Args:
        tau: as for :class:`gtc_lightning.GTCStrategy`, and so are ``warmup_steps``,
            ``max_consecutive_skips``, ``dense_fallback``, ``exchange``, ``backend``,
            ``restore_residuals``, ``coding``, ``target_density``, ``busy_wait``, ``conserve``,
            ``momentum_masking``, ``mean_variance``, ``word_levels``, ``compress`` (``compress="auto"`` decides as Fabric
            sets up the optimizers: ``"update"`` for one, ``"gradient"`` for several; ``"update"`` takes
            one optimizer and refuses a second; with ``"update"`` every rank's optimizer state goes into
            its shard of ``fabric.save`` and ``fabric.load`` gives each rank its own back).
        density_warmup_steps: as for the Lightning strategy, but a number of optimizer steps only (0, the
            default: none): Fabric does not know the run's length, which ``"auto"`` takes a share of.
        gradient_clip_val, gradient_clip_algorithm: clip each rank's local gradient before it enters
            the residual, by its norm over the whole module (as ``clip_grad_norm_``) or by value, at
            ``local_clip_scale`` times ``gradient_clip_val``; the decoded update is not clipped again.
            None: no clipping.
        local_clip_scale: ``"sqrt_world"`` (default): each rank's own gradient clipped at sqrt(N) times the
            threshold on N ranks (DGC's rule; also what ``fabric.clip_gradients`` gives in the update
            mode on compressed steps), as :class:`~gtc_lightning.GTCStrategy`'s option; ``1``: at the
            threshold itself.
        accelerator: as for Fabric's ``DDPStrategy``, and so are ``parallel_devices``, ``cluster_environment``,
            ``checkpoint_io``, ``precision``, ``process_group_backend``, ``timeout``, ``start_method``.
        **kwargs: passed to ``DistributedDataParallel`` (``process_group`` is honoured by the
            exchange; ``find_unused_parameters`` and ``static_graph`` are tracked as in the
            Lightning strategy).
    """

    def __init__(
        self,
        tau: float | Literal["auto"] = "auto",
        warmup_steps: int = 0,
        max_consecutive_skips: int | None = 10,
        dense_fallback: bool = True,
        exchange: Literal["auto", "alltoall", "allgather"] = "auto",
        backend: Literal["auto", "torch", "triton"] = "auto",
        restore_residuals: bool = True,
        coding: Literal["none", "rice"] = "rice",
        target_density: float | None = None,
        compress: Literal["auto", "gradient", "update"] = "auto",
        busy_wait: bool | None = None,
        conserve: Literal["direction", "displacement"] = "direction",
        density_warmup_steps: int = 0,
        momentum_masking: bool = False,
        mean_variance: bool | Literal["auto"] = False,
        word_levels: int | Literal["auto"] = "auto",
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: Literal["norm", "value"] = "norm",
        local_clip_scale: float | Literal["sqrt_world"] = "sqrt_world",
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **kwargs: Any,
    ) -> None:
        check_options(tau, warmup_steps, max_consecutive_skips, exchange, backend, coding, target_density, compress,
                      busy_wait, conserve, density_warmup_steps, momentum_masking, mean_variance, word_levels)
        if density_warmup_steps == "auto":
            raise ValueError(
                "density_warmup_steps='auto' is a share of the Trainer's optimizer steps; Fabric does not know the "
                "run's length: give the number of steps (e.g. 5 % of your loop's optimizer steps)"
            )
        if gradient_clip_algorithm not in ("norm", "value"):
            raise ValueError(f"gradient_clip_algorithm={gradient_clip_algorithm!r}: use 'norm' or 'value'")
        if gradient_clip_val is not None and not gradient_clip_val > 0:
            raise ValueError(
                f"gradient_clip_val={gradient_clip_val!r}: use a positive number, or None for no clipping"
            )
        self._clip = (gradient_clip_algorithm, float(gradient_clip_val)) if gradient_clip_val else None
        check_local_clip_scale(local_clip_scale)
        self._local_clip_scale = local_clip_scale
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            **kwargs,
        )
        self._options = {
            "tau": tau if tau == "auto" else float(tau),
            "warmup_steps": warmup_steps,
            "max_consecutive_skips": max_consecutive_skips,
            "dense_fallback": bool(dense_fallback),
            "exchange": exchange,
            "backend": backend,
            "coding": coding,
            "target_density": target_density,
            "busy_wait": busy_wait,
            "conserve": conserve,
            "density_warmup_steps": density_warmup_steps,
            "momentum_masking": momentum_masking,
            "mean_variance": mean_variance,
            "word_levels": word_levels,
        }
        self._compress = compress
        self._optimizers: list[Optimizer] = []  # set up by Fabric: compress="auto" decides by their number
        self._update_params: list[torch.nn.Parameter] = []
        self._decided: tuple[bool, bool] | None = None  # compress="update": this step's (warmup, skipped)
        self._restore_residuals = bool(restore_residuals)
        self._gtc_state: GTCState | None = None
        self._module: Module | None = None

    @property
    def gtc_state(self) -> GTCState | None:
        """The hook's state; ``None`` before ``fabric.setup(model)``."""
        return self._gtc_state

    @property
    def gtc_stats(self) -> dict:
        """This rank's statistics, as ``GTCStrategy.gtc_stats``."""
        if self._gtc_state is None:
            return {"step": 0, "last": None, "total": None}
        return self._gtc_state.stats()

    def _grad_scaler(self) -> Any:
        scaler = getattr(self.precision, "scaler", None)
        return scaler if scaler is not None and scaler.is_enabled() else None

    @override
    def setup_module(self, module: Module) -> DistributedDataParallel:
        if self._gtc_state is not None:
            raise ValueError(
                "GTCFabricStrategy compresses the gradients of one module, and one was set up already; set up "
                "a single model (wrap several in one nn.Module) or use another Fabric instance"
            )
        sparse = sparse_gradient_parameters(module)
        if sparse:
            raise ValueError(
                f"GTCFabricStrategy compresses dense gradients, but {sparse} get sparse gradients "
                "(nn.Embedding/EmbeddingBag with sparse=True). Use sparse=False (GTC then compresses "
                "their dense gradients), or freeze them (requires_grad=False), or use Fabric's strategy='ddp'"
            )
        ddp = super().setup_module(module)
        self._gtc_state = state = GTCState(
            process_group=self._ddp_kwargs.get("process_group"),
            named_parameters=module.named_parameters(),
            compress="auto",  # decided by _resolve_compress (the update mode's options are checked against it)
            **self._options,
        )
        scaler = self._grad_scaler()
        state.grad_scale = float(scaler.get_scale()) if scaler is not None else 1.0
        state.clip = local_clip_threshold(self._clip, self._local_clip_scale, state.world_size)
        if self._ddp_kwargs.get("find_unused_parameters") or self._ddp_kwargs.get("static_graph"):
            state.track_usage(module.parameters())
        self._module = module
        self._resolve_compress(len(self._optimizers))
        self._update_params = [p for _, p in module.named_parameters() if p.requires_grad]
        ddp.register_comm_hook(state, gtc_hook)
        return ddp

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        # fabric.setup(model, *optimizers) and fabric.setup_optimizers(*optimizers) both come here, once
        # per optimizer, before or after the module.
        refuse_optimizers("GTCFabricStrategy", [optimizer], update=self._compress in ("auto", "update"))
        known = any(optimizer is other for other in self._optimizers)
        self._resolve_compress(len(self._optimizers) + (not known))  # raises before anything changed
        if not known:
            self._optimizers.append(optimizer)
            if self._compress == "auto" and len(self._optimizers) == 2:
                warn_gradient_mode_for_adaptive("GTCFabricStrategy", self._optimizers)
        return super().setup_optimizer(optimizer)

    def _resolve_compress(self, count: int) -> None:
        """What the residuals hold, from ``compress`` and ``count``, the optimizers set up: ``"auto"``
        takes the optimizer's step for one optimizer (as ``GTCStrategy``) and Strom's gradient for several
        (the update mode compresses one optimizer's step: a second one's would be emitted and decoded
        during the first's step and never applied). Before any optimizer it stays at the gradient."""
        if self._compress == "update" and count > 1:
            raise ValueError(
                f"GTCFabricStrategy(compress='update') compresses the step of one optimizer; {count} "
                "optimizers were set up. Use compress='gradient' (or 'auto', which picks it for several "
                "optimizers), or one optimizer"
            )
        state = self._gtc_state
        if state is None:
            return
        if self._compress == "auto":
            mode = "update" if count == 1 else "gradient"
        else:
            mode = self._compress
        if mode != state.compress and state.compress == "update" and state.step > 0:
            raise ValueError(
                f"GTCFabricStrategy(compress='auto') picked compress='update' for one optimizer, and "
                f"{state.step} optimizer step(s) ran in it (or were restored from a checkpoint); {count} "
                "optimizers take compress='gradient', whose residuals hold gradients, not optimizer steps. "
                "Set up every optimizer before the first step (fabric.setup(model, opt_a, opt_b) or "
                "fabric.setup_optimizers(opt_a, opt_b)), or use GTCFabricStrategy(compress='gradient')"
            )
        state.compress = mode
        if count and (unused := unused_update_options(state)):  # (no optimizer yet: nothing is decided)
            rank_zero_warn(unused)

    def _refuse_clipping(self, what: str) -> None:
        raise ValueError(
            f"fabric.clip_gradients({what}) under GTC would clip the decoded update, which is already bounded "
            f"by tau per element, not the gradient: the raw gradient went into the residual during "
            f"fabric.backward. Give the clipping to the strategy instead: GTCFabricStrategy(gradient_clip_val=..., "
            f"gradient_clip_algorithm='norm' or 'value'), and drop the fabric.clip_gradients call"
        )

    def _local_limit(self, limit: float) -> float:
        """``fabric.clip_gradients``' threshold for a rank's own gradient: ``limit`` times ``local_clip_scale``."""
        assert self._gtc_state is not None
        return local_clip_threshold(("", float(limit)), self._local_clip_scale, self._gtc_state.world_size)[1]

    @override
    def clip_gradients_norm(
        self,
        module: Module,
        optimizer: Optimizer,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        if self._gtc_state is not None and self._gtc_state.compress == "update":  # local gradients: as DDP
            warmup, skipped = self._decide_step()
            if skipped:  # skipped on every rank: nothing to clip (AMP's scaler sees the NaN)
                return torch.tensor(float("nan"), device=self.root_device)
            max_norm = max_norm if warmup else self._local_limit(max_norm)
            return super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite)
        self._refuse_clipping(f"max_norm={max_norm}")

    @override
    def clip_gradients_value(self, module: Module, optimizer: Optimizer, clip_val: float) -> None:
        if self._gtc_state is not None and self._gtc_state.compress == "update":  # local gradients: as DDP
            warmup, skipped = self._decide_step()
            if skipped:
                return None
            clip_val = clip_val if warmup else self._local_limit(clip_val)
            return super().clip_gradients_value(module, optimizer, clip_val)
        self._refuse_clipping(f"clip_val={clip_val}")

    @override
    def optimizer_step(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        state = self._gtc_state
        if state is not None and state.compress == "update":
            return self._update_step(optimizer, **kwargs)
        if state is not None and self._module is not None:
            state.check_unknown_gradients(self._module.named_parameters())
            state.finish_step(self._module.parameters(), loss_scaler=self._grad_scaler() is not None)
        if "closure" in kwargs:
            kwargs["closure"] = gradient_closure_once(kwargs["closure"], optimizer, "GTCFabricStrategy")
        output = super().optimizer_step(optimizer, **kwargs)
        scaler = self._grad_scaler()
        if state is not None and scaler is not None:
            state.grad_scale = float(scaler.get_scale())
        return output

    def _decide_step(self) -> tuple[bool, bool]:
        """``compress="update"``: whether this step is a dense warm-up step, and whether it is skipped on
        every rank (a non-finite gradient on some rank). Decided once per step, after backward and before
        anything unscales or clips the gradients (the strategy's clipping, ``fabric.clip_gradients``): a
        skipped step leaves NaN gradients under AMP's loss scaler, so that every rank's scaler records the
        overflow when it unscales them. Unscaling first would let a rank whose own gradient was finite
        record none and step on the NaN, and the ranks' loss scales would part."""
        if self._decided is not None:
            return self._decided
        state, params = self._gtc_state, self._update_params
        assert state is not None and self._module is not None
        state.check_unknown_gradients(self._module.named_parameters())
        loss_scaler = self._grad_scaler() is not None
        warmup = state.step < state.warmup_steps
        if warmup:  # DDP averaged the gradients: every rank steps on the mean
            update_mode.warmup(state)
            stats = state.finish_step(params, loss_scaler=loss_scaler)
            skipped = stats is not None and stats.skipped
        else:
            skipped = update_mode.check_finite(state, params, loss_scaler, keep=True)  # (and keeps the parameters)
        self._decided = (warmup, skipped)
        return self._decided

    def _update_step(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        """``compress="update"`` (:mod:`gtc_lightning.algorithms.gtc.update`): fabric.backward left each
        rank's own gradient; the step is skipped everywhere or not (:meth:`_decide_step`), then the
        gradient is clipped, the rank's optimizer steps on it and the step it made is compressed and
        exchanged."""
        state, params = self._gtc_state, self._update_params
        assert state is not None
        warmup, skipped = self._decide_step()
        self._decided = None  # the next step decides anew
        scaler = self._grad_scaler()
        if self._clip is not None and not skipped:  # each rank's own gradient, before its optimizer steps
            if scaler is not None:
                scaler.unscale_(optimizer)
            grads = [p for p in params if p.grad is not None]
            # a rank's own gradient on a compressed step (local_clip_scale times c), the mean on a dense one
            algorithm, limit = self._clip if warmup else state.clip
            if algorithm == "norm":
                torch.nn.utils.clip_grad_norm_(grads, limit)
            else:
                torch.nn.utils.clip_grad_value_(grads, limit)
        output = super().optimizer_step(optimizer, **kwargs)
        if not warmup and not skipped:  # with the rates the step used (read after it)
            update_mode.exchange(state, params, update_mode.learning_rates(optimizer), optimizer)
        if scaler is not None:
            state.grad_scale = float(scaler.get_scale())
        return output

    @override
    def save_checkpoint(
        self, path: _PATH, state: dict[str, Any], storage_options: Any | None = None, filter: Any = None
    ) -> None:
        # fabric.save calls this on every rank: each writes its own residual shard.
        if self._gtc_state is not None:
            state = {
                **state,
                checkpoint.CHECKPOINT_KEY: checkpoint.checkpoint_entry(self._gtc_state, self.world_size),
            }
            optimizers = None
            if self._gtc_state.compress == "update":  # every rank's own optimizer state
                optimizers = {key: value.state_dict() for key, value in state.items() if isinstance(value, Optimizer)}
            checkpoint.save_shard(
                self._gtc_state, self.checkpoint_io, path, self.global_rank, self.world_size, optimizers=optimizers
            )
        super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)

    @override
    def load_checkpoint(
        self, path: _PATH, state: Any = None, strict: bool = True, weights_only: bool | None = None
    ) -> dict[str, Any]:
        rest = super().load_checkpoint(path, state=state, strict=strict, weights_only=weights_only)
        entry = rest.pop(checkpoint.CHECKPOINT_KEY, None) if isinstance(rest, dict) else None
        if entry is not None and self._gtc_state is not None:
            optimizers = checkpoint.restore(
                self._gtc_state, entry, checkpoint.resolve_link(path), self.global_rank, self.world_size, self.checkpoint_io,
                self.root_device, residuals=self._restore_residuals,
                hint="GTCFabricStrategy(restore_residuals=False)",
            )  # fmt: skip
            if optimizers and isinstance(state, dict) and self._gtc_state.compress == "update":
                for key, value in state.items():
                    if isinstance(value, Optimizer) and key in optimizers:
                        value.load_state_dict(optimizers[key])
        return rest

    @override
    def teardown(self) -> None:
        if self._gtc_state is not None:
            self._gtc_state.untrack_usage()
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        launchers = (("gtc", "popen"), ("gtc_spawn", "spawn"), ("gtc_fork", "fork"), ("gtc_notebook", "fork"))
        for (name, start_method), unused in itertools.product(launchers, (None, True, False)):
            extra = {} if unused is None else {"find_unused_parameters": unused}
            suffix = "" if unused is None else f"_find_unused_parameters_{str(unused).lower()}"
            strategy_registry.register(
                name + suffix,
                cls,
                description=f"Fabric DDP with gradient threshold compression, start_method '{start_method}'",
                start_method=start_method,
                **extra,
            )


# The Trainer-only strategies of the family, by the names a Fabric user would try: a clear error
# instead of Fabric's "invalid strategy name" (which lists ddp, deepspeed, ...).
TRAINER_ONLY = {
    "gtc_stale": "the one-step-stale exchange needs the Trainer's optimizer-step hooks",
    "ma": "model averaging runs in the Trainer's optimizer step",
    "bmuf": "BMUF runs in the Trainer's optimizer step",
    "bmuf_gtc": "BMUF-GTC runs in the Trainer's optimizer step",
    "diloco": "DiLoCo's outer step (BMUF) runs in the Trainer's optimizer step",
    "sparseloco": "SparseLoCo's compressed block sync runs in the Trainer's optimizer step",
    "dpsgd": "D-PSGD runs in the Trainer's optimizer step",
    "gtc_hsdp": "its replicate dimension's GTC is wired into the Trainer's FSDP2 set-up and checkpoints",
    "adpsgd": "AD-PSGD runs in the Trainer's optimizer step and its synchronisation points in the Trainer's hooks",
}


def _trainer_only(name: str, why: str):
    def refuse(**_: Any) -> None:
        raise ValueError(
            f"Fabric(strategy={name!r}): {name} is a Lightning Trainer strategy only ({why}). Use "
            f"Trainer(strategy={name!r}), or Fabric(strategy='gtc') for gradient threshold compression "
            "in Fabric."
        )

    return refuse


def register_trainer_only_names(strategy_registry: _StrategyRegistry) -> None:
    """Register the Trainer-only names (and their _spawn/_fork/_notebook variants) so that Fabric
    refuses them with :func:`_trainer_only`'s message."""
    for base, why in TRAINER_ONLY.items():
        for suffix in ("", "_spawn", "_fork", "_notebook"):
            name = base + suffix
            if name not in strategy_registry:
                strategy_registry.register(
                    name, _trainer_only(name, why), description=f"not for Fabric: {why}"
                )
