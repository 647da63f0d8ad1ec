"""What each rebalance of a worker pool cost, from the workers' own logs (``--log-format json``).

For every step of a scale-out run (a worker started, stopped or killed at a wall time), on the logs' clock:
- **partitions moved**: those whose owner after the step differs from their owner before it;
- **seconds unowned**: per partition that was without an owner during the step, from the moment it lost its owner
  (the owner's ``revoked`` or ``lost`` event, or the SIGKILL) to its next ``assigned`` event. A partition that kept its
  owner throughout (incremental rebalancing) has none; under eager rebalancing every partition of every worker is
  revoked and assigned again, so every partition has some;
- **states re-read**: states a worker had consumed and dropped uncommitted (each worker logs "dropped N uncommitted
  states"), which their next owner reads again from the committed offset. A SIGKILLed worker logs nothing: its share
  is bounded by the states of its partitions past their committed offsets when it died (``Step.unread_bound``);
- **partitions lost**: those a live worker reported ``lost`` during the step: its group session expired (the
  coordinator answered none of its heartbeats for the session timeout), so it dropped its whole assignment and joined
  again. That is no rebalance's doing, and incremental rebalancing does not prevent it: on the tests' 2-core machine
  the embedded broker (noida-db) has answered nothing for 6 s while a starting worker loaded its model, and the
  worker that kept its partitions lost them all for ~0.3 s.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from bench.stream_windows import wall_time

_DROPPED = re.compile(r"dropped (\d+) uncommitted states")


@dataclass
class Step:
    """One scale event: ``action`` (start, stop, kill) on ``worker`` at wall time ``t``."""

    label: str
    action: str
    worker: str
    t: float
    held_at_kill: set[int] = field(default_factory=set)  # a kill: the partitions the worker held then
    unread_bound: int = 0  # a kill: its partitions' states past their committed offsets then


def dropped_states(text: str) -> list[tuple[float, int]]:
    """(wall time, states) of every "dropped N uncommitted states" line in a JSON log."""
    found = []
    for record in _json_lines(text):
        match = _DROPPED.search(record.get("message", ""))
        if match:
            found.append((wall_time(record["ts"]), int(match.group(1))))
    return found


def _json_lines(text: str):
    for line in re.split(r"[\r\n]+", text):
        if line.startswith("{") and '"ts"' in line:
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


def ownership_changes(events_by_worker: dict[str, list[dict]], steps: list[Step]) -> list[tuple[float, str, int, str | None]]:
    """(time, "gain"/"lose", partition, worker) from every worker's membership events and the kills, in time order."""
    changes = []
    for worker, events in events_by_worker.items():
        for event in events:
            kind = {"assigned": "gain", "revoked": "lose", "lost": "lose"}.get(event["event"])
            if kind is not None:
                changes.extend((event["t"], kind, p, worker) for p in event.get("partitions") or [])
    for step in steps:
        if step.action == "kill":
            changes.extend((step.t, "lose", p, step.worker) for p in step.held_at_kill)
    # at one instant a loss comes before a gain: a partition handed over within the same millisecond was unowned 0 s
    return sorted(changes, key=lambda c: (c[0], c[1] == "gain"))


def rebalance_table(events_by_worker: dict[str, list[dict]], drops: list[tuple[float, int]], steps: list[Step],
                    end: float, partitions: int) -> list[dict]:
    """One row per step after the first (the first worker's start is an assignment, not a rebalance): see the module
    docstring. ``end``: the wall time the run ended (the last step's window closes there)."""
    changes = ownership_changes(events_by_worker, steps)
    bounds = [s.t for s in steps] + [end]
    rows = []
    for index, step in enumerate(steps):
        start, stop = bounds[index], bounds[index + 1]
        before, after = _owners_at(changes, start), _owners_at(changes, stop)
        gaps = _gaps(changes, start, stop)
        if index == 0:
            continue
        dropped = sum(n for t, n in drops if start <= t < stop)
        rows.append({
            "step": step.label,
            "moved": sorted(p for p in range(partitions) if before.get(p) != after.get(p)),
            "unowned_s": {p: round(s, 3) for p, s in sorted(gaps.items())},
            "reread": dropped + step.unread_bound,
            "reread_is_bound": step.action == "kill",
            "lost": _lost(events_by_worker, start, stop),
        })
    return rows


def _lost(events_by_worker: dict[str, list[dict]], start: float, stop: float) -> list[int]:
    """The partitions any worker reported ``lost`` in [start, stop)."""
    return sorted({p for events in events_by_worker.values() for event in events
                   if event["event"] == "lost" and start <= event["t"] < stop for p in event.get("partitions") or []})


def _owners_at(changes, t: float) -> dict[int, str | None]:
    """Each partition's owner just before ``t`` (None: none)."""
    owners: dict[int, str | None] = {}
    for when, kind, partition, worker in changes:
        if when >= t:
            break
        if kind == "gain":
            owners[partition] = worker
        elif owners.get(partition) == worker:
            owners[partition] = None
    return owners


def _gaps(changes, start: float, stop: float) -> dict[int, float]:
    """Per partition, the seconds without an owner of every gap that began in [start, stop)."""
    owners: dict[int, str | None] = {}
    lost_at: dict[int, float] = {}
    gaps: dict[int, float] = {}
    for when, kind, partition, worker in changes:
        if kind == "lose" and owners.get(partition) == worker:
            owners[partition], lost_at[partition] = None, when
        elif kind == "gain":
            began = lost_at.pop(partition, None)
            if began is not None and start <= began < stop:
                gaps[partition] = gaps.get(partition, 0.0) + when - began
            owners[partition] = worker
    return gaps


def markdown(results: list[dict]) -> str:
    """The table of one or more runs (``bench.scale_out.run_scale_out`` results), a row per rebalance."""
    lines = ["| rebalancing | step | partitions moved | partitions unowned | seconds unowned (max / mean) "
             "| seconds unowned per partition | states re-read | partitions lost (session expired) |",
             "|---|---|---|---|---|---|---|---|"]
    for result in results:
        for row in result["rebalances"]:
            seconds = list(row["unowned_s"].values())
            span = f"{max(seconds):.2f} / {sum(seconds) / len(seconds):.2f}" if seconds else "0"
            each = " ".join(f"{p}:{s:.2f}" for p, s in row["unowned_s"].items()) or "-"
            reread = f"<= {row['reread']}" if row["reread_is_bound"] else str(row["reread"])
            lines.append(f"| {result['rebalancing']} | {row['step']} | {len(row['moved'])} {row['moved']} | "
                         f"{len(seconds)} | {span} | {each} | {reread} | {row['lost'] or '-'} |")
    return "\n".join(lines)
