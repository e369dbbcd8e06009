#!/usr/bin/env bash
# One GPU session on the H200 test machine: GPU tests, then benchmarks; logs and JSON under $OUT.
# Usage: OUT=/some/dir bash tools/h200_session.sh STEP... (steps: see the case below)
# First run tools/fetch_gpu_wheels.sh here and carry .whl and .carry to the device.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PHOTON_CACHE_DIR="${PHOTON_CACHE_DIR:-/tmp/photon-cache}"
OUT="${OUT:-out}"; mkdir -p "$OUT"
steps=("$@"); [ ${#steps[@]} -gt 0 ] || steps=(tests throughput bubble profile)
log="$OUT/session.log"
P="python3 -m photon.cli"
if [ -d .whl ]; then  # packages the GPU image lacks (the server's), carried as wheels
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$log"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$log"
tp() {  # tp NAME ARGS...: one throughput run, JSON summary to $OUT/tp_NAME.json
  local name=$1; shift
  timeout 200 $P bench throughput "$@" --output-json "$OUT/tp_$name.json" 2>&1 | tail -2 | tee -a "$log"
}
for step in "${steps[@]}"; do
  echo "=== $step $(date +%T)" | tee -a "$log"
  case "$step" in
    tests)
      timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu tests/test_sampler.py \
        tests/test_triton_attention.py tests/test_kernels.py 2>&1 | tail -25 | tee -a "$log" ;;
    gputests)  # only the GPU-marked tests (CPU ones run in CI; server tests need openai)
      timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu tests/test_kernels.py \
        tests/test_sampler.py tests/test_triton_attention.py 2>&1 | tail -25 | tee -a "$log" ;;
    bubble_final)
      timeout 150 $P bench bubble --model-shape qwen3-0.6b --output-mode final \
        --output-json "$OUT/bubble_qwen_final.json" 2>&1 | grep -v '^{' | tee -a "$log" ;;
    throughput)
      tp qwen_pipelined --model-shape qwen3-0.6b
      tp qwen_blocking --model-shape qwen3-0.6b --no-pipelined ;;
    structured)  # issue 6: JSON-schema decode tok/s, pipelined vs blocking vs unconstrained
      for schema in records records-no-ranges; do
        timeout 240 $P bench structured --model-shape qwen3-0.6b --batch-sizes 32 128 \
          --schema $schema --output-json "$OUT/structured_qwen_$schema.json" 2>&1 | grep -v '^{' \
          | tee -a "$log"
      done ;;
    structured_wait)  # who waits for the masks: the GPU (default) or the engine thread, same machine
      for schema in records records-no-ranges; do
        for wait in device host; do
          timeout 200 $P bench structured --model-shape qwen3-0.6b --batch-sizes 32 128 \
            --schema $schema --structured-outputs-mask-wait $wait \
            --output-json "$OUT/structured_qwen_${schema}_$wait.json" 2>&1 | grep -v '^{' \
            | tee -a "$log"
        done
      done ;;
    structured_repeat)  # records three times and records-no-ranges once: the spread on one machine
      for run in r1:records r2:records r3:records r1:records-no-ranges; do
        round=${run%%:*}; schema=${run#*:}
        timeout 150 $P bench structured --model-shape qwen3-0.6b --batch-sizes 32 128 \
          --schema $schema --output-json "$OUT/structured_${schema}_$round.json" 2>&1 \
          | grep -v '^{' | sed "s/^/$schema $round /" | tee -a "$log"
      done ;;
    structured_threads)  # the records schema with 4 and 8 mask-fill threads (default: 8)
      for threads in 4 8; do
        timeout 200 $P bench structured --model-shape qwen3-0.6b --batch-sizes 32 128 \
          --structured-outputs-threads $threads \
          --output-json "$OUT/structured_qwen_records_t$threads.json" 2>&1 | grep -v '^{' \
          | tee -a "$log"
      done ;;
    gputests_structured)  # the structured-outputs and kernel GPU tests only
      timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_cuda_structured.py \
        tests/test_kernels.py 2>&1 | tail -15 | tee -a "$log" ;;
    profile_structured_gpu)  # compute-stream kernel classes and idle gaps, JSON vs plain batches
      timeout 300 python3 tools/profile_structured_gpu.py --out "$OUT" 2>&1 | tail -8 | cut -c1-1500 \
        | tee -a "$log" ;;
    profile_structured_host)  # cProfile of the engine thread, records B=128
      timeout 200 python3 tools/profile_structured_host.py > "$OUT/profile_host.txt" 2>&1
      head -40 "$OUT/profile_host.txt" | tee -a "$log" ;;
    throughput8b)
      tp llama8b_pipelined --model-shape llama-3.1-8b ;;
    throughput8b_blocking)
      tp llama8b_blocking --model-shape llama-3.1-8b --no-pipelined ;;
    bubble)
      timeout 150 $P bench bubble --model-shape qwen3-0.6b --output-json "$OUT/bubble_qwen.json" \
        2>&1 | grep -v '^{' | tee -a "$log" ;;
    bubble8b)
      timeout 150 $P bench bubble --model-shape llama-3.1-8b --output-json "$OUT/bubble_llama8b.json" \
        2>&1 | grep -v '^{' | tee -a "$log" ;;
    profile)
      timeout 120 $P bench profile --model-shape qwen3-0.6b --batch-size 256 --prompt-len 1024 \
        2>&1 | tail -1 > "$OUT/profile_qwen.json"; tail -c 1500 "$OUT/profile_qwen.json" | tee -a "$log" ;;
    peer)
      # HF transformers continuous batching on the standard workload; its weights feed photon.
      timeout 330 python3 .carry/hf_peer.py --model qwen3-0.6b --n 256 --save /tmp/peer-qwen \
        2>&1 | tail -2 | tee -a "$log" "$OUT/peer_hf.json"
      python3 -c "from photon.bench.shapes import attach_tokenizer; attach_tokenizer('/tmp/peer-qwen')"
      tp peer_weights_pipelined --model /tmp/peer-qwen --dtype bfloat16
      tp peer_weights_blocking --model /tmp/peer-qwen --dtype bfloat16 --no-pipelined ;;
    serve)
      # Latency/throughput frontier of `photon serve`, pipelined and blocking servers, loopback.
      model=/tmp/peer-qwen; [ -d $model ] || model=$(python3 -c "
from photon.bench.shapes import materialize_shape; print(materialize_shape('qwen3-0.6b', '/tmp'))")
      extra=(); [ -f $model/model.safetensors ] || extra=(--load-format dummy)
      for mode in pipelined no-pipelined; do
        $P serve --model $model "${extra[@]}" --dtype bfloat16 --max-model-len 2048 --port 8123 \
          --$mode > "$OUT/serve_$mode.log" 2>&1 &
        pid=$!
        timeout 150 $P bench serve --base-url http://127.0.0.1:8123 --wait-server 120 \
          --random-input-len 512 --random-output-len 128 --num-prompts 64 \
          --warmup-requests 32 --sweep-concurrency 4 16 64 --label $mode --output-dir "$OUT/serve" 2>&1 | tail -2 | cut -c1-400 | tee -a "$log"
        kill $pid; wait $pid
      done
      $P bench serve --plot-from "$OUT/serve/pipelined.json" "$OUT/serve/no-pipelined.json" \
        --plot-output "$OUT/serve/frontier_h200.png" 2>&1 | tail -1 | tee -a "$log"
      tar czf "$OUT/serve.tgz" -C "$OUT" serve serve_pipelined.log serve_no-pipelined.log \
        && rm -rf "$OUT/serve" "$OUT"/serve_*.log ;;
  esac
done
echo "=== done $(date +%T)" | tee -a "$log"
