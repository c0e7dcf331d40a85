"""Stage 6: final alignments with the triphone GMM, as DNN targets, plus pdf priors and the
agreement of the alignments with the TTS engines' own phone timings.

Writes under ``<data_dir>/ali/``:

- ``{train,dev}_cuts.jsonl.gz``: the feature cuts with ``cut.pdf_ali``, a Lhotse
  ``TemporalArray`` of pdf-ids (int32, frame shift 0.01 s, exactly one per fbank frame),
  stored losslessly with ``NumpyFilesWriter`` under ``ali/{split}_pdf_ali/``. Train holds the
  clean utterances and their augmented copies (each aligned on its own audio).
- ``priors.npy``: ``[num_pdfs]`` float32, (training frames per pdf + 1) normalised to sum 1.
- ``info.json``: pdfs, frames and utterances per split, drops, phone agreement.

Utterances with an OOV word (dev), too few frames for their HMM sequence, or no Viterbi path
even at the retry beam are dropped and recorded (stage ``align``).
"""

from __future__ import annotations

import json
import logging
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from local.drops import clear_drops, record_drop
from local.gmm_common import (
    GmmSystem,
    compile_graphs,
    equal_alignment,
    gmm_front_end,
    is_augmented,
    viterbi_align,
)
from local.lang import cut_words, load_lang
from local.tree_stats import TidTables

log = logging.getLogger(__name__)

FRAME_SHIFT = 0.01


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
    system: GmmSystem, lang, cuts, data_dir: Path | None, split: str, beam: float = 10.0, retry_beam: float = 40.0
) -> dict[str, np.ndarray]:
    """Viterbi transition-id alignments ``{cut id: [T]}`` of ``cuts``; failures are recorded
    (reasons ``oov``, ``too_short_for_hmm``, ``alignment_failed``) and left out."""
    def drop(cut_id: str, reason: str, detail: str) -> None:
        log.warning("align: %s %s dropped: %s (%s)", split, cut_id, reason, detail)
        if data_dir is not None:
            record_drop(data_dir, "align", split, cut_id, reason, detail)

    word_ids = {}
    for cut in cuts:
        words = cut_words(cut)
        oov = sorted({w for w in words if w not in lang.words})
        if oov or not words:
            drop(cut.id, "oov" if oov else "empty_transcript", " ".join(oov))
        else:
            word_ids[cut.id] = lang.word_ids(words)
    graphs = compile_graphs(system, lang, word_ids)
    alis = {}
    front_end = gmm_front_end(cuts)
    for cut in tqdm([c for c in cuts if c.id in graphs], desc=f"align {split}", unit="utt", leave=False):
        feats = front_end[cut.id]
        if equal_alignment(graphs[cut.id], len(feats)) is None:
            drop(cut.id, "too_short_for_hmm", f"{len(feats)} frames")
            continue
        ali, _ = viterbi_align(system, graphs[cut.id], feats, cut.id, beam=beam, retry_beam=retry_beam)
        if ali is None:
            drop(cut.id, "alignment_failed", f"no path at retry_beam={retry_beam}")
            continue
        alis[cut.id] = ali
    return alis


def write_pdf_alignments(cuts, pdf_alis: dict[str, np.ndarray], out_dir: Path, split: str) -> int:
    """Attach ``cut.pdf_ali`` (int32 ``[T]``, one per fbank frame) and write ``{split}_cuts.jsonl.gz``.

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
            arr = writer.store_array(cut.id, pdf.astype(np.int32), frame_shift=FRAME_SHIFT, temporal_dim=0, start=0)
            kept.append(cut.with_custom("pdf_ali", arr))
            frames += len(pdf)
    CutSet.from_cuts(kept).to_file(out_dir / f"{split}_cuts.jsonl.gz")
    return frames


def align(data_dir: Path | str, beam: float = 10.0, retry_beam: float = 40.0) -> dict:
    """Stage 6: align train (clean + augmented) and dev with ``exp/tri/final.pkl``; write the
    pdf-id cuts, priors and ``info.json``; measure agreement with the TTS gold timings.

    Returns:
        a summary (pdfs, frames and utterances per split, phone agreement, seconds).
    """
    import pickle

    from lhotse import CutSet

    torch.set_num_threads(1)
    start = time.perf_counter()
    data_dir = Path(data_dir)
    out = data_dir / "ali"
    out.mkdir(parents=True, exist_ok=True)
    clear_drops(data_dir, "align")
    lang = load_lang(data_dir / "lang")
    system = GmmSystem.load(data_dir / "exp" / "tri" / "final.pkl")
    tid2pdf = system.tid2pdf()
    tables = TidTables.from_transition_model(system.tm)
    id2phone = {i: p for p, i in lang.phones.items()}
    info: dict = {"num_pdfs": system.tm.num_pdfs, "splits": {}}
    counts = np.zeros(system.tm.num_pdfs, dtype=np.float64)
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
        alis = align_cuts(system, lang, cuts, data_dir, split, beam=beam, retry_beam=retry_beam)
        pdf_alis = {u: tid2pdf[a].astype(np.int32) for u, a in alis.items()}
        frames = write_pdf_alignments(cuts, pdf_alis, out, split)
        if split == "train":
            for pdf in pdf_alis.values():
                counts += np.bincount(pdf, minlength=len(counts))
            clean = [c for c in cuts if not is_augmented(c)]
            agreement = phone_agreement(clean, alis, tables, id2phone)
            augmented = phone_agreement([c for c in cuts if is_augmented(c)], alis, tables, id2phone)
            mono_ali = data_dir / "exp" / "mono" / "ali.pkl"
            if mono_ali.exists():
                mono = GmmSystem.load(data_dir / "exp" / "mono" / "final.pkl")
                with open(mono_ali, "rb") as f:
                    agreement["mono"] = phone_agreement(clean, pickle.load(f), TidTables.from_transition_model(mono.tm), id2phone)["overall"]
            agreement["augmented"] = augmented["overall"]
        else:
            agreement[split] = phone_agreement(cuts, alis, tables, id2phone)["overall"]
        info["splits"][split] = {"utterances": len(pdf_alis), "dropped": len(cuts) - len(pdf_alis), "frames": frames}
    priors = ((counts + 1.0) / (counts + 1.0).sum()).astype(np.float32)
    np.save(out / "priors.npy", priors)
    info["num_frames"] = int(counts.sum())
    info["pdfs_unseen_in_train"] = int((counts == 0).sum())
    info["phone_agreement"] = agreement
    info["seconds"] = round(time.perf_counter() - start, 1)
    (out / "info.json").write_text(json.dumps(info, indent=1))
    summary = {
        "num_pdfs": info["num_pdfs"],
        "train_utts": info["splits"]["train"]["utterances"],
        "train_frames": info["splits"]["train"]["frames"],
        "dev_utts": info["splits"].get("dev", {}).get("utterances", 0),
        "phone_agreement": agreement.get("overall"),
        "phone_agreement_mono": agreement.get("mono"),
        "seconds": info["seconds"],
    }
    log.info("align: %s", summary)
    return summary
