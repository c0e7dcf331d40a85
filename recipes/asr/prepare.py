#!/usr/bin/env python3
"""Data pipeline of the hybrid DNN-HMM recipe, Kaldi/icefall style.

Stages (each skipped when it has already completed; ``--stage`` / ``--stop-stage`` select them):

  0  corpus    corpus -> Lhotse manifests (embedded TTS corpus, or a local real corpus)
  1  features  40-bin fbank (DNN) + 13 MFCC (GMM), CMVN statistics
  2  lang      CMUdict lexicon, phones/words, HMM topology, L.fst, n-gram LM -> G.fst
  3  mono      monophone GMM-HMM: flat start, Viterbi training; decode dev/test
  4  tri       triphone GMM-HMM on a phonetic decision tree (Δ + ΔΔ), then the LDA+MLLT triphone
               system from its alignments (exp/lda_mllt; not with --no-lda-mllt); decode both on
               dev/test. SAT, align and adapt work on the LDA+MLLT system's 40-dim features
  5  sat       speaker-adaptive triphone GMM-HMM (per-speaker fMLLR); decode dev/test with fMLLR
  6  align     DNN targets: fMLLR alignments with the SAT system (align_fmllr.sh), pdf priors,
               agreement with TTS gold timings
  7  adapt     DNN speaker adaptation: per-speaker fbank fMLLR of every split, against a fbank UBM (no
               transcripts) and against per-pdf fbank Gaussians on the SAT system's alignments
               (training) and fMLLR decoding (dev, test)
  8  report    report.json and a readable summary

These are the recipe's stages 0-8 in run.sh too (its 9-11 train the baseline and GTC, decode and compare).

Stage 0 records the corpus options (--corpus, --corpus-dir, --size, --seed, --train-parts) in
``<data-dir>/settings.json``; later runs on that data dir take them from there when left out, and refuse
a value that differs (rebuild from stage 0 with --force, or use another --data-dir). LDA+MLLT before SAT
(on by default, as in Kaldi's recipes; --no-lda-mllt: SAT on the Δ + ΔΔ system) is recorded there too: left
out, the recorded setting is taken (a data dir built by an earlier recipe, whose settings.json has no such
entry, was built without it); given, a data dir whose GMM stages were built the other way is refused until
they are rebuilt (``--stage 4 --force``). So are --beam and --max-active, the GMM decodings' search
(default 10 and 3,000; Kaldi's 13 and 7,000): left out, the recorded ones are taken; others are refused
until the decoding stages are rebuilt (``--stage 3 --force``).

A stage is marked done (``<data-dir>/.done/<stage>``) only when it completed, and before it runs
what it writes (``STAGE_OUTPUTS``) is cleared: killing a run in the middle of any stage and running
the same command again gives what an uninterrupted run gives (``local/atomic.py``).

Usage:
  python recipes/asr/prepare.py                                  # embedded corpus, default size
  python recipes/asr/prepare.py --corpus synthetic --size tiny --data-dir data/tiny
  python recipes/asr/prepare.py --corpus mini_librispeech --corpus-dir /path/to/LibriSpeech
  python recipes/asr/prepare.py --corpus librispeech --corpus-dir /path/to/LibriSpeech \
      --train-parts train-clean-100 train-clean-360 --lm-text more_sentences.txt --oov g2p
  python recipes/asr/prepare.py --corpus kaldi --corpus-dir /path/to/data --lexicon lexicon.txt
  python recipes/asr/prepare.py --corpus librispeech --corpus-dir /path/to/LibriSpeech \
      --lm-arpa 3-gram.pruned.1e-7.arpa.gz                       # the first pass's LM: the user's ARPA
  python recipes/asr/prepare.py --stage 3 --stop-stage 5         # re-run the GMM stages only
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from local.atomic import write_json, write_text
from local.drops import clear_drops
from local.graph.decode import Search

log = logging.getLogger("prepare")

STAGES = ["corpus", "features", "lang", "mono", "tri", "sat", "align", "adapt", "report"]
CORPORA = ["synthetic", "mini_librispeech", "librispeech", "timit", "yesno", "kaldi"]
# What each stage writes under the data dir (globs), cleared before the stage runs: what a killed
# run of it left (a truncated manifest, a storage shard of another --num-jobs, a GMM half trained,
# a corpus mirror) is never taken for its output. The synthetic corpus's audio is its own output;
# a real corpus's audio stays where it is (--corpus-dir) and is never touched.
STAGE_OUTPUTS = {
    "corpus": ["manifests", ".corpus-mirror-*"],
    "features": ["features"],
    "lang": ["lang"],
    "mono": ["exp/mono"],
    "tri": ["exp/tri", "exp/lda_mllt"],  # lda_mllt: trained in the tri stage with --lda-mllt
    "sat": ["exp/sat"],
    "align": ["ali"],
    "adapt": ["adapt"],
    "report": ["report.json"],
}


# files a completed stage must have written today; a stage marked done without them (an older
# version of the recipe) runs again, and the stages after it with it
STAGE_REQUIRES = {"adapt": ["adapt/fbank_sat_trans.pkl"]}
# the GMM sizes that prepare.py sets (--tri-leaves ...): tree leaves and total Gaussians of tri, lda_mllt
# (not with --no-lda-mllt) and sat
GMM_SIZES = ("tri_leaves", "tri_gauss", "lda_mllt_leaves", "lda_mllt_gauss", "sat_leaves", "sat_gauss")
# the stages a data dir built with or without LDA+MLLT holds that the setting changes
LDA_MLLT_STAGES = ("tri", "sat", "align", "adapt", "report")
# the stages whose output the GMM decodings' search (--beam, --max-active) changes: the decodings, the
# DNN's dev and test fbank transforms made from SAT's (adapt), the report
GMM_SEARCH_STAGES = ("mono", "tri", "sat", "adapt", "report")


def default_data_dir(corpus: str, size: str) -> Path:
    """``data/synthetic-<size>`` for the embedded corpus, ``data/<corpus>`` otherwise."""
    return Path("data") / (f"synthetic-{size}" if corpus == "synthetic" else corpus)


def _marker(data_dir: Path, stage: str) -> Path:
    return data_dir / ".done" / stage


def clear_stage_outputs(data_dir: Path, name: str, corpus: str = "synthetic") -> list[Path]:
    """Remove what stage ``name`` writes under ``data_dir`` (``STAGE_OUTPUTS``, plus ``audio/``
    for the synthetic corpus); returns what was removed."""
    patterns = STAGE_OUTPUTS[name] + (["audio"] if name == "corpus" and corpus == "synthetic" else [])
    removed = []
    for pattern in patterns:
        for path in sorted(data_dir.glob(pattern)):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
            removed.append(path)
    return removed


def _run_stage(name: str, data_dir: Path, args: argparse.Namespace) -> str:
    """Run one stage; return the line that says what it produced."""
    if name == "corpus":
        if args.corpus == "synthetic":
            from local.data.corpus_synthetic import prepare_synthetic

            cuts = prepare_synthetic(data_dir, size=args.size, seed=args.seed, num_jobs=args.num_jobs)
        else:
            from local.data.corpus_real import prepare_real

            if args.corpus_dir is None:
                raise SystemExit(f"--corpus {args.corpus} needs --corpus-dir pointing at the corpus on disk")
            cuts = prepare_real(args.corpus, Path(args.corpus_dir), data_dir, args.train_parts,
                                allow_shared_speakers=args.allow_shared_speakers)
        parts = [f"{s}: {len(c)} utts {sum(x.duration for x in c) / 3600:.2f} h" for s, c in cuts.items()]
        return "; ".join(parts)
    if name == "features":
        from local.data.features import compute_features

        return _summary(compute_features(data_dir, num_jobs=args.num_jobs))
    if name == "lang":
        from local.graph.lang import prepare_lang

        return _summary(prepare_lang(data_dir, lexicon=args.lexicon, lm_text=args.lm_text, oov=args.oov,
                                     tags=args.tags, unk_word=args.unk_word, lm_arpa=args.lm_arpa,
                                     unk_model=args.unk_model))
    if name == "mono":
        from local.gmm.mono import train_mono

        return _summary(train_mono(data_dir, seed=args.seed, search=args.search))
    if name == "tri":
        from local.gmm.tri import train_tri

        sizes = args.gmm_sizes
        line = _summary(train_tri(data_dir, sizes["tri_leaves"], sizes["tri_gauss"], seed=args.seed,
                                  search=args.search, corpus=args.corpus))
        if args.lda_mllt:
            from local.gmm.lda_mllt import train_lda_mllt

            lda = train_lda_mllt(data_dir, sizes["lda_mllt_leaves"], sizes["lda_mllt_gauss"], seed=args.seed,
                                 search=args.search, corpus=args.corpus)
            line += "; lda_mllt: " + _summary(lda)
        return line
    if name == "sat":
        from local.gmm.sat import train_sat

        sizes = args.gmm_sizes
        from local.gmm.sat import SAT_SCHEDULES

        return _summary(train_sat(data_dir, sizes["sat_leaves"], sizes["sat_gauss"], seed=args.seed,
                                  search=args.search, corpus=args.corpus, **SAT_SCHEDULES[args.sat_schedule],
                                  **({"speaker_independent": "lda_mllt"} if args.lda_mllt else {})))
    if name == "align":
        from local.gmm.align import align

        return _summary(align(data_dir, seed=args.seed))
    if name == "adapt":
        from local.dnn.adapt import adapt, adapt_sat

        summary = adapt(data_dir, seed=args.seed)
        sat = adapt_sat(data_dir)
        summary["fbank_sat"] = {split: v["gain_per_frame"] for split, v in sat["splits"].items()}
        summary["seconds"] = round(summary["seconds"] + sat["seconds"], 1)
        return _summary(summary)
    if name == "report":
        from local.report import make_report

        return _summary(make_report(data_dir, corpus=args.corpus))
    raise AssertionError(name)


SETTING_DEFAULTS = {"corpus": "synthetic", "corpus_dir": None, "size": "default", "seed": 0, "train_parts": None}
SETTING_FLAGS = {"corpus": "--corpus", "corpus_dir": "--corpus-dir", "size": "--size", "seed": "--seed",
                 "train_parts": "--train-parts"}


def resolve_settings(data_dir: Path, recorded: dict | None, given: dict, stage: int, force: bool) -> dict:
    """The corpus settings a run works with: each of ``given`` (``SETTING_DEFAULTS``' keys) that is not
    ``None``, else the one ``recorded`` in the data dir's ``settings.json``, else the default. Unless
    stage 0 is rebuilt (``stage=0, force=True``) or nothing is recorded yet, a given value that differs
    from the recorded one is refused, naming both and the fix."""
    rebuild = recorded is None or (stage == 0 and force)
    base = SETTING_DEFAULTS if rebuild else {**SETTING_DEFAULTS, **recorded}
    differ = {} if rebuild else {k: v for k, v in given.items() if v is not None and v != base[k]}
    if differ:
        were = ", ".join(f"{SETTING_FLAGS[k]} {_shown(base[k])}" for k in differ)
        now = ", ".join(f"{SETTING_FLAGS[k]} {_shown(v)}" for k, v in differ.items())
        why = ("stage 0 is rebuilt only with --force" if stage == 0 else
               f"stages {stage} on would be built on other settings than the corpus under them")
        raise SystemExit(
            f"{data_dir} was prepared with {were} (settings.json), and this run gives {now}: {why}. Leave "
            f"{' and '.join(map(SETTING_FLAGS.get, differ))} out (the recorded settings are taken), rebuild from "
            "stage 0 (--stage 0 --force), or use another --data-dir")
    return {k: given[k] if given[k] is not None else base[k] for k in SETTING_DEFAULTS}


def _shown(value) -> str:
    return " ".join(value) if isinstance(value, list) else str(value)


def _without_flag(settings: dict) -> dict:
    """``settings`` without the ``lda_mllt`` and ``gmm_search`` entries, which ``check_lda_mllt`` and
    ``check_gmm_search`` compare on their own."""
    return {k: v for k, v in settings.items() if k not in ("lda_mllt", "gmm_search")}


def _built_with_lda_mllt(data_dir: Path, stage: int, force: bool) -> list[str]:
    """The stages of ``data_dir`` that the LDA+MLLT setting changes and this run keeps (done, and not
    rebuilt from the tri stage)."""
    if force and stage <= STAGES.index("tri"):
        return []
    return [name for name in LDA_MLLT_STAGES if _marker(data_dir, name).exists()]


def resolve_lda_mllt(data_dir: Path, recorded: dict | None, lda_mllt: bool | None, stage: int,
                     force: bool) -> bool:
    """``--lda-mllt`` / ``--no-lda-mllt``; left out (None): the data dir's recorded setting, else on (the
    default; like the GMM search, a recorded setting holds for a rebuild too). A data dir built by an earlier
    recipe, whose ``settings.json`` has no ``lda_mllt`` entry, was built without it: its built GMM stages
    keep that (said in the log), a rebuild from the tri stage gets the default."""
    if lda_mllt is not None:
        return lda_mllt
    if recorded is not None and "lda_mllt" in recorded:
        return bool(recorded["lda_mllt"])
    built = _built_with_lda_mllt(data_dir, stage, force)
    if built:
        log.warning("%s: stages %s were built without LDA+MLLT, by a recipe whose default that was "
                    "(settings.json had no lda_mllt entry; it now records this); they are kept so. --lda-mllt "
                    "--stage %d --force rebuilds them with it, the default now",
                    data_dir, ", ".join(built), STAGES.index("tri"))
        return False
    return True


def check_lda_mllt(data_dir: Path, recorded: dict | None, lda_mllt: bool, stage: int, force: bool) -> None:
    """Refuse to continue a data dir whose GMM stages (tri on) were built with the other LDA+MLLT setting
    (``settings.json``; no entry: without, by an earlier recipe), unless this run rebuilds them from the
    tri stage (``--stage`` at most 4 with ``--force``)."""
    was = bool((recorded or {}).get("lda_mllt", False))
    if was == lda_mllt:
        return
    built = _built_with_lda_mllt(data_dir, stage, force)
    if not built:
        return
    flag = "--lda-mllt" if was else "--no-lda-mllt"
    raise SystemExit(
        f"{data_dir}'s stages {', '.join(built)} were built {'with' if was else 'without'} LDA+MLLT "
        f"(settings.json); to change that, rebuild them from the tri stage: add --stage {STAGES.index('tri')} "
        f"--force (or use another --data-dir, or run with {flag})"
    )


def recorded_search(recorded: dict | None) -> Search:
    """The GMM search ``settings.json`` records (``gmm_search``); the recipe's when it records none."""
    return Search(**(recorded or {}).get("gmm_search", {}))


