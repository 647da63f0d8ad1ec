"""Users' own events end to end, on the session broker with real worker and replay subprocesses: JSON events with
nested fields through a template, Avro events written by confluent-kafka's own ``AvroSerializer``, registry-framed
output read by its own ``AvroDeserializer``; the probabilities equal ``SchemaEngine.score`` on the text the mapping
renders; bad input is dead-lettered with its reason and path while the records around it are scored; exactly once
through SIGKILL with mapping and registry on; a replay of a JSON topic by time range, resumed after SIGKILL.

The registry is the session's (``schema_registry_url``: the test double, or the one SCHEMA_REGISTRY_URL names):
workers are subprocesses, so confluent-kafka's in-process ``mock://`` registry cannot be shared with them."""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import time
from collections import Counter
from datetime import datetime, timezone

import pytest
from confluent_kafka import OFFSET_BEGINNING, KafkaError, Producer, TopicPartition
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer
from confluent_kafka.serialization import MessageField, SerializationContext

from tests.worker.conftest import QUESTIONS, QUESTIONS_V2, Stream, WorkerProcess, expected_probabilities, feed_states, state_texts
from worker.kafka_clients import reader_consumer
from worker.stream.replay import replay_group

TEMPLATE = r"Subject: {ticket.subject}\n\n{ticket.body}"  # as typed in a shell: the CLI turns \n into newlines
TRACEPARENT = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
JSON_MAPPING = ("--input-format", "json", "--schema-id", "support", "--text-template", TEMPLATE,
                "--event-time-field", "ticket.created_at", "--metadata-fields", "ticket.priority,customer.tier")


def ticket(i: int, subject: str, body: str) -> dict:
    return {"ticket": {"id": f"T-{i}", "subject": subject, "body": body, "created_at": "2026-03-01T09:12:00Z",
                       "priority": "high" if i % 2 else "low"}, "customer": {"tier": "gold"}}


def rendered(event: dict) -> str:
    return f"Subject: {event['ticket']['subject']}\n\n{event['ticket']['body']}"


def produce(stream: Stream, records: list[tuple[bytes | None, bytes | None, list | None]], timestamp_ms: int = 0) -> None:
    producer = Producer({"bootstrap.servers": stream.bootstrap, "partitioner": "murmur2_random", "log_level": 0})
    for key, value, headers in records:
        producer.produce(stream.topics.states, key=key, value=value, headers=headers, timestamp=timestamp_ms)
    assert producer.flush(10) == 0


def read_with_confluent_deserializer(stream: Stream, registry_url: str, expected: int, timeout_s: float = 60.0):
    """Both output topics as a plain confluent-kafka consumer with its own ``AvroDeserializer`` reads them:
    {topic kind: [(record, headers)]}."""
    deserialize = AvroDeserializer(SchemaRegistryClient({"url": registry_url}))
    consumer = reader_consumer(stream.bootstrap)
    consumer.assign([TopicPartition(t, p, OFFSET_BEGINNING)
                     for t in (stream.topics.probabilities, stream.topics.dead_letter) for p in range(stream.partitions)])
    found = {"probabilities": [], "dead-letter": []}
    deadline, settle_until = time.monotonic() + timeout_s, None
    try:
        while time.monotonic() < deadline and (settle_until is None or time.monotonic() < settle_until):
            message = consumer.poll(0.1)
            if message is None or message.error() is not None:
                assert message is None or message.error().code() == KafkaError._PARTITION_EOF
                continue
            kind = "probabilities" if message.topic() == stream.topics.probabilities else "dead-letter"
            record = deserialize(message.value(), SerializationContext(message.topic(), MessageField.VALUE))
            found[kind].append((record, dict(message.headers() or [])))
            if settle_until is None and sum(map(len, found.values())) >= expected:
                settle_until = time.monotonic() + 1.0
    finally:
        consumer.close()
    return found


