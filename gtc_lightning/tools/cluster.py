"""Emulated cluster: run any training command on N network namespaces of this machine.
Long file: one tool with its whole life cycle (set-up, shaping, the run, teardown after a kill, cleanup).

    python -m gtc_lightning.tools.cluster --nodes 4 --rate 1gbit -- \\
        python recipes/asr/train.py --strategy gtc --trainer.num_nodes 4 --trainer.devices 1
    python -m gtc_lightning.tools.cluster --cleanup       # remove what killed runs left behind

Topology (every address lives only inside namespaces the tool creates)::

    <prefix>-n0: veth0 10.213.0.1 ──tbf──┐
    <prefix>-n1: veth1 10.213.0.2 ──tbf──┤  <prefix>-br: br0 (ports port0..portN-1, tbf on each)
    ...                                  ┘

Each node's link is shaped in both directions with ``tc qdisc ... tbf``: on the node's veth (what
the node sends) and on its bridge port (what it receives). Added propagation delay cannot be
emulated on this kernel: netem (and fq/etf, which could delay by timestamp) are not built in, so
the links have the bandwidth asked for and the sub-millisecond latency of veth. The root namespace
gets a blackhole route for the subnet, so nothing in it can leak out through the default route.

On node k the command runs under ``ip netns exec`` with the variables Lightning's
``LightningEnvironment`` reads (``MASTER_ADDR``, ``MASTER_PORT``, ``NODE_RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``; ``RANK`` too, for plain ``torch.distributed`` programs) and
``GLOO_SOCKET_IFNAME``. No training code path is special: Lightning's own multi-node path runs,
over gloo. The command must say how many nodes there are (``--trainer.num_nodes N``); the
placeholders ``{num_nodes}``, ``{node_rank}``, ``{local_rank}``, ``{rank}``,
``{devices_per_node}`` and ``{world_size}`` are replaced in every argument.

Each run writes ``<out>/node<k>.log`` (``node<k>-local<l>.log`` with several processes per node)
and ``<out>/cluster.json``: the configuration, per-process exit codes and wall times, and the
bytes each node's veth counted (``/sys/class/net/<dev>/statistics`` inside its namespace).

The Python API keeps one cluster up for several commands::

    with Cluster(nodes=2, rate="100mbit") as cluster:
        result = cluster.run(["python", "train.py", "--trainer.num_nodes", "2"], out="exp/c/100m")
        cluster.set_rate("1gbit")
        result = cluster.run([...], out="exp/c/1g")
        print(result.status, result.total["tx_bytes"])
        cluster.set_rate("100mbit", nodes=[1])      # one slow link: a straggler
        cluster.set_link(1, up=False)               # node 1 cut off (``ip link set veth1 down``)
"""

from __future__ import annotations

import argparse
import codecs
import datetime
import fcntl
import ipaddress
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from typing_extensions import Self

ROUTE_PROTO = 213  # marks our blackhole routes in the root namespace; the metric is the owner's pid
LOCK_DIR = Path("/run/gtc_cluster")  # one flock'ed file per live run: a free lock means a dead owner
_NAME = re.compile(r"^(gtcc\d+)-(n\d+|br)$")
_CAP_NET_ADMIN, _CAP_SYS_ADMIN = 12, 21
# A launcher's variables the parent may carry; any of them makes Lightning pick another environment.
_FOREIGN_LAUNCHER_VARS = ("TORCHELASTIC_RUN_ID", "GROUP_RANK", "LOCAL_WORLD_SIZE", "SLURM_NTASKS", "SLURM_JOB_NAME")
_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
               "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12}  # tc: "bps" = bytes/s
_SIZE_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1024, "m": 2**20, "mb": 2**20, "g": 2**30, "gb": 2**30,
               "kbit": 1024 / 8, "mbit": 2**20 / 8, "gbit": 2**30 / 8}  # as tc reads sizes
_TIME_UNITS = {"s": 1, "sec": 1, "ms": 1e-3, "msec": 1e-3, "us": 1e-6, "usec": 1e-6}
_PLACEHOLDERS = ("num_nodes", "node_rank", "local_rank", "rank", "devices_per_node", "world_size")


def say(message: str) -> None:
    """What the tool is doing, on stderr (node 0's output goes to stdout)."""
    print(f"[cluster] {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------- parsing


def parse_rate(rate: str) -> int | None:
    """``"100mbit"`` -> 100000000 bits/s; ``"none"`` -> None (unshaped). Units as tc reads them."""
    text = str(rate).strip().lower()
    if text == "none":
        return None
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([a-z]+)", text)
    if not match or match.group(2) not in _RATE_UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"rate {rate!r} is not a positive number with a unit such as 100mbit, 1gbit, "
                         f"10gbit (units: {', '.join(_RATE_UNITS)}), or 'none' for unshaped links")
    return round(float(match.group(1)) * _RATE_UNITS[match.group(2)])


def parse_size(size: str) -> int:
    """``"256kb"`` -> 262144 bytes (tc's reading: kb = 1024 bytes, kbit = 128 bytes)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([a-z]*)", str(size).strip().lower())
    if not match or match.group(2) not in _SIZE_UNITS:
        raise ValueError(f"size {size!r} is not a number of bytes with an optional unit such as 256kb, "
                         f"1mb, 2mbit (units: {', '.join(u for u in _SIZE_UNITS if u)})")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2)])


def parse_time(duration: str) -> float:
    """``"100ms"`` -> 0.1 seconds."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([a-z]+)", str(duration).strip().lower())
    if not match or match.group(2) not in _TIME_UNITS:
        raise ValueError(f"time {duration!r} is not a number with a unit such as 100ms, 1s, 500us")
    return float(match.group(1)) * _TIME_UNITS[match.group(2)]


