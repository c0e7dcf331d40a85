"""Sphinx configuration of the gtc-lightning docs.

Build: ``pip install -e ".[docs]"``, then ``python -m sphinx -W --keep-going -b html docs docs/_build/html``
(warnings are errors, as CI builds it). Pages are Markdown (myst-parser); the API reference comes
from the docstrings (autodoc with napoleon for their Google-style ``Args:`` sections).
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout's package, also when it is not installed

import gtc_lightning

project = "gtc-lightning"
author = "The gtc-lightning authors"
copyright = "The gtc-lightning authors (Apache-2.0)"
release = gtc_lightning.__version__
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "**/_build", "benchmarks/model_suite/results.md", "benchmarks/model_suite_long/results.md",
                    "benchmarks/model_suite_long_mechanisms/results.md",
                    "benchmarks/model_suite_long_cnn_budget/results.md"]  # the suite's own output

# Markdown: headings get anchors (links such as page.md#a-section), ::: fences for notes.
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 4

# API reference: members in source order, type hints in the description, Google-style sections.
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# a bare name such as `tau` in a docstring may match several attributes; the first is taken
suppress_warnings = ["ref.python"]

html_theme = "furo"
html_title = f"gtc-lightning {release}"
