"""Moved to :mod:`gtc_lightning.algorithms.gtc.update` in 0.2.0; this alias warns and goes in 0.3.0."""

from gtc_lightning._moved import alias

__getattr__, __dir__ = alias(
    __name__,
    "gtc_lightning.algorithms.gtc.update",
    "gtc_lightning.algorithms.gtc.config",
    renamed={"_f32": "f32", "_WORD_BYTES": "WORD_BYTES"},
)
