"""Stage 0: the embedded TTS corpus and real-corpus layouts to Lhotse manifests."""

from __future__ import annotations

import gzip
import shutil
from collections import Counter
from dataclasses import replace
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from fixtures_corpus import (
    load_split,
    tiny_utterances,
    write_kaldi_dir,
    write_librispeech,
    write_timit,
)
from local.data import corpus_synthetic, tts
from local.data.corpus_real import prepare_real
from local.data.corpus_synthetic import ENGINE_SHARE, SIZES, plan, prepare_synthetic, recorded_speaker
from local.drops import load_drops

ARPABET = {
    "AA", "AE", "AH", "AO", "AW", "AY", "B", "CH", "D", "DH", "EH", "ER", "EY", "F", "G", "HH", "IH",
    "IY", "JH", "K", "L", "M", "N", "NG", "OW", "OY", "P", "R", "S", "SH", "T", "TH", "UH", "UW", "V",
    "W", "Y", "Z", "ZH", "SIL",
}


def _speakers(cuts) -> set[str]:
    return {c.supervisions[0].speaker for c in cuts}


def _texts(cuts) -> set[str]:
    return {c.supervisions[0].text for c in cuts}


# ------------------------------------------------------------------ synthetic corpus
def test_tiny_corpus_splits(tiny_corpus):
    train, dev, test = (load_split(tiny_corpus, s) for s in ("train", "dev", "test"))
    assert len(train) > 0 and len(dev) > 0 and len(test) > 0
    ids = [c.id for cs in (train, dev, test) for c in cs]
    assert len(ids) == len(set(ids))
    # test and dev voices never trained on, and no voice setting in both dev and test
    assert not _speakers(train) & _speakers(test)
    assert not _speakers(dev) & _speakers(train) and not _speakers(dev) & _speakers(test)
    engines = {c.supervisions[0].custom["engine"] for c in test}
    assert engines == {"espeak", "flite", "festival"}
    # sentences disjoint between splits (augmented copies repeat their own train sentence)
    assert (
        not _texts(train) & _texts(test)
        and not _texts(train) & _texts(dev)
        and not _texts(dev) & _texts(test)
    )
    # every train utterance has an augmented copy: same speaker and text, different audio length
    plain = {c.id: c for c in train if not c.id.endswith("-aug")}
    augmented = [c for c in train if c.id.endswith("-aug")]
    assert len(augmented) == len(plain)
    for c in augmented:
        orig = plain[c.id[: -len("-aug")]]
        assert c.supervisions[0].speaker == orig.supervisions[0].speaker
        assert c.supervisions[0].text == orig.supervisions[0].text
    for c in list(train) + list(test):
        sup = c.supervisions[0]
        words = sup.text.split()
        assert 4 <= len(words) <= 10 and sup.text == sup.text.upper() and sup.language == "English"
        audio = c.load_audio()
        assert c.sampling_rate == 16000 and audio.shape == (1, c.num_samples) and np.abs(audio).max() > 0.01


def test_tiny_corpus_gold_alignments_tile_the_audio(tiny_corpus):
    for split in ("train", "dev", "test"):
        for c in load_split(tiny_corpus, split):
            ali = c.supervisions[0].alignment["phone"]
            assert ali[0].start == 0.0
            for a, b in pairwise(ali):
                assert abs(a.start + a.duration - b.start) < 1e-4 and a.duration > 0
            assert abs(ali[-1].start + ali[-1].duration - c.duration) < 1e-3
            assert {a.symbol for a in ali} <= ARPABET
            speech = [a.symbol for a in ali if a.symbol != "SIL"]
            # about one gold phone per lexicon phone: 4-10 words of 1-10 phones each
            assert (
                len(c.supervisions[0].text.split()) <= len(speech) <= 10 * len(c.supervisions[0].text.split())
            )


def test_tiny_corpus_is_deterministic(tiny_corpus, tmp_path):
    size = SIZES["tiny"]
    first, again = plan(size, 0, tmp_path), plan(size, 0, tmp_path)
    assert [(u.id, u.text, u.voice, u.aug) for u in first] == [(u.id, u.text, u.voice, u.aug) for u in again]
    assert [u.text for u in plan(size, 1, tmp_path)] != [u.text for u in first]
    # a rebuild (one process this time) reproduces ids, texts and gold timings
    rebuilt = prepare_synthetic(tmp_path / "again", size="tiny", seed=0, num_jobs=1)
    for split in ("train", "dev", "test"):
        a, b = load_split(tiny_corpus, split), rebuilt[split]
        assert [c.id for c in a] == [c.id for c in b]
        assert [c.supervisions[0].text for c in a] == [c.supervisions[0].text for c in b]
        assert [c.supervisions[0].alignment["phone"] for c in a] == [
            c.supervisions[0].alignment["phone"] for c in b
        ]


