"""GTCHSDPStrategy ("gtc_hsdp"): FSDP2 on the shard dimension, GTC across the replicate dimension, on 4
forked CPU ranks over gloo, a 2 x 2 mesh (ranks 0, 1 hold shards 0, 1 of replica 0; ranks 2, 3 of
replica 1). Each rank writes what it saw to ``rank{r}.pt``; the tests compare the ranks."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from _strategy_helpers import TIMEOUT, keep_master_port  # noqa: F401  (autouse fixture)
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

import gtc_lightning  # noqa: F401  (registers "gtc_hsdp")
from gtc_lightning.strategies.hsdp import GTCHSDPStrategy, ShardedResultsLauncher

FEATURES, HIDDEN, CLASSES = 16, 24, 4
SAMPLES, BATCH = 128, 8  # 4 ranks x 4 batches of 8 per epoch


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    teacher = torch.randn(FEATURES, CLASSES, generator=g)
    return TensorDataset(x, (x @ teacher).argmax(dim=1))


class ShardedMLP(L.LightningModule):
    """16 -> 24 -> 24 -> 4 MLP, each hidden block its own FSDP2 module, the head in the root's.

    Args:
        out_dir: where each rank writes its record.
        shard: how ``configure_model`` shards: ``"shard"`` (FSDP2 on the shard dimension, as GTC
            wants), ``"native"`` (on the whole 2-D mesh: torch's own HSDP), ``"blocks"`` (the blocks
            alone, not the head), ``"none"`` (not at all).
        per_rank_data: each rank takes rows ``rank::world`` itself (for strategies whose sampler
            splits the data otherwise).
        step_data: each rank's batch is a function of the global step and the rank alone, whatever
            batches Lightning replays on a resume.
    """

    def __init__(self, out_dir: Path, shard: str = "shard", per_rank_data: bool = False, step_data: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(
            [torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.Tanh()),
             torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh())]
        )  # fmt: skip
        self.head = torch.nn.Linear(HIDDEN, CLASSES)
        self.out_dir, self.shard, self.per_rank_data = Path(out_dir), shard, per_rank_data or step_data
        self.step_data = step_data
        self.records: list[dict] = []
        self.calls: list[tuple[str, torch.Tensor, torch.Tensor]] = []

    def configure_model(self) -> None:
        if self.shard == "none":
            return
        mesh = self.device_mesh if self.shard == "native" else self.device_mesh["shard"]
        for block in self.blocks:
            fully_shard(block, mesh=mesh)
        if self.shard != "blocks":
            fully_shard(self, mesh=mesh)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.step_data:
            x, y = dataset()[(torch.arange(BATCH) + (self.global_step * 4 + self.global_rank) * BATCH) % SAMPLES]
        return torch.nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)

    def train_dataloader(self):
        data = dataset()
        if self.per_rank_data:
            rows = list(range(self.global_rank, SAMPLES, self.trainer.world_size))
            data = torch.utils.data.Subset(data, rows)
        return DataLoader(data, batch_size=BATCH)

    def on_train_start(self):
        state = getattr(self.trainer.strategy, "gtc_state", None)
        if state is None:
            return
        reduce = state.reduce

        def recording(key, output):
            before = output.detach().clone()
            reduce(key, output)
            slot = state.slots[key]
            own = slot.words[torch.distributed.get_rank(state.replicate_group)] if slot.words else 0
            self.calls.append((key, before, slot.message[:own].clone(), slot.tau))

        state.reduce = recording

    def on_train_batch_end(self, outputs, batch, batch_idx):
        state = getattr(self.trainer.strategy, "gtc_state", None)
        self.records.append({
            "params": [p.to_local().detach().clone() if hasattr(p, "to_local") else p.detach().clone()
                       for p in self.parameters()],
            "residuals": {k: s.residual.clone() for k, s in state.slots.items()} if state else {},
            "loss": float(outputs["loss"]), "batch": float(batch[0].sum()),
        })  # fmt: skip

    def on_train_end(self):
        state = getattr(self.trainer.strategy, "gtc_state", None)
        out = {"records": self.records, "calls": self.calls, "stats": dict(state.totals) if state else {},
               "nbytes": state.nbytes() if state else 0,
               "shard_numel": sum(p.to_local().numel() for p in self.parameters())}  # fmt: skip
        torch.save(out, self.out_dir / f"rank{self.global_rank}.pt")


def run(out_dir: Path, strategy=None, max_steps: int = 6, ckpt_path: str | None = None, model=None,
        checkpoint_at: int | None = None, **kwargs) -> list[dict]:  # fmt: skip
    """Fit on 4 forked CPU ranks; the ranks' records, rank by rank."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if strategy is None:
        kwargs.setdefault("tau", 0.01)
        kwargs.setdefault("coding", "none")
        kwargs.setdefault("compress", "gradient")  # Strom's mode, whose hook these tests look into
        strategy = GTCHSDPStrategy(replicate_size=2, shard_size=2, start_method="fork", timeout=TIMEOUT, **kwargs)
    callbacks = []
    if checkpoint_at is not None:
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=out_dir / "ckpt", every_n_epochs=checkpoint_at,
                                                             save_on_train_epoch_end=True, save_top_k=-1))  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu", devices=4, strategy=strategy, max_steps=max_steps, logger=False,
        enable_checkpointing=bool(callbacks), callbacks=callbacks, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=not getattr(model, "per_rank_data", False),
    )  # fmt: skip
    trainer.fit(model or ShardedMLP(out_dir), ckpt_path=ckpt_path)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(4)]


