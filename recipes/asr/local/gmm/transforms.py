"""fMLLR (constrained MLLR, Gales 1998) for diagonal-covariance GMMs, in numpy with float64 maths:
Kaldi's ``gmm-est-fmllr`` and ``compose-transforms``, which kaldi-hmm-gmm does not expose. The
speaker-adaptive stage (``gmm_sat``) uses it for training and decoding.

A per-speaker affine map ``x -> A x + b``, ``W = [A b]`` ``[D, D+1]``, is chosen to maximise the
likelihood of the speaker's frames under the model (Jacobian ``log|det A|`` included). With the
extended vector ``xi = [x; 1]`` and the Gaussian posteriors ``gamma`` of the aligned pdfs, the
auxiliary function is ``Q(W) = beta log|det A| + sum_i (w_i . k_i - 0.5 w_i G_i w_i')`` where
``beta = sum gamma``, ``K = sum gamma (mu / var) xi'`` and ``G_i = sum gamma / var[i] xi xi'``.

Q is maximised by Gales' row-by-row update: ``det A`` is linear in row ``i`` through the cofactor
row ``c_i``, so with the other rows fixed the row optimum is ``w_i = G_i^-1 (alpha c_i + k_i)``,
where ``alpha`` solves a quadratic; of its two roots the one with the larger Q is kept. Each row
update is the exact maximum over that row, so Q never drops.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)


def gaussian_posteriors(am, feats: np.ndarray, pdfs: np.ndarray, weights: np.ndarray | None = None) -> list:
    """Within-pdf Gaussian posteriors of aligned frames, one ``log_likelihoods_matrix`` per pdf.

    Args:
        am: ``khg.AmDiagGmm``. feats: ``[T, D]``. pdfs: pdf of each frame ``[T]``.
        weights: per-frame weight ``[T]`` (None: all 1); frames of weight 0 are left out.

    Returns:
        ``[(pdf, frame indices [n], posteriors [n, G] float64 times the frame weights)]``.
    """
    feats, pdfs = np.asarray(feats, np.float32), np.asarray(pdfs, np.int64)
    weights = np.ones(len(pdfs)) if weights is None else np.asarray(weights, np.float64)
    if not len(feats) == len(pdfs) == len(weights):
        raise ValueError(f"{len(feats)} frames, {len(pdfs)} pdfs and {len(weights)} weights; they must match")
    if len(pdfs) and (pdfs.min() < 0 or pdfs.max() >= am.num_pdfs):
        raise ValueError(f"pdf ids span {pdfs.min()}..{pdfs.max()}; the model has {am.num_pdfs} pdfs")
    frames = np.flatnonzero(weights != 0)
    frames = frames[np.argsort(pdfs[frames], kind="stable")]
    out = []
    for idx in np.split(frames, np.flatnonzero(np.diff(pdfs[frames])) + 1):
        if len(idx) == 0:
            continue
        p = int(pdfs[idx[0]])
        ll = np.asarray(am.get_pdf(p).log_likelihoods_matrix(feats[idx]), np.float64)  # [n, G]
        post = np.exp(ll - ll.max(1, keepdims=True))
        post *= (weights[idx] / post.sum(1))[:, None]
        out.append((p, idx, post))
    return out


def _outer_sum(coef: np.ndarray, x: np.ndarray, chunk: int = 2048) -> np.ndarray:
    """``sum_t coef[t, m] x_t x_t'`` for every m: ``[M, d, d]`` (in chunks of frames, to bound memory)."""
    d = x.shape[1]
    out = np.zeros((coef.shape[1], d * d))
    for s in range(0, len(x), chunk):
        xs = x[s : s + chunk]
        out += coef[s : s + chunk].T @ (xs[:, :, None] * xs[:, None, :]).reshape(len(xs), d * d)
    return out.reshape(-1, d, d)


