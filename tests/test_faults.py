"""Faults on the emulated cluster (``gtc_lightning.tools.faults``): a link taken down mid-training stops
every rank within the collective timeout with a message that names the problem, and the resume
from the last checkpoint is bit-exact; per-node rates and link state of ``Cluster``; the pure
logic (checkpoint comparison, messages, the cut's timing, the straggler summary, the report).

The cluster tests need network namespaces (root, or CAP_NET_ADMIN and CAP_SYS_ADMIN) and skip
with the reason otherwise, as tests/test_cluster.py does; its ``netns`` fixture checks that
nothing is left behind. The link-down test trains ``conf/tiny.yaml`` three times (uninterrupted,
cut, resumed) with a 10 s collective timeout: about a minute.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from test_cluster import netns  # noqa: F401  (fixture: skips without namespaces, checks teardown)

from gtc_lightning.tools import faults
from gtc_lightning.tools.cluster import Cluster

# ---------------------------------------------------------------------------- checkpoint comparison


def _save_run(root: Path, weight: torch.Tensor, residual: torch.Tensor, seconds: float) -> Path:
    ckpt = root / "checkpoints" / "last.ckpt"
    (root / "checkpoints" / "last.ckpt.gtc").mkdir(parents=True)
    torch.save({"state_dict": {"w": weight}, "global_step": 8, "gtc": {"step": 8, "totals": {"exchange_s": seconds}},
                "optimizer_states": [{"state": {0: {"momentum_buffer": weight * 2}}, "param_groups": [{"lr": 0.5}]}],
                "callbacks": {"RecipeCheckpoint": {"dirpath": str(root)}}}, ckpt)
    torch.save({"rank": 0, "residual": residual}, root / "checkpoints" / "last.ckpt.gtc" / "rank0.pt")
    return ckpt


def test_compare_runs_is_bit_exact_and_finds_any_difference(tmp_path):
    w, r = torch.randn(5), torch.randn(7)
    a = _save_run(tmp_path / "a", w, r, 1.0)
    b = _save_run(tmp_path / "b", w.clone(), r.clone(), 2.0)  # other paths and timers: the same run
    same = faults.compare_runs(a, b)
    assert same["differences"] == []
    assert same["files"] == ["last.ckpt", "last.ckpt.gtc/rank0.pt"]
    assert same["tensors"] == 3 and same["timers"] == 1

    w2 = w.clone()
    w2[3] = torch.nextafter(w2[3], torch.tensor(float("inf")))  # one ulp
    c = _save_run(tmp_path / "c", w2, r, 1.0)
    diff = faults.compare_runs(a, c)["differences"]
    assert "last.ckpt/state_dict/w: tensors differ (torch.float32 (5,) vs torch.float32 (5,))" in diff
    assert any("optimizer_states[0]/state/0/momentum_buffer" in d for d in diff)

    d = _save_run(tmp_path / "d", w, r + 1, 1.0)
    assert faults.compare_runs(a, d)["differences"] == [("last.ckpt.gtc/rank0.pt/residual: tensors differ "
                                                        "(torch.float32 (7,) vs torch.float32 (7,))")]
    (d.parent / "last.ckpt.gtc" / "rank0.pt").unlink()
    assert faults.compare_runs(a, d)["differences"] == ["last.ckpt.gtc/rank0.pt: only in the first run"]


def test_timers_are_floats_under_seconds_keys():
    assert faults.is_timer("exchange_s", 0.5)
    assert not faults.is_timer("exchange_s", torch.tensor(0.5))
    assert not faults.is_timer("steps", 3.0) and not faults.is_timer("words_s", 3)


# -------------------------------------------------------------------------------------- messages

RESUME = "To resume from the last checkpoint: python recipes/asr/train.py --strategy gtc --ckpt_path last"


def test_error_line_is_the_last_one():
    log = f"noise\ntrain.py: error: first\nmore\ntrain.py: error: training stopped: lost rank 1 (x). {RESUME}\n"
    assert faults.error_line(log) == f"train.py: error: training stopped: lost rank 1 (x). {RESUME}"
    assert faults.error_line("Traceback (most recent call last):\nRuntimeError: boom\n") is None


@pytest.mark.parametrize("line,rank,clear", [
    (f"train.py: error: training stopped: lost rank 1 (pid 7 on vm: not responding). {RESUME}", 0, True),
    ((f"train.py: error: training stopped: lost rank 0 (unreachable: this rank's network link veth1 "
     f"(GLOO_SOCKET_IFNAME) is down, so this rank is cut off from the others). {RESUME}"), 1, True),
    # the cut rank blaming rank 0 without saying its own link is down
    (f"train.py: error: training stopped: lost rank 0 (it held the rendezvous store). {RESUME}", 1, False),
    # a rank naming someone else than the cut one
    (f"train.py: error: training stopped: lost rank 0 (it held the rendezvous store). {RESUME}", 2, False),
    ("train.py: error: training stopped: lost rank 1 (pid 7 on vm: not responding).", 0, False),  # no resume
    (None, 0, False),
])
def test_message_is_clear(line, rank, clear):
    assert faults.message_is_clear(line, rank, cut_rank=1, interface="veth1") is clear


# ------------------------------------------------------------------------- timing and straggler


def test_cut_lands_between_checkpoints():
    assert faults.cut_delay([100.0, 104.0], 0.5) == pytest.approx(2.0)


def test_gtc_runs_the_measured_settings_and_other_names_as_given(tmp_path):
    """gtc and gtc_stale as docs/benchmarks/faults.md measured them (conf/gtc.yaml, conf/gtc_stale.yaml: Strom's
    gradient mode, fixed tau, 32-bit words), not GTCStrategy's defaults; any other name as it is."""
    args = {"data_dir": tmp_path, "exp_dir": tmp_path, "timeout": 10.0, "every": 5, "train_args": []}
    for name, config in (("gtc", "gtc.yaml"), ("gtc_stale", "gtc_stale.yaml")):
        command = faults.train_command(name, **args)
        assert "--trainer.strategy" not in command
        assert command[command.index(str(faults.TINY)) + 1 : command.index(str(faults.TINY)) + 3] == [
            "--config", str(faults.REPO / "conf" / config)]  # fmt: skip
        assert command[command.index("--run_name") + 1] == name
    command = faults.train_command("ddp", **args)
    assert command[command.index("--trainer.strategy") + 1] == "ddp"