def test_dev_extra_adds_held_out_voices_and_leaves_the_rest_as_it_was(tmp_path):
    """Version 3's further dev sentences: new voices and sentences, while train, test and the first
    ``dev`` sentences are what the corpus without them has (the default size's plan, no synthesis)."""
    size = SIZES["default"]
    assert size.dev_extra > 0
    with_extra = plan(size, 0, tmp_path)
    without = plan(replace(size, dev_extra=0, espeak_variants_dev_extra=()), 0, tmp_path)

    def key(utts):
        return [(u.id, u.text, u.voice, u.aug) for u in utts]

    assert key(u for u in with_extra if u.split != "dev") == key(u for u in without if u.split != "dev")
    dev = [u for u in with_extra if u.split == "dev"]
    assert key(dev[: size.dev]) == key(u for u in without if u.split == "dev")
    extra = dev[size.dev :]
    assert len(extra) == size.dev_extra and len({u.id for u in dev}) == len(dev)
    others = {u.voice for u in with_extra if u not in extra}
    extra_espeak = {u.voice for u in extra if u.voice.engine == "espeak"}
    assert extra_espeak.isdisjoint(others)
    assert len(extra_espeak) == len(size.espeak_accents_test) * len(size.espeak_variants_dev_extra)
    # festival's dev voices speak dev's further sentences too
    assert {u.voice for u in extra if u.voice.engine == "festival"} == {u.voice for u in dev[: size.dev]
                                                                          if u.voice.engine == "festival"}
    texts = {u.text for u in with_extra if u not in extra}
    assert {u.text for u in extra}.isdisjoint(texts) and len({u.text for u in extra}) == len(extra)
    vocab = {w for u in with_extra if u.split == "train" for w in u.text.split()}
    assert all(set(u.text.split()) <= vocab for u in extra)  # alignable: dev frame accuracy counts them
    with pytest.raises(ValueError, match="dev_extra"):
        plan(replace(size, dev_extra=10**6), 0, tmp_path)
    with pytest.raises(ValueError, match="espeak_variants_dev_extra"):
        plan(replace(size, espeak_variants_dev_extra=()), 0, tmp_path)


def test_dev_has_festival_voices_of_its_own_and_train_and_test_stay_as_they_were(tmp_path):
    """Version 4: dev's sentences shared between espeak and festival's MBROLA voices by the engines'
    shares, three persons that train and test do not have, each in as many settings as a test voice;
    train, test and dev's sentences are those of the corpus without them (the default size's plan)."""
    size = SIZES["default"]
    assert [name for name, _ in size.festival_dev] == ["us1_mbrola", "us2_mbrola", "us3_mbrola"]
    utts = plan(size, 0, tmp_path)
    without = plan(replace(size, festival_dev=()), 0, tmp_path)

    def key(us):
        return [(u.id, u.text, u.voice, u.aug) for u in us if u.split != "dev"]

    assert key(utts) == key(without)
    dev = [u for u in utts if u.split == "dev"]
    assert [u.text for u in dev] == [u.text for u in without if u.split == "dev"]
    assert len(dev) == size.dev + size.dev_extra
    festival = [u for u in dev if u.voice.engine == "festival"]
    share = ENGINE_SHARE["festival"] / (ENGINE_SHARE["festival"] + ENGINE_SHARE["espeak"])
    assert abs(len(festival) / len(dev) - share) < 0.05, len(festival)
    settings = Counter(u.voice for u in festival)
    n_test = size.settings_per_voice - 1
    assert len(settings) == 3 * n_test and max(settings.values()) - min(settings.values()) <= 1
    assert {recorded_speaker(v) for v in settings} == {"us1", "us2", "us3"}
    assert {v.gender for v in settings} == {"f", "m"}
    assert not {u.voice for u in dev} & {u.voice for u in utts if u.split != "dev"}
    # the tiny size (the tests' corpus) has none
    assert not any(u.voice.engine == "festival" for u in plan(SIZES["tiny"], 0, tmp_path) if u.split == "dev")


