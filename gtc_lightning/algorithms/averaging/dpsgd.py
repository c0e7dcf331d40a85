"""Decentralised parallel SGD (D-PSGD), torch only: the ring, the neighbour exchange and its state.

Every step, each rank averages its parameters with its ring neighbours instead of all-reducing
gradients (Lian et al., NeurIPS 2017): the exchange is launched before the forward pass
(:meth:`DPSGDState.launch`) and completed after the backward pass (:meth:`DPSGDState.complete`), the
optimizer then applies the rank's own gradient. The steps are numbered in
:mod:`gtc_lightning.strategies.dpsgd`, which wires this state into Lightning.
"""

import functools
import math
import time

import torch
import torch.distributed as dist
from torch.optim import Optimizer
from typing_extensions import override

from gtc_lightning.algorithms.averaging.model_averaging import (
    AveragingState,
    SyncStats,
    all_mean,
    flatten,
    unflatten_,
)
from gtc_lightning.algorithms.common import allreduce_bytes


def ring_neighbours(rank: int, world: int) -> list[int]:
    """The ring neighbours of ``rank`` among ``world`` ranks: ``[left, right]``, or the one other
    rank when ``world == 2``."""
    if world < 2:
        raise ValueError(f"a ring needs at least 2 ranks, got {world}")
    left, right = (rank - 1) % world, (rank + 1) % world
    return [left] if left == right else [left, right]


def check_ring_size(world: int) -> None:
    if world < 2:
        raise ValueError(
            f"dpsgd averages each rank with its ring neighbours, so it needs at least 2 ranks; got {world}. "
            "Train with more devices (or num_nodes), or with a single-device strategy"
        )


def neighbour_ops(sent: torch.Tensor, received: list[torch.Tensor], peers: list[int], group=None) -> list:
    """The point-to-point ops of one neighbour exchange, every receive posted before any send.

    On gloo the order decides the speed: with the sends first, two ranks that send to each other
    take turns on the link (measured on 2 and 4 emulated nodes at 100 Mbit/s, 6.2 MB to each
    neighbour: 0.9-1.0 s on 2 nodes, 1.9-2.1 s on 4, about twice the wire time); with the receives
    posted first both directions flow at once (0.53 s and 1.07 s, the wire time). What arrives is
    the same either way."""
    ops = [dist.P2POp(dist.irecv, buf, peer, group) for peer, buf in zip(peers, received)]
    return ops + [dist.P2POp(dist.isend, sent, peer, group) for peer in peers]


