"""``python -m gtc_lightning.tools.faults``: a cut link and a slow link on the emulated cluster.

Two stages, each on :class:`gtc_lightning.tools.cluster.Cluster` (needs root, like the cluster itself):

**link down.** ``recipes/asr/train.py`` trains on N nodes (``conf/tiny.yaml`` on the tiny corpus,
a checkpoint every few steps, ``--collective_timeout`` seconds; ``gtc`` and ``gtc_stale`` with
``conf/gtc.yaml`` and ``conf/gtc_stale.yaml``, Strom's gradient mode at a fixed tau). First an uninterrupted run; then
the same command again, and halfway between its second and third checkpoint (timed from the first
two writes, whatever the steps cost today) one node's link goes down (``ip link set veth<k> down``
in its namespace). Every rank must exit with status 1 by itself within the collective timeout plus a
stated slack (the diagnosis of who was lost, a few seconds, and the exit), and its last
``train.py: error:`` line must name the problem: the cut node says its own link is down, the others
name the cut rank as lost. Then the link comes back up, the same command with ``--ckpt_path last``
resumes to the same number of steps, and its final checkpoint is compared with the uninterrupted
run's: every tensor with ``torch.equal`` (parameters, optimizer state, schedulers, the strategies'
entries), every other value with ``==``, and every per-rank shard beside the checkpoint (GTC's
residuals, the local-step schemes' models and optimizers).

**straggler.** :func:`gtc_lightning.tools.bench_cluster.run_config` (the benchmark's program: the
acoustic DNN on random frames, every strategy in turn in the same processes, ``nocomm`` as the
compute) with all links at the base rate, then with one node's link at a tenth of it; repeated,
the order alternating, so that each strategy's slowdown comes with its spread. With ``--slow-sleep S``
the straggler is that node's compute instead (it sleeps S seconds before every step, links equal),
and what is compared is the other nodes' step: what ``adpsgd`` keeps and the synchronous
strategies lose.

Example (the README's run)::

    python -m gtc_lightning.tools.faults --down-nodes 2 4 --down-strategies gtc ddp ddp_bf16 gtc_stale ma bmuf \
        bmuf_gtc dpsgd --repeats 3 --md docs/benchmarks/faults.md --json docs/benchmarks/faults.json
    python -m gtc_lightning.tools.faults --stages link_down --down-nodes 4 --down-strategies gtc ddp

Writes ``<out>/faults.json`` and ``<out>/faults.md`` (or ``--json``/``--md``); every run's node logs
and ``cluster.json`` under ``<out>/link_down/n<N>/<strategy>/`` and ``<out>/straggler/rep<r>/<links>/``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shlex
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]  # gtc_lightning/tools/faults.py -> the checkout
TRAIN = REPO / "recipes" / "asr" / "train.py"
TINY = REPO / "conf" / "tiny.yaml"
# What the published runs measured as gtc and gtc_stale: Strom's gradient mode at the recipe's fixed
# tau in 32-bit words, the recipe's configs (the registered names alone are GTCStrategy's defaults:
# automatic tau, Golomb-Rice coding and, with one optimizer, the update mode).
CONFIGS = {"gtc": REPO / "conf" / "gtc.yaml", "gtc_stale": REPO / "conf" / "gtc_stale.yaml"}
ERROR_PREFIX = "train.py: error:"
# checkpoint entries that name run directories or hold wall-clock state, not training state
NOT_COMPARED = ("callbacks", "hyper_parameters", "datamodule_hyper_parameters", "hparams_name",
                "pytorch-lightning_version")


def say(message: str) -> None:
    print(f"[faults] {message}", flush=True)


# ------------------------------------------------------------------------------------ comparison


def is_timer(key: Any, value: Any) -> bool:
    """A wall-clock statistic (``compress_s``, ``exchange_s``, ...: seconds measured, not state)."""
    return isinstance(key, str) and key.endswith("_s") and isinstance(value, float)


def _diff(where: str, a: Any, b: Any, out: list[str], counts: dict[str, int]) -> None:
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        counts["tensors"] += 1
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            out.append(f"{where}: tensor in one, {type(a if not isinstance(a, torch.Tensor) else b).__name__} in the other")
        elif a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            out.append(f"{where}: tensors differ ({a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)})")
    elif isinstance(a, dict) and isinstance(b, dict):
        for key in set(a) ^ set(b):
            out.append(f"{where}/{key}: only in {'the first' if key in a else 'the second'}")
        for key in sorted(set(a) & set(b), key=str):
            if is_timer(key, a[key]) and is_timer(key, b[key]):
                counts["timers"] += 1
                continue
            _diff(f"{where}/{key}", a[key], b[key], out, counts)
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            out.append(f"{where}: {len(a)} items vs {len(b)}")
        for i, (x, y) in enumerate(zip(a, b)):
            _diff(f"{where}[{i}]", x, y, out, counts)
    else:
        counts["values"] += 1
        same = a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))
        if not same:
            out.append(f"{where}: {a!r} vs {b!r}")


def compare_runs(a: Path, b: Path) -> dict[str, Any]:
    """Bit-exact comparison of two final checkpoints and the per-rank shards beside them.

    ``a``, ``b``: the ``last.ckpt`` files. Every directory ``<ckpt>.<name>/`` beside a checkpoint
    (``.gtc``: GTC's residuals; ``.ma``, ``.bmuf``, ...: the local-step schemes' per-rank state)
    is compared file by file. Wall-clock statistics (floats under keys ending in ``_s``) are skipped
    and counted. Returns ``differences`` (empty: bit-exact), the files and the numbers of tensors
    and other values compared and of timers skipped.
    """
    import torch

    a, b = a.resolve(), b.resolve()  # train.py's last.ckpt is a link; the shards sit beside its target
    out: list[str] = []
    counts = {"tensors": 0, "values": 0, "timers": 0}
    files = []
    pairs = [(a, b)]
    shard_dirs = sorted({d.name for ckpt in (a, b) for d in ckpt.parent.glob(ckpt.name + ".*") if d.is_dir()})
    for name in shard_dirs:
        da, db = a.parent / name, b.parent / name
        rel = sorted({p.relative_to(d) for d in (da, db) if d.is_dir() for p in d.rglob("*") if p.is_file()})
        pairs += [(da / r, db / r) for r in rel]
    for fa, fb in pairs:
        label = fa.name if fa == a else f"{fa.parent.name}/{fa.relative_to(fa.parent)}"
        files.append(label)
        if not (fa.is_file() and fb.is_file()):
            out.append(f"{label}: only in {'the first' if fa.is_file() else 'the second'} run")
            continue
        x, y = (torch.load(f, map_location="cpu", weights_only=False) for f in (fa, fb))
        if fa == a:
            x, y = ({k: v for k, v in d.items() if k not in NOT_COMPARED} for d in (x, y))
        _diff(label, x, y, out, counts)
    return {"differences": out, "files": files, **counts}


# ------------------------------------------------------------------------------------- messages


def error_line(log_text: str) -> str | None:
    """The last ``train.py: error:`` line of a rank's log (what it said when it stopped)."""
    lines = [line for line in log_text.splitlines() if line.startswith(ERROR_PREFIX)]
    return lines[-1] if lines else None


