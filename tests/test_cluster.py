"""The emulated cluster: namespaces joined by shaped links, the multi-node environment, the byte
counts in cluster.json, and teardown after success, failure, timeout, Ctrl-C and a killed tool.

Everything that builds namespaces needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN) and a kernel
that lets ``ip netns add`` work; those tests skip with the reason otherwise. The option checks run
anywhere. Node programs are tiny (``python -c`` or a short script), so the module takes ~30 s.
"""

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gtc_lightning.tools import cluster
from gtc_lightning.tools.cluster import Cluster, parse_rate

ROOT = Path(__file__).resolve().parents[1]
# The module run as a file: the same CLI without importing the package (and Lightning) first.
CLUSTER_PY = str(ROOT / "gtc_lightning" / "tools" / "cluster.py")
PY = sys.executable


def _sh(*args: str) -> str:
    return subprocess.run(args, check=False, capture_output=True, text=True).stdout


def _network_state(others: frozenset[str] = frozenset()) -> dict[str, object]:
    """What a run must leave as it found it: namespaces, root links, every route table, lock files.

    Things of the runs named in ``others`` (prefixes of other clusters alive on this kernel, e.g. a
    benchmark beside the tests) are left out: they come and go on their own.
    """
    def mine(line: str) -> bool:
        return not any(f"{o}-" in line or f"{o}." in line or f"metric {o[4:]} " in line for o in others)

    return {
        "namespaces": sorted(line.split()[0] for line in _sh("ip", "netns", "list").splitlines()
                             if line and mine(line)),
        "links": sorted(line.split()[0] for line in _sh("ip", "-br", "link").splitlines() if line),
        "routes": sorted(r for r in _sh("ip", "route", "show", "table", "all").splitlines() if mine(r + " ")),
        "locks": sorted(p.name for p in cluster.LOCK_DIR.glob("gtcc*.lock") if mine(p.name))
        if cluster.LOCK_DIR.is_dir() else [],
    }


def _live_runs() -> frozenset[str]:
    """Prefixes of other clusters alive now (what a dead run left is removed by the fixture first)."""
    namespaces, routes = cluster._prefix_leftovers()
    prefixes = {cluster._NAME.match(n).group(1) for n in namespaces} | {f"gtcc{r['metric']}" for r in routes}
    if cluster.LOCK_DIR.is_dir():
        prefixes |= {p.stem for p in cluster.LOCK_DIR.glob("gtcc*.lock")}
    return frozenset(p for p in prefixes if cluster._owner_alive(p))


def _ours(pid: int) -> bool:
    """``pid`` is this process or one of its descendants (a cluster this test's code started)."""
    me = os.getpid()
    while pid > 1:
        if pid == me:
            return True
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (FileNotFoundError, IndexError, ValueError):
            return False
    return False


def _foreign_runs() -> frozenset[str]:
    """Live clusters whose owner is not of this process tree: another job that started during the test."""
    return frozenset(p for p in _live_runs() if not _ours(int(p[4:])))


def _netns_problem() -> str | None:
    problem = cluster.missing_privileges() or cluster.missing_tools()
    if problem:
        return problem
    probe = f"gtcc{os.getpid()}-probe"
    proc = subprocess.run(["ip", "netns", "add", probe], check=False, capture_output=True, text=True)
    if proc.returncode != 0:
        return f"`ip netns add` fails here: {proc.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=False)
    return None


@pytest.fixture
def netns():
    """Skip without namespaces; afterwards, nothing of the test's clusters may be left."""
    problem = _netns_problem()
    if problem:
        pytest.skip(f"needs network namespaces: {problem}")
    cluster.cleanup_leftovers()  # what killed runs left earlier (a live run's things are kept)
    others = _live_runs()
    before = _network_state(others)
    yield
    # A cluster another job (a benchmark, a second test run) started meanwhile is not this test's;
    # one this process tree started and left, alive or dead, is.
    assert _network_state(others | _foreign_runs()) == before
    assert "MASTER_PORT" not in os.environ and "NODE_RANK" not in os.environ


