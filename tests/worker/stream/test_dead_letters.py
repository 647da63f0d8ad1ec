"""Every dead-letter reason: bad input between good states; the good ones are scored, the bad one is in the
dead-letter topic with its reason and original bytes, offsets advance past all of them, the worker keeps running."""

from __future__ import annotations

import base64

import schemas
from tests.worker.conftest import QUESTIONS, encode_state, state_texts

FAULT_MARKER = "#inject-fault#"


def test_each_bad_input_goes_to_dead_letters_between_scored_states(stream_factory, model_dir):
    stream = stream_factory(partitions=1)  # one partition: input order is output order
    stream.put_schema("tickets", QUESTIONS)
    # A schema the engine cannot prepare (27 options, published raw: `decider schema put` would refuse it) ...
    too_many = {"schema_id": "nine", "version": 1, "mode": "packed", "created_at": None,
                "questions": [{"id": "q", "question": "Pick one", "options": [f"o{i}" for i in range(27)], "temperature": None}]}
    stream.produce_raw(b"nine", schemas.encode_question_schema(too_many), topic=stream.topics.schemas)
    # ... one over the engine's size limits (a question of 2,500 characters) ...
    too_long = {"schema_id": "long", "version": 1, "mode": "packed", "created_at": None,
                "questions": [{"id": "q", "question": "Why? " * 500, "options": ["a", "b"], "temperature": None}]}
    stream.produce_raw(b"long", schemas.encode_question_schema(too_long), topic=stream.topics.schemas)
    # ... and a schema record that is not Avro at all.
    stream.produce_raw(b"garbled", b"\x00\x01 definitely not avro", topic=stream.topics.schemas)

    good = iter(state_texts(24, seed=3))
    bad_inputs = {
        "undecodable": (b"bad-bytes", b"\xff\xfe\xfd not a StateEvent"),
        "undecodable-null": (b"bad-null", None),
        "invalid_fields": (b"bad-fields", encode_state("", "tickets", "a state without an id")),
        "invalid_fields-no-text": (b"bad-no-text", encode_state("bad-no-text", "tickets", "  ")),
        "unknown_schema": (b"bad-unknown", encode_state("bad-unknown", "no-such-schema", "who asks?")),
        "schema_unpreparable": (b"bad-nine", encode_state("bad-nine", "nine", "nine options")),
        "schema_unpreparable-garbled": (b"bad-garbled", encode_state("bad-garbled", "garbled", "garbled schema")),
        "schema_unpreparable-long": (b"bad-long", encode_state("bad-long", "long", "a long question")),
        "state_too_large": (b"bad-large", encode_state("bad-large", "tickets", "x" * 600)),
        "scoring_error": (b"bad-fault", encode_state("bad-fault", "tickets", f"this state fails {FAULT_MARKER} on the device")),
    }
    sent: list[tuple[str, bytes | None, bytes | None]] = []
    for name, (key, value) in bad_inputs.items():
        for _ in range(2):
            state_id = f"good-{len(sent)}"
            sent.append(("good", state_id.encode(), encode_state(state_id, "tickets", next(good))))
        sent.append((name, key, value))
    sent.append(("good", b"good-last", encode_state("good-last", "tickets", next(good))))
    for _kind, key, value in sent:
        stream.produce_raw(key, value)

    worker = stream.start_worker(model_dir, "dlq", "--schema-wait-ms", "300", "--max-state-chars", "500",
                                 fail_on=FAULT_MARKER)
    probabilities, dead = stream.collect(len(sent), timeout_s=90)

    good_ids = sorted(key.decode() for kind, key, _ in sent if kind == "good")
    assert sorted(r["state_id"] for r in probabilities) == good_ids, worker.log()
    assert len(dead) == len(bad_inputs), dead
    by_offset = {d["source_offset"]: d for d in dead}
    for offset, (kind, key, value) in enumerate(sent):
        if kind == "good":
            continue
        letter = by_offset[offset]
        assert letter["reason"] == kind.split("-")[0], letter
        assert letter["message"]
        assert letter["source_topic"] == stream.topics.states and letter["source_partition"] == 0
        assert letter["original_key"] == key.decode()
        assert letter["original_value_base64"] == (None if value is None else base64.b64encode(value).decode())
        assert letter["worker_id"] == "dlq"
        decoded = None if kind.startswith("undecodable") else schemas.decode_state(value)
        # The ids of every record that decoded, whatever its reason (an empty id is none).
        assert letter["state_id"] == (decoded and decoded["state_id"] or None), letter
        assert letter["schema_id"] == (decoded and decoded["schema_id"]), letter
    assert "no-such-schema" in by_offset[_offset(sent, "unknown_schema")]["message"]
    assert "27 options" in by_offset[_offset(sent, "schema_unpreparable")]["message"]
    assert "2500 characters; at most 2000" in by_offset[_offset(sent, "schema_unpreparable-long")]["message"]
    assert "600 characters" in by_offset[_offset(sent, "state_too_large")]["message"]
    assert "injected" in by_offset[_offset(sent, "scoring_error")]["message"]

    assert stream.committed_offsets() == {0: len(sent)}
    assert worker.process.poll() is None, "bad input must not stop the worker"
    assert worker.stop() == 0, worker.log()


def _offset(sent: list, kind: str) -> int:
    return next(i for i, (k, _, _) in enumerate(sent) if k == kind)
