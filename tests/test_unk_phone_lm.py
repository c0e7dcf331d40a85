"""``recipes/asr/research/unk_phone_lm.py``: Kaldi's limit on G's unknown-word history, and the exact skip of
the states kaldilm's ``arpa2fst`` keeps with only a free back-off arc."""

import math

import pytest
from local.graph.lm import compile_G, train_lm
from local.kaldi import kaldifst
from unk_phone_lm import limit_unk_history, skip_redundant_states

SENTENCES = [["THE", "CAT", "SAW", "<UNK>"], ["THE", "<UNK>", "SAW", "THE", "DOG"], ["A", "<UNK>", "CAT"],
             ["THE", "DOG", "SAW", "A", "CAT"], ["A", "DOG", "<UNK>", "SAW", "THE", "CAT"]]


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    d = tmp_path_factory.mktemp("g")
    words = ["<eps>", "<UNK>", "A", "CAT", "DOG", "SAW", "THE", "#0", "<s>", "</s>"]
    (d / "words.txt").write_text("".join(f"{w} {i}\n" for i, w in enumerate(words)))
    train_lm(SENTENCES, d / "lm.arpa", order=3)
    return d, {w: i for i, w in enumerate(words)}


def _unk_destinations(g, unk: int) -> set[int]:
    return {a.nextstate for s in range(g.num_states) for a in kaldifst.ArcIterator(g, s) if a.olabel == unk}


def _backoff_as_epsilon(g_text: str, backoff: int):
    rows = [line.split() for line in g_text.splitlines() if line.strip()]
    rows = [[*r[:2], *("0" if x == str(backoff) else x for x in r[2:4]), *r[4:]] if len(r) >= 4 else r for r in rows]
    g = kaldifst.compile(s="\n".join(" ".join(r) for r in rows) + "\n", acceptor=False)
    kaldifst.arcsort(g, sort_type="ilabel")
    return g


def _cost(g, words: list[int]) -> float:
    best = kaldifst.shortest_path(kaldifst.compose(kaldifst.make_linear_acceptor(words), g))
    if best.num_states == 0:
        return math.inf
    total = 0.0
    for s in range(best.num_states):
        total += sum(float(a.weight.value) for a in kaldifst.ArcIterator(best, s))
        final = float(best.final(s).value)
        total += final if math.isfinite(final) else 0.0
    return total


def test_limit_unk_history_leaves_one_destination_and_the_rest_of_G(lm, tmp_path):
    d, ids = lm
    text = (d / "lm.arpa").read_text()
    limited, dropped = limit_unk_history(text, "<UNK>")
    grams = [line.split("\t") for line in limited.splitlines() if line.count("\t") >= 1]
    assert dropped > 0 and not [g for g in grams if "<UNK>" in g[1].split()[:-1]]  # no <UNK> history left
    assert not [g for g in grams if g[1].split()[-1] == "<UNK>" and len(g) == 3]  # nor a back-off after it
    for n in (1, 2, 3):  # \data\ counts what each section holds
        declared = int(limited.split(f"ngram {n}=")[1].split()[0])
        section = limited.split(f"\\{n}-grams:")[1].split("\\")[0]
        assert declared == sum(1 for line in section.splitlines() if line.strip())
    (tmp_path / "lm.arpa").write_text(limited)
    compile_G(tmp_path / "lm.arpa", d / "words.txt", tmp_path / "G.fst")
    raw = kaldifst.compile(s=(tmp_path / "G.fst.txt").read_text(), acceptor=False)
    skipped_text, moved = skip_redundant_states((tmp_path / "G.fst.txt").read_text(), ids["#0"])
    skipped = kaldifst.compile(s=skipped_text, acceptor=False)
    assert len(_unk_destinations(raw, ids["<UNK>"])) > 1 and moved > 0  # kaldilm keeps a state per history
    assert len(_unk_destinations(skipped, ids["<UNK>"])) == 1
    # exact: every word string costs what it cost before the skip (paths through the back-off arcs, #0 read
    # as epsilon, included)
    raw_eps, skipped_eps = (_backoff_as_epsilon(t, ids["#0"]) for t in ((tmp_path / "G.fst.txt").read_text(),
                                                                        skipped_text))
    for sent in (["THE", "<UNK>", "SAW", "THE", "DOG"], ["A", "CAT"], ["<UNK>", "<UNK>", "CAT"], ["DOG", "THE"]):
        labels = [ids[w] for w in sent]
        before, after = _cost(raw_eps, labels), _cost(skipped_eps, labels)
        assert math.isfinite(before) and after == pytest.approx(before, abs=1e-4)
