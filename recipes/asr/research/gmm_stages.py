#!/usr/bin/env python3
"""Does each GMM stage improve on the one before? Dev and test WER of every GMM system of one or more data
dirs, each against the monophone system with a paired 95 % interval drawn over speakers.

For each data dir and system (``mono``, ``tri``, ``lda_mllt``, ``sat``, those trained) this reads what the
stage's decoding wrote (``exp/<system>/decode_<split>/wer.json``: the acoustic scale and penalty dev chose,
and ``per_utt-<split>-acwt<scale>[-wip<penalty>].json`` at that point; SAT's final fMLLR pass) and the
sizes the stage trained with (``summary.json``), and compares the system with ``mono`` on the same
utterances (``local.wer_stats.paired_difference``, the speakers resampled: a small dev of a few voices
has wide intervals), and with the stage before it (``vs_previous``, past the triphone system: LDA+MLLT
against the triphone system, SAT against the last of them trained). With ``--tree-heldout`` it also scores the triphone tree's growth on speakers it was
not built on (``local.gmm.tree.build_tree``'s ``heldout``): the monophone alignments' tree statistics of
``--heldout-share`` of the training speakers, left out of the tree, and of dev; the held-out log-likelihood
gain per frame at several numbers of leaves says how much of the context that the tree learns carries over
to other voices. Prints JSON.

Usage:
  python recipes/asr/research/gmm_stages.py --data-dirs data/synthetic-default /tmp/user_data --tree-heldout
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # recipes/asr: the recipe's `local` package

from local.wer_stats import paired_difference, per_utterance_counts

SYSTEMS = ("mono", "tri", "lda_mllt", "sat")
LEAF_POINTS = (10, 25, 50, 100, 200, 300, 500, 700, 1000)  # splits past the roots, for the held-out curve


def decoded(data_dir: Path, system: str, split: str) -> dict[str, list[int]] | None:
    """``{utt: [errors, words]}`` of ``system`` on ``split`` at the point dev chose, or None if not decoded."""
    d = data_dir / "exp" / system / f"decode_{split}"
    if not (d / "wer.json").exists():
        return None
    wer = json.loads((d / "wer.json").read_text())
    scale, penalty = wer["acoustic_scale"], float(wer.get("word_insertion_penalty", 0.0))
    name = f"per_utt-{split}-acwt{scale:g}" + (f"-wip{penalty:g}" if penalty else "") + ".json"
    if not (d / name).exists():
        raise FileNotFoundError(f"{d / name} is missing: {d}/wer.json names a point its decoding did not write")
    return json.loads((d / name).read_text())


def speakers_of(data_dir: Path, split: str) -> dict[str, str]:
    """Utterance -> speaker of ``split``'s feature cuts (the GMM front end's speaker)."""
    from lhotse import CutSet
    from local.data.features import gmm_cmvn_key

    return {c.id: gmm_cmvn_key(c) for c in CutSet.from_file(data_dir / "features" / f"{split}_cuts.jsonl.gz")}


def stages(data_dir: Path, speakers: dict[str, dict[str, str]] | None = None) -> dict:
    """Each system's WER on dev and test against ``mono``'s, with its sizes. ``speakers``: ``{split:
    {utt: speaker}}`` (default: the data dir's feature cuts, ``speakers_of``)."""
    out = {}
    for split in ("dev", "test"):
        base = decoded(data_dir, "mono", split)
        if base is None:
            raise FileNotFoundError(f"{data_dir}/exp/mono/decode_{split} is missing: run prepare.py --stage 3 first")
        ids = sorted(base)
        speaker = speakers[split] if speakers else speakers_of(data_dir, split)
        _, index = np.unique([speaker[u] for u in ids], return_inverse=True)
        errors_mono, words = per_utterance_counts(base, ids)
        previous = None  # (system, its errors): the stage before, the one this stage's alignments come from
        for system in SYSTEMS:
            result = decoded(data_dir, system, split)
            if result is None:
                continue
            errors, _ = per_utterance_counts(result, ids)
            diff = paired_difference(errors, errors_mono, words, groups=index)  # the system's WER minus mono's
            summary = json.loads((data_dir / "exp" / system / "summary.json").read_text())
            entry = out.setdefault(system, {"pdfs": summary.get("pdfs"), "gaussians": summary.get("gaussians")})
            entry[split] = {"wer": round(diff["wer_a"], 2),
                            "vs_mono": [round(diff[k], 2) for k in ("diff", "diff_lo", "diff_hi")]}
            if previous is not None and previous[0] != "mono":
                step = paired_difference(errors, previous[1], words, groups=index)
                entry[split]["vs_previous"] = [previous[0], *(round(step[k], 2) for k in ("diff", "diff_lo", "diff_hi"))]
            previous = (system, errors)
    return out


def tree_heldout(data_dir: Path, share: float, seed: int = 0) -> dict:
    """The held-out gain per frame of the triphone tree's growth at ``LEAF_POINTS`` splits past its roots:
    on ``share`` of the training speakers (left out of the tree) and on dev (all of train in the tree)."""
    from local.gmm.common import GmmSystem, compile_graphs, load_utterances, realign_all
    from local.gmm.tree import build_tree
    from local.gmm.tree_stats import TidTables, accumulate_tree_stats
    from local.graph.lang import load_lang

    lang = load_lang(data_dir / "lang")
    train = load_utterances(data_dir, "train")
    mono, alis = GmmSystem.load_run(data_dir / "exp" / "mono", train.feats)
    dev = load_utterances(data_dir, "dev")
    kept = {u: w for u, w in dev.words.items() if lang.unk or not lang.oov_words(w)}
    graphs = compile_graphs(mono, lang, {u: lang.word_ids(w) for u, w in kept.items()})
    dev_alis = realign_all(mono, graphs, dev, sorted(kept), None, "gmm_stages", split="dev")
    tables = TidTables.from_transition_model(mono.tm)

    def stats(alignments, feats, ids):
        return accumulate_tree_stats([alignments[u] for u in ids], [feats[u] for u in ids], tables)

    speaker = speakers_of(data_dir, "train")
    names = sorted({speaker[u] for u in alis})
    random.Random(seed).shuffle(names)
    held = set(names[:max(1, round(share * len(names)))])
    curves = {}
    for name, tree_ids, heldout in (
        ("train_speakers_left_out", [u for u in alis if speaker[u] not in held],
         stats(alis, train.feats, [u for u in alis if speaker[u] in held])),
        ("dev", list(alis), stats(dev_alis, dev.feats, list(dev_alis))),
    ):
        summary = build_tree(stats(alis, train.feats, tree_ids), None, lang.silence_ids, lang.phone_ids,
                             mono.tm.topo.get_phone_to_num_pdf_classes(), num_leaves=100_000,
                             heldout=heldout).summary
        gains = np.cumsum(summary["heldout_gains"]) / summary["heldout_frames"]
        curves[name] = {"roots": summary["roots"], "most_leaves": summary["leaves"],
                        "best_leaves": summary["roots"] + int(np.argmax(gains)) + 1,
                        "gain_per_frame": {summary["roots"] + k: round(float(gains[k - 1]), 3)
                                           for k in LEAF_POINTS if k <= len(gains)}}
    curves["train_speakers_left_out"]["speakers"] = f"{len(held)} of {len(names)}"
    curves["dev"]["utterances"] = f"{len(dev_alis)} of {len(dev.words)}"
    return curves


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dirs", type=Path, nargs="+", required=True, help="data dirs whose GMM stages ran")
    ap.add_argument("--tree-heldout", action="store_true", help="also the tree's held-out gains (a minute or two)")
    ap.add_argument("--heldout-share", type=float, default=0.1, help="share of the training speakers left out")
    args = ap.parse_args(argv)
    if not 0 < args.heldout_share < 1:
        ap.error(f"--heldout-share {args.heldout_share}: give a share between 0 and 1 (0.1: a tenth of the speakers)")
    for data_dir in args.data_dirs:
        report = {"data_dir": str(data_dir), "stages": stages(data_dir)}
        if args.tree_heldout:
            report["tree_heldout"] = tree_heldout(data_dir, args.heldout_share)
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
