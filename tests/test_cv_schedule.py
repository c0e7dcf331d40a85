"""The DNN's cross-validation set apart from dev (``--data.cv_speakers``) and Kaldi nnet1's schedule
(``--model.schedule nnet1``): the held-out speakers on the tiny corpus's manifests and on a small
aligned data dir, the schedule's decisions on scripted losses, and one short training run with both."""

import json
import logging
import math
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from lightning.pytorch import Callback
from local.dnn.datamodule import AsrDataModule, held_out_speakers, speaker_of
from local.dnn.model import AcousticModel
from local.dnn.schedule import Nnet1Schedule
from test_train import FEAT_DIM, NUM_PDFS, aligned_cut

ROOT = Path(__file__).resolve().parents[1]
TRAIN_SPEAKERS = [f"spk{k}" for k in range(10)]


def write_aligned_dir(data_dir: Path, speakers: dict[str, list[str]], utts_per_speaker: int = 4) -> Path:
    """What the DNN stage reads (as ``test_train.write_aligned_dir``), with the speakers given per split:
    ``ali/{train,dev}_cuts.jsonl.gz``, ``manifests/test_cuts.jsonl.gz`` (speakers only), ``ali/info.json``,
    ``features/cmvn.json``, ``adapt/fbank_{,sat_}trans.pkl``. A frame's pdf-id is the argmax of its first bins."""
    from lhotse import CutSet
    from lhotse.features.io import NumpyFilesWriter

    rng = np.random.default_rng(0)
    for sub in ("ali", "features", "manifests", "adapt"):
        (data_dir / sub).mkdir(parents=True)
    with NumpyFilesWriter(data_dir / "ali" / "storage") as writer:
        for split, names in speakers.items():
            cuts = []
            for spk in names:
                for i in range(utts_per_speaker):
                    cut_id, frames = f"{spk}-{split}-{i}", int(rng.integers(5, 30))
                    cuts.append(aligned_cut(writer, rng, cut_id, frames, spk))
            folder = "manifests" if split == "test" else "ali"
            CutSet.from_cuts(cuts).to_file(data_dir / folder / f"{split}_cuts.jsonl.gz")
    (data_dir / "ali" / "info.json").write_text(json.dumps({"num_pdfs": NUM_PDFS}))
    zero = {"mean": [0.0] * FEAT_DIM, "std": [1.0] * FEAT_DIM, "frames": 1}
    (data_dir / "features" / "cmvn.json").write_text(json.dumps({"global": zero, "speakers": {}}))
    identity = np.hstack([np.eye(FEAT_DIM), np.zeros((FEAT_DIM, 1))])
    for name in ("fbank_trans.pkl", "fbank_sat_trans.pkl"):  # what train.py checks for before it trains
        with open(data_dir / "adapt" / name, "wb") as f:
            pickle.dump({spk: identity for names in speakers.values() for spk in names}, f)
    return data_dir


@pytest.fixture(scope="module")
def aligned(tmp_path_factory) -> Path:
    return write_aligned_dir(tmp_path_factory.mktemp("cv") / "d",
                             {"train": TRAIN_SPEAKERS, "dev": ["dev0", "dev1"], "test": ["test0"]})


# --- the held-out speakers ---------------------------------------------------------------------------

def test_held_out_speakers_of_the_tiny_corpus_are_train_persons_never_dev_or_test(tiny_corpus):
    from fixtures_corpus import load_split

    train = [speaker_of(c) for c in load_split(tiny_corpus, "train")]
    others = {speaker_of(c) for split in ("dev", "test") for c in load_split(tiny_corpus, split)}
    persons = set(train)
    assert len(persons) < len({c.supervisions[0].speaker for c in load_split(tiny_corpus, "train")}), \
        "a person (all settings and augmented copies of a voice) is held out, not a voice setting"
    assert "kal" in persons, "flite's kal16 and festival's kal_diphone are one person"
    for fraction in (0.1, 0.3):
        got = held_out_speakers(train, fraction, seed=0, other_speakers=others)
        assert len(got) == int(fraction * len(persons) + 0.5) >= 1
        assert set(got) <= persons and not set(got) & others
        assert got == held_out_speakers(list(reversed(train)), fraction, seed=0, other_speakers=others)
    draws = {tuple(held_out_speakers(train, 0.3, seed=s, other_speakers=others)) for s in range(6)}
    assert len(draws) > 1, "the seed draws the speakers"


