"""The LDA+MLLT front end (``local.gmm.lda_mllt``) on synthetic data, and ``prepare.py --lda-mllt``'s
plumbing (which stage trains what, the flag recorded in ``settings.json``). The LDA+MLLT system on the
tiny corpus, decoded and with SAT on top: ``test_gmm.py``."""

import argparse
import json

import numpy as np
import prepare
import pytest
from local.gmm.lda_mllt import (
    LdaStats,
    accumulate_lda_stats,
    accumulate_mllt_stats,
    aligned_log_likelihood,
    estimate_lda,
    estimate_mllt,
    mllt_objective,
    splice,
    transform_means,
)
from local.kaldi import khg


def test_splice_repeats_the_edge_frames_as_kaldi_does():
    x = np.array([[0, 1], [2, 3], [4, 5], [6, 7]])
    out = splice(x)  # ±3 frames: 2 * 7 = 14 dims
    assert out.shape == (4, 14)
    np.testing.assert_array_equal(out[0], [0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 4, 5, 6, 7])
    np.testing.assert_array_equal(out[1], [0, 1, 0, 1, 0, 1, 2, 3, 4, 5, 6, 7, 6, 7])
    np.testing.assert_array_equal(out[3], [0, 1, 2, 3, 4, 5, 6, 7, 6, 7, 6, 7, 6, 7])
    np.testing.assert_array_equal(splice(x, context=1)[2], [2, 3, 4, 5, 6, 7])
    np.testing.assert_array_equal(splice(x[:1], context=2), [[0, 1] * 5])  # one frame: all copies of it


def _classes_on_a_line(rng, dim=6, num_classes=5, per_class=3000):
    """Gaussian classes sharing a correlated within-class covariance, their means on one line."""
    R = rng.normal(size=(dim, dim))
    within = R @ R.T + 0.5 * np.eye(dim)
    direction = rng.normal(size=dim)
    chol = np.linalg.cholesky(within)
    x = np.concatenate([3 * c * direction + rng.normal(size=(per_class, dim)) @ chol.T for c in range(num_classes)])
    return x, np.repeat(np.arange(num_classes), per_class), within, direction


def test_lda_recovers_the_discriminant_direction_and_whitens_the_within_class_covariance():
    rng = np.random.default_rng(0)
    x, classes, within, direction = _classes_on_a_line(rng)
    stats = accumulate_lda_stats(x, classes, None, LdaStats.zeros(5, 6))
    # frames of weight 0 (silence in the recipe) change nothing, whatever their class and values
    junk = rng.normal(size=(500, 6)) * 50
    weighted = accumulate_lda_stats(x, classes, None, LdaStats.zeros(6, 6))
    accumulate_lda_stats(junk, np.full(500, 5), np.zeros(500), weighted)
    lda, info = estimate_lda(stats, dim=3)
    np.testing.assert_allclose(estimate_lda(weighted, dim=3)[0], lda, atol=1e-10)
    assert lda.shape == (3, 6) and info["classes"] == 5 and info["frames"] == len(x)

    fisher = np.linalg.solve(within, direction)  # the population's discriminant direction
    cosine = abs(lda[0] @ fisher) / np.linalg.norm(lda[0]) / np.linalg.norm(fisher)
    assert cosine > 0.999
    ev = info["eigenvalues"]
    assert ev == sorted(ev, reverse=True) and ev[0] > 100 * ev[1]  # the means span one direction

    y = x @ lda.T
    means = np.stack([y[classes == c].mean(0) for c in range(5)])
    centred = y - means[classes]
    np.testing.assert_allclose(centred.T @ centred / len(y), np.eye(3), atol=1e-8)  # unit within-class
    between = (means - y.mean(0)).T @ (means - y.mean(0)) / 5
    np.testing.assert_allclose(between, np.diag(ev[:3]), atol=1e-8)  # diagonal between-class

    with pytest.raises(ValueError, match=r"dim < classes"):
        estimate_lda(stats, dim=5)


def _am(means: np.ndarray, variances: np.ndarray, weights: np.ndarray):
    """``khg.AmDiagGmm`` with one GMM per row of ``means`` ``[P, G, D]``."""
    am = khg.AmDiagGmm()
    for m, v, w in zip(means, variances, weights):
        g = khg.DiagGmm(nmix=m.shape[0], dim=m.shape[1])
        g.set_weights(np.asarray(w, np.float32))
        g.set_means(np.asarray(m, np.float32))
        g.set_invvars(np.asarray(1.0 / v, np.float32))
        g.compute_gconsts()
        am.add_pdf(g)
    return am


