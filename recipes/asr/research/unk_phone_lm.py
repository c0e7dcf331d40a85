#!/usr/bin/env python3
"""Kaldi's ``limit_arpa_unk_history.py`` on a data dir whose decoding graphs spell ``<UNK>`` out of phones
(``prepare.py --unk-model phone``, ``local/graph/unk_model.py``): does G's unknown-word history matter?

G as the lang stage estimates it keeps the n-grams with ``<UNK>`` in their history, so its ``<UNK>`` arcs
lead to as many states as ``<UNK>`` has histories, and ``L_disambig o G`` holds a copy of the phone LM for
each. Kaldi drops those n-grams (and the back-off weights of those that end in ``<UNK>``), so that every
``<UNK>`` arc leads to the one empty history and LG holds one copy. This writes a second data dir
(``--out``) sharing everything with ``--data-dir`` but its lang and graphs: the lang's G so limited (the
states that kaldilm's ``arpa2fst`` keeps with only a free back-off arc skipped, as Kaldi's ``arpa2fst``
removes them: exact), and HCLG rebuilt by the recipe's ``make_hclg`` for each system of ``--systems``.
Decode it with ``gmm_search.py --data-dir <out> --system <system>`` (SAT: the final pass on the speakers'
transforms that its stage estimated) and compare with the data dir's own graphs.

Usage:
  python recipes/asr/research/unk_phone_lm.py --data-dir /tmp/ucdata --out /tmp/ucdata_unklimit \
      --systems mono tri lda_mllt sat
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # recipes/asr: the recipe's `local` package

from local.graph.lang import compile_fst, load_lang, read_symbols
from local.graph.lm import compile_G
from local.graph.unk_model import UNK_DISAMBIG
from local.kaldi import kaldifst


def limit_unk_history(arpa_text: str, unk: str) -> tuple[str, int]:
    """The ARPA without the n-grams that have ``unk`` in their history and without the back-off weights of
    those that end in it (a history that ends in ``unk`` then backs off to the empty one at no cost, and
    Kaldi's ``arpa2fst`` merges its state away); returns the text and the number of n-grams dropped.

    A line-by-line rewrite of the text as written, unlike ``local.graph.user_lm.read_arpa``, which
    normalises the words and leaves out n-grams that normalisation cannot map."""
    counts, dropped, order = Counter(), 0, 0
    body = []
    for line in arpa_text.splitlines():
        s = line.strip()
        if s.startswith("\\") and s.endswith("-grams:"):
            order = int(s[1:].split("-")[0])
            body.append(s)
            continue
        if s == "\\end\\":
            order = 0
            body.append(s)
            continue
        if order and s:
            fields = s.split()
            words = fields[1 : order + 1]
            if unk in words[:-1]:
                dropped += 1
                continue
            if words[-1] == unk and len(fields) == order + 2:  # no back-off: the history ends at the word
                s = "\t".join([fields[0], " ".join(words)])
            counts[order] += 1
            body.append(s)
        elif order:
            body.append(s)
    header = ["\\data\\"] + [f"ngram {n}={counts[n]}" for n in sorted(counts)] + [""]
    return "\n".join(header + body) + "\n", dropped


def skip_redundant_states(g_text: str, backoff: int) -> tuple[str, int]:
    """G's text with every arc into a state whose one way out is a free back-off arc (not final) sent on to
    where that arc leads (Kaldi's ``arpa2fst`` removes such states; kaldilm keeps them): exact. Returns the
    text and the number of arcs redirected."""
    arcs, finals = defaultdict(list), set()
    rows = [line.split() for line in g_text.splitlines() if line.strip()]
    for f in rows:
        if len(f) >= 4:
            arcs[f[0]].append(f)
        else:
            finals.add(f[0])

    def free_backoff(state):
        out = arcs.get(state, [])
        if state in finals or len(out) != 1:
            return None
        f = out[0]
        return f[1] if int(f[2]) == backoff and (len(f) == 4 or float(f[4]) == 0.0) else None

    def end(state):
        seen = set()
        while (nxt := free_backoff(state)) is not None and state not in seen:
            seen.add(state)
            state = nxt
        return state

    moved, out = 0, []
    for f in rows:
        if len(f) >= 4 and (dest := end(f[1])) != f[1]:
            f = [f[0], dest, *f[2:]]
            moved += 1
        out.append(" ".join(f))
    return "\n".join(out) + "\n", moved


def link_tree(src: Path, dst: Path, skip: set[str]) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for name in os.listdir(src):
        if name not in skip and not (dst / name).exists():
            os.symlink(src / name, dst / name)


def build(data_dir: Path, out: Path, systems: list[str]) -> dict:
    from local.gmm.common import GmmSystem
    from local.graph.hclg import make_hclg

    src_lang = load_lang(data_dir / "lang")
    unk = src_lang.unk
    if not unk or UNK_DISAMBIG not in src_lang.phones:
        raise ValueError(f"{data_dir}/lang does not spell an unknown word out of phones (prepare.py --oov unk "
                         "--unk-model phone writes one)")
    link_tree(data_dir, out, {"lang", "exp"})
    lang = out / "lang"
    if lang.exists():
        shutil.rmtree(lang)
    shutil.copytree(data_dir / "lang", lang)
    words = read_symbols(lang / "words.txt")
    arpa, dropped = limit_unk_history((lang / "lm.arpa").read_text(), unk)
    (lang / "lm.arpa").write_text(arpa)
    compile_G(lang / "lm.arpa", lang / "words.txt", lang / "G.fst")
    g_text, moved = skip_redundant_states((lang / "G.fst.txt").read_text(), words["#0"])
    (lang / "G.fst.txt").write_text(g_text)
    G = compile_fst(g_text, "ilabel")
    kaldifst.connect(G)
    G.write(str(lang / "G.fst"))

    def destinations(g) -> int:
        return len({a.nextstate for st in range(g.num_states) for a in kaldifst.ArcIterator(g, st)
                    if a.olabel == words[unk]})

    summary = {"unk_history_ngrams_dropped": dropped, "g_arcs_redirected": moved, "g_states": G.num_states,
               "unk_destinations": destinations(G),
               "unk_destinations_before": destinations(kaldifst.StdVectorFst.read(str(data_dir / "lang" / "G.fst")))}
    for system in systems:
        exp_src, exp = data_dir / "exp" / system, out / "exp" / system
        link_tree(exp_src, exp, {"graph", "decode_dev", "decode_test"})
        for split in ("dev", "test"):  # SAT's final pass reads the speakers' transforms from here
            (exp / f"decode_{split}").mkdir(parents=True, exist_ok=True)
            trans = exp_src / f"decode_{split}" / "trans.pkl"
            if trans.exists() and not (exp / f"decode_{split}" / "trans.pkl").exists():
                os.symlink(trans, exp / f"decode_{split}" / "trans.pkl")
        gmm = GmmSystem.load(exp_src / "final.pkl")
        hclg = make_hclg(lang, gmm.tree, gmm.tm, out_path=exp / "graph" / "HCLG.fst")
        before = kaldifst.StdVectorFst.read(str(exp_src / "graph" / "HCLG.fst")).num_states
        summary[system] = {"hclg_states": hclg.num_states, "hclg_states_before": before}
        print(json.dumps({"system": system, **summary[system]}), flush=True)
    return summary


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", type=Path, required=True, help="a data dir whose GMM stages have run (--oov unk)")
    p.add_argument("--out", type=Path, required=True, help="the second data dir (its lang and graphs its own)")
    p.add_argument("--systems", nargs="+", default=["mono", "tri", "lda_mllt", "sat"])
    args = p.parse_args(argv)
    if args.out.resolve() == args.data_dir.resolve():
        p.error(f"--out {args.out} is --data-dir: give a new directory")
    print(json.dumps(build(args.data_dir, args.out, args.systems)))


if __name__ == "__main__":
    main()
