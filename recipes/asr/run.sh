#!/usr/bin/env bash
# The main job, Kaldi run.sh style: embedded TTS corpus -> features, lang, GMM-HMM alignments ->
# DNN baseline (1 worker) and GTC (2 workers) -> HCLG decoding -> comparison table and plot.
#
#   bash recipes/asr/run.sh                        # everything, skipping what is already done
#   stage=2 bash recipes/asr/run.sh                # from the GTC training on
#   data=data/mini_librispeech bash recipes/asr/run.sh   # after prepare.py --corpus ... (see README)
set -euo pipefail
cd "$(dirname "$0")/../.."

python=${python:-.venv/bin/python}
data=${data:-data/synthetic-default}
exp=${exp:-exp/dnn}
stage=${stage:-0}

if [ "$stage" -le 0 ]; then
  echo "== stage 0: data pipeline (corpus, features, lang, GMM-HMM, alignments) -> $data"
  $python recipes/asr/prepare.py --data-dir "$data"
fi
if [ "$stage" -le 1 ]; then
  echo "== stage 1: single-device baseline (global batch of the 2-worker runs) -> $exp/baseline"
  $python recipes/asr/train.py --config conf/baseline.yaml --data.data_dir "$data" --exp_dir "$exp"
fi
if [ "$stage" -le 2 ]; then
  echo "== stage 2: GTC, 2 workers -> $exp/gtc"
  $python recipes/asr/train.py --strategy gtc --data.data_dir "$data" --exp_dir "$exp" --run_name gtc
fi
if [ "$stage" -le 3 ]; then
  echo "== stage 3: decode dev/test, compare -> $exp/compare"
  $python recipes/asr/evaluate.py --runs "$exp/baseline" "$exp/gtc" --out "$exp/compare"
fi
