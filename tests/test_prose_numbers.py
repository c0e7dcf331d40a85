"""Numbers in prose that stay true: every measured figure that the README, the user guide
(docs/guide/*.md; installation.md is checked by its own owner) and the recipe's README state in running
text is checked here against the data it comes from.

The tables are rendered from their JSON (``tests/doc_tables.py``); the text around them is not, so each
figure of the text belongs to a *claim*: a phrase that this module renders from its source (the model
suite's ``results.json`` and sweeps, ``recipes/asr/RESULTS.json`` and ``RESULTS-kaldi.json``, the step
overhead's, the emulated cluster's and the faults' JSON, the current section of ``RESULTS.md``) exactly as
the page must say it, or a phrase whose facts a test here computes from that source. A page must hold
each of its claims (whitespace, links' targets and inline code aside), and once the claims and the
settings (``SETTINGS``: defaults, constants and conditions, each checked against the code or marked as a
condition) are taken out of its prose (generated tables and code blocks are not prose), no figure may be
left: a new figure in prose fails ``test_every_figure_in_prose_is_checked`` until it is a claim here.

A figure is a number with a unit (%, ×, ms, s, min, kB, MB, bits, bytes, M, k, ...), with a decimal
point, or with a thousands comma; plain integers (2 ranks, 3 seeds, stages 0-11), dates, versions and
settings such as 1e-2 are not.

    python -m pytest -q tests/test_prose_numbers.py

When data change (a new suite run, a new recipe build), a failure prints the phrase as the data render it:
copy it into the page.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from collections import defaultdict
from decimal import ROUND_HALF_UP, Decimal
from functools import cache
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import doc_tables

from gtc_lightning.algorithms.gtc.config import DENSITY_WARMUP_SHARE, DENSITY_WARMUP_START

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RECIPE_README = ROOT / "recipes" / "asr" / "README.md"
RESULTS_MD = ROOT / "recipes" / "asr" / "RESULTS.md"
GUIDE = ROOT / "docs" / "guide"
SUITE = ROOT / "docs" / "benchmarks" / "model_suite"
BENCH = ROOT / "docs" / "benchmarks"


def documents() -> list[Path]:
    """The pages whose prose figures must be claims: the README, the recipe's README, the guide."""
    guide = [p for p in sorted(GUIDE.glob("*.md")) if p.name != "installation.md"]
    return [README, RECIPE_README, *guide]


# --- reading the pages ---------------------------------------------------------------------------

FENCE = re.compile(r"^```.*?^```[^\n]*$", re.DOTALL | re.MULTILINE)
COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)
LINK_TARGET = re.compile(r"\]\([^)\s]*\)")
INLINE_CODE = re.compile(r"`[^`]*`")


def normalize(text: str) -> str:
    """Text as the claims are matched: links' targets and inline code taken out, whitespace one space."""
    text = LINK_TARGET.sub("]", text)
    text = INLINE_CODE.sub("`", text)
    return re.sub(r"\s+", " ", text).strip()


def prose(path: Path) -> str:
    """A page's running text: without tables (those rendered from JSON are checked by test_doc_tables.py, the
    model suite page's by a test here), code blocks and comments, normalized."""
    text = doc_tables.MARKER.sub("", path.read_text())
    text = re.sub(r"<!-- compat-matrix(-short)?: begin.*?<!-- compat-matrix(-short)?: end -->", "", text,
                  flags=re.DOTALL)
    text = COMMENT.sub("", FENCE.sub("", text))
    text = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("|"))  # tables
    return normalize(text)


UNIT = r"(?:%|×|x|ms|s|min|kB|KB|MB|GB|M|k|bits?|bytes?|Mbit/s|Gbit/s|points?|GiB)"
NUMBER = re.compile(rf"(?<![\w.,\-−/+])[+\-−]?\d[\d,]*(?:\.\d+)?(?:\s?{UNIT}(?![\w]))?")
DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
VERSION = re.compile(r"(?:\d+\.){2}\d+|(?:Python|torch|Lightning|Triton|version|≥)\s\d+(?:\.\d+)*")
SCIENTIFIC = re.compile(r"\d(?:\.\d+)?e-\d+")


def figures(text: str) -> list[str]:
    """The figures of a text (see the module's docstring for what counts)."""
    text = SCIENTIFIC.sub("", VERSION.sub("", DATE.sub("", text)))
    text = re.sub(r"(?<=\d)[-–](?=\d)", " - ", text)  # a range's two ends, each a figure
    found = []
    for m in NUMBER.finditer(text):
        token = m.group(0)
        number = re.match(r"[+\-−]?[\d,]*(?:\.\d+)?", token).group(0)
        if token != number or "." in number or re.search(r"\d,\d{3}", number):
            found.append(token)
    return found


# --- the sources -----------------------------------------------------------------------------------

@cache
def suite() -> dict[tuple[int, str, str], list[dict]]:
    """(world size, model, method) -> the runs of the model suite and its density sweeps."""
    groups: dict[tuple[int, str, str], list[dict]] = defaultdict(list)
    for name in ("results", "sweep_update_gradient", "sweep_dense"):
        for run in json.loads((SUITE / f"{name}.json").read_text()):
            key = (run["world_size"], run["model"], run["method"])
            if "error" not in run and (name == "results" or run["method"] != "ddp"):
                groups[key].append(run)
    return groups


MODELS = ("transformer", "cnn", "gru", "speech_dnn")


