"""Automatic tau: the controller's arithmetic by hand, and 2-rank runs in which tau adapts to a
target density with bit-identical replicas, bounded steps and a bit-exact resume."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from _strategy_helpers import (
    TinyMLP,
    fit,
    keep_master_port,  # noqa: F401  (autouse: the fork launcher sets MASTER_PORT)
)
from lightning.pytorch.callbacks import ModelCheckpoint

from gtc_lightning.algorithms.gtc.auto_tau import SLOPE, TauController

TARGET = 0.02


def test_controller_steps_by_hand():
    c = TauController(target_density=0.01, tau=1.0, gain=0.5, smoothing=0.5, max_change=2.0)
    # First measurement is taken as it is: log(0.04 / 0.01) * 0.5 / 1.6 = 0.4332 -> tau * e**0.4332.
    assert c.update(0.04) == pytest.approx(math.exp(0.5 * math.log(4) / SLOPE))
    # EMA (0.04 + 0.01) / 2 = 0.025.
    tau = c.tau
    assert c.update(0.01) == pytest.approx(tau * math.exp(0.5 * math.log(2.5) / SLOPE))
    # A huge error moves tau by at most max_change, either way.
    fast = TauController(target_density=0.01, tau=1.0, gain=1.0, smoothing=1.0, max_change=2.0)
    assert fast.update(1e-9) == 0.5
    assert fast.update(0.9) == 1.0
    restored = TauController(target_density=0.5, tau=9.0)
    restored.load_state_dict(c.state_dict())
    assert restored == c


@pytest.mark.parametrize("bad", [0.0, 1.0, -0.1])
def test_bad_target_density(bad):
    with pytest.raises(ValueError, match="target_density"):
        TauController(target_density=bad, tau=1.0)


def test_auto_without_a_target_aims_at_the_default_density():
    import torch.distributed as dist

    from gtc_lightning import GTCState
    from gtc_lightning.algorithms.gtc.config import DEFAULT_DENSITY

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        state = GTCState(None, TinyMLP().named_parameters(), tau="auto")
        assert state.target_density == DEFAULT_DENSITY and state.controller.target_density == DEFAULT_DENSITY
        assert GTCState(None, TinyMLP().named_parameters(), tau=0.01).controller is None  # a fixed tau stays fixed
    finally:
        dist.destroy_process_group()


def test_tau_tracks_the_target_density(tmp_path):
    _, ranks = fit(
        tmp_path, tau="auto", target_density=TARGET, max_epochs=1,
        model_kwargs={"samples": 1024, "momentum": 0.0, "lr": 0.2},
    )  # fmt: skip
    recs = ranks[0]["records"]
    assert len(recs) == 64
    for p0, p1 in zip(ranks[0]["records"], ranks[1]["records"]):
        assert torch.equal(p0["params"], p1["params"])
    taus = [rec["stats"]["last"]["tau"] for rec in recs]
    numel = recs[0]["stats"]["last"]["numel"]
    first = recs[0]["stats"]["last"]["words_all"] / (2 * numel)
    assert taus[0] != 1e-2 and TARGET / 1.5 < first < TARGET * 1.5, "the first step's tau was not measured"
    for a, b in itertools.pairwise(taus):
        assert 1 / 1.1 - 1e-9 <= b / a <= 1.1 + 1e-9
    late = [rec["stats"]["last"]["words_all"] / (2 * numel) for rec in recs[-16:]]
    density = sum(late) / len(late)
    assert TARGET / 2 < density < TARGET * 2, (density, taus[-1])
    assert abs(math.log(max(taus) / min(taus))) > 0.2, "tau never moved: the test does not exercise the controller"


class Scaled(TinyMLP):
    """The loss times 1e-3: gradients a thousand times smaller than TinyMLP's."""

    def training_step(self, batch, batch_idx):
        return self.loss(batch) * 1e-3


def test_automatic_tau_presumes_no_gradient_scale(tmp_path):
    """Gradients 1000x smaller: tau="auto" sends about the target density from its first step (it used
    to start at 1e-2 and send nothing for tens of steps)."""
    _, ranks = fit(tmp_path, tau="auto", target_density=TARGET, max_epochs=1,
                   model=Scaled(samples=256, momentum=0.0, lr=0.2))  # fmt: skip
    numel = ranks[0]["records"][0]["stats"]["last"]["numel"]
    densities = [rec["stats"]["last"]["words_all"] / (2 * numel) for rec in ranks[0]["records"]]
    assert all(TARGET / 5 < d < TARGET * 5 for d in densities), densities
    assert ranks[0]["records"][0]["stats"]["last"]["tau"] < 1e-3


def test_auto_tau_resumes_bit_exactly(tmp_path):
    kwargs = {"tau": "auto", "target_density": TARGET, "model_kwargs": {"samples": 256, "momentum": 0.0}}
    _, full = fit(tmp_path / "full", max_epochs=2, **kwargs)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    fit(tmp_path / "a", max_epochs=1, trainer_kwargs={"enable_checkpointing": True, "callbacks": [checkpoint]}, **kwargs)
    _, resumed = fit(tmp_path / "b", max_epochs=2, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"), **kwargs)
    half = len(full[0]["records"]) // 2
    for rank in range(2):
        for a, b in zip(resumed[rank]["records"], full[rank]["records"][half:]):
            assert a["stats"]["last"]["tau"] == b["stats"]["last"]["tau"]
            assert torch.equal(a["params"], b["params"]) and torch.equal(a["residual"], b["residual"])


def test_a_fixed_tau_that_sends_nothing_is_named(tmp_path):
    """A fixed tau far above gradients 1000x smaller: no word for 20 steps is warned about once, with
    tau and the fix."""
    _, ranks = fit(tmp_path, tau=1e-2, max_epochs=1, model=Scaled(samples=512, momentum=0.0))
    assert all(rec["stats"]["last"]["words_all"] == 0 for rec in ranks[0]["records"])
    warned = [w for w in ranks[0]["warnings"] if "no rank sent a word for 20 optimizer steps" in w]
    assert len(warned) == 1 and "tau=0.01" in warned[0] and "tau='auto'" in warned[0]
