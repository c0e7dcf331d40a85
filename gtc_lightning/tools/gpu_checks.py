"""``python -m gtc_lightning.tools.gpu_checks --out DIR``: every GPU check of the project in one call.

A lent GPU machine is held for minutes, and each start costs one: this runs all that only a GPU can
show, one part after another, each bounded by its own time limit so that the whole fits in
:data:`BUDGET_S` (under the 10 minutes of one call), and writes each part's log and JSON into
``DIR`` with a summary (``summary.json``, and a table on stdout):

1. ``tests``: ``tests/test_cuda.py`` with ``TRITON_INTERPRET=0`` (the kernels against their torch
   twins bit for bit, the update mode's one-pass fold on CUDA, the whole update-mode step against the
   CPU's, replicas bit-identical on 1 rank over NCCL and 2 ranks on one GPU over gloo, adpsgd and BMUF
   on the GPU, ``gtc_hsdp``'s FSDP2 and replicate dimension on 2 ranks sharing the GPU);
2. ``kernels``: ``gtc_lightning.tools.bench`` at 1 M, 14.6 M and 100 M elements with the update mode's
   ``fold_emit_`` and Golomb-Rice coding, each against a device copy of the same bytes (the roofline);
3. ``step``: ``gtc_lightning.tools.bench_step`` on one GPU, one rank: the host cost of a step of each
   strategy against ``nocomm`` (DDP sending nothing), the update mode in one pass and through its
   reference passes (``gtc_update_twopass``) side by side, on the recipe's model and Strom's;
4. ``profile``: the update mode's step on Strom's model under torch's profiler: the host's ops by their
   own time (``profile/*.txt``), to find what of the step's host work to fuse or drop.

Run from the repository root (the device machine has torch, triton, lightning and pytest, and none of
the recipe's packages: nothing here needs them)::

    PYTHONPATH=. python -m gtc_lightning.tools.gpu_checks --out "$OUT"

A part that fails or runs out of time is recorded as such and the next one runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

BUDGET_S = 540  # the whole call: under the 10 minutes one device command may take, with a minute to spare
PARTS = {
    # name: (time limit in seconds, command after the Python executable)
    "tests": (  # 314 s on an H200 (2026-12-04): its Trainer tests take about 30 s each; gtc_hsdp's two since
        390,
        ["-m", "pytest", "--noconftest", "-q", "-p", "no:cacheprovider", "tests/test_cuda.py", "--junitxml", "{out}/tests.xml"],
    ),
    "kernels": (  # 19 s there
        35,
        ["-m", "gtc_lightning.tools.bench", "--sizes", "1M,14.6M,100M", "--density", "1%", "--rice", "--fold",
         "--repeats", "10", "--json", "{out}/kernels.json"],
    ),
    "step": (  # 57 s there
        85,
        ["-m", "gtc_lightning.tools.bench_step", "--accelerator", "gpu", "--world", "1", "--models", "recipe", "strom",
         "--strategies", "ddp", "ddp_bf16", "gtc", "gtc_update", "gtc_update_twopass", "nocomm", "--rounds", "3",
         "--steps", "30", "--warmup", "10", "--batch", "4096", "--precision", "bf16-mixed", "--matmul-precision",
         "high", "--out", "{out}/step.json"],
    ),
    "profile": (  # not yet run on a GPU
        30,
        ["-m", "gtc_lightning.tools.bench_step", "--accelerator", "gpu", "--world", "1", "--models", "strom",
         "--strategies", "gtc_update", "--rounds", "1", "--steps", "20", "--warmup", "10", "--batch", "4096",
         "--precision", "bf16-mixed", "--matmul-precision", "high", "--out", "{out}/profile.json",
         "--profile", "{out}/profile"],
    ),
}  # fmt: skip


def run_part(name: str, limit: float, argv: list[str], out: Path) -> dict:
    """Run one part with ``limit`` seconds; its output goes to ``out/<name>.log``."""
    command = [sys.executable, *(arg.format(out=out) for arg in argv)]
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    with open(out / f"{name}.log", "w") as log:
        log.write("$ " + " ".join(command) + "\n")
        log.flush()
        try:
            code = subprocess.run(
                command, check=False, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=limit
            ).returncode
            status = "passed" if code == 0 else f"failed (exit {code})"
        except subprocess.TimeoutExpired:
            status = f"timed out after {limit:.0f} s"
    seconds = round(time.perf_counter() - start, 1)
    tail = (out / f"{name}.log").read_text().splitlines()[-3:]
    return {"part": name, "status": status, "seconds": seconds, "tail": tail}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for the logs, JSON files and summary.json")
    parser.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(PARTS), help="which parts to run")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_checks: no CUDA device here; these checks need one (see the module's docstring)", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name(0)
    print(f"gpu_checks: {device}, torch {torch.__version__}; parts {', '.join(args.parts)}; budget {BUDGET_S} s", flush=True)
    started, results = time.perf_counter(), []
    for name in args.parts:
        limit, command = PARTS[name]
        left = BUDGET_S - (time.perf_counter() - started)
        if left < 20:
            results.append({"part": name, "status": "not run (budget spent)", "seconds": 0.0, "tail": []})
            continue
        result = run_part(name, min(limit, left), command, args.out)
        results.append(result)
        print(f"  {name}: {result['status']} in {result['seconds']} s", flush=True)
    summary = {"device": device, "torch": torch.__version__, "parts": results}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print("\n| part | status | seconds |\n|---|---|---|")
    for result in results:
        print(f"| {result['part']} | {result['status']} | {result['seconds']} |")
    return 0 if all(r["status"] == "passed" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
