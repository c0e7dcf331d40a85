"""Stage 2: lexicon, tables, topology, L.fst, OOV policy and the whole prepare_lang."""

import pytest
from lhotse import CutSet, MonoCut, Recording, SupervisionSegment
from lhotse.audio import AudioSource
from local.data.normalize import normalize_words
from local.drops import count_drops, load_drops
from local.graph.lang import add_disambig, load_lang, prepare_lang, split_oov
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


def test_normalize_words():
    # one rule for corpus transcripts, the lexicon, the LM text and the references
    assert normalize_words("Don't stop, the-end!  'Quoted'") == ["DON'T", "STOP", "THE", "END", "QUOTED"]


def _data_dir(tmp_path, train, dev=DEV, test=None):
    data = tmp_path / "data"
    (data / "manifests").mkdir(parents=True)
    make_cuts(train, "train").to_file(data / "manifests" / "train_cuts.jsonl.gz")
    make_cuts(dev, "dev").to_file(data / "manifests" / "dev_cuts.jsonl.gz")
    if test:
        make_cuts(test, "test").to_file(data / "manifests" / "test_cuts.jsonl.gz")
    return data


def test_oov_words_are_counted_and_listed(lang):
    data, summary, _ = lang
    assert summary["train_oov_words"] == 1 and summary["train_oov_tokens"] == 1
    assert (data / "lang" / "oov.txt").read_text() == "ZZQXV 1\n"


def test_user_lexicon_replaces_and_extends_cmudict(tmp_path):
    data = _data_dir(tmp_path, TRAIN)
    lexicon = tmp_path / "lexicon.txt"
    # lexiconp layout for one line, stress digits, a special entry; ZZQXV is new, CAT replaced
    lexicon.write_text("<UNK> SPN\n!SIL SIL\nzzqxv 1.0 Z IH1 K S\nCAT K AE2 T\nCAT K EH T\n")
    summary = prepare_lang(data, lm_order=2, lexicon=lexicon)
    lg = load_lang(data / "lang")
    assert lg.lexicon["ZZQXV"] == [("Z", "IH", "K", "S")] and "ZZQXV" in lg.words
    assert lg.lexicon["CAT"] == [("K", "AE", "T"), ("K", "EH", "T")]
    assert summary["user_lexicon_words"] == 2 and summary["user_lexicon_new_words"] == 1
    assert summary["train_dropped_oov"] == 1  # only the empty transcript now
    bad = tmp_path / "bad.txt"
    bad.write_text("CAT K AE T\nDOG D OX G\n")
    with pytest.raises(ValueError, match=r"1 bad entries, e.g. line 2 \('DOG D OX G'\): phones \['OX'\]"):
        prepare_lang(data, lm_order=2, lexicon=bad)


def test_oov_g2p_keeps_the_utterance_with_flite_pronunciations(tmp_path):
    data = _data_dir(tmp_path, TRAIN)
    summary = prepare_lang(data, lm_order=2, oov="g2p")
    lg = load_lang(data / "lang")
    assert summary["g2p_words"] == 1 and summary["train_oov_words"] == 0
    pron = lg.lexicon["ZZQXV"][0]
    assert pron and set(pron) <= set(lg.phones)
    assert (data / "lang" / "g2p_lexicon.txt").read_text().startswith("ZZQXV ")
    assert "LIKES" in lg.words  # its utterance is kept
    with pytest.raises(ValueError, match="--oov 'guess': use drop"):
        prepare_lang(data, lm_order=2, oov="guess")


def test_lm_text_adds_sentences_and_counts_test_overlap(tmp_path, caplog):
    data = _data_dir(tmp_path, TRAIN, test=["a friend saw my dog"])
    text = tmp_path / "lm.txt"
    text.write_text("My friend saw the horse.\nthe qqzzy ran\n\nA friend saw my dog\n")
    summary = prepare_lang(data, lm_order=2, lm_text=text)
    lg = load_lang(data / "lang")
    assert "HORSE" in lg.words and "QQZZY" not in lg.words  # its sentence has a word no lexicon knows
    assert summary["lm_text_sentences"] == 2 and summary["lm_text_dropped_oov"] == 1
    assert summary["lm_text_test_sentences"] == 1 and "the LM has seen the test set" in caplog.text
    assert summary["lm_sentences"] == 5  # 3 distinct training sentences + 2 of the LM text
    with pytest.raises(FileNotFoundError, match="--lm-text .*nowhere.txt: no such file"):
        prepare_lang(data, lm_order=2, lm_text=tmp_path / "nowhere.txt")


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
