"""local.wer_stats: bootstrap intervals of WER, means over seeds and paired differences."""

import numpy as np
import pytest
from local.wer_stats import paired_difference, per_utterance_counts, wer_interval


def _counts(rng, num_utts=400, error_rate=0.1):
    words = rng.integers(4, 11, num_utts).astype(float)
    errors = rng.binomial(words.astype(int), error_rate).astype(float)
    return errors, words



def _fake_run(d, seed: int, name: str, workers: int, data_dir, dev_frame_acc: list[float]):
    """A run dir as compare_runs reads it, without decodes: ``decode/``, ``config.yaml``, ``train_summary.json``."""
    import json

    (d / "decode").mkdir(parents=True)
    (d / "config.yaml").write_text(f"seed_everything: {seed}\n")
    (d / "train_summary.json").write_text(json.dumps({
        "run_name": name, "strategy": name, "world_size": workers, "num_weights": 1000,
        "dev_frame_acc": dev_frame_acc, "data_dir": str(data_dir)}))
    return d

def test_point_estimate_is_total_errors_over_words_and_inside_the_interval():
    errors, words = _counts(np.random.default_rng(0))
    r = wer_interval(errors, words)
    assert r["wer"] == pytest.approx(100 * errors.sum() / words.sum(), abs=0.01)
    assert r["lo"] < r["wer"] < r["hi"]


def test_interval_narrows_with_more_utterances():
    rng = np.random.default_rng(1)
    small, big = wer_interval(*_counts(rng, 200)), wer_interval(*_counts(rng, 3200))
    assert (big["hi"] - big["lo"]) < 0.5 * (small["hi"] - small["lo"])  # ~1/sqrt(16) = 1/4


def test_mean_over_seeds_is_the_mean_of_the_seed_wers():
    rng = np.random.default_rng(2)
    words = rng.integers(4, 11, 300).astype(float)
    seeds = np.vstack([rng.binomial(words.astype(int), p) for p in (0.08, 0.1, 0.12)]).astype(float)
    r = wer_interval(seeds, words)
    assert r["wer"] == pytest.approx(np.mean(100 * seeds.sum(1) / words.sum()), abs=0.01)


def test_paired_difference_of_a_system_with_itself_is_exactly_zero():
    errors, words = _counts(np.random.default_rng(3))
    r = paired_difference(errors, errors, words)
    assert r["diff"] == r["diff_lo"] == r["diff_hi"] == 0 and r["rel_pct"] == r["rel_lo"] == r["rel_hi"] == 0


def test_pairing_makes_a_small_consistent_gain_significant():
    rng = np.random.default_rng(4)
    a, words = _counts(rng, 1000, 0.15)
    b = a.copy()
    fixed = rng.choice(np.flatnonzero(a > 0), 60, replace=False)  # b fixes one error in 60 utterances
    b[fixed] -= 1
    paired = paired_difference(a, b, words)
    assert paired["diff"] > 0 and paired["diff_lo"] > 0, "the paired interval must exclude 0"
    assert paired["rel_pct"] < 0 and paired["rel_hi"] < 0
    ia, ib = wer_interval(a, words), wer_interval(b, words)
    assert ib["hi"] > ia["lo"], "unpaired intervals overlap: only the pairing shows the gain"


def test_resampling_seeds_puts_the_spread_between_trainings_in_the_interval():
    """Three paired trainings whose differences disagree (b better on seed 0, worse on seed 1,
    equal on seed 2): each is clear over 3,000 utterances, so the utterance bootstrap of the mean
    difference is narrow, while drawing the seeds too spans the per-seed differences. One seed: the
    two bootstraps agree exactly."""
    rng = np.random.default_rng(6)
    words = rng.integers(4, 11, 3000).astype(float)
    a = np.vstack([rng.binomial(words.astype(int), 0.1) for _ in range(3)]).astype(float)
    b = a.copy()
    idx0, idx1 = rng.choice(3000, 200, replace=False), rng.choice(3000, 200, replace=False)
    b[0, idx0] = np.maximum(b[0, idx0] - 1, 0)  # b fixes errors on seed 0
    b[1, idx1] += 1  # and makes ones on seed 1
    narrow, wide = paired_difference(a, b, words), paired_difference(a, b, words, over_seeds=True)
    assert wide["diff"] == narrow["diff"] and wide["rel_pct"] == narrow["rel_pct"]
    per_seed = [paired_difference(a[s], b[s], words)["rel_pct"] for s in range(3)]
    assert min(per_seed) < -2 and max(per_seed) > 2
    assert narrow["rel_hi"] - narrow["rel_lo"] < 0.5 * (wide["rel_hi"] - wide["rel_lo"])
    assert wide["rel_lo"] < -1 and wide["rel_hi"] > 1, "the seed draws reach both signs"
    assert paired_difference(a[:1], b[:1], words, over_seeds=True) == paired_difference(a[:1], b[:1], words)
    assert wer_interval(a, words, over_seeds=True)["wer"] == wer_interval(a, words)["wer"]
    with pytest.raises(ValueError, match="same order"):
        paired_difference(a, b[:2], words, over_seeds=True)


