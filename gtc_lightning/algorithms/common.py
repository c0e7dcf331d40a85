"""What the algorithms share: the byte count of a ring all-reduce (every statistic compares with
it), the equal-size all-gather under its name in both torch versions we run, the busy wait on a
collective, the exact finiteness test, the replica checksum, and the integer check whose message
gives the reason. Torch only."""

import os
import time
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

# ``all_gather_into_tensor`` is deprecated from torch 2.13 on in favour of ``all_gather_single``
# (same arguments); the GPU machines run torch 2.11, which only has the former.
all_gather_equal = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


SPIN_SECONDS = 0.05  # the longest a busy wait polls before it blocks as a plain wait does
_yield_core = getattr(os, "sched_yield", None) or (lambda: time.sleep(0))  # (no sched_yield on Windows)


def busy_wait_fits(group: dist.ProcessGroup | None = None) -> bool:
    """Whether waiting on ``group``'s collectives should poll (``busy_wait=None``): on gloo, when this
    machine has a core for every rank on it (``LOCAL_WORLD_SIZE``, else the group's size).

    A blocked rank's thread sleeps while gloo's threads pass the messages; on the 2-core CPU
    machines of this project two processes that each computed the recipe model's forward and
    backward (15.0-15.3 ms a step alone) and then all-reduced 2 floats took 17.5-19.0 ms a step
    blocking, 16.2-16.3 ms polling. Polling keeps the waiting core busy, so the hand-offs do not
    wait for it to wake. Where ranks outnumber the cores a poll would take a core from a rank still
    computing: no polling there, nor on NCCL (its waits are on the GPU stream). Without
    ``LOCAL_WORLD_SIZE`` (set by torchrun) every rank of the group is counted as on this machine,
    so a multi-node job launched otherwise polls only when the whole group fits: pass
    ``busy_wait=True`` there."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_backend(group) != "gloo":
        return False
    local = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size(group)))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return local <= cores


def finish(work: Any, busy: bool) -> None:
    """Wait for a collective's handle (``async_op=True``); ``busy``: poll it, yielding the core to
    any other runnable thread between polls, for up to :data:`SPIN_SECONDS`, then block. A failed
    collective raises from ``work.wait()`` as it would from the blocking call."""
    if work is None:
        return
    if busy:
        end = time.perf_counter() + SPIN_SECONDS
        while not work.is_completed() and time.perf_counter() < end:
            _yield_core()
    work.wait()


def allreduce_bytes(numel: int, world_size: int, element_bytes: int = 4) -> int:
    """Bytes one rank sends (and receives) in a ring all-reduce of ``numel`` elements:
    ``2 (W-1)/W * element_bytes * numel`` (fp32: 4 bytes, bf16: 2)."""
    return 2 * (world_size - 1) * element_bytes * numel // world_size if world_size > 1 else 0


def check_int(name: str, value: Any, low: int, meaning: str) -> None:
    """Raise ``ValueError`` unless ``value`` is an int (not a bool) ``>= low``; ``meaning`` says what it is."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"Expect {name} to be an int >= {low} ({meaning}), got {value!r}")


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
