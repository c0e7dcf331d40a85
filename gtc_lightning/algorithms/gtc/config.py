"""GTC's hyper-parameters: what each may be, their defaults and constants, and the checks that name a
bad value and what it should be (shared by the state and by every strategy that takes them)."""

import math

import numpy as np
import torch

from gtc_lightning.ops import BACKENDS

WORD_BYTES = 4  # an uncoded word: index | sign << 31, int32
HEADER = 3  # int64 values per rank in the gradient mode's header: non-finite count, words, message bytes
CODINGS = ("none", "rice")
COMPRESS = ("auto", "gradient", "update")
# tau="auto" without a target_density: words per rank per element and step. The model suite
# (gtc_lightning.tools.model_suite, 4 ranks) put the update mode at 1e-2 within 1-5 % of DDP's held-out
# loss on a transformer, a GRU and the speech DNN at 150-170x fewer bytes than a fp32 all-reduce;
# 3e-3 gave 300-480x at 2-57 % worse loss on those short runs.
DEFAULT_DENSITY = 1e-2
AUTO_TAU_INIT = 1e-2  # tau="auto" before its first compressed step measured where to start
SAMPLE = 1 << 16  # gradient elements automatic tau's start is measured on (a strided sample)
EXCHANGES = ("auto", "alltoall", "allgather")
# Dense fallback: enter when the sparse exchange would move more bytes than a dense bf16 ring
# all-reduce (half of fp32's), leave again when it moves less than a quarter of fp32's. At 2 ranks
# the words of every element (4n bytes) are as many as fp32's 2 (W-1)/W 4n: only a threshold below
# fp32's lets the fallback fire there, and a step that sends a word for half the elements has
# stopped compressing anyway.
FALLBACK_ENTER, FALLBACK_EXIT = 0.5, 0.25
SILENT_STEPS = 20  # compressed steps in a row in which no rank sent a word before GTC warns
# The update mode's residual: what the optimizer wanted to apply divided by its learning rate
# ("direction", applied at the rate of the step that sends it), or the displacement itself.
CONSERVE = ("direction", "displacement")
# density_warmup_steps: the density starts here (DGC's first epoch, 75 % sparsity) and falls
# geometrically to target_density.
DENSITY_WARMUP_START = 0.25
# density_warmup_steps="auto": this share of the run's optimizer steps (DGC: 4 of ImageNet's 90 epochs)
DENSITY_WARMUP_SHARE = 0.05
MAX_WORD_LEVELS = 8  # word_levels: a word carries at most 2**7 tau
AUTO_WORD_LEVELS = 4  # word_levels='auto' with plain SGD: words of tau, 2 tau, 4 tau and 8 tau


def scheduled_density(target: float, step: int, warmup_steps: int) -> float:
    """The density of optimizer step ``step`` (1-based) under a warm-up of ``warmup_steps``: from
    :data:`DENSITY_WARMUP_START` down to ``target`` geometrically, then ``target``."""
    if step >= warmup_steps or target >= DENSITY_WARMUP_START:
        return target
    return DENSITY_WARMUP_START * (target / DENSITY_WARMUP_START) ** (max(step - 1, 0) / warmup_steps)


def resolve_density_warmup(value: int | str, total_steps: float) -> tuple[int, str]:
    """``density_warmup_steps`` as a number of optimizer steps, and why: ``"auto"`` is
    :data:`DENSITY_WARMUP_SHARE` of ``total_steps`` (the Trainer's ``estimated_stepping_batches``), or
    none when the run's length is unknown (infinite)."""
    if value != "auto":
        return int(value), "as asked"
    if not math.isfinite(total_steps) or total_steps < 1:
        return 0, "density_warmup_steps='auto': none, the run's length is unknown (give a number of steps)"
    steps = max(1, round(DENSITY_WARMUP_SHARE * total_steps))
    return steps, f"density_warmup_steps='auto': {DENSITY_WARMUP_SHARE:.0%} of {int(total_steps)} optimizer steps"