def test_held_out_speakers_skip_shared_dev_speakers_and_name_the_count():
    speakers = [f"s{k}" for k in range(10)]
    for seed in range(5):  # --allow-shared-speakers: a train speaker in dev is never drawn
        assert not {"s0", "s1"} & set(held_out_speakers(speakers, 0.5, seed, other_speakers={"s0", "s1"}))
    with pytest.raises(ValueError, match=r"train has 4 speaker\(s\).*--data.cv_speakers 0.125 or more"):
        held_out_speakers(speakers[:4], 0.1, 0)
    with pytest.raises(ValueError, match="leaving none to train on"):
        held_out_speakers(speakers[:2], 0.9, 0)
    with pytest.raises(ValueError, match="train has 1 of 10"):
        held_out_speakers(speakers, 0.2, 0, other_speakers=set(speakers[1:]))
    with pytest.raises(ValueError, match="0 <= cv_speakers < 1"):
        AsrDataModule(data_dir="d", cv_speakers=1.0)


def test_cv_set_holds_the_held_out_speakers_utterances_and_train_the_rest(aligned):
    plain = AsrDataModule(data_dir=str(aligned), features="fbank_sat")
    plain.setup("fit")
    dm = AsrDataModule(data_dir=str(aligned), features="fbank_sat", cv_speakers=0.2)
    dm.setup("fit")
    held = dm.cv_speaker_list
    assert len(held) == 2 and set(held) <= set(TRAIN_SPEAKERS)
    assert held == AsrDataModule(data_dir=str(aligned), cv_speakers=0.2).held_out(), "deterministic"
    assert held != AsrDataModule(data_dir=str(aligned), cv_speakers=0.2, seed=1).held_out() or \
        held != AsrDataModule(data_dir=str(aligned), cv_speakers=0.2, seed=2).held_out()
    (_, _, cv_offsets), (train_feats, _, train_offsets) = dm.splits["cv"], dm.splits["train"]
    assert len(cv_offsets) - 1 == 4 * len(held) and len(train_offsets) - 1 == 4 * (10 - len(held))
    # the two sets together are the plain training set, frame for frame, in the manifest's order
    from lhotse import CutSet

    order = [speaker_of(c) in held for c in CutSet.from_file(aligned / "ali" / "train_cuts.jsonl.gz")]
    lengths = np.diff(plain.splits["train"][2])
    assert list(np.diff(cv_offsets)) == [n for n, h in zip(lengths, order) if h]
    assert list(np.diff(train_offsets)) == [n for n, h in zip(lengths, order) if not h]
    assert len(train_feats) + len(dm.splits["cv"][0]) == len(plain.splits["train"][0])
    assert dm.val_sets == ("dev", "cv") and plain.val_sets == ("dev",)
    loaders = dm.val_dataloader()
    assert len(loaders) == 2 and sum(len(b["y"]) for b in loaders[1]) == cv_offsets[-1]
    assert sum(len(b["y"]) for b in plain.val_dataloader()) == len(plain.splits["dev"][1])
    stream = AsrDataModule(data_dir=str(aligned), cv_speakers=0.2, loader="stream", buffer_frames=100)
    stream.setup("fit")  # the streaming loader's epoch: the same training frames, read lazily
    assert sum(len(b["y"]) for b in stream.train_dataloader()) == len(train_feats)


# --- the schedule's decisions ------------------------------------------------------------------------

def _decide(losses, **kwargs):
    schedule = Nnet1Schedule(**kwargs)
    return [schedule.step(x) for x in losses]


