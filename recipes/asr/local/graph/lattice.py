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
one best path search per utterance, not 35 decodings.

Choosing by acoustic scale ``s`` is choosing the LM weight ``1 / s`` (Kaldi's LMWT, with acoustic
scale 1): both name the same ratio of graph to acoustic cost.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)

LATTICE_BEAM = 6.0  # Kaldi's decode.sh default
# The search beam of the lattice decoding: the recipe's best-path beam, not Kaldi's decode.sh 13. On the
# default corpus (baseline DNN, seed 0, a loaded 2-core host) beam 13 took 2.6 times beam 10's time on 150
# dev utterances for a dev WER of 9.46 % against 9.81 %, and 4.5 times on all 900 dev utterances for 4.66 %
# against 4.77 %; a lattice beam of 8 gave the same WER as 6 in 1.3 times the time. At 13 the main job's
# decoding stage would take about 10 minutes more; pass evaluate.py --beam 13 for Kaldi's setting.
LATTICE_SEARCH_BEAM = 10.0
# The scale the lattices are made at: inside the DNN's grid (local.constants), near where dev picks.
LATTICE_ACOUSTIC_SCALE = 0.125


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
    """Convert a ``kaldifst.Lattice`` (through its text form) into a :class:`WordLattice`."""
    arcs, finals = [], {}
    for line in lattice.to_str().splitlines():
        fields = line.split()
        if len(fields) == 5:
            g, a = fields[4].split(",")
            arcs.append((int(fields[0]), int(fields[1]), int(fields[3]), float(g), float(a)))
        elif len(fields) in (1, 2):
            g, a = fields[1].split(",") if len(fields) == 2 else ("0", "0")
            finals[int(fields[0])] = (float(g), float(a))
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


def best_paths(lattice: WordLattice, scales: np.ndarray, penalties: np.ndarray) -> list[list[int]]:
    """The best path's words at every grid point ``(scales[k], penalties[k])``, all in one pass.

    Returns:
        ``[K]`` lists of word ids (``[]`` where no final state is reachable).
    """
    scales, penalties = np.asarray(scales, dtype=np.float64), np.asarray(penalties, dtype=np.float64)
    k = len(scales)
    ratio = scales / lattice.scale
    has_word = (lattice.word != 0).astype(np.float64)
    arc_cost = lattice.graph[:, None] + lattice.acoustic[:, None] * ratio[None, :] + has_word[:, None] * penalties
    cost = np.full((lattice.num_states, k), np.inf)
    back = np.full((lattice.num_states, k), -1, dtype=np.int64)
    cost[0] = 0.0
    bounds = np.searchsorted(lattice.src, np.arange(lattice.num_states + 1))
    for s in range(lattice.num_states):
        lo, hi = bounds[s], bounds[s + 1]
        if lo == hi or not np.isfinite(cost[s]).any():
            continue
        for i in range(lo, hi):  # (a state has few arcs; each update is over the whole grid)
            d = lattice.dst[i]
            cand = cost[s] + arc_cost[i]
            better = cand < cost[d]
            if better.any():
                cost[d] = np.where(better, cand, cost[d])
                back[d, better] = i
    total = cost + lattice.final_graph[:, None] + lattice.final_acoustic[:, None] * ratio[None, :]
    ends = np.argmin(total, axis=0)
    out = []
    for j in range(k):
        if not np.isfinite(total[ends[j], j]):
            out.append([])
            continue
        words, s = [], ends[j]
        while s != 0:
            i = back[s, j]
            if lattice.word[i]:
                words.append(int(lattice.word[i]))
            s = lattice.src[i]
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
        out[utt_id] = from_kaldifst(raw, acoustic_scale) if ok else None
        frames += per_tid.shape[0]
    seconds = time.time() - t0
    log.info(
        "lattices of %d utterances (%d frames) in %.1f s (%.1f ms per second of audio); %d without a path",
        len(out), frames, seconds, 1000 * seconds / max(frames / 100, 1e-9), sum(v is None for v in out.values()),
    )  # fmt: skip
    return out


def grid_hypotheses(
    lattices: dict[str, WordLattice | None], scales: list[float], penalties: list[float]
) -> dict[tuple[float, float], dict[str, list[int]]]:
    """``{(scale, penalty): {utt_id: word ids}}`` over the whole grid, one pass per lattice."""
    points = [(s, p) for s in scales for p in penalties]
    s_arr, p_arr = np.array([s for s, _ in points]), np.array([p for _, p in points])
    out: dict[tuple[float, float], dict[str, list[int]]] = {pt: {} for pt in points}
    for utt_id, lattice in lattices.items():
        paths = best_paths(lattice, s_arr, p_arr) if lattice is not None else [[] for _ in points]
        for pt, words in zip(points, paths):
            out[pt][utt_id] = words
    return out
