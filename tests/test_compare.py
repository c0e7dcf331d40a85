"""``gtc_lightning.tools.compare`` (gtc-compare): the guide's own comparison (docs/guide/compare.md:
DDP, a bf16 all-reduce and GTC on the example model, 2 fork-started CPU ranks, 200 steps) run and read
back from its printed table and its JSON, the guide's table and YAML checked against it, and each
error a user can make, with the value and the fix in the message. About 10 s (4 fork-started fits)."""

import contextlib
import io
import json
import math
import re
import shlex
import sys
from importlib.util import find_spec
from pathlib import Path

import lightning as L
import pytest
import torch
from _strategy_helpers import keep_master_port  # noqa: F401  (autouse: fork sets MASTER_PORT)
from lightning.pytorch.strategies import StrategyRegistry

from gtc_lightning import GTCStrategy
from gtc_lightning.algorithms.common import allreduce_bytes
from gtc_lightning.tools import compare

ROOT = Path(__file__).resolve().parents[1]
GUIDE = (ROOT / "docs" / "guide" / "compare.md").read_text()
MODEL = "examples.compare_example.TinyClassifier"
DATA = "examples.compare_example.BlobsData"
# the command reads the model and data with jsonargparse (in pyproject's [asr] extra, not the library's)
needs_jsonargparse = pytest.mark.skipif(find_spec("jsonargparse") is None, reason='needs jsonargparse[signatures]')


@pytest.fixture(scope="module", autouse=True)
def _checkout_importable():
    """The example classes import as ``examples.compare_example.*``, as from the checkout's root."""
    sys.path.insert(0, str(ROOT))
    yield
    sys.path.remove(str(ROOT))


class NoValidation(L.LightningModule):
    """Trains, never validates."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(16, 4)

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _guide_block(language: str, starting: str) -> str:
    blocks = re.findall(rf"^```{language}\n(.*?)^```", GUIDE, flags=re.MULTILINE | re.DOTALL)
    return next(b for b in blocks if b.startswith(starting))


def _rows(text: str) -> dict[str, list[str]]:
    """The table's rows by strategy: their cells."""
    rows = re.findall(r"^\| (ddp|ddp_bf16|gtc) \|(.*)\|$", text, flags=re.MULTILINE)
    return {name: [c.strip() for c in cells.split("|")] for name, cells in rows}


def _bytes(cell: str) -> float:
    number, unit = cell.split()
    return float(number) * {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9}[unit]


@pytest.fixture(scope="module")
def guide_run(tmp_path_factory):
    """The guide's command, run: (its records by strategy, what it printed, its output folder)."""
    if find_spec("jsonargparse") is None:
        pytest.skip("needs jsonargparse[signatures]")
    command = _guide_block("bash", "python -m gtc_lightning.tools.compare").splitlines()[0]
    out = tmp_path_factory.mktemp("compare")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        results = compare.main([*shlex.split(command)[3:], "--out", str(out)])
    return {r["strategy"]: r for r in results}, printed.getvalue(), out


def test_every_run_from_the_same_start(guide_run):
    """The three runs trained the same model from the same parameters, validated at the last step
    with a finite loss, and ended with identical replicas."""
    runs, _, _ = guide_run
    assert list(runs) == ["ddp", "ddp_bf16", "gtc"]
    assert len({json.dumps(r["initial_checksum"]) for r in runs.values()}) == 1
    for r in runs.values():
        assert r["steps"] == r["heldout_step"] == 200 and r["world_size"] == 2 and r["numel"] == 5508
        assert [step for step, _, _ in r["curve"]] == [40, 80, 120, 160, 200]
        assert math.isfinite(r["heldout_loss"]) and 0 < r["heldout_loss"] < math.log(4)
        assert r["replicas_identical"] and r["step_seconds"] > 0


