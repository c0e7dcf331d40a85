"""``gtc_lightning.tools.gpu_checks``: every part's command is one its tool accepts, the parts fit the
budget of one device call, and without a GPU it says so instead of running."""

from __future__ import annotations

import argparse
import importlib

import pytest

from gtc_lightning.tools import gpu_checks


class Parsed(Exception):
    """Raised once a tool's own parser accepted the arguments (nothing runs)."""


@pytest.mark.parametrize("name", [name for name in gpu_checks.PARTS if name != "tests"])
def test_each_part_is_a_command_its_tool_accepts(name, tmp_path, monkeypatch):
    _, argv = gpu_checks.PARTS[name]
    assert argv[0] == "-m"
    args = [arg.format(out=tmp_path) for arg in argv[2:]]
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        original(self, args, namespace)
        raise Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    with pytest.raises(Parsed):
        importlib.import_module(argv[1]).main(args)


def test_the_tests_part_runs_the_cuda_tests_file():
    _, argv = gpu_checks.PARTS["tests"]
    assert "tests/test_cuda.py" in argv and "--noconftest" in argv


def test_the_parts_fit_one_device_call():
    assert sum(limit for limit, _ in gpu_checks.PARTS.values()) <= gpu_checks.BUDGET_S <= 570


def test_without_a_gpu_it_says_so(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    assert gpu_checks.main(["--out", str(tmp_path)]) == 2
    assert "no CUDA device" in capsys.readouterr().err
