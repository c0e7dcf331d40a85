"""Stage 4 (not with ``prepare.py --no-lda-mllt``): the LDA+MLLT triphone system (Kaldi's
``steps/train_lda_mllt.sh``), trained after the Δ + ΔΔ triphone system (``tri``) from its
alignments, then decoded like it. The SAT stage then adapts on its features.

The front end: the 13 CMVN'd MFCC (``features.gmm_features``, the CMVN of every GMM) of
``2 * SPLICE + 1`` frames around each frame, spliced as Kaldi's ``splice-feats`` does (the edge
frames repeated; 91 dims), projected to ``LDA_DIM`` = 40 dims by ``M = A L``:

- ``L`` (LDA, Kaldi's ``acc-lda`` / ``est-lda``): classes are the pdfs of the triphone system's
  alignments, silence frames weigh ``SILENCE_WEIGHT`` = 0 (``train_lda_mllt.sh``). With the
  within-class covariance ``W = C C'`` (Cholesky) and the between-class covariance ``B``, the
  eigenvectors ``U`` of ``C^-1 B C^-T`` (largest eigenvalues first) give ``L = U' C^-1``: the
  projected within-class covariance is the identity, the between-class one diagonal. No offset.
- ``A`` (MLLT, semi-tied covariance, Gales 1999; Kaldi's ``gmm-acc-mllt`` / ``est-mllt``): a square
  transform of the LDA features under which the model's diagonal covariances fit best. From the
  Gaussian posteriors of the current model (silence weight 0), ``beta = sum gamma`` and
  ``G_i = sum_j (1 / var_j[i]) sum_t gamma_tj (x_t - mu_j)(x_t - mu_j)'``, ``A`` maximises
  ``Q(A) = beta log|det A| - 0.5 sum_i a_i G_i a_i'`` (the model's log-likelihood with the means
  moved to ``A mu_j`` and the variances kept, up to a constant) by Gales' row-by-row update from
  ``A = I``, ``a_i = sqrt(beta / (c_i G_i^-1 c_i')) c_i G_i^-1`` (``c_i`` the cofactor row),
  ``MLLT_SWEEPS`` sweeps as ``est-mllt``. Each row update is the exact maximum over that row, so
  ``Q`` never drops, nor does the likelihood (EM's bound). The model follows as Kaldi's
  ``gmm-transform-means`` moves it: means to ``A mu``, variances kept (in the semi-tied model they
  are the diagonal covariances of the new space); ``M`` becomes ``A M`` (``compose-transforms``).

Training (``train_lda_mllt.sh``): a new tree and one Gaussian per leaf on the LDA features from
the triphone alignments (``tri.build_triphone_system``), the alignments converted, then
``num_iters`` Viterbi passes (``common.train_iterations``) re-aligning on ``REALIGN_ITERS`` and
re-estimating MLLT at the start of the passes ``MLLT_ITERS``.

Writes ``exp/lda_mllt/final.pkl`` (the model with its transform ``M``), ``lda.npy`` (``L``
``[40, 91]``), ``final_mat.npy`` (``M`` ``[40, 91]``), ``tree``, ``ali.pkl``, ``history.json``,
``summary.json`` (with the LDA eigenvalues and each MLLT update's objective gain) and
``decode_{dev,test}/`` as the triphone stage does.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from local.gmm.transforms import apply_affine, gaussian_posteriors
from local.graph.decode import RECIPE_SEARCH, Search

log = logging.getLogger(__name__)

SPLICE = 3  # splice-feats' --left-context and --right-context
LDA_DIM = 40  # train_lda_mllt.sh's --dim
SILENCE_WEIGHT = 0.0  # train_lda_mllt.sh: weight-silence-post 0.0 for the LDA and the MLLT statistics
REALIGN_ITERS = (10, 20, 30)  # train_lda_mllt.sh (35 passes)
MLLT_ITERS = (2, 4, 6, 12)  # train_lda_mllt.sh
MLLT_SWEEPS = 200  # est-mllt's sweeps over the rows (MlltAccs::Update)


# ---------------------------------------------------------------- the front end
def splice(x: np.ndarray, context: int = SPLICE) -> np.ndarray:
    """Kaldi's ``splice-feats``: ``[T, D]`` -> ``[T, D * (2 context + 1)]``, frame ``t`` followed by
    its neighbours ``t - context .. t + context`` in order, the first and last frame repeated past
    the edges."""
    x = np.asarray(x)
    if x.ndim != 2 or len(x) == 0:
        raise ValueError(f"features of shape {x.shape}; splice needs [T, D] with T >= 1")
    idx = np.clip(np.arange(len(x))[:, None] + np.arange(-context, context + 1)[None, :], 0, len(x) - 1)
    return x[idx].reshape(len(x), -1)


def lda_mllt_features(mfcc: np.ndarray, transform: np.ndarray) -> np.ndarray:
    """The LDA+MLLT features ``[T, d]`` float32 of CMVN'd MFCC ``[T, D]``: spliced ±``SPLICE``
    frames, then ``transform`` ``[d, D * (2 SPLICE + 1)]`` (float64 maths)."""
    transform = np.asarray(transform)
    spliced_dim = mfcc.shape[1] * (2 * SPLICE + 1)
    if transform.ndim != 2 or transform.shape[1] != spliced_dim:
        raise ValueError(f"transform of shape {transform.shape} for {mfcc.shape[1]}-dim features spliced to "
                         f"{spliced_dim} dims; it must have {spliced_dim} columns (re-run the tri stage with "
                         "--lda-mllt for these features)")
    return apply_affine(transform, splice(np.asarray(mfcc, np.float64)))


# ---------------------------------------------------------------- LDA
@dataclass
class LdaStats:
    """Kaldi's LDA accumulators: per class the count ``[C]`` and the sum ``[C, D]``, and the total
    sum of outer products ``[D, D]``."""

    count: np.ndarray
    first: np.ndarray
    second: np.ndarray

    @classmethod
    def zeros(cls, num_classes: int, dim: int) -> LdaStats:
        return cls(np.zeros(num_classes), np.zeros((num_classes, dim)), np.zeros((dim, dim)))


def accumulate_lda_stats(feats: np.ndarray, classes: np.ndarray, weights: np.ndarray | None,
                         stats: LdaStats) -> LdaStats:
    """Add frames ``feats`` ``[T, D]`` of classes ``classes`` ``[T]`` weighted by ``weights``
    ``[T]`` (None: 1) to ``stats`` (``acc-lda``); returns ``stats``."""
    x = np.asarray(feats, np.float64)
    classes = np.asarray(classes, np.int64)
    w = np.ones(len(x)) if weights is None else np.asarray(weights, np.float64)
    if not len(x) == len(classes) == len(w):
        raise ValueError(f"{len(x)} frames, {len(classes)} classes and {len(w)} weights; they must match")
    if x.shape[1] != stats.first.shape[1]:
        raise ValueError(f"{x.shape[1]}-dim frames for {stats.first.shape[1]}-dim LDA statistics")
    if len(classes) and (classes.min() < 0 or classes.max() >= len(stats.count)):
        raise ValueError(f"class ids span {classes.min()}..{classes.max()}; the statistics have "
                         f"{len(stats.count)} classes")
    stats.count += np.bincount(classes, weights=w, minlength=len(stats.count))
    order = np.argsort(classes, kind="stable")
    starts = np.flatnonzero(np.diff(classes[order], prepend=-1))  # each class's first frame in ``order``
    xw = x * w[:, None]
    stats.first[classes[order[starts]]] += np.add.reduceat(xw[order], starts, axis=0) if len(x) else 0.0
    stats.second += xw.T @ x
    return stats


def estimate_lda(stats: LdaStats, dim: int = LDA_DIM) -> tuple[np.ndarray, dict]:
    """Kaldi's ``est-lda``: the ``[dim, D]`` LDA projection under which the within-class covariance
    is the identity and the between-class covariance diagonal, its rows by decreasing between-class
    variance; classes without frames are left out.

    Returns:
        the projection and ``{"eigenvalues": all D, largest first, "frames", "classes"}``.
    """
    keep = stats.count > 0
    n, classes, D = float(stats.count.sum()), int(keep.sum()), stats.second.shape[0]
    if not 0 < dim <= D or dim >= classes:
        raise ValueError(f"LDA to {dim} dims from {D}-dim features and {classes} classes with frames: need "
                         f"0 < dim <= {D} and dim < classes (the between-class covariance has rank classes - 1)")
    mean = stats.first[keep].sum(0) / n
    total = stats.second / n - np.outer(mean, mean)
    class_means = stats.first[keep] / stats.count[keep, None]
    between = (class_means * (stats.count[keep] / n)[:, None]).T @ class_means - np.outer(mean, mean)
    within = total - between
    try:
        chol = np.linalg.cholesky(within)
    except np.linalg.LinAlgError as e:
        raise ValueError(f"the within-class covariance of {n:.0f} frames is not positive definite ({e}); "
                         "LDA needs more frames than spliced dimensions, and features that vary") from None
    chol_inv = np.linalg.inv(chol)
    eigenvalues, vectors = np.linalg.eigh(chol_inv @ between @ chol_inv.T)
    order = np.argsort(eigenvalues)[::-1]
    lda = vectors[:, order].T @ chol_inv
    return lda[:dim], {"eigenvalues": eigenvalues[order].tolist(), "frames": n, "classes": classes}


# ---------------------------------------------------------------- MLLT
@dataclass
class MlltStats:
    """Kaldi's MLLT accumulators: ``G`` ``[D, D, D]`` (one ``[D, D]`` matrix per row of the transform)
    and the count ``beta``."""

    G: np.ndarray
    beta: float = 0.0

    @classmethod
    def zeros(cls, dim: int) -> MlltStats:
        return cls(np.zeros((dim, dim, dim)), 0.0)


def accumulate_mllt_stats(am, feats: np.ndarray, pdfs: np.ndarray, weights: np.ndarray | None = None,
                          stats: MlltStats | None = None) -> MlltStats:
    """Add the MLLT statistics of ``feats`` ``[T, D]`` aligned to ``pdfs`` ``[T]`` (frame weights
    ``weights``, None: 1) under the diagonal GMMs of ``am`` (``gmm-acc-mllt``): ``beta += sum gamma``,
    ``G_i += sum_j (1 / var_j[i]) S_j`` with ``S_j = sum_t gamma_tj (x_t - mu_j)(x_t - mu_j)'`` about
    the model's means. Returns the statistics (new ones when ``stats`` is None)."""
    x = np.asarray(feats, np.float64)
    stats = MlltStats.zeros(x.shape[1]) if stats is None else stats
    for p, idx, post in gaussian_posteriors(am, x, pdfs, weights):
        gmm = am.get_pdf(p)
        means, inv_vars = np.asarray(gmm.means, np.float64), np.asarray(gmm.inv_vars, np.float64)  # [G, D]
        xs = x[idx]
        occ, first = post.sum(0), post.T @ xs  # [G], [G, D]
        second = np.stack([(xs * post[:, g, None]).T @ xs for g in range(post.shape[1])])  # [G, D, D]
        scatter = (second - np.einsum("ga,gb->gab", means, first)
                   - np.einsum("ga,gb->gab", first, means) + occ[:, None, None] * np.einsum("ga,gb->gab", means, means))
        stats.G += np.einsum("gi,gab->iab", inv_vars, scatter)
        stats.beta += float(occ.sum())
    return stats