def test_mbrola_voice_gives_mapped_phone_timings():
    """A festival MBROLA voice (dev's) speaks on festival's radio phone set: every phone maps."""
    (out,) = tts.synth_festival_batch(tts.Voice("festival", "us1_mbrola", 1.0, 0, "f"), ["please call stella"])
    audio, spans = out
    phones, unmapped = tts.to_alignment(spans, "festival", len(audio) / tts.SAMPLE_RATE)
    assert not unmapped and float(np.abs(audio).max()) > 0.01
    assert [p for p, _, _ in phones if p != tts.SIL] == ["P", "L", "IY", "Z", "K", "AO", "L", "S", "T", "EH", "L", "AH"]


def test_setup_installs_the_packages_the_corpus_names():
    """setup.sh's package list is the one the corpus's error message names, and holds every festival voice's."""
    setup = (Path(__file__).resolve().parents[1] / "setup.sh").read_text()
    (line,) = [ln for ln in setup.splitlines() if ln.startswith("APT_PACKAGES=")]
    assert line.split("=", 1)[1].strip('"').split() == tts.DEBIAN_PACKAGES.split()
    assert set(tts.FESTIVAL_VOICE_PACKAGE.values()) <= set(tts.DEBIAN_PACKAGES.split())


def test_missing_festival_voice_names_its_package(tmp_path, monkeypatch):
    monkeypatch.setattr(tts, "festival_voices", lambda: {"kal_diphone", "ked_diphone", "cmu_us_slt_arctic_hts"})
    with pytest.raises(RuntimeError, match=r"festival voice us2_mbrola \(festvox-us2\).*run setup.sh"):
        tts.check_tools(festival=("kal_diphone", "us2_mbrola"))
    tts.check_tools(festival=("kal_diphone", "ked_diphone"))
    # the voice is there but not the engine that speaks it
    monkeypatch.setattr(tts, "festival_voices", lambda: {"us1_mbrola"})
    real_which = shutil.which
    monkeypatch.setattr(tts.shutil, "which", lambda name: None if name == "mbrola" else real_which(name))
    with pytest.raises(RuntimeError, match=r"mbrola \(the engine of festival voice us1_mbrola\)"):
        tts.check_tools(festival=("us1_mbrola",))


def test_no_recorded_speaker_is_in_two_splits(tmp_path):
    """The default size's plan (no synthesis): no voice setting, and no person recorded for flite or
    festival (kal16 and kal_diphone are one, so are the two slt voices), speaks in two splits."""
    utts = plan(SIZES["default"], 0, tmp_path)
    speakers = {s: {recorded_speaker(u.voice) for u in utts if u.split == s} for s in ("train", "dev", "test")}
    for a, b in (("train", "dev"), ("train", "test"), ("dev", "test")):
        assert not speakers[a] & speakers[b], (a, b)
    assert {"kal", "slt", "awb"} <= speakers["train"] and {"rms", "ked"} <= speakers["test"]
    assert {"us1", "us2", "us3"} <= speakers["dev"]
    assert all(recorded_speaker(u.voice) != u.voice.name for u in utts if u.voice.engine == "festival")


def test_failed_and_empty_synthesis_are_dropped(tmp_path, monkeypatch):
    real_plan = corpus_synthetic.plan

    def small_plan_with_bad_entries(size, seed, audio_dir):
        utts = real_plan(size, seed, audio_dir)
        train = [u for u in utts if u.split == "train"][:2]
        dev = next(u for u in utts if u.split == "dev")
        test = next(u for u in utts if u.split == "test" and u.voice.engine == "flite")
        train[0] = replace(train[0], voice=replace(train[0].voice, engine="espeak", name="en-xx-nonexistent"))
        test = replace(test, text="   ")  # flite speaks nothing: audio of silence only
        return train + [dev, test]

    monkeypatch.setattr(corpus_synthetic, "plan", small_plan_with_bad_entries)
    cuts = prepare_synthetic(tmp_path, size="tiny", seed=0, num_jobs=1)
    drops = load_drops(tmp_path)
    assert sorted((d["split"], d["reason"]) for d in drops) == [
        ("test", "empty_audio"),
        ("train", "tts_failed"),
    ]
    assert "en-xx-nonexistent" in next(d["detail"] for d in drops if d["reason"] == "tts_failed")
    # what is left: one train utterance and its augmented copy, one dev utterance, no test
    assert [len(cuts[s]) for s in ("train", "dev", "test")] == [2, 1, 0]
    assert not {d["id"] for d in drops} & {c.id for cs in cuts.values() for c in cs}


