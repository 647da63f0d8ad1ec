"""The worker process of ``bench/host_cost.py``: ``decider worker`` itself, with its CPU counted by thread and by stage.

    PYTHONPATH=TREE python bench/host_stages.py --out SNAPSHOTS.jsonl [--stages] [--engine stand-in|tiny] -- worker ...

runs the ``decider`` CLI of the tree on PYTHONPATH (the worker, its config, its logs: what ``python -m worker`` runs)
after installing, in that tree's classes:

- **the engine's own compute, timed apart.** The model's forward is the step function ``SchemaEngine._step_fn``
  builds (on the GPU: the captured graph's replay). Its CPU time on the GPU thread is counted as ``forward`` and never
  as host time. ``--engine tiny`` runs the tiny model's forward every step (torch on one thread, so all of its compute
  is on the GPU thread where it is counted); ``--engine stand-in`` (the default) runs the real forward once per step
  shape and afterwards returns that output again, at no cost, and hands the scores to the collector when a GPU would
  have them: a batch of n states is busy ``--device-ms A,B`` (A + B x n ms) after the one ahead of it, the H200's
  t(n) from issue 46 by default. The host path (staging the rows, the launch call, reading the scores back) runs
  unchanged; what changes is that the CPU is free while the "GPU" works, as on the H200, so the loop can be driven at
  the H200's rates (the tiny model's forward on this CPU scores ~45 states/s at 10 questions).
- with ``--stages``, **every stage of the path**: a wrapper around each function of ``STAGES`` reads the calling
  thread's CPU clock (``time.thread_time_ns``) when it is entered and left and charges the time in between to that
  stage, less the stages it called (exclusive time, per thread: a stack per thread). What a thread spends outside
  every stage is its ``other``. Each wrapped call costs about ``calibrate()``'s nanoseconds, reported with the
  snapshots so that the caller can take them off; run without ``--stages`` for exact totals.

Snapshots: a line ``snapshot NAME`` on standard input appends one JSON line to ``--out``: the monotonic and wall
time, every thread's CPU nanoseconds by thread id and name (``bench.thread_cpu.thread_cpu_ns``; Python threads
under their ``threading`` names), the stage totals by thread and stage, and the engine's forward. The difference
between two snapshots is a window's cost.

This file is a script run by the interpreter of the tree under test, so that ``bench/host_cost.py`` can drive the
worker of another checkout (``--trees``): it imports nothing from ``bench`` (the tree under test may not have it).
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import Callable

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)     # run as a script: bench/ itself is no package root; the tree under test is on PYTHONPATH

# (module, Class.method or function, stage). Stages on the loop thread first, then the tokenizer pool, the GPU thread,
# the collector and the committer. A name the tree does not have is skipped (and listed in the snapshot's "missing"):
# the names of before issue 46's cuts and after them are both here, so that two trees can be compared.
STAGES = (
    ("worker.stream.loop", "Worker._step", "loop"),
    ("worker.stream.inflight", "CyclesInFlight.next_message", "wait"),
    ("worker.stream.intake", "Intake.take_fetched", "intake"),
    ("worker.stream.intake", "Intake.take", "intake"),
    ("worker.formats.input_decoder", "SourceDecoder.decode", "decode"),
    ("worker.stream.routing", "Router.route", "route"),
    ("worker.stream.scorer", "Scorer.acquire", "route"),
    ("worker.stream.scorer", "Scorer.tokenize", "tokenize_submit"),
    ("worker.stream.scorer", "Scorer.tokenize_many", "tokenize_submit"),
    ("worker.stream.routing", "Router.flush", "tokenize_submit"),
    ("worker.stream.closing", "CycleClosing.due", "closing_rule"),
    ("worker.stream.closing", "CycleClosing.poll_timeout", "closing_rule"),
    ("worker.stream.loop", "Worker._close_cycle", "close"),
    ("worker.stream.schema_table", "SchemaTable.catch_up_if_answered", "schema_catch_up"),
    ("worker.stream.schema_table", "SchemaTable.poll", "schema_poll"),
    ("worker.stream.inflight", "CyclesInFlight.submit", "submit"),
    ("worker.stream.scorer", "Scorer.submit", "submit"),
    ("worker.stream.loop", "Worker._hand_scored", "hand"),
    ("worker.stream.loop", "Worker._hand", "hand"),
    ("worker.stream.outputs", "Outputs.of_cycle", "records"),
    ("worker.formats.output_formats", "OutputEncoder.encode", "encode"),
    ("worker.formats.probability_avro", "ProbabilityWriter.write", "encode"),
    ("worker.stream.loop", "Worker._take_outcomes", "committed"),
    ("worker.stream.loop", "Worker._committed", "committed"),
    ("worker.ops.logs", "log_event", "log"),
    ("engine.schema_engine", "SchemaEngine.tokenize", "tokenize"),
    ("engine.schema_engine", "SchemaEngine.tokenize_many", "tokenize"),
    ("worker.stream.scorer", "Scorer._launch_jobs", "launch"),
    ("worker.stream.scorer", "Scorer._gather", "gather"),
    ("engine.step_layout", "StepLayout.stage", "pad"),
    ("worker.stream.scorer", "Scorer._collect", "collect"),
    ("engine.scores", "PendingScores.details", "read_back"),
    ("worker.stream.scorer", "Scorer._checked", "check"),
    ("worker.stream.committer", "Committer._commit", "commit"),
    ("worker.stream.transactions", "Transactions._produce", "produce"),
    ("worker.stream.transactions", "Transactions._call", "txn_calls"),
    ("worker.stream.transactions", "Transactions._flush", "flush"),
    ("worker.stream.transactions", "Transactions._on_delivery", "delivery_reports"),
)
BEFORE_46 = {("worker.stream.scorer", "Scorer.tokenize")}
"""Entries of ``STAGES`` that only the worker of before issue 46's cuts has: not reported missing elsewhere."""
FORWARD = "forward"
"""The engine's own compute: never host time."""

