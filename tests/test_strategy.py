"""GTCStrategy end to end: 2- and 4-process CPU/gloo training started by fork (a second or two a run).

Each run's ranks record parameters, residuals, their local gradients and statistics per batch (see
``_strategy_helpers.Recorder``); the tests recompute what Strom's algorithm must have applied from
those records, independently of the package, and compare bit for bit.
"""

import csv
import math
import pickle
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
from _strategy_helpers import (
    TinyMLP,
    expected_sparse_step,
    fit,
    keep_master_port,  # noqa: F401  (autouse: the fork launcher sets MASTER_PORT)
    unscaled_grads,
)
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins import MixedPrecision

from gtc_lightning import GTCState, GTCStrategy
from gtc_lightning.algorithms.common import allreduce_bytes
from gtc_lightning.algorithms.gtc.config import FALLBACK_ENTER, FALLBACK_EXIT

TAU = 0.05
WORLD = 2
STEPS = 8  # 2 epochs x 4 batches per rank
LR = 0.5


@pytest.fixture(scope="module")
def gtc_run(tmp_path_factory):
    """Plain SGD (no momentum), so that each update is exactly ``-lr * decoded gradient``."""
    out = tmp_path_factory.mktemp("gtc")
    logger = CSVLogger(save_dir=out, name="csv")
    return fit(out, tau=TAU, check_replicas_every=1, model_kwargs={"momentum": 0.0}, trainer_kwargs={"logger": logger})


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


def check_sparse_steps(ranks, tau=TAU, lr=LR, steps=None):
    """Every step of a momentum-free SGD run against :func:`expected_sparse_step`, bit for bit:
    the applied update, each rank's new residual, each rank's word count."""
    world = len(ranks)
    params = ranks[0]["start"]["params"]
    residuals = [rank["start"]["residual"] for rank in ranks]
    for t in range(len(ranks[0]["records"]) if steps is None else steps):
        recs = [rank["records"][t] for rank in ranks]
        update, new, words = expected_sparse_step(residuals, [rec["local_grad"] for rec in recs], tau)
        params = params.add(update, alpha=-lr)  # what torch.optim.SGD does without momentum
        for r, rec in enumerate(recs):
            assert torch.equal(rec["params"], params), f"rank {r}: parameters differ after step {t + 1}"
            assert torch.equal(rec["residual"], new[r]), f"rank {r}: residual differs after step {t + 1}"
            assert rec["stats"]["last"]["words"] == words[r], f"rank {r}, step {t + 1}"
        assert sum(words) == recs[0]["stats"]["last"]["words_all"]
        assert world == recs[0]["stats"]["last"]["world_size"]
        residuals = new
    return params


def test_applied_update_is_strom_step_computed_independently(gtc_run):
    """params(t) = params(t-1) - lr * tau/N * (#plus - #minus) and r(t) = r + g -/+ tau, recomputed
    from the recorded local gradients: a hook that zeroes or garbles the gradient fails here."""
    _, ranks = gtc_run
    assert len(ranks[0]["records"]) == STEPS
    check_sparse_steps(ranks)
    votes = sum(rec["stats"]["last"]["words_all"] for rec in ranks[0]["records"])
    assert votes > 0, "tau too large for the test: nothing was ever sent"


