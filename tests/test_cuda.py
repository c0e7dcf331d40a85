"""The Triton kernels compiled and run on a GPU, and the "gtc" strategy training on CUDA.

Skipped without CUDA, and under ``TRITON_INTERPRET=1`` (conftest sets it when it is unset, for
the CPU tests). On a GPU machine::

    TRITON_INTERPRET=0 python -m pytest tests/test_cuda.py

Every kernel runs on CUDA tensors and is compared bit for bit with the torch reference on CPU,
on the adversarial cases of the CPU tests (``test_ops``, ``test_step_ops``, ``test_update_kernels``,
``test_rice``).
Then real Lightning training on the GPU: one rank over NCCL, and two ranks sharing the one GPU
over gloo (NCCL refuses two ranks on one device), each with the Triton and the torch backend.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch

from gtc_lightning.ops import compress, decompress, torch_ops, update_ops
from gtc_lightning.ops import triton_kernels as tk
from gtc_lightning.ops.reference import compress_reference, decompress_reference
from gtc_lightning.ops.rice import rice_decode, rice_encode

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or tk.INTERPRETED,
    reason="needs a CUDA GPU and TRITON_INTERPRET=0 (run: TRITON_INTERPRET=0 pytest tests/test_cuda.py)",
)

import test_ops  # (the CPU tests' adversarial cases)
import test_rice
import test_step_ops
import test_update_kernels

CUDA = torch.device("cuda")
TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


# ---- compress / decompress ---------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:overflow encountered")
@pytest.mark.parametrize("block", ["case", "default"])
@pytest.mark.parametrize("name", list(test_ops.CASES))
def test_compress_on_cuda_matches_reference_bit_for_bit(name, block):
    grad, residual, tau, case_block = test_ops.CASES[name]
    r_ref = residual.clone()
    w_ref = compress_reference(grad, r_ref, tau)
    r_gpu = residual.to(CUDA)
    w_gpu = tk.compress_triton(grad.to(CUDA), r_gpu, tau, block=case_block if block == "case" else tk.COMPRESS_BLOCK)
    assert w_gpu.is_cuda and w_gpu.dtype == torch.int32
    assert torch.equal(w_gpu.cpu(), w_ref)
    assert torch.equal(bits(r_gpu.cpu()), bits(r_ref))


def test_public_api_dispatches_cuda_tensors_to_triton_and_agrees():
    grad, residual, _ = test_ops.random_case(1_000_003, 31, scale=0.3)
    r_ref, r_gpu = residual.clone(), residual.to(CUDA)
    w_ref, w_gpu = compress(grad, r_ref, 0.5), compress(grad.to(CUDA), r_gpu, 0.5)
    assert w_gpu.is_cuda and torch.equal(w_gpu.cpu(), w_ref) and torch.equal(bits(r_gpu.cpu()), bits(r_ref))
    assert w_ref.numel() > 1000
    out_ref, out_gpu = decompress(w_ref, grad.numel(), 0.5, divisor=3), decompress(w_gpu, grad.numel(), 0.5, divisor=3)
    assert out_gpu.is_cuda and torch.equal(bits(out_gpu.cpu()), bits(out_ref))


@pytest.mark.parametrize("where", [[0], [3, 70_000, 99_999]])
def test_nonfinite_grad_raises_on_cuda_and_keeps_residual(where):
    grad, residual, _ = test_ops.random_case(100_000, 10)
    for i, pos in enumerate(where):
        grad[pos] = [float("nan"), float("inf"), float("-inf")][i]
    r_gpu = residual.to(CUDA)
    with pytest.raises(ValueError, match=f"{len(where)} non-finite"):
        compress(grad.to(CUDA), r_gpu, test_ops.TAU)
    assert torch.equal(bits(r_gpu.cpu()), bits(residual))


def test_decompress_on_cuda_is_order_independent():
    n, world = 300_000, 4
    messages = []
    for k in range(world):
        grad, residual, _ = test_ops.random_case(n, 40 + k)
        messages.append(compress_reference(grad, residual, test_ops.TAU))
    words = torch.cat(messages * 2)  # duplicates: counts up to +-8, and cancelling votes
    scale = float(np.float32(test_ops.TAU / world))
    ref = decompress_reference(words, n, scale)
    perm = torch.randperm(words.numel(), generator=torch.Generator().manual_seed(3))
    for w in (words, words[perm], words.flip(0)):
        assert torch.equal(bits(tk.decompress_triton(w.to(CUDA), n, scale).cpu()), bits(ref))


# ---- the hook's step primitives ----------------------------------------------------------------


def _threshold(ops, device, grad, residual, **kw):
    return test_step_ops.run_threshold(ops, grad, residual, cursor0=3, device=device, **kw)[:3]


@pytest.mark.parametrize("offset", [0, (1 << 31) - 70_001])
@pytest.mark.parametrize("name", list(test_step_ops.CASES))
def test_threshold_on_cuda_matches_torch(name, offset):
    grad, residual = test_step_ops.CASES[name]
    expected = _threshold(torch_ops, "cpu", grad, residual, offset=offset)
    got = _threshold(tk, CUDA, grad, residual, offset=offset)
    assert got[2] == expected[2] == 0
    assert torch.equal(got[1], expected[1]) and torch.equal(bits(got[0]), bits(expected[0]))


@pytest.mark.parametrize("clip", [None, 0.3])
def test_threshold_alpha_clip_and_half_precision_on_cuda(clip):
    grad, residual = test_step_ops.CASES["sparse"]
    for g in (grad * 1024.0, (grad * 1024.0).to(torch.bfloat16)):
        kw = {"alpha": 1 / 1024, "clip": None if clip is None else clip * 1024}
        expected, got = _threshold(torch_ops, "cpu", g, residual, **kw), _threshold(tk, CUDA, g, residual, **kw)
        assert torch.equal(got[1], expected[1]) and torch.equal(bits(got[0]), bits(expected[0]))


def test_non_finite_values_are_counted_on_cuda():
    grad, residual = test_step_ops.CASES["sparse"]
    grad = grad.clone()
    grad[[5, 40_000, 69_999]] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    assert _threshold(tk, CUDA, grad, residual)[2] == 3


@pytest.mark.parametrize("padded", [False, True])
def test_decode_on_cuda_matches_reference_and_clears_counts(padded):
    n, world = 200_000, 3
    g = torch.Generator().manual_seed(9)
    messages = [torch.unique(torch.randint(0, n, (int(n * d),), generator=g)).to(torch.int32) for d in (0.01, 0.2, 0.0)]
    messages = [torch.where(torch.rand(m.numel(), generator=g) < 0.5, m | -(1 << 31), m).to(torch.int32) for m in messages]
    scale = float(np.float32(np.float32(test_step_ops.TAU) / world))
    reference = decompress_reference(torch.cat(messages), n, scale)
    if padded:
        width = max(m.numel() for m in messages)
        words = torch.full((world, width), 12345, dtype=torch.int32)
        for r, m in enumerate(messages):
            words[r, : m.numel()] = m
        words, lengths = words.view(-1), torch.tensor([m.numel() for m in messages], device=CUDA)
    else:
        words, lengths = torch.cat(messages), None
    counts = torch.zeros(n, dtype=tk.COUNTS_DTYPE, device=CUDA)
    outs = [torch.full((70_000,), 5.0, device=CUDA), torch.full((n - 70_000,), 5.0, device=CUDA)]
    tk.decode_(words.to(CUDA), lengths, counts, [(0, outs[0]), (70_000, outs[1])], scale)
    assert torch.equal(bits(torch.cat(outs).cpu()), bits(reference))
    assert not counts.any()


# ---- the update mode's fold and emission -------------------------------------------------------


@pytest.mark.parametrize(("n", "block"), [(10_000_000, None), (1_000_003, 64)], ids=["10M", "1M-small-blocks"])
@pytest.mark.parametrize("nonfinite", [False, True], ids=["finite", "nan-inf"])
def test_fold_emit_on_cuda_matches_the_reference(n, block, nonfinite):
    """The fused kernel against ``update_ops``' two passes on CPU: ties at tau, an offset, the message
    over the kept copy (words, parameter, residual, the whole buffer; NaN compared as NaN: the GPU's
    is canonical)."""
    case = test_update_kernels.make_case(n, seed=11, nonfinite=nonfinite)
    kw = {"offset": 1000, "base": 1000, "cursor0": 1000}
    want = test_update_kernels.run(test_update_kernels.reference, *case, **kw)
    got = test_update_kernels.run(tk.fold_emit_, *case, device=CUDA, **kw, **({} if block is None else {"block": block}))
    test_update_kernels.assert_same(got, want)
    assert want[4] == (3 if nonfinite else 0) and got[3].numel() > n // 200


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_update_ops_fold_emit_runs_the_twin_on_cuda(dtype, monkeypatch):
    """``update_ops.fold_emit_`` sends CUDA tensors to the Triton twin (bf16: torch's fold on the device,
    then the emission kernel), with the reference's results."""
    param, kept, residual = test_update_kernels.make_case(1_000_003, seed=12)
    param = param.to(dtype)
    kept = param.float() + 0.01 if dtype != torch.float32 else kept
    calls = []
    twin = tk.fold_emit_
    monkeypatch.setattr(tk, "fold_emit_", lambda *a, **kw: calls.append(1) or twin(*a, **kw))
    want = test_update_kernels.run(test_update_kernels.reference, param, kept, residual, 7)
    got = test_update_kernels.run(update_ops.fold_emit_, param, kept, residual, 7, device=CUDA)
    assert calls == [1] and got[0].dtype == dtype
    test_update_kernels.assert_same(got, want)