def assert_scored_as_rendered(schema_engine, document: dict, records: list[dict], texts_by_id: dict[str, str]) -> None:
    """Each of ``texts_by_id``'s states has one record, holding every question of ``document`` in order, with its
    options, and the probabilities ``SchemaEngine.score`` gives for the text the mapping rendered."""
    ids = sorted(texts_by_id)
    assert sorted(record["state_id"] for record in records) == ids
    expected = dict(zip(ids, expected_probabilities(schema_engine, document, [texts_by_id[i] for i in ids]), strict=True))
    questions = [(q["id"], q["options"]) for q in document["questions"]]
    for record in records:
        assert [(q["id"], q["options"]) for q in record["questions"]] == questions, record["state_id"]
        got = [q["probabilities"] for q in record["questions"]]
        for row, want in zip(got, expected[record["state_id"]], strict=True):
            assert row == pytest.approx(want, abs=1e-4), record["state_id"]


def test_json_events_through_a_template_with_bad_input_mixed_in(stream, model_dir, schema_engine, schema_registry_url):
    """Nested JSON through a template, ids from the key, registry-framed output read by confluent's own
    deserializer, trace headers carried over; the issue's bad inputs each dead-lettered with reason and path."""
    stream.put_schema("support", QUESTIONS)
    texts = state_texts(12, seed=31)
    good = {f"T-{i}": ticket(i, f"case {i}", text) for i, text in enumerate(texts)}
    bad = [  # (key, value, expected reason, a word the message must name)
        (b"bad-not-json", b"\xff\xfe not json", "undecodable", "UTF-8"),
        (b"bad-array", b'["not", "an", "object"]', "undecodable", "not an object"),
        (b"bad-missing", json.dumps({"ticket": {"subject": "s", "created_at": 1, "priority": "p"}, "customer": {"tier": "t"}}).encode(),
         "invalid_fields", "ticket.body"),
        (b"bad-object-text", json.dumps(ticket(99, "s", {"an": "object"})).encode(), "invalid_fields", "ticket.body"),
        (b"bad-framed", b"\x00\x00\x00\x00\x07" + b"\x02avro bytes", "undecodable", "avro-registry"),
        (b"bad-tombstone", None, "undecodable", "tombstone"),
        (b"\xff\xfebad-key", json.dumps(ticket(98, "s", "b")).encode(), "invalid_fields", "key"),
    ]
    records = []
    items = list(good.items())
    for index, (state_id, event) in enumerate(items):
        records.append((state_id.encode(), json.dumps(event).encode(), [("traceparent", TRACEPARENT), ("other", b"x")]))
        if index < len(bad):
            records.append(bad[index][:2] + (None,))
    produce(stream, records)

    worker = stream.start_worker(model_dir, "json-template", *JSON_MAPPING, "--output-format", "avro-registry",
                                 "--schema-registry-url", schema_registry_url)
    # the reader's minute starts once the worker has its partitions, not at its launch: on a loaded 2-core machine the
    # worker's start (the model, the group) eats into it (the likely cause of this test's one failure, in a CI run whose
    # log was lost; it passed in the runs before and after)
    worker.wait_for_log("assigned", timeout_s=120)
    found = read_with_confluent_deserializer(stream, schema_registry_url, len(records))
    assert worker.stop() == 0, worker.log()

    scored = [record for record, _ in found["probabilities"]]
    assert sorted(r["state_id"] for r in scored) == sorted(good), worker.log()
    assert_scored_as_rendered(schema_engine, QUESTIONS, scored, {sid: rendered(e) for sid, e in good.items()})
    assert all(r["metadata"] == {"ticket.priority": "high" if int(r["state_id"][2:]) % 2 else "low", "customer.tier": "gold"}
               for r in scored)
    assert {r["event_time"] for r in scored} == {datetime(2026, 3, 1, 9, 12, tzinfo=timezone.utc)}  # timestamp-millis
    assert all(headers == {"traceparent": TRACEPARENT} for _, headers in found["probabilities"])

    letters = {record["original_key"]: record for record, _ in found["dead-letter"]}
    assert set(letters) == {key for key, *_ in bad}, worker.log()
    for key, value, reason, named in bad:
        letter = letters[key]
        assert (letter["reason"], letter["original_value"]) == (reason, value), letter
        assert named in letter["message"], letter
    assert letters[b"bad-missing"]["state_id"] == "bad-missing" and letters[b"bad-missing"]["schema_id"] == "support"
    assert stream.committed_offsets() == stream.end_offsets()


