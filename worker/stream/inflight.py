"""The cycles in flight: closed cycles handed to the GPU thread whose transactions are not committed yet, oldest
first, each with the times the loop and the GPU thread stamped on it, and the loop's wait on them.

A cycle in flight is scored on the GPU thread, then handed to the committer (``worker.stream.committer``), then
committed; the cycles handed come first, in order. While one cycle is scored the loop keeps consuming and tokenizing
the next. A consumer's poll cannot be woken by another thread, so meanwhile the loop waits on the cycle rather than
inside a poll (``CyclesInFlight.next_message``): on its scores, so that it is handed on at once rather than at the end
of a poll (a wait of up to its timeout, spent from every record's latency), and on the committer's outcomes; woken, it
takes the messages fetched meanwhile.
"""

from __future__ import annotations

import contextlib
import queue
import weakref
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Collection, Iterator

from confluent_kafka import Consumer

from worker.formats.records import SchemaKey
from worker.ops import metrics
from worker.stream import gc_pauses
from worker.stream.batcher import Cycle, monotonic
from worker.stream.latency_budget import CycleBudget
from worker.stream.schema_table import TableView
from worker.stream.scored import LaunchTimes
from worker.stream.scorer import BatchJob, Scorer


@dataclass
class InFlight:
    """A closed cycle whose scoring was submitted and whose transaction is not committed yet."""

    cycle: Cycle
    keys: list[SchemaKey]  # the cycle's batches, in the order of the scorer's results
    future: Future
    closed_at: float  # when the loop decided to close the cycle
    planned_visible_at: float | None = None  # when the latency budget's plan expects it visible
    planned_close_at: float | None = None  # when the budget would have closed it (its plan at the close)
    ahead_free_at: float | None = None  # when the budget expected the cycle ahead scored (None: the GPU was free)
    gather_s: float | None = None  # the budget's gathering window at the close (None: no budget)
    submitted_at: float | None = None  # when the loop handed it to the GPU thread (schemas caught up, batches built)
    launched: Future = field(default_factory=Future)  # its ``LaunchTimes``, once its batch is queued on the device
    scored_at: float | None = None  # when its scores were ready (set on the scoring thread)
    handed: bool = False  # handed to the committer (its records made and its offsets named)
    out: Any = None  # its records (``worker.stream.outputs.CycleOutputs``), once handed
    offsets: list | None = None  # what its transaction commits, once handed
    wakes_loop: bool = False  # its scores put a wake-up on the loop's queue (once it waited on them)
    table_view: TableView | None = None  # the schema table it was routed with, until the broker confirms it

    def on_launched(self, times: LaunchTimes) -> None:
        """(GPU thread) Its batch is queued on the device."""
        self.launched.set_result(times)

    def wake_on_scores(self, wakeups: queue.SimpleQueue) -> None:
        """Have ``wakeups`` told (once) when its scores are ready."""
        if not self.wakes_loop:
            self.wakes_loop = True
            self.future.add_done_callback(lambda _: wakeups.put(None))

    @property
    def launch(self) -> LaunchTimes | None:
        """When the GPU thread took it, had its states and queued its batch; None until then."""
        return self.launched.result() if self.launched.done() else None

    def queued_s(self) -> float:
        """Seconds from its handoff to the GPU thread to that thread taking it (0 before either)."""
        launch = self.launch
        if launch is None or self.submitted_at is None:
            return 0.0
        return max(0.0, launch.taken_at - self.submitted_at)

    def latency_fields(self, committed_at: float) -> dict[str, float | None]:
        """Its first state's arrival-to-visible time, once committed at ``committed_at``, what the plan expected under a
        budget, and where the time went: when, after that arrival, the cycle closed, the loop handed it to the GPU
        thread (after the schema catch-up), that thread took it and had its tokenized states, its batch was queued on
        the device and its scores were ready (None where it did not happen: a cycle of dead letters only is never
        launched); and, only where they happened, what stopped it on the way that its times cannot tell: the garbage
        collections that overlapped it (``gc_pauses_ms``: [start since arrival, ms] each) and the CUDA graphs its
        launch captured (``graph_captures``), for ``bench/tail_causes.py``; and, where its states came from tokenizer
        jobs, when the last of them was submitted and was done (``tokenize_submitted_ms``, ``tokenized_ms``), and the
        GPU thread's CPU time from taking it to its launch (``launch_cpu_ms``: the rest of that time it waited); and
        under a budget, the gathering window it planned with at the close (``gather_ms``, ``worker.stream.gathering``:
        0 where the planner closes as soon as the GPU can take the cycle)."""
        arrived_at = self.cycle.arrived_at
        if arrived_at is None:
            return {}
        since_arrival = lambda at: None if at is None else round((at - arrived_at) * 1000, 2)  # noqa: E731
        launch = self.launch
        taken, gathered, launched = (launch.taken_at, launch.gathered_at, launch.launched_at) if launch else (None,) * 3
        stops: dict = {}
        if pauses := gc_pauses.pauses_between(arrived_at, committed_at):
            stops["gc_pauses_ms"] = [[since_arrival(at), round(seconds * 1000, 2)] for at, seconds in pauses]
        if launch is not None and launch.captures:
            stops["graph_captures"] = launch.captures
        if launch is not None and launch.tokenized_at is not None:
            stops["tokenize_submitted_ms"] = since_arrival(launch.tokenize_submitted_at)
            stops["tokenized_ms"] = since_arrival(launch.tokenized_at)
        if launch is not None and launch.cpu_s is not None:
            stops["launch_cpu_ms"] = round(launch.cpu_s * 1000, 3)
        if self.gather_s is not None:
            stops["gather_ms"] = round(self.gather_s * 1000, 2)
        # the arrival on the monotonic clock places cycles on one clock finer than the log's milliseconds (the GPU's
        # idle time between two cycles, for one)
        return {"arrived_monotonic_ms": round(arrived_at * 1000, 3),
                "arrival_to_visible_ms": since_arrival(committed_at),
                "planned_visible_ms": since_arrival(self.planned_visible_at),
                "planned_close_ms": since_arrival(self.planned_close_at),
                "ahead_free_expected_ms": since_arrival(self.ahead_free_at),
                "closed_ms": since_arrival(self.closed_at), "submitted_ms": since_arrival(self.submitted_at),
                "taken_ms": since_arrival(taken),
                "gathered_ms": since_arrival(gathered), "launched_ms": since_arrival(launched),
                "scored_ms": since_arrival(self.scored_at), **stops}