def test_replicas_stay_bit_identical_and_loss_goes_down(gtc_run):
    _, ranks = gtc_run
    for step, (p0, p1) in enumerate(zip(*_records(ranks, "params")), start=1):
        assert torch.equal(p0, p1), f"replicas differ after step {step}"
    # Ranks see different data, so their residuals differ, while the parameters don't.
    assert not torch.equal(ranks[0]["records"][-1]["residual"], ranks[1]["records"][-1]["residual"])
    losses = torch.tensor(_records(ranks, "loss"))  # [rank, step]
    first, last = losses[:, : STEPS // 2].mean(), losses[:, STEPS // 2 :].mean()
    assert last < 0.9 * first, f"mean loss went from {first:.3f} to {last:.3f}"


def test_bytes_are_counted_as_the_collectives_send_them(gtc_run):
    """all-to-all: header (W-1)*24 bytes + own words * 4 * (W-1); received: the others' words."""
    trainer, ranks = gtc_run
    numel = sum(p.numel() for p in TinyMLP().parameters())
    for rank in range(WORLD):
        for rec in ranks[rank]["records"]:
            last = rec["stats"]["last"]
            own, everyone = last["words"], last["words_all"]
            assert last["mode"] == "sparse" and last["numel"] == numel
            assert last["bytes_sent"] == 24 * (WORLD - 1) + 4 * (WORLD - 1) * own
            assert last["bytes_received"] == 24 * (WORLD - 1) + 4 * (everyone - own)
            assert last["allreduce_fp32_bytes"] == 2 * (WORLD - 1) * 4 * numel // WORLD
            assert last["allreduce_bf16_bytes"] * 2 == last["allreduce_fp32_bytes"]
    total = ranks[0]["records"][-1]["stats"]["total"]
    assert total["bytes_sent"] == sum(rec["stats"]["last"]["bytes_sent"] for rec in ranks[0]["records"])
    assert total["ratio_fp32"] == total["allreduce_fp32_bytes"] / total["bytes_sent"]
    assert total["compress_s"] > 0 and total["exchange_s"] > 0 and total["skips"] == 0

    (metrics,) = Path(trainer.default_root_dir).rglob("metrics.csv")
    rows = list(csv.DictReader(metrics.read_text().splitlines()))
    logged = [row for row in rows if row.get("gtc/words")]
    assert len(logged) == STEPS
    keys = ["gtc/bytes_sent", "gtc/bytes_received", "gtc/ratio_fp32", "gtc/ratio_bf16", "gtc/exchange_s"]
    assert all(key in rows[0] for key in keys)
    last = ranks[0]["records"][-1]["stats"]["last"]
    assert float(logged[-1]["gtc/bytes_sent"]) == last["bytes_sent"]
    assert float(logged[-1]["gtc/ratio_bf16"]) == pytest.approx(last["allreduce_bf16_bytes"] / last["bytes_sent"])
    assert {"gtc_vs_fp32", "gtc_vs_bf16"} <= set(trainer.callback_metrics)  # rank 0's, sent back by fork


def test_padded_allgather_gives_the_same_bits_and_counts_its_padding(gtc_run, tmp_path):
    _, alltoall = gtc_run
    _, padded = fit(tmp_path, tau=TAU, exchange="allgather", model_kwargs={"momentum": 0.0})
    for a, b in zip(alltoall[0]["records"], padded[0]["records"]):
        assert torch.equal(a["params"], b["params"]) and torch.equal(a["residual"], b["residual"])
    for t, rec in enumerate(padded[0]["records"]):
        width = max(padded[r]["records"][t]["stats"]["last"]["words"] for r in range(WORLD))
        assert rec["stats"]["last"]["bytes_sent"] == 24 * (WORLD - 1) + 4 * (WORLD - 1) * width


@pytest.mark.parametrize("exchange", ["alltoall", "allgather"])
def test_rice_coded_exchange_gives_the_same_bits_with_fewer_bytes(gtc_run, tmp_path, exchange):
    _, plain = gtc_run
    _, coded = fit(tmp_path, tau=TAU, coding="rice", exchange=exchange, model_kwargs={"momentum": 0.0})
    for rank in range(WORLD):
        for a, b in zip(plain[rank]["records"], coded[rank]["records"]):
            assert torch.equal(a["params"], b["params"]) and torch.equal(a["residual"], b["residual"])
            assert a["stats"]["last"]["words"] == b["stats"]["last"]["words"]
            assert b["stats"]["last"]["bytes_sent"] < a["stats"]["last"]["bytes_sent"]


def test_triton_kernels_in_the_hook_match_the_torch_backend(gtc_run, tmp_path):
    """The hook on the Triton kernels (interpreted on CPU, as on CUDA) gives the same bits."""
    _, torch_backend = gtc_run
    _, triton_backend = fit(tmp_path, tau=TAU, backend="triton", max_epochs=1, model_kwargs={"momentum": 0.0})
    for rank in range(WORLD):
        for a, b in zip(torch_backend[rank]["records"], triton_backend[rank]["records"]):
            assert torch.equal(a["params"], b["params"])
            assert torch.equal(a["residual"], b["residual"])
            assert a["stats"]["last"]["words"] == b["stats"]["last"]["words"]


def test_four_ranks(tmp_path):
    _, ranks = fit(tmp_path, devices=4, tau=0.08, max_epochs=1, model_kwargs={"momentum": 0.0, "samples": 128})
    assert len(ranks[0]["records"]) == 4
    assert all(rec["stats"]["last"]["mode"] == "sparse" for rec in ranks[0]["records"])
    check_sparse_steps(ranks, tau=0.08)


def test_warmup_steps_are_dense_ddp_bit_for_bit(warmup_run, ddp_run):
    _, warm = warmup_run
    _, ddp = ddp_run
    for rank in range(WORLD):
        for i in range(2):
            assert torch.equal(warm[rank]["records"][i]["params"], ddp[rank]["records"][i]["params"])
            assert warm[rank]["records"][i]["stats"]["last"]["mode"] == "warmup"
            assert warm[rank]["records"][i]["residual"].abs().max() == 0
        assert warm[rank]["records"][2]["stats"]["last"]["mode"] == "sparse"
        assert not torch.equal(warm[rank]["records"][2]["params"], ddp[rank]["records"][2]["params"])
    assert warm[0]["records"][-1]["stats"]["total"]["warmup_steps"] == 2


def test_bucket_rebuild_keeps_residuals_with_their_parameters(gtc_run, tmp_path):
    """GTC is elementwise: one big bucket or many rebuilt ones must give the same bits."""
    _, one_bucket = gtc_run
    _, many = fit(tmp_path, tau=TAU, bucket_cap_mb=0.0001, model_kwargs={"momentum": 0.0})
    buckets = _records(many, "buckets")[0]
    assert buckets[0] == 1 and buckets[-1] > 1, f"expected DDP to rebuild 1 bucket into several, saw {buckets}"
    for rank in range(WORLD):
        for a, b in zip(one_bucket[rank]["records"], many[rank]["records"]):
            assert torch.equal(a["params"], b["params"])
            assert torch.equal(a["residual"], b["residual"])


def test_one_bucket_by_default_and_the_users_cap_kept():
    """GTCStrategy hands DDP a 1 GB bucket cap unless told otherwise (its hook's host work is per
    bucket); a cap the user gives, or LightningCLI's explicit None for "default", is respected."""
    from gtc_lightning.strategies.gtc import BUCKET_CAP_MB

    assert GTCStrategy()._ddp_kwargs["bucket_cap_mb"] == BUCKET_CAP_MB == 1024
    assert GTCStrategy(bucket_cap_mb=None)._ddp_kwargs["bucket_cap_mb"] == BUCKET_CAP_MB
    assert GTCStrategy(bucket_cap_mb=25)._ddp_kwargs["bucket_cap_mb"] == 25


class Branchy(TinyMLP):
    """TinyMLP plus two heads used only sometimes: ``odd`` on odd global steps (on every rank, so
    it is unused by all ranks on even steps; left out of a static graph, which DDP requires to be
    the same every step) and ``solo`` on rank 0 only (unused on rank 1, used by the world).
    Gradients are large against tau, so residuals beyond tau are left over."""

    def __init__(self, use_odd: bool = True, **kwargs):
        super().__init__(**kwargs)
        self.odd = torch.nn.Linear(16, 4)
        self.solo = torch.nn.Linear(16, 4)
        self.use_odd = use_odd

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.net(x)
        if self.use_odd and self.global_step % 2:
            out = out + self.odd(x)
        if self.global_rank == 0:
            out = out + self.solo(x)
        return torch.nn.functional.cross_entropy(out, y) * 20.0


@pytest.mark.parametrize("static_graph", [False, True], ids=["find_unused", "static_graph"])
def test_unused_parameters_lose_nothing(tmp_path, static_graph):
    """Conservation over the run for every element: what the optimizer applied equals the mean
    over ranks of (sum of local gradients - final residual). A word for a parameter no rank used
    would be dropped by DDP (grad None) and break it; an unused rank's residual must not move."""
    kwargs = {"static_graph": True} if static_graph else {"find_unused_parameters": True}
    model = Branchy(use_odd=not static_graph, momentum=0.0)
    _, ranks = fit(tmp_path, tau=0.02, model=model, **kwargs)
    for p0, p1 in zip(*_records(ranks, "params")):
        assert torch.equal(p0, p1)
    numels = ranks[0]["numels"]
    names = [name for name, _ in model.named_parameters()]
    bounds = torch.tensor([0, *numels]).cumsum(0).tolist()
    odd = slice(bounds[names.index("odd.weight")], bounds[names.index("odd.bias") + 1])
    solo = slice(bounds[names.index("solo.weight")], bounds[names.index("solo.bias") + 1])
    for rank in ranks:
        recs = rank["records"]
        for t in range(1, len(recs)):
            if not recs[t]["used"][names.index("odd.weight")]:
                assert torch.equal(recs[t]["residual"][odd], recs[t - 1]["residual"][odd]), f"step {t + 1}"
    assert torch.equal(ranks[1]["records"][-1]["residual"][solo], ranks[1]["start"]["residual"][solo])
    applied = (ranks[0]["start"]["params"].double() - ranks[0]["records"][-1]["params"].double()) / LR
    sent = sum(
        sum(rec["local_grad"].double() for rec in rank["records"]) - rank["records"][-1]["residual"].double()
        for rank in ranks
    ) / WORLD
    assert torch.allclose(applied, sent, atol=1e-5), float((applied - sent).abs().max())
    # The heads did learn: words were sent for them on the steps they were used.
    assert (applied[solo].abs() > 0).any()
    assert (applied[odd].abs() > 0).any() or static_graph


def test_resume_matches_uninterrupted_run(warmup_run, warmup_checkpoint, tmp_path):
    _, full = warmup_run
    saved = torch.load(warmup_checkpoint, weights_only=False)["gtc"]
    assert saved["world_size"] == WORLD and saved["step"] == 4 and "residuals" not in saved
    for rank in range(WORLD):
        shard = torch.load(f"{warmup_checkpoint}.gtc/rank{rank}.pt", weights_only=False)
        assert shard["rank"] == rank and shard["step"] == 4
        assert torch.equal(shard["residual"], full[rank]["records"][3]["residual"])

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


def test_resume_with_another_world_size_keeps_the_pending_update(warmup_checkpoint, tmp_path):
    """The pending update is the mean residual: 2 ranks' residuals become 1 rank's mean of them."""
    shards = [torch.load(f"{warmup_checkpoint}.gtc/rank{r}.pt", weights_only=False)["residual"] for r in range(2)]
    _, (single,) = fit(tmp_path, devices=1, tau=TAU, warmup_steps=2, ckpt_path=str(warmup_checkpoint))
    assert single["start"]["step"] == 4
    pending_before = (shards[0].double() + shards[1].double()) / 2
    assert torch.allclose(single["start"]["residual"].double(), pending_before, atol=1e-7)
    assert single["start"]["residual"].abs().max() > 0
    assert any("residuals of 2 ranks but this run has 1" in w and "mean" in w for w in single["warnings"])


def test_missing_shard_is_a_clear_error(warmup_checkpoint, tmp_path):
    import shutil

    copy = tmp_path / "copy.ckpt"
    shutil.copy(warmup_checkpoint, copy)
    (tmp_path / "copy.ckpt.gtc").mkdir()
    shutil.copy(f"{warmup_checkpoint}.gtc/rank0.pt", tmp_path / "copy.ckpt.gtc" / "rank0.pt")
    with pytest.raises(Exception, match=r"residual shard of rank 1 is missing: .*copy.ckpt.gtc/rank1.pt"):
        fit(tmp_path / "run", tau=TAU, warmup_steps=2, ckpt_path=str(copy))
    _, ranks = fit(tmp_path / "run2", tau=TAU, warmup_steps=2, restore_residuals=False, ckpt_path=str(copy))
    assert ranks[1]["start"]["step"] == 4 and ranks[1]["start"]["residual"].abs().max() == 0


def test_removed_checkpoints_take_their_shards_along(tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=1)
    fit(tmp_path, tau=TAU, max_epochs=1, trainer_kwargs={"enable_checkpointing": True, "callbacks": [checkpoint]})
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert files == ["epoch=0-step=4.ckpt", "epoch=0-step=4.ckpt.gtc"], files


def test_validate_with_a_checkpoint_then_fit_starts_fresh(warmup_checkpoint, tmp_path):
    """Only a fit that resumes may restore GTC's step counter and residuals (one process, so the
    strategy object is the one both calls use)."""
    from _strategy_helpers import Recorder

    recorder = Recorder(tmp_path)
    strategy = GTCStrategy(tau=TAU, warmup_steps=2, timeout=torch.distributed.constants.default_pg_timeout)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[recorder], default_root_dir=tmp_path,
        limit_val_batches=1,
    )  # fmt: skip
    model = TinyMLP()
    model.val_dataloader = model.train_dataloader
    model.validation_step = lambda batch, batch_idx: None
    try:
        trainer.validate(model, ckpt_path=str(warmup_checkpoint), verbose=False)
        trainer.fit(model)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    (rank0,) = [torch.load(tmp_path / "rank0.pt", weights_only=False)]
    assert rank0["start"]["step"] == 0 and rank0["start"]["residual"].abs().max() == 0
    assert rank0["records"][0]["stats"]["last"]["mode"] == "warmup"


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
        assert first["stats"]["last"]["mode"] == "warmup" and first["stats"]["last"]["skipped"]
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
    # The residuals and word counts are Strom's on the unscaled local gradients, bit for bit.
    residuals = [rank["start"]["residual"] for rank in ranks]
    for t, grads in enumerate(unscaled_grads(ranks, 2.0**10)):
        if t == 2:
            continue  # skipped: checked below
        _, residuals, words = expected_sparse_step(residuals, grads, TAU)
        for r, rank in enumerate(ranks):
            assert torch.equal(rank["records"][t]["residual"], residuals[r]), f"rank {r}, step {t + 1}"
            assert rank["records"][t]["stats"]["last"]["words"] == words[r]
    for rank in ranks:
        recs = rank["records"]
        grad = (rank["start"]["params"] - recs[0]["params"]) / LR
        votes = torch.round(grad / (TAU / WORLD))
        assert torch.allclose(grad, votes * (TAU / WORLD), atol=1e-5) and votes.abs().max() >= 1
        assert recs[2]["stats"]["last"]["skipped"]
        assert torch.equal(recs[2]["params"], recs[1]["params"])
        assert torch.equal(recs[2]["residual"], recs[1]["residual"])
        assert recs[2]["scale"] == recs[1]["scale"] / 2, "the scaler saw the overflow and backed off"
        assert torch.isfinite(recs[-1]["params"]).all()
    for p0, p1 in zip(*_records(ranks, "params")):
        assert torch.equal(p0, p1)


