"""The exactly-once commit against the broker: committed records and offsets appear together; an aborted
transaction (records and offsets sent, then a failure) leaves nothing a read_committed reader can see and no
offset; a second instance with the same transactional id fences the first."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time

import pytest
from confluent_kafka import Consumer, KafkaError, TopicPartition

from worker.exceptions import AbortableError, BrokerOutageError, FencedError
from worker.kafka_clients import reader_consumer
from worker.formats.records import OutgoingRecord
from worker.stream.transactions import Transactions

MAX_MESSAGE_BYTES = 10_000  # the test producers' message.max.bytes: a larger record fails inside the transaction


def _group_consumer(stream) -> Consumer:
    consumer = Consumer({"bootstrap.servers": stream.bootstrap, "group.id": stream.group, "enable.auto.commit": False,
                         "isolation.level": "read_committed", "auto.offset.reset": "earliest", "log_level": 0})
    consumer.assign([TopicPartition(stream.topics.states, 0, 0)])
    return consumer


def _producer(stream, txn_id: str) -> dict:
    return {"bootstrap.servers": stream.bootstrap, "transactional.id": txn_id, "transaction.timeout.ms": 10_000, "log_level": 0,
            "message.max.bytes": MAX_MESSAGE_BYTES}


@contextlib.contextmanager
def _transactions(stream, txn_id: str):
    """An initialised Transactions committing a fresh group consumer's offsets; both closed afterwards."""
    consumer = _group_consumer(stream)
    txns = Transactions(_producer(stream, txn_id), consumer, "w")
    txns.init()
    try:
        yield txns
    finally:
        txns.close()
        consumer.close()


def _records(stream, n: int, tag: str) -> list[OutgoingRecord]:
    return [OutgoingRecord(stream.topics.probabilities, f"{tag}-{i}".encode(), f"value-{tag}-{i}".encode()) for i in range(n)]


def _read_keys(stream) -> list[str]:
    probabilities, _ = _raw_collect(stream)
    return sorted(k for k in probabilities)


def _raw_collect(stream, timeout_s: float = 3.0):
    consumer = reader_consumer(stream.bootstrap)
    consumer.assign([TopicPartition(stream.topics.probabilities, p, 0) for p in range(stream.partitions)])
    keys, eof, deadline = [], set(), time.monotonic() + timeout_s
    while len(eof) < stream.partitions and time.monotonic() < deadline:
        message = consumer.poll(0.1)
        if message is None:
            continue
        if message.error():
            assert message.error().code() == KafkaError._PARTITION_EOF, message.error().str()
            eof.add(message.partition())
            continue
        keys.append(message.key().decode())
    consumer.close()
    return keys, eof


def test_commit_publishes_records_and_offsets_together(stream):
    with _transactions(stream, "t-commit") as txns:
        txns.commit(_records(stream, 5, "ok"), [TopicPartition(stream.topics.states, 0, 17)])
        assert _read_keys(stream) == sorted(f"ok-{i}" for i in range(5))
        assert stream.committed_offsets()[0] == 17
        # where the transaction's time went, for the committed event
        assert list(txns.last_steps_ms) == ["begin", "produce", "offsets", "flush", "commit"]
        assert all(ms >= 0 for ms in txns.last_steps_ms.values())


def test_abort_leaves_nothing_visible_and_no_offsets(stream):
    with _transactions(stream, "t-abort") as txns:
        # Records are queued first (step 2): the oversized last one fails the produce step after four others, so the
        # transaction already holds records when the single abort path runs.
        too_big = OutgoingRecord(stream.topics.probabilities, b"too-big", b"x" * (MAX_MESSAGE_BYTES * 2))
        with pytest.raises(AbortableError, match="produce failed"):
            txns.commit(_records(stream, 4, "aborted") + [too_big], [TopicPartition(stream.topics.states, 0, 99)])
        assert _read_keys(stream) == []
        assert stream.committed_offsets()[0] < 0  # no committed offset at all
        txns.commit(_records(stream, 2, "after"), [TopicPartition(stream.topics.states, 0, 3)])
        assert _read_keys(stream) == ["after-0", "after-1"]
        assert stream.committed_offsets()[0] == 3


def test_second_instance_with_same_transactional_id_fences_the_first(stream):
    consumer = _group_consumer(stream)
    first = Transactions(_producer(stream, "t-fence"), consumer, "dup")
    first.init()
    first.commit(_records(stream, 1, "first"), [])
    second = Transactions(_producer(stream, "t-fence"), consumer, "dup")
    second.init()
    with pytest.raises(FencedError, match="--worker-id dup"):
        first.commit(_records(stream, 1, "zombie"), [])
    second.commit(_records(stream, 1, "second"), [])
    assert _read_keys(stream) == ["first-0", "second-0"]
    second.close()
    consumer.close()


def test_watchdog_exits_with_code_5_when_a_call_overruns_and_stays_quiet_otherwise():
    script = ("import sys, threading, time\nfrom worker.ops.liveness import BrokerLiveness\n"
              "from worker.stream.watchdog import Watchdog\nbroker = BrokerLiveness()\nw = Watchdog(broker)\n"
              "for _ in range(200):\n    with w.guard('quick', 0.4, 0.5):\n        pass\n"
              "print('after quick calls:', broker.liveness_problem(), file=sys.stderr, flush=True)\n"
              "report = lambda: (time.sleep(0.3), print('overrun:', broker.liveness_problem(), file=sys.stderr, flush=True))\n"
              "threading.Thread(target=report).start()\n"
              "with w.guard('send_offsets_to_transaction', 0.1, 0.6):\n    time.sleep(10)\n")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert done.returncode == 5, done.stderr
    assert "after quick calls: None" in done.stderr
    # Between the call's own timeout and the exit, /healthz has its reason to answer 503.
    assert "overrun: send_offsets_to_transaction overran its timeout" in done.stderr
    assert "send_offsets_to_transaction did not return" in done.stderr
    assert time.monotonic() - started < 8


def test_no_coordinator_within_the_outage_bound_is_exit_5():
    from worker.devbroker.processes import free_port
    from worker.ops.liveness import BrokerLiveness

    broker = BrokerLiveness()
    consumer = Consumer({"bootstrap.servers": "127.0.0.1:1", "group.id": "nobody", "log_level": 0})
    nobody = {"bootstrap.servers": f"127.0.0.1:{free_port()}", "transactional.id": "t-nobody", "log_level": 0}
    txns = Transactions(nobody, consumer, "w", timeout_s=0.5, outage_s=1.5, broker=broker)
    started = time.monotonic()
    with pytest.raises(BrokerOutageError, match="--broker-outage-s") as raised:
        txns.init()
    assert raised.value.exit_code == 5
    assert 1.5 <= time.monotonic() - started < 6
    assert "broker unreachable" in broker.readiness_problem()
    consumer.close()
