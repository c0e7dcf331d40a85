"""BMUF (``"bmuf"``) and BMUF-GTC (``"bmuf_gtc"``): the block update on numbers computed by hand, its
DiLoCo reading, and 2- and 4-process CPU/gloo runs started by fork, replayed independently.

The replays recompute every rank's local steps from its recorded gradient (plain SGD, or Strom's
step within each GTC group) and every block update from the formulas of Chen & Huo, written here
again: G = mean - start, Δ = ηΔ + ζG, W = W + Δ, next start = W + ηΔ (Nesterov) or W.
"""

import os

import lightning as L
import pytest
import torch
from _averaging_helpers import fit_recorded, local_step, mean
from _strategy_helpers import (
    TinyMLP,
    expected_sparse_step,
    keep_master_port,  # noqa: F401  (autouse: the fork launcher sets MASTER_PORT)
)
from lightning.pytorch.callbacks import ModelCheckpoint

from gtc_lightning import BMUFGTCStrategy, BMUFStrategy
from gtc_lightning.algorithms.averaging.bmuf import BMUFState, block_update_, group_ranks
from gtc_lightning.algorithms.common import allreduce_bytes

K = 3  # block syncs after steps 3 and 6 of 8 (2 epochs x 4 batches per rank)
TAU = 0.05
NUMEL = sum(p.numel() for p in TinyMLP().parameters())


# ---- the block update by hand --------------------------------------------------------------------


def run_blocks(means: list[float], eta: float, zeta: float, nesterov: bool, w0: float = 1.0) -> list[tuple]:
    """``block_update_`` on a one-element model: (W, Δ, next start) after each block."""
    w, delta, out = torch.tensor([w0]), torch.zeros(1), []
    for m in means:
        start = block_update_(w, delta, torch.tensor([float(m)]), eta, zeta, nesterov)
        out.append((float(w), float(delta), float(start)))
    return out


def test_block_update_by_hand():
    """W0 = 1, η = 0.5, ζ = 1, the learners' mean 0 after block 1 and -2 after block 2.

    Plain:    G1 = 0 - 1 = -1,    Δ1 = -1,                 W1 = 0,  start 0;
              G2 = -2 - 0 = -2,   Δ2 = 0.5*-1 - 2 = -2.5,   W2 = -2.5, start -2.5.
    Nesterov: G1 = -1, Δ1 = -1, W1 = 0, start W1 + 0.5 Δ1 = -0.5;
              G2 = -2 + 0.5 = -1.5, Δ2 = -0.5 - 1.5 = -2,   W2 = -2,  start -2 + 0.5*-2 = -3.
    """
    assert run_blocks([0, -2], 0.5, 1.0, nesterov=False) == [(0, -1, 0), (-2.5, -2.5, -2.5)]
    assert run_blocks([0, -2], 0.5, 1.0, nesterov=True) == [(0, -1, -0.5), (-2, -2, -3)]
    # ζ = 0.5: G1 = -1, Δ1 = -0.5, W1 = 0.5; G2 = -2 - 0.5 = -2.5, Δ2 = -0.25 - 1.25 = -1.5, W2 = -1.
    assert run_blocks([0, -2], 0.5, 0.5, nesterov=False) == [(0.5, -0.5, 0.5), (-1.0, -1.5, -1.0)]
    # η = 0, ζ = 1 is model averaging: the next block starts from the mean.
    assert [start for *_, start in run_blocks([0.25, -2], 0.0, 1.0, nesterov=True)] == [0.25, -2]


