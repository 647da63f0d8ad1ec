#!/usr/bin/env bash
# One device call: the small tile and the packed step inputs on the GPU (tests), the engine at batch 1/32/128, then
# the stream's throughput, one latency budget and a replay. Outputs under $OUT.
set -u
. bench/gpu_setup.sh || exit 1
mkdir -p "$OUT"
timeout 70 python3 -m pytest tests/engine/test_small_tile.py tests/engine/test_gpu.py -m gpu -q -rA --tb=short \
  -p no:cacheprovider -o addopts="" -k "small_tile or invariant_linear or bank or warmup or 70" -s > "$OUT/gpu_tests_c.txt" 2>&1
grep -E "PASSED|FAILED|ERROR|passed|failed|identical to" "$OUT/gpu_tests_c.txt" | tail -14
METHODS=cached_graphs,cached_graphs_deterministic BATCHES=1,32,128 T_ENGINE=75 bash bench/gpu_session.sh engine 2>&1 | tail -11
STATES=8000 T_STREAM=190 STREAM_ARGS="--max-wait-ms 20 --latency-budget-ms 50 --latency-seconds 6 --latency-warmup-seconds 2 --replay" \
  bash bench/gpu_session.sh stream 2>&1 | tail -12
