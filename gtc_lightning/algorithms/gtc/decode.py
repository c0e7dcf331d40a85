"""What every rank does with the words it received, as tensor functions (no state, no collective):
the valid words of a padded all-gather, Golomb-Rice coded messages back into words, a dense
fallback's sums into the buckets, and what a low-precision bucket rounded off."""

import torch

from gtc_lightning.ops.rice import rice_decode, rice_split
from gtc_lightning.ops.torch_ops import INDEX_MASK


def valid_words(words: torch.Tensor, lengths: list[int] | None) -> torch.Tensor:
    """The words of a received exchange back to back: ``words`` as they are when ``lengths`` is None
    (all valid), else the first ``lengths[r]`` of each row ``r`` of a padded all-gather."""
    if lengths is None:
        return words
    rows = words.view(len(lengths), -1)
    return torch.cat([rows[r, :n] for r, n in enumerate(lengths)])


def votes(words: torch.Tensor, numel: int) -> torch.Tensor:
    """``[numel]`` float32 vote counts of ``words`` (all valid): +1 at each word's index, -1 where its
    sign bit is set."""
    flat = torch.zeros(numel, dtype=torch.float32, device=words.device)
    flat.index_add_(0, (words & INDEX_MASK).long(), torch.where(words < 0, -1.0, 1.0).to(torch.float32))
    return flat


def decode_coded(
    data: torch.Tensor,
    sizes: list[int],
    width: int | None,
    own: tuple[int, torch.Tensor] | None = None,
    several: bool = False,
) -> torch.Tensor:
    """The words of every rank's coded message in ``data`` (as :func:`~gtc_lightning.algorithms.gtc.exchange.send_coded` received it), rank
    0's first, as ``send_words`` gives them. ``several``: each rank's part is one or more messages back to
    back (the update mode's ``word_levels``: one per level), decoded one after the other. ``own``: ``(rank, words)``, the words this rank coded itself,
    taken as they are instead of decoding its own message again (the code is lossless: the same words)."""
    if width is None:
        parts = data.split(sizes)
    else:
        parts = [row[:n] for row, n in zip(data.view(len(sizes), width), sizes)]
    rank, words = own if own is not None else (-1, None)
    out = []
    for r, part in enumerate(parts):
        if r == rank:
            out.append(words)
        else:
            out += [rice_decode(message) for message in (rice_split(part) if several else [part])]
    return torch.cat(out)


def decode_dense(sums: torch.Tensor, world: int, grad_scale: float, outputs: list) -> None:
    """Write ``sums / world`` (times the loss scale) into each ``(offset, [n] buffer)`` of ``outputs``."""
    for offset, buffer in outputs:
        torch.div(sums[offset : offset + buffer.numel()], world, out=buffer)
        if grad_scale != 1.0:
            buffer.mul_(grad_scale)


# ---- what a bf16/fp16 bucket cannot hold goes back into the residual ---------------------------------
#
# DDP's buckets have the parameters' dtype: with bf16 or fp16 parameters the decoded update is rounded
# to it. The rounding error ``e`` of an element is the same on every rank (every rank decodes the same
# words); each rank adds it to its residual, so the mean residual, the update still to come, grows by
# exactly what the rounding took off, and conservation holds in low-precision buckets too.


def _low_precision(outputs: list) -> list:
    return [(offset, buffer) for offset, buffer in outputs if buffer.dtype != torch.float32]


def sparse_rounding(
    words: torch.Tensor, lengths: list[int] | None, outputs: list, scale: float, grad_scale: float
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``[(flat index, error)]`` of the elements whose decoded value ``count * scale`` a low-precision
    output rounded, unscaled by the loss scale; O(words), nothing for float32 outputs."""
    low = _low_precision(outputs)
    if not low or not words.numel():
        return []
    words = valid_words(words, lengths)
    index, inverse = torch.unique((words & INDEX_MASK).long(), return_inverse=True)
    votes = torch.zeros(index.numel(), dtype=torch.float32, device=words.device)
    votes.index_add_(0, inverse, torch.where(words < 0, -1.0, 1.0).to(torch.float32))
    exact = votes * scale  # float32, as the decode kernels compute it
    errors = []
    for offset, buffer in low:
        inside = (index >= offset) & (index < offset + buffer.numel())
        at = index[inside]
        error = exact[inside] - buffer[at - offset].float()
        errors.append((at, error / grad_scale if grad_scale != 1.0 else error))
    return errors


def dense_rounding(
    sums: torch.Tensor, world: int, outputs: list, grad_scale: float
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """As :func:`sparse_rounding` for a dense update ``sums / world`` (every element)."""
    errors = []
    for offset, buffer in _low_precision(outputs):
        n = buffer.numel()
        exact = sums[offset : offset + n] / world
        at = torch.arange(offset, offset + n, device=sums.device)
        errors.append((at, exact - buffer.float() / grad_scale))
    return errors
