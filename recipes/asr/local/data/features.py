"""Stage 1: Kaldi-compatible fbank (for the DNN) and MFCC (for the GMMs), CMVN statistics.

Both come from Lhotse's Kaldi-compatible extractors with the same framing: 25 ms window,
10 ms shift, ``snip_edges=False`` (so an utterance of d seconds has round(100 d) frames and
the fbank frames, MFCC frames and alignment frames agree one to one).

Writes ``<data_dir>/features/{split}_cuts.jsonl.gz`` (cuts with ``cut.features`` = 40-bin
fbank and ``cut.mfcc`` = 13 MFCC as a temporal array, both stored with
``LilcomChunkyWriter``) and ``features/cmvn.json``::

    {"global": {"mean": [F], "std": [F], "frames": N},      # training frames
     "splits": {split: {spk: {"mean": [F], "std": [F], "frames": N}}},  # each split's own frames
     "speakers": {spk: {...}}}  # each speaker's first split's entry (train, dev, test order)

Speaker statistics are per split: a speaker's frames of that split only (unsupervised, like
Kaldi's per-speaker ``compute-cmvn-stats`` on each data dir), so a speaker in two splits
(``prepare.py --allow-shared-speakers``) is normalised in dev and test without its training
frames. ``split_cmvn`` gives a split's table to ``apply_cmvn``. With no speaker in two splits
(the embedded corpus), ``speakers`` holds the same numbers. ``global`` covers the training split
and is used for cuts without a known speaker.
"""

from __future__ import annotations

import logging
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from tqdm import tqdm

from local.atomic import atomic_path, die_with_parent, write_json
from local.drops import clear_drops, record_drop

log = logging.getLogger(__name__)

NUM_MEL_BINS = 40
NUM_CEPS = 13
FRAME_SHIFT = 0.01
SAMPLING_RATE = 16000
DELTA_WINDOW = 2


def _extractors():
    from lhotse import Fbank, FbankConfig, Mfcc, MfccConfig

    return Fbank(FbankConfig(num_mel_bins=NUM_MEL_BINS)), Mfcc(MfccConfig(num_ceps=NUM_CEPS))


def _resample(audio: np.ndarray, rate: int) -> np.ndarray:
    """``[C, S]`` audio at ``rate`` -> ``SAMPLING_RATE``, with Lhotse's own port of torchaudio's sinc
    resampler: what ``cut.resample`` applies when torchaudio is installed (without it Lhotse falls
    back to scipy; neither is a dependency here, and torchaudio does not import with torch 2.13)."""
    import torch
    from lhotse.augmentation.torchaudio import get_or_create_resampler

    samples = torch.from_numpy(np.ascontiguousarray(audio, dtype=np.float32))
    return get_or_create_resampler(int(rate), SAMPLING_RATE)(samples).numpy()


def _bad_audio(cut) -> tuple[np.ndarray | None, str, str]:
    """Load a cut's audio as ``[1, S]`` at ``SAMPLING_RATE`` (resampled from the cut's own rate);
    on failure return ``(None, reason, detail)``."""
    try:
        audio = cut.load_audio()
        if cut.sampling_rate != SAMPLING_RATE:
            audio = _resample(audio, cut.sampling_rate)
    except Exception as e:  # noqa: BLE001  (any decoder error means unreadable audio)
        return None, "unreadable_audio", f"{type(e).__name__}: {e}"[:300]
    if audio.size == 0:
        return None, "empty_audio", "0 samples"
    if not np.isfinite(audio).all():
        return None, "corrupt_audio", "non-finite samples"
    return audio[:1], "", ""


def _one_thread() -> None:
    """Worker set-up: one torch thread per process (the jobs are the parallelism); the worker
    dies with the stage's process (a killed run's worker must not write into the re-run's outputs)."""
    import torch

    die_with_parent()

    torch.set_num_threads(1)


def _stored_features(fbank, feats: np.ndarray, audio: np.ndarray, cut, writer):
    """Store ``feats`` (``fbank``'s output for ``audio``) and describe them as Lhotse's
    ``extract_from_samples_and_store`` does, without computing the filterbank a second time."""
    from lhotse import Features
    from lhotse.features.base import store_feature_array

    return Features(
        start=cut.start,
        duration=round(audio.shape[1] / cut.sampling_rate, ndigits=8),
        type=fbank.name,
        num_frames=feats.shape[0],
        num_features=feats.shape[1],
        frame_shift=fbank.frame_shift,
        sampling_rate=cut.sampling_rate,
        channels=cut.channel,
        storage_type=writer.name,
        storage_path=str(writer.storage_path),
        storage_key=store_feature_array(feats, storage=writer),
    )


