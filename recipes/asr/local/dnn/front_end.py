"""The DNN's input frames per cut, for training (``datamodule``) and decoding (``evaluate.py``).

Three front ends (``FEATURES``), all speaker-normalised; the DNN splices 17 of their frames:

- ``fbank``: 40-bin fbank, mean and variance normalised per speaker (``features.apply_cmvn``;
  Kaldi's ``run_dnn_fbank.sh``).
- ``fbank_fmllr``: ``fbank`` followed by the speaker's affine fbank transform
  (``local.dnn.adapt``: fMLLR against a fbank UBM, estimated without transcripts, so any speaker
  of any set can get one).
- ``fbank_sat`` (default): ``fbank`` followed by the speaker's affine fbank transform estimated against
  per-pdf fbank Gaussians on the SAT system's frame alignments (``local.dnn.adapt.adapt_sat``):
  training speakers from their training alignments, dev and test speakers from the best paths of
  the SAT system's fMLLR decoding (a first pass, no transcripts; any other set is decoded by the
  SAT GMM on the way, ``add_speakers``). Stays in the fbank domain; on the default corpus it
  brought the DNN from 14.5 % to 8.6 % test WER (README).
- ``mfcc_fmllr``: Kaldi nnet1's classic input, the SAT GMM's own features: 13 MFCC with speaker
  CMVN, spliced and LDA+MLLT-projected (40 dims; with ``prepare.py --no-lda-mllt`` Δ, ΔΔ, 39 dims),
  through the speaker's fMLLR transform of the SAT system (training speakers: from ``align_fmllr``
  on their transcripts, ``ali/trans_train.pkl``; dev and test speakers alike, without transcripts: from
  the SAT system's fMLLR decoding, ``exp/sat/decode_{split}/trans.pkl``, so that what dev picks is
  picked on the input test gets). For comparison only: it needs a GMM decoding pass before the DNN
  can run.

Speakers are ``features.gmm_cmvn_key`` (augmented copies apart) for both transforms.
"""

from __future__ import annotations

import json
import logging
import pickle
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from local.data.features import apply_cmvn, gmm_cmvn_key, split_cmvn, split_speaker_key
from local.gmm.transforms import apply_affine

log = logging.getLogger(__name__)

FEATURES = ("fbank", "fbank_fmllr", "fbank_sat", "mfcc_fmllr")


def one_blas_thread() -> None:
    """numpy's BLAS on one thread in this process (``threadpoolctl``), for the DNN's loaders.

    The front end's BLAS calls are small (a ``[T, 40] x [40, 41]`` product per cut). With
    OpenBLAS's default of a thread per core they compete with torch's threads, which spin
    between training steps: measured here with a training running, one such product took
    4.5 ms against 34 us on one thread.
    """
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=1, user_api="blas")


def _load_pickle(path: Path, fix: str) -> dict:
    if not path.exists():
        raise ValueError(f"No such file: {path}; {fix}")
    with open(path, "rb") as f:
        return pickle.load(f)


