"""Golomb-Rice coding of a GTC message: the gaps between its sorted indices, and the sign bits.

Strom (2015, section 2.5) notes that the gaps between the sorted indices of a message follow a
geometric distribution, so a Golomb-Rice code brings a word from 32 bits to about 8-11 at the
densities GTC runs at. A gap ``d`` with Rice parameter ``k`` is the quotient ``q = d >> k`` in
unary (``q`` ones, then a zero) and the remainder ``d & (2**k - 1)`` in ``k`` bits; each word adds
its sign bit.

Layout (one rank's message, sent as bytes; every part a whole number of little-endian int32
words, bit ``j`` of a stream at bit ``31 - j % 32`` of word ``j // 32``)::

    header   4 words: words m, parameter k, unary bits U, escapes E
    unary    ceil(U / 32) words: per word min(q, QMAX) ones then a zero; padded with ones, so
             the stream holds exactly m zeros
    fixed    ceil(m * (k + 1) / 32) words: per word k remainder bits then the sign bit; padded
             with zeros
    escapes  E words: the whole gap of each word with q >= QMAX, in word order

The unary parts and the fixed-width parts are kept in two streams rather than interleaved, so that
both directions are a few parallel passes (prefix sums over lengths, positions of the zeros) in
torch and in Triton (``rice_kernels.py``, used for CUDA tensors), instead of a bit-serial parse;
the number of bits is the same as the interleaved code's. A gap of up to 2**31 - 1 with a small
``k`` would need billions of unary bits: quotients of ``QMAX`` or more are written as ``QMAX``
ones and the gap goes to the escape list.

``k`` is chosen per message as the one of ``k0 - 1, k0, k0 + 1`` (``k0 = log2`` of the mean gap
times ln 2) that gives the fewest bits, computed exactly from the gaps.
"""

from __future__ import annotations

import math

import numpy as np
import torch

INDEX_MASK = (1 << 31) - 1
SIGN_BIT = -(1 << 31)
QMAX = 32  # quotients >= QMAX are escaped
HEADER_BYTES = 16
MAX_K = 30


def pack_words(bits: torch.Tensor, pad: int) -> torch.Tensor:
    """``[L]`` 0/1 values -> ``[ceil(L/32)]`` int32 words, bit ``j`` at bit ``31 - j % 32`` of word
    ``j // 32``; the tail padded with ``pad`` bits."""
    extra = (-bits.numel()) % 32
    if extra:
        bits = torch.cat([bits, bits.new_full((extra,), pad)])
    shifts = torch.arange(31, -1, -1, device=bits.device)
    return (bits.view(-1, 32).long() << shifts).sum(dim=1).to(torch.int32)


def unpack_words(words: torch.Tensor) -> torch.Tensor:
    """``[W]`` int32 words -> ``[32 W]`` int64 0/1 bits, as :func:`pack_words` lays them out."""
    shifts = torch.arange(31, -1, -1, device=words.device)
    return ((words.long() & 0xFFFFFFFF)[:, None] >> shifts).reshape(-1) & 1


def _bits_for(gaps: torch.Tensor, k: int) -> int:
    q = gaps >> k
    return int(torch.clamp(q, max=QMAX).sum()) + gaps.numel() * (k + 2) + 32 * int((q >= QMAX).sum())


def rice_parameter(gaps: torch.Tensor) -> int:
    """The ``k`` of ``k0 - 1, k0, k0 + 1`` giving the fewest bits for ``gaps`` (``[m]`` int64)."""
    if gaps.numel() == 0:
        return 0
    mean = float(gaps.double().mean())
    k0 = math.floor(math.log2(max(mean * math.log(2), 1.0)))
    candidates = [k for k in (k0 - 1, k0, k0 + 1) if 0 <= k <= MAX_K]
    return min(candidates, key=lambda k: _bits_for(gaps, k))


