"""The Lightning glue every strategy of the package shares: its names registered as Lightning names
its DDP variants, DDP's own communication-hook arguments refused, the unused-parameter hint, and a
callback added once, before the checkpoint callbacks; the optimizers GTC refuses (LBFGS, ZeRO's in the update
mode) and the closure
Strom's gradient mode takes (evaluated once a step)."""

import sys
from collections.abc import Callable
from typing import Any

import torch
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback, Checkpoint
from lightning.pytorch.utilities.exceptions import _augment_message

HOOK_ARGS = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period")
LAUNCHERS = (("", "popen"), ("_spawn", "spawn"), ("_fork", "fork"), ("_notebook", "fork"))


def register_names(registry: _StrategyRegistry, cls: type, name: str, description: str, **init_args: Any) -> None:
    """``name``, ``name_spawn``, ``name_fork``, ``name_notebook``, each also with
    ``_find_unused_parameters_true`` / ``_false``, as Lightning names its DDP variants; ``init_args``
    go to every one of them."""
    for suffix, start_method in LAUNCHERS:
        registry.register(
            f"{name}{suffix}",
            cls,
            description=f"{description}, start_method '{start_method}'",
            start_method=start_method,
            **init_args,
        )
        for unused in (True, False):
            registry.register(
                f"{name}{suffix}_find_unused_parameters_{str(unused).lower()}",
                cls,
                description=f"{description}, find_unused_parameters={unused}, start_method '{start_method}'",
                start_method=start_method,
                find_unused_parameters=unused,
                **init_args,
            )


def drop_hook_args(kwargs: dict, who: str) -> None:
    """Refuse DDP's own communication-hook arguments (LightningCLI passes every DDPStrategy argument
    explicitly, the hook ones as ``None``: those are dropped)."""
    clashing = sorted(key for key in HOOK_ARGS if kwargs.get(key) is not None)
    if clashing:
        raise ValueError(
            f"{who} registers its own DDP communication hook; remove {clashing} (or use DDPStrategy for another "
            "hook)"
        )
    for key in HOOK_ARGS:
        kwargs.pop(key, None)


def hint_unused_parameters(exception: BaseException, name: str, more: str = "") -> None:
    """Add to DDP's "Expected to have finished reduction" error how to turn on the detection of unused
    parameters for the strategy registered as ``name``; ``more``: what the strategy then does."""
    _augment_message(
        exception,
        pattern=".*Expected to have finished reduction in the prior iteration.*",
        new_message=(
            "It looks like your LightningModule has parameters that were not used in producing the loss returned"
            " by training_step. If this is intentional, enable the detection of unused parameters, either with"
            f" `strategy='{name}_find_unused_parameters_true'` or with `find_unused_parameters=True`.{more}"
        ),
    )


def add_callback(trainer: Trainer, callback: Callback) -> None:
    """Once, before the checkpoint callbacks (so that they can monitor the logged statistics)."""
    if any(type(cb) is type(callback) and getattr(cb, "prefix", None) == getattr(callback, "prefix", None)
           for cb in trainer.callbacks):  # fmt: skip
        return
    where = next(
        (i for i, cb in enumerate(trainer.callbacks) if isinstance(cb, Checkpoint)), len(trainer.callbacks)
    )
    trainer.callbacks.insert(where, callback)