def test_replicas_bit_identical_and_conservation(tmp_path):
    ranks = run(tmp_path, max_steps=6, tau=0.01)
    for shard in (0, 1):  # ranks shard and 2 + shard hold the same shard
        a, b = ranks[shard], ranks[2 + shard]
        for ra, rb in zip(a["records"], b["records"]):
            for pa, pb in zip(ra["params"], rb["params"]):
                assert torch.equal(pa, pb)
    # The two shards of a replica differ, and training moved the parameters.
    assert not torch.equal(ranks[0]["records"][-1]["params"][0], ranks[1]["records"][-1]["params"][0])
    assert ranks[0]["stats"]["sparse"] == 6 * 3 and ranks[0]["stats"]["words"] > 0
    # Conservation: per rank and module, the residual plus tau times the words sent is the gradient sum.
    for rank in ranks:
        for key, final in rank["records"][-1]["residuals"].items():
            calls = [c for c in rank["calls"] if c[0] == key]
            total = torch.stack([c[1] for c in calls]).double().sum(0)
            sent = torch.zeros_like(total)
            for _, _, words, tau in calls:
                sign = torch.where(words < 0, 1.0, -1.0).double()  # the residual moved by -tau per + word
                sent.index_add_(0, (words & 0x7FFFFFFF).long(), -sign * tau)
            torch.testing.assert_close(final.double() + sent, total, atol=1e-5, rtol=0)


def test_dense_warmup_equals_native_hsdp(tmp_path):
    """The plumbing (FSDP2 on the shard dimension, the hook across replicas) against torch's own HSDP."""
    ours = run(tmp_path / "gtc", max_steps=4, warmup_steps=4, model=ShardedMLP(tmp_path / "gtc", per_rank_data=True))
    native = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2, timeout=TIMEOUT)
    native._configure_launcher = lambda: setattr(native, "_launcher", ShardedResultsLauncher(native, "fork"))
    model = ShardedMLP(tmp_path / "native", shard="native", per_rank_data=True)
    theirs = run(tmp_path / "native", strategy=native, max_steps=4, model=model)
    assert ours[0]["stats"]["dense"] == 4 * 3 and ours[0]["stats"]["sparse"] == 0
    for a, b in zip(ours, theirs):
        for ra, rb in zip(a["records"], b["records"]):
            assert abs(ra["loss"] - rb["loss"]) < 1e-5
            for pa, pb in zip(ra["params"], rb["params"]):
                torch.testing.assert_close(pa, pb, atol=1e-6, rtol=1e-5)


