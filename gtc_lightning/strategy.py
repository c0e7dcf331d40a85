"""``GTCStrategy``: Lightning's DDP with its gradient all-reduce replaced by threshold compression.

The strategy only wires things together: it builds the :class:`~gtc_lightning.hook.GTCState`,
registers :func:`~gtc_lightning.hook.gtc_hook` on the DDP model (on CPU/gloo as on CUDA/NCCL),
applies each step's skip decision before the optimizer runs, checks that the replicas agree,
saves and restores the residuals of every rank in checkpoints, and logs statistics.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.callbacks import Callback, Checkpoint
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from gtc_lightning.hook import GTCState, all_gather_equal, gtc_hook, parameter_checksums

log = logging.getLogger(__name__)

CHECKPOINT_KEY = "gtc"  # the checkpoint entry holding every rank's residuals and the counters
_HOOK_ARGS = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period")


def _check_int(name: str, value: Any, low: int, meaning: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"Expect {name} to be an int >= {low} ({meaning}), got {value!r}")


class GTCStrategy(DDPStrategy):
    """DDP with Strom's gradient threshold compression (GTC) instead of dense all-reduce.

    Args:
        tau: the threshold. Each rank adds its gradient to a per-element residual and sends one
            int32 word for every element whose residual passed ``±tau``; the optimizer sees
            ``tau / world_size * (#plus - #minus)``. About 15x the per-rank gradient RMS works
            (≈ 1e-2 for mean-loss gradients of ~256 frames per rank).
        warmup_steps: optimizer steps of dense all-reduce before compression starts.
        check_replicas_every: every this many optimizer steps, compare a parameter checksum
            across ranks and raise ``RuntimeError`` if the replicas differ; 0 turns it off.
        max_consecutive_skips: raise ``RuntimeError`` after this many consecutive steps skipped
            for a non-finite gradient; ``None`` never raises.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
        process_group_backend, timeout, start_method: as for ``DDPStrategy``.
        **kwargs: passed to ``DistributedDataParallel`` (e.g. ``bucket_cap_mb``,
            ``find_unused_parameters``, ``static_graph``).
    """

    def __init__(
        self,
        tau: float = 1e-2,
        warmup_steps: int = 0,
        check_replicas_every: int = 0,
        max_consecutive_skips: int | None = 10,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **kwargs: Any,
    ) -> None:
        if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not math.isfinite(tau) or tau <= 0:
            raise ValueError(
                f"Expect tau to be a finite number > 0, got {tau!r}: it is the threshold a residual must pass "
                "to emit a word; start near 15x the per-rank gradient RMS (e.g. tau=1e-2)"
            )
        _check_int(
            "warmup_steps", warmup_steps, 0, "dense steps before compression; 0 compresses from the start"
        )
        _check_int(
            "check_replicas_every", check_replicas_every, 0, "steps between replica checks; 0 turns it off"
        )
        if max_consecutive_skips is not None:
            _check_int("max_consecutive_skips", max_consecutive_skips, 1, "or None to never raise")
        clashing = sorted(set(kwargs) & set(_HOOK_ARGS))
        if clashing:
            raise ValueError(
                f"GTCStrategy registers its own DDP communication hook; remove {clashing} "
                "(or use DDPStrategy for another hook)"
            )
        if start_method not in ("popen", "spawn", "fork", "forkserver"):
            raise ValueError(f"Expect start_method in popen/spawn/fork/forkserver, got {start_method!r}")
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            **kwargs,
        )
        self._tau = float(tau)
        self._warmup_steps = warmup_steps
        self._check_replicas_every = check_replicas_every
        self._max_consecutive_skips = max_consecutive_skips
        self._gtc_state: GTCState | None = None
        self._saved_gtc: dict | None = None  # checkpoint entry waiting for the state to exist
        self._checked_step = 0

    @property
    def tau(self) -> float:
        """The compression threshold."""
        return self._tau

    @property
    def gtc_state(self) -> GTCState | None:
        """The hook's state (residuals, counters); ``None`` before ``fit`` configured DDP."""
        return self._gtc_state

    @property
    def gtc_stats(self) -> dict:
        """This rank's statistics: ``{"step", "last": {...} or None, "total": {...}}``.

        ``last`` holds the newest step's words, words_all, bytes_sent, dense_bytes, ratio,
        compress_s, decompress_s, skipped, dense; ``total`` the sums since the start (restored
        from checkpoints) plus ``skips`` and ``consecutive_skips``.
        """
        if self._gtc_state is None:
            return {"step": 0, "last": None, "total": None}
        return self._gtc_state.stats()

    # ---- wiring into DDP ---------------------------------------------------------------------

    @override
    def setup(self, trainer: Trainer) -> None:
        super().setup(trainer)
        if not any(isinstance(cb, _GTCStatsLogger) for cb in trainer.callbacks):
            # Before the checkpoint callbacks, so that they can monitor the GTC metrics.
            where = next((i for i, cb in enumerate(trainer.callbacks) if isinstance(cb, Checkpoint)), None)
            trainer.callbacks.insert(
                len(trainer.callbacks) if where is None else where, _GTCStatsLogger(self)
            )

    @override
    def _register_ddp_hooks(self) -> None:
        # DDPStrategy only registers hooks on CUDA; GTC needs its hook on every device.
        assert isinstance(self.model, DistributedDataParallel)
        self._gtc_state = GTCState(
            process_group=None,
            named_parameters=self.model.module.named_parameters(),
            tau=self._tau,
            warmup_steps=self._warmup_steps,
            max_consecutive_skips=self._max_consecutive_skips,
        )
        self._checked_step = 0
        if self._saved_gtc is not None:
            self._restore_gtc(self._saved_gtc)
            self._saved_gtc = None
        self.model.register_comm_hook(self._gtc_state, gtc_hook)

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        def closure_then_apply_skip() -> Any:
            result = closure()
            if self._gtc_state is not None:
                assert self.lightning_module is not None
                poison = self._grad_scaler() is not None  # let AMP's scaler see the skip
                self._gtc_state.finish_step(self.lightning_module.parameters(), poison_skipped=poison)
            return result

        output = super().optimizer_step(optimizer, closure_then_apply_skip, model, **kwargs)
        self._maybe_check_replicas()
        return output

    @override
    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        super().pre_backward(closure_loss)
        if self._gtc_state is not None:
            scaler = self._grad_scaler()
            self._gtc_state.grad_scale = float(scaler.get_scale()) if scaler is not None else 1.0

    def _grad_scaler(self) -> Any:
        """AMP's GradScaler when the precision plugin scales the loss (fp16 mixed), else None."""
        scaler = getattr(self.precision_plugin, "scaler", None)
        return scaler if scaler is not None and scaler.is_enabled() else None

    def _maybe_check_replicas(self) -> None:
        state = self._gtc_state
        every = self._check_replicas_every
        if state is None or not every or state.step == self._checked_step or state.step % every:
            return
        self._checked_step = state.step
        assert self.lightning_module is not None
        named = [(n, p) for n, p in self.lightning_module.named_parameters()]
        sums = parameter_checksums([p for _, p in named])
        everyone = torch.empty(self.world_size * sums.numel(), dtype=sums.dtype, device=sums.device)
        all_gather_equal(everyone, sums)
        everyone = everyone.view(self.world_size, -1).cpu()
        differs = everyone != everyone[0]
        if differs.any():
            ranks = [int(r) for r in torch.nonzero(differs.any(dim=1)).flatten()]
            names = [named[int(i)][0] for i in torch.nonzero(differs.any(dim=0)).flatten()]
            raise RuntimeError(
                f"GTC replicas diverged: after optimizer step {state.step}, rank(s) {ranks} hold parameters "
                f"different from rank 0's ({names[:5]}{' ...' if len(names) > 5 else ''}). Every rank must apply "
                "the same update: look for code that changes parameters on one rank only or for "
                "non-deterministic optimizer kernels"
            )

    # ---- checkpoints ---------------------------------------------------------------------------

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None
    ) -> None:
        # Trainer.save_checkpoint calls this on every rank, so the residuals can be gathered here.
        if self._gtc_state is not None:
            checkpoint[CHECKPOINT_KEY] = self._gather_gtc()
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        # Lightning loads the checkpoint of a fit before it configures DDP (and a new GTCState):
        # keep the entry until _register_ddp_hooks applies it.
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._saved_gtc = checkpoint.get(CHECKPOINT_KEY)
        return checkpoint

    def _gather_gtc(self) -> dict:
        """Every rank's residual vector gathered on rank 0 (``[world, n]`` on CPU there)."""
        state = self._gtc_state
        assert state is not None
        vector = state.residual_vector(self.root_device)
        rows = [torch.empty_like(vector) for _ in range(self.world_size)] if self.global_rank == 0 else None
        dist.gather(vector, rows, dst=0)
        return {
            "world_size": self.world_size,
            "tau": state.tau,
            "names": list(state.param_names),
            "numels": list(state.numels),
            "residuals": torch.stack(rows).cpu() if rows is not None else None,
            **state.counters(),
        }

    def _restore_gtc(self, saved: dict) -> None:
        state = self._gtc_state
        assert state is not None
        state.load_counters(saved)
        if saved["names"] != state.param_names or saved["numels"] != state.numels:
            state.reset_residuals()
            rank_zero_warn(
                "GTC: the checkpoint's parameters differ from the model's; residuals restart from zero"
            )
        elif saved["world_size"] != self.world_size:
            state.reset_residuals()
            rank_zero_warn(
                f"GTC: the checkpoint holds residuals of {saved['world_size']} ranks but this run has "
                f"{self.world_size}; residuals restart from zero (the unsent gradient, at most tau per element "
                "and rank, is dropped)"
            )
        else:
            state.load_residual_vector(saved["residuals"][self.global_rank].to(self.root_device))
            log.info("GTC: restored rank %d's residuals at step %d", self.global_rank, state.step)

    # ---- registration --------------------------------------------------------------------------

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        for name, start_method in (("gtc", "popen"), ("gtc_spawn", "spawn"), ("gtc_fork", "fork")):
            strategy_registry.register(
                name,
                cls,
                description=f"DDP with gradient threshold compression, start_method '{start_method}'",
                start_method=start_method,
            )


class _GTCStatsLogger(Callback):
    """Logs the newest GTC step's statistics through ``LightningModule.log`` (added by the strategy)."""

    def __init__(self, strategy: GTCStrategy) -> None:
        self._strategy = strategy
        self._logged_step = -1

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        state = self._strategy.gtc_state
        if state is None or state.last is None or state.last.step == self._logged_step:
            return  # no exchange since the last log: a gradient-accumulation micro-step
        last = state.last
        self._logged_step = last.step
        ratio = last.ratio if math.isfinite(last.ratio) else 0.0
        values = {
            "gtc/words": float(last.words),
            "gtc/words_all": float(last.words_all),
            "gtc/bytes_sent": float(last.bytes_sent),
            "gtc/dense_bytes": float(last.dense_bytes),
            "gtc/ratio": ratio,
            "gtc/compress_s": last.compress_s,
            "gtc/decompress_s": last.decompress_s,
            "gtc/skips": float(state.totals["skips"]),
            "gtc/dense": float(last.dense),
        }
        pl_module.log_dict(values, on_step=True, on_epoch=False, batch_size=1)
        pl_module.log(
            "gtc_ratio", ratio, on_step=True, on_epoch=False, prog_bar=True, logger=False, batch_size=1
        )
