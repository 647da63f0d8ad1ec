"""A broker outage mid-stream: the broker is SIGKILLed while the worker works through a backlog, /readyz turns 503,
the broker comes back on the same port and data dir, and the same worker process resumes by itself and finishes:
every state the broker kept is scored exactly once (read_committed), with no worker restart.

On the consumer protocol (KIP-848, Apache Kafka's default here) the same process must ride it out. On the classic
protocol, whose static membership librdkafka fences when a session expired during the outage and the member rejoined
(confluentinc/librdkafka#3437; the worker then exits 5 saying so), the test restarts the worker once with the same
--worker-id, as a supervisor would, and exactly-once must hold across that too.

The broker is the session's kind, started for the test alone (``tests.brokers.own_broker``). Apache Kafka keeps every
acknowledged record across the SIGKILL, so there every state produced is scored exactly once. noida-db is not
crash-durable (it may lose acknowledged records on kill -9), so there exactly-once is asserted over the states it
still holds after the restart, read back from the states topic.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections import Counter

import pytest
from confluent_kafka import OFFSET_BEGINNING, KafkaError, TopicPartition

import schemas
from tests import brokers
from tests.brokers import own_broker
from tests.worker.conftest import QUESTIONS, Stream, encode_state, state_texts
from worker.config import Topics
from worker.devbroker.processes import free_port
from worker.kafka_clients import create_topics, plain_producer, reader_consumer


def _status(port: int, path: str) -> int | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


def _wait_for(condition, timeout_s: float, what: str, log) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} not within {timeout_s} s:\n{log()}"
        time.sleep(0.1)


def _produce(bootstrap: str, topic: str, states: list[tuple[str, bytes]]) -> None:
    producer = plain_producer(bootstrap)
    for state_id, value in states:
        producer.produce(topic, key=state_id.encode(), value=value)
    assert producer.flush(15) == 0


def _states_kept(stream: Stream) -> list[str]:
    """The state ids the states topic holds now (read_committed, to its end)."""
    consumer = reader_consumer(stream.bootstrap)
    ends = {p: consumer.get_watermark_offsets(TopicPartition(stream.topics.states, p), timeout=10)[1]
            for p in range(stream.partitions)}
    consumer.assign([TopicPartition(stream.topics.states, p, OFFSET_BEGINNING) for p in ends if ends[p] > 0])
    ids, done = [], {p for p, end in ends.items() if end == 0}
    deadline = time.monotonic() + 30
    try:
        while len(done) < len(ends) and time.monotonic() < deadline:
            message = consumer.poll(0.2)
            if message is None:
                continue
            if message.error() is not None:
                assert message.error().code() == KafkaError._PARTITION_EOF, message.error().str()
                if message.offset() >= ends[message.partition()]:
                    done.add(message.partition())
                continue
            ids.append(schemas.decode_state(message.value())["state_id"])
            if message.offset() + 1 >= ends[message.partition()]:
                done.add(message.partition())
    finally:
        consumer.close()
    assert len(done) == len(ends), "could not read the states topic to its end"
    return ids


@pytest.mark.parametrize("protocol", brokers.group_protocols())
def test_worker_rides_out_a_broker_outage(tmp_path, model_dir, protocol):
    with own_broker(tmp_path) as broker:
        _rides_out_an_outage(broker, tmp_path, model_dir, protocol)


def _rides_out_an_outage(broker, tmp_path, model_dir, protocol: str) -> None:
    stream = Stream(broker.bootstrap, Topics("o.states", "o.schemas", "o.probabilities", "o.dead-letter"), "g-outage",
                    tmp_path, 2)
    metrics_port = free_port()
    try:
        create_topics(broker.bootstrap, stream.topics, 2)
        stream.put_schema("tickets", QUESTIONS)
        # the transaction opened when the broker dies blocks in send_offsets_to_transaction until the broker is back,
        # or at most for the transaction timeout (librdkafka ignores the call's own 5 s), and the watchdog exits the
        # worker 5 s after that: 30 s, longer than the outage (Apache Kafka takes 5-10 s to restart here, noida-db <1 s)
        def start():
            return stream.start_worker(model_dir, "outlasts", "--group-protocol", protocol, "--metrics-port",
                                       str(metrics_port), "--transaction-timeout-ms", "30000", "--max-batch", "4")

        worker, restarts = start(), []

        def rides_on():
            """Whether the worker runs on; on the classic protocol a worker fenced right after its session expired
            (librdkafka's static membership, confluentinc/librdkafka#3437: exit 5) is restarted, as a supervisor
            would, and counted. The consumer protocol must ride through in the same process."""
            nonlocal worker
            if worker.process.poll() is None:
                return True
            if protocol == "classic" and worker.process.returncode == 5 and "librdkafka#3437" in worker.log():
                restarts.append(worker.log())
                worker = start()
                return True
            return False

        _wait_for(lambda: _status(metrics_port, "/readyz") == 200, 90, "ready", worker.log)
        texts = state_texts(400, seed=8)
        states = [(f"o-{i}", encode_state(f"o-{i}", "tickets", t)) for i, t in enumerate(texts)]
        _produce(broker.bootstrap, stream.topics.states, states[:300])  # a backlog: the worker is mid-stream
        _wait_for(lambda: "committed scored=" in worker.log(), 60, "a first commit", worker.log)

        broker.kill()  # SIGKILL: no clean shutdown of the broker; its log directory stays
        _wait_for(lambda: _status(metrics_port, "/readyz") != 200, 20, "/readyz 503 during the outage", worker.log)
        assert rides_on(), worker.log()
        time.sleep(3.0)

        broker.start()
        _produce(broker.bootstrap, stream.topics.states, states[300:])
        kept = _states_kept(stream)
        assert len(kept) >= 100, kept  # at least what was produced after the restart
        if type(broker).__name__ == "ApacheKafka":  # crash-durable: nothing it acknowledged is gone
            assert sorted(kept) == sorted(state_id for state_id, _ in states), len(kept)

        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            probabilities, dead = stream.collect(len(kept), timeout_s=5, settle_s=0)
            if set(kept) <= {r["state_id"] for r in probabilities}:
                break
            assert rides_on(), f"the worker exited:\n{worker.log()}"
        probabilities, dead = stream.collect(len(kept), timeout_s=30, settle_s=2.0)
        counts = Counter(r["state_id"] for r in probabilities)
        assert not dead, dead
        if not set(kept) <= set(counts):   # pytest cuts a long assertion message short: the log's end in full
            # Twice in CI (never here) none of the 400 states was found: whether the worker stopped committing or the
            # reader stopped seeing its records, the states' committed offsets and the outputs' stable ones tell.
            pytest.fail(f"{len(set(kept) - set(counts))} states kept by the broker never scored "
                        f"(e.g. {sorted(set(kept) - set(counts))[:10]}); {len(restarts)} restarts; {len(counts)} "
                        f"scored states read\n{stream.diagnostics(log_lines=12)}", pytrace=False)
        assert set(counts.values()) == {1}, {k: v for k, v in counts.items() if v > 1}
        assert stream.committed_offsets() == stream.end_offsets()
        assert _status(metrics_port, "/readyz") == 200 and _status(metrics_port, "/healthz") == 200
        assert worker.process.poll() is None and (protocol == "classic" or not restarts), restarts
        assert worker.stop() == 0, worker.log()
    finally:
        for process in stream.workers:
            process.kill()


def test_worker_exits_5_when_the_broker_stays_away(tmp_path, model_dir):
    with own_broker(tmp_path) as broker:
        _exits_5_when_the_broker_stays_away(broker, tmp_path, model_dir)


def _exits_5_when_the_broker_stays_away(broker, tmp_path, model_dir) -> None:
    stream = Stream(broker.bootstrap, Topics("g.states", "g.schemas", "g.probabilities", "g.dead-letter"), "g-gone",
                    tmp_path, 1)
    try:
        create_topics(broker.bootstrap, stream.topics, 1)
        stream.put_schema("tickets", QUESTIONS)
        worker = stream.start_worker(model_dir, "gives-up", "--broker-outage-s", "4", "--transaction-timeout-ms", "6000")
        _produce(broker.bootstrap, stream.topics.states, [("g-0", encode_state("g-0", "tickets", "the box was damaged"))])
        scored, dead = stream.collect(1, timeout_s=90, settle_s=0)
        # the broker goes away only once the worker has scored and committed: an outage mid-run, not at its start
        assert [r["state_id"] for r in scored] == ["g-0"] and dead == [], (scored, dead, worker.log())
        broker.kill()
        killed = time.monotonic()
        assert worker.process.wait(60) == 5, worker.log()
        assert time.monotonic() - killed >= 4
        log = worker.log()
        assert "--broker-outage-s" in log and "Traceback" not in log, log
    finally:
        for process in stream.workers:
            process.kill()
