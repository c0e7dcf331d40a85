"""Moved to :mod:`gtc_lightning.algorithms.gtc.stale` in 0.2.0; this alias warns and goes in 0.3.0.

The update in flight is now kept by the state (:meth:`GTCState.drain`, :meth:`GTCState.pending_entry`,
:meth:`GTCState.load_pending`) and by :class:`~gtc_lightning.algorithms.gtc.inflight.InFlight`; the
functions of 0.1.0 below call them.
"""

from __future__ import annotations

import torch

from gtc_lightning._moved import alias
from gtc_lightning.algorithms.gtc.inflight import InFlight
from gtc_lightning.algorithms.gtc.state import GTCState
from gtc_lightning.algorithms.gtc.stats import StepStats

__getattr__, __dir__ = alias(__name__, "gtc_lightning.algorithms.gtc.stale", "gtc_lightning.algorithms.gtc.inflight")


def drain(state: GTCState) -> InFlight | None:
    return state.drain()


def pending_entry(state: GTCState) -> dict | None:
    return state.pending_entry()


def load_pending(state: GTCState, entry: dict, device: torch.device) -> None:
    state.load_pending(entry, device)


def pending_vector(state: GTCState, flight: InFlight) -> torch.Tensor:
    return flight.vector_in(state.param_names, state.numels)


def pending_by_name(state: GTCState, flight: InFlight) -> tuple[InFlight, dict[str, torch.Tensor]]:
    return flight, flight.by_name(state.param_names, state.numels)


def pending_in_order(state: GTCState, flight: InFlight, parts: dict[str, torch.Tensor]) -> InFlight:
    return flight.reordered(parts, state.param_names, state.numels)


def finish_stale(state: GTCState, parameters: list, stats: StepStats, loss_scaler: bool) -> None:
    state._finish_stale(parameters, stats, loss_scaler)
