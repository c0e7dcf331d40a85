"""local.gmm.transforms: fMLLR statistics, estimation and composition on synthetic data with known answers."""


import numpy as np
import pytest
from local.gmm.transforms import (
    FmllrStats,
    accumulate_fmllr_stats,
    apply_affine,
    compose_affine,
    estimate_fmllr,
    fmllr_objective,
    gaussian_posteriors,
)
from local.kaldi import khg


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
    W4, info = estimate_fmllr(stats, num_iters=4)
    trace = np.asarray(info["objective_trace"])
    assert len(trace) == 1 + 4 * 4
    # the trace follows the objective row by row: its last value is the objective of the result
    assert trace[-1] == pytest.approx(fmllr_objective(W4, stats), rel=1e-10)
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
