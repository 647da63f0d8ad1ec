"""Stalled partitions are reported (``worker.stream.progress``): a states partition with records waiting whose committed offset
stands still, and an output partition where a read_committed reader does not get the newest record the worker
committed. The second is what made a SIGKILL test lose the records of one partition: the embedded broker lists an
aborted transaction to every later fetch, and librdkafka then skips the producer's later records (issue 37)."""

from __future__ import annotations

import json
import multiprocessing
import os
import time
import urllib.error
import urllib.request
import uuid

import pytest
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition

from tests import brokers
from tests.worker.conftest import QUESTIONS, state_texts
from worker.ops import liveness, metrics
from worker.devbroker.processes import free_port
from worker.kafka_clients import create_topics, reader_consumer, reader_consumer_config
from worker.config import Topics
from worker.stream.progress import InputProgress, ProgressWatch, read_back

EMBEDDED = brokers.selection() == "embedded"


# ---- the input check, on the clock alone ---------------------------------------------------------------------------
def test_a_partition_with_records_waiting_and_no_commit_stalls_and_progress_resets_it():
    inputs = InputProgress()
    inputs.assigned([0, 1], now=0.0)
    inputs.observed(0, end=10, group_committed=4)  # 6 records wait
    inputs.observed(1, end=3, group_committed=3)   # caught up
    assert inputs.waiting(now=100.0) == {0: (100.0, 4, 10)}
    inputs.committed([(0, 7)], now=120.0)           # progress restarts the clock
    assert inputs.waiting(now=130.0) == {0: (10.0, 7, 10)}
    inputs.committed([(0, 10)], now=140.0)          # nothing waits: not a stall however long it stays so
    assert inputs.waiting(now=1000.0) == {}
    inputs.observed(0, end=12, group_committed=-1)  # new records: the clock runs from the last look without any
    assert inputs.waiting(now=1010.0) == {0: (10.0, 10, 12)}
    inputs.revoked([0])
    assert inputs.waiting(now=2000.0) == {}


def _stats(topic: str, partitions: dict[int, tuple[int, int]]) -> str:
    """librdkafka statistics JSON with each partition's ls_offset and committed_offset (the fields the check reads)."""
    return json.dumps({"topics": {topic: {"partitions": {
        **{str(p): {"fetch_state": "active", "ls_offset": end, "committed_offset": committed}
           for p, (end, committed) in partitions.items()},
        "-1": {"fetch_state": "none"}}}}})


def test_the_watch_reports_a_stall_once_it_lasts_the_bound_then_clears_it():
    described = []
    watch = ProgressWatch(states_topic="s", stall_after_s=60,
                          describe=lambda partition: described.append(partition) or "a cycle is not scored yet")
    try:
        watch.on_event("assigned", {"partitions": [3]})
        liveness.PARTITION_ENDS.on_stats(_stats("s", {3: (50, 20)}))
        start = time.monotonic()
        assert watch.check(start + 30) == [] and liveness.PROGRESS.readiness_problem() is None
        samples = {s.labels["partition"]: s.value for s in metrics.PARTITION_STALL_SECONDS.collect()[0].samples}
        assert samples["3"] == pytest.approx(30, abs=1)
        stalls = watch.check(start + 61)
        assert len(stalls) == 1 and stalls[0].startswith("s[3] has not advanced for 61 s with 30 records waiting")
        assert stalls[0].endswith("a cycle is not scored yet") and described == [3]
        assert "s[3] has not advanced" in liveness.PROGRESS.readiness_problem()
        watch.on_event("committed", {"offsets": [(3, 50)], "outputs": {}})
        assert watch.check(start + 62) == [] and liveness.PROGRESS.readiness_problem() is None
        assert not metrics.PARTITION_STALL_SECONDS.collect()[0].samples
    finally:
        liveness.PARTITION_ENDS.on_stats(json.dumps({}))
        liveness.PROGRESS.report(None)


@pytest.fixture
def watched():
    """A watch of states topic ``s`` with a 60 s bound, on the test's clock alone (its own thread is not started);
    partition 3 assigned at t = 1000 s. -> (watch, a function that sets partition 3's committed and end offsets as
    the consumer's statistics report them)."""
    watch = ProgressWatch(states_topic="s", stall_after_s=60)
    watch.inputs.assigned([3], now=1000.0)
    try:
        yield watch, lambda committed, end: liveness.PARTITION_ENDS.on_stats(_stats("s", {3: (end, committed)}))
    finally:
        liveness.PARTITION_ENDS.on_stats(json.dumps({}))
        liveness.PROGRESS.report(None)


def test_a_single_record_waiting_is_a_stall_once_it_waited_the_bound(watched):
    watch, ends = watched
    ends(committed=20, end=21)
    stalls = watch.check(1000.0 + 600)
    assert [s.split(" (")[0] for s in stalls] == ["s[3] has not advanced for 600 s with 1 records waiting"]
    assert "s[3] has not advanced" in liveness.PROGRESS.readiness_problem()   # /readyz: 503


