"""Pronunciations beyond CMUdict: the user's own lexicon and a letter-to-sound fallback.

- A user lexicon (``prepare.py --lexicon FILE``) in Kaldi's ``lexicon.txt`` layout (``WORD PH1 PH2
  ...``; ``lexiconp.txt``'s probability column is accepted and ignored). Its phones are the lexicon's
  39 ARPAbet phones (stress digits are removed, case does not matter); its entries replace CMUdict's
  for the words it has and add the words CMUdict lacks. Its entries in the silence-like phones ``SPN``
  and ``NSN`` (Kaldi's ``<UNK> SPN``, ``[noise] NSN``) are taken as tags (``local/graph/tags.py``);
  ``!SIL`` and entries in ``SIL`` are skipped (L has optional silence between words already).
- OOV policy (``prepare.py --oov``): ``drop`` leaves a training utterance with a word that no lexicon
  knows out of training (recorded as a drop, reason ``oov``, and counted in the lang summary with the
  words in ``lang/oov.txt``); ``unk`` keeps it, the word mapped to the unknown word ``<UNK>``
  (pronounced ``SPN``; Kaldi's ``sym2int.pl --map-oov``), in training and in the LM; ``g2p`` gives
  such words the pronunciation of flite's letter-to-sound rules (trained on CMUdict, so in its phone
  set; the words and their pronunciations in ``lang/g2p_lexicon.txt``; tags get none). Dev and test
  words are never added: an OOV there stays an error the decoder cannot avoid.
- The default (``prepare.py`` without ``--oov``) is ``unk`` for a real corpus and ``drop`` for the
  embedded one. On recorded speech an OOV is a name, a partial word or a rare spelling, and dropping
  its utterance throws away every other word of it with its audio, which Kaldi's and icefall's
  recipes never do; the embedded corpus has no OOV by construction, and ``drop`` leaves its phone set
  (no ``SPN``) and so its results as they were.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from local.data.normalize import is_tag, normalize_words
from local.graph.tags import SILENCE_LIKE

OOV_POLICIES = ("drop", "unk", "g2p")


def default_oov(corpus: str) -> str:
    """``--oov`` left out: ``drop`` for the embedded (synthetic) corpus, ``unk`` for a real one (module docstring)."""
    return "drop" if corpus == "synthetic" else "unk"


def read_user_lexicon(path: Path | str, phones: set[str]) -> dict[str, list[tuple[str, ...]]]:
    """``WORD -> [pronunciation, ...]`` from a Kaldi lexicon file.

    Raises:
        ValueError: naming the lines with a phone outside ``phones`` or a word the recipe's text
            normalisation would split, and the fix.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--lexicon {path}: no such file (a Kaldi lexicon.txt: WORD PH1 PH2 ...)")
    lex: dict[str, list[tuple[str, ...]]] = {}
    bad = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        fields = line.split()
        if not fields or fields[0].startswith("!") or fields[0].lower() in ("<s>", "</s>", "<eps>"):
            continue
        word, pron = fields[0], fields[1:]
        if pron and re.fullmatch(r"[0-9.]+", pron[0]):  # lexiconp.txt: WORD PROB PH1 ...
            pron = pron[1:]
        pron = tuple(re.sub(r"\d", "", p).upper() for p in pron)
        if not pron or "SIL" in pron:
            continue
        words = normalize_words(word)
        unknown = sorted(set(pron) - phones - set(SILENCE_LIKE))
        if unknown or words != [word.upper()]:
            why = f"phones {unknown} not in the lexicon's phone set" if unknown else f"the word normalises to {words}"
            bad.append(f"line {number} ({line.strip()!r}): {why}")
            continue
        prons = lex.setdefault(words[0], [])
        if pron not in prons:
            prons.append(pron)
    if bad:
        raise ValueError(
            f"--lexicon {path}: {len(bad)} bad entries, e.g. {'; '.join(bad[:3])}. Use the 39 ARPAbet phones of "
            f"CMUdict ({' '.join(sorted(phones))}) or {'/'.join(SILENCE_LIKE)} for tags, and upper-case words of "
            "letters, digits and apostrophes"
        )
    if not lex:
        raise ValueError(f"--lexicon {path}: no entries (expected lines WORD PH1 PH2 ...)")
    return lex


def flite_g2p(words: list[str]) -> dict[str, tuple[str, ...]]:
    """Pronunciations of ``words`` from flite's letter-to-sound rules (``flite -ps``), in ARPAbet
    without stress; a word whose phones do not all map is left out."""
    from local.data.tts import FLITE_TO_ARPA

    words = [w for w in words if not is_tag(w)]  # a noise mark has no spelling to sound out
    if words and shutil.which("flite") is None:
        raise RuntimeError("--oov g2p needs flite (Debian: apt-get install flite), or use --oov drop")
    out = {}
    for word in words:
        result = subprocess.run(
            ["flite", "-t", word.lower(), "-ps", "-o", "/dev/null"], capture_output=True, text=True, check=True
        )
        pron: list[str] = []
        for sym in result.stdout.split():
            mapped = FLITE_TO_ARPA.get(re.sub(r"\d", "", sym.lower()))
            if mapped is None:
                pron = []
                break
            pron += [p for p in mapped if p != "SIL"]
        if pron:
            out[word] = tuple(pron)
    return out