class DPSGDState(AveragingState):
    """State of D-PSGD: the ring, the exchange in flight and the statistics of
    :class:`~gtc_lightning.algorithms.averaging.model_averaging.AveragingState` (a sync every step, ``period=1``), plus the
    newest spread measurement.

    Args:
        warmup_steps: optimizer steps of dense gradient all-reduce before the neighbour averaging starts.
        process_group: the ring's ranks (``None``: all ranks), at least 2.
    """

    def __init__(self, warmup_steps: int = 0, process_group: dist.ProcessGroup | None = None) -> None:
        world = dist.get_world_size(process_group)
        check_ring_size(world)
        super().__init__(period=1, warmup_steps=warmup_steps, process_group=process_group)
        rank = dist.get_rank(process_group)
        to_global = (lambda r: r) if process_group is None else (lambda r: dist.get_global_rank(process_group, r))
        self.neighbours = [to_global(r) for r in ring_neighbours(rank, world)]
        # The internal state.
        self._works: list = []
        self._buffers: dict[tuple, list[torch.Tensor]] = {}  # (numel, dtype, device) -> [sent, received...]
        self._current: tuple | None = None  # (parameters, sent, received) of the exchange in flight
        self._host_s = 0.0  # host seconds of the launch, the wait and the average
        self._done: tuple[int, float] | None = None  # (bytes, host seconds) of this step's exchange
        # The statistics.
        self.totals["spread_bytes"] = 0
        self.measured: dict | None = None  # the newest spread: {"step", "spread", "distance"}

    @property
    def averaging(self) -> bool:
        """Whether the step about to run averages with the neighbours (the warmup is over)."""
        return self.step >= self.warmup_steps

    def launch(self, params: list[torch.Tensor]) -> None:
        """Step 2: send a flat copy of ``params`` to the neighbours and receive theirs, asynchronously."""
        started = time.perf_counter()
        numel = sum(p.numel() for p in params)
        dtype = functools.reduce(torch.promote_types, (p.dtype for p in params))
        key = (numel, dtype, params[0].device)
        buffers = self._buffers.get(key)
        if buffers is None:
            buffers = [torch.empty(numel, dtype=dtype, device=params[0].device) for _ in range(1 + len(self.neighbours))]
            self._buffers = {key: buffers}
        sent, received = buffers[0], buffers[1:]
        with torch.no_grad():
            torch.cat([p.detach().reshape(-1).to(dtype) for p in params], out=sent)
        self._works = dist.batch_isend_irecv(neighbour_ops(sent, received, self.neighbours, self.process_group))
        self._current = (params, sent, received)
        self._host_s = time.perf_counter() - started

    def complete(self) -> None:
        """Step 3: wait for the neighbours' copies and write the neighbour average into the parameters."""
        if self._current is None:  # (once, should an optimizer call the closure again)
            return
        started = time.perf_counter()
        params, sent, received = self._current
        self._current = None
        for work in self._works:
            work.wait()
        self._works = []
        # x + ((l - x) + (r - x)) / 3: differences first, so that agreeing ranks keep their bits.
        for buf in received:
            buf.sub_(sent)
        for buf in received[1:]:
            received[0].add_(buf)
        sent.add_(received[0].div_(len(received) + 1))
        unflatten_(sent, params)
        size = sent.numel() * sent.element_size() * len(self.neighbours)
        self._done = (size, self._host_s + time.perf_counter() - started)

    @override
    def after_step(self, params: list[torch.Tensor], optimizers: list[Optimizer]) -> SyncStats:
        """Count one optimizer step: a dense warmup step, or the exchange :meth:`complete` did."""
        if self._done is None:
            return super().after_step(params, optimizers)
        (size, seconds), self._done = self._done, None
        self.step += 1
        stats = SyncStats(
            step=self.step, mode="sync", numel=sum(p.numel() for p in params), world_size=self.world_size,
            bytes_sent=size, bytes_received=size, exchange_s=seconds,
        )  # fmt: skip
        self._record(stats)
        return stats

    @override
    def exchange(self, params: list[torch.Tensor], optimizers: list[Optimizer]) -> tuple[int, int]:
        """Nothing after the step: the averaging happened inside it (an optimizer without parameters)."""
        return 0, 0

    def measure_spread(self, params: list[torch.Tensor]) -> dict:
        """The RMS distance of each rank's ``params`` from their mean over the ranks (a collective:
        call it on every rank). Returns ``{"step", "spread" (all ranks), "distance" (this rank)}``."""
        with torch.no_grad():
            mean, size = all_mean(params, self.process_group)
            squared = (flatten(params).to(mean.dtype) - mean).double().pow(2).mean().reshape(1)
            distance = math.sqrt(float(squared))
            dist.all_reduce(squared, group=self.process_group)
        self.totals["spread_bytes"] += size + allreduce_bytes(1, self.world_size, 8)
        spread = math.sqrt(float(squared) / self.world_size)
        self.measured = {"step": self.step, "spread": spread, "distance": distance}
        return self.measured

    def average_(self, params: list[torch.Tensor]) -> None:
        """Overwrite every rank's ``params`` with their mean over the ranks (a collective)."""
        with torch.no_grad():
            mean, _ = all_mean(params, self.process_group)
            unflatten_(mean, params)

    @override
    def __getstate__(self) -> dict:
        """As :class:`AveragingState`'s, without the exchange's buffers and requests."""
        return {**super().__getstate__(), "_works": [], "_buffers": {}, "_current": None}

    @override
    def stats(self) -> dict:
        """``{"step", "last", "total", "spread"}``; ``total["ratio_fp32"]``: DDP's fp32 all-reduce bytes
        over the same steps per byte sent (1 with 2 ranks, below 1 with 3: D-PSGD sends more, to fewer
        peers)."""
        return {**super().stats(), "spread": self.measured}
