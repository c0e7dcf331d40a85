"""Streaming and overlap of the block sync (``fragments``, ``overlap`` of ``bmuf``/``diloco``/``sparseloco``).

The state is driven on 2 forked gloo ranks with synthetic local steps (each rank's model moves by a fixed
draw every optimizer step), and every model is checked against what the filter gives when written out by
hand for that schedule; then 2-rank Lightning runs check a resume with an exchange in flight.
"""

import time

import lightning as L
import pytest
import torch
import torch.distributed as dist
from _averaging_helpers import fit_recorded, run_ranks
from _strategy_helpers import keep_master_port  # noqa: F401  (autouse: the fork launcher sets MASTER_PORT)
from lightning.pytorch.callbacks import ModelCheckpoint

from gtc_lightning import BMUFStrategy, SparseLoCoStrategy
from gtc_lightning.algorithms.averaging.bmuf import BMUFState
from gtc_lightning.algorithms.sparseloco import SparseLoCoState

N = 1000


def moves(rank: int, steps: int) -> list[torch.Tensor]:
    """What rank ``rank``'s local step ``t`` moves its model by (a fixed draw per rank and step)."""
    g = torch.Generator().manual_seed(7 + rank)
    return [1e-2 * torch.randn(N, generator=g) for _ in range(steps)]


class SlowState(BMUFState):
    """A dense exchange that takes ``delay`` seconds more (a slow link)."""

    delay = 0.0

    def mean_update(self, update, part, group, step):
        time.sleep(self.delay)
        return super().mean_update(update, part, group, step)


