#!/usr/bin/env python3
"""A user's corpus, as a new user brings one: Kaldi data dirs of real English sentences spoken by voices
that neither dev nor test shares with train, and a text for the language model.

The sentences are real text, not the recipe's generator: quotations from Debian's ``fortunes`` package
(``apt-get install fortunes``; any text files can be given with ``--text``), split into sentences of
4-14 words, upper-cased, with digits and markup left out; so the words are those of written English,
and some are in no lexicon (the recipe's ``--oov`` policy meets them). Each sentence is used once. The
voices are the recipe's TTS engines (``local.data.tts``), a different set of persons per split:

- train: espeak-ng's ``en-us``, ``en``, ``en-gb-x-rp`` and ``en-gb-x-gbclan`` accents with 8 variants
  each, and flite's ``kal16``, ``awb`` and ``slt``;
- dev: espeak's ``en-gb-scotland`` and ``en-029`` with 4 other variants, festival's MBROLA ``us1``;
- test: espeak's ``en-us-nyc`` and ``en-gb-x-gbcwmd`` with 4 more variants, flite's ``rms``.

Writes ``<out>/{train,dev,test}/`` (``wav.scp``, ``text``, ``utt2spk``, ``spk2utt``; 16 kHz WAV files
under ``<out>/wav``) and ``<out>/lm.txt`` (train's sentences and as many again that no split speaks:
the user's LM text, never dev's or test's). Deterministic in ``--seed``. Then, as the recipe's README
says for a Kaldi data dir:

  python recipes/asr/research/unseen_voices_corpus.py --out /tmp/user_corpus
  python recipes/asr/prepare.py --corpus kaldi --corpus-dir /tmp/user_corpus --lm-text /tmp/user_corpus/lm.txt \\
      --data-dir data/user_corpus

Sizes default to the review's (1,500 / 250 / 300 utterances, about an hour of training speech).
"""

from __future__ import annotations

import argparse
import random
import re
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import soundfile as sf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # recipes/asr: the recipe's `local` package

from local.data.tts import SAMPLE_RATE, Voice, check_tools, synth_espeak, synth_festival_batch, synth_flite

FORTUNES = Path("/usr/share/games/fortunes")
ESPEAK_VARIANTS = {"train": ("m1", "m2", "m3", "m4", "f1", "f2", "f3", "Andy"),
                   "dev": ("m5", "f4", "robert", "Annie"),
                   "test": ("m6", "f5", "travis", "linda")}
ESPEAK_ACCENTS = {"train": ("en-us", "en", "en-gb-x-rp", "en-gb-x-gbclan"),
                  "dev": ("en-gb-scotland", "en-029"),
                  "test": ("en-us-nyc", "en-gb-x-gbcwmd")}
OTHERS = {"train": (("flite", "kal16", "m"), ("flite", "awb", "m"), ("flite", "slt", "f")),
          "dev": (("festival", "us1_mbrola", "f"),),
          "test": (("flite", "rms", "m"),)}
FEMALE = {"Annie", "linda"}
SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
LEFT_OUT = re.compile(r"[0-9@#$%&*_/\\<>=+:;()\[\]{}|~^\"]|--")


def sentences(paths: list[Path]) -> list[str]:
    """Distinct sentences of 4-14 words from fortune files (entries separated by ``%`` lines), upper-cased,
    letters and apostrophes only; a sentence with digits or markup is left out, in file order."""
    seen: dict[str, None] = {}
    for path in paths:
        for entry in path.read_text(encoding="latin-1").split("\n%\n"):
            for sentence in SENTENCE_END.split(" ".join(entry.split())):
                if LEFT_OUT.search(sentence):
                    continue
                words = [w.strip("'-").upper() for w in re.sub(r"[^A-Za-z' -]", " ", sentence).split()]
                words = [w for w in words if w and not w.startswith("-")]
                if 4 <= len(words) <= 14:
                    seen.setdefault(" ".join(words), None)
    return list(seen)


def voices(split: str, rng: random.Random, accents: tuple[str, ...] | None = None,
           others: bool = True) -> list[Voice]:
    """The split's voice settings: every espeak accent (``accents``, default the split's own) with every
    variant of the split, and (``others``) the other engines' voices (two settings each), each at its own
    rate and pitch."""
    out = [Voice("espeak", f"{a}+{v}", round(rng.uniform(0.85, 1.2), 2), rng.randrange(30, 71),
                 "f" if v[0] == "f" or v in FEMALE else "m")
           for a in (accents or ESPEAK_ACCENTS[split]) for v in ESPEAK_VARIANTS[split]]
    for engine, name, gender in OTHERS[split] if others else ():
        out += [Voice(engine, name, round(rng.uniform(0.85, 1.15), 2), rng.randrange(-200, 201, 50), gender)
                for _ in range(2)]
    return out


