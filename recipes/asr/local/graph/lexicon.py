"""Pronunciations beyond CMUdict: the user's own lexicon and a letter-to-sound fallback.

- A user lexicon (``prepare.py --lexicon FILE``) in Kaldi's ``lexicon.txt`` layout (``WORD PH1 PH2
  ...``; ``lexiconp.txt``'s probability column is accepted and ignored). Its phones are the lexicon's
  39 ARPAbet phones (stress digits are removed, case does not matter); its entries replace CMUdict's
  for the words it has and add the words CMUdict lacks. Kaldi's special entries (``<UNK>``,
  ``!SIL``, words spelled ``SIL``/``SPN``/``NSN``) are skipped.
- OOV policy (``prepare.py --oov``): ``drop`` (default) leaves a training utterance with a word that
  no lexicon knows out of training (recorded as a drop, reason ``oov``, and counted in the lang
  summary with the words in ``lang/oov.txt``); ``g2p`` gives such words the pronunciation of flite's
  letter-to-sound rules (trained on CMUdict, so in its phone set; the words and their
  pronunciations in ``lang/g2p_lexicon.txt``). Dev and test words are never added: an OOV there
  stays an error the decoder cannot avoid.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from local.data.normalize import normalize_words

SPECIAL_PHONES = {"SIL", "SPN", "NSN"}


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
        if not fields or fields[0].startswith(("<", "!")):
            continue
        word, pron = fields[0], fields[1:]
        if pron and re.fullmatch(r"[0-9.]+", pron[0]):  # lexiconp.txt: WORD PROB PH1 ...
            pron = pron[1:]
        pron = tuple(re.sub(r"\d", "", p).upper() for p in pron)
        if not pron or set(pron) & SPECIAL_PHONES:
            continue
        words = normalize_words(word)
        unknown = sorted(set(pron) - phones)
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
            f"CMUdict ({' '.join(sorted(phones))}) and upper-case words of letters, digits and apostrophes"
        )
    if not lex:
        raise ValueError(f"--lexicon {path}: no entries (expected lines WORD PH1 PH2 ...)")
    return lex


def flite_g2p(words: list[str]) -> dict[str, tuple[str, ...]]:
    """Pronunciations of ``words`` from flite's letter-to-sound rules (``flite -ps``), in ARPAbet
    without stress; a word whose phones do not all map is left out."""
    from local.data.tts import FLITE_TO_ARPA

    if shutil.which("flite") is None:
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