def test_mismatched_utterances_name_the_fix():
    with pytest.raises(ValueError, match="same utterances"):
        wer_interval(np.ones((2, 5)), np.ones(4))
    with pytest.raises(ValueError, match="not scored"):
        per_utterance_counts({"a": [1, 5]}, ["a", "b"])
    errors, words = per_utterance_counts({"a": [1, 5], "b": [0, 3]}, ["b", "a"])
    np.testing.assert_array_equal(errors, [0, 1])
    np.testing.assert_array_equal(words, [3, 5])


def test_comparison_names_automatic_tau_and_coding(tmp_path):
    """A GTC run with automatic tau and Rice coding (its config.yaml's strategy init_args) shows
    the target density, the coding, words per step and bits per word; a plain one does not."""
    import json

    from local.dnn.compare import markdown_table, run_row

    rows = []
    for name, init_args in (("auto", "{tau: auto, target_density: 0.003, coding: rice}"), ("plain", None)):
        d = tmp_path / name
        d.mkdir()
        strategy = f"{{class_path: gtc_lightning.GTCStrategy, init_args: {init_args}}}" if init_args else "gtc"
        (d / "config.yaml").write_text(f"seed_everything: 0\ntrainer: {{strategy: {strategy}}}\n")
        (d / "train_summary.json").write_text(json.dumps({
            "run_name": name, "strategy": "gtc", "world_size": 2, "num_weights": 1000, "tau": 0.0123,
            "gtc": {"step": 10, "total": {"words": 200, "bytes_sent": 275 if init_args else 840}}}))
        rows.append(run_row(d))
        rows[-1]["rel_wer_change_pct"] = None
    auto, plain = rows
    assert (auto["target_density"], auto["coding"], plain["coding"]) == (0.003, "rice", "none")
    assert auto["words_per_step"] == 20 and auto["bits_per_word"] == pytest.approx(11.0)
    assert plain["bits_per_word"] == pytest.approx(33.6)
    # 4 ranks: each word goes to 3 peers, and is still 32 bits (plus its share of the headers)
    d = tmp_path / "four"
    d.mkdir()
    (d / "config.yaml").write_text("seed_everything: 0\ntrainer: {strategy: gtc}\n")
    (d / "train_summary.json").write_text(json.dumps({
        "run_name": "four", "strategy": "gtc", "world_size": 4, "num_weights": 1000, "tau": 0.01,
        "gtc": {"step": 10, "last": {"world_size": 4}, "total": {"words": 200, "bytes_sent": 3 * 840}}}))
    assert run_row(d)["bits_per_word"] == pytest.approx(33.6)
    md = markdown_table(rows)
    assert "| auto | gtc, rice | 2 | auto, density 0.003 (last 0.0123) |" in md
    assert "| plain | gtc | 2 | 0.0123 |" in md  # (no precision recorded: float32, not named)
    (tmp_path / "plain" / "config.yaml").write_text("trainer: {strategy: gtc, precision: bf16-mixed}\n")
    assert run_row(tmp_path / "plain")["precision"] == "bf16-mixed"  # a summary without it: the config's
    summary = json.loads((tmp_path / "plain" / "train_summary.json").read_text())
    (tmp_path / "plain" / "train_summary.json").write_text(json.dumps({**summary, "precision": "bf16-mixed"}))
    row = {**run_row(tmp_path / "plain"), "rel_wer_change_pct": None}
    assert row["precision"] == "bf16-mixed" and "| plain | gtc, bf16-mixed | 2 | 0.0123 |" in markdown_table([row])
    # a run of the name alone since GTCStrategy's defaults changed: its summary says what fit chose
    settings = {"target_density": 0.003, "coding": "rice", "compress": "update"}
    (tmp_path / "plain" / "train_summary.json").write_text(json.dumps({**summary, **settings}))
    row = {**run_row(tmp_path / "plain"), "rel_wer_change_pct": None}
    assert {k: row[k] for k in settings} == settings
    assert "| plain | gtc, update, rice, bf16-mixed | 2 | auto, density 0.003 (last 0.0123) |" in markdown_table([row])


