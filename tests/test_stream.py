"""The streaming frame loader (``local.dnn.stream``): coverage, equal batch counts, determinism,
mid-epoch resume, bounded memory, and training through it (1 process and 2 forked ranks)."""

from pathlib import Path

import numpy as np
import pytest
import torch
from lhotse import CutSet
from local.dnn.datamodule import AsrDataModule, ResumableLoader, batch_bounds, splice
from local.dnn.stream import FrameBuffer, StreamingFrameBatches, even_split
from test_train import ROOT, _run, write_aligned_dir


@pytest.fixture(scope="module")
def aligned(tmp_path_factory) -> Path:
    return write_aligned_dir(tmp_path_factory.mktemp("stream") / "d", {"train": 40, "dev": 8})


def tagged(cut) -> tuple[np.ndarray, np.ndarray]:
    """Frames that say where they come from: bin 0 the cut's number, bin 1 the frame's index."""
    n = cut.num_frames
    feats = np.stack([np.full(n, int(cut.id.split("-")[-1].split("_")[0])), np.arange(n)], 1)
    return feats.astype(np.float32), np.arange(n, dtype=np.int32)


def dataset(cuts, rank=0, world=1, epoch=0, seed=0, batch=16, buffer=64, load_fn=tagged, context=0, readers=0):
    def layout(share, ep):
        return batch_bounds([share], 0, batch)

    return StreamingFrameBatches(cuts, load_fn, context, layout, lambda: epoch, lambda: (rank, world), seed,
                                 buffer_frames=buffer, chunk_seconds=0.3, cut_shuffle_buffer=8, readers=readers)


def frames_of(batches) -> list[tuple[int, int]]:
    return [(int(c), int(f)) for b in batches for c, f in b["x"].numpy().reshape(-1, 2)]


def test_buffer_draws_every_frame_once_and_splices_like_the_in_memory_loader():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 30, size=60)
    data = [rng.standard_normal((n, 3)).astype(np.float32) for n in lengths]
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    feats = np.concatenate(data)
    buf = FrameBuffer(context=2, rng=np.random.default_rng(1))
    loaded, drawn, cuts = [], [], iter(range(len(data)))
    while True:  # keep about 40 frames undrawn, draw 7 at a time: many loads, frees and compactions
        while buf.pending < 40 and (c := next(cuts, None)) is not None:
            buf.put(c, int(lengths[c]))
        if buf.pending == 0:
            break
        slots, frames = buf.draw(min(7, buf.pending))
        x, y = buf.windows(slots, frames, lambda c: (loaded.append(c), (data[c], np.full(len(data[c]), c)))[1])
        cut_of = y.astype(np.int64)
        np.testing.assert_array_equal(x, splice(feats, offsets, offsets[cut_of] + frames, 2))
        drawn += list(zip(cut_of.tolist(), frames.tolist(), strict=True))
        buf.release(slots)
    assert sorted(drawn) == [(c, f) for c in range(len(data)) for f in range(lengths[c])]
    assert sorted(loaded) == list(range(len(data))), "each cut is read once"
    assert buf.resident == 0 and buf.free != [] and buf.peak_resident < feats.shape[0] / 2


@pytest.mark.parametrize("world", [1, 2, 3])
def test_ranks_cover_the_split_once_with_equal_batch_counts(aligned, world):
    cuts = aligned / "ali" / "train_cuts.jsonl.gz"
    per_rank = [list(dataset(cuts, rank=r, world=world)) for r in range(world)]
    assert len({len(b) for b in per_rank}) == 1, "every rank must draw the same number of batches"
    assert len(per_rank[0]) == len(dataset(cuts, world=world))
    got = sorted(f for batches in per_rank for f in frames_of(batches))
    want = sorted((int(c.id.split("-")[-1]), f) for c in CutSet.from_file(cuts) for f in range(c.num_frames))
    assert got == want
    sizes = [len(b["y"]) for batches in per_rank for b in batches]
    assert min(sizes) >= 1 and max(sizes) <= 16 + 16, sizes


def test_even_split():
    assert even_split(10, 3) == [4, 3, 3] and sum(even_split(1001, 17)) == 1001


