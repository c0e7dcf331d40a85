"""Shared pieces of GMM-HMM training (Kaldi's ``gmm-acc-stats-ali`` / ``gmm-est`` /
``gmm-align-compiled`` / ``convert-ali``), used by the monophone and triphone stages.

Statistics are accumulated in numpy over the whole training set at once: per pdf, one call
to ``DiagGmm.log_likelihoods_matrix`` for all its frames, Gaussian posteriors, then
occupancy, first- and second-order sums per Gaussian. They are handed to Kaldi's
``AccumAmDiagGmm`` as two pseudo-frames per Gaussian (``accumulate_from_posteriors``), so the
M-step is Kaldi's own ``mle_am_diag_gmm_update`` (variance floor, low-count Gaussian removal)
while Python makes ~2 calls per Gaussian instead of one per frame. A Gaussian with
occupancy ``n``, sums ``Σx`` and ``Σx²`` is reproduced exactly by the frames
``m ± s`` (``m = Σx/n``, ``s² = Σx²/n − m²``), each of weight ``n/2``.
"""

from __future__ import annotations

import json
import logging
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from local.constants import SELF_LOOP_SCALE, TRANSITION_SCALE
from local.gmm.align_jobs import TrainingGraphs
from local.gmm.tree_stats import TidTables, _phone_ends
from local.graph.hclg import training_graph_compiler
from local.kaldi import kaldifst, khg

log = logging.getLogger(__name__)

ACOUSTIC_SCALE = 0.1  # Kaldi's --acoustic-scale for alignment
# GMM front-end CMVN: "speaker" (mean and variance over each speaker's utterances of a split, as
# Kaldi's per-speaker cmvn.scp) or "utterance" (each utterance on its own).
CMVN = "speaker"


def front_end_id(lda_mllt: bool = False) -> str:
    """What the GMMs are trained on (``features.gmm_features`` with the ``CMVN`` setting, then
    Δ + ΔΔ, or with ``lda_mllt`` spliced and projected by an LDA+MLLT transform,
    ``local.gmm.lda_mllt``); stored with every system so that a system and the features it is used
    with always agree."""
    if lda_mllt:
        return f"13 MFCC, {CMVN} mean+variance CMVN, spliced, LDA+MLLT"
    return f"13 MFCC, {CMVN} mean+variance CMVN, deltas+double deltas"


