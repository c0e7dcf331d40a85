"""The library's tests run without the recipe (``pip install -e ".[dev]"``, no ``setup.sh``): a recipe test
is then skipped with the reason, not an error (conftest.py). Checked here by hiding the recipe's packages
from a pytest run in a subprocess (``sys.modules[name] = None`` makes ``import name`` fail as if it were
not installed), and by holding conftest's list of them to pyproject's ``[asr]`` extra. What both suites take
(time, memory, disk) is docs/guide/installation.md's table, rendered here from docs/benchmarks/test_suite.json."""

from __future__ import annotations

import importlib.metadata
import json
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


# --- what the tests take: docs/guide/installation.md's table, rendered from the measurement ---------------

SUITE = ROOT / "docs" / "benchmarks" / "test_suite.json"
INSTALLATION = ROOT / "docs" / "guide" / "installation.md"


def _duration(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes} min {seconds} s" if minutes else f"{seconds} s"


def _size(kib: float) -> str:
    """One decimal in GB from 1 GB up, tens of MB below (sizes in KiB, as du -sk and time -v give them)."""
    gb = kib * 1024 / 1e9
    return f"{gb:.1f} GB" if gb >= 1 else f"{round(kib * 1024 / 1e7) * 10:,} MB"


def suite_table(data: dict) -> list[str]:
    """The table of installation.md's section on the tests, as its lines."""
    full, lib = data["suites"]["full"], data["suites"]["library"]

    def tests(s: dict) -> str:
        why = f"{s['skipped_cuda']:,} CUDA tests, {s['skipped_recipe']:,} of the recipe's" if s["skipped_recipe"] else "the CUDA tests"
        return f"{s['passed']:,} passed, {s['skipped']:,} skipped ({why})"

    def venv(s: dict) -> str:
        return f"{_size(s['venv_kb'])} (torch {_size(s['torch_kb'])}, Triton {_size(s['triton_kb'])})"

    assert all(s["skipped"] == s["skipped_cuda"] + s["skipped_recipe"] and s["failed"] == 0 for s in (full, lib))
    return [
        "| | everything, as CI runs it (`bash setup.sh`) | the library's tests alone (`[dev]`) |",
        "|---|---|---|",
        f"| tests | {tests(full)} | {tests(lib)} |",
        f"| wall time on 2 cores | {_duration(full['wall_s'])} | {_duration(lib['wall_s'])} |",
        f"| memory: the largest process's peak RSS | {_size(full['max_rss_kb'])} | {_size(lib['max_rss_kb'])} |",
        f"| disk: the virtualenv | {venv(full)} | {venv(lib)} |",
        f"| disk: the tests' temporary files | {_size(full['tmp_kb'])} | {_size(lib['tmp_kb'])} |",
        f"| disk: Debian packages | {_size(full['debian_kb'])} (the TTS engines and voices, jemalloc) | none |",
    ]


@pytest.mark.parametrize("kib, text", [(2370008, "2.4 GB"), (1160796, "1.2 GB"), (259540, "270 MB"), (42000, "40 MB")])
def test_sizes_are_rounded_as_the_page_says(kib, text):
    assert _size(kib) == text


def test_the_installation_page_states_the_measured_suites():
    data = json.loads(SUITE.read_text())
    page = INSTALLATION.read_text()
    lines = suite_table(data)
    missing = [line for line in lines if line not in page.splitlines()]
    assert not missing, "docs/guide/installation.md's table, as docs/benchmarks/test_suite.json renders it:\n" + "\n".join(
        lines
    )
    assert f"Measured on {data['measured']}" in page
