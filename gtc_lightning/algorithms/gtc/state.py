"""GTC's state (:class:`GTCState`): the hyper-parameters, every rank's per-element residuals in one flat
buffer laid out as DDP's buckets (:mod:`~gtc_lightning.algorithms.gtc.layout` lays it out), the
update in flight of the one-step-stale mode, the step counter and the statistics. It pickles without
its process group and carries its residuals over, by parameter name, to a new DDP wrapper.

The hook (:mod:`~gtc_lightning.algorithms.gtc.hook`), the stale exchange and the update mode read and
write its buffers; the strategies build it, hand it the clipping and the loss scale, and apply each
step's outcome once through :meth:`GTCState.finish_step`.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Iterable

import torch
import torch.distributed as dist

from gtc_lightning.algorithms.common import all_finite, busy_wait_fits
from gtc_lightning.algorithms.gtc.auto_tau import TauController
from gtc_lightning.algorithms.gtc.config import (
    AUTO_TAU_INIT,
    DEFAULT_DENSITY,
    SILENT_STEPS,
    check_options,
    f32,
    scheduled_density,
)
from gtc_lightning.algorithms.gtc.inflight import InFlight
from gtc_lightning.algorithms.gtc.stats import TOTAL_KEYS, Clock, StepStats
from gtc_lightning.ops import MAX_NUMEL

log = logging.getLogger(__name__)


class GTCState:
    """State of :func:`gtc_hook`: hyper-parameters, per-element residuals and statistics.

    Args:
        process_group: the group to exchange within; ``None`` for the default (world) group.
        named_parameters: ``(name, parameter)`` pairs of the module DDP wraps; only parameters
            with ``requires_grad`` get residuals (they are the ones DDP puts into buckets).
        tau: the threshold; each word moves one element by ``tau / world_size``; with a
            ``target_density`` the initial value (``"auto"``: 1e-2).
        target_density: adapt tau after every step so that the words per rank and gradient
            element track this (:mod:`gtc_lightning.algorithms.gtc.auto_tau`); None keeps tau fixed.
        warmup_steps: optimizer steps of dense all-reduce before compression starts.
        max_consecutive_skips: raise after this many consecutive skipped steps; ``None``: never.
        dense_fallback: fall back to a dense all-reduce on steps where the sparse exchange would
            move more bytes than a bf16 all-reduce (see :data:`FALLBACK_ENTER`).
        exchange: ``"alltoall"`` (uneven messages), ``"allgather"`` (padded to the longest) or
            ``"auto"`` (all-to-all on gloo, all-gather otherwise); the header goes the same way.
        backend: ``"auto"`` (Triton on CUDA, torch elsewhere), ``"torch"`` or ``"triton"``.
        stale: one-step-stale mode (:mod:`gtc_lightning.algorithms.gtc.stale`): each step's exchange runs while
            the next step computes, and its update is applied one step late.
        coding: ``"rice"``: Golomb-Rice coded messages; ``"none"``: 32-bit words.
        compress: ``"gradient"`` (Strom's: the residual of gradients, in the DDP hook) or
            ``"update"`` (:mod:`gtc_lightning.algorithms.gtc.update`: the residual of the steps each rank's
            optimizer makes); ``"auto"`` until the strategy has seen the optimizers.
        busy_wait: how a rank waits for the step's collectives. ``True``: it polls them (see
            :func:`~gtc_lightning.algorithms.common.finish`), ``False``: it blocks; ``None``
            (default): polls on gloo when the machine has a core for each of its ranks
            (:func:`~gtc_lightning.algorithms.common.busy_wait_fits`).
        conserve, density_warmup_steps, momentum_masking, mean_variance, word_levels: the update mode's, as for
            :class:`~gtc_lightning.GTCStrategy`.
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None,
        named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
        tau: float,
        warmup_steps: int = 0,
        max_consecutive_skips: int | None = 10,
        dense_fallback: bool = True,
        exchange: str = "auto",
        backend: str = "auto",
        stale: bool = False,
        coding: str = "none",
        target_density: float | None = None,
        compress: str = "gradient",
        busy_wait: bool | None = None,
        conserve: str = "direction",
        density_warmup_steps: int = 0,
        momentum_masking: bool = False,
        mean_variance: bool = False,
        word_levels: int | str = 1,
    ) -> None:
        check_options(tau, warmup_steps, max_consecutive_skips, exchange, backend, coding, target_density, compress,
                      busy_wait, conserve, density_warmup_steps, momentum_masking, mean_variance, word_levels)
        measure = tau == "auto"  # automatic tau measures where to start at its first compressed step
        if tau == "auto":
            tau = AUTO_TAU_INIT
            target_density = DEFAULT_DENSITY if target_density is None else target_density
        # The hyper-parameters.
        self.process_group = process_group
        self.tau = float(tau)
        self.tau32 = f32(tau)
        self.warmup_steps = warmup_steps
        self.max_consecutive_skips = max_consecutive_skips
        self.dense_fallback = bool(dense_fallback)
        self.exchange = exchange
        self.backend = backend
        self.stale = bool(stale)
        self.coding = coding
        self.compress = compress
        self.target_density = target_density
        self.busy_wait = busy_wait
        self.conserve = conserve
        self.density_warmup_steps = density_warmup_steps
        self.momentum_masking = momentum_masking
        self.mean_variance = mean_variance
        self.word_levels = word_levels
        self._busy: bool | None = None  # busy_wait resolved, at the first collective
        self.controller = (
            TauController(target_density, float(tau), started=not measure) if target_density is not None else None
        )
        # Gradient clipping of each rank's local gradient, set by the strategy from the Trainer:
        # ("norm" | "value", threshold) or None.
        self.clip: tuple[str, float] | None = None
        # Loss scale of the gradients DDP hands over (AMP's GradScaler; 1.0 without one): the
        # residuals hold unscaled gradients and the decoded estimate is scaled back.
        self.grad_scale = 1.0
        # The internal state.
        self.param_names: list[str] = []
        self.numels: list[int] = []
        self._name_of: dict[int, str] = {}
        self.bind(named_parameters)
        self.step = 0
        self._reset_buffers()
        self._used: set[int] | None = None  # ids of parameters that got a gradient (when tracked)
        self._usage_handles: list = []
        self._dense_mode = False
        self._warned_fallback = self._warned_masking = self._warned_variance = False
        self._silent = 0  # compressed steps in a row without a word from any rank
        self.last: StepStats | None = None  # the newest exchange, read by the strategy
        self._last_consumed = True
        # The statistics.
        self.totals: dict[str, float] = {key: 0 for key in TOTAL_KEYS}
        if self.rank == 0:
            log.info(
                "GTC config: tau=%s, warmup_steps=%d, max_consecutive_skips=%s, dense_fallback=%s, "
                "exchange=%s, stale=%s, coding=%s, world_size=%d, parameters=%d (%d elements)",
                f"auto (target_density={target_density:g}, from {self.tau:g})" if target_density else f"{self.tau:g}",
                self.warmup_steps,
                self.max_consecutive_skips,
                self.dense_fallback,
                self.exchange,
                self.stale,
                self.coding,
                self.world_size,
                len(self.param_names),
                sum(self.numels),
            )

    def _reset_buffers(self) -> None:
        # Flat buffers in bucket order: the committed residual and the next one being written.
        self._residual: torch.Tensor | None = None
        self._spare: torch.Tensor | None = None
        self._keys: list[tuple[int, ...]] = []  # per bucket index: ids of its parameters
        self._offsets: list[int] = []  # per bucket index: its first element in the flat space
        self._slots: dict[str, tuple[int, int]] = {}  # parameter name -> (offset, numel)
        self._loaded: dict[str, torch.Tensor] = {}  # residuals waiting for the first layout
        self._building: dict | None = None  # a new layout being assembled during one step
        self._counts: torch.Tensor | None = None  # [capacity] vote counts, all zero between steps
        self._message: torch.Tensor | None = None  # [capacity] int32: this rank's words
        self._pending: list[tuple[dist.GradBucket, torch.futures.Future, int]] = []
        self._deferred: list = []  # buckets waiting for the gradient norm (norm clipping)
        self._unused: list[tuple[int, int]] = []  # flat ranges of parameters unused this step
        self._norm_sq: torch.Tensor | None = None
        self._step_offset = 0
        self._compress_marks: list = []
        self._unsettled: list = []  # (stats, field, start, end) timings still to read
        self._clock = Clock(torch.device("cpu"))
        # stale=True: the exchange in flight (an InFlight), and the second message and sum
        # buffers that step t+1 writes while step t's are still being sent.
        self._in_flight = None
        self._spare_message: torch.Tensor | None = None
        self._spare_sum: torch.Tensor | None = None
        self._applied: list[tuple[int, torch.Tensor]] = []  # (offset, bucket buffer) of the last decode
        # compress="update": the parameters before the step, then the message, then the mean update.
        self._scratch: torch.Tensor | None = None
        self._sample_generator: torch.Generator | None = None  # draws the per-rank threshold's sample

    def bind(self, named_parameters: Iterable[tuple[str, torch.nn.Parameter]]) -> None:
        """(Re)build the parameter -> name map, e.g. after unpickling the state."""
        pairs = [(name, p) for name, p in named_parameters if p.requires_grad]
        self.param_names = [name for name, _ in pairs]
        self.numels = [p.numel() for _, p in pairs]
        self._name_of = {id(p): name for name, p in pairs}
        if sum(self.numels) > MAX_NUMEL:
            raise ValueError(
                f"the model has {sum(self.numels)} trainable elements, more than the 2**31-1 a word's 31-bit "
                "index can address in one step"
            )

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.process_group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.process_group)

    @property
    def busy(self) -> bool:
        """Whether this rank polls the step's collectives (``busy_wait``, ``None`` resolved once)."""
        if self._busy is None:
            wanted = self.busy_wait
            self._busy = busy_wait_fits(self.process_group) if wanted is None else wanted
        return self._busy

    def density_now(self) -> float | None:
        """The target density of the current optimizer step (``self.step``), after any warm-up
        (``density_warmup_steps``, the update mode's); None with a fixed tau."""
        if self.target_density is None:
            return None
        return scheduled_density(self.target_density, self.step, self.density_warmup_steps)

    _PICKLED = (
        "tau", "tau32", "warmup_steps", "max_consecutive_skips", "dense_fallback", "exchange", "backend",
        "stale", "coding", "compress", "target_density", "controller", "clip", "grad_scale", "param_names",
        "numels", "step", "totals", "last", "busy_wait", "conserve", "density_warmup_steps",
        "momentum_masking", "mean_variance", "word_levels", "_dense_mode", "_warned_fallback",
    )  # fmt: skip

    def __getstate__(self) -> dict:
        """Every hyper-parameter, the counters, automatic tau's controller, the residuals (as one vector)
        and, with ``stale=True``, the update in flight (waited for, as a vector); no process group, no
        buffers."""
        log.warning("GTCState: the process group is not picklable and is dropped; call bind() after loading")
        missing = [key for key in self.__dict__ if not key.startswith("_") and key not in self._PICKLED]
        assert missing == ["process_group"], f"GTCState.__getstate__ does not know {missing}"
        state = {key: self.__dict__[key] for key in self._PICKLED}
        state["residuals"] = self.residual_vector(torch.device("cpu"))
        state["pending"] = self.pending_entry()
        return state

    def __setstate__(self, state: dict) -> None:
        """Restore with the default process group; ``bind(named_parameters)`` must follow."""
        residuals = state.pop("residuals")
        pending = state.pop("pending", None)
        state.setdefault("busy_wait", None)  # pickled before it existed
        state.setdefault("conserve", "direction")
        state.setdefault("density_warmup_steps", 0)
        state.setdefault("momentum_masking", False)
        state.setdefault("mean_variance", False)
        state.setdefault("word_levels", 1)
        self.__dict__.update(state)
        self._busy = None
        self.process_group = None
        self._name_of = {}
        self._used, self._usage_handles = None, []
        self._last_consumed, self._silent, self._warned_masking, self._warned_variance = True, 0, False, False
        self._reset_buffers()
        self.load_residual_vector(residuals)
        if pending is not None:
            self.load_pending(pending, torch.device("cpu"))
        log.warning("GTCState: process group set to the default group after loading")

    def rebind(self, named_parameters: Iterable[tuple[str, torch.nn.Parameter]]) -> list[str]:
        """Carry this state over to a new DDP wrapper of the model (a second ``trainer.fit``): the
        residuals follow their parameters by name into the new wrapper's layout, built at its first
        step; counters, automatic tau, the dense-fallback mode and an update in flight (``stale``)
        are kept.

        Returns:
            names of parameters that are no longer trainable: their residual (and their part of an
            update in flight) is dropped.
        """
        saved = dict(zip(self.param_names, self.residual_vector().split(self.numels)))
        flight = self._in_flight
        parts = flight.by_name(self.param_names, self.numels) if flight is not None else None
        self.untrack_usage()
        self.bind(named_parameters)
        self._reset_buffers()
        if flight is not None:
            self._in_flight = flight.reordered(parts, self.param_names, self.numels)
        self._loaded = {
            name: saved[name].clone()
            for name, n in zip(self.param_names, self.numels)
            if name in saved and saved[name].numel() == n
        }
        return [name for name in saved if name not in self._loaded]

    # ---- which parameters a backward pass used ---------------------------------------------

    def track_usage(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        """Record which parameters get a gradient in each backward pass (needed when some may be
        unused: ``find_unused_parameters`` or ``static_graph``)."""
        self.untrack_usage()
        self._used = set()
        used = self._used
        for p in parameters:
            if p.requires_grad:
                self._usage_handles.append(p.register_post_accumulate_grad_hook(lambda q: used.add(id(q))))

    def untrack_usage(self) -> None:
        for handle in self._usage_handles:
            handle.remove()
        self._usage_handles, self._used = [], None

    # ---- residuals, per parameter ----------------------------------------------------------

    def residual_vector(self, device: torch.device | None = None) -> torch.Tensor:
        """All residuals, ``[sum(numels)]`` float32 in ``param_names`` order (zeros where none yet)."""
        if device is None:
            device = self._residual.device if self._residual is not None else torch.device("cpu")
        parts = []
        for name, n in zip(self.param_names, self.numels):
            if name in self._slots:
                offset, _ = self._slots[name]
                parts.append(self._residual[offset : offset + n].to(device))
            elif name in self._loaded:
                parts.append(self._loaded[name].to(device))
            else:
                parts.append(torch.zeros(n, device=device))
        return torch.cat(parts) if parts else torch.zeros(0, device=device)

    def load_residual_vector(self, vector: torch.Tensor) -> None:
        """Set all residuals from a ``[sum(numels)]`` vector made by :meth:`residual_vector`."""
        if vector.numel() != sum(self.numels):
            raise ValueError(
                f"residual vector has {vector.numel()} elements, the model has {sum(self.numels)}"
            )
        for name, part in zip(self.param_names, vector.to(torch.float32).split(self.numels)):
            if name in self._slots:
                offset, n = self._slots[name]
                self._residual[offset : offset + n].copy_(part)
            else:
                self._loaded[name] = part.clone()

    def reset_residuals(self) -> None:
        """Forget all residuals (they restart from zero)."""
        self._loaded = {}
        if self._residual is not None:
            self._residual.zero_()

    def counters(self) -> dict:
        """Step counter and statistics totals, for checkpoints."""
        controller = self.controller.state_dict() if self.controller is not None else None
        return {"step": self.step, "totals": dict(self.totals), "dense_mode": self._dense_mode, "controller": controller}

    def load_counters(self, saved: dict) -> None:
        self.step = int(saved["step"])
        self.totals.update(saved["totals"])
        self._dense_mode = bool(saved.get("dense_mode", False))
        if self.controller is not None and saved.get("controller"):
            self.controller.load_state_dict(saved["controller"])
            self.set_tau(self.controller.tau)

    def measuring_tau(self) -> bool:
        """Automatic tau that has not started yet: its first compressed step measures where to start."""
        return self.controller is not None and not self.controller.started

    def set_tau(self, tau: float) -> None:
        """The threshold of the next steps (the automatic-tau controller's output)."""
        self.tau = float(tau)
        self.tau32 = f32(tau)

    # ---- the update in flight (stale=True) -------------------------------------------------

    def drain(self) -> InFlight | None:
        """Wait for the exchange in flight, if any (checkpoints, end of fit); it stays pending."""
        if self._in_flight is not None:
            self._in_flight.wait()
        return self._in_flight

    def pending_entry(self) -> dict | None:
        """The exchange in flight, drained, for a checkpoint (:meth:`InFlight.entry`); None if none."""
        flight = self.drain()
        return flight.entry(self.param_names, self.numels, self.tau32) if flight is not None else None

    def load_pending(self, entry: dict, device: torch.device) -> None:
        """Restore a checkpoint's pending update: applied at the next step (``stale``), or added to every
        rank's residual otherwise (the mean residual is the update still to come, so nothing is lost)."""
        flight = InFlight.from_entry(entry, device)
        if self.stale:
            self._in_flight = flight
            return
        if flight.kind == "sparse":
            update = flight.vector * (self.tau32 if flight.tau32 is None else flight.tau32) / flight.world
        else:
            update = flight.vector / flight.world
        self.load_residual_vector(self.residual_vector(device) + update)

    # ---- the step outcome, consumed once by the strategy -------------------------------------

    def finish_step(
        self, parameters: Iterable[torch.nn.Parameter], loss_scaler: bool = False
    ) -> StepStats | None:
        """Apply the outcome of the newest exchange once, after backward and before the update.

        Skipped steps (a non-finite value on some rank; for dense warmup steps, in the averaged
        gradient every rank holds) leave every ``param.grad`` as ``None``, so torch optimizers skip
        the update without touching their state, are counted, warned about, and raise after too
        many in a row. With an AMP loss scaler the overflow belongs to the scaler: the gradients
        are filled with NaN so that it skips the step and lowers its scale, counted as
        ``overflows``, without warning and without the consecutive-skip limit. With ``stale=True``
        see :meth:`_finish_stale` for the steps that apply nothing.

        Args:
            parameters: the parameters the optimizer updates.
            loss_scaler: an AMP GradScaler scales the loss.

        Returns:
            the newest :class:`StepStats`, or ``None`` if no exchange happened since the last call.

        Raises:
            RuntimeError: ``max_consecutive_skips`` consecutive steps were skipped.
        """
        if self._last_consumed or self.last is None:
            return None
        self._last_consumed = True
        stats = self.last
        parameters = list(parameters)
        if stats.mode == "warmup" and not stats.skipped:
            grads = [p.grad for p in parameters if p.grad is not None]
            stats.skipped = not all(all_finite(g) for g in grads)
        if not stats.skipped:
            self.totals["consecutive_skips"] = 0
            if self.stale:
                self._finish_stale(parameters, stats, loss_scaler)
            return stats
        for p in parameters:
            if not loss_scaler:
                p.grad = None
            elif p.grad is not None:
                p.grad.fill_(math.nan)
        if loss_scaler:
            self.totals["overflows"] += 1
            return stats
        self.totals["skips"] += 1
        self.totals["consecutive_skips"] += 1
        where = f"on rank(s) {stats.bad_ranks}" if stats.bad_ranks else "in the averaged dense gradient"
        limit = self.max_consecutive_skips
        message = (
            f"GTC: non-finite gradient {where} at optimizer step {stats.step}: update skipped on every "
            f"rank, residuals unchanged ({self.totals['skips']} skips so far, "
            f"{self.totals['consecutive_skips']} in a row, limit {limit})"
        )
        if limit is not None and self.totals["consecutive_skips"] >= limit:
            raise RuntimeError(
                message
                + f"; {limit} consecutive skipped steps: training diverged. Lower the learning rate, "
                "check the data for NaN/Inf, or raise max_consecutive_skips"
            )
        if self.rank == 0:
            warnings.warn(message, RuntimeWarning, stacklevel=2)
        return stats

    def _finish_stale(self, parameters: list, stats: StepStats, loss_scaler: bool) -> None:
        """The optimizer's view of a stale step that was not skipped (from :meth:`finish_step`).

        Nothing applied (the first compressed step): no gradients, so that the optimizer does not move
        (zeros stay under a loss scaler). Parameters that no rank used in this backward keep
        ``grad = None`` under DDP, although the update being applied, an earlier step's, may move them:
        they get their part of it from the bucket buffers (checked only for them).
        """
        if stats.mode not in ("sparse", "dense"):
            return
        if stats.applied is None:
            if not loss_scaler:
                for p in parameters:
                    p.grad = None
            return
        if self._used is None or not self._applied:
            return
        for p in parameters:
            name = self._name_of.get(id(p))
            if p.grad is not None or name not in self._slots:
                continue
            offset, n = self._slots[name]
            for start, buffer in self._applied:
                if start <= offset < start + buffer.numel():
                    values = buffer[offset - start : offset - start + n]
                    if bool(values.any()):
                        p.grad = values.view_as(p).clone()
                    break

    def check_unknown_gradients(self, named_parameters: Iterable[tuple[str, torch.nn.Parameter]]) -> None:
        """Raise for a parameter that got a gradient but was frozen when DDP wrapped the model (e.g.
        unfrozen by Lightning's ``BaseFinetuning`` during fit): it is in none of DDP's buckets, so its
        gradient is never exchanged and the replicas would diverge without a word (plain DDP has the
        same limitation). The strategies call it after every backward pass that synchronised."""
        for name, p in named_parameters:
            if p.grad is not None and id(p) not in self._name_of:
                raise RuntimeError(
                    f"GTC: parameter {name!r} got a gradient but did not require one when the "
                    "model was wrapped in DDP at the start of fit, so no bucket holds it: its gradient is never "
                    "exchanged and the replicas would diverge (DDP itself has this limitation). Unfreezing during "
                    "fit (e.g. BaseFinetuning) is not supported: make it trainable before trainer.fit (with a zero "
                    "learning rate until it should train), or unfreeze between two trainer.fit calls (GTC carries "
                    "its state over)"
                )

    def _record(self, stats: StepStats) -> None:
        self.last = stats
        self._last_consumed = False
        if stats.mode == "sparse":
            self._silent = self._silent + 1 if stats.words_all == 0 else 0
            if self._silent == SILENT_STEPS and self.rank == 0:
                if self.compress == "update" and stats.tau == 0.0:
                    why = (
                        "the optimizer's steps were all zero. With parameters stored in bf16/fp16 (bf16-true, "
                        "16-true) a step below half a unit in the last place of a weight is rounded away by the "
                        "optimizer itself, as under DDP: train in mixed precision (fp32 weights), or use a larger "
                        "learning rate"
                    )
                else:
                    why = (
                        "every gradient stays below tau in the residuals and nothing reaches the optimizer. Use "
                        "tau='auto' with a target_density (the default), or a smaller tau"
                    )
                warnings.warn(
                    f"GTC: no rank sent a word for {SILENT_STEPS} optimizer steps in a row (up to step {stats.step}, "
                    f"tau={stats.tau:g}, density 0): {why}",
                    RuntimeWarning,
                    stacklevel=3,
                )
        self.totals["steps"] += 1
        if stats.mode in ("sparse", "dense", "warmup"):
            self.totals[f"{stats.mode}_steps"] += 1
        for key in ("words", "words_all", "bytes_sent", "bytes_received", "compress_s"):
            self.totals[key] += getattr(stats, key)
        self.totals["allreduce_fp32_bytes"] += stats.allreduce_fp32_bytes
        self.totals["allreduce_bf16_bytes"] += stats.allreduce_bf16_bytes

    def settle(self, block: bool = True) -> None:
        """Fill in the exchange and decode times of recent steps once their CUDA events completed
        (on CPU they are known at once); ``block=False`` leaves pending ones for later."""
        keep = []
        for stats, field, start, end in self._unsettled:
            seconds = self._clock.seconds(start, end, block)
            if seconds is None:
                keep.append((stats, field, start, end))
                continue
            setattr(stats, field, seconds)
            self.totals[field] += seconds
        self._unsettled = keep

    def stats(self) -> dict:
        """The newest step's statistics and the running totals, as plain numbers."""
        self.settle(block=False)
        total = dict(self.totals)
        sent = total["bytes_sent"]
        total["ratio_fp32"] = total["allreduce_fp32_bytes"] / sent if sent else math.inf
        total["ratio_bf16"] = total["allreduce_bf16_bytes"] / sent if sent else math.inf
        return {"step": self.step, "last": self.last.as_dict() if self.last else None, "total": total}