@dataclass
class GmmSystem:
    """A GMM-HMM: transition model, per-pdf diagonal GMMs, context-dependency tree, and the
    LDA+MLLT transform of its features (``[d, 13 * frames spliced]``), None for Δ + ΔΔ features."""

    tm: khg.TransitionModel
    am: khg.AmDiagGmm
    tree: khg.ContextDependency
    transform: np.ndarray | None = None

    def save(self, path: Path | str) -> None:
        """Pickle to ``path`` (the khg objects pickle through Kaldi's binary format; the transform,
        when there is one, travels with the model)."""
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        d = {"tm": self.tm, "am": self.am, "tree": self.tree, "front_end": front_end_id(self.transform is not None)}
        if self.transform is not None:
            d["transform"] = np.asarray(self.transform, np.float64)
        with open(path, "wb") as f:
            pickle.dump(d, f)

    def features(self, cuts, cmvn: str | None = None) -> dict[str, np.ndarray]:
        """The features this system models, of ``cuts`` (one split): ``gmm_front_end`` with its
        transform."""
        return gmm_front_end(cuts, cmvn, self.transform)

    def save_run(self, exp: Path, alis: dict, history: list) -> None:
        """A trained stage's outputs in ``exp``: ``final.pkl``, ``ali.pkl`` (transition-ids per
        utterance) and ``history.json`` (one entry per training pass)."""
        self.save(exp / "final.pkl")
        with open(exp / "ali.pkl", "wb") as f:
            pickle.dump(alis, f)
        (exp / "history.json").write_text(json.dumps(history, indent=1))

    @classmethod
    def load_run(cls, exp: Path, feats: dict) -> tuple[GmmSystem, dict[str, np.ndarray]]:
        """A trained stage's system and its alignments of the utterances in ``feats`` (the next
        stage's starting point); raises if none of them has one."""
        system = cls.load(exp / "final.pkl")
        with open(exp / "ali.pkl", "rb") as f:
            alis = {u: a for u, a in pickle.load(f).items() if u in feats}
        if not alis:
            raise RuntimeError(f"{exp}/ali.pkl has no alignment of the current training cuts; re-run that stage")
        return system, alis

    @classmethod
    def load(cls, path: Path | str, check_front_end: bool = True) -> GmmSystem:
        """Unpickle a system; with ``check_front_end``, one trained on other GMM features than
        the current ``front_end_id()`` (e.g. by an older version of the recipe) is refused."""
        if not Path(path).exists():
            raise RuntimeError(f"{path} is missing; run the stage that trains it first")
        with open(path, "rb") as f:
            d = pickle.load(f)
        transform = d.get("transform")
        if check_front_end and d.get("front_end") != front_end_id(transform is not None):
            data_dir = Path(path).parents[2]
            raise RuntimeError(
                f"{path} was trained on GMM features {d.get('front_end')!r}, not the current "
                f"{front_end_id(transform is not None)!r}; retrain the GMM stages: python recipes/asr/prepare.py "
                f"--data-dir {data_dir} --stage 3 --force"
            )
        return cls(d["tm"], d["am"], d["tree"], transform)

    def tid2pdf(self) -> np.ndarray:
        """``[num_transition_ids + 1]`` int64: pdf of each transition-id (entry 0 unused)."""
        return np.asarray(self.tm.id2pdf_id, dtype=np.int64)

    def info(self) -> dict:
        return {"pdfs": self.tm.num_pdfs, "gaussians": self.am.num_gauss, "transition_ids": self.tm.num_transition_ids}


def read_topology(topo_text: str) -> khg.HmmTopology:
    topo = khg.HmmTopology()
    topo.read(topo_text)
    return topo


def single_gaussian_am(means: np.ndarray, variances: np.ndarray) -> khg.AmDiagGmm:
    """One diagonal Gaussian per pdf. Args: means, variances ``[num_pdfs, D]``."""
    am = khg.AmDiagGmm()
    for mean, var in zip(np.asarray(means, np.float32), np.asarray(variances, np.float32)):
        g = khg.DiagGmm(nmix=1, dim=len(mean))
        g.set_weights(np.ones(1, np.float32))
        g.set_means(mean[None])
        g.set_invvars(1.0 / var[None])
        g.compute_gconsts()
        am.add_pdf(g)
    return am


# ---------------------------------------------------------------- graphs and alignment
def compile_graphs(system: GmmSystem, lang, word_ids: dict[str, list[int]]) -> TrainingGraphs:
    """Training graph (HCL for the transcript, no probabilities yet) per utterance id."""
    compiler = training_graph_compiler(lang.dir, system.tree, system.tm)
    return TrainingGraphs({utt: compiler.compile_graph_from_text(ids) for utt, ids in word_ids.items()}, lang.dir,
                          word_ids)


def equal_alignment(graph, num_frames: int, seed: int = 0) -> np.ndarray | None:
    """Flat-start alignment (Kaldi's ``align-equal-compiled``): transition-ids ``[T]`` spread
    evenly over a random path of the graph, or None when ``num_frames`` is shorter than every
    path (the utterance is too short for its HMM sequence)."""
    ok, afst = kaldifst.equal_align(ifst=graph, length=num_frames, rand_seed=seed, num_retries=10)
    if not ok:
        return None
    ok, ali, _, _ = kaldifst.get_linear_symbol_sequence(afst)
    if not ok or len(ali) != num_frames:
        return None
    return np.asarray(ali, dtype=np.int32)


