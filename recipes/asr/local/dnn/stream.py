"""Streaming training frames: Lhotse's cut sampler feeds a frame shuffle buffer of bounded size.

The in-memory loader (``datamodule.FrameBatches``) holds every training frame of the corpus; this
one holds only what its buffer needs, so memory does not grow with the corpus::

    lazy manifest ──DynamicCutSampler──▶ chunks of cuts ──▶ FrameBuffer ──▶ batches of windows
    (CutSet.from_jsonl_lazy)  (shuffled by Lhotse's             (tickets: one per frame not yet
                               reservoir, this rank's share     drawn; each batch draws tickets
                               of every world_size chunks)      uniformly at random)

- Cut order: ``lhotse.dataset.DynamicCutSampler`` (``shuffle=True``, seeded by ``seed`` and the
  epoch through ``set_epoch``, ``rank``/``world_size`` from the trainer) yields this rank's chunks
  of about ``chunk_seconds`` of speech; the chunks of all ranks are disjoint and cover the split.
- Frame order: before each batch the buffer is filled until it holds ``buffer_frames`` undrawn
  frames (or the rank's share is exhausted), then the batch takes that many frames uniformly at
  random among the undrawn ones. A frame's cut stays in memory (one ``[T, F]`` array in an
  arena) until its last frame is drawn, so the resident frames are a small multiple of
  ``buffer_frames`` (about ``ln T`` for cuts of ``T`` frames), whatever the corpus size.
- Equal batch counts on every rank (DDP/GTC need them), with no exchange: cut-level sharding gives
  the ranks slightly different numbers of frames, so every rank lays out the nominal share (the
  split's frames / world size, counted once from the manifest) in batches as the in-memory loader
  does and draws those sizes until its share of cuts runs out; from then on it knows exactly how
  many frames are left and splits them evenly over the batches left (:func:`even_split`). The
  same number of batches everywhere and in every epoch, no frame left out, and batch sizes off
  the nominal ones only by (share - nominal share) / (batches left), a few frames with the
  default buffer. Should a rank's share outlast the layout (a buffer smaller than the imbalance),
  its last batch takes the rest.
- Deterministic per ``(seed, epoch, rank)``. Resuming mid-epoch replays the epoch's draws on
  frame counts alone and loads the features of the cuts still in the buffer: skipping ``k``
  batches reads only the manifest.

- Reading in parallel (``readers`` > 0): the cuts are read and transformed (features, front end,
  alignment) in that many reader processes while the training process keeps the buffer and
  splices, so the training process's own work per frame is the in-memory loader's (a splice).
  Reader ``w`` of ``k`` takes the sampler's chunks ``w, w + k, ...`` (every reader walks the same
  seeded manifest order) and sends each chunk as one message; the training process puts the chunks
  back in the sampler's order, so the batches are the same for any number of readers.

Only the per-cut front ends stream (``fbank``, ``fbank_fmllr``, ``fbank_sat``); ``mfcc_fmllr`` normalises each
speaker over the whole split and needs the in-memory loader.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import IterableDataset

from local.dnn.front_end import one_blas_thread

log = logging.getLogger(__name__)


class FrameBuffer:
    """Undrawn frames ("tickets") of the cuts put in, drawn uniformly at random in batches.

    Each cut gets a slot; its frames are loaded into an arena only when one of its tickets is
    first drawn (``load_fn(key) -> (feats [T, F], targets [T])``), and the slot is freed (and
    reused) when its last ticket is drawn. Drawing alone (a replay on frame counts) loads nothing.
    Every array here is sized by what the buffer holds, never by the corpus.

    Args:
        context: frames on each side of a window's centre (clamped inside the cut).
        rng: the generator that picks the frames.
        reserve: arena rows allocated at the first load (the buffer's size: the loaded cuts
            soon hold more), so that it grows a few times instead of from a few thousand rows.
    """

    def __init__(self, context: int, rng: np.random.Generator, reserve: int = 4096) -> None:
        self.context, self.rng, self.reserve = context, rng, reserve
        self.tickets = np.zeros((2, 1024), np.int64)  # [slot, frame within the slot's cut] per undrawn frame
        self.pending = 0
        self.keys: list[object] = []                  # per slot: what load_fn needs (the cut)
        self.length = np.zeros(0, np.int64)           # per slot: frames of its cut
        self.left = np.zeros(0, np.int64)             # per slot: tickets not yet drawn
        self.start = np.zeros(0, np.int64)            # per slot: first arena row, -1 until loaded
        self.free: list[int] = []
        self.arena = np.zeros((0, 0), np.float32)
        self.arena_targets = np.zeros(0, np.int32)
        self.used = 0                                 # arena rows in use (bump allocation, then compaction)
        self.resident = 0                             # frames of the loaded cuts
        self.peak_resident = 0                        # most frames ever held at once

    def _new_slot(self) -> int:
        if self.free:
            return self.free.pop()
        slot = len(self.keys)
        self.keys.append(None)
        if slot >= len(self.length):
            grow = max(64, len(self.length))
            self.length, self.left = (np.concatenate([a, np.zeros(grow, np.int64)]) for a in (self.length, self.left))
            self.start = np.concatenate([self.start, np.full(grow, -1, np.int64)])
        return slot

    def put(self, key: object, num_frames: int) -> None:
        """Adds a cut of ``num_frames`` frames (no data read yet)."""
        if num_frames <= 0:
            return
        slot = self._new_slot()
        self.keys[slot], self.length[slot], self.left[slot], self.start[slot] = key, num_frames, num_frames, -1
        end = self.pending + num_frames
        if end > self.tickets.shape[1]:
            grown = np.zeros((2, max(end, 2 * self.tickets.shape[1])), np.int64)
            grown[:, :self.pending] = self.tickets[:, :self.pending]
            self.tickets = grown
        self.tickets[0, self.pending:end] = slot
        self.tickets[1, self.pending:end] = np.arange(num_frames)
        self.pending = end

    def draw(self, size: int) -> tuple[np.ndarray, np.ndarray]:
        """Takes ``size`` tickets uniformly at random: their ``(slots, frames)``."""
        n = self.pending
        if not 0 < size <= n:
            raise ValueError(f"asked for {size} frames, {n} left")
        pick = self.rng.choice(n, size=size, replace=False)
        slots, frames = self.tickets[0, pick], self.tickets[1, pick]
        # fill the holes below n - size with the unpicked tickets at or above it
        tail = np.ones(size, bool)
        tail[pick[pick >= n - size] - (n - size)] = False
        holes = pick[pick < n - size]
        self.tickets[:, holes] = self.tickets[:, n - size + np.flatnonzero(tail)]
        self.pending = n - size
        return slots, frames

    def release(self, slots: np.ndarray) -> None:
        """Counts drawn tickets off their slots; frees the slots with none left."""
        np.subtract.at(self.left, slots, 1)
        for s in np.unique(slots[self.left[slots] == 0]).tolist():
            if self.start[s] >= 0:
                self.resident -= int(self.length[s])
            self.keys[s], self.start[s] = None, -1
            self.free.append(s)

    def _load(self, slots: np.ndarray, load_fn: Callable[[object], tuple[np.ndarray, np.ndarray]]) -> None:
        c = self.context
        for s in np.unique(slots[self.start[slots] < 0]).tolist():
            feats, targets = load_fn(self.keys[s])
            n = int(self.length[s])
            if len(feats) != n:
                raise ValueError(f"cut {getattr(self.keys[s], 'id', self.keys[s])}: the manifest says {n} "
                                 f"frames, its features have {len(feats)}; re-run stage 6")
            self._reserve(n + 2 * c, feats.shape[1])
            first = self.used + c
            self.arena[self.used:first] = feats[0]  # the edge frames repeated: every window is a block of rows
            self.arena[first:first + n] = feats
            self.arena[first + n:first + n + c] = feats[-1]
            self.arena_targets[first:first + n] = targets
            self.start[s] = first
            self.keys[s] = None  # (loaded: what it was read from is no longer needed)
            self.used += n + 2 * c
            self.resident += n
            self.peak_resident = max(self.peak_resident, self.resident)

    def _reserve(self, rows: int, dim: int) -> None:
        """Room for ``rows`` more rows: compact the loaded cuts to the front (in place, cut by cut),
        then enlarge the arena in place when they would fill more than 80 % of it."""
        if self.used + rows <= len(self.arena):
            return
        c = self.context
        live = np.flatnonzero(self.start >= 0)
        live = live[np.argsort(self.start[live])]
        pos = 0
        for s in live.tolist():  # ascending starts: every move goes to a lower row
            a, n = int(self.start[s]) - c, int(self.length[s]) + 2 * c  # the cut's rows with its edges
            self.arena[pos:pos + n], self.arena_targets[pos:pos + n] = self.arena[a:a + n], self.arena_targets[a:a + n]
            self.start[s], pos = pos + c, pos + n
        self.used = pos
        if pos + rows > 0.8 * len(self.arena):  # grow by a quarter beyond the need: bounded, few compactions
            size = max(int(1.25 * (pos + rows)), self.reserve)
            if not len(self.arena):  # the first cut sets the width (a later cut of another width fails to fit)
                self.arena = np.empty((0, dim), np.float32)
            # in place (realloc): a large arena is moved by remapping its pages, not copied beside itself
            self.arena.resize((size, dim), refcheck=False)
            self.arena_targets.resize(size, refcheck=False)

    def windows(self, slots: np.ndarray, frames: np.ndarray,
                load_fn: Callable[[object], tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
        """The spliced windows ``[B, (2*context+1)*F]`` and targets ``[B]`` of drawn tickets.

        A cut sits in the arena between ``context`` copies of its first and of its last frame, so
        the window of a frame (clamped inside its cut, as ``datamodule.splice``) is the block of
        ``2*context+1`` rows around it: one row of a strided view of the arena, gathered whole."""
        self._load(slots, load_fn)
        centre = self.start[slots] + frames
        rows, dim = self.arena.shape
        width = 2 * self.context + 1
        blocks = np.lib.stride_tricks.as_strided(self.arena, shape=(max(rows - width + 1, 0), width * dim),
                                                 strides=self.arena.strides, writeable=False)
        return blocks[centre - self.context], self.arena_targets[centre]


def load_checked(load_fn: Callable, cut) -> tuple[np.ndarray, np.ndarray]:
    """``load_fn(cut)``, its frame count checked against the manifest's."""
    feats, targets = load_fn(cut)
    if len(feats) != cut.num_frames or len(targets) != cut.num_frames:
        raise ValueError(f"cut {cut.id}: the manifest says {cut.num_frames} frames, its features have {len(feats)} "
                         f"and its targets {len(targets)}; re-run stage 6")
    return feats, targets