@pytest.mark.parametrize("word_levels", [1, 4])
def test_update_mode_step_on_cuda_is_the_cpu_step(word_levels):
    """Three update-mode steps of one rank (the Triton twin folding and emitting on the GPU) against the
    same on CPU: words and tau equal, parameters and residual equal to the bit (and with words of up to
    8 tau: the levels are torch calls on the device)."""
    gpu, used = test_update_kernels.update_steps(CUDA, word_levels=word_levels)
    cpu, _ = test_update_kernels.update_steps("cpu", word_levels=word_levels)
    assert used == 3 * 4
    for t, (a, b) in enumerate(zip(gpu, cpu, strict=True)):
        assert a[0] == b[0] > 0 and a[1] == b[1], f"step {t + 1}: words or tau"
        assert torch.equal(bits(a[2]), bits(b[2])), f"step {t + 1}: parameters"
        assert torch.equal(bits(a[3]), bits(b[3])), f"step {t + 1}: residual"


def test_bench_fold_on_cuda_is_bit_identical():
    from gtc_lightning.tools import bench

    rows = bench.bench_fold(2_000_000, 0.01, CUDA, 1, bench.fold_backends_for(CUDA))
    assert [r["backend"] for r in rows] == ["copy (roofline)", "torch reference", "triton"]
    assert rows[2]["identical"] is True and 0.008 < rows[2]["density"] < 0.012


