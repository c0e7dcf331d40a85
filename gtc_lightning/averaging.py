"""Moved to :mod:`gtc_lightning.strategies.averaging` in 0.2.0; this alias warns and goes in 0.3.0."""

from gtc_lightning._moved import alias

__getattr__, __dir__ = alias(
    __name__,
    "gtc_lightning.strategies.averaging",
    "gtc_lightning.strategies.loggers",
    "gtc_lightning.algorithms.averaging.model_averaging",
    "gtc_lightning.strategies.common",
    "gtc_lightning.algorithms.common",
    renamed={"_TOTAL_KEYS": "TOTAL_KEYS"},
)