class ChunkReader(IterableDataset):
    """One epoch of a rank's chunks of cuts, read and transformed in a ``DataLoader`` worker.

    Worker ``w`` of ``k`` reads the chunks ``w, w + k, ...`` of ``chunks_fn()`` (each worker walks
    the whole seeded order and skips the others' chunks: cheap, as no features are read for them)
    and yields one message per chunk: its index, its cuts' frame counts, and their frames and
    targets concatenated (numpy arrays, pickled through the worker's pipe: cheaper here than a
    shared-memory tensor, which costs a socket round trip per tensor).
    """

    def __init__(self, chunks_fn: Callable[[], Iterator], load_fn: Callable) -> None:
        self.chunks_fn, self.load_fn = chunks_fn, load_fn

    def __iter__(self) -> Iterator[tuple[int, np.ndarray, np.ndarray, np.ndarray]]:
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        one_blas_thread()
        for index, chunk in enumerate(self.chunks_fn()):
            if index % workers != worker:
                continue
            loaded = [load_checked(self.load_fn, cut) for cut in chunk if cut.num_frames > 0]
            yield (index, np.array([len(t) for _, t in loaded], np.int64),
                   np.concatenate([f for f, _ in loaded]) if loaded else np.zeros((0, 0), np.float32),
                   np.concatenate([t for _, t in loaded]).astype(np.int32) if loaded else np.zeros(0, np.int32))


