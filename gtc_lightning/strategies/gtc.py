"""``GTCStrategy``: Lightning's DDP with its gradient all-reduce replaced by threshold compression.
Long file: the strategy's options with their documentation, and the Lightning calls it overrides.

The strategy only wires things together: it builds the :class:`~gtc_lightning.algorithms.gtc.state.GTCState`,
registers :func:`~gtc_lightning.algorithms.gtc.hook.gtc_hook` on the DDP model (on CPU/gloo as on CUDA/NCCL),
hands it the Trainer's gradient clipping and AMP's loss scale, applies each step's skip decision
before the optimizer runs, checks that the replicas agree, saves and restores every rank's
residuals in checkpoints (one shard per rank), and logs statistics.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from gtc_lightning.algorithms.common import all_gather_equal, check_int, parameter_checksums
from gtc_lightning.algorithms.gtc import update as update_mode
from gtc_lightning.algorithms.gtc.config import (
    DEFAULT_DENSITY,
    check_local_clip_scale,
    check_options,
    local_clip_threshold,
    resolve_compress,
    resolve_density_warmup,
    resolve_mean_variance,
    resolve_word_levels,
    sparse_gradient_parameters,
    unused_update_options,
)
from gtc_lightning.algorithms.gtc.hook import gtc_hook
from gtc_lightning.algorithms.gtc.state import GTCState
from gtc_lightning.strategies import checkpoint as gtc_checkpoint
from gtc_lightning.strategies.checkpoint import CHECKPOINT_KEY
from gtc_lightning.strategies.common import (
    add_callback,
    drop_hook_args,
    gradient_closure_once,
    hint_unused_parameters,
    refuse_optimizers,
    register_names,
)
from gtc_lightning.strategies.loggers import GTCStatsLogger

log = logging.getLogger(__name__)

BUCKET_CAP_MB = 1024  # GTCStrategy's default DDP bucket cap: one bucket for models up to 256 M weights


def exchanges_in_run(trainer: Any, optimizers: int) -> float:
    """The update mode's exchanges in a fit: the Trainer's ``estimated_stepping_batches``, times the number of
    optimizers when there are several (manual optimization: each one's step is an exchange, presumed every
    batch), at most ``max_steps`` (Lightning's global step counts every optimizer's steps)."""
    total = trainer.estimated_stepping_batches * optimizers
    return min(total, trainer.max_steps) if trainer.max_steps > 0 else total


class GTCStrategy(DDPStrategy):
    """DDP with Strom's gradient threshold compression (GTC) instead of dense all-reduce.

    With no arguments (``strategy="gtc"``) nothing presumes a gradient scale or an optimizer:
    ``compress="auto"`` compresses what each rank's optimizer applies (:mod:`gtc_lightning.algorithms.gtc.update`),
    ``tau="auto"`` picks each step's threshold so that every rank sends about ``1e-2`` of the
    parameters as words (:data:`~gtc_lightning.algorithms.gtc.config.DEFAULT_DENSITY`), and ``coding="rice"`` sends
    those words Golomb-Rice coded (8-11 bits a word instead of 32). A fp32 ring all-reduce sends
    ``64 / (W * density * bits a word)`` times the bytes: 140-170x at 4 ranks in the model suite
    (``python -m gtc_lightning.tools.model_suite``). GTC's own memory: 8 bytes a parameter.

    Args:
        tau: the threshold. Each rank adds to a per-element residual (the gradient, or with
            ``compress="update"`` its optimizer's step over the learning rate) and sends one int32
            word for every element whose residual passed ``±tau``, each moving that element by
            ``tau / world_size``. ``"auto"`` (default): from the ``target_density``. A number: a fixed
            tau, in the residual's units (Strom's gradient mode: about 15x the per-rank gradient RMS,
            ≈ 1e-2 for the recipe's mean-loss gradients of ~256 frames per rank).
        warmup_steps: optimizer steps of dense all-reduce before compression starts.
        check_replicas_every: every this many optimizer steps, compare a parameter checksum
            across ranks and raise ``RuntimeError`` if the replicas differ; 0 turns it off.
        max_consecutive_skips: raise ``RuntimeError`` after this many consecutive steps skipped
            for a non-finite gradient; ``None`` never raises. (With an AMP loss scaler its
            overflows are the scaler's business and never count.)
        dense_fallback: in the gradient mode, on a step where the sparse exchange would send more
            bytes than a dense bf16 ring all-reduce, half of fp32's (tau too small, a dense outlier
            gradient, many ranks), all-reduce every rank's residual + gradient instead and restart
            the residuals from zero; back to sparse once it would send less than a quarter of fp32's
            (:data:`~gtc_lightning.algorithms.gtc.config.FALLBACK_ENTER`, ``FALLBACK_EXIT``). Counted
            as ``dense_steps``, warned about once. The update mode sends what it emits and warns once
            where that is more than the fallback's threshold.
        exchange: ``"alltoall"`` (each rank's words as they are), ``"allgather"`` (padded to the
            longest message) or ``"auto"`` (all-to-all on gloo, where it was measured faster;
            all-gather on NCCL). The step's header (word counts) goes the same way: by all-to-all
            one message latency, by gloo's ring all-gather world size - 1 in a row.
        backend: the compression kernels: ``"auto"`` (Triton on CUDA, torch on CPU), ``"torch"``,
            or ``"triton"`` (on CPU only under ``TRITON_INTERPRET=1``, for tests).
        target_density: the words each rank sends per element and step (density), for automatic
            tau; None with ``tau="auto"``: 1e-2. With ``compress="update"`` each rank's threshold is
            just below the ``1 - target_density`` quantile of its residual, every step, estimated from
            a stratified random sample (the density is met within the sample's error; more where many
            elements tie at the quantile, all of which are sent); with ``"gradient"`` one tau for all ranks moves after every step towards it
            (:mod:`gtc_lightning.algorithms.gtc.auto_tau`), starting where the first step's gradients put it, or at
            a given numeric ``tau``. Lower density, more compression, slower progress per step.
        compress: what the residuals hold. ``"update"``: each rank's optimizer steps on its own
            gradient (its momentum and Adam moments are its own, checkpointed per rank) and GTC
            compresses the step it made, so what is conserved is what the optimizer applies: for
            momentum SGD (DGC's momentum correction) and the Adam family; 8 bytes a parameter.
            ``"gradient"``: Strom's original, the gradients in DDP's hook during backward, the
            optimizer sees the decoded average gradient: right for plain SGD, wrong for Adam (it
            rescales each sparse vote); 16 bytes a parameter. ``"auto"`` (default): ``"update"``,
            ``"gradient"`` with ``stale=True`` or a Muon optimizer (measured: Muon's orthogonalised
            steps lost in the update mode, on the two-optimizer example). With several optimizers
            (manual optimization) the update mode compresses and exchanges each one's step after it,
            over the parameters it moved (each exchange is an optimizer step of ``gtc_stats``;
            ``word_levels`` and ``mean_variance`` "auto" are on only where every optimizer is one
            they are for).
        conserve: the update mode's residual (experimental, measured on the long model suite):
            ``"direction"`` (default) keeps the optimizer's step over its learning rate, applied at
            the rate of the step that sends it; ``"displacement"`` keeps the step itself.
        density_warmup_steps: the update mode's density starts at 0.25 and falls geometrically to
            ``target_density`` over this many optimizer steps (DGC's warm-up; 0: none). ``"auto"``
            (default): 5 % of the Trainer's ``estimated_stepping_batches`` (none when that is unknown).
            On the long model suite it kept every small model's held-out loss within 0.4 % above DDP's
            (mean of 3 seeds), where without it one seed of the speech DNN lost 10.9 %; it costs the
            warm-up's bytes. Set 0 for the former default.
        momentum_masking: the update mode zeros each rank's momentum (SGD's momentum buffer, Adam's
            first moment) at the elements it sent, after every step (DGC's momentum factor masking).
        mean_variance: with ``torch.optim.Adam`` / ``AdamW``, the update mode's step divides each rank's
            first moment by an estimate of the second moment of the mean gradient over the ranks (from
            the rank's own two moments) instead of the rank's own, which holds ``W`` times the noise of
            the mean's. Off by default: on the long model suite it brought the 2.4 M-weight LM from +1.0 %
            to +0.5 % of DDP's loss but cost the small Adam models (the GRU +0.7 % against +0.4 %).
            ``"auto"``: on for Adam and AdamW without ``amsgrad``, off (silently) for every other
            optimizer; ``True`` warns where it cannot apply.
        word_levels: the update mode's words carry ``tau``, ``2 tau``, ... up to ``2**(word_levels - 1) tau``:
            each the largest its element holds, so what sits far above the threshold drains in a few steps
            instead of one ``tau`` a step (what is left keeps its sign). The words stay 32 bits (Rice-coded:
            one message per level); each rank's header grows by 8 bytes a level. ``1``: Strom's words of
            ``tau``. ``"auto"`` (default): 4 for plain SGD (``torch.optim.SGD`` without momentum), 1 for every
            other optimizer; on the long model suite 4 levels brought the plain-SGD speech DNN from +0.35 % to
            -0.75 % of DDP's held-out loss (better on each of 3 seeds), changed nothing under Adam (no word
            went above ``tau``) and stayed within the seeds' spread on momentum SGD.
        local_clip_scale: with the Trainer's ``gradient_clip_val`` c, each rank's own gradient is clipped at
            ``local_clip_scale`` times c on compressed steps. ``"sqrt_world"`` (default): sqrt(N) c on N ranks,
            DGC's rule (its N^-1/2 of the global threshold, in the units of a rank's mean gradient, which
            is what a rank clips). ``1``: at c itself.
        busy_wait: how a rank waits for GTC's collectives each step (the header and word exchanges,
            the update mode's finite-gradient flag). ``None`` (default): on gloo it polls them,
            yielding its core between polls, when the machine has a core for each of its ranks;
            otherwise, and on NCCL, it blocks. ``True`` / ``False``: always poll / always block. On the
            project's 2-core CPU machines a blocked rank's wake-ups cost about 4 ms a step of the
            recipe's model; polling made its 2-rank ``gtc`` run 11-16 % faster, with the same results.
        coding: ``"rice"`` (default) sends each message Golomb-Rice coded (the gaps between its
            sorted indices and the signs: 8-11 bits a word at the densities GTC runs at, instead
            of 32), lossless, at the cost of encoding and decoding on every step (on an H100 about
            1.3 ms a message: on fast links ``"none"``, 32-bit words, is quicker).
        restore_residuals: restore the residuals of a resumed checkpoint (every rank reads its own
            shard; the shards of a linked ``last.ckpt``, ``ModelCheckpoint(save_last="link")``, are
            found beside the link's target). ``False`` restarts them from zero: the pending update,
            with ``stale=True`` the update in flight too, is lost. Either way, with ``compress="update"``
            every rank's own optimizer state comes back from its shard where the shard is there (at
            another world size every rank takes the checkpoint's, rank 0's).
        stale: one-step-stale GTC (also registered as ``"gtc_stale"``): each step's word exchange
            runs while the next step computes and its update is applied one step late; the replicas
            stay bit-identical. The first compressed step applies nothing, and the last step's
            update is not applied at the end of fit (it is kept for a resume). See
            :mod:`gtc_lightning.algorithms.gtc.stale` for skips, checkpoints and the rest. Takes ``coding="rice"``
            (the coded bytes travel, decoded when applied) and automatic tau (each update is scaled
            with the tau of the step that sent it). Refused with several optimizers.
        accelerator: as for ``DDPStrategy``, and so are ``parallel_devices``, ``cluster_environment``,
            ``checkpoint_io``, ``precision_plugin``, ``process_group_backend``, ``timeout``, ``start_method``.
        **kwargs: passed to ``DistributedDataParallel`` (e.g. ``bucket_cap_mb``: GTC's default is
            :data:`BUCKET_CAP_MB`, 1 GB, so that a model's gradients reach the hook in one bucket
            and the hook's fixed host work per bucket is paid once a step, where DDP's 25 MB
            split Strom's DNN into three: on an H100 that cut 0.3-1.3 ms from a 6-7 ms step, on
            CPU it changed nothing (docs/experiments/gpu_h100.md);
            ``find_unused_parameters``, ``static_graph``, ``process_group``: the exchange runs in
            that group). DDP's own communication-hook arguments may only be ``None``.

    Gradient clipping: with the Trainer's ``gradient_clip_val`` c set, each rank's *local* gradient
    is clipped before it enters the residual (the update mode: before its optimizer steps on it), by
    norm over the whole model (as ``clip_grad_norm_``) or by value, at ``local_clip_scale`` times c:
    sqrt(N) c by default. DDP clips the averaged gradient, which is shorter than each rank's where
    the ranks' gradients disagree (about half as long on 4 ranks on the model suite's CNN); clipped at
    c itself, every local step of that CNN was clipped, and it lost 5.6 % of held-out loss against DDP
    clipped at c (at sqrt(N) c: -0.3 %, 3 seeds). Since the residuals apply what went into them, a
    spike still never reaches the model beyond sqrt(N) c per rank. The decoded update is not clipped a
    second time: in the gradient mode ``LightningModule.configure_gradient_clipping`` (and an override
    of it) runs on dense warmup steps only, where it clips the average at c, as under DDP.

    Continuing training with a second ``trainer.fit`` on the same Trainer carries every rank's
    state over: residuals, step counter, automatic tau, the dense-fallback mode and an update in
    flight, bit for bit as one uninterrupted fit (Lightning allows a second fit with the popen
    launcher and externally launched processes, e.g. torchrun or SLURM, not with fork/spawn).

    Like DDP, GTC exchanges the gradients of the parameters that were trainable when fit started:
    a parameter unfrozen during fit (e.g. by ``BaseFinetuning``) is refused with an error at its
    first gradient; unfreeze between two fits instead.
    """

    def __init__(
        self,
        tau: float | Literal["auto"] = "auto",
        warmup_steps: int = 0,
        check_replicas_every: int = 0,
        max_consecutive_skips: int | None = 10,
        dense_fallback: bool = True,
        exchange: Literal["auto", "alltoall", "allgather"] = "auto",
        backend: Literal["auto", "torch", "triton"] = "auto",
        restore_residuals: bool = True,
        stale: bool = False,
        coding: Literal["none", "rice"] = "rice",
        target_density: float | None = None,
        compress: Literal["auto", "gradient", "update"] = "auto",
        busy_wait: bool | None = None,
        conserve: Literal["direction", "displacement"] = "direction",
        density_warmup_steps: int | Literal["auto"] = "auto",
        momentum_masking: bool = False,
        mean_variance: bool | Literal["auto"] = False,
        word_levels: int | Literal["auto"] = "auto",
        local_clip_scale: float | Literal["sqrt_world"] = "sqrt_world",
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **kwargs: Any,
    ) -> None:
        check_options(tau, warmup_steps, max_consecutive_skips, exchange, backend, coding, target_density, compress,
                      busy_wait, conserve, density_warmup_steps, momentum_masking, mean_variance, word_levels)
        self._word_levels = word_levels
        check_local_clip_scale(local_clip_scale)
        self._local_clip_scale = local_clip_scale
        self._conserve, self._density_warmup_steps = conserve, density_warmup_steps
        self._momentum_masking, self._mean_variance = momentum_masking, mean_variance
        if not isinstance(stale, bool):
            raise ValueError(f"Expect stale to be True or False, got {stale!r}")  # noqa: TRY004
        check_int(
            "check_replicas_every", check_replicas_every, 0, "steps between replica checks; 0 turns it off"
        )
        drop_hook_args(kwargs, "GTCStrategy")
        if kwargs.get("bucket_cap_mb") is None:
            kwargs["bucket_cap_mb"] = BUCKET_CAP_MB
        if start_method not in ("popen", "spawn", "fork", "forkserver"):
            raise ValueError(f"Expect start_method in popen/spawn/fork/forkserver, got {start_method!r}")
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            **kwargs,
        )
        self._tau = tau if tau == "auto" else float(tau)
        self._warmup_steps = warmup_steps
        self._check_replicas_every = check_replicas_every
        self._max_consecutive_skips = max_consecutive_skips
        self._dense_fallback = bool(dense_fallback)
        self._exchange = exchange
        self._backend = backend
        self._restore_residuals = bool(restore_residuals)
        self._stale = stale
        self._coding = coding
        self._target_density = target_density
        self._compress = compress
        self._busy_wait = busy_wait
        if stale and compress == "update":
            raise ValueError(
                "GTCStrategy(stale=True) delays the decoded gradient by a step; it takes compress='gradient' (or "
                "'auto', which picks it), not compress='update'"
            )
        self._gtc_state: GTCState | None = None
        self._update_params: list[torch.nn.Parameter] = []  # compress="update": the state's, in its order
        self._rank_optimizers: list[dict] | None = None  # this rank's optimizer states from its shard
        self._saved_gtc: tuple[dict, _PATH] | None = None  # checkpoint entry waiting for the state
        self._checked_step = 0
        self._clip: tuple[str, float] | None = None  # the Trainer's clipping, applied per rank
        self._dense_step = False  # whether the step in progress handed the optimizer a dense average
        self._local_step = False  # compress="update": whether the step in progress clips each rank's own gradient

    @property
    def tau(self) -> float | str:
        """The compression threshold: the current one once training runs (it moves with a
        ``target_density``), else the configured one."""
        return self._gtc_state.tau if self._gtc_state is not None else self._tau

    @property
    def target_density(self) -> float | None:
        """The words per rank and element automatic tau aims at (None with a fixed tau)."""
        if self._gtc_state is not None:
            return self._gtc_state.target_density
        return self._target_density if self._target_density is not None or self._tau != "auto" else DEFAULT_DENSITY

    @property
    def coding(self) -> str:
        """How messages are sent: ``"rice"`` (Golomb-Rice coded) or ``"none"`` (32-bit words)."""
        return self._coding

    @property
    def stale(self) -> bool:
        """Whether each step's update is applied one step late (the exchange overlaps the next step)."""
        return self._stale

    @property
    def gtc_state(self) -> GTCState | None:
        """The hook's state (residuals, counters); ``None`` before ``fit`` configured DDP."""
        return self._gtc_state

    @property
    def gtc_stats(self) -> dict:
        """This rank's statistics: ``{"step", "last": {...} or None, "total": {...}}``.

        ``last`` holds the newest step's mode, words, words_all, bytes_sent, bytes_received, the
        dense ring all-reduce's bytes in fp32 and bf16 and the ratios to them, density,
        compress_s, exchange_s, decompress_s; ``total`` the sums since the start (restored from
        checkpoints) with ``sparse_steps``, ``dense_steps``, ``skips``, ``overflows``.
        """
        if self._gtc_state is None:
            return {"step": 0, "last": None, "total": None}
        return self._gtc_state.stats()

    @property
    def _process_group(self) -> dist.ProcessGroup | None:
        return self._ddp_kwargs.get("process_group")

    # ---- wiring into DDP ---------------------------------------------------------------------

    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.model is not None
        if trainer.state.fn == TrainerFn.FITTING:
            sparse = sparse_gradient_parameters(self.model)
            if sparse:
                raise ValueError(
                    f"GTCStrategy compresses dense gradients, but {sparse} get sparse gradients "
                    "(nn.Embedding/EmbeddingBag with sparse=True). Use sparse=False (GTC then compresses "
                    "their dense gradients), or freeze them (requires_grad=False), or train with strategy='ddp'"
                )
            self._clip = None
            clip_val = trainer.gradient_clip_val
            if clip_val is not None and clip_val > 0:
                algorithm = getattr(trainer.gradient_clip_algorithm, "value", trainer.gradient_clip_algorithm)
                self._clip = (str(algorithm or "norm"), float(clip_val))
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            self._resolve_compress()
            refuse_optimizers("GTCStrategy", self.optimizers, update=self._gtc_state.compress == "update")
            if self._gtc_state.compress == "gradient":
                self._gate_clipping()
            else:
                self._scale_local_clipping()
            if self._clip is not None and self.global_rank == 0:
                local = local_clip_threshold(self._clip, self._local_clip_scale, self._gtc_state.world_size)
                log.info(
                    "GTC: gradient clipping by %s at %g: each rank's own gradient is clipped at %g before compression "
                    "(local_clip_scale=%r; dense warm-up steps clip the averaged gradient at %g, as DDP)",
                    self._clip[0], self._clip[1], local[1], self._local_clip_scale, self._clip[1],
                )  # fmt: skip
        if self._stale and trainer.state.fn == TrainerFn.FITTING and len(self.optimizers) > 1:
            raise ValueError(
                f"GTCStrategy(stale=True) applies each exchange's update at the next backward pass, which with "
                f"{len(self.optimizers)} optimizers may belong to another optimizer than the one whose parameters "
                "it moves; use one optimizer, or stale=False"
            )
        add_callback(trainer, GTCStatsLogger(self))  # before the checkpoint callbacks: they may monitor it

    @property
    def compress(self) -> str:
        """What GTC compresses: ``"gradient"`` or ``"update"`` once fit chose (``"auto"``), else as configured."""
        return self._gtc_state.compress if self._gtc_state is not None else self._compress

    def _resolve_compress(self) -> None:
        """``compress="auto"``: the optimizer's step (whatever the optimizer: for plain SGD it is the
        gradient times the rate, for momentum SGD and Adam what they apply), with 8 bytes a parameter
        of GTC's own; Strom's gradient with ``stale=True`` or Muon
        (:func:`~gtc_lightning.algorithms.gtc.config.resolve_compress`). With several optimizers (manual
        optimization) each one's step is compressed and exchanged after it, over the parameters it moved."""
        state = self._gtc_state
        assert state is not None and self.lightning_module is not None
        mode, why = resolve_compress(self._compress, self.optimizers, self._stale)
        state.compress = mode
        self._update_params = [p for _, p in self.lightning_module.named_parameters() if p.requires_grad]
        if unused := unused_update_options(state):
            rank_zero_warn(unused)
        if mode == "update" and len(self.optimizers) > 1:
            self._resolve_auto_options_over_optimizers()
        if self.global_rank == 0:
            log.info("GTC compresses %s (%s): %s", "each rank's optimizer step" if mode == "update" else "the gradient",
                     ", ".join(type(o).__name__ for o in self.optimizers), why)  # fmt: skip

    def _resolve_auto_options_over_optimizers(self) -> None:
        """``word_levels="auto"`` and ``mean_variance="auto"`` with several optimizers: one setting for every
        exchange (the words' format is the state's), on only where every optimizer is one it is for (plain SGD;
        Adam and AdamW), each optimizer's reason logged."""
        state = self._gtc_state
        assert state is not None
        for option, resolve, combine in (("word_levels", resolve_word_levels, min),
                                         ("mean_variance", resolve_mean_variance, all)):  # fmt: skip
            if getattr(state, option) != "auto":
                continue
            picks = [resolve("auto", optimizer) for optimizer in self.optimizers]
            setattr(state, option, combine(value for value, _ in picks))
            if self.global_rank == 0:
                log.info("GTC: %s=%r over %d optimizers (%s)", option, getattr(state, option), len(picks),
                         "; ".join(why for _, why in picks))  # fmt: skip

    def _gate_clipping(self) -> None:
        """Lightning calls ``configure_gradient_clipping`` after the closure, on what the optimizer is
        handed: under GTC that is the decoded update, already bounded, whose every rank's gradient was
        clipped before compression. Let it run on dense warmup steps only."""
        plugin = self.precision_plugin
        if "_clip_gradients" in vars(plugin):
            return
        original = plugin._clip_gradients

        def clip_dense_steps_only(*args: Any, **kwargs: Any) -> None:
            if self._dense_step:
                original(*args, **kwargs)

        plugin._clip_gradients = clip_dense_steps_only
        module = self.lightning_module
        if module is not None and is_overridden("configure_gradient_clipping", module, LightningModule):
            log.warning(
                "GTC: your LightningModule overrides configure_gradient_clipping; it runs on dense warmup steps only. "
                "On compressed steps each rank's local gradient is clipped before compression by the Trainer's "
                "gradient_clip_val / gradient_clip_algorithm, and the decoded update is not clipped again"
            )

    def _scale_local_clipping(self) -> None:
        """``compress="update"``: Lightning clips what the optimizer is handed, each rank's own gradient on a
        compressed step; there the Trainer's threshold is scaled by ``local_clip_scale`` (dense warm-up steps
        hand it the averaged gradient, clipped at the threshold itself, as DDP)."""
        plugin = self.precision_plugin
        if "clip_gradients" in vars(plugin):
            return
        original = plugin.clip_gradients  # where LightningModule.clip_gradients ends, after its own checks

        def clip_local_at_scale(optimizer: Any, clip_val: Any = 0.0, *args: Any, **kwargs: Any) -> None:
            state = self._gtc_state
            if clip_val and self._local_step and state is not None:
                clip_val = local_clip_threshold(("", float(clip_val)), self._local_clip_scale, state.world_size)[1]
            return original(optimizer, clip_val, *args, **kwargs)

        plugin.clip_gradients = clip_local_at_scale

    @override
    def _register_ddp_hooks(self) -> None:
        # DDPStrategy only registers hooks on CUDA; GTC needs its hook on every device.
        assert isinstance(self.model, DistributedDataParallel)
        module = self.model.module
        state = self._gtc_state
        if self._saved_gtc is None and state is not None:
            # A second fit of the same Trainer in the same processes: carry the state over.
            dropped = state.rebind(module.named_parameters())
            state.process_group = self._process_group
            if dropped:
                log.warning("GTC: parameters no longer trainable, their residuals dropped: %s", dropped)
        else:
            state = self._new_state(module)
        self._gtc_state = state
        state.clip = local_clip_threshold(self._clip, self._local_clip_scale, state.world_size)
        scaler = self._grad_scaler()
        state.grad_scale = float(scaler.get_scale()) if scaler is not None else 1.0
        if self._ddp_kwargs.get("find_unused_parameters") or self._ddp_kwargs.get("static_graph"):
            state.track_usage(module.parameters())
        self._checked_step = 0
        if self._saved_gtc is not None:
            entry, path = self._saved_gtc
            self._saved_gtc = None
            self._restore_gtc(entry, path)
        self.model.register_comm_hook(state, gtc_hook)

    def _new_state(self, module: torch.nn.Module) -> GTCState:
        return GTCState(
            process_group=self._process_group,
            named_parameters=module.named_parameters(),
            tau=self._tau,
            warmup_steps=self._warmup_steps,
            max_consecutive_skips=self._max_consecutive_skips,
            dense_fallback=self._dense_fallback,
            exchange=self._exchange,
            backend=self._backend,
            stale=self._stale,
            coding=self._coding,
            target_density=self._target_density,
            compress="auto",
            busy_wait=self._busy_wait,
            conserve=self._conserve,
            density_warmup_steps=0 if self._density_warmup_steps == "auto" else self._density_warmup_steps,
            momentum_masking=self._momentum_masking,
            mean_variance=self._mean_variance,
            word_levels=self._word_levels,
        )

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        if self._gtc_state is not None and self._gtc_state.compress == "update":
            return self._update_step(optimizer, closure, model, **kwargs)

        closure = gradient_closure_once(closure, optimizer, "GTCStrategy")

        def closure_then_apply_skip() -> Any:
            result = closure()
            state = self._gtc_state
            if state is not None:
                assert self.lightning_module is not None
                state.check_unknown_gradients(self.lightning_module.named_parameters())
                scaler = self._grad_scaler() is not None  # let AMP's scaler see the skip
                stats = state.finish_step(self.lightning_module.parameters(), loss_scaler=scaler)
                # The hook clipped each rank's gradient; Lightning clips what follows the closure
                # (configure_gradient_clipping), so it may only act on dense warmup steps.
                self._dense_step = stats is not None and stats.mode == "warmup"
            return result

        output = super().optimizer_step(optimizer, closure_then_apply_skip, model, **kwargs)
        if self._gtc_state is not None:
            scaler = self._grad_scaler()
            if scaler is not None:  # the scale the next backward will use
                self._gtc_state.grad_scale = float(scaler.get_scale())
        self._maybe_check_replicas()
        return output

    def _update_step(
        self, optimizer: Optimizer, closure: Callable[[], Any], model: LightningModule | torch.nn.Module | None, **kwargs: Any
    ) -> Any:
        """``compress="update"`` (:mod:`gtc_lightning.algorithms.gtc.update`): the rank's optimizer steps on its own
        gradient (clipped by Lightning as it is), and the step it made is compressed and exchanged."""
        state = self._gtc_state
        assert state is not None and self.lightning_module is not None
        params, module = self._update_params, self.lightning_module
        scaler = self._grad_scaler() is not None
        warmup = state.step < state.warmup_steps
        skipped = False
        evaluations = 0

        def closure_then_check() -> Any:
            nonlocal skipped, evaluations
            evaluations += 1
            result = closure()
            if evaluations > 1:
                # An optimizer that evaluates the closure again within its step (SAM's second gradient, a line
                # search) probes other points: the parameters kept are the step's start, checked once
                return result
            state.check_unknown_gradients(module.named_parameters())
            if warmup:  # DDP averaged the gradients: every rank steps on the mean
                update_mode.warmup(state)
                stats = state.finish_step(params, loss_scaler=scaler)
                skipped = stats is not None and stats.skipped
            else:
                skipped = update_mode.check_finite(state, params, scaler, keep=True)  # (and keeps the parameters)
            return result

        self._local_step = not warmup
        output = super().optimizer_step(optimizer, closure_then_check, model, **kwargs)
        if not warmup and not skipped:
            # The rates the step used: read after it, since the closure may set them (a callback's or the
            # module's on_before_optimizer_step runs inside it).
            rates = update_mode.learning_rates(optimizer)
            # with several optimizers each exchange is compared with a dense all-reduce of its own parameters
            own = sum(p.numel() for p in params if id(p) in rates) if len(self.optimizers) > 1 else None
            update_mode.exchange(state, params, rates, optimizer, dense_numel=own)
        self._maybe_check_replicas()
        return output

    def _grad_scaler(self) -> Any:
        """AMP's GradScaler when the precision plugin scales the loss (fp16 mixed), else None."""
        scaler = getattr(self.precision_plugin, "scaler", None)
        return scaler if scaler is not None and scaler.is_enabled() else None

    def _maybe_check_replicas(self) -> None:
        state = self._gtc_state
        every = self._check_replicas_every
        if state is None or not every or state.step == self._checked_step or state.step % every:
            return
        self._checked_step = state.step
        assert self.lightning_module is not None
        named = [(n, p) for n, p in self.lightning_module.named_parameters()]
        sums = parameter_checksums([p for _, p in named])
        world = dist.get_world_size(self._process_group)
        everyone = torch.empty(world * sums.numel(), dtype=sums.dtype, device=sums.device)
        all_gather_equal(everyone, sums, group=self._process_group)
        everyone = everyone.view(world, -1).cpu()
        differs = everyone != everyone[0]
        if differs.any():
            ranks = [int(r) for r in torch.nonzero(differs.any(dim=1)).flatten()]
            names = [named[int(i)][0] for i in torch.nonzero(differs.any(dim=0)).flatten()]
            raise RuntimeError(
                f"GTC replicas diverged: after optimizer step {state.step}, rank(s) {ranks} hold parameters "
                f"different from rank 0's ({names[:5]}{' ...' if len(names) > 5 else ''}). Every rank must apply "
                "the same update: look for code that changes parameters on one rank only or for "
                "non-deterministic optimizer kernels"
            )

    @override
    def on_exception(self, exception: BaseException) -> None:
        hint_unused_parameters(
            exception,
            "gtc_stale" if self._stale else "gtc",
            " GTC then leaves a parameter a rank did not use out of that rank's message and keeps its residual.",
        )

    @override
    def on_train_start(self) -> None:
        # density_warmup_steps="auto" reads the run's length here, once the fit loop has set up (and a
        # resumed fit restored) its data: asked for at setup, Lightning builds the train loader early, and
        # a resumed run's loader then starts from the sampler's state before the checkpoint's
        super().on_train_start()
        state = self._gtc_state
        if self._density_warmup_steps == "auto" and state is not None and state.compress == "update":
            total = exchanges_in_run(self.lightning_module.trainer, len(self.optimizers))
            state.density_warmup_steps, why = resolve_density_warmup("auto", total)
            if self.global_rank == 0:
                log.info("GTC: %s", why)

    @override
    def on_train_end(self) -> None:
        # stale=True: the last step's exchange is waited for, and stays pending (not applied).
        if self._gtc_state is not None:
            self._gtc_state.drain()

    @override
    def teardown(self) -> None:
        if self._gtc_state is not None:
            try:
                self._gtc_state.drain()
            except RuntimeError as error:  # a peer that failed: nothing left to wait for
                log.warning("GTC: the exchange in flight did not complete (%s); dropped", error)
                self._gtc_state._in_flight = None
            self._gtc_state.untrack_usage()
        self.precision_plugin.__dict__.pop("_clip_gradients", None)
        self._saved_gtc = None
        super().teardown()

    # ---- checkpoints: the counters in the checkpoint, each rank's residuals in its own shard --

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None
    ) -> None:
        # Trainer.save_checkpoint calls this on every rank: each writes its own residual shard.
        state = self._gtc_state
        if state is not None:
            checkpoint[CHECKPOINT_KEY] = {
                **gtc_checkpoint.checkpoint_entry(state, self.world_size),
                "pending": state.pending_entry(),
            }
            optimizers = [o.state_dict() for o in self.optimizers] if state.compress == "update" else None
            gtc_checkpoint.save_shard(
                state, self.checkpoint_io, filepath, self.global_rank, self.world_size, optimizers=optimizers
            )
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        super().remove_checkpoint(filepath)
        # Every rank removes the shard it wrote: on several nodes each may sit on its own disk.
        gtc_checkpoint.remove_shard(self.checkpoint_io, filepath, self.global_rank)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        # Lightning loads the checkpoint of a fit before it configures DDP (and a new GTCState):
        # keep the entry until _register_ddp_hooks applies it. Only a fit resumes GTC's state;
        # validate/test/predict with a checkpoint must not leave it for a later fit().
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        module = self.lightning_module
        fitting = module is not None and module._trainer is not None and module.trainer.state.fn == TrainerFn.FITTING
        entry = checkpoint.get(CHECKPOINT_KEY)
        self._saved_gtc = (entry, gtc_checkpoint.resolve_link(checkpoint_path)) if fitting and entry is not None else None
        return checkpoint

    def _restore_gtc(self, saved: dict, path: _PATH) -> None:
        state = self._gtc_state
        assert state is not None
        self._rank_optimizers = gtc_checkpoint.restore(
            state, saved, path, self.global_rank, self.world_size, self.checkpoint_io, self.root_device,
            residuals=self._restore_residuals,
        )  # fmt: skip
        # After the residuals: without the stale option the pending update is added to them.
        if self._restore_residuals and saved.get("pending") is not None and saved["names"] == state.param_names:
            state.load_pending(saved["pending"], self.root_device)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        # compress="update": every rank's optimizer stepped on its own gradient; its own state is in
        # its shard (the checkpoint holds rank 0's).
        super().load_optimizer_state_dict(checkpoint)
        saved, self._rank_optimizers = self._rank_optimizers, None
        if saved is not None and self._gtc_state is not None and self._gtc_state.compress == "update":
            for optimizer, state in zip(self.optimizers, saved):
                optimizer.load_state_dict(state)

    # ---- registration --------------------------------------------------------------------------

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        register_names(strategy_registry, cls, "gtc", "DDP with gradient threshold compression")
        register_names(
            strategy_registry, cls, "gtc_stale", "DDP with one-step-stale gradient threshold compression", stale=True
        )
