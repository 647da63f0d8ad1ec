"""Why each state over the budget was late: one cause per late state, from what the worker logs of every cycle.

A measured state's latency runs from its event time to the moment the benchmark's read_committed reader saw its
record. The state belongs to the cycle that committed its input offset (the ``committed`` event's ``offsets``: the
first cycle of the worker's log whose next offset for the state's partition is past the state's offset). That cycle's
event places its steps on one clock, in ms after its first state's arrival (``closed_ms``, ``submitted_ms``,
``taken_ms``, ``gathered_ms``, ``launched_ms``, ``scored_ms``, ``arrival_to_visible_ms``; ``arrived_monotonic_ms``
puts the cycle ahead of it on the same clock), and the transaction's ``commit_ms`` and ``commit_steps_ms``. The
cycle's time is cut into pieces, each charged to one cause:

| piece | cause |
|---|---|
| until the cycle ahead of it (same worker) was scored | ``gpu_busy``: queued behind scoring in flight |
| then, while the GPU was free, to the close | ``host_intake``: not closed yet (poll, decode, routing, records) |
| close -> handed to the GPU thread | ``broker_schema``: the schema catch-up (a broker round trip), batches built |
| handed -> taken by the GPU thread | ``host_handoff`` |
| taken -> its tokenized states gathered | ``host_gather`` |
| gathered -> queued on the device | ``host_launch`` (``capture`` where it captured graphs: ``graph_captures``) [1] |
| from queued, or the cycle ahead's scores if later, to its scores | ``scoring``: its own batch (``capture`` likewise) |
| scores -> its transaction began, while the transaction before was running | ``broker_queue``: behind the committer |
| the rest of scores -> transaction began | ``host_records``: records made and encoded, handed to the committer |
| the transaction's ``produce`` step | ``host_produce``: records queued in the producer |
| its ``offsets``, ``flush`` and ``commit`` steps | ``broker_commit`` |
| visible to the worker -> seen by the reader | ``reader``: the benchmark's read_committed fetch |

[1] ``scoring`` on a CPU, whose forward runs inside the launch.

Then, per late state, on its own span (from its event time, placed on the cycle's clock, to when the reader saw it):

1. a rebalance, an abort or a worker (re)start (``assigned``, ``revoked``, ``lost``, ``aborted``, ``model_loaded``
   events of any worker) inside the span: the cause is ``rebalance``, whatever the pieces say;
2. else every garbage collection overlapping the span (the event's ``gc_pauses_ms``) is charged to ``gc`` and taken
   out of the pieces it overlaps (a collection stops every thread: whatever ran then waited for it); and every pause
   of the broker's JVM (Apache Kafka's GC log, ``broker_pauses``) overlapping a piece that waits on the broker
   (``broker_schema``, ``broker_commit``, ``reader``) is charged to ``broker_gc`` and taken out of that piece;
3. the cause is the one with the most time inside the span; a tie goes to the one earlier in ``CAUSES``.

So a state is charged to what took most of its time, not to what exceeded a typical value: at a load the GPU cannot
keep up with, every late state queued behind the GPU and says so. A state whose cycle is not in the logs (a worker's
log not read, an event without the times) is counted ``unmapped``.
"""
from __future__ import annotations

import bisect
import datetime
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

CAUSES = ("rebalance", "capture", "gc", "broker_gc", "gpu_busy", "scoring", "host_intake", "broker_schema",
          "host_handoff", "host_gather", "host_launch", "host_records", "host_produce", "broker_queue", "broker_commit",
          "reader", "other")
"""Every cause, in the order that breaks a tie."""

MEMBERSHIP = ("assigned", "revoked", "lost", "aborted", "model_loaded")
WAITS_ON_BROKER = ("broker_schema", "broker_commit", "reader")
"""The pieces a pause of the broker holds up (its requests are not answered meanwhile)."""
_GC_PAUSE = re.compile(r"^\[(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+)\+0000\] GC\(\d+\) (?:[YO]: )?Pause .* ([\d.]+)ms$",
                       re.M)
