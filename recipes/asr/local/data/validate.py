"""Kaldi's ``utils/validate_data_dir.sh`` for a data dir the recipe reads (stage 0, ``--corpus kaldi``).

A data dir is ``wav.scp``, ``text`` and ``utt2spk``, optionally ``segments`` and ``spk2utt``. Checked
before any audio is read, each failure a ``ValueError`` of one line, ``file:line: problem; fix``:

- the file is UTF-8 (Kaldi's ``validate_text.pl``: a transcript in Latin-1 would turn its accented words
  into words no lexicon knows);
- every line ends with ``\\n`` (not ``\\r\\n``) and has its fields (``utt2spk``: 2, ``segments``: 4,
  ``wav.scp`` and ``spk2utt``: 2 or more; ``text`` may hold the id alone, an empty transcript);
- keys sorted as ``LC_ALL=C sort`` sorts them (byte order) and unique;
- the same utterances in ``text``, ``utt2spk`` and ``wav.scp`` (with ``segments``: in ``segments``,
  whose recordings are exactly those of ``wav.scp``);
- ``segments`` times: numbers, ``0 <= start < end`` (``end`` -1: to the end of the recording);
- ``spk2utt``, when present, the exact inverse of ``utt2spk``.

``check_disjoint_speakers`` refuses a speaker in two splits (``--allow-shared-speakers``: a warning).
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)

REQUIRED = ("wav.scp", "text", "utt2spk")
FIX_DIR = "run Kaldi's utils/fix_data_dir.sh on the data dir (it keeps the utterances every file names)"
# fewest fields per line, and the exact count where Kaldi wants one
FIELDS = {"wav.scp": (2, None), "text": (1, None), "utt2spk": (2, 2), "segments": (4, 4), "spk2utt": (2, None)}


def read_lines(path: Path) -> list[tuple[int, str, str]]:
    """``[(line number, key, rest of the line)]`` of a Kaldi table file (the rest stripped, as Kaldi
    reads it), its lines checked for their newline and number of fields (``FIELDS``)."""
    raw = path.read_bytes()
    if raw and not raw.endswith(b"\n"):
        n = raw.count(b"\n") + 1
        raise ValueError(f"{path}:{n}: the last line has no newline; end the file with one (Kaldi's tools need it)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        n = raw.count(b"\n", 0, error.start) + 1
        column = error.start - (raw.rfind(b"\n", 0, error.start) + 1) + 1
        raise ValueError(
            f"{path}:{n}: byte 0x{raw[error.start]:02x} at column {column} is not UTF-8; convert the file "
            f"(e.g. iconv -f ISO-8859-1 -t UTF-8 {path} > {path.name}.utf8, then move it back)"
        ) from None
    least, exact = FIELDS.get(path.name, (1, None))
    out = []
    for n, line in enumerate(text.split("\n")[:-1], start=1):
        if line.endswith("\r"):
            raise ValueError(f"{path}:{n}: the line ends with \\r (a Windows line ending); "
                             f"convert the file: sed -i 's/\\r$//' {path}")
        fields = line.split()
        if len(fields) < least or (exact and len(fields) != exact):
            want = f"{exact}" if exact else f"at least {least}"
            raise ValueError(f"{path}:{n}: {len(fields)} fields in `{line}`, {path.name} wants {want}; "
                             "fix the line or remove it")
        out.append((n, fields[0], line.strip()[len(fields[0]):].strip()))
    return out


def _check_sorted_unique(path: Path, rows: list[tuple[int, str, str]]) -> None:
    """Keys in ``LC_ALL=C sort`` order (bytes), each once (Kaldi's ``check_sorted_and_uniq``)."""
    seen: dict[str, int] = {}
    prev = None
    for n, key, _ in rows:
        if key in seen:
            raise ValueError(f"{path}:{n}: key {key} repeats line {seen[key]}; keep one line per key")
        if prev is not None and key.encode() < prev.encode():
            raise ValueError(f"{path}:{n}: key {key} comes after {prev}, not in LC_ALL=C sort order; "
                             f"sort it (LC_ALL=C sort {path.name} -o {path.name}) or {FIX_DIR}")
        seen[key], prev = n, key


def _check_same_keys(data: Path, name_a: str, rows_a: list, name_b: str, rows_b: list, what: str) -> None:
    """The keys of two files are the same set; the first one that is in only one is named with its line."""
    keys_b = {k for _, k, _ in rows_b}
    for n, key, _ in rows_a:
        if key not in keys_b:
            raise ValueError(f"{data / name_a}:{n}: {what} {key} has no line in {name_b}; "
                             f"add its line there or {FIX_DIR}")
    keys_a = {k for _, k, _ in rows_a}
    for n, key, _ in rows_b:
        if key not in keys_a:
            raise ValueError(f"{data / name_b}:{n}: {what} {key} has no line in {name_a}; "
                             f"add its line there or {FIX_DIR}")


def _check_segments(path: Path, rows: list) -> None:
    for n, utt, rest in rows:
        rec, start, end = rest.split()
        try:
            t0, t1 = float(start), float(end)
        except ValueError:
            raise ValueError(f"{path}:{n}: times `{start} {end}` of {utt} are not numbers; "
                             "want <utt> <recording> <start> <end> in seconds") from None
        if t0 < 0:
            raise ValueError(f"{path}:{n}: {utt} starts at {start} s, before its recording {rec}; "
                             "give a start of 0 or more")
        if t1 != -1 and t1 <= t0:
            raise ValueError(f"{path}:{n}: {utt} ends at {end} s, not after its start {start} s; "
                             "give an end after the start (or -1: the end of the recording), or remove the line")


def _check_spk2utt(data: Path, spk2utt: list, utt2spk: list) -> None:
    """``spk2utt`` lists each utterance of ``utt2spk`` once, under its speaker (Kaldi regenerates it
    with ``utils/utt2spk_to_spk2utt.pl``)."""
    fix = f"regenerate it: utils/utt2spk_to_spk2utt.pl {data / 'utt2spk'} > {data / 'spk2utt'}"
    speaker_of = {utt: spk for _, utt, spk in utt2spk}
    listed: dict[str, int] = {}
    for n, spk, utts in spk2utt:
        for utt in utts.split():
            if utt in listed:
                raise ValueError(f"{data / 'spk2utt'}:{n}: utterance {utt} is listed again (line {listed[utt]}); {fix}")
            if utt not in speaker_of:
                raise ValueError(f"{data / 'spk2utt'}:{n}: utterance {utt} has no line in utt2spk; {fix}")
            if speaker_of[utt] != spk:
                raise ValueError(f"{data / 'spk2utt'}:{n}: utterance {utt} is under speaker {spk}, "
                                 f"utt2spk says {speaker_of[utt]}; {fix}")
            listed[utt] = n
    for n, utt, spk in utt2spk:
        if utt not in listed:
            raise ValueError(f"{data / 'utt2spk'}:{n}: utterance {utt} of speaker {spk} is not in spk2utt; {fix}")


def validate_data_dir(data: Path | str) -> dict[str, list[tuple[int, str, str]]]:
    """Check a Kaldi data dir (the checks in the module docstring); raise ``ValueError`` at the first
    failure. Returns the rows of each file present (``read_lines``), for the line numbers of later errors."""
    data = Path(data)
    missing = [name for name in REQUIRED if not (data / name).is_file()]
    if missing:
        raise ValueError(f"{data}: no {', '.join(missing)}; a Kaldi data dir needs wav.scp, text and utt2spk "
                         "(without speaker information, each utterance its own speaker: "
                         "awk '{print $1, $1}' text > utt2spk)")
    rows = {name: read_lines(data / name) for name in (*REQUIRED, "segments", "spk2utt") if (data / name).is_file()}
    for name, lines in rows.items():
        _check_sorted_unique(data / name, lines)
    _check_same_keys(data, "utt2spk", rows["utt2spk"], "text", rows["text"], "utterance")
    if "segments" in rows:
        _check_segments(data / "segments", rows["segments"])
        _check_same_keys(data, "utt2spk", rows["utt2spk"], "segments", rows["segments"], "utterance")
        recordings = {rest.split()[0] for _, _, rest in rows["segments"]}
        in_scp = {rec for _, rec, _ in rows["wav.scp"]}
        for n, utt, rest in rows["segments"]:
            if rest.split()[0] not in in_scp:
                raise ValueError(f"{data / 'segments'}:{n}: recording {rest.split()[0]} of {utt} has no line in "
                                 f"wav.scp; add it there or {FIX_DIR}")
        for n, rec, _ in rows["wav.scp"]:
            if rec not in recordings:
                raise ValueError(f"{data / 'wav.scp'}:{n}: recording {rec} has no utterance in segments; "
                                 f"add its segments or {FIX_DIR}")
    else:
        _check_same_keys(data, "utt2spk", rows["utt2spk"], "wav.scp", rows["wav.scp"], "utterance")
    if "spk2utt" in rows:
        _check_spk2utt(data, rows["spk2utt"], rows["utt2spk"])
    return rows


def check_disjoint_speakers(speakers: dict[str, set[str]], allow_shared: bool = False) -> list[str]:
    """Refuse a speaker in two splits (``{split: speakers}``): dev and test would score speakers the
    acoustic model was trained on (Kaldi's recipes keep them apart). ``allow_shared``: log a warning
    instead. Returns the shared speakers, sorted."""
    splits = list(speakers)
    shared = sorted({s for i, a in enumerate(splits) for b in splits[i + 1:] for s in speakers[a] & speakers[b]})
    if not shared:
        return shared
    where = "; ".join(f"{a} and {b}: {len(speakers[a] & speakers[b])}" for i, a in enumerate(splits)
                      for b in splits[i + 1:] if speakers[a] & speakers[b])
    line = (f"{len(shared)} speaker(s) in two splits ({where}; e.g. {', '.join(shared[:5])}): dev and test would "
            "score speakers the model was trained on")
    if not allow_shared:
        raise ValueError(f"{line}; give each speaker to one split (utt2spk), or pass --allow-shared-speakers "
                         "to go on with a warning")
    log.warning("%s (--allow-shared-speakers); CMVN statistics and speaker transforms stay per split", line)
    return shared
