#!/usr/bin/env python3
"""Dev (or test) WER and decoding time of a trained GMM system at each acoustic scale under several
decoder searches: what Kaldi's wider search (beam 13, 7,000 active states) buys against the recipe's
(beam 10, 3,000), and where.

Searches (``--searches``, any of):

- ``recipe``: beam 10, at most 3,000 active states (``local.graph.decode.RECIPE_SEARCH``);
- ``kaldi``: beam 13, 7,000 (``KALDI_SEARCH``, Kaldi's ``steps/decode.sh``);
- ``recipe7000``: beam 10, 7,000 (the active-state limit alone);
- ``scaled``: Kaldi's beam 13 at ``decode.sh``'s acoustic scale 0.0833 carried to the decoding's
  scale ``s`` (beam ``13 * s / 0.0833``, 7,000): the same room for acoustic cost at every scale, where
  Kaldi decodes once at 0.0833 and moves the scale on its lattices.

The system's dev (or test) features are those its stage decoded (``exp/<system>/final.pkl``'s
transform; for ``sat``, the final pass on the speakers' second fMLLR transforms that the stage saved
in ``decode_<split>/trans.pkl``), the graph is the stage's ``exp/<system>/graph/HCLG.fst``, the GMMs
are evaluated once (as the stage does for dev's sweep) and each search decodes in the stage's
``DECODE_JOBS`` processes. Prints one JSON line per (scale, search): ``wer``, ``errors``, ``seconds``
(the decoding's wall time), and writes each point's ``errs-*``/``recogs-*`` under ``--out``.

Usage:
  python recipes/asr/research/gmm_search.py --data-dir data/synthetic-default --system tri \\
      --scales 0.0588 0.0667 0.0833 --searches recipe kaldi recipe7000 scaled --out exp/gmm_search
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # recipes/asr: the recipe's `local` package

from local.data.features import gmm_cmvn_key
from local.gmm.common import GmmSystem, load_utterances
from local.gmm.decode import DECODE_JOBS
from local.gmm.sat import transformed
from local.graph.decode import (
    KALDI_SEARCH,
    RECIPE_SEARCH,
    Search,
    decode_utterances_gmm,
    gmm_loglikes,
    score,
    words_to_text,
)
from local.graph.lang import load_lang
from local.kaldi import kaldifst

KALDI_DECODE_SCALE = 0.0833  # steps/decode.sh's --acwt, the scale Kaldi's GMM lattices are searched at


def search_at(name: str, scale: float) -> Search:
    """The search ``name`` (the module's list) at acoustic scale ``scale``."""
    if name == "recipe":
        return RECIPE_SEARCH
    if name == "kaldi":
        return KALDI_SEARCH
    if name == "recipe7000":
        return Search(RECIPE_SEARCH.beam, KALDI_SEARCH.max_active)
    if name == "scaled":
        return Search(round(KALDI_SEARCH.beam * scale / KALDI_DECODE_SCALE, 3), KALDI_SEARCH.max_active)
    raise ValueError(f"search {name!r}: use recipe, kaldi, recipe7000 or scaled")


def sweep(data_dir: Path, system_name: str, split: str, scales: list[float], searches: list[str],
          out: Path) -> list[dict]:
    """Decode ``split`` with ``system_name`` at every (scale, search); returns the JSON records."""
    exp = data_dir / "exp" / system_name
    for needed in (exp / "final.pkl", exp / "graph" / "HCLG.fst"):
        if not needed.exists():
            raise FileNotFoundError(f"{needed}: run the {system_name} stage first (prepare.py writes its system "
                                    "and graph)")
    system = GmmSystem.load(exp / "final.pkl")
    lang = load_lang(data_dir / "lang")
    utts = load_utterances(data_dir, split, transform=system.transform)
    feats = dict(utts.feats)
    if system_name == "sat":  # the final pass: the speakers' second transforms, as the stage estimated them
        with open(exp / f"decode_{split}" / "trans.pkl", "rb") as f:
            transforms = pickle.load(f)
        feats = transformed(feats, {c.id: gmm_cmvn_key(c) for c in utts.cuts}, transforms)
    loglikes = gmm_loglikes(system.am, feats.items())
    hclg_path = exp / "graph" / "HCLG.fst"
    hclg = kaldifst.StdVectorFst.read(str(hclg_path))
    refs = {u: " ".join(utts.words[u]) for u in utts.ids}
    records = []
    for scale in scales:
        for name in searches:
            search = search_at(name, scale)
            start = time.perf_counter()
            hyps = decode_utterances_gmm(hclg, system.tm, system.am, list(feats.items()), acoustic_scale=scale,
                                         beam=search.beam, max_active=search.max_active, hclg_path=hclg_path,
                                         num_jobs=DECODE_JOBS, loglikes=loglikes)
            seconds = time.perf_counter() - start
            res = score(refs, {u: words_to_text(w, lang.id2word) for u, w in hyps.items()}, out / system_name,
                        f"{split}-acwt{scale:g}-{name}")
            record = {"system": system_name, "split": split, "acoustic_scale": scale, "search": name,
                      **search.record(), "wer": res["wer"], "errors": res["errors"], "words": res["words"],
                      "seconds": round(seconds, 1)}
            print(json.dumps(record), flush=True)
            records.append(record)
    return records


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", type=Path, required=True, help="a data dir the GMM stages have run on")
    p.add_argument("--system", required=True, help="mono, tri, lda_mllt or sat (exp/<system>)")
    p.add_argument("--split", default="dev", choices=("dev", "test"))
    p.add_argument("--scales", type=float, nargs="+", required=True, help="acoustic scales to decode at")
    p.add_argument("--searches", nargs="+", default=["recipe", "kaldi"],
                   choices=("recipe", "kaldi", "recipe7000", "scaled"))
    p.add_argument("--out", type=Path, required=True, help="where each point's errs-*/recogs-* go")
    args = p.parse_args(argv)
    if any(s <= 0 for s in args.scales):
        p.error(f"--scales {args.scales}: give positive acoustic scales (the recipe's grids: 0.0425-0.104)")
    sweep(args.data_dir, args.system, args.split, args.scales, args.searches, args.out)


if __name__ == "__main__":
    main()
