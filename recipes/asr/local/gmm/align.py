"""Stage 6: the DNN targets: fMLLR alignments of train and dev with the speaker-adaptive (SAT)
system, as Kaldi's ``steps/align_fmllr.sh`` makes them for nnet1, plus pdf priors and the
agreement of the alignments with the TTS engines' own phone timings.

``align_fmllr.sh`` on dev: (1) align with the speaker-independent model (here ``exp/tri``, or
``exp/lda_mllt`` when the SAT system was trained on its LDA+MLLT features),
(2) estimate each speaker's fMLLR transform from that alignment with the SAT model (silence
frames weigh 0), (3) align the adapted features with the SAT model. Train takes the SAT
stage's own final alignments and transforms (the final model on the final transforms: what
``align_fmllr.sh`` would compute again, for minutes); ``reuse_train=False`` runs
``align_fmllr`` on train too. The DNN then decodes with the SAT system's tree and graph
(``exp/sat/graph/HCLG.fst``). ``system="tri"`` keeps the older speaker-independent targets
(the triphone system, no transforms) for comparison.

Writes under ``<data_dir>/ali/``:

- ``{train,dev}_cuts.jsonl.gz``: the feature cuts with ``cut.pdf_ali``, a Lhotse
  ``TemporalArray`` of pdf-ids (int32, frame shift 0.01 s, exactly one per fbank frame),
  stored losslessly with ``NumpyFilesWriter`` under ``ali/{split}_pdf_ali/``. Train holds the
  clean utterances and their augmented copies (each aligned on its own audio).
- ``priors.npy``: ``[num_pdfs]`` float32 pdf priors: training frames per pdf / all frames,
  floored at ``PRIOR_FLOOR`` / num_pdfs (rare pdfs would otherwise get huge pseudo-likelihoods
  from ``log p(pdf|x) - log p(pdf)``), renormalised.
- ``trans_{train,dev}.pkl``: the speakers' fMLLR transforms of the GMM features (SAT only;
  ``{speaker: W [39, 40]}``, ``[40, 41]`` on LDA+MLLT features), which the classic nnet1 input
  (``features="mfcc_fmllr"``) uses.
- ``info.json``: the system (``system``, ``model``, ``graph``), pdfs, frames and utterances per
  split, drops, phone agreement.

Utterances with an OOV word (dev), too few frames for their HMM sequence, or no Viterbi path
even at the retry beam are dropped and recorded (stage ``align``).
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from local.atomic import atomic_path, write_json
from local.data.features import gmm_cmvn_key
from local.drops import clear_drops, record_drop
from local.gmm.common import (
    GmmSystem,
    compile_graphs,
    equal_alignment,
    is_augmented,
    viterbi_align,
)
from local.gmm.tree_stats import TidTables
from local.graph.lang import cut_words, load_lang

log = logging.getLogger(__name__)

FRAME_SHIFT = 0.01
PRIOR_FLOOR = 0.1  # a pdf's prior is at least a tenth of the uniform prior (pdf_priors)


# ---------------------------------------------------------------- agreement with gold timings
def gold_frame_labels(cut, num_frames: int) -> list[str | None]:
    """The gold phone at each frame's centre (``t * 10 ms + 5 ms``), None where unknown.

    Gold timings are ``supervision.alignment["phone"]`` items (ARPAbet without stress, ``SIL``),
    in the cut's time frame (the synthetic corpus has one supervision starting at 0).
    """
    labels: list[str | None] = [None] * num_frames
    for sup in cut.supervisions:
        items = (sup.alignment or {}).get("phone") or []
        for item in items:
            start = sup.start + item.start
            first = max(int(np.ceil((start - 0.005) / FRAME_SHIFT - 1e-6)), 0)
            last = min(int(np.ceil((start + item.duration - 0.005) / FRAME_SHIFT - 1e-6)), num_frames)
            for t in range(first, last):
                labels[t] = item.symbol
    return labels


def phone_agreement(cuts, alis: dict[str, np.ndarray], tables: TidTables, id2phone: dict[int, str]) -> dict:
    """Frame-level agreement of alignments with the gold phone timings of the cuts.

    Args:
        cuts: cuts with gold timings (``supervision.alignment["phone"]``); others are skipped.
        alis: ``{cut id: transition-ids [T]}``.
        tables: ``TidTables`` of the model that produced ``alis``.
        id2phone: phone id -> name (``phones.txt``).

    Returns:
        ``{"overall", "within_1_frame", "frames", "utterances", "per_speaker", "per_engine"}``:
        fractions of the frames whose gold label is a phone of ``id2phone`` (frames whose gold
        label is unknown are skipped); ``within_1_frame`` also accepts the aligned phone of a
        neighbouring frame. ``overall`` is None when no cut has gold timings.
    """
    known = set(id2phone.values())
    hits = defaultdict(lambda: np.zeros(3))  # group -> (agree, agree within 1, frames)
    utts = 0
    for cut in cuts:
        ali = alis.get(cut.id)
        if ali is None or not any((s.alignment or {}).get("phone") for s in cut.supervisions):
            continue
        hyp = np.array([id2phone[p] for p in tables.phone[np.asarray(ali, dtype=np.int64)]])
        gold = gold_frame_labels(cut, len(hyp))
        keep = np.array([g is not None and g in known for g in gold])
        if not keep.any():
            continue
        ref = np.array([g if g is not None else "" for g in gold])
        same = hyp == ref
        near = same.copy()
        near[1:] |= hyp[:-1] == ref[1:]
        near[:-1] |= hyp[1:] == ref[:-1]
        counts = np.array([same[keep].sum(), near[keep].sum(), keep.sum()], dtype=float)
        sup = cut.supervisions[0]
        engine = (sup.custom or {}).get("engine", "unknown")
        for group in ("overall", f"speaker:{sup.speaker}", f"engine:{engine}"):
            hits[group] += counts
        utts += 1
    if not hits:
        return {"overall": None, "within_1_frame": None, "frames": 0, "utterances": 0, "per_speaker": {}, "per_engine": {}}
    frac = lambda g: round(float(hits[g][0] / hits[g][2]), 4)
    return {
        "overall": frac("overall"),
        "within_1_frame": round(float(hits["overall"][1] / hits["overall"][2]), 4),
        "frames": int(hits["overall"][2]),
        "utterances": utts,
        "per_speaker": {g.split(":", 1)[1]: frac(g) for g in sorted(hits) if g.startswith("speaker:")},
        "per_engine": {g.split(":", 1)[1]: frac(g) for g in sorted(hits) if g.startswith("engine:")},
    }


# ---------------------------------------------------------------- the stage
def align_cuts(
    system: GmmSystem, lang, cuts, data_dir: Path | None, split: str, beam: float = 10.0, retry_beam: float = 40.0,
    feats: dict[str, np.ndarray] | None = None, seed: int = 0,
) -> dict[str, np.ndarray]:
    """Viterbi transition-id alignments ``{cut id: [T]}`` of ``cuts``; failures are recorded
    (reasons ``oov``, ``too_short_for_hmm``, ``alignment_failed``; not when ``data_dir`` is None)
    and left out. ``feats``: the GMM features per cut (None: ``system.features(cuts)``). ``seed``: of
    the equal alignment that tells an utterance too short for its HMM sequence (random paths)."""
    def drop(cut_id: str, reason: str, detail: str) -> None:
        log.warning("align: %s %s dropped: %s (%s)", split, cut_id, reason, detail)
        if data_dir is not None:
            record_drop(data_dir, "align", split, cut_id, reason, detail)

    word_ids = {}
    for cut in cuts:
        words = cut_words(cut)
        oov = sorted(set(lang.oov_words(words)))  # (none with an unknown word: --oov unk maps them)
        if oov or not words:
            drop(cut.id, "oov" if oov else "empty_transcript", " ".join(oov))
        else:
            word_ids[cut.id] = lang.word_ids(words)
    graphs = compile_graphs(system, lang, word_ids)
    alis = {}
    front_end = system.features(cuts) if feats is None else feats
    for cut in tqdm([c for c in cuts if c.id in graphs], desc=f"align {split}", unit="utt", leave=False):
        feats = front_end[cut.id]
        if equal_alignment(graphs[cut.id], len(feats), seed=seed) is None:
            drop(cut.id, "too_short_for_hmm", f"{len(feats)} frames")
            continue
        ali, _ = viterbi_align(system, graphs[cut.id], feats, cut.id, beam=beam, retry_beam=retry_beam)
        if ali is None:
            drop(cut.id, "alignment_failed", f"no path at retry_beam={retry_beam}")
            continue
        alis[cut.id] = ali
    return alis


def write_pdf_alignments(cuts, pdf_alis: dict[str, np.ndarray], out_dir: Path, split: str) -> int:
    """Attach ``cut.pdf_ali`` (int32 ``[T]``, one per fbank frame) and write ``{split}_cuts.jsonl.gz``,
    without the supervisions' gold phone timings (used only to check the alignments, and most of
    a cut's parsing time and memory when the DNN's loader reads the manifest every epoch).

    Returns:
        the number of frames written.
    """
    from lhotse import CutSet, NumpyFilesWriter

    kept, frames = [], 0
    with NumpyFilesWriter(out_dir / f"{split}_pdf_ali") as writer:
        for cut in cuts:
            pdf = pdf_alis.get(cut.id)
            if pdf is None:
                continue
            if len(pdf) != cut.features.num_frames:
                raise RuntimeError(
                    f"{cut.id}: {len(pdf)} alignment frames but {cut.features.num_frames} fbank frames; "
                    "the MFCC and fbank framings differ (both must use snip_edges=False)"
                )
            arr = writer.store_array(cut.id, pdf.astype(np.int32), frame_shift=FRAME_SHIFT, temporal_dim=0, start=cut.start)
            kept.append(cut.drop_alignments().with_custom("pdf_ali", arr))
            frames += len(pdf)
    with atomic_path(out_dir / f"{split}_cuts.jsonl.gz") as tmp:
        CutSet.from_cuts(kept).to_file(tmp)
    return frames


def align_fmllr(sat: GmmSystem, si: GmmSystem, lang, cuts, data_dir: Path | None, split: str, beam: float = 10.0,
                retry_beam: float = 40.0, seed: int = 0) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Kaldi's ``align_fmllr.sh`` on one split: speaker-independent alignment with ``si`` (of the same
    features as ``sat``), one
    fMLLR transform per speaker (``features.gmm_cmvn_key``) estimated with ``sat`` from it
    (silence weight 0), then the SAT alignment of the adapted features.

    Returns:
        ``({cut id: SAT transition-ids [T]}, {speaker: W [D, D+1]})``.
    """
    from local.gmm.common import convert_alignments
    from local.gmm.sat import SILENCE_WEIGHT_TRAIN, check_same_features, speaker_transforms, transformed

    check_same_features(si, sat, data_dir)

    raw = sat.features(cuts)
    speakers = {c.id: gmm_cmvn_key(c) for c in cuts}
    si_alis = align_cuts(si, lang, cuts, None, f"{split} (speaker-independent pass)", beam, retry_beam, raw, seed)
    trans = speaker_transforms(sat, raw, convert_alignments(si_alis, si, sat), speakers, lang.silence_ids,
                               SILENCE_WEIGHT_TRAIN)
    alis = align_cuts(sat, lang, cuts, data_dir, split, beam, retry_beam, transformed(raw, speakers, trans), seed)
    return alis, trans


