"""What the algorithms share: the byte count of a ring all-reduce (every statistic compares with
it), the equal-size all-gather under its name in both torch versions we run, the exact finiteness
test, the replica checksum, and the integer check whose message gives the reason. Torch only."""

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

# ``all_gather_into_tensor`` is deprecated from torch 2.13 on in favour of ``all_gather_single``
# (same arguments); the GPU machines run torch 2.11, which only has the former.
all_gather_equal = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


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