def test_missing_tts_tool_names_the_packages(tmp_path, monkeypatch):
    real_which = shutil.which
    monkeypatch.setattr(tts.shutil, "which", lambda name: None if name == "festival" else real_which(name))
    with pytest.raises(RuntimeError, match="apt-get install espeak-ng flite festival festvox-kallpc16k"):
        prepare_synthetic(tmp_path, size="tiny")


# ------------------------------------------------------------------ real corpora
def _corrupt(path: Path) -> None:
    path.write_bytes(b"this is not audio" * 10)


def test_mini_librispeech_layout_with_bad_inputs(tiny_corpus, tmp_path):
    utts = tiny_utterances(tiny_corpus, 14)
    corpus = tmp_path / "LibriSpeech"
    ids = write_librispeech(
        corpus, {"train-clean-5": ["19", "26"], "dev-clean-2": ["84", "174", "251", "422"]}, utts
    )
    # utterances are dealt round-robin over 6 speakers: 19 gets ids 0, 6, 12 and 26 gets 1, 7, 13
    spk19, spk26 = corpus / "train-clean-5" / "19" / "100", corpus / "train-clean-5" / "26" / "100"
    _corrupt(spk19 / f"{ids[0]}.flac")
    sf.write(str(spk19 / f"{ids[6]}.flac"), np.zeros(0, np.float32), 16000, format="WAV")
    trans = spk19 / "19-100.trans.txt"
    trans.write_text(trans.read_text().replace(f"{ids[12]} {utts[12][1]}", ids[12]))
    trans = spk26 / "26-100.trans.txt"
    trans.write_text(
        "".join(line + "\n" for line in trans.read_text().splitlines() if not line.startswith(ids[7]))
    )
    data = tmp_path / "data"
    cuts = prepare_real("mini_librispeech", corpus, data)
    reasons = {d["id"]: d["reason"] for d in load_drops(data)}
    assert reasons == {
        ids[0]: "unreadable_audio",
        ids[6]: "empty_audio",
        ids[12]: "empty_transcript",
        ids[7]: "missing_transcript",
    }
    # dev-clean-2 speakers are halved between dev and test
    assert (
        _speakers(cuts["dev"])
        and _speakers(cuts["test"])
        and not _speakers(cuts["dev"]) & _speakers(cuts["test"])
    )
    kept = {c.id for cs in cuts.values() for c in cs}
    assert kept == set(ids) - set(reasons)
    for c in cuts["train"]:
        assert c.load_audio().shape[1] == c.num_samples and c.supervisions[0].text.isupper()
    assert (data / "manifests" / "train_cuts.jsonl.gz").is_file()
    assert not list(data.glob(".corpus-mirror-*"))  # the mirror tree is gone, paths point at the corpus
    assert all(str(corpus.resolve()) in c.recording.sources[0].source for c in cuts["train"])


def test_librispeech_layout(tiny_corpus, tmp_path):
    utts = tiny_utterances(tiny_corpus, 6)
    ids = write_librispeech(
        tmp_path / "LS", {"train-clean-100": ["1"], "dev-clean": ["2"], "test-clean": ["3"]}, utts
    )
    cuts = prepare_real("librispeech", tmp_path / "LS", tmp_path / "data")
    assert {c.id for c in cuts["train"]} == set(ids[0::3])
    assert {c.id for c in cuts["dev"]} == set(ids[1::3]) and {c.id for c in cuts["test"]} == set(ids[2::3])
    # a tree without test-clean is refused at stage 0, not left with an empty test set
    import shutil

    shutil.rmtree(tmp_path / "LS" / "test-clean")
    with pytest.raises(FileNotFoundError, match=r"has no \['test-clean'\].*test \['test-clean'\]"):
        prepare_real("librispeech", tmp_path / "LS", tmp_path / "data2")