def test_checkpoint_resume_bit_exact_and_refused_at_another_mesh(tmp_path):
    kwargs = {"tau": "auto", "coding": "rice"}
    straight = run(tmp_path / "straight", max_steps=8, model=ShardedMLP(tmp_path / "straight", step_data=True), **kwargs)
    run(tmp_path / "first", max_steps=4, checkpoint_at=1, model=ShardedMLP(tmp_path / "first", step_data=True), **kwargs)
    ckpt = next((tmp_path / "first" / "ckpt").glob("*.ckpt"))
    assert ckpt.is_dir()  # a distributed checkpoint
    model = ShardedMLP(tmp_path / "resumed", step_data=True)
    resumed = run(tmp_path / "resumed", max_steps=8, ckpt_path=str(ckpt), model=model, **kwargs)
    assert len(resumed[0]["records"]) == 4
    for a, b in zip(straight, resumed):
        last_a, last_b = a["records"][-1], b["records"][-1]
        for pa, pb in zip(last_a["params"], last_b["params"]):
            assert torch.equal(pa, pb)
        for key in last_a["residuals"]:
            assert torch.equal(last_a["residuals"][key], last_b["residuals"][key])
    # At a 4 x 1 mesh the residuals do not fit: refused, with the fix; restore_residuals=False resumes.
    other = GTCHSDPStrategy(replicate_size=4, shard_size=1, start_method="fork", timeout=TIMEOUT, tau=0.01)
    with pytest.raises(Exception, match="restore_residuals=False"):
        run(tmp_path / "other", strategy=other, max_steps=5, ckpt_path=str(ckpt))
    fresh = GTCHSDPStrategy(replicate_size=4, shard_size=1, start_method="fork", timeout=TIMEOUT, tau=0.01,
                            restore_residuals=False)  # fmt: skip
    ranks = run(tmp_path / "fresh", strategy=fresh, max_steps=5, ckpt_path=str(ckpt))
    assert len(ranks[0]["records"]) == 1  # step 5 after the checkpoint's 4


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"replicate_size": 1}, "replicate_size to be an int >= 2"),
        ({"replicate_size": "auto", "shard_size": 3}, "does not divide the world size 4"),
        ({"replicate_size": 2, "shard_size": 4}, "is not the world size 4"),
        ({"replicate_size": "auto", "shard_size": 4}, "replicate_size is 1"),
        ({"save_distributed_checkpoint": False}, "save_distributed_checkpoint=True"),
    ],
)
def test_bad_meshes(tmp_path, kwargs, message):
    with pytest.raises(Exception, match=message):
        strategy = GTCHSDPStrategy(start_method="fork", timeout=TIMEOUT, **kwargs)
        run(tmp_path, strategy=strategy, max_steps=1)


@pytest.mark.parametrize(
    ("shard", "message"),
    [("none", "no FSDP2 module"), ("native", "sharded on a mesh of shape"), ("blocks", "outside every FSDP2 module")],
)
def test_bad_models(tmp_path, shard, message):
    with pytest.raises(Exception, match=message):
        run(tmp_path, max_steps=1, model=ShardedMLP(tmp_path, shard=shard))


def test_registered():
    from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC
    from lightning.pytorch.strategies import StrategyRegistry

    assert StrategyRegistry["gtc_hsdp_fork"]["strategy"] is GTCHSDPStrategy
    with pytest.raises(ValueError, match="Trainer strategy only"):
        FABRIC.get("gtc_hsdp")


class AdamStepLR(ShardedMLP):
    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=1e-2)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.9),
                                                   "interval": "step"}}  # fmt: skip


class Frozen(ShardedMLP):
    def __init__(self, out_dir):
        super().__init__(out_dir)
        self.blocks[0][0].weight.requires_grad_(False)


# The matrix of docs/guide/hsdp.md: (model class, Trainer arguments, what the run must show).
FEATURES_WORK = {
    "adam_steplr": (AdamStepLR, {}),
    "accumulate_grad_batches": (ShardedMLP, {"accumulate_grad_batches": 2}),
    "bf16_mixed": (ShardedMLP, {"precision": "bf16-mixed"}),
    "clip_norm": (ShardedMLP, {"gradient_clip_val": 0.1}),
    "clip_value": (ShardedMLP, {"gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"}),
    "frozen_layer": (Frozen, {}),
}


