"""Decoding of dev and test with a GMM system: the classic first baselines of a Kaldi recipe.

No binding gives a GMM lattice fast enough: ``kaldi-hmm-gmm``'s lattice decoders return only the best path,
and ``kaldi-decoder``'s ``LatticeSimpleDecoder`` has no limit on active states. On the default corpus's dev set
(version 4's triphone system, 2 processes, jemalloc preloaded), its lattices at Kaldi's beam 13 and scale
0.0833 took 66.7 s, and rescored to the scale dev picks gave 17.64 % (Kaldi's search decoding at that scale,
0.0667: 17.43 %); at beam 10 they took 25.3 s at 0.0833 (18.21 %) and 44.4 s at 0.0667 (17.76 %), where the
whole sweep below took 44 s for its 4 decodings (17.72 %), and test then costs about twice dev. So dev is
decoded again per point of the sweep, Kaldi's scoring by decoding: the acoustic scale (1 / LM weight) from
``GMM_ACOUSTIC_SCALES`` at no penalty, by a bracketing search that stops one scale past dev's best and
extends the grid past an edge that holds it (``pick_scale``); then, at that scale, the word insertion
penalties of Kaldi's ``score.sh`` (``WORD_INSERTION_PENALTIES``) in order while each is better
(``pick_penalty``). Test is decoded once, at dev's pick; without dev, at ``GMM_PREFERRED_SCALE`` and no
penalty. Writes ``exp/<name>/graph/HCLG.fst`` (and ``HCLG_wip<p>.fst`` per penalty tried) and
``exp/<name>/decode_{dev,test}/`` with ``recogs-*``/``errs-*`` per point (``point_name``) and
``wer.json`` (the result at the chosen point: ``wer`` in %, counts, ``acoustic_scale``,
``word_insertion_penalty``, ``search``: the decoder's beam and most active states, ``speed``: that
decoding's wall time, audio time and real-time factor, and on dev ``by_scale``, ``by_penalty`` and
``grid``: the scales tried, those added and those skipped). Dev's GMM log-likelihoods are evaluated
once for the whole sweep (``gmm_loglikes``).

The search is the recipe's beam 10 with at most 3,000 active states (``Search``), or Kaldi's 13 and 7,000
(``prepare.py --beam 13 --max-active 7000``). On the default corpus's 900 dev utterances (version 4), each
system at the scale dev picks, 2 processes, Kaldi's search took 2.3-2.9 times as long for 0.8-3.1 % fewer
errors: monophone 8.4 -> 23.6 s, 18.40 -> 18.06 %; triphone 11.2 -> 32.8 s, 18.40 -> 18.25 %; SAT's final
pass 7.9 -> 18.4 s, 8.46 -> 8.20 %. Paired, whole processes with their loading (``farm-bench -n 3 --vs``):
1.76 times the recipe's search's wall time for SAT's final pass. The gain is the beam's: at beam 10, 7,000 active
states in place of 3,000 change no dev WER by more than 0.06 points; and a beam that follows the scale
(Kaldi's 13 at its decoding scale 0.0833, ``13 * s / 0.0833``) is not Kaldi's search below 0.0833 (SAT's
final pass at 0.0588: 8.43 against 8.20 %; ``recipes/asr/research/gmm_search.py``,
docs/experiments/gmm_beams.md).
"""

from __future__ import annotations

import json
import logging
import pickle
import time
from functools import partial
from pathlib import Path

from local.atomic import atomic_path
from local.constants import GMM_ACOUSTIC_SCALES, GMM_PREFERRED_SCALE, WORD_INSERTION_PENALTIES
from local.gmm.common import GmmSystem, load_utterances
from local.graph.decode import (
    RECIPE_SEARCH,
    Search,
    decode_utterances_gmm,
    gmm_loglikes,
    pick_penalty,
    pick_scale,
    point_name,
    score,
    words_to_text,
)
from local.graph.hclg import make_hclg, with_word_penalty

log = logging.getLogger(__name__)

DECODE_JOBS = 2  # processes per decoding: the 2 cores of the reference machine (the stages run in one)


def decode_split(hclg, system: GmmSystem, utts, id2word: dict[int, str], out_dir: Path, split: str,
                 acoustic_scale: float, alignments: dict | None = None, hclg_path: Path | None = None,
                 loglikes: dict | None = None, penalty: float = 0.0, search: Search = RECIPE_SEARCH) -> dict:
    """Decode one split at one acoustic scale and score it; returns ``decode.score``'s result
    (``alignments`` receives the best paths' transition-ids). With ``hclg_path``, ``DECODE_JOBS``
    processes decode; ``loglikes``: the split's GMM log-likelihoods (``gmm_loglikes``), if kept;
    ``penalty``: the word insertion penalty ``hclg`` (and ``hclg_path``) already carry, for the names;
    ``search``: the decoder's beam and most active states.
    The result also holds the decoding's ``speed`` (``timed``)."""
    start = time.perf_counter()
    hyps = decode_utterances_gmm(hclg, system.tm, system.am, ((u, utts.feats[u]) for u in utts.ids),
                                 acoustic_scale=acoustic_scale, beam=search.beam, max_active=search.max_active,
                                 alignments=alignments, hclg_path=hclg_path, num_jobs=DECODE_JOBS, loglikes=loglikes)
    speed = timed(start, utts.feats)
    refs = {c.id: " ".join(utts.words[c.id]) for c in utts.cuts}
    texts = {u: words_to_text(w, id2word) for u, w in hyps.items()}
    return {**score(refs, texts, out_dir, point_name(split, acoustic_scale, penalty)), "speed": speed}


