"""Triphone phonetic decision tree, built the way Kaldi's ``build-tree`` builds it.

kaldi-hmm-gmm has no tree building, so this module grows the tree in numpy and hands it to
``khg.ContextDependency`` as Kaldi's binary ``ContextDependency`` blob:

1. ``accumulate_tree_stats`` (``local.gmm.tree_stats``): diagonal-Gaussian statistics (count, sum,
   sum of squares) per context event ``(left, centre, right, pdf_class)`` from transition-id
   alignments (Kaldi's ``acc-tree-stats``; phone 0 stands for the utterance boundary).
2. ``cluster_phones``: questions (sets of phones) from top-down binary clustering of the
   per-phone Gaussians; every node of the cluster tree is a question (``cluster-phones``).
3. ``build_tree``: one root per non-silence phone (and per pdf-class unless shared), greedy
   splitting of the best leaf by likelihood gain, then bottom-up merging of leaves within a
   root (``--cluster-thresh``); leaves that merge share one pdf. Silence phones get one
   leaf per pdf-class and no context.
4. The tree as ``local.gmm.event_map`` nodes, written in Kaldi's binary format and loaded into
   ``khg.ContextDependency`` (``TreeResult.tree``; ``TreeResult.blob`` is the file's bytes).

Event keys (N=3, P=1): 0 left phone, 1 centre phone, 2 right phone, -1 pdf-class.
"""

import heapq
import itertools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from local.gmm.event_map import (
    PDF_CLASS_KEY,
    Const,
    EventMap,
    Split,
    Table,
    load_context_dependency,
    map_event,
    write_context_dependency,
)
from local.gmm.tree_stats import Stats, TidTables, accumulate_tree_stats
from local.kaldi import khg

__all__ = ["TidTables", "TreeResult", "accumulate_tree_stats", "build_tree", "cluster_phones"]

log = logging.getLogger(__name__)

KEY_COLUMN = {0: 0, 1: 1, 2: 2, PDF_CLASS_KEY: 3}  # event key -> column of the event array


# ---------------------------------------------------------------- Gaussian likelihood of stats
def _stats_arrays(stats: Stats) -> tuple[np.ndarray, np.ndarray]:
    """Events ``[E, 4]`` and stacked stats ``[E, 1 + 2D]`` (count, sum, sumsq)."""
    if not stats:
        raise ValueError("no tree statistics: accumulate_tree_stats produced nothing (empty alignments?)")
    keys = sorted(stats)
    rows = [np.concatenate([[stats[k][0]], stats[k][1], stats[k][2]]) for k in keys]
    return np.asarray(keys, dtype=np.int64).reshape(-1, 4), np.asarray(rows, dtype=np.float64)


def _mean_var(s: np.ndarray, var_floor: float) -> tuple[np.ndarray, np.ndarray]:
    d = (s.shape[-1] - 1) // 2
    n = np.maximum(s[..., :1], 1e-10)
    mean = s[..., 1 : 1 + d] / n
    return mean, np.maximum(s[..., 1 + d :] / n - mean**2, var_floor)


def _loglike(s: np.ndarray, var_floor: float) -> np.ndarray:
    """Log-likelihood of stats ``[..., 1+2D]`` under their own ML diagonal Gaussian (Kaldi's Objf)."""
    d = (s.shape[-1] - 1) // 2
    _, var = _mean_var(s, var_floor)
    return -0.5 * s[..., 0] * (np.log(var).sum(-1) + d * (1.0 + np.log(2 * np.pi)))


def _cross_loglike(h: np.ndarray, t: np.ndarray, var_floor: float) -> float:
    """Log-likelihood of the frames behind stats ``h`` ``[1+2D]`` under the ML diagonal Gaussian of stats ``t``
    (held-out frames scored by the Gaussian that the training frames estimate)."""
    d = (t.shape[-1] - 1) // 2
    mean, var = _mean_var(t, var_floor)
    n, first, second = h[0], h[1 : 1 + d], h[1 + d :]
    return float(-0.5 * (n * (np.log(2 * np.pi * var).sum()) + ((second - 2 * mean * first + n * mean**2) / var).sum()))


