"""The cluster benchmark's pieces: one run on 2 emulated nodes (and the single-device baseline) with a
tiny model and 2 steps per strategy, checked for what the README's table rests on: the wire bytes
the veth counters saw inside the timed window against what the collectives should send, the
replay's bytes against training's, nothing sent by ``nocomm``, start-up traffic outside the window,
the report and plot written, and nothing of the cluster left behind.

Needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN) for the namespaces; skipped with the reason
otherwise. About 20-40 s (three Lightning processes start; each fits a few tiny models).
"""

import json
from pathlib import Path

import pytest
from test_cluster import netns  # noqa: F401  (the fixture: nothing of the cluster left behind)

from gtc_lightning.tools import bench_cluster, scaling
from gtc_lightning.tools.bench_cluster import burst_for, parse_strategy


def test_parse_strategy_and_burst():
    assert parse_strategy("gtc") == {"name": "gtc", "options": {}, "label": "gtc"}
    assert parse_strategy("bmuf:period=5,nesterov=false,block_lr=0.5")["options"] == {
        "period": 5, "nesterov": False, "block_lr": 0.5}  # fmt: skip
    with pytest.raises(ValueError, match="key=value"):
        parse_strategy("bmuf:5")
    # 1 ms of the rate, at least 16 KiB
    assert burst_for("1gbit", 1.0) == "125000"
    assert burst_for("100mbit", 1.0) == str(16 * 1024)


def test_gtc_is_strom_gradient_mode_at_the_fixed_tau():
    """What the published rows measured, whatever GTCStrategy's defaults: the gradient mode at the given
    tau in 32-bit words (gtc_rice: coded), also under a registered name with options, unless they say."""
    cases = {("gtc", ""): ("none", False), ("gtc_rice", ""): ("rice", False), ("gtc_stale", ""): ("none", True),
             ("gtc_allgather", ""): ("none", False), ("gtc", ":exchange=allgather"): ("none", False),
             ("bmuf_gtc", ":period=5"): ("none", False), ("gtc", ":coding=rice"): ("rice", False)}  # fmt: skip
    for (name, options), (coding, stale) in cases.items():
        entry = parse_strategy(name + options)
        strategy = bench_cluster.build_strategy(entry["name"], 0.02, entry["options"])
        assert (strategy.compress, strategy.coding, strategy.tau, strategy.stale) == ("gradient", coding, 0.02, stale)
        assert strategy.target_density is None, name + options  # a fixed tau


def test_nocomm_runs_once_and_bmuf_gtc_needs_two_groups():
    """nocomm (the compute) is added to every world once, also when the user names it; bmuf_gtc is
    left out of a world with fewer than two groups."""
    def names(world, given):
        return [s["label"] for s in bench_cluster._strategies_for(world, [parse_strategy(g) for g in given])]

    assert names(4, ["gtc", "nocomm", "gtc_rice"]) == ["gtc", "gtc_rice", "nocomm"]
    assert names(2, ["bmuf_gtc", "gtc"]) == ["gtc", "nocomm"]
    assert names(4, ["bmuf_gtc"]) == ["bmuf_gtc", "nocomm"]


def test_report_names_targets_only_where_they_can_be_read():
    """The published records re-render: the full run lists the issue's targets for 4 workers and
    Strom's model; a run without GTC on them (ddp and dpsgd only) has no targets section."""
    from pathlib import Path

    docs = Path(__file__).resolve().parents[1] / "docs"
    full = bench_cluster.render(json.loads((docs / "benchmarks" / "bench_cluster.json").read_text()))
    assert "Targets (4 workers, Strom's model):" in full and "| 100mbit | step, fp32 DDP / GTC |" in full
    dpsgd = json.loads((docs / "experiments" / "bench_dpsgd_strom.json").read_text())
    assert dpsgd["targets"] == []
    text = bench_cluster.render(dpsgd)
    assert "Targets" not in text and "| strom | 4 | 100mbit | dpsgd |" in text


