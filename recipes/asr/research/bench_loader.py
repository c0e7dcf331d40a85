"""Peak memory and throughput of the DNN's training loaders as the corpus grows.

    python recipes/asr/research/bench_loader.py --data-dir data/synthetic-default --out docs/benchmarks/loader

Each measurement runs in a fresh Python process (peak RSS is per process: ``ru_maxrss`` after
the run, imports included), draws ``--batches`` training batches and reports frames/s:

- ``memory`` (``--data.loader memory``) on the corpus and on copies of it repeated to each of
  ``--memory-hours`` (a manifest file of repeated cuts with new ids); its memory grows with the
  corpus, so it is measured only where it fits;
- ``stream`` (``--data.loader stream``) on the corpus and on a lazy manifest of its cuts repeated
  to each of ``--stream-hours`` (Lhotse's ``CutSet.repeat`` over the manifest file, new cut ids:
  the same code path as a real manifest of that size, the same speakers and features).

Frames/s counts the loader alone, after ``setup_s`` (``memory``: reading the split into memory;
``stream``: counting the manifest's frames for the epoch's length). Peak RSS of the training
process, and of the reading-ahead worker where there is one (``ru_maxrss`` of the children). Writes ``<out>.json`` and ``<out>.md``.

``--pairs 100000 400000 --batch-size 512`` prints instead how correlated the batches are (pairs of
frames from the same cut per batch) in memory and with each buffer size, from frame counts alone.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]  # the recipe: local/


def _corpus(data_dir: str, hours: float | None) -> tuple[Path, float, int]:
    """The training manifest, its hours, and how many times to repeat it to reach ``hours``."""
    from lhotse import CutSet

    path = Path(data_dir) / "ali" / "train_cuts.jsonl.gz"
    corpus_hours = sum(c.duration for c in CutSet.from_jsonl_lazy(path)) / 3600
    return path, corpus_hours, max(1, round(hours / corpus_hours)) if hours else 1


def _stream(dm, path: Path, times: int, readers: int):
    """The streaming loader of ``dm``'s settings on ``path`` repeated ``times`` (lazily), as rank 0 of 1, epoch 0."""
    from lhotse import CutSet
    from local.dnn.datamodule import batch_bounds
    from local.dnn.stream import StreamingFrameBatches

    hp = dm.hparams
    source = (lambda: CutSet.from_jsonl_lazy(path).repeat(times, preserve_id=False)) if times > 1 else path
    return StreamingFrameBatches(source, dm.load_cut, 8, lambda share, epoch: batch_bounds([share], 0, hp.batch_size),
                                 lambda: 0, lambda: (0, 1), 0, hp.buffer_frames, hp.chunk_seconds,
                                 hp.cut_shuffle_buffer, readers)


def measure(data_dir: str, loader: str, hours: float | None, batches: int, batch_size: int, buffer_frames: int,
            workers: int, readers: int = 0) -> dict:
    """One measurement, in this process."""
    sys.path.insert(0, str(HERE))
    from lhotse import CutSet
    from local.dnn.datamodule import AsrDataModule, ResumableLoader, load_split

    dm = AsrDataModule(data_dir, loader=loader, batch_size=batch_size, buffer_frames=buffer_frames,
                       num_workers=workers, readers=readers if loader == "stream" else 0)
    path, corpus_hours, times = _corpus(data_dir, hours)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        if loader == "memory":
            if times > 1:
                repeated = Path(tmp) / "train_cuts.jsonl.gz"
                CutSet.from_jsonl_lazy(path).repeat(times, preserve_id=False).to_file(repeated)
                path = repeated
            dm.splits["train"] = load_split(path, dm.front_end, "train")
            dl = dm.train_dataloader()
        else:
            dl = ResumableLoader(_stream(dm, path, times, readers), workers)
        epoch_batches = len(dl)  # stream: counts the manifest's frames
        setup_s = time.perf_counter() - start
        start = time.perf_counter()
        frames = drawn = 0
        for batch in dl:
            frames += len(batch["y"])
            drawn += 1
            if drawn == batches:
                break
        seconds = time.perf_counter() - start
    peak = getattr(getattr(dl.dataset, "last_buffer", None), "peak_resident", None)
    return {"loader": loader, "workers": workers, "readers": readers, "hours": round(corpus_hours * times, 2), "repeats": times,
            "epoch_batches": epoch_batches, "batches": drawn, "frames": frames, "setup_s": round(setup_s, 2),
            "seconds": round(seconds, 2), "frames_per_s": round(frames / seconds),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            "worker_peak_rss_mb": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024) if workers or readers else 0,
            "buffer_peak_resident_frames": peak}


