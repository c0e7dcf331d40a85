"""The hook's step primitives (``threshold_``, ``apply_words_``, ``decode_``): the torch backend
and its Triton twin (interpreted) bit for bit, and both against the reference ``compress`` /
``decompress`` they must reproduce when chained."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gtc_lightning.ops import step_ops, torch_ops
from gtc_lightning.ops import triton_kernels as tk
from gtc_lightning.ops.reference import compress_reference, decompress_reference

TAU = 0.75
BACKENDS = {"torch": torch_ops, "triton": tk}


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def run_threshold(ops, grad, residual, tau=TAU, offset=0, alpha=1.0, clip=None, capacity=None, cursor0=0,
                  device="cpu"):
    """One ``threshold_`` of ``ops`` on ``device`` (``tests/test_cuda.py`` passes CUDA); returns
    ``(new residual, words, non-finite count, whole message)``, on CPU."""
    grad, residual = grad.to(device, copy=True), residual.to(device)
    out = torch.full_like(residual, 123.0)
    message = torch.full((capacity or grad.numel() + cursor0 + 1,), -7, dtype=torch.int32, device=device)
    cursor = torch.tensor([cursor0], dtype=torch.int64, device=device)
    bad = torch.zeros(1, dtype=torch.int32, device=device)
    ops.threshold_(grad, residual, out, tau, message, cursor, bad, offset=offset, alpha=alpha, clip=clip)
    return out.cpu(), message[cursor0 : int(cursor)].cpu(), int(bad), message.cpu()


CASES = {
    "empty": (torch.zeros(0), torch.zeros(0)),
    "tiny": (torch.tensor([1.0, -0.5, 0.0]), torch.tensor([0.0, -0.5, 0.75])),
    "not_a_chunk_multiple": (torch.randn(1001, generator=gen(1)), torch.randn(1001, generator=gen(2)) * 0.5),
    "dense": (torch.randn(5000, generator=gen(3)) * 3, torch.zeros(5000)),
    "sparse": (torch.randn(70_000, generator=gen(4)) * 0.1, (torch.rand(70_000, generator=gen(5)) - 0.5)),
    "exactly_tau": (torch.tensor([TAU, -TAU, 0.375, -0.375] * 9), torch.zeros(36)),
}


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("offset", [0, 1000, (1 << 31) - 70_001])
def test_threshold_is_compress_out_of_place(name, offset):
    """Words (shifted by the offset) and new residual as the reference compress, bit for bit; the
    old residual is untouched; apply_words_ with -tau takes the subtraction back."""
    grad, residual = CASES[name]
    ref_residual = residual.clone()
    ref_words = compress_reference(grad, ref_residual, TAU)
    index = ref_words & ((1 << 31) - 1)
    expected = (index + offset).to(torch.int32) | (ref_words & torch.tensor(-(1 << 31), dtype=torch.int32))
    before = residual.clone()
    for name_b, ops in BACKENDS.items():
        out, words, bad, _ = run_threshold(ops, grad, residual, offset=offset, cursor0=3)
        assert bad == 0
        assert torch.equal(words, expected), name_b
        assert torch.equal(out.view(torch.int32), ref_residual.view(torch.int32)), name_b
        assert torch.equal(residual, before), name_b
        ops.apply_words_(out, ref_words, -TAU)  # local indices into this chunk
        assert torch.allclose(out, residual + grad, rtol=0, atol=1e-6), name_b


@pytest.mark.parametrize("clip", [None, 0.3])
def test_alpha_and_clip_fold_into_the_gradient(clip):
    grad, residual = CASES["not_a_chunk_multiple"]
    grad = grad * 1024.0  # loss-scaled by 2**10
    results = [run_threshold(ops, grad, residual, alpha=1 / 1024, clip=None if clip is None else clip * 1024)
               for ops in BACKENDS.values()]
    (out_t, words_t, _, _), (out_k, words_k, _, _) = results
    assert torch.equal(out_t, out_k) and torch.equal(words_t, words_k)
    g = grad.clamp(-clip * 1024, clip * 1024) if clip else grad
    expected = residual.clone()
    assert torch.equal(words_t, compress_reference(g / 1024, expected, TAU))
    assert torch.equal(out_t, expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_clip_of_half_precision_gradients_rounds_like_torch_clamp(dtype):
    """A clip bound the gradient's dtype cannot hold (0.3 * 1024) clamps to that bound rounded to
    the dtype, as ``grad.clamp_`` does in the torch backend (the kernel once kept it in float32: seen
    on an H100, where the interpreter's test had only float32 gradients)."""
    grad, residual = CASES["sparse"]
    half = (grad * 1024.0 * 4).to(dtype)
    results = [run_threshold(ops, half, residual, alpha=1 / 1024, clip=0.3 * 1024) for ops in BACKENDS.values()]
    (out_t, words_t, _, _), (out_k, words_k, _, _) = results
    assert torch.equal(words_t, words_k) and torch.equal(out_t.view(torch.int32), out_k.view(torch.int32))
    clamped = half.clamp(-0.3 * 1024, 0.3 * 1024)
    assert (clamped.abs() == float(torch.tensor(0.3 * 1024).to(dtype))).any()
    expected = residual.clone()
    compress_reference(clamped.float() / 1024, expected, TAU)
    assert torch.equal(out_t, expected)


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("bad_value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_values_are_counted(backend, bad_value):
    grad, residual = CASES["sparse"]
    grad = grad.clone()
    grad[[5, 40_000, 69_999]] = bad_value
    _, _, bad, _ = run_threshold(BACKENDS[backend], grad, residual)
    assert bad == 3
    # A finite sum that overflows in the residual counts too.
    _, _, bad, _ = run_threshold(BACKENDS[backend], torch.tensor([3e38, 1.0]), torch.tensor([3e38, 0.0]))
    assert bad == 1


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_grad_is_only_read_and_may_be_half_precision(backend):
    ops = BACKENDS[backend]
    grad, residual = CASES["tiny"]
    g = grad.clone()
    message, cursor, bad = torch.zeros(8, dtype=torch.int32), torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int32)
    ops.threshold_(g, residual, torch.empty(3), TAU, message, cursor, bad)
    assert torch.equal(g, grad) and int(cursor) == 2
    half = grad.to(torch.bfloat16)
    out = torch.empty(3)
    ops.threshold_(half, residual, out, TAU, message, cursor, bad)
    expected = residual.clone()
    compress_reference(half.float(), expected, TAU)
    assert torch.equal(out, expected) and int(cursor) == 2 * 2


@pytest.mark.parametrize("padded", [False, True])
def test_decode_matches_reference_and_clears_counts(padded):
    n, world = 20_000, 3
    g = gen(9)
    messages = [torch.unique(torch.randint(0, n, (int(n * d),), generator=g)).to(torch.int32) for d in (0.01, 0.2, 0.0)]
    messages = [torch.where(torch.rand(m.numel(), generator=g) < 0.5, m | -(1 << 31), m).to(torch.int32) for m in messages]
    scale = float(np.float32(np.float32(TAU) / world))
    reference = decompress_reference(torch.cat(messages), n, scale)
    if padded:
        width = max(m.numel() for m in messages)
        words = torch.full((world, width), 12345, dtype=torch.int32)  # padding garbage must be ignored
        for r, m in enumerate(messages):
            words[r, : m.numel()] = m
        words, lengths = words.view(-1), [m.numel() for m in messages]
    else:
        words, lengths = torch.cat(messages), None
    for name, ops in BACKENDS.items():
        counts = torch.zeros(n, dtype=ops.COUNTS_DTYPE)
        outs = [torch.full((7000,), 5.0), torch.full((n - 7000,), 5.0)]
        ops.decode_(words, lengths, counts, [(0, outs[0]), (7000, outs[1])], scale)
        assert torch.equal(torch.cat(outs).view(torch.int32), reference.view(torch.int32)), name
        assert not counts.any(), name


def test_decode_into_half_precision_buckets():
    words = torch.tensor([0, 2, 2, 5 | -(1 << 31)], dtype=torch.int32)
    outs = []
    for ops in BACKENDS.values():
        out = torch.zeros(6, dtype=torch.bfloat16)
        ops.decode_(words, None, torch.zeros(6, dtype=ops.COUNTS_DTYPE), [(0, out)], 0.375)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    assert outs[0].float().tolist() == [0.375, 0, 0.75, 0, 0, -0.375]


def test_step_ops_dispatch():
    assert step_ops(torch.device("cpu")) is torch_ops
    assert step_ops(torch.device("cpu"), "triton") is tk  # TRITON_INTERPRET=1 in the tests
    assert step_ops(torch.device("cuda"), "torch") is torch_ops
    with pytest.raises(ValueError, match="backend"):
        step_ops(torch.device("cpu"), "cuda")


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setattr(tk, "INTERPRETED", False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        step_ops(torch.device("cpu"), "triton")
