"""``python -m gtc_lightning.tools.bench_cluster``: every strategy's step on an emulated commodity network.
Long file: one benchmark with its runs, the collectives it replays, the calibration of the scaling model
and its report (the emulator: cluster.py; the model: scaling.py).

For each model, number of workers (one per emulated node of :mod:`gtc_lightning.tools.cluster`; 1 worker
is the single-device baseline, no network) and link rate, one cluster run trains every strategy in
turn in the same processes, round after round (``ddp``, ``ddp_bf16``, ``gtc``, ..., ``nocomm``,
``ddp``, ...), with :func:`gtc_lightning.tools.bench_step._segment`'s Lightning steps of the acoustic DNN
on random frames. Then, in the same processes, it replays each strategy's collectives with the
message sizes just measured and no compute. What it separates, per strategy:

- **step**: mean seconds per optimizer step over the timed steps (median over rounds);
- **compute**: the step of ``nocomm`` (DDP sending nothing) in the same processes and rounds: with
  4 workers on 2 cores the compute itself is slowed by sharing the cores, and this measures it so;
- **comm** = step - compute: what communicating adds to a step (including a strategy's own work on
  the gradient, such as GTC's thresholding and decoding, which the hook times apart as ``codec``);
- **network alone**: the replay's seconds per step (collectives only, each step after a pause that
  lets the link's token bucket refill as compute would);
- **wire bytes**: what each node's veth counted between the first and the last timed step, read by
  the rank itself from ``/sys/class/net/<dev>/statistics`` inside its namespace (the counters the
  Cluster API reads), divided by the steps. The window starts after the warm-up steps, so start-up
  traffic (rendezvous, DDP's parameter broadcast, Lightning's barriers) is outside it by
  construction; the Cluster API's count for the whole run is recorded beside it.

Next to the wire bytes stands what the strategy itself counts (its hook's ``bytes_sent``; for DDP
the ring formula ``2 (W-1)/W · 4n``; for PowerSGD the ring bytes of every all-reduce its hook issued,
recorded by :func:`gtc_lightning.tools.bench_step.powersgd_meter`, whose sizes the replay replays). GTC's
residuals at a fixed tau start from a triangular distribution on (-tau, tau), near the steady state of
thresholding, so that a few steps measure the message size of a long run instead of the first steps'
near-empty messages (``--residual-start zero`` turns it off); ``gtc_update`` (GTCStrategy's defaults:
the optimizer's step, automatic per-rank tau, Rice coding) sends its target density from the first
step. The scaling model (:mod:`gtc_lightning.tools.scaling`) is calibrated on the replays and its step
predictions compared with the measured steps.

Example (the README's run; needs root for the namespaces)::

    python -m gtc_lightning.tools.bench_cluster --out exp/bench_cluster
    python -m gtc_lightning.tools.bench_cluster --models recipe --workers 2 --rates 1gbit --steps 3 --rounds 1

Writes ``<out>/results.json`` (schema ``gtc_lightning.bench_cluster/1``: ``args``, ``configs`` with
per-configuration load averages and cluster results, ``rows`` with one record per model, workers,
rate and strategy, ``model`` with the calibrated network parameters and the predictions),
``<out>/table.md`` and ``<out>/bench_cluster.png``; every configuration's node logs, ``cluster.json``
and per-rank ``rank<k>.json`` under ``<out>/<model>/w<W>/<rate>/``.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import itertools
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from gtc_lightning.tools import scaling

DEFAULT_STRATEGIES = ("ddp", "ddp_bf16", "powersgd_r1", "powersgd_r4", "gtc", "gtc_update")
# one word exchange per step
GTC_LIKE = ("gtc", "gtc_alltoall", "gtc_allgather", "gtc_stale", "gtc_rice", "gtc_update")
OPTIONAL_STRATEGIES = ("gtc_stale", "ma", "bmuf", "bmuf_gtc", "dpsgd", "adpsgd")  # joined when they exist
DEFAULT_TAU = {"recipe": 2e-2, "strom": 1e-2}  # ~30x the per-rank gradient RMS on the benchmark's data
_COMPUTE_FLOPS = 5e10  # about what one core of this host sustains on these layers; only to choose step counts


# ------------------------------------------------------------------------------------ node side


def _counters(interface: str | None) -> dict[str, int]:
    if not interface:
        return {}
    base = Path("/sys/class/net") / interface / "statistics"
    return {
        key: int((base / key).read_text()) for key in ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets")
    }


def _make_callbacks(plan: dict, warmup: int, steps: int):
    import lightning as L
    import torch

    from gtc_lightning.tools import bench_step

    class WireMeter(L.Callback):
        """Veth counters, time and the strategy's own statistics at the window's two ends."""

        def __init__(self) -> None:
            self.ends: list[dict] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx + 1 in (warmup, warmup + steps):
                totals = bench_step.strategy_totals(trainer.strategy, trainer.callbacks)
                self.ends.append(
                    {
                        "t": time.perf_counter(),
                        "wire": _counters(plan["interface"]),
                        "stats": {k: v["total"] for k, v in totals.items()},
                    }
                )

    class ResidualStart(L.Callback):
        """GTC residuals drawn from the triangular distribution on (-tau, tau), the stationary one of
        a zero-mean random walk that gives back tau each time it leaves the interval. Only at a fixed
        tau: with automatic tau (``gtc_update``) each rank's threshold is its residual's quantile at the
        target density, which sets the message size from the first step on."""

        def on_train_start(self, trainer, pl_module):
            state = getattr(trainer.strategy, "gtc_state", None)
            if state is None or plan["residual_start"] == "zero" or state.target_density is not None:
                return
            n = state.residual_vector().numel()
            g = torch.Generator().manual_seed(1000 + trainer.global_rank)
            tri = (torch.rand(n, generator=g) - torch.rand(n, generator=g)) * state.tau
            state.load_residual_vector(tri)

    class SlowRank(L.Callback):
        """A straggler's compute: this rank sleeps ``slow_sleep_s`` before every training batch."""

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_rank == plan.get("slow_rank"):
                time.sleep(plan["slow_sleep_s"])

    return WireMeter(), ResidualStart(), SlowRank()


def build_strategy(name: str, tau: float, options: dict[str, Any]):
    """``single`` (no DDP), a name :mod:`gtc_lightning.tools.bench_step` knows, or a registered one. GTC is
    Strom's gradient mode at the fixed ``tau`` in 32-bit words (what the published runs measured), also
    under a registered name with options (``gtc:exchange=allgather``), unless they say otherwise."""
    from gtc_lightning.tools import bench_step

    if name == "single":
        return "auto"
    if not options:
        try:
            return bench_step.make_strategy(name, tau, "auto")
        except (ValueError, ImportError):
            pass
    from lightning.pytorch.strategies import StrategyRegistry

    import gtc_lightning  # (registers the project's names)

    if name not in StrategyRegistry:
        raise ValueError(
            f"strategy {name!r} is neither in bench_step.STRATEGIES {bench_step.STRATEGIES} nor a "
            f"registered Lightning strategy"
        )
    entry = StrategyRegistry[name]
    cls, params = entry["strategy"], dict(entry["init_params"])
    if "tau" in inspect.signature(cls).parameters:
        params["tau"] = tau
    if issubclass(cls, gtc_lightning.GTCStrategy):  # as bench_step's gtc, unless the options say otherwise
        params.setdefault("compress", "gradient")
        params.setdefault("coding", "none")
    params.update(options)
    return cls(**params)


