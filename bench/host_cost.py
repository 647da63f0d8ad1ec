"""The host's cost of the stream, measured on the CPU: host CPU microseconds per state and per cycle by stage, and the
GIL's share of the wall time, for one `decider worker` on its real path (issue 46).

    python bench/host_cost.py                                   # Apache Kafka, 1,000 states/s, this tree
    python bench/host_cost.py --trees /tmp/before,.  --reps 2   # two checkouts side by side, alternately
    python bench/host_cost.py --broker embedded --rate 300 --seconds 3    # small (tests/bench runs it smaller)

What runs: the broker (`bench/bench_broker.py`), the tiny model (`engine.testing.write_tiny_model`), a schema of
--questions x --options (`bench/workload.py`: 10 x 4, its prefix padded to --prefix-tokens), states of
--state-tokens as JSON objects (`--input-format json`, ids, text, schema id and event time from fields), Avro output,
and one `decider worker` (`bench/host_stages.py`: the tree's own CLI, started with PYTHONPATH=TREE) with the latency
budget of the H200's capacity runs (--latency-budget-ms 25 --max-wait-ms 25, --max-batch 128). Its path is the
product's: poll, decode, route, tokenize, pad, launch, read back, build records, encode, produce, commit, and the
bookkeeping and logging of each commit. Each window (one worker process per tree, per mode, per repetition, on topics
of its own) warms up at --rate for --warmup-seconds, then offers --rate states/s for --seconds, measured between two
snapshots of the worker's CPU clocks (`bench/host_stages.py`), and ends with the exactly-once check.

The engine's own compute is not host cost, and is timed apart: `bench/host_stages.py` counts the model's forward (the
step `SchemaEngine` builds; on the GPU a graph's replay) as `forward`, and with `--engine stand-in` (the default) a
step replays the output of the first real forward of its shape at no cost, with its scores ready when the H200 would
have them (--device-ms: t(n) = 2.3 ms + 0.45 ms a state, issue 46), so that the loop runs at the H200's rates on this
CPU (whose tiny-model forward scores ~45 states/s at 10 questions). `--engine tiny` runs the real forward every step
(then only low rates can be offered; its CPU is subtracted).

Two modes per window, each in its own worker process:
- `light`: only the forward is wrapped. Host CPU = every thread's CPU (its CPU clock: `bench.thread_cpu.thread_cpu_ns`)
  minus the forward's, per state (the states committed in the window, from the worker's `committed` events) and per
  cycle, by thread; the GIL's share of the wall time from py-spy's `--gil` samples (`bench/gil_profile.py`): held
  outside the engine's compute (`non_engine_share`) and in it. These are the figures the targets are read against.
- `stages`: every function of `bench/host_stages.py`'s `STAGES` is wrapped and charged its exclusive CPU on its thread
  (`time.thread_time_ns` on entry and exit): host CPU by stage, per state and per cycle, and each thread's time outside
  any stage (`other`). Each wrapped call adds a measured ~2 us; `us_per_state_corrected` takes the wrapper's own part
  off each stage, and the light mode's totals are the reference.
Per cycle from the `committed` events: the median close -> launch (the cycle closed until its batch was queued on the
device) of the cycles of <= 8 states, with its parts (`bench.stream_windows.cycle_timelines`).

Beside the worker, per window: the broker's CPU a state and the machine's busy and stolen cores (`/proc/stat`): on this
project's 2-core machine at 1,000 states/s Apache Kafka takes ~1 ms of CPU a state and the machine ~1.8-2 cores, so the
worker's clocks run long. Each repetition starts at another tree: one tree's four windows in a run cost the worker 500,
526, 526 and 546 us a state (librdkafka's 89 to 128) as the broker's fell (1,195 to 956: its JIT warming up), and the
tree always run second was charged for it.

The JSON (`--out`, default bench/results/DATE-cpu-host-cost.json) holds every window and, per tree, the medians over
its repetitions; with two trees, each figure's ratio (second / first). A PNG beside it (where matplotlib is installed;
`python bench/host_cost.py --plot X.json` renders it again) shows per tree the host CPU a state by thread, the GIL by
thread and the largest stages, against issue 46's targets (60 us a state, 15% of the wall time).

    python bench/host_cost.py --plot bench/results/X-cpu-host-cost.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import gil_profile, host_cost_plot  # noqa: E402
from bench.ab_order import rotated  # noqa: E402
from bench.bench_broker import add_broker_option, bench_broker  # noqa: E402
from bench.host_stages import stand_in_command  # noqa: E402
from bench.stream_phases import Reader, Stream, exactly_once, produce  # noqa: E402
from bench.stream_windows import committed_records, cycle_timelines, read_log_events  # noqa: E402
from bench.thread_cpu import machine_cpu_s, process_cpu_s  # noqa: E402
from bench.workload import states  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SMALL_CYCLE = 8
"""Cycles of at most this many states are the ones the close -> launch target (0.3 ms) is about."""
NATIVE = "librdkafka"
JSON_INPUT_FLAGS = ("--input-format", "json", "--id-field", "id", "--text-field", "text", "--schema-id-field", "schema",
                    "--event-time-field", "created_at")
# py-spy's frames of the engine's compute: the forward's own and the stand-in's (bench/host_stages.py's `forward`)
ENGINE_FRAMES = gil_profile.ENGINE_FRAMES + r"|^forward \((?:.*/)?host_stages\.py"


def json_state(state_id: str, text: str, event_time_ms: int) -> bytes:
    """A user's event as the worker reads it with JSON_INPUT_FLAGS."""
    return json.dumps({"id": state_id, "schema": "bench", "text": text, "created_at": event_time_ms,
                       "source": {"system": "helpdesk", "queue": "billing"}}).encode()


