"""``python -m gtc_lightning.tools.bench_step``: training-step time of each strategy, side by side.

Runs real Lightning training steps of an acoustic DNN (17 x 40 fbank windows in, sigmoid hidden
layers, softmax over pdf-ids) on random data with every strategy in turn, in the same processes
and the same run, round after round (``ddp``, ``gtc``, ... ``ddp``, ``gtc``, ...), so that a slow
moment of a noisy machine hits all of them. Per round and strategy it takes the median step time
(after warm-up steps); the table gives the median over rounds and each strategy's ratio to
``ddp`` computed round by round (median, min-max).

Strategies: ``ddp`` (fp32 all-reduce), ``ddp_bf16`` (bf16 all-reduce), ``gtc`` (Strom's gradient
mode at the fixed ``--tau`` in 32-bit words, ``GTCStrategy(compress="gradient", coding="none")``, as
every ``gtc_*`` here but ``gtc_update``, not GTCStrategy's defaults; its exchange as ``--exchange`` says),
``gtc_update`` (GTCStrategy's defaults as of 2026-11-28, asked for explicitly: each rank's optimizer steps
on its own gradient and GTC compresses the step it made, a per-rank tau at density 1e-2, Golomb-Rice
coded; ``gtc_update_blocking``: the same with ``busy_wait=False``, every collective waited for by
blocking instead of polling; ``gtc_update_twopass``: the same through the update mode's reference
passes, ``update.ONE_PASS = False``: the fold and the emission one after the other, a dense decode),
``powersgd_r1`` / ``powersgd_r4`` (torch's PowerSGD hook at rank 1 and 4, built as the model suite
builds them; the bytes of every all-reduce the hook issues are counted), ``gtc_rice`` (the same,
Golomb-Rice coded), ``gtc_alltoall`` / ``gtc_allgather`` (the two word exchanges, uneven
messages or padded to the longest), ``gtc_stale`` (one-step-stale GTC: the word exchange overlaps the next
step), ``gtc_ddpbuckets`` (GTC in DDP's default 25 MB buckets, one threshold pass each, instead of
GTCStrategy's default single bucket), ``dpsgd`` (ring-neighbour parameter averaging, overlapping the
forward and backward passes) and ``nocomm`` (DDP sending nothing: the compute-only step GTC should
come close to).

Models: ``recipe`` (5 x 512, 150 outputs: 1.48 M weights, the recipe's CPU model) and ``strom``
(5 x 1536, 2700 outputs: 14.6 M weights, Strom 2015's DNN), or ``LxH:K``.

On one machine it forks ``--world`` ranks (gloo on loopback). Under a launcher that sets
``MASTER_ADDR``, ``MASTER_PORT``, ``NODE_RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE`` (e.g.
``python -m gtc_lightning.tools.cluster``) it runs as one of those ranks with ``--num-nodes``.

Example::

    python -m gtc_lightning.tools.bench_step --models recipe strom --rounds 3 --steps 20
    python -m gtc_lightning.tools.bench_step --models strom --strategies gtc_update --rounds 1 --profile exp/prof
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import socket
import statistics
import time
from pathlib import Path

STRATEGIES = (
    "ddp", "ddp_bf16", "gtc", "gtc_alltoall", "gtc_allgather", "gtc_rice", "gtc_stale", "gtc_ddpbuckets", "gtc_update",
    "gtc_update_blocking", "gtc_update_twopass", "powersgd_r1", "powersgd_r4", "dpsgd", "nocomm",
)
# gtc_update: GTCStrategy()'s defaults since 2026-11-28 01:12 UTC (hook.DEFAULT_DENSITY 1e-2; 3e-3 before),
# pinned so that its rows keep their meaning if the defaults move again
GTC_UPDATE = {"compress": "update", "tau": "auto", "target_density": 1e-2, "coding": "rice"}
# PowerSGD as the model suite builds it: rank r, start_powerSGD_iter=2 (the fewest dense steps torch allows
# with error feedback), PowerSGDState's other defaults; and in one DDP bucket (GTCStrategy's default cap),
# because on gloo torch's hook deadlocks with two buckets in flight: each bucket's ``then`` callback
# waits for its next all-reduce on one of gloo's two worker threads, and two such waits leave no thread
# to run the all-reduces (the model suite's models, under 1 MB, have one bucket anyway)
POWERSGD_RANKS = {"powersgd_r1": 1, "powersgd_r4": 4}
POWERSGD_START_ITER = 2
DDP_BUCKET_CAP_MB = 25  # gtc_ddpbuckets: DDP's own default bucket cap (GTCStrategy's is one bucket)
MODELS = {"recipe": (5, 512, 150), "strom": (5, 1536, 2700)}
INPUT_DIM = 17 * 40


def parse_model(text: str) -> tuple[int, int, int]:
    """``recipe``, ``strom`` or ``LxH:K`` -> (layers, hidden units, outputs)."""
    if text in MODELS:
        return MODELS[text]
    match = re.fullmatch(r"(\d+)x(\d+):(\d+)", text)
    if not match:
        raise ValueError(f"model {text!r}: use recipe, strom or LAYERSxHIDDEN:OUTPUTS such as 5x1024:2000")
    return tuple(int(x) for x in match.groups())


def make_dnn(model_spec: tuple[int, int, int], lr: float):
    """The benchmarks' acoustic DNN as a LightningModule: ``INPUT_DIM`` in, ``layers`` sigmoid layers of
    ``hidden`` units, ``outputs`` logits; cross-entropy, plain SGD at ``lr``; seeded (same on every rank)."""
    import lightning as L
    import torch

    layers, hidden, outputs = model_spec

    class DNN(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            dims = [INPUT_DIM] + [hidden] * layers
            body = []
            for a, b in itertools.pairwise(dims):
                body += [torch.nn.Linear(a, b), torch.nn.Sigmoid()]
            self.net = torch.nn.Sequential(*body, torch.nn.Linear(hidden, outputs))

        def training_step(self, batch, batch_idx):
            return torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=lr)

    return DNN()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def strategy_totals(strategy, callbacks=()) -> dict[str, dict]:
    """Every ``*_stats`` property's step count and numeric running totals (``gtc_stats``,
    ``sync_stats``, ...) of ``strategy`` and of ``callbacks`` (``powersgd_stats`` of
    :func:`powersgd_meter`'s), copied: ``{name: {"step": int, "total": {key: float}}}``."""
    out = {}
    for owner in (strategy, *callbacks):
        for name in dir(type(owner)):
            if name.endswith("_stats") and isinstance(getattr(type(owner), name, None), property):
                stats = getattr(owner, name)
                total = stats.get("total") if isinstance(stats, dict) else None
                if total:
                    numbers = {k: float(v) for k, v in total.items() if isinstance(v, (int, float))}
                    out[name] = {"step": int(stats.get("step", 0)), "total": numbers}
    return out


def powersgd_meter():
    """A callback that records every all-reduce torch's PowerSGD hook issues during ``fit`` (P, Q and the
    uncompressed tensors of each bucket; the dense warm-up's through ``default_hooks``), step by step, as
    the model suite counts them: by standing in for ``torch.distributed`` in the hook's modules.

    Its ``powersgd_stats`` (``{"step", "total": {"bytes_sent", "allreduces"}}``) count the bytes each rank
    puts on the wire in a ring all-reduce, ``2 (W-1)/W`` of each tensor's; ``sizes`` holds each finished
    step's all-reduces as ``[numel, element bytes]`` in the order this rank issued them.
    """
    import lightning as L
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    from gtc_lightning.algorithms.common import allreduce_bytes

    class Recording:
        """``torch.distributed`` as the hook modules see it, with ``all_reduce`` recorded."""

        def __init__(self, meter) -> None:
            self._meter = meter

        def __getattr__(self, name):
            return getattr(dist, name)

        def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
            world = dist.get_world_size(group)
            # list.append: atomic, also from the gloo thread that runs the hook's later ``then`` steps
            self._meter._current.append((tensor.numel(), tensor.element_size(), world))
            return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)

    class PowerSGDMeter(L.Callback):
        def __init__(self) -> None:
            self.sizes: list[list[tuple[int, int]]] = []
            self._current: list[tuple[int, int, int]] = []
            self._bytes = 0
            self._count = 0
            self._saved = None

        @property
        def powersgd_stats(self) -> dict:
            return {"step": len(self.sizes), "total": {"bytes_sent": self._bytes, "allreduces": self._count}}

        def setup(self, trainer, pl_module, stage):
            self._saved = (powerSGD_hook.dist, default_hooks.dist)
            powerSGD_hook.dist = default_hooks.dist = Recording(self)

        def teardown(self, trainer, pl_module, stage):
            if self._saved is not None:
                powerSGD_hook.dist, default_hooks.dist = self._saved
                self._saved = None

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            # DDP waited for every bucket's future (the Q all-reduce last) before backward returned
            step, self._current = self._current, []
            self._bytes += sum(allreduce_bytes(n, world, size) for n, size, world in step)
            self._count += len(step)
            self.sizes.append([(n, size) for n, size, _ in step])

    return PowerSGDMeter()


