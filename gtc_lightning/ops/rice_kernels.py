"""Triton twins of the bit-stream steps of ``rice.py`` (CUDA tensors; CPU under
``TRITON_INTERPRET=1``). The gaps, the prefix sums and the header stay torch operations; these
kernels do what torch has no vectorised form for: setting and reading single bits.

- ``pack_unary``: a stream of ones with a zero at each word's end position (``atomic_and`` of one
  bit per word: words of one 32-bit stream word clear different bits, so any order gives the same
  result).
- ``pack_fixed``: each word's ``L``-bit field at bit ``i * L`` (``atomic_or`` into one or two stream
  words).
- ``zero_positions``: the positions of the zeros of the unary stream, in order: a popcount per
  stream word, a prefix sum, then each word writes its zeros' positions at its offset (32 unrolled
  steps over a block of words).
- ``unpack_fixed``: field ``i`` from the one or two stream words it spans.

Bits are numbered as in ``rice.py``: bit ``j`` of a stream is bit ``31 - j % 32`` of int32 word
``j // 32``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gtc_lightning.ops.triton_kernels import INTERPRETED, check_runnable

BLOCK = 65536 if INTERPRETED else 1024
WARPS = 4


@triton.jit
def _clear_bits_kernel(
    positions_ptr,  # *i64 [m]: bit positions to set to zero
    stream_ptr,  # *i32 [W]: all ones on entry
    m,  # number of positions
    BLOCK: tl.constexpr,  # positions per program
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < m
    pos = tl.load(positions_ptr + offs, mask=valid, other=0)
    bit = (31 - (pos & 31)).to(tl.int32)
    tl.atomic_and(stream_ptr + (pos >> 5), ~(tl.full([BLOCK], 1, tl.int32) << bit), mask=valid, sem="relaxed")


@triton.jit
def _or_fields_kernel(
    values_ptr,  # *i64 [m]: field values, each < 2**L
    stream_ptr,  # *i32 [W]: zeros on entry
    m,  # number of fields
    L,  # bits per field, 1..31
    BLOCK: tl.constexpr,  # fields per program
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < m
    value = tl.load(values_ptr + offs, mask=valid, other=0).to(tl.uint64)
    start = offs * L
    word = start >> 5
    # The field as the top bits of a 64-bit window that starts at its first stream word.
    window = value << (64 - L - (start & 31)).to(tl.uint64)
    high = (window >> 32).to(tl.uint32).to(tl.int32, bitcast=True)
    low = (window & 0xFFFFFFFF).to(tl.uint32).to(tl.int32, bitcast=True)
    tl.atomic_or(stream_ptr + word, high, mask=valid, sem="relaxed")
    tl.atomic_or(stream_ptr + word + 1, low, mask=valid & (low != 0), sem="relaxed")


@triton.jit
def _popcount(x):
    """Set bits of each uint32 (SWAR: no libdevice, so the interpreter runs it too)."""
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F
    return (x * 0x01010101) >> 24


@triton.jit
def _count_zeros_kernel(
    stream_ptr,  # *i32 [W]
    counts_ptr,  # *i64 [W]: receives the zeros of each word
    n,  # words
    BLOCK: tl.constexpr,  # words per program
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < n
    inverted = ~tl.load(stream_ptr + offs, mask=valid, other=-1).to(tl.uint32, bitcast=True)
    tl.store(counts_ptr + offs, _popcount(inverted).to(tl.int64), mask=valid)


@triton.jit
def _zero_positions_kernel(
    stream_ptr,  # *i32 [W]
    starts_ptr,  # *i64 [W]: exclusive prefix sum of the zeros per word
    out_ptr,  # *i64 [m]: receives the positions of the zeros, ascending
    n,  # words
    BLOCK: tl.constexpr,  # words per program
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < n
    inverted = ~tl.load(stream_ptr + offs, mask=valid, other=-1).to(tl.uint32, bitcast=True)
    at = tl.load(starts_ptr + offs, mask=valid, other=0)
    for j in tl.static_range(32):
        zero = (inverted >> (31 - j)) & 1
        tl.store(out_ptr + at, offs * 32 + j, mask=valid & (zero != 0))
        at += zero.to(tl.int64)


@triton.jit
def _fields_kernel(
    stream_ptr,  # *i32 [W]
    out_ptr,  # *i64 [m]: receives field i
    m,  # number of fields
    n,  # words in the stream
    L,  # bits per field, 1..31
    BLOCK: tl.constexpr,  # fields per program
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < m
    start = offs * L
    word = start >> 5
    high = tl.load(stream_ptr + word, mask=valid, other=0).to(tl.uint32, bitcast=True).to(tl.uint64)
    low = tl.load(stream_ptr + word + 1, mask=valid & (word + 1 < n), other=0)
    window = (high << 32) | low.to(tl.uint32, bitcast=True).to(tl.uint64)
    value = (window >> (64 - L - (start & 31)).to(tl.uint64)) & ((1 << L) - 1)
    tl.store(out_ptr + offs, value.to(tl.int64), mask=valid)


def _grid(n: int) -> tuple[int]:
    return (triton.cdiv(max(n, 1), BLOCK),)


def pack_unary(ends: torch.Tensor, bits: int) -> torch.Tensor:
    """``[ceil(bits/32)]`` int32: ones, with a zero at each of ``ends`` (``[m]`` int64)."""
    check_runnable(ends)
    stream = torch.full(((bits + 31) // 32,), -1, dtype=torch.int32, device=ends.device)
    if ends.numel():
        _clear_bits_kernel[_grid(ends.numel())](ends, stream, ends.numel(), BLOCK=BLOCK, num_warps=WARPS)
    return stream


def pack_fixed(values: torch.Tensor, width: int) -> torch.Tensor:
    """``[ceil(m * width / 32)]`` int32: the ``width``-bit ``values`` (``[m]`` int64) back to back."""
    check_runnable(values)
    m = values.numel()
    stream = torch.zeros((m * width + 31) // 32 + 1, dtype=torch.int32, device=values.device)
    if m:
        _or_fields_kernel[_grid(m)](values, stream, m, width, BLOCK=BLOCK, num_warps=WARPS)
    return stream[:-1]  # the last word only caught the empty low halves of the last fields


def zero_positions(stream: torch.Tensor, m: int) -> torch.Tensor:
    """``[m]`` int64 ascending positions of the zeros of ``stream`` (int32 words).

    Raises:
        ValueError: the stream holds another number of zeros.
    """
    check_runnable(stream)
    n = stream.numel()
    counts = torch.empty(n, dtype=torch.int64, device=stream.device)
    if n:
        _count_zeros_kernel[_grid(n)](stream, counts, n, BLOCK=BLOCK, num_warps=WARPS)
    ends = torch.cumsum(counts, 0)
    total = int(ends[-1]) if n else 0
    if total != m:
        raise ValueError(f"corrupt Rice-coded message: {total} unary codes for {m} words")
    out = torch.empty(m, dtype=torch.int64, device=stream.device)
    if n:
        _zero_positions_kernel[_grid(n)](stream, ends - counts, out, n, BLOCK=BLOCK, num_warps=WARPS)
    return out


def unpack_fixed(stream: torch.Tensor, m: int, width: int) -> torch.Tensor:
    """``[m]`` int64: the ``width``-bit fields of ``stream``."""
    check_runnable(stream)
    out = torch.empty(m, dtype=torch.int64, device=stream.device)
    if m:
        _fields_kernel[_grid(m)](stream, out, m, stream.numel(), width, BLOCK=BLOCK, num_warps=WARPS)
    return out
