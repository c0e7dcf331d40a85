"""Other test sets for ``evaluate.py --test-set``: a Kaldi data dir read the way Kaldi's own tools
would accept it, and the bookkeeping of what was (not) scored.

A Kaldi data dir (``wav.scp``, ``text``, ``utt2spk``; optionally ``segments``, ``spk2utt``) is
reconciled as ``utils/fix_data_dir.sh`` does: an utterance is kept only when every required file
names it (``text``, ``utt2spk``, and ``wav.scp`` or ``segments`` with its recording in
``wav.scp``); ``spk2utt`` is not a filter (fix_data_dir.sh regenerates it from ``utt2spk``).
Every utterance left out is returned with a reason, never silently lost:

- ``not_in_wav_scp``: no audio entry (no ``wav.scp`` line, or its ``segments`` recording has none)
- ``not_in_text``: no line in ``text`` (a line with the id alone is an empty transcript: kept)
- ``not_in_utt2spk``: no line in ``utt2spk``
- ``missing_audio_file``: the ``wav.scp`` path does not exist
- ``unreadable_audio``: the file (or the ``cmd |`` output) is not audio libsndfile can read
- ``empty_audio``: 0 samples
- ``segment_outside_audio``: a ``segments`` line that starts past the end of its recording

Recordings keep their own sampling rate; the feature extraction resamples them to 16 kHz.
"""

from __future__ import annotations

import io
import logging
import subprocess
from collections import Counter
from pathlib import Path

import soundfile as sf

log = logging.getLogger(__name__)

REQUIRED = ("wav.scp", "text", "utt2spk")


def _read(path: Path) -> dict[str, str]:
    """Kaldi ``key rest-of-line`` file through Lhotse's reader (a key alone maps to ``""``)."""
    from lhotse.kaldi import load_kaldi_text_file

    return load_kaldi_text_file(path, allow_empty_ref=True) if path.is_file() else {}


def _audio_info(src: str, data: Path) -> tuple[object | None, str, str, str]:
    """``(soundfile info, source type, source, "")`` of a ``wav.scp`` entry, or
    ``(None, "", "", reason + ": " + detail)`` when it cannot be read."""
    src = src.strip()
    if not src:
        return None, "", "", "missing_audio_file: wav.scp gives no path"
    if src.endswith("|"):  # a command whose output is the audio (Kaldi's extended filename)
        cmd = src[:-1].strip()
        try:
            proc = subprocess.run(cmd, shell=True, capture_output=True, check=True, timeout=600)
            return sf.info(io.BytesIO(proc.stdout)), "command", cmd, ""
        except Exception as e:  # noqa: BLE001  (a failing command or non-audio output)
            return None, "", "", f"unreadable_audio: `{cmd}`: {type(e).__name__}: {e}"[:300]
    path = Path(src)
    if not path.is_absolute() and not path.exists():  # Kaldi: relative to the working directory
        path = data / src
    if not path.exists():
        return None, "", "", f"missing_audio_file: {src} does not exist"
    try:
        info = sf.info(str(path))
    except Exception as e:  # noqa: BLE001  (libsndfile raises several types)
        return None, "", "", f"unreadable_audio: {path}: {e}"[:300]
    return info, "file", str(path.resolve()), ""


