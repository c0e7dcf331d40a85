"""``recipes/asr/research/seed_spread.py``: a run against the baseline per voice family, beside the
baseline's own seed-to-seed change, from run dirs as ``run.sh`` writes them."""

import json

import pytest
import seed_spread

# two families: espeak (two persons), flite (one); 4 utterances each of 10 words
SPEAKERS = {"u1": "espeak-a", "u2": "espeak-a", "u3": "espeak-b", "u4": "espeak-b",
            "u5": "flite-slt", "u6": "flite-slt", "u7": "flite-slt", "u8": "flite-slt"}


def counts(errors):
    return {u: [e, 10] for u, e in zip(SPEAKERS, errors)}


BASE = {0: [1, 1, 1, 1, 1, 1, 1, 1], 1: [1, 1, 1, 1, 2, 2, 2, 2]}  # seed 1 worse on flite alone
RUN = {0: [1, 1, 1, 1, 1, 1, 1, 1], 1: [1, 1, 1, 1, 3, 3, 3, 3]}


def test_the_run_per_seed_and_the_baselines_own_spread():
    data = {("baseline", s): counts(e) for s, e in BASE.items()} | {("gtc", s): counts(e) for s, e in RUN.items()}
    report = seed_spread.spread(data, SPEAKERS, "gtc")
    assert list(report) == ["all", "espeak", "flite"]
    assert (report["espeak"]["persons"], report["flite"]["persons"], report["all"]["words"]) == (2, 1, 80)
    flite = report["flite"]
    assert flite["wer"] == {"baseline 0": 10.0, "baseline 1": 20.0, "gtc 0": 10.0, "gtc 1": 30.0}
    assert flite["run_vs_baseline"]["0"][0] == 0.0 and flite["run_vs_baseline"]["1"][0] == 50.0
    assert flite["baseline_seed_vs_seed"] == {"0->1": 100.0, "1->0": -50.0}
    assert flite["run_seed_vs_seed"] == {"0->1": 200.0, "1->0": -66.7}
    assert report["espeak"]["baseline_seed_vs_seed"] == {"0->1": 0.0, "1->0": 0.0}
    lo, hi = report["all"]["run_vs_baseline_seeds_resampled"][1:]
    assert lo <= report["all"]["run_vs_baseline_seeds_resampled"][0] <= hi


def test_unmatched_seeds_are_refused():
    data = {("baseline", 0): counts(BASE[0]), ("baseline", 1): counts(BASE[1]), ("gtc", 0): counts(RUN[0])}
    with pytest.raises(ValueError, match=r"'gtc' seeds \[0\].*same 2 or more seeds"):
        seed_spread.spread(data, SPEAKERS, "gtc")
    with pytest.raises(ValueError, match="same 2 or more seeds"):
        seed_spread.spread({("baseline", 0): counts(BASE[0]), ("gtc", 0): counts(RUN[0])}, SPEAKERS, "gtc")


def test_load_reads_run_sh_dirs(tmp_path):
    for seed, dir_ in ((0, tmp_path), (1, tmp_path / "seed1")):
        for name, errors in (("baseline", BASE[seed]), ("gtc", RUN[seed])):
            run = dir_ / name
            (run / "decode").mkdir(parents=True)
            (run / "config.yaml").write_text(f"seed_everything: {seed}\n")
            (run / "decode" / "per_utt-test.json").write_text(json.dumps(counts(errors)))
    (tmp_path / "seed2" / "gtc").mkdir(parents=True)  # not decoded: left out
    loaded = seed_spread.load(tmp_path, "gtc")
    assert sorted(loaded) == [("baseline", 0), ("baseline", 1), ("gtc", 0), ("gtc", 1)]
    assert loaded[("gtc", 1)]["u5"] == [3, 10]
