"""The update mode's step primitives (:mod:`gtc_lightning.algorithms.gtc.update`), torch and NumPy.

After a rank's optimizer stepped, each parameter's step goes into the residual and the parameter back
to the copy kept before the step ("fold"); then the residual's words are emitted at this rank's
threshold. :func:`fold_` and :func:`~gtc_lightning.ops.torch_ops.emit_` do it in separate passes
(the reference); :func:`fold_emit_` does both in one pass over the parameter, in chunks whose
temporaries stay in the CPU's cache, with the same words, residual and parameter to the bit.
:func:`fold_at` gives the folded residual at a sample of elements before any of it is written, so
that the threshold is known before the one pass. :func:`apply_words_` moves a parameter by the
decoded update at the words' elements only. On CUDA, :func:`fold_emit_` runs its Triton twin
(``triton_kernels.fold_emit_``).

The arithmetic of the fold is fixed so that every form gives the same bits: ``t = kept - param``,
``t = t * f32(1 / lr)``, ``residual = residual + t``, each rounded to float32 (no fused multiply-add).
"""

from __future__ import annotations

import numpy as np
import torch

from gtc_lightning.ops import step_ops, torch_ops
from gtc_lightning.ops.torch_ops import ABS_MASK, INF_BITS, SIGN_BIT, emit_, tau_bits

FOLD_CHUNK = 1 << 16  # elements per chunk of the one-pass fold: its temporaries (~200 kB) stay in L2


def inverse_rate(lr: float) -> float:
    """``1 / lr`` rounded to float32: the factor every form of the fold multiplies by."""
    return float(np.float32(1.0 / lr))


def fold_(param: torch.Tensor, kept: torch.Tensor, residual: torch.Tensor, lr: float) -> None:
    """``residual += (kept - param) / lr``; then ``param = kept`` exactly.

    Args:
        param: the parameter after its optimizer's step (``n`` elements), any float dtype.
        kept: ``[n]`` float32, the parameter before the step (in the parameter's element order).
        residual: ``[n]`` float32, updated in place.
        lr: the learning rate of the step (> 0).
    """
    inv = inverse_rate(lr)
    kept, residual = kept.view_as(param), residual.view_as(param)
    if param.dtype == torch.float32:
        step = param.sub_(kept).neg_()  # kept - param, in place (negation is exact)
    else:
        step = kept - param.float()
    residual.add_(step.mul_(inv))
    param.copy_(kept)


def fold_at(
    parts: list[tuple[torch.Tensor, int, float]], kept: torch.Tensor, residual: torch.Tensor, index: torch.Tensor
) -> torch.Tensor:
    """What :func:`fold_` would leave in the flat ``residual`` at the elements ``index``, without writing
    anything.

    Args:
        parts: ``(parameter, its offset in the flat buffers, its learning rate)``, ascending offsets.
        kept: ``[N]`` float32, the flat copy of the parameters kept before the step.
        residual: ``[N]`` float32, the flat residual.
        index: ``[m]`` int64, ascending, each within some part's range.

    Returns:
        ``[m]`` float32 (on CPU through NumPy's ``take``: a third of torch's indexing time for the sample).
    """
    edges = torch.tensor([[offset, offset + param.numel()] for param, offset, _ in parts]).view(-1)
    bounds = torch.searchsorted(index, edges.to(index.device)).tolist()
    if index.device.type == "cpu" and all(p.dtype == torch.float32 and p.is_contiguous() for p, _, _ in parts):
        at = index.numpy()
        step = np.take(kept.numpy(), at)
        rates = np.empty(at.size, dtype=np.float32)
        for j, (param, offset, lr) in enumerate(parts):
            a, b = bounds[2 * j], bounds[2 * j + 1]
            step[a:b] -= np.take(param.detach().reshape(-1).numpy(), at[a:b] - offset)
            rates[a:b] = inverse_rate(lr)
        np.multiply(step, rates, out=step)
        return torch.from_numpy(np.add(np.take(residual.numpy(), at), step, out=step))
    values = []
    for j, (param, offset, lr) in enumerate(parts):
        at = index[bounds[2 * j] : bounds[2 * j + 1]]
        step = kept[at] - param.reshape(-1)[at - offset].float()
        values.append(residual[at] + step.mul_(inverse_rate(lr)))
    return torch.cat(values)


