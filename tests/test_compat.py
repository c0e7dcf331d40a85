"""The compatibility matrix: every Lightning feature of ``tests/compat_matrix.py`` under every strategy
of the family, each cell a 2-rank CPU run started by fork (a tiny MLP, 2 epochs of 4 steps).

A cell that works must run, make the loss fall (unless the matrix says why it cannot), and leave the
replicas' parameters bit-identical after every batch (where the strategy promises it); each feature's runner checks what the feature
itself promises (the scheduler's learning rates, the step count after resuming, frozen weights
unchanged, ...). A cell that is refused must fail with the declared error when the matrix says: at
setup (before any batch) or at a given batch. The tables rendered from it (the README's short one, the
docs' whole one) are checked against the matrix.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from _strategy_helpers import (
    BATCH,
    CLASSES,
    FEATURES,
    TIMEOUT,
    TinyMLP,
    dataset,
    keep_master_port,  # noqa: F401  (autouse: the fork launcher sets MASTER_PORT)
)
from compat_matrix import (
    MATRIX,
    REGENERATE,
    SHORT_BEGIN,
    STRATEGIES,
    default_targets,
    marked_table,
    stale_blocks,
)
from lightning.pytorch.callbacks import EMAWeightAveraging, ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.plugins import MixedPrecision
from torch.utils.data import DataLoader

import gtc_lightning  # noqa: F401  (registers the gtc names)

STEPS = 8  # 2 epochs x 4 batches of 8 per rank


# ---- recording and running ---------------------------------------------------------------------


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().float().reshape(-1) for t in tensors]).clone()


class Record(L.Callback):
    """Per batch: global step, parameters, loss, learning rate, loss scale; per epoch the logged
    ``val_loss``; saved to ``out/rank{r}.pt`` at the end. Each batch writes its number (from 1) to
    ``out/batch{r}`` as it starts, so that a failed run tells where it failed."""

    def __init__(self, out: Path) -> None:
        self.out = Path(out)
        self.records: list[dict] = []
        self.val_losses: list[float] = []

    def on_train_start(self, trainer, pl_module):
        self.start = _flat(pl_module.parameters())

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        (self.out / f"batch{trainer.global_rank}").write_text(str(len(self.records) + 1))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.records.append({
            "global_step": trainer.global_step,
            "params": _flat(pl_module.parameters()),
            "loss": float(loss),
            "lr": trainer.optimizers[0].param_groups[0]["lr"],
            "scale": float(scaler.get_scale()) if scaler is not None else None,
        })  # fmt: skip

    def on_train_epoch_end(self, trainer, pl_module):
        if "val_loss" in trainer.callback_metrics:
            self.val_losses.append(float(trainer.callback_metrics["val_loss"]))

    def on_train_end(self, trainer, pl_module):
        out = {"records": self.records, "start": self.start, "val_losses": self.val_losses}
        torch.save(out, self.out / f"rank{trainer.global_rank}.pt")


@dataclass
class Run:
    """A finished fit: the parent's trainer and model (rank 0's weights, sent back by the fork
    launcher) and, rank by rank, what :class:`Record` saved."""

    trainer: L.Trainer
    model: L.LightningModule
    ranks: list[dict]


def strategy_class(name: str) -> type:
    module, _, cls = STRATEGIES[name].class_path.rpartition(".")
    return getattr(importlib.import_module(module), cls)


def build_strategy(name: str, **kwargs):
    """The strategy ``name`` of the matrix with its ``init_args``, started by fork."""
    return strategy_class(name)(start_method="fork", timeout=TIMEOUT, **STRATEGIES[name].init_args, **kwargs)


def load_ranks(out: Path, world: int = 2) -> list[dict]:
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


def fit(
    strategy,
    out: Path,
    model: L.LightningModule | None = None,
    max_epochs: int = 2,
    strategy_kwargs: dict | None = None,
    ckpt_path: str | None = None,
    **trainer_kwargs,
) -> Run:
    """Fit ``model`` (default :class:`TinyMLP`) on 2 CPU ranks; ``strategy`` is a matrix name
    (built by :func:`build_strategy` with ``strategy_kwargs``) or any Trainer ``strategy``."""
    out.mkdir(parents=True, exist_ok=True)
    if isinstance(strategy, str) and strategy in STRATEGIES:
        strategy = build_strategy(strategy, **(strategy_kwargs or {}))
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_epochs=max_epochs, logger=False,
        enable_checkpointing=trainer_kwargs.pop("enable_checkpointing", False), enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=out, log_every_n_steps=1,
        callbacks=[Record(out), *trainer_kwargs.pop("callbacks", [])], **trainer_kwargs,
    )  # fmt: skip
    model = model if model is not None else TinyMLP()
    trainer.fit(model, ckpt_path=ckpt_path)
    return Run(trainer, model, load_ranks(out))


def slices(model: torch.nn.Module) -> dict[str, slice]:
    """Where each parameter lies in :class:`Record`'s flat vectors (``model.parameters()`` order)."""
    where, start = {}, 0
    for name, p in model.named_parameters():
        where[name] = slice(start, start + p.numel())
        start += p.numel()
    return where