def resolve_compress(value: str, optimizers: list, stale: bool) -> tuple[str, str]:
    """``compress`` for a fit with ``optimizers``, and why: ``"auto"`` is the update mode (each rank's optimizer
    steps on its own gradient, and each optimizer's step is compressed after it), or Strom's gradient mode with
    ``stale=True`` (it exchanges gradients) or with a Muon optimizer among them (a class named ``*Muon*``, as
    torch's and the reference implementation's are: on the two-optimizer example, Muon and AdamW on 2 ranks with
    a cosine schedule, the update mode's held-out loss was 1.9-3.2 times the gradient mode's, 3 seeds: each rank
    orthogonalises its own noisy momentum, and the mean of those steps is not Muon's step on the mean)."""
    if value != "auto":
        return value, "as asked"
    names = [type(getattr(o, "optimizer", o)).__name__ for o in optimizers]
    if stale:
        return "gradient", "compress='auto' with stale=True"
    if muon := [n for n in names if "muon" in n.lower()]:
        return "gradient", (f"compress='auto' with {muon[0]}: Strom's gradient mode (the update mode lost to it with "
                            "Muon: each rank would orthogonalise its own momentum)")  # fmt: skip
    if len(names) == 1:
        return "update", "compress='auto' with one optimizer"
    return "update", f"compress='auto' with {len(names)} optimizers: each one's step is compressed and exchanged after it"


def resolve_mean_variance(value: bool | str, optimizer) -> tuple[bool, str]:
    """``mean_variance`` as a bool for ``optimizer``, and why: ``"auto"`` is True for
    :class:`torch.optim.Adam` and :class:`torch.optim.AdamW` (Lightning's and Fabric's wrappers unwrapped)
    when no group uses ``amsgrad``, the optimizers whose steps it corrects; False for every other."""
    if value != "auto":
        return bool(value), "as asked"
    opt = getattr(optimizer, "optimizer", optimizer)
    name = type(opt).__name__
    if not isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)):
        return False, f"mean_variance='auto': off for {name} (it corrects Adam and AdamW steps)"
    if any(group.get("amsgrad") for group in opt.param_groups):
        return False, f"mean_variance='auto': off for {name} with amsgrad"
    return True, f"mean_variance='auto': on for {name} (its steps with the mean gradient's second moment)"


def resolve_word_levels(value: int | str, optimizer) -> tuple[int, str]:
    """``word_levels`` as an int for ``optimizer``, and why: ``"auto"`` is :data:`AUTO_WORD_LEVELS` for
    :class:`torch.optim.SGD` without momentum in any group (plain SGD, whose steps are its gradients: an
    element can hold many tau at once; on the long model suite it paid there, on every seed), 1 for every
    other optimizer (Adam's bounded steps rarely fill 2 tau, momentum SGD did not gain: the header's bytes
    for nothing)."""
    if value != "auto":
        return int(value), "as asked"
    opt = getattr(optimizer, "optimizer", optimizer)
    name = type(opt).__name__
    if type(opt) is torch.optim.SGD and not any(group.get("momentum") for group in opt.param_groups):
        return AUTO_WORD_LEVELS, (
            f"word_levels='auto': {AUTO_WORD_LEVELS} for plain SGD (words of tau to {2 ** (AUTO_WORD_LEVELS - 1)} tau)"
        )
    return 1, f"word_levels='auto': 1 for {name}{' with momentum' if isinstance(opt, torch.optim.SGD) else ''} (words of tau)"


def local_clip_threshold(
    clip: tuple[str, float] | None, scale: float | str, world_size: int
) -> tuple[str, float] | None:
    """The clipping each rank applies to its own gradient: the user's ``(algorithm, c)`` with ``c`` times
    ``scale`` (``"sqrt_world"``: sqrt(N), DGC's N^-1/2 of the global threshold in the units of a rank's
    mean gradient, which is what a rank clips; on 4 ranks a rank's gradient was about twice as long as
    the averaged one, and clipping it at ``c`` cost the model suite's CNN +5.6 % against DDP clipped at
    ``c``, at ``2 c`` -0.3 %, 3 seeds). None: no clipping."""
    if clip is None:
        return None
    factor = math.sqrt(world_size) if scale == "sqrt_world" else float(scale)
    return clip[0], clip[1] * factor


