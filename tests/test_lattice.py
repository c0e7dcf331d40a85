"""Word lattices: the raw lattice's arrays, the best path at every (acoustic scale, insertion penalty)
point against brute force, and the lattice's best path against the best-path decoder's on a real graph."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from local.graph import lattice as L
from local.kaldi import kaldifst


def _lattice(text: str):
    """A kaldifst.Lattice from OpenFst text ``src dst ilabel olabel graph,acoustic`` / ``state graph,acoustic``."""
    lat = kaldifst.Lattice()
    lines = [line.split() for line in text.strip().splitlines()]
    states = 1 + max(int(f[i]) for f in lines for i in ((0, 1) if len(f) >= 4 else (0,)))
    for _ in range(states):
        lat.add_state()
    lat.start = 0
    for f in lines:
        if len(f) >= 4:
            g, a = map(float, f[4].split(",")) if len(f) == 5 else (0.0, 0.0)
            lat.add_arc(int(f[0]), kaldifst.LatticeArc(int(f[2]), int(f[3]), kaldifst.LatticeWeight(g, a), int(f[1])))
        else:
            g, a = map(float, f[1].split(","))
            lat.set_final(int(f[0]), kaldifst.LatticeWeight(g, a))
    return lat


# Two word paths and a shortcut, states deliberately not in topological order (3 -> 1).
TEXT = """
0 3 1 7 1.0,2.0
3 1 2 0 0.0,1.0
1 2 3 8 0.5,0.5
0 4 1 9 3.0,0.5
4 2 2 0 0.0,0.25
0 2 4 0 6.0,0.0
2 0.0,0.0
"""
PATHS = {  # words: (graph, acoustic) of each complete path
    (7, 8): (1.5, 3.5),
    (9,): (3.0, 0.75),
    (): (6.0, 0.0),
}


def test_raw_lattice_arrays_in_topological_order():
    wl = L.from_kaldifst(_lattice(TEXT), scale=0.5)
    assert wl.num_states == 5 and len(wl.src) == 6
    assert (wl.dst > wl.src).all() and (np.diff(wl.src) >= 0).all()
    assert np.isfinite(wl.final_graph).sum() == 1


def test_an_arc_of_weight_one_is_kept():
    """OpenFst's text writes an arc of weight (0, 0) with 4 fields, e.g. a word arc without input of graph
    cost 0. Dropped, the lattice lost its only complete path and gave an empty hypothesis."""
    text = """
