"""Stage 0 (synthetic): the embedded corpus, synthesised with espeak-ng, flite and festival.

Splits:

- ``train``: 60 espeak-ng settings (5 accents × m1–m5, f1–f3, Andy, travis, aunty, belinda) plus 3 settings each of flite
  kal16/awb/slt and festival kal_diphone/cmu_us_slt_arctic_hts, each with its own rate and
  pitch; plus one augmented copy of every utterance (sox speed 0.9–1.1, reverb, noise at
  10–30 dB SNR), id suffixed ``-aug``, same speaker.
- ``dev``: held-out voices, used in neither train nor test (espeak en-gb-scotland / en-029 /
  en-us-nyc with the variants m8, robert, Annie, linda, and since version 3 also Michael, paul,
  quincy, rob, Alicia, Andrea, anika, steph: 36 voices; since version 4 also festival's MBROLA
  diphone voices us1 (female), us2 and us3 (male), 2 settings each, so that dev has festival
  voices as test has), sentences not in train or test; 900 sentences, for the acoustic scale and
  the epoch, which must be chosen on voices the model has not heard (on version 3's first build the
  900 picked each DNN run's best test scale in 6 runs of 6, the first 300 alone in 1 of 6:
  docs/experiments/corpus_v3.md). Flite has no English voice left that train and test do not use,
  so dev has no flite voice (giving dev awb, one of train's, made every system worse on test:
  docs/experiments/corpus_v4.md; a choice of the corpus's design made on test, the one measure two
  corpora with different dev sets share).
- ``test``: voices never used in training (espeak en-gb-scotland / en-029 / en-us-nyc with
  m6, m7, f4, f5; flite rms; festival ked_diphone), sentences not in train or dev; 1650
  sentences (≥ 12,000 words), so that WER differences of a few percent relative can be told
  from noise.

Utterance ids are ``<speaker>_<split><index>``; the speaker id names the voice setting
(``espeak-en-us-m3-r110-p55``). Everything is deterministic in ``seed``. Each supervision
carries the engine's phone timings as ``alignment["phone"]`` (ARPAbet, no stress, ``SIL``),
relative to the recording and tiling it exactly; for the ``-aug`` copies the times are
scaled by ``1 / speed`` (reverb and noise keep them).
"""

from __future__ import annotations

import logging
import multiprocessing
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from lhotse import CutSet, MonoCut, Recording
from lhotse.audio import AudioSource
from lhotse.supervision import AlignmentItem, SupervisionSegment
from tqdm.auto import tqdm

from local.atomic import atomic_path, die_with_parent
from local.constants import SPLITS
from local.data.augment import Augmentation
from local.data.synth_jobs import Utterance, synth_chunk
from local.data.text import make_sentences
from local.data.tts import SAMPLE_RATE, Voice, check_tools
from local.drops import clear_drops, record_drop

log = logging.getLogger(__name__)

# 4: dev's sentences shared between espeak and festival's MBROLA voices, train and test as in 3;
# 3: dev of 900 sentences and 36 held-out voices, train and test as in 2; 2: dev of 300 sentences and 12
# held-out voices, 1650 test sentences, 60 espeak training voices; 1: dev of training voices
VERSION = 4
DEV_POOL_FACTOR = 20  # candidate sentences per dev sentence when looking for in-vocabulary ones
# Share of utterances per engine: espeak has many voices but one synthesis method, so it
# does not get a share proportional to its number of voices.
ENGINE_SHARE = {"espeak": 0.5, "flite": 0.3, "festival": 0.2}


@dataclass(frozen=True)
class Size:
    """Utterances per split (sentences 4–10 words, ~2.3 s each) and which voices take part.

    Attributes:
        train, dev, test: number of sentences (train gets as many augmented copies again).
        espeak_variants_train / _test: espeak variants used per accent.
        espeak_variants_dev: espeak variants of the dev voices, on the test accents.
        settings_per_voice: rate/pitch settings per flite/festival voice in train (test: 1 less, at least 1).
        words_per_class: keep only this many words of each template word class (None: all).
        dev_extra: more dev sentences, on the voices of ``espeak_variants_dev_extra`` (test accents)
            and ``festival_dev``. They are planned after everything else, from sentences neither train,
            dev nor test has, so that train and test stay what they are without them.
        festival_dev: festival voices of dev (``(name, gender)``), persons that neither train nor test
            has; each gets as many settings as a test voice of flite or festival. Dev's sentences are
            shared among its engines by ``ENGINE_SHARE``, as train's and test's are.
    """

    train: int
    dev: int
    test: int
    espeak_accents_train: tuple[str, ...]
    espeak_variants_train: tuple[str, ...]
    espeak_accents_test: tuple[str, ...]
    espeak_variants_test: tuple[str, ...]
    settings_per_voice: int
    espeak_variants_dev: tuple[str, ...]
    words_per_class: int | None = None
    dev_extra: int = 0
    espeak_variants_dev_extra: tuple[str, ...] = ()
    festival_dev: tuple[tuple[str, str], ...] = ()