def _pdf_params(am, p: int) -> tuple[np.ndarray, np.ndarray]:
    g = am.get_pdf(p)
    return np.asarray(g.means, np.float64), np.asarray(g.vars, np.float64)  # [G, D] each


# ---------------------------------------------------------------- fMLLR
@dataclass
class FmllrStats:
    """fMLLR statistics of one speaker: ``K [D, D+1]``, ``G [D, D+1, D+1]``, frame count ``beta``."""

    K: np.ndarray
    G: np.ndarray
    beta: float = 0.0

    @classmethod
    def zeros(cls, dim: int) -> FmllrStats:
        return cls(np.zeros((dim, dim + 1)), np.zeros((dim, dim + 1, dim + 1)), 0.0)


def accumulate_fmllr_stats(
    am, feats: np.ndarray, pdfs: np.ndarray, weights: np.ndarray | None = None,
    stats: FmllrStats | None = None,
) -> FmllrStats:
    """Add the fMLLR statistics of ``feats`` ``[T, D]`` aligned to ``pdfs`` ``[T]`` to ``stats``
    (new ones when None) and return them. Posteriors come from the untransformed ``feats``."""
    feats = np.asarray(feats, np.float64)
    stats = FmllrStats.zeros(feats.shape[1]) if stats is None else stats
    # Per frame, sum_j gamma_tj mu_j / var_j and sum_j gamma_tj / var_j; then one product over all
    # frames (not one per pdf: the per-pdf products cost ~5x more in small-matrix overhead).
    mean_coef, var_coef = np.zeros_like(feats), np.zeros_like(feats)
    beta = 0.0
    for p, idx, post in gaussian_posteriors(am, feats, pdfs, weights):
        means, variances = _pdf_params(am, p)
        mean_coef[idx] = post @ (means / variances)
        var_coef[idx] = post @ (1.0 / variances)
        beta += float(post.sum())
    xi = np.hstack([feats, np.ones((len(feats), 1))])
    stats.K += mean_coef.T @ xi
    stats.G += _outer_sum(var_coef, xi)
    stats.beta += beta
    return stats


def add_fmllr_stats(stats: FmllrStats, feats: np.ndarray, post: np.ndarray, means: np.ndarray,
                    variances: np.ndarray) -> FmllrStats:
    """Add the fMLLR statistics of frames ``feats`` ``[T, D]`` with Gaussian posteriors ``post``
    ``[T, G]`` (weights included) over diagonal Gaussians ``means``, ``variances`` ``[G, D]``."""
    feats = np.asarray(feats, np.float64)
    means, variances = np.asarray(means, np.float64), np.asarray(variances, np.float64)
    xi = np.hstack([feats, np.ones((len(feats), 1))])
    stats.K += (post @ (means / variances)).T @ xi  # sum_t (sum_j gamma_tj mu_j / var_j) xi_t'
    stats.G += _outer_sum(post @ (1.0 / variances), xi)
    stats.beta += float(post.sum())
    return stats


def _objective(W: np.ndarray, K: np.ndarray, G: np.ndarray, beta: float) -> float:
    D = W.shape[0]
    sign, logdet = np.linalg.slogdet(W[:, :D])
    if sign == 0:
        return float("-inf")
    return float(beta * logdet + np.sum(W * K) - 0.5 * np.einsum("ij,ijk,ik->", W, G, W))