@pytest.mark.parametrize("compress", ["gradient", "update"])
@pytest.mark.parametrize("feature", sorted(FEATURES_WORK))
def test_lightning_features(tmp_path, feature, compress):
    cls, trainer_kwargs = FEATURES_WORK[feature]
    strategy = GTCHSDPStrategy(replicate_size=2, shard_size=2, start_method="fork", timeout=TIMEOUT, tau=0.01,
                               compress=compress)  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu", devices=4, strategy=strategy, max_steps=3, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, **trainer_kwargs,
    )  # fmt: skip
    trainer.fit(cls(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(4)]
    assert ranks[0]["stats"]["sparse"] > 0
    for shard in (0, 1):
        for ra, rb in zip(ranks[shard]["records"], ranks[2 + shard]["records"]):
            assert all(torch.equal(pa, pb) for pa, pb in zip(ra["params"], rb["params"]))
            assert torch.isfinite(torch.tensor(ra["loss"]))
    moved = [not torch.equal(a, b) for a, b in zip(ranks[0]["records"][0]["params"], ranks[0]["records"][-1]["params"])]
    assert any(moved)
    if feature == "frozen_layer":
        assert not moved[0]


def test_fp16_loss_scaling_refused(tmp_path):
    from lightning.pytorch.plugins import MixedPrecision

    strategy = GTCHSDPStrategy(replicate_size=2, shard_size=2, start_method="fork", timeout=TIMEOUT)
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=1, logger=False,
                        plugins=[MixedPrecision("16-mixed", "cpu")], enable_progress_bar=False)  # fmt: skip
    with pytest.raises(Exception, match="loss-scaled precision"):
        trainer.fit(ShardedMLP(tmp_path))


class NaNOnRank2(ShardedMLP):
    def __init__(self, out_dir, step: int = 1):
        super().__init__(out_dir)
        self.nan_step = step

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.global_rank == 2 and self.global_step == self.nan_step else loss


def test_non_finite_gradient_keeps_residuals(tmp_path):
    """Rank 2's NaN reaches both shards of replica 1: every shard's mean is NaN on every replica (as a
    dense all-reduce's), and every rank's residual holds its own gradient instead of sending it."""
    ranks = run(tmp_path, max_steps=2, model=NaNOnRank2(tmp_path))
    for rank in ranks:
        assert rank["stats"]["skipped"] == 3 and rank["stats"]["sparse"] == 3
        assert all(torch.isnan(p).all() for p in rank["records"][1]["params"])
        for key, after in rank["records"][1]["residuals"].items():
            before = rank["records"][0]["residuals"][key]
            grad = [c[1] for c in rank["calls"] if c[0] == key][1]
            if torch.isfinite(grad).all():
                torch.testing.assert_close(after, before + grad, atol=1e-6, rtol=0)
            else:
                assert torch.equal(after, before)


def test_update_mode_undoes_a_non_finite_step_on_every_replica(tmp_path):
    """Rank 2's NaN at step 2 makes replica 1's step NaN: no replica moves at that step (every shard keeps
    the parameters of step 1, alike on the replicas), and the finite replica's step stays in its residual."""
    ranks = run(tmp_path, strategy=update_mode(tau=0.01), max_steps=2, model=NaNOnRank2(tmp_path))
    for rank in ranks:
        first, second = rank["records"][0]["params"], rank["records"][1]["params"]
        assert all(torch.equal(a, b) for a, b in zip(first, second))
        assert rank["stats"]["skipped"] == 1
    step = ranks[0]["calls"][1][1]  # replica 0's own (finite) step at step 2
    kept = ranks[0]["records"][1]["residuals"]["_update"] - ranks[0]["records"][0]["residuals"]["_update"]
    torch.testing.assert_close(kept, step, atol=1e-6, rtol=0)


def test_non_finite_first_gradient_with_automatic_tau(tmp_path):
    """The replicas agree on automatic tau's start even when one's first gradient is not finite."""
    ranks = run(tmp_path, max_steps=1, model=NaNOnRank2(tmp_path, step=0), tau="auto")
    for shard in (0, 1):
        assert [c[3] for c in ranks[shard]["calls"]] == [c[3] for c in ranks[2 + shard]["calls"]]
    assert ranks[0]["stats"]["skipped"] == 3


class UsedFromStep1(ShardedMLP):
    def __init__(self, out_dir):
        super().__init__(out_dir)
        self.extra = torch.nn.Linear(CLASSES, CLASSES)

    def forward(self, x):
        out = super().forward(x)
        return self.extra(out) if self.global_step >= 1 else out


