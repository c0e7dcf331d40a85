"""Frame-level training data for the hybrid DNN: spliced speaker-normalised frames and pdf-ids.

Batch schema (dicts from both loaders)::

    x: [B, (2*context+1)*F] float32   window of frames t-context .. t+context, frame-major
                                      (all F bins of frame t-context first); 17*40 = 680 by default
    y: [B] int64                      pdf-id of the centre frame t

Legend: B frames in the batch, F feature dims (40 fbank bins; 39 for ``mfcc_fmllr``); the frames
come from ``local.dnn.front_end`` (speaker CMVN, and the speaker's fMLLR transform by default). At utterance boundaries the first/last frame
is repeated, as Kaldi's splicing does.

Two training loaders (``loader``):

- ``memory`` (default): all frames of a split live in memory as one ``[N, F]`` float32 array (160
  bytes per frame at F = 40: one hour of speech is ~58 MB); windows are gathered per batch, so
  memory does not grow 17-fold. Fine for the corpora this recipe builds (hours).
- ``stream``: ``local.dnn.stream``: Lhotse's ``DynamicCutSampler`` over the lazy manifest feeds a
  frame shuffle buffer of ``buffer_frames``; memory is bounded by the buffer, not the corpus.
  The dev set stays in memory (it is small and fixed).

Shuffling and sharding (``memory``): every epoch, all training frames are permuted with a generator seeded
by ``(seed, epoch)``; rank ``r`` of ``W`` takes permuted positions ``r, r+W, ...`` (disjoint,
together complete) and every rank cuts its shard into the same number of batches, so DDP/GTC
ranks never wait on a missing batch; an epoch's last batch of fewer than a quarter of the batch size joins
the batch before it (``batch_bounds``: a step on a handful of frames at the full learning rate can undo the
epoch just before its validation).

Cross-validation set (``cv_speakers`` > 0, Kaldi nnet1's ``subset_data_dir_tr_cv.sh --cv-spk-percent``):
that fraction of the training speakers (``held_out_speakers``: persons, ``speaker_of``; never a
dev or test speaker; drawn by ``seed``) is held out of training and evaluated after every epoch as the
validation set ``cv``, beside ``dev``; the model's learning-rate schedule reads ``cv`` in place of
``dev``. Its frames go through the training split's front end (their speakers' transforms are the
training set's).

Resuming mid-epoch: the training loader is stateful (``state_dict``/``load_state_dict``, which
Lightning saves in every checkpoint and gives back on resume): it records the epoch and how many
batches of it were drawn, and a resumed run skips exactly those, so the rest of the epoch comes
in the order an uninterrupted run would have seen.
"""

from __future__ import annotations

import json
import logging
import random
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, IterableDataset

from local.dnn.front_end import FEATURES, FrontEnd, one_blas_thread
from local.dnn.stream import StreamingFrameBatches

log = logging.getLogger(__name__)


def splice(feats: np.ndarray, offsets: np.ndarray, frames: np.ndarray, context: int) -> np.ndarray:
    """Windows of ``2*context+1`` frames around ``frames``, clamped inside each frame's utterance.

    Args:
        feats: ``[N, F]`` frames of all utterances, concatenated.
        offsets: ``[U+1]`` start of each utterance in ``feats``, then ``N``.
        frames: ``[B]`` global frame indices (centres).
        context: frames on each side (8 for Strom's 17-frame window).

    Returns:
        ``[B, (2*context+1)*F]`` float32, frame-major.
    """
    utt = np.searchsorted(offsets, frames, side="right") - 1
    first, last = offsets[utt], offsets[utt + 1] - 1
    window = frames[:, None] + np.arange(-context, context + 1)[None, :]
    window = np.clip(window, first[:, None], last[:, None])
    return feats[window].reshape(len(frames), -1)


_NPY_1D = re.compile(rb"\{'descr': '(<i[248])', 'fortran_order': False, 'shape': \((\d+),\), \} *\n")


