"""Compare strategies on your own model: DDP, a bf16 all-reduce and GTC (or any registered strategy)
trained on the same seeds and ranks, held-out loss, bytes and step time side by side.

    python -m gtc_lightning.tools.compare --model my_pkg.MyModel --data my_pkg.MyData --max-steps 200
    python -m gtc_lightning.tools.compare --config cfg.yaml --strategies ddp gtc --seeds 0 1 2
    python -m gtc_lightning.tools.compare --model my_pkg.MyModel --model.init_args.hidden 256 ...

The model and data are given as LightningCLI takes them: a class path, ``--model.init_args.NAME``,
or a YAML file (``--config``) with ``model:`` and ``data:`` sections (and this command's options:
``strategies:``, ``max_steps:``, ...; ``trainer:`` holds extra Trainer arguments). Every run is a
``Trainer.fit`` on ``--devices`` ranks started by fork (CPU ranks over gloo, one thread each, or the
GPUs present with ``--accelerator gpu``), from the same seed (``seed_everything`` before the model is built: the same
initial parameters for every strategy). Per run:

- held-out loss: the ``--monitor`` metric the model logs in ``validation_step``, as each rank's
  ``trainer.callback_metrics`` holds it after the last validation, averaged over the ranks (the
  same number on every rank when the model logs it with ``sync_dist=True``). With ``--max-steps``
  validation runs ``--evals`` times, the last at the last step;
- bytes each rank sends for the model per optimizer step (gradients; the averaging family sends
  parameters): DDP and ``ddp_bf16`` by the ring all-reduce's formula over the trainable parameters
  (:func:`gtc_lightning.algorithms.common.allreduce_bytes`), GTC from its ``gtc_stats``, the
  averaging family from its ``sync_stats``, PowerSGD by counting its hook's all-reduces; any other
  strategy: "not measured";
- the median wall time of an optimizer step on rank 0.

Writes ``results.json`` (every run, with its curve), ``results.md`` (the table) and
``loss_vs_bytes.png`` (if matplotlib is installed) into ``--out``. Needs jsonargparse
(``pip install "jsonargparse[signatures]"``).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
import os
import re
import statistics
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy, Strategy, StrategyRegistry
from lightning.pytorch.utilities.model_helpers import is_overridden

import gtc_lightning  # noqa: F401  (fills StrategyRegistry with the family's names)
from gtc_lightning import BF16AllReduceStrategy, PowerSGDStrategy, parameter_checksums
from gtc_lightning.algorithms.common import allreduce_bytes
from gtc_lightning.tools.model_suite import (
    STATS,
    count_hook_allreduces,
    quiet_lightning,
    registered_hook,
    restore_environment,
    stats_bytes_sent,
)

DEFAULT_STRATEGIES = ["ddp", "ddp_bf16", "gtc"]
DEFAULT_STEPS = 100  # when neither --max-steps nor --max-epochs is given
TIMEOUT = timedelta(minutes=10)  # a hung collective fails the run instead of blocking for 30 min
# Trainer arguments this command sets itself (each through its own option, or fixed for the comparison)
OWN_TRAINER_ARGS = {
    "accelerator": "--accelerator", "devices": "--devices", "strategy": "--strategies", "max_steps": "--max-steps",
    "max_epochs": "--max-epochs", "val_check_interval": "--evals", "check_val_every_n_epoch": "--evals",
    "num_nodes": "(one node)", "callbacks": "(its probe)", "logger": "(none)", "default_root_dir": "--out",
    "num_sanity_val_steps": "(none)",
}
CLASS_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")


# ---- arguments and what they name --------------------------------------------------------------


def build_parser():
    """The jsonargparse parser: the model and data as LightningCLI takes them, and the comparison's options."""
    try:
        from jsonargparse import ActionConfigFile, ArgumentParser, DefaultHelpFormatter
    except ImportError as error:
        raise SystemExit(
            f"gtc-compare reads the model and data as LightningCLI does, with jsonargparse ({error}); "
            'install it: pip install "jsonargparse[signatures]"'
        ) from error

    class Formatter(DefaultHelpFormatter, argparse.RawDescriptionHelpFormatter):
        """jsonargparse's help, with the description's lines kept."""

    parser = ArgumentParser(prog="python -m gtc_lightning.tools.compare", description=__doc__, formatter_class=Formatter)
    add = parser.add_argument
    add("--config", action=ActionConfigFile, help="a YAML file with model:, data: and any option below")
    parser.add_subclass_arguments(L.LightningModule, "model", as_group=False, required=True,
                                  help="your LightningModule: a class path, with --model.init_args.NAME VALUE")
    parser.add_subclass_arguments(L.LightningDataModule, "data", as_group=False, required=False,
                                  help="your LightningDataModule (none: the model's own dataloaders)")
    add("--strategies", nargs="+", default=DEFAULT_STRATEGIES, help="registered strategy names to compare")
    add("--seeds", nargs="+", type=int, default=[0], help="one run per strategy and seed")
    add("--accelerator", choices=["cpu", "gpu"], default="cpu", help="cpu: ranks by fork over gloo")
    add("--devices", type=int, default=None, help="ranks (default: 2 on cpu, every GPU present on gpu)")
    add("--max-steps", type=int, default=None, help=f"optimizer steps per run (default {DEFAULT_STEPS} "
        "unless --max-epochs is given)")
    add("--max-epochs", type=int, default=None, help="epochs per run (validation after each epoch)")
    add("--evals", type=int, default=5, help="validations per run with --max-steps, the last at the last step")
    add("--monitor", default="val_loss", help="the held-out metric the model logs in validation_step")
    add("--trainer", type=dict, default={}, help="more Trainer arguments, e.g. {precision: bf16-mixed}")
    add("--out", type=Path, default=Path("gtc_compare"), help="where results.json/.md and the plot go")
    return parser