class ProbedStream(Stream):
    """A phase's topics and one worker run by `bench/host_stages.py` from ``tree``, taking snapshot commands."""

    def __init__(self, args, bootstrap: str, model_dir: Path, schema_file: Path, name: str, logs: Path, tree: Path,
                 stages: bool):
        super().__init__(args, bootstrap, model_dir, schema_file, name, args.max_wait_ms, logs, args.latency_budget_ms)
        self.tree, self.stages = tree, stages
        self.snapshots_path = logs / f"{name}-w0.snapshots.jsonl"

    def start_worker(self, i: int) -> None:
        cli, env = self.worker_args(i)
        env = {**env, "PYTHONPATH": str(self.tree), "OMP_NUM_THREADS": "1"}
        cmd = stand_in_command(self.args.device_ms, self.snapshots_path, [*cli, *JSON_INPUT_FLAGS], self.stages,
                               self.args.engine)
        log = open(self.log_path(i), "ab")
        self.workers[i] = subprocess.Popen(cmd, env=env, cwd=self.tree, stdin=subprocess.PIPE, stdout=log, stderr=log,
                                           start_new_session=True, text=True)

    def snapshot(self, name: str, timeout_s: float = 30.0) -> dict:
        """The worker's CPU clocks and stage totals now."""
        worker = self.workers[0]
        worker.stdin.write(f"snapshot {name}\n")
        worker.stdin.flush()
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            found = [s for s in self.read_snapshots() if s["name"] == name]
            if found:
                return found[-1]
            time.sleep(0.02)
        raise SystemExit(f"the worker took no snapshot within {timeout_s} s; see {self.log_path(0)}")

    def read_snapshots(self) -> list[dict]:
        if not self.snapshots_path.exists():
            return []
        return [json.loads(line) for line in self.snapshots_path.read_text().splitlines() if line.endswith("}")]


