"""Synthetic tasks for the model suite, each with its true distribution and best possible loss.

Every task is drawn from a generative model fixed by ``task_seed`` (the same for every run), so
the loss of the true conditional distribution is known: exactly where it has a closed form (the
Markov chain's conditional entropy), else as its expectation over the held-out inputs (the mean
entropy of the Bayes posterior) or as the true predictor's loss on the held-out set itself
(the hidden Markov model). A model trained on the samples cannot beat it in expectation.
``seed`` draws the training samples; the held-out set depends on ``task_seed`` only, so every
method and seed is scored on the same examples. Nothing is downloaded; all in float64 where a
loss is computed, then stored as float32 / int64 tensors.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils.data import Dataset, TensorDataset

TASK_SEED = 1234  # the generative model of every task
HELDOUT_SEED = 4321  # the held-out samples, the same for every run


@dataclass
class Task:
    """A synthetic data set and what its true distribution scores.

    Attributes:
        train: the training samples (inputs, targets), drawn with the run's seed.
        heldout: the held-out samples, the same in every run.
        best_loss: mean cross-entropy (nats per prediction) of the true distribution on held-out
            data, the floor a model approaches.
        true_loss: the true distribution's mean cross-entropy on any sample of the task, e.g.
            ``true_loss(*task.heldout.tensors)``; for tests (it is close to ``best_loss``).
    """

    train: Dataset
    heldout: TensorDataset
    best_loss: float
    true_loss: Callable[..., float]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _entropy(log_probs: torch.Tensor) -> torch.Tensor:
    """``[..., K]`` log-probabilities -> ``[...]`` entropies in nats (0 log 0 = 0)."""
    return -(log_probs.exp() * log_probs.clamp(min=-1e30)).nansum(-1)


def _nll(log_probs: torch.Tensor, targets: torch.Tensor) -> float:
    """Mean of ``-log_probs[..., targets]``."""
    return float(-log_probs.gather(-1, targets.unsqueeze(-1)).mean())


# ---- a sparse Markov chain over tokens (the transformer's language) ------------------------


def markov_task(
    vocab: int, order: int, support: int, seq_len: int, train_seqs: int, heldout_seqs: int, seed: int
) -> Task:
    """Sequences from a sparse random Markov chain of ``order``; ``tokens [N, seq_len]`` int64.

    Each of the ``vocab**order`` contexts (the previous ``order`` tokens) allows ``support`` next
    tokens, with Dirichlet(1) weights. Sequences start from the chain's stationary distribution
    over contexts, so every position's context has that distribution and the best loss for
    predicting token ``t >= order`` is exactly the conditional entropy
    ``sum_context pi(context) H(P[context, :])``.
    """
    g = _gen(TASK_SEED)
    contexts = vocab**order
    allowed = torch.rand(contexts, vocab, generator=g).argsort(dim=1)[:, :support]
    weights = -torch.rand(contexts, support, generator=g, dtype=torch.float64).log()  # Dirichlet(1)
    probs = torch.zeros(contexts, vocab, dtype=torch.float64)
    probs.scatter_(1, allowed, weights / weights.sum(1, keepdim=True))
    pi = _stationary_contexts(probs, vocab)
    best = float((pi * _entropy(probs.log())).sum())

    def context_of(tokens: torch.Tensor, t: int) -> torch.Tensor:
        """``[N]`` context index of the tokens ``t - order .. t - 1`` (the oldest most significant)."""
        index = torch.zeros(len(tokens), dtype=torch.int64)
        for k in range(t - order, t):
            index = index * vocab + tokens[:, k]
        return index

    def sample(n: int, gen: torch.Generator) -> torch.Tensor:
        tokens = torch.empty(n, seq_len, dtype=torch.int64)
        first = torch.multinomial(pi, n, replacement=True, generator=gen)
        for k in range(order):
            tokens[:, k] = first // vocab ** (order - 1 - k) % vocab
        for t in range(order, seq_len):
            tokens[:, t] = torch.multinomial(probs[context_of(tokens, t)], 1, generator=gen).squeeze(1)
        return tokens

    def true_loss(tokens: torch.Tensor) -> float:
        context = torch.stack([context_of(tokens, t) for t in range(order, seq_len)], dim=1)
        return _nll(probs.log()[context], tokens[:, order:])

    return Task(
        TensorDataset(sample(train_seqs, _gen(seed))),
        TensorDataset(sample(heldout_seqs, _gen(HELDOUT_SEED))),
        best,
        true_loss,
    )


def _stationary_contexts(probs: torch.Tensor, vocab: int) -> torch.Tensor:
    """Stationary distribution ``[vocab**order]`` of the chain on contexts ``(a, b..) -> (b.., c)``.

    Iterates the lazy chain ``(I + M) / 2``, which has the same stationary distributions as ``M``
    and converges whether or not ``M`` is periodic.
    """
    contexts = probs.shape[0]
    table = probs.view(vocab, contexts // vocab, vocab)  # [a, b.., c] = P(c | a, b..)
    pi = torch.full((vocab, contexts // vocab), 1.0 / contexts, dtype=torch.float64)
    for _ in range(100_000):
        new = 0.5 * (pi + torch.einsum("ab,abc->bc", pi, table).reshape(vocab, -1))
        if (new - pi).abs().max() < 1e-14:
            return (new / new.sum()).reshape(-1)
        pi = new
    raise RuntimeError("the context chain's stationary distribution did not converge in 100000 steps")


# ---- gratings in noise (the CNN's images) --------------------------------------------------

# (cycles down, cycles across) per image: ten orientations and spatial frequencies a 3x3 filter can see
WAVES = [(3, 0), (0, 3), (4, 0), (0, 4), (3, 3), (3, -3), (4, 2), (2, 4), (4, -2), (2, -4)]


def grating_task(size: int, amplitude: float, train: int, heldout: int, seed: int) -> Task:
    """Images ``x [N, 1, size, size]`` float32: the class's sinusoidal grating (one wave vector of
    :data:`WAVES` per class) with amplitude ``amplitude`` and a uniformly random phase, plus white
    noise of std 1; ``y [N]`` uniform class ids (10 classes): texture classification.

    Integrating the Gaussian likelihood over the phase gives ``p(x | c) ~ I0(A R_c)`` with ``R_c``
    the magnitude of ``x``'s Fourier coefficient at the class's wave vector (every grating has the
    same energy ``size**2 / 2``), so the Bayes posterior is exact; the best loss is its mean entropy
    over the held-out images.
    """
    rows, cols = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    angle = torch.stack(
        [2 * math.pi * (ky * rows + kx * cols) / size for ky, kx in WAVES]
    ).double()  # [C, H, W]

    def sample(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.randint(len(WAVES), (n,), generator=gen)
        phase = 2 * math.pi * torch.rand(n, 1, 1, generator=gen, dtype=torch.float64)
        x = amplitude * torch.cos(angle[y] + phase) + torch.randn(
            n, size, size, generator=gen, dtype=torch.float64
        )
        return x.unsqueeze(1).float(), y

    def log_posterior(x: torch.Tensor) -> torch.Tensor:
        x = x.double().squeeze(1)
        magnitude = torch.hypot(
            torch.einsum("nhw,chw->nc", x, angle.cos()), torch.einsum("nhw,chw->nc", x, angle.sin())
        )
        z = amplitude * magnitude
        return torch.log_softmax(torch.special.i0e(z).log() + z, dim=1)  # log I0(z), stable

    x_held, y_held = sample(heldout, _gen(HELDOUT_SEED))
    best = float(_entropy(log_posterior(x_held)).mean())
    return Task(
        TensorDataset(*sample(train, _gen(seed))),
        TensorDataset(x_held, y_held),
        best,
        lambda x, y: _nll(log_posterior(x), y),
    )


# ---- a hidden Markov model (the GRU's sequences) --------------------------------------------


def hmm_task(
    states: int,
    vocab: int,
    stay: float,
    emission_alpha: float,
    seq_len: int,
    train: int,
    heldout: int,
    seed: int,
) -> Task:
    """Token sequences ``tokens [N, seq_len]`` int64 from a sticky hidden Markov model.

    The hidden state stays with probability ``stay``, else jumps to a random other state; each
    state emits from its own Dirichlet(``emission_alpha``) distribution over the tokens, and the
    emissions overlap, so predicting the next token needs a belief about the state. The true
    predictor is the forward algorithm; the best loss is its mean loss on the held-out set for the
    positions the model predicts (tokens 1 .. seq_len-1 from the tokens before them).
    """
    g = _gen(TASK_SEED)
    jump = -torch.rand(states, states, generator=g, dtype=torch.float64).log()
    jump.fill_diagonal_(0)
    trans = (1 - stay) * jump / jump.sum(1, keepdim=True) + stay * torch.eye(states, dtype=torch.float64)
    gamma = torch._standard_gamma(
        torch.full((states, vocab), emission_alpha, dtype=torch.float64), generator=g
    )
    emit = gamma / gamma.sum(1, keepdim=True)
    start = torch.linalg.matrix_power(trans, 4096)[0]  # the stationary distribution: trans mixes fast
    assert torch.allclose(start @ trans, start)

    def sample(n: int, gen: torch.Generator) -> torch.Tensor:
        tokens = torch.empty(n, seq_len, dtype=torch.int64)
        state = torch.multinomial(start, n, replacement=True, generator=gen)
        for t in range(seq_len):
            tokens[:, t] = torch.multinomial(emit[state], 1, generator=gen).squeeze(1)
            state = torch.multinomial(trans[state], 1, generator=gen).squeeze(1)
        return tokens

    def true_loss(tokens: torch.Tensor) -> float:
        """The forward algorithm: ``-log p(x_t | x_<t)`` averaged over t >= 1 and the sequences."""
        belief = start.expand(len(tokens), states) * emit[:, tokens[:, 0]].T
        belief = belief / belief.sum(1, keepdim=True)
        total = 0.0
        for t in range(1, seq_len):
            predicted = belief @ trans  # p(state_t | x_<t)
            joint = predicted * emit[:, tokens[:, t]].T
            p_token = joint.sum(1)
            total += float(-p_token.log().sum())
            belief = joint / p_token.unsqueeze(1)
        return total / (len(tokens) * (seq_len - 1))

    held = sample(heldout, _gen(HELDOUT_SEED))
    return Task(TensorDataset(sample(train, _gen(seed))), TensorDataset(held), true_loss(held), true_loss)


# ---- Gaussian mixtures per class (the speech DNN's frames) ----------------------------------


def frames_task(
    classes: int, components: int, dim: int, latent: int, noise: float, train: int, heldout: int, seed: int
) -> Task:
    """Spliced "fbank" windows ``x [N, dim]`` float32 (e.g. 17 x 40 = 680) with senone-like
    labels ``y [N]``: each class is a mixture of ``components`` Gaussians with one shared covariance.

    Fbank windows are strongly correlated, so the frames live near a random ``latent``-dimensional
    subspace: a component's mean there, plus Gaussian noise of std ``noise`` in the subspace, plus
    a little isotropic noise (std 0.1 of the signal) in all ``dim`` dimensions. Classes overlap and
    the boundaries are not linear (several components per class). Class priors fall off like real
    senone counts (``p(c) ~ 1/sqrt(c + 1)``). Features are scaled to about unit variance, as after
    mean and variance normalisation. The Bayes posterior is exact (whitened distances); the best
    loss is the mean entropy of that posterior over the held-out frames.
    """
    g = _gen(TASK_SEED)
    prior = 1.0 / torch.arange(1, classes + 1, dtype=torch.float64).sqrt()
    prior /= prior.sum()
    basis = torch.randn(latent, dim, generator=g, dtype=torch.float64) / math.sqrt(dim)  # rows ~ unit length
    centres = torch.randn(classes, components, latent, generator=g, dtype=torch.float64)  # [C, M, latent]
    floor = 0.1 * math.sqrt(1 + noise**2) / math.sqrt(dim / latent)  # the isotropic noise's std
    scale = math.sqrt((1 + noise**2) * latent / dim + floor**2)  # the features' std per dimension
    means = centres @ basis / scale  # [C, M, dim]
    # Whitening by the shared covariance makes the likelihood a Euclidean distance.
    cov = (noise**2 * basis.T @ basis + floor**2 * torch.eye(dim, dtype=torch.float64)) / scale**2
    whiten = torch.linalg.inv(torch.linalg.cholesky(cov))  # L^-1, so that cov^-1 = L^-T L^-1
    white_means = means @ whiten.T

    def sample_latent(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.multinomial(prior, n, replacement=True, generator=gen)
        m = torch.randint(components, (n,), generator=gen)
        return centres[y, m] + noise * torch.randn(n, latent, generator=gen, dtype=torch.float64), y

    def sample(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        z, y = sample_latent(n, gen)
        x = z @ basis + floor * torch.randn(n, dim, generator=gen, dtype=torch.float64)
        return (x / scale).float(), y

    def log_posterior(x: torch.Tensor) -> torch.Tensor:
        w = x.double() @ whiten.T
        dist2 = (
            w.square().sum(1)[:, None, None]
            - 2 * torch.einsum("nd,cmd->ncm", w, white_means)
            + white_means.square().sum(2)[None]
        )
        log_lik = torch.logsumexp(-dist2 / 2, dim=2) - math.log(components)
        return torch.log_softmax(log_lik + prior.log(), dim=1)

    x_held, y_held = sample(heldout, _gen(HELDOUT_SEED))
    best = float(_entropy(log_posterior(x_held)).mean())
    z, y = sample_latent(train, _gen(seed))
    frames = LatentFrames(z.float(), y, (basis / scale).float(), floor / scale, seed)
    return Task(frames, TensorDataset(x_held, y_held), best, lambda x, y: _nll(log_posterior(x), y))


class LatentFrames(Dataset):
    """Frames kept as their latent part ``z [N, latent]``; each batch is projected and gets its
    isotropic noise when it is loaded (``__getitems__``), so that a few 10^5 frames of 680 floats
    never sit in memory. The noise is drawn from a generator seeded by the run's seed and the
    batch's first index: the same run sees the same frames.

    Args:
        latent: ``[N, latent]`` the frames in the subspace. labels: ``[N]``.
        basis: ``[latent, dim]`` the projection (already scaled). floor: the isotropic noise's std.
        seed: the run's seed.
    """

    def __init__(
        self, latent: torch.Tensor, labels: torch.Tensor, basis: torch.Tensor, floor: float, seed: int
    ):
        self.latent, self.labels, self.basis, self.floor, self.seed = latent, labels, basis, floor, seed

    def __len__(self) -> int:
        return len(self.labels)

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        index = torch.as_tensor(indices)
        gen = _gen(self.seed * 2**32 + int(index[0]))
        x = self.latent[index] @ self.basis + self.floor * torch.randn(
            len(index), self.basis.shape[1], generator=gen
        )
        return list(zip(x, self.labels[index]))

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.__getitems__([i])[0]
