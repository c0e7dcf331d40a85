"""Comparison of trained runs: a markdown table, a JSON file and Strom's Figure 1 (dev frame
accuracy per epoch) for the single-device baseline against DDP/GTC runs.

Each run directory holds ``train_summary.json`` (train.py), ``metrics.csv`` (CSVLogger) and
``decode/results.json`` (evaluate.py).
"""

from __future__ import annotations

import csv
import json
import logging
import math
import re
from pathlib import Path

import numpy as np

from local.constants import DNN_PREFERRED_SCALE

log = logging.getLogger(__name__)


def _column_means(metrics_csv: Path) -> dict[str, float]:
    """Mean of every numeric column of a CSVLogger file (empty cells skipped)."""
    sums: dict[str, list[float]] = {}
    if not metrics_csv.exists():
        return {}
    with metrics_csv.open() as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if value not in ("", None):
                    sums.setdefault(key, []).append(float(value))
    return {k: sum(v) / len(v) for k, v in sums.items()}


def bytes_sent_per_step(summary: dict, fp32: float) -> float:
    """Bytes rank 0 sent per optimizer step: what the strategy's own statistics counted (``gtc``:
    GTC's messages; ``sync``: ma/bmuf/dpsgd's averaging, and bmuf_gtc's block syncs beside its GTC
    words), else the dense all-reduce the strategy runs (DDP: ``fp32``; ``ddp_bf16``: half of it)."""
    counted = [(s["total"]["bytes_sent"], s["step"]) for s in (summary.get("gtc"), summary.get("sync"))
               if s and s.get("total") and s.get("step")]
    if counted:
        return sum(sent / steps for sent, steps in counted)
    if int(summary["world_size"]) == 1:
        return 0.0
    bf16 = summary.get("strategy") == "ddp_bf16" or summary.get("strategy_class") == "BF16AllReduceStrategy"
    return fp32 / 2 if bf16 else fp32


# Registered names of the strategy classes whose lower-cased class name (less "Strategy") differs
CLASS_NAMES = {"modelaveraging": "ma", "bmufgtc": "bmuf_gtc", "bf16allreduce": "ddp_bf16", "singledevice": "auto"}


def strategy_name(strategy, devices) -> str:
    """A run's strategy as the recipe names it: ``baseline`` for one device, else the registered
    name (``gtc``, ``gtc_stale``, ``ddp``, ``ma``, ...) of ``strategy``, a name or a LightningCLI
    ``class_path``/``init_args`` dict (or Namespace); launcher suffixes (``_spawn``, ...) dropped."""
    if isinstance(strategy, str):
        name = re.sub(r"(_spawn|_fork|_notebook)?(_find_unused_parameters_(true|false))?$", "", strategy)
    else:
        get = (lambda k: strategy.get(k)) if hasattr(strategy, "get") else (lambda k: None)
        class_path, init_args = get("class_path") or "", get("init_args") or {}
        name = class_path.rsplit(".", 1)[-1].lower().removesuffix("strategy") or type(strategy).__name__.lower()
        name = CLASS_NAMES.get(name, name)
        if name == "gtc" and (init_args.get("stale") if hasattr(init_args, "get") else False):
            name = "gtc_stale"
    if name in ("auto", "single_device") and str(devices) in ("1", "[0]"):
        return "baseline"
    return name


def run_config(run_dir: Path | str) -> dict:
    """A run's ``config.yaml`` (LightningCLI's record of its settings), ``{}`` when missing."""
    import yaml

    path = Path(run_dir) / "config.yaml"
    return (yaml.safe_load(path.read_text()) or {}) if path.exists() else {}


def strategy_args(run_dir: Path | str) -> dict:
    """The strategy's ``init_args`` in a run's config (``{}`` when the strategy was named by a
    string): where automatic tau's ``target_density`` and ``coding`` live."""
    strategy = (run_config(run_dir).get("trainer") or {}).get("strategy")
    return (strategy.get("init_args") or {}) if isinstance(strategy, dict) else {}


def gtc_message_stats(summary: dict) -> tuple[float | None, float | None]:
    """(words, bits per word) of the GTC messages rank 0 sent per optimizer step, headers included;
    ``(None, None)`` for a run without GTC's statistics.

    Every word goes to each of the other ranks of the GTC group (the world, or a ``bmuf_gtc`` group:
    the ``world_size`` of the last step's record), so the bytes sent count it once per peer."""
    gtc = summary.get("gtc") or {}
    total, steps = gtc.get("total") or {}, gtc.get("step")
    if not steps or not total.get("words"):
        return None, None
    group = (gtc.get("last") or {}).get("world_size") or summary.get("world_size") or 2
    return total["words"] / steps, 8 * total["bytes_sent"] / total["words"] / max(int(group) - 1, 1)