_local = threading.local()
_totals: dict[tuple[str, str], list[int]] = {}   # (thread group, stage) -> [ns, calls]; each key written by one thread
_clock = time.thread_time_ns


def thread_group(name: str) -> str:
    """A thread's name without a pool's index: ``decider-tok_1`` -> ``decider-tok``."""
    return re.sub(r"_\d+$", "", name)


_states: dict[int, tuple] = {}   # native thread id -> its (stack, last charge, group), for `_pending` to read


def _thread_state():
    state = getattr(_local, "state", None)
    if state is None:
        state = _local.state = ([], [0], thread_group(threading.current_thread().name))
        _states[threading.get_native_id()] = state
    return state


def _pending(thread_ns: dict[int, int]) -> dict[tuple[str, str], int]:
    """(thread group, stage) -> the CPU its threads have spent in the stage they are in since its last charge, as of
    `thread_ns` (each thread's CPU clock, read by `snapshot`).

    A stage is charged when it is left (or calls another), so a snapshot taken mid-call would leave that call's time so
    far to the next window: the window it straddles the start of then charged it more than its threads spent in the
    window (an ``other`` below 0 where one long call straddled). A snapshot adds it."""
    pending: dict[tuple[str, str], int] = {}
    for tid, (stack, last, group) in list(_states.items()):
        try:
            stage, since, now = stack[-1], last[0], thread_ns[tid]   # the thread may move on: off by that instant
        except (IndexError, KeyError):              # in no stage, or ended
            continue
        pending[(group, stage)] = pending.get((group, stage), 0) + max(0, now - since)
    return pending


def timed(stage: str, fn):
    """``fn`` with its exclusive CPU time on the calling thread charged to ``stage``."""
    def wrapper(*args, **kwargs):
        stack, last, group = _thread_state()
        now = _clock()
        if stack:
            _charge(group, stack[-1], now - last[0], 0)
        stack.append(stage)
        last[0] = now
        try:
            return fn(*args, **kwargs)
        finally:
            now = _clock()
            _charge(group, stack.pop(), now - last[0], 1)
            last[0] = now
    wrapper.__wrapped__ = fn
    wrapper.__name__ = getattr(fn, "__name__", stage)
    wrapper.__qualname__ = getattr(fn, "__qualname__", stage)
    return wrapper


def _charge(group: str, stage: str, ns: int, calls: int) -> None:
    entry = _totals.get((group, stage))
    if entry is None:
        entry = _totals[(group, stage)] = [0, 0]
    entry[0] += ns
    entry[1] += calls


def install(module_name: str, path: str, stage: str) -> bool:
    """Wrap ``module_name``'s ``path`` (``Class.method`` or a function) with ``timed``; False where it is not there."""
    return wrap_attribute(module_name, path, lambda fn: timed(stage, fn)) is not None


def wrap_attribute(module_name: str, path: str, wrap: Callable[[Callable], Callable]) -> Callable[[], None] | None:
    """Replace ``module_name``'s ``path`` (``Class.method``, a static method included, or a function) with
    ``wrap(it)`` -> a callable that puts the original back; None where it is not there."""
    try:
        owner = importlib.import_module(module_name)
    except ImportError:
        return None
    *outer, name = path.split(".")
    for part in outer:
        owner = getattr(owner, part, None)
        if owner is None:
            return None
    raw = inspect.getattr_static(owner, name, None)
    if raw is None:
        return None
    setattr(owner, name, staticmethod(wrap(raw.__func__)) if isinstance(raw, staticmethod) else wrap(raw))
    return lambda: setattr(owner, name, raw)