# ---- Golomb-Rice bit packing -------------------------------------------------------------------


@pytest.mark.parametrize("name", list(test_rice.CASES))
def test_rice_on_cuda_matches_torch_bytes_and_round_trips(name):
    words = test_rice.CASES[name]
    data = rice_encode(words, backend="torch")
    data_gpu = rice_encode(words.to(CUDA))
    assert data_gpu.is_cuda and torch.equal(data_gpu.cpu(), data)
    back = rice_decode(data_gpu)
    assert back.is_cuda and torch.equal(back.cpu(), words)


# ---- the strategy training on the GPU ----------------------------------------------------------


def _train_main(rank: int, world: int, port: int, backend: str, exchange: str, coding: str, out: str,
                mode: str = "gradient") -> None:
    """One rank: 12 steps of a small DNN on cuda:0; writes its parameters and stats.

    ``mode``: ``gradient`` (Strom's GTC at tau 2e-3, plain SGD), ``update`` (``GTCStrategy``'s defaults
    with AdamW: the rank's optimizer steps, its step is compressed at the per-rank tau) or ``adpsgd``
    (the asynchronous pairwise averaging, its exchange through host copies on its own gloo group).
    """
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODE_RANK=str(rank), LOCAL_RANK="0",
                      WORLD_SIZE=str(world), GLOBAL_RANK=str(rank))  # fmt: skip
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from gtc_lightning import GTCStrategy
    from gtc_lightning.tools.bench_step import make_dnn

    torch.use_deterministic_algorithms(True)
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own frames
    x, y = torch.randn(12 * 64, 17 * 40, generator=g), torch.randint(0, 50, (12 * 64,), generator=g)
    pg_backend = "gloo" if world > 1 else "nccl"
    model = make_dnn((3, 256, 50), lr=0.5)
    if mode == "adpsgd":
        from gtc_lightning import ADPSGDStrategy

        strategy = ADPSGDStrategy(process_group_backend=pg_backend)
    else:
        if mode == "update":
            strategy = GTCStrategy(compress="update", backend=backend, exchange=exchange, coding=coding,
                                   check_replicas_every=4, process_group_backend=pg_backend)  # fmt: skip
            model.configure_optimizers = lambda: torch.optim.AdamW(model.parameters(), lr=1e-3)
        else:
            strategy = GTCStrategy(tau=2e-3, compress="gradient", backend=backend, exchange=exchange,
                                   coding=coding, check_replicas_every=4, process_group_backend=pg_backend)  # fmt: skip
    trainer = L.Trainer(accelerator="gpu", devices=1, num_nodes=world, strategy=strategy, max_steps=12,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False)  # fmt: skip
    seen = set()  # where the parameters were during training (Lightning moves them to the CPU at teardown)

    class Where(L.Callback):
        def on_train_batch_end(self, *args, **kwargs):
            seen.add(str(next(model.parameters()).device))

    trainer.callbacks.append(Where())
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=64))
    params = torch.cat([p.detach().float().cpu().reshape(-1) for p in model.parameters()])
    record = {"params": params, "device": str(trainer.strategy.root_device), "param_device": ",".join(sorted(seen))}
    if mode == "adpsgd":
        stats = trainer.strategy.adpsgd_state
        record.update(exchanges=int(getattr(stats, "exchanges", 0) or 0), ops="adpsgd")
    else:
        total = trainer.strategy.gtc_stats["total"]
        ops = getattr(trainer.strategy.gtc_state, "_ops", None)  # (the gradient mode's kernels)
        record.update(ops=ops.__name__ if ops else "update", words=total.get("words", 0),
                      sparse_steps=total.get("sparse_steps", 0))  # fmt: skip
    torch.save(record, Path(out) / f"rank{rank}.pt")


