"""train.py: the --strategy shortcut, every config in conf/, and short CPU runs on a small
synthetic aligned data dir (random fbank, pdf-ids that depend on it), single device and GTC
with 2 forked ranks. The end-to-end run with decoding uses the ``tiny_aligned`` corpus fixture."""

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
import train
from local.dnn.datamodule import AsrDataModule

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "conf").glob("*.yaml"))
NUM_PDFS, FEAT_DIM = 6, 5


def aligned_cut(writer, rng: np.random.Generator, cut_id: str, frames: int, speaker: str):
    """One utterance of ``frames`` random fbank frames and their pdf alignment, written by ``writer``: each
    frame's pdf-id is the argmax of its first ``NUM_PDFS`` feature bins, so it can be learnt."""
    from lhotse import Features, MonoCut, SupervisionSegment

    feats = rng.standard_normal((frames, FEAT_DIM)).astype(np.float32)
    key = writer.write(cut_id, feats)
    features = Features(type="fbank", num_frames=frames, num_features=FEAT_DIM, frame_shift=0.01,
                        sampling_rate=16000, start=0, duration=frames / 100, storage_type=writer.name,
                        storage_path=str(writer.storage_path), storage_key=key, recording_id=cut_id)  # fmt: skip
    sup = SupervisionSegment(cut_id, cut_id, 0, frames / 100, speaker=speaker, text="A B")
    cut = MonoCut(cut_id, 0, frames / 100, 0, supervisions=[sup], features=features)
    pdf = np.argmax(feats[:, :NUM_PDFS], axis=1).astype(np.int32) % NUM_PDFS
    cut.pdf_ali = writer.store_array(cut_id + "-ali", pdf, frame_shift=0.01, temporal_dim=0)
    return cut


def write_aligned_dir(data_dir: Path, utts: dict[str, int], seed: int = 0) -> Path:
    """A data dir with what the DNN stage reads: ``ali/{train,dev}_cuts.jsonl.gz`` (fbank features and
    ``pdf_ali``), ``ali/info.json``, ``ali/priors.npy``, ``features/cmvn.json`` and ``adapt/fbank_{,sat_}trans.pkl``.

    Each frame's pdf-id is the argmax of its first ``NUM_PDFS`` feature bins, so it can be learnt.
    """
    from lhotse import CutSet
    from lhotse.features.io import NumpyFilesWriter

    rng = np.random.default_rng(seed)
    (data_dir / "ali").mkdir(parents=True)
    (data_dir / "features").mkdir()
    with NumpyFilesWriter(data_dir / "ali" / "storage") as writer:
        for split, num_utts in utts.items():
            cuts = []
            for i in range(num_utts):
                cut_id, frames = f"{split}-{i:03d}", int(rng.integers(5, 40))
                cuts.append(aligned_cut(writer, rng, cut_id, frames, f"spk{i % 2}"))
            CutSet.from_cuts(cuts).to_file(data_dir / "ali" / f"{split}_cuts.jsonl.gz")
    (data_dir / "ali" / "info.json").write_text(json.dumps({"num_pdfs": NUM_PDFS}))
    np.save(data_dir / "ali" / "priors.npy", np.full(NUM_PDFS, 1 / NUM_PDFS, dtype=np.float32))
    zero = {"mean": [0.0] * FEAT_DIM, "std": [1.0] * FEAT_DIM, "frames": 1}
    (data_dir / "features" / "cmvn.json").write_text(json.dumps({"global": zero, "speakers": {"spk0": zero}}))
    (data_dir / "adapt").mkdir()  # the speakers' fbank transforms (stage 7): identity
    identity = np.hstack([np.eye(FEAT_DIM), np.zeros((FEAT_DIM, 1))])
    for name in ("fbank_trans.pkl", "fbank_sat_trans.pkl"):  # fbank_fmllr's and fbank_sat's
        with open(data_dir / "adapt" / name, "wb") as f:
            pickle.dump({"spk0": identity, "spk1": identity}, f)
    return data_dir


@pytest.fixture(scope="module")
def aligned(tmp_path_factory) -> Path:
    return write_aligned_dir(tmp_path_factory.mktemp("data") / "d", {"train": 40, "dev": 8})


class ParseOnly(train.AsrCLI):
    """Parses and resolves the run (data, run dir) but instantiates nothing."""

    def instantiate_classes(self) -> None:
        pass


