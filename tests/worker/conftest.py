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
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, Producer, TopicPartition

import schemas
from worker.cli import commands
from worker.config import Topics
from worker.kafka_clients import create_topics, last_committed, reader_consumer, reader_consumer_config, whole_pass_reader

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

    def events(self) -> list[dict]:
        """The events of a worker started with ``--log-format json``, in order, each with its wall time as ``t``."""
        from bench.stream_windows import log_events

        return log_events(self.log())

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
        # A session timeout of 6 s moves a killed worker's partitions soon; the consumer protocol's is the broker's
        # (tests.brokers sets it to 6 s on the Kafka it starts).
        session = [] if _group_protocol(extra) == "consumer" else ["--session-timeout-ms", "6000"]
        args = [sys.executable, *entry, "worker", "-b", self.bootstrap, "--model", str(model_dir),
                "--worker-id", worker_id, "--group", self.group,
                "--states-topic", self.topics.states, "--schemas-topic", self.topics.schemas,
                "--probabilities-topic", self.topics.probabilities, "--dead-letter-topic", self.topics.dead_letter,
                "--max-batch", "8", "--max-wait-ms", "50", *session, *extra]
        process_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        # One log per start: a restarted worker must not find its predecessor's lines.
        worker = WorkerProcess(args, self.workdir / f"worker-{worker_id}-{len(self.workers)}.log", process_env)
        self.workers.append(worker)
        return worker

    # ---- outputs ----------------------------------------------------------------------------------------------
    def collect(self, expected: int, timeout_s: float = 60.0, settle_s: float = 1.0,
                registry_url: str | None = None) -> tuple[list[dict], list[dict]]:
        """What a read_committed reader finds in both output topics, read from the beginning: whole passes, each
        by a fresh reader, until a pass finds ``expected`` records in total (then one more pass ``settle_s`` later, so
        that duplicates would show) or ``timeout_s`` runs out. Returns (probability records, dead letters) of the
        last pass, in any output format (``registry_url`` for avro-registry output).

        Whole passes, not one reader following the topics: a reader that fetches from an offset past an aborted
        transaction's abort marker is told by the embedded broker (noida-db 0.2.3) that the aborted transaction is
        still there, and librdkafka then skips every later batch of that producer id on the partition (the
        producer id a worker keeps across restarts with its --worker-id). Kafka lists only the aborted
        transactions that overlap the fetched range. A pass from offset 0 fetches each partition in one response
        that holds the abort markers before the later batches (``tests/worker/stream/test_progress.py`` shows the gap)."""
        deadline = time.monotonic() + timeout_s
        found = self.read_outputs(registry_url)
        while len(found[0]) + len(found[1]) < expected and time.monotonic() < deadline:
            time.sleep(0.2)
            found = self.read_outputs(registry_url)
        if len(found[0]) + len(found[1]) >= expected and settle_s > 0:
            time.sleep(settle_s)
            found = self.read_outputs(registry_url)
        return found

    def read_outputs(self, registry_url: str | None = None, pass_timeout_s: float = 20.0) -> tuple[list[dict], list[dict]]:
        """One pass: both output topics from the beginning to their last stable offsets, by a fresh read_committed
        reader that fetches each partition whole (up to 64 MiB) in one response."""
        from worker.formats.output_formats import OutputDecoder
        from worker.formats.registry import registry_client

        client = registry_client(registry_url) if registry_url else None
        decoders = {kind: OutputDecoder(kind, client) for kind in ("probabilities", "dead-letter")}
        consumer = whole_pass_reader(self.bootstrap)
        partitions = [TopicPartition(t, p, OFFSET_BEGINNING) for t in (self.topics.probabilities, self.topics.dead_letter)
                      for p in range(self.partitions)]
        consumer.assign(partitions)
        probabilities, dead, at_end = [], [], set()
        self.last_pass_counts: Counter = Counter()
        deadline = time.monotonic() + pass_timeout_s
        try:
            while len(at_end) < len(partitions) and time.monotonic() < deadline:
                message = consumer.poll(0.1)
                if message is None:
                    continue
                if message.error() is not None:
                    assert message.error().code() == KafkaError._PARTITION_EOF, message.error().str()
                    at_end.add((message.topic(), message.partition()))
                    continue
                self.last_pass_counts[(message.topic(), message.partition())] += 1
                if message.topic() == self.topics.probabilities:
                    probabilities.append(commands.as_json("probabilities", message, decoders["probabilities"]))
                else:
                    dead.append(commands.as_json("dead-letter", message, decoders["dead-letter"]))
            return probabilities, dead
        finally:
            consumer.close()

    # ---- when a test fails ------------------------------------------------------------------------------------
    def diagnostics(self, log_lines: int = 40) -> str:
        """What a failed test of this stream leaves to read: each worker's exit code and log tail, the consumer group's
        members and assignment, committed against end offsets of the states topic, and per output partition the high
        watermark, the last stable offset and what a whole read_committed pass finds there. Never raises."""
        parts = []
        for worker in self.workers:
            code = worker.process.poll()
            tail = "\n".join(worker.log().splitlines()[-log_lines:]) if worker.log_path.exists() else "(no log)"
            parts.append(f"--- {worker.log_path.name} (exit code {code}) ---\n{tail}")
        for title, read in (("consumer group", self._describe_group), ("states topic", self._describe_states),
                            ("output topics", self._describe_outputs)):
            try:
                parts.append(f"--- {title} ---\n{read()}")
            except Exception as exc:  # noqa: BLE001 - a diagnostic that fails must not hide the test's own failure
                parts.append(f"--- {title} --- could not be read: {exc!r}")
        return "\n".join(parts)

    def _describe_group(self) -> str:
        from confluent_kafka.admin import AdminClient

        admin = AdminClient({"bootstrap.servers": self.bootstrap})  # held: a client destroyed mid-request fails its futures
        described = admin.describe_consumer_groups([self.group], request_timeout=10)[self.group].result()
        members = [f"  {m.member_id} (instance {m.group_instance_id}, {m.client_id}): "
                   f"{sorted(tp.partition for tp in m.assignment.topic_partitions)}" for m in described.members]
        return f"{self.group}: state {described.state}\n" + ("\n".join(members) or "  no members")

    def _describe_states(self) -> str:
        committed, end = self.committed_offsets(), self.end_offsets()
        return "\n".join(f"  [{p}] committed {committed[p]}, end {end[p]}" for p in sorted(end))

    def _describe_outputs(self) -> str:
        probabilities, dead = self.read_outputs(pass_timeout_s=10)
        committed, uncommitted = reader_consumer(self.bootstrap), Consumer({**reader_consumer_config(self.bootstrap),
                                                                            "isolation.level": "read_uncommitted"})
        lines = [f"  a whole read_committed pass finds {len(probabilities)} probability records and {len(dead)} dead letters"]
        try:
            for topic in (self.topics.probabilities, self.topics.dead_letter):
                for p in range(self.partitions):
                    tp = TopicPartition(topic, p)
                    lso, hwm = committed.get_watermark_offsets(tp, timeout=10)[1], uncommitted.get_watermark_offsets(tp, timeout=10)[1]
                    lines.append(f"  {topic}[{p}]: high watermark {hwm}, last stable offset {lso}, "
                                 f"{self.last_pass_counts.get((topic, p), 0)} records in that pass")
        finally:
            committed.close()
            uncommitted.close()
        return "\n".join(lines)

    def committed_offsets(self, group: str | None = None) -> dict[int, int]:
        """A group's (default: the workers') committed offset per states partition (-1001 if none), whatever
        transaction is open (``worker.kafka_clients.last_committed``)."""
        parts = last_committed(self.bootstrap, group or self.group,
                               [TopicPartition(self.topics.states, p) for p in range(self.partitions)])
        return {tp.partition: tp.offset for tp in parts}

    def end_offsets(self) -> dict[int, int]:
        """The states topic's end offset per partition."""
        consumer = reader_consumer(self.bootstrap)
        try:
            return {p: consumer.get_watermark_offsets(TopicPartition(self.topics.states, p), timeout=10)[1]
                    for p in range(self.partitions)}
        finally:
            consumer.close()


