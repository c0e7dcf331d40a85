"""Public ops: ``compress`` and ``decompress``, and the one dispatch point for both backends.

CUDA tensors run the Triton kernels (``triton_kernels.py``); CPU tensors run the pure-torch
reference (``reference.py``). Both give bit-identical results. Argument validation lives here;
the non-finite check of ``grad`` lives in each backend (the Triton one fuses it on the GPU).

The DDP hook uses the step primitives ``threshold_``, ``apply_words_`` and ``decode_`` over kept
buffers instead (``torch_ops.py`` and their Triton twins); :func:`step_ops` picks the backend.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from gtc_lightning.ops.reference import compress_reference, decompress_reference

MAX_NUMEL = (1 << 31) - 1  # a word holds a 31-bit index

__all__ = ["BACKENDS", "MAX_NUMEL", "compress", "compress_torch", "decompress", "step_ops", "use_triton"]

BACKENDS = ("auto", "torch", "triton")


def _fp32(value: float) -> float:
    with np.errstate(over="ignore"):  # 1e39 becomes inf, which _check_tau reports
        return float(np.float32(value))


def _check_tau(tau: float) -> float:
    if not isinstance(tau, (int, float)) or isinstance(tau, bool) or not math.isfinite(tau) or tau <= 0:
        raise ValueError(f"tau must be a finite number > 0, got {tau!r}")
    tau32 = _fp32(tau)
    if tau32 <= 0 or not math.isfinite(tau32):
        raise ValueError(f"tau={tau!r} is not representable as a positive float32")
    return tau32


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` goes to the Triton backend (CUDA tensors do, CPU tensors don't)."""
    return tensor.is_cuda


def step_ops(device: torch.device, backend: str = "auto"):
    """The module holding the step primitives for ``device``: Triton on CUDA, torch elsewhere.

    Args:
        device: where the gradients live.
        backend: ``"auto"``, or force ``"torch"`` or ``"triton"`` (on CPU only under
            ``TRITON_INTERPRET=1``, for tests).

    Returns:
        ``gtc_lightning.ops.torch_ops`` or ``gtc_lightning.ops.triton_kernels``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"Expect backend in {BACKENDS}, got {backend!r}")
    if backend == "torch" or (backend == "auto" and device.type != "cuda"):
        from gtc_lightning.ops import torch_ops

        return torch_ops
    from gtc_lightning.ops import triton_kernels

    if device.type != "cuda" and not triton_kernels.INTERPRETED:
        raise ValueError(
            f"backend='triton' needs CUDA tensors, got {device}; on CPU the Triton kernels run only "
            "under TRITON_INTERPRET=1 (set before triton is imported), for tests"
        )
    return triton_kernels


def _check_vector(name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")  # noqa: TRY004
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}; flatten it first")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous; call .contiguous() first")


def compress(grad: torch.Tensor, residual: torch.Tensor, tau: float) -> torch.Tensor:
    """Add ``grad`` into ``residual`` and emit a word for each element beyond ``±tau``.

    In place: ``residual += grad``; for each ``i`` with ``residual[i] > tau`` emit ``i`` and
    subtract ``tau``; with ``residual[i] < -tau`` emit ``i | 1 << 31`` (a negative int32) and
    add ``tau``. Strict comparisons, at most one word per element, ascending index order.

    Args:
        grad: ``[n]`` float32, contiguous, finite.
        residual: ``[n]`` float32, contiguous, same device as ``grad``; updated in place.
        tau: threshold > 0 (rounded to float32, as the arithmetic is float32).

    Returns:
        ``[m]`` int32 words, ``0 <= m <= n``.

    Raises:
        ValueError: bad tau, dtype, shape, device, contiguity or size; a non-finite element
            in ``grad`` (then ``residual`` is left exactly as it was).
    """
    tau32 = _check_tau(tau)
    _check_vector("grad", grad, torch.float32)
    _check_vector("residual", residual, torch.float32)
    if grad.numel() != residual.numel():
        raise ValueError(f"grad has {grad.numel()} elements but residual has {residual.numel()}")
    if grad.device != residual.device:
        raise ValueError(f"grad is on {grad.device} but residual is on {residual.device}")
    if grad.numel() > MAX_NUMEL:
        raise ValueError(
            f"{grad.numel()} elements is more than 2**31-1 addressable by a 31-bit index; "
            "compress in chunks (lower bucket_cap_mb)"
        )
    if use_triton(grad):
        from gtc_lightning.ops.triton_kernels import compress_triton

        # The kernels count non-finite elements themselves, before touching the residual.
        return compress_triton(grad, residual, tau32)
    return compress_torch(grad, residual, tau32)


def compress_torch(grad: torch.Tensor, residual: torch.Tensor, tau32: float) -> torch.Tensor:
    """The torch backend as ``compress`` runs it: non-finite check, then the reference.

    Args and returns as ``compress_reference``; raises ``ValueError`` with the count of
    non-finite elements in ``grad`` before ``residual`` is touched.
    """
    # One reduction in the common case: a finite sum means every element is finite.
    bad = 0 if bool(torch.isfinite(grad.sum())) else int((~torch.isfinite(grad)).sum())
    if bad:
        raise ValueError(f"grad has {bad} non-finite element(s) (NaN/Inf); residual left unchanged")
    return compress_reference(grad, residual, tau32)


def decompress(words: torch.Tensor, numel: int, tau: float, divisor: int = 1) -> torch.Tensor:
    """Decode (possibly concatenated) messages: ``out[i] = tau/divisor * (#plus_i - #minus_i)``.

    Counts are exact integers, so the result is bit-identical for any order of ``words``.

    Args:
        words: ``[m]`` int32, contiguous; every index ``< numel``.
        numel: length of the decoded vector, ``0 <= numel <= 2**31-1``.
        tau: threshold used by the senders.
        divisor: e.g. the world size, to average over workers; an int >= 1.

    Returns:
        ``[numel]`` float32 on the device of ``words``.
    """
    tau32 = _check_tau(tau)
    _check_vector("words", words, torch.int32)
    if isinstance(numel, bool) or not isinstance(numel, int) or not 0 <= numel <= MAX_NUMEL:
        raise ValueError(f"numel must be an int in [0, 2**31-1], got {numel!r}")
    if isinstance(divisor, bool) or not isinstance(divisor, int) or divisor < 1:
        raise ValueError(f"divisor must be an int >= 1 (e.g. the world size), got {divisor!r}")
    if words.numel():
        top = int((words & ((1 << 31) - 1)).max())
        if top >= numel:
            raise ValueError(f"a word has index {top}, out of range for numel={numel}")
    scale = _fp32(np.float32(tau32) / np.float32(divisor))
    if use_triton(words):
        from gtc_lightning.ops.triton_kernels import decompress_triton

        return decompress_triton(words, numel, scale)
    return decompress_reference(words, numel, scale)