def _run_strategy(run_dir: Path, summary: dict) -> str:
    """The strategy's name from the run's config (also for runs whose summary has an older label,
    such as ``modelaveraging``), else the summary's."""
    trainer = run_config(run_dir).get("trainer") or {}
    if trainer.get("strategy") is not None and summary.get("strategy") != "baseline":
        return strategy_name(trainer["strategy"], trainer.get("devices", summary.get("world_size")))
    return summary["strategy"]


def run_row(run_dir: Path | str) -> dict:
    """Everything the report says about one run, from the files its training and decoding wrote."""
    run_dir = Path(run_dir)
    summary_path = run_dir / "train_summary.json"
    if not summary_path.exists():
        raise ValueError(f"No such file: {summary_path}; train the run with recipes/asr/train.py first")
    summary = json.loads(summary_path.read_text())
    decode_path = run_dir / "decode" / "results.json"
    decoded = json.loads(decode_path.read_text()) if decode_path.exists() else {}
    means = _column_means(run_dir / "metrics.csv")
    world = int(summary["world_size"])
    # What a dense ring all-reduce sends per worker and step: 2 (W-1)/W of the gradient.
    fp32 = 2.0 * (world - 1) / world * 4 * summary["num_weights"]
    bytes_per_step = bytes_sent_per_step(summary, fp32)
    ratio_fp32 = fp32 / bytes_per_step if bytes_per_step else None
    ratio_bf16 = fp32 / 2 / bytes_per_step if bytes_per_step else None
    accs = summary.get("dev_frame_acc") or []
    args = strategy_args(run_dir)
    words, bits = gtc_message_stats(summary)
    return {
        "run": summary.get("run_name", run_dir.name),
        "strategy": _run_strategy(run_dir, summary),
        "workers": world,
        "tau": summary.get("tau"),  # the last one where it moved (target_density)
        # the summary's (runs since GTCStrategy's defaults changed), else a trained run's strategy init_args,
        # else a simulated run's options (read only then); a strategy named without init_args before: none
        "target_density": summary.get("target_density") or args.get("target_density")
        or (run_config(run_dir).get("simulate") or {}).get("target_density"),
        "coding": summary.get("coding") or args.get("coding") or ("none" if summary.get("gtc") else None),
        "compress": summary.get("compress") or args.get("compress") or ("gradient" if summary.get("gtc") else None),
        # runs from before the summary recorded it: their config's, where null is Lightning's 32-true
        "precision": summary.get("precision") or (run_config(run_dir).get("trainer") or {}).get("precision") or "32-true",
        "words_per_step": words,
        "bits_per_word": bits,  # 32+ uncoded, ~10-13 Golomb-Rice coded
        "epochs": summary.get("epochs"),
        "num_weights": summary.get("num_weights"),
        "dev_frame_acc": accs[-1] if accs else None,
        "dev_frame_acc_per_epoch": accs,
        "dev_wer": decoded.get("dev", {}).get("wer"),
        "test_wer": decoded.get("test", {}).get("wer"),
        "acoustic_scale": decoded.get("acoustic_scale"),
        "bytes_per_step": bytes_per_step,
        "allreduce_fp32_bytes_per_step": fp32,
        "ratio_fp32": ratio_fp32,
        "ratio_bf16": ratio_bf16,
        "frames_per_sec": means.get("frames_per_sec"),
        "train_seconds": summary.get("train_seconds"),
    }


def add_relative_wer(rows: list[dict], baseline: str | None = None) -> dict | None:
    """Set ``rel_wer_change_pct`` = 100 (WER - WER_base) / WER_base (negative: better than the baseline)
    and ``rel_wer_base_seed``, the seed of the baseline run it was computed against.

    The baseline is the run named ``baseline`` or else the first single-worker run; each row is
    compared with that baseline's run of its own seed (``row["seed"]``), and with the first one
    where its seed has none. Returns the first baseline row.
    """
    base = next((r for r in rows if r["run"] == baseline), None) if baseline else None
    base = base or next((r for r in rows if r["workers"] == 1), None)
    by_seed = {}
    for r in rows:
        if base is not None and r["run"] == base["run"] and r.get("seed") is not None:
            by_seed.setdefault(r["seed"], r)
    for r in rows:
        ref = by_seed.get(r.get("seed"), base)
        ok = ref is not None and ref["test_wer"] and r["test_wer"] is not None
        r["rel_wer_change_pct"] = 100.0 * (r["test_wer"] - ref["test_wer"]) / ref["test_wer"] if ok else None
        r["rel_wer_base_seed"] = ref.get("seed") if ok else None
    return base


