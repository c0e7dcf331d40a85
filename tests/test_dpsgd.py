"""D-PSGD (``DPSGDStrategy``, ``"dpsgd"``) on 2 and 4 forked CPU ranks.

Each run records every rank's parameters and local gradients per batch (``_strategy_helpers.Recorder``);
the tests recompute each step independently from those records: every rank's parameters after step k
are the average of its own and its ring neighbours' after step k-1, minus the learning rate times its
own gradient (plain SGD), bit for bit.
"""

import csv
import math
from pathlib import Path

import lightning as L
import pytest
import torch
from _averaging_helpers import Validated, check_checkpoints_hold_the_validated_mean, mean
from _strategy_helpers import (
    TinyMLP,
    fit,
    keep_master_port,  # noqa: F401  (autouse)
)
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from gtc_lightning import DPSGDStrategy

LR = 0.5
SGD = {"momentum": 0.0}


def neighbour_step(params: list[torch.Tensor], grads: list[torch.Tensor], lr: float = LR) -> list[torch.Tensor]:
    """D-PSGD's step computed from scratch: x_i + sum_j (x_j - x_i) / (neighbours + 1) - lr g_i over
    the ring neighbours j = i - 1, i + 1 (the one other rank when there are 2)."""
    world, out = len(params), []
    for i, x in enumerate(params):
        ring = [(i - 1) % world] if world == 2 else [(i - 1) % world, (i + 1) % world]
        diffs = [params[j] - x for j in ring]
        total = diffs[0]
        for d in diffs[1:]:
            total = total + d
        out.append((x + total / (len(ring) + 1)).add(grads[i], alpha=-lr))
    return out


def check_neighbour_steps(ranks: list[dict], steps: range | None = None, start: list | None = None) -> list:
    params = start if start is not None else [rank["start"]["params"] for rank in ranks]
    for t in steps if steps is not None else range(len(ranks[0]["records"])):
        params = neighbour_step(params, [rank["records"][t]["local_grad"] for rank in ranks])
        for i, rank in enumerate(ranks):
            assert torch.equal(rank["records"][t]["params"], params[i]), f"rank {i}: parameters after step {t + 1}"
        params = [rank["records"][t]["params"] for rank in ranks]
    return params


def spread(params: list[torch.Tensor]) -> float:
    center = sum(p.double() for p in params) / len(params)
    return math.sqrt(sum(float((p.double() - center).pow(2).mean()) for p in params) / len(params))


@pytest.fixture(scope="module")
def dpsgd_run(tmp_path_factory):
    """2 ranks, 2 epochs of 4 steps, validation after each, a checkpoint monitored on val_loss and
    one every 4 steps."""
    out = tmp_path_factory.mktemp("dpsgd")
    callbacks = [
        ModelCheckpoint(dirpath=out / "every", every_n_train_steps=4, save_top_k=-1),
        ModelCheckpoint(dirpath=out / "best", monitor="val_loss", save_top_k=1),
    ]
    trainer_kwargs = {
        "logger": CSVLogger(save_dir=out, name="csv"), "enable_checkpointing": True, "callbacks": callbacks,
        "num_sanity_val_steps": 0,
    }  # fmt: skip
    model = Validated(out, **SGD)
    return fit(out, strategy=DPSGDStrategy, model=model, trainer_kwargs=trainer_kwargs)


def test_each_step_averages_with_the_neighbour_then_steps_locally(dpsgd_run):
    _, ranks = dpsgd_run
    assert len(ranks[0]["records"]) == 8
    check_neighbour_steps(ranks)  # also through the validations after steps 4 and 8
    assert not torch.equal(ranks[0]["records"][-1]["params"], ranks[1]["records"][-1]["params"])


def test_bytes_and_spread_are_logged(dpsgd_run):
    trainer, ranks = dpsgd_run
    numel = ranks[0]["start"]["params"].numel()
    (metrics,) = Path(trainer.default_root_dir).rglob("metrics.csv")
    rows = [row for row in csv.DictReader(metrics.read_text().splitlines()) if row.get("dpsgd/bytes_sent")]
    assert len(rows) == 8
    for t, row in enumerate(rows):
        assert float(row["dpsgd/bytes_sent"]) == float(row["dpsgd/bytes_received"]) == 4 * numel  # one neighbour
        assert float(row["dpsgd/sync"]) == 1.0 and float(row["dpsgd/syncs"]) == t + 1
        expected = spread([rank["records"][t]["params"] for rank in ranks])
        assert float(row["dpsgd/spread"]) == pytest.approx(expected, rel=1e-4) and expected > 0
        assert float(row["dpsgd/distance"]) == pytest.approx(expected, rel=1e-4)  # 2 ranks: both at the same distance
    assert "dpsgd_spread" in trainer.callback_metrics