def _window(meter, steps: int) -> dict:
    if len(meter.ends) != 2:
        return {}
    (a, b) = meter.ends
    out = {
        "window_s": b["t"] - a["t"],
        "wire": {k: b["wire"][k] - a["wire"][k] for k in b["wire"]},
        "hook": {},
    }
    for name, total in b["stats"].items():
        before = a["stats"].get(name, {})
        out["hook"][name] = {k: v - before.get(k, 0.0) for k, v in total.items()}
    out["step_s"] = out["window_s"] / steps
    return out


def _measure_gradient_rms(plan: dict, spec: tuple[int, int, int]) -> float:
    """RMS of one rank's mean-loss gradient at the initial model on the benchmark's random frames."""
    import torch

    layers, hidden, outputs = spec
    torch.manual_seed(0)
    dims = [680] + [hidden] * layers
    body = []
    for a, b in itertools.pairwise(dims):
        body += [torch.nn.Linear(a, b), torch.nn.Sigmoid()]
    net = torch.nn.Sequential(*body, torch.nn.Linear(hidden, outputs))
    g = torch.Generator().manual_seed(0)
    x, y = (
        torch.randn(plan["batch"], 680, generator=g),
        torch.randint(0, outputs, (plan["batch"],), generator=g),
    )
    torch.nn.functional.cross_entropy(net(x), y).backward()
    grads = torch.cat([p.grad.flatten() for p in net.parameters()])
    return float(grads.pow(2).mean().sqrt())


def node_worker(plan_path: str) -> None:
    """One rank of one configuration: training segments, then the replay; writes ``rank<k>.json``."""
    import logging

    import torch

    from gtc_lightning.tools import bench_step

    plan = json.loads(Path(plan_path).read_text())
    # Lightning sets torch's threads to cores / local processes (2 here, with one process per node)
    # unless OMP_NUM_THREADS is set: 2 or 4 nodes x 2 spinning OpenMP threads on 2 cores made every step
    # 3-10x slower, compute included.
    os.environ["OMP_NUM_THREADS"] = str(plan["threads"])
    torch.set_num_threads(plan["threads"])
    for name in ("lightning.pytorch", "lightning.fabric", "gtc_lightning"):
        logging.getLogger(name).setLevel(logging.WARNING)
    world, spec = plan["world"], tuple(plan["spec"])
    plan["interface"] = os.environ.get("GLOO_SOCKET_IFNAME") if world > 1 else None
    rank = int(os.environ.get("RANK", "0")) if world > 1 else 0
    segments: dict[str, list] = {}
    facts: dict[str, dict] = {}
    if world > 1:
        # Untimed first: the rendezvous and DDP's first all-reduces, on a tiny model.
        warm = argparse.Namespace(
            warmup=1, steps=12, batch=16, lr=plan["lr"], tau=plan["tau"], exchange="auto"
        )
        bench_step._segment(warm, (2, 16, 8), "ddp", devices=1, num_nodes=world, seed=0)
    for r in range(plan["rounds"]):
        for entry in plan["strategies"]:
            name = entry["label"]
            strategy = build_strategy(entry["name"], plan["tau"], entry["options"])
            steps = entry["steps"]
            period = getattr(strategy, "period", None)
            if isinstance(period, int) and period > 1:
                steps = math.ceil(steps / period) * period  # whole periods only
            # PowerSGD's window opens after its plain all-reduce steps
            warmup = bench_step.segment_warmup(entry["name"], plan["warmup"])
            args = argparse.Namespace(
                warmup=warmup,
                steps=steps,
                batch=plan["batch"],
                lr=plan["lr"],
                tau=plan["tau"],
                exchange="auto",
            )
            meter, start, slow = _make_callbacks(plan, warmup, steps)
            seg = bench_step._segment(
                args,
                spec,
                entry["name"],
                devices=1,
                num_nodes=world,
                seed=r,
                callbacks=[meter, start, slow],
                strategy=strategy,
            )
            window = _window(meter, steps)
            window.update(steps=steps, round=r, step_times=seg["steps"])
            segments.setdefault(name, []).append(window)
            facts[name] = {
                key: getattr(strategy, key)
                for key in ("period", "group_size", "tau")
                if isinstance(getattr(strategy, key, None), (int, float))
            }
            if "powersgd" in seg:  # bytes of each all-reduce of a step, in the order this rank issued them
                facts[name]["allreduces"] = [n * size for n, size in seg["powersgd"]["sizes"]]
            if rank == 0:
                print(
                    f"[bench_cluster] round {r} {name}: {steps} steps, {window.get('step_s', float('nan')):.3f} s/step",
                    flush=True,
                )
    replays = replay(plan, segments, facts) if world > 1 else {}
    out = {
        "rank": rank,
        "world": world,
        "interface": plan["interface"],
        "segments": segments,
        "facts": facts,
        "replay": replays,
        "gradient_rms": _measure_gradient_rms(plan, spec) if rank == 0 else None,
    }
    Path(plan["out"], f"rank{rank}.json").write_text(json.dumps(out, indent=1))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _hook_words(windows: list[dict]) -> float:
    """Words this rank sent per step (GTC's statistics), over all rounds."""
    words = steps = 0.0
    for w in windows:
        gtc = w.get("hook", {}).get("gtc_stats")
        if gtc:
            words += gtc.get("words", 0.0)
            steps += w["steps"]
    return words / steps if steps else 0.0


def _word_bytes(windows: list[dict], world: int) -> float:
    """Bytes per word as GTC sent them (4; fewer with an entropy coding): its bytes_sent, less the
    headers, per word and peer."""
    sent = words = steps = 0.0
    for w in windows:
        gtc = w.get("hook", {}).get("gtc_stats")
        if gtc:
            sent, words, steps = (
                sent + gtc.get("bytes_sent", 0.0),
                words + gtc.get("words", 0.0),
                steps + w["steps"],
            )
    if not words or world < 2:
        return scaling.WORD_BYTES
    return (sent - steps * (world - 1) * scaling.HEADER_BYTES) / ((world - 1) * words)


