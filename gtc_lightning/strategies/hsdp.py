"""``GTCHSDPStrategy``: FSDP2 inside a node, GTC across nodes (HSDP with a compressed replicate dimension).

The strategy only wires things together: it builds the 2-D device mesh ``("replicate", "shard")``,
hands the LightningModule the shard dimension to apply ``fully_shard`` on, installs
:class:`~gtc_lightning.algorithms.gtc.hsdp.HSDPGTCState`'s hook on every FSDP module that holds
parameters, broadcasts each shard once from its first replica, and saves and restores every rank's
residuals as sharded state in Lightning's distributed checkpoint.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.strategies.fsdp import _distributed_checkpoint_load, _distributed_checkpoint_save
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import ModelParallelStrategy, ParallelStrategy
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from gtc_lightning.algorithms.gtc.config import check_options
from gtc_lightning.algorithms.gtc.hsdp import HSDPGTCState
from gtc_lightning.strategies.common import add_callback, gradient_closure_once, refuse_optimizers

log = logging.getLogger(__name__)

CHECKPOINT_KEY = "gtc_hsdp"  # the checkpoint's entry (mesh, shard sizes) and the sharded state's key
ROOT = "_root"  # the name of the LightningModule itself among the FSDP modules
UPDATE_KEY = "_update"  # compress="update": the slot of the optimizer's step over all of this rank's shards
MOMENTS_KEY = "gtc_hsdp_moments"  # compress="update": every rank's own optimizer state, as sharded state


class GTCHSDPStrategy(ModelParallelStrategy):
    """Hybrid sharded data parallel whose replicate dimension is reduced by Strom's gradient threshold
    compression (GTC): parameters, gradients and optimizer states are sharded by FSDP2 within each
    group of ``shard_size`` ranks (a node), and the ``replicate_size`` ranks that hold the same shard
    exchange compressed words instead of all-reducing it.

    The LightningModule applies FSDP2 in ``configure_model`` on the shard dimension::

        def configure_model(self):
            mesh = self.device_mesh["shard"]
            for block in self.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(self, mesh=mesh)

    (``fully_shard`` on the whole 2-D mesh would make FSDP all-reduce across replicas itself: refused.)

    What is compressed (``compress``):

    - ``"gradient"`` (Strom's): FSDP2's hook receives each rank's gradient shard right after the
      reduce-scatter, before the sharded optimizer sees it: the residual is kept on the shard, the words
      go to the shard's replicas, and the decoded mean gradient is what FSDP hands to the optimizer.
      Every replica of a shard decodes the same words, so its optimizer (momentum, Adam moments) steps
      on the same gradient from the same state. Adam rescales each element's sparse votes by its own
      second moment, which costs accuracy; SGD (with momentum) suits it best.
    - ``"update"`` (what ``"auto"``, the default, picks with one optimizer; measured better with AdamW and
      with momentum SGD, docs/benchmarks/hsdp.md): no hook; each replica's sharded optimizer steps on its own gradient shard (the mean
      over its shard group) with its own moments, and the step it made is what the residual takes
      (its displacement: the parameters after the step minus before). The words of the residual go to
      the shard's replicas, and every replica sets its shard to where it was before the step plus the
      decoded mean step, so the replicas stay bit-identical while their optimizer states differ. With
      ``tau="auto"`` each replica measures its tau at every step (the ``1 - target_density`` quantile of
      its residual plus its step), since a step follows the learning-rate schedule, and sends it in its
      header: each replica's words are decoded at their sender's tau. One
      optimizer only. A step whose mean is not finite on some replica is undone on every replica.

    Either way the shard's replicas stay bit-identical without ever being compared or broadcast.

    Memory: GTC keeps a float32 residual and an int32 message buffer per element of the rank's shard,
    8 bytes per element, ``1/shard_size`` of the DDP strategy's per-parameter cost; the update mode holds
    two more float32 copies of the shard during the step (before, and the step).

    Args:
        replicate_size: ranks that hold the same shard (GTC's exchange); ``"auto"``: the number of
            nodes. Must be at least 2.
        shard_size: ranks a shard group spans (FSDP2's reduce-scatter and all-gather); ``"auto"``:
            the devices per node. ``replicate_size * shard_size`` must be the world size.
        tau: the threshold, in the gradient's units, or ``"auto"`` (default): measured at the first
            compressed step and moved towards ``target_density``, per FSDP module and shard.
        target_density: words per element and step with automatic tau (None: 1e-2).
        compress: ``"auto"`` (default: ``"update"`` with one optimizer, ``"gradient"`` with several),
            ``"gradient"`` (Strom's, in FSDP's hook) or ``"update"`` (each replica's optimizer step,
            compressed after it); see above.
        warmup_steps: backward passes of dense all-reduce across replicas before compression.
        coding: ``"rice"`` (default, Golomb-Rice coded, 8-11 bits a word) or ``"none"`` (32 bits).
        restore_residuals: restore every rank's residuals from a resumed checkpoint (same mesh
            only). ``False`` restarts them from zero (their pending update is lost), at any mesh.
        busy_wait: poll GTC's collectives (True), block on them (False), or poll on gloo where each
            rank has a core (None).
        save_distributed_checkpoint: must be True: the residuals differ on every rank and are saved
            as sharded state (torch Distributed Checkpoint), as Lightning's FSDP2 checkpoints are.
        process_group_backend: as for ``ModelParallelStrategy``; so is ``timeout``.
        start_method: ``"popen"`` (default, Lightning's script launcher), ``"spawn"`` or ``"fork"``
            (the main process's module keeps its initial weights after fit: load a checkpoint).
    """

    def __init__(
        self,
        replicate_size: int | Literal["auto"] = "auto",
        shard_size: int | Literal["auto"] = "auto",
        tau: float | Literal["auto"] = "auto",
        target_density: float | None = None,
        warmup_steps: int = 0,
        coding: Literal["none", "rice"] = "rice",
        compress: Literal["auto", "gradient", "update"] = "auto",
        restore_residuals: bool = True,
        busy_wait: bool | None = None,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork"] = "popen",
    ) -> None:
        check_options(tau, warmup_steps, None, "auto", "auto", coding, target_density, "gradient", busy_wait)
        if compress not in ("auto", "gradient", "update"):
            raise ValueError(
                f"Expect compress in ('auto', 'gradient', 'update') (Strom's gradient residual in FSDP's hook, each "
                f"replica's optimizer step compressed after it, or 'auto': the update with one optimizer), got "
                f"{compress!r}"
            )
        for name, size, low in (("replicate_size", replicate_size, 2), ("shard_size", shard_size, 1)):
            if size != "auto" and (isinstance(size, bool) or not isinstance(size, int) or size < low):
                why = (
                    "with one replica there is nothing to exchange across replicas: use ModelParallelStrategy "
                    "(FSDP2 alone)" if name == "replicate_size" else "ranks per shard group"
                )
                raise ValueError(f"Expect {name} to be an int >= {low} or 'auto' ({why}), got {size!r}")
        if not save_distributed_checkpoint:
            raise ValueError(
                "GTCHSDPStrategy(save_distributed_checkpoint=False) is not supported: every rank's residuals "
                "differ and are saved as sharded state; keep save_distributed_checkpoint=True (the default)"
            )
        if start_method not in ("popen", "spawn", "fork"):
            raise ValueError(f"Expect start_method in popen/spawn/fork, got {start_method!r}")
        super().__init__(
            data_parallel_size=replicate_size,
            tensor_parallel_size=shard_size,
            save_distributed_checkpoint=True,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._tau = tau
        self._target_density = target_density
        self._warmup_steps = warmup_steps
        self._coding = coding
        self._compress = compress
        self._mode = "update" if compress == "auto" else compress  # resolved at setup
        self._restore_residuals = bool(restore_residuals)
        self._busy_wait = busy_wait
        self._start_method = start_method
        self._gtc_state: HSDPGTCState | None = None

    # ---- the mesh --------------------------------------------------------------------------------

    @override
    def _configure_launcher(self) -> None:
        if self._start_method == "popen":
            super()._configure_launcher()
        else:
            self._launcher = ShardedResultsLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        ParallelStrategy.setup_environment(self)
        self._setup_distributed()
        world = self.world_size
        replicas = self.num_nodes if self._data_parallel_size == "auto" else self._data_parallel_size
        shards = self.num_processes if self._tensor_parallel_size == "auto" else self._tensor_parallel_size
        if self._tensor_parallel_size == "auto" and self._data_parallel_size != "auto":
            shards = world // replicas if world % replicas == 0 else shards
        if self._data_parallel_size == "auto" and self._tensor_parallel_size != "auto":
            replicas = world // shards if world % shards == 0 else replicas
        if world % shards:
            raise ValueError(
                f"GTCHSDPStrategy: shard_size={shards} does not divide the world size {world}: every rank must "
                "belong to one shard group of shard_size ranks; pick a divisor of the world size (the devices "
                "per node, usually)"
            )
        if replicas * shards != world:
            raise ValueError(
                f"GTCHSDPStrategy: replicate_size={replicas} x shard_size={shards} is not the world size {world}; "
                f"set replicate_size={world // shards}"
            )
        if replicas < 2:
            raise ValueError(
                f"GTCHSDPStrategy: replicate_size is 1 (world size {world}, shard_size={shards}): with one replica "
                "there is nothing for GTC to exchange. Use ModelParallelStrategy (FSDP2 alone), or a shard_size "
                "that leaves at least 2 replicas"
            )
        self._data_parallel_size, self._tensor_parallel_size = replicas, shards
        self._device_mesh = init_device_mesh(
            self.root_device.type, (replicas, shards), mesh_dim_names=("replicate", "shard")
        )
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Every rank is a data-parallel worker: the shard group splits the parameters, not the data.
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @property
    def gtc_state(self) -> HSDPGTCState | None:
        return self._gtc_state

    @property
    def gtc_stats(self) -> dict[str, int]:
        """This rank's totals: hook calls, words, bytes sent across the replicate dimension, and what
        a fp32 ring all-reduce of the same shards would have sent (``bytes_dense``)."""
        return dict(self._gtc_state.totals) if self._gtc_state is not None else {}

    # ---- the hooks ---------------------------------------------------------------------------------

    @override
    def setup(self, trainer: L.Trainer) -> None:
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is not None:
            raise ValueError(
                "GTCHSDPStrategy does not take a loss-scaled precision ('16-mixed'): a step the scaler skips would "
                "drop words the residuals already gave away. Use '32-true' or 'bf16-mixed'"
            )
        super().setup(trainer)
        modules = self._fsdp_modules()
        replicate = self.device_mesh["replicate"].get_group()
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            refuse_optimizers("GTCHSDPStrategy", self.optimizers, update=False)
        if self._compress == "auto" and fitting:
            self._mode = "update" if len(self.optimizers) == 1 else "gradient"
        if self._mode == "update" and fitting and len(self.optimizers) != 1:
            raise ValueError(
                f"GTCHSDPStrategy(compress='update') compresses the step of one optimizer; this model has "
                f"{len(self.optimizers)}. Return one optimizer from configure_optimizers, or use compress='gradient'"
            )
        state = self._gtc_state
        if state is None or state.replicate_group is not replicate or state.per_step_tau != (
            self._mode == "update" and self._tau == "auto"
        ):
            state = HSDPGTCState(
                replicate, self._tau, self._target_density, self._warmup_steps, self._coding, self._busy_wait,
                per_step_tau=self._mode == "update",
            )
            self._gtc_state = state
        if self._mode == "gradient":
            for key, module in modules.items():
                module.set_all_reduce_hook(state.hook(key))
        add_callback(trainer, HSDPStatsLogger(self))
        if trainer.state.fn == TrainerFn.FITTING:
            self._broadcast_shards(replicate)
        if self.global_rank == 0:
            numel = sum(p.numel() for p in self.model.parameters())
            log.info(
                "GTC HSDP: %d replicas x %d shards, %d FSDP modules, %d parameters; compress=%s%s, tau=%s, coding=%s",
                self._data_parallel_size, self._tensor_parallel_size, len(modules), numel, self._mode,
                f" (auto: {len(self.optimizers)} optimizer(s))" if self._compress == "auto" else "",
                self._tau if self._tau != "auto" else f"auto (target_density={state.target_density:g})", self._coding,
            )  # fmt: skip

    @property
    def compress(self) -> str:
        """What is compressed: ``"gradient"`` or ``"update"`` (``"auto"`` resolved at setup: the update with one
        optimizer, the gradient with several)."""
        return self._mode

    def _local_shards(self) -> list[torch.Tensor]:
        """This rank's shard of every trainable parameter (the tensors FSDP2's optimizer steps on)."""
        assert self.model is not None
        return [p.to_local() if hasattr(p, "to_local") else p for p in self.model.parameters() if p.requires_grad]

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """``compress="update"``: the optimizer steps on this replica's own gradient, then the step is
        replaced by GTC's estimate of the replicas' mean step (the module docstring)."""
        if self._mode != "update" or self._gtc_state is None:
            if self._gtc_state is not None:  # the gradient mode: one gradient a step
                closure = gradient_closure_once(closure, optimizer, "GTCHSDPStrategy")
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        shards = self._local_shards()
        before = torch.cat([t.detach().reshape(-1) for t in shards])
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        with torch.no_grad():
            step = torch.cat([t.reshape(-1) for t in shards]).sub_(before)
            self._gtc_state.reduce(UPDATE_KEY, step)
            finite = bool(torch.isfinite(step).all())
            if finite:
                before.add_(step)
            elif self.global_rank == 0:
                log.warning("GTC HSDP: the replicas' mean step is not finite; the step is undone on every replica")
            for t, part in zip(shards, before.split([t.numel() for t in shards])):
                t.copy_(part.view_as(t))
        return output

    def _fsdp_modules(self) -> dict[str, Any]:
        """The FSDP2 modules that hold parameters, by name, each checked to be sharded on the shard
        dimension alone."""
        from torch.distributed.fsdp import FSDPModule

        assert self.model is not None
        shard_mesh = self.device_mesh["shard"]
        found = {}
        for name, module in self.model.named_modules():
            if not isinstance(module, FSDPModule):
                continue
            group = module._get_fsdp_state()._fsdp_param_group
            if group is None:
                continue
            mesh = group.mesh_info.mesh
            if mesh.ndim != 1 or mesh.size() != shard_mesh.size() or mesh.mesh.tolist() != shard_mesh.mesh.tolist():
                raise ValueError(
                    f"GTCHSDPStrategy: {name or 'the LightningModule'} is sharded on a mesh of shape "
                    f"{tuple(mesh.shape)} ({mesh.mesh_dim_names}); GTC does the replicate dimension itself, so "
                    "apply fully_shard(module, mesh=self.device_mesh['shard']) in configure_model"
                )
            found[name or ROOT] = module
        if not found:
            raise ValueError(
                "GTCHSDPStrategy: the model has no FSDP2 module holding parameters. Apply "
                "torch.distributed.fsdp.fully_shard(module, mesh=self.device_mesh['shard']) in the "
                "LightningModule's configure_model (to its blocks, then to the module itself)"
            )
        from torch.distributed.tensor import DTensor

        plain = [n for n, p in self.model.named_parameters() if p.requires_grad and not isinstance(p, DTensor)]
        if plain:
            raise ValueError(
                f"GTCHSDPStrategy: trainable parameters outside every FSDP2 module ({plain[:5]}"
                f"{' ...' if len(plain) > 5 else ''}) would get no gradient reduction at all; apply fully_shard to "
                "the LightningModule itself too, after its blocks"
            )
        return found

    def _broadcast_shards(self, replicate: dist.ProcessGroup) -> None:
        """Every replica of a shard starts from the first replica's values (as DDP broadcasts from rank
        0): GTC keeps them identical from there on."""
        source = dist.get_global_rank(replicate, 0)
        assert self.model is not None
        with torch.no_grad():
            for p in self.model.parameters():
                local = p.to_local() if hasattr(p, "to_local") else p
                dist.broadcast(local, src=source, group=replicate)

    # ---- checkpoints: the residuals as sharded state ------------------------------------------------

    def _sharded_state(self, saved: dict[str, dict[str, torch.Tensor]]) -> dict[str, dict[str, Any]]:
        """Each rank's tensors as one DTensor ``[R, S, k]`` over the 2-D mesh, this rank's ``[1, 1, k]``:
        Distributed Checkpoint writes and reads every rank's own piece."""
        from torch.distributed.tensor import DTensor, Shard

        mesh = self.device_mesh
        return {
            key: {
                name: DTensor.from_local(t.detach().reshape(1, 1, -1), mesh, [Shard(0), Shard(1)], run_check=False)
                for name, t in entry.items()
            }
            for key, entry in saved.items()
        }

    def _own_moments(self) -> dict[str, dict[str, torch.Tensor]]:
        """``compress="update"``: this rank's optimizer state tensors (momentum, Adam's moments: its shard's,
        and its replica's own), which Distributed Checkpoint would save once for all replicas of a shard."""
        own = {}
        for i, optimizer in enumerate(self.optimizers):
            for j, group in enumerate(optimizer.param_groups):
                for k, p in enumerate(group["params"]):
                    for name, t in sorted(optimizer.state.get(p, {}).items()):
                        if torch.is_tensor(t) and t.is_floating_point() and t.dim() > 0:
                            local = t.to_local() if hasattr(t, "to_local") else t
                            own[f"{i}.{j}.{k}.{name}"] = local
        return {"moments": own} if own else {}

    def _entry(self) -> dict[str, Any]:
        state = self._gtc_state
        assert state is not None
        return {
            "mesh": [self._data_parallel_size, self._tensor_parallel_size],
            "numels": {key: slot.residual.numel() for key, slot in state.slots.items()},
            "compress": self._mode,  # "update": every rank's optimizer state is saved too
        }

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("GTCHSDPStrategy.save_checkpoint(..., storage_options=...) is not supported")
        path = Path(self.broadcast(filepath))
        if path.is_file():
            path.unlink()
        path.mkdir(parents=True, exist_ok=True)
        converted = {"state_dict": checkpoint.pop("state_dict")}
        converted.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        if self._gtc_state is not None:
            converted[CHECKPOINT_KEY] = self._sharded_state(self._gtc_state.rank_state())
            checkpoint[CHECKPOINT_KEY] = self._entry()
            if self._mode == "update":
                converted[MOMENTS_KEY] = self._sharded_state(self._own_moments())
        _distributed_checkpoint_save(converted, path)
        if self.global_rank == 0:
            torch.save(checkpoint, path / _METADATA_FILENAME)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        meta = path / _METADATA_FILENAME
        entry = torch.load(meta, weights_only=weights_only).get(CHECKPOINT_KEY) if meta.is_file() else None
        module = self.lightning_module
        fitting = module is not None and module._trainer is not None and module.trainer.state.fn == TrainerFn.FITTING
        restore = fitting and self._restore_residuals and entry is not None
        mesh = [self._data_parallel_size, self._tensor_parallel_size]
        if restore and entry["mesh"] != mesh:
            raise RuntimeError(
                f"GTCHSDPStrategy: the checkpoint {path} holds the residuals of a {entry['mesh'][0]} x "
                f"{entry['mesh'][1]} (replicate x shard) mesh, this run's mesh is {mesh[0]} x {mesh[1]}: every "
                "rank's residual belongs to its own shard and replica, and they do not carry over to another "
                "mesh. Resume at the same mesh, or with GTCHSDPStrategy(restore_residuals=False) to restart the "
                "residuals from zero (the parameters and the optimizer's state are resharded; the residuals' "
                "pending update is lost)"
            )
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        checkpoint.pop(CHECKPOINT_KEY, None)
        if restore:
            state = self._gtc_state
            assert state is not None
            device = self.root_device
            for key, numel in entry["numels"].items():
                state.new_slot(key, numel, device)
            sharded = self._sharded_state(state.rank_state())
            _distributed_checkpoint_load({CHECKPOINT_KEY: sharded}, path)
            state.load_rank_state(
                {key: {name: t.to_local().reshape(-1) for name, t in e.items()} for key, e in sharded.items()}
            )
            own = self._own_moments() if self._mode == "update" and entry.get("compress") == "update" else {}
            if own:
                moments = self._sharded_state(own)
                _distributed_checkpoint_load({MOMENTS_KEY: moments}, path)
                with torch.no_grad():
                    for name, t in own["moments"].items():
                        t.copy_(moments["moments"][name].to_local().reshape(t.shape))
            if self.global_rank == 0:
                log.info("GTC HSDP: restored every rank's residuals%s from %s",
                         " and optimizer state" if own else "", path)  # fmt: skip
        elif fitting and entry is not None and self.global_rank == 0:
            log.info("GTC HSDP: residuals restart from zero (restore_residuals=False)")
        return checkpoint

    # ---- registration ------------------------------------------------------------------------------

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        for suffix, start_method in (("", "popen"), ("_spawn", "spawn"), ("_fork", "fork")):
            strategy_registry.register(
                f"gtc_hsdp{suffix}",
                cls,
                description=f"FSDP2 within a node, GTC across the replicate dimension, start_method '{start_method}'",
                start_method=start_method,
            )


class HSDPStatsLogger(L.Callback):
    """Logs, on the steps the Trainer logs (``log_every_n_steps``), rank 0's totals since fit started:
    ``gtc_hsdp/bytes_sent`` across the replicate dimension, ``gtc_hsdp/ratio_fp32`` (what a fp32 ring
    all-reduce of the same shards would have sent, per byte sent), ``gtc_hsdp/density`` (words per
    element of the shards and hook call) and ``gtc_hsdp/tau`` (the mean over the FSDP modules)."""

    def __init__(self, strategy: GTCHSDPStrategy) -> None:
        self._strategy = strategy

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:  # fmt: skip
        state = self._strategy.gtc_state
        connector = getattr(trainer, "_logger_connector", None)
        if state is None or not state.slots or (connector is not None and not connector.should_update_logs):
            return
        totals = state.totals
        values = {
            "gtc_hsdp/bytes_sent": float(totals["bytes_sent"]),
            "gtc_hsdp/ratio_fp32": totals["bytes_dense"] / max(totals["bytes_sent"], 1),
            "gtc_hsdp/density": totals["words"] / max(totals["elements"], 1),
            "gtc_hsdp/tau": sum(slot.tau for slot in state.slots.values()) / len(state.slots),
        }
        pl_module.log_dict(values, on_step=True, on_epoch=False, rank_zero_only=True)


class ShardedResultsLauncher(_MultiProcessingLauncher):
    """Lightning's fork/spawn launcher, without handing rank 0's weights back to the main process: they
    are shards (DTensors), which the main process's unsharded module cannot take."""

    @override
    def _collect_rank_zero_results(self, trainer: L.Trainer, results: Any) -> _WorkerOutput | None:
        if self._strategy.local_rank != 0:
            return None
        callback = trainer.checkpoint_callback
        best = getattr(callback, "best_model_path", None) if callback else None
        return _WorkerOutput(best, None, trainer.state, results, self.get_extra_results(trainer))