def loss(model: str, method: str, world: int = 4) -> float:
    return statistics.fmean(r["final_loss"] for r in suite()[(world, model, method)])


def vs_ddp(model: str, method: str, world: int = 4) -> float:
    """Held-out loss against DDP's, in per cent."""
    return 100 * (loss(model, method, world) - loss(model, "ddp", world)) / loss(model, "ddp", world)


def ratio(model: str, method: str, world: int = 4) -> float:
    return statistics.fmean(r["ratio_fp32"] for r in suite()[(world, model, method)])


@cache
def long_runs() -> dict[tuple[str, str], dict[int, dict]]:
    """(model, method) -> seed -> run, of the long profile at 4 ranks (both JSONs, errors left out)."""
    return doc_tables.long_runs()


def long_change(model: str, method: str) -> tuple[float, float, list[float]]:
    """On the long profile: the held-out loss against DDP's of the same seeds (per cent), the mean ratio to a
    fp32 ring all-reduce, and each seed's own change, as the tables compute them."""
    return doc_tables.long_change(long_runs(), model, method)


LONG_MODELS = ("transformer", "cnn", "gru", "speech_dnn", "transformer_lm")
LONG_NAMES = {"transformer": "the small transformer", "cnn": "the CNN", "gru": "the GRU",
              "speech_dnn": "the recipe's speech DNN", "transformer_lm": "the 2.4 M-weight transformer LM"}  # fmt: skip


def long_headline() -> list[str]:
    """The README's headline: the defaults (with their density warm-up) on the long profile, the models not
    yet within 1 %, and what the warm-up changed."""
    changes = {m: long_change(m, "gtc_defaults") for m in LONG_MODELS}
    budgets = {m: {run["steps"] for run in long_runs()[(m, "gtc_defaults")].values()} for m in LONG_MODELS}
    budgets = {m: b for m, (b,) in budgets.items()}  # one budget a model
    steps = statistics.mode(budgets.values())
    assert all(m == "cnn" for m, b in budgets.items() if b != steps), budgets  # the sentence names the CNN's
    longer = "".join(f" (the CNN {b:,})" for b in budgets.values() if b != steps)
    seeds = max(len(long_runs()[(m, "gtc_defaults")]) for m in LONG_MODELS)
    within = [m for m in LONG_MODELS if abs(changes[m][0]) < 1.0]
    others = [m for m in LONG_MODELS if m not in within]

    def named(m: str, method: str = "gtc_defaults") -> str:
        change, _, each = long_change(m, method)
        seeds = f"{len(each)} seeds: {pct(min(each))[:-2]} to {pct(max(each))}" if len(each) > 1 else "1 seed"
        return f"{LONG_NAMES[m]}: {pct(change)} ({seeds})"

    dnn = long_change("speech_dnn", "gtc")
    combo = long_change("transformer_lm", "gtc_density_warmup_mean_variance")
    return [
        (f"{span([changes[m][1] for m in LONG_MODELS])}× fewer bytes than a fp32 all-reduce, within "
         f"{max(abs(changes[m][0]) for m in within):.1f} % of DDP's held-out loss on {len(within)} of "
         f"{len(LONG_MODELS)} models** trained for {steps:,} steps{longer}: ` with no arguments, 4 CPU ranks, mean of "
         f"{seeds} seeds"),
        "Not yet on " + " and ".join(named(m) for m in others) + ";",
        (f"brings it to {pct(combo[0])} ({len(combo[2])} seeds)"),
        (f"(DGC's: from {DENSITY_WARMUP_START:g} to the target over the first {100 * DENSITY_WARMUP_SHARE:.0f} % of "
         "the run)"),
        (f"spares {LONG_NAMES['speech_dnn']} the {pct(dnn[0])} it lost without it ({len(dnn[2])} seeds: "
         f"{pct(min(dnn[2]))[:-2]} to {pct(max(dnn[2]))})"),
    ]


def sparse_claim() -> str:
    """The guide's sentence on densities below 3e-3 on the long profile: the small transformer at 5e-4 and the GRU
    at 1e-3."""
    t, g = long_change("transformer", "gtc_5e-4"), long_change("gru", "gtc_1e-3")
    return (
        f"the small transformer at density 5e-4 stayed within {t[0]:.1f} % of DDP ({len(t[2])} seeds) at {t[1]:,.0f}× "
        f"fewer bytes than fp32, while the GRU at 1e-3 lost {pct(g[0])} ({len(g[2])} seed) at {g[1]:.0f}×"
    )


def block_sync_claim() -> str:
    """The guide's sentence on a thousand times fewer bytes with the compressed block sync (``sparseloco`` every
    20 steps at density 3e-2) on the long profile: the models where it stays within 1 % of DDP, and the two where
    it does not."""
    within = [m for m in ("transformer", "gru", "speech_dnn") if long_change(m, "sparseloco_h20_3e-2")[0] < 1]
    assert within == ["transformer", "gru", "speech_dnn"], within
    t, g, d = (long_change(m, "sparseloco_h20_3e-2") for m in within)
    # the CNN's run of the same period (20 steps): its 2,000-step run (at 6,000 steps the suite's period is 60)
    c, lm = long_change("cnn@2000", "sparseloco_h20_3e-2"), long_change("transformer_lm", "sparseloco_h20_3e-2")
    return (
        f"within {max(t[0], g[0], d[0]):.1f} % of DDP on the small transformer, the GRU and the speech DNN "
        f"({min(len(x[2]) for x in (t, g, d))} seeds each) at {min(t[1], g[1], d[1]):,.0f}-{max(t[1], g[1], d[1]):,.0f}× "
        f"fewer bytes than fp32, but {pct(c[0])} on the CNN (its 2,000-step runs) and {pct(lm[0])} on the 2.4 M-weight "
        "LM (1 seed each)"
    )


