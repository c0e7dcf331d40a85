"""The package's layers (docs/architecture.md), read from the imports with ``ast``: each layer imports
only the layers below it, the algorithms never import Lightning, Triton is imported only where its
kernels live (elsewhere only inside the functions that run on CUDA), the runtime never imports the
tools, no private name crosses a module, no import cycle, and a module over 600 lines says why in its
first lines. Also: the 0.1.0 module paths are gone (0.3.0), nothing in the repository still uses one,
and CHANGELOG.md's migration table names each with a home that imports."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "gtc_lightning"
# bottom to top; a module may import its own layer and the layers below
LAYERS = {"ops": 0, "algorithms": 1, "strategies": 2, "": 3, "tools": 4}
TORCH_ONLY = ("ops", "algorithms")
TRITON_FILES = {"gtc_lightning.ops.triton_kernels", "gtc_lightning.ops.rice_kernels"}
MAX_LINES = 600
LENGTH_REASON = "Long file:"  # a module over MAX_LINES says why on a line starting so, near its top
# The module paths of 0.1.0, aliases that warned in 0.2.0 and were removed in 0.3.0 -> their first new home
# (CHANGELOG.md, "Removed: the 0.1.0 module paths", has the whole table).
REMOVED_0_1_0 = {
    "gtc_lightning.auto_tau": "gtc_lightning.algorithms.gtc.auto_tau",
    "gtc_lightning.averaging": "gtc_lightning.strategies.averaging",
    "gtc_lightning.baselines": "gtc_lightning.strategies.baselines",
    "gtc_lightning.bench": "gtc_lightning.tools.bench",
    "gtc_lightning.bench_cluster": "gtc_lightning.tools.bench_cluster",
    "gtc_lightning.bench_exchange": "gtc_lightning.tools.bench_exchange",
    "gtc_lightning.bench_step": "gtc_lightning.tools.bench_step",
    "gtc_lightning.bmuf": "gtc_lightning.strategies.bmuf",
    "gtc_lightning.checkpoint": "gtc_lightning.strategies.checkpoint",
    "gtc_lightning.cluster": "gtc_lightning.tools.cluster",
    "gtc_lightning.dpsgd": "gtc_lightning.strategies.dpsgd",
    "gtc_lightning.fabric": "gtc_lightning.strategies.fabric",
    "gtc_lightning.faults": "gtc_lightning.tools.faults",
    "gtc_lightning.hook": "gtc_lightning.algorithms.gtc.hook",
    "gtc_lightning.scaling": "gtc_lightning.tools.scaling",
    "gtc_lightning.simulate": "gtc_lightning.tools.simulate",
    "gtc_lightning.soak": "gtc_lightning.tools.soak",
    "gtc_lightning.stale": "gtc_lightning.algorithms.gtc.stale",
    "gtc_lightning.strategy": "gtc_lightning.strategies.gtc",
    "gtc_lightning.update": "gtc_lightning.algorithms.gtc.update",
}
OLD_NAMES = "|".join(sorted((old.rpartition(".")[2] for old in REMOVED_0_1_0), key=len, reverse=True))
# gtc_lightning.<old> as a module, a class path or python -m's argument; not gtc_lightning.tools.bench, not a
# JSON schema's "gtc_lightning.faults/1" (a format's name), not a file path gtc_lightning/faults.py
OLD_PATH = re.compile(rf"\bgtc_lightning\.({OLD_NAMES})\b(?![/\w])")
OLD_FROM_IMPORT = re.compile(rf"\bfrom\s+gtc_lightning\s+import\s+\(?\s*(?:\w+(?:\s+as\s+\w+)?\s*,\s*)*({OLD_NAMES})\b")
SCANNED = (".py", ".md", ".yaml", ".yml", ".sh", ".toml", ".cfg", ".txt", ".rst")


def _name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def layer(module: str) -> str:
    """``ops``, ``algorithms``, ``strategies``, ``tools``, or ``""`` for the package itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else ""


def imports(path: Path) -> list[tuple[str, list[str], bool, int]]:
    """``(module, names, at module level, line)`` of every import in ``path`` (``from gtc_lightning
    import tools`` is the module ``gtc_lightning.tools``, a module of the package's)."""
    tree = ast.parse(path.read_text(), str(path))
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, [], id(node) in top, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, f"{path}:{node.lineno}: relative import; the package imports by full name"
            names = [alias.name for alias in node.names]
            submodules = [f"{node.module}.{n}" for n in names if f"{node.module}.{n}" in MODULES]
            if submodules:
                found += [(m, [], id(node) in top, node.lineno) for m in submodules]
                names = [n for n in names if f"{node.module}.{n}" not in submodules]
            if names or not submodules:
                found.append((node.module, names, id(node) in top, node.lineno))
    return found


