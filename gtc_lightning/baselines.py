"""Moved to :mod:`gtc_lightning.strategies.baselines` in 0.2.0; this alias warns and goes in 0.3.0."""

from gtc_lightning._moved import alias

__getattr__, __dir__ = alias(__name__, "gtc_lightning.strategies.baselines", "gtc_lightning.algorithms.hooks")