def test_bytes_dense_by_formula_gtc_by_its_stats(guide_run):
    """DDP's bytes are the fp32 ring all-reduce of its trainable parameters at every curve point,
    bf16's half of them; GTC's come from its own counters, and are far fewer."""
    runs, _, _ = guide_run
    fp32 = allreduce_bytes(5508, 2, 4)
    assert runs["ddp"]["bytes_source"] == "ring formula" and runs["ddp"]["bytes_per_step"] == fp32
    assert [b for _, _, b in runs["ddp"]["curve"]] == [step * fp32 for step, _, _ in runs["ddp"]["curve"]]
    assert runs["ddp_bf16"]["bytes_per_step"] == allreduce_bytes(5508, 2, 2) == fp32 / 2
    gtc = runs["gtc"]
    assert gtc["bytes_source"] == "gtc_stats" and gtc["comm_hook"] == "gtc_hook"
    assert 0 < gtc["bytes_per_step"] < fp32 / 20
    assert gtc["ratio_fp32"] == pytest.approx(fp32 / gtc["bytes_per_step"])


def test_printed_table_and_files_agree_with_the_records(guide_run):
    runs, printed, out = guide_run
    assert json.loads((out / "results.json").read_text()) == json.loads(json.dumps(list(runs.values())))
    rows = _rows(printed)
    ddp = runs["ddp"]["heldout_loss"]
    for name, r in runs.items():
        loss, vs, step, sent, ratio, _, source = rows[name]
        assert (loss, vs, step) == (f"{r['heldout_loss']:.4f}", f"{100 * (r['heldout_loss'] / ddp - 1):+.1f} %", "200")
        assert (ratio, source) == (f"{r['ratio_fp32']:.1f}", r["bytes_source"])
        assert _bytes(sent) == pytest.approx(r["bytes_per_step"], rel=0.01)
    assert (out / "results.md").read_text() in printed
    if find_spec("matplotlib") is not None:
        assert (out / "loss_vs_bytes.png").stat().st_size > 0
    else:
        assert "plot skipped: matplotlib is not installed" in printed


def test_the_guide_shows_this_run(guide_run):
    """The guide's table is this run's (losses within 2 %, bytes within 5 %; not the step times), and
    its prose holds: GTC's loss more than twice DDP's after 40 steps, 2.5 % above at the end."""
    runs, printed, _ = guide_run
    shown, now = _rows(GUIDE), _rows(printed)
    assert list(shown) == list(now)
    for name in shown:
        (loss, vs, step, sent, ratio, _, source), fresh = shown[name], now[name]
        assert float(loss) == pytest.approx(float(fresh[0]), rel=0.02), name
        assert float(vs.split()[0]) == pytest.approx(float(fresh[1].split()[0]), abs=1.0), name
        assert (step, source) == (fresh[2], fresh[6])
        assert _bytes(sent) == pytest.approx(_bytes(fresh[3]), rel=0.05)
        assert float(ratio) == pytest.approx(float(fresh[4]), rel=0.05)
    (step, gtc_40, _), (_, ddp_40, _) = runs["gtc"]["curve"][0], runs["ddp"]["curve"][0]
    assert step == 40 and gtc_40 > 2 * ddp_40
    prose = " ".join(GUIDE.split())
    assert f"after 40 steps, it is more than twice DDP's; at the end, {shown['gtc'][1][1:]} above it" in prose


@needs_jsonargparse
def test_the_guides_yaml_and_registration(tmp_path):
    """The guide's YAML file parses (the command line overriding it) with the strategy its Python
    snippet registers, started by fork with its setting."""
    config = tmp_path / "compare.yaml"
    config.write_text(_guide_block("yaml", "model:"))
    exec(_guide_block("python", "from lightning"), {})  # noqa: S102  (the guide's snippet: registers gtc_dense3e-2)
    try:
        parser = compare.build_parser()
        cfg = parser.parse_args(["--config", str(config), "--model.init_args.lr", "0.001"])
        assert compare.check_config(cfg) == 2
        assert (cfg.strategies, cfg.seeds, cfg.max_steps, cfg.trainer) == (
            ["ddp", "gtc", "gtc_dense3e-2"], [0, 1, 2], 500, {"gradient_clip_val": 1.0})
        built = compare.instantiate(parser, cfg)
        assert (built.model.hparams.hidden, built.model.hparams.lr) == (128, 0.001)
        strategy = compare.make_strategy("gtc_dense3e-2")
        assert isinstance(strategy, GTCStrategy) and strategy._start_method == "fork"
        assert strategy._target_density == 3e-2
    finally:
        StrategyRegistry.remove("gtc_dense3e-2")