def make_strategy(name: str, tau: float, exchange: str):
    import inspect

    from lightning.pytorch.strategies import DDPStrategy

    from gtc_lightning import GTCStrategy
    from gtc_lightning.strategies.baselines import BF16AllReduceStrategy, NoCommStrategy, PowerSGDStrategy
    from gtc_lightning.strategies.gtc import BUCKET_CAP_MB

    if name == "ddp":
        return DDPStrategy()
    if name == "ddp_bf16":
        return BF16AllReduceStrategy()
    if name == "nocomm":
        return NoCommStrategy()
    if name in POWERSGD_RANKS:
        return PowerSGDStrategy(
            matrix_approximation_rank=POWERSGD_RANKS[name], start_powerSGD_iter=POWERSGD_START_ITER,
            bucket_cap_mb=BUCKET_CAP_MB,
        )
    if name == "dpsgd":
        from gtc_lightning import DPSGDStrategy

        return DPSGDStrategy(average_at_end=False)
    if name == "gtc_update":  # the defaults, asked for: no fixed tau (``tau`` is not used)
        return GTCStrategy(exchange=exchange, **GTC_UPDATE)
    if name == "gtc_update_blocking":  # the same, each collective waited for by blocking, as before busy_wait
        return GTCStrategy(exchange=exchange, busy_wait=False, **GTC_UPDATE)
    if name == "gtc_update_twopass":  # the same through the reference passes (_segment sets update.ONE_PASS)
        return GTCStrategy(exchange=exchange, **GTC_UPDATE)
    # Every GTC variant is Strom's gradient mode at the fixed ``tau`` in 32-bit words (gtc_rice: Golomb-Rice
    # coded), what the published timings measured, whatever GTCStrategy's defaults (automatic tau, Rice
    # coding, the update mode). These three go only where the strategy has them, so that the same command
    # can time an older GTCStrategy (without them: the gradient mode in 32-bit words) for a before/after
    # comparison.
    known = inspect.signature(GTCStrategy).parameters
    measured = (("exchange", exchange), ("compress", "gradient"), ("coding", "none"))
    options: dict = {key: value for key, value in measured if key in known}
    if name == "gtc_stale":
        options["stale"] = True
    elif name in ("gtc_alltoall", "gtc_allgather"):
        options["exchange"] = name.removeprefix("gtc_")
    elif name == "gtc_ddpbuckets":
        options["bucket_cap_mb"] = DDP_BUCKET_CAP_MB
    elif name == "gtc_rice":
        options["coding"] = "rice"
    elif name != "gtc":
        raise ValueError(f"unknown strategy {name!r}; choose from {STRATEGIES}")
    return GTCStrategy(tau=tau, **options)


