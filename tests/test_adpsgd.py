"""AD-PSGD (``ADPSGDStrategy``, ``"adpsgd"``) on 2 and 4 forked CPU ranks.

The exchange itself is tested on plain tensors over gloo (no Lightning): after a pair's exchange both
ranks hold the mean of what they sent, bit for bit; the passive rank sends the model it published
last, moved by every mean since; an exchange slower than the steps makes both of its ranks block at
``max_staleness``. Through the Trainer: the passive rank answers while its copy to the host waits for
the step; a rank that sleeps every step does not slow the others down between synchronisation
points; validation and the end of fit see the consensus model; a resume restores every rank's state
as the checkpoint's drain left it; a fit after an exception exchanges again.
"""

from __future__ import annotations

import csv
import math
import os
import time
from datetime import timedelta
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
from _averaging_helpers import Validated, mean, run_ranks
from _strategy_helpers import (
    BATCH,
    TIMEOUT,
    TinyMLP,
    fit,
    keep_master_port,  # noqa: F401  (autouse)
)
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from gtc_lightning import ADPSGDStrategy
from gtc_lightning.algorithms.averaging import coded_exchange
from gtc_lightning.algorithms.averaging.adpsgd import ADPSGDState
from gtc_lightning.algorithms.averaging.pairing import check_world, schedule_peer

SGD = {"momentum": 0.0}


# ---- the pairing --------------------------------------------------------------------------------


def test_ring_schedule_alternates_right_and_left_so_each_round_pairs_disjointly():
    assert [schedule_peer(0, 4, n) for n in range(4)] == [1, 3, 1, 3]
    assert [schedule_peer(2, 4, n) for n in range(4)] == [3, 1, 3, 1]
    assert [schedule_peer(0, 2, n) for n in range(3)] == [1, 1, 1]
    for n in range(6):  # every round: the active ranks' peers are distinct
        peers = [schedule_peer(a, 8, n) for a in (0, 2, 4, 6)]
        assert sorted(peers) == [1, 3, 5, 7]


def test_random_schedule_draws_odd_peers_from_the_seed():
    draws = [schedule_peer(2, 8, n, "random", seed=7) for n in range(64)]
    assert set(draws) == {1, 3, 5, 7}  # every passive rank, no active one
    assert draws == [schedule_peer(2, 8, n, "random", seed=7) for n in range(64)]  # stateless
    assert draws != [schedule_peer(2, 8, n, "random", seed=8) for n in range(64)]
    assert {schedule_peer(0, 3, n, "random") for n in range(16)} == {1}  # an odd world: "random" only
    with pytest.raises(ValueError, match="rank 1 is passive"):
        schedule_peer(1, 4, 0)


@pytest.mark.parametrize(
    ("world", "peering", "message"),
    [(1, "ring", "at least 2 ranks"), (3, "ring", r"even number of ranks; got 3.*peering='random'"),
     (2, "star", r"peering in \('ring', 'random'\), got 'star'")],
)  # fmt: skip
def test_bad_worlds_are_refused_with_the_fix(world, peering, message):
    with pytest.raises(ValueError, match=message):
        check_world(world, peering)


# ---- the exchange on plain tensors (gloo, no Lightning) -------------------------------------------


def _init(rank: int) -> dist.ProcessGroup:
    dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]), timeout=TIMEOUT)
    return dist.new_group(backend="gloo", timeout=TIMEOUT)


def _one_round(rank: int, out_dir: Path) -> dict:
    """Each rank's own random model; one step boundary (the active ranks start their first exchange)
    and a drain; no local step in between."""
    group = _init(rank)
    torch.manual_seed(rank)
    params = [torch.randn(5, 3), torch.randn(7)]
    sent = torch.cat([p.reshape(-1) for p in params]).clone()
    state = ADPSGDState(group, max_staleness=1)
    state.start(params)
    state.after_step(params, [])
    state.drain(params)
    return {"sent": sent, "after": torch.cat([p.reshape(-1) for p in params]), "totals": state.stats()["total"]}


@pytest.mark.parametrize("world", [2, 4])
def test_a_pair_exchange_leaves_both_on_the_mean_of_what_they_sent(tmp_path, world):
    out = run_ranks(tmp_path, _one_round, devices=world, timeout=60)
    for active in range(0, world, 2):
        peer = schedule_peer(active, world, 0)
        expected = (out[active]["sent"] + out[peer]["sent"]) * 0.5
        assert torch.equal(out[active]["after"], expected), f"rank {active}"
        assert torch.equal(out[peer]["after"], expected), f"rank {peer}"
    for rank in out:
        assert rank["totals"]["applied"] == 1 and not torch.equal(rank["after"], rank["sent"])
    total_before = sum(rank["sent"].double() for rank in out)
    total_after = sum(rank["after"].double() for rank in out)
    torch.testing.assert_close(total_after, total_before)  # the pairs moved by opposite amounts


