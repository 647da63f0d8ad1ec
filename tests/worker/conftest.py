"""Fixtures and helpers of the worker tests: isolated topic sets, worker subprocesses, read_committed readers.

Workers always run as real subprocesses (``python -m worker worker ...``) against the session broker,
with the real tiny model and real Avro bytes; readers see only what a read_committed consumer sees.
"""

from __future__ import annotations

import json
import os
import threading
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import OFFSET_BEGINNING, KafkaError, Producer, TopicPartition

import schemas
from worker.cli import commands
from worker.config import Topics
from worker.kafka_clients import create_topics, reader_consumer

REPO = Path(__file__).resolve().parents[2]
SCHEMA_FILE = REPO / "worker" / "examples" / "support_schema.json"

QUESTIONS = {
    "questions": [
        {"id": "angry", "question": "Is the customer angry?", "options": ["yes", "no"]},
        {"id": "want", "question": "What does the customer want?", "options": ["refund", "replacement", "information"]},
        {"id": "team", "question": "Which team?", "options": ["billing", "shipping", "tech", "sales"], "temperature": 0.7},
    ]
}
QUESTIONS_V2 = {
    "questions": [
        {"id": "urgent", "question": "Is it urgent?", "options": ["yes", "no"]},
        {"id": "angry", "question": "Is the customer angry?", "options": ["yes", "no", "unclear"]},
    ]
}

WORDS = ("order late refund angry disk full alert payment card fraud login failed latency spike user asked "
         "for help the box was damaged again and nobody answered my email within three days").split()


def state_texts(n: int, seed: int = 0) -> list[str]:
    """Deterministic states of mixed length."""
    import random

    rnd = random.Random(seed)
    return [" ".join(rnd.choice(WORDS) for _ in range(rnd.randint(2, 30))) for _ in range(n)]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """The tiny random Qwen3.5-family model every worker test scores with."""
    from engine.testing import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("worker-tiny-model"), seed=0)


@pytest.fixture(scope="session")
def schema_engine(model_dir):
    """The reference scorer: the same model loaded in the test process (CPU float32)."""
    from engine import Engine, SchemaEngine

    return SchemaEngine(Engine.load(model_dir, device="cpu", dtype="float32"))


class WorkerProcess:
    """One ``decider worker`` subprocess with its log file."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str]) -> None:
        self.args, self.log_path = args, log_path
        self._log = open(log_path, "ab")
        self.process = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=REPO)

    def log(self) -> str:
        """Everything the worker printed so far."""
        return self.log_path.read_text(errors="replace")

    def wait_for_log(self, needle: str, timeout_s: float = 60.0) -> None:
        """Block until ``needle`` appears in the log (fails if the worker exits first)."""
        deadline = time.monotonic() + timeout_s
        while needle not in self.log():
            assert self.process.poll() is None, f"worker exited ({self.process.returncode}) before logging {needle!r}:\n{self.log()}"
            assert time.monotonic() < deadline, f"worker did not log {needle!r} in {timeout_s} s:\n{self.log()}"
            time.sleep(0.05)

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, then wait for a clean exit; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout_s)
        finally:
            self._log.close()

    def kill(self) -> None:
        """SIGKILL: no chance to commit, abort or close anything."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self._log.close()


