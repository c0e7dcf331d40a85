"""local.transforms: fMLLR, MLLT, LDA and splicing on synthetic data with known answers."""

import itertools

import numpy as np
import pytest
from local.gmm_common import single_gaussian_am
from local.kaldi import khg
from local.transforms import (
    FmllrStats,
    accumulate_fmllr_stats,
    accumulate_mllt_stats,
    apply_affine,
    compose_affine,
    estimate_fmllr,
    estimate_lda,
    estimate_mllt,
    fmllr_objective,
    gaussian_posteriors,
    mllt_objective,
    splice,
)


def gmm_am(rng, num_pdfs=3, num_gauss=3, dim=5, spread=4.0):
    """An AmDiagGmm with random weights, means (std ``spread``) and variances, and its parameters."""
    am, params = khg.AmDiagGmm(), []
    for _ in range(num_pdfs):
        w = rng.dirichlet(np.full(num_gauss, 5.0)).astype(np.float32)
        mu = rng.normal(0, spread, (num_gauss, dim)).astype(np.float32)
        var = rng.uniform(0.5, 1.5, (num_gauss, dim)).astype(np.float32)
        g = khg.DiagGmm(nmix=num_gauss, dim=dim)
        g.set_weights(w)
        g.set_means(mu)
        g.set_invvars(1.0 / var)
        g.compute_gconsts()
        am.add_pdf(g)
        params.append((w / w.sum(), mu, var))
    return am, params


def sample(rng, params, num_frames):
    """Frames drawn from the GMMs, with their pdf labels."""
    pdfs = rng.integers(0, len(params), num_frames)
    x = np.empty((num_frames, params[0][1].shape[1]))
    for p, (w, mu, var) in enumerate(params):
        idx = np.flatnonzero(pdfs == p)
        comp = rng.choice(len(w), size=len(idx), p=w)
        x[idx] = mu[comp] + np.sqrt(var[comp]) * rng.normal(size=(len(idx), x.shape[1]))
    return x, pdfs


def distortion(rng, dim):
    """A known affine map ``y = M x + c`` and its inverse as ``[A b]``."""
    M = np.eye(dim) + 0.3 * rng.normal(size=(dim, dim))
    c = rng.normal(0, 1, dim)
    inv = np.linalg.inv(M)
    return M, c, np.hstack([inv, -(inv @ c)[:, None]])


# ---------------------------------------------------------------- statistics
def test_posteriors_match_numpy():
    rng = np.random.default_rng(1)
    am, params = gmm_am(rng, dim=4)
    x, pdfs = sample(rng, params, 60)
    weights = rng.uniform(0, 2, 60)
    weights[::7] = 0
    seen = []
    for p, idx, post in gaussian_posteriors(am, x, pdfs, weights):
        w, mu, var = params[p]
        ll = np.log(w) - 0.5 * (np.log(2 * np.pi * var).sum(1) + (((x[idx, None] - mu) ** 2) / var).sum(2))
        ref = np.exp(ll - ll.max(1, keepdims=True))
        ref *= (weights[idx] / ref.sum(1))[:, None]
        assert np.all(pdfs[idx] == p)
        np.testing.assert_allclose(post, ref, rtol=1e-4, atol=1e-7)
        seen += idx.tolist()
    assert sorted(seen) == np.flatnonzero(weights != 0).tolist()
    with pytest.raises(ValueError, match="pdf ids"):
        gaussian_posteriors(am, x, pdfs + 5)


def reference_fmllr_stats(am, x, pdfs, weights):
    """Frame by frame, Gaussian by Gaussian, straight from the definitions."""
    D = x.shape[1]
    K, G, beta = np.zeros((D, D + 1)), np.zeros((D, D + 1, D + 1)), 0.0
    for t in range(len(x)):
        g = am.get_pdf(int(pdfs[t]))
        ll = np.asarray(g.log_likelihoods_matrix(x[t : t + 1].astype(np.float32)), np.float64)[0]
        post = np.exp(ll - ll.max()) / np.exp(ll - ll.max()).sum() * weights[t]
        xi = np.append(x[t], 1.0)
        for j in range(len(post)):
            mu, var = np.asarray(g.means[j], np.float64), np.asarray(g.vars[j], np.float64)
            K += post[j] * (mu / var)[:, None] * xi[None, :]
            for i in range(D):
                G[i] += post[j] / var[i] * np.outer(xi, xi)
            beta += post[j]
    return K, G, beta


