"""Ops: the Triton kernels (under TRITON_INTERPRET=1, set by conftest) against the torch
reference bit for bit, the invariants both must keep, every error of the public API, the
benchmark command and the sm_90 compile check."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from functools import partial

import numpy as np
import pytest
import torch

from gtc_lightning import ops
from gtc_lightning.ops import compress, decompress
from gtc_lightning.ops import triton_kernels as tk
from gtc_lightning.ops.reference import compress_reference, decompress_reference
from gtc_lightning.tools import bench

TAU = 0.75  # exact in float32, so fp32 and float64 arithmetic agree on it
SIGN = -(1 << 31)
INDEX = (1 << 31) - 1


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def f32(x: float) -> float:
    return float(np.float32(x))


def next_up(x: float) -> float:
    return float(np.nextafter(np.float32(x), np.float32(np.inf)))


def next_down(x: float) -> float:
    return float(np.nextafter(np.float32(x), np.float32(-np.inf)))


def both_backends(grad, residual, tau, block=tk.COMPRESS_BLOCK):
    """Run reference and Triton from the same residual; assert bit-identical; return reference's."""
    r_ref, r_tri = residual.clone(), residual.clone()
    w_ref = compress_reference(grad, r_ref, tau)
    w_tri = tk.compress_triton(grad, r_tri, tau, block=block)
    assert w_tri.dtype == torch.int32 and w_tri.dim() == 1
    assert torch.equal(w_tri, w_ref), f"words differ: {w_tri[:8].tolist()} vs {w_ref[:8].tolist()}"
    assert torch.equal(bits(r_tri), bits(r_ref)), "residuals differ in their bits"
    return w_ref, r_ref


def t32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_case(n, seed, tau=TAU, scale=1.0):
    g = gen(seed)
    return torch.randn(n, generator=g) * scale, torch.randn(n, generator=g) * scale * 0.5, tau


def adversarial_cases():
    up, down = next_up(TAU), next_down(TAU)
    cases = {
        "empty": (t32([]), t32([]), TAU, 128),
        "one_above": (t32([1.0]), t32([0.0]), TAU, 128),
        "one_below": (t32([-0.5]), t32([0.25]), TAU, 128),
        "not_a_block_multiple": (*random_case(1000, 1)[:2], TAU, 128),
        "many_small_blocks_dense": (*random_case(5000, 2)[:2], TAU, 128),
        "many_small_blocks_sparse": (*random_case(6000, 3)[:2], 2.5, 128),
        "default_block_1e5": (*random_case(100_000, 4)[:2], 1.5, tk.COMPRESS_BLOCK),
        "all_below": (torch.rand(3000, generator=gen(5)) * 1.4 - 0.7, torch.zeros(3000), TAU, 256),
        "all_above": (torch.rand(3000, generator=gen(6)) + 0.76, torch.zeros(3000), TAU, 256),
        "all_below_minus_tau": (-torch.rand(3000, generator=gen(7)) - 0.76, torch.zeros(3000), TAU, 256),
        # r lands exactly on +-tau (no word: strict), one ulp beyond (word), one ulp inside.
        "exactly_tau": (
            t32([TAU, -TAU, 0.375, -0.375, up, -up, down, -down, 0.0]),
            t32([0.0, 0.0, 0.375, -0.375, 0.0, 0.0, 0.0, 0.0, up]),
            TAU,
            16,
        ),
        # -0.0 + -0.0 = -0.0, -0.0 + 0.0 = +0.0: untouched elements keep those exact bits.
        "negative_zero": (t32([-0.0, 0.0, -0.0, 0.0, 1.0]), t32([-0.0, -0.0, 0.0, 0.0, -0.0]), TAU, 16),
        # 3e38 + 3e38 overflows to inf: inf > tau, inf - tau = inf; 3.4e38 - tau rounds back
        # to 3.4e38 (tau is below half its ulp).
        "huge": (
            t32([3e38, -3e38, 1e38, -1e38, 3.4e38, 0.0, 0.0]),
            t32([3e38, -3e38, 1e38, 0.0, -1.0, float("inf"), float("-inf")]),
            TAU,
            16,
        ),
        # Subnormal threshold and values: no flushing to zero anywhere.
        "subnormal": (
            torch.randn(2000, generator=gen(8)) * 1e-39,
            torch.randn(2000, generator=gen(9)) * 1e-39,
            f32(1e-39),
            128,
        ),
    }
    return cases


