"""GTC on what the optimizer applies (``GTCStrategy(compress="update")``, the default for momentum
SGD and the Adam family).

Strom's GTC conserves the gradient: every element of it is either applied or kept in the residual.
That is lossless for plain SGD, whose update is the gradient times the learning rate. It is not for
an optimizer with per-element state: Adam divides each decoded ``±tau/W`` vote by the root of its
own running mean of squared votes, so an element voted at rate ``p`` moves by about ``sqrt(p)`` of
Adam's normal step, and momentum SGD keeps pushing the old votes after they were applied (what DGC's
momentum correction and factor masking fix). So here each rank's optimizer steps on its own
gradient, as in DGC's local momentum, 1-bit Adam's compressed momentum and DeMo's local moments, and
GTC compresses the step it made. Per optimizer step and rank:

1. Before the step, the parameters are kept in the scratch buffer.
2. After backward (local gradients: DDP's hook sends nothing), one small all-reduce of a non-finite
   flag: a NaN/Inf gradient on any rank skips the step on every rank (with an AMP loss scaler every
   rank's scaler sees it), before any optimizer state is touched. Steps 1 and 2 come with the closure's
   first evaluation: an optimizer that evaluates it again within its step (SAM) probes from there.
3. The rank's optimizer steps on its own gradient: its moments and momentum are its own, like the
   local models of model averaging (and kept per rank in checkpoints).
4. The step it made, divided by its learning rate (the optimizer's direction: Adam's
   ``m / (sqrt(v) + eps)`` plus weight decay, momentum SGD's velocity), is added to the residual,
   and the parameters go back to the kept copy, exactly.
5. Threshold: ``tau_r``, this rank's, is just below the ``1 - target_density`` quantile of
   ``|residual|`` (estimated from a stratified random sample of :data:`SAMPLE` elements in runs of
   16 neighbours, seeded by step and rank), so that each rank sends about ``target_density * n``
   words every step whatever the scale of its optimizer's steps: no gradient scale is presumed, and
   the warm-up and decay of the learning rate do not move the density. Elements tied at the quantile
   are all sent; a residual that is mostly zero sends its largest non-zero elements. Words
   ``index | sign << 31`` for ``|r| > tau_r``, over the parameters the optimizer moved (a group at
   learning rate 0 keeps its residual); ``±tau_r`` subtracted (in place). Steps 4 and 5 are one pass
   over each parameter (:func:`~gtc_lightning.ops.update_ops.fold_emit_`): the sample's elements are
   folded first, alone, to know ``tau_r``.
6. One header exchange ``[words, bytes, tau_r, non-finite]`` and one word exchange, as in the gradient mode
   (all-to-all on gloo, all-gather on NCCL; ``coding="rice"`` Golomb-Rice codes the messages).
7. Decode, rank by rank in rank order: ``±tau_r / W`` at each word of rank ``r`` into the scratch
   buffer (no index twice within a rank, a fixed order across ranks: bit-identical on every rank,
   on CPU and GPU), then every parameter moves by ``-lr * scratch``, at its words' elements alone
   for large float32 ones: replicas stay bit-identical without a broadcast. Parameters in bf16/fp16 feed what their rounding took off back into every
   rank's residual. What the rank's own optimizer rounded away in step 3 is not seen: with weights
   stored in bf16 (``bf16-true``) a step below half a unit in the last place moves nothing, under DDP
   as here (200 AdamW steps at lr 1e-4 on bf16 weights in [0.5, 1.5): no element moved, with or
   without GTC; in fp32 every one did). Mixed precision keeps fp32 weights and has no such loss.

What is conserved is what the optimizer wanted to apply, in units of its learning rate (kept until
sent, applied with the learning rate of the step that sends it, as the gradient mode applies a kept
gradient). With ``conserve="displacement"`` the residual keeps the step itself and every word moves a
parameter by what was folded (a learning-rate warm-up no longer scales up old steps, nor a decay
drops them). ``density_warmup_steps`` starts the density at 0.25 and lowers it geometrically to
``target_density`` over that many steps (DGC's warm-up). ``momentum_masking`` zeros the rank's
momentum (SGD's ``momentum_buffer``, the Adam family's ``exp_avg``) at the elements it sent, after
the step (DGC's momentum factor masking: momentum no longer pushes what was just sent).
``word_levels`` lets a word carry ``2^k tau`` (the largest that its element holds, ``k < word_levels``):
the words go level by level, each level ascending (a Rice-coded message per level), their counts in the
header (:func:`split_levels_`, :func:`level_votes`).
``mean_variance`` (Adam and AdamW) replaces, in the step that goes into the residual, the rank's own second
moment by an estimate of the mean gradient's (:func:`~gtc_lightning.algorithms.gtc.moments.mean_variance_step`): the mean of the ranks' first
moments is DDP's first moment, so with the mean gradient's second moment the mean of the ranks' steps is
DDP's step. Memory: the residual and the scratch buffer, 8 bytes per parameter beyond DDP's.
Dense warm-up steps (``warmup_steps``) average the gradients as DDP does and step every rank's
optimizer on the mean.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from gtc_lightning.algorithms.common import allreduce_bytes, finish
from gtc_lightning.algorithms.gtc.config import (
    FALLBACK_ENTER,
    WORD_BYTES,
    f32,
    resolve_mean_variance,
    resolve_word_levels,
)
from gtc_lightning.algorithms.gtc.decode import decode_coded
from gtc_lightning.algorithms.gtc.exchange import send_coded, send_header, send_words
from gtc_lightning.algorithms.gtc.moments import mask_momentum, mean_variance_step
from gtc_lightning.algorithms.gtc.state import GTCState
from gtc_lightning.algorithms.gtc.stats import StepStats
from gtc_lightning.ops import step_ops, update_ops
from gtc_lightning.ops.rice import rice_encode
from gtc_lightning.ops.torch_ops import INDEX_MASK

log = logging.getLogger(__name__)

SAMPLE = 1 << 16  # residual elements the per-rank threshold is estimated from (a stratified random sample)
SAMPLE_RUN = 16  # ... in runs of this many neighbours (one random place per window)
# Steps 4-5 in one pass and step 7 at the words' elements alone (False: the reference passes, fold then
# emit, and a dense decode and update: the same words, residuals and parameters; for tests and benchmarks)
ONE_PASS = True
_HEADER = 4  # int64 values per rank: words, message bytes, tau (float64 bits), non-finite residual elements


def sample_positions(
    ranges: list[tuple[int, int]], generator: torch.Generator | None, device: torch.device
) -> torch.Tensor | None:
    """The elements the threshold is estimated from: ``[m]`` int64 flat indices in ascending order, a run
    of :data:`SAMPLE_RUN` neighbours at a random place in each window of ``ceil(total * SAMPLE_RUN /
    SAMPLE)`` elements of ``ranges`` (a stratified sample: a fixed stride would alias with the layout,
    e.g. take the same columns of every weight matrix; runs of neighbours cost a quarter of single
    elements to read); None when the ranges hold at most :data:`SAMPLE` elements (all of them then)."""
    lengths = [end - start for start, end in ranges]
    total = sum(lengths)
    if total <= SAMPLE:
        return None
    stride = -(-total * SAMPLE_RUN // SAMPLE)  # >= SAMPLE_RUN + 1
    windows = total // stride
    start = torch.arange(windows, device=device) * stride
    start += torch.randint(stride - SAMPLE_RUN + 1, (windows,), device=device, generator=generator)
    position = (start[:, None] + torch.arange(SAMPLE_RUN, device=device)).view(-1)
    if len(ranges) > 1 or ranges[0][0]:  # positions among the ranges' elements -> flat indices
        size = torch.tensor(lengths, device=device)
        ends = size.cumsum(0)
        which = torch.searchsorted(ends, position, right=True)
        position += (torch.tensor([start for start, _ in ranges], device=device) - (ends - size))[which]
    return position


def _kth_largest(sample: torch.Tensor, density: float) -> float:
    """The ``1 - density`` quantile of ``sample`` (``[m]``, non-negative): its ``ceil(density * m)``-th
    largest value, roughly."""
    k = min(sample.numel(), max(1, math.ceil((1.0 - density) * sample.numel())))
    if sample.device.type == "cpu":  # NumPy's partition: 6x faster than torch's topk at 65,536 (NaN last, as torch)
        return float(np.partition(sample.numpy(), k - 1)[k - 1])
    top = sample.numel() - k + 1  # the k-th smallest is the top-th largest
    if top < k:  # the same element; a small top-k is about 4x faster than kthvalue
        return float(torch.topk(sample, top, sorted=False).values.min())
    return float(torch.kthvalue(sample, k).values)


def _just_below(value: float) -> float:
    """The largest float32 below ``value`` (> 0), so that ``|r| > tau`` sends ``|r| == value`` too."""
    return float(np.nextafter(np.float32(value), np.float32(0.0))) if math.isfinite(value) else value


def rank_tau(
    residual: torch.Tensor,
    density: float,
    ranges: list[tuple[int, int]] | None = None,
    generator: torch.Generator | None = None,
) -> float:
    """This rank's threshold: just below the ``1 - density`` quantile of ``|residual|`` over ``ranges``,
    estimated from a stratified random sample of about :data:`SAMPLE` elements (all of them for smaller
    models, :func:`sample_positions`), so that every element at the quantile and above is sent
    (``|r| > tau``), ties included.

    Where that quantile is 0 (fewer than ``density`` of the elements are non-zero: say an embedding of
    which few rows moved), the ``density * n``-th largest non-zero ``|r|`` over all the elements sets it
    instead: the non-zero elements are sent rather than nothing.

    Args:
        residual: ``[n]`` float32.
        density: words per element to aim for, in (0, 1).
        ranges: ``(start, end)`` flat ranges of the elements to send from, ascending; None: all.
        generator: draws the sample (seeded by the caller: the same step gives the same sample).

    Returns:
        tau, as a float32 value; 0.0 when every element is 0 (nothing to send); NaN or Inf when the
        sample met a non-finite element.
    """
    ranges = [(0, residual.numel())] if ranges is None else [(a, b) for a, b in ranges if b > a]
    total = sum(end - start for start, end in ranges)
    if not total:
        return 0.0
    positions = sample_positions(ranges, generator, residual.device)
    every = [residual[start:end] for start, end in ranges]
    if positions is None:
        sample = (every[0] if len(every) == 1 else torch.cat(every)).abs()
    else:
        sample = residual[positions].abs()
    value = _kth_largest(sample, density)
    if value == 0.0:  # mostly zeros: the largest non-zero elements, found over all of them
        values = (every[0] if len(every) == 1 else torch.cat(every)).abs()
        nonzero = values[values > 0]
        if not nonzero.numel():
            return 0.0
        want = max(1, math.ceil(density * total))
        value = float(nonzero.min() if nonzero.numel() <= want else torch.topk(nonzero, want, sorted=False).values.min())
    return _just_below(value)


def layout(state: GTCState, params: list[torch.nn.Parameter]) -> None:
    """The flat residual and scratch buffers, parameters in the state's order, on their device;
    residuals restored or carried over (by name) go into place. Called at the first step."""
    if state._residual is not None and state._scratch is not None:
        return
    device = params[0].device if params else torch.device("cpu")
    total = sum(state.numels)
    state._residual = torch.zeros(total, dtype=torch.float32, device=device)
    state._scratch = torch.empty(total, dtype=torch.float32, device=device)
    offset, slots = 0, {}
    for name, n in zip(state.param_names, state.numels):
        slots[name] = (offset, n)
        if name in state._loaded:
            state._residual[offset : offset + n].copy_(state._loaded[name])
        offset += n
    state._slots, state._loaded = slots, {}


def _views(buffer: torch.Tensor, state: GTCState, params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    """Per parameter, its slice of a flat buffer, shaped like it."""
    out = []
    for p in params:
        offset, n = state._slots[state._name_of[id(p)]]
        out.append(buffer[offset : offset + n].view_as(p))
    return out


def begin(state: GTCState, params: list[torch.nn.Parameter]) -> None:
    """Step 1: keep the parameters in the scratch buffer."""
    layout(state, params)
    with torch.no_grad():
        for view, p in zip(_views(state._scratch, state, params), params):
            view.copy_(p)


def check_finite(state: GTCState, params: list[torch.nn.Parameter], loss_scaler: bool, keep: bool = False) -> bool:
    """Step 2: whether some rank's local gradient is non-finite; if so the step is skipped on every
    rank (``GTCState.finish_step`` applies it: no gradients, or NaN ones for an AMP loss scaler).

    One flag per rank from one reduction on the device (the sum of every gradient: a NaN or Inf
    element makes it non-finite), all-reduced: the host waits once, for the flags, not once per
    parameter. Only where a sum is non-finite do the flagged ranks look element by element (a sum of
    finite values that overflowed is no reason to skip) and exchange what they found.

    Args:
        keep: also step 1, :func:`begin`, while the flags are on their way (after the backward pass the
            parameters are what they were before it): the copy hides the all-reduce's latency.

    Returns:
        True when the step is skipped.
    """
    grads = [p.grad for p in params if p.grad is not None]
    device = params[0].device if params else torch.device("cpu")
    world, rank = state.world_size, state.rank

    def gather(flag: torch.Tensor | bool, meanwhile=None) -> list[int]:
        flags = torch.zeros(world, dtype=torch.int64, device=device)
        flags[rank] = flag
        work = dist.all_reduce(flags, group=state.process_group, async_op=True) if world > 1 else None
        if meanwhile is not None:
            meanwhile()
        finish(work, state.busy)
        return flags.tolist()

    total = torch.stack([g.sum(dtype=torch.float32) for g in grads]).sum() if grads else torch.zeros((), device=device)
    flagged = gather(~torch.isfinite(total), (lambda: begin(state, params)) if keep else None)
    if any(flagged):
        flagged = gather(bool(flagged[rank]) and not all(bool(torch.isfinite(g).all()) for g in grads))
    bad_ranks = [r for r, flag in enumerate(flagged) if flag]
    if not bad_ranks:
        state.totals["consecutive_skips"] = 0
        return False
    state.step += 1
    header = (world - 1) * world * 8 if world > 1 else 0
    state._record(
        StepStats(
            step=state.step, mode="skipped", skipped=True, bad_ranks=bad_ranks, numel=sum(state.numels),
            world_size=world, words=0, words_all=0, bytes_sent=header, bytes_received=header,
            compress_s=0.0, exchange_s=0.0, decompress_s=0.0, tau=state.tau,
        )
    )  # fmt: skip
    state.finish_step(params, loss_scaler=loss_scaler)
    return True


def learning_rates(optimizer: torch.optim.Optimizer) -> dict[int, float]:
    """``id(parameter) -> learning rate`` of its group: read after the optimizer's step, the rates it
    used (a rate set inside the closure, e.g. in ``on_before_optimizer_step``, is one of them)."""
    return {id(p): float(group["lr"]) for group in optimizer.param_groups for p in group["params"]}


def _sampler(state: GTCState, device: torch.device) -> torch.Generator:
    """The generator of the threshold's sample, seeded from the step and the rank: the same sample
    for the same step, so a resumed run continues bit for bit."""
    generator = state._sample_generator
    if generator is None or generator.device != device:
        generator = state._sample_generator = torch.Generator(device=device)
    return generator.manual_seed(state.step * 1_000_003 + state.rank)


def exchange(
    state: GTCState,
    params: list[torch.nn.Parameter],
    lrs: dict[int, float],
    optimizer: torch.optim.Optimizer | None = None,
    dense_numel: int | None = None,
) -> StepStats:
    """Steps 4-7, after the rank's optimizer stepped: compress the step it made, exchange, apply the
    decoded mean on every rank; with ``state.momentum_masking``, zero ``optimizer``'s momentum at the
    elements this rank sent.

    A parameter the optimizer did not move (in none of its groups, or in a group at learning rate 0,
    as when frozen that way) sends nothing: its residual, the steps still pending for it, is kept
    whole until its rate is above 0 again.

    ``dense_numel``: the elements of the dense all-reduce the step's bytes are compared with (None: every
    parameter's; with several optimizers, each exchanging its own parameters, the optimizer's).

    Raises:
        RuntimeError: on every rank alike, when some rank's optimizer made a non-finite step from
            finite gradients (it is named); the exchange stops before any word is sent.
    """
    world, rank = state.world_size, state.rank
    state.step += 1
    start = time.perf_counter()
    residual, scratch = state._residual, state._scratch
    numel = residual.numel() if dense_numel is None else dense_numel
    moved: list[Moved] = []
    with torch.no_grad():
        for p, kept in zip(params, _views(scratch, state, params)):
            lr = lrs.get(id(p))
            if lr is None or lr == 0.0:
                p.copy_(kept)  # not in this optimizer, or frozen by a zero rate: nothing to send
                continue
            offset, n = state._slots[state._name_of[id(p)]]
            moved.append(Moved(p, offset, n, lr if state.conserve == "direction" else 1.0))
        moved.sort(key=lambda m: m.offset)
        if state.mean_variance == "auto" and optimizer is not None:  # decided by the optimizer, once
            state.mean_variance, why = resolve_mean_variance("auto", optimizer)
            if rank == 0:
                log.info("GTC: %s", why)
        if state.word_levels == "auto":  # decided by the optimizer, once (1 without one)
            state.word_levels, why = resolve_word_levels("auto", optimizer)
            if rank == 0 and optimizer is not None:
                log.info("GTC: %s", why)
        if state.mean_variance is True and optimizer is not None:
            mean_variance_step(state, optimizer, moved)

        # 4-5. residual += (kept - p) / lr, p = kept exactly; this rank's threshold and words (in
        # ascending order, over the moved parameters' elements); the scratch buffer holds the message then.
        message = scratch.view(torch.int32)
        cursor = torch.zeros(1, dtype=torch.int64, device=residual.device)
        bad = torch.zeros(1, dtype=torch.int32, device=residual.device)
        tau32 = _fold_and_emit(state, moved, message, cursor, bad)
        own, nonfinite = int(cursor), int(bad)
        if nonfinite:
            own = 0  # nothing is sent: every rank raises after the header
        levels = state.word_levels
        level_counts = split_levels_(residual, message[:own], tau32, levels) if levels > 1 else []
        compress_s = time.perf_counter() - start

        # 6. Header [words, bytes, tau, non-finite] and words.
        start = time.perf_counter()
        if state.coding == "rice" and not nonfinite:
            segments = message[:own].split([own - sum(level_counts), *level_counts]) if levels > 1 else [message[:own]]
            coded = [rice_encode(words) for words in segments if words.numel()]  # (empty levels left out)
            state._coded = torch.cat(coded) if coded else rice_encode(message[:0])
            size = state._coded.numel()
        else:
            size = own * WORD_BYTES
        tau_bits = torch.tensor([tau32], dtype=torch.float64).view(torch.int64)
        header = torch.cat([torch.tensor([own, size], dtype=torch.int64), tau_bits,
                            torch.tensor([nonfinite, *level_counts], dtype=torch.int64)]).to(residual.device)  # fmt: skip
        header_width = _HEADER + len(level_counts)
        headers = send_header(state, header).view(world, header_width).cpu()
        counts, sizes = headers[:, 0].tolist(), headers[:, 1].tolist()
        taus = headers[:, 2].contiguous().view(torch.float64).tolist()
        bad_ranks = [r for r, count in enumerate(headers[:, 3].tolist()) if count]
        if bad_ranks:
            raise RuntimeError(
                f"GTC (compress='update'): at optimizer step {state.step} the optimizer made a non-finite step "
                f"from finite gradients on rank(s) {bad_ranks} ({'this rank: ' if rank in bad_ranks else ''}"
                f"{nonfinite if rank in bad_ranks else 'no'} non-finite residual elements here). Every rank stops "
                "here, before a word is sent. Check the optimizer's hyper-parameters: an eps that underflows in "
                "16-bit precision (use 'bf16-mixed' or '16-mixed', or a larger eps), a learning rate too large"
            )
        if state.coding == "rice":
            data, width, sent, received, _ = send_coded(state, sizes)
            words, lengths = decode_coded(data, sizes, width, own=(rank, message[:own]), several=levels > 1), None
        else:
            state._message = message  # what send_words sends from
            words, lengths, sent, received, _ = send_words(state, counts)
            state._message = None
            if world == 1:
                words = words.clone()  # one rank: its own message, a view of the scratch buffer
        exchanged = time.perf_counter()

        # 7. Decode rank by rank into the scratch buffer at the words' elements, then move every parameter
        # by -lr * it there.
        parts = [
            level_votes(part, f32(f32(taus[r]) / world), headers[r, _HEADER:].tolist())
            for r, part in enumerate(_rank_words(words, lengths, counts))
        ]
        index = _apply(state, moved, parts)
        if state.momentum_masking and optimizer is not None:
            mask_momentum(state, optimizer, moved, index[rank])
    header_bytes = (world - 1) * header_width * 8
    fp32_bytes = allreduce_bytes(numel, world)
    stats = StepStats(
        step=state.step, mode="sparse", skipped=False, bad_ranks=[], numel=numel, world_size=world, words=own,
        words_all=sum(counts), bytes_sent=header_bytes + sent, bytes_received=header_bytes + received,
        compress_s=compress_s, exchange_s=exchanged - start, decompress_s=time.perf_counter() - exchanged,
        applied=state.step, tau=tau32, share=(world - 1) * max(sizes) / fp32_bytes if fp32_bytes else 0.0,
    )  # fmt: skip
    if state.target_density is not None:
        state.tau, state.tau32 = tau32, tau32
    if stats.share > FALLBACK_ENTER and not state._warned_fallback and rank == 0:
        state._warned_fallback = True
        if state.target_density is None:
            why = (
                f"at the fixed tau={tau32:g}. In this mode tau is in units of the optimizer's step over its learning "
                "rate (Adam's: about 1 a step): use tau='auto' with a target_density (the default), or a larger tau"
            )
        else:
            why = (
                f"against a target_density of {state.target_density:g}: many elements were tied at a rank's threshold "
                "and every one of them was sent (an optimizer whose steps are all alike, such as a sign-based one, "
                "does that). It trains as sent; a dense strategy may cost less"
            )
        warnings.warn(
            f"GTC (compress='update'): at optimizer step {state.step} the words of up to {max(counts)} of {numel} "
            f"elements (density {max(counts) / max(numel, 1):.2%}) sent more bytes than a bf16 all-reduce, {why}",
            RuntimeWarning,
            stacklevel=2,
        )
    state._record(stats)
    for field in ("exchange_s", "decompress_s"):  # host timers: known at once (the hook's wait for CUDA events)
        state.totals[field] += getattr(stats, field)
    state._last_consumed = True
    state.settle()
    return stats


@dataclass
class Moved:
    """A parameter the optimizer moved this step: its flat range in the residual and its rate."""

    param: torch.nn.Parameter
    offset: int
    numel: int
    lr: float

    def views(self, buffer: torch.Tensor) -> torch.Tensor:
        return buffer[self.offset : self.offset + self.numel]


def _fold_and_emit(
    state: GTCState, moved: list[Moved], message: torch.Tensor, cursor: torch.Tensor, bad: torch.Tensor
) -> float:
    """Steps 4-5 for the ``moved`` parameters (ascending offsets): fold each one's step into the residual
    and emit the words at this rank's threshold. Returns the threshold.

    With a per-rank threshold the folded residual is first computed at the sample's elements alone
    (:func:`~gtc_lightning.ops.update_ops.fold_at`), so that the threshold is known before the one pass
    that folds and emits (:func:`~gtc_lightning.ops.update_ops.fold_emit_`). Where that cannot give it
    (a model within one sample, a quantile of 0, a non-finite sample) the passes run one after the
    other: fold, :func:`rank_tau`, emit; the words, residual and parameters are the same either way.
    """
    residual, scratch = state._residual, state._scratch
    ranges = _merged([[m.offset, m.offset + m.numel] for m in moved])
    tau32 = state.tau32  # a fixed tau, in units of the optimizer's direction (or displacement)
    density = state.density_now()
    if density is not None:
        positions = sample_positions(ranges, _sampler(state, residual.device), residual.device) if ONE_PASS else None
        tau32 = 0.0
        if positions is not None:
            parts = [(m.param, m.offset, m.lr) for m in moved]
            sample = update_ops.fold_at(parts, scratch, residual, positions).abs_()
            value = _kth_largest(sample, density)
            tau32 = _just_below(value) if value > 0.0 and math.isfinite(value) else 0.0
    if tau32 > 0.0 and ONE_PASS:
        for m in moved:
            update_ops.fold_emit_(m.param, m.views(scratch), m.views(residual), m.lr, tau32, message, cursor, bad,
                                  m.offset, backend=state.backend)  # fmt: skip
        return tau32
    for m in moved:
        update_ops.fold_(m.param, m.views(scratch), m.views(residual), m.lr)
    if density is not None:
        tau32 = rank_tau(residual, density, ranges, _sampler(state, residual.device))
    if not math.isfinite(tau32):
        bad += 1  # the sample met a NaN/Inf
    elif tau32 > 0.0:
        for first, end in ranges:  # a NaN/Inf element is counted in bad
            step_ops(residual.device, state.backend).emit_(residual[first:end], tau32, message, cursor, bad, first)
    else:
        bad += sum(int((~torch.isfinite(residual[first:end])).sum()) for first, end in ranges)
    return tau32


SPARSE_APPLY = 1 << 16  # float32 parameters of at least this many elements move at their words alone


def _apply(
    state: GTCState, moved: list[Moved], parts: list[tuple[torch.Tensor, torch.Tensor]]
) -> list[torch.Tensor]:
    """Step 7: every rank's words (``(index, votes)`` in rank order, :func:`level_votes`) decoded into the
    scratch buffer, each vote (``±tau_r / W``, or a multiple) added rank by rank at its element (no element twice within a rank, a fixed
    order across ranks: bit-identical on every rank), then each moved parameter moved by ``-lr`` times
    it. Large float32 parameters move at their words' elements alone; the others by a dense add over
    their range (bf16/fp16 ones feeding what their rounding took off back into the residual). Returns
    each rank's flat indices (ascending)."""
    residual, scratch = state._residual, state._scratch
    index, votes = [i for i, _ in parts], [v for _, v in parts]
    sparse = [
        ONE_PASS and m.param.dtype == torch.float32 and m.numel >= SPARSE_APPLY and m.param.is_contiguous()
        for m in moved
    ]
    for m, alone in zip(moved, sparse):
        if not alone:
            m.views(scratch).zero_()
    for i in index:
        scratch.index_fill_(0, i, 0.0)
    for i, v in zip(index, votes):
        scratch.index_add_(0, i, v)
    if any(sparse):  # each rank's words are ascending: a parameter's are a slice of each
        edges = torch.tensor([[m.offset, m.offset + m.numel] for m in moved], device=scratch.device).view(-1)
        bounds = [torch.searchsorted(i, edges).tolist() for i in index]
    for j, (m, alone) in enumerate(zip(moved, sparse)):
        p = m.param
        if alone:
            at = torch.cat([i[b[2 * j] : b[2 * j + 1]] for i, b in zip(index, bounds)])
            update_ops.apply_words_(p, scratch[at], at - m.offset, m.lr)
        elif p.dtype == torch.float32:
            p.add_(m.views(scratch).view_as(p), alpha=-m.lr)
        else:
            target = p.float() - m.lr * m.views(scratch).view_as(p)
            p.copy_(target)
            m.views(residual).view_as(p).add_(p.float() - target, alpha=1.0 / m.lr)  # what the rounding took off
    return index


