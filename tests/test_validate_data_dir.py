"""A user's Kaldi data dir at stage 0: Kaldi's validate_data_dir.sh checks, each recording's own sampling
rate (files and ``cmd |`` entries), speakers kept to one split, CMVN statistics per split."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from lhotse import CutSet
from local.data.corpus_real import prepare_real
from local.data.features import SAMPLING_RATE, compute_features
from local.data.validate import check_disjoint_speakers, validate_data_dir
from local.drops import load_drops


def _tone(seconds: float, rate: int, hz: float = 440.0) -> np.ndarray:
    t = np.arange(round(seconds * rate)) / rate
    rng = np.random.default_rng(rate)
    return (0.3 * np.sin(2 * np.pi * hz * t) + 0.01 * rng.standard_normal(len(t))).astype(np.float32)


def _write(d: Path, name: str, lines: list[str]) -> None:
    (d / name).write_text("".join(line + "\n" for line in lines))


def _data_dir(d: Path, speakers=("s1", "s1", "s2"), rates: tuple[int, ...] | None = None) -> list[str]:
    """A valid data dir: one 0.5 s file per utterance, ``<speaker>-u<k>``; returns the utterance ids."""
    (d / "wav").mkdir(parents=True, exist_ok=True)
    utts = [f"{spk}-u{k}" for k, spk in enumerate(speakers)]
    for utt, rate in zip(utts, rates or (16000,) * len(utts), strict=True):
        sf.write(str(d / "wav" / f"{utt}.wav"), _tone(0.5, rate), rate)
    _write(d, "wav.scp", [f"{u} {d / 'wav' / u}.wav" for u in utts])
    _write(d, "text", [f"{u} HELLO WORLD" for u in utts])
    _write(d, "utt2spk", [f"{u} {u.split('-')[0]}" for u in utts])
    spk2utt = {}
    for u in utts:
        spk2utt.setdefault(u.split("-")[0], []).append(u)
    _write(d, "spk2utt", [f"{s} {' '.join(us)}" for s, us in sorted(spk2utt.items())])
    return utts


def _lines(d: Path, name: str) -> list[str]:
    return (d / name).read_text().splitlines()


def test_a_valid_data_dir_passes(tmp_path):
    _data_dir(tmp_path)
    rows = validate_data_dir(tmp_path)
    assert [key for _, key, _ in rows["utt2spk"]] == ["s1-u0", "s1-u1", "s2-u2"]
    assert rows["text"][0] == (1, "s1-u0", "HELLO WORLD")
    _write(tmp_path, "text", ["s1-u0 CAF\u00c9 CR\u00c8ME", *_lines(tmp_path, "text")[1:]])  # UTF-8 beyond ASCII
    assert validate_data_dir(tmp_path)["text"][0] == (1, "s1-u0", "CAF\u00c9 CR\u00c8ME")


def _segments(d: Path) -> None:
    """Two segments of each recording, utterances ``<rec>-a`` and ``<rec>-b``."""
    recs = [line.split()[0] for line in _lines(d, "wav.scp")]
    utts = [(f"{r}-{h}", r) for r in recs for h in "ab"]
    _write(d, "segments", [f"{u} {r} {0 if u.endswith('a') else 0.25} {0.25 if u.endswith('a') else -1}"
                           for u, r in utts])
    _write(d, "text", [f"{u} HELLO" for u, _ in utts])
    _write(d, "utt2spk", [f"{u} {r.split('-')[0]}" for u, r in utts])
    (d / "spk2utt").unlink()


# (what to break, the error it must raise): each check of validate_data_dir, on the 3-utterance dir
BROKEN = {
    "no utt2spk": (lambda d: (d / "utt2spk").unlink(), r"no utt2spk; a Kaldi data dir needs wav.scp, text and utt2spk"),
    "unsorted": (lambda d: _write(d, "text", _lines(d, "text")[::-1]),
                 r"text:2: key s1-u1 comes after s2-u2, not in LC_ALL=C sort order; sort it \(LC_ALL=C sort text"),
    "C order, not the locale's": (lambda d: _write(d, "text", ["s1-u0 A", "S1-u9 B"]),
                                  r"text:2: key S1-u9 comes after s1-u0"),
    "duplicate key": (lambda d: _write(d, "utt2spk", ["s1-u0 s1", "s1-u1 s1", "s1-u1 s1", "s2-u2 s2"]),
                      r"utt2spk:3: key s1-u1 repeats line 2; keep one line per key"),
    "not in text": (lambda d: _write(d, "text", [_lines(d, "text")[0], _lines(d, "text")[2]]),
                    (r"utt2spk:2: utterance s1-u1 has no line in text; add its line there or run Kaldi's "
                    r"utils/fix_data_dir.sh")),
    "not in utt2spk": (lambda d: _write(d, "utt2spk", _lines(d, "utt2spk")[:2]),
                       r"text:3: utterance s2-u2 has no line in utt2spk; .*fix_data_dir.sh"),
    "not in wav.scp": (lambda d: _write(d, "wav.scp", _lines(d, "wav.scp")[1:]),
                       r"utt2spk:1: utterance s1-u0 has no line in wav.scp"),
    "only in wav.scp": (lambda d: _write(d, "wav.scp", [*_lines(d, "wav.scp"), "s3-u3 x.wav"]),
                        r"wav.scp:4: utterance s3-u3 has no line in utt2spk"),
    "utt2spk fields": (lambda d: _write(d, "utt2spk", ["s1-u0 s1 extra", *_lines(d, "utt2spk")[1:]]),
                       r"utt2spk:1: 3 fields in `s1-u0 s1 extra`, utt2spk wants 2"),
    "no final newline": (lambda d: (d / "text").write_text((d / "text").read_text().rstrip("\n")),
                         r"text:3: the last line has no newline"),
    "not UTF-8": (lambda d: (d / "text").write_bytes((d / "text").read_bytes().replace(b"s1-u1 ", "s1-u1 CAF\u00c9 ".encode("latin-1"))),
                  r"text:2: byte 0xc9 at column 10 is not UTF-8; convert the file \(e.g. iconv -f ISO-8859-1 -t UTF-8"),
    "windows line ending": (lambda d: (d / "utt2spk").write_bytes((d / "utt2spk").read_bytes().replace(b"\n", b"\r\n")),
                            r"utt2spk:1: the line ends with \\r .*sed -i"),
    "spk2utt wrong speaker": (lambda d: _write(d, "spk2utt", ["s1 s1-u0", "s2 s1-u1 s2-u2"]),
                              (r"spk2utt:2: utterance s1-u1 is under speaker s2, utt2spk says s1; regenerate it: "
                              r"utils/utt2spk_to_spk2utt.pl")),
    "spk2utt missing utterance": (lambda d: _write(d, "spk2utt", ["s1 s1-u0", "s2 s2-u2"]),
                                  r"utt2spk:2: utterance s1-u1 of speaker s1 is not in spk2utt"),
    "spk2utt twice": (lambda d: _write(d, "spk2utt", ["s1 s1-u0 s1-u1 s1-u0", "s2 s2-u2"]),
                      r"spk2utt:1: utterance s1-u0 is listed again \(line 1\)"),
    "spk2utt unknown utterance": (lambda d: _write(d, "spk2utt", ["s1 s1-u0 s1-u1", "s2 s2-u2 s2-u9"]),
                                  r"spk2utt:2: utterance s2-u9 has no line in utt2spk"),
    "segment recording not in wav.scp": (
        lambda d: (_segments(d), _write(d, "wav.scp", _lines(d, "wav.scp")[:2])),
        r"segments:5: recording s2-u2 of s2-u2-a has no line in wav.scp"),
    "wav.scp recording without segments": (
        lambda d: (_segments(d), _write(d, "wav.scp", [*_lines(d, "wav.scp"), "s9-u9 x.wav"])),
        r"wav.scp:4: recording s9-u9 has no utterance in segments"),
    "segment start after end": (
        lambda d: (_segments(d), _write(d, "segments", ["s1-u0-a s1-u0 0.3 0.2", *_lines(d, "segments")[1:]])),
        r"segments:1: s1-u0-a ends at 0.2 s, not after its start 0.3 s"),
    "segment start below 0": (
        lambda d: (_segments(d), _write(d, "segments", ["s1-u0-a s1-u0 -0.1 0.2", *_lines(d, "segments")[1:]])),
        r"segments:1: s1-u0-a starts at -0.1 s, before its recording s1-u0"),
    "segment times not numbers": (
        lambda d: (_segments(d), _write(d, "segments", ["s1-u0-a s1-u0 0 end", *_lines(d, "segments")[1:]])),
        r"segments:1: times `0 end` of s1-u0-a are not numbers"),
    "segment fields": (
        lambda d: (_segments(d), _write(d, "segments", ["s1-u0-a s1-u0 0", *_lines(d, "segments")[1:]])),
        r"segments:1: 3 fields in `s1-u0-a s1-u0 0`, segments wants 4"),
    "segment not in utt2spk": (
        lambda d: (_segments(d), _write(d, "utt2spk", _lines(d, "utt2spk")[1:]),
                   _write(d, "text", _lines(d, "text")[1:])),
        r"segments:1: utterance s1-u0-a has no line in utt2spk"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_each_check_fails_with_the_file_line_and_fix(tmp_path, case):
    _data_dir(tmp_path)
    breaking, message = BROKEN[case]
    breaking(tmp_path)
    with pytest.raises(ValueError, match=message) as e:
        validate_data_dir(tmp_path)
    assert "\n" not in str(e.value)  # one line
    # and stage 0 refuses the dir before reading any audio
    with pytest.raises(ValueError, match=message):
        prepare_real("kaldi", tmp_path, tmp_path.parent / f"{tmp_path.name}-data")


def test_segments_with_end_minus_one_pass_and_cut_to_the_recording(tmp_path):
    _data_dir(tmp_path, speakers=("a", "b", "c"))
    _segments(tmp_path)
    validate_data_dir(tmp_path)
    cuts = prepare_real("kaldi", tmp_path, tmp_path / "data")
    b = {c.id: c for cs in cuts.values() for c in cs}["a-u0-b"]
    assert b.start == pytest.approx(0.25) and b.duration == pytest.approx(0.25)


# ------------------------------------------------------------------ sampling rates
def _mixed_rates(d: Path) -> dict[str, int]:
    """train: an 8 kHz file, a 16 kHz file read through `cat |`, and (with sox) 16 kHz audio that a
    `sox ... -r 8000 -t wav - |` pipe turns into 8 kHz, as sph2pipe does for telephone speech."""
    split = {"train": ("t1", "t1", "t2"), "dev": ("d1",), "test": ("e1", "e2")}
    rates = {"train": (8000, 16000, 16000), "dev": (16000,), "test": (16000, 8000)}
    for s, speakers in split.items():
        _data_dir(d / s, speakers=speakers, rates=rates[s])
    train = d / "train"
    scp = _lines(train, "wav.scp")
    scp[1] = f"t1-u1 cat {train / 'wav' / 't1-u1.wav'} |"
    want = {"t1-u0": 8000, "t1-u1": 16000, "t2-u2": 16000}
    if shutil.which("sox"):
        scp[2] = f"t2-u2 sox {train / 'wav' / 't2-u2.wav'} -r 8000 -t wav - |"
        want["t2-u2"] = 8000
    _write(train, "wav.scp", scp)
    return want


def test_each_recording_keeps_its_own_rate_and_stage_1_resamples_to_16k(tmp_path):
    want = _mixed_rates(tmp_path / "corpus")
    data = tmp_path / "data"
    cuts = prepare_real("kaldi", tmp_path / "corpus", data)
    got = {c.id: c.sampling_rate for c in cuts["train"]}
    assert got == want
    # files only: the old recipe stamped the last file's rate (8 kHz) on every recording
    assert {c.id: c.sampling_rate for c in cuts["test"]} == {"e1-u0": 16000, "e2-u1": 8000}
    for c in cuts["train"]:
        assert c.duration == pytest.approx(0.5, abs=1e-3)
        assert c.load_audio().shape[1] == round(0.5 * c.sampling_rate)  # the pipe too, at its rate
    assert {c.recording.sources[0].type for c in cuts["train"]} == {"file", "command"}

    summary = compute_features(data, num_jobs=1)
    assert summary["train"]["dropped"] == 0
    feats = {c.id: c for c in CutSet.from_file(data / "features" / "train_cuts.jsonl.gz")}
    for cut in feats.values():
        assert cut.sampling_rate == SAMPLING_RATE
        assert cut.load_features().shape == (50, 40)  # 0.5 s at 100 frames per second
    # the 440 Hz tone lands in the same mel bin whatever the rate it was recorded at
    peak = {u: int(np.argmax(c.load_features().mean(0))) for u, c in feats.items()}
    assert len(set(peak.values())) == 1, peak


def test_a_rate_that_cannot_be_read_names_the_recording_line_and_fix(tmp_path):
    utts = _data_dir(tmp_path, speakers=("a", "b", "c"))
    raw = tmp_path / "wav" / "b-u1.raw"
    raw.write_bytes((_tone(0.5, 8000) * 32767).astype(np.int16).tobytes())  # headerless PCM, as sph2pipe -f raw
    scp = _lines(tmp_path, "wav.scp")
    scp[1] = f"{utts[1]} cat {raw} |"
    _write(tmp_path, "wav.scp", scp)
    with pytest.raises(ValueError, match=(r"wav.scp:2: recording b-u1 \(utterance b-u1\): its sampling rate cannot be "
                                          r"read: `cat .*b-u1.raw \|` wrote 8000 bytes with no audio header .*; make "
                                          r"the command write WAV to stdout \(e.g. sph2pipe -f wav")):
        prepare_real("kaldi", tmp_path, tmp_path / "data")
    scp[1] = f"{utts[1]} no-such-sph2pipe -f wav x.sph |"
    _write(tmp_path, "wav.scp", scp)
    with pytest.raises(ValueError, match=r"wav.scp:2: recording b-u1 .*`no-such-sph2pipe -f wav x.sph` cannot run "
                                         r"here .*; install the program or put it on PATH"):
        prepare_real("kaldi", tmp_path, tmp_path / "data")


def test_a_failing_command_or_bad_file_is_a_drop(tmp_path):
    utts = _data_dir(tmp_path, speakers=("a", "b", "c", "d"))
    scp = _lines(tmp_path, "wav.scp")
    scp[1] = f"{utts[1]} cat {tmp_path / 'missing.wav'} |"
    (tmp_path / "wav" / f"{utts[2]}.wav").write_bytes(b"not audio")
    _write(tmp_path, "wav.scp", scp)
    cuts = prepare_real("kaldi", tmp_path, tmp_path / "data")
    assert {d["id"]: d["reason"] for d in load_drops(tmp_path / "data")} == {utts[1]: "unreadable_audio",
                                                                            utts[2]: "unreadable_audio"}
    assert sorted(c.id for cs in cuts.values() for c in cs) == [utts[0], utts[3]]


# ------------------------------------------------------------------ speakers across splits
def test_a_speaker_in_two_splits_is_refused_unless_allowed(tmp_path, caplog):
    corpus = tmp_path / "corpus"
    for s, speakers in {"train": ("a", "b"), "dev": ("c",), "test": ("a",)}.items():
        _data_dir(corpus / s, speakers=speakers)
    # the same speaker "a" in train and test (utterance ids differ: a-u0 in both would be one id twice)
    (corpus / "test" / "wav" / "a-u0.wav").rename(corpus / "test" / "wav" / "a-u5.wav")
    for name in ("wav.scp", "text", "utt2spk", "spk2utt"):
        (corpus / "test" / name).write_text((corpus / "test" / name).read_text().replace("a-u0", "a-u5"))
    with pytest.raises(ValueError, match=r"1 speaker\(s\) in two splits \(train and test: 1; e.g. a\).*pass "
                                         r"--allow-shared-speakers to go on with a warning"):
        prepare_real("kaldi", corpus, tmp_path / "data")
    assert not (tmp_path / "data" / "manifests").exists()
    with caplog.at_level(logging.WARNING):
        cuts = prepare_real("kaldi", corpus, tmp_path / "data", allow_shared_speakers=True)
    assert "--allow-shared-speakers" in caplog.text
    assert {c.supervisions[0].speaker for c in cuts["test"]} == {"a"}


def test_check_disjoint_speakers():
    assert check_disjoint_speakers({"train": {"a", "b"}, "dev": {"c"}, "test": {"d"}}) == []
    with pytest.raises(ValueError, match=r"2 speaker\(s\) in two splits \(train and dev: 1; dev and test: 1"):
        check_disjoint_speakers({"train": {"a", "b"}, "dev": {"b", "c"}, "test": {"c"}})
    assert check_disjoint_speakers({"train": {"a"}, "dev": {"a"}}, allow_shared=True) == ["a"]
