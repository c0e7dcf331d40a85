"""GTC for Lightning Fabric: 2 CPU ranks started by fork train a tiny MLP; every step is
recomputed independently (as in test_strategy.py), the skip decision, and fabric.save/load of the
residuals."""

from __future__ import annotations

import copy
import math
import os
import warnings
from datetime import timedelta
from pathlib import Path

import lightning as L
import pytest
import torch
from _strategy_helpers import (
    CLASSES,
    FEATURES,
    HIDDEN,
    SAMSGD,
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


@pytest.mark.parametrize(("algorithm", "scale"), [("norm", "sqrt_world"), ("value", "sqrt_world"), ("norm", 1.0)])
def test_clipping_acts_on_each_ranks_gradient_before_compression(tmp_path, algorithm, scale):
    """A 100x loss spike on rank 1 at step 2: its local gradient is clipped before it enters the
    residual (norm over the whole module, or each element) at local_clip_scale times the threshold
    (sqrt(2) on 2 ranks by default), the replicas stay bit-identical, and nothing is lost: new
    residual + emitted words = old residual + clipped gradient."""
    c = 0.5 if algorithm == "norm" else 0.02
    limit = c * (math.sqrt(2) if scale == "sqrt_world" else scale)
    clip = {"gradient_clip_val": c, "gradient_clip_algorithm": algorithm, "local_clip_scale": scale}
    ranks = run(tmp_path, clip=clip, spike=100.0)
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
    for bad in (0, -1.0, "dgc", True, float("nan")):
        with pytest.raises(ValueError, match=r"local_clip_scale=.*'sqrt_world'"):
            GTCFabricStrategy(gradient_clip_val=1.0, local_clip_scale=bad)


# ---- compress="update" (the default through "auto" for one optimizer) ----------------------------

UPDATE = {"tau": "auto", "target_density": 0.05}


def _launch(tmp_path: Path, fn, *args, plugins: list | None = None, **options) -> list:
    strategy = GTCFabricStrategy(start_method="fork", timeout=timedelta(seconds=60), **options)
    L.Fabric(accelerator="cpu", devices=WORLD, strategy=strategy, plugins=plugins).launch(fn, tmp_path, *args)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _rows(fabric: L.Fabric, step: int) -> slice:
    return slice((step * WORLD + fabric.global_rank) * 8, (step * WORLD + fabric.global_rank + 1) * 8)


def _flat(params) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in params]).clone()


def _amp_train(fabric: L.Fabric, out: Path, fabric_clip: bool) -> None:
    model = make_model()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    scaler = fabric.strategy.precision.scaler
    x, y = dataset().tensors
    records = [{"params": _flat(model.parameters()), "scale": float(scaler.get_scale())}]
    for step in range(4):
        loss = torch.nn.functional.cross_entropy(model(x[_rows(fabric, step)]), y[_rows(fabric, step)])
        if step == 1 and fabric.global_rank == 1:
            loss = loss * float("nan")
        fabric.backward(loss)
        if fabric_clip:  # Fabric's own clipping, allowed in the update mode (each rank's own gradient)
            fabric.clip_gradients(model, optimizer, max_norm=0.5)
        optimizer.step()
        optimizer.zero_grad()
        records.append({"params": _flat(model.parameters()), "scale": float(scaler.get_scale()),
                        "stats": fabric.strategy.gtc_stats, "compress": fabric.strategy.gtc_state.compress})
    torch.save(records, out / f"rank{fabric.global_rank}.pt")


