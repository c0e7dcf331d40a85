"""The spread over builds of the corpus: the same runs trained on several builds, side by side.

A build is one data dir made by ``prepare.py``: on the embedded corpus each ``--seed`` draws its own
sentences, voice settings (rate, pitch) and augmentation over the same voices, so two builds have
different test sets and their WERs cannot be paired utterance by utterance. What one build cannot
tell is how much a WER, or a difference between two systems, moves when the corpus is drawn again;
this report gives it: per build, each GMM system's dev and test WER and each run name's test WER
with its paired change against the baseline of the same build (``seeds_report``, intervals over that
build's test speakers), then over the builds their mean, range and standard deviation.

``compare_runs`` calls :func:`builds_report` when its runs were trained on more than one data dir.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from local.dnn.compare import gmm_reference, run_row, run_seed, seeds_report, test_speakers

GMM_SYSTEMS = ("mono", "tri", "sat")


def run_data_dir(run_dir: Path | str) -> str | None:
    """The data dir a run trained on (its ``train_summary.json``), None when not recorded."""
    path = Path(run_dir) / "train_summary.json"
    return json.loads(path.read_text()).get("data_dir") if path.exists() else None


def group_by_build(run_dirs: list[Path]) -> dict[str, list[Path]]:
    """Runs grouped by the data dir they trained on, in the order first met (a run that does not
    record one goes with the first group)."""
    groups: dict[str, list[Path]] = {}
    first = None
    for d in run_dirs:
        key = run_data_dir(d) or first or ""
        key = str(Path(key).resolve()) if key and Path(key).is_dir() else key  # data/x and /repo/data/x: one build
        first = first or key
        groups.setdefault(key, []).append(Path(d))
    return groups


def check_one_run_per_seed(run_dirs: list[Path]) -> None:
    """Refuse two runs of one name and seed on one build: the seed-paired statistics would keep one
    of them and drop the other without a word."""
    seen: dict[tuple, Path] = {}
    for d in run_dirs:
        summary = json.loads((Path(d) / "train_summary.json").read_text())
        key = (summary.get("run_name", Path(d).name), run_seed(Path(d)))
        if key[1] is not None and key in seen:
            raise ValueError(f"runs {seen[key]} and {d} are both {key[0]!r} with seed {key[1]} on the data dir "
                             f"{run_data_dir(d)}: compare one run per name and seed (give the other in a second "
                             "evaluate.py --out), or train it with another --seed_everything")
        seen[key] = Path(d)


def _gmm_wers(data_dir: Path) -> dict[str, dict]:
    out = {}
    for system in GMM_SYSTEMS:
        wers = {}
        for split in ("dev", "test"):
            path = data_dir / "exp" / system / f"decode_{split}" / "wer.json"
            if path.exists():
                wers[split] = json.loads(path.read_text())["wer"]
        if wers:
            out[system] = wers
    return out


def _spread(values: list[float]) -> dict:
    return {"values": values, "mean": statistics.fmean(values), "min": min(values), "max": max(values),
            "sd": statistics.stdev(values) if len(values) > 1 else None}


def builds_report(groups: dict[str, list[Path]], baseline: str = "baseline") -> dict:
    """Per build (``group_by_build``) its corpus settings, GMM WERs and ``seeds_report``; then, per
    GMM system and run name, the spread of the test WER (and of the run's paired change against the
    baseline and against the SAT GMM, in %) over the builds that have it."""
    builds = []
    for data_dir, dirs in groups.items():
        path = Path(data_dir)
        settings_path = path / "settings.json"
        settings = json.loads(settings_path.read_text()) if settings_path.exists() else {}
        dev: dict[str, list[float]] = {}
        for row in map(run_row, dirs):
            if row["dev_wer"] is not None:
                dev.setdefault(row["run"], []).append(row["dev_wer"])
        speaker_of = test_speakers(path) if path.is_dir() else None
        reference = gmm_reference(path) if path.is_dir() else None
        builds.append({"data_dir": data_dir, "corpus": settings.get("corpus"), "seed": settings.get("seed"),
                       "version": settings.get("version"), "gmm": _gmm_wers(path),
                       "dev_wer": {n: statistics.fmean(v) for n, v in dev.items()},
                       "runs": seeds_report(dirs, baseline, reference, speaker_of=speaker_of)})
    spread: dict[str, dict] = {}
    for system in GMM_SYSTEMS:
        tests = [b["gmm"][system]["test"] for b in builds if "test" in b["gmm"].get(system, {})]
        if tests:
            spread[f"{system} GMM"] = {"test_wer": _spread(tests)}
    names = list(dict.fromkeys(n for b in builds for n in b["runs"].get("runs", {})))
    for name in names:
        entries = [b["runs"]["runs"][name] for b in builds if name in b["runs"].get("runs", {})]
        spread[name] = {"test_wer": _spread([e["mean"]["wer"] for e in entries])}
        vb = [e["vs_baseline"]["mean"]["rel_pct"] for e in entries if "vs_baseline" in e]
        if vb:
            spread[name]["vs_baseline_pct"] = _spread(vb)
        vr = [e["vs_reference"]["rel_pct"] for e in entries if "vs_reference" in e]
        if vr:
            spread[name]["vs_sat_pct"] = _spread(vr)
    return {"builds": builds, "spread": spread, "baseline": baseline}


def _label(b: dict) -> str:
    return f"corpus seed {b['seed']}" if b.get("seed") is not None else Path(b["data_dir"]).name


def builds_markdown(report: dict) -> str:
    """Two tables: WERs per build and over the builds; each run's paired changes per build and over them."""
    builds, spread = report["builds"], report["spread"]
    labels = [_label(b) for b in builds]

    def over(s: dict | None, fmt: str) -> str:
        if not s:
            return "– | – | –"
        sd = "–" if s["sd"] is None else format(s["sd"], fmt.lstrip("+"))
        return f"{format(s['mean'], fmt)} | {format(s['min'], fmt)} – {format(s['max'], fmt)} | {sd}"

    lines = [(f"Spread over {len(builds)} builds of the corpus ({', '.join(labels)}: each build draws its own "
              "sentences, voice settings and augmentation). Per build: test %WER (dev %WER), DNN runs as the mean "
              "over their seeds on that build; then the test WER's mean, range and standard deviation over the "
              "builds."), "",
             "| system | " + " | ".join(labels) + " | mean test | range | sd |",
             "|---|" + "---|" * len(labels) + "---|---|---|"]
    for system in GMM_SYSTEMS:
        if f"{system} GMM" not in spread:
            continue
        cells = []
        for b in builds:
            w = b["gmm"].get(system, {})
            cells.append(f"{w['test']:.2f} ({w['dev']:.2f})" if "test" in w and "dev" in w else
                         (f"{w['test']:.2f}" if "test" in w else "–"))
        lines.append(f"| {system} GMM | " + " | ".join(cells) + f" | {over(spread[f'{system} GMM']['test_wer'], '.2f')} |")
    for name, s in spread.items():
        if name.endswith(" GMM"):
            continue
        cells = []
        for b in builds:
            r = b["runs"].get("runs", {}).get(name)
            dev = b["dev_wer"].get(name)
            cells.append("–" if r is None else f"{r['mean']['wer']:.2f}" + (f" ({dev:.2f})" if dev is not None else ""))
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {over(s['test_wer'], '.2f')} |")
    changed = [n for n, s in spread.items() if "vs_baseline_pct" in s or "vs_sat_pct" in s]
    if changed:
        lines += ["", (f"Relative test WER change per build, paired over that build's test utterances (95 % bootstrap "
                       f"interval over its speakers): against `{report['baseline']}` of the same seed and build, and "
                       "against the build's SAT GMM; then the change's mean, range and standard deviation over the "
                       "builds."), "",
                  "| run | against | " + " | ".join(labels) + " | mean | range | sd |",
                  "|---|---|" + "---|" * len(labels) + "---|---|---|"]
        for name in changed:
            for key, against, field in (("vs_baseline_pct", report["baseline"], "vs_baseline"),
                                        ("vs_sat_pct", "SAT GMM", "vs_reference")):
                if key not in spread[name]:
                    continue
                cells = []
                for b in builds:
                    e = b["runs"].get("runs", {}).get(name, {}).get(field)
                    e = e.get("mean") if e and field == "vs_baseline" else e
                    cells.append(f"{e['rel_pct']:+.1f} % [{e['rel_lo']:+.1f}, {e['rel_hi']:+.1f}]" if e else "–")
                lines.append(f"| {name} | {against} | " + " | ".join(cells) + f" | {over(spread[name][key], '+.1f')} |")
    return "\n".join(lines)