def check_gmm_search(data_dir: Path, recorded: dict | None, search: Search, stage: int, force: bool) -> None:
    """Refuse to continue a data dir whose decoding stages (mono on) were built with another GMM search
    (``--beam``, ``--max-active``; ``settings.json``'s ``gmm_search``, absent: the recipe's), unless this run
    rebuilds them from the mono stage (``--stage`` at most 3 with ``--force``): a done stage would be skipped
    and keep the decodings of the other search."""
    was = recorded_search(recorded)
    if was == search:
        return
    built = [name for name in GMM_SEARCH_STAGES if _marker(data_dir, name).exists()]
    if not built or (force and stage <= STAGES.index("mono")):
        return
    raise SystemExit(
        f"{data_dir}'s stages {', '.join(built)} were decoded with --beam {was.beam:g} --max-active {was.max_active} "
        f"(settings.json), not --beam {search.beam:g} --max-active {search.max_active}; to change that, rebuild "
        f"them from the mono stage: add --stage {STAGES.index('mono')} --force (or use another --data-dir, or run "
        f"with --beam {was.beam:g} --max-active {was.max_active})"
    )


def _gmm_size(text: str) -> int | str:
    """A GMM size option's value: ``auto`` or a positive whole number."""
    if text == "auto":
        return text
    if text.isdigit() and int(text) > 0:
        return int(text)
    raise argparse.ArgumentTypeError(f"{text!r}: give a positive whole number or auto")