def _alive(pid: int) -> bool:
    """Running, not a zombie (an orphan's zombie waits for pid 1, which may never reap it here)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, IndexError):
        return False


def _start_cli(args: list[str], command: list[str]) -> subprocess.Popen:
    """The CLI in a subprocess, read until the processes have started."""
    proc = subprocess.Popen([PY, CLUSTER_PY, *args, "--", *command], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "logs and cluster.json in" in line:
            return proc
    raise AssertionError("the CLI never started the processes:\n" + "".join(lines))


def _wait_for_files(paths: list[Path], seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not all(p.exists() and p.read_text().strip() for p in paths):
        assert time.monotonic() < deadline, f"no {paths} after {seconds} s"
        time.sleep(0.05)


# A node program that records its pid, ignores SIGTERM (as a rank blocked in gloo does) and sleeps.
STUBBORN = ("import os, pathlib, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "pathlib.Path(sys.argv[1] + os.environ['NODE_RANK']).write_text(str(os.getpid())); time.sleep(60)")


# ------------------------------------------------------------------------------ runs on two nodes

GLOO = """\
import os, time
import torch
import torch.distributed as dist

dist.init_process_group("gloo")  # env://: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE from the cluster
x = torch.full((1_000_000,), float(dist.get_rank() + 1))
start = time.perf_counter()
dist.all_reduce(x)
print(f"node {os.environ['NODE_RANK']} arg {sys_arg} if {os.environ['GLOO_SOCKET_IFNAME']} "
      f"master {os.environ['MASTER_ADDR']} local {os.environ['LOCAL_RANK']} sum {x.min().item()} "
      f"{x.max().item()} seconds {time.perf_counter() - start:.3f}")
dist.destroy_process_group()
"""


def test_gloo_all_reduce_across_namespaces_counts_the_payload(netns, tmp_path):
    script = tmp_path / "all_reduce.py"
    script.write_text("import sys\nsys_arg = sys.argv[1]\n" + GLOO)
    with Cluster(nodes=2, rate="100mbit") as c:
        result = c.run([PY, str(script), "{node_rank}"], tmp_path / "out", timeout=120)
    assert result.ok and result.exit_code == 0
    for k in range(2):
        log = (tmp_path / "out" / f"node{k}.log").read_text()
        assert f"node {k} arg {k} if veth{k} master 10.213.0.1 local 0 sum 3.0 3.0" in log, log
    record = json.loads((tmp_path / "out" / "cluster.json").read_text())
    assert record["schema"] == "gtc_lightning.cluster/1" and record["status"] == "ok"
    assert record["config"]["rate_bits_per_s"] == 100_000_000 and record["config"]["world_size"] == 2
    # A 2-rank all-reduce of n float32 sends n * 4 bytes each way (2 (W-1)/W 4n); headers add ~3 %.
    payload = 1_000_000 * 4
    for node in record["nodes"]:
        assert node["exit_code"] == 0 and [p["exit_code"] for p in node["processes"]] == [0]
        assert node["tx_bytes"] == node["counters_after"]["tx_bytes"] - node["counters_before"]["tx_bytes"]
        assert payload <= node["tx_bytes"] < 1.1 * payload, node
        assert payload <= node["rx_bytes"] < 1.1 * payload, node
    assert record["total"]["tx_bytes"] == sum(n["tx_bytes"] for n in record["nodes"])


TRANSFER = """\
import os, socket, sys, time

size, port, master = int(sys.argv[1]), 29600, os.environ["MASTER_ADDR"]
if os.environ["NODE_RANK"] == "0":
    server = socket.create_server((master, port))
    conn, _ = server.accept()
    start, got = time.perf_counter(), 0
    while chunk := conn.recv(1 << 16):
        got += len(chunk)
    print(f"received {got} bytes in {time.perf_counter() - start:.3f} s", flush=True)
else:
    deadline = time.monotonic() + 20
    while True:
        try:
            conn = socket.create_connection((master, port))
            break
        except OSError:
            assert time.monotonic() < deadline, "node 0 never listened"
            time.sleep(0.02)
    conn.sendall(b"x" * size)
    conn.close()
