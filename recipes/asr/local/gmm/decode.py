"""Decoding of dev and test with a GMM system: the classic first baselines of a Kaldi recipe.

The acoustic scale is picked on dev from ``ACOUSTIC_SCALES`` (Kaldi's scoring sweeps the LM
weight the same way) and applied to test. Writes ``exp/<name>/graph/HCLG.fst`` and
``exp/<name>/decode_{dev,test}/`` with ``recogs-*``/``errs-*`` per scale and ``wer.json``
(the result at the chosen scale: ``wer`` in %, counts, ``acoustic_scale``).
"""

from __future__ import annotations

import json
import logging
import pickle
import time
from pathlib import Path

from local.gmm.common import GmmSystem, load_utterances
from local.graph.decode import decode_utterances_gmm, score, words_to_text
from local.graph.hclg import make_hclg

log = logging.getLogger(__name__)

# 1 / LM weight for LM weights 20, 17, 15, 12, 10, 8 (Kaldi's scoring sweeps 7 .. 17). Until corpus version 3 the
# grid began at 0.0667, and every GMM system picked that edge on dev.
ACOUSTIC_SCALES = (0.05, 0.0588, 0.0667, 0.0833, 0.1, 0.125)
DECODE_JOBS = 2  # processes per decoding: the 2 cores of the reference machine (the stages run in one)


def decode_split(hclg, system: GmmSystem, utts, id2word: dict[int, str], out_dir: Path, split: str,
                 acoustic_scale: float, alignments: dict | None = None, hclg_path: Path | None = None) -> dict:
    """Decode one split at one acoustic scale and score it; returns ``decode.score``'s result
    (``alignments`` receives the best paths' transition-ids). With ``hclg_path``, ``DECODE_JOBS``
    processes decode."""
    hyps = decode_utterances_gmm(hclg, system.tm, system.am, ((u, utts.feats[u]) for u in utts.ids),
                                 acoustic_scale=acoustic_scale, alignments=alignments, hclg_path=hclg_path,
                                 num_jobs=DECODE_JOBS)
    refs = {c.id: " ".join(utts.words[c.id]) for c in utts.cuts}
    texts = {u: words_to_text(w, id2word) for u, w in hyps.items()}
    return score(refs, texts, out_dir, f"{split}-acwt{acoustic_scale:g}")


def decode_system(data_dir: Path | str, name: str, system: GmmSystem, lang,
                  scales: tuple[float, ...] = ACOUSTIC_SCALES) -> dict:
    """Build HCLG for ``system``, decode dev (every scale) and test (the best dev scale).

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
        utts = load_utterances(data_dir, split)
        out_dir = exp / f"decode_{split}"
        sweep = split == "dev" or "dev" not in best
        paths = {s: {} for s in (scales if sweep else (best["dev"],))}
        tried = {s: decode_split(hclg, system, utts, id2word, out_dir, split, s, paths[s], hclg_path) for s in paths}
        scale = min(tried, key=lambda s: (tried[s]["wer"], abs(s - 0.1)))
        res = {**tried[scale], "acoustic_scale": scale}
        if sweep:
            res["by_scale"] = {str(s): r["wer"] for s, r in tried.items()}
        best[split] = scale
        (out_dir / "wer.json").write_text(json.dumps(res, indent=1))
        with open(out_dir / "best_path.pkl", "wb") as f:  # first pass of the SAT stage's fMLLR decoding
            pickle.dump(paths[scale], f)
        results[f"{split}_wer"] = res["wer"]
        log.info("%s %s: WER %.2f %% at acoustic scale %g", name, split, res["wer"], scale)
    results["acoustic_scale"] = best.get("dev")
    results["decode_seconds"] = round(time.perf_counter() - start, 1)
    return results