def parse(args: list[str]) -> ParseOnly:
    return ParseOnly(train.AcousticModel, train.AsrDataModule, args=train.expand_strategy_shortcut(args), run=False,
                     parser_kwargs={"default_config_files": [str(train.DEFAULT_CONFIG)]})


@pytest.mark.parametrize("argv,cuda,want", [
    (["--strategy", "gtc"], False, ["--trainer.strategy=gtc", "--trainer.devices=2"]),
    (["--strategy=ddp"], False, ["--trainer.strategy=ddp", "--trainer.devices=2"]),
    (["--strategy", "gtc"], True, ["--trainer.strategy=gtc", "--trainer.devices=auto"]),
    (["--strategy", "single"], True, ["--trainer.strategy=auto", "--trainer.devices=1"]),
    (["--strategy", "ma"], False, ["--trainer.strategy=ma", "--trainer.devices=2"]),
    (["--strategy", "gtc_stale"], False, ["--trainer.strategy=gtc_stale", "--trainer.devices=2"]),
    (["--strategy", "dpsgd"], True, ["--trainer.strategy=dpsgd", "--trainer.devices=auto"]),
    (["--strategy", "adpsgd"], False, ["--trainer.strategy=adpsgd", "--trainer.devices=2"]),
    (["--strategy", "bmuf_gtc"], False, ["--trainer.strategy=bmuf_gtc", "--trainer.devices=4"]),
    (["--strategy", "bmuf_gtc"], True, ["--trainer.strategy=bmuf_gtc", "--trainer.devices=auto"]),
    (["--config", "c.yaml", "--strategy", "gtc", "--trainer.devices", "4"], False,
     ["--config", "c.yaml", "--trainer.strategy=gtc", "--trainer.devices=2", "--trainer.devices", "4"]),
    (["--model.lr", "0.5"], False, ["--model.lr", "0.5"]),
])
def test_strategy_shortcut_expands_in_place(argv, cuda, want):
    assert train.expand_strategy_shortcut(argv, cuda=cuda) == want


@pytest.mark.parametrize("argv", [["--strategy", "horovod"], ["--strategy"]])
def test_bad_shortcut_raises(argv):
    with pytest.raises(ValueError, match="--strategy"):
        train.expand_strategy_shortcut(argv, cuda=False)


def test_shortcut_parses_into_trainer_arguments(aligned, tmp_path):
    cli = parse(["--strategy", "gtc", "--data.data_dir", str(aligned), "--exp_dir", str(tmp_path)])
    assert cli.config.trainer.strategy == "gtc" and cli.config.trainer.devices == "2"
    assert cli.config.run_name == "gtc" and cli.config.trainer.default_root_dir == str(tmp_path / "gtc")
    assert cli.config.model.hidden_dim == 512  # conf/default.yaml is always read
    cli = parse(["--strategy", "gtc", "--trainer.devices", "3", "--data.data_dir", str(aligned),
                 "--exp_dir", str(tmp_path), "--model.lr", "0.25"])
    assert cli.config.trainer.devices == "3" and cli.config.model.lr == 0.25
    assert parse(["--strategy", "single", "--data.data_dir", str(aligned)]).config.run_name == "baseline"


@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_every_config_parses(config, aligned, tmp_path):
    cli = parse(["--config", str(config), "--data.data_dir", str(aligned), "--exp_dir", str(tmp_path)])
    model_hp = cli.config.model
    assert model_hp.hidden_dim >= 1 and model_hp.num_layers >= 1 and cli.config.data.context >= 0
    if config.name == "strom2015.yaml":
        assert model_hp.hidden_dim == 1536 and model_hp.num_layers == 5
    if config.name == "gtc.yaml":
        assert cli.config.trainer.strategy.class_path == "gtc_lightning.GTCStrategy"
        assert cli.config.trainer.strategy.init_args.tau > 0 and cli.config.run_name == "gtc"