def rice_encode(words: torch.Tensor, k: int | None = None, backend: str = "auto") -> torch.Tensor:
    """Encode one rank's message.

    Args:
        words: ``[m]`` int32 words ``index | sign << 31`` with strictly ascending indices (as
            ``threshold_`` writes them).
        k: the Rice parameter; None chooses it from the gaps.
        backend: ``"auto"`` (Triton's bit packing for CUDA tensors, NumPy's for CPU ones, torch's
            elsewhere), ``"torch"``, ``"numpy"`` or ``"triton"``.

    Returns:
        ``[B]`` uint8, the layout of the module docstring.

    Raises:
        ValueError: indices not strictly ascending, or ``k`` outside ``[0, 30]``.
    """
    device = words.device
    index = (words & INDEX_MASK).long()
    m = index.numel()
    previous = torch.cat([index.new_full((1,), -1), index[:-1]]) if m else index
    gaps = index - previous - 1
    if m and int(gaps.min()) < 0:
        raise ValueError("rice_encode needs strictly ascending indices (one word per element, sorted)")
    if k is None:
        k = rice_parameter(gaps)
    if not 0 <= k <= MAX_K:
        raise ValueError(f"Rice parameter k must be in [0, {MAX_K}], got {k}")
    q = gaps >> k
    escaped = q >= QMAX
    ends = torch.cumsum(torch.clamp(q, max=QMAX) + 1, 0) - 1  # where each word's terminating zero sits
    unary_bits = int(ends[-1]) + 1 if m else 0
    fixed_value = ((gaps & ((1 << k) - 1)) << 1) | (words < 0).long()
    chosen = backend_for(words, backend)
    if chosen == "triton":
        from gtc_lightning.ops.rice_kernels import pack_fixed, pack_unary

        unary, fixed = pack_unary(ends, unary_bits), pack_fixed(fixed_value, k + 1)
    elif chosen == "numpy":
        unary, fixed = _pack_unary_cpu(ends, unary_bits), _pack_fixed_cpu(fixed_value, k + 1)
    else:
        unary = torch.ones(unary_bits, dtype=torch.int64, device=device)
        unary[ends] = 0
        unary = pack_words(unary, pad=1)
        shifts = torch.arange(k, -1, -1, device=device)
        fixed = pack_words(((fixed_value[:, None] >> shifts) & 1).reshape(-1), pad=0)
    escapes = gaps[escaped].to(torch.int32)
    header = torch.tensor([m, k, unary_bits, escapes.numel()], dtype=torch.int32, device=device)
    return torch.cat([header, unary, fixed, escapes]).view(torch.uint8)


# The CPU twins of the bit packing, through NumPy's packbits/unpackbits: the same words to the bit,
# without the torch passes' int64 per bit (one core, 15,000 words a message: decoding 0.53 against
# 0.67 ms, encoding 0.60 against 0.76 ms, medians of 200; docs/benchmarks/kernels.md). A stream bit j
# at bit 31 - j % 32 of word j // 32 is bit j % 8 (first = most significant) of byte j // 8 once each
# word is written big-endian.


def _words_from_bits(bits: np.ndarray, pad: int) -> torch.Tensor:
    """``[L]`` uint8 0/1 bits -> ``[ceil(L/32)]`` int32 words, as :func:`pack_words` lays them out."""
    extra = (-bits.size) % 32
    if extra:
        bits = np.concatenate([bits, np.full(extra, pad, dtype=np.uint8)])
    return torch.from_numpy(np.packbits(bits).view(">u4").astype(np.uint32).view(np.int32))


def _bits_from_words(words: torch.Tensor) -> np.ndarray:
    """``[W]`` int32 words -> ``[32 W]`` uint8 0/1 bits, as :func:`unpack_words` reads them."""
    return np.unpackbits(words.numpy().view(np.uint32).astype(">u4").view(np.uint8))


def _pack_unary_cpu(ends: torch.Tensor, unary_bits: int) -> torch.Tensor:
    bits = np.ones(unary_bits, dtype=np.uint8)
    bits[ends.numpy()] = 0
    return _words_from_bits(bits, pad=1)


def _pack_fixed_cpu(value: torch.Tensor, width: int) -> torch.Tensor:
    """Each value's low ``width`` bits, most significant first, back to back."""
    per_value = np.unpackbits(value.numpy().astype(">u4").view(np.uint8).reshape(-1, 4), axis=1)
    return _words_from_bits(per_value[:, 32 - width :].reshape(-1), pad=0)


