"""evaluate.py finds a run's checkpoint and data dir after the run dir or the data dir was moved."""

from __future__ import annotations

from pathlib import Path

import pytest
from evaluate import locate_run, main


def _run_dir(root: Path, names: tuple[str, ...]) -> Path:
    run = root / "exp" / "run"
    (run / "checkpoints").mkdir(parents=True)
    for name in names:
        (run / "checkpoints" / name).write_bytes(name.encode())
    return run


def _data_dir(root: Path) -> Path:
    (root / "data" / "ali").mkdir(parents=True)
    return root / "data"


def test_moved_run_dir_uses_its_own_copy_of_the_recorded_checkpoint(tmp_path):
    run, data = _run_dir(tmp_path, ("last.ckpt", "step100-end.ckpt")), _data_dir(tmp_path)
    summary = {"checkpoint": "/gone/exp/run/checkpoints/step100-end.ckpt", "data_dir": str(data)}
    assert locate_run(run, summary) == (run / "checkpoints" / "step100-end.ckpt", data)


def test_recorded_checkpoint_outside_the_run_dir_is_used_when_the_run_dir_has_none(tmp_path):
    run, data = _run_dir(tmp_path, ()), _data_dir(tmp_path)
    elsewhere = tmp_path / "kept" / "final.ckpt"
    elsewhere.parent.mkdir()
    elsewhere.write_bytes(b"x")
    assert locate_run(run, {"checkpoint": str(elsewhere), "data_dir": str(data)})[0] == elsewhere


def test_last_checkpoint_when_none_is_recorded(tmp_path):
    run, data = _run_dir(tmp_path, ("last.ckpt",)), _data_dir(tmp_path)
    assert locate_run(run, {"data_dir": str(data)})[0] == run / "checkpoints" / "last.ckpt"


def test_missing_checkpoint_names_every_place_looked(tmp_path):
    run, data = _run_dir(tmp_path, ()), _data_dir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"step7-end\.ckpt.*/gone/step7-end\.ckpt.*last\.ckpt"):
        locate_run(run, {"checkpoint": "/gone/step7-end.ckpt", "data_dir": str(data)})


def test_moved_data_dir_names_the_option_and_the_option_overrides(tmp_path):
    run, data = _run_dir(tmp_path, ("last.ckpt",)), _data_dir(tmp_path)
    summary = {"data_dir": "/gone/data/synthetic-default"}
    with pytest.raises(FileNotFoundError, match=r"/gone/data/synthetic-default.*--data-dir"):
        locate_run(run, summary)
    assert locate_run(run, summary, data)[1] == data


def test_compare_only_refuses_runs_that_were_never_decoded(tmp_path, capsys):
    decoded_run, fresh_run = tmp_path / "exp" / "a", tmp_path / "exp" / "b"
    (decoded_run / "decode").mkdir(parents=True)
    (decoded_run / "decode" / "results.json").write_text("{}")
    fresh_run.mkdir()
    with pytest.raises(SystemExit):
        main(["--compare-only", "--out", str(tmp_path / "cmp"), "--runs", str(decoded_run), str(fresh_run)])
    err = capsys.readouterr().err
    assert f"never decoded (no decode/results.json): {fresh_run}" in err and str(decoded_run) not in err
    assert "without --compare-only" in err and not (tmp_path / "cmp").exists()


def test_other_test_sets_are_decoded_at_the_scale_dev_picked_for_the_run(tmp_path, caplog):
    """``--test-set`` without ``--acoustic-scale``: the scale in the run's decode/results.json, else the
    preferred 0.1 with a warning that says how to do better."""
    import json

    from evaluate import dev_scale_of

    run = _run_dir(tmp_path, ("last.ckpt",))
    assert dev_scale_of(run / "checkpoints" / "last.ckpt") == 0.1 and "give --acoustic-scale" in caplog.text
    (run / "decode").mkdir()
    (run / "decode" / "results.json").write_text(json.dumps({"acoustic_scale": 0.143}))
    assert dev_scale_of(run / "checkpoints" / "last.ckpt") == 0.143


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_decoding_workers_stop_with_a_killed_evaluate(tmp_path):
    """evaluate.py decodes runs in spawned worker processes: when evaluate.py is killed (SIGKILL, no
    clean-up), its workers die with it instead of decoding on for minutes (Linux: PR_SET_PDEATHSIG)."""
    import os
    import subprocess
    import sys
    import textwrap
    import time

    asr = Path(__file__).resolve().parents[1] / "recipes" / "asr"
    pid_file = tmp_path / "pid"
    code = textwrap.dedent(f"""
        import multiprocessing, os, signal, sys
        sys.path.insert(0, {str(asr)!r})
        from concurrent.futures import ProcessPoolExecutor
        import evaluate
        pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), initializer=evaluate._worker_init)
        open({str(pid_file)!r}, "w").write(str(pool.submit(os.getpid).result()))
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    subprocess.run([sys.executable, "-c", code], check=False, timeout=120)
    worker = int(pid_file.read_text())

    def alive() -> bool:  # a zombie (dead, not yet reaped) counts as dead
        try:
            return Path(f"/proc/{worker}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except (FileNotFoundError, ProcessLookupError):
            return False

    deadline = time.monotonic() + 10
    while alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    survived = alive()
    if survived:
        os.kill(worker, 9)  # (not left running after the test)
    assert not survived, "the decoding worker outlived its killed evaluate.py"
