#!/usr/bin/env python3
"""Train the hybrid DNN acoustic model (Strom 2015) with Lightning, on one device or with DDP/GTC.

Usage:
  python recipes/asr/train.py                          # single device (the baseline)
  python recipes/asr/train.py --strategy gtc           # gradient threshold compression, 2 CPU processes
  python recipes/asr/train.py --strategy ddp           # dense all-reduce, 2 CPU processes
  python recipes/asr/train.py --strategy ddp_bf16      # dense all-reduce in bf16, 2 CPU processes
  python recipes/asr/train.py --strategy ma            # periodic model averaging, 2 CPU processes
  python recipes/asr/train.py --strategy bmuf          # blockwise model-update filtering, 2 CPU processes
  python recipes/asr/train.py --strategy bmuf_gtc      # GTC in 2 groups of 2, BMUF across them: 4 CPU procs
  python recipes/asr/train.py --strategy gtc_stale     # GTC, updates applied one step late, 2 CPU processes
  python recipes/asr/train.py --strategy dpsgd         # ring-neighbour parameter averaging, 2 CPU processes
  python recipes/asr/train.py --config conf/strom2015.yaml --strategy gtc   # 5 x 1536, all GPUs
  python recipes/asr/train.py --strategy gtc --trainer.devices 4 --trainer.max_epochs 6 --model.lr 0.5

``--strategy {single,ddp,ddp_bf16,gtc,gtc_stale,ma,bmuf,bmuf_gtc,dpsgd}`` is a shortcut, expanded where it
stands into ``--trainer.strategy`` and ``--trainer.devices`` (CPU: 1 process for single, 4 for bmuf_gtc, 2 for the others;
GPU: 1 or all GPUs); a later
``--trainer.devices N`` or ``--config`` wins. ``conf/default.yaml`` is always read first; any
``--trainer.* / --model.* / --data.*`` overrides it (``--help`` lists them all).

Data: when ``<data_dir>/ali`` is missing, the data stages (``prepare.py``) run first, in the
process that will start the others. Output: ``<exp_dir>/<run_name>/`` with ``config.yaml``,
``metrics.csv`` (CSVLogger), ``checkpoints/last.ckpt`` and ``train_summary.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from jsonargparse import Namespace
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from local.datamodule import AsrDataModule
from local.model import AcousticModel

import gtc_lightning  # noqa: F401  (registers the "gtc" strategy, also in re-launched children)

log = logging.getLogger("train")

REPO = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = REPO / "conf" / "default.yaml"
SHORTCUTS = {"single": "auto", "ddp": "ddp", "ddp_bf16": "ddp_bf16", "gtc": "gtc", "gtc_stale": "gtc_stale",
             "ma": "ma", "bmuf": "bmuf", "bmuf_gtc": "bmuf_gtc", "dpsgd": "dpsgd"}
CPU_PROCESSES = {"bmuf_gtc": "4"}  # processes on CPU: bmuf_gtc needs two groups of 2; the others run on 2
ALI_FILES = ("ali/train_cuts.jsonl.gz", "ali/dev_cuts.jsonl.gz", "ali/info.json", "features/cmvn.json",
             "adapt/fbank_trans.pkl")


def expand_strategy_shortcut(argv: list[str], cuda: bool | None = None) -> list[str]:
    """Replace ``--strategy NAME`` (or ``--strategy=NAME``) by the trainer arguments it stands for.

    ``single`` -> strategy auto on 1 device; ``ddp``/``gtc`` -> that strategy on 2 CPU processes,
    or on all GPUs when CUDA is available.
    """
    cuda = torch.cuda.is_available() if cuda is None else cuda
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--strategy" or arg.startswith("--strategy="):
            if "=" in arg:
                name = arg.split("=", 1)[1]
            elif i + 1 < len(argv):
                name = argv[i + 1]
                i += 1
            else:
                raise ValueError("--strategy needs a value: one of " + ", ".join(SHORTCUTS))
            if name not in SHORTCUTS:
                raise ValueError(f"--strategy {name!r} is not a shortcut; use one of {', '.join(SHORTCUTS)} "
                                 "or --trainer.strategy for any Lightning strategy")
            devices = "1" if name == "single" else ("auto" if cuda else CPU_PROCESSES.get(name, "2"))
            out += [f"--trainer.strategy={SHORTCUTS[name]}", f"--trainer.devices={devices}"]
        else:
            out.append(arg)
        i += 1
    return out


def run_name_for(strategy, devices) -> str:
    """``baseline`` for one device, else the strategy's name (``gtc``, ``ddp``, ...)."""
    if isinstance(strategy, str):
        name = re.sub(r"(_spawn|_fork|_notebook)?(_find_unused_parameters_(true|false))?$", "", strategy)
    else:
        class_path = strategy.get("class_path", "") if isinstance(strategy, (dict, Namespace)) else ""
        name = class_path.rsplit(".", 1)[-1].lower().removesuffix("strategy") or type(strategy).__name__.lower()
    if name in ("auto", "single_device") and str(devices) in ("1", "[0]"):
        return "baseline"
    return name


