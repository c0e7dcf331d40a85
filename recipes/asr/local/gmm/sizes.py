"""Tree leaves and total Gaussians of the triphone (``tri``), LDA+MLLT (``lda_mllt``) and SAT (``sat``)
systems, fixed before training from the hours of speech they train on (``auto``), or given
(``prepare.py --tri-leaves ...``).

The rule interpolates linearly in log hours (log sizes) between these points and keeps the nearest
end's sizes outside them:

- the default corpus (2.34 h of TTS speech): ``tri`` 150 leaves / 2,000 Gaussians, chosen on dev
  (version 4: 18.40 / 17.72 / 18.09 % at 1,500 / 2,000 / 3,000; 150 leaves from a held-out-voice
  validation, ``tri.train_tri``); ``sat`` 300 / 2,500, chosen on the DNNs' dev WER, since its tree is
  their output layer (version 4: 6.63 % against 6.96 % and 7.14 % on the trees of 150 / 1,500 and
  500 / 4,000, the page ``docs/experiments/sat_sizes.md``); ``lda_mllt`` the
  triphone system's 150 / 2,000, not tuned on this corpus: Kaldi's recipes give the
  LDA+MLLT system the Δ + ΔΔ system's sizes (RM: 1,800 / 9,000 both) or somewhat more (WSJ si84 and
  LibriSpeech: 2,500 / 15,000 against 2,000 / 10,000), and the points below already give it that;
- Kaldi's recipes, for all three systems: 2,500 / 15,000 from ~15 h (WSJ si84, tri2b) to 100 h
  (LibriSpeech train-clean-100, tri3b), 4,200 / 40,000 at 460 h (LibriSpeech tri4b) and
  7,000 / 150,000 at 960 h (LibriSpeech tri6b).

That is the synthetic corpus's rule (``corpus="synthetic"``): below 15 h its own point is the only one, a
few dozen voices of synthetic speech. A corpus of recorded speech (every other ``corpus``) takes Kaldi's
smaller recipes as points too, RM (~3 h: 1,800 / 9,000 for all three systems) and mini_librispeech
(train-clean-5, ~5 h: tri1 2,000 / 10,000, tri2b and tri3b 2,500 / 15,000), and for the triphone and
LDA+MLLT systems a point at 1 h, 300 / 1,500, measured on two Kaldi data dirs of about an hour of real
sentences spoken by 38 voices (``research/unseen_voices_corpus.py``; the page
``docs/experiments/unseen_voices_gmm.md``): there 300 leaves made every stage better than the one before
on dev, of the training accents and of others, where RM's speech per leaf (600) left the triphone system
3.2 points behind 300 and 2.0 behind the monophone on the accents train lacks, and the SAT system, whose
own sizes stayed, came out level (43.34 / 23.00 % at 300 against 43.99 / 23.14 % at 600-650). Below
the first point the sizes shrink in proportion to the hours (as much speech per leaf and per Gaussian),
never below the synthetic corpus's sizes (Gaussians: nor above the first point's). Leaves are rounded to 50,
Gaussians to 500.
"""

from __future__ import annotations

import numpy as np

FRAMES_PER_HOUR = 360_000  # 10 ms frames
KALDI_POINTS = ((15.0, 2500, 15000), (100.0, 2500, 15000), (460.0, 4200, 40000), (960.0, 7000, 150000))
DEFAULT_CORPUS_POINTS = {"tri": (2.34, 150, 2000), "lda_mllt": (2.34, 150, 2000), "sat": (2.34, 300, 2500)}
# Recorded speech below 15 h: the unseen-voices corpora's hour (tri, lda_mllt: measured), then Kaldi's recipes,
# RM's tri1 / tri2b / tri3b, mini_librispeech's
KALDI_SMALL_POINTS = {"tri": ((1.0, 300, 1500), (3.0, 1800, 9000), (5.0, 2000, 10000)),
                      "lda_mllt": ((1.0, 300, 1500), (3.0, 1800, 9000), (5.0, 2500, 15000)),
                      "sat": ((3.0, 1800, 9000), (5.0, 2500, 15000))}


def auto_sizes(system: str, hours: float, corpus: str = "synthetic") -> tuple[int, int]:
    """``(leaves, total Gaussians)`` of ``system`` ("tri", "lda_mllt" or "sat") trained on ``hours`` of speech
    of ``corpus`` (``prepare.py --corpus``: the synthetic corpus's rule, or that of recorded speech)."""
    if system not in DEFAULT_CORPUS_POINTS:
        raise ValueError(f"system={system!r}; use 'tri', 'lda_mllt' or 'sat'")
    hours = max(hours, 1e-6)
    if corpus == "synthetic":
        points = [DEFAULT_CORPUS_POINTS[system], *KALDI_POINTS]
    else:
        points = [*KALDI_SMALL_POINTS[system], *KALDI_POINTS]
    logs = np.log(np.array(points, dtype=np.float64))
    leaves, gauss = (float(np.exp(np.interp(np.log(hours), logs[:, 0], logs[:, i]))) for i in (1, 2))
    if corpus != "synthetic" and hours < points[0][0]:  # as much speech per leaf and per Gaussian as the point's
        floor = [min(low, size) for low, size in zip(DEFAULT_CORPUS_POINTS[system][1:], points[0][1:])]
        leaves, gauss = (max(size * hours / points[0][0], low) for size, low in zip(points[0][1:], floor))
    return 50 * round(leaves / 50), 500 * round(gauss / 500)


def resolve_sizes(system: str, num_leaves: int | str, total_gauss: int | str, frames: int,
                  corpus: str = "synthetic") -> dict:
    """The sizes a stage trains with: each of ``num_leaves`` / ``total_gauss`` a positive number or
    ``"auto"`` (``auto_sizes`` of ``frames`` training frames of ``corpus``). Returns ``{"leaves",
    "gaussians", "train_hours", "auto": which were auto}``."""
    hours = frames / FRAMES_PER_HOUR
    auto = dict(zip(("leaves", "gaussians"), auto_sizes(system, hours, corpus)))
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

