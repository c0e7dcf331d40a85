"""GTC's state in checkpoints, shared by the Lightning and the Fabric strategy.

The checkpoint itself (written by global rank 0) holds a small entry: step counter, statistics,
parameter names and sizes, world size. Every rank writes its own residuals beside it, in
``<checkpoint>.gtc/rank<r>.pt``: O(n) memory per rank, on save and on load.

Restoring with the same world size gives each rank its own residuals back, bit for bit. With
another world size every rank starts from the mean of the saved residuals: the pending update,
what the residuals would still apply, is ``(1/W) * sum of the residuals``, so the mean keeps it
unchanged (``(1/W') * W' * mean``); the shards are read one at a time.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.fabric.utilities.types import _PATH

from gtc_lightning.algorithms.gtc.state import GTCState

log = logging.getLogger(__name__)

CHECKPOINT_KEY = "gtc"  # the checkpoint entry: counters, layout, where the residual shards are
SHARD_SUFFIX = ".gtc"  # residual shards live in "<checkpoint>.gtc/rank<r>.pt"


def resolve_link(checkpoint_path: _PATH) -> _PATH:
    """The file a local symlink points to (``ModelCheckpoint(save_last="link")`` makes ``last.ckpt`` a
    link to the newest checkpoint, whose shards sit beside the target, not beside the link); any other
    path as it is."""
    path = os.fspath(checkpoint_path)
    if "://" not in path and os.path.islink(path):
        return os.path.realpath(path)
    return checkpoint_path


def shard_path(checkpoint_path: _PATH, rank: int) -> str:
    """Where global rank ``rank`` keeps its residuals for the checkpoint ``checkpoint_path``."""
    return os.path.join(f"{checkpoint_path}{SHARD_SUFFIX}", f"rank{rank}.pt")


def checkpoint_entry(state: GTCState, world_size: int) -> dict[str, Any]:
    """The entry of the checkpoint itself (the residuals go to the shards)."""
    return {
        "format": 2,
        "world_size": world_size,
        "tau": state.tau,
        "names": list(state.param_names),
        "numels": list(state.numels),
        **state.counters(),
    }


def save_shard(
    state: GTCState,
    checkpoint_io: CheckpointIO,
    checkpoint_path: _PATH,
    rank: int,
    world_size: int,
    optimizers: list[dict] | None = None,
) -> None:
    """Write this rank's residuals beside ``checkpoint_path`` (every rank calls it); with
    ``compress="update"`` also this rank's optimizer states (``optimizers``: their state dicts), which
    differ between ranks (each rank's optimizer steps on its own gradient)."""
    shard = {
        "rank": rank,
        "world_size": world_size,
        "step": state.step,
        "residual": state.residual_vector(torch.device("cpu")),
    }
    if optimizers is not None:
        shard["optimizers"] = optimizers
    checkpoint_io.save_checkpoint(shard, shard_path(checkpoint_path, rank))


def remove_shard(checkpoint_io: CheckpointIO, checkpoint_path: _PATH, rank: int) -> None:
    """Remove rank ``rank``'s residual shard of a checkpoint that is removed, through ``checkpoint_io``
    (every rank removes its own: on several nodes each may have written to a disk of its own), and
    the shard folder once it is empty (whichever rank finds it so; a race between ranks is harmless)."""
    where = shard_path(checkpoint_path, rank)
    fs = get_filesystem(where)
    if fs.exists(where):
        checkpoint_io.remove_checkpoint(where)
    remove_empty_folder(os.path.dirname(where))


def remove_empty_folder(folder: str) -> None:
    """Remove ``folder`` if it exists and is empty; another rank may remove it first."""
    fs = get_filesystem(folder)
    try:
        if fs.exists(folder) and not fs.ls(folder):
            fs.rmdir(folder)
    except (FileNotFoundError, OSError):
        pass


def _load_shard(checkpoint_io: CheckpointIO, path: _PATH, rank: int, world: int, hint: str) -> dict:
    where = shard_path(path, rank)
    if not get_filesystem(where).exists(where):
        raise RuntimeError(
            f"GTC: the checkpoint {path} was saved by {world} ranks, but the residual shard of rank {rank} is "
            f"missing: {where}. Each rank writes its shard beside the checkpoint; copy it there from the "
            f"machine that ran rank {rank}, or resume with {hint} to restart the residuals from zero (their "
            "pending update is lost)"
        )
    return checkpoint_io.load_checkpoint(where)


def restore(
    state: GTCState,
    saved: dict[str, Any],
    checkpoint_path: _PATH,
    rank: int,
    world_size: int,
    checkpoint_io: CheckpointIO,
    device: torch.device,
    residuals: bool = True,
    hint: str = "GTCStrategy(restore_residuals=False)",
) -> None:
    """Put a checkpoint's GTC entry and this rank's residuals back into ``state``.

    Args:
        state: the fresh state of the resumed run.
        saved: the checkpoint's entry (:func:`checkpoint_entry`; the format-1 entry, which held
            every rank's residuals itself, is read too).
        checkpoint_path: the checkpoint file; shards are beside it.
        rank, world_size: this rank and the resumed run's world size.
        checkpoint_io: reads the shards.
        device: where the residuals live.
        residuals: False restarts the residuals from zero (counters are still restored, and so are
            this rank's optimizer states where its shard is there).
        hint: how to turn residual restoring off, for the missing-shard error.

    Returns:
        this rank's own optimizer states from its shard (``compress="update"``, same world size), or
        None: then every rank takes the checkpoint's (rank 0's).

    Raises:
        RuntimeError: a shard that is needed is missing.
    """
    state.load_counters(saved)
    if not residuals:
        log.info("GTC: residuals restart from zero at step %d (not restored)", state.step)
        if saved["world_size"] != world_size or "residuals" in saved:
            return None
        where = shard_path(checkpoint_path, rank)
        if not get_filesystem(where).exists(where):
            log.warning(
                "GTC: rank %d's shard %s is missing; with compress='update' this rank's optimizer takes the "
                "checkpoint's state (rank 0's) instead of its own",
                rank,
                where,
            )
            return None
        return checkpoint_io.load_checkpoint(where).get("optimizers")
    if saved["names"] != state.param_names or saved["numels"] != state.numels:
        rank_zero_warn("GTC: the checkpoint's parameters differ from the model's; residuals restart from zero")
        return None
    old_world = saved["world_size"]
    if "residuals" in saved:  # format 1
        rows = saved["residuals"]

        def load(r: int) -> dict:
            return {"residual": rows[r]}
    else:

        def load(r: int) -> dict:
            return _load_shard(checkpoint_io, checkpoint_path, r, old_world, hint)

    if old_world == world_size:
        shard = load(rank)
        state.load_residual_vector(shard["residual"].to(device))
        log.info("GTC: restored rank %d's residuals at step %d", rank, state.step)
        return shard.get("optimizers")
    total = torch.zeros(sum(state.numels), dtype=torch.float64)
    for r in range(old_world):
        total += load(r)["residual"].double()
    state.load_residual_vector((total / old_world).float().to(device))
    rank_zero_warn(
        f"GTC: the checkpoint holds residuals of {old_world} ranks but this run has {world_size}; every rank "
        "starts from their mean, which keeps the pending update (the mean residual) unchanged"
    )
    return None