"""


def _transfer_seconds(c: Cluster, script: Path, out: Path, size: int) -> float:
    result = c.run([PY, str(script), str(size)], out, timeout=60, stream=False)
    assert result.ok, (out / "node0.log").read_text()
    words = (out / "node0.log").read_text().split()
    assert int(words[1]) == size
    assert result.nodes[1].tx_bytes >= size
    return float(words[4])


def test_tbf_shapes_both_ways_and_set_rate_changes_it(netns, tmp_path):
    script = tmp_path / "transfer.py"
    script.write_text(TRANSFER)
    size = 2_000_000
    with Cluster(nodes=2, rate="10mbit") as c:
        shaped = _transfer_seconds(c, script, tmp_path / "10mbit", size)
        for ns, dev in [*zip(c.namespaces, c.interfaces), *((c.bridge_namespace, p) for p in c.ports)]:
            assert "tbf" in _sh("tc", "-n", ns, "qdisc", "show", "dev", dev) and "10Mbit" in _sh(
                "tc", "-n", ns, "qdisc", "show", "dev", dev)
        c.set_rate("none")
        assert "tbf" not in _sh("tc", "-n", c.namespaces[0], "qdisc", "show", "dev", c.interfaces[0])
        unshaped = _transfer_seconds(c, script, tmp_path / "none", size)
    # 2 MB at 10 Mbit/s, less the 256 KiB tbf bucket that starts full: ~1.4 s.
    assert shaped >= 1.2, shaped
    assert unshaped < 0.5, unshaped


LIGHTNING = """\
import sys

import lightning as L
import torch


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


torch.manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
trainer = L.Trainer(accelerator="cpu", devices=1, num_nodes=int(sys.argv[1]), strategy="ddp", max_steps=2,
                    logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False)
trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=8))
weight = trainer.lightning_module.layer.weight.sum().item()
print(f"rank {trainer.global_rank} of {trainer.world_size} step {trainer.global_step} weight {weight:.8f}")
"""


def test_lightning_ddp_runs_on_two_nodes_through_the_cli(netns, tmp_path, capsys, monkeypatch):
    """The command line's ``main`` in this process (its ``python -m`` entry runs in test_site_pages):
    the two nodes' processes are the only ones that start Lightning."""
    script = tmp_path / "tiny.py"
    script.write_text(LIGHTNING)
    out = tmp_path / "out"
    monkeypatch.chdir(ROOT)
    code = cluster.main(["--nodes", "2", "--rate", "100mbit", "--out", str(out), "--timeout", "300", "--", PY,
                         str(script), "{num_nodes}"])
    printed = capsys.readouterr()
    assert code == 0, printed.out + printed.err
    assert "[node0] rank 0 of 2 step 2" in printed.out  # node 0 streamed, prefixed
    weights = set()
    for k in range(2):
        line = next(x for x in (out / f"node{k}.log").read_text().splitlines() if x.startswith("rank "))
        assert line.startswith(f"rank {k} of 2 step 2"), line
        weights.add(line.split()[-1])
    assert len(weights) == 1  # DDP over the link kept the replicas identical
    record = json.loads((out / "cluster.json").read_text())
    assert record["status"] == "ok" and record["command"][-1] == "{num_nodes}"
    assert all(node["tx_bytes"] > 0 for node in record["nodes"])


def test_devices_per_node_sets_ranks_and_logs(netns, tmp_path):
    show = "import os; print(*(os.environ[k] for k in ('NODE_RANK', 'LOCAL_RANK', 'RANK', 'WORLD_SIZE')))"
    with Cluster(nodes=2, rate="none", devices_per_node=2) as c:
        result = c.run([PY, "-c", show], tmp_path, stream=False)
    assert result.ok
    for node in range(2):
        for local in range(2):
            text = (tmp_path / f"node{node}-local{local}.log").read_text().split()
            assert text == [str(node), str(local), str(2 * node + local), "4"]


# ---------------------------------------------------------------------------- failure and teardown


