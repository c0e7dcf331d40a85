"""Pure-torch reference of Strom's threshold compression (the CPU backend).

Same signatures and bit-identical results as the Triton kernels in ``triton_kernels.py``;
inputs are validated by the dispatch layer in ``gtc_lightning.ops`` before either runs.
"""

from __future__ import annotations

import torch

SIGN_BIT = -(1 << 31)  # int32 word with only bit 31 set
INDEX_MASK = (1 << 31) - 1


def compress_reference(grad: torch.Tensor, residual: torch.Tensor, tau: float) -> torch.Tensor:
    """``residual += grad``; emit one word per element whose residual left [-tau, tau].

    Args:
        grad: ``[n]`` float32, finite (checked by the caller).
        residual: ``[n]`` float32, updated in place.
        tau: the threshold, already rounded to float32 by the caller.

    Returns:
        ``[m]`` int32 words in ascending index order: ``i`` for +tau, ``i | 1 << 31`` for -tau.
    """
    residual.add_(grad)
    # |r| > tau is exactly (r > tau or r < -tau): r is never NaN here (grad is finite).
    index = torch.nonzero(residual.abs() > tau).squeeze(1)
    values = residual[index]
    negative = values < 0
    words = index.to(torch.int32)
    words = torch.where(negative, words | SIGN_BIT, words)
    # Only emitted elements are written: the others keep their exact bits (-0.0 too), as in the kernel.
    residual[index] = torch.where(negative, values + tau, values - tau)
    return words


def decompress_reference(words: torch.Tensor, numel: int, scale: float) -> torch.Tensor:
    """Exact integer vote counts per element, then one multiplication by ``scale``.

    Args:
        words: ``[m]`` int32, indices already checked to be ``< numel``.
        numel: length of the output.
        scale: ``tau / divisor`` rounded to float32 by the caller.

    Returns:
        ``[numel]`` float32 ``scale * (#plus - #minus)``.
    """
    index = (words & INDEX_MASK).long()
    votes = torch.where(words < 0, -1, 1).to(torch.int32)
    counts = torch.zeros(numel, dtype=torch.int32, device=words.device).index_add_(0, index, votes)
    return counts.to(torch.float32).mul_(scale)