def mllt_objective(A: np.ndarray, stats: MlltStats) -> float:
    """``Q(A) = beta log|det A| - 0.5 sum_i a_i G_i a_i'``."""
    A = np.asarray(A, np.float64)
    return float(stats.beta * np.linalg.slogdet(A)[1] - 0.5 * np.einsum("ij,ijk,ik->", A, stats.G, A))


def estimate_mllt(stats: MlltStats, num_sweeps: int = MLLT_SWEEPS) -> tuple[np.ndarray, dict]:
    """The MLLT transform ``A`` ``[D, D]`` maximising ``mllt_objective`` from ``A = I`` (``est-mllt``):
    ``num_sweeps`` sweeps of Gales' row update. With the other rows fixed, ``det A`` is linear in
    row ``i`` through its cofactors ``c_i`` (here ``A^-1[:, i]``, the cofactors over ``det A``), and
    ``beta log|a_i . c_i| - 0.5 a_i G_i a_i'`` is largest at ``a_i = sqrt(beta / (c_i G_i^-1 c_i'))
    c_i G_i^-1``.

    Returns:
        ``A`` and ``{"objective_gain_per_frame", "frames"}``.
    """
    D, beta = stats.G.shape[0], stats.beta
    if beta < 10 * D:  # est-mllt warns below this count too
        raise ValueError(f"MLLT from {beta:.0f} frames of {D}-dim features; it needs at least {10 * D} "
                         "(non-silence frames)")
    G_inv = np.linalg.inv(stats.G)
    A, gain = np.eye(D), 0.0
    for _ in range(num_sweeps):
        for i in range(D):
            c = np.linalg.inv(A)[:, i]
            before = beta * np.log(abs(A[i] @ c)) - 0.5 * A[i] @ stats.G[i] @ A[i]
            gc = G_inv[i] @ c
            A[i] = np.sqrt(beta / (c @ gc)) * gc
            after = beta * np.log(abs(A[i] @ c)) - 0.5 * A[i] @ stats.G[i] @ A[i]
            if after < before - 1e-5 * abs(before):  # est-mllt's "Objective decrease in MLLT update"
                raise RuntimeError(f"the MLLT objective dropped from {before:.6g} to {after:.6g} in a row update; "
                                   "its statistics are not positive definite (too few frames per dimension?)")
            gain += after - before
    return A, {"objective_gain_per_frame": gain / beta, "frames": beta}


