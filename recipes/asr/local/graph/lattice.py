"""Word lattices, and the LM weight and word insertion penalty chosen on them without decoding again.

Kaldi's ``score.sh`` decodes once into lattices, then for each LM weight and insertion penalty takes
the lattice's best path (``lattice-scale --inv-acoustic-scale``, ``lattice-add-penalty``,
``lattice-best-path``) and scores it. Here the lattices come from ``kaldi_decoder``'s
``LatticeSimpleDecoder`` (Kaldi's ``LatticeSimpleDecoder``, the one Python binding found that returns
a lattice: ``kaldi-hmm-gmm``'s lattice decoders return only the best path): its raw lattice, with
transition-ids on the input side, words on the output side and a (graph cost, acoustic cost) pair on
every arc, the acoustic cost at the scale the decoder used. A grid point ``(s, p)`` weighs an arc
``graph + acoustic * s / s_decode + p * [arc has a word]``; the best path of every grid point comes
from one pass over the lattice (:func:`best_paths`, all points at once), so a grid of 35 costs about
one best path search per utterance, not 35 decodings. :func:`grid_hypotheses` searches
:data:`BATCH` lattices side by side (:func:`batch_best_paths`: array operations per generation of
states rather than Python steps per arc), with the same choices, ties included.

Choosing by acoustic scale ``s`` is choosing the LM weight ``1 / s`` (Kaldi's LMWT, with acoustic
scale 1): both name the same ratio of graph to acoustic cost.

:class:`LmRescorer` swaps the first-pass LM for a larger one on every path before the grid (Kaldi's
``lmrescore.sh``); :func:`best_paths` then follows (state, LM history) pairs.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

LATTICE_BEAM = 6.0  # Kaldi's decode.sh default
# The search beam of the lattice decoding: 13, Kaldi's decode.sh default. On corpus version 4's four DNN runs
# (seeds 0 and 1, baseline and gtc, 8 epochs; the same models decoded at each beam) the mean dev WER is
# 6.62 / 6.42 / 6.35 % at beams 10 / 12 / 13 (docs/experiments/dnn_epochs_beams.md). With glibc's malloc beam 13
# made the main job's decoding stage 6:09 and left no margin under 30 minutes; run.sh decodes with jemalloc
# preloaded, which makes the stage 0.68 times as long (3:21 against 4:57 for two runs, paired), and beam 13
# fits. A lattice beam of 8 gave the same WER as 6 in 1.3 times the time.
LATTICE_SEARCH_BEAM = 13.0
# The scale the lattices are made at: inside the DNN's grid (local.constants), near where dev picks.
LATTICE_ACOUSTIC_SCALE = 0.125
# Lattices searched together (batch_best_paths): enough to share each pass over a generation of states,
# few enough to keep the grid's arrays (states x grid points) to some 100 MB.
BATCH = 128


@dataclass
class WordLattice:
    """A raw lattice as arrays, states renumbered in topological order (start = 0), arcs sorted by
    their source state.

    Attributes:
        src, dst: ``[A]`` int64 states of each arc.
        word: ``[A]`` int64 output label (0: no word).
        graph, acoustic: ``[A]`` float64 costs (acoustic at ``scale``).
        final_graph, final_acoustic: ``[S]`` float64 final costs (``inf``: not final).
        scale: the acoustic scale the decoder used.
    """

    src: np.ndarray
    dst: np.ndarray
    word: np.ndarray
    graph: np.ndarray
    acoustic: np.ndarray
    final_graph: np.ndarray
    final_acoustic: np.ndarray
    scale: float

    @property
    def num_states(self) -> int:
        return len(self.final_graph)


def from_kaldifst(lattice, scale: float) -> WordLattice:
    """Convert a ``kaldifst.Lattice`` (through its text form) into a :class:`WordLattice`.

    OpenFst's text leaves out a weight that is One: an arc ``src dst ilabel olabel`` (4 fields; in a
    raw lattice a word arc without input whose graph cost is 0) costs (0, 0), as does a final state
    written alone."""
    arcs, finals = [], {}
    for line in lattice.to_str().splitlines():
        fields = line.split()
        if len(fields) in (4, 5):
            g, a = fields[4].split(",") if len(fields) == 5 else ("0", "0")
            arcs.append((int(fields[0]), int(fields[1]), int(fields[3]), float(g), float(a)))
        elif len(fields) in (1, 2):
            g, a = fields[1].split(",") if len(fields) == 2 else ("0", "0")
            finals[int(fields[0])] = (float(g), float(a))
        elif fields:
            raise ValueError(f"a lattice line of {len(fields)} fields: {line!r}; expected an arc (4 or 5) or a final "
                             "state (1 or 2)")
    states = 1 + max([lattice.start, *finals, *(a[0] for a in arcs), *(a[1] for a in arcs)])
    out_arcs: list[list[int]] = [[] for _ in range(states)]
    indegree = np.zeros(states, dtype=np.int64)
    for i, (s, d, *_) in enumerate(arcs):
        out_arcs[s].append(i)
        indegree[d] += 1
    # Kahn's topological sort from the start state (states not reachable from it are dropped)
    rank = np.full(states, -1, dtype=np.int64)
    queue, order = deque([lattice.start]), []
    while queue:
        s = queue.popleft()
        rank[s] = len(order)
        order.append(s)
        for i in out_arcs[s]:
            d = arcs[i][1]
            indegree[d] -= 1
            if indegree[d] == 0:
                queue.append(d)
    if any(indegree[s] > 0 for s in order):
        raise ValueError("the lattice has a cycle; expected the acyclic raw lattice of a decoder")
    kept = [i for s in order for i in out_arcs[s] if rank[arcs[i][1]] >= 0]
    arr = np.array([arcs[i] for i in kept], dtype=np.float64).reshape(-1, 5)
    final_graph = np.full(len(order), np.inf)
    final_acoustic = np.full(len(order), np.inf)
    for s, (g, a) in finals.items():
        if rank[s] >= 0:
            final_graph[rank[s]], final_acoustic[rank[s]] = g, a
    return WordLattice(
        src=rank[arr[:, 0].astype(np.int64)], dst=rank[arr[:, 1].astype(np.int64)], word=arr[:, 2].astype(np.int64),
        graph=arr[:, 3], acoustic=arr[:, 4], final_graph=final_graph, final_acoustic=final_acoustic, scale=scale,
    )  # fmt: skip


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``concatenate([arange(s, s + c) for s, c in zip(starts, counts)])`` without the loop."""
    total = int(counts.sum())
    if not total:
        return np.zeros(0, dtype=np.int64)
    shift = np.repeat(starts - (np.cumsum(counts) - counts), counts)
    return shift + np.arange(total, dtype=np.int64)


