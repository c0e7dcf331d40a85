"""``recipes/asr/research/unseen_voices_corpus.py``: Kaldi data dirs of real sentences whose dev and test
voices train lacks, as prepare.py --corpus kaldi reads them."""

import random

import pytest
import unseen_voices_corpus as uvc

FORTUNES = """Every cloud has a silver lining, they say.
%
Call me at 555 0199 tomorrow.  Never put off till tomorrow what you can do today!
%
A fool and his money are soon parted. -- Proverb
%
Short one.
"""


def test_sentences_are_real_text_of_four_to_fourteen_words(tmp_path):
    path = tmp_path / "fortunes"
    path.write_text(FORTUNES)
    assert uvc.sentences([path]) == ["EVERY CLOUD HAS A SILVER LINING THEY SAY",  # digits: the sentence is left out
                                     "NEVER PUT OFF TILL TOMORROW WHAT YOU CAN DO TODAY",
                                     "A FOOL AND HIS MONEY ARE SOON PARTED"]  # the attribution is not a sentence


def test_no_person_speaks_in_two_splits():
    rng = random.Random(0)
    persons = {split: {v.name.split("+")[-1] if v.engine == "espeak" else v.name for v in uvc.voices(split, rng)}
               for split in ("train", "dev", "test")}
    assert not persons["train"] & persons["dev"] and not persons["train"] & persons["test"]
    assert not persons["dev"] & persons["test"]
    seen = uvc.voices("dev", rng, accents=("en-us",), others=False)
    assert {v.name for v in seen} == {f"en-us+{v}" for v in uvc.ESPEAK_VARIANTS["dev"]}


def test_data_dirs_and_lm_text(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("\n%\n".join(f"sentence number {w} is spoken here" for w in
                                 ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"]) + "\n")
    out = tmp_path / "corpus"
    assert uvc.main(["--out", str(out), "--text", str(text), "--sizes", "3", "2", "2", "--jobs", "1"]) == 0
    for split, n in (("train", 3), ("dev", 2), ("test", 2)):
        ids = [line.split()[0] for line in (out / split / "text").read_text().splitlines()]
        assert len(ids) == n and ids == sorted(ids)
        assert [line.split()[0] for line in (out / split / "wav.scp").read_text().splitlines()] == ids
        utt2spk = dict(line.split() for line in (out / split / "utt2spk").read_text().splitlines())
        assert all(u.startswith(s + "-") for u, s in utt2spk.items())
    lm = (out / "lm.txt").read_text().splitlines()
    spoken = {line.split(" ", 1)[1] for s in ("dev", "test") for line in (out / s / "text").read_text().splitlines()}
    assert len(lm) == 6 and not spoken & set(lm)  # train's 3 and 3 no split speaks


def test_too_little_text_is_refused(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("one sentence of real text\n")
    with pytest.raises(SystemExit):
        uvc.main(["--out", str(tmp_path / "c"), "--text", str(text)])