0 1 1 0 1.0,2.0
1 2 0 5
2 3 2 6 0.5,0.5
3 0.0,0.0
"""
    lat = _lattice(text)
    assert ["1", "2", "0", "5"] in [line.split() for line in lat.to_str().splitlines()]  # as kaldifst writes it
    wl = L.from_kaldifst(lat, scale=1.0)
    assert wl.num_states == 4 and len(wl.src) == 3 and wl.word.tolist() == [0, 5, 6]
    assert L.best_paths(wl, np.array([1.0]), np.array([0.0])) == [[5, 6]]


@pytest.mark.parametrize(("scale", "penalty"), list(itertools.product([0.1, 0.5, 1.0, 3.0], [-2.0, 0.0, 2.0])))
def test_best_path_at_every_grid_point_is_the_brute_force_best(scale, penalty):
    wl = L.from_kaldifst(_lattice(TEXT), scale=0.5)

    def cost(words):
        g, a = PATHS[words]
        return g + a * scale / 0.5 + penalty * len(words)

    want = min(PATHS, key=cost)
    got = L.best_paths(wl, np.array([scale]), np.array([penalty]))[0]
    assert tuple(got) == want


def test_grid_hypotheses_matches_one_point_at_a_time():
    wl = L.from_kaldifst(_lattice(TEXT), scale=0.5)
    grid = L.grid_hypotheses({"u": wl, "lost": None}, [0.1, 1.0, 3.0], [-2.0, 2.0])
    for (s, p), hyps in grid.items():
        assert hyps["u"] == L.best_paths(wl, np.array([s]), np.array([p]))[0] and hyps["lost"] == []


def test_lattice_best_path_equals_the_best_path_decoder(tiny_aligned):
    """On the tiny corpus's SAT graph, random pseudo log-likelihoods: at the scale it decoded with and
    no penalty, the lattice's best path has the words of ``FasterDecoder``'s."""
    import json

    from local.gmm.common import GmmSystem
    from local.graph.decode import BEAM, decode_utterances

    info = json.loads((tiny_aligned / "ali" / "info.json").read_text())
    hclg = kaldifst.StdVectorFst.read(str(tiny_aligned / info["graph"]))
    tm = GmmSystem.load(tiny_aligned / info["model"], check_front_end=False).tm
    rng = np.random.default_rng(0)
    utts = [(f"u{i}", rng.normal(0, 3, (60 + 10 * i, tm.num_pdfs)).astype(np.float32)) for i in range(6)]
    best = decode_utterances(hclg, tm, utts, acoustic_scale=0.5, beam=BEAM, max_active=100000)
    lattices = L.decode_lattices(hclg, tm, utts, acoustic_scale=0.5, beam=BEAM)
    grid = L.grid_hypotheses(lattices, [0.5, 0.25], [0.0, 5.0])
    assert {u: grid[(0.5, 0.0)][u] for u, _ in utts} == best
    assert any(grid[(0.5, 5.0)][u] != best[u] for u, _ in utts) or all(len(w) <= 1 for w in best.values())


def _arpa(tmp_path, name, order, sentences, vocab):
    from local.graph.lm import estimate_kn, write_arpa

    write_arpa(estimate_kn(sentences, order, vocab), tmp_path / name)
    return tmp_path / name


def _random_lattice(rng, states: int, words: int) -> L.WordLattice:
    """A random acyclic lattice in topological order: every state reaches the last (final) one."""
    arcs = []
    for s in range(states - 1):
        for d in {s + 1, *rng.integers(s + 1, states, size=rng.integers(0, 3))}:
            word = int(rng.integers(1, words + 1)) if rng.random() < 0.4 else 0
            arcs.append((s, int(d), word, rng.uniform(0, 3), rng.uniform(0, 5)))
    arcs.sort()
    src, dst, word, graph, acoustic = (np.array(c) for c in zip(*arcs))
    final_graph, final_acoustic = np.full(states, np.inf), np.full(states, np.inf)
    final_graph[-1], final_acoustic[-1] = 0.5, 0.0
    final_graph[states // 2], final_acoustic[states // 2] = 2.0, 1.0  # a second way to end
    return L.WordLattice(src=src.astype(np.int64), dst=dst.astype(np.int64), word=word.astype(np.int64),
                         graph=graph, acoustic=acoustic, final_graph=final_graph, final_acoustic=final_acoustic,
                         scale=0.1)  # fmt: skip


def _all_paths(lat: L.WordLattice) -> list[tuple[tuple[int, ...], float, float]]:
    """Every complete path of ``lat``: (words, graph cost, acoustic cost)."""
    out, stack = [], [(0, (), 0.0, 0.0)]
    while stack:
        s, words, g, a = stack.pop()
        if np.isfinite(lat.final_graph[s]):
            out.append((words, g + lat.final_graph[s], a + lat.final_acoustic[s]))
        for i in np.nonzero(lat.src == s)[0]:
            w = int(lat.word[i])
            stack.append((int(lat.dst[i]), words + ((w,) if w else ()), g + lat.graph[i], a + lat.acoustic[i]))
    return out


def test_lm_rescoring_finds_the_brute_force_best_path_under_the_new_lm(tmp_path):
    """The rescored best path at every grid point is the path minimising graph - old LM + new LM +
    scaled acoustic + penalty, found by listing every path; with the first-pass LM as the new one it
    is the plain best path."""
    from local.graph.lm import BOS, EOS, ArpaLM

    vocab = ["a", "b", "c", "d"]
    rng = np.random.default_rng(0)
    text = [list(rng.choice(vocab, size=rng.integers(1, 6))) for _ in range(40)]
    old = _arpa(tmp_path, "old.arpa", 2, text, vocab)
    new = _arpa(tmp_path, "new.arpa", 4, text[:25] + [["a", "b", "c", "d"]] * 5, vocab)
    id2word = {0: "<eps>", **{i + 1: w for i, w in enumerate(vocab)}, 5: "#0"}
    rescorer, same = L.LmRescorer(old, new, id2word), L.LmRescorer(old, old, id2word)
    lms = {name: ArpaLM(path) for name, path in (("old", old), ("new", new))}

    def lm_cost(name, words):
        history, total = (BOS,), 0.0
        for w in [id2word[x] for x in words] + [EOS]:
            total -= L.LN10 * lms[name].logprob(w, history)
            history += (w,)
        return total

    scales, penalties = np.array([0.05, 0.1, 0.1, 0.3]), np.array([0.0, -1.0, 1.5, 0.0])
    changed = 0
    for seed in range(30):
        lat = _random_lattice(np.random.default_rng(seed), states=9, words=4)
        listed = _all_paths(lat)
        got = L.best_paths(lat, scales, penalties, rescorer)
        assert L.best_paths(lat, scales, penalties, same) == L.best_paths(lat, scales, penalties)
        for j, (scale, penalty) in enumerate(zip(scales, penalties)):
            totals = {lm: [g - lm_cost("old", w) + lm_cost(lm, w) + a * scale / lat.scale + penalty * len(w)
                           for w, g, a in listed] for lm in ("old", "new")}  # fmt: skip
            best = min(totals["new"])
            assert min(t for t, (w, _, _) in zip(totals["new"], listed) if list(w) == got[j]) == pytest.approx(best, abs=1e-9)
            changed += listed[int(np.argmin(totals["old"]))][0] != tuple(got[j])
    assert changed > 0  # the new LM changed some choices, so the test tells the two apart


def test_a_rescoring_lm_without_every_graph_word_is_refused(tmp_path):
    old = _arpa(tmp_path, "old.arpa", 2, [["a", "b"], ["b", "c"]], ["a", "b", "c"])
    new = _arpa(tmp_path, "new.arpa", 3, [["a", "b"]], ["a", "b"])
    with pytest.raises(ValueError, match=r"lacks 1 word\(s\) the graph can output, e\.g\. c"):
        L.LmRescorer(old, new, {0: "<eps>", 1: "a", 2: "b", 3: "c"})


def test_the_rescoring_lm_of_order_3_is_the_first_pass_lm(tiny_aligned, tmp_path):
    """make_rescore_lm estimates on the lang stage's own sentences: order 3 gives lm.arpa again."""
    import shutil

    from local.graph.lm import make_rescore_lm

    data = tmp_path / "data"
    shutil.copytree(tiny_aligned / "lang", data / "lang")
    (data / "manifests").symlink_to(tiny_aligned / "manifests")
    path = make_rescore_lm(data, 3)
    assert path.name == "lm_3gram.arpa" and path.read_text() == (data / "lang" / "lm.arpa").read_text()
    four = make_rescore_lm(data, 4)
    assert "ngram 4=" in four.read_text() and make_rescore_lm(data, 4) == four  # written once
    with pytest.raises(ValueError, match="order=0"):
        make_rescore_lm(data, 0)


