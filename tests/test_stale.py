"""One-step-stale GTC (``GTCStrategy(stale=True)``, ``"gtc_stale"``) on 2 and 4 forked CPU ranks.

Each run records parameters, residuals and local gradients per batch (``_strategy_helpers.Recorder``);
the tests recompute Strom's step independently (``expected_sparse_step``) and check that step t's
parameters moved by step t-1's decoded update, bit for bit, on every rank.
"""

from pathlib import Path

import pytest
import torch
from _strategy_helpers import (
    expected_sparse_step,
    fit,
    keep_master_port,  # noqa: F401  (autouse)
    unscaled_grads,
)
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins import MixedPrecision

from gtc_lightning import GTCStrategy

TAU = 0.05
LR = 0.5
STEPS = 8
SGD = {"momentum": 0.0}  # the update is exactly -lr * decoded gradient


def check_stale_steps(ranks, grads=None, skipped=(), tau=TAU, start_update=None):
    """Every step against an independent computation: step t's parameters move by the update of the
    last step before t that was not skipped, step t's residuals are Strom's (``skipped`` steps, 1-based,
    change neither). ``grads[t]`` per rank overrides the recorded local gradients (accumulation);
    ``tau="recorded"``: each step's own tau as its statistics give it (automatic tau).

    Returns:
        the update still pending after the last step.
    """
    world, records = len(ranks), [rank["records"] for rank in ranks]
    params = ranks[0]["start"]["params"]
    residuals = [rank["start"]["residual"] for rank in ranks]
    pending = start_update
    steps = len(grads) if grads is not None else len(records[0])
    for t in range(steps):
        recs = [r[t] for r in records]
        last = recs[0]["stats"]["last"]
        if t + 1 in skipped:
            assert last["skipped"] and last["applied"] is None
        else:
            local = grads[t] if grads is not None else [rec["local_grad"] for rec in recs]
            step_tau = last["tau"] if tau == "recorded" else tau
            update, residuals, words = expected_sparse_step(residuals, local, step_tau)
            assert [rec["stats"]["last"]["words"] for rec in recs] == words, f"step {t + 1}"
            assert last["applied"] == (None if pending is None else pending[0]), f"step {t + 1}"
            if pending is not None:
                params = params.add(pending[1], alpha=-LR)
            pending = (last["step"], update)
        for r, rec in enumerate(recs):
            assert torch.equal(rec["params"], params), f"rank {r}: parameters differ after step {t + 1}"
            assert torch.equal(rec["residual"], residuals[r]), f"rank {r}: residual differs after step {t + 1}"
    assert world == records[0][-1]["stats"]["last"]["world_size"]
    return pending


@pytest.fixture(scope="module")
def stale_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("stale")
    checkpoint = ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=4, save_top_k=-1)
    return fit(
        out, tau=TAU, stale=True, check_replicas_every=1, model_kwargs=SGD,
        trainer_kwargs={"enable_checkpointing": True, "callbacks": [checkpoint]},
    )  # fmt: skip


def test_update_is_applied_exactly_one_step_late_on_identical_replicas(stale_run):
    """params(t) = params(t-1) - lr * update(t-1); step 1 applies nothing; residuals as Strom's."""
    _, ranks = stale_run
    assert len(ranks[0]["records"]) == STEPS
    first = ranks[0]["records"][0]
    assert torch.equal(first["params"], ranks[0]["start"]["params"]), "step 1 has nothing to apply"
    check_stale_steps(ranks)
    assert sum(rec["stats"]["last"]["words_all"] for rec in ranks[0]["records"]) > 0
    for rec in ranks[0]["records"]:
        last = rec["stats"]["last"]
        assert last["mode"] == "sparse" and last["bytes_sent"] == 24 + 4 * last["words"]