def test_failed_node_is_named_and_the_others_are_stopped(netns, tmp_path, capfd):
    fail_on_1 = f"import os, sys; sys.exit(3) if os.environ['NODE_RANK'] == '1' else exec({STUBBORN!r})"
    with Cluster(nodes=2, rate="100mbit") as c:
        start = time.monotonic()
        result = c.run([PY, "-c", fail_on_1, str(tmp_path / "pid")], tmp_path, grace=0.5, kill_after=0.5)
    assert time.monotonic() - start < 15
    assert result.status == "failed" and result.exit_code == 1
    assert result.nodes[1].exit_code == 3 and result.nodes[1].processes[0].stopped_by is None
    # node 0 ignored SIGTERM: SIGKILL ended it
    assert result.nodes[0].exit_code == -signal.SIGKILL and result.nodes[0].processes[0].stopped_by == "peer_failed"
    err = capfd.readouterr().err
    assert f"FAILED: node 1 local rank 0 exit 3; log {tmp_path / 'node1.log'}" in err
    assert json.loads((tmp_path / "cluster.json").read_text())["nodes"][1]["exit_code"] == 3


def test_timeout_escalates_sigterm_to_sigkill(netns, tmp_path):
    with Cluster(nodes=2, rate="100mbit") as c:
        result = c.run([PY, "-c", STUBBORN, str(tmp_path / "pid")], tmp_path, timeout=1.5, kill_after=0.5)
    assert result.status == "timeout" and result.exit_code == 124
    for k, node in enumerate(result.nodes):
        assert node.exit_code == -signal.SIGKILL and node.processes[0].stopped_by == "timeout"
        assert not _alive(int((tmp_path / f"pid{k}").read_text()))


def test_ctrl_c_stops_the_nodes_and_tears_down(netns, tmp_path):
    proc = _start_cli(["--nodes", "2", "--rate", "1gbit", "--out", str(tmp_path), "--kill-after", "0.5"],
                      [PY, "-c", STUBBORN, str(tmp_path / "pid")])
    pid_files = [tmp_path / "pid0", tmp_path / "pid1"]
    _wait_for_files(pid_files)
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=30)
    assert proc.returncode == 130, rest
    assert "torn down" in rest
    assert all(not _alive(int(p.read_text())) for p in pid_files)
    record = json.loads((tmp_path / "cluster.json").read_text())
    assert record["status"] == "interrupted" and record["exit_code"] == 130
    assert {p["stopped_by"] for n in record["nodes"] for p in n["processes"]} == {"interrupted"}


def test_cleanup_removes_what_a_killed_tool_left(netns, tmp_path):
    proc = _start_cli(["--nodes", "2", "--rate", "1gbit", "--out", str(tmp_path)],
                      [PY, "-c", STUBBORN, str(tmp_path / "pid")])
    pid_files = [tmp_path / "pid0", tmp_path / "pid1"]
    _wait_for_files(pid_files)
    proc.kill()  # no teardown can run
    proc.communicate()
    prefix = f"gtcc{proc.pid}"
    assert f"{prefix}-n0" in _sh("ip", "netns", "list")
    assert f"metric {proc.pid}" in _sh("ip", "route", "show", "proto", str(cluster.ROUTE_PROTO))
    removed = [line for line in cluster.cleanup_leftovers() if prefix in line or f"metric {proc.pid}" in line]
    assert len(removed) == 4, removed  # 2 node namespaces, the bridge's, the route
    assert all(not _alive(int(p.read_text())) for p in pid_files)  # orphaned ranks killed
    assert not [line for line in cluster.cleanup_leftovers() if prefix in line]


