"""``recipes/asr/research/gmm_search.py`` on the tiny corpus: the recipe's search reproduces what the
GMM stages decoded (monophone, and SAT's final pass on its saved transforms), and each search is the
one named."""

import json

import gmm_search
import pytest


@pytest.mark.parametrize("system", ["mono", "sat"])
def test_recipe_search_reproduces_the_stage(tiny_aligned, tmp_path, system):
    stage = json.loads((tiny_aligned / "exp" / system / "decode_dev" / "wer.json").read_text())
    scale = float(min(stage["by_scale"], key=stage["by_scale"].get))  # a scale the stage decoded at penalty 0
    records = gmm_search.sweep(tiny_aligned, system, "dev", [scale], ["recipe", "scaled"], tmp_path)
    recipe, scaled = records
    assert recipe["wer"] == stage["by_scale"][str(scale)]
    assert (recipe["beam"], recipe["max_active"]) == (10.0, 3000)
    assert scaled["beam"] == pytest.approx(13.0 * scale / 0.0833, abs=1e-3) and scaled["max_active"] == 7000
    assert (tmp_path / system / f"errs-dev-acwt{scale:g}-recipe.txt").exists()


def test_searches_and_bad_input(tiny_aligned, tmp_path):
    assert gmm_search.search_at("kaldi", 0.05).record() == {"beam": 13.0, "max_active": 7000}
    assert gmm_search.search_at("recipe7000", 0.05).record() == {"beam": 10.0, "max_active": 7000}
    assert gmm_search.search_at("scaled", 0.0833).beam == pytest.approx(13.0, abs=1e-3)
    with pytest.raises(ValueError, match="search 'wide'"):
        gmm_search.search_at("wide", 0.1)
    built = tmp_path / "data"  # a data dir built with --no-lda-mllt: no exp/lda_mllt
    (built / "exp" / "tri").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="run the lda_mllt stage first"):
        gmm_search.sweep(built, "lda_mllt", "dev", [0.1], ["recipe"], tmp_path)
    with pytest.raises(SystemExit):
        gmm_search.main(["--data-dir", str(tiny_aligned), "--system", "mono", "--scales", "-0.1", "--out",
                         str(tmp_path)])
