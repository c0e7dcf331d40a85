"""The GMM stages' sizes and seed as prepare.py sets them: tree leaves and total Gaussians of the
triphone, LDA+MLLT and SAT systems fixed before training from the hours of training speech (or given), and
``--seed`` handed to every GMM stage."""

import argparse
import json

import prepare
import pytest
from local.gmm.sizes import auto_sizes, resolve_sizes


def test_auto_sizes_keep_the_default_corpus_and_reach_kaldis_sizes():
    default_hours = 843_400 / 360_000  # the default corpus's training frames
    assert auto_sizes("tri", default_hours) == (150, 2000) and auto_sizes("sat", default_hours) == (300, 2500)
    assert auto_sizes("tri", 0.05) == (150, 2000)  # smaller corpora keep the default corpus's sizes
    for system in ("tri", "sat"):
        assert auto_sizes(system, 15) == auto_sizes(system, 100) == (2500, 15000)
        assert auto_sizes(system, 460) == (4200, 40000) and auto_sizes(system, 5000) == (7000, 150000)
        sizes = [auto_sizes(system, h) for h in (2.34, 5, 10, 15, 100, 200, 460, 960)]
        assert sizes == sorted(sizes) and len(set(sizes)) == 7  # growing with the data
    assert auto_sizes("tri", 10) == (1350, 9500) and auto_sizes("sat", 10) == (1550, 10000)
    # LDA+MLLT: the triphone system's sizes (Kaldi's recipes: the same or somewhat more than tri1)
    assert all(auto_sizes("lda_mllt", h) == auto_sizes("tri", h) for h in (0.05, 2.34, 10, 100, 960))


def test_recorded_speech_takes_kaldis_small_recipes_sizes():
    """A corpus of recorded speech: RM's sizes at 3 h, mini_librispeech's at 5 h (tri1 2,000 / 10,000,
    tri2b and tri3b 2,500 / 15,000), Kaldi's larger recipes above as for the synthetic corpus; the triphone
    and LDA+MLLT systems 300 / 1,500 at 1 h (the unseen-voices corpora's point); below the first point in
    proportion to the hours, never below the synthetic corpus's sizes."""
    for system in ("tri", "lda_mllt", "sat"):
        assert auto_sizes(system, 3.0, "timit") == (1800, 9000)
        assert auto_sizes(system, 15, "librispeech") == auto_sizes(system, 15) == (2500, 15000)
        sizes = [auto_sizes(system, h, "kaldi") for h in (0.01, 0.5, 1, 2, 3, 4, 5, 10, 15)]
        assert sizes == sorted(sizes)
    assert auto_sizes("tri", 5.0, "mini_librispeech") == (2000, 10000)
    assert auto_sizes("sat", 5.0, "mini_librispeech") == auto_sizes("lda_mllt", 5.0, "kaldi") == (2500, 15000)
    assert auto_sizes("sat", 1.0, "kaldi") == (600, 3000)  # RM's speech per leaf and per Gaussian
    assert auto_sizes("tri", 1.0, "kaldi") == auto_sizes("lda_mllt", 1.04, "kaldi") == (300, 1500)  # measured
    assert auto_sizes("tri", 0.5, "kaldi") == (150, 1500)  # floor: the synthetic corpus's leaves, not its 2,000
    assert auto_sizes("tri", 2.0, "kaldi") == (950, 4500)  # between 1 h's and RM's, in log hours
    assert auto_sizes("tri", 0.01, "yesno") == (150, 1500) and auto_sizes("sat", 0.01, "kaldi") == (300, 2500)
    assert resolve_sizes("tri", "auto", "auto", frames=3 * 360_000, corpus="timit")["leaves"] == 1800


def test_given_sizes_are_checked_and_auto_ones_recorded():
    sizes = resolve_sizes("tri", "auto", 4000, frames=36_000_000)
    assert sizes == {"leaves": 2500, "gaussians": 4000, "train_hours": 100.0, "auto": ["leaves"]}
    with pytest.raises(ValueError, match=r"tri leaves=-3; .*--tri-leaves"):
        resolve_sizes("tri", -3, "auto", frames=1000)
    with pytest.raises(ValueError, match=r"100 Gaussians for 300 leaves.*--sat-gauss"):
        resolve_sizes("sat", "auto", 100, frames=1000)
    with pytest.raises(ValueError, match="use 'tri', 'lda_mllt' or 'sat'"):
        auto_sizes("mono", 1.0)
    with pytest.raises(ValueError, match=r"--lda-mllt-gauss of at least --lda-mllt-leaves"):
        resolve_sizes("lda_mllt", 500, 100, frames=1000)