def viterbi_align(
    system: GmmSystem, graph, feats: np.ndarray, utt: str, beam: float = 10.0, retry_beam: float = 40.0
) -> tuple[np.ndarray | None, float]:
    """Viterbi alignment of ``feats`` ``[T, D]`` to ``graph`` (``gmm-align-compiled``).

    Returns:
        transition-ids ``[T]`` (None when no path survives ``retry_beam``) and the
        acoustic log-likelihood of the path (unscaled).
    """
    fst = graph.copy()
    khg.add_transition_probs(
        trans_model=system.tm, transition_scale=TRANSITION_SCALE, self_loop_scale=SELF_LOOP_SCALE, fst=fst
    )
    dec = khg.DecodableAmDiagGmmScaled(am=system.am, tm=system.tm, feats=feats, scale=ACOUSTIC_SCALE)
    done, _, _, like, _, ali, _ = khg.align_utterance_wrapper(
        config=khg.AlignConfig(beam=beam, retry_beam=retry_beam),
        utt=utt,
        acoustic_scale=ACOUSTIC_SCALE,
        fst=fst,
        decodable=dec,
        num_done=0,
        num_error=0,
        num_retried=0,
        tot_like=0.0,
        frame_count=0,
    )
    if not done or len(ali) != len(feats):
        return None, float("-inf")
    return np.asarray(ali, dtype=np.int32), like


# ---------------------------------------------------------------- statistics and update
@dataclass
class Stats:
    """Sufficient statistics of one pass over the data."""

    accs: khg.AccumAmDiagGmm
    transitions: np.ndarray  # [num_transition_ids + 1] float64 counts per transition-id
    pdf_occs: np.ndarray  # [num_pdfs] float32 frames per pdf
    log_like: float  # total GMM log-likelihood of the aligned frames
    frames: int


def accumulate(system: GmmSystem, feats: np.ndarray, ali: np.ndarray) -> Stats:
    """E-step over all aligned frames at once (``gmm-acc-stats-ali``).

    Args:
        feats: every training frame, concatenated ``[N, D]`` float32.
        ali: transition-id of each frame ``[N]``.
    """
    if len(feats) != len(ali):
        raise ValueError(f"{len(feats)} frames but {len(ali)} alignment entries; they must match")
    am, tm = system.am, system.tm
    pdf = system.tid2pdf()[ali]
    accs = khg.AccumAmDiagGmm()
    accs.init(model=am, flags=khg.GmmUpdateFlags.kGmmAll)
    order = np.argsort(pdf, kind="stable")
    bounds = np.searchsorted(pdf[order], np.arange(tm.num_pdfs + 1))
    pdf_occs = np.diff(bounds).astype(np.float32)
    total = 0.0
    for p in range(tm.num_pdfs):
        idx = order[bounds[p] : bounds[p + 1]]
        if len(idx) == 0:
            continue
        x = feats[idx]
        ll = np.asarray(am.get_pdf(p).log_likelihoods_matrix(x), dtype=np.float64)  # [n, G]
        top = ll.max(1, keepdims=True)
        frame_ll = top[:, 0] + np.log(np.exp(ll - top).sum(1))
        total += float(frame_ll.sum())
        post = np.exp(ll - frame_ll[:, None])
        occ = post.sum(0)
        x64 = x.astype(np.float64)
        mean = (post.T @ x64) / np.maximum(occ, 1e-20)[:, None]
        var = np.maximum((post.T @ (x64 * x64)) / np.maximum(occ, 1e-20)[:, None] - mean**2, 0.0)
        std = np.sqrt(var)
        for g in np.flatnonzero(occ > 0):
            w = np.zeros(len(occ), np.float32)
            w[g] = occ[g] / 2
            for sign in (1.0, -1.0):
                frame = (mean[g] + sign * std[g]).astype(np.float32)
                accs.accumulate_from_posteriors(model=am, data=frame, gmm_index=p, weight=w)
    trans = np.bincount(ali, minlength=tm.num_transition_ids + 1).astype(np.float64)
    return Stats(accs, trans, pdf_occs, total, len(ali))


