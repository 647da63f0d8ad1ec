"""Where a synchronous cached_graphs step's latency goes, host against device (GPU only).

    python bench/probes/host_probe.py --batches 1,8 [--iters 50] [--set engine.model.ANSWER_QUERIES_MIN_ROWS=2]

Each step is `SchemaEngine.launch_mixed(...).result()` on an idle GPU, as `engine_bench.py`'s cached_graphs times it,
with host clocks and CUDA events around the graph's replay (`engine.graphs.CapturedStep.replay`, wrapped here):

  prepare     from the call to the replay's first copy (rows, the staging buffer): the GPU has nothing to do yet
  launch      the replay call on the host (the input copy and the graph's launch)
  device      from the input copy's start to the step's last copy on the device (CUDA events)
  after       from the device's end to the scores in Python lists (the wait's wake-up, tolist)
  wall        the whole call (p50 of each, in microseconds)

`device` against `engine_bench.py`'s pipelined p50 says how much of a step the graph itself takes.

`--profile N` then runs N more steps of each batch under cProfile and prints the functions with the most time of
their own: which Python and which torch or CUDA calls make up `prepare` and `launch` (the part of a worker's close ->
launch that is the engine's, issue 46).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.engine_bench import parse_setting  # noqa: E402
from bench.workload import build_engine, questions, states  # noqa: E402
from bench.probes.variant_ab import patched  # noqa: E402
from engine import SchemaEngine  # noqa: E402
from engine.graphs import CapturedStep  # noqa: E402


class ReplayMarks:
    """Host times and CUDA events around each graph replay of the step being timed."""

    def __init__(self) -> None:
        self.copy_started = torch.cuda.Event(enable_timing=True)
        self.host_copy_at = self.host_replayed_at = 0.0
        self._replay = CapturedStep.replay

    def __enter__(self) -> "ReplayMarks":
        marks = self

        def replay(step, *values):
            marks.host_copy_at = time.perf_counter()
            marks.copy_started.record()
            out = marks._replay(step, *values)
            marks.host_replayed_at = time.perf_counter()
            return out
        CapturedStep.replay = replay
        return self

    def __exit__(self, *exc) -> None:
        CapturedStep.replay = self._replay


def probe(se: SchemaEngine, requests, iters: int) -> dict[str, float]:
    """p50 microseconds of each part of a synchronous step over `iters` steps (after 5 untimed ones)."""
    parts: dict[str, list[float]] = {k: [] for k in ("prepare", "launch", "device", "after", "wall")}
    done = torch.cuda.Event(enable_timing=True)
    with ReplayMarks() as marks:
        for i in range(iters + 5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            pending = se.launch_mixed(requests)
            done.record()
            pending.result()
            t1 = time.perf_counter()
            if i < 5:
                continue
            device_s = marks.copy_started.elapsed_time(done) / 1000
            parts["prepare"].append(marks.host_copy_at - t0)
            parts["launch"].append(marks.host_replayed_at - marks.host_copy_at)
            parts["device"].append(device_s)
            parts["after"].append(t1 - t0 - (marks.host_copy_at - t0) - device_s)
            parts["wall"].append(t1 - t0)
    return {k: round(statistics.median(v) * 1e6, 1) for k, v in parts.items()}


def profile(se: SchemaEngine, requests, steps: int, rows: int = 30) -> str:
    """cProfile's table of `steps` synchronous steps (the wait for the device excluded: it is not host work), sorted
    by each function's own time."""
    profiler = cProfile.Profile()
    for _ in range(steps):
        torch.cuda.synchronize()
        profiler.enable()
        pending = se.launch_mixed(requests)
        profiler.disable()
        pending.result()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(rows)
    return text.getvalue()


def batch_sizes(text: str) -> list[int]:
    """"1,8" -> [1, 8]; anything else is a usage error (exit 2) before a model is built."""
    try:
        sizes = [int(b) for b in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return sizes


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default=[1, 8], type=batch_sizes, help="comma-separated batch sizes (default 1,8)")
    ap.add_argument("--state-tokens", type=int, default=128)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--set", action="append", default=[], type=parse_setting, dest="settings",
                    help="module.ATTR=literal, held for the whole run")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="then N steps of each batch under cProfile: the launch's host time by function")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("host_probe.py times a CUDA graph's replay: run it on a GPU machine")
    args.quick, args.device, args.dtype = False, "cuda", "bfloat16"
    eng, _ = build_engine(args)
    rows = []
    with patched(args.settings):
        se = SchemaEngine(eng)
        h = se.prepare(questions(eng.tok, 10, 4, 400))
        for batch in args.batches:
            requests = [(h, se.tokenize(h, s)) for s in states(eng.tok, batch, args.state_tokens, 0)]
            row = {"batch": batch, **probe(se, requests, args.iters)}
            print(json.dumps(row), flush=True)
            rows.append(row)
            if args.profile:
                print(f"=== batch {batch}: {args.profile} launches under cProfile (host time, the device's excluded)")
                print(profile(se, requests, args.profile), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"settings": [list(map(str, s)) for s in args.settings], "rows": rows}))
    return rows


if __name__ == "__main__":
    main()