# ---- the models --------------------------------------------------------------------------------


class AdamStepLR(TinyMLP):
    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=0.02)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class ManualTwoOptimizers(TinyMLP):
    """Manual optimization with two optimizers, each toggled in turn (Lightning's GAN pattern)."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        for optimizer in self.optimizers():
            self.toggle_optimizer(optimizer)
            loss = self.loss(batch)
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()
            self.untoggle_optimizer(optimizer)
        return loss

    def configure_optimizers(self):
        return (
            torch.optim.SGD(self.net[0].parameters(), lr=self.lr, momentum=self.momentum),
            torch.optim.SGD(self.net[2].parameters(), lr=self.lr, momentum=self.momentum),
        )


class WithUnusedBranch(TinyMLP):
    """A second head that no rank ever uses."""

    def __init__(self):
        super().__init__()
        self.unused = torch.nn.Linear(FEATURES, CLASSES)


class Frozen(TinyMLP):
    def __init__(self):
        super().__init__()
        self.net[0].requires_grad_(False)


class Tied(TinyMLP):
    """16 -> 16 -> 16 -> 4 where both 16 x 16 layers share one weight matrix."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(FEATURES, FEATURES), torch.nn.Tanh(), torch.nn.Linear(FEATURES, FEATURES),
            torch.nn.Tanh(), torch.nn.Linear(FEATURES, CLASSES),
        )  # fmt: skip
        self.net[2].weight = self.net[0].weight

    def on_train_end(self):
        assert self.net[2].weight is self.net[0].weight, "the tie was broken"


class WithBatchNorm(TinyMLP):
    def __init__(self):
        super().__init__()
        self.net.insert(1, torch.nn.BatchNorm1d(self.net[0].out_features))


class Evaluated(TinyMLP):
    """Validation and test loops on the training data, logging ``val_loss`` and ``test_loss``."""

    def val_dataloader(self):
        return self.train_dataloader()

    def test_dataloader(self):
        return self.train_dataloader()

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch), sync_dist=True)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self.loss(batch), sync_dist=True)


class Compiled(TinyMLP):
    def configure_model(self):
        # In place (nn.Module.compile), so that the state dict keeps its keys.
        self.net.compile(backend="eager")

    def on_train_end(self):
        assert self.net._compiled_call_impl is not None, "configure_model did not run"


class SparseEmbedding(TinyMLP):
    """Each feature's sign picks one of two 8-dim embeddings: ids ``2 * feature + (x > 0)``."""

    def __init__(self):
        super().__init__(lr=2.0, momentum=0.0)
        del self.net
        self.embedding = torch.nn.Embedding(2 * FEATURES, 8, sparse=True)
        torch.nn.init.normal_(self.embedding.weight, std=0.1)
        self.head = torch.nn.Linear(FEATURES * 8, CLASSES)

    def loss(self, batch):
        x, y = batch
        ids = 2 * torch.arange(FEATURES) + (x > 0).long()
        return torch.nn.functional.cross_entropy(self.head(self.embedding(ids).flatten(1)), y)


