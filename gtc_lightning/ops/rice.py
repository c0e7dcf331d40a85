"""Golomb-Rice coding of a GTC message: the gaps between its sorted indices, and the sign bits.

Strom (2015, section 2.5) notes that the gaps between the sorted indices of a message follow a
geometric distribution, so a Golomb-Rice code brings a word from 32 bits to about 10-11 at the
densities GTC runs at. A gap ``d`` with Rice parameter ``k`` is the quotient ``q = d >> k`` in
unary (``q`` ones, then a zero) and the remainder ``d & (2**k - 1)`` in ``k`` bits; each word adds
its sign bit.

Layout (one rank's message, ``uint8``)::

    header   4 x int32: words m, parameter k, unary bits U, escapes E (little-endian)
    unary    ceil(U / 8) bytes: per word min(q, QMAX) ones then a zero, MSB first
    fixed    ceil(m * (k + 1) / 8) bytes: per word k remainder bits then the sign bit, MSB first
    escapes  E x int32: the whole gap of each word with q >= QMAX, in word order

The unary parts and the fixed-width parts are kept in two streams rather than interleaved, so that
both directions are a handful of vectorised passes (prefix sums over lengths, positions of the
zeros) instead of a bit-serial parse; the number of bits is the same as the interleaved code's.
A gap of up to 2**31 - 1 with a small ``k`` would need billions of unary bits: quotients of
``QMAX`` or more are written as ``QMAX`` ones and the gap goes to the escape list.

``k`` is chosen per message as the one of ``k0 - 1, k0, k0 + 1`` (``k0 = log2`` of the mean gap)
that gives the fewest bits, computed exactly from the gaps.

Works on any device torch does (CPU and CUDA tensors alike).
"""

from __future__ import annotations

import math

import torch

INDEX_MASK = (1 << 31) - 1
SIGN_BIT = -(1 << 31)
QMAX = 32  # quotients >= QMAX are escaped
HEADER_BYTES = 16
MAX_K = 30


def _pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """``[L]`` 0/1 values -> ``[ceil(L/8)]`` uint8, MSB first (the tail padded with zeros)."""
    pad = (-bits.numel()) % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    weights = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.int32, device=bits.device)
    return (bits.view(-1, 8).to(torch.int32) * weights).sum(dim=1).to(torch.uint8)


def _unpack_bits(data: torch.Tensor) -> torch.Tensor:
    """``[B]`` uint8 -> ``[8B]`` int32 0/1, MSB first."""
    shifts = torch.arange(7, -1, -1, device=data.device, dtype=torch.int32)
    return ((data.to(torch.int32)[:, None] >> shifts) & 1).reshape(-1)


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


def rice_encode(words: torch.Tensor, k: int | None = None) -> torch.Tensor:
    """Encode one rank's message.

    Args:
        words: ``[m]`` int32 words ``index | sign << 31`` with strictly ascending indices (as
            ``threshold_`` writes them).
        k: the Rice parameter; None chooses it from the gaps.

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
    ones = torch.clamp(q, max=QMAX)
    ends = torch.cumsum(ones + 1, 0) - 1  # where each word's terminating zero sits
    unary_bits = int(ends[-1]) + 1 if m else 0
    unary = torch.ones(unary_bits, dtype=torch.int32, device=device)
    unary[ends] = 0
    fixed_value = ((gaps & ((1 << k) - 1)) << 1) | (words < 0).long()
    shifts = torch.arange(k, -1, -1, device=device)
    fixed = ((fixed_value[:, None] >> shifts) & 1).reshape(-1)
    escapes = gaps[escaped].to(torch.int32)
    header = torch.tensor([m, k, unary_bits, escapes.numel()], dtype=torch.int32, device=device)
    parts = [header.view(torch.uint8), _pack_bits(unary), _pack_bits(fixed), escapes.view(torch.uint8)]
    return torch.cat(parts)


def rice_decode(data: torch.Tensor) -> torch.Tensor:
    """Decode one rank's message made by :func:`rice_encode`.

    Args:
        data: ``[B]`` uint8.

    Returns:
        ``[m]`` int32 words, as given to the encoder.

    Raises:
        ValueError: a message too short for its header or its streams.
    """
    if data.numel() < HEADER_BYTES:
        raise ValueError(f"a Rice-coded message has a {HEADER_BYTES}-byte header, got {data.numel()} bytes")
    m, k, unary_bits, num_escapes = (int(x) for x in data[:HEADER_BYTES].clone().view(torch.int32))
    unary_bytes, fixed_bytes = (unary_bits + 7) // 8, (m * (k + 1) + 7) // 8
    expected = HEADER_BYTES + unary_bytes + fixed_bytes + 4 * num_escapes
    if data.numel() != expected or not 0 <= k <= MAX_K:
        raise ValueError(f"corrupt Rice-coded message: {data.numel()} bytes, header says {expected} (m={m}, k={k})")
    if m == 0:
        return torch.zeros(0, dtype=torch.int32, device=data.device)
    at = HEADER_BYTES
    unary = _unpack_bits(data[at : at + unary_bytes])[:unary_bits]
    at += unary_bytes
    fixed = _unpack_bits(data[at : at + fixed_bytes])[: m * (k + 1)].view(m, k + 1).long()
    at += fixed_bytes
    escapes = data[at:].clone().view(torch.int32).long()
    ends = torch.nonzero(unary == 0).squeeze(1)
    if ends.numel() != m:
        raise ValueError(f"corrupt Rice-coded message: {ends.numel()} unary codes for {m} words")
    q = ends - torch.cat([ends.new_full((1,), -1), ends[:-1]]) - 1
    weights = 1 << torch.arange(k, -1, -1, device=data.device)
    value = (fixed * weights).sum(dim=1)
    gaps = ((q << k) | (value >> 1)).long()
    escaped = q >= QMAX
    if int(escaped.sum()) != escapes.numel():
        raise ValueError("corrupt Rice-coded message: escape count does not match the quotients")
    gaps[escaped] = escapes
    index = torch.cumsum(gaps + 1, 0) - 1
    words = index.to(torch.int32)
    return torch.where((value & 1).bool(), words | SIGN_BIT, words)


def rice_bits_per_word(data: torch.Tensor) -> float:
    """Bits of the message (header included) per word it carries."""
    m = int(data[:HEADER_BYTES].clone().view(torch.int32)[0])
    return 8.0 * data.numel() / m if m else math.inf
