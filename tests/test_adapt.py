"""local.dnn.adapt (fbank UBM and per-speaker fMLLR without transcripts) and local.dnn.front_end, on
synthetic data with known answers; the stage itself runs on the tiny corpus in ``tiny_aligned``."""

import itertools
import json
import pickle

import numpy as np
import pytest
from local.dnn.adapt import (
    DiagGmm,
    estimate_aligned_transform,
    estimate_speaker_transform,
    identity_transform,
    pdf_gaussians,
    speech_frames,
    train_ubm,
)
from local.gmm.transforms import apply_affine


def _mixture(rng, num_gauss=8, dim=4, n=6000):
    means = rng.normal(0, 3, (num_gauss, dim))
    variances = rng.uniform(0.3, 1.0, (num_gauss, dim))
    comp = rng.integers(0, num_gauss, n)
    x = means[comp] + np.sqrt(variances[comp]) * rng.normal(size=(n, dim))
    return DiagGmm(np.full(num_gauss, 1 / num_gauss), means, variances), x


def test_log_likelihoods_match_a_direct_formula():
    rng = np.random.default_rng(0)
    gmm, x = _mixture(rng, n=20)
    want = np.log(gmm.weights) + np.stack([
        -0.5 * (np.log(2 * np.pi * v).sum() + ((x - m) ** 2 / v).sum(1)) for m, v in zip(gmm.means, gmm.variances)
    ], axis=1)
    np.testing.assert_allclose(gmm.log_likelihoods(x), want, rtol=1e-10)
    post, _ = gmm.posteriors(x)
    np.testing.assert_allclose(post.sum(1), 1.0)


def test_ubm_em_never_lowers_the_likelihood_and_fits_the_data():
    rng = np.random.default_rng(1)
    truth, x = _mixture(rng)
    ubm, history = train_ubm(x, num_gauss=8, num_iters=15, seed=0)
    assert all(b >= a - 1e-6 for a, b in itertools.pairwise(history)), history
    assert ubm.posteriors(x)[1] / len(x) > truth.posteriors(x)[1] / len(x) - 0.1
    with pytest.raises(ValueError, match="fewer Gaussians"):
        train_ubm(x[:5], num_gauss=8)


def test_speaker_transform_undoes_a_known_distortion_without_labels():
    rng = np.random.default_rng(2)
    ubm, x = _mixture(rng, num_gauss=6, dim=3, n=4000)
    M = np.eye(3) + 0.15 * rng.normal(size=(3, 3))
    c = rng.normal(0, 0.5, 3)
    distorted = x @ M.T + c
    W, info = estimate_speaker_transform(ubm, distorted, num_em=6)
    assert info["gain_per_frame"] > 0
    restored = apply_affine(W, distorted)
    assert np.abs(restored - x).mean() < 0.25 * np.abs(distorted - x).mean()


def test_pdf_gaussians_are_each_pdfs_mean_and_variance():
    x = np.array([[0.0, 1.0], [2.0, 3.0], [10.0, 10.0], [12.0, 14.0], [5.0, 5.0]])
    pdf = np.array([0, 0, 2, 2, 3])
    g = pdf_gaussians([(x[:3], pdf[:3]), (x[3:], pdf[3:])], num_pdfs=4)
    np.testing.assert_allclose(g.means[0], [1.0, 2.0])
    np.testing.assert_allclose(g.variances[0], [1.0, 1.0])
    np.testing.assert_allclose(g.means[2], [11.0, 12.0])
    np.testing.assert_allclose(g.variances[2], [1.0, 4.0])
    # pdf 1 has no frames and pdf 3 one: both take the data's mean and variance
    np.testing.assert_allclose(g.means[1], x.mean(0))
    np.testing.assert_allclose(g.means[3], x.mean(0))
    np.testing.assert_allclose(g.variances[1], x.var(0))
    np.testing.assert_allclose(g.weights, np.array([2, 1, 2, 1]) / 6)
    with pytest.raises(ValueError, match="align stage"):
        pdf_gaussians([], num_pdfs=4)


def test_aligned_transform_undoes_a_distortion_that_fools_the_ubm():
    """Labels decide which Gaussian each frame belongs to: a distortion large enough to move frames
    onto other Gaussians is undone with the alignment, and not without it."""
    rng = np.random.default_rng(5)
    truth, _ = _mixture(rng, num_gauss=6, dim=3, n=10)
    pdf = rng.integers(0, 6, 4000)
    x = truth.means[pdf] + np.sqrt(truth.variances[pdf]) * rng.normal(size=(4000, 3))
    M = np.array([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]) * 1.3  # a rotation of the axes, scaled
    c = rng.normal(0, 1.0, 3)
    distorted = x @ M.T + c
    W, info = estimate_aligned_transform(truth, distorted, pdf)
    assert info["gain_per_frame"] > 0
    restored = apply_affine(W, distorted)
    assert np.abs(restored - x).mean() < 0.05 * np.abs(distorted - x).mean()
    W_ubm, _ = estimate_speaker_transform(truth, distorted, num_em=6)
    assert np.abs(apply_affine(W_ubm, distorted) - x).mean() > 5 * np.abs(restored - x).mean()
    W_few, info_few = estimate_aligned_transform(truth, distorted[:50], pdf[:50], min_frames=100)
    np.testing.assert_array_equal(W_few, identity_transform(3))
    assert info_few["gain_per_frame"] == 0.0


