"""Golomb-Rice coding of GTC messages: bit-exact round trips on adversarial messages, the size
the code promises, and clear errors on malformed input."""

from __future__ import annotations

import pytest
import torch

from gtc_lightning.ops.rice import (
    HEADER_BYTES,
    QMAX,
    rice_bits_per_word,
    rice_decode,
    rice_encode,
    rice_parameter,
)

SIGN = -(1 << 31)


def message(index, negative=None) -> torch.Tensor:
    index = torch.as_tensor(index, dtype=torch.int64)
    words = index.to(torch.int32)
    if negative is not None:
        words = torch.where(torch.as_tensor(negative), words | SIGN, words)
    return words


def random_message(n: int, density: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    index = torch.nonzero(torch.rand(n, generator=g) < density).squeeze(1)
    return message(index, torch.rand(index.numel(), generator=g) < 0.5)


CASES = {
    "no_words": message([]),
    "one_word": message([5]),
    "one_word_at_zero": message([0], [True]),
    "gap_zero_run": message(list(range(100, 164))),
    "all_negative": message(list(range(0, 3000, 3)), [True] * 1000),
    "gaps_near_2_31": message([0, (1 << 30), (1 << 31) - 2, (1 << 31) - 1], [False, True, False, True]),
    "first_index_huge": message([(1 << 31) - 1], [True]),
    "dense": random_message(5000, 0.6, 1),
    "density_0.5%": random_message(200_000, 0.005, 2),
    "density_0.05%": random_message(2_000_000, 0.0005, 3),
}


@pytest.mark.parametrize("name", CASES)
def test_round_trip_is_bit_exact(name):
    words = CASES[name]
    data = rice_encode(words)
    assert data.dtype == torch.uint8 and data.numel() % 4 == 0
    assert torch.equal(rice_decode(data), words)


@pytest.mark.parametrize("name", [n for n in CASES if n != "density_0.05%"])
def test_triton_bit_packing_matches_torch(name):
    """The Triton kernels (interpreted here) write and read the same bytes as the torch code."""
    words = CASES[name]
    data = rice_encode(words, backend="torch")
    assert torch.equal(rice_encode(words, backend="triton"), data)
    assert torch.equal(rice_decode(data, backend="triton"), words)


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("k", [None, 0, 9])
def test_numpy_bit_packing_matches_torch(name, k):
    """The CPU coding (NumPy's packbits, what "auto" runs on CPU tensors) writes and reads the same
    bytes as the torch code."""
    words = CASES[name]
    data = rice_encode(words, k=k, backend="torch")
    assert torch.equal(rice_encode(words, k=k, backend="numpy"), data)
    assert torch.equal(rice_encode(words, k=k), data)
    assert torch.equal(rice_decode(data, backend="numpy"), words)
    assert torch.equal(rice_decode(data, backend="torch"), words)


def test_unknown_or_misplaced_backend_is_refused():
    with pytest.raises(ValueError, match="backend in"):
        rice_encode(message([1, 2]), backend="cuda")
    from gtc_lightning.ops.rice import backend_for

    assert backend_for(message([1]), "auto") == "numpy" and backend_for(message([1]).to("meta"), "auto") == "torch"
    with pytest.raises(ValueError, match="backend='numpy' codes CPU tensors"):
        backend_for(message([1]).to("meta"), "numpy")


@pytest.mark.parametrize("k", [0, 1, 7, 30])
def test_round_trip_with_any_parameter(k):
    words = CASES["density_0.5%"]
    assert torch.equal(rice_decode(rice_encode(words, k=k)), words)


def test_size_near_the_entropy_of_the_gaps():
    """At 0.5 % density the mean gap is ~200: Rice needs about log2(200) + 2 ~ 9.6 bits a word,
    Strom's 10-11; the 32-bit words cost 32."""
    words = CASES["density_0.5%"]
    bits = rice_bits_per_word(rice_encode(words))
    assert 9.0 < bits < 11.0, bits


def test_escapes_keep_huge_gaps_small():
    words = CASES["gaps_near_2_31"]
    data = rice_encode(words, k=0)
    # 3 gaps of ~2**30 escape: QMAX + 1 unary bits each, not 2**30.
    assert data.numel() < HEADER_BYTES + 4 * (QMAX + 2) + 3 * 4 + 8


def test_parameter_choice_is_the_best_of_its_candidates():
    torch.manual_seed(5)
    gaps = torch.distributions.Geometric(probs=torch.tensor(0.01)).sample((4000,)).long()
    k = rice_parameter(gaps)
    sizes = {j: rice_encode(torch.cumsum(gaps + 1, 0).sub(1).to(torch.int32), k=j).numel() for j in range(12)}
    assert sizes[k] <= min(sizes.values()) * 1.01, (k, sizes)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (torch.zeros(3, dtype=torch.uint8), "16-byte header"),
        (torch.zeros(18, dtype=torch.uint8), "int32 words"),
        (torch.tensor([2, 0, 5, 0, 0], dtype=torch.int32).view(torch.uint8), "corrupt"),
    ],
)
def test_malformed_messages_are_refused(data, match):
    with pytest.raises(ValueError, match=match):
        rice_decode(data)


def test_unsorted_words_are_refused():
    with pytest.raises(ValueError, match="strictly ascending"):
        rice_encode(message([5, 3]))
    with pytest.raises(ValueError, match="strictly ascending"):
        rice_encode(message([5, 5]))
    with pytest.raises(ValueError, match="Rice parameter"):
        rice_encode(message([5]), k=31)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("rank", [0, 1, 2])
def test_decode_coded_takes_this_ranks_own_words(rank, padded):
    """Every rank's words as the exchange delivers them, with this rank's own words taken as given
    instead of decoded from its own message: the same words in the same rank order."""
    from gtc_lightning.algorithms.gtc.decode import decode_coded

    messages = [random_message(50_000, 0.01, 10 + r) for r in range(3)]
    messages[1] = message([])  # a rank with nothing to send
    coded = [rice_encode(m) for m in messages]
    sizes = [c.numel() for c in coded]
    if padded:  # an all-gather's rows, padded to the longest message
        width = max(sizes)
        data = torch.zeros(len(coded), width, dtype=torch.uint8)
        for r, c in enumerate(coded):
            data[r, : c.numel()] = c
        data = data.view(-1)
    else:
        data, width = torch.cat(coded), None
    expected = torch.cat(messages)
    assert torch.equal(decode_coded(data, sizes, width), expected)
    got = decode_coded(data, sizes, width, own=(rank, messages[rank].clone()))
    assert torch.equal(got, expected)
    # the own words are used, not decoded: other words in their place show up in the result, in place
    other = message([7, 9], [True, False])
    mixed = decode_coded(data, sizes, width, own=(rank, other))
    assert torch.equal(mixed, torch.cat([other if r == rank else m for r, m in enumerate(messages)]))