def message_is_clear(line: str | None, rank: int, cut_rank: int, interface: str) -> bool:
    """The cut rank says its own link is down; every other rank names the cut rank as lost; all
    print the command that resumes."""
    if not line or "To resume from the last checkpoint: " not in line or not line.endswith("--ckpt_path last"):
        return False
    if rank == cut_rank:
        return f"network link {interface} (GLOO_SOCKET_IFNAME) is down" in line
    return f"lost rank {cut_rank} (" in line


# --------------------------------------------------------------------------------------- link down


def train_command(strategy: str, data_dir: Path, exp_dir: Path, timeout: float, every: int,
                  train_args: list[str]) -> list[str]:
    """``train.py`` on every node: one process each, ``{num_nodes}`` filled in by the cluster; ``gtc`` and
    ``gtc_stale`` with their configs (:data:`CONFIGS`), any other name as ``--trainer.strategy``."""
    chosen = ["--config", str(CONFIGS[strategy])] if strategy in CONFIGS else ["--trainer.strategy", strategy]
    return [sys.executable, str(TRAIN), "--config", str(TINY), *chosen, "--trainer.devices", "1", "--trainer.num_nodes", "{num_nodes}", "--data.data_dir", str(data_dir),
            "--exp_dir", str(exp_dir), "--run_name", strategy, "--num_threads", "1",
            "--checkpoint_every_n_steps", str(every), "--collective_timeout", f"{timeout:g}", *train_args]


