"""Pages of the docs site that must follow the code: docs/reference/cli.md shows the ``--help`` of
every command line, each section with the options its command has now, no more and no fewer
(``python docs/cli_help.py`` rewrites the page; the recipe's scripts only where its packages are); docs/reference/api.md documents every name of
``gtc_lightning.__all__``."""

import importlib.util
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import MISSING_RECIPE_PACKAGES, without_the_recipe

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("cli_help", ROOT / "docs" / "cli_help.py")
cli_help = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cli_help)


def help_in_process(module: str) -> str:
    """``python -m module --help``'s output, run in this process (the package is imported once here,
    not once per command); the threads and environment a tool's ``main`` sets are put back."""
    import contextlib
    import io
    import os
    import runpy
    import sys

    import torch

    out, argv, environ, threads = io.StringIO(), sys.argv, dict(os.environ), torch.get_num_threads()
    sys.argv = [module, "--help"]
    os.environ["COLUMNS"] = "100"
    try:
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as stop:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        assert stop.value.code in (0, None), f"{module} --help exited with {stop.value.code}"
    finally:
        sys.argv = argv
        os.environ.clear()
        os.environ.update(environ)
        torch.set_num_threads(threads)
    return out.getvalue()


def check_commands(commands: list[tuple[str, str, list[str]]], in_process: bool = False) -> None:
    sections = cli_help.page_sections(cli_help.PAGE.read_text())
    assert list(sections) == [title for title, _, _ in cli_help.COMMANDS], "regenerate: python docs/cli_help.py"
    if in_process:
        texts = [help_in_process(argv[1]) for _, _, argv in commands]
    else:
        with ThreadPoolExecutor(max_workers=4) as pool:
            texts = list(pool.map(cli_help.capture, [argv for _, _, argv in commands]))
    for (title, _, _), text in zip(commands, texts):
        now, shown = cli_help.options(text), cli_help.options(sections[title])
        assert now == shown, (
            f"{title}: options added {sorted(now - shown)}, gone {sorted(shown - now)}; "
            "regenerate: python docs/cli_help.py"
        )


@pytest.mark.filterwarnings("ignore:'gtc_lightning.tools.*found in sys.modules:RuntimeWarning")  # runpy, as -m
def test_cli_page_has_every_tool_with_its_options():
    check_commands([command for command in cli_help.COMMANDS if command not in cli_help.RECIPE], in_process=True)


def test_cli_page_has_every_recipe_script_with_its_options():
    if MISSING_RECIPE_PACKAGES:  # the library's tests alone (conftest.py)
        pytest.skip(without_the_recipe(MISSING_RECIPE_PACKAGES[0]))
    check_commands(cli_help.RECIPE)


def test_api_page_documents_every_public_name():
    import gtc_lightning

    page = (ROOT / "docs" / "reference" / "api.md").read_text()
    documented = set(re.findall(r"^\.\. auto(?:class|function):: gtc_lightning\.(\w+)$", page, flags=re.MULTILINE))
    missing = sorted(set(gtc_lightning.__all__) - documented)
    assert not missing, f"docs/reference/api.md lacks {missing}: add an autoclass/autofunction line for each"


def test_every_tool_with_a_command_line_is_on_the_cli_page():
    """A module of ``gtc_lightning/tools`` that runs as ``python -m`` is one of the page's commands."""
    tools = ROOT / "gtc_lightning" / "tools"
    runnable = sorted(p.stem for p in tools.glob("*.py") if 'if __name__ == "__main__"' in p.read_text())
    missing = [t for t in runnable if t not in cli_help.TOOLS]
    assert not missing, f"{missing}: add them to TOOLS in docs/cli_help.py and run python docs/cli_help.py"


def test_the_site_includes_the_recipe_readme_and_results():
    """The docs site shows the recipe's README and RESULTS.md as pages (included, so never a stale copy)."""
    index = (ROOT / "docs" / "index.md").read_text()
    for name in ("README", "RESULTS"):
        page = (ROOT / "docs" / "recipe" / f"{name}.md").read_text()
        assert f"```{{include}} ../../recipes/asr/{name}.md" in page and f"recipe/{name}\n" in index


def test_multi_node_torchrun_commands_rendezvous_with_c10d():
    """torchrun across nodes with a rendezvous endpoint needs the c10d backend: the static one gives
    every node rank 0."""
    commands = []
    for page in sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]:
        text = page.read_text().replace("\\\n", " ")
        commands += [(page, line) for line in text.splitlines() if "torchrun" in line and "--rdzv-endpoint" in line]
    assert commands, "no multi-node torchrun command found (the guide's multi_node page has one)"
    bad = [f"{p.relative_to(ROOT)}: {line.strip()}" for p, line in commands if "--rdzv-backend c10d" not in line]
    assert not bad, "add --rdzv-backend c10d:\n" + "\n".join(bad)
