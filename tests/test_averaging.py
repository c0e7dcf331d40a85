"""ModelAveragingStrategy (``"ma"``) end to end: 2- and 4-process CPU/gloo runs started by fork.

The ranks record their parameters, local gradients, momentum buffers and statistics per batch; the
tests replay the run independently of the package (each rank's SGD step on its own gradient, the
mean of the ranks' parameters every K steps) and compare bit for bit on 2 ranks.
"""

import csv
import pickle
from pathlib import Path

import lightning as L
import pytest
import torch
from _averaging_helpers import (
    LR,
    check_checkpoints_hold_the_validated_mean,
    fit_recorded,
    local_step,
    mean,
    run_ranks,
)
from _averaging_helpers import Validated as SeenValidated
from _strategy_helpers import (
    TIMEOUT,
    TinyMLP,
    fit,
    keep_master_port,  # noqa: F401  (autouse: the fork launcher sets MASTER_PORT)
)
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins import TorchCheckpointIO
from lightning.pytorch.strategies import DDPStrategy

from gtc_lightning import (
    BMUFGTCStrategy,
    BMUFStrategy,
    DPSGDStrategy,
    ModelAveragingStrategy,
    SparseLoCoStrategy,
)
from gtc_lightning.algorithms.common import allreduce_bytes

K = 3  # syncs after steps 3 and 6 of 8 (2 epochs x 4 batches per rank)
STEPS = 8
NUMEL = sum(p.numel() for p in TinyMLP().parameters())


@pytest.fixture(scope="module")
def ma_run(tmp_path_factory):
    """Plain SGD (no momentum), so that each local step is exactly ``p - lr * g``."""
    out = tmp_path_factory.mktemp("ma")
    logger = CSVLogger(save_dir=out, name="csv")
    return fit_recorded(out, ModelAveragingStrategy, period=K, model_kwargs={"momentum": 0.0},
                        trainer_kwargs={"logger": logger})  # fmt: skip


@pytest.fixture(scope="module")
def momentum_run(tmp_path_factory):
    """SGD with momentum 0.9 (optimizer state that differs between ranks), optimizer_state="keep"."""
    return fit_recorded(tmp_path_factory.mktemp("momentum"), ModelAveragingStrategy, period=K)


def replay(ranks: list[dict], period: int, warmup: int = 0) -> list[list[torch.Tensor]]:
    """Every rank's parameters after every step, recomputed from the recorded local gradients:
    warmup steps apply the ranks' mean gradient, local steps each rank's own, and every
    ``period``-th step after the warmup replaces each rank's parameters by the ranks' mean."""
    params = [rank["start"]["params"] for rank in ranks]
    out = []
    for t in range(1, len(ranks[0]["records"]) + 1):
        grads = [rank["records"][t - 1]["local_grad"] for rank in ranks]
        if t <= warmup:
            params = [local_step(p, mean(grads)) for p in params]
        else:
            params = [local_step(p, g) for p, g in zip(params, grads)]
            if (t - warmup) % period == 0:
                params = [mean(params)] * len(ranks)
        out.append(params)
    return out


def check_replay(ranks: list[dict], period: int, warmup: int = 0, exact: bool = True) -> None:
    for t, expected in enumerate(replay(ranks, period, warmup), start=1):
        for r, rank in enumerate(ranks):
            got = rank["records"][t - 1]["params"]
            if exact:
                assert torch.equal(got, expected[r]), f"rank {r}: parameters differ after step {t}"
            else:
                assert torch.allclose(got, expected[r], atol=1e-6), f"rank {r}, step {t}"


def check_identical_exactly_after_syncs(ranks: list[dict], sync_steps: set[int]) -> None:
    for t in range(1, len(ranks[0]["records"]) + 1):
        first = ranks[0]["records"][t - 1]["params"]
        same = [torch.equal(first, rank["records"][t - 1]["params"]) for rank in ranks[1:]]
        if t in sync_steps:
            assert all(same), f"replicas differ right after the sync of step {t}"
        else:
            assert not any(same), (
                f"replicas identical after the local step {t}: did a rank send its gradient?"
            )


def test_replicas_identical_right_after_a_sync_and_different_between(ma_run):
    _, ranks, syncs = ma_run
    assert len(ranks[0]["records"]) == STEPS
    check_identical_exactly_after_syncs(ranks, {3, 6})
    assert [rec["last"]["mode"] for rec in syncs[0]] == ["local", "local", "sync"] * 2 + ["local"] * 2