def test_deterministic_per_seed_and_epoch_and_resumes_mid_epoch(aligned):
    cuts = aligned / "ali" / "train_cuts.jsonl.gz"
    full = frames_of(dataset(cuts, epoch=1))
    assert full == frames_of(dataset(cuts, epoch=1))
    assert full != frames_of(dataset(cuts, epoch=0)) and full != frames_of(dataset(cuts, epoch=1, seed=5))
    batches = list(dataset(cuts, epoch=1))
    resumed = dataset(cuts, epoch=1)
    resumed.load_state_dict({"epoch": 1, "batches": 7})
    rest = list(resumed)
    assert len(rest) == len(batches) - 7
    for a, b in zip(rest, batches[7:], strict=True):
        assert torch.equal(a["x"], b["x"]) and torch.equal(a["y"], b["y"])
    bad = dataset(cuts, epoch=1)
    bad.load_state_dict({"epoch": 1, "batches": 10_000})
    with pytest.raises(ValueError, match="past this run's"):
        list(bad)


def test_memory_is_bounded_by_the_buffer_not_the_manifest(aligned):
    path = aligned / "ali" / "train_cuts.jsonl.gz"
    peaks = {}
    for times in (1, 12):
        ds = dataset(lambda t=times: CutSet.from_jsonl_lazy(path).repeat(t, preserve_id=False), buffer=64)
        n = sum(len(b["y"]) for b in ds)
        assert n == times * sum(c.num_frames for c in CutSet.from_file(path))
        peaks[times] = ds.last_buffer.peak_resident
    assert peaks[12] <= 2 * peaks[1] + 40, peaks  # 12x the frames, the same bound (+ one cut)
    assert peaks[12] < n / 10


@pytest.mark.parametrize("workers", [0, 1])
def test_loader_position_is_counted_where_batches_are_consumed(aligned, workers):
    cuts = aligned / "ali" / "train_cuts.jsonl.gz"
    everything = list(dataset(cuts, epoch=2))
    loader = ResumableLoader(dataset(cuts, epoch=2), num_workers=workers)
    it = iter(loader)
    for _ in range(5):
        next(it)
    state = loader.state_dict()
    assert state == {"epoch": 2, "batches": 5}
    again = ResumableLoader(dataset(cuts, epoch=2), num_workers=workers)
    again.load_state_dict(state)
    rest = list(again)
    assert [b["x"].tolist() for b in rest] == [b["x"].tolist() for b in everything[5:]]
    assert again.state_dict() == {"epoch": 2, "batches": len(everything)}


def test_bad_settings_name_the_fix(aligned):
    with pytest.raises(ValueError, match="mfcc_fmllr"):
        AsrDataModule(str(aligned), features="mfcc_fmllr", loader="stream")
    with pytest.raises(ValueError, match="num_workers=2"):
        AsrDataModule(str(aligned), num_workers=2)
    with pytest.raises(ValueError, match="buffer_frames=0"):
        AsrDataModule(str(aligned), loader="stream", buffer_frames=0)
    with pytest.raises(ValueError, match="readers=2 with num_workers=1"):
        AsrDataModule(str(aligned), loader="stream", readers=2, num_workers=1)
    with pytest.raises(ValueError, match="readers=1.*not 'memory'"):
        AsrDataModule(str(aligned), readers=1)
    with pytest.raises(ValueError, match="readers=-1"):
        dataset(aligned / "ali" / "train_cuts.jsonl.gz", readers=-1)
    with pytest.raises(ValueError, match="No such file"):
        dataset(aligned / "nothing.jsonl.gz")
    errors = []  # 40 cuts of 5-40 frames over 30 ranks: some shares hold fewer frames than the batches
    for rank in range(30):
        try:
            list(dataset(aligned / "ali" / "train_cuts.jsonl.gz", world=30, rank=rank, batch=1, buffer=1))
        except ValueError as exc:
            errors.append(str(exc))
    assert errors and all("too few or too long" in e and "--data.loader memory" in e for e in errors)


def test_streamed_frames_match_the_in_memory_loader(aligned):
    mem = AsrDataModule(str(aligned), batch_size=16)
    mem.setup("fit")
    feats, _, offsets = mem.splits["train"]
    stream = AsrDataModule(str(aligned), batch_size=16, loader="stream", buffer_frames=50, chunk_seconds=0.3)
    stream.setup("fit")
    assert "train" not in stream.splits
    x = torch.cat([b["x"] for b in stream.train_dataloader()]).numpy()
    want = splice(feats, offsets, np.arange(len(feats)), 8)  # the same windows, in another order
    assert x.shape == want.shape
    key = lambda a: np.lexsort(a.T[::-1])
    np.testing.assert_array_equal(x[key(x)], want[key(want)])


