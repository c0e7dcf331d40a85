"""Strom's gradient threshold compression as a DDP communication hook: :func:`gtc_hook` on a
:class:`~gtc_lightning.algorithms.gtc.state.GTCState`.

The algorithm, per optimizer step and per rank (Strom 2015, sections 2.3-2.6):

1. Warmup: for the first ``warmup_steps`` steps every bucket is averaged by DDP's own dense
   all-reduce hook, bit for bit as DDP.
2. Threshold, bucket by bucket as DDP hands them over, while backward goes on: ``out = residual +
   g`` (``g`` unscaled from AMP's loss scale and clipped as the Trainer asks) into a second
   residual buffer, the words ``index | sign << 31`` of every element with ``|out| > tau``
   appended to this step's message and ``±tau`` subtracted there. The old residual is kept, so a
   step skipped because of any rank needs no undo. Parameters this rank did not use
   in the backward (``find_unused_parameters``) are left out: DDP never applies an update to a
   parameter no rank used, so a word for one would be lost; their residual is carried over.
   Norm clipping needs every gradient first, so with it all buckets wait for the last one.
3. Header exchange at the last bucket: every rank sends ``[non-finite count, words, bytes]`` to
   every rank (all-to-all on gloo: one message latency; all-gather on NCCL), the step's one host
   synchronisation.
4. Decide, identically on every rank from the headers: *skip* (a non-finite value on some rank:
   residuals unchanged, the strategy drops the update), *dense* (the sparse exchange would move
   more bytes than a dense bf16 all-reduce: every rank's ``residual + g`` is all-reduced and the
   residuals restart from zero, so nothing is lost; hysteresis keeps it from flapping), or
   *sparse*.
5. Sparse: one word exchange (all-to-all of uneven messages where the backend is gloo, measured
   faster than padding to the longest; padded all-gather on NCCL); the new residual becomes the
   residual (buffer swap).
6. Decode every rank's words at once into the bucket buffers: exact int32 vote counts, then one
   float32 scale ``tau / world_size``, so every rank computes bit-identical gradients whatever the
   order of words, and the replicas stay identical forever without a broadcast ("dead reckoning").

Residuals live in one flat buffer laid out as DDP's buckets (:mod:`~gtc_lightning.algorithms.gtc.layout`).
The collectives of steps 3 and 5 are in :mod:`~gtc_lightning.algorithms.gtc.exchange`; with
``stale=True`` steps 5-6 are :func:`~gtc_lightning.algorithms.gtc.stale.exchange_stale`'s, which this
hook dispatches to after step 4; with ``compress="update"`` the hook sends nothing after the warm-up
(:func:`local_hook`) and :mod:`~gtc_lightning.algorithms.gtc.update` compresses the optimizer's step.

All tensor work runs on the thread that calls the hook (no ``Future.then`` callbacks), which keeps
Triton's interpreter, which is not thread-safe, out of DDP's callback threads.
"""

import math
import warnings

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from gtc_lightning.algorithms.common import allreduce_bytes, finish
from gtc_lightning.algorithms.gtc.config import (
    AUTO_TAU_INIT,
    FALLBACK_ENTER,
    FALLBACK_EXIT,
    HEADER,
    SAMPLE,
    WORD_BYTES,
)
from gtc_lightning.algorithms.gtc.decode import decode_coded, decode_dense, dense_rounding, sparse_rounding
from gtc_lightning.algorithms.gtc.exchange import (
    feed_back,
    reduce_dense,
    send_coded,
    send_header,
    send_words,
    word_scale,
)
from gtc_lightning.algorithms.gtc.layout import bucket_offset, buffers, finish_layout, start_layout
from gtc_lightning.algorithms.gtc.stale import exchange_stale
from gtc_lightning.algorithms.gtc.state import GTCState
from gtc_lightning.algorithms.gtc.stats import Clock, StepStats
from gtc_lightning.ops import step_ops
from gtc_lightning.ops.rice import rice_encode


def _new_future(device: torch.device) -> torch.futures.Future:
    # A Future holding CUDA tensors must be told its devices, so that it can synchronise streams.
    return torch.futures.Future(devices=[device]) if device.type == "cuda" else torch.futures.Future()


