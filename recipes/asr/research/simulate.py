#!/usr/bin/env python3
"""Train the recipe's DNN with N data-parallel workers simulated in one process (``gtc_lightning.tools.simulate``):
what ``gtc``, ``ma``, ``bmuf`` and ``bmuf_gtc`` learn at 8 to 128 workers, on one device.

Each worker gets the batches ``train.py --trainer.devices N`` gives rank r (the same permutation of
the frames per seed and epoch, every N-th frame of it from r), the model starts from the same
initialisation (``--seed``), the learning rate follows the same schedule after each epoch (on worker
0's dev frame accuracy, as rank 0's), and the run directory has what ``evaluate.py --runs`` reads
(``train_summary.json``, ``config.yaml`` with the seed, ``checkpoints/last.ckpt``: the model a real
run's checkpoint holds), so a simulated run is decoded and compared like a trained one. Dev frame
accuracy and the checkpoint are of the model a real run's evaluation loops see: for ``gtc`` the one model;
for ``ma``, ``bmuf`` and ``bmuf_gtc`` the mean of the workers' models (the strategies' ``average_eval``),
scored on all of dev where a real run sums the ranks' shares. The global
batch stays ``--global-batch`` frames (512: the recipe's 2 x 256), so that only the scheme and the
number of workers change, as in the README's strategy comparison. ``gtc`` and ``bmuf_gtc`` are Strom's
gradient mode at ``--tau`` in 32-bit words, as ``--config conf/gtc.yaml`` (and ``conf/bmuf_gtc.yaml``)
train it (with ``--target-density``: automatic tau from ``--tau``), not ``--strategy gtc``, which runs
GTCStrategy's defaults.

Speed is not simulated (the workers run one after the other): the scaling model gives it.
The work grows with the workers (one pass over a 1.5 M-float residual per GTC worker and step): on
this 2-core CPU, one thread, about 6 ms per GTC worker and step (9 ms per ``bmuf_gtc`` worker in
groups of 8, 10 ms per BMUF worker), so an epoch of 1,648 steps takes about 3 minutes at 16 workers
and 20 at 128. On CUDA the GTC ops run as Triton kernels.

Usage:
  python recipes/asr/research/simulate.py --scheme gtc --workers 32 --exp-dir exp/sim --seed 0
  python recipes/asr/research/simulate.py --scheme bmuf_gtc --workers 128 --group-size 8 --period 50
  python recipes/asr/evaluate.py --runs exp/dnn/baseline exp/sim/gtc_w32 --out exp/sim/compare
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the recipe: local/, evaluate.py

import numpy as np
import torch
import yaml
from local.dnn.datamodule import AsrDataModule, FrameBatches, shard_batches
from local.dnn.model import AcousticModel

log = logging.getLogger("simulate")


def worker_batches(dm: AsrDataModule, workers: int, batch_size: int, seed: int, epoch: int):
    """Per step, each worker's batch (``{"x", "y"}``): rank r's batches of ``train.py`` on N devices,
    from the data module's training frames through its own ``FrameBatches``."""
    feats, targets, offsets = dm.splits["train"]
    loaders = [FrameBatches(feats, targets, offsets, dm.hparams.context,
                            lambda e, r=r: shard_batches(len(feats), r, workers, batch_size, seed, e), lambda: epoch)
               for r in range(workers)]
    yield from zip(*loaders, strict=True)


