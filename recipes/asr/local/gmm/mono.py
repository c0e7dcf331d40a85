"""Stage 3: monophone GMM-HMM (Kaldi's ``steps/train_mono.sh``), then decoding of dev/test.

1. One global diagonal Gaussian (mean/variance of all training frames) copied to every pdf
   of the monophone tree (``gmm-init-mono``).
2. Flat start: each utterance's frames spread evenly over its HMM sequence
   (``align-equal-compiled``); an utterance with fewer frames than HMM states is dropped
   (reason ``too_short_for_hmm``).
3. ``num_iters`` passes of Viterbi training, re-aligning on Kaldi's schedule and growing the
   Gaussians to ``total_gauss`` (``split_by_count``).

Writes ``exp/mono/final.pkl`` (transition model, GMMs, tree), ``exp/mono/ali.pkl``
(``{utt: transition-ids [T]}``), ``exp/mono/history.json`` and the decoding results.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import numpy as np

from local.drops import record_drop
from local.gmm.align_jobs import align_jobs
from local.gmm.common import (
    GmmSystem,
    begin_stage,
    compile_graphs,
    equal_alignment,
    load_utterances,
    read_topology,
    single_gaussian_am,
    train_iterations,
)
from local.graph.decode import RECIPE_SEARCH, Search
from local.kaldi import khg

log = logging.getLogger(__name__)

REALIGN_ITERS = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 14, 16, 18, 20, 23}  # Kaldi's, cut to 25 passes


def init_mono(topo_text: str, feats: np.ndarray) -> GmmSystem:
    """Monophone system with the global Gaussian of ``feats`` ``[N, D]`` in every pdf."""
    topo = read_topology(topo_text)
    tree = khg.monophone_context_dependency(phones=topo.phones, phone2num_pdf_classes=topo.get_phone_to_num_pdf_classes())
    x = np.asarray(feats, dtype=np.float64)
    mean, var = x.mean(0), np.maximum(x.var(0), 1e-3)
    am = single_gaussian_am(np.tile(mean, (tree.num_pdfs, 1)), np.tile(var, (tree.num_pdfs, 1)))
    return GmmSystem(khg.TransitionModel(ctx_dep=tree, hmm_topo=topo), am, tree)


def flat_start(system: GmmSystem, graphs: dict, utts, data_dir: Path | None, seed: int = 0) -> dict[str, np.ndarray]:
    """Equal alignments; utterances too short for their HMM sequence are dropped and recorded."""
    alis = {}
    for utt in utts.ids:
        ali = equal_alignment(graphs[utt], len(utts.feats[utt]), seed=seed)
        if ali is None:
            log.warning("mono: %s has %d frames, fewer than its HMM states; dropped", utt, len(utts.feats[utt]))
            if data_dir is not None:
                record_drop(data_dir, "mono", "train", utt, "too_short_for_hmm", f"{len(utts.feats[utt])} frames")
            continue
        alis[utt] = ali
    return alis


def train_mono(
    data_dir: Path | str,
    num_iters: int = 25,
    total_gauss: int = 1000,
    beam: float = 10.0,
    seed: int = 0,
    augmented: bool = True,
    decode: bool = True,
    scales: tuple[float, ...] | None = None,
    search: Search = RECIPE_SEARCH,
) -> dict:
    """Train the monophone system on the training utterances (with their augmented copies: ``augmented``) and
    decode dev/test.

    Args:
        data_dir: the recipe's data directory (features and lang stages done).
        num_iters: training passes (Kaldi's train_mono uses 40; 25 converge on TTS speech).
        total_gauss: Gaussians in total at the end of mixture growth.
        beam: Viterbi alignment beam (retry beam 40).
        seed: seed of the flat start's random paths (``align-equal-compiled``) and of the mixing
            up's perturbations (``common.split_by_count``).
        scales: the acoustic-scale grid dev is searched on (default ``GMM_ACOUSTIC_SCALES``; bracketed, extended
            past an edge: ``pick_scale``).
        search: the dev and test decodings' beam and most active states (``local.graph.decode.Search``;
            ``prepare.py --beam``, ``--max-active``).
        augmented: train on the sox-augmented copies too (those that fail alignment are dropped
            and counted). Held-out-voice validation with mean-only CMVN (11 training voice settings left
            out of GMM training, their 347 clean utterances decoded): WER 21.4 % clean-only, 19.6 % with them.
        decode: decode dev and test with the final model (``exp/mono/decode_*``).

    Returns:
        a summary: utterances, pdfs, Gaussians, final log-likelihood, seconds, WERs.
    """
    start = time.perf_counter()
    data_dir, exp, lang = begin_stage(data_dir, "mono")
    utts = load_utterances(data_dir, "train", clean_only=not augmented)
    if not utts.cuts:
        raise RuntimeError(f"no training utterances in {data_dir}/features/train_cuts.jsonl.gz after OOV filtering")
    system = init_mono(lang.topo_text, np.concatenate(list(utts.feats.values())))
    graphs = compile_graphs(system, lang, {u: lang.word_ids(w) for u, w in utts.words.items()})
    alis = flat_start(system, graphs, utts, data_dir, seed=seed)
    if not alis:
        raise RuntimeError("mono: every training utterance is too short for its HMM sequence; check the features")
    load_seconds = time.perf_counter() - start
    with align_jobs(graphs, system, utts.feats):  # re-alignments in ALIGN_JOBS processes
        alis, history = train_iterations(
            system, graphs, utts, alis, num_iters, REALIGN_ITERS, total_gauss, max_iter_inc=num_iters - 5,
            data_dir=data_dir, stage="mono", beam=beam, seed=seed,
        )
        # Kaldi realigns once more with the final model to give the next stage its alignments.
        from local.gmm.common import realign_all

        alis = realign_all(system, graphs, utts, list(alis), data_dir, "mono", beam=beam)
    system.save_run(exp, alis, history)
    train_seconds = time.perf_counter() - start
    summary = {
        "utterances": len(alis),
        "dropped": len(utts.ids) - len(alis),
        **system.info(),
        "log_like_per_frame": round(history[-1]["log_like_per_frame"], 3),
        "load_seconds": round(load_seconds, 1),
        "train_seconds": round(train_seconds, 1),
    }
    log.info("mono: trained %s", summary)
    if decode:
        from local.gmm.decode import decode_system

        summary.update(decode_system(data_dir, "mono", system, lang, search=search,
                                    **({"scales": scales} if scales else {})))
    summary["seconds"] = round(time.perf_counter() - start, 1)
    (exp / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary
