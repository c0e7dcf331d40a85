"""Triphone decision tree: Kaldi's binary tree format, likelihood-gain splitting, khg integration."""

import itertools

import numpy as np
import pytest
from local.gmm.event_map import (
    PDF_CLASS_KEY,
    Const,
    Split,
    Table,
    context_dependency_blob,
    load_context_dependency,
    parse_event_map,
    write_context_dependency,
)
from local.gmm.tree import TidTables, accumulate_tree_stats, build_tree, cluster_phones
from local.kaldi import kaldifst, khg

SIL, PHONES = 1, [1, 2, 3, 4, 5, 6]
NUM_CLASSES = {1: 5, 2: 3, 3: 3, 4: 3, 5: 3, 6: 3}
CONTEXTS = [0, *PHONES]


def topology(phones: list[int], sil: int) -> "khg.HmmTopology":
    """3-state left-to-right phones and a 5-state silence, in Kaldi's topology text."""
    lines = ["<Topology>", "<TopologyEntry>", "<ForPhones> " + " ".join(str(p) for p in phones if p != sil)]
    lines += ["</ForPhones>"]
    lines += [
        f"<State> {i} <PdfClass> {i} <Transition> {i} 0.75 <Transition> {i + 1} 0.25 </State>"
        for i in range(3)
    ]
    lines += ["<State> 3 </State>", "</TopologyEntry>", "<TopologyEntry>", f"<ForPhones> {sil} </ForPhones>"]
    for i in range(4):
        arcs = "".join(f"<Transition> {j} 0.25 " for j in ([0, 1, 2, 3] if i == 0 else [1, 2, 3, 4]))
        lines.append(f"<State> {i} <PdfClass> {i} {arcs}</State>")
    lines += ["<State> 4 <PdfClass> 4 <Transition> 4 0.75 <Transition> 5 0.25 </State>", "<State> 5 </State>"]
    topo = khg.HmmTopology()
    topo.read("\n".join(lines + ["</TopologyEntry>", "</Topology>"]) + "\n")
    return topo


def planted_stats(seed: int = 0, frames: int = 50, dim: int = 4, shifted_right=(4, 5)) -> dict:
    """Gaussian stats where phone 3's frames move by +3 in dim 2 when the right phone is in ``shifted_right``."""
    rng = np.random.default_rng(seed)
    stats = {}
    for left, centre, right in itertools.product(CONTEXTS, PHONES, CONTEXTS):
        for k in range(NUM_CLASSES[centre]):
            mean = np.zeros(dim)
            mean[0], mean[1] = centre, k
            if centre == 3 and right in shifted_right:
                mean[2] += 3.0
            x = rng.normal(mean, 1.0, size=(frames, dim))
            stats[(left, centre, right, k)] = (float(frames), x.sum(0), (x**2).sum(0))
    return stats


def splits(node) -> list[tuple[int, tuple[int, ...]]]:
    """All (key, yes_set) questions asked in a tree."""
    if isinstance(node, Split):
        return [(node.key, node.yes_set), *splits(node.yes), *splits(node.no)]
    if isinstance(node, Table):
        return [q for e in node.entries if e is not None for q in splits(e)]
    return []


def pdfs_in(node) -> set[int]:
    if isinstance(node, Const):
        return {node.pdf}
    children = [node.yes, node.no] if isinstance(node, Split) else [e for e in node.entries if e is not None]
    return set().union(*(pdfs_in(c) for c in children))


def test_writer_reproduces_kaldi_monophone_blob_byte_for_byte():
    topo = topology(PHONES, SIL)
    mono = khg.monophone_context_dependency(
        phones=PHONES, phone2num_pdf_classes=topo.get_phone_to_num_pdf_classes()
    )
    blob = context_dependency_blob(mono)
    pdf = itertools.count()
    by_hand = Table(
        0,
        (
            None,
            *(Table(PDF_CLASS_KEY, tuple(Const(next(pdf)) for _ in range(NUM_CLASSES[p]))) for p in PHONES),
        ),
    )
    assert write_context_dependency(by_hand, context_width=1, central_position=0) == blob
    assert parse_event_map(blob) == (1, 0, by_hand)


