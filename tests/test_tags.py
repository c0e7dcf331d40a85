"""Real corpora's tags and a user's LM: noise tags and ``<UNK>`` as words of silence-like phones (SPN, NSN)
left out of scoring, ``--oov unk``, a user lexicon's SPN/NSN entries, and ``--lm-arpa`` for the first pass."""

import gzip
import json
import re

import pytest
from local.data.normalize import normalize_words, scored_words
from local.graph.decode import score
from local.graph.lang import load_lang, prepare_lang
from local.graph.lexicon import default_oov
from local.graph.lm import ArpaLM, make_rescore_lm
from local.graph.tags import DEFAULT_TAGS, check_unk_word, parse_tags
from local.kaldi import khg
from test_lang import make_cuts

TRAIN = ["the cat saw the dog", "[noise] a dog read the book", "the cat likes zzqxv <unk>", "my friend read a book"]
DEV = ["the dog saw a cat [laughter]", "the cat saw qqzzy"]


def _data_dir(tmp_path, train=TRAIN, dev=DEV):
    data = tmp_path / "data"
    (data / "manifests").mkdir(parents=True)
    make_cuts(train, "train").to_file(data / "manifests" / "train_cuts.jsonl.gz")
    make_cuts(dev, "dev").to_file(data / "manifests" / "dev_cuts.jsonl.gz")
    return data


def test_tags_are_normalised_whole():
    # (before: NOISE SPOKEN NOISE, three words of the lexicon, the LM and the references)
    assert normalize_words("[noise] <SPOKEN_NOISE>") == ["[NOISE]", "<SPOKEN_NOISE>"]
    assert normalize_words("so[laughter]well <unk> [vocalized-noise]") == [
        "SO", "[LAUGHTER]", "WELL", "<UNK>", "[VOCALIZED-NOISE]"]  # fmt: skip
    assert normalize_words("well-known 'quoted'") == ["WELL", "KNOWN", "QUOTED"]  # words as before
    assert scored_words("[noise] the <unk> cat <NOISE>") == ["THE", "CAT"]


def test_scoring_leaves_tags_and_unk_out_of_both_sides(tmp_path):
    refs = {"a": "the [noise] cat <unk> sat", "b": "[laughter]"}
    hyps = {"a": "<UNK> the cat [LAUGHTER] sat <SPOKEN_NOISE>", "b": "[noise] <unk>"}
    result = score(refs, hyps, tmp_path, "dev")
    assert result["wer"] == 0.0 and result["words"] == 3 and result["errors"] == 0
    assert result["sentence_errors"] == 0
    # an OOV word stays in the reference, an error the decoder cannot avoid
    assert score({"a": "the cat zzqxv"}, {"a": "the cat <UNK>"}, tmp_path, "x")["errors"] == 1


def test_unk_keeps_the_utterance_and_maps_tags_and_oov(tmp_path):
    data = _data_dir(tmp_path)
    summary = prepare_lang(data, lm_order=2, oov="unk")
    lg = load_lang(data / "lang")
    # every training utterance kept: ZZQXV maps to <UNK>, the tags are words of their own
    assert summary["train_kept"] == 4 and summary["train_dropped_oov"] == 0
    assert summary["train_oov_words"] == 1 and summary["unk_word"] == "<UNK>" and lg.unk == "<UNK>"
    assert summary["train_tag_tokens"] == {"<UNK>": 1, "[NOISE]": 1}
    assert lg.lexicon["<UNK>"] == [("SPN",)] and lg.lexicon["[NOISE]"] == [("NSN",)]
    assert "ZZQXV" not in lg.words and "NOISE" not in lg.words
    utt = normalize_words(TRAIN[2])
    assert lg.word_ids(utt) == [lg.words[w] for w in ("THE", "CAT", "LIKES", "<UNK>", "<UNK>")]
    # silence-like phones: after SIL, in the silence topology and in the silence set
    assert [p for p, _ in sorted(lg.phones.items(), key=lambda x: x[1])][:4] == ["<eps>", "SIL", "SPN", "NSN"]
    assert lg.silence_ids == [1, 2, 3] and not set(lg.silence_ids) & set(lg.nonsil_phone_ids)
    topo = khg.HmmTopology()
    topo.read(lg.topo_text)
    classes = topo.get_phone_to_num_pdf_classes()
    assert [classes[p] for p in lg.silence_ids] == [5, 5, 5]
    assert summary["silence_phones"] == ["SIL", "SPN", "NSN"]
    # the LM has them as words, and the rescoring LM maps the OOV as the lang stage did
    lm = ArpaLM(data / "lang" / "lm.arpa")
    assert {"<UNK>", "[NOISE]"} <= set(lm.vocab) and "ZZQXV" not in lm.vocab
    assert "<UNK>" in ArpaLM(make_rescore_lm(data, 3)).vocab


