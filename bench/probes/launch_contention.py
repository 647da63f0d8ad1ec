"""The worker's launch of a cycle, on its own GPU thread, with and without what runs beside it in a worker (GPU only;
`--quick`: the tiny model on the CPU, for the test).

    python bench/probes/launch_contention.py --batches 1,6,16 [--iters 300]

Issue 46's capacity runs (run DS) measured the GPU thread's own CPU from taking a cycle to its launch at 0.38-0.56 ms
a cycle of 5-8 states (`launch_cpu_ms`), where one synchronous step's host time is 0.13-0.22 ms (`host_probe.py`).
What does the stream add? Each mode scores the same batch through the worker's own `Scorer` (its GPU thread gathers
the rows and launches, its collector thread waits for the scores and reads them), `--iters` cycles:

  sync        the next cycle is submitted once the one before it is read: the GPU thread launches alone
  pipelined   two cycles in flight, as in a worker under load: the GPU thread launches while the collector waits on the
              batch ahead (a CUDA event's `synchronize`, which spins on a core with CUDA's default scheduling)
  blocking    the done-events made with `blocking=True`: the collector's wait sleeps in the driver
  python      a thread beside them holds the GIL in pure Python in slices of --python-slice-us with as long asleep
              after each, as the worker's loop does between its blocking calls

Per mode, p50 (p90) of: `cpu` the GPU thread's CPU from taking the cycle to its launch (the worker's `launch_cpu_ms`),
`launch` the same span's wall time, `to_read` from the launch to the scores read (in `sync`, an idle GPU's step and
the collector's wake-up: what blocking events add), and the cycles a second. `--profile MODE` then runs MODE once more
under cProfile: the CPU by function (the profiler's own cost inflates every figure alike; from Python 3.12 cProfile
sees every thread, so profile `sync`, where the GPU thread runs alone). `--api-profile` then runs `sync` once more
under torch's profiler: the host's time in each torch op and CUDA runtime call (the graph's launch, the copies, the
pinned allocations, the events), which cProfile sees only as the Python call around them. `--pieces` then runs
`sync` once more with no profiler, a clock around each step of the launch's path (`PIECES`, inclusive of what each
calls): the GPU thread's wall and CPU per cycle in each, where a profiler's cost per call would blur them.
`--variant NAME:module.ATTR=value` (as `bench/probes/variant_ab.py` takes it) times `sync` as the code is and under each
variant's settings in turn, `--rounds` times, each round starting one arm later (`--modes sync` leaves out the other
modes), e.g. `--modes sync --variant "loop:engine.label_mass.ORDERED_MASS_KERNEL=False"`.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import threading
import time
from concurrent.futures import Future
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.host_stages import wrap_attribute  # noqa: E402
from bench.probes.host_probe import batch_sizes  # noqa: E402
from bench.ab_order import rotated  # noqa: E402
from bench.probes.variant_ab import parse_variant, patched  # noqa: E402
from bench.workload import build_engine, questions, states  # noqa: E402
from engine import SchemaEngine  # noqa: E402
from worker.stream.scorer import BatchJob, Scorer  # noqa: E402

PIECES = ("worker.stream.scorer:Scorer._gather", "worker.stream.scorer:last_job_times",
          "engine.schema_engine:SchemaEngine.graph_stats", "engine.schema_engine:SchemaEngine.launch_mixed",
          "engine.schema_engine:SchemaEngine._launch_requests", "engine.schema_engine:SchemaEngine._score_step",
          "engine.step_layout:StepLayout.stage", "engine.graphs:GraphManager.run", "engine.capture:CapturedStep.replay",
          "torch.cuda.graphs:CUDAGraph.replay", "engine.schema_engine:SchemaEngine._record_done")
"""The launch path's steps `--pieces` times, as module:qualified name (nested ones include what they call)."""

MODES = ("sync", "sync+blocking", "pipelined", "pipelined+blocking", "pipelined+python", "pipelined+python+blocking")
"""Each a `+`-joined set of: `sync` or `pipelined` (one or two cycles in flight), `blocking`, `python`."""


@contextmanager
def blocking_events():
    """`SchemaEngine`'s done-events made with `blocking=True` (cudaEventBlockingSync) while the block runs."""
    record = SchemaEngine._record_done

    def blocking(self):
        if self.e.dev.type != "cuda":
            return None
        event = torch.cuda.Event(blocking=True)
        event.record()
        return event
    SchemaEngine._record_done = blocking
    try:
        yield
    finally:
        SchemaEngine._record_done = record


