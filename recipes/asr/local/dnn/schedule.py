"""Kaldi nnet1's learning-rate schedule (``steps/nnet/train_scheduler.sh``) as a pure decision rule.

After each epoch the cross-validation cross-entropy (frame average) of the new weights decides:

1. accept the epoch when its loss is below the best accepted one (or the epoch is one of the first
   ``keep_lr_epochs``), else reject it: the caller restores the weights of the last accepted epoch;
2. ``rel_impr = (best before - best after) / best before`` (0 after a rejection);
3. stop when halving has started and ``rel_impr < end_halving_impr``;
4. start halving when ``rel_impr < start_halving_impr``; once started, halve after every epoch.

So a rejection halves the rate, or stops training when halving had already started, as in nnet1.
Two departures: the first epoch is accepted whatever its loss and its relative gain is not computed
(nnet1 cross-validates the initial weights first: one more pass over the set, to reject an epoch of
SGD from a random init, which does not happen at a working learning rate); and ``max_iters`` is the
trainer's ``max_epochs``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Decision:
    """What the schedule decided after one epoch (0-based ``epoch``)."""

    epoch: int
    loss: float  # cross-validation cross-entropy of the epoch's weights
    accepted: bool  # False: restore the weights of the last accepted epoch
    rel_impr: float  # relative gain of the best accepted loss (inf for the first epoch)
    halve: bool  # halve the learning rate before the next epoch
    stop: bool  # end training: the weights are those of the last accepted epoch

    def describe(self, lr_before: float, lr_after: float) -> str:
        gain = "first epoch" if math.isinf(self.rel_impr) else f"relative gain {self.rel_impr:.4f}"
        what = "accepted" if self.accepted else "rejected (weights of the last accepted epoch restored)"
        nxt = "stop" if self.stop else (f"lr {lr_before:.4g} -> {lr_after:.4g}" if self.halve else f"lr {lr_after:.4g}")
        return f"epoch {self.epoch}: cv loss {self.loss:.4f}, {what}, {gain}; {nxt}"


class Nnet1Schedule:
    """nnet1's accept/reject, start-halving and stop rule over a sequence of cross-validation losses.

    Args:
        start_halving_impr: relative gain of the best loss below which halving starts (nnet1: 0.01).
        end_halving_impr: relative gain below which training stops once halving started (nnet1: 0.001).
        keep_lr_epochs: first epochs always accepted and never halved after (nnet1's ``keep_lr_iters``).
    """

    def __init__(self, start_halving_impr: float = 0.01, end_halving_impr: float = 0.001,
                 keep_lr_epochs: int = 0) -> None:
        if not 0 <= end_halving_impr <= start_halving_impr:
            raise ValueError(f"end_halving_impr={end_halving_impr}, start_halving_impr={start_halving_impr}: need "
                             "0 <= end <= start (nnet1: 0.001 and 0.01), since stopping comes after halving starts")
        if keep_lr_epochs < 0:
            raise ValueError(f"keep_lr_epochs={keep_lr_epochs}: give 0 or more")
        # hyper-parameters
        self.start_halving_impr, self.end_halving_impr = start_halving_impr, end_halving_impr
        self.keep_lr_epochs = keep_lr_epochs
        # state
        self.best_loss = math.inf  # loss of the last accepted epoch
        self.halving = False
        self.decisions: list[Decision] = []

    def step(self, loss: float) -> Decision:
        """Decide after the next epoch, whose cross-validation loss is ``loss``."""
        if not math.isfinite(loss):
            raise ValueError(f"cross-validation loss {loss} after epoch {len(self.decisions)}: the schedule needs "
                             "a finite loss (a diverged run, or an empty cross-validation set)")
        epoch, previous = len(self.decisions), self.best_loss
        keep = epoch < self.keep_lr_epochs
        accepted = loss < previous or keep
        if accepted:
            self.best_loss = loss
        rel_impr = math.inf if math.isinf(previous) else (previous - self.best_loss) / previous
        halve = stop = False
        if not keep:
            if self.halving and rel_impr < self.end_halving_impr:
                stop = True
            else:
                self.halving |= rel_impr < self.start_halving_impr
                halve = self.halving
        decision = Decision(epoch, loss, accepted, rel_impr, halve, stop)
        self.decisions.append(decision)
        return decision

    def state_dict(self) -> dict:
        return {"best_loss": self.best_loss, "halving": self.halving, "decisions": [asdict(d) for d in self.decisions]}

    def load_state_dict(self, state: dict) -> None:
        self.best_loss, self.halving = float(state["best_loss"]), bool(state["halving"])
        self.decisions = [Decision(**d) for d in state["decisions"]]
