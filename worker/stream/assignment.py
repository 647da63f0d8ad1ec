"""Where the loop's states come from and where its committed positions go: the consumer and its assignment.

``Worker`` (``worker.stream.loop``) takes one ``Assignment``: ``GroupAssignment`` here for ``decider worker`` (the states
topic shared through the consumer group), ``worker.stream.replay.RangeAssignment`` for ``decider replay`` (a fixed
range of offsets, its end stored in the committed offsets' metadata). The loop itself is the same for both.

The group rebalances incrementally: on the classic protocol with the cooperative-sticky assignor, or on KIP-848's
consumer protocol, where the broker assigns. A rebalance then revokes only the partitions that change owner; the
worker drops their uncommitted work (``worker.stream.revocation``) and goes on scoring the others. An eager assignor
(``[kafka] "partition.assignment.strategy" = "range"``) revokes every partition of every worker, which drops all of
it. ``choose_group_protocol`` picks the protocol when the worker starts.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Collection, Protocol

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, TopicPartition

from worker.ops import liveness
from worker.config import WorkerConfig
from worker.exceptions import AbortableError, BrokerOutageError, ConfigError, FatalError, FencedError
from worker.kafka_clients import (CONSUMER_GROUP_HEARTBEAT_API, broker_api_keys, incremental_rebalancing,
                                  is_embedded_broker, worker_consumer_config)
from worker.stream.group_metadata import GroupMetadata
from worker.stream.turns import TakingTurns, complete_hanging_offsets

log = logging.getLogger(__name__)

EventSink = Callable[[str, dict[str, Any]], None]
DropUncommitted = Callable[[str, Collection[TopicPartition] | None], None]
"""The loop's: forget the uncommitted work of these partitions (None: all of it), for this reason."""

CLASSIC_ONLY_KAFKA_KEYS = ("partition.assignment.strategy", "heartbeat.interval.ms")
"""[kafka] settings that only the classic protocol has: given, they choose it when --group-protocol is left out."""

EMBEDDED_BROKER_REJOIN_PAUSE_S = 0.05
"""On the embedded development broker only (``worker.kafka_clients.is_embedded_broker``), after a cooperative revoke the
rebalance callback returns no sooner than this. Returning is what makes the worker rejoin the group, and noida-db 0.2.3
loses a joining member's pending JoinGroup when another member rejoins within ~10 ms of the round that admitted it: the
group then waits for that member until the rebalance timeout (max.poll.interval.ms, 5 minutes). Measured there with two
joins in a row: returning after 0-10 ms stalled the group in 4 of 5 runs, after 20 ms in none of 20, after 50 ms in none
of 20. Apache Kafka needs no pause, and gets none (the group tests run there without it)."""


def choose_group_protocol(config: WorkerConfig, api_keys: set[int] | None) -> tuple[str, str]:
    """(the group protocol the worker joins with, why), given the broker's ``api_keys`` (``broker_api_keys``; None:
    unknown): the one asked for, else the best one the broker offers (KIP-848's consumer protocol where its
    ConsumerGroupHeartbeat API is listed) unless a setting only the classic protocol has was given. ``ConfigError`` when
    --group-protocol consumer asks a broker that lacks it: librdkafka would retry the join forever without a word."""
    asked = config.requested_group_protocol
    if asked == "classic":
        return "classic", "asked for"
    offered = None if api_keys is None else CONSUMER_GROUP_HEARTBEAT_API in api_keys
    if asked == "consumer":
        if offered is False:
            raise ConfigError(f"--group-protocol consumer: the broker at {config.bootstrap} does not offer KIP-848's consumer "
                              "group protocol (Apache Kafka 4.0 or later has it); use --group-protocol classic, or leave "
                              "it out for the best one the broker has")
        return "consumer", "asked for"
    classic_settings = [f"[kafka] {key}" for key in CLASSIC_ONLY_KAFKA_KEYS if key in config.kafka]
    classic_settings += ["--session-timeout-ms"] if config.session_timeout_ms is not None else []
    if classic_settings:
        return "classic", f"{' and '.join(classic_settings)} given, which only the classic protocol has"
    if offered is None:
        return "classic", "the broker's API versions could not be read, and every broker has the classic protocol"
    if offered:
        return "consumer", "the broker offers KIP-848's"
    return "classic", "the broker does not offer KIP-848's consumer protocol"


