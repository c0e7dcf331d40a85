"""The soak command (``python -m gtc_lightning.tools.soak``) on a few steps: replicas checked and found
identical for gtc and ddp; a replica made to drift is caught at the next check and the command
fails."""

import json
import math
import subprocess
import sys


def _soak(tmp_path, *extra):
    out = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "gtc_lightning.tools.soak", "--model", "2x32:8", "--batch", "16", "--steps", "30",
           "--every", "10", "--progress", "0", "--out", str(out), *extra]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    return proc, json.loads(out.read_text()) if out.exists() else None


def test_replicas_identical_and_reported(tmp_path):
    proc, report = _soak(tmp_path, "--strategies", "gtc", "ddp")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert [r["strategy"] for r in report["runs"]] == ["gtc", "ddp"]
    for run in report["runs"]:
        assert run["steps"] == 30 and run["checks"] == 3 and run["identical"] and run["mismatches"] == []
        assert math.isfinite(run["first_loss"]) and math.isfinite(run["last_loss"])
    assert report["runs"][0]["gtc"]["sparse_steps"] == 30
    assert "gtc: 30 steps, 3 replica checks, 0 mismatches (none)" in proc.stdout


def test_a_drifting_replica_is_caught(tmp_path):
    proc, report = _soak(tmp_path, "--strategies", "gtc", "--perturb-at", "15")
    assert proc.returncode == 1
    (run,) = report["runs"]
    assert run["mismatches"] == [20, 30] and not run["identical"]
    assert "first at step 20" in proc.stdout
