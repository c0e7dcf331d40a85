"""WER with 95 % intervals by bootstrap over utterances (Bisani and Ney, ICASSP 2004), for single
systems, means over seeds, and paired differences between systems decoded on the same utterances.

Every function takes per-utterance counts aligned on one list of utterance ids: ``errors``
``[S, U]`` (S systems or seeds, U utterances) and ``words`` ``[U]`` reference words. One
bootstrap replicate draws U utterances with replacement (the same draw for every system, which
is what makes a difference paired) and recomputes each WER as total errors / total words over
the draw. The interval is the 2.5 and 97.5 percentiles of the replicates.

With ``groups`` (a cluster id per utterance, e.g. its speaker) a replicate draws the clusters with
replacement instead, each drawn cluster bringing all its utterances (the cluster bootstrap): the
utterances of one voice share its errors, so they are not independent draws, and an interval over
utterances is too narrow for an absolute WER on a test set of few speakers. A paired difference draws
the same clusters for both systems.

With ``over_seeds=True`` a replicate also draws the S seeds with replacement (the same seed draw
for both systems of a paired difference, whose seeds are matched), so that the interval holds the
spread between trainings as well as between utterances: two trainings of the same model that
differ only in their seed (initial weights, frame order) give different WERs, and a
difference between systems smaller than that spread is not one that more test utterances can
confirm. With S = 1 it is the utterance bootstrap; with few seeds it is coarse (S = 3 has 10
distinct seed draws), and it only widens the intervals.
"""

from __future__ import annotations

import numpy as np

NUM_REPLICATES = 2000
SEED = 0


def _replicates(errors: np.ndarray, words: np.ndarray, num: int, seed: int,
                groups: np.ndarray | None = None) -> np.ndarray:
    """``[num, S]``: each system's WER (%) on ``num`` bootstrap draws of the utterances (of the
    clusters ``groups`` ``[U]``, when given)."""
    errors, words = np.atleast_2d(np.asarray(errors, np.float64)), np.asarray(words, np.float64)
    if errors.shape[1] != len(words):
        raise ValueError(f"errors cover {errors.shape[1]} utterances but words {len(words)}; "
                         "score every system on the same utterances")
    if words.sum() <= 0:
        raise ValueError("no reference words: nothing to score")
    if groups is not None:
        _, groups = np.unique(np.asarray(groups), return_inverse=True)
        if len(groups) != len(words):
            raise ValueError(f"groups name {len(groups)} utterances but words {len(words)}: one cluster id each")
    units = len(words) if groups is None else int(groups.max()) + 1
    rng = np.random.default_rng(seed)
    out = np.empty((num, errors.shape[0]))
    for start in range(0, num, 200):  # counts of each utterance (or cluster) in 200 draws at a time
        n = min(200, num - start)
        counts = rng.multinomial(units, np.full(units, 1.0 / units), size=n).astype(np.float64)
        if groups is not None:
            counts = counts[:, groups]  # an utterance is drawn as often as its cluster
        out[start : start + n] = 100.0 * (counts @ errors.T) / np.maximum(counts @ words, 1e-9)[:, None]
    return out


def _seed_mean(reps: np.ndarray, over_seeds: bool, seed: int) -> np.ndarray:
    """``[num]``: the mean over seeds (the columns of ``reps``, ``[num, S]``) of each replicate;
    with ``over_seeds``, of S seeds drawn with replacement, one draw per replicate (the same draws
    for every call with the same ``seed`` and shape, which is what pairs two systems' seeds)."""
    if not over_seeds or reps.shape[1] == 1:
        return reps.mean(1)
    draw = np.random.default_rng([seed, 1]).integers(0, reps.shape[1], size=reps.shape)
    return np.take_along_axis(reps, draw, axis=1).mean(1)


def _interval(values: np.ndarray) -> tuple[float, float]:
    lo, hi = np.percentile(values, [2.5, 97.5])
    return round(float(lo), 2), round(float(hi), 2)


def wer_interval(errors: np.ndarray, words: np.ndarray, num: int = NUM_REPLICATES, seed: int = SEED,
                 over_seeds: bool = False, groups: np.ndarray | None = None) -> dict:
    """WER of one system (``errors`` ``[U]``) or of the mean over seeds (``[S, U]``: the mean of
    the S WERs), with its 95 % interval: ``{"wer", "lo", "hi"}`` in %. ``over_seeds``: resample
    the seeds too; ``groups``: resample clusters of utterances (module docstring)."""
    errors = np.atleast_2d(np.asarray(errors, np.float64))
    wer = float((100.0 * errors.sum(1) / np.sum(words)).mean())
    lo, hi = _interval(_seed_mean(_replicates(errors, words, num, seed, groups), over_seeds, seed))
    return {"wer": round(wer, 2), "lo": lo, "hi": hi}


def paired_difference(errors_a: np.ndarray, errors_b: np.ndarray, words: np.ndarray, num: int = NUM_REPLICATES,
                      seed: int = SEED, over_seeds: bool = False, groups: np.ndarray | None = None) -> dict:
    """WER(a) − WER(b) and (WER(b) − WER(a)) / WER(a) (b's relative change against a), each with
    a paired 95 % interval. ``errors_a``/``errors_b``: ``[U]``, or ``[S, U]`` for means over S
    seeds (seed-averaged WERs compared). ``over_seeds``: resample the seeds too, row ``s`` of
    ``a`` paired with row ``s`` of ``b`` (module docstring). Returns ``{"diff", "diff_lo",
    "diff_hi", "rel_pct", "rel_lo", "rel_hi", "wer_a", "wer_b"}``."""
    a, b = np.atleast_2d(np.asarray(errors_a, np.float64)), np.atleast_2d(np.asarray(errors_b, np.float64))
    if over_seeds and len(a) != len(b):
        raise ValueError(f"over_seeds pairs seed s of a with seed s of b, but a has {len(a)} seeds and b {len(b)}; "
                         "pass the seeds both systems have, in the same order")
    reps = _replicates(np.vstack([a, b]), words, num, seed, groups)
    wer_a, wer_b = _seed_mean(reps[:, : len(a)], over_seeds, seed), _seed_mean(reps[:, len(a) :], over_seeds, seed)
    point_a = float((100.0 * a.sum(1) / np.sum(words)).mean())
    point_b = float((100.0 * b.sum(1) / np.sum(words)).mean())
    diff_lo, diff_hi = _interval(wer_a - wer_b)
    rel_lo, rel_hi = _interval(100.0 * (wer_b - wer_a) / np.maximum(wer_a, 1e-9))
    return {"wer_a": round(point_a, 2), "wer_b": round(point_b, 2), "diff": round(point_a - point_b, 2),
            "diff_lo": diff_lo, "diff_hi": diff_hi,
            "rel_pct": round(100.0 * (point_b - point_a) / max(point_a, 1e-9), 1), "rel_lo": round(rel_lo, 1),
            "rel_hi": round(rel_hi, 1)}


def per_utterance_counts(per_utt: dict[str, list[int]], ids: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """``(errors [U], words [U])`` of ``ids`` from ``{utt: [errors, words]}`` (``decode.score``);
    an id missing from ``per_utt`` is an error: systems must be scored on the same utterances."""
    missing = [u for u in ids if u not in per_utt]
    if missing:
        raise ValueError(f"{len(missing)} utterances not scored (e.g. {missing[:3]}); decode the same test set "
                         "with every system")
    return (np.array([per_utt[u][0] for u in ids], np.float64), np.array([per_utt[u][1] for u in ids], np.float64))