def test_a_cluster_another_job_starts_meanwhile_is_not_the_tests(netns, tmp_path):
    """The teardown check leaves out clusters started outside this process tree during the test."""
    sleeper = [PY, "-c", ("import os, pathlib, sys, time; "
                          "pathlib.Path(sys.argv[1] + os.environ['NODE_RANK']).write_text(str(os.getpid())); "
                          "time.sleep(60)")]
    # Another job's CLI: started through a shell that exits at once, so it is no descendant of ours.
    detached = shlex.join([PY, CLUSTER_PY, "--nodes", "2", "--rate", "none", "--out", str(tmp_path / "other"),
                           "--", *sleeper, str(tmp_path / "other_pid")])
    pid = int(subprocess.run(["sh", "-c", f"{detached} >{tmp_path / 'other.log'} 2>&1 & echo $!"],
                             check=True, capture_output=True, text=True).stdout)
    mine = _start_cli(["--nodes", "2", "--rate", "none", "--out", str(tmp_path / "mine")],
                      [*sleeper, str(tmp_path / "mine_pid")])
    try:
        _wait_for_files([tmp_path / "other_pid0", tmp_path / "other_pid1", tmp_path / "mine_pid0",
                         tmp_path / "mine_pid1"], seconds=60)
        live = _live_runs()
        assert {f"gtcc{pid}", f"gtcc{mine.pid}"} <= live
        assert f"gtcc{pid}" in _foreign_runs() and f"gtcc{mine.pid}" not in _foreign_runs()
    finally:
        for proc_pid in (pid, mine.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc_pid, signal.SIGINT)
        mine.communicate(timeout=30)
        deadline = time.monotonic() + 30
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
    assert mine.returncode == 130 and not _alive(pid)
    assert f"gtcc{pid}" not in _live_runs() and "torn down" in (tmp_path / "other.log").read_text()


def test_a_failing_setup_leaves_nothing(netns, monkeypatch):
    real_sh = cluster._sh

    def fail_on_second_node(*args, **kwargs):
        if args[:3] == ("ip", "netns", "add") and args[3].endswith("-n1"):
            raise RuntimeError("injected")
        return real_sh(*args, **kwargs)

    monkeypatch.setattr(cluster, "_sh", fail_on_second_node)
    with pytest.raises(RuntimeError, match="injected"), Cluster(nodes=3, rate="100mbit"):
        pass


# ------------------------------------------------------------------------------------------ options


@pytest.mark.parametrize("rate, bits", [("100mbit", 10**8), ("1gbit", 10**9), ("10gbit", 10**10),
                                        ("12.5mbps", 10**8), ("none", None), ("NONE", None)])
def test_parse_rate(rate, bits):
    assert parse_rate(rate) == bits


@pytest.mark.parametrize("argv, message", [
    (["--rate", "fast"], "rate 'fast' is not a positive number with a unit such as 100mbit"),
    (["--rate", "100mb"], "rate '100mb'"),
    (["--nodes", "0"], "nodes=0: need 1 to 250 nodes"),
    (["--burst", "1kb"], "burst '1kb' = 1024 bytes holds less than one packet"),
    (["--subnet", "8.8.8.0/24"], "subnet '8.8.8.0/24': need a private IPv4 network"),
    (["--subnet", "10.0.0.0/30", "--nodes", "3"], "room for 3 hosts"),
    (["--tbf-latency", "soon"], "time 'soon'"),
])
def test_bad_options_name_the_value_and_exit_2(argv, message, capsys):
    assert cluster.main([*argv, "--", "true"]) == 2
    assert message in capsys.readouterr().err


def test_without_root_says_what_is_missing(monkeypatch, capsys):
    monkeypatch.setattr(cluster.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(cluster, "_effective_capabilities", lambda: 0)
    assert cluster.main(["--nodes", "2", "--", "true"]) == 2
    err = capsys.readouterr().err
    assert "needs root, or CAP_NET_ADMIN and CAP_SYS_ADMIN" in err and "uid 1000" in err
    with pytest.raises(PermissionError, match="needs root"):
        Cluster(nodes=2).start()


def test_a_command_is_required(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cluster.main(["--nodes", "2"])
    assert exit_info.value.code == 2 and "give the command to run after `--`" in capsys.readouterr().err


def test_help_states_that_no_delay_is_emulated(capsys):
    with pytest.raises(SystemExit):
        cluster.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "netem is absent from this kernel" in text and "no propagation delay can be added" in text
    assert "{num_nodes}" in text
