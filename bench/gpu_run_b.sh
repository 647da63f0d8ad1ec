#!/usr/bin/env bash
# One device call: the MLP probe, the new GPU tests, the engine at batch 1/32/128, then the stream with latency budgets
# and a replay. Outputs under $OUT.
set -u
. bench/gpu_setup.sh || exit 1
mkdir -p "$OUT"
timeout 80 python3 bench/mlp_probe.py --out "$OUT/mlp_probe.json" > "$OUT/mlp_probe.txt" 2>&1; tail -22 "$OUT/mlp_probe.txt"
timeout 170 python3 -m pytest tests/engine/test_gpu_invariance.py tests/engine/test_triton_kernels.py \
  tests/engine/test_swiglu_matmul.py tests/engine/test_gpu.py -m gpu -q -rA --tb=short -p no:cacheprovider -o addopts="" \
  -k "many_schemas or indexed or swiglu or identical or bank" -s > "$OUT/gpu_tests_b.txt" 2>&1
grep -E "PASSED|FAILED|ERROR|passed|failed|bank:" "$OUT/gpu_tests_b.txt" | tail -30
METHODS=cached_graphs,cached_graphs_deterministic BATCHES=1,32,128 T_ENGINE=80 bash bench/gpu_session.sh engine 2>&1 | tail -12
STATES=8000 T_STREAM=250 STREAM_ARGS="--max-wait-ms 20 --latency-budget-ms 25,50,100 --latency-seconds 8 --latency-warmup-seconds 3 --replay" \
  bash bench/gpu_session.sh stream 2>&1 | tail -22
