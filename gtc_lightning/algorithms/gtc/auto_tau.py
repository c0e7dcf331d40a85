"""Automatic tau: a controller that keeps the density of the exchanged words near a target.

tau is GTC's one knob and it depends on the model, the batch size and the world size. Strom's
Table 3 and this project's sweeps show the words per step falling as a power of tau: density ~
tau ** -1.6 over two decades. So the controller works in log space: after every compressed step
it smooths the measured density (the words all ranks sent, per rank and element) with an
exponential moving average and moves ``log tau`` by ``gain / 1.6`` of the log error, at most
``max_change`` (10 %) per step. Every rank runs it on the same exchanged word counts with the same
float arithmetic, so every rank holds the same tau and the replicas stay bit-identical. Warm-up
(dense) steps and skipped steps do not move it.

``tau="auto"`` presumes no gradient scale: its first compressed step holds every bucket back until
the last one, takes the ``1 - target_density`` quantile of ``|residual + gradient|`` on each rank
(a strided sample) and starts from the ranks' geometric mean (one small all-reduce, once), so that
the first step already sends about the target density. An explicit ``tau`` with a
``target_density`` starts from that tau instead.

With ``gain = 0.25`` and the density responding within a few steps, the error halves in about
five steps; a learning-rate halving, which changes the gradients' size, is followed within tens of
steps. The step counter, tau and the moving average are saved in checkpoints.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

SLOPE = 1.6  # -d log(density) / d log(tau), measured (on the recipe; Strom's Table 3)


@dataclass
class TauController:
    """Moves tau so that the exchanged density tracks ``target_density``.

    Attributes:
        target_density: words per rank per gradient element and step to aim for, in (0, 1).
        tau: the current threshold.
        ema: smoothed measured density (None before the first measurement).
        gain: fraction of the log error corrected per step.
        smoothing: weight of a new measurement in the moving average.
        max_change: largest factor by which tau may change in one step.
    """

    target_density: float
    tau: float
    ema: float | None = None
    started: bool = False
    gain: float = 0.25
    smoothing: float = 0.3
    max_change: float = 1.1

    def __post_init__(self) -> None:
        if not 0.0 < self.target_density < 1.0:
            raise ValueError(
                f"Expect target_density in (0, 1) (words per rank per gradient element and step, e.g. 1e-3), "
                f"got {self.target_density!r}"
            )
        if not (self.tau > 0 and math.isfinite(self.tau)):
            raise ValueError(f"Expect the initial tau to be a finite number > 0, got {self.tau!r}")

    def start(self, tau: float) -> float:
        """The measured starting tau (the first compressed step's quantile of ``|residual + gradient|``)."""
        if tau > 0 and math.isfinite(tau):
            self.tau = tau
        self.started = True
        return self.tau

    def update(self, density: float) -> float:
        """Take one step's measured density; return the tau for the next step."""
        measured = max(density, 1e-12)
        self.ema = measured if self.ema is None else (1 - self.smoothing) * self.ema + self.smoothing * measured
        step = self.gain * math.log(self.ema / self.target_density) / SLOPE
        limit = math.log(self.max_change)
        self.tau *= math.exp(min(max(step, -limit), limit))
        return self.tau

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, saved: dict) -> None:
        for key, value in saved.items():
            setattr(self, key, value)
        if "started" not in saved:  # a checkpoint from before tau's start was measured
            self.started = True