def test_drop_keeps_the_phone_set_of_a_corpus_without_tags(tmp_path):
    # the embedded corpus: no tags, no OOV, --oov drop (its default): no SPN, no NSN, ids as before
    data = _data_dir(tmp_path, ["the cat saw the dog", "a dog read the book"], ["the dog saw a cat"])
    summary = prepare_lang(data, lm_order=2)
    lg = load_lang(data / "lang")
    assert "SPN" not in lg.phones and "NSN" not in lg.phones and lg.silence_ids == [1]
    assert lg.phones["AA"] == 2 and len(lg.phone_ids) == 40 and "silence_phones" not in summary
    assert lg.unk is None and not (data / "lang" / "unk_word.txt").exists()
    assert default_oov("synthetic") == "drop" and default_oov("kaldi") == default_oov("librispeech") == "unk"


def test_drop_policy_still_drops_oov_but_takes_tags(tmp_path):
    data = _data_dir(tmp_path)
    summary = prepare_lang(data, lm_order=2, oov="drop")
    lg = load_lang(data / "lang")
    assert summary["train_dropped_oov"] == 1  # ZZQXV's utterance
    assert lg.lexicon["[NOISE]"] == [("NSN",)] and "SPN" not in lg.phones and "<UNK>" not in lg.words
    with pytest.raises(ValueError, match=r"words \['ZZQXV'\] are not in"):
        lg.word_ids(["THE", "ZZQXV"])


def test_user_lexicon_spn_nsn_entries_are_taken(tmp_path):
    data = _data_dir(tmp_path, TRAIN + ["[cough] the cat"])
    lexicon = tmp_path / "lexicon.txt"
    # Kaldi's special entries: <unk> and two tags in SPN/NSN ([cough] is in no default list), !SIL skipped
    lexicon.write_text("!SIL SIL\n<unk> SPN\n[cough] NSN\n[laughter] nsn\nzzqxv Z IH1 K S\n")
    summary = prepare_lang(data, lm_order=2, lexicon=lexicon, oov="drop")
    lg = load_lang(data / "lang")
    assert lg.lexicon["[COUGH]"] == [("NSN",)] and lg.lexicon["<UNK>"] == [("SPN",)]
    assert summary["user_lexicon_tags"] == 3 and summary["user_lexicon_words"] == 1
    assert summary["train_dropped_oov"] == 0 and "!SIL" not in lg.words
    assert lg.silence_ids == [lg.phones[p] for p in ("SIL", "SPN", "NSN")]


def test_tag_and_unk_options():
    assert parse_tags(None) == DEFAULT_TAGS
    assert parse_tags(["[noise]=nsn", "<breath>=SPN"]) == {"[NOISE]": "NSN", "<BREATH>": "SPN"}
    for bad in ("[noise]", "noise=NSN", "[noise]=SIL", "[a b]=SPN"):
        with pytest.raises(ValueError, match=re.escape(f"--tags {bad!r}: give TAG=PHONE")):
            parse_tags([bad])
    assert check_unk_word("<unk>") == "<UNK>"
    with pytest.raises(ValueError, match="--unk-word 'UNK': give one word in angle or square brackets"):
        check_unk_word("UNK")


ARPA = """
\\data\\
ngram 1=9
ngram 2=5

\\1-grams:
-99\t<s>\t-0.30
-0.70\t</s>
-0.80\tthe\t-0.30
-1.00\tcat\t-0.20
-1.00\tdog\t-0.20
-1.20\tsaw\t-0.20
-1.50\tmouse\t-0.10
-1.50\tzzqxv\t-0.10
-1.60\t<unk>

\\2-grams:
-0.20\t<s> the
-0.40\tthe cat
-0.50\tcat saw
-0.30\tsaw zzqxv
-0.30\tzzqxv </s>

\\end\\
"""


