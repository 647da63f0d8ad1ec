"""A time-stepped model of the worker's loop under --latency-budget-ms, driven by the worker's own planner.

What p50/p99 (record timestamp -> visible) can a budget reach at a given rate, given what a batch costs on the GPU?
The planner is the real one (`worker.stream.latency_budget.LatencyBudget`: its estimates, `close_by`, the learned launch
lead); the loop, the GPU and Kafka are modelled, with costs fitted to stream_bench runs' stage means (the defaults:
run V's, bench/README.md):

- states arrive at `--rate` (Poisson); each is consumable `--kafka-ms` (uniform range) after its timestamp;
- the loop consumes what is consumable (up to --max-batch), asks the planner whether to close, and closes: the
  schema catch-up and launch take `--launch-ms` of the loop before the batch is queued on the device;
- the GPU runs batches in order, each `--batch-fixed-ms + --per-row-ms x rows`, rows padded to the engine's graph
  bucket (`engine.buckets.B_BUCKETS`); scores are read `--collect-ms` later;
- the loop's wait ends when a state is consumable (nothing in flight), when the oldest cycle in flight is scored, when
  the planner's close time comes, or after `--poll-ms` (in flight); it commits cycles in order (`--commit-ms` of its
  time) and keeps at most two cycles in flight (it waits for the older one's commit after submitting a new one);
- with `--stalls AT:MS,...` the loop does nothing for MS ms from AT ms on (a collection, a slow broker call): what a
  stall leaves behind, and how fast the planner drains it.

It is a model: use it to compare planner changes side by side, and the GPU to measure them. Example (run V's costs
and rate):

    python bench/probes/budget_model.py --rate 829 --budgets 25,50,100
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import math
import random
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.buckets import B_BUCKETS, bucket  # noqa: E402
from bench.host_stages import device_ms_at  # noqa: E402
import worker.stream.latency_budget  # noqa: E402,F401  (planner_module's default)


@dataclass
class Costs:
    """What the modelled worker's steps take, in ms."""
    batch_fixed_ms: float = 2.4
    per_row_ms: float = 0.5
    kafka_ms: tuple[float, float] = (0.5, 2.0)
    launch_ms: float = 1.05
    collect_ms: float = 0.3
    commit_ms: float = 2.27
    poll_ms: float = 5.0     # the loop's wait for messages while a cycle is in flight (its scores end it sooner)
    batch_ms: tuple[tuple[int, float], ...] = ()  # measured (rows, ms) points: the GPU's time between them, instead
    launch_per_state_ms: float = 0.0   # the launch's part that grows with the batch (gathering, padding)
    launch_jitter_ms: float = 0.0      # a launch's extra time, exponential with this mean (the GIL, the scheduler)
    first_launch_ms: float = 0.0       # the GPU thread busy this long at start (the first schema's graphs)

    def gpu_ms(self, rows: int) -> float:
        """A batch of ``rows`` (padded) rows on the modelled GPU: the line, or the measured points' broken line (an
        engine whose time per state stops falling past some batch, as the H100's does past 32: run CV)."""
        if not self.batch_ms:
            return self.batch_fixed_ms + self.per_row_ms * rows
        return device_ms_at(tuple(sorted(self.batch_ms)), rows)


@dataclass
class _Cycle:
    first: float
    closed: float
    launched: float
    scored: float
    timestamps: list[float] = field(default_factory=list)
    queued: float = 0.0      # its wait for the GPU thread


