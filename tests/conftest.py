"""Test set-up. TRITON_INTERPRET must be set before anything imports triton.language,
and ``import lightning`` already does (through torch._dynamo): so set it first of all."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "recipes" / "asr"))

import shutil  # noqa: E402

import pytest  # noqa: E402
from fixtures_corpus import tiny_corpus  # noqa: E402,F401  (session fixture)


@pytest.fixture(scope="session")
def tiny_aligned(tiny_corpus, tmp_path_factory) -> Path:  # noqa: F811
    """The tiny corpus taken through every data stage (features, lang, mono, tri, align, report)
    by the real stage runner, once per session. Returns its data dir."""
    from prepare import prepare

    data_dir = tmp_path_factory.mktemp("tiny_aligned")
    shutil.copytree(tiny_corpus, data_dir, dirs_exist_ok=True)
    prepare(corpus="synthetic", size="tiny", data_dir=data_dir, stage=1, stop_stage=6, num_jobs=1)
    return data_dir