@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_every_config_builds_the_trainer(config, aligned, tmp_path):
    """Instantiates model, data and trainer (strategy included), as train.py does before fitting;
    conf/strom2015.yaml asks for GPUs, so it is built on CPU here."""
    from lightning.pytorch import Trainer

    import gtc_lightning

    cpu = ["--trainer.accelerator", "cpu"] if config.name == "strom2015.yaml" else []
    cli = train.build_cli(["--config", str(config), "--data.data_dir", str(aligned),
                           "--exp_dir", str(tmp_path), "--num_threads", "1", *cpu])
    assert isinstance(cli.trainer, Trainer) and cli.model.hparams.num_pdfs == NUM_PDFS
    strategy = cli.trainer.strategy
    if config.name in ("gtc.yaml", "gtc_stale.yaml", "bmuf_gtc.yaml"):  # Strom's fixed tau, as measured
        assert isinstance(strategy, gtc_lightning.GTCStrategy) and strategy.tau == 0.01
        assert strategy.target_density is None and strategy.compress == "gradient" and strategy.coding == "none"
        assert cli.trainer.num_devices == (4 if config.name == "bmuf_gtc.yaml" else 2)
        assert strategy.stale == (config.name == "gtc_stale.yaml")
    if config.name == "adpsgd.yaml":
        assert isinstance(strategy, gtc_lightning.ADPSGDStrategy) and strategy.max_staleness == 2
        assert strategy.peering == "ring" and cli.config.run_name == "adpsgd" and cli.trainer.num_devices == 2
    if config.name == "diloco.yaml":  # DiLoCo's outer step, H = 50 for the recipe's short runs
        assert type(strategy) is gtc_lightning.BMUFStrategy and strategy.period == 50
        assert (strategy.block_lr, strategy.block_momentum, strategy.nesterov) == (0.7, 0.9, True)
        assert cli.config.run_name == "diloco" and cli.trainer.num_devices == 2
    if config.name == "sparseloco.yaml":
        assert isinstance(strategy, gtc_lightning.SparseLoCoStrategy) and strategy.period == 30
        assert (strategy.density, strategy.values) == (1 / 64, "2bit") and cli.trainer.num_devices == 2
    if config.name == "gtc_auto.yaml":  # automatic tau from 0.01, Rice coding, lr 2 over conf/default.yaml's 1.0
        assert isinstance(strategy, gtc_lightning.GTCStrategy) and strategy.tau == 0.01
        assert strategy.target_density == 2.5e-3 and strategy.coding == "rice" and strategy.compress == "gradient"
        assert cli.model.hparams.lr == 2.0 and cli.config.run_name == "gtc_auto" and cli.trainer.num_devices == 2


@pytest.mark.parametrize("terminal", [False, True])
def test_progress_bar_refreshes_every_step_only_in_a_terminal(terminal, aligned, tmp_path, monkeypatch):
    import io

    class Stderr(io.StringIO):
        def isatty(self) -> bool:
            return terminal

    monkeypatch.setattr("sys.stderr", Stderr())
    cli = train.build_cli(["--config", str(ROOT / "conf" / "baseline.yaml"), "--data.data_dir", str(aligned),
                           "--exp_dir", str(tmp_path), "--num_threads", "1"])
    bars = [c for c in cli.trainer.callbacks if type(c).__name__ == "TQDMProgressBar"]
    assert len(bars) == 1 and cli.trainer.progress_bar_callback is bars[0]
    assert bars[0].refresh_rate == (1 if terminal else train.PROGRESS_EVERY)
    quiet = train.build_cli(["--config", str(ROOT / "conf" / "baseline.yaml"), "--data.data_dir", str(aligned),
                             "--exp_dir", str(tmp_path), "--num_threads", "1", "--trainer.enable_progress_bar", "false"])
    assert quiet.trainer.progress_bar_callback is None


def test_gtc_config_trains_on_the_tiny_corpus(tiny_aligned, tmp_path):
    """``train.py --config conf/tiny.yaml --config conf/gtc.yaml`` (the class path with its init_args,
    every DDP argument passed by LightningCLI), started by fork instead of popen inside pytest."""
    summary = _run(["--config", str(ROOT / "conf" / "tiny.yaml"), "--config", str(ROOT / "conf" / "gtc.yaml"),
                    "--trainer.strategy.init_args.start_method", "fork", "--data.data_dir", str(tiny_aligned),
                    "--exp_dir", str(tmp_path), "--trainer.max_epochs", "1", "--num_threads", "1"])
    assert summary["strategy_class"] == "GTCStrategy" and summary["run_name"] == "gtc"
    assert summary["world_size"] == 2 and summary["tau"] == 0.01
    assert (summary["target_density"], summary["coding"], summary["compress"]) == (None, "none", "gradient")
    assert summary["global_steps"] == 4 and summary["gtc"]["step"] == 4
    assert summary["gtc"]["total"]["bytes_sent"] > 0 and len(summary["dev_frame_acc"]) == 1


