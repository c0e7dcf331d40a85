"""HCLG construction and decoding on a toy system, plus Kaldi-style scoring.

The acoustic evidence for an utterance is made from a known forced alignment: an equal
alignment of the training graph of its transcript gives one pdf per frame, and the
log-likelihood matrix peaks on that pdf. Decoding must return the transcript, for a
monophone tree and for a triphone tree (N=3, P=1) loaded from Kaldi's binary format.
"""

import numpy as np
import pytest
from local.gmm.event_map import Const, Split, Table, load_context_dependency, write_context_dependency
from local.graph.decode import (
    BEAM,
    MAX_ACTIVE,
    _decode_all,
    decode_utterances,
    decode_utterances_gmm,
    score,
    tid_to_pdf,
    words_to_text,
)
from local.graph.hclg import make_hclg, training_graph_compiler, with_word_penalty
from local.graph.lang import cmu_lexicon, load_lang, write_lang
from local.graph.lm import compile_G, train_lm
from local.kaldi import kaldifst, khg

SENTENCES = [
    "THE CAT SAW THE DOG",
    "A DOG SAW A CAT",
    "THE DOG LIKES THE CAT",
    "MY FRIEND READ A BOOK",
    "THE BOOK",
    "MY CAT LIKES A BOOK",
]
TESTS = ["THE DOG LIKES THE CAT", "A CAT SAW MY FRIEND", "THE BOOK"]


@pytest.fixture(scope="module")
def lang(tmp_path_factory):
    d = tmp_path_factory.mktemp("lang")
    sents = [s.split() for s in SENTENCES]
    write_lang(d, sorted({w for s in sents for w in s}), cmu_lexicon())
    train_lm(sents, d / "lm.arpa", order=2)
    compile_G(d / "lm.arpa", d / "words.txt", d / "G.fst")
    return load_lang(d)


def triphone_tree(lang, topo):
    """Per phone and pdf class a leaf, except AE's centre state split on the left phone (vowel or not)."""
    classes = topo.get_phone_to_num_pdf_classes()
    entries, pdf = [None] * (max(lang.phone_ids) + 1), 0
    vowels = tuple(sorted(lang.phones[p] for p in ("AA", "AE", "AH", "AO", "EH", "IH", "IY", "UW")))
    for p in lang.phone_ids:
        states = []
        for c in range(classes[p]):
            if p == lang.phones["AE"] and c == 1:
                states.append(Split(key=0, yes_set=vowels, yes=Const(pdf), no=Const(pdf + 1)))
                pdf += 2
            else:
                states.append(Const(pdf))
                pdf += 1
        entries[p] = Table(key=-1, entries=tuple(states))
    return load_context_dependency(write_context_dependency(Table(key=1, entries=tuple(entries)), 3, 1))


def build_system(lang, kind: str):
    topo = khg.HmmTopology()
    topo.read(lang.topo_text)
    if kind == "mono":
        tree = khg.monophone_context_dependency(
            phones=lang.phone_ids, phone2num_pdf_classes=topo.get_phone_to_num_pdf_classes()
        )
    else:
        tree = triphone_tree(lang, topo)
    tm = khg.TransitionModel(ctx_dep=tree, hmm_topo=topo)
    return kind, tree, tm, make_hclg(lang.dir, tree, tm)


@pytest.fixture(scope="module", params=["mono", "tri"])
def system(request, lang):
    return build_system(lang, request.param)


def aligned_pdfs(lang, tree, tm, text: str, frames: int, seed: int) -> np.ndarray:
    graph = training_graph_compiler(lang.dir, tree, tm).compile_graph_from_text(lang.word_ids(text.split()))
    ok, afst = kaldifst.equal_align(ifst=graph, length=frames, rand_seed=seed, num_retries=10)
    assert ok
    ok, tids, words, _ = kaldifst.get_linear_symbol_sequence(afst)
    assert ok and len(tids) == frames and words == lang.word_ids(text.split())
    return tid_to_pdf(tm)[np.asarray(tids) - 1]


