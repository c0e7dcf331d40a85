"""evaluate.py says when its lattices would be decoded with glibc's malloc, and how to preload jemalloc."""

from __future__ import annotations

import logging

import evaluate
from evaluate import allocator_note


def test_no_note_when_jemalloc_is_preloaded():
    env = {"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}
    assert allocator_note(env, lambda name: "libjemalloc.so.2") is None


def test_note_names_the_preload_line_when_jemalloc_is_installed():
    note = allocator_note({"LD_PRELOAD": "libother.so"}, lambda name: "libjemalloc.so.2" if name == "jemalloc" else None)
    assert "glibc's malloc" in note and "LD_PRELOAD=libjemalloc.so.2" in note


def test_note_names_the_debian_package_when_jemalloc_is_missing():
    note = allocator_note({}, lambda name: None)
    assert "libjemalloc2" in note and "LD_PRELOAD=libjemalloc.so.2" in note


def test_main_logs_the_note_before_decoding_lattices(tmp_path, monkeypatch, caplog):
    run = tmp_path / "exp" / "run"
    run.mkdir(parents=True)
    decoded = []
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.setattr(evaluate, "_evaluate_args", lambda args: decoded.append(args[0]))
    monkeypatch.setattr(evaluate, "compare_runs", lambda *a, **k: None)
    with caplog.at_level(logging.INFO, logger="evaluate"):
        evaluate.main(["--runs", str(run), "--out", str(tmp_path / "compare")])
    assert decoded == [run]
    assert any("glibc's malloc" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="evaluate"):  # best path: no lattices, no note
        evaluate.main(["--runs", str(run), "--search", "best-path", "--out", str(tmp_path / "compare")])
    assert not any("glibc's malloc" in r.getMessage() for r in caplog.records)
