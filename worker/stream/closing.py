"""When the loop closes its open cycle, and so how long its poll may wait for more states meanwhile.

A cycle closes when its batches are full (--max-batch) or --max-wait-ms after its first state (``Cycle.due``), when a
state's wait for its schema runs out (it becomes a dead letter and its partition flows again), when the latency budget
closes it (``CycleBudget``: as soon as the GPU can take it), or at the end of a finite input. Replay has no
--max-wait-ms: only full batches and the input's end close its cycles. A cycle stays open while it holds nothing but
the states the close before it held back, all still waiting for their schema: nothing of it could commit.
"""

from __future__ import annotations

import math
from typing import Callable

from worker.stream.batcher import Cycle
from worker.stream.latency_budget import CycleBudget


class CycleClosing:
    """The loop's rule for closing its open cycle, with the latency budget (``budget``) it consults."""

    def __init__(self, max_batch: int, max_wait_ms: int | None, budget_ms: int | None,
                 gpu_busy: Callable[[], bool]) -> None:
        self.max_batch = max_batch
        # No --max-wait-ms (replay): only full batches close a cycle, and the input's end closes the last one.
        self.max_wait_s = math.inf if max_wait_ms is None else max_wait_ms / 1000
        self.budget = CycleBudget(budget_ms, self.max_wait_s, gpu_busy, max_batch)
        self._carried = (0, 0)  # states (all, waiting) the open cycle took over, held back, from the one before it

    def due(self, now: float, cycle: Cycle, input_exhausted: Callable[[], bool]) -> bool:
        """Whether the open ``cycle`` closes now."""
        if not len(cycle):
            return False
        wait_deadline = cycle.wait_deadline()
        if wait_deadline is not None and now >= wait_deadline:
            return True  # a wait for a schema ran out: its state becomes a dead letter, its partition flows again
        if cycle.waiting and (len(cycle), len(cycle.waiting)) == self._carried:
            return False  # nothing but the states held back last time, all still waiting: nothing could commit now
        # No deadline closes the last, partial cycle of a finite input: its end does.
        return cycle.due(now, self.max_batch, self.max_wait_s) or self.budget.due(now, cycle) or input_exhausted()

    def poll_timeout(self, now: float, cycle: Cycle, in_flight: bool) -> float:
        """How long the loop may wait for a message before the open ``cycle`` is due (``in_flight``: a cycle is on the
        GPU)."""
        until_due = cycle.seconds_until_due(now, self.max_wait_s)
        wait_deadline = cycle.wait_deadline()
        if wait_deadline is not None:
            until_due = min(until_due if until_due is not None else math.inf, max(0.0, wait_deadline - now))
        # While a cycle is on the GPU the wait ends when its scores are ready (``CyclesInFlight.next_message``); wait
        # briefly all the same, so that messages fetched meanwhile are routed while it runs.
        timeout = 0.005 if in_flight else 0.1
        if until_due is not None:
            close_by = self.budget.close_by(now, cycle)
            until_due = until_due if close_by is None else min(until_due, max(0.0, close_by - now))
        return min(timeout, until_due) if until_due is not None else timeout

    def carried_over(self, cycle: Cycle) -> None:
        """The cycle just opened, ``cycle``, holds the states the close before it held back."""
        self._carried = (len(cycle), len(cycle.waiting))

    def forget(self) -> None:
        """The uncommitted cycles were dropped (an abort, a rebalance): the next cycle follows none."""
        self._carried = (0, 0)
        self.budget.forget_order()