def test_w_and_delta_loaded_on_the_cpu_move_to_the_device_of_the_mean_at_the_first_block():
    """A shard gives W and Δ as Lightning's checkpoint IO loads them, on the CPU; after a resume on a
    GPU the first block's mean is on the GPU ("meta" stands in for it here): W and Δ move there."""
    state = BMUFState(period=2, block_momentum=0.5, world_size=2)
    state.load_state_dict({"step": 4, "totals": {}, "global_params": torch.ones(3), "delta": torch.zeros(3)})
    start = state.update(torch.zeros(3, device="meta"))
    assert state.global_params.device.type == state.delta.device.type == start.device.type == "meta"
    state = BMUFState(period=2, block_momentum=0.5, nesterov=False, world_size=2)  # on the CPU: as by hand
    state.load_state_dict({"step": 4, "totals": {}, "global_params": torch.ones(1), "delta": torch.zeros(1)})
    assert float(state.update(torch.zeros(1))) == 0.0 and float(state.delta) == -1.0


def test_diloco_outer_nesterov_step_is_bmuf_with_nesterov_block_momentum_by_hand():
    """DiLoCo's outer step: outer gradient θ - mean, SGD with Nesterov momentum μ and learning rate α.
    With μ = η = 0.5, α = ζ = 1, θ0 = 1 and the means of the test above:

    block 1: g = 1 - 0 = 1, buffer = 1, step g + μ buffer = 1.5, θ1 = -0.5;
    block 2: g = -0.5 + 2 = 1.5, buffer = 0.5*1 + 1.5 = 2, step 1.5 + 0.5*2 = 2.5, θ2 = -3:
    BMUF-Nesterov's start points -0.5 and -3, and the buffer is -Δ/ζ (Δ1 = -1, Δ2 = -2).
    """
    theta = torch.nn.Parameter(torch.tensor([1.0]))
    outer = torch.optim.SGD([theta], lr=1.0, momentum=0.5, nesterov=True)
    starts, buffers = [], []
    for m in (0.0, -2.0):
        theta.grad = theta.detach() - m
        outer.step()
        starts.append(float(theta.detach()))
        buffers.append(float(outer.state[theta]["momentum_buffer"]))
    assert starts == [-0.5, -3.0] and buffers == [1.0, 2.0]
    bmuf = run_blocks([0, -2], 0.5, 1.0, nesterov=True)
    assert starts == [start for *_, start in bmuf]
    assert buffers == [-delta / 1.0 for _, delta, _ in bmuf]


def test_diloco_correspondence_with_its_own_numbers():
    """DiLoCo's outer learning rate 0.7 and momentum 0.9, random models over 5 blocks."""
    g = torch.Generator().manual_seed(0)
    theta = torch.nn.Parameter(torch.randn(100, generator=g))
    outer = torch.optim.SGD([theta], lr=0.7, momentum=0.9, nesterov=True)
    w, delta = theta.detach().clone(), torch.zeros(100)
    for _ in range(5):
        local_mean = theta.detach() + 0.1 * torch.randn(100, generator=g)
        start = block_update_(w, delta, local_mean.clone(), 0.9, 0.7, nesterov=True)
        theta.grad = theta.detach() - local_mean
        outer.step()
        assert torch.allclose(start, theta.detach(), atol=1e-6)
        assert torch.allclose(outer.state[theta]["momentum_buffer"], -delta / 0.7, atol=1e-6)


# ---- end to end: the replays ----------------------------------------------------------------------


def block(w, delta, start, models, eta, zeta, nesterov):
    """Chen & Huo's block update, from the learners' models after the block."""
    update = mean(models) - start
    delta = eta * delta + zeta * update
    w = w + delta
    return w, delta, (w + eta * delta if nesterov else w)


