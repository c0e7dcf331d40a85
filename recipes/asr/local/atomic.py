"""Writes that an interrupted run never leaves half done, and workers that never outlive the run.

``prepare.py`` may be killed at any moment (SIGKILL, a lost machine). Three rules make a re-run
give what an uninterrupted run gives:

1. a stage is marked done (``.done/<stage>``) only after it completed;
2. before a stage runs, what it writes is cleared (``prepare.STAGE_OUTPUTS``), so nothing a
   killed run of it left (a truncated manifest, a storage shard of another ``--num-jobs``) is
   taken for its output;
3. files are written under a temporary name beside the target and renamed onto it
   (``os.replace`` is atomic within a file system): a reader sees the old file or the new one,
   never a partial one. Files that several stages share (``dropped.jsonl``, the timings, the
   settings) depend on this.

Worker processes call ``die_with_parent`` first: a worker of a killed run would otherwise finish
its task and write into the outputs of the re-run that started meanwhile.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_path(path: Path | str) -> Iterator[Path]:
    """A temporary path beside ``path`` (same suffixes, so writers that infer the format from the
    name still do) to write to; renamed onto ``path`` when the block completes, removed otherwise."""
    path = Path(path)
    tmp = path.with_name(f".tmp{os.getpid()}-{path.name}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text(path: Path | str, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_json(path: Path | str, obj, indent: int | None = 1) -> None:
    write_text(path, json.dumps(obj, indent=indent))


def die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this process when its parent dies (``PR_SET_PDEATHSIG``).
    Call it first in a worker's initializer. Elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    if os.getppid() == 1:  # the parent died before the call: nobody will signal us
        os._exit(1)
