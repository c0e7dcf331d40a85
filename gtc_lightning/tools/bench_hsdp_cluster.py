"""``python -m gtc_lightning.tools.bench_hsdp_cluster``: ``gtc_hsdp``'s step on an emulated cluster of 2 nodes
of 2 ranks each, the slow link between the nodes (needs root for the namespaces: :mod:`.cluster`).

The model suite's transformer sharded by FSDP2 within each node (the shard group) and replicated across
the two nodes, trained by Lightning's own multi-node path over gloo, one cluster run per method and rate:

- ``nocomm``: ``gtc_hsdp`` whose hooks do nothing: FSDP2 within the node, nothing across the nodes (the
  step the others are compared with; the replicas drift apart, the loss is not scored);
- ``hsdp``: torch's own HSDP (``fully_shard`` on the 2-D mesh): a dense fp32 all-reduce of every gradient
  shard across the nodes;
- ``gtc_hsdp``: :class:`~gtc_lightning.strategies.hsdp.GTCHSDPStrategy` at its defaults (gradient mode);
- ``gtc_hsdp_update``: the same with ``compress="update"``.

Per run: the median step over the timed steps (after ``--warmup``) of every rank, the bytes each node's
link counted over the run (the cluster's veth counters) and the strategy's own count across the
replicate dimension. Writes ``<out>/results.json`` and prints a table::

    python -m gtc_lightning.tools.bench_hsdp_cluster --rates 100mbit 1gbit --steps 80 --out exp/hsdp_cluster
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy

from gtc_lightning.strategies.hsdp import GTCHSDPStrategy
from gtc_lightning.tools import bench_hsdp
from gtc_lightning.tools.bench_hsdp import ShardedTransformerLM

METHODS = ("nocomm", "hsdp", "gtc_hsdp", "gtc_hsdp_update")
NODES, DEVICES = 2, 2


class _NoReplicate(GTCHSDPStrategy):
    """FSDP2 within the node and nothing across the nodes: every hook leaves the gradient shard as it is."""

    def setup(self, trainer: L.Trainer) -> None:
        super().setup(trainer)
        for module in self._fsdp_modules().values():
            module.set_all_reduce_hook(lambda output: None)


class _NativeHSDP(bench_hsdp._NativeHSDP):
    """bench_hsdp's torch HSDP with Lightning's own launcher: the cluster tool starts the processes."""

    _configure_launcher = ModelParallelStrategy._configure_launcher


def build(method: str, busy_wait: bool | None):
    """``busy_wait``: GTC's waits poll (True), block (False) or decide by the cores (None). The emulated nodes
    share this host's cores, but each counts them as its own, so ``None`` polls with 4 ranks on 2 cores."""
    if method == "hsdp":
        return _NativeHSDP(data_parallel_size=NODES, tensor_parallel_size=DEVICES)
    if method == "nocomm":
        return _NoReplicate(replicate_size=NODES, shard_size=DEVICES, compress="gradient")
    compress = "update" if method == "gtc_hsdp_update" else "gradient"
    return GTCHSDPStrategy(replicate_size=NODES, shard_size=DEVICES, compress=compress, busy_wait=busy_wait)


class StepTimes(L.Callback):
    def __init__(self) -> None:
        self.seconds: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._started = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seconds.append(time.perf_counter() - self._started)


# The suite's transformer (106,272 parameters) and the long profile's (2.4 M: 3 blocks of width 256, order 2).
MODELS = {"small": {}, "large": {"d_model": 256, "layers": 3, "order": 2}}


