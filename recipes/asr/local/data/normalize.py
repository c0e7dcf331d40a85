"""The one text normalisation of the recipe: corpus transcripts, the lexicon's words, the LM text and
the references scored against.

Upper case; letters, digits and apostrophes are kept; every other character (hyphens and punctuation
included) separates words (``WELL-KNOWN`` -> ``WELL KNOWN``, as CMUdict spells such words); apostrophes
at either end of a word are quotation marks and go (``'HELLO'`` -> ``HELLO``, ``DON'T`` stays).

Tags stay whole: a token in square or angle brackets (``[noise]``, ``[vocalized-noise]``, ``<UNK>``,
``<SPOKEN_NOISE>``) is one word, upper-cased (``[NOISE]``), as real corpora mark noise, laughter and
unknown words (Kaldi's and icefall's conventions). The lang stage gives the known tags a silence-like
phone (``local/graph/tags.py``); scoring leaves every tag out of both sides (:func:`scored_words`, as
Kaldi's ``local/wer_output_filter`` and icefall do).
"""

from __future__ import annotations

import re

_NOT_WORD = re.compile(r"[^A-Z0-9' ]+")
_TAG = re.compile(r"(\[[^\[\]<>\s]+\]|<[^\[\]<>\s]+>)")


def is_tag(word: str) -> bool:
    """True for a normalised tag (``[NOISE]``, ``<UNK>``): a word in square or angle brackets."""
    return len(word) > 2 and (word[0], word[-1]) in (("[", "]"), ("<", ">"))


def normalize_words(text: str) -> list[str]:
    """Transcript -> upper-case words as they appear in ``words.txt`` (tags whole: module docstring)."""
    out = []
    for i, piece in enumerate(_TAG.split(text.upper())):
        if i % 2:  # (re.split puts the captured tags at the odd places)
            out.append(piece)
        else:
            out += [w for w in (w.strip("'") for w in _NOT_WORD.sub(" ", piece).split()) if w]
    return out


def normalize_text(text: str) -> str:
    """:func:`normalize_words`, joined by single spaces (``""`` when no word is left)."""
    return " ".join(normalize_words(text))


def scored_words(text: str) -> list[str]:
    """The words WER counts: :func:`normalize_words` without tags (noise marks and ``<UNK>``), applied to
    the references and the hypotheses alike (Kaldi's ``wer_output_filter``, icefall's scoring)."""
    return [w for w in normalize_words(text) if not is_tag(w)]
