"""local.dnn.sharpness against the exactly formed Hessian of a small model, the training-time
monitor on a two-rank GTC run and a single-device run, and recipes/asr/research/sharpness.py on a finished run."""

import json
from pathlib import Path

import pytest
import sharpness as sharpness_cli
import torch
import train
from local.dnn.sharpness import top_hessian_eigenvalue
from test_train import ROOT, aligned  # noqa: F401 (the fixture)
from torch import nn
from torch.func import functional_call


def _exact_hessian_eigenvalues(model: nn.Module, batches) -> torch.Tensor:
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    flat0 = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def loss(flat):
        params, i = {}, 0
        for n, s in zip(names, shapes):
            params[n] = flat[i : i + s.numel()].reshape(s)
            i += s.numel()
        return sum(nn.functional.cross_entropy(functional_call(model, params, (b["x"],)), b["y"])
                   for b in batches) / len(batches)

    return torch.linalg.eigvalsh(torch.autograd.functional.hessian(loss, flat0.double()).float())


@pytest.mark.parametrize("scale", [1.0, 8.0])
def test_top_eigenvalue_matches_the_formed_hessian(scale):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Sigmoid(), nn.Linear(5, 3))
    with torch.no_grad():
        model[0].weight.mul_(scale)  # sharper at a larger scale: the estimate must follow
    batches = [{"x": torch.randn(16, 4), "y": torch.randint(0, 3, (16,))} for _ in range(2)]
    model = model.double()
    batches = [{"x": b["x"].double(), "y": b["y"]} for b in batches]
    eig = _exact_hessian_eigenvalues(model, batches)
    dominant = float(eig[eig.abs().argmax()])
    res = top_hessian_eigenvalue(model, batches, iters=500, tol=1e-9)
    assert res["converged"], res
    assert res["lambda_max"] == pytest.approx(dominant, rel=1e-4)
    assert all(p.grad is None for p in model.parameters())  # .grad untouched
    assert res["loss"] == pytest.approx(sum(float(nn.functional.cross_entropy(model(b["x"]), b["y"]))
                                            for b in batches) / 2, rel=1e-6)


def test_top_eigenvalue_names_bad_input():
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="no batches"):
        top_hessian_eigenvalue(model, [])
    with pytest.raises(ValueError, match="iters=0"):
        top_hessian_eigenvalue(model, [{"x": torch.zeros(1, 2), "y": torch.zeros(1, dtype=torch.long)}], iters=0)


def test_the_global_rng_is_left_alone():
    model = nn.Linear(3, 2)
    b = [{"x": torch.randn(8, 3), "y": torch.randint(0, 2, (8,))}]
    torch.manual_seed(5)
    want = torch.rand(3)
    torch.manual_seed(5)
    top_hessian_eigenvalue(model, b, iters=3)
    assert torch.equal(torch.rand(3), want)


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "sharpness.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("strategy", ["single", "gtc_fork"])
def test_monitor_logs_during_a_run_and_leaves_training_alone(aligned, tmp_path, strategy):  # noqa: F811
    common = ["--config", str(ROOT / "conf" / "tiny.yaml"), "--data.data_dir", str(aligned), "--trainer.max_epochs",
              "1", "--trainer.limit_train_batches", "6", "--num_threads", "1", "--seed_everything", "3"]
    if strategy == "gtc_fork":
        common += ["--trainer.strategy", "gtc_fork", "--trainer.devices", "2"]
    else:
        common += ["--strategy", "single"]
    plain = train.main(common + ["--exp_dir", str(tmp_path / "plain")])
    watched = train.main(common + ["--exp_dir", str(tmp_path / "watched"),
                                   "--trainer.callbacks+=local.dnn.sharpness.SharpnessMonitor",
                                   "--trainer.callbacks.every_n_steps", "2", "--trainer.callbacks.iters", "5"])
    run_dir = Path(watched.config.trainer.default_root_dir)
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == [0, 2, 4, 6]  # at the start, every 2 steps, at the end (6 once)
    assert all(r["lambda_max"] > 0 and r["lr_x_lambda"] == pytest.approx(r["lr"] * r["lambda_max"]) for r in rows)
    # the monitor reads the weights only: the trained weights are the unwatched run's, bit for bit
    a = torch.load(json.loads((Path(plain.config.trainer.default_root_dir) / "train_summary.json").read_text())
                   ["checkpoint"], weights_only=False)["state_dict"]
    b = torch.load(json.loads((run_dir / "train_summary.json").read_text())["checkpoint"],
                   weights_only=False)["state_dict"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_cli_measures_a_finished_run(aligned, tmp_path):  # noqa: F811
    cli = train.main(["--config", str(ROOT / "conf" / "tiny.yaml"), "--strategy", "single", "--data.data_dir",
                      str(aligned), "--exp_dir", str(tmp_path), "--trainer.max_epochs", "1"])
    run_dir = Path(cli.config.trainer.default_root_dir)
    out = tmp_path / "s.json"
    rows = sharpness_cli.main(["--runs", str(run_dir), "--batches", "2", "--batch-size", "16", "--iters", "50",
                               "--out", str(out)])
    assert json.loads(out.read_text()) == rows and rows[0]["lambda_max"] > 0 and rows[0]["frames"] == 32
    with pytest.raises(ValueError, match="only .* training batches"):
        sharpness_cli.main(["--runs", str(run_dir), "--batches", "10000", "--batch-size", "16"])
    with pytest.raises(FileNotFoundError, match="train_summary.json"):
        sharpness_cli.main(["--runs", str(tmp_path / "nope")])


def _fit_with_loader(tmp_path, data, watched: bool = True) -> list[torch.Tensor]:
    import lightning as L
    from local.dnn.model import AcousticModel
    from local.dnn.sharpness import SharpnessMonitor

    torch.manual_seed(1)
    model = AcousticModel(input_dim=6, num_pdfs=3, hidden_dim=5, num_layers=1, lr=0.5)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, limit_val_batches=0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tmp_path,
                        callbacks=[SharpnessMonitor(every_n_steps=1, iters=5)] if watched else [])
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=None, shuffle=True))
    return [p.detach().clone() for p in model.parameters()]


def test_monitor_takes_the_batches_of_a_fit_without_datamodule(tmp_path):
    torch.manual_seed(0)
    data = [{"x": torch.randn(16, 6), "y": torch.randint(0, 3, (16,))} for _ in range(4)]
    watched = _fit_with_loader(tmp_path / "watched", data)
    rows = _rows(tmp_path / "watched")
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and all(r["lambda_max"] > 0 for r in rows)
    # reading the shuffling loader leaves the global RNG, so the shuffle order and the weights, alone
    plain = _fit_with_loader(tmp_path / "plain", data, watched=False)
    assert all(torch.equal(a, b) for a, b in zip(watched, plain))


def test_monitor_names_batches_it_cannot_read(tmp_path):
    with pytest.raises(TypeError, match="needs batches .*got list"):
        _fit_with_loader(tmp_path, [(torch.randn(16, 6), torch.randint(0, 3, (16,)))])
    with pytest.raises(TypeError, match=r"got dict with keys \['feats', 'y'\]"):
        _fit_with_loader(tmp_path, [{"feats": torch.randn(16, 6), "y": torch.randint(0, 3, (16,))}])