# -------------------------------------------------------------------------------------- privileges


def _effective_capabilities() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


def missing_privileges() -> str | None:
    """None when this process may build namespaces and links, else what is missing and how to run."""
    if os.geteuid() == 0:
        return None
    caps = _effective_capabilities()
    missing = [name for name, bit in (("CAP_NET_ADMIN", _CAP_NET_ADMIN), ("CAP_SYS_ADMIN", _CAP_SYS_ADMIN))
               if not caps >> bit & 1]
    if not missing:
        return None
    return (f"gtc_lightning.tools.cluster needs root, or {' and '.join(missing)}, to create network namespaces, "
            f"veth links and tc qdiscs (running as uid {os.geteuid()} without them). Run it as root, "
            f"e.g. `sudo .venv/bin/python -m gtc_lightning.tools.cluster ...`, or in a container started with "
            f"--cap-add NET_ADMIN --cap-add SYS_ADMIN")


def missing_tools() -> str | None:
    """None when ``ip`` and ``tc`` (iproute2) are on PATH, else the fix."""
    absent = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if absent:
        return f"{' and '.join(absent)} not found on PATH; install iproute2 (apt-get install iproute2)"
    return None


def _sh(*args: str, check: bool = True) -> str:
    proc = subprocess.run(args, check=False, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`{shlex.join(args)}` failed with exit {proc.returncode}: {proc.stderr.strip()}")
    return proc.stdout


# ----------------------------------------------------------------------------------------- signals


class Interrupted(KeyboardInterrupt):
    """SIGINT, SIGTERM or SIGHUP arrived; ``signum`` says which."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _raise_interrupted(signum: int, _frame: Any) -> None:
    raise Interrupted(signum)


def _set_handlers(handler: Any) -> dict[int, Any] | None:
    """Install ``handler`` for SIGINT/SIGTERM/SIGHUP; returns the old ones (None off the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return {sig: signal.signal(sig, handler) for sig in _SIGNALS}


def _restore_handlers(old: dict[int, Any] | None) -> None:
    for sig, handler in (old or {}).items():
        signal.signal(sig, handler)


@contextmanager
def _signals_deferred(hurry: threading.Event) -> Iterator[None]:
    """While stopping and tearing down, a signal must not abort the clean-up: it only sets ``hurry``
    (skip the rest of the SIGTERM grace period and SIGKILL at once)."""

    def handler(signum: int, _frame: Any) -> None:
        hurry.set()
        say(f"{signal.Signals(signum).name} while stopping: killing now, then tearing down")

    old = _set_handlers(handler)
    try:
        yield
    finally:
        _restore_handlers(old)


# ------------------------------------------------------------------------------------------ results


@dataclass
class ProcessResult:
    """One process of a run: node ``node_rank``, ``LOCAL_RANK`` ``local_rank``."""

    node_rank: int
    local_rank: int
    rank: int  # global rank, node_rank * devices_per_node + local_rank
    exit_code: int | None  # negative: killed by that signal (-9 = SIGKILL)
    wall_s: float
    stopped_by: str | None  # None (ended by itself), "timeout", "peer_failed" or "interrupted"
    log: str
    ended_at: float | None = None  # Unix time the tool saw it end (polled every 50 ms)


@dataclass
class NodeResult:
    """One node of a run: its processes and the bytes its veth counted during the run."""

    node_rank: int
    namespace: str
    interface: str
    address: str
    exit_code: int  # the first non-zero exit code of its processes, else 0
    wall_s: float  # the longest of its processes
    tx_bytes: int  # counted by the node's veth between before and after the run (headers included)
    rx_bytes: int
    tx_packets: int
    rx_packets: int
    counters_before: dict[str, int]
    counters_after: dict[str, int]
    processes: list[ProcessResult] = field(default_factory=list)


@dataclass
class RunResult:
    """What ``Cluster.run`` returns and writes to ``<out>/cluster.json`` (plus ``config``)."""

    status: str  # "ok", "failed" (a process exited non-zero), "timeout" or "interrupted"
    exit_code: int  # the CLI's: 0 ok, 1 failed, 124 timeout, 128 + signal number interrupted
    command: list[str]
    out: str
    started_at: str
    wall_s: float
    timeout_s: float
    config: dict[str, Any]
    nodes: list[NodeResult]
    total: dict[str, int]  # tx/rx bytes and packets summed over nodes

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_json(self) -> dict[str, Any]:
        return {"schema": "gtc_lightning.cluster/1", **asdict(self)}


# ------------------------------------------------------------------------------------------ cluster


class Cluster:
    """N emulated nodes: network namespaces joined by tbf-shaped veth links to a bridge.

    Args:
        nodes: number of namespaces (nodes), 1 to 250.
        rate: link rate both ways, as tc reads it (``100mbit``, ``1gbit``, ``10gbit``) or ``none``.
        devices_per_node: processes per node (``LOCAL_RANK`` 0..G-1); the command must say
            ``--trainer.devices G``.
        burst: tbf bucket size (``256kb`` = 256 KiB); at least one packet.
        tbf_latency: tbf queue limit expressed as the longest a packet may wait (not a delay).
        mtu: MTU of every veth and the bridge.
        subnet: a private IPv4 network for the nodes' addresses (node k gets host k+1).
        master_port: ``MASTER_PORT`` (every namespace is fresh, so any port is free).
        verbose: print the plan, each run's start and summary, and the teardown (problems are
            always printed).
    """

    _active: Cluster | None = None  # one per process: names and the route's metric come from the pid

    def __init__(
        self,
        nodes: int = 2,
        rate: str = "1gbit",
        *,
        devices_per_node: int = 1,
        burst: str = "256kb",
        tbf_latency: str = "100ms",
        mtu: int = 1500,
        subnet: str = "10.213.0.0/24",
        master_port: int = 29500,
        verbose: bool = True,
    ):
        if not isinstance(nodes, int) or not 1 <= nodes <= 250:
            raise ValueError(f"nodes={nodes!r}: need 1 to 250 nodes (one namespace and address each)")
        if not isinstance(devices_per_node, int) or devices_per_node < 1:
            raise ValueError(f"devices_per_node={devices_per_node!r}: need at least 1 process per node")
        if not 576 <= mtu <= 65535:
            raise ValueError(f"mtu={mtu}: need 576 to 65535 bytes")
        if not 1 <= master_port <= 65535:
            raise ValueError(f"master_port={master_port}: need a TCP port, 1 to 65535")
        try:
            network = ipaddress.ip_network(subnet)
        except ValueError as err:
            raise ValueError(f"subnet {subnet!r} is not an IPv4 network like 10.213.0.0/24 ({err})") from None
        if network.version != 4 or not network.is_private or network.num_addresses - 2 < nodes:
            raise ValueError(f"subnet {subnet!r}: need a private IPv4 network with room for {nodes} hosts, "
                             f"e.g. 10.213.0.0/24")
        # Hyper-parameters of the links.
        self.nodes, self.devices_per_node, self.mtu = nodes, devices_per_node, mtu
        self.world_size = nodes * devices_per_node
        self.subnet, self.master_port = network, master_port
        self._say = say if verbose else _quiet
        self.rate, self.rate_bits, self.burst_bytes, self.tbf_latency_s = "none", None, 0, 0.0
        self._check_shaping(rate, burst, tbf_latency)
        self._rate, self._burst, self._tbf_latency = rate, burst, tbf_latency
        # Names: unique per process, recognisable by --cleanup.
        self.prefix = f"gtcc{os.getpid()}"
        self.bridge_namespace = f"{self.prefix}-br"
        self.namespaces = [f"{self.prefix}-n{k}" for k in range(nodes)]
        self.interfaces = [f"veth{k}" for k in range(nodes)]
        self.ports = [f"port{k}" for k in range(nodes)]
        self.addresses = [str(network.network_address + k + 1) for k in range(nodes)]
        self.master_addr = self.addresses[0]
        # Internal state: what exists now, so that close() removes exactly that.
        self._created: list[str] = []
        self.link_rates: list[str] = ["none"] * nodes  # each node's link as set_rate left it
        self.links_up: list[bool] = [True] * nodes
        self._route: tuple[str, ...] | None = None
        self._lock_fd: int | None = None
        self._old_handlers: dict[int, Any] | None = None
        self._started = False

    # -- life cycle

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Create namespaces, bridge, links, addresses, qdiscs and the blackhole route."""
        problem = missing_privileges() or missing_tools()
        if problem:
            raise PermissionError(problem)
        if Cluster._active is not None:
            raise RuntimeError(f"cluster {Cluster._active.prefix} is still up in this process; close it "
                               f"first (names and the route's metric are per process)")
        Cluster._active = self
        self._old_handlers = _set_handlers(_raise_interrupted)
        try:
            self._print_plan()
            self._lock()
            self._check_subnet_free()
            dst = str(self.subnet)
            self._route = ("blackhole", dst, "proto", str(ROUTE_PROTO), "metric", str(os.getpid()))
            _sh("ip", "route", "add", *self._route)
            br = self.bridge_namespace
            self._add_namespace(br)
            _sh("ip", "-n", br, "link", "add", "br0", "type", "bridge")
            _sh("ip", "-n", br, "link", "set", "br0", "mtu", str(self.mtu), "up")
            for ns, dev, port, addr in zip(self.namespaces, self.interfaces, self.ports, self.addresses):
                self._add_namespace(ns)
                _sh("ip", "link", "add", dev, "netns", ns, "type", "veth", "peer", "name", port, "netns", br)
                _sh("ip", "-n", ns, "addr", "add", f"{addr}/{self.subnet.prefixlen}", "dev", dev)
                _sh("ip", "-n", ns, "link", "set", dev, "mtu", str(self.mtu), "up")
                _sh("ip", "-n", br, "link", "set", port, "mtu", str(self.mtu), "master", "br0", "up")
            self._started = True
            self.set_rate(self._rate, self._burst, self._tbf_latency, quiet=True)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Remove everything ``start`` made, also after a failure halfway; safe to call twice."""
        hurry = threading.Event()
        with _signals_deferred(hurry):
            problems = []
            for ns in self._created:
                _kill_namespace_processes(ns)
            steps = [("ip", "netns", "del", ns) for ns in reversed(self._created)]
            steps += [("ip", "route", "del", *self._route)] if self._route else []
            for step in steps:
                try:
                    _sh(*step)
                except RuntimeError as err:
                    problems.append(str(err))
            if self._created or self._route:
                self._say(f"torn down: {len(self._created)} namespaces (with their links and bridge)"
                    + (f", blackhole route {self.subnet}" if self._route else ""))
            for problem in problems:
                say(f"teardown problem: {problem}; `python -m gtc_lightning.tools.cluster --cleanup` retries")
            self._created, self._route, self._started = [], None, False
            if self._lock_fd is not None:
                (LOCK_DIR / f"{self.prefix}.lock").unlink(missing_ok=True)
                os.close(self._lock_fd)
                self._lock_fd = None
            if Cluster._active is self:
                Cluster._active = None
        _restore_handlers(self._old_handlers)
        self._old_handlers = None

    # -- links

    def _check_shaping(self, rate: str, burst: str, tbf_latency: str) -> tuple[int | None, int, float]:
        bits, burst_bytes, latency_s = parse_rate(rate), parse_size(burst), parse_time(tbf_latency)
        if bits is not None and burst_bytes < self.mtu + 14:
            raise ValueError(f"burst {burst!r} = {burst_bytes} bytes holds less than one packet "
                             f"(mtu {self.mtu} + 14 header bytes); raise the burst, e.g. 256kb")
        if bits is not None and latency_s <= 0:
            raise ValueError(f"tbf latency {tbf_latency!r} must be positive, e.g. 100ms")
        return bits, burst_bytes, latency_s

    def set_rate(self, rate: str, burst: str | None = None, tbf_latency: str | None = None,
                 *, nodes: Sequence[int] | None = None, quiet: bool = False) -> None:
        """Shape every link, both ways, to ``rate`` (``none``: remove the shaping); with ``nodes``
        only those nodes' links (a straggler), leaving the cluster's rate as it was."""
        burst = burst or self._burst
        tbf_latency = tbf_latency or self._tbf_latency
        bits, burst_bytes, latency_s = self._check_shaping(rate, burst, tbf_latency)
        if not self._started:
            raise RuntimeError("the cluster is not up: call start() or use `with Cluster(...)` first")
        chosen = range(self.nodes) if nodes is None else sorted(set(nodes))
        if any(not 0 <= k < self.nodes for k in chosen):
            raise ValueError(f"nodes={list(nodes)}: this cluster has nodes 0 to {self.nodes - 1}")
        ends = [(self.namespaces[k], self.interfaces[k]) for k in chosen]
        ends += [(self.bridge_namespace, self.ports[k]) for k in chosen]
        for ns, dev in ends:
            if bits is None:
                _sh("tc", "-n", ns, "qdisc", "del", "dev", dev, "root", check=False)
            else:
                _sh("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{bits}bit",
                    "burst", str(burst_bytes), "latency", f"{round(latency_s * 1e6)}us")
        for k in chosen:
            self.link_rates[k] = rate
        if nodes is not None:
            if not quiet:
                self._say(f"link of node{'s' if len(chosen) > 1 else ''} {', '.join(map(str, chosen))} now {rate}")
            return
        self._rate, self._burst, self._tbf_latency = rate, burst, tbf_latency
        self.rate, self.rate_bits, self.burst_bytes, self.tbf_latency_s = rate, bits, burst_bytes, latency_s
        if not quiet:
            self._say(f"links now {self._shaping_text()}")

    def set_link(self, node: int, up: bool, *, quiet: bool = False) -> None:
        """Take node ``node``'s link down (``ip link set veth<k> down`` in its namespace: the node is
        cut off, its connected route gone) or bring it back up (address, route and shaping return)."""
        if not self._started:
            raise RuntimeError("the cluster is not up: call start() or use `with Cluster(...)` first")
        if not 0 <= node < self.nodes:
            raise ValueError(f"node={node}: this cluster has nodes 0 to {self.nodes - 1}")
        state = "up" if up else "down"
        _sh("ip", "-n", self.namespaces[node], "link", "set", self.interfaces[node], state)
        self.links_up[node] = up
        if not quiet:
            self._say(f"node {node}: {self.interfaces[node]} {state}")

    def _shaping_text(self) -> str:
        if parse_rate(self._rate) is None:
            return "unshaped"
        return f"{self._rate} both ways (tbf burst {self._burst} latency {self._tbf_latency})"

    def counters(self) -> list[dict[str, int]]:
        """Each node's veth counters now: ``tx_bytes``, ``rx_bytes``, ``tx_packets``, ``rx_packets``."""
        result = []
        for ns, dev in zip(self.namespaces, self.interfaces):
            stats = json.loads(_sh("ip", "-n", ns, "-j", "-s", "link", "show", "dev", dev))[0]["stats64"]
            result.append({f"{way}_{what}": int(stats[way][what])
                           for way in ("tx", "rx") for what in ("bytes", "packets")})
        return result

    # -- set-up helpers

    def _print_plan(self) -> None:
        procs = f", {self.devices_per_node} processes each" if self.devices_per_node > 1 else ""
        self._say(f"{self.nodes} nodes{procs}; links {self._shaping_text()}, mtu {self.mtu}; no added propagation "
            f"delay (netem is absent from this kernel)")
        self._say(f"bridge br0 in namespace {self.bridge_namespace}; blackhole route {self.subnet} in the root "
            f"namespace")
        for k, (ns, dev, addr) in enumerate(zip(self.namespaces, self.interfaces, self.addresses)):
            self._say(f"node {k}: namespace {ns}, {dev} {addr}/{self.subnet.prefixlen} <-> port{k}")

    def _lock(self) -> None:
        LOCK_DIR.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(LOCK_DIR / f"{self.prefix}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        # We hold the lock of our pid's prefix: anything under that name is a dead run's (pid reuse).
        if _prefix_leftovers(self.prefix) != ([], []):
            say(f"removing leftovers of an earlier run with the same prefix {self.prefix}")
            _remove_prefix(self.prefix)

    def _check_subnet_free(self) -> None:
        for route in json.loads(_sh("ip", "-j", "route", "show", "table", "all") or "[]"):
            dst = route.get("dst", "default")
            if dst == "default" or route.get("protocol") == str(ROUTE_PROTO) or ":" in dst:
                continue
            try:
                network = ipaddress.ip_network(dst, strict=False)
            except ValueError:
                continue
            if network.subnet_of(self.subnet):
                raise RuntimeError(f"subnet {self.subnet} is in use here (root namespace route {dst} "
                                   f"{route.get('dev', route.get('type', ''))}); pick another --subnet")

    def _add_namespace(self, ns: str) -> None:
        _sh("ip", "netns", "add", ns)
        self._created.append(ns)
        # No IPv6: router solicitations and DAD would add packets to the counters.
        _sh("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1",
            "net.ipv6.conf.default.disable_ipv6=1", check=False)
        _sh("ip", "-n", ns, "link", "set", "lo", "up")

    # -- running

    def environment(self, node_rank: int, local_rank: int = 0) -> dict[str, str]:
        """The variables set for process ``local_rank`` of node ``node_rank`` (on top of os.environ)."""
        return {
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            "NODE_RANK": str(node_rank),
            "LOCAL_RANK": str(local_rank),
            "RANK": str(node_rank * self.devices_per_node + local_rank),
            "WORLD_SIZE": str(self.world_size),
            "GLOO_SOCKET_IFNAME": self.interfaces[node_rank],
            "PYTHONUNBUFFERED": "1",
        }

    def config(self) -> dict[str, Any]:
        """The configuration as ``cluster.json`` records it."""
        return {
            "nodes": self.nodes, "devices_per_node": self.devices_per_node, "world_size": self.world_size,
            "rate": self.rate, "rate_bits_per_s": self.rate_bits, "link_rates": list(self.link_rates),
            "links_up": list(self.links_up),
            "burst_bytes": self.burst_bytes if self.rate_bits else None,
            "tbf_latency_s": self.tbf_latency_s if self.rate_bits else None,
            "added_delay_s": 0.0, "mtu": self.mtu, "subnet": str(self.subnet),
            "master_addr": self.master_addr, "master_port": self.master_port, "prefix": self.prefix,
            "bridge_namespace": self.bridge_namespace,
        }

    def run(
        self,
        command: Sequence[str],
        out: str | os.PathLike,
        *,
        timeout: float = 1800.0,
        kill_after: float = 10.0,
        grace: float = 30.0,
        stream: bool = True,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike | None = None,
    ) -> RunResult:
        """Run ``command`` on every node at once, wait for all, write ``<out>/cluster.json``.

        Args:
            command: the program and its arguments; placeholders ``{num_nodes}`` etc. are replaced.
            out: directory for ``node<k>.log`` and ``cluster.json``.
            timeout: seconds until every process still running gets SIGTERM.
            kill_after: seconds from SIGTERM to SIGKILL (a rank blocked in gloo ignores SIGTERM).
            grace: seconds the others may keep running after one process failed before they are
                stopped the same way (a rank whose peer died usually fails by itself within ~2 s).
            stream: copy node 0's (local rank 0's) output to stdout, each line prefixed ``[node0]``.
            env: extra variables for every process.
            cwd: working directory of the processes (default: this process's).

        Returns:
            The ``RunResult``; ``result.ok`` says whether every process exited 0. Raises
            ``Interrupted`` after stopping the processes and writing ``cluster.json`` when a
            signal arrived.
        """
        if not self._started:
            raise RuntimeError("the cluster is not up: call start() or use `with Cluster(...)` first")
        if not command:
            raise ValueError("empty command: give the program to run on every node")
        if timeout <= 0 or kill_after < 0 or grace < 0:
            raise ValueError(f"timeout={timeout}, kill_after={kill_after}, grace={grace}: need timeout > 0 "
                             f"and non-negative kill_after and grace")
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        command = [str(arg) for arg in command]
        if self.nodes > 1 and not any("num_nodes" in arg for arg in command):
            say(f"note: the command never says num_nodes; a Lightning command needs --trainer.num_nodes "
                f"{self.nodes} (or num_nodes={{num_nodes}}) to join the other nodes")
        base_env = {k: v for k, v in os.environ.items() if k not in _FOREIGN_LAUNCHER_VARS}
        base_env.update(env or {})
        self._say(f"run on {self.nodes} nodes ({self._shaping_text()}): {shlex.join(command)}")
        self._say(f"MASTER_ADDR={self.master_addr} MASTER_PORT={self.master_port} WORLD_SIZE={self.world_size}; "
            f"logs and cluster.json in {out}; timeout {timeout:g} s")
        before = self.counters()
        started_at = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        t0 = time.monotonic()
        procs: list[_Process] = []
        status, interrupted = "ok", None
        try:
            for k in range(self.nodes):
                for local in range(self.devices_per_node):
                    procs.append(self._spawn(command, out, k, local, base_env, cwd,
                                             tee=stream and k == 0 and local == 0))
            status = self._wait(procs, deadline=t0 + timeout, grace=grace)
        except KeyboardInterrupt as err:  # Interrupted, or a plain one off the main thread
            status = "interrupted"
            interrupted = err if isinstance(err, Interrupted) else Interrupted(signal.SIGINT)
            say(f"{interrupted.args[0]}: stopping every process")
        finally:
            hurry = threading.Event()
            with _signals_deferred(hurry):
                reason = {"timeout": "timeout", "failed": "peer_failed", "interrupted": "interrupted"}.get(status)
                _stop([p for p in procs if p.popen.poll() is None], reason, kill_after, hurry)
                for p in procs:
                    _killpg(p.popen.pid, signal.SIGKILL)  # stragglers of a group whose leader has exited
                    p.finish()
                after = self.counters()
        wall = time.monotonic() - t0
        if status == "ok" and any(p.popen.returncode != 0 for p in procs):
            status = "failed"
        if interrupted is not None:
            exit_code = 128 + interrupted.signum
        else:
            exit_code = {"ok": 0, "failed": 1, "timeout": 124}[status]
        result = RunResult(status=status, exit_code=exit_code, command=command, out=str(out),
                           started_at=started_at, wall_s=round(wall, 3), timeout_s=timeout,
                           config=self.config(), nodes=self._node_results(procs, before, after),
                           total={})
        result.total = {key: sum(getattr(n, key) for n in result.nodes)
                        for key in ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets")}
        (out / "cluster.json").write_text(json.dumps(result.to_json(), indent=1) + "\n")
        self._summarise(result)
        if interrupted is not None:
            raise interrupted
        return result

    def _spawn(self, command: list[str], out: Path, k: int, local: int, base_env: dict[str, str],
               cwd: str | os.PathLike | None, tee: bool) -> _Process:
        rank = k * self.devices_per_node + local
        values = {"num_nodes": self.nodes, "node_rank": k, "local_rank": local, "rank": rank,
                  "devices_per_node": self.devices_per_node, "world_size": self.world_size}
        args = []
        for arg in command:
            for name in _PLACEHOLDERS:
                arg = arg.replace("{" + name + "}", str(values[name]))
            args.append(arg)
        log = out / (f"node{k}.log" if self.devices_per_node == 1 else f"node{k}-local{local}.log")
        return _Process(["ip", "netns", "exec", self.namespaces[k], *args], {**base_env,
                        **self.environment(k, local)}, cwd, log, k, local, rank, tee)

    def _wait(self, procs: list[_Process], deadline: float, grace: float) -> str:
        first_failure = None
        while True:
            now = time.monotonic()
            running = 0
            for p in procs:
                code = p.popen.poll()
                if code is None:
                    running += 1
                elif p.end is None:
                    p.end = now
                    if code != 0 and first_failure is None:
                        first_failure = now
                        say(f"node {p.node_rank} (local rank {p.local_rank}) exited {_describe(code)}; "
                            f"the others get {grace:g} s to end by themselves (log {p.log})")
            if running == 0:
                return "ok"
            if now >= deadline:
                say(f"timeout: {running} processes still running; stopping them")
                return "timeout"
            if first_failure is not None and now >= first_failure + grace:
                return "failed"
            time.sleep(0.05)

    def _node_results(self, procs: list[_Process], before: list[dict[str, int]],
                      after: list[dict[str, int]]) -> list[NodeResult]:
        results = []
        for k in range(self.nodes):
            mine = [p.result() for p in procs if p.node_rank == k]
            delta = {key: after[k][key] - before[k][key] for key in after[k]}
            codes = [p.exit_code for p in mine if p.exit_code != 0]
            results.append(NodeResult(
                node_rank=k, namespace=self.namespaces[k], interface=self.interfaces[k],
                address=self.addresses[k], exit_code=codes[0] if codes else 0,
                wall_s=max((p.wall_s for p in mine), default=0.0), counters_before=before[k],
                counters_after=after[k], processes=mine, **delta))
        return results

    def _summarise(self, result: RunResult) -> None:
        for node in result.nodes:
            self._say(f"node {node.node_rank} ({node.address}): exit {_describe(node.exit_code)}, {node.wall_s:.1f} s, "
                f"sent {node.tx_bytes / 1e6:.3f} MB, received {node.rx_bytes / 1e6:.3f} MB on {node.interface}")
        failed = [(n, p) for n in result.nodes for p in n.processes if p.exit_code != 0]
        for node, p in failed:
            why = f" (stopped: {p.stopped_by})" if p.stopped_by else ""
            label = "stopped" if p.stopped_by == "interrupted" else "FAILED"
            say(f"{label}: node {node.node_rank} local rank {p.local_rank} exit {_describe(p.exit_code)}{why}; "
                f"log {p.log}")
        self._say(f"{result.status} in {result.wall_s:.1f} s; {Path(result.out) / 'cluster.json'}")


def _quiet(_message: str) -> None:
    pass


def _describe(code: int | None) -> str:
    if code is None:
        return "unknown"
    if code < 0:
        return f"{code} (killed by {signal.Signals(-code).name})"
    return str(code)


class _Process:
    """One started process, its log and (for node 0) the thread copying its output to stdout."""

    def __init__(self, args: list[str], env: dict[str, str], cwd: str | os.PathLike | None, log: Path,
                 node_rank: int, local_rank: int, rank: int, tee: bool):
        self.node_rank, self.local_rank, self.rank, self.log = node_rank, local_rank, rank, log
        self.stopped_by: str | None = None
        self.end: float | None = None
        self._file = open(log, "wb")  # noqa: SIM115  (closed in finish)
        # A session of its own: the terminal's Ctrl-C reaches only us, and we stop the whole group.
        self.popen = subprocess.Popen(args, env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                                      stdout=subprocess.PIPE if tee else self._file,
                                      stderr=subprocess.STDOUT, start_new_session=True)
        self.start = time.monotonic()
        self._thread = None
        if tee:
            self._thread = threading.Thread(target=self._tee, name=f"tee-node{node_rank}", daemon=True)
            self._thread.start()

    def _tee(self) -> None:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        fd, line_start, prefix = self.popen.stdout.fileno(), True, f"[node{self.node_rank}] "
        while chunk := os.read(fd, 65536):
            self._file.write(chunk)
            self._file.flush()
            pieces = []
            for piece in re.split(r"([\r\n])", decoder.decode(chunk)):
                if piece in ("\r", "\n"):
                    pieces.append(piece)
                    line_start = True
                elif piece:
                    pieces.append(prefix + piece if line_start else piece)
                    line_start = False
            sys.stdout.write("".join(pieces))
            sys.stdout.flush()

    def finish(self) -> None:
        if self.end is None:
            self.end = time.monotonic()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self.popen.stdout.close()
        self._file.close()

    def result(self) -> ProcessResult:
        return ProcessResult(node_rank=self.node_rank, local_rank=self.local_rank, rank=self.rank,
                             exit_code=self.popen.returncode, wall_s=round((self.end or self.start) - self.start, 3),
                             stopped_by=self.stopped_by, log=str(self.log),
                             ended_at=None if self.end is None else round(time.time() - (time.monotonic() - self.end), 3))


def _stop(procs: list[_Process], reason: str | None, kill_after: float, hurry: threading.Event) -> None:
    """SIGTERM each process group, SIGKILL what is left ``kill_after`` seconds later (or at once if
    ``hurry`` is set): SIGTERM alone does not end a rank blocked in gloo."""
    if not procs:
        return
    say(f"SIGTERM to {len(procs)} processes ({reason}); SIGKILL after {kill_after:g} s")
    for p in procs:
        p.stopped_by = reason
        _killpg(p.popen.pid, signal.SIGTERM)
    deadline = time.monotonic() + kill_after
    while any(p.popen.poll() is None for p in procs) and time.monotonic() < deadline and not hurry.is_set():
        time.sleep(0.05)
    for p in procs:
        _killpg(p.popen.pid, signal.SIGKILL)
        p.popen.wait()
        if p.end is None:
            p.end = time.monotonic()


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


# ------------------------------------------------------------------------------------------ cleanup


def _kill_namespace_processes(ns: str) -> None:
    """SIGKILL whatever still runs inside ``ns`` (orphans of a killed run keep the namespace alive)."""
    for pid in _sh("ip", "netns", "pids", ns, check=False).split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def _prefix_leftovers(prefix: str | None = None) -> tuple[list[str], list[dict[str, Any]]]:
    """Namespaces and blackhole routes made by this tool (all runs, or the one named ``prefix``)."""
    names = [line.split()[0] for line in _sh("ip", "netns", "list", check=False).splitlines() if line.strip()]
    namespaces = [n for n in names if (m := _NAME.match(n)) and (prefix is None or m.group(1) == prefix)]
    routes = [r for r in json.loads(_sh("ip", "-j", "route", "show", "proto", str(ROUTE_PROTO)) or "[]")
              if r.get("type") == "blackhole" and (prefix is None or f"gtcc{r.get('metric')}" == prefix)]
    return namespaces, routes


def _remove_prefix(prefix: str) -> list[str]:
    namespaces, routes = _prefix_leftovers(prefix)
    for ns in namespaces:
        _kill_namespace_processes(ns)
    removed = []
    for ns in namespaces:
        _sh("ip", "netns", "del", ns, check=False)
        removed.append(f"namespace {ns}")
    for route in routes:
        _sh("ip", "route", "del", "blackhole", route["dst"], "proto", str(ROUTE_PROTO), "metric",
            str(route["metric"]), check=False)
        removed.append(f"route blackhole {route['dst']} metric {route['metric']}")
    return removed


def _owner_alive(prefix: str) -> bool:
    """A live run holds the flock on its lock file; a killed one's lock is free."""
    path = LOCK_DIR / f"{prefix}.lock"
    if not path.exists():
        return False
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def cleanup_leftovers() -> list[str]:
    """Remove namespaces (killing what runs in them) and blackhole routes of runs that are gone.

    Returns:
        One line per removed thing. Runs still alive (their lock is held) are left alone.
    """
    namespaces, routes = _prefix_leftovers()
    prefixes = {_NAME.match(n).group(1) for n in namespaces} | {f"gtcc{r['metric']}" for r in routes}
    if LOCK_DIR.is_dir():
        prefixes |= {p.stem for p in LOCK_DIR.glob("gtcc*.lock")}
    removed = []
    for prefix in sorted(prefixes):
        if _owner_alive(prefix):
            say(f"{prefix}: its run is still alive; leaving it")
            continue
        say(f"{prefix}: its run is gone; removing its namespaces, routes and lock")
        removed += _remove_prefix(prefix)
        (LOCK_DIR / f"{prefix}.lock").unlink(missing_ok=True)
    for line in removed:
        say(f"removed {line}")
    say(f"cleanup: removed {len(removed)} leftovers" if removed else "cleanup: nothing left behind")
    return removed


# ---------------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m gtc_lightning.tools.cluster",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run a command on N emulated nodes: network namespaces of this machine joined by veth "
                    "links to a bridge, each link shaped both ways with tc tbf. Needs root (or CAP_NET_ADMIN "
                    "and CAP_SYS_ADMIN).",
        epilog="""\
The command comes after `--` and runs once per node (G times with --devices-per-node G) under
`ip netns exec`, with MASTER_ADDR (node 0's address), MASTER_PORT, NODE_RANK, LOCAL_RANK, RANK,
WORLD_SIZE and GLOO_SOCKET_IFNAME set: Lightning's own multi-node path over gloo. The command must
give Lightning the node count itself, e.g. `--trainer.num_nodes 4 --trainer.devices 1`; these
placeholders are replaced in every argument: {num_nodes} {node_rank} {local_rank} {rank}
{devices_per_node} {world_size}.

Latency: only bandwidth is emulated. netem is absent from this kernel (so are fq and etf), so no
propagation delay can be added; the links have veth's sub-millisecond latency. --tbf-latency is
tbf's queue limit, not a delay.

Output: <out>/node<k>.log per node (node<k>-local<l>.log with G > 1), node 0's output also on
stdout prefixed [node0], and <out>/cluster.json with the configuration, per-process exit codes and
wall times, and the bytes and packets each node's veth sent and received during the run.

Exit status: 0 all processes exited 0; 1 one failed (the others are stopped --grace seconds
later); 124 timeout; 130 Ctrl-C (143 SIGTERM); 2 bad options or missing privileges. Namespaces,
links, bridge and the blackhole route are removed in every case; after a SIGKILL of this tool,
`--cleanup` removes them (and kills what still runs inside).

example:
  python -m gtc_lightning.tools.cluster --nodes 4 --rate 1gbit --out exp/cluster/gtc -- \\
      python recipes/asr/train.py --strategy gtc --trainer.num_nodes 4 --trainer.devices 1
""")
    add = parser.add_argument
    add("--nodes", type=int, default=2, help="number of nodes (namespaces), 1-250 (default 2)")
    add("--devices-per-node", type=int, default=1, metavar="G",
        help="processes per node, LOCAL_RANK 0..G-1; the command must say --trainer.devices G (default 1)")
    add("--rate", default="1gbit", help="link rate both ways as tc reads it: 100mbit, 1gbit, 10gbit, ... or "
        "'none' for unshaped links (default 1gbit)")
    add("--burst", default="256kb", help="tbf bucket size, tc units (256kb = 256 KiB; default 256kb)")
    add("--tbf-latency", default="100ms", help="tbf queue limit as the longest wait of a queued packet; not "
        "an added delay (default 100ms)")
    add("--mtu", type=int, default=1500, help="MTU of the links and the bridge (default 1500)")
    add("--subnet", default="10.213.0.0/24", help="private IPv4 subnet of the node addresses, used only "
        "inside the namespaces; blackholed in the root namespace (default 10.213.0.0/24)")
    add("--master-port", type=int, default=29500, help="MASTER_PORT on node 0 (default 29500)")
    add("--out", type=Path, default=None, help="directory for logs and cluster.json "
        "(default exp/cluster/<date-time>)")
    add("--timeout", type=float, default=1800.0, help="seconds until the processes get SIGTERM (default 1800)")
    add("--kill-after", type=float, default=10.0, help="seconds from SIGTERM to SIGKILL (default 10)")
    add("--grace", type=float, default=30.0, help="seconds the other processes may run on after one failed "
        "before they are stopped (default 30)")
    add("--quiet", action="store_true", help="do not copy node 0's output to stdout (the logs still get it)")
    add("--cleanup", action="store_true", help="remove namespaces, routes and locks left by killed runs "
        "(kills what still runs in them), then exit")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    options, command = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = build_parser()
    args = parser.parse_args(options)
    if args.cleanup and command:
        parser.error("--cleanup takes no command")
    if not args.cleanup and not command:
        parser.error("give the command to run after `--`, e.g. -- python train.py --trainer.num_nodes 2")
    try:
        cluster = Cluster(nodes=args.nodes, rate=args.rate, devices_per_node=args.devices_per_node,
                          burst=args.burst, tbf_latency=args.tbf_latency, mtu=args.mtu, subnet=args.subnet,
                          master_port=args.master_port)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    problem = missing_privileges() or missing_tools()
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if args.cleanup:
        cleanup_leftovers()
        return 0
    out = args.out or Path("exp/cluster") / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    try:
        with cluster:
            result = cluster.run(command, out, timeout=args.timeout, kill_after=args.kill_after,
                                 grace=args.grace, stream=not args.quiet)
    except Interrupted as err:
        say(f"stopped by {err.args[0]}")
        return 128 + err.signum
    except (RuntimeError, ValueError, PermissionError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())