def _launch(tmp_path: Path, world: int, backend: str, exchange: str = "auto", coding: str = "none",
            mode: str = "gradient") -> list[dict]:
    from gtc_lightning.tools.bench_step import free_port

    out = tmp_path / f"{mode}_{world}_{backend}_{exchange}_{coding}"
    out.mkdir()
    port = free_port()
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)])}
    code = "import sys, test_cuda; a = sys.argv[1:]; test_cuda._train_main(int(a[0]), int(a[1]), int(a[2]), *a[3:])"
    argv = [str(world), str(port), backend, exchange, coding, str(out), mode]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(r), *argv],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for r in range(world)
    ]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    return [torch.load(out / f"rank{r}.pt") for r in range(world)]


@pytest.mark.parametrize(("world", "exchange", "coding"), [(1, "auto", "none"), (2, "allgather", "none"),
                                                           (2, "alltoall", "none"), (2, "auto", "rice")])
def test_strategy_trains_on_cuda_with_triton_like_torch(tmp_path, world, exchange, coding):
    """The comm hook on CUDA runs the Triton step primitives; the replicas stay bit-identical and
    equal, bit for bit, the same training with the hook's torch backend."""
    triton_runs = _launch(tmp_path, world, "auto", exchange, coding)
    torch_runs = _launch(tmp_path, world, "torch", exchange, coding)
    for rec in triton_runs:
        assert rec["device"] == "cuda:0" and rec["ops"].endswith("triton_kernels"), rec
        assert rec["sparse_steps"] == 12 and rec["words"] > 0, rec
    for rec in torch_runs:
        assert rec["ops"].endswith("torch_ops"), rec
    for rec in triton_runs[1:] + torch_runs:
        assert torch.equal(bits(rec["params"]), bits(triton_runs[0]["params"]))
    print(json.dumps({"world": world, "words_per_step": triton_runs[0]["words"] / 12}))