def test_librispeech_takes_the_training_parts_asked_for(tiny_corpus, tmp_path):
    utts = tiny_utterances(tiny_corpus, 8)
    parts = {"train-clean-100": ["1"], "train-clean-360": ["4"], "dev-clean": ["2"], "test-clean": ["3"]}
    ids = write_librispeech(tmp_path / "LS", parts, utts)
    default = prepare_real("librispeech", tmp_path / "LS", tmp_path / "data")
    assert {c.id for c in default["train"]} == set(ids[0::4])  # train-clean-100 only, 360 present or not
    both = prepare_real("librispeech", tmp_path / "LS", tmp_path / "data2", ["train-clean-100", "train-clean-360"])
    assert {c.id for c in both["train"]} == set(ids[0::4]) | set(ids[1::4])
    with pytest.raises(ValueError, match=r"--train-parts \['train-clean-5'\]: librispeech's training parts"):
        prepare_real("librispeech", tmp_path / "LS", tmp_path / "data3", ["train-clean-5"])
    with pytest.raises(FileNotFoundError, match=r"has no \['train-other-500'\].*--train-parts"):
        prepare_real("librispeech", tmp_path / "LS", tmp_path / "data4", ["train-other-500"])
    with pytest.raises(ValueError, match="only for librispeech and mini_librispeech, not timit"):
        prepare_real("timit", tmp_path / "LS", tmp_path / "data5", ["train-clean-100"])


def test_timit_layout(tiny_corpus, tmp_path):
    from lhotse.recipes.timit import get_speakers

    dev_spk, test_spk = get_speakers()
    utts = tiny_utterances(tiny_corpus, 6)
    ids = write_timit(
        tmp_path / "timit", {"TRAIN": ["FCJF0", "MDAB0"], "TEST": [dev_spk[0], test_spk[0]]}, utts
    )
    (tmp_path / "timit" / "data" / "TRAIN" / "DR1" / "FCJF0" / "SX000.TXT").unlink()  # missing transcript
    # an SA sentence (every TIMIT speaker reads the same two) in train and in test: both left out
    for part, spk in (("TRAIN", "MDAB0"), ("TEST", test_spk[0])):
        d = tmp_path / "timit" / "data" / part / "DR1" / spk.upper()
        for ext in (".WAV", ".TXT", ".WRD", ".PHN"):
            src = next(d.glob(f"SX*{ext}"))
            (d / f"SA1{ext}").write_bytes(src.read_bytes())
    cuts = prepare_real("timit", tmp_path / "timit", tmp_path / "data")
    reasons = sorted((d["reason"], d["id"]) for d in load_drops(tmp_path / "data"))
    sa = sorted(("timit_sa", f"{spk.upper()}-SA1") for spk in ("MDAB0", test_spk[0]))
    assert reasons == [("missing_transcript", ids[0]), *sa]
    # utterances dealt round-robin: FCJF0 0, 4; MDAB0 1, 5; dev speaker 2; core-test speaker 3
    assert {c.id for c in cuts["train"]} == {ids[1], ids[4], ids[5]} and {c.id for c in cuts["dev"]} == {
        ids[2]
    }
    assert {c.id for c in cuts["test"]} == {ids[3]}
    sup = cuts["dev"][0].supervisions[0]
    assert sup.text == utts[2][1] and "phone" not in sup.alignment and "timit_word" in sup.alignment


def test_yesno_layout(tmp_path):
    yes, _ = tts.synth_espeak(tts.Voice("espeak", "en-us+m1", 1.0, 50, "m"), "yes")
    no, _ = tts.synth_espeak(tts.Voice("espeak", "en-us+m1", 1.0, 50, "m"), "no")
    waves = tmp_path / "yesno" / "waves_yesno"
    waves.mkdir(parents=True)
    rng = np.random.default_rng(0)
    names = set()
    while len(names) < 60:
        names.add("_".join(str(b) for b in rng.integers(0, 2, 8)))
    for name in sorted(names):
        audio = np.concatenate([yes if b == "1" else no for b in name.split("_")])
        sf.write(str(waves / f"{name}.wav"), audio, 16000)
    cuts = prepare_real("yesno", tmp_path / "yesno", tmp_path / "data")
    # lhotse's split (sorted, even train, odd test); dev: the last 6 training files, not the test set
    train_files = sorted(names)[0::2]
    assert [c.id for c in cuts["dev"]] == train_files[-6:] and [c.id for c in cuts["train"]] == train_files[:-6]
    assert [c.id for c in cuts["test"]] == sorted(names)[1::2]
    c = cuts["train"][0]
    assert c.supervisions[0].text == " ".join("YES" if b == "1" else "NO" for b in c.id.split("_"))
    # with a corrupt file lhotse's parser (exactly 60 files) is bypassed, the same split rule kept
    _corrupt(waves / f"{sorted(names)[1]}.wav")
    again = prepare_real("yesno", tmp_path / "yesno", tmp_path / "data2")
    assert [c.id for c in again["dev"]] == train_files[-6:] and len(again["train"]) == 24
    assert len(again["test"]) == 29
    assert [d["reason"] for d in load_drops(tmp_path / "data2")] == ["unreadable_audio"]


