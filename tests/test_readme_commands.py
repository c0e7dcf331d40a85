"""Docs that stay true: every command shown in a code block of the README, the recipe's README and
RESULTS.md, and the user guide (docs/guide/*.md) still runs.

Each ``python ...`` command (also ``.venv/bin/python``, ``torchrun``/``srun`` before it, environment
variables in front) is run as its quick form: the script or module with ``--help``, which must exit 0
(the project's modules inside this process, scripts in a process of their own);
a script that parses no arguments (``examples/quickstart.py``, which CI runs in full) is compiled
instead. A project console script (``gtc-scaling``) must resolve to a function. A ``bash ...`` command
must name a file that ``bash -n`` parses (it is not run). ``pip install ".[extra]"`` must name an extra of
pyproject.toml. A module outside the project (``pytest``, ``sphinx``) is checked only where installed,
and a recipe script only where the recipe's packages are (not with the library's tests alone, conftest.py).
Placeholders (``my_script.py``, ``your_cli.py``, ``<...>``, ``...``) are skipped.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import runpy
import shlex
import subprocess
import sys
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import entry_points
from importlib.util import find_spec
from pathlib import Path

import pytest
from conftest import MISSING_RECIPE_PACKAGES, RECIPE_PACKAGES

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the pyproject checks are skipped
    tomllib = None

ROOT = Path(__file__).resolve().parents[1]
SHELLS = ("bash", "sh", "console", "shell")
PYTHONS = re.compile(r"^(\S*/)?python3?(\.\d+)?$")
ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
PLACEHOLDER = re.compile(r"(^|/)(my|your)_|<|\.\.\.")
PROJECT_SCRIPTS = {"gtc-scaling", "gtc-model-suite"}


def documents() -> list[Path]:
    docs = [ROOT / "README.md", ROOT / "recipes" / "asr" / "README.md", ROOT / "recipes" / "asr" / "RESULTS.md"]
    return [p for p in docs if p.is_file()] + sorted((ROOT / "docs" / "guide").glob("*.md"))


def code_blocks(text: str) -> list[str]:
    """The shell code blocks of a Markdown text (```bash, ```sh, ```console, ```shell, or no language)."""
    blocks = re.findall(r"^```([A-Za-z]*)[^\n]*\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)
    return [body for lang, body in blocks if lang in SHELLS or lang == ""]


def commands(block: str) -> list[str]:
    """The commands of a shell block: continuation lines joined, comments and prompts dropped, split at
    ``&&``, ``||``, ``;`` and ``|``."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        line = line.strip()
        line = line.removeprefix("$ ")
        line = line.split(" # ", 1)[0].split("\t#", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        out += [part.strip() for part in re.split(r"&&|\|\||;|\|", line) if part.strip()]
    return out


def check_of(command: str) -> tuple[str, list[str]] | None:
    """What to check for one command: ``(kind, argv)``, or ``None`` for a command of no concern."""
    try:
        words = shlex.split(command)
    except ValueError:
        return None
    while words and (ENV.match(words[0]) or words[0] in ("time", "sudo", "exec", "env")):
        words = words[1:]
    if not words:
        return None
    if words[0] in ("torchrun", "srun"):  # the script is the first .py argument
        script = next((w for w in words if w.endswith(".py")), None)
        return ("script", [script]) if script else None
    if words[0] in PROJECT_SCRIPTS or (words[0].startswith("gtc-") and not words[0].endswith(".py")):
        return "console", [words[0]]
    if words[0] == "bash":
        return ("bash", [words[1]]) if len(words) > 1 and not words[1].startswith("-") else None
    if words[0] == "pip" or words[1:3] == ["-m", "pip"]:
        return "pip", words
    if PYTHONS.match(words[0]):
        args = words[1:]
        while args and args[0].startswith("-") and args[0] not in ("-m", "-c"):
            args = args[1:]  # interpreter options (-W ignore is rare; -u, -O, -X ...)
        if not args or args[0] == "-c":
            return None
        if args[0] == "-m":
            return ("module", args[1:]) if len(args) > 1 else None
        return "script", [args[0]]
    return None


def collected() -> dict[tuple[str, str], list[str]]:
    """(kind, target) -> where it was shown, for every command of every document."""
    found: dict[tuple[str, str], list[str]] = {}
    for doc in documents():
        for block in code_blocks(doc.read_text()):
            for command in commands(block):
                check = check_of(command)
                if check is None:
                    continue
                kind, argv = check
                if kind != "pip" and PLACEHOLDER.search(argv[0]):
                    continue
                target = shlex.join(argv) if kind == "pip" else argv[0]
                found.setdefault((kind, target), []).append(f"{doc.relative_to(ROOT)}: {command}")
                if kind == "module" and argv[0] == "pytest":  # the test files and folders it names
                    for arg in argv[1:]:
                        if not arg.startswith("-") and ("/" in arg or arg.endswith(".py") or arg == "tests"):
                            path = arg.split("::", 1)[0]
                            found.setdefault(("path", path), []).append(f"{doc.relative_to(ROOT)}: {command}")
    return found


COMMANDS = collected()


def _parses_arguments(path: Path) -> bool:
    text = path.read_text(errors="replace")
    return any(s in text for s in ("argparse", "ArgumentParser", "LightningCLI", "jsonargparse", "sys.argv"))


def _help(argv: list[str]) -> tuple[int, str]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, *argv, "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=env, check=False)
    return proc.returncode, (proc.stdout + proc.stderr)[-2000:]


_IN_PROCESS = threading.Lock()  # sys.argv and stdout are the process's: one module at a time


def _help_in_process(module: str) -> tuple[int, str]:
    """``python -m module --help`` inside this process (torch is imported once, not per command)."""
    out = io.StringIO()
    with _IN_PROCESS, warnings.catch_warnings(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        warnings.simplefilter("ignore")
        argv, sys.argv = sys.argv, [module, "--help"]
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
        except Exception as error:  # noqa: BLE001 - reported as the command's failure
            code, out = 1, io.StringIO(f"{out.getvalue()}\n{type(error).__name__}: {error}")
        finally:
            sys.argv = argv
    return code, out.getvalue()[-2000:]


def problem(kind: str, target: str) -> str | None:
    """Why the command is broken, or ``None``."""
    if kind == "bash":
        path = ROOT / target
        if not path.is_file():
            return f"{target}: no such file"
        proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, check=False)
        return f"bash -n {target}: {proc.stderr.strip()}" if proc.returncode else None
    if kind == "path":
        return None if (ROOT / target).exists() else f"{target}: no such file or folder"
    if kind == "script":
        path = ROOT / target
        if not path.is_file():
            return f"{target}: no such file"
        if not _parses_arguments(path):
            proc = subprocess.run([sys.executable, "-m", "py_compile", str(path)], capture_output=True,
                                  text=True, check=False)
            return f"{target} does not compile: {proc.stderr.strip()}" if proc.returncode else None
        rc, out = _help([target])
        missing = re.findall(r"No module named '([\w.]+)'", out)
        if rc and missing and RECIPE_PACKAGES.get(missing[-1].split(".")[0]) in MISSING_RECIPE_PACKAGES:
            return None  # a recipe script without the recipe's packages (bash setup.sh): not checked here
        return f"python {target} --help exited {rc}:\n{out}" if rc else None
    if kind == "module":
        top = target.split(".")[0]
        if top not in ("gtc_lightning",) and find_spec(top) is None:
            return None  # a tool from outside the project, not installed here (sphinx without [docs])
        if find_spec(target) is None:
            return f"python -m {target}: no such module"
        if target == "pytest":
            return None
        rc, out = _help_in_process(target) if top == "gtc_lightning" else _help(["-m", target])
        return f"python -m {target} --help exited {rc}:\n{out}" if rc else None
    if kind in ("console", "pip") and tomllib is None:
        return None
    if kind == "console":
        scripts = {ep.name: ep for ep in entry_points(group="console_scripts")}
        declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"].get("scripts", {})
        if target not in declared:
            return f"{target}: not a console script of pyproject.toml"
        if target in scripts:
            scripts[target].load()
        return None
    if kind == "pip":
        extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
        named = set()
        for word in shlex.split(target):
            match = re.search(r"^\.?\[([^\]]+)\]$", word.strip("\"'").lstrip("-e").strip())
            if match:
                named |= {e.strip() for e in match.group(1).split(",")}
        unknown = named - extras
        return f"{target}: no extra {sorted(unknown)} in pyproject.toml ({sorted(extras)})" if unknown else None
    return f"unknown kind {kind}"


def test_documents_show_commands():
    """The README's own commands are found (else the extraction, not the docs, is broken)."""
    kinds = {kind for kind, _ in COMMANDS}
    assert {"bash", "script", "module"} <= kinds, COMMANDS
    assert ("bash", "setup.sh") in COMMANDS and ("bash", "recipes/asr/run.sh") in COMMANDS


def test_every_command_shown_still_runs():
    """All commands at once, two at a time: each ``--help`` starts a Python with torch (a few seconds)."""
    items = sorted(COMMANDS)
    with ThreadPoolExecutor(max_workers=2) as pool:
        problems = list(pool.map(lambda item: problem(*item), items))
    broken = [
        f"{p}\n  shown in: " + "; ".join(COMMANDS[item][:3])
        for item, p in zip(items, problems) if p is not None
    ]
    assert not broken, "commands in the docs that no longer run:\n" + "\n".join(broken)


@pytest.mark.parametrize("block, expected", [
    ("stage=9 bash recipes/asr/run.sh\n", [("bash", ["recipes/asr/run.sh"])]),
    (".venv/bin/python -m gtc_lightning.tools.cluster --nodes 4 -- \\\n  .venv/bin/python recipes/asr/train.py\n",
     [("module", ["gtc_lightning.tools.cluster", "--nodes", "4", "--", ".venv/bin/python", "recipes/asr/train.py"])]),
    ("bash setup.sh && .venv/bin/python -m pytest -q tests\n",
     [("bash", ["setup.sh"]), ("module", ["pytest", "-q", "tests"])]),
    ("torchrun --nnodes 2 recipes/asr/train.py --strategy gtc\n", [("script", ["recipes/asr/train.py"])]),
    ("# a comment\npython examples/quickstart.py   # 2 ranks\n", [("script", ["examples/quickstart.py"])]),
])
def test_extraction(block, expected):
    assert [check_of(c) for c in commands(block)] == expected
