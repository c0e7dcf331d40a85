"""GMM-HMM stages: vectorised statistics, monophone and triphone training, decoding, the final
pdf-id alignments, drop handling and the agreement measure. The end-to-end tests share one tiny
synthetic corpus (TTS) built once per module; too little speech for good models, so they check
the mechanics, not accuracy (accuracy is measured on the default corpus, see README)."""

import json
import pickle
import sys
from pathlib import Path

import numpy as np
import pytest
from local.drops import load_drops
from local.graph.lang import make_topo
from local.kaldi import khg

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- unit tests without a corpus
def _toy_system(num_gauss: int, dim: int, seed: int):
    from local.gmm.common import GmmSystem, read_topology

    rng = np.random.default_rng(seed)
    topo = read_topology(make_topo([1, 2, 3], sil_id=1))
    tree = khg.monophone_context_dependency(phones=topo.phones, phone2num_pdf_classes=topo.get_phone_to_num_pdf_classes())
    am = khg.AmDiagGmm()
    for _ in range(tree.num_pdfs):
        g = khg.DiagGmm(nmix=num_gauss, dim=dim)
        g.set_weights(rng.dirichlet(np.ones(num_gauss)).astype(np.float32))
        g.set_means(rng.normal(size=(num_gauss, dim)).astype(np.float32))
        g.set_invvars(rng.uniform(0.5, 2.0, size=(num_gauss, dim)).astype(np.float32))
        g.compute_gconsts()
        am.add_pdf(g)
    return GmmSystem(khg.TransitionModel(ctx_dep=tree, hmm_topo=topo), am, tree)


