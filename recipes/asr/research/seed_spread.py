#!/usr/bin/env python3
"""Is a run's change against the baseline on one voice family larger than the trainings' own spread?

For each voice family of the test set (``local.dnn.compare.voice_family``: the TTS engine on the synthetic
corpus) and for the whole set: each seed's test WER of the baseline and of ``--run``, the run against the
baseline of the same seed (paired, ``local.wer_stats.paired_difference``), the mean over seeds with the seeds
resampled too, and the placebo: every seed of the baseline against every other seed of the baseline (and the
same for the run), the relative change that retraining alone gives. A family's interval is drawn over its
utterances (as the comparison's family table draws it); the whole set's over persons. A family of one person
(flite's and festival's test voices on the synthetic corpus) holds nothing of the variation between voices:
the placebo is the only yardstick there.

Reads what ``run.sh`` wrote: ``<exp>/{baseline,<run>}`` (seed 0) and ``<exp>/seedN/{baseline,<run>}``, each
decoded (``decode/per_utt-test.json``), and the data dir's test cuts for the speakers. Prints JSON.

Usage:
  python recipes/asr/research/seed_spread.py --exp exp/dnn --data data/synthetic-default --run gtc
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # recipes/asr: the recipe's `local` package

from local.dnn.compare import run_seed, test_speakers, voice_family
from local.wer_stats import paired_difference, per_utterance_counts


def spread(counts: dict[tuple[str, int], dict], speaker_of: dict[str, str], run: str,
           baseline: str = "baseline") -> dict:
    """The report for ``counts`` (``{(name, seed): {utt: [errors, words]}}``, the baseline and ``run`` on the
    same seeds) and ``speaker_of`` (utterance -> speaker): ``{family: {...}}`` with ``"all"`` first."""
    seeds = sorted(s for n, s in counts if n == baseline)
    missing = [s for s in seeds if (run, s) not in counts] + [s for n, s in counts if n == run and s not in seeds]
    if len(seeds) < 2 or missing:
        raise ValueError(f"baseline seeds {seeds}, {run!r} seeds {sorted(s for n, s in counts if n == run)}: "
                         "give both runs on the same 2 or more seeds (run.sh seeds=\"1 2\" stage=9)")
    ids = sorted(counts[(baseline, seeds[0])])
    out = {}
    for fam in ["all", *sorted({voice_family(speaker_of[u]) for u in ids})]:
        sel = [u for u in ids if fam == "all" or voice_family(speaker_of[u]) == fam]
        groups = np.array([speaker_of[u] for u in sel]) if fam == "all" else None  # a family: its utterances
        words = per_utterance_counts(counts[(baseline, seeds[0])], sel)[1]
        err = {k: per_utterance_counts(c, sel)[0] for k, c in counts.items()}

        def rel(a, b, words=words, groups=groups):
            d = paired_difference(a, b, words, groups=groups)
            return [d["rel_pct"], d["rel_lo"], d["rel_hi"]]

        over = paired_difference(np.vstack([err[(baseline, s)] for s in seeds]),
                                 np.vstack([err[(run, s)] for s in seeds]), words, groups=groups, over_seeds=True)
        out[fam] = {
            "words": int(words.sum()), "persons": len({speaker_of[u] for u in sel}),
            "wer": {f"{n} {s}": round(100.0 * err[(n, s)].sum() / words.sum(), 2)
                    for n in (baseline, run) for s in seeds},
            "run_vs_baseline": {str(s): rel(err[(baseline, s)], err[(run, s)]) for s in seeds},
            "run_vs_baseline_seeds_resampled": [over["rel_pct"], over["rel_lo"], over["rel_hi"]],
            "baseline_seed_vs_seed": {f"{a}->{b}": rel(err[(baseline, a)], err[(baseline, b)])[0]
                                      for a, b in itertools.permutations(seeds, 2)},
            "run_seed_vs_seed": {f"{a}->{b}": rel(err[(run, a)], err[(run, b)])[0]
                                 for a, b in itertools.permutations(seeds, 2)},
        }
    return out


def load(exp: Path, run: str, baseline: str = "baseline") -> dict[tuple[str, int], dict]:
    """``{(name, seed): per-utterance test counts}`` of every decoded baseline and ``run`` under ``exp``."""
    counts = {}
    for d in [exp, *sorted(exp.glob("seed[0-9]*"))]:
        for name in (baseline, run):
            path = d / name / "decode" / "per_utt-test.json"  # at the scale dev picked (evaluate.py)
            seed = run_seed(d / name) if path.exists() else None
            if seed is not None:
                counts[(name, seed)] = json.loads(path.read_text())
    return counts


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--exp", type=Path, default=Path("exp/dnn"), help="run.sh's exp dir")
    parser.add_argument("--data", type=Path, default=Path("data/synthetic-default"), help="the recipe data dir")
    parser.add_argument("--run", default="gtc", help="the run name compared with the baseline")
    args = parser.parse_args(argv)
    speaker_of = test_speakers(args.data)
    if speaker_of is None:
        raise SystemExit(f"{args.data}/features/test_cuts.jsonl.gz not found: give the data dir the runs decoded")
    report = spread(load(args.exp, args.run), speaker_of, args.run)
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
