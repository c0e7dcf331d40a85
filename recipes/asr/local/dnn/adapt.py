"""Stage 7: speaker adaptation of the DNN's filterbank input: a per-speaker affine transform of
the 40 CMVN-normalised fbank bins (fMLLR, Gales 1998) estimated against a diagonal UBM trained
on the fbank of the training speakers. No transcripts are used, so test speakers and any new
data get theirs the same way (``evaluate.py --test-set``).

Per-speaker CMVN shifts and scales each bin on its own; a voice never heard in training also
differs in how energy moves between neighbouring bins (formant positions, spectral tilt), which a
full ``[40, 41]`` affine map can undo. The SAT GMM gains most of its lead over the
speaker-independent triphone this way (README); this stage gives the DNN the same kind of
normalisation without leaving the fbank domain.

1. Speech frames: an energy detector (``speech_frames``); TTS silence is digital zero, a
   constant vector that carries nothing about the speaker and would dominate the statistics.
2. UBM: a diagonal GMM of ``num_gauss`` Gaussians, EM on up to ``UBM_FRAMES`` speech frames of
   the training set's CMVN fbank (``train_ubm``).
3. One transform per speaker (``features.gmm_cmvn_key``: augmented copies apart, as the GMMs
   do), by EM from the identity: posteriors of the UBM's Gaussians on the currently transformed
   frames, fMLLR statistics of the untransformed frames, Gales' row update
   (``local.gmm.transforms``), ``FMLLR_EM_ITERS`` times (``estimate_speaker_transform``).
4. SAT: the UBM is retrained on the transformed training frames and the transforms
   re-estimated against it, ``sat_rounds`` times (Kaldi's ``train_sat.sh`` does the same for
   the GMMs).
5. Dev and test speakers: step 3 with the final UBM, from their own utterances.

Writes ``adapt/ubm.npz`` (weights ``[M]``, means and variances ``[M, 40]``),
``adapt/fbank_trans.pkl`` (``{speaker: W [40, 41]}`` of every split's speakers; a dev or test
speaker whose name an earlier split has too, with ``prepare.py --allow-shared-speakers``, under
``features.split_speaker_key``: each split keeps its own transform) and
``adapt/info.json``.
"""

from __future__ import annotations

import json
import logging
import pickle
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from local.atomic import atomic_path
from local.data.features import add_split_entries, apply_cmvn, gmm_cmvn_key, split_cmvn
from local.gmm.transforms import FmllrStats, add_fmllr_stats, apply_affine, estimate_fmllr

log = logging.getLogger(__name__)

NUM_GAUSS = 256
UBM_FRAMES = 100_000  # speech frames the UBM is trained on (drawn evenly from the training speakers)
UBM_ITERS = 8
FMLLR_EM_ITERS = 2
FMLLR_ROW_PASSES = 3  # Gales' row-by-row passes per EM iteration
FMLLR_MAX_FRAMES = 2000  # speech frames per speaker used for its statistics (evenly spaced): 50 per parameter
FMLLR_MIN_FRAMES = 200.0  # fewer speech frames: the speaker keeps the identity
VAD_RANGE = 6.9  # speech: mean log-mel energy within 6.9 (30 dB) of the utterance's 10th loudest frame
VARIANCE_FLOOR = 0.01  # times the data's variance, per dimension


# ---------------------------------------------------------------- speech frames
def speech_frames(fbank: np.ndarray, vad_range: float = VAD_RANGE) -> np.ndarray:
    """``[T]`` bool: frames whose mean log-mel energy is within ``vad_range`` of the utterance's
    loud frames (the 10th loudest, so one click does not set the level). Raw fbank ``[T, F]``."""
    energy = np.asarray(fbank, np.float64).mean(axis=1)
    if len(energy) == 0:
        return np.zeros(0, bool)
    loud = np.sort(energy)[-min(10, len(energy))]
    return energy > loud - vad_range