def test_comparison_reports_seeds_pairs_and_the_gmm_reference(tmp_path, caplog):
    """compare_runs over 2 seeds x (baseline, gtc) with per-utterance counts and a SAT GMM decode."""
    import json

    from local.dnn.compare import compare_runs

    rng = np.random.default_rng(5)
    ids = [f"u{i:03d}" for i in range(200)]
    words = rng.integers(4, 11, len(ids))
    data_dir = tmp_path / "data"
    sat = data_dir / "exp" / "sat" / "decode_test"
    sat.mkdir(parents=True)
    (sat / "wer.json").write_text(json.dumps({"wer": 10.0, "acoustic_scale": 0.0833}))
    (sat / "per_utt-test-acwt0.0833.json").write_text(json.dumps(
        {u: [int(rng.binomial(w, 0.1)), int(w)] for u, w in zip(ids, words)}))
    runs = []
    for seed in (0, 1):
        for name, workers, rate in (("baseline", 1, 0.08), ("gtc", 2, 0.08)):
            d = _fake_run(tmp_path / f"seed{seed}" / name, seed, name, workers, data_dir, [0.5, 0.6])
            counts = {u: [int(rng.binomial(w, rate)), int(w)] for u, w in zip(ids, words)}
            (d / "decode" / "per_utt-test.json").write_text(json.dumps(counts))
            wer = 100 * sum(c[0] for c in counts.values()) / words.sum()
            (d / "decode" / "results.json").write_text(json.dumps({"dev": {"wer": 5.0}, "test": {"wer": wer}}))
            runs.append(d)
    compare_runs(runs, tmp_path / "cmp")
    report = json.loads((tmp_path / "cmp" / "comparison.json").read_text())["intervals"]
    assert report["utterances"] == 200 and set(report["runs"]) == {"baseline", "gtc"}
    gtc = report["runs"]["gtc"]
    assert gtc["seeds"] == [0, 1] and gtc["vs_baseline"]["seeds"] == [0, 1]
    assert gtc["mean"]["lo"] < gtc["mean"]["wer"] < gtc["mean"]["hi"]
    assert gtc["vs_reference"]["rel_lo"] < gtc["vs_reference"]["rel_pct"] < gtc["vs_reference"]["rel_hi"]
    assert "vs_baseline" not in report["runs"]["baseline"]
    # the data dir moved: the runs' recorded one is gone, the one given (evaluate.py --data-dir) is used
    moved = data_dir.rename(tmp_path / "data_moved")
    compare_runs(runs, tmp_path / "cmp_gone")
    assert f"data dir {data_dir} is gone" in caplog.text and "--data-dir" in caplog.text
    assert "vs_reference" not in json.loads((tmp_path / "cmp_gone" / "comparison.json").read_text())[
        "intervals"]["runs"]["gtc"]
    compare_runs(runs, tmp_path / "cmp_moved", data_dir=moved)
    moved_gtc = json.loads((tmp_path / "cmp_moved" / "comparison.json").read_text())["intervals"]["runs"]["gtc"]
    assert moved_gtc["vs_reference"] == gtc["vs_reference"]
    wide, narrow = gtc["vs_baseline"]["mean_over_seeds"], gtc["vs_baseline"]["mean"]
    assert wide["rel_pct"] == narrow["rel_pct"] and wide["rel_hi"] - wide["rel_lo"] >= narrow["rel_hi"] - narrow["rel_lo"]
    md = (tmp_path / "cmp" / "comparison.md").read_text()
    assert "| gtc | 2 |" in md and "vs SAT GMM" in md and "seeds resampled too" in md