def update(
    system: GmmSystem,
    stats: Stats,
    target_gauss: int = 0,
    min_gaussian_occupancy: float = 10.0,
    power: float = 0.2,
    min_count: float = 20.0,
    seed: int = 0,
) -> None:
    """M-step (``gmm-est``): transitions, GMM means/variances/weights, then mixture growth
    towards ``target_gauss`` Gaussians in total (``--mix-up``; 0 keeps the count), its
    perturbations drawn from ``seed`` (``split_by_count``)."""
    cfg = khg.MleTransitionUpdateConfig()
    system.tm.mle_update(stats.transitions, cfg)
    opts = khg.MleDiagGmmOptions()
    opts.min_gaussian_occupancy = min_gaussian_occupancy
    khg.mle_am_diag_gmm_update(
        config=opts, amdiag_gmm_acc=stats.accs, flags=khg.str_to_gmm_flags("mvw"), am_gmm=system.am
    )
    if target_gauss > system.am.num_gauss:
        split_by_count(system.am, stats.pdf_occs, target_gauss, power=power, min_count=min_count, seed=seed)


def split_by_count(
    am, state_occs, target_gauss: int, perturb_factor: float = 0.01, power: float = 0.2, min_count: float = 20.0,
    seed: int = 0,
) -> None:
    """Kaldi's mixing up (``AmDiagGmm::SplitByCount``), with the means perturbed from a seeded generator.

    kaldi-hmm-gmm draws the perturbation of each split from ``std::random_device``, which cannot be
    seeded: the same data gave a different GMM in every run (the tiny test corpus's triphone system
    had 68 to 73 pdfs from one run to the next). So the split itself is Kaldi's, with no perturbation,
    and the perturbation is replayed here in Kaldi's order from the split history: for the ``j``-th
    split of a pdf, of Gaussian ``i`` into ``i`` and ``n0 + j``, ``r = randn(dim) * sqrt(inv_var[i])``,
    ``means_invvars[n0 + j] = means_invvars[i] + perturb_factor * r``, ``means_invvars[i] -= perturb_factor
    * r``. The number of Gaussians per pdf is khg's own (``split_by_count`` run on a copy); the
    generator's seed is ``(seed, Gaussians before, target_gauss)``.
    """
    occs = np.asarray(state_occs, dtype=np.float32)
    planned = pickle.loads(pickle.dumps(am))
    planned.split_by_count(
        state_occs=occs, target_components=target_gauss, perturb_factor=0.0, power=power, min_count=min_count
    )
    rng = np.random.default_rng((seed, am.num_gauss, target_gauss))
    for pdf in range(am.num_pdfs):
        target = planned.get_pdf(pdf).num_gauss
        gmm = am.get_pdf(pdf)
        first_new = gmm.num_gauss
        if target <= first_new:
            continue
        history = gmm.split(target, 0.0)
        inv_vars = np.array(gmm.inv_vars, dtype=np.float64)
        means_invvars = np.array(gmm.means_invvars, dtype=np.float64)
        for j, i in enumerate(history):
            r = rng.standard_normal(inv_vars.shape[1]) * np.sqrt(inv_vars[i])
            means_invvars[first_new + j] = means_invvars[i] + perturb_factor * r
            means_invvars[i] -= perturb_factor * r
        gmm.set_invvars_and_means(inv_vars.astype(np.float32), (means_invvars / inv_vars).astype(np.float32))
        gmm.compute_gconsts()