def test_the_last_update_is_pending_in_checkpoints_not_applied(stale_run, tmp_path):
    """The checkpoint after step 4 holds step 4's update (vote counts in parameter order); a fit that
    resumes from it applies it at step 5 and continues bit for bit as the uninterrupted run."""
    trainer, full = stale_run
    ckpt = next(p for p in (Path(trainer.default_root_dir) / "ckpt").glob("*step=4.ckpt"))
    pending = torch.load(ckpt, weights_only=False)["gtc"]["pending"]
    assert pending["step"] == 4 and pending["kind"] == "sparse" and pending["world"] == 2
    update = check_stale_steps(full, grads=[[r["records"][t]["local_grad"] for r in full] for t in range(4)])
    scale = torch.tensor(TAU, dtype=torch.float32) / 2
    assert torch.equal(pending["vector"] * scale, update[1])

    _, resumed = fit(tmp_path, tau=TAU, stale=True, model_kwargs=SGD, ckpt_path=str(ckpt))
    for rank in range(2):
        assert len(resumed[rank]["records"]) == 4
        for a, b in zip(resumed[rank]["records"], full[rank]["records"][4:]):
            assert a["step"] == b["step"] and a["stats"]["last"]["applied"] == b["stats"]["last"]["applied"]
            assert torch.equal(a["params"], b["params"]) and torch.equal(a["residual"], b["residual"])


@pytest.mark.parametrize("exchange", ["alltoall", "allgather"])
def test_rice_coded_stale_exchange_gives_the_same_bits_with_fewer_bytes(stale_run, tmp_path, exchange):
    """coding="rice" with stale=True: the coded bytes travel while the next step computes and are
    decoded when applied; every step's parameters, residuals and applied step equal the uncoded run's,
    with fewer bytes; the checkpoint's pending update is the same vector."""
    trainer, plain = stale_run
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)
    _, coded = fit(
        tmp_path, tau=TAU, stale=True, coding="rice", exchange=exchange, model_kwargs=SGD,
        trainer_kwargs={"enable_checkpointing": True, "callbacks": [checkpoint]},
    )  # fmt: skip
    for rank in range(2):
        for a, b in zip(plain[rank]["records"], coded[rank]["records"], strict=True):
            assert torch.equal(a["params"], b["params"]) and torch.equal(a["residual"], b["residual"])
            last_a, last_b = a["stats"]["last"], b["stats"]["last"]
            assert last_a["applied"] == last_b["applied"] and last_a["words"] == last_b["words"]
            if last_a["words"] > 8:
                assert last_b["bytes_sent"] < last_a["bytes_sent"], (last_a, last_b)
    assert sum(rec["stats"]["last"]["words"] > 8 for rec in plain[0]["records"]) >= STEPS // 2
    check_stale_steps(coded)
    saved = [torch.load(next((d / "ckpt").glob("*step=4.ckpt")), weights_only=False)["gtc"]["pending"]
             for d in (Path(trainer.default_root_dir), tmp_path)]
    assert saved[0]["step"] == saved[1]["step"] == 4 and torch.equal(saved[0]["vector"], saved[1]["vector"])


def test_automatic_tau_scales_each_update_with_the_tau_of_its_own_step(tmp_path):
    """tau="auto" with stale=True (and Rice coding): tau moves after every step, and the update applied
    at step t is step t-1's words times step t-1's tau; a fit resumed from the checkpoint after step 16,
    the end of the first epoch (its pending update saved with its tau), continues bit for bit."""
    kwargs = {"tau": "auto", "target_density": 0.02, "stale": True, "coding": "rice",
              "model_kwargs": {**SGD, "samples": 256}}  # fmt: skip
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=16, save_top_k=-1)
    _, full = fit(tmp_path / "full", trainer_kwargs={"enable_checkpointing": True, "callbacks": [checkpoint]},
                  **kwargs)  # fmt: skip
    taus = [rec["stats"]["last"]["tau"] for rec in full[0]["records"]]
    assert len(taus) == 32 and len(set(taus)) > 8, taus
    check_stale_steps(full, tau="recorded")
    ckpt = next((tmp_path / "ckpt").glob("*step=16.ckpt"))
    pending = torch.load(ckpt, weights_only=False)["gtc"]["pending"]
    assert pending["step"] == 16 and pending["tau32"] == float(torch.tensor(taus[15], dtype=torch.float32))
    assert taus[15] != taus[16], "tau did not move at the resumed step: the test would not see a wrong tau"
    _, resumed = fit(tmp_path / "resumed", ckpt_path=str(ckpt), **kwargs)
    for rank in range(2):
        for a, b in zip(resumed[rank]["records"], full[rank]["records"][16:], strict=True):
            assert a["stats"]["last"]["tau"] == b["stats"]["last"]["tau"]
            assert torch.equal(a["params"], b["params"]) and torch.equal(a["residual"], b["residual"])


