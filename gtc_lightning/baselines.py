"""Dense baselines to compare GTC with: DDP with a bf16 all-reduce, and DDP that sends nothing.

A compressed exchange has to beat a well-tuned 16-bit all-reduce, not only fp32 (Agarwal et al.,
MLSys 2022), so ``"ddp_bf16"`` is registered beside ``"gtc"``. torch's own
``bf16_compress_hook`` refuses gloo ("requires CUDA 11+ and NCCL 2.10+"); the same arithmetic in
:func:`bf16_allreduce_hook` runs on gloo and NCCL. Lightning registers DDP hooks only on CUDA, so
:class:`HookedDDPStrategy` registers its hook on every device.

:class:`NoCommStrategy` averages nothing: each rank trains on its own data and the replicas drift
apart. It is a measuring stick only, the step time of a step that communicates nothing, and is
not registered by name.
"""


from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.strategies import _StrategyRegistry
from lightning.pytorch.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override


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


class HookedDDPStrategy(DDPStrategy):
    """DDP with a fixed communication hook, registered on CPU/gloo as on CUDA/NCCL."""

    hook: Any = None

    @override
    def _register_ddp_hooks(self) -> None:
        assert isinstance(self.model, DistributedDataParallel)
        self.model.register_comm_hook(self._ddp_kwargs.get("process_group"), type(self).hook)


class BF16AllReduceStrategy(HookedDDPStrategy):
    """DDP whose gradient all-reduce runs in bf16: the stronger dense baseline (``"ddp_bf16"``)."""

    hook = staticmethod(bf16_allreduce_hook)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        for name, start_method in (("ddp_bf16", "popen"), ("ddp_bf16_spawn", "spawn"), ("ddp_bf16_fork", "fork")):
            strategy_registry.register(
                name, cls, description=f"DDP with a bf16 all-reduce, start_method '{start_method}'",
                start_method=start_method,
            )  # fmt: skip


class NoCommStrategy(HookedDDPStrategy):
    """DDP that sends no gradient at all (replicas drift apart): the compute-only reference."""

    hook = staticmethod(no_comm_hook)