def cnn_claim() -> str:
    """The guide's sentence on the long suite's CNN at its longer budget: density 3e-3, and the defaults with and
    without the density warm-up (3 seeds, paired)."""
    sparse, warm, none = (long_change("cnn", m) for m in ("gtc_3e-3", "gtc_defaults", "gtc"))
    paired = [w - n for w, n in zip(warm[2], none[2])]
    assert min(paired) > 0, paired  # "on every seed"
    steps = {r["steps"] for r in long_runs()[("cnn", "gtc_3e-3")].values()}
    (steps,) = steps
    return (
        f"On the suite's CNN (momentum SGD with BatchNorm, {steps:,} steps) the loss fell as the density fell: "
        f"density 3e-3 was {pct(sparse[0])} against DDP ({len(sparse[2])} seeds) at {sparse[1]:.0f}×, and the "
        f"warm-up cost {min(paired):.1f}-{max(paired):.1f} points on every seed ({pct(warm[0])} against "
        f"{pct(none[0])} without it)"
    )


def moments_claim() -> tuple[str, str]:
    """The guide's sentences on Adam's per-rank moments in the update mode, from the long profile: what they
    cost alone (the ranks' steps averaged densely), the defaults, and mean_variance (at density 3e-3 too)."""

    def on(model: str, method: str) -> tuple[str, str]:
        change, _, each = long_change(model, method)
        return pct(change), f"{len(each)} seed{'s' if len(each) > 1 else ''}"

    lm = "transformer_lm"
    (alone, n_alone), (default, n_default) = on(lm, "local_moments_dense"), on(lm, "gtc")
    (mv, n_mv), (mv_t, n_t), (mv_g, n_g) = (on(m, "gtc_mean_variance") for m in (lm, "transformer", "gru"))
    return (
        f"On the long suite's 2.4 M-weight transformer LM that alone costs {alone} ({n_alone}: the ranks' AdamW "
        f"steps averaged densely, no compression), most of GTC's {default} at density 1e-2 without the warm-up "
        f"({n_default}). "
        f"`GTCStrategy(mean_variance=True)` steps with an estimate of the mean gradient's second moment instead: "
        f"{mv} there ({n_mv}), {mv_t} on the small transformer ({n_t}), but {mv_g} on the GRU ({n_g}; Adam at rate "
        f"1e-2, where GTC without it gives {on('gru', 'gtc')[0]}), so it is not a default"
    ), (
        f"With density 3e-3 as well the LM is {on(lm, 'gtc_3e-3_mean_variance')[0]} "
        f"({on(lm, 'gtc_3e-3_mean_variance')[1]}) at {long_change(lm, 'gtc_3e-3_mean_variance')[1]:.0f}× fewer "
        f"bytes than fp32, against {on(lm, 'gtc_3e-3')[0]} ({on(lm, 'gtc_3e-3')[1]}) without the option"
    )


def combo_claim() -> str:
    """The guide's sentence on mean_variance with the default density warm-up: the LM and the GRU."""
    lm, gru, warm = (long_change(m, meth) for m, meth in (("transformer_lm", "gtc_density_warmup_mean_variance"),
                                                        ("gru", "gtc_density_warmup_mean_variance"),
                                                        ("gru", "gtc_defaults")))

    def seeds(each: list[float]) -> str:
        return f"{len(each)} seed{'s' if len(each) > 1 else ''}"

    return (f"the LM is {pct(lm[0])} ({seeds(lm[2])}) at {lm[1]:.0f}×, and the GRU {pct(gru[0])} ({seeds(gru[2])}) "
            f"where the warm-up alone gives {pct(warm[0])}")


def moments_claim_short() -> str:
    """The README's shorter form of :func:`moments_claim`."""
    lm = "transformer_lm"
    return (
        f"on the long suite's 2.4 M-weight LM that alone costs {pct(long_change(lm, 'local_moments_dense')[0])} "
        f"of GTC's {pct(long_change(lm, 'gtc')[0])} (density 1e-2, no warm-up); `mean_variance=True` gives "
        f"{pct(long_change(lm, 'gtc_mean_variance')[0])} there but {pct(long_change('gru', 'gtc_mean_variance')[0])} "
        f"on the GRU (without it {pct(long_change('gru', 'gtc')[0])})"
    )


def pct(x: float) -> str:
    return f"{x:+.1f} %".replace("-", "−")


def span(values, fmt: str = "{:.0f}", sep: str = "-") -> str:
    lo, hi = fmt.format(min(values)), fmt.format(max(values))
    return lo if lo == hi else f"{lo}{sep}{hi}"


def pct_span(values) -> str:
    """``+1.1 to +5.6 %``."""
    lo, hi = min(values), max(values)
    return f"{pct(lo)[:-2]} to {pct(hi)}"


@cache
def results(name: str = "RESULTS.json") -> dict:
    return json.loads((ROOT / "recipes" / "asr" / name).read_text())


