#!/usr/bin/env bash
# photon's standard GPU benchmark set, on any machine with one CUDA GPU.
#
# Usage: tools/gpu_bench.sh [OUTPUT_DIR] [STEP...]
#   OUTPUT_DIR  where the JSON results and bench.log go (default: ./bench-results)
#   STEP        one or more of the steps below (default: env tests throughput bubble structured)
#
# Steps and the files they write (the tables of docs/benchmarks.md are made from them):
#   env         env.json: date, git commit, GPU, driver, Python, torch and triton versions
#   tests       the `gpu`-marked tests (pytest's summary goes to bench.log)
#   throughput  the standard offline workload, pipelined and blocking (--no-pipelined), on the
#               qwen3-0.6b and llama-3.1-8b shapes: throughput_SHAPE_{pipelined,blocking}.json
#   bubble      per-step GPU / host / wall time, pipelined vs blocking: bubble_qwen3-0.6b.json
#   structured  JSON-schema decode vs the same batch unconstrained, schemas records and
#               records-no-ranges: structured_qwen3-0.6b_SCHEMA.json
#   profile     GPU time of a decode step by kernel class (B=256, 1,024-token contexts):
#               profile_qwen3-0.6b_b256_ctx1024.json; decode and mixed steps (two 128-token
#               refills a step) at 128-token contexts with their host time (--host-profile):
#               profile_host_qwen3-0.6b_b256_r{0,2}.json (not in the default set)
#   serve       `photon serve` + `photon bench serve` on loopback, pipelined and blocking servers:
#               serve/pipelined.json, serve/no-pipelined.json, serve/frontier.png (not in the
#               default set; needs the server's and the client's packages)
#   quant       quantization schemes on random-weight checkpoints of qwen3-0.6b and llama-3.1-8b
#               (written first, then `photon quantize` for the compressed-tensors ones): bf16,
#               --quantization fp8, fp8 + --kv-cache-dtype fp8, w8a8-int8, w4a16; the offline
#               workload's throughput and peak GPU memory: throughput_SHAPE_SCHEME.json, and
#               `photon bench quality` of each scheme against bf16 on qwen3-0.6b:
#               quality_SCHEME.json (not in the default set; needs ~40 GB of disk)
#   lora        the offline workload with 0, 1, 8 and 32 synthetic LoRA adapters (--max-loras =
#               adapters) and a slot-churn run (500 adapters on qwen3-0.6b, 64 on llama-3.1-8b,
#               drawn Zipf-distributed, --max-loras 16): lora_SHAPE_N.json (not in the default set)
#   moe         the MoE shape qwen3-30b-a3b (fused MoE Triton kernel) on one GPU, offline
#               workload, against its roofline: throughput_qwen3-30b-a3b.json (not in the default
#               set)
# Two-GPU steps (skipped, with a message, when fewer than 2 GPUs are visible; not in the default
# set):
#   parallel    offline throughput at -tp 1 and -tp 2 on qwen3-0.6b and llama-3.1-8b:
#               parallel/throughput_SHAPE_tpN.json; the MoE shape qwen3-30b-a3b at -tp 2, -tp 2
#               --enable-expert-parallel (offline: parallel/throughput_qwen3-30b-a3b_*.json) and
#               served at those two and -dp 2 --enable-expert-parallel (`photon bench serve`
#               sweep: parallel/serve/{tp2,tp2-ep,dp2-ep}.json)
#   router      tools/bench_router.py, two qwen3-0.6b replicas (GPU 0 and GPU 1) with a KV cache
#               too small to hold every conversation: router/{POLICY,reference}.json, table.md
#   pd          prefill-heavy serving (2,048-token prompts, 32-token outputs): a prefill instance
#               on GPU 0 and a decode instance on GPU 1 (SharedMemoryConnector) behind `photon
#               proxy`, against two aggregated instances behind `photon router --policy
#               round_robin`, qwen3-0.6b: pd/{disaggregated,aggregated}.json
#
# SHAPES (environment) narrows the model shapes of the throughput, quant and lora steps (default:
# "qwen3-0.6b llama-3.1-8b"), e.g. SHAPES=qwen3-0.6b tools/gpu_bench.sh OUT quant lora.
# Run it from the repository root with photon installed (pip install -e ".[test]"). The built-in
# shapes have random weights and a byte-level BPE tokenizer trained at first use, so nothing is
# downloaded. The llama-3.1-8b shape needs room for its 16 GB of bf16 weights plus a KV cache.
# `structured` and the structured-outputs GPU tests need xgrammar (the tests also jsonschema).
# Example: tools/gpu_bench.sh results/h200 env throughput
# Two GPUs: tools/gpu_bench.sh results/h200x2 env parallel router pd
set -uo pipefail