def check_local_clip_scale(scale: float | str) -> None:
    """``local_clip_scale``: ``"sqrt_world"`` or a positive number, else an error naming the value and the fix."""
    if scale == "sqrt_world":
        return
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(
            f"local_clip_scale={scale!r}: use 'sqrt_world' (each rank's gradient clipped at sqrt(N) times the "
            f"clipping threshold, DGC's rule) or a positive number (1: at the threshold itself)"
        )


def f32(x: float) -> float:
    """``x`` rounded to float32, as every rank applies tau (the same rounding on every rank)."""
    return float(np.float32(x))


def check_options(
    tau: float,
    warmup_steps: int,
    max_consecutive_skips: int | None,
    exchange: str,
    backend: str,
    coding: str = "none",
    target_density: float | None = None,
    compress: str = "gradient",
    busy_wait: bool | None = None,
    conserve: str = "direction",
    density_warmup_steps: int = 0,
    momentum_masking: bool = False,
    mean_variance: bool = False,
    word_levels: int | str = 1,
) -> None:
    """Validate GTC's hyper-parameters, with messages that say what each one means.

    Raises:
        ValueError: naming the bad value and what it should be.
    """
    if tau != "auto" and (
        isinstance(tau, bool) or not isinstance(tau, (int, float)) or not math.isfinite(tau) or tau <= 0
    ):
        raise ValueError(
            f"Expect tau to be a finite number > 0 or 'auto', got {tau!r}: it is the threshold a residual must "
            "pass to emit a word; start near 15x the per-rank gradient RMS (e.g. tau=1e-2), or let it adapt "
            "with tau='auto', target_density=1e-3"
        )
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(
            f"Expect warmup_steps to be an int >= 0 (dense steps before compression; 0 compresses from the "
            f"start), got {warmup_steps!r}"
        )
    if max_consecutive_skips is not None and (
        isinstance(max_consecutive_skips, bool)
        or not isinstance(max_consecutive_skips, int)
        or max_consecutive_skips < 1
    ):
        raise ValueError(
            f"Expect max_consecutive_skips to be an int >= 1 or None (never raise), got {max_consecutive_skips!r}"
        )
    if exchange not in EXCHANGES:
        raise ValueError(f"Expect exchange in {EXCHANGES}, got {exchange!r}")
    if backend not in BACKENDS:
        raise ValueError(f"Expect backend in {BACKENDS}, got {backend!r}")
    if coding not in CODINGS:
        raise ValueError(
            f"Expect coding in {CODINGS} (rice: Golomb-Rice coded index gaps, 8-11 bits a word instead of 32), "
            f"got {coding!r}"
        )
    if target_density is not None and (
        isinstance(target_density, bool)
        or not isinstance(target_density, (int, float))
        or not 0.0 < target_density < 1.0
    ):
        raise ValueError(
            f"Expect target_density to be None or a number in (0, 1) (words per rank per gradient element and "
            f"step, e.g. 1e-3), got {target_density!r}"
        )
    if compress not in COMPRESS:
        raise ValueError(
            f"Expect compress in {COMPRESS} ('gradient': Strom's residual of gradients, for plain SGD; 'update': "
            f"the step each rank's optimizer makes, for momentum SGD and Adam; 'auto': by the optimizer), got "
            f"{compress!r}"
        )
    if conserve not in CONSERVE:
        raise ValueError(
            f"Expect conserve in {CONSERVE} (compress='update': what the residual keeps; 'direction': the "
            f"optimizer's step over its learning rate, 'displacement': the step itself), got {conserve!r}"
        )
    if density_warmup_steps != "auto" and (
        isinstance(density_warmup_steps, bool) or not isinstance(density_warmup_steps, int) or density_warmup_steps < 0
    ):
        raise ValueError(
            f"Expect density_warmup_steps to be an int >= 0 (compress='update': optimizer steps over which the "
            f"density falls from {DENSITY_WARMUP_START} to target_density; 0: none) or 'auto' "
            f"({DENSITY_WARMUP_SHARE:.0%} of the Trainer's optimizer steps), got {density_warmup_steps!r}"
        )
    if not isinstance(momentum_masking, bool):
        raise ValueError(  # noqa: TRY004  (a ValueError, as for every other option)
            f"Expect momentum_masking to be True (compress='update': zero each rank's optimizer momentum at the "
            f"elements it sent, DGC's momentum factor masking) or False, got {momentum_masking!r}"
        )
    if not isinstance(mean_variance, bool) and mean_variance != "auto":
        raise ValueError(
            f"Expect mean_variance to be True (compress='update': each rank's Adam steps with an estimate of the "
            f"mean gradient's second moment, from its own moments), False, or 'auto' (True with Adam and AdamW "
            f"without amsgrad), got {mean_variance!r}"
        )
    if word_levels != "auto" and (
        isinstance(word_levels, bool) or not isinstance(word_levels, int) or not 1 <= word_levels <= MAX_WORD_LEVELS
    ):
        raise ValueError(
            f"Expect word_levels to be an int in [1, {MAX_WORD_LEVELS}] (compress='update': a word carries tau, 2 tau, "
            f"..., 2**(word_levels - 1) tau, the most that fits what its element holds; 1: tau alone, Strom's "
            f"1-bit words) or 'auto' ({AUTO_WORD_LEVELS} for plain SGD, 1 otherwise), got {word_levels!r}"
        )
    if compress == "gradient" and (
        conserve != "direction" or density_warmup_steps not in (0, "auto") or momentum_masking or mean_variance is True
        or word_levels not in (1, "auto")
    ):
        given = {"conserve": conserve, "density_warmup_steps": density_warmup_steps,
                 "momentum_masking": momentum_masking, "mean_variance": mean_variance,
                 "word_levels": word_levels}  # fmt: skip
        named = ", ".join(
            f"{k}={v!r}" for k, v in given.items() if v not in ("direction", 0, "auto", False) and (k, v) != ("word_levels", 1)
        )
        raise ValueError(
            f"{named}: the update mode's options (its residual and its optimizer steps); compress='gradient' "
            "keeps gradients. Use compress='update' (or 'auto'), or leave them at their defaults"
        )
    if busy_wait is not None and not isinstance(busy_wait, bool):
        raise ValueError(
            f"Expect busy_wait to be True (poll the collectives), False (block on them) or None (poll on gloo "
            f"when each rank has a core), got {busy_wait!r}"
        )


