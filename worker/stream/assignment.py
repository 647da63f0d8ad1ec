"""Where the loop's states come from and where its committed positions go: the consumer and its assignment.

``Worker`` (``worker.stream.loop``) takes one ``Assignment``: ``GroupAssignment`` here for ``decider worker`` (the states
topic shared through the consumer group), ``worker.stream.replay.RangeAssignment`` for ``decider replay`` (a fixed
range of offsets, its end stored in the committed offsets' metadata). The loop itself is the same for both.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Protocol

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, TopicPartition

from worker.ops import liveness
from worker.config import WorkerConfig
from worker.exceptions import FatalError, FencedError
from worker.kafka_clients import worker_consumer_config
from worker.stream.transactions import Transactions

log = logging.getLogger(__name__)

EventSink = Callable[[str, dict[str, Any]], None]
DropUncommitted = Callable[[str], None]


class Assignment(Protocol):
    """The consumer/assignment policy of one loop."""

    def consumer(self) -> Consumer:
        """The states consumer (created once, before ``start``)."""

    def start(self, consumer: Consumer, txns: Transactions, drop_uncommitted: DropUncommitted) -> None:
        """Begin consuming (after the transactional producer fenced any predecessor)."""

    def accepts(self, message: Any) -> bool:
        """Whether ``message`` is part of the input; one that is not is neither scored nor committed."""

    def commit_offsets(self, offsets: list[TopicPartition]) -> list[TopicPartition]:
        """The offsets to send with a cycle's transaction (``offsets`` plus any metadata they carry)."""

    def on_committed(self, offsets: list[TopicPartition]) -> None:
        """``offsets`` are committed."""

    def rewind_positions(self, consumer: Consumer) -> list[TopicPartition]:
        """After an abort: where each partition's reading starts again (its committed offset)."""

    def exhausted(self) -> bool:
        """Whether the input has ended (nothing more will arrive): the last cycle then closes without a deadline."""

    def finish(self, txns: Transactions) -> None:
        """After the last cycle committed on a clean stop: whatever the input still has to commit."""

    def leave(self, consumer: Consumer) -> None:
        """Give the partitions up before the consumer closes."""


class GroupAssignment:
    """The states topic through the consumer group: partitions come and go with rebalances."""

    def __init__(self, config: WorkerConfig, on_event: EventSink | None = None) -> None:
        self._config = config
        self._emit = on_event or (lambda kind, info: None)
        self._drop_uncommitted: DropUncommitted = lambda why: None

    def consumer(self) -> Consumer:
        return Consumer(worker_consumer_config(self._config))

    def start(self, consumer: Consumer, txns: Transactions, drop_uncommitted: DropUncommitted) -> None:
        self._drop_uncommitted = drop_uncommitted
        consumer.subscribe([self._config.topics.states], on_assign=self._on_assign, on_revoke=self._on_revoke,
                           on_lost=self._on_lost)

    def accepts(self, message: Any) -> bool:
        return True

    def commit_offsets(self, offsets: list[TopicPartition]) -> list[TopicPartition]:
        return offsets

    def on_committed(self, offsets: list[TopicPartition]) -> None:
        pass

    def rewind_positions(self, consumer: Consumer) -> list[TopicPartition]:
        assignment = consumer.assignment()
        if not assignment:
            return []
        # No committed offset yet: the group starts from the beginning (auto.offset.reset=earliest).
        return [TopicPartition(tp.topic, tp.partition, tp.offset if tp.offset >= 0 else OFFSET_BEGINNING)
                for tp in consumer.committed(assignment, timeout=10)]

    def exhausted(self) -> bool:
        return False

    def finish(self, txns: Transactions) -> None:
        pass

    def leave(self, consumer: Consumer) -> None:
        # A static member does not leave the group on close(); unsubscribing does, so a stopped worker's
        # partitions go to the others now rather than after session.timeout.ms. Serve the revoke and let the
        # LeaveGroup request go out before close() tears the client down.
        consumer.unsubscribe()
        deadline = time.monotonic() + 1.0
        while consumer.assignment() and time.monotonic() < deadline:
            consumer.poll(0.05)
        consumer.poll(0.2)

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._emit("assigned", self._where(partitions))

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # Eager rebalancing revokes everything; uncommitted work is dropped, never committed, because
        # the next owner starts from the committed offsets and would score those states again.
        self._drop_uncommitted("partitions revoked")
        self._emit("revoked", self._where(partitions))

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # Lost (session expired): another worker may already own them; committing would be wrong, and a
        # transaction with stale group metadata would be rejected anyway.
        self._drop_uncommitted("partitions lost")
        self._emit("lost", self._where(partitions))

    def _where(self, partitions: list[TopicPartition]) -> dict[str, Any]:
        """A rebalance event's fields: the topic and group it happened in (a worker started without --group joins
        the default group, and whoever is in it rebalances with it), this worker, and the partitions."""
        return {"topic": self._config.topics.states, "group": self._config.group, "worker_id": self._config.worker_id,
                "partitions": [p.partition for p in partitions]}


def check_consumer_error(error: KafkaError, config: WorkerConfig) -> None:
    """Raise ``FencedError``/``FatalError`` for a consumer error the loop cannot go on from; log any other."""
    # librdkafka reports a fatal consumer error as a _FATAL event whose text names the cause.
    fatal = error.fatal() or error.code() in (KafkaError._FATAL, KafkaError.FENCED_INSTANCE_ID)
    if fatal and "fenc" in error.str().lower():
        raise FencedError(f"consumer fenced: another worker joined group {config.group} with --worker-id "
                          f"{config.worker_id} and took over; this instance stops. Give each worker a unique --worker-id.")
    if fatal:
        raise FatalError(f"fatal consumer error: {error.str()}")
    if error.code() != KafkaError._PARTITION_EOF:
        log.warning("consumer: %s", error.str())


def seek_committed(assignment: Assignment, consumer: Consumer, outage_s: float) -> None:
    """Move ``consumer`` back to ``assignment``'s committed positions, retried while the broker does not answer
    (``BrokerOutageError`` after ``outage_s``)."""
    while True:
        try:
            for tp in assignment.rewind_positions(consumer):
                consumer.seek(tp)
            return
        except KafkaException as exc:
            liveness.BROKER.failed(f"reading the committed offsets: {exc.args[0].str()}")
            liveness.BROKER.check_outage(outage_s)
            log.warning("could not rewind to the committed offsets yet (%s); retrying", exc.args[0].str())
            time.sleep(0.5)


def partition_names(partitions: list[TopicPartition], with_offsets: bool = False) -> str:
    """``topic[p]`` (``@offset``) for a log line."""
    return ", ".join(f"{p.topic}[{p.partition}]" + (f"@{p.offset}" if with_offsets else "") for p in partitions) or "nothing"