def test_fp16_scaler_overflows_are_the_scalers_not_divergence(tmp_path):
    """A too-large initial loss scale overflows every step at first: the scaler backs off, GTC
    neither warns about the learning rate nor aborts after max_consecutive_skips."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)
    plugins = [MixedPrecision("16-mixed", "cpu", scaler=scaler)]
    _, ranks = fit(tmp_path, tau=TAU, max_consecutive_skips=3, trainer_kwargs={"plugins": plugins})
    for rank in ranks:
        total = rank["records"][-1]["stats"]["total"]
        assert total["overflows"] >= 4 and total["skips"] == 0
        assert rank["records"][-1]["scale"] <= 2.0 ** (40 - 4)
        assert not any("non-finite" in w or "learning rate" in w for w in rank["warnings"])


@pytest.mark.parametrize("scale", ["sqrt_world", 1.0])
def test_gradient_clipping_acts_on_each_ranks_gradient_before_compression(tmp_path, scale):
    """A loss spike on rank 1 at step 2: clipped by norm before it enters rank 1's residual, at
    local_clip_scale times the Trainer's threshold (sqrt(2) on 2 ranks by default), so the residual
    stays small; the replicas stay identical; clipping changes the result."""
    spike = {"momentum": 0.0, "spike_on": (1, 1, 1e4)}
    sparse = {"tau": TAU, "dense_fallback": False, "model_kwargs": spike, "max_epochs": 1}  # the spike would go dense
    _, plain = fit(tmp_path / "plain", **sparse)
    _, clipped = fit(tmp_path / "clip", **sparse, local_clip_scale=scale, trainer_kwargs={"gradient_clip_val": 0.5})
    limit = 0.5 * (math.sqrt(WORLD) if scale == "sqrt_world" else scale)
    for p0, p1 in zip(*_records(clipped, "params")):
        assert torch.equal(p0, p1)
    raw = plain[1]["records"][1]
    assert raw["residual"].norm() > 100, "the spike went into the residual unclipped"
    rec = clipped[1]["records"][1]
    before = clipped[1]["records"][0]["residual"]
    # The residual grew by the clipped gradient minus what was sent: at most the limit in norm plus
    # tau per word sent.
    grown = (rec["residual"] - before).norm()
    assert grown <= limit + TAU * math.sqrt(rec["stats"]["last"]["words"]) + 1e-6
    assert grown > 0.5 * limit  # clipped at the limit, not below it (the spike is 1e4 times the gradient)
    assert not torch.equal(plain[0]["records"][-1]["params"], clipped[0]["records"][-1]["params"])


def test_gradient_clipping_by_value(tmp_path):
    spike = {"momentum": 0.0, "spike_on": (1, 1, 1e4)}
    _, ranks = fit(
        tmp_path, tau=TAU, model_kwargs=spike, max_epochs=1,
        trainer_kwargs={"gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"}, local_clip_scale=1.0,
    )  # fmt: skip
    for t in range(1, 4):
        grown = ranks[1]["records"][t]["residual"] - ranks[1]["records"][t - 1]["residual"]
        assert grown.abs().max() <= 0.01 + TAU + 1e-6


class PairsGTC(GTCStrategy):
    """Hands DDP (and so GTC) a process group of two of the four ranks: {0, 1} and {2, 3}."""

    def setup_distributed(self):
        super().setup_distributed()
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        self._ddp_kwargs["process_group"] = pairs[self.global_rank // 2]


def test_process_group_is_honoured(tmp_path):
    _, ranks = fit(
        tmp_path, strategy=PairsGTC, devices=4, tau=0.02, dense_fallback=False, max_epochs=1,
        model_kwargs={"momentum": 0.0, "samples": 128},
    )  # fmt: skip
    assert not torch.equal(ranks[0]["records"][-1]["params"], ranks[2]["records"][-1]["params"])
    for a, b in ((0, 1), (2, 3)):
        for ra, rb in zip(ranks[a]["records"], ranks[b]["records"]):
            assert torch.equal(ra["params"], rb["params"])
            assert ra["stats"]["last"]["world_size"] == 2
    check_sparse_steps(ranks[:2], tau=0.02)
    check_sparse_steps(ranks[2:], tau=0.02)


def test_dense_fallback_when_sparse_would_send_more(tmp_path):
    """A small tau on 4 ranks: most elements emit, (W-1)*4m > 2(W-1)/W*2n (a bf16 all-reduce), so
    every step goes dense: the update is the mean of every rank's residual + gradient (the tau the
    threshold pass subtracted taken back: a missing take-back would be off by tau/4 * lr = 1e-3),
    the residuals restart from zero, and the warning names tau and the density."""
    _, ranks = fit(tmp_path, devices=4, tau=1e-2, max_epochs=1, model_kwargs={"momentum": 0.0, "samples": 128})
    params = ranks[0]["start"]["params"]
    residuals = [rank["start"]["residual"] for rank in ranks]
    for t in range(4):
        recs = [rank["records"][t] for rank in ranks]
        assert all(rec["stats"]["last"]["mode"] == "dense" for rec in recs)
        total = residuals[0] + recs[0]["local_grad"]
        for r in range(1, 4):
            total = total + (residuals[r] + recs[r]["local_grad"])
        params = params.add(total / 4, alpha=-LR)
        for rec in recs:
            assert torch.allclose(rec["params"], params, rtol=0, atol=1e-6)
            assert rec["residual"].abs().max() == 0
            assert rec["stats"]["last"]["bytes_sent"] == 3 * 24 + allreduce_bytes(rec["stats"]["last"]["numel"], 4)
        residuals = [rec["residual"] for rec in recs]
        for p in recs[1:]:
            assert torch.equal(p["params"], recs[0]["params"])
    assert ranks[0]["records"][-1]["stats"]["total"]["dense_steps"] == 4
    assert sum("falling back to dense" in w and "tau=0.01" in w for w in ranks[0]["warnings"]) == 1


class LossSchedule(TinyMLP):
    """Every rank's loss times ``factors[global_step]``: the gradients' size, step by step."""

    def __init__(self, factors, **kwargs):
        super().__init__(**kwargs)
        self.factors = factors

    def training_step(self, batch, batch_idx):
        return self.loss(batch) * self.factors[self.global_step]


def test_dense_fallback_enters_and_leaves_without_flapping_at_two_ranks(tmp_path):
    """Large gradients, then middling (stays dense: hysteresis), then small (leaves), then middling
    again (stays sparse): the mode follows ENTER/EXIT exactly, changes twice, and fires at 2 ranks."""
    factors = [10, 10, 0.8, 0.3, 0.7, 0.7, 0.7, 0.7]
    _, ranks = fit(tmp_path, tau=TAU, model=LossSchedule(factors, momentum=0.0))
    lasts = [rec["stats"]["last"] for rec in ranks[0]["records"]]
    modes, shares = [last["mode"] for last in lasts], [last["share"] for last in lasts]
    dense = False
    for t, (mode, share) in enumerate(zip(modes, shares)):
        dense = share > (FALLBACK_EXIT if dense else FALLBACK_ENTER)
        assert mode == ("dense" if dense else "sparse"), f"step {t + 1}: {mode} at share {share:.3f}"
    assert modes == ["dense"] * 3 + ["sparse"] * 5, list(zip(modes, shares))
    assert FALLBACK_EXIT < shares[2] < FALLBACK_ENTER, "no step tested staying dense in between"
    assert any(FALLBACK_EXIT < s < FALLBACK_ENTER for s in shares[4:]), "no step tested staying sparse"
    for rank in ranks:
        assert rank["records"][2]["residual"].abs().max() == 0 and rank["records"][3]["residual"].abs().max() > 0


class ManualTwoOptimizers(TinyMLP):
    """Manual optimization with two optimizers, each toggled (Lightning's GAN pattern)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        first, second = self.optimizers()
        for opt in (first, second):
            self.toggle_optimizer(opt)
            loss = self.loss(batch)
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
            self.untoggle_optimizer(opt)
        return loss

    def configure_optimizers(self):
        return (
            torch.optim.SGD(self.net[0].parameters(), lr=self.lr),
            torch.optim.SGD(self.net[2].parameters(), lr=self.lr),
        )


def test_manual_optimization_with_two_optimizers(tmp_path):
    _, ranks = fit(tmp_path, tau=TAU, model=ManualTwoOptimizers(), find_unused_parameters=True)
    for p0, p1 in zip(*_records(ranks, "params")):
        assert torch.equal(p0, p1)
    last = ranks[0]["records"][-1]
    assert last["step"] == 2 * STEPS and last["stats"]["total"]["words"] > 0
    assert not torch.equal(last["params"], ranks[0]["start"]["params"])


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
    ("name", "start_method", "unused"),
    [
        ("gtc", "popen", False),
        ("gtc_spawn", "spawn", False),
        ("gtc_fork", "fork", False),
        ("gtc_notebook", "fork", False),
        ("gtc_find_unused_parameters_true", "popen", True),
        ("gtc_spawn_find_unused_parameters_true", "spawn", True),
        ("gtc_fork_find_unused_parameters_true", "fork", True),
        ("gtc_find_unused_parameters_false", "popen", False),
    ],
)
def test_registered_names_resolve_to_the_strategy(name, start_method, unused):
    trainer = L.Trainer(strategy=name, accelerator="cpu", devices=2, logger=False, enable_progress_bar=False)
    assert isinstance(trainer.strategy, GTCStrategy)
    assert trainer.strategy._start_method == start_method
    assert trainer.strategy._ddp_kwargs.get("find_unused_parameters", False) is unused


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
        ({"model_averaging_period": 4}, "own DDP communication hook"),
        ({"start_method": "thread"}, "start_method"),
        ({"exchange": "ring"}, "exchange"),
        ({"backend": "cuda"}, "backend"),
        ({"coding": "huffman"}, "coding"),
    ],
)
def test_bad_configuration_raises(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GTCStrategy(**kwargs)


def test_ddp_hook_arguments_given_as_none_are_accepted():
    """What LightningCLI does: every DDPStrategy argument passed explicitly, the hook ones None."""
    strategy = GTCStrategy(tau=0.01, ddp_comm_state=None, ddp_comm_hook=None, ddp_comm_wrapper=None,
                           model_averaging_period=None)  # fmt: skip
    assert strategy.tau == 0.01 and "ddp_comm_hook" not in strategy._ddp_kwargs


def test_finiteness_check_is_exact_when_the_sum_overflows():
    from gtc_lightning.algorithms.common import all_finite

    assert all_finite(torch.tensor([3e38, 3e38]))  # the sum overflows, the elements are finite
    assert not all_finite(torch.tensor([1.0, float("nan")]))
    assert not all_finite(torch.tensor([float("inf"), float("-inf")]))
    assert not all_finite(torch.tensor([-float("inf"), 0.0]))
    assert all_finite(torch.zeros(0))


def _header_rank(rank: int, world: int, store_path: str, exchange: str, queue) -> None:
    from gtc_lightning.algorithms.gtc import exchange as hook

    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        used = []

        def recording(name, fn):
            def call(*args, **kwargs):
                used.append(name)
                return fn(*args, **kwargs)

            return call

        hook.all_gather_equal = recording("allgather", hook.all_gather_equal)
        hook.dist.all_to_all_single = recording("alltoall", hook.dist.all_to_all_single)
        state = GTCState(dist.group.WORLD, TinyMLP().named_parameters(), tau=TAU, exchange=exchange)
        header = torch.tensor([rank % 2, 100 + rank, 4 * (100 + rank)], dtype=torch.int64)
        queue.put((rank, hook.send_header(state, header).tolist(), used))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("exchange", "collective"), [("auto", "alltoall"), ("alltoall", "alltoall"),
                                                      ("allgather", "allgather")])  # fmt: skip
def test_header_goes_to_every_rank_in_one_all_to_all_on_gloo(tmp_path, exchange, collective):
    """Every rank gets every rank's header in rank order; on gloo by one all-to-all (one message
    latency) unless the padded all-gather exchange was asked for."""
    ctx = torch.multiprocessing.get_context("fork")
    queue, world = ctx.Queue(), 3
    procs = [ctx.Process(target=_header_rank, args=(r, world, str(tmp_path / "store"), exchange, queue))
             for r in range(world)]  # fmt: skip
    for p in procs:
        p.start()
    results = sorted(queue.get(timeout=60) for _ in range(world))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    expected = [v for r in range(world) for v in (r % 2, 100 + r, 4 * (100 + r))]
    for _, headers, used in results:
        assert headers == expected and used == [collective]