@dataclass
class Stream:
    """An isolated set of the four topics plus a consumer group on the session broker."""

    bootstrap: str
    topics: Topics
    group: str
    workdir: Path
    partitions: int
    workers: list[WorkerProcess] = field(default_factory=list)
    _producer: Producer | None = None

    # ---- inputs ----------------------------------------------------------------------------------------------
    def put_schema(self, schema_id: str, document: dict[str, Any]) -> dict[str, Any]:
        path = self.workdir / f"schema-{schema_id}-{uuid.uuid4().hex[:6]}.json"
        path.write_text(json.dumps(document))
        return commands.put_schema(self.bootstrap, self.topics, schema_id, path)[0]

    def delete_schema(self, schema_id: str) -> None:
        commands.delete_schema(self.bootstrap, self.topics, schema_id)

    def produce_states(self, items: list[tuple[str, str]], schema_id: str) -> None:
        """Publish (state id, text) pairs naming ``schema_id``."""
        records = [{"state_id": sid, "schema_id": schema_id, "state": text, "event_time": 1_700_000_000_000, "metadata": None}
                   for sid, text in items]
        commands.produce_states(self.bootstrap, self.topics, records)

    def produce_raw(self, key: bytes | None, value: bytes | None, topic: str | None = None) -> None:
        """Publish arbitrary bytes (bad input) to the states topic (or ``topic``)."""
        if self._producer is None:
            self._producer = Producer({"bootstrap.servers": self.bootstrap, "partitioner": "murmur2_random", "log_level": 0})
        self._producer.produce(topic or self.topics.states, key=key, value=value)
        assert self._producer.flush(10) == 0

    # ---- workers ---------------------------------------------------------------------------------------------
    def start_worker(self, model_dir: Path, worker_id: str, *extra: str, env: dict[str, str] | None = None,
                     fail_on: str | None = None, scores_late_s: float | None = None) -> WorkerProcess:
        """A worker on this stream; with ``fail_on``, states containing that text fail in the scoring step; with
        ``scores_late_s``, each batch's scores are ready that long after its launch (``tests.worker.faults``)."""
        entry = ["-m", "worker"]
        if fail_on is not None:
            entry = ["-m", "tests.worker.faults", f"fail-on={fail_on}"]
        elif scores_late_s is not None:
            entry = ["-m", "tests.worker.faults", f"scores-late={scores_late_s}"]
        args = [sys.executable, *entry, "worker", "-b", self.bootstrap, "--model", str(model_dir),
                "--worker-id", worker_id, "--group", self.group,
                "--states-topic", self.topics.states, "--schemas-topic", self.topics.schemas,
                "--probabilities-topic", self.topics.probabilities, "--dead-letter-topic", self.topics.dead_letter,
                "--max-batch", "8", "--max-wait-ms", "50", "--session-timeout-ms", "6000", *extra]
        process_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        # One log per start: a restarted worker must not find its predecessor's lines.
        worker = WorkerProcess(args, self.workdir / f"worker-{worker_id}-{len(self.workers)}.log", process_env)
        self.workers.append(worker)
        return worker

    # ---- outputs ---------------------------------------------------------------------------------------------
    def collect(self, expected: int, timeout_s: float = 60.0, settle_s: float = 1.0,
                registry_url: str | None = None) -> tuple[list[dict], list[dict]]:
        """Read both output topics from the beginning, read_committed, until ``expected`` records in total
        (then ``settle_s`` more, so duplicates would show). Returns (probability records, dead letters), in any
        output format (``registry_url`` for avro-registry output)."""
        from worker.formats.output_formats import OutputDecoder
        from worker.formats.registry import registry_client

        client = registry_client(registry_url) if registry_url else None
        decoders = {kind: OutputDecoder(kind, client) for kind in ("probabilities", "dead-letter")}
        consumer = reader_consumer(self.bootstrap)
        consumer.assign([TopicPartition(t, p, OFFSET_BEGINNING)
                         for t in (self.topics.probabilities, self.topics.dead_letter) for p in range(self.partitions)])
        probabilities, dead = [], []
        deadline, settle_until = time.monotonic() + timeout_s, None
        try:
            while True:
                now = time.monotonic()
                if settle_until is None and len(probabilities) + len(dead) >= expected:
                    settle_until = now + settle_s
                if (settle_until is not None and now >= settle_until) or now >= deadline:
                    return probabilities, dead
                message = consumer.poll(0.1)
                if message is None or message.error() is not None:
                    if message is not None:
                        assert message.error().code() == KafkaError._PARTITION_EOF, message.error().str()
                    continue
                if message.topic() == self.topics.probabilities:
                    probabilities.append(commands.as_json("probabilities", message, decoders["probabilities"]))
                else:
                    dead.append(commands.as_json("dead-letter", message, decoders["dead-letter"]))
        finally:
            consumer.close()

    def committed_offsets(self, group: str | None = None) -> dict[int, int]:
        """A group's (default: the workers') committed offset per states partition (-1001 if none)."""
        consumer = reader_consumer(self.bootstrap, group=group or self.group)
        try:
            parts = consumer.committed([TopicPartition(self.topics.states, p) for p in range(self.partitions)], timeout=10)
            return {tp.partition: tp.offset for tp in parts}
        finally:
            consumer.close()

    def end_offsets(self) -> dict[int, int]:
        """The states topic's end offset per partition."""
        consumer = reader_consumer(self.bootstrap)
        try:
            return {p: consumer.get_watermark_offsets(TopicPartition(self.topics.states, p), timeout=10)[1]
                    for p in range(self.partitions)}
        finally:
            consumer.close()


def feed_states(stream: Stream, states: list[tuple[str, bytes]], done: threading.Event, chunk: int = 10, pause_s: float = 0.05) -> None:
    """Publish (key, value) states in small chunks with pauses, so workers are mid-stream when a test kills or stops them."""
    producer = Producer({"bootstrap.servers": stream.bootstrap, "partitioner": "murmur2_random", "log_level": 0})
    for start in range(0, len(states), chunk):
        for state_id, value in states[start:start + chunk]:
            producer.produce(stream.topics.states, key=state_id.encode(), value=value)
        assert producer.flush(10) == 0
        time.sleep(pause_s)
    done.set()


@pytest.fixture
def stream_factory(kafka_bootstrap, tmp_path):
    """Make isolated streams; kills any worker still running at the end of the test."""
    made: list[Stream] = []

    def make(partitions: int = 2) -> Stream:
        suffix = uuid.uuid4().hex[:8]
        topics = Topics(states=f"t-{suffix}.states", schemas=f"t-{suffix}.schemas",
                        probabilities=f"t-{suffix}.probabilities", dead_letter=f"t-{suffix}.dead-letter")
        create_topics(kafka_bootstrap, topics, partitions)
        stream = Stream(kafka_bootstrap, topics, f"g-{suffix}", tmp_path, partitions)
        made.append(stream)
        return stream

    yield make
    for stream in made:
        for worker in stream.workers:
            worker.kill()
        if stream._producer is not None:
            stream._producer.flush(5)
            stream._producer = None


@pytest.fixture
def stream(stream_factory) -> Stream:
    """One isolated stream with 2 partitions."""
    return stream_factory(2)


def expected_probabilities(schema_engine, document: dict, texts: list[str]) -> list[list[list[float]]]:
    """What ``SchemaEngine.score`` gives for ``texts`` under ``document``'s questions, per state, per question."""
    from worker.formats.records import engine_questions, question_schema_record

    record = question_schema_record(document, "ref", 1)
    handle = schema_engine.prepare(engine_questions(record), independent=document.get("mode") == "independent")
    try:
        probs = schema_engine.score(handle, texts)
        return [[row[:n] for row, n in zip(p.tolist(), handle.n_options)] for p in probs]
    finally:
        schema_engine.release(handle)


def encode_state(state_id: str, schema_id: str, text: str) -> bytes:
    """Avro bytes of a StateEvent."""
    return schemas.encode_state({"state_id": state_id, "schema_id": schema_id, "state": text, "event_time": None, "metadata": None})
