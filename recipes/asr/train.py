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
  python recipes/asr/train.py --strategy adpsgd        # asynchronous pair averaging (ADPSGD), 2 CPU processes
  python recipes/asr/train.py --strategy diloco        # DiLoCo's block syncs (H = 500), 2 CPU processes
  python recipes/asr/train.py --config conf/diloco.yaml  # the same at H = 50 (the recipe's runs are short)
  python recipes/asr/train.py --strategy sparseloco    # DiLoCo's block update as GTC words, 2 CPU processes
  python recipes/asr/train.py --config conf/strom2015.yaml --strategy gtc   # 5 x 1536, all GPUs
  python recipes/asr/train.py --strategy gtc --trainer.devices 4 --trainer.max_epochs 6 --model.lr 0.5

``--strategy {single,ddp,ddp_bf16,gtc,gtc_stale,ma,bmuf,bmuf_gtc,dpsgd,adpsgd,diloco,sparseloco}`` is a shortcut, expanded where it
stands into ``--trainer.strategy`` and ``--trainer.devices`` (CPU: 1 process for single, 4 for bmuf_gtc, 2 for the others;
GPU: 1 or all GPUs); a later
``--trainer.devices N`` or ``--config`` wins. ``conf/default.yaml`` is always read first; any
``--trainer.* / --model.* / --data.*`` overrides it (``--help`` lists them all).

Data: when ``<data_dir>/ali`` is missing, the data stages (``prepare.py``) run first, in the
process that will start the others (only into a new directory or one prepare.py made). Output:
``<exp_dir>/<run_name>/`` with ``config.yaml``, ``metrics.csv`` (CSVLogger),
``checkpoints/last.ckpt`` and ``train_summary.json``.

Checkpoints and resuming: ``checkpoints/last.ckpt`` is rewritten every
``--checkpoint_every_n_steps`` optimizer steps (default 1000; 0: epoch ends only) and at every
epoch end. ``--ckpt_path last`` resumes the run directory's newest checkpoint (``--ckpt_path
PATH``: that file), bit-exactly: parameters, optimizer state, learning rate, the data order
mid-epoch and GTC's residuals (every rank's, saved beside the checkpoint). Give the same command
plus ``--ckpt_path last``.

Failures: a collective that waits longer than ``--collective_timeout`` seconds (default 300)
fails; when a rank dies the others stop with an error naming it, and the command to resume is
printed.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import difflib
import functools
import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from jsonargparse import Namespace
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.callbacks import ModelCheckpoint, TQDMProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from local.dnn.compare import strategy_name
from local.dnn.datamodule import AsrDataModule
from local.dnn.model import AcousticModel
from local.dnn.precision import native_bf16_cpu

import gtc_lightning  # noqa: F401  (registers the "gtc" strategy, also in re-launched children)
from gtc_lightning.algorithms.common import busy_wait_fits, finish

log = logging.getLogger("train")

REPO = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = REPO / "conf" / "default.yaml"
SHORTCUTS = {"single": "auto", "ddp": "ddp", "ddp_bf16": "ddp_bf16", "gtc": "gtc", "gtc_stale": "gtc_stale",
             "ma": "ma", "bmuf": "bmuf", "bmuf_gtc": "bmuf_gtc", "dpsgd": "dpsgd",
             "adpsgd": "adpsgd", "diloco": "diloco", "sparseloco": "sparseloco"}
CPU_PROCESSES = {"bmuf_gtc": "4"}  # processes on CPU: bmuf_gtc needs two groups of 2; the others run on 2
ALI_FILES = ("ali/train_cuts.jsonl.gz", "ali/dev_cuts.jsonl.gz", "ali/info.json", "features/cmvn.json",
             "adapt/fbank_trans.pkl", "adapt/fbank_sat_trans.pkl")
RECIPE_MARKS = ("settings.json", ".done", "manifests", "ali")  # what prepare.py writes into a data dir
MODEL_SHAPE = ("input_dim", "num_pdfs", "hidden_dim", "num_layers")  # hyper-parameters that set tensor shapes


class RecipeError(ValueError):
    """Bad input to train.py: the message names the value and the fix (printed without a traceback)."""


class DataNotReady(RecipeError, RuntimeError):
    """The data dir lacks the alignments and train.py may not prepare them here."""


class RankLostError(RuntimeError):
    """A distributed run stopped because a rank was lost; the message names it and how to resume."""


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
                raise RecipeError(f"--strategy {name!r} is not a shortcut{_did_you_mean(name, SHORTCUTS)}; use "
                                  f"one of {', '.join(SHORTCUTS)} or --trainer.strategy for any Lightning strategy")
            devices = "1" if name == "single" else ("auto" if cuda else CPU_PROCESSES.get(name, "2"))
            out += [f"--trainer.strategy={SHORTCUTS[name]}", f"--trainer.devices={devices}"]
        else:
            out.append(arg)
        i += 1
    return out