# ---------------------------------------------------------------- diagonal GMM
@dataclass
class DiagGmm:
    """A diagonal-covariance GMM: ``weights [M]``, ``means [M, D]``, ``variances [M, D]``."""

    weights: np.ndarray
    means: np.ndarray
    variances: np.ndarray

    def log_likelihoods(self, x: np.ndarray) -> np.ndarray:
        """``[T, M]``: ``log w_m + log N(x_t; mu_m, var_m)`` for frames ``x`` ``[T, D]``."""
        x = np.asarray(x, np.float64)
        inv = 1.0 / self.variances
        const = np.log(self.weights) - 0.5 * (np.log(2 * np.pi * self.variances).sum(1)
                                              + (self.means**2 * inv).sum(1))
        return const + x @ (self.means * inv).T - 0.5 * (x * x) @ inv.T

    def posteriors(self, x: np.ndarray) -> tuple[np.ndarray, float]:
        """Gaussian posteriors ``[T, M]`` and the total log-likelihood of ``x``."""
        ll = self.log_likelihoods(x)
        top = ll.max(1, keepdims=True)
        frame_ll = top[:, 0] + np.log(np.exp(ll - top).sum(1))
        return np.exp(ll - frame_ll[:, None]), float(frame_ll.sum())

    def save(self, path: Path) -> None:
        np.savez(path, weights=self.weights, means=self.means, variances=self.variances)

    @classmethod
    def load(cls, path: Path) -> DiagGmm:
        if not Path(path).exists():
            raise ValueError(f"No such file: {path}; run the adapt stage: python recipes/asr/prepare.py "
                             f"--data-dir {Path(path).parents[1]} --stage 7")
        d = np.load(path)
        return cls(d["weights"], d["means"], d["variances"])


def train_ubm(x: np.ndarray, num_gauss: int = NUM_GAUSS, num_iters: int = UBM_ITERS, seed: int = 0,
              init: DiagGmm | None = None, chunk: int = 50_000) -> tuple[DiagGmm, list[float]]:
    """EM for a diagonal GMM on frames ``x`` ``[N, D]``; starts from ``init`` or from
    ``num_gauss`` distinct random frames with the data's variance. Variances are floored at
    ``VARIANCE_FLOOR`` times the data's; a Gaussian that loses its frames is re-seeded on a
    random frame. Returns the GMM and the average log-likelihood per frame of every pass."""
    x = np.asarray(x, np.float64)
    if len(x) < num_gauss:
        raise ValueError(f"{len(x)} frames for a UBM of {num_gauss} Gaussians; use fewer Gaussians")
    rng = np.random.default_rng(seed)
    floor = VARIANCE_FLOOR * x.var(0)
    if init is None:
        means = x[rng.choice(len(x), num_gauss, replace=False)]
        gmm = DiagGmm(np.full(num_gauss, 1.0 / num_gauss), means, np.tile(x.var(0), (num_gauss, 1)))
    else:
        gmm = DiagGmm(init.weights.copy(), init.means.copy(), init.variances.copy())
    history = []
    for _ in range(num_iters):
        occ, first, second, total = 0.0, 0.0, 0.0, 0.0
        for s in range(0, len(x), chunk):
            post, ll = gmm.posteriors(x[s : s + chunk])
            occ = occ + post.sum(0)
            first = first + post.T @ x[s : s + chunk]
            second = second + post.T @ (x[s : s + chunk] ** 2)
            total += ll
        history.append(total / len(x))
        dead = occ < 1e-3 * len(x) / num_gauss
        occ_safe = np.maximum(occ, 1e-10)[:, None]
        means = first / occ_safe
        variances = np.maximum(second / occ_safe - means**2, floor)
        if dead.any():  # re-seed on random frames
            means[dead] = x[rng.choice(len(x), int(dead.sum()), replace=False)]
            variances[dead] = x.var(0)
            occ = np.where(dead, np.median(occ), occ)
        gmm = DiagGmm(occ / occ.sum(), means, variances)
    return gmm, history