def test_comparison_at_fixed_acoustic_scales_pairs_runs_decoded_at_the_same_scale(tmp_path):
    """With test decoded at every scale (evaluate.py --test-sweep), the report adds each run name's
    mean test WER and paired change at each fixed scale, beside the scales dev picked; a run decoded
    without the sweep leaves the sweep out (scales are those every run has)."""
    import json

    from local.dnn.compare import compare_runs

    rng = np.random.default_rng(7)
    ids = [f"u{i:03d}" for i in range(300)]
    words = rng.integers(4, 11, len(ids))
    # gtc is the baseline's errors at 0.1 and twice them at 0.2: +0 % and +100 % at the fixed scales,
    # while at the scales dev picked (0.2 for gtc, 0.1 for the baseline) the difference is neither
    rates = {"baseline": {"0.1": 0.05, "0.2": 0.08}, "gtc": {"0.1": 0.05, "0.2": 0.16}}
    picked = {"baseline": 0.1, "gtc": 0.2}
    base_errors = {s: rng.binomial(words, r) for s, r in rates["baseline"].items()}
    runs = []
    for seed in (0, 1):
        for name, workers in (("baseline", 1), ("gtc", 2)):
            d = _fake_run(tmp_path / f"seed{seed}" / name, seed, name, workers, tmp_path / "no-gmm", [0.5, 0.6])
            sweep = {}
            for scale in ("0.1", "0.2"):
                errors = base_errors[scale] * (2 if name == "gtc" and scale == "0.2" else 1)
                counts = {u: [int(e), int(w)] for u, e, w in zip(ids, errors, words)}
                (d / "decode" / f"per_utt-test-acwt{scale}.json").write_text(json.dumps(counts))
                sweep[scale] = 100 * errors.sum() / words.sum()
                if float(scale) == picked[name]:
                    (d / "decode" / "per_utt-test.json").write_text(json.dumps(counts))
            (d / "decode" / "results.json").write_text(json.dumps({
                "acoustic_scale": picked[name], "dev": {"wer": 5.0}, "test": {"wer": sweep[str(picked[name])]},
                "test_sweep": sweep}))
            runs.append(d)
    compare_runs(runs, tmp_path / "cmp")
    fixed = json.loads((tmp_path / "cmp" / "comparison.json").read_text())["fixed_scales"]
    assert list(fixed) == ["0.1", "0.2"]
    assert fixed["0.1"]["runs"]["gtc"]["vs_baseline"]["mean"]["rel_pct"] == pytest.approx(0.0)
    assert fixed["0.2"]["runs"]["gtc"]["vs_baseline"]["mean"]["rel_pct"] == pytest.approx(100.0)
    assert fixed["0.2"]["runs"]["gtc"]["mean"]["wer"] == pytest.approx(200 * base_errors["0.2"].sum() / words.sum(),
                                                                       abs=0.01)
    md = (tmp_path / "cmp" / "comparison.md").read_text()
    assert "| gtc | 0.2, 0.2 |" in md and "(+0.0 % [+0.0, +0.0])" in md and "(+100.0 %" in md
    # one run without the sweep: no fixed-scale table
    results = runs[0] / "decode" / "results.json"
    results.write_text(json.dumps({k: v for k, v in json.loads(results.read_text()).items() if k != "test_sweep"}))
    compare_runs(runs, tmp_path / "cmp2")
    assert json.loads((tmp_path / "cmp2" / "comparison.json").read_text())["fixed_scales"] == {}
    assert "fixed acoustic scale" not in (tmp_path / "cmp2" / "comparison.md").read_text()