def run_name_for(strategy, devices) -> str:
    """``baseline`` for one device, else the strategy's name (``gtc``, ``ddp``, ``ma``, ...)."""
    return strategy_name(strategy, devices)


def _did_you_mean(name: str, choices) -> str:
    close = difflib.get_close_matches(name, list(choices), n=3, cutoff=0.6)
    return f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""


def data_ready(data_dir: Path) -> bool:
    return all((data_dir / f).exists() for f in ALI_FILES)


def check_strategy_name(strategy) -> None:
    """A strategy given by name must exist: Lightning's own error calls any unknown string invalid
    without naming the recipe's strategies."""
    if not isinstance(strategy, str) or strategy == "auto" or strategy in StrategyRegistry:
        return
    names = [n for n in StrategyRegistry.available_strategies() if "find_unused" not in n]
    raise RecipeError(
        f"--trainer.strategy {strategy!r} does not exist{_did_you_mean(strategy, [*SHORTCUTS, *names])}. Use "
        f"--strategy {{{','.join(SHORTCUTS)}}} (the recipe's shortcuts), a registered name ({', '.join(names)}) "
        "or a class path (--trainer.strategy gtc_lightning.GTCStrategy)")


def checkpoint_dir(run_dir: Path) -> Path:
    """Where the recipe's checkpoints go (the CSV logger's directory is the run directory)."""
    return run_dir / "checkpoints"


def resolve_ckpt_path(ckpt_path: str | None, run_dir: Path) -> str | None:
    """``--ckpt_path``: ``None``, ``last`` (the newest ``*.ckpt`` in the run's checkpoint directory) or a file."""
    if ckpt_path in (None, "", "null", "none"):
        return None
    if ckpt_path == "last":
        ckpt_dir = checkpoint_dir(run_dir)
        if (ckpt_dir / RecipeCheckpoint.LINK).is_file():  # the last checkpoint every rank finished
            return str(ckpt_dir / RecipeCheckpoint.LINK)
        found = sorted(ckpt_dir.glob("*.ckpt"), key=lambda f: f.stat().st_mtime) if ckpt_dir.is_dir() else []
        if not found:
            raise RecipeError(
                f"--ckpt_path last: no checkpoint in {ckpt_dir}, the run directory of this command "
                f"(<exp_dir>/<run_name>). Give the --exp_dir/--run_name (or --strategy/--config) of the run to "
                "resume, a checkpoint file (--ckpt_path PATH), or leave --ckpt_path out to start afresh")
        return str(found[-1])
    path = Path(ckpt_path)
    if not path.is_file():
        raise RecipeError(f"--ckpt_path {ckpt_path}: no such file; give a checkpoint file (e.g. "
                          f"{checkpoint_dir(run_dir) / 'last.ckpt'}) or --ckpt_path last for this run's newest")
    return str(path)


def check_checkpoint(path: str, model: LightningModule) -> None:
    """Refuse, before anything is written, a checkpoint that cannot be read or holds another model."""
    fix = ("resume from another checkpoint (--ckpt_path PATH) or leave --ckpt_path out to start afresh")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # a truncated zip, garbage bytes, an empty file: torch raises many kinds
        raise RecipeError(f"--ckpt_path {path}: not a readable checkpoint, it is truncated or corrupt "
                          f"({type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}); "
                          f"{fix}") from exc
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt or "loops" not in ckpt:
        raise RecipeError(f"--ckpt_path {path}: not a Lightning training checkpoint (no state_dict/loops "
                          f"entries); give a checkpoints/*.ckpt written by train.py, or {fix}")
    saved = {k: tuple(v.shape) for k, v in ckpt["state_dict"].items()}
    wanted = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if saved == wanted:
        return
    hp_saved, hp_now = ckpt.get("hyper_parameters", {}), model.hparams
    differ = [k for k in MODEL_SHAPE if k in hp_saved and hp_saved[k] != hp_now.get(k)]
    if differ:
        what = ", ".join(f"{k}={hp_saved[k]} (this run: {hp_now.get(k)})" for k in differ)
        flags = " ".join(f"--model.{k} {hp_saved[k]}" for k in differ if k not in ("input_dim", "num_pdfs"))
        hint = (f"resume with the checkpoint's settings ({flags}, or the --config of the run that saved it)"
                if flags else "resume on the data dir (and --data.features/--data.context) the checkpoint was "
                "trained on")
    else:
        key = next(k for k in sorted(set(saved) | set(wanted)) if saved.get(k) != wanted.get(k))
        what, hint = f"{key}: {saved.get(key)} in the checkpoint, {wanted.get(key)} here", "resume with its settings"
    raise RecipeError(f"--ckpt_path {path} holds a model of another size: {what}; {hint}, or leave --ckpt_path "
                      "out to train this model afresh")


