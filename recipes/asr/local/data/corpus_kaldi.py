"""Stage 0 for Kaldi data dirs (``--corpus kaldi``): validated, each recording at its own sampling rate.

Each data dir is checked first as Kaldi's ``utils/validate_data_dir.sh`` would
(``local.data.validate``): a malformed dir is an error naming the file, the line and the fix, before
any audio is read. Each recording's sampling rate and length then come from its own header: a file's
through libsndfile, a ``cmd |`` entry's from the WAV header of the command's output (the command is
run, as Kaldi's ``wav-to-duration`` does). A dir may mix rates (8 kHz telephone speech beside 16 kHz);
the manifests keep each recording's own rate, and stage 1 resamples to the recipe's 16 kHz through
Lhotse (``cut.resample`` and Lhotse's resampler, ``local.data.features``). A ``cmd |`` whose output
has no header (``sph2pipe -f raw``, ``sox ... -t raw -``) has no rate to read: an error naming the
recording, its ``wav.scp`` line and the fix.

Content problems leave the utterance out, each recorded as a drop (``local.drops``): a file that is
missing or not audio, or a command that fails (``unreadable_audio``), no samples (``empty_audio``), a
transcript with no words (``empty_transcript``), a segment that starts past its recording's end
(``segment_outside_audio``).
"""

from __future__ import annotations

import io
import subprocess
from pathlib import Path

import soundfile as sf

from local.constants import SPLITS
from local.data.normalize import normalize_text
from local.data.validate import validate_data_dir
from local.drops import record_drop

COMMAND_TIMEOUT_S = 600
WAV_COMMANDS = "sph2pipe -f wav FILE |, sox FILE -t wav - |, ffmpeg -i FILE -f wav - |"


def audio_path(src: str, data: Path) -> Path:
    """A wav.scp path: absolute, else relative to the working directory (Kaldi's rule) if it
    exists there, else relative to the data dir."""
    p = Path(src)
    return p if p.is_absolute() or p.exists() else data / src


