"""GTC's state survives every way a Lightning user calls it: a second ``trainer.fit``, a linked
``last.ckpt``, pickling, checkpoints without residuals, removal of old checkpoints by each rank,
an unfrozen parameter, a clipping override, bf16 buckets, and Fabric with every option.

Each test runs 2 CPU ranks started by fork and failed on the code before its fix."""

from __future__ import annotations

import pickle
from datetime import timedelta
from pathlib import Path

import lightning as L
import pytest
import torch
from _strategy_helpers import (
    TinyMLP,
    expected_sparse_step,
    fit,
    keep_master_port,  # noqa: F401  (autouse: the fork launcher sets MASTER_PORT)
    run_ranks,
)
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import BaseFinetuning, ModelCheckpoint

from gtc_lightning import GTCFabricStrategy, GTCStrategy

TAU, LR, WORLD = 0.05, 0.5, 2


def _final_state(strategy: GTCStrategy, model: L.LightningModule) -> dict:
    state = strategy.gtc_state
    flight = state._in_flight
    return {
        "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone(),
        "residual": state.residual_vector().clone(),
        "step": state.step,
        "tau": state.tau,
        "dense_mode": state._dense_mode,
        "pending": flight.vector_in(state.param_names, state.numels).clone() if flight is not None else None,
    }


def _two_fits(rank: int, out: Path, two: bool, options: dict) -> None:
    model = TinyMLP(momentum=0.0)  # no optimizer state: Lightning builds a new optimizer every fit
    strategy = GTCStrategy(timeout=timedelta(seconds=60), **options)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, num_nodes=WORLD, strategy=strategy, max_epochs=1 if two else 2,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model)
    if two:
        assert strategy.gtc_state.residual_vector().abs().sum() > 0
        trainer.fit_loop.max_epochs = 2
        trainer.fit(model)
    torch.save(_final_state(strategy, model), out / f"rank{rank}_{int(two)}.pt")


@pytest.mark.parametrize(
    "options",
    [
        {"tau": TAU, "warmup_steps": 2},
        {"tau": TAU, "stale": True},
        {"tau": "auto", "target_density": 0.05, "stale": True, "coding": "rice"},
    ],
    ids=["warmup", "stale", "auto-tau-rice-stale"],
)
def test_a_second_fit_continues_as_one_uninterrupted_fit(tmp_path, options):
    """Residuals, step counter (no second warm-up), automatic tau and the update in flight carry over."""
    for two in (False, True):
        run_ranks(_two_fits, WORLD, tmp_path, two, options)
    for rank in range(WORLD):
        one = torch.load(tmp_path / f"rank{rank}_0.pt", weights_only=False)
        two = torch.load(tmp_path / f"rank{rank}_1.pt", weights_only=False)
        assert two["step"] == one["step"] == 8
        assert two["tau"] == one["tau"]
        assert torch.equal(two["params"], one["params"]), "the second fit did not continue the first"
        assert torch.equal(two["residual"], one["residual"])
        if options.get("stale"):
            assert one["pending"] is not None and torch.equal(two["pending"], one["pending"])


def test_resume_from_a_linked_last_checkpoint(tmp_path):
    """``save_last="link"``: last.ckpt is a symlink; the shards are found beside its target."""
    full = fit(tmp_path / "full", tau=TAU, stale=True, model_kwargs={"momentum": 0.0})[1]
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last="link", save_top_k=-1)
    fit(tmp_path / "part", tau=TAU, stale=True, max_epochs=1, model_kwargs={"momentum": 0.0},
        trainer_kwargs={"enable_checkpointing": True, "callbacks": [checkpoint]})  # fmt: skip
    last = tmp_path / "ckpt" / "last.ckpt"
    assert last.is_symlink() and not Path(f"{last}.gtc").exists()
    _, resumed = fit(tmp_path / "resumed", tau=TAU, stale=True, model_kwargs={"momentum": 0.0}, ckpt_path=str(last))
    for rank in range(WORLD):
        assert torch.equal(resumed[rank]["start"]["residual"], full[rank]["records"][3]["residual"])
        assert torch.equal(resumed[rank]["records"][-1]["params"], full[rank]["records"][-1]["params"])


