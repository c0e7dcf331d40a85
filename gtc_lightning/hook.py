"""Moved to :mod:`gtc_lightning.algorithms.gtc.hook` in 0.2.0; this alias warns and goes in 0.3.0."""

from gtc_lightning._moved import alias

__getattr__, __dir__ = alias(
    __name__,
    "gtc_lightning.algorithms.gtc.hook",
    "gtc_lightning.algorithms.gtc.state",
    "gtc_lightning.algorithms.gtc.stats",
    "gtc_lightning.algorithms.gtc.config",
    "gtc_lightning.algorithms.common",
    "gtc_lightning.algorithms.gtc.exchange",
    "gtc_lightning.algorithms.gtc.decode",
    "gtc_lightning.algorithms.gtc.layout",
    "gtc_lightning.algorithms.gtc.auto_tau",
    "gtc_lightning.ops",
    "gtc_lightning.ops.rice",
    "gtc_lightning.ops.torch_ops",
    renamed={
        "_HEADER": "HEADER",
        "_WORD_BYTES": "WORD_BYTES",
        "_f32": "f32",
        "_TOTAL_KEYS": "TOTAL_KEYS",
        "_Clock": "Clock",
    },
)