def _sweep(lat: L.WordLattice, scales: np.ndarray, penalties: np.ndarray) -> list[list[int]]:
    """The reference search: one sweep over the arcs in order, a state's cost replaced only by a strictly
    lower one, the best end by ``np.argmin``."""
    ratio = scales / lat.scale
    arc_cost = lat.graph[:, None] + lat.acoustic[:, None] * ratio + (lat.word != 0)[:, None] * penalties
    cost = np.full((lat.num_states, len(scales)), np.inf)
    back = np.full((lat.num_states, len(scales)), -1)
    cost[0] = 0.0
    for i in range(len(lat.src)):
        cand = cost[lat.src[i]] + arc_cost[i]
        better = cand < cost[lat.dst[i]]
        cost[lat.dst[i]] = np.where(better, cand, cost[lat.dst[i]])
        back[lat.dst[i], better] = i
    total = cost + lat.final_graph[:, None] + lat.final_acoustic[:, None] * ratio
    out = []
    for j, end in enumerate(np.argmin(total, axis=0)):
        words, s = [], end
        while np.isfinite(total[end, j]) and s != 0:
            i = back[s, j]
            words += [int(lat.word[i])] if lat.word[i] else []
            s = lat.src[i]
        out.append(words[::-1])
    return out


@pytest.mark.parametrize("seed", range(4))
def test_the_lattices_searched_together_choose_as_one_sweep_each(seed):
    """``batch_best_paths`` relaxes many lattices a generation of states at a time; on lattices of
    small integer costs, full of exact ties between paths and between ends, it picks the same paths
    as one sweep over each lattice's arcs in order (the first arc and the first end among equals)."""
    rng = np.random.default_rng(seed)
    lattices = []
    for states in rng.integers(2, 40, size=12):
        lat = _random_lattice(rng, int(states), words=3)
        lat.graph, lat.acoustic = np.round(lat.graph), np.round(lat.acoustic)
        lat.final_graph[states // 3] = 1.0 if seed % 2 else lat.final_graph[states // 3]  # a third end, for ties
        lat.final_acoustic[states // 3] = 0.0 if seed % 2 else lat.final_acoustic[states // 3]
        lattices.append(lat)
    nowhere = _random_lattice(rng, 5, words=3)
    nowhere.final_graph[:] = np.inf  # no final state: no path
    lattices.insert(3, nowhere)
    # state 1 is not reached from the start, yet its arc leads into state 2, which is
    orphan = L.WordLattice(src=np.array([0, 0, 1, 2, 3]), dst=np.array([2, 3, 2, 3, 4]), word=np.array([1, 0, 2, 3, 0]),
                           graph=np.array([1.0, 4.0, 0.0, 1.0, 0.0]), acoustic=np.array([0.0, 0.0, 0.0, 1.0, 1.0]),
                           final_graph=np.array([np.inf] * 4 + [0.0]), final_acoustic=np.array([np.inf] * 4 + [0.0]),
                           scale=0.1)  # fmt: skip
    lattices.append(orphan)
    scales = np.array([0.1, 0.1, 0.2, 0.5, 1.0, 2.0])
    penalties = np.array([0.0, 1.0, 0.0, -1.0, 0.5, 0.0])
    got = L.batch_best_paths(lattices, scales, penalties)
    assert got == [_sweep(lat, scales, penalties) for lat in lattices]
    assert got[3] == [[]] * len(scales) and got[-1][0] == [1, 3]
    assert L.batch_best_paths(lattices[:1], scales, penalties) == got[:1]