def window(args, broker, model_dir: Path, schema_file: Path, texts: list[str], logs: Path, tree: Path,
           mode: str, tag: str) -> dict:
    """One measured window of ``tree``'s worker in ``mode`` (light or stages) on ``broker``; see the module
    docstring."""
    bootstrap = broker.bootstrap
    stream = ProbedStream(args, bootstrap, model_dir, schema_file, tag, logs, tree, stages=mode == "stages")
    reader = Reader(bootstrap, stream.topics, args.partitions)
    reader.start()
    stream.start_worker(0)
    try:
        stream.wait_for_group(args.start_timeout)
        warm = [f"w-{i}" for i in range(max(2 * SMALL_CYCLE, int(args.rate * args.warmup_seconds)))]
        produce(bootstrap, stream.topics.states, warm, [texts[i % len(texts)] for i in range(len(warm))], rate=args.rate,
                value_of=json_state)
        if not reader.wait_for(len(warm), args.start_timeout):
            raise SystemExit(f"the worker did not score the warm-up within {args.start_timeout} s; see {logs}")
        ids = [f"m-{i}" for i in range(int(args.rate * args.seconds))]
        started = stream.snapshot("start")
        around = [(machine_cpu_s(), process_cpu_s(broker.process.pid))]
        sampler = raw = None
        if mode == "light":
            raw = logs / f"{tag}-w0.gil.txt"
            sampler = gil_profile.record(stream.workers[0].pid, args.seconds, raw)
        produce(bootstrap, stream.topics.states, ids, [texts[i % len(texts)] for i in range(len(ids))], rate=args.rate,
                value_of=json_state)
        ended = stream.snapshot("end")
        around.append((machine_cpu_s(), process_cpu_s(broker.process.pid)))
        gil = gil_profile.finish(sampler, raw, args.seconds, ENGINE_FRAMES) if mode == "light" else None
        produced_s = ended["monotonic"] - started["monotonic"]
        all_visible = reader.wait_for(len(warm) + len(ids), 120)
        lag_s = time.time() - ended["wall"]
        time.sleep(0.5)                                       # a duplicate would show up by now
    finally:
        reader.halt.set()
        stream.stop()
    probe = next(s for s in stream.read_snapshots() if s["name"] == "started")
    events = [e for e in read_log_events(stream.log_path(0))
              if e["event"] == "committed" and started["wall"] < e["t"] <= ended["wall"] and committed_records(e)]
    result = dict(tree=str(tree), mode=mode, offered_states_per_s=args.rate, window_s=round(produced_s, 3),
                  all_visible=all_visible, drained_after_window_s=round(lag_s, 2), engine=probe["engine"],
                  device_ms=probe["device_ms"], **costs(started, ended, events, probe), **exactly_once(reader, warm + ids))
    result["committed_states_per_s"] = round(result["states"] / produced_s, 1) if produced_s else None
    result.update(beside(around, result["states"], produced_s))
    result["sustained"] = bool(all_visible and result["committed_states_per_s"] >= 0.95 * args.rate)
    if gil is not None:
        result["gil"] = gil
    return result


def window_order(trees: list[str], reps: int) -> list[tuple[int, int, str]]:
    """(repetition, tree's index, tree) in the order the windows run: each repetition starts at another tree, since a
    run's later windows cost the worker more than its first (module docstring)."""
    return [(rep, t, tree) for rep in range(reps) for t, tree in rotated(list(enumerate(trees)), rep)]


def beside(around: list, states_n: int, seconds: float) -> dict:
    """What ran beside the worker over the window, from ``around``'s ((machine busy, steal), broker CPU) seconds at its
    start and end: the broker's CPU per state, and the cores this whole machine kept busy (and lost to steal). On
    this project's 2-core machine the broker takes a core's share of the worker's, and a worker's CPU clocks run
    longer for the same work where the machine is busier."""
    ((busy0, steal0), broker0), ((busy1, steal1), broker1) = around
    return dict(broker_cpu_us_per_state=round((broker1 - broker0) / states_n * 1e6, 1) if states_n else None,
                machine_busy_cores=round((busy1 - busy0) / seconds, 2) if seconds else None,
                machine_steal_cores=round((steal1 - steal0) / seconds, 3) if seconds else None)