CASES = adversarial_cases()


@pytest.mark.filterwarnings("ignore:overflow encountered")
@pytest.mark.parametrize("name", list(CASES))
def test_triton_matches_reference_bit_for_bit(name):
    grad, residual, tau, block = CASES[name]
    words, _ = both_backends(grad, residual, tau, block)
    index = words & INDEX
    assert torch.all(index[1:] > index[:-1]), "words must be in strictly ascending index order"


@pytest.mark.filterwarnings("ignore:overflow encountered")
@pytest.mark.parametrize("name", [*CASES, "nan_and_tail"])
@pytest.mark.parametrize("offset", [0, 1000])
def test_cpu_emit_matches_the_row_search_bit_for_bit(name, offset):
    """The CPU step's NumPy search (``_emit_cpu``, what ``emit_`` runs on CPU tensors) writes the
    same words after the same cursor, counts the same non-finite values and leaves the same residual
    bits as the torch row search (``_emit_rows``, other devices)."""
    from gtc_lightning.ops import torch_ops

    if name == "nan_and_tail":  # NaN in a full row and in the tail past the last row of CHUNK elements
        grad, residual, tau = random_case(3 * torch_ops.CHUNK + 7, 11)
        grad[[5, 3 * torch_ops.CHUNK + 2]] = float("nan")
    else:
        grad, residual, tau = CASES[name][:3]
    results = []
    for emit in (torch_ops._emit_cpu, torch_ops._emit_rows):
        out = residual + grad
        message = torch.full((out.numel() + 3,), 7, dtype=torch.int32)
        cursor, bad = torch.tensor([3]), torch.zeros(1, dtype=torch.int32)
        emit(out, f32(tau), message, cursor, bad, offset)
        results.append((message, int(cursor), int(bad), bits(out)))
    (m_cpu, c_cpu, b_cpu, o_cpu), (m_rows, c_rows, b_rows, o_rows) = results
    assert (c_cpu, b_cpu) == (c_rows, b_rows)
    assert torch.equal(m_cpu, m_rows), f"words differ: {m_cpu[3:11].tolist()} vs {m_rows[3:11].tolist()}"
    assert torch.equal(o_cpu, o_rows), "residuals differ in their bits"
    if name == "nan_and_tail":
        assert b_cpu == 2 and c_cpu > 5


@pytest.mark.filterwarnings("ignore:overflow encountered")
@pytest.mark.parametrize("name", [*CASES, "nan_and_tail"])
def test_find_words_reads_what_emit_writes(name):
    """``find_words`` (the compressed block sync's read-only selection) gives ``emit_``'s words, their
    indices and its non-finite count, on CPU (NumPy) and through the torch path (a strided view, as on
    other devices), and leaves its input's bits as they were."""
    from gtc_lightning.ops import torch_ops

    if name == "nan_and_tail":
        grad, residual, tau = random_case(3 * torch_ops.CHUNK + 7, 11)
        grad[[5, 3 * torch_ops.CHUNK + 2]] = float("nan")
    else:
        grad, residual, tau = CASES[name][:3]
    values = residual + grad
    out = values.clone()
    message = torch.zeros(out.numel(), dtype=torch.int32)
    cursor, bad = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int32)
    torch_ops.emit_(out, f32(tau), message, cursor, bad)
    strided = torch.stack([values, values], dim=1)[:, 0]  # not contiguous: the torch path
    for given in (values, strided):
        before = bits(given)
        index, words, nonfinite = torch_ops.find_words(given, f32(tau))
        assert torch.equal(words, message[: int(cursor)]) and nonfinite == int(bad)
        assert torch.equal(index, (words & INDEX).long()) and index.dtype == torch.int64
        assert torch.equal(bits(given), before), "find_words wrote to its input"
    if name == "nan_and_tail":
        assert nonfinite == 2