def drive(rank, out_dir, steps, sparse=False, delay=0.0, step_s=0.0, **options):
    """``steps`` optimizer steps of 2 ranks, then ``finish`` (the end of fit); returns each rank's model
    after every step and after ``finish``, each step's host seconds, the totals and the residual."""
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    params = [torch.randn(N // 4, 4)]
    if sparse:
        state = SparseLoCoState(**options)
    else:
        state = SlowState(**options)
        state.delay = delay
    state.begin(params)
    start, after, seconds, modes = params[0].reshape(-1).clone(), [], [], []
    for move in moves(rank, steps):
        time.sleep(step_s)  # the local step's compute
        with torch.no_grad():
            params[0].add_(move.view_as(params[0]))
        begin = time.perf_counter()
        modes.append(state.after_step(params, []).mode)
        seconds.append(time.perf_counter() - begin)
        after.append(params[0].reshape(-1).clone())
    state.finish(params)
    final = params[0].reshape(-1).clone()
    result = {"start": start, "after": after, "final": final, "seconds": seconds, "modes": modes,
              "totals": dict(state.totals), "residual": getattr(state, "residual", None)}  # fmt: skip
    dist.destroy_process_group()
    return result


def summed(rank: int, first: int, last: int) -> torch.Tensor:
    """Rank ``rank``'s moves of steps ``first``..``last`` (1-based, inclusive)."""
    return sum(moves(rank, last)[first - 1 : last])


def both(first: int, last: int) -> torch.Tensor:
    return (summed(0, first, last) + summed(1, first, last)) / 2


def close(x: torch.Tensor, y: torch.Tensor) -> bool:
    return torch.allclose(x, y, rtol=0, atol=1e-6)


def test_overlap_lands_each_exchange_one_interval_late_and_keeps_each_ranks_progress(tmp_path):
    """Period 2, η = 0.5, ζ = 0.7, Nesterov, 4 steps. Sync 1 (step 2) launches ū1 = mean of steps 1-2 and
    changes nothing; sync 2 (step 4) lands it: W1 = x0 + Δ1 (Δ1 = ζ ū1), each rank at W1 + ηΔ1 plus its own
    steps 3-4, and launches ū2 = mean of steps 3-4; the end of fit lands ū2: every rank at W2 + ηΔ2."""
    eta, zeta = 0.5, 0.7
    ranks = run_ranks(tmp_path, drive, steps=4, period=2, block_momentum=eta, block_lr=zeta, overlap=True)
    x0 = ranks[0]["start"]
    delta1 = zeta * both(1, 2)
    w1 = x0 + delta1
    delta2 = eta * delta1 + zeta * both(3, 4)
    w2 = w1 + delta2
    for r, rank in enumerate(ranks):
        assert torch.equal(rank["start"], x0)
        assert close(rank["after"][1], x0 + summed(r, 1, 2)), "the launching sync must not move the model"
        assert close(rank["after"][3], w1 + eta * delta1 + summed(r, 3, 4)), f"rank {r} after the landing"
        assert close(rank["final"], w2 + eta * delta2), f"rank {r} after the end of fit"
        assert rank["modes"] == ["local", "sync", "local", "sync"]
        n = 2 * (2 - 1) * N * 4 // 2  # a 2-rank ring all-reduce of N float32 sends N * 4 bytes
        assert rank["totals"]["bytes_sent"] == 2 * n, "both exchanges counted, the last at the end of fit"
    assert not torch.equal(ranks[0]["after"][3], ranks[1]["after"][3])
    assert torch.equal(ranks[0]["final"], ranks[1]["final"]), "after the last landing the replicas are one"


def test_fragments_sync_the_parts_in_turn(tmp_path):
    """Period 4 in 2 fragments (η = 0, ζ = 1): step 2 syncs the first half (its mean of steps 1-2), step 4
    the second half (its mean of steps 1-4); the first half keeps each rank's steps 3-4."""
    ranks = run_ranks(tmp_path, drive, steps=4, period=4, block_momentum=0.0, fragments=2, nesterov=False)
    x0, half = ranks[0]["start"], slice(0, N // 2)
    rest = slice(N // 2, N)
    for r, rank in enumerate(ranks):
        assert close(rank["after"][1][half], (x0 + both(1, 2))[half])
        assert close(rank["after"][1][rest], (x0 + summed(r, 1, 2))[rest]), "the other half is not synced"
        assert close(rank["after"][3][rest], (x0 + both(1, 4))[rest])
        assert close(rank["after"][3][half], (x0 + both(1, 2) + summed(r, 3, 4))[half])
        assert rank["modes"] == ["local", "sync"] * 2
        assert rank["totals"]["bytes_sent"] == 2 * (N // 2) * 4, "each sync sends half the model"
        assert torch.equal(rank["final"], rank["after"][3]), "nothing in flight without overlap"


@pytest.mark.parametrize("values", ["sign", "2bit"])
def test_sparse_streamed_sync_conserves_every_update(tmp_path, values):
    """SparseLoCo in 2 fragments with overlap (η = 0, ζ = 1), 8 steps of period 4 (the second half launched
    at step 8, landed at the end of fit; the first launched at step 6, landed at step 8, then each rank's own
    steps 7-8): the ranks' mean has moved by the mean over the ranks of (all their moves - what each residual
    still owes), element by element: error feedback loses nothing across parts and delays."""
    options = {"period": 4, "block_momentum": 0.0, "density": 0.05, "values": values}
    ranks = run_ranks(tmp_path, drive, steps=8, sparse=True, fragments=2, overlap=True, **options)
    a, b = ranks
    half, rest = slice(0, N // 2), slice(N // 2, N)
    assert torch.equal(a["final"][rest], b["final"][rest]), "the last part landed with nothing after it"
    assert close(a["final"][half] - b["final"][half], (summed(0, 7, 8) - summed(1, 7, 8))[half])
    owed = [summed(r, 1, 8) - rank["residual"] for r, rank in enumerate(ranks)]
    moved = (a["final"] + b["final"]) / 2 - a["start"]
    assert torch.allclose(moved, (owed[0] + owed[1]) / 2, rtol=0, atol=2e-6)
    assert a["residual"].abs().max() > 0
    # Each sync sends ~5 % of a half: 4 syncs of ~25 words each on N = 1000 (the threshold's sample is rough).
    assert 4 * 0.03 * N / 2 <= a["totals"]["words"] <= 4 * 0.08 * N / 2, a["totals"]["words"]


def test_overlap_returns_before_a_slow_exchange_ends(tmp_path):
    """An exchange that takes 1.5 s, local steps of 0.5 s, a sync every 2 steps (2 fragments of period 4):
    without overlap each sync's step waits the 1.5 s; with overlap the launching step returns at once and the
    next sync waits only for what the 2 local steps (1 s) did not hide."""
    common = {"steps": 4, "period": 4, "fragments": 2, "block_momentum": 0.0, "delay": 1.5, "step_s": 0.5}
    waited = run_ranks(tmp_path / "plain", drive, **common)
    hidden = run_ranks(tmp_path / "overlap", drive, overlap=True, **common)
    for rank in waited:
        assert min(rank["seconds"][1], rank["seconds"][3]) >= 1.4, rank["seconds"]
    for rank in hidden:
        assert rank["seconds"][1] < 0.3, rank["seconds"]
        assert 0.2 < rank["seconds"][3] < 1.0, rank["seconds"]  # 1.5 s less the 1 s of local steps


# ---- in Lightning: a resume with an exchange in flight ----------------------------------------------


@pytest.mark.parametrize(
    ("strategy", "options"),
    [
        (BMUFStrategy, {"block_momentum": 0.5, "block_lr": 0.7}),
        (SparseLoCoStrategy, {"density": 0.1, "block_momentum": 0.5, "block_lr": 0.7}),
    ],
    ids=["bmuf", "sparseloco"],
)
def test_resume_with_an_exchange_in_flight_is_bit_exact(tmp_path, strategy, options):
    """Period 3, overlap: the exchange launched at step 3 is in flight at the checkpoint of step 4; its
    result goes into every rank's shard and lands at step 6 of the resumed run as in the uninterrupted one."""
    kwargs = {"period": 3, "overlap": True, **options}
    _, full, syncs = fit_recorded(tmp_path / "full", strategy, **kwargs)
    assert [rec["last"]["mode"] for rec in syncs[0]] == ["local", "local", "sync"] * 2 + ["local"] * 2
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    trainer_kwargs = {"enable_checkpointing": True, "callbacks": [checkpoint]}
    fit_recorded(tmp_path / "part1", strategy, max_epochs=1, trainer_kwargs=trainer_kwargs, **kwargs)
    path = tmp_path / "ckpt" / "last.ckpt"
    shard = torch.load(f"{path}.{strategy.name}/rank1.pt", weights_only=False)["averaging"]
    assert shard["step"] == 4 and shard["pending"]["fragment"] == 0 and shard["pending"]["mean"].abs().max() > 0
    _, resumed, _ = fit_recorded(tmp_path / "resumed", strategy, ckpt_path=str(path), **kwargs)
    for r, (a, b) in enumerate(zip(resumed, full)):
        assert [rec["global_step"] for rec in a["records"]] == [5, 6, 7, 8]
        for t, (x, y) in enumerate(zip(a["records"], b["records"][4:]), start=5):
            assert torch.equal(x["params"], y["params"]), f"rank {r}: step {t} differs from the uninterrupted run"


class FinalParams(L.Callback):
    """Each rank's parameters as the callbacks see them at the end of fit."""

    def __init__(self, out_dir):
        self.out_dir = out_dir

    def on_train_end(self, trainer, pl_module):
        flat = torch.cat([p.detach().reshape(-1) for p in pl_module.parameters()])
        torch.save(flat, self.out_dir / f"final{trainer.global_rank}.pt")


def test_the_callbacks_see_the_last_exchange_landed(tmp_path):
    """Period 4, overlap, 8 steps: the exchange launched at step 8 lands before any other callback's
    ``on_train_end``, so a checkpoint or evaluation at the end of fit gets the synced model, one on every rank."""
    out = tmp_path / "run"
    out.mkdir()
    trainer_kwargs = {"callbacks": [FinalParams(out)]}
    _, ranks, syncs = fit_recorded(out, BMUFStrategy, period=4, overlap=True, block_momentum=0.0,
                                   trainer_kwargs=trainer_kwargs)  # fmt: skip
    final = [torch.load(out / f"final{r}.pt") for r in range(2)]
    assert torch.equal(final[0], final[1])
    assert not torch.equal(ranks[0]["records"][-1]["params"], ranks[1]["records"][-1]["params"])
    assert syncs[0][-1]["total"]["syncs"] == 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"period": 30, "fragments": 7}, r"fragments to divide period=30.*got fragments=7; use one of \[1, 2, 3, 5"),
        ({"fragments": 0}, r"fragments to be an int >= 1"),
        ({"overlap": "yes"}, r"overlap to be True or False, got 'yes'"),
        ({"fragments": 2, "optimizer_state": "reset"}, r"optimizer_state='reset' with fragments=2.*use optimizer_state='keep'"),
    ],
)  # fmt: skip
def test_bad_stream_options_are_refused_with_the_value_and_the_fix(kwargs, message):
    for cls in (BMUFStrategy, SparseLoCoStrategy):
        with pytest.raises(ValueError, match=message):
            cls(**kwargs)
