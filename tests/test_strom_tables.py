"""``recipes/asr/research/strom_tables.py`` on the tiny corpus: both tables from real runs (a baseline, GTC at
two thresholds, two model sizes), decoded, with Strom's rows beside; a second call trains nothing.

CI-sized: the GTC runs fork their second rank (``--gtc-args``) rather than start Python again, and the runs are
decoded by best path (test_train.py's end-to-end test covers the lattice search); neither changes what the tables
hold."""

import json
from pathlib import Path

import pytest
import strom_tables


def test_size_parsing():
    assert strom_tables.parse_size("5x1536") == (5, 1536)
    with pytest.raises(Exception, match="LAYERSxUNITS"):
        strom_tables.parse_size("5-512")


def test_tables_on_the_tiny_corpus(tiny_aligned, tmp_path, monkeypatch):
    argv = ["--data-dir", str(tiny_aligned), "--exp-dir", str(tmp_path), "--taus", "0.001", "0.05",
            "--epochs", "1", "--sizes", "2x16", "3x32", "--size-steps", "3", "--size-tau", "0.01",
            "--train-args", "--config conf/tiny.yaml --num_threads 1",
            "--gtc-args", "--trainer.strategy.init_args.start_method fork",
            "--eval-args", "--acoustic-scales 0.1 --search best-path --beam 8 --max-active 1000 --jobs 1"]  # fmt: skip
    # as in a process that launched ranks before (e.g. after fork-launched tests): not inherited by the runs
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert strom_tables.main(argv) == 0
    results = json.loads((tmp_path / "tables.json").read_text())
    t3, t4 = results["table3"], results["table4"]
    assert [r["tau"] for r in t3["rows"]] == [0.001, 0.05]
    low, high = t3["rows"]
    # a higher threshold sends fewer bytes (at tau 0.001 the tiny model's steps may all fall back to dense,
    # which sends no words): a larger compression ratio
    assert low["bytes_per_step"] > high["bytes_per_step"] and low["ratio_fp32"] < high["ratio_fp32"]
    # Strom's scheme in 32-bit words: a 24-byte header and 4 bytes a word; at tau 0.001 the words would send
    # more than a bf16 all-reduce, so the dense fallback (2 ranks: a fp32 all-reduce of 4n bytes) takes steps
    assert low["dense_steps"] > 0 and high["dense_steps"] == 0
    for r in t3["rows"]:
        assert r["test_wer"] is not None and r["rel_wer_reduction_pct"] is not None
        config = (Path(r["run"]) / "config.yaml").read_text()
        assert "compress: gradient" in config and "start_method: fork" in config  # not the update mode; --gtc-args
        summary = json.loads((Path(r["run"]) / "train_summary.json").read_text())
        steps, dense_bytes = summary["gtc"]["total"]["steps"], 4 * summary["num_weights"]
        sent = 24 * steps + 4 * r["words_per_step"] * steps + r["dense_steps"] * dense_bytes
        assert r["bytes_per_step"] * steps == pytest.approx(sent, rel=1e-6)
    assert t3["baseline"]["test_wer"] is not None
    assert "start_method" not in (tmp_path / "baseline" / "config.yaml").read_text()  # --gtc-args: GTC runs only
    assert [(r["layers"], r["hidden"]) for r in t4["rows"]] == [(2, 16), (3, 32)]
    assert t4["rows"][0]["weights"] < t4["rows"][1]["weights"] and all(r["steps"] == 3 for r in t4["rows"])
    text = (tmp_path / "tables.md").read_text()
    assert "| 0.05 |" in text and "| 3 x 32 |" in text and "| 4 | 331,000 | 69 | 846 |" in text
    assert f"| {low['density']:.2e} | {low['dense_steps']} | " in text
    # everything exists: nothing is trained or decoded again
    monkeypatch.setattr(strom_tables.subprocess, "run", lambda *a, **k: pytest.fail(f"ran {a[0][:3]}"))
    decoded = json.loads((tmp_path / "compare" / "comparison.json").read_text())
    assert strom_tables.main([*argv, "--no-decode"]) == 0
    assert json.loads((tmp_path / "tables.json").read_text())["table3"]["rows"][0]["test_wer"] is None
    assert decoded["runs"][0]["run"] == "baseline"


def test_combine_makes_table3_over_seeds(tmp_path):
    def run(name, seed, tau=None, acc=0.6, wer=8.0, size=6000.0):
        return {"run": name, "seed": seed, "tau": tau, "dev_frame_acc": acc, "test_wer": wer,
                "bytes_per_step": size, "words_per_step": size / 4, "ratio_fp32": 6e6 / size}

    band = {"wer": 8.0, "lo": 7.5, "hi": 8.5}
    comparison = {
        "runs": [run("baseline", 0, wer=7.5), run("baseline", 1, wer=8.5), run("tau0.02", 1, 0.02, 0.61, 9.0, 2000.0),
                 run("tau0.02", 0, 0.02, 0.62, 8.0, 3000.0), run("tau0.01", 0, 0.01, size=5000.0),
                 run("tau0.01", 1, 0.01, size=5000.0)],
        "intervals": {"runs": {
            "baseline": {"mean": band},
            "tau0.01": {"mean": band, "vs_baseline": {"mean": {"rel_pct": 0.0, "rel_lo": -2.0, "rel_hi": 2.0}}},
            "tau0.02": {"mean": {"wer": 8.5, "lo": 8.0, "hi": 9.0},
                        "vs_baseline": {"mean": {"rel_pct": 6.25, "rel_lo": 1.04, "rel_hi": 11.5}}}}},
    }
    rows = strom_tables.combined_table3(comparison).splitlines()
    assert "seeds 0/1" in rows[0] and len(rows) == 5
    assert rows[2].startswith("| baseline (1 device) |") and "7.50/8.50 %" in rows[2]
    assert rows[3].startswith("| 0.01 | 5.0-5.0 KB |")  # sorted by tau
    assert rows[4] == ("| 0.02 | 2.0-3.0 KB | 500-750 | 2,000-3,000× | 62.00/61.00 % | 8.00/9.00 % | "
                       "8.50 % [8.00, 9.00] | +6.2 % [+1.0, +11.5] |")  # per seed in seed order
    with pytest.raises(SystemExit, match="no such file"):
        strom_tables.main(["--combine", str(tmp_path / "missing.json")])
    comparison["runs"] = [r for r in comparison["runs"] if r["run"] != "baseline"]
    with pytest.raises(SystemExit, match="no run named 'baseline'"):
        strom_tables.combined_table3(comparison)