@contextmanager
def python_load(slice_s: float):
    """A thread holding the GIL in pure Python for `slice_s`, then asleep as long, until the block ends."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            until = time.perf_counter() + slice_s
            while time.perf_counter() < until:
                pass
            time.sleep(slice_s)
    thread = threading.Thread(target=spin, name="python-load", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def done(value) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def cycles(scorer: Scorer, handle, rows, iters: int, in_flight: int) -> dict[str, list[float]]:
    """`iters` cycles of `rows` through `scorer.submit`, at most `in_flight` of them submitted and not read: per cycle
    its GPU thread's CPU and wall from taking it to its launch, and from its launch to its scores read (seconds)."""
    slots = threading.Semaphore(in_flight)
    launched: list = []
    read_at: dict[int, float] = {}
    futures = []
    started = time.perf_counter()
    for i in range(iters):
        slots.acquire()
        job = BatchJob(done(handle), [done(row) for row in rows])
        future = scorer.submit([job], on_launched=launched.append)
        future.add_done_callback(lambda f, i=i: (read_at.__setitem__(i, time.monotonic()), slots.release()))
        futures.append(future)
    for future in futures:
        future.result()
    wall = time.perf_counter() - started
    return {"cpu": [t.cpu_s for t in launched], "launch": [t.launched_at - t.taken_at for t in launched],
            "to_read": [read_at[i] - t.launched_at for i, t in enumerate(launched)], "wall": [wall]}


