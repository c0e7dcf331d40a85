"""Utterances that a stage skips are never lost silently: each is recorded here with a
reason, counted in the stage's log line and listed in ``report.json``.

Records go to ``<data-dir>/dropped.jsonl``, one JSON object per line:
``{"stage": "features", "split": "train", "id": "utt-0001", "reason": "empty_audio", "detail": "..."}``.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from local.atomic import write_text


def record_drop(data_dir: Path | str, stage: str, split: str, utt_id: str, reason: str, detail: str = "") -> None:
    """Append one dropped utterance to ``<data_dir>/dropped.jsonl``.

    Args:
        stage: the stage that dropped it (``corpus``, ``features``, ``lang``, ``mono``, ...).
        reason: a short snake_case reason (``unreadable_audio``, ``empty_transcript``,
            ``oov``, ``too_short_for_hmm``, ``alignment_failed``, ...); counted in the report.
        detail: free text for a person (the exception message, the OOV words).
    """
    path = Path(data_dir) / "dropped.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    rec = {"stage": stage, "split": split, "id": utt_id, "reason": reason, "detail": detail}
    with path.open("a") as f:
        f.write(json.dumps(rec) + "\n")


def load_drops(data_dir: Path | str) -> list[dict]:
    """The records; a last line without its newline (an append that a killed run left half
    written) is not a record."""
    path = Path(data_dir) / "dropped.jsonl"
    if not path.exists():
        return []
    text = path.read_text()
    if not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def count_drops(data_dir: Path | str, stage: str | None = None) -> Counter:
    """``Counter`` of ``(stage, reason)`` (or of ``reason`` when ``stage`` is given)."""
    drops = load_drops(data_dir)
    if stage is None:
        return Counter((d["stage"], d["reason"]) for d in drops)
    return Counter(d["reason"] for d in drops if d["stage"] == stage)


def clear_drops(data_dir: Path | str, stage: str) -> None:
    """Forget a stage's earlier records before it runs again (so re-runs don't double-count)."""
    path = Path(data_dir) / "dropped.jsonl"
    if path.exists():
        kept = [d for d in load_drops(data_dir) if d["stage"] != stage]
        write_text(path, "".join(json.dumps(d) + "\n" for d in kept))
