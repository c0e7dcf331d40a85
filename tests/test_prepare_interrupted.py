"""Interrupted data stages: ``prepare.py`` killed (SIGKILL) in the middle of the
corpus, features and align stages, then run again with the same command (in the test's process), gives the
outputs of an uninterrupted run (the ``tiny_corpus`` / ``tiny_aligned`` fixtures): same manifests, same audio,
feature and alignment arrays, no file left over from the killed run, and no worker of the killed
run still alive to write into the re-run's outputs."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from lhotse import CutSet

ROOT = Path(__file__).resolve().parents[1]
PREPARE = ROOT / "recipes" / "asr" / "prepare.py"

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for the killed run's workers")


def _command(data_dir: Path, stage: int, *extra: str, jobs: int = 2) -> list[str]:
    return [sys.executable, str(PREPARE), "--corpus", "synthetic", "--size", "tiny", "--data-dir", str(data_dir),
            "--stage", str(stage), "--stop-stage", str(stage), "--num-jobs", str(jobs), *extra]


def _live_group_members(pgid: int) -> list[str]:
    """Python processes of process group ``pgid`` that are not zombies, as ``pid (name)`` (a TTS
    program a killed worker started may finish its sentence: it writes only to a temporary dir)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        name, fields = text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] != "Z" and name.startswith("python"):
            out.append(f"{stat.parent.name} ({name})")
    return out