def _stamp_scored(inflight: InFlight | None) -> None:
    """(Scoring thread) ``inflight``'s scores are ready (None: the cycle was dropped meanwhile)."""
    if inflight is not None:
        inflight.scored_at = monotonic()


class CyclesInFlight:
    """The loop's cycles in flight, oldest first, and its wait on the oldest."""

    def __init__(self) -> None:
        self._cycles: deque[InFlight] = deque()
        # a cycle in flight's launch and scores wake the loop's wait through this (``next_message``): a C-level
        # queue, where concurrent.futures.wait built and tore down waiters in Python on every wait
        self._wakeups: queue.SimpleQueue = queue.SimpleQueue()

    def __len__(self) -> int:
        return len(self._cycles)

    def __iter__(self) -> Iterator[InFlight]:
        return iter(self._cycles)

    @property
    def oldest(self) -> InFlight:
        """The cycle whose transaction commits next."""
        return self._cycles[0]

    def submit(self, cycle: Cycle, closed_at: float, budget: CycleBudget, scorer: Scorer,
               table_view: TableView | None = None) -> None:
        """Hand ``cycle``, closed at ``closed_at``, to ``scorer`` as one GPU batch, with ``budget``'s plan for it: it is
        in flight from now on. ``table_view``: the schema table's view it was routed with, not confirmed yet (None: the
        table had caught up with the topic)."""
        if cycle.opened_at is not None:
            metrics.FILL_WAIT.observe(monotonic() - cycle.opened_at)
        keys = list(cycle.batches)
        jobs = [BatchJob(cycle.batches[key].handle, list(cycle.batches[key].rows)) for key in keys]
        if jobs:  # one GPU batch, every schema's states together
            metrics.BATCH_SIZE.observe(sum(len(job.rows) for job in jobs))
        # the plan at the close, before ``submitted`` plans past this cycle: whether the close kept it, and whether the
        # GPU freed when expected, are read from the committed events (bench/stream_windows.py's ``gpu_pipeline``). It
        # is asked as of the cycle's first arrival: asked as of the close, it is never before the close, so a close
        # the loop came to late looked on plan
        planned_close = budget.close_by(cycle.arrived_at if cycle.arrived_at is not None else closed_at, cycle)
        ahead_free = budget.state.gpu_free_at if budget.state is not None and self.gpu_busy() else None
        gather = budget.state.gather_s if budget.state is not None else None
        inflight = InFlight(cycle, keys, Future(), closed_at, budget.submitted(closed_at, cycle),  # before it is in flight
                            planned_close, ahead_free, gather_s=gather, table_view=table_view)
        inflight.submitted_at = monotonic()
        inflight.future = scorer.submit(jobs, on_launched=lambda times: inflight.on_launched(times))
        # through a weak reference: a callback holding the cycle would make future -> callback -> cycle -> future a
        # reference cycle, and every committed cycle's states, records and scores garbage that only the collector
        # frees (~100k objects a collection at 1,000 states/s, 80-600 ms with every thread stopped: issue 46)
        stamp = weakref.ref(inflight)
        inflight.future.add_done_callback(lambda _: _stamp_scored(stamp()))
        self._cycles.append(inflight)

    def pop_oldest(self) -> InFlight:
        """The oldest cycle committed: it is no longer in flight."""
        return self._cycles.popleft()

    def clear(self) -> None:
        """Every cycle in flight was dropped (an abort, a rebalance)."""
        self._cycles.clear()

    def forget_partitions(self, partitions: Collection[tuple[str, int]]) -> tuple[int, list[InFlight]]:
        """Remove the states and offsets of ``partitions`` (given up in a rebalance) from every cycle in flight: the
        device scores them all the same, but they never commit. Returns how many states were removed, and the cycles
        left with nothing to commit, which are no longer in flight."""
        removed = sum(len(inflight.cycle.forget_partitions(partitions, scored=True)) for inflight in self._cycles)
        kept: deque[InFlight] = deque()
        emptied: list[InFlight] = []
        for inflight in self._cycles:
            (emptied if not len(inflight.cycle) and not inflight.cycle.offsets() else kept).append(inflight)
        self._cycles = kept
        return removed, emptied

    def unhanded(self) -> Iterator[InFlight]:
        """The cycles not handed to the committer yet, oldest first (the newest cycles in flight)."""
        return (inflight for inflight in list(self._cycles) if not inflight.handed)

    def unscored(self) -> int:
        """How many cycles are queued on or scored by the GPU thread."""
        return sum(not inflight.future.done() for inflight in self._cycles)

    def wake(self) -> None:
        """End the loop's wait (``next_message``): another thread has something for it (the committer's outcome)."""
        self._wakeups.put(None)

    def gpu_busy(self) -> bool:
        """Whether the last submitted cycle is still being scored."""
        return bool(self._cycles) and not self._cycles[-1].future.done()

    def next_message(self, consumer: Consumer, timeout: float) -> Any:
        """``consumer``'s next message, waiting up to ``timeout`` for one or, while a cycle is being scored, for its
        scores or a transaction's end (``wake``): the cycle is then handed on at once rather than at the end of a
        poll."""
        waiting = next(self.unhanded(), None)
        if waiting is None:
            return consumer.poll(timeout)
        if timeout <= 0 or waiting.future.done():
            return consumer.poll(0)     # it is to be handed on now
        message = consumer.poll(0)
        if message is None:
            self._wait_for(waiting, timeout)
            message = consumer.poll(0)
        return message

    def _wait_for(self, inflight: InFlight, timeout: float) -> None:
        """Wait up to ``timeout`` for ``inflight``'s scores. Another cycle's progress or a transaction's end may end
        the wait early: the loop then merely looks again."""
        inflight.wake_on_scores(self._wakeups)
        while True:                            # forget the wake-ups of what is already done
            try:
                self._wakeups.get_nowait()
            except queue.Empty:
                break
        if inflight.future.done():
            return
        with contextlib.suppress(queue.Empty):
            self._wakeups.get(timeout=timeout)