class FrontEnd:
    """Turns the cuts of a split into the DNN's input frames.

    Args:
        data_dir: the recipe's data directory (``features/cmvn.json``; ``adapt/`` for
            ``fbank_fmllr``; ``ali/`` and ``exp/sat/`` for ``mfcc_fmllr``).
        kind: one of ``FEATURES``.
    """

    def __init__(self, data_dir: Path | str, kind: str = "fbank_sat") -> None:
        if kind not in FEATURES:
            raise ValueError(f"features={kind!r}; use one of {FEATURES}")
        self.data_dir, self.kind = Path(data_dir), kind
        cmvn_path = self.data_dir / "features" / "cmvn.json"
        if not cmvn_path.exists():
            raise ValueError(f"No such file: {cmvn_path}; run `python recipes/asr/prepare.py --data-dir "
                             f"{self.data_dir}` (stage 1) first")
        self.cmvn = json.loads(cmvn_path.read_text())
        self.fbank_trans: dict[str, np.ndarray] = {}
        if kind in ("fbank_fmllr", "fbank_sat"):
            self.fbank_trans = _load_pickle(
                self.data_dir / "adapt" / ("fbank_trans.pkl" if kind == "fbank_fmllr" else "fbank_sat_trans.pkl"),
                f"run the adapt stage: python recipes/asr/prepare.py --data-dir {self.data_dir} --stage 7")

    @property
    def dim(self) -> int:
        if self.kind == "mfcc_fmllr":
            transform = self.gmm_transform()
            return 39 if transform is None else len(transform)
        return len(self.cmvn["global"]["mean"])

    def gmm_transform(self) -> np.ndarray | None:
        """The SAT system's LDA+MLLT transform (``mfcc_fmllr``), None when it models Δ + ΔΔ features."""
        if not hasattr(self, "_gmm_transform"):
            from local.gmm.common import GmmSystem

            self._gmm_transform = GmmSystem.load(self.data_dir / "exp" / "sat" / "final.pkl").transform
        return self._gmm_transform

    def mfcc_transforms(self, split: str) -> dict[str, np.ndarray]:
        """The SAT system's fMLLR transforms of a split's speakers (``mfcc_fmllr``)."""
        if split == "train":  # from the transcripts, as Kaldi's SAT training estimates them
            return _load_pickle(self.data_dir / "ali" / "trans_train.pkl", "run the align stage (SAT alignments): "
                                f"python recipes/asr/prepare.py --data-dir {self.data_dir} --stage 6")
        if split in ("dev", "test"):  # from the first-pass decoding, no transcripts: dev as test is
            return _load_pickle(self.data_dir / "exp" / "sat" / f"decode_{split}" / "trans.pkl",
                                f"decode {split} with the SAT system: python recipes/asr/prepare.py --data-dir "
                                f"{self.data_dir} --stage 5 --force")
        raise ValueError(f"features='mfcc_fmllr' has speaker transforms for train, dev and test only, not {split!r}; "
                         "decode other sets with a fbank model")

    def add_speakers(self, cuts, cmvn: dict | None = None) -> None:
        """Speaker statistics of a new set (``evaluate.py --test-set``): its CMVN statistics
        (``cmvn``: ``{"speakers": {...}}`` of the set) and each speaker's transform, without
        transcripts: ``fbank_fmllr`` against the UBM from its own utterances; ``fbank_sat`` from
        the best paths of the SAT GMM's fMLLR decoding of the set (``local.gmm.sat.decode_new_set``).
        From then on every set is normalised with the merged per-speaker statistics and transforms (the
        new set's own first), whatever its split's name."""
        if cmvn:
            self.cmvn = {"global": self.cmvn["global"], "speakers": {**self.cmvn["speakers"], **cmvn["speakers"]}}
        if self.kind == "fbank_fmllr":
            from local.dnn.adapt import DiagGmm, estimate_transforms, speaker_frames

            ubm = DiagGmm.load(self.data_dir / "adapt" / "ubm.npz")
            trans, summary = estimate_transforms(ubm, speaker_frames(cuts, self.cmvn))
            log.info("fbank fMLLR of the new set's speakers: %s", summary)
            self._add_transforms(trans)
        elif self.kind == "fbank_sat":
            from local.dnn.adapt import new_set_transforms

            trans, summary = new_set_transforms(self.data_dir, cuts, self.cmvn)
            log.info("fbank transforms of the new set's speakers from its SAT GMM decoding: %s", summary)
            self._add_transforms(trans)
        elif self.kind == "mfcc_fmllr":
            raise ValueError("features='mfcc_fmllr' needs the SAT GMM's fMLLR decoding of a set first; "
                             "decode new sets with a fbank model (features fbank, fbank_fmllr or fbank_sat)")

    def _add_transforms(self, trans: dict[str, np.ndarray]) -> None:
        """A new set's speaker transforms, ahead of a recipe split's of the same speaker name."""
        self.fbank_trans = {**{k: w for k, w in self.fbank_trans.items() if k.partition("/")[2] not in trans}, **trans}

    def __call__(self, cuts, split: str) -> Iterator[tuple[object, np.ndarray]]:
        """``(cut, frames [T, dim] float32)`` for every cut of ``cuts`` (all of one ``split``: the
        MFCC front end normalises each speaker over the split's cuts, as the GMMs do)."""
        if self.kind == "mfcc_fmllr":
            from local.gmm.common import gmm_front_end

            cuts = list(cuts)
            trans = self.mfcc_transforms(split)
            feats = gmm_front_end(cuts, transform=self.gmm_transform())
            for cut in cuts:
                key = gmm_cmvn_key(cut)
                x = feats[cut.id]
                yield cut, (apply_affine(trans[key], x) if key in trans else x)
            return
        cmvn = split_cmvn(self.cmvn, split)  # the split's own speaker statistics
        for cut in cuts:
            speaker = cut.supervisions[0].speaker if cut.supervisions else None
            x = np.asarray(apply_cmvn(cut.load_features(), speaker, cmvn), dtype=np.float32)
            if self.kind in ("fbank_fmllr", "fbank_sat"):
                key = gmm_cmvn_key(cut)
                W = self.fbank_trans.get(split_speaker_key(split, key), self.fbank_trans.get(key))
                if W is None:
                    raise ValueError(f"no fbank transform for speaker {key!r} of cut {cut.id}; re-run the adapt "
                                     f"stage (python recipes/asr/prepare.py --data-dir {self.data_dir} --stage 7) "
                                     "or add the set's speakers with FrontEnd.add_speakers")
                x = apply_affine(W, x)
            yield cut, x
