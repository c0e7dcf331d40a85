"""The package's layers (docs/architecture.md), read from the imports with ``ast``: each layer imports
only the layers below it, the algorithms never import Lightning, Triton is imported only where its
kernels live (elsewhere only inside the functions that run on CUDA), the runtime never imports the
tools, no private name crosses a module, no module imports a 0.1.0 alias, no import cycle, and a module
over 600 lines says why in its first lines. Also: the aliases still answer, and warn."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import warnings
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


def _name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


ALIASES = {
    _name(path)
    for path in PACKAGE.glob("*.py")
    if path.name != "__init__.py" and "from gtc_lightning._moved import" in path.read_text()
}
MODULES = {
    _name(path): path
    for path in sorted(PACKAGE.rglob("*.py"))
    if _name(path) not in ALIASES and _name(path) != "gtc_lightning._moved"
}


def layer(module: str) -> str:
    """``ops``, ``algorithms``, ``strategies``, ``tools``, or ``""`` for the package itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else ""


def imports(path: Path) -> list[tuple[str, list[str], bool, int]]:
    """``(module, names, at module level, line)`` of every import in ``path`` (``from gtc_lightning
    import hook`` is the module ``gtc_lightning.hook`` when that is one)."""
    tree = ast.parse(path.read_text(), str(path))
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, [], id(node) in top, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, f"{path}:{node.lineno}: relative import; the package imports by full name"
            names = [alias.name for alias in node.names]
            submodules = [f"{node.module}.{n}" for n in names if f"{node.module}.{n}" in MODULES | dict.fromkeys(ALIASES)]
            if submodules:
                found += [(m, [], id(node) in top, node.lineno) for m in submodules]
                names = [n for n in names if f"{node.module}.{n}" not in submodules]
            if names or not submodules:
                found.append((node.module, names, id(node) in top, node.lineno))
    return found


def own(module: str) -> str | None:
    """The package module ``module`` refers to (itself, or the package it sits in), or None."""
    while module and module not in MODULES and module not in ALIASES:
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
            if mine is None or mine in ALIASES:
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


def test_nothing_imports_the_0_1_0_aliases():
    sources = [*MODULES.values(), *(ROOT / "recipes").rglob("*.py"), *(ROOT / "tests").glob("*.py"), *(ROOT / "examples").glob("*.py")]
    wrong = [
        f"{path.relative_to(ROOT)}:{line}: {target}"
        for path in sources
        if path.name != "test_layers.py"
        for target, _, _, line in imports(path)
        if own(target) in ALIASES
    ]
    assert not wrong, "import the new paths (CHANGELOG.md):\n" + "\n".join(wrong)


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


@pytest.mark.parametrize("alias", sorted(ALIASES))
def test_every_0_1_0_path_still_imports_and_warns(alias):
    sys.modules.pop(alias, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(alias)
    assert any(issubclass(w.category, DeprecationWarning) and "moved to gtc_lightning." in str(w.message) for w in caught)
    assert dir(module)


def test_old_names_and_python_m_still_work():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from gtc_lightning import hook, strategy
        from gtc_lightning.algorithms.gtc.config import HEADER
        from gtc_lightning.strategies.gtc import GTCStrategy

    assert hook._HEADER == HEADER and strategy.GTCStrategy is GTCStrategy and hook.GTCState.__name__ == "GTCState"
    out = subprocess.run([sys.executable, "-m", "gtc_lightning.scaling", "--help"], capture_output=True, text=True,
                         check=False, cwd=ROOT)  # fmt: skip
    assert out.returncode == 0 and "gtc_lightning.tools.scaling" in out.stdout + out.stderr