@pytest.mark.parametrize(
    ("model", "trainer_kwargs", "message"),
    [
        (ShardedMLP, {"precision": "bf16-true"}, "reduces float32 gradient shards"),
        (UsedFromStep1, {}, "got no gradient in some backward pass"),
    ],
)
def test_refused_at_the_first_gradient(tmp_path, model, trainer_kwargs, message):
    strategy = GTCHSDPStrategy(replicate_size=2, shard_size=2, start_method="fork", timeout=TIMEOUT, tau=0.01,
                               compress="gradient")  # fmt: skip
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, **trainer_kwargs)  # fmt: skip
    with pytest.raises(Exception, match=message):
        trainer.fit(model(tmp_path))


def test_update_mode_takes_a_parameter_without_gradient_in_some_steps(tmp_path):
    """The update mode has no hook: a parameter that got no gradient did not move, and its step is zero."""
    ranks = run(tmp_path, strategy=update_mode(), max_steps=3, model=UsedFromStep1(tmp_path))
    for shard in (0, 1):
        for ra, rb in zip(ranks[shard]["records"], ranks[2 + shard]["records"]):
            assert all(torch.equal(pa, pb) for pa, pb in zip(ra["params"], rb["params"]))
    assert ranks[0]["stats"]["sparse"] == 3


def test_statistics_logged(tmp_path):
    strategy = GTCHSDPStrategy(replicate_size=2, shard_size=2, start_method="fork", timeout=TIMEOUT)
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=3, log_every_n_steps=1,
                        logger=L.pytorch.loggers.CSVLogger(tmp_path), enable_checkpointing=False,
                        enable_progress_bar=False)  # fmt: skip
    trainer.fit(ShardedMLP(tmp_path))
    metrics = (next(tmp_path.rglob("metrics.csv"))).read_text().splitlines()
    header, last = metrics[0].split(","), metrics[-1].split(",")
    row = dict(zip(header, last))
    assert float(row["gtc_hsdp/ratio_fp32"]) > 1 and float(row["gtc_hsdp/bytes_sent"]) > 0
    assert 0 < float(row["gtc_hsdp/density"]) < 1 and float(row["gtc_hsdp/tau"]) > 0


# ---- the update mode: each replica's optimizer step, compressed after it ---------------------------------


def update_mode(**kwargs) -> GTCHSDPStrategy:
    kwargs = {"tau": "auto", "coding": "rice", **kwargs}
    return GTCHSDPStrategy(replicate_size=2, shard_size=2, start_method="fork", timeout=TIMEOUT, compress="update",
                           **kwargs)  # fmt: skip


@pytest.mark.parametrize("tau", [5e-3, "auto"])
def test_update_mode_keeps_replicas_identical_and_conserves_the_steps(tmp_path, tau):
    """Adam with a step schedule, each replica on its own data and moments: no hook call, one exchange per
    step of the whole shard's step, the replicas of a shard bit-identical after every step, and per rank
    the residual plus what its words sent (at the tau it thresholded with: a fixed one, or with "auto" its
    own, measured that step and sent in its header) is the sum of its optimizer's steps."""
    ranks = run(tmp_path, strategy=update_mode(tau=tau), max_steps=6, model=AdamStepLR(tmp_path))
    for shard in (0, 1):
        for ra, rb in zip(ranks[shard]["records"], ranks[2 + shard]["records"]):
            assert all(torch.equal(pa, pb) for pa, pb in zip(ra["params"], rb["params"]))
    assert not torch.equal(ranks[0]["records"][-1]["params"][0], ranks[0]["records"][0]["params"][0])
    for rank in ranks:
        assert {c[0] for c in rank["calls"]} == {"_update"} and rank["stats"]["sparse"] == 6
        assert rank["shard_numel"] == rank["records"][-1]["residuals"]["_update"].numel()
        steps = torch.stack([c[1] for c in rank["calls"]]).double()
        sent = torch.zeros(steps.shape[1], dtype=torch.float64)
        for _, _, words, own_tau in rank["calls"]:
            sign = torch.where(words < 0, -1.0, 1.0).double()
            sent.index_add_(0, (words & 0x7FFFFFFF).long(), sign * own_tau)
        torch.testing.assert_close(rank["records"][-1]["residuals"]["_update"].double() + sent, steps.sum(0),
                                   atol=1e-6, rtol=0)  # fmt: skip
    # The replicas stepped on different data: their own steps differ, and so, with "auto", their taus (not
    # at every step: Adam's first step is about lr on every element, whatever the data).
    assert not torch.equal(ranks[0]["calls"][0][1], ranks[2]["calls"][0][1])
    taus = [[call[3] for call in ranks[r]["calls"]] for r in (0, 2)]
    assert (taus[0] != taus[1]) == (tau == "auto"), taus