def replay(ranks, period, eta, zeta, nesterov, group_size=1, tau=None):
    """Every rank's parameters after every step: learners (groups of ``group_size`` ranks) step
    locally (plain SGD on one rank's gradient, or Strom's step within a GTC group), and every
    ``period`` steps start again from the block update of their mean."""
    groups = [list(range(s, s + group_size)) for s in range(0, len(ranks), group_size)]
    start = ranks[0]["start"]["params"]
    w, delta = start, torch.zeros_like(start)
    params = [start] * len(groups)
    residuals = [rank["start"]["residual"] for rank in ranks]
    out = []
    for t in range(1, len(ranks[0]["records"]) + 1):
        for g, members in enumerate(groups):
            grads = [ranks[r]["records"][t - 1]["local_grad"] for r in members]
            if tau is None:
                params[g] = local_step(params[g], grads[0])
                continue
            update, new, _ = expected_sparse_step([residuals[r] for r in members], grads, tau)
            params[g] = local_step(params[g], update)
            for r, residual in zip(members, new):
                residuals[r] = residual
        if t % period == 0:
            w, delta, start = block(w, delta, start, params, eta, zeta, nesterov)
            params = [start] * len(groups)
        out.append([params[r // group_size] for r in range(len(ranks))])
    return out


def check_replay(ranks, expected, exact=True):
    for t, models in enumerate(expected, start=1):
        for r, rank in enumerate(ranks):
            got = rank["records"][t - 1]["params"]
            same = torch.equal(got, models[r]) if exact else torch.allclose(got, models[r], atol=1e-6)
            assert same, f"rank {r}: parameters differ after step {t}"


@pytest.mark.parametrize("nesterov", [True, False], ids=["nesterov", "plain"])
def test_block_update_equals_an_independent_computation(tmp_path, nesterov):
    """2 ranks, SGD without momentum, η = 0.5 (1 - 1/N), ζ = 1: every step bit for bit."""
    _, ranks, syncs = fit_recorded(tmp_path, BMUFStrategy, period=K, nesterov=nesterov,
                                   model_kwargs={"momentum": 0.0})  # fmt: skip
    expected = replay(ranks, K, eta=0.5, zeta=1.0, nesterov=nesterov)
    check_replay(ranks, expected)
    for t in range(1, 9):
        same = torch.equal(ranks[0]["records"][t - 1]["params"], ranks[1]["records"][t - 1]["params"])
        assert same == (t % K == 0), f"step {t}"
    assert [rec["last"]["mode"] for rec in syncs[0]] == ["local", "local", "sync"] * 2 + ["local"] * 2
    assert syncs[1][2]["last"]["bytes_sent"] == allreduce_bytes(NUMEL, 2)
    if nesterov:  # the same run read as DiLoCo: an outer SGD with Nesterov momentum η and rate ζ
        theta = torch.nn.Parameter(ranks[0]["start"]["params"].clone())
        outer = torch.optim.SGD([theta], lr=1.0, momentum=0.5, nesterov=True)
        models = [rank["start"]["params"] for rank in ranks]
        for t in range(1, 9):
            models = [local_step(m, rank["records"][t - 1]["local_grad"]) for m, rank in zip(models, ranks)]
            if t % K == 0:
                theta.grad = theta.detach() - mean(models)
                outer.step()
                models = [theta.detach().clone()] * 2
                assert torch.allclose(ranks[0]["records"][t - 1]["params"], theta.detach(), atol=1e-6)


def test_four_ranks_default_block_momentum_is_one_minus_one_over_n(tmp_path):
    _, ranks, _ = fit_recorded(tmp_path, BMUFStrategy, devices=4, max_epochs=1, period=2,
                               model_kwargs={"momentum": 0.0, "samples": 128})  # fmt: skip
    check_replay(ranks, replay(ranks, 2, eta=0.75, zeta=1.0, nesterov=True), exact=False)


@pytest.fixture(scope="module")
def bmuf_gtc_run(tmp_path_factory):
    """4 ranks in 2 GTC groups of 2, SGD without momentum, a block sync every 3 steps."""
    return fit_recorded(tmp_path_factory.mktemp("bmuf_gtc"), BMUFGTCStrategy, devices=4, period=K, tau=TAU,
                        model_kwargs={"momentum": 0.0, "samples": 128})  # fmt: skip


def test_bmuf_gtc_replicas_identical_in_a_group_every_step_and_everywhere_after_a_block_sync(bmuf_gtc_run):
    _, ranks, _ = bmuf_gtc_run
    for t in range(1, 9):
        params = [rank["records"][t - 1]["params"] for rank in ranks]
        assert torch.equal(params[0], params[1]) and torch.equal(params[2], params[3]), f"step {t}"
        assert torch.equal(params[0], params[2]) == (t % K == 0), f"step {t}"
    for rank in ranks:
        assert all(rec["stats"]["last"]["world_size"] == 2 for rec in rank["records"])  # GTC within the group


def test_bmuf_gtc_steps_equal_an_independent_computation(bmuf_gtc_run):
    """Strom's step within each group, BMUF of the two groups' models (η = 1 - 1/2), bit for bit."""
    _, ranks, _ = bmuf_gtc_run
    assert all(rec["stats"]["last"]["mode"] == "sparse" for rank in ranks for rec in rank["records"])
    check_replay(ranks, replay(ranks, K, eta=0.5, zeta=1.0, nesterov=True, group_size=2, tau=TAU))


def test_bmuf_gtc_block_bytes(bmuf_gtc_run):
    """Representatives all-reduce over the 2 groups and send the model to their group's other rank."""
    _, _, syncs = bmuf_gtc_run
    model = 4 * NUMEL
    for r, rank in enumerate(syncs):
        last = rank[K - 1]["last"]
        assert last["mode"] == "sync" and rank[0]["last"]["bytes_sent"] == 0
        if r % 2 == 0:
            reduced = allreduce_bytes(NUMEL, 2)
            assert (last["bytes_sent"], last["bytes_received"]) == (reduced + model, reduced)
        else:
            assert (last["bytes_sent"], last["bytes_received"]) == (0, model)
        assert last["world_size"] == 4 and rank[-1]["total"]["syncs"] == 2


# ---- checkpoints --------------------------------------------------------------------------------


def fit_twice(tmp_path, strategy, devices=2, **kwargs):
    """The uninterrupted run (2 epochs), and the first epoch with a checkpoint at step 4 (one step
    after the block sync of step 3: the learners' models differ there), then resumed."""
    _, full, _ = fit_recorded(tmp_path / "full", strategy, devices=devices, **kwargs)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    trainer_kwargs = {"enable_checkpointing": True, "callbacks": [checkpoint]}
    fit_recorded(
        tmp_path / "part1", strategy, devices=devices, max_epochs=1, trainer_kwargs=trainer_kwargs, **kwargs
    )
    path = tmp_path / "ckpt" / "last.ckpt"
    _, resumed, _ = fit_recorded(
        tmp_path / "resumed", strategy, devices=devices, ckpt_path=str(path), **kwargs
    )
    return full, resumed, path


def check_resumed(full, resumed):
    for r, (a, b) in enumerate(zip(resumed, full)):
        assert torch.equal(a["start"]["params"], b["records"][3]["params"]), (
            f"rank {r} did not get its own model"
        )
        assert [rec["global_step"] for rec in a["records"]] == [5, 6, 7, 8]
        for t, (x, y) in enumerate(zip(a["records"], b["records"][4:]), start=5):
            assert torch.equal(x["params"], y["params"]), (
                f"rank {r}: step {t} differs from the uninterrupted run"
            )


def test_bmuf_resume_is_bit_exact_with_w_global_and_delta_in_every_shard(tmp_path):
    """Local SGD with momentum 0.9 (every rank's own buffers), Nesterov block momentum."""
    full, resumed, path = fit_twice(tmp_path, BMUFStrategy, period=K)
    shards = [torch.load(f"{path}.bmuf/rank{r}.pt", weights_only=False) for r in range(2)]
    for shard in shards:
        averaging = shard["averaging"]
        assert averaging["step"] == 4 and averaging["delta"].abs().max() > 0
        assert torch.equal(averaging["global_params"], shards[0]["averaging"]["global_params"])
    assert not torch.equal(shards[0]["state_dict"]["net.0.weight"], shards[1]["state_dict"]["net.0.weight"])
    check_resumed(full, resumed)


def test_bmuf_gtc_resume_is_bit_exact(tmp_path):
    full, resumed, path = fit_twice(tmp_path, BMUFGTCStrategy, devices=4, period=K, tau=TAU,
                                    model_kwargs={"samples": 128})  # fmt: skip
    assert os.path.isdir(f"{path}.gtc") and os.path.isdir(f"{path}.bmuf_gtc")
    representative = torch.load(f"{path}.bmuf_gtc/rank2.pt", weights_only=False)["averaging"]
    other = torch.load(f"{path}.bmuf_gtc/rank3.pt", weights_only=False)["averaging"]
    assert representative["global_params"] is not None and other["global_params"] is None
    check_resumed(full, resumed)


# ---- bad settings ---------------------------------------------------------------------------------


BAD_BLOCK_SETTINGS = [
    ({"block_momentum": 1.0}, r"block_momentum \(η\) in \[0, 1\)"),
    ({"block_momentum": -0.1}, "block_momentum"),
    ({"block_momentum": True}, "block_momentum"),
    ({"block_lr": 0.0}, r"block_lr \(ζ\)"),
    ({"block_lr": float("nan")}, "block_lr"),
    ({"period": 0}, "period"),
    ({"optimizer_state": "sum"}, "optimizer_state"),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD_BLOCK_SETTINGS)
def test_bad_bmuf_settings_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BMUFStrategy(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        *BAD_BLOCK_SETTINGS,
        ({"group_size": 0}, "group_size"),
        ({"process_group": object()}, "own process groups"),
    ],
)
def test_bad_bmuf_gtc_settings_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BMUFGTCStrategy(**kwargs)


def test_groups_of_consecutive_ranks():
    assert group_ranks(4, 2) == [[0, 1], [2, 3]]
    assert group_ranks(8, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert group_ranks(2, 1) == [[0], [1]]
    with pytest.raises(ValueError, match=r"group_size=3 does not divide the 4 ranks.*one of \[1, 2\]"):
        group_ranks(4, 3)
    with pytest.raises(ValueError, match=r"group_size=4 of 4 ranks makes one group.*strategy='gtc'"):
        group_ranks(4, 4)
    with pytest.raises(ValueError, match="makes one group.*at least 2 ranks"):
        group_ranks(1, 1)


@pytest.mark.parametrize(
    ("devices", "group_size", "message"),
    [(4, 3, "does not divide the 4 ranks"), (2, 2, "makes one group")],
)
def test_bmuf_gtc_group_size_is_checked_as_the_trainer_is_built(devices, group_size, message):
    """Before any process starts (and again on every rank as fit sets up)."""
    with pytest.raises(ValueError, match=message):
        L.Trainer(strategy=BMUFGTCStrategy(group_size=group_size, start_method="fork"), accelerator="cpu",
                  devices=devices, logger=False)  # fmt: skip


@pytest.mark.parametrize(
    ("name", "cls", "start_method", "unused"),
    [
        ("bmuf", BMUFStrategy, "popen", False),
        ("bmuf_fork", BMUFStrategy, "fork", False),
        ("bmuf_gtc", BMUFGTCStrategy, "popen", False),
        ("bmuf_gtc_spawn_find_unused_parameters_true", BMUFGTCStrategy, "spawn", True),
    ],
)
def test_registered_names_resolve(name, cls, start_method, unused):
    devices = 4 if cls is BMUFGTCStrategy else 2  # the default group_size=2 needs 2 groups
    trainer = L.Trainer(strategy=name, accelerator="cpu", devices=devices, logger=False, enable_progress_bar=False)
    strategy = trainer.strategy
    assert type(strategy) is cls and strategy._start_method == start_method
    assert strategy._ddp_kwargs.get("find_unused_parameters", False) is unused
    assert (strategy.period, strategy.block_momentum, strategy.block_lr, strategy.nesterov) == (
        50,
        None,
        1.0,
        True,
    )
