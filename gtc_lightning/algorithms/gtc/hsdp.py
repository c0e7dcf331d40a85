"""GTC across the replicate dimension of HSDP: FSDP2 shards the parameters within a group of ranks
(the shard dimension), and the ranks that hold the same shard (the replicate dimension) exchange
threshold-compressed words instead of all-reducing the shard's gradient.

FSDP2 is applied on the shard dimension alone, so that its reduce-scatter leaves on every rank the
mean over the shard group of the gradients of its shard, and calls the module's all-reduce hook
(``FSDPModule.set_all_reduce_hook``) with that flat shard ``g`` ``[n]``; :meth:`HSDPGTCState.reduce`
replaces it in place by the estimate of its mean over the replicate group. Per FSDP module and rank:

1. Dense warm-up: for the first ``warmup_steps`` calls, all-reduce ``g`` over the replicate group.
2. Residual: ``r += g``; every element with ``|r| > tau`` emits one word ``index | sign << 31`` (in
   ascending index order) and moves ``r`` by ``∓tau`` (the same primitives as the DDP hook). A
   gradient with a NaN/Inf is not added (the residual stays finite) and sends no word.
3. Header: every replica's word count, message bytes, non-finite flag and (``per_step_tau``) its own
   tau, all-gathered in the replicate group.
4. Words: every replica's message (Golomb-Rice coded with ``coding="rice"``) to every other replica
   of the shard (all-to-all of uneven messages).
5. Decode into ``g`` itself: ``g[i] = tau / R * (#plus - #minus)``, counted as exact float integers,
   so every replica of the shard writes the same bits whatever the order the words arrived in; with
   ``per_step_tau`` each replica's words are worth its own ``tau_r / R``, added replica by replica in
   rank order (no index twice within a replica), the same bits on every replica. If a
   replica had a non-finite gradient, ``g`` becomes NaN on every replica (a dense all-reduce would
   give the same), and this rank's residual keeps its own gradient: nothing is lost.
6. Automatic tau: the replicas of a shard move their tau alike, from the exchanged counts.

GTC's memory per rank: the residual (float32) and the message buffer (int32), 8 bytes per element
of the rank's shard: a 1/S share of what the DDP strategy keeps. The decode writes into FSDP's
own output buffer. Torch only.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from gtc_lightning.algorithms.common import (
    all_finite,
    all_gather_equal,
    allreduce_bytes,
    busy_wait_fits,
    finish,
)
from gtc_lightning.algorithms.gtc.auto_tau import TauController
from gtc_lightning.algorithms.gtc.config import (
    AUTO_TAU_INIT,
    CODINGS,
    DEFAULT_DENSITY,
    SAMPLE,
    f32,
)
from gtc_lightning.ops import step_ops
from gtc_lightning.ops.rice import rice_decode, rice_encode
from gtc_lightning.ops.torch_ops import INDEX_MASK

log = logging.getLogger(__name__)

HEADER = 4  # int64 per replica: words, message bytes, non-finite flag, tau (float64 bits; per_step_tau)
TOTAL_KEYS = ("steps", "sparse", "dense", "skipped", "elements", "words", "bytes_sent", "bytes_dense")


@dataclass
class ShardSlot:
    """GTC's state for one FSDP module on one rank: its gradient shard's residual and threshold."""

    residual: torch.Tensor  # [n] float32
    message: torch.Tensor  # [n] int32: this rank's words of the step
    tau: float
    controller: TauController | None
    calls: int = 0  # hook calls so far (one per backward pass)
    words: list[int] = field(default_factory=list)  # the last exchange's word counts, per replica

    def nbytes(self) -> int:
        return self.residual.numel() * self.residual.element_size() + self.message.numel() * self.message.element_size()


class HSDPGTCState:
    """State of the replicate dimension's GTC: hyper-parameters, one :class:`ShardSlot` per FSDP
    module, and byte counts.

    Args:
        replicate_group: the ranks that hold the same shard (this rank's replicate group).
        tau: the threshold, in the gradient's units, or ``"auto"``: measured at the first compressed
            step (the ``1 - target_density`` quantile of ``|g|``, the replicas' geometric mean) and
            then moved after every step so that each replica sends about ``target_density`` words per
            element (:mod:`~gtc_lightning.algorithms.gtc.auto_tau`).
        target_density: words per element and step for ``tau="auto"`` (None: 1e-2), or with a numeric
            tau to adapt it from there; None with a numeric tau keeps it fixed.
        warmup_steps: backward passes of dense all-reduce before compression starts.
        coding: ``"rice"`` (Golomb-Rice coded words, 8-11 bits a word) or ``"none"`` (32 bits).
        busy_wait: poll the collectives (True), block (False), or poll on gloo where each rank has a
            core (None).
        per_step_tau: with ``tau="auto"``, each replica measures its own tau at every compressed step
            (the ``1 - target_density`` quantile of its ``|residual + input|``, from a strided sample)
            and sends it in its header, instead of one tau moved by the controller; every replica's
            words are decoded at their sender's tau, so no collective is added. The update mode uses
            it: an optimizer's step follows its learning-rate schedule (a warm-up multiplies it tenfold
            in a few dozen steps), which the controller, at most 10 % a step, would trail.
    """

    def __init__(
        self,
        replicate_group: dist.ProcessGroup,
        tau: float | str = "auto",
        target_density: float | None = None,
        warmup_steps: int = 0,
        coding: str = "rice",
        busy_wait: bool | None = None,
        per_step_tau: bool = False,
    ) -> None:
        if coding not in CODINGS:
            raise ValueError(f"Expect coding in {CODINGS}, got {coding!r}")
        # The hyper-parameters.
        self.replicate_group = replicate_group
        self.measure = tau == "auto"
        if self.measure:
            target_density = DEFAULT_DENSITY if target_density is None else target_density
        self.tau = AUTO_TAU_INIT if self.measure else float(tau)
        self.target_density = target_density
        self.warmup_steps = warmup_steps
        self.coding = coding
        self.busy_wait = busy_wait
        self.per_step_tau = bool(per_step_tau) and self.measure
        self._busy: bool | None = None
        # The internal state, per FSDP module (by its name in the model).
        self.slots: dict[str, ShardSlot] = {}
        # The statistics: hook calls and bytes this rank sent across the replicate dimension, and what
        # a fp32 ring all-reduce of the same shards would have sent.
        self.totals: dict[str, int] = {key: 0 for key in TOTAL_KEYS}

    @property
    def replicas(self) -> int:
        return dist.get_world_size(self.replicate_group)

    @property
    def busy(self) -> bool:
        if self._busy is None:
            self._busy = busy_wait_fits(self.replicate_group) if self.busy_wait is None else self.busy_wait
        return self._busy

    def hook(self, key: str) -> Callable[[torch.Tensor], None]:
        """The all-reduce hook of the FSDP module named ``key``."""

        def all_reduce_hook(output: torch.Tensor) -> None:
            self.reduce(key, output)

        return all_reduce_hook

    def nbytes(self) -> int:
        """GTC's own memory on this rank (residuals and message buffers)."""
        return sum(slot.nbytes() for slot in self.slots.values())

    def slot(self, key: str, output: torch.Tensor) -> ShardSlot:
        slot = self.slots.get(key)
        if slot is None:
            n = output.numel()
            controller = None
            if self.target_density is not None:
                controller = TauController(self.target_density, self.tau, started=not self.measure)
            slot = ShardSlot(
                residual=torch.zeros(n, dtype=torch.float32, device=output.device),
                message=torch.empty(n, dtype=torch.int32, device=output.device),
                tau=self.tau,
                controller=controller,
            )
            self.slots[key] = slot
        elif slot.residual.numel() != output.numel():
            raise RuntimeError(
                f"GTC (HSDP): the gradient shard of {key!r} has {output.numel()} elements, its residual "
                f"{slot.residual.numel()}: a parameter of this FSDP module got no gradient in some backward pass "
                "(FSDP2 then reduces a shorter shard), or the sharding changed. Every parameter of a module must "
                "get a gradient in every step (as FSDP2 itself needs the same of every rank): freeze parameters "
                "that go unused (requires_grad=False) before fit"
            )
        return slot

    # ---- the reduction ---------------------------------------------------------------------------

    def reduce(self, key: str, output: torch.Tensor) -> None:
        """Replace ``output`` ``[n]`` (this rank's gradient shard, the mean over its shard group) by the
        replicate group's mean as GTC estimates it (steps 1-6 of the module docstring)."""
        if output.dtype != torch.float32 or output.dim() != 1:
            raise RuntimeError(
                f"GTC (HSDP) reduces float32 gradient shards; {key!r} reduces {output.dtype} "
                f"{tuple(output.shape)}. Keep FSDP's reduce_dtype float32 (MixedPrecisionPolicy(reduce_dtype="
                "torch.float32)) and the parameters float32 ('bf16-mixed', not 'bf16-true')"
            )
        slot = self.slot(key, output)
        slot.calls += 1
        replicas, n = self.replicas, output.numel()
        self.totals["steps"] += 1
        self.totals["elements"] += n
        self.totals["bytes_dense"] += allreduce_bytes(n, replicas)
        # 1. Dense warm-up.
        if slot.calls <= self.warmup_steps:
            finish(dist.all_reduce(output, group=self.replicate_group, async_op=True), self.busy)
            output.div_(replicas)
            self.totals["dense"] += 1
            self.totals["bytes_sent"] += allreduce_bytes(n, replicas)
            return
        # 2. Residual and words.
        finite = all_finite(output)
        if self.per_step_tau:  # this replica's own, sent in its header
            stride = max(1, n // SAMPLE)
            slot.tau = self._quantile(slot.residual[::stride] + output[::stride])
            if slot.controller is not None:
                slot.controller.tau, slot.controller.started = slot.tau, True
        elif slot.controller is not None and not slot.controller.started:  # every replica joins, finite or not
            slot.tau = slot.controller.start(self._first_tau(slot.residual + output))
        tau32 = f32(slot.tau)
        cursor = torch.zeros(1, dtype=torch.int64, device=output.device)
        bad = torch.zeros(1, dtype=torch.int32, device=output.device)
        if finite:
            ops = step_ops(output.device)
            ops.threshold_(output, slot.residual, slot.residual, tau32, slot.message, cursor, bad)
        own = int(cursor)
        words = slot.message[:own]
        coded = rice_encode(words) if self.coding == "rice" else words.view(torch.uint8)
        # 3. Header.
        tau_bits = int(torch.tensor([slot.tau], dtype=torch.float64).view(torch.int64))
        header = torch.tensor([own, coded.numel(), 0 if finite else 1, tau_bits], dtype=torch.int64, device=output.device)
        headers = torch.empty(replicas * HEADER, dtype=torch.int64, device=output.device)
        finish(all_gather_equal(headers, header, group=self.replicate_group, async_op=True), self.busy)
        rows = headers.view(replicas, HEADER).tolist()
        counts, sizes = [row[0] for row in rows], [row[1] for row in rows]
        rank = dist.get_rank(self.replicate_group)
        self.totals["bytes_sent"] += (replicas - 1) * HEADER * 8
        # 4. Words.
        received = torch.empty(sum(sizes), dtype=torch.uint8, device=output.device)
        if sum(sizes):
            work = dist.all_to_all_single(
                received, coded.repeat(replicas), output_split_sizes=sizes, input_split_sizes=[sizes[rank]] * replicas,
                group=self.replicate_group, async_op=True,
            )  # fmt: skip
            finish(work, self.busy)
        self.totals["bytes_sent"] += (replicas - 1) * sizes[rank]
        self.totals["words"] += own
        if any(row[2] for row in rows):
            # A replica's gradient is not finite: the shard's mean is not either. This rank keeps its own
            # gradient in its residual (its words are taken back) for a later step.
            if finite:
                ops.apply_words_(slot.residual, words, -tau32)
            output.fill_(float("nan"))
            self.totals["skipped"] += 1
            return
        # 5. Decode, from exact vote counts.
        parts = received.split(sizes)
        if self.coding == "rice":
            everyone = [words if r == rank else rice_decode(part) for r, part in enumerate(parts)]
        else:
            everyone = [words if r == rank else part.view(torch.int32) for r, part in enumerate(parts)]
        output.zero_()
        if self.per_step_tau:  # each replica's words at its own tau, replica by replica in rank order
            taus = torch.tensor([row[3] for row in rows], dtype=torch.int64).view(torch.float64).tolist()
            for words_r, tau_r in zip(everyone, taus):
                scale = f32(f32(tau_r) / replicas)
                output.index_add_(0, (words_r & INDEX_MASK).long(), torch.where(words_r < 0, -scale, scale))
        else:
            everyone = torch.cat(everyone)
            output.index_add_(0, (everyone & INDEX_MASK).long(), torch.where(everyone < 0, -1.0, 1.0))
            output.mul_(f32(tau32 / replicas))
        self.totals["sparse"] += 1
        slot.words = counts
        # 6. Automatic tau, alike on every replica of the shard (per_step_tau: measured at the next step).
        if slot.controller is not None and not self.per_step_tau:
            slot.tau = slot.controller.update(sum(counts) / max(replicas * n, 1))

    def _quantile(self, values: torch.Tensor) -> float:
        """The ``1 - target_density`` quantile of ``|values|`` (a strided sample, its finite elements),
        or :data:`AUTO_TAU_INIT` when that is 0 or there is none."""
        sample = values[:: max(1, values.numel() // SAMPLE)].abs()
        sample = sample[torch.isfinite(sample)]
        k = min(sample.numel(), max(1, math.ceil((1.0 - self.target_density) * sample.numel())))
        tau = float(torch.kthvalue(sample.cpu(), k).values) if sample.numel() else 0.0
        return tau if tau > 0 else AUTO_TAU_INIT

    def _first_tau(self, values: torch.Tensor) -> float:
        """:meth:`_quantile` of ``values``, the replicas' geometric mean: the replicas of a shard start
        from the same tau."""
        log_tau = torch.tensor([math.log(self._quantile(values))], dtype=torch.float64)  # _quantile is > 0
        finish(dist.all_reduce(log_tau, group=self.replicate_group, async_op=True), self.busy)
        self.totals["bytes_sent"] += allreduce_bytes(1, self.replicas, 8)
        return float(torch.exp(log_tau / self.replicas))

    # ---- checkpoints -------------------------------------------------------------------------------

    def rank_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Every module's residual ``[n]`` and threshold state ``[4]`` float64 (tau, the controller's
        moving average or NaN, whether it started, hook calls): this rank's own, for a sharded save."""
        saved = {}
        for key, slot in self.slots.items():
            ctrl = slot.controller
            ema = ctrl.ema if ctrl is not None and ctrl.ema is not None else float("nan")
            started = float(ctrl.started) if ctrl is not None else 1.0
            scalars = torch.tensor([slot.tau, ema, started, float(slot.calls)], dtype=torch.float64)
            saved[key] = {"residual": slot.residual, "scalars": scalars}
        return saved

    def load_rank_state(self, saved: dict[str, dict[str, torch.Tensor]]) -> None:
        """Put back what :meth:`rank_state` gave (after loading into its tensors), slot by slot."""
        for key, entry in saved.items():
            residual = entry["residual"]
            tau, ema, started, calls = entry["scalars"].tolist()
            slot = self.slot(key, residual)
            slot.residual.copy_(residual)
            slot.tau, slot.calls = tau, int(calls)
            if slot.controller is not None:
                slot.controller.tau = tau
                slot.controller.ema = None if math.isnan(ema) else ema
                slot.controller.started = bool(started)

    def new_slot(self, key: str, numel: int, device: torch.device) -> ShardSlot:
        """The slot of ``key`` before its first gradient (a resume loads into it)."""
        return self.slot(key, torch.empty(numel, dtype=torch.float32, device=device))
