"""The dense baselines' DDP communication hooks, torch only: a bf16 all-reduce that runs on gloo too
(torch's ``bf16_compress_hook`` refuses gloo: "requires CUDA 11+ and NCCL 2.10+"), a hook that
sends nothing (local steps; the step time of a step that communicates nothing), and
:func:`one_bucket_at_a_time`, which makes a hook that issues collectives from its future's callbacks
(torch's PowerSGD) safe on gloo with several buckets. The strategies that register them on every
device are in :mod:`gtc_lightning.strategies.baselines`."""

import functools
from collections.abc import Callable
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


def one_bucket_at_a_time(hook: Callable) -> Callable:
    """``hook`` with each bucket started only once the previous bucket's future has completed.

    torch's ``powerSGD_hook`` all-reduces its ``P`` and ``Q`` factors inside ``then`` callbacks. On
    NCCL a collective's future completes when it is enqueued, so the callbacks run in the backward's
    thread, in bucket order. On gloo they run on the thread that completed the previous all-reduce,
    while the backward goes on to issue the next bucket's first all-reduce from its own thread: with
    two buckets or more the ranks issue their collectives in different orders and gloo aborts
    ("Received data size doesn't match expected size") or hangs. Waiting for the previous bucket
    (its whole chain of callbacks) before starting the next keeps one order on every rank; the
    backward still overlaps the last bucket's exchange. The wrapper keeps ``hook``'s name (DDP's
    logging data reports it as the registered hook).
    """
    previous: list[torch.futures.Future] = []

    @functools.wraps(hook)
    def hook_in_order(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        if previous:
            previous.pop().wait()
        future = hook(state, bucket)
        previous.append(future)
        return future

    return hook_in_order
