"""Decoding with ``khg.FasterDecoder`` on an HCLG, and Kaldi-style scoring with jiwer.

Only the best path is used (WER, and the first pass of fMLLR decoding), so the decoder is Kaldi's
``FasterDecoder`` (``gmm-decode-faster``), not ``LatticeFasterDecoder``: the same beam search
without the token links a lattice needs. On 60 test utterances of the default corpus it gave the
same words and the same transition-ids as the lattice decoder for the monophone and triphone GMMs,
in 0.39-0.40 of the time; two DNN runs decoded again (dev at 5 acoustic scales and test, 3,150
utterances each) gave the same words everywhere, in about the same time (a DNN's peaked scores keep
few tokens alive).

Used by the GMM stages (``decode_utterances_gmm``: the GMMs evaluated as one matrix product per
utterance, ``GmmScorer``; a grid of acoustic scales on one set of features evaluates them once,
``gmm_loglikes``) and by the DNN evaluation (``decode_utterances`` on
pseudo-log-likelihoods ``log p(pdf | x) - log p(pdf)``).

The decoder asks a decodable for the log-likelihood of a transition-id at a frame.
``khg.DecodableCtc(m)`` returns ``m[t, tid - 1]`` unscaled, so the per-pdf matrix is expanded
to transition-ids through the transition model's ``tid -> pdf`` table and multiplied by the
acoustic scale here (matching ``DecodableAmDiagGmmScaled`` to 1e-6, DESIGN §5).
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from local.constants import MAX_GRID_EXTENSIONS
from local.data.normalize import scored_words
from local.kaldi import kaldifst, khg

log = logging.getLogger(__name__)

# Search settings of the recipe's decodings, GMM and DNN best paths alike (Kaldi's decode.sh uses beam 13
# with 7000 active states; the DNN's lattices: local/graph/lattice.py). On the default corpus's dev set, at
# the acoustic scales dev picks (0.0588-0.0833 for the GMMs), Kaldi's search took 2.3-2.9 times as long for
# 0.8-3.1 % fewer errors (local/gmm/decode.py); the GMM stages take it with prepare.py --beam 13 --max-active 7000.
BEAM, MAX_ACTIVE = 10.0, 3000


@dataclass(frozen=True)
class Search:
    """The pruning of a GMM system's dev and test decodings (``FasterDecoder``'s beam and most active
    states per frame): the recipe's :data:`BEAM` / :data:`MAX_ACTIVE` by default, :data:`KALDI_SEARCH`
    with ``prepare.py --beam 13 --max-active 7000``. Recorded in each decoding's ``wer.json``."""

    beam: float = BEAM
    max_active: int = MAX_ACTIVE

    def __post_init__(self) -> None:
        if not (isinstance(self.beam, (int, float)) and self.beam > 0):
            raise ValueError(f"beam={self.beam!r}: give a positive number (the recipe's {BEAM:g}, Kaldi's 13)")
        if isinstance(self.max_active, bool) or not isinstance(self.max_active, int) or self.max_active < 200:
            raise ValueError(f"max_active={self.max_active!r}: give a whole number of at least 200, the decoder's "
                             f"min_active (the recipe's {MAX_ACTIVE}, Kaldi's 7000)")

    def record(self) -> dict:
        """``{"beam", "max_active"}`` for a ``wer.json``."""
        return {"beam": float(self.beam), "max_active": int(self.max_active)}

    @classmethod
    def recorded(cls, wer_json: dict) -> Search:
        """The search a ``wer.json`` records; the recipe's default for one written before it was recorded."""
        given = wer_json.get("search") or {}
        return cls(float(given.get("beam", BEAM)), int(given.get("max_active", MAX_ACTIVE)))


RECIPE_SEARCH = Search()  # the GMM stages' default
KALDI_SEARCH = Search(13.0, 7000)  # Kaldi's steps/decode.sh and decode_fmllr.sh
MIN_PARALLEL = 100  # utterances per process below which a GMM decoding stays in this process
# Most bytes of GMM log-likelihoods kept for one set of features (``gmm_loglikes``): the default corpus's
# test set takes 0.45 GB with the SAT system's 300 pdfs; a LibriSpeech dev set with 4,200 would take 30.
LOGLIKE_CACHE_BYTES = 2 << 30