def split_levels_(residual: torch.Tensor, words: torch.Tensor, tau32: float, levels: int) -> list[int]:
    """``word_levels``: after :func:`_fold_and_emit` took ``tau`` off each sent element, the words whose
    element held ``|r| >= 2^k tau`` carry ``2^k tau`` (the largest ``k < levels``), and the rest of that
    is taken off the residual here (what is left, ``|r| - 2^k tau < 2^k tau``, keeps its sign: nothing
    overshoots). The words (``[m]`` int32, ascending, a view of the message) are reordered in place
    level by level, ascending within each. Returns the counts of levels ``1 .. levels - 1``."""
    if not words.numel() or not tau32 > 0.0:
        return [0] * (levels - 1)
    index = (words & INDEX_MASK).long()
    rest = residual[index]  # sign * (|r| - tau)
    # (2^k - 1) tau for k = 0 .. levels - 1, in float32: an element takes the largest that its |r| - tau reaches
    extra = torch.tensor([f32((2**k - 1) * tau32) for k in range(levels)], dtype=torch.float32, device=rest.device)
    level = torch.searchsorted(extra, rest.abs(), right=True) - 1
    taken = extra[level]
    residual[index] = rest - torch.where(words < 0, -taken, taken)
    order = torch.sort(level, stable=True).indices
    words.copy_(words[order])
    return torch.bincount(level, minlength=levels).tolist()[1:]


