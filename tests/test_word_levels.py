"""The update mode's ``word_levels``: a word carries ``2^k tau``, the largest that its element holds, so
a residual far above the threshold drains in fewer steps; what is not sent stays, with its sign.

One rank by hand for the levels themselves, 2 forked CPU ranks for what every rank must agree on:
replicas bit-identical and every wanted step applied or kept, with plain words and Rice-coded ones."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from _strategy_helpers import TinyMLP, fit, keep_master_port  # noqa: F401  (autouse: the fork launcher)
from test_update import LR, UPDATE, _step_once, check_conservation, one_rank  # noqa: F401  (a fixture)

from gtc_lightning import GTCStrategy
from gtc_lightning.algorithms.gtc.config import resolve_word_levels
from gtc_lightning.algorithms.gtc.update import level_votes, split_levels_
from gtc_lightning.ops.rice import rice_decode, rice_encode, rice_split


class Levels(L.Callback):
    """Writes the word levels the strategy's state resolved to."""

    def __init__(self, out) -> None:
        self.out = out

    def on_train_end(self, trainer, pl_module):
        torch.save(trainer.strategy.gtc_state.word_levels, self.out / f"levels{trainer.global_rank}.pt")


@pytest.mark.usefixtures("one_rank")
def test_each_word_carries_the_largest_power_of_two_of_tau_its_element_holds():
    """tau 1, lr 0.5, 4 levels: elements holding 0.5, 1.5, 2.5, 5, 9 and -20 send nothing, 1, 2, 4, 8 and -8;
    the residual keeps 0.5, 0.5, 0.5, 1, 1 and -12 (nothing overshoots); the parameter moves by lr times
    what was sent."""
    from gtc_lightning import GTCState

    torch.manual_seed(0)
    layer = torch.nn.Linear(6, 1, bias=False)
    params = list(layer.parameters())
    held = torch.tensor([[0.5, 1.5, 2.5, 5.0, 9.0, -20.0]])
    state = GTCState(None, layer.named_parameters(), tau=1.0, compress="update", word_levels=4)
    before = params[0].detach().clone()
    stats = _step_once(state, params, [held], lr=0.5)
    assert stats.words == 5
    sent = torch.tensor([[0.0, 1.0, 2.0, 4.0, 8.0, -8.0]])
    assert torch.allclose(state._residual.view(1, 6), held - sent, rtol=0, atol=1e-6)
    assert torch.allclose(before - params[0].detach(), 0.5 * sent, rtol=0, atol=1e-6)
    assert stats.bytes_sent == 0  # one rank: nothing on the wire


def test_the_top_level_caps_what_a_word_carries():
    """|r| 5 and 10 (tau 1 already taken off): with 2 levels both words carry 2, with 3 levels 4."""
    residual = torch.tensor([0.0, 4.0, -9.0])
    words = torch.tensor([1, 2 | -(1 << 31)], dtype=torch.int32)
    two = residual.clone()
    assert split_levels_(two, words.clone(), 1.0, 2) == [2]
    assert torch.equal(two, torch.tensor([0.0, 3.0, -8.0]))
    three = residual.clone()
    assert split_levels_(three, words.clone(), 1.0, 3) == [0, 2]
    assert torch.equal(three, torch.tensor([0.0, 1.0, -6.0]))


def test_words_are_regrouped_by_level_and_decoded_back_in_index_order():
    residual = torch.zeros(10)
    residual[[1, 4, 7, 9]] = torch.tensor([0.2, -3.5, 1.0, 0.0])  # after tau = 1 came off
    words = torch.tensor([1, 4 | -(1 << 31), 7, 9], dtype=torch.int32)
    upper = split_levels_(residual, words, 1.0, 3)  # |r| 1.2, 4.5, 2.0, 1.0 -> levels 0, 2, 1, 0
    assert upper == [1, 1]
    assert (words & 0x7FFFFFFF).tolist() == [1, 9, 7, 4]
    index, votes = level_votes(words, 0.5, upper)
    assert index.tolist() == [1, 4, 7, 9]
    assert votes.tolist() == [0.5, -2.0, 1.0, 0.5]


def test_rice_coded_levels_split_back_into_their_messages():
    segments = [torch.tensor([3, 40, 41 | -(1 << 31)], dtype=torch.int32), torch.tensor([7], dtype=torch.int32)]
    data = torch.cat([rice_encode(s) for s in segments])
    parts = rice_split(data)
    assert len(parts) == 2
    assert all(torch.equal(rice_decode(p), s) for p, s in zip(parts, segments))
    with pytest.raises(ValueError, match="corrupt Rice-coded messages"):
        rice_split(data[:-4])


@pytest.mark.parametrize("coding", ["none", "rice"])
def test_levels_keep_replicas_identical_and_every_step_applied_or_kept(tmp_path, coding):
    """2 ranks, plain SGD, a threshold fixed at 1e-3 (below most gradient elements, so that most words go
    out at the upper levels): what each rank wanted is applied or kept, on both ranks alike, and some
    element moved by more than one word of tau could move it."""
    tau = 1e-3
    options = {**UPDATE, "tau": tau, "target_density": None, "coding": coding, "word_levels": 4}
    _, ranks = fit(tmp_path, model_kwargs={"momentum": 0.0, "lr": LR}, **options)
    steps = len(ranks[0]["records"])
    directions = [[rank["records"][t]["local_grad"] for rank in ranks] for t in range(steps)]
    assert check_conservation(ranks, directions, LR) == 8
    moved = (ranks[0]["start"]["params"] - ranks[0]["records"][0]["params"]).abs().max() / LR
    assert moved > 2 * tau, "one level moves an element by at most tau (both ranks' words)"
    assert ranks[0]["records"][-1]["loss"] < ranks[0]["records"][0]["loss"]


@pytest.mark.parametrize(("make", "levels"), [
    (lambda ps: torch.optim.SGD(ps, lr=0.1), 4),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), 1),
    (lambda ps: torch.optim.AdamW(ps), 1),
], ids=["plain-sgd", "momentum-sgd", "adamw"])  # fmt: skip
def test_auto_is_four_levels_for_plain_sgd_alone(make, levels):
    optimizer = make(torch.nn.Linear(2, 2).parameters())
    got, why = resolve_word_levels("auto", optimizer)
    assert got == levels and "word_levels='auto'" in why
    assert resolve_word_levels(2, optimizer) == (2, "as asked")


def test_auto_is_resolved_at_the_first_step_and_trains_with_identical_replicas(tmp_path):
    _, ranks = fit(tmp_path, model_kwargs={"momentum": 0.0, "lr": LR}, **{**UPDATE, "coding": "rice"},
                   trainer_kwargs={"callbacks": [Levels(tmp_path)]})  # fmt: skip
    for a, b in zip(ranks[0]["records"], ranks[1]["records"]):
        assert torch.equal(a["params"], b["params"])
    assert [torch.load(tmp_path / f"levels{r}.pt") for r in range(2)] == [4, 4]


def test_word_levels_are_checked_and_refused_with_the_gradient_mode():
    with pytest.raises(ValueError, match=r"Expect word_levels to be an int in \[1, 8\] .* got 0"):
        GTCStrategy(word_levels=0)
    with pytest.raises(ValueError, match="got True"):
        GTCStrategy(word_levels=True)
    with pytest.raises(ValueError, match="^word_levels=4: the update mode's options"):
        GTCStrategy(compress="gradient", word_levels=4)
    GTCStrategy(compress="gradient", word_levels=1)
    GTCStrategy(compress="gradient", word_levels="auto")
    assert GTCStrategy()._word_levels == "auto"
