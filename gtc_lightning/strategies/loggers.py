"""The callbacks that log each strategy's statistics through ``LightningModule.log`` on the steps the
Trainer logs (``log_every_n_steps``: ``log`` costs ~1 ms a value, as much as the whole exchange of a
small model): :class:`GTCStatsLogger` for GTC (``gtc/...``), :class:`SyncStatsLogger` for the averaging
family (``ma/...``, ``bmuf/...``, ``dpsgd/...``), :class:`StalenessLogger` for ``adpsgd``
(``adpsgd/...``, with the staleness of its asynchronous exchanges). The strategies add them once, before the
checkpoint callbacks, so that those can monitor what they log."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from gtc_lightning.algorithms.averaging.model_averaging import AveragingState


class GTCStatsLogger(Callback):
    """Logs the newest GTC step's statistics through ``LightningModule.log`` on the steps the Trainer
    logs (``log_every_n_steps``); added by the strategy (``strategy``: a GTCStrategy, read for its
    ``gtc_state``). ``gtc_stats`` has every step's."""

    def __init__(self, strategy: Any) -> None:
        self._strategy = strategy
        self._logged_step = -1

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        state = self._strategy.gtc_state
        if state is None or state.last is None or state.last.step == self._logged_step:
            return  # no exchange since the last log: a gradient-accumulation micro-step
        # Only on the steps the Trainer sends to its loggers (log_every_n_steps): LightningModule.log
        # costs ~1 ms a value, as much as the whole exchange of a small model.
        connector = getattr(trainer, "_logger_connector", None)
        if connector is not None and not connector.should_update_logs:
            return
        state.settle(block=False)
        last = state.last
        self._logged_step = last.step

        def finite(x: float) -> float:
            return x if math.isfinite(x) else 0.0

        values = {
            "gtc/words": float(last.words),
            "gtc/words_all": float(last.words_all),
            "gtc/bytes_sent": float(last.bytes_sent),
            "gtc/bytes_received": float(last.bytes_received),
            "gtc/allreduce_fp32_bytes": float(last.allreduce_fp32_bytes),
            "gtc/ratio_fp32": finite(last.ratio_fp32),
            "gtc/ratio_bf16": finite(last.ratio_bf16),
            "gtc/compress_s": last.compress_s,
            "gtc/exchange_s": last.exchange_s,
            "gtc/decompress_s": last.decompress_s,
            "gtc/skips": float(state.totals["skips"]),
            "gtc/overflows": float(state.totals["overflows"]),
            "gtc/dense": float(last.dense),
            "gtc/tau": last.tau,
        }
        pl_module.log_dict(values, on_step=True, on_epoch=False, batch_size=1)
        bar = {"gtc_vs_fp32": finite(last.ratio_fp32), "gtc_vs_bf16": finite(last.ratio_bf16)}
        if state.controller is not None:
            bar["gtc_tau"] = state.tau
        pl_module.log_dict(bar, on_step=True, on_epoch=False, prog_bar=True, logger=False, batch_size=1)


class SyncStatsLogger(Callback):
    """Logs the newest step's statistics under ``prefix/`` through ``LightningModule.log`` on the
    steps the Trainer logs (``log_every_n_steps``; ``log`` costs ~1 ms a value), and the ratio to
    DDP's bytes and the sync count in the progress bar; the strategy's ``sync_stats`` has every step's."""

    def __init__(self, state_of: Callable[[], AveragingState | None], prefix: str) -> None:
        self._state_of = state_of
        self.prefix = prefix
        self._logged_step = -1

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        state = self._state_of()
        if state is None or state.last is None or state.last.step == self._logged_step:
            return  # no optimizer step since the last log: a gradient-accumulation micro-step
        connector = getattr(trainer, "_logger_connector", None)
        if connector is not None and not connector.should_update_logs:
            return
        last, total, p = state.last, state.stats()["total"], self.prefix
        self._logged_step = last.step
        ratio = total["ratio_fp32"] if math.isfinite(total["ratio_fp32"]) else 0.0
        values = {
            f"{p}/bytes_sent": float(last.bytes_sent),
            f"{p}/bytes_received": float(last.bytes_received),
            f"{p}/sync": float(last.mode == "sync"),
            f"{p}/exchange_s": last.exchange_s,
            f"{p}/syncs": float(total["syncs"]),
            f"{p}/bytes_sent_total": float(total["bytes_sent"]),
            f"{p}/ratio_fp32": ratio,
        }
        pl_module.log_dict(values, on_step=True, on_epoch=False, batch_size=1)
        bar = {f"{p}_vs_fp32": ratio, f"{p}_syncs": float(total["syncs"])}
        pl_module.log_dict(bar, on_step=True, on_epoch=False, prog_bar=True, logger=False, batch_size=1)


class StalenessLogger(SyncStatsLogger):
    """:class:`SyncStatsLogger` for ``adpsgd``, plus the staleness of the means applied on each logged
    step (``adpsgd/staleness``: the largest, in local steps; ``adpsgd/lag``: how many steps the peers'
    models were behind this rank's; ``adpsgd/applied``; ``adpsgd/blocked_s``: the wait for the
    staleness bound) and their totals, and at each training epoch's end, a global synchronisation
    point (``sync_point``: the strategy's, which drains the exchanges and measures the spread), the
    replicas' spread (``adpsgd/spread`` over all ranks, ``adpsgd/distance_max`` the largest rank's
distance from the mean). At the start of each training epoch and batch it calls ``resume`` (the
strategy's: its communication thread runs again after a synchronisation point, before the batch's
compute, so that a slow rank answers from the start)."""

    def __init__(
        self, state_of: Callable[[], Any], prefix: str, sync_point: Callable[[], None], resume: Callable[[], None]
    ) -> None:
        super().__init__(state_of, prefix)
        self._sync_point = sync_point
        self._resume = resume

    @override
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._resume()

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._resume()

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        state = self._state_of()
        before = self._logged_step
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if state is None or self._logged_step == before or state.last_staleness is None:
            return  # not a logged step (or a dense warmup step)
        last, total, p = state.last_staleness, state.stats()["total"], self.prefix
        values = {
            f"{p}/staleness": float(last["staleness"]),
            f"{p}/lag": float(last["lag"]),
            f"{p}/applied": float(last["applied"]),
            f"{p}/blocked_s": float(last["blocked_s"]),
            f"{p}/staleness_max": float(total["staleness_max"]),
            f"{p}/staleness_mean": float(total["staleness_mean"]),
            f"{p}/blocked_s_total": float(total["blocked_s"]),
        }
        pl_module.log_dict(values, on_step=True, on_epoch=False, batch_size=1)

    @override
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._sync_point()
        state = self._state_of()
        if state is None or state.measured is None:
            return
        p = self.prefix  # (an all-reduce each: this is a synchronisation point)
        pl_module.log(f"{p}/spread", state.measured["spread"], on_step=False, on_epoch=True, sync_dist=True)
        pl_module.log(
            f"{p}/distance_max", state.measured["distance"], on_step=False, on_epoch=True, sync_dist=True,
            reduce_fx="max",
        )  # fmt: skip