@pytest.mark.parametrize(("n", "k"), [(100_000, 1000), (20_000, 1000), (50_000, 17), (5_000, 2_000), (10, 3)])
def test_the_largest_entries_are_topks_whatever_the_sample_sees(n, k):
    g = torch.Generator().manual_seed(n + k)
    cases = [torch.randn(n, generator=g).abs(), torch.rand(n, generator=g) ** 8]
    stride = max(1, 2 * k // coded_exchange.SAMPLE_ABOVE)
    hidden = torch.zeros(n)  # the sampled entries large, the k largest of all between them
    hidden[::stride] = 1.0
    free = torch.nonzero(hidden == 0).squeeze(1)[:k]
    hidden[free] = 2.0
    cases.append(hidden)
    crowded = torch.rand(n, generator=g)  # the sampled entries the largest: fewer than k may pass (the whole searched)
    crowded[::stride] = 3.0
    cases.append(crowded)
    for magnitude in cases:
        values, indices = coded_exchange.largest(magnitude, k)
        expected = torch.topk(magnitude, k, sorted=False)
        assert torch.equal(torch.sort(values).values, torch.sort(expected.values).values)
        assert torch.equal(magnitude[indices], values) and indices.unique().numel() == k


class _Snapshot(ADPSGDState):
    """Keeps every edge's reference as the synchronisation point drops them."""

    def _forget_references(self) -> None:
        self.kept = {peer: ref.clone() for peer, ref in self._refs.items()}
        super()._forget_references()


def _coded_rounds(rank: int, out_dir: Path, steps: int, density: float, lr: float) -> dict:
    """``steps`` step boundaries of coded exchanges (max_staleness 1: each lands before the next
    starts), each after a local step of ``lr`` times a fixed random direction of this rank."""
    group = _init(rank)
    torch.manual_seed(rank)
    params = [torch.randn(40, 5), torch.randn(60)]
    direction = torch.randn(260)
    start = torch.cat([p.reshape(-1) for p in params]).clone()
    state = _Snapshot(group, max_staleness=1, compress="gtc", density=density)
    phases = []
    for phase in range(2):  # the first from a fit's start (dense first exchanges), the second after a sync point
        state.start(params)
        for _ in range(steps):
            time.sleep(0.002)  # (a step's compute: the passive rank applies its moves as they land)
            with torch.no_grad():
                params[0].add_(lr * direction[:200].view(40, 5))
                params[1].add_(lr * direction[200:])
            state.after_step(params, [])
        state.drain(params)
        phases.append({"totals": dict(state.stats()["total"]), "kept": state.kept, "refs_left": len(state._refs)})
        if phase == 0:
            state.measure_spread(params)
            phases[0]["set"] = {peer: ref.clone() for peer, ref in state._refs.items()}
    return {"start": start, "after": torch.cat([p.reshape(-1) for p in params]), "direction": direction,
            "phases": phases}


@pytest.mark.parametrize("world", [2, 4])
def test_coded_exchanges_keep_the_sum_share_each_pairs_reference_and_reach_consensus(tmp_path, world):
    steps, density, lr = 60, 0.05, 1e-3
    out = run_ranks(tmp_path, _coded_rounds, devices=world, timeout=90, steps=steps, density=density, lr=lr)
    # what the pairs exchanged moved them by opposite amounts: the sum is the start's plus the local steps
    total = sum(r["after"].double() for r in out)
    expected = sum((r["start"] + 2 * steps * lr * r["direction"]).double() for r in out)
    torch.testing.assert_close(total, expected, atol=1e-4, rtol=0)
    # both ranks of every edge hold the same reference, bit for bit, at the end of each phase
    for phase in range(2):
        edges = 0
        for active in range(0, world, 2):
            for peer, ref in out[active]["phases"][phase]["kept"].items():
                assert torch.equal(ref, out[peer]["phases"][phase]["kept"][active]), f"edge {active}-{peer}"
                edges += 1
        assert edges == (1 if world == 2 else 4) and all(r["phases"][phase]["refs_left"] == 0 for r in out)
    # the sync point set every edge's reference to the ranks' mean, the same on every rank
    for r in out:
        for ref in r["phases"][0]["set"].values():
            assert torch.equal(ref, out[0]["phases"][0]["set"][1])
    # the bytes: from the fit's start each edge's first exchange dense (260 fp32), every other one
    # k + 1 int32 words; after the sync point every exchange coded
    k = math.ceil(density * 260)
    for r in out:
        first, both = r["phases"][0]["totals"], r["phases"][1]["totals"]
        dense = 1 if world == 2 else 2
        assert first["bytes_sent"] == dense * 260 * 4 + (first["applied"] - dense) * (k + 1) * 4
        second = both["bytes_sent"] - first["bytes_sent"]
        assert second == (both["applied"] - first["applied"]) * (k + 1) * 4
    # the ranks agree far better than without exchanges: their spread is small next to their start's
    def spread(models):
        stack = torch.stack(models)
        return float((stack - stack.mean(0)).pow(2).mean().sqrt())

    assert spread([r["after"] for r in out]) < 0.05 * spread([r["start"] for r in out])


class _Applied(ADPSGDState):
    """Records every mean (or move) this rank applies, in the order applied, with the step boundary
    that applied it (a drain's: one past the last step)."""

    applied: list

    def _note(self, item):
        self.applied = getattr(self, "applied", [])
        self.applied.append((self.step + 1 if getattr(self, "draining", False) else self.step, item))
        return super()._note(item)

    def drain(self, params):
        self.draining = True
        return super().drain(params)


def _passive_sends(rank: int, out_dir: Path, compress: str, steps: int) -> dict:
    """2 ranks for about ``steps`` x 30 ms: the passive rank steps every 30 ms, the active rank every
    3 ms, and the passive rank's side of each exchange takes 10 ms on the wire after it read the model
    it sends. So several exchanges land between two of the passive rank's boundaries, and some span
    one. Each local step adds a fixed direction. Returns the model published at every boundary and the
    means applied."""
    group = _init(rank)
    if rank % 2:
        wait = ADPSGDState._wait

        def slow(self, works):
            time.sleep(0.01)
            wait(self, works)

        ADPSGDState._wait = slow
    torch.manual_seed(rank)
    params = [torch.randn(40, 5), torch.randn(60)]
    direction = torch.randn(260) * 1e-2
    state = _Applied(group, max_staleness=2, compress=compress, density=0.05)

    def flat():
        return torch.cat([p.detach().reshape(-1) for p in params]).clone()

    state.start(params)
    published = [flat()]
    began = time.perf_counter()
    while (len(published) <= steps) if rank % 2 else (time.perf_counter() - began < steps * 0.03):
        time.sleep(0.03 if rank % 2 else 0.003)
        with torch.no_grad():
            params[0].add_(direction[:200].view(40, 5))
            params[1].add_(direction[200:])
        state.after_step(params, [])
        published.append(flat())
    state.drain(params)
    return {"published": published, "applied": state.applied}


@pytest.mark.parametrize("compress", ["none", "gtc"])
def test_the_passive_sends_its_newest_model_moved_by_every_mean_since(tmp_path, compress):
    """What the passive rank sends for a request: the model it published at its last step boundary
    (the means that landed before it applied), moved by every mean that landed since, in turn."""
    out = run_ranks(tmp_path, _passive_sends, devices=2, timeout=60, compress=compress, steps=20)
    published, applied = out[1]["published"], out[1]["applied"]
    assert len(applied) >= 20, len(applied)  # several exchanges per passive step
    spanned = sum(at > item.sent_step + 1 for at, item in applied)
    assert spanned >= 2, spanned  # a step boundary fell inside some of them
    for i, (_, item) in enumerate(applied):
        view = published[item.sent_step]
        for at, before in applied[:i]:
            if at > item.sent_step:  # landed after that boundary published its model, before this request
                view = view + before.delta if before.delta is not None else before.mean + (view - before.sent)
        assert torch.equal(item.sent, view), f"exchange {i}: the passive rank sent another model"
    if compress == "none":  # and it is what went on the wire: the active rank's mean is of the two
        assert len(out[0]["applied"]) == len(applied)
        for (_, mine), (_, theirs) in zip(out[0]["applied"], applied):
            assert torch.equal(mine.mean, (mine.sent + theirs.sent).mul_(0.5))


def _slow_link(rank: int, out_dir: Path, max_staleness: int, steps: int) -> dict:
    """The passive rank's side of every exchange takes 0.15 s on the wire, after it read the model it
    sends (a slow link); the active rank's steps take 0.01 s, the passive rank's 0.03 s, so that an
    exchange spans about 5 of its steps. Records every step boundary's staleness."""
    group = _init(rank)
    if rank % 2:
        wait = ADPSGDState._wait

        def slow(self, works):
            time.sleep(0.15)
            wait(self, works)

        ADPSGDState._wait = slow
    params = [torch.full((4,), float(rank))]
    state = ADPSGDState(group, max_staleness=max_staleness)
    state.start(params)
    seen = []
    for _ in range(steps):
        time.sleep(0.03 if rank % 2 else 0.01)
        with torch.no_grad():
            params[0].add_(1.0)  # a local step
        state.after_step(params, [])
        seen.append(dict(state.last_staleness))
    state.drain(params)
    return {"seen": seen, "totals": state.stats()["total"]}


def test_both_ranks_of_an_exchange_block_when_it_reaches_max_staleness(tmp_path):
    out = run_ranks(tmp_path, _slow_link, devices=2, timeout=60, max_staleness=3, steps=12)
    active = out[0]
    staleness = [s["staleness"] for s in active["seen"] if s["applied"]]
    assert staleness and max(staleness) == 3, staleness  # in flight 3 steps, then waited for
    assert active["totals"]["staleness_max"] == 3
    assert active["totals"]["blocked_s"] > 0.05
    assert sum(s["applied"] for s in active["seen"]) >= 2  # it went on exchanging
    # The passive rank too: its answer spans ~5 of its steps, but it applies no mean older than 3.
    passive = [s["staleness"] for s in out[1]["seen"] if s["applied"]]
    assert passive and max(passive) <= 3 and out[1]["totals"]["staleness_max"] <= 3, passive
    assert out[1]["totals"]["blocked_s"] > 0.05  # it waited for the exchange at the bound


# ---- through the Trainer ------------------------------------------------------------------------


def _copy_waits_for_the_step(rank: int, out_dir: Path, steps: int, collective: bool) -> dict:
    """One rank of a fit whose every step runs a collective when ``collective`` (the all-reduce of
    ``self.log(..., sync_dist=True)``; ``strategy.reduce`` here) and whose copies of the parameters to the host behave
    as on a GPU: the host queues the step and goes on; a copy waits for the step's kernels, the queued
    collective among them (run inside the copy here), and takes 50 ms. ``max_staleness=1``: the active
    rank waits for every exchange at its next step boundary, before its copy."""
    world = 2
    pending: list[torch.Tensor] = []

    class Collective(TinyMLP):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            if collective:
                pending.append(loss.detach())  # queued with the step: the next host copy waits for it
            return loss

    copy = ADPSGDState._flat

    def device_copy(self, params):
        while pending:
            trainer.strategy.reduce(pending.pop(0), reduce_op="mean")
        time.sleep(0.05)
        return copy(self, params)

    ADPSGDState._flat = device_copy
    strategy = ADPSGDStrategy(max_staleness=1, timeout=timedelta(seconds=10))  # a hang fails in 10 s
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=out_dir,
    )  # fmt: skip
    trainer.fit(Collective(samples=world * steps * BATCH, momentum=0.0))
    return {"global_step": trainer.global_step, "totals": strategy.adpsgd_state.stats()["total"]}