@pytest.mark.parametrize("strategy,devices,readers", [("single", 1, 0), ("gtc_fork", 2, 0), ("single", 1, 2)])
def test_training_streams(aligned, tmp_path, strategy, devices, readers):
    args = ["--config", str(ROOT / "conf" / "tiny.yaml"), "--data.data_dir", str(aligned), "--exp_dir",
            str(tmp_path), "--trainer.max_epochs", "2", "--trainer.limit_train_batches", "null", "--data.loader", "stream", "--data.buffer_frames", "200",
            "--data.chunk_seconds", "0.5", "--num_threads", "1", "--data.readers", str(readers)]
    args += ["--strategy", "single"] if devices == 1 else ["--trainer.strategy", strategy, "--trainer.devices", "2"]
    summary = _run(args)
    assert summary["world_size"] == devices and len(summary["dev_frame_acc"]) == 2
    per_epoch = len(dataset(aligned / "ali" / "train_cuts.jsonl.gz", world=devices, batch=32))
    assert summary["data"]["loader"] == "stream" and summary["global_steps"] == 2 * per_epoch > 2, summary


def test_training_with_readers_on_two_forked_ranks_learns_what_it_learns_without(aligned, tmp_path):
    results = []
    for readers in (0, 1):
        args = ["--config", str(ROOT / "conf" / "tiny.yaml"), "--data.data_dir", str(aligned), "--exp_dir",
                str(tmp_path / str(readers)), "--trainer.max_epochs", "2", "--trainer.limit_train_batches", "null",
                "--data.loader", "stream", "--data.buffer_frames", "200", "--data.chunk_seconds", "0.5",
                "--num_threads", "1", "--trainer.strategy", "gtc_fork", "--trainer.devices", "2",
                "--data.readers", str(readers)]
        results.append(_run(args))
    assert results[0]["dev_frame_acc"] == results[1]["dev_frame_acc"]
    assert results[0]["global_steps"] == results[1]["global_steps"] > 2