def in_order(messages: Iterator[tuple[int, np.ndarray, np.ndarray, np.ndarray]]
             ) -> Iterator[tuple[int, tuple[np.ndarray, np.ndarray]]]:
    """The cuts of :class:`ChunkReader`'s messages in the sampler's chunk order: ``(frames, (feats, targets))``."""
    pending: dict[int, tuple] = {}
    expected = 0
    for message in messages:
        pending[message[0]] = message
        while expected in pending:
            _, lengths, feats, targets = pending.pop(expected)
            expected += 1
            ends = np.cumsum(lengths).tolist()
            for start, end in zip((0, *ends[:-1]), ends):
                yield end - start, (feats[start:end], targets[start:end])
    if pending:  # a chunk index was skipped: the readers disagree on the chunk order
        raise RuntimeError(f"chunk {expected} never arrived from the readers (got {sorted(pending)[:5]}...)")


def _as_sent(message):
    return message  # the readers' numpy arrays cross as they are (pickled through the pipe, no tensor conversion)


def _given(key: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    return key  # frames and targets read ahead by a reader


def even_split(frames: int, batches: int) -> list[int]:
    """``frames`` in ``batches`` sizes that differ by at most one (the larger ones first)."""
    q, r = divmod(frames, batches)
    return [q + 1] * r + [q] * (batches - r)


class StreamingFrameBatches(IterableDataset):
    """One epoch of this rank's batches from a lazy Lhotse manifest (schema: ``datamodule``).

    Args:
        cuts: aligned cuts (``ali/train_cuts.jsonl.gz``), read lazily; or a function returning a
            lazy ``CutSet`` (e.g. ``lambda: CutSet.from_jsonl_lazy(path).repeat(400, preserve_id=False)``).
        load_fn: ``cut -> (frames [T, F] float32, pdf-ids [T])`` (front end + alignment).
        context: frames each side of the centre.
        batch_fn: ``(share, epoch) -> [(start, end), ...]``: the batch layout of a share of
            ``share`` frames (the nominal share, the same on every rank).
        epoch_fn, rank_fn: the trainer's epoch; ``(rank, world_size)``.
        seed: seeds the sampler and the buffer with the epoch.
        buffer_frames: undrawn frames the buffer is filled to before each batch.
        chunk_seconds: speech per chunk of cuts from the sampler.
        cut_shuffle_buffer: cuts in Lhotse's shuffling reservoir.
        readers: processes that read and transform the cuts (0: this process reads them).
    """

    prefetch = 16  # chunks each reader may read ahead (a few MB): it keeps reading while this process compacts its arena

    def __init__(self, cuts: Path | str | Callable, load_fn: Callable, context: int, batch_fn: Callable,
                 epoch_fn: Callable[[], int], rank_fn: Callable[[], tuple[int, int]], seed: int,
                 buffer_frames: int, chunk_seconds: float, cut_shuffle_buffer: int, readers: int = 0) -> None:
        if buffer_frames < 1 or chunk_seconds <= 0 or cut_shuffle_buffer < 1 or readers < 0:
            raise ValueError(f"bad streaming settings: buffer_frames={buffer_frames} (>= 1), chunk_seconds="
                             f"{chunk_seconds} (> 0), cut_shuffle_buffer={cut_shuffle_buffer} (>= 1), "
                             f"readers={readers} (>= 0)")
        if not callable(cuts) and not Path(cuts).exists():
            raise ValueError(f"No such file: {cuts}; run `python recipes/asr/prepare.py` (stages 0-6) first")
        self.cuts, self.load_fn, self.context = cuts, load_fn, context
        self.batch_fn, self.epoch_fn, self.rank_fn, self.seed = batch_fn, epoch_fn, rank_fn, seed
        self.buffer_frames, self.chunk_seconds, self.cut_shuffle_buffer = buffer_frames, chunk_seconds, cut_shuffle_buffer
        self.readers = readers
        self._resume: tuple[int, int] | None = None
        self._total: int | None = None
        self.last_buffer: FrameBuffer | None = None

    def manifest(self):
        """The lazy ``CutSet`` of the split, without the supervisions' alignments (the TTS phone
        timings: half of a cut's memory in Lhotse's shuffling reservoir, and unused here)."""
        from lhotse import CutSet

        cuts = self.cuts() if callable(self.cuts) else CutSet.from_jsonl_lazy(self.cuts)
        return cuts.drop_alignments()

    def chunks(self, epoch: int, rank: int | None = None, world: int | None = None) -> Iterator:
        """Rank ``rank``'s chunks of cuts for ``epoch`` (lazy: no features read; this rank's by default)."""
        from lhotse.dataset import DynamicCutSampler

        if rank is None or world is None:
            rank, world = self.rank_fn()
        sampler = DynamicCutSampler(self.manifest(), max_duration=self.chunk_seconds,
                                    shuffle=True, shuffle_buffer_size=self.cut_shuffle_buffer, seed=self.seed,
                                    rank=rank, world_size=world, drop_last=False)
        sampler.set_epoch(epoch)
        yield from sampler

    def total_frames(self) -> int:
        """Frames of the whole split, from the manifest (counted once)."""
        if self._total is None:
            self._total = sum(cut.num_frames for cut in self.manifest())
        return self._total

    def nominal(self, epoch: int) -> list[tuple[int, int]]:
        """The batch layout every rank shares (its length is the epoch's number of batches)."""
        _, world = self.rank_fn()
        if self.total_frames() < world:
            raise ValueError(f"{self.cuts}: {self.total_frames()} frames for {world} ranks; use fewer devices")
        return self.batch_fn(self.total_frames() // world, epoch)

    def __len__(self) -> int:
        return len(self.nominal(self.epoch_fn()))

    def cut_stream(self, epoch: int) -> tuple[Iterator[tuple[int, object]], Callable]:
        """This rank's cuts of ``epoch`` as ``(frames, key)`` in the sampler's order, and the
        ``load_fn`` of their keys: the cuts themselves, read here; or, with ``readers``, their
        frames and targets, read ahead by that many processes (:class:`ChunkReader`)."""
        if not self.readers:
            return ((cut.num_frames, cut) for chunk in self.chunks(epoch) for cut in chunk), self.load_fn
        from functools import partial

        from torch.utils.data import DataLoader

        rank, world = self.rank_fn()
        reader = ChunkReader(partial(self.chunks, epoch, rank, world), self.load_fn)
        messages = DataLoader(reader, batch_size=None, num_workers=self.readers, prefetch_factor=self.prefetch,
                              collate_fn=_as_sent)
        return in_order(iter(messages)), _given

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        epoch = self.epoch_fn()
        rank, _ = self.rank_fn()
        sizes = [end - start for start, end in self.nominal(epoch)]
        skip = 0
        if self._resume is not None and self._resume[0] == epoch:
            skip = self._resume[1]
            if not 0 <= skip <= len(sizes):
                raise ValueError(f"the checkpoint's data position ({skip} batches into epoch {epoch}) is past "
                                 f"this run's {len(sizes)} batches per epoch: resume with the data settings "
                                 "(batch_size, seed, buffer, number of processes) of the run that saved it")
            log.info("resuming epoch %d after its first %d of %d batches (replayed on frame counts)",
                     epoch, skip, len(sizes))
        self._resume = None
        one_blas_thread()  # (also in a reading-ahead worker process)
        buffer = self.last_buffer = FrameBuffer(self.context, np.random.default_rng([self.seed, epoch, rank, 7]),
                                                    reserve=self.buffer_frames)
        stream, load_fn = self.cut_stream(epoch)
        try:
            yield from self._batches(buffer, stream, load_fn, sizes, skip, epoch)
        finally:
            stream.close()  # (stops the readers of an epoch left early)

    def _batches(self, buffer: FrameBuffer, stream: Iterator, load_fn: Callable, sizes: list[int], skip: int,
                 epoch: int) -> Iterator[dict[str, torch.Tensor]]:
        exhausted = False
        for i in range(len(sizes)):
            while not exhausted and buffer.pending < max(self.buffer_frames, sizes[i]):
                item = next(stream, None)
                if item is None:
                    exhausted = True
                    left = len(sizes) - i
                    if buffer.pending < left:
                        raise ValueError(
                            f"epoch {epoch}: this rank's share of the cuts ran out with {buffer.pending} frames "
                            f"for the {left} batches left (every rank draws {len(sizes)}): the cuts are too few "
                            "or too long for this many ranks; lower --data.chunk_seconds or use --data.loader memory")
                    sizes[i:] = even_split(buffer.pending, left)
                    break
                buffer.put(item[1], item[0])
            if i == len(sizes) - 1 and not exhausted:  # the share outlasts the layout: the rest joins the last batch
                for frames, key in stream:
                    buffer.put(key, frames)
                sizes[i] = buffer.pending
            slots, frames = buffer.draw(sizes[i])
            if i >= skip:
                x, y = buffer.windows(slots, frames, load_fn)
                buffer.release(slots)
                yield {"x": torch.from_numpy(x), "y": torch.from_numpy(y.astype(np.int64))}
            else:
                buffer.release(slots)

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._resume = (int(state["epoch"]), int(state["batches"]))