# ---------------------------------------------------------------- alignment conversion
def phone_instances(ali: np.ndarray, tables: TidTables) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per frame: (phone instance index, left phone, right phone); 0 outside the utterance.

    Phone instances are split as Kaldi's ``SplitToPhones`` does (``tree_stats``), reordered
    self-loops included.
    """
    tid = np.asarray(ali, dtype=np.int64)
    end = _phone_ends(tid, tables)
    instance = np.concatenate([[0], np.cumsum(end)])
    inst_phone = tables.phone[tid][np.flatnonzero(np.concatenate([[True], end]))]
    left = np.concatenate([[0], inst_phone[:-1]])[instance]
    right = np.concatenate([inst_phone[1:], [0]])[instance]
    return instance, left, right


def phones_of(ali: np.ndarray, tables: TidTables) -> list[int]:
    """The phone sequence of an alignment (one entry per phone instance)."""
    instance, _, _ = phone_instances(ali, tables)
    starts = np.flatnonzero(np.diff(np.concatenate([[-1], instance])))
    return tables.phone[np.asarray(ali, dtype=np.int64)[starts]].tolist()


def convert_alignments(alis: dict[str, np.ndarray], old: GmmSystem, new: GmmSystem) -> dict[str, np.ndarray]:
    """Map alignments to another tree/transition model of the same topology, frame by frame
    (Kaldi's ``convert-ali``): each frame keeps its phone, HMM state and transition index; its
    pdfs come from the new tree with the phone's context.

    Args:
        alis: ``{utt: transition-ids of old [T]}``.

    Returns:
        ``{utt: transition-ids of new [T]}`` (int32).
    """
    old_tables = TidTables.from_transition_model(old.tm)
    old_tuples = [t.__getstate__()[:2] for t in old.tm.tuples]
    old_state2id, old_id2state = old.tm.state2id, old.tm.id2state
    new_state = {tuple(t.__getstate__()[:4]): s + 1 for s, t in enumerate(new.tm.tuples)}
    new_state2id, topo = new.tm.state2id, new.tm.topo
    cache: dict[tuple[int, int, int], int] = {}

    def convert(old_tid: int, lphone: int, rphone: int) -> int:
        state = old_id2state[old_tid]
        phone, hmm_state = old_tuples[state - 1]
        hmm = topo.topology_for_phone(phone)[hmm_state]
        ctx = [lphone, phone, rphone] if new.tree.context_width == 3 else [phone]
        ok_f, fwd = new.tree.compute(ctx, hmm.forward_pdf_class)
        ok_s, loop = new.tree.compute(ctx, hmm.self_loop_pdf_class)
        if not (ok_f and ok_s):
            raise RuntimeError(f"the new tree has no pdf for context {ctx}; was it built for these phones?")
        return new_state2id[new_state[(phone, hmm_state, fwd, loop)]] + old_tid - old_state2id[state]

    out = {}
    for utt, ali in alis.items():
        tid = np.asarray(ali, dtype=np.int64)
        _, left, right = phone_instances(tid, old_tables)
        keys, inverse = np.unique(np.stack([tid, left, right], axis=1), axis=0, return_inverse=True)
        new_tids = np.empty(len(keys), dtype=np.int32)
        for k, key in enumerate(map(tuple, keys.tolist())):
            if key not in cache:
                cache[key] = convert(*key)
            new_tids[k] = cache[key]
        out[utt] = new_tids[inverse.ravel()]
    return out


# ---------------------------------------------------------------- data
def is_augmented(cut) -> bool:
    """True for the sox-augmented copy of a training utterance.

    The synthetic corpus marks it with an ``augmentation`` entry in the supervision's custom
    fields and a ``-aug`` id suffix.
    """
    customs = [cut.custom or {}] + [s.custom or {} for s in cut.supervisions]
    return any("augmentation" in c for c in customs) or cut.id.endswith("-aug")


@dataclass
class Utterances:
    """The utterances of one split with what GMM training and decoding need."""

    cuts: list
    feats: dict[str, np.ndarray]  # id -> [T, D] (39: Δ + ΔΔ; the LDA+MLLT dimension)
    words: dict[str, list[str]]  # id -> transcript words

    @property
    def ids(self) -> list[str]:
        return [c.id for c in self.cuts]


def load_utterances(data_dir: Path, split: str, clean_only: bool = True, cmvn: str | None = None,
                    transform: np.ndarray | None = None) -> Utterances:
    """Feature cuts of ``split`` (``load_cuts``) with their GMM features and words. ``cmvn``: "speaker"
    or "utterance" mean and variance normalisation of the GMM features (``gmm_front_end``), None for
    the module default ``CMVN``; ``transform``: the LDA+MLLT transform of a system trained on such
    features (``GmmSystem.transform``), None for Δ + ΔΔ."""
    from local.graph.lang import cut_words

    cuts = load_cuts(data_dir, split, clean_only)
    feats = gmm_front_end(cuts, cmvn, transform)
    return Utterances(cuts, feats, {c.id: cut_words(c) for c in cuts})


def load_cuts(data_dir: Path, split: str, clean_only: bool = True) -> list:
    """Feature cuts of ``split``; for train only those the lang stage kept (no OOV) and, with
    ``clean_only``, no augmented copies."""
    from lhotse import CutSet

    path = Path(data_dir) / "features" / f"{split}_cuts.jsonl.gz"
    if not path.exists():
        raise RuntimeError(f"{path} is missing; run prepare.py --stage 1 first")
    cuts = list(CutSet.from_file(path))
    if split == "train":
        kept_file = Path(data_dir) / "lang" / "train_ids.txt"
        if kept_file.exists():
            kept = set(kept_file.read_text().split())
            cuts = [c for c in cuts if c.id in kept]
        if clean_only:
            cuts = [c for c in cuts if not is_augmented(c)]
    return cuts


def gmm_front_end(cuts, cmvn: str | None = None, transform: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """GMM features ``{cut id: [T, D]}`` of ``cuts`` (one split), normalised per speaker over
    these cuts or per utterance (``cmvn``, None for the module default ``CMVN``): with ``transform``
    None, the CMVN'd MFCC with Δ and ΔΔ (39 dims); else the CMVN'd MFCC spliced and projected by
    ``transform`` (``lda_mllt.lda_mllt_features``)."""
    from local.data.features import gmm_features

    stats = _cmvn_stats(cuts, cmvn)
    if transform is None:
        return {c.id: gmm_features(c, stats) for c in cuts}
    from local.gmm.lda_mllt import lda_mllt_features

    return {c.id: lda_mllt_features(gmm_features(c, stats, deltas=False), transform) for c in cuts}


def gmm_mfcc(cuts, cmvn: str | None = None) -> dict[str, np.ndarray]:
    """The CMVN'd 13 MFCC ``{cut id: [T, 13]}`` of ``cuts`` (one split), as ``gmm_front_end``
    normalises them, before Δ + ΔΔ or splicing."""
    from local.data.features import gmm_features

    stats = _cmvn_stats(cuts, cmvn)
    return {c.id: gmm_features(c, stats, deltas=False) for c in cuts}


def _cmvn_stats(cuts, cmvn: str | None):
    """Per-speaker CMVN statistics of ``cuts`` for ``cmvn`` "speaker", None for "utterance"."""
    from local.data.features import gmm_speaker_stats

    cmvn = CMVN if cmvn is None else cmvn
    if cmvn not in ("speaker", "utterance"):
        raise ValueError(f"cmvn={cmvn!r}; use 'speaker' or 'utterance'")
    return gmm_speaker_stats(cuts) if cmvn == "speaker" else None


def begin_stage(data_dir: Path | str, name: str) -> tuple[Path, Path, object]:
    """The common start of a GMM stage: one torch thread, ``exp/<name>`` created, the stage's old
    drop records cleared, the lang loaded. Returns ``(data_dir, exp dir, lang)``."""
    import torch

    from local.drops import clear_drops
    from local.graph.lang import load_lang

    torch.set_num_threads(1)
    data_dir = Path(data_dir)
    exp = data_dir / "exp" / name
    exp.mkdir(parents=True, exist_ok=True)
    clear_drops(data_dir, name)
    return data_dir, exp, load_lang(data_dir / "lang")


# ---------------------------------------------------------------- the training loop
def realign_all(
    system: GmmSystem,
    graphs: dict,
    utts: Utterances,
    ids: list[str],
    data_dir: Path | None,
    stage: str,
    split: str = "train",
    beam: float = 10.0,
    retry_beam: float = 40.0,
) -> dict[str, np.ndarray]:
    """Viterbi-align ``ids``; utterances without a path even at ``retry_beam`` are dropped
    (reason ``alignment_failed``) and left out of the result. In the processes of ``graphs.jobs`` when
    ``align_jobs.align_jobs`` attached them."""
    from local.drops import record_drop

    jobs = getattr(graphs, "jobs", None)
    if jobs is not None:
        found = jobs.align(system, ids, utts.feats, beam, retry_beam)
    else:
        found = {u: viterbi_align(system, graphs[u], utts.feats[u], u, beam=beam, retry_beam=retry_beam)[0]
                 for u in ids}
    alis = {}
    for utt in ids:
        ali = found[utt]
        if ali is None:
            log.warning("%s: %s has no alignment even at retry beam %g; dropped", stage, utt, retry_beam)
            if data_dir is not None:
                record_drop(data_dir, stage, split, utt, "alignment_failed", f"no path at retry_beam={retry_beam}")
            continue
        alis[utt] = ali
    return alis


def train_iterations(
    system: GmmSystem,
    graphs: dict,
    utts: Utterances,
    alis: dict[str, np.ndarray],
    num_iters: int,
    realign_iters: set[int],
    total_gauss: int,
    max_iter_inc: int,
    data_dir: Path | None,
    stage: str,
    beam: float = 10.0,
    adapt: Callable[[int, dict[str, np.ndarray]], bool] | None = None,
    seed: int = 0,
) -> tuple[dict[str, np.ndarray], list[dict]]:
    """Kaldi's Viterbi training loop (``train_mono.sh`` / ``train_deltas.sh``): pass 0 on the
    given alignments, then passes ``1..num_iters-1``, re-aligning first on ``realign_iters``;
    the Gaussian count grows linearly to ``total_gauss`` by pass ``max_iter_inc``.

    ``adapt(pass, alignments)``, called after any re-alignment of a pass, may replace features in
    ``utts.feats`` (``train_sat.sh``'s fMLLR re-estimation) and returns True when it did. ``seed``:
    of the mixing up's perturbations, the only random step of the loop.

    Returns:
        the final alignments and one record per pass (avg log-likelihood per frame, Gaussians).
    """
    from tqdm import tqdm

    num_gauss = system.am.num_gauss
    inc = max((total_gauss - num_gauss) // max(max_iter_inc, 1), 0)
    history = []
    ids, feats_all = None, None
    for it in tqdm(range(num_iters), desc=f"{stage} passes", unit="pass", leave=False):
        if it in realign_iters:
            alis = realign_all(system, graphs, utts, list(alis), data_dir, stage, beam=beam)
        if adapt is not None and adapt(it, alis):
            ids = None
            if getattr(graphs, "jobs", None) is not None:
                graphs.jobs.features_changed()
        if ids != list(alis):
            ids = list(alis)
            feats_all = np.concatenate([utts.feats[u] for u in ids])
        if not ids:
            raise RuntimeError(f"{stage}: every training utterance failed to align; check features and lang")
        stats = accumulate(system, feats_all, np.concatenate([alis[u] for u in ids]))
        update(system, stats, target_gauss=num_gauss, min_gaussian_occupancy=3.0 if it == 0 else 10.0, seed=seed)
        if it <= max_iter_inc:
            num_gauss = min(num_gauss + inc, total_gauss)
        rec = {"pass": it, "log_like_per_frame": stats.log_like / stats.frames, "gaussians": system.am.num_gauss,
               "utterances": len(ids), "realigned": it in realign_iters}
        history.append(rec)
        log.info("%s pass %2d: avg log-like %.3f per frame over %d frames, %d Gaussians%s", stage, it,
                 rec["log_like_per_frame"], stats.frames, rec["gaussians"], " (realigned)" if rec["realigned"] else "")
    return alis, history