def test_both_loaders_put_numpys_blas_on_one_thread(aligned):
    """The per-cut front-end products must not compete with torch's threads (``one_blas_thread``)."""
    from threadpoolctl import threadpool_info, threadpool_limits

    def blas_threads():
        return {lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"}

    if not blas_threads():
        pytest.skip("numpy has no BLAS that threadpoolctl can see")
    threadpool_limits(limits=2, user_api="blas")
    assert blas_threads() == {2}
    AsrDataModule(str(aligned), batch_size=16).setup("fit")  # reads the splits into memory
    assert blas_threads() == {1}
    stream = AsrDataModule(str(aligned), batch_size=16, loader="stream", buffer_frames=50, chunk_seconds=0.3)
    stream.setup("fit")
    threadpool_limits(limits=2, user_api="blas")
    next(iter(stream.train_dataloader()))  # streams the training split
    assert blas_threads() == {1}


def test_bench_loader_measures_each_loader_in_its_own_process(aligned, tmp_path):
    """One process per measurement, five in all (their start-ups are the test's time): the in-memory
    loader; the streaming loader with one reader process, on the corpus and on its cuts repeated to
    0.05 h (``--workers`` empty: no row reading in the training process, whose batches
    test_readers_give_the_batches_of_reading_in_process_and_resume_alike shows are the readers'); and
    the streaming loader's reading and splicing halves apart (these read in process) at each size."""
    import json

    import bench_loader

    out = tmp_path / "loader"
    assert bench_loader.main(["--data-dir", str(aligned), "--out", str(out), "--batches", "4", "--batch-size", "16",
                              "--buffer-frames", "50", "--memory-hours", "--stream-hours", "0.05", "--workers",
                              "--readers", "1", "--parts"]) == 0
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    hours = sum(c.duration for c in CutSet.from_file(aligned / "ali" / "train_cuts.jsonl.gz")) / 3600
    times = round(0.05 / hours)
    assert [(r["loader"], r["repeats"], r["readers"]) for r in rows] == [("memory", 1, 0), ("stream", 1, 1),
                                                                          ("stream", times, 1)]
    for r in rows:
        assert r["batches"] == 4 and r["frames"] == 4 * 16 and r["frames_per_s"] > 0 and r["peak_rss_mb"] > 100
    assert rows[0]["epoch_batches"] == rows[1]["epoch_batches"]  # the same split, laid out alike
    assert abs(rows[2]["epoch_batches"] - times * rows[1]["epoch_batches"]) <= times  # counted on the repeats
    assert 0 < rows[2]["buffer_peak_resident_frames"] < 20 * 50
    assert rows[0]["worker_peak_rss_mb"] == 0 and rows[1]["worker_peak_rss_mb"] > 0 and rows[2]["worker_peak_rss_mb"] > 0
    parts = json.loads(out.with_suffix(".json").read_text())["parts"]
    assert [p["hours"] for p in parts] == [rows[1]["hours"], rows[2]["hours"]]
    for part in parts:  # the splicing half drew the batches of the measured rows from what the reading half read
        assert part["batches"] == 4 and part["frames"] == 4 * 16 and part["frames_read"] > 4 * 16 + 50
        assert part["reading_frames_per_s"] > 0 and part["splicing_frames_per_s"] > 0
    table = out.with_suffix(".md").read_text()
    assert table.count("\n| stream | 0 | 1 |") == 2 and "\n| stream | 0 | 0 |" not in table


def test_a_small_buffer_makes_more_correlated_batches(aligned):
    import bench_loader

    pairs = bench_loader.same_cut_pairs(str(aligned), 16, [20, 10**6])
    assert pairs["stream 20"] > 2 * pairs["memory"] > 0  # a batch from a buffer of about one cut
    assert pairs["stream 1000000"] < 1.5 * pairs["memory"]  # a buffer of the whole split: a full shuffle


@pytest.mark.parametrize("readers", [1, 3])
def test_readers_give_the_batches_of_reading_in_process_and_resume_alike(aligned, readers):
    """Chunks read by 1 or 3 processes come back in the sampler's order: the same batches, bit for bit,
    on every rank, and a mid-epoch resume replays them the same way."""
    cuts = aligned / "ali" / "train_cuts.jsonl.gz"
    dm = AsrDataModule(str(aligned), batch_size=16, loader="stream")
    for rank in (0, 1):
        want = list(dataset(cuts, rank=rank, world=2, epoch=1, load_fn=dm.load_cut, context=2))
        got = list(dataset(cuts, rank=rank, world=2, epoch=1, load_fn=dm.load_cut, context=2, readers=readers))
        assert len(got) == len(want) > 5
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a["x"], b["x"]) and torch.equal(a["y"], b["y"])
    resumed = dataset(cuts, rank=1, world=2, epoch=1, load_fn=dm.load_cut, context=2, readers=readers)
    resumed.load_state_dict({"epoch": 1, "batches": 4})
    rest = list(resumed)
    for a, b in zip(rest, want[4:], strict=True):
        assert torch.equal(a["x"], b["x"]) and torch.equal(a["y"], b["y"])
    it = iter(dataset(cuts, epoch=1, readers=readers))  # left after one batch: its readers stop
    next(it)
    it.close()


def short_features(cut) -> tuple[np.ndarray, np.ndarray]:
    feats, targets = tagged(cut)
    return feats[:-1], targets


def test_a_readers_error_names_the_cut(aligned):
    with pytest.raises(ValueError, match="its features have .* re-run stage 6"):
        list(dataset(aligned / "ali" / "train_cuts.jsonl.gz", load_fn=short_features, readers=1))


def test_pdf_alignments_are_read_as_lhotse_reads_them(aligned, tmp_path):
    from lhotse.features.io import NumpyFilesWriter
    from local.dnn.datamodule import load_pdf_ali

    cuts = list(CutSet.from_file(aligned / "ali" / "train_cuts.jsonl.gz"))
    for cut in cuts:
        got, want = load_pdf_ali(cut), cut.load_custom("pdf_ali")
        assert got.dtype == want.dtype == np.int32 and np.array_equal(got, want)
    with NumpyFilesWriter(tmp_path / "other") as writer:  # int64, and a 2-D array (through Lhotse)
        for value in (np.arange(7, dtype=np.int64) * 10**10, np.arange(6, dtype=np.int32).reshape(3, 2)):
            cut = cuts[0].with_custom("pdf_ali", writer.store_array(f"a{value.ndim}", value, frame_shift=0.01,
                                                                     temporal_dim=0))
            got = load_pdf_ali(cut)
            assert got.dtype == value.dtype and np.array_equal(got, value)
