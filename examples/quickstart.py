"""The README's quickstart on 2 CPU ranks: a tiny LightningModule trained with ``strategy="gtc"``.

    python examples/quickstart.py

Lightning starts the second rank by running this script again (the default launcher), so the
training sits under ``if __name__ == "__main__"``. CI runs it on a plain ``pip install .`` (no extras:
no Triton) to check that the library alone trains on CPU.
"""

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import gtc_lightning  # registers "gtc"
from gtc_lightning import parameter_checksums


class TinyClassifier(L.LightningModule):
    """16 features -> 64 -> 4 classes, AdamW (so ``compress="auto"`` picks the update mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 16, generator=g)
    y = (x @ torch.randn(16, 4, generator=g)).argmax(dim=1)
    return DataLoader(TensorDataset(x, y), batch_size=32)


def main() -> None:
    torch.manual_seed(0)
    model = TinyClassifier()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="gtc", max_epochs=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, data())
    mine = parameter_checksums(model.parameters())
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    if not all(torch.equal(mine, other) for other in everyone):
        raise SystemExit("quickstart: the two replicas differ")
    if trainer.is_global_zero:
        total = trainer.strategy.gtc_stats["total"]
        print(f"quickstart: gtc-lightning {gtc_lightning.__version__} from {gtc_lightning.__file__}")
        print(f"quickstart: {int(total['steps'])} steps on 2 CPU ranks, replicas identical, "
              f"{total['ratio_fp32']:.0f}x fewer bytes than a fp32 all-reduce")
    # Leave together: a rank that exits while the other still tears gloo down can abort it at exit.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
