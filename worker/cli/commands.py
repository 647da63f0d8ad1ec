"""The CLI's client-side operations: publish schemas and states, read topics back as JSON.

Kept apart from ``cli.py`` so tests and the demo call the same code the commands run.
"""

from __future__ import annotations

import difflib
import json
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

from confluent_kafka import OFFSET_BEGINNING, OFFSET_END, KafkaError, KafkaException, TopicPartition

import schemas
from worker.config import Cluster, Topics
from worker.exceptions import BrokerUnavailableError, ConfigError
from worker.kafka_clients import as_cluster, plain_producer, reader_consumer, require_topics
from worker.formats.output_formats import OutputDecoder, json_ready
from worker.formats.records import question_schema_record
from worker.formats.registry import RegistryConfig
from worker.stream.schema_table import BrokenSchema, SchemaTable
from worker.cli.user_files import load_schema_file


def _deliver(producer, what: str) -> None:
    """Flush ``producer`` and raise if anything was not delivered."""
    remaining = producer.flush(30)
    if remaining:
        raise BrokerUnavailableError(f"{remaining} {what} were not delivered within 30 s; is the broker up?")


def put_schema(cluster: Cluster | str, topics: Topics, schema_id: str, path: str | Path,
               version: int | None = None) -> tuple[dict[str, Any], bool]:
    """Publish the schema file at ``path`` as the next version of ``schema_id`` -> (the record, whether it was
    published). Idempotent: a file whose content equals the latest version's publishes nothing and returns that
    version (workers would prepare it again under a new version number for nothing). An explicit ``version`` is
    always published."""
    if not schema_id:
        raise ConfigError("--id must not be empty")
    document = load_schema_file(path)
    require_topics(cluster, [topics.schemas], roles=topics)
    if version is None:
        latest, version = latest_schema(cluster, topics, schema_id)
        if latest is not None and not isinstance(latest, BrokenSchema) and _same_content(latest, document):
            return latest, False
    record = question_schema_record(document, schema_id, version)
    publish_schema(cluster, topics, record)
    return record, True


def latest_schema(cluster: Cluster | str, topics: Topics, schema_id: str) -> tuple[dict[str, Any] | None, int]:
    """(the latest record of ``schema_id`` in the schemas topic, None if none or deleted, a ``BrokenSchema`` if
    unusable; the version the next one gets)."""
    table = SchemaTable(cluster, topics.schemas)
    try:
        table.catch_up()
        return table.get(schema_id), table.highest_version(schema_id) + 1
    finally:
        table.close()


def published_schemas(cluster: Cluster | str, topics: Topics) -> tuple[dict[str, dict[str, Any]], set[str]]:
    """(the latest record of every schema id the schemas topic holds, by id, a ``BrokenSchema`` where unusable; the ids
    whose latest record is a tombstone)."""
    require_topics(cluster, [topics.schemas], roles=topics)
    table = SchemaTable(cluster, topics.schemas)
    try:
        table.catch_up()
        return {schema_id: table.get(schema_id) for schema_id in table.ids()}, table.deleted_ids()
    finally:
        table.close()


_LISTED = 8  # schema ids an error lists at most


def require_schema(cluster: Cluster | str, topics: Topics, schema_id: str, fix: str) -> dict[str, Any]:
    """The latest record of ``schema_id``; ``ConfigError`` (exit 2) when the schemas topic does not hold it (never
    published, a typo, or deleted), with the id meant where one is close and ``fix``, what the user can do instead."""
    held, deleted = published_schemas(cluster, topics)
    if schema_id in held:
        return held[schema_id]
    if schema_id in deleted:
        raise ConfigError(f"schema {schema_id!r} was deleted from {topics.schemas}; {fix}")
    close = difflib.get_close_matches(schema_id, sorted(held), n=1)
    listed = ", ".join(map(repr, sorted(held)[:_LISTED])) + (f", ... ({len(held)} in all)" if len(held) > _LISTED else "")
    hint = f"did you mean {close[0]!r}?" if close else f"it holds {listed}" if held else "it holds no schema"
    raise ConfigError(f"schema {schema_id!r} is not in {topics.schemas} ({hint}); {fix}")


def publish_schema(cluster: Cluster | str, topics: Topics, record: dict[str, Any]) -> None:
    """Publish a QuestionSchema record (keyed by its schema id) and wait until the broker has it."""
    producer = plain_producer(cluster)
    producer.produce(topics.schemas, key=record["schema_id"].encode(), value=schemas.encode_question_schema(record))
    _deliver(producer, "schema records")


def _same_content(published: dict[str, Any], document: dict[str, Any]) -> bool:
    """Whether ``document`` as a record equals the ``published`` one but for its version and creation time (both
    through Avro, so optional fields compare with their defaults filled in)."""
    stamp = {"version": published["version"], "created_at": published["created_at"]}
    candidate = {**question_schema_record(document, published["schema_id"], published["version"]), **stamp}
    return schemas.decode_question_schema(schemas.encode_question_schema(candidate)) == published


