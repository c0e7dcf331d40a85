"""The model suite's LightningModules: what Lightning users train, CPU-sized, on synthetic tasks.

Each module draws its task (:mod:`gtc_lightning.tools.suite_data`) when it is built, in the parent
process before the ranks fork, with ``train_size`` samples: the runner asks for exactly the
samples its steps consume (``steps x batch_size x world_size``), so no sample is seen twice and
the held-out loss measures learning, not memorising. Every module has the same surface:

- ``task``: the :class:`~gtc_lightning.tools.suite_data.Task` (``best_loss``, the held-out set);
- ``loss(*tensors)``: the mean cross-entropy of a batch (nats per prediction);
- ``batch_size``: per rank; Lightning's ``DistributedSampler`` shards the training set.

:func:`heldout_loss` scores any of them on its full held-out set.
"""

from __future__ import annotations

import itertools
import math

import lightning as L
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

from gtc_lightning.tools.suite_data import frames_task, grating_task, hmm_task, markov_task


def heldout_loss(model: L.LightningModule) -> float:
    """Mean cross-entropy of ``model`` on its task's whole held-out set, in eval mode (BatchNorm
    uses its running statistics), with the parameters it holds now."""
    was_training = model.training
    model.eval()
    with torch.no_grad():
        loss = float(model.loss(*model.task.heldout.tensors))
    model.train(was_training)
    return loss


def _loader(model: L.LightningModule) -> DataLoader:
    # shuffle=True: Lightning replaces the sampler by a shuffling DistributedSampler.
    return DataLoader(model.task.train, batch_size=model.batch_size, shuffle=True, drop_last=True)


def _warmup_cosine(warmup: int, steps: int):
    """Learning-rate factor of step ``s``: linear warm-up to 1 over ``warmup`` steps, then cosine to 0."""
    return lambda s: (
        (s + 1) / warmup
        if s < warmup
        else 0.5 * (1 + math.cos(math.pi * (s - warmup) / max(1, steps - warmup)))
    )


class TransformerLM(L.LightningModule):
    """Pre-norm decoder-only transformer LM on a sparse Markov chain, AdamW with warm-up + cosine.

    Batch: ``tokens [B, T]``; the loss predicts tokens ``order .. T-1`` (each has its whole
    context in view), so the chain's conditional entropy is the best loss. Order 1 by default: at
    order 2 (1024 contexts of 32 tokens) the model was still near the unigram loss after 300 steps.

    Args:
        train_size: training sequences. seed: initial weights and training samples.
        steps: optimizer steps of the run (the schedule's length). batch_size: sequences per rank.
        vocab, order, seq_len, d_model, layers, heads: the task's and the model's sizes.
        lr, weight_decay, warmup: AdamW's peak rate, decoupled weight decay, warm-up fraction.
    """

    def __init__(
        self,
        train_size: int,
        seed: int = 0,
        steps: int = 300,
        batch_size: int = 16,
        vocab: int = 32,
        order: int = 1,
        seq_len: int = 32,
        d_model: int = 64,
        layers: int = 2,
        heads: int = 4,
        lr: float = 1e-3,
        weight_decay: float = 0.01,
        warmup: float = 0.1,
    ) -> None:
        super().__init__()
        self.task = markov_task(
            vocab, order, support=4, seq_len=seq_len, train_seqs=train_size, heldout_seqs=512, seed=seed
        )
        self.order, self.steps, self.batch_size = order, steps, batch_size
        self.lr, self.weight_decay, self.warmup = lr, weight_decay, warmup
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, d_model)
        self.position = nn.Parameter(0.02 * torch.randn(seq_len, d_model))
        block = nn.TransformerEncoderLayer(
            d_model, heads, 4 * d_model, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)
        self.register_buffer(
            "causal", nn.Transformer.generate_square_subsequent_mask(seq_len - 1), persistent=False
        )

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        inputs = tokens[:, :-1]  # [B, T-1]
        x = self.embed(inputs) + self.position[: inputs.shape[1]]
        h = self.norm(self.blocks(x, mask=self.causal, is_causal=True))
        logits = self.head(h)[:, self.order - 1 :]  # [B, T-order, V]: predictions of tokens order .. T-1
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, self.order :].reshape(-1))

    def training_step(self, batch, batch_idx):
        return self.loss(*batch)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, _warmup_cosine(max(1, int(self.warmup * self.steps)), self.steps)
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        return _loader(self)


