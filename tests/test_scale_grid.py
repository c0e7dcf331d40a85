"""Acoustic scales picked on dev (``local.graph.decode.pick_scale``): the grid grows past an edge that
holds dev's best scale, by the geometric step of that end, a bounded number of times."""

import math

import pytest
from local.constants import GMM_ACOUSTIC_SCALES, MAX_GRID_EXTENSIONS
from local.graph.decode import pick_scale

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
