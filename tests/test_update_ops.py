"""The update mode's primitives (``gtc_lightning.ops.update_ops``): the one-pass fold and emission against
the two-pass reference, bit for bit, on fixed seeds; the sampled fold; the update applied at the words;
and a whole update-mode step through either path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gtc_lightning.ops import torch_ops, update_ops
from gtc_lightning.ops.update_ops import FOLD_CHUNK


def _case(n: int, seed: int, tau: float) -> tuple:
    """A parameter after a step, the copy kept before it, a residual: some elements tied exactly at the
    threshold after the fold, some far beyond it."""
    g = torch.Generator().manual_seed(seed)
    kept = torch.randn(n, generator=g)
    param = kept - 0.01 * torch.randn(n, generator=g)
    residual = torch.randn(n, generator=g) * tau
    lr = 0.1
    fold = update_ops.fold_at([(param, 0, lr)], kept, residual, torch.arange(n))
    ties = torch.randint(n, (n // 100,), generator=g)
    residual[ties] += torch.tensor(tau, dtype=torch.float32) - fold[ties]  # |r| == tau (or a rounding away)
    return param, kept, residual, lr


def _reference(param, kept, residual, lr, tau, offset):
    """fold_ then emit_, with the message over the kept copy as in the update mode."""
    param, residual, buffer = param.clone(), residual.clone(), kept.clone()
    message, cursor, bad = buffer.view(torch.int32), torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int32)
    update_ops.fold_(param, buffer, residual, lr)
    torch_ops.emit_(residual, tau, message, cursor, bad, offset)
    return param, residual, message[: int(cursor)].clone(), int(bad)


def _fused(param, kept, residual, lr, tau, offset):
    param, residual, buffer = param.clone(), residual.clone(), kept.clone()
    message, cursor, bad = buffer.view(torch.int32), torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int32)
    update_ops.fold_emit_(param, buffer, residual, lr, tau, message, cursor, bad, offset)
    return param, residual, message[: int(cursor)].clone(), int(bad)


@pytest.mark.parametrize("n", [1, 1000, FOLD_CHUNK, 3 * FOLD_CHUNK + 17], ids=lambda n: f"n{n}")
@pytest.mark.parametrize("seed", [0, 1])
def test_the_one_pass_fold_matches_the_two_passes_to_the_bit(n, seed):
    tau = 0.02
    param, kept, residual, lr = _case(n, seed, tau)
    want, got = _reference(param, kept, residual, lr, tau, 5), _fused(param, kept, residual, lr, tau, 5)
    for name, a, b in zip(("param", "residual", "words", "non-finite"), want, got):
        assert (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b), name
    assert torch.equal(got[0], kept), "the parameter is back at the kept copy"
    if n >= 1000:
        assert 0 < got[2].numel() < n
        assert torch.all((got[2] & torch_ops.INDEX_MASK) >= 5), "words carry the offset"


def test_the_one_pass_fold_counts_non_finite_elements_as_the_reference_does():
    tau = 0.02
    param, kept, residual, lr = _case(2 * FOLD_CHUNK, 3, tau)
    param[[7, FOLD_CHUNK + 3]] = float("nan")
    residual[100] = float("inf")
    want, got = _reference(param, kept, residual, lr, tau, 0), _fused(param, kept, residual, lr, tau, 0)
    assert want[3] == got[3] == 3
    assert torch.equal(want[2], got[2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_sampled_fold_is_the_fold_at_those_elements(dtype):
    """Two parameters in one flat buffer (the second one's rate its own), sampled across both."""
    param, kept, residual, lr = _case(5000, 4, 0.02)
    first, second = param[:3000].view(30, 100).to(dtype), param[3000:].to(dtype)
    kept = torch.cat([first.float().reshape(-1), second.float()]) - 0.01
    index = torch.tensor([0, 17, 2999, 3000, 4999])
    at = update_ops.fold_at([(first, 0, lr), (second, 3000, 2 * lr)], kept, residual, index)
    folded = residual.clone()
    update_ops.fold_(first.clone(), kept[:3000], folded[:3000], lr)
    update_ops.fold_(second.clone(), kept[3000:], folded[3000:], 2 * lr)
    assert torch.equal(at, folded[index])


def test_a_low_precision_parameter_takes_the_reference_path():
    param, kept, residual, lr = _case(3000, 5, 0.02)
    low = param.to(torch.bfloat16)
    kept = low.float()
    a, b = _reference(low, kept, residual, lr, 0.02, 0), _fused(low, kept, residual, lr, 0.02, 0)
    assert all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b))
    assert a[0].dtype == torch.bfloat16


def test_the_update_at_the_words_is_the_dense_update_there():
    g = torch.Generator().manual_seed(6)
    param = torch.randn(40, 50, generator=g)
    update = torch.zeros(2000)
    index = torch.tensor([3, 1999, 3, 640, 0, 640])  # repeats, as two ranks' words on one element
    update[index] = torch.randn(index.numel(), generator=g)[[0, 1, 0, 3, 4, 3]]
    dense = param.clone()
    dense.add_(update.view_as(dense), alpha=-0.3)
    sparse = param.clone()
    update_ops.apply_words_(sparse, update[index], index, 0.3)
    assert torch.equal(sparse, dense)


def test_a_step_through_the_one_pass_path_equals_one_through_the_reference(monkeypatch):
    """A whole update-mode step (one rank) with a layer above one sample and one below the sparse-update
    size: the same words, residual and parameters whether the fold runs in one pass or two and the
    update is applied at the words or densely (``update.ONE_PASS``)."""
    import torch.distributed as dist

    from gtc_lightning import GTCState
    from gtc_lightning.algorithms.gtc import update as update_mode

    def run(one_pass: bool) -> tuple:
        monkeypatch.setattr(update_mode, "ONE_PASS", one_pass)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(512, 300), torch.nn.Tanh(), torch.nn.Linear(300, 10))
        params = list(model.parameters())
        state = GTCState(None, model.named_parameters(), tau="auto", target_density=0.01, compress="update")
        g = torch.Generator().manual_seed(1)
        out = []
        for _ in range(3):
            update_mode.begin(state, params)
            with torch.no_grad():
                for p in params:
                    p.sub_(0.1 * torch.randn(p.shape, generator=g))
            stats = update_mode.exchange(state, params, {id(p): 0.1 for p in params})
            out.append((stats.words, stats.tau, torch.cat([p.detach().reshape(-1) for p in params]).clone(),
                        state.residual_vector().clone()))  # fmt: skip
        monkeypatch.undo()
        return out

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        fused, reference = run(True), run(False)
    finally:
        dist.destroy_process_group()
    for t, (a, b) in enumerate(zip(fused, reference, strict=True)):
        assert a[0] == b[0] > 0 and a[1] == b[1], f"step {t + 1}: words or tau"
        assert torch.equal(a[2], b[2]) and torch.equal(a[3], b[3]), f"step {t + 1}: parameters or residual"
    assert np.isclose(fused[0][0] / sum(p.numel() for p in torch.nn.Linear(512, 300).parameters()), 0.01, rtol=0.5)