@pytest.mark.parametrize("name", ["diloco", "sparseloco"])
def test_block_sync_config_trains_on_the_tiny_corpus(name, tiny_aligned, tmp_path):
    """``conf/diloco.yaml`` and ``conf/sparseloco.yaml`` on 2 forked ranks, with a period of 2 so that the
    4 steps of the tiny run hold 2 block syncs."""
    summary = _run(["--config", str(ROOT / "conf" / "tiny.yaml"), "--config", str(ROOT / "conf" / f"{name}.yaml"),
                    "--trainer.strategy.init_args.start_method", "fork", "--trainer.strategy.init_args.period", "2",
                    "--data.data_dir", str(tiny_aligned), "--exp_dir", str(tmp_path), "--trainer.max_epochs", "1",
                    "--num_threads", "1"])
    assert summary["run_name"] == name and summary["world_size"] == 2 and summary["global_steps"] == 4
    assert summary["strategy_class"] == ("BMUFStrategy" if name == "diloco" else "SparseLoCoStrategy")
    assert summary["sync"]["total"]["syncs"] == 2 and summary["sync"]["total"]["bytes_sent"] > 0


def test_block_sync_shortcuts_are_the_registered_names(aligned, tmp_path):
    """``--strategy diloco`` is the registered ``"diloco"``: DiLoCo's own H = 500 and outer step."""
    import gtc_lightning

    for name, cls in (("diloco", gtc_lightning.BMUFStrategy), ("sparseloco", gtc_lightning.SparseLoCoStrategy)):
        cli = train.build_cli(["--strategy", name, "--data.data_dir", str(aligned), "--exp_dir", str(tmp_path),
                               "--trainer.accelerator", "cpu"])
        assert type(cli.trainer.strategy) is cls and cli.trainer.num_devices == 2
    assert (cli.trainer.strategy.period, cli.trainer.strategy.density) == (30, 1 / 64)


def test_gtc_shortcut_builds_a_two_process_cpu_trainer(aligned, tmp_path):
    import gtc_lightning

    cli = train.build_cli(["--strategy", "gtc", "--data.data_dir", str(aligned), "--exp_dir", str(tmp_path),
                           "--trainer.accelerator", "cpu"])
    assert isinstance(cli.trainer.strategy, gtc_lightning.GTCStrategy)
    assert cli.trainer.num_devices == 2
    assert cli.model.hparams.num_pdfs == NUM_PDFS and cli.model.hparams.input_dim == 17 * FEAT_DIM


def test_missing_data_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")  # a re-launched rank never prepares data itself
    with pytest.raises(RuntimeError, match="prepare.py"):
        parse(["--data.data_dir", str(tmp_path / "nothing")])


def test_datamodule_loads_cmvn_windows_and_labels(aligned):
    dm = AsrDataModule(data_dir=str(aligned), batch_size=16, dev_batch_size=64)
    dm.setup("fit")
    feats, targets, offsets = dm.splits["train"]
    assert feats.shape == (offsets[-1], FEAT_DIM) and targets.shape == (offsets[-1],) and len(offsets) == 41
    assert dm.num_pdfs == NUM_PDFS and dm.input_dim == 17 * FEAT_DIM
    batch = next(iter(dm.train_dataloader()))
    assert batch["x"].shape == (16, 17 * FEAT_DIM) and batch["y"].dtype == torch.int64
    dev = list(dm.val_dataloader())
    assert sum(len(b["y"]) for b in dev) == len(dm.splits["dev"][1])


def _run(args: list[str]) -> dict:
    cli = train.main(args)
    run_dir = Path(cli.config.trainer.default_root_dir)
    summary = json.loads((run_dir / "train_summary.json").read_text())
    assert (run_dir / "metrics.csv").exists() and (run_dir / "config.yaml").exists()
    assert Path(summary["checkpoint"]).exists()
    return summary


def test_single_device_run_learns(aligned, tmp_path):
    summary = _run(["--config", str(ROOT / "conf" / "tiny.yaml"), "--strategy", "single",
                    "--data.data_dir", str(aligned), "--exp_dir", str(tmp_path), "--trainer.max_epochs", "3",
                    "--trainer.limit_train_batches", "null", "--data.batch_size", "16", "--model.lr", "1.0"])
    accs = summary["dev_frame_acc"]
    assert summary["world_size"] == 1 and summary["strategy"] == "baseline" and len(accs) == 3
    assert summary["precision"] == "32-true"
    assert accs[-1] > 1.5 / NUM_PDFS, f"dev frame accuracy {accs} did not rise above chance"