@pytest.mark.parametrize(("warmup_steps", "fabric_clip"), [(0, False), (0, True), (2, False)])
def test_update_mode_fp16_with_clipping_skips_an_overflow_on_every_rank(tmp_path, warmup_steps, fabric_clip):
    """fp16 with AMP's GradScaler and clipping (the strategy's, or fabric.clip_gradients): rank 1's
    loss is NaN at the second step. Every rank's scaler must see the overflow (the finiteness
    decision, over all ranks, comes before unscaling and clipping): the step is skipped everywhere,
    both scales halve together, and the replicas stay finite and bit-identical."""
    from lightning.fabric.plugins import MixedPrecision

    init = 2.0**16
    plugins = [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=init))]
    clip = {} if fabric_clip else {"gradient_clip_val": 0.5}
    ranks = _launch(tmp_path, _amp_train, fabric_clip, plugins=plugins, warmup_steps=warmup_steps, **clip,
                    **UPDATE)
    for rank in ranks:
        assert rank[-1]["compress"] == "update"
        assert [rec["scale"] for rec in rank] == [init, init, init / 2, init / 2, init / 2]
        assert torch.equal(rank[2]["params"], rank[1]["params"]), "the overflow step moved nothing"
        assert not torch.equal(rank[3]["params"], rank[2]["params"])
    for t in range(5):
        assert torch.isfinite(ranks[0][t]["params"]).all()
        assert torch.equal(ranks[0][t]["params"], ranks[1][t]["params"]), f"replicas differ after step {t}"
    assert ranks[0][-1]["stats"]["total"]["overflows"] == 1


LR_A, LR_B = 0.5, 0.2


def _two_optimizers_train(fabric: L.Fabric, out: Path, how: str) -> None:
    """Two plain SGD optimizers over disjoint halves of the model (first layer, last layer)."""
    model = make_model()
    opt_a = torch.optim.SGD(model[0].parameters(), lr=LR_A)
    opt_b = torch.optim.SGD(model[2].parameters(), lr=LR_B)
    if how == "setup":
        model, opt_a, opt_b = fabric.setup(model, opt_a, opt_b)
    elif how == "setup_optimizers":
        model = fabric.setup_module(model)
        opt_a, opt_b = fabric.setup_optimizers(opt_a, opt_b)
    else:  # one by one, the second after a step: refused in the update mode
        model, opt_a = fabric.setup(model, opt_a)
    state = fabric.strategy.gtc_state
    params = list(model.parameters())
    local: dict[int, torch.Tensor] = {}
    for i, p in enumerate(params):
        p.register_hook(lambda g, i=i: local.__setitem__(i, g.detach().clone()))
    x, y = dataset().tensors
    records = [{"params": _flat(params), "residual": state.residual_vector().clone()}]
    for step in range(STEPS):
        rows = _rows(fabric, step)
        fabric.backward(torch.nn.functional.cross_entropy(model(x[rows]), y[rows]))
        opt_a.step()
        opt_b.step()
        opt_a.zero_grad()
        opt_b.zero_grad()
        records.append({"params": _flat(params), "residual": state.residual_vector().clone(),
                        "local_grad": torch.cat([local[i].reshape(-1) for i in range(len(params))]),
                        "compress": state.compress, "stats": fabric.strategy.gtc_stats})
        if how == "late" and step == 0:
            opt_b = fabric.setup_optimizers(opt_b)
    torch.save(records, out / f"rank{fabric.global_rank}.pt")


@pytest.mark.parametrize("how", ["setup", "setup_optimizers"])
def test_auto_with_two_optimizers_compresses_the_gradient_and_both_move(tmp_path, how):
    """compress='auto' with two optimizers (over the first and the last layer) takes Strom's gradient
    mode, as the Trainer's auto does: one exchange a step, and each half moves by its own rate times
    the decoded mean gradient, on both ranks alike."""
    ranks = _launch(tmp_path, _two_optimizers_train, how, tau=TAU)
    split = sum(p.numel() for p in make_model()[0].parameters())
    params, residuals = ranks[0][0]["params"], [rank[0]["residual"] for rank in ranks]
    for t in range(1, STEPS + 1):
        recs = [rank[t] for rank in ranks]
        assert recs[0]["compress"] == "gradient"
        assert recs[0]["stats"]["step"] == t, "one exchange a step"
        update, new, _ = expected_sparse_step(residuals, [rec["local_grad"] for rec in recs], TAU)
        params = torch.cat([params[:split] - LR_A * update[:split], params[split:] - LR_B * update[split:]])
        for r, rec in enumerate(recs):
            assert torch.equal(rec["params"], recs[0]["params"]), f"replicas differ at step {t}"
            assert torch.equal(rec["residual"], new[r]), f"rank {r}, step {t}"
        assert torch.allclose(recs[0]["params"], params, rtol=0, atol=1e-6)
        residuals = new
    moved = ranks[0][-1]["params"] != ranks[0][0]["params"]
    assert moved[:split].any() and moved[split:].any(), "both halves move"