def install_poll_timer() -> bool:
    """The states consumer's ``poll``: its class is replaced, where the loop makes it, by a subclass whose ``poll``
    is timed (a C type's method cannot be wrapped in place)."""
    try:
        assignment = importlib.import_module("worker.stream.assignment")
    except ImportError:
        return False
    base = assignment.Consumer

    class TimedConsumer(base):
        poll = timed("poll", base.poll)
        consume = timed("poll", base.consume)

    assignment.Consumer = TimedConsumer
    return True


def stand_in_command(device_ms: str, snapshots: Path, cli: list[str], stages: bool = False,
                     engine: str = "stand-in") -> list[str]:
    """The command that runs ``decider`` with ``cli`` under this script: its CPU by thread (and by stage with
    ``stages``) on snapshot commands, its engine's compute timed apart, and with ``engine == "stand-in"`` each batch
    scored in the time ``device_ms`` gives it ("A,B" or "n:ms,...": ``parse_device_ms``; the modelled GPU, the CPU free
    meanwhile)."""
    return [sys.executable, str(Path(__file__).resolve()), "--out", str(snapshots), "--engine", engine, "--device-ms",
            device_ms, *(["--stages"] if stages else []), "--", *cli]


def parse_device_ms(text: str) -> tuple[tuple[float, float], ...]:
    """``--device-ms``: "A,B" (a batch of n states takes A + B x n ms) -> ((0, A), (1, A + B)), a line through two
    points; or measured "n:ms,..." points (the GPU's own batch times: between them a broken line, beyond the last
    two the line through them). ValueError where it is neither."""
    if ":" not in text:
        fixed, per_state = (float(x) for x in text.split(","))
        return ((0.0, fixed), (1.0, fixed + per_state))
    points = tuple(sorted((float(n), float(ms)) for n, ms in (item.split(":") for item in text.split(","))))
    if len(points) < 2 or len({n for n, _ in points}) != len(points):
        raise ValueError(f"--device-ms {text!r}: at least two points of distinct batch sizes")
    return points


def device_ms_at(points: tuple[tuple[float, float], ...], n: float) -> float:
    """The modelled time of a batch of ``n`` on ``parse_device_ms``'s points."""
    (n0, t0), (n1, t1) = next(((a, b) for a, b in zip(points, points[1:]) if n <= b[0]), points[-2:])
    return t0 + (t1 - t0) * (n - n0) / (n1 - n0)


def points_padded(points: tuple[tuple[float, float], ...]) -> bool:
    """Whether ``parse_device_ms``'s points are a GPU's measured batch times (its graphs pad a batch to a bucket)
    rather than a line."""
    return points[0][0] >= 1


def stand_in_batch_ms(points: tuple[tuple[float, float], ...], n_states: int) -> float:
    """The stand-in GPU's time for a batch of ``n_states``: on a line, for the states themselves; on a GPU's measured
    points (real batch sizes), for the engine's batch bucket it is padded to, as its graph would run it."""
    if points_padded(points):
        from engine.buckets import B_BUCKETS, bucket
        n_states = bucket(n_states, B_BUCKETS) or n_states
    return device_ms_at(points, n_states)


def install_engine(engine: str, device_ms: tuple[tuple[float, float], ...]) -> None:
    """Time the engine's forward apart (``FORWARD``); with ``engine == "stand-in"``, replace its compute by its
    first output per step shape, and make the scores of a batch of n states ready ``stand_in_batch_ms(device_ms, n)``
    ms after the batch ahead of it."""
    from engine import scores, schema_engine

    import torch

    build = schema_engine.SchemaEngine._step_fn
    units: dict = {}    # (answers in a row, label mass) -> that row's read-out [answers, columns] from a real forward

    def _step_fn(self, shape, layout, *args, **kwargs):
        step, keep = build(self, shape, layout, *args, **kwargs)
        with_mass = args[-1] if args else None

        def forward(staged):
            if engine != "stand-in":
                return step(staged)
            counts = layout.unstage(staged)[4][1].tolist()          # answers per row, 0 for padding rows
            if any((n, with_mass) not in units for n in counts if n):
                out = step(staged)                                  # once per new row shape: the real read-out
                at = 0
                for n in counts:
                    units.setdefault((n, with_mass), out[at:at + n].clone())
                    at += n
            rows = [units[(n, with_mass)] for n in counts if n]
            answers = torch.cat(rows) if rows else torch.empty(0)
            return torch.cat([answers, answers.new_zeros(layout.A - len(answers), answers.shape[1])])
        return timed(FORWARD, forward), keep

    schema_engine.SchemaEngine._step_fn = _step_fn
    if engine != "stand-in":
        return
    launch, details = schema_engine.SchemaEngine.launch_mixed, scores.PendingScores.details
    device = {"free_at": 0.0}

    def launch_mixed(self, requests):
        pending = launch(self, requests)
        ready_at = max(time.monotonic(), device["free_at"]) + stand_in_batch_ms(device_ms, len(requests)) / 1000
        device["free_at"] = pending.stand_in_ready_at = ready_at
        return pending

    def wait_for_device(self):
        delay = getattr(self, "stand_in_ready_at", 0.0) - time.monotonic()
        if delay > 0:
            time.sleep(delay)         # as the collector waits on a CUDA event: no CPU, no GIL
        return details(self)

    schema_engine.SchemaEngine.launch_mixed = launch_mixed
    scores.PendingScores.details = wait_for_device
    if points_padded(device_ms):      # the modelled GPU runs graphs: --unpadded-batches sees its buckets
        from engine.buckets import unpadded_prefix
        schema_engine.SchemaEngine.unpadded_count = lambda self, schemas: unpadded_prefix([h.P for h in schemas])