def test_an_input_stall_is_reported_the_moment_it_lasted_the_bound(watched):
    watch, ends = watched
    ends(committed=20, end=25)
    assert watch.check(1000.0 + 59.99) == [] and liveness.PROGRESS.readiness_problem() is None
    assert [s.split(" (")[0] for s in watch.check(1000.0 + 60)] == ["s[3] has not advanced for 60 s with 5 records waiting"]
    assert "s[3] has not advanced for 60 s" in liveness.PROGRESS.readiness_problem()


# ---- reading a committed record back, on the session's broker --------------------------------------------------------
def _topic(bootstrap: str, partitions: int = 1) -> str:
    name = f"rb-{uuid.uuid4().hex[:8]}"
    create_topics(bootstrap, Topics(name + ".s", name + ".sc", name, name + ".dl"), partitions)
    return name


def _committed_record(producer: Producer, topic: str, value: bytes) -> int:
    """Produce ``value`` to partition 0 in one committed transaction; its offset."""
    offsets = []
    producer.begin_transaction()
    producer.produce(topic, value=value, partition=0, on_delivery=lambda err, msg: offsets.append(msg.offset()))
    assert producer.flush(10) == 0
    producer.commit_transaction(10)
    return offsets[0]


def _follower_gets(bootstrap: str, topic: str, offset: int) -> bool:
    """Whether a read_committed reader that starts fetching at ``offset`` (as one following the partition does once it
    has read what came before) gets the record there."""
    consumer = Consumer({**reader_consumer_config(bootstrap), "group.id": f"f-{uuid.uuid4().hex}"})
    consumer.assign([TopicPartition(topic, 0, offset)])
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            message = consumer.poll(0.2)
            if message is None:
                continue
            if message.error() is not None:
                assert message.error().code() == KafkaError._PARTITION_EOF
                return False
            return message.offset() == offset
        return False
    finally:
        consumer.close()


def test_a_committed_record_reads_back_and_an_open_transaction_before_it_is_named(kafka_bootstrap):
    topic = _topic(kafka_bootstrap)
    ours = Producer({"bootstrap.servers": kafka_bootstrap, "transactional.id": f"ours-{topic}"})
    ours.init_transactions(10)
    reader = reader_consumer(kafka_bootstrap)
    try:
        assert read_back(reader, (topic, 0), _committed_record(ours, topic, b"first")) == ""
        other = Producer({"bootstrap.servers": kafka_bootstrap, "transactional.id": f"other-{topic}"})
        other.init_transactions(10)
        other.begin_transaction()
        other.produce(topic, value=b"left open", partition=0)
        assert other.flush(10) == 0
        offset = _committed_record(ours, topic, b"second")
        found = read_back(reader, (topic, 0), offset)
        assert "last stable offset stays at" in found and "a transaction open there" in found, found
        other.abort_transaction(10)
        assert read_back(reader, (topic, 0), offset) == ""
    finally:
        reader.close()


def test_an_output_record_readers_do_not_get_is_reported_once_that_lasted_the_bound_and_clears(kafka_bootstrap):
    """The watch reads back what the worker committed; a record a read_committed reader does not get (an open
    transaction before it holds the last stable offset) is a stall after --stall-after-s, until readers get it."""
    topic = _topic(kafka_bootstrap)
    ours = Producer({"bootstrap.servers": kafka_bootstrap, "transactional.id": f"ours-{topic}"})
    ours.init_transactions(10)
    other = Producer({"bootstrap.servers": kafka_bootstrap, "transactional.id": f"other-{topic}"})
    other.init_transactions(10)
    other.begin_transaction()
    other.produce(topic, value=b"left open", partition=0)
    assert other.flush(10) == 0
    offset = _committed_record(ours, topic, b"committed behind it")
    watch = ProgressWatch(states_topic="s", stall_after_s=60)
    watch._reader = reader_consumer(kafka_bootstrap)   # what start() sets, without its thread: the test's clock alone
    try:
        watch.on_event("committed", {"offsets": [], "outputs": {(topic, 0): offset}})
        t0 = time.monotonic()
        for _ in range(5):  # a read-back that learns nothing (no answer in its 3 s) does not start the clock
            assert watch.check(t0) == [] and liveness.PROGRESS.readiness_problem() is None    # unreadable for 0 s yet
            if watch.outputs.unreadable(t0):
                break
        assert watch.outputs.unreadable(t0), "five read-backs never found the record unreadable"
        stalls = watch.check(t0 + 60)
        assert [s.split(": ")[0] for s in stalls] == [f"{topic}[0] for 60 s"], stalls
        assert "its last stable offset stays at" in stalls[0]
        assert f"{topic}[0] for 60 s" in liveness.PROGRESS.readiness_problem()           # /readyz: 503
        other.abort_transaction(10)
        assert watch.check(t0 + 61) == [] and liveness.PROGRESS.readiness_problem() is None
    finally:
        watch._reader.close()
        liveness.PROGRESS.report(None)