# ---------------------------------------------------------------- per-speaker transforms
def identity_transform(dim: int) -> np.ndarray:
    return np.hstack([np.eye(dim), np.zeros((dim, 1))])


def estimate_speaker_transform(ubm: DiagGmm, x: np.ndarray, num_em: int = FMLLR_EM_ITERS,
                               min_frames: float = FMLLR_MIN_FRAMES) -> tuple[np.ndarray, dict]:
    """fMLLR ``W [D, D+1]`` of one speaker's frames ``x`` ``[T, D]`` against ``ubm``, by EM from
    the identity; returns it and ``{"frames", "gain_per_frame"}`` (log-likelihood per frame,
    Jacobian included, after minus before)."""
    x = np.asarray(x, np.float64)
    D = x.shape[1]
    W = identity_transform(D)
    if len(x) < min_frames:
        return W, {"frames": len(x), "gain_per_frame": 0.0}
    start = None
    for _ in range(num_em):
        post, ll = ubm.posteriors(apply_affine(W, x))
        logdet = np.linalg.slogdet(W[:, :D])[1]
        start = ll / len(x) + logdet if start is None else start
        stats = add_fmllr_stats(FmllrStats.zeros(D), x, post, ubm.means, ubm.variances)
        W, _ = estimate_fmllr(stats, init=W, num_iters=FMLLR_ROW_PASSES, min_count=0.0)
    _, ll = ubm.posteriors(apply_affine(W, x))
    gain = ll / len(x) + np.linalg.slogdet(W[:, :D])[1] - start
    return W, {"frames": len(x), "gain_per_frame": float(gain)}


def _evenly(x: np.ndarray, n: int) -> np.ndarray:
    return x if len(x) <= n else x[np.linspace(0, len(x) - 1, n).astype(np.int64)]


def speaker_frames(cuts, cmvn: dict, max_frames: int | None = FMLLR_MAX_FRAMES) -> dict[str, np.ndarray]:
    """CMVN fbank speech frames of ``cuts`` grouped by speaker (``gmm_cmvn_key``), at most
    ``max_frames`` per speaker, evenly spaced over its utterances: ``{speaker: [n, F]}``."""
    groups: dict[str, list[np.ndarray]] = {}
    for cut in cuts:
        raw = cut.load_features()
        speaker = cut.supervisions[0].speaker if cut.supervisions else None
        normed = apply_cmvn(raw, speaker, cmvn)
        groups.setdefault(gmm_cmvn_key(cut), []).append(normed[speech_frames(raw)])
    out = {}
    for spk, parts in groups.items():
        frames = np.concatenate(parts)
        out[spk] = _evenly(frames, max_frames) if max_frames else frames
    return out


def estimate_transforms(ubm: DiagGmm, frames: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict]:
    """``estimate_speaker_transform`` for every speaker; returns the transforms and a summary."""
    trans, gains, skipped = {}, [], 0
    for spk, x in frames.items():
        trans[spk], info = estimate_speaker_transform(ubm, x)
        if info["frames"] < FMLLR_MIN_FRAMES:
            skipped += 1
        else:
            gains.append(info["gain_per_frame"])
    return trans, {"speakers": len(trans), "kept_identity": skipped,
                   "gain_per_frame": round(float(np.mean(gains)), 3) if gains else None}


