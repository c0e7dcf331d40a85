"""The tables in the Markdown that are rendered from JSON in the repository, and the script that renders them.

Each table sits between two markers, ``<!-- NAME: begin (...) -->`` and ``<!-- NAME: end -->``, in any
of the files ``FILES`` lists; ``TABLES`` maps NAME to the function that renders it. Three kinds:

- ``model-suite``: the README's summary of the model suite at 4 ranks, and ``model-suite-report``: the
  suite's whole report, both from ``docs/benchmarks/model_suite/results.json`` (``python -m
  gtc_lightning.tools.model_suite --out docs/benchmarks/model_suite`` writes it);
- ``model-suite-long-options``: the long profile's GTC settings and the update mode's options against
  DDP, seed by seed, from ``docs/benchmarks/model_suite_long/results.json`` and
  ``docs/benchmarks/model_suite_long_mechanisms/results.json``, and ``model-suite-long-summary``: the
  README's selection of it (the defaults, the density warm-up, PowerSGD and bf16);
- ``compat-matrix`` and ``compat-matrix-short``: the compatibility matrix, from ``tests/compat_matrix.py``;
- ``recipe-results``: the current section of ``recipes/asr/RESULTS.md``, from ``recipes/asr/RESULTS.json``,
  and ``recipe-results-kaldi``: the section of run.sh's ``profile=kaldi``, from ``recipes/asr/RESULTS-kaldi.json``
  (``recipes/asr/local/results.py``).

    python tests/doc_tables.py           # rewrite every stale table
    python tests/doc_tables.py --check   # exit 1 and name the stale tables

``tests/test_doc_tables.py`` fails when a table differs from what its JSON renders.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL_SUITE_JSON = ROOT / "docs" / "benchmarks" / "model_suite" / "results.json"
REGENERATE = "python tests/doc_tables.py"
MARKER = re.compile(r"<!-- ([a-z0-9-]+): begin \(.*?\) -->\n(.*?)\n?<!-- \1: end -->", re.DOTALL)

# The model suite's models as the README names them: (label, optimizer).
SUITE_MODELS = {
    "transformer": ("transformer LM", "AdamW"),
    "cnn": ("CNN + BatchNorm", "SGD Nesterov"),
    "gru": ("GRU", "Adam"),
    "speech_dnn": ("speech DNN", "plain SGD"),
}
# The columns of the README's summary: (method in results.json, header).
SUITE_COLUMNS = (
    ("gtc", "GTC 1e-2, no warm-up (the defaults then)"),
    ("gtc_3e-2", "GTC, density 3e-2"),
    ("powersgd_r1", "PowerSGD rank 1"),
    ("powersgd_r4", "PowerSGD rank 4"),
    ("ddp_bf16", "bf16 all-reduce"),
)
SUITE_WORLD_SIZE = 4
LONG_JSONS = (
    ROOT / "docs" / "benchmarks" / "model_suite_long" / "results.json",
    ROOT / "docs" / "benchmarks" / "model_suite_long_mechanisms" / "results.json",
)
# The columns of the long profile's table of options: (method in the JSONs, header).
LONG_OPTION_COLUMNS = (
    ("gtc", "`gtc` (former defaults)"),
    ("gtc_density_warmup", "`gtc_density_warmup`"),
    ("gtc_word_levels", "`gtc_word_levels`"),
    ("gtc_displacement", "`gtc_displacement`"),
    ("gtc_3e-3", "`gtc_3e-3`"),
    ("gtc_3e-3_density_warmup", "`gtc_3e-3_density_warmup`"),
    ("gtc_3e-3_word_levels", "`gtc_3e-3_word_levels`"),
    ("gtc_3e-3_displacement", "`gtc_3e-3_displacement`"),
    ("gtc_momentum_masking", "`gtc_momentum_masking`"),
    ("gtc_3e-3_momentum_masking", "`gtc_3e-3_momentum_masking`"),
    ("powersgd_r4", "`powersgd_r4`"),
)

# The long profile's table of what the ranks' own optimizer moments cost (Adam models): (method, header).
LONG_MOMENT_COLUMNS = (
    ("local_moments_dense", "`local_moments_dense` (own moments, dense average)"),
    ("gtc", "`gtc` (former defaults)"),
    ("gtc_mean_variance", "`gtc_mean_variance`"),
    ("gtc_3e-3", "`gtc_3e-3`"),
    ("gtc_3e-3_mean_variance", "`gtc_3e-3_mean_variance`"),
    ("gtc_defaults", "GTC defaults (density warm-up)"),
    ("gtc_density_warmup_mean_variance", "`gtc_density_warmup_mean_variance`"),
)
ADAM_MODELS = ("transformer", "gru", "transformer_lm")
# The long profile's table of the family: (method, header).
LONG_FAMILY_COLUMNS = (
    ("gtc_defaults", "GTC defaults"),
    ("ma", "`ma`"),
    ("diloco", "`diloco`"),
    ("sparseloco", "`sparseloco`"),
    ("sparseloco_h10", "`sparseloco_h10`"),
    ("sparseloco_h20_3e-2", "`sparseloco_h20_3e-2`"),
    ("bmuf_gtc", "`bmuf_gtc`"),
    ("dpsgd", "`dpsgd`"),
    ("adpsgd", "`adpsgd`"),
)

# Gradient clipping by norm at the model's c (model_suite.CLIP_NORM), each against DDP clipped at c
LONG_CLIPPING_ROWS = (
    ("ddp", "DDP, not clipped"),
    ("gtc_defaults_clip", "GTC defaults, each rank's gradient clipped at c (`local_clip_scale=1`)"),
    ("gtc_defaults_clip_dgc", "GTC defaults, each rank's gradient clipped at sqrt(N) c (the default)"),
)


def model_suite_long_clipping(paths: tuple[Path, ...] = LONG_JSONS, world_size: int = SUITE_WORLD_SIZE) -> str:
    """Per model with clipped runs: DDP clipped at c, and each row of :data:`LONG_CLIPPING_ROWS` against it
    (same seeds; cells as in :func:`model_suite_long_options`)."""
    runs = long_runs(paths, world_size)
    lines = ["| model | setting | held-out loss against DDP clipped at c |", "|---|---|---|"]
    for model in [model for model, method in runs if method == "ddp_clip"]:
        base = runs[(model, "ddp_clip")]
        lines.append(
            f"| {long_label(model)} | DDP clipped at c | {statistics.fmean(r['final_loss'] for r in base.values()):.4f} ({len(base)}) |"
        )
        for method, label in LONG_CLIPPING_ROWS:
            found = long_change(runs, model, method, "ddp_clip")
            if found is not None:
                change, ratio, each = found
                spread = f" [{min(each):+.2f}, {max(each):+.2f}]" if len(each) > 1 else ""
                lines.append(f"| {long_label(model)} | {label} | {change:+.2f} %{spread} at {ratio:.0f}x ({len(each)}) |")
    return "\n".join(lines)


def _ratio(x: float) -> str:
    return f"{x:.0f}×" if x >= 30 else f"{x:.1f}×"


def model_suite_table(path: Path = MODEL_SUITE_JSON, world_size: int = SUITE_WORLD_SIZE) -> str:
    """Held-out loss against DDP's (mean over seeds) and how many times fewer bytes than a fp32 ring
    all-reduce, per model and method, as ``tools/model_suite.py``'s own report computes them."""
    runs = [r for r in json.loads(path.read_text()) if r["world_size"] == world_size and "error" not in r]

    def of(model: str, method: str) -> list[dict]:
        return [r for r in runs if r["model"] == model and r["method"] == method]

    lines = [
        "| model, optimizer | " + " | ".join(header for _, header in SUITE_COLUMNS) + " |",
        "|---|" + "---|" * len(SUITE_COLUMNS),
    ]
    for model, (label, optimizer) in SUITE_MODELS.items():
        ddp = statistics.fmean(r["final_loss"] for r in of(model, "ddp"))
        cells = []
        for method, _ in SUITE_COLUMNS:
            mine = of(model, method)
            loss = statistics.fmean(r["final_loss"] for r in mine)
            ratio = statistics.fmean(r["ratio_fp32"] for r in mine)
            cells.append(f"{100 * (loss - ddp) / ddp:+.1f} %, {_ratio(ratio)}")
        lines.append(f"| {label}, {optimizer} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# The README's summary of the long profile: (method in the JSONs, header).
LONG_SUMMARY_COLUMNS = (
    ("gtc_defaults", "GTC defaults"),
    ("gtc", "GTC, no warm-up (former defaults)"),
    ("gtc_3e-3_density_warmup", "GTC 3e-3, density warm-up"),
    ("powersgd_r1", "PowerSGD rank 1"),
    ("powersgd_r4", "PowerSGD rank 4"),
    ("ddp_bf16", "bf16 all-reduce"),
)
LONG_LABELS = {**{m: f"{label}, {opt}" for m, (label, opt) in SUITE_MODELS.items()},
               "transformer": "transformer LM 106 k, AdamW", "transformer_lm": "transformer LM 2.4 M, AdamW"}  # fmt: skip


def model_suite_long_summary() -> str:
    """The README's table of the long profile: the defaults, the former defaults and the baselines, each
    cell as in :func:`model_suite_long_options`, at the profile's budgets."""
    return model_suite_long_options(columns=LONG_SUMMARY_COLUMNS, labels=LONG_LABELS, current=True)


def long_label(model: str, labels: dict[str, str] | None = None) -> str:
    """A row's name: ``labels``' (or the suite's) name of the model, with its budget where the model runs
    another number of steps than most of the profile's, or has runs at an earlier budget (``"cnn@2000"``)."""
    from gtc_lightning.tools.model_suite import LONG_STEPS

    base, _, steps = model.partition("@")
    name = (labels or {}).get(base, base)
    if steps or LONG_STEPS[base] != statistics.mode(LONG_STEPS.values()):
        return f"{name}, {int(steps or LONG_STEPS[base]):,} steps"
    return name


def _long_order(model: str) -> tuple[int, int]:
    """Rows in the profile's order of models, a model's earlier budgets after its current one."""
    from gtc_lightning.tools.model_suite import LONG_STEPS

    base, _, steps = model.partition("@")
    return list(LONG_STEPS).index(base) if base in LONG_STEPS else len(LONG_STEPS), int(steps or 0)


# The suite's name of the setting GTCStrategy() is since its density warm-up became a default ("auto": 5 % of
# the run; ``gtc_defaults`` runs where there are some; tests/test_model_suite.py checks they are the same);
# with plain SGD (the speech DNN) word_levels="auto" adds words of up to 8 tau.
DEFAULTS_MEASURED_AS = "gtc_density_warmup"
DEFAULTS_MEASURED_AS_PLAIN_SGD = "gtc_word_levels"
PLAIN_SGD_MODELS = ("speech_dnn",)


def defaults_measured_as(model: str) -> str:
    """The suite method whose runs are ``GTCStrategy()``'s on ``model``."""
    return DEFAULTS_MEASURED_AS_PLAIN_SGD if model in PLAIN_SGD_MODELS else DEFAULTS_MEASURED_AS


def long_runs(paths: tuple[Path, ...] = LONG_JSONS, world_size: int = SUITE_WORLD_SIZE) -> dict:
    """``(model, method) -> {seed: run}`` of the long profile at ``world_size`` ranks (errors left out);
    ``(model, "gtc_defaults")`` without runs of its own takes those of :func:`defaults_measured_as`. Runs
    at another budget than the profile's (``model_suite.LONG_STEPS``: a budget that grew) are the model
    ``"cnn@2000"``, apart from the current ones."""
    from gtc_lightning.tools.model_suite import LONG_STEPS

    groups: dict[tuple[str, str], dict[int, dict]] = {}
    for p in paths:
        for r in json.loads(p.read_text()):
            if r["world_size"] == world_size and "error" not in r:
                model = r["model"] if r["steps"] == LONG_STEPS.get(r["model"]) else f"{r['model']}@{r['steps']}"
                groups.setdefault((model, r["method"]), {})[r["seed"]] = r
    for model, method in list(groups):
        if method == defaults_measured_as(model.partition("@")[0]) and (model, "gtc_defaults") not in groups:
            groups[(model, "gtc_defaults")] = groups[(model, method)]
    return groups


def long_change(
    runs: dict, model: str, method: str, base: str = "ddp"
) -> tuple[float, float, list[float]] | None:
    """A setting's held-out loss against DDP's (or ``base``'s) of the same seeds (ratio of the means, per
    cent), its mean ratio of bytes to a fp32 ring all-reduce and each seed's own change; None without a run."""
    ddp = runs.get((model, base), {})
    mine = {s: r for s, r in runs.get((model, method), {}).items() if s in ddp}
    if not mine:
        return None
    base = statistics.fmean(ddp[s]["final_loss"] for s in mine)
    mean = statistics.fmean(r["final_loss"] for r in mine.values())
    each = [100 * (r["final_loss"] - ddp[s]["final_loss"]) / ddp[s]["final_loss"] for s, r in mine.items()]
    return 100 * (mean - base) / base, statistics.fmean(r["ratio_fp32"] for r in mine.values()), each


def model_suite_long_options(
    paths: tuple[Path, ...] = LONG_JSONS,
    world_size: int = SUITE_WORLD_SIZE,
    columns: tuple[tuple[str, str], ...] = LONG_OPTION_COLUMNS,
    labels: dict[str, str] | None = None,
    only: tuple[str, ...] | None = None,
    current: bool = False,
    min_filled: int = 1,
) -> str:
    """Per model and setting of the long profile: the held-out loss against DDP's of the same seeds
    (ratio of the means, then the lowest and highest seed's own change in brackets), the mean ratio of
    bytes to a fp32 ring all-reduce, and the number of seeds. Settings without a run are left empty; ``only``:
    these models alone; ``current``: at the profile's budgets alone (not a model's earlier, shorter runs); a
    model with fewer than ``min_filled`` settings measured is left out."""
    runs = long_runs(paths, world_size)
    models = sorted(
        (
            model
            for model, method in runs
            if method == "ddp"
            and (only is None or model.partition("@")[0] in only)
            and not (current and "@" in model)
        ),
        key=_long_order,
    )
    lines = [
        "| model | DDP | " + " | ".join(header for _, header in columns) + " |",
        "|---|---|" + "---|" * len(columns),
    ]
    for model in models:
        ddp = runs[(model, "ddp")]
        cells = [f"{statistics.fmean(r['final_loss'] for r in ddp.values()):.4f} ({len(ddp)})"]
        for method, _ in columns:
            found = long_change(runs, model, method)
            if found is None:
                cells.append("")
                continue
            change, ratio, each = found
            spread = f" [{min(each):+.2f}, {max(each):+.2f}]" if len(each) > 1 else ""
            cells.append(f"{change:+.2f} %{spread} at {ratio:.0f}x ({len(each)})")
        if sum(bool(c) for c in cells[1:]) >= min_filled:
            lines.append(f"| {long_label(model, labels)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def model_suite_report(path: Path = MODEL_SUITE_JSON) -> str:
    """The model suite's whole report (models, one table per world size, DDP's last evaluations), as
    ``python -m gtc_lightning.tools.model_suite`` writes it to ``results.md``."""
    from gtc_lightning.tools.model_suite import report_markdown

    return report_markdown(json.loads(path.read_text())).strip("\n")


def _load(name: str, path: Path):
    """The module at ``path`` (imported once; dataclasses need it in ``sys.modules``)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _compat(short: bool) -> Callable[[], str]:
    return lambda: _load("compat_matrix", ROOT / "tests" / "compat_matrix.py").render_table(short)


def _recipe_results(profile: str) -> Callable[[], str]:
    def render() -> str:
        results = _load("recipe_results", ROOT / "recipes" / "asr" / "local" / "results.py")
        return results.render(json.loads(results.PROFILES[profile][0].read_text()))

    return render


TABLES: dict[str, Callable[[], str]] = {
    "model-suite": model_suite_table,
    "model-suite-report": model_suite_report,
    "model-suite-long-options": model_suite_long_options,
    "model-suite-long-summary": model_suite_long_summary,
    "model-suite-long-moments": lambda: model_suite_long_options(columns=LONG_MOMENT_COLUMNS, only=ADAM_MODELS),
    "model-suite-long-family": lambda: model_suite_long_options(columns=LONG_FAMILY_COLUMNS, min_filled=2),
    "model-suite-long-family-short": lambda: model_suite_long_options(
        columns=tuple(c for c in LONG_FAMILY_COLUMNS if not c[0].startswith("sparseloco_h")), labels=LONG_LABELS,
        min_filled=2,
    ),
    "model-suite-long-clipping": model_suite_long_clipping,
    "compat-matrix": _compat(False),
    "compat-matrix-short": _compat(True),
    "recipe-results": _recipe_results("default"),
    "recipe-results-kaldi": _recipe_results("kaldi"),
}


def files() -> list[Path]:
    """Every Markdown file that may hold a table: the README, the recipe's, CHANGELOG and the docs."""
    fixed = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "recipes" / "asr" / "README.md",
             ROOT / "recipes" / "asr" / "RESULTS.md"]
    return [p for p in fixed if p.is_file()] + sorted((ROOT / "docs").rglob("*.md"))


def blocks(text: str) -> list[tuple[str, str]]:
    """(name, content) of every marked table in ``text``."""
    return [(m.group(1), m.group(2).strip("\n")) for m in MARKER.finditer(text)]


def stale(path: Path) -> list[str]:
    """The names of the tables in ``path`` that differ from what renders now (unknown names included)."""
    return [name for name, content in blocks(path.read_text())
            if name not in TABLES or content != TABLES[name]()]


def rewrite(path: Path) -> bool:
    """Render every known table of ``path`` again; returns whether the file changed."""
    text = path.read_text()

    def render(m: re.Match) -> str:
        name = m.group(1)
        if name not in TABLES:
            return m.group(0)
        begin = m.group(0).split("\n", 1)[0]
        return f"{begin}\n{TABLES[name]()}\n<!-- {name}: end -->"

    new = MARKER.sub(render, text)
    if new != text:
        path.write_text(new)
    return new != text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="rewrite nothing; exit 1 if a table is stale")
    args = parser.parse_args(argv)
    status = 0
    for path in files():
        if args.check:
            for name in stale(path):
                print(f"{path.relative_to(ROOT)}: table {name!r} is stale; regenerate: {REGENERATE}")
                status = 1
        elif rewrite(path):
            print(f"{path.relative_to(ROOT)}: rewritten")
    return status


if __name__ == "__main__":
    sys.exit(main())