def keep_metrics_on_resume(trainer: Trainer) -> None:
    """Lightning's CSV logger deletes an existing ``metrics.csv``; a resumed run appends to it."""
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.loggers.csv_logs import ExperimentWriter

    class AppendingWriter(ExperimentWriter):
        def _check_log_dir_exists(self) -> None:
            if self._fs.isfile(self.metrics_file_path):  # keep its rows; new columns rewrite the header
                with self._fs.open(self.metrics_file_path, "r", newline="") as file:
                    self.metrics_keys = sorted(next(csv.reader(file), []))

    for logger in trainer.loggers:
        if isinstance(logger, CSVLogger) and logger._experiment is None:
            logger._experiment = AppendingWriter(log_dir=logger.log_dir)


class RecipeCheckpoint(ModelCheckpoint):
    """``checkpoints/last.ckpt``, rewritten every ``every_n_train_steps`` optimizer steps (0: never
    mid-epoch) and at the end of every epoch (after validation and the learning-rate update).

    Each save goes to a file of its own, ``step<S>.ckpt`` (``step<S>-end.ckpt`` at an epoch end),
    with every rank's shards beside it, and ``last.ckpt`` is a link that moves to it only after
    every rank has written (Lightning's barrier ends ``Trainer.save_checkpoint``); the checkpoint it
    pointed to is removed then. A rank lost while the others save (a cut link) thus leaves the
    previous checkpoint complete as ``last.ckpt``: rewriting ``last.ckpt`` in place left rank 0's
    step with shards of other ranks from an earlier step (seen with bmuf_gtc, whose groups run
    apart between syncs), and the resumed ranks then waited for each other's collectives.

    Every rank removes its own shards of the replaced checkpoints (the strategies' ``remove_checkpoint``:
    on several nodes each may have written to a disk of its own), after a barrier that follows the
    link's move, so that no shard of the checkpoint ``last.ckpt`` names is removed before it names
    the new one."""

    LINK = "last.ckpt"

    def __init__(self, every_n_train_steps: int = 0) -> None:
        super().__init__(save_last=True, save_top_k=0, enable_version_counter=False,
                         every_n_train_steps=every_n_train_steps or None)

    def set_every_n_train_steps(self, every_n_train_steps: int) -> None:
        if every_n_train_steps < 0:
            raise RecipeError(f"--checkpoint_every_n_steps {every_n_train_steps}: give 0 (epoch ends only) or more")
        self._every_n_train_steps = every_n_train_steps

    @property
    def state_key(self) -> str:
        return "RecipeCheckpoint"  # the same whatever the interval, so a resume may change it

    def _save_last_checkpoint(self, trainer: Trainer, monitor_candidates: dict, end: bool = False) -> None:
        # the same name on every rank (each writes its shards beside it), chosen without looking at files
        target = Path(self.dirpath) / f"step{trainer.global_step}{'-end' if end else ''}.ckpt"
        link = Path(self.dirpath) / self.LINK
        self.last_model_path = str(link)
        self._save_checkpoint(trainer, str(target))  # returns after every rank has written its part
        if trainer.is_global_zero:
            temporary = link.with_name(f".{self.LINK}.{os.getpid()}")
            temporary.unlink(missing_ok=True)
            temporary.symlink_to(target.name)
            os.replace(temporary, link)  # atomic: last.ckpt is the old checkpoint or the new one
        trainer.strategy.barrier("RecipeCheckpoint: last.ckpt moved")
        for old in self._replaced(target):
            trainer.strategy.remove_checkpoint(str(old))

    def _replaced(self, target: Path) -> list[Path]:
        """The checkpoints to remove, as this rank sees the folder: the replaced one and any a failed
        save left, by their files (``step<S>.ckpt``) or by their shard folders (``step<S>.ckpt.<kind>``,
        all a rank on a disk of its own may have)."""
        folder = Path(self.dirpath)
        if not folder.is_dir():  # a rank without shards, on a disk of its own
            return []
        names = set()
        for path in folder.iterdir():
            if path.is_symlink() or path.name.startswith("."):
                continue
            if path.is_file() and path.suffix == ".ckpt":
                names.add(path.name)
            elif path.is_dir() and ".ckpt." in path.name:
                names.add(path.name[: path.name.index(".ckpt.") + len(".ckpt")])
        return [folder / name for name in sorted(names - {target.name, self.LINK})]

    def _save_epoch_end(self, trainer: Trainer) -> None:
        if trainer.fast_dev_run or trainer.state.fn != TrainerFn.FITTING or trainer.sanity_checking:
            return
        self._save_last_checkpoint(trainer, self._monitor_candidates(trainer), end=True)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._should_save_on_train_epoch_end(trainer):
            self._save_epoch_end(trainer)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self._should_save_on_train_epoch_end(trainer):
            self._save_epoch_end(trainer)