def test_split_event_map_round_trips_through_khg():
    root = Table(
        1,
        (
            None,
            Table(PDF_CLASS_KEY, (Split(2, (1, 3), Const(0), Split(0, (2,), Const(1), Const(2))), Const(3))),
        ),
    )
    blob = write_context_dependency(root)
    tree = load_context_dependency(blob)
    assert context_dependency_blob(tree) == blob
    assert (tree.context_width, tree.central_position, tree.num_pdfs) == (3, 1, 4)
    assert tree.compute([0, 1, 3], 0) == (True, 0)
    assert tree.compute([2, 1, 2], 0) == (True, 1)
    assert tree.compute([0, 1, 0], 0) == (True, 2)
    assert tree.compute([2, 1, 2], 1) == (True, 3)
    assert tree.compute([2, 2, 2], 0)[0] is False  # phone 2 has no entry in the table


def test_planted_right_context_split_is_found_and_nothing_else(tmp_path):
    stats = planted_stats()
    result = build_tree(stats, None, [SIL], PHONES, NUM_CLASSES, num_leaves=100, min_count=100, thresh=300)
    assert (
        sorted(splits(result.root)) == [(2, (4, 5))] * 3
    )  # one split per pdf-class of phone 3, on the right phone
    assert result.num_pdfs == sum(NUM_CLASSES.values()) + 3 == result.tree.num_pdfs
    assert pdfs_in(result.root) == set(range(result.num_pdfs))
    for left, right, k in itertools.product(CONTEXTS, CONTEXTS, range(3)):
        assert result.tree.compute([left, 3, right], k) == (True, result.pdf_id(left, 3, right, k))
    assert result.pdf_id(2, 3, 4, 1) == result.pdf_id(0, 3, 5, 1) != result.pdf_id(2, 3, 6, 1)
    shifted = result.pdf_id(1, 3, 4, 1)
    assert result.means[shifted, 2] == pytest.approx(3.0, abs=0.1)
    assert result.counts[shifted] == 2 * len(CONTEXTS) * 50
    result.write(tmp_path / "tree")
    assert (
        tmp_path / "tree"
    ).read_bytes() == b"\0B" + result.blob  # Kaldi's binary file header, then the blob
    # The same data with a threshold above the whole gain: no split at all.
    total_gain = result.summary["split_gain_per_frame"] * result.summary["frames"]
    none = build_tree(
        stats, None, [SIL], PHONES, NUM_CLASSES, num_leaves=100, min_count=100, thresh=total_gain
    )
    assert splits(none.root) == [] and none.num_pdfs == sum(NUM_CLASSES.values())


def test_min_count_and_num_leaves_are_respected():
    stats = planted_stats()
    smallest_side = 2 * len(CONTEXTS) * 50  # frames of phone 3 with a shifted right phone, per pdf-class
    result = build_tree(
        stats, None, [SIL], PHONES, NUM_CLASSES, num_leaves=100, min_count=smallest_side + 1, thresh=300
    )
    assert (2, (4, 5)) not in splits(result.root)
    assert result.counts.min() >= smallest_side + 1
    capped = build_tree(stats, None, [SIL], PHONES, NUM_CLASSES, num_leaves=21, min_count=100, thresh=300)
    assert capped.summary["leaves"] == 21 and len(splits(capped.root)) == 1
    with pytest.raises(ValueError, match="num_leaves"):
        build_tree(stats, None, [SIL], PHONES, NUM_CLASSES, num_leaves=5)


def test_leaves_with_the_same_distribution_merge_into_one_pdf():
    stats = planted_stats()
    singletons = [(p,) for p in PHONES]  # {4, 5} must be found as {4} then {5}: two leaves, alike
    result = build_tree(
        stats, singletons, [SIL], PHONES, NUM_CLASSES, num_leaves=100, min_count=100, thresh=300
    )
    assert result.summary["leaves"] == sum(NUM_CLASSES.values()) + 6
    assert result.num_pdfs == sum(NUM_CLASSES.values()) + 3
    assert result.pdf_id(0, 3, 4, 2) == result.pdf_id(0, 3, 5, 2) != result.pdf_id(0, 3, 6, 2)
    assert pdfs_in(result.root) == set(range(result.num_pdfs))
    unmerged = build_tree(
        stats, singletons, [SIL], PHONES, NUM_CLASSES, num_leaves=100, min_count=100, thresh=300, cluster_thresh=0.0
    )
    assert unmerged.num_pdfs == unmerged.summary["leaves"]