def test_prepare_hands_its_seed_sizes_and_search_to_every_gmm_stage(monkeypatch, tmp_path):
    from local.gmm import align, mono, sat, tri
    from local.graph.decode import KALDI_SEARCH

    calls = {}

    def record(name):
        return lambda data_dir, *args, **kwargs: calls.setdefault(name, (args, kwargs)) and {}

    for module, fn in ((mono, "train_mono"), (tri, "train_tri"), (sat, "train_sat"), (align, "align")):
        monkeypatch.setattr(module, fn, record(fn))
    args = argparse.Namespace(seed=7, gmm_sizes={"tri_leaves": 400, "tri_gauss": "auto", "sat_leaves": "auto",
                                                 "sat_gauss": 6000}, lda_mllt=False, sat_schedule="recipe",
                              search=KALDI_SEARCH, corpus="timit")
    for stage in ("mono", "tri", "sat", "align"):
        prepare._run_stage(stage, tmp_path, args)
    assert all(kwargs["seed"] == 7 for _, kwargs in calls.values()) and len(calls) == 4
    assert calls["train_tri"][0] == (400, "auto") and calls["train_sat"][0] == ("auto", 6000)
    assert [calls[fn][1]["search"] for fn in ("train_mono", "train_tri", "train_sat")] == [KALDI_SEARCH] * 3
    assert calls["train_tri"][1]["corpus"] == calls["train_sat"][1]["corpus"] == "timit"  # (auto sizes' rule)


def test_the_size_options_parse_auto_or_a_positive_number(monkeypatch):
    seen = {}
    monkeypatch.setattr(prepare, "prepare", lambda *args, **kwargs: seen.update(kwargs))
    prepare.main(["--tri-leaves", "800", "--sat-gauss", "auto"])
    assert seen["gmm_sizes"] == {"tri_leaves": 800, "tri_gauss": "auto", "lda_mllt_leaves": "auto",
                                 "lda_mllt_gauss": "auto", "sat_leaves": "auto", "sat_gauss": "auto"}
    assert seen["lda_mllt"] is None  # left out: the data dir's record, else on (prepare.resolve_lda_mllt)
    for bad in ("0", "-5", "many"):
        with pytest.raises(SystemExit):
            prepare.main(["--sat-leaves", bad])


def test_an_unknown_gmm_size_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(ValueError, match="unknown GMM sizes"):
        prepare.prepare(data_dir=tmp_path / "data", stage=3, gmm_sizes={"mono_gauss": 10})
    assert not (tmp_path / "data").exists()


def test_later_stages_take_the_corpus_settings_recorded_at_stage_0_and_refuse_others(tmp_path, monkeypatch):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    settings = {"corpus": "kaldi", "corpus_dir": "/corpora/mine", "size": "default", "seed": 2}
    (data_dir / "settings.json").write_text(json.dumps(settings))
    runs = []
    monkeypatch.setattr(prepare, "_run_stage", lambda name, d, args: runs.append((name, args)) or "ok")
    prepare.main(["--data-dir", str(data_dir), "--stage", "3", "--stop-stage", "3"])  # no corpus options
    (name, args), = runs
    assert name == "mono" and (args.corpus, args.corpus_dir, args.seed) == ("kaldi", "/corpora/mine", 2)
    settings["lda_mllt"] = True  # (nothing of the GMM stages built yet: the default is recorded)
    assert json.loads((data_dir / "settings.json").read_text()) == settings
    for given, match in (({"seed": 0}, r"--seed 2 \(settings.json\), and this run gives --seed 0"),
                         ({"corpus": "synthetic"}, r"--corpus kaldi .* gives --corpus synthetic.*--stage 0 --force"),
                         ({"corpus_dir": "/elsewhere"}, "--corpus-dir /corpora/mine")):
        with pytest.raises(SystemExit, match=match):
            prepare.prepare(data_dir=data_dir, stage=4, stop_stage=4, **given)
    assert len(runs) == 1 and json.loads((data_dir / "settings.json").read_text()) == settings
    prepare.prepare(data_dir=data_dir, stage=4, stop_stage=4, corpus="kaldi", seed=2)  # the recorded ones: fine
    assert runs[-1][0] == "tri" and runs[-1][1].seed == 2
    # stage 0 done and not forced: the same refusal as ever; rebuilt: the new settings are recorded
    with pytest.raises(SystemExit, match=r"gives --corpus synthetic: stage 0 is rebuilt only with --force"):
        prepare.prepare(data_dir=data_dir, corpus="synthetic", stop_stage=0)
    prepare.prepare(data_dir=data_dir, corpus="synthetic", size="tiny", stop_stage=0, force=True)
    recorded = json.loads((data_dir / "settings.json").read_text())
    assert (recorded["corpus"], recorded["size"], recorded["seed"], recorded["corpus_dir"]) == ("synthetic", "tiny", 0, None)


def test_train_prepares_a_half_prepared_data_dir_with_its_recorded_corpus(tmp_path, monkeypatch):
    """train.py on a data dir whose stages stopped early runs the rest with the corpus settings.json
    records (before, its own --corpus default, synthetic, was given and refused)."""
    from pathlib import Path

    import train

    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "settings.json").write_text(json.dumps({"corpus": "kaldi", "corpus_dir": "/corpora/mine",
                                                        "size": "tiny", "seed": 0}))  # tiny.yaml: --corpus_size tiny
    runs = []
    monkeypatch.setattr(prepare, "_run_stage", lambda name, d, args: runs.append((name, args.corpus, args.corpus_dir)))
    conf = Path(__file__).resolve().parents[1] / "conf" / "tiny.yaml"
    with pytest.raises(RuntimeError, match="prepare.py finished but"):  # the stand-in stages write nothing
        train.main(["--config", str(conf), "--strategy", "single", "--data.data_dir", str(data_dir)])
    assert [r[0] for r in runs][:2] == ["corpus", "features"]
    assert {r[1:] for r in runs} == {("kaldi", "/corpora/mine")}
