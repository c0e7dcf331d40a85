"""Triton backend (CUDA tensors; CPU under ``TRITON_INTERPRET=1``): the public ``compress`` /
``decompress``, the DDP hook's step primitives ``threshold_``, ``emit_``, ``apply_words_``, ``decode_``,
and the update mode's ``fold_emit_``.
Long file: every Triton twin of the step primitives in one module, the one ``step_ops`` hands out.

Bit-identical to ``reference.py`` and ``torch_ops.py``: the same float32 operations in the same
order (``r = residual + grad``; ``r > tau``; ``r - tau``), words in ascending index order,
decoded values from exact int32 counts times one float32 scale.

Threshold, n elements, m words, B elements per block (bytes moved in global memory):

1. ``_threshold_kernel``: read grad and residual, write the new residual, ``±tau`` subtracted
   (12n); compact each block's words in ascending order with an in-block exclusive scan
   (``tl.cumsum``) into the block's own slice of a scratch buffer (4m), store the block's count,
   count non-finite values.
2. ``torch.cumsum`` over the block counts (n/B elements).
3. ``_gather_words_kernel``: copy each block's words to ``message[cursor + block start]`` (8m);
   the cursor is a device tensor advanced on the device, so the hook needs no host sync until
   its one header exchange per step.

The public ``compress`` must leave the residual untouched when grad holds a NaN/Inf, and no block
knows about the others, so it runs ``_count_nonfinite_kernel`` over grad first (4n) and the
threshold kernel in its guarded, in-place mode; then one host sync sizes the output.

Decode (the hook): ``_count_words_kernel`` adds +1/-1 per valid word of a ``[W, width]`` exchange
buffer (rank r's first ``lengths[r]`` words) into an all-zero int32 ``counts`` (integer atomics:
exact in any order); ``_counts_to_values_kernel`` writes ``float32(count) * scale`` per output
element and clears ``counts`` in the same pass. Public ``decompress``: zero the output, count
into its int32 view, then ``_gather_counts_kernel`` / ``_scatter_values_kernel`` touch only the
words' elements (4n + ~36m bytes).

Update mode (``fold_emit_``, twin of ``update_ops.fold_emit_``): ``_fold_emit_kernel`` is the threshold
kernel with the gradient replaced by the optimizer's step over its rate, ``t = kept - param``,
``t = t * inv``, ``residual = residual + t``, each rounded to float32 (``FP_OPTIONS``: no FMA), and
``param = kept`` stored back: read param, kept and residual, write param and residual (20n), the
words as above. Its ``FOLD=False`` form is ``emit_`` on a residual that already holds the step.

Threads: the interpreter is not thread-safe; the hook runs every kernel on the thread that calls
it (never in ``Future.then`` callbacks).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from gtc_lightning.ops import torch_ops, update_ops

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
# Elements (or words) per program and warps on CUDA. Not tuned on a GPU yet (the benchmark's
# --blocks sweeps the threshold block). The threshold kernel runs 4 elements per thread, one
# 16-byte vector per tensor: compiled for sm_90 that needs 32 registers with triton 3.9 and 63
# with 3.6 (2048 elements at 8 warps needed 64 and 115, halving the warps an SM can hold).
CUDA_CONFIG = {"compress": (1024, 8), "nonfinite": (4096, 8), "words": (1024, 4), "values": (2048, 8)}
# The interpreter costs ~1.4 ms per program, so it gets few large blocks.
INTERPRETER_BLOCK = 65536
COMPRESS_BLOCK = INTERPRETER_BLOCK if INTERPRETED else CUDA_CONFIG["compress"][0]
NONFINITE_BLOCK = INTERPRETER_BLOCK if INTERPRETED else CUDA_CONFIG["nonfinite"][0]
WORDS_BLOCK = INTERPRETER_BLOCK if INTERPRETED else CUDA_CONFIG["words"][0]
VALUES_BLOCK = INTERPRETER_BLOCK if INTERPRETED else CUDA_CONFIG["values"][0]
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
def _threshold_kernel(
    grad_ptr,  # *fp32/bf16/fp16 [n]: gradient, read once
    residual_ptr,  # *fp32 [n]: residual, read
    out_ptr,  # *fp32 [n]: new residual (may be residual_ptr: in place)
    scratch_ptr,  # *i32 [n]: block b writes its words, in order, from scratch[b * BLOCK]
    block_counts_ptr,  # *i32 [n_blocks]: number of words of each block
    bad_ptr,  # *i32 [1]: GUARD: > 0 means do nothing; else receives the non-finite count of out
    n,  # number of elements
    offset,  # index of element 0 in the words' index space
    tau,  # fp32 threshold, > 0
    alpha,  # fp32 factor on the gradient (used when ALPHA)
    clip,  # fp32 clamp bound on the gradient (used when CLIP)
    BLOCK: tl.constexpr,  # elements per program
    GUARD: tl.constexpr,  # public compress: skip everything when bad_ptr holds > 0
    ALPHA: tl.constexpr,  # multiply the gradient by alpha
    CLIP: tl.constexpr,  # clamp the gradient to [-clip, clip] first
):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    if GUARD:
        # A non-finite grad anywhere masks every access off: the residual keeps its bits.
        n_active = n - n * tl.minimum(tl.load(bad_ptr), 1)
    else:
        n_active = n
    active = offs < n_active
    r = tl.load(residual_ptr + offs, mask=active, other=0.0)
    g = tl.load(grad_ptr + offs, mask=active, other=0.0).to(tl.float32)
    if CLIP:
        # As torch.clamp: NaN stays NaN (comparisons with NaN are false), +-Inf becomes +-clip
        # (which the launcher rounded to the gradient's dtype).
        g = tl.where(g > clip, clip, tl.where(g < -clip, -clip, g))
    if ALPHA:
        g = g * alpha
    r = r + g
    plus = r > tau
    minus = r < -tau
    emit = (plus | minus).to(tl.int32)
    rank = tl.cumsum(emit, axis=0) - emit  # exclusive scan: position among the block's words
    word = ((offs + offset) | (minus.to(tl.int64) << 31)).to(tl.int32)  # index | sign bit, as int32
    tl.store(scratch_ptr + pid * BLOCK + rank, word, mask=active & (emit != 0))
    r = tl.where(plus, r - tau, tl.where(minus, r + tau, r))
    tl.store(out_ptr + offs, r, mask=active)
    tl.store(block_counts_ptr + pid, tl.sum(emit, axis=0))
    if not GUARD:
        nonfinite = tl.sum((active & ~(tl.abs(r) <= _FLT_MAX)).to(tl.int32), axis=0)
        tl.atomic_add(bad_ptr, nonfinite, mask=nonfinite > 0, sem="relaxed")


@triton.jit
def _gather_words_kernel(
    scratch_ptr,  # *i32 [n]: per-block words from _threshold_kernel
    block_counts_ptr,  # *i32 [n_blocks]: words per block
    block_ends_ptr,  # *i64 [n_blocks]: inclusive prefix sum of block_counts
    message_ptr,  # *i32 [capacity]: output, words in ascending index order from message[cursor]
    cursor_ptr,  # *i64 [1]: where this call's words start in message
    BLOCK: tl.constexpr,  # same block size as the threshold pass
):
    pid = tl.program_id(0).to(tl.int64)
    count = tl.load(block_counts_ptr + pid)
    start = tl.load(cursor_ptr) + tl.load(block_ends_ptr + pid) - count
    lanes = tl.arange(0, BLOCK)
    keep = lanes < count
    w = tl.load(scratch_ptr + pid * BLOCK + lanes, mask=keep)
    tl.store(message_ptr + start + lanes, w, mask=keep)


@triton.jit
def _fold_emit_kernel(
    param_ptr,  # *fp32 [n]: the parameter after its optimizer's step; receives kept (FOLD)
    kept_ptr,  # *fp32 [n]: the parameter before the step, only read (FOLD)
    residual_ptr,  # *fp32 [n]: residual, updated in place (+ the step over lr, then -+tau at the words)
    scratch_ptr,  # *i32 [n]: block b writes its words, in order, from scratch[b * BLOCK]
    block_counts_ptr,  # *i32 [n_blocks]: number of words of each block
    bad_ptr,  # *i32 [1]: increased by the number of NaN/Inf elements of the new residual
    n,  # number of elements
    offset,  # index of element 0 in the words' index space
    inv,  # fp32 1 / lr rounded to float32 (FOLD)
    tau,  # fp32 threshold, > 0
    limit,  # i32 bits of tau: |r| > tau iff (bits of r & 0x7fffffff) > limit, NaN/Inf above it
    BLOCK: tl.constexpr,  # elements per program
    FOLD: tl.constexpr,  # False: emit alone, on a residual that already holds the step
):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    active = offs < n
    r = tl.load(residual_ptr + offs, mask=active, other=0.0)
    if FOLD:
        k = tl.load(kept_ptr + offs, mask=active, other=0.0)
        t = k - tl.load(param_ptr + offs, mask=active, other=0.0)
        t = t * inv  # three roundings, as update_ops: the launch's FP_OPTIONS forbid an FMA here
        r = r + t
        tl.store(param_ptr + offs, k, mask=active)
    # On the bits, as torch_ops.emit_: NaN is a word too (the caller skips the step on a count in bad).
    bits = r.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    emit = active & (bits > limit)
    minus = emit & (r < 0)
    e = emit.to(tl.int32)
    rank = tl.cumsum(e, axis=0) - e  # exclusive scan: position among the block's words
    word = ((offs + offset) | (minus.to(tl.int64) << 31)).to(tl.int32)  # index | sign bit, as int32
    tl.store(scratch_ptr + pid * BLOCK + rank, word, mask=emit)
    r = tl.where(minus, r + tau, tl.where(emit, r - tau, r))
    tl.store(residual_ptr + offs, r, mask=active)
    tl.store(block_counts_ptr + pid, tl.sum(e, axis=0))
    nonfinite = tl.sum((emit & (bits >= 0x7F800000)).to(tl.int32), axis=0)
    tl.atomic_add(bad_ptr, nonfinite, mask=nonfinite > 0, sem="relaxed")


@triton.jit
def _apply_words_kernel(
    words_ptr,  # *i32 [m]: this rank's words, at most one per index
    residual_ptr,  # *fp32 [N]: residual, -tau at a plus word, +tau at a minus word
    m,  # number of words
    tau,  # fp32 threshold
    BLOCK: tl.constexpr,  # words per program
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < m
    w = tl.load(words_ptr + offs, mask=valid, other=0)
    index = (w & 0x7FFFFFFF).to(tl.int64)
    r = tl.load(residual_ptr + index, mask=valid, other=0.0)
    tl.store(residual_ptr + index, tl.where(w < 0, r + tau, r - tau), mask=valid)


@triton.jit
def _count_words_kernel(
    words_ptr,  # *i32 [rows * width]: index | sign bit per word, row r valid up to lengths[r]
    lengths_ptr,  # *i64 [rows]: valid words per row
    counts_ptr,  # *i32 [N]: receives #plus - #minus per index
    total,  # rows * width
    width,  # words per row (>= 1)
    BLOCK: tl.constexpr,  # words per program
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < total
    row = offs // width
    valid = valid & (offs - row * width < tl.load(lengths_ptr + row, mask=valid, other=0))
    w = tl.load(words_ptr + offs, mask=valid, other=0)
    vote = tl.where(w < 0, -1, 1).to(tl.int32)
    tl.atomic_add(counts_ptr + (w & 0x7FFFFFFF).to(tl.int64), vote, mask=valid, sem="relaxed")


@triton.jit
def _counts_to_values_kernel(
    counts_ptr,  # *i32 [n]: vote counts; zeroed after reading
    out_ptr,  # *fp32/bf16/fp16 [n]: receives float32(count) * scale
    n,  # number of elements
    scale,  # fp32 tau / divisor (times a loss scale)
    BLOCK: tl.constexpr,  # elements per program
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < n
    c = tl.load(counts_ptr + offs, mask=valid, other=0)
    tl.store(out_ptr + offs, (c.to(tl.float32) * scale).to(out_ptr.dtype.element_ty), mask=valid)
    tl.store(counts_ptr + offs, tl.zeros_like(c), mask=valid)


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
    """Warps for a threshold block: 4 elements per thread, 1 to 16 warps."""
    return max(1, min(16, block // 128))


def check_runnable(t: torch.Tensor) -> None:
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


def _threshold_launch(
    grad: torch.Tensor,
    residual: torch.Tensor,
    out: torch.Tensor,
    tau32: float,
    bad: torch.Tensor,
    block: int,
    guard: bool,
    offset: int = 0,
    alpha: float = 1.0,
    clip: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """Runs the threshold pass; returns (scratch, block_counts, block_ends, launch options)."""
    n = grad.numel()
    n_blocks = triton.cdiv(n, block)
    scratch = torch.empty(n, dtype=torch.int32, device=grad.device)
    block_counts = torch.empty(n_blocks, dtype=torch.int32, device=grad.device)
    launch = {"BLOCK": block, "num_warps": compress_warps(block), **FP_OPTIONS}
    if clip is not None and grad.dtype != torch.float32:
        # torch's grad.clamp_ in bf16/fp16 gives the bound rounded to that dtype (round to nearest
        # even); clamping the exactly converted values to the rounded bound gives the same numbers.
        clip = float(torch.tensor(clip, dtype=torch.float32).to(grad.dtype))
    _threshold_kernel[(n_blocks,)](
        grad, residual, out, scratch, block_counts, bad, n, offset, tau32, alpha,
        0.0 if clip is None else clip,
        GUARD=guard, ALPHA=alpha != 1.0, CLIP=clip is not None, **launch,
    )  # fmt: skip
    return scratch, block_counts, torch.cumsum(block_counts, 0), launch


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
    check_runnable(grad)
    words = torch.empty(0, dtype=torch.int32, device=grad.device)
    if n == 0:
        return words, 0
    bad = torch.zeros(1, dtype=torch.int32, device=grad.device)
    check_block, check_warps = NONFINITE_BLOCK, CUDA_CONFIG["nonfinite"][1]
    _count_nonfinite_kernel[(triton.cdiv(n, check_block),)](
        grad, bad, n, BLOCK=check_block, num_warps=check_warps, **FP_OPTIONS
    )
    scratch, block_counts, block_ends, launch = _threshold_launch(
        grad, residual, residual, tau32, bad, block, guard=True
    )
    total, n_bad = torch.stack([block_ends[-1], bad[0].to(torch.int64)]).tolist()
    if n_bad or total == 0:
        return words, n_bad
    words = torch.empty(total, dtype=torch.int32, device=grad.device)
    cursor = torch.zeros(1, dtype=torch.int64, device=grad.device)
    _gather_words_kernel[(block_counts.numel(),)](scratch, block_counts, block_ends, words, cursor, **launch)
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


def _launch_count(words: torch.Tensor, lengths: torch.Tensor, counts: torch.Tensor, width: int) -> None:
    total = words.numel()
    if total == 0 or width == 0:
        return
    block = WORDS_BLOCK
    _count_words_kernel[(triton.cdiv(total, block),)](
        words, lengths, counts, total, width, BLOCK=block, num_warps=CUDA_CONFIG["words"][1], **FP_OPTIONS
    )


def _launch_decompress(words: torch.Tensor, numel: int, scale: float, block: int) -> torch.Tensor:
    """Checks, allocates and launches the decompress passes."""
    _check_vector("words", words, torch.int32)
    _check_block(block)
    if not 0 <= numel <= MAX_NUMEL:
        raise ValueError(f"numel must be in [0, 2**31-1], got {numel}")
    check_runnable(words)
    out = torch.zeros(numel, dtype=torch.float32, device=words.device)
    m = words.numel()
    if m == 0:
        return out
    grid = (triton.cdiv(m, block),)
    counts = out.view(torch.int32)
    values = torch.empty(m, dtype=torch.float32, device=words.device)
    launch = {"BLOCK": block, "num_warps": CUDA_CONFIG["words"][1], **FP_OPTIONS}
    lengths = torch.full((1,), m, dtype=torch.int64, device=words.device)
    _count_words_kernel[grid](words, lengths, counts, m, m, **launch)
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


# ---- the hook's step primitives: same signatures as gtc_lightning.ops.torch_ops -----------------


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
    block: int = COMPRESS_BLOCK,
) -> None:
    """Triton twin of ``torch_ops.threshold_`` (``grad`` is only read, also when clipping).

    No host sync: the words go to ``message[cursor:]`` and ``cursor`` advances on the device.
    """
    check_runnable(grad)
    n = grad.numel()
    if n == 0:
        return
    words, block_counts, block_ends, launch = _threshold_launch(
        grad, residual, out, tau32, bad, block, guard=False, offset=offset, alpha=alpha, clip=clip
    )
    _gather_words_kernel[(block_counts.numel(),)](words, block_counts, block_ends, message, cursor, **launch)
    cursor += block_ends[-1:]


def emit_(
    out: torch.Tensor,
    tau32: float,
    message: torch.Tensor,
    cursor: torch.Tensor,
    bad: torch.Tensor,
    offset: int = 0,
    block: int = COMPRESS_BLOCK,
) -> None:
    """Triton twin of ``torch_ops.emit_`` (a contiguous float32 ``out``; anything else goes to it)."""
    check_runnable(out)
    if out.dtype != torch.float32 or not out.is_contiguous():
        torch_ops.emit_(out, tau32, message, cursor, bad, offset)
        return
    _fold_emit(out, out, out, 1.0, tau32, message, cursor, bad, offset, block, fold=False)


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
    block: int = COMPRESS_BLOCK,
) -> None:
    """Triton twin of ``update_ops.fold_emit_``: ``residual += (kept - param) / lr``, ``param = kept``,
    then the words of ``|residual| > tau32`` to ``message[cursor:]`` (ascending ``(offset + i) | sign <<
    31``), ``±tau32`` subtracted there, NaN/Inf counted in ``bad``; no host sync.

    A contiguous float32 parameter takes one fused pass. Any other (bf16/fp16 weights, a strided
    layout) is folded by ``update_ops.fold_`` in torch on the device, then emitted by the ``FOLD=False``
    kernel: the same words, residual and parameter as the reference, in one more pass.

    Args:
        param: the parameter after its optimizer's step (``n`` elements).
        kept: ``[n]`` float32, contiguous, the parameter before the step; ``message`` may share its memory.
        residual: ``[n]`` float32, contiguous, updated in place.
        lr: the step's learning rate (> 0).
        tau32, message, cursor, bad, offset: as ``threshold_``.
        block: elements per program (a power of two >= 16).
    """
    check_runnable(param)
    _check_vector("kept", kept, torch.float32)
    _check_vector("residual", residual, torch.float32)
    if not param.numel() == kept.numel() == residual.numel():
        raise ValueError(
            f"param has {param.numel()} elements, kept {kept.numel()} and residual {residual.numel()}; "
            "they must match (the kept copy and the residual are the parameter's slices of the flat buffers)"
        )
    if param.dtype != torch.float32 or not param.is_contiguous():
        update_ops.fold_(param, kept, residual, lr)
        emit_(residual, tau32, message, cursor, bad, offset, block)
        return
    inv = update_ops.inverse_rate(lr)
    _fold_emit(param.detach().view(-1), kept, residual, inv, tau32, message, cursor, bad, offset, block, fold=True)


def _fold_emit(param, kept, residual, inv, tau32, message, cursor, bad, offset, block, fold) -> None:
    """Launches the fold (or emission) pass, then the gather of its words into ``message``.

    ``message`` may be ``kept``'s memory: the gather is a later launch on the same stream, so it
    starts after every program of the fold has read its ``kept``; the fold writes its words only
    to the scratch buffer.
    """
    _check_block(block)
    n = residual.numel()
    if n == 0:
        return
    n_blocks = triton.cdiv(n, block)
    scratch = torch.empty(n, dtype=torch.int32, device=residual.device)
    block_counts = torch.empty(n_blocks, dtype=torch.int32, device=residual.device)
    launch = {"BLOCK": block, "num_warps": compress_warps(block), **FP_OPTIONS}
    _fold_emit_kernel[(n_blocks,)](
        param, kept, residual, scratch, block_counts, bad, n, offset, inv, tau32, torch_ops.tau_bits(tau32),
        FOLD=fold, **launch,
    )  # fmt: skip
    block_ends = torch.cumsum(block_counts, 0)
    _gather_words_kernel[(n_blocks,)](scratch, block_counts, block_ends, message, cursor, **launch)
    cursor += block_ends[-1:]


COUNTS_DTYPE = torch.int32  # vote counts for the integer atomics


def apply_words_(residual: torch.Tensor, words: torch.Tensor, tau32: float) -> None:
    """Triton twin of ``torch_ops.apply_words_``."""
    m = words.numel()
    if m == 0:
        return
    check_runnable(words)
    block = WORDS_BLOCK
    _apply_words_kernel[(triton.cdiv(m, block),)](
        words, residual, m, tau32, BLOCK=block, num_warps=CUDA_CONFIG["words"][1], **FP_OPTIONS
    )


def decode_(
    words: torch.Tensor,
    lengths: list[int] | None,
    counts: torch.Tensor,
    outputs: list[tuple[int, torch.Tensor]],
    scale: float,
) -> None:
    """Triton twin of ``torch_ops.decode_``: atomics count the valid words, one pass per output
    writes ``float32(count) * scale`` and clears ``counts``."""
    check_runnable(counts)
    if lengths is None:
        lengths, width = [words.numel()], words.numel()
    else:
        width = words.numel() // max(len(lengths), 1)
    lens = torch.tensor(lengths, dtype=torch.int64).to(words.device, non_blocking=True)
    _launch_count(words, lens, counts, width)
    block, warps = VALUES_BLOCK, CUDA_CONFIG["values"][1]
    for offset, out in outputs:
        n = out.numel()
        if n:
            _counts_to_values_kernel[(triton.cdiv(n, block),)](
                counts[offset : offset + n], out, n, scale, BLOCK=block, num_warps=warps, **FP_OPTIONS
            )


# Every kernel with its argument types (triton signature strings, constexprs excluded), its
# CUDA_CONFIG entry and the constexprs a compile needs besides BLOCK: what an ahead-of-time compile
# needs (``python -m gtc_lightning.tools.bench --compile-only``).
KERNELS = {
    "count_nonfinite": (
        _count_nonfinite_kernel,
        {"grad_ptr": "*fp32", "bad_ptr": "*i32", "n": "i32"},
        "nonfinite",
        {},
    ),
    "threshold": (
        _threshold_kernel,
        {
            "grad_ptr": "*fp32",
            "residual_ptr": "*fp32",
            "out_ptr": "*fp32",
            "scratch_ptr": "*i32",
            "block_counts_ptr": "*i32",
            "bad_ptr": "*i32",
            "n": "i32",
            "offset": "i32",
            "tau": "fp32",
            "alpha": "fp32",
            "clip": "fp32",
        },
        "compress",
        {"GUARD": False, "ALPHA": True, "CLIP": False},
    ),
    "gather_words": (
        _gather_words_kernel,
        {
            "scratch_ptr": "*i32",
            "block_counts_ptr": "*i32",
            "block_ends_ptr": "*i64",
            "message_ptr": "*i32",
            "cursor_ptr": "*i64",
        },
        "compress",
        {},
    ),
    "fold_emit": (
        _fold_emit_kernel,
        {
            "param_ptr": "*fp32",
            "kept_ptr": "*fp32",
            "residual_ptr": "*fp32",
            "scratch_ptr": "*i32",
            "block_counts_ptr": "*i32",
            "bad_ptr": "*i32",
            "n": "i32",
            "offset": "i32",
            "inv": "fp32",
            "tau": "fp32",
            "limit": "i32",
        },
        "compress",
        {"FOLD": True},
    ),
    "apply_words": (
        _apply_words_kernel,
        {"words_ptr": "*i32", "residual_ptr": "*fp32", "m": "i32", "tau": "fp32"},
        "words",
        {},
    ),
    "count_words": (
        _count_words_kernel,
        {"words_ptr": "*i32", "lengths_ptr": "*i64", "counts_ptr": "*i32", "total": "i32", "width": "i32"},
        "words",
        {},
    ),
    "counts_to_values": (
        _counts_to_values_kernel,
        {"counts_ptr": "*i32", "out_ptr": "*fp32", "n": "i32", "scale": "fp32"},
        "values",
        {},
    ),
    "gather_counts": (
        _gather_counts_kernel,
        {"words_ptr": "*i32", "counts_ptr": "*i32", "values_ptr": "*fp32", "scale": "fp32", "m": "i32"},
        "words",
        {},
    ),
    "scatter_values": (
        _scatter_values_kernel,
        {"words_ptr": "*i32", "values_ptr": "*fp32", "out_ptr": "*fp32", "m": "i32"},
        "words",
        {},
    ),
}