class OneBucketLayout(Callback):
    """Lays DDP's gradient buckets out once, in parameter order, before the first step.

    DDP lays them out twice: in parameter order for the first step after it is built, then in the
    order the gradients came ready. With more than 2 ranks the sum of each element depends on where
    it sits in its bucket (gloo's ring adds each chunk starting at another rank), so a resumed
    run's first step, in the first layout where the uninterrupted run was already in the second,
    differed in the last bits (4 ranks of ddp or ddp_bf16: ~1e-7 on most weights after 60 steps).
    Pushing every parameter as "rebuilt" makes DDP's one rebuild, at the first forward, use
    parameter order in every run. Only with more than 2 ranks: the sum of 2 numbers has no order.
    """

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        reducer = getattr(trainer.strategy.model, "reducer", None)
        if trainer.world_size > 2 and hasattr(reducer, "_push_all_rebuilt_params"):  # torch's private API
            reducer._push_all_rebuilt_params()


class AsrCLI(LightningCLI):
    """LightningCLI with the recipe's links, data preparation and per-run output directory."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument("--corpus", default=None, type=str | None,
                            help="corpus prepared when data is missing (default: the one the data dir's settings.json "
                                 "records, else synthetic)")
        parser.add_argument("--corpus_dir", default=None, help="directory of a real corpus (see prepare.py)")
        parser.add_argument("--corpus_size", default=None, type=str | None,
                            help="synthetic corpus size: tiny or default (default: as recorded, else default)")
        parser.add_argument("--prepare", default=True, type=bool, help="run the data stages if ali/ is missing")
        parser.add_argument("--exp_dir", default="exp/dnn", help="runs are written to <exp_dir>/<run_name>")
        parser.add_argument("--run_name", default=None, help="default: baseline (1 device) or the strategy name")
        parser.add_argument("--num_threads", default=0, type=int,
                            help="torch threads per process; 0: CPU cores / processes on this node")
        parser.add_argument("--ckpt_path", default=None, type=str | None,
                            help="resume from this checkpoint; 'last': the newest in <exp_dir>/<run_name>/checkpoints")
        parser.add_argument("--checkpoint_every_n_steps", default=1000, type=int,
                            help="rewrite checkpoints/last.ckpt every N optimizer steps (and at every epoch end); "
                                 "0: at epoch ends only")
        parser.add_argument("--collective_timeout", default=300.0, type=float,
                            help="seconds a collective may wait for the other ranks before the run fails "
                                 "(torch's default is 1800)")
        parser.link_arguments("data.num_pdfs", "model.num_pdfs", apply_on="instantiate")
        parser.link_arguments("data.input_dim", "model.input_dim", apply_on="instantiate")

    def before_instantiate_classes(self) -> None:
        cfg = self.config
        if cfg.data.data_dir is None:
            from prepare import default_data_dir

            cfg.data.data_dir = str(default_data_dir(cfg.corpus or "synthetic", cfg.corpus_size or "default"))
        check_strategy_name(cfg.trainer.strategy)
        if cfg.collective_timeout <= 0:
            raise RecipeError(f"--collective_timeout {cfg.collective_timeout}: give seconds > 0 (default 300)")
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
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, RecipeCheckpoint):
                callback.set_every_n_train_steps(cfg.checkpoint_every_n_steps)
        if hasattr(trainer.strategy, "_timeout"):  # DDPStrategy and every strategy of gtc_lightning
            trainer.strategy._timeout = timedelta(seconds=cfg.collective_timeout)
        if trainer.world_size > 1:
            trainer.callbacks.append(RankWatch())
        if trainer.world_size > 2:
            trainer.callbacks.append(OneBucketLayout())
        self._check_precision(trainer)
        quiet_progress(trainer)
        return trainer

    @staticmethod
    def _check_precision(trainer: Trainer) -> None:
        """bfloat16 on a CPU that emulates it runs, slower than float32: say so (run.sh picks for the device)."""
        on_cpu = isinstance(trainer.accelerator, CPUAccelerator)
        if "bf16" in str(trainer.precision) and on_cpu and not native_bf16_cpu():
            log.warning("--trainer.precision %s on a CPU without native bfloat16 (no AVX512-BF16 or AMX): oneDNN "
                        "emulates it, slower than float32; --trainer.precision 32-true is faster here",
                        trainer.precision)

    def _prepare_data(self, data_dir: Path) -> None:
        cfg = self.config
        missing = [f for f in ALI_FILES if not (data_dir / f).exists()]
        if data_dir.is_dir() and any(data_dir.iterdir()) and not any((data_dir / m).exists() for m in RECIPE_MARKS):
            raise DataNotReady(
                f"--data.data_dir {data_dir} is not a recipe data dir (none of {', '.join(RECIPE_MARKS)}); train.py "
                "writes the data stages only into a new directory or one prepare.py made, so it left this one "
                "untouched. Give the --data-dir that prepare.py wrote, or prepare this corpus into a new one: "
                f"`python recipes/asr/prepare.py --corpus {{kaldi,librispeech,...}} --corpus-dir {data_dir} "
                "--data-dir data/<name>`")
        if os.environ.get("LOCAL_RANK", "0") != "0" or not cfg.prepare:
            raise DataNotReady(f"{data_dir} lacks {missing} (the alignments of the data stages); run "
                               f"`python recipes/asr/prepare.py --data-dir {data_dir}` first (train.py prepares "
                               "data only in the launching process, and only with --prepare true)")
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
            "precision": str(trainer.precision),  # 32-true, or bf16-mixed: products in bfloat16, weights in float32
            "tau": getattr(strategy, "tau", None),
            # GTC's settings as fit resolved them (the defaults are automatic tau, Rice coding and, with one
            # optimizer, the update mode): what the comparison labels the run with
            "target_density": getattr(strategy, "target_density", None),
            "coding": getattr(strategy, "coding", None),
            "compress": getattr(strategy, "compress", None),
            "gtc": getattr(strategy, "gtc_stats", None),  # rank 0's step count and byte totals
            "sync": getattr(strategy, "sync_stats", None),  # ma, bmuf, bmuf_gtc: rank 0's syncs and bytes
            "epochs": trainer.current_epoch,
            "global_steps": trainer.global_step,
            "dev_frame_acc": list(getattr(pl_module, "dev_acc_history", [])),
            # --data.cv_speakers: the held-out training speakers and their frame accuracy per epoch
            "cv_speakers": getattr(trainer.datamodule, "cv_speaker_list", None),
            "cv_frame_acc": list(getattr(pl_module, "cv_acc_history", [])),
            "schedule_decisions": getattr(pl_module, "schedule_decisions", []),  # --model.schedule nnet1
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


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


class RankWatch(Callback):
    """Names the rank a distributed run lost. Each rank publishes its host and pid and a heartbeat
    (a counter bumped every ``period`` seconds) in the rendezvous store; when training fails,
    :meth:`on_exception` finds the lost ranks: the launcher's children that died (popen), ranks
    whose heartbeat stopped, or rank 0 when its store no longer answers (Lightning's launchers
    start the store in rank 0). With more than 2 ranks, a rank that stopped because of the first
    loss may be named too. A rank whose own link is down (its ``GLOO_SOCKET_IFNAME`` interface not
    up) says so instead of blaming the others.

    The store is asked through a fresh connection in a thread given at most ``2.5 * period + 2 *
    probe_timeout`` seconds: once a link is cut, a TCP store client waits forever in ``recv`` (it
    has no timeout after connecting and a cut link sends no reset), and the heartbeat thread's
    connection holds the client's lock while it waits, which hung the rank that was cut off."""

    PREFIX = "recipe_rank_watch/"
    probe_timeout = 5.0  # seconds the diagnosis may spend connecting to the store

    def __init__(self, period: float = 1.0) -> None:
        self.period = period
        self.lost: dict[int, str] = {}
        self._store = None
        self._store_answered = False  # the diagnosis reached the store
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.rank, self.world = 0, 1

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        import torch.distributed as dist

        if stage != "fit" or trainer.world_size < 2 or not dist.is_initialized():
            return
        self.rank, self.world = trainer.global_rank, trainer.world_size
        self._address = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        try:
            self._store = self._connect()
            self._store.set(f"{self.PREFIX}info{self.rank}", json.dumps({"host": socket.gethostname(),
                                                                         "pid": os.getpid()}))
        except Exception as exc:  # noqa: BLE001  no TCP store to watch through: report less, never fail the run
            log.warning("rank %d: no heartbeat (store %s: %s)", self.rank, self._address, exc)
            self._store = None
            return
        log.info("rank %d of %d: pid %d on %s", self.rank, self.world, os.getpid(), socket.gethostname())
        self._thread = threading.Thread(target=self._beat, name="rank-heartbeat", daemon=True)
        self._thread.start()

    def _connect(self, timeout: float = 10.0):
        import torch.distributed as dist

        return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                             timeout=timedelta(seconds=timeout), wait_for_workers=False)

    def _beat(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self._store.add(f"{self.PREFIX}beat{self.rank}", 1)
            except Exception:  # noqa: BLE001  (the store is gone)
                return  # the store is gone (rank 0 lost or finished): nothing left to beat into

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._stop.set()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if self._store is None or isinstance(exception, KeyboardInterrupt):
            return
        self.lost = self.diagnose(trainer)
        if self.rank != 0 and self._store_answered:  # tell rank 0 this rank is done with its store
            self._bounded(lambda: self._connect(self.probe_timeout).set(f"{self.PREFIX}diagnosed{self.rank}", "1"),
                          self.probe_timeout + 1)

    @staticmethod
    def _bounded(fn, seconds: float) -> None:
        """``fn()`` in a daemon thread, given at most ``seconds`` (a store client can hang)."""
        def run() -> None:
            with contextlib.suppress(Exception):
                fn()

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(seconds)

    def wait_for_diagnoses(self) -> None:
        """Rank 0 holds the store: before it exits, the ranks still running get the time to find the
        lost ones through it (at most one diagnosis's time); without it a rank still probing found
        the store gone and blamed rank 0 instead of the rank that was cut off."""
        if self.rank != 0 or self._store is None or not self.lost:
            return
        waiting = [r for r in range(1, self.world) if r not in self.lost]
        deadline = time.monotonic() + 2.5 * self.period + 2 * self.probe_timeout

        def poll() -> None:
            store = self._connect(self.probe_timeout)
            while waiting and time.monotonic() < deadline:
                waiting[:] = [r for r in waiting if not store.check([f"{self.PREFIX}diagnosed{r}"])]
                time.sleep(0.1)

        self._bounded(poll, deadline - time.monotonic() + 1)

    def _store_refuses(self) -> str | None:
        """What the store's host answered when it refused a connection (nothing listens there: the process that
        held the store has ended), at once, where a store client retries until its timeout; None when a
        connection was made, or the host did not answer in time (the probe through the store decides then)."""
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        try:
            with socket.create_connection((host, int(port)), timeout=self.probe_timeout):
                return None
        except ConnectionRefusedError as exc:
            return f"connection refused ({exc.strerror or exc})"
        except (OSError, TypeError, ValueError):
            return None

    def _who(self, store, rank: int) -> str:
        try:
            info = json.loads(store.get(f"{self.PREFIX}info{rank}"))
            return f"pid {info['pid']} on {info['host']}"
        except Exception:  # noqa: BLE001  (no info: say so)
            return "pid unknown"

    def _silent(self, others: list[int]) -> dict[int, str]:
        """The ranks among ``others`` whose heartbeat stood still for 2.5 periods, with their pid and
        host, asked through a connection of its own (the heartbeat's may be stuck)."""
        store = self._connect(self.probe_timeout)
        before = {r: store.add(f"{self.PREFIX}beat{r}", 0) for r in others}
        time.sleep(2.5 * self.period)
        after = {r: store.add(f"{self.PREFIX}beat{r}", 0) for r in others}
        return {r: self._who(store, r) for r in others if after[r] == before[r]}

    def diagnose(self, trainer: Trainer) -> dict[int, str]:
        lost: dict[int, str] = {}
        procs = getattr(trainer.strategy.launcher, "procs", None) or []
        first = trainer.strategy.node_rank * trainer.num_devices
        deadline = time.monotonic() + 1.0  # a killed child's sockets close before it can be waited for
        while procs and not lost and time.monotonic() < deadline:
            for i, proc in enumerate(procs):  # the popen launcher's children: local ranks 1..
                code = proc.poll()
                if code not in (None, 0):
                    lost[first + i + 1] = f"pid {proc.pid}: {_describe_exit(code)}"
            time.sleep(0.05)
        if lost:
            return lost
        others = [r for r in range(self.world) if r != self.rank]
        link = _link_down()
        if link:  # this rank is the one cut off: every other rank is out of reach
            return {r: f"unreachable: {link}, so this rank is cut off from the others" for r in others}
        refused = self._store_refuses() if self.rank != 0 else None
        if refused:  # nothing listens where rank 0's store was: rank 0 is gone, no need to wait for a probe
            return {0: f"it held the rendezvous store at {self._address}, which no longer answers: {refused}"}
        answer: dict[str, Any] = {}

        def probe() -> None:
            try:
                answer["silent"] = self._silent(others)
            except Exception as exc:  # noqa: BLE001  (any store failure means it is gone)
                answer["error"] = exc

        limit = 2.5 * self.period + 2 * self.probe_timeout
        thread = threading.Thread(target=probe, name="rank-probe", daemon=True)
        thread.start()
        thread.join(limit)
        self._store_answered = "silent" in answer
        if "silent" in answer:
            for r, who in answer["silent"].items():
                lost[r] = f"{who}: not responding, no heartbeat for {2.5 * self.period:.1f} s (hung, stopped or cut off)"
            return lost
        why = _first_line(answer["error"]) if "error" in answer else f"no answer within {limit:.1f} s"
        if self.rank != 0:
            lost[0] = f"it held the rendezvous store at {self._address}, which no longer answers: {why}"
        return lost


def _link_down() -> str | None:
    """``this rank's network link veth1 is down`` when an interface named by ``GLOO_SOCKET_IFNAME``
    (the one gloo was told to use) is not up; None when they are up or none is named."""
    for name in filter(None, os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")):
        try:
            state = Path("/sys/class/net", name, "operstate").read_text().strip()
        except OSError:
            return f"this rank's network interface {name} (GLOO_SOCKET_IFNAME) is gone"
        if state not in ("up", "unknown"):  # "unknown": interfaces without carrier state, such as lo
            return f"this rank's network link {name} (GLOO_SOCKET_IFNAME) is {state}"
    return None


_RESUME = {"command": None}  # how to resume this run, for messages printed on failure


PROGRESS_EVERY = 50  # steps between progress-bar refreshes when the output goes to a file or a pipe


def quiet_progress(trainer: Trainer) -> None:
    """Lightning's default progress bar, refreshed every ``PROGRESS_EVERY`` steps, not every step, when
    stderr is not a terminal: run.sh's log held 10 MB of rewritten bars (1,500 baseline steps into a
    file: 8 KB against 282 KB; the wall time the same within the runs' spread). A bar given with
    another refresh rate (``--trainer.callbacks``) is kept as it is."""
    bar = trainer.progress_bar_callback
    if type(bar) is TQDMProgressBar and bar.refresh_rate == 1 and not sys.stderr.isatty():
        trainer.callbacks[trainer.callbacks.index(bar)] = TQDMProgressBar(refresh_rate=PROGRESS_EVERY)


def resume_command(argv: list[str]) -> str:
    """The command line that resumes this run: its arguments, any --ckpt_path replaced by ``last``."""
    args, i = [], 0
    while i < len(argv):
        if argv[i] == "--ckpt_path":
            i += 2
            continue
        if not argv[i].startswith("--ckpt_path="):
            args.append(argv[i])
        i += 1
    script = os.path.relpath(__file__) if not os.path.relpath(__file__).startswith("..") else __file__
    return shlex.join(["python", script, *args, "--ckpt_path", "last"])


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:300]}" if text else type(exc).__name__


