"""Scaling model: step time and speed-up of each strategy on 1-128 nodes, from the compute time of a
step and the messages each strategy sends.
Long file: one model of every strategy's messages, its calibration, its command and its plot.

A step is its compute (forward, backward, optimizer; plus the strategy's own work on the gradient,
such as GTC's thresholding and decoding, and on the model at a sync, such as BMUF's block update,
counted once per period) followed by its collectives; nothing overlaps, except for
strategies marked ``overlap`` (one-step-stale GTC), whose exchange runs under the next step's
compute. Each collective moves bytes over the node's link and pays a latency per message hop
(α-β model, Thakur, Rabenseifner & Gropp 2005). Per rank, for a group of ``p`` ranks and a link
of ``B`` bytes/s each way:

==============================  =====================================  ==================
collective                      bytes each rank sends (and receives)   message hops
==============================  =====================================  ==================
ring all-reduce of S bytes      2 (p-1)/p · S                          2 (p-1)
all-gather, s bytes per rank    (p-1) · s                              p-1
all-to-all, the same s to all   (p-1) · s                              1 (all posted at once)
broadcast of S (binomial tree)  ceil(log2 p) · S (the root's)          ceil(log2 p)
neighbour exchange, k peers     k · S                                  1
==============================  =====================================  ==================

and takes ``wire_overhead · bytes / B + bytes / host_bytes_per_s + hops · latency``: the link's
serialisation (with Ethernet/IP/TCP headers and ACKs, ``wire_overhead`` bytes on the wire per payload
byte), the host's own cost of moving the bytes (copies and reductions, which on the emulated
cluster's two cores limit everything above a few Gbit/s) and one latency per hop. An emulated link
(tbf) also lets ``burst`` bytes through at once after an idle moment: each step gets that credit once.

Several ranks per node (``Hosts``: R GPUs of one machine sharing its link, joined by a faster
``intra`` link such as NVLink): a collective whose ranks all sit on one node runs on ``intra``; a ring
(all-reduce, all-gather) over consecutive ranks crosses each node's link once per hop, so its time is
the one-rank-per-node formula on the node's link (each hop waits for its slowest, inter-node, edge);
an all-to-all puts on the node's link what all its ``r`` ranks send to the ranks of other nodes,
``r · (p - r) · s`` bytes, while the ``r - 1`` on-node messages go over ``intra`` at the same time.
Ranks are placed in order (node k holds ranks kR ... kR + R - 1), so groups of G | R consecutive
ranks live on one node and their representatives (every G-th rank) on R / G per node.

Strategies (what each rank sends per optimizer step; n weights, m words per rank, K the period,
G ranks per group):

- ``ddp``: ring all-reduce of 4n bytes; ``ddp_bf16``: of 2n bytes.
- ``gtc`` (and ``gtc_alltoall``, ``gtc_stale``, ``gtc_rice``): a header of 24 bytes from each rank
  to every other rank, then each rank's 4m bytes of words to every other rank, both by all-to-all
  (the hook's exchange on gloo). ``gtc_allgather``: header and words by all-gather, the words
  padded to the longest message (``max_words``).
- ``gtc_update`` (GTC on each rank's optimizer step): first an all-reduce of one int64 non-finite
  flag per rank (8W bytes), then the header (24 bytes) and the words as ``gtc``, at the bytes per word
  they were sent in (Golomb-Rice coded: 8-11 bits).
- ``powersgd_r1``, ``powersgd_r4`` (torch's PowerSGD hook): the ring all-reduces it issued in a
  measured step, each bucket's uncompressed tensors, P and Q (``allreduces``: their bytes); unknown
  (None) without them.
- ``ma``, ``bmuf``: every K steps a ring all-reduce of 4n bytes.
- ``bmuf_gtc`` (two tiers): GTC within groups of G ranks every step; every K steps the groups'
  representatives all-reduce 4n bytes and broadcast the result within their group.
- ``dpsgd``: every step 4n bytes to each of 2 ring neighbours.
- ``adpsgd``: every step 4n bytes to one peer (an even rank's exchange with an odd one, in the
  background).
- ``nocomm``, ``single``: nothing.

Everything here is plain arithmetic on floats, so that ``tests/test_scaling.py`` can check it by hand.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

HEADER_BYTES = 24  # GTC's header: three int64 per rank (non-finite count, words, message bytes)
WORD_BYTES = 4


@dataclass(frozen=True)
class Network:
    """One node's link and host, as the model sees them.

    Attributes:
        rate_bits: link rate each way, bits/s.
        latency_s: α, seconds per message hop (software and propagation).
        wire_overhead: bytes on the wire per payload byte (headers, ACKs); 1.0 for payload only.
        host_bytes_per_s: what the host itself can move per second (copies, reductions); inf: no limit.
        burst_bytes: bytes an idle link lets through at once (tbf's bucket); 0 for a real link.
    """

    rate_bits: float
    latency_s: float = 0.0
    wire_overhead: float = 1.0
    host_bytes_per_s: float = math.inf
    burst_bytes: float = 0.0

    def __post_init__(self) -> None:
        if not self.rate_bits > 0:
            raise ValueError(f"rate_bits={self.rate_bits}: a link needs a positive rate in bits/s")
        if self.latency_s < 0 or self.wire_overhead < 1 or self.host_bytes_per_s <= 0 or self.burst_bytes < 0:
            raise ValueError(
                f"{self}: need latency_s >= 0, wire_overhead >= 1, host_bytes_per_s > 0, burst_bytes >= 0"
            )

    @property
    def bytes_per_s(self) -> float:
        return self.rate_bits / 8

    def seconds(self, payload_bytes: float, hops: float) -> float:
        """Time to send ``payload_bytes`` in ``hops`` messages in sequence (no burst credit)."""
        wire = self.wire_overhead * payload_bytes
        return wire / self.bytes_per_s + payload_bytes / self.host_bytes_per_s + hops * self.latency_s


@dataclass(frozen=True)
class Hosts:
    """How ranks sit on machines.

    Attributes:
        ranks_per_node: R, ranks (GPUs) of one machine; they share the machine's ``Network`` link.
        intra: the link between ranks of one machine (NVLink, PCIe, shared memory); None: the
            machine's own ``Network``.
    """

    ranks_per_node: int = 1
    intra: Network | None = None

    def __post_init__(self) -> None:
        if (
            isinstance(self.ranks_per_node, bool)
            or not isinstance(self.ranks_per_node, int)
            or self.ranks_per_node < 1
        ):
            raise ValueError(f"ranks_per_node={self.ranks_per_node!r}: need an int >= 1 (GPUs per machine)")


ONE_PER_NODE = Hosts()


@dataclass(frozen=True)
class Collective:
    """One collective a strategy runs, per rank.

    Attributes:
        kind: ``allreduce``, ``allgather``, ``alltoall``, ``broadcast`` or ``neighbours``.
        size: bytes: the buffer (all-reduce, broadcast, neighbour exchange) or one rank's message
            (all-gather, all-to-all).
        group: ranks taking part (for ``neighbours``: the peers each rank sends to).
        every: steps per collective (1: every step; K: once per period).
        stride: the ranks taking part are every ``stride``-th rank (BMUF-GTC's representatives of
            groups of G: G); what decides how many of them share a node (:class:`Hosts`).
    """

    kind: str
    size: float
    group: int
    every: int = 1
    stride: int = 1

    def sent_bytes(self) -> float:
        """Payload bytes one rank sends (and receives) in this collective."""
        p, s = self.group, self.size
        if p <= 1 and self.kind != "neighbours":
            return 0.0
        if self.kind == "allreduce":
            return 2 * (p - 1) / p * s
        if self.kind in ("allgather", "alltoall"):
            return (p - 1) * s
        if self.kind == "broadcast":
            return math.ceil(math.log2(p)) * s
        if self.kind == "neighbours":
            return p * s
        raise ValueError(f"unknown collective kind {self.kind!r}")

    def hops(self) -> int:
        """Messages in sequence (each pays one latency)."""
        p = self.group
        if p <= 1 and self.kind != "neighbours":
            return 0
        return {
            "allreduce": 2 * (p - 1),
            "allgather": p - 1,
            "alltoall": 1,
            "broadcast": math.ceil(math.log2(p)),
            "neighbours": 1,
        }[self.kind]

    def per_node(self, hosts: Hosts) -> int:
        """How many of this collective's ranks share one node (ranks placed in order)."""
        return min(self.group, max(1, hosts.ranks_per_node // self.stride))

    def seconds(self, net: Network, hosts: Hosts = ONE_PER_NODE) -> float:
        """Seconds for this collective on nodes linked by ``net`` (see the module docstring for
        several ranks per node)."""
        if hosts.ranks_per_node == 1:
            return net.seconds(self.sent_bytes(), self.hops())
        local, intra = self.per_node(hosts), hosts.intra or net
        if local >= self.group:  # every rank of it on one node
            return intra.seconds(self.sent_bytes(), self.hops())
        if self.kind != "alltoall":
            return net.seconds(self.sent_bytes(), self.hops())
        # The node's link carries what its ``local`` ranks send off the node; the on-node messages
        # go over ``intra`` meanwhile; each rank's host still moves all it sends.
        off_node = local * (self.group - local) * self.size
        link = net.wire_overhead * off_node / net.bytes_per_s + self.sent_bytes() / net.host_bytes_per_s
        return max(link + net.latency_s, intra.seconds((local - 1) * self.size, 1))


def ring_allreduce_s(size: float, p: int, net: Network) -> float:
    """``2 (p-1)/p · S / B + 2 (p-1) α`` (plus the host and wire terms of ``net``)."""
    return Collective("allreduce", size, p).seconds(net)


def allgather_s(message: float, p: int, net: Network) -> float:
    """``(p-1) · s / B + (p-1) α``."""
    return Collective("allgather", message, p).seconds(net)


PATTERNS = (
    "ddp",
    "ddp_bf16",
    "gtc",
    "gtc_alltoall",
    "gtc_allgather",
    "gtc_stale",
    "gtc_rice",
    "gtc_update",
    "powersgd_r1",
    "powersgd_r4",
    "ma",
    "bmuf",
    "bmuf_gtc",
    "dpsgd",
    "adpsgd",
    "nocomm",
    "single",
)
OVERLAPPED = ("gtc_stale", "dpsgd", "adpsgd")  # the exchange runs while a step computes
SYNCING = ("ma", "bmuf", "bmuf_gtc")  # work on the whole model once per period (``Node.sync_s``)


@dataclass(frozen=True)
class Messages:
    """What a strategy's messages depend on, per rank and step.

    Attributes:
        numel: gradient elements (weights) n.
        words: words one rank sends per step (GTC), mean.
        max_words: the longest message of a step (what a padded all-gather sends); default ``words``.
        word_bytes: bytes per word as sent (4; less with entropy coding).
        period: K, steps between two model averagings (ma, bmuf, bmuf_gtc).
        group_size: G, ranks per group (bmuf_gtc).
        allreduces: bytes of each all-reduce of a step, in order (PowerSGD: measured, as its hook
            issued them).
    """

    numel: int
    words: float = 0.0
    max_words: float | None = None
    word_bytes: float = WORD_BYTES
    period: int = 1
    group_size: int = 2
    allreduces: tuple[float, ...] = ()


def collectives(strategy: str, world: int, msg: Messages) -> list[Collective] | None:
    """The collectives ``strategy`` runs per rank (see the module docstring); None if unknown."""
    n, w = msg.numel, world
    if world <= 1 or strategy in ("nocomm", "single"):
        return []
    words = [Collective("alltoall", HEADER_BYTES, w), Collective("alltoall", msg.word_bytes * msg.words, w)]
    if strategy == "ddp":
        return [Collective("allreduce", 4 * n, w)]
    if strategy == "ddp_bf16":
        return [Collective("allreduce", 2 * n, w)]
    if strategy in ("gtc", "gtc_alltoall", "gtc_stale", "gtc_rice"):
        return words
    if strategy == "gtc_update":
        return [Collective("allreduce", 8 * w, w), *words]
    if strategy.startswith("powersgd"):
        return [Collective("allreduce", size, w) for size in msg.allreduces] if msg.allreduces else None
    if strategy == "gtc_allgather":
        longest = msg.max_words if msg.max_words is not None else msg.words
        return [
            Collective("allgather", HEADER_BYTES, w),
            Collective("allgather", msg.word_bytes * longest, w),
        ]
    if strategy in ("ma", "bmuf"):
        return [Collective("allreduce", 4 * n, w, every=msg.period)]
    if strategy == "bmuf_gtc":
        g = min(msg.group_size, w)
        groups = max(w // g, 1)
        return [
            Collective("alltoall", HEADER_BYTES, g),
            Collective("alltoall", msg.word_bytes * msg.words, g),
            Collective("allreduce", 4 * n, groups, every=msg.period, stride=g),
            Collective("broadcast", 4 * n, g, every=msg.period),
        ]
    if strategy == "dpsgd":
        return [Collective("neighbours", 4 * n, min(2, w - 1))]
    if strategy == "adpsgd":  # whole models; with compress="gtc" msg.words coded words and tau
        return [Collective("neighbours", msg.word_bytes * (msg.words + 1) if msg.words else 4 * n, 1)]
    return None


def bytes_per_step(colls: list[Collective]) -> float:
    """Payload bytes one rank sends per step, averaged over a period."""
    return sum(c.sent_bytes() / c.every for c in colls)


def comm_seconds(colls: list[Collective], net: Network, hosts: Hosts = ONE_PER_NODE) -> float:
    """Seconds of communication per step, averaged over a period (the steps where the every-K
    collectives run and those where they do not). An emulated link's burst credit is taken once per
    step, limited to what the step sends: the bucket refills while the next step computes."""
    if not colls:
        return 0.0
    period = math.lcm(*(c.every for c in colls))
    total = 0.0
    for step in range(period):
        running = [c for c in colls if step % c.every == 0]
        seconds = sum(c.seconds(net, hosts) for c in running)
        wire = net.wire_overhead * sum(c.sent_bytes() for c in running)
        total += max(0.0, seconds - min(net.burst_bytes, wire) / net.bytes_per_s)
    return total / period


@dataclass(frozen=True)
class Node:
    """One node's compute, per optimizer step.

    Attributes:
        compute_s: forward, backward and optimizer step (what a step that sends nothing takes).
        frames: frames per node and step (the local mini-batch).
        overhead_s: the strategy's own work per step independent of the world size (GTC: thresholding).
        per_word_s: the strategy's work per word received (GTC: decoding all ranks' words).
        sync_s: the strategy's own arithmetic at one sync of the model (``ma``: the flat copy, the
            division and the copy back; ``bmuf`` and ``bmuf_gtc``: BMUF's block update on top), paid
            once per period; the collectives' own cost is not in it.
    """

    compute_s: float
    frames: int
    overhead_s: float = 0.0
    per_word_s: float = 0.0
    sync_s: float = 0.0


@dataclass(frozen=True)
class Prediction:
    """The model's step for one strategy and world size."""

    strategy: str
    world: int
    compute_s: float  # compute plus the strategy's own work
    comm_s: float  # communication per step (averaged over a period)
    step_s: float
    frames_per_s: float
    speedup: float  # frames/s over one node's (a step that sends nothing)
    bytes_per_step: float  # payload bytes one rank sends
    collectives: list[Collective] = field(default_factory=list)


def predict(
    strategy: str, world: int, node: Node, msg: Messages, net: Network, hosts: Hosts = ONE_PER_NODE
) -> Prediction | None:
    """Step time, frames/s and speed-up of ``strategy`` on ``world`` ranks (``hosts.ranks_per_node``
    to a node; one by default); None if its pattern is unknown. ``node`` is one rank's compute."""
    colls = collectives(strategy, world, msg)
    if colls is None:
        return None
    group = min(msg.group_size, world) if strategy == "bmuf_gtc" else world
    work = node.compute_s
    if colls:
        work += node.overhead_s + node.per_word_s * group * msg.words
        if strategy in SYNCING:
            work += node.sync_s / msg.period
    comm = comm_seconds(colls, net, hosts)
    step = max(work, comm) if strategy in OVERLAPPED else work + comm
    fps = world * node.frames / step
    return Prediction(
        strategy=strategy,
        world=world,
        compute_s=work,
        comm_s=comm,
        step_s=step,
        frames_per_s=fps,
        speedup=fps / (node.frames / node.compute_s),
        bytes_per_step=bytes_per_step(colls),
        collectives=colls,
    )


def sweep(
    strategies: list[str],
    worlds: list[int],
    node_of: dict[str, Node],
    msg_of: dict[str, Messages],
    net: Network,
) -> dict[str, list[Prediction]]:
    """``predict`` for every strategy and world size (strategies with unknown patterns left out)."""
    out = {}
    for s in strategies:
        rows = [predict(s, w, node_of[s], msg_of[s], net) for w in worlds]
        if all(r is not None for r in rows):
            out[s] = rows
    return out


def fit_network(samples: list[tuple[list[Collective], Network, float]]) -> tuple[float, float]:
    """Least-squares α (latency_s) and 1/host_bytes_per_s from measured communication times.

    Args:
        samples: ``(collectives, network with its rate, wire overhead and burst, measured seconds)``;
            the link term is taken as known, the rest is ``hops · α + bytes / H``. Each sample is
        weighted by 1 / measured (relative errors): otherwise the few slowest exchanges (dense
        fp32 at 100 Mbit/s, seconds each) decide α and H alone, and every millisecond-sized
        exchange at 10 Gbit/s is predicted several times too slow.

    Returns:
        ``(latency_s, host_bytes_per_s)``, both clipped to be non-negative (inf: no host limit).
    """
    rows, rhs = [], []
    for colls, net, measured in samples:
        link_only = replace(net, latency_s=0.0, host_bytes_per_s=math.inf)
        rest = measured - comm_seconds(colls, link_only)
        hops = sum(c.hops() / c.every for c in colls)
        sent = bytes_per_step(colls)
        w = 1.0 / measured if measured > 0 else 0.0
        rows.append((w * hops, w * sent))
        rhs.append(w * rest)
    # Normal equations of a 2-parameter least squares, then clip (one parameter refitted alone).
    a11 = sum(h * h for h, _ in rows)
    a12 = sum(h * b for h, b in rows)
    a22 = sum(b * b for _, b in rows)
    y1 = sum(h * r for (h, _), r in zip(rows, rhs))
    y2 = sum(b * r for (_, b), r in zip(rows, rhs))
    det = a11 * a22 - a12 * a12
    alpha, inv_host = (0.0, 0.0)
    if det > 0:
        alpha, inv_host = (y1 * a22 - y2 * a12) / det, (a11 * y2 - a12 * y1) / det
    if alpha < 0 or det <= 0:
        alpha, inv_host = 0.0, (max(y2, 0.0) / a22 if a22 else 0.0)
    if inv_host < 0:
        alpha, inv_host = (max(y1, 0.0) / a11 if a11 else 0.0), 0.0
    return alpha, (1 / inv_host if inv_host > 0 else math.inf)


# ------------------------------------------------------------------ Strom's Table 2 and today's nodes

STROM_TABLE2 = {1: 10_000, 5: 43_000, 10: 88_000, 20: 171_000, 40: 331_000, 80: 547_000}  # nodes: frames/s
STROM_WEIGHTS = 14_600_000
STROM_WORDS = 69_000 / WORD_BYTES  # Table 3, tau = 4: 69 KB per node and mini-batch of 1024 frames
NODES = (1, 2, 4, 8, 16, 32, 64, 80, 128)


@dataclass(frozen=True)
class Scenario:
    """A cluster to predict: one node's compute, its link, the model and GTC's message size.

    Attributes:
        name: a label for tables and plots.
        frames_per_s: one node's training rate with nothing to send (its compute).
        frames: frames per node and step (local mini-batch).
        net: the link (a real one: no burst credit).
        numel: weights.
        words: GTC words per node and step.
        overhead_s: GTC's thresholding per step (independent of the node count).
        per_word_s: GTC's decoding per received word.
        group_size: BMUF-GTC's nodes per group (GTC inside; BMUF across groups every ``period`` steps).
        period: BMUF-GTC's steps between block syncs.
        sync_s: BMUF's block update at one sync (``Node.sync_s``), also BMUF-GTC's.
        ranks_per_node: GPUs per machine, sharing ``net`` (:class:`Hosts`); the columns then count GPUs.
        intra: the link between the GPUs of one machine (None: ``net``).
    """

    name: str
    frames_per_s: float
    frames: int
    net: Network
    numel: int = STROM_WEIGHTS
    words: float = STROM_WORDS
    overhead_s: float = 0.0
    per_word_s: float = 0.0
    group_size: int = 8
    period: int = 50
    sync_s: float = 0.0
    ranks_per_node: int = 1
    intra: Network | None = None

    def predict(self, strategy: str, world: int) -> Prediction:
        node = Node(
            compute_s=self.frames / self.frames_per_s,
            frames=self.frames,
            overhead_s=self.overhead_s,
            per_word_s=self.per_word_s,
            sync_s=self.sync_s,
        )
        msg = Messages(numel=self.numel, words=self.words, period=self.period, group_size=self.group_size)
        hosts = Hosts(self.ranks_per_node, self.intra)
        prediction = predict(strategy, world, node, msg, self.net, hosts)
        assert prediction is not None, strategy
        return prediction


# Strom 2015: AWS EC2 G2 instances, one GRID K520 each, single-threaded SGD at about 10,000
# frames/s; "standard AWS networking", taken here as 1 Gbit/s with 50 us per message (an assumption:
# the paper gives no rate). Synchronous model; Strom's nodes sent asynchronously.
STROM_2015 = Scenario(
    "Strom 2015: K520 nodes, 10,000 frames/s, 1 Gbit/s",
    frames_per_s=10_000,
    frames=1024,
    net=Network(1e9, latency_s=50e-6),
)
# An H100 node (assumed). Measured through Lightning on an H100 (docs/experiments/gpu_h100.md), a 1024-frame step of
# this DNN takes ~3 ms with nothing sent, Lightning's own loop being most of it, and GTC's hook adds
# 1.1-2.3 ms of host work: these scenarios describe a much leaner training loop than Lightning's.
# Strom's DNN costs 6 n = 88 MFLOP per frame; 2e6
# frames/s is 175 TFLOP/s, 18 % of the H100 SXM's 989 TFLOP/s dense bf16 peak, allowing for small
# GEMMs (1024 x 1536 x 1536) and ~40 kernel launches per 0.5 ms step. GTC's thresholding reads and
# writes ~5 passes over 4n bytes at ~2.5 TB/s (0.12 ms); decoding ~0.1 ns per received word (scattered
# adds). Links: 20 us per message (TCP within a cloud placement group).
H100_COMPUTE_FRAMES_PER_S = 2e6
H100 = {
    rate: Scenario(
        f"H100 nodes, 2M frames/s, {rate} Gbit/s",
        frames_per_s=H100_COMPUTE_FRAMES_PER_S,
        frames=1024,
        net=Network(rate * 1e9, latency_s=20e-6),
        overhead_s=0.12e-3,
        per_word_s=1e-10,
    )
    for rate in (25, 100)
}
SCENARIO_STRATEGIES = ("ddp", "ddp_bf16", "gtc", "bmuf", "bmuf_gtc")

# Amazon's 2019 write-up (its two-tier GTC/BMUF, a deep LSTM on 2000 hours) gives speed-ups over one GPU at 32,
# 64 and 128 GPUs and no hardware. A setting that gives its order of the three schemes, every number
# an assumption: GPUs 8 to a machine (groups of 8 = one machine), each at 1/8 of the H100 scenario's
# rate (V100-class: 1/8 of the H100's dense peak) on Strom's DNN and words, 25 Gbit/s between machines,
# the GPUs of a machine exchanging through the host's MPI/TCP stack at PCIe rate (100 Gbit/s), and a
# software latency of 200 us a message on both tiers; BMUF's block update 0.4 ms a sync (6 passes over
# the model at ~900 GB/s); K = 50 (004's example). The two tiers trade latencies: the hybrid pays two
# on-machine message latencies every step for its GTC, flat BMUF a ring of 2 (N - 1) inter-machine hops
# every K steps, which grows with N; the same latency on both tiers puts the crossing between 64 and
# 128 GPUs (render_seeds_004() shows other latencies); with NVLink-class latency inside the machine
# (10 us) the hybrid leads from 16 GPUs on.
SEEDS_004_SPEEDUP = {  # GPUs: (GTC, BMUF, BMUF-GTC), speed-up over one GPU as 004 reports them
    32: (26.0, 36.6, 31.0),
    64: (17.0, 57.0, 42.0),
    128: (11.0, 80.0, 97.0),
}


def seeds_004_scenario(latency_s: float = 200e-6, intra_latency_s: float | None = None) -> Scenario:
    """The assumed setting of Amazon's 2019 BMUF-GTC write-up (see :data:`SEEDS_004_SPEEDUP`), with its message latencies."""
    intra_latency_s = latency_s if intra_latency_s is None else intra_latency_s
    return Scenario(
        f"Amazon 2019 (assumed): 8 GPUs a machine, 25 Gbit/s, {latency_s * 1e6:.0f} us a message",
        frames_per_s=H100_COMPUTE_FRAMES_PER_S / 8,
        frames=1024,
        net=Network(25e9, latency_s=latency_s),
        overhead_s=8 * 0.12e-3 / 3,  # the H100's thresholding at ~900 GB/s instead of ~2.5 TB/s
        per_word_s=1e-10,
        group_size=8,
        period=50,
        sync_s=0.4e-3,
        ranks_per_node=8,
        intra=Network(100e9, latency_s=intra_latency_s),
    )


def render_seeds_004(latencies=(50e-6, 200e-6, 500e-6)) -> str:
    """Markdown: the model's GTC, BMUF and BMUF-GTC speed-ups at 32, 64 and 128 GPUs in the assumed
    setting of Amazon's 2019 write-up, beside its, for a few message latencies; which of BMUF and the hybrid is
    faster at each size."""
    head = (
        "| GPUs | Amazon 2019 GTC / BMUF / hybrid | "
        + " | ".join(f"model at {a * 1e6:.0f} us: GTC / BMUF / hybrid" for a in latencies)
        + " |"
    )
    out = [head, "|---" * (head.count("|") - 1) + "|"]
    for gpus, (g, b, h) in SEEDS_004_SPEEDUP.items():
        cells = [str(gpus), f"{g:.0f} / {b:.1f} / {h:.0f} ({'BMUF' if b > h else 'hybrid'} ahead)"]
        for a in latencies:
            sc = seeds_004_scenario(a)
            pg, pb, ph = (sc.predict(s, gpus).speedup for s in ("gtc", "bmuf", "bmuf_gtc"))
            cells.append(f"{pg:.1f} / {pb:.1f} / {ph:.1f} ({'BMUF' if pb > ph else 'hybrid'} ahead)")
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def scenario_rows(scenario: Scenario, nodes=NODES, strategies=SCENARIO_STRATEGIES) -> list[dict]:
    """Speed-up over one node (nothing sent) and step time per strategy and node count."""
    rows = []
    for w in nodes:
        row: dict = {"nodes": w}
        for s in strategies:
            p = scenario.predict(s, w)
            row[s] = {
                "speedup": p.speedup,
                "step_s": p.step_s,
                "comm_s": p.comm_s,
                "frames_per_s": p.frames_per_s,
            }
        rows.append(row)
    return rows


def render_scenarios(scenarios=None) -> str:
    """Markdown: Strom's Table 2 beside the model, and the same question for H100 nodes."""
    scenarios = scenarios or [STROM_2015, H100[25], H100[100]]
    out = []
    for sc in scenarios:
        strom = sc is STROM_2015
        nodes = tuple(STROM_TABLE2) + (128,) if strom else NODES
        head = "| nodes | " + ("Strom's frames/s (speed-up) | " if strom else "")
        head += " | ".join(f"{s} speed-up" for s in SCENARIO_STRATEGIES) + " | gtc step ms (comm) |"
        out += [
            (
                f"**{sc.name}** (compute {1e3 * sc.frames / sc.frames_per_s:.2f} ms per {sc.frames}-frame step; "
                f"GTC {sc.words * WORD_BYTES / 1e3:.0f} KB per node and step; BMUF-GTC groups of "
                f"{sc.group_size}, sync every {sc.period} steps)"
            ),
            "",
            head,
            "|---" * (head.count("|") - 1) + "|",
        ]
        for row in scenario_rows(sc, nodes):
            cells = [str(row["nodes"])]
            if strom:
                f = STROM_TABLE2.get(row["nodes"])
                cells.append(f"{f:,} ({f / 10_000:.1f})" if f else "-")
            cells += [f"{row[s]['speedup']:.1f}" for s in SCENARIO_STRATEGIES]
            cells.append(f"{1e3 * row['gtc']['step_s']:.2f} ({1e3 * row['gtc']['comm_s']:.2f})")
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def plot_scenarios(path, scenarios=None, extra: dict | None = None) -> None:
    """Speed-up against nodes, one panel per scenario (``extra``: more panels as name -> rows)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = [STROM_2015, H100[25], H100[100]] if scenarios is None else scenarios
    # multiples of 8 past 8 nodes, so that BMUF-GTC's groups of 8 always fill
    nodes = (1, 2, 3, 4, 6, 8, *range(16, 129, 8))
    panels = [(sc.name, scenario_rows(sc, nodes)) for sc in scenarios] + list((extra or {}).items())
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), squeeze=False)
    for ax, (name, rows) in zip(axes[0], panels):
        nodes = [r["nodes"] for r in rows]
        for i, s in enumerate(k for k in rows[0] if k != "nodes"):
            ax.plot(nodes, [r[s]["speedup"] for r in rows], label=s, color=f"C{i}")
        ax.plot(nodes, nodes, ":", color="0.6", label="linear")
        if name == STROM_2015.name:
            ax.plot(
                list(STROM_TABLE2), [f / 10_000 for f in STROM_TABLE2.values()], "ko", label="Strom, Table 2"
            )
        gpus = name == seeds_004_scenario().name
        if gpus:
            keys = [k for k in rows[0] if k != "nodes"]
            for j, s in enumerate(("gtc", "bmuf", "bmuf_gtc")):
                points = [(w, v[j]) for w, v in SEEDS_004_SPEEDUP.items()]
                ax.plot(*zip(*points), "x", color=f"C{keys.index(s)}", ms=8, label=f"{s}, Amazon 2019")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("GPUs" if gpus else "nodes")
        ax.set_ylabel("speed-up over one GPU" if gpus else "speed-up over one node")
        ax.set_title(name, fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# GTC's and BMUF's own work per weight and per word on a GPU, as the H100 scenario estimates them
# (thresholding ~5 passes over 4 bytes a weight at ~2.5 TB/s, decoding ~0.1 ns a received word, BMUF's
# block update ~6 passes); the defaults of a scenario given on the command line.
GPU_THRESHOLD_S_PER_WEIGHT = 0.12e-3 / STROM_WEIGHTS
GPU_DECODE_S_PER_WORD = 1e-10
GPU_SYNC_S_PER_WEIGHT = 6 * 4 / 2.5e12
ALL_STRATEGIES = ("ddp", "ddp_bf16", "gtc", "gtc_stale", "ma", "bmuf", "bmuf_gtc", "dpsgd")


def user_scenario(
    weights: float,
    frames_per_s: float,
    frames: int,
    rate_bits: float,
    latency_s: float = 20e-6,
    density: float = 1e-3,
    gpus_per_node: int = 1,
    intra_rate_bits: float | None = None,
    intra_latency_s: float = 10e-6,
    period: int = 50,
    group_size: int | None = None,
    overhead_s: float | None = None,
    per_word_s: float = GPU_DECODE_S_PER_WORD,
    sync_s: float | None = None,
) -> Scenario:
    """A cluster described by a user: one GPU's (or node's) compute, the link, the model, GTC's density.

    Args:
        weights: the model's trainable elements n.
        frames_per_s: one GPU's training rate with nothing sent (its compute).
        frames: frames (samples) per GPU and step.
        rate_bits: each machine's link, bits/s each way.
        latency_s: α per message hop between machines.
        density: GTC's words per weight and step on each rank (``strategy.gtc_stats["last"]["density"]``,
            or ``target_density`` with ``tau="auto"``).
        gpus_per_node: GPUs of a machine sharing its link.
        intra_rate_bits, intra_latency_s: the link between the GPUs of a machine (None: the machine's).
        period: K of ``ma``, ``bmuf`` and ``bmuf_gtc``.
        group_size: ``bmuf_gtc``'s group (default: a machine's GPUs, or 8 with one GPU a machine).
        overhead_s, per_word_s, sync_s: GTC's thresholding per step, decoding per received word and
            BMUF's block update per sync; None: the GPU estimates above, scaled by ``weights``.

    Raises:
        ValueError: naming a value that is not positive (or a density outside (0, 1]).
    """
    for name, value in (
        ("weights", weights),
        ("frames_per_s", frames_per_s),
        ("frames", frames),
        ("period", period),
    ):
        if not value > 0:
            raise ValueError(f"{name}={value!r}: need a positive number")
    if isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int) or gpus_per_node < 1:
        raise ValueError(f"gpus_per_node={gpus_per_node!r}: need an int >= 1 (GPUs sharing a machine's link)")
    if not 0 < density <= 1:
        raise ValueError(
            f"density={density!r}: GTC's words per weight and step, need 0 < density <= 1 (e.g. 1e-3)"
        )
    intra = None
    if gpus_per_node > 1:
        intra = Network(intra_rate_bits or rate_bits, latency_s=intra_latency_s)
    return Scenario(
        f"{weights / 1e6:.3g} M weights, {frames_per_s:,.0f} frames/s a GPU, {rate_bits / 1e9:g} Gbit/s, "
        f"{gpus_per_node} GPU(s) a machine",
        frames_per_s=frames_per_s,
        frames=int(frames),
        net=Network(rate_bits, latency_s=latency_s),
        numel=int(weights),
        words=density * weights,
        overhead_s=GPU_THRESHOLD_S_PER_WEIGHT * weights if overhead_s is None else overhead_s,
        per_word_s=per_word_s,
        group_size=group_size or (gpus_per_node if gpus_per_node > 1 else 8),
        period=int(period),
        sync_s=GPU_SYNC_S_PER_WEIGHT * weights if sync_s is None else sync_s,
        ranks_per_node=gpus_per_node,
        intra=intra,
    )


def render_user(scenario: Scenario, ranks=NODES, strategies=ALL_STRATEGIES) -> str:
    """Markdown: per strategy and rank count, the speed-up over one GPU, the step (ms) and the MB each
    rank sends per step."""
    unit = "GPUs" if scenario.ranks_per_node > 1 else "nodes"
    head = f"| {unit} | " + " | ".join(f"{s}: speed-up (step ms, MB sent)" for s in strategies) + " |"
    out = [
        (
            f"**{scenario.name}** (compute {1e3 * scenario.frames / scenario.frames_per_s:.2f} ms per "
            f"{scenario.frames}-frame step; GTC {scenario.words:,.0f} words a rank and step; "
            f"K = {scenario.period}; BMUF-GTC groups of {scenario.group_size})"
        ),
        "",
        head,
        "|---" * (head.count("|") - 1) + "|",
    ]
    for w in ranks:
        cells = [str(w)]
        for s in strategies:
            if s == "bmuf_gtc" and w < 2 * scenario.group_size:
                cells.append("-")  # needs two groups at least
                continue
            p = scenario.predict(s, w)
            cells.append(f"{p.speedup:.1f}× ({1e3 * p.step_s:.2f}, {p.bytes_per_step / 1e6:.3g})")
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    import argparse
    from pathlib import Path

    from gtc_lightning.tools.cluster import parse_rate, parse_time

    parser = argparse.ArgumentParser(
        prog="python -m gtc_lightning.tools.scaling",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Without --weights: the built-in scenarios (Strom's Table 2, H100 nodes, Amazon 2019) and their plot. "
        "With --weights, --frames-per-s and --rate: your cluster, e.g. "
        "python -m gtc_lightning.tools.scaling --weights 14.6e6 --frames-per-s 2e6 --frames 1024 --rate 100gbit "
        "--gpus-per-node 8 --intra-rate 900gbit --density 1e-3",
    )
    parser.add_argument(
        "--png", type=Path, default=None, help="plot (built-in scenarios: default docs/benchmarks/scaling.png)"
    )
    mine = parser.add_argument_group("your cluster (all three of --weights, --frames-per-s, --rate)")
    mine.add_argument("--weights", type=float, help="trainable elements of the model, e.g. 14.6e6")
    mine.add_argument("--frames-per-s", type=float, help="one GPU's training rate sending nothing (frames/s)")
    mine.add_argument("--frames", type=int, default=1024, help="frames per GPU and step (default 1024)")
    mine.add_argument("--rate", help="each machine's link, as tc writes it: 10gbit, 100gbit, 400mbit")
    mine.add_argument("--latency", default="20us", help="per message hop between machines (default 20us)")
    mine.add_argument(
        "--gpus-per-node", type=int, default=1, help="GPUs sharing a machine's link (default 1)"
    )
    mine.add_argument("--intra-rate", default=None, help="link between a machine's GPUs (default: --rate)")
    mine.add_argument("--intra-latency", default="10us", help="per message inside a machine (default 10us)")
    mine.add_argument("--density", type=float, default=1e-3,
                      help="GTC's words per weight and step on a rank (default 1e-3)")  # fmt: skip
    mine.add_argument("--period", type=int, default=50, help="K of ma, bmuf, bmuf_gtc (default 50)")
    mine.add_argument(
        "--group-size", type=int, default=None, help="bmuf_gtc's group (default: --gpus-per-node or 8)"
    )
    mine.add_argument("--nodes", type=int, nargs="+", default=list(NODES), help="rank counts to predict")
    mine.add_argument("--strategies", nargs="+", default=list(ALL_STRATEGIES), choices=ALL_STRATEGIES)
    args = parser.parse_args(argv)
    given = [args.weights is not None, args.frames_per_s is not None, args.rate is not None]
    if any(given) and not all(given):
        parser.error("a cluster of your own needs --weights, --frames-per-s and --rate (e.g. --rate 25gbit)")
    if all(given):
        try:
            rate = parse_rate(args.rate)
            intra = parse_rate(args.intra_rate) if args.intra_rate else None
            if rate is None or (args.intra_rate and intra is None):
                raise ValueError("a link of 'none' has no rate to model: give one such as 25gbit")
            scenario = user_scenario(
                weights=args.weights, frames_per_s=args.frames_per_s, frames=args.frames, rate_bits=rate,
                latency_s=parse_time(args.latency), density=args.density, gpus_per_node=args.gpus_per_node,
                intra_rate_bits=intra, intra_latency_s=parse_time(args.intra_latency), period=args.period,
                group_size=args.group_size,
            )  # fmt: skip
        except ValueError as err:
            parser.error(str(err))
        if min(args.nodes) < 1:
            parser.error(f"--nodes {args.nodes}: rank counts must be >= 1")
        print(render_user(scenario, args.nodes, args.strategies))
        if args.png:
            args.png.parent.mkdir(parents=True, exist_ok=True)
            plot_scenarios(args.png, [scenario])
            print(f"plot: {args.png}")
        return
    print(render_scenarios())
    print(f"**{seeds_004_scenario().name}**, and at other latencies (both tiers):\n")
    print(render_seeds_004())
    png = args.png or Path("docs/benchmarks/scaling.png")
    png.parent.mkdir(parents=True, exist_ok=True)
    plot_scenarios(png, [STROM_2015, H100[25], H100[100], seeds_004_scenario()])
    print(f"plot: {png}")


if __name__ == "__main__":
    main()
