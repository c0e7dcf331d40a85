"""GTCStrategy end to end: 2-process CPU/gloo training started by fork (about a second per run).

Each run's ranks record parameters, residuals and statistics per batch (see
``_strategy_helpers.Recorder``); the tests compare those records across ranks and runs.
"""

import csv
import os
import pickle
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
from _strategy_helpers import TinyMLP, fit
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins import MixedPrecision

from gtc_lightning import GTCState, GTCStrategy

TAU = 0.05
WORLD = 2
STEPS = 8  # 2 epochs x 4 batches per rank


@pytest.fixture(scope="module", autouse=True)
def _keep_master_port():
    # The fork launcher writes MASTER_PORT into the parent's environment; don't leak it.
    before = os.environ.get("MASTER_PORT")
    yield
    if before is None:
        os.environ.pop("MASTER_PORT", None)
    else:
        os.environ["MASTER_PORT"] = before


@pytest.fixture(scope="module")
def gtc_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gtc")
    logger = CSVLogger(save_dir=out, name="csv")
    return fit(out, tau=TAU, check_replicas_every=1, trainer_kwargs={"logger": logger})


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    return fit(tmp_path_factory.mktemp("ddp"), strategy="ddp")


@pytest.fixture(scope="module")
def warmup_run(tmp_path_factory):
    return fit(tmp_path_factory.mktemp("warmup"), tau=TAU, warmup_steps=2)


@pytest.fixture(scope="module")
def warmup_checkpoint(tmp_path_factory):
    """The first epoch (4 steps, 2 of them dense) of ``warmup_run``, checkpointed at its end."""
    out = tmp_path_factory.mktemp("part1")
    checkpoint = ModelCheckpoint(dirpath=out / "ckpt", save_last=True)
    fit(
        out,
        tau=TAU,
        warmup_steps=2,
        max_epochs=1,
        trainer_kwargs={"enable_checkpointing": True, "callbacks": [checkpoint]},
    )
    return out / "ckpt" / "last.ckpt"


def _records(ranks, key):
    return [[rec[key] for rec in rank["records"]] for rank in ranks]