@pytest.mark.parametrize(("exchange", "devices"), [("allgather", 4), ("alltoall", 2)])
def test_bucket_rebuild_under_the_exchange_in_flight(tmp_path, exchange, devices):
    """Many small buckets that DDP rebuilds after step 1, while step 1's words are in flight."""
    _, ranks = fit(
        tmp_path, devices=devices, tau=TAU, stale=True, exchange=exchange, bucket_cap_mb=0.0001, max_epochs=1,
        dense_fallback=False,
        model_kwargs={**SGD, "samples": 32 * devices},
    )  # fmt: skip
    buckets = [rec["buckets"] for rec in ranks[0]["records"]]
    assert buckets[0] == 1 and buckets[-1] > 1, buckets
    check_stale_steps(ranks)


def test_a_skipped_step_keeps_the_update_in_flight_for_the_next(tmp_path):
    """A NaN on rank 1 at optimizer step 3: step 3 applies and sends nothing, residuals unchanged;
    step 4 applies step 2's update, step 5 step 4's."""
    _, ranks = fit(tmp_path, tau=TAU, stale=True, model_kwargs={**SGD, "nan_on": (1, 2, 2)})
    check_stale_steps(ranks, skipped={3})
    applied = [rec["stats"]["last"]["applied"] for rec in ranks[0]["records"]]
    assert applied == [None, 1, None, 2, 4, 5, 6, 7]
    assert ranks[0]["records"][-1]["stats"]["total"]["skips"] == 1


def test_gradient_accumulation_applies_one_optimizer_step_late(tmp_path):
    _, ranks = fit(tmp_path, tau=TAU, stale=True, model_kwargs=SGD, trainer_kwargs={"accumulate_grad_batches": 2})
    assert [rec["step"] for rec in ranks[0]["records"]] == [0, 1, 1, 2, 2, 3, 3, 4]
    micro = [[rec["local_grad"] for rec in rank["records"]] for rank in ranks]
    grads = [[m[2 * t] + m[2 * t + 1] for m in micro] for t in range(4)]
    stepped = [{**rank, "records": rank["records"][1::2]} for rank in ranks]
    check_stale_steps(stepped, grads=grads)


def test_dense_fallback_is_applied_one_step_late(tmp_path):
    """tau small on 4 ranks: every step dense; step t applies the mean of step t-1's residual + gradient
    (the tau the threshold pass subtracted taken back: without it off by tau/4 * lr = 1e-3)."""
    _, ranks = fit(tmp_path, devices=4, tau=1e-2, stale=True, max_epochs=1, model_kwargs={**SGD, "samples": 128})
    params, pending = ranks[0]["start"]["params"], None
    for t in range(4):
        recs = [rank["records"][t] for rank in ranks]
        assert all(rec["stats"]["last"]["mode"] == "dense" for rec in recs)
        if pending is not None:
            params = params.add(pending, alpha=-LR)
        total = recs[0]["local_grad"].clone()
        for rec in recs[1:]:
            total = total + rec["local_grad"]
        pending = total / 4  # residuals restart from zero at every dense step
        for rec in recs:
            assert torch.allclose(rec["params"], params, rtol=0, atol=1e-6) and rec["residual"].abs().max() == 0
            assert torch.equal(rec["params"], recs[0]["params"])


