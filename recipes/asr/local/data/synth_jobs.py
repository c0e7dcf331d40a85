"""Worker side of the synthetic corpus: synthesise, augment and write one chunk of utterances.

Kept free of Lhotse so that the worker processes (forked from a fork server that preloads
only this module) start in a fraction of a second.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile as sf

from local.atomic import atomic_path
from local.data.augment import Augmentation, augment
from local.data.tts import (
    SAMPLE_RATE,
    SIL,
    Voice,
    synth_espeak,
    synth_festival_batch,
    synth_flite,
    to_alignment,
)


@dataclass
class Utterance:
    """One sentence to synthesise: its id, split, text, voice setting, wav path and (train) augmentation."""

    id: str
    split: str
    text: str
    voice: Voice
    wav: Path
    aug: Augmentation | None = None


def _write(path: Path, audio: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        sf.write(str(tmp), audio, SAMPLE_RATE, subtype="PCM_16")


def synth_chunk(chunk: list[Utterance]) -> list[dict]:
    """Synthesise (and augment) one chunk; one result dict per utterance (and its ``-aug`` copy)."""
    voice = chunk[0].voice
    if voice.engine == "festival":
        outs = synth_festival_batch(voice, [u.text for u in chunk])
    else:
        synth = synth_espeak if voice.engine == "espeak" else synth_flite
        outs = []
        for u in chunk:
            try:
                outs.append(synth(voice, u.text))
            except Exception as e:  # noqa: BLE001  (one failed sentence must not stop the corpus)
                outs.append(e)
    results = []
    for u, out in zip(chunk, outs):
        base = {"utt": u, "ok": False}
        if isinstance(out, Exception):
            results.append({**base, "reason": "tts_failed", "detail": f"{voice.engine}: {out}"})
            continue
        audio, spans = out
        if len(audio) == 0 or float(np.abs(audio).max()) < 1e-4:
            results.append(
                {**base, "reason": "empty_audio", "detail": f"{voice.engine} produced {len(audio)} samples"}
            )
            continue
        duration = len(audio) / SAMPLE_RATE
        phones, unmapped = to_alignment(spans, voice.engine, duration)
        if all(p == SIL for p, _, _ in phones):
            results.append(
                {**base, "reason": "empty_audio", "detail": f"{voice.engine} produced pauses only"}
            )
            continue
        _write(u.wav, audio)
        results.append(
            {
                "utt": u,
                "ok": True,
                "id": u.id,
                "wav": u.wav,
                "num_samples": len(audio),
                "phones": phones,
                "unmapped": unmapped,
                "raw_end": spans[-1][2] if spans else 0.0,
            }
        )
        if u.aug is not None:
            aid = f"{u.id}-aug"
            try:
                y = augment(audio, u.aug)
            except Exception as e:  # noqa: BLE001
                results.append(
                    {"utt": u, "ok": False, "id": aid, "reason": "augmentation_failed", "detail": str(e)}
                )
                continue
            awav = u.wav.with_name(f"{aid}.wav")
            _write(awav, y)
            aphones, _ = to_alignment(spans, voice.engine, len(y) / SAMPLE_RATE, time_scale=1.0 / u.aug.speed)
            results.append(
                {
                    "utt": u,
                    "ok": True,
                    "id": aid,
                    "wav": awav,
                    "num_samples": len(y),
                    "phones": aphones,
                    "unmapped": Counter(),
                    "aug": u.aug.describe(),
                }
            )
    return results