def test_synced_parameters_are_the_mean_computed_independently(ma_run):
    """Every step of both ranks, bit for bit: local SGD steps, and at steps 3 and 6 the mean."""
    _, ranks, _ = ma_run
    check_replay(ranks, K)
    losses = torch.tensor([[rec["loss"] for rec in rank["records"]] for rank in ranks])
    assert losses[:, STEPS // 2 :].mean() < 0.9 * losses[:, : STEPS // 2].mean()


def test_four_ranks(tmp_path):
    _, ranks, syncs = fit_recorded(tmp_path, ModelAveragingStrategy, devices=4, max_epochs=1, period=2,
                                   model_kwargs={"momentum": 0.0, "samples": 128})  # fmt: skip
    check_identical_exactly_after_syncs(ranks, {2, 4})
    check_replay(ranks, 2, exact=False)  # a 4-rank all-reduce sums in its own order
    assert syncs[3][1]["last"]["bytes_sent"] == allreduce_bytes(NUMEL, 4) == 2 * 3 * 4 * NUMEL // 4


def test_dense_warmup_then_local_steps(tmp_path):
    """Steps 1-2 average the gradients (identical replicas), the periods count from step 3."""
    _, ranks, syncs = fit_recorded(tmp_path, ModelAveragingStrategy, period=K, warmup_steps=2,
                                   model_kwargs={"momentum": 0.0})  # fmt: skip
    check_replay(ranks, K, warmup=2)
    check_identical_exactly_after_syncs(ranks, {1, 2, 5, 8})
    assert [rec["last"]["mode"] for rec in syncs[0]] == ["warmup"] * 2 + ["local", "local", "sync"] * 2
    assert syncs[0][0]["last"]["bytes_sent"] == allreduce_bytes(NUMEL, 2)


def test_bytes_are_counted_and_logged_on_logging_steps(ma_run):
    """A sync sends (and receives) a ring all-reduce of the parameters, a local step nothing."""
    trainer, _, syncs = ma_run
    dense = allreduce_bytes(NUMEL, 2)
    for rank in syncs:
        for t, rec in enumerate(rank, start=1):
            sent = dense if t % K == 0 else 0
            assert rec["last"]["bytes_sent"] == rec["last"]["bytes_received"] == sent, f"step {t}"
            assert rec["last"]["allreduce_fp32_bytes"] == dense
        total = rank[-1]["total"]
        assert total["syncs"] == 2 and total["bytes_sent"] == 2 * dense
        assert total["ratio_fp32"] == STEPS * dense / (2 * dense) == 4.0
    (metrics,) = Path(trainer.default_root_dir).rglob("metrics.csv")
    rows = [row for row in csv.DictReader(metrics.read_text().splitlines()) if row.get("ma/bytes_sent")]
    assert [float(row["ma/bytes_sent"]) for row in rows] == [0, 0, dense, 0, 0, dense, 0, 0]
    assert float(rows[-1]["ma/syncs"]) == 2 and float(rows[-1]["ma/ratio_fp32"]) == 4.0
    assert {"ma_vs_fp32", "ma_syncs"} <= set(trainer.callback_metrics)  # the progress bar's, rank 0's


def momentum_buffers(syncs, t):
    return [rank[t - 1]["momentum"] for rank in syncs]


def test_optimizer_state_keep(momentum_run):
    """Each rank keeps its momentum across a sync: the buffers differ although the models agree."""
    _, ranks, syncs = momentum_run
    check_identical_exactly_after_syncs(ranks, {3, 6})
    first, second = momentum_buffers(syncs, 3)
    assert not torch.equal(first, second)


def test_optimizer_state_reset(momentum_run, tmp_path):
    _, ranks, syncs = fit_recorded(tmp_path, ModelAveragingStrategy, period=K, optimizer_state="reset")
    for rank in syncs:
        assert [rec["momentum"] is None for rec in rank] == [False, False, True] * 2 + [False] * 2
    # The step after a reset starts a new momentum buffer from the gradient alone.
    for r, rank in enumerate(ranks):
        assert torch.equal(syncs[r][3]["momentum"], rank["records"][3]["local_grad"])
    assert not torch.equal(ranks[0]["records"][-1]["params"], momentum_run[1][0]["records"][-1]["params"])


def test_optimizer_state_average(tmp_path):
    """At a sync the momentum buffers become the ranks' mean of what each rank's SGD made of them."""
    _, ranks, syncs = fit_recorded(tmp_path, ModelAveragingStrategy, period=K, optimizer_state="average")
    check_identical_exactly_after_syncs(ranks, {3, 6})
    for t in (3, 6):
        before = [0.9 * rank[t - 2]["momentum"] + ranks[r]["records"][t - 1]["local_grad"]
                  for r, rank in enumerate(syncs)]  # fmt: skip
        for buffer in momentum_buffers(syncs, t):
            assert torch.allclose(buffer, mean(before), atol=1e-6)
        assert torch.equal(*momentum_buffers(syncs, t))
    assert syncs[0][2]["last"]["bytes_sent"] == 2 * allreduce_bytes(NUMEL, 2) + 8  # + the count header


def test_scale_lr_multiplies_the_learning_rate_by_the_world_size(tmp_path):
    _, ranks, syncs = fit_recorded(tmp_path, ModelAveragingStrategy, period=K, scale_lr=True, max_epochs=1,
                                   model_kwargs={"momentum": 0.0})  # fmt: skip
    for r, rank in enumerate(ranks):
        assert syncs[r][0]["lr"] == 2 * LR
        first = rank["records"][0]
        assert torch.equal(
            first["params"], local_step(rank["start"]["params"], first["local_grad"], lr=2 * LR)
        )


@pytest.fixture(scope="module")
def checkpoint_at_step_4(tmp_path_factory):
    """The first epoch of ``momentum_run`` with a checkpoint at its end, one local step after the
    sync of step 3: the ranks' parameters and momentum differ there."""
    out = tmp_path_factory.mktemp("part1")
    checkpoint = ModelCheckpoint(dirpath=out / "ckpt", save_last=True)
    fit_recorded(out, ModelAveragingStrategy, period=K, max_epochs=1,
                 trainer_kwargs={"enable_checkpointing": True, "callbacks": [checkpoint]})  # fmt: skip
    return out / "ckpt" / "last.ckpt"


def test_resume_is_bit_exact_with_every_ranks_own_state(momentum_run, checkpoint_at_step_4, tmp_path):
    _, full, full_syncs = momentum_run
    saved = torch.load(checkpoint_at_step_4, weights_only=False)
    assert saved["ma"]["world_size"] == 2 and saved["ma"]["step"] == 4 and saved["ma"]["totals"]["syncs"] == 1
    shards = [torch.load(f"{checkpoint_at_step_4}.ma/rank{r}.pt", weights_only=False) for r in range(2)]
    assert not torch.equal(shards[0]["state_dict"]["net.0.weight"], shards[1]["state_dict"]["net.0.weight"])

    _, resumed, syncs = fit_recorded(
        tmp_path, ModelAveragingStrategy, period=K, ckpt_path=str(checkpoint_at_step_4)
    )
    for r in range(2):
        assert torch.equal(resumed[r]["start"]["params"], full[r]["records"][3]["params"])
        assert [rec["global_step"] for rec in resumed[r]["records"]] == [5, 6, 7, 8]
        for t, (a, b) in enumerate(zip(resumed[r]["records"], full[r]["records"][4:]), start=5):
            assert torch.equal(a["params"], b["params"]), (
                f"rank {r}: step {t} differs from the uninterrupted run"
            )
        assert syncs[r][-1]["total"] == full_syncs[r][-1]["total"] | {
            "exchange_s": syncs[r][-1]["total"]["exchange_s"]
        }


def test_missing_shard_is_a_clear_error_and_restore_shards_false_starts_from_rank_0(
    checkpoint_at_step_4, tmp_path
):
    import shutil

    copy = tmp_path / "copy.ckpt"
    shutil.copy(checkpoint_at_step_4, copy)
    (tmp_path / "copy.ckpt.ma").mkdir()
    shutil.copy(f"{checkpoint_at_step_4}.ma/rank0.pt", tmp_path / "copy.ckpt.ma" / "rank0.pt")
    with pytest.raises(
        Exception, match=r"shard of rank 1 is missing: .*copy.ckpt.ma/rank1.pt.*restore_shards=False"
    ):
        fit_recorded(tmp_path / "run", ModelAveragingStrategy, period=K, ckpt_path=str(copy))
    _, ranks, syncs = fit_recorded(tmp_path / "run2", ModelAveragingStrategy, period=K, restore_shards=False,
                                   ckpt_path=str(copy))  # fmt: skip
    assert torch.equal(ranks[0]["start"]["params"], ranks[1]["start"]["params"])
    assert [rec["last"]["mode"] for rec in syncs[0]] == [
        "local",
        "sync",
        "local",
        "local",
    ]  # the count goes on


class RemovalsIO(TorchCheckpointIO):
    """Appends every path it removes to ``removed{global rank}.txt``."""

    def __init__(self, out_dir: Path) -> None:
        super().__init__()
        self.out_dir = Path(out_dir)

    def remove_checkpoint(self, path) -> None:
        super().remove_checkpoint(path)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        with open(self.out_dir / f"removed{rank}.txt", "a") as f:
            f.write(f"{path}\n")


@pytest.fixture(scope="module")
def linked_last(tmp_path_factory) -> Path:
    """The first epoch of ``momentum_run`` with a checkpoint after every step, the newest 2 kept, and
    a ``last-step=<n>.ckpt`` link to the newest, each link removed as the next is made."""
    out = tmp_path_factory.mktemp("linked")
    checkpoint = ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=1, save_top_k=2, monitor="step",
                                 mode="max", save_last="link")  # fmt: skip
    checkpoint.CHECKPOINT_NAME_LAST = "last-{step}"
    trainer_kwargs = {"enable_checkpointing": True, "callbacks": [checkpoint], "plugins": [RemovalsIO(out)]}
    fit_recorded(out, ModelAveragingStrategy, period=K, max_epochs=1, trainer_kwargs=trainer_kwargs)
    return out