@cache
def current_section() -> str:
    """RESULTS.md's current section, from its ``## Current`` heading to the next ``## `` heading."""
    text = RESULTS_MD.read_text()
    start = text.index("\n## Current")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def md_row(path: Path, first_cell: str) -> list[str]:
    """The cells of the first table row of ``path`` whose first cell is ``first_cell``."""
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] == first_cell:
            return cells
    raise AssertionError(f"{path.relative_to(ROOT)} has no table row {first_cell!r}")


def step_ratios(model: str, strategy: str) -> list[float]:
    """Per round: the strategy's median step over DDP's (bench_step's × DDP), the one-pass run of 2026-12-02."""
    res = json.loads((BENCH / "step_update_onepass" / f"{model}.json").read_text())["results"][model]
    return [s["step_s"] / d["step_s"] for s, d in zip(res[strategy], res["ddp"])]


def cluster_step(model: str, world: int, rate: str, strategy: str) -> float:
    rows = json.loads((BENCH / "bench_cluster.json").read_text())["rows"]
    (row,) = [r for r in rows if (r["model"], r["world"], r["rate"], r["strategy"]) == (model, world, rate, strategy)]
    return row


# --- the claims --------------------------------------------------------------------------------------

def _recipe_v3_row() -> list[str]:
    return md_row(RESULTS_MD, "GTC automatic τ, density 2.5e-3, Rice")


def _summary_range() -> tuple[str, str]:
    """The lowest and highest paired change of density 2.5e-3 with Rice in rice_auto_tau_summary.md's tables."""
    summary = ROOT / "docs" / "experiments" / "rice_auto_tau_summary.md"
    changes = []
    for first in ("auto, density 2.5e-3, Rice", "auto, density 2.5e-3"):
        cell = md_row(summary, first)[-1]
        changes.append(float(re.search(r"[+\-−]\d+\.\d", cell.replace("**", "")).group(0).replace("−", "-")))
    return pct(min(changes))[:-2], pct(max(changes))


def claim_1120(rendered_ratio: str = "×") -> str:
    """The 1,120× result, one way: the corpus-version-3 build of RESULTS.md, with its conditions."""
    row = _recipe_v3_row()
    lo, hi = _summary_range()
    return (
        "(1.55 M weights, 10 epochs, 2 ranks, Strom's gradient mode with automatic τ at density 2.5e-3 and Rice "
        f"coding, corpus version 3, 3 seeds) GTC sent {row[1].replace('×', rendered_ratio)} fewer bytes than fp32 "
        f"at {row[3]} test WER, paired against the single-device baseline"
    ), f"other trainings of that setting measured {lo} to {hi}"


def words_list(items) -> str:
    """``0 and 1``, ``0, 1 and 2``: a list as the prose writes it."""
    items = [str(x) for x in items]
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def readme_claims() -> list[str]:
    first, second = claim_1120()
    r = results()
    runs = r["comparison"]["runs"]
    gtc_runs = [x for x in runs if x["run"] == "gtc"]
    iv = r["comparison"]["intervals"]
    gtc_iv = iv["runs"]["gtc"]
    held, resampled = gtc_iv["vs_baseline"]["mean"], gtc_iv["vs_baseline"]["mean_over_seeds"]
    seeds = sorted({x["seed"] for x in runs})
    recipe = (
        f"(its current build in [RESULTS.md], {r['collected']['commit']}, {r['collected']['date']}: corpus version "
        f"{r['settings']['version']}, the DNN of {gtc_runs[0]['num_weights'] / 1e6:.2f} M weights trained "
        f"{gtc_runs[0]['epochs']} epochs in {gtc_runs[0]['precision']}, seeds {words_list(seeds)}): ` with "
        f"its defaults on {gtc_runs[0]['workers']} CPU ranks sent {span([x['ratio_fp32'] for x in gtc_runs])}× fewer "
        f"bytes than fp32 at a test word error rate (WER) of {gtc_iv['mean']['wer']:.2f} % against the single-device "
        f"baseline's {iv['runs']['baseline']['mean']['wer']:.2f} %, {pct(held['rel_pct'])} "
        f"[{pct(held['rel_lo'])[:-2]}, {pct(held['rel_hi'])[:-2]}] paired (each seed's runs scored on the same test "
        f"utterances; 95 % bootstrap interval over the test set's {iv['speakers']} persons), and "
        f"[{pct(resampled['rel_lo'])[:-2]}, {pct(resampled['rel_hi'])[:-2]}] with the seeds resampled too"
    )
    strom = [cluster_step("strom", 4, rate, s) for rate in ("100mbit", "1gbit", "10gbit") for s in ("gtc", "ddp")]
    faults = {x["strategy"]: x["slowdown"]["median"] for x in json.loads((BENCH / "faults.json").read_text())["straggler"]["summary"]}
    fault_tau = {row["tau"] for run in json.loads((BENCH / "faults.json").read_text())["straggler"]["runs"]
                 for row in run["rows"] if row["strategy"] == "gtc"}
    (fault_tau,) = fault_tau
    h200 = json.loads((BENCH / "gpu" / "step_update_h200_b4096.json").read_text())
    h200_ms = {s: 1e3 * statistics.median(x["step_s"] for x in segs) for s, segs in h200["results"]["recipe"].items()}
    return [
        # the headline: the long profile
        *long_headline(),
        # choosing settings: density
        first, second,
        (f"(density 1e-2 on the suite: {span([ratio(m, 'gtc', 2) for m in MODELS])}× at 2 ranks, "
        f"{span([ratio(m, 'gtc') for m in MODELS])}× at 4)"),
        recipe,
        # when it is faster
        (f"a step took {strom[0]['step_s']:.2f} s against {strom[1]['step_s']:.1f} s for fp32 DDP and "
        f"{cluster_step('strom', 4, '100mbit', 'ddp_bf16')['step_s']:.1f} s for bf16 DDP; at 1 Gbit/s "
        f"{strom[2]['step_s']:.2f} s against {strom[3]['step_s']:.2f} s, at 10 Gbit/s {strom[4]['step_s']:.2f} s "
        f"against {strom[5]['step_s']:.2f} s, with {span([x['compute_s'] for x in strom], '{:.2f}')} s of compute alone"),
        f"slowed DDP {faults['ddp']:.1f}× and Strom's gradient mode (τ = {fault_tau:g}, 32-bit words) {faults['gtc']:.2f}×",
        # host cost
        (f"the defaults' step was {statistics.median(step_ratios('recipe', 'gtc_update')):.2f}× DDP's on the recipe's "
        f"DNN and {statistics.median(step_ratios('strom', 'gtc_update')):.2f}× on Strom's, the gradient mode's "
        f"{span([statistics.median(step_ratios(m, 'gtc')) for m in ('recipe', 'strom')], '{:.2f}')}×"),
        (f"took {h200_ms['gtc_update']:.1f} ms against DDP's {h200_ms['ddp']:.1f} ms, the gradient mode's "
        f"{h200_ms['gtc']:.1f} ms"),
        # limitations
        moments_claim_short(),
        # the recipe section: the main job's time, from RESULTS.md's current section
        f"the main job took {main_job_time()} on an idle 2-core machine",
        f"also searches the GMMs with Kaldi's settings: {kaldi_job_time()},",
    ]