def test_restore_residuals_false_restores_no_pending_update(tmp_path):
    """A stale checkpoint's update in flight must not reach the residuals when they are not restored."""
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    fit(tmp_path / "part", tau=TAU, stale=True, max_epochs=1,
        trainer_kwargs={"enable_checkpointing": True, "callbacks": [checkpoint]})  # fmt: skip
    last = tmp_path / "ckpt" / "last.ckpt"
    assert torch.load(last, weights_only=False)["gtc"]["pending"] is not None
    for stale in (False, True):
        _, ranks = fit(tmp_path / f"resumed{stale}", tau=TAU, stale=stale, restore_residuals=False, ckpt_path=str(last))
        for rank in ranks:
            assert rank["start"]["step"] == 4
            assert rank["start"]["residual"].abs().max() == 0
            if stale:  # nothing in flight: the first step of the resumed fit applies nothing
                assert rank["records"][0]["stats"]["last"]["applied"] is None


class RemovalsIO(TorchCheckpointIO):
    """Records every removal, per rank, in a file beside the checkpoints."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir

    def remove_checkpoint(self, path) -> None:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else "main"
        with open(self.log_dir / f"removed{rank}.txt", "a") as f:
            f.write(f"{path}\n")
        super().remove_checkpoint(path)


def test_each_rank_removes_the_shard_it_wrote(tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=1)
    fit(tmp_path, tau=TAU, max_epochs=1, checkpoint_io=RemovalsIO(tmp_path),
        trainer_kwargs={"enable_checkpointing": True, "callbacks": [checkpoint]})  # fmt: skip
    for rank in range(WORLD):
        removed = (tmp_path / f"removed{rank}.txt").read_text().split()
        assert any(line.endswith(f"epoch=0-step=2.ckpt.gtc/rank{rank}.pt") for line in removed), removed
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert files == ["epoch=0-step=4.ckpt", "epoch=0-step=4.ckpt.gtc"], files


class PickledGTC(GTCStrategy):
    """After step 3, every rank's state goes through pickle and comes back (rebound to the model)."""

    def optimizer_step(self, *args, **kwargs):
        output = super().optimizer_step(*args, **kwargs)
        state = self._gtc_state
        if state.step == 3:
            copy = pickle.loads(pickle.dumps(state))
            copy.bind(self.lightning_module.named_parameters())
            copy.process_group = state.process_group
            state.__dict__.clear()
            state.__dict__.update(copy.__dict__)
        return output


@pytest.mark.parametrize("stale", [False, True], ids=["sync", "stale"])
def test_a_pickled_state_steps_on_as_the_original(tmp_path, stale):
    options = {"tau": "auto", "target_density": 0.05, "coding": "rice", "stale": stale}
    _, plain = fit(tmp_path / "plain", model_kwargs={"momentum": 0.0}, **options)
    _, pickled = fit(tmp_path / "pickled", strategy=PickledGTC, model_kwargs={"momentum": 0.0}, **options)
    for a, b in zip(plain, pickled):
        assert len(b["records"]) == 8
        for ra, rb in zip(a["records"], b["records"]):
            assert torch.equal(ra["params"], rb["params"]) and torch.equal(ra["residual"], rb["residual"])
            assert ra["stats"]["last"]["tau"] == rb["stats"]["last"]["tau"]


def test_options_are_checked_when_the_strategy_is_made():
    for cls in (GTCStrategy, GTCFabricStrategy):
        with pytest.raises(ValueError, match=r"target_density .*\(0, 1\).*got 5.0"):
            cls(target_density=5.0)
        with pytest.raises(ValueError, match=r"compress in .*got 'weights'"):
            cls(compress="weights")


class UnfreezeAtEpoch1(BaseFinetuning):
    def freeze_before_training(self, pl_module):
        self.freeze(pl_module.net[0])

    def finetune_function(self, pl_module, current_epoch, optimizer):
        if current_epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.net[0], optimizer, train_bn=True)


