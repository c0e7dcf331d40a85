"""Stage 5: speaker-adaptive training of the triphone system (Kaldi's ``steps/train_sat.sh``)
and fMLLR decoding of dev/test (``steps/decode_fmllr.sh``).

The dev and test voices of the embedded corpus are never heard in training, and a
speaker-independent triphone system spends its tree on voice differences. SAT takes the
voices out: every speaker gets an affine feature transform (fMLLR,
``local.gmm.transforms``), and the tree and Gaussians are trained on the transformed features.

1. Per-speaker fMLLR of the training data from the speaker-independent triphone system
   (``prepare.py``'s default, the LDA+MLLT system ``exp/lda_mllt``, whose 40-dim features then carry
   the whole stage, as ``train_sat.sh`` on top of ``train_lda_mllt.sh``; with ``--no-lda-mllt``, ``exp/tri``)
   and its alignments; silence frames get weight 0 (``train_sat.sh``).
2. A new tree and one Gaussian per leaf on the transformed features; alignments converted.
3. ``num_iters`` Viterbi passes, re-aligning and re-estimating the transforms with the SAT model
   (composed onto the current ones) on the passes of a schedule (``SAT_SCHEDULES``).
4. Decoding (``decode_sat``): a speaker-independent first pass with that system, fMLLR from its
   best paths (silence weight 0.01), a pass with the SAT model at the first pass's acoustic scale, a
   second fMLLR estimate from that pass, and the final pass, the only one decoded at every scale of
   dev's grid (``decode_fmllr.sh`` too decodes its passes at one scale and sweeps only the scoring).
   Speakers are those of the GMM CMVN (``features.gmm_cmvn_key``), estimated without transcripts,
   as in Kaldi's offline decoding.

Writes ``exp/sat/final.pkl``, ``tree``, ``ali.pkl``, ``history.json``, ``trans.pkl``
(``{speaker: W [D, D+1]}`` of the training speakers; ``D`` 39, or 40 on LDA+MLLT features), ``summary.json`` and
``decode_{dev,test}/`` (``recogs-*``, ``errs-*``, ``wer.json``, ``trans.pkl``, ``best_path.pkl``).
"""

from __future__ import annotations

import json
import logging
import pickle
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import numpy as np

from local.constants import GMM_PREFERRED_SCALE, SAT_ACOUSTIC_SCALES, WORD_INSERTION_PENALTIES
from local.data.features import gmm_cmvn_key
from local.gmm.align_jobs import align_jobs
from local.gmm.common import (
    GmmSystem,
    Utterances,
    begin_stage,
    compile_graphs,
    convert_alignments,
    gmm_front_end,
    load_utterances,
    realign_all,
    train_iterations,
)
from local.gmm.decode import DECODE_JOBS, PenaltyGraphs, timed
from local.gmm.sizes import resolve_sizes
from local.gmm.transforms import (
    FmllrStats,
    accumulate_fmllr_stats,
    apply_affine,
    compose_affine,
    estimate_fmllr,
)
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
from local.graph.hclg import make_hclg
from local.kaldi import kaldifst

log = logging.getLogger(__name__)

# Passes that start with a re-alignment and with a re-estimation of the training speakers' transforms.
# "kaldi" (the default): steps/train_sat.sh's schedule. "recipe": fMLLR once, at pass 20, the recipe's earlier
# one. On corpus version 3 (seed 0) Kaldi's gave the lower dev WER at every acoustic scale (6.73 %
# against 7.30 % at dev's pick; test 7.59 against 9.58 %), and the baseline DNN on its alignments dev
# 4.77 % / test 6.28 % against 4.77 / 6.15 % (docs/experiments/sat_schedule.md): dev chose it.
# Mixing up reaches the total Gaussians by pass 15 (``max_iter_inc`` below; train_sat.sh: 25). On version 4's dev
# (seed 0) 25 gave 8.55 % against 8.46 % (6 errors of 6,892 words; docs/experiments/sat_schedule.md).
SAT_SCHEDULES = {
    "kaldi": {"realign_iters": (10, 20, 30), "fmllr_iters": (2, 4, 6, 12)},
    "recipe": {"realign_iters": (10, 25), "fmllr_iters": (20,)},
}
FMLLR_MIN_FRAMES = 500.0  # fewer (silence-weighted) frames: the speaker keeps its current transform
SILENCE_WEIGHT_TRAIN = 0.0  # train_sat.sh
SILENCE_WEIGHT_DECODE = 0.01  # decode_fmllr.sh