def _csr(src: np.ndarray, num_states: int) -> tuple[np.ndarray, np.ndarray]:
    """Arcs by source state: ``(arc order: by source, then as given; first arc of each state)``."""
    order = np.argsort(src, kind="stable")
    first = np.concatenate([[0], np.cumsum(np.bincount(src, minlength=num_states))])
    return order, first


def best_paths(lattice: WordLattice, scales: np.ndarray, penalties: np.ndarray,
               rescorer: LmRescorer | None = None) -> list[list[int]]:
    """The best path's words at every grid point ``(scales[k], penalties[k])``, all in one pass;
    with ``rescorer``, under its larger LM (:class:`LmRescorer`).

    Returns:
        ``[K]`` lists of word ids (``[]`` where no final state is reachable).
    """
    scales, penalties = np.asarray(scales, dtype=np.float64), np.asarray(penalties, dtype=np.float64)
    if rescorer is not None:
        ratio = scales / lattice.scale
        has_word = (lattice.word != 0).astype(np.float64)
        arc_cost = lattice.graph[:, None] + lattice.acoustic[:, None] * ratio[None, :] + has_word[:, None] * penalties
        final = lattice.final_graph[:, None] + lattice.final_acoustic[:, None] * ratio[None, :]
        return _rescored_best_paths(lattice, arc_cost, final, rescorer)
    return batch_best_paths([lattice], scales, penalties)[0]


