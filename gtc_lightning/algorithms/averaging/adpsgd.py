"""Asynchronous decentralised parallel SGD (AD-PSGD), torch only: the bipartite pairing, the pair
exchange that runs in a background thread, and its state.

Lian, Zhang, Zhang & Liu, "Asynchronous Decentralized Parallel Stochastic Gradient Descent", ICML
2018; the form IBM trains its Switchboard LSTM with (Zhang et al., ICASSP 2019). Each rank
takes local optimizer steps on its own gradient; after each of them it averages its parameters
with one peer, without a global barrier:

* The ranks are split in two: even ranks are *active*, odd ranks *passive*. Only an active rank
  starts an exchange, and only with a passive one, so that no two ranks wait for each other in a
  cycle (the communication graph is bipartite: deadlock-free). The peer of an active rank's n-th
  exchange comes from a fixed schedule (:func:`~gtc_lightning.algorithms.averaging.pairing.schedule_peer`): ``"ring"`` alternates between its
  right and left ring neighbours as Zhang et al. do, ``"random"`` draws a passive rank from a seeded
  hash of (seed, rank, n). The schedule keeps no state but the exchange counter, which a
  checkpoint keeps.
* An active rank hands a flat copy ``s_a`` of its parameters to its communication thread after its
  step and goes on computing. The thread sends ``s_a`` to the peer and receives the peer's model
  ``s_p``; both compute the same mean ``m = (s_a + s_p) * 0.5`` (addition is commutative in floating
  point: the two means are equal bit for bit).
* A passive rank's communication thread waits for requests from any active rank. For each it sends
  the newest model its training loop published (moved by the means of the exchanges since) while the
  active rank's arrives, and keeps the mean; a slow passive rank answers at the speed of its
  network, not of its compute. The training loop holds the lock it shares with the thread only for
  CPU arithmetic and pointer swaps: the copies between the device and host memory (which on a GPU
  wait for the step's kernels, and for any collective the step queued) run outside it, so that the
  thread answers while the step computes.
* A mean is applied by the training loop at its next step boundary (:meth:`ADPSGDState.after_step`) as
  ``x <- m + (x - s)``: the local steps taken since ``s`` was sent are kept on top of the average.
  When none were taken the rank holds exactly ``m``. The sum of the ranks' models is kept (up to
  rounding): each pair's exchange moves the two by opposite amounts.
* Staleness: the local steps between the model a rank sent and the step boundary that applies the
  mean. It is at most ``max_staleness`` on every rank (Lian et al.'s bound T holds for every worker).
  An exchange may stay in flight for several steps (a slow link or a busy peer); an active rank whose
  exchange reached ``max_staleness`` steps blocks at its step boundary until it lands, and so does a
  passive rank whose thread is still serving a request with a model that old. When an exchange takes
  less than a step a passive rank applies each mean one step after the model it sent (staleness 1,
  the best the seed reports for overlapped communication). An active rank starts a new exchange once
  the last one landed.

A global synchronisation point (an epoch end, validation, a checkpoint, the end of fit) calls
:meth:`ADPSGDState.drain` on every rank: an active rank waits for its exchange and tells every
passive rank that it stops; a passive rank serves until every active rank stopped. Then every mean
is applied, nothing is in flight, and collectives on the default group may run. After an exception
:meth:`ADPSGDState.abandon` lets the thread go: the means in flight are dropped, and a thread left
blocked in the exchange's group (until the group's timeout) touches nothing of a later fit.

The exchange runs on a gloo process group of its own (CPU tensors; on GPUs the flat copies go
through host memory, as Zhang et al. average on the CPU), used by one thread of each process at a time.

**Coded exchanges** (``compress="gtc"``, beyond the seeds): a pair sends Strom's threshold words
instead of whole models (the words: :mod:`gtc_lightning.algorithms.averaging.coded_exchange`). Both ranks of a pair (an *edge*: an active rank and one passive peer) keep
the same reference model ``r``: the mean of all ranks measured at the last synchronisation point
(:meth:`ADPSGDState.measure_spread`; the strategy measures it as fit starts too), or where there is
none the mean of the pair's first exchange, which is then dense. Each exchange on the edge sends, from each side, the
``k = ceil(density * n)`` largest entries of its residual ``x - r`` as words (sign bit + 31-bit
index, Strom's format) and ``tau``, the smallest of their magnitudes: the message decodes to ``q``, ``+-tau`` at its words.
Both sides then move by half the difference of what was sent, ``x_a += (q_p - q_a) / 2`` and
``x_p += (q_a - q_p) / 2`` (opposite amounts: the sum is kept), and both add the mean of what was
sent to the reference, ``r += (q_a + q_p) / 2``, computed identically on the two sides. What a rank
did not send stays in its residual ``x - r`` for the next exchange on that edge (error feedback).
Were every entry sent exactly, this is the dense mean. Each rank keeps one reference per peer it
exchanged with since the last synchronisation point (a model's worth of host memory each: 1 at 2
ranks, 2 with the ring schedule; with ``peering="random"`` an active rank may reach every passive
rank, W/2 references, and a passive rank every active one). The references are set anew at every
synchronisation point: nothing of them goes into a checkpoint.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.optim import Optimizer
from typing_extensions import override

from gtc_lightning.algorithms.averaging.coded_exchange import coded_words, decode_largest, encode_largest
from gtc_lightning.algorithms.averaging.model_averaging import (
    AveragingState,
    SyncStats,
    all_mean,
    flatten,
    unflatten_,
)
from gtc_lightning.algorithms.averaging.pairing import actives, check_world, passives, schedule_peer
from gtc_lightning.algorithms.common import allreduce_bytes, check_int

log = logging.getLogger(__name__)

COMPRESSIONS = ("none", "gtc")
REQUEST, STOP = 1, 0  # the header's first word
DENSE, CODED = 0, 1  # the header's last word: what the payload is
HEADER_TAG, MODEL_TAG, REPLY_HEADER_TAG, REPLY_TAG = 11, 12, 13, 14
HEADER_WORDS = 4  # [kind, the sender's step, the sender's rank, DENSE or CODED]
ADPSGD_TOTALS = ("applied", "staleness_sum", "staleness_max", "lag_sum", "blocked_s")


def check_compression(compress: str, density: float) -> None:
    """``compress`` one of :data:`COMPRESSIONS`; ``0 < density <= 1``."""
    if compress not in COMPRESSIONS:
        raise ValueError(
            f"Expect compress in {COMPRESSIONS} (what a pair exchange sends: whole models, or Strom's threshold "
            f"words of the difference from the pair's reference), got {compress!r}"
        )
    if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0 < density <= 1:
        raise ValueError(
            f"adpsgd: density={density!r} must be a number in (0, 1]: the share of the parameters a coded "
            "exchange sends (e.g. 0.01)"
        )


@dataclass
class Landed:
    """One exchange's outcome on this rank: the mean (dense) or the move to add (``delta``, coded), the
    model this rank sent and the step it was published at, the peer, the peer's step, the seconds the
    exchange took (the thread's) and the payload's bytes this rank sent."""

    mean: torch.Tensor | None
    sent: torch.Tensor
    sent_step: int
    peer: int
    peer_step: int
    seconds: float
    bytes: int
    delta: torch.Tensor | None = None


class _Run:
    """What one run of the communication thread (from :meth:`ADPSGDState.start` to the drain) works
    with: the group, the queues, and the flag :meth:`ADPSGDState.abandon` sets. A thread that an
    exception left behind keeps its own and writes nothing of a later run's."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.jobs: queue.Queue = queue.Queue()  # active: (sent, step, peer) or None to stop
        self.arrived: queue.Queue = queue.Queue()  # active: Landed, or an exception
        self.abandoned = False


class ADPSGDState(AveragingState):
    """State of AD-PSGD on this rank: its role, the exchange schedule, the communication thread and
    what it brought, and the statistics of :class:`AveragingState` plus the staleness.

    Args:
        comm_group: a gloo process group over all ranks (``dist.new_group(backend="gloo")``), used
            only by the exchange.
        max_staleness: local steps an exchange may stay in flight, on either side of it: at that many
            the rank blocks at its step boundary until it lands (>= 1).
        peering: ``"ring"`` or ``"random"`` (:func:`~gtc_lightning.algorithms.averaging.pairing.schedule_peer`).
        seed: the ``"random"`` schedule's seed.
        warmup_steps: optimizer steps of dense gradient all-reduce before the exchanges start.
        compress: ``"none"`` (whole models) or ``"gtc"`` (coded exchanges, see the module's text).
        density: the share of the parameters a coded message carries (0 < density <= 1).
    """

    def __init__(
        self,
        comm_group: dist.ProcessGroup,
        max_staleness: int = 2,
        peering: str = "ring",
        seed: int = 0,
        warmup_steps: int = 0,
        compress: str = "none",
        density: float = 0.01,
    ) -> None:
        check_int("max_staleness", max_staleness, 1, "local steps an exchange may stay in flight")
        check_int("seed", seed, 0, "the seed of peering='random'")
        check_compression(compress, density)
        world = dist.get_world_size()
        check_world(world, peering)
        super().__init__(period=1, warmup_steps=warmup_steps, process_group=None)
        # The hyper-parameters.
        self.comm_group = comm_group
        self.max_staleness = max_staleness
        self.peering = peering
        self.seed = seed
        self.compress = compress
        self.density = float(density)
        self.rank = dist.get_rank()
        self.active = self.rank % 2 == 0
        self.actives, self.passives = actives(world), passives(world)
        # The internal state.
        self.exchanges = 0  # exchanges this (active) rank started: the schedule's position
        self._lock = threading.Lock()  # the training loop's and the thread's: CPU arithmetic and swaps only
        self._changed = threading.Condition(self._lock)  # passive: a serve landed (or the thread failed)
        self._thread: threading.Thread | None = None
        self._run: _Run | None = None  # the thread's group and queues
        self._left: list[tuple[threading.Thread, dist.ProcessGroup]] = []  # threads abandon() left, their group
        self._in_flight: tuple[int, int] | None = None  # active: (step sent, peer)
        self._landed: list[Landed] = []  # passive: the means the thread kept, not applied yet
        self._view: torch.Tensor | None = None  # passive: the newest model (published, or a mean since)
        self._view_step = 0
        self._serving: int | None = None  # passive: the step of the view the thread is sending now
        self._error: BaseException | None = None
        self._blocked_s = 0.0  # this step's wait for the staleness bound
        self._refs: dict[int, torch.Tensor] = {}  # compress="gtc": each edge's reference, by peer (thread only)
        # The statistics.
        for key in ADPSGD_TOTALS:
            self.totals[key] = 0
        self.totals["spread_bytes"] = 0
        self.last_staleness: dict | None = None  # the newest step's: {"applied", "staleness", "lag", "blocked_s"}
        self.measured: dict | None = None  # the newest spread: {"step", "spread", "distance"}

    @property
    def averaging(self) -> bool:
        """Whether the warmup is over (the exchanges run)."""
        return self.step >= self.warmup_steps

    @property
    def running(self) -> bool:
        """Whether the communication thread runs (since the first step after the last sync point)."""
        return self._thread is not None

    def uses(self, group: dist.ProcessGroup) -> bool:
        """Whether a thread of this state may still call into ``group`` (the running one, or one that
        :meth:`abandon` left blocked in it): the group must not be destroyed under it."""
        if self._thread is not None and self._run is not None and self._run.group is group:
            return True
        self._left = [(thread, g) for thread, g in self._left if thread.is_alive()]
        return any(g is group for _, g in self._left)

    # ---- the training loop's side ----------------------------------------------------------------

    def start(self, params: list[torch.Tensor]) -> None:
        """Start the communication thread (no-op when it runs): call it on every rank before the
        first local step after a global synchronisation point."""
        if self._thread is not None:
            return
        self._error = None
        self._run = run = _Run(self.comm_group)
        if self.active:
            target = self._active_loop
        else:
            self._view, self._view_step, self._serving = self._flat(params), self.step, None
            target = self._passive_loop
        self._thread = threading.Thread(target=target, args=(run,), name=f"adpsgd-rank{self.rank}", daemon=True)
        self._thread.start()

    @override
    def after_step(self, params: list[torch.Tensor], optimizers: list[Optimizer]) -> SyncStats:
        """The step boundary: apply the means that landed, and on an active rank start the next
        exchange; on either side block first when the exchange in flight reached ``max_staleness``."""
        if not self.averaging:
            return super().after_step(params, optimizers)  # a dense warmup step
        started = time.perf_counter()
        self.step += 1
        self._blocked_s = 0.0
        self._raise_error()
        landed: list[Landed] = []
        if self.active:
            landed += self._collect(params, block=False)
            if self._in_flight is not None and self.step - self._in_flight[0] >= self.max_staleness:
                landed += self._collect(params, block=True)
            if self._in_flight is None and self._thread is not None:
                assert self._run is not None
                peer = schedule_peer(self.rank, len(self.actives) + len(self.passives), self.exchanges,
                                     self.peering, self.seed)  # fmt: skip
                self.exchanges += 1
                self._in_flight = (self.step, peer)
                self._run.jobs.put((self._flat(params), self.step, peer))
        else:
            landed = self._publish(params)
        stats = self._count(params, landed, time.perf_counter() - started)
        self._record(stats)
        return stats

    def _publish(self, params: list[torch.Tensor]) -> list[Landed]:
        """Passive: apply the means that landed and publish the result as the model the thread sends.
        The copies from and to the device run outside the lock (on a GPU the first waits for the
        step's kernels): the thread serves meanwhile, from the model published at the last boundary."""
        x = self._flat(params)
        with self._changed:
            if self._serving is not None and self.step - self._serving >= self.max_staleness:
                waited = time.perf_counter()
                while self._serving is not None and self.step - self._serving >= self.max_staleness:
                    if self._error is not None or self._thread is None or not self._thread.is_alive():
                        break
                    self._changed.wait(timeout=1.0)
                self._blocked_s += time.perf_counter() - waited
            landed, self._landed = self._landed, []
            x = self._moved(x, landed)
            self._view, self._view_step = x, self.step
        self._raise_error()
        if landed:
            unflatten_(x, params)
        return landed

    def drain(self, params: list[torch.Tensor]) -> bool:
        """A global synchronisation point, on every rank: finish the exchanges, stop the thread and
        apply every mean. Returns whether anything ran (``False``: it was stopped already)."""
        if self._thread is None:
            return False
        assert self._run is not None
        landed: list[Landed] = []
        if self.active:
            if self._in_flight is not None:
                landed += self._collect(params, block=True)
            self._run.jobs.put(None)
            self._thread.join()
            self._raise_error()
            header = torch.tensor([STOP, self.step, self.rank, DENSE], dtype=torch.int64)
            works = [dist.isend(header, peer, group=self._run.group, tag=HEADER_TAG) for peer in self.passives]
            for work in works:
                work.wait()
        else:
            self._thread.join()  # it returns once every active rank said it stops
            self._raise_error()
            with self._lock:
                landed, self._landed = self._landed, []
                self._view = None
            self._apply(params, landed)
        self._thread = self._run = None
        self._forget_references()
        for item in landed:  # (the step counter stays: staleness counts the steps since each was sent)
            self._note(item)
            for key in ("bytes_sent", "bytes_received"):
                self.totals[key] += item.bytes
        return True

    def _forget_references(self) -> None:
        """Drop every edge's reference (at a synchronisation point, the thread stopped): the next
        exchange of each edge is dense again."""
        self._refs.clear()

    def abandon(self) -> None:
        """After an exception in the training loop: let the thread go without waiting for it (an
        active rank's stops after its exchange; a passive rank's stays blocked in the group until its
        timeout, a daemon thread that does not keep the process alive). The means in flight are
        dropped; a later fit starts a thread of its own, on its own group, and the one left here
        writes nothing of it."""
        run, thread = self._run, self._thread
        if run is not None:
            with self._changed:
                run.abandoned = True
                self._landed, self._view, self._serving = [], None, None
                self._changed.notify_all()
            run.jobs.put(None)
            if thread is not None and thread.is_alive():
                self._left.append((thread, run.group))
        self._thread = self._run = None
        self._in_flight = None
        self._refs = {}

    def _flat(self, params: list[torch.Tensor]) -> torch.Tensor:
        """A flat host copy of ``params`` (on a GPU: it waits for the kernels queued before it)."""
        return flatten(params).cpu()

    @staticmethod
    def _moved(x: torch.Tensor, landed: list[Landed]) -> torch.Tensor:
        """``x <- m + (x - s)`` for each landed mean in turn (exactly ``m`` when ``x`` is still ``s``);
        ``x <- x + delta`` for a coded exchange's move. New tensors: ``x`` is not written."""
        for item in landed:
            x = x + item.delta if item.delta is not None else item.mean + (x - item.sent)
        return x

    def _apply(self, params: list[torch.Tensor], landed: list[Landed]) -> None:
        """The landed means (:meth:`_moved`) applied to ``params``."""
        if landed:
            unflatten_(self._moved(self._flat(params), landed), params)

    def _collect(self, params: list[torch.Tensor], block: bool) -> list[Landed]:
        """Active: the exchange in flight, applied if it landed (waited for when ``block``)."""
        if self._in_flight is None:
            return []
        assert self._run is not None
        try:
            if block:
                waited = time.perf_counter()
                item = self._run.arrived.get()
                self._blocked_s += time.perf_counter() - waited
            else:
                item = self._run.arrived.get_nowait()
        except queue.Empty:
            return []
        self._in_flight = None
        if isinstance(item, BaseException):
            self._error = item
            self._raise_error()
        self._apply(params, [item])
        return [item]

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(
                f"adpsgd: rank {self.rank}'s exchange thread failed at step {self.step}: {error!r}. A peer that "
                "stopped or a timeout of the exchange's gloo group (the strategy's `timeout`) are the usual causes"
            ) from error

    def _note(self, item: Landed) -> tuple[int, int]:
        staleness, lag = self.step - item.sent_step, item.sent_step - item.peer_step
        self.totals["applied"] += 1
        self.totals["staleness_sum"] += staleness
        self.totals["staleness_max"] = max(self.totals["staleness_max"], staleness)
        self.totals["lag_sum"] += lag
        return staleness, lag

    def _count(self, params: list[torch.Tensor], landed: list[Landed], seconds: float) -> SyncStats:
        numel = sum(p.numel() for p in params)
        size = sum(item.bytes for item in landed)
        noted = [self._note(item) for item in landed]
        self.totals["blocked_s"] += self._blocked_s
        self.last_staleness = {
            "applied": len(landed),
            "staleness": max((s for s, _ in noted), default=0),
            "lag": sum(lag for _, lag in noted) / len(noted) if noted else 0.0,
            "blocked_s": self._blocked_s,
        }
        return SyncStats(
            step=self.step, mode="sync" if landed else "local", numel=numel, world_size=self.world_size,
            bytes_sent=size, bytes_received=size, exchange_s=seconds,
        )  # fmt: skip

    # ---- the communication thread ------------------------------------------------------------------

    def _active_loop(self, run: _Run) -> None:
        while True:
            job = run.jobs.get()
            if job is None:
                return
            sent, step, peer = job
            try:
                run.arrived.put(self._exchange(run, sent, step, peer))
            except BaseException as error:  # noqa: BLE001  (the training loop raises it)
                run.arrived.put(error)
                return

    def _wait(self, works: list) -> None:
        """Wait for an exchange's sends and receives (both directions at once)."""
        for work in works:
            work.wait()

    def _exchange(self, run: _Run, sent: torch.Tensor, step: int, peer: int) -> Landed:
        started = time.perf_counter()
        group = run.group
        ref = self._refs.get(peer)
        payload = sent if ref is None else encode_largest(sent - ref, coded_words(sent.numel(), self.density))
        header = torch.tensor([REQUEST, step, self.rank, DENSE if ref is None else CODED], dtype=torch.int64)
        reply_header, reply = torch.empty(HEADER_WORDS, dtype=torch.int64), torch.empty_like(payload)
        self._wait([  # the receives posted before the sends, as for dpsgd's neighbour exchange
            dist.irecv(reply_header, peer, group=group, tag=REPLY_HEADER_TAG),
            dist.irecv(reply, peer, group=group, tag=REPLY_TAG),
            dist.isend(header, peer, group=group, tag=HEADER_TAG),
            dist.isend(payload, peer, group=group, tag=MODEL_TAG),
        ])  # fmt: skip
        size, peer_step = payload.numel() * payload.element_size(), int(reply_header[1])
        if ref is not None:
            mine, theirs = decode_largest(payload, sent.numel()), decode_largest(reply, sent.numel())
            with self._lock:
                if not run.abandoned:
                    self._refs[peer] = ref + (mine + theirs) * 0.5
            delta = (theirs - mine) * 0.5
            return Landed(None, sent, step, peer, peer_step, time.perf_counter() - started, size, delta)
        mean = (sent + reply).mul_(0.5)
        if self.compress == "gtc":
            with self._lock:
                if not run.abandoned:
                    self._refs[peer] = mean  # (never written in place)
        return Landed(mean, sent, step, peer, peer_step, time.perf_counter() - started, size)

    def _passive_loop(self, run: _Run) -> None:
        try:
            stopped = 0
            header = torch.empty(HEADER_WORDS, dtype=torch.int64)
            while stopped < len(self.actives):
                src = dist.recv(header, None, group=run.group, tag=HEADER_TAG)
                kind, peer_step, _, payload = header.tolist()
                if kind == STOP:
                    stopped += 1
                    continue
                self._serve(run, src, peer_step, payload == CODED)
        except BaseException as error:  # noqa: BLE001  (the training loop raises it)
            with self._changed:
                if not run.abandoned:
                    self._error, self._serving = error, None
                    self._changed.notify_all()

    def _serve(self, run: _Run, src: int, peer_step: int, coded: bool = False) -> None:
        """One request: the newest model (or its coded residual) goes back while the peer's arrives
        (both directions at once), then the mean (or the move) is kept. Should the training loop
        publish a newer model meanwhile, the model the next request gets is that one moved by the mean:
        ``m + (newer - sent)``."""
        started = time.perf_counter()
        with self._lock:
            if run.abandoned:
                return
            sent, sent_step = self._view, self._view_step
            ref = self._refs.get(src)
            self._serving = sent_step
        assert sent is not None
        if coded and ref is None:
            raise RuntimeError(
                f"adpsgd: rank {src} sent a coded exchange, but rank {self.rank} holds no reference for their pair "
                "(every rank must be given the same compress setting)"
            )
        payload = encode_largest(sent - ref, coded_words(sent.numel(), self.density)) if coded else sent
        incoming = torch.empty_like(payload)
        reply_header = torch.tensor([REQUEST, sent_step, self.rank, CODED if coded else DENSE], dtype=torch.int64)
        self._wait([
            dist.irecv(incoming, src, group=run.group, tag=MODEL_TAG),
            dist.isend(reply_header, src, group=run.group, tag=REPLY_HEADER_TAG),
            dist.isend(payload, src, group=run.group, tag=REPLY_TAG),
        ])  # fmt: skip
        size = payload.numel() * payload.element_size()
        if coded:
            theirs, mine = decode_largest(incoming, sent.numel()), decode_largest(payload, sent.numel())
            ref, delta = ref + (theirs + mine) * 0.5, (theirs - mine) * 0.5
            landed = Landed(None, sent, sent_step, src, peer_step, time.perf_counter() - started, size, delta)
        else:
            mean = (incoming + sent).mul_(0.5)
            ref, delta = mean, None  # (the reference: never written in place)
            landed = Landed(mean, sent, sent_step, src, peer_step, time.perf_counter() - started, size)
        with self._changed:  # atomic with the training loop's step boundary
            if run.abandoned:
                return
            if coded or self.compress == "gtc":
                self._refs[src] = ref
            if delta is not None:
                self._view = self._view + delta
            else:
                self._view = mean if self._view is sent else mean + (self._view - sent)
            self._landed.append(landed)
            self._serving = None
            self._changed.notify_all()

    # ---- the collectives of the synchronisation points -------------------------------------------------

    def measure_spread(self, params: list[torch.Tensor]) -> dict:
        """The RMS distance of each rank's ``params`` from their mean over the ranks (a collective on
        the default group: call it on every rank, at a synchronisation point). With ``compress="gtc"``
        the mean (the same on every rank) becomes every edge's reference, so that the exchanges after
        the synchronisation point are coded from the first."""
        with torch.no_grad():
            mean, size = all_mean(params, None)
            if self.compress == "gtc" and self._thread is None:  # every edge's reference: the mean, the same everywhere
                shared = mean.detach().to(torch.float32).cpu()
                self._refs = {peer: shared for peer in (self.passives if self.active else self.actives)}
            squared = (flatten(params).to(mean.dtype) - mean).double().pow(2).mean().reshape(1)
            distance = math.sqrt(float(squared))
            dist.all_reduce(squared)
        self.totals["spread_bytes"] += size + allreduce_bytes(1, self.world_size, 8)
        spread = math.sqrt(float(squared) / self.world_size)
        self.measured = {"step": self.step, "spread": spread, "distance": distance}
        return self.measured

    def average_(self, params: list[torch.Tensor]) -> None:
        """Overwrite every rank's ``params`` with their mean over the ranks (a collective)."""
        with torch.no_grad():
            mean, _ = all_mean(params, None)
            unflatten_(mean, params)

    # ---- checkpoints and statistics ----------------------------------------------------------------

    @override
    def state_dict(self) -> dict:
        """The step counter, the schedule's position and the statistics (taken at a synchronisation
        point: nothing is in flight)."""
        if self._thread is not None:
            raise RuntimeError("adpsgd: the state is saved at a synchronisation point; call drain() first")
        return {**super().state_dict(), "exchanges": self.exchanges}

    @override
    def load_state_dict(self, saved: dict) -> None:
        super().load_state_dict(saved)
        self.exchanges = int(saved.get("exchanges", 0))

    @override
    def __getstate__(self) -> dict:
        """As :class:`AveragingState`'s, without the thread, its queues and lock, and the group."""
        state = {**self.__dict__, "process_group": None, "spread": None, "comm_group": None}
        state.update(_lock=None, _changed=None, _thread=None, _run=None, _left=[], _landed=[], _view=None,
                     _in_flight=None, _serving=None, _refs={})
        return state

    @override
    def stats(self) -> dict:
        """``{"step", "last", "total", "staleness", "spread"}``: ``staleness`` the newest step's
        (``applied`` means, their largest ``staleness`` in local steps, the mean ``lag``: how many
        steps the peers' models were behind the ones this rank sent, ``blocked_s``); ``total`` adds
        ``applied`` (means), ``staleness_max``, ``staleness_mean``, ``lag_mean`` and ``blocked_s``."""
        out = super().stats()
        applied = self.totals["applied"]
        out["total"]["staleness_mean"] = self.totals["staleness_sum"] / applied if applied else 0.0
        out["total"]["lag_mean"] = self.totals["lag_sum"] / applied if applied else 0.0
        return {**out, "staleness": self.last_staleness, "spread": self.measured}