def test_semantics_on_hand_made_values():
    """Strict thresholds, sign bit, in-place update: checked against values written out."""
    up = next_up(TAU)
    grad = t32([TAU, -TAU, up, -up, 2.0, -0.5, 0.0])
    residual = t32([0.0, 0.0, 0.0, 0.0, 0.0, -0.5, 0.0])
    words, new = both_backends(grad, residual, TAU, 16)
    assert words.tolist() == [2, 3 | SIGN, 4, 5 | SIGN]
    expected = [TAU, -TAU, f32(up - TAU), f32(-up + TAU), 2.0 - TAU, -1.0 + TAU, 0.0]
    assert new.tolist() == expected


@pytest.mark.filterwarnings("ignore:overflow encountered")
def test_huge_values_emit_and_stay_infinite():
    grad, residual, tau, block = CASES["huge"]
    words, new = both_backends(grad, residual, tau, block)
    assert (words & INDEX).tolist() == list(range(7))
    assert (words < 0).tolist() == [False, True, False, True, False, False, True]
    assert new[[0, 1, 5, 6]].tolist() == [float("inf"), float("-inf"), float("inf"), float("-inf")]
    assert new[4] == grad[4], "3.4e38 - tau rounds back to 3.4e38"


@pytest.mark.parametrize("where", [[0], [3, 70_000, 99_999]])
def test_nonfinite_grad_raises_with_count_and_keeps_residual(where):
    grad, residual, _ = random_case(100_000, 10)
    values = [float("nan"), float("inf"), float("-inf")]
    for i, pos in enumerate(where):
        grad[pos] = values[i]
    before = residual.clone()
    with pytest.raises(ValueError, match=f"{len(where)} non-finite"):
        tk.compress_triton(grad, residual, TAU)
    assert torch.equal(bits(residual), bits(before))


def test_nonfinite_grad_in_one_of_many_blocks_keeps_every_block():
    grad, residual, _ = random_case(5000, 11)
    grad[4321] = float("nan")
    before = residual.clone()
    with pytest.raises(ValueError, match="1 non-finite"):
        tk.compress_triton(grad, residual, TAU, block=128)
    assert torch.equal(bits(residual), bits(before))


@pytest.fixture(params=["reference", "triton"])
def backend(request, monkeypatch):
    """Public API through either backend: 'triton' sends CPU tensors to the interpreted kernels."""
    if request.param == "triton":
        monkeypatch.setattr(ops, "use_triton", lambda tensor: True)
    return request.param


def test_public_nonfinite_error(backend):
    grad, residual, _ = random_case(1000, 12)
    grad[[1, 500]] = t32([float("inf"), float("nan")])
    before = residual.clone()
    with pytest.raises(ValueError, match="2 non-finite element"):
        compress(grad, residual, TAU)
    assert torch.equal(bits(residual), bits(before))


