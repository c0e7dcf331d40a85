"""Writes docs/reference/cli.md: the ``--help`` of every command line of the project, captured.

Run ``python docs/cli_help.py`` after changing a command line's options; ``tests/test_site_pages.py``
fails when the page lists other options than a command has. ``COLUMNS`` is fixed so the text
wraps the same everywhere.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "reference" / "cli.md"

# (title, the command as a user types it, argv after the interpreter)
RECIPE = [
    ("recipes/asr/prepare.py", "python recipes/asr/prepare.py", ["recipes/asr/prepare.py"]),
    ("recipes/asr/train.py", "python recipes/asr/train.py", ["recipes/asr/train.py"]),
    ("recipes/asr/evaluate.py", "python recipes/asr/evaluate.py", ["recipes/asr/evaluate.py"]),
]
TOOLS = [
    "bench", "bench_step", "bench_exchange", "bench_cluster", "cluster", "faults", "soak", "scaling", "model_suite", "gpu_checks",
    "compare", "bench_hsdp", "bench_hsdp_cluster", "bench_sparseloco",
]
COMMANDS = RECIPE + [
    (f"gtc_lightning.tools.{t}", f"python -m gtc_lightning.tools.{t}", ["-m", f"gtc_lightning.tools.{t}"]) for t in TOOLS
]

INTRO = """# Command lines

The `--help` of every command of the project, captured by `python docs/cli_help.py` (a test fails
when a command's options differ from this page). `train.py` is a LightningCLI: besides its own
options it takes every `Trainer` argument (`--trainer.*`), the model's (`--model.*`) and the data's
(`--data.*`), and `--config FILE.yaml` (the configs are in `conf/`); `--strategy NAME` is its
shortcut for a strategy of the family. The recipe's stages are described in `recipes/asr/README.md`.
`gtc-scaling`, `gtc-model-suite` and `gtc-compare` are the console scripts of
`gtc_lightning.tools.scaling`, `gtc_lightning.tools.model_suite` and `gtc_lightning.tools.compare`.
"""


def capture(argv: list[str]) -> str:
    env = dict(os.environ, COLUMNS="100", PYTHONWARNINGS="ignore")
    result = subprocess.run([sys.executable, *argv, "--help"], check=False, cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} --help exited with {result.returncode}:\n{result.stderr}")
    return result.stdout.rstrip().replace(str(ROOT) + "/", "") + "\n"  # paths relative to the checkout


def helps() -> dict[str, str]:
    """Each command's title -> its ``--help``."""
    with ThreadPoolExecutor(max_workers=4) as pool:
        texts = list(pool.map(capture, [argv for _, _, argv in COMMANDS]))
    return {title: text for (title, _, _), text in zip(COMMANDS, texts)}


def render(texts: dict[str, str]) -> str:
    parts = [INTRO]
    for title, typed, _ in COMMANDS:
        parts.append(f"## `{title}`\n\n`{typed} --help`:\n\n```text\n{texts[title]}```\n")
    return "\n".join(parts)


def options(text: str) -> set[str]:
    """The long options a help text names."""
    return set(re.findall(r"(?<![\w-])--[A-Za-z][\w.-]*", text))


def page_sections(page: str) -> dict[str, str]:
    """Each section's title -> the help text on the page."""
    found = re.findall(r"^## `([^`]+)`\n.*?```text\n(.*?)```", page, flags=re.MULTILINE | re.DOTALL)
    return dict(found)


if __name__ == "__main__":
    PAGE.write_text(render(helps()))
    print(f"{PAGE}: {len(COMMANDS)} commands")
