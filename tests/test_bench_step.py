"""``python -m gtc_lightning.tools.bench_step``: one forked rank on CPU, its table and JSON, the per-step
statistics over the timed steps only, and the GPU option's error without GPUs."""

from __future__ import annotations

import json

import pytest
import torch

from gtc_lightning.tools import bench_step


def test_one_rank_table_and_timed_statistics(tmp_path, capsys):
    out = tmp_path / "steps.json"
    bench_step.main([
        "--world", "1", "--models", "2x16:4", "--strategies", "gtc", "nocomm", "--rounds", "1",
        "--steps", "3", "--warmup", "2", "--batch", "8", "--tau", "1e-3", "--threads", "1", "--out", str(out),
    ])  # fmt: skip
    table = capsys.readouterr().out
    # One rank sends nothing: no ratios to an all-reduce (this once divided by zero).
    assert "| 2x16:4 | " in table and "precision 32-true" in table
    data = json.loads(out.read_text())
    gtc = data["results"]["2x16:4"]["gtc"][0]
    assert len(gtc["steps"]) == 3
    # Per timed step (3), not per step since the start (5): words per step <= the weights.
    weights = (17 * 40 + 1) * 16 + (16 + 1) * 16 + (16 + 1) * 4
    assert 0 < gtc["gtc"]["words"] <= weights
    assert gtc["gtc"]["modes"] == {"sparse": 3, "dense": 0}


def test_profile_writes_rank_0s_table_of_the_timed_steps(tmp_path):
    bench_step.main([
        "--world", "1", "--models", "2x16:4", "--strategies", "gtc_update", "--rounds", "1", "--steps", "3",
        "--warmup", "2", "--batch", "8", "--threads", "1", "--out", str(tmp_path / "steps.json"),
        "--profile", str(tmp_path / "prof"),
    ])  # fmt: skip
    table = (tmp_path / "prof" / "2x16x4_gtc_update_round0.txt").read_text()
    assert table.startswith("3 profiled steps") and "Optimizer.step#SGD.step" in table
    calls = next(line for line in table.splitlines() if "Optimizer.step#SGD.step" in line)
    assert calls.split()[-1] == "3"  # the timed steps alone, not the warm-up's


def test_strategy_totals_copy_step_and_numbers():
    class Fake:
        @property
        def gtc_stats(self):
            return {"step": 4, "last": None, "total": {"words": 10, "mode": "sparse", "compress_s": 0.5}}

        @property
        def sync_stats(self):
            return {"step": 0, "total": None}

    assert bench_step.strategy_totals(Fake()) == {"gtc_stats": {"step": 4, "total": {"words": 10.0, "compress_s": 0.5}}}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without GPUs")
def test_gpu_option_needs_gpus(capsys):
    with pytest.raises(SystemExit):
        bench_step.main(["--accelerator", "gpu", "--world", "1", "--out", "/nonexistent/x.json"])
    assert "needs 1 visible GPUs, found 0" in capsys.readouterr().err


def test_new_names_build_powersgd_as_the_model_suite_and_gtc_update_as_the_defaults():
    """powersgd_r1/r4 are the model suite's PowerSGD (rank r, start_powerSGD_iter=2) in one DDP bucket;
    gtc_update asks for what GTCStrategy() does today: the optimizer's step, automatic tau at the default
    density, Rice coding (a fixed-tau ``gtc`` stays Strom's gradient mode)."""
    from gtc_lightning import GTCStrategy, PowerSGDStrategy
    from gtc_lightning.strategies.gtc import BUCKET_CAP_MB
    from gtc_lightning.tools.model_suite import METHODS

    for name, rank in bench_step.POWERSGD_RANKS.items():
        built = bench_step.make_strategy(name, 1e-2, "auto")
        assert isinstance(built, PowerSGDStrategy)
        assert built._powersgd_kwargs == METHODS[name]()._powersgd_kwargs
        assert built._powersgd_kwargs["matrix_approximation_rank"] == rank
        assert built._ddp_kwargs["bucket_cap_mb"] == BUCKET_CAP_MB
    update = bench_step.make_strategy("gtc_update", 1e-2, "auto")
    defaults = GTCStrategy()
    assert (update.compress, update.tau, update.target_density, update.coding) == (
        "update", "auto", defaults.target_density, defaults.coding)  # fmt: skip
    assert defaults.compress == "auto" and defaults.tau == "auto"  # auto: "update" for one optimizer
    gtc = bench_step.make_strategy("gtc", 1e-2, "auto")
    assert (gtc.compress, gtc.tau, gtc.coding) == ("gradient", 1e-2, "none")
    with pytest.raises(ValueError, match="unknown strategy"):
        bench_step.make_strategy("powersgd_r2", 1e-2, "auto")


@pytest.mark.parametrize("rank", [1, 4])
def test_powersgd_meter_records_the_hooks_all_reduces(rank):
    """The recipe's DNN on one rank, a compressed step: one bucket, three all-reduces, the biases whole,
    then P (``[rows, r]`` of every weight matrix) and Q (``[columns, r]``); at W ranks each costs the
    ring's 2 (W-1)/W of its bytes. A few seconds."""
    from argparse import Namespace

    from gtc_lightning.algorithms.common import allreduce_bytes

    layers, hidden, outputs = spec = bench_step.MODELS["recipe"]
    rows = [hidden] * layers + [outputs]  # Linear weights are [out, in]: rows = outputs, columns = inputs
    columns = [bench_step.INPUT_DIM] + [hidden] * layers
    args = Namespace(warmup=1, steps=2, batch=8, lr=0.1, tau=1e-3, exchange="auto")
    # In a process of its own: a one-rank gloo group torn down in the pytest process could abort it (a
    # gloo worker thread of the destroyed group threw std::system_error, about 1 run in 7 under load).
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        seg = pool.submit(_one_rank_segment, args, spec, f"powersgd_r{rank}").result(timeout=600)
    # the window opens after PowerSGD's two plain all-reduce steps whatever the warm-up asked for
    assert len(seg["steps"]) == 2
    assert seg["powersgd"]["sizes"] == [(sum(rows), 4), (rank * sum(rows), 4), (rank * sum(columns), 4)]
    assert seg["powersgd"]["allreduces"] == 3 and seg["powersgd"]["bytes_sent"] == 0  # one rank sends nothing
    for world in (2, 4):
        sent = sum(allreduce_bytes(n, world, size) for n, size in seg["powersgd"]["sizes"])
        assert sent == 2 * (world - 1) * 4 * (sum(rows) + rank * (sum(rows) + sum(columns))) // world


def _one_rank_segment(args, spec, name):
    """``bench_step._segment`` on one rank, run in a spawned process (the test above)."""
    import torch

    torch.set_num_threads(1)
    return bench_step._segment(args, spec, name, devices=1, num_nodes=1, seed=0)
