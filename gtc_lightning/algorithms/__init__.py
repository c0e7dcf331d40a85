"""The algorithms, torch only (no Lightning import): :mod:`.gtc` (Strom's threshold compression) and
:mod:`.averaging` (model averaging, BMUF, D-PSGD) over the shared :mod:`.common` helpers and the dense
baselines' DDP hooks in :mod:`.hooks`. The Lightning and Fabric strategies in
:mod:`gtc_lightning.strategies` wire them in."""