def _fmt(value, spec: str, unit: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return format(value, spec) + unit


def markdown_table(rows: list[dict]) -> str:
    head = ("| run | strategy | workers | τ | epochs | dev frame acc. | dev WER | test WER | rel. WER change "
            "| words / step / worker | bits / word | bytes sent / step / worker | vs fp32 all-reduce "
            "| vs bf16 all-reduce | frames / s | train time |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        tau = _fmt(r["tau"], ".3g")
        if r.get("target_density") is not None:
            tau = f"auto, density {r['target_density']:g} (last {tau})"
        strategy = r["strategy"] + {"update": ", update", "gtc": ", GTC-coded exchanges"}.get(r.get("compress"), "")
        strategy += f", {r['coding']}" if r.get("coding") not in (None, "none") else ""
        strategy += f", {r['precision']}" if r.get("precision", "32-true") != "32-true" else ""
        lines.append(" | ".join([
            f"| {r['run']}", strategy, str(r["workers"]), tau, _fmt(r["epochs"], "d"),
            _fmt(100 * r["dev_frame_acc"] if r["dev_frame_acc"] is not None else None, ".2f", " %"),
            _fmt(r["dev_wer"], ".2f", " %"), _fmt(r["test_wer"], ".2f", " %"),
            _fmt(r["rel_wer_change_pct"], "+.1f", " %"), _fmt(r.get("words_per_step"), ",.0f"),
            _fmt(r.get("bits_per_word"), ".1f"), _fmt(r["bytes_per_step"], ",.0f"),
            _fmt(r["ratio_fp32"], ",.1f", "×"), _fmt(r["ratio_bf16"], ",.1f", "×"),
            _fmt(r["frames_per_sec"], ",.0f"), _fmt(r["train_seconds"], ".0f", " s") + " |",
        ]))
    return "\n".join(lines)


def accuracy_bands(rows: list[dict]) -> dict[str, dict]:
    """Per run name: dev frame accuracy (%) per epoch as the mean, lowest and highest over its seeds,
    over the epochs every seed reached; with the run's workers and its number of seeds."""
    bands = {}
    for name in dict.fromkeys(r["run"] for r in rows):
        runs = [r for r in rows if r["run"] == name and r["dev_frame_acc_per_epoch"]]
        if not runs:
            continue
        epochs = min(len(r["dev_frame_acc_per_epoch"]) for r in runs)
        accs = np.array([[100 * a for a in r["dev_frame_acc_per_epoch"][:epochs]] for r in runs])
        bands[name] = {"strategy": runs[0].get("strategy", name), "workers": runs[0]["workers"],
                       "seeds": len(runs), "seed_ids": [r.get("seed") for r in runs],
                       "mean": accs.mean(axis=0).tolist(), "min": accs.min(axis=0).tolist(),
                       "max": accs.max(axis=0).tolist()}
    return bands


def plot_accuracy(rows: list[dict], path: Path, max_seed_lines: int = 3) -> Path:
    """Dev frame accuracy per epoch (Strom 2015, Figure 1): one line per run; with several seeds one
    colour per run name and one line style per seed, or, beyond ``max_seed_lines`` run names, one line
    per run name (the mean over its seeds, epoch by epoch) in a band from the lowest to the highest
    seed, one colour per strategy and one line style per number of workers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    several_seeds = len({r.get("seed") for r in rows}) > 1
    names = list(dict.fromkeys(r["run"] for r in rows))

    def workers(r: dict) -> str:
        return f"{r['workers']} worker{'s' if r['workers'] > 1 else ''}"

    if several_seeds and len(names) > max_seed_lines:
        # one colour per strategy, one line style per number of workers (solid: the fewest)
        bands = accuracy_bands(rows)
        strategy_colors = {st: f"C{i % 10}" for i, st in enumerate(dict.fromkeys(b["strategy"] for b in bands.values()))}
        worker_counts = sorted({b["workers"] for b in bands.values() if b["workers"] > 1})
        for band in bands.values():
            x = range(1, len(band["mean"]) + 1)
            seeds = band["seeds"]
            style = ("-", "--", ":", "-.")[worker_counts.index(band["workers"]) % 4] if band["workers"] > 1 else "-"
            what = f"mean of {seeds} seeds" if seeds > 1 else f"seed {band['seed_ids'][0]}"
            color = strategy_colors[band["strategy"]]
            ax.plot(x, band["mean"], marker="o", color=color, linestyle=style,
                    label=f"{band['strategy']} ({workers(band)}), {what}")
            if seeds > 1:
                ax.fill_between(x, band["min"], band["max"], color=color, alpha=0.15)
        fig.set_size_inches(8.5, 4.5)
        ax.legend(fontsize="small", loc="center left", bbox_to_anchor=(1.02, 0.5))
    else:
        colors = {name: f"C{i % 10}" for i, name in enumerate(names)}
        for r in rows:
            accs = r["dev_frame_acc_per_epoch"]
            label = f"{r['run']} ({workers(r)})"
            style = {}
            if several_seeds:
                label += f", seed {r.get('seed')}"
                seeds = sorted({x.get("seed") for x in rows if x["run"] == r["run"]}, key=str)
                style = {"color": colors[r["run"]],
                         "linestyle": ("-", "--", ":", "-.")[seeds.index(r.get("seed")) % 4]}
            elif len(names) > 10:  # past the ten colours, the next ten runs dashed, and so on
                style = {"color": colors[r["run"]], "linestyle": ("-", "--", ":", "-.")[names.index(r["run"]) // 10 % 4]}
            ax.plot(range(1, len(accs) + 1), [100 * a for a in accs], marker="o", label=label, **style)
        ax.legend(fontsize="small")
    ax.xaxis.get_major_locator().set_params(integer=True)  # epochs
    ax.set_xlabel("epoch")
    ax.set_ylabel("dev frame accuracy (%)")
    ax.set_title("Convergence: baseline vs. distributed training")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---------------------------------------------------------------- intervals over utterances and seeds
def run_seed(run_dir: Path) -> int | None:
    """``seed_everything`` of a run (its ``config.yaml``), None when unknown."""
    seed = run_config(run_dir).get("seed_everything")
    return int(seed) if isinstance(seed, int) and not isinstance(seed, bool) else None


def _test_counts(run_dir: Path, scale: str | None = None) -> dict | None:
    """Per-utterance test counts at the scale dev picked, or at ``scale`` (``evaluate.py --test-sweep``)."""
    path = Path(run_dir) / "decode" / ("per_utt-test.json" if scale is None else f"per_utt-test-acwt{scale}.json")
    return json.loads(path.read_text()) if path.exists() else None


def sweep_scales(run_dirs: list[Path]) -> list[str]:
    """The acoustic scales at which every run's test set was decoded (``evaluate.py --test-sweep``)."""
    common = None
    for d in run_dirs:
        results = Path(d) / "decode" / "results.json"
        scales = set(json.loads(results.read_text()).get("test_sweep", {})) if results.exists() else set()
        common = scales if common is None else common & scales
    return sorted(common or (), key=float)


def gmm_reference(data_dir: Path | str, system: str = "sat") -> dict | None:
    """Per-utterance test counts of a GMM system's decoding at its chosen scale and word insertion penalty
    (``exp/<system>/decode_test``), or None when the data pipeline did not write them."""
    from local.graph.decode import point_name

    decode_dir = Path(data_dir) / "exp" / system / "decode_test"
    wer = decode_dir / "wer.json"
    if not wer.exists():
        return None
    res = json.loads(wer.read_text())
    point = point_name("test", res["acoustic_scale"], res.get("word_insertion_penalty", 0.0))
    path = decode_dir / f"per_utt-{point}.json"
    return json.loads(path.read_text()) if path.exists() else None


def test_speakers(data_dir: Path | str) -> dict[str, str] | None:
    """Test utterance id -> speaker, from the cuts ``evaluate.py`` decodes (``features/test_cuts``;
    None without them): the supervision's speaker, or on the synthetic corpus the person behind the
    voice (``cut_speaker``), so that the bootstrap draws persons, not rate/pitch settings of one voice."""
    path = Path(data_dir) / "features" / "test_cuts.jsonl.gz"
    if not path.exists():
        return None
    from lhotse import CutSet

    return {c.id: cut_speaker(c.supervisions[0]) for c in CutSet.from_file(path) if c.supervisions}


def cut_speaker(supervision) -> str:
    """The speaker of a supervision for statistics. The synthetic corpus names a speaker per voice
    setting (``espeak-en-029-f4-r116-p45``: the SAT and fMLLR speaker); its ``custom`` fields
    (``engine``, ``voice``) give the person: ``<engine>-<person>`` (``espeak-en-029+f4``,
    ``flite-rms``, ``festival-ked``; ``local.data.corpus_synthetic.person``). Other corpora: the
    supervision's ``speaker``."""
    custom = supervision.custom or {}
    if "engine" in custom and "voice" in custom:
        from local.data.corpus_synthetic import person

        return f"{custom['engine']}-{person(custom['engine'], custom['voice'])}"
    return supervision.speaker


def crossfold_counts(run_dir: Path, scales: list[str], speaker_of: dict[str, str]) -> tuple[dict, list[str]] | None:
    """Per-utterance test counts with the acoustic scale picked on the other half of the test speakers:
    speakers sorted and dealt into two folds; for each fold the scale with the fewest errors on the
    other fold (ties: the one nearer ``DNN_PREFERRED_SCALE``, as on dev) decodes it. A diagnostic of what a dev set like
    the test set, 1/2 its size, would pick (``evaluate.py --test-sweep``); returns the counts and the
    two picks (for the folds of the first and second speakers), or None (with a warning) when an
    utterance has no known speaker or the test set has fewer than 2 speakers."""
    by_scale = {s: _test_counts(run_dir, s) for s in scales}
    missing = sorted(set(next(iter(by_scale.values()))) - set(speaker_of))
    speakers = sorted({speaker_of[u] for u in next(iter(by_scale.values())) if u in speaker_of})
    if missing or len(speakers) < 2:
        log.warning("%s: no scale from the other half of the test speakers (%s)", run_dir,
                    f"utterances without a speaker in features/test_cuts: {missing[:3]}" if missing else
                    f"{len(speakers)} test speaker(s)")
        return None
    fold = {spk: i % 2 for i, spk in enumerate(speakers)}
    counts, picks = {}, []
    for k in (0, 1):
        def errors_on_other(scale: str, k=k) -> tuple[int, float]:
            return (sum(v[0] for u, v in by_scale[scale].items() if fold[speaker_of[u]] != k), abs(float(scale) - DNN_PREFERRED_SCALE))
        best = min(scales, key=errors_on_other)
        picks.append(best)
        counts.update({u: v for u, v in by_scale[best].items() if fold[speaker_of[u]] == k})
    return counts, picks


def seeds_report(run_dirs: list[Path], baseline: str = "baseline", reference: dict | None = None,
                 counts_of=_test_counts, speaker_of: dict[str, str] | None = None) -> dict:
    """Test WER per run name over its seeds, with 95 % bootstrap intervals (``wer_stats``): per seed,
    the mean over seeds, each run name against ``baseline`` (paired, seeds matched) and against the
    ``reference`` GMM counts (``{utt: [errors, words]}``). Each run's counts are ``counts_of(run_dir)``:
    by default at the acoustic scale dev picked for it. With ``speaker_of`` (utterance -> speaker,
    every scored utterance in it) the replicates draw speakers, else utterances."""
    from local.wer_stats import paired_difference, per_utterance_counts, wer_interval

    groups: dict[str, dict[int, dict]] = {}
    for d in run_dirs:
        counts = counts_of(d)
        if counts is None:
            continue
        name = json.loads((Path(d) / "train_summary.json").read_text()).get("run_name", Path(d).name)
        seed = run_seed(Path(d))
        groups.setdefault(name, {})[seed if seed is not None else len(groups.get(name, {}))] = counts
    if not groups:
        return {}
    ids = sorted(next(iter(next(iter(groups.values())).values())))
    words = per_utterance_counts(next(iter(next(iter(groups.values())).values())), ids)[1]
    errors = {n: {s: per_utterance_counts(c, ids)[0] for s, c in sorted(g.items())} for n, g in groups.items()}
    ref = per_utterance_counts(reference, ids)[0] if reference else None
    groups = None
    if speaker_of is not None:
        missing = [u for u in ids if u not in speaker_of]
        if missing:
            raise ValueError(f"{len(missing)} scored utterances have no speaker (e.g. {missing[:3]}); "
                             "give speaker_of for every test utterance, or None to resample utterances")
        groups = np.array([speaker_of[u] for u in ids])
    report: dict = {"utterances": len(ids), "words": int(words.sum()), "runs": {},
                    "resampled": "speakers" if groups is not None else "utterances"}
    if groups is not None:
        report["speakers"] = len(set(groups.tolist()))
    iv = {"groups": groups}
    for name, by_seed in errors.items():
        stack = np.vstack(list(by_seed.values()))
        entry = {"seeds": list(by_seed), "per_seed": {s: wer_interval(e, words, **iv) for s, e in by_seed.items()},
                 "mean": wer_interval(stack, words, **iv)}
        if ref is not None:
            entry["vs_reference"] = paired_difference(ref, stack, words, **iv)
        if name != baseline and baseline in errors:
            common = [s for s in by_seed if s in errors[baseline]]
            if common:
                base = np.vstack([errors[baseline][s] for s in common])
                run = np.vstack([by_seed[s] for s in common])
                entry["vs_baseline"] = {"seeds": common, "mean": paired_difference(base, run, words, **iv), "per_seed": {
                    s: paired_difference(errors[baseline][s], by_seed[s], words, **iv) for s in common}}
                if len(common) > 1:  # the interval with the spread between trainings in it
                    entry["vs_baseline"]["mean_over_seeds"] = paired_difference(base, run, words, over_seeds=True,
                                                                                **iv)
        report["runs"][name] = entry
    return report


def seeds_markdown(report: dict, reference_name: str = "SAT GMM") -> str:
    """The seeds report as a markdown table: WER [95 % interval] per seed and mean, the relative
    change against the reference GMM and against the baseline (negative: fewer errors)."""
    if not report:
        return ""
    def iv(r: dict) -> str:
        return f"{r['wer']:.2f} % [{r['lo']:.2f}, {r['hi']:.2f}]"

    def rel(r: dict) -> str:
        return f"{r['rel_pct']:+.1f} % [{r['rel_lo']:+.1f}, {r['rel_hi']:+.1f}]"

    head = (f"| run | seeds | test WER per seed | mean test WER | vs {reference_name} (rel.) | baseline − run (abs.) "
            "| vs baseline (rel.) | vs baseline (rel.), seeds resampled too |")
    over = (f"over its {report['speakers']} speakers (each drawn speaker brings all its utterances)"
            if report.get("resampled") == "speakers" else "over utterances")
    lines = [(f"Test set: {report['utterances']} utterances, {report['words']} words; 95 % intervals by bootstrap "
              f"{over} (paired for differences); in the last column each replicate also draws the seeds "
              "with replacement, so that its interval holds the spread between trainings (needs 2 or more "
              "seeds)."), "", head, "|---|---|---|---|---|---|---|---|"]
    for name, r in report["runs"].items():
        per_seed = "; ".join(f"{s}: {iv(v)}" for s, v in r["per_seed"].items())
        vb = r.get("vs_baseline", {}).get("mean")
        vs = r.get("vs_baseline", {}).get("mean_over_seeds")
        diff = f"{vb['diff']:+.2f} [{vb['diff_lo']:+.2f}, {vb['diff_hi']:+.2f}]" if vb else "–"
        lines.append(f"| {name} | {len(r['seeds'])} | {per_seed} | {iv(r['mean'])} | "
                     f"{rel(r['vs_reference']) if 'vs_reference' in r else '–'} | {diff} | {rel(vb) if vb else '–'} "
                     f"| {rel(vs) if vs else '–'} |")
    return "\n".join(lines)


def sweep_markdown(sweep: dict[str, dict], picked: dict[str, list]) -> str:
    """Mean test WER per run name at each fixed acoustic scale, and its paired change against the
    baseline at the same scale (``sweep``: scale -> ``seeds_report``; ``picked``: the scales dev
    picked per run name, one per seed)."""
    if not sweep:
        return ""
    scales = list(sweep)
    lines = [("Test WER at each fixed acoustic scale (every run decoded at the same scale; mean over seeds, "
              "change against the baseline paired, seeds matched). The tables above use the scale dev picked "
              "for each run, listed here per seed."), "",
             "| run | scales dev picked | " + " | ".join(f"test WER at {s}" for s in scales) + " |",
             "|---|---|" + "---|" * len(scales)]
    for name in sweep[scales[0]]["runs"]:
        cells = []
        for s in scales:
            r = sweep[s]["runs"].get(name)
            if r is None:
                cells.append("–")
                continue
            vb = r.get("vs_baseline", {}).get("mean")
            rel = f" ({vb['rel_pct']:+.1f} % [{vb['rel_lo']:+.1f}, {vb['rel_hi']:+.1f}])" if vb else ""
            cells.append(f"{r['mean']['wer']:.2f} %{rel}")
        lines.append(f"| {name} | {', '.join(f'{x:g}' for x in picked.get(name, []))} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def crossfold_markdown(report: dict) -> str:
    """The cross-fold report (``crossfold_counts`` per run, then ``seeds_report``) as a table."""
    lines = [("Diagnostic, not a result: each half of the test speakers decoded at the scale the other half "
              "prefers (what a dev set like the test set would pick); mean over seeds, paired against the "
              "baseline picked the same way."), "",
             "| run | scales picked (fold 1/fold 2, per seed) | mean test WER | vs baseline (rel.) |", "|---|---|---|---|"]
    for name, r in report["runs"].items():
        vb = r.get("vs_baseline", {}).get("mean")
        rel = f"{vb['rel_pct']:+.1f} % [{vb['rel_lo']:+.1f}, {vb['rel_hi']:+.1f}]" if vb else "–"
        m = r["mean"]
        lines.append(f"| {name} | {', '.join(report['picks'].get(name, []))} | {m['wer']:.2f} % [{m['lo']:.2f}, "
                     f"{m['hi']:.2f}] | {rel} |")
    return "\n".join(lines)


def voice_family(speaker: str) -> str:
    """The part of a speaker id before its first ``-``: the TTS engine on the synthetic corpus
    (``espeak-en-us-m3-r110-p55`` -> ``espeak``)."""
    return speaker.split("-", 1)[0]


def family_reports(run_dirs: list[Path], baseline: str, speaker_of: dict[str, str],
                   max_families: int = 8) -> dict[str, dict]:
    """``seeds_report`` on the test utterances of each voice family (``voice_family``), or ``{}``
    when the test set has one family or more than ``max_families`` (speaker ids without that
    structure). The test set's families are voices no training or dev utterance has, so a difference
    that one engine's voices show and the mean hides appears here (docs/experiments/auto_tau_rice.md,
    "Sharpness", found it when dev had espeak voices only)."""
    families = sorted({voice_family(s) for s in speaker_of.values()})
    if not 2 <= len(families) <= max_families:
        return {}
    out = {}
    for fam in families:
        def counts_of(d: Path, fam=fam) -> dict | None:
            counts = _test_counts(d)
            return None if counts is None else {u: v for u, v in counts.items()
                                                if voice_family(speaker_of.get(u, "")) == fam}
        out[fam] = seeds_report(run_dirs, baseline, counts_of=counts_of)
    return out


def family_markdown(reports: dict[str, dict]) -> str:
    """Mean test WER per run name and voice family, with its paired change against the baseline."""
    if not reports:
        return ""
    fams = list(reports)
    lines = [("Test WER per voice family (the speaker id's first part: the TTS engine on the synthetic corpus; "
              "mean over seeds at the scale dev picked, change against the baseline paired over utterances, "
              "seeds matched). Words per family and seed: " + ", ".join(f"{f} {reports[f]['words']}" for f in fams)
              + "."), "", "| run | " + " | ".join(fams) + " |", "|---|" + "---|" * len(fams)]
    for name in reports[fams[0]]["runs"]:
        cells = []
        for f in fams:
            r = reports[f]["runs"].get(name)
            vb = r.get("vs_baseline", {}).get("mean") if r else None
            rel = f" ({vb['rel_pct']:+.1f} % [{vb['rel_lo']:+.1f}, {vb['rel_hi']:+.1f}])" if vb else ""
            cells.append(f"{r['mean']['wer']:.2f} %{rel}" if r else "–")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def compare_runs(run_dirs: list[Path | str], out_dir: Path | str, baseline: str | None = None,
                 data_dir: Path | str | None = None) -> dict:
    """Write ``comparison.md`` (per-run table, then WERs with intervals over utterances and seeds),
    ``comparison.json`` and ``dev_frame_acc.png`` under ``out_dir``. ``data_dir`` (for the SAT GMM's
    test WER and the test speakers): default, the one the first run trained on. Runs on several data dirs
    (builds, ``local.dnn.builds``) and no ``data_dir``: the first build's tables, then the spread over all."""
    from local.dnn import builds as corpus_builds

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    groups = corpus_builds.group_by_build([Path(d) for d in run_dirs]) if data_dir is None else {str(data_dir): run_dirs}
    for group in groups.values():
        corpus_builds.check_one_run_per_seed(group)
    run_dirs = next(iter(groups.values()))  # several builds: the first one's runs, then the spread over all
    rows = [run_row(d) for d in run_dirs]
    for r, d in zip(rows, run_dirs):
        r["seed"] = run_seed(Path(d))
    base = add_relative_wer(rows, baseline)
    data_dir = data_dir or corpus_builds.run_data_dir(run_dirs[0])
    if data_dir and not Path(data_dir).is_dir():
        log.warning("data dir %s is gone: the comparison has no SAT GMM column and no test-speaker folds; "
                    "give the moved one with evaluate.py --data-dir", data_dir)
        data_dir = None
    reference = gmm_reference(data_dir) if data_dir else None
    dirs, base_name = [Path(d) for d in run_dirs], base["run"] if base else "baseline"
    speaker_of = test_speakers(data_dir) if data_dir else None
    seeds = seeds_report(dirs, base_name, reference, speaker_of=speaker_of)
    table = markdown_table(rows) + "\n\n" + seeds_markdown(seeds)

    def per_name(values) -> dict[str, list]:  # one value per run (in run order), grouped by run name
        grouped: dict[str, list] = {}
        for r, v in zip(rows, values):
            grouped.setdefault(r["run"], []).append(v)
        return grouped

    scales = sweep_scales(dirs)
    sweep = {s: seeds_report(dirs, base_name, counts_of=lambda d, s=s: _test_counts(d, s)) for s in scales}
    if sweep:
        table += "\n\n" + sweep_markdown(sweep, per_name(r.get("acoustic_scale") for r in rows))
    families = family_reports(dirs, base_name, speaker_of) if speaker_of and base else {}
    if families:
        table += "\n\n" + family_markdown(families)
    crossfold: dict = {}
    if speaker_of and sweep:
        folds = {d: crossfold_counts(d, scales, speaker_of) for d in dirs}
        if all(folds.values()):
            crossfold = seeds_report(dirs, base_name, counts_of=lambda d: folds[d][0])
        if crossfold:
            crossfold["picks"] = per_name("/".join(folds[d][1]) for d in dirs)
            table += "\n\n" + crossfold_markdown(crossfold)
    builds = corpus_builds.builds_report(groups, base_name) if len(groups) > 1 else {}
    if builds:
        table = (f"Runs on {next(iter(groups))}, the first of {len(groups)} builds of the corpus (the spread over "
                 "the builds follows).\n\n" + table + "\n\n" + corpus_builds.builds_markdown(builds))
    note = (f"Relative WER change against `{base['run']}` of the same seed (its first run where the seed has "
            "none); bytes sent: what one worker puts on the wire per "
            "optimizer step (for DDP its fp32 ring all-reduce, 2 (W-1)/W x 4 bytes per weight); vs fp32 / bf16 "
            "all-reduce: the bytes such an all-reduce sends per worker, divided by the bytes sent (at 2 workers also "
            "Strom's measure, the gradient's fp32 bytes over the message's); words and bits per word: GTC's "
            "messages (32 bits a word and a header uncoded, about 8-11 Golomb-Rice coded).") if base else \
        "No single-worker baseline among the runs: relative WER change not computed."
    (out_dir / "comparison.md").write_text(table + "\n\n" + note + "\n")
    (out_dir / "comparison.json").write_text(json.dumps({"baseline": base and base["run"], "runs": rows,
                                                         "intervals": seeds, "fixed_scales": sweep,
                                                         "scale_from_other_test_speakers": crossfold,
                                                         "by_voice_family": families, "builds": builds}, indent=1,
                                                        default=str))
    png = plot_accuracy(rows, out_dir / "dev_frame_acc.png")
    log.info("comparison of %d runs -> %s, %s\n%s", len(rows), out_dir / "comparison.md", png, table)
    return {"rows": rows, "markdown": out_dir / "comparison.md", "json": out_dir / "comparison.json", "png": png}