def batch_best_paths(lattices: list[WordLattice], scales: np.ndarray, penalties: np.ndarray) -> list[list[list[int]]]:
    """:func:`best_paths` of many lattices side by side: ``[lattice][grid point]`` word ids.

    A path's cost at a point weighs an arc ``graph + acoustic * scale / lattice.scale + penalty * [word]``.
    Each state keeps, per point, the least ``cost of its source + cost of the arc`` over its incoming
    arcs and, among arcs that tie, the first in the lattice's arc order; the best final state is the
    first (in state order) of least ``cost + final cost``. Those are the choices of a sweep over the arcs
    in order, whatever the order the arcs are relaxed in, so the lattices are relaxed together one
    generation of states at a time (a state once all its incoming arcs are relaxed), and the paths are
    traced back together, a step per pass."""
    scales, penalties = np.asarray(scales, dtype=np.float64), np.asarray(penalties, dtype=np.float64)
    k, n = len(scales), len(lattices)
    if not n:
        return []
    sizes = np.array([lat.num_states for lat in lattices], dtype=np.int64)
    offset = np.concatenate([[0], np.cumsum(sizes)])
    num = int(offset[-1])
    arc_counts = np.array([lat.src.size for lat in lattices], dtype=np.int64)
    arc_owner = np.repeat(np.arange(n), arc_counts)
    src = np.concatenate([lat.src for lat in lattices]) + offset[arc_owner]
    dst = np.concatenate([lat.dst for lat in lattices]) + offset[arc_owner]
    word = np.concatenate([lat.word for lat in lattices])
    graph = np.concatenate([lat.graph for lat in lattices])
    acoustic = np.concatenate([lat.acoustic for lat in lattices])
    has_word = (word != 0).astype(np.float64)
    ratio = np.stack([scales / lat.scale for lat in lattices])  # [lattice, point]
    none = np.iinfo(np.int64).max
    cost = np.full((num, k), np.inf)
    back = np.full((num, k), none, dtype=np.int64)
    starts = offset[:-1][sizes > 0]
    cost[starts] = 0.0
    order, first = _csr(src, num)
    indegree = np.bincount(dst, minlength=num)
    frontier = np.flatnonzero(indegree == 0)  # the starts, and any state the start does not reach (cost inf)
    while frontier.size:
        arcs = order[_ranges(first[frontier], first[frontier + 1] - first[frontier])]
        if not arcs.size:
            break
        arcs = arcs[np.argsort(dst[arcs], kind="stable")]  # by head, each head's arcs in their order
        heads = dst[arcs]
        group = np.flatnonzero(np.concatenate([[True], heads[1:] != heads[:-1]]))
        unique = heads[group]
        # the arc costs as best_paths has always computed them: graph + acoustic * ratio + penalty * [word]
        arc_cost = graph[arcs, None] + acoustic[arcs, None] * ratio[arc_owner[arcs]] + has_word[arcs, None] * penalties
        cand = cost[src[arcs]] + arc_cost
        count = np.diff(np.append(group, arcs.size))  # incoming arcs of each head in this pass
        low = np.minimum.reduceat(cand, group, axis=0)
        before = cost[unique]
        after = np.minimum(before, low)
        cost[unique] = after
        tied = np.where(cand == np.repeat(after, count, axis=0), arcs[:, None], none)
        kept = np.where(after < before, none, back[unique])  # a lower cost: the old arc lost
        back[unique] = np.minimum(kept, np.minimum.reduceat(tied, group, axis=0))
        indegree[unique] -= count
        frontier = unique[indegree[unique] == 0]
    # per lattice and point: the first state of least total cost (np.argmin's choice); only final states count
    all_final_graph = np.concatenate([lat.final_graph for lat in lattices])
    finals = np.flatnonzero(np.isfinite(all_final_graph))
    final_owner = np.searchsorted(offset, finals, side="right") - 1
    final_graph = all_final_graph[finals, None]
    final_acoustic = np.concatenate([lat.final_acoustic for lat in lattices])[finals, None] * ratio[final_owner]
    total = cost[finals] + final_graph + final_acoustic
    best = np.full((n, k), np.inf)
    ends = np.full((n, k), none, dtype=np.int64)
    if finals.size:
        bounds = np.flatnonzero(np.concatenate([[True], final_owner[1:] != final_owner[:-1]]))
        owners = final_owner[bounds]
        best[owners] = np.minimum.reduceat(total, bounds, axis=0)
        is_best = total == best[final_owner]
        ends[owners] = np.minimum.reduceat(np.where(is_best, finals[:, None], none), bounds, axis=0)
    found = np.isfinite(best)
    # trace back every (lattice, point) together: one arc per pass, words collected last to first
    row, col = np.nonzero(found)
    cur = ends[row, col]
    start_of = offset[row]
    steps: list[tuple[np.ndarray, np.ndarray]] = []  # (which path, word) per pass, words != 0
    path_id = row * k + col
    while cur.size:
        live = cur != start_of
        cur, start_of, path_id = cur[live], start_of[live], path_id[live]
        if not cur.size:
            break
        arc = back[cur, path_id % k]
        w = word[arc]
        has = w != 0
        steps.append((path_id[has], w[has]))
        cur = src[arc]
    out = [[[] for _ in range(k)] for _ in range(n)]
    ids = np.concatenate([p for p, _ in steps]) if steps else np.zeros(0, dtype=np.int64)
    if ids.size:
        words = np.concatenate([w for _, w in steps])
        step = np.concatenate([np.full(p.size, i) for i, (p, _) in enumerate(steps)])
        by_path = np.lexsort((-step, ids))
        ids, words = ids[by_path], words[by_path]
        cuts = np.flatnonzero(np.diff(ids)) + 1
        for group_ids, group_words in zip(np.split(ids, cuts), np.split(words, cuts)):
            pid = int(group_ids[0])
            out[pid // k][pid % k] = group_words.tolist()
    return out


class LmRescorer:
    """Replaces the first-pass LM's cost on every lattice path by a larger LM's (Kaldi's
    ``lmrescore.sh``: ``lattice-lmrescore`` with the old G at scale -1, then with the new LM).

    A path's graph cost is its HMM transition costs plus the first-pass LM's cost of its words (G's
    arcs, ``-ln 10 * log10 p`` from ``lm.arpa``, ``</s>`` in G's final weights). The rescored path
    weighs ``graph + ln 10 * (log10 p_old(words) - log10 p_new(words))`` instead: the difference is
    added word by word, knowing each word's history, by :func:`best_paths` (``rescorer``), which then
    follows (lattice state, LM history) pairs: the exact best path under the new LM, not an n-best
    approximation. As in Kaldi, G's cost of a word sequence is taken to be the ARPA's (it is lower where
    a back-off path through G undercuts an n-gram the ARPA has, which both then leave in).

    Args:
        old_arpa: the first-pass LM (the data dir's ``lang/lm.arpa``, which G was compiled from).
        new_arpa: the larger LM, over every word of the graph (``local.graph.lm.make_rescore_lm``).
        id2word: the lattice's word ids -> words (``lang/words.txt``).
    """

    def __init__(self, old_arpa: Path | str, new_arpa: Path | str, id2word: dict[int, str]) -> None:
        from local.graph.lm import BOS, EOS, ArpaLM

        self.old, self.new = ArpaLM(old_arpa), ArpaLM(new_arpa)
        missing = sorted(set(self.old.vocab) - set(self.new.vocab))
        if missing:
            raise ValueError(
                f"the rescoring LM {new_arpa} lacks {len(missing)} word(s) the graph can output, e.g. "
                f"{', '.join(missing[:5])}; estimate it over the graph's vocabulary (make_rescore_lm, or "
                "SRILM/KenLM with lang/words.txt as the vocabulary)")
        known = set(self.old.vocab)
        self.words = {i: w for i, w in id2word.items() if w in known}
        self.words[0] = EOS  # (word id 0 on an arc: no word; here it stands for the end of the sentence)
        self.start = (BOS,)
        self.history = max(self.old.order, self.new.order) - 1
        self._cost: dict[tuple, float] = {}

    def cost(self, history: tuple, word: int) -> float:
        """The change of graph cost when ``word`` (0: ``</s>``) follows ``history`` (words as strings)."""
        key = (history, word)
        if key not in self._cost:
            w = self.words[word]
            self._cost[key] = LN10 * (self.old.logprob(w, history) - self.new.logprob(w, history))
        return self._cost[key]

    def extend(self, history: tuple, word: int) -> tuple:
        return (history + (self.words[word],))[-self.history :] if self.history else ()


LN10 = float(np.log(10.0))


def _rescored_best_paths(lattice: WordLattice, arc_cost: np.ndarray, final: np.ndarray,
                         rescorer: LmRescorer) -> list[list[int]]:
    """:func:`best_paths` over (lattice state, LM history) pairs, with ``rescorer``'s cost changes.

    A state's histories are those of the paths reaching it; they change only on word arcs, so the
    states of a stretch without words share one tuple of histories and one row order, and an arc
    without a word updates all its rows at once (``[H, K]`` arrays)."""
    n, k = lattice.num_states, arc_cost.shape[1]
    bounds = np.searchsorted(lattice.src, np.arange(n + 1))
    hists: list = [None] * n  # each state's histories, a tuple shared along a stretch without words
    hists[0] = (rescorer.start,)
    rows: dict[int, tuple[tuple, dict]] = {}  # id(histories) -> (histories (kept alive), {history: row})

    def row_of(h: tuple) -> dict:
        if id(h) not in rows:
            rows[id(h)] = (h, {x: r for r, x in enumerate(h)})
        return rows[id(h)][1]

    for s in range(n):  # 1: the histories of every state (topological order: all arcs into s come first)
        for i in range(bounds[s], bounds[s + 1]):
            d, w = int(lattice.dst[i]), int(lattice.word[i])
            came = hists[s] if not w else tuple(dict.fromkeys(rescorer.extend(h, w) for h in hists[s]))
            if hists[d] is None or hists[d] is came:
                hists[d] = came
            elif any(h not in row_of(hists[d]) for h in came):
                hists[d] = tuple(dict.fromkeys(hists[d] + came))
    cost = [np.full((len(h), k), np.inf) if h is not None else None for h in hists]
    back_arc = [np.full((len(h), k), -1, dtype=np.int64) if h is not None else None for h in hists]
    back_row = [np.full((len(h), k), -1, dtype=np.int64) if h is not None else None for h in hists]
    cost[0][0] = 0.0
    for s in range(n):  # 2: the best path to every (state, history), at every grid point
        if hists[s] is None:
            continue
        for i in range(bounds[s], bounds[s + 1]):
            d, w = int(lattice.dst[i]), int(lattice.word[i])
            if not w:
                cand = cost[s] + arc_cost[i]
                if hists[d] is hists[s]:  # the same rows
                    better = cand < cost[d]
                    cost[d] = np.where(better, cand, cost[d])
                    back_arc[d][better] = i
                    back_row[d] = np.where(better, np.arange(len(hists[s]))[:, None], back_row[d])
                    continue
                targets = [(r, row_of(hists[d])[h], cand[r]) for r, h in enumerate(hists[s])]
            else:
                targets = [(r, row_of(hists[d])[rescorer.extend(h, w)], cost[s][r] + arc_cost[i] + rescorer.cost(h, w))
                           for r, h in enumerate(hists[s])]  # fmt: skip
            for r, t, c in targets:
                better = c < cost[d][t]
                if better.any():
                    cost[d][t] = np.where(better, c, cost[d][t])
                    back_arc[d][t, better], back_row[d][t, better] = i, r
    best, end = np.full(k, np.inf), [(-1, -1)] * k
    for s in np.nonzero(np.isfinite(final).any(axis=1))[0]:
        if hists[s] is None:
            continue
        total = cost[s] + final[s] + np.array([rescorer.cost(h, 0) for h in hists[s]])[:, None]
        r = np.argmin(total, axis=0)
        for j in np.nonzero(total[r, np.arange(k)] < best)[0]:
            best[j], end[j] = total[r[j], j], (int(s), int(r[j]))
    out = []
    for j in range(k):
        if not np.isfinite(best[j]):
            out.append([])
            continue
        words, (s, r) = [], end[j]
        while s != 0:
            i = back_arc[s][r, j]
            if lattice.word[i]:
                words.append(int(lattice.word[i]))
            s, r = int(lattice.src[i]), int(back_row[s][r, j])
        out.append(words[::-1])
    return out


def decode_lattices(
    hclg,
    trans_model,
    utterances: Iterable[tuple[str, np.ndarray]],
    acoustic_scale: float,
    beam: float,
    lattice_beam: float = LATTICE_BEAM,
) -> dict[str, WordLattice | None]:
    """Decode per-pdf log-likelihoods ``[T, num_pdfs]`` into word lattices (``None`` where no path
    survived the beam: it scores as an empty hypothesis)."""
    import kaldi_decoder

    from local.graph.decode import scaled_per_tid, tid_to_pdf

    tid2pdf = tid_to_pdf(trans_model)
    config = kaldi_decoder.LatticeSimpleDecoderConfig(beam=beam, lattice_beam=lattice_beam)
    out, frames, t0 = {}, 0, time.time()
    for utt_id, loglik in utterances:
        per_tid = scaled_per_tid(utt_id, loglik, tid2pdf, trans_model.num_pdfs, acoustic_scale)
        decoder = kaldi_decoder.LatticeSimpleDecoder(hclg, config)
        decoder.decode(kaldi_decoder.DecodableCtc(per_tid))
        ok, raw = decoder.get_raw_lattice()
        lattice = from_kaldifst(raw, acoustic_scale) if ok else None
        # no final state reachable from the start: no complete path, an empty hypothesis (counted below)
        out[utt_id] = lattice if lattice is not None and np.isfinite(lattice.final_graph).any() else None
        frames += per_tid.shape[0]
    seconds = time.time() - t0
    log.info(
        "lattices of %d utterances (%d frames) in %.1f s (%.1f ms per second of audio); %d without a path",
        len(out), frames, seconds, 1000 * seconds / max(frames / 100, 1e-9), sum(v is None for v in out.values()),
    )  # fmt: skip
    return out


def grid_hypotheses(
    lattices: dict[str, WordLattice | None], scales: list[float], penalties: list[float],
    rescorer: LmRescorer | None = None,
) -> dict[tuple[float, float], dict[str, list[int]]]:
    """``{(scale, penalty): {utt_id: word ids}}`` over the whole grid, one pass per lattice (with
    ``rescorer``: under its larger LM)."""
    points = [(s, p) for s in scales for p in penalties]
    s_arr, p_arr = np.array([s for s, _ in points]), np.array([p for _, p in points])
    out: dict[tuple[float, float], dict[str, list[int]]] = {pt: {} for pt in points}
    items = list(lattices.items())
    for first in range(0, len(items), BATCH):
        batch = items[first : first + BATCH]
        found = [(u, lat) for u, lat in batch if lat is not None]
        if rescorer is not None:
            paths = [best_paths(lat, s_arr, p_arr, rescorer) for _, lat in found]
        else:
            paths = batch_best_paths([lat for _, lat in found], s_arr, p_arr)
        by_utt = dict(zip((u for u, _ in found), paths))
        for utt_id, _ in batch:
            for j, pt in enumerate(points):
                out[pt][utt_id] = by_utt[utt_id][j] if utt_id in by_utt else []
    return out
