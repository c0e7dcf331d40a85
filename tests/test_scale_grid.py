"""Acoustic scales picked on dev (``local.graph.decode.pick_scale``): the grid grows past an edge that
holds dev's best scale, by the geometric step of that end, a bounded number of times; a costly sweep
brackets dev's best instead of scoring the whole grid. Word insertion penalties (``pick_penalty``)."""

import math

import pytest
from local.constants import GMM_ACOUSTIC_SCALES, MAX_GRID_EXTENSIONS, WORD_INSERTION_PENALTIES
from local.graph.decode import penalty_past_edge, pick_penalty, pick_scale, pick_scale_and_penalty

GRID = (0.05, 0.0588, 0.0667, 0.0833, 0.1, 0.125)


def dev_wer(optimum: float, calls: list):
    """A stub scorer: WER grows with the log distance from ``optimum``; every call recorded."""

    def wer(scale: float) -> float:
        calls.append(scale)
        return 10.0 + 5.0 * abs(math.log(scale / optimum))

    return wer


def test_an_optimum_inside_the_grid_leaves_it_as_it_is():
    calls = []
    scale, info = pick_scale(dev_wer(0.07, calls), GRID, prefer=0.1)
    assert scale == 0.0667 and info == {"grid": list(GRID), "extended": [], "at_edge": False}
    assert sorted(calls) == list(GRID)


def test_an_optimum_below_the_grid_extends_it_downwards_by_its_lowest_ratio():
    calls = []
    scale, info = pick_scale(dev_wer(0.04, calls), GRID, prefer=0.1)
    step = float(f"{0.05 * 0.05 / 0.0588:.3g}")  # 0.0425
    assert info["extended"] == [step, float(f"{step * step / 0.05:.3g}")] and scale == step
    assert info["grid"] == sorted(GRID + tuple(info["extended"])) and not info["at_edge"]
    assert sorted(calls) == info["grid"]  # each scale scored once


def test_an_optimum_above_the_grid_extends_it_upwards():
    scale, info = pick_scale(dev_wer(0.14, []), GRID, prefer=0.1)
    assert info["extended"] == [0.156, 0.195] and scale == 0.156 and not info["at_edge"]
    assert info["grid"][-2:] == [0.156, 0.195]


def test_the_extensions_stop_at_the_bound_and_say_the_best_is_still_at_the_edge():
    calls = []
    scale, info = pick_scale(dev_wer(0.001, calls), GRID, prefer=0.1)
    assert len(info["extended"]) == MAX_GRID_EXTENSIONS and info["at_edge"]
    assert scale == info["grid"][0] == min(info["extended"]) and len(calls) == len(GRID) + MAX_GRID_EXTENSIONS
    _, info = pick_scale(dev_wer(0.001, []), GRID, prefer=0.1, max_extensions=1)
    assert len(info["extended"]) == 1 and info["at_edge"]


def test_ties_go_to_the_preferred_scale_and_a_single_scale_is_taken_as_given():
    scale, info = pick_scale(lambda s: 5.0, GMM_ACOUSTIC_SCALES, prefer=0.0667)
    assert scale == 0.0667 and info["extended"] == []
    scale, info = pick_scale(dev_wer(0.01, []), (0.1,), prefer=0.1)
    assert scale == 0.1 and info == {"grid": [0.1], "extended": [], "at_edge": False}
    with pytest.raises(ValueError, match="empty acoustic-scale grid"):
        pick_scale(lambda s: 0.0, (), prefer=0.1)


def test_the_bracketing_search_picks_as_the_whole_grid_and_skips_the_far_side():
    """Dev's WER falls then rises: the two middle scales, then outwards to the first worse one."""
    for optimum in (0.052, 0.06, 0.07, 0.09, 0.11, 0.13):
        calls = []
        whole, _ = pick_scale(dev_wer(optimum, []), GRID, prefer=0.1)
        scale, info = pick_scale(dev_wer(optimum, calls), GRID, prefer=0.1, bracket=True)
        assert scale == whole
        assert sorted(calls) == info["grid"] and len(calls) < len(GRID)
        assert sorted(info["grid"] + info["skipped"]) == sorted(set(GRID) | set(info["extended"]))
        i = info["grid"].index(scale)  # bracketed: a worse scale tried on each side
        assert 0 < i < len(info["grid"]) - 1


def test_the_bracketing_search_reaches_an_edge_and_extends_the_grid():
    calls = []
    scale, info = pick_scale(dev_wer(0.04, calls), GRID, prefer=0.1, bracket=True)
    whole, whole_info = pick_scale(dev_wer(0.04, []), GRID, prefer=0.1)
    assert scale == whole == 0.0425 and info["extended"] == whole_info["extended"] == [0.0425, 0.0361]
    assert info["skipped"] == [0.1, 0.125] and sorted(calls) == info["grid"] and not info["at_edge"]


