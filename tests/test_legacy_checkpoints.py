"""Checkpoints written by gtc-lightning 0.1.0, before the package was laid out in folders, resume
today (tests/data/checkpoints_0.1.0, made by its make_checkpoints.py): on 2 forked CPU ranks every
rank gets its own residual back, and in the update mode its own optimizer state, bit for bit from
the shards; the model is the checkpoint's; training goes on with identical replicas."""

from __future__ import annotations

import shutil
from pathlib import Path

import lightning as L
import pytest
import torch
from _strategy_helpers import AdamMLP, TinyMLP, fit, keep_master_port  # noqa: F401  (autouse: MASTER_PORT)

DATA = Path(__file__).resolve().parent / "data" / "checkpoints_0.1.0"
WORLD = 2


class OptimizerAtStart(L.Callback):
    """Every rank saves its optimizer state as the resumed fit starts."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_start(self, trainer, pl_module):
        torch.save(trainer.optimizers[0].state_dict(), self.out / f"optimizer{trainer.global_rank}.pt")


def _load(path: Path) -> dict:
    return torch.load(path, weights_only=False)


@pytest.mark.parametrize(
    "name, options, model",
    [
        ("gtc_gradient", {"compress": "gradient", "tau": 0.01, "coding": "none", "dense_fallback": False}, TinyMLP),
        ("gtc_update", {"compress": "update", "tau": "auto", "coding": "rice", "target_density": 0.05}, AdamMLP),
    ],
)
def test_a_checkpoint_of_0_1_0_resumes(name, options, model, tmp_path):
    shutil.copytree(DATA, tmp_path / "ckpt")
    ckpt = tmp_path / "ckpt" / f"{name}.ckpt"
    saved = _load(ckpt)
    shards = [_load(tmp_path / "ckpt" / f"{name}.ckpt.gtc" / f"rank{r}.pt") for r in range(WORLD)]
    assert not torch.equal(shards[0]["residual"], shards[1]["residual"])  # each rank has its own
    _, ranks = fit(tmp_path / "run", model=model(), max_epochs=saved["epoch"] + 2, ckpt_path=str(ckpt), **options,
                   trainer_kwargs={"callbacks": [OptimizerAtStart(tmp_path)]})  # fmt: skip
    params = torch.cat([t.float().reshape(-1) for t in saved["state_dict"].values()])
    for rank, (record, shard) in enumerate(zip(ranks, shards)):
        assert record["start"]["step"] == saved["gtc"]["step"] == shard["step"]
        assert torch.equal(record["start"]["residual"], shard["residual"]), f"rank {rank}'s residual"
        assert torch.equal(record["start"]["params"], params)
        assert len(record["records"]) == 4 and record["records"][-1]["step"] == saved["gtc"]["step"] + 4
        if options["compress"] == "update":  # every rank's own AdamW moments, not rank 0's
            optimizer = torch.load(tmp_path / f"optimizer{rank}.pt", weights_only=False)["state"]
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(optimizer[0][key], shard["optimizers"][0]["state"][0][key])
    for a, b in zip(ranks[0]["records"], ranks[1]["records"]):
        assert torch.equal(a["params"], b["params"])
