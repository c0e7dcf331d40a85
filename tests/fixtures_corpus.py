"""Corpus fixtures shared by the recipe tests.

``tiny_corpus`` synthesises the ``tiny`` embedded corpus once per test session (a few
seconds) and returns its data dir (``manifests/{train,dev,test}_cuts.jsonl.gz``, ``audio/``).
Later stages copy it (or write beside it under their own sub-directory) rather than
rebuilding it. The layout builders write real-corpus directory layouts from its audio.

The recipe's packages (Lhotse, soundfile) are imported where used, so that the library's tests load
this file without them; ``tiny_corpus`` is skipped, naming the missing ones, where the Debian TTS engines that
synthesise the corpus are missing (``bash setup.sh`` installs them).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

if TYPE_CHECKING:
    from lhotse import CutSet

TINY_SEED = 0
TTS_ENGINES = ("espeak-ng", "flite", "festival", "sox")  # the programs local/data/tts.py runs


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> Path:
    """Data dir of the tiny synthetic corpus (built once per session, seed 0)."""
    missing = [engine for engine in TTS_ENGINES if shutil.which(engine) is None]
    if missing:
        pytest.skip(f"the recipe's synthetic corpus needs the Debian TTS engines, missing here: {', '.join(missing)} "
                    "(bash setup.sh installs them)")  # fmt: skip
    from local.data.corpus_synthetic import prepare_synthetic

    data_dir = tmp_path_factory.mktemp("tiny_corpus")
    prepare_synthetic(data_dir, size="tiny", seed=TINY_SEED, num_jobs=2)
    return data_dir


def load_split(data_dir: Path, split: str) -> CutSet:
    from lhotse import CutSet

    return CutSet.from_file(Path(data_dir) / "manifests" / f"{split}_cuts.jsonl.gz")


def tiny_utterances(data_dir: Path, n: int) -> list[tuple[np.ndarray, str]]:
    """``n`` (audio ``[num_samples]`` float32 16 kHz, UPPERCASE text) pairs from the tiny corpus (dev + test)."""
    cuts = [c for split in ("dev", "test") for c in load_split(data_dir, split)]
    if len(cuts) < n:
        raise ValueError(f"the tiny corpus has {len(cuts)} dev+test utterances, fewer than the {n} asked")
    return [(c.load_audio()[0], c.supervisions[0].text) for c in cuts[:n]]


def write_librispeech(
    root: Path, parts: dict[str, list[str]], utts: list[tuple[np.ndarray, str]]
) -> list[str]:
    """Lay utterances out like LibriSpeech: ``<part>/<spk>/<chapter>/<spk>-<chapter>-<nnnn>.flac``
    plus ``<spk>-<chapter>.trans.txt``. ``parts`` maps part name → speaker ids; utterances
    are dealt round-robin over all (part, speaker) pairs. Returns the utterance ids."""
    import soundfile as sf

    slots = [(part, spk) for part, spks in parts.items() for spk in spks]
    ids, lines = [], {}
    for k, (audio, text) in enumerate(utts):
        part, spk = slots[k % len(slots)]
        chapter = "100"
        uid = f"{spk}-{chapter}-{k:04d}"
        d = root / part / spk / chapter
        d.mkdir(parents=True, exist_ok=True)
        sf.write(str(d / f"{uid}.flac"), audio, 16000)
        lines.setdefault(d / f"{spk}-{chapter}.trans.txt", []).append(f"{uid} {text}")
        ids.append(uid)
    for path, ls in lines.items():
        path.write_text("".join(line + "\n" for line in ls))
    return ids


def write_timit(root: Path, speakers: dict[str, list[str]], utts: list[tuple[np.ndarray, str]]) -> list[str]:
    """Lay utterances out like TIMIT: ``data/<TRAIN|TEST>/DR1/<SPK>/<SENT>.WAV`` with ``.TXT``
    (``0 <end> text``), ``.WRD`` and ``.PHN`` (sample ranges). Returns ``<SPK>-<SENT>`` ids."""
    import soundfile as sf

    slots = [(part, spk) for part, spks in speakers.items() for spk in spks]
    ids = []
    for k, (audio, text) in enumerate(utts):
        part, spk = slots[k % len(slots)]
        d = root / "data" / part / "DR1" / spk.upper()
        d.mkdir(parents=True, exist_ok=True)
        sent = f"SX{k:03d}"
        sf.write(str(d / f"{sent}.WAV"), audio, 16000)
        n = len(audio)
        (d / f"{sent}.TXT").write_text(f"0 {n} {text.lower()}.\n")
        words = text.lower().split()
        edges = np.linspace(0, n, len(words) + 1).astype(int)
        (d / f"{sent}.WRD").write_text(
            "".join(f"{a} {b} {w}\n" for a, b, w in zip(edges[:-1], edges[1:], words))
        )
        (d / f"{sent}.PHN").write_text(f"0 {n // 2} h#\n{n // 2} {n} h#\n")
        ids.append(f"{spk.upper()}-{sent}")
    return ids


def write_kaldi_dir(
    d: Path, utts: list[tuple[np.ndarray, str]], prefix: str, n_speakers: int = 3
) -> list[str]:
    """A Kaldi data dir: ``wav.scp`` (paths relative to ``d``), ``text``, ``utt2spk``. Returns utt ids."""
    import soundfile as sf

    (d / "wav").mkdir(parents=True, exist_ok=True)
    ids = []
    scp, text, u2s = [], [], []
    for k, (audio, words) in enumerate(utts):
        spk = f"{prefix}spk{k % n_speakers}"
        uid = f"{spk}-{k:04d}"
        sf.write(str(d / "wav" / f"{uid}.wav"), audio, 16000)
        scp.append(f"{uid} wav/{uid}.wav")
        text.append(f"{uid} {words}")
        u2s.append(f"{uid} {spk}")
        ids.append(uid)
    for name, lines in (("wav.scp", scp), ("text", text), ("utt2spk", u2s)):
        (d / name).write_text("".join(line + "\n" for line in sorted(lines)))
    return ids