out="${1:-bench-results}"
[ $# -gt 0 ] && shift
steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(env tests throughput bubble structured)
export PYTHONUNBUFFERED=1
photon=(python3 -m photon.cli)
read -r -a shapes <<< "${SHAPES:-qwen3-0.6b llama-3.1-8b}"
status=0

run() {  # run CMD...: echo the command into the log, run it, remember a failure
  echo "\$ $*" | tee -a "$log"
  "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || { echo "exit status $rc" | tee -a "$log"; status=1; }
}

step_env() {
  python3 - "$out/env.json" <<'EOF' 2>&1 | tee -a "$log"
import datetime, json, platform, subprocess, sys
import torch
def sh(*cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
try:
    import triton
    triton_version = triton.__version__
except ImportError:
    triton_version = None
smi = sh("nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader")
env = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
       "commit": sh("git", "rev-parse", "HEAD"),
       "uncommitted_changes": bool(sh("git", "status", "--porcelain")),
       "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
       "nvidia_smi": smi, "python": platform.python_version(), "torch": torch.__version__,
       "triton": triton_version, "cpu_count": __import__("os").cpu_count()}
with open(sys.argv[1], "w", encoding="utf-8") as f:
    json.dump(env, f, indent=1)
print(json.dumps(env))
EOF
}

step_tests() {
  run python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu tests/test_kernels.py \
    tests/test_sampler.py tests/test_triton_attention.py tests/test_spec_kernel.py \
    tests/test_spec_ngram_kernel.py tests/test_spec_step_kernels.py
}

step_throughput() {
  for shape in "${shapes[@]}"; do
    run "${photon[@]}" bench throughput --model-shape "$shape" \
      --output-json "$out/throughput_${shape}_pipelined.json"
    run "${photon[@]}" bench throughput --model-shape "$shape" --no-pipelined \
      --output-json "$out/throughput_${shape}_blocking.json"
  done
}

step_bubble() {
  run "${photon[@]}" bench bubble --model-shape qwen3-0.6b \
    --output-json "$out/bubble_qwen3-0.6b.json"
}

step_structured() {
  for schema in records records-no-ranges; do
    run "${photon[@]}" bench structured --model-shape qwen3-0.6b --batch-sizes 32 128 \
      --schema "$schema" --output-json "$out/structured_qwen3-0.6b_$schema.json"
  done
}

step_profile() {  # `bench profile` prints its JSON summary as the last line of stdout
  run "${photon[@]}" bench profile --model-shape qwen3-0.6b --batch-size 256 --prompt-len 1024
  grep '^{"benchmark": "profile"' "$log" | tail -1 > "$out/profile_qwen3-0.6b_b256_ctx1024.json"
  for r in 0 2; do
    run "${photon[@]}" bench profile --model-shape qwen3-0.6b --batch-size 256 --prompt-len 128 \
      --steps 16 --warmup-steps 8 --refills-per-step "$r" --host-profile
    grep '^{"benchmark": "profile"' "$log" | tail -1 > "$out/profile_host_qwen3-0.6b_b256_r$r.json"
  done
}

free_port() {
  python3 -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"
}

step_serve() {
  local dir model port pid
  dir=$(mktemp -d)
  model=$(python3 -c "from photon.bench.shapes import materialize_shape as m; print(m('qwen3-0.6b', '$dir'))")
  for mode in pipelined no-pipelined; do
    port=$(free_port)
    "${photon[@]}" serve --model "$model" --load-format dummy --dtype bfloat16 \
      --max-model-len 2048 --port "$port" "--$mode" > "$out/serve_$mode.log" 2>&1 &
    pid=$!
    run "${photon[@]}" bench serve --base-url "http://127.0.0.1:$port" --wait-server 300 \
      --random-input-len 512 --random-output-len 128 --num-prompts 64 --warmup-requests 32 \
      --sweep-concurrency 4 16 64 --label "$mode" --output-dir "$out/serve"
    kill "$pid"; wait "$pid"
  done
  run "${photon[@]}" bench serve --plot-from "$out/serve/pipelined.json" \
    "$out/serve/no-pipelined.json" --plot-output "$out/serve/frontier.png"
  rm -rf "$dir"
}

# ---- quantization, LoRA ---------------------------------------------------------------------

random_checkpoint() {  # random_checkpoint SHAPE DIR: a random bf16 checkpoint of SHAPE; its path
  python3 -c "from photon.bench.shape_weights import write_random_checkpoint as w; print(w('$1', '$2'))"
}

quality() {  # quality SCHEME ARGS...: `photon bench quality` of ARGS into quality_SCHEME.json
  local scheme=$1; shift
  run "${photon[@]}" bench quality "$@" --output-json "$out/quality_$scheme.json"
}

step_quant() {
  local dir shape base scheme
  for shape in "${shapes[@]}"; do
    dir=$(mktemp -d)
    echo "writing a random checkpoint of $shape" | tee -a "$log"
    if ! base=$(random_checkpoint "$shape" "$dir"); then
      echo "quant: no checkpoint of $shape" | tee -a "$log"; status=1; continue
    fi
    run "${photon[@]}" bench throughput --model "$base" \
      --output-json "$out/throughput_${shape}_bf16.json"
    run "${photon[@]}" bench throughput --model "$base" --quantization fp8 \
      --output-json "$out/throughput_${shape}_fp8.json"
    run "${photon[@]}" bench throughput --model "$base" --quantization fp8 \
      --kv-cache-dtype fp8 --calculate-kv-scales \
      --output-json "$out/throughput_${shape}_fp8-kv-fp8.json"
    for scheme in w8a8-int8 w4a16; do
      run "${photon[@]}" quantize --model "$base" --scheme "$scheme" --out "$base-$scheme"
      run "${photon[@]}" bench throughput --model "$base-$scheme" \
        --output-json "$out/throughput_${shape}_$scheme.json"
    done
    if [ "$shape" = qwen3-0.6b ]; then
      quality fp8 --model "$base" --quantization fp8
      quality fp8-kv-fp8 --model "$base" --quantization fp8 --kv-cache-dtype fp8 \
        --calculate-kv-scales
      quality w8a8-int8 --model "$base-w8a8-int8" --reference-model "$base"
      quality w4a16 --model "$base-w4a16" --reference-model "$base"
    fi
    rm -rf "$dir"
  done
}

step_lora() {  # N adapters in N slots, then adapters taking turns in 16 slots
  local shape n churn
  for shape in "${shapes[@]}"; do
    run "${photon[@]}" bench throughput --model-shape "$shape" \
      --output-json "$out/lora_${shape}_0.json"
    for n in 1 8 32; do
      run "${photon[@]}" bench throughput --model-shape "$shape" --num-lora-adapters "$n" \
        --max-loras "$n" --output-json "$out/lora_${shape}_$n.json"
    done
    churn=500  # the larger shape's adapters are ~90 MB each on disk: 64 of them
    [ "$shape" = llama-3.1-8b ] && churn=64
    run "${photon[@]}" bench throughput --model-shape "$shape" --num-lora-adapters "$churn" \
      --lora-assignment zipf --max-loras 16 --output-json "$out/lora_${shape}_$churn.json"
  done
}

step_moe() {
  run "${photon[@]}" bench throughput --model-shape qwen3-30b-a3b \
    --output-json "$out/throughput_qwen3-30b-a3b.json"
}

# ---- two GPUs -------------------------------------------------------------------------------

num_gpus=""
two_gpus() {  # two_gpus STEP: whether 2 GPUs are visible (else say that STEP is skipped)
  [ -n "$num_gpus" ] ||
    num_gpus=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
  [ "$num_gpus" -ge 2 ] && return 0
  echo "$1: skipped: needs 2 GPUs, $num_gpus visible" | tee -a "$log"
  return 1
}

servers=()
start_server() {  # start_server GPUS LOG ARGS...: `photon serve ARGS` in the background
  local gpus=$1 logfile=$2; shift 2
  CUDA_VISIBLE_DEVICES=$gpus "${photon[@]}" serve "$@" > "$logfile" 2>&1 &
  servers+=($!)
}

stop_servers() {  # stop every process start_server (or a front end) started, and reap it
  local pid
  for pid in "${servers[@]}"; do kill "$pid" 2>/dev/null; done
  for pid in "${servers[@]}"; do wait "$pid" 2>/dev/null; done
  servers=()
}

wait_healthy() {  # wait_healthy URL...: until each GET URL/health answers 200 (at most 600 s)
  python3 - "$@" <<'EOF' 2>&1 | tee -a "$log"
import sys, time, urllib.request
deadline = time.monotonic() + 600
for url in sys.argv[1:]:
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if time.monotonic() > deadline:
            sys.exit(f"{url} not healthy after 600 s")
        time.sleep(2)
EOF
}

serve_sweep() {  # serve_sweep URL LABEL DIR ARGS...: a `photon bench serve` sweep into DIR
  local url=$1 label=$2 dir=$3; shift 3
  run "${photon[@]}" bench serve --base-url "$url" --wait-server 600 --label "$label" \
    --output-dir "$dir" "$@"
}

step_parallel() {
  two_gpus parallel || return 0
  local shape tp
  mkdir -p "$out/parallel"
  for shape in qwen3-0.6b llama-3.1-8b; do
    for tp in 1 2; do
      run "${photon[@]}" bench throughput --model-shape "$shape" -tp "$tp" \
        --output-json "$out/parallel/throughput_${shape}_tp$tp.json"
    done
  done
  shape=qwen3-30b-a3b  # the MoE shape: experts split (-tp 2) or partitioned (EP)
  run "${photon[@]}" bench throughput --model-shape "$shape" -tp 2 \
    --output-json "$out/parallel/throughput_${shape}_tp2.json"
  run "${photon[@]}" bench throughput --model-shape "$shape" -tp 2 --enable-expert-parallel \
    --output-json "$out/parallel/throughput_${shape}_tp2-ep.json"
  parallel_serve "$shape"
}

parallel_serve() {  # parallel_serve SHAPE: served at -tp 2, -tp 2 EP and -dp 2 EP
  local dir model port mode
  dir=$(mktemp -d)
  model=$(python3 -c "from photon.bench.shapes import materialize_shape as m; print(m('$1', '$dir'))")
  for mode in tp2 tp2-ep dp2-ep; do
    port=$(free_port)
    case "$mode" in
      tp2) set -- -tp 2 ;;
      tp2-ep) set -- -tp 2 --enable-expert-parallel ;;
      dp2-ep) set -- -dp 2 --enable-expert-parallel ;;
    esac
    start_server 0,1 "$out/parallel/serve_$mode.log" --model "$model" --load-format dummy \
      --dtype bfloat16 --max-model-len 4096 --port "$port" "$@"
    serve_sweep "http://127.0.0.1:$port" "$mode" "$out/parallel/serve" \
      --random-input-len 1024 --random-output-len 256 --num-prompts 256 \
      --warmup-requests 32 --sweep-concurrency 16 64 256
    stop_servers
  done
  rm -rf "$dir"
}