def test_scale_from_the_other_half_of_the_test_speakers(tmp_path):
    """The cross-fold diagnostic decodes each half of the test speakers at the scale with the fewest
    errors on the other half: a run whose fold-2 speakers are error-free at 0.2 gets 0.2 for fold 1
    (where 0.2 is worse) and 0.1 for fold 2."""
    import json

    from lhotse import CutSet, MonoCut, SupervisionSegment
    from local.dnn.compare import compare_runs

    speakers = ["spkA", "spkB", "spkC", "spkD"]  # sorted: folds {A, C} and {B, D}
    ids = [f"{spk}_utt{i:02d}" for spk in speakers for i in range(30)]
    data_dir = tmp_path / "data"
    (data_dir / "features").mkdir(parents=True)
    CutSet.from_cuts(MonoCut(id=u, start=0.0, duration=1.0, channel=0, supervisions=[
        SupervisionSegment(id=u, recording_id=u, start=0.0, duration=1.0, speaker=u.split("_")[0])]) for u in ids
    ).to_file(data_dir / "features" / "test_cuts.jsonl.gz")
    fold2 = {u for u in ids if u.split("_")[0] in ("spkB", "spkD")}
    errors = {"baseline": {"0.1": {u: 1 for u in ids}, "0.2": {u: 2 for u in ids}},
              "cross": {"0.1": {u: 1 for u in ids}, "0.2": {u: 0 if u in fold2 else 3 for u in ids}}}
    runs = []
    for name, workers in (("baseline", 1), ("cross", 2)):
        d = tmp_path / name
        (d / "decode").mkdir(parents=True)
        (d / "config.yaml").write_text("seed_everything: 0\n")
        (d / "train_summary.json").write_text(json.dumps({
            "run_name": name, "strategy": name, "world_size": workers, "num_weights": 1000,
            "dev_frame_acc": [0.5], "data_dir": str(data_dir)}))
        for scale, errs in errors[name].items():
            (d / "decode" / f"per_utt-test-acwt{scale}.json").write_text(json.dumps({u: [e, 10] for u, e in errs.items()}))
        (d / "decode" / "per_utt-test.json").write_text(json.dumps({u: [e, 10] for u, e in errors[name]["0.1"].items()}))
        (d / "decode" / "results.json").write_text(json.dumps({
            "acoustic_scale": 0.1, "dev": {"wer": 5.0}, "test": {"wer": 10.0}, "test_sweep": {"0.1": 10.0, "0.2": 0.0}}))
        runs.append(d)
    compare_runs(runs, tmp_path / "cmp")
    report = json.loads((tmp_path / "cmp" / "comparison.json").read_text())["scale_from_other_test_speakers"]
    assert report["picks"] == {"baseline": ["0.1/0.1"], "cross": ["0.2/0.1"]}
    # cross: fold 1 (60 utterances) at 0.2 with 3 errors each, fold 2 at 0.1 with 1 each, of 1200 words
    assert report["runs"]["cross"]["mean"]["wer"] == pytest.approx(100 * (60 * 3 + 60 * 1) / 1200, abs=0.01)
    assert report["runs"]["baseline"]["mean"]["wer"] == pytest.approx(10.0, abs=0.01)
    assert report["runs"]["cross"]["vs_baseline"]["mean"]["rel_pct"] == pytest.approx(100.0)
    assert "| cross | 0.2/0.1 |" in (tmp_path / "cmp" / "comparison.md").read_text()
    # one speaker only: no diagnostic (every fold would be picked on nothing), the rest of the report stays
    CutSet.from_cuts(MonoCut(id=u, start=0.0, duration=1.0, channel=0, supervisions=[
        SupervisionSegment(id=u, recording_id=u, start=0.0, duration=1.0, speaker="one")]) for u in ids
    ).to_file(data_dir / "features" / "test_cuts.jsonl.gz")
    compare_runs(runs, tmp_path / "cmp1")
    report = json.loads((tmp_path / "cmp1" / "comparison.json").read_text())
    assert report["scale_from_other_test_speakers"] == {} and set(report["fixed_scales"]) == {"0.1", "0.2"}


def test_relative_wer_change_is_against_the_baseline_of_the_same_seed():
    """Seed 1's GTC run is compared with seed 1's baseline, not seed 0's; a seed without a
    baseline run falls back to the first baseline."""
    from local.dnn.compare import add_relative_wer

    rows = [{"run": "baseline", "workers": 1, "seed": 0, "test_wer": 8.0},
            {"run": "baseline", "workers": 1, "seed": 1, "test_wer": 10.0},
            {"run": "gtc", "workers": 2, "seed": 0, "test_wer": 8.4},
            {"run": "gtc", "workers": 2, "seed": 1, "test_wer": 9.0},
            {"run": "gtc", "workers": 2, "seed": 2, "test_wer": 8.8},
            {"run": "ma", "workers": 2, "seed": 1, "test_wer": None}]
    base = add_relative_wer(rows)
    assert base is rows[0]
    assert [r["rel_wer_change_pct"] for r in rows[:5]] == pytest.approx([0.0, 0.0, 5.0, -10.0, 10.0])
    assert [r["rel_wer_base_seed"] for r in rows] == [0, 1, 0, 1, 0, None]
    assert rows[5]["rel_wer_change_pct"] is None


