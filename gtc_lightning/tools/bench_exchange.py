"""Time GTC's per-step exchange with its header sent two ways, interleaved round by round.

A GTC step on gloo sends a 24-byte header from every rank to every rank (the word counts, needed to
size the word exchange), then the words by all-to-all. The header used to go by all-gather, which
gloo runs as a ring: world - 1 message latencies in a row; by all-to-all every message is posted at
once, one latency. This runs both, with the hook's own calls (``exchange.send_header`` with
``exchange="allgather"`` and ``"alltoall"``, then ``exchange.send_words``), ``--words`` words per rank,
alternating the two every repeat so that both see the same network and load::

    python -m gtc_lightning.tools.cluster --nodes 4 --rate 1gbit -- \\
        python -m gtc_lightning.tools.bench_exchange --words 13000 --json exp/exchange_1gbit.json

Reads the launcher's environment (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``);
rank 0 prints and writes the medians, the per-repeat ratio (all-to-all header / all-gather header)
and its quartiles.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from gtc_lightning.algorithms.common import busy_wait_fits
from gtc_lightning.algorithms.gtc import exchange

WAYS = ("allgather", "alltoall")  # how the header goes; the words go by all-to-all in both


class _Exchange:
    """The few ``GTCState`` attributes ``exchange.send_header`` and ``exchange.send_words`` read."""

    def __init__(self, header_way: str, words: int) -> None:
        self.exchange = header_way
        self.process_group = None
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        self._message = torch.arange(words, dtype=torch.int32)
        self.busy = busy_wait_fits()  # GTCState's default: poll on gloo when each rank has a core


def one_step(header_way: str, words: int) -> float:
    """Seconds for one header exchange and one word exchange of ``words`` words per rank."""
    state = _Exchange(header_way, words)
    header = torch.tensor([0, words, 4 * words], dtype=torch.int64)
    dist.barrier()
    start = time.perf_counter()
    headers = exchange.send_header(state, header).view(state.world_size, 3)
    counts = headers[:, 1].tolist()
    state.exchange = "alltoall"
    received, _, _, _, _ = exchange.send_words(state, counts)
    seconds = time.perf_counter() - start
    if received.numel() != sum(counts):
        raise RuntimeError(f"received {received.numel()} words, expected {sum(counts)}")
    return seconds


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
    return q[0], statistics.median(values), q[2]


def main(argv: list[str] | None = None) -> dict | None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--words", type=int, default=13000, help="words per rank and step (default: Strom's DNN at 4 ranks)")
    p.add_argument("--repeats", type=int, default=200, help="steps per way (default 200)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--json", type=Path, default=None, help="rank 0 writes the results here")
    args = p.parse_args(argv)
    if args.words < 0 or args.repeats < 1:
        p.error(f"--words {args.words} must be >= 0 and --repeats {args.repeats} >= 1")
    if "RANK" not in os.environ:
        p.error("no RANK in the environment: run it under python -m gtc_lightning.tools.cluster (or torchrun)")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        if dist.get_world_size() < 2:
            raise SystemExit("bench_exchange needs at least 2 ranks")
        for _ in range(args.warmup):
            for way in WAYS:
                one_step(way, args.words)
        times: dict[str, list[float]] = {way: [] for way in WAYS}
        for i in range(args.repeats):
            for way in WAYS if i % 2 == 0 else WAYS[::-1]:
                times[way].append(one_step(way, args.words))
        world = dist.get_world_size()
        if dist.get_rank() != 0:
            return None
    finally:
        dist.destroy_process_group()
    ratios = [b / a for a, b in zip(times["allgather"], times["alltoall"])]
    q1, mid, q3 = quartiles(ratios)
    result = {
        "world_size": world,
        "words": args.words,
        "repeats": args.repeats,
        "median_s": {way: statistics.median(t) for way, t in times.items()},
        "ratio_alltoall_to_allgather": {"q1": q1, "median": mid, "q3": q3},
        "times_s": times,
    }
    med = result["median_s"]
    print(
        f"{world} ranks, {args.words} words each, {args.repeats} steps per way: header by all-gather "
        f"{med['allgather'] * 1e3:.2f} ms, by all-to-all {med['alltoall'] * 1e3:.2f} ms a step (median); "
        f"ratio per step {mid:.3f} [{q1:.3f}, {q3:.3f}]",
        flush=True,
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