def main_job_time() -> str:
    """The main job's time of the current build, from the stage table of RESULTS.md's current section."""
    row = md_row(RESULTS_MD, "**all**")
    return row[-1].strip("*")


@cache
def kaldi_section() -> str:
    """RESULTS.md's section of ``profile=kaldi``'s newest build, from its ``### Kaldi's settings`` heading to the
    next ``## `` heading."""
    text = RESULTS_MD.read_text()
    start = text.index("\n### Kaldi's settings (`profile=kaldi`)")
    return text[start:text.index("\n## ", start + 1)]


def kaldi_job_time() -> str:
    """The time of ``profile=kaldi``'s main job, from its section's stage table."""
    rows = [line for line in kaldi_section().splitlines() if line.startswith("| **all** |")]
    return rows[-1].split("|")[-2].strip().strip("*")


def guide_claims() -> dict[str, list[str]]:
    t = "transformer"
    first, second = claim_1120()
    numel = [suite()[(4, m, "ddp")][0]["numel"] for m in MODELS]
    all_steps = [suite()[(4, m, "ddp")][0]["steps"] for m in MODELS]
    return {
        "choosing_settings.md": [
            (f"These runs are short ({span(all_steps)} steps) and the models small ({span([n / 1e3 for n in numel])} k "
            f"weights), so every element is sent only a few times a run: the sparser 3e-3 "
            f"({span([ratio(m, 'gtc_3e-3') for m in MODELS])}×) cost {pct_span([vs_ddp(m, 'gtc_3e-3') for m in MODELS])}"),
            first, second,
            (f"lower loss on every model, for {span([ratio(m, 'gtc') / ratio(m, 'gtc_3e-2') for m in MODELS], '{:.1f}')}× "
            "the bytes"),
            (f"cost {pct_span([vs_ddp(t, 'gtc_1e-1'), vs_ddp(t, 'gtc_3e-1')])} on the transformer even at density 1e-1 "
            "and 3e-1"),
            *moments_claim(),
            combo_claim(),
            sparse_claim(),
            block_sync_claim(),
            cnn_claim(),
            (f"(the defaults on the suite: {span([ratio(m, 'gtc', 2) for m in MODELS])}× at 2 ranks, "
            f"{span([ratio(m, 'gtc') for m in MODELS])}× at 4)"),
        ],
    }


def recipe_readme_claims() -> list[str]:
    """The recipe README's figures: the current build's (RESULTS.json, RESULTS-kaldi.json and the current
    section of RESULTS.md)."""
    cur, kal = results(), results("RESULTS-kaldi.json")
    worse = [g["dev"]["by_penalty"]["0.5"] - g["dev"]["wer"] for g in cur["gmm"].values()]
    assert all(g["dev"]["word_insertion_penalty"] == 0 for g in cur["gmm"].values())

    def pair(snap, name):
        g = snap["gmm"][name]
        return f"{g['dev']['wer']:.2f} / {g['test']['wer']:.2f}"

    def dnn_mean(snap):
        """The four runs' mean WER, rounded half up as RESULTS.md's tables round it."""
        means = []
        for split in ("dev", "test"):
            hundredths = [round(100 * d[split]["wer"]) for d in snap["decodes"].values()]
            means.append(Decimal(sum(hundredths)) / len(hundredths) / 100)
        return " / ".join(str(m.quantize(Decimal("0.01"), rounding=ROUND_HALF_UP)) for m in means)

    assert kal["settings"]["gmm_search"] == {"beam": 13.0, "max_active": 7000}
    assert cur["settings"]["lda_mllt"] and kal["settings"]["lda_mllt"]  # the same front end: the search differs
    data_stages = [line for line in kaldi_section().splitlines() if line.startswith("| data stages |")][-1]
    data_stages = data_stages.split("|")[-2].strip()  # the stage table of profile=kaldi's build
    # the default's DNNs of the day profile=kaldi was built (its four runs, seeds 0 and 1), from that section
    default_then = md_row(RESULTS_MD, "the four DNNs, mean")[-1]
    return [
        f"In the current build every GMM system picks penalty 0 (0.5 is {span(worse, '{:.2f}')} points worse on dev)",
        f"From a fresh clone it took {kaldi_job_time()}, its data stages {data_stages};",
        (f"Against the current default (dev / test %WER) Kaldi's search gives the monophone system {pair(kal, 'mono')} "
        f"against {pair(cur, 'mono')}, the triphone system {pair(kal, 'tri')} against {pair(cur, 'tri')}, LDA+MLLT "
        f"{pair(kal, 'lda_mllt')} against {pair(cur, 'lda_mllt')} and SAT {pair(kal, 'sat')} against "
        f"{pair(cur, 'sat')}, and the DNNs are level: the four runs' mean {dnn_mean(kal)} against the default's "
        f"of that day, {default_then}"),
        (f"In the current build it gives dev / test {pair(cur, 'lda_mllt')} against the Δ + ΔΔ system's "
        f"{pair(cur, 'tri')}, and SAT on it {pair(cur, 'sat')}; the main job took {main_job_time()}"),
    ]