def test_validation_schedule_ends_on_the_last_step():
    assert compare.validation_schedule(200, 5) == 40
    assert compare.validation_schedule(12, 3) == 4
    assert compare.validation_schedule(7, 5) == 1  # 7 validations
    assert compare.validation_schedule(997, 5) == 997  # a prime: one validation, at the end


# ---- the errors: each names the bad value and the fix ------------------------------------------


def _args(*extra: str) -> list[str]:
    return ["--model", MODEL, "--data", DATA, "--max-steps", "4", *extra]


@needs_jsonargparse
@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--model", "no_such_pkg.Model", "--data", DATA], r"--model no_such_pkg\.Model: does not import.*No module"),
        (["--model", "examples.compare_example.Nope", "--data", DATA], r"Nope: does not import.*attribute"),
        (["--model", "torch.nn.Linear", "--data", DATA], r"torch\.nn\.Linear: is .*not a subclass of .*LightningModule"),
        (["--model", MODEL, "--data", MODEL], r"--data examples\.compare_example\.TinyClassifier: .*not a subclass"),
        (["--model", "test_compare.NoValidation", "--data", DATA], r"NoValidation has no validation_step.*self\.log"),
        (_args("--devices", "1"), r"1 rank\(s\) \(--devices\).*at least 2 ranks.*--devices 2"),
        (_args("--accelerator", "gpu"), r"\d rank\(s\) \(GPUs present\).*--accelerator cpu"),
        (_args("--strategies", "ddp", "no_such"), r"'no_such' is not a registered strategy; registered: .*ddp_bf16.*gtc"),
        (_args("--strategies", "fsdp"), r"'fsdp' is FSDPStrategy, not of the DDP family"),
        (_args("--trainer", "{max_steps: 3}"), r"--trainer \['max_steps'\]: set by this command; use \['--max-steps'\]"),
    ],
    ids=["no-module", "no-class", "not-a-module", "not-a-datamodule", "no-validation", "one-rank", "no-gpu",
         "unknown-strategy", "not-ddp-family", "trainer-arg"],
)
def test_errors_before_any_run(argv, expected, tmp_path):
    if "--accelerator" in argv and torch.cuda.device_count() >= 2:
        pytest.skip("two GPUs present")
    with pytest.raises(ValueError, match=expected):
        compare.main([*argv, "--out", str(tmp_path)])
    assert not (tmp_path / "runs").exists()


@needs_jsonargparse
def test_a_bad_class_path_in_a_config_file(tmp_path):
    config = tmp_path / "cfg.yaml"
    config.write_text(f"model: {MODEL}\ndata:\n  class_path: examples.compare_example.NoSuchData\n")
    with pytest.raises(ValueError, match=r"--data examples\.compare_example\.NoSuchData: does not import"):
        compare.main(["--config", str(config), "--out", str(tmp_path)])


@needs_jsonargparse
def test_a_metric_the_model_does_not_log(tmp_path):
    """Known only after a run: the error lists what validation logged."""
    with pytest.raises(ValueError, match=r"--monitor val_acc: .*it logged \['val_loss'\].*self\.log\('val_acc'"):
        compare.main(_args("--strategies", "ddp", "--monitor", "val_acc", "--out", str(tmp_path)))


@needs_jsonargparse
def test_command_line_errors_are_one_line(monkeypatch):
    """The console script exits with the message, no traceback."""
    monkeypatch.setattr(sys, "argv", ["gtc-compare", *_args("--devices", "1")])
    with pytest.raises(SystemExit, match=r"^gtc-compare: error: 1 rank\(s\)"):
        compare.cli()


def test_without_jsonargparse_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "jsonargparse", None)  # import fails as if not installed
    with pytest.raises(SystemExit, match=r'pip install "jsonargparse\[signatures\]"'):
        compare.main(_args())
