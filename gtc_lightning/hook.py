"""Strom's gradient threshold compression as a DDP communication hook: one state class, one hook.

The algorithm, per optimizer step and per rank (Strom 2015, sections 2.3-2.6):

1. Warmup: for the first ``warmup_steps`` steps every bucket is averaged by a dense all-reduce.
2. Stash: DDP hands the hook one bucket at a time, in bucket-index order. Each bucket's Future is
   kept pending until the last bucket (``bucket.is_last()``) arrives; then one exchange serves all
   buckets, so the decision to skip a step is taken once, for the whole model, on every rank.
3. Compress: if all local gradients are finite, ``compress(grad, residual, tau)`` per bucket adds
   the gradient into the per-element residual and emits int32 words (index | sign << 31). The
   residuals are backed up first, so a step skipped because of another rank can be undone exactly.
4. Header exchange: every rank all-gathers ``[non_finite_flag, words_in_bucket_0, ...]``. Any flag
   set: every rank restores its residuals, the step is marked skipped (the strategy then leaves
   ``param.grad`` as ``None`` so the optimizer does nothing) and no words travel.
5. Word exchange: each rank's words, concatenated over buckets, are padded to the longest message
   and all-gathered in one collective of equal sizes (which gloo requires and NCCL does fastest).
6. Decode: per bucket, the words of all ranks are decoded with
   ``decompress(words, numel, tau, divisor=world_size)`` into the bucket buffer. The decoding goes
   through exact integer counts, so every rank computes bit-identical gradients and the replicas
   stay identical forever without any broadcast ("dead reckoning").

Residuals live per parameter (keyed by name) as views into one flat tensor per bucket. DDP
rebuilds its buckets after the first iteration; when a bucket's parameters change, a new flat
tensor is assembled from the per-parameter residuals, so nothing is lost or misplaced.

All tensor work runs on the thread that calls the hook (no ``Future.then`` callbacks), which keeps
Triton's interpreter, which is not thread-safe, out of DDP's callback threads.
"""

import logging
import math
import time
import warnings
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from gtc_lightning.ops import compress, decompress

log = logging.getLogger(__name__)

# ``all_gather_into_tensor`` is deprecated from torch 2.13 on in favour of ``all_gather_single``
# (same arguments); the GPU machines run torch 2.11, which only has the former.
all_gather_equal = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_HEADER_DTYPE = torch.int64
_WORD_BYTES = 4
_DENSE_BYTES = 4  # an fp32 gradient element, what a dense all-reduce message carries


@dataclass
class StepStats:
    """What one optimizer step's exchange did on this rank.

    Attributes:
        step: 1-based count of synchronising backward passes, i.e. optimizer steps.
        dense: True for a warmup step (dense all-reduce, no compression).
        skipped: True when a non-finite gradient made every rank skip this update.
        bad_ranks: ranks that reported a non-finite gradient (empty when unknown: dense steps).
        numel: gradient elements in all buckets.
        words: words this rank sent (a dense step counts one per element).
        words_all: words all ranks sent together.
        bytes_sent: bytes this rank put into the collectives (header + padded words; for a dense
            step, its fp32 message).
        dense_bytes: the fp32 bytes a dense all-reduce message would carry (``4 * numel``).
        compress_s: seconds spent in ``compress`` (device-synchronised).
        decompress_s: seconds spent in ``decompress`` (device-synchronised).
    """

    step: int
    dense: bool
    skipped: bool
    bad_ranks: list
    numel: int
    words: int
    words_all: int
    bytes_sent: int
    dense_bytes: int
    compress_s: float
    decompress_s: float

    @property
    def ratio(self) -> float:
        """Dense fp32 bytes replaced per byte sent (1.0 for dense steps)."""
        return self.dense_bytes / self.bytes_sent if self.bytes_sent else math.inf


_TOTAL_KEYS = (
    "steps",
    "dense_steps",
    "skips",
    "consecutive_skips",
    "words",
    "words_all",
    "bytes_sent",
    "dense_bytes",
    "compress_s",
    "decompress_s",
)