def _group_protocol(args: tuple[str, ...]) -> str | None:
    """The --group-protocol value among a worker's ``args`` (None: not given)."""
    return next((args[i + 1] for i, arg in enumerate(args[:-1]) if arg == "--group-protocol"), None)


def feed_states(stream: Stream, states: list[tuple[str, bytes]], done: threading.Event, chunk: int = 10, pause_s: float = 0.05) -> None:
    """Publish (key, value) states in small chunks with pauses, so workers are mid-stream when a test kills or stops them."""
    producer = Producer({"bootstrap.servers": stream.bootstrap, "partitioner": "murmur2_random", "log_level": 0})
    for start in range(0, len(states), chunk):
        for state_id, value in states[start:start + chunk]:
            producer.produce(stream.topics.states, key=state_id.encode(), value=value)
        assert producer.flush(10) == 0
        time.sleep(pause_s)
    done.set()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's report gets each of its streams' diagnostics (``Stream.diagnostics``): worker log tails, the
    group's assignment, committed and end offsets, output watermarks; workers are still running at this point."""
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed:
        for index, stream in enumerate(getattr(item, "decider_streams", ())):
            report.sections.append((f"decider stream {index} ({stream.topics.states})", stream.diagnostics()))


@pytest.fixture
def stream_factory(kafka_bootstrap, tmp_path, request):
    """Make isolated streams; kills any worker still running at the end of the test."""
    made: list[Stream] = []
    request.node.decider_streams = made

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