def summary(samples: dict[str, list[float]], iters: int) -> dict[str, float]:
    """p50 and p90 microseconds of each span, and cycles a second."""
    def quantiles(values: list[float]) -> tuple[float, float]:
        ordered = sorted(values)
        return round(ordered[len(ordered) // 2] * 1e6, 1), round(ordered[int(len(ordered) * 0.9)] * 1e6, 1)
    out = {}
    for name in ("cpu", "launch", "to_read"):
        out[f"{name}_us_p50"], out[f"{name}_us_p90"] = quantiles(samples[name])
    out["cycles_per_s"] = round(iters / samples["wall"][0], 1)
    return out


@contextmanager
def mode_context(mode: str, slice_s: float):
    parts = mode.split("+")
    with blocking_events() if "blocking" in parts else nullcontext():
        with python_load(slice_s) if "python" in parts else nullcontext():
            yield


def profiled(scorer: Scorer, handle, rows, iters: int, mode: str, slice_s: float, top: int = 30) -> str:
    """cProfile's table, by own time, of the GPU thread over `iters` cycles of `mode`."""
    profiler = cProfile.Profile()
    scorer._gpu.submit(profiler.enable).result()        # cProfile hooks the thread that enables it
    with mode_context(mode, slice_s):
        cycles(scorer, handle, rows, iters, 1 if mode.startswith("sync") else 2)
    scorer._gpu.submit(profiler.disable).result()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def api_profiled(scorer: Scorer, handle, rows, iters: int, top: int = 25) -> str:
    """torch.profiler's table, by self CPU time, of `iters` `sync` cycles: torch ops and CUDA runtime calls."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    prof = profile(activities=activities)
    scorer._gpu.submit(prof.__enter__).result()         # torch's profiler records the ops of the thread that starts it
    cycles(scorer, handle, rows, iters, 1)
    scorer._gpu.submit(prof.__exit__, None, None, None).result()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)


@contextmanager
def piece_clocks(names=PIECES, thread: int | None = None):
    """Wrap each `module:Class.attr` (or `module:function`) with a clock -> {name: [(wall s, thread CPU s) a call]},
    calls made on `thread` (None: any) only; the originals put back on exit."""
    spans: dict[str, list[tuple[float, float]]] = {name: [] for name in names}

    def clock(calls: list):
        def wrap(function):
            def clocked(*a, **k):
                if thread is not None and threading.get_ident() != thread:
                    return function(*a, **k)
                wall, cpu = time.perf_counter(), time.thread_time()
                try:
                    return function(*a, **k)
                finally:
                    calls.append((time.perf_counter() - wall, time.thread_time() - cpu))
            return clocked
        return wrap

    undo = []
    try:
        for name in names:
            module_name, path = name.split(":")
            restore = wrap_attribute(module_name, path, clock(spans[name]))
            if restore is None:
                raise LookupError(f"{name}: no such function to clock")
            undo.append(restore)
        yield spans
    finally:
        for restore in reversed(undo):
            restore()


def pieces(scorer: Scorer, handle, rows, iters: int) -> list[dict]:
    """`iters` `sync` cycles with `piece_clocks` on the GPU thread: per piece, its calls, wall and CPU microseconds a
    cycle (means over the cycles), then the launch's own CPU and wall (`summary`)."""
    gpu_thread = scorer._gpu.submit(threading.get_ident).result()
    with piece_clocks(thread=gpu_thread) as spans:
        samples = cycles(scorer, handle, rows, iters, 1)
    out = [{"piece": name, "calls_a_cycle": round(len(calls) / iters, 2),
            "wall_us_a_cycle": round(sum(w for w, _ in calls) / iters * 1e6, 1),
            "cpu_us_a_cycle": round(sum(c for _, c in calls) / iters * 1e6, 1)} for name, calls in spans.items()]
    out.append({"piece": "launch (taken -> launched)", **summary(samples, iters)})
    return out


def variant_rows(scorer: Scorer, handle, rows, iters: int, rounds: int, variants: list) -> list[dict]:
    """`sync` cycles as the code is (`base`) and under each variant's settings, in turn, `rounds` times (none without
    variants): a row each, with the launch's `summary`."""
    out, arms = [], [("base", [])] + variants
    for round_ in range(rounds if variants else 0):
        for name, patches in rotated(arms, round_):
            with patched(patches):
                samples = cycles(scorer, handle, rows, iters, 1)
            out.append({"round": round_, "mode": "sync", "variant": name, **summary(samples, iters)})
    return out


def modes_of(text: str) -> list[str]:
    """--modes: comma-separated names of MODES."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown mode(s) {', '.join(unknown)}; choose from {', '.join(MODES)}")
    return modes


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default=[1, 6, 16], type=batch_sizes, help="comma-separated batch sizes")
    ap.add_argument("--state-tokens", type=int, default=128)
    ap.add_argument("--iters", type=int, default=300, help="cycles a mode (default 300)")
    ap.add_argument("--rounds", type=int, default=2, help="the modes in turn, this many times")
    ap.add_argument("--python-slice-us", type=float, default=200.0)
    ap.add_argument("--profile", default=None, choices=MODES, metavar="MODE",
                    help="then MODE again with the GPU thread under cProfile: its CPU by function")
    ap.add_argument("--api-profile", action="store_true",
                    help="then `sync` again under torch's profiler: host time by torch op and CUDA runtime call")
    ap.add_argument("--pieces", action="store_true",
                    help="then `sync` again with a clock around each step of the launch's path (PIECES)")
    ap.add_argument("--modes", default=list(MODES), type=modes_of, help="comma-separated modes (default: all)")
    ap.add_argument("--variant", action="append", default=[], type=parse_variant,
                    help="then `sync` under each and as the code is, the order rotated each of --rounds: NAME:module.ATTR=literal[;...] "
                         "(bench/probes/variant_ab.py's format; a setting read at each launch takes effect at once)")
    ap.add_argument("--quick", action="store_true", help="the tiny model on the CPU (no CUDA events)")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    if not args.quick and not torch.cuda.is_available():
        raise SystemExit("launch_contention.py times CUDA launches: run it on a GPU machine, or with --quick")
    args.device, args.dtype = ("cpu", "float32") if args.quick else ("cuda", "bfloat16")
    eng, _ = build_engine(args)
    se = SchemaEngine(eng)
    h = se.prepare(questions(eng.tok, 10, 4, 400 if not args.quick else 60))
    scorer = Scorer(se, memory_budget=2**34)
    rows_out = []
    try:
        for batch in args.batches:
            rows = [se.tokenize(h, s) for s in states(eng.tok, batch, args.state_tokens, 0)]
            cycles(scorer, h, rows, 10, 2)                          # the batch's graph captured before any timing
            for round_ in range(args.rounds):
                for mode in args.modes:
                    with mode_context(mode, args.python_slice_us / 1e6):
                        samples = cycles(scorer, h, rows, args.iters, 1 if mode.startswith("sync") else 2)
                    row = {"batch": batch, "round": round_, "mode": mode, **summary(samples, args.iters)}
                    print(json.dumps(row), flush=True)
                    rows_out.append(row)
            for row in variant_rows(scorer, h, rows, args.iters, args.rounds, args.variant):
                row = {"batch": batch, **row}
                print(json.dumps(row), flush=True)
                rows_out.append(row)
            if args.profile:
                print(f"=== batch {batch}, {args.profile}: the GPU thread under cProfile, {args.iters} cycles")
                print(profiled(scorer, h, rows, args.iters, args.profile, args.python_slice_us / 1e6), flush=True)
            if args.api_profile:
                print(f"=== batch {batch}, sync: torch ops and CUDA runtime calls, {args.iters} cycles")
                print(api_profiled(scorer, h, rows, args.iters), flush=True)
            if args.pieces:
                print(f"=== batch {batch}, sync: the launch's path by piece, {args.iters} cycles")
                for row in pieces(scorer, h, rows, args.iters):
                    print(json.dumps({"batch": batch, **row}), flush=True)
                    rows_out.append({"batch": batch, **row})
    finally:
        scorer.close()
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows_out}, default=str))
    return rows_out


if __name__ == "__main__":
    main()