def compare_claims() -> list[str]:
    """docs/guide/compare.md's reading of its example: GTC's loss at the end, as the example's table has it."""
    row = md_row(GUIDE / "compare.md", "gtc")
    return [f"at the end, {row[2].lstrip('+-')} above it"]


def claims() -> dict[Path, list[str]]:
    found = {README: readme_claims(), RECIPE_README: recipe_readme_claims()}
    for name, phrases in guide_claims().items():
        found[GUIDE / name] = phrases
    if (GUIDE / "compare.md").is_file() and "| gtc |" in (GUIDE / "compare.md").read_text():
        found[GUIDE / "compare.md"] = compare_claims()
    return found


# --- settings: figures in prose that are not measurements ---------------------------------------------

def _source(path: str) -> str:
    return (ROOT / path).read_text()


def _constant(path: str, name: str) -> str:
    m = re.search(rf"^{name}\s*=\s*(.+?)(?:\s*#.*)?$", _source(path), flags=re.MULTILINE)
    assert m, f"{path} defines no {name}"
    return m.group(1)


def _memory_per_param() -> dict[str, float]:
    return {m: statistics.fmean(r["memory_bytes_per_param"] for r in suite()[(4, "transformer", m)])
            for m in ("gtc", "gtc_strom_1e-2", "powersgd_r1")}


def _bits_per_word() -> list[float]:
    return [r["bits_per_word"] for r in results()["comparison"]["runs"] if r.get("bits_per_word")]


# phrase (as ``normalize`` leaves it) -> a check that it is true, or None for a condition or a setting
# that the phrase itself states (a model's size, a default named in code nearby).
SETTINGS: dict[str, object] = {
    # GTC's own memory a parameter, as the model suite measured it
    "8 bytes a parameter": lambda: abs(_memory_per_param()["gtc"] - 8) < 0.1,
    "8 / 16 bytes": lambda: abs(_memory_per_param()["gtc_strom_1e-2"] - 16) < 0.1,
    "16 bytes a parameter": lambda: abs(_memory_per_param()["gtc_strom_1e-2"] - 16) < 0.1,
    "8 bytes a parameter in the update mode, 16 in the gradient mode; PowerSGD's about 4":
        lambda: round(_memory_per_param()["powersgd_r1"]) == 4,
    "32 more bytes a parameter": None,  # the update mode's traffic as step_overhead.md counts it
    "8 bytes": lambda: abs(_memory_per_param()["gtc"] - 8) < 0.1,
    "16 bytes": lambda: abs(_memory_per_param()["gtc_strom_1e-2"] - 16) < 0.1,
    # Golomb-Rice coding's bits a word, as the recipe's runs sent them
    "8-11 bits": lambda: all(8 <= b <= 11 for b in _bits_per_word()),
    "8-11 bits a word": lambda: all(8 <= b <= 11 for b in _bits_per_word()),
    # Strom's rule for a fixed tau, as the code's error message gives it
    "about 15× the per-rank gradient RMS (≈ 0.01": lambda: "15x the per-rank gradient RMS" in _source(
        "gtc_lightning/algorithms/gtc/config.py") and "tau: 0.01" in _source("conf/gtc.yaml"),
    "start near 15× the per-rank gradient RMS": lambda: "15x the per-rank gradient RMS" in _source(
        "gtc_lightning/algorithms/gtc/config.py"),
    "that is τ ≈ 0.01": lambda: "tau: 0.01" in _source("conf/gtc.yaml"),
    "about 15× it in the gradient mode": None,
    "start near 15x the per-rank gradient RMS": None,  # the error message itself
    "τ = 0.01": None,  # a setting the sentence names
    "τ ≈ 0.01": None,
    "(τ = 0.01)": None,
    "14.6 M-weight": None,  # Strom's DNN, by its size
    "1.55 M weights": lambda: round(results()["comparison"]["runs"][0]["num_weights"] / 1e4) == 155,
    "10 of 100 Mbit/s": None,  # the straggler's condition
    "at 100 Mbit/s": None,
    "4096 frames": None,
    # constants of the code, by name
    "for up to 50 ms": lambda: float(_constant("gtc_lightning/algorithms/common.py", "SPIN_SECONDS")) == 0.05,
    "65,536 elements": lambda: _constant("gtc_lightning/algorithms/gtc/update.py", "SAMPLE") == "1 << 16",
    "changes at most 10 % a step": lambda: "max_change: float = 1.1" in _source("gtc_lightning/algorithms/gtc/auto_tau.py"),
    "2(W−1)/W × 4 bytes": None,  # the ring all-reduce's bytes, a formula
    "(W−1)·4m bytes": None,
    "default 300 s": lambda: 'default=300.0' in _source("recipes/asr/train.py"),
    "(beam 10, 3,000 active states)": lambda: "3000" in _source("recipes/asr/prepare.py"),
    "(default 10 and 3,000; Kaldi's `decode.sh`: 13 and 7,000)": None,  # Kaldi's decode.sh
    "with 7,000 active states": None,
    "(RM's 1,800 / 9,000 at 3 h": lambda: "1800" in _source("recipes/asr/local/gmm/sizes.py"),
    "150 leaves / 2,000 Gaussians": lambda: "2000" in _source("recipes/asr/local/gmm/sizes.py"),
    "SAT 300 / 2,500": lambda: "2500" in _source("recipes/asr/local/gmm/sizes.py"),
    "LDA+MLLT systems 300 / 1,500 at 1 h": lambda: '"tri": ((1.0, 300, 1500)' in _source("recipes/asr/local/gmm/sizes.py"),
    "25 ms / 10 ms": None,  # Kaldi's fbank framing
    "frame shift 0.01 s": None,
    "penalties 0.5 and 1": None,
    "penalty (0, 0.5, 1)": None,
    "a 95 % interval": None,
    "stage 9": None,
    # the precision guide's experiment condition
    "Weights stored in 16 bits": None,
    "bf16 weights in [0.5, 1.5)": None,
    "learning rate of 1.0": None,
    "31-bit": None,
    "at 2 bytes an element": None,  # bf16
    # the strategy table's defaults
    "`tau` (0.01), block arguments as `bmuf`": lambda: 'tau: float | Literal["auto"] = 1e-2' in _source(
        "gtc_lightning/strategies/bmuf.py"),
}