def test_gtc_run_with_two_forked_ranks(aligned, tmp_path):
    """Also in bf16-mixed, the main job's precision where the CPU computes bfloat16: the gradient GTC
    thresholds is still float32, and the summary names the precision."""
    summary = _run(["--config", str(ROOT / "conf" / "tiny.yaml"), "--trainer.strategy", "gtc_fork",
                    "--trainer.devices", "2", "--data.data_dir", str(aligned), "--exp_dir", str(tmp_path),
                    "--trainer.max_epochs", "1", "--num_threads", "1", "--trainer.precision", "bf16-mixed"])
    assert summary["world_size"] == 2 and summary["strategy"] == "gtc" and summary["tau"] > 0
    assert summary["precision"] == "bf16-mixed"
    # the registered name alone: GTCStrategy's defaults, as fit resolved them (one optimizer: the update mode)
    from gtc_lightning.algorithms.gtc.config import DEFAULT_DENSITY

    assert (summary["target_density"], summary["coding"], summary["compress"]) == (DEFAULT_DENSITY, "rice", "update")
    assert summary["gtc"]["step"] > 0 and summary["gtc"]["total"]["bytes_sent"] > 0
    assert len(summary["dev_frame_acc"]) == 1


def test_tiny_corpus_end_to_end(request, tmp_path):
    """Baseline and GTC (2 ranks) on the tiny TTS corpus, then decoding and the comparison report. Lattices
    at beam 6, CI-sized: the one-epoch models' search is wide, and a beam of 6 rather than 8 halves its time."""
    try:
        data_dir = request.getfixturevalue("tiny_aligned")
    except pytest.FixtureLookupError:
        pytest.skip("needs the tiny_aligned corpus fixture (tests/conftest.py) from the data pipeline")
    import evaluate

    common = ["--config", str(ROOT / "conf" / "tiny.yaml"), "--data.data_dir", str(data_dir),
              "--exp_dir", str(tmp_path), "--trainer.max_epochs", "1"]
    base = _run(common + ["--strategy", "single"])
    gtc = _run(common + ["--trainer.strategy", "gtc_fork", "--trainer.devices", "2", "--num_threads", "1"])
    evaluate.main(["--runs", str(tmp_path / "baseline"), str(tmp_path / "gtc"), "--out", str(tmp_path / "cmp"),
                   "--acoustic-scales", "0.1", "--beam", "6", "--jobs", "1"])
    report = json.loads((tmp_path / "cmp" / "comparison.json").read_text())
    assert [r["run"] for r in report["runs"]] == ["baseline", "gtc"] and report["baseline"] == "baseline"
    for row in report["runs"]:
        assert row["dev_frame_acc"] is not None, "no dev frame accuracy: the corpus has no aligned dev utterances"
        assert 0 <= row["test_wer"] and 0 <= row["dev_frame_acc"] <= 1
    assert report["runs"][1]["ratio_fp32"] > 1 and report["runs"][1]["ratio_bf16"] * 2 == pytest.approx(report["runs"][1]["ratio_fp32"])
    assert base["world_size"] == 1 and gtc["world_size"] == 2
    assert (tmp_path / "cmp" / "dev_frame_acc.png").stat().st_size > 0
    assert list((tmp_path / "baseline" / "decode").glob("errs-test*"))
    # the default search: lattices once, the scale and the insertion penalty chosen on dev by rescoring
    lattice = json.loads((tmp_path / "baseline" / "decode" / "results.json").read_text())
    grid = lattice["dev_grid"]
    assert lattice["search"] == "lattice" and lattice["word_insertion_penalty"] in grid["penalties"]
    assert set(grid["penalties"]) == {0.0, 0.5, 1.0, *grid["penalties_extended"]}
    # a penalty past the grid only when dev's best sat at its edge, and then inside the grown grid
    assert not grid["penalty_at_edge"] or len(grid["penalties_extended"]) == 3
    assert len(grid["wer"]) == len(grid["penalties"]) * len(grid["grid"])
    assert lattice["dev"]["wer"] == min(lattice["dev_grid"]["wer"].values())
    assert report["intervals"]["runs"]["gtc"]["vs_baseline"]["seeds"] == [0]
    # --test-sweep decodes again what was decoded without it (also with --skip-decoded); test at the scale
    # dev picked is the sweep's entry for that scale; a second call skips the runs
    sweep_args = ["--runs", str(tmp_path / "baseline"), str(tmp_path / "gtc"), "--out", str(tmp_path / "cmp_sweep"),
                  "--acoustic-scales", "0.1", "0.2", "--beam", "8", "--max-active", "1000", "--jobs", "1",
                  "--skip-decoded", "--test-sweep", "--search", "best-path"]
    evaluate.main(sweep_args)
    results = json.loads((tmp_path / "gtc" / "decode" / "results.json").read_text())
    # (a grid of two scales always has dev's best at an edge: it grows, and test is swept over what dev tried)
    assert set(results["test_sweep"]) == {f"{s:g}" for s in results["dev_grid"]["grid"]} >= {"0.1", "0.2"}
    assert results["test"]["wer"] == results["test_sweep"][f"{results['acoustic_scale']:g}"]
    assert (tmp_path / "gtc" / "decode" / "per_utt-test-acwt0.2.json").exists()
    swept = json.loads((tmp_path / "cmp_sweep" / "comparison.json").read_text())["fixed_scales"]
    assert set(swept) >= {"0.1", "0.2"} and "vs_baseline" in swept["0.2"]["runs"]["gtc"]
    mtime = (tmp_path / "gtc" / "decode" / "results.json").stat().st_mtime
    evaluate.main(sweep_args)
    assert (tmp_path / "gtc" / "decode" / "results.json").stat().st_mtime == mtime
    # --skip-decoded takes only a decoding of the same settings: another beam or grid is decoded again
    settings = results["settings"]
    assert settings == evaluate.decode_settings("best-path", 8, 1000, (0.2, 0.1), (0.0,))
    assert evaluate.decoded(tmp_path / "gtc", True, None, settings)
    assert not evaluate.decoded(tmp_path / "gtc", True, None, {**settings, "beam": 13.0})
    assert not evaluate.decoded(tmp_path / "gtc", True, None, evaluate.decode_settings("lattice", 8, None, (0.1, 0.2),
                                                                                       (0.0, 0.5, 1.0)))
    with pytest.raises(SystemExit):  # the lattice decoder has no limit on active states to set
        evaluate.main(["--runs", str(tmp_path / "gtc"), "--max-active", "1000", "--out", str(tmp_path / "x")])
    # --rescore-lm: the lattices rescored with another LM (here the first pass's own: the same choice and
    # WERs), the first pass kept beside; a decoding without rescoring is not taken for one with it
    rescore_args = ["--runs", str(tmp_path / "baseline"), "--out", str(tmp_path / "cmp_lm"), "--acoustic-scales",
                    "0.1", "--beam", "6", "--jobs", "1", "--skip-decoded",
                    "--rescore-lm", str(data_dir / "lang" / "lm.arpa")]
    evaluate.main(rescore_args)
    rescored = json.loads((tmp_path / "baseline" / "decode" / "results.json").read_text())
    first = rescored["lm_rescore"]["first_pass"]
    assert rescored["lm_rescore"]["order"] == rescored["lm_rescore"]["first_pass_order"] == 3
    assert (first["dev_wer"], first["test_wer"]) == (rescored["dev"]["wer"], rescored["test"]["wer"])
    assert (tmp_path / "baseline" / "decode" / "errs-test-first-pass.txt").exists()
    assert evaluate.decoded(tmp_path / "baseline", rescore_lm=rescore_args[-1])
    assert not evaluate.decoded(tmp_path / "baseline") and not evaluate.decoded(tmp_path / "baseline", rescore_lm="4")
    with pytest.raises(SystemExit):
        evaluate.main(rescore_args[:-2] + ["--search", "best-path", "--rescore-lm", "4"])
    # any other test set (here the raw test manifest): features, CMVN and fbank transforms from its audio alone
    evaluate.main(["--checkpoint", str(tmp_path / "gtc" / "checkpoints" / "last.ckpt"), "--test-set",
                   str(data_dir / "manifests" / "test_cuts.jsonl.gz"), "--data-dir", str(data_dir),
                   "--out", str(tmp_path / "other"), "--acoustic-scale", "0.1", "--beam", "8", "--max-active", "1000"])
    other = json.loads((tmp_path / "other" / "decode_other" / "results-test_cuts.json").read_text())
    assert other["utterances"] > 0 and other["words"] > 0


