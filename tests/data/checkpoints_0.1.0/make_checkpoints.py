"""Writes the checkpoints of this folder: GTCStrategy on 2 forked CPU ranks, TinyMLP of
tests/_strategy_helpers.py, 1 epoch (4 optimizer steps), a checkpoint at its end with every rank's
shard beside it (the checkpoint callback's own entry, which holds this machine's paths, is
emptied). They were written by gtc-lightning 0.1.0 (commit 4887064, before the package was
laid out in folders) and are kept as they are: tests/test_legacy_checkpoints.py resumes them.

  gtc_gradient.ckpt  compress="gradient", tau=0.01, coding="none", dense_fallback=False (sparse on every
                     step): residual shards
  gtc_update.ckpt    compress="update" with AdamW, tau="auto", coding="rice": residual and
                     per-rank optimizer shards

Run from the repository root: python tests/data/checkpoints_0.1.0/make_checkpoints.py
"""

import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
from _strategy_helpers import AdamMLP, TinyMLP, fit
from lightning.pytorch.callbacks import ModelCheckpoint

RUNS = {
    "gtc_gradient": {"compress": "gradient", "tau": 0.01, "coding": "none", "dense_fallback": False},
    "gtc_update": {"compress": "update", "tau": "auto", "coding": "rice", "target_density": 0.05},
}


if __name__ == "__main__":
    for name, options in RUNS.items():
        model = AdamMLP() if options["compress"] == "update" else TinyMLP()
        checkpoint = ModelCheckpoint(dirpath=HERE, filename=name, save_top_k=1)
        with tempfile.TemporaryDirectory() as out:
            fit(Path(out), model=model, max_epochs=1, **options,
                trainer_kwargs={"enable_checkpointing": True, "callbacks": [checkpoint]})  # fmt: skip
        path = HERE / f"{name}.ckpt"
        saved = torch.load(path, weights_only=False)
        saved["callbacks"] = {}
        torch.save(saved, path)
