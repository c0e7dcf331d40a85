"""The model suite (``gtc_lightning.tools.model_suite``): its synthetic tasks' best losses, torch's
PowerSGD hook as a Lightning strategy on gloo, and the ``--quick`` suite end to end (about 30 s:
12 fork-started 2-rank runs), checked against what each method must send."""

import itertools
import json
import math

import pytest
import torch
from _strategy_helpers import TinyMLP, fit, keep_master_port  # noqa: F401  (autouse: fork sets MASTER_PORT)
from lightning.pytorch.strategies import StrategyRegistry
from torch.utils.data import default_collate

from gtc_lightning import PowerSGDStrategy
from gtc_lightning.algorithms.common import allreduce_bytes
from gtc_lightning.algorithms.gtc.config import (
    AUTO_WORD_LEVELS,
    DEFAULT_DENSITY,
    local_clip_threshold,
    resolve_density_warmup,
    resolve_word_levels,
)
from gtc_lightning.tools import model_suite
from gtc_lightning.tools.suite_data import frames_task, grating_task, hmm_task, markov_task
from gtc_lightning.tools.suite_models import MODELS

# ---- the synthetic tasks: the best loss is what the true distribution scores -----------------


def _train_tensors(task, n):
    """The first ``n`` training samples as tensors (frames are projected when loaded)."""
    if hasattr(task.train, "tensors"):
        return [t[:n] for t in task.train.tensors]
    return default_collate(task.train.__getitems__(list(range(n))))


@pytest.mark.parametrize(
    "make",
    [
        lambda n, seed: markov_task(32, 1, 4, 32, n, 64, seed),
        lambda n, seed: markov_task(8, 2, 3, 32, n, 64, seed),
        lambda n, seed: grating_task(16, 0.4, n * 4, n * 4, seed),
        lambda n, seed: grating_task(16, 0.25, n * 4, n * 4, seed),
        lambda n, seed: frames_task(32, 2, 680, 16, 1.0, n * 4, n * 4, seed),
        lambda n, seed: hmm_task(8, 16, 0.9, 0.1, 32, n, 1024, seed),
    ],
    ids=["markov1", "markov2", "grating", "grating_noisy", "frames", "hmm"],
)
def test_true_distribution_scores_the_best_loss(make):
    """On a fresh sample of ~10^5 predictions (16000 images or frames), the true distribution's mean
    cross-entropy is the stated best loss within sampling error (about 4 standard errors): the
    sampler, the entropy (or forward algorithm) and the stationary start agree. A wrong posterior
    would score worse than its own entropy."""
    task = make(4000, 7)
    sample = _train_tensors(task, len(task.train))
    assert task.true_loss(*sample) == pytest.approx(task.best_loss, abs=0.03)
    assert 0.0 < task.best_loss


def test_hmm_best_loss_beats_a_bigram_model():
    """The forward algorithm's loss on held-out data is below a bigram model fitted on 128k tokens
    (which knows only the previous token), and the bigram is below the unigram entropy."""
    task = hmm_task(8, 16, 0.9, 0.1, 32, 4000, 1024, 3)
    (train,) = task.train.tensors
    counts = torch.ones(16, 16, dtype=torch.float64)  # add-one smoothing
    counts.index_put_(
        (train[:, :-1].reshape(-1), train[:, 1:].reshape(-1)), torch.tensor(1.0).double(), accumulate=True
    )
    (held,) = task.heldout.tensors
    bigram = float(-(counts / counts.sum(1, keepdim=True)).log()[held[:, :-1], held[:, 1:]].mean())
    freq = torch.bincount(train.reshape(-1), minlength=16).double()
    unigram = float(-(freq / freq.sum() * (freq / freq.sum()).log()).sum())
    assert task.best_loss < bigram - 0.1 < unigram