@torch.no_grad()
def frame_accuracy(model: torch.nn.Module, dm: AsrDataModule, device: torch.device) -> float:
    """Frame accuracy of ``model`` on the data module's dev batches (all of dev: no trainer, one rank)."""
    model.eval()
    correct = total = 0
    for batch in dm.val_dataloader():
        correct += int((model(batch["x"].to(device)).argmax(dim=-1).cpu() == batch["y"]).sum())
        total += batch["y"].numel()
    model.train()
    return correct / max(total, 1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from gtc_lightning.tools.simulate import SCHEMES

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scheme", choices=SCHEMES, required=True)
    p.add_argument("--workers", type=int, required=True, help="simulated workers (>= 2)")
    p.add_argument("--data-dir", default="data/synthetic-default", help="the recipe's data dir (stages 0-6 done)")
    p.add_argument("--features", default="fbank_sat", help="the DNN's front end, as train.py's --data.features")
    p.add_argument("--global-batch", type=int, default=512, help="frames per step over all workers")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--schedule", choices=("halve", "newbob"), default="halve")
    p.add_argument("--lr", type=float, default=1.0)
    p.add_argument("--hidden-dim", type=int, default=512)
    p.add_argument("--num-layers", type=int, default=5)
    p.add_argument("--hold-epochs", type=int, default=0)
    p.add_argument("--tau", type=float, default=0.01, help="gtc, bmuf_gtc: the threshold (with --target-density: "
                   "its starting value)")
    p.add_argument("--target-density", type=float, default=None,
                   help="gtc, bmuf_gtc: automatic tau, as GTCStrategy(target_density=...): words per worker and "
                   "weight to aim for, e.g. 1e-3 (default: tau fixed)")
    p.add_argument("--period", type=int, default=50, help="ma, bmuf, bmuf_gtc: K, steps between syncs")
    p.add_argument("--group-size", type=int, default=2, help="bmuf_gtc: workers per GTC group")
    p.add_argument("--block-momentum", type=float, default=None, help="bmuf, bmuf_gtc: η (default 1 - 1/N)")
    p.add_argument("--block-lr", type=float, default=1.0, help="bmuf, bmuf_gtc: ζ")
    p.add_argument("--no-nesterov", action="store_true", help="bmuf, bmuf_gtc: classical block momentum")
    p.add_argument("--seed", type=int, default=0, help="as train.py's --seed_everything and --data.seed")
    p.add_argument("--exp-dir", default="exp/sim")
    p.add_argument("--run-name", default=None, help="default: <scheme>_w<workers>")
    p.add_argument("--flush-denormal", action="store_true",
                   help="treat denormal floats (below 1.2e-38) as zero on CPU (torch.set_flush_denormal): where "
                   "saturated sigmoids make the gradients denormal, each GEMM on them runs ~50x slower here")
    p.add_argument("--device", default="auto", help="auto (cuda when there is one), cpu or cuda")
    a = p.parse_args(argv)
    if a.workers < 2:
        p.error(f"--workers {a.workers}: simulate 2 or more (one worker is train.py's baseline)")
    if a.global_batch % a.workers:
        p.error(f"--global-batch {a.global_batch} does not split into {a.workers} equal batches; "
                f"use a multiple of {a.workers}")
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device here; use --device cpu (or auto)")
    if a.target_density is not None and a.scheme not in ("gtc", "bmuf_gtc"):
        p.error(f"--target-density is automatic tau for gtc and bmuf_gtc; --scheme {a.scheme} has no tau")
    if a.epochs < 1:
        p.error(f"--epochs {a.epochs}: train at least one")
    return a


def main(argv: list[str] | None = None) -> dict:
    a = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import lightning as L

    from gtc_lightning.tools.simulate import VirtualWorkers

    device = torch.device("cuda" if a.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if a.device == "auto" else a.device))
    run_name = a.run_name or f"{a.scheme}_w{a.workers}"
    run_dir = Path(a.exp_dir) / run_name
    L.seed_everything(a.seed)  # as LightningCLI's seed_everything, before the model is made
    if a.flush_denormal and not torch.set_flush_denormal(True):
        log.warning("--flush-denormal: this CPU cannot flush denormals (no SSE3); running without")
    batch = a.global_batch // a.workers
    dm = AsrDataModule(a.data_dir, features=a.features, batch_size=batch, seed=a.seed)
    dm.setup("fit")
    model = AcousticModel(input_dim=dm.input_dim, num_pdfs=dm.num_pdfs, hidden_dim=a.hidden_dim,
                          num_layers=a.num_layers, lr=a.lr, schedule=a.schedule, hold_epochs=a.hold_epochs).to(device)
    sim = VirtualWorkers(
        model, lambda params: torch.optim.SGD(params, lr=a.lr, momentum=model.hparams.momentum),
        lambda m, b: torch.nn.functional.cross_entropy(m(b["x"].to(device)), b["y"].to(device)),
        a.scheme, a.workers, tau=a.tau, period=a.period, block_momentum=a.block_momentum,
        block_lr=a.block_lr, nesterov=not a.no_nesterov, group_size=a.group_size, target_density=a.target_density,
    )  # fmt: skip
    log.info("%s on %d simulated workers (%d frames each per step) on %s: %d weights, %d training frames",
             a.scheme, a.workers, batch, device, sim.numel, len(dm.splits["train"][0]))
    start = time.perf_counter()
    for epoch in range(a.epochs):
        t0, losses = time.perf_counter(), []
        for i, batches in enumerate(worker_batches(dm, a.workers, batch, a.seed, epoch)):
            losses.append(sim.step(batches))
            if i % 200 == 0:
                log.info("epoch %d step %d: loss %.3f%s", epoch, i, losses[-1],
                         f", tau {sim.taus[0]:.4g}" if sim.controllers else "")  # fmt: skip
        with sim.evaluated() as evaluated:  # what a real run's validation sees (ma, bmuf: the workers' mean)
            acc = frame_accuracy(evaluated, dm, device)
        model.dev_acc_history.append(acc)
        lr = sim.optimizers[0].param_groups[0]["lr"]
        if model.halve_after_epoch(epoch):
            sim.scale_lr(0.5)
        log.info("epoch %d: %d steps, train loss %.3f, dev frame accuracy %.4f (worker 0), lr %g, %.0f s, %s%s",
                 epoch, len(losses), float(np.mean(losses)), acc, lr, time.perf_counter() - t0, sim.totals,
                 f", tau {sim.taus[0]:.4g}" if sim.compressed else "")  # fmt: skip
    seconds = time.perf_counter() - start
    (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    with sim.evaluated() as evaluated:  # a real run's checkpoint: the mean of the ranks' models (ma, bmuf)
        state_dict = {k: v.detach().cpu().clone() for k, v in evaluated.state_dict().items()}
    torch.save({
        "state_dict": state_dict,
        "hyper_parameters": dict(model.hparams),
        "datamodule_hyper_parameters": dict(dm.hparams),
        "pytorch-lightning_version": L.__version__,
        "epoch": a.epochs - 1,
        "global_step": sim.step_count,
        "dev_acc_history": list(model.dev_acc_history),
        "newbob_halving": model._newbob_halving,
    }, ckpt)  # fmt: skip
    stats = sim.stats()
    summary = {
        "run_name": run_name,
        "strategy": f"{a.scheme} (simulated)",
        "strategy_class": "VirtualWorkers",
        "world_size": a.workers,
        "accelerator": device.type,
        "tau": sim.taus[0] if sim.compressed else None,  # the last one where it moved (--target-density)
        "gtc": stats["gtc"],
        "sync": stats["sync"],
        "epochs": a.epochs,
        "global_steps": sim.step_count,
        "dev_frame_acc": list(model.dev_acc_history),
        "train_seconds": round(seconds, 1),
        "checkpoint": str(ckpt.resolve()),
        "data_dir": str(Path(a.data_dir).resolve()),
        "num_weights": sim.numel,
        "model": dict(model.hparams),
        "data": dict(dm.hparams),
        "simulated": {"scheme": a.scheme, "workers": a.workers, "batch_per_worker": batch, "tau": a.tau,
                      "target_density": a.target_density, "final_taus": sim.taus if sim.compressed else None,
                      "period": a.period, "group_size": a.group_size, "block_momentum": sim.block_momentum,
                      "block_lr": a.block_lr, "nesterov": not a.no_nesterov, "dense_steps": sim.totals["dense_steps"],
                      "syncs": sim.totals["syncs"]},
    }
    (run_dir / "train_summary.json").write_text(json.dumps(summary, indent=1, default=str))
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"seed_everything": a.seed, "simulate": vars(a)}))
    log.info("simulated %s in %.0f s: dev frame accuracy per epoch %s; %s", run_name, seconds,
             [f"{x:.4f}" for x in model.dev_acc_history], run_dir / "train_summary.json")
    return summary


if __name__ == "__main__":
    main()
