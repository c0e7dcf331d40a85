"""local/dnn/precision.py: the main job's training precision (bf16-mixed only where the device computes
bfloat16 natively), and train.py's warning when bf16 is asked for on a CPU that emulates it."""

import logging
import platform
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.accelerators import CPUAccelerator
from local.dnn import precision

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("native,want", [(True, "bf16-mixed"), (False, "32-true")])
def test_cpu_precision_follows_native_bfloat16(native, want, monkeypatch):
    monkeypatch.setattr(precision, "native_bf16_cpu", lambda: native)
    chosen, reason = precision.default_precision("cpu")
    assert chosen == want and ("natively" in reason if native else "emulate" in reason)


def test_cuda_without_a_device_is_float32(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert precision.default_precision("gpu")[0] == "32-true"
    monkeypatch.setattr(precision, "native_bf16_cpu", lambda: True)
    assert precision.default_precision("auto")[0] == "bf16-mixed"  # auto without CUDA: the CPU decides


def test_bad_accelerator_is_named():
    with pytest.raises(ValueError, match="accelerator='tpu'"):
        precision.default_precision("tpu")


@pytest.mark.parametrize("flags,want", [({"avx512f", "avx512_bf16"}, True), ({"amx_bf16"}, True),
                                        ({"avx2", "avx512f"}, False)])
def test_cpu_flags_decide_without_onednns_probe(flags, want, monkeypatch):
    class NoProbe:
        def __getattr__(self, name):
            raise AttributeError(name)

    monkeypatch.setattr(torch.ops, "mkldnn", NoProbe())
    monkeypatch.setattr(precision, "cpu_flags", lambda: flags)
    assert precision.native_bf16_cpu() is want


def test_cpu_flags_are_read_from_cpuinfo():
    if platform.machine() != "x86_64" or not Path("/proc/cpuinfo").exists():
        pytest.skip("reads the flags line of an x86-64 Linux /proc/cpuinfo")
    assert {"fpu", "sse2"} <= precision.cpu_flags()


def test_script_prints_what_run_sh_reads():
    out = subprocess.run([sys.executable, str(ROOT / "recipes" / "asr" / "local" / "dnn" / "precision.py")],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() in ("bf16-mixed", "32-true")
    assert out.stderr.startswith(f"precision {out.stdout.strip()}: ")


def test_train_warns_about_emulated_bfloat16(monkeypatch, caplog):
    import train

    trainer = SimpleNamespace(precision="bf16-mixed", accelerator=CPUAccelerator())
    monkeypatch.setattr(train, "native_bf16_cpu", lambda: False)
    with caplog.at_level(logging.WARNING, logger=train.log.name):
        train.AsrCLI._check_precision(trainer)
    assert "slower than float32" in caplog.text and "32-true" in caplog.text
    caplog.clear()
    monkeypatch.setattr(train, "native_bf16_cpu", lambda: True)
    train.AsrCLI._check_precision(trainer)
    train.AsrCLI._check_precision(SimpleNamespace(precision="32-true", accelerator=CPUAccelerator()))
    assert not caplog.text


def test_run_sh_names_its_precision_and_refuses_others():
    """run.sh picks the precision with precision.py unless told, and refuses a value it does not train with
    (stage=12: past the last stage, none runs)."""
    import os

    env = {**os.environ, "python": sys.executable, "stage": "12"}
    run_sh = ["bash", str(ROOT / "recipes" / "asr" / "run.sh")]
    out = subprocess.run(run_sh, env=env, capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() in ("== DNN training precision: bf16-mixed; profile: default",
                                  "== DNN training precision: 32-true; profile: default")
    bad = subprocess.run(run_sh, env={**env, "precision": "16-mixed"}, capture_output=True, text=True, check=False)
    assert bad.returncode == 2 and "precision=16-mixed: use 32-true or bf16-mixed" in bad.stderr


def test_run_sh_hands_evaluate_args_to_the_decoding_stage(tmp_path):
    """stage=11 decodes every trained run with evaluate.py, adding ``evaluate_args`` (a stand-in python
    records the command line)."""
    import os

    (tmp_path / "exp" / "baseline").mkdir(parents=True)
    (tmp_path / "exp" / "baseline" / "train_summary.json").write_text("{}")
    stub = tmp_path / "python"
    stub.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'calls'}\n")
    stub.chmod(0o755)
    env = {**os.environ, "python": str(stub), "stage": "11", "precision": "32-true", "exp": str(tmp_path / "exp"),
           "evaluate_args": "--rescore-lm 4 --jobs 1"}
    out = subprocess.run(["bash", str(ROOT / "recipes" / "asr" / "run.sh")], env=env, capture_output=True,
                         text=True, check=False, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    call = (tmp_path / "calls").read_text().strip()
    assert call.startswith("recipes/asr/evaluate.py --runs " + str(tmp_path / "exp" / "baseline"))
    assert call.endswith("--skip-decoded --rescore-lm 4 --jobs 1")


def test_run_sh_decodes_with_jemalloc_preloaded_unless_told(tmp_path):
    """stage 11 preloads the jemalloc it is given (found with ldconfig when not given), keeps a preload the
    caller had, says when there is none, and jemalloc=none leaves glibc's malloc (the stand-in python records
    its LD_PRELOAD)."""
    import os

    (tmp_path / "exp" / "baseline").mkdir(parents=True)
    (tmp_path / "exp" / "baseline" / "train_summary.json").write_text("{}")
    stub = tmp_path / "python"
    stub.write_text(f"#!/bin/sh\necho \"[$LD_PRELOAD]\" >> {tmp_path / 'calls'}\n")
    stub.chmod(0o755)
    lib = tmp_path / "libjemalloc.so.2"
    lib.write_bytes(b"")  # the stand-in python loads nothing: any file will do
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env.update(python=str(stub), stage="11", precision="32-true", exp=str(tmp_path / "exp"))
    outs = [subprocess.run(["bash", str(ROOT / "recipes" / "asr" / "run.sh")], env={**env, **extra},
                           capture_output=True, text=True, check=False, cwd=tmp_path)
            for extra in ({"jemalloc": str(lib)}, {"jemalloc": str(lib), "LD_PRELOAD": "/other.so"},
                          {"jemalloc": "none"}, {"jemalloc": str(tmp_path / "missing.so")})]
    assert [o.returncode for o in outs] == [0, 0, 0, 0], [o.stderr for o in outs]
    assert (tmp_path / "calls").read_text().split() == [f"[{lib}]", f"[{lib}:/other.so]", "[]", "[]"]
    assert f"decoding with jemalloc ({lib})" in outs[0].stdout
    assert "glibc's malloc (jemalloc=none)" in outs[2].stdout
    assert "jemalloc not found at" in outs[3].stderr and "apt-get install libjemalloc2" in outs[3].stderr
    # not given: ldconfig's. A stand-in ldconfig names it first in a list longer than a pipe holds, so that a
    # reader that left early would end ldconfig on SIGPIPE (and pipefail the job, as a loaded machine once did)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ldconfig").write_text(
        f"#!/bin/sh\necho '\tlibjemalloc.so.2 (libc6,x86-64) => {lib}'\n"
        "i=0; while [ $i -lt 4000 ]; do echo '\tlibfoo.so.1 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libfoo.so.1'; "
        "i=$((i+1)); done\n")
    (bin_dir / "ldconfig").chmod(0o755)
    found = subprocess.run(["bash", str(ROOT / "recipes" / "asr" / "run.sh")],
                           env={**env, "PATH": f"{bin_dir}:{env['PATH']}"}, capture_output=True, text=True,
                           check=False, cwd=tmp_path)
    assert found.returncode == 0, found.stderr
    assert f"== decoding with jemalloc ({lib})" in found.stdout
    assert (tmp_path / "calls").read_text().split()[-1] == f"[{lib}]"


def test_run_sh_profile_kaldi_asks_every_stage_for_kaldi_s_settings_in_its_own_dirs(tmp_path):
    """profile=kaldi: prepare.py gets LDA+MLLT and the GMM beams, evaluate.py its defaults, and the data and
    runs go to their own dirs (a stand-in python records the command lines); another profile is refused."""
    import os

    stub = tmp_path / "python"
    stub.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'calls'}\n")
    stub.chmod(0o755)
    env = {**os.environ, "python": str(stub), "precision": "32-true", "profile": "kaldi",
           "prepare_args": "--num-jobs 1"}
    out = subprocess.run(["bash", str(ROOT / "recipes" / "asr" / "run.sh")], env={**env, "stop_stage": "10"},
                         capture_output=True, text=True, check=False, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    # stage 11 on a run the stand-in did not train (run.sh works from the repository's root: exp given in full)
    runs = tmp_path / "exp" / "dnn-kaldi"
    (runs / "baseline").mkdir(parents=True)
    (runs / "baseline" / "train_summary.json").write_text("{}")
    out = subprocess.run(["bash", str(ROOT / "recipes" / "asr" / "run.sh")], env={**env, "stage": "11", "exp": str(runs)},
                         capture_output=True, text=True, check=False, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    prep, base, gtc, evaluate = (tmp_path / "calls").read_text().strip().splitlines()
    assert prep.startswith("recipes/asr/prepare.py --data-dir data/synthetic-default-kaldi --stage 0 --stop-stage 8")
    assert prep.endswith("--lda-mllt --beam 13 --max-active 7000 --num-jobs 1")
    assert all("--data.data_dir data/synthetic-default-kaldi --exp_dir exp/dnn-kaldi " in c for c in (base, gtc))
    assert evaluate.startswith(f"recipes/asr/evaluate.py --runs {runs / 'baseline'} --out {runs / 'compare'}")
    assert evaluate.endswith("--skip-decoded")  # the DNN lattices' default beam is Kaldi's 13
    bad = subprocess.run(["bash", str(ROOT / "recipes" / "asr" / "run.sh")], env={**env, "profile": "fast"},
                         capture_output=True, text=True, check=False, cwd=tmp_path)
    assert bad.returncode == 2 and "profile=fast: use default or kaldi" in bad.stderr


def test_run_sh_decodes_every_seed_found_and_keeps_each_corpus_s_runs_apart(tmp_path):
    """stage=11 compares the runs of every seed trained (seed 0 in exp/, seed N in exp/seedN/, N in numeric
    order), stops with the fix when there is none, and a real corpus's runs live in exp/dnn-<corpus>."""
    import os

    stub = tmp_path / "python"
    stub.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'calls'}\n")
    stub.chmod(0o755)
    exp = tmp_path / "exp"  # (run.sh works from the repository's root: exp given in full)
    runs = [str(exp / r) for r in ("baseline", "gtc", "seed1/gtc", "seed3/baseline", "seed10/baseline")]
    for run in runs:
        Path(run).mkdir(parents=True)
        (Path(run) / "train_summary.json").write_text("{}")
    (exp / "seed2").mkdir()  # a seed dir with no finished run
    env = {**os.environ, "python": str(stub), "precision": "32-true", "stage": "11"}
    run_sh = ["bash", str(ROOT / "recipes" / "asr" / "run.sh")]
    out = subprocess.run(run_sh, env={**env, "exp": str(exp)}, capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "calls").read_text().startswith(f"recipes/asr/evaluate.py --runs {' '.join(runs)} --out {exp}/compare")
    none = subprocess.run(run_sh, env={**env, "corpus": "yesno"}, capture_output=True, text=True, check=False)
    assert none.returncode == 2 and "no trained run under exp/dnn-yesno" in none.stderr
