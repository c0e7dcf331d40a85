"""Strom's gradient threshold compression (GTC), torch only: no Lightning import.

From the bottom up: :mod:`.config` (hyper-parameters and their checks), :mod:`.stats` (what a step
did), :mod:`.auto_tau` (automatic tau's controller), :mod:`.decode` (received words as tensors),
:mod:`.inflight` (the stale exchange's update in flight), :mod:`.state` (:class:`GTCState`),
:mod:`.layout` (the flat buffers laid out as DDP's buckets), :mod:`.exchange` (the collectives),
:mod:`.stale` (the one-step-stale exchange), :mod:`.hook` (:func:`gtc_hook`, the DDP communication
hook) and :mod:`.update` (GTC on the optimizer's step); :mod:`.hsdp` is GTC across the replicate
dimension of FSDP2's hybrid sharding (its all-reduce hook). Each imports only modules before it.
"""

from gtc_lightning.algorithms.gtc.config import DEFAULT_DENSITY, check_options, sparse_gradient_parameters
from gtc_lightning.algorithms.gtc.hook import gtc_hook, local_hook
from gtc_lightning.algorithms.gtc.state import GTCState
from gtc_lightning.algorithms.gtc.stats import StepStats

__all__ = [
    "DEFAULT_DENSITY",
    "GTCState",
    "StepStats",
    "check_options",
    "gtc_hook",
    "local_hook",
    "sparse_gradient_parameters",
]
