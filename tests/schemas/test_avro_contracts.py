"""The Avro contracts: every record round-trips through real bytes, garbage is rejected, the files are
documented and evolvable (every optional field has a default)."""

from __future__ import annotations

import json
from importlib.resources import files

import pytest

import schemas

EXAMPLES = {
    "state_event": {"state_id": "s-1", "schema_id": "support", "state": "late order", "event_time": 1_700_000_000_123,
                    "metadata": {"channel": "email"}},
    "question_schema": {"schema_id": "support", "version": 3, "mode": "independent", "created_at": 1_700_000_000_000,
                        "calibration": "contextual", "label_mass": None,
                        "questions": [{"id": "angry", "question": "Angry?", "options": ["yes", "no"], "temperature": 0.5,
                                       "option_bias": [0.25, -0.25]}]},
    "probability_record": {"state_id": "s-1", "schema_id": "support", "schema_version": 3, "model_id": "tiny",
                           "questions": [{"id": "angry", "options": ["yes", "no"], "probabilities": [0.25, 0.75],
                                          "label_mass": 0.5, "raw_probabilities": None}],
                           "source_topic": "decider.states", "source_partition": 2, "source_offset": 41,
                           "event_time": None, "scored_at": 1_700_000_000_999, "truncated": True, "worker_id": "w0",
                           "metadata": None,
                           "fingerprint": {"digest": "76cbb0c84ea6fa6f", "model": "f57a0d98b94eb3e9",
                                           "decider": "0.1.0 #acdeb2f590716bb4",
                                           "kernels": "cpu float32 torch deterministic #311dba5d5d696666",
                                           "prompt": "4e9143e6597bb456", "calibration": "none #661e0e7c74423ec7"}},
    "dead_letter": {"reason": "unknown_schema", "message": "no schema", "source_topic": "decider.states",
                    "source_partition": 0, "source_offset": 7, "original_key": b"k", "original_value": b"\x00\x01",
                    "state_id": "s-1", "schema_id": "nope", "failed_at": 1_700_000_000_000, "worker_id": "w0"},
}
CODECS = {
    "state_event": (schemas.encode_state, schemas.decode_state),
    "question_schema": (schemas.encode_question_schema, schemas.decode_question_schema),
    "probability_record": (schemas.encode_probability, schemas.decode_probability),
    "dead_letter": (schemas.encode_dead_letter, schemas.decode_dead_letter),
}


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_round_trip_through_bytes(name):
    encode, decode = CODECS[name]
    payload = encode(EXAMPLES[name])
    assert isinstance(payload, bytes) and payload[:1] != b"O"  # schemaless: no container-file header
    assert decode(payload) == EXAMPLES[name]


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_garbage_and_trailing_bytes_are_rejected(name):
    encode, decode = CODECS[name]
    with pytest.raises(ValueError):
        decode(b"\xff\xff\xff\xff garbage")
    with pytest.raises(ValueError, match="trailing"):
        decode(encode(EXAMPLES[name]) + b"\x00")
    with pytest.raises(ValueError):
        decode(encode(EXAMPLES[name])[:-1])


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_avsc_is_namespaced_documented_and_evolvable(name):
    document = json.loads(files("schemas").joinpath(f"{name}.avsc").read_text())
    assert document["namespace"] == "io.decider" and document["doc"]

    def check(record):
        for field in record["fields"]:
            assert field.get("doc"), f"{record['name']}.{field['name']} has no doc"
            kind = field["type"]
            if isinstance(kind, list) and "null" in kind:
                assert "default" in field and field["default"] is None, f"{field['name']}: optional without default null"
            inner = kind.get("items") if isinstance(kind, dict) and kind.get("type") == "array" else kind
            if isinstance(inner, dict) and inner.get("type") == "record":
                check(inner)

    check(document)


def test_old_reader_skips_fields_added_later():
    """Evolution: a record written with an extra (defaulted) field still decodes with today's schema."""
    import io

    import fastavro

    newer = json.loads(files("schemas").joinpath("state_event.avsc").read_text())
    newer["fields"].append({"name": "priority", "type": "int", "default": 0, "doc": "added later"})
    newer = fastavro.parse_schema(newer, named_schemas={})
    buffer = io.BytesIO()
    fastavro.schemaless_writer(buffer, newer, {**EXAMPLES["state_event"], "priority": 5})
    old_view = fastavro.schemaless_reader(io.BytesIO(buffer.getvalue()), newer, schemas.STATE_EVENT)
    assert old_view["state"] == "late order" and "priority" not in old_view

