"""The consumer's group metadata that each cycle's transaction carries (zombie fencing, KIP-447), kept between cycles.

``Consumer.consumer_group_metadata()`` is a request to librdkafka's own thread, answered on the consumer group's
queue, and confluent-kafka makes it holding the GIL: asked for every cycle, it held the GIL ~7% of the wall time at
~250 cycles a second on the CPU (py-spy --gil; the worker's threads wait on it, the GPU thread's launches
included). The metadata changes only when the group's generation or this member's epoch does, so it is asked again
only when that may have happened: after a rebalance callback (the assignment forgets it), after an aborted
transaction, and at least every ``MAX_AGE_S``. A transaction carrying older metadata than the broker's is never
committed for partitions that moved: the classic protocol's coordinator refuses an older generation
(ILLEGAL_GENERATION), and KIP-848's accepts an older member epoch only for partitions assigned to the member since
that epoch (KIP-1251, in Apache Kafka 4.4); a refusal aborts the transaction like any other, and the cycles are
read again.
"""

from __future__ import annotations

import time
from typing import Any

from confluent_kafka import Consumer

MAX_AGE_S = 1.0
"""How long metadata is used without asking again, where nothing said it changed."""


class GroupMetadata:
    """The latest group metadata asked of a consumer, until ``forget`` or ``MAX_AGE_S``."""

    def __init__(self) -> None:
        self._metadata: Any = None
        self._asked_at = 0.0
        self.asked = 0  # how many times the consumer was asked (the tests count them)

    def current(self, consumer: Consumer) -> Any:
        """The metadata for a transaction committing ``consumer``'s offsets now. Never call it on the consumer's
        thread inside a rebalance callback: librdkafka does not answer there."""
        now = time.monotonic()
        if self._metadata is None or now - self._asked_at >= MAX_AGE_S:
            self._metadata, self._asked_at = consumer.consumer_group_metadata(), now
            self.asked += 1
        return self._metadata

    def forget(self) -> None:
        """The group's generation or this member's epoch may have changed: ask again next time."""
        self._metadata = None