def test_each_rank_removes_its_own_shards_and_an_old_link_removes_none(linked_last):
    """Through the strategy's CheckpointIO; on several nodes each rank's shard may be on its own disk."""
    ckpt = linked_last / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "epoch=0-step=3.ckpt", "epoch=0-step=3.ckpt.ma", "epoch=0-step=4.ckpt", "epoch=0-step=4.ckpt.ma",
        "last-step=4.ckpt",
    ]  # fmt: skip
    assert sorted(p.name for p in (ckpt / "epoch=0-step=3.ckpt.ma").iterdir()) == ["rank0.pt", "rank1.pt"]
    for r in range(2):
        removed = [Path(p) for p in (linked_last / f"removed{r}.txt").read_text().split() if ".ma/" in p]
        assert [p.relative_to(ckpt).as_posix() for p in removed] == [
            f"epoch=0-step=1.ckpt.ma/rank{r}.pt", f"epoch=0-step=2.ckpt.ma/rank{r}.pt",
        ], f"rank {r}"  # fmt: skip


def test_resume_through_a_linked_last_checkpoint_finds_the_shards_of_its_target(
    momentum_run, linked_last, tmp_path
):
    _, full, _ = momentum_run
    last = linked_last / "ckpt" / "last-step=4.ckpt"
    assert last.is_symlink() and last.resolve().name == "epoch=0-step=4.ckpt"
    _, resumed, _ = fit_recorded(tmp_path, ModelAveragingStrategy, period=K, ckpt_path=str(last))
    for r in range(2):
        assert torch.equal(resumed[r]["start"]["params"], full[r]["records"][3]["params"])
        assert [rec["global_step"] for rec in resumed[r]["records"]] == [5, 6, 7, 8]
        for t, (a, b) in enumerate(zip(resumed[r]["records"], full[r]["records"][4:]), start=5):
            assert torch.equal(a["params"], b["params"]), f"rank {r}: step {t} differs from the uninterrupted run"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"period": 0}, "period"),
        ({"period": -1}, "period"),
        ({"period": 1.5}, "period"),
        ({"period": True}, "period"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"optimizer_state": "mean"}, "optimizer_state"),
        ({"ddp_comm_hook": lambda state, bucket: None}, "own DDP communication hook"),
        ({"model_averaging_period": 4}, "own DDP communication hook"),
    ],
)
def test_bad_settings_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ModelAveragingStrategy(**kwargs)