def test_nnet1_accepts_rejects_starts_halving_and_stops():
    d = _decide([2.0, 1.5, 1.6, 1.45, 1.4495])
    assert [x.accepted for x in d] == [True, True, False, True, True]
    assert math.isinf(d[0].rel_impr) and d[1].rel_impr == pytest.approx(0.25)
    assert d[2].rel_impr == 0 and d[3].rel_impr == pytest.approx(0.05 / 1.5)
    # a rejection starts halving; once started it halves every epoch; a gain below 0.001 then stops
    assert [x.halve for x in d] == [False, False, True, True, False]
    assert [x.stop for x in d] == [False, False, False, False, True]


def test_nnet1_starts_halving_on_a_small_gain_and_a_rejection_after_that_stops():
    d = _decide([2.0, 1.99, 1.8, 2.5])
    assert d[1].rel_impr == pytest.approx(0.005) and d[1].halve and not d[1].stop
    assert d[2].halve and not d[2].stop, "a large gain does not stop halving"
    assert not d[3].accepted and d[3].stop and not d[3].halve
    # a gain below end_halving_impr before halving started only starts it (nnet1 checks the stop first)
    d = _decide([2.0, 1.9999])
    assert d[1].halve and not d[1].stop


def test_nnet1_keep_lr_epochs_accepts_and_holds_the_rate():
    d = _decide([2.0, 2.1, 2.2, 2.3], keep_lr_epochs=2)
    assert [x.accepted for x in d] == [True, True, False, False]
    assert [x.halve for x in d] == [False, False, True, False] and d[3].stop
    with pytest.raises(ValueError, match="0 <= end <= start"):
        Nnet1Schedule(start_halving_impr=0.001, end_halving_impr=0.01)
    with pytest.raises(ValueError, match="finite loss"):
        Nnet1Schedule().step(float("nan"))


def test_model_restores_the_accepted_weights_and_halves_on_a_rejection(monkeypatch):
    model = AcousticModel(input_dim=4, num_pdfs=2, hidden_dim=3, num_layers=1, lr=1.0, momentum=0.9,
                          schedule="nnet1")
    opt = model.configure_optimizers()
    monkeypatch.setattr(AcousticModel, "optimizers", lambda self: opt)
    monkeypatch.setattr(AcousticModel, "log", lambda self, *a, **k: None)
    trainer = type("T", (), {"current_epoch": 0, "world_size": 1, "should_stop": False, "datamodule": None,
                              "is_global_zero": True, "max_steps": -1, "global_step": 0})()
    model._trainer = trainer
    model.on_fit_start()
    weights = []

    def epoch(loss: float) -> None:  # "training" moves the weights and fills the momentum buffers
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
        weights.append([p.detach().clone() for p in model.parameters()])
        model.loss_history["cv"].append(loss)
        model.on_train_epoch_end()
        trainer.current_epoch += 1

    epoch(2.0)
    epoch(1.5)
    momentum = {k: v["momentum_buffer"].clone() for k, v in opt.state_dict()["state"].items()}
    assert opt.param_groups[0]["lr"] == 1.0
    epoch(1.7)  # worse than 1.5: rejected, the weights and momentum of epoch 1 back, the rate halved
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights[1]))
    assert all(torch.equal(opt.state_dict()["state"][k]["momentum_buffer"], v) for k, v in momentum.items())
    assert opt.param_groups[0]["lr"] == 0.5 and not trainer.should_stop
    epoch(1.49999)  # accepted, but the gain is below end_halving_impr with halving started: stop
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights[3]))
    assert trainer.should_stop and opt.param_groups[0]["lr"] == 0.5
    assert [d["accepted"] for d in model.schedule_decisions] == [True, True, False, True]
    with pytest.raises(RuntimeError, match="no new cross-validation loss"):
        model.on_train_epoch_end()  # no validation after this epoch


def test_newbob_reads_the_held_out_speakers_in_place_of_dev(monkeypatch):
    model = AcousticModel(input_dim=4, num_pdfs=2, hidden_dim=2, num_layers=1, schedule="newbob")
    model.dev_acc_history = [0.30, 0.40]  # dev would keep the rate: a 10-point gain
    model.cv_acc_history = [0.30, 0.301]  # the held-out speakers gained 0.1 point: halve
    assert model.halve_after_epoch(1)
    with pytest.raises(ValueError, match="inside a Lightning fit"):
        AcousticModel(input_dim=4, num_pdfs=2, hidden_dim=2, num_layers=1, schedule="nnet1").halve_after_epoch(0)