def test_update_mode_dense_warmup_equals_native_hsdp(tmp_path):
    """SGD with momentum is linear in the gradient: the mean of the replicas' steps from the same point is
    the step on the mean gradient, so the update mode's dense warm-up is torch's own HSDP."""
    model = ShardedMLP(tmp_path / "gtc", per_rank_data=True)
    ours = run(tmp_path / "gtc", strategy=update_mode(warmup_steps=4), max_steps=4, model=model)
    native = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2, timeout=TIMEOUT)
    native._configure_launcher = lambda: setattr(native, "_launcher", ShardedResultsLauncher(native, "fork"))
    theirs = run(tmp_path / "native", strategy=native, max_steps=4,
                 model=ShardedMLP(tmp_path / "native", shard="native", per_rank_data=True))  # fmt: skip
    assert ours[0]["stats"]["dense"] == 4 and ours[0]["stats"]["sparse"] == 0
    for a, b in zip(ours, theirs):
        for ra, rb in zip(a["records"], b["records"]):
            for pa, pb in zip(ra["params"], rb["params"]):
                torch.testing.assert_close(pa, pb, atol=1e-6, rtol=1e-5)


def test_update_mode_resume_bit_exact(tmp_path):
    straight = run(tmp_path / "straight", strategy=update_mode(), max_steps=8,
                   model=AdamStepLR(tmp_path / "straight", step_data=True))  # fmt: skip
    run(tmp_path / "first", strategy=update_mode(), max_steps=4, checkpoint_at=1,
        model=AdamStepLR(tmp_path / "first", step_data=True))  # fmt: skip
    ckpt = next((tmp_path / "first" / "ckpt").glob("*.ckpt"))
    resumed = run(tmp_path / "resumed", strategy=update_mode(), max_steps=8, ckpt_path=str(ckpt),
                  model=AdamStepLR(tmp_path / "resumed", step_data=True))  # fmt: skip
    assert len(resumed[0]["records"]) == 4
    for a, b in zip(straight, resumed):
        assert all(torch.equal(pa, pb) for pa, pb in zip(a["records"][-1]["params"], b["records"][-1]["params"]))
        assert torch.equal(a["records"][-1]["residuals"]["_update"], b["records"][-1]["residuals"]["_update"])


class TwoOptimizers(ShardedMLP):
    def __init__(self, out_dir):
        super().__init__(out_dir)
        self.automatic_optimization = False

    def configure_optimizers(self):
        return [torch.optim.SGD(self.blocks.parameters(), lr=0.1), torch.optim.SGD(self.head.parameters(), lr=0.1)]

    def training_step(self, batch, batch_idx):
        optimizers = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        for optimizer in optimizers:
            optimizer.zero_grad()
        self.manual_backward(loss)
        for optimizer in optimizers:
            optimizer.step()
        return loss


class TwiceSGD(torch.optim.SGD):
    """SGD that evaluates its closure twice a step (as SAM and line searches do), stepping on the second."""

    @torch.no_grad()
    def step(self, closure):
        with torch.enable_grad():
            closure()
            loss = closure()
        super().step()
        return loss


class ClosureTwice(ShardedMLP):
    def __init__(self, out_dir, optimizer: str = "twice"):
        super().__init__(out_dir)
        self.which = optimizer

    def configure_optimizers(self):
        if self.which == "lbfgs":
            return torch.optim.LBFGS(self.parameters(), lr=0.1)
        return TwiceSGD(self.parameters(), lr=0.1)