class Assignment(Protocol):
    """The consumer/assignment policy of one loop."""

    metadata: GroupMetadata  # the group metadata cycles' transactions carry, forgotten where it may have changed

    def consumer(self) -> Consumer:
        """The states consumer (created once, before ``start``)."""

    def start(self, consumer: Consumer, txns: TakingTurns | None, drop_uncommitted: DropUncommitted) -> None:
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

    def finish(self, txns: TakingTurns) -> None:
        """After the last cycle committed on a clean stop: whatever the input still has to commit."""

    def leave(self, consumer: Consumer) -> None:
        """Give the partitions up before the consumer closes."""


class GroupAssignment:
    """The states topic through the consumer group: partitions come and go with rebalances."""

    def __init__(self, config: WorkerConfig, on_event: EventSink | None = None) -> None:
        self._config = config
        self._emit = on_event or (lambda kind, info: None)
        self._drop_uncommitted: DropUncommitted = lambda why, partitions: None
        self.protocol = "classic"
        self.incremental = False  # whether a rebalance revokes only the partitions that move (else: every one)
        self.rejoin_pause_s = 0.0  # how long a cooperative revoke waits before it rejoins: the embedded broker's gap
        self.session_lost_at: float | None = None  # monotonic time this worker's partitions were last lost
        self._txns: TakingTurns | None = None
        self._heal_due = False  # partitions were lost: their offsets may hang in a transaction (`_on_assign`)
        self._leaving = False
        self.metadata = GroupMetadata()   # forgotten at every rebalance callback: the generation or epoch moves

    def consumer(self) -> Consumer:
        classic = self._config.requested_group_protocol == "classic"  # then the broker need not be asked
        self.protocol, why = choose_group_protocol(self._config, None if classic else broker_api_keys(self._config.cluster))
        settings = worker_consumer_config(self._config, self.protocol)
        self.incremental = incremental_rebalancing(settings)
        if self.protocol == "classic" and self.incremental and is_embedded_broker(self._config.cluster):
            self.rejoin_pause_s = EMBEDDED_BROKER_REJOIN_PAUSE_S
            log.info("the broker is the embedded development broker (noida-db): a cooperative revoke waits %.0f ms "
                     "before the worker rejoins (it loses a JoinGroup that follows another within ~10 ms)",
                     self.rejoin_pause_s * 1000)
        self._emit("group_protocol", {"group": self._config.group, "protocol": self.protocol, "why": why,
                                      "rebalancing": "incremental" if self.incremental else "eager"})
        try:
            return Consumer(settings)
        except KafkaException as exc:  # a [kafka] setting librdkafka refuses only in a consumer (an unknown assignor)
            raise ConfigError(f"the states consumer's settings: {exc.args[0].str()}") from None

    def start(self, consumer: Consumer, txns: TakingTurns | None, drop_uncommitted: DropUncommitted) -> None:
        self._drop_uncommitted, self._txns = drop_uncommitted, txns
        if txns is not None:  # without transactions of its own, the worker can neither have left nor heal pending offsets
            complete_hanging_offsets(self._config, consumer, txns)
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

    def finish(self, txns: TakingTurns) -> None:
        pass

    def leave(self, consumer: Consumer) -> None:
        # A static member does not leave the group on close(); unsubscribing does, so a stopped worker's
        # partitions go to the others now rather than after session.timeout.ms. Serve the revoke and let the
        # LeaveGroup request go out before close() tears the client down.
        self._leaving = True
        consumer.unsubscribe()
        deadline = time.monotonic() + 1.0
        while consumer.assignment() and time.monotonic() < deadline:
            consumer.poll(0.05)
        consumer.poll(0.2)

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self.metadata.forget()
        if self._heal_due and self._txns is not None and partitions:
            # Lost in a broker outage, the last transaction may have been committing while the broker restarted: its
            # offsets can then hang pending for good (`complete_hanging_offsets`), and librdkafka would retry their
            # fetch without a word. Nothing of this worker is in flight here: the loss dropped it all, after the
            # transaction running had ended (`_on_lost`).
            self._heal_due = False
            try:
                complete_hanging_offsets(self._config, consumer, self._txns, partitions)
            except (KafkaException, AbortableError) as exc:  # the broker just back: no worse off than unchecked
                log.warning("could not check the committed offsets of partitions %s after their loss (%s): reading "
                            "them starts when they answer", [p.partition for p in partitions], exc)
        # Incremental: ``partitions`` are the ones added, the others stay; eager: the whole new assignment. Each
        # starts at its committed offset.
        (consumer.incremental_assign if self.incremental else consumer.assign)(partitions)
        self._emit("assigned", self._where(partitions))

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self.metadata.forget()
        # The next owner starts from the committed offsets and scores their states again: what this worker has of
        # them uncommitted is dropped, never committed. Incremental: only the revoked partitions'; eager revokes all.
        called = time.monotonic()
        self._drop_uncommitted("partitions revoked", partitions if self.incremental else None)
        self._give_up(consumer, partitions)
        self._emit("revoked", self._where(partitions))
        if self.rejoin_pause_s and not self._leaving:
            time.sleep(max(0.0, called + self.rejoin_pause_s - time.monotonic()))

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self.metadata.forget()
        # Lost (session expired): another worker may already own them; committing would be wrong, and a
        # transaction with stale group metadata would be rejected anyway.
        self.session_lost_at = time.monotonic()
        self._drop_uncommitted("partitions lost", None)
        self._heal_due = True
        self._give_up(consumer, partitions)
        self._emit("lost", self._where(partitions))

    def _give_up(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """Stop fetching ``partitions``: messages of theirs already fetched are never returned after this."""
        if self.incremental:
            consumer.incremental_unassign(partitions)
        else:
            consumer.unassign()

    def _where(self, partitions: list[TopicPartition]) -> dict[str, Any]:
        """A rebalance event's fields: the topic and group it happened in (a worker started without --group joins
        the default group, and whoever is in it rebalances with it), this worker, and the partitions."""
        return {"topic": self._config.topics.states, "group": self._config.group, "worker_id": self._config.worker_id,
                "partitions": [p.partition for p in partitions]}


FENCED_AFTER_LOST_S = 60.0
"""A static member's fencing this soon after its own partitions were lost is taken for its own stale membership."""


def check_consumer_error(error: KafkaError, config: WorkerConfig, session_lost_at: float | None = None) -> None:
    """Raise ``FencedError``/``FatalError`` for a consumer error the loop cannot go on from; log any other.
    ``session_lost_at``: when this worker last lost its partitions (its group session expired), if it did."""
    # librdkafka reports a fatal consumer error as a _FATAL event whose text names the cause.
    fatal = error.fatal() or error.code() in (KafkaError._FATAL, KafkaError.FENCED_INSTANCE_ID)
    fenced = fatal and "fenc" in error.str().lower()
    if fenced and session_lost_at is not None and time.monotonic() - session_lost_at < FENCED_AFTER_LOST_S:
        # Seen on Apache Kafka when a broker outage or overload outlasted the session: librdkafka's classic protocol
        # rejoins with a new member id under the same group.instance.id, a request of the old one is then refused
        # with FENCED_INSTANCE_ID, and librdkafka makes that fatal (confluentinc/librdkafka#3437). Not another worker:
        # a restart recovers, so exit as for an outage, not with "give each worker a unique id".
        raise BrokerOutageError(f"consumer fenced right after its group session expired: the classic protocol's "
                                f"static membership (--worker-id {config.worker_id}) rejoined as a new member and "
                                f"librdkafka refuses to go on (confluentinc/librdkafka#3437); restart it with the same "
                                f"--worker-id. The consumer protocol (--group-protocol consumer, Kafka 4.0+) has no "
                                f"such fencing")
    if fenced:
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