def cut_delay(writes: list[float], fraction: float) -> float:
    """Seconds to wait after the second checkpoint write: ``fraction`` of the time between the
    first two (so the cut lands between checkpoints, however fast the steps are today)."""
    return fraction * (writes[1] - writes[0])


class _Watch(threading.Thread):
    """Polls the run's checkpoint file; with ``fraction`` set, takes ``node``'s link down
    :func:`cut_delay` after its second write (Unix time in ``cut_at``)."""

    def __init__(self, cluster, ckpt: Path, node: int, fraction: float | None) -> None:
        super().__init__(name="faults-watch", daemon=True)
        self.cluster, self.ckpt, self.node, self.fraction = cluster, ckpt, node, fraction
        self.writes: list[float] = []  # mtimes of the checkpoint's writes (50 ms apart at least)
        self.cut_at: float | None = None
        self.done = threading.Event()

    def run(self) -> None:
        while self.fraction is not None and len(self.writes) < 2 and not self.done.wait(0.02):
            try:
                mtime = self.ckpt.stat().st_mtime
            except FileNotFoundError:
                continue
            if not self.writes or mtime > self.writes[-1] + 0.05:
                self.writes.append(mtime)
        if len(self.writes) < 2 or self.done.wait(cut_delay(self.writes, self.fraction)):
            return
        self.cluster.set_link(self.node, up=False)
        self.cut_at = time.time()


def _run(cluster, command: list[str], out: Path, ckpt: Path, node: int, fraction: float | None,
         limit: float):
    watch = _Watch(cluster, ckpt, node, fraction)
    watch.start()
    try:
        # grace: the other ranks must end by themselves, so the cluster stops none of them early
        result = cluster.run(command, out, timeout=limit, grace=limit, stream=False)
    finally:
        watch.done.set()
        watch.join()
    return result, watch