@pytest.mark.parametrize(
    ("name", "start_method", "unused"),
    [
        ("ma", "popen", False),
        ("ma_fork", "fork", False),
        ("ma_spawn_find_unused_parameters_true", "spawn", True),
    ],
)
def test_registered_names_resolve(name, start_method, unused):
    trainer = L.Trainer(strategy=name, accelerator="cpu", devices=2, logger=False, enable_progress_bar=False)
    assert type(trainer.strategy) is ModelAveragingStrategy and trainer.strategy._start_method == start_method
    assert trainer.strategy._ddp_kwargs.get("find_unused_parameters", False) is unused
    assert trainer.strategy.period == 10  # Su et al.'s better averaging frequency


# ---- the family's state through Lightning's life cycle -------------------------------------------

LIFECYCLE = {  # DDP itself is the reference: what every strategy of the family must match
    "ddp": (DDPStrategy, {}),
    "ma": (ModelAveragingStrategy, {"period": K}),
    "bmuf": (BMUFStrategy, {"period": K}),
    "dpsgd": (DPSGDStrategy, {}),
    "bmuf_gtc": (BMUFGTCStrategy, {"group_size": 1, "period": K, "tau": 0.01}),
}


class Validated(TinyMLP):
    def val_dataloader(self):
        return self.train_dataloader()

    def validation_step(self, batch, batch_idx):
        return None


