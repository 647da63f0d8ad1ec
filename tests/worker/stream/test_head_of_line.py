"""A state waiting for its schema holds back only its own partition: the other partitions keep their normal latency,
the waiting states end as dead letters after --schema-wait-ms, and a deleted schema's states go there at once."""

from __future__ import annotations

import threading
import time

from confluent_kafka import OFFSET_BEGINNING, KafkaError, Producer, TopicPartition

import schemas
from tests.worker.conftest import QUESTIONS, state_texts
from worker.cli import commands
from worker.kafka_clients import reader_consumer

SCHEMA_WAIT_MS = 4000
NORMAL_BOUND_S = 2.0
"""Good states on unblocked partitions must be visible within this of their production (a few hundred ms
normally; slack for a shared 2-core machine); a stalled worker would show SCHEMA_WAIT_MS."""


def _state(state_id: str, schema_id: str, text: str) -> bytes:
    return schemas.encode_state({"state_id": state_id, "schema_id": schema_id, "state": text, "event_time": None,
                                 "metadata": None})


class _Reader(threading.Thread):
    """Reads both output topics read_committed and notes when each record became visible."""

    def __init__(self, stream) -> None:
        super().__init__(daemon=True)
        self.stream, self.seen, self.done = stream, [], threading.Event()

    def run(self) -> None:
        topics = self.stream.topics
        consumer = reader_consumer(self.stream.bootstrap)
        consumer.assign([TopicPartition(t, p, OFFSET_BEGINNING) for t in (topics.probabilities, topics.dead_letter)
                         for p in range(self.stream.partitions)])
        try:
            while not self.done.is_set():
                message = consumer.poll(0.05)
                if message is None or message.error() is not None:
                    assert message is None or message.error().code() == KafkaError._PARTITION_EOF
                    continue
                kind = "probabilities" if message.topic() == topics.probabilities else "dead-letter"
                self.seen.append((kind, commands.as_json(kind, message), time.time() * 1000))
        finally:
            consumer.close()


def test_an_unknown_schema_holds_back_only_its_partition(stream_factory, model_dir):
    stream = stream_factory(partitions=4)
    stream.put_schema("tickets", QUESTIONS)
    stream.put_schema("gone", QUESTIONS)
    stream.delete_schema("gone")
    worker = stream.start_worker(model_dir, "hol", "--schema-wait-ms", str(SCHEMA_WAIT_MS))
    worker.wait_for_log("schemas loaded")
    reader = _Reader(stream)
    reader.start()
    # One state first, so that preparing the schema is not in the measured latencies.
    producer = Producer({"bootstrap.servers": stream.bootstrap, "log_level": 0})
    producer.produce(stream.topics.states, partition=3, key=b"warm-up", value=_state("warm-up", "tickets", "warm up"))
    producer.flush(10)
    deadline = time.monotonic() + 60
    while not reader.seen and time.monotonic() < deadline:
        time.sleep(0.05)
    assert reader.seen, worker.log()

    # 4 rounds over 4 partitions; on partition 0, one state of a schema never published per 10 good ones; on
    # partition 1, one state of the deleted schema per round.
    texts = iter(state_texts(200, seed=5))
    sent: dict[str, tuple[int, str, float]] = {"warm-up": (3, "warm-up", 0.0)}  # state id -> (partition, kind, produced at, ms)
    for round_ in range(4):
        for index in range(10):
            for partition in range(4):
                state_id = f"good-{round_}-{index}-{partition}"
                producer.produce(stream.topics.states, partition=partition, key=state_id.encode(),
                                 value=_state(state_id, "tickets", next(texts)))
                sent[state_id] = (partition, "good", time.time() * 1000)
            if index == 3:
                producer.produce(stream.topics.states, partition=0, key=f"unknown-{round_}".encode(),
                                 value=_state(f"unknown-{round_}", "never-published", "who asks?"))
                sent[f"unknown-{round_}"] = (0, "unknown", time.time() * 1000)
                producer.produce(stream.topics.states, partition=1, key=f"deleted-{round_}".encode(),
                                 value=_state(f"deleted-{round_}", "gone", "asked of a deleted schema"))
                sent[f"deleted-{round_}"] = (1, "deleted", time.time() * 1000)
            producer.flush(10)
            time.sleep(0.1)

    deadline = time.monotonic() + SCHEMA_WAIT_MS / 1000 * 4 + 60
    while len(reader.seen) < len(sent) and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)  # duplicates would show
    reader.done.set()
    reader.join()

    by_id: dict[str, list] = {}
    for kind, record, visible_ms in reader.seen:
        by_id.setdefault(record["state_id"], []).append((kind, record, visible_ms))
    assert sorted(by_id) == sorted(sent), worker.log()
    assert all(len(outcomes) == 1 for outcomes in by_id.values()), "every state exactly once"
    assert stream.committed_offsets() == stream.end_offsets()

    for state_id, (partition, kind, produced_ms) in sent.items():
        [(out_kind, record, visible_ms)] = by_id[state_id]
        latency_ms = visible_ms - produced_ms
        if kind == "warm-up":
            continue
        if kind == "good":
            assert out_kind == "probabilities", record
            if partition != 0:  # the unblocked partitions keep their normal latency
                assert latency_ms < NORMAL_BOUND_S * 1000, (state_id, latency_ms, worker.log())
        elif kind == "unknown":
            assert out_kind == "dead-letter" and record["reason"] == "unknown_schema", record
            assert "after waiting" in record["message"] and record["state_id"] == state_id
        else:
            assert out_kind == "dead-letter" and record["reason"] == "unknown_schema", record
            assert "was deleted" in record["message"], record
            assert latency_ms < NORMAL_BOUND_S * 1000, (state_id, latency_ms)  # at once, not after the wait
    # Partition 0's good states behind a wait are held, then scored (not lost, not early).
    held = [by_id[state_id][0][2] - produced_ms for state_id, (partition, kind, produced_ms) in sent.items()
            if partition == 0 and kind == "good"]
    assert max(held) >= SCHEMA_WAIT_MS * 0.8, held
    assert worker.stop() == 0, worker.log()
