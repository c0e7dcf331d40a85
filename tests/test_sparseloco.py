"""The compressed block sync (``"sparseloco"``) and the DiLoCo name (``"diloco"``).

The state is driven directly on 2 forked gloo ranks (no Lightning) with synthetic local steps, so that
every number can be checked against what the test itself knows each rank did; then 2-rank Lightning
runs (the tiny MLP) check the strategy: replicas bit-identical after each sync, a bit-exact resume.
"""

import lightning as L
import pytest
import torch
import torch.distributed as dist
from _averaging_helpers import fit_recorded, run_ranks
from _strategy_helpers import TinyMLP, keep_master_port  # noqa: F401  (autouse: the fork launcher sets MASTER_PORT)
from lightning.pytorch.callbacks import ModelCheckpoint

from gtc_lightning import BMUFStrategy, SparseLoCoStrategy
from gtc_lightning.algorithms.averaging.bmuf import BMUFState
from gtc_lightning.algorithms.common import allreduce_bytes, parameter_checksums
from gtc_lightning.algorithms.sparseloco import SparseLoCoState, decode_values, select_
from gtc_lightning.ops.rice import rice_decode, rice_encode
from gtc_lightning.ops.torch_ops import INDEX_MASK

K = 3  # block syncs after steps 3 and 6 of the Lightning runs' 8


# ---- one rank's selection, by hand ------------------------------------------------------------------