def test_kaldi_data_dir_single_and_split(tiny_corpus, tmp_path):
    utts = tiny_utterances(tiny_corpus, 12)
    single = tmp_path / "kaldi_single"
    ids = write_kaldi_dir(single, utts, "a", n_speakers=4)
    # an empty transcript and unreadable audio are dropped and recorded (a missing line is an error of
    # the data dir's validation: tests/test_validate_data_dir.py)
    text = [line.split()[0] if line.startswith(ids[1]) else line for line in (single / "text").read_text().splitlines()]
    (single / "text").write_text("\n".join(text) + "\n")
    _corrupt(single / "wav" / f"{ids[2]}.wav")
    cuts = prepare_real("kaldi", single, tmp_path / "data")
    reasons = {d["id"]: d["reason"] for d in load_drops(tmp_path / "data")}
    assert reasons == {ids[1]: "empty_transcript", ids[2]: "unreadable_audio"}
    # 4 speakers: one held out for test, one for dev, by sorted speaker id
    assert _speakers(cuts["test"]) == {"aspk3"} and _speakers(cuts["dev"]) == {"aspk2"}
    assert {c.id for cs in cuts.values() for c in cs} == set(ids) - set(reasons)

    split = tmp_path / "kaldi_split"
    for k, s in enumerate(("train", "dev", "test")):
        write_kaldi_dir(split / s, utts[4 * k : 4 * k + 4], s[:2])
    # segments: two halves of one recording become two cuts
    rid = (split / "test" / "wav.scp").read_text().split()[0]
    scp = (split / "test" / "wav.scp").read_text().splitlines()
    (split / "test" / "wav.scp").write_text(scp[0] + "\n")  # Kaldi: every wav.scp recording has segments
    half = sf.info(str(split / "test" / "wav" / f"{rid}.wav")).duration / 2
    (split / "test" / "segments").write_text(f"{rid}-a {rid} 0 {half:.3f}\n{rid}-b {rid} {half:.3f} -1\n")
    (split / "test" / "text").write_text(f"{rid}-a FIRST HALF\n{rid}-b SECOND HALF\n")
    (split / "test" / "utt2spk").write_text(f"{rid}-a s1\n{rid}-b s1\n")
    cuts = prepare_real("kaldi", split, tmp_path / "data_split")
    assert len(cuts["train"]) == 4 and len(cuts["dev"]) == 4
    assert [c.id for c in cuts["test"]] == [f"{rid}-a", f"{rid}-b"]
    assert cuts["test"][1].start == pytest.approx(half, abs=1e-3)
    assert cuts["test"][1].load_audio().shape[1] > 0


def test_kaldi_data_dir_of_two_speakers_is_not_split_by_utterance(tiny_corpus, tmp_path):
    single = tmp_path / "kaldi_two"
    write_kaldi_dir(single, tiny_utterances(tiny_corpus, 6), "a", n_speakers=2)
    with pytest.raises(ValueError, match=r"2 speaker\(s\) \['aspk0', 'aspk1'\].*give train/, dev/ and test/"):
        prepare_real("kaldi", single, tmp_path / "data")


def test_missing_corpus_dir_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="No such directory: .*nowhere.*downloads nothing"):
        prepare_real("mini_librispeech", tmp_path / "nowhere", tmp_path / "data")
    with pytest.raises(ValueError, match="unknown corpus"):
        prepare_real("switchboard", tmp_path, tmp_path / "data")


def test_manifest_files_are_gzipped_jsonl(tiny_corpus):
    with gzip.open(tiny_corpus / "manifests" / "test_cuts.jsonl.gz", "rt") as f:
        assert f.readline().startswith("{")