def _kill_when(data_dir: Path, stage: int, ready: Callable[[str], bool], log: Path, *extra: str) -> None:
    """Start ``prepare.py`` for ``stage`` and SIGKILL it (its main process only, as a lost machine or
    the OOM killer would) as soon as ``ready(log so far)``. Its workers must die with it (within
    seconds, not when their task would have ended): they would write into the re-run's outputs."""
    with log.open("w") as out:
        proc = subprocess.Popen(_command(data_dir, stage, *extra), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not ready(log.read_text()):
            assert proc.poll() is None, f"prepare.py ended (rc {proc.returncode}) before the kill:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"stage {stage} never got under way:\n{log.read_text()}"
            time.sleep(0.002)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 3
        while members := _live_group_members(proc.pid):
            assert time.monotonic() < deadline, f"workers of the killed prepare.py still run: {members}"
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if _live_group_members(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)


def _rerun(data_dir: Path, stage: int, jobs: int = 2) -> None:
    """The same command again, in this process (``prepare.main`` with its arguments): a second start of
    Python would add nothing to what is checked."""
    from prepare import main

    main(_command(data_dir, stage, jobs=jobs)[2:])


def _files(d: Path) -> set[str]:
    return {str(p.relative_to(d)) for p in d.rglob("*") if p.is_file()}


def _cuts(path: Path) -> dict:
    return {c.id: c for c in CutSet.from_file(path)}


def _interrupted(data_dir: Path, stage: str) -> bool:
    return not (data_dir / ".done" / stage).exists()


def test_corpus_stage_killed_then_rerun(tiny_corpus, tmp_path):
    data = tmp_path / "d"
    _kill_when(data, 0, lambda _: any(data.glob("audio/*/*.wav")), tmp_path / "killed.log")
    assert _interrupted(data, "corpus") and not (data / "manifests" / "test_cuts.jsonl.gz").exists()
    _rerun(data, 0)
    assert (data / ".done" / "corpus").exists()
    assert _files(data / "audio") == _files(tiny_corpus / "audio")  # nothing left over, nothing missing
    for split in ("train", "dev", "test"):
        got, want = (_cuts(d / "manifests" / f"{split}_cuts.jsonl.gz") for d in (data, tiny_corpus))
        assert list(got) == list(want)
        for cut_id, cut in got.items():
            a, b = cut.to_dict(), want[cut_id].to_dict()
            for d, root in ((a, data), (b, tiny_corpus)):
                src = d["recording"]["sources"][0]
                src["source"] = str(Path(src["source"]).relative_to(root))
            assert a == b, cut_id
            audio, ref = (sf.read(c.recording.sources[0].source, dtype="int16")[0] for c in (cut, want[cut_id]))
            np.testing.assert_array_equal(audio, ref, err_msg=cut_id)


def test_features_stage_killed_then_rerun(tiny_aligned, tiny_corpus, tmp_path):
    """Killed once its workers (2 jobs) had written part of a storage shard; run again with 1 job
    (as ``tiny_aligned`` was, and fast): the killed run's second shards are gone, and the features
    and CMVN statistics are those of the uninterrupted run."""
    data = tmp_path / "d"
    shutil.copytree(tiny_corpus / "manifests", data / "manifests")  # (their audio paths are absolute)
    def started(_) -> bool:  # both workers opened their train shard, one has written to it
        shards = list(data.glob("features/train_feats.*.lca"))
        return len(shards) == 2 and any(p.stat().st_size > 0 for p in shards)

    _kill_when(data, 1, started, tmp_path / "killed.log")
    assert _interrupted(data, "features") and not (data / "features" / "cmvn.json").exists()
    assert (data / "features" / "train_feats.1.lca").exists()
    _rerun(data, 1, jobs=1)
    assert _files(data / "features") == {"cmvn.json"} | {f"{s}_{kind}" for s in ("train", "dev", "test")
                                                         for kind in ("cuts.jsonl.gz", "feats.0.lca")}
    for split in ("train", "dev", "test"):
        got, want = (_cuts(d / "features" / f"{split}_cuts.jsonl.gz") for d in (data, tiny_aligned))
        assert list(got) == list(want)
        for cut_id, cut in got.items():
            np.testing.assert_array_equal(cut.load_features(), want[cut_id].load_features(), err_msg=cut_id)
            np.testing.assert_array_equal(cut.load_custom("mfcc"), want[cut_id].load_custom("mfcc"), err_msg=cut_id)
    got, want = (json.loads((d / "features" / "cmvn.json").read_text()) for d in (data, tiny_aligned))
    assert got == want


def test_align_stage_killed_then_rerun(tiny_aligned, tmp_path):
    """A complete data dir whose align stage is forced again and killed while it writes the
    alignments: the re-run (same command, no --force) redoes it and gives the first run's outputs."""
    landed = 0
    for attempt in range(3):  # the stage takes ~0.3 s: retried if a kill came after its end
        data = tmp_path / f"d{attempt}"
        shutil.copytree(tiny_aligned, data, symlinks=True)
        writing = lambda log, d=data: "cleared ali" in log and (d / "ali" / "train_pdf_ali").exists()
        _kill_when(data, 6, writing, tmp_path / f"killed{attempt}.log", "--force")
        if not _interrupted(data, "align"):
            continue
        landed += 1
        assert _files(data / "ali") != _files(tiny_aligned / "ali")  # the killed run left a partial ali/
        _rerun(data, 6)
        assert (data / ".done" / "align").exists()
        assert _files(data / "ali") == _files(tiny_aligned / "ali")
        for split in ("train", "dev"):
            got, want = (_cuts(d / "ali" / f"{split}_cuts.jsonl.gz") for d in (data, tiny_aligned))
            assert list(got) == list(want)
            for cut_id, cut in got.items():
                np.testing.assert_array_equal(cut.load_custom("pdf_ali"), want[cut_id].load_custom("pdf_ali"))
            with open(data / "ali" / f"trans_{split}.pkl", "rb") as f, open(tiny_aligned / "ali" / f"trans_{split}.pkl",
                                                                           "rb") as g:
                a, b = pickle.load(f), pickle.load(g)
            assert set(a) == set(b) and all(np.array_equal(a[k], b[k]) for k in a)
        np.testing.assert_array_equal(np.load(data / "ali" / "priors.npy"), np.load(tiny_aligned / "ali" / "priors.npy"))
        got, want = (json.loads((d / "ali" / "info.json").read_text()) for d in (data, tiny_aligned))
        assert {k: v for k, v in got.items() if k != "seconds"} == {k: v for k, v in want.items() if k != "seconds"}
        break
    assert landed, "every kill came after the align stage had finished: nothing was tested"


def test_atomic_path_leaves_the_old_file_when_a_write_fails(tmp_path):
    from local.atomic import atomic_path, write_json

    path = tmp_path / "x_cuts.jsonl.gz"
    path.write_text("old")
    with pytest.raises(RuntimeError), atomic_path(path) as tmp:
        assert tmp.name.endswith("x_cuts.jsonl.gz") and tmp.parent == tmp_path  # keeps the suffixes
        tmp.write_text("half")
        raise RuntimeError("killed")
    assert path.read_text() == "old" and os.listdir(tmp_path) == [path.name]
    write_json(path, {"a": 1})
    assert json.loads(path.read_text()) == {"a": 1} and os.listdir(tmp_path) == [path.name]


def test_half_written_drop_record_is_not_a_record(tmp_path):
    from local.drops import clear_drops, load_drops, record_drop

    record_drop(tmp_path, "corpus", "train", "u1", "empty_audio")
    record_drop(tmp_path, "features", "train", "u2", "too_short")
    with (tmp_path / "dropped.jsonl").open("a") as f:
        f.write('{"stage": "align", "split": "tr')  # what an append killed mid-write leaves
    assert [d["id"] for d in load_drops(tmp_path)] == ["u1", "u2"]
    clear_drops(tmp_path, "align")
    assert [d["id"] for d in load_drops(tmp_path)] == ["u1", "u2"]
    assert (tmp_path / "dropped.jsonl").read_text().endswith("\n")


def test_stage_outputs_cleared_before_a_stage_runs_never_a_real_corpus(tmp_path):
    from prepare import clear_stage_outputs

    for name in ("manifests", "audio", "features", ".corpus-mirror-abc"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "f").write_text("x")
    assert {p.name for p in clear_stage_outputs(tmp_path, "corpus", "kaldi")} == {"manifests", ".corpus-mirror-abc"}
    assert (tmp_path / "audio" / "f").exists() and (tmp_path / "features" / "f").exists()
    assert [p.name for p in clear_stage_outputs(tmp_path, "corpus", "synthetic")] == ["audio"]
    assert [p.name for p in clear_stage_outputs(tmp_path, "features")] == ["features"]
    assert not any(tmp_path.iterdir())
