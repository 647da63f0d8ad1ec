"""The stream's record conversions: a consumed record decodes to a StateEvent or to the reason it cannot be scored;
dead letters and probability records carry their source, and every reason code is one the Avro contract knows."""

from __future__ import annotations

import pytest

import schemas
from tests.worker.conftest import encode_state
from worker.formats.records import Reason, SourceRecord, Unscorable, dead_letter, decode_source, probability_record


def _source(value: bytes | None, key: bytes | None = b"k") -> SourceRecord:
    return SourceRecord("decider.states", 3, 41, key, value)


def test_every_worker_reason_code_is_in_the_schema():
    assert {r.value for r in Reason} <= set(schemas.DEAD_LETTER_REASONS)


def test_decode_source_gives_the_state_or_the_reason():
    assert decode_source(_source(encode_state("s-1", "support", "late order")), 100)["state"] == "late order"
    cases = [
        (None, Reason.UNDECODABLE, "no value"),
        (b"\xff\xfe not avro", Reason.UNDECODABLE, "not a valid io.decider.StateEvent"),
        (encode_state("", "support", "text"), Reason.INVALID_FIELDS, "state_id is empty"),
        (encode_state("s-1", "support", "   "), Reason.INVALID_FIELDS, "state text is empty"),
        (encode_state("s-1", "support", "x" * 101), Reason.STATE_TOO_LARGE, "101 characters; the limit is 100"),
    ]
    for value, reason, says in cases:
        with pytest.raises(Unscorable, match=says) as caught:
            decode_source(_source(value), 100)
        assert caught.value.reason is reason


def test_dead_letter_carries_the_source_bytes_reason_and_ids():
    source = _source(b"\x00raw", key=b"s-9")
    record = dead_letter(source, Reason.UNKNOWN_SCHEMA, "no schema", "dlq", "w0", state={"state_id": "s-9", "schema_id": "x"})
    assert (record.topic, record.key) == ("dlq", b"s-9")
    decoded = schemas.decode_dead_letter(record.value)
    assert decoded["reason"] == "unknown_schema" and decoded["message"] == "no schema"
    assert (decoded["source_topic"], decoded["source_partition"], decoded["source_offset"]) == ("decider.states", 3, 41)
    assert decoded["original_key"] == b"s-9" and decoded["original_value"] == b"\x00raw"
    assert (decoded["state_id"], decoded["schema_id"], decoded["worker_id"]) == ("s-9", "x", "w0")


def test_dead_letters_are_keyed_by_state_id_when_there_is_one_else_by_the_original_key():
    """A mapped topic's key may be null or another id: the output key is the state id, as for probability records."""
    mapped = dead_letter(_source(b"{}", key=None), Reason.INVALID_FIELDS, "m", "dlq", "w0", state={"state_id": "T-7"})
    assert mapped.key == b"T-7" and schemas.decode_dead_letter(mapped.value)["original_key"] is None
    other = dead_letter(_source(b"{}", key=b"customer-3"), Reason.INVALID_FIELDS, "m", "dlq", "w0", state={"state_id": "T-8"})
    assert other.key == b"T-8"
    unread = dead_letter(_source(b"\xff", key=b"raw-key"), Reason.UNDECODABLE, "m", "dlq", "w0")
    assert unread.key == b"raw-key"


def test_probability_record_follows_the_schema_and_the_source():
    schema = {"schema_id": "support", "version": 2, "questions": [{"id": "angry", "options": ["yes", "no"]}]}
    state = {"state_id": "s-1", "event_time": 5, "metadata": {"a": "b"}}
    record = probability_record(state, schema, [[0.25, 0.75]], "tiny", _source(b""), "w0", truncated=True)
    assert schemas.decode_probability(schemas.encode_probability(record)) == record
    assert record["questions"] == [{"id": "angry", "options": ["yes", "no"], "probabilities": [0.25, 0.75],
                                    "label_mass": None, "raw_probabilities": None}]
    assert (record["source_partition"], record["source_offset"], record["schema_version"]) == (3, 41, 2)
    calibrated = probability_record(state, schema, [[0.25, 0.75]], "tiny", _source(b""), "w0", label_mass=[0.5],
                                    raw_probabilities=[[0.5, 0.5]])
    assert schemas.decode_probability(schemas.encode_probability(calibrated)) == calibrated
    assert calibrated["questions"][0]["label_mass"] == 0.5 and calibrated["questions"][0]["raw_probabilities"] == [0.5, 0.5]


def test_engine_output_with_a_label_mass_that_is_no_share_is_unusable():
    from worker.formats.records import probabilities_problem

    good = [[0.25, 0.75], [0.5, 0.2, 0.3]]
    assert probabilities_problem(good, [2, 3]) is None and probabilities_problem(good, [2, 3], [0.9, 0.01]) is None
    for mass in ([float("nan"), 0.5], [0.5, 1.5], [-0.1, 0.2]):
        assert "is not a share" in probabilities_problem(good, [2, 3], mass)
    assert "sum to" in probabilities_problem([[0.25, 0.5], [0.5, 0.2, 0.3]], [2, 3], [0.5, 0.5])