def test_update_with_two_optimizers_is_refused_with_the_fix(tmp_path):
    with pytest.raises(Exception, match=r"compress='update'.*2 optimizers.*compress='gradient' \(or 'auto'"):
        _launch(tmp_path, _two_optimizers_train, "setup", tau=TAU, compress="update")


def test_a_second_optimizer_after_an_update_step_is_refused_with_the_fix(tmp_path):
    with pytest.raises(Exception, match=r"compress='update'.*before the first step.*compress='gradient'"):
        _launch(tmp_path, _two_optimizers_train, "late", tau=TAU)


def _adamw_train(fabric: L.Fabric, out: Path, steps: int, save: str | None, load: str | None) -> None:
    torch.manual_seed(0)
    model = make_model()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    state = fabric.strategy.gtc_state
    first = 0
    if load:
        fabric.load(load, {"model": model, "optimizer": optimizer})
        first = state.step
    loaded = copy.deepcopy(optimizer.state_dict())  # state_dict() holds the live tensors
    x, y = dataset().tensors
    records = []
    for step in range(first, first + steps):
        rows = _rows(fabric, step % 4)
        fabric.backward(torch.nn.functional.cross_entropy(model(x[rows]), y[rows]))
        optimizer.step()
        optimizer.zero_grad()
        records.append({"params": _flat(model.parameters()), "residual": state.residual_vector().clone()})
    if save:
        fabric.save(save, {"model": model, "optimizer": optimizer})
    torch.save({"records": records, "compress": state.compress, "optimizer": optimizer.state_dict(),
                "loaded": loaded}, out / f"rank{fabric.global_rank}.pt")  # fmt: skip


def _moments(optimizer_state: dict) -> list[torch.Tensor]:
    return [s[key] for _, s in sorted(optimizer_state["state"].items()) for key in ("exp_avg", "exp_avg_sq")]


def test_update_mode_resume_restores_every_ranks_own_optimizer_state(tmp_path):
    """AdamW in the update mode: each rank's moments are its own. Resumed from fabric.save after 4
    steps, every rank gets back the moments it saved (not rank 0's, which the checkpoint file holds),
    and the run continues bit for bit as the uninterrupted one."""
    ckpt = str(tmp_path / "fabric.ckpt")
    for name in ("full", "part", "resumed"):
        (tmp_path / name).mkdir()
    full = _launch(tmp_path / "full", _adamw_train, 8, None, None, **UPDATE)
    part = _launch(tmp_path / "part", _adamw_train, 4, ckpt, None, **UPDATE)
    resumed = _launch(tmp_path / "resumed", _adamw_train, 4, None, ckpt, **UPDATE)
    assert full[0]["compress"] == "update"
    saved = [_moments(rank["optimizer"]) for rank in part]
    assert not all(torch.equal(a, b) for a, b in zip(*saved)), "the ranks' moments differ (else: no proof)"
    for r in range(WORLD):
        loaded = _moments(resumed[r]["loaded"])
        assert all(torch.equal(a, b) for a, b in zip(loaded, saved[r])), f"rank {r} got back other moments"
        for t, (a, b) in enumerate(zip(part[r]["records"] + resumed[r]["records"], full[r]["records"])):
            assert torch.equal(a["params"], b["params"]), f"rank {r}, step {t + 1}"
            assert torch.equal(a["residual"], b["residual"]), f"rank {r}, step {t + 1}"


def test_two_adam_optimizers_in_the_gradient_mode_are_warned_about():
    from gtc_lightning import GTCFabricStrategy

    model = torch.nn.Linear(4, 4)
    for compress, expected in (("auto", 1), ("gradient", 0)):
        strategy = GTCFabricStrategy(compress=compress)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            strategy.setup_optimizer(torch.optim.Adam([model.weight]))
            strategy.setup_optimizer(torch.optim.AdamW([model.bias]))
        said = [w for w in caught if "take Strom's gradient mode" in str(w.message)]
        assert len(said) == expected and (not said or "Adam, AdamW" in str(said[0].message))