def load_pdf_ali(cut) -> np.ndarray:
    """``cut.load_custom("pdf_ali")``, read directly where it is a 1-D integer ``.npy`` file of
    Lhotse's ``NumpyFilesWriter`` (stage 6): ``np.load`` parses each file's header with
    ``ast.literal_eval``, which took longer than reading and decompressing the cut's features.
    Any other storage, or a header of another form, goes through Lhotse."""
    array = cut.custom["pdf_ali"].array
    if array.storage_type == "numpy_files":
        with open(Path(array.storage_path) / array.storage_key, "rb") as f:
            head = f.read(10)
            if head[:8] == b"\x93NUMPY\x01\x00":  # format 1.0: a 2-byte header length follows
                match = _NPY_1D.fullmatch(f.read(int.from_bytes(head[8:10], "little")))
                if match:
                    return np.fromfile(f, dtype=match[1].decode(), count=int(match[2]))
    return np.asarray(cut.load_custom("pdf_ali"))


MIN_LAST_BATCH = 0.25  # an epoch's last batch under this share of batch_size joins the one before (batch_bounds)


def batch_bounds(shard_sizes: list[int], rank: int, batch_size: int, warmup_frames: int = 0,
                 warmup_batch_size: int = 0) -> list[tuple[int, int]]:
    """``(start, end)`` positions of each batch in rank ``rank``'s shard; the same count on every rank.

    Batches are laid out on the smallest shard (the first ``warmup_frames`` in batches of
    ``warmup_batch_size``, the rest in batches of ``batch_size``); a larger shard's extra frames
    (at most one per rank) join its last batch. A last batch of fewer than a quarter of ``batch_size``'s
    frames joins the batch before it (``MIN_LAST_BATCH``): its mean gradient would carry more than twice
    a full batch's noise at the full learning rate, and a step on 7 frames at the recipe's rate 1.0,
    the epoch's last before its validation, left a DNN at chance on a Kaldi data dir of 374,279 frames.
    """
    n = min(shard_sizes)
    if n == 0:
        raise ValueError(f"a rank would get no training frames (shard sizes {shard_sizes}); use fewer devices")
    bounds, start = [], 0
    warm_end = min(warmup_frames, n) if warmup_batch_size > 0 else 0
    while start < n:
        size = warmup_batch_size if start < warm_end else batch_size
        end = min(start + size, warm_end if start < warm_end else n)
        bounds.append((start, end))
        start = end
    last = bounds[-1][1] - bounds[-1][0]
    if len(bounds) > 1 and bounds[-1][0] >= warm_end and last < MIN_LAST_BATCH * batch_size:
        bounds[-2:] = [(bounds[-2][0], bounds[-1][1])]
    bounds[-1] = (bounds[-1][0], shard_sizes[rank])
    return bounds