@pytest.mark.parametrize("collective", [True, False], ids=["collective", "none"])
def test_the_passive_answers_while_its_host_copy_waits_for_the_step(tmp_path, collective):
    """The passive rank's copies to and from the host run outside the lock its thread takes, so the
    thread answers while a copy waits. With a collective in every step the ranks would otherwise wait
    on each other in a cycle (the passive rank's copy for the active rank's collective, the active
    rank for its exchange, the exchange for the lock): both hung at step 3 until the timeout. Without
    one, the active rank would wait for the passive rank's copies (0.42 s over the 8 steps; 0.006 s
    with the copies outside the lock)."""
    steps = 8
    out = run_ranks(tmp_path, _copy_waits_for_the_step, devices=2, timeout=60, steps=steps, collective=collective)
    assert [rank["global_step"] for rank in out] == [steps, steps]
    active = out[0]["totals"]
    assert active["applied"] >= steps - 1  # max_staleness=1: each exchange lands by the next boundary
    assert active["blocked_s"] < 0.02 * steps, active["blocked_s"]  # the exchange itself: ~1 ms




def test_stats_are_logged_and_validation_sees_the_average_of_the_drained_ranks(tmp_path):
    """2 ranks, 2 epochs of 4 steps; a checkpoint after each epoch's last step (a synchronisation
    point), validation after each epoch."""
    every = ModelCheckpoint(dirpath=tmp_path / "every", every_n_train_steps=4, save_top_k=-1)
    trainer_kwargs = {"logger": CSVLogger(save_dir=tmp_path, name="csv"), "enable_checkpointing": True,
                      "callbacks": [every], "num_sanity_val_steps": 0}  # fmt: skip
    trainer, ranks = fit(tmp_path, strategy=ADPSGDStrategy, model=Validated(tmp_path, **SGD),
                         trainer_kwargs=trainer_kwargs, max_staleness=2)  # fmt: skip
    assert [len(rank["records"]) for rank in ranks] == [8, 8]
    losses = torch.tensor([[rec["loss"] for rec in rank["records"]] for rank in ranks])  # [rank, step]
    assert losses[:, 4:].mean() < 0.85 * losses[:, :4].mean(), losses  # it learns (0.68-0.74 measured)
    pairs = zip(ranks[0]["records"], ranks[1]["records"])
    assert any(not torch.equal(a["params"], b["params"]) for a, b in pairs)  # the replicas drift between syncs
    seen = [torch.load(tmp_path / f"seen{r}.pt") for r in range(2)]
    for k, step in enumerate((4, 8)):  # the checkpoint drained; validation averaged what it left
        ckpt = tmp_path / "every" / f"epoch={k}-step={step}.ckpt"
        own = [torch.load(f"{ckpt}.adpsgd/rank{r}.pt", weights_only=False)["state_dict"] for r in range(2)]
        own = [torch.cat([v.reshape(-1) for v in state.values()]) for state in own]
        assert torch.equal(seen[0][k], mean(own)) and torch.equal(seen[1][k], mean(own)), f"validation {k}"
        saved = torch.load(ckpt, weights_only=False)
        assert torch.equal(torch.cat([v.reshape(-1) for v in saved["state_dict"].values()]), mean(own))
        assert saved["adpsgd"]["step"] == step and 1 <= saved["adpsgd"]["exchanges"] <= step  # rank 0's
    (metrics,) = Path(trainer.default_root_dir).rglob("metrics.csv")
    rows = list(csv.DictReader(metrics.read_text().splitlines()))
    steps = [row for row in rows if row.get("adpsgd/staleness")]
    assert len(steps) == 8
    assert all(0 <= float(row["adpsgd/staleness"]) <= 2 for row in steps)
    assert float(steps[-1]["adpsgd/staleness_max"]) <= 2
    # rank 0's (the one logged): how many land depends on the threads' timing (3 of 8 on a loaded machine),
    # but with max_staleness=2 an exchange is applied at the latest 2 steps after it was sent, so at least 2
    assert sum(float(row["adpsgd/applied"]) for row in steps) >= 2
    spreads = [float(row["adpsgd/spread"]) for row in rows if row.get("adpsgd/spread")]
    assert len(spreads) == 2  # measured at each epoch's first synchronisation point, the checkpoint
    for k, logged in enumerate(spreads):
        own = [torch.load(tmp_path / "every" / f"epoch={k}-step={4 * k + 4}.ckpt.adpsgd" / f"rank{r}.pt",
                          weights_only=False)["state_dict"] for r in range(2)]  # fmt: skip
        own = [torch.cat([v.reshape(-1) for v in state.values()]).double() for state in own]
        center = (own[0] + own[1]) / 2
        expected = math.sqrt(sum(float((x - center).pow(2).mean()) for x in own) / 2)
        assert logged == pytest.approx(expected, rel=1e-4, abs=1e-9)