def fit_in_one_call_and_in_two(rank: int, out_dir: Path, name: str) -> dict:
    """One rank of a script that trains 2 epochs with one ``fit``, then again with ``fit`` (1 epoch),
    ``validate`` and ``fit`` continued to 2 epochs on the same Trainer (plain SGD: Lightning builds a
    new optimizer for the second fit, which keeps nothing else)."""
    cls, kwargs = LIFECYCLE[name]
    out = {}
    for how, epochs in (("once", [2]), ("twice", [1, 2])):
        model = Validated(momentum=0.0)
        trainer = L.Trainer(
            accelerator="cpu", devices=2, strategy=cls(timeout=TIMEOUT, **kwargs), max_epochs=epochs[0],
            limit_val_batches=1, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, default_root_dir=out_dir,
        )  # fmt: skip
        for max_epochs in epochs[1:]:
            trainer.fit(model)
            trainer.validate(model, verbose=False)
            trainer.fit_loop.max_epochs = max_epochs
        trainer.fit(model)
        strategy = trainer.strategy
        gtc = getattr(strategy, "gtc_state", None)
        out[how] = {
            "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
            "global_step": trainer.global_step,
            "sync_step": strategy.sync_stats["step"] if hasattr(strategy, "sync_stats") else None,
            "residual": gtc.residual_vector() if gtc is not None else None,
            "gtc_step": gtc.step if gtc is not None else None,
        }
    out["unpickled"] = type(pickle.loads(pickle.dumps(trainer.strategy))).__name__
    return out


@pytest.mark.parametrize("name", list(LIFECYCLE))
def test_a_second_fit_continues_every_rank_bit_for_bit(tmp_path, name):
    """``fit`` again on the same Trainer (the ranks live on, as under torchrun) continues every rank's
    own model, the period's position, BMUF's W and Δ, D-PSGD's own models (not the average the first
    fit ended with) and GTC's residuals: bit for bit the one fit of the same length, as under DDP."""
    for rank, out in enumerate(run_ranks(tmp_path, fit_in_one_call_and_in_two, name=name)):
        once, twice = out["once"], out["twice"]
        assert twice["global_step"] == once["global_step"] == STEPS
        assert twice["sync_step"] == once["sync_step"], f"rank {rank}: the step counter restarted"
        assert twice["gtc_step"] == once["gtc_step"]
        if once["residual"] is not None:
            assert torch.equal(twice["residual"], once["residual"]), f"rank {rank}: GTC's residuals differ"
        assert torch.equal(twice["params"], once["params"]), f"rank {rank}: the parameters differ"
        assert out["unpickled"] == LIFECYCLE[name][0].__name__


def fit_ending_between_syncs(rank: int, out_dir: Path, name: str) -> dict:
    """One rank: the same fit (8 steps, syncs after 3 and 6) with and without ``average_at_end``."""
    cls, kwargs = LIFECYCLE[name]
    out = {}
    for at_end in (False, True):
        model = Validated(momentum=0.0)
        trainer = L.Trainer(
            accelerator="cpu", devices=2, strategy=cls(timeout=TIMEOUT, average_at_end=at_end, **kwargs),
            max_epochs=2, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, default_root_dir=out_dir,
        )  # fmt: skip
        trainer.fit(model)
        out[at_end] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return out


