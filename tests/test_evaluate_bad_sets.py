"""``evaluate.py --checkpoint CKPT --test-set DIR`` on Kaldi data dirs with the faults a new user's
test set has: a missing or unreadable audio file, an empty transcript, files that
disagree on the utterances, an 8 kHz recording, OOV words. Each set is 20 utterances of the tiny
corpus written as a Kaldi data dir; the checkpoint is a one-epoch tiny model trained once here."""

from __future__ import annotations

import ast
import json
import logging
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

ROOT = Path(__file__).resolve().parents[1]
NUM_UTTS = 20


@pytest.fixture(scope="module")
def checkpoint(tiny_aligned, tmp_path_factory) -> Path:
    import train

    exp = tmp_path_factory.mktemp("bad_sets_exp")
    cli = train.main(["--config", str(ROOT / "conf" / "tiny.yaml"), "--strategy", "single", "--data.data_dir",
                      str(tiny_aligned), "--exp_dir", str(exp), "--trainer.max_epochs", "1", "--num_threads", "1"])
    ckpt = Path(cli.config.trainer.default_root_dir) / "checkpoints" / "last.ckpt"
    assert ckpt.exists()
    return ckpt


def _utterances(data_dir: Path) -> list[dict]:
    """20 utterances of the tiny corpus (dev, test, then clean train): id, wav, text, speaker."""
    from lhotse import CutSet

    cuts = [c for split in ("dev", "test", "train")
            for c in CutSet.from_file(data_dir / "manifests" / f"{split}_cuts.jsonl.gz") if not c.id.endswith("-aug")]
    assert len(cuts) >= NUM_UTTS
    return [{"id": c.id, "wav": c.recording.sources[0].source, "text": c.supervisions[0].text,
             "spk": c.supervisions[0].speaker} for c in cuts[:NUM_UTTS]]


