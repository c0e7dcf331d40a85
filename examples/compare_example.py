"""A small LightningModule and DataModule to try ``gtc_lightning.tools.compare`` on
(docs/guide/compare.md; tests/test_compare.py). From the checkout's root:

    python -m gtc_lightning.tools.compare --model examples.compare_example.TinyClassifier \
        --data examples.compare_example.BlobsData --max-steps 200

The classes read like any user's: typed ``__init__`` arguments (``--model.init_args.hidden 128``),
a ``validation_step`` that logs ``val_loss`` (the comparison's held-out loss).
"""

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset


class TinyClassifier(L.LightningModule):
    """``features -> hidden -> hidden -> classes`` with AdamW (so ``strategy="gtc"`` picks the update mode).

    Args:
        features: input size (the data's ``features``).
        hidden: width of the two hidden layers.
        classes: output classes (the data's ``classes``).
        lr: AdamW's learning rate.
    """

    def __init__(self, features: int = 16, hidden: int = 64, classes: int = 4, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(features, hidden), torch.nn.ReLU(),
            torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
            torch.nn.Linear(hidden, classes),
        )  # fmt: skip

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        # sync_dist: every rank logs the mean over the whole held-out set, not its own shard's
        self.log("val_loss", torch.nn.functional.cross_entropy(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class BlobsData(L.LightningDataModule):
    """Points ``x [N, features]`` labelled by a fixed random linear teacher with noise, ``y [N]``;
    drawn from ``seed`` alone, so every run of a comparison sees the same sets.

    Args:
        features: input size.
        classes: label classes.
        train_size, val_size: samples in the training and held-out sets.
        batch_size: batch per rank.
        noise: standard deviation of the noise added to the teacher's logits (the best loss is above 0).
        seed: the sets' seed.
    """

    def __init__(self, features: int = 16, classes: int = 4, train_size: int = 4096, val_size: int = 512,
                 batch_size: int = 32, noise: float = 0.5, seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        h = self.hparams
        g = torch.Generator().manual_seed(h.seed)
        teacher = torch.randn(h.features, h.classes, generator=g)
        x = torch.randn(h.train_size + h.val_size, h.features, generator=g)
        y = (x @ teacher + h.noise * torch.randn(len(x), h.classes, generator=g)).argmax(dim=1)
        self.train_set = TensorDataset(x[: h.train_size], y[: h.train_size])
        self.val_set = TensorDataset(x[h.train_size:], y[h.train_size:])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size)
