"""The torch backend of the hook's step primitives (CPU tensors; any device torch runs on).

The DDP hook does not call ``compress`` / ``decompress``: those allocate and run a pass per
operation, which on this project's CPUs costs far more than the arithmetic (a fresh 58 MB tensor
faults in its pages; ``isfinite(x).all()`` alone is slower than the whole compression). A step is
instead two primitives over kept buffers, with as few passes over the n elements as torch allows:

1. ``threshold_``: ``out = residual + grad`` into a second buffer (loss scale and value clipping
   folded in; the old residual stays intact, so a skipped step needs no undo); then per row of
   32 elements an ``amax`` and an ``amin`` (two read passes, no n-sized writes) find the rows that
   hold an element beyond ``±tau`` or a NaN/Inf; only those rows are gathered and searched, and
   ``±tau`` is subtracted by one scattered add at the words. On CPU tensors NumPy does the same
   search over all elements at once (``_emit_cpu``: its comparison and ``flatnonzero`` beat
   torch's reductions and ``nonzero`` there), with bit-identical words and residual. On the float bits,
   ``bits & 0x7fffffff`` orders like ``|x|`` and puts NaN/Inf above every finite tau, so
   non-finite values are counted among the candidates at O(rows hit) cost.
2. ``decode_``: votes of all ranks' words into a kept all-zero float32 ``counts`` buffer (+-1
   adds exactly in any order), each output written as ``count * scale`` in one pass, then
   ``counts`` cleared: every rank decodes bit-identical values.

``apply_words_`` adds or takes back ``±tau`` at this rank's words (the dense fallback undoes the
subtraction with it). The Triton twins in ``triton_kernels.py`` have the same signatures and
bit-identical results.
"""

from __future__ import annotations

import numpy as np
import torch

SIGN_BIT = -(1 << 31)  # int32 word with only bit 31 set
INDEX_MASK = (1 << 31) - 1
ABS_MASK = 0x7FFFFFFF  # clears the float sign bit
INF_BITS = 0x7F800000  # |bits| of +-Inf; NaN is above it
CHUNK = 32  # elements per candidate chunk (measured fastest of 8-64 at 1.5 M and 14.6 M elements)


def tau_bits(tau32: float) -> int:
    """The int32 bit pattern of the float32 ``tau32`` (> 0): ``|x| > tau`` iff ``abs bits > this``."""
    return int(torch.tensor(tau32, dtype=torch.float32).view(torch.int32))


def _emit(block: torch.Tensor, first: torch.Tensor, width: int, tau32: float) -> tuple:
    """Words of the candidate rows gathered in ``block``.

    Args:
        block: ``[h * width]`` float32, ``h`` rows of the new residual (a copy).
        first: ``[h]`` int64 flat index of each row's first element.
        width: elements per row.
        tau32: the threshold.

    Returns:
        ``(index, negative, words, non-finite count)``: ``[m]`` int64 ascending flat indices, their
        signs, ``[m]`` int32 words without offset.
    """
    bits = block.view(torch.int32) & ABS_MASK  # orders like |x|; NaN/Inf above every finite tau
    pos = torch.nonzero(bits > tau_bits(tau32)).squeeze(1)
    nonfinite = int((bits[pos] >= INF_BITS).sum()) if pos.numel() else 0
    negative = block[pos] < 0
    index = first[pos // width] + pos % width
    words = torch.where(negative, index.to(torch.int32) | SIGN_BIT, index.to(torch.int32))
    return index, negative, words, nonfinite


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
) -> None:
    """``out = residual + alpha * clamp(grad, -clip, clip)``; emit the words of ``|out| > tau``
    and subtract ``±tau`` there.

    Args:
        grad: ``[n]`` float32 or half; clamped in place when ``clip`` is set, else only read.
        residual: ``[n]`` float32, read only (so that a skipped step needs no undo).
        out: ``[n]`` float32, receives the new residual.
        tau32: threshold, a float32 value > 0.
        message: ``[capacity]`` int32; the words go to ``message[cursor:]`` in ascending order,
            ``(offset + i) | sign << 31``.
        cursor: ``[1]`` int64, advanced by the number of words.
        bad: ``[1]`` int32, increased by the number of non-finite elements of ``out``.
        offset: index of element 0 in the step's flat index space.
        alpha: factor on the gradient (1 / loss scale, times a norm-clipping coefficient).
        clip: clamp the gradient to ``[-clip, clip]`` first (in the gradient's own scale).
    """
    if clip is not None:
        grad.clamp_(-clip, clip)
    if alpha == 1.0:
        torch.add(residual, grad, out=out)
    else:
        torch.add(residual, grad, alpha=alpha, out=out)
    emit_(out, tau32, message, cursor, bad, offset)