def _lost_message(lost: dict[int, str], cause: BaseException | None = None) -> str:
    ranks = ", ".join(f"rank {r} ({why})" for r, why in sorted(lost.items()))
    seen = f" This rank saw {_first_line(cause)}." if cause is not None else ""
    return f"training stopped: lost {ranks}.{seen} To resume from the last checkpoint: {_RESUME['command']}"


_LIGHTNING_OBSERVER: dict = {}


def _broadcast_sigterm_strictly(loop) -> None:
    """Lightning's per-step broadcast of rank 0's SIGTERM flag, minus its ``except Exception``: a
    rank cut off from rank 0 waited out the collective timeout there, went on, and waited it out
    again in its step's own collective (41 s for a 20 s timeout, seen with bmuf_gtc on 4 nodes).
    On gloo with a core per rank it polls the broadcast, as GTC polls its own collectives
    (``gtc_lightning.algorithms.common.finish``)."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    trainer = loop.trainer
    flag = torch.tensor([1 if getattr(trainer, "received_sigterm", False) else 0], device=trainer.strategy.root_device)
    finish(torch.distributed.broadcast(flag, src=0, async_op=True), busy_wait_fits())
    if flag.item() == 1:
        with contextlib.suppress(Exception):  # stopping anyway
            torch.distributed.barrier()  # as Lightning: every rank stops at the same step
        raise SIGTERMException()


def _launch_rank_observer(child_processes: list) -> None:
    """Lightning's popen observer SIGKILLs the launching process within 5 s of a child's death,
    before it can say which rank died; this one lets the main thread report first."""
    try:
        from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
    except ImportError:  # another Lightning version: its own observer (kills the launcher, names no rank)
        return _LIGHTNING_OBSERVER["launch"](child_processes)

    class _RankObserver(_ChildProcessObserver):
        grace = 20.0  # seconds the main thread has to report and exit before everything is killed

        def _terminate_all(self) -> None:
            deadline = time.monotonic() + self.grace
            while time.monotonic() < deadline:
                time.sleep(0.2)  # the main thread exits meanwhile (this thread is a daemon): done
            lost = {i + 1: f"pid {p.pid}: {_describe_exit(p.returncode)}"
                    for i, p in enumerate(self._child_processes) if p.returncode not in (None, 0)}
            print(f"train.py: error: {_lost_message(lost)}", file=sys.stderr, flush=True)
            super()._terminate_all()

    _RankObserver(child_processes=child_processes, main_pid=os.getpid()).start()


def build_cli(argv: list[str] | None) -> AsrCLI:
    """Parse ``argv`` (shortcut included; ``None``: ``sys.argv``, already expanded), prepare data if
    needed, instantiate model, data, trainer."""
    if argv is not None:
        _RESUME["command"] = resume_command(argv)
    return AsrCLI(
        AcousticModel,
        AsrDataModule,
        args=None if argv is None else expand_strategy_shortcut(argv),
        run=False,
        parser_kwargs={"default_config_files": [str(DEFAULT_CONFIG)], "description": __doc__,
                       "formatter_class": argparse.RawDescriptionHelpFormatter},
        trainer_defaults={"callbacks": [RecipeCheckpoint()]},
        save_config_kwargs={"overwrite": True},
    )


def main(argv: list[str] | None = None) -> AsrCLI:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if argv is None:
        # the user's own command line; ranks started by the popen launcher inherit it
        os.environ.setdefault("RECIPE_RESUME_COMMAND", resume_command(sys.argv[1:]))
        _RESUME["command"] = os.environ["RECIPE_RESUME_COMMAND"]
        # Expanded in place: Lightning's popen launcher starts the other ranks with sys.argv.
        sys.argv[1:] = expand_strategy_shortcut(sys.argv[1:])
    cli = build_cli(argv)
    fit(cli)
    return cli


RANK_EXIT_TIMEOUT_S = 120.0


def wait_for_ranks(procs: list, timeout: float = RANK_EXIT_TIMEOUT_S) -> None:
    """Rank 0 of a run started from the command line waits for the ranks it launched (Lightning's popen
    launcher, ``procs``) to exit after a finished fit, so that the command ends with its last rank: a
    shell's ``time`` then counts every rank's CPU (a rank left unwaited is reparented, its CPU lost to
    ``time``), and the next stage of ``run.sh`` never starts beside a rank still tearing down. A rank still
    running after ``timeout`` seconds is named in a warning and left to finish.
    """
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("rank process %s still running %.0f s after training finished; not waiting for it",
                        proc.pid, timeout)
        else:
            if proc.returncode:
                log.warning("rank process %s exited with code %s after training finished", proc.pid, proc.returncode)


def fit(cli: AsrCLI) -> None:
    """``trainer.fit`` from ``--ckpt_path`` (checked first); a lost rank becomes :class:`RankLostError`."""
    run_dir = Path(cli.config.trainer.default_root_dir)
    ckpt_path = resolve_ckpt_path(cli.config.ckpt_path, run_dir)
    if ckpt_path is not None:
        check_checkpoint(ckpt_path, cli.model)
        log.info("resuming from %s", ckpt_path)
        keep_metrics_on_resume(cli.trainer)
    import lightning.pytorch.strategies.launchers.subprocess_script as popen_launcher

    if hasattr(popen_launcher, "_launch_process_observer"):  # Lightning's private hook; keep its own elsewhere
        _LIGHTNING_OBSERVER["launch"] = popen_launcher._launch_process_observer
        popen_launcher._launch_process_observer = _launch_rank_observer
    watch = next((c for c in cli.trainer.callbacks if isinstance(c, RankWatch)), None)
    epoch_loop = cli.trainer.fit_loop.epoch_loop
    if hasattr(epoch_loop, "_broadcast_sigterm_tensor"):  # Lightning's private method (2.6)
        epoch_loop._broadcast_sigterm_tensor = functools.partial(_broadcast_sigterm_strictly, epoch_loop)
    try:
        # through a link: the strategies' shards sit beside the file it points to
        real = None if ckpt_path is None else os.path.realpath(ckpt_path)
        cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=real)
        launched = getattr(cli.trainer.strategy.launcher, "procs", None) or []  # (fork launchers join their own)
        wait_for_ranks([proc for proc in launched if isinstance(proc, subprocess.Popen)])
    except Exception as exc:
        if watch is not None and watch.lost:
            watch.wait_for_diagnoses()
            for proc in getattr(cli.trainer.strategy.launcher, "procs", None) or []:
                if proc.poll() is None:
                    proc.kill()  # the others would wait for the lost rank until their timeout
            for logger in cli.trainer.loggers:  # the rows logged so far (the process ends without teardown)
                try:
                    logger.save()
                except Exception as save_exc:  # noqa: BLE001 - the loss is what must be reported
                    log.warning("could not flush the %s logger: %s", type(logger).__name__, save_exc)
            raise RankLostError(_lost_message(watch.lost, exc)) from exc
        if cli.trainer.world_size > 1 or any(checkpoint_dir(run_dir).glob("*.ckpt")):
            log.error("training failed (%s: %s); to resume from the last checkpoint: %s", type(exc).__name__,
                      exc, _RESUME["command"])
        raise


if __name__ == "__main__":
    try:
        main()
    except RecipeError as exc:
        print(f"train.py: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except RankLostError as exc:
        print(f"train.py: error: {exc}", file=sys.stderr)
        # Without interpreter teardown: the broken process group's threads can abort it there
        # ("terminate called without an active exception", exit -6 instead of 1: seen on one rank
        # of 16 in the link-down runs of gtc_lightning.tools.faults). Checkpoints are already on disk.
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(1)