def sparse_gradient_parameters(module: torch.nn.Module) -> list[str]:
    """Names of trainable parameters that get sparse gradients (``nn.Embedding(sparse=True)``,
    ``nn.EmbeddingBag(sparse=True)``): GTC compresses dense gradient buckets only."""
    names = []
    for prefix, sub in module.named_modules():
        if isinstance(sub, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and sub.sparse:
            names += [
                f"{prefix}.{name}" if prefix else name
                for name, p in sub.named_parameters(recurse=False)
                if p.requires_grad
            ]
    return names


def unused_update_options(state) -> str | None:
    """Why the update mode's options of ``state`` do nothing, when ``compress="auto"`` picked the
    gradient mode (stale=True, or a Muon optimizer); None when they are at their defaults."""
    if state.compress != "gradient" or (
        state.conserve == "direction"
        and not state.density_warmup_steps
        and not state.momentum_masking
        and state.mean_variance is not True
        and state.word_levels in (1, "auto")
    ):
        return None
    return (
        f"GTC: conserve={state.conserve!r}, density_warmup_steps={state.density_warmup_steps}, "
        f"word_levels={state.word_levels}, momentum_masking={state.momentum_masking} and "
        f"mean_variance={state.mean_variance} apply to "
        "compress='update'; compress='auto' picked the gradient mode here (stale=True, or Muon), "
        "which does not use them"
    )
