"""The stream benchmark's steady-state windows, from the workers' own structured logs (``--log-format json``).

A worker logs each event of its loop as one JSON line with its wall-clock time (``worker.ops.logs``): ``assigned`` /
``revoked`` / ``lost`` with the partitions, ``committed`` with the states it scored and dead-lettered in that
transaction. From those, on the same clock as the benchmark's reader:

- when every worker held partitions, and from when each had committed since its last assignment (its schema
  prepared, its graphs captured): the start of the all-workers window;
- how many records each worker committed inside that window: its own steady rate;
- for ``decider replay``: the time from ``replay_started`` to its first commit (schema preparation, graph capture,
  the first batch) and its rate from the first commit to the last.
"""
from __future__ import annotations

import datetime
import json
import re
from pathlib import Path

_TS_FORMAT = "%Y-%m-%dT%H:%M:%S.%fZ"   # worker.ops.logs.JsonFormatter's ts, UTC
_MEMBERSHIP = ("assigned", "revoked", "lost")


def log_events(text: str) -> list[dict]:
    """The events in a ``--log-format json`` log, each with its wall time as ``t`` (epoch seconds), in order.

    Other lines (a progress bar's carriage-return updates, plain stderr output) are skipped."""
    events = []
    for line in re.split(r"[\r\n]+", text):
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "event" in record and "ts" in record:
            events.append({**record, "t": wall_time(record["ts"])})
    return events


def wall_time(ts: str) -> float:
    """A log line's ``ts`` (``worker.ops.logs.JsonFormatter``, UTC) as epoch seconds."""
    return datetime.datetime.strptime(ts, _TS_FORMAT).replace(tzinfo=datetime.timezone.utc).timestamp()


def read_log_events(path: Path) -> list[dict]:
    """``log_events`` of a log file (none if it does not exist yet)."""
    return log_events(path.read_text(errors="replace")) if path.exists() else []


def held_partitions(events: list[dict]) -> set[int]:
    """The partitions a worker holds after ``events``; a new process (``model_loaded``) starts with none."""
    held: set[int] = set()
    for event in events:
        kind = event["event"]
        if kind == "model_loaded":
            held = set()
        elif kind == "assigned":
            held |= set(event.get("partitions") or [])
        elif kind in ("revoked", "lost"):
            held -= set(event.get("partitions") or [])
    return held


def committed_records(event: dict) -> int:
    """Records (probabilities and dead letters) a ``committed`` event made visible."""
    return int(event.get("scored") or 0) + sum((event.get("dead_letters") or {}).values())


