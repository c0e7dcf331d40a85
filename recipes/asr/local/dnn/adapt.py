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
``adapt/fbank_trans.pkl`` (``{speaker: W [40, 41]}`` of every split's speakers) and
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

from local.data.features import apply_cmvn, gmm_cmvn_key
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
    train = speaker_frames(cuts["train"], cmvn, max_frames=None)
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
            split_trans, info["splits"][split] = estimate_transforms(ubm, speaker_frames(cuts[split], cmvn))
            trans.update(split_trans)
            log.info("adapt: %s speakers: %s", split, info["splits"][split])
    ubm.save(out / "ubm.npz")
    with open(out / "fbank_trans.pkl", "wb") as f:
        pickle.dump(trans, f)
    info["seconds"] = round(time.perf_counter() - start, 1)
    (out / "info.json").write_text(json.dumps(info, indent=1))
    result = {"speakers": len(trans), **{f"{s}_gain": v["gain_per_frame"] for s, v in info["splits"].items()},
              "seconds": info["seconds"]}
    log.info("adapt: %s", result)
    return result