"""A pause's line in the broker's log: G1's (``GC(7) Pause Young ...``) and ZGC's, generational ones naming the young or
old collection (``GC(0) Y: Pause Mark Start (Major) ...``)."""
SAME_TRANSACTION_MS = 0.05
"""Cycles whose records became visible this close together (the event's rounding) ended in one transaction."""
_TIMES = ("arrived_monotonic_ms", "closed_ms", "scored_ms", "arrival_to_visible_ms", "offsets")


@dataclass(frozen=True)
class LateState:
    """One measured state as the reader saw it: wall times in ms since the epoch, and its input position."""

    event_ms: float
    visible_ms: float
    partition: int
    offset: int
    measured: bool = True     # in the window's measured part (False: its warm-up, read only to place its cycles)


@dataclass
class CyclePieces:
    """A committed cycle's time cut into causes, on its own clock (ms after its first state's arrival)."""

    arrival_wall_ms: float | None          # its first state's arrival on the wall clock (None: not placed yet)
    visible_ms: float                      # its records visible, after arrival
    pieces: list[tuple[float, float, str]] = field(default_factory=list)   # (from, to, cause)
    gc: list[tuple[float, float]] = field(default_factory=list)             # (from, to) of each collection


def broker_pauses(log: "str | Path | None") -> list[tuple[float, float]]:
    """The JVM's pauses in an Apache Kafka broker's log file (the log tags of
    ``worker.devbroker.apache_kafka.GC_FLAGS``) as (start, end) wall times in ms since the epoch: a line is written as
    its pause ends. None or no file: none."""
    if log is None or not Path(log).is_file():
        return []
    pauses = []
    for match in _GC_PAUSE.finditer(Path(log).read_text(errors="replace")):
        end = datetime.datetime.strptime(match.group(1), "%Y-%m-%dT%H:%M:%S.%f").replace(
            tzinfo=datetime.timezone.utc).timestamp() * 1000
        pauses.append((end - float(match.group(2)), end))
    return pauses


def _piece(pieces: list, start: float | None, end: float | None, cause: str) -> None:
    if start is not None and end is not None and end > start:
        pieces.append((start, end, cause))


def cycle_pieces(event: dict, ahead: dict | None, previous_transaction_end: float | None,
                 compute_in_launch: bool = False) -> CyclePieces:
    """``event``'s cycle cut into causes (see the module's docstring). ``ahead``: the cycle committed before it by the
    same worker (None: none); ``previous_transaction_end``: when the transaction before its own ended, on the worker's
    monotonic clock in ms (None: none); ``compute_in_launch``: the device computes inside the launch (a CPU: the
    forward runs before the launch returns), so gathered -> queued is its ``scoring``, not the host's launch."""
    base = event["arrived_monotonic_ms"]
    get = event.get
    closed, scored, visible = get("closed_ms"), get("scored_ms"), get("arrival_to_visible_ms")
    submitted, taken, gathered, launched = get("submitted_ms"), get("taken_ms"), get("gathered_ms"), get("launched_ms")
    captured = bool(get("graph_captures"))
    ahead_scored = None
    if ahead is not None and ahead.get("scored_ms") is not None and ahead.get("arrived_monotonic_ms") is not None:
        ahead_scored = min(ahead["arrived_monotonic_ms"] + ahead["scored_ms"] - base, scored)
    busy_until = max(0.0, ahead_scored or 0.0)
    pieces: list[tuple[float, float, str]] = []
    _piece(pieces, 0.0, busy_until, "gpu_busy")
    # the host's steps up to the launch, where they did not overlap the wait for the GPU
    steps = [(closed, "host_intake"), (submitted, "broker_schema"), (taken, "host_handoff"), (gathered, "host_gather"),
             (launched, "capture" if captured else "scoring" if compute_in_launch else "host_launch")]
    at = 0.0
    for end, cause in steps:
        if end is None:
            continue
        _piece(pieces, max(at, busy_until), end, cause)
        at = max(at, end)
    _piece(pieces, max(at, busy_until), scored, "capture" if captured else "scoring")
    # after the scores: the transaction's steps, counted back from its end
    commit_ms = float(get("commit_ms") or 0.0)
    began = max(scored, visible - commit_ms)
    queue_end = None if previous_transaction_end is None else min(began, previous_transaction_end - base)
    _piece(pieces, scored, queue_end, "broker_queue")
    _piece(pieces, max(scored, queue_end or scored), began, "host_records")
    at = began
    step_ms = get("commit_steps_ms") or {}
    for name in ("begin", "produce", "offsets", "flush", "commit"):
        end = min(visible, at + float(step_ms.get(name, 0.0)))
        _piece(pieces, at, end, "host_produce" if name in ("begin", "produce") else "broker_commit")
        at = end
    _piece(pieces, at, visible, "broker_commit")   # what the steps do not name (the committer's wake-up)
    gc = [(start, start + ms) for start, ms in get("gc_pauses_ms") or []]
    return CyclePieces(None, visible, pieces, gc)