def _lower_median(values):
    """The middle value of ``values`` sorted (the lower of the two middle ones for an even count)."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


def _commits(events: list[dict]) -> list[dict]:
    return [e for e in events if e["event"] == "committed" and committed_records(e)]


def all_workers_window(events_by_worker: list[list[dict]], visible: list[float], lo: float, hi: float) -> dict:
    """The part of the measured window [lo, hi] (wall times) in which every worker was in steady state.

    A worker is steady from its first commit after its last assignment at or before ``hi``: from then on it holds
    partitions and its schema is prepared. The window starts when the last worker is steady (and not before ``lo``)
    and ends at ``hi``. ``visible``: when each output record became visible to the reader. Returns the aggregate
    rate (records visible inside the window per second), each worker's own rate (records it committed inside the
    window per second), the window's length and how much of [lo, hi] it cut, the time between the first and the
    last worker getting partitions at all, and the membership events inside the window (a rebalance there means
    the window is not steady after all). Rates are None when the window is empty."""
    firsts = [next((e["t"] for e in events if e["event"] == "assigned" and e.get("partitions")), None)
              for events in events_by_worker]
    spread = max(firsts) - min(firsts) if firsts and None not in firsts else None
    steady_from = []
    for events in events_by_worker:
        assigned = [e["t"] for e in events if e["event"] == "assigned" and e.get("partitions") and e["t"] <= hi]
        first_commit = next((e["t"] for e in _commits(events) if assigned and e["t"] > assigned[-1]), None)
        steady_from.append(first_commit)
    result = dict(assignment_spread_s=spread, all_workers_window_s=None, all_workers_window_cut_s=None,
                  all_workers_states=0, all_workers_states_per_s=None, per_worker_states_per_s=None,
                  rebalances_in_window=None)
    if None in steady_from or not steady_from:
        return result
    start = max(lo, *steady_from)
    if start >= hi:
        return result
    seconds = hi - start
    inside = sum(1 for t in visible if start < t <= hi)
    per_worker = [sum(committed_records(e) for e in _commits(events) if start < e["t"] <= hi) / seconds
                  for events in events_by_worker]
    membership = sum(1 for events in events_by_worker for e in events
                     if e["event"] in _MEMBERSHIP and start < e["t"] <= hi)
    return {**result, "all_workers_window_s": seconds, "all_workers_window_cut_s": start - lo,
            "all_workers_states": inside, "all_workers_states_per_s": inside / seconds,
            "per_worker_states_per_s": per_worker, "rebalances_in_window": membership}


def replay_timing(events: list[dict]) -> dict:
    """A replay's startup (``replay_started`` to its first commit: schema preparation, graph capture and the first
    batch) and its steady rate: the records committed after the first commit per second until the last commit."""
    started = next((e["t"] for e in events if e["event"] == "replay_started"), None)
    commits = _commits(events)
    result = dict(startup_s=None, first_to_last_commit_s=None, steady_states_per_s=None, commits=len(commits))
    if not commits:
        return result
    first, last = commits[0]["t"], commits[-1]["t"]
    result["startup_s"] = first - started if started is not None else None
    if last > first:
        result["first_to_last_commit_s"] = last - first
        result["steady_states_per_s"] = sum(committed_records(e) for e in commits[1:]) / (last - first)
    return result


def budget_plan_errors(events: list[dict], budget_ms: float, since: float = 0.0) -> dict:
    """Under a latency budget, how the worker's plans came out, over the cycles committed after wall time ``since``:
    per cycle, its first state's arrival-to-visible time minus what the plan expected when the cycle closed
    (``committed`` events' ``arrival_to_visible_ms`` - ``planned_visible_ms``; positive: later than planned), and how
    many cycles were planned over the budget already (the GPU busy until too late: they gathered until it freed)."""
    plans = [(e["planned_visible_ms"], e["arrival_to_visible_ms"]) for e in _commits(events)
             if e["t"] >= since and e.get("planned_visible_ms") is not None and e.get("arrival_to_visible_ms") is not None]
    errors = sorted(actual - planned for planned, actual in plans)
    if not errors:
        return dict(planned_cycles=0, planned_over_budget=0, later_than_planned=0, plan_error_p50_ms=None,
                    plan_error_p90_ms=None)
    return dict(planned_cycles=len(errors), planned_over_budget=sum(planned > budget_ms for planned, _ in plans),
                later_than_planned=sum(x > 0 for x in errors), plan_error_p50_ms=_lower_median(errors),
                plan_error_p90_ms=errors[int(0.9 * (len(errors) - 1))])


_SEGMENTS = (("to_close_ms", None, "closed_ms"), ("close_to_launch_ms", "closed_ms", "launched_ms"),
             ("launch_to_scored_ms", "launched_ms", "scored_ms"), ("scored_to_visible_ms", "scored_ms",
                                                                    "arrival_to_visible_ms"))
# close to launch in three, where the events carry the GPU thread's times (workers since 2026-12-01): the schema
# catch-up and the wait for the GPU thread; the wait for the tokenizers; the batch's inputs built and queued
_LAUNCH_SEGMENTS = (("close_to_taken_ms", "closed_ms", "taken_ms"),
                    ("taken_to_gathered_ms", "taken_ms", "gathered_ms"),
                    ("gathered_to_launch_ms", "gathered_ms", "launched_ms"))
# close to taken in two, where the events say when the loop handed the cycle to the GPU thread (since session 12): the
# schema catch-up and the batches built; the GPU thread's wait to take it
_HANDOFF_SEGMENTS = (("close_to_submitted_ms", "closed_ms", "submitted_ms"),
                     ("submitted_to_taken_ms", "submitted_ms", "taken_ms"))
# the tokenizers against the close and the GPU thread, where the events say when the cycle's last tokenizer job was
# submitted and done (since 2026-12-06): signed (negative: before), so that taken -> gathered tells a wait for the
# tokenizers (their last job done after the cycle was taken) from one after them (the GIL, the GPU thread's wake-up)
_TOKENIZER_SEGMENTS = (("close_to_tokenize_submitted_ms", "closed_ms", "tokenize_submitted_ms"),
                       ("taken_to_tokenized_ms", "taken_ms", "tokenized_ms"))


def cycle_timelines(events: list[dict], budget_ms: float, since: float = 0.0) -> dict:
    """Where the cycles committed after wall time ``since`` spent their first state's time to visibility: the median
    of each segment (arrival to close; close to the batch queued on the device, which covers the schema catch-up and
    the launch; launch to scores ready, which covers the wait behind the batch ahead; scores to visible, which covers
    the records and the transaction) over all cycles and over those visible later than ``budget_ms``, from the
    ``committed`` events' ``closed_ms``, ``launched_ms`` and ``scored_ms``; close to launch split further where every
    cycle's event has ``taken_ms`` and ``gathered_ms``, close to taken where they have ``submitted_ms``, and taken to
    gathered where they say when the last tokenizer job was submitted and done (``_TOKENIZER_SEGMENTS``), and taken to
    launch into the GPU thread's CPU time (``launch_cpu_ms``) and its waits (``launch_waiting_ms``) where they say; and
    how many cycles had their transaction opened while the GPU scored them (``opened_ahead``, workers before the
    committer thread) or the median number of cycles their transaction committed (``cycles_in_transaction``), where
    every event says; the median transaction of the group's cycles (``commit_ms``) and of each of its steps
    (``commit_steps_ms``: queuing the records, the offsets, the flush, EndTxn), counted once a transaction (by its
    first cycle); and the median number of states a cycle scored (``states``: late cycles are often the larger
    ones)."""
    cycles = [e for e in _commits(events) if e["t"] >= since
              and all(e.get(k) is not None for k in ("closed_ms", "launched_ms", "scored_ms", "arrival_to_visible_ms"))]

    def medians(group: list[dict]) -> dict:
        if not group:
            return {"cycles": 0}
        out: dict = {"cycles": len(group)}
        split = all(e.get("taken_ms") is not None and e.get("gathered_ms") is not None for e in group)
        handoff = split and all(e.get("submitted_ms") is not None for e in group)
        tokenizers = split and all(e.get("tokenized_ms") is not None for e in group)
        segments = (_SEGMENTS + (_LAUNCH_SEGMENTS if split else ()) + (_HANDOFF_SEGMENTS if handoff else ())
                    + (_TOKENIZER_SEGMENTS if tokenizers else ()))
        for name, start, end in segments:
            out[name] = round(_lower_median(e[end] - (e[start] if start else 0.0) for e in group), 2)
        if tokenizers:  # taken -> gathered after the later of the two
            out["tokenized_to_gathered_ms"] = round(_lower_median(
                e["gathered_ms"] - max(e["taken_ms"], e["tokenized_ms"]) for e in group), 2)
        if split and all(e.get("launch_cpu_ms") is not None for e in group):  # the GPU thread's work, and its waits
            out["launch_cpu_ms"] = round(_lower_median(e["launch_cpu_ms"] for e in group), 3)
            out["launch_waiting_ms"] = round(_lower_median(
                e["launched_ms"] - e["taken_ms"] - e["launch_cpu_ms"] for e in group), 2)
        out["states"] = _lower_median(e.get("scored", 0) for e in group)        # a cycle's scored states
        if all("opened_ahead" in e for e in group):   # workers of 2026-12-01 and 02 (sessions 12 to 16)
            out["opened_ahead"] = sum(bool(e["opened_ahead"]) for e in group)
        if all("cycles_in_transaction" in e for e in group):   # workers with the committer thread
            out["cycles_in_transaction"] = _lower_median(e["cycles_in_transaction"] for e in group)
        out.update(_transaction_medians(group))
        return out

    return {"all": medians(cycles), "late": medians([e for e in cycles if e["arrival_to_visible_ms"] > budget_ms])}


def _transaction_medians(cycles: list[dict]) -> dict:
    """The median ``commit_ms`` and ``commit_steps_ms`` of the transactions that committed ``cycles``, each counted
    by its first cycle (a transaction's later cycles repeat its figures); {} where the events do not carry them."""
    firsts = [e for e in cycles if e.get("transaction_cycle", 0) == 0 and e.get("commit_steps_ms")]
    if not firsts:
        return {}
    steps = {step: round(_lower_median(e["commit_steps_ms"][step] for e in firsts if step in e["commit_steps_ms"]), 2)
             for step in firsts[0]["commit_steps_ms"]}
    return {"commit_ms": round(_lower_median(e["commit_ms"] for e in firsts), 2), "commit_steps_ms": steps}


def gpu_pipeline(events: list[dict], since: float = 0.0) -> dict:
    """How closely the worker's cycles followed one another on the GPU, over the cycles committed after wall time
    ``since`` (``committed`` events with ``arrived_monotonic_ms``: workers since session 13), each cycle placed on the
    worker's monotonic clock: the fraction of the time the GPU was scoring (from a cycle's launch, or the scores of the
    one ahead if later, to its scores), the median time the GPU sat idle before a cycle's batch was queued
    (``idle_before_launch_ms``: its launch after the scores of the cycle ahead, 0 where queued behind them), and the
    median time a cycle closed before the scores of the cycle ahead (``close_lead_ms``; the launch lead the latency
    budget plans with is close to launch, so a lead below that idles the GPU), and the share of the time the GPU sat
    idle while a cycle's states waited (``idle_while_waiting_fraction``: its launch after the scores ahead, its first
    state arrived before them; the median hides it where most cycles are queued: run DK's GPU idled ~10 ms of each
    ~70 ms cycle of 125 states while its median said 0), in two parts: while the cycle was still open
    (``idle_while_gathering_fraction``: the planner chose to gather, as a budget with room lets it) and from its close
    to its launch (``idle_after_close_fraction``: the host's way from the close to the device); and, where the events
    carry the latency budget's plan at the close (since 2026-12-06), how much later than planned the cycles closed
    (``close_after_plan_ms``, median; negative: sooner, as a full batch closes; runs DP to DT's workers asked the plan
    as of the close, so it never showed one later) and how much later than expected the GPU freed
    (``free_after_expected_ms``, median: the cycle ahead's scores against the plan's time for them); and where they
    carry the planner's gathering window (since 2026-12-07), its median (``gather_window_ms``) and the share of cycles
    planned with one (``gathering_fraction``: 0 where every cycle closed as soon as the GPU could take it)."""
    cycles = [e for e in _commits(events) if e["t"] >= since
              and all(e.get(k) is not None for k in ("arrived_monotonic_ms", "closed_ms", "launched_ms", "scored_ms"))]
    if len(cycles) < 2:
        return {"cycles": len(cycles)}
    at = lambda e, key: e["arrived_monotonic_ms"] + e[key]  # noqa: E731
    cycles.sort(key=lambda e: at(e, "scored_ms"))
    busy, idle, lead, idle_waiting, idle_gathering = 0.0, [], [], 0.0, 0.0
    after_plan, after_expected = [], []
    for ahead, cycle in zip(cycles, cycles[1:]):
        free_at, closed, launched = at(ahead, "scored_ms"), at(cycle, "closed_ms"), at(cycle, "launched_ms")
        busy += at(cycle, "scored_ms") - max(launched, free_at)
        idle.append(max(0.0, launched - free_at))
        if cycle["arrived_monotonic_ms"] < free_at:
            idle_waiting += idle[-1]
            idle_gathering += max(0.0, min(closed, launched) - free_at)
        lead.append(free_at - closed)
        if cycle.get("planned_close_ms") is not None:
            after_plan.append(closed - at(cycle, "planned_close_ms"))
        if cycle.get("ahead_free_expected_ms") is not None:
            after_expected.append(free_at - at(cycle, "ahead_free_expected_ms"))
    span = at(cycles[-1], "scored_ms") - at(cycles[0], "scored_ms")
    share = lambda ms: round(ms / span, 3) if span > 0 else None  # noqa: E731
    windows = [cycle["gather_ms"] for cycle in cycles if cycle.get("gather_ms") is not None]
    return {"cycles": len(cycles), "gpu_busy_fraction": share(busy), "idle_before_launch_ms": round(_lower_median(idle), 2),
            "close_lead_ms": round(_lower_median(lead), 2), "idle_while_waiting_fraction": share(idle_waiting),
            "idle_while_gathering_fraction": share(idle_gathering),
            "idle_after_close_fraction": share(idle_waiting - idle_gathering),
            **({"close_after_plan_ms": round(_lower_median(after_plan), 2)} if after_plan else {}),
            **({"free_after_expected_ms": round(_lower_median(after_expected), 2)} if after_expected else {}),
            **({"gather_window_ms": round(_lower_median(windows), 2),
                "gathering_fraction": round(sum(w > 0 for w in windows) / len(windows), 3)} if windows else {})}
