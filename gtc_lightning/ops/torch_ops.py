"""The torch backend of the hook's step primitives (CPU tensors; any device torch runs on).

The DDP hook does not call ``compress`` / ``decompress``: those allocate and run a pass per
operation, which on this project's CPUs costs far more than the arithmetic (a fresh 58 MB tensor
faults in its pages; ``isfinite(x).all()`` alone is slower than the whole compression). A step is
instead three primitives over kept buffers, each as few passes over the n elements as torch allows:

1. ``threshold_``: ``out = residual + grad`` (loss scale and value clipping folded in), then the
   words of the elements with ``|out| > tau``, appended to a message at a cursor. The search runs
   on the float bits: ``bits & 0x7fffffff`` orders like ``|x|`` and puts NaN/Inf above every finite
   tau, so non-finite elements are always among the candidates and are counted there, at O(words)
   cost. Candidates are found per chunk of 32 with an integer ``amax`` (one read pass), and only
   chunks above tau are searched element by element: ~2.5x faster than ``nonzero`` over the mask.
   ``tau`` is *not* subtracted yet: the step may still be skipped or go dense.
2. ``apply_words_``: subtract ``±tau`` where this rank's words were emitted (O(words)).
3. ``decode_``: integer votes of all ranks' words into a kept all-zero ``counts`` buffer, each
   output written as ``float(count) * scale``, then ``counts`` cleared at the words (O(words)):
   exact in any word order, so every rank decodes bit-identical values.

The Triton twins in ``triton_kernels.py`` have the same signatures and bit-identical results.
"""

from __future__ import annotations

import torch

SIGN_BIT = -(1 << 31)  # int32 word with only bit 31 set
INDEX_MASK = (1 << 31) - 1
ABS_MASK = 0x7FFFFFFF  # clears the float sign bit
INF_BITS = 0x7F800000  # |bits| of +-Inf; NaN is above it
CHUNK = 32  # elements per candidate chunk (measured fastest of 8-64 at 1.5 M and 14.6 M elements)


def tau_bits(tau32: float) -> int:
    """The int32 bit pattern of the float32 ``tau32`` (> 0): ``|x| > tau`` iff ``abs bits > this``."""
    return int(torch.tensor(tau32, dtype=torch.float32).view(torch.int32))


def _above(bits: torch.Tensor, limit: int) -> torch.Tensor:
    """``[m]`` int64 ascending positions where ``bits > limit`` (``bits``: ``[n]`` int32)."""
    n = bits.numel()
    full = n // CHUNK * CHUNK
    parts = []
    if full:
        rows = bits[:full].view(-1, CHUNK)
        hit = torch.nonzero(rows.amax(dim=1) > limit).squeeze(1)
        if hit.numel():
            row, col = torch.nonzero(rows.index_select(0, hit) > limit, as_tuple=True)
            parts.append(hit[row] * CHUNK + col)
    if full < n:
        parts.append(torch.nonzero(bits[full:] > limit).squeeze(1) + full)
    if not parts:
        return torch.zeros(0, dtype=torch.int64, device=bits.device)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def threshold_(
    grad: torch.Tensor,
    residual: torch.Tensor,
    out: torch.Tensor,
    tau32: float,
    message: torch.Tensor,
    cursor: torch.Tensor,
    bad: torch.Tensor,
    offset: int = 0,
    alpha: float = 1.0,
    clip: float | None = None,
    scratch: torch.Tensor | None = None,
) -> None:
    """``out = residual + alpha * clamp(grad, -clip, clip)``; append the words of ``|out| > tau``.

    Args:
        grad: ``[n]`` float32 (or half; then ``scratch`` is needed); clamped in place when
            ``clip`` is set, and overwritten as scratch when float32 and ``scratch`` is None.
        residual: ``[n]`` float32, read only.
        out: ``[n]`` float32, receives the new residual *before* tau is subtracted.
        tau32: threshold, a float32 value > 0.
        message: ``[capacity]`` int32; the words go to ``message[cursor:]`` in ascending order,
            ``(offset + i) | sign << 31``.
        cursor: ``[1]`` int64, advanced by the number of words.
        bad: ``[1]`` int32, increased by the number of non-finite elements of ``out``.
        offset: index of element 0 in the step's flat index space.
        alpha: factor on the gradient (1 / loss scale, times a norm-clipping coefficient).
        clip: clamp the gradient to ``[-clip, clip]`` first (in the gradient's own scale).
        scratch: ``[n]`` int32 to use instead of ``grad``'s memory.
    """
    if clip is not None:
        grad.clamp_(-clip, clip)
    if alpha == 1.0:
        torch.add(residual, grad, out=out)
    else:
        torch.add(residual, grad, alpha=alpha, out=out)
    if scratch is None:
        scratch = grad.view(torch.int32)
    bits = torch.bitwise_and(out.view(torch.int32), ABS_MASK, out=scratch)
    index = _above(bits, tau_bits(tau32))
    m = index.numel()
    if not m:
        return
    nonfinite = int((bits[index] >= INF_BITS).sum())
    if nonfinite:
        bad += nonfinite
    words = (index + offset).to(torch.int32)
    words = torch.where(out[index] < 0, words | SIGN_BIT, words)
    start = int(cursor)
    message[start : start + m] = words
    cursor += m


def apply_words_(residual: torch.Tensor, words: torch.Tensor, tau32: float) -> None:
    """``residual[i] -= tau`` for a word ``i``, ``+= tau`` for ``i | 1 << 31`` (one word per index).

    Args:
        residual: ``[N]`` float32, the step's flat residual; updated in place.
        words: ``[m]`` int32, this rank's words (indices into ``residual``).
        tau32: the threshold the words were emitted with.
    """
    if not words.numel():
        return
    index = (words & INDEX_MASK).long()
    values = residual[index]
    residual[index] = torch.where(words < 0, values + tau32, values - tau32)


def decode_(
    words: torch.Tensor,
    lengths: list[int] | None,
    counts: torch.Tensor,
    outputs: list[tuple[int, torch.Tensor]],
    scale: float,
) -> None:
    """Decode all ranks' words into ``outputs``: ``out[j] = scale * (#plus - #minus)`` of index
    ``offset + j``.

    Args:
        words: ``[W * width]`` int32 (rank r's words in row r, ``lengths[r]`` valid) or, with
            ``lengths=None``, ``[m]`` int32 words, all valid.
        lengths: valid words per row, or None.
        counts: ``[N]`` int32, all zero on entry and on return (cleared at the words).
        outputs: ``(offset, [n] float tensor)`` pairs, written entirely.
        scale: ``tau / world_size`` (times a loss scale), as a float32 value.
    """
    if lengths is not None:
        width = words.numel() // max(len(lengths), 1)
        rows = words.view(len(lengths), width) if width else words.view(len(lengths), 0)
        words = torch.cat([rows[r, :n] for r, n in enumerate(lengths)])
    index = (words & INDEX_MASK).long()
    counts.index_add_(0, index, torch.where(words < 0, -1, 1).to(torch.int32))
    for offset, out in outputs:
        out.copy_(counts[offset : offset + out.numel()])
        out.mul_(scale)
    counts.index_fill_(0, index, 0)