def test_conservation(backend):
    """Per element, with r = fl32(old + grad) and d = tau * decoded own words:
    new == fl32(r - d) bit for bit (d in {-tau, 0, tau}); exactly r == new + d where
    |r| <= 2 tau (Sterbenz: the subtraction is exact); within half an ulp of new otherwise."""
    g = gen(13)
    old = (torch.rand(20_000, generator=g) * 2 - 1) * TAU
    grad = torch.randn(20_000, generator=g) * 3 * TAU
    residual = old.clone()
    words = compress(grad, residual, TAU)
    d = decompress(words, 20_000, TAU)
    r = old + grad
    assert torch.equal(bits(residual), bits(torch.where(d != 0, r - d, r)))
    exact = r.abs() <= 2 * TAU
    assert exact.sum() > 5000 and (~exact).sum() > 5000, "the data must exercise both regimes"
    err = residual.double() + d.double() - r.double()
    assert torch.all(err[exact] == 0)
    ulp = (torch.nextafter(residual.abs(), torch.tensor(float("inf"))) - residual.abs()).double()
    assert torch.all(err.abs() <= ulp / 2)
    assert torch.all(residual[d == 0].abs() <= TAU), "untouched elements stay within [-tau, tau]"


def test_conservation_over_many_steps_is_exact_on_dyadic_values():
    """With values on a 2**-10 grid every float32 operation is exact, so over 10 steps
    initial residual + sum of grads == final residual + tau * sum of decoded messages."""
    g = gen(14)
    residual = torch.randint(-800, 800, (5000,), generator=g).float() / 1024
    r_ref, total_grad, total_decoded = residual.clone(), residual.double(), torch.zeros(5000).double()
    for _ in range(10):
        grad = torch.randint(-1500, 1500, (5000,), generator=g).float() / 1024
        words = tk.compress_triton(grad, residual, TAU, block=256)
        assert torch.equal(words, compress_reference(grad, r_ref, TAU))
        total_grad += grad.double()
        total_decoded += tk.decompress_triton(words, 5000, TAU).double()
    assert torch.equal(residual.double() + total_decoded, total_grad)
    assert torch.equal(bits(residual), bits(r_ref))


def messages(n=30_000, workers=3):
    out = []
    for k in range(workers):
        grad, residual, _ = random_case(n, 20 + k)
        out.append(tk.compress_triton(grad, residual, TAU, block=1024))
    return out


@pytest.mark.parametrize(("n", "block"), [(2000, 128), (30_000, tk.WORDS_BLOCK)])
def test_decompress_is_order_independent_and_matches_reference(n, block):
    words = torch.cat(messages(n) * 2)  # duplicates: counts up to +-6, and +1 -1 cancelling
    shuffled = words[torch.randperm(words.numel(), generator=gen(15))]
    scale = f32(TAU / 3)
    ref = decompress_reference(words, n, scale)
    for w in (words, shuffled, words.flip(0)):
        assert torch.equal(bits(tk.decompress_triton(w, n, scale, block=block)), bits(ref))
    assert ref.abs().max() > scale * 2, "some element must get several votes"
    assert block == tk.WORDS_BLOCK or words.numel() > 4 * block, "small blocks: several programs"


def test_decompress_cancelling_votes_give_positive_zero(backend):
    out = decompress(torch.tensor([7, 7 | SIGN, 3], dtype=torch.int32), 10, TAU)
    assert bits(out).tolist() == [0] * 3 + [bits(t32([TAU])).item()] + [0] * 6


def test_decompress_with_divisor(backend):
    words = torch.cat(messages(n=20_000, workers=4))
    out = decompress(words, 20_000, 0.3, divisor=4)
    w = words.numpy()
    counts = np.zeros(20_000, np.int64)
    np.add.at(counts, w & INDEX, np.where(w < 0, -1, 1))
    expected = counts.astype(np.float32) * (np.float32(0.3) / np.float32(4))
    assert np.array_equal(out.numpy().view(np.int32), expected.view(np.int32))


def test_decompress_empty(backend):
    assert torch.equal(decompress(torch.tensor([], dtype=torch.int32), 5, TAU), torch.zeros(5))
    assert decompress(torch.tensor([], dtype=torch.int32), 0, TAU).shape == (0,)


