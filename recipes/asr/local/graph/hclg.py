"""Decoding graph HCLG and training-graph compiler (Kaldi's ``mkgraph.sh`` and
``compile-train-graphs`` with kaldifst + kaldi_hmm_gmm).

``make_hclg`` follows mkgraph.sh step by step:

1. LG  = det*(L_disambig o G) in the log semiring, then minimise (encoded).
2. CLG = context expansion of LG for the tree's context width N and central position P
   (N=1, P=0 for a monophone tree: C is the identity but the ilabels become context windows).
3. Ha  = the HMM transducer from context windows to transition-ids (no self-loops yet).
4. HCLGa = det*(Ha o CLG); the disambiguation transition-ids become epsilon; remove epsilons;
   minimise.
5. HCLG = HCLGa with self-loops added (self_loop_scale 0.1, reordered, as Kaldi).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from local.constants import SELF_LOOP_SCALE, TRANSITION_SCALE
from local.graph.lang import load_lang
from local.kaldi import kaldifst, khg

log = logging.getLogger(__name__)


def num_arcs(fst) -> int:
    return sum(fst.num_arcs(s) for s in range(fst.num_states))


def remove_disambig_tids(fst, num_transition_ids: int, disambig_tids: list[int]):
    """``fst`` with the disambiguation transition-ids on its input side replaced by epsilon
    (Kaldi's ``fstrmsymbols``).

    The bindings expose no mutable arc iterator, and copying arc by arc in Python takes seconds
    on a real graph, so this composes with a one-state map ``tid:tid``, ``<eps>:d`` instead.
    """
    m = kaldifst.StdVectorFst()
    m.add_state()
    m.start = 0
    m.set_final(0, 0.0)
    for t in range(1, num_transition_ids + 1):
        m.add_arc(0, kaldifst.StdArc(t, t, 0.0, 0))
    for d in disambig_tids:
        m.add_arc(0, kaldifst.StdArc(0, d, 0.0, 0))
    kaldifst.arcsort(m, sort_type="olabel")
    return kaldifst.StdVectorFst(kaldifst.compose(m, fst))


def with_word_penalty(hclg, penalty: float, word_ids):
    """``hclg`` with ``penalty`` added to the graph cost of every word it outputs (Kaldi's
    ``lattice-add-penalty``, applied to the search instead of a lattice): composed with a one-state map
    ``w:w/penalty`` over ``word_ids`` (the bindings expose no mutable arc iterator), ilabel-sorted for
    the decoder. Like any composition it drops the states that reach no final state (the recipe's graphs
    have none). Raises if a path was lost (an output label missing from ``word_ids``)."""
    m = kaldifst.StdVectorFst()
    m.add_state()
    m.start = 0
    m.set_final(0, 0.0)
    for w in sorted(set(word_ids) - {0}):
        m.add_arc(0, kaldifst.StdArc(w, w, penalty, 0))
    kaldifst.arcsort(m, sort_type="ilabel")
    # kaldifst's compose matches on the first argument's output labels: sorted by them, or arcs go missing
    # (a test graph lost 35 of 783 arcs composed in HCLG's ilabel order)
    by_word = kaldifst.StdVectorFst(hclg)
    kaldifst.arcsort(by_word, sort_type="olabel")
    out = kaldifst.StdVectorFst(kaldifst.compose(by_word, m))  # (trimmed, as composition is: no dead ends)
    kaldifst.arcsort(out, sort_type="ilabel")
    trimmed = kaldifst.StdVectorFst(hclg)
    kaldifst.connect(trimmed)
    if num_arcs(out) != num_arcs(trimmed):
        raise RuntimeError(
            f"the word insertion penalty graph has {num_arcs(out)} arcs, HCLG {num_arcs(trimmed)}: HCLG outputs a "
            "label that is not in words.txt; rebuild the graph (prepare.py --stage 2 --force)"
        )
    return out


def make_hclg(
    lang_dir: Path | str,
    tree,
    trans_model,
    out_path: Path | str | None = None,
    self_loop_scale: float = SELF_LOOP_SCALE,
):
    """Build the decoding graph for ``tree`` / ``trans_model`` from ``lang_dir`` (L_disambig.fst, G.fst).

    Args:
        lang_dir: the stage-2 lang directory.
        tree: a ``khg.ContextDependency`` (monophone N=1, P=0 or triphone N=3, P=1).
        trans_model: the ``khg.TransitionModel`` built on that tree.
        out_path: where to write ``HCLG.fst`` (optional).

    Returns:
        ``HCLG`` (``kaldifst.StdVectorFst``): input labels transition-ids, output labels word ids.
    """
    t0 = time.time()
    lang = load_lang(lang_dir)
    g_path = Path(lang_dir) / "G.fst"
    if not g_path.exists():
        raise RuntimeError(f"{g_path} is missing; run prepare.py --stage 2 (lang + LM) first")
    L = lang.L_disambig()
    kaldifst.arcsort(L, sort_type="olabel")
    G = kaldifst.StdVectorFst.read(str(g_path))
    kaldifst.arcsort(G, sort_type="ilabel")

    LG = kaldifst.StdVectorFst(kaldifst.compose(L, G))
    if kaldifst.determinize_star(LG, use_log=True):  # True means it stopped early (partial result)
        raise RuntimeError(
            "determinization of L o G did not finish; the lexicon needs more disambiguation symbols"
        )
    kaldifst.minimize_encoded(LG)
    t_lg = time.time()

    CLG, ilabel_info = kaldifst.compose_context(
        disambig_syms=lang.disambig_phone_ids,
        context_width=tree.context_width,
        central_position=tree.central_position,
        ifst=LG,
    )
    kaldifst.arcsort(CLG, sort_type="ilabel")
    t_clg = time.time()

    Ha, disambig_tids = khg.get_h_transducer(
        ilabel_info=ilabel_info,
        ctx_dep=tree,
        trans_model=trans_model,
        config=khg.HTransducerConfig(transition_scale=TRANSITION_SCALE),
    )
    kaldifst.arcsort(Ha, sort_type="olabel")
    HCLGa = kaldifst.StdVectorFst(kaldifst.compose(Ha, CLG))
    if kaldifst.determinize_star(HCLGa, use_log=True):
        raise RuntimeError("determinization of Ha o CLG did not finish")
    HCLGa = remove_disambig_tids(HCLGa, trans_model.num_transition_ids, disambig_tids)
    kaldifst.rmepsilon(HCLGa)
    kaldifst.minimize_encoded(HCLGa)
    t_hclga = time.time()

    HCLG = khg.add_self_loops(
        self_loop_scale=self_loop_scale, disambig_syms=[], reorder=True, trans_model=trans_model, ifst=HCLGa
    )
    kaldifst.arcsort(HCLG, sort_type="ilabel")
    if HCLG.num_states == 0:
        raise RuntimeError(f"HCLG from {lang_dir} is empty: G and L share no word sequence (check words.txt)")
    if out_path is not None:
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        HCLG.write(str(out_path))
    t1 = time.time()
    log.info(
        "HCLG: LG %d states (%.1f s), CLG %d (%.1f s), HCLGa (%.1f s), HCLG %d states / %d arcs (%.1f s)%s",
        LG.num_states,
        t_lg - t0,
        CLG.num_states,
        t_clg - t_lg,
        t_hclga - t_clg,
        HCLG.num_states,
        num_arcs(HCLG),
        t1 - t_hclga,
        f" -> {out_path}" if out_path else "",
    )
    return HCLG


def training_graph_compiler(lang_dir: Path | str, tree, trans_model):
    """``khg.TrainingGraphCompiler`` on ``L.fst`` for forced alignment.

    Transition and self-loop scales are 0 (as Kaldi's ``compile-train-graphs``): the transition
    probabilities are added at alignment time with ``khg.add_transition_probs``. Use
    ``compiler.compile_graph_from_text(word_ids)`` per utterance.
    """
    lang = load_lang(lang_dir)
    L = lang.L()
    kaldifst.arcsort(L, sort_type="olabel")
    opts = khg.TrainingGraphCompilerOptions(transition_scale=0.0, self_loop_scale=0.0)
    return khg.TrainingGraphCompiler(
        trans_model=trans_model, ctx_dep=tree, lex_fst=L, disambig_syms=lang.disambig_phone_ids, opts=opts
    )
