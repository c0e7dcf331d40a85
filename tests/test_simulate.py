"""The one-process simulation of many workers (gtc_lightning.tools.simulate) against real multi-process runs
of the strategies: the same parameters after every step (bit for bit on 2 ranks)."""

from __future__ import annotations

import pytest
import torch
from _averaging_helpers import fit_recorded
from _strategy_helpers import BATCH, SAMPLES, TinyMLP, dataset, fit, keep_master_port  # noqa: F401

from gtc_lightning import BMUFGTCStrategy, BMUFStrategy, GTCStrategy, ModelAveragingStrategy
from gtc_lightning.tools.simulate import VirtualWorkers

LR = 0.5


def simulate(scheme: str, workers: int, epochs: int = 2, samples: int = SAMPLES, **options) -> list[torch.Tensor]:
    """TinyMLP trained by ``workers`` simulated workers on the batches Lightning's distributed sampler
    gives each rank (torch's ``DistributedSampler``, shuffled with seed 0 + epoch: rank r takes every
    W-th sample of the permutation from r); worker 0's flat parameters after each step."""
    module = TinyMLP(momentum=0.0, samples=samples)
    sim = VirtualWorkers(module, lambda ps: torch.optim.SGD(ps, lr=LR), lambda m, b: m.loss(b), scheme, workers,
                         **options)
    x, y = dataset(samples).tensors
    out = []
    for epoch in range(epochs):
        order = torch.randperm(samples, generator=torch.Generator().manual_seed(epoch))
        shards = [order[r::workers] for r in range(workers)]
        for k in range(len(shards[0]) // BATCH):
            batches = [(x[s[k * BATCH:(k + 1) * BATCH]], y[s[k * BATCH:(k + 1) * BATCH]]) for s in shards]
            sim.step(batches)
            out.append(torch.cat([p.detach().reshape(-1) for p in sim.model.parameters()]).clone())
    return out, sim


def check(real: list[dict], simulated: list[torch.Tensor], exact: bool) -> None:
    assert len(real) == len(simulated)
    for t, (rec, params) in enumerate(zip(real, simulated)):
        if exact:
            assert torch.equal(rec["params"], params), f"step {t + 1}: max diff {(rec['params'] - params).abs().max()}"
        else:
            torch.testing.assert_close(params, rec["params"], atol=2e-5, rtol=0, msg=f"step {t + 1}")


def test_gtc_on_two_workers_equals_the_strategy_bit_for_bit(tmp_path):
    """Strom's gradient mode at a fixed tau in 32-bit words (what the simulator models), with a tau that
    sends more than a bf16 all-reduce on the first steps: the dense fallback enters at 2 ranks and leaves
    again, and both kinds of step, the switches and the bytes match the strategy's (2 ranks: bit for bit)."""
    _, ranks = fit(tmp_path, GTCStrategy, tau=0.03, compress="gradient", coding="none",
                   model_kwargs={"momentum": 0.0})  # fmt: skip
    with pytest.warns(RuntimeWarning, match=r"sparse exchange would send .* Raise tau \(now 0.03\)"):
        params, sim = simulate("gtc", 2, tau=0.03)
    check(ranks[0]["records"], params, exact=True)
    stats = sim.stats()["gtc"]
    real = ranks[0]["records"][-1]["stats"]["total"]
    assert stats["total"]["words"] == real["words"] > 0
    assert stats["total"]["dense_steps"] == real["dense_steps"] > 0
    assert stats["total"]["bytes_sent"] == real["bytes_sent"]


def test_gtc_on_four_workers_with_the_dense_fallback_equals_the_strategy(tmp_path):
    """tau small enough that the sparse exchange would send more than a bf16 all-reduce on some steps."""
    _, ranks = fit(tmp_path, GTCStrategy, devices=4, tau=0.07, compress="gradient", coding="none",
                   model_kwargs={"momentum": 0.0, "samples": 128})  # fmt: skip
    with pytest.warns(RuntimeWarning, match=r"sparse exchange would send .* Raise tau \(now 0.07\)"):
        params, sim = simulate("gtc", 4, samples=128, tau=0.07)
    check(ranks[0]["records"], params, exact=False)
    real = ranks[0]["records"][-1]["stats"]["total"]
    assert sim.totals["dense_steps"] == real["dense_steps"] > 0
    assert sim.totals["dense_steps"] < sim.step_count  # and some sparse steps


def test_gtc_on_four_workers_without_dense_steps_equals_the_strategy_bit_for_bit(tmp_path):
    """The decoded update is a count of votes (exact in any order), so without the dense fallback's
    float sums nothing depends on the order the ranks' words are added in."""
    _, ranks = fit(tmp_path, GTCStrategy, devices=4, tau=0.1, compress="gradient", coding="none",
                   model_kwargs={"momentum": 0.0, "samples": 128})  # fmt: skip
    params, sim = simulate("gtc", 4, samples=128, tau=0.1)
    assert sim.totals["dense_steps"] == 0 and sim.totals["words"] > 0
    check(ranks[0]["records"], params, exact=True)


def test_gtc_with_automatic_tau_equals_the_strategy_bit_for_bit(tmp_path):
    """One controller on the words both workers sent, as on every rank: the same taus and parameters."""
    _, ranks = fit(tmp_path, GTCStrategy, tau=0.01, target_density=0.05, compress="gradient", coding="none",
                   model_kwargs={"momentum": 0.0})  # fmt: skip
    params, sim = simulate("gtc", 2, tau=0.01, target_density=0.05)
    check(ranks[0]["records"], params, exact=True)
    real = ranks[0]["records"][-1]["stats"]
    assert real["last"]["tau"] != 0.01 and sim.taus[0] != 0.01  # tau moved (the same words say how far)
    assert sim.stats()["gtc"]["total"]["words"] == real["total"]["words"]


def test_bmuf_gtc_with_automatic_tau_moves_each_group_tau_on_its_own_words():
    params, sim = simulate("bmuf_gtc", 4, epochs=4, samples=128, period=3, tau=0.05, group_size=2,
                           target_density=0.3)  # fmt: skip
    fixed, _ = simulate("bmuf_gtc", 4, epochs=4, samples=128, period=3, tau=0.05, group_size=2)
    assert len(sim.taus) == 2 and all(t != 0.05 for t in sim.taus) and sim.taus[0] != sim.taus[1]
    assert not torch.equal(params[-1], fixed[-1])
    for controller in sim.controllers:  # each group's smoothed density ends near the target
        assert 0.9 < controller.ema / 0.3 < 1.1


@pytest.mark.parametrize("scheme,strategy", [("ma", ModelAveragingStrategy), ("bmuf", BMUFStrategy)])
def test_local_step_schemes_on_two_workers_equal_the_strategies_bit_for_bit(tmp_path, scheme, strategy):
    _, ranks, syncs = fit_recorded(tmp_path, strategy, period=3, model_kwargs={"momentum": 0.0})
    params, sim = simulate(scheme, 2, period=3)
    check(ranks[0]["records"], params, exact=True)
    assert sim.stats()["sync"]["total"]["bytes_sent"] == syncs[0][-1]["total"]["bytes_sent"]
    assert sim.totals["syncs"] == syncs[0][-1]["total"]["syncs"] == 2


def test_bmuf_gtc_on_four_workers_equals_the_strategy(tmp_path):
    _, ranks, syncs = fit_recorded(tmp_path, BMUFGTCStrategy, devices=4, period=3, tau=0.01, compress="gradient",
                                   coding="none", model_kwargs={"momentum": 0.0, "samples": 128})  # fmt: skip
    params, sim = simulate("bmuf_gtc", 4, samples=128, period=3, tau=0.01, group_size=2)
    check(ranks[0]["records"], params, exact=False)
    assert sim.block_momentum == 0.5  # 1 - 1/N for N = 2 groups
    assert sim.totals["syncs"] == syncs[0][-1]["total"]["syncs"]


def reference_gtc(workers: int, tau: float, steps: int = 6, group_size: int | None = None) -> list[torch.Tensor]:
    """GTC written out with the public ``compress`` / ``decompress`` (no dense fallback): one model
    per group, every worker's flat gradient added to its own residual; the group's parameters after
    each step."""
    from gtc_lightning.ops import compress, decompress

    size = group_size or workers
    models = [TinyMLP(momentum=0.0, samples=128) for _ in range(workers // size)]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    optimizers = [torch.optim.SGD(m.parameters(), lr=LR) for m in models]
    numel = sum(p.numel() for p in models[0].parameters())
    residuals = torch.zeros(workers, numel)
    x, y = dataset(128).tensors
    out = []
    for t in range(steps):
        for g, (model, opt) in enumerate(zip(models, optimizers)):
            words = []
            for w in range(g * size, (g + 1) * size):
                model.zero_grad(set_to_none=True)
                rows = slice((t * workers + w) * 2 % 128, (t * workers + w) * 2 % 128 + 2)
                model.loss((x[rows], y[rows])).backward()
                grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
                words.append(compress(grad, residuals[w], tau))
            update = decompress(torch.cat(words), numel, tau, divisor=size)
            start = 0
            for p in model.parameters():
                p.grad = update[start : start + p.numel()].view_as(p).clone()
                start += p.numel()
            opt.step()
        out.append([torch.cat([p.detach().reshape(-1) for p in m.parameters()]).clone() for m in models])
    return out, residuals


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gtc_at_many_workers_equals_compress_and_decompress_bit_for_bit(backend):
    """The simulator adds each worker's gradient into its residual by autograd and thresholds it with
    the hook's primitives (Triton's through a kept zero vector): the same bits as the public ops."""
    x, y = dataset(128).tensors
    for scheme, workers, group in (("gtc", 5, None), ("bmuf_gtc", 6, 3)):
        expected, residuals = reference_gtc(workers, tau=0.01, group_size=group)
        sim = VirtualWorkers(TinyMLP(momentum=0.0, samples=128), lambda ps: torch.optim.SGD(ps, lr=LR),
                             lambda m, b: m.loss(b), scheme, workers, tau=0.01, period=1000, group_size=group or 2,
                             dense_fallback=False, backend=backend)  # fmt: skip
        for t, params in enumerate(expected):
            batches = []
            for w in range(workers):
                start = (t * workers + w) * 2 % 128
                batches.append((x[start : start + 2], y[start : start + 2]))
            sim.step(batches)
            for model, want in zip(sim.models, params):
                assert torch.equal(torch.cat([p.detach().reshape(-1) for p in model.parameters()]), want), (scheme, t)
        assert sim.totals["words"] > 0
        for w in range(workers):
            assert torch.equal(sim.residuals[w], residuals[w]), (scheme, w)


def test_a_non_finite_gradient_names_the_worker_and_step():
    sim = VirtualWorkers(TinyMLP(momentum=0.0), lambda ps: torch.optim.SGD(ps, lr=LR),
                         lambda m, b: m.loss(b[:2]) * b[2], "gtc", 3, dense_fallback=False)  # fmt: skip
    x, y = dataset(SAMPLES).tensors
    sim.step([(x[:2], y[:2], 1.0)] * 3)
    with pytest.raises(ValueError, match=r"worker 1's gradient has \d+ non-finite element\(s\) .* at step 1"):
        sim.step([(x[:2], y[:2], 1.0), (x[:2], y[:2], float("nan")), (x[:2], y[:2], 1.0)])


def test_bad_settings_say_what_is_wrong():
    module = TinyMLP(momentum=0.0)
    make = lambda **kw: VirtualWorkers(module, lambda ps: torch.optim.SGD(ps, lr=LR), lambda m, b: m.loss(b), **kw)
    with pytest.raises(ValueError, match="scheme in"):
        make(scheme="dpsgd", workers=2)
    with pytest.raises(ValueError, match="workers to be an int >= 2"):
        make(scheme="gtc", workers=1)
    with pytest.raises(ValueError, match="does not divide"):
        make(scheme="bmuf_gtc", workers=6, group_size=4)
    with pytest.raises(ValueError, match="period"):
        make(scheme="bmuf", workers=2, period=0)
    with pytest.raises(ValueError, match="target_density .* not 'bmuf'"):
        make(scheme="bmuf", workers=2, target_density=1e-3)
    with pytest.raises(ValueError, match="target_density in"):
        make(scheme="gtc", workers=2, target_density=2.0)
    with pytest.raises(ValueError, match="float32 parameters"):
        VirtualWorkers(TinyMLP(momentum=0.0).double(), lambda ps: torch.optim.SGD(ps, lr=LR), lambda m, b: m.loss(b),
                       "gtc", 2)  # fmt: skip
    sim = make(scheme="ma", workers=2)
    with pytest.raises(ValueError, match="one batch per worker"):
        sim.step([None])


@pytest.mark.parametrize("scheme", ["ma", "bmuf", "gtc"])
def test_evaluated_is_the_mean_of_the_workers_models_as_a_real_runs_validation(scheme):
    """Between syncs (8 steps, K = 3) ``evaluated()`` holds the mean of the learners' models, each
    divided by their number and summed in order (a 2-rank all-reduce's), and worker 0's own come back
    after; ``gtc`` has one model, which it holds as it is."""
    _, sim = simulate(scheme, 2, tau=0.01, period=3) if scheme == "gtc" else simulate(scheme, 2, period=3)
    flat = [torch.cat([p.detach().reshape(-1) for p in m.parameters()]).clone() for m in sim.models]
    with sim.evaluated() as model:
        seen = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
    after = torch.cat([p.detach().reshape(-1) for p in sim.model.parameters()])
    assert torch.equal(after, flat[0]), "worker 0's own parameters did not come back"
    if scheme == "gtc":
        assert len(flat) == 1 and torch.equal(seen, flat[0])
    else:
        assert not torch.equal(flat[0], flat[1]), "the test needs workers apart"
        assert torch.equal(seen, flat[0] / 2 + flat[1] / 2)
