"""Tree leaves and total Gaussians of the triphone (``tri``), LDA+MLLT (``lda_mllt``) and SAT (``sat``)
systems, fixed before training from the hours of speech they train on (``auto``), or given
(``prepare.py --tri-leaves ...``).

The rule interpolates linearly in log hours (log sizes) between these points and keeps the nearest
end's sizes outside them:

- the default corpus (2.34 h of TTS speech): ``tri`` 150 leaves / 1,500 Gaussians, chosen on a
  held-out-voice validation (``tri.train_tri``); ``sat`` 300 / 2,500, chosen on dev against 150 / 1,500
  and 500 / 4,000 (dev 7.30 % against 8.18 and 7.68 %, the page ``docs/experiments/sat_sizes.md``);
  ``lda_mllt`` the triphone system's 150 / 1,500, not tuned on this corpus: Kaldi's recipes give the
  LDA+MLLT system the Δ + ΔΔ system's sizes (RM: 1,800 / 9,000 both) or somewhat more (WSJ si84 and
  LibriSpeech: 2,500 / 15,000 against 2,000 / 10,000), and the points below already give it that;
- Kaldi's recipes, for all three systems: 2,500 / 15,000 from ~15 h (WSJ si84, tri2b) to 100 h
  (LibriSpeech train-clean-100, tri3b), 4,200 / 40,000 at 460 h (LibriSpeech tri4b) and
  7,000 / 150,000 at 960 h (LibriSpeech tri6b).

Kaldi's smallest recipe (RM, ~3 h: 1,800 / 9,000) is not a point: at that size the default corpus,
a few dozen voices of synthetic speech, is the recipe's own. Leaves are rounded to 50, Gaussians to 500.
"""

from __future__ import annotations

import numpy as np

FRAMES_PER_HOUR = 360_000  # 10 ms frames
KALDI_POINTS = ((15.0, 2500, 15000), (100.0, 2500, 15000), (460.0, 4200, 40000), (960.0, 7000, 150000))
DEFAULT_CORPUS_POINTS = {"tri": (2.34, 150, 1500), "lda_mllt": (2.34, 150, 1500), "sat": (2.34, 300, 2500)}


def auto_sizes(system: str, hours: float) -> tuple[int, int]:
    """``(leaves, total Gaussians)`` of ``system`` ("tri", "lda_mllt" or "sat") trained on ``hours`` of speech."""
    if system not in DEFAULT_CORPUS_POINTS:
        raise ValueError(f"system={system!r}; use 'tri', 'lda_mllt' or 'sat'")
    points = np.log(np.array([DEFAULT_CORPUS_POINTS[system], *KALDI_POINTS], dtype=np.float64))
    x = np.log(max(hours, 1e-6))
    leaves, gauss = (float(np.exp(np.interp(x, points[:, 0], points[:, i]))) for i in (1, 2))
    return 50 * round(leaves / 50), 500 * round(gauss / 500)


def resolve_sizes(system: str, num_leaves: int | str, total_gauss: int | str, frames: int) -> dict:
    """The sizes a stage trains with: each of ``num_leaves`` / ``total_gauss`` a positive number or
    ``"auto"`` (``auto_sizes`` of ``frames`` training frames). Returns ``{"leaves", "gaussians",
    "train_hours", "auto": which were auto}``."""
    hours = frames / FRAMES_PER_HOUR
    auto = dict(zip(("leaves", "gaussians"), auto_sizes(system, hours)))
    sizes, flag = {}, system.replace("_", "-")
    for name, value, option in (("leaves", num_leaves, "leaves"), ("gaussians", total_gauss, "gauss")):
        if value == "auto":
            sizes[name] = auto[name]
        elif isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value > 0:
            sizes[name] = int(value)
        else:
            raise ValueError(f"{system} {name}={value!r}; give a positive whole number or 'auto' "
                             f"(prepare.py --{flag}-{option})")
    if sizes["gaussians"] < sizes["leaves"]:
        raise ValueError(f"{system}: {sizes['gaussians']} Gaussians for {sizes['leaves']} leaves; a leaf has at "
                         f"least one Gaussian, so give --{flag}-gauss of at least --{flag}-leaves")
    return {**sizes, "train_hours": round(hours, 3),
            "auto": [n for n, v in (("leaves", num_leaves), ("gaussians", total_gauss)) if v == "auto"]}
