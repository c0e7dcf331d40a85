"""WER with 95 % intervals by bootstrap over utterances (Bisani and Ney, ICASSP 2004), for single
systems, means over seeds, and paired differences between systems decoded on the same utterances.

Every function takes per-utterance counts aligned on one list of utterance ids: ``errors``
``[S, U]`` (S systems or seeds, U utterances) and ``words`` ``[U]`` reference words. One
bootstrap replicate draws U utterances with replacement (the same draw for every system, which
is what makes a difference paired) and recomputes each WER as total errors / total words over
the draw. The interval is the 2.5 and 97.5 percentiles of the replicates.
"""

from __future__ import annotations

import numpy as np

NUM_REPLICATES = 2000
SEED = 0


def _replicates(errors: np.ndarray, words: np.ndarray, num: int, seed: int) -> np.ndarray:
    """``[num, S]``: each system's WER (%) on ``num`` bootstrap draws of the utterances."""
    errors, words = np.atleast_2d(np.asarray(errors, np.float64)), np.asarray(words, np.float64)
    if errors.shape[1] != len(words):
        raise ValueError(f"errors cover {errors.shape[1]} utterances but words {len(words)}; "
                         "score every system on the same utterances")
    if words.sum() <= 0:
        raise ValueError("no reference words: nothing to score")
    rng = np.random.default_rng(seed)
    out = np.empty((num, errors.shape[0]))
    for start in range(0, num, 200):  # counts of each utterance in 200 draws at a time
        n = min(200, num - start)
        counts = rng.multinomial(len(words), np.full(len(words), 1.0 / len(words)), size=n).astype(np.float64)
        out[start : start + n] = 100.0 * (counts @ errors.T) / (counts @ words)[:, None]
    return out


def _interval(values: np.ndarray) -> tuple[float, float]:
    lo, hi = np.percentile(values, [2.5, 97.5])
    return round(float(lo), 2), round(float(hi), 2)


def wer_interval(errors: np.ndarray, words: np.ndarray, num: int = NUM_REPLICATES, seed: int = SEED) -> dict:
    """WER of one system (``errors`` ``[U]``) or of the mean over seeds (``[S, U]``: the mean of
    the S WERs), with its 95 % interval: ``{"wer", "lo", "hi"}`` in %."""
    errors = np.atleast_2d(np.asarray(errors, np.float64))
    wer = float((100.0 * errors.sum(1) / np.sum(words)).mean())
    lo, hi = _interval(_replicates(errors, words, num, seed).mean(1))
    return {"wer": round(wer, 2), "lo": lo, "hi": hi}


def paired_difference(errors_a: np.ndarray, errors_b: np.ndarray, words: np.ndarray, num: int = NUM_REPLICATES,
                      seed: int = SEED) -> dict:
    """WER(a) − WER(b) and (WER(b) − WER(a)) / WER(a) (b's relative change against a), each with
    a paired 95 % interval. ``errors_a``/``errors_b``: ``[U]``, or ``[S, U]`` for means over S
    seeds (seed-averaged WERs compared). Returns ``{"diff", "diff_lo", "diff_hi", "rel_pct",
    "rel_lo", "rel_hi", "wer_a", "wer_b"}``."""
    a, b = np.atleast_2d(np.asarray(errors_a, np.float64)), np.atleast_2d(np.asarray(errors_b, np.float64))
    reps = _replicates(np.vstack([a, b]), words, num, seed)
    wer_a, wer_b = reps[:, : len(a)].mean(1), reps[:, len(a) :].mean(1)
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
