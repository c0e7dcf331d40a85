"""The n-gram estimator: normalisation, smoothing, ARPA round trip, G.fst compilation."""

import math
import random

import pytest
from local.graph.lm import BOS, EOS, ArpaLM, compile_G, estimate_kn, kn_discounts, train_lm, write_arpa

SUBJECTS = ["THE CAT", "A DOG", "MY FRIEND", "THE TEACHER", "OUR NEIGHBOUR"]
VERBS = ["SAW", "LIKES", "CALLED", "FOUND"]
OBJECTS = ["THE BALL", "A HOUSE", "THE RED CAR", "HER BOOK", "SOME WATER"]


def template_sentences(n: int, seed: int) -> list[list[str]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        s = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}"
        if rng.random() < 0.3:
            s += " TODAY"
        out.append(s.split())
    return out


@pytest.fixture(scope="module")
def trigram(tmp_path_factory):
    sents = template_sentences(300, seed=0)
    vocab = sorted({w for s in sents for w in s} | {"UNSEEN"})
    path = tmp_path_factory.mktemp("lm") / "lm.arpa"
    write_arpa(estimate_kn(sents, 3, vocab), path)
    return ArpaLM(path), sents


def test_every_history_sums_to_one(trigram):
    lm, _ = trigram
    predicted = lm.vocab
    assert EOS in predicted and BOS not in predicted and "UNSEEN" in predicted
    histories = [()] + [g for g in lm.prob if len(g) < lm.order] + [("NOT", "SEEN"), ("CAT", "TODAY")]
    for h in histories:
        total = sum(10 ** lm.logprob(w, h) for w in predicted)
        assert total == pytest.approx(1.0, abs=1e-4), f"history {h} sums to {total}"


def test_seen_continuations_beat_unseen(trigram):
    lm, _ = trigram
    assert lm.logprob("CAT", (BOS, "THE")) > lm.logprob("CAT", (BOS, "A"))
    assert lm.logprob("UNSEEN", ()) > -math.inf  # vocabulary words keep the uniform share


def test_trigram_perplexity_below_unigram(tmp_path):
    train, dev = template_sentences(400, seed=1), template_sentences(100, seed=2)
    ppl = {}
    for order in (1, 3):
        ppl[order] = train_lm(train, tmp_path / f"{order}.arpa", order=order, held_out={"dev": dev})[
            "lm_dev_ppl"
        ]
    assert ppl[3] < 0.5 * ppl[1], ppl


def test_discounts_in_range_and_fallback():
    d = kn_discounts({1: 100, 2: 40, 3: 20, 4: 10})
    assert all(0 < dk < k for k, dk in zip((1, 2, 3), d))
    assert kn_discounts({1: 3}) == (0.5, 0.5, 0.5)


def test_oov_in_training_raises():
    with pytest.raises(ValueError, match="not in the vocabulary"):
        estimate_kn([["A", "B"]], 2, ["A"])


def test_perplexity_counts_oov(trigram):
    lm, _ = trigram
    r = lm.perplexity([["THE", "ZEBRA", "SAW", "THE", "BALL"]])
    assert r["oov"] == 1 and r["tokens"] == 5


def test_G_compiles(tmp_path):
    sents = template_sentences(50, seed=3)
    vocab = sorted({w for s in sents for w in s})
    words = ["<eps>"] + vocab + ["#0", BOS, EOS]
    (tmp_path / "words.txt").write_text("".join(f"{w} {i}\n" for i, w in enumerate(words)))
    train_lm(sents, tmp_path / "lm.arpa", order=2)
    out = compile_G(tmp_path / "lm.arpa", tmp_path / "words.txt", tmp_path / "G.fst")
    assert out["G_states"] > len(vocab)
    labels = {
        int(f[2])
        for f in (line.split() for line in (tmp_path / "G.fst.txt").read_text().splitlines())
        if len(f) >= 4
    }
    assert words.index("#0") in labels  # backoff arcs
    assert labels <= set(range(len(words)))
