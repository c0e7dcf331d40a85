"""GTC for Lightning Fabric: 2 CPU ranks started by fork train a tiny MLP; every step is
recomputed independently (as in test_strategy.py), the skip decision, and fabric.save/load of the
residuals."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import lightning as L
import pytest
import torch
from _strategy_helpers import (
    CLASSES,
    FEATURES,
    HIDDEN,
    dataset,
    expected_sparse_step,
    keep_master_port,  # noqa: F401  (autouse: the fork launcher sets MASTER_PORT)
)

from gtc_lightning.strategies.fabric import GTCFabricStrategy

TAU, LR, STEPS, WORLD = 0.05, 0.5, 4, 2


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, CLASSES))


def train(fabric: L.Fabric, out: Path, nan_at: int | None = None, load: str | None = None, save: str | None = None,
          spike: float = 1.0, fabric_clip: bool = False):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model, optimizer = fabric.setup(model, optimizer)
    if load:
        fabric.load(load, {"model": model, "optimizer": optimizer})
    state = fabric.strategy.gtc_state
    params = list(model.parameters())
    local: dict[int, torch.Tensor] = {}
    for i, p in enumerate(params):
        p.register_hook(lambda g, i=i: local.__setitem__(i, g.detach().clone()))
    x, y = dataset().tensors
    records = [{"params": torch.cat([p.detach().reshape(-1) for p in params]).clone(),
                "residual": state.residual_vector().clone()}]
    for step in range(STEPS):
        rows = slice((step * WORLD + fabric.global_rank) * 8, (step * WORLD + fabric.global_rank + 1) * 8)
        loss = torch.nn.functional.cross_entropy(model(x[rows]), y[rows])
        if step == nan_at and fabric.global_rank == 1:
            loss = loss * float("nan")
        if step == 1 and fabric.global_rank == 1:
            loss = loss * spike
        fabric.backward(loss)
        if fabric_clip:
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        records.append({
            "params": torch.cat([p.detach().reshape(-1) for p in params]).clone(),
            "residual": state.residual_vector().clone(),
            "local_grad": torch.cat([local[i].reshape(-1) for i in range(len(params))]),
            "stats": fabric.strategy.gtc_stats,
        })
    if save:
        fabric.save(save, {"model": model, "optimizer": optimizer})
    torch.save(records, out / f"rank{fabric.global_rank}.pt")


def run(tmp_path: Path, clip: dict | None = None, options: dict | None = None, **kwargs) -> list[list[dict]]:
    options = {"tau": TAU, "compress": "gradient", **(options or {}), **(clip or {})}
    strategy = GTCFabricStrategy(start_method="fork", timeout=timedelta(seconds=60), **options)
    fabric = L.Fabric(accelerator="cpu", devices=WORLD, strategy=strategy)
    fabric.launch(train, tmp_path, **kwargs)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def test_every_step_is_strom_step_and_replicas_agree(tmp_path):
    ranks = run(tmp_path)
    params, residuals = ranks[0][0]["params"], [rank[0]["residual"] for rank in ranks]
    for t in range(1, STEPS + 1):
        recs = [rank[t] for rank in ranks]
        update, new, words = expected_sparse_step(residuals, [rec["local_grad"] for rec in recs], TAU)
        params = params.add(update, alpha=-LR)
        for r, rec in enumerate(recs):
            assert torch.equal(rec["params"], params), f"rank {r}, step {t}"
            assert torch.equal(rec["residual"], new[r])
            assert rec["stats"]["last"]["words"] == words[r]
        residuals = new
    assert ranks[0][-1]["stats"]["total"]["ratio_fp32"] > 1


def test_non_finite_gradient_skips_the_step_everywhere(tmp_path):
    ranks = run(tmp_path, nan_at=1)
    for rank in ranks:
        assert rank[2]["stats"]["last"]["skipped"]
        assert torch.equal(rank[2]["params"], rank[1]["params"])
        assert torch.equal(rank[2]["residual"], rank[1]["residual"])
        assert not torch.equal(rank[3]["params"], rank[2]["params"])


def test_save_and_load_keep_every_ranks_residuals(tmp_path):
    ckpt = str(tmp_path / "fabric.ckpt")
    (tmp_path / "a").mkdir()
    first = run(tmp_path / "a", save=ckpt)
    assert sorted(os.listdir(f"{ckpt}.gtc")) == ["rank0.pt", "rank1.pt"]
    (tmp_path / "b").mkdir()
    second = run(tmp_path / "b", load=ckpt)
    for r in range(WORLD):
        assert torch.equal(second[r][0]["residual"], first[r][-1]["residual"])
        assert torch.equal(second[r][0]["params"], first[r][-1]["params"])
        assert second[r][-1]["stats"]["step"] == 2 * STEPS


def test_automatic_tau_and_rice_coding(tmp_path):
    """The options GTCStrategy takes work in Fabric too: tau moves towards the target density, the
    coded messages are smaller than 4 bytes a word, and the replicas agree."""
    ranks = run(tmp_path, options={"tau": "auto", "target_density": 0.05, "coding": "rice"})
    for t in range(1, STEPS + 1):
        assert torch.equal(ranks[0][t]["params"], ranks[1][t]["params"])
    taus = [rec["stats"]["last"]["tau"] for rec in ranks[0][1:]]
    assert taus[0] != 1e-2 and len(set(taus)) == STEPS, taus  # measured at the first step, then moved
    total = ranks[0][-1]["stats"]["total"]
    assert total["words"] > 0 and total["bytes_sent"] - STEPS * 24 < (WORLD - 1) * 4 * total["words"]


def _setup_sparse(fabric: L.Fabric) -> None:
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 2))
    fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_sparse_gradients_are_refused_at_setup_with_the_fix():
    strategy = GTCFabricStrategy(start_method="fork", timeout=timedelta(seconds=60))
    fabric = L.Fabric(accelerator="cpu", devices=WORLD, strategy=strategy)
    with pytest.raises(Exception, match=r"\['0.weight'\] get sparse gradients .*sparse=False"):
        fabric.launch(_setup_sparse)


def test_registered_by_name_for_fabric():
    import gtc_lightning  # noqa: F401

    for name, method in (("gtc", "popen"), ("gtc_fork", "fork"), ("gtc_spawn_find_unused_parameters_true", "spawn")):
        fabric = L.Fabric(accelerator="cpu", devices=2, strategy=name)
        assert isinstance(fabric.strategy, GTCFabricStrategy) and fabric.strategy._start_method == method


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="tau"):
        GTCFabricStrategy(tau=0)
    with pytest.raises(ValueError, match="exchange"):
        GTCFabricStrategy(exchange="ring")


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_clipping_acts_on_each_ranks_gradient_before_compression(tmp_path, algorithm):
    """A 100x loss spike on rank 1 at step 2: its local gradient is clipped before it enters the
    residual (norm over the whole module, or each element), the replicas stay bit-identical, and
    nothing is lost: new residual + emitted words = old residual + clipped gradient."""
    limit = 0.5 if algorithm == "norm" else 0.02
    ranks = run(tmp_path, clip={"gradient_clip_val": limit, "gradient_clip_algorithm": algorithm}, spike=100.0)
    residuals = [rank[0]["residual"] for rank in ranks]
    params = ranks[0][0]["params"]
    for t in range(1, STEPS + 1):
        recs = [rank[t] for rank in ranks]
        grads = []
        for rec in recs:
            g = rec["local_grad"]
            if algorithm == "norm":
                g = g * min(1.0, limit / (float(g.norm()) + 1e-6))
            else:
                g = g.clamp(-limit, limit)
            grads.append(g)
        update, new, _ = expected_sparse_step(residuals, grads, TAU)
        params = params.add(update, alpha=-LR)
        for r, rec in enumerate(recs):
            assert torch.equal(rec["params"], recs[0]["params"]), f"replicas differ at step {t}"
            assert torch.allclose(rec["residual"], new[r], atol=1e-6), f"rank {r}, step {t}"
        assert torch.allclose(recs[0]["params"], params, atol=1e-6)
        residuals = [rec["residual"] for rec in recs]
    spiked = ranks[1][2]["local_grad"]
    assert float(spiked.norm()) > 10 * limit  # the spike was there, and the checks above saw it clipped


def test_fabric_clip_gradients_is_refused_with_the_fix(tmp_path):
    with pytest.raises(Exception, match="gradient_clip_val"):
        run(tmp_path, fabric_clip=True)
    with pytest.raises(ValueError, match="gradient_clip_algorithm"):
        GTCFabricStrategy(gradient_clip_val=1.0, gradient_clip_algorithm="l1")
    with pytest.raises(ValueError, match="gradient_clip_val"):
        GTCFabricStrategy(gradient_clip_val=-1.0)
