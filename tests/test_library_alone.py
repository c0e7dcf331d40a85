"""The library's tests run without the recipe (``pip install -e ".[dev]"``, no ``setup.sh``): a recipe test
is then skipped with the reason, not an error (conftest.py). Checked here by hiding the recipe's packages
from a pytest run in a subprocess (``sys.modules[name] = None`` makes ``import name`` fail as if it were
not installed), and by holding conftest's list of them to pyproject's ``[asr]`` extra."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import RECIPE_PACKAGES

ROOT = Path(__file__).resolve().parents[1]


def _requirement_name(requirement: str) -> str:
    return re.split(r"[\[<>=!~;\s]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_the_recipe_packages_are_the_asr_extra():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    asr, dev = ({_requirement_name(r) for r in extras[name]} for name in ("asr", "dev"))
    assert asr - dev == set(RECIPE_PACKAGES.values()), "conftest.RECIPE_PACKAGES: [asr]'s packages that [dev] lacks"


def test_without_the_recipe_its_tests_are_skipped_with_the_reason():
    """A recipe test module (test_lang.py imports Lhotse) is skipped at collection, a test whose fixture
    builds the recipe's corpus (tiny_aligned) at set-up, each naming what is missing and setup.sh; the
    library's tests beside them run."""
    lightning = {_requirement_name(r) for r in importlib.metadata.requires("lightning") or () if "extra ==" not in r}
    hidden = [name for name, requirement in RECIPE_PACKAGES.items() if requirement not in lightning]  # not tqdm
    hide = "; ".join(f"sys.modules[{name!r}] = None" for name in hidden)
    code = f"import sys; {hide}; import pytest; sys.exit(pytest.main(sys.argv[1:]))"
    proc = subprocess.run(
        [sys.executable, "-c", code, "-q", "-rs", "-p", "no:cacheprovider", "tests/test_lang.py",
         "tests/test_strom_tables.py::test_tables_on_the_tiny_corpus", "tests/test_scaling.py"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    skipped = [line for line in out.splitlines() if line.startswith("SKIPPED")]
    assert len(skipped) == 2, out
    module, fixture = sorted(skipped, key=lambda line: "(lhotse;" not in line or "conftest.py" not in line)
    assert "needs the recipe's packages (lhotse; missing here: lhotse, " in module and "bash setup.sh" in module
    # the fixture's reason: Lhotse, or the TTS engines first where those are missing too
    assert "bash setup.sh" in fixture and ("needs the recipe's packages" in fixture or "TTS engines" in fixture)
    assert re.search(r"\b\d+ passed, 2 skipped in ", out) and " failed" not in out and " error" not in out, out