def transform_means(am, A: np.ndarray) -> None:
    """Kaldi's ``gmm-transform-means``: every Gaussian's mean ``mu -> A mu``, variances kept."""
    A = np.asarray(A, np.float64)
    for p in range(am.num_pdfs):
        gmm = am.get_pdf(p)
        gmm.set_means((np.asarray(gmm.means, np.float64) @ A.T).astype(np.float32))
        gmm.compute_gconsts()


def aligned_log_likelihood(am, feats: np.ndarray, pdfs: np.ndarray, weights: np.ndarray | None = None) -> float:
    """``sum_t w_t log p(x_t | pdf_t)`` of aligned frames under the GMMs of ``am``."""
    x = np.asarray(feats, np.float32)
    pdfs = np.asarray(pdfs, np.int64)
    w = np.ones(len(x)) if weights is None else np.asarray(weights, np.float64)
    total = 0.0
    for p in np.unique(pdfs):
        idx = np.flatnonzero(pdfs == p)
        ll = np.asarray(am.get_pdf(int(p)).log_likelihoods_matrix(x[idx]), np.float64)
        top = ll.max(1)
        total += float(w[idx] @ (top + np.log(np.exp(ll - top[:, None]).sum(1))))
    return total


# ---------------------------------------------------------------- the stage
def train_lda_mllt(
    data_dir: Path | str,
    num_leaves: int | str = "auto",
    total_gauss: int | str = "auto",
    num_iters: int = 35,
    realign_iters: tuple[int, ...] = REALIGN_ITERS,
    mllt_iters: tuple[int, ...] = MLLT_ITERS,
    dim: int = LDA_DIM,
    beam: float = 10.0,
    decode: bool = True,
    scales: tuple[float, ...] | None = None,
    search: Search = RECIPE_SEARCH,
    seed: int = 0,
    corpus: str = "synthetic",
) -> dict:
    """Train the LDA+MLLT triphone system from ``exp/tri`` and decode dev/test.

    Args:
        data_dir: the recipe's data directory (tri stage done).
        num_leaves: most tree leaves, or ``"auto"``: fixed before training from the hours of
            training speech (``local.gmm.sizes``: the triphone system's sizes).
        total_gauss: Gaussians at the end of mixture growth, or ``"auto"``.
        num_iters: training passes (Kaldi's 35).
        realign_iters: passes that start with a re-alignment (Kaldi's 10, 20, 30).
        mllt_iters: passes that start with an MLLT update (Kaldi's 2, 4, 6, 12).
        dim: the LDA's output dimension (Kaldi's 40).
        beam: Viterbi alignment beam (retry beam 40).
        decode: decode dev and test (``exp/lda_mllt/decode_*``).
        scales: the acoustic-scale grid dev is searched on (default ``GMM_ACOUSTIC_SCALES``; bracketed, extended
            past an edge: ``pick_scale``).
        search: the dev and test decodings' beam and most active states (``local.graph.decode.Search``;
            ``prepare.py --beam``, ``--max-active``).
        seed: seed of the mixing up's perturbations (``common.split_by_count``).
        corpus: ``prepare.py --corpus``, for ``auto`` sizes (``local.gmm.sizes.auto_sizes``: the synthetic
            corpus's rule, or recorded speech's).

    Returns:
        a summary: leaves, pdfs, Gaussians, the sizes asked (``sizes``), final log-likelihood (in the
        final features' space), the MLLT updates' objective gains, seconds, WERs.
    """
    from local.gmm.align_jobs import align_jobs
    from local.gmm.common import (
        GmmSystem,
        Utterances,
        begin_stage,
        compile_graphs,
        convert_alignments,
        gmm_mfcc,
        load_cuts,
        realign_all,
        train_iterations,
    )
    from local.gmm.sat import silence_tids
    from local.gmm.sizes import resolve_sizes
    from local.gmm.tri import build_triphone_system
    from local.graph.lang import cut_words

    start = time.perf_counter()
    data_dir, exp, lang = begin_stage(data_dir, "lda_mllt")
    cuts = load_cuts(data_dir, "train", clean_only=False)
    mfcc = gmm_mfcc(cuts)
    tri, tri_alis = GmmSystem.load_run(data_dir / "exp" / "tri", mfcc)

    tid2pdf, sil = tri.tid2pdf(), silence_tids(tri, lang.silence_ids)
    lda_stats = LdaStats.zeros(tri.tm.num_pdfs, mfcc[cuts[0].id].shape[1] * (2 * SPLICE + 1))
    for utt, ali in tri_alis.items():
        accumulate_lda_stats(splice(mfcc[utt]), tid2pdf[ali], np.where(sil[ali], SILENCE_WEIGHT, 1.0), lda_stats)
    lda, lda_info = estimate_lda(lda_stats, dim)
    np.save(exp / "lda.npy", lda)
    transform = lda
    utts = Utterances(cuts, {u: lda_mllt_features(x, transform) for u, x in mfcc.items()},
                      {c.id: cut_words(c) for c in cuts})
    log.info("lda_mllt: LDA %d -> %d dims from %.0f frames of %d pdfs (kept %.1f %% of the between-class variance)",
             lda.shape[1], dim, lda_info["frames"], lda_info["classes"],
             100 * sum(lda_info["eigenvalues"][:dim]) / sum(lda_info["eigenvalues"]))

    frames = sum(len(mfcc[u]) for u in tri_alis)
    sizes = resolve_sizes("lda_mllt", num_leaves, total_gauss, frames, corpus)
    log.info("lda_mllt: %d leaves, %d Gaussians at most (%.2f h of training speech)", sizes["leaves"],
             sizes["gaussians"], sizes["train_hours"])
    system, tree_summary = build_triphone_system(tri, tri_alis, utts.feats, lang, sizes["leaves"], shared_roots=True)
    (exp / "tree").write_bytes(b"\0B" + tree_summary.pop("blob"))
    alis = convert_alignments(tri_alis, tri, system)
    graphs = compile_graphs(system, lang, {u: lang.word_ids(utts.words[u]) for u in alis})
    mllt: list[dict] = []

    def update_mllt(it: int, current_alis: dict) -> bool:
        nonlocal transform
        if it not in mllt_iters:
            return False
        sys_sil, sys_pdf = silence_tids(system, lang.silence_ids), system.tid2pdf()
        ids = list(current_alis)
        ali = np.concatenate([current_alis[u] for u in ids])
        stats = accumulate_mllt_stats(system.am, np.concatenate([utts.feats[u] for u in ids]), sys_pdf[ali],
                                      np.where(sys_sil[ali], SILENCE_WEIGHT, 1.0))
        A, info = estimate_mllt(stats)
        transform_means(system.am, A)
        transform = A @ transform
        utts.feats.update({u: lda_mllt_features(x, transform) for u, x in mfcc.items()})
        mllt.append({"pass": it, **info})
        log.info("lda_mllt pass %d: MLLT objective gain %.4f per frame over %.0f frames", it,
                 info["objective_gain_per_frame"], info["frames"])
        return True

    with align_jobs(graphs, system, utts.feats):  # re-alignments in ALIGN_JOBS processes
        alis, history = train_iterations(
            system, graphs, utts, alis, num_iters, set(realign_iters), sizes["gaussians"],
            max_iter_inc=min(25, num_iters - 5), data_dir=data_dir, stage="lda_mllt", beam=beam, adapt=update_mllt,
            seed=seed,
        )
        alis = realign_all(system, graphs, utts, list(alis), data_dir, "lda_mllt", beam=beam)
    system.transform = transform
    system.save_run(exp, alis, history)
    np.save(exp / "final_mat.npy", transform)
    summary = {
        "utterances": len(alis),
        "leaves": tree_summary.get("leaves"),
        **system.info(),
        "dim": int(transform.shape[0]),
        "sizes": sizes,
        "log_like_per_frame": round(history[-1]["log_like_per_frame"], 3),
        "mllt_gain_per_frame": [round(m["objective_gain_per_frame"], 4) for m in mllt],
        "train_seconds": round(time.perf_counter() - start, 1),
    }
    log.info("lda_mllt: trained %s", summary)
    if decode:
        from local.gmm.decode import decode_system

        summary.update(decode_system(data_dir, "lda_mllt", system, lang, search=search,
                                    **({"scales": scales} if scales else {})))
    summary["seconds"] = round(time.perf_counter() - start, 1)
    (exp / "summary.json").write_text(json.dumps({**summary, "tree": tree_summary, "lda": lda_info, "mllt": mllt},
                                                 indent=1))
    return summary