def test_tasks_are_deterministic_per_seed():
    """The same seed draws the same training set; another seed another; the held-out set is shared."""
    a, b, c = (markov_task(32, 1, 4, 16, 64, 32, seed) for seed in (0, 0, 1))
    assert torch.equal(a.train.tensors[0], b.train.tensors[0])
    assert not torch.equal(a.train.tensors[0], c.train.tensors[0])
    assert torch.equal(a.heldout.tensors[0], c.heldout.tensors[0])
    f, g = (frames_task(8, 2, 680, 16, 1.0, 64, 32, 5) for _ in range(2))
    assert torch.equal(_train_tensors(f, 64)[0], _train_tensors(g, 64)[0])


@pytest.mark.parametrize("name", list(MODELS))
def test_models_take_their_batches(name):
    """Each model's loss on its first training batch is finite and its gradient reaches every
    parameter."""
    model = MODELS[name](train_size=2 * model_suite.batch_size(name), steps=10)
    batch = next(iter(model.train_dataloader()))
    loss = model.loss(*batch)
    loss.backward()
    assert math.isfinite(loss.item())
    assert all(p.grad is not None for p in model.parameters())


# ---- PowerSGD as a Lightning strategy on gloo ------------------------------------------------


def test_powersgd_registered_and_validated():
    assert {"ddp_powersgd", "ddp_powersgd_spawn", "ddp_powersgd_fork"} <= set(StrategyRegistry)
    with pytest.raises(ValueError, match="start_powerSGD_iter >= 2"):
        PowerSGDStrategy(start_powerSGD_iter=1)
    with pytest.raises(ValueError, match="matrix_approximation_rank"):
        PowerSGDStrategy(matrix_approximation_rank=0)


def test_powersgd_runs_on_gloo_with_identical_replicas(tmp_path):
    """torch's own hook on 2 forked gloo ranks: the replicas stay bit-identical, the 2 dense steps
    apply updates of high rank, every later step a rank-1 update to the [32, 16] weight (momentum-free
    SGD, so the weight's change is -lr times the decoded gradient P Q^T)."""
    _, ranks = fit(
        tmp_path,
        strategy=PowerSGDStrategy,
        max_epochs=2,
        model_kwargs={"momentum": 0.0},
        matrix_approximation_rank=1,
        start_powerSGD_iter=2,
    )
    records = [rank["records"] for rank in ranks]
    for a, b in zip(*records):
        assert torch.equal(a["params"], b["params"])
    weights = [ranks[0]["start"]["params"][:512]] + [rec["params"][:512] for rec in records[0]]
    ranks_of_updates = []
    for before, after in itertools.pairwise(weights):
        s = torch.linalg.svdvals((after - before).double().view(32, 16))
        ranks_of_updates.append(int((s > 1e-4 * s[0]).sum()))
    assert min(ranks_of_updates[:2]) > 8
    assert ranks_of_updates[2:] == [1] * (len(weights) - 3)


class _WideMLP(TinyMLP):
    """:class:`TinyMLP` with six hidden [256, 256] layers (0.4 M weights): enough work per bucket
    for the race below to show within a few steps."""

    def __init__(self, samples: int = 256):
        super().__init__(lr=0.05, momentum=0.0, samples=samples)
        torch.manual_seed(0)
        layers = [torch.nn.Linear(16, 256), torch.nn.Tanh()]
        for _ in range(6):
            layers += [torch.nn.Linear(256, 256), torch.nn.Tanh()]
        self.net = torch.nn.Sequential(*layers, torch.nn.Linear(256, 4))