def replay(plan: dict, segments: dict, facts: dict) -> dict:
    """Each strategy's collectives (:func:`gtc_lightning.tools.scaling.collectives`) with the measured word
    counts and no compute, ``replay_steps`` steps (whole periods), each after a pause."""
    import torch
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    numel = parameter_count(tuple(plan["spec"]))
    groups_cache: dict[tuple, Any] = {}

    def group_of(ranks: tuple[int, ...]):
        if len(ranks) == world:
            return None
        if ranks not in groups_cache:
            groups_cache[ranks] = dist.new_group(list(ranks))
        return groups_cache[ranks]

    out = {}
    for entry in plan["strategies"]:
        name, base = entry["label"], entry["name"]
        if base in ("nocomm", "single"):
            continue
        mine = segments.get(name, [])
        words = torch.tensor([_hook_words(mine), _word_bytes(mine, world)], dtype=torch.float64)
        dist.all_reduce(words)
        mean_words, word_bytes = (float(x) / world for x in words)
        mean_words = adpsgd_words(entry, numel) or mean_words
        f = facts.get(name, {})
        # PowerSGD's all-reduces as rank 0 issued them: every rank replays the same ones in the same order
        allreduces = [f.get("allreduces", [])]
        dist.broadcast_object_list(allreduces, src=0)
        msg = scaling.Messages(
            numel=numel,
            words=mean_words,
            word_bytes=word_bytes if base in GTC_LIKE else scaling.WORD_BYTES,
            period=int(f.get("period", 1)),
            group_size=int(f.get("group_size", 2)),
            allreduces=tuple(allreduces[0]),
        )
        colls = scaling.collectives(base, world, msg)
        if colls is None:
            continue
        period = math.lcm(*(c.every for c in colls)) if colls else 1
        estimate = scaling.comm_seconds(colls, scaling.Network(plan["rate_bits"])) + plan["replay_pause_s"]
        steps = min(plan["replay_steps"], max(2, int(plan["replay_budget_s"] / estimate)))
        steps = math.ceil(steps / period) * period
        # Every rank builds every group in the same order (new_group is collective).
        g = min(msg.group_size, world)
        my_group = tuple(range(rank // g * g, rank // g * g + g))
        reps = tuple(range(0, world, g))
        for ranks in sorted({tuple(range(k, k + g)) for k in range(0, world, g)} | {reps}):
            group_of(ranks)
        times, before = [], _counters(plan["interface"])
        for step in range(steps):
            dist.barrier()
            time.sleep(plan["replay_pause_s"])
            t0 = time.perf_counter()
            for c in colls:
                if step % c.every:
                    continue
                if base == "bmuf_gtc":
                    if c.kind == "allreduce" and rank not in reps:
                        continue
                    ranks = reps if c.kind == "allreduce" else my_group
                else:
                    ranks = tuple(range(world))
                _run_collective(c, base, ranks, group_of(ranks), rank, step)
            times.append(time.perf_counter() - t0)
        after = _counters(plan["interface"])
        out[name] = {
            "collectives": [vars(c) for c in colls],
            "words": mean_words,
            "steps": steps,
            "step_times": times,
            "step_s": statistics.fmean(times),
            "wire": {k: after[k] - before[k] for k in after},
        }
    return out


def pair_peer(rank: int, world: int, step: int) -> int:
    """``adpsgd``'s peer at ``step`` on the ring schedule, as every rank sees it: an even rank's
    right neighbour on even steps and left one on odd steps; an odd rank's the even rank that picks it."""
    from gtc_lightning.algorithms.averaging.pairing import schedule_peer

    if rank % 2 == 0:
        return schedule_peer(rank, world, step)
    return (rank - 1) % world if step % 2 == 0 else (rank + 1) % world


def _run_collective(
    c: scaling.Collective, strategy: str, ranks: tuple[int, ...], group, rank: int, step: int = 0
) -> None:
    import torch
    import torch.distributed as dist

    from gtc_lightning.algorithms.averaging.dpsgd import neighbour_ops

    p = len(ranks)
    if c.kind == "allreduce":
        dtype, width = (torch.bfloat16, 2) if strategy == "ddp_bf16" else (torch.float32, 4)
        dist.all_reduce(torch.ones(int(c.size // width), dtype=dtype), group=group)
    elif c.kind == "allgather":
        n = max(int(c.size // 4), 1)
        dist.all_gather_into_tensor(
            torch.empty(p * n, dtype=torch.int32), torch.ones(n, dtype=torch.int32), group=group
        )
    elif c.kind == "alltoall":
        n = int(c.size // 4)
        dist.all_to_all_single(
            torch.empty(p * n, dtype=torch.int32), torch.ones(p * n, dtype=torch.int32), group=group
        )
    elif c.kind == "broadcast":
        dist.broadcast(torch.ones(int(c.size // 4)), src=ranks[0], group=group)
    elif c.kind == "neighbours":
        buf = torch.ones(int(c.size // 4))
        peers = sorted({(rank - 1) % p, (rank + 1) % p} - {rank})
        if strategy == "adpsgd":  # one peer a step, the pairs of the ring schedule
            peers = [pair_peer(rank, p, step)]
        ops = neighbour_ops(buf, [torch.empty_like(buf) for _ in peers], peers)  # as dpsgd sends
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    else:
        raise ValueError(f"cannot replay collective kind {c.kind!r}")


def adpsgd_words(entry: dict, numel: int) -> int:
    """Words of one coded ``adpsgd`` exchange (``adpsgd:compress=gtc``, ``density`` 0.01 unless given);
    0 for every other strategy (whole models, or words measured by the hook)."""
    options = entry.get("options", {})
    if entry["name"] != "adpsgd" or options.get("compress") != "gtc":
        return 0
    from gtc_lightning.algorithms.averaging.coded_exchange import coded_words

    return coded_words(numel, float(options.get("density", 0.01)))


def parameter_count(spec: tuple[int, int, int]) -> int:
    layers, hidden, outputs = spec
    return (680 + 1) * hidden + (layers - 1) * (hidden + 1) * hidden + (hidden + 1) * outputs


# ----------------------------------------------------------------------------------- orchestrator


def parse_strategy(text: str) -> dict[str, Any]:
    """``bmuf:period=5,block_lr=1.0`` -> name, constructor options and the label used in tables."""
    name, _, rest = text.partition(":")
    options: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"strategy {text!r}: options are key=value pairs after ':', e.g. bmuf:period=5")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return {"name": name, "options": options, "label": text}


def available_strategies() -> list[str]:
    """The default list: DDP fp32 and bf16, PowerSGD at rank 1 and 4, GTC (Strom's and the defaults), and
    whichever of the other schemes exist."""
    from lightning.pytorch.strategies import StrategyRegistry

    import gtc_lightning  # noqa: F401
    from gtc_lightning.tools import bench_step

    out = list(DEFAULT_STRATEGIES)
    small_periods = {"ma": "ma:period=5", "bmuf": "bmuf:period=5", "bmuf_gtc": "bmuf_gtc:period=5"}
    for name in OPTIONAL_STRATEGIES:
        if name in bench_step.STRATEGIES or name in StrategyRegistry:
            out.append(small_periods.get(name, name))
    return out


def choose_steps(
    base: str, spec: tuple[int, int, int], world: int, rate_bits: float | None, args: argparse.Namespace
) -> int:
    """Timed steps for one segment: as many as fit ``--segment-budget`` by a rough estimate of the
    step (compute at a nominal core's rate, communication by the scaling model at 0.1 % density),
    between ``--min-steps`` and ``--steps``."""
    n = parameter_count(spec)
    compute = 6 * n * args.batch / _COMPUTE_FLOPS * max(1.0, world / (os.cpu_count() or 1))
    comm = 0.0
    if rate_bits and world > 1:
        colls = scaling.collectives(base, world, scaling.Messages(numel=n, words=1e-3 * n, period=5)) or []
        comm = scaling.comm_seconds(colls, scaling.Network(rate_bits))
    return int(min(args.steps, max(args.min_steps, args.segment_budget // (compute + comm))))


def burst_for(rate: str, burst_ms: float, mtu: int = 1500) -> str:
    """tbf bucket of ``burst_ms`` at the line rate, at least 16 KiB (~11 packets): tbf needs about a
    millisecond's worth to reach its rate here, and a bigger bucket lets small messages through unshaped."""
    from gtc_lightning.tools.cluster import parse_rate

    bits = parse_rate(rate)
    return str(max(16 * 1024, 4 * mtu, round(bits / 8 * burst_ms / 1e3))) if bits else "256kb"


def _tau_for(model: str, args: argparse.Namespace) -> float:
    if model in args.tau:
        return args.tau[model]
    return args.tau.get("*", DEFAULT_TAU.get(model, 1e-2))


def run_config(
    cluster, model: str, world: int, rate: str | None, strategies: list[dict], args: argparse.Namespace
) -> dict:
    """One configuration: every strategy on ``world`` nodes at ``rate`` (or one process, no network)."""
    import subprocess

    from gtc_lightning.tools import bench_step
    from gtc_lightning.tools.cluster import parse_rate

    spec = bench_step.parse_model(model)
    out = Path(args.out) / model / f"w{world}" / (rate or "local")
    out.mkdir(parents=True, exist_ok=True)
    rate_bits = parse_rate(rate) if rate else None
    entries = []
    for s in strategies:
        entries.append({**s, "steps": choose_steps(s["name"], spec, world, rate_bits, args)})
    plan = {
        "model": model,
        "spec": list(spec),
        "world": world,
        "rate": rate,
        "strategies": entries,
        "rounds": args.rounds,
        "warmup": args.warmup,
        "batch": args.batch,
        "tau": _tau_for(model, args),
        "lr": args.lr,
        "threads": args.threads,
        "replay_steps": args.replay_steps,
        "replay_pause_s": args.replay_pause,
        "replay_budget_s": args.segment_budget / 2,
        "rate_bits": rate_bits,
        "residual_start": args.residual_start,
        "slow_rank": args.slow_rank,
        "slow_sleep_s": args.slow_sleep,
        "out": str(out),
    }
    (out / "plan.json").write_text(json.dumps(plan, indent=1))
    for stale in out.glob("rank*.json"):
        stale.unlink()
    command = [
        sys.executable,
        "-m",
        "gtc_lightning.tools.bench_cluster",
        "--node-worker",
        str(out / "plan.json"),
        "--num-nodes",
        "{num_nodes}",
    ]
    record: dict[str, Any] = {
        "model": model,
        "world": world,
        "rate": rate,
        "rate_bits": rate_bits,
        "tau": plan["tau"],
        "plan": str(out / "plan.json"),
        "steps": {e["label"]: e["steps"] for e in entries},
        "load_before": os.getloadavg(),
        "slow_rank": args.slow_rank,
        "slow_sleep_s": args.slow_sleep if args.slow_rank is not None else 0.0,
    }
    started = time.monotonic()
    if cluster is None:
        launcher = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK")
        env = {k: v for k, v in os.environ.items() if k not in launcher}
        with open(out / "node0.log", "w") as log:
            proc = subprocess.run(
                command, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout, check=False
            )
        record.update(status="ok" if proc.returncode == 0 else "failed", cluster=None)
    else:
        result = cluster.run(command, out, timeout=args.timeout, stream=False)
        record.update(
            status=result.status,
            burst_bytes=cluster.burst_bytes,
            cluster={
                "wall_s": result.wall_s,
                "nodes": [
                    {"node_rank": n.node_rank, "tx_bytes": n.tx_bytes, "rx_bytes": n.rx_bytes}
                    for n in result.nodes
                ],
            },
        )
    record["wall_s"] = round(time.monotonic() - started, 1)
    record["load_after"] = os.getloadavg()
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    record["ranks"] = len(ranks)
    if record["status"] == "ok" and len(ranks) != world:
        record["status"] = "incomplete"
    record["rows"] = summarize_config(record, ranks, plan) if record["status"] == "ok" else []
    return record


def summarize_config(record: dict, ranks: list[dict], plan: dict) -> list[dict]:
    """One row per strategy: step, compute, comm, codec, network alone, wire and hook bytes."""
    from gtc_lightning.algorithms.common import allreduce_bytes

    world, n = record["world"], parameter_count(tuple(plan["spec"]))
    rank0 = next(r for r in ranks if r["rank"] == 0)

    def median_step(label: str) -> float | None:
        values = [w["step_s"] for w in rank0["segments"].get(label, []) if "step_s" in w]
        return statistics.median(values) if values else None

    compute = median_step("nocomm") if world > 1 else median_step("single")
    rows = []
    for entry in plan["strategies"]:
        label, base = entry["label"], entry["name"]
        step = median_step(label)
        if step is None:
            continue
        steps_total = sum(w["steps"] for w in rank0["segments"][label])
        per_rank_tx, per_rank_rx, hook_bytes, words, word_bytes = [], [], [], [], []
        for r in ranks:
            wins = r["segments"].get(label, [])
            steps = sum(w["steps"] for w in wins)
            per_rank_tx.append(sum(w.get("wire", {}).get("tx_bytes", 0) for w in wins) / steps)
            per_rank_rx.append(sum(w.get("wire", {}).get("rx_bytes", 0) for w in wins) / steps)
            sent = sum(s.get("bytes_sent", 0.0) for w in wins for s in w.get("hook", {}).values())
            hook_bytes.append(sent / steps)
            words.append(_hook_words(wins))
            word_bytes.append(_word_bytes(wins, world))
        if base == "ddp":
            hook = float(allreduce_bytes(n, world, 4))
        elif base == "ddp_bf16":
            hook = float(allreduce_bytes(n, world, 2))
        elif base in ("nocomm", "single"):
            hook = 0.0
        else:
            hook = statistics.fmean(hook_bytes) if any(hook_bytes) else None
        codec = 0.0
        for w in rank0["segments"][label]:
            gtc = w.get("hook", {}).get("gtc_stats", {})
            codec += gtc.get("compress_s", 0.0) + gtc.get("decompress_s", 0.0)
        codec /= steps_total
        parts = {
            k: sum(w.get("hook", {}).get("gtc_stats", {}).get(k, 0.0) for w in rank0["segments"][label])
            / steps_total
            for k in ("compress_s", "exchange_s", "decompress_s")
        }
        replays = [r["replay"][label] for r in ranks if label in r.get("replay", {})]
        network = statistics.fmean(x["step_s"] for x in replays) if replays else None
        replay_tx = (
            statistics.fmean(x["wire"].get("tx_bytes", 0) / x["steps"] for x in replays) if replays else None
        )
        wire = statistics.fmean(per_rank_tx) if world > 1 else 0.0
        rate_bits = record["rate_bits"]
        by_rank = {
            r["rank"]: statistics.median(ws) for r in ranks
            if (ws := [w["step_s"] for w in r["segments"].get(label, []) if "step_s" in w])
        }  # fmt: skip
        fast = [s for k, s in by_rank.items() if k != record.get("slow_rank")]
        rows.append({
            "model": record["model"], "weights": n, "world": world, "rate": record["rate"], "rate_bits": rate_bits,
            "strategy": label, "base": base, "steps": steps_total, "rounds": len(rank0["segments"][label]),
            "step_s": step, "step_s_rounds": [w["step_s"] for w in rank0["segments"][label] if "step_s" in w],
            "compute_s": compute, "comm_s": None if compute is None else step - compute, "codec_s": codec, "codec_parts": parts,
            "network_s": network, "frames_per_s": plan["batch"] * world / step,
            "wire_tx_bytes": wire, "wire_rx_bytes": statistics.fmean(per_rank_rx) if world > 1 else 0.0,
            "hook_bytes": hook, "wire_over_hook": wire / hook if hook else None,
            "replay_tx_bytes": replay_tx,
            "words": adpsgd_words(entry, n) or (statistics.fmean(words) if any(words) else None),
            "word_bytes": statistics.fmean(word_bytes) if base in GTC_LIKE and any(words) else None,
            "wire_bound_s": wire * 8 / rate_bits if rate_bits else None,
            "fp32_ring_bytes": float(allreduce_bytes(n, world, 4)),
            "facts": rank0.get("facts", {}).get(label, {}), "tau": plan["tau"],
            "gradient_rms": rank0.get("gradient_rms"),
            "replay": replays[0] if replays else None,
            "load_before": record["load_before"], "load_after": record["load_after"],
            "step_s_by_rank": [by_rank[k] for k in sorted(by_rank)], "slow_rank": record.get("slow_rank"),
            "slow_sleep_s": record.get("slow_sleep_s", 0.0), "fast_step_s": max(fast) if fast else None,
        })  # fmt: skip
    return rows


# --------------------------------------------------------------------------------- model and report


def _collectives_of(row: dict, words: float | None = None) -> list[scaling.Collective] | None:
    facts = row.get("facts", {})
    msg = scaling.Messages(
        numel=row["weights"],
        words=(row["words"] or 0.0) if words is None else words,
        word_bytes=row.get("word_bytes") or scaling.WORD_BYTES,
        period=int(facts.get("period", 1)),
        group_size=int(facts.get("group_size", 2)),
        allreduces=tuple(facts.get("allreduces", ())),
    )
    return scaling.collectives(row["base"], row["world"], msg)


def _time_sync_work(spec: tuple[int, int, int], threads: int, repeats: int, barrier=None) -> dict[str, float]:
    import torch

    from gtc_lightning.algorithms.averaging.bmuf import BMUFState
    from gtc_lightning.algorithms.averaging.model_averaging import flatten, unflatten_
    from gtc_lightning.tools import bench_step

    torch.set_num_threads(threads)
    params = [p.detach() for p in bench_step.make_dnn(spec, 0.1).parameters()]
    state = BMUFState(period=1, block_momentum=0.5, world_size=2)
    state.begin(params)

    def ma() -> None:
        unflatten_(flatten(params).div_(2), params)

    def bmuf() -> None:
        unflatten_(state.update(flatten(params).div_(2)), params)

    def bmuf_gtc() -> None:
        bmuf()
        unflatten_(flatten(params), params)

    out = {}
    with torch.no_grad():
        for name, work in (("ma", ma), ("bmuf", bmuf), ("bmuf_gtc", bmuf_gtc)):
            times = []
            for i in range(repeats + 1):  # the first is a warm-up
                if barrier is not None:
                    barrier.wait()
                start = time.perf_counter()
                work()
                if i:
                    times.append(time.perf_counter() - start)
            out[name] = statistics.median(times)
    return out


def _sync_work_child(spec, threads, repeats, barrier, queue) -> None:
    queue.put(_time_sync_work(spec, threads, repeats, barrier))


def measure_sync_work(
    spec: tuple[int, int, int], threads: int = 1, repeats: int = 5, processes: int = 1
) -> dict[str, float]:
    """Seconds of one sync's own arithmetic on the model of ``spec`` (the real parameter tensors),
    with the strategies' own functions and no collective, in ``processes`` processes of ``threads``
    torch threads each doing it at the same moment, as the ranks of one host do at a sync (they share
    its cores and memory bandwidth): median of ``repeats`` after one warm-up, the slowest process's.
    ``ma`` flattens the parameters, divides and copies them back (:func:`gtc_lightning.algorithms.averaging.model_averaging.all_mean`
    and ``unflatten_`` without the all-reduce); ``bmuf`` adds the block update
    (:meth:`gtc_lightning.algorithms.averaging.bmuf.BMUFState.update`); ``bmuf_gtc``'s representative adds the flat copies
    of the broadcast to its group."""
    if processes < 1:
        raise ValueError(f"processes {processes}: need at least 1")
    if processes == 1:
        return _time_sync_work(spec, threads, repeats)
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")  # no fork of a process whose OpenMP may have run
    barrier, queue = ctx.Barrier(processes), ctx.Queue()
    procs = [
        ctx.Process(target=_sync_work_child, args=(spec, threads, repeats, barrier, queue))
        for _ in range(processes)
    ]
    for proc in procs:
        proc.start()
    try:
        results = [queue.get(timeout=600) for _ in procs]
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    return {k: max(r[k] for r in results) for k in results[0]}


def sync_ranks(row: dict) -> int:
    """The ranks of a row that do a sync's arithmetic at once: all of them (``ma``, ``bmuf``) or one
    per group (``bmuf_gtc``'s representatives; the others wait for their broadcast)."""
    if row["base"] == "bmuf_gtc":
        return max(row["world"] // int(row.get("facts", {}).get("group_size", 2)), 1)
    return row["world"]


def calibrate(
    rows: list[dict],
    configs: list[dict],
    cpus: int | None = None,
    threads: int = 1,
    sync_work: dict[str, dict[str, dict]] | None = None,
) -> dict:
    """Fit the network's latency and host throughput on the replays (network alone), then predict
    every training step from its measured compute and codec time and its measured message sizes.

    The schemes that overlap their exchange with compute (``scaling.OVERLAPPED``) are predicted as
    overlapped only where the host has a core for it beside every worker's ``threads`` torch threads
    (``cpus >= workers x (threads + 1)``; ``cpus`` None: assumed). On this 2-core host with 2 or 4
    single-threaded workers every core runs a rank's compute and the exchange adds to the step.

    The schemes that sync the model every K steps (``scaling.SYNCING``) add their sync's own arithmetic
    once per period: ``sync_work[model][str(ranks)][base]`` seconds, measured with as many processes
    doing it at once as the row has ranks doing it (:func:`measure_sync_work`, :func:`sync_ranks`)."""
    sync_work = sync_work or {}
    burst = {(c["model"], c["world"], c["rate"]): c.get("burst_bytes", 0) for c in configs}
    net_rows = [r for r in rows if r["world"] > 1 and r["replay"] and r["network_s"] is not None]
    ratios = [
        r["replay_tx_bytes"] / scaling.bytes_per_step(_collectives_of(r))
        for r in net_rows
        if scaling.bytes_per_step(_collectives_of(r)) >= 1e6
    ]
    overhead = statistics.median(ratios) if ratios else 1.0
    samples = []
    for r in net_rows:
        colls = [scaling.Collective(**c) for c in r["replay"]["collectives"]]
        net = scaling.Network(
            r["rate_bits"],
            wire_overhead=overhead,
            burst_bytes=burst.get((r["model"], r["world"], r["rate"]), 0),
        )
        samples.append((colls, net, r["network_s"]))
    latency, host = scaling.fit_network(samples) if samples else (0.0, math.inf)
    predictions = []
    for r in rows:
        if r["world"] < 2 or r["compute_s"] is None or r["base"] in ("nocomm", "single"):
            continue
        colls = _collectives_of(r, words=r["words"] or 0.0)
        if colls is None:
            continue
        net = scaling.Network(
            r["rate_bits"],
            latency_s=latency,
            wire_overhead=overhead,
            host_bytes_per_s=host,
            burst_bytes=burst.get((r["model"], r["world"], r["rate"]), 0),
        )
        comm = scaling.comm_seconds(colls, net)
        work = r["compute_s"] + r["codec_s"]
        if r["base"] in scaling.SYNCING:
            sync = sync_work.get(r["model"], {}).get(str(sync_ranks(r)), {}).get(r["base"], 0.0)
            work += sync / int(r.get("facts", {}).get("period", 1))
        overlap = r["base"] in scaling.OVERLAPPED and (cpus is None or cpus >= r["world"] * (threads + 1))
        step = max(work, comm) if overlap else work + comm
        network = None
        if r["replay"]:
            network = scaling.comm_seconds([scaling.Collective(**c) for c in r["replay"]["collectives"]], net)
        predictions.append(
            {
                "model": r["model"],
                "world": r["world"],
                "rate": r["rate"],
                "strategy": r["strategy"],
                "step_s": step,
                "comm_s": comm,
                "network_s": network,
                "error": step / r["step_s"] - 1,
                "network_error": network / r["network_s"] - 1 if network and r["network_s"] else None,
            }
        )
    return {
        "latency_s": latency,
        "host_bytes_per_s": host,
        "wire_overhead": overhead,
        "samples": len(samples),
        "predictions": predictions,
    }


def targets(rows: list[dict]) -> list[dict]:
    """The issue's targets for 4 workers and Strom's model, measured against them."""
    out = []
    find = {(r["model"], r["world"], r["rate"], r["strategy"]): r for r in rows}
    rates = sorted(
        {r["rate"] for r in rows if r["model"] == "strom" and r["world"] == 4},
        key=lambda x: find[("strom", 4, x, "gtc")]["rate_bits"] if ("strom", 4, x, "gtc") in find else 0,
    )
    for rate in rates:
        gtc, ddp, bf16 = (find.get(("strom", 4, rate, s)) for s in ("gtc", "ddp", "ddp_bf16"))
        if not (gtc and ddp):
            continue

        def add(what: str, value: float | None, goal: str, ok: bool | None, rate: str = rate) -> None:
            out.append({"rate": rate, "target": what, "measured": value, "goal": goal, "met": ok})

        comm_ratio = ddp["comm_s"] / gtc["comm_s"] if gtc["comm_s"] and gtc["comm_s"] > 0 else None
        add(
            "comm per step, fp32 DDP / GTC (step - compute)",
            comm_ratio,
            ">= 50",
            None if comm_ratio is None else comm_ratio >= 50,
        )
        if gtc["network_s"] and ddp["network_s"]:
            ratio = ddp["network_s"] / gtc["network_s"]
            add("network alone per step, fp32 DDP / GTC (replay)", ratio, ">= 50", ratio >= 50)
        for what, value in (
            ("GTC comm (step - compute) / wire-time bound", gtc["comm_s"]),
            ("GTC network alone (replay) / wire-time bound", gtc["network_s"]),
        ):
            if value is not None and gtc["wire_bound_s"]:
                # step - compute <= 0: GTC's step was within the noise of the step that sends nothing;
                # no ratio to a bound can be read from that
                ratio = value / gtc["wire_bound_s"] if value > 0 else None
                add(what, ratio, "<= 1.5", None if ratio is None else ratio <= 1.5)
        if gtc["wire_tx_bytes"]:
            ratio = gtc["fp32_ring_bytes"] / gtc["wire_tx_bytes"]
            add("fp32 ring all-reduce bytes / GTC wire bytes", ratio, ">= 500", ratio >= 500)
            ratio = ddp["wire_tx_bytes"] / gtc["wire_tx_bytes"]
            add("fp32 DDP wire bytes / GTC wire bytes (both measured)", ratio, ">= 500", ratio >= 500)
        if rate == "100mbit":
            ratio = ddp["step_s"] / gtc["step_s"]
            add("step, fp32 DDP / GTC", ratio, ">= 5", ratio >= 5)
            if bf16:
                ratio = bf16["step_s"] / gtc["step_s"]
                add("step, bf16 DDP / GTC", ratio, ">= 2.5", ratio >= 2.5)
    return out


def _fmt(x: float | None, digits: int = 3) -> str:
    if x is None:
        return "-"
    if abs(x) >= 1e5:
        return f"{x:,.0f}"
    return f"{x:.{digits}f}"


def _mb(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e6:.3f}"


def render(results: dict) -> str:
    """The markdown report: the measured table, the targets, the model's calibration and errors."""
    rows, model = results["rows"], results["model"]
    args = results["args"]
    pred = {(p["model"], p["world"], p["rate"], p["strategy"]): p for p in model["predictions"]}
    lines = [
        (
            f"{args['batch']} frames per worker and step; {args['threads']} torch thread(s) per worker on a "
            f"{results['host']['cpus']}-core host; {args['rounds']} rounds, median of each segment's mean step; "
            f"tau: {', '.join(f'{m} {t:g}' for m, t in results['taus'].items())}; links shaped both ways by tbf "
            f"(bucket {args['burst_ms']:g} ms of the rate, at least 16 KiB); started {results['started']}, "
            f"{results['wall_s'] / 60:.0f} min."
        ),
        "",
        (
            "| model | workers | rate | strategy | step s | compute s | comm s | codec s | network alone s "
            "| wire-time bound s | frames/s | wire MB/step/rank | hook MB | wire/hook | model s (error) | load before → after |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p = pred.get((r["model"], r["world"], r["rate"], r["strategy"]))
        predicted = f"{p['step_s']:.3f} ({p['error']:+.0%})" if p else "-"
        load = f"{r['load_before'][0]:.1f} → {r['load_after'][0]:.1f}"
        lines.append(
            f"| {r['model']} | {r['world']} | {r['rate'] or '-'} | {r['strategy']} | {_fmt(r['step_s'])} "
            f"| {_fmt(r['compute_s'])} | {_fmt(r['comm_s'])} | {_fmt(r['codec_s'])} | {_fmt(r['network_s'])} "
            f"| {_fmt(r['wire_bound_s'])} | {r['frames_per_s']:,.0f} | {_mb(r['wire_tx_bytes'])} "
            f"| {_mb(r['hook_bytes'])} | {_fmt(r['wire_over_hook'], 2)} | {predicted} | {load} |"
        )
    if results["targets"]:  # none without GTC and DDP on 4 workers with Strom's model
        lines += [
            "",
            "Targets (4 workers, Strom's model):",
            "",
            "| rate | target | measured | goal | met |",
            "|---|---|---|---|---|",
        ]
    for t in results["targets"]:
        met = "-" if t["met"] is None else ("yes" if t["met"] else "**no**")
        lines.append(f"| {t['rate']} | {t['target']} | {_fmt(t['measured'], 2)} | {t['goal']} | {met} |")
    errors = [abs(p["error"]) for p in model["predictions"]]
    lines += [
        "",
        (
            f"Scaling model calibrated on the {model['samples']} replays: latency α = "
            f"{model['latency_s'] * 1e3:.3f} ms per hop, host throughput H = "
            f"{model['host_bytes_per_s'] * 8 / 1e9:.2f} Gbit/s, {model['wire_overhead']:.3f} wire bytes per payload "
            f"byte; step predictions within {max(errors, default=0):.0%} "
            f"(median {statistics.median(errors) if errors else 0:.0%}) of the measurements, "
            f"{sum(e <= 0.15 for e in errors)} of {len(errors)} within 15 %."
        ),
    ]
    for m, by_count in results.get("sync_work", {}).items():
        parts = [
            f"{count} at once: " + ", ".join(f"{k} {1e3 * work[k]:.0f} ms" for k in scaling.SYNCING if k in work)
            for count, work in sorted(by_count.items(), key=lambda x: int(x[0]))
        ]
        first = next(iter(by_count.values()))
        lines += [
            "",
            (
                f"Sync arithmetic on {m}'s model (no collective; processes of {first.get('threads', 1)} thread(s) doing "
                f"it at once, as many as the row's ranks doing it; measured {first.get('measured', '?')}), added "
                "once per period: " + "; ".join(parts) + "."
            ),
        ]
    for name, proj in results.get("projections", {}).items():
        sc = proj["scenario"]
        strategies = [k for k in proj["rows"][0] if k != "nodes"]
        lines += [
            "",
            (
                f"Projection, {name}: {sc['frames_per_s']:,.0f} frames/s per node, GTC {sc['words']:,.0f} words "
                f"per node and step, thresholding {1e3 * sc['overhead_s']:.0f} ms, decoding "
                f"{1e9 * sc['per_word_s']:.0f} ns per word, BMUF's block update {1e3 * sc.get('sync_s', 0.0):.0f} ms; "
                "speed-up over one node:"
            ),
            "",
            "| nodes | " + " | ".join(strategies) + " |",
            "|---" * (len(strategies) + 1) + "|",
        ]
        for row in proj["rows"]:
            lines.append(
                f"| {row['nodes']} | " + " | ".join(f"{row[k]['speedup']:.1f}" for k in strategies) + " |"
            )
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    """Stacked bars per configuration: compute and communication of each strategy's step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results["rows"] if r["world"] > 1 and r["compute_s"] is not None]
    panels = sorted({(r["model"], r["world"]) for r in rows}, key=lambda x: (x[0] != "recipe", x[1]))
    if not panels:
        return
    # one colour per strategy in every panel (C7 is matplotlib's grey: the compute's colour, skipped)
    names = list(dict.fromkeys(r["strategy"] for r in rows if r["strategy"] != "nocomm"))
    colour = {s: f"C{k if k < 7 else k + 1}" for k, s in enumerate(names)}
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 3.2 * len(panels)), squeeze=False)
    for ax, (model, world) in zip(axes[:, 0], panels):
        mine = [r for r in rows if r["model"] == model and r["world"] == world]
        rates = sorted(
            {r["rate"] for r in mine}, key=lambda x: next(r["rate_bits"] for r in mine if r["rate"] == x)
        )
        strategies = [s for s in dict.fromkeys(r["strategy"] for r in mine) if s != "nocomm"]  # nocomm: the grey
        width = 0.8 / len(strategies)
        for i, s in enumerate(strategies):
            xs, comp, comm, net = [], [], [], []
            for j, rate in enumerate(rates):
                r = next((r for r in mine if r["rate"] == rate and r["strategy"] == s), None)
                if r is None:
                    continue
                xs.append(j + (i - (len(strategies) - 1) / 2) * width)
                comp.append(min(r["compute_s"], r["step_s"]))
                comm.append(max(r["step_s"] - r["compute_s"], 0.0))
                net.append(r["network_s"])
            ax.bar(xs, comp, width * 0.95, color="0.75", edgecolor="0.4")
            ax.bar(xs, comm, width * 0.95, bottom=comp, label=s, color=colour[s])
            ax.scatter(
                [x for x, v in zip(xs, net) if v],
                [v for v in net if v],
                marker="_",
                s=120,
                color="k",
                zorder=3,
            )
        ax.set_xticks(range(len(rates)), rates)
        ax.set_yscale("log")
        ax.set_ylabel("s per step")
        ax.set_title(
            f"{model}, {world} workers: compute (grey: nocomm's step) + communication; '-' = network alone (replay)"
        )
        ax.legend(fontsize=7, ncol=len(strategies))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def projections(rows: list[dict], model: dict, sync_work: dict | None = None) -> dict[str, dict]:
    """1-128 nodes of this host's kind (one core each, own link), from the measurements: one node's
    compute = the single-device step; GTC's words per step and its thresholding and decoding times
    from 2 workers (one core each); BMUF's block update on one core (``sync_work``); the calibrated
    latency, no host limit, no burst credit."""
    sync_work = sync_work or {}
    out = {}
    for m in dict.fromkeys(r["model"] for r in rows):
        single = next((r for r in rows if r["model"] == m and r["world"] == 1), None)
        gtc = next(
            (r for r in rows if r["model"] == m and r["world"] == 2 and r["base"] == "gtc" and r["words"]),
            None,
        )
        if single is None or gtc is None:
            continue
        windows = gtc["codec_parts"]
        for rate, bits in sorted(
            {(r["rate"], r["rate_bits"]) for r in rows if r["rate_bits"]}, key=lambda x: x[1]
        ):
            sc = scaling.Scenario(
                f"{m} on CPU nodes like this host's, {rate}",
                frames_per_s=single["frames_per_s"],
                frames=round(single["frames_per_s"] * single["step_s"]),
                net=scaling.Network(bits, latency_s=model["latency_s"]),
                numel=single["weights"],
                words=gtc["words"],
                overhead_s=windows["compress_s"],
                per_word_s=windows["decompress_s"] / (2 * gtc["words"]),
                sync_s=sync_work.get(m, {}).get("1", {}).get("bmuf", 0.0),
            )
            out[sc.name] = {
                "scenario": {
                    "frames_per_s": sc.frames_per_s,
                    "frames": sc.frames,
                    "rate_bits": bits,
                    "latency_s": sc.net.latency_s,
                    "words": sc.words,
                    "overhead_s": sc.overhead_s,
                    "per_word_s": sc.per_word_s,
                    "group_size": sc.group_size,
                    "period": sc.period,
                    "sync_s": sc.sync_s,
                },
                "rows": scaling.scenario_rows(sc),
            }
    return out


def finish(results: dict, out: Path, png: Path | None = None) -> None:
    rows = [row for c in results["configs"] for row in c["rows"]]
    results["rows"] = rows
    threads = results.get("args", {}).get("threads", 1)
    sync_work = results.setdefault("sync_work", {})
    needed: dict[str, set[int]] = {}
    for r in rows:
        if r["base"] in scaling.SYNCING:
            needed.setdefault(r["model"], {1}).add(sync_ranks(r))  # 1: the projections' one node
    from gtc_lightning.tools import bench_step

    for m, counts in needed.items():
        for count in sorted(counts):
            if str(count) in sync_work.get(m, {}):
                continue  # measured here after the configurations, or by a later --report-only
            work = measure_sync_work(bench_step.parse_model(m), threads, processes=count)
            sync_work.setdefault(m, {})[str(count)] = {
                **work,
                "threads": threads,
                "measured": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                "load": os.getloadavg()[0],
            }
            print(f"sync arithmetic, {m}, {count} process(es) of {threads} thread(s): " + ", ".join(
                f"{k} {1e3 * v:.1f} ms" for k, v in work.items()), flush=True)
    results["model"] = calibrate(rows, results["configs"], results.get("host", {}).get("cpus"), threads, sync_work)
    results["targets"] = targets(rows)
    results["projections"] = projections(rows, results["model"], sync_work)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "table.md").write_text(render(results) + "\n")
    plot(results, png or out / "bench_cluster.png")
    if results["projections"]:
        # the biggest model's projections (Strom's when it was measured), one panel per rate
        last = list(results["projections"])[-1].split(" on ")[0]
        extra = {
            name: p["rows"] for name, p in results["projections"].items() if name.startswith(last + " on ")
        }
        scaling.plot_scenarios(
            (png or out / "bench_cluster.png").with_name("scaling_projection.png"), [], extra
        )


def _strategies_for(world: int, strategies: list[dict]) -> list[dict]:
    """A world's strategies plus ``nocomm`` (its compute) once, also when it was asked for;
    ``bmuf_gtc`` needs at least two groups, ``adpsgd`` an even number of workers."""
    out = [
        s
        for s in strategies
        if s["name"] != "nocomm"
        and not (s["name"] == "bmuf_gtc" and world < 2 * int(s["options"].get("group_size", 2)))
        and not (s["name"] == "adpsgd" and world % 2)  # its ring pairs even ranks with odd ones
    ]
    return out + [parse_strategy("nocomm")]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m gtc_lightning.tools.bench_cluster",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--models", nargs="+", default=["recipe", "strom"], help="recipe, strom or LxH:K (default both)")
    add(
        "--workers",
        nargs="+",
        type=int,
        default=[1, 2, 4],
        help="workers, one per emulated node; 1 = single device, no network (default 1 2 4)",
    )
    add("--rates", nargs="+", default=["100mbit", "1gbit", "10gbit"], help="link rates as tc reads them")
    add(
        "--strategies",
        nargs="+",
        default=None,
        help="strategy names, with constructor options after ':' (bmuf:period=5,block_lr=1.0); default: "
        f"{' '.join(DEFAULT_STRATEGIES)} and whichever of {' '.join(OPTIONAL_STRATEGIES)} exist (periods 5); "
        "nocomm is always added (the compute), and 'single' runs at 1 worker",
    )
    add(
        "--tau",
        nargs="+",
        default=[],
        help="GTC's threshold: one value for all models or MODEL=VALUE pairs "
        f"(default {' '.join(f'{m}={t:g}' for m, t in DEFAULT_TAU.items())}: ~30x the per-rank gradient RMS)",
    )
    add("--steps", type=int, default=10, help="timed steps per segment at most (default 10)")
    add("--min-steps", type=int, default=2, help="timed steps per segment at least (default 2)")
    add(
        "--segment-budget",
        type=float,
        default=20.0,
        help="seconds a segment's timed steps may take by a rough estimate; slow configurations get fewer "
        "steps, down to --min-steps (default 20)",
    )
    add("--warmup", type=int, default=2, help="untimed steps before each segment's window (default 2)")
    add("--rounds", type=int, default=2, help="rounds over all strategies (default 2)")
    add("--batch", type=int, default=256, help="frames per worker and step (default 256)")
    add("--lr", type=float, default=0.1)
    add("--threads", type=int, default=1, help="torch threads per worker (default 1)")
    add(
        "--residual-start",
        choices=["triangular", "zero"],
        default="triangular",
        help="GTC residuals at the start of each segment (default triangular on (-tau, tau))",
    )
    add("--replay-steps", type=int, default=5, help="replayed steps per strategy (whole periods; default 5)")
    add(
        "--replay-pause",
        type=float,
        default=0.05,
        help="seconds of pause before each replayed step (default 0.05)",
    )
    add(
        "--slow-rank",
        type=int,
        default=None,
        help="a straggler's compute: this rank sleeps --slow-sleep seconds before every training batch, in every "
        "strategy's segment (nocomm's included); rows get each rank's step and fast_step_s, the slowest of the "
        "other ranks' (default: none)",
    )
    add("--slow-sleep", type=float, default=0.0, help="the --slow-rank's sleep per batch in seconds (default 0)")
    add("--burst-ms", type=float, default=1.0, help="tbf bucket in milliseconds of the rate (default 1)")
    add("--timeout", type=float, default=3600.0, help="seconds per configuration before it is stopped")
    add(
        "--out",
        type=Path,
        default=Path("exp/bench_cluster"),
        help="output directory (default exp/bench_cluster)",
    )
    add("--png", type=Path, default=None, help="where the plot goes (default <out>/bench_cluster.png)")
    add("--report-only", action="store_true", help="re-render table, model and plot from <out>/results.json")
    add(
        "--resume",
        action="store_true",
        help="keep the configurations <out>/results.json already has ok (same models, tau, steps and rounds) "
        "and measure only the others, e.g. after a run was stopped",
    )
    add("--node-worker", default=None, help=argparse.SUPPRESS)
    add("--num-nodes", default=None, help=argparse.SUPPRESS)  # what the cluster put in {num_nodes}
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.node_worker:
        node_worker(args.node_worker)
        return 0
    if args.report_only:
        results = json.loads((args.out / "results.json").read_text())
        finish(results, args.out, args.png)
        print((args.out / "table.md").read_text())
        return 0
    taus: dict[str, float] = {}
    for item in args.tau:
        model, sep, value = item.rpartition("=")
        taus[model if sep else "*"] = float(value)
    args.tau = taus
    if args.min_steps < 1 or args.steps < args.min_steps or args.warmup < 1 or args.rounds < 1:
        parser.error(
            f"need 1 <= --min-steps <= --steps, --warmup >= 1, --rounds >= 1; got {args.min_steps}, "
            f"{args.steps}, {args.warmup}, {args.rounds}"
        )
    if args.slow_sleep < 0 or (args.slow_rank is not None and not 0 <= args.slow_rank < min(args.workers)):
        parser.error(
            f"--slow-rank must be a rank of every --workers count (0 to {min(args.workers) - 1}) and --slow-sleep "
            f">= 0; got --slow-rank {args.slow_rank} --slow-sleep {args.slow_sleep}"
        )
    from gtc_lightning.tools import bench_step
    from gtc_lightning.tools.cluster import Cluster, Interrupted, missing_privileges, missing_tools

    for model in args.models:
        bench_step.parse_model(model)
    strategies = [parse_strategy(s) for s in (args.strategies or available_strategies())]
    if any(w > 1 for w in args.workers):
        problem = missing_privileges() or missing_tools()
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 2
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "schema": "gtc_lightning.bench_cluster/1",
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": {"cpus": os.cpu_count(), "load_at_start": os.getloadavg()},
        "taus": {m: _tau_for(m, args) for m in args.models},
        "configs": [],
    }
    kept: set[tuple] = set()
    if args.resume and (args.out / "results.json").exists():
        earlier = json.loads((args.out / "results.json").read_text())
        same = ("tau", "steps", "min_steps", "segment_budget", "warmup", "rounds", "batch", "lr", "threads",
                "residual_start", "replay_steps", "replay_pause", "burst_ms")
        differ = [k for k in same if k != "tau" and earlier["args"].get(k) != results["args"][k]]
        differ += [f"tau of {m}" for m in args.models if m in earlier["taus"] and earlier["taus"][m] != results["taus"][m]]
        if differ:
            parser.error(f"--resume: {args.out / 'results.json'} was measured with other settings ({', '.join(differ)}); "
                         "use another --out or the same settings")
        results["configs"] = [c for c in earlier["configs"] if c["status"] == "ok"]
        results["started"] = earlier["started"]
        results["taus"] = {**earlier["taus"], **results["taus"]}
        results["host"]["load_at_start"] = earlier["host"]["load_at_start"]
        kept = {(c["model"], c["world"], c["rate"]) for c in results["configs"]}
        print(f"--resume: keeping {len(kept)} configurations measured on {earlier['started']}", flush=True)
    t0 = time.monotonic()
    labels = ", ".join(s["label"] for s in strategies)
    print(
        f"bench_cluster: models {args.models}, workers {args.workers}, rates {args.rates}; strategies {labels} "
        f"(+ nocomm as the compute); results in {args.out}",
        flush=True,
    )

    def done(record: dict) -> None:
        results["configs"].append(record)
        results["wall_s"] = time.monotonic() - t0
        (args.out / "results.json").write_text(json.dumps(results, indent=1))
        head = (
            f"{record['model']} w{record['world']} {record['rate'] or 'local'}: {record['status']} in "
            f"{record['wall_s']:.0f} s, load {record['load_before'][0]:.1f} -> {record['load_after'][0]:.1f}"
        )
        steps = "; ".join(f"{r['strategy']} {r['step_s']:.3f} s" for r in record["rows"])
        print(f"{head}; {steps}", flush=True)

    try:
        if 1 in args.workers:
            for model in args.models:
                if (model, 1, None) not in kept:
                    done(run_config(None, model, 1, None, [parse_strategy("single")], args))
        for world in sorted(w for w in args.workers if w > 1):
            if all((m, world, r) in kept for m in args.models for r in args.rates):
                continue
            with Cluster(
                nodes=world, rate=args.rates[0], burst=burst_for(args.rates[0], args.burst_ms), verbose=False
            ) as cluster:
                for rate in args.rates:
                    cluster.set_rate(rate, burst=burst_for(rate, args.burst_ms), quiet=True)
                    for model in args.models:
                        if (model, world, rate) in kept:
                            continue
                        done(
                            run_config(cluster, model, world, rate, _strategies_for(world, strategies), args)
                        )
    except Interrupted as err:
        print(f"stopped by {err.args[0]}; rendering what was measured", file=sys.stderr)
    results["wall_s"] = time.monotonic() - t0
    results["host"]["load_at_end"] = os.getloadavg()
    finish(results, args.out, args.png)
    print((args.out / "table.md").read_text())
    return 0 if all(c["status"] == "ok" for c in results["configs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
