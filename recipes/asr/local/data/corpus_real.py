"""Stage 0 (real corpora): a local corpus directory to Lhotse manifests. Nothing is downloaded.

Splits taken from each corpus:

| corpus | train | dev | test |
|---|---|---|---|
| mini_librispeech | train-clean-5 | dev-clean-2, first half of its speakers (sorted) | dev-clean-2, other half |
| librispeech | train-clean-100 (``train_parts``: any of train-clean-100, train-clean-360, train-other-500) | dev-clean | test-clean |
| timit | lhotse TRAIN without the SA sentences | lhotse DEV (its 50 dev speakers) | lhotse TEST (24 core-test speakers) |
| yesno | lhotse train (30 files) but its last 6 (sorted) | those 6 training files | lhotse test (30 files) |
| kaldi | ``train/`` | ``dev/`` | ``test/`` data dirs; or one data dir split by sorted speaker (utt2spk with ≥ 3 speakers; fewer is an error): last 10 % (≥ 1) → test, the 10 % before → dev |

TIMIT's two SA sentences are read by every speaker, train and test alike: Kaldi's TIMIT recipe
leaves them out, and so does this one (each recorded as a drop, reason ``timit_sa``), so that
their texts reach neither the LM nor the test set twice. A single Kaldi data dir with fewer than 3
speakers cannot be split without a speaker in two splits: give ``train/ dev/ test/`` instead.
Kaldi data dirs are validated and read with each recording's own sampling rate
(``local.data.corpus_kaldi``). A speaker in two splits is refused for every corpus
(``--allow-shared-speakers``: a warning).

Bad input is found before Lhotse sees it (Lhotse's parsers stop at a corrupt file or an
empty transcript line): the corpus (but a Kaldi data dir) is mirrored into a temporary tree of symlinks that
leaves out unreadable audio, empty audio and empty or missing transcripts, each recorded
with :func:`local.drops.record_drop` (reasons ``unreadable_audio``, ``empty_audio``,
``empty_transcript``, ``missing_transcript``, ``missing_audio``). The recipes of
``lhotse.recipes`` then parse the clean tree and the recordings are pointed back at the
original files. Texts are upper-cased, keeping letters, digits, apostrophes and spaces.
TIMIT's own phone/word timings are kept as ``alignment["timit_phone"|"timit_word"]`` (its
48-phone set, not the lexicon's: the ``phone`` key is reserved for ARPAbet gold timings).
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import soundfile as sf
from lhotse import CutSet, MonoCut, RecordingSet, SupervisionSet
from lhotse.utils import fastcopy

from local.atomic import atomic_path
from local.constants import SPLITS
from local.data.corpus_kaldi import kaldi_parts
from local.data.normalize import normalize_text
from local.data.validate import check_disjoint_speakers
from local.drops import clear_drops, record_drop

log = logging.getLogger(__name__)

CORPORA = ("mini_librispeech", "librispeech", "timit", "yesno", "kaldi")


def check_audio(path: Path) -> tuple[str | None, str]:
    """``(None, "")`` for readable non-empty audio, else ``(reason, detail)``."""
    try:
        info = sf.info(str(path))
    except Exception as e:  # noqa: BLE001  (libsndfile raises several types for bad files)
        return "unreadable_audio", f"{path}: {e}"
    if info.frames == 0:
        return "empty_audio", f"{path}: 0 samples"
    return None, ""


def _link(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.symlink_to(src.resolve())


# ------------------------------------------------------------------------------ LibriSpeech
LIBRISPEECH_PARTS = {
    "mini_librispeech": {"train": ["train-clean-5"], "dev": ["dev-clean-2"]},
    "librispeech": {"train": ["train-clean-100"], "dev": ["dev-clean"], "test": ["test-clean"]},
}
LIBRISPEECH_TRAIN_PARTS = ("train-clean-100", "train-clean-360", "train-other-500")
YESNO_DEV_FILES = 6  # the last 6 (sorted) of lhotse's 30 training files


def _mirror_librispeech(corpus_dir: Path, parts: dict[str, list[str]], shadow: Path, data_dir: Path) -> None:
    for split, names in parts.items():
        for name in names:
            part = corpus_dir / name
            if not part.is_dir():
                continue
            audio = {p.stem: p for p in part.glob("*/*/*.flac")}
            transcribed = set()
            for trans in sorted(part.glob("*/*/*.trans.txt")):
                kept = []
                for line in trans.read_text().splitlines():
                    if not line.strip():
                        continue
                    uid, _, text = line.strip().partition(" ")
                    transcribed.add(uid)
                    if uid not in audio:
                        record_drop(
                            data_dir, "corpus", split, uid, "missing_audio", f"{trans}: no {uid}.flac"
                        )
                    elif not normalize_text(text):
                        record_drop(data_dir, "corpus", split, uid, "empty_transcript", str(trans))
                    else:
                        reason, detail = check_audio(audio[uid])
                        if reason:
                            record_drop(data_dir, "corpus", split, uid, reason, detail)
                            continue
                        kept.append(line.strip())
                        _link(audio[uid], shadow / audio[uid].relative_to(corpus_dir))
                out = shadow / trans.relative_to(corpus_dir)
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text("".join(k + "\n" for k in kept))
            for uid in sorted(set(audio) - transcribed):
                record_drop(
                    data_dir,
                    "corpus",
                    split,
                    uid,
                    "missing_transcript",
                    f"{audio[uid]} has no line in a *.trans.txt",
                )


def _librispeech(
    corpus: str, corpus_dir: Path, shadow: Path, data_dir: Path, train_parts: list[str] | None = None
) -> dict[str, list]:
    from lhotse.recipes import prepare_librispeech

    parts = dict(LIBRISPEECH_PARTS[corpus])
    if train_parts:
        allowed = LIBRISPEECH_TRAIN_PARTS if corpus == "librispeech" else tuple(parts["train"])
        unknown = [p for p in train_parts if p not in allowed]
        if unknown:
            raise ValueError(f"--train-parts {unknown}: {corpus}'s training parts are {list(allowed)}")
        parts["train"] = list(train_parts)
    missing = [n for s in SPLITS for n in parts.get(s, []) if not (corpus_dir / n).is_dir()]
    if missing:
        raise FileNotFoundError(
            f"{corpus_dir} has no {missing} (the {corpus} parts it needs: "
            f"{', '.join(f'{s} {parts[s]}' for s in SPLITS if s in parts)}); point --corpus-dir at the directory "
            "that contains them (e.g. LibriSpeech/), or choose the training parts present with --train-parts"
        )
    present = {s: [n for n in names if (corpus_dir / n).is_dir()] for s, names in parts.items()}
    _mirror_librispeech(corpus_dir, present, shadow, data_dir)
    names = [n for ns in present.values() for n in ns if (shadow / n).is_dir()]
    manifests = prepare_librispeech(shadow, dataset_parts=names, num_jobs=1)
    out = {s: [manifests[n] for n in present[s] if n in manifests] for s in present}
    if corpus == "mini_librispeech":
        # dev-clean-2 is its only held-out part: half of its speakers for dev, half for test
        dev = (
            out["dev"][0] if out["dev"] else {"recordings": RecordingSet(), "supervisions": SupervisionSet()}
        )
        speakers = sorted({s.speaker for s in dev["supervisions"]})
        test_spk = set(speakers[len(speakers) // 2 :])
        sups = dev["supervisions"]
        out["dev"] = [
            {
                "recordings": dev["recordings"],
                "supervisions": sups.filter(lambda s: s.speaker not in test_spk),
            }
        ]
        out["test"] = [
            {"recordings": dev["recordings"], "supervisions": sups.filter(lambda s: s.speaker in test_spk)}
        ]
    return out


# ------------------------------------------------------------------------------ TIMIT
def _find_dir(root: Path, name: str) -> Path | None:
    for base in (root, root / "data", root / "DATA"):
        if base.is_dir():
            for p in base.iterdir():
                if p.is_dir() and p.name.upper() == name:
                    return p
    return None


def _timit(corpus_dir: Path, shadow: Path, data_dir: Path) -> dict[str, list]:
    from lhotse.recipes import prepare_timit

    found = {part: _find_dir(corpus_dir, part) for part in ("TRAIN", "TEST")}
    if not all(found.values()):
        raise FileNotFoundError(
            f"{corpus_dir} has no TRAIN and TEST directories (looked in it and in data/); "
            "point --corpus-dir at the TIMIT root"
        )
    for part, src in found.items():
        split = "train" if part == "TRAIN" else "test"
        for wav in sorted(p for p in src.glob("*/*/*") if p.suffix.upper() == ".WAV"):
            uid = f"{wav.parent.name.upper()}-{wav.stem.upper()}"
            if wav.stem.upper().startswith("SA"):
                record_drop(
                    data_dir,
                    "corpus",
                    split,
                    uid,
                    "timit_sa",
                    f"{wav}: an SA sentence, read by every speaker",
                )
                continue
            side = {
                ext: next(
                    (q for q in (wav.with_suffix(ext), wav.with_suffix(ext.lower())) if q.exists()), None
                )
                for ext in (".TXT", ".PHN", ".WRD")
            }
            reason, detail = check_audio(wav)
            if reason is None and side[".TXT"] is None:
                reason, detail = "missing_transcript", f"{wav}: no .TXT beside it"
            if reason is None and not normalize_text(" ".join(side[".TXT"].read_text().split()[2:])):
                reason, detail = "empty_transcript", str(side[".TXT"])
            if reason:
                record_drop(data_dir, "corpus", split, uid, reason, detail)
                continue
            dst = (
                shadow
                / "data"
                / part
                / wav.parent.parent.name.upper()
                / wav.parent.name.upper()
                / f"{wav.stem.upper()}.WAV"
            )
            _link(wav, dst)
            for ext, path in side.items():
                if path is not None:
                    _link(path, dst.with_suffix(ext))
                else:  # timings are optional for us; lhotse's parser needs the file
                    dst.with_suffix(ext).write_text("")
    manifests = prepare_timit(shadow, num_phones=48, num_jobs=1)
    return {"train": [manifests["TRAIN"]], "dev": [manifests["DEV"]], "test": [manifests["TEST"]]}


# ------------------------------------------------------------------------------ yesno
def _yesno(corpus_dir: Path, shadow: Path, data_dir: Path) -> dict[str, list]:
    from lhotse.recipes import prepare_yesno

    src = corpus_dir / "waves_yesno" if (corpus_dir / "waves_yesno").is_dir() else corpus_dir
    waves = sorted(src.glob("*.wav"))
    if not waves:
        raise FileNotFoundError(
            f"{src} has no *.wav files; point --corpus-dir at waves_yesno/ (or its parent)"
        )
    # lhotse's rule: sorted files, even positions train, odd test; the last training files are dev
    split_of = {w: ("train" if i % 2 == 0 else "test") for i, w in enumerate(waves)}
    train_files = [w for w in waves if split_of[w] == "train"]
    for w in train_files[len(train_files) - min(YESNO_DEV_FILES, len(train_files) // 5) :]:
        split_of[w] = "dev"
    good = []
    for w in waves:
        reason, detail = check_audio(w)
        if reason:
            record_drop(data_dir, "corpus", split_of[w], w.stem, reason, detail)
        else:
            good.append(w)
    if len(waves) == 60 and len(good) == 60:
        for w in good:
            _link(w, shadow / w.name)
        m = prepare_yesno(shadow)
        dev_ids = {w.stem for w in good if split_of[w] == "dev"}
        train = {
            "recordings": m["train"]["recordings"],
            "supervisions": m["train"]["supervisions"].filter(lambda s: s.recording_id not in dev_ids),
        }
        dev = {
            "recordings": m["train"]["recordings"],
            "supervisions": m["train"]["supervisions"].filter(lambda s: s.recording_id in dev_ids),
        }
        return {"train": [train], "dev": [dev], "test": [m["test"]]}
    # lhotse's parser insists on exactly 60 files: same rule, applied here to what is readable
    from lhotse import Recording, SupervisionSegment

    out = {}
    for split in SPLITS:
        recs, sups = [], []
        for w in good:
            if split_of[w] != split:
                continue
            words = w.stem.split("_")
            if not words or set(words) - {"0", "1"}:
                record_drop(
                    data_dir,
                    "corpus",
                    split,
                    w.stem,
                    "missing_transcript",
                    f"{w.name} is not named 0_1_..._1.wav",
                )
                continue
            rec = Recording.from_file(w, recording_id=w.stem)
            recs.append(rec)
            sups.append(
                SupervisionSegment(
                    id=w.stem,
                    recording_id=w.stem,
                    start=0.0,
                    duration=rec.duration,
                    channel=0,
                    language="Hebrew",
                    text=" ".join("YES" if x == "1" else "NO" for x in words),
                )
            )
        out[split] = [
            {
                "recordings": RecordingSet.from_recordings(recs),
                "supervisions": SupervisionSet.from_segments(sups),
            }
        ]
    return out


# ------------------------------------------------------------------------------ common
def _to_cuts(split: str, parts: list[dict], data_dir: Path) -> CutSet:
    """One MonoCut per supervision, texts normalised, audio paths pointed back at the corpus.

    Must run while the mirror tree exists (its symlinks are resolved here).
    """
    cuts = []
    for part in parts:
        recs: RecordingSet = part["recordings"]
        for sup in part["supervisions"]:
            rec = recs[sup.recording_id]
            src = rec.sources[0]
            if src.type == "file":
                rec = fastcopy(rec, sources=[fastcopy(src, source=str(Path(src.source).resolve()))])
            text = normalize_text(sup.text or "")
            if not text:
                record_drop(
                    data_dir, "corpus", split, sup.id, "empty_transcript", "no words after normalisation"
                )
                continue
            alignment = sup.alignment
            if alignment:  # TIMIT's own timings: keep them, out of the way of the ARPAbet "phone" key
                alignment = {f"timit_{k}": v for k, v in alignment.items()}
            new_sup = fastcopy(
                sup,
                start=0.0,
                text=text,
                speaker=sup.speaker or sup.recording_id,
                language=sup.language or "English",
                alignment=alignment,
            )
            cuts.append(
                MonoCut(
                    id=sup.id,
                    start=sup.start,
                    duration=sup.duration,
                    channel=sup.channel,
                    recording=rec,
                    supervisions=[new_sup],
                )
            )
    return CutSet.from_cuts(sorted(cuts, key=lambda c: c.id))


def prepare_real(
    corpus: str, corpus_dir: Path, data_dir: Path, train_parts: list[str] | None = None,
    allow_shared_speakers: bool = False,
) -> dict[str, CutSet]:
    """Prepare a local corpus; writes ``<data_dir>/manifests/{train,dev,test}_cuts.jsonl.gz``.

    Args:
        corpus: one of ``mini_librispeech``, ``librispeech``, ``timit``, ``yesno``, ``kaldi``.
        corpus_dir: the unpacked corpus (layouts in the module docstring).
        data_dir: output root.
        train_parts: LibriSpeech only: its training parts to use (default ``train-clean-100``).
        allow_shared_speakers: a speaker in two splits is a warning, not an error
            (``local.data.validate.check_disjoint_speakers``).

    Returns:
        ``{"train": CutSet, "dev": CutSet, "test": CutSet}`` of MonoCuts with one supervision each.
    """
    if corpus not in CORPORA:
        raise ValueError(f"unknown corpus {corpus!r}; use one of {CORPORA} (or 'synthetic')")
    if train_parts and corpus not in LIBRISPEECH_PARTS:
        raise ValueError(
            f"--train-parts {train_parts}: only for librispeech and mini_librispeech, not {corpus}"
        )
    corpus_dir, data_dir = Path(corpus_dir), Path(data_dir)
    if not corpus_dir.is_dir():
        raise FileNotFoundError(
            f"No such directory: {corpus_dir} (--corpus-dir must point at an unpacked local copy of {corpus}; "
            "this recipe downloads nothing. Without a corpus use --corpus synthetic)"
        )
    clear_drops(data_dir, "corpus")
    data_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=data_dir, prefix=".corpus-mirror-") as tmp:
        shadow = Path(tmp)
        if corpus in LIBRISPEECH_PARTS:
            parts = _librispeech(corpus, corpus_dir, shadow, data_dir, train_parts)
        elif corpus == "timit":
            parts = _timit(corpus_dir, shadow, data_dir)
        elif corpus == "yesno":
            parts = _yesno(corpus_dir, shadow, data_dir)
        else:
            parts = kaldi_parts(corpus_dir, data_dir)
        manifests = {split: _to_cuts(split, parts.get(split, []), data_dir) for split in SPLITS}
    check_disjoint_speakers({s: {c.supervisions[0].speaker for c in cs} for s, cs in manifests.items()},
                            allow_shared_speakers)
    out_dir = data_dir / "manifests"
    out_dir.mkdir(parents=True, exist_ok=True)
    for split, cs in manifests.items():
        with atomic_path(out_dir / f"{split}_cuts.jsonl.gz") as tmp:
            cs.to_file(tmp)
    from local.data.corpus_synthetic import summarize

    log.info("corpus: %s from %s, %s", corpus, corpus_dir, summarize(manifests))
    return manifests
