"""Decoding of dev and test with a GMM system: the classic first baselines of a Kaldi recipe.

The acoustic scale is picked on dev from ``GMM_ACOUSTIC_SCALES`` (Kaldi's scoring sweeps the LM
weight the same way), the grid extended past an edge that holds dev's best (``pick_scale``), and
applied to test; without dev, test is decoded at ``PREFERRED_SCALE``. Writes
``exp/<name>/graph/HCLG.fst`` and ``exp/<name>/decode_{dev,test}/`` with ``recogs-*``/``errs-*`` per
scale and ``wer.json`` (the result at the chosen scale: ``wer`` in %, counts, ``acoustic_scale``, and
on dev ``by_scale`` and ``grid``: the scales tried and those added). Dev's GMM log-likelihoods are
evaluated once for the whole grid (``gmm_loglikes``).
"""

from __future__ import annotations

import json
import logging
import pickle
import time
from functools import partial
from pathlib import Path

from local.constants import GMM_ACOUSTIC_SCALES
from local.gmm.common import GmmSystem, load_utterances
from local.graph.decode import decode_utterances_gmm, gmm_loglikes, pick_scale, score, words_to_text
from local.graph.hclg import make_hclg

log = logging.getLogger(__name__)

PREFERRED_SCALE = 0.1  # Kaldi's GMM acoustic scale: ties on dev go to the scale nearest it
DECODE_JOBS = 2  # processes per decoding: the 2 cores of the reference machine (the stages run in one)


def decode_split(hclg, system: GmmSystem, utts, id2word: dict[int, str], out_dir: Path, split: str,
                 acoustic_scale: float, alignments: dict | None = None, hclg_path: Path | None = None,
                 loglikes: dict | None = None) -> dict:
    """Decode one split at one acoustic scale and score it; returns ``decode.score``'s result
    (``alignments`` receives the best paths' transition-ids). With ``hclg_path``, ``DECODE_JOBS``
    processes decode; ``loglikes``: the split's GMM log-likelihoods (``gmm_loglikes``), if kept."""
    hyps = decode_utterances_gmm(hclg, system.tm, system.am, ((u, utts.feats[u]) for u in utts.ids),
                                 acoustic_scale=acoustic_scale, alignments=alignments, hclg_path=hclg_path,
                                 num_jobs=DECODE_JOBS, loglikes=loglikes)
    refs = {c.id: " ".join(utts.words[c.id]) for c in utts.cuts}
    texts = {u: words_to_text(w, id2word) for u, w in hyps.items()}
    return score(refs, texts, out_dir, f"{split}-acwt{acoustic_scale:g}")


def _decode_kept(hclg, system: GmmSystem, utts, id2word: dict[int, str], out_dir: Path, split: str,
                 hclg_path: Path, loglikes: dict | None, tried: dict, paths: dict, acoustic_scale: float) -> float:
    """``decode_split`` at ``acoustic_scale``, its result kept in ``tried`` and its best paths in
    ``paths`` (by scale); returns the WER."""
    paths[acoustic_scale] = {}
    tried[acoustic_scale] = decode_split(hclg, system, utts, id2word, out_dir, split, acoustic_scale,
                                         paths[acoustic_scale], hclg_path, loglikes)
    return tried[acoustic_scale]["wer"]


def decode_system(data_dir: Path | str, name: str, system: GmmSystem, lang,
                  scales: tuple[float, ...] = GMM_ACOUSTIC_SCALES) -> dict:
    """Build HCLG for ``system``, decode dev (every scale of the grid, extended by ``pick_scale``) and
    test (the best dev scale).

    Returns:
        ``{"dev_wer", "test_wer", "acoustic_scale", "decode_seconds"}`` (WER in %).
    """
    start = time.perf_counter()
    exp = Path(data_dir) / "exp" / name
    hclg_path = exp / "graph" / "HCLG.fst"
    hclg = make_hclg(lang.dir, system.tree, system.tm, out_path=hclg_path)
    id2word = lang.id2word
    results, best = {}, {}
    splits = [s for s in ("dev", "test") if (Path(data_dir) / "features" / f"{s}_cuts.jsonl.gz").exists()]
    for split in splits:
        utts = load_utterances(data_dir, split, transform=system.transform)
        out_dir = exp / f"decode_{split}"
        paths, tried = {}, {}
        loglikes = gmm_loglikes(system.am, utts.feats.items()) if split == "dev" else None  # every scale's
        wer = partial(_decode_kept, hclg, system, utts, id2word, out_dir, split, hclg_path, loglikes, tried, paths)
        if split == "dev":
            scale, grid = pick_scale(wer, scales, PREFERRED_SCALE)
        else:
            scale = best.get("dev", PREFERRED_SCALE)
            wer(scale)
        res = {**tried[scale], "acoustic_scale": scale}
        if split == "dev":
            res["by_scale"] = {str(s): tried[s]["wer"] for s in grid["grid"]}
            res["grid"] = grid
        best[split] = scale
        (out_dir / "wer.json").write_text(json.dumps(res, indent=1))
        with open(out_dir / "best_path.pkl", "wb") as f:  # first pass of the SAT stage's fMLLR decoding
            pickle.dump(paths[scale], f)
        results[f"{split}_wer"] = res["wer"]
        log.info("%s %s: WER %.2f %% at acoustic scale %g", name, split, res["wer"], scale)
    results["acoustic_scale"] = best.get("dev")
    results["decode_seconds"] = round(time.perf_counter() - start, 1)
    return results