def test_shared_pdf_class_roots_ask_about_the_pdf_class():
    result = build_tree(
        planted_stats(), None, [SIL], PHONES, NUM_CLASSES, num_leaves=100, min_count=100, thresh=300,
        share_pdf_classes=True,
    )
    keys = {key for key, _ in splits(result.root)}
    assert keys == {PDF_CLASS_KEY, 2}
    assert len({result.pdf_id(0, 2, 0, k) for k in range(3)}) == 3  # the states of phone 2 were told apart


def test_cluster_phones_groups_similar_phones():
    stats = {}
    rng = np.random.default_rng(1)
    for p, centre in zip(PHONES, [0.0, 0.1, 0.2, 5.0, 5.1, 5.2]):
        x = rng.normal(centre, 0.3, size=(200, 2))
        stats[(0, p, 0, 1)] = (200.0, x.sum(0), (x**2).sum(0))
    questions = cluster_phones(stats, PHONES)
    assert (1, 2, 3) in questions and (4, 5, 6) in questions
    assert tuple(PHONES) in questions and all((p,) in questions for p in PHONES)


def alignment(
    tm: "khg.TransitionModel", topo: "khg.HmmTopology", phones: list[int], reorder: bool
) -> list[int]:
    """Transition-ids through each phone's states, two self-loops per state (after the exit if reordered)."""
    tids = []
    for p in phones:
        state_of = {tm.tuples[s - 1].__getstate__()[:2]: s for s in range(1, len(tm.tuples) + 1)}
        for i, hmm in enumerate(topo.topology_for_phone(p)[:-1]):
            targets = [dst for dst, _ in hmm.transitions]
            first = tm.state2id[state_of[(p, i)]]
            loop, forward = first + targets.index(i), first + targets.index(i + 1)
            tids += [forward, loop, loop] if reorder else [loop, loop, forward]
    return tids


@pytest.mark.parametrize("reorder", [False, True])
def test_stats_from_alignment_and_transition_model_from_tree(reorder):
    topo = topology(PHONES, SIL)
    mono = khg.monophone_context_dependency(
        phones=PHONES, phone2num_pdf_classes=topo.get_phone_to_num_pdf_classes()
    )
    tm = khg.TransitionModel(ctx_dep=mono, hmm_topo=topo)
    tables = TidTables.from_transition_model(tm)
    sequence = [SIL, 2, 2, 3, SIL]  # a repeated phone: two instances, not one
    ali = alignment(tm, topo, sequence, reorder)
    feats = np.arange(len(ali), dtype=np.float64)[:, None] * np.ones((1, 2))
    stats = accumulate_tree_stats([ali], [feats], tables)
    assert sum(v[0] for v in stats.values()) == len(ali)
    lefts, rights = [0, *sequence[:-1]], [*sequence[1:], 0]
    start = 0
    for left, centre, right in zip(lefts, sequence, rights):
        for k in range(NUM_CLASSES[centre]):
            count, total, _ = stats[(left, centre, right, k)]
            frames = np.arange(start + 3 * k, start + 3 * k + 3)
            assert count == 3 and total[0] == frames.sum()
        start += 3 * NUM_CLASSES[centre]
    assert len(stats) == sum(NUM_CLASSES[p] for p in sequence)

    result = build_tree(
        planted_stats(), None, [SIL], PHONES, NUM_CLASSES, num_leaves=100, min_count=100, thresh=300
    )
    tri = khg.TransitionModel(ctx_dep=result.tree, hmm_topo=topo)
    assert tri.num_pdfs == result.num_pdfs
    tri_tables = TidTables.from_transition_model(tri)
    for tid in range(1, tri.num_transition_ids + 1):
        p, k = int(tri_tables.phone[tid]), int(tri_tables.pdf_class[tid])
        allowed = {result.pdf_id(left, p, right, k) for left, right in itertools.product(CONTEXTS, CONTEXTS)}
        assert tri.transition_id_to_pdf(tid) in allowed