def own(module: str) -> str | None:
    """The package module ``module`` refers to (itself, or the package it sits in), or None."""
    while module and module not in MODULES:
        module = module.rpartition(".")[0]
    return module or None


def test_the_layers_are_what_the_documentation_says():
    text = (ROOT / "docs" / "architecture.md").read_text()
    for folder in ("gtc_lightning/ops/", "gtc_lightning/algorithms/", "gtc_lightning/strategies/", "gtc_lightning/tools/"):
        assert folder in text
    assert {layer(m) for m in MODULES} == set(LAYERS)


def test_each_layer_imports_only_the_layers_below_it():
    wrong = []
    for module, path in MODULES.items():
        for target, _, _, line in imports(path):
            mine = own(target)
            if mine is None:
                continue
            if LAYERS[layer(mine)] > LAYERS[layer(module)]:
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {layer(module) or 'gtc_lightning'} imports {mine}")
    assert not wrong, "imports up the layers:\n" + "\n".join(wrong)


def test_the_two_algorithm_families_do_not_import_each_other():
    wrong = [
        f"{path.relative_to(ROOT)}:{line}: {target}"
        for module, path in MODULES.items()
        for family, other in (("gtc", "averaging"), ("averaging", "gtc"))
        if module.startswith(f"gtc_lightning.algorithms.{family}")
        for target, _, _, line in imports(path)
        if target.startswith(f"gtc_lightning.algorithms.{other}")
    ]
    assert not wrong, "the families share only algorithms.common and algorithms.hooks:\n" + "\n".join(wrong)


def test_the_algorithms_and_ops_never_import_lightning():
    wrong = [
        f"{path.relative_to(ROOT)}:{line}: {target}"
        for module, path in MODULES.items()
        if layer(module) in TORCH_ONLY
        for target, _, _, line in imports(path)
        if target.split(".")[0] in ("lightning", "pytorch_lightning", "lightning_fabric")
    ]
    assert not wrong, "torch only below strategies/:\n" + "\n".join(wrong)


def test_triton_is_imported_only_where_its_kernels_run():
    """At module level only the kernel files import Triton (or them); anything else imports them inside
    the function that runs on CUDA, so a CPU run without Triton installed never needs it."""
    wrong = [
        f"{path.relative_to(ROOT)}:{line}: {target}"
        for module, path in MODULES.items()
        if module not in TRITON_FILES
        for target, _, top, line in imports(path)
        if top and (target.split(".")[0] == "triton" or target in TRITON_FILES)
    ]
    assert not wrong, "module-level Triton imports outside the kernel files:\n" + "\n".join(wrong)


def test_the_runtime_never_imports_the_tools():
    wrong = [
        f"{path.relative_to(ROOT)}:{line}: {target}"
        for module, path in MODULES.items()
        if layer(module) != "tools"
        for target, _, _, line in imports(path)
        if (own(target) or "").startswith("gtc_lightning.tools")
    ]
    assert not wrong, "\n".join(wrong)


def test_no_private_name_crosses_a_module():
    sources = {**MODULES, **{p.stem: p for p in (ROOT / "recipes").rglob("*.py")}, **{p.stem: p for p in (ROOT / "tests").glob("*.py")}}
    wrong = [
        f"{path.relative_to(ROOT)}:{line}: from {target} import {name}"
        for path in sources.values()
        for target, names, _, line in imports(path)
        if target.startswith("gtc_lightning")
        for name in names
        if name.startswith("_") and not name.startswith("__")
    ]
    assert not wrong, "a name starting with _ stays in its module; make it public where it lives:\n" + "\n".join(wrong)


def test_no_import_cycles():
    graph = {
        module: {own(target) for target, _, _, _ in imports(path)} & set(MODULES) - {module}
        for module, path in MODULES.items()
    }
    # a package's __init__ re-exporting its own modules is not a cycle of theirs
    for module, targets in graph.items():  # importing a.b.c runs a/__init__.py first: not an edge of c's
        graph[module] = {t for t in targets if not module.startswith(f"{t}.")}
    done, path, cycles = set(), [], []

    def visit(node: str) -> None:
        if node in path:
            cycles.append(" -> ".join([*path[path.index(node):], node]))
            return
        if node in done:
            return
        path.append(node)
        for nxt in sorted(graph[node]):
            visit(nxt)
        path.pop()
        done.add(node)

    for module in sorted(graph):
        visit(module)
    assert not cycles, "\n".join(cycles)


def test_a_long_module_says_why_in_its_first_lines():
    wrong = []
    for path in MODULES.values():
        lines = path.read_text().splitlines()
        if len(lines) > MAX_LINES and not any(line.lstrip().startswith(LENGTH_REASON) for line in lines[:40]):
            wrong.append(f"{path.relative_to(ROOT)}: {len(lines)} lines")
    assert not wrong, f"over {MAX_LINES} lines without a '{LENGTH_REASON}' line near the top:\n" + "\n".join(wrong)