# ---------------------------------------------------------------- questions by phone clustering
def _two_means(
    members: list[int], gauss: dict[int, np.ndarray], var_floor: float
) -> tuple[list[int], list[int]]:
    """Split phones in two, maximising the summed likelihood of both halves (local search)."""
    like = lambda group: float(_loglike(sum(gauss[p] for p in group), var_floor))
    pairs = [(a, b) for i, a in enumerate(members) for b in members[i + 1 :]]
    a, b = max(pairs, key=lambda ab: like([ab[0]]) + like([ab[1]]) - like(ab))  # most dissimilar seeds
    side = {p: int(like([b, p]) - like([b]) > like([a, p]) - like([a])) for p in members}
    side[a], side[b] = 0, 1
    for _ in range(20):
        moved = False
        for p in members:
            here = [q for q in members if side[q] == side[p]]
            there = [q for q in members if side[q] != side[p]]
            rest = [q for q in here if q != p]
            if rest and like(rest) + like([*there, p]) > like(here) + like(there):
                side[p], moved = 1 - side[p], True
        if not moved:
            break
    return [p for p in members if side[p] == 0], [p for p in members if side[p] == 1]


def cluster_phones(
    stats: Stats, phones: Sequence[int], pdf_classes: Sequence[int] = (1,), var_floor: float = 0.01
) -> list[tuple[int, ...]]:
    """Questions from top-down binary clustering of per-phone Gaussians (Kaldi's ``cluster-phones``).

    Args:
        stats: tree statistics (``accumulate_tree_stats``).
        phones: the phones to cluster (all real phones, silence included: it is a context too).
        pdf_classes: pdf-classes whose stats describe a phone (Kaldi uses the central state, 1);
            a phone with none of them uses all its stats.
        var_floor: variance floor of the likelihood.

    Returns:
        Sorted phone sets, every node of the cluster tree (the whole set and singletons included).
    """
    events, s = _stats_arrays(stats)
    gauss: dict[int, np.ndarray] = {}
    for p in phones:
        mine = events[:, 1] == p
        chosen = mine & np.isin(events[:, 3], pdf_classes)
        if mine.any():
            gauss[p] = s[chosen if chosen.any() else mine].sum(0)
    unseen = sorted(set(phones) - set(gauss))
    if unseen:
        log.warning(
            "cluster_phones: no statistics for phones %s; they only appear in the all-phones question", unseen
        )
    questions, todo = [tuple(sorted(phones))], [sorted(gauss)]
    while todo:
        group = todo.pop()
        if tuple(group) != questions[0]:
            questions.append(tuple(group))
        if len(group) > 1:
            todo.extend(_two_means(group, gauss, var_floor))
    log.info("cluster_phones: %d questions over %d phones", len(questions), len(phones))
    return questions


# ---------------------------------------------------------------- tree building
@dataclass(eq=False)
class _Node:
    """A node while the tree grows: a leaf until ``split`` is set to (key, yes_set, yes, no)."""

    events: np.ndarray  # [E, 4]
    stats: np.ndarray  # [E, 1 + 2D]
    root: int
    split: tuple | None = None
    best: tuple = (-np.inf, None, None)  # (gain, key, yes_set) of the best allowed split
    held_events: np.ndarray | None = None  # held-out speakers' events and stats (build_tree's ``heldout``)
    held_stats: np.ndarray | None = None