def test_vectorised_stats_equal_kaldi_per_frame_accumulation():
    from local.gmm.common import accumulate

    system = _toy_system(num_gauss=3, dim=5, seed=0)
    rng = np.random.default_rng(1)
    n = 400
    feats = rng.normal(size=(n, 5)).astype(np.float32) * 2 + 1
    ali = rng.integers(1, system.tm.num_transition_ids + 1, size=n)
    ali[ali == ali[0]] = ali[1]  # leave some pdfs without frames
    stats = accumulate(system, feats, ali)

    ref = khg.AccumAmDiagGmm()
    ref.init(model=system.am, flags=khg.GmmUpdateFlags.kGmmAll)
    tid2pdf = system.tid2pdf()
    log_like = sum(
        ref.accumulate_for_gmm(model=system.am, data=x, gmm_index=int(tid2pdf[a]), weight=1.0) for x, a in zip(feats, ali)
    )
    assert stats.log_like == pytest.approx(log_like, rel=1e-5)
    for p in range(system.tm.num_pdfs):
        mine, theirs = stats.accs.get_acc(p), ref.get_acc(p)
        np.testing.assert_allclose(mine.occupancy, theirs.occupancy, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(mine.mean_accumulator, theirs.mean_accumulator, rtol=1e-4, atol=1e-3)
        np.testing.assert_allclose(mine.variance_accumulator, theirs.variance_accumulator, rtol=1e-4, atol=1e-3)
    assert stats.pdf_occs.sum() == n
    assert stats.transitions.sum() == n and stats.transitions[0] == 0


def test_update_grows_mixtures_to_target():
    from local.gmm.common import accumulate, update

    system = _toy_system(num_gauss=1, dim=4, seed=2)
    rng = np.random.default_rng(3)
    feats = rng.normal(size=(3000, 4)).astype(np.float32)
    ali = rng.integers(1, system.tm.num_transition_ids + 1, size=3000)
    before = system.am.num_gauss
    update(system, accumulate(system, feats, ali), target_gauss=before + 10, min_count=5.0)
    assert system.am.num_gauss == before + 10


def test_priors_are_floored_at_a_fraction_of_uniform_and_sum_to_one():
    from local.gmm.align import pdf_priors

    priors = pdf_priors(np.array([1000.0, 0.0, 1.0, 999.0]), floor=0.1)
    assert priors.sum() == pytest.approx(1.0) and priors.dtype == np.float32
    assert priors[1] == pytest.approx(priors[2]) and priors[1] > 0.1 / 4 * 0.9
    assert priors[0] / priors[3] == pytest.approx(1000 / 999, rel=1e-5)  # frequent pdfs keep their ratio
    with pytest.raises(ValueError, match="no training frames"):
        pdf_priors(np.zeros(3))


# ---------------------------------------------------------------- end to end on the tiny corpus
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Tiny corpus through lang, then mono, tri (decoding at one scale) and the align stage."""
    sys.path.insert(0, str(ROOT / "recipes" / "asr"))
    from local.gmm.align import align
    from local.gmm.mono import train_mono
    from local.gmm.tri import train_tri
    from prepare import prepare

    data_dir = tmp_path_factory.mktemp("gmm") / "tiny"
    prepare(corpus="synthetic", data_dir=data_dir, size="tiny", stop_stage=2, num_jobs=1)
    mono = train_mono(data_dir, num_iters=8, total_gauss=200, scales=(0.1,))
    tri = train_tri(data_dir, num_leaves=150, total_gauss=300, num_iters=8, scales=(0.1,))
    ali = align(data_dir, system="tri")  # the speaker-independent targets; the SAT ones: the last test
    return data_dir, mono, tri, ali


@pytest.fixture(scope="module")
def sat(trained):
    """The SAT stage on the tiny triphone system: 8 passes, transforms re-estimated at pass 4."""
    from local.gmm.sat import train_sat

    data_dir = trained[0]
    return train_sat(data_dir, num_leaves=150, total_gauss=300, num_iters=8, realign_iters=(3,), fmllr_iters=(4,),
                     scales=(0.1,))


def test_sat_has_a_transform_per_training_speaker(trained, sat):
    from lhotse import CutSet
    from local.data.features import gmm_cmvn_key
    from local.gmm.sat import FMLLR_MIN_FRAMES

    data_dir = trained[0]
    with open(data_dir / "exp" / "sat" / "trans.pkl", "rb") as f:
        trans = pickle.load(f)
    with open(data_dir / "exp" / "sat" / "ali.pkl", "rb") as f:
        alis = pickle.load(f)
    cuts = {c.id: c for c in CutSet.from_file(data_dir / "features" / "train_cuts.jsonl.gz")}
    speakers = {gmm_cmvn_key(cuts[u]) for u in alis}
    assert set(trans) == speakers and sat["speakers"] == len(speakers)
    frames = {}
    for u, ali in alis.items():
        frames[gmm_cmvn_key(cuts[u])] = frames.get(gmm_cmvn_key(cuts[u]), 0) + len(ali)
    identity = np.hstack([np.eye(39), np.zeros((39, 1))])
    for spk, W in trans.items():
        assert W.shape == (39, 40) and np.isfinite(W).all()
        if frames[spk] < FMLLR_MIN_FRAMES:  # too few frames (silence frames weigh 0): no transform
            np.testing.assert_array_equal(W, identity)
    assert any(not np.allclose(W, identity) for W in trans.values())
    history = json.loads((data_dir / "exp" / "sat" / "history.json").read_text())
    assert len(history) == 8 and history[3]["realigned"]
    assert sat["pdfs"] > 0 and (data_dir / "exp" / "sat" / "tree").stat().st_size > 0


def test_sat_decoding_writes_adapted_and_first_pass_wer(trained, sat):
    data_dir = trained[0]
    for split in ("dev", "test"):
        out = data_dir / "exp" / "sat" / f"decode_{split}"
        res = json.loads((out / "wer.json").read_text())
        assert res["wer"] == sat[f"{split}_wer"] and res["words"] > 0 and res["acoustic_scale"] == 0.1
        assert res["si_first_pass_wer"] == sat[f"{split}_si_wer"] and res["speakers"] > 0
        assert res["speed"]["rtf"] > 0 and res["speed"]["jobs"] >= 1
        assert (out / f"errs-{split}-acwt0.1.txt").exists() and (out / "trans.pkl").exists()


def test_speaker_transform_undoes_a_known_distortion(trained):
    """All training frames as one speaker, distorted by y = M x + c: the estimated fMLLR maps
    them back close to x under the triphone model and its alignments."""
    from local.gmm.common import GmmSystem, load_utterances
    from local.gmm.sat import SILENCE_WEIGHT_TRAIN, speaker_transforms
    from local.gmm.transforms import apply_affine
    from local.graph.lang import load_lang

    data_dir = trained[0]
    tri = GmmSystem.load(data_dir / "exp" / "tri" / "final.pkl")
    with open(data_dir / "exp" / "tri" / "ali.pkl", "rb") as f:
        alis = pickle.load(f)
    utts = load_utterances(data_dir, "train", clean_only=False)
    rng = np.random.default_rng(0)
    M = np.eye(39) * rng.uniform(0.7, 1.3, 39) + 0.05 * rng.standard_normal((39, 39))
    c = 0.5 * rng.standard_normal(39)
    clean = {u: utts.feats[u] for u in alis}
    distorted = {u: (x @ M.T + c).astype(np.float32) for u, x in clean.items()}
    speakers, sil_id = dict.fromkeys(alis, "all"), load_lang(data_dir / "lang").sil_id
    first = speaker_transforms(tri, distorted, alis, speakers, sil_id, SILENCE_WEIGHT_TRAIN)
    # a second estimate on the adapted features, composed onto the first (as in decoding)
    adapted = {u: apply_affine(first["all"], y) for u, y in distorted.items()}
    second = speaker_transforms(tri, adapted, alis, speakers, sil_id, SILENCE_WEIGHT_TRAIN, first)

    def error(W):
        return np.mean([np.abs(apply_affine(W, distorted[u]) - clean[u]).mean() for u in alis])

    before = np.mean([np.abs(distorted[u] - clean[u]).mean() for u in alis])
    assert error(first["all"]) < 0.5 * before
    assert error(second["all"]) < error(first["all"])


def test_alignments_cover_every_kept_utterance_frame_by_frame(trained):
    from lhotse import CutSet
    from local.gmm.common import is_augmented

    data_dir, _mono, tri, _ = trained
    kept = set((data_dir / "lang" / "train_ids.txt").read_text().split())
    drops = load_drops(data_dir)
    cuts = {c.id: c for c in CutSet.from_file(data_dir / "features" / "train_cuts.jsonl.gz")}
    clean = {u for u in kept if not is_augmented(cuts[u])}
    # the GMMs train on the clean utterances the lang stage kept and their augmented copies
    trained_on = clean | {u for u, c in cuts.items() if is_augmented(c) and u.removesuffix("-aug") in clean}
    assert trained_on > clean
    # the triphone system starts from the monophone alignments: it loses what either stage dropped
    for system, stages in (("mono", {"mono"}), ("tri", {"mono", "tri"})):
        dropped = {d["id"] for d in drops if d["stage"] in stages}
        with open(data_dir / "exp" / system / "ali.pkl", "rb") as f:
            alis = pickle.load(f)
        assert set(alis) == trained_on - dropped
        for utt, ali in alis.items():
            assert len(ali) == cuts[utt].features.num_frames
    history = json.loads((data_dir / "exp" / "mono" / "history.json").read_text())
    assert history[-1]["log_like_per_frame"] > history[0]["log_like_per_frame"]
    assert tri["pdfs"] > 0 and (data_dir / "exp" / "tri" / "tree").stat().st_size > 0


def test_pdf_alignment_cuts_and_priors(trained):
    from lhotse import CutSet
    from local.gmm.common import GmmSystem

    data_dir, _, _, summary = trained
    num_pdfs = GmmSystem.load(data_dir / "exp" / "tri" / "final.pkl").tm.num_pdfs
    cuts = CutSet.from_file(data_dir / "ali" / "train_cuts.jsonl.gz")
    assert len(cuts) == summary["train_utts"] > 0
    assert any(c.id.endswith("-aug") for c in cuts), "the augmented copies are aligned too"
    for cut in cuts:
        pdf = cut.load_custom("pdf_ali")
        assert pdf.dtype == np.int32 and pdf.shape == (cut.features.num_frames,)
        assert 0 <= pdf.min() and pdf.max() < num_pdfs
        assert cut.pdf_ali.frame_shift == 0.01
    priors = np.load(data_dir / "ali" / "priors.npy")
    assert priors.dtype == np.float32 and priors.shape == (num_pdfs,)
    assert priors.sum() == pytest.approx(1.0, abs=1e-5) and (priors > 0).all()
    info = json.loads((data_dir / "ali" / "info.json").read_text())
    assert info["num_pdfs"] == num_pdfs and info["num_frames"] == sum(c.features.num_frames for c in cuts)
    assert 0.0 <= info["phone_agreement"]["overall"] <= 1.0


def test_gmm_decoding_writes_wer(trained):
    from local.gmm.common import load_utterances
    from local.graph.decode import point_name

    data_dir, mono, tri, _ = trained
    for system, summary in (("mono", mono), ("tri", tri)):
        for split in ("dev", "test"):
            res = json.loads((data_dir / "exp" / system / f"decode_{split}" / "wer.json").read_text())
            assert res["wer"] == summary[f"{split}_wer"] and res["words"] > 0 and res["acoustic_scale"] == 0.1
            # (dev picks the word insertion penalty: 0 on some builds, 0.5 on others; unseeded mixture splitting)
            name = point_name(split, 0.1, res["word_insertion_penalty"])
            assert (data_dir / "exp" / system / f"decode_{split}" / f"errs-{name}.txt").exists()
            speed = res["speed"]  # the chosen point's decoding: wall time over the split's audio
            assert speed["seconds"] > 0 and speed["rtf"] == pytest.approx(speed["seconds"] / speed["audio_seconds"],
                                                                          rel=0.1, abs=1e-3)  # (both rounded)
            frames = sum(len(f) for f in load_utterances(data_dir, split).feats.values())
            assert speed["audio_seconds"] == pytest.approx(frames / 100, abs=0.1)
        assert (data_dir / "exp" / system / "graph" / "HCLG.fst").exists()
        dev = json.loads((data_dir / "exp" / system / "decode_dev" / "wer.json").read_text())
        # one scale: taken as given
        assert dev["grid"] == {"grid": [0.1], "extended": [], "at_edge": False, "skipped": []}
    assert tri["sizes"] == {"leaves": 150, "gaussians": 300, "train_hours": tri["sizes"]["train_hours"], "auto": []}


def test_gmm_decoding_extends_the_grid_past_the_edge_dev_picks(trained, monkeypatch):
    """Dev's best at the low edge of the grid: dev decoded once more a step below, test once, at dev's pick."""
    from local.gmm import decode
    from local.gmm.common import GmmSystem
    from local.graph.lang import load_lang

    data_dir = trained[0]
    decoded = []

    def fake_decode(hclg, system, utts, id2word, out_dir, split, scale, alignments=None, hclg_path=None,
                    loglikes=None, penalty=0.0, search=None):
        decoded.append((split, scale))
        out_dir.mkdir(parents=True, exist_ok=True)  # as scoring does
        return {"wer": 10.0 + 100 * abs(scale - 0.06) + penalty, "words": 1}

    monkeypatch.setattr(decode, "decode_split", fake_decode)
    system = GmmSystem.load(data_dir / "exp" / "mono" / "final.pkl")
    summary = decode.decode_system(data_dir, "mono_grid", system, load_lang(data_dir / "lang"), scales=(0.08, 0.1))
    dev = json.loads((data_dir / "exp" / "mono_grid" / "decode_dev" / "wer.json").read_text())
    assert dev["grid"] == {"grid": [0.0512, 0.064, 0.08, 0.1], "extended": [0.064, 0.0512], "at_edge": False,
                           "skipped": []}
    assert summary["acoustic_scale"] == dev["acoustic_scale"] == 0.064
    assert [s for split, s in decoded if split == "test"] == [summary["acoustic_scale"]]
    assert set(dev["by_scale"]) == {str(s) for s in dev["grid"]["grid"]}


def test_gmm_decoding_sweeps_the_penalty_at_dev_s_scale_and_decodes_test_with_it(trained, monkeypatch):
    """Dev's scale at no penalty, then penalties in order while each is better; test at dev's (scale,
    penalty), through the graph with that penalty."""
    from local.gmm import decode
    from local.gmm.common import GmmSystem
    from local.graph.lang import load_lang

    data_dir = trained[0]
    decoded = []

    def fake_decode(hclg, system, utts, id2word, out_dir, split, scale, alignments=None, hclg_path=None,
                    loglikes=None, penalty=0.0, search=None):
        decoded.append((split, scale, penalty, hclg_path.name))
        out_dir.mkdir(parents=True, exist_ok=True)
        return {"wer": 10.0 + 100 * abs(scale - 0.1) + {0.0: 0.0, 0.5: -1.0, 1.0: -0.5}[penalty], "words": 1}

    monkeypatch.setattr(decode, "decode_split", fake_decode)
    system = GmmSystem.load(data_dir / "exp" / "mono" / "final.pkl")
    summary = decode.decode_system(data_dir, "mono_wip", system, load_lang(data_dir / "lang"),
                                   scales=(0.08, 0.1, 0.125, 0.15))
    dev = json.loads((data_dir / "exp" / "mono_wip" / "decode_dev" / "wer.json").read_text())
    assert (summary["acoustic_scale"], summary["word_insertion_penalty"]) == (0.1, 0.5)
    assert dev["by_penalty"] == {"0.0": 10.0, "0.5": 9.0, "1.0": 9.5} and dev["grid"]["skipped"] == [0.15]
    assert [d for d in decoded if d[0] == "dev"] == [
        ("dev", 0.1, 0.0, "HCLG.fst"), ("dev", 0.125, 0.0, "HCLG.fst"), ("dev", 0.08, 0.0, "HCLG.fst"),
        ("dev", 0.1, 0.5, "HCLG_wip0.5.fst"), ("dev", 0.1, 1.0, "HCLG_wip1.fst")]
    assert [d for d in decoded if d[0] == "test"] == [("test", 0.1, 0.5, "HCLG_wip0.5.fst")]
    assert (data_dir / "exp" / "mono_wip" / "graph" / "HCLG_wip0.5.fst").exists()



def test_every_gmm_decoding_prunes_with_the_stage_s_search_and_records_it(trained, sat, monkeypatch, tmp_path):
    """``prepare.py --beam/--max-active`` reach every GMM decoding: a system's dev sweep and test, SAT's
    passes, and a new set's passes (each as its stage decoded, read from its ``wer.json``)."""
    import shutil

    from lhotse import CutSet
    from local.gmm import decode as decode_module
    from local.gmm import sat as sat_module
    from local.gmm.common import GmmSystem
    from local.graph.decode import KALDI_SEARCH, Search
    from local.graph.lang import load_lang

    data_dir = tmp_path / "tiny"  # (a copy: the module's other tests read the stages' decodings)
    shutil.copytree(trained[0], data_dir, ignore=shutil.ignore_patterns("audio"))
    lang = load_lang(data_dir / "lang")
    seen = []
    real = decode_module.decode_utterances_gmm

    def recording(*args, beam, max_active, **kwargs):
        seen.append((beam, max_active))
        return real(*args, beam=beam, max_active=max_active, **kwargs)

    for module in (decode_module, sat_module):
        monkeypatch.setattr(module, "decode_utterances_gmm", recording)
    mono = GmmSystem.load(data_dir / "exp" / "mono" / "final.pkl")
    decode_module.decode_system(data_dir, "mono", mono, lang, scales=(0.1,), penalties=(0.5,), search=KALDI_SEARCH)
    assert len(seen) >= 3 and set(seen) == {(13.0, 7000)}  # dev at 0.1, at penalty 0.5, test
    for split in ("dev", "test"):
        res = json.loads((data_dir / "exp" / "mono" / f"decode_{split}" / "wer.json").read_text())
        assert res["search"] == {"beam": 13.0, "max_active": 7000}

    seen.clear()
    sat_module.decode_sat(data_dir, GmmSystem.load(data_dir / "exp" / "sat" / "final.pkl"),
                          GmmSystem.load(data_dir / "exp" / "tri" / "final.pkl"), lang, scales=(0.1,),
                          penalties=(0.5,), search=KALDI_SEARCH)
    assert len(seen) >= 5 and set(seen) == {(13.0, 7000)}  # (the first pass is the tri stage's, kept)
    assert json.loads((data_dir / "exp" / "sat" / "decode_dev" / "wer.json").read_text())["search"]["beam"] == 13.0

    seen.clear()  # a new set: tri's first pass as the tri stage decoded (before searches were recorded: 10 / 3000)
    tri_dev = data_dir / "exp" / "tri" / "decode_dev" / "wer.json"
    tri_dev.write_text(json.dumps({k: v for k, v in json.loads(tri_dev.read_text()).items() if k != "search"}))
    sat_module.decode_new_set(data_dir, CutSet.from_file(data_dir / "features" / "test_cuts.jsonl.gz"))
    assert seen == [(10.0, 3000), (13.0, 7000), (13.0, 7000)]
    assert Search.recorded({}) == Search() and Search.recorded({"search": KALDI_SEARCH.record()}) == KALDI_SEARCH


@pytest.mark.parametrize("beam, max_active, match", [(0, 3000, "beam=0"), (10.0, 100, "max_active=100"),
                                                     (10.0, 3000.5, "max_active=3000.5")])
def test_a_bad_search_names_the_value_and_the_fix(beam, max_active, match):
    from local.graph.decode import Search

    with pytest.raises(ValueError, match=match + ".*Kaldi's"):
        Search(beam, max_active)

def test_converted_alignment_keeps_phones_and_transitions(trained):
    from local.gmm.common import GmmSystem, convert_alignments, phones_of
    from local.gmm.tree_stats import TidTables

    data_dir = trained[0]
    mono = GmmSystem.load(data_dir / "exp" / "mono" / "final.pkl")
    tri = GmmSystem.load(data_dir / "exp" / "tri" / "final.pkl")
    with open(data_dir / "exp" / "mono" / "ali.pkl", "rb") as f:
        alis = pickle.load(f)
    mono_tables, tri_tables = TidTables.from_transition_model(mono.tm), TidTables.from_transition_model(tri.tm)
    converted = convert_alignments(alis, mono, tri)
    assert set(converted) == set(alis)
    for utt, ali in alis.items():
        new = converted[utt]
        assert phones_of(new, tri_tables) == phones_of(ali, mono_tables)
        np.testing.assert_array_equal(tri_tables.is_self_loop[new], mono_tables.is_self_loop[ali])
        np.testing.assert_array_equal(tri_tables.pdf_class[new], mono_tables.pdf_class[ali])


def test_phone_agreement_is_one_for_gold_equal_to_alignment_and_drops_with_shift(trained):
    from lhotse import CutSet
    from lhotse.supervision import AlignmentItem
    from local.gmm.align import phone_agreement
    from local.gmm.common import GmmSystem, phone_instances
    from local.gmm.tree_stats import TidTables
    from local.graph.lang import load_lang

    data_dir = trained[0]
    mono = GmmSystem.load(data_dir / "exp" / "mono" / "final.pkl")
    tables = TidTables.from_transition_model(mono.tm)
    id2phone = {i: p for p, i in load_lang(data_dir / "lang").phones.items()}
    with open(data_dir / "exp" / "mono" / "ali.pkl", "rb") as f:
        alis = pickle.load(f)
    cuts = [c for c in CutSet.from_file(data_dir / "features" / "train_cuts.jsonl.gz") if c.id in alis][:4]
    gold_cuts = []
    for cut in cuts:
        ali = alis[cut.id]
        inst, _, _ = phone_instances(ali, tables)
        starts = np.flatnonzero(np.diff(np.concatenate([[-1], inst])))
        ends = np.append(starts[1:], len(ali))
        items = [AlignmentItem(symbol=id2phone[tables.phone[ali[s]]], start=s * 0.01, duration=(e - s) * 0.01)
                 for s, e in zip(starts, ends)]
        sup = cut.supervisions[0].with_alignment("phone", items)
        gold_cuts.append(cut.map_supervisions(lambda _, sup=sup: sup))
    exact = phone_agreement(gold_cuts, alis, tables, id2phone)
    assert exact["overall"] == 1.0 and exact["utterances"] == len(cuts)
    shifted = {u: np.concatenate([a[3:], a[-3:]]) for u, a in alis.items()}
    assert phone_agreement(gold_cuts, shifted, tables, id2phone)["overall"] < 1.0
    assert phone_agreement(gold_cuts, shifted, tables, id2phone)["within_1_frame"] <= 1.0


def test_too_short_utterances_are_dropped_with_a_reason(trained):
    from lhotse import CutSet
    from local.gmm.align import align_cuts
    from local.gmm.common import GmmSystem, Utterances, compile_graphs
    from local.gmm.mono import flat_start
    from local.graph.lang import cut_words, load_lang

    data_dir = trained[0]
    lang = load_lang(data_dir / "lang")
    system = GmmSystem.load(data_dir / "exp" / "mono" / "final.pkl")
    cut = next(c for c in CutSet.from_file(data_dir / "features" / "train_cuts.jsonl.gz") if len(cut_words(c)) >= 3)
    short = cut.truncate(duration=0.05).with_id(cut.id + "-short")
    short.supervisions[0].text = cut.supervisions[0].text
    out = data_dir / "drop_test"
    assert align_cuts(system, lang, [short], out, "train") == {}
    assert [d["reason"] for d in load_drops(out)] == ["too_short_for_hmm"]

    words = {cut.id: cut_words(cut)}
    utts = Utterances([cut], {cut.id: np.zeros((4, 39), np.float32)}, words)
    graphs = compile_graphs(system, lang, {cut.id: lang.word_ids(words[cut.id])})
    assert flat_start(system, graphs, utts, out) == {}
    assert [d["reason"] for d in load_drops(out)] == ["too_short_for_hmm"] * 2


def test_alignment_failure_is_dropped_not_raised(trained):
    from lhotse import CutSet
    from local.gmm.common import GmmSystem, Utterances, compile_graphs, realign_all
    from local.graph.lang import cut_words, load_lang

    data_dir = trained[0]
    lang = load_lang(data_dir / "lang")
    system = GmmSystem.load(data_dir / "exp" / "mono" / "final.pkl")
    cut = next(iter(CutSet.from_file(data_dir / "features" / "train_cuts.jsonl.gz")))
    words = {cut.id: cut_words(cut)}
    graphs = compile_graphs(system, lang, {cut.id: lang.word_ids(words[cut.id])})
    # Noise frames far outside every Gaussian: no path survives the beam, nor the retry beam.
    feats = np.random.default_rng(0).normal(scale=1e3, size=(300, 39)).astype(np.float32)
    utts = Utterances([cut], {cut.id: feats}, words)
    out = data_dir / "fail_test"
    assert realign_all(system, graphs, utts, [cut.id], out, "mono") == {}
    assert [d["reason"] for d in load_drops(out)] == ["alignment_failed"]


def test_sat_first_pass_reuses_tri_best_paths_and_redecodes_without_them(trained, sat):
    from local.gmm.common import GmmSystem
    from local.gmm.sat import decode_sat
    from local.graph.decode import point_name
    from local.graph.lang import load_lang

    data_dir = trained[0]
    tri_dir = data_dir / "exp" / "tri"
    for split in ("dev", "test"):
        tri_res = json.loads((tri_dir / f"decode_{split}" / "wer.json").read_text())
        assert sat[f"{split}_si_wer"] == tri_res["wer"]  # the tri stage's decoding is the first pass
    # without the saved best paths the first pass is decoded again, with the same result
    saved = tri_dir / "decode_test" / "best_path.pkl"
    saved.rename(saved.with_suffix(".bak"))
    try:
        again = decode_sat(data_dir, GmmSystem.load(data_dir / "exp" / "sat" / "final.pkl"),
                           GmmSystem.load(tri_dir / "final.pkl"), load_lang(data_dir / "lang"), scales=(0.1,))
    finally:
        saved.with_suffix(".bak").rename(saved)
    assert (again["test_si_wer"], again["test_wer"]) == (sat["test_si_wer"], sat["test_wer"])
    penalty = json.loads((tri_dir / "decode_dev" / "wer.json").read_text())["word_insertion_penalty"]
    assert (data_dir / "exp" / "sat" / "decode_test" / f"errs-{point_name('test-si', 0.1, penalty)}.txt").exists()


def test_sat_decoding_decodes_the_first_adapted_pass_once_at_the_first_pass_scale(trained, sat, monkeypatch,
                                                                                  tmp_path):
    """As ``decode_fmllr.sh``: per split one adapted pass at the speaker-independent system's scale (for the
    second transforms), then the final pass at each scale of dev's grid and at dev's pick on test."""
    import shutil

    from local.gmm import sat as sat_module
    from local.gmm.common import GmmSystem
    from local.graph.lang import load_lang

    data_dir = tmp_path / "tiny"  # (a copy: the module's other tests read the SAT stage's decodings)
    shutil.copytree(trained[0], data_dir, ignore=shutil.ignore_patterns("audio"))
    si_scale = json.loads((data_dir / "exp" / "tri" / "decode_dev" / "wer.json").read_text())["acoustic_scale"]
    calls = []
    real = sat_module.decode_utterances_gmm

    def recording(*args, acoustic_scale, **kwargs):
        calls.append(acoustic_scale)
        return real(*args, acoustic_scale=acoustic_scale, **kwargs)

    monkeypatch.setattr(sat_module, "decode_utterances_gmm", recording)
    grid = (0.0833, 0.1, 0.125)
    res = sat_module.decode_sat(data_dir, GmmSystem.load(data_dir / "exp" / "sat" / "final.pkl"),
                                GmmSystem.load(data_dir / "exp" / "tri" / "final.pkl"), load_lang(data_dir / "lang"),
                                scales=grid)
    dev = json.loads((data_dir / "exp" / "sat" / "decode_dev" / "wer.json").read_text())
    tried = dev["grid"]["grid"]
    final = len(tried) + len(dev["by_penalty"]) - 1  # dev's final passes: each scale tried, then each penalty
    assert calls == [si_scale, *calls[1 : final + 1], si_scale, res["acoustic_scale"]]
    assert sorted(set(calls[1 : final + 1])) == tried and calls[final] == res["acoustic_scale"]
    assert sorted(tried + dev["grid"]["skipped"]) == sorted(set(grid) | set(dev["grid"]["extended"]))


def test_next_stage_needs_alignments_of_the_current_training_cuts(trained):
    from local.gmm.common import GmmSystem

    exp = trained[0] / "exp" / "mono"
    with open(exp / "ali.pkl", "rb") as f:
        first = next(iter(pickle.load(f)))
    system, alis = GmmSystem.load_run(exp, dict.fromkeys(["not-a-cut", first]))
    assert len(alis) == 1 and system.tm.num_pdfs > 0
    with pytest.raises(RuntimeError, match="no alignment of the current training cuts"):
        GmmSystem.load_run(exp, {"not-a-cut": None})


def test_a_system_trained_on_other_features_is_refused(trained, tmp_path):
    from local.gmm.common import GmmSystem, front_end_id

    src = trained[0] / "exp" / "mono" / "final.pkl"
    with open(src, "rb") as f:
        saved = pickle.load(f)
    assert saved["front_end"] == front_end_id()
    old = tmp_path / "data" / "exp" / "mono" / "final.pkl"
    old.parent.mkdir(parents=True)
    with open(old, "wb") as f:  # as written by a version without speaker variance normalisation
        pickle.dump({k: v for k, v in saved.items() if k != "front_end"}, f)
    with pytest.raises(RuntimeError, match=r"was trained on GMM features None.*--stage 3 --force"):
        GmmSystem.load(old)
    assert GmmSystem.load(old, check_front_end=False).tm.num_pdfs == GmmSystem.load(src).tm.num_pdfs


def test_parallel_gmm_decoding_equals_one_process(trained):
    from local.gmm.common import GmmSystem, load_utterances
    from local.graph.decode import decode_gmm_parallel, decode_utterances_gmm
    from local.kaldi import kaldifst

    data_dir = trained[0]
    system = GmmSystem.load(data_dir / "exp" / "tri" / "final.pkl")
    graph = data_dir / "exp" / "tri" / "graph" / "HCLG.fst"
    utts = load_utterances(data_dir, "dev")
    items = [(u, utts.feats[u]) for u in utts.ids]
    one_alis, two_alis = {}, {}
    one = decode_utterances_gmm(kaldifst.StdVectorFst.read(str(graph)), system.tm, system.am, items, 0.1,
                                alignments=one_alis)
    two = decode_gmm_parallel(graph, system.tm, system.am, items, 0.1, num_jobs=2, alignments=two_alis)
    assert one == two and list(two) == [u for u, _ in items]
    assert set(one_alis) == set(two_alis) and all(np.array_equal(one_alis[u], two_alis[u]) for u in one_alis)


def test_gmm_scorer_equals_kaldis_per_pdf_log_likelihood():
    from local.graph.decode import GmmScorer, gmm_loglikes

    system = _toy_system(num_gauss=5, dim=7, seed=3)
    feats = np.random.default_rng(4).normal(size=(11, 7)).astype(np.float32) * 2.0
    ours = GmmScorer(system.am)(feats)
    kaldi = np.array([[system.am.log_likelihood(p, f) for p in range(system.am.num_pdfs)] for f in feats])
    assert ours.shape == (11, system.am.num_pdfs) and ours.dtype == np.float32
    np.testing.assert_allclose(ours, kaldi, rtol=1e-5, atol=1e-4)
    assert gmm_loglikes(system.am, [("u", feats)], max_bytes=11 * system.am.num_pdfs * 4 - 1) is None  # too big
    with pytest.raises(ValueError, match="the GMMs model 7 dimensions"):
        GmmScorer(system.am)(feats[:, :6])


def _kaldi_gmm_decode(hclg, system, items, scale: float) -> tuple[dict, dict]:
    """The reference: Kaldi's ``DecodableAmDiagGmmScaled`` (the GMMs evaluated frame by frame and pdf by
    pdf) under the recipe's search settings; (words, transition-ids) per utterance."""
    from local.graph.decode import BEAM, MAX_ACTIVE
    from local.kaldi import kaldifst, khg

    options = khg.FasterDecoderOptions(beam=BEAM, max_active=MAX_ACTIVE, min_active=200)
    words, alis = {}, {}
    for u, feats in items:
        decoder = khg.FasterDecoder(hclg, options)
        decoder.decode(khg.DecodableAmDiagGmmScaled(am=system.am, tm=system.tm, scale=scale,
                                                     feats=np.ascontiguousarray(feats, dtype=np.float32)))
        ok, best = decoder.get_best_path()
        assert ok, u
        ok, tids, word_ids, _ = kaldifst.get_linear_symbol_sequence(best)
        words[u], alis[u] = list(word_ids), np.asarray(tids, dtype=np.int64)
    return words, alis


def test_gmm_decoding_equals_kaldis_decodable(trained, monkeypatch):
    """Every GMM decoding (``GmmScorer``'s products, evaluated per utterance or kept for a grid of
    acoustic scales, ``gmm_loglikes``): the same words and transition-ids as Kaldi's
    ``DecodableAmDiagGmmScaled``, in one process and in two."""
    from local.gmm.common import GmmSystem, load_utterances
    from local.graph.decode import decode_utterances_gmm, gmm_loglikes
    from local.kaldi import kaldifst

    data_dir = trained[0]
    system = GmmSystem.load(data_dir / "exp" / "tri" / "final.pkl")
    graph = data_dir / "exp" / "tri" / "graph" / "HCLG.fst"
    hclg = kaldifst.StdVectorFst.read(str(graph))
    utts = load_utterances(data_dir, "dev")
    items = [(u, utts.feats[u]) for u in utts.ids]
    kaldi_words, kaldi_alis = _kaldi_gmm_decode(hclg, system, items, 0.07)
    assert any(kaldi_words.values())
    kept = gmm_loglikes(system.am, items)
    monkeypatch.setattr("local.graph.decode.MIN_PARALLEL", 1)  # two processes even for the tiny corpus
    for jobs in (1, 2):
        for loglikes in (None, kept):
            alis: dict = {}
            words = decode_utterances_gmm(hclg, system.tm, system.am, items, 0.07, alignments=alis,
                                          hclg_path=graph, num_jobs=jobs, loglikes=loglikes)
            assert words == kaldi_words
            assert set(alis) == set(kaldi_alis) and all(np.array_equal(alis[u], kaldi_alis[u]) for u in alis)


def test_alignment_in_two_processes_equals_one_and_follows_changed_features(trained, monkeypatch):
    """``align_jobs``: the same transition-ids as one process, with the model of each call, and the new
    features once the stage says it changed them (SAT's fMLLR)."""
    from local.gmm import align_jobs as jobs_module
    from local.gmm.common import GmmSystem, compile_graphs, load_utterances, realign_all
    from local.graph.lang import load_lang

    data_dir = trained[0]
    system = GmmSystem.load(data_dir / "exp" / "tri" / "final.pkl")
    lang = load_lang(data_dir / "lang")
    utts = load_utterances(data_dir, "train")
    graphs = compile_graphs(system, lang, {u: lang.word_ids(utts.words[u]) for u in utts.ids})
    ids = list(graphs)[::-1]  # any order: the result keeps it
    one = realign_all(system, graphs, utts, ids, None, "test")
    monkeypatch.setattr(jobs_module, "MIN_PER_JOB", 1)
    with jobs_module.align_jobs(graphs, system, utts.feats, num_jobs=2):
        assert graphs.jobs is not None and len(graphs.jobs.procs) == 2
        two = realign_all(system, graphs, utts, ids, None, "test")
        assert list(two) == list(one) and all(np.array_equal(one[u], two[u]) for u in one)
        utts.feats.update({u: x[::-1].copy() for u, x in utts.feats.items()})  # time-reversed: other paths
        graphs.jobs.features_changed()
        reversed_two = realign_all(system, graphs, utts, ids, None, "test")
    assert graphs.jobs is None
    reversed_one = realign_all(system, graphs, utts, ids, None, "test")
    assert list(reversed_two) == list(reversed_one)
    assert all(np.array_equal(reversed_one[u], reversed_two[u]) for u in reversed_one)
    assert any(not np.array_equal(one[u], reversed_one[u]) for u in reversed_one if u in one)


def test_the_sat_schedule_option_reaches_the_sat_stage(monkeypatch, tmp_path):
    """``prepare.py --sat-schedule``: steps/train_sat.sh's passes by default, the recipe's older ones on request,
    reach ``train_sat``; an unknown name is refused with the choices."""
    import argparse

    import prepare
    from local.gmm import sat
    from local.graph.decode import Search

    seen = {}
    monkeypatch.setattr(prepare, "prepare", lambda *args, **kwargs: seen.update(kwargs))
    prepare.main(["--sat-schedule", "recipe"])
    assert seen["sat_schedule"] == "recipe"
    prepare.main([])
    assert seen["sat_schedule"] == "kaldi"
    monkeypatch.undo()
    with pytest.raises(ValueError, match="unknown --sat-schedule 'fast'; choose recipe or kaldi"):
        prepare.prepare(data_dir=tmp_path / "d", sat_schedule="fast")
    calls = []
    monkeypatch.setattr(sat, "train_sat", lambda data_dir, *a, **kw: calls.append(kw) or {})
    sizes = dict.fromkeys(prepare.GMM_SIZES, "auto")
    prepare._run_stage("sat", tmp_path, argparse.Namespace(seed=0, gmm_sizes=sizes, lda_mllt=False,
                                                           sat_schedule="kaldi", search=Search(), corpus="synthetic"))
    assert calls == [{"seed": 0, "search": Search(), "corpus": "synthetic", "realign_iters": (10, 20, 30),
                      "fmllr_iters": (2, 4, 6, 12)}]


def test_mixing_up_is_kaldis_split_with_a_seeded_perturbation(trained):
    """``split_by_count``: khg's number of Gaussians per pdf, the same GMM from the same seed (khg's own
    perturbation comes from std::random_device), a new one from another seed, and Kaldi's perturbation:
    each half of a split moved by ``perturb_factor * N(0, 1)`` standard deviations, in opposite directions."""
    from local.gmm.common import GmmSystem, split_by_count

    path = trained[0] / "exp" / "mono" / "final.pkl"
    before = GmmSystem.load(path).am
    occs = np.linspace(50, 500, before.num_pdfs).astype(np.float32)
    target = before.num_gauss + 90

    def split(seed):
        am = GmmSystem.load(path).am
        split_by_count(am, occs, target, seed=seed)
        return am

    a, b, other = split(0), split(0), split(1)
    theirs = GmmSystem.load(path).am
    theirs.split_by_count(state_occs=occs, target_components=target, perturb_factor=0.01, power=0.2, min_count=20.0)
    assert a.num_gauss == target
    assert [a.get_pdf(p).num_gauss for p in range(a.num_pdfs)] == [
        theirs.get_pdf(p).num_gauss for p in range(a.num_pdfs)
    ]
    assert pickle.dumps(a) == pickle.dumps(b) and pickle.dumps(a) != pickle.dumps(other)
    steps = []
    for p in range(a.num_pdfs):
        old, new = before.get_pdf(p), a.get_pdf(p)
        if new.num_gauss != old.num_gauss + 1:
            continue
        i, n0 = int(np.argmax(np.asarray(old.weights))), old.num_gauss  # Kaldi splits the heaviest
        sd = np.sqrt(np.asarray(new.vars))
        np.testing.assert_allclose(np.asarray(new.weights)[[i, n0]], np.asarray(old.weights)[i] / 2, rtol=1e-6)
        up = (np.asarray(new.means)[n0] - np.asarray(old.means)[i]) / sd[n0]
        down = (np.asarray(new.means)[i] - np.asarray(old.means)[i]) / sd[i]
        np.testing.assert_allclose(up, -down, atol=1e-4)
        steps.append(up)
    steps = np.concatenate(steps)
    assert len(steps) > 500 and 0.009 < steps.std() < 0.011


@pytest.mark.parametrize("jobs", [1, 2])
def test_gmm_training_gives_the_same_model_twice(trained, tmp_path, monkeypatch, jobs):
    """The monophone stage run again on the same data (in another directory) writes the same model, its
    re-alignments in this process or in two (``align_jobs``)."""
    import shutil

    from local.gmm import align_jobs
    from local.gmm.mono import train_mono

    monkeypatch.setattr(align_jobs, "MIN_PER_JOB", 1 if jobs == 2 else 10**9)
    again = tmp_path / "again"
    shutil.copytree(trained[0], again, ignore=shutil.ignore_patterns("exp", "ali"))
    train_mono(again, num_iters=8, total_gauss=200, decode=False)
    first = (trained[0] / "exp" / "mono" / "final.pkl").read_bytes()
    assert (again / "exp" / "mono" / "final.pkl").read_bytes() == first


def test_the_seed_reaches_the_triphone_stage(trained, tmp_path):
    """The triphone stage (mixing up's perturbations) run again: the same model from seed 0, another from seed 1."""
    import shutil

    from local.gmm.tri import train_tri

    again = tmp_path / "again"
    shutil.copytree(trained[0], again, ignore=shutil.ignore_patterns("ali"))
    first = (trained[0] / "exp" / "tri" / "final.pkl").read_bytes()
    models = []
    for seed in (0, 1):
        train_tri(again, num_leaves=150, total_gauss=300, num_iters=8, decode=False, seed=seed)
        models.append((again / "exp" / "tri" / "final.pkl").read_bytes())
    assert models[0] == first and models[1] != first


def test_another_seed_gives_another_monophone_model(trained, tmp_path):
    """The seed reaches the monophone stage's random steps (the flat start's paths, mixing up)."""
    import shutil

    from local.gmm.mono import train_mono

    again = tmp_path / "again"
    shutil.copytree(trained[0], again, ignore=shutil.ignore_patterns("exp", "ali"))
    train_mono(again, num_iters=8, total_gauss=200, decode=False, seed=1)
    assert (again / "exp" / "mono" / "final.pkl").read_bytes() != (trained[0] / "exp" / "mono" / "final.pkl").read_bytes()


@pytest.mark.parametrize("system_name", ["mono", "tri"])
def test_gmm_decoding_of_an_utterance_does_not_depend_on_what_was_decoded_before(trained, system_name):
    """The best path of each utterance, transition-ids included, whatever the order of the utterances
    (a decoder reused across utterances broke ties between equal-cost paths by its history)."""
    from local.gmm.common import GmmSystem, load_utterances
    from local.graph.decode import decode_utterances_gmm
    from local.kaldi import kaldifst

    data_dir = trained[0]
    hclg = kaldifst.StdVectorFst.read(str(data_dir / "exp" / system_name / "graph" / "HCLG.fst"))
    system = GmmSystem.load(data_dir / "exp" / system_name / "final.pkl")
    utts = load_utterances(data_dir, "dev")
    items = [(u, utts.feats[u]) for u in utts.ids]
    forward, backward = {}, {}
    words = decode_utterances_gmm(hclg, system.tm, system.am, items, 0.1, alignments=forward)
    words_back = decode_utterances_gmm(hclg, system.tm, system.am, items[::-1], 0.1, alignments=backward)
    alone = {}
    for item in items:  # each utterance first, with nothing before it
        decode_utterances_gmm(hclg, system.tm, system.am, [item], 0.1, alignments=alone)
    assert words == words_back and set(forward) == set(backward) == set(alone) == {u for u, _ in items}
    for u, ali in forward.items():
        assert np.array_equal(ali, backward[u]) and np.array_equal(ali, alone[u]), u


def test_sat_alignments_are_the_dnn_targets(trained, sat):
    """Stage 6 with the SAT system: train from the SAT stage, dev by align_fmllr, transforms saved,
    targets and priors over the SAT system's pdfs, the SAT graph named for decoding."""
    from local.gmm.align import align
    from local.gmm.common import GmmSystem

    data_dir = trained[0]
    summary = align(data_dir)
    info = json.loads((data_dir / "ali" / "info.json").read_text())
    num_pdfs = GmmSystem.load(data_dir / "exp" / "sat" / "final.pkl").tm.num_pdfs
    assert summary["system"] == info["system"] == "sat" and info["num_pdfs"] == num_pdfs
    assert info["graph"] == "exp/sat/graph/HCLG.fst" and (data_dir / info["graph"]).exists()
    assert np.load(data_dir / "ali" / "priors.npy").shape == (num_pdfs,)
    for split in ("train", "dev"):
        with open(data_dir / "ali" / f"trans_{split}.pkl", "rb") as f:
            trans = pickle.load(f)
        assert trans and all(W.shape == (39, 40) for W in trans.values())
    with open(data_dir / "exp" / "sat" / "ali.pkl", "rb") as f:
        sat_alis = pickle.load(f)
    assert info["splits"]["train"]["utterances"] == len(sat_alis)


# ---------------------------------------------------------------- LDA+MLLT (prepare.py --lda-mllt)
@pytest.fixture(scope="module")
def lda_mllt(trained, tmp_path_factory):
    """A copy of the tiny corpus's mono and tri systems, then what ``prepare.py --lda-mllt`` builds on
    them, with fewer passes: the LDA+MLLT system (8 passes, MLLT at 2 and 4), SAT on its features
    (8 passes) and the align stage's fMLLR targets."""
    import shutil

    from local.gmm.align import align
    from local.gmm.lda_mllt import train_lda_mllt
    from local.gmm.sat import train_sat

    src, data_dir = trained[0], tmp_path_factory.mktemp("lda_mllt") / "tiny"
    shutil.copytree(src, data_dir, ignore=lambda d, names: [n for n in names if Path(d) == src / "exp" and n != "tri"
                                                            and n != "mono"])
    lda = train_lda_mllt(data_dir, num_leaves=150, total_gauss=300, num_iters=8, realign_iters=(5,),
                         mllt_iters=(2, 4), scales=(0.1,))
    sat = train_sat(data_dir, num_leaves=150, total_gauss=300, num_iters=8, realign_iters=(3,), fmllr_iters=(4,),
                    scales=(0.1,), speaker_independent="lda_mllt")
    return data_dir, lda, sat, align(data_dir)


def test_lda_mllt_system_decodes_and_keeps_its_transform(lda_mllt):
    from local.gmm.common import GmmSystem, front_end_id, load_cuts

    data_dir, lda, _, _ = lda_mllt
    exp = data_dir / "exp" / "lda_mllt"
    system = GmmSystem.load(exp / "final.pkl")
    assert system.transform.shape == (40, 91) and lda["dim"] == 40
    np.testing.assert_array_equal(np.load(exp / "final_mat.npy"), system.transform)
    assert np.load(exp / "lda.npy").shape == (40, 91) and not np.allclose(np.load(exp / "lda.npy"), system.transform)
    with open(exp / "final.pkl", "rb") as f:
        assert pickle.load(f)["front_end"] == front_end_id(lda_mllt=True)
    assert len(lda["mllt_gain_per_frame"]) == 2 and min(lda["mllt_gain_per_frame"]) >= 0
    history = json.loads((exp / "history.json").read_text())
    assert len(history) == 8 and history[5]["realigned"]
    for split in ("dev", "test"):
        res = json.loads((exp / f"decode_{split}" / "wer.json").read_text())
        assert res["wer"] == lda[f"{split}_wer"] and res["words"] > 0 and res["acoustic_scale"] == 0.1
        assert (exp / f"decode_{split}" / "best_path.pkl").exists()  # the SAT decoding's first pass
    with open(exp / "ali.pkl", "rb") as f:
        alis = pickle.load(f)
    feats = system.features(load_cuts(data_dir, "train", clean_only=False))
    assert all(len(feats[u]) == len(a) and feats[u].shape[1] == 40 for u, a in alis.items())


def test_sat_on_lda_mllt_features_decodes_and_aligns(lda_mllt):
    from lhotse import CutSet
    from local.dnn.front_end import FrontEnd

    data_dir, lda, sat, ali = lda_mllt
    assert sat["speaker_independent"] == "lda_mllt"
    with open(data_dir / "exp" / "sat" / "trans.pkl", "rb") as f:
        assert all(W.shape == (40, 41) for W in pickle.load(f).values())
    for split in ("dev", "test"):
        res = json.loads((data_dir / "exp" / "sat" / f"decode_{split}" / "wer.json").read_text())
        assert res["wer"] == sat[f"{split}_wer"] and res["si_first_pass_wer"] == lda[f"{split}_wer"]
    info = json.loads((data_dir / "ali" / "info.json").read_text())
    assert ali["system"] == "sat" and "lda_mllt" in info["phone_agreement"]
    for split in ("train", "dev"):
        with open(data_dir / "ali" / f"trans_{split}.pkl", "rb") as f:
            assert all(W.shape == (40, 41) for W in pickle.load(f).values())
    front = FrontEnd(data_dir, "mfcc_fmllr")  # nnet1's input follows the SAT system's features
    dev = list(CutSet.from_file(data_dir / "features" / "dev_cuts.jsonl.gz"))
    _, x = next(iter(front(dev, "dev")))
    assert front.dim == x.shape[1] == 40
    # dev's transforms are test's kind (the SAT decoding's first pass), not the transcripts' (align stage's)
    for split in ("dev", "test"):
        with open(data_dir / "exp" / "sat" / f"decode_{split}" / "trans.pkl", "rb") as f:
            decoded = pickle.load(f)
        used = front.mfcc_transforms(split)
        assert used.keys() == decoded.keys() and all(np.array_equal(used[k], decoded[k]) for k in used)
    with open(data_dir / "ali" / "trans_dev.pkl", "rb") as f:
        aligned = pickle.load(f)
    assert any(not np.array_equal(aligned[k], front.mfcc_transforms("dev")[k]) for k in aligned)


def test_a_new_set_is_decoded_at_the_sat_system_s_scale_and_penalty(trained, sat, tmp_path):
    """``decode_new_set`` (``evaluate.py --test-set``'s SAT decoding) decodes as ``decode_sat`` decoded
    test, the word insertion penalty dev picked included: the same best paths."""
    import pickle
    import shutil

    from lhotse import CutSet
    from local.gmm.common import GmmSystem
    from local.gmm.sat import decode_new_set, decode_sat
    from local.graph.lang import load_lang

    data_dir = tmp_path / "tiny"  # (a copy: the module's other tests read the SAT stage's decodings)
    shutil.copytree(trained[0], data_dir, ignore=shutil.ignore_patterns("audio"))
    res = decode_sat(data_dir, GmmSystem.load(data_dir / "exp" / "sat" / "final.pkl"),
                     GmmSystem.load(data_dir / "exp" / "tri" / "final.pkl"), load_lang(data_dir / "lang"),
                     scales=(0.1,), penalties=(0.5,))
    assert (res["acoustic_scale"], res["word_insertion_penalty"]) == (0.1, 0.5)
    with open(data_dir / "exp" / "sat" / "decode_test" / "best_path.pkl", "rb") as f:
        expected = pickle.load(f)
    _, _, best = decode_new_set(data_dir, CutSet.from_file(data_dir / "features" / "test_cuts.jsonl.gz"))
    assert expected and set(best) == set(expected)
    assert all(np.array_equal(best[u], expected[u]) for u in expected)
    assert (data_dir / "exp" / "sat" / "graph" / "HCLG_wip0.5.fst").exists()