def segment_warmup(strategy_name: str, warmup: int) -> int:
    """Untimed steps of a segment: ``warmup``, and for PowerSGD at least its plain all-reduce steps."""
    return max(warmup, POWERSGD_START_ITER) if strategy_name in POWERSGD_RANKS else warmup


def _segment(args, model_spec, strategy_name: str, devices: int, num_nodes: int, seed: int,
             callbacks=(), strategy=None) -> dict:
    """One ``fit`` of ``warmup + steps`` steps; returns per-step seconds and GTC statistics.

    ``callbacks`` join the Trainer's after the step clock; ``strategy`` (an instance or a registered
    name) replaces the one ``strategy_name`` would build (``gtc_lightning.tools.bench_cluster`` uses both).
    """
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    outputs = model_spec[2]
    warmup = segment_warmup(strategy_name, args.warmup)
    total = warmup + args.steps
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(total * args.batch, INPUT_DIM, generator=g)
    y = torch.randint(0, outputs, (total * args.batch,), generator=g)

    class Clock(L.Callback):
        def __init__(self):
            self.marks: list[float] = []
            self.after_warmup: dict = {}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if pl_module.device.type == "cuda":
                torch.cuda.synchronize(pl_module.device)  # the step's kernels finished, not just queued
            self.marks.append(time.perf_counter())
            if len(self.marks) == warmup:
                self.after_warmup = strategy_totals(trainer.strategy, trainer.callbacks)

    class Profile(L.Callback):
        """``--profile DIR``: torch's profiler over the timed steps; rank 0's table of the host's ops (by
        their own time) into ``DIR/<model>_<strategy>_round<r>.txt``."""

        def __init__(self, path: Path) -> None:
            self.path, self.profiler = path, None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == warmup and self.profiler is None:
                activities = [torch.profiler.ProfilerActivity.CPU]
                if pl_module.device.type == "cuda":
                    activities.append(torch.profiler.ProfilerActivity.CUDA)
                self.profiler = torch.profiler.profile(activities=activities)
                self.profiler.__enter__()

        def on_train_end(self, trainer, pl_module):
            if self.profiler is None:
                return
            self.profiler.__exit__(None, None, None)
            if trainer.global_rank == 0:
                table = self.profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self.path.write_text(f"{args.steps} profiled steps (their times include the profiler's own)\n{table}\n")

    from gtc_lightning.strategies.baselines import PowerSGDStrategy

    if getattr(args, "profile", None):
        name = f"{'x'.join(map(str, model_spec))}_{strategy_name}_round{seed}.txt"
        callbacks = [*callbacks, Profile(Path(args.profile) / name)]
    clock = Clock()
    strategy = strategy or make_strategy(strategy_name, args.tau, args.exchange)
    try:  # the update mode's one-pass step, or its reference passes (gtc_update_twopass)
        from gtc_lightning.algorithms.gtc import update as update_mode

        update_mode.ONE_PASS = strategy_name != "gtc_update_twopass"
    except ImportError:  # an older package timed for a before/after comparison
        pass
    # PowerSGD's all-reduces, recorded before the clock and the callbacks read a step's totals
    meters = [powersgd_meter()] if isinstance(strategy, PowerSGDStrategy) else []
    trainer = L.Trainer(
        accelerator=getattr(args, "accelerator", "cpu"), precision=getattr(args, "precision", "32-true"), devices=devices, num_nodes=num_nodes, strategy=strategy,
        max_steps=total, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[*meters, clock, *callbacks], use_distributed_sampler=False,
    )  # fmt: skip
    # One item per batch, sliced rather than collated from single frames: on a GPU, collating 1024
    # frames one by one took longer than the step's compute (H100: ~7 of ~15 ms per step).
    batches = [(x[i : i + args.batch], y[i : i + args.batch]) for i in range(0, total * args.batch, args.batch)]
    data = DataLoader(batches, batch_size=None, shuffle=False)
    trainer.fit(make_dnn(model_spec, args.lr), data)
    steps = [b - a for a, b in zip(clock.marks[warmup - 1 :], clock.marks[warmup:])]
    out = {"step_s": statistics.median(steps), "steps": steps}
    # Statistics per timed step: the totals at the end less those after the warm-up (which hold the
    # first step's kernel compilation on a GPU).
    end, start = strategy_totals(trainer.strategy, trainer.callbacks), clock.after_warmup
    timed = {}
    for name, stats in end.items():
        before = start.get(name, {"step": 0, "total": {}})
        n = max(stats["step"] - before["step"], 1)
        timed[name] = (n, {k: v - before["total"].get(k, 0) for k, v in stats["total"].items()})
    if "gtc_stats" in timed:
        n, total_stats = timed["gtc_stats"]
        keys = ("compress_s", "exchange_s", "decompress_s", "bytes_sent", "words")
        out["gtc"] = {key: total_stats.get(key, 0.0) / n for key in keys}
        out["gtc"]["modes"] = {k: total_stats.get(f"{k}_steps", 0) for k in ("sparse", "dense")}
        state = getattr(trainer.strategy, "gtc_state", None)
        out["gtc"]["buckets"] = len(getattr(state, "_keys", None) or []) or None  # DDP buckets per step
    if "sync_stats" in timed:
        n, total_stats = timed["sync_stats"]
        out["sync"] = {key: total_stats[key] / n for key in ("bytes_sent", "exchange_s")}
    if "powersgd_stats" in timed:
        n, total_stats = timed["powersgd_stats"]
        out["powersgd"] = {key: total_stats[key] / n for key in ("bytes_sent", "allreduces")}
        out["powersgd"]["sizes"] = meters[0].sizes[-1]  # the last step's all-reduces, [numel, element bytes]
    return out


