"""What one step of GTC did (:class:`StepStats`), the running totals' keys, and the clock that times
the steps without a host synchronisation of its own."""

import math
import time
from dataclasses import asdict, dataclass

import torch

from gtc_lightning.algorithms.common import allreduce_bytes


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


TOTAL_KEYS = (  # GTCState.totals: running sums over the steps
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


class Clock:
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
