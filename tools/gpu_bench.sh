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
#               profile_qwen3-0.6b_b256_ctx1024.json (not in the default set)
#   serve       `photon serve` + `photon bench serve` on loopback, pipelined and blocking servers:
#               serve/pipelined.json, serve/no-pipelined.json, serve/frontier.png (not in the
#               default set; needs the server's and the client's packages)
#
# Run it from the repository root with photon installed (pip install -e ".[test]"). The built-in
# shapes have random weights and a byte-level BPE tokenizer trained at first use, so nothing is
# downloaded. The llama-3.1-8b shape needs room for its 16 GB of bf16 weights plus a KV cache.
# `structured` and the structured-outputs GPU tests need xgrammar (the tests also jsonschema).
# Example: tools/gpu_bench.sh results/h200 env throughput
set -uo pipefail

out="${1:-bench-results}"
[ $# -gt 0 ] && shift
steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(env tests throughput bubble structured)
export PYTHONUNBUFFERED=1
photon=(python3 -m photon.cli)
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
    tests/test_sampler.py tests/test_triton_attention.py
}

step_throughput() {
  for shape in qwen3-0.6b llama-3.1-8b; do
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
  local json="$out/profile_qwen3-0.6b_b256_ctx1024.json"
  run "${photon[@]}" bench profile --model-shape qwen3-0.6b --batch-size 256 --prompt-len 1024
  grep '^{"benchmark": "profile"' "$log" | tail -1 > "$json"
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

for step in "${steps[@]}"; do
  case "$step" in
    env|tests|throughput|bubble|structured|profile|serve) ;;
    *) echo "gpu_bench.sh: unknown step '$step' (allowed: env tests throughput bubble" \
         "structured profile serve)" >&2
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