SPEAKER_INDEPENDENT = ("tri", "lda_mllt")  # the systems SAT can start from


def speaker_independent_of(system: GmmSystem) -> str:
    """The speaker-independent system (``exp/<name>``) a SAT system was trained from and decodes its
    first pass with: the one whose features it shares (LDA+MLLT when it has a transform)."""
    return "tri" if system.transform is None else "lda_mllt"


def check_same_features(si: GmmSystem, system: GmmSystem, data_dir: Path | None) -> None:
    """Raise unless the speaker-independent ``si`` and the SAT ``system`` model the same features."""
    same = (si.transform is None and system.transform is None) or (
        si.transform is not None and system.transform is not None and np.array_equal(si.transform, system.transform))
    if not same:
        where = data_dir if data_dir is not None else "DATA_DIR"
        raise RuntimeError(f"exp/{speaker_independent_of(system)} and exp/sat of {where} model different features "
                           "(the LDA+MLLT stage was re-run after SAT); re-run the SAT stage: python "
                           f"recipes/asr/prepare.py --data-dir {where} --stage 5 --force")


def silence_tids(system: GmmSystem, sil_ids: int | Sequence[int]) -> np.ndarray:
    """``[num_transition_ids + 1]`` bool: transition-id belongs to a silence phone (SIL, and SPN/NSN where the
    lang has them: ``Lang.silence_ids``; index 0 unused)."""
    tm, sil = system.tm, {sil_ids} if isinstance(sil_ids, int) else set(sil_ids)
    return np.array([False] + [tm.transition_id_to_phone(t) in sil for t in range(1, tm.num_transition_ids + 1)])