def test_the_bracketing_search_stops_at_the_first_worse_scale():
    """Not unimodal: a lower WER beyond a worse scale is not seen (the whole grid would find it)."""
    wers = {0.05: 5.0, 0.0588: 9.0, 0.0667: 8.0, 0.0833: 7.0, 0.1: 8.5, 0.125: 9.5}
    wer = lambda s: wers.get(s, 6.0)  # (below the grid, where the whole grid's search extends it)
    scale, info = pick_scale(wer, GRID, prefer=0.1, bracket=True)
    assert scale == 0.0833 and info["skipped"] == [0.05, 0.0588, 0.125]
    assert pick_scale(wer, GRID, prefer=0.1)[0] == 0.05


def test_penalties_are_tried_in_order_while_each_is_better():
    calls = []
    wers = {0.0: 10.0, 0.5: 9.0, 1.0: 9.5}
    assert pick_penalty(lambda p: calls.append(p) or wers[p], (1.0, 0.0, 0.5)) == (0.5, wers)
    assert calls == [0.0, 0.5, 1.0]
    calls = []
    assert pick_penalty(lambda p: calls.append(p) or {0.0: 10.0, 0.5: 10.0}[p], WORD_INSERTION_PENALTIES) == (
        0.0, {0.0: 10.0, 0.5: 10.0})  # a tie stops the sweep and goes to the smaller penalty
    assert calls == [0.0, 0.5]
    with pytest.raises(ValueError, match="no word insertion penalty"):
        pick_penalty(lambda p: 0.0, ())


def test_a_best_penalty_at_the_top_extends_the_grid_upwards():
    """Dev's WER falling through 0, 0.5 and 1 goes on to 1.5 and 2 (the grid's step), stops at the first
    worse one and picks the best; a WER still falling after MAX_GRID_EXTENSIONS steps stops there with a
    warning. The lower bound is fixed: a best 0 tries nothing below it."""
    calls = []
    wer = {0.0: 10.0, 0.5: 9.0, 1.0: 8.0, 1.5: 7.5, 2.0: 7.9}
    assert pick_penalty(lambda p: calls.append(p) or wer[p], WORD_INSERTION_PENALTIES) == (1.5, wer)
    assert calls == [0.0, 0.5, 1.0, 1.5, 2.0]
    falling = lambda p: 10.0 - p
    penalty, tried = pick_penalty(falling, WORD_INSERTION_PENALTIES, max_extensions=2)
    assert penalty == 2.0 and sorted(tried) == [0.0, 0.5, 1.0, 1.5, 2.0]
    assert pick_penalty(lambda p: 5.0 + p, WORD_INSERTION_PENALTIES)[1] == {0.0: 5.0, 0.5: 5.5}
    assert penalty_past_edge([0.0, 0.5, 1.0], 0.0) == -0.5 and penalty_past_edge([0.0, 0.5, 1.0], 1.0) == 1.5
    assert penalty_past_edge([0.0, 0.5, 1.0], 0.5) is None and penalty_past_edge([0.0], 0.0) is None


def test_lattice_choice_extends_the_penalties_past_either_edge():
    """Every (scale, penalty) point costs a best path: dev's best penalty at the lower edge 0 brings -0.5
    (a bonus per word), scored at every scale tried; the scale is picked again with it. A best inside the
    penalties stops there; one still at the edge after the bound says so."""
    calls = []

    def rescore_with(wer_of):
        def rescore(scales, penalties):
            calls.append((list(scales), list(penalties)))
            wers.update({(s, p): wer_of(s, p) for s in scales for p in penalties})
        return rescore

    wers = {}
    bowl = lambda s, p: 10.0 + 100 * abs(s - 0.125) + abs(p + 0.5)  # best at (0.125, -0.5)
    scale, penalty, info = pick_scale_and_penalty(rescore_with(bowl), wers, (0.1, 0.125, 0.143), (0.0, 0.5, 1.0),
                                                  prefer=0.1)
    assert (scale, penalty) == (0.125, -0.5)
    assert info["penalties"] == [-1.0, -0.5, 0.0, 0.5, 1.0] and info["penalties_extended"] == [-0.5, -1.0]
    assert not info["penalty_at_edge"] and info["grid"] == [0.1, 0.125, 0.143] and info["extended"] == []
    assert set(wers) == {(s, p) for s in info["grid"] for p in info["penalties"]}
    assert calls[1] == ([0.1, 0.125, 0.143], [-0.5])
    wers.clear()
    falling = lambda s, p: 10.0 + 100 * abs(s - 0.125) - p
    _, penalty, info = pick_scale_and_penalty(rescore_with(falling), wers, (0.1, 0.125, 0.143), (0.0, 0.5, 1.0),
                                              prefer=0.1, max_extensions=2)
    assert penalty == 2.0 and info["penalty_at_edge"] and info["penalties_extended"] == [1.5, 2.0]
    wers.clear()
    # the scale grid grows too: every point of it has every penalty
    low = lambda s, p: 10.0 + 100 * s + abs(p - 0.5)
    scale, penalty, info = pick_scale_and_penalty(rescore_with(low), wers, (0.1, 0.125), (0.0, 0.5, 1.0), prefer=0.1)
    assert penalty == 0.5 and scale == info["grid"][0] < 0.1 and info["extended"] == info["grid"][:-2]
    assert set(wers) == {(s, p) for s in info["grid"] for p in info["penalties"]}