def test_hclg_shape(system, lang, tmp_path):
    kind, tree, tm, hclg = system
    assert (tree.context_width, tree.central_position) == ((1, 0) if kind == "mono" else (3, 1))
    assert tm.num_pdfs == (122 if kind == "mono" else 123)
    ilabels, olabels = set(), set()
    for s in range(hclg.num_states):
        it = kaldifst.ArcIterator(hclg, s)
        while not it.done:
            ilabels.add(it.value.ilabel)
            olabels.add(it.value.olabel)
            it.next()
    assert ilabels - {0} <= set(range(1, tm.num_transition_ids + 1))  # no disambiguation ids left
    assert olabels - {0} == {i for w, i in lang.words.items() if w in lang.lexicon}
    make_hclg(lang.dir, tree, tm, out_path=tmp_path / "HCLG.fst")
    assert kaldifst.StdVectorFst.read(str(tmp_path / "HCLG.fst")).num_states == hclg.num_states


def _arcs(fst) -> tuple[list, list]:
    """The arcs ``(ilabel, olabel, weight)`` and final weights of ``fst``, sorted (state numbers left out)."""
    arcs, finals = [], []
    for s in range(fst.num_states):
        it = kaldifst.ArcIterator(fst, s)
        while not it.done:
            a = it.value
            arcs.append((a.ilabel, a.olabel, round(float(a.weight.value), 4)))
            it.next()
        if np.isfinite(float(fst.final(s).value)):
            finals.append(round(float(fst.final(s).value), 4))
    return sorted(arcs), sorted(finals)