# --- one short run with both options -----------------------------------------------------------------

def test_training_with_held_out_speakers_and_nnet1_logs_each_decision(aligned, tmp_path, caplog):
    import train

    caplog.set_level(logging.INFO, logger="local.dnn.model")
    cli = train.main(["--config", str(ROOT / "conf" / "tiny.yaml"), "--strategy", "single",
                      "--data.data_dir", str(aligned), "--data.features", "fbank_sat", "--exp_dir", str(tmp_path),
                      "--trainer.max_epochs", "4", "--trainer.limit_val_batches", "null",
                      "--data.cv_speakers", "0.2", "--model.schedule", "nnet1"])
    assert not (aligned / "settings.json").exists(), "the data dir was complete: train.py must not prepare data"
    summary = json.loads((Path(cli.config.trainer.default_root_dir) / "train_summary.json").read_text())
    decisions, epochs = summary["schedule_decisions"], summary["epochs"]
    assert summary["cv_speakers"] == cli.datamodule.cv_speaker_list and len(summary["cv_speakers"]) == 2
    assert 1 <= len(decisions) == len(summary["cv_frame_acc"]) == len(summary["dev_frame_acc"]) <= 4
    assert [d["epoch"] for d in decisions] == list(range(len(decisions))) and decisions[0]["rel_impr"] is None
    assert decisions[-1]["stop"] or len(decisions) == 4
    assert [d["loss"] for d in decisions] == pytest.approx(cli.model.loss_history["cv"])
    lines = [r.getMessage() for r in caplog.records if "nnet1 schedule on cv" in r.getMessage()]
    assert len(lines) == len(decisions) and all(("accepted" in m or "rejected" in m) and "lr" in m or "stop" in m
                                                for m in lines)
    metrics = (Path(cli.config.trainer.default_root_dir) / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"cv_loss", "cv_frame_acc", "dev_loss", "dev_frame_acc", "cv_accepted"} <= set(metrics)
    assert epochs >= len(decisions)


class Interrupt(Callback):
    """Fails the run when step ``at`` starts, after the checkpoint of the step before (as test_resume's)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.at:
            raise RuntimeError(f"interrupted at step {self.at}")


def test_a_run_resumed_mid_epoch_decides_and_ends_as_an_uninterrupted_one(aligned, tmp_path):
    """The schedule's state (best loss, halving, decisions, the accepted weights) goes into the checkpoint:
    resumed in epoch 1 (steps 4-7), whose rejection restores epoch 0's weights, the run ends bit for bit
    as one never interrupted."""
    import train

    def args(name: str) -> list[str]:
        return ["--config", str(ROOT / "conf" / "tiny.yaml"), "--strategy", "single", "--run_name", name,
                "--data.data_dir", str(aligned), "--data.features", "fbank_sat", "--exp_dir", str(tmp_path),
                "--trainer.max_epochs", "4", "--data.cv_speakers", "0.2", "--model.schedule", "nnet1",
                "--model.lr", "20", "--checkpoint_every_n_steps", "2"]  # a rate that gets epoch 1 rejected

    def weights(cli) -> dict:
        return {k: v.clone() for k, v in cli.model.state_dict().items()}

    whole = weights(train.main(args("whole")))
    decisions = json.loads((tmp_path / "whole" / "train_summary.json").read_text())["schedule_decisions"]
    assert [d["accepted"] for d in decisions][:2] == [True, False], "epoch 1 not rejected: change the rate"
    cli = train.build_cli(args("resumed"))
    cli.trainer.callbacks.append(Interrupt(6))
    with pytest.raises(RuntimeError, match="interrupted at step 6"):
        train.fit(cli)
    resumed = weights(train.main(args("resumed") + ["--ckpt_path", "last"]))
    assert json.loads((tmp_path / "resumed" / "train_summary.json").read_text())["schedule_decisions"] == decisions
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
