"""Moved to :mod:`gtc_lightning.tools.bench_cluster` in 0.2.0 (``python -m gtc_lightning.tools.bench_cluster``);
this alias warns and goes in 0.3.0."""

from gtc_lightning._moved import alias, run_moved

if __name__ == "__main__":
    run_moved("gtc_lightning.bench_cluster", "gtc_lightning.tools.bench_cluster")
else:
    __getattr__, __dir__ = alias(__name__, "gtc_lightning.tools.bench_cluster")