def audio_info(src: str, data: Path, where: str) -> tuple[object | None, str, str, str, str]:
    """``(soundfile info, source type, source, "", "")`` of a ``wav.scp`` entry, or ``(None, "", "",
    reason, detail)`` for audio left out. ``where`` (``wav.scp:line: recording R (utterances ...)``)
    starts the error raised when a command runs but its output's sampling rate cannot be read."""
    if not src.endswith("|"):
        path = audio_path(src, data)
        try:
            return sf.info(str(path)), "file", str(path.resolve()), "", ""
        except Exception as e:  # noqa: BLE001  (libsndfile raises several types for bad files)
            return None, "", "", "unreadable_audio", f"{path}: {e}"[:300]
    cmd = src[:-1].strip()
    try:
        proc = subprocess.run(cmd, shell=True, capture_output=True, check=False, timeout=COMMAND_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None, "", "", "unreadable_audio", f"`{cmd}` ran past {COMMAND_TIMEOUT_S} s"
    err = proc.stderr.decode(errors="replace").strip().splitlines()
    if proc.returncode == 127:
        raise ValueError(f"{where}: `{cmd}` cannot run here ({err[-1] if err else 'command not found'}); "
                         "install the program or put it on PATH")
    if proc.returncode != 0:
        return None, "", "", "unreadable_audio", f"`{cmd}` exited {proc.returncode}: {err[-1] if err else ''}"[:300]
    if not proc.stdout:
        return None, "", "", "empty_audio", f"`{cmd}` wrote nothing"
    try:
        return sf.info(io.BytesIO(proc.stdout)), "command", cmd, "", ""
    except Exception as e:  # noqa: BLE001  (output without a header libsndfile knows)
        why = str(e).rpartition(": ")[2] or type(e).__name__  # libsndfile's reason, without the stream's repr
        raise ValueError(
            f"{where}: its sampling rate cannot be read: `{cmd} |` wrote {len(proc.stdout)} bytes with no audio "
            f"header ({why}); make the command write WAV to stdout (e.g. {WAV_COMMANDS})") from None


def _describe(data: Path, line: int, rid: str, utts: list[str]) -> str:
    some = ", ".join(utts[:3]) + (f" and {len(utts) - 3} more" if len(utts) > 3 else "")
    return f"{data / 'wav.scp'}:{line}: recording {rid} (utterance {some})"


def load_kaldi_dir(data: Path, data_dir: Path, split_of) -> dict:
    """One validated Kaldi data dir -> ``{"recordings": RecordingSet, "supervisions": SupervisionSet}``
    of the utterances kept, each recording at its own rate; the others are recorded as drops of
    ``split_of(utterance id)``."""
    from lhotse import AudioSource, Recording, RecordingSet, SupervisionSegment, SupervisionSet

    rows = validate_data_dir(data)
    wav_scp = {rid: (n, src) for n, rid, src in rows["wav.scp"]}
    text = {utt: (n, words) for n, utt, words in rows["text"]}
    speaker = {utt: spk for _, utt, spk in rows["utt2spk"]}
    segments = {utt: rest.split() for _, utt, rest in rows.get("segments", [])}
    audio_of = {utt: fields[0] for utt, fields in segments.items()} if segments else {u: u for u in wav_scp}
    keep = []
    for utt in sorted(audio_of):
        n, words = text[utt]
        if normalize_text(words):
            keep.append(utt)
        else:
            record_drop(data_dir, "corpus", split_of(utt), utt, "empty_transcript", f"{data / 'text'}:{n}")
    utts_of: dict[str, list[str]] = {}
    for utt in keep:
        utts_of.setdefault(audio_of[utt], []).append(utt)
    recordings = {}
    for rid, utts in sorted(utts_of.items()):
        line, src = wav_scp[rid]
        info, kind, source, reason, detail = audio_info(src, data, _describe(data, line, rid, utts))
        if info is not None and info.frames == 0:
            reason, detail = "empty_audio", f"{source}: 0 samples"
        if reason:
            for utt in utts:
                record_drop(data_dir, "corpus", split_of(utt), utt, reason, detail)
            continue
        recordings[rid] = Recording(
            id=rid,
            sources=[AudioSource(type=kind, channels=list(range(info.channels)), source=source)],
            sampling_rate=info.samplerate,
            num_samples=info.frames,
            duration=info.frames / info.samplerate,
        )
    supervisions = []
    for utt in keep:
        rec = recordings.get(audio_of[utt])
        if rec is None:
            continue
        start, end = 0.0, rec.duration
        if segments:
            start, end = float(segments[utt][1]), float(segments[utt][2])
            end = rec.duration if end == -1 else min(end, rec.duration)  # Kaldi's extract-segments clips too
            if start >= end:
                record_drop(data_dir, "corpus", split_of(utt), utt, "segment_outside_audio",
                            f"starts at {start} s, {rec.id} lasts {rec.duration:.3f} s")
                continue
        supervisions.append(SupervisionSegment(id=utt, recording_id=rec.id, start=start, duration=end - start,
                                               channel=0, text=text[utt][1], speaker=speaker[utt]))
    used = sorted({s.recording_id for s in supervisions})
    return {"recordings": RecordingSet.from_recordings(recordings[r] for r in used),
            "supervisions": SupervisionSet.from_segments(supervisions)}


def split_by_speaker(data: Path) -> dict[str, str]:
    """Utterance id -> split for one data dir split by sorted speaker (``local.data.corpus_real``'s
    docstring): the last 10 % of the speakers (at least 1) test, the 10 % before dev."""
    utt2spk = {utt: spk for _, utt, spk in validate_data_dir(data)["utt2spk"]}
    speakers = sorted(set(utt2spk.values()))
    if len(speakers) < 3:
        raise ValueError(
            f"{data}: one Kaldi data dir with {len(speakers)} speaker(s) {speakers} (utt2spk) cannot be split into "
            "train, dev and test without a speaker in two of them; give train/, dev/ and test/ data dirs "
            "(subdirectories of --corpus-dir), or an utt2spk that names the speakers"
        )
    n = max(1, round(0.1 * len(speakers)))
    test, dev = set(speakers[len(speakers) - n:]), set(speakers[len(speakers) - 2 * n: len(speakers) - n])
    return {u: "test" if s in test else "dev" if s in dev else "train" for u, s in utt2spk.items()}


def kaldi_parts(corpus_dir: Path, data_dir: Path) -> dict[str, list[dict]]:
    """``train/ dev/ test/`` data dirs under ``corpus_dir``, or ``corpus_dir`` itself split by speaker ->
    ``{split: [{"recordings", "supervisions"}]}``."""
    subdirs = {s: corpus_dir / s for s in SPLITS if (corpus_dir / s / "wav.scp").is_file()}
    if subdirs:
        missing = [s for s in SPLITS if s not in subdirs]
        if missing:
            raise FileNotFoundError(
                f"{corpus_dir} has Kaldi data dirs for {sorted(subdirs)} but not {missing}; "
                "give all of train/, dev/, test/ or a single data dir"
            )
        return {s: [load_kaldi_dir(d, data_dir, lambda u, s=s: s)] for s, d in subdirs.items()}
    if not (corpus_dir / "wav.scp").is_file():
        raise FileNotFoundError(
            f"{corpus_dir} has no wav.scp, nor train/ dev/ test/ subdirs with one; point --corpus-dir at a Kaldi data dir"
        )
    split_of = split_by_speaker(corpus_dir)
    whole = load_kaldi_dir(corpus_dir, data_dir, lambda u: split_of.get(u, "train"))
    return {s: [{"recordings": whole["recordings"],
                 "supervisions": whole["supervisions"].filter(lambda sup, s=s: split_of[sup.id] == s)}]
            for s in SPLITS}
