"""Test set-up. TRITON_INTERPRET must be set before anything imports triton.language,
and ``import lightning`` already does (through torch._dynamo): so set it first of all."""

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

import shutil

import pytest
import torch

torch.set_num_threads(1)
from fixtures_corpus import tiny_corpus  # noqa: F401  (session fixture)


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