@pytest.mark.parametrize("gz", [False, True])
def test_lm_arpa_builds_G_with_the_lexicon_words(tmp_path, gz):
    data = _data_dir(tmp_path)
    path = tmp_path / ("lm.arpa.gz" if gz else "lm.arpa")
    path.write_bytes(gzip.compress(ARPA.encode()) if gz else ARPA.encode())
    summary = prepare_lang(data, lexicon=None, oov="unk", lm_arpa=path)
    lang = data / "lang"
    lg = load_lang(lang)
    # ZZQXV is in no lexicon: dropped from G with its two bigrams, listed and counted
    assert summary["lm_arpa_words"] == 7 and summary["lm_arpa_dropped_words"] == 1
    assert summary["lm_arpa_dropped_ngrams"] == 3 and summary["lm_ngrams"] == [8, 3]
    assert (lang / "lm_arpa_oov.txt").read_text() == "ZZQXV\n"
    assert json.loads((lang / "summary.json").read_text())["lm_arpa_dropped_words"] == 1
    lm = ArpaLM(lang / "lm.arpa")
    assert "ZZQXV" not in lm.vocab and lm.prob[("THE", "CAT")] == -0.4
    # the ARPA's words the lexicon knows join the vocabulary (MOUSE is in no transcript), <unk> as <UNK>
    assert "MOUSE" in lg.words and "<UNK>" in lm.vocab
    labels = {int(f[3]) for f in (line.split() for line in (lang / "G.fst.txt").read_text().splitlines()) if len(f) > 3}
    assert lg.words["MOUSE"] in labels and lg.words["CAT"] in labels
    assert summary["lm_arpa_train_words_missing"] > 0  # READ, BOOK, ... : the decoder cannot output them
    assert "lm_dev_ppl" in summary
    # a rescoring LM covers the training words G lacks too
    assert {"BOOK", "MOUSE"} <= set(ArpaLM(make_rescore_lm(data, 2)).vocab)


def test_lm_arpa_words_get_flite_pronunciations_with_g2p(tmp_path):
    data = _data_dir(tmp_path)
    path = tmp_path / "lm.arpa"
    path.write_text(ARPA)
    summary = prepare_lang(data, oov="g2p", lm_arpa=path)
    lg = load_lang(data / "lang")
    assert summary["lm_arpa_dropped_words"] == 0 and lg.lexicon["ZZQXV"] and "ZZQXV" in lg.words
    assert ArpaLM(data / "lang" / "lm.arpa").prob[("SAW", "ZZQXV")] == -0.3


def test_lm_arpa_errors(tmp_path):
    data = _data_dir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"--lm-arpa .*nowhere.arpa: no such file; give a back-off"):
        prepare_lang(data, lm_arpa=tmp_path / "nowhere.arpa")
    text = tmp_path / "text.txt"
    text.write_text("the cat saw the dog\n")
    with pytest.raises(ValueError, match=r"--lm-arpa .*text.txt: not an ARPA file \(line 1 is 'the cat saw"):
        prepare_lang(data, lm_arpa=text)
    broken = tmp_path / "broken.arpa"
    broken.write_text("\\data\\\nngram 1=2\n\n\\1-grams:\n-1.0 the cat dog\n")
    with pytest.raises(ValueError, match=r"line 5 \('-1.0 the cat dog'\) is not a 1-gram entry"):
        prepare_lang(data, lm_arpa=broken)
    foreign = tmp_path / "foreign.arpa"
    foreign.write_text("\\data\\\nngram 1=3\n\n\\1-grams:\n-1.0\t</s>\n-1.0\tzzqxv\n-1.0\tqqzzy\n\n\\end\\\n")
    with pytest.raises(ValueError, match=r"--lm-arpa .*foreign.arpa: none of its 2 words \(e.g. QQZZY, ZZQXV\) is in"):
        prepare_lang(data, lm_arpa=foreign)
    arpa = tmp_path / "lm.arpa"
    arpa.write_text(ARPA)
    with pytest.raises(ValueError, match="--lm-arpa .* and --lm-text .*: the ARPA replaces the recipe's LM"):
        prepare_lang(data, lm_arpa=arpa, lm_text=text)


def test_prepare_checks_the_new_options_first(tmp_path):
    from prepare import prepare

    with pytest.raises(ValueError, match=r"--lm-arpa .*nowhere.arpa: no such file"):
        prepare(data_dir=tmp_path / "d", stage=2, stop_stage=2, lm_arpa=tmp_path / "nowhere.arpa")
    with pytest.raises(ValueError, match="--tags 'noise': give TAG=PHONE"):
        prepare(data_dir=tmp_path / "d", stage=2, stop_stage=2, tags=["noise"])
    with pytest.raises(ValueError, match="unknown --oov 'guess'; choose drop, unk or g2p"):
        prepare(data_dir=tmp_path / "d", stage=2, stop_stage=2, oov="guess")