def planner_module(tree: Path | None):
    """``worker.stream.latency_budget`` of this tree, or of another checkout ``tree`` (a planner A/B in one model)."""
    if tree is None:
        return sys.modules["worker.stream.latency_budget"]
    import importlib.util
    spec = importlib.util.spec_from_file_location(f"planner_{abs(hash(str(tree)))}",
                                                  Path(tree) / "worker/stream/latency_budget.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)   # (its dataclasses look it up there)
    spec.loader.exec_module(module)
    return module


def simulate(rate: float, budget_ms: float, costs: Costs, seconds: float = 20.0, max_batch: int = 128,
             tick_ms: float = 0.25, seed: int = 1, launch_lead: bool = True,
             stalls: tuple[tuple[float, float], ...] = (), planner_tree: Path | None = None) -> dict:
    """One run of the model -> p50/p99 of timestamp -> visible (ms, after the first fifth), the share of states over
    the budget, and the mean batch. ``launch_lead=False``: the planner is not told when batches reach the device (as
    before it learned the launch lead); ``stalls``: (at, ms)
    pairs, the loop held for ms from at."""
    rnd, jitter = random.Random(seed), random.Random(seed + 1)
    arrivals, t = [], 0.0
    while t < seconds * 1000:
        t += rnd.expovariate(rate / 1000)
        arrivals.append((t, t + rnd.uniform(*costs.kafka_ms)))
    module = planner_module(planner_tree)
    planner = module.LatencyBudget(budget_ms / 1000, budget_ms / 1000)
    # what the planner's version takes: the open cycle's size (its lead grows with it), a cycle's wait for the GPU thread
    sized = "n_states" in inspect.signature(planner.close_by).parameters
    queued = "queued_s" in {f.name for f in dataclasses.fields(module.CycleTimes)}
    latencies, batches, idle = [], [], []
    thread_free = costs.first_launch_ms
    inflight: list[_Cycle] = []
    open_states: list[float] = []
    now = busy_until = gpu_free = next_wake = 0.0
    i = 0

    def commit_oldest(at: float) -> float:
        cycle = inflight.pop(0)
        visible = at + costs.commit_ms
        planner.committed(module.CycleTimes(len(cycle.timestamps), cycle.first / 1000, cycle.closed / 1000,
                                            cycle.scored / 1000, visible / 1000,
                                            launched_at=cycle.launched / 1000 if launch_lead else None,
                                            **({"queued_s": cycle.queued / 1000} if queued else {})))
        latencies.extend(visible - ts for ts in cycle.timestamps)
        return visible

    while i < len(arrivals) or open_states or inflight:
        now += tick_ms
        for at, ms in stalls:
            if at <= now < at + tick_ms:
                busy_until = max(busy_until, now + ms)
        if now < busy_until:
            continue
        consumable = i < len(arrivals) and arrivals[i][1] <= now
        scored = bool(inflight) and inflight[0].scored <= now
        # the loop's wait ends on a message while nothing is in flight, else on the oldest cycle's scores
        if now < next_wake and not scored and not (consumable and not inflight):
            continue
        while i < len(arrivals) and arrivals[i][1] <= now and len(open_states) < max_batch:
            open_states.append(arrivals[i][0])
            i += 1
        if scored:
            busy_until = commit_oldest(now)
            continue
        gpu_busy = bool(inflight) and inflight[-1].scored > now
        close_at = math.inf
        if open_states:
            first, n = min(open_states), len(open_states)
            close_at = planner.close_by(now / 1000, first / 1000, gpu_busy, *([n] if sized else [])) * 1000
            if n >= max_batch or now >= close_at or i >= len(arrivals):
                planner.submitted(now / 1000, n, gpu_busy)
                taken = max(now, thread_free)   # the GPU thread takes it once free (at start: preparing a schema)
                launched = taken + costs.launch_ms + costs.launch_per_state_ms * n + (
                    jitter.expovariate(1 / costs.launch_jitter_ms) if costs.launch_jitter_ms else 0.0)
                thread_free = launched
                if inflight and launched > gpu_free and first < gpu_free:
                    idle.append(launched - gpu_free)   # the GPU idle while this cycle's states waited
                gpu_free = max(launched, gpu_free) + costs.gpu_ms(bucket(n, B_BUCKETS))
                inflight.append(_Cycle(first, now, launched, gpu_free + costs.collect_ms, open_states,
                                       queued=taken - now))
                batches.append(n)
                open_states, busy_until = [], launched
                while len(inflight) > 1:
                    busy_until = commit_oldest(max(busy_until, inflight[0].scored))
                continue
        next_wake = min(now + (costs.poll_ms if inflight else 100.0), close_at)
    measured = sorted(latencies[len(latencies) // 5:])
    quantile = lambda q: measured[int(q * (len(measured) - 1))]  # noqa: E731
    return dict(rate=rate, budget_ms=budget_ms, p50_ms=round(quantile(0.5), 1), p99_ms=round(quantile(0.99), 1),
                over_budget=round(sum(x > budget_ms for x in measured) / len(measured), 3),
                mean_batch=round(statistics.mean(batches), 1),
                gpu_idle_ms_a_cycle=round(sum(idle) / len(batches), 3))


def pairs(first: type, second: type):
    """An argparse type for "a:b,c:d" (--batch-ms, --stalls) -> ((first(a), second(b)), ...); anything else is a usage
    error (exit 2)."""
    def parse(text: str) -> tuple[tuple, ...]:
        try:
            return tuple((first(a), second(b)) for a, b in (p.split(":") for p in text.split(",") if p))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated a:b pairs of numbers, got {text!r}") from None
    return parse


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=829.0, help="offered states/s")
    ap.add_argument("--budgets", default="25,50,100", help="comma-separated budgets in ms")
    ap.add_argument("--seconds", type=float, default=20.0, help="modelled seconds of traffic")
    ap.add_argument("--quick", action="store_true", help="2 modelled seconds (a test)")
    ap.add_argument("--no-launch-lead", action="store_true", help="the planner without its learned launch lead")
    defaults = Costs()
    ap.add_argument("--planner-tree", type=Path, default=None,
                    help="another checkout whose worker/stream/latency_budget.py plans (an A/B of planner changes)")
    for name in ("batch_fixed_ms", "per_row_ms", "launch_ms", "collect_ms", "commit_ms", "poll_ms",
                 "launch_per_state_ms", "launch_jitter_ms", "first_launch_ms"):
        ap.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(defaults, name))
    ap.add_argument("--kafka-ms", default="0.5,2", help="min,max ms from a record's timestamp to consumable")
    ap.add_argument("--batch-ms", default=(), type=pairs(int, float),
                    help="rows:ms,... measured batch times (e.g. the H100's, run CV: 1:2.41,8:5.4,32:16.2,128:63.5), "
                    "joined by straight lines, instead of the fixed and per-row costs")
    ap.add_argument("--stalls", default=(), type=pairs(float, float),
                    help="at:ms,... the loop held for ms from at ms (modelled time), e.g. 3000:40,6000:60")
    args = ap.parse_args(argv)
    costs = Costs(args.batch_fixed_ms, args.per_row_ms, tuple(float(x) for x in args.kafka_ms.split(",")),
                  args.launch_ms, args.collect_ms, args.commit_ms, args.poll_ms, args.batch_ms,
                  args.launch_per_state_ms, args.launch_jitter_ms, args.first_launch_ms)
    seconds = 2.0 if args.quick else args.seconds
    results = [simulate(args.rate, float(b), costs, seconds, launch_lead=not args.no_launch_lead,
                        stalls=args.stalls, planner_tree=args.planner_tree)
               for b in args.budgets.split(",")]
    for result in results:
        print(json.dumps(result), flush=True)
    return results


if __name__ == "__main__":
    main()