def test_a_closure_evaluated_twice_trains_in_the_update_mode_alone_and_lbfgs_is_refused(tmp_path):
    ranks = run(tmp_path / "update", strategy=update_mode(), max_steps=3, model=ClosureTwice(tmp_path / "update"))
    for shard in (0, 1):
        for ra, rb in zip(ranks[shard]["records"], ranks[2 + shard]["records"]):
            assert all(torch.equal(pa, pb) for pa, pb in zip(ra["params"], rb["params"]))
    with pytest.raises(Exception, match=r"TwiceSGD evaluates the closure again.*compress='update'"):
        run(tmp_path / "gradient", max_steps=3, model=ClosureTwice(tmp_path / "gradient"))
    with pytest.raises(Exception, match=r"GTCHSDPStrategy cannot train with LBFGS"):
        run(tmp_path / "lbfgs", strategy=update_mode(), max_steps=1, model=ClosureTwice(tmp_path / "lbfgs", "lbfgs"))


def test_update_mode_refuses_two_optimizers_and_bad_values(tmp_path):
    with pytest.raises(Exception, match="compresses the step of one optimizer; this model has 2"):
        run(tmp_path, strategy=update_mode(), max_steps=1, model=TwoOptimizers(tmp_path))
    with pytest.raises(ValueError, match=r"compress in \('auto', 'gradient', 'update'\).*got 'dense'"):
        GTCHSDPStrategy(compress="dense")


def test_auto_picks_the_update_with_one_optimizer_and_the_gradient_with_two(tmp_path):
    """The default: the update mode for one optimizer (no hook call, one exchange a step), Strom's gradient
    mode for two (manual optimization: each optimizer steps on the decoded gradients)."""
    auto = GTCHSDPStrategy(replicate_size=2, shard_size=2, start_method="fork", timeout=TIMEOUT)
    one = run(tmp_path / "one", strategy=auto, max_steps=3, model=AdamStepLR(tmp_path / "one"))
    assert {c[0] for c in one[0]["calls"]} == {"_update"} and one[0]["stats"]["sparse"] == 3
    auto = GTCHSDPStrategy(replicate_size=2, shard_size=2, start_method="fork", timeout=TIMEOUT)
    two = run(tmp_path / "two", strategy=auto, max_steps=2, model=TwoOptimizers(tmp_path / "two"))
    assert "_update" not in {c[0] for c in two[0]["calls"]} and two[0]["stats"]["sparse"] > 0


def test_update_mode_measures_tau_at_every_step(tmp_path):
    """Adam's steps grow and shrink with the schedule; tau follows each step, so every step of every rank
    sends about the target density (here 0.1 of a ~550-element shard), not the controller's lagging share."""
    ranks = run(tmp_path, strategy=update_mode(target_density=0.1, coding="none"), max_steps=6,
                model=AdamStepLR(tmp_path))  # fmt: skip
    for rank in ranks:
        for key, before, words, tau in rank["calls"]:
            assert 0.05 * before.numel() <= words.numel() <= 0.2 * before.numel(), (words.numel(), before.numel())
        # Every byte counted: per step a header of 4 int64 (τ among them: no collective of its own) and 4
        # bytes a word to the other replica.
        assert rank["stats"]["bytes_sent"] == sum(32 + 4 * words.numel() for _, _, words, _ in rank["calls"])


def _reduce_at_own_taus(rank: int, out: Path) -> None:
    """One replica of 2 (the replicate group is the world): three steps of ``per_step_tau`` reduction of
    its own input; what each step decoded and what each replica's words were worth, into ``rank{r}.pt``."""
    import torch.distributed as dist

    from gtc_lightning.algorithms.gtc.hsdp import HSDPGTCState

    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=TIMEOUT)
    state = HSDPGTCState(dist.group.WORLD, tau="auto", target_density=0.05, coding="rice", per_step_tau=True)
    g = torch.Generator().manual_seed(rank)
    steps = []
    for _ in range(3):
        given = torch.randn(4096, generator=g) * (1 + 9 * rank)  # replica 1's steps are 10x larger
        before = state.slots["m"].residual.clone() if "m" in state.slots else torch.zeros(4096)
        output = given.clone()
        state.reduce("m", output)
        sent = before + given - state.slots["m"].residual  # what this replica's words were worth: ±tau_r
        both = [torch.empty(4096) for _ in range(2)]
        dist.all_gather(both, sent)
        steps.append({"output": output, "sent": both, "tau": state.slots["m"].tau})
    torch.save(steps, out / f"rank{rank}.pt")
    dist.destroy_process_group()


