"""Moved to :mod:`gtc_lightning.strategies.gtc` in 0.2.0; this alias warns and goes in 0.3.0."""

from gtc_lightning._moved import alias

__getattr__, __dir__ = alias(
    __name__,
    "gtc_lightning.strategies.gtc",
    "gtc_lightning.strategies.loggers",
    "gtc_lightning.strategies.common",
    "gtc_lightning.strategies.checkpoint",
    "gtc_lightning.algorithms.common",
    renamed={
        "_HOOK_ARGS": "HOOK_ARGS",
        "_check_int": "check_int",
        "_LAUNCHERS": "LAUNCHERS",
        "_GTCStatsLogger": "GTCStatsLogger",
    },
)
