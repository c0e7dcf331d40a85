"""The averaging family, torch only (no Lightning import): periodic model averaging
(:mod:`.model_averaging`, whose state and flat collectives the others build on), BMUF (:mod:`.bmuf`)
D-PSGD (:mod:`.dpsgd`) and its
asynchronous form AD-PSGD (:mod:`.adpsgd`). Their Lightning strategies are in :mod:`gtc_lightning.strategies`."""

from gtc_lightning.algorithms.averaging.adpsgd import ADPSGDState
from gtc_lightning.algorithms.averaging.bmuf import BMUFState
from gtc_lightning.algorithms.averaging.dpsgd import DPSGDState
from gtc_lightning.algorithms.averaging.model_averaging import AveragingState, SyncStats, local_hook

__all__ = ["ADPSGDState", "AveragingState", "BMUFState", "DPSGDState", "SyncStats", "local_hook"]