@pytest.mark.parametrize("name", ["ma", "bmuf", "bmuf_gtc", "dpsgd"])
def test_a_fit_that_ends_between_syncs_returns_the_mean_of_the_ranks_models(tmp_path, name):
    """Steps 7 and 8 are each rank's own: with ``average_at_end`` (the default) fit leaves every rank the
    mean of them (bit for bit the all-reduce's), without it each rank keeps its own."""
    own, averaged = zip(*((out[False], out[True]) for out in run_ranks(tmp_path, fit_ending_between_syncs, name=name)))
    assert not torch.equal(own[0], own[1]), "the test needs a fit that ends with the ranks apart"
    for rank in range(2):
        assert torch.equal(averaged[rank], mean(list(own))), f"rank {rank}"


EVALUATED = {  # syncs after steps 3 and 6; validations and checkpoints after steps 4 and 8, the ranks apart
    "ma": (ModelAveragingStrategy, {"period": K}),
    "bmuf": (BMUFStrategy, {"period": K}),
    "sparseloco": (SparseLoCoStrategy, {"period": K}),
    "bmuf_gtc": (BMUFGTCStrategy, {"group_size": 1, "period": K, "tau": 0.01}),
}


@pytest.mark.parametrize("name", list(EVALUATED))
def test_validation_and_checkpoints_between_syncs_see_the_mean_of_the_ranks_models(tmp_path, name):
    """Validation after steps 4 and 8 (between syncs) evaluates the mean of the ranks' models, each
    rank's own comes back for the next local step; the checkpoints hold that mean, their shards each
    rank's own, and a fit resumed from a checkpoint goes on from every rank's own, bit for bit."""
    cls, kwargs = EVALUATED[name]
    callbacks = [
        ModelCheckpoint(dirpath=tmp_path / "every", every_n_train_steps=4, save_top_k=-1),
        ModelCheckpoint(dirpath=tmp_path / "best", monitor="val_loss", save_top_k=1),
    ]
    trainer_kwargs = {"enable_checkpointing": True, "callbacks": callbacks, "num_sanity_val_steps": 0}
    model = SeenValidated(tmp_path, momentum=0.0)
    _, ranks = fit(tmp_path, strategy=cls, model=model, trainer_kwargs=trainer_kwargs, **kwargs)
    seen = [torch.load(tmp_path / f"seen{r}.pt") for r in range(2)]
    for k, t in enumerate((3, 7)):
        own = [rank["records"][t]["params"] for rank in ranks]
        assert not torch.equal(own[0], own[1]), f"the test needs ranks apart after step {t + 1}"
        for r in range(2):
            assert torch.equal(seen[r][k], mean(own)), f"rank {r}: validation after step {t + 1}"
    if name == "ma":  # the local step after the validation starts from the rank's own model
        for rank in ranks:
            step5 = local_step(rank["records"][3]["params"], rank["records"][4]["local_grad"])
            assert torch.equal(rank["records"][4]["params"], step5)
    check_checkpoints_hold_the_validated_mean(tmp_path, name, seen[0], ranks)
    resumed_dir = tmp_path / "resumed"
    _, resumed = fit(resumed_dir, strategy=cls, model=TinyMLP(momentum=0.0),
                     ckpt_path=str(tmp_path / "every" / "epoch=0-step=4.ckpt"), **kwargs)  # fmt: skip
    for r in range(2):
        assert torch.equal(resumed[r]["start"]["params"], ranks[r]["records"][3]["params"])
        for a, b in zip(resumed[r]["records"], ranks[r]["records"][4:]):
            assert torch.equal(a["params"], b["params"]), f"rank {r}: the resumed fit differs"


