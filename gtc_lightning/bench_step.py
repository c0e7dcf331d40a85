"""Moved to :mod:`gtc_lightning.tools.bench_step` in 0.2.0 (``python -m gtc_lightning.tools.bench_step``);
this alias warns and goes in 0.3.0."""

from gtc_lightning._moved import alias, run_moved

if __name__ == "__main__":
    run_moved("gtc_lightning.bench_step", "gtc_lightning.tools.bench_step")
else:
    __getattr__, __dir__ = alias(
        __name__,
        "gtc_lightning.tools.bench_step",
        renamed={"_free_port": "free_port", "_make_strategy": "make_strategy"},
    )