def load_kaldi_test_dir(data: Path) -> tuple[list, list, list[tuple[str, str, str]], dict]:
    """Read and reconcile a Kaldi data dir.

    Returns:
        ``(recordings, supervisions, drops, notes)``: the ``RecordingSet`` (each recording at its
        own sampling rate) and ``SupervisionSet`` of the kept utterances, the left-out utterances
        as ``(utt id, reason, detail)``, and ``notes`` (``input_utterances``, ``sampling_rates``
        of the kept recordings, remarks about files that were not filters).
    """
    from lhotse import AudioSource, Recording, RecordingSet, SupervisionSegment, SupervisionSet

    data = Path(data)
    missing = [name for name in ("wav.scp", "text") if not (data / name).is_file()]
    if missing:
        raise ValueError(
            f"{data} has no {' nor '.join(missing)}; a Kaldi data dir needs wav.scp, text and utt2spk "
            "(see Kaldi's data preparation docs), or give a Lhotse cuts manifest"
        )
    wav_scp, text, segments = _read(data / "wav.scp"), _read(data / "text"), _read(data / "segments")
    remarks = []
    if (data / "utt2spk").is_file():
        utt2spk = _read(data / "utt2spk")
    else:
        remarks.append("no utt2spk: each utterance is its own speaker")
        utt2spk = {u: u for u in (segments or wav_scp)}
    spk2utt = _read(data / "spk2utt")
    if spk2utt:
        listed = {u: s for s, us in spk2utt.items() for u in us.split()}
        if listed != {u: s for u, s in utt2spk.items()}:
            remarks.append("spk2utt disagrees with utt2spk: utt2spk is used (as fix_data_dir.sh does)")

    audio_of = {u: seg.split()[0] for u, seg in segments.items() if seg.split()} if segments else {r: r for r in wav_scp}
    utts = sorted(set(audio_of) | set(text) | set(utt2spk))
    drops: list[tuple[str, str, str]] = []
    candidates = []
    for u in utts:
        absent = []
        if segments and u not in audio_of:
            absent.append("no line in segments")
        elif segments and audio_of[u] not in wav_scp:
            absent.append(f"its recording {audio_of[u]} (segments) has no line in wav.scp")
        elif not segments and u not in wav_scp:
            absent.append("no line in wav.scp")
        absent += [f"no line in {name}" for name, keys in (("text", text), ("utt2spk", utt2spk)) if u not in keys]
        if absent:
            first = absent[0].rsplit(" ", 1)[-1]
            reason = "not_in_" + ("wav_scp" if first in ("wav.scp", "segments") else first)
            drops.append((u, reason, "; ".join(absent)))
        else:
            candidates.append(u)

    recordings, bad_rec = {}, {}
    for rid in sorted({audio_of[u] for u in candidates}):
        info, kind, source, error = _audio_info(wav_scp[rid], data)
        if info is not None and info.frames == 0:
            error = f"empty_audio: {source}: 0 samples"
        if error:
            bad_rec[rid] = error
            continue
        recordings[rid] = Recording(
            id=rid,
            sources=[AudioSource(type=kind, channels=list(range(info.channels)) if info.channels > 1 else [0],
                                 source=source)],
            sampling_rate=info.samplerate,
            num_samples=info.frames,
            duration=info.frames / info.samplerate,
        )
    supervisions = []
    for u in candidates:
        rid = audio_of[u]
        if rid in bad_rec:
            reason, _, detail = bad_rec[rid].partition(": ")
            drops.append((u, reason, detail))
            continue
        rec = recordings[rid]
        start, duration = 0.0, rec.duration
        if segments:
            fields = segments[u].split()
            try:
                start, end = float(fields[1]), float(fields[2])
            except (IndexError, ValueError):
                drops.append((u, "bad_segment", f"segments line `{u} {segments[u]}`: want <rec> <start> <end>"))
                continue
            end = rec.duration if end < 0 else min(end, rec.duration)
            if start >= end:
                drops.append((u, "segment_outside_audio", f"{start}-{end} s of {rid} ({rec.duration:.2f} s)"))
                continue
            duration = end - start
        supervisions.append(SupervisionSegment(id=u, recording_id=rid, start=start, duration=duration, channel=0,
                                               text=text[u], speaker=utt2spk[u], language="English"))
    used = {s.recording_id for s in supervisions}
    rates = Counter(recordings[r].sampling_rate for r in used)
    notes = {"input_utterances": len(utts), "sampling_rates": {str(k): v for k, v in sorted(rates.items())},
             "remarks": remarks}
    if segments and set(wav_scp) - set(audio_of.values()):
        remarks.append(f"{len(set(wav_scp) - set(audio_of.values()))} wav.scp recordings have no segment")
    for r in remarks:
        log.warning("%s: %s", data, r)
    return (RecordingSet.from_recordings(recordings[r] for r in sorted(used)),
            SupervisionSet.from_segments(supervisions), drops, notes)


def oov_stats(refs: dict[str, str], vocabulary: set[str]) -> dict:
    """Reference words (normalised as scored) outside ``vocabulary`` (the recognizer's words.txt):
    ``{"tokens", "words" (total reference words), "rate" (%), "utterances", "counts": {word: n}}``."""
    from local.data.normalize import scored_words

    counts: Counter = Counter()
    utts, total = 0, 0
    for text in refs.values():
        words = scored_words(text)  # (tags and <UNK> are not scored, so never OOV)
        total += len(words)
        oov = [w for w in words if w not in vocabulary]
        counts.update(oov)
        utts += bool(oov)
    tokens = sum(counts.values())
    return {"tokens": tokens, "words": total, "rate": round(100.0 * tokens / max(total, 1), 2), "utterances": utts,
            "counts": dict(counts.most_common())}