@pytest.mark.parametrize("summary,want", [
    ({"strategy": "baseline", "world_size": 1}, 0.0),
    ({"strategy": "ddp", "world_size": 2}, 4000.0),  # 2 (W-1)/W x 4 bytes x 1000 weights
    ({"strategy": "ddp_bf16", "world_size": 2}, 2000.0),
    ({"strategy": "gtc", "world_size": 2, "gtc": {"step": 10, "total": {"bytes_sent": 500}}}, 50.0),
    ({"strategy": "ma", "world_size": 4, "sync": {"step": 8, "total": {"bytes_sent": 12_000}}}, 1500.0),
    ({"strategy": "bmuf_gtc", "world_size": 4, "gtc": {"step": 10, "total": {"bytes_sent": 300}},
      "sync": {"step": 10, "total": {"bytes_sent": 2000}}}, 230.0),
])
def test_bytes_per_step_follow_each_strategys_own_counts(summary, want):
    from local.dnn.compare import bytes_sent_per_step

    world = summary["world_size"]
    assert bytes_sent_per_step(summary, 2.0 * (world - 1) / world * 4 * 1000) == pytest.approx(want)


def test_accuracy_bands_average_seeds_over_the_epochs_all_reached(tmp_path):
    """The convergence plot of many strategies draws each run name's mean over its seeds, with the
    lowest and highest seed as a band, over the epochs every seed reached; the PNG is written."""
    from local.dnn.compare import accuracy_bands, plot_accuracy

    rows = [{"run": "ma", "workers": 2, "seed": 0, "dev_frame_acc_per_epoch": [0.40, 0.50, 0.60]},
            {"run": "ma", "workers": 2, "seed": 1, "dev_frame_acc_per_epoch": [0.44, 0.54]},
            {"run": "bmuf", "workers": 4, "seed": 0, "dev_frame_acc_per_epoch": [0.30]},
            {"run": "none", "workers": 2, "seed": 2, "dev_frame_acc_per_epoch": []}]
    bands = accuracy_bands(rows)
    assert list(bands) == ["ma", "bmuf"]
    assert bands["ma"]["seeds"] == 2 and bands["ma"]["workers"] == 2
    np.testing.assert_allclose(bands["ma"]["mean"], [42.0, 52.0])
    np.testing.assert_allclose(bands["ma"]["min"], [40.0, 50.0])
    np.testing.assert_allclose(bands["ma"]["max"], [44.0, 54.0])
    assert bands["bmuf"]["mean"] == bands["bmuf"]["max"] == [30.0]
    for limit in (1, 3):  # mean-and-band mode, then one line per seed
        assert plot_accuracy(rows, tmp_path / f"acc{limit}.png", max_seed_lines=limit).stat().st_size > 0


def test_runs_past_ten_colours_are_told_apart_by_line_style(tmp_path, monkeypatch):
    """One seed, 12 runs: matplotlib has ten colours, so runs 11 and 12 reuse the first two colours
    with dashed lines."""
    import matplotlib

    matplotlib.use("Agg")
    from local.dnn.compare import plot_accuracy
    from matplotlib.axes import Axes

    drawn = []
    original = Axes.plot

    def spy(self, *args, **kwargs):
        drawn.append(kwargs)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Axes, "plot", spy)
    rows = [{"run": f"r{i}", "workers": 2, "seed": 0, "dev_frame_acc_per_epoch": [0.1 * i]} for i in range(12)]
    assert plot_accuracy(rows, tmp_path / "acc.png").stat().st_size > 0
    styles = [(k["color"], k["linestyle"]) for k in drawn]
    assert len(set(styles)) == 12 and styles[10] == ("C0", "--") and styles[0] == ("C0", "-")