def costs(started: dict, ended: dict, events: list[dict], probe: dict) -> dict:
    """What the window between two snapshots cost: CPU by thread, by stage (where wrapped), per state and per cycle,
    with the engine's forward taken out; and the cycles' close -> launch."""
    states_n = sum(committed_records(e) for e in events)
    cycles_n = len(events)
    before = {int(tid): v for tid, v in started["threads"].items()}
    by_thread: dict[str, float] = {}
    python_ns = native_ns = 0
    for tid, (group, is_python, ns) in ended["threads"].items():
        spent = ns - before.get(int(tid), (group, is_python, 0))[2]
        name = group if is_python else (NATIVE if group.startswith("rdk:") else f"native:{group}")
        by_thread[name] = by_thread.get(name, 0) + spent
        if is_python:
            python_ns += spent
        else:
            native_ns += spent
    stages = stage_deltas(started, ended)
    forward_ns = sum(ns for (group, stage), (ns, _) in stages.items() if stage == "forward")
    forward_calls = sum(calls for (group, stage), (_, calls) in stages.items() if stage == "forward")
    host_ns = python_ns + native_ns - forward_ns
    per_state = lambda ns: round(ns / states_n / 1000, 2) if states_n else None  # noqa: E731
    per_cycle = lambda ns: round(ns / cycles_n / 1000, 2) if cycles_n else None  # noqa: E731
    gpu = next((g for g in by_thread if g.startswith("decider-gpu")), None)
    if gpu:
        by_thread[gpu] -= forward_ns                          # the GPU thread's host part
    out = dict(states=states_n, cycles=cycles_n, states_per_cycle=round(states_n / cycles_n, 2) if cycles_n else None,
               host_us_per_state=per_state(host_ns), host_us_per_cycle=per_cycle(host_ns),
               python_host_us_per_state=per_state(python_ns - forward_ns),
               native_client_us_per_state=per_state(native_ns),
               engine_forward_us_per_state=per_state(forward_ns), engine_forwards=forward_calls,
               by_thread_us_per_state={name: per_state(ns) for name, ns in sorted(by_thread.items(), key=lambda kv: -kv[1])
                                       if ns > 0.001 * max(host_ns, 1)},
               cycle=cycle_costs(events))
    if probe.get("stages_installed"):
        out["stages"] = stage_table(stages, by_thread, probe["overhead"], states_n, cycles_n, forward_ns, gpu)
        out["wrapper_overhead_ns"] = probe["overhead"]
        out["missing_stages"] = probe["missing"]
    return out


def stage_deltas(started: dict, ended: dict) -> dict[tuple[str, str], tuple[int, int]]:
    """(thread group, stage) -> (CPU ns, calls) between two snapshots."""
    before = {(g, s): (ns, calls) for g, s, ns, calls in started["stages"]}
    return {(g, s): (ns - before.get((g, s), (0, 0))[0], calls - before.get((g, s), (0, 0))[1])
            for g, s, ns, calls in ended["stages"]}


def stage_table(stages: dict, by_thread: dict[str, float], overhead: dict, states_n: int, cycles_n: int,
                forward_ns: int, gpu: str | None) -> list[dict]:
    """One row per (thread, stage), and per thread its time outside every stage (``other``); largest first."""
    rows = []
    in_stages: dict[str, float] = {}
    for (group, stage), (ns, calls) in stages.items():
        if stage == "forward" or not states_n:
            continue
        in_stages[group] = in_stages.get(group, 0) + ns
        corrected = max(0.0, ns - calls * overhead["self_ns"])
        rows.append(dict(thread=group, stage=stage, us_per_state=round(ns / states_n / 1000, 2),
                         us_per_state_corrected=round(corrected / states_n / 1000, 2),
                         us_per_cycle=round(ns / cycles_n / 1000, 2) if cycles_n else None,
                         calls_per_state=round(calls / states_n, 2)))
    for group, ns in by_thread.items():
        if not states_n or group == NATIVE or group.startswith("native:"):
            continue
        rest = ns - in_stages.get(group, 0)
        if abs(rest) > 0.001 * states_n * 1000:
            rows.append(dict(thread=group, stage="other", us_per_state=round(rest / states_n / 1000, 2),
                             us_per_state_corrected=round(rest / states_n / 1000, 2),
                             us_per_cycle=round(rest / cycles_n / 1000, 2) if cycles_n else None, calls_per_state=None))
    return sorted(rows, key=lambda r: -r["us_per_state"])


