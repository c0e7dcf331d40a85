"""A user's own corpus through every stage to a WER: a Kaldi data dir and a LibriSpeech tree.

The sentences are not the embedded corpus's templates: they are the first Harvard sentences (IEEE
Recommended Practice for Speech Quality Measurements, 1969), spoken by voices of the embedded TTS
engines, each split by its own voices (train: two espeak-ng voices and flite's kal16; dev: an
espeak-ng voice and flite's rms; test: another espeak-ng voice and flite's slt). Dev and test speak
training sentences (as TIMIT's SX sentences are shared between speakers) so that the tiny system's
vocabulary covers them; the LM also gets sentences no one speaks through ``--lm-text``, and one
word comes from the user's ``--lexicon``; in the Kaldi data dirs a ``[noise]`` tag opens each voice's
first sentence. Each corpus goes through stages 0-8 (``prepare.py``),
one epoch of the DNN (``conf/tiny.yaml``) and decoding (``evaluate.py``), CI-sized.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import soundfile as sf

ROOT = Path(__file__).resolve().parents[1]

SPOKEN = [
    "The birch canoe slid on the smooth planks.",
    "Glue the sheet to the dark blue background.",
    "It's easy to tell the depth of a well.",
    "These days a chicken leg is a rare dish.",
    "Rice is often served in round bowls.",
    "The juice of lemons makes fine punch.",
    "The box was thrown beside the parked truck.",
    "The hogs were fed chopped corn and garbage.",
    "Four hours of steady work faced us.",
    "A large size in stockings is hard to sell.",
    "The boy was there when the sun rose.",
    "A rod is used to catch pink salmon.",
]
LM_ONLY = [  # never spoken: LM text only
    "The source of the huge river is the clear spring.",
    "Kick the ball straight and follow through.",
    "Help the woman get back to her feet.",
    "A pot of tea helps to pass the evening.",
]


def _voices():
    from local.data.tts import Voice

    return {
        "train": [Voice("espeak", "en-us+m1", 1.0, 50, "m"), Voice("espeak", "en-us+f3", 1.1, 60, "f"),
                  Voice("flite", "kal16", 1.0, 0, "m")],
        "dev": [Voice("espeak", "en-us+m3", 0.95, 40, "m"), Voice("flite", "rms", 1.0, 0, "m")],
        "test": [Voice("espeak", "en-us+f2", 1.05, 55, "f"), Voice("flite", "slt", 1.0, 0, "f")],
    }  # fmt: skip


@pytest.fixture(scope="module")
def spoken():
    """``{split: [(speaker, utterance id, audio, text), ...]}``: every training voice speaks every
    sentence, each dev and test voice half of them."""
    from local.data import tts

    out = {}
    for split, voices in _voices().items():
        rows = []
        for v, voice in enumerate(voices):
            synth = tts.synth_espeak if voice.engine == "espeak" else tts.synth_flite
            sentences = SPOKEN if split == "train" else SPOKEN[v :: len(voices)]
            for k, text in enumerate(sentences):
                audio, _ = synth(voice, text)
                rows.append((f"{split}{v}", f"{split}{v}-{k:02d}", audio, text))
        out[split] = rows
    return out


def _run_recipe(corpus: str, corpus_dir: Path, tmp_path: Path, **options) -> dict:
    """Stages 0-8, one DNN epoch, decoding; returns the decode results of the run."""
    import evaluate
    import train
    from prepare import STAGES, prepare

    data = prepare(corpus=corpus, corpus_dir=corpus_dir, data_dir=tmp_path / "data", stage=0, num_jobs=1, **options)
    assert all((data / ".done" / s).is_file() for s in STAGES)
    train.main(["--config", str(ROOT / "conf" / "tiny.yaml"), "--strategy", "single", "--data.data_dir", str(data),
                "--exp_dir", str(tmp_path / "exp"), "--trainer.max_epochs", "1", "--num_threads", "1"])  # fmt: skip
    evaluate.main(["--runs", str(tmp_path / "exp" / "baseline"), "--out", str(tmp_path / "cmp"),
                   "--acoustic-scales", "0.1", "--beam", "8", "--jobs", "1"])  # fmt: skip
    return json.loads((tmp_path / "exp" / "baseline" / "decode" / "results.json").read_text())


def test_kaldi_data_dirs_with_a_lexicon_and_lm_text_to_a_wer(spoken, tmp_path):
    from local.data.normalize import normalize_words

    corpus = tmp_path / "kaldi"
    for split, rows in spoken.items():
        d = corpus / split
        (d / "wav").mkdir(parents=True)
        for _, uid, audio, _ in rows:
            sf.write(str(d / "wav" / f"{uid}.wav"), audio, 16000)
        (d / "wav.scp").write_text("".join(f"{uid} wav/{uid}.wav\n" for _, uid, _, _ in rows))
        # a noise tag before each voice's first sentence (Kaldi data dirs of real corpora have them)
        (d / "text").write_text("".join(f"{uid} {'[noise] ' * uid.endswith('-00')}{text}\n" for _, uid, _, text in rows))
        (d / "utt2spk").write_text("".join(f"{uid} {spk}\n" for spk, uid, _, _ in rows))
    (tmp_path / "lm.txt").write_text("".join(s + "\n" for s in LM_ONLY))
    (tmp_path / "lexicon.txt").write_text("CANOE K AH0 N UW1\n")
    results = _run_recipe("kaldi", corpus, tmp_path, lexicon=tmp_path / "lexicon.txt", lm_text=tmp_path / "lm.txt")
    lang = json.loads((tmp_path / "data" / "lang" / "summary.json").read_text())
    assert lang["lm_text_sentences"] == len(LM_ONLY) and lang["lm_text_test_sentences"] == 0
    assert lang["user_lexicon_words"] == 1 and lang["train_dropped_oov"] == 0
    # the tag is a word of the non-spoken-noise phone, <UNK> one of spoken noise (--oov unk: a real corpus's
    # default); both are trained like silence and left out of scoring
    assert lang["oov_policy"] == "unk" and lang["train_tag_tokens"] == {"[NOISE]": len(_voices()["train"])}
    assert lang["silence_phones"] == ["SIL", "SPN", "NSN"]
    assert (tmp_path / "data" / "lang" / "lexicon.txt").read_text().count("CANOE ") == 1
    assert "HUGE" in (tmp_path / "data" / "lang" / "words.txt").read_text()  # from the LM text alone
    test = results["test"]
    assert test["utterances"] == len(spoken["test"]) and 0 <= test["wer"] < 200
    assert test["words"] == sum(len(normalize_words(text)) for _, _, _, text in spoken["test"])  # no [NOISE]
    report = json.loads((tmp_path / "data" / "report.json").read_text())
    assert report  # stage 8 summarised the build


def test_librispeech_tree_to_a_wer(spoken, tmp_path):
    corpus = tmp_path / "LibriSpeech"
    parts = {"train": "train-clean-100", "dev": "dev-clean", "test": "test-clean"}
    for split, rows in spoken.items():
        lines: dict[Path, list[str]] = {}
        for spk, uid, audio, text in rows:
            speaker = str(100 + int(spk[-1]) + 10 * list(parts).index(split))
            d = corpus / parts[split] / speaker / "7"
            d.mkdir(parents=True, exist_ok=True)
            name = f"{speaker}-7-{uid.split('-')[1]}"
            sf.write(str(d / f"{name}.flac"), audio, 16000)
            lines.setdefault(d / f"{speaker}-7.trans.txt", []).append(f"{name} {text.upper()}")
        for path, ls in lines.items():
            path.write_text("".join(line + "\n" for line in ls))
    results = _run_recipe("librispeech", corpus, tmp_path, oov="g2p")
    assert results["test"]["utterances"] == len(spoken["test"]) and 0 <= results["test"]["wer"] < 200