def test_per_step_tau_decodes_each_replicas_words_at_its_own_tau(tmp_path):
    """Each replica thresholds at its own measured tau (10x apart here) and sends it in its header; the
    decoded shard is the mean of what the replicas' words were worth, bit-identical on both, and each
    replica sends about the target density."""
    from _strategy_helpers import run_ranks

    run_ranks(_reduce_at_own_taus, 2, tmp_path, timeout=60)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for a, b in zip(*ranks):
        assert torch.equal(a["output"], b["output"])
        torch.testing.assert_close(a["output"], (a["sent"][0] + a["sent"][1]) / 2, atol=1e-6, rtol=1e-6)
        assert 5 < b["tau"] / a["tau"] < 20
        for sent in a["sent"]:
            assert 0.02 < (sent != 0).float().mean() < 0.1


# ---- two processes sharing one device over gloo, as tests/test_cuda.py runs them on cuda:0 -------------


def two_process_main(rank: int, port: int, out: str, compress: str, accelerator: str) -> None:
    """One rank of two (``replicate_size=2`` x ``shard_size=1``), launched by :func:`launch_two` as a
    process of its own, on ``accelerator`` (``"gpu"``: both ranks on cuda:0 over gloo, since NCCL refuses
    two ranks on one device): 6 steps of :class:`ShardedMLP` (each rank its own rows), its record in
    ``rank{r}.pt`` as the forked tests write it."""
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODE_RANK=str(rank), LOCAL_RANK="0",
                      WORLD_SIZE="2", GLOBAL_RANK=str(rank))  # fmt: skip
    strategy = GTCHSDPStrategy(replicate_size=2, shard_size=1, process_group_backend="gloo", timeout=TIMEOUT,
                               tau="auto" if compress == "update" else 0.01, compress=compress)  # fmt: skip
    trainer = L.Trainer(
        accelerator=accelerator, devices=1, num_nodes=2, strategy=strategy, max_steps=6, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False,
    )  # fmt: skip
    model = ShardedMLP(Path(out), per_rank_data=True)
    trainer.fit(model)
    record = torch.load(Path(out) / f"rank{rank}.pt", weights_only=False)
    record["device"] = str(next(model.parameters()).device)
    torch.save(record, Path(out) / f"rank{rank}.pt")


def launch_two(out: Path, compress: str, accelerator: str) -> list[dict]:
    """:func:`two_process_main` in two new Python processes; their records, rank by rank."""
    import os
    import subprocess
    import sys

    from gtc_lightning.tools.bench_step import free_port

    out.mkdir(parents=True)
    tests = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests), str(tests.parent)])}
    if accelerator == "gpu":
        env["TRITON_INTERPRET"] = "0"
    code = "import sys, test_hsdp; a = sys.argv[1:]; test_hsdp.two_process_main(int(a[0]), int(a[1]), *a[2:])"
    port = free_port()
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(r), str(port), str(out), compress, accelerator],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(2)
    ]  # fmt: skip
    logs = [p.communicate(timeout=300)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def check_two_replicas(runs: list[dict]) -> None:
    """The two replicas of the one shard bit-identical after every step, finite, trained, GTC's steps sparse."""
    assert runs[0]["stats"]["sparse"] > 0
    for a, b in zip(runs[0]["records"], runs[1]["records"]):
        assert all(torch.equal(pa.cpu(), pb.cpu()) for pa, pb in zip(a["params"], b["params"]))
        assert all(torch.isfinite(p).all() for p in a["params"])
    first, last = runs[0]["records"][0]["params"], runs[0]["records"][-1]["params"]
    assert any(not torch.equal(a, b) for a, b in zip(first, last))


def test_two_processes_over_gloo_as_the_cuda_test_runs_them(tmp_path):
    """The launch of tests/test_cuda.py's gtc_hsdp test, on the CPU: two processes, a 2 x 1 mesh."""
    runs = launch_two(tmp_path / "update", "update", "cpu")
    assert [run["device"] for run in runs] == ["cpu", "cpu"]
    check_two_replicas(runs)
