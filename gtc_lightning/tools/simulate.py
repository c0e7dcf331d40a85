"""Many data-parallel workers in one process: GTC, model averaging, BMUF and BMUF-GTC, step for step.

The WER of a scheme at 32, 64 or 128 workers (the trade-off Amazon's 2019 BMUF-GTC write-up reports) needs that many
workers' training, not that many machines: what a worker contributes is a function of its own batch,
its own model (or the shared one) and its own residual. :class:`VirtualWorkers` keeps those for
``workers`` workers and runs each step as the strategies do, one worker after the other:

- every worker's gradient is the mean loss of its own batch, by autograd on its model;
- ``gtc``: Strom's gradient mode, ``GTCStrategy(compress="gradient", coding="none", tau=...)`` (not
  the strategy's defaults: automatic tau, Golomb-Rice coding, and for one optimizer the compression
  of each rank's update): the worker's words from :func:`gtc_lightning.ops.compress` on its own
  residual, the update from :func:`gtc_lightning.ops.decompress` of all workers' words divided by the
  workers (Strom's ``tau / N`` per vote), and the hook's dense fallback: a step whose longest message
  of 32-bit words would send more than ``FALLBACK_ENTER`` (0.5) of a dense fp32 all-reduce's bytes,
  a bf16 all-reduce's, all-reduces residual + gradient and restarts the residuals from zero, until a
  step would send less than ``FALLBACK_EXIT`` (0.25) of them (at 2 workers too: a word for more than
  half the elements);
- ``ma``: every worker its own model and optimizer, every ``period`` steps the mean (each model
  divided by N, then summed in rank order, as :func:`gtc_lightning.algorithms.averaging.model_averaging.all_mean`);
- ``bmuf``: the same mean through :func:`gtc_lightning.algorithms.averaging.bmuf.block_update_` (η = 1 - 1/N by default);
- ``bmuf_gtc``: ``gtc`` within groups of ``group_size`` consecutive workers (one model per group),
  BMUF across the groups every ``period`` steps; residuals carry over a block sync.

With 2 workers the parameters equal a 2-process run of the strategy bit for bit (tests/test_simulate.py
checks every step against ``GTCStrategy``, ``ModelAveragingStrategy``, ``BMUFStrategy``). GTC's
decoded update is a count of votes, exact in any order, so without dense-fallback steps ``gtc`` stays
bit-exact at any number of workers (on the recipe, 4 workers for an epoch: the dev frame accuracy,
words and bytes of a 4-rank ``train.py`` run, to the last digit). Elsewhere, with more than 2
learners, sums are taken in rank order where gloo's ring may add in another: the last bits may differ.
Automatic tau (``target_density``) runs one controller per GTC group on the words its workers sent,
as every rank of the group does, from ``tau`` as ``GTCStrategy(tau=<a number>, target_density=...)``
starts (``tau="auto"`` measures its start at the first step: not simulated). Not simulated: dense warmup steps, gradient clipping, the stale
exchange, Golomb-Rice coding (lossless: it changes the bytes, and with them the steps where the
dense fallback enters, not a sparse step's update) and time: this measures what
the schemes learn, the scaling model (:mod:`gtc_lightning.tools.scaling`) what they cost.

The work per step grows with the workers: one forward/backward per worker and, for GTC, one pass over
a residual per worker (``workers x weights`` floats). Autograd adds each worker's gradient straight
into its residual (its ``.grad`` are views of it), and the hook's own primitives (``threshold_``'s scan,
``decode_`` into kept counts) do the rest, so no gradient is flattened or added twice. On a 2-core CPU,
one thread, for the recipe's 1.55 M weights at 128 workers of 4 frames: 5.8 ms per GTC worker and step
(7.8 ms with ``compress`` / ``decompress`` on flattened gradients, before), 8.9 ms per ``bmuf_gtc``
worker in groups of 8 (each group also decodes and steps its own model).
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from gtc_lightning.algorithms.averaging.bmuf import (
    block_update_,
    check_block_args,
    default_block_momentum,
    group_ranks,
)
from gtc_lightning.algorithms.averaging.model_averaging import flatten, unflatten_
from gtc_lightning.algorithms.common import allreduce_bytes
from gtc_lightning.algorithms.gtc.auto_tau import TauController
from gtc_lightning.algorithms.gtc.config import FALLBACK_ENTER, FALLBACK_EXIT, HEADER, WORD_BYTES, f32
from gtc_lightning.ops import step_ops

SCHEMES = ("gtc", "ma", "bmuf", "bmuf_gtc")


class VirtualWorkers:
    """``workers`` data-parallel workers of one scheme, simulated in this process.

    Args:
        module: the model; worker 0 trains it in place (the others train deep copies of it, where
            the scheme gives them models of their own).
        optimizer_fn: ``parameters -> torch.optim.Optimizer``, called once per model.
        loss_fn: ``(model, batch) -> scalar loss`` (the mean over the batch, as a LightningModule's
            ``training_step`` returns it).
        scheme: one of :data:`SCHEMES`.
        workers: number of workers, >= 2.
        tau: GTC's threshold (``gtc``, ``bmuf_gtc``); with ``target_density``, its starting value.
        period: K, optimizer steps between syncs (``ma``, ``bmuf``, ``bmuf_gtc``).
        block_momentum: η; ``None``: 1 - 1/N for N learners (workers, or groups for ``bmuf_gtc``).
        block_lr: ζ.
        nesterov: Nesterov block momentum.
        group_size: workers per GTC group (``bmuf_gtc``).
        dense_fallback: GTC's fallback to a dense all-reduce, as ``GTCStrategy(dense_fallback=...)``.
        target_density: automatic tau, as ``GTCStrategy(target_density=...)``: after every step each GTC
            group's :class:`~gtc_lightning.algorithms.gtc.auto_tau.TauController` moves the group's tau from the
            words its workers sent (per worker and element). None keeps tau fixed.
        backend: the step primitives, as ``GTCStrategy(backend=...)``: ``"auto"`` (Triton on CUDA,
            torch elsewhere), ``"torch"`` or ``"triton"``.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        optimizer_fn: Callable[[Any], torch.optim.Optimizer],
        loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
        scheme: str,
        workers: int,
        *,
        tau: float = 0.01,
        period: int = 50,
        block_momentum: float | None = None,
        block_lr: float = 1.0,
        nesterov: bool = True,
        group_size: int = 2,
        dense_fallback: bool = True,
        backend: str = "auto",
        target_density: float | None = None,
    ) -> None:
        if scheme not in SCHEMES:
            raise ValueError(f"Expect scheme in {SCHEMES}, got {scheme!r}")
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 2:
            raise ValueError(f"Expect workers to be an int >= 2, got {workers!r}: one worker is the baseline")
        if isinstance(period, bool) or not isinstance(period, int) or period < 1:
            raise ValueError(f"Expect period (K) to be an int >= 1, got {period!r}")
        if not tau > 0:
            raise ValueError(f"Expect tau > 0, got {tau!r}")
        check_block_args(block_momentum, block_lr)
        if target_density is not None and scheme not in ("gtc", "bmuf_gtc"):
            raise ValueError(f"target_density (automatic tau) applies to gtc and bmuf_gtc, not {scheme!r}")
        self.scheme, self.workers, self.tau, self.period = scheme, workers, float(tau), period
        self.loss_fn, self.dense_fallback = loss_fn, bool(dense_fallback)
        # Which model each worker trains and which workers exchange GTC words together.
        if scheme == "gtc":
            self.groups = [list(range(workers))]
        elif scheme == "bmuf_gtc":
            self.groups = group_ranks(workers, group_size)
        else:
            self.groups = [[w] for w in range(workers)]
        # Each GTC group's threshold (float32, as the arithmetic sees it) and its controller.
        self.target_density = None if target_density is None else float(target_density)
        self.controllers = None
        if self.target_density is not None:  # (gtc or bmuf_gtc, checked above)
            self.controllers = [TauController(self.target_density, self.tau) for _ in self.groups]
        self.taus = [self.tau] * len(self.groups)
        self.models = [module] + [copy.deepcopy(module) for _ in self.groups[1:]]
        self.params = [[p for p in m.parameters() if p.requires_grad] for m in self.models]
        self.optimizers = [optimizer_fn(params) for params in self.params]
        self.numel = sum(p.numel() for p in self.params[0])
        device = self.params[0][0].device
        self.ops = step_ops(device, backend)
        self.compressed = scheme in ("gtc", "bmuf_gtc")
        self.residuals: list[torch.Tensor] | None = None
        if self.compressed:
            # Kept buffers, as the hook's: each worker's residual (autograd adds its gradient into
            # it), one message for the words, the vote counts; on Triton also a zero vector and a
            # spare that ``threshold_`` writes into and that then becomes the worker's residual.
            if any(p.dtype != torch.float32 for p in self.params[0]):
                raise ValueError("Expect float32 parameters for gtc / bmuf_gtc (the residuals are float32 and "
                                 f"hold the gradients), got {sorted({str(p.dtype) for p in self.params[0]})}")
            self.residuals = [torch.zeros(self.numel, device=device) for _ in range(workers)]
            self._zeros = None if hasattr(self.ops, "emit_") else torch.zeros(self.numel, device=device)
            self._spare = None if self._zeros is None else torch.empty(self.numel, device=device)
            self._message = torch.empty(self.numel, dtype=torch.int32, device=device)
            self._cursor = torch.zeros(1, dtype=torch.int64, device=device)
            self._bad = torch.zeros(1, dtype=torch.int32, device=device)
            self._counts = torch.zeros(self.numel, dtype=self.ops.COUNTS_DTYPE, device=device)
        self.dense_mode = [False] * len(self.groups)
        self._warned_fallback = False
        self.block = scheme in ("bmuf", "bmuf_gtc")
        learners = len(self.groups)
        self.block_momentum = default_block_momentum(learners) if block_momentum is None else float(block_momentum)
        self.block_lr, self.nesterov = float(block_lr), bool(nesterov)
        if self.block:
            self.global_params = flatten(self.params[0]).float().clone()
            self.delta = torch.zeros_like(self.global_params)
        self.step_count = 0
        # Worker 0's traffic, counted as the strategies count rank 0's.
        self.totals = {"dense_steps": 0, "words": 0, "gtc_bytes_sent": 0, "syncs": 0, "sync_bytes_sent": 0}

    @property
    def model(self) -> torch.nn.Module:
        """The model worker 0 holds (trained in place)."""
        return self.models[0]

    @contextlib.contextmanager
    def evaluated(self) -> Iterator[torch.nn.Module]:
        """Worker 0's model holding, for the duration, what a real run's evaluation loops and checkpoints
        see: for ``gtc`` its one model; for ``ma``, ``bmuf`` and ``bmuf_gtc`` the mean of the learners'
        models (the strategies' ``average_eval``: each divided by their number, then summed in order, as
        the all-reduce of 2 ranks forms it). Worker 0's own parameters come back afterwards."""
        if len(self.models) == 1:
            yield self.model
            return
        own = flatten(self.params[0]).clone()
        unflatten_(self._mean(), self.params[0])
        try:
            yield self.model
        finally:
            unflatten_(own, self.params[0])

    def _gradient(self, g: int, batch: Any, into: torch.Tensor | None = None) -> float:
        """Model ``g``'s gradient on ``batch`` in its parameters' ``.grad``; with ``into`` (a flat
        float32 buffer) the ``.grad`` are views of it, so that autograd adds the gradient into it in
        place (``into += gradient``, elementwise as ``torch.add``). Returns the loss."""
        model, params = self.models[g], self.params[g]
        if into is None:
            for p in params:
                p.grad = None
        else:
            self._as_grads(g, into)
        loss = self.loss_fn(model, batch)
        loss.backward()
        return float(loss.detach())

    def _as_grads(self, g: int, flat: torch.Tensor) -> None:
        """Make model ``g``'s ``.grad`` views of ``flat`` (no copy)."""
        start = 0
        for p in self.params[g]:
            p.grad = flat[start : start + p.numel()].view_as(p)
            start += p.numel()

    def step(self, batches: Sequence[Any]) -> float:
        """One optimizer step of every worker on its batch (``batches[w]`` for worker ``w``).

        Returns:
            the mean of the workers' losses.
        """
        if len(batches) != self.workers:
            raise ValueError(f"Expect one batch per worker ({self.workers}), got {len(batches)}")
        losses = []
        for g, members in enumerate(self.groups):
            if self.compressed:
                words, tau32 = [], f32(self.taus[g])
                for w in members:
                    losses.append(self._gradient(g, batches[w], into=self.residuals[w]))
                    words.append(self._compress(w, tau32))
                self._as_grads(g, self._exchange(g, members, words, tau32))
            else:
                loss = self._gradient(g, batches[members[0]])
                losses.append(loss)
            self.optimizers[g].step()
        self.step_count += 1
        if self.scheme != "gtc" and self.step_count % self.period == 0:
            self._sync()
        return sum(losses) / len(losses)

    def _compress(self, w: int, tau32: float) -> torch.Tensor:
        """Worker ``w``'s words: ``±tau`` off its residual (which holds residual + gradient) beyond
        the threshold, as ``gtc_lightning.ops.compress``, by the hook's primitives over kept buffers."""
        self._cursor.zero_()
        if self._zeros is None:  # torch: in place, on the sum autograd made
            self.ops.emit_(self.residuals[w], tau32, self._message, self._cursor, self._bad)
        else:  # Triton: its fused kernel adds a kept zero vector (0 + x is x) into the spare
            self.ops.threshold_(self.residuals[w], self._zeros, self._spare, tau32, self._message,
                                self._cursor, self._bad)  # fmt: skip
            self.residuals[w], self._spare = self._spare, self.residuals[w]
        bad = int(self._bad)
        if bad:
            self._bad.zero_()
            raise ValueError(f"worker {w}'s gradient has {bad} non-finite element(s) (NaN/Inf) at step "
                             f"{self.step_count}: lower the learning rate or check the batch")
        return self._message[: int(self._cursor)].clone()

    def _exchange(self, g: int, members: list[int], words: list[torch.Tensor], tau32: float) -> torch.Tensor:
        """GTC within one group, as the hook decides and decodes (steps 3-6 of
        ``gtc_lightning.algorithms.gtc.hook``);
        ``tau32``: the threshold the words were emitted with."""
        size = len(members)
        peers = size - 1
        if self.controllers is not None:  # the next step's tau, from this step's words (also when dense)
            density = sum(len(m) for m in words) / (size * self.numel)
            self.taus[g] = self.controllers[g].update(density)
        fp32_bytes = allreduce_bytes(self.numel, size)
        header = peers * HEADER * 8
        if self.dense_fallback and size > 1:
            share = peers * max(WORD_BYTES * len(m) for m in words) / fp32_bytes
            self.dense_mode[g] = share > (FALLBACK_EXIT if self.dense_mode[g] else FALLBACK_ENTER)
            if self.dense_mode[g] and not self._warned_fallback:
                self._warned_fallback = True
                warnings.warn(
                    f"GTC (simulated): at step {self.step_count} group {g}'s sparse exchange would send {share:.2f}x "
                    f"the bytes of a dense fp32 all-reduce (up to {max(len(m) for m in words)} words of "
                    f"{self.numel} to {peers} peers); it all-reduces densely until that falls below "
                    f"{FALLBACK_EXIT}x. Raise tau (now {tau32:.4g}) or set a target_density "
                    "(automatic tau) to keep the exchange sparse",
                    RuntimeWarning,
                    stacklevel=3,
                )
        first = members[0] == 0
        if self.dense_mode[g]:
            total = None
            for w, message in zip(members, words):
                self.ops.apply_words_(self.residuals[w], message, -tau32)
                total = self.residuals[w].clone() if total is None else total.add_(self.residuals[w])
                self.residuals[w].zero_()
            if first:
                self.totals["dense_steps"] += 1
                self.totals["gtc_bytes_sent"] += header + fp32_bytes
            return total.div_(size)
        if first:
            self.totals["words"] += len(words[0])
            self.totals["gtc_bytes_sent"] += header + peers * WORD_BYTES * len(words[0])
        update = torch.empty(self.numel, device=self._counts.device)
        # One vote is worth tau / size in float32, as the hook's (and ``decompress``'s) scale.
        self.ops.decode_(torch.cat(words), None, self._counts, [(0, update)], f32(tau32 / size))
        return update

    def _mean(self) -> torch.Tensor:
        """The mean of the learners' models, flat float32: each divided by their number, then summed in order."""
        mean = None
        for params in self.params:
            part = flatten(params).float().div_(len(self.models))
            mean = part if mean is None else mean.add_(part)
        return mean

    def _sync(self) -> None:
        """The averaging (``ma``) or block update (``bmuf``, ``bmuf_gtc``) over one model per learner."""
        learners = len(self.models)
        mean = self._mean()
        if self.block:
            mean = block_update_(self.global_params, self.delta, mean, self.block_momentum, self.block_lr,
                                 self.nesterov)
        for params in self.params:
            unflatten_(mean, params)
        self.totals["syncs"] += 1
        sent = allreduce_bytes(self.numel, learners)
        if self.scheme == "bmuf_gtc" and len(self.groups[0]) > 1:
            sent += (len(self.groups[0]) - 1) * self.numel * 4  # the representative's broadcast in its group
        self.totals["sync_bytes_sent"] += sent

    def scale_lr(self, factor: float) -> None:
        """Multiply every worker's learning rate (an epoch-end schedule, as on every rank)."""
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                group["lr"] *= factor

    def stats(self) -> dict:
        """Worker 0's statistics in the shape of the strategies' ``gtc_stats`` / ``sync_stats``:
        ``{"gtc": ... or None, "sync": ... or None}``."""
        t, steps = self.totals, self.step_count
        gtc = sync = None
        if self.compressed:
            gtc = {"step": steps, "last": {"world_size": len(self.groups[0])},
                   "total": {"steps": steps, "dense_steps": t["dense_steps"], "words": t["words"],
                             "bytes_sent": t["gtc_bytes_sent"]}}
        if self.scheme != "gtc":
            sync = {"step": steps, "total": {"steps": steps, "syncs": t["syncs"], "bytes_sent": t["sync_bytes_sent"]}}
        return {"gtc": gtc, "sync": sync}