def test_public_compress_matches_between_backends(monkeypatch):
    grad, residual, _ = random_case(70_000, 16)
    r_ref, r_tri = residual.clone(), residual.clone()
    w_ref = compress(grad, r_ref, 1.3)
    monkeypatch.setattr(ops, "use_triton", lambda tensor: True)
    w_tri = compress(grad, r_tri, 1.3)
    assert w_ref.numel() > 1000 and torch.equal(w_ref, w_tri)
    assert torch.equal(bits(r_ref), bits(r_tri))


V = torch.zeros(8)


@pytest.mark.parametrize(
    ("grad", "residual", "tau", "match"),
    [
        (V, V.clone(), 0.0, "tau must be"),
        (V, V.clone(), -1.0, "tau must be"),
        (V, V.clone(), float("nan"), "tau must be"),
        (V, V.clone(), float("inf"), "tau must be"),
        (V, V.clone(), True, "tau must be"),
        (V, V.clone(), "1", "tau must be"),
        (V, V.clone(), 1e-50, "not representable"),
        (V, V.clone(), 1e39, "not representable"),
        (V.double(), V.clone(), TAU, "grad must be torch.float32"),
        (V, V.clone().half(), TAU, "residual must be torch.float32"),
        (V.view(2, 4), V.clone(), TAU, "1-D"),
        (torch.zeros(16)[::2], V.clone(), TAU, "contiguous"),
        ([0.0] * 8, V.clone(), TAU, "torch.Tensor"),
        (V, torch.zeros(9), TAU, "9"),
        (torch.zeros(8, device="meta"), V.clone(), TAU, "meta"),
    ],
)
def test_compress_errors(grad, residual, tau, match):
    before = residual.clone() if isinstance(residual, torch.Tensor) else None
    with pytest.raises(ValueError, match=match):
        compress(grad, residual, tau)
    assert torch.equal(residual, before)


def test_compress_too_many_elements(monkeypatch):
    monkeypatch.setattr(ops, "MAX_NUMEL", 7)
    with pytest.raises(ValueError, match=r"8 elements is more than 2\*\*31-1"):
        compress(V, V.clone(), TAU)


W = torch.tensor([1, 2 | SIGN], dtype=torch.int32)


@pytest.mark.parametrize(
    ("words", "numel", "tau", "divisor", "match"),
    [
        (W, 8, 0.0, 1, "tau must be"),
        (W, 8, float("nan"), 1, "tau must be"),
        (W.long(), 8, TAU, 1, "words must be torch.int32"),
        (W.view(1, 2), 8, TAU, 1, "1-D"),
        (torch.zeros(4, dtype=torch.int32)[::2], 8, TAU, 1, "contiguous"),
        (W, -1, TAU, 1, "numel"),
        (W, True, TAU, 1, "numel"),
        (W, 8.0, TAU, 1, "numel"),
        (W, 2**31, TAU, 1, "numel"),
        (W, 8, TAU, 0, "divisor"),
        (W, 8, TAU, 1.5, "divisor"),
        (W, 8, TAU, True, "divisor"),
        (W, 2, TAU, 1, "index 2, out of range for numel=2"),
        (torch.tensor([7 | SIGN], dtype=torch.int32), 7, TAU, 1, "index 7"),
    ],
)
def test_decompress_errors(words, numel, tau, divisor, match):
    with pytest.raises(ValueError, match=match):
        decompress(words, numel, tau, divisor)


def test_kernel_launcher_errors(monkeypatch):
    with pytest.raises(ValueError, match="power of two >= 16, got 100"):
        tk.compress_triton(V, V.clone(), TAU, block=100)
    with pytest.raises(ValueError, match=r"grad \(8 elements on cpu\) and residual \(9 elements"):
        tk.compress_triton(V, torch.zeros(9), TAU)
    with pytest.raises(ValueError, match="words must be a contiguous 1-D torch.int32"):
        tk.decompress_triton(W.long(), 8, TAU)
    monkeypatch.setattr(tk, "INTERPRETED", False)
    with pytest.raises(RuntimeError, match="run on CUDA tensors"):
        tk.compress_triton(V, V.clone(), TAU)


