#!/usr/bin/env python3
"""Strom's Tables 3 and 4 (Interspeech 2015) on this recipe: GTC's threshold tau and the model size
against the update size and the compression ratio, with frame accuracy and WER.

Table 3: one single-device baseline and one GTC run (2 workers, the recipe's global batch) per tau,
all with the same epochs, seed and data; each run is decoded (``evaluate.py``: acoustic scale
chosen on dev, test decoded once) and compared with the baseline. Table 4: GTC at one tau for the
recipe's 5 x 512 DNN and larger ones (Strom's 5 hidden layers of 2x and 3x size, 8 hidden layers),
each trained for ``--size-steps`` optimizer steps: the update size and the compression ratio after
that many steps (no WER: the larger models would need the full schedule).

Runs go to ``<exp-dir>/tau<tau>``, ``<exp-dir>/size_<L>x<H>``; a run whose ``train_summary.json``
exists is not trained again (and a decoded one not decoded again), so an interrupted command picks
up where it stopped. Writes ``<exp-dir>/tables.md`` and ``tables.json``, with Strom's numbers beside
ours.

Usage:
  python recipes/asr/research/strom_tables.py                                    # default corpus, both tables
  python recipes/asr/research/strom_tables.py --taus 0.01 0.04 --sizes 5x512 5x1024 --epochs 2 --size-steps 200
  python recipes/asr/research/strom_tables.py --tables 4 --data-dir data/synthetic-default
  python recipes/asr/research/strom_tables.py --train-args "--config conf/tiny.yaml" --taus 0.01 --sizes 2x32 --epochs 1
  # Table 3 over seeds: one call per seed (--seed N --exp-dir exp/strom/seedN), then
  python recipes/asr/evaluate.py --compare-only --baseline baseline --out exp/strom/compare \\
      --runs exp/strom/seed*/{baseline,tau*}
  python recipes/asr/research/strom_tables.py --combine exp/strom/compare/comparison.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
TRAIN = REPO / "recipes" / "asr" / "train.py"
EVALUATE = REPO / "recipes" / "asr" / "evaluate.py"
log = logging.getLogger("strom_tables")

# Strom 2015, 40 nodes, epochs 2-10 (Table 3) and 80 nodes (Table 4): 14.6 M weights, 1024 frames per node.
STROM_TABLE3 = [  # tau, frames/s, update KB per mini-batch, compression ratio, elapsed min, relative WER reduction %
    (2.0, 303_000, 210, 278, 182, 1.8), (4.0, 331_000, 69, 846, 180, 1.6), (6.0, 334_000, 33, 1_770, 179, 1.1),
    (9.0, 335_000, 15, 3_893, 179, 0.2), (12.0, 335_000, 7.8, 7_487, 165, -0.5), (15.0, 341_000, 4.5, 12_978, 162, -1.9),
]
STROM_TABLE4 = [  # layers, weights M, frames/s, compression ratio, elapsed min, relative WER reduction %
    ("5 hidden layers", 14.6, 331_000, 846, 180, 1.6), ("8 hidden layers", 21.7, 186_000, 998, 247, 4.2),
    ("5 hidden layers of 2x size", 23.7, 213_000, 1_436, 259, 2.8),
    ("5 hidden layers of 3x size", 48.8, 109_000, 2_871, 508, 4.1),
]


def parse_size(text: str) -> tuple[int, int]:
    """``5x512`` -> (5 hidden layers, 512 units)."""
    try:
        layers, hidden = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--sizes: {text!r} is not LAYERSxUNITS, e.g. 5x512") from None
    if layers < 1 or hidden < 1:
        raise argparse.ArgumentTypeError(f"--sizes: {text!r} needs at least 1 layer of 1 unit")
    return layers, hidden


# What a launcher puts in the environment: each run here launches its own ranks, so none may be
# inherited (with LOCAL_RANK set, Lightning would take a run for an externally launched rank and
# wait for a second process that never comes).
LAUNCHER_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK",
                "LOCAL_WORLD_SIZE")


def _run(cmd: list[str], what: str) -> None:
    log.info("%s: %s", what, " ".join(cmd))
    start = time.monotonic()
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    proc = subprocess.run(cmd, cwd=REPO, check=False, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"strom_tables: {what} failed (exit {proc.returncode}); command: {' '.join(cmd)}")
    log.info("%s: done in %.0f s", what, time.monotonic() - start)


def train(run_dir: Path, extra: list[str], args: argparse.Namespace, what: str) -> dict:
    """Train one run unless its summary exists; return the summary."""
    summary = run_dir / "train_summary.json"
    if not summary.exists():
        cmd = [sys.executable, str(TRAIN), *shlex.split(args.train_args), *extra, "--data.data_dir", str(args.data_dir),
               "--exp_dir", str(run_dir.parent), "--run_name", run_dir.name,
               "--seed_everything", str(args.seed), "--data.seed", str(args.seed)]  # fmt: skip
        _run(cmd, what)
        if not summary.exists():
            raise SystemExit(f"strom_tables: {what} ended without {summary}")
    else:
        log.info("%s: %s exists, not trained again", what, summary)
    return json.loads(summary.read_text())


def gtc_args(tau: float, args: argparse.Namespace) -> list[str]:
    """Strom's scheme at ``tau``: the gradient mode at a fixed tau in 32-bit words (conf/gtc.yaml's, said
    here too: GTCStrategy's defaults are automatic tau, Golomb-Rice coding and the update mode), then
    ``--gtc-args``."""
    init = "--trainer.strategy.init_args"
    return ["--config", str(REPO / "conf" / "gtc.yaml"), f"{init}.tau", str(tau), f"{init}.compress", "gradient",
            f"{init}.coding", "none", *shlex.split(args.gtc_args)]


def update_stats(summary: dict) -> dict:
    """Per worker and optimizer step over the whole run: bytes sent and Strom's compression ratio."""
    total = summary["gtc"]["total"]
    steps = max(total["steps"], 1)
    return {
        "bytes_per_step": total["bytes_sent"] / steps,
        "words_per_step": total["words"] / steps,
        "ratio_fp32": total["ratio_fp32"],  # full fp32 gradient bytes / bytes sent (Strom's measure)
        "ratio_bf16": total["ratio_bf16"],
        "density": total["words"] / steps / summary["num_weights"],
        "dense_steps": total["dense_steps"],
    }