# ---------------------------------------------------------------- the stage
def adapt(data_dir: Path | str, num_gauss: int = NUM_GAUSS, sat_rounds: int = 1, seed: int = 0) -> dict:
    """Stage 7: UBM and per-speaker fbank fMLLR transforms of every split (see the module
    docstring). Returns a summary (speakers, gains, log-likelihoods, seconds)."""
    import torch
    from lhotse import CutSet

    torch.set_num_threads(1)
    start = time.perf_counter()
    data_dir = Path(data_dir)
    out = data_dir / "adapt"
    out.mkdir(parents=True, exist_ok=True)
    cmvn = json.loads((data_dir / "features" / "cmvn.json").read_text())
    cuts = {}
    for split in ("train", "dev", "test"):
        path = data_dir / "features" / f"{split}_cuts.jsonl.gz"
        if path.exists():
            cuts[split] = CutSet.from_file(path) or []
        elif split == "train":
            raise RuntimeError(f"{path} is missing; run prepare.py --stage 1 first")
    train = speaker_frames(cuts["train"], split_cmvn(cmvn, "train"), max_frames=None)
    per_spk = max(UBM_FRAMES // max(len(train), 1), 1)

    def ubm_data(trans: dict | None) -> np.ndarray:
        return np.concatenate([_evenly(apply_affine(trans[s], x) if trans else x, per_spk) for s, x in train.items()])

    log.info("adapt: %d training speakers, %d speech frames", len(train), sum(len(x) for x in train.values()))
    ubm, history = train_ubm(ubm_data(None), num_gauss, seed=seed)
    log.info("adapt: UBM of %d Gaussians, log-like %.3f per frame", num_gauss, history[-1])
    stats_frames = {s: _evenly(x, FMLLR_MAX_FRAMES) for s, x in train.items()}
    rounds = [{"ubm_log_like": round(history[-1], 3)}]
    trans, summary = estimate_transforms(ubm, stats_frames)
    for _ in range(sat_rounds):
        ubm, history = train_ubm(ubm_data(trans), num_gauss, num_iters=max(UBM_ITERS // 2, 1), init=ubm)
        trans, summary = estimate_transforms(ubm, stats_frames)
        rounds.append({"ubm_log_like": round(history[-1], 3), **summary})
        log.info("adapt: SAT round %d: UBM log-like %.3f per frame, transforms %s", len(rounds) - 1,
                 history[-1], summary)
    info = {"num_gauss": num_gauss, "sat_rounds": sat_rounds, "rounds": rounds, "splits": {"train": summary}}
    for split in ("dev", "test"):
        if split in cuts:
            frames = speaker_frames(cuts[split], split_cmvn(cmvn, split))
            split_trans, info["splits"][split] = estimate_transforms(ubm, frames)
            add_split_entries(trans, split_trans, split)
            log.info("adapt: %s speakers: %s", split, info["splits"][split])
    ubm.save(out / "ubm.npz")
    with open(out / "fbank_trans.pkl", "wb") as f:
        pickle.dump(dict(sorted(trans.items())), f)  # by speaker: the same bytes from the same build
    info["seconds"] = round(time.perf_counter() - start, 1)
    (out / "info.json").write_text(json.dumps(info, indent=1))
    result = {"speakers": len(trans), **{f"{s}_gain": v["gain_per_frame"] for s, v in info["splits"].items()},
              "seconds": info["seconds"]}
    log.info("adapt: %s", result)
    return result


# ---------------------------------------------------------------- fbank_sat: transforms from the SAT system's alignments
# The UBM above knows nothing of phones: its transform maps a voice onto "some speech". With the
# SAT GMM's frame alignments each frame has a phonetic class (pdf) and the transform maps the
# voice onto the training voices' Gaussian of that class, as the SAT GMM's own fMLLR does in the
# MFCC domain. Training speakers: the SAT system's training alignments (``ali/``, with their
# transcripts, as Kaldi's SAT training uses). Dev, test: the best paths of the SAT system's fMLLR
# decoding of the split (first pass, no transcripts), the same way for both.
SAT_TRANS = "fbank_sat_trans.pkl"
SAT_MODEL = "pdf_gauss.npz"


def pdf_gaussians(pairs, num_pdfs: int) -> DiagGmm:
    """One diagonal Gaussian per pdf from ``(frames [T, D], pdfs [T])`` pairs: weights are the
    pdfs' frame shares; a pdf with fewer than 2 frames takes the data's mean and variance.
    Variances are floored at ``VARIANCE_FLOOR`` times the data's."""
    occ, first, second = np.zeros(num_pdfs), None, None
    for x, pdf in pairs:
        x = np.asarray(x, np.float64)
        if first is None:
            first, second = np.zeros((num_pdfs, x.shape[1])), np.zeros((num_pdfs, x.shape[1]))
        occ += np.bincount(pdf, minlength=num_pdfs)
        np.add.at(first, pdf, x)
        np.add.at(second, pdf, x * x)
    if first is None or occ.sum() < 2:
        raise ValueError("no aligned frames to train the pdf Gaussians on; run the align stage (prepare.py --stage 6)")
    total = occ.sum()
    mean_all = first.sum(0) / total
    var_all = second.sum(0) / total - mean_all**2
    seen = occ >= 2
    means = np.where(seen[:, None], first / np.maximum(occ, 1)[:, None], mean_all)
    variances = np.where(seen[:, None], second / np.maximum(occ, 1)[:, None] - means**2, var_all)
    variances = np.maximum(variances, VARIANCE_FLOOR * var_all)
    weights = np.maximum(occ, 1.0) / np.maximum(occ, 1.0).sum()
    return DiagGmm(weights, means, variances)


def aligned_log_like(model: DiagGmm, x: np.ndarray, pdf: np.ndarray) -> float:
    """Total log-likelihood of frames ``x`` under their aligned pdfs' Gaussians."""
    x = np.asarray(x, np.float64)
    mu, var = model.means[pdf], model.variances[pdf]
    return float(-0.5 * (np.log(2 * np.pi * var) + (x - mu) ** 2 / var).sum())


def estimate_aligned_transform(model: DiagGmm, x: np.ndarray, pdf: np.ndarray,
                               min_frames: float = FMLLR_MIN_FRAMES) -> tuple[np.ndarray, dict]:
    """fMLLR ``W [D, D+1]`` of one speaker's frames ``x`` ``[T, D]`` whose pdfs ``[T]`` are known:
    each frame's posterior is 1 on its pdf's Gaussian, so one estimation is exact (no EM)."""
    x = np.asarray(x, np.float64)
    D = x.shape[1]
    W = identity_transform(D)
    if len(x) < min_frames:
        return W, {"frames": len(x), "gain_per_frame": 0.0}
    post = np.zeros((len(x), len(model.weights)))
    post[np.arange(len(x)), pdf] = 1.0
    stats = add_fmllr_stats(FmllrStats.zeros(D), x, post, model.means, model.variances)
    W, _ = estimate_fmllr(stats, init=W, num_iters=FMLLR_ROW_PASSES * FMLLR_EM_ITERS, min_count=0.0)
    before = aligned_log_like(model, x, pdf)
    after = aligned_log_like(model, apply_affine(W, x), pdf) + len(x) * np.linalg.slogdet(W[:, :D])[1]
    return W, {"frames": len(x), "gain_per_frame": float((after - before) / len(x))}


def aligned_speaker_frames(cuts, pdf_alis: dict[str, np.ndarray], cmvn: dict,
                           max_frames: int | None = FMLLR_MAX_FRAMES) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{speaker: (CMVN fbank speech frames [n, F], their pdfs [n])}`` of the cuts that have an
    alignment, at most ``max_frames`` per speaker, evenly spaced."""
    groups: dict[str, tuple[list, list]] = {}
    for cut in cuts:
        pdf = pdf_alis.get(cut.id)
        if pdf is None:
            continue
        raw = cut.load_features()
        if len(pdf) != len(raw):
            raise RuntimeError(f"{cut.id}: {len(pdf)} alignment frames but {len(raw)} fbank frames; "
                               "re-run the align stage (prepare.py --stage 6 --force)")
        speaker = cut.supervisions[0].speaker if cut.supervisions else None
        keep = speech_frames(raw)
        xs, ps = groups.setdefault(gmm_cmvn_key(cut), ([], []))
        xs.append(apply_cmvn(raw, speaker, cmvn)[keep])
        ps.append(np.asarray(pdf, np.int64)[keep])
    out = {}
    for spk, (xs, ps) in groups.items():
        x, p = np.concatenate(xs), np.concatenate(ps)
        if max_frames and len(x) > max_frames:
            pick = np.linspace(0, len(x) - 1, max_frames).astype(np.int64)
            x, p = x[pick], p[pick]
        out[spk] = (x, p)
    return out


def sat_first_pass_pdfs(data_dir: Path, split: str) -> dict[str, np.ndarray]:
    """pdf alignments of the SAT system's fMLLR decoding of ``split`` (no transcripts): the best
    paths of a decoding with the speakers' final transforms (``exp/sat/decode_<split>/trans.pkl``)
    at the acoustic scale chosen there (the sat stage's ``best_path.pkl``; a data dir of an older
    recipe has none and is decoded as a new set), kept in ``adapt/sat_best_path_<split>.pkl``."""
    from lhotse import CutSet

    from local.gmm.common import GmmSystem
    from local.gmm.sat import decode_new_set

    system = GmmSystem.load(data_dir / "exp" / "sat" / "final.pkl")
    cache = data_dir / "adapt" / f"sat_best_path_{split}.pkl"
    saved = data_dir / "exp" / "sat" / f"decode_{split}" / "best_path.pkl"  # the sat stage's own decoding
    if cache.exists() or saved.exists():
        with open(cache if cache.exists() else saved, "rb") as f:
            alis = pickle.load(f)
    else:  # a data dir of an older recipe: decode the split as any new set (the same best paths)
        _, _, alis = decode_new_set(data_dir, CutSet.from_file(data_dir / "features" / f"{split}_cuts.jsonl.gz"))
    if not cache.exists():
        with atomic_path(cache) as tmp, open(tmp, "wb") as f:
            pickle.dump(alis, f)
    tid2pdf = system.tid2pdf()
    return {u: tid2pdf[np.asarray(a, np.int64)] for u, a in alis.items()}


def _require(path: Path, fix: str) -> Path:
    if not path.exists():
        raise RuntimeError(f"No such file: {path}; {fix}")
    return path


def _summarise(results: dict) -> dict:
    """``{speaker: (W, info)}`` -> speakers, how many kept the identity (too few frames), mean gain."""
    gains = [i["gain_per_frame"] for _, i in results.values() if i["frames"] >= FMLLR_MIN_FRAMES]
    return {"speakers": len(results), "kept_identity": len(results) - len(gains),
            "gain_per_frame": round(float(np.mean(gains)), 3) if gains else None}


def transforms_from_pdfs(model: DiagGmm, cuts, pdfs: dict[str, np.ndarray], cmvn: dict) -> tuple[dict, dict]:
    """Every speaker of ``cuts`` gets its transform against ``model`` from its frames' ``pdfs``
    (``{utt: [T]}``); a speaker none of whose utterances has pdfs (the decoder found no path)
    keeps the identity. Returns the transforms and a summary."""
    cuts = list(cuts)
    results = {s: estimate_aligned_transform(model, x, p)
               for s, (x, p) in aligned_speaker_frames(cuts, pdfs, cmvn).items()}
    speakers = {gmm_cmvn_key(c) for c in cuts}
    trans = {s: results[s][0] if s in results else identity_transform(model.means.shape[1]) for s in speakers}
    return trans, {**_summarise(results), "undecoded_speakers_kept_identity": len(speakers - set(results))}


def adapt_sat(data_dir: Path | str, sat_rounds: int = 1) -> dict:
    """``fbank_sat`` transforms of every split's speakers (see above): per-pdf fbank Gaussians on
    the training speakers' aligned speech frames, one transform per speaker, ``sat_rounds`` times
    the Gaussians retrained on the transformed frames and the transforms re-estimated; then dev and
    test from the SAT decoding's best paths. Writes ``adapt/pdf_gauss.npz`` and
    ``adapt/fbank_sat_trans.pkl``; returns a summary."""
    from lhotse import CutSet

    start = time.perf_counter()
    data_dir = Path(data_dir)
    out = data_dir / "adapt"
    out.mkdir(parents=True, exist_ok=True)
    cmvn = json.loads((data_dir / "features" / "cmvn.json").read_text())
    ali_dir = data_dir / "ali"
    fix = f"run the align stage: python recipes/asr/prepare.py --data-dir {data_dir} --stage 6"
    num_pdfs = int(json.loads(_require(ali_dir / "info.json", fix).read_text())["num_pdfs"])
    train_cuts = CutSet.from_file(_require(ali_dir / "train_cuts.jsonl.gz", fix))
    train_alis = {c.id: np.asarray(c.load_custom("pdf_ali")) for c in train_cuts}
    train = aligned_speaker_frames(train_cuts, train_alis, split_cmvn(cmvn, "train"))

    trans: dict[str, np.ndarray] = {}
    rounds = []
    for r in range(sat_rounds + 1):
        model = pdf_gaussians(((apply_affine(trans[s], x) if trans else x, p) for s, (x, p) in train.items()), num_pdfs)
        results = {s: estimate_aligned_transform(model, x, p) for s, (x, p) in train.items()}
        trans = {s: w for s, (w, _) in results.items()}
        rounds.append(_summarise(results))
        log.info("adapt (fbank_sat): round %d, training speakers: %s", r, rounds[-1])
    info = {"sat_rounds": sat_rounds, "rounds": rounds, "splits": {"train": rounds[-1]}}
    for split in ("dev", "test"):
        path = data_dir / "features" / f"{split}_cuts.jsonl.gz"
        if not path.exists():
            continue
        split_trans, info["splits"][split] = transforms_from_pdfs(model, CutSet.from_file(path),
                                                                  sat_first_pass_pdfs(data_dir, split),
                                                                  split_cmvn(cmvn, split))
        add_split_entries(trans, split_trans, split)
        log.info("adapt (fbank_sat): %s speakers: %s", split, info["splits"][split])
    model.save(out / SAT_MODEL)
    with atomic_path(out / SAT_TRANS) as tmp, open(tmp, "wb") as f:
        pickle.dump(dict(sorted(trans.items())), f)  # by speaker: the split decodings finish in any order
    info["seconds"] = round(time.perf_counter() - start, 1)
    (out / "sat_info.json").write_text(json.dumps(info, indent=1))
    return info


def new_set_transforms(data_dir: Path | str, cuts, cmvn: dict) -> tuple[dict[str, np.ndarray], dict]:
    """``fbank_sat`` transforms of a new set's speakers (``evaluate.py --test-set``): the SAT GMM
    decodes the set (``local.gmm.sat.decode_new_set``: no transcripts), its best paths give each
    frame's pdf, and each speaker's transform is estimated against ``adapt/pdf_gauss.npz``."""
    from local.gmm.common import GmmSystem
    from local.gmm.sat import decode_new_set

    data_dir = Path(data_dir)
    model = DiagGmm.load(data_dir / "adapt" / SAT_MODEL)
    cuts = list(cuts)
    _, _, best_paths = decode_new_set(data_dir, cuts)
    tid2pdf = GmmSystem.load(data_dir / "exp" / "sat" / "final.pkl").tid2pdf()
    pdfs = {u: tid2pdf[np.asarray(a, np.int64)] for u, a in best_paths.items()}
    trans, summary = transforms_from_pdfs(model, cuts, pdfs, cmvn)
    return trans, {**summary, "decoded_utterances": len(best_paths), "utterances": len(cuts)}