def test_strategy_names_are_the_registered_ones(tmp_path):
    """Runs are labelled with the names users type: ma for ModelAveragingStrategy, gtc_stale for
    GTCStrategy(stale=True), launcher suffixes dropped, baseline for one device; a run whose
    summary kept an older label is named from its config.yaml."""
    import json

    from jsonargparse import Namespace
    from local.dnn.compare import run_row, strategy_name

    assert strategy_name("gtc_spawn", 2) == "gtc" and strategy_name("auto", 1) == "baseline"
    assert strategy_name("ddp_find_unused_parameters_true", 2) == "ddp"
    assert strategy_name({"class_path": "gtc_lightning.GTCStrategy", "init_args": {"stale": True}}, 2) == "gtc_stale"
    assert strategy_name({"class_path": "gtc_lightning.GTCStrategy", "init_args": {"tau": 0.01}}, 2) == "gtc"
    assert strategy_name(Namespace(class_path="gtc_lightning.ModelAveragingStrategy", init_args=Namespace(period=10)),
                         2) == "ma"
    assert strategy_name({"class_path": "gtc_lightning.BMUFGTCStrategy"}, 4) == "bmuf_gtc"
    assert strategy_name({"class_path": "gtc_lightning.BF16AllReduceStrategy"}, 2) == "ddp_bf16"
    assert strategy_name({"class_path": "lightning.pytorch.strategies.SingleDeviceStrategy"}, 1) == "baseline"
    d = tmp_path
    (d / "config.yaml").write_text("trainer: {devices: 2, strategy: {class_path: gtc_lightning.ModelAveragingStrategy}}\n")
    (d / "train_summary.json").write_text(json.dumps(
        {"run_name": "ma", "strategy": "modelaveraging", "world_size": 2, "num_weights": 10}))
    assert run_row(d)["strategy"] == "ma"


def test_test_wer_per_voice_family(tmp_path):
    """The comparison splits test WER by voice family (the speaker id's first part, the TTS engine on
    the synthetic corpus): a run that doubles the baseline's errors on the flite voices only is +0 % on
    espeak and +100 % on flite; a test set of one family, or of speaker ids without the structure
    (every id its own family, more than 8), gets no such table."""
    import json

    from lhotse import CutSet, MonoCut, SupervisionSegment
    from local.dnn.compare import compare_runs, voice_family

    assert voice_family("espeak-en-us-m3-r110-p55") == "espeak" and voice_family("spk1") == "spk1"

    def write_speakers(spk_of):
        CutSet.from_cuts(MonoCut(id=u, start=0.0, duration=1.0, channel=0, supervisions=[
            SupervisionSegment(id=u, recording_id=u, start=0.0, duration=1.0, speaker=s)]) for u, s in spk_of.items()
        ).to_file(data_dir / "features" / "test_cuts.jsonl.gz")

    speakers = ["espeak-en-m1", "espeak-en-f2", "flite-rms-r100", "flite-awb-r90"]
    ids = [f"{spk}_test{i:02d}" for spk in speakers for i in range(25)]
    data_dir = tmp_path / "data"
    (data_dir / "features").mkdir(parents=True)
    write_speakers({u: u.split("_")[0] for u in ids})
    runs = []
    for seed in (0, 1):
        for name, workers in (("baseline", 1), ("gtc", 2)):
            d = _fake_run(tmp_path / f"seed{seed}" / name, seed, name, workers, data_dir, [0.5])
            counts = {u: [(2 if name == "gtc" and u.startswith("flite") else 1) * (1 + seed), 10] for u in ids}
            (d / "decode" / "per_utt-test.json").write_text(json.dumps(counts))
            (d / "decode" / "results.json").write_text(json.dumps({"dev": {"wer": 5.0}, "test": {"wer": 10.0}}))
            runs.append(d)
    compare_runs(runs, tmp_path / "cmp")
    fam = json.loads((tmp_path / "cmp" / "comparison.json").read_text())["by_voice_family"]
    assert set(fam) == {"espeak", "flite"} and fam["flite"]["utterances"] == 50 and fam["flite"]["words"] == 500
    assert fam["espeak"]["runs"]["gtc"]["vs_baseline"]["mean"]["rel_pct"] == pytest.approx(0.0)
    assert fam["flite"]["runs"]["gtc"]["vs_baseline"]["mean"]["rel_pct"] == pytest.approx(100.0)
    assert fam["flite"]["runs"]["baseline"]["mean"]["wer"] == pytest.approx(15.0)  # seeds 10 % and 20 %
    md = (tmp_path / "cmp" / "comparison.md").read_text()
    assert "per voice family" in md and "| gtc | 15.00 % (+0.0 % [+0.0, +0.0]) | 30.00 % (+100.0 %" in md
    for spk_of in ({u: "espeak-x" for u in ids}, {u: f"s{i}" for i, u in enumerate(ids)}):
        write_speakers(spk_of)
        compare_runs(runs, tmp_path / "cmp1")
        assert json.loads((tmp_path / "cmp1" / "comparison.json").read_text())["by_voice_family"] == {}
        assert "per voice family" not in (tmp_path / "cmp1" / "comparison.md").read_text()


