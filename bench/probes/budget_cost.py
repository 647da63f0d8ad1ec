"""What the latency budget's learning costs the loop a commit, on this CPU (issue 46: the loop's CPU is GIL time the
GPU thread's launch waits behind).

    python bench/probes/budget_cost.py [--commits 3000] [--spacing-ms 4]

Feeds the loop's `CycleBudget.committed` (the estimates, the gathering window, the metrics and the overload watch) the
cycles of a tight budget's stream, one commit every --spacing-ms with 1-8 states, and reports the microseconds a
commit. Run in two checkouts (`cd TREE && PYTHONPATH=TREE python bench/probes/budget_cost.py`) to compare them.

What it showed (2026-12-06, this 2-core machine, five alternations of the two checkouts, the median of three rounds
each): 67-94 us a commit when the gathering window's three least-squares lines were refitted at every commit, 31-54
with `gathering.GATHER_REFRESH_S` (20 ms) between refits, 20-61 us less in every pair.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from concurrent.futures import Future
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from worker.formats.records import SourceRecord  # noqa: E402
from worker.stream.batcher import Cycle, Pending  # noqa: E402
from worker.stream.latency_budget import CycleBudget  # noqa: E402

SIZES = (1, 2, 3, 4, 5, 8)
"""The states of the cycles committed, drawn in turn at random."""


def cycle_of(n_states: int) -> Cycle:
    """A cycle of ``n_states`` states in one schema's batch, as the loop builds it."""
    cycle, done = Cycle(), Future()
    done.set_result(None)
    for offset in range(n_states):
        pending = Pending(SourceRecord("states", 0, offset, b"k", b"v"))
        cycle.track(pending, 0.0)
        cycle.add_to_batch(pending, {"schema_id": "s", "version": 1, "questions": []}, done, done, 0.0)
    return cycle


def commit_costs(commits: int, spacing_s: float, budget_ms: int = 25, seed: int = 0) -> float:
    """Microseconds a commit of the budget's learning, over ``commits`` after as many to warm up."""
    rng = random.Random(seed)
    budget = CycleBudget(budget_ms, budget_ms / 1000, lambda: True)
    cycles = {n: cycle_of(n) for n in SIZES}
    now = 1000.0

    def commit() -> None:
        nonlocal now
        now += spacing_s
        cycle = cycles[rng.choice(SIZES)]
        cycle.arrived_at = now - 0.010      # its first state arrived 10 ms before its commit: within the budget
        budget.committed(cycle, now - 0.006, now - 0.003, now, launched_at=now - 0.005, queued_s=0.0001)

    for _ in range(commits):
        commit()
    started = time.perf_counter()
    for _ in range(commits):
        commit()
    return (time.perf_counter() - started) / commits * 1e6


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--commits", type=int, default=3000)
    ap.add_argument("--spacing-ms", type=float, default=4.0, help="between commits (a 25 ms budget's: 3-6 ms)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    if args.commits < 1 or args.spacing_ms <= 0:
        ap.error("--commits must be at least 1 and --spacing-ms positive")
    costs = [round(commit_costs(args.commits, args.spacing_ms / 1000, seed=r), 1) for r in range(args.rounds)]
    result = {"us_per_commit": costs, "commits": args.commits, "spacing_ms": args.spacing_ms}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