def test_a_parameter_unfrozen_during_fit_is_named(tmp_path):
    with pytest.raises(Exception, match=r"parameter 'net.0.weight' got a gradient but did not require one"):
        fit(tmp_path, tau=TAU, trainer_kwargs={"callbacks": [UnfreezeAtEpoch1()]})


class ClipsEverything(TinyMLP):
    """A user's clipping override that clips whatever it is given to 1e-6."""

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.clip_gradients(optimizer, gradient_clip_val=1e-6, gradient_clip_algorithm="value")


def test_a_clipping_override_does_not_clip_the_decoded_update(tmp_path):
    _, ranks = fit(tmp_path, tau=TAU, warmup_steps=1, max_epochs=1, model=ClipsEverything(momentum=0.0))
    first = ranks[0]["records"][0]
    moved = (first["params"] - ranks[0]["start"]["params"]).abs().max()
    assert moved <= LR * 1e-6 + 1e-7, f"warm-up: not clipped, moved {moved}"
    # Compressed steps: exactly -lr * tau/W * votes, as Strom's step computed independently.
    before = [rank["records"][0]["residual"] for rank in ranks]
    params = first["params"]
    for t in range(1, 4):
        recs = [rank["records"][t] for rank in ranks]
        update, before, _ = expected_sparse_step(before, [rec["local_grad"] for rec in recs], TAU)
        params = params.add(update, alpha=-LR)
        assert update.abs().max() >= TAU / WORLD
        for rec in recs:
            assert torch.equal(rec["params"], params)


class DecodedGrads(L.Callback):
    """The gradient each step hands the optimizer (the decoded update), per rank; zeros for none."""

    def __init__(self, out: Path) -> None:
        self.out, self.grads = out, []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads.append(
            torch.cat([
                (p.grad.detach().float() if p.grad is not None else torch.zeros_like(p, dtype=torch.float32)).reshape(-1)
                for p in pl_module.parameters()
            ])
        )  # fmt: skip

    def on_train_end(self, trainer, pl_module):
        torch.save(self.grads, self.out / f"grads{trainer.global_rank}.pt")


@pytest.mark.parametrize("stale", [False, True], ids=["sync", "stale"])
def test_bf16_buckets_feed_their_rounding_back_into_the_residuals(tmp_path, stale):
    """bf16 parameters: DDP's buckets are bf16 and round the decoded update; what they round off goes
    back into every rank's residual. Per step, over the ranks: the gradients, less what the residuals
    kept, less W times what the optimizer was handed, is tau times the step's vote sum less (stale)
    the previous step's, so the running vote sum ``S`` must stay integral. Without the feedback it is
    off by W times the rounding, ~2e-3 of a vote."""
    _, ranks = fit(tmp_path, tau=TAU, stale=stale, max_epochs=1, model_kwargs={"momentum": 0.0},
                   trainer_kwargs={"precision": "bf16-true", "callbacks": [DecodedGrads(tmp_path)]})  # fmt: skip
    grads = [torch.load(tmp_path / f"grads{r}.pt") for r in range(WORLD)]
    residuals = [rank["start"]["residual"].double() for rank in ranks]
    votes = torch.zeros_like(residuals[0])
    rounded = 0
    for t in range(4):
        recs = [rank["records"][t] for rank in ranks]
        applied = grads[0][t].double()
        assert torch.equal(grads[0][t], grads[1][t])
        kept = sum(rec["residual"].double() - r for rec, r in zip(recs, residuals))
        gradient = sum(rec["local_grad"].double() for rec in recs)
        step_votes = (gradient - kept - WORLD * applied) / TAU  # S_t (sync), S_t - S_{t-1} (stale)
        votes = votes + step_votes if stale else step_votes
        assert (votes - votes.round()).abs().max() < 2e-4, f"step {t + 1}: not integral, rounding lost"
        exact = (votes.round() if not stale else (votes - step_votes).round()) * (TAU / WORLD)
        rounded += int((exact.float() != applied.float()).sum())
        residuals = [rec["residual"].double() for rec in recs]
    assert rounded > 0, "no bf16 rounding happened: the test would not see a missing feedback"