def cycle_costs(events: list[dict]) -> dict:
    """Close -> launch of the window's cycles of at most SMALL_CYCLE states (median, p90), with its parts' medians."""
    small = [e for e in events if e.get("launched_ms") is not None and e.get("closed_ms") is not None
             and committed_records(e) <= SMALL_CYCLE]
    if not small:
        return {"small_cycles": 0}
    spans = sorted(e["launched_ms"] - e["closed_ms"] for e in small)
    parts = cycle_timelines(small, budget_ms=float("inf"))["all"]
    return {"small_cycles": len(small), "close_to_launch_p50_ms": round(statistics.median(spans), 3),
            "close_to_launch_p90_ms": round(spans[int(0.9 * (len(spans) - 1))], 3),
            **{k: v for k, v in parts.items() if k.endswith("_ms") and k not in ("to_close_ms",)}}


SUMMARY_KEYS = ("host_us_per_state", "host_us_per_cycle", "python_host_us_per_state", "native_client_us_per_state",
                "states_per_cycle", "committed_states_per_s", "broker_cpu_us_per_state", "machine_busy_cores")


def summary(runs: list[dict], trees: list[str]) -> dict:
    """Per tree, the median over its repetitions of the headline figures (light mode), the GIL's shares and the
    close -> launch; the stage table of its first stages window; with two trees, ratios (second / first)."""
    out = {}
    for tree in trees:
        light = [r for r in runs if r["tree"] == tree and r["mode"] == "light"]
        staged = [r for r in runs if r["tree"] == tree and r["mode"] == "stages"]
        med = lambda values: round(statistics.median(values), 3) if values else None  # noqa: E731
        row = {k: med([r[k] for r in light if r.get(k) is not None]) for k in SUMMARY_KEYS}
        row["gil_non_engine_share"] = med([r["gil"]["non_engine_share"] for r in light
                                           if r.get("gil", {}).get("non_engine_share") is not None])
        row["gil_held_share"] = med([r["gil"]["gil_held_share"] for r in light
                                     if r.get("gil", {}).get("gil_held_share") is not None])
        row["close_to_launch_p50_ms"] = med([r["cycle"]["close_to_launch_p50_ms"] for r in light + staged
                                             if r["cycle"].get("close_to_launch_p50_ms") is not None])
        row["sustained"] = all(r["sustained"] for r in light) if light else None
        row["exactly_once"] = all(r["ok"] for r in light + staged)
        row["windows"] = len(light) + len(staged)
        if staged:
            row["stages"] = staged[0]["stages"]
        out[tree] = row
    if len(trees) == 2:
        a, b = out[trees[0]], out[trees[1]]
        out["ratios"] = {k: round(b[k] / a[k], 3) for k in (*SUMMARY_KEYS, "gil_non_engine_share", "gil_held_share",
                                                           "close_to_launch_p50_ms")
                         if isinstance(a.get(k), (int, float)) and isinstance(b.get(k), (int, float)) and a[k]}
    return out


