#!/usr/bin/env python3
"""Sharpness of trained DNN runs: the largest eigenvalue of the training loss's Hessian at each run's
final checkpoint (``local.dnn.sharpness``), on the same training frames for every run, so that
runs on one data dir can be compared (GTC against the baseline: docs/experiments/auto_tau_rice.md, "Sharpness").

The frames: the first ``--batches`` batches of ``--batch-size`` frames of the training data's epoch-0
order for seed ``--data-seed`` on one worker (the baseline's first batches), through the front end
each run was trained with. Writes one JSON line per run to stdout and, with ``--out``, a JSON list.

Usage:
  python recipes/asr/research/sharpness.py --runs exp/dnn/baseline exp/dnn/gtc
  python recipes/asr/research/sharpness.py --runs exp/lr2b/{baseline_lr2,gtc_rice_auto2.5e-3_lr2} --batches 16 --iters 30 \\
      --data-dir data/synthetic-default --out exp/lr2b/sharpness.json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the recipe: local/, evaluate.py

import torch
from evaluate import load_checkpoint, locate_run
from local.dnn.datamodule import AsrDataModule
from local.dnn.sharpness import first_batches, top_hessian_eigenvalue

log = logging.getLogger("sharpness")


def training_batches(data_dir: Path, features: str, context: int, num: int, batch_size: int,
                     seed: int) -> list[dict[str, torch.Tensor]]:
    dm = AsrDataModule(data_dir=str(data_dir), features=features, context=context, batch_size=batch_size, seed=seed)
    dm.setup("fit")
    batches = first_batches(dm.train_dataloader(), num)
    if len(batches) == num:
        return batches
    raise ValueError(f"{data_dir}: only {len(batches)} training batches of {batch_size} frames; ask for fewer "
                     f"(--batches {len(batches)}) or smaller ones (--batch-size)")


def measure_run(run_dir: Path, data_dir: Path | None, batches_by_key: dict, args) -> dict:
    summary_path = run_dir / "train_summary.json"
    if not summary_path.exists():
        raise FileNotFoundError(f"{run_dir}: no train_summary.json; is it a finished recipes/asr/train.py run?")
    checkpoint, data_dir = locate_run(run_dir, json.loads(summary_path.read_text()), data_dir)
    model, context, features = load_checkpoint(checkpoint)
    key = (str(data_dir), features, context)
    if key not in batches_by_key:
        batches_by_key[key] = training_batches(data_dir, features, context, args.batches, args.batch_size, args.data_seed)
    model = model.float()
    res = top_hessian_eigenvalue(model, batches_by_key[key], args.iters, args.tol, seed=args.seed)
    lr0 = float(model.hparams.lr)
    row = {"run": str(run_dir), "checkpoint": str(checkpoint), "lr": lr0, **res, "two_over_lr": 2.0 / lr0,
           "frames": sum(len(b["y"]) for b in batches_by_key[key])}
    if not res["converged"]:
        log.warning("%s: power iteration not converged in %d iterations (last change above tol %g); "
                    "raise --iters", run_dir, args.iters, args.tol)
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", nargs="+", required=True, type=Path, help="run dirs of recipes/asr/train.py")
    p.add_argument("--data-dir", type=Path, default=None, help="the data dir (default: the one each run recorded)")
    p.add_argument("--batches", type=int, default=16, help="training batches the loss is measured on (default 16)")
    p.add_argument("--batch-size", type=int, default=512, help="frames per batch (default 512)")
    p.add_argument("--data-seed", type=int, default=0, help="seed of the frame order the batches come from")
    p.add_argument("--iters", type=int, default=30, help="power iterations at most (default 30)")
    p.add_argument("--tol", type=float, default=1e-3, help="stop when the estimate moves less than this (relative)")
    p.add_argument("--seed", type=int, default=0, help="seed of the power iteration's start vector")
    p.add_argument("--out", type=Path, default=None, help="write the rows as a JSON list here")
    args = p.parse_args(argv)
    if args.batches < 1 or args.batch_size < 1:
        p.error(f"--batches {args.batches} and --batch-size {args.batch_size} must be >= 1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    rows, cache = [], {}
    for run_dir in args.runs:
        row = measure_run(run_dir, args.data_dir, cache, args)
        log.info("%s: sharpness %.3f (2/lr %.2f; loss %.4f on %d frames; %d iterations, %.0f s)", run_dir,
                 row["lambda_max"], row["two_over_lr"], row["loss"], row["frames"], row["iterations"], row["seconds"])
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
