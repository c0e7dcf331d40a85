"""``python -m gtc_lightning.bench_step``: one forked rank on CPU, its table and JSON, the per-step
statistics over the timed steps only, and the GPU option's error without GPUs."""

from __future__ import annotations

import json

import pytest
import torch

from gtc_lightning import bench_step


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
