"""Triton backend of ``compress`` / ``decompress`` (CUDA tensors; CPU under ``TRITON_INTERPRET=1``).

Bit-identical to ``reference.py``: the same float32 operations in the same order
(``r = residual + grad``; ``r > tau``; ``r - tau``), words in ascending index order, decoded
values from exact int32 counts times one float32 scale.

Compress, n elements, m words, B elements per block (bytes moved in global memory):

1. ``_count_nonfinite_kernel``: read grad (4n), one int32 atomic per block. The residual must
   stay untouched when grad has a NaN/Inf, and no block knows about the others, so this pass
   runs first; it costs less than re-reading grad *and* residual in a counting pass.
2. ``_compress_blocks_kernel``: read grad and residual, write the new residual (12n); compact
   each block's words in ascending order with an in-block exclusive scan (``tl.cumsum``) into
   the block's own slice of a scratch buffer (4m), store the block's count. If pass 1 found a
   non-finite element every access is masked off, so the residual keeps its exact bits.
3. ``torch.cumsum`` over the block counts (n/B elements) and one host sync that reads the
   word total and the non-finite count together (the output size must be known on the host).
4. ``_gather_words_kernel``: copy each block's words to its offset in the output (8m).

In all 16n + 12m bytes (the minimum for the in-place update is 12n + 4m), one host sync,
deterministic: no atomics decide any word's position.

Decompress: zero the float32 output (4n), then three passes over the words only:
``_count_words_kernel`` adds +1/-1 per word into the output's int32 view (integer atomics,
exact in any order); ``_gather_counts_kernel`` reads each word's final count and stores
``float32(count) * scale`` per word; ``_scatter_values_kernel`` writes those values back to the
output. Every word of one index writes the same bits, so the result does not depend on the
order; elements without words keep int32 0, which is +0.0, as ``0 * scale`` is. In all
4n + ~36m bytes instead of 12n for a count-buffer-then-scale design.

Threads: the interpreter (``TRITON_INTERPRET=1``) is not thread-safe, and DDP runs ``.then``
callbacks of a communication hook on another thread. The public dispatch in
``gtc_lightning.ops`` sends CPU tensors to the torch reference, so only code that calls these
functions directly on CPU tensors from several threads has to serialise the calls.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
# Elements (or words) per program and warps on CUDA. Not tuned on a GPU yet (the benchmark's
# --blocks sweeps the compress block). Compress runs 4 elements per thread, one 16-byte
# vector per tensor: compiled for sm_90 that needs 32 registers with triton 3.9 and 63 with
# 3.6 (2048 elements at 8 warps needed 64 and 115, halving the warps an SM can hold).
CUDA_CONFIG = {"compress": (1024, 8), "nonfinite": (4096, 8), "words": (1024, 4)}
# The interpreter costs ~1.4 ms per program, so it gets few large blocks.
INTERPRETER_BLOCK = 65536
COMPRESS_BLOCK = INTERPRETER_BLOCK if INTERPRETED else CUDA_CONFIG["compress"][0]
NONFINITE_BLOCK = INTERPRETER_BLOCK if INTERPRETED else CUDA_CONFIG["nonfinite"][0]
WORDS_BLOCK = INTERPRETER_BLOCK if INTERPRETED else CUDA_CONFIG["words"][0]
# Bit-exact with the reference: never contract a multiply and an add into an FMA.
FP_OPTIONS = {"enable_fp_fusion": False}
MAX_NUMEL = (1 << 31) - 1
FLT_MAX = 3.4028234663852886e38  # largest finite float32
_FLT_MAX: tl.constexpr = tl.constexpr(FLT_MAX)


@triton.jit
def _count_nonfinite_kernel(
    grad_ptr,  # *fp32 [n]: gradient to check
    bad_ptr,  # *i32 [1]: zeroed by the caller; receives the number of NaN/Inf elements
    n,  # number of elements
    BLOCK: tl.constexpr,  # elements per program
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_range = offs < n
    g = tl.load(grad_ptr + offs, mask=in_range, other=0.0)
    # NaN fails every comparison, so "not (|g| <= FLT_MAX)" catches NaN and +-Inf.
    bad = in_range & ~(tl.abs(g) <= _FLT_MAX)
    tl.atomic_add(bad_ptr, tl.sum(bad.to(tl.int32), axis=0), sem="relaxed")


@triton.jit
def _compress_blocks_kernel(
    grad_ptr,  # *fp32 [n]: gradient, read once
    residual_ptr,  # *fp32 [n]: residual, updated in place (untouched if bad_ptr holds > 0)
    scratch_ptr,  # *i32 [n]: block b writes its words, in order, from scratch[b * BLOCK]
    block_counts_ptr,  # *i32 [n_blocks]: number of words of each block
    bad_ptr,  # *i32 [1]: non-finite count from _count_nonfinite_kernel; > 0 means do nothing
    n,  # number of elements
    tau,  # fp32 threshold, > 0
    BLOCK: tl.constexpr,  # elements per program
):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    # A non-finite grad anywhere masks every access off: the residual keeps its bits.
    n_active = n - n * tl.minimum(tl.load(bad_ptr), 1)
    active = offs < n_active
    r = tl.load(residual_ptr + offs, mask=active, other=0.0)
    g = tl.load(grad_ptr + offs, mask=active, other=0.0)
    r = r + g
    plus = r > tau
    minus = r < -tau
    emit = (plus | minus).to(tl.int32)
    rank = tl.cumsum(emit, axis=0) - emit  # exclusive scan: position among the block's words
    word = (offs | (minus.to(tl.int64) << 31)).to(tl.int32)  # index | sign bit, as int32
    tl.store(scratch_ptr + pid * BLOCK + rank, word, mask=active & (emit != 0))
    tl.store(residual_ptr + offs, tl.where(plus, r - tau, tl.where(minus, r + tau, r)), mask=active)
    tl.store(block_counts_ptr + pid, tl.sum(emit, axis=0))


@triton.jit
def _gather_words_kernel(
    scratch_ptr,  # *i32 [n]: per-block words from _compress_blocks_kernel
    block_counts_ptr,  # *i32 [n_blocks]: words per block
    block_ends_ptr,  # *i64 [n_blocks]: inclusive prefix sum of block_counts
    words_ptr,  # *i32 [m]: output, words in ascending index order
    BLOCK: tl.constexpr,  # same block size as the compress pass
):
    pid = tl.program_id(0).to(tl.int64)
    count = tl.load(block_counts_ptr + pid)
    start = tl.load(block_ends_ptr + pid) - count
    lanes = tl.arange(0, BLOCK)
    keep = lanes < count
    w = tl.load(scratch_ptr + pid * BLOCK + lanes, mask=keep)
    tl.store(words_ptr + start + lanes, w, mask=keep)


@triton.jit
def _count_words_kernel(
    words_ptr,  # *i32 [m]: index | sign bit per word
    counts_ptr,  # *i32 [numel]: zeroed by the caller; receives #plus - #minus per index
    m,  # number of words
    BLOCK: tl.constexpr,  # words per program
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < m
    w = tl.load(words_ptr + offs, mask=valid, other=0)
    vote = tl.where(w < 0, -1, 1).to(tl.int32)
    tl.atomic_add(counts_ptr + (w & 0x7FFFFFFF).to(tl.int64), vote, mask=valid, sem="relaxed")


@triton.jit
def _gather_counts_kernel(
    words_ptr,  # *i32 [m]: index | sign bit per word
    counts_ptr,  # *i32 [numel]: final counts from _count_words_kernel
    values_ptr,  # *fp32 [m]: receives float32(count of the word's index) * scale
    scale,  # fp32 tau / divisor
    m,  # number of words
    BLOCK: tl.constexpr,  # words per program
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < m
    w = tl.load(words_ptr + offs, mask=valid, other=0)
    count = tl.load(counts_ptr + (w & 0x7FFFFFFF).to(tl.int64), mask=valid, other=0)
    tl.store(values_ptr + offs, count.to(tl.float32) * scale, mask=valid)


@triton.jit
def _scatter_values_kernel(
    words_ptr,  # *i32 [m]: index | sign bit per word
    values_ptr,  # *fp32 [m]: decoded value per word (equal for equal indices)
    out_ptr,  # *fp32 [numel]: output; same memory as the counts, overwritten where words point
    m,  # number of words
    BLOCK: tl.constexpr,  # words per program
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < m
    w = tl.load(words_ptr + offs, mask=valid, other=0)
    tl.store(out_ptr + (w & 0x7FFFFFFF).to(tl.int64), tl.load(values_ptr + offs, mask=valid), mask=valid)


def compress_warps(block: int) -> int:
    """Warps for a compress block: 4 elements per thread, 1 to 16 warps."""
    return max(1, min(16, block // 128))


def _check_runnable(t: torch.Tensor) -> None:
    if not t.is_cuda and not INTERPRETED:
        raise RuntimeError(
            f"the Triton kernels run on CUDA tensors (or on CPU with TRITON_INTERPRET=1 set before "
            f"triton is imported), got a tensor on {t.device}; use gtc_lightning.ops.compress/decompress"
        )


def _check_vector(name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    if t.dtype != dtype or t.dim() != 1 or not t.is_contiguous():
        raise ValueError(
            f"{name} must be a contiguous 1-D {dtype} tensor, got {t.dtype} shape {tuple(t.shape)} "
            f"contiguous={t.is_contiguous()}"
        )


def _check_block(block: int) -> None:
    if block < 16 or block & (block - 1):
        raise ValueError(f"block size must be a power of two >= 16, got {block}")


def _launch_compress(
    grad: torch.Tensor, residual: torch.Tensor, tau32: float, block: int
) -> tuple[torch.Tensor, int]:
    """Checks, allocates and launches the compress passes; returns (words, non-finite count)."""
    _check_vector("grad", grad, torch.float32)
    _check_vector("residual", residual, torch.float32)
    _check_block(block)
    n = grad.numel()
    if residual.numel() != n or residual.device != grad.device:
        raise ValueError(
            f"grad ({n} elements on {grad.device}) and residual ({residual.numel()} elements on "
            f"{residual.device}) must match"
        )
    if n > MAX_NUMEL:
        raise ValueError(f"{n} elements is more than 2**31-1 addressable by a 31-bit index")
    if not (0.0 < tau32 <= FLT_MAX):
        raise ValueError(f"tau must be a finite float32 > 0, got {tau32!r}")
    _check_runnable(grad)
    words = torch.empty(0, dtype=torch.int32, device=grad.device)
    if n == 0:
        return words, 0
    bad = torch.zeros(1, dtype=torch.int32, device=grad.device)
    check_block, check_warps = NONFINITE_BLOCK, CUDA_CONFIG["nonfinite"][1]
    _count_nonfinite_kernel[(triton.cdiv(n, check_block),)](
        grad, bad, n, BLOCK=check_block, num_warps=check_warps, **FP_OPTIONS
    )
    n_blocks = triton.cdiv(n, block)
    scratch = torch.empty(n, dtype=torch.int32, device=grad.device)
    block_counts = torch.empty(n_blocks, dtype=torch.int32, device=grad.device)
    launch = {"BLOCK": block, "num_warps": compress_warps(block), **FP_OPTIONS}
    _compress_blocks_kernel[(n_blocks,)](grad, residual, scratch, block_counts, bad, n, tau32, **launch)
    block_ends = torch.cumsum(block_counts, 0)  # int64
    total, n_bad = torch.stack([block_ends[-1], bad[0].to(torch.int64)]).tolist()
    if n_bad or total == 0:
        return words, n_bad
    words = torch.empty(total, dtype=torch.int32, device=grad.device)
    _gather_words_kernel[(n_blocks,)](scratch, block_counts, block_ends, words, **launch)
    return words, 0


def compress_triton(
    grad: torch.Tensor, residual: torch.Tensor, tau32: float, block: int = COMPRESS_BLOCK
) -> torch.Tensor:
    """Triton twin of ``compress_reference``: ``residual += grad``, emit words beyond ``±tau32``.

    Args:
        grad: ``[n]`` float32, contiguous.
        residual: ``[n]`` float32, contiguous, same device; updated in place.
        tau32: the threshold, a float32 value > 0.
        block: elements per program (power of two); large under the interpreter.

    Returns:
        ``[m]`` int32 words in ascending index order: ``i`` for +tau, ``i | 1 << 31`` for -tau.

    Raises:
        ValueError: bad shapes/dtypes/tau, or a non-finite element in ``grad`` (then
            ``residual`` keeps its exact bits).
    """
    words, n_bad = _launch_compress(grad, residual, tau32, block)
    if n_bad:
        raise ValueError(f"grad has {n_bad} non-finite element(s) (NaN/Inf); residual left unchanged")
    return words


def _launch_decompress(words: torch.Tensor, numel: int, scale: float, block: int) -> torch.Tensor:
    """Checks, allocates and launches the decompress passes."""
    _check_vector("words", words, torch.int32)
    _check_block(block)
    if not 0 <= numel <= MAX_NUMEL:
        raise ValueError(f"numel must be in [0, 2**31-1], got {numel}")
    _check_runnable(words)
    out = torch.zeros(numel, dtype=torch.float32, device=words.device)
    m = words.numel()
    if m == 0:
        return out
    grid = (triton.cdiv(m, block),)
    counts = out.view(torch.int32)
    values = torch.empty(m, dtype=torch.float32, device=words.device)
    launch = {"BLOCK": block, "num_warps": CUDA_CONFIG["words"][1], **FP_OPTIONS}
    _count_words_kernel[grid](words, counts, m, **launch)
    _gather_counts_kernel[grid](words, counts, values, scale, m, **launch)
    _scatter_values_kernel[grid](words, values, out, m, **launch)
    return out


def decompress_triton(
    words: torch.Tensor, numel: int, scale: float, block: int = WORDS_BLOCK
) -> torch.Tensor:
    """Triton twin of ``decompress_reference``: ``scale * (#plus - #minus)`` per index.

    Args:
        words: ``[m]`` int32; every index ``< numel`` (checked by the public ``decompress``;
            an out-of-range index here writes out of bounds).
        numel: length of the output.
        scale: ``tau / divisor`` as a float32 value.
        block: words per program (power of two).

    Returns:
        ``[numel]`` float32 on the device of ``words``.
    """
    return _launch_decompress(words, numel, scale, block)


# Every kernel with its argument types (triton signature strings, BLOCK excluded) and its
# CUDA_CONFIG entry: what an ahead-of-time compile needs (``python -m gtc_lightning.bench --compile-only``).
KERNELS = {
    "count_nonfinite": (
        _count_nonfinite_kernel,
        {"grad_ptr": "*fp32", "bad_ptr": "*i32", "n": "i32"},
        "nonfinite",
    ),
    "compress_blocks": (
        _compress_blocks_kernel,
        {
            "grad_ptr": "*fp32",
            "residual_ptr": "*fp32",
            "scratch_ptr": "*i32",
            "block_counts_ptr": "*i32",
            "bad_ptr": "*i32",
            "n": "i32",
            "tau": "fp32",
        },
        "compress",
    ),
    "gather_words": (
        _gather_words_kernel,
        {"scratch_ptr": "*i32", "block_counts_ptr": "*i32", "block_ends_ptr": "*i64", "words_ptr": "*i32"},
        "compress",
    ),
    "count_words": (_count_words_kernel, {"words_ptr": "*i32", "counts_ptr": "*i32", "m": "i32"}, "words"),
    "gather_counts": (
        _gather_counts_kernel,
        {"words_ptr": "*i32", "counts_ptr": "*i32", "values_ptr": "*fp32", "scale": "fp32", "m": "i32"},
        "words",
    ),
    "scatter_values": (
        _scatter_values_kernel,
        {"words_ptr": "*i32", "values_ptr": "*fp32", "out_ptr": "*fp32", "m": "i32"},
        "words",
    ),
}
