"""The dense baselines' DDP communication hooks, torch only: a bf16 all-reduce that runs on gloo too
(torch's ``bf16_compress_hook`` refuses gloo: "requires CUDA 11+ and NCCL 2.10+"), and a hook that
sends nothing (local steps; the step time of a step that communicates nothing). The strategies that
register them on every device are in :mod:`gtc_lightning.strategies.baselines`."""

from typing import Any

import torch
import torch.distributed as dist


def bf16_allreduce_hook(
    process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP hook: the bucket as bf16, divided by the world size, all-reduced, copied back.

    Sends ``2 (W-1)/W * 2`` bytes per element per rank in a ring, half of fp32's.
    """
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(dist.get_world_size(group))
    future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(fut.value()[0])
        return buffer

    return future.then(decompress)


def no_comm_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP hook that communicates nothing: each rank keeps its own gradient."""
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future