@pytest.mark.parametrize("scheme", ["gtc", "gtc_auto", "bmuf"])
def test_simulated_workers_match_a_two_rank_run(aligned, tmp_path, scheme):
    """recipes/asr/research/simulate.py with 2 workers against train.py on 2 forked ranks, same settings: the same
    final model (rank 0's), bit for bit, and for GTC (one model on every rank) the same dev frame
    accuracy after every epoch. GTC is what the simulation models, Strom's gradient mode at tau 0.01 in
    32-bit words (conf/gtc.yaml; gtc_auto: with automatic tau from there), not GTCStrategy's defaults.
    (Between bmuf's syncs the real ranks score the mean of their models on their shares of dev, the
    simulation the mean of its workers' on all of it; the checkpoints hold that mean.)"""
    import simulate

    gtc = ["--config", str(ROOT / "conf" / "gtc.yaml"), "--trainer.strategy.init_args.start_method", "fork"]
    strategy = {"gtc": gtc,
                "gtc_auto": [*gtc, "--trainer.strategy.init_args.target_density", "0.02"],
                "bmuf": ["--trainer.strategy", "gtc_lightning.BMUFStrategy", "--trainer.strategy.period", "3",
                         "--trainer.strategy.start_method", "fork"]}[scheme]
    summary = _run(["--config", str(ROOT / "conf" / "tiny.yaml"), *strategy, "--trainer.devices", "2",
                    "--data.data_dir", str(aligned), "--exp_dir", str(tmp_path / "real"), "--num_threads", "1",
                    "--trainer.limit_train_batches", "null", "--trainer.limit_val_batches", "null",
                    "--data.batch_size", "8", "--model.schedule", "halve"])
    auto = ["--target-density", "0.02"] if scheme == "gtc_auto" else []
    tau = ["--tau", "0.01"] if scheme != "bmuf" else []
    # bmuf also flushes denormals: nothing in this tiny model is that small, so still bit for bit
    flush = ["--flush-denormal"] if scheme == "bmuf" else []
    try:
        sim = simulate.main(["--scheme", scheme.removesuffix("_auto"), *tau, *auto, *flush, "--workers", "2",
                             "--data-dir", str(aligned), "--global-batch", "16", "--epochs", "2", "--hidden-dim",
                             "32", "--num-layers", "2", "--lr", "0.5", "--period", "3",
                             "--exp-dir", str(tmp_path / "sim")])  # fmt: skip
        denormal = (torch.tensor([1e-30]) * 1e-9).item()  # 1e-39 in float32, or 0 when flushed
        assert (denormal == 0.0) == bool(flush)
    finally:
        torch.set_flush_denormal(False)
    assert sim["global_steps"] == summary["global_steps"] > 6
    if scheme != "bmuf":  # and rank 0's words, dense steps and bytes (32-bit words, as the simulation counts)
        assert sim["dev_frame_acc"] == summary["dev_frame_acc"]
        for key in ("words", "dense_steps", "bytes_sent"):
            assert sim["gtc"]["total"][key] == summary["gtc"]["total"][key], key
    if scheme == "gtc_auto":  # the same last tau, and the report knows it was automatic
        from local.dnn.compare import run_row

        assert sim["tau"] == summary["tau"] != 0.01
        assert run_row(tmp_path / "sim" / "gtc_w2")["target_density"] == 0.02
    real = torch.load(summary["checkpoint"], weights_only=False)["state_dict"]
    mine = torch.load(sim["checkpoint"], weights_only=False)["state_dict"]
    assert real.keys() == mine.keys()
    assert all(torch.equal(real[k], mine[k]) for k in real)
    from evaluate import load_checkpoint

    model, context, features = load_checkpoint(sim["checkpoint"])
    assert (context, features, model.hparams.hidden_dim) == (8, "fbank_sat", 32)


@pytest.mark.parametrize("argv,message", [
    (["--workers", "1"], "simulate 2 or more"),
    (["--workers", "3"], "does not split into 3 equal batches"),
    (["--workers", "2", "--epochs", "0"], "train at least one"),
    (["--workers", "2", "--scheme", "bmuf", "--target-density", "1e-3"], "--scheme bmuf has no tau"),
])
def test_simulate_names_bad_settings(argv, message, capsys):
    import simulate

    with pytest.raises(SystemExit):
        simulate.parse_args(["--scheme", "gtc", *argv])
    assert message in capsys.readouterr().err