def delete_schema(cluster: Cluster | str, topics: Topics, schema_id: str) -> int:
    """Publish a tombstone for ``schema_id``: workers forget it; later states for it are dead-lettered. ``ConfigError``
    when the schemas topic does not hold it (a typo would otherwise print "deleted" and delete nothing). -> the
    version deleted."""
    if not schema_id:
        raise ConfigError("--id must not be empty")
    record = require_schema(cluster, topics, schema_id, "nothing deleted (decider schema list shows the schemas)")
    producer = plain_producer(cluster)
    producer.produce(topics.schemas, key=schema_id.encode(), value=None)
    _deliver(producer, "tombstones")
    return int(record["version"])


def produce_states(cluster: Cluster | str, topics: Topics, records: Iterable[dict[str, Any]]) -> int:
    """Publish StateEvent records keyed by state id; returns how many."""
    require_topics(cluster, [topics.states], roles=topics)
    producer = plain_producer(cluster)
    count = 0
    for record in records:
        payload = schemas.encode_state(record)
        while True:
            try:
                producer.produce(topics.states, key=record["state_id"].encode(), value=payload)
                break
            except BufferError:
                producer.poll(0.1)
            except KafkaException as exc:
                if exc.args[0].code() == KafkaError.MSG_SIZE_TOO_LARGE:
                    raise _too_large(cluster, record["state_id"], count + 1, len(payload)) from None
                raise
        count += 1
    _deliver(producer, "states")
    return count


def _too_large(cluster: Cluster | str, state_id: str, number: int, size: int) -> ConfigError:
    limit = as_cluster(cluster).settings.get("message.max.bytes", 1_000_000)  # librdkafka's default
    return ConfigError(
        f"state {state_id!r} (number {number}) is {size} bytes as a record, over the producer's limit of {limit} bytes "
        "(message.max.bytes); shorten it (workers dead-letter states over --max-state-chars, 32768 characters by "
        "default), or raise message.max.bytes in the config file's [kafka] table and the topic's max.message.bytes")


def as_json(topic_kind: str, message, decoder: OutputDecoder | None = None) -> dict[str, Any]:
    """A probability record or dead letter (any ``--output-format``; registry framing needs a ``decoder`` with a
    registry client) as a JSON-ready dict, plus where it was read from (topic, partition, offset, key) and, if any,
    its headers."""
    key = message.key()
    where = {"topic": message.topic(), "partition": message.partition(), "offset": message.offset(),
             "key": None if key is None else key.decode("utf-8", errors="replace")}
    record = (decoder or OutputDecoder(topic_kind)).decode(message.value(), message.topic())
    shown = {**json_ready(topic_kind, record), "kafka": where}
    if message.headers():
        shown["headers"] = {name: None if value is None else value.decode("utf-8", errors="replace")
                            for name, value in message.headers()}
    return shown


def tail(
    cluster: Cluster | str,
    topic: str,
    topic_kind: str,
    from_beginning: bool = False,
    max_records: int | None = None,
    idle_timeout_s: float | None = None,
    registry: RegistryConfig | None = None,
) -> Iterator[dict[str, Any]]:
    """Yield records of ``topic`` as a read_committed reader sees them (aborted output never shows), in any
    ``--output-format`` (registry-framed ones through ``registry``).

    Stops after ``max_records``, or once nothing new arrived for ``idle_timeout_s`` seconds.
    """
    role = Topics(probabilities=topic) if topic_kind == "probabilities" else Topics(dead_letter=topic)
    counts = require_topics(cluster, [topic], roles=role)
    decoder = OutputDecoder(topic_kind, registry.client() if registry is not None else None)
    consumer = reader_consumer(cluster)
    start = OFFSET_BEGINNING if from_beginning else OFFSET_END
    consumer.assign([TopicPartition(topic, p, start) for p in range(counts[topic])])
    seen, last_activity = 0, time.monotonic()
    try:
        while max_records is None or seen < max_records:
            message = consumer.poll(0.1)
            if message is None or message.error() is not None:
                if message is not None and message.error().code() != KafkaError._PARTITION_EOF:
                    raise BrokerUnavailableError(f"reading {topic}: {message.error().str()}")
                if idle_timeout_s is not None and time.monotonic() - last_activity > idle_timeout_s:
                    return
                continue
            last_activity = time.monotonic()
            try:
                record = as_json(topic_kind, message, decoder)
            except ValueError as exc:
                record = {"undecodable": str(exc), "kafka": {"topic": topic, "partition": message.partition(), "offset": message.offset()}}
            seen += 1
            yield record
    finally:
        consumer.close()


def json_line(record: dict[str, Any]) -> str:
    """One compact JSON line."""
    return json.dumps(record, separators=(",", ":"), ensure_ascii=False)


def summary_line(topic_kind: str, record: dict[str, Any]) -> str:
    """A record of ``tail`` as one short human-readable line."""
    if "undecodable" in record:
        return f"(undecodable record at {record['kafka']}: {record['undecodable']})"
    if topic_kind == "dead-letter":
        return (f"{record['reason']:<20} state={record.get('state_id')} from {record['source_topic']}[{record['source_partition']}]"
                f"@{record['source_offset']}: {record['message']}")
    answers = "  ".join(
        f"{q['id']}=" + max(zip(q["probabilities"], q["options"]))[1] + f" ({max(q['probabilities']):.2f})" for q in record["questions"]
    )
    return f"{record['state_id']}  {record['schema_id']} v{record['schema_version']}  {answers}"
