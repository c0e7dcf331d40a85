"""Strom's gradient threshold compression as a DDP communication hook: one state class, one hook.

The algorithm, per optimizer step and per rank (Strom 2015, sections 2.3-2.6):

1. Warmup: for the first ``warmup_steps`` steps every bucket is averaged by DDP's own dense
   all-reduce hook, bit for bit as DDP.
2. Threshold, bucket by bucket as DDP hands them over, while backward goes on: ``out = residual +
   g`` (``g`` unscaled from AMP's loss scale and clipped as the Trainer asks) into a second
   residual buffer, the words ``index | sign << 31`` of every element with ``|out| > tau``
   appended to this step's message and ``±tau`` subtracted there. The old residual is kept, so a
   step skipped because of any rank needs no undo. Parameters this rank did not use
   in the backward (``find_unused_parameters``) are left out: DDP never applies an update to a
   parameter no rank used, so a word for one would be lost; their residual is carried over.
   Norm clipping needs every gradient first, so with it all buckets wait for the last one.
3. Header exchange at the last bucket: every rank sends ``[non-finite count, words, bytes]`` to
   every rank (all-to-all on gloo: one message latency; all-gather on NCCL), the step's one host
   synchronisation.
4. Decide, identically on every rank from the headers: *skip* (a non-finite value on some rank:
   residuals unchanged, the strategy drops the update), *dense* (the sparse exchange would move
   more bytes than a dense bf16 all-reduce: every rank's ``residual + g`` is all-reduced and the
   residuals restart from zero, so nothing is lost; hysteresis keeps it from flapping), or
   *sparse*.
5. Sparse: one word exchange (all-to-all of uneven messages where the backend is gloo, measured
   faster than padding to the longest; padded all-gather on NCCL); the new residual becomes the
   residual (buffer swap).
6. Decode every rank's words at once into the bucket buffers: exact int32 vote counts, then one
   float32 scale ``tau / world_size``, so every rank computes bit-identical gradients whatever the
   order of words, and the replicas stay identical forever without a broadcast ("dead reckoning").

Residuals live in one flat buffer laid out as DDP's buckets (bucket 0 first), and words index
that flat space. DDP rebuilds its buckets after the first iteration: the flat buffer is then laid
out anew and each parameter's residual moves with it (found by name), so nothing is misplaced.

All tensor work runs on the thread that calls the hook (no ``Future.then`` callbacks), which keeps
Triton's interpreter, which is not thread-safe, out of DDP's callback threads.
"""

import logging
import math
import time
import warnings
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from gtc_lightning.auto_tau import TauController
from gtc_lightning.ops import BACKENDS, MAX_NUMEL, step_ops
from gtc_lightning.ops.rice import rice_decode, rice_encode
from gtc_lightning.ops.torch_ops import INDEX_MASK

log = logging.getLogger(__name__)

# ``all_gather_into_tensor`` is deprecated from torch 2.13 on in favour of ``all_gather_single``
# (same arguments); the GPU machines run torch 2.11, which only has the former.
all_gather_equal = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_WORD_BYTES = 4
_HEADER = 3  # int64 values per rank: non-finite count, words, message bytes
CODINGS = ("none", "rice")
COMPRESS = ("auto", "gradient", "update")
# tau="auto" without a target_density: words per rank per element and step. The model suite
# (gtc_lightning.tools.model_suite, 4 ranks) put the update mode at 1e-2 within 1-5 % of DDP's held-out
# loss on a transformer, a GRU and the speech DNN at 150-170x fewer bytes than a fp32 all-reduce;
# 3e-3 gave 300-480x at 2-57 % worse loss on those short runs.
DEFAULT_DENSITY = 1e-2
AUTO_TAU_INIT = 1e-2  # tau="auto" before its first compressed step measured where to start
SAMPLE = 1 << 16  # gradient elements automatic tau's start is measured on (a strided sample)
EXCHANGES = ("auto", "alltoall", "allgather")
# Dense fallback: enter when the sparse exchange would move more bytes than a dense bf16 ring
# all-reduce (half of fp32's), leave again when it moves less than a quarter of fp32's. At 2 ranks
# the words of every element (4n bytes) are as many as fp32's 2 (W-1)/W 4n: only a threshold below
# fp32's lets the fallback fire there, and a step that sends a word for half the elements has
# stopped compressing anyway.
FALLBACK_ENTER, FALLBACK_EXIT = 0.5, 0.25
SILENT_STEPS = 20  # compressed steps in a row in which no rank sent a word before GTC warns
_NONE = ()


def allreduce_bytes(numel: int, world_size: int, element_bytes: int = 4) -> int:
    """Bytes one rank sends (and receives) in a ring all-reduce of ``numel`` elements:
    ``2 (W-1)/W * element_bytes * numel`` (fp32: 4 bytes, bf16: 2)."""
    return 2 * (world_size - 1) * element_bytes * numel // world_size if world_size > 1 else 0


