"""Two optimizers under GTC, in manual optimization: Muon for the weight matrices and AdamW for the biases,
or AdamW for both.

Muon orthogonalises each matrix's momentum and takes only 2-D parameters, so a model trained with it keeps a
second optimizer for the rest. ``strategy="gtc"`` picks what to compress by the optimizers
(``compress="auto"``): the update mode (each rank's optimizers step on its own gradient and each optimizer's
step is compressed and exchanged after it) for AdamW, Strom's gradient mode where Muon is among them (each
rank would orthogonalise its own noisy momentum, and the mean of those steps is not Muon's step). The task: a
noisy tanh regression whose best possible held-out loss is the noise's variance, 0.01; a cosine schedule.

    python examples/two_optimizers.py                              # GTC's defaults, 2 CPU ranks
    python examples/two_optimizers.py --strategy gtc_update        # the update mode, asked for
    python examples/two_optimizers.py --strategy ddp               # the dense reference
    python examples/two_optimizers.py --optimizers adamw           # AdamW for both
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from torch import nn

from gtc_lightning import GTCStrategy

NOISE = 0.1  # the targets' noise: the best possible mean squared error is NOISE ** 2


class Regression(L.LightningModule):
    """A 16 -> 64 -> 64 -> 1 tanh MLP; Muon (or AdamW) on its matrices, AdamW on its biases."""

    def __init__(self, optimizers: str = "muon") -> None:
        super().__init__()
        self.automatic_optimization = False
        self.choice = optimizers
        self.net = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        for optimizer in self.optimizers():
            optimizer.zero_grad()
        self.manual_backward(loss)
        for optimizer in self.optimizers():
            optimizer.step()
        for scheduler in self.lr_schedulers():
            scheduler.step()
        self.log("train_loss", loss)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self):
        matrices = [p for p in self.parameters() if p.ndim == 2]
        others = [p for p in self.parameters() if p.ndim != 2]
        first = torch.optim.Muon(matrices, lr=2e-2) if self.choice == "muon" else torch.optim.AdamW(matrices, lr=1e-2)
        optimizers = [first, torch.optim.AdamW(others, lr=1e-2)]
        batches = self.trainer.estimated_stepping_batches  # (each optimizer steps once a batch)
        return optimizers, [torch.optim.lr_scheduler.CosineAnnealingLR(o, batches) for o in optimizers]


def loaders(samples: int = 4096) -> tuple[torch.utils.data.DataLoader, torch.utils.data.DataLoader]:
    """Train and held-out sets of ``y = tanh(x w) + noise`` (the same on every rank and run)."""
    generator = torch.Generator().manual_seed(0)
    w = torch.randn(16, 1, generator=generator)

    def data(n: int) -> torch.utils.data.TensorDataset:
        x = torch.randn(n, 16, generator=generator)
        return torch.utils.data.TensorDataset(x, torch.tanh(x @ w) + NOISE * torch.randn(n, 1, generator=generator))

    train, held_out = data(samples), data(samples // 4)
    return (torch.utils.data.DataLoader(train, batch_size=32, shuffle=True),
            torch.utils.data.DataLoader(held_out, batch_size=256))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=["gtc", "gtc_update", "gtc_gradient", "ddp"], default="gtc")
    parser.add_argument("--optimizers", choices=["muon", "adamw"], default="muon",
                        help="muon: Muon on the matrices, AdamW on the biases; adamw: AdamW for both")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    strategy = {"gtc": "gtc", "gtc_update": GTCStrategy(compress="update"),
                "gtc_gradient": GTCStrategy(compress="gradient"), "ddp": "ddp"}[args.strategy]  # fmt: skip
    L.seed_everything(args.seed)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=args.epochs, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False)  # fmt: skip
    train, held_out = loaders()
    trainer.fit(Regression(args.optimizers), train, held_out)
    if trainer.global_rank == 0:
        mode = f" ({trainer.strategy.compress} mode)" if isinstance(trainer.strategy, GTCStrategy) else ""
        print(f"{args.strategy}{mode}, {args.optimizers}: held-out loss {float(trainer.callback_metrics['val_loss']):.4f} "
              f"(best possible {NOISE ** 2:.4f}) after {trainer.global_step} optimizer steps")  # fmt: skip
    # Leave together: a rank that exits with gloo's process group alive can abort at exit ("terminate called
    # without an active exception"), its last output lost.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
