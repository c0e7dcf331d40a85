"""Stage 2: lexicon, tables, topology, L.fst, OOV policy and the whole prepare_lang."""

import pytest
from lhotse import CutSet, MonoCut, Recording, SupervisionSegment
from lhotse.audio import AudioSource
from local.drops import count_drops, load_drops
from local.graph.lang import add_disambig, load_lang, normalize_text, prepare_lang, split_oov
from local.kaldi import kaldifst, khg

TRAIN = [
    "the cat saw the dog",
    "a dog read the book",
    "the cat likes zzqxv",
    "my friend read a book",
    "",
    "The cat saw the dog.",
]
DEV = ["the dog saw a cat", "the cat saw qqzzy"]


def make_cuts(texts: list[str], split: str) -> CutSet:
    cuts = []
    for i, text in enumerate(texts):
        rid = f"{split}-{i}"
        rec = Recording(rid, [AudioSource("file", [0], f"/nonexistent/{rid}.wav")], 16000, 16000, 1.0)
        sup = SupervisionSegment(rid, rid, 0.0, 1.0, text=text, speaker=f"spk{i % 2}")
        cuts.append(MonoCut(rid, 0.0, 1.0, 0, recording=rec, supervisions=[sup]))
    return CutSet.from_cuts(cuts)


@pytest.fixture(scope="module")
def lang(tmp_path_factory):
    data = tmp_path_factory.mktemp("data")
    (data / "manifests").mkdir()
    make_cuts(TRAIN, "train").to_file(data / "manifests" / "train_cuts.jsonl.gz")
    make_cuts(DEV, "dev").to_file(data / "manifests" / "dev_cuts.jsonl.gz")
    summary = prepare_lang(data, lm_order=2)
    return data, summary, load_lang(data / "lang")


def test_normalize_text():
    assert normalize_text("Don't stop, the-end!  ") == ["DON'T", "STOP", "THE-END"]


def test_oov_policy(lang):
    data, summary, lg = lang
    drops = load_drops(data)
    assert {d["id"]: (d["reason"], d["detail"]) for d in drops} == {
        "train-2": ("oov", "ZZQXV"),
        "train-4": ("empty_transcript", ""),
    }
    assert count_drops(data, "lang") == {"oov": 1, "empty_transcript": 1}
    assert summary["train_kept"] == 4 and summary["train_dropped_oov"] == 2
    assert summary["lm_sentences"] == 3  # the repeated sentence counts once
    assert (data / "lang" / "train_ids.txt").read_text().split() == [
        "train-0",
        "train-1",
        "train-3",
        "train-5",
    ]
    # the vocabulary is the kept training words only: LIKES came from a dropped utterance
    assert "LIKES" not in lg.words and "ZZQXV" not in lg.words
    assert summary["dev_oov_rate"] == pytest.approx(1 / 9, abs=1e-4)  # QQZZY of 9 dev words
    # re-running does not double-count
    prepare_lang(data, lm_order=2)
    assert count_drops(data, "lang") == {"oov": 1, "empty_transcript": 1}


def test_split_oov_keeps_order():
    cuts = make_cuts(["a cat", "a zzqxv cat", "the cat"], "x")
    kept, dropped = split_oov(cuts, {"A", "CAT", "THE"})
    assert [c.id for c in kept] == ["x-0", "x-2"] and dropped == {"x-1": ["ZZQXV"]}


def test_tables_consistent(lang):
    _, _, lg = lang
    assert sorted(lg.words.values()) == list(range(len(lg.words)))
    assert sorted(lg.phones.values()) == list(range(len(lg.phones)))
    assert lg.words["<eps>"] == 0 and lg.phones["<eps>"] == 0 and lg.phones["SIL"] == 1
    assert {"#0", "<s>", "</s>"} <= set(lg.words)
    assert len(lg.phone_ids) == 40 and lg.disambig_phone_ids[0] == lg.phones["#0"]
    assert set(lg.lexicon) == {w for w in lg.words if w not in ("<eps>", "#0", "<s>", "</s>")}
    for prons in lg.lexicon.values():
        for pron in prons:
            assert all(p in lg.phones and not p[-1].isdigit() for p in pron)
    assert ("R", "EH", "D") in lg.lexicon["READ"] and ("R", "IY", "D") in lg.lexicon["READ"]


def test_disambig_homophones_and_prefixes():
    lex = [("TWO", ("T", "UW")), ("TOO", ("T", "UW")), ("TOOL", ("T", "UW", "L")), ("CAT", ("K", "AE", "T"))]
    out, max_k = add_disambig(lex)
    assert out == [
        ("TWO", ("T", "UW", "#1")),
        ("TOO", ("T", "UW", "#2")),
        ("TOOL", ("T", "UW", "L")),
        ("CAT", ("K", "AE", "T")),
    ]
    assert max_k == 2


def test_topology_loads(lang):
    _, _, lg = lang
    topo = khg.HmmTopology()
    topo.read(lg.topo_text)
    classes = topo.get_phone_to_num_pdf_classes()
    assert classes[lg.sil_id] == 5 and all(classes[p] == 3 for p in lg.nonsil_phone_ids)


def test_L_accepts_pronunciations_with_optional_silence(lang):
    _, _, lg = lang
    L = lg.L()
    assert L.num_states > 3
    word = lg.words["CAT"]
    phones = [lg.phones[p] for p in lg.lexicon["CAT"][0]]
    for seq in (phones, [lg.sil_id] + phones + [lg.sil_id]):
        acceptor = kaldifst.make_linear_acceptor(seq)
        out = kaldifst.compose(acceptor, L)
        ok, _, osyms, _ = kaldifst.get_linear_symbol_sequence(kaldifst.shortest_path(out))
        assert ok and [o for o in osyms if o] == [word]


def test_lm_and_G_written(lang):
    data, summary, _ = lang
    assert (data / "lang" / "lm.arpa").exists() and (data / "lang" / "G.fst").exists()
    assert summary["lm_dev_ppl"] > 1
