"""Stage 2b: an n-gram LM on the training transcripts (ARPA) and its G.fst.

No PyPI package here estimates ARPA n-grams without a compile step (``kenlm`` is a source
distribution and its wheel-less build has no ``lmplz``; NLTK's ``nltk.lm`` writes no ARPA),
so this is a small estimator: interpolated modified Kneser-Ney (Chen & Goodman 1998, the
default of SRILM ``-kndiscount -interpolate`` and KenLM ``lmplz``).

For a history ``h`` and word ``w``, with adjusted counts ``a`` (raw counts at the highest
order and for n-grams starting with ``<s>``, else the number of distinct left extensions)::

    p(w | h) = max(a(hw) - D(a(hw)), 0) / sum_v a(hv)  +  gamma(h) * p(w | h')
    gamma(h) = sum_v D(a(hv)) / sum_v a(hv)

where ``h'`` drops the oldest word and the unigram level interpolates with the uniform
distribution over the vocabulary plus ``</s>``. Each ``p(. | h)`` sums to 1, so the ARPA
probability of a seen n-gram is its interpolated value and its history's ARPA backoff
weight is exactly ``gamma(h)``.

kaldilm must not be imported in a process that uses kaldi_hmm_gmm/kaldifst (import-order
hang), so ``arpa2fst`` runs in a subprocess.
"""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

log = logging.getLogger(__name__)

BOS, EOS = "<s>", "</s>"
LOG10_ZERO = -99.0


def kn_discounts(count_of_counts: Counter) -> tuple[float, float, float]:
    """Modified-KN discounts ``(D1, D2, D3+)`` from the counts of counts ``t_k`` of one order.

    Chen & Goodman's estimates ``D_k = k - (k+1) Y t_{k+1} / t_k`` with ``Y = t1 / (t1 + 2 t2)``;
    on tiny data where some ``t_k`` is 0 or an estimate leaves ``(0, k)``, ``D_k`` falls back to
    ``Y`` (0.5 without singletons or doubletons) so that every history keeps backoff mass.
    """
    t = [count_of_counts.get(k, 0) for k in range(5)]
    y = t[1] / (t[1] + 2 * t[2]) if t[1] > 0 and t[2] > 0 else 0.5
    out = []
    for k in (1, 2, 3):
        d = k - (k + 1) * y * t[k + 1] / t[k] if t[k] > 0 and t[k + 1] > 0 else y
        out.append(d if 0.0 < d < k else y)
    return tuple(out)


def estimate_kn(
    sentences: list[list[str]], order: int, vocab: list[str]
) -> list[dict[tuple, tuple[float, float | None]]]:
    """Interpolated modified Kneser-Ney n-gram model.

    Args:
        sentences: word lists (no ``<s>``/``</s>``).
        order: n-gram order N >= 1.
        vocab: the words the model predicts (``</s>`` is added); sentence words outside it raise.

    Returns:
        ``model[n-1] = {ngram: (log10 p, log10 backoff or None)}`` for n = 1..N, in ARPA terms.
    """
    if order < 1:
        raise ValueError(f"order={order}; an n-gram LM needs order >= 1")
    vocab_set = set(vocab)
    unknown = {w for s in sentences for w in s if w not in vocab_set}
    if unknown:
        raise ValueError(
            f"{len(unknown)} training words are not in the vocabulary, e.g. {sorted(unknown)[:5]}"
        )
    if not sentences:
        raise ValueError("no training sentences for the LM")

    raw = [Counter() for _ in range(order)]
    for s in sentences:
        toks = [BOS] + s + [EOS]
        for n in range(1, order + 1):
            for i in range(len(toks) - n + 1):
                g = tuple(toks[i : i + n])
                if g != (BOS,):
                    raw[n - 1][g] += 1
    # Adjusted counts: continuation counts below the top order, except n-grams starting with <s>.
    adj = [Counter() for _ in range(order)]
    adj[order - 1] = raw[order - 1]
    for n in range(order - 1, 0, -1):
        for g in raw[n]:
            adj[n - 1][g[1:]] += 1
        for g, c in raw[n - 1].items():
            if g[0] == BOS:
                adj[n - 1][g] = c

    predicted = sorted(vocab_set | {EOS})
    prob: list[dict[tuple, float]] = [{} for _ in range(order)]
    gamma: list[dict[tuple, float]] = [{} for _ in range(order)]  # keyed by history (length n-1)
    for n in range(1, order + 1):
        d = kn_discounts(Counter(adj[n - 1].values()))
        total, mass = defaultdict(float), defaultdict(float)
        for g, c in adj[n - 1].items():
            total[g[:-1]] += c
            mass[g[:-1]] += d[min(c, 3) - 1]
        for h in total:
            gamma[n - 1][h] = mass[h] / total[h]
        for g, c in adj[n - 1].items():
            h = g[:-1]
            lower = 1.0 / len(predicted) if n == 1 else prob[n - 2][g[1:]]
            prob[n - 1][g] = max(c - d[min(c, 3) - 1], 0.0) / total[h] + gamma[n - 1][h] * lower
        if n == 1:  # vocabulary words never seen in training keep the uniform share
            for w in predicted:
                prob[0].setdefault((w,), gamma[0][()] / len(predicted))

    model = []
    for n in range(1, order + 1):
        table = {}
        for g, p in prob[n - 1].items():
            bow = gamma[n][g] if n < order and g in gamma[n] else None
            table[g] = (math.log10(p), None if bow is None else math.log10(bow))
        if n == 1:
            table[(BOS,)] = (LOG10_ZERO, math.log10(gamma[1][(BOS,)]) if order > 1 else None)
        model.append(table)
    return model