@pytest.mark.parametrize("option", [{"mean_variance": True}, {"momentum_masking": True}, {"conserve": "displacement"}])
def test_the_update_modes_options_reach_it_through_fabric(tmp_path, option):
    """GTCFabricStrategy with an option of the update mode and AdamW (they were refused at setup, where
    the state started in the gradient mode): the replicas stay bit-identical, and the residual differs
    from a run's without the option (it reached the update mode's step)."""
    for name in ("plain", "option"):
        (tmp_path / name).mkdir()
    plain = _launch(tmp_path / "plain", _adamw_train, 4, None, None, **UPDATE)
    changed = _launch(tmp_path / "option", _adamw_train, 4, None, None, **UPDATE, **option)
    for run in (plain, changed):
        for a, b in zip(run[0]["records"], run[1]["records"]):
            assert torch.equal(a["params"], b["params"])
    assert not torch.equal(plain[0]["records"][-1]["residual"], changed[0]["records"][-1]["residual"])


def test_the_update_modes_options_are_warned_about_once_an_optimizer_decides_the_mode():
    """Fabric sets the module up before its optimizers: the mode is not decided then, and an option of
    the update mode is not yet unused (it was warned about at every fabric.setup)."""
    import torch.distributed as dist

    from gtc_lightning import GTCFabricStrategy, GTCState

    model = torch.nn.Linear(4, 4)
    strategy = GTCFabricStrategy(momentum_masking=True)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        strategy._gtc_state = GTCState(None, model.named_parameters(), tau="auto", compress="auto",
                                       momentum_masking=True)  # fmt: skip
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            strategy._resolve_compress(0)  # no optimizer yet
            strategy._resolve_compress(1)  # the update mode: the option is used
        with pytest.warns(UserWarning, match="momentum_masking=True .* apply to compress='update'"):
            strategy._resolve_compress(2)  # several optimizers: the gradient mode
    finally:
        dist.destroy_process_group()


def test_lbfgs_is_refused_when_fabric_sets_it_up():
    model = make_model()
    with pytest.raises(ValueError, match=r"GTCFabricStrategy cannot train with LBFGS.*strategy='ddp'"):
        GTCFabricStrategy().setup_optimizer(torch.optim.LBFGS(model.parameters()))


def _sam_train(fabric: L.Fabric, out: Path) -> None:
    model = make_model()
    model, optimizer = fabric.setup(model, SAMSGD(model.parameters(), lr=0.5))
    x, y = dataset().tensors
    before = _flat(model.parameters())
    for step in range(3):

        def closure(step=step):
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x[_rows(fabric, step)]), y[_rows(fabric, step)])
            fabric.backward(loss)
            return loss

        try:
            optimizer.step(closure)
        except RuntimeError as error:
            torch.save(str(error), out / f"rank{fabric.global_rank}.pt")
            return
    moved = bool((_flat(model.parameters()) != before).any())
    everyone = fabric.all_gather(_flat(model.parameters()))
    torch.save({"moved": moved, "identical": bool((everyone == everyone[0]).all())}, out / f"rank{fabric.global_rank}.pt")


@pytest.mark.parametrize("compress", ["update", "gradient"])
def test_an_optimizer_evaluating_its_closure_twice_trains_in_the_update_mode_alone(tmp_path, compress):
    """SAM's closure, evaluated twice a step through Fabric: the update mode trains with identical replicas,
    Strom's gradient mode stops at the second evaluation on every rank, naming the update mode."""
    options = UPDATE if compress == "update" else {"tau": 0.01}
    ranks = _launch(tmp_path, _sam_train, compress=compress, **options)
    for rank in ranks:
        if compress == "update":
            assert rank == {"moved": True, "identical": True}
        else:
            assert "SAMSGD evaluates the closure again" in rank and "compress='update'" in rank