@pytest.mark.parametrize("old, new", sorted(REMOVED_0_1_0.items()))
def test_the_0_1_0_module_paths_are_gone(old, new):
    sys.modules.pop(old, None)
    with pytest.raises(ModuleNotFoundError, match=re.escape(old)):
        importlib.import_module(old)
    assert importlib.import_module(new).__name__ == new
    assert not (PACKAGE / f"{old.rpartition('.')[2]}.py").exists()


def test_python_m_of_an_old_path_fails_and_its_new_path_runs():
    """``python -m`` finds a module by its spec: the old path has none (it fails with "No module named"),
    the new one has (its ``--help`` runs in test_site_pages, with every tool's)."""
    assert importlib.util.find_spec("gtc_lightning.scaling") is None
    assert importlib.util.find_spec("gtc_lightning.tools.scaling") is not None


def _files() -> list[Path]:
    """The repository's text files (tracked and untracked but not ignored; every file under the checkout,
    less the usual outputs, where git is missing)."""
    try:
        out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.splitlines()  # fmt: skip
        paths = [ROOT / line for line in out]
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", ".venv", "build", "_build", "data", "exp", "node_modules", "__pycache__"}
        paths = [p for p in ROOT.rglob("*") if not skip & set(p.relative_to(ROOT).parts)]
    return [p for p in paths if p.suffix in SCANNED and p.is_file() and p != Path(__file__).resolve()]


def old_uses(text: str) -> list[tuple[int, str]]:
    """``(line, match)`` of every use of a 0.1.0 module path in ``text``."""
    found = [(m.start(), m.group(0)) for m in OLD_PATH.finditer(text)]
    found += [(m.start(), m.group(0)) for m in OLD_FROM_IMPORT.finditer(text)]
    return sorted((text.count("\n", 0, start) + 1, match) for start, match in found)


def code_blocks(text: str) -> str:
    """The fenced code blocks of a Markdown text, the rest blanked (line numbers kept)."""
    parts = re.split(r"(^```.*?^```)", text, flags=re.MULTILINE | re.DOTALL)
    return "".join(part if part.startswith("```") else re.sub(r"[^\n]", " ", part) for part in parts)


@pytest.mark.parametrize("text, expected", [
    ("python -m gtc_lightning.faults --stages x", ["gtc_lightning.faults"]),
    ("class_path: gtc_lightning.strategy.GTCStrategy", ["gtc_lightning.strategy"]),
    ("from gtc_lightning import GTCStrategy, hook", ["from gtc_lightning import GTCStrategy, hook"]),
    ("from gtc_lightning import (\n    GTCState,\n    stale,\n)", ["from gtc_lightning import (\n    GTCState,\n    stale"]),
    ("import gtc_lightning.bench_step as b", ["gtc_lightning.bench_step"]),
    ("python -m gtc_lightning.tools.bench --rice; gtc_lightning.tools.faults", []),
    ('"schema": "gtc_lightning.faults/1", gtc_lightning/faults.py', []),
    ("from gtc_lightning import GTCStrategy\nthe update mode", []),
    ("gtc_lightning.bench_cluster's program", ["gtc_lightning.bench_cluster"]),
])  # fmt: skip
def test_old_uses_finds_the_old_paths_and_only_them(text, expected):
    assert [match for _, match in old_uses(text)] == expected


def test_nothing_in_the_repository_uses_a_0_1_0_path():
    """Code, configs, scripts and docs name the new paths. CHANGELOG.md keeps the old names in its history
    and its migration table: only its code blocks are read."""
    wrong = []
    for path in _files():
        text = path.read_text(errors="replace")
        if path.name == "CHANGELOG.md":
            text = code_blocks(text)
        wrong += [f"{path.relative_to(ROOT)}:{line}: {match}" for line, match in old_uses(text)]
    assert not wrong, "0.1.0 module paths, removed in 0.3.0 (CHANGELOG.md has the new ones):\n" + "\n".join(wrong)


def test_the_changelog_maps_every_old_path_to_a_home_that_imports():
    text = (ROOT / "CHANGELOG.md").read_text()
    section = text[text.index("### Removed: the 0.1.0 module paths"):]
    section = section[:section.index("\n### ", 1)]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("| `gtc_lightning.") else []
        if len(cells) == 2:
            rows[cells[0].strip("`")] = re.findall(r"`(gtc_lightning(?:\.\w+)+)`", cells[1])
    assert set(rows) == set(REMOVED_0_1_0), "one row per removed path"
    for old, homes in rows.items():
        assert homes and homes[0] == REMOVED_0_1_0[old], f"{old}: its first home is {REMOVED_0_1_0[old]}"
        for home in homes:  # every module the row names imports
            assert importlib.import_module(home).__name__ == home, f"{old}: {home}"