@pytest.mark.parametrize(("world", "coding"), [(1, "rice"), (2, "rice"), (2, "none")])
def test_update_mode_trains_on_cuda_with_identical_replicas(tmp_path, world, coding):
    """GTCStrategy's defaults for AdamW (the update mode, a per-rank tau from a sampled quantile) on
    CUDA: every step sparse, the replicas bit-identical, and the same parameters with either
    backend (the fold and emission run ``update_ops.fold_emit_``'s Triton twin on CUDA either way;
    the rest of the step is torch calls on the device)."""
    auto_runs = _launch(tmp_path, world, "auto", "auto", coding, mode="update")
    torch_runs = _launch(tmp_path, world, "torch", "auto", coding, mode="update")
    for rec in auto_runs:
        assert rec["device"] == "cuda:0" and rec["param_device"] == "cuda:0", rec
        assert rec["sparse_steps"] == 12 and rec["words"] > 0, rec
    for rec in auto_runs[1:] + torch_runs:
        assert torch.equal(bits(rec["params"]), bits(auto_runs[0]["params"]))
    print(json.dumps({"world": world, "coding": coding, "words_per_step": auto_runs[0]["words"] / 12}))


def test_adpsgd_trains_on_cuda_through_host_copies(tmp_path):
    """adpsgd with its models on cuda:0 (two ranks sharing the GPU over gloo): the exchange's host
    copies go out and come back, and the consensus at the end of fit is the same on both ranks."""
    runs = _launch(tmp_path, 2, "auto", mode="adpsgd")
    initial = torch.cat([p.detach().reshape(-1) for p in _initial_dnn().parameters()])
    for rec in runs:
        assert rec["device"] == "cuda:0" and rec["param_device"] == "cuda:0", rec
        assert torch.isfinite(rec["params"]).all()
    assert torch.equal(bits(runs[0]["params"]), bits(runs[1]["params"]))  # the consensus at the end
    assert not torch.equal(bits(runs[0]["params"]), bits(initial))  # it trained


def _initial_dnn():
    from gtc_lightning.tools.bench_step import make_dnn

    return make_dnn((3, 256, 50), lr=0.5)


# ---- the averaging family on the GPU: adpsgd's host copies, BMUF's resume ----------------------


def _averaging_main(rank: int, world: int, port: int, out: str, mode: str, accelerator: str = "gpu") -> None:
    """One rank of two sharing cuda:0 over gloo (``accelerator="cpu"`` runs the same on the CPU).

    ``adpsgd``: 12 steps, ``max_staleness=1``, each with 50 ms of GPU work (``torch.cuda._sleep``)
    that the host copies at the step boundary wait for; ``adpsgd_collective``: the same with a
    ``self.log(..., sync_dist=True)`` in every step, before that work. ``bmuf``: ``period=2``, a checkpoint at step 3, then a new Trainer that
    resumes from it to step 8 (its first block, at step 4, mixes the shard's W and Δ with the mean).
    """
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODE_RANK=str(rank), LOCAL_RANK="0",
                      WORLD_SIZE=str(world), GLOBAL_RANK=str(rank))  # fmt: skip
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    from gtc_lightning import ADPSGDStrategy, BMUFStrategy
    from gtc_lightning.tools.bench_step import make_dnn

    g = torch.Generator().manual_seed(100 + rank)  # each rank its own frames
    data = DataLoader(TensorDataset(torch.randn(12 * 64, 17 * 40, generator=g),
                                    torch.randint(0, 50, (12 * 64,), generator=g)), batch_size=64)  # fmt: skip
    kwargs = {"accelerator": accelerator, "devices": 1, "num_nodes": world, "logger": False,
              "enable_progress_bar": False, "enable_model_summary": False, "use_distributed_sampler": False,
              "default_root_dir": out}  # fmt: skip
    model = make_dnn((3, 256, 50), lr=0.5)
    record: dict = {}
    if mode.startswith("adpsgd"):
        step = model.training_step

        def training_step(batch, batch_idx):
            loss = step(batch, batch_idx)
            if mode == "adpsgd_collective":
                model.log("loss", loss, sync_dist=True)  # a collective in every step
            if torch.cuda.is_available():
                torch.cuda._sleep(100_000_000)  # ~50 ms of GPU work, queued after the collective
            return loss

        model.training_step = training_step
        strategy = ADPSGDStrategy(max_staleness=1, process_group_backend="gloo", timeout=timedelta(seconds=60))
        trainer = L.Trainer(strategy=strategy, max_steps=12, enable_checkpointing=False, **kwargs)
        trainer.fit(model, data)
        record["totals"] = strategy.adpsgd_state.stats()["total"]
    else:
        checkpoint = ModelCheckpoint(dirpath=Path(out) / "ckpt", every_n_train_steps=3, save_top_k=-1)
        first = L.Trainer(strategy=BMUFStrategy(period=2, process_group_backend="gloo"), max_steps=3,
                          callbacks=[checkpoint], **kwargs)  # fmt: skip
        first.fit(model, data)
        strategy = BMUFStrategy(period=2, process_group_backend="gloo")
        second = L.Trainer(strategy=strategy, max_steps=8, enable_checkpointing=False, **kwargs)
        model = make_dnn((3, 256, 50), lr=0.5)
        second.fit(model, data, ckpt_path=str(Path(out) / "ckpt" / "epoch=0-step=3.ckpt"))
        state = strategy.averaging_state
        record.update(global_step=second.global_step, syncs=state.stats()["total"]["syncs"],
                      w_device=str(state.global_params.device), delta_device=str(state.delta.device))  # fmt: skip
    record["params"] = torch.cat([p.detach().float().cpu().reshape(-1) for p in model.parameters()])
    torch.save(record, Path(out) / f"rank{rank}.pt")


