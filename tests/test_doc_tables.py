"""Docs that stay true: the tables rendered from JSON match their JSON, and the recipe's results add up.

Every table between ``<!-- NAME: begin ... -->`` and ``<!-- NAME: end -->`` markers in the README, the
recipe's README and RESULTS.md, CHANGELOG.md and docs/ is compared with what ``tests/doc_tables.py``
renders from the JSON in the repository; ``python tests/doc_tables.py`` rewrites the stale ones.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import doc_tables

ROOT = doc_tables.ROOT


@pytest.mark.parametrize("path", doc_tables.files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_tables_are_rendered_from_their_json(path: Path):
    stale = doc_tables.stale(path)
    assert not stale, (
        f"{path.relative_to(ROOT)}: {', '.join(stale)} differ from what their JSON renders "
        f"(or name no known table); regenerate: `{doc_tables.REGENERATE}`"
    )


def test_the_readme_and_results_hold_their_tables():
    readme = [name for name, _ in doc_tables.blocks((ROOT / "README.md").read_text())]
    assert {"model-suite-long-summary", "compat-matrix-short"} <= set(readme), readme
    results = [name for name, _ in doc_tables.blocks((ROOT / "recipes" / "asr" / "RESULTS.md").read_text())]
    assert results == ["recipe-results", "recipe-results-kaldi"], results


def test_every_rendered_table_has_rows():
    for name, render in doc_tables.TABLES.items():
        assert render().count("\n|") >= 3, f"{name} renders no table"


def test_recipe_results_add_up():
    """Each %WER line of RESULTS.json (and RESULTS-kaldi.json): errors = ins + del + sub, and the WER is errors
    over words."""
    for name in ("RESULTS.json", "RESULTS-kaldi.json"):
        snap = json.loads((ROOT / "recipes" / "asr" / name).read_text())
        records = [g[split] for g in snap["gmm"].values() for split in ("dev", "test")]
        records += [d[split] for d in snap["decodes"].values() for split in ("dev", "test")]
        assert records
        for r in records:
            assert r["ins"] + r["del"] + r["sub"] == r["errors"], r
            assert abs(100 * r["errors"] / r["words"] - r["wer"]) < 0.006, r
        runs = {f"{r['run']}/{r['seed']}" for r in snap["comparison"]["runs"]}
        assert runs == set(snap["decodes"]), f"{name}: every compared run needs its decode results"


def test_recipe_results_show_the_lda_mllt_system_and_the_search_when_a_build_has_them(tmp_path):
    """A build with LDA+MLLT (the default) or without (``--no-lda-mllt``), and a recorded search: the LDA+MLLT
    row between tri and SAT or none, and the search under the GMM table; the section of each profile is
    rewritten between its own markers."""
    import copy

    results = doc_tables._load("recipe_results", ROOT / "recipes" / "asr" / "local" / "results.py")
    snap = json.loads(results.SNAPSHOT.read_text())
    assert "lda_mllt" in snap["gmm"]  # the default builds LDA+MLLT before SAT
    plain = results.render(snap)
    without = copy.deepcopy(snap)
    del without["gmm"]["lda_mllt"]
    assert "| lda_mllt |" in plain and "lda_mllt" not in results.render(without)
    # the current build recorded the recipe's search in every system; a build from before the field shows no line
    assert "Every GMM decoding searched with beam 10 and at most 3,000 active states" in plain
    unrecorded = copy.deepcopy(snap)
    for g in unrecorded["gmm"].values():
        for split in ("dev", "test"):
            g[split].pop("search", None)
    assert "Every GMM decoding searched" not in results.render(unrecorded)
    kaldi = copy.deepcopy(snap)
    kaldi["gmm"] = {name: kaldi["gmm"][name] for name in ("mono", "tri")}
    kaldi["gmm"]["lda_mllt"] = copy.deepcopy(snap["gmm"]["tri"])
    kaldi["gmm"]["sat"] = copy.deepcopy(snap["gmm"]["sat"])
    for g in kaldi["gmm"].values():
        g["test"]["search"] = {"beam": 13.0, "max_active": 7000}
    text = results.render(kaldi)
    rows = [line.split(" |")[0] for line in text.splitlines() if line.startswith("| ") and " | " in line]
    assert rows[rows.index("| tri") + 1] == "| lda_mllt" and rows[rows.index("| lda_mllt") + 1] == "| sat"
    assert "Every GMM decoding searched with beam 13 and at most 7,000 active states" in text
    kaldi["gmm"]["mono"]["test"]["search"] = {"beam": 10.0, "max_active": 3000}  # mixed: no single line
    assert "Every GMM decoding searched" not in results.render(kaldi)

    md, path = tmp_path / "RESULTS.md", tmp_path / "kaldi.json"
    begin, end = results.markers("recipe-results-kaldi")
    md.write_text(f"{results.BEGIN}\nold\n{results.END}\n{begin}\nold\n{end}\n")
    path.write_text(json.dumps(snap))
    assert results.update(md, path, "recipe-results-kaldi") and not results.update(md, path, "recipe-results-kaldi")
    assert results.block(md.read_text()) == "old" and results.block(md.read_text(), "recipe-results-kaldi") == plain

def test_ci_runs_the_readme_test_command():
    """`.ci/run` runs exactly the test command the README shows."""
    command = "bash setup.sh && .venv/bin/python -m pytest -q tests"
    assert f"```bash\n{command}\n```" in (ROOT / "README.md").read_text()
    assert command in (ROOT / ".ci" / "run").read_text().splitlines()


def test_the_readme_stays_short():
    """The README is for users (what it is, install, quickstart, settings, what to expect, limits,
    links): about 250 lines; measured results and logs live in the docs and RESULTS.md."""
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= 250, f"README.md has {lines} lines: move detail to docs/ (the guide or benchmarks) and link it"


def test_links_resolve():
    """Every relative link of the README and the recipe's pages names a file of the repository."""
    broken = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "recipes" / "asr").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)", doc.read_text()):
            if not re.match(r"[a-z]+:", target) and not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert not broken, "links to nothing:\n" + "\n".join(broken)


@pytest.mark.parametrize("name", ["model_suite", "model_suite_long", "model_suite_long_mechanisms"])
def test_model_suite_report_is_its_json(name):
    """``docs/benchmarks/{model_suite,model_suite_long}/results.md`` is what the tool renders from the
    ``results.json`` beside it (the long profile's: the runs done so far)."""
    path = ROOT / "docs" / "benchmarks" / name / "results.json"
    md = path.with_suffix(".md")
    assert md.read_text().strip("\n") == doc_tables.model_suite_report(path), (
        f"{md.relative_to(ROOT)} differs from its results.json; rerun the suite, or render the report again "
        "with gtc_lightning.tools.model_suite.report_markdown"
    )