@pytest.mark.parametrize("reorder", [True, False])
def test_aligned_graph_pdfs_match_the_tree_in_context(reorder):
    """Equal-align a real training graph built with the tree: every frame's pdf is the tree's pdf
    for the context that accumulate_tree_stats finds, with and without reordered self-loops."""
    topo = topology(PHONES, SIL)
    result = build_tree(
        planted_stats(), None, [SIL], PHONES, NUM_CLASSES, num_leaves=100, min_count=100, thresh=300
    )
    tm = khg.TransitionModel(ctx_dep=result.tree, hmm_topo=topo)
    # words 1 = phones 2 3, 2 = 4 5 6, 3 = 1 2
    lexicon = kaldifst.compile(
        s="0 1 2 1\n1 0 3 0\n0 2 4 2\n2 3 5 0\n3 0 6 0\n0 4 1 3\n4 0 2 0\n0\n", acceptor=False
    )
    kaldifst.arcsort(lexicon, sort_type="olabel")
    opts = khg.TrainingGraphCompilerOptions(transition_scale=0.0, self_loop_scale=0.0, reorder=reorder)
    compiler = khg.TrainingGraphCompiler(
        trans_model=tm, ctx_dep=result.tree, lex_fst=lexicon, disambig_syms=[], opts=opts
    )
    ok, aligned = kaldifst.equal_align(
        ifst=compiler.compile_graph_from_text([1, 1, 2, 3, 1]), length=60, rand_seed=3, num_retries=10
    )
    assert ok
    _, ali, _, _ = kaldifst.get_linear_symbol_sequence(aligned)
    tables = TidTables.from_transition_model(tm)
    feats = np.stack([np.arange(len(ali)), [tm.transition_id_to_pdf(t) for t in ali]], axis=1).astype(
        np.float64
    )
    stats = accumulate_tree_stats([ali], [feats], tables)
    assert {key[:3] for key in stats} == {
        (0, 2, 3),
        (2, 3, 2),
        (3, 2, 3),
        (2, 3, 4),
        (3, 4, 5),
        (4, 5, 6),
        (5, 6, 1),
        (6, 1, 2),
        (1, 2, 2),
        (2, 2, 3),
        (2, 3, 0),
    }
    for (left, centre, right, k), (count, total, sumsq) in stats.items():
        pdf = result.pdf_id(left, centre, right, k)
        assert total[1] == count * pdf and sumsq[1] == count * pdf**2  # every frame of the event had that pdf


def test_bad_inputs_name_the_problem():
    with pytest.raises(ValueError, match="alignments"):
        accumulate_tree_stats([[1, 2]], [], None)
    stats = planted_stats()
    with pytest.raises(ValueError, match="phones"):
        build_tree(stats, None, [SIL], PHONES[:-1], NUM_CLASSES)
    with pytest.raises(ValueError, match="num_pdf_classes"):
        build_tree(stats, None, [SIL], PHONES, {**NUM_CLASSES, 3: 2})


def test_heldout_gains_score_each_split_on_speakers_left_out():
    stats = planted_stats()
    build = lambda heldout: build_tree(stats, None, [SIL], PHONES, NUM_CLASSES, num_leaves=100, min_count=100,
                                       thresh=300, heldout=heldout).summary
    # scored on the training frames themselves, a split's held-out gain is its training gain
    same = build(stats)
    assert same["heldout_frames"] == same["frames"]
    assert sum(same["heldout_gains"]) == pytest.approx(same["split_gain_per_frame"] * same["frames"], rel=1e-9)
    # speakers with the same context effect gain from each of the three splits; speakers without it lose
    alike, unlike = build(planted_stats(seed=1)), build(planted_stats(seed=1, shifted_right=()))
    assert len(alike["heldout_gains"]) == len(unlike["heldout_gains"]) == 3
    assert min(alike["heldout_gains"]) > 0 > max(unlike["heldout_gains"])
    assert "heldout_gains" not in build(None)