def fold_emit_(
    param: torch.Tensor,
    kept: torch.Tensor,
    residual: torch.Tensor,
    lr: float,
    tau32: float,
    message: torch.Tensor,
    cursor: torch.Tensor,
    bad: torch.Tensor,
    offset: int = 0,
    backend: str = "auto",
) -> None:
    """:func:`fold_` then :func:`~gtc_lightning.ops.torch_ops.emit_` at ``tau32``: the words of
    ``|residual| > tau`` go to ``message[cursor:]`` as ``(offset + i) | sign << 31``, ``±tau`` is
    subtracted there, NaN/Inf are counted in ``bad``.

    ``message`` may share memory with ``kept`` (the update mode writes its words over the kept copy):
    a chunk's words land below the chunk's end, and each chunk reads its ``kept`` before they do.

    On a contiguous float32 CPU parameter this is one pass of chunks through NumPy (:data:`FOLD_CHUNK`
    elements each); elsewhere the two passes of the reference. CUDA tensors go to the Triton twin
    (``triton_kernels.fold_emit_``: one kernel, the words gathered on the device, no host sync), as
    :func:`~gtc_lightning.ops.step_ops` picks: ``backend`` ``"auto"`` (Triton on CUDA), ``"torch"``
    (this module's passes on any device) or ``"triton"`` (on CPU only under ``TRITON_INTERPRET=1``).
    """
    ops = step_ops(param.device, backend)
    if ops is not torch_ops:
        ops.fold_emit_(param, kept, residual, lr, tau32, message, cursor, bad, offset)
        return
    fused = (
        param.device.type == "cpu"
        and param.dtype == kept.dtype == residual.dtype == torch.float32
        and param.is_contiguous() and kept.is_contiguous() and residual.is_contiguous()
    )  # fmt: skip
    if not fused:
        fold_(param, kept, residual, lr)
        emit_(residual, tau32, message, cursor, bad, offset)
        return
    p, k, r = param.detach().reshape(-1).numpy(), kept.numpy(), residual.numpy()
    words_out = message.numpy()
    inv, limit = np.float32(inverse_rate(lr)), tau_bits(tau32)
    plus, minus = np.float32(tau32), np.float32(-tau32)
    n = p.size
    step = np.empty(min(n, FOLD_CHUNK), dtype=np.float32)
    above = np.empty(min(n, FOLD_CHUNK), dtype=np.bool_)
    start = count = int(cursor)
    nonfinite = 0
    for a in range(0, n, FOLD_CHUNK):
        b = min(n, a + FOLD_CHUNK)
        t, r_chunk = step[: b - a], r[a:b]
        np.subtract(k[a:b], p[a:b], out=t)
        np.multiply(t, inv, out=t)
        np.add(r_chunk, t, out=r_chunk)
        p[a:b] = k[a:b]
        bits = t.view(np.int32)  # |r| as ordered bits (NaN/Inf above every finite tau), into the free temporary
        np.bitwise_and(r_chunk.view(np.int32), ABS_MASK, out=bits)
        hit = np.flatnonzero(np.greater(bits, limit, out=above[: b - a]))
        if not hit.size:
            continue
        nonfinite += int(np.count_nonzero(bits[hit] >= INF_BITS))
        values = r_chunk[hit]
        negative = values < 0
        r_chunk[hit] = values + np.where(negative, plus, minus)  # r + (-tau) is r - tau to the bit
        words = (hit + (offset + a)).astype(np.int32)
        words[negative] |= np.int32(SIGN_BIT)
        words_out[count : count + hit.size] = words
        count += hit.size
    if nonfinite:
        bad += nonfinite
    if count != start:
        cursor += count - start


def apply_words_(
    param: torch.Tensor, update: torch.Tensor, index: torch.Tensor, lr: float
) -> None:
    """``param -= lr * update`` at the elements ``index`` only (``[m]`` int64 into the flat parameter,
    repeats allowed: each repeat writes the same value), contiguous float32 parameters.

    Args:
        param: the parameter, float32.
        update: ``[m]`` float32, the decoded update at ``index``.
        index: ``[m]`` int64.
        lr: the learning rate.
    """
    flat = param.detach().view(-1)
    flat.index_put_((index,), torch.add(flat[index], update, alpha=-lr))