def worker(method: str, steps: int, out: Path, busy_wait: bool | None = False, model_name: str = "small") -> None:
    """One rank of one run (the cluster tool starts 2 per node with Lightning's variables)."""
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    world = NODES * DEVICES
    model = ShardedTransformerLM(train_size=steps * 16 * world, seed=0, steps=steps, optimizer="adamw",
                                 **MODELS[model_name])  # fmt: skip
    times = StepTimes()
    trainer = L.Trainer(
        accelerator="cpu", devices=DEVICES, num_nodes=NODES, strategy=build(method, busy_wait), max_steps=steps, max_epochs=1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, callbacks=[times],
    )  # fmt: skip
    trainer.fit(model)
    state = getattr(trainer.strategy, "gtc_state", None)
    record = {"rank": trainer.global_rank, "step_seconds": times.seconds,
              "bytes_sent": state.totals["bytes_sent"] if state is not None else None}  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", nargs="+", default=["100mbit"], help="the link rate between the nodes, as tc reads it")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--steps", type=int, default=80, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the timing")
    parser.add_argument("--rounds", type=int, default=1, help="runs of every method at every rate, in turn")
    parser.add_argument("--out", type=Path, default=Path("exp/hsdp_cluster"))
    parser.add_argument("--busy-wait", choices=["block", "poll", "auto"], default="block",
                        help="GTC's waits: block (default: the emulated nodes share the host's cores), poll, or auto "
                             "(poll where a node has a core per rank, which each emulated node believes)")  # fmt: skip
    parser.add_argument("--model", choices=sorted(MODELS), default="small",
                        help="small: the suite's transformer (106 k parameters); large: the long profile's (2.4 M)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # a rank of one run: its method
    args = parser.parse_args(argv)
    if args.worker is not None:
        busy = {"block": False, "poll": True, "auto": None}[args.busy_wait]
        worker(args.worker, args.steps, args.out, busy, args.model)
        return []
    if args.warmup >= args.steps:
        parser.error(f"--warmup {args.warmup} leaves no timed step of --steps {args.steps}")
    from gtc_lightning.tools.cluster import Cluster

    rows = []
    with Cluster(nodes=NODES, rate=args.rates[0], devices_per_node=DEVICES) as cluster:
        for rate in args.rates:
            cluster.set_rate(rate)
            for round_ in range(args.rounds):
                for method in args.methods:
                    run_dir = args.out / rate / f"{method}-r{round_}"
                    command = [sys.executable, "-m", "gtc_lightning.tools.bench_hsdp_cluster", "--worker", method,
                               "--steps", str(args.steps), "--out", str(run_dir), "--busy-wait", args.busy_wait,
                               "--model", args.model]  # fmt: skip
                    result = cluster.run(command, out=run_dir, stream=False, timeout=1800)
                    if result.status != "ok":
                        raise RuntimeError(f"{method} at {rate}: {result.status}; the logs are in {run_dir}")
                    ranks = [json.loads((run_dir / f"rank{r}.json").read_text()) for r in range(NODES * DEVICES)]
                    timed = [s for r in ranks for s in r["step_seconds"][args.warmup :]]
                    sent = [r["bytes_sent"] for r in ranks if r["bytes_sent"] is not None]
                    rows.append({
                        "model": args.model, "rate": rate, "method": method, "round": round_, "steps": args.steps, "warmup": args.warmup,
                        "step_s": statistics.median(timed),
                        "link_bytes_per_step_node": result.total["tx_bytes"] / NODES / args.steps,
                        "strategy_bytes_per_step_rank": statistics.mean(sent) / args.steps if sent else None,
                    })  # fmt: skip
                    print(f"{rate} {method} round {round_}: {rows[-1]['step_s'] * 1e3:.1f} ms/step, "
                          f"{rows[-1]['link_bytes_per_step_node'] / 1e3:.1f} kB/step/node on the link", flush=True)  # fmt: skip
                    args.out.mkdir(parents=True, exist_ok=True)
                    (args.out / "results.json").write_text(json.dumps({"args": {**vars(args), "out": str(args.out)},
                                                                       "rows": rows}, indent=1))  # fmt: skip
    print(table(rows))
    return rows


def table(rows: list[dict]) -> str:
    """Per rate and method: the median over rounds of the median step, its ratio to ``nocomm``'s, and bytes."""
    lines = ["| rate | method | step ms (median of rounds) | vs nocomm | link kB/step/node | strategy kB/step/rank |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for rate in dict.fromkeys(r["rate"] for r in rows):
        base = [r["step_s"] for r in rows if r["rate"] == rate and r["method"] == "nocomm"]
        for method in dict.fromkeys(r["method"] for r in rows if r["rate"] == rate):
            mine = [r for r in rows if r["rate"] == rate and r["method"] == method]
            step = statistics.median(r["step_s"] for r in mine)
            ratio = f"{step / statistics.median(base):.2f}x" if base else "-"
            link = statistics.mean(r["link_bytes_per_step_node"] for r in mine) / 1e3
            own = mine[0]["strategy_bytes_per_step_rank"]
            lines.append(f"| {rate} | {method} | {1e3 * step:.1f} | {ratio} | {link:.1f} | "
                         f"{'-' if own is None else f'{own / 1e3:.2f}'} |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    main()