class Slow(TinyMLP):
    """One rank sleeps ``seconds`` in every training step; every rank records when each batch ends and
    how many means it had applied by then."""

    def __init__(self, out_dir: Path, slow_rank: int, seconds: float, **kwargs):
        super().__init__(**kwargs)
        self.out_dir, self.slow_rank, self.seconds, self.ends = Path(out_dir), slow_rank, seconds, []

    def training_step(self, batch, batch_idx):
        if self.global_rank == self.slow_rank:
            time.sleep(self.seconds)
        return super().training_step(batch, batch_idx)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.ends.append(time.perf_counter())
        self.applied = self.trainer.strategy.sync_stats["total"]["applied"]

    def on_train_epoch_start(self):
        self.began = time.perf_counter()

    def on_train_epoch_end(self):  # after the epoch end's synchronisation point (the strategy's callback runs first)
        out = {"took": self.ends[-1] - self.began, "applied": self.applied}  # (applied: by the last batch's end)
        torch.save(out, self.out_dir / f"slow{self.global_rank}.pt")


@pytest.mark.parametrize(("world", "slow_rank"), [(2, 1), (2, 0), (4, 1)])
def test_a_slow_rank_does_not_slow_the_others_between_synchronisation_points(tmp_path, world, slow_rank):
    """One rank sleeps 0.5 s a step for 6 steps: the others run their 6 steps (and their exchanges,
    some with the slow rank) in well under half its time, then wait for it at the epoch's end."""
    steps, seconds = 6, 0.5
    model = Slow(tmp_path, slow_rank, seconds, samples=world * steps * BATCH, **SGD)
    fit(tmp_path, strategy=ADPSGDStrategy, devices=world, max_epochs=1, model=model)
    out = [torch.load(tmp_path / f"slow{r}.pt") for r in range(world)]
    slow = out[slow_rank]["took"]
    assert slow >= steps * seconds
    for rank, got in enumerate(out):
        # Means applied between the synchronisation points, at the ranks' own step boundaries: on every
        # active rank (a slow passive rank's thread answers at once) and on the slow rank (the means of
        # its sleeps). A fast passive rank may be done before a slow active rank's first request.
        if rank % 2 == 0 or rank == slow_rank:
            assert got["applied"] >= 1, f"rank {rank} applied no mean before the epoch's end"
        if rank != slow_rank:
            assert got["took"] < 0.5 * slow, f"rank {rank} took {got['took']:.2f} s, the slow rank {slow:.2f} s"