def tid_to_pdf(trans_model) -> np.ndarray:
    """``[num_transition_ids]`` int64: pdf-id of transition-ids 1..N (index = tid - 1)."""
    return np.array(
        [trans_model.transition_id_to_pdf(t) for t in range(1, trans_model.num_transition_ids + 1)],
        dtype=np.int64,
    )


def _decode_all(hclg, decodables, beam: float, max_active: int, alignments: dict | None = None) -> dict:
    """Best word sequence per utterance; ``decodables`` yields ``(utt_id, num_frames, decodable)``.
    ``alignments``, if given, receives the best path's transition-ids ``[T]`` per decoded utterance.
    An utterance whose search reached no final state keeps its best partial path (Kaldi's
    ``--allow-partial``; counted as partial in the log); one where no path survived gets ``[]``."""
    options = khg.FasterDecoderOptions(beam=beam, max_active=max_active, min_active=200)
    out, failed, partial, frames, t0 = {}, [], [], 0, time.time()
    for utt_id, num_frames, decodable in decodables:
        # A new decoder (3 us) per utterance: a reused one keeps its token hash's size from earlier
        # utterances, which changes the order tokens are visited in, and so which of two paths of equal
        # cost survives. The best path then depended on what was decoded before it: CI saw the same words
        # with other transition-ids from one process and from two (tests/test_gmm.py, the tiny corpus).
        decoder = khg.FasterDecoder(hclg, options)
        decoder.decode(decodable)
        ok, best = decoder.get_best_path()
        if ok:
            ok, tids, word_ids, _ = kaldifst.get_linear_symbol_sequence(best)
        if not ok:
            failed.append(utt_id)
            out[utt_id] = []
        else:
            if not decoder.reached_final():
                partial.append(utt_id)
            if alignments is not None:
                alignments[utt_id] = np.asarray(tids, dtype=np.int64)
            out[utt_id] = list(word_ids)
        frames += num_frames
    _log_speed(len(out), failed, partial, frames, t0)
    return out


def decode_utterances(
    hclg,
    trans_model,
    utterances: Iterable[tuple[str, np.ndarray]],
    acoustic_scale: float,
    beam: float = BEAM,
    max_active: int = MAX_ACTIVE,
    alignments: dict | None = None,
) -> dict[str, list[int]]:
    """Decode per-pdf log-likelihoods.

    Args:
        hclg: the decoding graph (``graph.make_hclg``).
        trans_model: the ``khg.TransitionModel`` of the graph.
        utterances: ``(utt_id, loglik)`` with ``loglik`` ``[T, num_pdfs]`` (for a DNN:
            log posterior - log prior; for a GMM: ``gmm_loglikes``).
        acoustic_scale: multiplies the log-likelihoods (0.1 for GMMs, ~0.1-1 for DNNs).
        alignments: as in ``_decode_all``.

    Returns:
        ``{utt_id: [word ids]}``; an utterance where no path survives gets ``[]`` (logged).
    """
    tid2pdf = tid_to_pdf(trans_model)

    def decodables():
        for utt_id, loglik in utterances:
            per_tid = scaled_per_tid(utt_id, loglik, tid2pdf, trans_model.num_pdfs, acoustic_scale)
            yield utt_id, per_tid.shape[0], khg.DecodableCtc(per_tid)

    return _decode_all(hclg, decodables(), beam, max_active, alignments)