def _cpu_seconds() -> float:
    """CPU time (user + system) of this process and its finished children: on a shared machine,
    what a stage would take alone (its wall time when it runs in one process)."""
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _summary(result, prefix: str = "") -> str:
    """``key=value`` pairs of a stage's result; nested dicts (e.g. per split) one level deep."""
    if not isinstance(result, dict):
        return str(result)
    parts = []
    for k, v in result.items():
        if isinstance(v, dict) and not prefix:
            parts.append(_summary(v, prefix=f"{k}."))
        elif not isinstance(v, (dict, list)) and not hasattr(v, "__len__") or isinstance(v, str):
            parts.append(f"{prefix}{k}={_fmt(v)}")
    return ", ".join(p for p in parts if p)


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def prepare(
    corpus: str | None = None,
    corpus_dir: str | Path | None = None,
    data_dir: str | Path | None = None,
    size: str | None = None,
    stage: int = 0,
    stop_stage: int = len(STAGES) - 1,
    seed: int | None = None,
    num_jobs: int = 2,
    force: bool = False,
    train_parts: list[str] | None = None,
    lexicon: str | Path | None = None,
    lm_text: str | Path | None = None,
    oov: str | None = None,
    gmm_sizes: dict[str, int | str] | None = None,
    lda_mllt: bool | None = None,
    sat_schedule: str = "kaldi",
    beam: float | None = None,
    max_active: int | None = None,
    tags: list[str] | None = None,
    unk_word: str = "<UNK>",
    lm_arpa: str | Path | None = None,
    allow_shared_speakers: bool = False,
    unk_model: str = "phone",
) -> Path:
    """Run stages ``stage..stop_stage``; return the data directory. Importable by train.py.

    ``train_parts`` (LibriSpeech's training parts) and ``allow_shared_speakers`` (a speaker in two splits a
    warning, not an error: ``local.data.validate``) reach stage 0; ``lexicon``, ``lm_text``, ``oov``
    (None: ``unk`` for a real corpus, ``drop`` for the embedded one: ``local/graph/lexicon.py`` says why),
    ``tags`` (``TAG=PHONE`` items, None: ``local.graph.tags.DEFAULT_TAGS``), ``unk_word``, ``unk_model`` (how
    the decoding graphs spell ``unk_word``: ``local/graph/unk_model.py``) and ``lm_arpa`` (the first pass's
    LM, ``local/graph/user_lm.py``) reach stage 2. ``gmm_sizes``: any of ``GMM_SIZES`` (the
    triphone, LDA+MLLT and SAT systems' leaves and Gaussians), each a number or ``"auto"`` (the default:
    from the hours of training speech, ``local.gmm.sizes``). ``lda_mllt``: train the LDA+MLLT system in
    the tri stage and build SAT, align and adapt on its features (None: the one recorded in
    ``settings.json``, else True; recorded there; ``resolve_lda_mllt``, ``check_lda_mllt``).
    ``sat_schedule``: the SAT stage's passes of re-alignment and fMLLR re-estimation, ``"kaldi"`` (the
    default) or ``"recipe"`` (``local.gmm.sat.SAT_SCHEDULES``). ``beam``, ``max_active``: the GMM systems'
    dev and test decodings' search (``local.graph.decode.Search``; None: the one recorded in
    ``settings.json``, else the recipe's 10 and 3,000), recorded there when not the recipe's; one that differs
    from the recorded search is refused unless the decoding stages are rebuilt (``check_gmm_search``).

    ``corpus``, ``corpus_dir``, ``size``, ``seed`` and ``train_parts`` describe what stage 0 built and are
    recorded in ``settings.json``; left ``None``, they are taken from there (or default to the embedded
    corpus's: synthetic, default size, seed 0). A value given that differs from the recorded one is refused
    (``resolve_settings``) unless stage 0 is rebuilt (``stage=0, force=True``): the stages after it would
    otherwise be built on other settings than the corpus under them, and the record would say so wrongly."""
    data_dir = Path(data_dir) if data_dir is not None else default_data_dir(corpus or "synthetic", size or "default")
    settings = data_dir / "settings.json"
    recorded = json.loads(settings.read_text()) if settings.exists() else None
    given = {"corpus": corpus, "corpus_dir": str(corpus_dir) if corpus_dir else None, "size": size, "seed": seed,
             "train_parts": list(train_parts) if train_parts else None}
    resolved = resolve_settings(data_dir, recorded, given, stage, force)
    corpus, size, seed, corpus_dir = resolved["corpus"], resolved["size"], resolved["seed"], resolved["corpus_dir"]
    train_parts = resolved["train_parts"]
    if corpus not in CORPORA:
        raise ValueError(f"unknown corpus {corpus!r}; choose one of {CORPORA}")
    from local.graph.lexicon import OOV_POLICIES, default_oov
    from local.graph.tags import check_unk_word, parse_tags

    oov = oov if oov is not None else default_oov(corpus)
    if oov not in OOV_POLICIES:
        raise ValueError(f"unknown --oov {oov!r}; choose drop, unk or g2p")
    tag_map, unk_word = parse_tags(tags), check_unk_word(unk_word)
    from local.graph.unk_model import UNK_MODELS

    if unk_model not in UNK_MODELS:
        raise ValueError(f"unknown --unk-model {unk_model!r}; choose phone or spn")
    if lm_arpa is not None and not Path(lm_arpa).is_file():
        raise ValueError(f"--lm-arpa {lm_arpa}: no such file; give an ARPA back-off LM (gzipped or not)")
    if lm_arpa is not None and lm_text is not None:
        raise ValueError("--lm-arpa replaces the recipe's LM, which --lm-text feeds: give one of them")
    if corpus == "synthetic" and (train_parts or corpus_dir):
        raise ValueError("--train-parts and --corpus-dir are for a real corpus (--corpus librispeech, kaldi, ...)")
    if sat_schedule not in ("recipe", "kaldi"):
        raise ValueError(f"unknown --sat-schedule {sat_schedule!r}; choose recipe or kaldi")
    if size not in ("tiny", "default"):
        raise ValueError(f"unknown --size {size!r}; choose tiny or default")
    if not 0 <= stage <= stop_stage < len(STAGES):
        raise ValueError(f"need 0 <= stage ({stage}) <= stop_stage ({stop_stage}) <= {len(STAGES) - 1}")
    if set(gmm_sizes or {}) - set(GMM_SIZES):
        raise ValueError(f"unknown GMM sizes {sorted(set(gmm_sizes) - set(GMM_SIZES))}; use {list(GMM_SIZES)}")
    was = recorded_search(recorded)  # left out: the data dir's search, else the recipe's
    search = Search(float(beam) if beam is not None else was.beam,
                    max_active if max_active is not None else was.max_active)
    lda_mllt = resolve_lda_mllt(data_dir, recorded, lda_mllt, stage, force)
    data_dir.mkdir(parents=True, exist_ok=True)
    args = argparse.Namespace(corpus=corpus, corpus_dir=corpus_dir, size=size, seed=seed, num_jobs=num_jobs,
                              train_parts=train_parts, lexicon=lexicon, lm_text=lm_text, oov=oov,
                              tags=tag_map, unk_word=unk_word, lm_arpa=lm_arpa, unk_model=unk_model,
                              lda_mllt=lda_mllt, sat_schedule=sat_schedule, search=search)  # fmt: skip
    args.gmm_sizes = {**dict.fromkeys(GMM_SIZES, "auto"), **(gmm_sizes or {})}
    args.allow_shared_speakers = allow_shared_speakers
    wanted = {"corpus": corpus, "corpus_dir": corpus_dir, "size": size, "seed": seed}
    if train_parts:  # (only when given: data dirs prepared before these options stay valid)
        wanted["train_parts"] = list(train_parts)
    if corpus == "synthetic":
        from local.data.corpus_synthetic import VERSION

        wanted["version"] = VERSION  # an embedded corpus built by an older recipe is not silently reused
    rebuild = recorded is None or (stage == 0 and force)
    if not rebuild and stage == 0 and _without_flag(recorded) != wanted:
        raise SystemExit(
            f"{data_dir} was prepared with {settings.read_text().strip()}, not {wanted}; "
            "use another --data-dir or --force to rebuild it"
        )
    check_lda_mllt(data_dir, recorded, lda_mllt, stage, force)
    check_gmm_search(data_dir, recorded, search, stage, force)
    # Later stages build on what stage 0 made: its record stays as written then (an older corpus version too).
    record = _without_flag(wanted if rebuild else recorded)
    record["lda_mllt"] = lda_mllt
    if search != Search():  # (likewise: only when not the recipe's)
        record["gmm_search"] = search.record()
    write_text(settings, json.dumps(record))
    for i in range(stage, stop_stage + 1):
        name = STAGES[i]
        marker = _marker(data_dir, name)
        lacking = [f for f in STAGE_REQUIRES.get(name, ()) if not (data_dir / f).exists()]
        if marker.exists() and not force and not lacking:
            log.info("stage %d %-8s skipped: done on %s (delete %s to redo)", i, name, marker.read_text().strip(), marker)
            continue
        if marker.exists() and lacking:
            log.info("stage %d %-8s: done by an older version of the recipe (no %s): running it again", i, name,
                     ", ".join(lacking))
        start, cpu_start = time.perf_counter(), _cpu_seconds()
        log.info("stage %d %-8s ...", i, name)
        for later in STAGES[i:]:  # what a re-run stage produces invalidates what was built on it
            _marker(data_dir, later).unlink(missing_ok=True)
        clear_drops(data_dir, name)
        removed = clear_stage_outputs(data_dir, name, corpus)
        if removed:
            log.info("stage %d %-8s: cleared %s (an earlier or interrupted run's)", i, name,
                     ", ".join(str(p.relative_to(data_dir)) for p in removed))
        line = _run_stage(name, data_dir, args)
        seconds, cpu = time.perf_counter() - start, _cpu_seconds() - cpu_start
        marker.parent.mkdir(exist_ok=True)
        for file, value in (("stage_seconds.json", seconds), ("stage_cpu_seconds.json", cpu)):
            timings = data_dir / file
            times = json.loads(timings.read_text()) if timings.exists() else {}
            times[name] = round(value, 2)
            write_json(timings, times)
        write_text(marker, time.strftime("%Y-%m-%d %H:%M:%S") + f" in {seconds:.1f} s\n")  # last: done
        log.info("stage %d %-8s done in %.1f s (%.1f s of CPU): %s", i, name, seconds, cpu, line)
    return data_dir


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", default=None, choices=CORPORA,
                   help="which corpus to prepare (default: the data dir's settings.json, else synthetic)")
    p.add_argument("--corpus-dir", default=None, help="directory holding a real corpus (not synthetic)")
    p.add_argument("--data-dir", default=None, help="where everything is written (default data/<corpus>[-size])")
    p.add_argument("--size", default=None, choices=["tiny", "default"],
                   help="synthetic corpus size (default: the data dir's settings.json, else default)")
    p.add_argument("--stage", type=int, default=0, help=f"first stage to run (0-{len(STAGES) - 1})")
    p.add_argument("--stop-stage", type=int, default=len(STAGES) - 1, help=f"last stage to run (0-{len(STAGES) - 1})")
    p.add_argument("--seed", type=int, default=None,
                   help="seed of the synthetic corpus and of the GMM and adaptation stages (mono, tri, sat, align, "
                        "adapt: its UBM); default: the data dir's settings.json, else 0")
    p.add_argument("--lda-mllt", action=argparse.BooleanOptionalAction, default=None,
                   help="train an LDA+MLLT triphone system in the tri stage (exp/lda_mllt) and build SAT, align and "
                        "adapt on its features (default: the data dir's settings.json, else on; --no-lda-mllt: SAT "
                        "on the Δ + ΔΔ triphone system)")
    p.add_argument("--sat-schedule", default="kaldi", choices=["kaldi", "recipe"],
                   help="the SAT stage's passes of fMLLR re-estimation and re-alignment: kaldi (the default, "
                        "train_sat.sh's: fMLLR at 2, 4, 6, 12, realign at 10, 20, 30) or recipe (the recipe's "
                        "earlier one: fMLLR at pass 20, realign at 10, 25; a weaker SAT GMM on dev)")
    for name in GMM_SIZES:
        system, what = name.rsplit("_", 1)
        p.add_argument(f"--{system.replace('_', '-')}-{what}", type=_gmm_size, default="auto",
                       help=f"{'leaves' if what == 'leaves' else 'Gaussians in total'} of the {system} system, or "
                            "auto: from the hours of training speech (default)")
    p.add_argument("--beam", type=float, default=None,
                   help="decoding beam of the GMM systems' dev and test decodings (default: the data dir's "
                        "settings.json, else 10; Kaldi's decode.sh: 13, with --max-active 7000, about 2.5 times the "
                        "decoding time)")
    p.add_argument("--max-active", type=int, default=None,
                   help="most active decoder states per frame in those decodings (default: the data dir's "
                        "settings.json, else 3000; Kaldi's: 7000)")
    p.add_argument("--num-jobs", type=int, default=2, help="parallel processes for synthesis and features")
    p.add_argument("--force", action="store_true", help="re-run the selected stages even if done")
    p.add_argument("--train-parts", nargs="+", default=None,
                   help="librispeech: its training parts (default train-clean-100; also train-clean-360, train-other-500)")
    p.add_argument("--allow-shared-speakers", action="store_true",
                   help="stage 0: go on, with a warning, when a speaker is in two of train/dev/test (refused otherwise: "
                        "dev and test would score speakers the model was trained on); CMVN and speaker transforms stay per split")
    p.add_argument("--lexicon", default=None,
                   help="a Kaldi lexicon.txt (WORD PH1 PH2 ..., CMUdict's 39 phones) replacing or extending CMUdict")
    p.add_argument("--lm-text", default=None, help="more LM training text, one sentence per line (never the test set)")
    p.add_argument("--oov", default=None, choices=["drop", "unk", "g2p"],
                   help="training words no lexicon knows: drop their utterances (counted), unk (map them to "
                        "--unk-word, pronounced SPN, as Kaldi does) or g2p (flite's rules); default unk for a real "
                        "corpus, drop for the embedded one")
    p.add_argument("--unk-word", default="<UNK>", help="the unknown word of --oov unk (a tag: not scored)")
    p.add_argument("--unk-model", default="phone", choices=["phone", "spn"],
                   help="how the decoding graphs spell --unk-word: phone (any 2 or more phones, weighted by a phone "
                        "bigram of the lexicon, Kaldi's make_unk_lm.sh; default) or spn (its garbage phone, as in "
                        "training)")
    p.add_argument("--tags", nargs="+", default=None, metavar="TAG=PHONE",
                   help="the transcripts' noise tags and their silence-like phone, SPN (spoken noise) or NSN, "
                        "replacing the default list: <UNK>=SPN <SPOKEN_NOISE>=SPN [vocalized-noise]=SPN "
                        "[laughter]=SPN <NOISE>=NSN [noise]=NSN (tags are never scored)")
    p.add_argument("--lm-arpa", default=None,
                   help="the first pass's LM: an ARPA file (pruned or not, gzipped or not) instead of the recipe's "
                        "trigram; its words no lexicon knows leave G, counted (or get flite's pronunciations with "
                        "--oov g2p); not with --lm-text")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    prepare(a.corpus, a.corpus_dir, a.data_dir, a.size, a.stage, a.stop_stage, a.seed, a.num_jobs, a.force,
            a.train_parts, a.lexicon, a.lm_text, a.oov,
            gmm_sizes={name: getattr(a, name) for name in GMM_SIZES}, lda_mllt=a.lda_mllt,
            sat_schedule=a.sat_schedule, beam=a.beam, max_active=a.max_active, tags=a.tags,
            unk_word=a.unk_word, lm_arpa=a.lm_arpa, allow_shared_speakers=a.allow_shared_speakers,
            unk_model=a.unk_model)  # fmt: skip


if __name__ == "__main__":
    main()