def instantiate(parser, cfg):
    """The config with the model and data built (jsonargparse >= 4.49 calls it ``instantiate``)."""
    return (parser.instantiate if hasattr(parser, "instantiate") else parser.instantiate_classes)(cfg)


def given_class_paths(argv: list[str]) -> list[tuple[str, str]]:
    """The ``(section, class path)`` pairs named on the command line or in ``--config`` files."""
    import yaml

    found = []
    args = list(argv)
    for i, arg in enumerate(args):
        key, _, inline = arg.partition("=")
        value = inline if inline else (args[i + 1] if i + 1 < len(args) else "")
        if key in ("--model", "--data") and CLASS_PATH.match(value) and not Path(value).is_file():
            found.append((key[2:], value))
        elif key == "--config" and Path(value).is_file():
            doc = yaml.safe_load(Path(value).read_text()) or {}
            for section in ("model", "data"):
                entry = doc.get(section) if isinstance(doc, dict) else None
                path = entry.get("class_path") if isinstance(entry, dict) else entry
                if isinstance(path, str) and CLASS_PATH.match(path):
                    found.append((section, path))
    return found


def check_class_path(section: str, path: str) -> None:
    """Raise ``ValueError`` unless ``path`` imports and names a LightningModule (``model``) or a
    LightningDataModule (``data``) subclass."""
    base = L.LightningModule if section == "model" else L.LightningDataModule
    module_name, _, name = path.rpartition(".")
    try:
        found = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as error:
        raise ValueError(
            f"--{section} {path}: does not import ({type(error).__name__}: {error}); give the class as "
            f"package.module.ClassName, importable from the current directory or an installed package"
        ) from error
    if not (isinstance(found, type) and issubclass(found, base)):
        raise ValueError(  # noqa: TRY004  (a bad value given on the command line, as the other checks)
            f"--{section} {path}: is {found!r}, not a subclass of {base.__module__}.{base.__name__}; "
            f"give your {base.__name__} subclass's class path"
        )


def make_strategy(name: str) -> Strategy:
    """The registered strategy ``name``, with ranks started by fork (whatever its registered start method)."""
    if name not in StrategyRegistry:
        raise ValueError(
            f"--strategies: {name!r} is not a registered strategy; registered: "
            f"{', '.join(StrategyRegistry.available_strategies())}"
        )
    entry = StrategyRegistry[name]
    cls = entry["strategy"]
    if not issubclass(cls, DDPStrategy):
        raise ValueError(  # noqa: TRY004  (a bad value given on the command line, as the other checks)
            f"--strategies: {name!r} is {cls.__name__}, not of the DDP family; the comparison starts ranks by fork, "
            f"which only DDPStrategy and its subclasses (ddp, ddp_bf16, gtc, ma, bmuf, dpsgd, ...) can"
        )
    return cls(**{**entry["init_params"], "start_method": "fork", "timeout": TIMEOUT})