def _fit_checkpoint_resume(rank: int, out_dir: Path, world: int, compress: str = "none") -> dict:
    """One rank of: 1 epoch with a checkpoint at its 4th (last) step, then a new Trainer that resumes
    from it for a second epoch. Returns what the test compares with the checkpoint's shards."""

    class Started(L.Callback):
        def on_train_start(self, trainer, pl_module):
            optimizer = trainer.optimizers[0]
            self.start = {
                "params": torch.cat([p.detach().reshape(-1) for p in pl_module.parameters()]).clone(),
                "momentum": torch.cat(
                    [optimizer.state[p]["momentum_buffer"].reshape(-1) for p in pl_module.parameters()]
                ).clone(),
                "step": trainer.strategy.adpsgd_state.step,
                "exchanges": trainer.strategy.adpsgd_state.exchanges,
            }

    def trainer(max_epochs: int, callbacks: list) -> L.Trainer:
        return L.Trainer(
            accelerator="cpu", devices=world, strategy=ADPSGDStrategy(compress=compress, density=0.1, timeout=TIMEOUT),
            max_epochs=max_epochs,
            logger=False, enable_checkpointing=bool(callbacks), callbacks=callbacks, enable_progress_bar=False,
            enable_model_summary=False, default_root_dir=out_dir,
        )  # fmt: skip

    samples = world * 4 * BATCH
    first = trainer(1, [ModelCheckpoint(dirpath=out_dir / "ckpt", every_n_train_steps=4, save_top_k=-1)])
    model = TinyMLP(samples=samples)
    first.fit(model)
    final = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    # each rank's own model at the end, and the consensus (none kept where the ranks' models agreed)
    own, average = first.strategy._at_end or (final.clone(), final.clone())
    started = Started()
    second = trainer(2, [started])
    second.fit(TinyMLP(samples=samples), ckpt_path=str(out_dir / "ckpt" / "epoch=0-step=4.ckpt"))
    return {"own": own, "average": average, "final": final, "start": started.start,
            "global_step": second.global_step, "state": second.strategy.adpsgd_state.state_dict(),
            "totals": [first.strategy.adpsgd_state.stats()["total"], second.strategy.adpsgd_state.stats()["total"]],
            "numel": final.numel()}  # fmt: skip