def _maximise_rows(W: np.ndarray, K: np.ndarray, G: np.ndarray, beta: float, num_iters: int):
    """Gales' row-by-row maximisation of ``beta log|det W[:, :D]| + sum_i (w_i k_i - 0.5 w_i G_i w_i')``;
    returns the new ``W`` and the objective before and after every row update."""
    D, n = W.shape
    W = W.astype(np.float64)
    G_inv = np.linalg.inv(G)
    trace = [_objective(W, K, G, beta)]
    for _ in range(num_iters):
        for i in range(D):
            c = np.zeros(n)
            c[:D] = np.linalg.inv(W[:, :D])[:, i]  # cofactor row i / det A, so det A_new = det A (c . w)
            gc, gk = G_inv[i] @ c, G_inv[i] @ K[i]
            a, b = c @ gc, c @ gk  # w = alpha gc + gk; alpha (c . w) = beta: a alpha^2 + b alpha - beta = 0
            root = np.sqrt(b * b + 4.0 * a * beta)
            rows = [alpha * gc + gk for alpha in ((-b + root) / (2 * a), (-b - root) / (2 * a))]
            gains = [beta * np.log(abs(c @ w)) + w @ K[i] - 0.5 * w @ G[i] @ w for w in rows]
            best = int(np.argmax(gains))
            # Only row i's terms change, and c . w_old = 1 (log 0): the objective moves by the new row's
            # terms less the old row's (the whole objective again per row took half the estimation's time).
            old = W[i] @ K[i] - 0.5 * W[i] @ G[i] @ W[i]
            W[i] = rows[best]
            trace.append(trace[-1] + gains[best] - old)
    return W, trace


def _info(trace: list, beta: float, **extra) -> dict:
    gain = (trace[-1] - trace[0]) / beta if trace and beta > 0 else 0.0
    return {"aux_gain_per_frame": gain, "frames": beta, "objective_trace": trace, **extra}


def fmllr_objective(W: np.ndarray, stats: FmllrStats) -> float:
    """The fMLLR auxiliary function ``Q(W)`` (log-likelihood up to a constant)."""
    return _objective(np.asarray(W, np.float64), stats.K, stats.G, stats.beta)


def estimate_fmllr(
    stats: FmllrStats, init: np.ndarray | None = None, num_iters: int = 10, min_count: float = 100.0
) -> tuple[np.ndarray, dict]:
    """fMLLR transform ``W = [A b]`` ``[D, D+1]`` from ``stats``, starting from ``init`` (None:
    ``[I 0]``), and ``{"aux_gain_per_frame", "frames", "estimated", "objective_trace"}``. Below
    ``min_count`` frames the start is returned unchanged (``estimated`` False)."""
    D = stats.K.shape[0]
    W0 = np.hstack([np.eye(D), np.zeros((D, 1))]) if init is None else np.asarray(init, np.float64)
    if W0.shape != (D, D + 1):
        raise ValueError(f"init has shape {W0.shape}; expected {(D, D + 1)}")
    if stats.beta < min_count:
        log.info("fMLLR: %.1f frames < min_count=%g; keeping the initial transform", stats.beta, min_count)
        return W0.copy(), _info([], stats.beta, estimated=False)
    W, trace = _maximise_rows(W0, stats.K, stats.G, stats.beta, num_iters)
    return W, _info(trace, stats.beta, estimated=True)


def apply_affine(W: np.ndarray, feats: np.ndarray) -> np.ndarray:
    """``x -> A x + b`` for ``W = [A b]`` ``[D', D+1]``, or ``x -> A x`` for ``W = A`` ``[D', D]``;
    returns float32 ``[T, D']``."""
    W, x = np.asarray(W, np.float64), np.asarray(feats, np.float64)
    D = x.shape[1]
    if W.shape[1] not in (D, D + 1):
        raise ValueError(f"transform has shape {W.shape}; features of dim {D} need {D} or {D + 1} columns")
    return (x @ W[:, :D].T + (W[:, D] if W.shape[1] > D else 0.0)).astype(np.float32)


def compose_affine(outer: np.ndarray, inner: np.ndarray) -> np.ndarray:
    """The ``[D, D+1]`` transform applying ``inner`` then ``outer`` (Kaldi's ``compose-transforms``)."""
    outer, inner = np.asarray(outer, np.float64), np.asarray(inner, np.float64)
    D = outer.shape[0]
    return np.hstack([outer[:, :D] @ inner[:, :D], outer[:, :D] @ inner[:, D:] + outer[:, D:]])
