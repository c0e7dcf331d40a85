"""Pages of the docs site that must follow the code: docs/reference/cli.md shows the ``--help`` of
every command line, each section with the options its command has now, no more and no fewer
(``python docs/cli_help.py`` rewrites the page); docs/reference/api.md documents every name of
``gtc_lightning.__all__``."""

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("cli_help", ROOT / "docs" / "cli_help.py")
cli_help = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cli_help)


def test_cli_page_has_every_command_with_its_options():
    sections = cli_help.page_sections(cli_help.PAGE.read_text())
    assert list(sections) == [title for title, _, _ in cli_help.COMMANDS], "regenerate: python docs/cli_help.py"
    for title, text in cli_help.helps().items():
        now, shown = cli_help.options(text), cli_help.options(sections[title])
        assert now == shown, (
            f"{title}: options added {sorted(now - shown)}, gone {sorted(shown - now)}; "
            "regenerate: python docs/cli_help.py"
        )


def test_api_page_documents_every_public_name():
    import gtc_lightning

    page = (ROOT / "docs" / "reference" / "api.md").read_text()
    documented = set(re.findall(r"^\.\. auto(?:class|function):: gtc_lightning\.(\w+)$", page, flags=re.MULTILINE))
    missing = sorted(set(gtc_lightning.__all__) - documented)
    assert not missing, f"docs/reference/api.md lacks {missing}: add an autoclass/autofunction line for each"
