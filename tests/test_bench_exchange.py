"""``python -m gtc_lightning.tools.bench_exchange``: both header ways on 2 local gloo ranks, its JSON, and
the errors without a launcher."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gtc_lightning.tools import bench_exchange


def test_two_ranks_time_both_header_ways(tmp_path):
    out = tmp_path / "exchange.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29731",
           "-m", "gtc_lightning.tools.bench_exchange", "--words", "50", "--repeats", "4", "--warmup", "1",
           "--json", str(out)]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "2 ranks, 50 words each, 4 steps per way" in run.stdout
    data = json.loads(out.read_text())
    assert data["world_size"] == 2 and data["words"] == 50
    assert {len(t) for t in data["times_s"].values()} == {4} and set(data["times_s"]) == {"allgather", "alltoall"}
    ratio = data["ratio_alltoall_to_allgather"]
    assert 0 < ratio["q1"] <= ratio["median"] <= ratio["q3"]


def test_errors_name_the_bad_value(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        bench_exchange.main(["--repeats", "0"])
    assert "--repeats 0" in capsys.readouterr().err
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit):
        bench_exchange.main([])
    assert "gtc_lightning.tools.cluster" in capsys.readouterr().err
