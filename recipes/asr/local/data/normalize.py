"""The one text normalisation of the recipe: corpus transcripts, the lexicon's words, the LM text and
the references scored against.

Upper case; letters, digits and apostrophes are kept; every other character (hyphens and punctuation
included) separates words (``WELL-KNOWN`` -> ``WELL KNOWN``, as CMUdict spells such words); apostrophes
at either end of a word are quotation marks and go (``'HELLO'`` -> ``HELLO``, ``DON'T`` stays).
"""

from __future__ import annotations

import re

_NOT_WORD = re.compile(r"[^A-Z0-9' ]+")


def normalize_words(text: str) -> list[str]:
    """Transcript -> upper-case words as they appear in ``words.txt``."""
    words = (w.strip("'") for w in _NOT_WORD.sub(" ", text.upper()).split())
    return [w for w in words if w]


def normalize_text(text: str) -> str:
    """:func:`normalize_words`, joined by single spaces (``""`` when no word is left)."""
    return " ".join(normalize_words(text))
