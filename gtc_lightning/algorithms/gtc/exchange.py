"""GTC's collectives, as the hook, the stale exchange and the update mode run them: the header every
rank sends every rank, the words (all-to-all of uneven messages on gloo, where it was measured faster
than padding to the longest; a padded all-gather elsewhere), the Golomb-Rice coded bytes, and the
dense fallback's all-reduce; what one vote is worth, and where the rounding of a low-precision bucket
goes back into the residual. Bytes are counted as the collectives put them on the wire per rank."""

from __future__ import annotations

import torch
import torch.distributed as dist

from gtc_lightning.algorithms.common import all_gather_equal, finish
from gtc_lightning.algorithms.gtc.config import WORD_BYTES, f32
from gtc_lightning.algorithms.gtc.state import GTCState


def exchange_kind(state: GTCState) -> str:
    """``state.exchange``, with ``"auto"`` resolved: all-to-all on gloo, all-gather elsewhere."""
    if state.exchange != "auto":
        return state.exchange
    return "alltoall" if dist.get_backend(state.process_group) == "gloo" else "allgather"


def send_header(state: GTCState, header: torch.Tensor) -> torch.Tensor:
    """Step 3's collective: every rank's ``[h]`` int64 header to every rank, ``[world * h]`` in rank
    order. With the all-to-all exchange (gloo) the header goes by all-to-all too: each rank
    sends its header to each peer at once, one message latency, where gloo's all-gather is a ring of
    world - 1 latencies in a row (``gtc_lightning.tools.bench_exchange`` on 4 emulated nodes at 1 Gbit/s:
    header and 13,000 words a step in 3.1 against 5.5 ms).
    """
    world = state.world_size
    if world == 1:
        return header
    headers = torch.empty(world * header.numel(), dtype=torch.int64, device=header.device)
    if exchange_kind(state) == "alltoall":
        work = dist.all_to_all_single(headers, header.repeat(world), group=state.process_group, async_op=True)
    else:
        work = all_gather_equal(headers, header, group=state.process_group, async_op=True)
    finish(work, state.busy)
    return headers


def send_words(state: GTCState, counts: list[int], async_op: bool = False) -> tuple:
    """Step 5's collective: every rank's words to every rank (all-to-all of uneven messages, or an
    all-gather padded to the longest).

    Args:
        state: the state; its message holds this rank's ``counts[rank]`` words.
        counts: words of every rank, from the headers.
        async_op: launch and return the handle instead of waiting (``stale=True``).

    Returns:
        ``(words, lengths, bytes sent, bytes received, work)``: ``words`` ``[sum(counts)]`` all valid
        (``lengths`` None) or ``[W * max(counts)]`` with ``lengths = counts`` valid per row; ``work``
        the collective's handle when ``async_op`` (None when nothing had to be sent).
    """
    group, world, rank = state.process_group, state.world_size, state.rank
    own, message = counts[rank], state._message
    if world == 1 or not sum(counts):
        return message[:own], None, 0, 0, None
    if exchange_kind(state) == "alltoall":
        words = torch.empty(sum(counts), dtype=torch.int32, device=message.device)
        work = dist.all_to_all_single(
            words, message[:own].repeat(world), output_split_sizes=counts, input_split_sizes=[own] * world,
            group=group, async_op=True,
        )  # fmt: skip
        return words, None, (world - 1) * own * WORD_BYTES, (sum(counts) - own) * WORD_BYTES, _handed(work, state, async_op)
    width = max(counts)
    words = torch.empty(world * width, dtype=torch.int32, device=message.device)
    work = all_gather_equal(words, message[:width], group=group, async_op=True)
    sent = (world - 1) * width * WORD_BYTES
    return words, counts, sent, sent, _handed(work, state, async_op)


def send_coded(state: GTCState, sizes: list[int], async_op: bool = False) -> tuple:
    """Step 5 with ``coding="rice"``: every rank's Golomb-Rice coded message (``sizes`` bytes each)
    to every rank (all-to-all of uneven messages, or an all-gather padded to the longest).

    Returns:
        ``(data, width, bytes sent, bytes received, work)``: ``data`` the received bytes, laid out as
        :func:`~gtc_lightning.algorithms.gtc.decode.decode_coded` reads them with ``sizes`` and ``width`` (None: back to back, else rows
        of ``width``); ``work`` the collective's handle when ``async_op`` (None when nothing was sent).
    """
    group, world, rank = state.process_group, state.world_size, state.rank
    coded, own = state._coded, sizes[rank]
    if world == 1:
        return coded, None, 0, 0, None
    if exchange_kind(state) == "alltoall":
        data = torch.empty(sum(sizes), dtype=torch.uint8, device=coded.device)
        work = dist.all_to_all_single(
            data, coded.repeat(world), output_split_sizes=sizes, input_split_sizes=[own] * world, group=group,
            async_op=True,
        )  # fmt: skip
        return data, None, (world - 1) * own, sum(sizes) - own, _handed(work, state, async_op)
    width = max(sizes)
    padded = torch.zeros(width, dtype=torch.uint8, device=coded.device)
    padded[:own] = coded
    data = torch.empty(world * width, dtype=torch.uint8, device=coded.device)
    work = all_gather_equal(data, padded, group=group, async_op=True)
    sent = (world - 1) * width
    return data, width, sent, sent, _handed(work, state, async_op)


def _handed(work, state: GTCState, async_op: bool):
    """The handle, for the caller to wait on (``async_op``); else waited for here, and None."""
    if async_op:
        return work
    finish(work, state.busy)
    return None


def word_scale(state: GTCState, world: int, tau32: float | None = None) -> float:
    """What one vote is worth in the bucket: ``tau / world`` in float32, times the loss scale;
    ``tau32``: the float32 tau the words were thresholded with, when not the state's (``stale=True``
    with automatic tau applies a step's words after tau moved)."""
    return f32(f32((state.tau32 if tau32 is None else tau32) / world) * state.grad_scale)


def reduce_dense(state: GTCState, unused: list, own: int, numel: int, async_op: bool = False):
    """The fallback's collective: sum every rank's residual + gradient (the spare buffer) over the
    ranks, and restart the residuals at zero (those of parameters this rank did not use excepted).

    Returns:
        the all-reduce's handle when ``async_op``, else None.
    """
    residual, spare = state._residual, state._spare
    # Take back the tau the threshold pass subtracted at this rank's words (exact up to one rounding).
    state._ops.apply_words_(spare, state._message[:own], -state.tau32)
    for a, b in unused:
        spare[a:b].zero_()
    work = dist.all_reduce(spare[:numel], group=state.process_group, async_op=True)
    kept = [(a, b, residual[a:b].clone()) for a, b in unused]
    residual.zero_()
    for a, b, values in kept:
        residual[a:b].copy_(values)
    return _handed(work, state, async_op)


def feed_back(state: GTCState, errors: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Add the rounding errors to the committed residual (call once the step's residual is committed)."""
    for at, error in errors:
        state._residual.index_add_(0, at, error)
