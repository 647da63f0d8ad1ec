"""End-to-end stream benchmark: embedded broker + N `decider worker` processes + a load generator.

    python bench/stream_bench.py                      # GPU: 0.8B-shaped model, 1 worker, max-wait 5/20/50 ms
    python bench/stream_bench.py --workers 2          # one worker per GPU (CUDA_VISIBLE_DEVICES=i each)
    python bench/stream_bench.py --workers 2 --kill-one   # SIGKILL worker 0 mid-stream, restart it, verify exactly-once
    python bench/stream_bench.py --quick              # CPU, tiny model, small (tests/bench runs it)
    python bench/stream_bench.py --scale-out          # workers 1 -> 3 -> 1 under load, eager vs incremental
                                                      # rebalancing (bench/scale_out.py), one worker per GPU

Phases, each on its own set of topics so they never mix; each starts its workers, waits until every one holds
partitions (from their `--log-format json` logs), then scores a warm-up before anything is measured:
1. engine only: the same model and shape scored in-process by `SchemaEngine.score_rows` at --max-batch (the ceiling
   the stream should approach);
2. throughput: N states produced as fast as the producer goes; sustained states/s = the rate at which scored
   records become visible to a read_committed reader, between 10% and 90% of them (start-up and tail excluded);
   with --kill-one, worker 0 is SIGKILLed at 40% and restarted with the same --worker-id. Inside that window, the
   all-workers window starts once every worker has committed since its last assignment (from the workers' logs,
   `bench.stream_windows`): the aggregate rate there, each worker's own committed records per second there, and the
   time between the first and the last worker getting partitions;
3. latency, once per --max-wait-ms: states produced at --latency-load x the measured throughput; latency of a state =
   the moment its record becomes visible to a read_committed reader - its event time (set when it was produced);
   then once per --latency-budget-ms B, the same with workers run with `--latency-budget-ms B --max-wait-ms B`:
   how many states were visible later than B after their event time, and how many cycles the worker itself counted
   as over the budget (it measures from when it consumed a cycle's first state, so it cannot see time in Kafka).
   With --gil-profile, py-spy samples worker 0's GIL holder over each budget phase's measured window
   (`bench/gil_profile.py`): which thread held the GIL for what share of the time, and where;
4. with --replay: `decider replay` of the first latency phase's states topic (live, small deadline-cut batches) into
   new topics at full batches: its scoring rate as it reports it (from `replay_started`, so schema preparation and
   graph capture count), its steady rate from its first commit to its last and the seconds before that first commit
   (from its own log), and whether every replayed record's probabilities equal the live record's bit for bit (what
   deterministic scoring promises).
Every phase ends with the exactly-once check: each input state id appears exactly once across the probabilities
and dead-letter topics, and nothing else does.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import capacity, cgroup_cpu  # noqa: E402
from bench.replay_phase import replay_phase  # noqa: E402
from bench.stream_phases import latency_phase, throughput_phase  # noqa: E402
from bench.workload import QWEN35_08B, questions, states  # noqa: E402
from bench.bench_broker import add_broker_option, bench_broker  # noqa: E402
from bench.host_stages import parse_device_ms, stand_in_batch_ms  # noqa: E402


# The engine benchmark's Qwen3.5-0.8B shape with the offline test tokenizer's vocabulary (the worker loads a tokenizer
# from the model directory, and the real Qwen3.5 BPE ships only in tiktoken form). Token counts of the shape (state,
# prefix) are measured with that tokenizer, so the work per state matches the engine benchmark.
SHAPE_08B = {**{k: v for k, v in QWEN35_08B.items() if k != "vocab_size"}, "initializer_range": 0.02}


def stand_in_label(device_ms: str) -> str:
    """How the stand-in's GPU is written in titles: its line, or its measured points."""
    if ":" in device_ms:
        return "batch times " + ", ".join(f"{n}: {ms} ms" for n, ms in (p.split(":") for p in device_ms.split(",")))
    fixed, per_state = device_ms.split(",")
    return f"t(n) = {fixed} + {per_state} n ms"


def device_tag(env: dict) -> str:
    """The device in a result's file name: the GPU's name, or cpu-stand-in."""
    return "cpu-stand-in" if env.get("engine") == "stand-in" else env["gpu"].replace(" ", "-").lower()