def adaptive_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` scales each element by its own running second moment (Adam, AdamW, Adamax,
    NAdam, RAdam, Adagrad, RMSprop, Adadelta, and their subclasses), where Strom's gradient mode loses."""
    kinds = (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
             torch.optim.Adagrad, torch.optim.RMSprop, torch.optim.Adadelta)  # fmt: skip
    return isinstance(optimizer, kinds)

BUCKET_CAP_MB = 1024  # GTCStrategy's default DDP bucket cap: one bucket for models up to 256 M weights


def warn_gradient_mode_for_adaptive(who: str, optimizers: list) -> None:
    """``compress="auto"`` took Strom's gradient mode for several optimizers: say so where one of them
    is adaptive (:func:`adaptive_optimizer`), since that costs accuracy."""
    adaptive = [type(o).__name__ for o in optimizers if adaptive_optimizer(o)]
    if adaptive:
        rank_zero_warn(
            f"{who}: {len(optimizers)} optimizers take Strom's gradient mode, and {', '.join(adaptive)} rescale "
            "each element's sparse votes by their own second moments, which costs accuracy (the update mode, "
            "which compresses what the optimizer applies, takes one optimizer). Use one optimizer with parameter "
            "groups where you can, or set compress='gradient' to say you chose this"
        )


def refuse_optimizers(who: str, optimizers: list, update: bool) -> None:
    """Raise the reason and the fix for an optimizer GTC cannot train with.

    LBFGS keeps curvature pairs of its own iterates (each step's displacement and the change of the gradient
    along it). Under GTC the parameters move by the decoded mean of the ranks' steps, not by the step the
    rank's LBFGS made (the update mode), or the gradient it sees is a sparse vote and its line search would
    send gradients it only probes with (the gradient mode): its pairs no longer describe the loss. On a small
    MLP the update mode's loss wandered (1.40 to 2.96 to 1.34 over 8 steps) where DDP's fell from 1.54 to 0.27.

    ``ZeroRedundancyOptimizer`` in the update mode (``update``): each rank steps its shard of the state on its
    own gradient and broadcasts the parameters it owns, so every element would step on one rank's gradient
    alone, and the broadcast sends the dense parameters every step. The gradient mode hands it the decoded
    mean gradient, as DDP hands it the averaged one, and is left to run.
    """
    for optimizer in optimizers:
        inner = getattr(optimizer, "optimizer", optimizer)  # Lightning's and Fabric's wrappers
        name = type(inner).__name__
        if isinstance(inner, torch.optim.LBFGS):
            raise ValueError(  # noqa: TRY004  (a setting refused, as every refusal at setup)
                f"{who} cannot train with {name}: LBFGS builds its curvature estimate from its own steps, and GTC "
                "moves each rank's parameters by the decoded mean of every rank's compressed step instead, so the "
                "estimate no longer describes the loss. Use strategy='ddp' for LBFGS, or a first-order optimizer "
                "(SGD, Adam) with GTC"
            )
        # (torch.distributed.optim is imported by the user who made one: importing it here would cost every
        # import of this package torch's deprecation warnings of its TorchScript optimizers)
        zero = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
        if update and zero is not None and isinstance(inner, zero.ZeroRedundancyOptimizer):
            raise ValueError(
                f"{who}'s update mode (compress='update', or 'auto' with one optimizer) cannot train with {name}: "
                "it steps each rank's shard of the optimizer state on that rank's own gradient and broadcasts the "
                "parameters the rank owns, so each element would learn from one rank's data and the broadcast "
                "would send the dense parameters every step. Use the optimizer it wraps (the update mode keeps "
                "each rank's own state), or compress='gradient' (the decoded mean gradient, as DDP's)"
            )


def gradient_closure_once(closure: Callable[[], Any] | None, optimizer: Any, who: str) -> Callable[[], Any] | None:
    """``closure`` for Strom's gradient mode, which exchanges the gradient of every backward pass: it stops
    with the reason and the fix at a second evaluation within one optimizer step (SAM's second gradient, a
    line search), where the first gradient would be sent and never applied."""
    if closure is None:
        return None
    evaluations = 0

    def once(*args: Any, **kwargs: Any) -> Any:
        nonlocal evaluations
        evaluations += 1
        if evaluations > 1:
            name = type(getattr(optimizer, "optimizer", optimizer)).__name__
            raise RuntimeError(
                f"{who}(compress='gradient'): {name} evaluates the closure again within its step (SAM's second "
                "gradient, a line search); Strom's gradient mode compresses and exchanges one gradient per "
                "optimizer step, and a gradient used only to probe would be sent and never applied. Use "
                "compress='update' (what 'auto' picks for GTCStrategy: each rank's optimizer probes with its own "
                "gradients and the step it makes is compressed) or strategy='ddp'"
            )
        return closure(*args, **kwargs)

    return once