def measure_parts(data_dir: str, hours: float | None, batches: int, batch_size: int, buffer_frames: int) -> dict:
    """The streaming loader's two halves timed apart, in this process: reading (one reader's work:
    the sampler's walk over the manifest, then reading, normalising and transforming each cut,
    as ``ChunkReader`` does in a reader process) and splicing (the training process's work with
    ``readers``: the buffer and the windows, over the same chunks read beforehand). With enough
    readers to keep up, the second is the loader's throughput; one reader keeps up when the
    first is the faster."""
    sys.path.insert(0, str(HERE))
    from functools import partial

    import numpy as np
    from local.dnn.datamodule import AsrDataModule
    from local.dnn.stream import ChunkReader, FrameBuffer, _given, in_order

    dm = AsrDataModule(data_dir, loader="stream", batch_size=batch_size, buffer_frames=buffer_frames)
    path, corpus_hours, times = _corpus(data_dir, hours)
    ds = _stream(dm, path, times, readers=0)
    sizes = [end - start for start, end in ds.nominal(0)]
    batches = min(batches, len(sizes))
    need = sum(sizes[:batches]) + buffer_frames  # what the buffer takes in for these batches (and one cut more)
    messages, read = [], 0
    start = time.perf_counter()
    for message in ChunkReader(partial(ds.chunks, 0, 0, 1), dm.load_cut):
        messages.append(message)
        read += len(message[3])
        if read > need:
            break
    reading_s = time.perf_counter() - start
    buffer = FrameBuffer(8, np.random.default_rng([0, 0, 0, 7]), reserve=buffer_frames)
    start = time.perf_counter()
    drawn = ds._batches(buffer, in_order(iter(messages)), _given, sizes, 0, 0)
    frames = sum(len(next(drawn)["y"]) for _ in range(batches))
    splicing_s = time.perf_counter() - start
    return {"hours": round(corpus_hours * times, 2), "batches": batches, "frames": frames,
            "reading_frames_per_s": round(read / reading_s), "splicing_frames_per_s": round(frames / splicing_s),
            "frames_read": read}