@dataclass
class StepStats:
    """What one optimizer step's exchange did on this rank.

    Bytes are counted as the collectives put them on the wire per rank: a ring all-gather or a
    pairwise all-to-all sends each rank's message to the ``W - 1`` others; a ring all-reduce sends
    ``2 (W-1)/W`` of the buffer. They are compared with what a dense ring all-reduce of the same
    gradient would send, in fp32 and in bf16 (the stronger dense baseline).

    Attributes:
        step: 1-based count of synchronising backward passes, i.e. optimizer steps.
        mode: ``"sparse"`` (words exchanged), ``"dense"`` (fallback: residual + gradient
            all-reduced, residuals reset), ``"warmup"`` (DDP's dense all-reduce), or
            ``"skipped"`` (a non-finite value on some rank: nothing exchanged but the header).
        skipped: True when the update is dropped on every rank (also a warmup step whose averaged
            gradient is non-finite).
        bad_ranks: ranks that reported a non-finite value (empty for warmup steps).
        numel: gradient elements in all buckets.
        world_size: ranks in the exchange.
        words: words this rank emitted (0 unless sparse).
        words_all: words of all ranks together.
        bytes_sent: bytes this rank sent (header, words or the dense all-reduce).
        bytes_received: bytes this rank received.
        compress_s: seconds spent thresholding (all buckets).
        exchange_s: seconds spent in the collectives (host wall time).
        decompress_s: seconds spent decoding into the buckets.
        tau: the threshold this step's words were emitted with.
        share: the sparse exchange's bytes (the longest message, as the collectives send it) over a
            dense fp32 ring all-reduce's; the dense fallback enters above :data:`FALLBACK_ENTER` and
            leaves below :data:`FALLBACK_EXIT` (0 for warmup and skipped steps).
        applied: the optimizer step whose decoded update this step hands the optimizer: this step
            itself, or with ``stale=True`` the step before (an earlier one after a skip); ``None``
            when nothing is applied (a skip, or the first stale step: nothing in flight yet).
    """

    step: int
    mode: str
    skipped: bool
    bad_ranks: list
    numel: int
    world_size: int
    words: int
    words_all: int
    bytes_sent: int
    bytes_received: int
    compress_s: float
    exchange_s: float
    decompress_s: float
    applied: int | None = None
    tau: float = 0.0
    share: float = 0.0

    @property
    def dense(self) -> bool:
        return self.mode in ("dense", "warmup")

    @property
    def allreduce_fp32_bytes(self) -> int:
        """What a dense fp32 ring all-reduce of the gradient sends per rank."""
        return allreduce_bytes(self.numel, self.world_size, 4)

    @property
    def allreduce_bf16_bytes(self) -> int:
        """What a dense bf16 ring all-reduce of the gradient sends per rank."""
        return allreduce_bytes(self.numel, self.world_size, 2)

    @property
    def ratio_fp32(self) -> float:
        """fp32 all-reduce bytes per byte sent (inf when nothing was sent: one rank)."""
        return self.allreduce_fp32_bytes / self.bytes_sent if self.bytes_sent else math.inf

    @property
    def ratio_bf16(self) -> float:
        """bf16 all-reduce bytes per byte sent."""
        return self.allreduce_bf16_bytes / self.bytes_sent if self.bytes_sent else math.inf

    @property
    def density(self) -> float:
        """Words this rank emitted per gradient element."""
        return self.words / self.numel if self.numel else 0.0

    def as_dict(self) -> dict:
        out = asdict(self)
        for key in ("allreduce_fp32_bytes", "allreduce_bf16_bytes", "ratio_fp32", "ratio_bf16", "density"):
            out[key] = getattr(self, key)
        return out


_TOTAL_KEYS = (
    "steps",
    "sparse_steps",
    "dense_steps",
    "warmup_steps",
    "skips",
    "consecutive_skips",
    "overflows",
    "words",
    "words_all",
    "bytes_sent",
    "bytes_received",
    "allreduce_fp32_bytes",
    "allreduce_bf16_bytes",
    "compress_s",
    "exchange_s",
    "decompress_s",
)


def check_options(
    tau: float,
    warmup_steps: int,
    max_consecutive_skips: int | None,
    exchange: str,
    backend: str,
    coding: str = "none",
    target_density: float | None = None,
    compress: str = "gradient",
) -> None:
    """Validate GTC's hyper-parameters, with messages that say what each one means.

    Raises:
        ValueError: naming the bad value and what it should be.
    """
    if tau != "auto" and (
        isinstance(tau, bool) or not isinstance(tau, (int, float)) or not math.isfinite(tau) or tau <= 0
    ):
        raise ValueError(
            f"Expect tau to be a finite number > 0 or 'auto', got {tau!r}: it is the threshold a residual must "
            "pass to emit a word; start near 15x the per-rank gradient RMS (e.g. tau=1e-2), or let it adapt "
            "with tau='auto', target_density=1e-3"
        )
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(
            f"Expect warmup_steps to be an int >= 0 (dense steps before compression; 0 compresses from the "
            f"start), got {warmup_steps!r}"
        )
    if max_consecutive_skips is not None and (
        isinstance(max_consecutive_skips, bool)
        or not isinstance(max_consecutive_skips, int)
        or max_consecutive_skips < 1
    ):
        raise ValueError(
            f"Expect max_consecutive_skips to be an int >= 1 or None (never raise), got {max_consecutive_skips!r}"
        )
    if exchange not in EXCHANGES:
        raise ValueError(f"Expect exchange in {EXCHANGES}, got {exchange!r}")
    if backend not in BACKENDS:
        raise ValueError(f"Expect backend in {BACKENDS}, got {backend!r}")
    if coding not in CODINGS:
        raise ValueError(
            f"Expect coding in {CODINGS} (rice: Golomb-Rice coded index gaps, ~10 bits a word instead of 32), "
            f"got {coding!r}"
        )
    if target_density is not None and (
        isinstance(target_density, bool)
        or not isinstance(target_density, (int, float))
        or not 0.0 < target_density < 1.0
    ):
        raise ValueError(
            f"Expect target_density to be None or a number in (0, 1) (words per rank per gradient element and "
            f"step, e.g. 1e-3), got {target_density!r}"
        )
    if compress not in COMPRESS:
        raise ValueError(
            f"Expect compress in {COMPRESS} ('gradient': Strom's residual of gradients, for plain SGD; 'update': "
            f"the step each rank's optimizer makes, for momentum SGD and Adam; 'auto': by the optimizer), got "
            f"{compress!r}"
        )