@pytest.mark.parametrize(("world", "compress"), [(2, "none"), (4, "none"), (2, "gtc")])
def test_consensus_at_the_end_and_a_bit_exact_resume(tmp_path, world, compress):
    out = run_ranks(tmp_path, _fit_checkpoint_resume, devices=world, timeout=90, world=world, compress=compress)
    ckpt = tmp_path / "ckpt" / "epoch=0-step=4.ckpt"
    own = [rank["own"] for rank in out]
    for rank in out:  # the end of fit: every rank on the mean of the ranks' own models
        assert torch.equal(rank["final"], out[0]["final"])
        if world == 2:
            assert torch.equal(rank["final"], mean(own))
        else:
            torch.testing.assert_close(rank["final"], mean(own), rtol=0, atol=1e-6)
    for r, rank in enumerate(out):
        shard = torch.load(f"{ckpt}.adpsgd/rank{r}.pt", weights_only=False)
        saved = torch.cat([v.reshape(-1) for v in shard["state_dict"].values()])
        # The checkpoint was the last step: its drain left each rank's own model as fit ended with it.
        assert torch.equal(saved, rank["own"].float())
        assert torch.equal(rank["start"]["params"], saved), f"rank {r}: resumed parameters"
        momentum = torch.cat([s["momentum_buffer"].reshape(-1) for s in shard["optimizers"][0]["state"].values()])
        assert torch.equal(rank["start"]["momentum"], momentum), f"rank {r}: resumed optimizer state"
        assert rank["start"]["step"] == shard["averaging"]["step"] == 4
        exchanges = shard["averaging"]["exchanges"]  # the schedule's position: one a landed exchange
        assert rank["start"]["exchanges"] == exchanges and (1 <= exchanges <= 4 if r % 2 == 0 else exchanges == 0)
        assert rank["global_step"] == 8 and rank["state"]["step"] == 8
        assert rank["state"]["exchanges"] > exchanges or r % 2  # the schedule went on from there
        if compress == "gtc":  # each fit set the references as it started: every exchange coded
            words = math.ceil(0.1 * rank["numel"]) + 1
            for totals in rank["totals"]:
                assert totals["applied"] >= 1 and totals["bytes_sent"] == totals["applied"] * words * 4