def write_arpa(model: list[dict], path: Path | str) -> None:
    lines = ["", "\\data\\"] + [f"ngram {n + 1}={len(t)}" for n, t in enumerate(model)]
    for n, table in enumerate(model):
        lines += ["", f"\\{n + 1}-grams:"]
        for g in sorted(table):
            p, bow = table[g]
            lines.append(f"{p:.6f}\t{' '.join(g)}" + ("" if bow is None else f"\t{bow:.6f}"))
    lines += ["", "\\end\\", ""]
    Path(path).write_text("\n".join(lines))


class ArpaLM:
    """Back-off n-gram model read from an ARPA file (for perplexity and tests)."""

    def __init__(self, path: Path | str):
        self.prob: dict[tuple, float] = {}
        self.bow: dict[tuple, float] = {}
        section = 0
        for line in Path(path).read_text().splitlines():
            line = line.strip()
            if not line or line.startswith("ngram ") or line in ("\\data\\", "\\end\\"):
                continue
            if line.startswith("\\") and line.endswith("-grams:"):
                section = int(line[1:].split("-")[0])
                continue
            fields = line.split()
            if section == 0 or len(fields) not in (section + 1, section + 2):
                raise ValueError(f"{path}: malformed ARPA line {line!r}")
            g = tuple(fields[1 : section + 1])
            self.prob[g] = float(fields[0])
            if len(fields) == section + 2:
                self.bow[g] = float(fields[-1])
        self.order = max((len(g) for g in self.prob), default=0)
        self.vocab = sorted(g[0] for g in self.prob if len(g) == 1 and g[0] != BOS)

    def logprob(self, word: str, history: tuple[str, ...]) -> float:
        """log10 p(word | history) with ARPA back-off; raises KeyError for an unknown word."""
        history = tuple(history)[-(self.order - 1) :] if self.order > 1 else ()
        backoff = 0.0
        while True:
            g = history + (word,)
            if g in self.prob:
                return backoff + self.prob[g]
            if not history:
                raise KeyError(word)
            backoff += self.bow.get(history, 0.0)
            history = history[1:]

    def perplexity(self, sentences: list[list[str]]) -> dict:
        """Perplexity over words and ``</s>`` (SRILM's ``ppl``); OOV words are skipped and counted."""
        total, n, oov = 0.0, 0, 0
        known = set(self.vocab)
        for s in sentences:
            hist = (BOS,)
            for w in s + [EOS]:
                if w not in known:
                    oov += 1
                    hist = (BOS,) if self.order > 1 else ()
                    continue
                total += self.logprob(w, hist)
                n += 1
                hist = hist + (w,)
        ppl = 10 ** (-total / n) if n else float("nan")
        return {"ppl": ppl, "tokens": n, "oov": oov}


def train_lm(sentences, arpa_path, order=3, vocab=None, held_out=None) -> dict:
    """Estimate the LM, write ``arpa_path`` and measure perplexity on each held-out split.

    Args:
        sentences: training word lists.
        vocab: predicted words (default: the training words).
        held_out: ``{split: word lists}`` to report perplexity and OOV rate on.
    """
    vocab = sorted({w for s in sentences for w in s}) if vocab is None else vocab
    model = estimate_kn(sentences, order, vocab)
    write_arpa(model, arpa_path)
    lm = ArpaLM(arpa_path)
    out = {
        "lm_order": order,
        "lm_ngrams": [len(t) for t in model],
        "lm_train_ppl": round(lm.perplexity(sentences)["ppl"], 2),
    }
    for split, sents in (held_out or {}).items():
        r = lm.perplexity(sents)
        out[f"lm_{split}_ppl"] = round(r["ppl"], 2)
        out[f"{split}_oov_rate"] = round(r["oov"] / max(1, r["oov"] + r["tokens"] - len(sents)), 4)
    log.info("lm: %s-gram on %d sentences -> %s %s", order, len(sentences), arpa_path, out)
    return out


