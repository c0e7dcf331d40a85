"""local.dnn.builds: the comparison over several builds of the corpus (one data dir each)."""

import json

import numpy as np
import pytest


def _run(d, seed, name, workers, data_dir, counts):
    (d / "decode").mkdir(parents=True)
    (d / "config.yaml").write_text(f"seed_everything: {seed}\n")
    (d / "train_summary.json").write_text(json.dumps({
        "run_name": name, "strategy": name, "world_size": workers, "num_weights": 1000,
        "dev_frame_acc": [0.5], "data_dir": str(data_dir)}))
    (d / "decode" / "per_utt-test.json").write_text(json.dumps(counts))
    wer = 100 * sum(c[0] for c in counts.values()) / sum(c[1] for c in counts.values())
    (d / "decode" / "results.json").write_text(json.dumps({"dev": {"wer": wer / 2}, "test": {"wer": wer}}))
    return d


def _build(tmp_path, seed, sat_wer):
    """A data dir with its settings, GMM decodes (SAT per utterance) and test speakers."""
    from lhotse import CutSet, MonoCut, SupervisionSegment

    data = tmp_path / f"data{seed}"
    ids = [f"espeak-s{k}_test{i:02d}" for k in range(4) for i in range(20)]
    (data / "features").mkdir(parents=True)
    CutSet.from_cuts(MonoCut(id=u, start=0.0, duration=1.0, channel=0, supervisions=[
        SupervisionSegment(id=u, recording_id=u, start=0.0, duration=1.0, speaker=u.split("_")[0])]) for u in ids
    ).to_file(data / "features" / "test_cuts.jsonl.gz")
    (data / "settings.json").write_text(json.dumps({"corpus": "synthetic", "size": "default", "seed": seed,
                                                    "version": 3}))
    for system, wer in (("mono", 3 * sat_wer), ("tri", 2 * sat_wer), ("sat", sat_wer)):
        for split in ("dev", "test"):
            out = data / "exp" / system / f"decode_{split}"
            out.mkdir(parents=True)
            (out / "wer.json").write_text(json.dumps({"wer": wer if split == "test" else wer - 1,
                                                      "acoustic_scale": 0.05}))
    per_utt = {u: [int(sat_wer / 10), 10] for u in ids}
    (data / "exp" / "sat" / "decode_test" / "per_utt-test-acwt0.05.json").write_text(json.dumps(per_utt))
    return data, ids


def test_spread_over_builds_pairs_runs_within_each_build(tmp_path):
    """Two builds: gtc doubles the baseline's errors on build 1 and equals it on build 2, so its paired
    change is +100 % and +0 %, mean +50 %; the first build's runs fill the usual tables."""
    from local.dnn.compare import compare_runs

    runs = []
    for seed, sat_wer, gtc_factor in ((1, 20.0, 2), (2, 30.0, 1)):
        data, ids = _build(tmp_path, seed, sat_wer)
        runs.append(_run(tmp_path / f"b{seed}" / "baseline", 0, "baseline", 1, data, {u: [1, 10] for u in ids}))
        runs.append(_run(tmp_path / f"b{seed}" / "gtc", 0, "gtc", 2, data, {u: [gtc_factor, 10] for u in ids}))
    compare_runs(runs, tmp_path / "cmp")
    out = json.loads((tmp_path / "cmp" / "comparison.json").read_text())
    assert [r["test_wer"] for r in out["runs"]] == [10.0, 20.0]  # the first build's runs only
    spread = out["builds"]["spread"]
    assert spread["sat GMM"]["test_wer"]["values"] == [20.0, 30.0]
    assert spread["baseline"]["test_wer"]["mean"] == pytest.approx(10.0)
    gtc = spread["gtc"]
    assert gtc["test_wer"]["values"] == pytest.approx([20.0, 10.0])
    assert gtc["vs_baseline_pct"]["values"] == pytest.approx([100.0, 0.0])
    assert gtc["vs_baseline_pct"]["mean"] == pytest.approx(50.0)
    assert gtc["vs_baseline_pct"]["sd"] == pytest.approx(float(np.std([100.0, 0.0], ddof=1)))
    assert gtc["vs_sat_pct"]["values"] == pytest.approx([0.0, -200 / 3], abs=0.05)  # 20 % vs 20 %, 10 % vs 30 %
    assert [b["seed"] for b in out["builds"]["builds"]] == [1, 2]
    assert out["builds"]["builds"][0]["gmm"]["tri"] == {"dev": 39.0, "test": 40.0}
    md = (tmp_path / "cmp" / "comparison.md").read_text()
    assert "Spread over 2 builds of the corpus (corpus seed 1, corpus seed 2" in md
    assert "| sat GMM | 20.00 (19.00) | 30.00 (29.00) | 25.00 | 20.00 – 30.00 | 7.07 |" in md
    assert "| gtc | baseline | +100.0 % [" in md and "| +50.0 | +0.0 – +100.0 | 70.7 |" in md
    # one build only (or a data dir given): no spread, as before
    compare_runs(runs[:2], tmp_path / "cmp1")
    assert json.loads((tmp_path / "cmp1" / "comparison.json").read_text())["builds"] == {}


def test_two_runs_of_one_name_and_seed_on_one_build_are_refused(tmp_path):
    """Before, the second silently replaced the first in the seed-paired statistics."""
    from local.dnn.compare import compare_runs

    data, ids = _build(tmp_path, 0, 20.0)
    runs = [_run(tmp_path / x / "baseline", 0, "baseline", 1, data, {u: [1, 10] for u in ids}) for x in ("a", "b")]
    with pytest.raises(ValueError, match=r"both 'baseline' with seed 0 .* --seed_everything"):
        compare_runs(runs, tmp_path / "cmp")


def test_evaluate_refuses_one_data_dir_for_runs_of_several_builds(tmp_path, capsys):
    """evaluate.py --data-dir decodes every run on that dir: wrong for a run of another build."""
    import evaluate

    runs = []
    for seed in (1, 2):
        data, ids = _build(tmp_path, seed, 20.0)
        runs.append(_run(tmp_path / f"b{seed}" / "baseline", 0, "baseline", 1, data, {u: [1, 10] for u in ids}))
    with pytest.raises(SystemExit):
        evaluate.main(["--runs", *map(str, runs), "--data-dir", str(tmp_path / "data1"), "--compare-only",
                       "--out", str(tmp_path / "cmp")])
    assert "with runs trained on 2 data dirs" in capsys.readouterr().err