def table3(args: argparse.Namespace) -> dict:
    base_dir = args.exp_dir / "baseline"
    epochs = ["--trainer.max_epochs", str(args.epochs)]
    train(base_dir, ["--config", str(REPO / "conf" / "baseline.yaml"), *epochs], args, "table 3 baseline")
    runs = []
    for tau in args.taus:
        run_dir = args.exp_dir / f"tau{tau:g}"
        summary = train(run_dir, [*gtc_args(tau, args), *epochs], args, f"table 3 tau={tau:g}")
        runs.append((tau, run_dir, summary))
    dirs = [str(base_dir)] + [str(d) for _, d, _ in runs]
    if args.decode:
        _run([sys.executable, str(EVALUATE), "--runs", *dirs, "--out", str(args.exp_dir / "compare"),
              "--skip-decoded", "--baseline", "baseline", *shlex.split(args.eval_args)], "table 3 decoding")  # fmt: skip
        rows = {r["run"]: r for r in json.loads((args.exp_dir / "compare" / "comparison.json").read_text())["runs"]}
    else:
        rows = {}
    base = json.loads((base_dir / "train_summary.json").read_text())
    base_row = rows.get("baseline", {})
    out = {"baseline": {"dev_frame_acc": base["dev_frame_acc"][-1], "test_wer": base_row.get("test_wer"),
                        "train_seconds": base["train_seconds"]}, "rows": []}  # fmt: skip
    for tau, run_dir, summary in runs:
        row = rows.get(run_dir.name, {})
        out["rows"].append({
            "tau": tau, "run": str(run_dir), **update_stats(summary),
            "frames_per_s": row.get("frames_per_sec"), "train_seconds": summary["train_seconds"],
            "dev_frame_acc": summary["dev_frame_acc"][-1], "test_wer": row.get("test_wer"),
            "rel_wer_reduction_pct": -row["rel_wer_change_pct"] if row.get("rel_wer_change_pct") is not None else None,
        })  # fmt: skip
    return out


def table4(args: argparse.Namespace) -> dict:
    out = {"tau": args.size_tau, "steps": args.size_steps, "rows": []}
    for layers, hidden in args.sizes:
        run_dir = args.exp_dir / f"size_{layers}x{hidden}"
        extra = [*gtc_args(args.size_tau, args), "--model.num_layers", str(layers), "--model.hidden_dim", str(hidden),
                 "--trainer.max_steps", str(args.size_steps), "--trainer.max_epochs", "-1",
                 "--trainer.val_check_interval", str(args.size_steps), "--trainer.check_val_every_n_epoch", "null"]
        summary = train(run_dir, extra, args, f"table 4 {layers}x{hidden}")
        out["rows"].append({
            "layers": layers, "hidden": hidden, "weights": summary["num_weights"], **update_stats(summary),
            "steps": summary["gtc"]["total"]["steps"], "train_seconds": summary["train_seconds"],
            "dev_frame_acc": summary["dev_frame_acc"][-1] if summary["dev_frame_acc"] else None,
        })  # fmt: skip
    return out