def write_model(args, root: Path) -> Path:
    from engine.testing import write_tiny_model
    tiny = args.quick or args.engine == "stand-in"
    return write_tiny_model(root / "model", seed=0, **({} if tiny else SHAPE_08B))


def schema_document(tok, n_questions: int, n_options: int, prefix_tokens: int) -> dict:
    """The engine benchmark's questions (padded to `prefix_tokens`) as a schema file, with question ids."""
    return {"mode": "packed", "questions": [{"id": f"q{i}", **q} for i, q in
                                            enumerate(questions(tok, n_questions, n_options, prefix_tokens))]}


def engine_only(args, model_dir: Path, document: dict, texts: list[str]) -> float:
    """States/s of the engine alone at --max-batch on this device, warmed up."""
    import torch
    from engine import Engine, SchemaEngine
    eng = Engine.load(model_dir, device="cuda" if args.device.startswith("cuda") else "cpu")
    se = SchemaEngine(eng)
    h = se.prepare(document["questions"])
    rows = [se.tokenize(h, t) for t in texts[:args.max_batch]]
    for _ in range(2):
        se.score_rows(h, rows)
    n, t = 0, time.perf_counter()
    while time.perf_counter() - t < args.engine_seconds:
        se.score_rows(h, rows)
        n += len(rows)
    rate = n / (time.perf_counter() - t)
    del se, h, eng
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rate


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="CPU, tiny model, a few hundred states")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--gpus", type=int, default=None, help="GPUs to spread workers over (default: all visible)")
    ap.add_argument("--kill-one", action="store_true", help="SIGKILL worker 0 at 40%% of the throughput phase, restart it")
    ap.add_argument("--states", type=int, default=None)
    ap.add_argument("--state-tokens", type=int, default=128)
    ap.add_argument("--questions", type=int, default=10)
    ap.add_argument("--options", type=int, default=4)
    ap.add_argument("--prefix-tokens", type=int, default=400)
    ap.add_argument("--max-batch", type=int, default=None)
    ap.add_argument("--max-wait-ms", default=None, help="comma-separated; the latency phase runs once per value")
    ap.add_argument("--latency-budget-ms", default=None,
                    help="comma-separated; after the --max-wait-ms phases, a latency phase per value with workers run "
                         "with --latency-budget-ms B --max-wait-ms B (default: 25,50,100; none with --quick)")
    ap.add_argument("--latency-load", type=float, default=0.5, help="offered load as a fraction of the throughput")
    ap.add_argument("--latency-rate", type=float, default=None, help="offered states/s (instead of --latency-load)")
    ap.add_argument("--latency-seconds", type=float, default=None)
    ap.add_argument("--latency-warmup-seconds", type=float, default=None,
                    help="load at the offered rate before latencies are measured (first-sight graph captures)")
    ap.add_argument("--partitions", type=int, default=None)
    ap.add_argument("--gil-profile", action="store_true",
                    help="sample worker 0's GIL holder with py-spy during each budget phase's measured window "
                         "(bench/gil_profile.py): worker0_gil in the phase's result, the raw samples beside its log")
    ap.add_argument("--replay", action="store_true",
                    help="after the latency phases, replay the first one's states at full batches and compare records")
    ap.add_argument("--engine-seconds", type=float, default=None)
    ap.add_argument("--capacity", action="store_true",
                    help="measure each --latency-budget-ms's capacity instead of the phases above (bench/capacity.py)")
    ap.add_argument("--capacity-loads", default=None,
                    help="comma-separated offered loads, fractions of the full-load rate (default 0.3,0.4,...,0.9,0.95)")
    ap.add_argument("--capacity-samples", type=int, default=2, help="measured windows per load")
    ap.add_argument("--capacity-settle-seconds", type=float, default=None,
                    help="states at a budget's first load, not measured, before its first window: the fresh broker "
                         "and workers of each budget settle (default 12; 0 with --quick)")
    ap.add_argument("--full-load-rate", type=float, default=None,
                    help="with --capacity: take this many states/s as the full load instead of measuring it (the "
                         "loads are fractions of it: two trees compared at the same offered rates)")
    ap.add_argument("--broker-delay-ms", type=float, default=0.0,
                    help="with --capacity: the workers reach the broker through bench/latency_proxy.py, this much each way")
    ap.add_argument("--engine", choices=("model", "stand-in"), default="model",
                    help="stand-in: on a CPU, the tiny model's real path with each batch's scores ready when a GPU "
                         "of --device-ms would have them (bench/host_stages.py), at the full shapes (not --quick's); "
                         "the engine-only rate is then the model's, at --max-batch")
    ap.add_argument("--device-ms", default="2.3,0.45",
                    help="with --engine stand-in: A,B (a batch of n states takes A + B x n ms; default: the H200's "
                         "t(n), issue 46), or a GPU's measured batch times n:ms,... (a batch padded to its graph's "
                         "bucket, a broken line between the points)")
    add_broker_option(ap)
    ap.add_argument("--start-timeout", type=float, default=300)
    ap.add_argument("--scale-out", default=None, metavar="REBALANCING",
                    help="instead of the phases above: bench/scale_out.py's run (workers 1 -> 3 -> 1 under load) once "
                         "per comma-separated rebalancing, e.g. eager,incremental")
    ap.add_argument("--scale-out-rate", type=float, default=None,
                    help="states/s offered during --scale-out (default 1500: 75%% of one H200; 20 with --quick)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    stand_in = args.engine == "stand-in"
    if stand_in and args.quick:
        ap.error("--engine stand-in runs the full shapes; --quick's small ones would model nothing")
    if stand_in:
        try:
            device_points = parse_device_ms(args.device_ms)
        except ValueError:
            ap.error(f"--device-ms: expected A,B (milliseconds: a batch of n takes A + B x n) or n:ms,... (measured "
                     f"batch times, at least two), got {args.device_ms!r}")
    import torch
    cuda = torch.cuda.is_available() and not args.quick and not stand_in
    args.device = args.device or ("cuda" if cuda else "cpu")
    args.gpus = args.gpus or (torch.cuda.device_count() if args.device.startswith("cuda") else 1)
    args.states = args.states or (120 if args.quick else 20000)
    args.max_batch = args.max_batch or (16 if args.quick else 128)
    args.max_wait_ms = [int(x) for x in (args.max_wait_ms or ("20" if args.quick else "5,20,50")).split(",")]
    budgets = args.latency_budget_ms if args.latency_budget_ms is not None else (
        "50" if args.quick and args.capacity else "" if args.quick else "25,50,100")
    args.latency_budget_ms = [int(x) for x in budgets.split(",") if x.strip()]
    for flag, values in (("--max-wait-ms", args.max_wait_ms), ("--latency-budget-ms", args.latency_budget_ms)):
        if len(set(values)) != len(values):
            # a phase's topics and consumer group are named by its value: a repeat would read the earlier phase's
            # topics and count its records as duplicates
            ap.error(f"{flag}: each value at most once ({values}); run the bench again for another sample")
    args.capacity_loads = ([float(x) for x in args.capacity_loads.split(",")] if args.capacity_loads
                           else [0.3, 0.6] if args.quick else list(capacity.DEFAULT_LOADS))
    if args.broker_delay_ms and not args.capacity:
        ap.error("--broker-delay-ms is measured by --capacity runs only")
    if args.capacity_settle_seconds is not None and args.capacity_settle_seconds < 0:
        ap.error(f"--capacity-settle-seconds must be 0 or more, not {args.capacity_settle_seconds:g}")
    args.capacity_settle_seconds = (args.capacity_settle_seconds if args.capacity_settle_seconds is not None
                                    else 0 if args.quick else 12)
    args.latency_seconds = args.latency_seconds or (3 if args.quick else 8 if args.capacity else 15)
    args.latency_warmup_seconds = (args.latency_warmup_seconds if args.latency_warmup_seconds is not None
                                   else (1 if args.quick else 2 if args.capacity else 5))
    args.partitions = args.partitions or max(4, 2 * args.workers)
    if args.partitions < args.workers:
        print(f"stream_bench: --partitions {args.partitions} is fewer than --workers {args.workers}: a worker without "
              "partitions idles and every phase waits for all of them to hold some; give at least one per worker",
              file=sys.stderr)
        raise SystemExit(2)
    args.engine_seconds = args.engine_seconds or (2 if args.quick else 5)
    if args.quick:
        args.state_tokens, args.questions, args.prefix_tokens = 24, 3, 60

    root = Path(tempfile.mkdtemp(prefix="decider-stream-bench-"))
    logs = root / "logs"
    logs.mkdir()
    model_dir = write_model(args, root)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    document = schema_document(tok, args.questions, args.options, args.prefix_tokens)
    schema_file = root / "schema.json"
    schema_file.write_text(json.dumps(document))
    texts = states(tok, 256, args.state_tokens, seed=3)
    # up to --state-tokens each (a few tokens short where a word would not fit): their suffixes can fall into two
    # length buckets, and a graph first captured mid-phase stalls the stream (with kernels compiled for a new length,
    # for seconds), so the workers warm up both ends
    lengths = [len(tok.encode(t, add_special_tokens=False)) for t in texts]
    args.warmup_state_tokens = ",".join(str(n) for n in sorted({min(lengths), max(lengths)}))
    env = dict(date=datetime.date.today().isoformat(), device=args.device,
               gpu=torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu",
               broker=args.broker, workers=args.workers, gpus=args.gpus, partitions=args.partitions, max_batch=args.max_batch,
               state_tokens=args.state_tokens, questions=args.questions, options=args.options,
               model="tiny (engine.testing)" if args.quick else "Qwen3.5-0.8B-shaped random weights, test tokenizer",
               cpus=os.cpu_count(), cpu_quota_cpus=cgroup_cpu.quota_cpus())
    if stand_in:
        env.update(engine="stand-in", device_ms=args.device_ms,
                   gpu=f"CPU, a stand-in GPU: {stand_in_label(args.device_ms)}",
                   model="tiny (engine.testing), its forward replaced by the stand-in after the first of each shape")
    print(json.dumps(env), flush=True)
    if args.scale_out:
        from bench.scale_out import bench_runs
        return bench_runs(args, env, model_dir, schema_file, texts, root)
    if stand_in:    # the modelled GPU's rate at --max-batch
        one_engine = args.max_batch * 1000 / stand_in_batch_ms(device_points, args.max_batch)
    else:
        one_engine = engine_only(args, model_dir, document, texts)
    engine_rate = one_engine * (args.workers if args.device.startswith("cuda") else 1)
    print(f"engine only: {engine_rate:,.1f} states/s (x{args.workers} workers on GPUs)", flush=True)
    # The reader thread stamps when each record becomes visible; a full collection walking torch's and transformers'
    # objects in this process (~0.2 s) would stamp late and count as latency. Same remedy as the worker's, its young
    # threshold included (the reader's records would otherwise be promoted and trigger full collections).
    from worker.stream.gc_pauses import freeze_loaded_objects
    freeze_loaded_objects()
    if args.capacity:
        return capacity_result(args, capacity.capacity_run(args, env, engine_rate, model_dir, schema_file, texts, logs))
    runs = []
    with bench_broker(args.broker, logs) as broker:
        tput = throughput_phase(args, broker.bootstrap, model_dir, schema_file, texts, logs)
        tput["fraction_of_engine"] = tput["states_per_s"] / engine_rate
        if tput["all_workers_states_per_s"] is not None:
            tput["all_workers_fraction_of_engine"] = tput["all_workers_states_per_s"] / engine_rate
        # the latency phases' load is a fraction of what the whole group sustains
        sustained = tput["all_workers_states_per_s"] or tput["states_per_s"]
        runs.append(tput)
        print(json.dumps(tput), flush=True)
        for mw in args.max_wait_ms:
            lat = latency_phase(args, broker.bootstrap, model_dir, schema_file, texts, logs, mw,
                                args.latency_rate or args.latency_load * sustained)
            runs.append(lat)
            print(json.dumps(lat), flush=True)
        for budget in args.latency_budget_ms:
            lat = latency_phase(args, broker.bootstrap, model_dir, schema_file, texts, logs, budget,
                                args.latency_rate or args.latency_load * sustained, latency_budget_ms=budget)
            runs.append(lat)
            print(json.dumps(lat), flush=True)
        if args.replay:
            rep = replay_phase(args, broker.bootstrap, model_dir, f"lat{args.max_wait_ms[0]}", logs)
            # one replay process on one GPU, whatever the live phases' worker count
            rep["fraction_of_engine"] = rep["states_per_s"] / one_engine
            if rep["steady_states_per_s"] is not None:
                rep["steady_fraction_of_engine"] = rep["steady_states_per_s"] / one_engine
            runs.append(rep)
            print(json.dumps(rep), flush=True)
    result = dict(env=env, engine_only_states_per_s=engine_rate, runs=runs, logs=str(logs))
    print(markdown(result))
    if not args.quick:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        kill = "-kill" if args.kill_one else ""
        on = "" if args.broker == "kafka" else f"-{args.broker}"
        path = out / f"{env['date']}-{device_tag(env)}-stream-{args.workers}w{kill}{on}.json"
        path.write_text(json.dumps(result, indent=1))
        shutil.copytree(logs, path.with_suffix(".logs"), dirs_exist_ok=True)   # the workers' and broker's own account
        print(f"wrote {path} and its logs")
    return result


def capacity_result(args, result: dict) -> dict:
    """Print a capacity run's table; on a GPU keep its JSON, its PNG (where matplotlib is installed) and its logs."""
    print(capacity.markdown(result))
    if args.quick:
        return result
    env, out = result["env"], Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    on = "" if args.broker == "kafka" else f"-{args.broker}"
    path = out / f"{env['date']}-{device_tag(env)}-capacity-delay{args.broker_delay_ms:g}ms{on}.json"
    path.write_text(json.dumps(result, indent=1))
    shutil.copytree(result["logs"], path.with_suffix(".logs"), dirs_exist_ok=True)
    try:
        capacity.plot(result, path.with_suffix(".png"))
    except ImportError:
        print("matplotlib is not installed here: render the PNG with python bench/capacity.py --plot", path)
    print(f"wrote {path}")
    return result


def markdown(result: dict) -> str:
    env = result["env"]
    lines = [f"{env['gpu']}, {env['workers']} worker(s), {env['partitions']} partitions, max batch {env['max_batch']}, "
             f"{env['state_tokens']}-token states, {env['questions']} questions x {env['options']} options; "
             f"engine only: {result['engine_only_states_per_s']:,.1f} states/s", "",
             "| phase | max wait ms | budget ms | states/s | steady states/s | p50 ms | p99 ms | over budget | exactly once "
             "| dead letters |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for r in result["runs"]:
        if r["phase"] == "replay":
            lines.append(f"| replay of {r['of']} | | | {r['states_per_s']:,.1f} | {_num(r['steady_states_per_s'])} | | | "
                         f"| bit-identical to live: {r['bit_identical']}/{r['compared']} (max diff "
                         f"{r['max_abs_diff']:.3g}) | exit {r['exit_code']} |")
            notes.append(f"replay: {_num(r['startup_s'], 2)} s from replay_started to its first commit, then "
                         f"{_num(r['steady_states_per_s'])} states/s over {_num(r['first_to_last_commit_s'], 2)} s "
                         f"to its last; the process ran {r['process_s']:.1f} s")
            continue
        if r["phase"] == "throughput":
            per_worker = ", ".join(_num(x) for x in r["per_worker_states_per_s"] or [])
            notes.append(f"throughput: all {r['workers']} worker(s) steady over {_num(r['all_workers_window_s'], 2)} s "
                         f"of the 10-90% window ({_num(r['all_workers_window_cut_s'], 2)} s cut before it; "
                         f"{r['rebalances_in_window']} rebalance events in it); per worker: [{per_worker}] states/s; "
                         f"partitions reached the last worker {_num(r['assignment_spread_s'], 2)} s after the first")
        rate = r.get("states_per_s", r.get("offered_states_per_s"))
        over = f"{r['over_budget']}/{r['states']}" if "over_budget" in r else ""
        lines.append(f"| {r['phase']}{' (kill+restart)' if r.get('killed_and_restarted') else ''} | {r.get('max_wait_ms', '')} "
                     f"| {r.get('latency_budget_ms', '')} | {rate:,.1f} | {_num(r.get('all_workers_states_per_s'))} "
                     f"| {r.get('p50_ms', float('nan')):.1f} "
                     f"| {r.get('p99_ms', float('nan')):.1f} | {over} "
                     f"| {'yes' if r['ok'] else 'NO: ' + json.dumps(r)} | {r['dead_letters']} |")
    return "\n".join(lines + [""] + notes)


def _num(value: float | None, digits: int = 1) -> str:
    """A figure for the table; empty when not measured."""
    return "" if value is None else f"{value:,.{digits}f}"


if __name__ == "__main__":
    main()
