"""train.py's faults: resuming from its own command (``--ckpt_path``, checkpoints every N steps)
bit-exactly, a rank lost mid-training (SIGKILL, SIGSTOP) on a 2-rank popen run, and bad input to
the entry point (corrupt or foreign checkpoints, data dirs, strategy names). On the tiny corpus
(``tiny_aligned``) with ``conf/tiny.yaml``: 4 batches per epoch."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import train
from _strategy_helpers import keep_master_port  # noqa: F401  (autouse: the fork launcher sets MASTER_PORT)
from lightning.pytorch import Callback

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "conf" / "tiny.yaml"
STEPS = 12  # 3 epochs x 4 batches (conf/tiny.yaml: limit_train_batches 4)


class Interrupt(Callback):
    """Fails the run when step ``at`` starts: the run dies as a killed one would, after the
    checkpoint of the step before (if one was due) and before this step changes anything."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.at:
            raise RuntimeError(f"interrupted at step {self.at}")


class FinalState(Callback):
    """Every rank saves its parameters, optimizer state and GTC residuals when training ends."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = Path(out_dir)

    def on_train_end(self, trainer, pl_module):
        state = getattr(trainer.strategy, "gtc_state", None)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        torch.save({
            "step": trainer.global_step,
            "params": [p.detach().clone() for p in pl_module.parameters()],
            "optimizer": trainer.optimizers[0].state_dict(),
            "residual": state.residual_vector().clone() if state is not None else None,
            "dev_acc_history": list(pl_module.dev_acc_history),
        }, self.out_dir / f"rank{trainer.global_rank}.pt")


def _common(data_dir: Path, strategy: str) -> list[str]:
    run = ["--strategy", "single"] if strategy == "single" else ["--trainer.strategy", strategy,
                                                                 "--trainer.devices", "2"]
    return ["--config", str(TINY), "--data.data_dir", str(data_dir), "--num_threads", "1", "--run_name", "r",
            "--checkpoint_every_n_steps", "3", "--trainer.max_epochs", "3", *run]


def _fit(args: list[str], *callbacks: Callback) -> train.AsrCLI:
    cli = train.build_cli(args)
    cli.trainer.callbacks.extend(callbacks)
    train.fit(cli)
    return cli


# (strategy, step at which the first run dies, step of the checkpoint it leaves): checkpoints every
# 3 steps and at epoch ends (steps 4, 8, 12); dying at step 6 leaves step 6's, mid-epoch 1 (2 of 4
# batches drawn); dying at step 5 leaves the end of epoch 0 (step 4). ma/bmuf/dpsgd/gtc_stale: the
# strategies whose ranks differ between syncs or apply updates late; bmuf_gtc needs 4 processes
# (its resume is in tests/test_compat.py).
CASES = [("single", 6, 6), ("single", 5, 4), ("ddp_fork", 6, 6), ("gtc_fork", 6, 6), ("gtc_stale_fork", 6, 6),
         ("ma_fork", 6, 6), ("bmuf_fork", 6, 6), ("dpsgd_fork", 6, 6)]


# the streaming loader (local/dnn/stream.py), in the training process and with a reading-ahead worker
STREAM = ["--data.loader", "stream", "--data.buffer_frames", "300", "--data.chunk_seconds", "1"]
STREAM_CASES = [("single", 6, 6, STREAM + ["--data.num_workers", "1"]), ("gtc_fork", 6, 6, STREAM)]


@pytest.mark.parametrize("strategy,dies_at,saved_at", CASES, ids=[f"{c[0]}-dies-at-{c[1]}" for c in CASES])
def test_resume_continues_bit_exactly(strategy, dies_at, saved_at, tiny_aligned, tmp_path):
    """12 steps straight == a run killed at step ``dies_at`` + ``--ckpt_path last``, bit for bit on every
    rank: parameters, optimizer state, learning rate, dev accuracy history, GTC residuals."""
    check_resume(strategy, dies_at, saved_at, tiny_aligned, tmp_path, [])


@pytest.mark.parametrize("strategy,dies_at,saved_at,extra", STREAM_CASES, ids=["single-worker", "gtc_fork"])
def test_resume_continues_bit_exactly_when_streaming(strategy, dies_at, saved_at, extra, tiny_aligned, tmp_path):
    check_resume(strategy, dies_at, saved_at, tiny_aligned, tmp_path, extra)


def test_resume_of_ddp_on_4_ranks_is_bit_exact(tiny_aligned, tmp_path):
    """With more than 2 ranks DDP's sums depend on each gradient's place in its bucket, and DDP lays
    the buckets out anew after its first step: the resumed run's first step differed in the last
    bits until train.OneBucketLayout made the layout the same in every run."""
    check_resume("ddp_fork", 6, 6, tiny_aligned, tmp_path, ["--trainer.devices", "4"])


def check_resume(strategy: str, dies_at: int, saved_at: int, tiny_aligned: Path, tmp_path: Path,
                 extra: list[str]) -> None:
    common = _common(tiny_aligned, strategy) + extra
    _fit(common + ["--exp_dir", str(tmp_path / "straight")], FinalState(tmp_path / "straight_state"))

    with pytest.raises(Exception) as died:
        _fit(common + ["--exp_dir", str(tmp_path / "resumed")], Interrupt(dies_at))
    assert f"interrupted at step {dies_at}" in str(died.value)
    last = tmp_path / "resumed" / "r" / "checkpoints" / "last.ckpt"
    ckpt = torch.load(last, map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == saved_at
    loader = ckpt["loops"]["fit_loop"]["state_dict"].get("combined_loader")
    if saved_at % 4:  # mid-epoch: the loader says where it stopped
        assert loader == [{"epoch": saved_at // 4, "batches": saved_at % 4}]

    _fit(common + ["--exp_dir", str(tmp_path / "resumed"), "--ckpt_path", "last"], FinalState(tmp_path / "resumed_state"))
    ranks = 1 if strategy == "single" else 2
    for run in ("straight", "resumed"):
        only_the_last_checkpoint(tmp_path / run / "r" / "checkpoints", ranks)
    for rank in range(ranks):
        a = torch.load(tmp_path / "straight_state" / f"rank{rank}.pt", weights_only=False)
        b = torch.load(tmp_path / "resumed_state" / f"rank{rank}.pt", weights_only=False)
        assert a["step"] == b["step"] == STEPS
        for pa, pb in zip(a["params"], b["params"], strict=True):
            assert torch.equal(pa, pb), f"rank {rank}: parameters differ after the resume"
        assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]  # the halved learning rate
        assert a["optimizer"]["state"].keys() == b["optimizer"]["state"].keys()
        for key, sa in a["optimizer"]["state"].items():
            for name, va in sa.items():
                assert torch.equal(torch.as_tensor(va), torch.as_tensor(b["optimizer"]["state"][key][name]))
        if a["residual"] is not None:
            assert torch.equal(a["residual"], b["residual"]), f"rank {rank}: GTC residuals differ"
            assert a["residual"].abs().sum() > 0
        assert a["dev_acc_history"] == b["dev_acc_history"] and len(a["dev_acc_history"]) == 3
    # metrics.csv keeps the first part's rows (Lightning's CSV logger would delete them)
    rows = {run: (tmp_path / run / "r" / "metrics.csv").read_text().splitlines() for run in ("straight", "resumed")}
    # (rows logged after the last checkpoint by the dead run are logged again by the resumed one)
    assert len(rows["straight"]) <= len(rows["resumed"]) <= len(rows["straight"]) + 2
    assert rows["resumed"][0] == rows["straight"][0]  # the same columns
    step = rows["resumed"][0].split(",").index("step")
    assert rows["resumed"][1].split(",")[step] == "0"  # the first part's rows are still there


def only_the_last_checkpoint(folder: Path, ranks: int) -> None:
    """``last.ckpt``, the checkpoint it links to and that one's shard folders (one shard per rank):
    every rank removed its shards of the checkpoints replaced before (the strategies remove each
    rank's own, so rank 0 alone left the others' behind)."""
    target = (folder / "last.ckpt").readlink().name
    left = sorted(p.name for p in folder.iterdir())
    assert all(name in ("last.ckpt", target) or name.startswith(f"{target}.") for name in left), left
    for shards in folder.glob(f"{target}.*"):
        assert sorted(p.name for p in shards.iterdir()) == [f"rank{r}.pt" for r in range(ranks)], shards


def test_checkpoint_option_every_n_steps_and_epoch_ends(tiny_aligned, tmp_path):
    """``--checkpoint_every_n_steps 0`` writes last.ckpt at epoch ends only; a negative value is refused."""
    common = _common(tiny_aligned, "single") + ["--exp_dir", str(tmp_path)]
    saved = []

    class Saves(Callback):
        def on_save_checkpoint(self, trainer, pl_module, checkpoint):
            saved.append(trainer.global_step)

    _fit(common + ["--checkpoint_every_n_steps", "0"], Saves())
    assert saved == [4, 8, 12]
    saved.clear()
    shutil.rmtree(tmp_path / "r")
    _fit(common + ["--checkpoint_every_n_steps", "3"], Saves())
    assert saved == [3, 4, 6, 8, 9, 12, 12]  # step 12 ends epoch 2: rewritten after validation and the LR update
    with pytest.raises(train.RecipeError, match="--checkpoint_every_n_steps -1"):
        train.build_cli(common + ["--checkpoint_every_n_steps", "-1"])


# ---- a rank lost mid-training ----------------------------------------------------------------

def _popen_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (
        "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "RANK", "RECIPE_RESUME_COMMAND")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def test_a_store_that_refuses_is_known_gone_at_once(monkeypatch):
    """A rank that lost rank 0 asks its store's address first: a refused connection (nothing listens: the
    process that held the store has ended) is the answer at once, instead of a store client's retries until
    its timeout; a listening store, or a bad address, leaves the question to the probe through the store."""
    import socket
    from types import SimpleNamespace

    watch = SimpleNamespace(probe_timeout=2.0)
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(port))
        assert train.RankWatch._store_refuses(watch) is None
    started = time.monotonic()
    assert "connection refused" in train.RankWatch._store_refuses(watch)  # the port is closed now
    assert time.monotonic() - started < 1.0
    monkeypatch.setenv("MASTER_PORT", "not a port")
    assert train.RankWatch._store_refuses(watch) is None


def test_rank_0_waits_for_the_ranks_it_launched(caplog):
    """After a finished fit rank 0 waits for the popen launcher's ranks: each is reaped (its CPU then counts
    in a shell's ``time`` of the command); one still running at the timeout is named and left; a rank that
    exited non-zero is named."""
    quick = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    failed = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    start = time.monotonic()
    with caplog.at_level("WARNING", logger="train"):
        train.wait_for_ranks([quick, failed], timeout=30)
    assert quick.returncode == 0 and failed.returncode == 3 and time.monotonic() - start < 10
    assert f"rank process {failed.pid} exited with code 3" in caplog.text
    caplog.clear()
    stuck = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = time.monotonic()
        with caplog.at_level("WARNING", logger="train"):
            train.wait_for_ranks([stuck], timeout=0.5)
        assert time.monotonic() - start < 5 and stuck.poll() is None
        assert f"rank process {stuck.pid} still running 0 s after training finished" in caplog.text
    finally:
        stuck.kill()
        stuck.wait()


def test_two_rank_run_ends_with_its_last_rank(tiny_aligned, tmp_path):
    """``train.py --strategy gtc`` (popen launcher): when the command returns, rank 1 has exited and been
    reaped by rank 0 (no process of its pid is left)."""
    cmd = [sys.executable, str(ROOT / "recipes" / "asr" / "train.py"), "--config", str(TINY), "--strategy", "gtc",
           "--data.data_dir", str(tiny_aligned), "--exp_dir", str(tmp_path / "exp"), "--num_threads", "1",
           "--trainer.max_epochs", "1"]
    res = subprocess.run(cmd, cwd=tmp_path, env=_popen_env(), capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    pid = int(re.search(r"rank 1 of 2: pid (\d+)", res.stdout + res.stderr).group(1))
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@pytest.mark.parametrize("how,victim", [("SIGKILL", 1), ("SIGKILL", 0), ("SIGSTOP", 1)])
def test_lost_rank_stops_the_other_with_its_name(how, victim, tiny_aligned, tmp_path):
    """``train.py --strategy gtc`` (2 ranks, popen launcher) runs; one rank gets SIGKILL (dies) or
    SIGSTOP (hangs). The survivor must exit within ``--collective_timeout`` (10 s) plus a margin,
    name the lost rank and print the command that resumes the run; rank 0 exits non-zero."""
    timeout = 10
    cmd = [sys.executable, str(ROOT / "recipes" / "asr" / "train.py"), "--config", str(TINY), "--strategy", "gtc",
           "--data.data_dir", str(tiny_aligned), "--exp_dir", str(tmp_path / "exp"), "--num_threads", "1",
           "--trainer.max_epochs", "100000", "--checkpoint_every_n_steps", "5", "--collective_timeout", str(timeout)]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=_popen_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True)
    reader.start()
    pids: dict[int, int] = {}
    try:
        ckpt = tmp_path / "exp" / "gtc" / "checkpoints" / "last.ckpt"
        deadline = time.monotonic() + 90
        while not (len(pids) == 2 and ckpt.exists()):  # both ranks up and training (a checkpoint written)
            assert proc.poll() is None and time.monotonic() < deadline, "".join(out)[-3000:]
            pids = {int(r): int(p) for r, p in re.findall(r"rank (\d) of 2: pid (\d+)", "".join(out))}
            time.sleep(0.2)
        os.kill(pids[victim], getattr(signal, how))
        lost_at = time.monotonic()
        reader.join(timeout + 30)  # the pipe closes when both ranks have exited
        elapsed = time.monotonic() - lost_at
        if victim != 0:
            assert proc.wait(5) == 1  # train.py's status for a lost rank, not a signal from teardown
        text = "".join(out)
        assert not reader.is_alive(), f"the survivor still runs {elapsed:.0f} s after the loss:\n{text[-3000:]}"
        assert elapsed < timeout + 15, f"{elapsed:.0f} s to stop (timeout {timeout} s)"
        error = next((line for line in text.splitlines() if line.startswith("train.py: error:")), None)
        assert error is not None, text[-3000:]
        assert f"lost rank {victim} (" in error
        if victim == 0:  # rank 1 tells: rank 0 held the store
            assert "rendezvous store" in error and "which no longer answers" in error
        if how == "SIGKILL" and victim == 1:
            assert f"pid {pids[1]}: killed by signal 9 (SIGKILL)" in error
        if how == "SIGSTOP":
            assert "not responding" in error
        assert "To resume from the last checkpoint: python " in error and error.endswith("--ckpt_path last")
        assert f"--exp_dir {tmp_path / 'exp'}" in error and "--strategy gtc" in error
    finally:
        for pid in pids.values():  # the processes this test started, by pid
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            proc.kill()
        proc.wait()


# ---- bad input to the entry point --------------------------------------------------------------

@pytest.fixture(scope="module")
def baseline_run(tiny_aligned, tmp_path_factory) -> tuple[Path, list[str]]:
    """A finished single-device run (1 epoch); returns its exp dir and command."""
    exp = tmp_path_factory.mktemp("baseline_exp")
    args = ["--config", str(TINY), "--strategy", "single", "--data.data_dir", str(tiny_aligned), "--exp_dir", str(exp),
            "--trainer.max_epochs", "1", "--num_threads", "1"]
    train.main(args)
    return exp, args


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {str(f.relative_to(directory)): f.read_bytes() for f in sorted(directory.rglob("*")) if f.is_file()}


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_corrupt_checkpoint_is_refused_and_nothing_is_written(damage, baseline_run, tmp_path):
    exp, args = baseline_run
    good = (exp / "baseline" / "checkpoints" / "last.ckpt").read_bytes()
    bad = tmp_path / f"{damage}.ckpt"
    bad.write_bytes({"truncated": good[: len(good) // 2], "garbage": b"\x80not a checkpoint" * 100, "empty": b""}[damage])
    before = _snapshot(exp)
    with pytest.raises(train.RecipeError) as err:
        train.main(args + ["--ckpt_path", str(bad)])
    msg = str(err.value)
    assert f"--ckpt_path {bad}: not a readable checkpoint, it is truncated or corrupt" in msg
    assert "resume from another checkpoint" in msg and "leave --ckpt_path out" in msg
    assert _snapshot(exp) == before  # the run it would have resumed is untouched


def test_checkpoint_of_another_model_size_is_refused(baseline_run):
    exp, args = baseline_run
    ckpt = exp / "baseline" / "checkpoints" / "last.ckpt"
    before = _snapshot(exp)
    with pytest.raises(train.RecipeError) as err:
        train.main(args + ["--model.hidden_dim", "16", "--model.num_layers", "3", "--ckpt_path", "last"])
    msg = str(err.value)
    assert f"--ckpt_path {ckpt} holds a model of another size" in msg
    assert "hidden_dim=32 (this run: 16)" in msg and "num_layers=2 (this run: 3)" in msg
    assert "--model.hidden_dim 32 --model.num_layers 2" in msg
    assert _snapshot(exp) == before


def test_ckpt_path_last_without_a_checkpoint_names_the_directory(baseline_run, tmp_path):
    _, args = baseline_run
    with pytest.raises(train.RecipeError, match=re.escape(f"no checkpoint in {tmp_path / 'baseline' / 'checkpoints'}")):
        train.main(args + ["--exp_dir", str(tmp_path), "--ckpt_path", "last"])
    with pytest.raises(train.RecipeError, match=re.escape(f"--ckpt_path {tmp_path / 'no.ckpt'}: no such file")):
        train.main(args + ["--ckpt_path", str(tmp_path / "no.ckpt")])


def test_data_dir_that_is_not_a_recipe_dir_is_left_untouched(tmp_path):
    """A directory of something else (here a Kaldi-style dir) is refused instead of having the
    synthetic corpus and every data stage written into it."""
    data = tmp_path / "my_corpus"
    data.mkdir()
    (data / "wav.scp").write_text("utt1 /audio/utt1.wav\n")
    (data / "text").write_text("utt1 HELLO\n")
    before = _snapshot(data)
    with pytest.raises(train.DataNotReady) as err:
        train.main(["--config", str(TINY), "--data.data_dir", str(data), "--exp_dir", str(tmp_path / "exp")])
    msg = str(err.value)
    assert f"--data.data_dir {data} is not a recipe data dir" in msg and "left this one untouched" in msg
    assert f"prepare.py --corpus {{kaldi,librispeech,...}} --corpus-dir {data}" in msg
    assert _snapshot(data) == before and sorted(p.name for p in data.iterdir()) == ["text", "wav.scp"]
    assert not (tmp_path / "exp").exists()


def test_data_dir_without_alignments_names_them_and_the_command(tmp_path):
    """A recipe data dir whose alignment stage did not run, with --prepare false (the popen ranks
    other than 0 see the same): the missing files and prepare.py's command."""
    data = tmp_path / "data"
    (data / "manifests").mkdir(parents=True)
    (data / "settings.json").write_text('{"corpus": "synthetic"}')
    with pytest.raises(train.DataNotReady) as err:
        train.main(["--config", str(TINY), "--data.data_dir", str(data), "--prepare", "false"])
    msg = str(err.value)
    assert f"{data} lacks ['ali/train_cuts.jsonl.gz'" in msg and f"python recipes/asr/prepare.py --data-dir {data}" in msg


def test_unknown_strategy_names_the_value_and_the_choices(tiny_aligned, tmp_path):
    base = ["--config", str(TINY), "--data.data_dir", str(tiny_aligned), "--exp_dir", str(tmp_path)]
    with pytest.raises(train.RecipeError) as err:
        train.main(base + ["--strategy", "gtcc"])
    assert "--strategy 'gtcc' is not a shortcut (did you mean 'gtc'" in str(err.value)
    assert "single, ddp, ddp_bf16, gtc" in str(err.value)
    with pytest.raises(train.RecipeError) as err:
        train.main(base + ["--trainer.strategy", "bmfu"])
    assert "--trainer.strategy 'bmfu' does not exist (did you mean 'bmuf'" in str(err.value)
    assert "--strategy {single,ddp," in str(err.value) and "gtc_lightning.GTCStrategy" in str(err.value)
    # from the shell: one line on stderr, no traceback, exit status 2
    res = subprocess.run([sys.executable, str(ROOT / "recipes" / "asr" / "train.py"), "--strategy", "gtcc"],
                         check=False, cwd=tmp_path, env=_popen_env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith("train.py: error: --strategy 'gtcc' is not a shortcut")
