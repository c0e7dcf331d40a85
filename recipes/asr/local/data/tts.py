"""Text-to-speech engine wrappers that return 16 kHz audio and the engine's own phone timings.

Three Debian engines, each with a real source of phone timings:

- **espeak-ng** through ``libespeak-ng`` (ctypes): phoneme events (``espeakEVENT_PHONEME``,
  enabled by ``espeakINITIALIZE_PHONEME_EVENTS``) carry each phoneme's mnemonic and its
  start in ms; a phone ends where the next event starts. Native rate (words/min) and pitch.
- **flite** (``flite -psdur``): ``phone:end_time`` pairs. kal16's final pause runs past the
  audio end (DESIGN §5); alignments are clipped to the audio in :func:`to_alignment`.
- **festival** (a Scheme batch script, ``utt.save.segs``): segment end times. Its voices here are
  diphone (kal, ked; MBROLA's us1, us2, us3, whose diphones MBROLA joins) and HTS (slt) voices,
  all on festival's American front end and its radio phone set.

Pitch for flite and festival is changed after synthesis with sox ``pitch`` (cents), which
keeps durations, so the timings stay valid. Phone symbols are mapped to ARPAbet without
stress (the lexicon's phones) through :data:`FLITE_TO_ARPA` and :data:`ESPEAK_TO_ARPA`;
silence is ``SIL``. Symbols missing from the tables are counted, mapped to ``SIL`` and
logged by the caller.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SAMPLE_RATE = 16000
SIL = "SIL"
DEBIAN_PACKAGES = (
    "espeak-ng flite festival festvox-kallpc16k festvox-kdlpc16k festvox-us-slt-hts "
    "festvox-us1 festvox-us2 festvox-us3 sox libespeak-ng1"
)
# The Debian package of each festival voice; the MBROLA ones are in contrib, their diphone databases
# (mbrola-us1/2/3) in non-free: setup.sh enables both components.
FESTIVAL_VOICE_PACKAGE = {
    "kal_diphone": "festvox-kallpc16k",
    "ked_diphone": "festvox-kdlpc16k",
    "cmu_us_slt_arctic_hts": "festvox-us-slt-hts",
    "us1_mbrola": "festvox-us1",
    "us2_mbrola": "festvox-us2",
    "us3_mbrola": "festvox-us3",
}

# flite and festival both use the CMU/radio phone set (lower case ARPAbet plus a few extras).
FLITE_TO_ARPA: dict[str, tuple[str, ...]] = {
    **{
        p.lower(): (p,)
        for p in [
            "AA", "AE", "AH", "AO", "AW", "AY", "B", "CH", "D", "DH", "EH", "ER", "EY", "F", "G", "HH",
            "IH", "IY", "JH", "K", "L", "M", "N", "NG", "OW", "OY", "P", "R", "S", "SH", "T", "TH",
            "UH", "UW", "V", "W", "Y", "Z", "ZH",
        ]
    },
    "ax": ("AH",),
    "axr": ("ER",),
    "ix": ("IH",),
    "ux": ("UW",),
    "dx": ("T",),
    "nx": ("N",),
    "el": ("AH", "L"),
    "em": ("AH", "M"),
    "en": ("AH", "N"),
    "hv": ("HH",),
    "pau": (SIL,),
    "h#": (SIL,),
    "brth": (SIL,),
    "ssil": (SIL,),
    "sil": (SIL,),
}

# espeak-ng's English phoneme mnemonics (en, en-us, en-gb-*, en-029 ...) to ARPAbet. A few
# are diphthongs with r-colouring or syllabic consonants that ARPAbet writes as two phones;
# their duration is split evenly.
ESPEAK_TO_ARPA: dict[str, tuple[str, ...]] = {
    # consonants
    "p": ("P",),
    "b": ("B",),
    "t": ("T",),
    "d": ("D",),
    "k": ("K",),
    "g": ("G",),
    "f": ("F",),
    "v": ("V",),
    "T": ("TH",),
    "D": ("DH",),
    "s": ("S",),
    "z": ("Z",),
    "S": ("SH",),
    "Z": ("ZH",),
    "h": ("HH",),
    "m": ("M",),
    "n": ("N",),
    "N": ("NG",),
    "l": ("L",),
    "r": ("R",),
    "w": ("W",),
    "j": ("Y",),
    "tS": ("CH",),
    "dZ": ("JH",),
    # dental t/d: en-029's realisation of /θ/ and /ð/ ("threw" = t[ r u:)
    "t[": ("TH",),
    "d[": ("DH",),
    "w#": ("W",),
    # ";" is a short linking glide between a vowel and a vowel-initial word ("very_old"):
    # no lexicon phone, so its time goes to the phone before it
    ";": (),
    "t#": ("T",),
    "d#": ("D",),
    "t2": ("T",),
    "d2": ("D",),
    "?": ("T",),
    "z#": ("Z",),
    "z/2": ("Z",),
    "n-": ("AH", "N"),
    "m-": ("AH", "M"),
    "l/": ("L",),
    "l/2": ("L",),
    "r-": ("R",),
    "x": ("K",),
    "W": ("W",),
    "C": ("HH",),
    "k#": ("K",),
    "s2": ("S",),
    "tS2": ("CH",),
    "dZ2": ("JH",),
    "*": ("R",),
    "R": ("R",),
    "R2": ("R",),
    "r/": ("R",),
    "j/": ("Y",),
    # vowels
    "a": ("AE",),
    "a#": ("AE",),
    "aa": ("AA",),
    "a2": ("AE",),
    "A:": ("AA",),
    "A": ("AA",),
    "A@": ("AA", "R"),
    "A#": ("AA",),
    "aI": ("AY",),
    "aI2": ("AY",),
    "aI@": ("AY", "ER"),
    "aI3": ("AY", "ER"),
    "aU": ("AW",),
    "aU@": ("AW", "ER"),
    "@": ("AH",),
    "@2": ("AH",),
    "@5": ("AH",),
    "@/": ("AH",),
    "@L": ("AH", "L"),
    "@-": ("AH",),
    "3:": ("ER",),
    "3": ("ER",),
    "@r": ("ER",),
    "3r": ("ER",),
    "E": ("EH",),
    "E2": ("EH",),
    "E#": ("EH",),
    "e@": ("EH", "R"),
    "eI": ("EY",),
    "e": ("EH",),
    "i": ("IY",),
    "i:": ("IY",),
    "I": ("IH",),
    "I2": ("IH",),
    "I#": ("IH",),
    "i@": ("IY", "R"),
    "i@3": ("IY", "R"),
    "I@": ("IH", "R"),
    "0": ("AA",),
    "0#": ("AA",),
    "O:": ("AO",),
    "O": ("AO",),
    "O2": ("AA",),
    "O@": ("AO", "R"),
    "o@": ("AO", "R"),
    "oU": ("OW",),
    "oU#": ("OW",),
    "o:": ("OW",),
    "o": ("OW",),
    "OI": ("OY",),
    "U": ("UH",),
    "u:": ("UW",),
    "u": ("UW",),
    "U@": ("UH", "R"),
    "V": ("AH",),
    "V#": ("AH",),
    "IR": ("IH", "R"),
    "VR": ("ER",),
    "aI@3": ("AY", "ER"),
    "u@": ("UW", "R"),
    "eI#": ("EY",),
    "a:": ("AA",),
    "E:": ("EH",),
    "y": ("UW",),
    "Y": ("UW",),
}


def espeak_symbol(sym: str) -> tuple[str, ...] | None:
    """ARPAbet phones for one espeak mnemonic: ``(SIL,)`` for pauses, ``()`` for a symbol
    whose time belongs to the phone before it, ``None`` if unknown."""
    if sym.startswith("_") or sym == "":
        return (SIL,)
    return ESPEAK_TO_ARPA.get(sym)


def flite_symbol(sym: str) -> tuple[str, ...] | None:
    """ARPAbet phones for one flite/festival phone, ``None`` if unknown."""
    return FLITE_TO_ARPA.get(sym.lower())


@dataclass(frozen=True)
class Voice:
    """One voice setting: a speaker of the corpus.

    Attributes:
        engine: ``espeak``, ``flite`` or ``festival``.
        name: the engine's voice (``en-us+m3``, ``kal16``, ``kal_diphone``).
        rate: speaking rate relative to the engine's default (1.2 = 20 % faster).
        pitch: espeak: base pitch 0–100 (50 default); flite/festival: shift in cents by sox.
        gender: ``m`` or ``f``.
    """

    engine: str
    name: str
    rate: float
    pitch: int
    gender: str

    @property
    def speaker(self) -> str:
        return f"{self.engine}-{self.name.replace('+', '-')}-r{round(self.rate * 100)}-p{self.pitch}"


def festival_voices() -> set[str]:
    """The voices festival finds (``voice.list``); empty when festival is missing."""
    if shutil.which("festival") is None:
        return set()
    res = subprocess.run(["festival", "--pipe"], input="(print (voice.list))\n", capture_output=True, text=True,
                         check=False)  # fmt: skip
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("(")]
    return set(lines[-1].strip("()").split()) if lines else set()


def check_tools(festival: tuple[str, ...] = ()) -> None:
    """Raise one error naming the Debian packages when a TTS tool or a ``festival`` voice is missing."""
    missing = [t for t in ("espeak-ng", "flite", "festival", "sox") if shutil.which(t) is None]
    try:
        ctypes.CDLL("libespeak-ng.so.1")
    except OSError:
        missing.append("libespeak-ng.so.1")
    if "festival" not in missing:
        have = festival_voices()
        for name in festival:
            if name not in have:
                missing.append(f"festival voice {name} ({FESTIVAL_VOICE_PACKAGE.get(name, 'no Debian package known')})")
            elif name.endswith("_mbrola") and shutil.which("mbrola") is None:
                missing.append(f"mbrola (the engine of festival voice {name})")
    if missing:
        raise RuntimeError(
            f"the synthetic corpus needs TTS tools that are missing: {', '.join(missing)}; "
            f"run setup.sh (it enables Debian's contrib and non-free components for the MBROLA voices), or "
            f"install them with `sudo apt-get install {DEBIAN_PACKAGES}`, or prepare a real corpus "
            "with --corpus mini_librispeech|librispeech|timit|yesno|kaldi --corpus-dir DIR"
        )


def _sox_to_16k(data: bytes | Path, in_rate: int, pitch_cents: int = 0) -> np.ndarray:
    """Resample (and pitch-shift, duration kept) through sox; returns float32 ``[num_samples]``.
    ``-R``: sox dithers its 16-bit output with a random seed unless told to repeat itself, and the
    corpus must be the same on every run (an interrupted stage 0 re-run included)."""
    if isinstance(data, Path):
        cmd = ["sox", "-R", str(data)]
        inp = None
    else:
        cmd = ["sox", "-R", "-t", "raw", "-r", str(in_rate), "-e", "signed", "-b", "16", "-c", "1", "-"]
        inp = data
    cmd += ["-t", "raw", "-e", "signed", "-b", "16", "-c", "1", "-r", str(SAMPLE_RATE), "-"]
    if pitch_cents:
        cmd += ["pitch", str(pitch_cents)]
    out = subprocess.run(cmd, input=inp, capture_output=True, check=True).stdout
    return np.frombuffer(out, dtype=np.int16).astype(np.float32) / 32768.0


# ---------------------------------------------------------------- espeak-ng through libespeak-ng
class _EspeakEventId(ctypes.Union):
    _fields_ = [("number", ctypes.c_int), ("name", ctypes.c_char_p), ("string", ctypes.c_char * 8)]


class _EspeakEvent(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("unique_identifier", ctypes.c_uint),
        ("text_position", ctypes.c_int),
        ("length", ctypes.c_int),
        ("audio_position", ctypes.c_int),
        ("sample", ctypes.c_int),
        ("user_data", ctypes.c_void_p),
        ("id", _EspeakEventId),
    ]


_SYNTH_CALLBACK = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.POINTER(_EspeakEvent)
)
_EVENT_LIST_TERMINATED, _EVENT_PHONEME = 0, 7
_AUDIO_OUTPUT_SYNCHRONOUS, _INITIALIZE_PHONEME_EVENTS, _INITIALIZE_DONT_EXIT = 2, 0x0001, 0x8000
_PARAM_RATE, _PARAM_PITCH, _POS_CHARACTER = 1, 3, 1


class _Espeak:
    """One libespeak-ng instance per process (the library is a process-wide singleton)."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libespeak-ng.so.1")
        self.rate = self.lib.espeak_Initialize(
            _AUDIO_OUTPUT_SYNCHRONOUS, 0, None, _INITIALIZE_PHONEME_EVENTS | _INITIALIZE_DONT_EXIT
        )
        if self.rate <= 0:
            raise RuntimeError(
                f"espeak_Initialize failed ({self.rate}); reinstall libespeak-ng1 and espeak-ng-data"
            )
        self._samples: list[bytes] = []
        self._events: list[tuple[str, int]] = []
        self._callback = _SYNTH_CALLBACK(self._on_audio)  # keep a reference: libespeak calls it
        self.lib.espeak_SetSynthCallback(self._callback)

    def _on_audio(self, wav, num_samples, events) -> int:
        if wav and num_samples > 0:
            self._samples.append(ctypes.string_at(wav, 2 * num_samples))
        i = 0
        while events[i].type != _EVENT_LIST_TERMINATED:
            ev = events[i]
            if ev.type == _EVENT_PHONEME:
                self._events.append((bytes(ev.id.string).rstrip(b"\0").decode("ascii", "replace"), ev.sample))
            i += 1
        return 0

    def synth(self, voice: Voice, text: str) -> tuple[np.ndarray, list[tuple[str, float, float]]]:
        if self.lib.espeak_SetVoiceByName(voice.name.encode()) != 0:
            raise RuntimeError(
                f"espeak-ng has no voice {voice.name!r}; list them with `espeak-ng --voices=en`"
            )
        self.lib.espeak_SetParameter(_PARAM_RATE, round(175 * voice.rate), 0)
        self.lib.espeak_SetParameter(_PARAM_PITCH, int(voice.pitch), 0)
        self._samples, self._events = [], []
        data = text.encode() + b"\0"
        err = self.lib.espeak_Synth(data, len(data), 0, _POS_CHARACTER, 0, 0, None, None)
        self.lib.espeak_Synchronize()
        if err != 0:
            raise RuntimeError(f"espeak_Synth returned {err}")
        raw = b"".join(self._samples)
        total = len(raw) // 2
        phones = []
        for k, (sym, start) in enumerate(self._events):
            end = self._events[k + 1][1] if k + 1 < len(self._events) else total
            if end > start:
                phones.append((sym, start / self.rate, end / self.rate))
        return _sox_to_16k(raw, self.rate), phones


