"""The acoustic DNN: shapes, gradients, initialisation and learning-rate schedules."""

import pytest
import torch
from local.dnn.model import AcousticModel


def test_forward_backward_shapes():
    model = AcousticModel(input_dim=17 * 5, num_pdfs=11, hidden_dim=16, num_layers=3)
    x, y = torch.randn(8, 85), torch.randint(0, 11, (8,))
    logits = model(x)
    assert logits.shape == (8, 11)
    torch.nn.functional.cross_entropy(logits, y).backward()
    assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())
    sigmoids = [m for m in model.net if isinstance(m, torch.nn.Sigmoid)]
    assert len(sigmoids) == 3


def test_weight_count_of_strom_topology():
    model = AcousticModel(input_dim=680, num_pdfs=2700, hidden_dim=1536, num_layers=5)
    n = sum(p.numel() for p in model.parameters())
    assert 14.0e6 < n < 15.2e6  # Strom 2015: 14.6 M trainable parameters


def test_hidden_init_gain_spreads_sigmoid_inputs():
    torch.manual_seed(0)
    x = torch.randn(256, 680)
    wide = AcousticModel(input_dim=680, num_pdfs=10, hidden_dim=512, num_layers=2, init_gain=4.0)
    narrow = AcousticModel(input_dim=680, num_pdfs=10, hidden_dim=512, num_layers=2, init_gain=1.0)
    assert wide.net[0](x).std() > 3 * narrow.net[0](x).std()


def test_bad_sizes_raise():
    with pytest.raises(ValueError, match="num_pdfs=0"):
        AcousticModel(num_pdfs=0)


@pytest.mark.parametrize("schedule,hold,history,want", [
    ("halve", 0, [0.3], [0.5, 0.25, 0.125]),
    ("halve", 1, [0.3], [1.0, 0.5, 0.25]),
    ("newbob", 0, [0.30, 0.40, 0.402, 0.45], [1.0, 1.0, 0.5, 0.25]),
])
def test_learning_rate_schedules(schedule, hold, history, want, monkeypatch):
    model = AcousticModel(input_dim=4, num_pdfs=2, hidden_dim=2, num_layers=1, schedule=schedule,
                          hold_epochs=hold, newbob_threshold=0.005)
    opt = model.configure_optimizers()
    monkeypatch.setattr(AcousticModel, "optimizers", lambda self: opt)
    monkeypatch.setattr(AcousticModel, "log", lambda self, *a, **k: None)
    got = []
    for epoch in range(len(want)):
        model.dev_acc_history = history[: epoch + 1]
        model._trainer = type("T", (), {"current_epoch": epoch, "world_size": 1})()
        model.on_train_epoch_end()
        got.append(opt.param_groups[0]["lr"])
    assert got == pytest.approx(want)


def _one_sgd_step(model: AcousticModel, batch: dict, **trainer_args) -> None:
    from lightning.pytorch import Trainer

    trainer = Trainer(max_steps=1, limit_val_batches=0, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", **trainer_args)
    trainer.fit(model, torch.utils.data.DataLoader([batch], batch_size=None))


def test_sam_step_takes_the_gradient_at_the_moved_weights_and_steps_from_the_unmoved():
    """With sam_rho the step is w - lr * grad L(w + rho * g / |g|) (g = grad L(w)); with 0 it is SGD's."""
    torch.manual_seed(0)
    batch = {"x": torch.randn(32, 20), "y": torch.randint(0, 4, (32,))}
    for rho in (0.0, 0.5):
        model = AcousticModel(input_dim=20, num_pdfs=4, hidden_dim=8, num_layers=2, lr=0.3, sam_rho=rho)
        w0 = [p.detach().clone() for p in model.parameters()]
        g = torch.autograd.grad(torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"]), list(model.parameters()))
        norm = torch.sqrt(sum((x ** 2).sum() for x in g))
        with torch.no_grad():
            for p, gi in zip(model.parameters(), g):
                p.add_(gi, alpha=rho / float(norm))
        g_sam = torch.autograd.grad(torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"]),
                                    list(model.parameters()))
        with torch.no_grad():
            for p, w in zip(model.parameters(), w0):
                p.copy_(w)
        _one_sgd_step(model, batch)
        for p, w, gs in zip(model.parameters(), w0, g_sam):
            torch.testing.assert_close(p.detach(), w - 0.3 * gs, rtol=1e-5, atol=1e-6)
        if rho:  # and it is not SGD's step
            assert not all(torch.allclose(p.detach(), w - 0.3 * gi) for p, w, gi in zip(model.parameters(), w0, g))


def test_sam_names_bad_settings():
    with pytest.raises(ValueError, match="sam_rho=-0.1"):
        AcousticModel(sam_rho=-0.1)
    model = AcousticModel(input_dim=4, num_pdfs=2, hidden_dim=3, num_layers=1, sam_rho=0.1)
    with pytest.raises(ValueError, match="accumulate_grad_batches=2"):
        _one_sgd_step(model, {"x": torch.randn(4, 4), "y": torch.randint(0, 2, (4,))}, accumulate_grad_batches=2)


class _NanOnStep(AcousticModel):
    """Its SAM ascent is finite; the gradient GTC exchanges is NaN on optimizer step ``nan_step``."""

    def __init__(self, nan_step: int, **kw) -> None:
        super().__init__(**kw)
        self.nan_step = nan_step
        self.params_after: list[list[torch.Tensor]] = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.trainer.global_step == self.nan_step else loss

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        super().on_train_batch_end(outputs, batch, batch_idx)
        self.params_after.append([p.detach().clone() for p in self.parameters()])


def test_sam_restores_the_weights_when_gtc_skips_the_step(tmp_path):
    """A step GTC skips (non-finite gradient) leaves the weights where they were before SAM's ascent."""
    import lightning as L

    from gtc_lightning import GTCStrategy

    torch.manual_seed(0)
    data = [{"x": torch.randn(16, 6), "y": torch.randint(0, 3, (16,))} for _ in range(4)]
    model = _NanOnStep(2, input_dim=6, num_pdfs=3, hidden_dim=5, num_layers=1, lr=0.5, sam_rho=0.3)
    start = [p.detach().clone() for p in model.parameters()]
    strategy = GTCStrategy(tau=1e-3, timeout=torch.distributed.constants.default_pg_timeout)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_epochs=1, limit_val_batches=0,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path)
    try:
        with pytest.warns(RuntimeWarning, match=r"non-finite gradient on rank\(s\) \[0\] at optimizer step 3"):
            trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=None))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    after = model.params_after
    assert len(after) == 4 and model._sam_saved is None
    assert not all(torch.equal(a, s) for a, s in zip(after[1], start))  # steps 0 and 1 moved the weights
    for a, b in zip(after[2], after[1]):  # the skipped step: bit for bit the weights before it
        assert torch.equal(a, b)
    assert not all(torch.equal(a, b) for a, b in zip(after[3], after[2]))
    assert all(torch.isfinite(p).all() for p in model.parameters())
