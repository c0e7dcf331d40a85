"""Stage 1: frame counts, fbank/MFCC agreement, CMVN per speaker, deltas, bad audio."""

import json
import pickle

import numpy as np
import pytest
import soundfile as sf
from lhotse import CutSet, MonoCut, Recording, SupervisionSegment
from lhotse.audio import AudioSource
from local.data.features import (
    add_deltas,
    add_split_entries,
    apply_cmvn,
    compute_features,
    gmm_features,
    split_cmvn,
    write_cmvn,
)
from local.drops import count_drops, load_drops

SR = 16000


def tone(seconds: float, freq: float, gain: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(round(seconds * SR)) / SR
    return (gain * (np.sin(2 * np.pi * freq * t) + 0.1 * rng.standard_normal(t.size))).astype(np.float32)


def cut_for(path, rid: str, speaker: str | None, num_samples: int | None = None) -> MonoCut:
    n = num_samples if num_samples is not None else sf.info(path).frames
    rec = Recording(rid, [AudioSource("file", [0], str(path))], SR, n, n / SR)
    sup = SupervisionSegment(rid, rid, 0.0, n / SR, text="HELLO", speaker=speaker)
    return MonoCut(rid, 0.0, n / SR, 0, recording=rec, supervisions=[sup])


@pytest.fixture(scope="module")
def featdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("feat")
    wav = d / "wav"
    wav.mkdir()
    good = {"a1": (1.0, "loud"), "a2": (1.234, "loud"), "b1": (0.73, "quiet"), "c1": (0.5, None)}
    gains = {"loud": 0.5, "quiet": 0.02, None: 0.1}
    cuts = []
    for i, (rid, (sec, spk)) in enumerate(good.items()):
        sf.write(wav / f"{rid}.wav", tone(sec, 300 + 100 * i, gains[spk], i), SR)
        cuts.append(cut_for(wav / f"{rid}.wav", rid, spk))
    (wav / "corrupt.wav").write_bytes(b"RIFF\x00\x00garbage" * 10)
    cuts.append(cut_for(wav / "corrupt.wav", "corrupt", "loud", num_samples=16000))
    cuts.append(cut_for(wav / "missing.wav", "missing", "loud", num_samples=16000))
    sf.write(wav / "empty.wav", np.zeros(0, dtype=np.float32), SR)
    cuts.append(cut_for(wav / "empty.wav", "empty", "loud", num_samples=0))
    sf.write(wav / "short.wav", tone(0.004, 300, 0.1, 9), SR)  # 64 samples: no 10 ms frame
    cuts.append(cut_for(wav / "short.wav", "short", "loud"))
    (d / "manifests").mkdir()
    CutSet.from_cuts(cuts).to_file(d / "manifests" / "train_cuts.jsonl.gz")
    CutSet.from_cuts(cuts[:2]).to_file(d / "manifests" / "dev_cuts.jsonl.gz")
    summary = compute_features(d, splits=("train", "dev"))
    return d, summary, {rid: sec for rid, (sec, _) in good.items()}


def test_frame_counts_100_per_second(featdir):
    d, summary, seconds = featdir
    cuts = CutSet.from_file(d / "features" / "train_cuts.jsonl.gz")
    assert sorted(c.id for c in cuts) == sorted(seconds)
    for cut in cuts:
        n = round(seconds[cut.id] * SR)
        fbank, mfcc = cut.load_features(), cut.load_custom("mfcc")
        assert fbank.shape == ((n + 80) // 160, 40)  # snip_edges=False: round(samples / shift)
        assert mfcc.shape == (fbank.shape[0], 13)
        assert cut.num_frames == fbank.shape[0]
    assert summary["train"] == {"cuts": 4, "dropped": 4, "frames": 100 + 123 + 73 + 50}
    assert summary["dev"]["cuts"] == 2


def test_bad_audio_dropped_with_reason(featdir):
    d, _, _ = featdir
    reasons = {r["id"]: r["reason"] for r in load_drops(d) if r["split"] == "train"}
    assert reasons == {
        "corrupt": "unreadable_audio",
        "missing": "unreadable_audio",
        "empty": "empty_audio",
        "short": "too_short",
    }
    assert count_drops(d, "features")["unreadable_audio"] == 2


def test_cmvn_per_speaker(featdir):
    d, _, _ = featdir
    stats = json.loads((d / "features" / "cmvn.json").read_text())
    assert set(stats["speakers"]) == {"loud", "quiet"}
    assert stats["splits"]["train"]["loud"]["frames"] == stats["splits"]["dev"]["loud"]["frames"] == 100 + 123
    assert stats["speakers"]["loud"] == stats["splits"]["train"]["loud"]  # its first split's, not pooled
    assert stats["global"]["frames"] == 100 + 123 + 73 + 50
    loud, quiet = (np.array(stats["speakers"][s]["mean"]) for s in ("loud", "quiet"))
    assert (loud - quiet).mean() > 3  # 28 dB gain difference shows up in the log-mel mean
    cuts = {c.id: c for c in CutSet.from_file(d / "features" / "train_cuts.jsonl.gz")}
    both = np.concatenate([cuts[i].load_features() for i in ("a1", "a2")])
    normed = apply_cmvn(both, "loud", stats)
    np.testing.assert_allclose(normed.mean(0), 0, atol=0.02)
    np.testing.assert_allclose(normed.std(0), 1, atol=0.02)
    glob = apply_cmvn(both, None, stats)
    assert np.allclose(glob, apply_cmvn(both, "unknown-speaker", stats))
    assert not np.allclose(glob, normed)
    with pytest.raises(ValueError, match="dims"):
        apply_cmvn(both[:, :13], "loud", stats)


def test_cmvn_per_split(tmp_path):
    """A speaker in train and dev (prepare.py --allow-shared-speakers): each split's statistics come from
    that split's frames only, and the front end normalises each split with its own."""
    from local.dnn.front_end import FrontEnd

    (tmp_path / "wav").mkdir()
    cuts = {}
    for split, gain in (("train", 0.5), ("dev", 0.01)):
        sf.write(tmp_path / "wav" / f"{split}.wav", tone(1.0, 400, gain, 0), SR)
        cuts[split] = cut_for(tmp_path / "wav" / f"{split}.wav", split, "shared")
    (tmp_path / "manifests").mkdir()
    for split, cut in cuts.items():
        CutSet.from_cuts([cut]).to_file(tmp_path / "manifests" / f"{split}_cuts.jsonl.gz")
    compute_features(tmp_path, splits=("train", "dev"))
    stats = json.loads((tmp_path / "features" / "cmvn.json").read_text())
    feats = {s: next(iter(CutSet.from_file(tmp_path / "features" / f"{s}_cuts.jsonl.gz"))) for s in cuts}
    for split, cut in feats.items():
        own = stats["splits"][split]["shared"]
        assert own["frames"] == 100  # not the 200 of both splits pooled
        np.testing.assert_allclose(own["mean"], cut.load_features().mean(0), rtol=1e-5, atol=1e-4)
        normed = apply_cmvn(cut.load_features(), "shared", split_cmvn(stats, split))
        np.testing.assert_allclose(normed.mean(0), 0, atol=1e-3)
        (_, x), = FrontEnd(tmp_path, "fbank")([cut], split)
        np.testing.assert_allclose(x, normed, rtol=1e-6)
    # the adapt stage's speaker transforms: each split's own too (``add_split_entries``)
    rng = np.random.default_rng(1)
    trans: dict = {}
    for split in cuts:
        add_split_entries(trans, {"shared": rng.normal(size=(40, 41)).astype(np.float32)}, split)
    assert set(trans) == {"shared", "dev/shared"}
    (tmp_path / "adapt").mkdir()
    (tmp_path / "adapt" / "fbank_sat_trans.pkl").write_bytes(pickle.dumps(trans))
    for split, key in (("train", "shared"), ("dev", "dev/shared")):
        normed = apply_cmvn(feats[split].load_features(), "shared", split_cmvn(stats, split))
        (_, x), = FrontEnd(tmp_path, "fbank_sat")([feats[split]], split)
        np.testing.assert_allclose(x, normed @ trans[key][:, :40].T + trans[key][:, 40], rtol=1e-4, atol=1e-4)
    # 34 dB apart: the pooled mean would leave each split's frames far from zero mean
    assert np.mean(stats["splits"]["train"]["shared"]["mean"]) - np.mean(stats["splits"]["dev"]["shared"]["mean"]) > 3


def test_cmvn_of_speakers_in_one_split_each_are_the_pooled_ones(tmp_path):
    """With no speaker in two splits (the embedded corpus), the per-split statistics are bit for bit the
    all-splits pooling the recipe used before: the default corpus's numbers do not move."""
    rng = np.random.default_rng(0)
    sums = {split: {f"{split}{k}": [int(n), rng.normal(size=40) * n, rng.random(40) * n * 50]
                    for k, n in enumerate(rng.integers(50, 500, size=3))} for split in ("train", "dev", "test")}
    got = write_cmvn(sums, tmp_path / "cmvn.json")
    for split, table in sums.items():
        for spk, (n, total, sq) in table.items():
            n, total, sq = 0 + n, 0.0 + total, 0.0 + sq  # the old accumulation over splits, from [0, 0.0, 0.0]
            mean = total / n
            pooled = {"mean": mean.tolist(), "std": np.sqrt(np.maximum(sq / n - mean**2, 1e-10)).tolist(), "frames": n}
            assert got["splits"][split][spk] == pooled == got["speakers"][spk]
    table, plain = {}, {}
    for split, entries in sums.items():
        add_split_entries(table, entries, split)
        plain.update(entries)
    assert table == plain


def test_gmm_features(featdir):
    d, _, _ = featdir
    cut = next(iter(CutSet.from_file(d / "features" / "train_cuts.jsonl.gz")))
    x = gmm_features(cut)
    assert x.shape == (cut.num_frames, 39) and x.dtype == np.float32
    np.testing.assert_allclose(x[:, :13].mean(0), 0, atol=1e-3)
    np.testing.assert_allclose(x[:, :13].std(0), 1, atol=1e-3)


def test_deltas_match_kaldi_definition():
    ramp = np.arange(20, dtype=np.float32)[:, None] * np.array([[1.0, -2.0]], dtype=np.float32)
    x = add_deltas(ramp)
    assert x.shape == (20, 6)
    np.testing.assert_allclose(x[:, :2], ramp)
    np.testing.assert_allclose(x[2:-2, 2:4], [[1.0, -2.0]] * 16, atol=1e-6)  # slope inside
    np.testing.assert_allclose(x[4:-4, 4:6], 0, atol=1e-6)  # no curvature inside
    # at the edge frames are repeated: delta at t=0 = (1*1 + 2*2) / 10 for slope 1
    assert x[0, 2] == pytest.approx(0.5)
    rng = np.random.default_rng(0)
    y = rng.standard_normal((30, 3)).astype(np.float32)
    t = 10
    want = sum(n * (y[t + n] - y[t - n]) for n in (1, 2)) / 10
    np.testing.assert_allclose(add_deltas(y)[t, 3:6], want, atol=1e-5)


def test_two_jobs_same_result(featdir, tmp_path):
    d, summary, _ = featdir
    (tmp_path / "manifests").mkdir()
    (tmp_path / "manifests" / "train_cuts.jsonl.gz").write_bytes(
        (d / "manifests" / "train_cuts.jsonl.gz").read_bytes()
    )
    assert compute_features(tmp_path, splits=("train",), num_jobs=2)["train"] == summary["train"]
    one = CutSet.from_file(d / "features" / "train_cuts.jsonl.gz")
    two = CutSet.from_file(tmp_path / "features" / "train_cuts.jsonl.gz")
    assert [c.id for c in one] == [c.id for c in two]  # manifest order kept across shards
    for a, b in zip(one, two):
        np.testing.assert_array_equal(a.load_features(), b.load_features())
    with pytest.raises(ValueError, match="num_jobs"):
        compute_features(tmp_path, num_jobs=0)


def test_gmm_features_per_speaker_cmvn(featdir):
    from local.data.features import gmm_cmvn_key, gmm_speaker_stats
    from local.gmm.common import gmm_front_end

    d, _, _ = featdir
    cuts = list(CutSet.from_file(d / "features" / "train_cuts.jsonl.gz"))
    stats = gmm_speaker_stats(cuts)
    key = gmm_cmvn_key(cuts[0])
    mine = [c for c in cuts if gmm_cmvn_key(c) == key]
    x = np.concatenate([gmm_features(c, stats) for c in mine])
    # zero mean and unit variance over the speaker, not over each utterance
    np.testing.assert_allclose(x[:, :13].mean(0), 0, atol=1e-3)
    np.testing.assert_allclose(x[:, :13].std(0), 1, atol=1e-3)
    if len(mine) > 1:
        assert np.abs(gmm_features(mine[0], stats)[:, :13].mean(0)).max() > 1e-3
    raw = np.concatenate([np.asarray(c.load_custom("mfcc"), np.float64) for c in mine])
    means_only = np.concatenate([gmm_features(c, stats, norm_vars=False) for c in mine])
    np.testing.assert_allclose(means_only[:, :13], raw - raw.mean(0), atol=1e-3)
    front = gmm_front_end(cuts)
    np.testing.assert_allclose(front[mine[0].id], gmm_features(mine[0], stats))
    np.testing.assert_allclose(gmm_front_end(cuts[:1], "utterance")[cuts[0].id], gmm_features(cuts[0]))
    with pytest.raises(ValueError, match="no CMVN statistics"):
        gmm_features(cuts[0], {})
    with pytest.raises(ValueError, match="cmvn='global'"):
        gmm_front_end(cuts, "global")


def test_stored_features_describe_what_lhotse_would(tmp_path):
    """The stage stores the fbank it computed once; the manifest is the one Lhotse's
    extract_from_samples_and_store writes (itself computing the filterbank again), and the
    stored matrix is the filterbank up to lilcom's compression."""
    from lhotse import LilcomChunkyWriter
    from local.data.features import _extractors, _stored_features

    sf.write(tmp_path / "x.wav", tone(1.37, 440, 0.3, 5), SR)
    cut = cut_for(tmp_path / "x.wav", "x", "s")
    audio = cut.load_audio()
    fbank, _ = _extractors()
    feats = fbank.extract(audio, SR)
    with LilcomChunkyWriter(tmp_path / "ours") as w1, LilcomChunkyWriter(tmp_path / "lhotse") as w2:
        ours = _stored_features(fbank, feats, audio, cut, w1)
        theirs = fbank.extract_from_samples_and_store(
            samples=audio, storage=w2, sampling_rate=SR, offset=cut.start, channel=cut.channel
        )
    fields = lambda m: {k: v for k, v in m.to_dict().items() if k not in ("storage_path", "storage_key")}
    assert fields(ours) == fields(theirs)
    assert np.allclose(ours.load(), feats, atol=0.05)
    assert np.array_equal(ours.load(), theirs.load())