_ESPEAK: _Espeak | None = None


def synth_espeak(voice: Voice, text: str) -> tuple[np.ndarray, list[tuple[str, float, float]]]:
    """Returns ``(audio [num_samples] float32 at 16 kHz, [(espeak_symbol, start_s, end_s), ...])``."""
    global _ESPEAK
    if _ESPEAK is None:
        _ESPEAK = _Espeak()
    return _ESPEAK.synth(voice, text)


# ---------------------------------------------------------------- flite
def _ends_to_spans(ends: list[tuple[str, float]]) -> list[tuple[str, float, float]]:
    spans, prev = [], 0.0
    for sym, end in ends:
        if end > prev:
            spans.append((sym, prev, end))
        prev = max(prev, end)
    return spans


def synth_flite(voice: Voice, text: str) -> tuple[np.ndarray, list[tuple[str, float, float]]]:
    """Returns ``(audio [num_samples] float32 at 16 kHz, [(flite_phone, start_s, end_s), ...])``."""
    with tempfile.TemporaryDirectory() as tmp:
        wav = Path(tmp) / "out.wav"
        res = subprocess.run(
            [
                "flite",
                "-voice",
                voice.name,
                "--setf",
                f"duration_stretch={1.0 / voice.rate:.4f}",
                "-psdur",
                "-t",
                text,
                "-o",
                str(wav),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        ends = []
        for item in res.stdout.split():
            sym, _, end = item.rpartition(":")
            ends.append((sym, float(end)))
        return _sox_to_16k(wav, 0, voice.pitch), _ends_to_spans(ends)


# ---------------------------------------------------------------- festival
def synth_festival_batch(voice: Voice, texts: list[str]) -> list[tuple[np.ndarray, list] | Exception]:
    """Synthesise many texts with one festival process (its start-up dominates short texts).

    Returns one entry per text: ``(audio [num_samples] float32 16 kHz, [(phone, start_s, end_s)])``
    or the exception that explains why that text produced nothing.
    """
    with tempfile.TemporaryDirectory() as tmp:
        lines = [f"(voice_{voice.name})", f"(Parameter.set 'Duration_Stretch {1.0 / voice.rate:.4f})"]
        for k, text in enumerate(texts):
            safe = text.replace("\\", " ").replace('"', " ")
            lines.append(
                f'(unwind-protect (begin (set! u (Utterance Text "{safe}")) (utt.synth u) '
                f'(utt.wave.resample u {SAMPLE_RATE}) (utt.save.wave u "{tmp}/{k}.wav" \'riff) '
                f'(utt.save.segs u "{tmp}/{k}.segs")) (format t "failed %d\\n" {k}))'
            )
        script = Path(tmp) / "synth.scm"
        script.write_text("\n".join(lines) + "\n")
        res = subprocess.run(["festival", "-b", str(script)], capture_output=True, text=True, check=False)
        out: list = []
        for k in range(len(texts)):
            wav, segs = Path(tmp) / f"{k}.wav", Path(tmp) / f"{k}.segs"
            if not wav.exists() or not segs.exists():
                out.append(
                    RuntimeError(
                        f"festival wrote no audio (rc={res.returncode}): {res.stderr.strip()[-300:]}"
                    )
                )
                continue
            ends = []
            for line in segs.read_text().splitlines():
                parts = line.split()
                if len(parts) == 3 and parts[0] != "#":
                    ends.append((parts[2], float(parts[0])))
            out.append((_sox_to_16k(wav, 0, voice.pitch), _ends_to_spans(ends)))
        return out


def to_alignment(
    spans: list[tuple[str, float, float]], engine: str, duration: float, time_scale: float = 1.0
) -> tuple[list[tuple[str, float, float]], Counter]:
    """Map engine phones to ARPAbet and make them tile ``[0, duration)`` exactly.

    Args:
        spans: ``(engine_symbol, start_s, end_s)`` from a synth function.
        engine: selects the symbol table.
        duration: audio length in seconds; spans past it are clipped (kal16's final pause).
        time_scale: multiply all times (``1 / speed`` for a sox ``speed`` copy).

    Returns:
        ``([(ARPAbet, start_s, duration_s), ...], Counter of unmapped engine symbols)``.
        Gaps of 1 ms or more (before the first phone, after the last) are filled with
        ``SIL``, shorter ones absorbed; adjacent ``SIL`` are merged.
    """
    lookup = espeak_symbol if engine == "espeak" else flite_symbol
    unmapped: Counter = Counter()
    pieces: list[list] = []
    for sym, start, end in spans:
        start, end = start * time_scale, end * time_scale
        phones = lookup(sym)
        if phones == ():
            if pieces:
                pieces[-1][2] = end
            continue
        if phones is None:
            unmapped[sym] += 1
            phones = (SIL,)
        step = (end - start) / len(phones)
        for i, ph in enumerate(phones):
            pieces.append([ph, start + i * step, start + (i + 1) * step])
    items: list[list] = []
    t = 0.0
    for ph, start, end in pieces:
        start, end = max(start, t), min(end, duration)
        if end <= start:
            continue
        if start > t + 1e-3:
            items.append([SIL, t, start])
        else:  # gaps under 1 ms (rounding in the engines' outputs) go to the phone that follows
            start = t
        if items and items[-1][0] == ph == SIL:
            items[-1][2] = end
        else:
            items.append([ph, start, end])
        t = end
    if t < duration:
        if items and items[-1][0] == SIL:
            items[-1][2] = duration
        else:
            items.append([SIL, t, duration])
    out = []
    for ph, s, e in items:
        s, e = round(s, 5), round(e, 5)
        if e > s:
            out.append((ph, s, round(e - s, 5)))
    return out, unmapped
