"""Stage 4: triphone GMM-HMM on a phonetic decision tree (Kaldi's ``steps/train_deltas.sh``),
then decoding of dev/test.

1. Tree statistics (per triphone context and pdf-class) from the monophone alignments
   (``acc-tree-stats``); questions by phone clustering; tree grown by likelihood gain
   (``local.gmm.tree.build_tree``).
2. One Gaussian per leaf from the tree statistics (``gmm-init-model``); the monophone
   alignments mapped onto the new tree frame by frame (``convert-ali``).
3. ``num_iters`` Viterbi passes with re-alignment and mixture growth to ``total_gauss``.

Writes ``exp/tri/final.pkl``, ``exp/tri/tree`` (Kaldi binary), ``exp/tri/ali.pkl``,
``exp/tri/history.json`` and the decoding results.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import numpy as np

from local.gmm.align_jobs import align_jobs
from local.gmm.common import (
    GmmSystem,
    begin_stage,
    compile_graphs,
    convert_alignments,
    load_utterances,
    realign_all,
    single_gaussian_am,
    train_iterations,
)
from local.gmm.sizes import resolve_sizes
from local.gmm.tree import build_tree
from local.gmm.tree_stats import TidTables, accumulate_tree_stats
from local.graph.decode import RECIPE_SEARCH, Search
from local.kaldi import khg

log = logging.getLogger(__name__)

REALIGN_ITERS = {10, 20, 30}  # Kaldi's train_deltas.sh (35 passes)


def build_triphone_system(mono: GmmSystem, alis: dict[str, np.ndarray], feats: dict[str, np.ndarray],
                          lang, num_leaves: int, min_count: float = 100.0, thresh: float = 300.0,
                          shared_roots: bool = False) -> tuple[GmmSystem, dict]:
    """Tree from the monophone alignments and a one-Gaussian-per-leaf triphone system
    (``shared_roots``: one root per phone whose questions include the pdf-class, Kaldi's default).

    Returns:
        the system and the tree builder's summary.
    """
    tables = TidTables.from_transition_model(mono.tm)
    ids = list(alis)
    stats = accumulate_tree_stats([alis[u] for u in ids], [feats[u] for u in ids], tables)
    topo = mono.tm.topo
    result = build_tree(
        stats,
        questions=None,
        silence_phones=lang.silence_ids,
        phones=lang.phone_ids,
        num_pdf_classes=topo.get_phone_to_num_pdf_classes(),
        num_leaves=num_leaves,
        min_count=min_count,
        thresh=thresh,
        share_pdf_classes=shared_roots,
    )
    tm = khg.TransitionModel(ctx_dep=result.tree, hmm_topo=topo)
    system = GmmSystem(tm, single_gaussian_am(result.means, result.variances), result.tree)
    return system, {**result.summary, "blob": result.blob}


def train_tri(
    data_dir: Path | str,
    num_leaves: int | str = "auto",
    total_gauss: int | str = "auto",
    num_iters: int = 35,
    beam: float = 10.0,
    augmented: bool = True,
    shared_roots: bool = True,
    min_count: float = 100.0,
    decode: bool = True,
    scales: tuple[float, ...] | None = None,
    search: Search = RECIPE_SEARCH,
    seed: int = 0,
    corpus: str = "synthetic",
) -> dict:
    """Train the triphone system from ``exp/mono`` and decode dev/test.

    Args:
        data_dir: the recipe's data directory (mono stage done).
        num_leaves: most tree leaves (Kaldi's ``numleaves``), or ``"auto"``: fixed before training
            from the hours of training speech (``local.gmm.sizes``: Kaldi's recipes' sizes, and
            150 leaves / 2,000 Gaussians on the default corpus).
        total_gauss: Gaussians at the end of mixture growth (Kaldi's ``totgauss``), or ``"auto"``.
            The default corpus's sizes were chosen (with mean-only CMVN) on a held-out-voice
            validation (11 training voice settings left out of GMM training and decoded; monophone
            19.6 %): with shared roots and augmented data, 150 leaves gave 23.3 % at 600 Gaussians,
            19.9 / 18.8 % (two runs) at 1000, 18.7 % at 1500; 300 leaves / 1000 gave 22.0 %;
            separate roots per HMM state 22.3 %. 1,500 was that grid's edge; on version 4's dev (the main
            job's monophone system, seed 0) 150 leaves gave 18.40 / 17.72 / 18.09 % at 1,500 / 2,000 / 3,000
            Gaussians, so the default is 2,000.
        num_iters: training passes (Kaldi's train_deltas uses 35, re-aligning at 10, 20, 30).
        beam: Viterbi alignment beam (retry beam 40).
        scales: the acoustic-scale grid dev is searched on (default ``GMM_ACOUSTIC_SCALES``; bracketed, extended
            past an edge: ``pick_scale``).
        search: the dev and test decodings' beam and most active states (``local.graph.decode.Search``;
            ``prepare.py --beam``, ``--max-active``).
        augmented: train on the sox-augmented copies too (speed/noise/reverb variety acts like
            more voices); needs a monophone trained the same way (its alignments seed the tree).
        shared_roots: one tree root per phone shared by its HMM states (Kaldi's ``roots.txt``
            "shared split"), so the leaves go where the data says instead of 3 per phone up front.
        min_count: fewest frames on each side of a tree split.
        decode: decode dev and test (``exp/tri/decode_*``).
        seed: seed of the mixing up's perturbations (``common.split_by_count``).
        corpus: ``prepare.py --corpus``, for ``auto`` sizes (``local.gmm.sizes.auto_sizes``: the synthetic
            corpus's rule, or recorded speech's).

    Returns:
        a summary: leaves, pdfs, Gaussians, the sizes asked (``sizes``), final log-likelihood,
        seconds, WERs.
    """
    start = time.perf_counter()
    data_dir, exp, lang = begin_stage(data_dir, "tri")
    utts = load_utterances(data_dir, "train", clean_only=not augmented)
    mono, mono_alis = GmmSystem.load_run(data_dir / "exp" / "mono", utts.feats)
    frames = sum(len(utts.feats[u]) for u in mono_alis)
    sizes = resolve_sizes("tri", num_leaves, total_gauss, frames, corpus)
    log.info("tri: %d leaves, %d Gaussians at most (%.2f h of training speech)", sizes["leaves"],
             sizes["gaussians"], sizes["train_hours"])
    system, tree_summary = build_triphone_system(
        mono, mono_alis, utts.feats, lang, sizes["leaves"], min_count=min_count, shared_roots=shared_roots
    )
    # Kaldi's binary file form ("\0B" header, then the blob), which Kaldi tools and khg read back.
    (exp / "tree").write_bytes(b"\0B" + tree_summary.pop("blob"))
    alis = convert_alignments(mono_alis, mono, system)
    graphs = compile_graphs(system, lang, {u: lang.word_ids(utts.words[u]) for u in alis})
    tree_seconds = time.perf_counter() - start
    log.info("tri: tree with %d pdfs in %.1f s; %d alignments converted", system.tm.num_pdfs, tree_seconds, len(alis))

    with align_jobs(graphs, system, utts.feats):  # re-alignments in ALIGN_JOBS processes
        alis, history = train_iterations(
            system, graphs, utts, alis, num_iters, REALIGN_ITERS, sizes["gaussians"], max_iter_inc=min(25, num_iters - 5),
            data_dir=data_dir, stage="tri", beam=beam, seed=seed,
        )
        alis = realign_all(system, graphs, utts, list(alis), data_dir, "tri", beam=beam)
    system.save_run(exp, alis, history)
    summary = {
        "utterances": len(alis),
        "leaves": tree_summary.get("leaves"),
        **system.info(),
        "sizes": sizes,
        "log_like_per_frame": round(history[-1]["log_like_per_frame"], 3),
        "tree_seconds": round(tree_seconds, 1),
        "train_seconds": round(time.perf_counter() - start, 1),
    }
    log.info("tri: trained %s", summary)
    if decode:
        from local.gmm.decode import decode_system

        summary.update(decode_system(data_dir, "tri", system, lang, search=search,
                                    **({"scales": scales} if scales else {})))
    summary["seconds"] = round(time.perf_counter() - start, 1)
    (exp / "summary.json").write_text(json.dumps({**summary, "tree": tree_summary}, indent=1))
    return summary