# ---- one runner per feature: runs the cell, checks what the feature promises, returns the Run ----

Runner = Callable[[str, Path, Callable[[str], Run]], Run]
RUNNERS: dict[str, Runner] = {}


def runner(feature: str) -> Callable[[Runner], Runner]:
    def register(fn: Runner) -> Runner:
        RUNNERS[feature] = fn
        return fn

    return register


@runner("sgd")
def run_sgd(strategy, out, reference):
    return reference(strategy)


@runner("adam_steplr")
def run_adam_steplr(strategy, out, reference):
    run = fit(strategy, out, AdamStepLR())
    for rank in run.ranks:  # recorded after the batch's scheduler step: halved after steps 4 and 8
        assert [rec["lr"] for rec in rank["records"]] == [0.02] * 3 + [0.01] * 4 + [0.005]
    return run


@runner("accumulate_grad_batches")
def run_accumulate(strategy, out, reference):
    run = fit(strategy, out, accumulate_grad_batches=2)
    for rank in run.ranks:
        assert [rec["global_step"] for rec in rank["records"]] == [0, 1, 1, 2, 2, 3, 3, 4]
    return run


@runner("bf16_mixed")
def run_bf16(strategy, out, reference):
    return fit(strategy, out, precision="bf16-mixed")


@runner("fp16_mixed")
def run_fp16(strategy, out, reference):
    # Trainer(precision="16-mixed") on CPU turns into bf16-mixed; the plugin keeps fp16 and its scaler.
    run = fit(strategy, out, plugins=[MixedPrecision("16-mixed", "cpu")])
    for rank in run.ranks:
        assert all(rec["scale"] is not None for rec in rank["records"]), "no GradScaler"
    return run


@runner("manual_two_optimizers")
def run_manual(strategy, out, reference):
    run = fit(strategy, out, ManualTwoOptimizers(), strategy_kwargs={"find_unused_parameters": True})
    assert run.ranks[0]["records"][-1]["global_step"] == 2 * STEPS  # both optimizers stepped each batch
    return run


def check_unused_branch_untouched(run: Run) -> Run:
    where = slices(run.model)
    unused = slice(where["unused.weight"].start, where["unused.bias"].stop)
    for rank in run.ranks:
        assert torch.equal(rank["records"][-1]["params"][unused], rank["start"][unused])
    return run


@runner("unused_find_unused")
def run_unused_find_unused(strategy, out, reference):
    run = fit(strategy, out, WithUnusedBranch(), strategy_kwargs={"find_unused_parameters": True})
    return check_unused_branch_untouched(run)


@runner("unused_by_name")
def run_unused_by_name(strategy, out, reference):
    run = fit(f"{STRATEGIES[strategy].fork_name}_find_unused_parameters_true", out, WithUnusedBranch())
    assert type(run.trainer.strategy) is strategy_class(strategy)
    return check_unused_branch_untouched(run)


@runner("unused_without_flag")
def run_unused_without_flag(strategy, out, reference):
    return fit(strategy, out, WithUnusedBranch())


@runner("frozen_layers")
def run_frozen(strategy, out, reference):
    run = fit(strategy, out, Frozen())
    where = slices(run.model)
    frozen = slice(where["net.0.weight"].start, where["net.0.bias"].stop)
    for rank in run.ranks:
        last = rank["records"][-1]["params"]
        assert torch.equal(last[frozen], rank["start"][frozen])
        assert not torch.equal(last[frozen.stop :], rank["start"][frozen.stop :])
    return run