def _process_shard(cuts: list, storage_path: str) -> tuple[list, list, dict]:
    """Compute and store fbank + MFCC for ``cuts``.

    Returns:
        the cuts with features attached (as dicts), the drops ``[(id, reason, detail)]`` and the
        per-speaker fbank sums ``{speaker: [count, sum [F], sum of squares [F]]}``.
    """
    from lhotse import LilcomChunkyWriter
    from lhotse.utils import fastcopy

    fbank, mfcc = _extractors()
    out, drops, sums = [], [], {}
    with LilcomChunkyWriter(storage_path) as writer:
        for cut in tqdm(cuts, desc=Path(storage_path).name, leave=False, mininterval=2.0):
            audio, reason, detail = _bad_audio(cut)  # at 16 kHz, the rate the extractors' filterbanks are built for
            if cut.sampling_rate != SAMPLING_RATE:  # the cut now describes the resampled audio
                cut = cut.resample(SAMPLING_RATE)
            shift = round(FRAME_SHIFT * cut.sampling_rate)
            if audio is not None and (audio.shape[1] + shift // 2) // shift == 0:  # snip_edges=False framing
                reason, detail = "too_short", f"{audio.shape[1]} samples give no 10 ms frame"
            elif audio is not None:
                try:
                    feats = fbank.extract(audio, cut.sampling_rate)
                    ceps = mfcc.extract(audio, cut.sampling_rate)
                except Exception as e:  # noqa: BLE001  (recorded, never a crash of the stage)
                    reason, detail = "feature_extraction_failed", f"{type(e).__name__}: {e}"[:300]
            if reason:
                drops.append((cut.id, reason, detail))
                continue
            if ceps.shape[0] != feats.shape[0]:
                raise RuntimeError(
                    f"cut {cut.id}: {feats.shape[0]} fbank frames but {ceps.shape[0]} MFCC frames; "
                    "both extractors must use the same framing"
                )
            cut = fastcopy(cut, features=_stored_features(fbank, feats, audio, cut, writer))
            cut.mfcc = writer.store_array(cut.id, ceps, frame_shift=FRAME_SHIFT, temporal_dim=0, start=cut.start)
            spk = cut.supervisions[0].speaker if cut.supervisions else None
            acc = sums.setdefault(spk, [0, np.zeros(feats.shape[1]), np.zeros(feats.shape[1])])
            acc[0] += feats.shape[0]
            acc[1] += feats.sum(0, dtype=np.float64)
            acc[2] += np.square(feats, dtype=np.float64).sum(0)
            out.append(cut.to_dict())
    return out, drops, sums


def _stats(count: int, total: np.ndarray, sq: np.ndarray) -> dict:
    mean = total / count
    std = np.sqrt(np.maximum(sq / count - mean**2, 1e-10))
    return {"mean": mean.tolist(), "std": std.tolist(), "frames": int(count)}


def compute_features(data_dir: Path | str, splits=("train", "dev", "test"), num_jobs: int = 1) -> dict:
    """Stage 1: features for each split's cuts and the CMVN statistics.

    Args:
        data_dir: recipe data directory with ``manifests/{split}_cuts.jsonl.gz``.
        splits: splits to process; a missing dev/test manifest is skipped with a warning.
        num_jobs: worker processes (each writes its own storage shard).

    Returns:
        ``{split: {"cuts": kept, "dropped": n, "frames": total}}``.
    """
    from lhotse import CutSet

    data_dir = Path(data_dir)
    out_dir = data_dir / "features"
    out_dir.mkdir(parents=True, exist_ok=True)
    if num_jobs < 1:
        raise ValueError(f"num_jobs={num_jobs}; use 1 or more worker processes")
    clear_drops(data_dir, "features")
    summary, sums_by_split = {}, {}
    for split in splits:
        path = data_dir / "manifests" / f"{split}_cuts.jsonl.gz"
        if not path.exists():
            if split == "train":
                raise RuntimeError(f"{path} is missing; run prepare.py --stage 0 first")
            log.warning("features: %s is missing, skipping split %s", path, split)
            continue
        cuts = list(CutSet.from_file(path))
        shards = [cuts[j::num_jobs] for j in range(num_jobs)]
        storage = [str(out_dir / f"{split}_feats.{j}") for j in range(num_jobs)]
        if num_jobs == 1:
            results = [_process_shard(shards[0], storage[0])]
        else:
            # spawn, not fork: a forked child inherits torch's OpenMP pool in a locked state and hangs
            with ProcessPoolExecutor(
                num_jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_one_thread
            ) as pool:
                results = list(pool.map(_process_shard, shards, storage))
        kept, split_sums = [], {}
        for dicts, drops, sums in results:
            kept += dicts
            for cut_id, reason, detail in drops:
                record_drop(data_dir, "features", split, cut_id, reason, detail)
            for spk, (n, s, q) in sums.items():
                acc = split_sums.setdefault(spk, [0, 0.0, 0.0])
                acc[0], acc[1], acc[2] = acc[0] + n, acc[1] + s, acc[2] + q
        order = {c.id: i for i, c in enumerate(cuts)}
        kept.sort(key=lambda d: order[d["id"]])
        with atomic_path(out_dir / f"{split}_cuts.jsonl.gz") as tmp:
            CutSet.from_dicts(kept).to_file(tmp)
        sums_by_split[split] = split_sums
        frames = sum(n for n, _, _ in split_sums.values())
        summary[split] = {"cuts": len(kept), "dropped": len(cuts) - len(kept), "frames": int(frames)}
        log.info(
            "features %s: %d cuts, %d frames (%.2f h), %d dropped",
            split,
            len(kept),
            frames,
            frames * FRAME_SHIFT / 3600,
            len(cuts) - len(kept),
        )

    write_cmvn(sums_by_split, out_dir / "cmvn.json")
    return summary


def write_cmvn(sums_by_split: dict, path: Path) -> dict:
    """Per-speaker (per split) and global (train, else all) fbank mean/std -> ``path`` (the layout in
    the module docstring)."""
    splits = {split: {spk: _stats(*v) for spk, v in sums.items() if spk is not None}
              for split, sums in sums_by_split.items()}
    speakers: dict = {}
    for table in splits.values():
        for spk, st in table.items():
            speakers.setdefault(spk, st)
    glob = sums_by_split.get("train") or {k: v for d in sums_by_split.values() for k, v in d.items()}
    n = sum(v[0] for v in glob.values())
    if n == 0:
        raise RuntimeError("no feature frames at all: every utterance was dropped (see dropped.jsonl)")
    stats = {
        "global": _stats(n, sum(v[1] for v in glob.values()), sum(v[2] for v in glob.values())),
        "speakers": speakers,
        "splits": splits,
    }
    write_json(path, stats, indent=None)
    return stats


def split_cmvn(stats: dict, split: str) -> dict:
    """The statistics ``apply_cmvn`` takes for the cuts of ``split``: its speakers' own (``stats["splits"]``);
    for a set stage 1 did not see, or a ``cmvn.json`` written before per-split statistics, ``stats`` itself."""
    table = stats.get("splits", {}).get(split)
    return stats if table is None else {"global": stats["global"], "speakers": table}


def split_speaker_key(split: str, speaker: str) -> str:
    """The key of a speaker-level table entry (the adapt stage's fbank transforms) of a dev or test
    speaker whose name an earlier split has too (``prepare.py --allow-shared-speakers``)."""
    return f"{split}/{speaker}"


def add_split_entries(table: dict, entries: dict, split: str) -> None:
    """Add ``split``'s ``{speaker: value}`` to ``table``, a speaker already there (from an earlier
    split) under ``split_speaker_key``: each split keeps its own, and with no speaker in two splits the
    table is what a plain ``update`` gives."""
    table.update({(split_speaker_key(split, s) if s in table else s): v for s, v in entries.items()})


def apply_cmvn(feats: np.ndarray, speaker: str | None, stats: dict) -> np.ndarray:
    """Mean/variance normalise ``feats`` ``[T, F]`` with the speaker's statistics (global if unknown);
    ``stats`` of one split (``split_cmvn``)."""
    s = stats["speakers"].get(speaker) if speaker is not None else None
    s = s or stats["global"]
    mean, std = np.asarray(s["mean"], dtype=np.float32), np.asarray(s["std"], dtype=np.float32)
    if feats.shape[-1] != mean.shape[0]:
        raise ValueError(
            f"features have {feats.shape[-1]} dims but the CMVN stats {mean.shape[0]}; "
            "recompute features/cmvn.json with the same extractor"
        )
    return (feats - mean) / std


def delta_filters(order: int = 2, window: int = DELTA_WINDOW) -> list[np.ndarray]:
    """Kaldi's delta filters: order 1 is ``sum_n n (x[t+n] - x[t-n]) / (2 sum_n n^2)``, order k
    convolves order k-1 with it (so ΔΔ has width 4 * window + 1)."""
    base = np.arange(-window, window + 1, dtype=np.float64)
    base /= 2 * np.sum(np.arange(1, window + 1) ** 2)
    filters = [np.ones(1)]
    for _ in range(order):
        filters.append(np.convolve(filters[-1], base))
    return filters


def add_deltas(x: np.ndarray, order: int = 2, window: int = DELTA_WINDOW) -> np.ndarray:
    """``[T, D]`` -> ``[T, D * (order + 1)]`` with Kaldi's ``add-deltas`` (edge frames repeated)."""
    T = x.shape[0]
    out = []
    for f in delta_filters(order, window):
        half = len(f) // 2
        idx = np.clip(np.arange(T)[:, None] + np.arange(-half, half + 1)[None, :], 0, T - 1)
        out.append(np.einsum("tkd,k->td", x[idx].astype(np.float64), f))
    return np.concatenate(out, axis=1).astype(np.float32)


def gmm_cmvn_key(cut) -> str:
    """The CMVN "speaker" of a cut for the GMM front end: its supervision's speaker (a voice
    setting of the synthetic corpus), with augmented copies (``augmentation`` in the supervision's
    custom fields) pooled apart, as Kaldi gives perturbed data its own speaker prefix. A cut
    without a speaker is its own speaker (per-utterance CMVN)."""
    sup = cut.supervisions[0] if cut.supervisions else None
    if sup is None or sup.speaker is None:
        return f"utt:{cut.id}"
    aug = "augmentation" in (sup.custom or {}) or "augmentation" in (cut.custom or {}) or cut.id.endswith("-aug")
    return f"{sup.speaker}-aug" if aug else sup.speaker


def gmm_speaker_stats(cuts) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per-speaker mean and standard deviation of the 13 MFCC (Kaldi's ``compute-cmvn-stats
    --spk2utt``) over ``cuts``, keyed by ``gmm_cmvn_key``: the statistics of one data split,
    unsupervised (no transcripts), so a test speaker is normalised with its own test utterances as
    in Kaldi's offline decoding.

    Returns:
        ``{key: (mean [13], std [13])}`` float64 (std floored at 1e-3).
    """
    sums: dict[str, list] = {}
    for cut in cuts:
        ceps = np.asarray(cut.load_custom("mfcc"), dtype=np.float64)
        acc = sums.setdefault(gmm_cmvn_key(cut), [0, np.zeros(ceps.shape[1]), np.zeros(ceps.shape[1])])
        acc[0] += len(ceps)
        acc[1] += ceps.sum(0)
        acc[2] += (ceps * ceps).sum(0)
    out = {}
    for key, (n, total, squares) in sums.items():
        mean = total / max(n, 1)
        out[key] = (mean, np.sqrt(np.maximum(squares / max(n, 1) - mean**2, 1e-6)))
    return out


def gmm_features(cut, speaker_stats: dict[str, tuple[np.ndarray, np.ndarray]] | None = None,
                 norm_vars: bool = True, deltas: bool = True) -> np.ndarray:
    """The GMM front end for one cut: 13 MFCC, CMVN (Kaldi's ``apply-cmvn``), Δ and ΔΔ ->
    ``[T, 39]`` float32.

    Args:
        cut: a cut with ``cut.mfcc`` (stage 1).
        speaker_stats: per-speaker statistics (``gmm_speaker_stats``); the cut's speaker must be
            in it. None normalises each utterance by its own statistics.
        norm_vars: divide by the standard deviation too (``apply-cmvn --norm-vars=true``). On the
            default corpus, whose test voices are unseen in training, speaker mean + variance
            normalisation cut the monophone test WER from about 18 % (mean only) to about 14 %.
        deltas: add Δ and ΔΔ; False stops after the CMVN (``[T, 13]``, what the LDA+MLLT front end
            splices, ``local.gmm.lda_mllt``).
    """
    ceps = np.asarray(cut.load_custom("mfcc"), dtype=np.float64)
    if speaker_stats is None:
        mean, std = ceps.mean(axis=0), np.sqrt(np.maximum(ceps.var(axis=0), 1e-6))
    else:
        key = gmm_cmvn_key(cut)
        if key not in speaker_stats:
            raise ValueError(
                f"no CMVN statistics for speaker {key!r} of cut {cut.id}; compute gmm_speaker_stats over its split"
            )
        mean, std = speaker_stats[key]
    normed = ((ceps - mean) / std if norm_vars else ceps - mean).astype(np.float32)
    return add_deltas(normed) if deltas else normed