def test_powersgd_with_several_buckets_on_gloo(tmp_path):
    """With more than one DDP bucket, torch's hook issues one bucket's P/Q all-reduces from a gloo
    callback thread while the backward issues the next bucket's from its own thread; the ranks then
    disagree on the order and hang or abort (the long suite's 2.4 M LM has 2 buckets). The strategy
    runs the buckets one after another on gloo: training finishes, the replicas stay bit-identical
    and a hidden [256, 256] weight takes rank-1 updates."""
    _, ranks = fit(
        tmp_path,
        strategy=PowerSGDStrategy,
        max_epochs=1,
        model=_WideMLP(),
        matrix_approximation_rank=1,
        start_powerSGD_iter=2,
        bucket_cap_mb=0.3,  # one [256, 256] layer (256 kB) per bucket: 7 buckets
    )
    records = [rank["records"] for rank in ranks]
    assert len(records[0]) == len(records[1]) == 16
    for a, b in zip(*records):
        assert torch.equal(a["params"], b["params"])
    first = 16 * 256 + 256  # the first layer's weight and bias, then the first hidden weight
    change = (records[0][-1]["params"] - records[0][-2]["params"])[first : first + 256 * 256]
    s = torch.linalg.svdvals(change.double().view(256, 256))
    assert int((s > 1e-4 * s[0]).sum()) == 1


# ---- the quick suite, end to end ---------------------------------------------------------------


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("suite")
    return out, model_suite.main(["--quick", "--out", str(out)])


HOOKS = {
    "ddp": "allreduce",
    "ddp_bf16": "bf16_allreduce_hook",
    "powersgd_r1": "powerSGD_hook",
    "powersgd_r4": "powerSGD_hook",
}


def _runs(results, method):
    return [r for r in results if r["method"] == method]