_ARPA2FST = """
import sys, kaldilm
text = kaldilm.arpa2fst(input_arpa=sys.argv[1], disambig_symbol="#0", read_symbol_table=sys.argv[2])
open(sys.argv[3], "w").write(text)
"""


def compile_G(arpa_path, words_txt, G_path, timeout: float = 600.0) -> dict:
    """ARPA -> ``G.fst`` (and ``G.fst.txt``) with kaldilm's arpa2fst in a subprocess.

    ``#0`` labels the backoff arcs; ``<s>``/``</s>`` become epsilons. G is ilabel-sorted.
    """
    from local.kaldi import kaldifst

    G_path = Path(G_path)
    text_path = G_path.with_suffix(".fst.txt")
    proc = subprocess.run(
        [sys.executable, "-c", _ARPA2FST, str(arpa_path), str(words_txt), str(text_path)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"kaldilm.arpa2fst failed on {arpa_path} with {words_txt}:\n{proc.stderr[-2000:]}")
    G = kaldifst.compile(s=text_path.read_text(), acceptor=False)
    kaldifst.arcsort(G, sort_type="ilabel")
    G.write(str(G_path))
    log.info(
        "G: %d states, %d arcs -> %s", G.num_states, sum(G.num_arcs(s) for s in range(G.num_states)), G_path
    )
    return {"G_states": G.num_states}


def lm_sentences(data_dir: Path | str, lm_text: Path | str | None = None) -> list[list[str]]:
    """The distinct sentences the lang stage estimated ``lang/lm.arpa`` on: the kept training
    transcripts (``lang/train_ids.txt``) and the sentences of ``lm_text`` (default: the ``--lm-text``
    the lang stage recorded in ``lang/summary.json``) whose words are all in ``lang/words.txt``; with an
    unknown word (``--oov unk``: ``lang/unk_word.txt``) the words outside it are mapped to that word, as the
    lang stage did."""
    from lhotse import CutSet

    from local.data.normalize import normalize_words
    from local.graph.lang import cut_words, map_unknown

    data_dir = Path(data_dir)
    lang = data_dir / "lang"
    for need in ("train_ids.txt", "words.txt", "summary.json"):
        if not (lang / need).exists():
            raise FileNotFoundError(f"{lang / need} is missing; run the lang stage: "
                                    f"python recipes/asr/prepare.py --data-dir {data_dir} --stage 2")
    kept = set(lang.joinpath("train_ids.txt").read_text().split())
    words = {line.split()[0] for line in lang.joinpath("words.txt").read_text().splitlines() if line.strip()}
    unk = lang.joinpath("unk_word.txt").read_text().strip() if lang.joinpath("unk_word.txt").exists() else None
    cuts = CutSet.from_file(data_dir / "manifests" / "train_cuts.jsonl.gz")
    sentences = [map_unknown(cut_words(c), words, unk) for c in cuts if c.id in kept]
    lm_text = lm_text or json.loads(lang.joinpath("summary.json").read_text()).get("lm_text")
    if lm_text:
        path = Path(lm_text)
        if not path.is_file():
            raise FileNotFoundError(f"LM text {path} (the lang stage's --lm-text) is gone; give it again")
        extra = (map_unknown(normalize_words(line), words, unk) for line in path.read_text().splitlines())
        sentences += [w for w in extra if w and all(x in words for x in w)]
    return [list(s) for s in dict.fromkeys(tuple(s) for s in sentences)]


def make_rescore_lm(data_dir: Path | str, order: int, lm_text: Path | str | None = None) -> Path:
    """A larger n-gram for lattice rescoring (``local.graph.lattice.LmRescorer``): ``order`` over
    the lang stage's LM sentences (:func:`lm_sentences`) and vocabulary, written once to
    ``lang/lm_<order>gram.arpa`` (``lm_<order>gram_<text>.arpa`` with another ``lm_text``). Order 3
    gives ``lang/lm.arpa`` again, byte for byte."""
    if not isinstance(order, int) or order < 1:
        raise ValueError(f"rescoring LM order={order!r}; give a whole number >= 1 (4: a 4-gram)")
    lang = Path(data_dir) / "lang"
    suffix = f"_{Path(lm_text).stem}" if lm_text else ""
    path = lang / f"lm_{order}gram{suffix}.arpa"
    if path.exists():
        return path
    sentences = lm_sentences(data_dir, lm_text)
    # the first pass's words (and, over a user's --lm-arpa, the training words it lacks): the rescoring LM
    # must cover every word the graph can output
    vocab = sorted(set(ArpaLM(lang / "lm.arpa").vocab) | {w for s in sentences for w in s})
    from local.atomic import atomic_path

    with atomic_path(path) as tmp:
        stats = train_lm(sentences, tmp, order=order, vocab=[w for w in vocab if w != EOS])
    log.info("rescoring LM: %s (%s)", path, stats)
    return path