def gtc_hook(state: GTCState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: Strom's threshold compression with one exchange per step.

    Register with ``ddp_model.register_comm_hook(state, gtc_hook)``. The steps are numbered as in
    the module docstring.

    Args:
        state: the :class:`GTCState` shared by all buckets.
        bucket: the DDP bucket; ``bucket.buffer()`` is ``[n]``, this rank's gradients of
            ``bucket.parameters()`` back to back.

    Returns:
        a Future of the ``[n]`` averaged gradient estimate, written into ``bucket.buffer()``;
        completed when the last bucket of the step arrives.
    """
    if state.compress == "update":  # update.py: the optimizer's step is compressed, not this
        return local_hook(state, bucket)
    # 1. Dense warmup, averaged over ranks as DDP's default hook does.
    if state.step < state.warmup_steps:
        if bucket.is_last():
            state.step += 1
            if state._used is not None:
                state._used.clear()
            numel = sum(state.numels)
            world = state.world_size
            dense = allreduce_bytes(numel, world)
            state._record(
                StepStats(
                    step=state.step, mode="warmup", skipped=False, bad_ranks=[], numel=numel, world_size=world,
                    words=0, words_all=0, bytes_sent=dense, bytes_received=dense,
                    compress_s=0.0, exchange_s=0.0, decompress_s=0.0,
                )
            )  # fmt: skip
        return allreduce_hook(state.process_group, bucket)

    # 2. Threshold this bucket now (or keep it for the norm), then wait for the last one.
    if bucket.index() == 0:
        _begin_step(state, bucket.buffer().device)
    buffer = bucket.buffer()
    future = _new_future(buffer.device)
    params = bucket.parameters()
    offset = bucket_offset(state, bucket, params)
    state._step_offset = offset + buffer.numel()
    runs = _used_runs(state, params, buffer.numel())
    state._pending.append((bucket, future, offset))
    norm_clip = state.clip is not None and state.clip[0] == "norm"
    if norm_clip or state.measuring_tau():
        state._deferred.append((buffer, offset, runs))
        if norm_clip:
            norm = torch.linalg.vector_norm(buffer, dtype=torch.float32)
            state._norm_sq = norm * norm if state._norm_sq is None else state._norm_sq + norm * norm
    else:
        _threshold_bucket(state, buffer, offset, runs, alpha=1.0 / state.grad_scale)
    if bucket.is_last():
        _exchange(state)
        _adapt_tau(state)
    return future


def local_hook(state: GTCState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """``compress="update"``: the gradient stays local (each rank's optimizer steps on its own), but
    during the dense warm-up DDP's all-reduce averages it."""
    if state.step < state.warmup_steps:
        return allreduce_hook(state.process_group, bucket)
    future = _new_future(bucket.buffer().device)
    future.set_result(bucket.buffer())
    return future


def _adapt_tau(state: GTCState) -> None:
    """Automatic tau: after a compressed step that was not skipped, move tau towards the target
    density, from the word counts every rank received in the headers (so every rank agrees)."""
    last = state.last
    if state.controller is None or last is None or last.skipped or last.step != state.step:
        return
    density = sum(state._step_counts) / max(last.world_size * last.numel, 1)
    state.set_tau(state.controller.update(density))


def _begin_step(state: GTCState, device: torch.device) -> None:
    # A new step starting at bucket 0 drops leftovers of a backward pass that failed half-way.
    state._pending, state._deferred, state._unused = [], [], []
    state._building, state._norm_sq, state._step_offset = None, None, 0
    if state._counts is None:
        start_layout(state, device)
    state._ops = step_ops(device, state.backend)
    state._clock = Clock(device)
    state._cursor = torch.zeros(1, dtype=torch.int64, device=device)
    state._bad = torch.zeros(1, dtype=torch.int32, device=device)
    state._compress_marks = []
    state.settle()


def _used_runs(state: GTCState, params: list, numel: int) -> list[tuple[int, int, bool]]:
    """``(start, end, used)`` element ranges of a bucket, merged where neighbours agree."""
    if state._used is None:
        return [(0, numel, True)]
    runs: list[list] = []
    start = 0
    for p in params:
        used = id(p) in state._used
        if runs and runs[-1][2] == used:
            runs[-1][1] += p.numel()
        else:
            runs.append([start, start + p.numel(), used])
        start += p.numel()
    return [tuple(r) for r in runs]


def _threshold_bucket(
    state: GTCState, buffer: torch.Tensor, offset: int, runs: list, alpha: float
) -> None:
    """Step 2 for one bucket: the new residual into the spare buffer, words into the message."""
    start = state._clock.now()
    residual, spare = buffers(state)
    clip = None
    if state.clip is not None and state.clip[0] == "value":
        clip = state.clip[1] * state.grad_scale  # the bucket holds loss-scaled gradients
    for lo, hi, used in runs:
        a, b = offset + lo, offset + hi
        if not used:
            spare[a:b].copy_(residual[a:b])
            state._unused.append((a, b))
            continue
        state._ops.threshold_(
            buffer[lo:hi], residual[a:b], spare[a:b], state.tau32, state._message, state._cursor, state._bad,
            offset=a, alpha=alpha, clip=clip,
        )  # fmt: skip
    state._compress_marks.append((start, state._clock.now()))


def _first_tau(state: GTCState, alpha: float) -> float:
    """Automatic tau's start, measured, so that no gradient scale is presumed: every rank takes the
    ``1 - target_density`` quantile of ``|residual + alpha * gradient|`` over a strided sample of the
    step's buckets, and the ranks agree on the geometric mean (one small all-reduce, at the first
    compressed step only)."""
    residual, _ = buffers(state)
    total = sum(buffer.numel() for buffer, _, _ in state._deferred)
    stride = max(1, total // SAMPLE)
    parts = [
        (residual[offset : offset + buffer.numel()] + alpha * buffer.float())[::stride]
        for buffer, offset, _ in state._deferred
    ]
    sample = torch.cat(parts).abs() if parts else torch.zeros(1)
    sample = sample[torch.isfinite(sample)]
    k = min(sample.numel(), max(1, math.ceil((1.0 - state.controller.target_density) * sample.numel())))
    tau = float(torch.kthvalue(sample.cpu(), k).values) if sample.numel() else 0.0
    log_tau = torch.tensor([math.log(tau) if tau > 0 else math.log(AUTO_TAU_INIT)], dtype=torch.float64)
    if state.world_size > 1:
        log_tau = log_tau.to(residual.device)
        finish(dist.all_reduce(log_tau, group=state.process_group, async_op=True), state.busy)
        log_tau = log_tau.cpu() / state.world_size
    return float(torch.exp(log_tau))


def _exchange(state: GTCState) -> None:
    """Steps 3-6 for all buckets of one step; completes every Future."""
    state.step += 1
    world, rank = state.world_size, state.rank
    if state._deferred:
        coef = 1.0
        if state._norm_sq is not None:
            # Norm clipping: one coefficient for the whole local gradient, unscaled (as
            # clip_grad_norm_), folded into the gradient's factor.
            norm = float(state._norm_sq.sqrt()) / state.grad_scale
            limit = state.clip[1]
            coef = min(1.0, limit / (norm + 1e-6)) if math.isfinite(norm) else 1.0
        if state.measuring_tau():
            state.set_tau(state.controller.start(_first_tau(state, coef / state.grad_scale)))
        for buffer, offset, runs in state._deferred:
            _threshold_bucket(state, buffer, offset, runs, alpha=coef / state.grad_scale)
        state._deferred = []
    finish_layout(state)
    numel = state._step_offset
    residual, spare = state._residual, state._spare
    pending, state._pending = state._pending, []
    used, state._unused = state._unused, []
    if state._used is not None:
        state._used.clear()
    clock = state._clock

    # 3. One header exchange: non-finite count and words of every rank; the step's host sync.
    start = clock.now()
    if state.coding == "rice":
        state._coded = rice_encode(state._message[: int(state._cursor)])
        size = torch.tensor([state._coded.numel()], dtype=torch.int64, device=state._cursor.device)
    else:
        size = state._cursor * WORD_BYTES
    header = torch.cat([state._bad.to(torch.int64), state._cursor, size])
    headers = send_header(state, header).view(world, HEADER).tolist()
    header_bytes = (world - 1) * HEADER * 8
    bad_ranks = [r for r, (bad, _, _) in enumerate(headers) if bad]
    counts = [words for _, words, _ in headers]
    state._step_counts = counts
    sizes = [message_bytes for _, _, message_bytes in headers]
    own = counts[rank]
    fp32_bytes = allreduce_bytes(numel, world)

    compress_s = sum(clock.seconds(a, b) for a, b in state._compress_marks)  # complete: synced above

    def record(mode: str, sent: int, received: int, exchanged, end, applied: int | None = state.step) -> None:
        sparse = mode == "sparse"
        stats = StepStats(
            step=state.step, mode=mode, skipped=mode == "skipped", bad_ranks=bad_ranks, numel=numel,
            world_size=world, words=own if sparse else 0, words_all=sum(counts) if sparse else 0,
            bytes_sent=header_bytes + sent, bytes_received=header_bytes + received,
            compress_s=compress_s, exchange_s=0.0, decompress_s=0.0, applied=None if mode == "skipped" else applied,
            tau=state.tau, share=0.0 if mode == "skipped" else share,
        )  # fmt: skip
        state._record(stats)
        state._unsettled += [(stats, "exchange_s", start, exchanged), (stats, "decompress_s", exchanged, end)]
        if not clock.cuda:
            state.settle()

    # 4. Decide, on every rank from the same headers.
    if bad_ranks:
        for bucket, future, _ in pending:
            future.set_result(bucket.buffer().zero_())
        now = clock.now()
        record("skipped", 0, 0, now, now)
        return
    dense = False
    share = (world - 1) * max(sizes) / fp32_bytes if fp32_bytes else 0.0
    if state.dense_fallback and world > 1:
        was_dense = state._dense_mode
        state._dense_mode = share > (FALLBACK_EXIT if was_dense else FALLBACK_ENTER)
        if state._dense_mode and not state._warned_fallback and rank == 0:
            state._warned_fallback = True
            warnings.warn(
                f"GTC: at optimizer step {state.step} the sparse exchange would send {share:.2f}x the bytes of a "
                f"dense fp32 all-reduce, more than a bf16 all-reduce (up to {max(counts)} words of {numel} elements, "
                f"density {max(counts) / max(numel, 1):.2%}, tau={state.tau:g}); falling back to dense all-reduce "
                f"until it drops below {FALLBACK_EXIT}x. A larger tau (or tau='auto' with a target_density) keeps "
                "the exchange sparse",
                RuntimeWarning,
                stacklevel=3,
            )
        dense = state._dense_mode
    if state.stale:
        exchange_stale(state, pending, used, counts, sizes, numel, record, dense)
        return
    if dense:
        _dense_step(state, pending, used, own, numel, start, record)
        return

    # 5. One word exchange.
    if state.coding == "rice":
        data, width, sent, received, _ = send_coded(state, sizes)
        words, lengths = decode_coded(data, sizes, width, own=(rank, state._message[:own])), None
    else:
        words, lengths, sent, received, _ = send_words(state, counts)
    exchanged = clock.now()
    state._residual, state._spare = spare, residual

    # 6. Decode every bucket from all ranks' words at once.
    outputs = [(o, b.buffer()) for b, _, o in pending]
    scale = word_scale(state, world)
    state._ops.decode_(words, lengths, state._counts, outputs, scale)
    feed_back(state, sparse_rounding(words, lengths, outputs, scale, state.grad_scale))
    for bucket, future, _ in pending:
        future.set_result(bucket.buffer())
    record("sparse", sent, received, exchanged, clock.now())


def _dense_step(state: GTCState, pending: list, unused: list, own: int, numel: int, start, record) -> None:
    """Step 4's fallback: all-reduce every rank's residual + gradient; residuals restart at zero.

    A parameter this rank did not use sends zeros and keeps its residual, so that nothing is
    applied to a parameter no rank used (DDP would drop it) and nothing is lost.
    """
    world, clock, sums = state.world_size, state._clock, state._spare
    reduce_dense(state, unused, own, numel)
    exchanged = clock.now()
    outputs = [(o, b.buffer()) for b, _, o in pending]
    decode_dense(sums, world, state.grad_scale, outputs)
    feed_back(state, dense_rounding(sums, world, outputs, state.grad_scale))
    for bucket, future, _ in pending:
        future.set_result(bucket.buffer())
    sent = allreduce_bytes(numel, world)
    record("dense", sent, sent, exchanged, clock.now())