def _unpack_cpu(unary: torch.Tensor, fixed: torch.Tensor, m: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions of the unary stream's zeros and the ``m`` fixed-width values, as int64."""
    ends = torch.from_numpy(np.flatnonzero(_bits_from_words(unary) == 0))
    if ends.numel() != m:
        raise ValueError(f"corrupt Rice-coded message: {ends.numel()} unary codes for {m} words")
    bits = _bits_from_words(fixed)[: m * width].reshape(m, width)
    padded = np.zeros((m, 32), dtype=np.uint8)
    padded[:, 32 - width :] = bits
    value = np.packbits(padded, axis=1).view(">u4").reshape(m).astype(np.int64)
    return ends, torch.from_numpy(value)


BACKENDS = ("auto", "torch", "numpy", "triton")


def backend_for(t: torch.Tensor, backend: str) -> str:
    """``backend`` with ``"auto"`` resolved: Triton for CUDA tensors, NumPy for CPU ones, else torch."""
    if backend not in BACKENDS:
        raise ValueError(f"Expect backend in {BACKENDS}, got {backend!r}")
    if backend == "numpy" and t.device.type != "cpu":
        raise ValueError(f"backend='numpy' codes CPU tensors; this one is on {t.device}: use 'auto'")
    if backend != "auto":
        return backend
    return "triton" if t.is_cuda else "numpy" if t.device.type == "cpu" else "torch"


def rice_decode(data: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """Decode one rank's message made by :func:`rice_encode`.

    Args:
        data: ``[B]`` uint8.
        backend: as for :func:`rice_encode`.

    Returns:
        ``[m]`` int32 words, as given to the encoder.

    Raises:
        ValueError: a message too short for its header or its streams.
    """
    if data.numel() < HEADER_BYTES or data.numel() % 4:
        raise ValueError(
            f"a Rice-coded message is int32 words with a {HEADER_BYTES}-byte header, got {data.numel()} bytes"
        )
    words32 = data.view(torch.int32)
    m, k, unary_bits, num_escapes = (int(x) for x in words32[:4])
    unary_words, fixed_words = (unary_bits + 31) // 32, (m * (k + 1) + 31) // 32
    expected = 4 + unary_words + fixed_words + num_escapes
    if words32.numel() != expected or not 0 <= k <= MAX_K or m < 0:
        raise ValueError(
            f"corrupt Rice-coded message: {data.numel()} bytes, its header says {4 * expected} (m={m}, k={k})"
        )
    if m == 0:
        return torch.zeros(0, dtype=torch.int32, device=data.device)
    unary = words32[4 : 4 + unary_words]
    fixed = words32[4 + unary_words : 4 + unary_words + fixed_words]
    escapes = words32[4 + unary_words + fixed_words :].long()
    chosen = backend_for(data, backend)
    if chosen == "triton":
        from gtc_lightning.ops.rice_kernels import unpack_fixed, zero_positions

        ends, value = zero_positions(unary, m), unpack_fixed(fixed, m, k + 1)
    elif chosen == "numpy":
        ends, value = _unpack_cpu(unary, fixed, m, k + 1)
    else:
        ends = torch.nonzero(unpack_words(unary) == 0).squeeze(1)
        if ends.numel() != m:
            raise ValueError(f"corrupt Rice-coded message: {ends.numel()} unary codes for {m} words")
        bits = unpack_words(fixed)[: m * (k + 1)].view(m, k + 1)
        value = (bits << torch.arange(k, -1, -1, device=data.device)).sum(dim=1)
    q = ends - torch.cat([ends.new_full((1,), -1), ends[:-1]]) - 1
    gaps = (q << k) | (value >> 1)
    escaped = q >= QMAX
    if int(escaped.sum()) != escapes.numel():
        raise ValueError("corrupt Rice-coded message: escape count does not match the quotients")
    gaps[escaped] = escapes
    index = torch.cumsum(gaps + 1, 0) - 1
    out = index.to(torch.int32)
    return torch.where((value & 1).bool(), out | SIGN_BIT, out)


def rice_split(data: torch.Tensor) -> list[torch.Tensor]:
    """Messages of :func:`rice_encode` sent back to back (``[B]`` uint8), each one's bytes, in order;
    one message gives ``[data]``. Each message's length is read from its header (on the host).

    Raises:
        ValueError: a message's header runs past the data.
    """
    words32 = data.view(torch.int32)
    out, at, total = [], 0, words32.numel()
    while at < total:
        if total - at < 4:
            raise ValueError(f"corrupt Rice-coded messages: {4 * (total - at)} bytes left, less than a header")
        m, k, unary_bits, num_escapes = (int(x) for x in words32[at : at + 4])
        size = 4 + (unary_bits + 31) // 32 + (max(m, 0) * (k + 1) + 31) // 32 + num_escapes
        if size <= 0 or at + size > total:
            raise ValueError(
                f"corrupt Rice-coded messages: a header at byte {4 * at} says {4 * size} bytes, {4 * (total - at)} are left"
            )
        out.append(data[4 * at : 4 * (at + size)])
        at += size
    return out


def rice_bits_per_word(data: torch.Tensor) -> float:
    """Bits of the message (header included) per word it carries."""
    m = int(data.view(torch.int32)[0])
    return 8.0 * data.numel() / m if m else math.inf