def _overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def cause_of(cycle: CyclePieces, state: LateState, membership_wall_ms: list[float],
             broker_pauses_wall_ms: list[tuple[float, float]] = ()) -> tuple[str, dict[str, float]]:
    """The one cause of ``state``'s lateness (the rule of the module's docstring), and its time per cause (ms);
    ``broker_pauses_wall_ms``: the broker's pauses (``broker_pauses``)."""
    start = max(0.0, state.event_ms - cycle.arrival_wall_ms)
    end = max(start, state.visible_ms - cycle.arrival_wall_ms)
    broker = [(b0 - cycle.arrival_wall_ms, b1 - cycle.arrival_wall_ms) for b0, b1 in broker_pauses_wall_ms
              if b1 > state.event_ms and b0 < state.visible_ms]
    times: dict[str, float] = defaultdict(float)
    covered = 0.0
    for p0, p1, cause in (*cycle.pieces, (cycle.visible_ms, end, "reader")):
        share = _overlap(start, end, p0, p1)
        if share <= 0:
            continue
        a, b = max(start, p0), min(end, p1)
        stopped = sum(_overlap(a, b, g0, g1) for g0, g1 in cycle.gc)
        paused = sum(_overlap(a, b, g0, g1) for g0, g1 in broker) if cause in WAITS_ON_BROKER else 0.0
        paused = min(paused, share - stopped)
        times[cause] += share - stopped - paused
        times["gc"] += stopped
        times["broker_gc"] += paused
        covered += share
    times["other"] += max(0.0, (end - start) - covered)   # steps an event did not time
    times = {cause: round(ms, 3) for cause, ms in times.items() if ms > 1e-9}
    bisect_at = bisect.bisect_left(membership_wall_ms, state.event_ms)
    if bisect_at < len(membership_wall_ms) and membership_wall_ms[bisect_at] <= state.visible_ms:
        return "rebalance", times
    if not times:
        return "other", times
    return max(times, key=lambda cause: (times[cause], -CAUSES.index(cause))), times


class CycleIndex:
    """The committed cycles of a run's workers, each cut into causes, found by the input offsets they committed."""

    def __init__(self, events_by_worker: list[list[dict]], compute_in_launch: bool = False) -> None:
        self._by_partition: dict[int, list[tuple[int, int]]] = defaultdict(list)   # partition -> [(next offset, k)]
        self.cycles: list[CyclePieces] = []
        self.membership: list[float] = sorted(1000 * e["t"] for events in events_by_worker for e in events
                                              if e["event"] in MEMBERSHIP)
        for events in events_by_worker:
            ahead, transaction_end, previous_end = None, None, None
            for event in events:
                if event["event"] == "model_loaded":
                    ahead, transaction_end, previous_end = None, None, None   # a new process: a new monotonic clock
                if event["event"] != "committed" or any(event.get(k) is None for k in _TIMES):
                    continue
                end = event["arrived_monotonic_ms"] + event["arrival_to_visible_ms"]
                if previous_end is not None and end > previous_end + SAME_TRANSACTION_MS:
                    transaction_end = previous_end   # the transaction before this one's (cycles of one share its end)
                pieces = cycle_pieces(event, ahead, transaction_end, compute_in_launch)
                # the arrival on the wall clock, from the log line's time (a little after the commit)
                pieces.arrival_wall_ms = 1000 * event["t"] - event["arrival_to_visible_ms"]
                for partition, offset in event["offsets"]:
                    self._by_partition[partition].append((offset, len(self.cycles)))
                self.cycles.append(pieces)
                ahead, previous_end = event, end
        for entries in self._by_partition.values():
            entries.sort()

    def cycle_of(self, partition: int, offset: int) -> int | None:
        """The index of the cycle that committed ``offset`` of ``partition`` (None: no cycle read did)."""
        entries = self._by_partition.get(partition, [])
        k = bisect.bisect_right(entries, (offset, len(self.cycles)))
        return entries[k][1] if k < len(entries) else None