def test_validation_and_the_end_of_fit_see_the_average(dpsgd_run, tmp_path):
    trainer, ranks = dpsgd_run
    out = Path(trainer.default_root_dir)
    seen = [torch.load(out / f"seen{r}.pt") for r in range(2)]
    for k, t in enumerate((3, 7)):
        average = mean([rank["records"][t]["params"] for rank in ranks])
        assert torch.equal(seen[0][k], average) and torch.equal(seen[1][k], average)
    final = torch.cat([p.detach().reshape(-1) for p in trainer.lightning_module.parameters()])
    assert torch.equal(final, mean([rank["records"][-1]["params"] for rank in ranks])), "average_at_end"
    # The checkpoints hold the average (the model validated); their shards each rank's own.
    check_checkpoints_hold_the_validated_mean(out, "dpsgd", seen[0], ranks)


def test_resume_continues_every_rank_bit_for_bit(dpsgd_run, tmp_path):
    trainer, full = dpsgd_run
    ckpt = Path(trainer.default_root_dir) / "every" / "epoch=0-step=4.ckpt"
    _, resumed = fit(tmp_path, strategy=DPSGDStrategy, model=TinyMLP(**SGD), ckpt_path=str(ckpt))
    for r in range(2):
        assert torch.equal(resumed[r]["start"]["params"], full[r]["records"][3]["params"])
        for a, b in zip(resumed[r]["records"], full[r]["records"][4:]):
            assert torch.equal(a["params"], b["params"])


def test_four_ranks_average_with_left_and_right(tmp_path):
    _, ranks = fit(tmp_path, strategy=DPSGDStrategy, devices=4, max_epochs=1, model_kwargs={**SGD, "samples": 128})
    check_neighbour_steps(ranks)
    params = [rank["records"][-1]["params"] for rank in ranks]
    assert all(not torch.equal(params[0], p) for p in params[1:])


def test_warmup_steps_are_dense_and_identical(tmp_path):
    _, ranks = fit(tmp_path, strategy=DPSGDStrategy, warmup_steps=2, max_epochs=1, model_kwargs=SGD)
    for t in range(2):
        assert torch.equal(ranks[0]["records"][t]["params"], ranks[1]["records"][t]["params"])
    check_neighbour_steps(ranks, steps=range(2, 4), start=[rank["records"][1]["params"] for rank in ranks])


def test_one_rank_is_refused_as_the_trainer_is_built():
    with pytest.raises(ValueError, match="at least 2 ranks"):
        L.Trainer(strategy=DPSGDStrategy(), accelerator="cpu", devices=1, logger=False)


@pytest.mark.parametrize("name", ["dpsgd", "dpsgd_spawn", "dpsgd_fork", "dpsgd_fork_find_unused_parameters_true"])
def test_registered_names(name):
    trainer = L.Trainer(strategy=name, accelerator="cpu", devices=2, logger=False, enable_progress_bar=False)
    assert isinstance(trainer.strategy, DPSGDStrategy)


@pytest.mark.parametrize(("kwargs", "message"), [({"warmup_steps": -1}, "warmup_steps"),
                                                 ({"ddp_comm_hook": print}, "own DDP communication hook")])
def test_bad_configuration_raises(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DPSGDStrategy(**kwargs)


def test_neighbour_exchange_posts_every_receive_before_any_send(monkeypatch):
    """gloo serialises two ranks that send to each other before receiving (about twice the wire time
    on an emulated 100 Mbit/s link); the exchange posts its receives first, with one buffer a neighbour.
    (P2POp recorded as built: a real one needs a process group.)"""
    from types import SimpleNamespace

    import torch.distributed as dist

    from gtc_lightning.algorithms.averaging.dpsgd import neighbour_ops

    monkeypatch.setattr(dist, "P2POp", lambda op, tensor, peer, group=None: SimpleNamespace(
        op=op, tensor=tensor, peer=peer))
    sent, received = torch.zeros(4), [torch.zeros(4), torch.zeros(4)]
    ops = neighbour_ops(sent, received, [3, 1])
    assert [(op.op, op.peer) for op in ops] == [(dist.irecv, 3), (dist.irecv, 1), (dist.isend, 3), (dist.isend, 1)]
    assert ops[0].tensor is received[0] and ops[1].tensor is received[1] and ops[2].tensor is sent
