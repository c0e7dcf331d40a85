"""Tree statistics from alignments, like Kaldi's ``acc-tree-stats``.

Diagonal-Gaussian statistics (count, sum, sum of squares) of the frames aligned to each context
event ``(left, centre, right, pdf_class)``; phone 0 stands for the utterance boundary.
"""

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from local.kaldi import khg

log = logging.getLogger(__name__)

Stats = dict[tuple[int, int, int, int], tuple[float, np.ndarray, np.ndarray]]


@dataclass(frozen=True)
class TidTables:
    """Facts per transition-id, each an int/bool array ``[num_transition_ids + 1]`` (entry 0 unused)."""

    phone: np.ndarray
    pdf_class: np.ndarray  # forward pdf-class; the self-loop's for self-loops (TransitionIdToPdfClass)
    state: np.ndarray  # transition-state
    is_final: np.ndarray  # transition into the HMM's final state
    is_self_loop: np.ndarray

    @classmethod
    def from_transition_model(cls, tm: "khg.TransitionModel") -> "TidTables":
        """Read the tables out of a transition model (any tree)."""
        n, topo = tm.num_transition_ids, tm.topo
        id2state, tuples = tm.id2state, [t.__getstate__() for t in tm.tuples]  # each property copies
        entries = {p: topo.topology_for_phone(p) for p in topo.phones}
        tables = {k: np.zeros(n + 1, dtype=np.int64) for k in ("phone", "pdf_class", "state")}
        flags = {k: np.zeros(n + 1, dtype=bool) for k in ("is_final", "is_self_loop")}
        for tid in range(1, n + 1):
            state = id2state[tid]
            phone, hmm_state = tuples[state - 1][:2]
            self_loop = tm.is_self_loop(tid)
            hmm = entries[phone][hmm_state]
            tables["phone"][tid], tables["state"][tid] = phone, state
            tables["pdf_class"][tid] = hmm.self_loop_pdf_class if self_loop else hmm.forward_pdf_class
            flags["is_final"][tid], flags["is_self_loop"][tid] = tm.is_final(tid), self_loop
        return cls(**tables, **flags)


def _phone_ends(tid: np.ndarray, tables: TidTables) -> np.ndarray:
    """``[T - 1]`` bool: a phone instance ends between frame t and t + 1 (Kaldi's SplitToPhones).

    Without reordering a state's visit is self-loops then its exit, so an instance ends right after
    the exit into the final state. Graphs built with reordered self-loops (kaldi's default) emit the
    exit first and the self-loops after it: the instance then ends after the last self-loop of the
    visit that exited into the final state. Reordering shows as an exit followed by a self-loop of
    the same state (ambiguous only for repeated one-state phones, as in Kaldi).
    """
    loop, state = tables.is_self_loop[tid], tables.state[tid]
    if not (~loop[:-1] & loop[1:] & (state[1:] == state[:-1])).any():
        return tables.is_final[tid[:-1]]
    visit = np.cumsum(~loop) - 1  # each visit of a state starts with its exit transition
    if visit[0] < 0:
        raise ValueError(
            "alignment starts with a self-loop but its self-loops are reordered; is it one alignment?"
        )
    visit_is_final = tables.is_final[tid[~loop]]
    return visit_is_final[visit[:-1]] & ~loop[1:]


def accumulate_tree_stats(
    alignments: Sequence[np.ndarray], features: Sequence[np.ndarray], tables: TidTables
) -> Stats:
    """Gaussian statistics per context event, like Kaldi's ``acc-tree-stats``.

    Args:
        alignments: per utterance, transition-ids ``[T]``.
        features: per utterance, features ``[T, D]`` of the same frames.
        tables: ``TidTables.from_transition_model(tm)``.

    Returns:
        ``{(left, centre, right, pdf_class): (count, sum [D], sum of squares [D])}``, float64;
        left/right are the neighbouring phone instances, 0 at the utterance boundaries.
    """
    if len(alignments) != len(features):
        raise ValueError(
            f"{len(alignments)} alignments but {len(features)} feature matrices; pass one of each per utterance"
        )
    stats: Stats = {}
    for i, (ali, feats) in enumerate(zip(alignments, features)):
        tid, feats = np.asarray(ali, dtype=np.int64), np.asarray(feats, dtype=np.float64)
        if len(tid) != len(feats) or len(tid) == 0:
            raise ValueError(
                f"utterance {i}: {len(tid)} alignment frames vs {len(feats)} feature frames; they must agree and be > 0"
            )
        end = _phone_ends(tid, tables)
        instance = np.concatenate([[0], np.cumsum(end)])
        phone = tables.phone[tid]
        inst_phone = phone[np.flatnonzero(np.concatenate([[True], end]))]
        left = np.concatenate([[0], inst_phone[:-1]])[instance]
        right = np.concatenate([inst_phone[1:], [0]])[instance]
        events = np.stack([left, phone, right, tables.pdf_class[tid]], axis=1)
        keys, inverse = np.unique(events, axis=0, return_inverse=True)
        order = np.argsort(inverse.ravel(), kind="stable")
        starts = np.flatnonzero(np.diff(np.concatenate([[-1], inverse.ravel()[order]])))
        counts = np.diff(np.append(starts, len(order)))
        sums, sumsq = np.add.reduceat(feats[order], starts), np.add.reduceat(feats[order] ** 2, starts)
        for k, key in enumerate(map(tuple, keys.tolist())):
            old = stats.get(key)
            stats[key] = (
                (float(counts[k]), sums[k], sumsq[k])
                if old is None
                else (old[0] + counts[k], old[1] + sums[k], old[2] + sumsq[k])
            )
    log.info("tree stats: %d context events from %d utterances", len(stats), len(alignments))
    return stats