def place_arrivals(index: CycleIndex, states: list[LateState], budget_ms: float) -> None:
    """Put each cycle's arrival on the reader's clock: its states' earliest event time, where the worker counted from
    it (a record's timestamp: ``worker.stream.latency_budget``), else as its log line says (the worker counted from
    consumption: the earliest event was already older than the budget when consumed)."""
    earliest: dict[int, float] = {}
    for state in states:
        k = index.cycle_of(state.partition, state.offset)
        if k is not None:
            earliest[k] = min(earliest.get(k, state.event_ms), state.event_ms)
    for k, event_ms in earliest.items():
        cycle = index.cycles[k]
        if cycle.arrival_wall_ms - event_ms <= budget_ms:
            cycle.arrival_wall_ms = event_ms


def window_causes(events_by_worker: list[list[dict]], states: list[LateState], budget_ms: float,
                  compute_in_launch: bool = False, broker_pauses_wall_ms: list[tuple[float, float]] = ()) -> dict:
    """The tail table of one measured window: of ``states`` (every state the reader saw with an event time; those not
    ``measured`` only place their cycles), the measured ones over ``budget_ms``, how many per cause, their share, and
    the mean ms per cause over them (what the late states' time was spent on, whichever cause each was charged to).
    ``compute_in_launch``: see ``cycle_pieces``; ``broker_pauses_wall_ms``: the broker's pauses (``broker_pauses``)."""
    index = CycleIndex(events_by_worker, compute_in_launch)
    place_arrivals(index, states, budget_ms)
    late = [s for s in states if s.measured and s.visible_ms - s.event_ms > budget_ms]
    counts: Counter = Counter()
    spent: dict[str, float] = defaultdict(float)
    for state in late:
        k = index.cycle_of(state.partition, state.offset)
        if k is None:
            counts["unmapped"] += 1
            continue
        cause, times = cause_of(index.cycles[k], state, index.membership, broker_pauses_wall_ms)
        counts[cause] += 1
        for name, ms in times.items():
            spent[name] += ms
    order = [c for c in (*CAUSES, "unmapped") if counts[c]]
    return dict(over_budget=len(late), causes={c: counts[c] for c in order},
                shares={c: round(counts[c] / len(late), 4) for c in order},
                mean_ms={c: round(spent[c] / len(late), 2) for c in CAUSES if spent.get(c)})


def merged(tables: list[dict]) -> dict:
    """Several windows' tables as one (a load's samples together)."""
    counts: Counter = Counter()
    spent: dict[str, float] = defaultdict(float)
    late = sum(t["over_budget"] for t in tables)
    for table in tables:
        counts.update(table["causes"])
        for cause, ms in table["mean_ms"].items():
            spent[cause] += ms * table["over_budget"]
    order = [c for c in (*CAUSES, "unmapped") if counts[c]]
    return dict(over_budget=late, causes={c: counts[c] for c in order},
                shares={c: round(counts[c] / late, 4) for c in order} if late else {},
                mean_ms={c: round(spent[c] / late, 2) for c in CAUSES if spent.get(c)} if late else {})
