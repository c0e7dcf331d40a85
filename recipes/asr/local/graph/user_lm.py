"""A user's ARPA LM for the first pass (``prepare.py --lm-arpa FILE``), reconciled with the lexicon.

The ARPA (plain or gzipped, pruned or not: LibriSpeech's ``3-gram.pruned.1e-7.arpa.gz`` is the usual
first-pass LM) replaces the recipe's own estimate as ``lang/lm.arpa``, from which G is compiled
(``local.graph.lm.compile_G``) and which lattice rescoring takes as the first pass's LM. Its words go
through the recipe's text normalisation (``<unk>`` -> ``<UNK>``, ``the`` -> ``THE``); a word the
lexicon lacks (or that normalisation splits) leaves G with every n-gram that holds it, as Kaldi's
``format_lm.sh`` drops them (``arpa2fst --read-symbol-table`` skips n-grams with OOV words): the
count goes to the log and the lang summary, the words to ``lang/lm_arpa_oov.txt``. With ``--oov
g2p`` they get flite's pronunciations first. The back-off weights are kept as they are, so the
history of a dropped word keeps the mass it gave that word (Kaldi's behaviour too).

Every n-gram is held in memory while the file is rewritten: a pruned LM (tens of MB) is what the
recipe's first pass is for; a large unpruned one belongs to lattice rescoring (``evaluate.py
--rescore-lm``).
"""

from __future__ import annotations

import gzip
import logging
import re
from pathlib import Path

from local.data.normalize import normalize_words

log = logging.getLogger(__name__)

BOS, EOS = "<s>", "</s>"
_COUNT = re.compile(r"ngram\s+(\d+)\s*=\s*(\d+)")
_FIX = "give a back-off n-gram LM in ARPA format (\\data\\, ngram N=..., \\N-grams: sections; gzipped or not)"


def _lines(path: Path):
    """The file's lines, gunzipped when it starts with gzip's magic bytes."""
    with path.open("rb") as f:
        gz = f.read(2) == b"\x1f\x8b"
    with (gzip.open(path, "rt", encoding="utf-8") if gz else path.open(encoding="utf-8")) as f:
        for line in f:
            yield line.rstrip("\n")


def _word(token: str) -> str | None:
    """A token of the ARPA as the recipe spells it (``<s>``/``</s>`` as they are); None: normalisation splits
    or empties it."""
    if token in (BOS, EOS):
        return token
    words = normalize_words(token)
    return words[0] if len(words) == 1 else None


def read_arpa(path: Path | str) -> list[dict[tuple[str, ...], str]]:
    """``tables[n-1] = {normalised n-gram: "log10p" or "log10p<TAB>backoff"}`` of an ARPA file; an n-gram
    whose words normalisation cannot map (or maps onto one seen before) is left out.

    Raises:
        FileNotFoundError / ValueError: a missing file or one that is not ARPA, naming it and the fix.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--lm-arpa {path}: no such file; {_FIX}")
    declared: dict[int, int] = {}
    tables: list[dict] = []
    section = None  # None: before \data\; 0: in \data\; n: in \n-grams:
    try:
        for number, line in enumerate(_lines(path), 1):
            line = line.strip()
            if not line:
                continue
            if section is None:
                if line != "\\data\\":
                    raise ValueError(f"--lm-arpa {path}: not an ARPA file (line {number} is {line[:60]!r}, not "
                                     f"\\data\\); {_FIX}")
                section = 0
            elif line == "\\end\\":
                break
            elif line.startswith("\\") and line.endswith("-grams:"):
                section = int(line[1:].split("-")[0])
                tables += [{} for _ in range(section - len(tables))]
            elif section == 0:
                match = _COUNT.fullmatch(line)
                if not match:
                    raise ValueError(f"--lm-arpa {path}: line {number} ({line[:60]!r}) of \\data\\ is not "
                                     f"'ngram N=COUNT'; {_FIX}")
                declared[int(match[1])] = int(match[2])
            else:
                fields = line.split()
                if len(fields) not in (section + 1, section + 2):
                    raise ValueError(f"--lm-arpa {path}: line {number} ({line[:60]!r}) is not a {section}-gram "
                                     f"entry (log10p, {section} words, optional back-off); {_FIX}")
                gram = tuple(_word(t) for t in fields[1 : section + 1])
                if None not in gram:
                    rest = fields[0] + ("" if len(fields) == section + 1 else "\t" + fields[-1])
                    tables[section - 1].setdefault(gram, rest)
    except UnicodeDecodeError as e:
        raise ValueError(f"--lm-arpa {path}: not text ({e}); {_FIX}") from e
    if section is None or not declared or not tables or not tables[0]:
        raise ValueError(f"--lm-arpa {path}: not an ARPA file (no \\data\\ counts or no \\1-grams: section); {_FIX}")
    return tables


def arpa_vocabulary(tables: list[dict]) -> set[str]:
    """The words of the unigram table, without ``<s>`` and ``</s>``."""
    return {g[0] for g in tables[0]} - {BOS, EOS}


def write_reconciled_arpa(tables: list[dict], vocab: set[str], out: Path | str) -> dict:
    """Write the n-grams of ``tables`` whose words are all in ``vocab`` (plus ``<s>``, ``</s>``) to ``out``;
    return the counts kept and dropped."""
    known = set(vocab) | {BOS, EOS}
    kept = [{g: v for g, v in table.items() if all(w in known for w in g)} for table in tables]
    lines = ["", "\\data\\"] + [f"ngram {n + 1}={len(t)}" for n, t in enumerate(kept)]
    for n, table in enumerate(kept):
        lines += ["", f"\\{n + 1}-grams:"]
        lines += [f"{v.split(chr(9))[0]}\t{' '.join(g)}" + (f"\t{v.split(chr(9))[1]}" if "\t" in v else "")
                  for g, v in table.items()]
    lines += ["", "\\end\\", ""]
    Path(out).write_text("\n".join(lines))
    return {"lm_arpa_order": len(tables), "lm_ngrams": [len(t) for t in kept],
            "lm_arpa_dropped_ngrams": sum(len(a) - len(b) for a, b in zip(tables, kept))}