def _launch_averaging(tmp_path: Path, mode: str, accelerator: str = "gpu") -> list[dict]:
    from gtc_lightning.tools.bench_step import free_port

    out = tmp_path / mode
    out.mkdir()
    port = free_port()
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)])}
    code = "import sys, test_cuda; a = sys.argv[1:]; test_cuda._averaging_main(int(a[0]), 2, int(a[1]), *a[2:])"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(r), str(port), str(out), mode, accelerator],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for r in range(2)
    ]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize("mode", ["adpsgd", "adpsgd_collective"])
def test_adpsgd_passive_answers_while_its_host_copy_waits_for_the_gpu(tmp_path, mode):
    """The passive rank's host copy at each step boundary waits for the step's 50 ms of GPU work; its
    thread answers meanwhile (the copy runs outside the lock), so the active rank, which waits for
    every exchange at its next boundary, is not held up by the copies (behind them: up to 50 ms a
    step); with a collective in every step the ranks finish too."""
    runs = _launch_averaging(tmp_path, mode)
    active = runs[0]["totals"]
    assert active["steps"] == 12 and active["applied"] >= 11, active
    assert active["blocked_s"] < 0.02 * 12, active
    assert torch.equal(bits(runs[0]["params"]), bits(runs[1]["params"]))  # the consensus at the end


def test_bmuf_resumes_on_cuda_with_w_and_delta_on_the_gpu(tmp_path):
    """A resume loads W and Δ from the shard on the CPU; the first block moves them to the GPU."""
    runs = _launch_averaging(tmp_path, "bmuf")
    for rec in runs:
        assert rec["global_step"] == 8 and rec["syncs"] >= 2, rec
        assert rec["w_device"] == rec["delta_device"] == "cuda:0", rec
    assert torch.equal(bits(runs[0]["params"]), bits(runs[1]["params"]))  # step 8 ends a block


# ---- gtc_hsdp on the GPU: FSDP2 and GTC's replicate dimension on cuda:0 ----------------------------------


@pytest.mark.parametrize("compress", ["update", "gradient"])
def test_gtc_hsdp_trains_on_cuda_with_identical_replicas(tmp_path, compress):
    """Two ranks sharing cuda:0 over gloo (``replicate_size=2`` x ``shard_size=1``): FSDP2's parameters on
    the GPU, GTC's words from the Triton kernels, the two replicas bit-identical after every step."""
    import test_hsdp

    runs = test_hsdp.launch_two(tmp_path / compress, compress, "gpu")
    assert [run["device"] for run in runs] == ["cuda:0", "cuda:0"]
    test_hsdp.check_two_replicas(runs)