def _num(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def markdown(results: dict) -> str:
    parts = []
    t3 = results.get("table3")
    if t3:
        b = t3["baseline"]
        parts.append(
            f"Table 3 on the recipe: GTC on 2 workers, {results['epochs']} epochs, seed {results['seed']}; baseline "
            f"(1 device, same global batch): dev frame accuracy {b['dev_frame_acc']:.4f}, test WER "
            f"{_num(b['test_wer'], '.2f')} %. Update size: bytes one worker sends per optimizer step "
            "(header + words; on a dense step, where the words would send more than a bf16 all-reduce, header + "
            "a fp32 all-reduce's bytes), mean over the run; compression ratio: fp32 gradient bytes / update "
            "bytes.\n\n| tau | update size per step [KB] | words per step | density | dense steps | compression "
            "ratio | vs bf16 | train s | dev frame acc | test WER % | relative WER reduction % |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|"
        )
        for r in t3["rows"]:
            parts[-1] += (
                f"\n| {r['tau']:g} | {r['bytes_per_step'] / 1000:.1f} | {r['words_per_step']:,.0f} | "
                f"{r['density']:.2e} | {r['dense_steps']} | {r['ratio_fp32']:,.0f} | {r['ratio_bf16']:,.0f} | "
                f"{r['train_seconds']:.0f} | "
                f"{r['dev_frame_acc']:.4f} | {_num(r['test_wer'], '.2f')} | {_num(r['rel_wer_reduction_pct'], '+.1f')} |"
            )
        parts.append(
            "Strom's Table 3 (40 nodes, epochs 2-10, 14.6 M weights):\n\n| tau | frames/s | update size per "
            "mini-batch [KB] | compression ratio | elapsed [min] | relative WER reduction % |\n|---|---|---|---|---|---|\n"
            + "\n".join(f"| {t:g} | {f:,} | {kb:g} | {c:,} | {m} | {w:+.1f} |" for t, f, kb, c, m, w in STROM_TABLE3)
        )
    t4 = results.get("table4")
    if t4:
        parts.append(
            f"Table 4 on the recipe: GTC on 2 workers at tau = {t4['tau']:g}, {t4['steps']} optimizer steps per "
            "model; update size and compression ratio are means over those steps.\n\n"
            "| hidden layers x units | weights [M] | update size per step [KB] | words per step | density | "
            "dense steps | compression ratio | train s | dev frame acc |\n|---|---|---|---|---|---|---|---|---|\n"
            + "\n".join(
                f"| {r['layers']} x {r['hidden']} | {r['weights'] / 1e6:.2f} | {r['bytes_per_step'] / 1000:.1f} | "
                f"{r['words_per_step']:,.0f} | {r['density']:.2e} | {r['dense_steps']} | {r['ratio_fp32']:,.0f} | "
                f"{r['train_seconds']:.0f} | "
                f"{_num(r['dev_frame_acc'], '.4f')} |"
                for r in t4["rows"]
            )
        )
        parts.append(
            "Strom's Table 4 (80 nodes, tau = 4):\n\n| layers | weights [M] | frames/s | compression ratio | "
            "elapsed [min] | relative WER reduction % |\n|---|---|---|---|---|---|\n"
            + "\n".join(f"| {n} | {w} | {f:,} | {c:,} | {m} | {r:+.1f} |" for n, w, f, c, m, r in STROM_TABLE4)
        )
    return "\n\n".join(parts) + "\n"


def combined_table3(comparison: dict) -> str:
    """Table 3 over several seeds, from ``evaluate.py --compare-only --baseline baseline`` over the
    seeds' runs (its ``comparison.json``): per tau the range of update size, words and compression
    over the seeds, dev frame accuracy and test WER per seed, the mean test WER with its 95 %
    interval and the paired relative change against the baseline of the same seeds."""
    intervals = comparison["intervals"]["runs"]
    runs: dict[str, list[dict]] = {}
    for r in comparison["runs"]:
        runs.setdefault(r["run"], []).append(r)
    if "baseline" not in runs:
        raise SystemExit("strom_tables --combine: the comparison has no run named 'baseline'; build it with "
                         "evaluate.py --compare-only --baseline baseline --runs <exp>/seed*/{baseline,tau*}")
    seeds = "/".join(str(s) for s in sorted({r["seed"] for r in comparison["runs"]}))
    taus = sorted((n for n in runs if n != "baseline" and runs[n][0].get("tau") is not None),
                  key=lambda n: runs[n][0]["tau"])

    def span(values: list[float], fmt: str) -> str:
        return f"{min(values):{fmt}}-{max(values):{fmt}}"

    header = (f"| τ | update size per step | words per step | compression | dev frame acc. (seeds {seeds}) | "
              f"test WER (seeds {seeds}) | mean test WER | vs baseline, paired |")
    lines = [header, "|---|---|---|---|---|---|---|---|"]
    for name in ["baseline", *taus]:
        rs = sorted(runs[name], key=lambda r: r["seed"])
        dev = "/".join(f"{100 * r['dev_frame_acc']:.2f}" for r in rs) + " %"
        wer = "/".join(f"{r['test_wer']:.2f}" for r in rs) + " %"
        m = intervals[name]["mean"]
        mean = f"{m['wer']:.2f} % [{m['lo']:.2f}, {m['hi']:.2f}]"
        if name == "baseline":
            lines.append(f"| baseline (1 device) | – | – | – | {dev} | {wer} | {mean} | – |")
            continue
        vs = intervals[name]["vs_baseline"]["mean"]
        lines.append(
            f"| {rs[0]['tau']:g} | {span([r['bytes_per_step'] / 1000 for r in rs], '.1f')} KB | "
            f"{span([r['words_per_step'] for r in rs], ',.0f')} | {span([r['ratio_fp32'] for r in rs], ',.0f')}× | "
            f"{dev} | {wer} | {mean} | {vs['rel_pct']:+.1f} % [{vs['rel_lo']:+.1f}, {vs['rel_hi']:+.1f}] |")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", type=Path, default=Path("data/synthetic-default"),
                   help="prepared recipe data (prepare.py runs first when its alignments are missing)")
    p.add_argument("--exp-dir", type=Path, default=Path("exp/strom_tables"), help="runs and tables go here")
    p.add_argument("--tables", nargs="+", choices=["3", "4"], default=["3", "4"])
    p.add_argument("--taus", type=float, nargs="+", default=[0.005, 0.01, 0.02, 0.04, 0.08],
                   help="Table 3's thresholds (default 0.005 0.01 0.02 0.04 0.08)")
    p.add_argument("--epochs", type=int, default=4, help="epochs of every Table 3 run (default 4, the recipe's)")
    p.add_argument("--sizes", type=parse_size, nargs="+", default=[(5, 512), (8, 512), (5, 1024), (5, 1536)],
                   help="Table 4's models as LAYERSxUNITS (default 5x512 8x512 5x1024 5x1536)")
    p.add_argument("--size-tau", type=float, default=0.01, help="Table 4's threshold (default 0.01)")
    p.add_argument("--size-steps", type=int, default=300, help="optimizer steps per Table 4 model (default 300)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-decode", dest="decode", action="store_false", help="Table 3 without WER (no decoding)")
    p.add_argument("--train-args", default="", help="more train.py arguments, before the table's own "
                   "(e.g. '--config conf/tiny.yaml' or '--trainer.limit_train_batches 200')")
    p.add_argument("--gtc-args", default="", help="more train.py arguments for the GTC runs only, after conf/gtc.yaml "
                   "(e.g. '--trainer.strategy.init_args.start_method fork': the second rank forked, not started anew)")
    p.add_argument("--eval-args", default="", help="more evaluate.py arguments (e.g. '--jobs 1 --beam 8')")
    p.add_argument("--combine", type=Path, metavar="COMPARISON_JSON",
                   help="only print Table 3 over several seeds from evaluate.py's comparison.json of their runs")
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = build_parser().parse_args(argv)
    if args.combine:
        if not args.combine.exists():
            raise SystemExit(f"strom_tables --combine: no such file {args.combine}; run evaluate.py --compare-only "
                             "--baseline baseline --out DIR --runs <exp>/seed*/{baseline,tau*} first (DIR/comparison.json)")
        print(combined_table3(json.loads(args.combine.read_text())), end="")
        return 0
    bad = [t for t in args.taus + [args.size_tau] if not t > 0]
    if bad or args.epochs < 1 or args.size_steps < 1:
        raise SystemExit(f"strom_tables: need tau > 0 (got {bad}), --epochs >= 1 and --size-steps >= 1")
    args.exp_dir.mkdir(parents=True, exist_ok=True)
    results = {"epochs": args.epochs, "seed": args.seed, "data_dir": str(args.data_dir)}
    if "3" in args.tables:
        results["table3"] = table3(args)
    if "4" in args.tables:
        results["table4"] = table4(args)
    (args.exp_dir / "tables.json").write_text(json.dumps(results, indent=1))
    text = markdown(results)
    (args.exp_dir / "tables.md").write_text(text)
    print(text)
    log.info("tables -> %s, %s", args.exp_dir / "tables.md", args.exp_dir / "tables.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
