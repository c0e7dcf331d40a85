"""The unknown word spelled out of phones in the decoding graph (Kaldi's ``utils/lang/make_unk_lm.sh`` with
``prepare_lang.sh --unk-fst``).

Under ``--oov unk`` the unknown word ``<UNK>`` stands for every word the vocabulary lacks. Trained as
Kaldi trains it, pronounced with the one garbage phone ``SPN`` (``L.fst``, the training graphs' lexicon),
it is a poor match for an unknown word in the decoder: on voices whose accents train lacks it takes the
speech that the word models match badly (a quarter of the frames of the triphone system's best paths on
such a dev), and each word it swallows is a deletion, ``<UNK>`` being a tag that is never scored
(``docs/experiments/unseen_voices_gmm.md``). Kaldi's remedy, used here by default
(``prepare.py --unk-model phone``): in the decoding lexicon ``L_disambig.fst`` ``<UNK>`` is any sequence of
two or more phones, weighted by a phone n-gram estimated on the lexicon's pronunciations.

- **The phone LM**: a bigram on the pronunciations of the lang stage's lexicon (CMUdict and the user's,
  one count per pronunciation, those with a silence-like phone left out), with Kaldi's constraint that
  only phone pairs the lexicon has follow one another and its minimum word length of two phones. The
  start, pair and end probabilities are maximum likelihood on the pairs that occur (none is unseen, so
  none needs smoothing). Kaldi's default is a pruned 4-gram (pocolm); a bigram keeps one state per phone.
- **In L**: ``<UNK>``'s ``SPN`` path is replaced by the phone LM between two arcs of a disambiguation
  symbol of its own, ``#unk``, one before its first phone and one after its last: read with its
  brackets, a phone string has one word sequence, so ``L_disambig o G`` stays determinisable (Kaldi puts
  the LM in place of a placeholder ``#2``). ``HCLG`` loses ``#unk`` with the other disambiguation
  symbols.
- **Unchanged**: ``L.fst`` (training and alignment keep ``<UNK>`` as ``SPN``, as Kaldi's ``lang``
  beside its decoding ``lang_unk`` does), G, the phone set the models are trained on, scoring.

``--unk-model spn`` keeps the garbage phone in decoding too (the recipe's graphs before this model).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from itertools import pairwise

UNK_MODELS = ("phone", "spn")
UNK_DISAMBIG = "#unk"
MIN_PHONES = 2  # make_unk_lm.sh's --min-word-length default


def phone_bigram(prons) -> dict:
    """``{"start": {p: P}, "next": {p: {q: P}}, "end": {p: P}, "prons": n}`` of ``prons`` (one count per
    pronunciation of ``MIN_PHONES`` phones or more), maximum likelihood on the pairs that occur.

    Raises:
        ValueError: no pronunciation is long enough.
    """
    start, pairs, end = Counter(), defaultdict(Counter), Counter()
    n = 0
    for pron in prons:
        if len(pron) < MIN_PHONES:
            continue
        n += 1
        start[pron[0]] += 1
        for a, b in pairwise(pron):
            pairs[a][b] += 1
        end[pron[-1]] += 1
    if not n:
        raise ValueError(f"no pronunciation of {MIN_PHONES} phones or more to estimate the unknown word's phone LM on")
    nxt, endp = {}, {}
    for a in set(pairs) | set(end):
        total = sum(pairs[a].values()) + end[a]
        nxt[a] = {b: c / total for b, c in pairs[a].items()}
        if end[a]:
            endp[a] = end[a] / total
    return {"start": {p: c / n for p, c in start.items()}, "next": nxt, "end": endp, "prons": n}


def unk_arcs(lm: dict, phone2id: dict[str, int], unk_id: int, loop: int, sil: int, first_state: int,
             sil_cost: float, no_sil_cost: float) -> tuple[list[str], int]:
    """OpenFst text arcs of the unknown word for ``make_lexicon_fst_text``'s L (states ``loop`` and
    ``sil``; new states numbered from ``first_state``): loop ``-#unk:<UNK>->`` entry; entry ``-p->`` (one
    phone read, last p); ``-q->`` (two or more, last q); from (two or more, q) ``-#unk->`` the loop state or the
    silence state, with the end probability and L's silence costs. Returns the lines and the next free state."""
    hash_unk = phone2id[UNK_DISAMBIG]
    phones = sorted(set(lm["start"]) | set(lm["next"]))
    entry = first_state
    one = {p: entry + 1 + i for i, p in enumerate(phones)}  # one phone read: cannot end (MIN_PHONES 2)
    more = {p: entry + 1 + len(phones) + i for i, p in enumerate(phones)}
    lines = [f"{loop} {entry} {hash_unk} {unk_id} 0"]
    lines += [f"{entry} {one[p]} {phone2id[p]} 0 {-math.log(prob):.6f}" for p, prob in sorted(lm["start"].items())]
    for a, succ in sorted(lm["next"].items()):
        for b, prob in sorted(succ.items()):
            lines.append(f"{one[a]} {more[b]} {phone2id[b]} 0 {-math.log(prob):.6f}")
            lines.append(f"{more[a]} {more[b]} {phone2id[b]} 0 {-math.log(prob):.6f}")
    for p, prob in sorted(lm["end"].items()):
        lines.append(f"{more[p]} {loop} {hash_unk} 0 {-math.log(prob) + no_sil_cost:.6f}")
        lines.append(f"{more[p]} {sil} {hash_unk} 0 {-math.log(prob) + sil_cost:.6f}")
    return lines, entry + 1 + 2 * len(phones)