def _write_kaldi_dir(d: Path, wav: dict, text: dict, utt2spk: dict) -> Path:
    """Kaldi's files as a user writes them (sorted; an empty transcript is the id alone on its line)."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "wav.scp").write_text("".join(f"{u} {p}\n" for u, p in sorted(wav.items())))
    (d / "text").write_text("".join(f"{u} {t}".rstrip() + "\n" for u, t in sorted(text.items())))
    (d / "utt2spk").write_text("".join(f"{u} {s}\n" for u, s in sorted(utt2spk.items())))
    spk2utt: dict[str, list] = {}
    for u, s in sorted(utt2spk.items()):
        spk2utt.setdefault(s, []).append(u)
    (d / "spk2utt").write_text("".join(f"{s} {' '.join(us)}\n" for s, us in sorted(spk2utt.items())))
    return d


def _maps(utts: list[dict]) -> tuple[dict, dict, dict]:
    return ({u["id"]: u["wav"] for u in utts}, {u["id"]: u["text"] for u in utts},
            {u["id"]: u["spk"] for u in utts})


def _evaluate(test_set: Path, data_dir: Path, checkpoint: Path, out: Path) -> tuple[dict, list[dict]]:
    import evaluate

    evaluate.main(["--checkpoint", str(checkpoint), "--test-set", str(test_set), "--data-dir", str(data_dir),
                   "--out", str(out), "--acoustic-scale", "0.1", "--beam", "8", "--max-active", "1000"])
    decode = out / "decode_other"
    result = json.loads((decode / f"results-{test_set.name}.json").read_text())
    dropped = [json.loads(line) for line in (decode / f"dropped-{test_set.name}.jsonl").read_text().splitlines()]
    return result, dropped


def _scored_ids(out: Path, name: str) -> set[str]:
    return set(json.loads((out / "decode_other" / f"per_utt-{name}.json").read_text()))


def test_missing_and_unreadable_audio_are_dropped_by_reason(tiny_aligned, checkpoint, tmp_path):
    utts = _utterances(tiny_aligned)
    wav, text, spk = _maps(utts)
    missing, garbage = utts[3]["id"], utts[7]["id"]
    wav[missing] = str(tmp_path / "nowhere" / "gone.wav")
    (tmp_path / "garbage.wav").write_bytes(b"RIFF this is not audio" * 10)
    wav[garbage] = str(tmp_path / "garbage.wav")
    test_set = _write_kaldi_dir(tmp_path / "missing_audio", wav, text, spk)
    result, dropped = _evaluate(test_set, tiny_aligned, checkpoint, tmp_path / "out")
    assert result["input_utterances"] == NUM_UTTS and result["scored_utterances"] == NUM_UTTS - 2
    assert result["not_scored"] == {"missing_audio_file": 1, "unreadable_audio": 1}
    assert {d["id"]: d["reason"] for d in dropped} == {missing: "missing_audio_file", garbage: "unreadable_audio"}
    assert "gone.wav" in next(d["detail"] for d in dropped if d["id"] == missing)
    # the other 18 were decoded and scored
    assert _scored_ids(tmp_path / "out", test_set.name) == {u["id"] for u in utts} - {missing, garbage}
    assert result["utterances"] == NUM_UTTS - 2 and result["words"] > 0


def test_empty_transcript_is_scored_as_an_empty_reference(tiny_aligned, checkpoint, tmp_path):
    utts = _utterances(tiny_aligned)
    wav, text, spk = _maps(utts)
    empty = utts[3]["id"]
    text[empty] = ""
    test_set = _write_kaldi_dir(tmp_path / "empty_text", wav, text, spk)
    assert f"{empty}\n" in (test_set / "text").read_text()  # the id alone on its line, as Kaldi allows
    result, dropped = _evaluate(test_set, tiny_aligned, checkpoint, tmp_path / "out")
    assert result["scored_utterances"] == NUM_UTTS and result["not_scored"] == {} and dropped == []
    assert result["empty_references"] == 1
    from local.data.normalize import normalize_words

    assert result["words"] == sum(len(normalize_words(u["text"])) for u in utts if u["id"] != empty)
    errors, ref_words = json.loads((tmp_path / "out" / "decode_other" / f"per_utt-{test_set.name}.json")
                                   .read_text())[empty]
    recogs = (tmp_path / "out" / "decode_other" / f"recogs-{test_set.name}.txt").read_text().splitlines()
    assert f"{empty}:\tref=[]" in recogs
    hyp = next(line for line in recogs if line.startswith(f"{empty}:\thyp="))
    num_hyp_words = len(ast.literal_eval(hyp.split("hyp=", 1)[1]))  # scoring writes the word lists
    assert ref_words == 0 and errors == num_hyp_words  # every hypothesis word is an insertion
    assert result["ins"] >= num_hyp_words


def test_kaldi_files_reconciled_like_fix_data_dir(tiny_aligned, checkpoint, tmp_path):
    """utt2spk names one utterance more than wav.scp, text lacks one utterance: both are left out
    (and counted); the other 19 are scored; spk2utt (not a filter in Kaldi) is not required to agree."""
    utts = _utterances(tiny_aligned)
    wav, text, spk = _maps(utts)
    spk["zz-extra-utt"] = "spk-extra"
    no_text = utts[5]["id"]
    del text[no_text]
    test_set = _write_kaldi_dir(tmp_path / "extra_utt2spk", wav, text, spk)
    result, dropped = _evaluate(test_set, tiny_aligned, checkpoint, tmp_path / "out")
    assert result["input_utterances"] == NUM_UTTS + 1 and result["scored_utterances"] == NUM_UTTS - 1
    assert result["not_scored"] == {"not_in_wav_scp": 1, "not_in_text": 1}
    assert {d["id"]: d["reason"] for d in dropped} == {"zz-extra-utt": "not_in_wav_scp", no_text: "not_in_text"}
    assert _scored_ids(tmp_path / "out", test_set.name) == {u["id"] for u in utts} - {no_text}


def test_8khz_recording_is_resampled(tiny_aligned, checkpoint, tmp_path):
    import evaluate
    import torch
    from lhotse import CutSet
    from lhotse.augmentation.torchaudio import get_or_create_resampler

    utts = _utterances(tiny_aligned)
    wav, text, spk = _maps(utts)
    low = utts[3]
    audio, rate = sf.read(low["wav"], dtype="float32")
    assert rate == 16000
    audio8k = get_or_create_resampler(16000, 8000)(torch.from_numpy(audio[None])).numpy()[0]
    sf.write(str(tmp_path / "low.wav"), audio8k, 8000, subtype="PCM_16")
    wav[low["id"]] = str(tmp_path / "low.wav")
    test_set = _write_kaldi_dir(tmp_path / "rate8k", wav, text, spk)
    result, dropped = _evaluate(test_set, tiny_aligned, checkpoint, tmp_path / "out")
    assert result["scored_utterances"] == NUM_UTTS and dropped == []
    assert result["resampled_recordings"] == {"8000": 1}
    # its features are those of the 16 kHz original below 4 kHz (the band 8 kHz audio keeps)
    cmvn = json.loads((tiny_aligned / "features" / "cmvn.json").read_text())
    cuts, _, info = evaluate.load_test_set(test_set, tmp_path / "feats", cmvn)
    assert info["sampling_rates"] == {"8000": 1, "16000": NUM_UTTS - 1}
    resampled = next(c for c in cuts if c.id == low["id"])
    assert resampled.sampling_rate == 16000
    original = next(c for split in ("dev", "test", "train")
                    for c in CutSet.from_file(tiny_aligned / "features" / f"{split}_cuts.jsonl.gz")
                    if c.id == low["id"])
    a, b = resampled.load_features(), original.load_features()
    assert a.shape == b.shape
    band = slice(2, 24)  # mel bins well inside 0-4 kHz (40 bins, 20 Hz-7.6 kHz)
    corr = np.corrcoef(a[:, band].ravel(), b[:, band].ravel())[0, 1]
    assert corr > 0.95, f"8 kHz audio resampled to 16 kHz gives features unlike the original's (r={corr:.3f})"
    assert np.abs(a[:, -5:] - b[:, -5:]).mean() > 1.0  # above 4 kHz the 8 kHz file has nothing: really resampled


def test_oov_words_counted_and_reported(tiny_aligned, checkpoint, tmp_path, caplog):
    from local.data.normalize import normalize_words
    from local.graph.lang import read_symbols

    utts = _utterances(tiny_aligned)
    wav, text, spk = _maps(utts)
    text[utts[2]["id"]] += " ZYXWVU QWXZ"
    text[utts[9]["id"]] = "ZYXWVU " + text[utts[9]["id"]]
    test_set = _write_kaldi_dir(tmp_path / "oov", wav, text, spk)
    with caplog.at_level(logging.INFO, logger="evaluate"):
        result, _ = _evaluate(test_set, tiny_aligned, checkpoint, tmp_path / "out")
    vocab = set(read_symbols(tiny_aligned / "lang" / "words.txt"))
    refs = [w for t in text.values() for w in normalize_words(t)]
    oov = result["oov"]
    assert oov["counts"]["ZYXWVU"] == 2 and oov["counts"]["QWXZ"] == 1
    assert oov["tokens"] == sum(w not in vocab for w in refs) and oov["words"] == len(refs) == result["words"]
    assert oov["utterances"] == sum(any(w not in vocab for w in normalize_words(t)) for t in text.values())
    line = next(r.getMessage() for r in caplog.records if "OOV reference words" in r.getMessage())
    assert f"OOV reference words: {oov['tokens']} of {len(refs)}" in line and "ZYXWVU" in line


def test_report_says_how_many_were_scored_and_why_not(tiny_aligned, checkpoint, tmp_path, caplog):
    """All the faults at once: the results JSON and the log line account for every utterance."""
    utts = _utterances(tiny_aligned)
    wav, text, spk = _maps(utts)
    wav[utts[0]["id"]] = str(tmp_path / "absent.wav")
    wav[utts[1]["id"]] = str(tmp_path / "absent2.wav")
    del spk[utts[2]["id"]]
    text["orphan-text-only"] = "HELLO"
    text[utts[4]["id"]] = ""
    test_set = _write_kaldi_dir(tmp_path / "everything", wav, text, spk)
    with caplog.at_level(logging.INFO, logger="evaluate"):
        result, dropped = _evaluate(test_set, tiny_aligned, checkpoint, tmp_path / "out")
    assert result["input_utterances"] == NUM_UTTS + 1
    assert result["not_scored"] == {"missing_audio_file": 2, "not_in_utt2spk": 1, "not_in_wav_scp": 1}
    assert result["scored_utterances"] == NUM_UTTS + 1 - 4 == result["utterances"]
    assert result["input_utterances"] == result["scored_utterances"] + sum(result["not_scored"].values())
    assert len(dropped) == 4 and result["empty_references"] == 1
    line = next(r.getMessage() for r in caplog.records if "utterances scored" in r.getMessage())
    assert f"on {NUM_UTTS - 3} of {NUM_UTTS + 1} utterances scored" in line
    assert "2 missing_audio_file" in line and "1 not_in_utt2spk" in line and "1 not_in_wav_scp" in line
    assert f"dropped-{test_set.name}.jsonl" in line


def test_no_scorable_utterance_names_the_reasons(tiny_aligned, checkpoint, tmp_path):
    utts = _utterances(tiny_aligned)[:2]
    wav, text, spk = _maps(utts)
    wav = {u: str(tmp_path / f"{u}.wav") for u in wav}
    test_set = _write_kaldi_dir(tmp_path / "nothing", wav, text, spk)
    with pytest.raises(ValueError, match="none of its 2 utterances can be scored .2 missing_audio_file"):
        _evaluate(test_set, tiny_aligned, checkpoint, tmp_path / "out")