SIZES = {
    "default": Size(
        1800,
        300,
        1650,
        ("en-us", "en", "en-gb-x-rp", "en-gb-x-gbclan", "en-gb-x-gbcwmd"),
        ("m1", "m2", "m3", "m4", "m5", "f1", "f2", "f3", "Andy", "travis", "aunty", "belinda"),
        ("en-gb-scotland", "en-029", "en-us-nyc"),
        ("m6", "m7", "f4", "f5"),
        3,
        ("m8", "robert", "Annie", "linda"),
        dev_extra=600,
        espeak_variants_dev_extra=("Michael", "paul", "quincy", "rob", "Alicia", "Andrea", "anika", "steph"),
        festival_dev=(("us1_mbrola", "f"), ("us2_mbrola", "m"), ("us3_mbrola", "m")),
    ),
    "tiny": Size(24, 6, 12, ("en-us", "en"), ("m1", "f2"), ("en-gb-scotland",), ("m6", "f4"), 1, ("m8",), 2),
}

ESPEAK_GENDER = {"Andy": "m", "travis": "m", "robert": "m", "Michael": "m", "paul": "m", "quincy": "m", "rob": "m",
                 "aunty": "f", "belinda": "f", "Annie": "f", "linda": "f", "Alicia": "f", "Andrea": "f", "anika": "f",
                 "steph": "f"}  # named variants; m1.., f1.. say it in their name
FLITE_TRAIN = (("kal16", "m"), ("awb", "m"), ("slt", "f"))
FESTIVAL_TRAIN = (("kal_diphone", "m"), ("cmu_us_slt_arctic_hts", "f"))
FLITE_TEST = (("rms", "m"),)
FESTIVAL_TEST = (("ked_diphone", "m"),)
# The person each flite/festival voice was recorded from (espeak's voices are rules, each its own): flite's
# kal16 and festival's kal_diphone are one speaker, as are the two slt voices. These five are in train or
# test (docs/experiments/corpus_v4_tries.md measured moving kal or slt to dev); dev's festival voices are
# MBROLA's three American diphone databases (Debian's contrib and non-free festvox-us1/2/3), three more
# persons.
RECORDED_SPEAKER = {"kal16": "kal", "kal_diphone": "kal", "awb": "awb", "slt": "slt", "cmu_us_slt_arctic_hts": "slt",
                    "rms": "rms", "ked_diphone": "ked", "us1_mbrola": "us1", "us2_mbrola": "us2",
                    "us3_mbrola": "us3"}


def recorded_speaker(voice: Voice) -> str:
    """Who a voice speaks as: the recorded person of a flite/festival voice, else the espeak voice."""
    return person(voice.engine, voice.name)


def person(engine: str, voice: str) -> str:
    """``recorded_speaker`` from a cut's ``custom`` fields (``engine``, ``voice``): the recorded person of
    a flite/festival voice, else the espeak voice; every rate/pitch setting of it is the same person."""
    return RECORDED_SPEAKER.get(voice, voice) if engine != "espeak" else voice


def voice_settings(size: Size, seed: int) -> dict[str, list[Voice]]:
    """Voice settings per engine for ``train``, ``dev`` and ``test`` (no setting in two splits).

    Returns:
        ``{"train": {engine: [Voice, ...]}, "dev": {"espeak": [...], "festival": [...]}, "test": {...},
        "dev_extra": {"espeak": [...], "festival": [...]}}``
    """
    rng = random.Random(f"voices-{seed}")

    def espeak(accents, variants):
        return [
            Voice("espeak", f"{a}+{v}", round(rng.uniform(0.85, 1.2), 2), rng.randrange(30, 71), ESPEAK_GENDER.get(v, v[0]))
            for a in accents
            for v in variants
        ]

    def others(engine, names, n):
        return [
            Voice(engine, name, round(rng.uniform(0.85, 1.15), 2), rng.randrange(-200, 201, 50), g)
            for name, g in names
            for _ in range(n)
        ]

    n_test = max(1, size.settings_per_voice - 1)
    out = {
        "train": {
            "espeak": espeak(size.espeak_accents_train, size.espeak_variants_train),
            "flite": others("flite", FLITE_TRAIN, size.settings_per_voice),
            "festival": others("festival", FESTIVAL_TRAIN, size.settings_per_voice),
        },
        "test": {
            "espeak": espeak(size.espeak_accents_test, size.espeak_variants_test),
            "flite": others("flite", FLITE_TEST, n_test),
            "festival": others("festival", FESTIVAL_TEST, n_test),
        },
        # drawn last, so that the train and test settings stay those of the corpus before dev had its own voices
        "dev": {"espeak": espeak(size.espeak_accents_test, size.espeak_variants_dev)},
    }
    # dev's festival settings (its further sentences share them), drawn after dev's espeak ones for the same reason
    festival = others("festival", size.festival_dev, n_test)
    # drawn after dev's, for the same reason
    out["dev_extra"] = {"espeak": espeak(size.espeak_accents_test, size.espeak_variants_dev_extra)}
    if festival:
        out["dev"]["festival"] = out["dev_extra"]["festival"] = festival
    return out