def test_word_penalty_adds_to_every_word_arc_and_nothing_else(system, lang):
    _, _, _, hclg = system
    trimmed = kaldifst.StdVectorFst(hclg)
    kaldifst.connect(trimmed)  # (this small graph has dead ends; composing leaves them out)
    arcs, finals = _arcs(trimmed)
    penalized = with_word_penalty(hclg, 0.5, lang.id2word)
    assert penalized.num_states == trimmed.num_states
    expected = sorted((i, o, round(w + (0.5 if o else 0.0), 4)) for i, o, w in arcs)
    assert _arcs(penalized) == (expected, finals)
    assert sum(o != 0 for _, o, _ in arcs) > 0
    words = [w for w in lang.id2word if w]
    with pytest.raises(RuntimeError, match="not in words.txt"):
        with_word_penalty(hclg, 0.5, words[: len(words) // 2])


def test_decode_peaked_loglik_returns_transcript(system, lang):
    _, tree, tm, hclg = system
    utts = []
    for i, text in enumerate(TESTS):
        pdfs = aligned_pdfs(lang, tree, tm, text, frames=40 * len(text.split()), seed=i)
        loglik = np.full((len(pdfs), tm.num_pdfs), -15.0, dtype=np.float32)
        loglik[np.arange(len(pdfs)), pdfs] = 0.0
        utts.append((f"u{i}", loglik))
    hyps = decode_utterances(hclg, tm, utts, acoustic_scale=1.0)
    assert {u: words_to_text(w, lang.id2word) for u, w in hyps.items()} == {
        f"u{i}": t for i, t in enumerate(TESTS)
    }
    with pytest.raises(ValueError, match="expected"):
        decode_utterances(hclg, tm, [("bad", utts[0][1][:, :-1])], acoustic_scale=1.0)


def test_decode_gmm(lang):
    _, tree, tm, hclg = build_system(lang, "mono")  # the GMM decodable does not depend on the tree
    rng = np.random.default_rng(0)
    dim = 8
    means = 4.0 * rng.standard_normal((tm.num_pdfs, dim))
    am = khg.AmDiagGmm()
    for m in means:
        g = khg.DiagGmm(nmix=1, dim=dim)
        g.set_weights(np.ones(1, dtype=np.float32))
        g.set_means(m[None].astype(np.float32))
        g.set_invvars(np.ones((1, dim), dtype=np.float32))
        g.compute_gconsts()
        am.add_pdf(g)
    text = TESTS[1]
    pdfs = aligned_pdfs(lang, tree, tm, text, frames=200, seed=3)
    feats = (means[pdfs] + 0.3 * rng.standard_normal((len(pdfs), dim))).astype(np.float32)
    alis = {}
    hyps = decode_utterances_gmm(hclg, tm, am, [("g", feats)], acoustic_scale=0.1, alignments=alis)
    assert words_to_text(hyps["g"], lang.id2word) == text
    assert len(alis["g"]) == len(pdfs)  # the best path's transition-ids: one per frame
    assert np.mean(tid_to_pdf(tm)[alis["g"] - 1] == pdfs) > 0.9


def test_best_path_decoder_agrees_with_lattice_decoder(system, lang):
    """The recipe decodes with Kaldi's FasterDecoder; Kaldi's LatticeFasterDecoder with the same beams
    finds the same best path (words and transition-ids) on noisy log-likelihoods."""
    _, tree, tm, hclg = system
    rng = np.random.default_rng(7)
    tid2pdf = tid_to_pdf(tm)
    config = khg.LatticeFasterDecoderConfig(beam=BEAM, max_active=MAX_ACTIVE, lattice_beam=6.0)
    lattice_decoder = khg.LatticeFasterDecoder(hclg, config)
    for i, text in enumerate(TESTS):
        pdfs = aligned_pdfs(lang, tree, tm, text, frames=30 * len(text.split()), seed=10 + i)
        loglik = rng.normal(-6.0, 2.0, (len(pdfs), tm.num_pdfs)).astype(np.float32)
        loglik[np.arange(len(pdfs)), pdfs] += 4.0
        words = decode_utterances(hclg, tm, [("u", loglik)], acoustic_scale=0.5)["u"]
        alis = {}
        per_tid = np.ascontiguousarray(0.5 * loglik[:, tid2pdf])
        _decode_all(hclg, [("u", len(pdfs), khg.DecodableCtc(per_tid))], BEAM, MAX_ACTIVE, alis)
        ok, tids, lattice_words, _ = khg.decode_utterance_lattice_faster(
            decoder=lattice_decoder, decodable=khg.DecodableCtc(per_tid), trans_model=tm, utt="u", allow_partial=True
        )
        assert ok and list(lattice_words) == words
        assert np.array_equal(np.asarray(tids), alis["u"])


def test_score_counts_and_files(tmp_path):
    refs = {"a": "the cat saw the dog", "b": "a book", "c": "my zebra", "d": "the book"}
    hyps = {"a": "THE CAT SAW DOG", "b": "A BIG BOOK", "c": "MY CAT"}  # d missing: all deleted
    r = score(refs, hyps, tmp_path, "test")
    assert (r["words"], r["del"], r["ins"], r["sub"]) == (11, 1 + 2, 1, 1)
    assert r["wer"] == pytest.approx(100 * 5 / 11, abs=0.01) and r["sentence_errors"] == 4
    errs = (tmp_path / "errs-test.txt").read_text()
    assert errs.startswith("%WER 45.45 [ 5 / 11, 1 ins, 3 del, 1 sub ]")
    assert "(ZEBRA->CAT)" in errs and "(***->BIG)" in errs and "(THE->***)" in errs
    assert "c:\tref=['MY', 'ZEBRA']" in (tmp_path / "recogs-test.txt").read_text()
    assert score({"x": "a b"}, {"x": "A B"}, tmp_path, "ok")["wer"] == 0.0


def _unk_lang(d, unk_model: str, extra: tuple[str, ...] = ()):
    """A lang whose vocabulary has ``<UNK>`` (pronounced SPN) as ``--oov unk`` writes it, its LM trained on
    SENTENCES with an unknown word in one of them; ``extra`` words join the vocabulary."""
    cmu = cmu_lexicon()
    cmu["<UNK>"] = [("SPN",)]
    sents = [s.split() for s in SENTENCES] + [["THE", "<UNK>", "SAW", "THE", "DOG"]]
    vocab = sorted({w for s in sents for w in s} | set(extra))
    summary = write_lang(d, vocab, cmu, unk="<UNK>", unk_model=unk_model)
    (d / "unk_word.txt").write_text("<UNK>\n")
    train_lm(sents, d / "lm.arpa", order=2)
    compile_G(d / "lm.arpa", d / "words.txt", d / "G.fst")
    return summary, load_lang(d)


def _words_of(fst, phones: list[int]) -> list[int] | None:
    best = kaldifst.shortest_path(kaldifst.compose(kaldifst.make_linear_acceptor(phones), fst))
    if best.num_states == 0:
        return None  # no path
    ok, _, osyms, _ = kaldifst.get_linear_symbol_sequence(best)
    assert ok
    return [o for o in osyms if o]


def test_unk_is_spelled_out_of_phones_in_decoding_only(tmp_path):
    summary, lg = _unk_lang(tmp_path / "phone", "phone")
    assert summary["unk_model"] == "phone" and summary["unk_phone_pairs"] > 1000  # CMUdict's seen phone pairs
    hash_unk, unk = lg.phones["#unk"], lg.words["<UNK>"]
    assert hash_unk in lg.disambig_phone_ids and hash_unk not in lg.phone_ids
    zebra = [lg.phones[p] for p in ("Z", "IY", "B", "R", "AH")]  # a word the vocabulary lacks
    L_dis, L = lg.L_disambig(), lg.L()
    assert _words_of(L_dis, [hash_unk, *zebra, hash_unk]) == [unk]
    assert _words_of(L_dis, zebra) is None  # not without its brackets
    assert _words_of(L_dis, [hash_unk, lg.phones["AH"], hash_unk]) is None  # two phones at least
    assert _words_of(L_dis, [lg.phones["SPN"]]) is None  # no garbage phone in decoding
    cat = [lg.phones[p] for p in lg.lexicon["CAT"][0]]
    assert _words_of(L_dis, [*cat, hash_unk, *zebra, hash_unk, lg.sil_id]) == [lg.words["CAT"], unk]
    assert _words_of(L, [lg.phones["SPN"]]) == [unk]  # training's lexicon keeps <UNK> as SPN
    spn_summary, spn = _unk_lang(tmp_path / "spn", "spn")
    assert spn_summary["unk_model"] == "spn" and "#unk" not in spn.phones
    assert _words_of(spn.L_disambig(), [spn.phones["SPN"]]) == [spn.words["<UNK>"]]
    with pytest.raises(ValueError, match="--unk-model 'letters': use phone"):
        write_lang(tmp_path / "bad", ["CAT", "<UNK>"], {"CAT": [("K", "AE", "T")], "<UNK>": [("SPN",)]},
                   unk="<UNK>", unk_model="letters")


@pytest.mark.parametrize("kind", ["mono", "tri"])
def test_decoder_spells_an_unknown_word_as_unk(tmp_path, kind):
    """Evidence aligned to THE ZEBRA SAW THE DOG (ZEBRA outside the vocabulary) decodes as THE <UNK> SAW THE DOG
    with the phone-spelled unknown word; with SPN alone the unknown word's frames cannot be <UNK>."""
    _, source = _unk_lang(tmp_path / "source", "spn", extra=("ZEBRA",))  # the same phones: the evidence's lang
    results = {}
    for model in ("phone", "spn"):
        _, lg = _unk_lang(tmp_path / model, model)
        assert [lg.phones[p] for p in ("SIL", "SPN", "Z")] == [source.phones[p] for p in ("SIL", "SPN", "Z")]
        _, tree, tm, hclg = build_system(lg, kind)
        pdfs = aligned_pdfs(source, tree, tm, "THE ZEBRA SAW THE DOG", frames=200, seed=0)
        loglik = np.full((len(pdfs), tm.num_pdfs), -15.0, dtype=np.float32)
        loglik[np.arange(len(pdfs)), pdfs] = 0.0
        hyps = decode_utterances(hclg, tm, [("u", loglik)], acoustic_scale=1.0)
        results[model] = words_to_text(hyps["u"], lg.id2word)
    assert results["phone"] == "THE <UNK> SAW THE DOG"
    assert results["spn"] != results["phone"]