def speaker_transforms(
    system: GmmSystem,
    feats: dict[str, np.ndarray],
    alis: dict[str, np.ndarray],
    speakers: dict[str, str],
    sil_id: int | Sequence[int],
    silence_weight: float,
    current: dict[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """One fMLLR estimate per speaker (``gmm-est-fmllr``) from the aligned frames of ``feats``
    (features as currently transformed), composed onto ``current``: ``{speaker: W [D, D+1]}``.

    Speakers without an alignment keep their current transform (or none)."""
    tid2pdf, sil = system.tid2pdf(), silence_tids(system, sil_id)
    by_speaker: dict[str, list[str]] = {}
    for utt in alis:
        by_speaker.setdefault(speakers[utt], []).append(utt)
    stats: dict[str, FmllrStats] = {}
    for spk, utt_ids in by_speaker.items():  # all of a speaker's frames at once: one pass per pdf and speaker
        tids = np.concatenate([alis[u] for u in utt_ids])
        stats[spk] = accumulate_fmllr_stats(system.am, np.concatenate([feats[u] for u in utt_ids]), tid2pdf[tids],
                                            np.where(sil[tids], silence_weight, 1.0))
    out = dict(current or {})
    gains = []
    for spk, acc in stats.items():
        W, info = estimate_fmllr(acc, num_iters=10, min_count=FMLLR_MIN_FRAMES)
        out[spk] = compose_affine(W, out[spk]) if spk in out else W
        if info["estimated"]:
            gains.append(info["aux_gain_per_frame"])
    if gains:
        log.info("fMLLR: %d of %d speakers estimated, objective gain %.3f per frame on average",
                 len(gains), len(stats), float(np.mean(gains)))
    return out


def transformed(raw: dict[str, np.ndarray], speakers: dict[str, str], transforms: dict[str, np.ndarray]) -> dict:
    """``raw`` features with each speaker's transform applied (untouched where it has none)."""
    return {u: apply_affine(transforms[speakers[u]], x) if speakers[u] in transforms else x for u, x in raw.items()}


def train_sat(
    data_dir: Path | str,
    num_leaves: int | str = "auto",
    total_gauss: int | str = "auto",
    num_iters: int = 35,
    realign_iters: set[int] | tuple[int, ...] = SAT_SCHEDULES["kaldi"]["realign_iters"],
    fmllr_iters: set[int] | tuple[int, ...] = SAT_SCHEDULES["kaldi"]["fmllr_iters"],
    beam: float = 10.0,
    decode: bool = True,
    scales: tuple[float, ...] = SAT_ACOUSTIC_SCALES,
    seed: int = 0,
    corpus: str = "synthetic",
    speaker_independent: str = "tri",
    search: Search = RECIPE_SEARCH,
) -> dict:
    """Train the SAT triphone system from ``exp/tri`` (or ``exp/lda_mllt``) and decode dev/test with fMLLR.

    Args:
        data_dir: the recipe's data directory (tri stage done).
        num_leaves: most tree leaves, or ``"auto"``: fixed before training from the hours of
            training speech (``local.gmm.sizes``: Kaldi's recipes' sizes, and 300 leaves / 2,500
            Gaussians on the default corpus, chosen on the DNNs' dev WER).
        total_gauss: Gaussians at the end of mixture growth, or ``"auto"``.
        num_iters: training passes.
        realign_iters: passes that start with a re-alignment.
        fmllr_iters: passes that start with a re-estimation of the speaker transforms.
        beam: Viterbi alignment beam (retry beam 40).
        decode: decode dev and test (``decode_sat``).
        scales: the acoustic-scale grid dev is searched on (bracketed, extended past an edge: ``pick_scale``).
        seed: seed of the mixing up's perturbations (``common.split_by_count``).
        corpus: ``prepare.py --corpus``, for ``auto`` sizes (``local.gmm.sizes.auto_sizes``: the synthetic
            corpus's rule, or recorded speech's).
        speaker_independent: the system SAT starts from, on whose features it trains: ``"tri"`` (Δ + ΔΔ)
            or ``"lda_mllt"`` (what ``prepare.py`` passes unless given ``--no-lda-mllt``).
        search: the decodings' beam and most active states (``prepare.py --beam``, ``--max-active``).

    Returns:
        a summary: speakers, leaves, pdfs, Gaussians, the sizes asked (``sizes``), log-likelihood,
        seconds, WERs.
    """
    from local.gmm.tri import build_triphone_system

    if speaker_independent not in SPEAKER_INDEPENDENT:
        raise ValueError(f"speaker_independent={speaker_independent!r}; use one of {SPEAKER_INDEPENDENT}")
    start = time.perf_counter()
    data_dir, exp, lang = begin_stage(data_dir, "sat")
    si_dir = data_dir / "exp" / speaker_independent
    utts = load_utterances(data_dir, "train", clean_only=False, transform=GmmSystem.load(si_dir / "final.pkl").transform)
    si, si_alis = GmmSystem.load_run(si_dir, utts.feats)
    raw = dict(utts.feats)
    speakers = {c.id: gmm_cmvn_key(c) for c in utts.cuts}

    trans = speaker_transforms(si, raw, si_alis, speakers, lang.silence_ids, SILENCE_WEIGHT_TRAIN)
    utts.feats.update(transformed(raw, speakers, trans))
    frames = sum(len(raw[u]) for u in si_alis)
    sizes = resolve_sizes("sat", num_leaves, total_gauss, frames, corpus)
    log.info("sat: %d leaves, %d Gaussians at most (%.2f h of training speech)", sizes["leaves"],
             sizes["gaussians"], sizes["train_hours"])
    system, tree_summary = build_triphone_system(si, si_alis, utts.feats, lang, sizes["leaves"], shared_roots=True)
    system.transform = si.transform
    (exp / "tree").write_bytes(b"\0B" + tree_summary.pop("blob"))
    alis = convert_alignments(si_alis, si, system)
    graphs = compile_graphs(system, lang, {u: lang.word_ids(utts.words[u]) for u in alis})
    log.info("sat: %d speaker transforms, tree with %d pdfs in %.1f s", len(trans), system.tm.num_pdfs,
             time.perf_counter() - start)

    def adapt(it: int, current_alis: dict) -> bool:
        nonlocal trans
        if it not in fmllr_iters:
            return False
        trans = speaker_transforms(system, utts.feats, current_alis, speakers, lang.silence_ids, SILENCE_WEIGHT_TRAIN, trans)
        utts.feats.update(transformed(raw, speakers, trans))
        return True

    with align_jobs(graphs, system, utts.feats):  # re-alignments in ALIGN_JOBS processes
        alis, history = train_iterations(
            system, graphs, utts, alis, num_iters, set(realign_iters), sizes["gaussians"],
            max_iter_inc=min(15, num_iters - 5), data_dir=data_dir, stage="sat", beam=beam, adapt=adapt, seed=seed,
        )
        alis = realign_all(system, graphs, utts, list(alis), data_dir, "sat", beam=beam)
    system.save_run(exp, alis, history)
    with open(exp / "trans.pkl", "wb") as f:
        pickle.dump(trans, f)
    summary = {
        **({"speaker_independent": speaker_independent} if speaker_independent != "tri" else {}),
        "utterances": len(alis),
        "speakers": len(trans),
        "leaves": tree_summary.get("leaves"),
        **system.info(),
        "sizes": sizes,
        "schedule": {"realign_iters": sorted(realign_iters), "fmllr_iters": sorted(fmllr_iters)},
        "log_like_per_frame": round(history[-1]["log_like_per_frame"], 3),
        "train_seconds": round(time.perf_counter() - start, 1),
    }
    log.info("sat: trained %s", summary)
    if decode:
        summary.update(decode_sat(data_dir, system, si, lang, scales, search=search))
    summary["seconds"] = round(time.perf_counter() - start, 1)
    (exp / "summary.json").write_text(json.dumps({**summary, "tree": tree_summary}, indent=1))
    return summary


def _second_transforms(hclg, system: GmmSystem, utts: Utterances, speakers: dict, sil_id: int | Sequence[int],
                       first_trans: dict, scale: float, hclg_path: Path | None = None,
                       search: Search = RECIPE_SEARCH) -> dict:
    """The first adapted pass and the second fMLLR estimate from its best paths, composed onto
    ``first_trans``. The pass decodes at ``scale``, the speaker-independent pass's (``decode_fmllr.sh``
    decodes every pass at one acoustic scale and sweeps only the scoring): it only chooses the frames
    of the second estimate, so the dev grid is decoded once per scale, on the final pass."""
    adapted = transformed(utts.feats, speakers, first_trans)
    alis: dict = {}
    decode_utterances_gmm(hclg, system.tm, system.am, adapted.items(), acoustic_scale=scale, beam=search.beam,
                          max_active=search.max_active, alignments=alis, hclg_path=hclg_path, num_jobs=DECODE_JOBS)
    return speaker_transforms(system, adapted, alis, speakers, sil_id, SILENCE_WEIGHT_DECODE, first_trans)


def _decode_final(hclg, system: GmmSystem, feats: dict, scale: float, hclg_path: Path | None = None,
                  best_paths: dict | None = None, loglikes: dict | None = None, search: Search = RECIPE_SEARCH) -> dict:
    """The final adapted pass over ``feats`` (under the second transforms) at ``scale``; ``best_paths``
    receives its transition-ids, ``loglikes``: the features' GMM log-likelihoods (``gmm_loglikes``), if kept."""
    return decode_utterances_gmm(hclg, system.tm, system.am, feats.items(), acoustic_scale=scale, beam=search.beam,
                                 max_active=search.max_active, alignments=best_paths, hclg_path=hclg_path,
                                 num_jobs=DECODE_JOBS, loglikes=loglikes)


def _score_final(graphs, system: GmmSystem, feats: dict, lang, refs: dict, out_dir: Path, split: str,
                 kept: tuple[dict, dict], loglikes: dict | None, search: Search, scale: float,
                 penalty: float = 0.0) -> float:
    """``_decode_final`` at ``(scale, penalty)`` (``graphs``: ``local.gmm.decode.PenaltyGraphs``), scored;
    its result and best paths kept by that point in ``kept``. Returns the WER (a point already decoded is not
    decoded again)."""
    by_point, paths_by_point = kept
    if (scale, penalty) in by_point:
        return by_point[(scale, penalty)]["wer"]
    hclg, hclg_path = graphs(penalty)
    start = time.perf_counter()
    hyps = _decode_final(hclg, system, feats, scale, hclg_path, paths_by_point.setdefault((scale, penalty), {}),
                         loglikes, search)
    speed = timed(start, feats)  # (the final pass alone)
    texts = {u: words_to_text(w, lang.id2word) for u, w in hyps.items()}
    by_point[(scale, penalty)] = {**score(refs, texts, out_dir, point_name(split, scale, penalty)), "speed": speed}
    return by_point[(scale, penalty)]["wer"]


def _si_decode(si_hclg, si_graph: Path, si: GmmSystem, utts: Utterances, scale: float,
               search: Search = RECIPE_SEARCH) -> tuple[dict, dict]:
    """The speaker-independent first pass of fMLLR decoding (``DECODE_JOBS`` processes reading
    ``si_graph``). Returns (hyps, best paths' transition-ids of ``si``)."""
    alis: dict = {}
    hyps = decode_utterances_gmm(si_hclg, si.tm, si.am, utts.feats.items(), acoustic_scale=scale, beam=search.beam,
                                 max_active=search.max_active, alignments=alis, hclg_path=si_graph,
                                 num_jobs=DECODE_JOBS)
    return hyps, alis


def _first_transforms(system: GmmSystem, si: GmmSystem, utts: Utterances, speakers: dict, sil_id: int | Sequence[int],
                      si_alis: dict) -> dict:
    """Each speaker's first fMLLR transform for ``system`` from the first pass's best paths."""
    return speaker_transforms(system, utts.feats, convert_alignments(si_alis, si, system), speakers, sil_id,
                              SILENCE_WEIGHT_DECODE)


def _chosen_point(dev_wer: Path, default_scale: float) -> tuple[float, float]:
    """The acoustic scale and word insertion penalty a stage picked on dev (its ``decode_dev/wer.json``;
    a data dir decoded before penalties were swept: no penalty), ``(default_scale, 0)`` without dev."""
    if not dev_wer.exists():
        return default_scale, 0.0
    res = json.loads(dev_wer.read_text())
    return res["acoustic_scale"], res.get("word_insertion_penalty", 0.0)


def decode_new_set(data_dir: Path | str, cuts) -> tuple[dict, dict, dict]:
    """fMLLR decoding of any other set's ``cuts`` (stage 1's features, ``cut.mfcc``) as
    ``decode_sat`` decodes test: the speaker-independent first pass with ``exp/tri`` (``exp/lda_mllt``
    for a SAT system on LDA+MLLT features), fMLLR per
    speaker (``gmm_cmvn_key``) from it, two adapted passes with ``exp/sat`` (the first at the
    speaker-independent system's dev-chosen scale, the final one at the SAT system's scale and word
    insertion penalty), each pass pruned as its stage's decodings were (``wer.json``'s ``search``). No
    transcripts are used. Returns ``(hyps {utt: word ids}, transforms {speaker: W}, best paths {utt: transition-ids
    of exp/sat})``."""
    data_dir = Path(data_dir)
    fix = f"run the GMM stages first: python recipes/asr/prepare.py --data-dir {data_dir} --stop-stage 5"
    sat_path = data_dir / "exp" / "sat" / "final.pkl"
    if not sat_path.exists():
        raise RuntimeError(f"No such file: {sat_path}; {fix}")
    system = GmmSystem.load(sat_path)
    si_name = speaker_independent_of(system)
    paths = {"si": data_dir / "exp" / si_name, "sat": data_dir / "exp" / "sat"}
    for exp in paths.values():
        for needed in ("final.pkl", "graph/HCLG.fst", "decode_dev/wer.json"):
            if not (exp / needed).exists():
                raise RuntimeError(f"No such file: {exp / needed}; {fix}")
    from local.graph.lang import load_lang

    lang = load_lang(data_dir / "lang")
    si = GmmSystem.load(paths["si"] / "final.pkl")
    check_same_features(si, system, data_dir)
    points = {n: _chosen_point(e / "decode_dev" / "wer.json", GMM_PREFERRED_SCALE) for n, e in paths.items()}
    searches = {n: Search.recorded(json.loads((e / "decode_dev" / "wer.json").read_text())) for n, e in paths.items()}
    cuts = list(cuts)
    utts = Utterances(cuts, gmm_front_end(cuts, transform=system.transform), {c.id: [] for c in cuts})
    speakers = {c.id: gmm_cmvn_key(c) for c in cuts}
    si_graph = paths["si"] / "graph" / "HCLG.fst"
    si_graphs = PenaltyGraphs(kaldifst.StdVectorFst.read(str(si_graph)), si_graph, lang.id2word)
    (si_scale, si_penalty), (scale, penalty) = points["si"], points["sat"]
    _, si_alis = _si_decode(*si_graphs(si_penalty), si, utts, si_scale, searches["si"])
    first = _first_transforms(system, si, utts, speakers, lang.silence_ids, si_alis)
    graph = paths["sat"] / "graph" / "HCLG.fst"
    graphs = PenaltyGraphs(kaldifst.StdVectorFst.read(str(graph)), graph, lang.id2word)
    hclg, _ = graphs(0.0)
    trans = _second_transforms(hclg, system, utts, speakers, lang.silence_ids, first, si_scale, graph, searches["sat"])
    best_paths: dict = {}
    final_hclg, final_graph = graphs(penalty)
    hyps = _decode_final(final_hclg, system, transformed(utts.feats, speakers, trans), scale, final_graph, best_paths,
                         search=searches["sat"])
    log.info("sat decoding of a new set: %d of %d utterances decoded, %d speakers", len(best_paths), len(cuts),
             len(set(speakers.values())))
    return hyps, trans, best_paths


def _first_pass(decode_dir: Path, utt_ids: set[str]) -> tuple[dict | None, float | None]:
    """The speaker-independent best paths and WER that the tri stage saved for this split, or
    ``(None, None)`` when they are missing or do not cover exactly these utterances."""
    path, wer = decode_dir / "best_path.pkl", decode_dir / "wer.json"
    if not (path.exists() and wer.exists()):
        return None, None
    with open(path, "rb") as f:
        alis = pickle.load(f)
    if not alis or not set(alis) <= utt_ids:  # (utterances the decoder failed on have no path)
        return None, None
    return alis, json.loads(wer.read_text())["wer"]


def decode_sat(data_dir: Path | str, system: GmmSystem, si: GmmSystem, lang,
               scales: tuple[float, ...] = SAT_ACOUSTIC_SCALES,
               penalties: tuple[float, ...] = WORD_INSERTION_PENALTIES, search: Search = RECIPE_SEARCH) -> dict:
    """fMLLR decoding of dev and test with the SAT system. The first pass is the speaker-independent
    system's (``si``: ``exp/tri``, or ``exp/lda_mllt`` on LDA+MLLT features) decoding at its own
    dev-chosen scale and penalty (its stage's ``best_path.pkl``, decoded again if missing); the first
    adapted pass decodes at that system's scale with no penalty (``_second_transforms``); the final pass
    is swept on dev as ``local.gmm.decode.decode_system`` sweeps (the scale by ``pick_scale``'s bracketing
    search, then the penalty by ``pick_penalty``) and decoded on test at dev's pick (``GMM_PREFERRED_SCALE``
    and no penalty without dev).

    Returns:
        ``{"dev_wer", "test_wer", "dev_si_wer", "test_si_wer", "acoustic_scale", "word_insertion_penalty",
        "decode_seconds"}``.
    """
    start = time.perf_counter()
    data_dir = Path(data_dir)
    exp = data_dir / "exp" / "sat"
    hclg_path = exp / "graph" / "HCLG.fst"
    hclg = make_hclg(lang.dir, system.tree, system.tm, out_path=hclg_path)
    graphs = PenaltyGraphs(hclg, hclg_path, lang.id2word)
    check_same_features(si, system, data_dir)
    si_dir = data_dir / "exp" / speaker_independent_of(system)
    si_graphs = None
    si_scale, si_penalty = _chosen_point(si_dir / "decode_dev" / "wer.json", GMM_PREFERRED_SCALE)
    results: dict = {}
    best_point = None
    for split in ("dev", "test"):
        if not (data_dir / "features" / f"{split}_cuts.jsonl.gz").exists():
            continue
        utts = load_utterances(data_dir, split, transform=system.transform)
        speakers = {c.id: gmm_cmvn_key(c) for c in utts.cuts}
        refs = {c.id: " ".join(utts.words[c.id]) for c in utts.cuts}
        out_dir = exp / f"decode_{split}"
        si_alis, si_wer = _first_pass(si_dir / f"decode_{split}", set(utts.ids))
        if si_alis is None:  # the first-pass system's best paths are missing or stale: decode again
            if si_graphs is None:
                si_graph = si_dir / "graph" / "HCLG.fst"
                si_hclg = (kaldifst.StdVectorFst.read(str(si_graph)) if si_graph.exists()
                           else make_hclg(lang.dir, si.tree, si.tm, out_path=si_graph))
                si_graphs = PenaltyGraphs(si_hclg, si_graph, lang.id2word)
            si_hyps, si_alis = _si_decode(*si_graphs(si_penalty), si, utts, si_scale, search)
            si_wer = score(refs, {u: words_to_text(w, lang.id2word) for u, w in si_hyps.items()}, out_dir,
                           point_name(f"{split}-si", si_scale, si_penalty))["wer"]
        first = _first_transforms(system, si, utts, speakers, lang.silence_ids, si_alis)
        trans = _second_transforms(hclg, system, utts, speakers, lang.silence_ids, first, si_scale, hclg_path, search)
        final = transformed(utts.feats, speakers, trans)  # the final pass's features, every scale's
        loglikes = gmm_loglikes(system.am, final.items()) if split == "dev" else None
        by_point, paths_by_point = {}, {}
        wer = partial(_score_final, graphs, system, final, lang, refs, out_dir, split, (by_point, paths_by_point),
                      loglikes, search)
        if split == "dev":
            scale, grid = pick_scale(wer, scales, GMM_PREFERRED_SCALE, bracket=True)
            penalty, by_penalty = pick_penalty(partial(wer, scale), penalties)
            best_point = (scale, penalty)
        else:
            scale, penalty = best_point or (GMM_PREFERRED_SCALE, 0.0)
            wer(scale, penalty)
        res = {**by_point[(scale, penalty)], "acoustic_scale": scale, "word_insertion_penalty": penalty,
               "si_first_pass_wer": si_wer, "speakers": len(set(speakers.values())), "search": search.record()}
        if split == "dev":
            res["by_scale"] = {str(s): by_point[(s, 0.0)]["wer"] for s in grid["grid"]}
            res["by_penalty"] = {str(p): w for p, w in by_penalty.items()}
            res["grid"] = grid
        (out_dir / "wer.json").write_text(json.dumps(res, indent=1))
        with open(out_dir / "trans.pkl", "wb") as f:
            pickle.dump(trans, f)
        with open(out_dir / "best_path.pkl", "wb") as f:  # the DNN's fbank_sat transforms start from them
            pickle.dump(paths_by_point[(scale, penalty)], f)
        results[f"{split}_wer"], results[f"{split}_si_wer"] = res["wer"], si_wer
        log.info("sat %s: WER %.2f %% with fMLLR at acoustic scale %g, word insertion penalty %g (first pass "
                 "%.2f %%)", split, res["wer"], scale, penalty, si_wer)
    results["acoustic_scale"], results["word_insertion_penalty"] = best_point or (None, None)
    results["decode_seconds"] = round(time.perf_counter() - start, 1)
    return results