def level_votes(words: torch.Tensor, scale: float, upper: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A rank's words as ``(index, votes)``: the index ascending (new tensors: the words may view the scratch
    buffer) and each vote ``±scale``, or ``±2^k scale`` with ``word_levels`` (the words level by level,
    ``upper``: the counts of levels ``1 ..`` from the rank's header; none or all 0: every word at ``scale``,
    in index order already)."""
    index = (words & INDEX_MASK).long()
    votes = torch.where(words < 0, -scale, scale).to(torch.float32)
    if not any(upper):
        return index, votes
    counts = torch.tensor([words.numel() - sum(upper), *upper], device=words.device)
    votes *= torch.repeat_interleave(torch.exp2(torch.arange(len(upper) + 1, dtype=torch.float32, device=words.device)), counts)
    index, order = torch.sort(index)
    return index, votes[order]


def warmup(state: GTCState) -> StepStats:
    """A dense warm-up step's statistics (DDP's all-reduce averaged the gradients in the hook; every
    rank's optimizer steps on the mean, so the parameters agree without an exchange). They are left
    for :meth:`GTCState.finish_step`, which the strategy calls next: it checks the mean gradient (the
    same on every rank) and skips the step everywhere when it is non-finite."""
    state.step += 1
    numel, world = sum(state.numels), state.world_size
    dense = allreduce_bytes(numel, world)
    stats = StepStats(
        step=state.step, mode="warmup", skipped=False, bad_ranks=[], numel=numel, world_size=world, words=0,
        words_all=0, bytes_sent=dense, bytes_received=dense, compress_s=0.0, exchange_s=0.0, decompress_s=0.0,
    )  # fmt: skip
    state._record(stats)
    return stats


def _merged(ranges: list[list[int]]) -> list[tuple[int, int]]:
    """``[start, end)`` ranges sorted, adjacent ones joined (one range when every parameter moved)."""
    out: list[list[int]] = []
    for first, end in sorted(ranges):
        if out and out[-1][1] == first:
            out[-1][1] = end
        else:
            out.append([first, end])
    return [(first, end) for first, end in out]


def _rank_words(words: torch.Tensor, lengths: list[int] | None, counts: list[int]) -> list[torch.Tensor]:
    """Every rank's words, rank 0's first (from an all-to-all back to back, or padded rows)."""
    if lengths is None:
        return list(words.split(counts))
    rows = words.view(len(lengths), -1)
    return [rows[r, :n] for r, n in enumerate(lengths)]