@runner("tied_weights")
def run_tied(strategy, out, reference):
    run = fit(strategy, out, Tied())
    # The shared matrix is one parameter (Tied.on_train_end checked the tie on every rank).
    assert run.ranks[0]["start"].numel() == sum(p.numel() for p in run.model.parameters())
    return run


@runner("batchnorm")
def run_batchnorm(strategy, out, reference):
    run = fit(strategy, out, WithBatchNorm())
    assert int(run.model.net[1].num_batches_tracked) == STEPS  # rank 0's buffers, sent back
    return run


@runner("static_graph")
def run_static_graph(strategy, out, reference):
    return fit(strategy, out, strategy_kwargs={"static_graph": True})


@runner("checkpoint_resume")
def run_checkpoint_resume(strategy, out, reference):
    """The first epoch with a checkpoint every 2 steps; a new Trainer resumes from step 4 and must
    continue with steps 5-8 exactly as the uninterrupted reference run did (a strategy that is not
    reproducible: start every rank from its shard of the checkpoint, bit for bit)."""
    every_2 = ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=2, save_top_k=-1)
    first = fit(strategy, out / "first", max_epochs=1, enable_checkpointing=True, callbacks=[every_2])
    saved = sorted(p.name for p in (out / "ckpt").glob("*.ckpt"))
    assert saved == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"], saved
    resumed = fit(strategy, out / "resumed", ckpt_path=str(out / "ckpt" / "epoch=0-step=4.ckpt"))
    if not STRATEGIES[strategy].reproducible:  # no run repeats another: each rank resumes from its shard
        shards = out / "ckpt" / f"epoch=0-step=4.ckpt.{type(resumed.trainer.strategy).name}"
        for rank, a in enumerate(resumed.ranks):
            assert [rec["global_step"] for rec in a["records"]] == [5, 6, 7, 8]
            shard = torch.load(shards / f"rank{rank}.pt", weights_only=False)["state_dict"]
            assert torch.equal(a["start"], _flat(shard.values())), f"rank {rank} did not resume from its shard"
        ranks = [{**a, "records": a["records"] + b["records"]} for a, b in zip(first.ranks, resumed.ranks)]
        return Run(resumed.trainer, resumed.model, ranks)
    full = reference(strategy)
    for rank, (a, b) in enumerate(zip(resumed.ranks, full.ranks)):
        assert [rec["global_step"] for rec in a["records"]] == [5, 6, 7, 8]
        for t, (x, y) in enumerate(zip(a["records"], b["records"][4:]), start=5):
            assert torch.equal(x["params"], y["params"]), (
                f"rank {rank}: step {t} differs from the uninterrupted run"
            )
    ranks = [{**a, "records": a["records"] + b["records"]} for a, b in zip(first.ranks, resumed.ranks)]
    return Run(resumed.trainer, resumed.model, ranks)


@runner("validate_test_after_fit")
def run_validate_test(strategy, out, reference):
    model = Evaluated()
    x, y = dataset().tensors
    with torch.no_grad():
        before = float(model.loss((x, y)))
    run = fit(strategy, out, model, check_val_every_n_epoch=STEPS)  # no validation inside fit
    (val,) = run.trainer.validate(model, verbose=False)
    (test,) = run.trainer.test(model, verbose=False)
    assert val["val_loss"] < before and test["test_loss"] < before, (before, val, test)
    return run


@runner("validation_in_fit")
def run_validation_in_fit(strategy, out, reference):
    run = fit(strategy, out, Evaluated(), num_sanity_val_steps=0)
    for rank in run.ranks:
        first, last = rank["val_losses"]
        assert last < first, rank["val_losses"]
    return run


@runner("ema_weights")
def run_ema_weights(strategy, out, reference):
    run = fit(strategy, out, callbacks=[EMAWeightAveraging(decay=0.5)])
    final = _flat(run.model.parameters())  # rank 0's model after fit
    for rank in run.ranks:
        assert not torch.equal(final, rank["records"][-1]["params"]), "fit did not end with the average model"
    return run