class GTCState:
    """State of :func:`gtc_hook`: hyper-parameters, per-element residuals and statistics.

    Args:
        process_group: the group to exchange within; ``None`` for the default (world) group.
        named_parameters: ``(name, parameter)`` pairs of the module DDP wraps; only parameters
            with ``requires_grad`` get residuals (they are the ones DDP puts into buckets).
        tau: the threshold; each word moves one element by ``tau / world_size``.
        warmup_steps: optimizer steps of dense all-reduce before compression starts.
        max_consecutive_skips: raise after this many consecutive skipped steps; ``None``: never.
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None,
        named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
        tau: float,
        warmup_steps: int = 0,
        max_consecutive_skips: int | None = 10,
    ) -> None:
        if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not math.isfinite(tau) or tau <= 0:
            raise ValueError(
                f"Expect tau to be a finite number > 0, got {tau!r}: it is the threshold a residual must "
                "pass to emit a word (about 15x the per-worker gradient RMS, e.g. 1e-2)"
            )
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(
                f"Expect warmup_steps to be an int >= 0 (0 = compress from the start), got {warmup_steps!r}"
            )
        if max_consecutive_skips is not None and (
            isinstance(max_consecutive_skips, bool)
            or not isinstance(max_consecutive_skips, int)
            or max_consecutive_skips < 1
        ):
            raise ValueError(
                f"Expect max_consecutive_skips to be an int >= 1 or None (never raise), got {max_consecutive_skips!r}"
            )
        # The hyper-parameters.
        self.process_group = process_group
        self.tau = float(tau)
        self.warmup_steps = warmup_steps
        self.max_consecutive_skips = max_consecutive_skips
        # The internal state.
        self.param_names: list[str] = []
        self.numels: list[int] = []
        self._name_of: dict[int, str] = {}
        self.bind(named_parameters)
        self.residuals: dict[
            str, torch.Tensor
        ] = {}  # name -> [numel] float32 view into a bucket's flat tensor
        self._flats: dict[int, tuple[tuple[str, ...], torch.Tensor]] = {}  # bucket index -> (names, [n] flat)
        self._pending: list[tuple[dist.GradBucket, torch.futures.Future]] = []
        self.step = 0
        # Loss scale of the gradients DDP hands over (AMP's GradScaler; 1.0 without one): the
        # residuals hold unscaled gradients and the decoded estimate is scaled back.
        self.grad_scale = 1.0
        self.last: StepStats | None = None  # the newest exchange, read by the strategy
        self._last_consumed = True
        # The statistics.
        self.totals: dict[str, float] = {key: 0 for key in _TOTAL_KEYS}
        if self.rank == 0:
            log.info(
                "GTC config: tau=%g, warmup_steps=%d, max_consecutive_skips=%s, world_size=%d, "
                "parameters=%d (%d elements)",
                self.tau,
                self.warmup_steps,
                self.max_consecutive_skips,
                self.world_size,
                len(self.param_names),
                sum(self.numels),
            )

    def bind(self, named_parameters: Iterable[tuple[str, torch.nn.Parameter]]) -> None:
        """(Re)build the parameter -> name map, e.g. after unpickling the state."""
        pairs = [(name, p) for name, p in named_parameters if p.requires_grad]
        self.param_names = [name for name, _ in pairs]
        self.numels = [p.numel() for _, p in pairs]
        self._name_of = {id(p): name for name, p in pairs}

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.process_group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.process_group)

    def __getstate__(self) -> dict:
        """Everything but the process group, the pending buckets and the id-based parameter map."""
        log.warning("GTCState: the process group is not picklable and is dropped; call bind() after loading")
        state = dict(self.__dict__)
        for key in ("process_group", "_pending", "_name_of", "_flats"):
            state.pop(key)
        return state

    def __setstate__(self, state: dict) -> None:
        """Restore with the default process group; ``bind(named_parameters)`` must follow."""
        self.__dict__.update(state)
        self.process_group = None
        self._pending = []
        self._name_of = {}
        self._flats = {}
        log.warning("GTCState: process group set to the default group after loading")

    # ---- residuals, per parameter ----------------------------------------------------------

    def bucket_residual(self, bucket: dist.GradBucket) -> torch.Tensor:
        """The ``[bucket numel]`` float32 residual laid out like ``bucket.buffer()``.

        Re-assembled from the per-parameter residuals whenever the bucket's parameters changed
        (DDP's bucket rebuild), so residuals follow their parameters, not bucket indices.
        """
        params = bucket.parameters()
        names = tuple(self._name_of[id(p)] for p in params)
        cached = self._flats.get(bucket.index())
        if cached is not None and cached[0] == names:
            return cached[1]
        device = bucket.buffer().device
        parts = [
            self.residuals[name].to(device)
            if name in self.residuals
            else torch.zeros(p.numel(), device=device)
            for name, p in zip(names, params)
        ]
        flat = torch.cat(parts) if parts else torch.zeros(0, device=device)
        if flat.numel() != bucket.buffer().numel():
            raise RuntimeError(
                f"bucket {bucket.index()} holds {bucket.buffer().numel()} gradient elements but its parameters "
                f"have {flat.numel()}; GTC assumes DDP lays parameters out back to back in a dense bucket"
            )
        offset = 0
        for name, p in zip(names, params):
            self.residuals[name] = flat[offset : offset + p.numel()]
            offset += p.numel()
        self._flats[bucket.index()] = (names, flat)
        return flat

    def residual_vector(self, device: torch.device | None = None) -> torch.Tensor:
        """All residuals, ``[sum(numels)]`` float32 in ``param_names`` order (zeros where none yet)."""
        if device is None:
            device = next(iter(self.residuals.values())).device if self.residuals else torch.device("cpu")
        parts = [
            self.residuals[name].to(device) if name in self.residuals else torch.zeros(n, device=device)
            for name, n in zip(self.param_names, self.numels)
        ]
        return torch.cat(parts) if parts else torch.zeros(0, device=device)

    def load_residual_vector(self, vector: torch.Tensor) -> None:
        """Set all residuals from a ``[sum(numels)]`` vector made by :meth:`residual_vector`."""
        if vector.numel() != sum(self.numels):
            raise ValueError(
                f"residual vector has {vector.numel()} elements, the model has {sum(self.numels)}"
            )
        self._flats = {}
        self.residuals = {}
        for name, part in zip(self.param_names, vector.to(torch.float32).split(self.numels)):
            self.residuals[name] = part.clone()

    def reset_residuals(self) -> None:
        """Forget all residuals (they restart from zero)."""
        self._flats = {}
        self.residuals = {}

    def counters(self) -> dict:
        """Step counter and statistics totals, for checkpoints."""
        return {"step": self.step, "totals": dict(self.totals)}

    def load_counters(self, saved: dict) -> None:
        self.step = int(saved["step"])
        self.totals.update(saved["totals"])

    # ---- the step outcome, consumed once by the strategy -------------------------------------

    def finish_step(
        self, parameters: Iterable[torch.nn.Parameter], poison_skipped: bool = False
    ) -> StepStats | None:
        """Apply the outcome of the newest exchange once, after backward and before the update.

        Skipped steps (a non-finite gradient on some rank; for dense warmup steps, in the averaged
        gradient every rank holds) leave every ``param.grad`` as ``None``, so torch optimizers skip
        the update without touching their state. Counts skips, warns, and raises after too many in
        a row.

        Args:
            parameters: the parameters the optimizer updates.
            poison_skipped: fill the gradients of a skipped step with NaN instead of dropping them,
                so that an AMP GradScaler sees the overflow, skips the step and lowers its scale.

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
        if stats.dense and not stats.skipped:
            grads = [p.grad for p in parameters if p.grad is not None]
            stats.skipped = bool(grads) and not bool(
                torch.stack([torch.isfinite(g).all() for g in grads]).all()
            )
        if stats.skipped:
            for p in parameters:
                if not poison_skipped:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.fill_(math.nan)
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
        else:
            self.totals["consecutive_skips"] = 0
        return stats

    def _record(self, stats: StepStats) -> None:
        self.last = stats
        self._last_consumed = False
        self.totals["steps"] += 1
        self.totals["dense_steps"] += int(stats.dense)
        for key in ("words", "words_all", "bytes_sent", "dense_bytes", "compress_s", "decompress_s"):
            self.totals[key] += getattr(stats, key)

    def stats(self) -> dict:
        """The newest step's statistics and the running totals, as plain numbers."""
        last = None
        if self.last is not None:
            last = asdict(self.last)
            last["ratio"] = self.last.ratio
        total = dict(self.totals)
        total["ratio"] = total["dense_bytes"] / total["bytes_sent"] if total["bytes_sent"] else math.inf
        return {"step": self.step, "last": last, "total": total}


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


def _all_finite(tensor: torch.Tensor) -> bool:
    """Exact, and cheaper than ``isfinite(t).all()``: a NaN or Inf element makes the sum
    non-finite; only a finite sum that overflowed needs the elementwise check."""
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


def _unscaled(grad: torch.Tensor, scale: float) -> torch.Tensor:
    """``[n]`` float32 ``grad / scale`` (a new tensor unless nothing changes)."""
    grad = grad if grad.dtype == torch.float32 else grad.float()
    return grad if scale == 1.0 else grad / scale


def _new_future(device: torch.device) -> torch.futures.Future:
    # A Future holding CUDA tensors must be told its devices, so that it can synchronise streams.
    return torch.futures.Future(devices=[device]) if device.type == "cuda" else torch.futures.Future()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
    # 1. Dense warmup, averaged over ranks as DDP's default hook does.
    if state.step < state.warmup_steps:
        if bucket.is_last():
            state.step += 1
            numel = sum(state.numels)
            dense = numel * _DENSE_BYTES
            state._record(
                StepStats(
                    state.step,
                    True,
                    False,
                    [],
                    numel,
                    numel,
                    numel * state.world_size,
                    dense,
                    dense,
                    0.0,
                    0.0,
                )
            )
        return allreduce_hook(state.process_group, bucket)

    # 2. Stash until the last bucket; a new step starting at bucket 0 drops leftovers of a
    # backward pass that failed half-way.
    if bucket.index() == 0:
        state._pending = []
    future = _new_future(bucket.buffer().device)
    state._pending.append((bucket, future))
    if bucket.is_last():
        pending, state._pending = state._pending, []
        _exchange(state, pending)
    return future


def _exchange(state: GTCState, pending: list[tuple[dist.GradBucket, torch.futures.Future]]) -> None:
    """Steps 3-6 of the algorithm for all buckets of one step; completes every Future."""
    state.step += 1
    group, world, tau = state.process_group, state.world_size, state.tau
    buckets = [bucket for bucket, _ in pending]
    # Forget flat residuals of bucket indices that no longer exist after DDP's rebuild.
    live = {bucket.index() for bucket in buckets}
    state._flats = {index: entry for index, entry in state._flats.items() if index in live}
    buffers = [bucket.buffer() for bucket in buckets]
    device = buffers[0].device
    numel = sum(b.numel() for b in buffers)

    # 3. Compress, unless a local gradient is non-finite; back up residuals for an exact undo.
    finite = all(_all_finite(b) for b in buffers)
    start = time.perf_counter()
    residuals = [state.bucket_residual(bucket) for bucket in buckets]
    backups: list[torch.Tensor] = []
    if finite:
        backups = [r.clone() for r in residuals]
        words = [compress(_unscaled(b, state.grad_scale), r, tau) for b, r in zip(buffers, residuals)]
    else:
        words = [torch.empty(0, dtype=torch.int32, device=device) for _ in buffers]
    _synchronize(device)
    compress_s = time.perf_counter() - start

    # 4. One header exchange: the non-finite flag travels with the word counts.
    header = torch.tensor(
        [0 if finite else 1] + [w.numel() for w in words], dtype=_HEADER_DTYPE, device=device
    )
    headers = torch.empty(world * header.numel(), dtype=_HEADER_DTYPE, device=device)
    all_gather_equal(headers, header, group=group)
    headers = headers.view(world, -1).cpu()
    bytes_sent = header.numel() * header.element_size()
    bad_ranks = [int(r) for r in torch.nonzero(headers[:, 0]).flatten()]
    counts = headers[:, 1:]  # [world, buckets]
    own_words = sum(w.numel() for w in words)
    if bad_ranks:
        for r, backup in zip(residuals, backups):
            r.copy_(backup)
        for buffer, (_, future) in zip(buffers, pending):
            future.set_result(buffer.zero_())
        state._record(
            StepStats(
                state.step,
                False,
                True,
                bad_ranks,
                numel,
                0,
                0,
                bytes_sent,
                numel * _DENSE_BYTES,
                compress_s,
                0.0,
            )
        )
        return

    # 5. One word exchange, every message padded to the longest.
    width = int(counts.sum(dim=1).max())
    gathered = torch.empty((world, width), dtype=torch.int32, device=device)
    if width:
        message = torch.zeros(width, dtype=torch.int32, device=device)
        torch.cat(words, out=message[:own_words])
        all_gather_equal(gathered.view(-1), message, group=group)
        bytes_sent += width * _WORD_BYTES

    # 6. Decode every bucket from all ranks' words into the bucket buffer.
    start = time.perf_counter()
    starts = torch.cumsum(counts, dim=1) - counts  # [world, buckets] offset of each bucket's words
    for b, (buffer, (_, future)) in enumerate(zip(buffers, pending)):
        pieces = [gathered[r, int(starts[r, b]) : int(starts[r, b] + counts[r, b])] for r in range(world)]
        all_words = torch.cat(pieces) if width else gathered.view(-1)
        decoded = decompress(all_words, buffer.numel(), tau, divisor=world)
        buffer.copy_(decoded if state.grad_scale == 1.0 else decoded.mul_(state.grad_scale))
        future.set_result(buffer)
    _synchronize(device)
    decompress_s = time.perf_counter() - start
    state._record(
        StepStats(
            state.step,
            False,
            False,
            [],
            numel,
            own_words,
            int(counts.sum()),
            bytes_sent,
            numel * _DENSE_BYTES,
            compress_s,
            decompress_s,
        )
    )