def test_replicas_stay_bit_identical_and_loss_goes_down(gtc_run):
    _, ranks = gtc_run
    params = _records(ranks, "params")
    assert len(params[0]) == STEPS
    for step, (p0, p1) in enumerate(zip(*params), start=1):
        assert torch.equal(p0, p1), f"replicas differ after step {step}"
    # Ranks see different data, so their residuals differ, while the parameters don't.
    assert not torch.equal(ranks[0]["records"][-1]["residual"], ranks[1]["records"][-1]["residual"])
    losses = torch.tensor(_records(ranks, "loss"))  # [rank, step]
    first, last = losses[:, : STEPS // 2].mean(), losses[:, STEPS // 2 :].mean()
    assert last < 0.8 * first, f"mean loss went from {first:.3f} to {last:.3f}"


def test_first_update_is_quantised_to_tau_over_world_size(gtc_run):
    _, ranks = gtc_run
    lr = TinyMLP().lr
    # First SGD step with momentum: p1 = p0 - lr * g, and g is tau/N times an integer vote count.
    grad = (ranks[0]["start"]["params"] - ranks[0]["records"][0]["params"]) / lr
    votes = torch.round(grad / (TAU / WORLD))
    assert torch.allclose(grad, votes * (TAU / WORLD), atol=1e-5)
    assert votes.abs().max() <= WORLD and votes.abs().max() >= 1
    stats = ranks[0]["records"][0]["stats"]["last"]
    assert int((votes != 0).sum()) <= stats["words_all"]


def test_update_differs_from_dense_ddp(gtc_run, ddp_run):
    _, gtc = gtc_run
    _, ddp = ddp_run
    for p0, p1 in zip(*_records(ddp, "params")):
        assert torch.equal(p0, p1)
    assert not torch.equal(gtc[0]["records"][0]["params"], ddp[0]["records"][0]["params"])
    assert torch.equal(gtc[0]["start"]["params"], ddp[0]["start"]["params"])


def test_warmup_steps_are_dense_ddp_bit_for_bit(warmup_run, ddp_run):
    _, warm = warmup_run
    _, ddp = ddp_run
    for rank in range(WORLD):
        for i in range(2):
            assert torch.equal(warm[rank]["records"][i]["params"], ddp[rank]["records"][i]["params"])
            assert warm[rank]["records"][i]["stats"]["last"]["dense"]
            assert warm[rank]["records"][i]["residual"].abs().max() == 0
        assert not warm[rank]["records"][2]["stats"]["last"]["dense"]
        assert not torch.equal(warm[rank]["records"][2]["params"], ddp[rank]["records"][2]["params"])
    assert warm[0]["records"][-1]["stats"]["total"]["dense_steps"] == 2


def test_statistics_are_logged(gtc_run):
    trainer, ranks = gtc_run
    last = [rank["records"][-1]["stats"] for rank in ranks]
    # Everybody receives every word: the all-rank count agrees, and is the sum of the ranks' own.
    assert last[0]["last"]["words_all"] == last[1]["last"]["words_all"]
    assert last[0]["last"]["words_all"] == last[0]["last"]["words"] + last[1]["last"]["words"]
    per_step = [rec["stats"]["last"]["words"] for rec in ranks[0]["records"]]
    assert last[0]["total"]["words"] == sum(per_step) > 0
    assert last[0]["last"]["ratio"] == last[0]["last"]["dense_bytes"] / last[0]["last"]["bytes_sent"]
    assert last[0]["last"]["dense_bytes"] == 4 * sum(p.numel() for p in TinyMLP().parameters())
    assert last[0]["total"]["compress_s"] > 0 and last[0]["total"]["skips"] == 0

    (metrics,) = Path(trainer.default_root_dir).rglob("metrics.csv")
    rows = list(csv.DictReader(metrics.read_text().splitlines()))
    keys = ["gtc/words", "gtc/words_all", "gtc/bytes_sent", "gtc/dense_bytes", "gtc/ratio", "gtc/compress_s"]
    logged = [row for row in rows if row.get("gtc/words")]
    assert len(logged) == STEPS
    assert all(key in rows[0] for key in keys + ["gtc/decompress_s", "gtc/skips"])
    assert float(logged[-1]["gtc/words"]) == last[0]["last"]["words"]
    assert "gtc_ratio" in trainer.progress_bar_metrics or "gtc_ratio" in trainer.callback_metrics


def test_bucket_rebuild_keeps_residuals_with_their_parameters(gtc_run, tmp_path):
    """GTC is elementwise: one big bucket or many rebuilt ones must give the same bits."""
    _, one_bucket = gtc_run
    _, many = fit(tmp_path, tau=TAU, bucket_cap_mb=0.0001)  # ~100 bytes: one parameter or two per bucket
    buckets = _records(many, "buckets")[0]
    assert buckets[0] == 1 and buckets[-1] > 1, (
        f"expected DDP to rebuild 1 bucket into several, saw {buckets}"
    )
    for rank in range(WORLD):
        for a, b in zip(one_bucket[rank]["records"], many[rank]["records"]):
            assert torch.equal(a["params"], b["params"])
            assert torch.equal(a["residual"], b["residual"])


def test_resume_matches_uninterrupted_run(warmup_run, warmup_checkpoint, tmp_path):
    _, full = warmup_run
    saved = torch.load(warmup_checkpoint, weights_only=False)["gtc"]
    assert saved["world_size"] == WORLD and saved["step"] == 4
    assert saved["residuals"].shape == (WORLD, sum(saved["numels"]))
    for rank in range(WORLD):
        assert torch.equal(saved["residuals"][rank], full[rank]["records"][3]["residual"])

    _, resumed = fit(tmp_path, tau=TAU, warmup_steps=2, ckpt_path=str(warmup_checkpoint))
    for rank in range(WORLD):
        assert resumed[rank]["start"]["step"] == 4
        assert torch.equal(resumed[rank]["start"]["residual"], full[rank]["records"][3]["residual"])
        after = resumed[rank]["records"]
        assert len(after) == 4
        for a, b in zip(after, full[rank]["records"][4:]):
            assert a["step"] == b["step"]
            assert torch.equal(a["params"], b["params"])
            assert torch.equal(a["residual"], b["residual"])


def test_resume_with_another_world_size_resets_residuals(warmup_checkpoint, tmp_path):
    _, (single,) = fit(tmp_path, devices=1, tau=TAU, warmup_steps=2, ckpt_path=str(warmup_checkpoint))
    assert single["start"]["step"] == 4
    assert single["start"]["residual"].abs().max() == 0
    assert any("residuals of 2 ranks but this run has 1" in w for w in single["warnings"]), single["warnings"]


def test_gradient_accumulation_exchanges_only_on_sync_steps(tmp_path):
    _, ranks = fit(tmp_path, tau=TAU, max_epochs=1, trainer_kwargs={"accumulate_grad_batches": 2})
    for rank in ranks:
        recs = rank["records"]
        assert [r["step"] for r in recs] == [0, 1, 1, 2]
        assert recs[0]["residual"].abs().max() == 0 and recs[0]["stats"]["last"] is None
        # The micro-step between two optimizer steps neither sends nor touches residuals.
        assert torch.equal(recs[2]["residual"], recs[1]["residual"])
        assert recs[2]["stats"]["total"]["words"] == recs[1]["stats"]["total"]["words"]
        assert recs[3]["stats"]["total"]["words"] > recs[2]["stats"]["total"]["words"]
    assert torch.equal(ranks[0]["records"][-1]["params"], ranks[1]["records"][-1]["params"])


def test_non_finite_gradient_on_one_rank_skips_the_step_everywhere(tmp_path):
    # global_step 2 is computed during the third optimizer step.
    _, ranks = fit(tmp_path, tau=TAU, model_kwargs={"nan_on": (1, 2, 2)})
    for rank in ranks:
        recs = rank["records"]
        skipped = recs[2]["stats"]["last"]
        assert skipped["skipped"] and skipped["bad_ranks"] == [1] and skipped["step"] == 3
        assert torch.equal(recs[2]["params"], recs[1]["params"])
        assert torch.equal(recs[2]["residual"], recs[1]["residual"])
        assert not torch.equal(recs[3]["params"], recs[2]["params"])
        assert recs[-1]["stats"]["total"]["skips"] == 1
        assert recs[-1]["stats"]["total"]["consecutive_skips"] == 0
    for p0, p1 in zip(*_records(ranks, "params")):
        assert torch.equal(p0, p1)
    assert any("non-finite gradient on rank(s) [1] at optimizer step 3" in w for w in ranks[0]["warnings"])


def test_non_finite_gradient_during_dense_warmup_skips_the_step(tmp_path):
    _, ranks = fit(tmp_path, tau=TAU, warmup_steps=2, max_epochs=1, model_kwargs={"nan_on": (1, 0, 0)})
    for rank in ranks:
        first = rank["records"][0]
        assert first["stats"]["last"]["dense"] and first["stats"]["last"]["skipped"]
        assert torch.equal(first["params"], rank["start"]["params"])
        assert not torch.equal(rank["records"][1]["params"], first["params"])
        assert torch.isfinite(rank["records"][-1]["params"]).all()
    assert any("in the averaged dense gradient at optimizer step 1" in w for w in ranks[0]["warnings"])


def test_fp16_loss_scaling_is_divided_out_and_skips_reach_the_scaler(tmp_path):
    # GradScaler multiplies gradients by 2**10: GTC must threshold the unscaled ones, and a
    # skipped step must reach the scaler as an overflow (NaN gradients), not as missing ones.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    plugins = [MixedPrecision("16-mixed", "cpu", scaler=scaler)]
    _, ranks = fit(tmp_path, tau=TAU, trainer_kwargs={"plugins": plugins}, model_kwargs={"nan_on": (1, 2, 2)})
    lr = TinyMLP().lr
    for rank in ranks:
        recs = rank["records"]
        grad = (rank["start"]["params"] - recs[0]["params"]) / lr
        votes = torch.round(grad / (TAU / WORLD))
        assert torch.allclose(grad, votes * (TAU / WORLD), atol=1e-5) and votes.abs().max() >= 1
        assert recs[2]["stats"]["last"]["skipped"]
        assert torch.equal(recs[2]["params"], recs[1]["params"])
        assert torch.equal(recs[2]["residual"], recs[1]["residual"])
        assert torch.isfinite(recs[-1]["params"]).all()
    for p0, p1 in zip(*_records(ranks, "params")):
        assert torch.equal(p0, p1)


def test_state_pickles_without_its_process_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = TinyMLP()
        state = GTCState(None, model.named_parameters(), tau=TAU, warmup_steps=3)
        state.load_residual_vector(torch.arange(sum(state.numels), dtype=torch.float32))
        state.process_group = dist.group.WORLD
        copy = pickle.loads(pickle.dumps(state))
        assert copy.process_group is None and copy.tau == TAU and copy.warmup_steps == 3
        assert torch.equal(copy.residual_vector(), state.residual_vector())
        copy.bind(model.named_parameters())
        assert copy.param_names == ["net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"]
    finally:
        dist.destroy_process_group()


def test_too_many_consecutive_skips_raise(tmp_path):
    with pytest.raises(Exception, match="3 consecutive skipped steps"):
        fit(tmp_path, tau=TAU, max_consecutive_skips=3, model_kwargs={"nan_on": (0, 1, 100)})


def test_replica_check_names_the_step_of_a_divergence(tmp_path):
    # Rank 1 nudges a weight after step 3; the check every 2 steps catches it after step 4.
    with pytest.raises(Exception, match=r"after optimizer step 4, rank\(s\) \[1\]"):
        fit(tmp_path, tau=TAU, check_replicas_every=2, model_kwargs={"perturb_on": (1, 3)})


@pytest.mark.parametrize(
    ("name", "start_method"), [("gtc", "popen"), ("gtc_spawn", "spawn"), ("gtc_fork", "fork")]
)
def test_registered_names_resolve_to_the_strategy(name, start_method):
    trainer = L.Trainer(strategy=name, accelerator="cpu", devices=2, logger=False, enable_progress_bar=False)
    assert isinstance(trainer.strategy, GTCStrategy)
    assert trainer.strategy._start_method == start_method


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tau": 0.0}, "tau"),
        ({"tau": -1.0}, "tau"),
        ({"tau": float("nan")}, "tau"),
        ({"tau": True}, "tau"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"warmup_steps": 1.5}, "warmup_steps"),
        ({"check_replicas_every": -2}, "check_replicas_every"),
        ({"max_consecutive_skips": 0}, "max_consecutive_skips"),
        ({"ddp_comm_hook": lambda state, bucket: None}, "own DDP communication hook"),
        ({"start_method": "thread"}, "start_method"),
    ],
)
def test_bad_configuration_raises(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GTCStrategy(**kwargs)


def test_finiteness_check_is_exact_when_the_sum_overflows():
    from gtc_lightning.hook import _all_finite

    assert _all_finite(torch.tensor([3e38, 3e38]))  # the sum overflows, the elements are finite
    assert not _all_finite(torch.tensor([1.0, float("nan")]))
    assert not _all_finite(torch.tensor([float("inf"), float("-inf")]))
    assert not _all_finite(torch.tensor([-float("inf"), 0.0]))
    assert _all_finite(torch.zeros(0))
