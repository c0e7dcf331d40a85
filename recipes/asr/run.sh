#!/usr/bin/env bash
# The main job, Kaldi run.sh style: embedded TTS corpus -> features, lang, GMM-HMM (mono, tri,
# SAT), fMLLR alignments, fbank speaker transforms -> DNN baseline (1 worker) and GTC (2 workers)
# -> HCLG decoding -> comparison table (WERs with 95 % intervals) and plot.
#
# One stage numbering for the whole recipe (stage=N: start there; stop_stage=M: stop after M):
#   0-8  data, prepare.py's own stages (0 corpus, 1 features, 2 lang, 3 mono, 4 tri, 5 sat, 6 align,
#        7 adapt, 8 report; each skipped once done)
#   9    single-device DNN baseline
#   10   GTC, 2 workers
#   11   decode dev/test, compare
#
#   bash recipes/asr/run.sh                        # everything, data stages skipped once done
#   stage=9 bash recipes/asr/run.sh                # from the baseline training on
#   seeds="1 2" stage=9 bash recipes/asr/run.sh    # two more seeds, then the comparison over all
#   stage=9 stop_stage=10 bash recipes/asr/run.sh  # train only (baseline and GTC), no decoding
#   corpus=mini_librispeech corpus_dir=/path/to/LibriSpeech bash recipes/asr/run.sh   # a real corpus -> data/mini_librispeech,
#                                                  # exp/dnn-mini_librispeech
#   corpus=kaldi corpus_dir=/path/to/kaldi_data prepare_args="--lexicon lexicon.txt --oov g2p" bash recipes/asr/run.sh
#                                                  # corpus: synthetic (default), mini_librispeech, librispeech, timit,
#                                                  # yesno, kaldi; prepare_args: more prepare.py options (--train-parts,
#                                                  # --lexicon, --lm-text, --oov, --num-jobs, --no-lda-mllt, --sat-schedule recipe)
#   test_sweep=1 stage=11 bash recipes/asr/run.sh  # also test at every acoustic scale (fixed-scale tables)
#   evaluate_args="--rescore-lm 4" stage=11 bash recipes/asr/run.sh
#                                                  # more evaluate.py options (here: lattices rescored with a 4-gram)
#   jemalloc=none stage=11 bash recipes/asr/run.sh # decode with glibc's malloc (default: jemalloc where installed)
#   precision=32-true bash recipes/asr/run.sh      # train in float32 (default: bf16-mixed where the
#                                                  # device computes bfloat16 natively, local/dnn/precision.py)
#   profile=kaldi bash recipes/asr/run.sh          # Kaldi's settings where the default departs from them for time:
#                                                  # GMM decodings at beam 13 with 7,000 active states
#                                                  # (prepare_args="--lda-mllt --beam 13 --max-active 7000"; LDA+MLLT
#                                                  # before SAT and the DNN lattices at Kaldi's beam 13 are in the
#                                                  # default too); data in <data>-kaldi, runs in exp/dnn-kaldi; 34 min
#                                                  # 40 s from a fresh clone (the default: 27 min 51 s), the DNNs
#                                                  # level (RESULTS.md)
#
# Seed 0 goes to $exp/{baseline,gtc}, seed N > 0 to $exp/seedN/{baseline,gtc}; stage 11 decodes
# the runs not decoded yet (dev at each acoustic scale, test at the one dev picks; with test_sweep=1
# also test at each scale, for the comparison's fixed-scale tables) and compares every run found, of
# every seed. A corpus other than the synthetic one keeps its runs in exp/dnn-<corpus>. Each stage prints its wall and
# CPU time (bash `time`; on a shared machine user + sys is what the stage takes alone).
set -euo pipefail
cd "$(dirname "$0")/../.."

python=${python:-.venv/bin/python}
corpus=${corpus:-synthetic}
corpus_dir=${corpus_dir:-}
prepare_args=${prepare_args:-}
evaluate_args=${evaluate_args:-}
profile=${profile:-default}
case "$profile" in
  default) suffix="" ;;
  kaldi) suffix=-kaldi; prepare_args="--lda-mllt --beam 13 --max-active 7000 $prepare_args" ;;
  *) echo "run.sh: profile=$profile: use default or kaldi (Kaldi's GMM decoding beams)" >&2; exit 2 ;;
esac
case "$corpus" in
  synthetic) data=${data:-data/synthetic-default$suffix}; corpus_args=() ;;
  mini_librispeech|librispeech|timit|yesno|kaldi)
    data=${data:-data/$corpus$suffix}
    if [ "${stage:-0}" -le 0 ] && [ -z "$corpus_dir" ]; then
      echo "run.sh: corpus=$corpus needs corpus_dir=/path/to/it (this recipe downloads nothing)" >&2; exit 2
    fi
    corpus_args=(--corpus "$corpus"); [ -n "$corpus_dir" ] && corpus_args+=(--corpus-dir "$corpus_dir") ;;
  *) echo "run.sh: corpus=$corpus: use synthetic, mini_librispeech, librispeech, timit, yesno or kaldi" >&2; exit 2 ;;
