"""The schema table reads the whole compacted topic outside any group: latest value per id, tombstones
delete, it keeps consuming, catch_up() reaches the end, unusable records are marked broken."""

from __future__ import annotations

import json
import time

from confluent_kafka import OFFSET_BEGINNING, Producer, TopicPartition

import schemas
from tests.worker.conftest import QUESTIONS, QUESTIONS_V2
from worker.cli import commands
from worker.formats.records import question_schema_record
from worker.stream.schema_table import BrokenSchema, SchemaTable


def test_latest_version_per_id_tombstones_and_live_updates(stream):
    stream.put_schema("a", QUESTIONS)
    stream.put_schema("a", QUESTIONS_V2)
    stream.put_schema("b", QUESTIONS)
    stream.put_schema("c", QUESTIONS)
    stream.delete_schema("c")

    table = SchemaTable(stream.bootstrap, stream.topics.schemas)
    try:
        table.catch_up()
        assert table.ids() == ["a", "b"]
        assert table.get("a")["version"] == 2
        assert [q["id"] for q in table.get("a")["questions"]] == ["urgent", "angry"]
        assert table.get("c") is None

        # Still consuming: a change published now shows up without a new table.
        stream.put_schema("b", QUESTIONS_V2)
        stream.delete_schema("a")
        changes = table.catch_up()
        assert [(c.schema_id, c.record and c.record["version"]) for c in changes] == [("b", 2), ("a", None)]
        assert table.ids() == ["b"] and table.get("b")["version"] == 2
    finally:
        table.close()


def test_unusable_records_are_kept_as_broken(stream):
    stream.produce_raw(b"junk", b"\x07 not avro", topic=stream.topics.schemas)
    mismatched = {"schema_id": "other", "version": 1, "mode": "packed", "created_at": None,
                  "questions": [{"id": "q", "question": "Q?", "options": ["a", "b"], "temperature": None}]}
    stream.produce_raw(b"liar", schemas.encode_question_schema(mismatched), topic=stream.topics.schemas)
    table = SchemaTable(stream.bootstrap, stream.topics.schemas)
    try:
        table.catch_up()
        assert isinstance(table.get("junk"), BrokenSchema) and "not a valid" in table.get("junk").problem
        assert isinstance(table.get("liar"), BrokenSchema) and "schema_id 'other'" in table.get("liar").problem
    finally:
        table.close()


def test_put_schema_versions_increase_per_id(stream):
    assert stream.put_schema("v", QUESTIONS)["version"] == 1
    assert stream.put_schema("v", QUESTIONS_V2)["version"] == 2
    assert stream.put_schema("w", QUESTIONS)["version"] == 1


def test_put_schema_of_the_same_content_publishes_nothing(stream):
    """Idempotent: the same file again is "unchanged, version 1"; a changed one, or one after a delete, is new."""
    first = stream.put_schema("same", QUESTIONS)
    assert first["version"] == 1
    path = stream.workdir / "same.json"
    path.write_text(json.dumps(QUESTIONS))
    again, published = commands.put_schema(stream.bootstrap, stream.topics, "same", path)
    assert not published and again == first
    assert _schema_records(stream, "same") == 1  # nothing new on the topic
    with_temperature = json.loads(json.dumps(QUESTIONS))
    with_temperature["questions"][0]["temperature"] = 0.5
    assert stream.put_schema("same", with_temperature)["version"] == 2
    assert stream.put_schema("same", QUESTIONS)["version"] == 3  # back to v1's content: a new version all the same
    stream.delete_schema("same")
    assert stream.put_schema("same", QUESTIONS)["version"] == 4  # after a delete the schema is published again
    assert _schema_records(stream, "same") == 5  # 4 versions and a tombstone


def _schema_records(stream, schema_id: str) -> int:
    """How many records (values and tombstones) the schemas topic holds under ``schema_id``."""
    from worker.kafka_clients import reader_consumer

    consumer = reader_consumer(stream.bootstrap)
    consumer.assign([TopicPartition(stream.topics.schemas, 0, OFFSET_BEGINNING)])
    count = 0
    try:
        while (message := consumer.poll(1.0)) is not None and message.error() is None:
            count += message.key() == schema_id.encode()
    finally:
        consumer.close()
    return count


def test_a_view_says_whether_the_table_had_applied_every_record_published_before_it(stream):
    """What a cycle closes with: the table's view is confirmed by the topic's end offsets asked for when it was taken,
    and ``changed_since`` names only the ids that changed after it."""
    stream.put_schema("a", QUESTIONS)
    table = SchemaTable(stream.bootstrap, stream.topics.schemas)
    try:
        table.catch_up()
        current = table.view()
        assert table.missed(current) is False

        stream.put_schema("a", QUESTIONS_V2)  # published, and not yet applied by the table: no poll in between
        stale = table.view()
        assert table.missed(stale) is True
        assert not table.changed_since(stale, {"a", "b"})  # nothing applied since the view yet

        assert [c.schema_id for c in table.catch_up()] == ["a"]
        assert table.changed_since(stale, {"a"}) and table.changed_since(current, {"a", "b"})
        assert not table.changed_since(stale, {"b"})
        assert table.missed(table.view()) is False
    finally:
        table.close()


def test_the_end_a_view_is_confirmed_by_is_the_last_stable_offset(stream):
    """A schema written inside a transaction still open is not the table's to read yet (it reads committed records
    only): neither a view nor a catch-up waits for it, and once committed it is missed, then applied."""
    stream.put_schema("a", QUESTIONS)
    table = SchemaTable(stream.bootstrap, stream.topics.schemas)
    writer = Producer({"bootstrap.servers": stream.bootstrap, "transactional.id": f"{stream.topics.schemas}-writer"})
    try:
        table.catch_up()
        writer.init_transactions(10)
        writer.begin_transaction()
        writer.produce(stream.topics.schemas, key=b"b",
                       value=schemas.encode_question_schema(question_schema_record(QUESTIONS, "b", 1)))
        writer.flush(10)

        started = time.monotonic()
        assert table.catch_up(timeout_s=5) == [] and time.monotonic() - started < 2
        assert table.missed(table.view()) is False

        writer.commit_transaction(10)   # returns before the partition has the commit's marker: its LSO moves soon after
        deadline = time.monotonic() + 5
        while not table.missed(table.view()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert table.missed(table.view()) is True
        assert [c.schema_id for c in table.catch_up()] == ["b"]
    finally:
        table.close()