def test_kernel_table_matches_kernel_arguments():
    for name, (kernel, signature, config, flags) in tk.KERNELS.items():
        args = list(inspect.signature(getattr(kernel, "fn", kernel)).parameters)
        assert args == [*signature, "BLOCK", *flags], name
        assert config in tk.CUDA_CONFIG
    block, warps = tk.CUDA_CONFIG["compress"]
    assert tk.compress_warps(block) == warps
    assert [tk.compress_warps(b) for b in (16, 512, 1024, 4096)] == [1, 4, 8, 16]


def test_bench_parsers():
    assert bench.parse_size("14.6M") == 14_600_000 and bench.parse_size("1k") == 1000
    assert bench.parse_density("0.5%") == 0.005 and bench.parse_density("0.01") == 0.01
    with pytest.raises(ValueError, match="size 'big'"):
        bench.parse_size("big")
    with pytest.raises(ValueError, match="density"):
        bench.parse_density("150%")


def test_bench_rows_side_by_side_on_cpu():
    """The CUDA layout of the table, with the interpreted kernels standing in for CUDA."""
    backends = bench.backends_for(torch.device("cpu"), blocks=[1024])
    assert list(backends) == ["torch reference"], "no Triton rows on CPU"
    backends["triton"] = (tk.compress_triton, tk.decompress_triton)
    backends["triton B=1024"] = (partial(tk.compress_triton, block=1024), tk.decompress_triton)
    rows = bench.bench_size(20_000, 0.01, torch.device("cpu"), 1, backends)
    assert [r["backend"] for r in rows] == ["copy (roofline)", "torch reference", "triton", "triton B=1024"]
    assert rows[2]["identical"] is True and rows[3]["identical"] is True
    assert 0.008 < rows[1]["density"] < 0.012
    table = bench.format_table(rows)
    assert table.count("\n") == 5 and table.count("| yes |") == 2


def test_bench_command_on_cpu(capsys, tmp_path):
    out_json = tmp_path / "bench.json"
    bench.main(["--device", "cpu", "--sizes", "10K", "--repeats", "1", "--density", "1%", "--rice", "--json", str(out_json)])
    out = capsys.readouterr().out
    assert "torch reference only" in out and "| 10,000 | torch reference |" in out
    assert "| 10,000 | torch | " in out  # the Rice row
    saved = json.loads(out_json.read_text())
    assert saved["device"] == "cpu" and [r["backend"] for r in saved["rows"]] == ["copy (roofline)", "torch reference"]
    torch_row, numpy_row = saved["rice"]
    assert (torch_row["backend"], numpy_row["backend"]) == ("torch", "numpy") and numpy_row["identical"] is True
    for rice in (torch_row, numpy_row):
        assert rice["round_trip"] is True and rice["words"] > 0 and 8 < rice["bits_per_word"] < 12


def test_kernels_compile_for_sm90():
    """``--compile-only`` in a fresh process without the interpreter (triton's cache may answer:
    it is keyed by the kernel source, so a hit means this very source compiled before)."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    proc = subprocess.run(
        [sys.executable, "-m", "gtc_lightning.tools.bench", "--compile-only"],
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode and "libcuda" in proc.stderr:
        pytest.skip(f"triton's CUDA backend needs a driver here: {proc.stderr[-300:]}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith("| ")]
    body = {r[0].strip(): [c.strip() for c in r] for r in rows[1:] if not r[0].startswith("-")}
    assert set(body) == set(tk.KERNELS), proc.stdout
    for name, cells in body.items():
        ptx, cubin, spills, ftz, fma = int(cells[3]), int(cells[4]), cells[6], cells[8], cells[9]
        assert ptx > 0 and cubin > 0, name
        assert (spills, ftz, fma) == ("0", "0", "0"), f"{name}: spills/ftz/fma {spills}/{ftz}/{fma}"