esac
# the DNN runs of each corpus in their own dir (the synthetic corpus's in exp/dnn, as always)
if [ "$corpus" = synthetic ]; then exp=${exp:-exp/dnn$suffix}; else exp=${exp:-exp/dnn-$corpus$suffix}; fi
stage=${stage:-0}
stop_stage=${stop_stage:-11}
seeds=${seeds:-0}
test_sweep=${test_sweep:-0}
case "$test_sweep" in 0|1) ;; *) echo "run.sh: test_sweep=$test_sweep: use test_sweep=1 (test at every scale) or 0" >&2; exit 2 ;; esac
precision=${precision:-$($python recipes/asr/local/dnn/precision.py)}
case "$precision" in 32-true|bf16-mixed) ;; *) echo "run.sh: precision=$precision: use 32-true or bf16-mixed" >&2; exit 2 ;; esac
echo "== DNN training precision: $precision; profile: $profile"

run_dir() { if [ "$1" = 0 ]; then echo "$exp"; else echo "$exp/seed$1"; fi; }

case "$stage$stop_stage" in *[!0-9]*) echo "run.sh: stage=$stage stop_stage=$stop_stage: use numbers 0-11" >&2; exit 2 ;; esac
run() { [ "$stage" -le "$1" ] && [ "$1" -le "$stop_stage" ]; }  # is stage $1 selected?

if [ "$stage" -le 8 ] && [ "$stop_stage" -ge 0 ]; then
  last=$(( stop_stage < 8 ? stop_stage : 8 ))
  echo "== stages $stage-$last: data pipeline (corpus, features, lang, GMM-HMM, alignments, adaptation) -> $data"
  # shellcheck disable=SC2086  # prepare_args: several options, split on spaces
  time $python recipes/asr/prepare.py --data-dir "$data" --stage "$stage" --stop-stage "$last" "${corpus_args[@]}" $prepare_args
fi
for seed in $seeds; do
  dir=$(run_dir "$seed")
  if run 9; then
    echo "== stage 9: single-device baseline, seed $seed (global batch of the 2-worker runs) -> $dir/baseline"
    time $python recipes/asr/train.py --config conf/baseline.yaml --data.data_dir "$data" --exp_dir "$dir" \
      --seed_everything "$seed" --data.seed "$seed" --trainer.precision "$precision"
  fi
  if run 10; then
    echo "== stage 10: GTC, 2 workers, seed $seed -> $dir/gtc"
    time $python recipes/asr/train.py --strategy gtc --data.data_dir "$data" --exp_dir "$dir" --run_name gtc \
      --seed_everything "$seed" --data.seed "$seed" --trainer.precision "$precision"
  fi
done
if run 11; then
  runs=()  # every seed trained so far: $exp/{baseline,gtc} and $exp/seedN/{baseline,gtc}, N ascending
  found=$(find "$exp" -maxdepth 1 -type d -name 'seed[0-9]*' 2>/dev/null | sed 's/.*seed//' | grep -E '^[0-9]+$' | sort -n || true)
  for seed in 0 $found; do
    for name in baseline gtc; do
      [ -f "$(run_dir "$seed")/$name/train_summary.json" ] && runs+=("$(run_dir "$seed")/$name")
    done
  done
  if [ "${#runs[@]}" = 0 ]; then
    echo "run.sh: stage 11: no trained run under $exp (train with stages 9-10 first, or point exp= at the runs)" >&2; exit 2
  fi
  echo "== stage 11: decode dev/test, compare ${#runs[@]} runs -> $exp/compare"
  sweep=""; [ "$test_sweep" = 1 ] && sweep=--test-sweep  # test also at every scale: fixed-scale tables
  # The lattice decoder spends about a third of its time in malloc and free: with jemalloc preloaded the decoding
  # stage takes 0.68 times as long (paired, two runs at beam 13), with the same lattices
  # (docs/experiments/dnn_epochs_beams.md). jemalloc=none: glibc's.
  # (awk reads ldconfig's whole list: leaving early would end ldconfig on SIGPIPE, and pipefail the job)
  jemalloc=${jemalloc:-$(ldconfig -p 2>/dev/null | awk '/libjemalloc\.so\.2 / && !p {p = $NF} END {print p}')}
  preload=${LD_PRELOAD:-}
  if [ "$jemalloc" = none ]; then
    echo "== decoding with glibc's malloc (jemalloc=none)"
  elif [ -n "$jemalloc" ] && [ -f "$jemalloc" ]; then
    echo "== decoding with jemalloc ($jemalloc)"; preload=$jemalloc${preload:+:$preload}
  else
    echo "== jemalloc not found${jemalloc:+ at $jemalloc}: decoding with glibc's malloc, about 1.5 times as long" \
      "(apt-get install libjemalloc2, or run setup.sh)" >&2
  fi
  # shellcheck disable=SC2086  # evaluate_args: several options, split on spaces
  time LD_PRELOAD=$preload $python recipes/asr/evaluate.py --runs "${runs[@]}" --out "$exp/compare" --skip-decoded \
    $sweep $evaluate_args
fi