def calibrate(calls: int = 20000) -> dict[str, float]:
    """Nanoseconds a wrapped call adds: to its own stage (``self_ns``) and to the stage that called it
    (``parent_ns``), measured on a no-op inside a timed parent, on this thread."""
    def noop():
        return None

    child, key = timed("_calibration_child", noop), (thread_group(threading.current_thread().name), "_calibration_child")

    def parent():
        for _ in range(calls):
            child()

    def bare():
        for _ in range(calls):
            noop()

    outer = timed("_calibration_parent", parent)
    pkey = (key[0], "_calibration_parent")
    t0 = _clock()
    bare()
    bare_ns = _clock() - t0
    outer()
    self_ns = _totals[key][0] / calls
    parent_ns = (_totals[pkey][0] - bare_ns) / calls
    for k in (key, pkey):
        _totals.pop(k, None)
    return {"self_ns": round(self_ns, 1), "parent_ns": round(max(parent_ns, 0.0), 1)}


def snapshot(name: str) -> dict:
    """Every thread's CPU and every stage's total now (see the module docstring)."""
    python_names = {t.native_id: t.name for t in threading.enumerate()}
    threads = {}
    for tid in map(int, os.listdir("/proc/self/task")):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
            ns = time.clock_gettime_ns((~tid << 3) | 6)    # the thread's CPU clock (CPUCLOCK_SCHED | PERTHREAD)
        except OSError:
            continue
        threads[tid] = [thread_group(python_names.get(tid, comm)), tid in python_names, ns]
    return {"name": name, "monotonic": time.monotonic(), "wall": time.time(), "threads": threads,
            "stages": _stage_totals({tid: ns for tid, (_, _, ns) in threads.items()})}


def _stage_totals(thread_ns: dict[int, int]) -> list[list]:
    """[group, stage, ns, calls] of every stage: its charges, and what its threads have spent in it since (`_pending`)."""
    pending = _pending(thread_ns)
    totals = {key: [ns + pending.pop(key, 0), calls] for key, (ns, calls) in list(_totals.items())}
    totals.update({key: [ns, 0] for key, ns in pending.items()})
    return [[group, stage, ns, calls] for (group, stage), (ns, calls) in totals.items()]


def serve_snapshots(out_path: str, extra: dict) -> None:
    """Answer ``snapshot NAME`` lines on standard input until it closes."""
    with open(out_path, "a") as out:
        out.write(json.dumps({"name": "started", **extra}) + "\n")
        out.flush()
        for line in sys.stdin:
            command, _, name = line.strip().partition(" ")
            if command == "snapshot":
                out.write(json.dumps(snapshot(name)) + "\n")
                out.flush()


def main() -> None:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--stages", action="store_true")
    ap.add_argument("--engine", choices=("stand-in", "tiny"), default="stand-in")
    ap.add_argument("--device-ms", default="2.3,0.45")
    args = ap.parse_args(argv[:split])
    device_ms = parse_device_ms(args.device_ms)
    import torch

    torch.set_num_threads(1)    # the forward's compute all on the GPU thread, where FORWARD counts it
    install_engine(args.engine, device_ms)
    missing = []
    if args.stages:
        for module_name, path, stage in STAGES:
            if not install(module_name, path, stage) and (module_name, path) not in BEFORE_46:
                missing.append(f"{module_name}.{path}")
        if not install_poll_timer():
            missing.append("worker.stream.assignment.Consumer")
    extra = {"stages_installed": args.stages, "engine": args.engine, "device_ms": args.device_ms, "missing": missing,
             "overhead": calibrate() if args.stages else None, "pid": os.getpid()}
    threading.Thread(target=serve_snapshots, args=(args.out, extra), name="host-stages-control", daemon=True).start()
    from worker.cli.app import main as decider

    decider(argv[split + 1:])


if __name__ == "__main__":
    main()