def test_fp16_loss_scale_and_overflow_reach_the_scaler(tmp_path):
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    plugins = [MixedPrecision("16-mixed", "cpu", scaler=scaler)]
    _, ranks = fit(
        tmp_path, tau=TAU, stale=True, model_kwargs={**SGD, "nan_on": (1, 2, 2)}, trainer_kwargs={"plugins": plugins}
    )
    # Residuals, words and applied updates: Strom's on the unscaled local gradients, bit for bit.
    check_stale_steps(ranks, grads=unscaled_grads(ranks, 2.0**10), skipped=(3,))
    for rank in ranks:
        recs = rank["records"]
        assert torch.equal(recs[0]["params"], rank["start"]["params"])
        grad = (recs[0]["params"] - recs[1]["params"]) / LR  # step 1's update, applied at step 2
        votes = torch.round(grad / (TAU / 2))
        assert torch.allclose(grad, votes * (TAU / 2), atol=1e-5) and votes.abs().max() >= 1
        assert recs[2]["stats"]["last"]["skipped"] and recs[2]["scale"] == recs[1]["scale"] / 2
        assert torch.equal(recs[2]["params"], recs[1]["params"])
    for a, b in zip(ranks[0]["records"], ranks[1]["records"]):
        assert torch.equal(a["params"], b["params"])


def test_a_parameter_no_rank_uses_at_the_applying_step_still_gets_its_update(tmp_path):
    """``odd`` is used on odd global steps only: its words of step t arrive at step t+1, when DDP
    leaves its gradient None; conservation over the run must still hold."""
    from test_strategy import Branchy

    model = Branchy(momentum=0.0)
    _, ranks = fit(tmp_path, tau=0.02, stale=True, dense_fallback=False, model=model, find_unused_parameters=True)
    names = [name for name, _ in model.named_parameters()]
    bounds = torch.tensor([0, *ranks[0]["numels"]]).cumsum(0).tolist()
    odd = slice(bounds[names.index("odd.weight")], bounds[names.index("odd.bias") + 1])
    for a, b in zip(ranks[0]["records"], ranks[1]["records"]):
        assert torch.equal(a["params"], b["params"])
    # What the optimizer applied equals what went into the residuals minus what is left there and
    # what is still in flight (the last step's update, computed from the records).
    applied = (ranks[0]["start"]["params"].double() - ranks[0]["records"][-1]["params"].double()) / LR
    sent = sum(
        sum(rec["local_grad"].double() for rec in rank["records"]) - rank["records"][-1]["residual"].double()
        for rank in ranks
    ) / 2
    last = [rank["records"][-1] for rank in ranks]
    before = [rank["records"][-2]["residual"] for rank in ranks]
    in_flight, _, _ = expected_sparse_step(before, [rec["local_grad"] for rec in last], 0.02)
    assert torch.allclose(applied, sent - in_flight.double(), atol=1e-5), float((applied - sent + in_flight).abs().max())
    assert (applied[odd].abs() > 0).any()


def test_several_optimizers_are_refused(tmp_path):
    from test_strategy import ManualTwoOptimizers

    with pytest.raises(Exception, match=r"stale=True.*2 optimizers"):
        fit(tmp_path, tau=TAU, stale=True, model=ManualTwoOptimizers(), find_unused_parameters=True)


@pytest.mark.parametrize("name", ["gtc_stale", "gtc_stale_spawn", "gtc_stale_fork", "gtc_stale_fork_find_unused_parameters_true"])
def test_registered_names(name):
    import lightning as L

    trainer = L.Trainer(strategy=name, accelerator="cpu", devices=2, logger=False, enable_progress_bar=False)
    assert isinstance(trainer.strategy, GTCStrategy) and trainer.strategy.stale


def test_bad_stale_value_is_refused():
    with pytest.raises(ValueError, match="stale"):
        GTCStrategy(stale="yes")