def pdf_priors(counts: np.ndarray, floor: float = 0.0) -> np.ndarray:
    """``[num_pdfs]`` float32 priors from training frame counts: relative frequencies floored at
    ``floor / num_pdfs`` (pdfs never or rarely seen get that much), renormalised to sum 1."""
    counts = np.asarray(counts, dtype=np.float64)
    if counts.sum() <= 0:
        raise ValueError("no training frames to estimate pdf priors from; check ali/info.json and dropped.jsonl")
    priors = np.maximum(counts / counts.sum(), floor / len(counts))
    return (priors / priors.sum()).astype(np.float32)


def sat_training_alignments(data_dir: Path, cuts) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The SAT stage's final alignments of the training cuts and its speakers' transforms
    (``exp/sat/ali.pkl``, ``trans.pkl``): the final model's Viterbi alignment of the features
    transformed by the final transforms, which is what ``align_fmllr`` would estimate and align
    again from scratch (minutes on the default corpus)."""
    import pickle

    with open(data_dir / "exp" / "sat" / "ali.pkl", "rb") as f:
        alis = pickle.load(f)
    with open(data_dir / "exp" / "sat" / "trans.pkl", "rb") as f:
        trans = pickle.load(f)
    wanted = {c.id for c in cuts}
    missing = wanted - set(alis)
    for cut_id in sorted(missing):
        record_drop(data_dir, "align", "train", cut_id, "alignment_failed", "no SAT training alignment (exp/sat/ali.pkl)")
    return {u: a for u, a in alis.items() if u in wanted}, trans


def align(data_dir: Path | str, system: str = "sat", beam: float = 10.0, retry_beam: float = 40.0,
          prior_floor: float = PRIOR_FLOOR, reuse_train: bool = True, seed: int = 0) -> dict:
    """Stage 6: align train (clean + augmented) and dev; write the pdf-id cuts, priors,
    transforms and ``info.json``; measure agreement with the TTS gold timings.

    Args:
        system: ``"sat"``: fMLLR alignments with ``exp/sat`` (``align_fmllr``); ``"tri"``: the
            speaker-independent triphone system's alignments (the recipe's older targets).
        prior_floor: priors are floored at ``prior_floor / num_pdfs`` (``pdf_priors``).
        reuse_train: with ``"sat"``, take train's alignments and transforms from the SAT stage
            (``sat_training_alignments``) instead of running ``align_fmllr`` on train again.
        seed: of the equal alignments that find utterances too short for their HMM sequence
            (``align_cuts``); the stage has no other random step.

    Returns:
        a summary (system, pdfs, frames and utterances per split, phone agreement, seconds).
    """
    import pickle

    from lhotse import CutSet

    if system not in ("sat", "tri"):
        raise ValueError(f"system={system!r}; use 'sat' (fMLLR alignments, the default) or 'tri'")
    torch.set_num_threads(1)
    start = time.perf_counter()
    data_dir = Path(data_dir)
    out = data_dir / "ali"
    out.mkdir(parents=True, exist_ok=True)
    clear_drops(data_dir, "align")
    lang = load_lang(data_dir / "lang")
    final = GmmSystem.load(data_dir / "exp" / system / "final.pkl")
    if system == "sat":
        from local.gmm.sat import speaker_independent_of

        si = GmmSystem.load(data_dir / "exp" / speaker_independent_of(final) / "final.pkl")
    tid2pdf = final.tid2pdf()
    tables = TidTables.from_transition_model(final.tm)
    id2phone = {i: p for p, i in lang.phones.items()}
    info: dict = {"system": system, "model": f"exp/{system}/final.pkl", "graph": f"exp/{system}/graph/HCLG.fst",
                  "num_pdfs": final.tm.num_pdfs, "splits": {}}
    counts = np.zeros(final.tm.num_pdfs, dtype=np.float64)
    agreement = {}
    for split in ("train", "dev"):
        path = data_dir / "features" / f"{split}_cuts.jsonl.gz"
        if not path.exists():
            if split == "train":
                raise RuntimeError(f"{path} is missing; run prepare.py --stage 1 first")
            continue
        cuts = list(CutSet.from_file(path))
        if split == "train" and (data_dir / "lang" / "train_ids.txt").exists():
            kept_ids = set((data_dir / "lang" / "train_ids.txt").read_text().split())
            kept_ids |= {c.id for c in cuts if is_augmented(c) and c.id.removesuffix("-aug") in kept_ids}
            cuts = [c for c in cuts if c.id in kept_ids]
        if system == "sat" and split == "train" and reuse_train:
            alis, trans = sat_training_alignments(data_dir, cuts)
        elif system == "sat":
            alis, trans = align_fmllr(final, si, lang, cuts, data_dir, split, beam=beam, retry_beam=retry_beam,
                                      seed=seed)
        if system == "sat":
            with atomic_path(out / f"trans_{split}.pkl") as tmp, open(tmp, "wb") as f:
                pickle.dump(trans, f)
        else:
            alis = align_cuts(final, lang, cuts, data_dir, split, beam=beam, retry_beam=retry_beam, seed=seed)
        pdf_alis = {u: tid2pdf[a].astype(np.int32) for u, a in alis.items()}
        frames = write_pdf_alignments(cuts, pdf_alis, out, split)
        if split == "train":
            for pdf in pdf_alis.values():
                counts += np.bincount(pdf, minlength=len(counts))
            clean = [c for c in cuts if not is_augmented(c)]
            agreement = phone_agreement(clean, alis, tables, id2phone)
            augmented = phone_agreement([c for c in cuts if is_augmented(c)], alis, tables, id2phone)
            for other in ("mono", "tri", "lda_mllt"):
                other_ali = data_dir / "exp" / other / "ali.pkl"
                if other != system and other_ali.exists():
                    model = GmmSystem.load(data_dir / "exp" / other / "final.pkl")
                    with open(other_ali, "rb") as f:
                        agreement[other] = phone_agreement(clean, pickle.load(f),
                                                           TidTables.from_transition_model(model.tm), id2phone)["overall"]
            agreement["augmented"] = augmented["overall"]
        else:
            agreement[split] = phone_agreement(cuts, alis, tables, id2phone)["overall"]
        info["splits"][split] = {"utterances": len(pdf_alis), "dropped": len(cuts) - len(pdf_alis), "frames": frames}
    with atomic_path(out / "priors.npy") as tmp:
        np.save(tmp, pdf_priors(counts, prior_floor))
    info["num_frames"] = int(counts.sum())
    info["pdfs_unseen_in_train"] = int((counts == 0).sum())
    info["pdfs_floored"] = int((counts / counts.sum() < prior_floor / len(counts)).sum())
    info["prior_floor"] = prior_floor
    info["phone_agreement"] = agreement
    info["seconds"] = round(time.perf_counter() - start, 1)
    write_json(out / "info.json", info)
    summary = {
        "system": system,
        "num_pdfs": info["num_pdfs"],
        "train_utts": info["splits"]["train"]["utterances"],
        "train_frames": info["splits"]["train"]["frames"],
        "dev_utts": info["splits"].get("dev", {}).get("utterances", 0),
        "pdfs_floored": info["pdfs_floored"],
        "phone_agreement": agreement.get("overall"),
        "phone_agreement_tri": agreement.get("tri"),
        "phone_agreement_mono": agreement.get("mono"),
        **({"phone_agreement_lda_mllt": agreement["lda_mllt"]} if "lda_mllt" in agreement else {}),
        "seconds": info["seconds"],
    }
    log.info("align: %s", summary)
    return summary
