"""The committed Avro contracts stay BACKWARD compatible with every released version (the Schema Registry's
default rule): a consumer holding today's ``schemas/*.avsc`` reads records written with any earlier release's.

Two checks per schema and release: the Apache Avro library's reader/writer compatibility rules (those the
registry applies: added fields need defaults, no type changes beyond Avro's promotions, enum symbols kept
or a default given, ...), and real bytes: a record written with the old schema is read with the new one
by fastavro. A deliberately incompatible variant of each rule must fail the check, so the check can fail.
"""

from __future__ import annotations

import copy
import io
import json
from pathlib import Path

import avro.compatibility
import avro.schema
import fastavro
import pytest

import schemas

PREVIOUS = Path(__file__).parent / "schemas" / "previous"
RELEASED = sorted((version.name, avsc.stem) for version in PREVIOUS.iterdir() if version.is_dir() for avsc in version.glob("*.avsc"))


def backward_problems(new: dict, old: dict) -> list[str]:
    """Why a reader with ``new`` cannot read data written with ``old`` ([] if it can)."""
    result = avro.compatibility.ReaderWriterCompatibilityChecker().get_compatibility(
        avro.schema.parse(json.dumps(new)), avro.schema.parse(json.dumps(old)))
    if result.compatibility is avro.compatibility.SchemaCompatibilityType.compatible:
        return []
    return sorted(result.messages) + sorted(result.locations)


def committed(name: str) -> dict:
    return json.loads(schemas.schema_text(name))


def released(version: str, name: str) -> dict:
    return json.loads((PREVIOUS / version / f"{name}.avsc").read_text())


SAMPLES = {
    "probability_record": {"state_id": "s", "schema_id": "q", "schema_version": 1, "model_id": "m",
                           "questions": [{"id": "a", "options": ["y", "n"], "probabilities": [0.5, 0.5]}],
                           "source_topic": "t", "source_partition": 0, "source_offset": 1, "event_time": None,
                           "scored_at": 5, "truncated": False, "worker_id": None, "metadata": None},
    "dead_letter": {"reason": "invalid_fields", "message": "m", "source_topic": "t", "source_partition": 0,
                    "source_offset": 1, "original_key": None, "original_value": b"v", "state_id": None,
                    "schema_id": None, "failed_at": 5, "worker_id": None},
    "state_event": {"state_id": "s", "schema_id": "q", "state": "text", "event_time": 7, "metadata": {"k": "v"}},
    "question_schema": {"schema_id": "q", "version": 2, "mode": "packed", "created_at": None,
                        "questions": [{"id": "a", "question": "?", "options": ["y", "n"], "temperature": None}]},
}


def _calibration_defaults(name: str, record: dict) -> dict:
    """``record`` (written by 0.1.0) as a reader with today's schema reads it: the calibration fields of issue 34
    (label mass, raw probabilities, option biases, the schema's calibration and label-mass switch) and the scoring
    fingerprint of issue 47 at their defaults."""
    if name == "probability_record":
        return {**record, "fingerprint": None,
                "questions": [{**q, "label_mass": None, "raw_probabilities": None} for q in record["questions"]]}
    if name == "question_schema":
        return {**record, "calibration": "none", "label_mass": None,
                "questions": [{**q, "option_bias": None} for q in record["questions"]]}
    return record


def test_every_committed_schema_has_a_released_version():
    assert {name for _, name in RELEASED} >= {"probability_record", "dead_letter", "state_event", "question_schema"}


@pytest.mark.parametrize("version, name", RELEASED)
def test_committed_schema_reads_the_released_ones(version, name):
    assert backward_problems(committed(name), released(version, name)) == []


@pytest.mark.parametrize("version, name", RELEASED)
def test_released_bytes_decode_with_the_committed_schema(version, name):
    buffer = io.BytesIO()
    fastavro.schemaless_writer(buffer, fastavro.parse_schema(released(version, name)), SAMPLES[name])
    buffer.seek(0)
    record = fastavro.schemaless_reader(buffer, fastavro.parse_schema(released(version, name)),
                                        fastavro.parse_schema(committed(name)))
    assert schemas.plain_times(record) == _calibration_defaults(name, SAMPLES[name])