def timed(start: float, feats: dict) -> dict:
    """A decoding's speed since ``start`` (``time.perf_counter``) over ``feats``' frames (10 ms each):
    ``{"seconds", "audio_seconds", "rtf", "jobs"}`` (wall time, with ``DECODE_JOBS`` processes)."""
    seconds = time.perf_counter() - start
    audio = sum(len(f) for f in feats.values()) / 100.0
    return {"seconds": round(seconds, 2), "audio_seconds": round(audio, 1), "rtf": round(seconds / max(audio, 1e-9), 4),
            "jobs": DECODE_JOBS}


class PenaltyGraphs:
    """HCLG with each word insertion penalty (``with_word_penalty``), built once per penalty and written
    beside ``HCLG.fst`` as ``HCLG_wip<penalty>.fst`` for the decoding processes; penalty 0 is HCLG itself."""

    def __init__(self, hclg, hclg_path: Path, word_ids) -> None:
        self.graphs, self.word_ids = {0.0: (hclg, hclg_path)}, list(word_ids)

    def __call__(self, penalty: float) -> tuple:
        if penalty not in self.graphs:
            hclg, path = self.graphs[0.0]
            graph = with_word_penalty(hclg, penalty, self.word_ids)
            out = path.with_name(f"{path.stem}_wip{penalty:g}{path.suffix}")
            with atomic_path(out) as tmp:  # (two evaluations decoding new sets may write it at once)
                graph.write(str(tmp))
            self.graphs[penalty] = (graph, out)
        return self.graphs[penalty]


def _decode_kept(graphs: PenaltyGraphs, system: GmmSystem, utts, id2word: dict[int, str], out_dir: Path,
                 split: str, loglikes: dict | None, search: Search, tried: dict, paths: dict, acoustic_scale: float,
                 penalty: float = 0.0) -> float:
    """``decode_split`` at ``(acoustic_scale, penalty)``, its result kept in ``tried`` and its best paths
    in ``paths`` (by that point); returns the WER (a point already decoded is not decoded again)."""
    point = (acoustic_scale, penalty)
    if point in tried:
        return tried[point]["wer"]
    paths[point] = {}
    hclg, hclg_path = graphs(penalty)
    tried[point] = decode_split(hclg, system, utts, id2word, out_dir, split, acoustic_scale, paths[point], hclg_path,
                                loglikes, penalty, search)
    return tried[point]["wer"]


def decode_system(data_dir: Path | str, name: str, system: GmmSystem, lang,
                  scales: tuple[float, ...] = GMM_ACOUSTIC_SCALES,
                  penalties: tuple[float, ...] = WORD_INSERTION_PENALTIES, search: Search = RECIPE_SEARCH) -> dict:
    """Build HCLG for ``system``, decode dev and test. Dev: the acoustic scale from the grid (a bracketing
    search, extended past an edge: ``pick_scale``) at no penalty, then the word insertion penalty at that
    scale (``pick_penalty``: Kaldi's 0, 0.5, 1, in order while each is better); test: at dev's pick. Every
    decoding prunes with ``search`` (recorded in ``wer.json``).

    Returns:
        ``{"dev_wer", "test_wer", "acoustic_scale", "word_insertion_penalty", "decode_seconds"}`` (WER in %).
    """
    start = time.perf_counter()
    exp = Path(data_dir) / "exp" / name
    hclg_path = exp / "graph" / "HCLG.fst"
    hclg = make_hclg(lang.dir, system.tree, system.tm, out_path=hclg_path)
    graphs = PenaltyGraphs(hclg, hclg_path, lang.id2word)
    id2word = lang.id2word
    results, best = {}, {}
    splits = [s for s in ("dev", "test") if (Path(data_dir) / "features" / f"{s}_cuts.jsonl.gz").exists()]
    for split in splits:
        utts = load_utterances(data_dir, split, transform=system.transform)
        out_dir = exp / f"decode_{split}"
        paths, tried = {}, {}
        loglikes = gmm_loglikes(system.am, utts.feats.items()) if split == "dev" else None  # every point's
        wer = partial(_decode_kept, graphs, system, utts, id2word, out_dir, split, loglikes, search, tried, paths)
        if split == "dev":
            scale, grid = pick_scale(wer, scales, GMM_PREFERRED_SCALE, bracket=True)
            penalty, by_penalty = pick_penalty(partial(wer, scale), penalties)
        else:
            scale, penalty = best.get("dev", (GMM_PREFERRED_SCALE, 0.0))
            wer(scale, penalty)
        res = {**tried[(scale, penalty)], "acoustic_scale": scale, "word_insertion_penalty": penalty,
               "search": search.record()}
        if split == "dev":
            res["by_scale"] = {str(s): tried[(s, 0.0)]["wer"] for s in grid["grid"]}
            res["by_penalty"] = {str(p): w for p, w in by_penalty.items()}
            res["grid"] = grid
        best[split] = (scale, penalty)
        (out_dir / "wer.json").write_text(json.dumps(res, indent=1))
        with open(out_dir / "best_path.pkl", "wb") as f:  # first pass of the SAT stage's fMLLR decoding
            pickle.dump(paths[(scale, penalty)], f)
        results[f"{split}_wer"] = res["wer"]
        log.info("%s %s: WER %.2f %% at acoustic scale %g, word insertion penalty %g", name, split, res["wer"],
                 scale, penalty)
    results["acoustic_scale"], results["word_insertion_penalty"] = best.get("dev", (None, None))
    results["decode_seconds"] = round(time.perf_counter() - start, 1)
    return results
