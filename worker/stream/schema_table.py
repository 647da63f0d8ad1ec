"""The schema table: the whole compacted schema topic, read by every worker as a key -> latest value map.

Read outside the consumer group (every partition assigned from the beginning, no offsets committed):
each worker needs every schema, not a share of them. Last write wins per key, as compaction would
leave it, and a tombstone (null value) deletes the key. The table keeps consuming while the worker
runs; ``catch_up()`` reads to the current end of the topic, so a schema published before a state was
consumed is known when that state's batch closes.

A cycle's close does not wait for that round trip (issue 46: 2.2 ms a close on Apache Kafka on this project's CPU
machine, serial with the GPU): ``view()`` notes what the table has applied and asks for the topic's end in the
background, the cycle is scored meanwhile, and before its records are made ``missed(view)`` says whether a record
published before the close was not yet applied then (rare: the table's reader fetches new records within a round
trip). Only then does the loop catch up, and ``changed_since`` tells it whether the cycle's states named a schema that
changed (their cycle is then read again).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, TopicPartition

import schemas
from worker.exceptions import BrokerUnavailableError
from worker.config import Cluster, Topics
from worker.kafka_clients import as_cluster, create_topics_command, reader_consumer
from worker.ops import liveness

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Change:
    """One applied schema-topic record: ``record`` None means the id was deleted."""

    schema_id: str
    record: dict[str, Any] | None


@dataclass(frozen=True)
class TableView:
    """What the table had applied when a cycle closed (``positions`` per partition, ``generation``: its count of applied
    changes), and the topic's end offsets asked for right after (``ends``: a future of partition -> end)."""

    positions: dict[int, int]
    generation: int
    ends: Future


class BrokenSchema(dict):
    """A schema-topic value that is present but unusable (undecodable or invalid); states naming it are
    dead-lettered as ``schema_unpreparable`` with ``problem`` as the message."""

    def __init__(self, schema_id: str, version: int, problem: str) -> None:
        super().__init__(schema_id=schema_id, version=version, questions=[], mode="packed")
        self.problem = problem


OFFSET_LATEST_TIME = -1
"""ListOffsets' timestamp for a partition's latest offset (its end)."""
_LEADER_MOVING = (KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE, KafkaError.UNKNOWN_TOPIC_OR_PART)