step_router() {
  two_gpus router || return 0
  # 64 conversations x 6 turns of 64 + 128 tokens, 2,048-token system prompts in 16 groups (the
  # tool's defaults): ~6,600 blocks of 16 tokens of distinct prefixes, more than one replica's
  # 4,096 hold, fewer than two replicas' (or the reference's 8,192).
  run python3 tools/bench_router.py --replicas 2 --devices 0 1 --model-shape qwen3-0.6b \
    --num-blocks 4096 --restart-between --output-dir "$out/router"
}

step_pd() {  # one prefill + one decode instance vs two aggregated ones, GPU 0 and GPU 1
  two_gpus pd || return 0
  local dir model p1 p2 front kvt
  dir=$(mktemp -d)
  model=$(python3 -c "from photon.bench.shapes import materialize_shape as m; print(m('qwen3-0.6b', '$dir'))")
  mkdir -p "$out/pd"
  set -- --model "$model" --load-format dummy --dtype bfloat16 --max-model-len 4096
  kvt='{"kv_connector": "SharedMemoryConnector", "kv_role": "kv_ROLE"}'
  p1=$(free_port); p2=$(free_port); front=$(free_port)
  start_server 0 "$out/pd/prefill.log" "$@" --port "$p1" --kv-transfer-config "${kvt/ROLE/producer}"
  start_server 1 "$out/pd/decode.log" "$@" --port "$p2" --kv-transfer-config "${kvt/ROLE/consumer}"
  wait_healthy "http://127.0.0.1:$p1" "http://127.0.0.1:$p2"
  "${photon[@]}" proxy --prefill "http://127.0.0.1:$p1" --decode "http://127.0.0.1:$p2" \
    --port "$front" > "$out/pd/proxy.log" 2>&1 &
  servers+=($!)
  pd_sweep "$front" disaggregated
  stop_servers
  p1=$(free_port); p2=$(free_port); front=$(free_port)
  start_server 0 "$out/pd/aggregated0.log" "$@" --port "$p1"
  start_server 1 "$out/pd/aggregated1.log" "$@" --port "$p2"
  wait_healthy "http://127.0.0.1:$p1" "http://127.0.0.1:$p2"
  "${photon[@]}" router --backends "http://127.0.0.1:$p1" "http://127.0.0.1:$p2" \
    --policy round_robin --port "$front" > "$out/pd/router.log" 2>&1 &
  servers+=($!)
  pd_sweep "$front" aggregated
  stop_servers
  rm -rf "$dir"
}

pd_sweep() {  # pd_sweep PORT LABEL: the prefill-heavy mix through the front end at PORT
  serve_sweep "http://127.0.0.1:$1" "$2" "$out/pd" --random-input-len 2048 \
    --random-output-len 32 --num-prompts 256 --warmup-requests 16 --sweep-concurrency 4 16 64
}

STEPS=(env tests throughput bubble structured profile serve quant lora moe parallel router pd)
for step in "${steps[@]}"; do
  case " ${STEPS[*]} " in
    *" $step "*) ;;
    *) echo "gpu_bench.sh: unknown step '$step' (allowed: ${STEPS[*]})" >&2
       exit 2 ;;
  esac
done
mkdir -p "$out"
log="$out/bench.log"
for step in "${steps[@]}"; do
  echo "=== $step $(date -u +%FT%TZ)" | tee -a "$log"
  "step_$step"
done
echo "=== done $(date -u +%FT%TZ); results in $out" | tee -a "$log"
exit "$status"
