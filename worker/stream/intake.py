"""The loop's first hop: polled messages into the open cycle.

Each message is an error to act on (``worker.stream.assignment.check_consumer_error``) or a record: tracked in the
cycle with its arrival (for the latency budget), decoded (``worker.formats.input_decoder``; a record that cannot be
scored goes to the dead letters with the reason) and routed to its schema's batch (``worker.stream.routing``).
"""

from __future__ import annotations

from typing import Callable

from worker.config import WorkerConfig
from worker.formats.input_decoder import SourceDecoder
from worker.formats.records import SourceRecord, Unscorable
from worker.stream.assignment import Assignment, check_consumer_error
from worker.stream.batcher import Cycle, Pending, monotonic
from worker.stream.latency_budget import CycleBudget
from worker.stream.outputs import Outputs
from worker.stream.routing import Router


class Intake:
    """Takes polled messages into a cycle: ``take`` one, ``take_fetched`` one and every message already fetched."""

    def __init__(self, config: WorkerConfig, assignment: Assignment, decoder: SourceDecoder, outputs: Outputs,
                 router: Router, budget: CycleBudget) -> None:
        self.config, self.assignment, self.decoder = config, assignment, decoder
        self.outputs, self.router, self.budget = outputs, router, budget

    def take_fetched(self, message, consumer, cycle: Callable[[], Cycle]) -> None:
        """``message`` (what a wait brought, or None) and every message already fetched after it, up to a full batch,
        into the open cycle, ``cycle()``: asked again for every message, since a revoke during a poll drops the
        uncommitted work and opens a new cycle.

        Poll one message at a time: rebalance callbacks then run between two messages, never in the middle of a
        fetched batch, so no message of a revoked assignment is routed after the revoke. --max-wait-ms ends the
        *wait* for more states, never the taking of states already here: a backlog is taken in full batches
        (a deadline on taking would cap batches at what one deadline's worth of routing allows, below the
        load the GPU can carry)."""
        count = 0
        try:
            while message is not None:
                self.take(message, cycle())
                count += 1
                if count >= self.config.max_batch or cycle().full(self.config.max_batch):
                    return
                message = consumer.poll(0)
        finally:
            self.router.flush()  # the states routed here are tokenized together

    def take(self, message, cycle: Cycle) -> None:
        """One polled message: an error to act on, or a record to decode and route."""
        if not self.assignment.accepts(message):
            return
        if message.error() is not None:
            # Only the group's assignment has a session to lose (a replay's fixed range has none).
            return check_consumer_error(message.error(), self.config, getattr(self.assignment, "session_lost_at", None))
        timestamp_ms = message.timestamp()[1]
        pending = Pending(SourceRecord(message.topic(), message.partition(), message.offset(), message.key(), message.value(),
                                       message.headers(), timestamp_ms))
        now = monotonic()
        cycle.track(pending, now, self.budget.arrival(now, timestamp_ms))
        try:
            pending.state = self.decoder.decode(pending.source)
        except Unscorable as exc:
            pending.state = exc.state  # the ids read before it failed, for the dead letter
            return self.outputs.reject(pending, exc.reason, str(exc))
        self.router.route(pending, cycle, monotonic())