def sparse_gradient_parameters(module: torch.nn.Module) -> list[str]:
    """Names of trainable parameters that get sparse gradients (``nn.Embedding(sparse=True)``,
    ``nn.EmbeddingBag(sparse=True)``): GTC compresses dense gradient buckets only."""
    names = []
    for prefix, sub in module.named_modules():
        if isinstance(sub, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and sub.sparse:
            names += [
                f"{prefix}.{name}" if prefix else name
                for name, p in sub.named_parameters(recurse=False)
                if p.requires_grad
            ]
    return names



class GTCState:
    """State of :func:`gtc_hook`: hyper-parameters, per-element residuals and statistics.

    Args:
        process_group: the group to exchange within; ``None`` for the default (world) group.
        named_parameters: ``(name, parameter)`` pairs of the module DDP wraps; only parameters
            with ``requires_grad`` get residuals (they are the ones DDP puts into buckets).
        tau: the threshold; each word moves one element by ``tau / world_size``; with a
            ``target_density`` the initial value (``"auto"``: 1e-2).
        target_density: adapt tau after every step so that the words per rank and gradient
            element track this (:mod:`gtc_lightning.auto_tau`); None keeps tau fixed.
        warmup_steps: optimizer steps of dense all-reduce before compression starts.
        max_consecutive_skips: raise after this many consecutive skipped steps; ``None``: never.
        dense_fallback: fall back to a dense all-reduce on steps where the sparse exchange would
            move more bytes than a bf16 all-reduce (see :data:`FALLBACK_ENTER`).
        exchange: ``"alltoall"`` (uneven messages), ``"allgather"`` (padded to the longest) or
            ``"auto"`` (all-to-all on gloo, all-gather otherwise); the header goes the same way.
        backend: ``"auto"`` (Triton on CUDA, torch elsewhere), ``"torch"`` or ``"triton"``.
        stale: one-step-stale mode (:mod:`gtc_lightning.stale`): each step's exchange runs while
            the next step computes, and its update is applied one step late.
        coding: ``"rice"``: Golomb-Rice coded messages; ``"none"``: 32-bit words.
        compress: ``"gradient"`` (Strom's: the residual of gradients, in the DDP hook) or
            ``"update"`` (:mod:`gtc_lightning.update`: the residual of the steps each rank's
            optimizer makes); ``"auto"`` until the strategy has seen the optimizers.
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
    ) -> None:
        check_options(tau, warmup_steps, max_consecutive_skips, exchange, backend, coding, target_density, compress)
        measure = tau == "auto"  # automatic tau measures where to start at its first compressed step
        if tau == "auto":
            tau = AUTO_TAU_INIT
            target_density = DEFAULT_DENSITY if target_density is None else target_density
        # The hyper-parameters.
        self.process_group = process_group
        self.tau = float(tau)
        self.tau32 = float(np.float32(tau))
        self.warmup_steps = warmup_steps
        self.max_consecutive_skips = max_consecutive_skips
        self.dense_fallback = bool(dense_fallback)
        self.exchange = exchange
        self.backend = backend
        self.stale = bool(stale)
        self.coding = coding
        self.compress = compress
        self.target_density = target_density
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
        self._warned_fallback = False
        self._silent = 0  # compressed steps in a row without a word from any rank
        self.last: StepStats | None = None  # the newest exchange, read by the strategy
        self._last_consumed = True
        # The statistics.
        self.totals: dict[str, float] = {key: 0 for key in _TOTAL_KEYS}
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
        self._clock = _Clock(torch.device("cpu"))
        # stale=True: the exchange in flight (a stale.InFlight), and the second message and sum
        # buffers that step t+1 writes while step t's are still being sent.
        self._in_flight = None
        self._spare_message: torch.Tensor | None = None
        self._spare_sum: torch.Tensor | None = None
        self._applied: list[tuple[int, torch.Tensor]] = []  # (offset, bucket buffer) of the last decode
        # compress="update": the parameters before the step, then the message, then the mean update.
        self._scratch: torch.Tensor | None = None

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

    _PICKLED = (
        "tau", "tau32", "warmup_steps", "max_consecutive_skips", "dense_fallback", "exchange", "backend",
        "stale", "coding", "compress", "target_density", "controller", "clip", "grad_scale", "param_names",
        "numels", "step", "totals", "last",
        "_dense_mode", "_warned_fallback",
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
        state["pending"] = None
        if self._in_flight is not None:
            from gtc_lightning.stale import pending_entry  # (it imports this module)

            state["pending"] = pending_entry(self)
        return state

    def __setstate__(self, state: dict) -> None:
        """Restore with the default process group; ``bind(named_parameters)`` must follow."""
        residuals = state.pop("residuals")
        pending = state.pop("pending", None)
        self.__dict__.update(state)
        self.process_group = None
        self._name_of = {}
        self._used, self._usage_handles = None, []
        self._last_consumed, self._silent = True, 0
        self._reset_buffers()
        self.load_residual_vector(residuals)
        if pending is not None:
            from gtc_lightning.stale import load_pending  # (it imports this module)

            load_pending(self, pending, torch.device("cpu"))
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
        if flight is not None:
            from gtc_lightning.stale import pending_by_name  # (it imports this module)

            flight = pending_by_name(self, flight)
        self.untrack_usage()
        self.bind(named_parameters)
        self._reset_buffers()
        if flight is not None:
            from gtc_lightning.stale import pending_in_order  # (it imports this module)

            self._in_flight = pending_in_order(self, *flight)
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
        self.tau32 = _f32(tau)

    # ---- the flat layout -------------------------------------------------------------------

    def _bucket_offset(self, bucket: dist.GradBucket, params: list) -> int:
        """Offset of ``bucket`` in the flat space; lays the space out anew when DDP rebuilt its
        buckets (or on the first step), moving each parameter's residual by name."""
        index = bucket.index()
        key = tuple(id(p) for p in params)
        if self._building is None and (index >= len(self._keys) or self._keys[index] != key):
            self._start_layout(bucket.buffer().device)
        offset = self._step_offset
        building = self._building
        if building is None:
            return self._offsets[index]
        for p in params:
            name = self._name_of.get(id(p))
            if name is None:
                raise RuntimeError(
                    f"DDP's bucket {index} holds a parameter of shape {tuple(p.shape)} that GTC does not know; "
                    "the model's parameters changed after the strategy was set up"
                )
            n = p.numel()
            where = building["residual"][offset : offset + n]
            if name in self._slots:
                old, _ = self._slots[name]
                where.copy_(self._residual[old : old + n])
            elif name in self._loaded:
                where.copy_(self._loaded[name])
            building["slots"][name] = (offset, n)
            offset += n
        building["keys"].append(key)
        building["offsets"].append(self._step_offset)
        return self._step_offset

    def _start_layout(self, device: torch.device) -> None:
        capacity = sum(self.numels)
        prefix = self._step_offset  # buckets already done this step keep their place
        residual = torch.zeros(capacity, dtype=torch.float32, device=device)
        spare = torch.empty(capacity, dtype=torch.float32, device=device)
        done = len(self._pending)
        if prefix:
            residual[:prefix].copy_(self._residual[:prefix])
            spare[:prefix].copy_(self._spare[:prefix])
        slots = {name: slot for name, slot in self._slots.items() if slot[0] < prefix}
        self._building = {
            "residual": residual,
            "spare": spare,
            "keys": self._keys[:done],
            "offsets": self._offsets[:done],
            "slots": slots,
        }
        counts_dtype = step_ops(device, self.backend).COUNTS_DTYPE
        if self._counts is None or self._counts.device != device or self._counts.dtype != counts_dtype:
            self._counts = torch.zeros(capacity, dtype=counts_dtype, device=device)
            self._message = torch.empty(capacity, dtype=torch.int32, device=device)

    def _finish_layout(self) -> None:
        building, self._building = self._building, None
        if building is None:
            return
        self._residual, self._spare = building["residual"], building["spare"]
        self._keys, self._offsets, self._slots = building["keys"], building["offsets"], building["slots"]
        self._loaded = {}
        log.debug("GTC: flat layout of %d buckets, %d elements", len(self._keys), self._step_offset)

    def _buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(committed residual, next residual) flat buffers of the step in progress."""
        if self._building is not None:
            return self._building["residual"], self._building["spare"]
        return self._residual, self._spare

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
        see :func:`gtc_lightning.stale.finish_stale` for the steps that apply nothing.

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
                from gtc_lightning.stale import finish_stale

                finish_stale(self, parameters, stats, loss_scaler)
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
                warnings.warn(
                    f"GTC: no rank sent a word for {SILENT_STEPS} optimizer steps in a row (up to step {stats.step}, "
                    f"tau={stats.tau:g}, density 0): every gradient stays below tau in the residuals and nothing "
                    "reaches the optimizer. Use tau='auto' with a target_density (the default), or a smaller tau",
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


def parameter_checksums(parameters: Iterable[torch.Tensor]) -> torch.Tensor:
    """A cheap exact fingerprint per parameter: the sum of its bit patterns as integers.

    Any single changed bit changes the sum, so replicas that drifted apart by a rounding error
    show up; it is not a cryptographic hash.

    Args:
        parameters: tensors on one device.

    Returns:
        ``[P]`` int64, one checksum per parameter.
    """
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    sums = [p.detach().reshape(-1).view(as_int[p.element_size()]).to(torch.int64).sum() for p in parameters]
    return torch.stack(sums) if sums else torch.zeros(0, dtype=torch.int64)


def all_finite(tensor: torch.Tensor) -> bool:
    """Exact, and cheaper than ``isfinite(t).all()``: a NaN or Inf element makes the sum
    non-finite; only a finite sum that overflowed needs the elementwise check."""
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


def _new_future(device: torch.device) -> torch.futures.Future:
    # A Future holding CUDA tensors must be told its devices, so that it can synchronise streams.
    return torch.futures.Future(devices=[device]) if device.type == "cuda" else torch.futures.Future()


def _f32(x: float) -> float:
    return float(np.float32(x))


class _Clock:
    """Host wall time on CPU; CUDA events on GPU, read only once they have completed, so that
    timing never adds a host synchronisation of its own."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start, end, block: bool = True) -> float | None:
        """Seconds from ``start`` to ``end``; None when not ``block`` and ``end`` is still pending."""
        if not self.cuda:
            return end - start
        if not block and not end.query():
            return None
        end.synchronize()
        return start.elapsed_time(end) / 1000.0


def gtc_hook(state: GTCState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: Strom's threshold compression with one exchange per step.

    Register with ``ddp_model.register_comm_hook(state, gtc_hook)``. The steps are numbered as in
    the module docstring.

    Args:
        state: the :class:`GTCState` shared by all buckets.
        bucket: the DDP bucket; ``bucket.buffer()`` is ``[n]``, this rank's gradients of
            ``bucket.parameters()`` back to back.

    Returns:
        a Future of the ``[n]`` averaged gradient estimate, written into ``bucket.buffer()``;
        completed when the last bucket of the step arrives.
    """
    if state.compress == "update":  # gtc_lightning.update: the optimizer's step is compressed, not this
        return local_hook(state, bucket)
    # 1. Dense warmup, averaged over ranks as DDP's default hook does.
    if state.step < state.warmup_steps:
        if bucket.is_last():
            state.step += 1
            if state._used is not None:
                state._used.clear()
            numel = sum(state.numels)
            world = state.world_size
            dense = allreduce_bytes(numel, world)
            state._record(
                StepStats(
                    step=state.step, mode="warmup", skipped=False, bad_ranks=[], numel=numel, world_size=world,
                    words=0, words_all=0, bytes_sent=dense, bytes_received=dense,
                    compress_s=0.0, exchange_s=0.0, decompress_s=0.0,
                )
            )  # fmt: skip
        return allreduce_hook(state.process_group, bucket)

    # 2. Threshold this bucket now (or keep it for the norm), then wait for the last one.
    if bucket.index() == 0:
        _begin_step(state, bucket.buffer().device)
    buffer = bucket.buffer()
    future = _new_future(buffer.device)
    params = bucket.parameters()
    offset = state._bucket_offset(bucket, params)
    state._step_offset = offset + buffer.numel()
    runs = _used_runs(state, params, buffer.numel())
    state._pending.append((bucket, future, offset))
    norm_clip = state.clip is not None and state.clip[0] == "norm"
    if norm_clip or state.measuring_tau():
        state._deferred.append((buffer, offset, runs))
        if norm_clip:
            norm = torch.linalg.vector_norm(buffer, dtype=torch.float32)
            state._norm_sq = norm * norm if state._norm_sq is None else state._norm_sq + norm * norm
    else:
        _threshold_bucket(state, buffer, offset, runs, alpha=1.0 / state.grad_scale)
    if bucket.is_last():
        _exchange(state)
        _adapt_tau(state)
    return future


def local_hook(state: GTCState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """``compress="update"``: the gradient stays local (each rank's optimizer steps on its own), but
    during the dense warm-up DDP's all-reduce averages it."""
    if state.step < state.warmup_steps:
        return allreduce_hook(state.process_group, bucket)
    future = _new_future(bucket.buffer().device)
    future.set_result(bucket.buffer())
    return future


def _adapt_tau(state: GTCState) -> None:
    """Automatic tau: after a compressed step that was not skipped, move tau towards the target
    density, from the word counts every rank received in the headers (so every rank agrees)."""
    last = state.last
    if state.controller is None or last is None or last.skipped or last.step != state.step:
        return
    density = sum(state._step_counts) / max(last.world_size * last.numel, 1)
    state.set_tau(state.controller.update(density))


def _begin_step(state: GTCState, device: torch.device) -> None:
    # A new step starting at bucket 0 drops leftovers of a backward pass that failed half-way.
    state._pending, state._deferred, state._unused = [], [], []
    state._building, state._norm_sq, state._step_offset = None, None, 0
    if state._counts is None:
        state._start_layout(device)
    state._ops = step_ops(device, state.backend)
    state._clock = _Clock(device)
    state._cursor = torch.zeros(1, dtype=torch.int64, device=device)
    state._bad = torch.zeros(1, dtype=torch.int32, device=device)
    state._compress_marks = []
    state.settle()


def _used_runs(state: GTCState, params: list, numel: int) -> list[tuple[int, int, bool]]:
    """``(start, end, used)`` element ranges of a bucket, merged where neighbours agree."""
    if state._used is None:
        return [(0, numel, True)]
    runs: list[list] = []
    start = 0
    for p in params:
        used = id(p) in state._used
        if runs and runs[-1][2] == used:
            runs[-1][1] += p.numel()
        else:
            runs.append([start, start + p.numel(), used])
        start += p.numel()
    return [tuple(r) for r in runs]


def _threshold_bucket(
    state: GTCState, buffer: torch.Tensor, offset: int, runs: list, alpha: float
) -> None:
    """Step 2 for one bucket: the new residual into the spare buffer, words into the message."""
    start = state._clock.now()
    residual, spare = state._buffers()
    clip = None
    if state.clip is not None and state.clip[0] == "value":
        clip = state.clip[1] * state.grad_scale  # the bucket holds loss-scaled gradients
    for lo, hi, used in runs:
        a, b = offset + lo, offset + hi
        if not used:
            spare[a:b].copy_(residual[a:b])
            state._unused.append((a, b))
            continue
        state._ops.threshold_(
            buffer[lo:hi], residual[a:b], spare[a:b], state.tau32, state._message, state._cursor, state._bad,
            offset=a, alpha=alpha, clip=clip,
        )  # fmt: skip
    state._compress_marks.append((start, state._clock.now()))


def _first_tau(state: GTCState, alpha: float) -> float:
    """Automatic tau's start, measured, so that no gradient scale is presumed: every rank takes the
    ``1 - target_density`` quantile of ``|residual + alpha * gradient|`` over a strided sample of the
    step's buckets, and the ranks agree on the geometric mean (one small all-reduce, at the first
    compressed step only)."""
    residual, _ = state._buffers()
    total = sum(buffer.numel() for buffer, _, _ in state._deferred)
    stride = max(1, total // SAMPLE)
    parts = [
        (residual[offset : offset + buffer.numel()] + alpha * buffer.float())[::stride]
        for buffer, offset, _ in state._deferred
    ]
    sample = torch.cat(parts).abs() if parts else torch.zeros(1)
    sample = sample[torch.isfinite(sample)]
    k = min(sample.numel(), max(1, math.ceil((1.0 - state.controller.target_density) * sample.numel())))
    tau = float(torch.kthvalue(sample.cpu(), k).values) if sample.numel() else 0.0
    log_tau = torch.tensor([math.log(tau) if tau > 0 else math.log(AUTO_TAU_INIT)], dtype=torch.float64)
    if state.world_size > 1:
        log_tau = log_tau.to(residual.device)
        dist.all_reduce(log_tau, group=state.process_group)
        log_tau = log_tau.cpu() / state.world_size
    return float(torch.exp(log_tau))


def _exchange(state: GTCState) -> None:
    """Steps 3-6 for all buckets of one step; completes every Future."""
    state.step += 1
    world, rank = state.world_size, state.rank
    if state._deferred:
        coef = 1.0
        if state._norm_sq is not None:
            # Norm clipping: one coefficient for the whole local gradient, unscaled (as
            # clip_grad_norm_), folded into the gradient's factor.
            norm = float(state._norm_sq.sqrt()) / state.grad_scale
            limit = state.clip[1]
            coef = min(1.0, limit / (norm + 1e-6)) if math.isfinite(norm) else 1.0
        if state.measuring_tau():
            state.set_tau(state.controller.start(_first_tau(state, coef / state.grad_scale)))
        for buffer, offset, runs in state._deferred:
            _threshold_bucket(state, buffer, offset, runs, alpha=coef / state.grad_scale)
        state._deferred = []
    state._finish_layout()
    numel = state._step_offset
    residual, spare = state._residual, state._spare
    pending, state._pending = state._pending, []
    used, state._unused = state._unused, []
    if state._used is not None:
        state._used.clear()
    clock = state._clock

    # 3. One header exchange: non-finite count and words of every rank; the step's host sync.
    start = clock.now()
    if state.coding == "rice":
        state._coded = rice_encode(state._message[: int(state._cursor)])
        size = torch.tensor([state._coded.numel()], dtype=torch.int64, device=state._cursor.device)
    else:
        size = state._cursor * _WORD_BYTES
    header = torch.cat([state._bad.to(torch.int64), state._cursor, size])
    headers = send_header(state, header).view(world, _HEADER).tolist()
    header_bytes = (world - 1) * _HEADER * 8
    bad_ranks = [r for r, (bad, _, _) in enumerate(headers) if bad]
    counts = [words for _, words, _ in headers]
    state._step_counts = counts
    sizes = [message_bytes for _, _, message_bytes in headers]
    own = counts[rank]
    fp32_bytes = allreduce_bytes(numel, world)

    compress_s = sum(clock.seconds(a, b) for a, b in state._compress_marks)  # complete: synced above

    def record(mode: str, sent: int, received: int, exchanged, end, applied: int | None = state.step) -> None:
        sparse = mode == "sparse"
        stats = StepStats(
            step=state.step, mode=mode, skipped=mode == "skipped", bad_ranks=bad_ranks, numel=numel,
            world_size=world, words=own if sparse else 0, words_all=sum(counts) if sparse else 0,
            bytes_sent=header_bytes + sent, bytes_received=header_bytes + received,
            compress_s=compress_s, exchange_s=0.0, decompress_s=0.0, applied=None if mode == "skipped" else applied,
            tau=state.tau, share=0.0 if mode == "skipped" else share,
        )  # fmt: skip
        state._record(stats)
        state._unsettled += [(stats, "exchange_s", start, exchanged), (stats, "decompress_s", exchanged, end)]
        if not clock.cuda:
            state.settle()

    # 4. Decide, on every rank from the same headers.
    if bad_ranks:
        for bucket, future, _ in pending:
            future.set_result(bucket.buffer().zero_())
        now = clock.now()
        record("skipped", 0, 0, now, now)
        return
    dense = False
    share = (world - 1) * max(sizes) / fp32_bytes if fp32_bytes else 0.0
    if state.dense_fallback and world > 1:
        was_dense = state._dense_mode
        state._dense_mode = share > (FALLBACK_EXIT if was_dense else FALLBACK_ENTER)
        if state._dense_mode and not state._warned_fallback and rank == 0:
            state._warned_fallback = True
            warnings.warn(
                f"GTC: at optimizer step {state.step} the sparse exchange would send {share:.2f}x the bytes of a "
                f"dense fp32 all-reduce, more than a bf16 all-reduce (up to {max(counts)} words of {numel} elements, "
                f"density {max(counts) / max(numel, 1):.2%}, tau={state.tau:g}); falling back to dense all-reduce "
                f"until it drops below {FALLBACK_EXIT}x. A larger tau (or tau='auto' with a target_density) keeps "
                "the exchange sparse",
                RuntimeWarning,
                stacklevel=3,
            )
        dense = state._dense_mode
    if state.stale:
        from gtc_lightning.stale import exchange_stale  # (it imports this module)

        exchange_stale(state, pending, used, counts, sizes, numel, record, dense)
        return
    if dense:
        _dense_step(state, pending, used, own, numel, start, record)
        return

    # 5. One word exchange.
    if state.coding == "rice":
        data, width, sent, received, _ = send_coded(state, sizes)
        words, lengths = decode_coded(data, sizes, width), None
    else:
        words, lengths, sent, received, _ = send_words(state, counts)
    exchanged = clock.now()
    state._residual, state._spare = spare, residual

    # 6. Decode every bucket from all ranks' words at once.
    outputs = [(o, b.buffer()) for b, _, o in pending]
    scale = word_scale(state, world)
    state._ops.decode_(words, lengths, state._counts, outputs, scale)
    feed_back(state, sparse_rounding(words, lengths, outputs, scale, state.grad_scale))
    for bucket, future, _ in pending:
        future.set_result(bucket.buffer())
    record("sparse", sent, received, exchanged, clock.now())


def send_header(state: GTCState, header: torch.Tensor) -> torch.Tensor:
    """Step 3's collective: every rank's ``[h]`` int64 header to every rank, ``[world * h]`` in rank
    order. With the all-to-all exchange (gloo) the header goes by all-to-all too: each rank
    sends its header to each peer at once, one message latency, where gloo's all-gather is a ring of
    world - 1 latencies in a row (``gtc_lightning.bench_exchange`` on 4 emulated nodes at 1 Gbit/s:
    header and 13,000 words a step in 3.1 against 5.5 ms).
    """
    world = state.world_size
    if world == 1:
        return header
    headers = torch.empty(world * header.numel(), dtype=torch.int64, device=header.device)
    if exchange_kind(state) == "alltoall":
        dist.all_to_all_single(headers, header.repeat(world), group=state.process_group)
    else:
        all_gather_equal(headers, header, group=state.process_group)
    return headers


def word_scale(state: GTCState, world: int, tau32: float | None = None) -> float:
    """What one vote is worth in the bucket: ``tau / world`` in float32, times the loss scale;
    ``tau32``: the float32 tau the words were thresholded with, when not the state's (``stale=True``
    with automatic tau applies a step's words after tau moved)."""
    return _f32(_f32((state.tau32 if tau32 is None else tau32) / world) * state.grad_scale)


def send_words(state: GTCState, counts: list[int], async_op: bool = False) -> tuple:
    """Step 5's collective: every rank's words to every rank (all-to-all of uneven messages, or an
    all-gather padded to the longest).

    Args:
        state: the state; its message holds this rank's ``counts[rank]`` words.
        counts: words of every rank, from the headers.
        async_op: launch and return the handle instead of waiting (``stale=True``).

    Returns:
        ``(words, lengths, bytes sent, bytes received, work)``: ``words`` ``[sum(counts)]`` all valid
        (``lengths`` None) or ``[W * max(counts)]`` with ``lengths = counts`` valid per row; ``work``
        the collective's handle when ``async_op`` (None when nothing had to be sent).
    """
    group, world, rank = state.process_group, state.world_size, state.rank
    own, message = counts[rank], state._message
    if world == 1 or not sum(counts):
        return message[:own], None, 0, 0, None
    if exchange_kind(state) == "alltoall":
        words = torch.empty(sum(counts), dtype=torch.int32, device=message.device)
        work = dist.all_to_all_single(
            words, message[:own].repeat(world), output_split_sizes=counts, input_split_sizes=[own] * world,
            group=group, async_op=async_op,
        )  # fmt: skip
        return words, None, (world - 1) * own * _WORD_BYTES, (sum(counts) - own) * _WORD_BYTES, work
    width = max(counts)
    words = torch.empty(world * width, dtype=torch.int32, device=message.device)
    work = all_gather_equal(words, message[:width], group=group, async_op=async_op)
    sent = (world - 1) * width * _WORD_BYTES
    return words, counts, sent, sent, work


def send_coded(state: GTCState, sizes: list[int], async_op: bool = False) -> tuple:
    """Step 5 with ``coding="rice"``: every rank's Golomb-Rice coded message (``sizes`` bytes each)
    to every rank (all-to-all of uneven messages, or an all-gather padded to the longest).

    Returns:
        ``(data, width, bytes sent, bytes received, work)``: ``data`` the received bytes, laid out as
        :func:`decode_coded` reads them with ``sizes`` and ``width`` (None: back to back, else rows
        of ``width``); ``work`` the collective's handle when ``async_op`` (None when nothing was sent).
    """
    group, world, rank = state.process_group, state.world_size, state.rank
    coded, own = state._coded, sizes[rank]
    if world == 1:
        return coded, None, 0, 0, None
    if exchange_kind(state) == "alltoall":
        data = torch.empty(sum(sizes), dtype=torch.uint8, device=coded.device)
        work = dist.all_to_all_single(
            data, coded.repeat(world), output_split_sizes=sizes, input_split_sizes=[own] * world, group=group,
            async_op=async_op,
        )  # fmt: skip
        return data, None, (world - 1) * own, sum(sizes) - own, work
    width = max(sizes)
    padded = torch.zeros(width, dtype=torch.uint8, device=coded.device)
    padded[:own] = coded
    data = torch.empty(world * width, dtype=torch.uint8, device=coded.device)
    work = all_gather_equal(data, padded, group=group, async_op=async_op)
    sent = (world - 1) * width
    return data, width, sent, sent, work


def decode_coded(data: torch.Tensor, sizes: list[int], width: int | None) -> torch.Tensor:
    """The words of every rank's coded message in ``data`` (as :func:`send_coded` received it), rank
    0's first, as ``send_words`` gives them."""
    if width is None:
        parts = data.split(sizes)
    else:
        parts = [row[:n] for row, n in zip(data.view(len(sizes), width), sizes)]
    return torch.cat([rice_decode(part) for part in parts])


def exchange_kind(state: GTCState) -> str:
    if state.exchange != "auto":
        return state.exchange
    return "alltoall" if dist.get_backend(state.process_group) == "gloo" else "allgather"


def _dense_step(state: GTCState, pending: list, unused: list, own: int, numel: int, start, record) -> None:
    """Step 4's fallback: all-reduce every rank's residual + gradient; residuals restart at zero.

    A parameter this rank did not use sends zeros and keeps its residual, so that nothing is
    applied to a parameter no rank used (DDP would drop it) and nothing is lost.
    """
    world, clock, sums = state.world_size, state._clock, state._spare
    reduce_dense(state, unused, own, numel)
    exchanged = clock.now()
    outputs = [(o, b.buffer()) for b, _, o in pending]
    decode_dense(sums, world, state.grad_scale, outputs)
    feed_back(state, dense_rounding(sums, world, outputs, state.grad_scale))
    for bucket, future, _ in pending:
        future.set_result(bucket.buffer())
    sent = allreduce_bytes(numel, world)
    record("dense", sent, sent, exchanged, clock.now())


def reduce_dense(state: GTCState, unused: list, own: int, numel: int, async_op: bool = False):
    """The fallback's collective: sum every rank's residual + gradient (the spare buffer) over the
    ranks, and restart the residuals at zero (those of parameters this rank did not use excepted).

    Returns:
        the all-reduce's handle when ``async_op``, else None.
    """
    residual, spare = state._residual, state._spare
    # Take back the tau the threshold pass subtracted at this rank's words (exact up to one rounding).
    state._ops.apply_words_(spare, state._message[:own], -state.tau32)
    for a, b in unused:
        spare[a:b].zero_()
    work = dist.all_reduce(spare[:numel], group=state.process_group, async_op=async_op)
    kept = [(a, b, residual[a:b].clone()) for a, b in unused]
    residual.zero_()
    for a, b, values in kept:
        residual[a:b].copy_(values)
    return work


def decode_dense(sums: torch.Tensor, world: int, grad_scale: float, outputs: list) -> None:
    """Write ``sums / world`` (times the loss scale) into each ``(offset, [n] buffer)`` of ``outputs``."""
    for offset, buffer in outputs:
        torch.div(sums[offset : offset + buffer.numel()], world, out=buffer)
        if grad_scale != 1.0:
            buffer.mul_(grad_scale)


# ---- what a bf16/fp16 bucket cannot hold goes back into the residual ---------------------------------
#
# DDP's buckets have the parameters' dtype: with bf16 or fp16 parameters the decoded update is rounded
# to it. The rounding error ``e`` of an element is the same on every rank (every rank decodes the same
# words); each rank adds it to its residual, so the mean residual, the update still to come, grows by
# exactly what the rounding took off, and conservation holds in low-precision buckets too.


def _low_precision(outputs: list) -> list:
    return [(offset, buffer) for offset, buffer in outputs if buffer.dtype != torch.float32]


def sparse_rounding(
    words: torch.Tensor, lengths: list[int] | None, outputs: list, scale: float, grad_scale: float
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``[(flat index, error)]`` of the elements whose decoded value ``count * scale`` a low-precision
    output rounded, unscaled by the loss scale; O(words), nothing for float32 outputs."""
    low = _low_precision(outputs)
    if not low or not words.numel():
        return []
    if lengths is not None:
        rows = words.view(len(lengths), -1)
        words = torch.cat([rows[r, :n] for r, n in enumerate(lengths)])
    index, inverse = torch.unique((words & INDEX_MASK).long(), return_inverse=True)
    votes = torch.zeros(index.numel(), dtype=torch.float32, device=words.device)
    votes.index_add_(0, inverse, torch.where(words < 0, -1.0, 1.0).to(torch.float32))
    exact = votes * scale  # float32, as the decode kernels compute it
    errors = []
    for offset, buffer in low:
        inside = (index >= offset) & (index < offset + buffer.numel())
        at = index[inside]
        error = exact[inside] - buffer[at - offset].float()
        errors.append((at, error / grad_scale if grad_scale != 1.0 else error))
    return errors


def dense_rounding(
    sums: torch.Tensor, world: int, outputs: list, grad_scale: float
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """As :func:`sparse_rounding` for a dense update ``sums / world`` (every element)."""
    errors = []
    for offset, buffer in _low_precision(outputs):
        n = buffer.numel()
        exact = sums[offset : offset + n] / world
        at = torch.arange(offset, offset + n, device=sums.device)
        errors.append((at, exact - buffer.float() / grad_scale))
    return errors


def feed_back(state: GTCState, errors: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Add the rounding errors to the committed residual (call once the step's residual is committed)."""
    for at, error in errors:
        state._residual.index_add_(0, at, error)
