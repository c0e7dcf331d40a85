"""Frame windows, rank sharding and batch layout of the DNN data module (no corpus needed)."""

import numpy as np
import pytest
import torch
from local.dnn.datamodule import FrameBatches, batch_bounds, shard_batches, splice


def test_splice_repeats_edge_frames_at_utterance_boundaries():
    # two utterances: frames 0..2 (values 0,1,2) and 3..7 (values 10..14); F = 1, context 2
    feats = np.array([0, 1, 2, 10, 11, 12, 13, 14], dtype=np.float32)[:, None]
    offsets = np.array([0, 3, 8])
    got = splice(feats, offsets, np.array([0, 2, 3, 5, 7]), context=2)
    want = np.array([
        [0, 0, 0, 1, 2],  # first frame of utterance 1: left edge repeated
        [0, 1, 2, 2, 2],  # last frame of utterance 1: never reaches into utterance 2
        [10, 10, 10, 11, 12],  # first frame of utterance 2: never reaches back into utterance 1
        [10, 11, 12, 13, 14],
        [12, 13, 14, 14, 14],
    ], dtype=np.float32)
    np.testing.assert_array_equal(got, want)


def test_splice_is_frame_major_for_several_bins():
    feats = np.arange(12, dtype=np.float32).reshape(6, 2)  # one utterance, F = 2
    got = splice(feats, np.array([0, 6]), np.array([0, 3]), context=1)
    np.testing.assert_array_equal(got, [[0, 1, 0, 1, 2, 3], [4, 5, 6, 7, 8, 9]])
    assert got.shape == (2, 3 * 2) and got.dtype == np.float32


def test_splice_single_frame_utterance():
    feats = np.array([[5.0], [7.0], [8.0]], dtype=np.float32)
    got = splice(feats, np.array([0, 1, 3]), np.array([0]), context=8)
    np.testing.assert_array_equal(got, np.full((1, 17), 5.0))


@pytest.mark.parametrize("num_frames,world,batch", [(1000, 1, 64), (1001, 2, 64), (1003, 4, 50), (7, 3, 100)])
def test_shards_are_disjoint_complete_and_equal_in_batches(num_frames, world, batch):
    per_rank = [shard_batches(num_frames, r, world, batch, seed=3, epoch=1) for r in range(world)]
    assert len({len(b) for b in per_rank}) == 1, "every rank must see the same number of batches"
    frames = np.concatenate([np.concatenate(b) for b in per_rank])
    assert len(frames) == num_frames and len(np.unique(frames)) == num_frames
    assert all(len(b) > 0 for batches in per_rank for b in batches)


def test_shuffle_is_deterministic_and_changes_with_epoch():
    a = np.concatenate(shard_batches(500, 1, 2, 32, seed=0, epoch=0))
    np.testing.assert_array_equal(a, np.concatenate(shard_batches(500, 1, 2, 32, seed=0, epoch=0)))
    assert not np.array_equal(a, np.concatenate(shard_batches(500, 1, 2, 32, seed=0, epoch=1)))
    assert not np.array_equal(a, np.concatenate(shard_batches(500, 1, 2, 32, seed=1, epoch=0)))
    assert not np.array_equal(a, np.sort(a)), "frames must be shuffled across utterances"


def test_dev_order_is_not_shuffled():
    batches = shard_batches(10, 0, 2, 2, seed=0, epoch=0, shuffle=False)
    np.testing.assert_array_equal(np.concatenate(batches), [0, 2, 4, 6, 8])


def test_gentle_start_uses_small_batches_first():
    bounds = batch_bounds([100, 101], rank=1, batch_size=32, warmup_frames=20, warmup_batch_size=8)
    sizes = [b - a for a, b in bounds]
    assert sizes == [8, 8, 4, 32, 32, 17]  # warm-up part, then full batches; rank 1's extra frame at the end
    assert bounds[0][0] == 0 and all(bounds[i][1] == bounds[i + 1][0] for i in range(len(bounds) - 1))


def test_a_last_batch_of_a_few_frames_joins_the_one_before():
    # 7 frames after 731 full batches (the Kaldi data dir whose DNN the 7-frame step left at chance): one batch
    bounds = batch_bounds([731 * 512 + 7], rank=0, batch_size=512)
    assert len(bounds) == 731 and bounds[-1] == (730 * 512, 731 * 512 + 7)
    # a quarter of a batch or more stays a batch of its own (the default corpus: 136 of 512, 68 of 256 per rank)
    assert [b - a for a, b in batch_bounds([1647 * 512 + 136], 0, 512)][-2:] == [512, 136]
    per_rank = [shard_batches(843_400, r, 2, 256, seed=0, epoch=0) for r in range(2)]
    assert [len(b) for b in per_rank] == [1648, 1648] and [len(b[-1]) for b in per_rank] == [68, 68]
    # every rank merges alike, and every frame is still in one batch
    per_rank = [shard_batches(2 * (40 * 64 + 5) + 1, r, 2, 64, seed=0, epoch=0) for r in range(2)]
    assert [len(b) for b in per_rank] == [40, 40] and [len(b[-1]) for b in per_rank] == [70, 69]
    frames = np.concatenate([np.concatenate(b) for b in per_rank])
    assert len(np.unique(frames)) == len(frames) == 2 * (40 * 64 + 5) + 1
    assert len(batch_bounds([5], 0, 64)) == 1  # a shard smaller than a batch is one batch


def test_too_many_ranks_raise():
    with pytest.raises(ValueError, match="no training frames"):
        shard_batches(2, 0, 3, 8, seed=0, epoch=0)


def test_frame_batches_schema_and_epoch_reshuffle():
    feats = np.random.default_rng(0).standard_normal((50, 4)).astype(np.float32)
    targets = np.arange(50, dtype=np.int32)
    offsets = np.array([0, 20, 50])
    epoch = [0]
    ds = FrameBatches(feats, targets, offsets, 8,
                      lambda e: shard_batches(50, 0, 1, 16, seed=0, epoch=e), lambda: epoch[0])
    batches = list(ds)
    assert len(ds) == len(batches) == 3 and len(batches[-1]["y"]) == 18  # the last 2 frames join the third batch
    x, y = batches[0]["x"], batches[0]["y"]
    assert x.shape == (16, 17 * 4) and x.dtype == torch.float32 and y.shape == (16,) and y.dtype == torch.int64
    # the centre frame of each window is the labelled frame
    np.testing.assert_array_equal(x[:, 8 * 4:9 * 4].numpy(), feats[y.numpy()])
    epoch[0] = 1
    assert not torch.equal(next(iter(ds))["y"], y)
