#!/usr/bin/env bash
# One GPU session on the H200 test machine: GPU tests, then benchmarks; logs and JSON under $OUT.
# Usage: OUT=/some/dir bash tools/h200_session.sh [tests|bubble|throughput ...]
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PHOTON_CACHE_DIR="${PHOTON_CACHE_DIR:-/tmp/photon-cache}"
OUT="${OUT:-out}"; mkdir -p "$OUT"
steps=("$@"); [ ${#steps[@]} -gt 0 ] || steps=(tests bubble throughput)
log="$OUT/session.log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$log"
python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$log"
for step in "${steps[@]}"; do
  echo "=== $step $(date +%T)" | tee -a "$log"
  case "$step" in
    tests)
      timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu tests/test_sampler.py \
        tests/test_pipeline.py 2>&1 | tail -25 | tee -a "$log" ;;
    bubble)
      timeout 240 python3 -m photon.cli bench bubble --model-shape qwen3-0.6b \
        --output-json "$OUT/bubble_qwen3_0.6b.json" 2>&1 | grep -v '^{' | tee -a "$log"
      timeout 240 python3 -m photon.cli bench bubble --model-shape llama-3.1-8b \
        --output-json "$OUT/bubble_llama_3.1_8b.json" 2>&1 | grep -v '^{' | tee -a "$log" ;;
    throughput)
      for mode in pipelined no-pipelined; do
        timeout 240 python3 -m photon.cli bench throughput --model-shape qwen3-0.6b --$mode \
          --output-json "$OUT/throughput_qwen3_0.6b_$mode.json" 2>&1 | tail -3 | tee -a "$log"
      done ;;
  esac
done
echo "=== done $(date +%T)" | tee -a "$log"
