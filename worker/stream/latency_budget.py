"""The latency budget (``--latency-budget-ms``): close each cycle so that its first state's record is visible to
read_committed readers as soon after that state's *arrival* as the load allows, and count the cycles that were not
visible within the budget.

A state arrives when its record was written to Kafka: the record's timestamp (the producer's create time, or the
broker's log-append time), so that the time it spent in Kafka before the worker consumed it is spent from the
budget, as a reader measuring from the record's timestamp sees it. Where that time cannot count, the state arrives
when the worker consumed it: a record without a timestamp, one stamped in the future (the producer's clock ahead of
ours), and one older than the whole budget when consumed (a backlog, a replay): it cannot be on time whatever the
worker does, and counting from its timestamp would find its --max-wait-ms already spent and close every cycle at once.

The budget is a deadline first: a cycle closes at once when the GPU is idle and, when a cycle is in flight, when
that one is expected to finish less the time a closed cycle of its size takes to be queued on the device (the *launch
lead*, learned per batch bucket, planned at its mean plus LEAD_DEVIATIONS deviations), so that its batch is queued
behind the one in flight. When the GPU frees is learned from the GPU's own time on each cycle (from its launch, or the
scores of the cycle ahead, to its scores), and a cycle that waited longer than the budget for the GPU thread (behind a
schema's preparation) teaches none of it. States that arrive while a batch runs make the next batch: the
queue sets the batch size, which grows with the load up to --max-batch (a cap at the batch beyond which larger ones
scored no faster, tried on an H100, made the tail at 80% load no better: bench/README.md, run DB). But not
before its *gathering window* after its first state (``worker.stream.gathering``): 0 at a light load; when the load
needs larger batches than closing at once makes (every cycle pays a fixed cost on the GPU, on the host and in its
transaction), as long as the budget allows, so that a larger budget holds a higher load. Gathering up to the
latest close that still meets the cycle's own deadline, at any load, was tried first (runs P and R in
bench/README.md): each cycle's larger batch held the GPU past the next cycle's deadline, and at 50 ms and half load
every cycle closed already late. ``bench/probes/budget_model.py`` compares policies. --max-wait-ms still caps a
cycle's wait.

A cycle closed at time ``t`` is scored when the GPU is free (the cycle in flight ahead of it finishes at ``g``),
and its transaction commits after its scores are ready and after the cycle ahead of it committed:

    visible(t) = max(max(t, g) + E(n), g + C(n)) + C(n)

where ``E(n)`` is the time from closing a cycle of ``n`` scored states to its scores being ready (the schema
catch-up, the tokenization still pending, the engine) and ``C(n)`` the time from its scores being ready to the
end of its transaction (building the output records, the transaction itself, the loop noticing). Both are
learned from the cycles the loop commits, per batch bucket (the power of two at or above ``n``), as running
estimates: their smoothed means say when the GPU frees, and the pessimistic values (the mean plus four smoothed
mean deviations, RFC 6298's retransmission timer) give each submitted cycle's *plan*, logged with its commit, so
that plans against outcomes show whether the budget can be met at this load.

The estimates and the plan are pure (no clock, no Kafka): the loop hands in the times it measured. ``CycleBudget`` is
the loop's side of it: it takes the loop's cycles, keeps the budget's state and reports to the metrics, and does
nothing when no budget is set.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable

from worker.ops import metrics
from worker.stream.batcher import Cycle
from worker.stream.gathering import GATHER_REFRESH_S, CommitWindow, CostLine, RecentRate, gather_window

log = logging.getLogger(__name__)

MEAN_GAIN = 1 / 8       # RFC 6298's alpha
DEVIATION_GAIN = 1 / 4  # RFC 6298's beta
DEVIATIONS = 4          # RFC 6298's K
LEAD_DEVIATIONS = 2
"""The launch lead a cycle closes by: its mean plus this many mean deviations. A lead at its mean launched a third of
the cycles queued behind another after the GPU had freed (run DM, an H100, batches of 1-16: the GPU idle 10-13% of
its time while states waited); a larger one costs the states that arrive meanwhile the wait for the next cycle."""


def bucket(n: int) -> int:
    """The batch bucket of ``n`` states: the power of two at or above it (1 for 0 or 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@dataclass
class RunningEstimate:
    """A smoothed mean and mean deviation of one duration; ``value`` is the pessimistic estimate."""

    mean: float
    deviation: float

    @classmethod
    def first(cls, seconds: float) -> "RunningEstimate":
        """The estimate after its first sample: RFC 6298 starts the deviation at half the sample."""
        return cls(mean=seconds, deviation=seconds / 2)

    def add(self, seconds: float) -> None:
        """Fold in one measured duration."""
        self.deviation += DEVIATION_GAIN * (abs(seconds - self.mean) - self.deviation)
        self.mean += MEAN_GAIN * (seconds - self.mean)

    @classmethod
    def folded(cls, estimate: "RunningEstimate | None", seconds: float) -> "RunningEstimate":
        """``estimate`` with one more measured duration folded in (the first estimate when there is none yet)."""
        if estimate is None:
            return cls.first(seconds)
        estimate.add(seconds)
        return estimate

    @property
    def value(self) -> float:
        """The duration to plan with: mean plus DEVIATIONS mean deviations."""
        return self.within(DEVIATIONS)

    def within(self, deviations: float) -> float:
        """The mean plus ``deviations`` mean deviations."""
        return self.mean + deviations * self.deviation


@dataclass
class BucketedEstimates:
    """Running estimates of one duration per batch bucket.

    A bucket not measured yet borrows from its neighbours, pessimistically: from the nearest larger measured bucket
    (a batch takes no longer than a bigger one), else from the nearest smaller one scaled by the size ratio (batched
    work grows at most linearly with the batch). Nothing measured at all: ``None``."""

    by_bucket: dict[int, RunningEstimate] = field(default_factory=dict)
    sizes: dict[int, float] = field(default_factory=dict)   # the smoothed mean of ``n`` per bucket

    def add(self, n: int, seconds: float) -> None:
        """Fold in the duration measured for a cycle of ``n`` scored states."""
        key = bucket(n)
        self.by_bucket[key] = RunningEstimate.folded(self.by_bucket.get(key), seconds)
        size = self.sizes.get(key)
        self.sizes[key] = float(n) if size is None else size + MEAN_GAIN * (n - size)

    def line(self) -> CostLine | None:
        """The duration as a line in ``n`` through the measured buckets' means, with their pessimistic margins
        (``worker.stream.gathering.CostLine``); None before any measurement."""
        return CostLine.fitted([(self.sizes[b], e.mean, e.value - e.mean) for b, e in sorted(self.by_bucket.items())])

    def seconds(self, n: int, expected: bool = False, deviations: float = DEVIATIONS) -> float | None:
        """The duration to plan with for ``n`` states (``expected``: the smoothed mean instead), or None before any
        measurement."""
        key = bucket(n)
        pick = (lambda e: e.mean) if expected else (lambda e: e.within(deviations))
        if key in self.by_bucket:
            return pick(self.by_bucket[key])
        larger = [b for b in self.by_bucket if b > key]
        if larger:
            return pick(self.by_bucket[min(larger)])
        if self.by_bucket:
            nearest = max(self.by_bucket)
            return pick(self.by_bucket[nearest]) * key / nearest
        return None

    def values(self) -> dict[int, float]:
        """The estimate of every measured bucket (for the metrics)."""
        return {b: e.value for b, e in sorted(self.by_bucket.items())}


def close_by(now: float, first_arrival: float, max_wait_s: float, gpu_free_at: float | None = None,
             launch_lead_s: float = 0.0, gather_s: float = 0.0) -> float:
    """When the open cycle closes: as soon as the GPU can take it, but not before ``first_arrival + gather_s``, capped
    at ``first_arrival + max_wait_s``.

    ``gpu_free_at``: when the cycle in flight is expected to finish scoring (None or past: the GPU is free now, and
    the cycle closes at once); ``launch_lead_s``: the time from closing a cycle to its batch being queued on the device
    (schema catch-up, tokenization, launch), so that a cycle closed that much before the GPU frees is queued behind
    the batch in flight; ``gather_s``: the gathering window (``worker.stream.gathering``: 0 unless the load needs
    larger batches and the budget allows them). See the module's docstring for why it never waits longer."""
    can_take = now if gpu_free_at is None else max(now, gpu_free_at - launch_lead_s)
    return min(first_arrival + max_wait_s, max(can_take, first_arrival + gather_s))


def visible_at(close: float, gpu_free_at: float, scoring_s: float, committing_s: float) -> float:
    """When a cycle closed at ``close`` becomes visible, per the model above."""
    scored = max(close, gpu_free_at) + scoring_s
    return max(scored, gpu_free_at + committing_s) + committing_s


@dataclass
class CycleTimes:
    """What the loop measured of one committed cycle (monotonic seconds)."""

    n_states: int          # scored states in the cycle
    first_arrival: float   # its first state arrived (``CycleBudget.arrival``)
    closed_at: float       # the loop decided to close it
    scored_at: float       # its scores were ready (all its batches)
    committed_at: float    # its transaction ended: its records are visible
    launched_at: float | None = None  # its batch was queued on the device (None: nothing was scored)
    queued_s: float = 0.0  # from its handoff to the GPU thread to that thread taking it


class LatencyBudget:
    """The budget's state in a running worker: the estimates, learned from every committed cycle, and the misses."""

    def __init__(self, budget_s: float, max_wait_s: float, max_batch: int = 128) -> None:
        self.budget_s, self.max_wait_s, self.max_batch = budget_s, max_wait_s, max_batch
        self.rate = RecentRate()        # states/s committed lately: the load the gathering window serves
        self.gather_s = 0.0             # the gathering window (``worker.stream.gathering``), after every commit
        self.engine = BucketedEstimates()
        self.commit = BucketedEstimates()
        # from closing a cycle to its batch queued on the device, per bucket: its states' gathering and padding grow
        # with the batch (~1.5 ms at 8 states, ~5 ms at 128 on run DK's H100)
        self.launch_lead = BucketedEstimates()
        # the GPU's own time on a cycle, from its launch (or the batch ahead's scores) to its scores: when the GPU
        # frees. E(n) (``engine``) counts from the close, so a cycle launched after the GPU freed adds the idle gap to
        # it, and a free time predicted from it closed every next cycle after the GPU was idle already (run DK)
        self.device = BucketedEstimates()
        self.misses = 0
        self._last_scored_at = self._last_committed_at = self._gathered_at = -math.inf
        self.gpu_free_at: float | None = None  # when the submitted cycles are expected scored (the GPU free)

    def close_by(self, now: float, first_arrival: float, gpu_busy: bool, n_states: int = 1) -> float:
        """When the open cycle of ``n_states`` should close (see ``close_by``); ``gpu_busy``: a submitted cycle is not
        scored yet."""
        return close_by(now, first_arrival, self.max_wait_s, self.gpu_free_at if gpu_busy else None,
                        self._lead(n_states), self.gather_s)

    def _lead(self, n_states: int, expected: bool = False) -> float:
        """The launch lead of a cycle of ``n_states`` to close by (``expected``: its mean, to say when it launches)."""
        return self.launch_lead.seconds(n_states, expected, LEAD_DEVIATIONS) or 0.0

    def submitted(self, now: float, n_states: int, gpu_busy: bool) -> float | None:
        """A cycle of ``n_states`` was closed at ``now`` and submitted: expect the GPU busy until it is scored.
        Returns when the plan expects its records visible, on the pessimistic estimates (None before any estimate).

        The GPU's busy time is the expected one, not the pessimistic one: it decides when the next cycle closes, and
        closing after the GPU frees would leave it idle. (The loop closes the next cycle at once when the cycle ahead
        is scored sooner.)"""
        gpu_free_at = max(now, self.gpu_free_at or now) if gpu_busy else now
        scoring = self.engine.seconds(n_states) if n_states else 0.0
        committing = self.commit.seconds(n_states)
        planned = None if scoring is None or committing is None else visible_at(now, gpu_free_at, scoring, committing)
        self.gpu_free_at = self._frees_at(now, gpu_free_at, n_states)
        return planned

    def _frees_at(self, now: float, gpu_free_at: float, n_states: int) -> float:
        """When the GPU is expected free after a cycle of ``n_states`` closed at ``now``, behind the batch in flight
        (``gpu_free_at``: now if none): launched a lead after its close, started when both it and the GPU are ready."""
        if not n_states:
            return gpu_free_at
        device = self.device.seconds(n_states, expected=True)
        if device is None:      # no launch timed yet: the time from the close, which holds the lead
            return gpu_free_at + (self.engine.seconds(n_states, expected=True) or 0.0)
        return max(now + self._lead(n_states, expected=True), gpu_free_at) + device

    def committed(self, times: CycleTimes) -> bool:
        """Learn from a committed cycle; True if its first state's record became visible later than the budget."""
        started_scoring = max(times.closed_at, self._last_scored_at)  # the GPU scores cycles one after the other
        started_commit = max(times.scored_at, self._last_committed_at)  # and the loop commits them in order
        # A cycle that waited longer than the whole budget for the GPU thread waited for a schema's preparation (the
        # first schema's graphs, 3.7 s on run DK's H100), not on the path the plan times: as a first sample it made
        # every estimate seconds long for ~50 cycles, and the cycles closed late the whole while.
        steady = times.queued_s <= self.budget_s
        if times.n_states and steady:
            self.engine.add(times.n_states, max(0.0, times.scored_at - started_scoring))
            if times.launched_at is not None:
                self.launch_lead.add(times.n_states, max(0.0, times.launched_at - times.closed_at))
                self.device.add(times.n_states, max(0.0, times.scored_at - max(times.launched_at, self._last_scored_at)))
        self.commit.add(times.n_states, max(0.0, times.committed_at - started_commit))
        self._last_scored_at, self._last_committed_at = times.scored_at, times.committed_at
        self.rate.add(times.committed_at, times.n_states)
        if times.committed_at - self._gathered_at >= GATHER_REFRESH_S:    # not at every commit: see its docstring
            self._gathered_at = times.committed_at
            self.gather_s = gather_window(self.rate.per_second(), self.engine.line(), self.commit.line(),
                                          self.budget_s, self._lead(times.n_states), self.max_batch, self.device.line())
        missed = times.committed_at - times.first_arrival > self.budget_s
        self.misses += missed
        return missed

    def forget_order(self) -> None:
        """Uncommitted cycles were dropped (abort, rebalance): the next cycle follows none in flight, and the backlog
        read again says nothing of the load."""
        self.gpu_free_at = None
        self.rate.forget()
        self.gather_s, self._gathered_at = 0.0, -math.inf


@dataclass
class Overload:
    """Whether the budget holds at the load arriving, judged over the last ``window_s`` of committed cycles: it does
    not when more than ``share`` of them were visible later than the budget (at least ``min_cycles`` of them over at
    least half the window, so that neither one slow cycle after a quiet spell nor a backlog taken at start, both
    late by nature, is a verdict on the load). The planner then cannot serve the load within the budget:
    the GPU scores what arrives only in batches that take longer than the budget leaves them. ``add`` returns a
    message when the verdict changes, for the log; it leaves the overloaded state only below half of ``share``, so
    a load on the edge does not flap."""

    budget_ms: float
    window_s: float = 10.0
    share: float = 0.05
    min_cycles: int = 20
    overloaded: bool = False
    _window: CommitWindow = field(init=False)

    def __post_init__(self) -> None:
        self._window = CommitWindow(self.window_s)

    def add(self, committed_at: float, n_states: int, missed: bool) -> str | None:
        """One committed cycle; -> a message if the budget stopped or started holding with it."""
        window = self._window
        window.add(committed_at, n_states, missed)
        if len(window) < self.min_cycles or committed_at - window.oldest_at() < self.window_s / 2:
            return None
        missed_share = window.missed / len(window)
        if self.overloaded == (missed_share > (self.share / 2 if self.overloaded else self.share)):
            return None
        self.overloaded = not self.overloaded
        rate, batch = self.rate(), window.states / len(window)
        if self.overloaded:
            return (f"latency budget {self.budget_ms:g} ms does not hold at this load: {missed_share:.0%} of the "
                    f"{len(window)} cycles committed in the last {self.window_s:g} s were visible later than it, "
                    f"at {rate:,.0f} states/s (batches of {batch:.1f} on average); this worker cannot score that rate "
                    "within the budget: add workers (GPUs) to the group, or raise --latency-budget-ms")
        return (f"latency budget {self.budget_ms:g} ms holds again: {missed_share:.0%} of the last {self.window_s:g} "
                f"s's cycles over it, at {rate:,.0f} states/s")

    def rate(self) -> float:
        """States scored per second over the window (0 before two cycles)."""
        return self._window.states_per_second()

    def forget(self) -> None:
        """Uncommitted work was dropped: the window starts again (the cycles after a rewind are a backlog)."""
        self._window.clear()


def scored_states(cycle: Cycle) -> int:
    """States of ``cycle`` in its batches (to be scored), as opposed to its dead letters and waiting states."""
    return sum(len(batch.members) for batch in cycle.batches.values())


class CycleBudget:
    """The latency budget as the loop uses it, on its cycles; with ``budget_ms`` None (no --latency-budget-ms) it
    never closes a cycle and learns nothing.

    ``gpu_busy`` says whether a submitted cycle is still being scored (the loop's cycles in flight)."""

    def __init__(self, budget_ms: int | None, max_wait_s: float, gpu_busy: Callable[[], bool],
                 max_batch: int = 128) -> None:
        self.budget_ms = budget_ms
        self.state = LatencyBudget(budget_ms / 1000, max_wait_s, max_batch) if budget_ms is not None else None
        self.overload = Overload(budget_ms) if budget_ms is not None else None
        self._gpu_busy = gpu_busy

    def announce(self, max_wait_ms: int | None) -> None:
        """Export the budget as a metric and say in the log how it closes cycles (once, at start)."""
        if self.state is None:
            return
        metrics.LATENCY_BUDGET_SECONDS.set(self.state.budget_s)
        log.info("latency budget %d ms: each state's record should be visible to read_committed readers within %d ms "
                 "of its arrival (its record's timestamp; when this worker consumed it for records without one, stamped "
                 "ahead of this host's clock, or already older than the budget); a cycle closes as soon as the GPU can "
                 "take it (at once when idle, else when the batch ahead is expected to finish, from running estimates "
                 "per batch size), after a gathering window that is 0 unless the load needs larger batches and the "
                 "budget allows them, and the cycles visible later than the budget are counted; --max-wait-ms %s caps "
                 "the wait", self.budget_ms, self.budget_ms, max_wait_ms)

    def arrival(self, consumed_at: float, timestamp_ms: int | None) -> float:
        """When a state consumed at ``consumed_at`` (monotonic) arrived, on the same clock: see the module's docstring
        (``timestamp_ms``: its record's timestamp, ms since the epoch; None or not positive: none)."""
        if self.state is None or timestamp_ms is None or timestamp_ms <= 0:
            return consumed_at
        age = time.time() - timestamp_ms / 1000
        if age <= 0 or age > self.state.budget_s:
            return consumed_at
        return consumed_at - age

    def close_by(self, now: float, cycle: Cycle) -> float | None:
        """When the budget closes the open ``cycle`` (monotonic seconds); None without a budget or an opened cycle."""
        if self.state is None or cycle.arrived_at is None:
            return None
        return self.state.close_by(now, cycle.arrived_at, self._gpu_busy(), len(cycle))

    def due(self, now: float, cycle: Cycle) -> bool:
        """Whether the budget closes the open ``cycle`` now."""
        close = self.close_by(now, cycle)
        return close is not None and len(cycle) > 0 and now >= close

    def submitted(self, closed_at: float, cycle: Cycle) -> float | None:
        """``cycle``, closed at ``closed_at``, goes to the GPU (call before it counts as in flight). -> when the plan
        expects its records visible (None without a budget or before any estimate)."""
        if self.state is None:
            return None
        return self.state.submitted(closed_at, scored_states(cycle), gpu_busy=self._gpu_busy())

    def committed(self, cycle: Cycle, closed_at: float, scored_at: float | None, now: float,
                  launched_at: float | None = None, queued_s: float = 0.0) -> None:
        """``cycle`` committed at ``now``: learn its times, update the estimates' metrics, count a miss (``queued_s``:
        how long it waited for the GPU thread to take it)."""
        if self.state is None or cycle.arrived_at is None:
            return
        n_states = scored_states(cycle)
        missed = self.state.committed(CycleTimes(
            n_states=n_states, first_arrival=cycle.arrived_at, closed_at=closed_at,
            scored_at=scored_at or now, committed_at=now, launched_at=launched_at, queued_s=queued_s))
        metrics.observe_budget(self.state.engine.values(), self.state.commit.values(), missed)
        verdict = self.overload.add(now, n_states, missed)
        metrics.ARRIVAL_STATES_PER_SECOND.set(self.overload.rate())
        if verdict is not None:
            metrics.LATENCY_BUDGET_OVERLOADED.set(int(self.overload.overloaded))
            (log.warning if self.overload.overloaded else log.info)("%s", verdict)

    def forget_order(self) -> None:
        """Uncommitted cycles were dropped: the next cycle follows none in flight."""
        if self.state is not None:
            self.state.forget_order()
            self.overload.forget()