def same_cut_pairs(data_dir: str, batch_size: int, buffers: list[int], seed: int = 0) -> dict[str, float]:
    """How correlated each loader's batches are: pairs of frames from the same cut per batch, mean
    over one epoch, from the manifest's frame counts alone (the streaming buffer's draws replayed
    without loading anything; the cut order a uniform shuffle, as Lhotse's reservoir gives when it
    holds the split)."""
    import numpy as np
    from lhotse import CutSet

    sys.path.insert(0, str(HERE))
    from local.dnn.stream import FrameBuffer

    lengths = np.array([c.num_frames for c in CutSet.from_jsonl_lazy(Path(data_dir) / "ali" / "train_cuts.jsonl.gz")])
    rng = np.random.default_rng(seed)
    batches = int(lengths.sum()) // batch_size

    def pairs(cut_ids: np.ndarray) -> int:
        counts = np.unique(cut_ids, return_counts=True)[1]
        return int((counts * (counts - 1) // 2).sum())

    owner = np.repeat(np.arange(len(lengths)), lengths)[rng.permutation(int(lengths.sum()))]
    out = {"memory": float(np.mean([pairs(owner[i * batch_size:(i + 1) * batch_size]) for i in range(batches)]))}
    for size in buffers:
        buffer, order, per_batch = FrameBuffer(0, np.random.default_rng(seed)), iter(rng.permutation(len(lengths))), []
        for _ in range(batches):
            while buffer.pending < size and (cut := next(order, None)) is not None:
                buffer.put(int(cut), int(lengths[cut]))
            slots, _ = buffer.draw(batch_size)
            per_batch.append(pairs(np.array([buffer.keys[s] for s in slots])))
            buffer.release(slots)
        out[f"stream {size}"] = float(np.mean(per_batch))
    return out


def _run_one(data_dir: str, spec: dict) -> dict:
    """One measurement in a fresh Python process (``--one``)."""
    done = subprocess.run([sys.executable, __file__, "--data-dir", data_dir, "--one", json.dumps(spec)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"bench_loader: the measurement {spec} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default="data/synthetic-default", help="a recipe data dir with ali/ (stage 6)")
    parser.add_argument("--out", default="docs/benchmarks/loader", help="writes <out>.json and <out>.md")
    parser.add_argument("--batches", type=int, default=3000, help="training batches drawn per measurement (at most one epoch; the buffer reaches its steady size after about 5 * buffer / batch size batches)")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--buffer-frames", type=int, default=400_000)
    parser.add_argument("--memory-hours", type=float, nargs="*", default=[10.0],
                        help="corpus sizes (hours, by repeating cuts) for the in-memory loader, besides the corpus")
    parser.add_argument("--stream-hours", type=float, nargs="*", default=[100.0, 1000.0],
                        help="corpus sizes (hours, by repeating cuts) for the streaming loader, besides the corpus")
    parser.add_argument("--workers", type=int, nargs="*", default=[0, 1], help="streaming loader worker settings")
    parser.add_argument("--readers", type=int, nargs="*", default=[1, 2],
                        help="streaming loader reader settings (each also measured, with no worker)")
    parser.add_argument("--pairs", type=int, nargs="*", metavar="BUFFER",
                        help="only print how correlated the batches are: pairs of frames from the same cut per batch "
                             "of --batch-size, in memory and with each of these buffer sizes (no timing)")
    parser.add_argument("--parts", action="store_true",
                        help="also time the streaming loader's reading and splicing apart, at each stream size")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: one measurement as JSON
    args = parser.parse_args(argv)
    if args.one:
        spec = json.loads(args.one)
        if spec.pop("parts", False):
            print(json.dumps(measure_parts(args.data_dir, spec["hours"], spec["batches"], spec["batch_size"],
                                           spec["buffer_frames"])))
        else:
            print(json.dumps(measure(args.data_dir, **spec)))
        return 0
    if not (Path(args.data_dir) / "ali" / "train_cuts.jsonl.gz").exists():
        parser.error(f"--data-dir {args.data_dir}: no ali/train_cuts.jsonl.gz; run recipes/asr/prepare.py (stages 0-7)")
    if args.pairs is not None:
        for name, value in same_cut_pairs(args.data_dir, args.batch_size, args.pairs or [args.buffer_frames]).items():
            print(f"{name}: {value:.1f} pairs of frames from the same cut per batch of {args.batch_size}")
        return 0
    plan = [("memory", None, 0), *[("memory", h, 0) for h in args.memory_hours]]
    plan = [(loader, hours, workers, 0) for loader, hours, workers in plan]
    plan += [("stream", h, w, 0) for h in [None, *args.stream_hours] for w in args.workers]
    plan += [("stream", h, 0, r) for h in [None, *args.stream_hours] for r in args.readers if r]
    rows = []
    for loader, hours, workers, readers in plan:
        spec = {"loader": loader, "hours": hours, "batches": args.batches, "batch_size": args.batch_size,
                "buffer_frames": args.buffer_frames, "workers": workers, "readers": readers}
        print(f"bench_loader: {loader} loader, {hours or 'corpus'} h, {workers} workers, {readers} readers ...",
              flush=True)
        row = _run_one(args.data_dir, spec)
        print(f"  {row['hours']} h: {row['frames_per_s']} frames/s, peak RSS {row['peak_rss_mb']} MB, "
              f"setup {row['setup_s']} s", flush=True)
        rows.append(row)
    parts = []
    for hours in [None, *args.stream_hours] if args.parts else []:
        print(f"bench_loader: the streaming loader's reading and splicing apart, {hours or 'corpus'} h ...", flush=True)
        parts.append(_run_one(args.data_dir, {"parts": True, "hours": hours, "batches": args.batches,
                                              "batch_size": args.batch_size, "buffer_frames": args.buffer_frames}))
        print(f"  reading {parts[-1]['reading_frames_per_s']} frames/s, splicing "
              f"{parts[-1]['splicing_frames_per_s']} frames/s", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    command = "python recipes/asr/research/bench_loader.py " + " ".join(argv if argv is not None else sys.argv[1:])
    out.with_suffix(".json").write_text(json.dumps({"command": command, "rows": rows, "parts": parts}, indent=1))
    header = (f"`{command}` ({time.strftime('%Y-%m-%d')}; up to {args.batches} batches of {args.batch_size} frames "
              f"per row, at most one epoch; buffer {args.buffer_frames} frames)")
    columns = ("| loader | workers | readers | corpus (h) | batches | setup (s) | frames/s | peak RSS (MB) | "
               "worker/reader peak RSS (MB) | buffer peak (frames) |")
    lines = ["# The data loader: memory against streaming", "", header, "", columns, "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['loader']} | {r['workers']} | {r['readers']} | {r['hours']} | {r['batches']} | {r['setup_s']} | {r['frames_per_s']:,} | "
                     f"{r['peak_rss_mb']:,} | {r['worker_peak_rss_mb'] or ''} | {r['buffer_peak_resident_frames'] or ''} |")
    if parts:
        lines += ["", ("The streaming loader's two halves apart, one process each (`measure_parts`): reading = one "
                       "reader's work, splicing = the training process's work with readers, over chunks read beforehand."),
                  "", "| corpus (h) | batches | frames read | reading frames/s | splicing frames/s |", "|---|---|---|---|---|"]
        lines += [f"| {r['hours']} | {r['batches']} | {r['frames_read']:,} | {r['reading_frames_per_s']:,} | "
                  f"{r['splicing_frames_per_s']:,} |" for r in parts]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