@pytest.mark.parametrize("values", ["sign", "2bit", "float32"])
def test_selection_takes_what_it_sends_off_the_residual(values):
    """Words of ``|r| > tau`` in ascending order; decoded value + new residual = old residual."""
    g = torch.Generator().manual_seed(0)
    residual = torch.randn(5000, generator=g)
    old = residual.clone()
    words, payload, a, b, bad = select_(residual, 1.5, values)
    index = (words & INDEX_MASK).long()
    assert bad == 0 and torch.equal(index, torch.nonzero(old.abs() > 1.5).squeeze(1))
    assert torch.equal(words < 0, old[index] < 0)
    sent = decode_values(words, payload, a, b, values)
    assert torch.allclose(sent + residual[index], old[index], rtol=0, atol=1e-6)
    untouched = torch.ones(5000, dtype=torch.bool)
    untouched[index] = False
    assert torch.equal(residual[untouched], old[untouched])
    if values == "sign":
        assert (a, b, payload.numel()) == (1.5, 0.0, 0) and torch.equal(
            sent.abs(), torch.full_like(sent, 1.5)
        )
    elif values == "2bit":  # two magnitudes, each the mean of its half; the level bits packed 32 a word
        assert 1.5 < a < b and payload.numel() == 4 * ((words.numel() + 31) // 32)
        upper = old[index].abs() > old[index].abs().mean()
        assert torch.allclose(torch.tensor([a, b]), torch.stack([old[index].abs()[~upper].mean(),
                                                                 old[index].abs()[upper].mean()]))  # fmt: skip
    else:
        assert torch.equal(sent, old[index]) and torch.equal(residual[index], torch.zeros(index.numel()))
    assert torch.equal(rice_decode(rice_encode(words)), words)


# ---- the state on 2 forked gloo ranks, without Lightning -------------------------------------------


def local_moves(rank: int, syncs: int, n: int, scale: float = 1e-2) -> list[torch.Tensor]:
    """What each rank's local steps move its model by in each block (a fixed draw per rank and block)."""
    g = torch.Generator().manual_seed(100 + rank)
    return [scale * torch.randn(n, generator=g) * torch.linspace(0.1, 3.0, n) for _ in range(syncs)]


def drive(rank, out_dir, n=4096, syncs=4, dense=False, world=2, **options):
    """``syncs`` blocks of one optimizer step each (period 1): the model moves by this rank's draw, then
    the state syncs. Returns the parameters after each sync, the stats, the residual, the moves."""
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    params = [torch.randn(n // 4, 4)]
    if dense:
        state = BMUFState(period=1, block_momentum=options.get("block_momentum", 0.0),
                          block_lr=options.get("block_lr", 1.0), nesterov=options.get("nesterov", True))  # fmt: skip
    else:
        state = SparseLoCoState(period=1, **{"block_momentum": 0.0, **options})
    state.begin(params)
    start = params[0].detach().reshape(-1).clone()
    after, stats = [], []
    for move in local_moves(rank, syncs, n):
        with torch.no_grad():
            params[0].add_(move.view_as(params[0]))
        stats.append(state.after_step(params, []))
        after.append(params[0].detach().reshape(-1).clone())
    residual = getattr(state, "residual", None)
    result = {"start": start, "after": after, "stats": stats, "totals": dict(state.totals), "residual": residual,
              "checksums": parameter_checksums(params)}  # fmt: skip
    dist.destroy_process_group()
    return result


@pytest.mark.parametrize(("values", "world"), [("sign", 2), ("2bit", 2), ("2bit", 4)])
def test_replicas_bit_identical_and_error_feedback_conserves(tmp_path, values, world):
    """Without outer momentum (η = 0, ζ = 1) the model moves by the decoded mean d each sync, so after
    all syncs: model - start = Σ d = mean over ranks of (Σ block updates - residual), for every element.
    With 4 ranks the order of the float additions matters: every rank must decode in rank order."""
    ranks = run_ranks(tmp_path, drive, devices=world, world=world, values=values, density=0.05)
    a, b = ranks[:2]
    for r, rank in enumerate(ranks[1:], start=1):
        for t, (x, y) in enumerate(zip(a["after"], rank["after"]), start=1):
            assert torch.equal(x, y), f"rank {r}'s parameters differ from rank 0's after sync {t}"
        assert torch.equal(a["checksums"], rank["checksums"])
    # The block update of each sync is the rank's move (every block starts where the last sync left it).
    owed = [sum(local_moves(r, 4, 4096)) - rank["residual"] for r, rank in enumerate(ranks)]
    moved = a["after"][-1] - a["start"]
    assert torch.allclose(moved, sum(owed) / world, rtol=0, atol=2e-6)
    assert 0 < a["residual"].abs().max() and not torch.equal(a["residual"], b["residual"])
    # About density * n words a rank and sync (the threshold is the quantile of the whole residual here).
    assert all(4 * 0.05 * 4096 <= rank["totals"]["words"] <= 4 * 0.06 * 4096 for rank in ranks)


@pytest.mark.parametrize("coding", ["rice", "none"])
def test_a_padded_all_gather_gives_the_all_to_alls_parameters(tmp_path, coding):
    """gloo's default is the all-to-all of uneven payloads; the padded all-gather (NCCL's default)
    carries the same words, decoded in the same order: the same parameters, bit for bit."""
    options = {"values": "2bit", "density": 0.05, "coding": coding}
    alltoall = run_ranks(tmp_path / "a", drive, exchange="alltoall", **options)
    allgather = run_ranks(tmp_path / "g", drive, exchange="allgather", **options)
    for x, y in zip(
        alltoall[0]["after"] + alltoall[1]["after"], allgather[0]["after"] + allgather[1]["after"]
    ):
        assert torch.equal(x, y)
    assert (
        allgather[0]["totals"]["bytes_sent"] >= alltoall[0]["totals"]["bytes_sent"]
    )  # padded to the longest


def test_without_error_feedback_the_unsent_update_is_lost(tmp_path):
    """error_decay=0 keeps nothing between syncs: conservation above fails by the residual (the test of
    conservation can fail)."""
    ranks = run_ranks(tmp_path, drive, values="sign", density=0.05, error_decay=0.0)
    owed = [sum(local_moves(r, 4, 4096)) - rank["residual"] for r, rank in enumerate(ranks)]
    moved = ranks[0]["after"][-1] - ranks[0]["start"]
    assert not torch.allclose(moved, (owed[0] + owed[1]) / 2, rtol=0, atol=1e-3)


def diverge_on_rank_1(rank, out_dir):
    """Rank 1's model holds a NaN at the first sync."""
    dist.init_process_group("gloo", rank=rank, world_size=2)
    params = [torch.zeros(64)]
    state = SparseLoCoState(period=1, block_momentum=0.0, density=0.1)
    state.begin(params)
    with torch.no_grad():
        params[0].add_(0.1 * torch.arange(64.0))
        if rank == 1:
            params[0][5] = float("nan")
    state.after_step(params, [])


def test_a_nan_in_a_block_update_stops_every_rank_before_the_payload(tmp_path):
    with pytest.raises(RuntimeError) as failure:
        run_ranks(tmp_path, diverge_on_rank_1, timeout=60)
    message = str(failure.value)
    assert message.count("NaN or Inf on rank(s) [1]") == 2, message  # both ranks raise, neither hangs


@pytest.mark.parametrize(
    "outer",
    [{"block_momentum": 0.0, "block_lr": 1.0}, {"block_momentum": 0.9, "block_lr": 0.7, "nesterov": True}],
    ids=["sparseloco-outer", "diloco-outer"],
)
def test_float32_values_at_density_1_equal_dense_bmuf(tmp_path, outer):
    dense = run_ranks(tmp_path / "dense", drive, dense=True, **outer)
    sparse = run_ranks(tmp_path / "sparse", drive, values="float32", density=1.0, coding="rice", **outer)
    for t, (x, y) in enumerate(zip(dense[0]["after"], sparse[0]["after"]), start=1):
        assert torch.allclose(x, y, rtol=1e-6, atol=1e-6), f"sync {t}: {float((x - y).abs().max())}"
        assert not torch.equal(x, dense[0]["start"])
    assert torch.equal(sparse[0]["after"][-1], sparse[1]["after"][-1])
    assert float(sparse[0]["residual"].abs().max()) == 0.0  # everything sent, exactly


def test_bytes_counted_and_far_below_a_dense_all_reduce(tmp_path):
    """With 32-bit words and 1-bit values the bytes are exact: a header of 6 int64 and 4 bytes a word to
    the one peer. At the defaults (2 bits, Rice coding, density 1/64) a sync costs a small fraction of
    one dense fp32 all-reduce of the model (BMUF's sync)."""
    n = 1 << 16
    plain = run_ranks(tmp_path / "plain", drive, n=n, syncs=2, values="sign", coding="none", density=1 / 64)
    for rank in plain:
        words = rank["totals"]["words"]
        assert rank["totals"]["bytes_sent"] == 2 * 6 * 8 + 4 * words
        assert rank["totals"]["syncs"] == 2
    default = run_ranks(tmp_path / "default", drive, n=n, syncs=2)  # values="2bit", coding="rice"
    dense = allreduce_bytes(n, 2)
    for rank in default:
        per_sync = rank["totals"]["bytes_sent"] / 2
        assert per_sync < dense / 100, (per_sync, dense)
        bits_per_word = 8 * (per_sync - 6 * 8) / (rank["totals"]["words"] / 2)
        assert bits_per_word < 10, bits_per_word  # Rice-coded gaps + sign (~8 bits at 1/64) + 1 level bit
    assert default[0]["stats"][0].bytes_received == default[1]["stats"][0].bytes_sent


# ---- the strategy in Lightning: 2 forked ranks, the tiny MLP ----------------------------------------


SPARSE = {"period": K, "density": 0.1, "values": "2bit", "model_kwargs": {"momentum": 0.0}}


def test_strategy_replicas_identical_after_each_sync_and_bytes_logged(tmp_path):
    _, ranks, syncs = fit_recorded(tmp_path, SparseLoCoStrategy, **SPARSE)
    for t in range(1, 9):
        same = torch.equal(ranks[0]["records"][t - 1]["params"], ranks[1]["records"][t - 1]["params"])
        assert same == (t % K == 0), f"step {t}"
    assert [rec["last"]["mode"] for rec in syncs[0]] == ["local", "local", "sync"] * 2 + ["local"] * 2
    numel = sum(p.numel() for p in TinyMLP().parameters())
    sent = syncs[0][K - 1]["last"]["bytes_sent"]
    assert 0 < sent < allreduce_bytes(numel, 2) / 4 and syncs[0][-1]["total"]["words"] > 0


def fit_twice(tmp_path, **kwargs):
    """The uninterrupted run, and the first epoch with a checkpoint at step 4 (between syncs) resumed."""
    _, full, _ = fit_recorded(tmp_path / "full", SparseLoCoStrategy, **kwargs)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    trainer_kwargs = {"enable_checkpointing": True, "callbacks": [checkpoint]}
    fit_recorded(
        tmp_path / "part1", SparseLoCoStrategy, max_epochs=1, trainer_kwargs=trainer_kwargs, **kwargs
    )
    path = tmp_path / "ckpt" / "last.ckpt"
    _, resumed, _ = fit_recorded(tmp_path / "resumed", SparseLoCoStrategy, ckpt_path=str(path), **kwargs)
    return full, resumed, path


def test_resume_is_bit_exact_with_every_ranks_residual_in_its_shard(tmp_path):
    """SGD with momentum 0.9 (every rank's own buffers), outer momentum on: each rank's residual differs and
    must come back from its own shard for steps 5-8 to repeat the uninterrupted run bit for bit."""
    kwargs = {**SPARSE, "model_kwargs": {}, "block_momentum": 0.5, "block_lr": 0.5}
    full, resumed, path = fit_twice(tmp_path, **kwargs)
    shards = [torch.load(f"{path}.sparseloco/rank{r}.pt", weights_only=False)["averaging"] for r in range(2)]
    assert all(shard["step"] == 4 for shard in shards)
    assert shards[0]["residual"].abs().max() > 0 and not torch.equal(
        shards[0]["residual"], shards[1]["residual"]
    )
    assert torch.equal(shards[0]["global_params"], shards[1]["global_params"])
    for r, (a, b) in enumerate(zip(resumed, full)):
        assert torch.equal(a["start"]["params"], b["records"][3]["params"]), (
            f"rank {r} did not get its own model"
        )
        assert [rec["global_step"] for rec in a["records"]] == [5, 6, 7, 8]
        for t, (x, y) in enumerate(zip(a["records"], b["records"][4:]), start=5):
            assert torch.equal(x["params"], y["params"]), (
                f"rank {r}: step {t} differs from the uninterrupted run"
            )


# ---- options and names --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"density": 0.0}, r"density in \(0, 1\].*got 0.0"),
        ({"density": 1.5}, r"density in \(0, 1\].*e.g. density=0.02"),
        ({"density": True}, "density"),
        ({"values": "4bit"}, r"values in \('sign', '2bit', 'float32'\).*got '4bit'"),
        ({"coding": "zip"}, r"coding in \('none', 'rice'\).*got 'zip'"),
        ({"error_decay": 1.5}, r"error_decay in \[0, 1\].*got 1.5"),
        ({"exchange": "ring"}, "exchange"),
        ({"optimizer_state": "average"}, r"densely.*use 'keep' \(DiLoCo, SparseLoCo\) or 'reset'"),
        ({"block_lr": 0.0}, r"block_lr \(ζ\)"),
        ({"block_momentum": 1.0}, r"block_momentum \(η\) in \[0, 1\)"),
        ({"period": 0}, "period"),
    ],
)
def test_bad_options_are_refused_with_the_value_and_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SparseLoCoStrategy(**kwargs)


@pytest.mark.parametrize(
    ("name", "cls", "expected", "start_method"),
    [
        ("diloco", BMUFStrategy, {"period": 500, "block_lr": 0.7, "block_momentum": 0.9, "nesterov": True}, "popen"),
        ("diloco_fork", BMUFStrategy, {"period": 500, "block_lr": 0.7, "block_momentum": 0.9}, "fork"),
        ("sparseloco", SparseLoCoStrategy, {"period": 30, "density": 1 / 64, "values": "2bit", "coding": "rice",
                                            "block_momentum": 0.0, "block_lr": 1.0, "error_decay": 1.0}, "popen"),
        ("sparseloco_spawn_find_unused_parameters_true", SparseLoCoStrategy, {"block_momentum": 0.0}, "spawn"),
    ],
)  # fmt: skip
def test_registered_names_resolve_to_the_papers_defaults(name, cls, expected, start_method):
    trainer = L.Trainer(strategy=name, accelerator="cpu", devices=2, logger=False, enable_progress_bar=False)
    strategy = trainer.strategy
    assert type(strategy) is cls and strategy._start_method == start_method
    assert {key: getattr(strategy, key) for key in expected} == expected
    assert strategy._ddp_kwargs.get("find_unused_parameters", False) is name.endswith("_true")


def test_fabric_refuses_the_names():
    for name in ("diloco", "sparseloco_fork"):
        with pytest.raises(ValueError, match=f"{name} is a Lightning Trainer strategy only"):
            L.Fabric(accelerator="cpu", devices=1, strategy=name)