@dataclass
class TreeResult:
    """A built tree and what initialising the triphone GMMs needs (one Gaussian per pdf, as init-model)."""

    tree: "khg.ContextDependency"
    blob: bytes  # Kaldi binary tree, e.g. to write as exp/tri/tree
    root: EventMap
    num_pdfs: int
    counts: np.ndarray  # [num_pdfs] frames per pdf (0 for phones without data)
    means: np.ndarray  # [num_pdfs, D]
    variances: np.ndarray  # [num_pdfs, D], floored
    questions: list[tuple[int, ...]]
    summary: dict = field(default_factory=dict)

    def write(self, path: str | Path) -> None:
        """Write the tree as a Kaldi binary ``tree`` file (``\\0B`` header, then ``blob``)."""
        self.tree.write(binary=True, filename=str(path))

    def pdf_id(self, left: int, centre: int, right: int, pdf_class: int) -> int | None:
        """The pdf of a triphone state, as ``tree.compute([left, centre, right], pdf_class)`` answers.

        ``left``/``right`` are 0 at an utterance boundary; None where the tree has no answer.
        """
        return map_event(self.root, {0: left, 1: centre, 2: right, PDF_CLASS_KEY: pdf_class})


def _best_split(
    node: _Node, questions: dict[int, tuple[list, np.ndarray]], min_count: float, var_floor: float
) -> tuple:
    total = node.stats.sum(0)
    base = _loglike(total, var_floor)
    best = (-np.inf, None, None)
    for key, (sets, member) in questions.items():  # member: [Q, V] 0/1 matrix of the question sets
        per_value = np.zeros((member.shape[1], node.stats.shape[1]))
        np.add.at(per_value, node.events[:, KEY_COLUMN[key]], node.stats)
        yes = member @ per_value
        no = total - yes
        gain = _loglike(yes, var_floor) + _loglike(no, var_floor) - base
        gain[(yes[:, 0] < min_count) | (no[:, 0] < min_count)] = -np.inf
        q = int(np.argmax(gain))
        if gain[q] > best[0]:
            best = (float(gain[q]), key, sets[q])
    return best


def _membership(sets: Sequence[Sequence[int]], size: int) -> np.ndarray:
    member = np.zeros((len(sets), size))
    for i, s in enumerate(sets):
        member[i, list(s)] = 1.0
    return member


def _merge_leaves(
    sums: list[np.ndarray], cluster_thresh: float, var_floor: float
) -> tuple[list[list[int]], float]:
    """Agglomerate leaf stats ``[1 + 2D]`` while the cheapest merge loses less than ``cluster_thresh``.

    Returns the groups of leaf indices and the summed likelihood loss of the merges.
    """
    groups, sums, total_loss = [[i] for i in range(len(sums))], list(sums), 0.0
    while len(groups) > 1:
        s = np.stack(sums)
        like = _loglike(s, var_floor)
        loss = like[:, None] + like[None, :] - _loglike(s[:, None] + s[None, :], var_floor)
        loss[np.tril_indices(len(groups))] = np.inf
        i, j = np.unravel_index(int(np.argmin(loss)), loss.shape)
        if loss[i, j] >= cluster_thresh:
            break
        total_loss += float(loss[i, j])
        groups[i], sums[i] = groups[i] + groups.pop(j), sums[i] + sums.pop(j)
    return groups, total_loss