USER_AVRO = json.dumps({"type": "record", "name": "Ticket", "namespace": "com.example.helpdesk", "fields": [
    {"name": "id", "type": "long"}, {"name": "body", "type": "string"},
    {"name": "customer", "type": {"type": "record", "name": "Customer", "fields": [{"name": "tier", "type": "string"}]}}]})


def test_avro_events_from_confluents_serializer_scored_into_json_output(stream, model_dir, schema_engine, schema_registry_url):
    """Avro written by confluent-kafka's own AvroSerializer; the decider-schema-id header picks a second schema;
    a framed record whose schema id the registry does not know is a dead letter; output as JSON."""
    from confluent_kafka.schema_registry import Schema

    stream.put_schema("support", QUESTIONS)
    stream.put_schema("triage", QUESTIONS_V2)
    client = SchemaRegistryClient({"url": schema_registry_url})
    serialize = AvroSerializer(client, Schema(USER_AVRO, "AVRO"))
    context = SerializationContext(stream.topics.states, MessageField.VALUE)
    texts = state_texts(8, seed=41)
    records = [(f"k{i}".encode(), serialize({"id": 500 + i, "body": text, "customer": {"tier": "gold"}}, context),
                [("decider-schema-id", b"triage")] if i % 4 == 3 else None) for i, text in enumerate(texts)]
    unknown_id = b"\x00" + (987654).to_bytes(4, "big") + b"\x02"
    records.insert(3, (b"unknown", unknown_id, None))
    produce(stream, records)

    worker = stream.start_worker(model_dir, "avro-in", "--input-format", "avro-registry", "--schema-registry-url",
                                 schema_registry_url, "--schema-id", "support", "--id-field", "id", "--text-field", "body",
                                 "--metadata-fields", "customer.tier", "--output-format", "json")
    probabilities, dead = stream.collect(len(records), timeout_s=90)
    assert worker.stop() == 0, worker.log()

    by_schema = {schema: {str(500 + i): t for i, t in enumerate(texts) if (i % 4 == 3) == (schema == "triage")}
                 for schema in ("support", "triage")}
    assert sorted((r["schema_id"], r["state_id"]) for r in probabilities) == sorted(
        (schema, sid) for schema, ids in by_schema.items() for sid in ids), worker.log()
    for schema, document in (("support", QUESTIONS), ("triage", QUESTIONS_V2)):
        assert_scored_as_rendered(schema_engine, document, [r for r in probabilities if r["schema_id"] == schema], by_schema[schema])
    assert all(r["metadata"] == {"customer.tier": "gold"} for r in probabilities)
    # keyed by state id (from --id-field), not by the input's key k0..k7; a record never read that far by its own key
    assert all(r["kafka"]["key"] == r["state_id"] for r in probabilities), [r["kafka"] for r in probabilities]
    assert [(d["reason"], d["original_key"], d["kafka"]["key"]) for d in dead] == [("undecodable", "unknown", "unknown")]
    assert "987654" in dead[0]["message"]
    assert stream.committed_offsets() == stream.end_offsets()


