#!/usr/bin/env bash
# Speculative decoding's benchmark on one CUDA GPU, in one run of at most 9 minutes: trains the
# bench pair (photon-bench + photon-bench-draft) and runs `photon bench spec` on it and on the
# committed pair (photon/assets/photon-tiny + photon-tiny-draft), prompts of held-out code.
#
# Usage: tools/bench_spec_h200.sh OUT [DATA]
#   OUT   where everything goes: env.json, bench.log (tools/gpu_bench.sh's env step),
#         bench_spec.log (every command and its output, with the time it started),
#         bench/ (the trained pair and agreement.json), spec_bench_pair.json, spec_tiny_pair.json
#   DATA  a `python -m photon.train prepare` directory (default: OUT/data, prepared when missing)
#
# Settings (environment variables, defaults in brackets):
#   TARGET_SECONDS [100], DRAFT_SECONDS [40]   training budget of each bench model
#   EVAL_INTERVAL [50]                         keep each model's best-evaluated weights (0: last)
#   OUTPUT_LEN [128], INPUT_LEN [128]          tokens per request of every cell
#   OUTPUT_LEN_RANGE_RATIO [0]                 output lengths drawn from OUTPUT_LEN x [1 - R, 1 + R]
#   REQUESTS_PER_SLOT [4]                      each cell runs N x B requests, B at a time
#   MIN_REQUESTS [16]                          ... and at least this many
#   BATCH_SIZES ["1 4 16 64 256"]
#   PROMPT_LOOKUP_MIN, PROMPT_LOOKUP_MAX [unset] the ngram cells' lookup (unset: the engine's, 5)
#   BUDGET_SECONDS [530]                       the whole run; each stage gets what is left
#   BENCH_PAIR [unset]                         a directory holding photon-bench and
#                                              photon-bench-draft: skip the training
#   MATRIX [full]                              adaptive: only the adaptive switch (K = 5) and
#                                              the control on both pairs, B = 16 64 256 unless
#                                              BATCH_SIZES says otherwise, each cell timed
#                                              REPEATS [5] times (its speedup: the median round);
#                                              spec_{bench,tiny}_pair_adaptive.json
#
# The matrix: the bench pair with K = 1..5 (adaptive switch off) for ngram and draft_model, and
# K = 5 with the switch on (it picks K_eff <= 5 per step); the committed pair with K = 1, 3, 5 off
# and 5 on, and a second no-speculation engine (`--control`: the paired method's own noise).
# Each engine is built once and reused for every batch size (see photon/bench/spec.py).
#
# Time on an H200: `bench spec` (paired: each speculative cell also times the no-speculation
# engine twice) took 303 s for the bench pair and 143 s for the committed pair with 4 requests at
# B = 1 and 4 (with 16, the default since --min-requests, the bench pair took about 370 s and the
# committed pair did not finish in the 125 s left of a 500 s budget); training takes its budgets
# plus ~40 s of
# start-up, evaluation and agreement, and prepare ~40 s (tokenizer training and encoding of the
# standard library). With the default budgets the whole run needs
# more than one 10-minute slot: train first (BENCH_PAIR) or lower the budgets. A stage that
# runs past the budget is stopped; the JSON of the finished stages stays (the bench pair first).
set -uo pipefail

[ $# -ge 1 ] || { sed -n '2,28p' "$0"; exit 2; }
out="$1"
data="${2:-$out/data}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
log="$out/bench_spec.log"
export PYTHONUNBUFFERED=1
deadline=$(( $(date +%s) + ${BUDGET_SECONDS:-530} ))
status=0

run() {  # run CMD...: log it, run it within the time left, remember a failure
  local left=$(( deadline - $(date +%s) ))
  echo "[$(date -u +%H:%M:%S), ${left} s left] \$ $*" | tee -a "$log"
  if [ "$left" -le 0 ]; then echo "skipped: no time left" | tee -a "$log"; status=1; return; fi
  timeout "$left" "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || { echo "exit status $rc" | tee -a "$log"; status=1; }
}

spec() {  # spec NAME ARGS...: photon bench spec on prompts of held-out code
  local name="$1"
  shift
  run python3 -m photon.cli bench spec --data "$data" --input-len "${INPUT_LEN:-128}" \
    --output-len "${OUTPUT_LEN:-128}" --output-len-range-ratio "${OUTPUT_LEN_RANGE_RATIO:-0}" \
    --requests-per-slot "${REQUESTS_PER_SLOT:-4}" --min-requests "${MIN_REQUESTS:-16}" \
    --batch-sizes ${BATCH_SIZES:-1 4 16 64 256} \
    ${PROMPT_LOOKUP_MIN:+--prompt-lookup-min "$PROMPT_LOOKUP_MIN"} \
    ${PROMPT_LOOKUP_MAX:+--prompt-lookup-max "$PROMPT_LOOKUP_MAX"} \
    --output-json "$out/spec_$name.json" "$@"
}

tools/gpu_bench.sh "$out" env >/dev/null
[ -f "$data/manifest.json" ] || run python3 -m photon.train prepare --out "$data"
pair="${BENCH_PAIR:-$out/bench}"
[ -n "${BENCH_PAIR:-}" ] || run python3 -m photon.train all --pair bench --data "$data" \
  --out "$pair" --target-seconds "${TARGET_SECONDS:-100}" --draft-seconds "${DRAFT_SECONDS:-40}" \
  --eval-interval "${EVAL_INTERVAL:-50}"
if [ "${MATRIX:-full}" = adaptive ]; then
  BATCH_SIZES="${BATCH_SIZES:-16 64 256}"
  for name in bench_pair tiny_pair; do
    if [ "$name" = bench_pair ]; then models=("$pair/photon-bench" "$pair/photon-bench-draft")
    else models=(photon/assets/photon-tiny photon/assets/photon-tiny-draft); fi
    spec "${name}_adaptive" --model "${models[0]}" --draft "${models[1]}" \
      --num-speculative-tokens --adaptive-num-speculative-tokens 5 --control \
      --repeats "${REPEATS:-5}"
  done
else
  spec bench_pair --model "$pair/photon-bench" --draft "$pair/photon-bench-draft" \
    --num-speculative-tokens 1 2 3 4 5 --adaptive-num-speculative-tokens 5
  spec tiny_pair --model photon/assets/photon-tiny --draft photon/assets/photon-tiny-draft \
    --num-speculative-tokens 1 3 5 --adaptive-num-speculative-tokens 5 --control
fi
echo "[$(date -u +%H:%M:%S)] done, exit status $status; results in $out" | tee -a "$log"
exit "$status"