class SchemaTable:
    """Latest QuestionSchema record per schema id, kept current from the schema topic."""

    def __init__(self, cluster: Cluster | str, topic: str, consumer: Consumer | None = None) -> None:
        self._topic = topic
        self._consumer = consumer or reader_consumer(cluster)
        metadata = self._consumer.list_topics(topic, timeout=10).topics.get(topic)
        if metadata is None or metadata.error is not None or not metadata.partitions:
            bootstrap = as_cluster(cluster).bootstrap
            raise BrokerUnavailableError(f"schema topic {topic} does not exist on {bootstrap} (a typo?); if the name is "
                                         f"right, create it with: {create_topics_command(bootstrap, Topics(schemas=topic))}")
        self._partitions = [TopicPartition(topic, p, OFFSET_BEGINNING) for p in sorted(metadata.partitions)]
        self._consumer.assign(self._partitions)
        # catch_up() asks the broker for the partitions' ends through a second client that never fetches. Kafka
        # answers one request at a time per connection, and the consumer above always has a Fetch parked at the
        # broker for up to its fetch.wait.max.ms (50) while the topic is idle: a ListOffsets sent behind it waited out
        # the rest of that wait, at every cycle's close. Measured on librdkafka's mock cluster, which holds fetches and
        # orders responses the same way: 0-49 ms a query (p50 20), against 0.1 ms on noida-db, which never waits.
        self._ends = reader_consumer(cluster)
        self._latest: dict[str, dict[str, Any]] = {}
        self._highest_version: dict[str, int] = {}  # survives tombstones (until compaction drops them)
        self._broken_versions = 0  # pseudo-versions for broken records, so each one differs from the last
        self._generation = 0  # changes applied so far
        self._changed_at: dict[str, int] = {}  # schema id -> the generation of its last change
        self._end_queries = ThreadPoolExecutor(1, thread_name_prefix="decider-schema-ends")

    def get(self, schema_id: str) -> dict[str, Any] | None:
        """The latest record for ``schema_id`` (a ``BrokenSchema`` if unusable), or None if unknown/deleted."""
        return self._latest.get(schema_id)

    def highest_version(self, schema_id: str) -> int:
        """The highest version ever read for ``schema_id``, deleted or not (0 if never seen): a re-created
        schema continues the numbering, so (id, version) never names two different question sets."""
        return self._highest_version.get(schema_id, 0)

    def ids(self) -> list[str]:
        """Schema ids currently in the table."""
        return sorted(self._latest)

    def deleted_ids(self) -> set[str]:
        """Schema ids published once whose latest record is a tombstone (until compaction drops them)."""
        return set(self._highest_version) - set(self._latest)

    def poll(self, max_records: int = 500) -> list[Change]:
        """Apply whatever the topic has ready now, without waiting; returns what changed."""
        changes: list[Change] = []
        for message in self._consumer.consume(max_records, timeout=0):
            change = self._apply(message)
            if change is not None:
                changes.append(change)
        return changes

    def _end_offsets(self, deadline: float) -> dict[int, int]:
        """Every partition's end offset, in one ListOffsets request for the latest offset of each (Kafka's timestamp
        -1). ``get_watermark_offsets`` asks for the earliest offset too, a second request per partition at every
        cycle's close: against Apache Kafka on this project's CPU machine 239 against 101 us a query and twice the
        client's CPU (issue 46). Read committed, as the table reads: the last stable offset. Asked again while a
        leader is moving or not yet elected (Apache Kafka answers NOT_LEADER_FOR_PARTITION for a moment after the
        topic's creation, its metadata already naming the leader)."""
        while True:
            try:
                found = self._ends.offsets_for_times([TopicPartition(self._topic, tp.partition, OFFSET_LATEST_TIME)
                                                      for tp in self._partitions],
                                                     timeout=max(0.1, deadline - time.monotonic()))
                error = next((tp.error for tp in found if tp.error is not None), None)
                if error is None:
                    return {tp.partition: tp.offset for tp in found}
            except KafkaException as exc:
                error = exc.args[0]
            if not (error.retriable() or error.code() in _LEADER_MOVING) or time.monotonic() > deadline:
                raise KafkaException(error)
            time.sleep(0.05)

    def catch_up(self, timeout_s: float = 5.0) -> list[Change]:
        """Read until every partition's position reaches the end it had when called."""
        deadline = time.monotonic() + timeout_s
        ends = self._end_offsets(deadline)
        changes: list[Change] = []
        while not self._reached(ends):
            if time.monotonic() > deadline:
                log.warning("schema topic %s: could not catch up within %.1f s", self._topic, timeout_s)
                break
            for message in self._consumer.consume(500, timeout=0.05):
                change = self._apply(message)
                if change is not None:
                    changes.append(change)
        return changes

    def view(self) -> TableView:
        """What the table has applied now, and a query of the topic's end started now (``missed`` reads it): a
        cycle closing with this view is scored without waiting for the broker."""
        deadline = time.monotonic() + 5.0
        ends = self._end_queries.submit(self._end_offsets, deadline)
        return TableView(self._applied_positions(), self._generation, ends)

    def missed(self, view: TableView, timeout_s: float = 5.0) -> bool | None:
        """Whether a record was in the topic when ``view`` was taken that the table had not applied then; None when
        the broker did not answer the query of its end (within ``timeout_s``: usually answered already)."""
        try:
            ends = view.ends.result(timeout=timeout_s)
        except Exception as exc:  # KafkaException, or the query's own timeout
            log.debug("schema topic %s: the end offsets' query failed: %r", self._topic, exc)
            return None
        return not _covers(view.positions, ends)

    def changed_since(self, view: TableView, schema_ids: set[str]) -> bool:
        """Whether any of ``schema_ids`` changed (a new version, a tombstone, a broken record) after ``view``."""
        return any(self._changed_at.get(schema_id, 0) > view.generation for schema_id in schema_ids)

    def catch_up_if_answered(self, timeout_s: float = 5.0) -> list[Change] | None:
        """``catch_up``, reporting to ``worker.ops.liveness`` whether the broker answered; None when it did not."""
        try:
            changes = self.catch_up(timeout_s=timeout_s)
        except KafkaException as exc:
            liveness.BROKER.failed(f"schema topic: {exc.args[0].str()}")
            return None
        liveness.BROKER.succeeded()
        return changes

    def _reached(self, ends: dict[int, int]) -> bool:
        return _covers(self._applied_positions(), ends)

    def _applied_positions(self) -> dict[int, int]:
        """Per partition, the offset of the next record the table will apply. A negative position means nothing was
        fetched yet: 0, which covers only an empty partition."""
        positions = self._consumer.position([TopicPartition(self._topic, tp.partition) for tp in self._partitions])
        return {tp.partition: max(tp.offset, 0) for tp in positions}

    def _apply(self, message) -> Change | None:
        change = self._applied(message)
        if change is not None:
            self._generation += 1
            self._changed_at[change.schema_id] = self._generation
        return change

    def _applied(self, message) -> Change | None:
        if message.error() is not None:
            if message.error().code() != KafkaError._PARTITION_EOF:
                log.warning("schema topic: %s", message.error().str())
            return None
        key = message.key().decode("utf-8", errors="replace") if message.key() is not None else None
        if key is None:
            log.warning("schema topic %s offset %d has no key; ignored", self._topic, message.offset())
            return None
        if message.value() is None:
            self._latest.pop(key, None)
            log.info("schema %s deleted (tombstone)", key)
            return Change(key, None)
        record = self._decode(key, message)
        if not isinstance(record, BrokenSchema):
            self._highest_version[key] = max(self._highest_version.get(key, 0), int(record["version"]))
        self._latest[key] = record
        return Change(key, record)

    def _decode(self, key: str, message) -> dict[str, Any]:
        where = f"schema topic {self._topic} partition {message.partition()} offset {message.offset()}"
        try:
            record = schemas.decode_question_schema(message.value())
        except ValueError as exc:
            return self._broken(key, f"{where} is not a valid QuestionSchema: {exc}")
        if record["schema_id"] != key:
            return self._broken(key, f"{where}: key {key!r} but schema_id {record['schema_id']!r}")
        # Question-level checks (option counts, duplicates, temperatures) are the engine's: a schema it
        # rejects in prepare() dead-letters its states as schema_unpreparable, with the engine's message.
        return record

    def _broken(self, key: str, problem: str) -> BrokenSchema:
        log.warning("%s", problem)
        self._broken_versions -= 1
        return BrokenSchema(key, self._broken_versions, problem)

    def close(self) -> None:
        """Close both clients (after the end offsets' query running, if any)."""
        self._end_queries.shutdown(wait=True, cancel_futures=True)
        try:
            self._consumer.close()
        finally:
            self._ends.close()


def _covers(positions: dict[int, int], ends: dict[int, int]) -> bool:
    """Whether ``positions`` have reached ``ends`` in every partition: nothing published before them is left."""
    return all(positions.get(partition, 0) >= end for partition, end in ends.items())