@pytest.mark.parametrize("path", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_figure_in_prose_is_checked(path: Path):
    text = prose(path)
    phrases = [normalize(p) for p in claims().get(path, []) + list(SETTINGS)]
    for phrase in sorted(phrases, key=len, reverse=True):
        text = text.replace(phrase, " ")
    left = figures(text)
    assert not left, (
        f"{path.relative_to(ROOT)}: figures in prose that no claim of tests/test_prose_numbers.py checks: {left}. "
        "Render the sentence from its JSON there (a claim), or say it without the figure and link to its page"
    )


@pytest.mark.parametrize("path", list(claims()), ids=lambda p: str(p.relative_to(ROOT)))
def test_claims_are_what_the_data_say(path: Path):
    text = prose(path)
    missing = [phrase for phrase in claims()[path] if normalize(phrase) not in text]
    assert not missing, (
        f"{path.relative_to(ROOT)} does not say, as its data render it:\n  " + "\n  ".join(missing)
    )


def test_settings_hold():
    wrong = [phrase for phrase, check in SETTINGS.items() if check is not None and not check()]
    assert not wrong, f"settings quoted in the docs that the code or data no longer have: {wrong}"


def test_powersgd_comparisons_are_the_tables():
    """The model suite page's sentence on PowerSGD names the models its table shows."""

    # the suite page: for each PowerSGD rank a GTC setting of lower loss at fewer bytes, on three of four models
    def beaten(m: str, rank: str) -> bool:
        return any(loss(m, g) < loss(m, rank) and ratio(m, g) > ratio(m, rank)
                   for (w, mm, g) in suite() if (w, mm) == (4, m) and g.startswith("gtc"))

    assert [m for m in MODELS if beaten(m, "powersgd_r1") and beaten(m, "powersgd_r4")] == ["transformer", "cnn"]
    assert [m for m in MODELS if beaten(m, "powersgd_r1") != beaten(m, "powersgd_r4")] == ["gru", "speech_dnn"]
    assert beaten("gru", "powersgd_r1") and beaten("speech_dnn", "powersgd_r4")
    page = prose(ROOT / "docs" / "benchmarks" / "model_suite.md")
    assert normalize("on the transformer and the CNN each PowerSGD rank has a GTC setting beside it with a lower "
                     "held-out loss at fewer bytes; on the GRU rank 1 only, on the speech DNN rank 4 only") in page


def test_model_suite_page_tables_are_the_json():
    """The hand-written tables of docs/benchmarks/model_suite.md (4 ranks; the density sweep) match the JSON:
    each row's loss change and ratio as the JSON rounds them."""
    page = (ROOT / "docs" / "benchmarks" / "model_suite.md").read_text()
    wrong = []
    model = None
    for line in page.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 8 and line.startswith("|") and cells[2] and cells[2][0].isdigit():
            model = cells[0] or model
            method = cells[1].replace("**", "").replace(" (defaults)", "")
            if (4, model, method) not in suite():
                continue
            want = (pct(vs_ddp(model, method)).replace("−", "-") if method != "ddp" else "–",
                    doc_tables._ratio(ratio(model, method)).rstrip("×"))
            got = (cells[3], cells[5])
            if method != "ddp" and got != want:
                wrong.append(f"{model} {method}: {got} where the JSON gives {want}")
    sweep = {"update 1e-2": "gtc_1e-2", "update 3e-2": "gtc_3e-2", "update 1e-1": "gtc_1e-1",
             "update 3e-1": "gtc_3e-1", "gradient 3e-3": "gtc_gradient_3e-3", "gradient 1e-2": "gtc_gradient_1e-2",
             "gradient 3e-2": "gtc_gradient_3e-2"}
    header = None
    for line in page.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0] == "model" and "update 1e-2" in cells:
            header = cells
        elif header and line.startswith("|") and cells[0] and cells[0][0].isalpha() and cells[0] != "model":
            model = cells[0].split(" (")[0]
            for name, cell in zip(header[1:], cells[1:]):
                if cell:
                    m = sweep[name]
                    want = f"{pct(vs_ddp(model, m)).replace('−', '-')}, {ratio(model, m):.0f}x"
                    if cell != want:
                        wrong.append(f"sweep {model} {name}: {cell!r} where the JSON gives {want!r}")
        elif header and not line.startswith("|"):
            header = None
    assert not wrong, "docs/benchmarks/model_suite.md:\n" + "\n".join(wrong)