class GmmScorer:
    """Per-pdf log-likelihoods of a ``khg.AmDiagGmm`` for whole utterances: what Kaldi's
    ``DecodableAmDiagGmm`` computes frame by frame and pdf by pdf (``DiagGmm::LogLikelihoods``, then the
    log-sum-exp over each pdf's Gaussians), as one float32 matrix product per utterance."""

    def __init__(self, am) -> None:
        weights, consts, counts = [], [], []
        for pdf in range(am.num_pdfs):
            gmm = am.get_pdf(pdf)
            # log N(x) + log w = gconst + means_invvars . x - 0.5 inv_vars . x^2
            weights.append(np.hstack([np.asarray(gmm.means_invvars), -0.5 * np.asarray(gmm.inv_vars)]))
            consts.append(np.asarray(gmm.gconsts))
            counts.append(gmm.num_gauss)
        self.weights = np.ascontiguousarray(np.vstack(weights).T, dtype=np.float32)  # [2D, G]
        self.consts = np.concatenate(consts).astype(np.float32)
        self.counts = np.asarray(counts)
        self.starts = np.concatenate([[0], np.cumsum(self.counts)[:-1]])
        self.dim = self.weights.shape[0] // 2

    def __call__(self, feats: np.ndarray) -> np.ndarray:
        """``[T, D]`` features -> ``[T, num_pdfs]`` float32 log-likelihoods."""
        x = np.asarray(feats, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != self.dim:
            raise ValueError(f"features of shape {x.shape}, the GMMs model {self.dim} dimensions")
        per_gauss = np.hstack([x, x * x]) @ self.weights + self.consts  # [T, G]
        top = np.maximum.reduceat(per_gauss, self.starts, axis=1)
        sums = np.add.reduceat(np.exp(per_gauss - np.repeat(top, self.counts, axis=1)), self.starts, axis=1)
        return top + np.log(sums)


def gmm_loglikes(am, utterances: Iterable[tuple[str, np.ndarray]],
                 max_bytes: int = LOGLIKE_CACHE_BYTES) -> dict[str, np.ndarray] | None:
    """``{utt_id: [T, num_pdfs] float32}`` of ``am`` on ``utterances`` (``(utt_id, feats)``), for
    ``decode_utterances_gmm(loglikes=...)``; None when they would take more than ``max_bytes`` (a large
    dev or test set: each decoding then evaluates the GMMs itself)."""
    utterances = list(utterances)
    size = sum(len(f) for _, f in utterances) * am.num_pdfs * 4
    if size > max_bytes:
        log.info("GMM log-likelihoods of %d utterances would take %.1f GB (over %.1f): evaluated by each "
                 "decoding", len(utterances), size / 1e9, max_bytes / 1e9)
        return None
    scorer = GmmScorer(am)
    return {u: scorer(f) for u, f in utterances}


def scaled_per_tid(utt_id: str, loglik, tid2pdf: np.ndarray, num_pdfs: int, acoustic_scale: float) -> np.ndarray:
    """``[T, num_pdfs]`` per-pdf log-likelihoods -> ``[T, num_transition_ids]`` scaled by ``acoustic_scale``
    (what a ``DecodableCtc`` reads; ``tid2pdf`` from :func:`tid_to_pdf`). Raises on a wrong shape."""
    loglik = np.asarray(loglik, dtype=np.float32)
    if loglik.ndim != 2 or loglik.shape[1] != num_pdfs:
        raise ValueError(
            f"{utt_id}: log-likelihoods of shape {loglik.shape}, expected [T, {num_pdfs}] "
            "(one column per pdf of the transition model)"
        )
    return np.ascontiguousarray(acoustic_scale * loglik[:, tid2pdf])


def decode_utterances_gmm(
    hclg,
    trans_model,
    am,
    utterances: Iterable[tuple[str, np.ndarray]],
    acoustic_scale: float = 0.1,
    beam: float = BEAM,
    max_active: int = MAX_ACTIVE,
    alignments: dict | None = None,
    hclg_path: Path | str | None = None,
    num_jobs: int = 1,
    loglikes: dict[str, np.ndarray] | None = None,
) -> dict[str, list[int]]:
    """Decode GMM features: ``utterances`` yields ``(utt_id, feats [T, D])`` for ``am`` (``khg.AmDiagGmm``),
    scored by :class:`GmmScorer` (what Kaldi's ``DecodableAmDiagGmmScaled`` computes; on the default
    corpus's 1,650 test utterances, in two processes, the same words and transition-ids in 28 s against
    42 s for the monophone system and 33 s against 52 s for the triphone one);
    ``alignments`` as in ``_decode_all`` (the first pass of fMLLR decoding uses them). With
    ``num_jobs`` > 1 and ``hclg_path`` (the graph as written on disk: FSTs do not pickle), the
    utterances are decoded by that many processes (``decode_gmm_parallel``). ``loglikes``: these
    features' per-pdf log-likelihoods (:func:`gmm_loglikes`), read instead of evaluating the GMMs again
    (a grid of acoustic scales on one set of features evaluates them once)."""
    if loglikes is not None:
        utterances = [(u, loglikes[u]) for u, _ in utterances]
    if num_jobs > 1 and hclg_path is not None:
        utterances = list(utterances)
        if len(utterances) >= MIN_PARALLEL * num_jobs:  # fewer: starting the processes costs more than it saves
            return decode_gmm_parallel(hclg_path, trans_model, am, utterances, acoustic_scale, num_jobs, beam,
                                       max_active, alignments, scored=loglikes is not None)
    if loglikes is None:  # each utterance's GMMs evaluated as one product, just before it is decoded
        scorer = GmmScorer(am)
        utterances = ((u, scorer(f)) for u, f in tqdm(utterances, desc="decode", leave=False, mininterval=2.0))
    return decode_utterances(hclg, trans_model, utterances, acoustic_scale, beam, max_active, alignments)


_WORKER: dict = {}


def _gmm_worker_init(hclg_path: str, models: bytes, beam: float, max_active: int) -> None:
    import pickle

    from threadpoolctl import threadpool_limits

    from local.atomic import die_with_parent

    die_with_parent()  # a killed stage's decoding workers stop with it
    # GmmScorer's products on one BLAS thread: OpenBLAS's thread per core in each of the processes made
    # the dev set's decoding with the triphone system take 23 s against 11 s. (torch is not imported
    # here: a system's dev grid and test decoding took 77.8 s against 82.6 s with it.)
    threadpool_limits(limits=1, user_api="blas")
    tm, am = pickle.loads(models)
    _WORKER.update(hclg=kaldifst.StdVectorFst.read(hclg_path), tm=tm, am=am, beam=beam, max_active=max_active)


def _gmm_worker_decode(args: tuple[list, float, bool]) -> tuple[dict, dict]:
    utterances, scale, scored = args
    w, alis = _WORKER, {}
    if scored:
        hyps = decode_utterances(w["hclg"], w["tm"], utterances, scale, w["beam"], w["max_active"], alis)
    else:
        hyps = decode_utterances_gmm(w["hclg"], w["tm"], w["am"], utterances, scale, w["beam"], w["max_active"],
                                     alis)
    return hyps, alis


def decode_gmm_parallel(hclg_path: Path | str, trans_model, am, utterances: list[tuple[str, np.ndarray]],
                        acoustic_scale: float, num_jobs: int, beam: float = BEAM, max_active: int = MAX_ACTIVE,
                        alignments: dict | None = None, scored: bool = False) -> dict[str, list[int]]:
    """``decode_utterances_gmm`` in ``num_jobs`` spawned processes (one thread each), each reading the
    graph from ``hclg_path``; utterances are dealt round-robin (a corpus sorted by voice puts the slow
    voices together). Same results as one process, in about 1 / num_jobs of the time on idle cores.
    ``scored``: ``utterances`` holds per-pdf log-likelihoods (:func:`gmm_loglikes`), not features."""
    import multiprocessing
    import pickle
    from concurrent.futures import ProcessPoolExecutor

    t0 = time.time()
    chunks = [(utterances[j::num_jobs], acoustic_scale, scored) for j in range(num_jobs)]
    models = pickle.dumps((trans_model, am))
    # spawn: a forked child would inherit this process's OpenMP state (DESIGN section 7)
    with ProcessPoolExecutor(num_jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_gmm_worker_init,
                             initargs=(str(hclg_path), models, beam, max_active)) as pool:
        results = list(pool.map(_gmm_worker_decode, chunks))
    out = {}
    for hyps, alis in results:
        out.update(hyps)
        if alignments is not None:
            alignments.update(alis)
    log.info("decoded %d utterances in %d processes in %.1f s", len(out), num_jobs, time.time() - t0)
    return {u: out[u] for u, _ in utterances if u in out}


def _log_speed(n: int, failed: list[str], partial: list[str], frames: int, t0: float) -> None:
    secs = time.time() - t0
    log.info(
        "decoded %d utterances (%.1f s of audio) in %.1f s, RTF %.3f; %d failed%s; %d partial%s",
        n,
        frames / 100,
        secs,
        secs / max(frames / 100, 1e-9),
        len(failed),
        f" (e.g. {failed[:3]})" if failed else "",
        len(partial),
        f" (no final state reached, e.g. {partial[:3]})" if partial else "",
    )


def pick_scale(wer: Callable[[float], float], grid: Sequence[float], prefer: float,
               max_extensions: int = MAX_GRID_EXTENSIONS, bracket: bool = False) -> tuple[float, dict]:
    """The scale of ``grid`` with the lowest ``wer(scale)`` on dev (ties: the one nearest ``prefer``).

    While the best lies at an edge of the grid, the grid grows one geometric step past that edge
    (the ratio of its two outermost scales, 3 significant digits), at most ``max_extensions`` times;
    a grid of one scale is taken as given.

    ``bracket``: for a costly ``wer`` (a decoding per scale), score the grid's two middle scales, then
    walk from the better one outwards while the next scale is better, stopping at the first worse one:
    the same pick as the whole grid when dev's WER falls and then rises along the grid, with the scales
    beyond that worse one left out (``"skipped"``).

    Returns:
        the scale and ``{"grid": the scales tried, ascending, "extended": the scales added,
        "at_edge": the best is still at an edge (the bound was reached)}``, with ``bracket`` also
        ``"skipped"``: the grid's scales not tried.
    """
    grid = sorted(set(grid))
    if not grid:
        raise ValueError("an empty acoustic-scale grid; give at least one scale")
    wers: dict[float, float] = {}
    key = lambda s: (wers[s], abs(s - prefer))
    if bracket and len(grid) > 2:
        low = (len(grid) - 1) // 2
        for s in grid[low : low + 2]:
            wers[s] = wer(s)
        i, step = (low, -1) if key(grid[low]) <= key(grid[low + 1]) else (low + 1, 1)
        while 0 <= i + step < len(grid):
            wers[grid[i + step]] = wer(grid[i + step])
            if key(grid[i + step]) >= key(grid[i]):
                break
            i += step
    else:
        wers = {s: wer(s) for s in grid}
    best = lambda: min(wers, key=key)
    added = []
    while len(grid) > 1 and best() in (grid[0], grid[-1]) and len(added) < max_extensions:
        low = best() == grid[0]
        end, inner = (grid[0], grid[1]) if low else (grid[-1], grid[-2])
        new = float(f"{end * end / inner:.3g}")
        if new in wers:  # the grid's end steps are too fine for 3 digits
            break
        wers[new] = wer(new)
        grid = [new, *grid] if low else [*grid, new]
        added.append(new)
    scale = best()
    at_edge = len(grid) > 1 and scale in (grid[0], grid[-1])
    if at_edge:
        log.warning("acoustic scale %g, picked on dev, is still at the edge of %s after %d extensions; "
                    "pass a wider grid", scale, [f"{s:g}" for s in grid], len(added))
    elif added:
        log.info("acoustic scale %g picked on dev after extending the grid by %s", scale, added)
    info = {"grid": sorted(wers), "extended": added, "at_edge": at_edge}
    if bracket:
        info["skipped"] = [s for s in grid if s not in wers]
    return scale, info


def pick_penalty(wer: Callable[[float], float], penalties: Sequence[float],
                 max_extensions: int = MAX_GRID_EXTENSIONS) -> tuple[float, dict[float, float]]:
    """The word insertion penalty with the lowest ``wer(penalty)`` on dev (ties: the smallest), tried in
    ascending order and stopping at the first that is worse than the one before: a costly ``wer`` (a
    decoding per penalty) is not called past it. While the largest penalty tried is still the best, the
    grid grows one step past it (``penalty_past_edge``), at most ``max_extensions`` times. The smallest
    penalty is a bound fixed in advance (the GMM systems start at Kaldi's 0). Returns the penalty and
    ``{penalty: WER}`` of those tried."""
    penalties = sorted(set(penalties))
    if not penalties:
        raise ValueError("no word insertion penalty to try; give at least one (0 is Kaldi's neutral value)")
    wers = {penalties[0]: wer(penalties[0])}
    for before, p in itertools.pairwise(penalties):
        wers[p] = wer(p)
        if wers[p] >= wers[before]:
            break
    best = lambda: min(wers, key=lambda p: (wers[p], p))
    for _ in range(max_extensions):
        tried = sorted(wers)
        new = penalty_past_edge(tried, best()) if best() == tried[-1] else None
        if new is None:
            break
        wers[new] = wer(new)
    if len(wers) > 1 and best() == max(wers) and max(wers) not in penalties:
        log.warning("word insertion penalty %g, picked on dev, is still the largest tried (%s)", best(),
                    [f"{p:g}" for p in sorted(wers)])
    return best(), wers


def penalty_past_edge(penalties: Sequence[float], best: float) -> float | None:
    """The next word insertion penalty when dev's ``best`` is at an edge of ``penalties`` (ascending, at
    least 2): one step of the grid's outermost spacing past that edge (3 significant digits); None when
    ``best`` is inside the grid or the grid has one penalty."""
    if len(penalties) < 2 or penalties[0] < best < penalties[-1]:
        return None
    if best == penalties[-1]:
        return float(f"{2 * penalties[-1] - penalties[-2]:.3g}")
    return float(f"{2 * penalties[0] - penalties[1]:.3g}")


def pick_scale_and_penalty(rescore: Callable[[list[float], list[float]], None], wers: dict, scales: Sequence[float],
                           penalties: Sequence[float], prefer: float,
                           max_extensions: int = MAX_GRID_EXTENSIONS) -> tuple[float, float, dict]:
    """Dev's (acoustic scale, word insertion penalty) where every point is cheap (a best path through
    lattices): ``rescore(scales, penalties)`` puts the WER of every such pair into ``wers[(s, p)]``.
    The scale is ``pick_scale``'s over the best penalty's WER at each scale (the scale grid extended past
    an edge); while the best penalty there is at an edge of the penalties (either one: a penalty below 0
    is a bonus per word), they grow one step past it (``penalty_past_edge``) at every scale tried, at most
    ``max_extensions`` times, and the scale is picked again. Ties: the scale nearest ``prefer``, then the
    smallest penalty in size.

    Returns:
        the scale, the penalty and ``pick_scale``'s information, its ``grid`` every scale tried, with
        ``"penalties"`` (those tried, ascending), ``"penalties_extended"`` and ``"penalty_at_edge"``.
    """
    pens = sorted(set(penalties))
    if not pens:
        raise ValueError("no word insertion penalty to try; give at least one (0 is Kaldi's neutral value)")

    def wer(scale: float) -> float:  # the best penalty's WER at this scale
        missing = [p for p in pens if (scale, p) not in wers]
        if missing:
            rescore([scale], missing)
        return min(wers[(scale, p)] for p in pens)

    tried = sorted(set(scales))
    rescore(tried, pens)
    added: list[float] = []
    while True:  # every scale tried so far stays in the grid, so every point has every penalty
        best_scale, info = pick_scale(wer, tried, prefer=prefer, max_extensions=max_extensions)
        tried = info["grid"]
        best_penalty = min(pens, key=lambda p: (wers[(best_scale, p)], abs(p)))
        new = penalty_past_edge(pens, best_penalty)
        if new is None or len(added) == max_extensions:
            break
        added.append(new)
        pens = sorted([*pens, new])
        rescore(tried, [new])
    info["extended"] = [s for s in tried if s not in set(scales)]
    return best_scale, best_penalty, {**info, "penalties": pens, "penalties_extended": added,
                                      "penalty_at_edge": penalty_past_edge(pens, best_penalty) is not None}


def point_name(split: str, scale: float, penalty: float = 0.0) -> str:
    """The name of a GMM decoding's ``recogs-``/``errs-`` files: ``dev-acwt0.0588``, with a nonzero word
    insertion penalty ``dev-acwt0.0588-wip0.5``."""
    return f"{split}-acwt{scale:g}" + (f"-wip{penalty:g}" if penalty else "")


def words_to_text(word_ids: list[int], id2word: dict[int, str]) -> str:
    return " ".join(id2word[i] for i in word_ids)


def score(refs: dict[str, str], hyps: dict[str, str], out_dir: Path | str, name: str) -> dict:
    """WER with jiwer; writes ``recogs-{name}.txt`` and ``errs-{name}.txt`` (Kaldi/icefall style) and
    ``per_utt-{name}.json`` (``{utt: [errors, reference words]}``, for intervals: ``wer_stats``).

    Both sides are normalised with ``local.data.normalize.scored_words``: tags (``[NOISE]``, ``<UNK>``) are left
    out of both, as Kaldi's ``wer_output_filter`` and icefall do. Reference words the system cannot
    output (OOV) simply count as errors. An utterance missing from ``hyps`` counts as all deleted.

    Returns:
        ``{"wer": %, "errors", "words", "ins", "del", "sub", "utterances", "sentence_errors"}``.
    """
    import jiwer

    if not refs:
        raise ValueError(f"no reference transcripts to score for {name}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ids = sorted(refs)
    ref_words = [scored_words(refs[i]) for i in ids]
    hyp_words = [scored_words(hyps.get(i, "")) for i in ids]
    counts = {"ins": 0, "del": 0, "sub": 0, "hits": 0}
    per_utt, sent_err, utt_counts = [], 0, {}
    for i, r, h in zip(ids, ref_words, hyp_words):
        pairs = align_words(r, h, jiwer) if r else [(None, w) for w in h]
        for a, b in pairs:
            key = "ins" if a is None else "del" if b is None else "hits" if a == b else "sub"
            counts[key] += 1
        sent_err += any(a != b for a, b in pairs)
        per_utt.append(pairs)
        utt_counts[i] = [sum(a != b for a, b in pairs), len(r)]
    n_ref = sum(len(r) for r in ref_words)
    errors = counts["ins"] + counts["del"] + counts["sub"]
    result = {
        "wer": round(100.0 * errors / max(n_ref, 1), 2),
        "errors": errors,
        "words": n_ref,
        "ins": counts["ins"],
        "del": counts["del"],
        "sub": counts["sub"],
        "utterances": len(ids),
        "sentence_errors": sent_err,
    }
    summary = (
        f"%WER {result['wer']:.2f} [ {errors} / {n_ref}, {counts['ins']} ins, {counts['del']} del, "
        f"{counts['sub']} sub ]  %SER {100.0 * sent_err / len(ids):.2f} [ {sent_err} / {len(ids)} ]"
    )
    with (out_dir / f"recogs-{name}.txt").open("w") as f:
        for i, r, h in zip(ids, ref_words, hyp_words):
            f.write(f"{i}:\tref={r}\n{i}:\thyp={h}\n")
    with (out_dir / f"errs-{name}.txt").open("w") as f:
        f.write(
            f"{summary}\n\nPER-UTTERANCE DETAILS: ref -> hyp, (REF->HYP) marks an error, *** an empty side\n"
        )
        for i, pairs in zip(ids, per_utt):
            f.write(
                f"{i}:\t"
                + " ".join(a if a == b else f"({a or '***'}->{b or '***'})" for a, b in pairs)
                + "\n"
            )
    (out_dir / f"per_utt-{name}.json").write_text(json.dumps(utt_counts))
    log.info("%s: %s", name, summary)
    return result


def align_words(ref: list[str], hyp: list[str], jiwer) -> list[tuple[str | None, str | None]]:
    """Minimum-edit alignment of one utterance as ``(ref word or None, hyp word or None)`` pairs."""
    if not hyp:
        return [(w, None) for w in ref]
    out = jiwer.process_words(" ".join(ref), " ".join(hyp))
    pairs = []
    for chunk in out.alignments[0]:
        r, h = ref[chunk.ref_start_idx : chunk.ref_end_idx], hyp[chunk.hyp_start_idx : chunk.hyp_end_idx]
        if chunk.type == "insert":
            pairs += [(None, w) for w in h]
        elif chunk.type == "delete":
            pairs += [(w, None) for w in r]
        else:  # equal / substitute: same length on both sides
            pairs += list(zip(r, h))
    return pairs
