"""The callbacks that log each strategy's statistics through ``LightningModule.log`` on the steps the
Trainer logs (``log_every_n_steps``: ``log`` costs ~1 ms a value, as much as the whole exchange of a
small model): :class:`GTCStatsLogger` for GTC (``gtc/...``), :class:`SyncStatsLogger` for the averaging
family (``ma/...``, ``bmuf/...``, ``dpsgd/...``). The strategies add them once, before the
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
