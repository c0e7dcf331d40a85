"""Dense baselines to compare GTC with: DDP with a bf16 all-reduce, and DDP that sends nothing.

A compressed exchange has to beat a well-tuned 16-bit all-reduce, not only fp32 (Agarwal et al.,
MLSys 2022), so ``"ddp_bf16"`` is registered beside ``"gtc"``. torch's own
``bf16_compress_hook`` refuses gloo ("requires CUDA 11+ and NCCL 2.10+"); the same arithmetic in
:func:`bf16_allreduce_hook` runs on gloo and NCCL. Lightning registers DDP hooks only on CUDA, so
:class:`HookedDDPStrategy` registers its hook on every device.

:class:`NoCommStrategy` averages nothing: each rank trains on its own data and the replicas drift
apart. It is a measuring stick only, the step time of a step that communicates nothing, and is
not registered by name.

:class:`PowerSGDStrategy` (``"ddp_powersgd"``) is what a Lightning user can pick today as a
compressed exchange: torch's own ``powerSGD_hook`` (Vogels et al., 2019; rank-r low-rank
compression with error feedback), unchanged, registered on every device. Its all-reduces are plain
``dist.all_reduce`` futures, issued inside ``then`` callbacks; on gloo those run on gloo's threads,
so with several buckets the strategy runs the buckets one after another
(:func:`~gtc_lightning.algorithms.hooks.one_bucket_at_a_time`): otherwise the ranks issue their
collectives in different orders and gloo aborts or hangs.
"""

from typing import Any

import torch.distributed as dist
from lightning.fabric.strategies import _StrategyRegistry
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from gtc_lightning.algorithms.hooks import bf16_allreduce_hook, no_comm_hook, one_bucket_at_a_time


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


class PowerSGDStrategy(HookedDDPStrategy):
    """DDP with torch's PowerSGD communication hook, on CPU/gloo as on CUDA/NCCL (``"ddp_powersgd"``).

    Each bucket's matrices are all-reduced as rank-r factors ``P [n, r]`` and ``Q [m, r]``; vectors
    and matrices too small to gain ``min_compression_rate`` go uncompressed. The arguments are
    :class:`~torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.PowerSGDState`'s, with its
    defaults. A fresh state is made each time DDP is configured; it is not checkpointed (torch's
    own example saves rank 0's state only), so a resume starts its error feedback from zero.

    Args:
        matrix_approximation_rank: r, the rank of the factors.
        start_powerSGD_iter: optimizer steps of plain fp32 all-reduce before compression starts.
            Must be at least 2 with error feedback or warm start: DDP rebuilds its buckets after
            the first step, and the state keys its buffers by bucket index.
        min_compression_rate: compress a ``[n, m]`` matrix only if ``n*m > rate * (n+m)*r``.
        use_error_feedback: keep each rank's compression error and add it to the next gradient.
        warm_start: start each step's power iteration from the previous step's ``Q``.
        orthogonalization_epsilon: added in Gram-Schmidt to avoid dividing by zero.
        random_seed: seed of the random initial ``Q``, the same on every rank.
        **kwargs: for ``DDPStrategy`` (``start_method``, ``timeout``, ``bucket_cap_mb``, ...).
    """

    def __init__(
        self,
        matrix_approximation_rank: int = 1,
        start_powerSGD_iter: int = 1_000,
        min_compression_rate: float = 2,
        use_error_feedback: bool = True,
        warm_start: bool = True,
        orthogonalization_epsilon: float = 0,
        random_seed: int = 0,
        **kwargs: Any,
    ) -> None:
        if not isinstance(matrix_approximation_rank, int) or matrix_approximation_rank < 1:
            raise ValueError(f"Expect matrix_approximation_rank >= 1, got {matrix_approximation_rank!r}")
        if (use_error_feedback or warm_start) and start_powerSGD_iter < 2:
            raise ValueError(
                f"Expect start_powerSGD_iter >= 2 with error feedback or warm start, got {start_powerSGD_iter}, "
                "because DDP rebuilds its buckets after the first step and PowerSGD keys its buffers by bucket"
            )
        super().__init__(**kwargs)
        self._powersgd_kwargs = {
            "matrix_approximation_rank": matrix_approximation_rank,
            "start_powerSGD_iter": start_powerSGD_iter,
            "min_compression_rate": min_compression_rate,
            "use_error_feedback": use_error_feedback,
            "warm_start": warm_start,
            "orthogonalization_epsilon": orthogonalization_epsilon,
            "random_seed": random_seed,
        }
        self._powersgd_state: PowerSGDState | None = None

    @property
    def powersgd_state(self) -> PowerSGDState | None:
        """The hook's state (error feedback, P and Q per bucket); ``None`` before ``fit`` configured DDP."""
        return self._powersgd_state

    @override
    def _register_ddp_hooks(self) -> None:
        assert isinstance(self.model, DistributedDataParallel)
        group = self._ddp_kwargs.get("process_group")
        self._powersgd_state = PowerSGDState(process_group=group, **self._powersgd_kwargs)
        # NCCL runs the hook's callbacks in the backward's thread, in bucket order; gloo does not
        # (see one_bucket_at_a_time).
        on_nccl = dist.get_backend(group) == "nccl"
        hook = powerSGD_hook if on_nccl else one_bucket_at_a_time(powerSGD_hook)
        self.model.register_comm_hook(self._powersgd_state, hook)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        for name, start_method in (
            ("ddp_powersgd", "popen"), ("ddp_powersgd_spawn", "spawn"), ("ddp_powersgd_fork", "fork")
        ):
            strategy_registry.register(
                name, cls, description=f"DDP with torch's PowerSGD hook (rank 1), start_method '{start_method}'",
                start_method=start_method,
            )  # fmt: skip