def test_two_nodes_tiny_model(netns, tmp_path, capsys):  # noqa: F811  (netns: the fixture imported above)
    """The command's ``main`` runs in this process, three times (measured, ``--resume``, ``--resume`` with
    other settings): only the configurations' ranks start Python (test_site_pages runs the ``python -m``
    entry of every tool)."""
    out = tmp_path / "bench"
    argv = ["--models", "2x16:8", "--workers", "1", "2", "--rates", "1gbit", "--strategies", "ddp", "gtc", "--steps",
            "2", "--min-steps", "2", "--rounds", "1", "--warmup", "1", "--replay-steps", "2", "--tau", "1e-3", "--out",
            str(out)]  # fmt: skip
    code = bench_cluster.main(argv)
    printed = capsys.readouterr()
    assert code == 0, printed.out[-3000:] + printed.err[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["schema"] == "gtc_lightning.bench_cluster/1"
    assert [(c["world"], c["rate"], c["status"]) for c in results["configs"]] == [
        (1, None, "ok"),
        (2, "1gbit", "ok"),
    ]
    rows = {(r["world"], r["strategy"]): r for r in results["rows"]}
    assert set(rows) == {(1, "single"), (2, "ddp"), (2, "gtc"), (2, "nocomm")}
    n = bench_cluster.parameter_count((2, 16, 8))
    ddp, gtc, nocomm = rows[2, "ddp"], rows[2, "gtc"], rows[2, "nocomm"]
    for row in results["rows"]:
        assert row["steps"] == 2 and row["step_s"] > 0 and row["load_before"] and row["load_after"]
    # The ring formula: 2 (W-1)/W * 4n = 4n at 2 ranks; the wire adds headers and ACKs (and the
    # counters only ever add), but within the window nothing else of size.
    assert ddp["hook_bytes"] == 4 * n
    assert 1.0 <= ddp["wire_tx_bytes"] / ddp["hook_bytes"] < 1.3
    assert ddp["replay_tx_bytes"] == pytest.approx(ddp["wire_tx_bytes"], rel=0.15)
    # GTC: the hook's count (header + words) is on the wire too; a small message is mostly headers.
    assert gtc["words"] > 0
    assert gtc["hook_bytes"] == pytest.approx(scaling.HEADER_BYTES + 4 * gtc["words"], rel=1e-6)
    assert gtc["wire_tx_bytes"] >= gtc["hook_bytes"]
    assert nocomm["wire_tx_bytes"] < 1000 and nocomm["hook_bytes"] == 0
    # compute is nocomm's step; comm the rest
    assert ddp["compute_s"] == nocomm["step_s"] and ddp["comm_s"] == pytest.approx(
        ddp["step_s"] - nocomm["step_s"]
    )
    # start-up traffic (DDP's parameter broadcast, rendezvous, warm-up steps) is outside the window
    cluster_tx = sum(node["tx_bytes"] for node in results["configs"][1]["cluster"]["nodes"]) / 2
    assert cluster_tx > sum(r["wire_tx_bytes"] * r["steps"] for r in (ddp, gtc, nocomm))
    # the model was calibrated on the replays and predicted each step
    assert results["model"]["samples"] == 2 and len(results["model"]["predictions"]) == 2
    table = (out / "table.md").read_text()
    assert "| 2x16:8 | 2 | 1gbit | gtc |" in table and "Scaling model calibrated" in table
    assert (out / "bench_cluster.png").stat().st_size > 0
    # the projection to 1-128 nodes from the single-device step and the 2-worker GTC measurements
    (name,) = results["projections"]
    assert [r["nodes"] for r in results["projections"][name]["rows"]] == list(scaling.NODES)
    assert "Projection, 2x16:8" in table
    # --resume keeps what was measured with the same settings and measures nothing again
    code = bench_cluster.main([*argv, "--resume"])
    again = capsys.readouterr()
    assert code == 0, again.out[-3000:] + again.err[-3000:]
    assert "--resume: keeping 2 configurations" in again.out
    resumed = json.loads((out / "results.json").read_text())
    assert resumed["configs"] == results["configs"] and resumed["started"] == results["started"]
    with pytest.raises(SystemExit) as other:
        bench_cluster.main([*argv, "--resume", "--batch", "8"])
    assert other.value.code == 2 and "other settings (batch)" in capsys.readouterr().err


def test_overlapped_exchange_is_added_to_the_step_where_no_core_is_spare():
    """dpsgd and gtc_stale overlap their exchange with compute only on a host with a core beside every
    worker's threads; on the 2-core host of the published run, with 2 and 4 workers, it adds."""
    published = json.loads((Path(__file__).resolve().parents[1] / "docs" / "benchmarks" / "bench_cluster.json").read_text())
    rows = {(r["model"], r["world"], r["rate"], r["strategy"]): r for r in published["rows"]}
    shared = bench_cluster.calibrate(published["rows"], published["configs"], cpus=2, threads=1)
    spare = bench_cluster.calibrate(published["rows"], published["configs"], cpus=64, threads=1)
    checked = 0
    for a, b in zip(shared["predictions"], spare["predictions"], strict=True):
        row = rows[a["model"], a["world"], a["rate"], a["strategy"]]
        work = row["compute_s"] + row["codec_s"]
        assert a["step_s"] == pytest.approx(work + a["comm_s"])
        if row["base"] in scaling.OVERLAPPED:
            assert b["step_s"] == pytest.approx(max(work, b["comm_s"]))
            checked += 1
        else:
            assert b["step_s"] == a["step_s"]
    assert checked == 24  # dpsgd and gtc_stale, 2 models x 2 world sizes x 3 rates


def test_sync_arithmetic_is_added_once_per_period_with_as_many_ranks_doing_it():
    """ma, bmuf and bmuf_gtc pay their sync's own arithmetic (flat copies, BMUF's block update) once per
    period, measured with as many processes at once as the row has ranks doing it: all ranks, or one
    representative per group for bmuf_gtc. The published run carries those measurements."""
    published = json.loads((Path(__file__).resolve().parents[1] / "docs" / "benchmarks" / "bench_cluster.json").read_text())
    sync_work = published["sync_work"]
    rows = {(r["model"], r["world"], r["rate"], r["strategy"]): r for r in published["rows"]}
    plain = bench_cluster.calibrate(published["rows"], published["configs"], cpus=2, threads=1)
    synced = bench_cluster.calibrate(published["rows"], published["configs"], cpus=2, threads=1, sync_work=sync_work)
    checked = 0
    for a, b in zip(plain["predictions"], synced["predictions"], strict=True):
        row = rows[a["model"], a["world"], a["rate"], a["strategy"]]
        if row["base"] in scaling.SYNCING:
            ranks = row["world"] // 2 if row["base"] == "bmuf_gtc" else row["world"]
            assert bench_cluster.sync_ranks(row) == ranks
            extra = sync_work[row["model"]][str(ranks)][row["base"]] / row["facts"]["period"]
            assert extra > 0 and b["step_s"] == pytest.approx(a["step_s"] + extra)
            checked += 1
        else:
            assert b["step_s"] == a["step_s"]
    assert checked == 30  # ma and bmuf: 2 models x 2 world sizes x 3 rates; bmuf_gtc: 4 workers only
    assert published["model"]["predictions"] == synced["predictions"]


def test_measure_sync_work_times_each_scheme_in_one_or_several_processes():
    for processes in (1, 2):
        work = bench_cluster.measure_sync_work((2, 16, 8), repeats=2, processes=processes)
        assert set(work) == {"ma", "bmuf", "bmuf_gtc"} and all(v > 0 for v in work.values())
    with pytest.raises(ValueError, match="processes 0"):
        bench_cluster.measure_sync_work((2, 16, 8), processes=0)


def test_replay_of_powersgd_and_gtc_update_is_what_they_send():
    """The replay and the model run what each strategy sent: PowerSGD the all-reduces its hook issued
    (their measured bytes, from the row's facts; none measured, no replay), gtc_update the non-finite
    flags' all-reduce (one int64 a rank), then the header and the words at their coded bytes per word."""
    assert bench_cluster.build_strategy("gtc_update", 0.02, {}).compress == "update"
    sizes = [40, 160, 2848]
    row = {"base": "powersgd_r1", "world": 4, "weights": 10**6, "words": None, "facts": {"allreduces": sizes}}
    assert bench_cluster._collectives_of(row) == [scaling.Collective("allreduce", size, 4) for size in sizes]
    assert scaling.collectives("powersgd_r4", 4, scaling.Messages(numel=10**6)) is None
    row = {"base": "gtc_update", "world": 4, "weights": 10**6, "words": 3000.0, "word_bytes": 1.2, "facts": {}}
    assert bench_cluster._collectives_of(row) == [
        scaling.Collective("allreduce", 32, 4), scaling.Collective("alltoall", scaling.HEADER_BYTES, 4),
        scaling.Collective("alltoall", 1.2 * 3000.0, 4)]  # fmt: skip
    assert "gtc_update" in bench_cluster.GTC_LIKE  # its bytes per word are read from its statistics