def data_ready(data_dir: Path) -> bool:
    return all((data_dir / f).exists() for f in ALI_FILES)


class AsrCLI(LightningCLI):
    """LightningCLI with the recipe's links, data preparation and per-run output directory."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument("--corpus", default="synthetic", help="corpus prepared when data is missing")
        parser.add_argument("--corpus_dir", default=None, help="directory of a real corpus (see prepare.py)")
        parser.add_argument("--corpus_size", default="default", help="synthetic corpus size: tiny or default")
        parser.add_argument("--prepare", default=True, type=bool, help="run the data stages if ali/ is missing")
        parser.add_argument("--exp_dir", default="exp/dnn", help="runs are written to <exp_dir>/<run_name>")
        parser.add_argument("--run_name", default=None, help="default: baseline (1 device) or the strategy name")
        parser.add_argument("--num_threads", default=0, type=int,
                            help="torch threads per process; 0: CPU cores / processes on this node")
        parser.link_arguments("data.num_pdfs", "model.num_pdfs", apply_on="instantiate")
        parser.link_arguments("data.input_dim", "model.input_dim", apply_on="instantiate")

    def before_instantiate_classes(self) -> None:
        cfg = self.config
        if cfg.data.data_dir is None:
            from prepare import default_data_dir

            cfg.data.data_dir = str(default_data_dir(cfg.corpus, cfg.corpus_size))
        data_dir = Path(cfg.data.data_dir)
        if not data_ready(data_dir):
            self._prepare_data(data_dir)
        name = cfg.run_name or run_name_for(cfg.trainer.strategy, cfg.trainer.devices)
        run_dir = Path(cfg.trainer.default_root_dir or Path(cfg.exp_dir) / name)
        cfg.run_name = name
        cfg.trainer.default_root_dir = str(run_dir)
        if cfg.trainer.logger in (None, True):
            cfg.trainer.logger = Namespace(class_path="lightning.pytorch.loggers.CSVLogger",
                                           init_args=Namespace(save_dir=str(run_dir), name="", version=""))
        threads = cfg.num_threads or self._auto_threads()
        torch.set_num_threads(threads)
        log.info("run %s -> %s; data %s; %d torch thread(s) per process", name, run_dir, data_dir, threads)

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        trainer = super().instantiate_trainer(**kwargs)
        cfg = self.config
        label = run_name_for(cfg.trainer.strategy, cfg.trainer.devices)
        trainer.callbacks.append(RunSummary(Path(cfg.trainer.default_root_dir), cfg.run_name, label,
                                            Path(cfg.data.data_dir)))
        return trainer

    def _prepare_data(self, data_dir: Path) -> None:
        cfg = self.config
        missing = [f for f in ALI_FILES if not (data_dir / f).exists()]
        if os.environ.get("LOCAL_RANK", "0") != "0" or not cfg.prepare:
            raise RuntimeError(f"{data_dir} lacks {missing}; run `python recipes/asr/prepare.py --data-dir "
                               f"{data_dir}` first (train.py prepares data only in the launching process)")
        from prepare import prepare

        log.info("%s lacks %s: running the data stages first", data_dir, missing)
        prepare(corpus=cfg.corpus, corpus_dir=cfg.corpus_dir, data_dir=data_dir, size=cfg.corpus_size)
        if not data_ready(data_dir):
            raise RuntimeError(f"prepare.py finished but {data_dir} still lacks some of {ALI_FILES}")

    def _auto_threads(self) -> int:
        devices = self.config.trainer.devices
        accelerator = str(self.config.trainer.accelerator)
        on_cpu = accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available())
        procs = int(devices) if on_cpu and str(devices).isdigit() else 1
        return max(1, (os.cpu_count() or 1) // max(procs, 1))


class RunSummary(Callback):
    """Writes ``train_summary.json`` on global rank 0 when training ends (inside the training
    process, so forked/spawned ranks report too): what ran, how fast, how accurate."""

    def __init__(self, run_dir: Path, run_name: str, strategy_label: str, data_dir: Path) -> None:
        self.run_dir, self.run_name, self.strategy_label, self.data_dir = run_dir, run_name, strategy_label, data_dir
        self._start = time.perf_counter()

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start = time.perf_counter()

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        strategy, ckpt = trainer.strategy, trainer.checkpoint_callback
        summary = {
            "run_name": self.run_name,
            "strategy": self.strategy_label,
            "strategy_class": type(strategy).__name__,
            "world_size": trainer.world_size,
            "accelerator": type(trainer.accelerator).__name__,
            "tau": getattr(strategy, "tau", None),
            "gtc": getattr(strategy, "gtc_stats", None),  # rank 0's step count and byte totals
            "sync": getattr(strategy, "sync_stats", None),  # ma, bmuf, bmuf_gtc: rank 0's syncs and bytes
            "epochs": trainer.current_epoch,
            "global_steps": trainer.global_step,
            "dev_frame_acc": list(getattr(pl_module, "dev_acc_history", [])),
            "train_seconds": round(time.perf_counter() - self._start, 1),
            "checkpoint": str(Path(ckpt.last_model_path).resolve()) if ckpt and ckpt.last_model_path else None,
            "data_dir": str(self.data_dir.resolve()),
            "num_weights": sum(p.numel() for p in pl_module.parameters()),
            "model": {k: v for k, v in pl_module.hparams.items() if not k.startswith("_")},
            "data": {k: v for k, v in trainer.datamodule.hparams.items() if not k.startswith("_")}
            if trainer.datamodule is not None else None,
        }
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / "train_summary.json"
        path.write_text(json.dumps(summary, indent=1, default=str))
        log.info("trained %s in %.0f s: dev frame accuracy per epoch %s; summary %s", self.run_name,
                 summary["train_seconds"], [f"{a:.4f}" for a in summary["dev_frame_acc"]], path)


def build_cli(argv: list[str] | None) -> AsrCLI:
    """Parse ``argv`` (shortcut included; ``None``: ``sys.argv``, already expanded), prepare data if
    needed, instantiate model, data, trainer."""
    return AsrCLI(
        AcousticModel,
        AsrDataModule,
        args=None if argv is None else expand_strategy_shortcut(argv),
        run=False,
        parser_kwargs={"default_config_files": [str(DEFAULT_CONFIG)], "description": __doc__,
                       "formatter_class": argparse.RawDescriptionHelpFormatter},
        trainer_defaults={"callbacks": [ModelCheckpoint(save_last=True, save_top_k=0, enable_version_counter=False)]},
        save_config_kwargs={"overwrite": True},
    )


def main(argv: list[str] | None = None) -> AsrCLI:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if argv is None:
        # Expanded in place: Lightning's popen launcher starts the other ranks with sys.argv.
        sys.argv[1:] = expand_strategy_shortcut(sys.argv[1:])
    cli = build_cli(argv)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    return cli


if __name__ == "__main__":
    main()