def test_fmllr_stats_match_reference_loop():
    rng = np.random.default_rng(2)
    am, params = gmm_am(rng, num_pdfs=2, num_gauss=2, dim=3, spread=1.0)
    x, pdfs = sample(rng, params, 25)
    weights = rng.uniform(0, 2, 25)
    weights[3] = weights[10] = 0
    stats = accumulate_fmllr_stats(am, x, pdfs, weights)
    K, G, beta = reference_fmllr_stats(am, x, pdfs, weights)
    np.testing.assert_allclose(stats.K, K, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(stats.G, G, rtol=1e-8, atol=1e-10)
    assert stats.beta == pytest.approx(beta, rel=1e-10)
    # accumulating in two halves into the same stats gives the same; zero weights add nothing
    keep = weights != 0
    half = accumulate_fmllr_stats(am, x[keep][:10], pdfs[keep][:10], weights[keep][:10])
    both = accumulate_fmllr_stats(am, x[keep][10:], pdfs[keep][10:], weights[keep][10:], stats=half)
    assert both is half
    np.testing.assert_allclose(both.G, G, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(both.K, K, rtol=1e-8, atol=1e-10)


def test_mllt_stats_match_reference_loop():
    rng = np.random.default_rng(3)
    am, params = gmm_am(rng, num_pdfs=2, num_gauss=2, dim=3, spread=1.0)
    x, pdfs = sample(rng, params, 20)
    G = np.zeros((3, 3, 3))
    for t in range(len(x)):
        g = am.get_pdf(int(pdfs[t]))
        ll = np.asarray(g.log_likelihoods_matrix(x[t : t + 1].astype(np.float32)), np.float64)[0]
        post = np.exp(ll - ll.max()) / np.exp(ll - ll.max()).sum()
        for j in range(len(post)):
            d = x[t] - np.asarray(g.means[j], np.float64)
            G += post[j] / np.asarray(g.vars[j], np.float64)[:, None, None] * np.outer(d, d)[None]
    stats = accumulate_mllt_stats(am, x, pdfs)
    np.testing.assert_allclose(stats.G, G, rtol=1e-8, atol=1e-10)
    assert stats.beta == pytest.approx(20.0)


# ---------------------------------------------------------------- fMLLR
def test_fmllr_recovers_known_affine_distortion():
    rng = np.random.default_rng(4)
    am, params = gmm_am(rng)
    x, pdfs = sample(rng, params, 4000)
    M, c, W_true = distortion(rng, 5)
    y = x @ M.T + c
    stats = accumulate_fmllr_stats(am, y, pdfs)
    W, info = estimate_fmllr(stats)
    assert info["estimated"] and info["frames"] == pytest.approx(4000)
    assert info["aux_gain_per_frame"] > 1.0
    # the ML transform beats the true inverse on its own statistics, and the identity by far
    assert fmllr_objective(W, stats) >= fmllr_objective(W_true, stats)
    assert np.abs(W - W_true).max() < 0.3
    # a second pass with posteriors from the adapted features, composed as in Kaldi's decode_fmllr
    W2, _ = estimate_fmllr(accumulate_fmllr_stats(am, apply_affine(W, y), pdfs))
    W = compose_affine(W2, W)
    assert np.abs(W - W_true).max() < 0.1
    assert np.abs(apply_affine(W, y) - x).mean() < 0.06
    assert np.abs(y - x).mean() > 0.5


def test_fmllr_objective_never_decreases():
    rng = np.random.default_rng(5)
    am, params = gmm_am(rng, dim=4)
    x, pdfs = sample(rng, params, 500)
    M, c, _ = distortion(rng, 4)
    stats = accumulate_fmllr_stats(am, x @ M.T + c, pdfs)
    _, info = estimate_fmllr(stats, num_iters=4)
    trace = np.asarray(info["objective_trace"])
    assert len(trace) == 1 + 4 * 4
    assert np.all(np.diff(trace) >= -1e-9 * np.abs(trace).max())
    assert trace[-1] > trace[0]
    # more iterations from where the last stopped keep climbing (or stay)
    W, _ = estimate_fmllr(stats, num_iters=1)
    W_more, info_more = estimate_fmllr(stats, init=W, num_iters=2)
    assert info_more["aux_gain_per_frame"] >= 0
    assert fmllr_objective(W_more, stats) >= fmllr_objective(W, stats)


def test_fmllr_below_min_count_returns_start():
    rng = np.random.default_rng(6)
    am, params = gmm_am(rng, dim=4)
    x, pdfs = sample(rng, params, 50)
    stats = accumulate_fmllr_stats(am, x + 3.0, pdfs)
    W, info = estimate_fmllr(stats)
    np.testing.assert_array_equal(W, np.hstack([np.eye(4), np.zeros((4, 1))]))
    assert not info["estimated"] and info["aux_gain_per_frame"] == 0.0
    init = np.hstack([2 * np.eye(4), np.ones((4, 1))])
    np.testing.assert_array_equal(estimate_fmllr(stats, init=init)[0], init)
    assert estimate_fmllr(stats, min_count=10)[1]["estimated"]
    with pytest.raises(ValueError, match="init"):
        estimate_fmllr(stats, init=np.eye(4))
    assert isinstance(FmllrStats.zeros(4).beta, float)


def test_apply_and_compose_affine():
    rng = np.random.default_rng(7)
    x = rng.normal(size=(10, 3))
    W1, W2 = rng.normal(size=(3, 4)), rng.normal(size=(3, 4))
    y = apply_affine(W1, x)
    assert y.dtype == np.float32 and y.shape == (10, 3)
    np.testing.assert_allclose(y, x @ W1[:, :3].T + W1[:, 3], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(apply_affine(W1[:2, :3], x), x @ W1[:2, :3].T, rtol=1e-5, atol=1e-5)
    both = apply_affine(compose_affine(W2, W1), x)
    np.testing.assert_allclose(both, apply_affine(W2, y), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="columns"):
        apply_affine(np.eye(5), x)


# ---------------------------------------------------------------- MLLT
def shared_covariance_data(rng, num_classes=4, dim=4, per_class=1000):
    R, _ = np.linalg.qr(rng.normal(size=(dim, dim)))
    root = R @ np.diag(np.sqrt(np.linspace(4.0, 0.5, dim)))
    means = rng.normal(0, 3, (num_classes, dim))
    classes = np.repeat(np.arange(num_classes), per_class)
    return means[classes] + rng.normal(size=(len(classes), dim)) @ root.T, classes


def diagonal_fit(x, classes):
    """Class means, pooled diagonal variance, and the data's total log-likelihood under them (khg)."""
    means = np.stack([x[classes == k].mean(0) for k in range(classes.max() + 1)])
    var = np.tile(((x - means[classes]) ** 2).mean(0), (len(means), 1))
    am = single_gaussian_am(means, var)
    xs = [x[classes == k].astype(np.float32) for k in range(len(means))]
    ll = sum(float(am.get_pdf(k).log_likelihoods_matrix(xk).sum()) for k, xk in enumerate(xs))
    return am, ll


def test_mllt_diagonalises_a_shared_rotated_covariance():
    rng = np.random.default_rng(8)
    x, classes = shared_covariance_data(rng)
    am, ll_before = diagonal_fit(x, classes)
    stats = accumulate_mllt_stats(am, x, classes)
    A, info = estimate_mllt(stats, num_iters=20)
    trace = np.asarray(info["objective_trace"])
    assert np.all(np.diff(trace) >= -1e-9 * np.abs(trace).max())
    assert mllt_objective(A, stats) == pytest.approx(trace[-1])
    assert info["aux_gain_per_frame"] > 0.05

    def max_correlation(x):
        cov = np.cov((x - np.stack([x[classes == k].mean(0) for k in range(4)])[classes]).T)
        corr = cov / np.sqrt(np.outer(np.diag(cov), np.diag(cov)))
        return np.abs(corr - np.eye(len(cov))).max()

    y = apply_affine(A, x).astype(np.float64)
    assert max_correlation(x) > 0.2
    assert max_correlation(y) < 1e-3
    # re-estimated diagonal model on A x (with the Jacobian) fits better, as well as a full covariance does
    _, ll_after = diagonal_fit(y, classes)
    ll_after += len(x) * np.linalg.slogdet(A)[1]
    resid = x - np.stack([x[classes == k].mean(0) for k in range(4)])[classes]
    cov = resid.T @ resid / len(x)
    ll_full = -0.5 * len(x) * (np.linalg.slogdet(2 * np.pi * cov)[1] + x.shape[1])
    assert ll_after > ll_before + 0.05 * len(x)
    assert ll_after == pytest.approx(ll_full, abs=1e-3 * len(x))


# ---------------------------------------------------------------- LDA and splicing
def lda_data(rng, per_class=1000):
    """Three classes in 5-D whose means differ only along one direction ``u``, with a shared
    correlated within-class covariance that is wide in other directions."""
    u = rng.normal(size=5)
    u /= np.linalg.norm(u)
    root = rng.normal(size=(5, 5)) * 2.0
    classes = np.repeat([0, 1, 2], per_class)
    x = np.array([-8.0, 0.0, 8.0])[classes, None] * u + rng.normal(size=(len(classes), 5)) @ root.T
    return x, classes


def within_cov(z, classes):
    resid = z - np.stack([z[classes == k].mean(0) for k in range(classes.max() + 1)])[classes]
    return resid.T @ resid / len(z)


def separated(v, classes):
    """Whether the classes' value ranges along ``v`` [N] do not overlap."""
    ranges = sorted((v[classes == k].min(), v[classes == k].max()) for k in np.unique(classes))
    return all(hi < lo for (_, hi), (lo, _) in itertools.pairwise(ranges))


def test_lda_separates_classes_and_whitens_within_class():
    rng = np.random.default_rng(9)
    x, classes = lda_data(rng)
    lda = estimate_lda(x, classes, dim=1)
    assert lda.shape == (1, 5)
    z = x @ lda.T
    assert separated(z[:, 0], classes)
    np.testing.assert_allclose(within_cov(z, classes), np.eye(1), atol=1e-8)
    assert not any(separated(x[:, d], classes) for d in range(5))  # no raw coordinate does it
    lda2 = estimate_lda(x, classes, dim=2)
    np.testing.assert_allclose(within_cov(x @ lda2.T, classes), np.eye(2), atol=1e-8)
    np.testing.assert_allclose(np.abs(lda2[0]), np.abs(lda[0]), rtol=1e-6)
    assert estimate_lda(x, classes, dim=4, allow_large_dim=True).shape == (4, 5)


def test_lda_rejects_bad_arguments():
    rng = np.random.default_rng(10)
    x, classes = lda_data(rng, per_class=20)
    with pytest.raises(ValueError, match="dim=6"):
        estimate_lda(x, classes, dim=6, allow_large_dim=True)
    with pytest.raises(ValueError, match="dim=0"):
        estimate_lda(x, classes, dim=0)
    with pytest.raises(ValueError, match="dim=3"):
        estimate_lda(x, classes, dim=3)
    with pytest.raises(ValueError, match="1 classes"):
        estimate_lda(x, np.zeros(len(x), int), dim=1)
    with pytest.raises(ValueError, match="classes"):
        estimate_lda(x, classes[:-1], dim=1)


def test_splice_repeats_edge_frames():
    feats = np.arange(12, dtype=np.float32).reshape(4, 3)
    out = splice(feats, 2)
    assert out.shape == (4, 15) and out.dtype == np.float32
    np.testing.assert_array_equal(out[0], np.concatenate([feats[0], feats[0], feats[0], feats[1], feats[2]]))
    np.testing.assert_array_equal(out[2], np.concatenate([feats[0], feats[1], feats[2], feats[3], feats[3]]))
    np.testing.assert_array_equal(out[:, 6:9], feats)
    np.testing.assert_array_equal(splice(feats, 0), feats)
    assert splice(feats[:0], 1).shape == (0, 9)
    np.testing.assert_array_equal(splice(feats[:1], 1), np.tile(feats[0], 3)[None])
    with pytest.raises(ValueError, match="context=-1"):
        splice(feats, -1)