def link_down_case(cluster, strategy: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Uninterrupted run, cut run, resume; see the module docstring. Returns the record."""
    import shutil

    import torch

    shutil.rmtree(out, ignore_errors=True)  # an earlier run's checkpoints would be resumed or watched
    node = args.down_node % cluster.nodes
    limit = args.run_limit
    common = {"data_dir": args.data_dir.resolve(), "timeout": args.timeout, "every": args.every,
              "train_args": shlex.split(args.train_args)}
    straight_exp, cut_exp = out / "straight", out / "cut"
    straight = train_command(strategy, exp_dir=straight_exp, **common)
    cut = train_command(strategy, exp_dir=cut_exp, **common)
    ckpt_of = {e: e / strategy / "checkpoints" / "last.ckpt" for e in (straight_exp, cut_exp)}
    record: dict[str, Any] = {"strategy": strategy, "nodes": cluster.nodes, "cut_node": node,
                              "cut_interface": cluster.interfaces[node], "timeout_s": args.timeout,
                              "slack_s": args.slack, "command": shlex.join(cut), "passed": False}

    say(f"{strategy}: uninterrupted run on {cluster.nodes} nodes")
    ref, _ = _run(cluster, straight, out / "straight_logs", ckpt_of[straight_exp], node, None, limit)
    record["straight"] = {"status": ref.status, "wall_s": ref.wall_s}
    if not ref.ok:
        record["problem"] = f"the uninterrupted run failed ({ref.status}); logs in {out / 'straight_logs'}"
        return record

    say(f"{strategy}: the same run, node {node}'s link ({cluster.interfaces[node]}) down between its 2nd and 3rd "
        f"checkpoint; every rank must stop within {args.timeout:g} + {args.slack:g} s")
    res, watch = _run(cluster, cut, out / "cut_logs", ckpt_of[cut_exp], node, args.cut_fraction, limit)
    if len(watch.writes) == 2:
        record["cut_after_second_checkpoint_s"] = round(cut_delay(watch.writes, args.cut_fraction), 3)
    if watch.cut_at is None:
        cluster.set_link(node, up=True, quiet=True)
        record["problem"] = f"the run ended ({res.status}) before the link was cut; give it more steps"
        return record
    ranks = []
    for n in res.nodes:
        for p in n.processes:
            line = error_line(Path(p.log).read_text(errors="replace"))
            after = None if p.ended_at is None else round(p.ended_at - watch.cut_at, 3)
            ranks.append({"rank": p.rank, "node": n.node_rank, "exit_code": p.exit_code, "stopped_by": p.stopped_by,
                          "exit_after_cut_s": after, "message": line, "log": p.log,
                          "clear": message_is_clear(line, p.rank, node, cluster.interfaces[node]),
                          # train.py's status for a lost rank; a signal (an abort in teardown) is a failure
                          "in_time": p.exit_code == 1 and p.stopped_by is None and after is not None
                          and after <= args.timeout + args.slack})
    record["ranks"] = ranks
    saved = torch.load(ckpt_of[cut_exp], map_location="cpu", weights_only=False)
    record["checkpoint_step_at_cut"] = saved["global_step"]
    for r in ranks:
        say(f"{strategy}: rank {r['rank']} exit {r['exit_code']} {r['exit_after_cut_s']} s after the cut"
            f"{' (stopped by the cluster tool)' if r['stopped_by'] else ''}; message "
            f"{'clear' if r['clear'] else 'NOT CLEAR'}: {(r['message'] or '(none)')[:160]}")

    cluster.set_link(node, up=True)
    say(f"{strategy}: resuming from the checkpoint of step {saved['global_step']} (--ckpt_path last)")
    resumed, _ = _run(cluster, [*cut, "--ckpt_path", "last"], out / "resume_logs", ckpt_of[cut_exp], node, None, limit)
    record["resume"] = {"status": resumed.status, "wall_s": resumed.wall_s}
    if not resumed.ok:
        record["problem"] = f"the resumed run failed ({resumed.status}); logs in {out / 'resume_logs'}"
        return record
    final = {e: torch.load(c, map_location="cpu", weights_only=False)["global_step"] for e, c in ckpt_of.items()}
    comparison = compare_runs(ckpt_of[straight_exp], ckpt_of[cut_exp])
    record["final_steps"] = [final[straight_exp], final[cut_exp]]
    record["comparison"] = comparison
    record["bit_exact"] = not comparison["differences"] and final[straight_exp] == final[cut_exp]
    record["passed"] = bool(record["bit_exact"] and all(r["in_time"] and r["clear"] for r in ranks))
    say(f"{strategy}: resumed to step {final[cut_exp]} (uninterrupted: {final[straight_exp]}); "
        f"{'bit-exact' if record['bit_exact'] else 'DIFFERENT'} over {len(comparison['files'])} files, "
        f"{comparison['tensors']} tensors" + "".join(f"\n  {d}" for d in comparison["differences"][:10]))
    return record


def link_down_stage(args: argparse.Namespace) -> list[dict]:
    from gtc_lightning.tools.cluster import Cluster

    records = []
    for nodes in args.down_nodes:
        with Cluster(nodes=nodes, rate=args.rate, verbose=False) as cluster:
            for strategy in args.down_strategies:
                if strategy == "bmuf_gtc" and nodes < 4:
                    say(f"{strategy}: skipped on {nodes} nodes, it needs 2 groups of 2 ranks (4 nodes)")
                    records.append({"strategy": strategy, "nodes": nodes, "skipped": "needs 4 nodes"})
                    continue
                records.append(link_down_case(cluster, strategy, args, args.out / "link_down" / f"n{nodes}" / strategy))
    return records


# --------------------------------------------------------------------------------------- straggler


def straggler_stage(args: argparse.Namespace) -> dict[str, Any]:
    from gtc_lightning.tools import bench_cluster as bc
    from gtc_lightning.tools.cluster import Cluster, parse_rate

    slow_bits = parse_rate(args.rate) / args.slow_factor
    compute = args.slow_sleep > 0  # the straggler's compute (a sleep per step) instead of its link
    slow = f"{args.slow_sleep:g} s of sleep per step" if compute else f"{slow_bits / 1e6:g}mbit"
    nodes = args.straggler_nodes
    node = args.straggler_node % nodes
    bargs = bc.build_parser().parse_args(["--steps", str(args.steps), "--min-steps", str(args.steps),
                                          "--rounds", str(args.rounds)])
    bargs.tau = {}
    names = args.straggler_strategies or bc.available_strategies()
    strategies = bc._strategies_for(nodes, [bc.parse_strategy(s) for s in names])
    say(f"straggler: {args.model} model, {nodes} nodes at {args.rate}, then node {node} with {slow}; "
        f"{', '.join(s['label'] for s in strategies)}; {args.repeats} repeats")
    runs = []
    burst = bc.burst_for(args.rate, bargs.burst_ms)
    with Cluster(nodes=nodes, rate=args.rate, burst=burst, verbose=False) as cluster:
        for rep in range(args.repeats):
            for links in (("equal", "straggler") if rep % 2 == 0 else ("straggler", "equal")):
                cluster.set_rate(args.rate, burst=burst, quiet=True)
                if links == "straggler" and not compute:
                    cluster.set_rate(slow, burst=bc.burst_for(slow, bargs.burst_ms), nodes=[node], quiet=True)
                bargs.slow_rank = node if compute else None  # (one rank a node: the node's rank)
                bargs.slow_sleep = args.slow_sleep if links == "straggler" else 0.0
                bargs.out = args.out / "straggler" / f"rep{rep}" / links
                rec = bc.run_config(cluster, args.model, nodes, args.rate, strategies, bargs)
                # A slow compute: the other ranks' step (the slowest of them); a slow link: rank 0's.
                steps = {r["strategy"]: r["fast_step_s"] if compute else r["step_s"] for r in rec["rows"]}
                runs.append({"repeat": rep, "links": links, "link_rates": list(cluster.link_rates),
                             "status": rec["status"], "wall_s": rec["wall_s"], "load_before": rec["load_before"],
                             "load_after": rec["load_after"], "rows": rec["rows"], "step_s": steps})
                say(f"straggler rep {rep} {links} ({', '.join(cluster.link_rates)}): {rec['status']} in "
                    f"{rec['wall_s']:.0f} s; " + "; ".join(f"{k} {v:.3f} s" for k, v in steps.items()))
    return {"model": args.model, "nodes": nodes, "rate": args.rate, "slow_rate": slow, "slow_node": node,
            "kind": "compute" if compute else "link",
            "strategies": [s["label"] for s in strategies], "runs": runs,
            "summary": summarize_straggler(runs)}


def summarize_straggler(runs: list[dict]) -> list[dict]:
    """Per strategy: step time with equal links and with the straggler (median and range over the
    repeats), and the slowdown straggler / equal of each repeat (median and range)."""
    out = []
    labels = list(dict.fromkeys(k for r in runs for k in r["step_s"]))
    reps = sorted({r["repeat"] for r in runs})
    for label in labels:
        row: dict[str, Any] = {"strategy": label}
        for links in ("equal", "straggler"):
            values = [r["step_s"][label] for r in runs if r["links"] == links and label in r["step_s"]]
            row[links] = {"median": statistics.median(values), "min": min(values), "max": max(values),
                          "values": values} if values else None
        ratios = []
        for rep in reps:
            pair = {r["links"]: r["step_s"].get(label) for r in runs if r["repeat"] == rep}
            if pair.get("equal") and pair.get("straggler"):
                ratios.append(pair["straggler"] / pair["equal"])
        row["slowdown"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
                           "values": ratios} if ratios else None
        out.append(row)
    return out


# ------------------------------------------------------------------------------------------ report


def _spread(d: dict | None, digits: int = 3) -> str:
    if not d:
        return "-"
    if len(d["values"]) == 1:
        return f"{d['median']:.{digits}f}"
    return f"{d['median']:.{digits}f} ({d['min']:.{digits}f}–{d['max']:.{digits}f})"


def _seconds(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def render(results: dict) -> str:
    host = results["host"]
    lines = [
        "# Faults on the emulated cluster",
        "",
        (f"Made by `{results['command']}` on {results['started']} ({results.get('wall_s', 0) / 60:.0f} min). Host: "
        f"{host['cpus']} CPU cores, so all nodes' workers share them; load average {host['load_at_start'][0]:.1f} at "
        f"the start, {host.get('load_at_end', [float('nan')])[0]:.1f} at the end (other jobs ran beside). "
        "Measured numbers only."),
    ]
    down = results.get("link_down")
    if down:
        done = [r for r in down if "skipped" not in r]
        lines += [
            "",
            "## A link taken down mid-training",
            "",
            (f"`recipes/asr/train.py --config conf/tiny.yaml` on the emulated cluster at "
            f"{results['args']['rate']} (`{results['args']['train_args']}`, a checkpoint every "
            f"{results['args']['every']} steps, `--collective_timeout {results['args']['timeout']:g}`); the cut "
            f"node's link taken down (`ip link set veth<k> down` in its namespace) {results['args']['cut_fraction']:g} "
            f"of a checkpoint interval after the run's second checkpoint. Pass: every rank exits with status 1 by itself within timeout + "
            f"{results['args']['slack']:g} s with a clear message, and the resume is bit-exact."),
            "",
            ("| nodes | strategy | cut node | checkpoint step at the cut | ranks' exit codes | seconds from cut to exit | "
            "messages clear | resumed to step | bit-exact (files, tensors) | passed |"),
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in down:
            if "skipped" in r:
                lines.append(f"| {r['nodes']} | {r['strategy']} | skipped: {r['skipped']} | | | | | | | |")
                continue
            ranks = r.get("ranks", [])
            comp = r.get("comparison")
            exact = "-" if comp is None else (f"{'yes' if r['bit_exact'] else '**no**'} "
                                              f"({len(comp['files'])}, {comp['tensors']})")
            lines.append(
                f"| {r['nodes']} | {r['strategy']} | {r['cut_node']} ({r['cut_interface']}) | {r.get('checkpoint_step_at_cut', '-')} "
                f"| {', '.join(str(x['exit_code']) for x in ranks) or '-'} "
                f"| {', '.join(_seconds(x['exit_after_cut_s']) for x in ranks) or '-'} "
                f"| {'yes' if ranks and all(x['clear'] for x in ranks) else '**no**'} "
                f"| {r.get('final_steps', ['-', '-'])[1]} | {exact} | {'yes' if r['passed'] else '**no**'} |")
        for r in done:
            if r.get("problem"):
                lines += ["", f"{r['strategy']}: {r['problem']}"]
        for nodes in dict.fromkeys(r["nodes"] for r in done):
            example = next((r for r in done if r["nodes"] == nodes and r.get("ranks")), None)
            if example:
                lines += ["", (f"What the ranks printed ({example['strategy']}, {nodes} nodes, node "
                          f"{example['cut_node']} cut):"), ""]
                lines += [f"- rank {x['rank']}: `{x['message']}`" for x in example["ranks"]]
    st = results.get("straggler")
    if st and st.get("kind") == "compute":
        lines += [
            "",
            "## A straggler: one node's compute slowed",
            "",
            (f"`gtc_lightning.tools.bench_cluster`'s program ({st['model']} model, 256 frames per worker and step, "
            f"{results['args']['steps']} timed steps per segment, {results['args']['rounds']} rounds, median segment) "
            f"on {st['nodes']} nodes, all links at {st['rate']}: first as they are, then node {st['slow_node']} with "
            f"{st['slow_rate']}; {results['args']['repeats']} repeats, the order alternating. Step seconds of the "
            "other nodes (the slowest of them): median (range) over the repeats; slowdown: straggler / equal within "
            "each repeat."),
            "",
            (f"| strategy | other nodes' step, none slowed (s) | other nodes' step, node {st['slow_node']} slowed (s) "
             "| slowdown |"),
            "|---|---|---|---|",
        ]
        for row in st["summary"]:
            lines.append(f"| {row['strategy']} | {_spread(row['equal'])} | {_spread(row['straggler'])} "
                         f"| {_spread(row['slowdown'], 2)} |")
    elif st:
        lines += [
            "",
            "## A straggler: one link at a tenth of the rate",
            "",
            (f"`gtc_lightning.tools.bench_cluster`'s program ({st['model']} model, 256 frames per worker and step, "
            f"{results['args']['steps']} timed steps per segment, {results['args']['rounds']} rounds, median segment) "
            f"on {st['nodes']} nodes: all links at {st['rate']}, then node {st['slow_node']}'s link at "
            f"{st['slow_rate']} (both ways); {results['args']['repeats']} repeats, the order alternating. Step "
            "seconds: median (range) over the repeats; slowdown: straggler / equal within each repeat."),
            "",
            f"| strategy | step, all at {st['rate']} (s) | step, one at {st['slow_rate']} (s) | slowdown |",
            "|---|---|---|---|",
        ]
        for row in st["summary"]:
            lines.append(f"| {row['strategy']} | {_spread(row['equal'])} | {_spread(row['straggler'])} "
                         f"| {_spread(row['slowdown'], 2)} |")
    bad = [r for r in st["runs"] if r["status"] != "ok"] if st else []
    if bad:
        lines += ["", "Runs that failed: " + ", ".join(f"rep {r['repeat']} {r['links']} ({r['status']})" for r in bad)]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m gtc_lightning.tools.faults", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--stages", nargs="+", choices=["link_down", "straggler"], default=["link_down", "straggler"])
    add("--rate", default="100mbit", help="every link's rate (the straggler's base rate; default 100mbit)")
    add("--out", type=Path, default=Path("exp/faults"), help="logs and results (default exp/faults)")
    add("--md", type=Path, default=None, help="the report (default <out>/faults.md)")
    add("--json", type=Path, default=None, help="the results (default <out>/faults.json)")
    add("--report-only", action="store_true", help="re-render --md from --json")
    g = parser.add_argument_group("link down")
    g.add_argument("--down-nodes", nargs="+", type=int, default=[2],
                   help="emulated nodes, one rank each; several counts run in turn (default 2; bmuf_gtc needs 4)")
    g.add_argument("--down-strategies", nargs="+", default=["gtc"], help="train.py strategies (default gtc)")
    g.add_argument("--down-node", type=int, default=-1, help="whose link goes down (default -1: the last node)")
    g.add_argument("--timeout", type=float, default=20.0, help="train.py --collective_timeout (default 20)")
    g.add_argument("--slack", type=float, default=15.0,
                   help="seconds past the timeout a rank may take to stop: the op in flight may have started just "
                        "after the cut, the diagnosis of who was lost (2.5 s of heartbeats, or up to 2 x 5 s trying "
                        "the store), the exit (default 15)")
    g.add_argument("--every", type=int, default=10, help="--checkpoint_every_n_steps (default 10)")
    g.add_argument("--cut-fraction", type=float, default=0.5,
                   help="cut this fraction of the time between the first two checkpoint writes after the second "
                        "(default 0.5: about halfway between the 2nd and 3rd checkpoint)")
    g.add_argument("--data-dir", type=Path, default=Path("data/synthetic-tiny"),
                   help="the tiny corpus, prepared first if missing (default data/synthetic-tiny)")
    g.add_argument("--train-args", default="--trainer.limit_train_batches 40 --trainer.max_epochs 2",
                   help="more train.py arguments, one string, given as --train-args='...' (default: "
                        "'%(default)s': 40 steps per epoch, 2 epochs)")
    g.add_argument("--run-limit", type=float, default=600.0, help="seconds any one train.py run may take")
    g = parser.add_argument_group("straggler")
    g.add_argument("--straggler-nodes", type=int, default=2, help="emulated nodes, one rank each (default 2)")
    g.add_argument("--straggler-strategies", nargs="+", default=None,
                   help="bench_cluster names (default: every strategy bench_cluster knows that exists)")
    g.add_argument("--model", default="recipe", help="bench_cluster model: recipe, strom or LxH:K (default recipe)")
    g.add_argument("--slow-factor", type=float, default=10.0, help="the straggler's link rate = rate / this")
    g.add_argument("--straggler-node", type=int, default=-1, help="the slow node (default -1: the last)")
    g.add_argument("--slow-sleep", type=float, default=0.0,
                   help="seconds the straggler sleeps before every step: its compute is slowed instead of its link "
                        "(the table then gives the other nodes' step; default 0: the link)")
    g.add_argument("--repeats", type=int, default=2, help="equal/straggler pairs (default 2)")
    g.add_argument("--steps", type=int, default=5, help="timed steps per segment, the same in every run (default 5)")
    g.add_argument("--rounds", type=int, default=2, help="rounds over the strategies per run (default 2)")
    return parser


def prepare_data(data_dir: Path) -> None:
    import subprocess

    if (data_dir / "ali" / "info.json").exists():
        return
    say(f"preparing the tiny corpus into {data_dir} (about a minute)")
    subprocess.run([sys.executable, str(REPO / "recipes" / "asr" / "prepare.py"), "--size", "tiny", "--data-dir",
                    str(data_dir)], check=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.slow_sleep < 0:
        parser.error(f"--slow-sleep is the straggler's sleep per step in seconds (0: slow its link instead); "
                     f"got {args.slow_sleep}")
    md, js = args.md or args.out / "faults.md", args.json or args.out / "faults.json"
    if args.report_only:
        md.write_text(render(json.loads(js.read_text())))
        print(md.read_text())
        return 0
    from gtc_lightning.tools.cluster import missing_privileges, missing_tools

    problem = missing_privileges() or missing_tools()
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    results: dict[str, Any] = {
        "schema": "gtc_lightning.faults/1",
        "command": shlex.join(["python", "-m", "gtc_lightning.tools.faults", *argv]),
        "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": {"cpus": os.cpu_count(), "load_at_start": os.getloadavg()},
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    }

    def save() -> None:
        results["wall_s"] = time.monotonic() - t0
        results["host"]["load_at_end"] = os.getloadavg()
        for path in (js, md):
            path.parent.mkdir(parents=True, exist_ok=True)
        js.write_text(json.dumps(results, indent=1) + "\n")
        md.write_text(render(results))

    from gtc_lightning.tools.cluster import Interrupted

    try:
        if "link_down" in args.stages:
            say(f"stage link_down: {', '.join(args.down_strategies)} on {' and '.join(map(str, args.down_nodes))} nodes")
            prepare_data(args.data_dir)
            results["link_down"] = link_down_stage(args)
            save()
        if "straggler" in args.stages:
            say("stage straggler")
            results["straggler"] = straggler_stage(args)
            save()
    except Interrupted as err:  # the cluster was torn down on the way out
        say(f"stopped by {err.args[0]}; {js} and {md} hold the stages that finished")
        return 128 + err.signum
    print(md.read_text())
    ok = all(r.get("passed") or "skipped" in r for r in results.get("link_down", []))
    ok = ok and all(r["status"] == "ok" for r in results.get("straggler", {}).get("runs", []))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
