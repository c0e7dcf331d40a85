"""One-step-stale GTC (``GTCStrategy(stale=True)``, ``"gtc_stale"``): the exchange of step t runs while
step t+1 computes, and its decoded update is applied one step late.

Strom's asynchronous mode within a synchronous frame, IBM's HYBRID (``003_…``: the all-reduce "runs
concurrently with gradient calculation" and each step applies the previous one's result). Every rank
still applies the same update at the same step, so the replicas stay bit-identical; the update the
optimizer applies at step t is computed from the gradients of step t-1 (staleness 1).

Per optimizer step t, at the hook's last bucket, after thresholding, the header exchange and the
skip / dense decision of :func:`gtc_lightning.algorithms.gtc.hook.gtc_hook` (steps 2-4 there, unchanged, with the
step's one host synchronisation):

1. Skip (a non-finite value on some rank): nothing is sent and nothing applied at step t, the
   residuals stay as they were, and the exchange in flight stays pending: it is applied at the next
   step that is not skipped. With an AMP loss scaler the optimizer sees NaN gradients, as without
   ``stale``, so that the scaler backs off at the step that overflowed.
2. Complete the exchange in flight (launched by the last step that was not skipped): wait for it
   and decode it into step t's bucket buffers, which DDP hands to the optimizer. At the first
   compressed step of a fit nothing is in flight: the optimizer gets no gradient (``None``, or
   zeros under an AMP loss scaler, which refuses a step without gradients) and does not move.
3. Launch step t's exchange with ``async_op=True``: the words (with ``coding="rice"`` the
   Golomb-Rice coded bytes, decoded into words when the update is applied), or on a dense-fallback
   step the all-reduce of every rank's residual + gradient (the residuals restart from zero). The
   new residual is committed at once. Step t+1 thresholds into a second message buffer (and a
   second sums buffer) while this step's are still on the wire.

Decoding uses the synchronous mode's kernels and float32 arithmetic, times the loss scale of the
applying step's backward (which the scaler divides out at that step). A vote is worth the tau of
the step that sent it over the world size: with automatic tau (``target_density``) tau moves after
every step, so the exchange in flight keeps its own tau (``tau32`` of its
:class:`~gtc_lightning.algorithms.gtc.inflight.InFlight`, and ``"tau32"`` in a checkpoint's pending
entry). DDP rebuilds its buckets after the first step, under an exchange in flight: its words then
move with their parameters (by name) first.

Where the exchange in flight goes:

- Gradient accumulation: it stays in flight through the next step's accumulation micro-batches.
- Validation between steps sees the parameters without it.
- Checkpoints: it is drained (waited for) and its update saved in the checkpoint's ``"gtc"`` entry as
  a vector in parameter order (vote counts, or the dense sums): the same on every rank, like the
  parameters. A fit that resumes applies it at its first step, bit for bit as the uninterrupted
  run; a fit without ``stale`` that resumes it adds it to every rank's residual, which keeps it.
- End of fit (``on_train_end``, or ``teardown`` after an error): it is drained and **not applied**.
  The parameters after the last step hold every update but the last step's, which stays pending in
  the state and in any checkpoint saved after the fit, and is applied first by a fit that resumes.
- Parameters no rank used in the applying step's backward (``find_unused_parameters``) get no
  gradient from DDP: :meth:`GTCState.finish_step` hands them their part of the update.
- Several optimizers are refused by the strategy: the update would reach whichever optimizer
  steps after the next backward pass.

Statistics of step t describe step t's own exchange (its bytes, counted as the collectives send
them when it is launched); ``exchange_s`` is the host time spent in the header and in waiting for
the exchange in flight (what the overlap did not hide); ``applied`` names the step whose update was
handed to the optimizer.
"""

from __future__ import annotations

import torch

from gtc_lightning.algorithms.common import allreduce_bytes
from gtc_lightning.algorithms.gtc.decode import decode_dense, dense_rounding, sparse_rounding, valid_words
from gtc_lightning.algorithms.gtc.exchange import feed_back, reduce_dense, send_coded, send_words, word_scale
from gtc_lightning.algorithms.gtc.inflight import InFlight
from gtc_lightning.algorithms.gtc.state import GTCState
from gtc_lightning.ops.torch_ops import INDEX_MASK, SIGN_BIT


def exchange_stale(
    state: GTCState,
    pending: list,
    unused: list,
    counts: list[int],
    sizes: list[int],
    numel: int,
    record,
    dense: bool,
) -> None:
    """Steps 2-3 for one optimizer step; completes every Future of ``pending``."""
    clock = state._clock
    outputs = [(offset, bucket.buffer()) for bucket, _, offset in pending]
    previous, state._in_flight = state._in_flight, None
    if previous is not None:
        previous.wait(state.busy)
    exchanged = clock.now()
    if previous is None:
        for _, buffer in outputs:
            buffer.zero_()
    else:
        rounding = _apply(state, previous, outputs)
    state._applied = outputs if previous is not None else []
    if dense:
        state._in_flight, sent, received = _launch_dense(state, unused, counts[state.rank], numel)
    else:
        state._in_flight, sent, received = _launch_sparse(state, counts, sizes)
    if previous is not None:
        feed_back(state, rounding)  # into the residual just committed
    for bucket, future, _ in pending:
        future.set_result(bucket.buffer())
    applied = previous.step if previous is not None else None
    record("dense" if dense else "sparse", sent, received, exchanged, clock.now(), applied=applied)