def test_calibrated_records_round_trip_with_the_committed_schemas():
    """The fields issue 34 added carry values, not only their defaults."""
    schema = {**SAMPLES["question_schema"], "calibration": "contextual", "label_mass": True,
              "questions": [{**SAMPLES["question_schema"]["questions"][0], "option_bias": [0.5, -0.5]}]}
    assert schemas.decode_question_schema(schemas.encode_question_schema(schema)) == schema
    record = {**SAMPLES["probability_record"], "fingerprint": None,
              "questions": [{**SAMPLES["probability_record"]["questions"][0], "label_mass": 0.93,
                             "raw_probabilities": [0.7, 0.3]}]}
    assert schemas.decode_probability(schemas.encode_probability(record)) == record


FINGERPRINT = {"digest": "76cbb0c84ea6fa6f", "model": "f57a0d98b94eb3e9", "decider": "0.1.0 #acdeb2f590716bb4",
               "kernels": "cpu float32 torch deterministic #311dba5d5d696666", "prompt": "4e9143e6597bb456",
               "calibration": "none #661e0e7c74423ec7"}


def test_fingerprinted_records_round_trip_and_an_old_reader_skips_the_fingerprint():
    """Issue 47's fingerprint carries its value; a reader holding the released schema reads today's records without
    it (FORWARD too, for consumers that upgrade after the workers)."""
    record = {**SAMPLES["probability_record"], "fingerprint": FINGERPRINT}
    assert schemas.decode_probability(schemas.encode_probability(record)) == _calibration_defaults(
        "probability_record", SAMPLES["probability_record"]) | {"fingerprint": FINGERPRINT}
    buffer = io.BytesIO(schemas.encode_probability(record))
    old = fastavro.schemaless_reader(buffer, schemas.PROBABILITY_RECORD,
                                     fastavro.parse_schema(released("0.1.0", "probability_record")))
    assert "fingerprint" not in old and schemas.plain_times(old) == SAMPLES["probability_record"]
    assert backward_problems(released("0.1.0", "probability_record"), committed("probability_record")) == []


def _field(document: dict, name: str) -> dict:
    return next(f for f in document["fields"] if f["name"] == name)


def add_field_without_default(doc: dict) -> None:
    doc["fields"].append({"name": "confidence", "type": "double"})


def change_a_type(doc: dict) -> None:
    _field(doc, "source_offset")["type"] = "string"


def narrow_a_type(doc: dict) -> None:
    _field(doc, "source_offset")["type"] = "int"  # long -> int: old longs may not fit


def rename_without_alias(doc: dict) -> None:
    field = _field(doc, "source_topic")
    field["name"] = "topic"


def drop_an_enum_symbol_without_default(doc: dict) -> None:
    reason = _field(doc, "reason")["type"]
    reason["symbols"] = [s for s in reason["symbols"] if s != "invalid_fields"]
    reason.pop("default", None)


def make_a_nullable_field_required(doc: dict) -> None:
    _field(doc, "worker_id").update(type="string")
    _field(doc, "worker_id").pop("default")


def require_an_option_bias(doc: dict) -> None:
    question = _field(doc, "questions")["type"]["items"]
    _field(question, "option_bias").update(type={"type": "array", "items": "double"})
    _field(question, "option_bias").pop("default")


def drop_the_calibration_default(doc: dict) -> None:
    _field(doc, "calibration").pop("default")


def require_the_fingerprint(doc: dict) -> None:
    _field(doc, "fingerprint").update(type=_field(doc, "fingerprint")["type"][1])
    _field(doc, "fingerprint").pop("default")


def require_the_label_mass(doc: dict) -> None:
    question = _field(doc, "questions")["type"]["items"]
    _field(question, "label_mass").update(type="double")
    _field(question, "label_mass").pop("default")


@pytest.mark.parametrize("name, breaking_change", [
    ("probability_record", add_field_without_default),
    ("probability_record", change_a_type),
    ("probability_record", narrow_a_type),
    ("probability_record", rename_without_alias),
    ("probability_record", make_a_nullable_field_required),
    ("dead_letter", drop_an_enum_symbol_without_default),
    ("dead_letter", change_a_type),
    ("question_schema", require_an_option_bias),
    ("question_schema", drop_the_calibration_default),
    ("probability_record", require_the_label_mass),
    ("probability_record", require_the_fingerprint),
])
def test_incompatible_variants_are_caught(name, breaking_change):
    variant = copy.deepcopy(committed(name))
    breaking_change(variant)
    assert backward_problems(variant, released("0.1.0", name)) != []


def test_compatible_evolutions_pass():
    variant = copy.deepcopy(committed("probability_record"))
    variant["fields"].append({"name": "confidence", "type": ["null", "double"], "default": None})
    _field(variant, "source_partition")["type"] = "long"  # int -> long is an Avro promotion
    assert backward_problems(variant, committed("probability_record")) == []
