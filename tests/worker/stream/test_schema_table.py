"""The schema table reads the whole compacted topic outside any group: latest value per id, tombstones
delete, it keeps consuming, catch_up() reaches the end, unusable records are marked broken."""

from __future__ import annotations

import schemas
from tests.worker.conftest import QUESTIONS, QUESTIONS_V2
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
    assert stream.put_schema("v", QUESTIONS)["version"] == 2
    assert stream.put_schema("w", QUESTIONS)["version"] == 1