def worker(args, devices: int, num_nodes: int) -> None:
    """One rank: every round runs every strategy on every model; rank 0 writes the results."""
    import torch

    # Without OMP_NUM_THREADS, Lightning resets torch's threads to cores / local processes at setup.
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    torch.set_num_threads(args.threads)
    torch.set_float32_matmul_precision(getattr(args, "matmul_precision", "highest"))
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("gtc_lightning").setLevel(logging.WARNING)
    results: dict = {}
    for model in args.models:
        spec = parse_model(model)
        for r in range(args.rounds):
            for name in args.strategies:
                seg = _segment(args, spec, name, devices, num_nodes, seed=r)
                results.setdefault(model, {}).setdefault(name, []).append(seg)
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    if dist.is_initialized():
        dist.destroy_process_group()


def _local_rank_main(local_rank: int, args, port: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODE_RANK="0", LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(args.world),
    )  # fmt: skip
    worker(args, devices=args.world, num_nodes=1)


def summarize(data: dict) -> str:
    """The side-by-side table: median step time, ratio to ddp round by round, GTC's breakdown."""
    args, results = data["args"], data["results"]
    world = args["world"] if args.get("num_nodes", 1) == 1 else args["num_nodes"]
    lines = [
        (f"{world} ranks, {args['batch']} frames per rank and step, {args['rounds']} rounds x {args['steps']} steps "
        f"(after {args['warmup']} warm-up steps), {args['threads']} thread(s) per rank, tau={args['tau']:g}, "
        f"{args.get('accelerator', 'cpu')}, precision {args.get('precision', '32-true')}, float32 matmul "
        f"{args.get('matmul_precision', 'highest')}"),
        "",
        ("| model | weights | strategy | step ms | frames/s | x ddp (median, min-max) | compress / exchange / decode ms "
        "| bytes sent/step | vs fp32 / bf16 all-reduce |"),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for model, per_strategy in results.items():
        layers, hidden, outputs = parse_model(model)
        weights = (INPUT_DIM + 1) * hidden + (layers - 1) * (hidden + 1) * hidden + (hidden + 1) * outputs
        base = [seg["step_s"] for seg in per_strategy.get("ddp", [])]
        for name, segs in per_strategy.items():
            step = statistics.median(seg["step_s"] for seg in segs)
            ratios = [seg["step_s"] / b for seg, b in zip(segs, base)] if base else []
            ratio = f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})" if ratios else "-"
            breakdown, sent, vs = "-", "-", "-"
            fp32 = 2 * (world - 1) / world * 4 * weights  # 0 for one rank: no ratios then
            if fp32 and name in ("ddp", "ddp_bf16"):
                sent_bytes = fp32 if name == "ddp" else fp32 / 2
                sent, vs = f"{sent_bytes:,.0f}", f"{fp32 / sent_bytes:.1f}x / {fp32 / 2 / sent_bytes:.1f}x"
            powersgd = [seg["powersgd"] for seg in segs if "powersgd" in seg]
            if powersgd:
                sent_bytes = statistics.mean(p["bytes_sent"] for p in powersgd)
                sent = f"{sent_bytes:,.0f}"
                vs = f"{fp32 / sent_bytes:.1f}x / {fp32 / 2 / sent_bytes:.1f}x" if fp32 and sent_bytes else "-"
            sync = [seg["sync"] for seg in segs if "sync" in seg]
            if sync:
                sent_bytes = statistics.mean(s["bytes_sent"] for s in sync)
                breakdown = f"- / {1e3 * statistics.mean(s['exchange_s'] for s in sync):.1f} / -"
                sent = f"{sent_bytes:,.0f}"
                vs = f"{fp32 / sent_bytes:.1f}x / {fp32 / 2 / sent_bytes:.1f}x" if fp32 and sent_bytes else "-"
            gtc = [seg["gtc"] for seg in segs if "gtc" in seg]
            if gtc:
                mean = {k: statistics.mean(g[k] for g in gtc) for k in ("compress_s", "exchange_s", "decompress_s", "bytes_sent")}
                breakdown = " / ".join(f"{1e3 * mean[k]:.1f}" for k in ("compress_s", "exchange_s", "decompress_s"))
                sent = f"{mean['bytes_sent']:,.0f}"
                vs = f"{fp32 / mean['bytes_sent']:.0f}x / {fp32 / 2 / mean['bytes_sent']:.0f}x" if fp32 else "-"
                dense = sum(g["modes"]["dense"] for g in gtc)
                if dense:
                    vs += f" ({dense} dense steps)"
            frames = args["batch"] * world / step
            lines.append(
                f"| {model} | {weights / 1e6:.2f} M | {name} | {1e3 * step:.1f} | {frames:,.0f} | {ratio} | {breakdown} "
                f"| {sent} | {vs} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["recipe", "strom"], help="recipe, strom or LxH:K")
    parser.add_argument(
        "--strategies", nargs="+", default=["ddp", "ddp_bf16", "gtc", "nocomm"], choices=STRATEGIES
    )
    parser.add_argument("--world", type=int, default=2, help="ranks to fork on this machine")
    parser.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu"],
                        help="gpu: one GPU per rank (NCCL), so --world at most the visible GPUs")
    parser.add_argument("--num-nodes", type=int, default=1,
                        help="under an external launcher: nodes (one rank per node); the environment gives the rank")
    parser.add_argument("--precision", default="32-true", help="Lightning's Trainer precision, e.g. bf16-mixed")
    parser.add_argument("--matmul-precision", default="highest", choices=["highest", "high", "medium"],
                        help="torch.set_float32_matmul_precision for float32 matrix products (high: TF32 on GPUs)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds over all strategies")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round and strategy")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    parser.add_argument("--batch", type=int, default=256, help="frames per rank and step")
    parser.add_argument("--tau", type=float, default=5e-3, help="GTC's threshold")
    parser.add_argument("--exchange", default="auto", choices=["auto", "alltoall", "allgather"])
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--threads", type=int, default=0, help="torch threads per rank; 0: cores / ranks on this node")
    parser.add_argument("--out", default="exp/bench_step/results.json")
    parser.add_argument("--profile", metavar="DIR", help="also profile the timed steps with torch.profiler: rank "
                        "0's table of host ops per model, strategy and round into DIR (the step times then "
                        "include the profiler's own: time without it)")
    args = parser.parse_args(argv)
    if args.warmup < 1 or args.steps < 2 or args.rounds < 1:
        parser.error(f"need --warmup >= 1, --steps >= 2, --rounds >= 1; got {args.warmup}, {args.steps}, {args.rounds}")
    for model in args.models:
        parse_model(model)
    if args.accelerator == "gpu":
        from lightning.fabric.accelerators.cuda import num_cuda_devices  # (NVML: CUDA stays fork-safe)

        found = num_cuda_devices()
        if found < (1 if "LOCAL_RANK" in os.environ else args.world):
            parser.error(f"--accelerator gpu --world {args.world} needs {args.world} visible GPUs, found {found}; "
                         "lower --world")
    external = "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ
    per_node = 1 if external else args.world
    if not args.threads:
        args.threads = max(1, (os.cpu_count() or 1) // per_node)
    print(
        f"bench_step: {args.world if not external else os.environ['WORLD_SIZE']} ranks, models {args.models}, "
        f"strategies {args.strategies}, {args.rounds} rounds x ({args.warmup} + {args.steps}) steps -> {args.out}",
        flush=True,
    )
    if external:
        worker(args, devices=1, num_nodes=args.num_nodes)
        if os.environ.get("NODE_RANK", "0") != "0":
            return
    else:
        import torch.multiprocessing as mp

        mp.start_processes(_local_rank_main, args=(args, free_port()), nprocs=args.world, start_method="fork")
    print(summarize(json.loads(Path(args.out).read_text())))


if __name__ == "__main__":
    main()