def _launch_sparse(state: GTCState, counts: list[int], sizes: list[int]) -> tuple[InFlight, int, int]:
    coded = width = own = None
    if state.coding == "rice":  # the coded bytes travel; they are decoded when the update is applied
        words, lengths = None, None
        coded, width, sent, received, work = send_coded(state, sizes, async_op=True)
        own = (state.rank, state._message[: counts[state.rank]].clone())  # the buffer is reused
    else:
        words, lengths, sent, received, work = send_words(state, counts, async_op=True)
    state._residual, state._spare = state._spare, state._residual
    message = state._spare_message
    if message is None or message.shape != state._message.shape or message.device != state._message.device:
        message = torch.empty_like(state._message)
    state._message, state._spare_message = message, state._message
    flight = InFlight(
        step=state.step, kind="sparse", world=state.world_size, tau32=state.tau32, work=work, words=words,
        lengths=lengths, coded=coded, own=own, sizes=sizes if coded is not None else None, width=width,
        slots=state._slots,
    )  # fmt: skip
    return flight, sent, received


def _launch_dense(state: GTCState, unused: list, own: int, numel: int) -> tuple[InFlight, int, int]:
    sums = state._spare
    work = reduce_dense(state, unused, own, numel, async_op=True)
    spare = state._spare_sum
    if spare is None or spare.shape != sums.shape or spare.device != sums.device:
        spare = torch.empty_like(sums)
    state._spare, state._spare_sum = spare, None
    flight = InFlight(
        step=state.step, kind="dense", world=state.world_size, work=work, sums=sums, slots=state._slots
    )
    sent = allreduce_bytes(numel, state.world_size)
    return flight, sent, sent


def _apply(state: GTCState, flight: InFlight, outputs: list) -> list:
    """Decode ``flight`` into the bucket buffers of the step in progress; returns what low-precision
    buckets rounded off (:func:`~gtc_lightning.algorithms.gtc.exchange.feed_back`)."""
    flight.received_words()
    if flight.kind == "sparse" and flight.slots is not None and flight.slots is not state._slots:
        flight.words, flight.lengths = _relayout_words(flight.words, flight.lengths, flight.slots, state._slots)
        flight.slots = state._slots
    if flight.slots is state._slots:  # the layout it was launched in: decode as the synchronous mode
        if flight.kind == "sparse":
            scale = word_scale(state, flight.world, flight.tau32)
            state._ops.decode_(flight.words, flight.lengths, state._counts, outputs, scale)
            return sparse_rounding(flight.words, flight.lengths, outputs, scale, state.grad_scale)
        decode_dense(flight.sums, flight.world, state.grad_scale, outputs)
        state._spare_sum = flight.sums
        return dense_rounding(flight.sums, flight.world, outputs, state.grad_scale)
    flat = torch.zeros(sum(state.numels), dtype=torch.float32, device=state._counts.device)
    for name, n, part in zip(
        state.param_names, state.numels, flight.vector_in(state.param_names, state.numels).split(state.numels)
    ):
        if name in state._slots:
            offset, _ = state._slots[name]
            flat[offset : offset + n].copy_(part)
    if flight.kind == "sparse":
        scale = word_scale(state, flight.world, flight.tau32)
        for offset, buffer in outputs:
            torch.mul(flat[offset : offset + buffer.numel()], scale, out=buffer)
        return dense_rounding(flat * (scale * flight.world / state.grad_scale), flight.world, outputs, state.grad_scale)
    decode_dense(flat, flight.world, state.grad_scale, outputs)
    return dense_rounding(flat, flight.world, outputs, state.grad_scale)


def _relayout_words(words: torch.Tensor, lengths: list[int] | None, old: dict, new: dict) -> tuple:
    """Words indexing the flat layout ``old`` (parameter name -> (offset, numel)) re-indexed for ``new``
    (DDP rebuilt its buckets under the exchange in flight): each word moves with its parameter,
    O(words). Returns ``(words, None)``, all valid, no longer in ascending order (decoding counts
    votes, so the order does not change a bit)."""
    words = valid_words(words, lengths)
    names = sorted((name for name in old if name in new), key=lambda name: old[name][0])
    starts = torch.tensor([old[name][0] for name in names], dtype=torch.int64, device=words.device)
    moved = torch.tensor([new[name][0] for name in names], dtype=torch.int64, device=words.device)
    index = (words & INDEX_MASK).long()
    which = torch.searchsorted(starts, index, right=True) - 1
    index = index - starts[which] + moved[which]
    return index.int() | (words & SIGN_BIT), None
