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
    states = 1 + max(int(f[i]) for f in lines for i in ((0, 1) if len(f) == 5 else (0,)))
    for _ in range(states):
        lat.add_state()
    lat.start = 0
    for f in lines:
        if len(f) == 5:
            g, a = map(float, f[4].split(","))
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