def test_mllt_statistics_are_those_of_the_definition():
    rng = np.random.default_rng(1)
    means, variances = rng.normal(size=(2, 3, 4)), rng.uniform(0.5, 2, size=(2, 3, 4))
    am = _am(means, variances, np.full((2, 3), 1 / 3))
    x, pdfs, w = rng.normal(size=(50, 4)), rng.integers(0, 2, size=50), rng.uniform(0, 1, size=50)
    stats = accumulate_mllt_stats(am, x, pdfs, w)
    G, beta = np.zeros((4, 4, 4)), 0.0
    for t in range(50):
        ll = np.asarray(am.get_pdf(int(pdfs[t])).log_likelihoods_matrix(x[t : t + 1].astype(np.float32)))[0]
        post = w[t] * np.exp(ll - ll.max()) / np.exp(ll - ll.max()).sum()
        for j in range(3):
            d = x[t] - means[pdfs[t], j]
            G += post[j] * np.einsum("i,ab->iab", 1 / variances[pdfs[t], j], np.outer(d, d))
            beta += post[j]
    assert stats.beta == pytest.approx(beta)
    np.testing.assert_allclose(stats.G, G, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("correlated", [True, False])
def test_mllt_never_lowers_the_likelihood_and_gains_on_correlated_data(correlated):
    """Data of 3 pdfs x 2 Gaussians, correlated by one shared rotation (the semi-tied case) or not;
    the model's diagonal Gaussians are fitted to it. After MLLT (means moved, variances kept) the
    likelihood of the transformed frames plus the Jacobian is at least the old one plus the
    objective's gain."""
    rng = np.random.default_rng(2)
    D, P, G, n = 5, 3, 2, 800
    R = np.linalg.qr(rng.normal(size=(D, D)))[0] if correlated else np.eye(D)
    centres = rng.normal(size=(P, G, D)) * 3
    scales = rng.uniform(0.3, 2.0, size=(P, G, D))
    pdfs = np.repeat(np.arange(P), G * n)
    comp = np.tile(np.repeat(np.arange(G), n), P)
    x = (centres[pdfs, comp] + rng.normal(size=(len(pdfs), D)) * scales[pdfs, comp]) @ R.T
    means = np.stack([[x[(pdfs == p) & (comp == g)].mean(0) for g in range(G)] for p in range(P)])
    variances = np.stack([[x[(pdfs == p) & (comp == g)].var(0) for g in range(G)] for p in range(P)])
    am = _am(means, variances, np.full((P, G), 1 / G))
    weights = rng.uniform(0.5, 1.0, size=len(x))

    stats = accumulate_mllt_stats(am, x, pdfs, weights)
    A, info = estimate_mllt(stats, num_sweeps=50)
    gain = mllt_objective(A, stats) - mllt_objective(np.eye(D), stats)
    assert info["objective_gain_per_frame"] * stats.beta == pytest.approx(gain, rel=1e-6, abs=1e-6)
    before = aligned_log_likelihood(am, x, pdfs, weights)
    transform_means(am, A)
    after = aligned_log_likelihood(am, x @ A.T, pdfs, weights) + weights.sum() * np.linalg.slogdet(A)[1]
    assert after >= before + gain - 1e-6 * abs(before)
    if correlated:
        assert gain / stats.beta > 0.2  # a rotation the diagonal Gaussians could not model (0.30 here)
    else:
        assert 0 <= gain / stats.beta < 0.05  # nothing left to gain


# ---------------------------------------------------------------- prepare.py --lda-mllt
def test_the_flag_trains_lda_mllt_in_the_tri_stage_and_sat_on_it(monkeypatch, tmp_path):
    from local.gmm import lda_mllt, sat, tri
    from local.graph.decode import Search

    calls = {}
    for module, fn in ((tri, "train_tri"), (lda_mllt, "train_lda_mllt"), (sat, "train_sat")):
        monkeypatch.setattr(module, fn, lambda data_dir, *a, _fn=fn, **kw: calls.setdefault(_fn, []).append((a, kw))
                            or {})
    sizes = {**dict.fromkeys(prepare.GMM_SIZES, "auto"), "lda_mllt_leaves": 500}
    search = Search(13.0, 7000)
    for flag in (False, True):
        args = argparse.Namespace(seed=3, gmm_sizes=sizes, lda_mllt=flag, sat_schedule="recipe", search=search,
                                  corpus="synthetic")
        prepare._run_stage("tri", tmp_path, args)
        prepare._run_stage("sat", tmp_path, args)
    assert len(calls["train_tri"]) == 2 and calls["train_lda_mllt"] == [
        ((500, "auto"), {"seed": 3, "search": search, "corpus": "synthetic"})]
    recipe = {"seed": 3, "search": search, "corpus": "synthetic", "realign_iters": (10, 25), "fmllr_iters": (20,)}
    assert [kw for _, kw in calls["train_sat"]] == [recipe, {**recipe, "speaker_independent": "lda_mllt"}]


def test_the_flag_is_recorded_and_a_data_dir_built_the_other_way_is_refused(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(prepare, "prepare", lambda *args, **kwargs: seen.update(kwargs))
    prepare.main(["--lda-mllt", "--lda-mllt-gauss", "3000"])
    assert seen["lda_mllt"] is True and seen["gmm_sizes"]["lda_mllt_gauss"] == 3000
    prepare.main(["--no-lda-mllt"])
    assert seen["lda_mllt"] is False
    monkeypatch.undo()

    data_dir = tmp_path / "data"
    (data_dir / ".done").mkdir(parents=True)
    settings = {"corpus": "synthetic", "corpus_dir": None, "size": "tiny", "seed": 0}
    (data_dir / "settings.json").write_text(json.dumps(settings))
    (data_dir / ".done" / "sat").write_text("done\n")
    with pytest.raises(SystemExit, match=r"built without LDA\+MLLT.*--stage 4 --force.*or run with --no-lda-mllt"):
        prepare.prepare(data_dir=data_dir, size="tiny", stage=5, stop_stage=5, lda_mllt=True)
    assert json.loads((data_dir / "settings.json").read_text()) == settings  # nothing written
    prepare.check_lda_mllt(data_dir, settings, True, stage=4, force=True)  # a rebuild from tri may change it
    prepare.check_lda_mllt(data_dir, settings, False, stage=5, force=False)  # the same setting continues
    with pytest.raises(SystemExit, match=r"built with LDA\+MLLT.*or run with --lda-mllt"):
        prepare.check_lda_mllt(data_dir, {**settings, "lda_mllt": True}, False, stage=6, force=True)


def test_lda_mllt_is_on_by_default_and_left_out_takes_the_data_dirs_record(tmp_path, caplog):
    """Left out: a new data dir (or one rebuilt from stage 0) gets LDA+MLLT; a recorded setting is kept;
    a data dir of an earlier recipe (no ``lda_mllt`` in settings.json) keeps its built GMM stages without
    it, and the log says how to rebuild them."""
    data_dir = tmp_path / "data"
    (data_dir / ".done").mkdir(parents=True)
    old = {"corpus": "synthetic", "corpus_dir": None, "size": "tiny", "seed": 0}
    assert prepare.resolve_lda_mllt(data_dir, None, None, stage=0, force=False) is True
    assert prepare.resolve_lda_mllt(data_dir, old, None, stage=5, force=False) is True  # nothing built yet
    for stage in prepare.STAGES:  # every stage done: prepare() only checks and records
        (data_dir / ".done" / stage).write_text("done\n")
    for recorded in (True, False):
        assert prepare.resolve_lda_mllt(data_dir, {**old, "lda_mllt": recorded}, None, 6, False) is recorded
    assert prepare.resolve_lda_mllt(data_dir, {**old, "lda_mllt": False}, True, 6, False) is True  # given wins
    assert prepare.resolve_lda_mllt(data_dir, old, None, stage=4, force=True) is True  # tri rebuilt
    with caplog.at_level("WARNING", logger="prepare"):
        assert prepare.resolve_lda_mllt(data_dir, old, None, stage=6, force=False) is False
    assert "were built without LDA+MLLT" in caplog.text and "--lda-mllt --stage 4 --force" in caplog.text

    (data_dir / "settings.json").write_text(json.dumps(old))
    prepare.prepare(data_dir=data_dir, stage=8, stop_stage=8)  # an earlier recipe's data dir continues as built
    assert json.loads((data_dir / "settings.json").read_text()) == {**old, "lda_mllt": False}


def test_the_gmm_search_is_recorded_taken_when_left_out_and_refused_when_it_differs(tmp_path, monkeypatch):
    from local.graph.decode import KALDI_SEARCH, Search

    seen = {}
    monkeypatch.setattr(prepare, "prepare", lambda *args, **kwargs: seen.update(kwargs))
    prepare.main(["--beam", "13", "--max-active", "7000"])
    assert (seen["beam"], seen["max_active"]) == (13.0, 7000)
    monkeypatch.undo()

    data_dir = tmp_path / "data"
    (data_dir / ".done").mkdir(parents=True)
    settings = {"corpus": "synthetic", "corpus_dir": None, "size": "tiny", "seed": 0}
    (data_dir / "settings.json").write_text(json.dumps(settings))
    for stage in prepare.STAGES:  # every stage done: prepare() only checks and records
        (data_dir / ".done" / stage).write_text("done\n")
    with pytest.raises(SystemExit, match=r"decoded with --beam 10 --max-active 3000.*--stage 3 --force"):
        prepare.prepare(data_dir=data_dir, stage=6, stop_stage=6, beam=13, max_active=7000)
    assert json.loads((data_dir / "settings.json").read_text()) == settings  # nothing written
    prepare.check_gmm_search(data_dir, settings, KALDI_SEARCH, stage=3, force=True)  # a rebuild may change it
    kaldi = {**settings, "gmm_search": KALDI_SEARCH.record()}
    (data_dir / "settings.json").write_text(json.dumps(kaldi))
    prepare.prepare(data_dir=data_dir, stage=8, stop_stage=8)  # left out: the recorded search is taken, kept
    assert json.loads((data_dir / "settings.json").read_text()) == {**kaldi, "lda_mllt": False}  # (built without)
    with pytest.raises(SystemExit, match=r"decoded with --beam 13 --max-active 7000.*not --beam 10 --max-active 7000"):
        prepare.prepare(data_dir=data_dir, stage=8, stop_stage=8, beam=10)
    with pytest.raises(SystemExit, match="--stage 3 --force"):  # a rebuild from a later stage is not enough
        prepare.check_gmm_search(data_dir, kaldi, Search(), stage=4, force=True)