def validation_schedule(max_steps: int, evals: int) -> int:
    """Steps between validations: a divisor of ``max_steps`` near ``max_steps / evals``, so that the
    last validation falls on the last step; one at the end where no divisor gives few enough."""
    wanted = max(1, max_steps // max(1, evals))
    every = max(d for d in range(1, wanted + 1) if max_steps % d == 0)
    return every if max_steps // every <= 4 * max(1, evals) else max_steps


# ---- what each rank measures ----------------------------------------------------------------


def bytes_source(strategy: Strategy) -> str | None:
    """How this strategy's bytes are known, or ``None`` (not measured)."""
    stats = [name for name in STATS if hasattr(type(strategy), name)]
    if stats:
        return "+".join(stats)
    if isinstance(strategy, PowerSGDStrategy):
        return "hook all-reduces"
    if type(strategy) is BF16AllReduceStrategy:
        return "ring formula (bf16)"
    if type(strategy) is DDPStrategy and strategy._ddp_comm_hook is None:
        return "ring formula"
    return None


class CompareProbe(L.Callback):
    """Runs in every rank: the monitored metric after each validation, bytes sent, step times, a
    parameter checksum; writes ``rank{r}.json`` into ``out_dir`` at the end of fit.

    Args:
        out_dir: where the ranks write their records.
        monitor: the metric the model logs in validation.
    """

    def __init__(self, out_dir: Path, monitor: str) -> None:
        self.out_dir = Path(out_dir)
        self.monitor = monitor
        self.curve: list[tuple[int, float, float | None]] = []  # (step, metric, bytes sent so far)
        self.logged: list[str] = []  # what validation logged, for the error when the metric is missing
        self.step_seconds: list[float] = []
        self._source: str | None = None
        self._counting = None
        self._counter = [0]
        self._pending = 0.0
        self._last_step = 0

    def setup(self, trainer, pl_module, stage):
        self._source = bytes_source(trainer.strategy)
        if isinstance(trainer.strategy, PowerSGDStrategy):
            self._counting = count_hook_allreduces()
            self._counter = self._counting.__enter__()

    def teardown(self, trainer, pl_module, stage):
        if self._counting is not None:
            self._counting.__exit__(None, None, None)
            self._counting = None

    def bytes_sent(self, trainer, pl_module) -> float | None:
        """Bytes this rank has put on the wire for the model since the start of fit, or ``None``."""
        strategy, world = trainer.strategy, trainer.world_size
        if self._source is None:
            return None
        if self._source == "hook all-reduces":
            return float(self._counter[0])
        if self._source.startswith("ring formula"):
            trainable = [p for p in pl_module.parameters() if p.requires_grad]
            if self._source == "ring formula (bf16)":
                per_step = allreduce_bytes(sum(p.numel() for p in trainable), world, 2)
            else:  # the gradient in the parameters' own dtype
                per_step = allreduce_bytes(sum(p.numel() * p.element_size() for p in trainable), world, 1)
            return float(trainer.global_step * per_step)
        return stats_bytes_sent(strategy)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        self._started = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        self._pending += time.perf_counter() - self._started
        if trainer.global_step != self._last_step:  # an optimizer step ended (not an accumulation batch)
            self.step_seconds.append(self._pending)
            self._pending, self._last_step = 0.0, trainer.global_step

    def on_validation_end(self, trainer, pl_module):
        if trainer.sanity_checking:
            return
        self.logged = sorted(trainer.callback_metrics)
        value = trainer.callback_metrics.get(self.monitor)
        if value is not None:
            self.curve.append((trainer.global_step, float(value), self.bytes_sent(trainer, pl_module)))

    def on_train_end(self, trainer, pl_module):
        record = {
            "rank": trainer.global_rank,
            "steps": trainer.global_step,
            "numel": sum(p.numel() for p in pl_module.parameters() if p.requires_grad),
            "bytes_sent": self.bytes_sent(trainer, pl_module),
            "bytes_source": self._source,
            "step_seconds": self.step_seconds,
            "curve": self.curve,
            "logged": self.logged,
            "checksum": parameter_checksums(pl_module.parameters()).tolist(),
            "comm_hook": registered_hook(trainer.strategy),
        }
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


# ---- one run in the parent ---------------------------------------------------------------------


class MonitorMissingError(ValueError):
    """The model's validation logged no ``--monitor`` metric: no run can be scored."""


def run_one(parser, cfg, name: str, seed: int, world: int, out: Path) -> dict:
    """Train the configured model with strategy ``name`` from ``seed`` on ``world`` forked ranks.

    Returns:
        strategy, seed, world_size, steps, numel, initial_checksum (the parameters as built, before
        fit), heldout_loss and heldout_step (the last validation), curve ``[(step, loss, bytes)]``
        (mean over ranks), bytes_per_step (mean over ranks; ``None``: not measured), bytes_source,
        allreduce_fp32_bytes_per_step, ratio_fp32, step_seconds (median, rank 0), replicas_identical,
        comm_hook, wall_s.
    """
    run_dir = out / "runs" / f"{name}-s{seed}"
    run_dir.mkdir(parents=True, exist_ok=True)
    for old in run_dir.glob("rank*.json"):
        old.unlink()
    with restore_environment("MASTER_PORT", "PL_GLOBAL_SEED"):
        L.seed_everything(seed, verbose=False)  # the same initial parameters and data for every strategy
        built = instantiate(parser, cfg)
        model, data = built.model, built.get("data")
        initial = parameter_checksums(model.parameters()).tolist()
        steps = cfg.max_steps if cfg.max_steps is not None else (-1 if cfg.max_epochs else DEFAULT_STEPS)
        schedule = (
            {"val_check_interval": validation_schedule(steps, cfg.evals), "check_val_every_n_epoch": None}
            if steps > 0 else {}
        )
        trainer = L.Trainer(
            accelerator=cfg.accelerator, devices=world, strategy=make_strategy(name), max_steps=steps,
            max_epochs=cfg.max_epochs if cfg.max_epochs is not None else -1, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=0, callbacks=[CompareProbe(run_dir, cfg.monitor)], default_root_dir=run_dir,
            **schedule, **cfg.trainer,
        )  # fmt: skip
        start = time.perf_counter()
        trainer.fit(model, datamodule=data)
        wall = time.perf_counter() - start
    ranks = [json.loads((run_dir / f"rank{r}.json").read_text()) for r in range(world)]
    rank0 = ranks[0]
    if not rank0["curve"]:
        raise MonitorMissingError(
            f"--monitor {cfg.monitor}: the model logged no such metric in validation ({name}, seed {seed}); "
            f"it logged {rank0['logged'] or 'nothing'}: pass --monitor with one of those, or log it with "
            f"self.log({cfg.monitor!r}, loss) in validation_step"
        )
    steps, numel = rank0["steps"], rank0["numel"]
    curve = [
        (point[0][0], statistics.fmean(p[1] for p in point),
         None if point[0][2] is None else statistics.fmean(p[2] for p in point))
        for point in zip(*[r["curve"] for r in ranks])
    ]  # fmt: skip
    measured = rank0["bytes_source"] is not None and steps > 0
    per_step = statistics.fmean(r["bytes_sent"] for r in ranks) / steps if measured else None
    fp32 = allreduce_bytes(numel, world, 4)
    return {
        "strategy": name,
        "seed": seed,
        "world_size": world,
        "accelerator": cfg.accelerator,
        "steps": steps,
        "numel": numel,
        "initial_checksum": initial,
        "monitor": cfg.monitor,
        "heldout_loss": curve[-1][1],
        "heldout_step": curve[-1][0],
        "curve": curve,
        "bytes_per_step": per_step,
        "bytes_source": rank0["bytes_source"] or "not measured",
        "allreduce_fp32_bytes_per_step": fp32,
        "ratio_fp32": None if per_step is None else (fp32 / per_step if per_step else math.inf),
        "step_seconds": statistics.median(rank0["step_seconds"]) if rank0["step_seconds"] else None,
        "replicas_identical": all(r["checksum"] == rank0["checksum"] for r in ranks),
        "comm_hook": rank0["comm_hook"],
        "wall_s": wall,
    }


# ---- the report -----------------------------------------------------------------------------------


def human_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def report_table(results: list[dict]) -> str:
    """One row per strategy (its seeds: mean [min-max]); the first strategy is the reference."""
    done = [r for r in results if "error" not in r]
    if not done:
        return "no run finished\n"
    monitor, world = done[0]["monitor"], done[0]["world_size"]
    names = list(dict.fromkeys(r["strategy"] for r in results))
    by_name = {n: [r for r in done if r["strategy"] == n] for n in names}
    reference = by_name[names[0]]
    ref_mean = statistics.fmean(r["heldout_loss"] for r in reference) if reference else None
    lines = [
        (
            f"| strategy | held-out {monitor} | vs {names[0]} | at step | bytes/step/rank "
            "| x fewer than fp32 all-reduce | step ms (median) | bytes from |"
        ),
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in names:
        runs = by_name[name]
        if not runs:
            error = next(r["error"] for r in results if r["strategy"] == name)
            lines.append(f"| {name} | FAILED: {error} | | | | | | |")
            continue
        losses = [r["heldout_loss"] for r in runs]
        mean = statistics.fmean(losses)
        loss = f"{mean:.4f}" + (f" [{min(losses):.4f}-{max(losses):.4f}]" if len(runs) > 1 else "")
        vs = f"{100 * (mean - ref_mean) / abs(ref_mean):+.1f} %" if ref_mean else "-"
        sent = [r["bytes_per_step"] for r in runs]
        measured = all(b is not None for b in sent)
        times = [r["step_seconds"] for r in runs if r["step_seconds"] is not None]
        cells = [
            name, loss, vs, str(runs[0]["heldout_step"]),
            human_bytes(statistics.fmean(sent)) if measured else "not measured",
            f"{statistics.fmean(r['ratio_fp32'] for r in runs):.1f}" if measured else "-",
            f"{1000 * statistics.median(times):.1f}" if times else "-",
            runs[0]["bytes_source"],
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    seeds = sorted({r["seed"] for r in done})
    lines += [
        "",
        (
            f"{world} {done[0]['accelerator']} ranks, seeds {seeds}, {done[0]['numel']:,} trainable parameters. "
            f"Held-out {monitor}: the last validation's value, mean over ranks (and seeds). Bytes: what the "
            f"strategy sends for the model (gradients; the averaging family: parameters) per rank and optimizer "
            f"step (a fp32 ring all-reduce of the gradient: "
            f"{human_bytes(done[0]['allreduce_fp32_bytes_per_step'])}). Step time: rank 0's, for information."
        ),
    ]
    if any(not r["replicas_identical"] for r in done):
        lines.append("Replicas not bit-identical at the end: " + ", ".join(
            f"{r['strategy']} seed {r['seed']}" for r in done if not r["replicas_identical"]))
    return "\n".join(lines) + "\n"


def plot_loss_vs_bytes(results: list[dict], out: Path) -> Path | None:
    """Held-out loss against bytes sent per rank (log x), one curve per run; ``None`` where no run has
    its bytes measured. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    colors: dict[str, str] = {}
    for r in results:
        points = [(b, loss) for _, loss, b in r.get("curve", []) if b]  # bytes 0 has no place on a log axis
        if r.get("bytes_per_step") is None or not points:
            continue
        label = None if r["strategy"] in colors else r["strategy"]
        line = ax.plot(*zip(*points), marker="o", ms=3, lw=1, color=colors.get(r["strategy"]), label=label)[0]
        colors.setdefault(r["strategy"], line.get_color())
    if not colors:
        plt.close(fig)
        return None
    done = [r for r in results if "error" not in r]
    ax.set_xscale("log")
    ax.set_xlabel(f"bytes sent per rank ({done[0]['world_size']} ranks)")
    ax.set_ylabel(f"held-out {done[0]['monitor']}")
    ax.set_title("held-out loss against bytes sent")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "loss_vs_bytes.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---- the command ----------------------------------------------------------------------------------


def check_config(cfg) -> int:
    """Raise ``ValueError`` for a comparison that cannot run; return the number of ranks."""
    if cfg.devices is None:
        if cfg.accelerator == "gpu":
            from lightning.fabric.accelerators.cuda import num_cuda_devices  # does not initialise CUDA (fork)

            world = num_cuda_devices()
        else:
            world = 2
    else:
        world = cfg.devices
    if world < 2:
        where = "GPUs present" if cfg.devices is None else "--devices"
        raise ValueError(
            f"{world} rank(s) ({where}): a comparison of communication needs at least 2 ranks; "
            f"pass --devices 2 or more" + (" (or --accelerator cpu for CPU ranks)" if cfg.accelerator == "gpu" else "")
        )
    for name in cfg.strategies:
        make_strategy(name)
    if cfg.max_steps is not None and cfg.max_steps < 1:
        raise ValueError(f"--max-steps {cfg.max_steps}: give at least 1 optimizer step")
    if cfg.max_epochs is not None and cfg.max_epochs < 1:
        raise ValueError(f"--max-epochs {cfg.max_epochs}: give at least 1 epoch")
    own = sorted(set(cfg.trainer) & set(OWN_TRAINER_ARGS))
    if own:
        raise ValueError(f"--trainer {own}: set by this command; use {[OWN_TRAINER_ARGS[k] for k in own]} instead")
    return world


def check_validation(model: L.LightningModule, data: L.LightningDataModule | None) -> None:
    """Raise ``ValueError`` unless the model validates and something gives validation batches."""
    if not is_overridden("validation_step", model, L.LightningModule):
        raise ValueError(
            f"{type(model).__qualname__} has no validation_step: the comparison's held-out loss is what it "
            f"logs there; add one that calls self.log('val_loss', loss) (and a val_dataloader)"
        )
    if not (is_overridden("val_dataloader", model, L.LightningModule)
            or (data is not None and is_overridden("val_dataloader", data, L.LightningDataModule))):
        raise ValueError(
            f"neither {type(model).__qualname__} nor the data module has a val_dataloader: give the data "
            f"module one (the held-out set the comparison scores)"
        )


def main(argv: list[str] | None = None) -> list[dict]:
    """Train each strategy on each seed, print one line per run and the table; write the files.

    Returns:
        every run's record (a failed run: its strategy, seed and ``error``).
    """
    # Forked ranks hang in their first parallel op if the parent ran a multi-threaded OpenMP op.
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    if not any(a in ("-h", "--help") or a.endswith(".help") for a in argv):
        for section, path in given_class_paths(argv):
            check_class_path(section, path)
    cfg = parser.parse_args(argv)
    world = check_config(cfg)
    built = instantiate(parser, cfg)  # the classes' own checks, before any run
    check_validation(built.model, built.get("data"))
    out = cfg.out
    out.mkdir(parents=True, exist_ok=True)
    runs = [(name, seed) for seed in cfg.seeds for name in cfg.strategies]
    print(f"compare: {type(built.model).__name__}, {len(runs)} runs ({cfg.strategies} x seeds {cfg.seeds}) "
          f"on {world} {cfg.accelerator} ranks -> {out}", flush=True)
    results: list[dict] = []
    with quiet_lightning(), warnings.catch_warnings():
        # Lightning's advice on loader workers and its own deprecations, once per run and rank: noise here
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        warnings.filterwarnings("ignore", ".*treespec.*")
        for i, (name, seed) in enumerate(runs, 1):
            try:
                record = run_one(parser, cfg, name, seed, world, out)
            except MonitorMissingError:
                raise  # the model's set-up, not the strategy's: every run would fail alike
            except Exception as error:  # noqa: BLE001  (one failed strategy must not lose the others)
                last = str(error).strip().splitlines()[-1:] or [""]
                record = {"strategy": name, "seed": seed, "error": f"{type(error).__name__}: {last[0]}"}
            results.append(record)
            (out / "results.json").write_text(json.dumps(results, indent=1))  # partial results survive
            if "error" in record:
                print(f"[{i}/{len(runs)}] {name} seed {seed}: FAILED {record['error']}", flush=True)
            else:
                sent = "not measured" if record["bytes_per_step"] is None else human_bytes(record["bytes_per_step"])
                print(f"[{i}/{len(runs)}] {name} seed {seed}: held-out {record['heldout_loss']:.4f}, "
                      f"{sent}/step, {record['wall_s']:.1f} s", flush=True)
    table = report_table(results)
    (out / "results.md").write_text(table)
    if importlib.util.find_spec("matplotlib") is None:
        plot = "plot skipped: matplotlib is not installed (pip install matplotlib)"
    else:
        plot = plot_loss_vs_bytes(results, out) or "plot skipped: no run with its bytes measured"
    print()
    print(table)
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}; {plot}", flush=True)
    return results


def cli() -> None:
    """The ``gtc-compare`` command: :func:`main` with the current directory importable (as ``python -m``
    has it), its errors as one line, no return value."""
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        main()
    except ValueError as error:
        raise SystemExit(f"gtc-compare: error: {error}") from None


if __name__ == "__main__":
    cli()