def plan(size: Size, seed: int, audio_dir: Path) -> list[Utterance]:
    """Assign distinct sentences to splits and voices (deterministic in ``seed``)."""
    # A pool larger than needed, so that dev can take sentences whose words all occur in train:
    # dev frame accuracy needs alignments, and an utterance with a word outside the training
    # lexicon cannot be aligned. Test sentences are drawn freely (their OOVs count as errors).
    pool = make_sentences(
        size.train + size.test + DEV_POOL_FACTOR * size.dev, seed, words_per_class=size.words_per_class
    )
    rng = random.Random(f"plan-{seed}")
    rng.shuffle(pool)
    vocab = {w for text in pool[: size.train] for w in text.split()}
    rest = pool[size.train :]
    dev = [t for t in rest if set(t.split()) <= vocab][: size.dev]
    dev += [t for t in rest if t not in dev][: size.dev - len(dev)]
    taken = set(dev)
    split_texts = {"train": pool[: size.train], "dev": dev, "test": [t for t in rest if t not in taken][: size.test]}
    voices = voice_settings(size, seed)
    utts = []
    for split in SPLITS:
        texts = split_texts[split]
        by_engine = voices[split]
        # engines by share (among those the split has voices of), then round-robin over each engine's settings
        engines = [e for e in ENGINE_SHARE if by_engine.get(e)]
        engine_of = rng.choices(engines, weights=[ENGINE_SHARE[e] for e in engines], k=len(texts))
        used = Counter()
        for k, (text, engine) in enumerate(zip(texts, engine_of)):
            voice = by_engine[engine][used[engine] % len(by_engine[engine])]
            used[engine] += 1
            uid = f"{voice.speaker}_{split}{k:05d}"
            aug = Augmentation.draw(rng) if split == "train" else None
            utts.append(Utterance(uid, split, text, voice, audio_dir / split / f"{uid}.wav", aug))
    # dev's further sentences and voices, after every draw above (so that those are as without them)
    used_texts = taken | set(split_texts["test"])
    left = [t for t in rest if t not in used_texts]
    extra = ([t for t in left if set(t.split()) <= vocab] + [t for t in left if not set(t.split()) <= vocab])
    if len(extra) < size.dev_extra:
        raise ValueError(f"the sentence pool has {len(extra)} sentences left for dev_extra={size.dev_extra}; "
                         "raise DEV_POOL_FACTOR or lower dev_extra")
    by_engine = voices["dev_extra"]
    if size.dev_extra and not by_engine["espeak"]:
        raise ValueError(f"dev_extra={size.dev_extra} needs voices: give espeak_variants_dev_extra (and "
                         "espeak_accents_test), or set dev_extra=0")
    # engines drawn by share as above, from a generator of their own (nothing drawn before changes)
    engines = [e for e in ENGINE_SHARE if by_engine.get(e)]
    engine_of = random.Random(f"dev-extra-{seed}").choices(
        engines, weights=[ENGINE_SHARE[e] for e in engines], k=size.dev_extra
    ) if size.dev_extra else []
    # round-robin over each engine's settings; festival's are dev's own, so they go on where dev's stopped
    used = Counter(u.voice.engine for u in utts if u.split == "dev" and u.voice.engine != "espeak")
    for i, (text, engine) in enumerate(zip(extra[: size.dev_extra], engine_of)):
        voice, k = by_engine[engine][used[engine] % len(by_engine[engine])], size.dev + i
        used[engine] += 1
        uid = f"{voice.speaker}_dev{k:05d}"
        utts.append(Utterance(uid, "dev", text, voice, audio_dir / "dev" / f"{uid}.wav", None))
    return utts


def _chunks(utts: list[Utterance], n: int) -> list[list[Utterance]]:
    """Group by voice (festival synthesises a whole group in one process), at most ``n`` each."""
    by_voice: dict[Voice, list[Utterance]] = {}
    for u in utts:
        by_voice.setdefault(u.voice, []).append(u)
    return [group[i : i + n] for group in by_voice.values() for i in range(0, len(group), n)]