def test_readme_quotes_the_current_build():
    """The README's recipe figures are RESULTS.md's current build: the commit and date it names are RESULTS.json's,
    every WER and time it quotes is in RESULTS.md's current section or rendered from RESULTS.json, and it names
    no other build's commit."""
    r = results()
    text = README.read_text()
    assert f"{r['collected']['commit']}, {r['collected']['date']}" in text
    assert r["collected"]["commit"] in current_section()
    commits = set(re.findall(r"(?<![\w/])[0-9a-f]{7}(?![\w])", text))
    assert commits <= {r["collected"]["commit"]}, f"the README names builds other than the current one: {commits}"
    section = current_section() + kaldi_section()  # profile=kaldi's newest build has its own section
    for time in re.findall(r"\d+ min \d+ s", prose(README)):
        assert time in section, f"the README's {time} is not in RESULTS.md's current section"
    rendered = {round(x, 2) for d in r["decodes"].values() for x in (d["dev"]["wer"], d["test"]["wer"])}
    rendered |= {run["mean"]["wer"] for run in r["comparison"]["intervals"]["runs"].values()}
    for wer in re.findall(r"\d+\.\d\d %", prose(README)):
        assert float(wer.split()[0]) in rendered, f"the README's WER {wer} is not RESULTS.json's (the current build)"


def test_readme_profile_kaldi_sentence_is_the_data():
    """"every GMM system better on dev, the DNNs level": profile=kaldi's build against the current default."""
    cur, kal = results(), results("RESULTS-kaldi.json")
    assert all(kal["gmm"][n]["dev"]["wer"] < cur["gmm"][n]["dev"]["wer"] for n in cur["gmm"])
    for split in ("dev", "test"):  # the four DNN runs' mean WER within a tenth of a point (RESULTS.md pairs them)
        means = [statistics.fmean(d[split]["wer"] for d in snap["decodes"].values()) for snap in (cur, kal)]
        assert abs(means[0] - means[1]) < 0.1, (split, means)
    assert "every GMM system better on dev, the DNNs level" in prose(README)


def test_recipe_readme_quotes_the_current_build():
    """Every WER pair and time in the recipe README's prose is the current build's (RESULTS.json, RESULTS-kaldi.json,
    the current section of RESULTS.md)."""
    text = prose(RECIPE_README)
    section = current_section() + kaldi_section()  # profile=kaldi's newest build has its own section
    for time in re.findall(r"\d+ min \d+ s", text):
        assert time in section, f"recipes/asr/README.md's {time} is not in RESULTS.md's current section"


def test_docstrings_say_what_the_code_does():
    """The two docstrings of item 1: the model suite's count of methods and GTCStrategy's dense fallback."""
    suite_src = _source("gtc_lightning/tools/model_suite.py")
    methods = re.search(r"DEFAULT_METHODS = \[(.*?)\]", suite_src, re.DOTALL).group(1)
    count = len(re.findall(r'"[^"]+"', methods))
    assert f"4 models x {count} methods x 3 seeds" in suite_src
    config = _source("gtc_lightning/algorithms/gtc/config.py")
    assert "FALLBACK_ENTER, FALLBACK_EXIT = 0.5, 0.25" in config
    doc = re.search(r"dense_fallback: (.*?)exchange:", _source("gtc_lightning/strategies/gtc.py"), re.DOTALL).group(1)
    doc = re.sub(r"\s+", " ", doc)
    assert "bf16 ring all-reduce, half of fp32's" in doc and "less than a quarter of fp32's" in doc, doc


def test_readme_names_the_version():
    version = re.search(r'^version = "([^"]+)"', _source("pyproject.toml"), flags=re.MULTILINE).group(1)
    assert f"Version {version} " in README.read_text(), f"the README's Status names another version than {version}"


@pytest.mark.parametrize("text, expected", [
    ("at +5.1 % held-out loss, 169× fewer, 2 ranks, 3 seeds", ["+5.1 %", "169×"]),
    ("torch 2.13.0, Python 3.11, 2026-11-30, density 1e-2, stages 0-11", []),
    ("1,122-1,123× at [+0.6, +5.6], 0.51 s", ["1,122", "1,123×", "+0.6", "+5.6", "0.51 s"]),
])
def test_figures(text, expected):
    assert figures(text) == expected
