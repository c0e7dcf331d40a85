"""The flat layout of GTC's buffers: one residual, its spare, the vote counts and this rank's message,
``[sum of numels]`` each, laid out as DDP's buckets (bucket 0 first); words index that flat space.
DDP rebuilds its buckets after the first iteration (the same bucket index can then hold other
parameters in another order): the space is then laid out anew during that step and each parameter's
residual moves with it, found by name, so nothing is misplaced."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from gtc_lightning.algorithms.gtc.state import GTCState
from gtc_lightning.ops import step_ops

log = logging.getLogger(__name__)



def bucket_offset(state: GTCState, bucket: dist.GradBucket, params: list) -> int:
    """Offset of ``bucket`` in the flat space; lays the space out anew when DDP rebuilt its
    buckets (or on the first step), moving each parameter's residual by name."""
    index = bucket.index()
    key = tuple(id(p) for p in params)
    if state._building is None and (index >= len(state._keys) or state._keys[index] != key):
        start_layout(state, bucket.buffer().device)
    offset = state._step_offset
    building = state._building
    if building is None:
        return state._offsets[index]
    for p in params:
        name = state._name_of.get(id(p))
        if name is None:
            raise RuntimeError(
                f"DDP's bucket {index} holds a parameter of shape {tuple(p.shape)} that GTC does not know; "
                "the model's parameters changed after the strategy was set up"
            )
        n = p.numel()
        where = building["residual"][offset : offset + n]
        if name in state._slots:
            old, _ = state._slots[name]
            where.copy_(state._residual[old : old + n])
        elif name in state._loaded:
            where.copy_(state._loaded[name])
        building["slots"][name] = (offset, n)
        offset += n
    building["keys"].append(key)
    building["offsets"].append(state._step_offset)
    return state._step_offset


def start_layout(state: GTCState, device: torch.device) -> None:
    """Start a new flat layout on ``device`` (first step, or DDP rebuilt its buckets); buckets already
    thresholded this step keep their place."""
    capacity = sum(state.numels)
    prefix = state._step_offset  # buckets already done this step keep their place
    residual = torch.zeros(capacity, dtype=torch.float32, device=device)
    spare = torch.empty(capacity, dtype=torch.float32, device=device)
    done = len(state._pending)
    if prefix:
        residual[:prefix].copy_(state._residual[:prefix])
        spare[:prefix].copy_(state._spare[:prefix])
    slots = {name: slot for name, slot in state._slots.items() if slot[0] < prefix}
    state._building = {
        "residual": residual,
        "spare": spare,
        "keys": state._keys[:done],
        "offsets": state._offsets[:done],
        "slots": slots,
    }
    counts_dtype = step_ops(device, state.backend).COUNTS_DTYPE
    if state._counts is None or state._counts.device != device or state._counts.dtype != counts_dtype:
        state._counts = torch.zeros(capacity, dtype=counts_dtype, device=device)
        state._message = torch.empty(capacity, dtype=torch.int32, device=device)


def finish_layout(state: GTCState) -> None:
    """Commit the layout assembled during this step, if any (at the step's last bucket)."""
    building, state._building = state._building, None
    if building is None:
        return
    state._residual, state._spare = building["residual"], building["spare"]
    state._keys, state._offsets, state._slots = building["keys"], building["offsets"], building["slots"]
    state._loaded = {}
    log.debug("GTC: flat layout of %d buckets, %d elements", len(state._keys), state._step_offset)


def buffers(state: GTCState) -> tuple[torch.Tensor, torch.Tensor]:
    """(committed residual, next residual) flat buffers of the step in progress."""
    if state._building is not None:
        return state._building["residual"], state._building["spare"]
    return state._residual, state._spare