def _cut(res: dict) -> MonoCut:
    u: Utterance = res["utt"]
    n = res["num_samples"]
    rec = Recording(
        id=res["id"],
        sources=[AudioSource(type="file", channels=[0], source=str(res["wav"].resolve()))],
        sampling_rate=SAMPLE_RATE,
        num_samples=n,
        duration=n / SAMPLE_RATE,
    )
    custom = {"engine": u.voice.engine, "voice": u.voice.name, "rate": u.voice.rate, "pitch": u.voice.pitch}
    if "aug" in res:
        custom["augmentation"] = res["aug"]
    sup = SupervisionSegment(
        id=res["id"],
        recording_id=res["id"],
        start=0.0,
        duration=rec.duration,
        channel=0,
        text=u.text,
        speaker=u.voice.speaker,
        gender=u.voice.gender,
        language="English",
        alignment={"phone": [AlignmentItem(symbol=p, start=s, duration=d) for p, s, d in res["phones"]]},
        custom=custom,
    )
    return MonoCut(
        id=res["id"], start=0.0, duration=rec.duration, channel=0, recording=rec, supervisions=[sup]
    )


def prepare_synthetic(
    data_dir: Path, size: str = "default", seed: int = 0, num_jobs: int = 2
) -> dict[str, CutSet]:
    """Synthesise the embedded corpus and write ``<data_dir>/manifests/{train,dev,test}_cuts.jsonl.gz``.

    Args:
        data_dir: output root; audio goes to ``<data_dir>/audio/<split>/``.
        size: ``default`` (≥ 1 h train + augmented copy, 0.5 h dev, ≥ 1 h test) or ``tiny`` (tests).
        seed: fixes sentences, voice settings and augmentation.
        num_jobs: synthesis processes.

    Returns:
        ``{"train": CutSet, "dev": CutSet, "test": CutSet}``, cuts sorted by id.
    """
    if size not in SIZES:
        raise ValueError(f"unknown corpus size {size!r}; use one of {sorted(SIZES)}")
    if num_jobs < 1:
        raise ValueError(f"num_jobs={num_jobs}; use 1 or more")
    data_dir = Path(data_dir)
    utts = plan(SIZES[size], seed, data_dir / "audio")
    check_tools(festival=tuple(sorted({u.voice.name for u in utts if u.voice.engine == "festival"})))
    clear_drops(data_dir, "corpus")
    chunks = _chunks(utts, 8 if size == "tiny" else 25)
    results: list[dict] = []
    bar = tqdm(total=len(utts), desc=f"synthesising {size} corpus", unit="utt")
    # espeak-ng keeps waveform state (pitch phase) from one utterance to the next, which moves
    # its phone events by a few samples: every chunk runs in a fresh process, forked from a
    # clean fork server (never from this process, which may have used libespeak-ng already),
    # so the corpus is the same whatever num_jobs and whatever ran before.
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["local.data.synth_jobs"])
    with ctx.Pool(num_jobs, initializer=die_with_parent, maxtasksperchild=1) as pool:
        for res in pool.imap_unordered(synth_chunk, chunks):
            results += res
            bar.update(sum(1 for r in res if not r.get("id", "").endswith("-aug")))
    bar.close()

    unmapped: Counter = Counter()
    cuts: dict[str, list[MonoCut]] = {s: [] for s in SPLITS}
    for res in results:
        u = res["utt"]
        if not res["ok"]:
            record_drop(data_dir, "corpus", u.split, res.get("id", u.id), res["reason"], res["detail"])
            continue
        unmapped += res["unmapped"]
        cuts[u.split].append(_cut(res))
    if unmapped:
        log.warning(
            "corpus: engine phone symbols without an ARPAbet mapping (scored as SIL): %s",
            dict(unmapped.most_common(20)),
        )
    out_dir = data_dir / "manifests"
    out_dir.mkdir(parents=True, exist_ok=True)
    manifests = {}
    for split in SPLITS:
        cs = CutSet.from_cuts(sorted(cuts[split], key=lambda c: c.id))
        with atomic_path(out_dir / f"{split}_cuts.jsonl.gz") as tmp:
            cs.to_file(tmp)
        manifests[split] = cs
    log.info("corpus: synthetic %s, %s", size, summarize(manifests))
    drops = sum(1 for r in results if not r["ok"])
    if drops:
        log.warning("corpus: %d utterances dropped, see %s", drops, data_dir / "dropped.jsonl")
    return manifests


def summarize(manifests: dict[str, CutSet]) -> str:
    """One line: hours / utterances / speakers per split."""
    parts = []
    for split, cs in manifests.items():
        hours = sum(c.duration for c in cs) / 3600
        speakers = {s.speaker for c in cs for s in c.supervisions}
        parts.append(f"{split} {hours:.2f} h / {len(cs)} utts / {len(speakers)} speakers")
    return "; ".join(parts)
