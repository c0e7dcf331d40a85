"""Noise tags and the unknown word: their phones, as Kaldi's lang directories have them.

Real corpora mark what is not a word: ``[noise]``, ``[laughter]``, ``[vocalized-noise]``
(Switchboard, Fisher), ``<NOISE>``, ``<SPOKEN_NOISE>`` (WSJ), ``<unk>`` (TED-LIUM, LibriSpeech's
LM). Kaldi's ``silence_phones.txt`` is ``SIL SPN NSN``: spoken noise (``SPN``) is what a speaker
utters that is not a word the lexicon knows (``<UNK>``, vocalised noise, laughter), non-spoken noise
(``NSN``) the rest. Both are trained like silence: the 5-state silence topology, one tree root per
pdf-class and no context questions, silence's weight in the fMLLR and LDA+MLLT statistics. Scoring
leaves tags and ``<UNK>`` out of references and hypotheses (``local.data.normalize.scored_words``).

A tag is a word in square or angle brackets (``local.data.normalize.is_tag``); the tags the lang
stage knows and their phones are ``DEFAULT_TAGS`` or ``prepare.py --tags TAG=PHONE ...``, and a user
lexicon's entries in ``SPN``/``NSN`` add to them. A tag outside that list is an OOV word like any
other (``--oov``). The phones enter the phone set only when a word of the vocabulary is pronounced
with them (a tag in the training transcripts, the LM text or the ARPA, or ``<UNK>`` under ``--oov
unk``): the embedded corpus, which has neither, keeps its phone set and its results.
"""

from __future__ import annotations

from local.data.normalize import is_tag, normalize_words

SPN, NSN = "SPN", "NSN"
SILENCE_LIKE = (SPN, NSN)  # the silence-like phones after SIL, in this order (Kaldi's silence_phones.txt)
UNK = "<UNK>"
DEFAULT_TAGS = {
    "<UNK>": SPN,
    "<SPOKEN_NOISE>": SPN,
    "[VOCALIZED-NOISE]": SPN,
    "[LAUGHTER]": SPN,  # vocal, the speaker's own: spoken noise (Switchboard's LAU phone is not kept apart)
    "<NOISE>": NSN,
    "[NOISE]": NSN,
}


def parse_tags(items: list[str] | None) -> dict[str, str]:
    """``--tags TAG=PHONE ...`` -> ``{normalised tag: phone}``; None: ``DEFAULT_TAGS``.

    Raises:
        ValueError: naming an item that is not ``TAG=PHONE``, a tag that is not one bracketed word,
            or a phone other than SPN/NSN, and the fix.
    """
    if items is None:
        return dict(DEFAULT_TAGS)
    out = {}
    for item in items:
        tag, sep, phone = item.rpartition("=")
        words = normalize_words(tag)
        if not sep or len(words) != 1 or not is_tag(words[0]) or phone.upper() not in SILENCE_LIKE:
            raise ValueError(
                f"--tags {item!r}: give TAG=PHONE, the tag one word in square or angle brackets and the phone "
                f"{SPN} (spoken noise) or {NSN} (non-spoken noise), e.g. '[noise]=NSN' '<unk>=SPN'")
        out[words[0]] = phone.upper()
    return out


def check_unk_word(word: str) -> str:
    """The normalised ``--unk-word``; it must be a tag, so that scoring leaves it out."""
    words = normalize_words(word)
    if len(words) != 1 or not is_tag(words[0]):
        raise ValueError(f"--unk-word {word!r}: give one word in angle or square brackets (default {UNK}), "
                         "which scoring leaves out as Kaldi's and icefall's do")
    return words[0]


def tag_lexicon(tags: dict[str, str], unk_word: str | None) -> dict[str, list[tuple[str, ...]]]:
    """Lexicon entries of the tags and of the unknown word (``SPN``): ``{word: [(phone,)]}``."""
    lex = {tag: [(phone,)] for tag, phone in tags.items()}
    if unk_word is not None:
        lex.setdefault(unk_word, [(SPN,)])
    return lex


def silence_like_used(lexicon: list[tuple[str, tuple[str, ...]]]) -> list[str]:
    """The silence-like phones the pronunciations of ``lexicon`` use, in ``SILENCE_LIKE``'s order."""
    used = {p for _, pron in lexicon for p in pron}
    return [p for p in SILENCE_LIKE if p in used]