def build_tree(
    stats: Stats,
    questions: Sequence[Sequence[int]] | None,
    silence_phones: Sequence[int],
    phones: Sequence[int],
    num_pdf_classes: Mapping[int, int] | Sequence[int],
    num_leaves: int = 2000,
    min_count: float = 100.0,
    thresh: float = 300.0,
    cluster_thresh: float | None = None,
    share_pdf_classes: bool = False,
    var_floor: float = 0.01,
    heldout: Stats | None = None,
) -> TreeResult:
    """Grow a triphone tree by likelihood gain (Kaldi's ``build-tree``) and load it into khg.

    Args:
        stats: tree statistics (``accumulate_tree_stats``).
        questions: phone sets asked about the left and right phones; None clusters them
            from ``stats`` (``cluster_phones``).
        silence_phones: phones that get one leaf per pdf-class and no context questions.
        phones: every phone of the topology (the tree must answer for each).
        num_pdf_classes: pdf-classes per phone (``topo.get_phone_to_num_pdf_classes()`` or a dict).
        num_leaves: most leaves before merging (Kaldi's ``--max-leaves``), roots included.
        min_count: fewest frames on each side of a split.
        thresh: smallest log-likelihood gain of a split.
        cluster_thresh: leaves of one root merge while the merge loses less than this;
            None means ``thresh`` (Kaldi's default).
        share_pdf_classes: one root per phone with questions about the pdf-class (Kaldi's
            "shared" roots) instead of one root per phone and pdf-class.
        var_floor: variance floor of the likelihoods and of the returned variances.
        heldout: tree statistics of speakers left out of ``stats``: each split's gain is also scored on
            them (their frames under the Gaussians that ``stats`` estimates), in split order, as
            ``summary["heldout_gains"]`` (``research/gmm_stages.py --tree-heldout`` reads them).
    """
    events, s = _stats_arrays(stats)
    held = _stats_arrays(heldout) if heldout is not None else None
    phones = sorted(phones)
    bad = sorted(set(events[:, :3].ravel().tolist()) - set(phones) - {0})
    if bad or not set(events[:, 1].tolist()) <= set(phones):
        raise ValueError(
            f"stats have phones {bad or [0]} that are not in phones (0 only as a missing context); "
            "pass every phone of the topology"
        )
    classes = lambda p: int(num_pdf_classes[p])
    too_big = sorted({(c, p) for _, p, _, c in events.tolist() if not 0 <= c < classes(p)})
    if too_big:
        raise ValueError(
            f"stats have (pdf_class, phone) {too_big[:5]} outside num_pdf_classes; use the topology of the alignments"
        )
    if questions is None:
        questions = cluster_phones(stats, phones, var_floor=var_floor)
    questions = sorted({tuple(sorted(q)) for q in questions})
    width = max(phones) + 1
    ctx = (questions, _membership(questions, width))
    max_classes = max(classes(p) for p in phones)
    class_sets = [tuple(range(i + 1)) for i in range(max_classes - 1)]  # "is pdf-class <= i?"
    by_key = {0: ctx, 2: ctx}
    shared_keys = {**by_key, PDF_CLASS_KEY: (class_sets, _membership(class_sets, max_classes))}

    # 1. roots: (phone, pdf_class or None when shared); silence never splits.
    roots, leaves, heap, tie = [], [], [], itertools.count()  # tie: split order is deterministic
    for p in phones:
        shared = share_pdf_classes and p not in silence_phones
        for c in [None] if shared else range(classes(p)):
            mask = (events[:, 1] == p) & (True if c is None else events[:, 3] == c)
            node = _Node(events[mask], s[mask], len(roots))
            if held is not None:
                hmask = (held[0][:, 1] == p) & (True if c is None else held[0][:, 3] == c)
                node.held_events, node.held_stats = held[0][hmask], held[1][hmask]
            roots.append((p, c, node))
            leaves.append(node)
            if p not in silence_phones and mask.any():
                node.best = _best_split(node, shared_keys if shared else by_key, min_count, var_floor)
                heapq.heappush(heap, (-node.best[0], next(tie), node))
    if num_leaves < len(roots):
        raise ValueError(
            f"num_leaves={num_leaves} is below the {len(roots)} roots (phones x pdf-classes); raise num_leaves"
        )
    unseen = sorted({p for p, _, n in roots if len(n.events) == 0})
    if unseen:
        log.warning(
            "build_tree: no statistics for phones %s: their pdfs get the global Gaussian and count 0", unseen
        )

    # 2. greedy splitting of the best leaf while the gain exceeds thresh.
    split_gain, heldout_gains = 0.0, []
    while heap and len(leaves) < num_leaves and -heap[0][0] > thresh:
        _, _, node = heapq.heappop(heap)
        gain, key, yes_set = node.best
        is_yes = np.isin(node.events[:, KEY_COLUMN[key]], yes_set)
        yes, no = (_Node(node.events[m], node.stats[m], node.root) for m in (is_yes, ~is_yes))
        if held is not None:
            held_yes = np.isin(node.held_events[:, KEY_COLUMN[key]], yes_set)
            for child, m in ((yes, held_yes), (no, ~held_yes)):
                child.held_events, child.held_stats = node.held_events[m], node.held_stats[m]
            heldout_gains.append(sum(_cross_loglike(n.held_stats.sum(0), n.stats.sum(0), var_floor) * sign
                                     for n, sign in ((yes, 1), (no, 1), (node, -1)))
                                 if len(node.held_stats) else 0.0)
        node.split, split_gain = (key, yes_set, yes, no), split_gain + gain
        leaves.remove(node)
        keys = shared_keys if roots[node.root][1] is None else by_key
        for child in (yes, no):
            leaves.append(child)
            child.best = _best_split(child, keys, min_count, var_floor)
            heapq.heappush(heap, (-child.best[0], next(tie), child))

    # 3. bottom-up merging of leaves within each root while the loss is below cluster_thresh.
    cluster_thresh = thresh if cluster_thresh is None else cluster_thresh
    cluster_of, merge_loss, clusters = {}, 0.0, []
    for r in range(len(roots)):
        mine = [n for n in leaves if n.root == r]
        groups, loss = _merge_leaves([n.stats.sum(0) for n in mine], cluster_thresh, var_floor)
        merge_loss += loss
        for group in groups:
            for i in group:
                cluster_of[id(mine[i])] = len(clusters)
            clusters.append(sum(mine[i].stats.sum(0) for i in group))

    # 4. pdf ids in tree order (roots by phone and pdf-class, yes before no), contiguous from 0.
    pdf_of_cluster: dict[int, int] = {}

    def freeze(node: _Node) -> EventMap:
        if node.split is None:
            return Const(pdf_of_cluster.setdefault(cluster_of[id(node)], len(pdf_of_cluster)))
        key, yes_set, yes, no = node.split
        return Split(key, tuple(int(v) for v in yes_set), freeze(yes), freeze(no))

    per_phone: dict[int, EventMap] = {}
    for p in phones:
        mine = [(c, n) for q, c, n in roots if q == p]
        per_phone[p] = (
            freeze(mine[0][1])
            if mine[0][0] is None
            else Table(PDF_CLASS_KEY, tuple(freeze(n) for _, n in mine))
        )
    root = Table(1, tuple(per_phone.get(v) for v in range(width)))

    order = sorted(pdf_of_cluster, key=pdf_of_cluster.get)
    totals = np.stack([clusters[c] for c in order])
    global_mean, global_var = _mean_var(s.sum(0), var_floor)
    means, variances = _mean_var(totals, var_floor)
    empty = totals[:, 0] == 0
    means[empty], variances[empty] = global_mean, global_var
    blob = write_context_dependency(root)
    tree = load_context_dependency(blob)
    if tree.num_pdfs != len(order):
        raise RuntimeError(
            f"khg reads {tree.num_pdfs} pdfs from the tree blob, the builder made {len(order)}"
        )
    frames = float(s[:, 0].sum())
    summary = {
        "roots": len(roots),
        "leaves": len(leaves),
        "pdfs": len(order),
        "questions": len(questions),
        "split_gain_per_frame": split_gain / frames,
        "merge_loss_per_frame": merge_loss / frames,
        "frames": frames,
        **({"heldout_gains": heldout_gains, "heldout_frames": float(held[1][:, 0].sum())} if held else {}),
    }
    log.info(
        "build_tree: %d roots -> %d leaves (gain %.3f/frame) -> %d pdfs after merging (loss %.3f/frame)",
        len(roots),
        len(leaves),
        summary["split_gain_per_frame"],
        len(order),
        summary["merge_loss_per_frame"],
    )
    return TreeResult(tree, blob, root, len(order), totals[:, 0], means, variances, list(questions), summary)
