"""The update mode's Triton twin (``triton_kernels.fold_emit_``, interpreted here) against the reference
passes of ``update_ops`` (``fold_`` then ``torch_ops.emit_``) bit for bit: sizes across many small
blocks, ties at tau, NaN/Inf, an offset, the message over the kept copy, low-precision parameters; its
emission-only form against ``torch_ops.emit_``; ``update_ops.fold_emit_``'s dispatch; a whole
update-mode step through the twin; the benchmark's fold rows. ``tests/test_cuda.py`` runs the same cases
compiled on a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from gtc_lightning.ops import torch_ops, update_ops
from gtc_lightning.ops import triton_kernels as tk

TAU = 0.02
LR = 0.1


def bits(t: torch.Tensor) -> torch.Tensor:
    """Float bits as int32, every NaN as one pattern (a GPU's arithmetic returns its canonical NaN, the
    CPU keeps the operand's payload)."""
    t = t.float()
    return torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t).view(torch.int32)


def make_case(n: int, seed: int, nonfinite: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(param after a step, kept before it, residual)``: about 1 % of the elements tied exactly at
    ``±tau`` after the fold (a zero step onto a residual of ``±tau``: not sent), as many a float32
    ulp above it (sent), many far beyond it; with ``nonfinite`` a NaN and an Inf step and an Inf
    residual."""
    g = torch.Generator().manual_seed(seed)
    kept = torch.randn(n, generator=g)
    param = kept - LR * 0.01 * torch.randn(n, generator=g)
    residual = torch.randn(n, generator=g) * TAU
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    tau = torch.tensor(TAU, dtype=torch.float32)
    above = torch.tensor(np.nextafter(np.float32(TAU), np.float32(1.0)))
    for value in (tau, above):
        at = torch.randperm(n, generator=g)[: max(1, n // 100)]
        param[at], residual[at] = kept[at], sign[at] * value
    if nonfinite and n >= 4:
        param[1], param[n // 2] = float("nan"), float("inf")
        residual[n - 1] = -float("inf")
    return param, kept, residual


def run(fn, param, kept, residual, offset: int = 0, base: int = 0, cursor0: int = 0, device="cpu", **kw) -> tuple:
    """One fold and emission by ``fn`` on ``device``, the message over the kept copy as in the update
    mode: a flat buffer holds ``base`` elements of other parameters, then this one's kept copy; the
    message is the buffer's int32 view, ``cursor0 <= base`` words already in it. Returns ``(param,
    residual, the whole buffer's bits, words, non-finite count)`` on CPU."""
    param, residual = param.to(device, copy=True), residual.to(device, copy=True)
    buffer = torch.cat([torch.full((base,), 9.0), kept]).to(device)
    message = buffer.view(torch.int32)
    cursor = torch.tensor([cursor0], dtype=torch.int64, device=device)
    bad = torch.zeros(1, dtype=torch.int32, device=device)
    fn(param, buffer[base:], residual, LR, TAU, message, cursor, bad, offset, **kw)
    words = message[cursor0 : int(cursor)].cpu().clone()
    return param.cpu(), residual.cpu(), message.cpu().clone(), words, int(bad)


def reference(param, kept, residual, lr, tau32, message, cursor, bad, offset=0):
    """``update_ops``' two passes, on any device."""
    update_ops.fold_(param, kept, residual, lr)
    torch_ops.emit_(residual, tau32, message, cursor, bad, offset)


def assert_same(got: tuple, want: tuple) -> None:
    for name, a, b in zip(("param", "residual", "buffer", "words", "non-finite"), got, want):
        if isinstance(a, torch.Tensor):
            same = torch.equal(a, b) if a.dtype == torch.int32 else torch.equal(bits(a), bits(b))
            assert same and a.dtype == b.dtype, name
        else:
            assert a == b, name


@pytest.mark.parametrize("n", [1, 63, 64, 65, 1000, 4099], ids=lambda n: f"n{n}")
@pytest.mark.parametrize("block", [16, 64])
def test_fold_emit_matches_the_reference_across_blocks(n, block):
    param, kept, residual = make_case(n, seed=n)
    want = run(reference, param, kept, residual, offset=5, base=5, cursor0=3)
    got = run(tk.fold_emit_, param, kept, residual, offset=5, base=5, cursor0=3, block=block)
    assert_same(got, want)
    assert torch.equal(bits(got[0]), bits(kept)), "the parameter is back at the kept copy"
    if n >= 1000:
        assert 0.005 * n < got[3].numel() < n
        assert torch.all((got[3] & torch_ops.INDEX_MASK) >= 5), "words carry the offset"


@pytest.mark.parametrize(("n", "block"), [(100_000, tk.COMPRESS_BLOCK), (70_000, 1024)])
def test_fold_emit_matches_the_reference_at_larger_sizes(n, block):
    param, kept, residual = make_case(n, seed=1)
    want = run(reference, param, kept, residual, offset=1000, base=1000, cursor0=1000)
    assert_same(run(tk.fold_emit_, param, kept, residual, offset=1000, base=1000, cursor0=1000, block=block), want)


def test_ties_at_tau_are_kept_and_a_ulp_above_is_sent():
    param, kept, residual = make_case(4099, seed=2)
    got = run(tk.fold_emit_, param, kept, residual, block=64)
    tied = (param == kept) & (residual.abs() == TAU)
    above = (param == kept) & (residual.abs() > TAU) & (residual.abs() < 1.0001 * TAU)
    assert tied.sum() >= 40 and above.sum() >= 40
    sent = torch.zeros(4099, dtype=torch.bool)
    sent[(got[3] & torch_ops.INDEX_MASK).long()] = True
    assert not sent[tied].any() and sent[above].all()
    assert torch.equal(got[1][tied], residual[tied])


@pytest.mark.parametrize("block", [64, tk.COMPRESS_BLOCK])
def test_non_finite_elements_are_counted_and_sent_as_the_reference_does(block):
    param, kept, residual = make_case(3000, seed=3, nonfinite=True)
    want = run(reference, param, kept, residual)
    got = run(tk.fold_emit_, param, kept, residual, block=block)
    assert want[4] == 3
    assert_same(got, want)


def test_an_offset_near_the_last_index():
    param, kept, residual = make_case(5000, seed=4)
    offset = (1 << 31) - 5001
    want, got = run(reference, param, kept, residual, offset), run(tk.fold_emit_, param, kept, residual, offset, block=256)
    assert_same(got, want)
    assert int((got[3] & torch_ops.INDEX_MASK).max()) <= (1 << 31) - 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_low_precision_parameter_is_folded_in_torch_then_emitted(dtype):
    param, kept, residual = make_case(3000, seed=5)
    low = param.to(dtype)
    kept = low.float() + 0.01
    want = run(reference, low, kept, residual)
    got = run(tk.fold_emit_, low, kept, residual, block=256)
    assert got[0].dtype == dtype and got[3].numel() > 0
    assert_same(got, want)


def test_a_shaped_parameter_folds_in_its_element_order():
    param, kept, residual = make_case(3000, seed=6)
    shaped, strided = param.view(30, 100), param.view(100, 30).t()  # contiguous, and not
    for p in (shaped, strided):
        want = run(reference, p, kept, residual)
        got = run(tk.fold_emit_, p, kept, residual, block=256)
        assert got[0].shape == p.shape
        assert_same(got, want)


def test_emit_is_torch_emit():
    g = torch.Generator().manual_seed(7)
    out = torch.randn(5000, generator=g) * TAU
    out[[3, 4000]] = torch.tensor([float("nan"), -float("inf")])
    out[10:20] = TAU
    results = []
    for emit in (torch_ops.emit_, lambda *a: tk.emit_(*a, block=64)):
        r = out.clone()
        message = torch.full((5010,), -7, dtype=torch.int32)
        cursor, bad = torch.tensor([10]), torch.zeros(1, dtype=torch.int32)
        emit(r, TAU, message, cursor, bad, 3)
        results.append((bits(r), message, int(cursor), int(bad)))
    (r_t, m_t, c_t, b_t), (r_k, m_k, c_k, b_k) = results
    assert c_t == c_k > 10 and b_t == b_k == 2
    assert torch.equal(r_t, r_k) and torch.equal(m_t, m_k)


def test_update_ops_dispatches_to_the_twin_when_asked(monkeypatch):
    param, kept, residual = make_case(2000, seed=8)
    calls = []
    twin = tk.fold_emit_
    monkeypatch.setattr(tk, "fold_emit_", lambda *a, **kw: calls.append(1) or twin(*a, **kw))
    want = run(update_ops.fold_emit_, param, kept, residual, 7)
    assert not calls, "CPU tensors keep update_ops' own passes"
    assert_same(run(update_ops.fold_emit_, param, kept, residual, 7, backend="triton"), want)
    assert calls == [1]
    assert_same(run(update_ops.fold_emit_, param, kept, residual, 7, backend="torch"), want)
    with pytest.raises(ValueError, match="backend"):
        run(update_ops.fold_emit_, param, kept, residual, backend="cuda")
    monkeypatch.setattr(tk, "INTERPRETED", False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        run(update_ops.fold_emit_, param, kept, residual, backend="triton")


def test_mismatched_buffers_are_refused_with_their_sizes():
    param, kept, residual = make_case(100, seed=9)
    with pytest.raises(ValueError, match="param has 100 elements, kept 99"):
        run(tk.fold_emit_, param, kept[:99], residual[:99])


def update_steps(
    device: torch.device | str, backend: str = "auto", steps: int = 3, word_levels: int = 1
) -> tuple[list[tuple], int]:
    """``steps`` update-mode steps of one rank (a 1-rank gloo group) on ``device``, with GTC's ``backend``
    (``update_ops.fold_emit_`` runs through it): a layer above one threshold sample and the sparse update's size, two below.
    With ``word_levels`` > 1 the threshold is fixed at 0.05, a tenth of the steps' scale, so that most
    words go out at the upper levels.

    The threshold's sample is drawn by a CPU generator with the step's seed on every device (a CUDA
    generator draws other numbers: the sample, and so tau, would differ); on CPU that is the sample
    the step draws anyway.

    Returns:
        Per step ``(words, tau, parameters, residual)`` on CPU, and how many parameters went through
        the Triton twin.
    """
    from gtc_lightning import GTCState
    from gtc_lightning.algorithms.gtc import update as update_mode

    device, twin = torch.device(device), []
    sample, fold = update_mode.sample_positions, tk.fold_emit_

    def cpu_sample(ranges, generator, where):
        positions = sample(ranges, torch.Generator().manual_seed(generator.initial_seed()), torch.device("cpu"))
        return None if positions is None else positions.to(where)

    def counted(*args, **kwargs) -> None:
        twin.append(1)
        fold(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(update_mode, "sample_positions", cpu_sample)
        mp.setattr(tk, "fold_emit_", counted)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(512, 300), torch.nn.Tanh(), torch.nn.Linear(300, 10)).to(device)
        params = list(model.parameters())
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            tau = {"tau": "auto", "target_density": 0.01} if word_levels == 1 else {"tau": 0.05}
            state = GTCState(None, model.named_parameters(), compress="update", backend=backend, word_levels=word_levels,
                             **tau)  # fmt: skip
            g = torch.Generator().manual_seed(1)
            out = []
            for _ in range(steps):
                update_mode.begin(state, params)
                with torch.no_grad():  # the optimizer's step (drawn on CPU: the same on every device)
                    for p in params:
                        p.sub_((0.1 * torch.randn(p.shape, generator=g)).to(device))
                stats = update_mode.exchange(state, params, {id(p): 0.1 for p in params})
                flat = torch.cat([p.detach().reshape(-1) for p in params]).cpu()
                out.append((stats.words, stats.tau, flat, state.residual_vector().cpu()))
        finally:
            dist.destroy_process_group()
    return out, len(twin)


@pytest.mark.parametrize("word_levels", [1, 4])
def test_an_update_mode_step_through_the_twin_is_the_cpu_step(word_levels):
    """The update mode's whole step with the Triton twin (interpreted) folding and emitting: the same
    words, tau, parameters and residual as with update_ops' NumPy pass (and with words of up to 8 tau)."""
    (cpu, none) = update_steps("cpu", word_levels=word_levels)
    (twin, used) = update_steps("cpu", backend="triton", word_levels=word_levels)
    assert none == 0 and used == 3 * 4
    for t, (a, b) in enumerate(zip(twin, cpu, strict=True)):
        assert a[0] == b[0] > 0 and a[1] == b[1], f"step {t + 1}: words or tau"
        assert torch.equal(bits(a[2]), bits(b[2])) and torch.equal(bits(a[3]), bits(b[3])), f"step {t + 1}"


def test_bench_fold_rows_on_cpu():
    """The CUDA layout of the fold table, with the interpreted twin standing in for CUDA."""
    from gtc_lightning.tools import bench

    device = torch.device("cpu")
    assert list(bench.fold_backends_for(device)) == ["torch reference", "numpy one pass"]
    backends = {**bench.fold_backends_for(device), "triton": tk.fold_emit_}
    rows = bench.bench_fold(20_000, 0.01, device, 1, backends)
    assert [r["backend"] for r in rows] == ["copy (roofline)", "torch reference", "numpy one pass", "triton"]
    assert rows[2]["identical"] is True and rows[3]["identical"] is True
    assert 0.008 < rows[1]["density"] < 0.012
    table = bench.format_fold_table(rows)
    assert table.count("\n") == 5 and table.count("| yes |") == 2