@runner("compiled")
def run_compiled(strategy, out, reference):
    return fit(strategy, out, Compiled())


@runner("clip_norm")
def run_clip_norm(strategy, out, reference):
    run = fit(strategy, out, gradient_clip_val=0.1)
    assert not torch.equal(
        run.ranks[0]["records"][-1]["params"], reference(strategy).ranks[0]["records"][-1]["params"]
    )
    return run


@runner("clip_value")
def run_clip_value(strategy, out, reference):
    run = fit(strategy, out, gradient_clip_val=0.01, gradient_clip_algorithm="value")
    assert not torch.equal(
        run.ranks[0]["records"][-1]["params"], reference(strategy).ranks[0]["records"][-1]["params"]
    )
    return run


@runner("sparse_embedding")
def run_sparse_embedding(strategy, out, reference):
    return fit(strategy, out, SparseEmbedding())


# ---- LightningCLI: a plain one, with the tiny model and this data module -------------------------


class TinyData(L.LightningDataModule):
    def __init__(self, batch_size: int = BATCH) -> None:
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self):
        return DataLoader(dataset(), batch_size=self.batch_size, shuffle=False)


CLI_TRAINER = [
    "--trainer.accelerator=cpu", "--trainer.devices=2", f"--trainer.max_epochs={STEPS // 4}",
    "--trainer.logger=false", "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
]  # fmt: skip


def cli_fit(strategy: str, out: Path, args: list[str]) -> Run:
    out.mkdir(parents=True, exist_ok=True)
    cli = LightningCLI(
        TinyMLP, TinyData, args=["fit", *CLI_TRAINER, f"--trainer.default_root_dir={out}", *args],
        trainer_defaults={"callbacks": [Record(out)]},
    )  # fmt: skip
    assert type(cli.trainer.strategy) is strategy_class(strategy)
    assert cli.trainer.strategy._start_method == "fork"
    return Run(cli.trainer, cli.model, load_ranks(out))


def check_init_args(run: Run, strategy: str) -> Run:
    for key, value in STRATEGIES[strategy].init_args.items():
        assert getattr(run.trainer.strategy, key) == value, key
    return run


@runner("cli_class_path_yaml")
def run_cli_yaml(strategy, out, reference):
    init_args = {**STRATEGIES[strategy].init_args, "start_method": "fork"}
    config = out / "strategy.yaml"
    out.mkdir(parents=True, exist_ok=True)
    strategy_config = {"class_path": STRATEGIES[strategy].class_path, "init_args": init_args}
    config.write_text(yaml.safe_dump({"trainer": {"strategy": strategy_config}}))
    return check_init_args(cli_fit(strategy, out, ["--config", str(config)]), strategy)


@runner("cli_class_path_args")
def run_cli_args(strategy, out, reference):
    init_args = {**STRATEGIES[strategy].init_args, "start_method": "fork"}
    args = [f"--trainer.strategy={STRATEGIES[strategy].class_path}"]
    args += [f"--trainer.strategy.{key}={value}" for key, value in init_args.items()]
    return check_init_args(cli_fit(strategy, out, args), strategy)


@runner("cli_by_name")
def run_cli_by_name(strategy, out, reference):
    return cli_fit(strategy, out, ["--trainer.strategy", STRATEGIES[strategy].fork_name])


# ---- Lightning Fabric: the same 2 epochs of 4 batches in a plain loop ----------------------------


def _fabric_loop(fabric: L.Fabric, out: Path) -> None:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.9))
    loader = fabric.setup_dataloaders(DataLoader(dataset(), batch_size=BATCH, shuffle=False))
    start, records = _flat(model.parameters()), []
    for _ in range(STEPS // len(loader)):
        for x, y in loader:
            (out / f"batch{fabric.global_rank}").write_text(str(len(records) + 1))
            loss = torch.nn.functional.cross_entropy(model(x), y)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            records.append({"params": _flat(model.parameters()), "loss": float(loss)})
    torch.save({"records": records, "start": start, "val_losses": []}, out / f"rank{fabric.global_rank}.pt")


@runner("fabric")
def run_fabric(strategy, out, reference):
    out.mkdir(parents=True, exist_ok=True)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=STRATEGIES[strategy].fork_name)
    fabric.launch(_fabric_loop, out)
    return Run(None, None, load_ranks(out))