def synth_voice(job: tuple[Voice, list[tuple[str, str]], str]) -> list[tuple[str, str, float]]:
    """Synthesise one voice's utterances ``[(utt, text)]`` into ``out/wav``; ``[(utt, path, seconds)]`` of
    those that synthesised (a failed sentence is left out, as a user's unreadable recording would be)."""
    voice, utts, out = job
    if voice.engine == "festival":
        results = synth_festival_batch(voice, [t for _, t in utts])
    else:
        synth = synth_espeak if voice.engine == "espeak" else synth_flite
        results = []
        for _, text in utts:
            try:
                results.append(synth(voice, text))
            except Exception as e:  # noqa: BLE001
                results.append(e)
    written = []
    for (utt, _), result in zip(utts, results):
        if isinstance(result, Exception):
            print(f"{utt}: not synthesised ({result})", file=sys.stderr)
            continue
        audio = np.asarray(result[0], dtype=np.float32)
        path = Path(out) / "wav" / f"{utt}.wav"
        sf.write(str(path), audio, SAMPLE_RATE, subtype="PCM_16")
        written.append((utt, str(path.resolve()), len(audio) / SAMPLE_RATE))
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="where the data dirs, wav/ and lm.txt go")
    ap.add_argument("--text", type=Path, nargs="+", help="text files of %%-separated entries "
                    f"(default: every fortune file in {FORTUNES})")
    ap.add_argument("--sizes", type=int, nargs=3, default=(1500, 250, 300), metavar=("TRAIN", "DEV", "TEST"),
                    help="utterances per split (default: 1500 250 300)")
    ap.add_argument("--dev-accents", nargs="+", choices=sorted({a for v in ESPEAK_ACCENTS.values() for a in v}),
                    help="dev's espeak accents (default: " + " ".join(ESPEAK_ACCENTS["dev"]) + ", which train "
                    "lacks); with train's accents dev holds unseen voices of seen accents")
    ap.add_argument("--dev-espeak-only", action="store_true", help="dev without festival's us1 (espeak voices only)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=2, help="parallel synthesis processes")
    args = ap.parse_args(argv)
    paths = args.text or sorted(p for p in FORTUNES.glob("*") if p.is_file() and "." not in p.name)
    if not paths:
        ap.error(f"no text: {FORTUNES} holds no fortune files (apt-get install fortunes) and --text was not given")
    pool = sentences(paths)
    rng = random.Random(f"user-corpus-{args.seed}")
    rng.shuffle(pool)
    need = sum(args.sizes)
    if len(pool) < need + args.sizes[0]:
        ap.error(f"{len(pool)} sentences for {need} utterances and {args.sizes[0]} more of LM text: give more --text")
    check_tools(tuple(name for split in OTHERS.values() for engine, name, _ in split if engine == "festival"))
    (args.out / "wav").mkdir(parents=True, exist_ok=True)
    jobs, text, start = [], {}, 0
    for split, size in zip(("train", "dev", "test"), args.sizes):
        settings = (voices(split, rng, args.dev_accents and tuple(args.dev_accents), not args.dev_espeak_only)
                    if split == "dev" else voices(split, rng))
        texts = pool[start:start + size]
        start += size
        for i, voice in enumerate(settings):
            utts = [(f"{voice.speaker}-{split}{j:05d}", t) for j, t in enumerate(texts) if j % len(settings) == i]
            text.update(utts)
            jobs.append((voice, utts, str(args.out)))
    lm = pool[:args.sizes[0]] + pool[need:need + args.sizes[0]]  # train's sentences and as many unspoken
    (args.out / "lm.txt").write_text("\n".join(lm) + "\n")
    with ProcessPoolExecutor(args.jobs) as ex:
        done = [w for ws in ex.map(synth_voice, jobs) for w in ws]
    by_split: dict[str, list] = {"train": [], "dev": [], "test": []}
    for utt, path, seconds in done:
        by_split[utt.rsplit("-", 1)[1].rstrip("0123456789")].append((utt, path, seconds))
    for split, utts in by_split.items():
        d = args.out / split
        d.mkdir(exist_ok=True)
        utts.sort()
        spk = {u: u.rsplit("-", 1)[0] for u, _, _ in utts}
        (d / "wav.scp").write_text("".join(f"{u} {p}\n" for u, p, _ in utts))
        (d / "text").write_text("".join(f"{u} {text[u]}\n" for u, _, _ in utts))
        (d / "utt2spk").write_text("".join(f"{u} {spk[u]}\n" for u, _, _ in utts))
        spk2utt: dict[str, list[str]] = {}
        for u, _, _ in utts:
            spk2utt.setdefault(spk[u], []).append(u)
        (d / "spk2utt").write_text("".join(f"{s} {' '.join(us)}\n" for s, us in sorted(spk2utt.items())))
        hours = sum(s for _, _, s in utts) / 3600
        print(f"{split}: {len(utts)} utterances, {len(spk2utt)} speakers, {hours:.2f} h")
    print(f"LM text: {len(lm)} sentences -> {args.out / 'lm.txt'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