def _fit_after_an_exception(rank: int, out_dir: Path, compress: str) -> dict:
    """One rank of: a fit whose training step raises at step 3 on every rank, then ``fit`` again on the
    same Trainer and model (a script that catches the error and goes on)."""
    world, steps = 2, 4

    class FailsOnce(TinyMLP):
        failed = False

        def training_step(self, batch, batch_idx):
            if self.global_step == 2 and not self.failed:
                self.failed = True
                raise RuntimeError("a failing step")
            return super().training_step(batch, batch_idx)

    strategy = ADPSGDStrategy(compress=compress, density=0.1, timeout=timedelta(seconds=10))  # a hang fails in 10 s
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=out_dir,
    )  # fmt: skip
    model = FailsOnce(samples=world * steps * BATCH, momentum=0.0)
    with pytest.raises(RuntimeError, match="a failing step"):
        trainer.fit(model)
    applied = strategy.adpsgd_state.stats()["total"]["applied"]
    trainer.fit(model)
    final = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"applied": [applied, strategy.adpsgd_state.stats()["total"]["applied"]], "final": final,
            "running": strategy.adpsgd_state.running}  # fmt: skip


@pytest.mark.parametrize("compress", ["none", "gtc"])
def test_a_fit_after_an_exception_exchanges_on_a_thread_of_its_own(tmp_path, compress):
    """The exception leaves the passive rank's thread blocked in the first fit's group; the second
    fit starts one of its own (and, coded, every rank sets its references): it exchanges and ends on
    the consensus."""
    out = run_ranks(tmp_path, _fit_after_an_exception, devices=2, timeout=60, compress=compress)
    for rank in out:
        assert rank["applied"][1] > rank["applied"][0], rank["applied"]  # the second fit's exchanges landed
        assert not rank["running"] and torch.equal(rank["final"], out[0]["final"])


def _resume_from_shards_of_different_steps(rank: int, out_dir: Path) -> list[str]:
    """One rank of: a fit of 4 steps with a checkpoint at the last; rank 1 sets its shard's step to 5,
    as a SIGTERM to every rank leaves it when rank 1 stopped a batch later (its model one step further);
    then a resume. Returns what this rank logged as warnings."""
    import logging

    world = 2

    def trainer(callbacks: list) -> L.Trainer:
        return L.Trainer(
            accelerator="cpu", devices=world, strategy=ADPSGDStrategy(timeout=TIMEOUT), max_epochs=1, logger=False,
            enable_checkpointing=bool(callbacks), callbacks=callbacks, enable_progress_bar=False,
            enable_model_summary=False, default_root_dir=out_dir,
        )  # fmt: skip

    samples = world * 4 * BATCH
    trainer([ModelCheckpoint(dirpath=out_dir / "ckpt", every_n_train_steps=4, save_top_k=-1)]).fit(
        TinyMLP(samples=samples)
    )
    ckpt = out_dir / "ckpt" / "epoch=0-step=4.ckpt"
    if rank == 1:
        shard_path = f"{ckpt}.adpsgd/rank1.pt"
        shard = torch.load(shard_path, weights_only=False)
        shard["averaging"]["step"] = 5
        torch.save(shard, shard_path)
    warnings: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            warnings.append(record.getMessage())

    logger = logging.getLogger("gtc_lightning.strategies.adpsgd")
    logger.addHandler(handler := Keep(level=logging.WARNING))
    try:
        trainer([]).fit(TinyMLP(samples=samples), ckpt_path=str(ckpt))
    finally:
        logger.removeHandler(handler)
    return warnings


def test_a_resume_from_shards_of_different_steps_says_what_follows(tmp_path):
    out = run_ranks(tmp_path, _resume_from_shards_of_different_steps, devices=2, timeout=60)
    assert not [w for w in out[0] if "shard is at step" in w]
    (said,) = [w for w in out[1] if "shard is at step" in w]
    assert "rank 1's shard is at step 5, the checkpoint (rank 0's" in said and "at step 4" in said, said
    assert "repeats 1 batch(es)" in said and "stays 1 apart" in said, said


