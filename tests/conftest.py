"""Test set-up. TRITON_INTERPRET must be set before anything imports triton.language,
and ``import lightning`` already does (through torch._dynamo): so set it first of all."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "recipes" / "asr"))