def _abandon_open_transaction(bootstrap: str, transactional_id: str, topic: str) -> None:
    """A producer process that dies (os._exit: no abort, no close) with a record in an open transaction."""
    producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": transactional_id})
    producer.init_transactions(10)
    producer.begin_transaction()
    producer.produce(topic, value=b"never committed", partition=0)
    producer.flush(10)
    os._exit(0)


def _killed_mid_transaction(bootstrap: str, transactional_id: str, topic: str) -> None:
    process = multiprocessing.get_context("spawn").Process(target=_abandon_open_transaction,
                                                           args=(bootstrap, transactional_id, topic))
    process.start()
    process.join(60)
    assert process.exitcode == 0


def test_a_restarted_producers_records_after_an_aborted_transaction_read_back_as_a_follower_gets_them(kafka_bootstrap):
    """The check agrees with a following reader on every broker; on the embedded broker both miss the record (its
    gap, issue 37). If the second half fails there, noida-db fixed its aborted-transaction list: Stream.collect's
    whole passes and this note can go."""
    topic = _topic(kafka_bootstrap)
    transactional_id = f"restarted-{topic}"
    _killed_mid_transaction(kafka_bootstrap, transactional_id, topic)
    restarted = Producer({"bootstrap.servers": kafka_bootstrap, "transactional.id": transactional_id})
    restarted.init_transactions(10)  # aborts what the dead instance left open: an abort marker after its record
    offset = _committed_record(restarted, topic, b"after the abort")
    reader = reader_consumer(kafka_bootstrap)
    try:
        found = read_back(reader, (topic, 0), offset)
    finally:
        reader.close()
    assert (found == "") == _follower_gets(kafka_bootstrap, topic, offset), found
    if EMBEDDED:
        assert "lists an aborted transaction of this producer id" in found, found


# ---- a worker says so ------------------------------------------------------------------------------------------------
def _readyz(port: int) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except (urllib.error.URLError, ConnectionError):
        return 0, ""


def _wait_for_readyz(port: int, status: int, needle: str, worker, timeout_s: float = 90) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        code, body = _readyz(port)
        if code == status and needle in body:
            return body
        assert worker.process.poll() is None, worker.log()
        time.sleep(0.2)
    raise AssertionError(f"/readyz never answered {status} with {needle!r}; last {_readyz(port)}\n{worker.log()}")


def test_a_partition_whose_scores_do_not_come_is_reported_and_fails_readyz_until_they_do(stream_factory, model_dir):
    stream = stream_factory(1)
    stream.put_schema("support", QUESTIONS)
    port = free_port()
    worker = stream.start_worker(model_dir, "stalled", "--stall-after-s", "2", "--metrics-port", str(port),
                                 scores_late_s=12)
    worker.wait_for_log("assigned", timeout_s=90)
    stream.produce_states([(f"s-{i}", text) for i, text in enumerate(state_texts(3, seed=5))], "support")
    body = _wait_for_readyz(port, 503, "has not advanced", worker)
    assert f"{stream.topics.states}[0] has not advanced" in body and "records waiting" in body, body
    assert "stalled partition:" in worker.log() and "was submitted" in worker.log(), worker.log()
    _wait_for_readyz(port, 200, "ready", worker, timeout_s=60)  # the late scores came and committed: it clears
    assert worker.stop() == 0, worker.log()


def test_a_worker_whose_committed_records_readers_do_not_get_says_so(stream_factory, model_dir):
    """The killed predecessor's open transaction on the output partition is aborted by the worker's start; on the
    embedded broker its later records there are then skipped by following readers, and the worker reports it."""
    stream = stream_factory(1)
    stream.put_schema("support", QUESTIONS)
    _killed_mid_transaction(stream.bootstrap, f"decider.{stream.group}.heir", stream.topics.probabilities)
    port = free_port()
    worker = stream.start_worker(model_dir, "heir", "--stall-after-s", "2", "--metrics-port", str(port))
    worker.wait_for_log("assigned", timeout_s=90)
    stream.produce_states([(f"s-{i}", text) for i, text in enumerate(state_texts(3, seed=6))], "support")
    probabilities, _ = stream.collect(3, timeout_s=60, settle_s=0)
    assert len(probabilities) == 3  # a whole pass from the beginning gets them all, on every broker
    if EMBEDDED:
        body = _wait_for_readyz(port, 503, "lists an aborted transaction of this producer id", worker)
        assert f"{stream.topics.probabilities}[0]" in body, body
        assert "stalled partition:" in worker.log(), worker.log()
    else:
        time.sleep(5)
        assert _readyz(port)[0] == 200 and "stalled partition:" not in worker.log(), worker.log()
    assert worker.stop() == 0, worker.log()
