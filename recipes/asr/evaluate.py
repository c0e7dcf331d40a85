#!/usr/bin/env python3
"""Decode with trained DNN acoustic models (hybrid DNN-HMM) and compare runs.

For each run: pseudo log-likelihoods ``log p(pdf | x) - log p(pdf)`` of ``checkpoints/last.ckpt``
-> the HCLG of the aligning GMM system (``exp/sat/graph``). By default (``--search lattice``, Kaldi's
``score.sh``) dev and test are each decoded once into word lattices (``local/graph/lattice.py``); the
acoustic scale (1 / LM weight) from ``--acoustic-scales`` (the grid extended past an edge that holds
dev's best, ``pick_scale``) and the word insertion penalty from ``--penalties`` (likewise extended
past an edge, below 0 too: ``penalty_past_edge``) are chosen on dev by rescoring its lattices, and
test's best path at that point is scored (with ``--test-sweep`` also at every scale dev tried, for the
comparison's fixed-scale tables). ``--search best-path`` decodes dev
again at each scale with ``FasterDecoder`` instead (no penalty), as the recipe did before 2026-11-28. Writes ``<run>/decode/`` (``recogs-*``, ``errs-*``,
``per_utt-*``, ``results.json``), then the comparison over runs (markdown, JSON and the dev frame
accuracy plot) under ``--out``.

Usage:
  python recipes/asr/evaluate.py --runs exp/dnn/baseline exp/dnn/gtc
  python recipes/asr/evaluate.py --runs exp/dnn/baseline exp/dnn/gtc --compare-only
  python recipes/asr/evaluate.py --runs exp/dnn/baseline exp/dnn/gtc --skip-decoded --test-sweep
  python recipes/asr/evaluate.py --runs exp/dnn/baseline --rescore-lm 4   # lattices rescored with a 4-gram
  # any other test set, as a Kaldi data dir (wav.scp, text, ...) or a Lhotse cuts manifest:
  python recipes/asr/evaluate.py --checkpoint exp/dnn/gtc/checkpoints/last.ckpt \\
      --test-set /path/to/data/test --data-dir data/synthetic-default   # at the scale dev picked for gtc
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import torch
from local.constants import DNN_ACOUSTIC_SCALES, DNN_PREFERRED_SCALE, WORD_INSERTION_PENALTIES
from local.data.features import SAMPLING_RATE
from local.dnn.compare import compare_runs
from local.dnn.datamodule import splice
from local.dnn.front_end import FrontEnd
from local.dnn.model import AcousticModel
from local.graph.decode import BEAM, MAX_ACTIVE, words_to_text
from local.graph.lattice import LATTICE_SEARCH_BEAM

log = logging.getLogger("evaluate")


def allocator_note(environ: dict | None = None, find_library=None) -> str | None:
    """What to say when the lattices would be decoded with glibc's malloc: ``None`` when jemalloc is
    preloaded (``LD_PRELOAD``, as ``run.sh`` does), else how to preload it or which Debian package has it.
    The lattice decoder spends about a third of its time in malloc and free (``run.sh``'s stage 11)."""
    import ctypes.util
    import os

    environ = os.environ if environ is None else environ
    if "jemalloc" in environ.get("LD_PRELOAD", ""):
        return None
    lib = (find_library or ctypes.util.find_library)("jemalloc")
    install = "" if lib else " (Debian's libjemalloc2, which setup.sh installs)"
    return (f"decoding lattices with glibc's malloc: LD_PRELOAD={lib or 'libjemalloc.so.2'} before the command"
            f"{install}, as run.sh does, decodes the same lattices in about 0.68 times the wall time")


def load_checkpoint(path: Path | str) -> tuple[AcousticModel, int, str]:
    """The model in eval mode on CPU, the context width and the front end it was trained with
    (``fbank`` for checkpoints older than the front-end choice)."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"No such checkpoint: {path}; train with recipes/asr/train.py first")
    blob = torch.load(path, map_location="cpu", weights_only=False)
    data_hp = blob.get("datamodule_hyper_parameters", {})
    model = AcousticModel.load_from_checkpoint(path, map_location="cpu")
    return model.eval(), int(data_hp.get("context", 8)), str(data_hp.get("features", "fbank"))


@torch.no_grad()
def pseudo_loglik(model: AcousticModel, feats: np.ndarray, context: int, log_prior: np.ndarray) -> np.ndarray:
    """``feats`` ``[T, F]`` (CMVN applied) -> ``[T, num_pdfs]`` float32 ``log p(pdf|x) - log p(pdf)``."""
    x = splice(feats, np.array([0, len(feats)]), np.arange(len(feats)), context)
    logpost = torch.log_softmax(model(torch.from_numpy(x)), dim=-1).numpy()
    return logpost - log_prior[None, :]


def utterance_logliks(model, context, log_prior, cuts, front_end: FrontEnd,
                      split: str) -> Iterator[tuple[str, np.ndarray]]:
    """``(cut id, [T, num_pdfs] pseudo log-likelihoods)`` of the cuts of one split, through the
    front end the model was trained with (speaker normalisation and transforms)."""
    for cut, feats in front_end(cuts, split):
        yield cut.id, pseudo_loglik(model, feats, context, log_prior)


def references(cuts) -> dict[str, str]:
    return {c.id: " ".join(s.text or "" for s in c.supervisions) for c in cuts}


class Decoder:
    """The HCLG, transition model and word table of the GMM system whose alignments the DNN was
    trained on (``ali/info.json``: ``exp/sat`` by default, ``exp/tri`` for older data dirs)."""

    def __init__(self, data_dir: Path, beam: float = BEAM, max_active: int = MAX_ACTIVE) -> None:
        from local.gmm.common import GmmSystem
        from local.graph.lang import read_symbols
        from local.kaldi import kaldifst

        info_path = data_dir / "ali" / "info.json"
        info = json.loads(info_path.read_text()) if info_path.exists() else {}
        graph = data_dir / info.get("graph", "exp/tri/graph/HCLG.fst")
        model = data_dir / info.get("model", "exp/tri/final.pkl")
        if not graph.exists():
            raise ValueError(f"No such file: {graph}; run `python recipes/asr/prepare.py --data-dir {data_dir}` "
                             "(the GMM stages build the graph)")
        self.hclg, self.graph = kaldifst.StdVectorFst.read(str(graph)), graph
        self.trans_model = GmmSystem.load(model, check_front_end=False).tm
        if "num_pdfs" in info and self.trans_model.num_pdfs != info["num_pdfs"]:
            raise ValueError(f"{model} has {self.trans_model.num_pdfs} pdfs but {info_path} {info['num_pdfs']}; "
                             f"re-run the align stage: python recipes/asr/prepare.py --data-dir {data_dir} --stage 6")
        self.id2word = {i: w for w, i in read_symbols(data_dir / "lang" / "words.txt").items()}
        self.beam, self.max_active = beam, max_active

    def decode(self, logliks: list[tuple[str, np.ndarray]], scale: float) -> dict[str, str]:
        from local.graph.decode import decode_utterances, words_to_text

        hyps = decode_utterances(self.hclg, self.trans_model, logliks, acoustic_scale=scale, beam=self.beam,
                                 max_active=self.max_active)
        return {u: words_to_text(w, self.id2word) for u, w in hyps.items()}


def locate_run(run_dir: Path, summary: dict, data_dir: Path | None = None) -> tuple[Path, Path]:
    """The checkpoint and data dir of a run, also after its run dir or data dir was moved.

    The checkpoint: the file of the recorded name in ``<run_dir>/checkpoints/`` (a run dir copied
    elsewhere keeps its checkpoints), else the recorded path, else ``checkpoints/last.ckpt``. The data
    dir: ``data_dir`` if given, else the recorded one.

    Raises:
        FileNotFoundError: neither checkpoint exists, or the data dir does not (it names ``--data-dir``).
    """
    recorded = summary.get("checkpoint")
    candidates = [run_dir / "checkpoints" / Path(recorded).name, Path(recorded)] if recorded else []
    candidates.append(run_dir / "checkpoints" / "last.ckpt")
    checkpoint = next((c for c in candidates if c.is_file()), None)
    if checkpoint is None:
        raise FileNotFoundError(f"{run_dir}: no checkpoint at {', '.join(map(str, dict.fromkeys(candidates)))}; "
                                "train the run again or copy its checkpoints/ into the run dir")
    data_dir = Path(data_dir or summary["data_dir"])
    if not (data_dir / "ali").is_dir():
        raise FileNotFoundError(f"{run_dir} was trained on {data_dir}, which has no ali/ (moved or deleted?); "
                                "pass the data dir with --data-dir DIR")
    return checkpoint, data_dir


def evaluate_run(run_dir: Path, data_dir: Path | None, scales: tuple[float, ...], beam: float | None = None,
                 max_active: int = MAX_ACTIVE, test_sweep: bool = False, search: str = "lattice",
                 penalties: tuple[float, ...] = WORD_INSERTION_PENALTIES, rescore_lm: str | int | None = None) -> dict:
    """Pick the acoustic scale (1 / LM weight; the grid extended by ``pick_scale``) and, with lattices,
    the word insertion penalty on dev; decode test with them; write ``<run_dir>/decode/``.

    ``search="lattice"`` (Kaldi's way): dev and test are each decoded once into word lattices
    (``local.graph.lattice``) and every (scale, penalty) point is a best path through them.
    ``search="best-path"``: dev is decoded again at each scale with ``FasterDecoder`` (no penalty).

    ``test_sweep``: also decode test at every scale (``per_utt-test-acwt<scale>.json`` and
    ``results.json["test_sweep"]``), to see how much of a WER difference between runs is the scale
    each picked on dev. The reported test WER stays the one at the scale dev picked.

    ``rescore_lm`` (lattice search only): rescore the lattices with a larger LM (``LmRescorer``) before
    the grid, an n-gram order (``make_rescore_lm``: that order on the lang stage's LM sentences) or an
    ARPA file over the graph's words. The scale and penalty are then chosen on the rescored dev
    lattices; ``results.json["lm_rescore"]`` keeps the first pass's choice and WERs beside them."""
    from lhotse import CutSet
    from local.graph.decode import pick_scale, score

    start = time.perf_counter()
    summary = json.loads((run_dir / "train_summary.json").read_text())
    checkpoint, data_dir = locate_run(run_dir, summary, data_dir)
    model, context, features = load_checkpoint(checkpoint)
    log_prior = np.log(np.load(data_dir / "ali" / "priors.npy")).astype(np.float32)
    front_end = FrontEnd(data_dir, features)
    settings = decode_settings(search, beam, max_active, scales, penalties)
    beam = settings["beam"]
    decoder, out = Decoder(data_dir, beam, max_active), run_dir / "decode"
    # all dev utterances (also those the GMM could not align, e.g. with OOV words), like test
    dev_cuts = CutSet.from_file(data_dir / "features" / "dev_cuts.jsonl.gz")
    dev = list(utterance_logliks(model, context, log_prior, dev_cuts, front_end, "dev"))
    if search == "lattice":
        return _evaluate_lattices(run_dir, data_dir, features, decoder, dev, dev_cuts, model, context, log_prior,
                                  front_end, scales, penalties, test_sweep, start, rescore_lm, settings)
    if search != "best-path":
        raise ValueError(f"search={search!r}: use lattice or best-path")
    if rescore_lm is not None:
        raise ValueError("rescoring with a larger LM needs lattices: use search='lattice' (--search lattice)")
    sweep = {}

    def dev_wer(scale: float) -> float:
        sweep[scale] = score(references(dev_cuts), decoder.decode(dev, scale), out, f"dev-acwt{scale:g}")
        return sweep[scale]["wer"]

    best, grid = pick_scale(dev_wer, scales, prefer=DNN_PREFERRED_SCALE)
    scales = grid["grid"]
    test_cuts = CutSet.from_file(data_dir / "features" / "test_cuts.jsonl.gz")
    test, test_refs = utterance_logliks(model, context, log_prior, test_cuts, front_end, "test"), references(test_cuts)
    test_sweep_wer, test_hyps = {}, None
    if test_sweep:
        test = list(test)
        for scale in scales:
            hyps = decoder.decode(test, scale)
            test_hyps = hyps if scale == best else test_hyps  # scored again below as "test", not decoded again
            test_sweep_wer[f"{scale:g}"] = score(test_refs, hyps, out, f"test-acwt{scale:g}")["wer"]
            log.info("%s: test WER %.2f %% at acoustic scale %g", run_dir, test_sweep_wer[f"{scale:g}"], scale)
    result = {
        "features": features,
        "graph": str(decoder.graph),
        "settings": settings,
        "acoustic_scale": best,
        "dev": sweep[best],
        "dev_sweep": {f"{s:g}": sweep[s]["wer"] for s in scales},
        "dev_grid": grid,
        "test": score(test_refs, test_hyps if test_hyps is not None else decoder.decode(test, best), out, "test"),
        "decode_seconds": round(time.perf_counter() - start, 1),
    }
    if test_sweep:
        result["test_sweep"] = test_sweep_wer
    (out / "results.json").write_text(json.dumps(result, indent=1))
    log.info("%s: acoustic scale %g (dev WER %.2f %%), test WER %.2f %%", run_dir, best, result["dev"]["wer"],
             result["test"]["wer"])
    return result


def rescorer_for(data_dir: Path, id2word: dict[int, str], rescore_lm: str | int):
    """The ``LmRescorer`` of ``--rescore-lm``: an n-gram order (a number: ``make_rescore_lm``) or an ARPA file."""
    from local.graph.lattice import LmRescorer
    from local.graph.lm import make_rescore_lm

    if isinstance(rescore_lm, int) or str(rescore_lm).isdigit():
        path = make_rescore_lm(data_dir, int(rescore_lm))
    else:
        path = Path(rescore_lm)
        if not path.is_file():
            raise FileNotFoundError(f"--rescore-lm {path}: no such ARPA file (or give an n-gram order, e.g. 4)")
    return LmRescorer(data_dir / "lang" / "lm.arpa", path, id2word), path


def _evaluate_lattices(run_dir, data_dir, features, decoder, dev, dev_cuts, model, context, log_prior, front_end,
                       scales, penalties, test_sweep, start, rescore_lm=None, settings=None) -> dict:
    """``evaluate_run`` with lattices: one decoding of dev and one of test, the grid by rescoring."""
    from lhotse import CutSet
    from local.graph.decode import pick_scale_and_penalty, score
    from local.graph.lattice import LATTICE_ACOUSTIC_SCALE, LATTICE_BEAM, decode_lattices, grid_hypotheses

    out = run_dir / "decode"
    penalties = sorted(set(penalties))
    if not penalties:
        raise ValueError("no word insertion penalty to try; give at least one (0 is Kaldi's neutral value)")
    t0 = time.perf_counter()
    dev_lats = decode_lattices(decoder.hclg, decoder.trans_model, dev, LATTICE_ACOUSTIC_SCALE, decoder.beam)
    lattice_seconds = time.perf_counter() - t0
    refs, id2word = references(dev_cuts), decoder.id2word

    def choose(rescorer, tag: str):  # the (scale, penalty) dev picks, with every point's WER
        wers, results = {}, {}

        def rescore(new_scales: list[float], new_pens: list[float]) -> None:
            grid = grid_hypotheses(dev_lats, new_scales, new_pens, rescorer)
            for (s, p), hyps in grid.items():
                text = {u: words_to_text(w, id2word) for u, w in hyps.items()}
                results[(s, p)] = score(refs, text, out, f"dev{tag}-acwt{s:g}-wip{p:g}")
                wers[(s, p)] = results[(s, p)]["wer"]

        best_scale, best_penalty, grid = pick_scale_and_penalty(rescore, wers, scales, penalties,
                                                                prefer=DNN_PREFERRED_SCALE)
        if grid["penalty_at_edge"]:
            log.warning("%s: word insertion penalty %g, picked on dev, is still at the edge of %s", run_dir,
                        best_penalty, [f"{p:g}" for p in grid["penalties"]])
        return best_scale, best_penalty, grid, wers, results

    first = choose(None, "")
    rescorer = lm_path = None
    if rescore_lm is not None:
        rescorer, lm_path = rescorer_for(data_dir, id2word, rescore_lm)
        t_rescore = time.perf_counter()
        best_scale, best_penalty, grid, wers, results = choose(rescorer, "-lm")
        rescore_seconds = time.perf_counter() - t_rescore
    else:
        best_scale, best_penalty, grid, wers, results = first
    test_cuts = CutSet.from_file(data_dir / "features" / "test_cuts.jsonl.gz")
    frames = [sum(len(ll) for _, ll in dev)]

    def counted(utterances):  # test's log-likelihoods, one at a time, their frames counted for the RTF
        for utt_id, loglik in utterances:
            frames[0] += len(loglik)
            yield utt_id, loglik

    test = counted(utterance_logliks(model, context, log_prior, test_cuts, front_end, "test"))
    t0 = time.perf_counter()
    test_lats = decode_lattices(decoder.hclg, decoder.trans_model, test, LATTICE_ACOUSTIC_SCALE, decoder.beam)
    lattice_seconds += time.perf_counter() - t0
    audio_seconds = frames[0] / 100.0  # 10 ms frames
    test_refs = references(test_cuts)
    points = grid["grid"] if test_sweep else [best_scale]
    t_rescore = time.perf_counter()
    test_grid = grid_hypotheses(test_lats, points, [best_penalty], rescorer)
    test_text = {s: {u: words_to_text(w, id2word) for u, w in test_grid[(s, best_penalty)].items()} for s in points}
    if rescorer is not None:
        rescore_seconds += time.perf_counter() - t_rescore
        (s1, p1), hyps = next(iter(grid_hypotheses(test_lats, [first[0]], [first[1]]).items()))
        first_test = score(test_refs, {u: words_to_text(w, id2word) for u, w in hyps.items()}, out, "test-first-pass")
    result = {
        "features": features,
        "graph": str(decoder.graph),
        "search": "lattice",
        "settings": settings,
        "lattice": {"acoustic_scale": LATTICE_ACOUSTIC_SCALE, "beam": decoder.beam,
                    "lattice_beam": LATTICE_BEAM, "decode_seconds": round(lattice_seconds, 1),
                    "audio_seconds": round(audio_seconds, 1), "rtf": round(lattice_seconds / audio_seconds, 4)},
        "acoustic_scale": best_scale,
        "word_insertion_penalty": best_penalty,
        "dev": results[(best_scale, best_penalty)],
        "dev_sweep": {f"{s:g}": results[(s, best_penalty)]["wer"] for s in grid["grid"]},
        "dev_grid": {**grid, "wer": {f"{s:g}/{p:g}": w for (s, p), w in sorted(wers.items())}},
        "test": score(test_refs, test_text[best_scale], out, "test"),
    }
    if test_sweep:
        result["test_sweep"] = {f"{s:g}": score(test_refs, test_text[s], out, f"test-acwt{s:g}")["wer"] for s in points}
    if rescorer is not None:
        result["lm_rescore"] = {
            "requested": str(rescore_lm), "lm": str(lm_path), "order": rescorer.new.order,
            "first_pass_order": rescorer.old.order,
            "seconds": round(rescore_seconds, 1),
            "first_pass": {"acoustic_scale": s1, "word_insertion_penalty": p1,
                           "dev_wer": first[4][(s1, p1)]["wer"], "test_wer": first_test["wer"]},
        }  # fmt: skip
        log.info("%s: first pass (order %d) dev WER %.2f %%, test WER %.2f %%; rescored with %s", run_dir,
                 rescorer.old.order, first[4][(s1, p1)]["wer"], first_test["wer"], lm_path)
    result["decode_seconds"] = round(time.perf_counter() - start, 1)
    (out / "results.json").write_text(json.dumps(result, indent=1))
    log.info("%s: acoustic scale %g, word insertion penalty %g (dev WER %.2f %%), test WER %.2f %%", run_dir,
             best_scale, best_penalty, result["dev"]["wer"], result["test"]["wer"])
    return result


def _worker_init() -> None:
    from local.atomic import die_with_parent

    die_with_parent()  # a killed evaluate.py's decoding workers stop with it
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(1)


def _evaluate_args(args: tuple) -> dict:
    return evaluate_run(*args)


def decode_settings(search: str, beam: float | None, max_active: int | None, scales, penalties) -> dict:
    """What a decoding's results depend on besides the checkpoint, as ``results.json["settings"]`` records
    it: the search, its beam (``None``: that search's default), the most active states (best-path search
    only: the lattice decoder has no such limit), the acoustic scales and (lattice search) the penalties
    dev starts from."""
    if beam is None:  # (local/graph/lattice.py: the lattice search's default and how it was chosen)
        beam = LATTICE_SEARCH_BEAM if search == "lattice" else BEAM
    out = {"search": search, "beam": float(beam), "acoustic_scales": sorted(map(float, set(scales)))}
    if search == "lattice":
        out["penalties"] = sorted(map(float, set(penalties)))
    else:
        out["max_active"] = int(max_active if max_active is not None else MAX_ACTIVE)
    return out


def decoded(run_dir: Path, test_sweep: bool = False, rescore_lm: str | None = None,
            settings: dict | None = None) -> bool:
    """True when ``run_dir/decode/results.json`` is newer than the run's last checkpoint (and, with
    ``test_sweep``, has test decoded at every scale), was rescored with the ``rescore_lm`` asked for (none
    when ``None``) and, with ``settings`` (``decode_settings``), was decoded with them: a results.json
    from another beam, search or grid, or one that does not record its settings, is not taken."""
    results, ckpt = run_dir / "decode" / "results.json", run_dir / "checkpoints" / "last.ckpt"
    if not (results.exists() and ckpt.exists() and results.stat().st_mtime > ckpt.stat().st_mtime):
        return False
    got = json.loads(results.read_text())
    wanted_lm = None if rescore_lm is None else str(rescore_lm)  # the same rescoring, or none, as asked
    if settings is not None and got.get("settings") != settings:
        log.info("%s: decoded with %s, not %s: decoding again", run_dir, got.get("settings", "unrecorded settings"),
                 settings)
        return False
    return (not test_sweep or "test_sweep" in got) and got.get("lm_rescore", {}).get("requested") == wanted_lm


def load_test_set(test_set: Path, work_dir: Path, train_cmvn: dict):
    """A Kaldi data dir or a Lhotse cuts manifest -> cuts with fbank computed as in stage 1 (other
    sampling rates resampled to 16 kHz), CMVN stats (per speaker of this set, the training set's
    global stats as fallback) and what happened to the set's utterances: ``{"input_utterances",
    "dropped": [(id, reason, detail)], "sampling_rates": {rate: recordings}, "remarks": [...]}``.

    A Kaldi data dir is reconciled as Kaldi's ``utils/fix_data_dir.sh`` does
    (``local.data.test_sets``); utterances without readable audio are dropped with their reason."""
    from lhotse import CutSet
    from local.data.features import _process_shard, _stats

    if test_set.is_dir():
        from local.data.test_sets import load_kaldi_test_dir

        recordings, supervisions, drops, info = load_kaldi_test_dir(test_set)
        if not supervisions:
            raise ValueError(f"{test_set}: none of its {info['input_utterances']} utterances can be scored "
                             f"({_reasons(drops)}); fix the data dir (e.g. with Kaldi's utils/fix_data_dir.sh)")
        cuts = CutSet.from_manifests(recordings=recordings, supervisions=supervisions).trim_to_supervisions()
    elif test_set.exists():
        cuts = CutSet.from_file(test_set)
        rates = Counter(c.sampling_rate for c in cuts)
        info = {"input_utterances": len(cuts), "sampling_rates": {str(k): v for k, v in sorted(rates.items())},
                "remarks": []}
        drops = []
    else:
        raise ValueError(f"No such test set: {test_set}; give a Kaldi data dir (wav.scp, text, utt2spk) "
                         "or a Lhotse cuts manifest")
    work_dir.mkdir(parents=True, exist_ok=True)
    dicts, feature_drops, sums = _process_shard(list(cuts), str(work_dir / "feats"))
    info["dropped"] = drops + list(feature_drops)
    for cut_id, reason, detail in info["dropped"]:
        log.warning("test set %s: not scored %s (%s: %s)", test_set.name, cut_id, reason, detail)
    stats = {"global": train_cmvn["global"], "speakers": {s: _stats(*v) for s, v in sums.items() if s is not None}}
    return CutSet.from_dicts(dicts), stats, info


def _reasons(drops: list) -> str:
    counts = Counter(reason for _, reason, _ in drops)
    return ", ".join(f"{n} {reason}" for reason, n in counts.most_common()) or "none"


def decode_test_set(checkpoint: Path, test_set: Path, data_dir: Path, scale: float, out_dir: Path,
                    beam: float = BEAM, max_active: int = MAX_ACTIVE) -> dict:
    """WER of ``checkpoint`` on any test set; words outside the lexicon count as errors (and are
    counted: ``oov``). An empty transcript is scored as an empty reference (every hypothesis word
    an insertion). Writes ``<out_dir>/results-<name>.json`` with the scores, how many utterances were
    scored and, per reason, how many were not (``not_scored``; each one in ``dropped-<name>.jsonl``)."""
    from local.data.test_sets import oov_stats
    from local.graph.decode import score
    from local.graph.lang import read_symbols

    model, context, features = load_checkpoint(checkpoint)
    log_prior = np.log(np.load(data_dir / "ali" / "priors.npy")).astype(np.float32)
    front_end = FrontEnd(data_dir, features)
    decoder = Decoder(data_dir, beam, max_active)
    name = test_set.name.removesuffix(".jsonl.gz")
    cuts, cmvn, info = load_test_set(test_set, out_dir / "features" / name, front_end.cmvn)
    if not len(cuts):
        raise ValueError(f"{test_set}: none of its {info['input_utterances']} utterances can be scored "
                         f"({_reasons(info['dropped'])}); see the warnings above")
    front_end.add_speakers(cuts, cmvn)  # the set's own CMVN statistics and speaker transforms, no transcripts
    logliks = utterance_logliks(model, context, log_prior, cuts, front_end, test_set.name)
    hyps = decoder.decode(logliks, scale)
    refs = references(cuts)
    result = score(refs, hyps, out_dir, name)
    resampled = {r: n for r, n in info["sampling_rates"].items() if int(float(r)) != SAMPLING_RATE}
    vocabulary = set(read_symbols(data_dir / "lang" / "words.txt"))
    result.update({
        "test_set": str(test_set),
        "input_utterances": info["input_utterances"],
        "scored_utterances": result["utterances"],
        "not_scored": dict(Counter(reason for _, reason, _ in info["dropped"]).most_common()),
        "empty_references": sum(1 for r in refs.values() if not r.strip()),
        "resampled_recordings": resampled,
        "oov": oov_stats(refs, vocabulary),
        "remarks": info["remarks"],
    })
    with (out_dir / f"dropped-{name}.jsonl").open("w") as f:
        for cut_id, reason, detail in info["dropped"]:
            f.write(json.dumps({"id": cut_id, "reason": reason, "detail": detail}) + "\n")
    (out_dir / f"results-{name}.json").write_text(json.dumps(result, indent=1))
    oov = result["oov"]
    log.info("%s: WER %.2f %% on %d of %d utterances scored; not scored: %s%s; %d empty references; "
             "%d recordings resampled to %d Hz (from %s); OOV reference words: %d of %d (%.2f %%) in %d utterances%s",
             name, result["wer"], result["scored_utterances"], result["input_utterances"],
             _reasons(info["dropped"]),
             f" (see {out_dir / f'dropped-{name}.jsonl'})" if info["dropped"] else "",
             result["empty_references"], sum(resampled.values()), SAMPLING_RATE,
             ", ".join(f"{r} Hz" for r in resampled) or "none", oov["tokens"], oov["words"], oov["rate"],
             oov["utterances"], f": {', '.join(list(oov['counts'])[:10])}" if oov["counts"] else "")
    return result


def dev_scale_of(checkpoint: Path) -> float:
    """The acoustic scale dev picked for the run a checkpoint belongs to (``<run>/checkpoints/x.ckpt`` ->
    ``<run>/decode/results.json``), else ``DNN_PREFERRED_SCALE``; says which."""
    results = checkpoint.resolve().parent.parent / "decode" / "results.json"
    if results.is_file():
        scale = float(json.loads(results.read_text())["acoustic_scale"])
        log.info("--test-set: acoustic scale %g, the one dev picked for this run (%s)", scale, results)
        return scale
    log.warning("--test-set: no %s to take dev's acoustic scale from: decoding at %g (give --acoustic-scale, or "
                "decode the run with --runs first)", results, DNN_PREFERRED_SCALE)
    return DNN_PREFERRED_SCALE


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", nargs="*", default=[], help="run directories of train.py (exp/dnn/<run>)")
    p.add_argument("--data-dir", default=None, help="recipe data dir (default: the one each run trained on)")
    p.add_argument("--acoustic-scales", type=float, nargs="+", default=list(DNN_ACOUSTIC_SCALES),
                   help="acoustic scales tried on dev, extended past an edge that holds the best; the best "
                        "decodes test")
    p.add_argument("--test-sweep", action="store_true",
                   help="also decode test at every acoustic scale; the comparison then shows each run name's "
                        "test WER and its paired change against the baseline at each fixed scale")
    p.add_argument("--search", choices=["lattice", "best-path"], default="lattice",
                   help="lattice: decode dev and test once into word lattices and choose the acoustic scale and "
                        "the word insertion penalty on dev by rescoring (Kaldi's score.sh); best-path: decode dev "
                        "again at each scale (no penalty)")
    p.add_argument("--penalties", type=float, nargs="+", default=list(WORD_INSERTION_PENALTIES),
                   help="word insertion penalties tried on dev with --search lattice (Kaldi's: 0 0.5 1), extended "
                        "one step past an edge that holds dev's best")
    p.add_argument("--rescore-lm", default=None, metavar="ORDER|ARPA",
                   help="rescore the lattices with a larger LM before choosing the scale and penalty on dev: an "
                        "n-gram order (e.g. 4: estimated on the lang stage's LM sentences, lang/lm_4gram.arpa) or an "
                        "ARPA file over the graph's words; results.json keeps the first pass's WERs beside")
    p.add_argument("--beam", type=float, default=None,
                   help=f"decoding beam (default: {LATTICE_SEARCH_BEAM:g} with --search lattice, {BEAM:g} with "
                        "--search best-path; Kaldi's decode.sh uses 13; chosen in local/graph/lattice.py)")
    p.add_argument("--max-active", type=int, default=None,
                   help=f"most active decoder states per frame, --search best-path only (default {MAX_ACTIVE}; the "
                        "lattice decoder has no such limit)")
    p.add_argument("--jobs", type=int, default=2, help="runs decoded in parallel (one process, one thread each)")
    p.add_argument("--out", default="exp/dnn/compare", help="where the comparison report goes")
    p.add_argument("--baseline", default=None, help="run name of the baseline (default: the single-worker run)")
    p.add_argument("--compare-only", action="store_true", help="only rebuild the report from decoded runs (a run never decoded is an error)")
    p.add_argument("--skip-decoded", action="store_true",
                   help="do not decode again a run whose decode/results.json is newer than its checkpoint "
                        "(with --test-sweep: and has the test sweep)")
    p.add_argument("--checkpoint", default=None, help="decode --test-set with this checkpoint")
    p.add_argument("--test-set", default=None, help="Kaldi data dir or Lhotse cuts manifest (with --checkpoint)")
    p.add_argument("--acoustic-scale", type=float, default=None,
                   help="acoustic scale for --test-set (default: the one dev picked for the checkpoint's run, its "
                        f"decode/results.json; without one, {DNN_PREFERRED_SCALE:g})")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(1)
    if a.checkpoint or a.test_set:
        if not (a.checkpoint and a.test_set and a.data_dir):
            p.error("--test-set needs --checkpoint and --data-dir (for the graph, priors and lexicon)")
        scale = a.acoustic_scale if a.acoustic_scale is not None else dev_scale_of(Path(a.checkpoint))
        decode_test_set(Path(a.checkpoint), Path(a.test_set), Path(a.data_dir), scale,
                        Path(a.out) / "decode_other", a.beam if a.beam is not None else BEAM,
                        a.max_active if a.max_active is not None else MAX_ACTIVE)
    if not a.runs:
        if not a.checkpoint:
            p.error("give --runs (and/or --checkpoint with --test-set)")
        return
    if a.compare_only:
        missing = [r for r in a.runs if not (Path(r) / "decode" / "results.json").exists()]
        if missing:
            p.error(f"--compare-only: {len(missing)} run(s) were never decoded (no decode/results.json): "
                    f"{' '.join(missing)}; decode them first (the same command without --compare-only, with "
                    "--skip-decoded to keep the decoded runs as they are)")
    if a.data_dir and a.runs:
        from local.dnn.builds import group_by_build

        recorded = group_by_build([Path(r) for r in a.runs])
        if len(recorded) > 1:
            p.error(f"--data-dir {a.data_dir} with runs trained on {len(recorded)} data dirs ({', '.join(recorded)}): "
                    "each run is decoded on its own; leave out --data-dir (the comparison then adds the spread over "
                    "the builds), or give the runs of one data dir")
    if a.rescore_lm is not None and a.search != "lattice":
        p.error("--rescore-lm rescores lattices: use it with --search lattice (the default)")
    if a.max_active is not None and a.search == "lattice" and a.runs:
        p.error(f"--max-active {a.max_active}: the lattice decoder (kaldi-decoder's LatticeSimpleDecoder) has no limit "
                "on active states; bound the lattice search with --beam, or use --search best-path")
    settings = decode_settings(a.search, a.beam, a.max_active, a.acoustic_scales, a.penalties)
    todo = [Path(r) for r in a.runs if not a.compare_only
            and not (a.skip_decoded and decoded(Path(r), a.test_sweep, a.rescore_lm, settings))]
    for run in set(map(Path, a.runs)) - set(todo):
        log.info("%s: not decoded again (%s)", run,
                 "--compare-only" if a.compare_only else "decode/results.json newer than the checkpoint")
    args = [(r, Path(a.data_dir) if a.data_dir else None, tuple(a.acoustic_scales), a.beam,
             a.max_active if a.max_active is not None else MAX_ACTIVE,
             a.test_sweep, a.search, tuple(a.penalties), a.rescore_lm) for r in todo]
    if todo and a.search == "lattice" and (note := allocator_note()):
        log.info(note)
    if a.jobs > 1 and len(todo) > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        # spawn: a forked child would inherit this process's OpenMP state (DESIGN section 7)
        with ProcessPoolExecutor(min(a.jobs, len(todo)), mp_context=multiprocessing.get_context("spawn"),
                                 initializer=_worker_init) as pool:
            list(pool.map(_evaluate_args, args))
    else:
        for arg in args:
            _evaluate_args(arg)
    compare_runs([Path(r) for r in a.runs], Path(a.out), a.baseline, a.data_dir)


if __name__ == "__main__":
    main()