class SavedEntries(L.Callback):
    """After Lightning's ``EMAWeightAveraging`` (listed before it): what each checkpoint's ``state_dict``
    holds on this rank before the strategy averages it (the rank's average model), and the model fit
    ends with on this rank before ``average_at_end`` (the average model, copied in)."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir, self.saved = Path(out_dir), {}

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        self.saved[trainer.global_step] = {k: v.detach().clone() for k, v in checkpoint["state_dict"].items()}

    def on_train_end(self, trainer, pl_module):
        final = torch.cat([p.detach().reshape(-1) for p in pl_module.parameters()]).clone()
        torch.save({"saved": self.saved, "final": final}, self.out_dir / f"entries{trainer.global_rank}.pt")


def test_with_lightnings_ema_the_checkpoint_and_the_end_of_fit_hold_the_mean_of_the_ranks_averages(tmp_path):
    """``EMAWeightAveraging`` puts each rank's average model in the checkpoint's ``state_dict`` (the model
    itself under ``current_model_state``) and copies it into the model at the end of fit: between syncs
    the ranks' averages differ, and the checkpoint holds their mean, as fit ends with it."""
    from lightning.pytorch.callbacks import EMAWeightAveraging

    callbacks = [
        EMAWeightAveraging(decay=0.5), SavedEntries(tmp_path),
        ModelCheckpoint(dirpath=tmp_path / "every", every_n_train_steps=4, save_top_k=-1),
    ]  # fmt: skip
    trainer_kwargs = {"enable_checkpointing": True, "callbacks": callbacks}
    trainer, _ = fit(tmp_path, strategy=ModelAveragingStrategy, model=TinyMLP(momentum=0.0),
                     trainer_kwargs=trainer_kwargs, period=K)  # fmt: skip
    entries = [torch.load(tmp_path / f"entries{r}.pt", weights_only=False) for r in range(2)]
    for step in (4, 8):
        ranks = [entry["saved"][step] for entry in entries]
        assert not torch.equal(ranks[0]["net.0.weight"], ranks[1]["net.0.weight"]), "the ranks' averages agree"
        saved = torch.load(tmp_path / "every" / f"epoch={step // 5}-step={step}.ckpt", weights_only=False)
        assert "current_model_state" in saved
        for key in ranks[0]:
            assert torch.equal(saved["state_dict"][key], mean([rank[key] for rank in ranks])), (step, key)
    final = torch.cat([p.detach().reshape(-1) for p in trainer.lightning_module.parameters()])
    assert torch.equal(final, mean([entry["final"] for entry in entries])), "average_at_end"


def test_without_average_eval_each_rank_validates_its_own_model(tmp_path):
    model = SeenValidated(tmp_path, momentum=0.0)
    trainer_kwargs = {"num_sanity_val_steps": 0}
    _, ranks = fit(tmp_path, strategy=ModelAveragingStrategy, model=model, trainer_kwargs=trainer_kwargs,
                   period=K, average_eval=False)  # fmt: skip
    seen = [torch.load(tmp_path / f"seen{r}.pt") for r in range(2)]
    for r in range(2):
        assert torch.equal(seen[r][0], ranks[r]["records"][3]["params"])
        assert torch.equal(seen[r][1], ranks[r]["records"][7]["params"])
    assert not torch.equal(seen[0][0], seen[1][0])


FABRIC_NAMES = [
    base + suffix
    for base in ("ma", "bmuf", "bmuf_gtc", "dpsgd")
    for suffix in ("", "_spawn", "_fork", "_notebook")
]


@pytest.mark.parametrize("name", FABRIC_NAMES)
def test_fabric_refuses_every_name_of_the_family_with_the_trainer_to_use(name):
    """The family runs in the Trainer's optimizer step, which Fabric does not have."""
    message = rf"{name} is a Lightning Trainer strategy only .* Use Trainer\(strategy='{name}'\)"
    with pytest.raises(ValueError, match=message):
        L.Fabric(accelerator="cpu", devices=2, strategy=name)


class UnfreezeOnStep2(L.Callback):
    """The model's last layer is frozen when fit starts and unfrozen before the second batch (as
    Lightning's ``BaseFinetuning`` does at an epoch's start)."""

    def setup(self, trainer, pl_module, stage):
        pl_module.net[2].requires_grad_(False)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 1:
            pl_module.net[2].requires_grad_(True)


@pytest.mark.parametrize(
    ("strategy", "kwargs"),
    [(ModelAveragingStrategy, {"period": 2}), (BMUFStrategy, {"period": 2}), (DPSGDStrategy, {"warmup_steps": 2})],
    ids=["ma", "bmuf", "dpsgd_warmup"],
)
def test_a_parameter_unfrozen_during_fit_is_refused_not_left_to_diverge(tmp_path, strategy, kwargs):
    """It is in none of DDP's buckets and not among the parameters averaged (D-PSGD averages it once
    its warmup is over): its copies would drift apart without a word."""
    with pytest.raises(Exception, match=r"'net\.2\.weight' got a gradient .* trainable before trainer\.fit"):
        fit_recorded(tmp_path, strategy, max_epochs=1, model_kwargs={"momentum": 0.0},
                     trainer_kwargs={"callbacks": [UnfreezeOnStep2()]}, **kwargs)  # fmt: skip
