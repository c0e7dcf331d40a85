"""Busy waiting on GTC's collectives: ``finish`` polls a handle then waits on it, ``busy_wait_fits``
decides where polling is the default, and polling or blocking ranks compute the same steps."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from _strategy_helpers import fit

from gtc_lightning import GTCFabricStrategy, GTCStrategy
from gtc_lightning.algorithms import common
from gtc_lightning.algorithms.common import busy_wait_fits, finish
from gtc_lightning.algorithms.gtc.state import GTCState


class FakeWork:
    """A collective's handle that completes after ``polls`` calls of ``is_completed``."""

    def __init__(self, polls: int | None) -> None:
        self.polls, self.asked, self.waited = polls, 0, False

    def is_completed(self) -> bool:
        self.asked += 1
        return self.polls is not None and self.asked > self.polls

    def wait(self) -> bool:
        self.waited = True
        return True


def test_finish_polls_until_the_collective_completes_then_waits():
    work = FakeWork(polls=5)
    finish(work, busy=True)
    assert work.asked == 6 and work.waited


def test_finish_blocks_without_polling_when_not_busy():
    work = FakeWork(polls=5)
    finish(work, busy=False)
    assert work.asked == 0 and work.waited
    finish(None, busy=True)  # nothing was sent: nothing to wait for


def test_finish_stops_polling_after_spin_seconds(monkeypatch):
    monkeypatch.setattr(common, "SPIN_SECONDS", 0.01)
    work = FakeWork(polls=None)  # never completes while polled
    finish(work, busy=True)
    assert work.asked > 1 and work.waited


def test_busy_wait_fits_gloo_with_a_core_per_local_rank(monkeypatch):
    assert not busy_wait_fits()  # no process group
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        cores = len(os.sched_getaffinity(0))
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores))
        assert busy_wait_fits()
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores + 1))
        assert not busy_wait_fits()
        monkeypatch.delenv("LOCAL_WORLD_SIZE")
        assert busy_wait_fits()  # the group's size, 1
    finally:
        dist.destroy_process_group()


def test_busy_wait_values_are_checked():
    for cls in (GTCStrategy, GTCFabricStrategy):
        with pytest.raises(ValueError, match=r"busy_wait to be True .*got 'yes'"):
            cls(busy_wait="yes")
    with pytest.raises(ValueError, match=r"busy_wait to be True .*got 1"):
        GTCState(None, torch.nn.Linear(2, 2).named_parameters(), tau=0.01, busy_wait=1)


@pytest.mark.parametrize("compress", ["update", "gradient"])
def test_polling_and_blocking_ranks_make_the_same_steps(tmp_path, compress):
    options = {"tau": "auto", "target_density": 0.05, "coding": "rice", "compress": compress}
    _, polled = fit(tmp_path / "polled", busy_wait=True, **options)
    _, blocked = fit(tmp_path / "blocked", busy_wait=False, **options)
    for a, b in zip(polled, blocked):
        assert len(a["records"]) == len(b["records"]) > 0
        for ra, rb in zip(a["records"], b["records"]):
            assert torch.equal(ra["params"], rb["params"])
        total = a["records"][-1]["stats"]["total"]
        assert total["words"] > 0
        # every mode's totals add up its exchange and decode times (the update mode's were left at 0)
        assert total["exchange_s"] > 0 and total["decompress_s"] > 0
