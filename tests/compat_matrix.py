"""The compatibility matrix, declared: Lightning feature x strategy -> the promised outcome.

``tests/test_compat.py`` runs every cell on 2 CPU ranks started by fork and checks it against this
table; the tables in the docs are rendered from it. A new strategy of the family joins by adding one
entry to ``STRATEGIES`` and its outcome to every row of ``MATRIX``.

Two forms, each between its own markers in any Markdown file: the whole matrix (one row per feature,
one column per strategy, every note; ``BEGIN``/``END``, the docs' reference page) and the short form
(one row per set of refused features, with the strategies that refuse it; ``SHORT_BEGIN``/``SHORT_END``,
the README).

Run ``python tests/compat_matrix.py`` after changing the matrix: it rewrites every block in the README
and in ``docs/reference/compat_matrix.md`` (where that page holds one); ``python tests/compat_matrix.py
FILE ...`` rewrites the blocks of the files given. ``tests/test_compat.py`` fails when one drifts.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS_PAGE = ROOT / "docs" / "reference" / "compat_matrix.md"
BEGIN = "<!-- compat-matrix: begin (generated from tests/compat_matrix.py; do not edit by hand) -->"
END = "<!-- compat-matrix: end -->"
SHORT_BEGIN = "<!-- compat-matrix-short: begin (generated from tests/compat_matrix.py; do not edit by hand) -->"
SHORT_END = "<!-- compat-matrix-short: end -->"
REGENERATE = "python tests/compat_matrix.py"


@dataclass(frozen=True)
class Strategy:
    """A strategy of the family, as the matrix builds it.

    Args:
        class_path: the class, importable (also what LightningCLI's ``class_path`` gets).
        init_args: its arguments in every cell (besides ``start_method="fork"`` and a timeout).
        fork_name: its registered name with ``start_method="fork"``.
        identical_replicas: whether it promises bit-identical parameters on every rank.
        reproducible: whether two runs with the same settings take the same steps bit for bit (not
            so where the ranks run asynchronously).
        learns_every_run: whether every run makes the tiny MLP's loss fall (its SGD has momentum 0.9
            at lr 0.5): where the ranks run asynchronously, how much depends on when the exchanges
            land, and the loss is checked in the strategy's own tests instead.
    """

    class_path: str
    init_args: dict = field(default_factory=dict)
    fork_name: str = ""
    identical_replicas: bool = True
    reproducible: bool = True
    learns_every_run: bool = True


@dataclass(frozen=True)
class Outcome:
    """What a cell promises: it works (``text`` is an optional note; ``learns=False`` where its
    settings cannot make the tiny MLP's loss fall in 8 steps, which the note must say), or it is
    refused (``text`` is the reason shown in the README, ``error`` a regex the error message must
    match, ``at`` when the error comes: ``"setup"``, before any batch, or ``"batch N"``, during the
    N-th batch)."""

    works: bool
    text: str = ""
    error: str = ""
    at: str = "setup"
    learns: bool = True


def works(note: str = "", learns: bool = True) -> Outcome:
    return Outcome(works=True, text=note, learns=learns)


def refused(reason: str, error: str, at: str = "setup") -> Outcome:
    return Outcome(works=False, text=reason, error=error, at=at)


STRATEGIES: dict[str, Strategy] = {
    "ddp": Strategy("lightning.pytorch.strategies.DDPStrategy", {}, "ddp_fork"),
    # Strom's gradient mode at a fixed tau, and the defaults (the update mode with automatic tau) at a
    # density that moves the tiny MLP's 676 weights within 8 steps.
    "gtc": Strategy("gtc_lightning.GTCStrategy", {"tau": 0.01, "compress": "gradient", "coding": "none"}, "gtc_fork"),
    "gtc_update": Strategy("gtc_lightning.GTCStrategy", {"target_density": 0.05}, "gtc_fork"),
    "gtc_stale": Strategy("gtc_lightning.GTCStrategy", {"tau": 0.01, "stale": True}, "gtc_stale_fork"),
    "dpsgd": Strategy("gtc_lightning.DPSGDStrategy", {}, "dpsgd_fork", identical_replicas=False),
    # Its ranks step at their own pace and an exchange lands when it lands: runs are not reproducible
    # step for step (the resume is checked against the checkpoint's shards instead), and at the tiny
    # MLP's momentum 0.9 the second half's loss was 0.60-0.98 of the first half's over repeated runs
    # (tests/test_adpsgd.py checks the loss at momentum 0: 0.68-0.74).
    "adpsgd": Strategy(
        "gtc_lightning.ADPSGDStrategy", {"max_staleness": 1}, "adpsgd_fork", identical_replicas=False,
        reproducible=False, learns_every_run=False,
    ),
    # Replicas are identical right after a sync only (tests/test_averaging.py, test_bmuf.py check that);
    # bmuf_gtc runs here with every rank its own group (the default group_size=2 needs 4 ranks). The
    # tiny MLP's local SGD (lr 0.5, momentum 0.9, 8-sample batches) diverges alone: a sync every 2 steps
    # (after 1 dense one, so that the checkpoint of step 4 falls between syncs), and for bmuf ζ = 1 - η,
    # which keeps the filtered step as large as model averaging's (ζ / (1 - η) = 1).
    "ma": Strategy(
        "gtc_lightning.ModelAveragingStrategy",
        {"period": 2, "warmup_steps": 1},
        "ma_fork",
        identical_replicas=False,
    ),
    "bmuf": Strategy(
        "gtc_lightning.BMUFStrategy",
        {"period": 2, "warmup_steps": 1, "block_momentum": 0.5, "block_lr": 0.5},
        "bmuf_fork",
        identical_replicas=False,
    ),
    "bmuf_gtc": Strategy(
        "gtc_lightning.BMUFGTCStrategy",
        {"tau": 0.01, "group_size": 1, "period": 2},
        "bmuf_gtc_fork",
        identical_replicas=False,
    ),
    # BMUF's block update sent as GTC words: a quarter of the tiny MLP's 676 weights a sync (its default
    # 1/64 would send 11), SparseLoCo's outer step (no outer momentum, lr 1), the same period and warmup.
    "sparseloco": Strategy(
        "gtc_lightning.SparseLoCoStrategy",
        {"period": 2, "warmup_steps": 1, "density": 0.25},
        "sparseloco_fork",
        identical_replicas=False,
    ),
}

# How the tables name a strategy where its key alone would mislead: `strategy="gtc"` is the update mode
# (the defaults), so the column of Strom's gradient mode says which it is.
LABELS = {
    "gtc": '`gtc`, `compress="gradient"` (Strom\'s, fixed τ)',
    "gtc_update": "`gtc` (the defaults: update mode)",
}


def label(name: str) -> str:
    """The column (or row) title of a strategy in the rendered tables."""
    return LABELS.get(name, f"`{name}`")


_UNUSED = "Lightning's unused-parameter error, pointing at `strategy='{}_find_unused_parameters_true'`"

# feature id -> (what the README calls it, {strategy: outcome}); test_compat.py has one runner per id.
MATRIX: dict[str, tuple[str, dict[str, Outcome]]] = {
    "sgd": (
        "SGD with momentum (the reference run of the other rows)",
        {
            "ddp": works(),
            "gtc": works(),
            "gtc_update": works(),
            "gtc_stale": works(),
            "dpsgd": works(),
            "adpsgd": works(),
            "ma": works(),
            "bmuf": works(),
            "bmuf_gtc": works(),
            "sparseloco": works(),
        },
    ),
    "adam_steplr": (
        "Adam + `StepLR` stepping every batch",
        {
            "ddp": works(),
            "gtc": works(),
            "gtc_update": works(),
            "gtc_stale": works(),
            "dpsgd": works(),
            "adpsgd": works(),
            "ma": works(),
            "bmuf": works(),
            "bmuf_gtc": works(),
            "sparseloco": works(),
        },
    ),
    "accumulate_grad_batches": (
        "`accumulate_grad_batches=2`",
        {
            "ddp": works(),
            "gtc": works("exchanges only on the steps that step the optimizer"),
            "gtc_update": works("exchanges only on the steps that step the optimizer"),
            "gtc_stale": works("exchanges on optimizer steps, each in flight through the next micro-batches"),
            "dpsgd": works("averages once per optimizer step"),
            "adpsgd": works("a local step and an exchange per optimizer step"),
            "ma": works("a period counts optimizer steps"),
            "bmuf": works("a block counts optimizer steps"),
            "bmuf_gtc": works("GTC exchanges on optimizer steps; a block counts them"),
            "sparseloco": works("a block counts optimizer steps"),
        },
    ),
    "bf16_mixed": (
        '`precision="bf16-mixed"` (CPU)',
        {
            "ddp": works(),
            "gtc": works(),
            "gtc_update": works(),
            "gtc_stale": works(),
            "dpsgd": works(),
            "adpsgd": works(),
            "ma": works(),
            "bmuf": works(),
            "bmuf_gtc": works(),
            "sparseloco": works(),
        },
    ),
    "fp16_mixed": (
        (
            '16-mixed with its `GradScaler`: `plugins=[MixedPrecision("16-mixed", "cpu")]` '
            '(`precision="16-mixed"` turns into bf16 on CPU)'
        ),
        {
            "ddp": works(),
            "gtc": works("thresholds the unscaled gradient: the loss scale is divided out"),
            "gtc_update": works("each rank's scaler unscales its own gradient; an overflow on any rank skips the step on every rank"),
            "gtc_stale": works("thresholds the unscaled gradient; scaled by the applying step's loss scale"),
            "dpsgd": works(),
            "adpsgd": works("each rank's own `GradScaler`, saved in its shard"),
            "ma": works("each rank's own `GradScaler`, saved in its shard"),
            "bmuf": works("each rank's own `GradScaler`, saved in its shard"),
            "bmuf_gtc": works("GTC thresholds the unscaled gradient"),
            "sparseloco": works("each rank's own `GradScaler`, saved in its shard"),
        },
    ),
    "manual_two_optimizers": (
        "manual optimization, two optimizers, `toggle_optimizer` (`find_unused_parameters=True`)",
        {
            "ddp": works(),
            "gtc": works(),
            "gtc_update": works("each optimizer's step is compressed and exchanged after it"),
            "gtc_stale": refused(
                "each update is applied at the next backward pass, which may step another optimizer",
                r"stale=True.*2 optimizers",
            ),
            "dpsgd": works("each optimizer step averages the parameters it updates"),
            "adpsgd": works("each optimizer step is a local step with its own exchange"),
            "ma": works("every optimizer step counts towards the period"),
            "bmuf": works("every optimizer step counts towards the period"),
            "bmuf_gtc": works("every optimizer step counts towards the period"),
            "sparseloco": works("every optimizer step counts towards the period"),
        },
    ),
    "unused_find_unused": (
        "a never used branch, `find_unused_parameters=True`",
        {
            "ddp": works(),
            "gtc": works("a parameter a rank did not use keeps its residual"),
            "gtc_update": works(),
            "gtc_stale": works(
                "a parameter a rank did not use keeps its residual; one that no rank uses when its update "
                "lands still gets it"
            ),
            "dpsgd": works(),
            "adpsgd": works(),
            "ma": works(),
            "bmuf": works(),
            "bmuf_gtc": works(),
            "sparseloco": works(),
        },
    ),
    "unused_by_name": (
        "the same by name: `<name>_fork_find_unused_parameters_true`",
        {
            "ddp": works(),
            "gtc": works(),
            "gtc_update": works(),
            "gtc_stale": works(),
            "dpsgd": works(),
            "adpsgd": works(),
            "ma": works(
                "runs, learns nothing here: the name's period=10 syncs none of the 8 steps, and the tiny "
                "MLP's local SGD alone diverges (loss not checked)",
                learns=False,
            ),
            "bmuf": works(
                "runs, learns nothing here: the name's period=50 syncs none of the 8 steps, and the tiny "
                "MLP's local SGD alone diverges (loss not checked)",
                learns=False,
            ),
            "bmuf_gtc": refused(
                "the registered names use `group_size=2`, one group of these 2 ranks (runs on 4: `tests/test_bmuf.py`)",
                "makes one group",
            ),
            "sparseloco": works(
                "runs, learns nothing here: the name's period=30 syncs none of the 8 steps, and the tiny "
                "MLP's local SGD alone diverges (loss not checked)",
                learns=False,
            ),
        },
    ),
    "unused_without_flag": (
        "a never used branch without `find_unused_parameters`",
        {
            "ddp": refused(_UNUSED.format("ddp"), "strategy='ddp_find_unused_parameters_true'", at="batch 2"),
            "gtc": refused(_UNUSED.format("gtc"), "strategy='gtc_find_unused_parameters_true'", at="batch 2"),
            "gtc_update": refused(_UNUSED.format("gtc"), "strategy='gtc_find_unused_parameters_true'", at="batch 2"),
            "gtc_stale": refused(
                _UNUSED.format("gtc_stale"), "strategy='gtc_stale_find_unused_parameters_true'", at="batch 2"
            ),
            "dpsgd": refused(
                _UNUSED.format("dpsgd"), "strategy='dpsgd_find_unused_parameters_true'", at="batch 2"
            ),
            "adpsgd": works("DDP reduces no gradient after the warmup, so no rank waits for the unused branch"),
            "ma": refused(_UNUSED.format("ma"), "strategy='ma_find_unused_parameters_true'", at="batch 2"),
            "bmuf": refused(
                _UNUSED.format("bmuf"), "strategy='bmuf_find_unused_parameters_true'", at="batch 2"
            ),
            "bmuf_gtc": refused(
                _UNUSED.format("bmuf_gtc"), "strategy='bmuf_gtc_find_unused_parameters_true'", at="batch 2"
            ),
            "sparseloco": refused(
                _UNUSED.format("sparseloco"), "strategy='sparseloco_find_unused_parameters_true'", at="batch 2"
            ),
        },
    ),
    "frozen_layers": (
        "frozen layers (`requires_grad=False`)",
        {
            "ddp": works(),
            "gtc": works(),
            "gtc_update": works(),
            "gtc_stale": works(),
            "dpsgd": works(),
            "adpsgd": works(),
            "ma": works(),
            "bmuf": works(),
            "bmuf_gtc": works(),
            "sparseloco": works(),
        },
    ),
    "tied_weights": (
        "tied weights (one parameter in two layers)",
        {
            "ddp": works(),
            "gtc": works(),
            "gtc_update": works(),
            "gtc_stale": works(),
            "dpsgd": works(),
            "adpsgd": works(),
            "ma": works(),
            "bmuf": works(),
            "bmuf_gtc": works(),
            "sparseloco": works(),
        },
    ),
    "batchnorm": (
        "`BatchNorm1d`",
        {
            "ddp": works(),
            "gtc": works(),
            "gtc_update": works(),
            "gtc_stale": works(),
            "dpsgd": works("the buffers are rank 0's: DDP broadcasts them every forward"),
            "adpsgd": works("each rank keeps its own buffers: DDP broadcasts none after the warmup"),
            "ma": works("the buffers are rank 0's: DDP broadcasts them every forward"),
            "bmuf": works("the buffers are rank 0's: DDP broadcasts them every forward"),
            "bmuf_gtc": works("the buffers are rank 0's: DDP broadcasts them every forward"),
            "sparseloco": works("the buffers are rank 0's: DDP broadcasts them every forward"),
        },
    ),
    "static_graph": (
        "`static_graph=True`",
        {
            "ddp": works(),
            "gtc": works(),
            "gtc_update": works(),
            "gtc_stale": works(),
            "dpsgd": works(),
            "adpsgd": refused(
                "after the warmup DDP reduces no gradient, which its static graph does not support (the error says "
                "to remove it: it only speeds up that reduction)",
                r"static_graph=True cannot be kept.*Remove static_graph",
            ),
            "ma": works(),
            "bmuf": works(),
            "bmuf_gtc": works(),
            "sparseloco": works(),
        },
    ),
    "checkpoint_resume": (
        "`ModelCheckpoint(every_n_train_steps=2)`, then `fit(ckpt_path=...)`",
        {
            "ddp": works("bit-identical to the uninterrupted run"),
            "gtc": works(
                "bit-identical to the uninterrupted run; each rank's residuals in `<ckpt>.gtc/rank<r>.pt`"
            ),
            "gtc_update": works(
                "bit-identical to the uninterrupted run; each rank's residuals and optimizer state in "
                "`<ckpt>.gtc/rank<r>.pt`"
            ),
            "gtc_stale": works(
                "bit-identical to the uninterrupted run; residual shards as for `gtc`, the update in flight "
                "drained into the checkpoint"
            ),
            "dpsgd": works(
                "bit-identical to the uninterrupted run; every rank's own parameters and optimizer state in "
                "`<ckpt>.dpsgd/rank<r>.pt`, their average in the checkpoint"
            ),
            "adpsgd": works(
                "every rank's own parameters, optimizer state and schedule position in `<ckpt>.adpsgd/rank<r>.pt`, "
                "taken after the exchanges finished and restored bit for bit; the steps after depend on when "
                "each exchange lands, as in the uninterrupted run"
            ),
            "ma": works(
                "bit-identical to the uninterrupted run; every rank's own model and optimizer state in "
                "`<ckpt>.ma/rank<r>.pt`, their mean in the checkpoint"
            ),
            "bmuf": works(
                "bit-identical to the uninterrupted run; every rank's own model, optimizer state, W and Δ "
                "in `<ckpt>.bmuf/rank<r>.pt`, their mean in the checkpoint"
            ),
            "bmuf_gtc": works(
                "bit-identical to the uninterrupted run; GTC's residual shards, and every rank's own "
                "model, optimizer state, W and Δ in `<ckpt>.bmuf_gtc/rank<r>.pt`, their mean in the checkpoint"
            ),
            "sparseloco": works(
                "bit-identical to the uninterrupted run; every rank's own model, optimizer state, W, Δ and "
                "residual in `<ckpt>.sparseloco/rank<r>.pt`, their mean in the checkpoint"
            ),
        },
    ),
    "validate_test_after_fit": (
        "`validate` and `test` after `fit`",
        {
            "ddp": works(),
            "gtc": works(),
            "gtc_update": works(),
            "gtc_stale": works(),
            "dpsgd": works("evaluates the average of the ranks' parameters"),
            "adpsgd": works("evaluates the average of the ranks' parameters"),
            "ma": works(
                "evaluates the mean of the ranks' models (`average_eval`)"
            ),
            "bmuf": works(
                "evaluates the mean of the ranks' models (`average_eval`)"
            ),
            "bmuf_gtc": works(
                "evaluates the mean of the ranks' models (`average_eval`)"
            ),
            "sparseloco": works(
                "evaluates the mean of the ranks' models (`average_eval`)"
            ),
        },
    ),
    "validation_in_fit": (
        "validation inside `fit`",
        {
            "ddp": works(),
            "gtc": works(),
            "gtc_update": works(),
            "gtc_stale": works("validation sees the parameters without the update in flight"),
            "dpsgd": works("evaluates the average; each rank's own parameters come back after"),
            "adpsgd": works("finishes every exchange, then evaluates the average; each rank's own parameters come back after"),
            "ma": works(
                "evaluates the mean of the ranks' models between syncs (`average_eval`); each rank's own comes back after"
            ),
            "bmuf": works(
                "evaluates the mean of the ranks' models between syncs (`average_eval`); each rank's own comes back after"
            ),
            "bmuf_gtc": works(
                "evaluates the mean of the ranks' models between syncs (`average_eval`); each rank's own comes back after"
            ),
            "sparseloco": works(
                "evaluates the mean of the ranks' models between syncs (`average_eval`); each rank's own comes back after"
            ),
        },
    ),
    "ema_weights": (
        "`EMAWeightAveraging` callback (Lightning's moving average of the weights, the model fit ends with)",
        {
            "ddp": works(),
            "gtc": works(),
            "gtc_update": works(),
            "gtc_stale": works("the average takes the parameters without the update in flight"),
            "dpsgd": works("each rank averages its own model; fit ends with the mean of the ranks' averages, which checkpoints hold"),
            "adpsgd": works("each rank averages its own model; fit ends with the mean of the ranks' averages, which checkpoints hold"),
            "ma": works("each rank averages its own model; fit ends with the mean of the ranks' averages, which checkpoints hold"),
            "bmuf": works("each rank averages its own model; fit ends with the mean of the ranks' averages, which checkpoints hold"),
            "bmuf_gtc": works("each rank averages its own model; fit ends with the mean of the ranks' averages, which checkpoints hold"),
            "sparseloco": works("each rank averages its own model; fit ends with the mean of the ranks' averages, which checkpoints hold"),
        },
    ),
    "compiled": (
        '`torch.compile` in `configure_model` (`backend="eager"`)',
        {
            "ddp": works(),
            "gtc": works(),
            "gtc_update": works(),
            "gtc_stale": works(),
            "dpsgd": works(),
            "adpsgd": works(),
            "ma": works(),
            "bmuf": works(),
            "bmuf_gtc": works(),
            "sparseloco": works(),
        },
    ),
    "clip_norm": (
        "`gradient_clip_val`, by norm",
        {
            "ddp": works("clips the averaged gradient"),
            "gtc": works("clips each rank's local gradient at sqrt(N) times the threshold (`local_clip_scale`) before it enters the residual"),
            "gtc_update": works("clips each rank's local gradient at sqrt(N) times the threshold (`local_clip_scale`) before its optimizer steps on it"),
            "gtc_stale": works("clips each rank's local gradient at sqrt(N) times the threshold (`local_clip_scale`) before it enters the residual"),
            "dpsgd": works("clips each rank's local gradient"),
            "adpsgd": works("clips each rank's local gradient"),
            "ma": works("clips each rank's local gradient"),
            "bmuf": works("clips each rank's local gradient"),
            "bmuf_gtc": works("clips each rank's local gradient"),
            "sparseloco": works("clips each rank's local gradient"),
        },
    ),
    "clip_value": (
        '`gradient_clip_val`, `gradient_clip_algorithm="value"`',
        {
            "ddp": works("clips the averaged gradient"),
            "gtc": works("clips each rank's local gradient at sqrt(N) times the threshold (`local_clip_scale`) before it enters the residual"),
            "gtc_update": works("clips each rank's local gradient at sqrt(N) times the threshold (`local_clip_scale`) before its optimizer steps on it"),
            "gtc_stale": works("clips each rank's local gradient at sqrt(N) times the threshold (`local_clip_scale`) before it enters the residual"),
            "dpsgd": works("clips each rank's local gradient"),
            "adpsgd": works("clips each rank's local gradient"),
            "ma": works("clips each rank's local gradient"),
            "bmuf": works("clips each rank's local gradient"),
            "bmuf_gtc": works("clips each rank's local gradient"),
            "sparseloco": works("clips each rank's local gradient"),
        },
    ),
    "sparse_embedding": (
        "`nn.Embedding(sparse=True)`",
        {
            "ddp": works(),
            "gtc": refused(
                "GTC compresses dense gradients; the error names the parameter and the fixes "
                "(`sparse=False`, freeze it, or `ddp`)",
                r"\['embedding\.weight'\] get sparse gradients.*sparse=False",
            ),
            "gtc_update": refused(
                "GTC compresses dense gradients; the error names the parameter and the fixes "
                "(`sparse=False`, freeze it, or `ddp`)",
                r"\['embedding\.weight'\] get sparse gradients.*sparse=False",
            ),
            "gtc_stale": refused(
                "GTC compresses dense gradients; the error names the parameter and the fixes "
                "(`sparse=False`, freeze it, or `ddp`)",
                r"\['embedding\.weight'\] get sparse gradients.*sparse=False",
            ),
            "dpsgd": works(),
            "adpsgd": works(),
            "ma": works(),
            "bmuf": works(),
            "bmuf_gtc": refused(
                "GTC compresses dense gradients; the error names the parameter and the fixes "
                "(`sparse=False`, freeze it, or `ddp`)",
                r"\['embedding\.weight'\] get sparse gradients.*sparse=False",
            ),
            "sparseloco": works(),
        },
    ),
    "cli_class_path_yaml": (
        "`LightningCLI`: `class_path` + `init_args` in a YAML file",
        {
            "ddp": works(),
            "gtc": works(),
            "gtc_update": works(),
            "gtc_stale": works(),
            "dpsgd": works(),
            "adpsgd": works(),
            "ma": works(),
            "bmuf": works(),
            "bmuf_gtc": works(),
            "sparseloco": works(),
        },
    ),
    "cli_class_path_args": (
        "`LightningCLI`: `--trainer.strategy <class path> --trainer.strategy.<arg> ...`",
        {
            "ddp": works(),
            "gtc": works(),
            "gtc_update": works(),
            "gtc_stale": works(),
            "dpsgd": works(),
            "adpsgd": works(),
            "ma": works(),
            "bmuf": works(),
            "bmuf_gtc": works(),
            "sparseloco": works(),
        },
    ),
    "cli_by_name": (
        "`LightningCLI`: `--trainer.strategy <name>_fork`",
        {
            "ddp": works(),
            "gtc": works(),
            "gtc_update": works(),
            "gtc_stale": works(),
            "dpsgd": works(),
            "adpsgd": works(),
            "ma": works(
                "runs, learns nothing here: the name's period=10 syncs none of the 8 steps, and the tiny "
                "MLP's local SGD alone diverges (loss not checked)",
                learns=False,
            ),
            "bmuf": works(
                "runs, learns nothing here: the name's period=50 syncs none of the 8 steps, and the tiny "
                "MLP's local SGD alone diverges (loss not checked)",
                learns=False,
            ),
            "bmuf_gtc": refused(
                "the registered names use `group_size=2`, one group of these 2 ranks (runs on 4: `tests/test_bmuf.py`)",
                "makes one group",
            ),
            "sparseloco": works(
                "runs, learns nothing here: the name's period=30 syncs none of the 8 steps, and the tiny "
                "MLP's local SGD alone diverges (loss not checked)",
                learns=False,
            ),
        },
    ),
    "fabric": (
        "Lightning Fabric: `Fabric(strategy=\"<name>_fork\")`, a plain loop",
        {
            "ddp": works(),
            "gtc": works("`GTCFabricStrategy`; clipping is its `gradient_clip_val` option (before compression); `fabric.clip_gradients` is refused"),
            "gtc_update": works("`GTCFabricStrategy` picks the update mode once `fabric.setup` is given the optimizer; `fabric.clip_gradients` clips each rank's own gradient"),
            "gtc_stale": refused(
                "Fabric has no optimizer-step hooks for it: a Trainer strategy only", r"Lightning Trainer strategy only"
            ),
            "dpsgd": refused(
                "Fabric has no optimizer-step hooks for it: a Trainer strategy only", r"Lightning Trainer strategy only"
            ),
            "adpsgd": refused(
                "Fabric has no optimizer-step hooks for it: a Trainer strategy only", r"Lightning Trainer strategy only"
            ),
            "ma": refused(
                "Fabric has no optimizer-step hooks for it: a Trainer strategy only", r"Lightning Trainer strategy only"
            ),
            "bmuf": refused(
                "Fabric has no optimizer-step hooks for it: a Trainer strategy only", r"Lightning Trainer strategy only"
            ),
            "bmuf_gtc": refused(
                "Fabric has no optimizer-step hooks for it: a Trainer strategy only", r"Lightning Trainer strategy only"
            ),
            "sparseloco": refused(
                "Fabric has no optimizer-step hooks for it: a Trainer strategy only", r"Lightning Trainer strategy only"
            ),
        },
    ),
}


def cell_text(outcome: Outcome) -> str:
    if outcome.works:
        return f"works: {outcome.text}" if outcome.text else "works"
    when = "at setup" if outcome.at == "setup" else f"at {outcome.at}"
    return f"**refused** {when}: {outcome.text}"


def render_table(short: bool = False) -> str:
    """The whole matrix: one row per feature, one column per strategy (``short=False``); or the short
    form: one row per set of features refused where ``ddp`` works, with the strategies of the family that
    refuse just those (every other row of the matrix works for them; a feature DDP itself refuses is
    Lightning's, and left out)."""
    names = list(STRATEGIES)
    if short:
        lines = [
            f"| strategies | refused where DDP works (each other feature of the {len(MATRIX)}-row matrix works) |",
            "|---|---|",
        ]
        rows: dict[str, list[str]] = {}  # what is refused -> the strategies refusing just that, in order
        for name in names[1:]:
            refusals = [
                title for title, outcomes in MATRIX.values() if not outcomes[name].works and outcomes[names[0]].works
            ]
            rows.setdefault("; ".join(refusals) if refusals else "nothing", []).append(label(name))
        lines += [f"| {'; '.join(strategies)} | {refused} |" for refused, strategies in rows.items()]
        return "\n".join(lines)
    lines = [
        "| Lightning feature | " + " | ".join(label(name) for name in names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for title, outcomes in MATRIX.values():
        lines.append(f"| {title} | " + " | ".join(cell_text(outcomes[name]) for name in names) + " |")
    return "\n".join(lines)


FORMS = {False: (BEGIN, END), True: (SHORT_BEGIN, SHORT_END)}  # short -> its markers


def marked_table(text: str, short: bool = False) -> str | None:
    """What ``text`` holds between the markers of one form; ``None`` when it has none."""
    begin, end = FORMS[short]
    if begin not in text or end not in text:
        return None
    return text.split(begin, 1)[1].split(end, 1)[0].strip("\n")


def readme_table(text: str) -> str:
    """What a file holds between the markers of the whole matrix (kept for callers of 0.2.0)."""
    table = marked_table(text)
    if table is None:
        raise ValueError(f"the file lacks the markers {BEGIN!r} and {END!r} around the compatibility table")
    return table


def stale_blocks(path: Path) -> list[str]:
    """The forms whose block in ``path`` differs from the matrix (``"full"``, ``"short"``)."""
    text = path.read_text()
    return [
        "short" if short else "full"
        for short in FORMS
        if (table := marked_table(text, short)) is not None and table != render_table(short)
    ]


def update_file(path: Path) -> bool:
    """Rewrite every block of either form in ``path``; returns whether the file changed.

    Raises:
        ValueError: ``path`` has the markers of neither form.
    """
    text = original = path.read_text()
    if all(marked_table(text, short) is None for short in FORMS):
        raise ValueError(f"{path} has no compatibility-table markers ({BEGIN!r} or {SHORT_BEGIN!r})")
    for short, (begin, end) in FORMS.items():
        if marked_table(text, short) is not None:
            head, rest = text.split(begin, 1)
            tail = rest.split(end, 1)[1]
            text = f"{head}{begin}\n{render_table(short)}\n{end}{tail}"
    if text == original:
        return False
    path.write_text(text)
    return True


def update_readme(path: Path = README) -> bool:
    """Rewrite the blocks of ``path`` (the README by default); returns whether the file changed."""
    return update_file(path)


def default_targets() -> list[Path]:
    """The README, and the docs' reference page where it holds a block."""
    page = DOCS_PAGE.is_file() and any(marked_table(DOCS_PAGE.read_text(), short) is not None for short in FORMS)
    return [README] + ([DOCS_PAGE] if page else [])


if __name__ == "__main__":
    for target in [Path(arg) for arg in sys.argv[1:]] or default_targets():
        changed = update_file(target)
        print(f"{target}: compatibility table {'rewritten' if changed else 'already up to date'}")