def write_plot(result: dict, out: Path) -> None:
    """The PNG beside the JSON (`bench/host_cost_plot.py`), or a line saying how to render it where matplotlib is
    missing."""
    try:
        print("wrote", host_cost_plot.plot(result, out.with_suffix(".png")), flush=True)
    except ImportError:
        print("matplotlib is not installed here: render the PNG with python bench/host_cost.py --plot", out, flush=True)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plot", default=None, metavar="JSON",
                    help="render the PNG of an earlier result (its JSON) and exit; nothing is measured")
    ap.add_argument("--trees", default=str(REPO), help="comma-separated checkouts whose worker is measured, in turn")
    ap.add_argument("--reps", type=int, default=1, help="windows per tree and mode (the trees alternate)")
    ap.add_argument("--modes", default="light,stages", help="light (totals and the GIL), stages (by stage), or both")
    ap.add_argument("--rate", type=float, default=1000.0, help="offered states/s")
    ap.add_argument("--seconds", type=float, default=10.0, help="measured window")
    ap.add_argument("--warmup-seconds", type=float, default=3.0)
    ap.add_argument("--engine", choices=("stand-in", "tiny"), default="stand-in")
    ap.add_argument("--device-ms", default="2.3,0.45", help="with --engine stand-in: a batch of n states takes A + B x n ms, or n:ms,... "
                    "(a GPU's measured batch times)")
    ap.add_argument("--max-batch", type=int, default=128)
    ap.add_argument("--latency-budget-ms", type=int, default=25)
    ap.add_argument("--max-wait-ms", type=int, default=None, help="default: the budget")
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--state-tokens", type=int, default=128)
    ap.add_argument("--questions", type=int, default=10)
    ap.add_argument("--options", type=int, default=4)
    ap.add_argument("--prefix-tokens", type=int, default=400)
    ap.add_argument("--start-timeout", type=float, default=180)
    add_broker_option(ap)
    ap.add_argument("--out", default=None, help="the JSON result (default bench/results/DATE-cpu-host-cost.json)")
    args = ap.parse_args(argv)
    if args.plot:
        try:
            result = json.loads(Path(args.plot).read_text())
        except (OSError, ValueError) as exc:
            ap.error(f"--plot {args.plot}: not a host_cost.py result ({exc})")
        if not {"env", "summary", "runs"} <= set(result):
            ap.error(f"--plot {args.plot}: not a host_cost.py result (no env, summary and runs)")
        write_plot(result, Path(args.plot))
        return result
    args.max_wait_ms = args.max_wait_ms or args.latency_budget_ms
    args.device, args.workers, args.gpus = "cpu", 1, 1
    trees = [str(Path(t).resolve()) for t in args.trees.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    if not set(modes) <= {"light", "stages"}:
        ap.error(f"--modes: light and/or stages, not {args.modes!r}")
    for tree in trees:
        if not (Path(tree) / "worker" / "cli" / "app.py").is_file():
            ap.error(f"--trees: {tree} is not a decider checkout (no worker/cli/app.py)")

    from engine.testing import write_tiny_model
    from transformers import AutoTokenizer

    from bench.stream_bench import schema_document

    root = Path(tempfile.mkdtemp(prefix="decider-host-cost-"))
    logs = root / "logs"
    logs.mkdir()
    model_dir = write_tiny_model(root / "model", seed=0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    schema_file = root / "schema.json"
    schema_file.write_text(json.dumps(schema_document(tok, args.questions, args.options, args.prefix_tokens)))
    texts = states(tok, 64, args.state_tokens, seed=3)
    env = dict(date=datetime.date.today().isoformat(), machine=f"{os.cpu_count()} CPUs", broker=args.broker,
               engine=args.engine, device_ms=args.device_ms, offered_states_per_s=args.rate, seconds=args.seconds,
               max_batch=args.max_batch, latency_budget_ms=args.latency_budget_ms, max_wait_ms=args.max_wait_ms,
               partitions=args.partitions, questions=args.questions, options=args.options,
               state_tokens=args.state_tokens, input="json", output="avro", logs=str(logs))
    print(json.dumps(env), flush=True)
    runs = []
    with bench_broker(args.broker, logs) as broker:
        for rep, t, tree in window_order(trees, args.reps):
            for mode in modes:
                run = window(args, broker, model_dir, schema_file, texts, logs, Path(tree), mode, f"hc{rep}t{t}{mode[0]}")
                runs.append(run)
                print(json.dumps({k: v for k, v in run.items() if k not in ("stages", "gil")}), flush=True)
    result = {"env": env, "summary": summary(runs, trees), "runs": runs}
    out = Path(args.out) if args.out else REPO / "bench" / "results" / f"{env['date']}-cpu-host-cost.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result["summary"], indent=1), flush=True)
    write_plot(result, out)
    return result


if __name__ == "__main__":
    main()