def test_warmup_steps_are_dense_and_identical_then_the_ranks_step_alone(tmp_path):
    _, ranks = fit(tmp_path, strategy=ADPSGDStrategy, warmup_steps=2, max_epochs=1, model_kwargs=SGD)
    for t in range(2):  # DDP's all-reduce: the same averaged gradient on both ranks
        assert torch.equal(ranks[0]["records"][t]["params"], ranks[1]["records"][t]["params"])
        assert not torch.equal(ranks[0]["records"][t]["local_grad"], ranks[1]["records"][t]["local_grad"])
    # Then each rank's own gradient: its parameters leave the other's (the means land later).
    assert not torch.equal(ranks[0]["records"][2]["params"], ranks[1]["records"][2]["params"])


# ---- settings -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"max_staleness": 0}, r"max_staleness to be an int >= 1.*got 0"),
     ({"max_staleness": 1.5}, "max_staleness"),
     ({"peering": "star"}, r"peering in \('ring', 'random'\).*got 'star'"),
     ({"seed": -1}, r"seed to be an int >= 0"),
     ({"warmup_steps": -1}, "warmup_steps"),
     ({"process_group": object()}, r"process_group=.*Remove process_group"),
     ({"static_graph": True}, r"static_graph=True cannot be kept.*Remove static_graph"),
     ({"ddp_comm_hook": print}, "own DDP communication hook"),
     ({"compress": "zip"}, r"compress in \('none', 'gtc'\).*got 'zip'"),
     ({"compress": "gtc", "density": 0}, r"density=0 must be a number in \(0, 1\]")],
)  # fmt: skip
def test_bad_settings_name_the_value_and_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ADPSGDStrategy(**kwargs)


def test_worlds_the_pairing_cannot_serve_are_refused_as_the_trainer_is_built():
    with pytest.raises(ValueError, match="at least 2 ranks"):
        L.Trainer(strategy=ADPSGDStrategy(), accelerator="cpu", devices=1, logger=False)
    with pytest.raises(ValueError, match=r"even number of ranks; got 3"):
        L.Trainer(strategy=ADPSGDStrategy(), accelerator="cpu", devices=3, logger=False)
    trainer = L.Trainer(strategy=ADPSGDStrategy(peering="random"), accelerator="cpu", devices=3, logger=False)
    assert trainer.strategy.peering == "random"


@pytest.mark.parametrize("name", ["adpsgd", "adpsgd_spawn", "adpsgd_fork", "adpsgd_fork_find_unused_parameters_true"])
def test_registered_names(name):
    trainer = L.Trainer(strategy=name, accelerator="cpu", devices=2, logger=False, enable_progress_bar=False)
    assert isinstance(trainer.strategy, ADPSGDStrategy)


def test_fabric_says_it_is_a_trainer_strategy():
    with pytest.raises(ValueError, match=r"adpsgd is a Lightning Trainer strategy only"):
        L.Fabric(accelerator="cpu", devices=2, strategy="adpsgd")



# ---- the tools ----------------------------------------------------------------------------------


def test_bench_cluster_replays_the_ring_schedules_pairs_and_the_scaling_model_one_peer():
    from gtc_lightning.tools import bench_cluster, scaling
    from gtc_lightning.tools.bench_cluster import pair_peer, parse_strategy

    for world in (2, 4, 8):
        for step in range(4):
            peers = [pair_peer(r, world, step) for r in range(world)]
            assert all(peers[peers[r]] == r and (r + peers[r]) % 2 for r in range(world)), (world, step, peers)
            assert peers[0] == schedule_peer(0, world, step)
    (pair,) = scaling.collectives("adpsgd", 4, scaling.Messages(numel=1000))
    assert (pair.kind, pair.size, pair.group) == ("neighbours", 4000, 1) and "adpsgd" in scaling.OVERLAPPED
    asked = [parse_strategy("adpsgd:max_staleness=4"), parse_strategy("dpsgd")]
    assert [s["label"] for s in bench_cluster._strategies_for(3, asked)] == ["dpsgd", "nocomm"]  # the ring needs an even world
    assert [s["label"] for s in bench_cluster._strategies_for(4, asked)] == ["adpsgd:max_staleness=4", "dpsgd", "nocomm"]
    coded = parse_strategy("adpsgd:compress=gtc,density=0.02")
    assert bench_cluster.adpsgd_words(coded, 1000) == 20 and bench_cluster.adpsgd_words(asked[0], 1000) == 0
    (pair,) = scaling.collectives("adpsgd", 4, scaling.Messages(numel=1000, words=20))
    assert pair.size == 4 * 21  # the words and tau