def test_exactly_once_through_sigkill_with_mapping_and_registry_on(stream, model_dir, schema_registry_url):
    stream.put_schema("support", QUESTIONS)
    rnd = random.Random(51)
    inputs, bodiless = [], set()
    for i, text in enumerate(state_texts(160, seed=51)):
        event = ticket(i, f"case {i}", text)
        if rnd.random() < 0.05:  # a few mapping failures: dead letters are outputs too
            del event["ticket"]["body"]
            bodiless.add(f"T-{i}")
        inputs.append((f"T-{i}", json.dumps(event).encode()))
    fed = threading.Event()
    feeder = threading.Thread(target=feed_states, args=(stream, inputs, fed), daemon=True)
    feeder.start()
    flags = (*JSON_MAPPING, "--output-format", "avro-registry", "--schema-registry-url", schema_registry_url)
    for _ in range(2):
        worker = stream.start_worker(model_dir, "eos-mapped", *flags)
        worker.wait_for_log("assigned", timeout_s=90)
        time.sleep(rnd.uniform(0.3, 2.0))
        worker.kill()
    feeder.join(120)
    assert fed.is_set()
    survivor = stream.start_worker(model_dir, "eos-mapped", *flags)
    probabilities, dead = stream.collect(len(inputs), timeout_s=150, settle_s=2.0, registry_url=schema_registry_url)

    seen = Counter([r["state_id"] for r in probabilities] + [d["state_id"] for d in dead])
    assert {k: v for k, v in seen.items() if v > 1} == {}, "states output more than once"
    assert set(seen) == {sid for sid, _ in inputs}
    assert bodiless and {d["state_id"] for d in dead} == bodiless  # exactly the events without a body
    assert {d["reason"] for d in dead} == {"invalid_fields"} and all("ticket.body" in d["message"] for d in dead)
    assert stream.committed_offsets() == stream.end_offsets()
    assert survivor.stop() == 0, survivor.log()


def _replay(stream: Stream, model_dir, name: str, *flags: str) -> WorkerProcess:
    args = [sys.executable, "-m", "worker", "replay", "-b", stream.bootstrap, "--model", str(model_dir), "--name", name,
            "--states-topic", stream.topics.states, "--schemas-topic", stream.topics.schemas,
            "--output-topic", stream.topics.probabilities, "--dead-letter-topic", stream.topics.dead_letter, "--no-progress", *flags]
    process = WorkerProcess(args, stream.workdir / f"replay-{name}-{len(stream.workers)}.log", {**os.environ, "PYTHONUNBUFFERED": "1"})
    stream.workers.append(process)
    return process


def test_replay_of_a_json_topic_by_time_range_into_registry_output_resumes_after_sigkill(stream, model_dir, schema_engine,
                                                                                      schema_registry_url):
    stream.put_schema("support", QUESTIONS)
    # Bands by the records' Kafka timestamps, set by the broker's clock here: the embedded broker's time index
    # does not find producer-set timestamps in the past (offsets_for_times answers -1), a real Kafka does.
    events, bounds = {}, []
    for band in ("before", "march-1", "after"):
        if band != "before":
            time.sleep(1.1)
            bounds.append(datetime.now(timezone.utc).isoformat(timespec="milliseconds"))
            time.sleep(0.1)
        texts = state_texts(40 if band == "march-1" else 5, seed=len(band))
        events[band] = {f"{band}-{i}": ticket(i, band, text) for i, text in enumerate(texts)}
        produce(stream, [(sid.encode(), json.dumps(e).encode(), None) for sid, e in events[band].items()])
    flags = (*JSON_MAPPING, "--from-time", bounds[0], "--to-time", bounds[1],
             "--output-format", "avro-registry", "--schema-registry-url", schema_registry_url)

    first = _replay(stream, model_dir, "march-1", *flags, "--max-batch", "2")
    first.wait_for_log("committed", timeout_s=90)
    first.kill()
    second = _replay(stream, model_dir, "march-1", *flags, "--max-batch", "16")
    assert second.process.wait(180) == 0, second.log()

    wanted = events["march-1"]
    probabilities, dead = stream.collect(len(wanted), timeout_s=30, settle_s=1.5, registry_url=schema_registry_url)
    assert dead == [] and Counter(r["state_id"] for r in probabilities) == Counter(set(wanted)), second.log()
    assert_scored_as_rendered(schema_engine, QUESTIONS, probabilities, {sid: rendered(e) for sid, e in wanted.items()})
    assert "resuming replay march-1" in second.log() and "replay march-1: complete" in second.log(), second.log()