def test_summarize_straggler_medians_and_ranges():
    runs = [
        {"repeat": 0, "links": "equal", "step_s": {"ddp": 1.0, "gtc": 0.10}},
        {"repeat": 0, "links": "straggler", "step_s": {"ddp": 9.0, "gtc": 0.12}},
        {"repeat": 1, "links": "straggler", "step_s": {"ddp": 11.0, "gtc": 0.11}},
        {"repeat": 1, "links": "equal", "step_s": {"ddp": 1.0, "gtc": 0.11}},
    ]
    rows = {r["strategy"]: r for r in faults.summarize_straggler(runs)}
    assert rows["ddp"]["equal"]["values"] == [1.0, 1.0]
    assert rows["ddp"]["straggler"] == {"median": 10.0, "min": 9.0, "max": 11.0, "values": [9.0, 11.0]}
    assert rows["ddp"]["slowdown"]["values"] == pytest.approx([9.0, 11.0])
    assert rows["gtc"]["slowdown"]["values"] == pytest.approx([1.2, 1.0])
    assert rows["gtc"]["slowdown"]["median"] == pytest.approx(1.1)


def test_render_states_command_machine_and_failures():
    results = {
        "command": "python -m gtc_lightning.tools.faults", "started": "2026-11-23T16:00:00+00:00", "wall_s": 600,
        "host": {"cpus": 2, "load_at_start": [1.0, 1, 1], "load_at_end": [2.0, 1, 1]},
        "args": {"rate": "100mbit", "train_args": "--trainer.max_epochs 2", "every": 10, "timeout": 20.0,
                 "slack": 15.0, "cut_fraction": 0.5, "steps": 5, "rounds": 2, "repeats": 2},
        "link_down": [{"strategy": "bmuf_gtc", "nodes": 2, "skipped": "needs 4 nodes"},
                      {"strategy": "gtc", "nodes": 2, "cut_node": 1, "cut_interface": "veth1", "passed": False,
                       "problem": "the run ended (ok) before the link was cut; give it more steps"}],
        "straggler": {"model": "recipe", "nodes": 2, "rate": "100mbit", "slow_rate": "10mbit", "slow_node": 1,
                      "runs": [{"repeat": 0, "links": "equal", "status": "failed"}],
                      "summary": [{"strategy": "ddp", "equal": {"median": 1.0, "min": 1.0, "max": 1.0, "values": [1.0]},
                                   "straggler": None, "slowdown": None}]},
    }
    text = faults.render(results)
    assert "Made by `python -m gtc_lightning.tools.faults`" in text and "2 CPU cores" in text
    assert "| 2 | bmuf_gtc | skipped: needs 4 nodes |" in text
    assert "gtc: the run ended (ok) before the link was cut" in text
    assert "| ddp | 1.000 | - | - |" in text and "Runs that failed: rep 0 equal (failed)" in text


# --------------------------------------------------------------------------------- on namespaces