def shard_batches(num_frames: int, rank: int, world_size: int, batch_size: int, seed: int, epoch: int,
                  shuffle: bool = True, warmup_frames: int = 0, warmup_batch_size: int = 0) -> list[np.ndarray]:
    """Frame indices of each of this rank's batches for one epoch.

    Args:
        num_frames: frames in the split.
        rank, world_size: this process's global rank and the number of processes.
        batch_size: frames per batch per rank.
        seed, epoch: the permutation is a pure function of ``(seed, epoch)``, equal on all ranks.
        shuffle: permute across utterances (training) or keep the corpus order (dev).
        warmup_frames, warmup_batch_size: Strom's gentler start; the first ``warmup_frames`` of
            this rank's shard go in batches of ``warmup_batch_size`` (0 disables it).

    Returns:
        list of ``[b]`` int64 arrays; over all ranks they are disjoint and cover ``range(num_frames)``.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} out of range for world_size={world_size}")
    order = np.random.default_rng([seed, epoch]).permutation(num_frames) if shuffle else np.arange(num_frames)
    shard = order[rank::world_size]
    sizes = [len(range(r, num_frames, world_size)) for r in range(world_size)]
    return [shard[a:b] for a, b in batch_bounds(sizes, rank, batch_size, warmup_frames, warmup_batch_size)]


class FrameBatches(IterableDataset):
    """One epoch of this rank's batches (see the module docstring for the schema).

    ``epoch_fn`` gives the current epoch each time iteration starts (the trainer's epoch, so a
    resumed run reshuffles exactly as an uninterrupted one). After :meth:`load_state_dict`
    (the epoch and how many of its batches were drawn, counted by :class:`ResumableLoader`) the
    next iteration over that epoch skips them.
    """

    def __init__(self, feats: np.ndarray, targets: np.ndarray, offsets: np.ndarray, context: int,
                 batch_fn: Callable[[int], list[np.ndarray]], epoch_fn: Callable[[], int]) -> None:
        self.feats, self.targets, self.offsets, self.context = feats, targets, offsets, context
        self.batch_fn, self.epoch_fn = batch_fn, epoch_fn
        self._resume: tuple[int, int] | None = None  # (epoch, batches to skip) from a checkpoint

    def __len__(self) -> int:
        return len(self.batch_fn(self.epoch_fn()))

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        epoch = self.epoch_fn()
        batches = self.batch_fn(epoch)
        skip = 0
        if self._resume is not None and self._resume[0] == epoch:
            skip = self._resume[1]
            if not 0 <= skip <= len(batches):
                raise ValueError(f"the checkpoint's data position ({skip} batches into epoch {epoch}) is past "
                                 f"this run's {len(batches)} batches per epoch: resume with the data settings "
                                 "(batch_size, seed, number of processes) of the run that saved it")
            log.info("resuming epoch %d after its first %d of %d batches", epoch, skip, len(batches))
        self._resume = None
        for frames in batches[skip:]:
            x = splice(self.feats, self.offsets, frames, self.context)
            yield {"x": torch.from_numpy(x), "y": torch.from_numpy(self.targets[frames].astype(np.int64))}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._resume = (int(state["epoch"]), int(state["batches"]))


class ResumableLoader(DataLoader):
    """A ``DataLoader`` over :class:`FrameBatches` or ``StreamingFrameBatches`` with its position in
    the epoch as state: Lightning saves ``state_dict()`` in checkpoints and calls
    ``load_state_dict()`` on resume. The position is counted here, in the process that consumes
    the batches, so it is right with a reading-ahead worker process (``num_workers=1``) too.
    More workers would each produce the whole epoch, so 0 or 1 only.
    """

    def __init__(self, dataset: IterableDataset, num_workers: int = 0) -> None:
        if num_workers not in (0, 1):
            raise ValueError(f"num_workers={num_workers}: the frame loaders take 0 (batches made in the training "
                             "process) or 1 (one process reading ahead); more would repeat the epoch")
        super().__init__(dataset, batch_size=None, num_workers=num_workers, prefetch_factor=4 if num_workers else None)
        self._epoch, self._drawn = -1, 0

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        epoch, resume = self.dataset.epoch_fn(), self.dataset._resume
        skip = resume[1] if resume is not None and resume[0] == epoch else 0
        batches = super().__iter__()  # a worker starts here, with the dataset's resume point
        if self.num_workers:
            self.dataset._resume = None  # (without workers the dataset clears it when it starts)
        self._epoch, self._drawn = epoch, skip
        return self._counted(batches)

    def _counted(self, batches: Iterator) -> Iterator[dict[str, torch.Tensor]]:
        for batch in batches:
            self._drawn += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self._epoch, "batches": self._drawn}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.dataset.load_state_dict(state)


def load_split(cuts_path: Path, front_end: FrontEnd, split: str, allow_empty: bool = False,
               keep: Callable[[object], bool] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Load aligned cuts into memory: the front end's frames and per-frame pdf-ids.

    Args:
        front_end: turns each cut into speaker-normalised frames (``local.dnn.front_end``).
        split: the split's name (the MFCC front end's speaker transforms are per split).
        allow_empty: return empty arrays for a manifest without cuts instead of raising.
        keep: only the cuts for which it is true (all by default).

    Returns:
        ``feats`` ``[N, F]`` float32, ``targets`` ``[N]`` int32, ``offsets`` ``[U+1]`` int64.
    """
    from lhotse import CutSet

    if not cuts_path.exists():
        raise ValueError(f"No such file: {cuts_path}; run `python recipes/asr/prepare.py` (stages 0-6) first")
    one_blas_thread()
    feats, targets, lengths = [], [], []
    cuts = CutSet.from_file(cuts_path) or []  # lhotse: None for an empty manifest
    for cut, f in front_end([c for c in cuts if keep(c)] if keep is not None else cuts, split):
        ali = np.asarray(cut.load_custom("pdf_ali"))
        if len(ali) != len(f):
            raise ValueError(f"cut {cut.id}: {len(f)} feature frames but {len(ali)} pdf_ali entries; "
                             "features and alignments must come from the same framing (re-run stage 6)")
        feats.append(f)
        targets.append(ali.astype(np.int32))
        lengths.append(len(f))
    if not feats:
        if not allow_empty:
            raise ValueError(f"{cuts_path} holds no cuts; check dropped.jsonl in the data dir for why")
        return np.zeros((0, 0), np.float32), np.zeros(0, np.int32), np.zeros(1, np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return np.concatenate(feats), np.concatenate(targets), offsets


def speaker_of(cut) -> str:
    """The speaker a cut is held out by: the supervision's speaker; on the synthetic corpus the person
    behind the voice (``corpus_synthetic.person``: every rate/pitch setting and augmented copy of it, and
    flite's and festival's voices of one recorded person, together); the cut itself when it has none."""
    sup = cut.supervisions[0] if cut.supervisions else None
    if sup is None or sup.speaker is None:
        return f"utt:{cut.id}"
    custom = sup.custom or {}
    if "engine" in custom and "voice" in custom:
        from local.data.corpus_synthetic import person

        return person(custom["engine"], custom["voice"])
    return sup.speaker


def held_out_speakers(train_speakers, fraction: float, seed: int, other_speakers=()) -> list[str]:
    """The training speakers of the cross-validation set (Kaldi's ``--cv-spk-percent``), sorted.

    Args:
        train_speakers: the training set's speakers (repeats allowed).
        fraction: share of them to hold out, rounded to the nearest count (0 < fraction < 1).
        seed: the draw is a pure function of the speakers and ``seed``.
        other_speakers: dev's and test's, never drawn (shared only with ``--allow-shared-speakers``).
    """
    speakers = sorted(set(train_speakers))
    others = set(other_speakers)
    candidates = [s for s in speakers if s not in others]
    count = int(fraction * len(speakers) + 0.5)
    if count < 1:
        raise ValueError(f"--data.cv_speakers {fraction} holds out no speaker: train has {len(speakers)} speaker(s) "
                         f"and {fraction:g} of them rounds to 0; give --data.cv_speakers "
                         f"{0.5 / max(len(speakers), 1):.3g} or more (one speaker), or 0 to run the schedule on dev")
    if count >= len(speakers):
        raise ValueError(f"--data.cv_speakers {fraction} holds out {count} of train's {len(speakers)} speaker(s), "
                         "leaving none to train on; give a smaller fraction, or 0 to run the schedule on dev")
    if count > len(candidates):
        raise ValueError(f"--data.cv_speakers {fraction} needs {count} training speakers in neither dev nor test, "
                         f"and train has {len(candidates)} of {len(speakers)}; give a smaller fraction")
    return sorted(random.Random(f"cv-speakers-{seed}").sample(candidates, count))


class SpeakerFilter:
    """``cut -> bool``: whether the cut's speaker is one of ``speakers`` (``inside``) or is not
    (picklable, for a reading-ahead worker)."""

    def __init__(self, speakers, inside: bool) -> None:
        self.speakers, self.inside = frozenset(speakers), inside

    def __call__(self, cut) -> bool:
        return (speaker_of(cut) in self.speakers) == self.inside


class LazyCuts:
    """The lazy manifest at ``path`` without the cuts of ``speakers`` (the streaming loader's training cuts)."""

    def __init__(self, path: Path, speakers) -> None:
        self.path, self.keep = path, SpeakerFilter(speakers, inside=False)

    def __call__(self):
        from lhotse import CutSet

        return CutSet.from_jsonl_lazy(self.path).filter(self.keep)


class AsrDataModule(LightningDataModule):
    """Aligned frames from ``<data_dir>/ali`` (recipe stage 6) for training and dev accuracy.

    Args:
        data_dir: the recipe's data directory (``ali/``, ``features/cmvn.json``, ``adapt/``);
            ``train.py`` fills it from ``--corpus``/``--corpus_size`` when left empty.
        features: the input front end (``local.dnn.front_end``): ``fbank_sat`` (default: speaker
            CMVN and the speaker's fbank transform from the SAT system's alignments), ``fbank_fmllr``
            (speaker CMVN and the speaker's fbank fMLLR transform against a UBM), ``fbank`` (speaker
            CMVN only) or ``mfcc_fmllr`` (the SAT GMM's fMLLR features, Kaldi nnet1's input; for comparison).
        context: frames each side of the centre (8: Strom's 17-frame window).
        batch_size: frames per batch per rank.
        dev_batch_size: frames per dev batch per rank.
        warmup_fraction: Strom's gentler start: this fraction of epoch 1 uses ``warmup_batch_size``.
        warmup_batch_size: the smaller batch of the first part of epoch 1.
        seed: seed of the frame permutation (combined with the epoch).
        loader: ``memory`` (every training frame in memory) or ``stream`` (a bounded frame
            shuffle buffer fed by Lhotse's cut sampler; ``local.dnn.stream``).
        buffer_frames: ``stream``: undrawn frames the shuffle buffer holds before each batch.
            The cuts it holds are a few times more frames (about ``ln T`` for cuts of ``T``
            frames), 164 bytes each at 40 bins, and 2 * context copies of each cut's edge frames.
            400,000 (default) matched the in-memory loader's dev frame accuracy on 3 seeds;
            100,000 was a point below (README).
        chunk_seconds: ``stream``: speech per chunk of cuts taken from the sampler.
        cut_shuffle_buffer: ``stream``: cuts in Lhotse's shuffling reservoir (its default, 20,000;
            about 5 KB each). The cut order is shuffled only within it, and the recipe's manifests
            are sorted by voice: keep it larger than a few voices' cuts.
        num_workers: 0 (training batches made in the training process) or 1 (one process reads
            ahead, overlapping feature reading with the training step).
        readers: ``stream``: processes that read and transform the cuts (features, front end,
            alignment) while the training process keeps the buffer and splices (0: the training
            process reads them). The batches are the same for any number; needs ``num_workers=0``.
        cv_speakers: share of the training speakers held out as the cross-validation set ``cv``
            that the learning-rate schedule reads in place of dev (nnet1: 0.1); 0 (default): none,
            every training speaker is trained on and the schedule reads dev.
    """

    def __init__(self, data_dir: str | None = None,
                 features: Literal["fbank_sat", "fbank_fmllr", "fbank", "mfcc_fmllr"] = "fbank_sat", context: int = 8, batch_size: int = 256, dev_batch_size: int = 4096, warmup_fraction: float = 0.0,
                 warmup_batch_size: int = 64, seed: int = 0, loader: Literal["memory", "stream"] = "memory",
                 buffer_frames: int = 400_000, chunk_seconds: float = 30.0, cut_shuffle_buffer: int = 20_000,
                 num_workers: int = 0, readers: int = 0, cv_speakers: float = 0.0) -> None:
        super().__init__()
        if not 0.0 <= cv_speakers < 1.0:
            raise ValueError(f"cv_speakers={cv_speakers}: give the share of training speakers to hold out, "
                             "0 <= cv_speakers < 1 (nnet1: 0.1; 0: none)")
        if features not in FEATURES:
            raise ValueError(f"features={features!r}; use one of {FEATURES}")
        if loader not in ("memory", "stream"):
            raise ValueError(f"loader={loader!r}; use 'memory' or 'stream'")
        if loader == "stream" and features == "mfcc_fmllr":
            raise ValueError("loader='stream' needs a per-cut front end; features='mfcc_fmllr' normalises each "
                             "speaker over the whole split: use loader='memory' or features fbank/fbank_fmllr/fbank_sat")
        if num_workers not in (0, 1):
            raise ValueError(f"num_workers={num_workers}: use 0 or 1 (one process reading ahead)")
        if readers < 0 or (readers and loader != "stream"):
            raise ValueError(f"readers={readers}: the streaming loader's reading processes (>= 0; with loader='stream', "
                             f"not {loader!r})")
        if readers and num_workers:
            raise ValueError(f"readers={readers} with num_workers={num_workers}: the readers are started by the "
                             "training process; use num_workers=0 with readers")
        if buffer_frames < 1 or chunk_seconds <= 0 or cut_shuffle_buffer < 1:
            raise ValueError(f"bad streaming settings: buffer_frames={buffer_frames} (>= 1), chunk_seconds="
                             f"{chunk_seconds} (> 0), cut_shuffle_buffer={cut_shuffle_buffer} (>= 1)")
        if context < 0 or batch_size < 1 or dev_batch_size < 1 or not 0.0 <= warmup_fraction <= 1.0:
            raise ValueError(f"bad data settings: context={context} (>= 0), batch_size={batch_size} (>= 1), "
                             f"dev_batch_size={dev_batch_size} (>= 1), warmup_fraction={warmup_fraction} (0..1)")
        if data_dir is None:
            raise ValueError("data_dir is None: give the recipe's data directory (e.g. data/synthetic-default)")
        self.save_hyperparameters()
        self.data_dir = Path(data_dir)
        self._front_end: FrontEnd | None = None
        self.splits: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self.cv_speaker_list: list[str] | None = None  # the held-out training speakers (cv_speakers > 0)

    @property
    def info(self) -> dict:
        path = self.data_dir / "ali" / "info.json"
        if not path.exists():
            raise ValueError(f"No such file: {path}; run `python recipes/asr/prepare.py --data-dir {self.data_dir}`")
        return json.loads(path.read_text())

    @property
    def num_pdfs(self) -> int:
        return int(self.info["num_pdfs"])

    @property
    def front_end(self) -> FrontEnd:
        if self._front_end is None:
            self._front_end = FrontEnd(self.data_dir, self.hparams.features)
        return self._front_end

    @property
    def feat_dim(self) -> int:
        return self.front_end.dim

    @property
    def input_dim(self) -> int:
        return (2 * self.hparams.context + 1) * self.feat_dim

    @property
    def val_sets(self) -> tuple[str, ...]:
        """Names of the validation loaders, in order: ``dev`` (when it has frames), then ``cv``."""
        dev = ("dev",) if "dev" not in self.splits or len(self.splits["dev"][0]) >= self._rank()[1] else ()
        return (*dev, "cv") if self.hparams.cv_speakers > 0 else ("dev",)

    def held_out(self) -> list[str]:
        """The cross-validation speakers (``held_out_speakers`` over this data dir's manifests), once."""
        if self.cv_speaker_list is None:
            from lhotse import CutSet

            ali = self.data_dir / "ali"
            train = [speaker_of(c) for c in CutSet.from_jsonl_lazy(ali / "train_cuts.jsonl.gz")]
            others = set()
            for path in (ali / "dev_cuts.jsonl.gz", self.data_dir / "manifests" / "dev_cuts.jsonl.gz",
                         self.data_dir / "manifests" / "test_cuts.jsonl.gz"):
                if path.exists():
                    others.update(speaker_of(c) for c in CutSet.from_jsonl_lazy(path))
            self.cv_speaker_list = held_out_speakers(train, self.hparams.cv_speakers, self.hparams.seed, others)
            held = sum(s in self.cv_speaker_list for s in train)  # speakers differ in size: say the share
            log.info("cv: %d of train's %d speakers held out of training for the schedule (seed %d), %d of its %d "
                     "utterances (%.1f %%): %s", len(self.cv_speaker_list), len(set(train)), self.hparams.seed, held,
                     len(train), 100 * held / len(train), " ".join(self.cv_speaker_list))
        return self.cv_speaker_list

    def setup(self, stage: str) -> None:
        held_out = self.held_out() if self.hparams.cv_speakers > 0 else []
        splits = ("train", "dev", "cv") if held_out else ("train", "dev")
        for split in splits:
            if split == "train" and self.hparams.loader == "stream":
                continue
            if split not in self.splits:
                keep = SpeakerFilter(held_out, inside=split == "cv") if split != "dev" and held_out else None
                self.splits[split] = load_split(
                    self.data_dir / "ali" / f"{'dev' if split == 'dev' else 'train'}_cuts.jsonl.gz", self.front_end,
                    "dev" if split == "dev" else "train", allow_empty=split == "dev", keep=keep)
                feats, _, offsets = self.splits[split]
                if len(feats) == 0 and split == "cv":
                    raise ValueError(f"cv: the held-out speakers {held_out} have no aligned utterances in "
                                     f"{self.data_dir}/ali (see dropped.jsonl); use another --data.seed")
                if len(feats) == 0:
                    log.warning("dev: no aligned utterances in %s/ali (see dropped.jsonl); dev frame accuracy "
                                "is not computed", self.data_dir)
                    continue
                log.info("%s: %d utterances, %d frames of %d bins in memory (%.1f MB)", split,
                         len(offsets) - 1, len(feats), feats.shape[1], feats.nbytes / 1e6)

    def _rank(self) -> tuple[int, int]:
        trainer = self.trainer
        return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)

    def _epoch(self) -> int:
        return self.trainer.current_epoch if self.trainer is not None else 0

    def load_cut(self, cut) -> tuple[np.ndarray, np.ndarray]:
        """One aligned cut's front-end frames ``[T, F]`` and pdf-ids ``[T]`` (the streaming loader's reader)."""
        (_, feats), = self.front_end([cut], "train")
        ali = load_pdf_ali(cut)
        if len(ali) != len(feats):
            raise ValueError(f"cut {cut.id}: {len(feats)} feature frames but {len(ali)} pdf_ali entries; "
                             "features and alignments must come from the same framing (re-run stage 6)")
        return feats, ali.astype(np.int32)

    def train_dataloader(self) -> DataLoader:
        hp = self.hparams
        if hp.loader == "stream":
            def layout(share: int, epoch: int) -> list[tuple[int, int]]:
                warm = int(hp.warmup_fraction * share) if epoch == 0 else 0
                return batch_bounds([share], 0, hp.batch_size, warm, hp.warmup_batch_size)

            path = self.data_dir / "ali" / "train_cuts.jsonl.gz"
            return ResumableLoader(StreamingFrameBatches(
                LazyCuts(path, self.held_out()) if hp.cv_speakers > 0 else path, self.load_cut, hp.context, layout, self._epoch,
                self._rank, hp.seed, hp.buffer_frames, hp.chunk_seconds, hp.cut_shuffle_buffer, hp.readers),
                hp.num_workers)
        feats, targets, offsets = self.splits["train"]
        rank, world = self._rank()
        warm = int(hp.warmup_fraction * len(feats) / world)

        def batches(epoch: int) -> list[np.ndarray]:
            return shard_batches(len(feats), rank, world, hp.batch_size, hp.seed, epoch,
                                 warmup_frames=warm if epoch == 0 else 0, warmup_batch_size=hp.warmup_batch_size)

        return ResumableLoader(FrameBatches(feats, targets, offsets, hp.context, batches, self._epoch),
                               hp.num_workers)

    def val_dataloader(self) -> DataLoader | list:
        if self.hparams.cv_speakers > 0:  # one loader per name of val_sets
            return [self._eval_loader(name) for name in self.val_sets]
        return self._eval_loader("dev") or []  # no aligned dev frames: validation is skipped

    def _eval_loader(self, split: str) -> DataLoader | None:
        feats, targets, offsets = self.splits[split]
        rank, world = self._rank()
        if len(feats) < world:
            if split == "cv":
                raise ValueError(f"cv: {len(feats)} frames of held-out speakers for {world} processes; hold more "
                                 "speakers out (a larger --data.cv_speakers) or use fewer devices")
            return None

        def batches(epoch: int) -> list[np.ndarray]:
            return shard_batches(len(feats), rank, world, self.hparams.dev_batch_size, 0, 0, shuffle=False)

        return DataLoader(FrameBatches(feats, targets, offsets, self.hparams.context, batches, lambda: 0),
                          batch_size=None)
