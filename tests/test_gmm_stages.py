"""``recipes/asr/research/gmm_stages.py``: each GMM system against the monophone at the point dev chose, from
the files the GMM stages write."""

import json

import gmm_stages
import pytest

SPEAKERS = {"u1": "a", "u2": "a", "u3": "b", "u4": "b"}


def decoding(root, system, split, per_utt, scale=0.0833, penalty=0.0, extra=None):
    d = root / "exp" / system / f"decode_{split}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "wer.json").write_text(json.dumps({"acoustic_scale": scale, "word_insertion_penalty": penalty}))
    name = f"per_utt-{split}-acwt{scale:g}" + (f"-wip{penalty:g}" if penalty else "") + ".json"
    (d / name).write_text(json.dumps({u: [e, 10] for u, e in zip(SPEAKERS, per_utt)}))
    for other in extra or []:  # points dev did not choose: never read
        (d / f"per_utt-{split}-acwt{other:g}.json").write_text(json.dumps({u: [10, 10] for u in SPEAKERS}))
    (root / "exp" / system / "summary.json").write_text(json.dumps({"pdfs": 10 * len(system), "gaussians": 100}))


def test_each_system_against_mono_at_the_point_dev_chose(tmp_path):
    for split in ("dev", "test"):
        decoding(tmp_path, "mono", split, [2, 2, 2, 2])
        decoding(tmp_path, "tri", split, [4, 4, 3, 3], scale=0.0667, extra=[0.0833])
        decoding(tmp_path, "sat", split, [1, 1, 1, 1], scale=0.05, penalty=0.5)
    report = gmm_stages.stages(tmp_path, {"dev": SPEAKERS, "test": SPEAKERS})
    assert list(report) == ["mono", "tri", "sat"]  # lda_mllt was not trained
    assert report["mono"]["dev"] == {"wer": 20.0, "vs_mono": [0.0, 0.0, 0.0]}
    tri = report["tri"]["test"]
    assert tri["wer"] == 35.0 and tri["vs_mono"][0] == 15.0 and 10.0 <= tri["vs_mono"][1] <= 15.0 <= tri["vs_mono"][2]
    assert report["sat"]["dev"]["wer"] == 10.0 and report["sat"]["dev"]["vs_mono"] == [-10.0, -10.0, -10.0]
    assert report["tri"]["pdfs"] == 30
    # each stage against the one before it: SAT against the triphone system (no LDA+MLLT here), not mono
    assert "vs_previous" not in report["tri"]["dev"]
    assert report["sat"]["test"]["vs_previous"][:2] == ["tri", -25.0]


def test_missing_decodings_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="exp/mono/decode_dev is missing.*--stage 3"):
        gmm_stages.stages(tmp_path, {"dev": SPEAKERS, "test": SPEAKERS})
    decoding(tmp_path, "mono", "dev", [2, 2, 2, 2])
    (tmp_path / "exp" / "mono" / "decode_dev" / "per_utt-dev-acwt0.0833.json").unlink()
    with pytest.raises(FileNotFoundError, match="names a point its decoding did not write"):
        gmm_stages.stages(tmp_path, {"dev": SPEAKERS, "test": SPEAKERS})