def test_one_slow_link_and_a_link_down(netns):  # noqa: F811
    with Cluster(nodes=2, rate="100mbit", verbose=False) as c:
        c.set_rate("10mbit", burst="16kb", nodes=[1])
        qdiscs = {(ns, dev): subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", dev], capture_output=True,
                                            text=True, check=True).stdout
                  for ns, dev in [(c.namespaces[0], "veth0"), (c.namespaces[1], "veth1"),
                                  (c.bridge_namespace, "port0"), (c.bridge_namespace, "port1")]}
        assert "rate 100Mbit" in qdiscs[(c.namespaces[0], "veth0")] and "rate 100Mbit" in qdiscs[(c.bridge_namespace, "port0")]
        assert "rate 10Mbit" in qdiscs[(c.namespaces[1], "veth1")] and "rate 10Mbit" in qdiscs[(c.bridge_namespace, "port1")]
        assert c.rate == "100mbit" and c.link_rates == ["100mbit", "10mbit"] and c.config()["link_rates"] == c.link_rates
        with pytest.raises(ValueError, match="nodes 0 to 1"):
            c.set_rate("10mbit", nodes=[2])

        def link() -> tuple[str, str]:
            ns = c.namespaces[1]
            state = subprocess.run(["ip", "netns", "exec", ns, "cat", "/sys/class/net/veth1/operstate"],
                                   capture_output=True, text=True, check=True).stdout.strip()
            return state, subprocess.run(["ip", "-n", ns, "route"], capture_output=True, text=True, check=True).stdout

        c.set_link(1, up=False)
        assert link() == ("down", "") and c.config()["links_up"] == [True, False]
        c.set_link(1, up=True)  # address, route and shaping come back
        state, routes = link()
        assert state == "up" and "10.213.0.0/24 dev veth1" in routes and c.links_up == [True, True]
        assert "rate 10Mbit" in subprocess.run(["tc", "-n", c.namespaces[1], "qdisc", "show", "dev", "veth1"],
                                               capture_output=True, text=True, check=True).stdout


def test_link_down_stops_every_rank_in_time_and_the_resume_is_bit_exact(netns, tiny_aligned, tmp_path):  # noqa: F811
    """gtc on 2 nodes, 20 steps, a checkpoint every 5: node 1's link goes down between the checkpoints
    of steps 10 and 15; both ranks must exit non-zero within the 10 s collective timeout + 15 s,
    rank 0 naming rank 1 as lost and rank 1 saying its link veth1 is down; resumed with
    ``--ckpt_path last`` to step 20, the final checkpoint and the residual shards equal the
    uninterrupted run's bit for bit."""
    args = faults.build_parser().parse_args([
        "--timeout", "10", "--every", "5", "--data-dir", str(tiny_aligned), "--out", str(tmp_path), "--run-limit", "180",
        # a wider model: steps of a few ms (an idle host, the tiny model) let the run pass its step-15 and
        # step-20 checkpoints before the watcher, polling every 20 ms, could cut between them
        "--train-args=--trainer.limit_train_batches 20 --trainer.max_epochs 1 --model.hidden_dim 1024"])
    with Cluster(nodes=2, rate="100mbit", verbose=False) as cluster:
        record = faults.link_down_case(cluster, "gtc", args, tmp_path / "gtc")
    summary = json.dumps({k: v for k, v in record.items() if k != "comparison"}, indent=1)
    assert "problem" not in record, summary
    assert 10 <= record["checkpoint_step_at_cut"] < 20, summary
    ranks = {r["rank"]: r for r in record["ranks"]}
    assert sorted(ranks) == [0, 1]
    for r in ranks.values():
        assert r["exit_code"] == 1 and r["stopped_by"] is None, summary
        assert r["exit_after_cut_s"] <= 10 + 15, summary
        assert r["clear"], summary
    assert "lost rank 1 (" in ranks[0]["message"] and "no heartbeat" in ranks[0]["message"]
    assert "network link veth1 (GLOO_SOCKET_IFNAME) is down" in ranks[1]["message"]
    assert record["final_steps"] == [20, 20]
    comparison = record["comparison"]
    assert comparison["differences"] == [] and record["bit_exact"] and record["passed"]
    assert comparison["files"] == ["step20-end.ckpt", "step20-end.ckpt.gtc/rank0.pt", "step20-end.ckpt.gtc/rank1.pt"]
    assert comparison["tensors"] >= 8
    # last.ckpt links to the last checkpoint every rank finished; the ones it replaced are gone
    for run in ("straight", "cut"):
        config = (tmp_path / "gtc" / run / "gtc" / "config.yaml").read_text()  # conf/gtc.yaml's settings
        assert "compress: gradient" in config and "coding: none" in config and "tau: 0.01" in config
        checkpoints = tmp_path / "gtc" / run / "gtc" / "checkpoints"
        assert sorted(p.name for p in checkpoints.iterdir()) == ["last.ckpt", "step20-end.ckpt", "step20-end.ckpt.gtc"]
        assert (checkpoints / "last.ckpt").readlink() == Path("step20-end.ckpt")