def emit_(
    out: torch.Tensor, tau32: float, message: torch.Tensor, cursor: torch.Tensor, bad: torch.Tensor, offset: int = 0
) -> None:
    """The second half of :func:`threshold_` on a residual that already holds residual + gradient:
    emit the words of ``|out| > tau`` and subtract ``±tau`` there, in place (arguments as there).

    The simulator (``gtc_lightning.tools.simulate``) lets autograd add each worker's gradient into its
    residual, so that no gradient is flattened or added a second time.
    """
    if out.device.type == "cpu" and out.dtype == torch.float32 and out.is_contiguous():
        _emit_cpu(out, tau32, message, cursor, bad, offset)
    else:
        _emit_rows(out, tau32, message, cursor, bad, offset)


def find_words(values: torch.Tensor, tau32: float) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The words :func:`emit_` would emit for ``values`` (``|x| > tau``, ascending, ``index | sign << 31``),
    without writing to ``values``: for a caller that takes other values than ``±tau`` off its residual
    (the compressed block sync), so that it need not copy the residual first.

    Returns:
        ``(index [m] int64, words [m] int32, non-finite elements among them)``.
    """
    if values.device.type == "cpu" and values.dtype == torch.float32 and values.is_contiguous():
        index, _, negative, nonfinite = _find_cpu(values.detach().numpy(), tau32)
        words = index.astype(np.int32)
        words[negative] |= np.int32(SIGN_BIT)
        return torch.from_numpy(index), torch.from_numpy(words), nonfinite
    first = torch.zeros(1, dtype=torch.int64, device=values.device)
    index, _, words, nonfinite = _emit(values.reshape(-1), first, max(values.numel(), 1), tau32)
    return index, words, nonfinite


def _emit_rows(
    out: torch.Tensor, tau32: float, message: torch.Tensor, cursor: torch.Tensor, bad: torch.Tensor, offset: int
) -> None:
    """:func:`emit_` in torch operations alone (any device): the rows of :data:`CHUNK` elements that
    hold a word are found by two reductions, then only they are searched."""
    n = out.numel()
    full = n // CHUNK * CHUNK
    found = []
    if full:
        rows = out[:full].view(-1, CHUNK)
        # A row holds a word (or a NaN/Inf) unless every element is within [-tau, tau]: two read
        # passes of reductions, cheaper than writing |x| or a mask of n elements.
        hit = torch.nonzero(~((rows.amax(dim=1) <= tau32) & (rows.amin(dim=1) >= -tau32))).squeeze(1)
        if hit.numel():
            found.append(_emit(rows.index_select(0, hit).view(-1), hit * CHUNK, CHUNK, tau32))
    if full < n:
        first = torch.full((1,), full, dtype=torch.int64, device=out.device)
        found.append(_emit(out[full:], first, n - full, tau32))
    if not found:
        return
    columns = list(zip(*found))  # the rows' results, then the tail's
    index, negative, words = (c[0] if len(c) == 1 else torch.cat(c) for c in columns[:3])
    nonfinite = sum(columns[3])
    if nonfinite:
        bad += nonfinite
    m = words.numel()
    if m:
        # r + (-tau) is r - tau to the bit: one scattered add over the words' elements only.
        out.index_add_(0, index, torch.where(negative, tau32, -tau32).to(out.dtype))
        start = int(cursor)
        message[start : start + m] = words + offset if offset else words
        cursor += m


def _find_cpu(values: np.ndarray, tau32: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """``|values| > tau`` on a float32 array: (ascending indices, the values there, their signs, non-finite count)."""
    bits = values.view(np.int32) & ABS_MASK  # orders like |x|; NaN/Inf above every finite tau
    index = np.flatnonzero(bits > tau_bits(tau32))
    hit = values[index]
    return index, hit, hit < 0, int(np.count_nonzero(bits[index] >= INF_BITS))


def _emit_cpu(
    out: torch.Tensor, tau32: float, message: torch.Tensor, cursor: torch.Tensor, bad: torch.Tensor, offset: int
) -> None:
    """:func:`emit_` on a contiguous float32 CPU tensor, through NumPy: the same words, counts and
    residual to the bit. NumPy's comparison and ``flatnonzero`` over all elements beat torch's row
    search on this project's CPUs (``torch.nonzero`` scans a bool tensor at about a third of
    ``np.flatnonzero``'s speed): in the recipe's 2-rank ``gtc`` run (update mode, 1.55 M weights, 1 %
    of them sent a step) the compress step took 5.1 ms a step against 6.2 ms."""
    values = out.detach().numpy()
    index, hit, negative, nonfinite = _find_cpu(values, tau32)
    m = index.size
    if not m:
        return
    if nonfinite:
        bad += nonfinite
    # r + (-tau) is r - tau to the bit, as in the row search's scattered add
    values[index] = hit + np.where(negative, np.float32(tau32), np.float32(-tau32))
    words = (index + offset).astype(np.int32)
    words[negative] |= np.int32(SIGN_BIT)
    start = int(cursor)
    message[start : start + m] = torch.from_numpy(words)
    cursor += m


def apply_words_(residual: torch.Tensor, words: torch.Tensor, tau32: float) -> None:
    """``residual[i] -= tau`` for a word ``i``, ``+= tau`` for ``i | 1 << 31`` (one word per index);
    a negative ``tau32`` undoes what ``threshold_`` subtracted (up to rounding).

    Args:
        residual: ``[N]`` float32, the step's flat residual; updated in place.
        words: ``[m]`` int32, this rank's words (indices into ``residual``).
        tau32: the threshold the words were emitted with.
    """
    if not words.numel():
        return
    index = (words & INDEX_MASK).long()
    residual.index_add_(0, index, torch.where(words < 0, tau32, -tau32).to(residual.dtype))


COUNTS_DTYPE = torch.float32  # vote counts as float32: exact integers (|count| < 2**24)


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
        counts: ``[N]`` :data:`COUNTS_DTYPE`, all zero on entry and on return. Votes of +-1 add
            up exactly in float32 in any order, and ``float32(count) * scale`` is then one
            multiplication, as in the int32 counts of the reference and the Triton kernels.
        outputs: ``(offset, [n] float tensor)`` pairs, written entirely.
        scale: ``tau / world_size`` (times a loss scale), as a float32 value.
    """
    if lengths is not None:
        width = words.numel() // max(len(lengths), 1)
        rows = words.view(len(lengths), width) if width else words.view(len(lengths), 0)
        words = torch.cat([rows[r, :n] for r, n in enumerate(lengths)])
    index = (words & INDEX_MASK).long()
    counts.index_add_(0, index, torch.where(words < 0, -1.0, 1.0).to(counts.dtype))
    for offset, out in outputs:
        torch.mul(counts[offset : offset + out.numel()], scale, out=out)
    if index.numel() * 8 > counts.numel():
        counts.zero_()  # a memset beats scattered writes when the words are dense
    else:
        counts.index_fill_(0, index, 0)