def test_speaker_bootstrap_is_wider_when_a_voice_carries_the_errors():
    """Two voices of 50 utterances each: one with all the errors. Resampling utterances treats the
    100 as independent; resampling voices draws 0, 1 or 2 copies of the bad voice, and its interval
    holds WERs near 0 and near twice the mean."""
    words = np.full(100, 10.0)
    errors = np.r_[np.full(50, 2.0), np.zeros(50)]
    speakers = np.array(["a"] * 50 + ["b"] * 50)
    by_utt = wer_interval(errors, words)
    by_spk = wer_interval(errors, words, groups=speakers)
    assert by_utt["wer"] == by_spk["wer"] == 10.0
    assert by_spk["lo"] == 0.0 and by_spk["hi"] == 20.0
    assert by_spk["hi"] - by_spk["lo"] > 3 * (by_utt["hi"] - by_utt["lo"])
    # a paired difference draws the same voices for both systems: a system better by 1 error on every
    # utterance of voice a is better in every replicate that draws voice a, and equal otherwise
    d = paired_difference(errors, np.r_[np.full(50, 1.0), np.zeros(50)], words, groups=speakers)
    assert d["diff_lo"] >= 0.0 and d["diff_hi"] <= 10.0
    with pytest.raises(ValueError, match="groups name 3 utterances but words 100"):
        wer_interval(errors, words, groups=np.array(["a", "b", "c"]))


def test_test_speakers_are_persons_not_voice_settings(tmp_path):
    """On the synthetic corpus a SAT speaker is one rate/pitch setting of a voice; the bootstrap's
    clusters are the persons behind them: flite's rms at two settings is one speaker, festival's
    ked_diphone is ked, each espeak voice (at any setting) is its own; a corpus without the ``engine``
    and ``voice`` fields keeps its supervisions' speakers."""
    from lhotse import CutSet, MonoCut, SupervisionSegment
    from local.dnn.compare import test_speakers

    settings = [("flite", "rms", "flite-rms-r112-p-200"), ("flite", "rms", "flite-rms-r114-p200"),
                ("festival", "ked_diphone", "festival-ked_diphone-r102-p150"),
                ("espeak", "en-029+f4", "espeak-en-029-f4-r116-p45"), ("espeak", "en-029+f4", "espeak-en-029-f4-r90-p50"),
                ("espeak", "en-029+m7", "espeak-en-029-m7-r92-p35")]
    (tmp_path / "features").mkdir()

    def write(custom: bool):
        CutSet.from_cuts(MonoCut(id=f"u{i}", start=0.0, duration=1.0, channel=0, supervisions=[SupervisionSegment(
            id=f"u{i}", recording_id=f"u{i}", start=0.0, duration=1.0, speaker=spk,
            custom={"engine": eng, "voice": voice} if custom else None)]) for i, (eng, voice, spk) in enumerate(settings)
        ).to_file(tmp_path / "features" / "test_cuts.jsonl.gz")

    write(custom=True)
    assert test_speakers(tmp_path) == {"u0": "flite-rms", "u1": "flite-rms", "u2": "festival-ked",
                                       "u3": "espeak-en-029+f4", "u4": "espeak-en-029+f4", "u5": "espeak-en-029+m7"}
    write(custom=False)
    assert test_speakers(tmp_path) == {f"u{i}": spk for i, (_, _, spk) in enumerate(settings)}
    assert test_speakers(tmp_path / "nowhere") is None