# ---- the tests ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Callable[[str], Run]:
    """The plain SGD run of each strategy, made once when a cell first asks for it."""
    runs: dict[str, Run] = {}

    def get(strategy: str) -> Run:
        if strategy not in runs:
            runs[strategy] = fit(strategy, tmp_path_factory.mktemp(f"reference-{strategy}"))
        return runs[strategy]

    return get


def check_loss_falls(ranks: list[dict]) -> None:
    losses = torch.tensor([[rec["loss"] for rec in rank["records"]] for rank in ranks])  # [rank, batch]
    half = losses.shape[1] // 2
    first, last = losses[:, :half].mean(), losses[:, half:].mean()
    assert last < 0.95 * first, f"mean loss went from {first:.3f} (first half) to {last:.3f} (second half)"


def check_identical_replicas(ranks: list[dict]) -> None:
    for r in range(1, len(ranks)):
        assert torch.equal(ranks[r]["start"], ranks[0]["start"]), f"rank {r} started from other parameters"
        for t, (a, b) in enumerate(zip(ranks[0]["records"], ranks[r]["records"]), start=1):
            assert torch.equal(a["params"], b["params"]), (
                f"rank {r}'s parameters differ from rank 0's after batch {t}"
            )


CELLS = [(feature, strategy) for feature in MATRIX for strategy in STRATEGIES]


@pytest.mark.parametrize(("feature", "strategy"), CELLS, ids=[f"{f}-{s}" for f, s in CELLS])
def test_cell(feature, strategy, tmp_path, reference):
    expected = MATRIX[feature][1][strategy]
    if expected.works:
        run = RUNNERS[feature](strategy, tmp_path, reference)
        assert all(len(rank["records"]) >= STEPS for rank in run.ranks)
        if expected.learns and STRATEGIES[strategy].learns_every_run:
            check_loss_falls(run.ranks)
        if STRATEGIES[strategy].identical_replicas:
            check_identical_replicas(run.ranks)
        return
    with pytest.raises(Exception) as failure:
        RUNNERS[feature](strategy, tmp_path, reference)
    message = str(failure.value)
    assert re.search(expected.error, message), (
        f"expected an error matching {expected.error!r}, got:\n{message}"
    )
    reached = max((int(p.read_text()) for p in tmp_path.rglob("batch[0-9]*")), default=0)
    where = f"batch {reached}" if reached else "setup"
    assert where == expected.at, f"the error came at {where}, not at {expected.at}"


def test_matrix_is_complete():
    assert set(RUNNERS) == set(MATRIX), "every row of compat_matrix.MATRIX needs one runner here, and no more"
    for feature, (_, outcomes) in MATRIX.items():
        assert set(outcomes) == set(STRATEGIES), f"{feature}: give an outcome for each of {list(STRATEGIES)}"
        for outcome in outcomes.values():
            assert outcome.works or (outcome.error and outcome.text), (
                f"{feature}: a refusal needs a reason and an error"
            )


def test_readme_table_is_the_rendered_matrix():
    """The README holds the short form; every file with a block (the README, the docs' reference page)
    holds the matrix as rendered now."""
    readme, *_ = default_targets()
    assert marked_table(readme.read_text(), short=True) is not None, f"README.md lacks {SHORT_BEGIN!r}"
    for path in default_targets():
        stale = stale_blocks(path)
        assert not stale, (
            f"{path.name}: the compatibility table ({', '.join(stale)}) differs from tests/compat_matrix.py; "
            f"regenerate it: `{REGENERATE}`"
        )