def test_too_few_frames_keep_the_identity():
    rng = np.random.default_rng(3)
    ubm, x = _mixture(rng, n=50)
    W, info = estimate_speaker_transform(ubm, x, min_frames=100)
    np.testing.assert_array_equal(W, identity_transform(4))
    assert info["gain_per_frame"] == 0.0


def test_speech_frames_leave_out_digital_silence():
    silence = np.full((30, 40), -15.9)
    speech = np.random.default_rng(4).normal(2.0, 1.0, (50, 40))
    mask = speech_frames(np.vstack([silence, speech, silence]))
    assert not mask[:30].any() and mask[30:80].all() and not mask[80:].any()


def _stage_transforms(data_dir, kind: str, trans_file: str, info_file: str):
    """The stage's transforms of ``kind``: every speaker of every split has a finite one, and the
    front end applies it. Returns them and the test cuts."""
    from lhotse import CutSet
    from local.data.features import gmm_cmvn_key
    from local.dnn.front_end import FrontEnd

    with open(data_dir / "adapt" / trans_file, "rb") as f:
        trans = pickle.load(f)
    info = json.loads((data_dir / "adapt" / info_file).read_text())
    for split in ("train", "dev", "test"):
        cuts = CutSet.from_file(data_dir / "features" / f"{split}_cuts.jsonl.gz")
        assert {gmm_cmvn_key(c) for c in cuts} <= set(trans), split
        assert info["splits"][split]["speakers"] > 0
    assert all(W.shape == (40, 41) and np.isfinite(W).all() for W in trans.values())
    assert list(trans) == sorted(trans)  # kept by speaker: two builds write the same bytes
    test = list(CutSet.from_file(data_dir / "features" / "test_cuts.jsonl.gz"))
    plain, adapted = FrontEnd(data_dir, "fbank"), FrontEnd(data_dir, kind)
    (cut, x), (_, y) = next(iter(plain(test[:1], "test"))), next(iter(adapted(test[:1], "test")))
    np.testing.assert_allclose(y, apply_affine(trans[gmm_cmvn_key(cut)], x), rtol=1e-5, atol=1e-5)
    return trans, test


def test_adapt_stage_on_the_tiny_corpus(tiny_aligned):
    """UBM transforms: every speaker of every split has one, the DNN front end applies it, and a
    new set's speakers get theirs from their audio alone."""
    from local.data.features import gmm_cmvn_key
    from local.dnn.front_end import FrontEnd

    _, test = _stage_transforms(tiny_aligned, "fbank_fmllr", "fbank_trans.pkl", "info.json")
    fresh = FrontEnd(tiny_aligned, "fbank_fmllr")
    fresh.fbank_trans = {}
    with pytest.raises(ValueError, match="add_speakers"):
        next(iter(fresh(test[:1], "test")))
    fresh.add_speakers(test)
    assert set(fresh.fbank_trans) == {gmm_cmvn_key(c) for c in test}


def test_adapt_stage_fbank_sat_on_the_tiny_corpus(tiny_aligned):
    """The SAT-aligned transforms: every speaker of every split has one (dev and test from the SAT
    system's decoding, kept in adapt/), the front end applies them, and a new set decoded by the
    SAT GMM from scratch gets the same ones."""
    from local.data.features import gmm_cmvn_key
    from local.dnn.front_end import FrontEnd

    trans, test = _stage_transforms(tiny_aligned, "fbank_sat", "fbank_sat_trans.pkl", "sat_info.json")
    for split in ("dev", "test"):
        with open(tiny_aligned / "adapt" / f"sat_best_path_{split}.pkl", "rb") as f:
            assert len(pickle.load(f)) > 0
    # a new set (here: test again, as evaluate.py --test-set would get it) is decoded by the SAT
    # GMM from scratch, without transcripts: the same best paths, so the same transforms
    fresh = FrontEnd(tiny_aligned, "fbank_sat")
    fresh.fbank_trans = {}
    fresh.add_speakers(test)
    assert set(fresh.fbank_trans) == {gmm_cmvn_key(c) for c in test}
    for spk, W in fresh.fbank_trans.items():
        np.testing.assert_allclose(W, trans[spk], rtol=1e-6, atol=1e-6)


def test_a_data_dir_of_an_older_recipe_gets_fbank_sat_by_running_the_adapt_stage_again(tiny_aligned, tmp_path,
                                                                                        caplog):
    """A data dir whose adapt stage is marked done but has no fbank_sat transforms (made before
    they existed) runs that stage again, and only the stages from it on."""
    import logging
    import shutil

    from prepare import prepare

    data_dir = tmp_path / "old"
    shutil.copytree(tiny_aligned, data_dir, symlinks=True)
    for name in ("fbank_sat_trans.pkl", "pdf_gauss.npz", "sat_info.json", "sat_best_path_dev.pkl",
                 "sat_best_path_test.pkl"):
        (data_dir / "adapt" / name).unlink()
    before = {s: (data_dir / ".done" / s).read_text() for s in ("align", "adapt")}
    with caplog.at_level(logging.INFO):
        prepare(corpus="synthetic", size="tiny", data_dir=data_dir, stage=1, stop_stage=8, num_jobs=1)
    assert (data_dir / "adapt" / "fbank_sat_trans.pkl").exists()
    assert "done by an older version of the recipe (no adapt/fbank_sat_trans.pkl)" in caplog.text
    assert (data_dir / ".done" / "align").read_text() == before["align"]  # not run again
    assert (data_dir / ".done" / "adapt").exists()