class TransformerLMLarge(TransformerLM):
    """The long profile's language model: :class:`TransformerLM` at 2.4 M parameters (3 blocks of
    width 256) on a second-order chain (1,024 contexts of 32 tokens, 4 next tokens each), AdamW with
    5 % warm-up and cosine decay.

    At order 2 the model must attend to the two previous tokens; the first-order task of the
    small model is a bigram table it learns in a few hundred steps. Whether a run's held-out loss
    has stopped improving is in the suite's printed curves (DDP's last evaluations).
    """

    def __init__(
        self,
        train_size: int,
        seed: int = 0,
        steps: int = 2000,
        batch_size: int = 16,
        vocab: int = 32,
        order: int = 2,
        seq_len: int = 32,
        d_model: int = 256,
        layers: int = 3,
        heads: int = 4,
        lr: float = 1e-3,
        weight_decay: float = 0.01,
        warmup: float = 0.05,
    ) -> None:
        super().__init__(
            train_size, seed, steps, batch_size, vocab, order, seq_len, d_model, layers, heads, lr, weight_decay, warmup
        )


class GratingCNN(L.LightningModule):
    """Small CNN with BatchNorm on gratings in noise (texture classes); SGD with Nesterov momentum
    0.9 and weight decay, warm-up + cosine.

    Batch: ``x [B, 1, 16, 16]``, ``y [B]`` (10 classes). A 5x5 conv, then two 3x3 convs with
    stride 2, each with BatchNorm + ReLU; global average pooling (the phase is random: the class
    is in which filters respond, not where); a linear classifier.

    Args:
        train_size: training images. seed: initial weights and samples. batch_size: per rank.
        steps: optimizer steps of the run (the schedule's length).
        width: channels of the first layer (then 2x). lr, momentum, weight_decay: SGD's.
    """

    def __init__(
        self,
        train_size: int,
        seed: int = 0,
        steps: int = 300,
        batch_size: int = 32,
        width: int = 16,
        lr: float = 0.1,
        momentum: float = 0.9,
        weight_decay: float = 5e-4,
    ) -> None:
        super().__init__()
        self.task = grating_task(size=16, amplitude=0.4, train=train_size, heldout=2048, seed=seed)
        self.steps, self.batch_size = steps, batch_size
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        torch.manual_seed(seed)

        def conv(c_in: int, c_out: int, stride: int, kernel: int = 3) -> list[nn.Module]:
            return [
                nn.Conv2d(c_in, c_out, kernel, stride, kernel // 2, bias=False),
                nn.BatchNorm2d(c_out),
                nn.ReLU(),
            ]

        self.net = nn.Sequential(
            *conv(1, width, 1, kernel=5),
            *conv(width, 2 * width, 2),
            *conv(2 * width, 2 * width, 2),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(2 * width, 10),
        )

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.net(x), y)

    def training_step(self, batch, batch_idx):
        return self.loss(*batch)

    def configure_optimizers(self):
        opt = torch.optim.SGD(
            self.parameters(),
            lr=self.lr,
            momentum=self.momentum,
            nesterov=True,
            weight_decay=self.weight_decay,
        )
        sched = torch.optim.lr_scheduler.LambdaLR(opt, _warmup_cosine(max(1, self.steps // 20), self.steps))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        return _loader(self)


class GRULM(L.LightningModule):
    """GRU next-token model on a hidden Markov model's sequences; Adam with warm-up + cosine.

    Batch: ``tokens [B, T]``; predicts tokens ``1 .. T-1`` from the tokens before them. The best
    loss is the forward algorithm's (the true HMM's belief over its hidden state).

    Args:
        train_size: training sequences. seed: initial weights and samples. batch_size: per rank.
        steps: optimizer steps of the run (the schedule's length).
        vocab, seq_len, embed, hidden: sizes. lr: Adam's peak rate.
    """

    def __init__(
        self,
        train_size: int,
        seed: int = 0,
        steps: int = 300,
        batch_size: int = 32,
        vocab: int = 16,
        seq_len: int = 32,
        embed: int = 32,
        hidden: int = 64,
        lr: float = 1e-2,
    ) -> None:
        super().__init__()
        self.task = hmm_task(
            8, vocab, stay=0.9, emission_alpha=0.1, seq_len=seq_len, train=train_size, heldout=1024, seed=seed
        )
        self.steps, self.batch_size, self.lr = steps, batch_size, lr
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, embed)
        self.gru = nn.GRU(embed, hidden, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        h, _ = self.gru(self.embed(tokens[:, :-1]))  # [B, T-1, hidden]
        logits = self.head(h)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))

    def training_step(self, batch, batch_idx):
        return self.loss(*batch)

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=self.lr)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, _warmup_cosine(max(1, self.steps // 20), self.steps))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        return _loader(self)


class SpeechDNN(L.LightningModule):
    """The recipe's acoustic DNN (``recipes/asr/local/dnn/model.py``), rebuilt here: 17 frames x 40
    fbank -> sigmoid hidden layers (Xavier init, gain 4) -> senone logits; mean cross-entropy,
    plain SGD without momentum at a high rate, halved four times in the second half of the run, as
    Strom trains it (2 hidden layers of 256 where the recipe has 5 of 512: it reaches its plateau in
    500 steps).

    Batch: ``x [B, 680]``, ``y [B]``: frames of class-conditional Gaussian mixtures with senone-like
    class priors (:func:`~gtc_lightning.tools.suite_data.frames_task`).

    Args:
        train_size: training frames. seed: initial weights and samples. batch_size: frames per rank.
        steps: optimizer steps of the run (the schedule's length).
        classes, hidden, layers: senones, units per hidden layer, hidden layers. lr: SGD's first rate.
    """

    def __init__(
        self,
        train_size: int,
        seed: int = 0,
        steps: int = 300,
        batch_size: int = 128,
        classes: int = 32,
        hidden: int = 256,
        layers: int = 2,
        lr: float = 2.0,
    ) -> None:
        super().__init__()
        self.task = frames_task(
            classes,
            components=2,
            dim=17 * 40,
            latent=16,
            noise=1.0,
            train=train_size,
            heldout=4096,
            seed=seed,
        )
        self.steps, self.batch_size, self.lr = steps, batch_size, lr
        torch.manual_seed(seed)
        dims = [17 * 40] + [hidden] * layers
        stack: list[nn.Module] = []
        for d_in, d_out in itertools.pairwise(dims):
            affine = nn.Linear(d_in, d_out)
            nn.init.xavier_uniform_(affine.weight, gain=4.0)  # sigmoid stacks sit at the prior without it
            nn.init.zeros_(affine.bias)
            stack += [affine, nn.Sigmoid()]
        output = nn.Linear(hidden, classes)
        nn.init.xavier_uniform_(output.weight)
        nn.init.zeros_(output.bias)
        self.net = nn.Sequential(*stack, output)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.net(x), y)

    def training_step(self, batch, batch_idx):
        return self.loss(*batch)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        # Strom halves the rate after every epoch past the first; here after each eighth past the half,
        # so that the run ends on a plateau (at 1/16 of the first rate).
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** max(0, int(8 * s / self.steps) - 3))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        return _loader(self)


MODELS: dict[str, type[L.LightningModule]] = {
    "transformer": TransformerLM,
    "cnn": GratingCNN,
    "gru": GRULM,
    "speech_dnn": SpeechDNN,
    "transformer_lm": TransformerLMLarge,  # the long profile's (>= 2 M parameters)
}