def test_quick_suite_every_cell(quick):
    _, results = quick
    assert len(results) == len(model_suite.QUICK_MODELS) * len(model_suite.DEFAULT_METHODS)
    for r in results:
        assert "error" not in r, r
        assert math.isfinite(r["final_loss"]) and r["replicas_identical"], r
        assert [p[0] for p in r["curve"]] == [0, r["steps"] // 2, r["steps"]]
        assert r["best_loss"] < r["initial_loss"]
        assert r["comm_hook"] == HOOKS.get(r["method"], r["comm_hook"])  # what was measured ran
    for r in _runs(results, "ddp"):
        assert r["final_loss"] < r["initial_loss"] - 0.1


def test_quick_suite_dense_bytes_are_the_ring_formula(quick):
    _, results = quick
    for r in _runs(results, "ddp"):
        assert r["bytes_per_step"] == allreduce_bytes(r["numel"], 2, 4) == r["allreduce_fp32_bytes_per_step"]
        assert r["curve"][-1][2] == r["steps"] * r["bytes_per_step"]
        assert r["ratio_fp32"] == 1.0 and r["memory_bytes_per_param"] == 0
    for r in _runs(results, "ddp_bf16"):
        assert r["bytes_per_step"] * 2 == allreduce_bytes(r["numel"], 2, 4)
        assert r["ratio_bf16"] == 1.0


def test_quick_suite_gtc_bytes_are_its_stats(quick):
    _, results = quick
    gtc = [r for r in results if r["method"].startswith("gtc")]
    assert {"gtc", "gtc_3e-3", "gtc_3e-2", "gtc_strom_1e-2"} <= {r["method"] for r in gtc}
    for r in gtc:
        assert r["bytes_total"] == pytest.approx(sum(r["gtc_bytes_sent"]) / 2)
        assert r["gtc_allreduce_fp32_bytes"] == r["steps"] * allreduce_bytes(r["numel"], 2, 4)
        assert 0 < r["density"] < 1
        if r["method"] != "gtc_strom_1e-2":  # the update mode: its density target, met every step
            target = {"gtc": DEFAULT_DENSITY, "gtc_3e-3": 3e-3, "gtc_3e-2": 3e-2}[r["method"]]
            assert target / 2 < r["density"] < target * 1.5 and r["gtc_dense_steps"] == 0
            assert (
                8 <= r["memory_bytes_per_param"] < 8.1
            )  # the residual and the scratch buffer (and the coded message)
        else:
            assert r["memory_bytes_per_param"] >= 8


def _powersgd_bytes_per_step(model_name: str, rank: int) -> int:
    """What torch's hook all-reduces per compressed step on 2 ranks (the ring moves each rank's
    4 bytes per element once at W=2): P and Q of every matrix worth compressing, the rest whole."""
    model = MODELS[model_name](train_size=model_suite.batch_size(model_name) * 2, steps=10)
    elements = 0
    for p in model.parameters():
        n, m = p.shape[0], p.numel() // p.shape[0]
        r = min(n, m, rank)
        elements += (n + m) * r if (n + m) * r * 2 < n * m else n * m
    return 4 * elements


def test_quick_suite_powersgd_bytes_are_what_the_hook_sends(quick):
    _, results = quick
    for r in _runs(results, "powersgd_r1") + _runs(results, "powersgd_r4"):
        rank = int(r["method"][-1])
        dense, compressed = 2, r["steps"] - 2  # start_powerSGD_iter=2: two plain all-reduces first
        expected = dense * allreduce_bytes(r["numel"], 2, 4) + compressed * _powersgd_bytes_per_step(
            r["model"], rank
        )
        assert r["bytes_total"] == expected
        ddp = next(d for d in _runs(results, "ddp") if d["model"] == r["model"])
        assert r["bytes_per_step"] < ddp["bytes_per_step"] / 2
        assert r["memory_bytes_per_param"] >= 4  # the error feedback, float32


def test_quick_suite_files(quick):
    out, results = quick
    assert json.loads((out / "results.json").read_text())[0]["model"] == results[0]["model"]
    table = (out / "results.md").read_text()
    assert "## 2 ranks" in table and "best possible loss" in table
    for method in model_suite.DEFAULT_METHODS:
        assert f"| {method} |" in table
    for name in model_suite.QUICK_MODELS:
        assert (out / f"loss_vs_bytes_{name}.png").stat().st_size > 10_000


# ---- the long profile: its models and steps, and a suite resumed across sessions -------------


def test_long_profile_has_a_language_model_of_two_million_parameters():
    assert set(model_suite.LONG_MODELS) >= set(model_suite.STANDARD_MODELS) | {"transformer_lm"}
    assert min(model_suite.LONG_STEPS.values()) >= 2000
    model = MODELS["transformer_lm"](train_size=2 * model_suite.batch_size("transformer_lm"), steps=10)
    assert sum(p.numel() for p in model.parameters()) >= 2_000_000
    opt = model.configure_optimizers()
    assert isinstance(opt["optimizer"], torch.optim.AdamW)


def _fake_record(model, method, world_size, seed, steps, evals, out_dir):
    return {"model": model, "method": method, "world_size": world_size, "seed": seed, "steps": steps,
            "numel": 10, "best_loss": 0.5, "initial_loss": 2.0, "final_loss": 1.0, "curve": [[0, 2.0], [steps, 1.0]],
            "bytes_per_step": 80.0, "ratio_fp32": 1.0, "ratio_bf16": 0.5, "step_seconds": 0.01, "wall_s": 1.0,
            "memory_bytes_per_param": 0.0, "replicas_identical": True}  # fmt: skip


def test_resume_runs_only_the_missing_cells(tmp_path, monkeypatch):
    """--resume keeps the records of earlier runs of the same cells and steps, and reruns failed
    ones and those of another length."""
    ran = []

    def fake(*cell):
        ran.append(cell[:4])
        return _fake_record(*cell)

    monkeypatch.setattr(model_suite, "run_cell", fake)
    monkeypatch.setattr(model_suite, "plot_loss_vs_bytes", lambda results, out: [])
    argv = [
        "--profile",
        "long",
        "--models",
        "gru",
        "--methods",
        "ddp",
        "gtc",
        "--seeds",
        "0",
        "1",
        "--out",
        str(tmp_path),
    ]
    first = model_suite.main(argv)
    assert len(ran) == 4 and [(r["model"], r["seed"]) for r in first][:2] == [
        ("gru", 0),
        ("gru", 0),
    ]  # seed-major
    records = json.loads((tmp_path / "results.json").read_text())
    records[1] = {k: records[1][k] for k in ("model", "method", "world_size", "seed")} | {"error": "Boom"}
    records[2]["steps"] = 200  # a run of the standard profile
    (tmp_path / "results.json").write_text(json.dumps(records))
    ran.clear()
    second = model_suite.main([*argv, "--resume"])
    assert ran == [("gru", "gtc", 4, 0), ("gru", "ddp", 4, 1)]
    assert len(second) == 4 and all("error" not in r and r["steps"] == 2000 for r in second)
    ran.clear()
    model_suite.main(argv)  # without --resume everything runs again
    assert len(ran) == 4


def test_merge_joins_runs_made_apart_and_renders_them(tmp_path, monkeypatch):
    """--merge runs nothing: a source's run of a cell the target holds replaces it in place, a new
    cell is appended, a failed run is left out, and results.md is rendered from the merged runs."""
    monkeypatch.setattr(model_suite, "run_cell", lambda *cell: pytest.fail("--merge must not run anything"))
    plotted = []
    monkeypatch.setattr(model_suite, "plot_loss_vs_bytes", lambda results, out: plotted.append(len(results)) or [])
    out, src = tmp_path / "out", tmp_path / "src"
    out.mkdir()
    src.mkdir()
    old = [_fake_record("gru", "ddp", 4, 0, 2000, 2, None), _fake_record("gru", "gtc", 4, 0, 2000, 2, None)]
    (out / "results.json").write_text(json.dumps(old))
    rerun = _fake_record("gru", "gtc", 4, 0, 2000, 2, None) | {"final_loss": 0.75}
    failed = {"model": "gru", "method": "ddp", "world_size": 4, "seed": 2, "error": "Boom"}
    (src / "results.json").write_text(json.dumps([rerun, _fake_record("gru", "ddp", 4, 1, 2000, 2, None), failed]))
    results = model_suite.main(["--out", str(out), "--merge", str(src)])
    cells = [(r["method"], r["seed"]) for r in results]
    assert cells == [("ddp", 0), ("gtc", 0), ("ddp", 1)]
    assert results[1]["final_loss"] == 0.75 and json.loads((out / "results.json").read_text()) == results
    assert (out / "results.md").read_text() == model_suite.report_markdown(results) and plotted == [3]
    (src / "results.json").write_text('{"not": "runs"}')
    with pytest.raises(ValueError, match=r"--merge: .*src.*give the --out directory"):
        model_suite.main(["--out", str(out), "--merge", str(src)])


def test_a_budget_that_grew_keeps_its_earlier_runs_apart(tmp_path, monkeypatch):
    """Runs of one model at two budgets are two cells: merging the longer runs keeps the shorter ones, the
    report names each budget (its own rows, its own DDP), and the long profile's tables take the
    profile's budget as the model's and the other as ``model@steps``."""
    monkeypatch.setattr(model_suite, "plot_loss_vs_bytes", lambda results, out: [])
    out, src = tmp_path / "out", tmp_path / "src"
    out.mkdir()
    src.mkdir()
    short = [_fake_record("cnn", m, 4, 0, 2000, 2, None) | {"final_loss": 1.0} for m in ("ddp", "gtc")]
    (out / "results.json").write_text(json.dumps(short))
    longer = [_fake_record("cnn", m, 4, 0, 6000, 2, None) | {"final_loss": f} for m, f in (("ddp", 0.5), ("gtc", 0.6))]
    (src / "results.json").write_text(json.dumps(longer))
    results = model_suite.main(["--out", str(out), "--merge", str(src)])
    assert [(r["method"], r["steps"]) for r in results] == [("ddp", 2000), ("gtc", 2000), ("ddp", 6000), ("gtc", 6000)]
    report = model_suite.report_markdown(results)
    assert "| cnn (2000 steps) | gtc | 1.0000 [1.0000-1.0000] | +0.0 % |" in report
    assert "| cnn (6000 steps) | gtc | 0.6000 [0.6000-0.6000] | +20.0 % |" in report
    import doc_tables  # tests/doc_tables.py: the long profile's tables
    monkeypatch.setattr(model_suite, "LONG_STEPS", {**model_suite.LONG_STEPS, "cnn": 6000})
    runs = doc_tables.long_runs((out / "results.json",))
    assert sorted(runs) == [("cnn", "ddp"), ("cnn", "gtc"), ("cnn@2000", "ddp"), ("cnn@2000", "gtc")]
    assert doc_tables.long_change(runs, "cnn", "gtc")[0] == pytest.approx(20.0)
    assert doc_tables.long_label("cnn@2000", doc_tables.LONG_LABELS).endswith(", 2,000 steps")


def test_profile_errors_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match="--profile long"):
        model_suite.main(["--models", "transformer_lm", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="choose one"):
        model_suite.main(["--quick", "--profile", "long", "--out", str(tmp_path)])
    (tmp_path / "results.json").write_text('{"not": "a list"}')
    with pytest.raises(ValueError, match="drop --resume"):
        model_suite.main(["--resume", "--models", "gru", "--methods", "ddp", "--out", str(tmp_path)])


def test_the_family_in_the_suite_counts_its_syncs_bytes(tmp_path):
    """The block methods sync every ``block_period(steps)`` steps: DiLoCo's bytes per optimizer step are
    a dense all-reduce's over the period (amortised), SparseLoCo's far fewer, both from ``sync_stats``."""
    results = model_suite.main(["--quick", "--models", "gru", "--methods", "diloco", "sparseloco", "dpsgd",
                                "--out", str(tmp_path)])  # fmt: skip
    runs = {r["method"]: r for r in results}
    assert all("error" not in r for r in runs.values()), runs
    steps = runs["diloco"]["steps"]
    period = model_suite.block_period(steps)
    assert period == 10 and model_suite.block_period(2000) == 50
    assert runs["diloco"]["ratio_fp32"] == pytest.approx(period)  # steps / period syncs of a fp32 all-reduce
    assert runs["diloco"]["replicas_identical"]  # the run ends on a sync
    assert runs["sparseloco"]["ratio_fp32"] > 100 * period and runs["sparseloco"]["replicas_identical"]
    assert runs["dpsgd"]["ratio_fp32"] == pytest.approx(1.0, rel=0.05)  # a whole model to one peer a step
    assert runs["diloco"]["memory_bytes_per_param"] >= 8  # the block's start and its momentum


def test_sparseloco_frontier_points_spend_the_same_bytes_per_step():
    """``sparseloco_h10`` and its two neighbours on a 2,000-step run: H = 10, 5, 20 at densities 1/64, 8e-3,
    3e-2, so each sends the same fraction of the model per optimizer step (1.5-1.6e-3) a different way."""
    built = {name: model_suite.FAMILY[name](2000, 4) for name in
             ("sparseloco_h10", "sparseloco_h5_8e-3", "sparseloco_h20_3e-2")}  # fmt: skip
    assert [s.period for s in built.values()] == [10, 5, 20]
    per_step = [s.density / s.period for s in built.values()]
    assert max(per_step) / min(per_step) < 1.1


def test_the_defaults_measured_under_their_setting_names():
    """``gtc`` keeps the setting its records measured (no density warm-up: the former defaults);
    ``gtc_defaults`` is ``GTCStrategy()`` as it is now, which on a 2,000-step run is ``gtc_density_warmup``
    (the tables' "GTC defaults" cells take those runs: tests/doc_tables.py)."""
    import doc_tables

    former = model_suite.METHODS["gtc"]()
    assert (former._density_warmup_steps, former._mean_variance) == (0, False)
    now = model_suite.METHODS["gtc_defaults"]()
    measured = model_suite.MECHANISMS[doc_tables.DEFAULTS_MEASURED_AS](2000, 4)
    assert resolve_density_warmup(now._density_warmup_steps, 2000)[0] == measured._density_warmup_steps == 100
    assert now._mean_variance is measured._mean_variance is False
    both = model_suite.MECHANISMS["gtc_density_warmup_mean_variance"](2000, 4)
    assert both._density_warmup_steps == 100 and both._mean_variance
    assert [model_suite.warmup(n) for n in (20, 40, 200, 400, 500)] == [max(1, n // 20) for n in (20, 40, 200, 400, 500)]
    for option in ("conserve", "momentum_masking", "target_density", "compress", "tau", "coding"):
        assert getattr(now, f"_{option}") == getattr(measured, f"_{option}"), option
    # word_levels="auto" by each suite model's optimizer: the plain-SGD models' defaults are gtc_word_levels
    assert former._word_levels == measured._word_levels == 1 and now._word_levels == "auto"
    with_levels = model_suite.MECHANISMS[doc_tables.DEFAULTS_MEASURED_AS_PLAIN_SGD](2000, 4)
    assert with_levels._word_levels == AUTO_WORD_LEVELS
    for option in ("density_warmup_steps", "mean_variance", "conserve", "momentum_masking", "target_density"):
        assert getattr(with_levels, f"_{option}") == getattr(measured, f"_{option}"), option
    for name, cls in MODELS.items():
        optimizer = cls(train_size=8, seed=0, steps=8).configure_optimizers()
        optimizer = optimizer["optimizer"] if isinstance(optimizer, dict) else optimizer
        levels = resolve_word_levels("auto", optimizer)[0]
        wanted = with_levels if doc_tables.defaults_measured_as(name) == doc_tables.DEFAULTS_MEASURED_AS_PLAIN_SGD else measured
        assert levels == wanted._word_levels, name



def test_clipped_methods_clip_at_c_or_dgcs_sqrt_n_c(tmp_path):
    """``ddp_clip`` and both GTC methods give the Trainer the model's threshold c; ``gtc_defaults_clip`` pins
    ``local_clip_scale=1`` (each rank's gradient at c), ``gtc_defaults_clip_dgc`` sqrt(N) c (DGC's N^-1/2 of
    the global threshold in a rank's mean-gradient units, the default); unclipped methods none; a model
    without a threshold is refused before any run, naming it."""
    c = model_suite.CLIP_NORM["cnn"]
    for method in model_suite.CLIPPED:
        assert model_suite.clip_threshold("cnn", method) == c
    assert model_suite.clip_threshold("cnn", "gtc_defaults") is None
    at_c = model_suite.CLIPPED["gtc_defaults_clip"][0]()
    dgc = model_suite.CLIPPED["gtc_defaults_clip_dgc"][0]()
    assert (at_c._local_clip_scale, dgc._local_clip_scale) == (1.0, "sqrt_world")
    assert local_clip_threshold(("norm", c), dgc._local_clip_scale, 4) == ("norm", pytest.approx(2 * c))
    assert local_clip_threshold(("norm", c), at_c._local_clip_scale, 4) == ("norm", c)
    with pytest.raises(ValueError, match=r"--models \['gru'\]: no clipping threshold"):
        model_suite.main(
            ["--models", "gru", "cnn", "--methods", "ddp", "gtc_defaults_clip", "--out", str(tmp_path)]
        )
    assert not (tmp_path / "results.json").exists()


def test_the_probe_scores_the_model_a_validation_loop_sees(tmp_path):
    """Every rank calls the strategy's validation hooks around rank 0's scoring (the local-step family puts
    the mean of the ranks' models in place there), and every rank records the step, so that the end of
    fit calls the same collectives on every rank."""
    from types import SimpleNamespace

    calls = []
    strategy = SimpleNamespace(
        on_validation_start=lambda: calls.append("start"), on_validation_end=lambda: calls.append("end")
    )
    probe = model_suite.SuiteProbe(tmp_path, [3])
    probe._evaluate(SimpleNamespace(strategy=strategy, global_rank=1, global_step=3), None)
    assert calls == ["start", "end"] and probe._evaluated_at == 3 and probe.curve == []
