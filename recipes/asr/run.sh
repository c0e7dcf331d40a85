#!/usr/bin/env bash
# The main job, Kaldi run.sh style: embedded TTS corpus -> features, lang, GMM-HMM (mono, tri,
# SAT), fMLLR alignments, fbank speaker transforms -> DNN baseline (1 worker) and GTC (2 workers)
# -> HCLG decoding -> comparison table (WERs with 95 % intervals) and plot.
#
#   bash recipes/asr/run.sh                        # everything, data stages skipped once done
#   stage=1 bash recipes/asr/run.sh                # from the baseline training on
#   seeds="1 2" stage=1 bash recipes/asr/run.sh    # two more seeds, then the comparison over all
#   data=data/mini_librispeech bash recipes/asr/run.sh   # after prepare.py --corpus ... (see README)
#   test_sweep=1 stage=3 bash recipes/asr/run.sh   # also test at every acoustic scale (fixed-scale tables)
#   precision=32-true bash recipes/asr/run.sh      # train in float32 (default: bf16-mixed where the
#                                                  # device computes bfloat16 natively, local/dnn/precision.py)
#
# Seed 0 goes to $exp/{baseline,gtc}, seed N > 0 to $exp/seedN/{baseline,gtc}; stage 3 decodes
# the runs not decoded yet (dev at each acoustic scale, test at the one dev picks; with test_sweep=1
# also test at each scale, for the comparison's fixed-scale tables) and compares every run found for
# seeds 0 1 2. Each stage prints its wall and
# CPU time (bash `time`; on a shared machine user + sys is what the stage takes alone).
set -euo pipefail
cd "$(dirname "$0")/../.."

python=${python:-.venv/bin/python}
data=${data:-data/synthetic-default}
exp=${exp:-exp/dnn}
stage=${stage:-0}
seeds=${seeds:-0}
test_sweep=${test_sweep:-0}
case "$test_sweep" in 0|1) ;; *) echo "run.sh: test_sweep=$test_sweep: use test_sweep=1 (test at every scale) or 0" >&2; exit 2 ;; esac
precision=${precision:-$($python recipes/asr/local/dnn/precision.py)}
case "$precision" in 32-true|bf16-mixed) ;; *) echo "run.sh: precision=$precision: use 32-true or bf16-mixed" >&2; exit 2 ;; esac
echo "== DNN training precision: $precision"

run_dir() { if [ "$1" = 0 ]; then echo "$exp"; else echo "$exp/seed$1"; fi; }

if [ "$stage" -le 0 ]; then
  echo "== stage 0: data pipeline (corpus, features, lang, GMM-HMM, alignments, adaptation) -> $data"
  time $python recipes/asr/prepare.py --data-dir "$data"
fi
for seed in $seeds; do
  dir=$(run_dir "$seed")
  if [ "$stage" -le 1 ]; then
    echo "== stage 1: single-device baseline, seed $seed (global batch of the 2-worker runs) -> $dir/baseline"
    time $python recipes/asr/train.py --config conf/baseline.yaml --data.data_dir "$data" --exp_dir "$dir" \
      --seed_everything "$seed" --data.seed "$seed" --trainer.precision "$precision"
  fi
  if [ "$stage" -le 2 ]; then
    echo "== stage 2: GTC, 2 workers, seed $seed -> $dir/gtc"
    time $python recipes/asr/train.py --strategy gtc --data.data_dir "$data" --exp_dir "$dir" --run_name gtc \
      --seed_everything "$seed" --data.seed "$seed" --trainer.precision "$precision"
  fi
done
if [ "$stage" -le 3 ]; then
  runs=()
  for seed in 0 1 2; do
    for name in baseline gtc; do
      [ -f "$(run_dir "$seed")/$name/train_summary.json" ] && runs+=("$(run_dir "$seed")/$name")
    done
  done
  echo "== stage 3: decode dev/test, compare ${#runs[@]} runs -> $exp/compare"
  sweep=""; [ "$test_sweep" = 1 ] && sweep=--test-sweep  # test also at every scale: fixed-scale tables
  time $python recipes/asr/evaluate.py --runs "${runs[@]}" --out "$exp/compare" --skip-decoded $sweep
fi
