"""Transactions on several transactional ids in turn (worker.stream.turns), against the broker: each commit goes out
on the next id, every commit's records and offsets are visible as with one id, and at start a group whose committed
offsets do not answer gets a transaction on every id."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

from tests.worker.stream.test_transactions import _group_consumer, _producer, _read_keys, _records
from worker.config import WorkerConfig
from worker.exceptions import FencedError
from worker.stream.assignment import GroupAssignment
from worker.kafka_clients import last_committed
from worker.stream import turns
from worker.stream.transactions import Transactions
from worker.stream.turns import TakingTurns, complete_hanging_offsets


def _turns(stream, consumer, ids: list[str]) -> TakingTurns:
    taking = TakingTurns([Transactions(_producer(stream, tid), consumer, "w") for tid in ids])
    taking.init()
    return taking


def test_each_commit_goes_out_on_the_next_id_and_every_commit_is_visible(stream):
    """Fencing one id shows which id a commit used: with ids a and b, the 1st and 3rd commits are a's, the 2nd b's.
    Everything committed is read back, and the group's offset is the last commit's."""
    consumer = _group_consumer(stream)
    taking = _turns(stream, consumer, ["turn-a", "turn-b"])
    taking.commit(_records(stream, 2, "c1"), [TopicPartition(stream.topics.states, 0, 1)])     # on a
    assert taking.last_outputs, "the outputs of the last commit are reported"
    intruder = Transactions(_producer(stream, "turn-b"), consumer, "other")
    intruder.init()                                                                             # fences b's producer
    with pytest.raises(FencedError):
        taking.commit(_records(stream, 1, "c2"), [TopicPartition(stream.topics.states, 0, 2)])  # on b: fenced
    intruder.close()
    taking.commit(_records(stream, 2, "c3"), [TopicPartition(stream.topics.states, 0, 3)])     # on a again
    assert _read_keys(stream) == ["c1-0", "c1-1", "c3-0", "c3-1"]
    assert stream.committed_offsets()[0] == 3
    with pytest.raises(KafkaException, match="fenced"):   # b's fenced producer cannot abort; the others still close
        taking.close()
    consumer.close()


def test_back_to_back_commits_on_two_ids_commit_offsets_in_order(stream):
    """Twenty back-to-back commits alternating between two ids: the group's offset ends at the last one's (a
    transaction's offsets may reach the coordinator after the next one's when their markers race; the one appended
    last wins), and every record is visible once."""
    consumer = _group_consumer(stream)
    taking = _turns(stream, consumer, ["order-a", "order-b"])
    for i in range(1, 21):
        taking.commit(_records(stream, 1, f"k{i:02d}"), [TopicPartition(stream.topics.states, 0, i)])
    assert _read_keys(stream) == [f"k{i:02d}-0" for i in range(1, 21)]
    assert stream.committed_offsets()[0] == 20
    taking.close()
    consumer.close()


def _config(stream) -> WorkerConfig:
    return WorkerConfig(bootstrap=stream.bootstrap, model_dir="unused", worker_id="w", group=stream.group,
                        topics=stream.topics)


def test_start_completes_nothing_when_the_committed_offsets_answer(stream):
    consumer = _group_consumer(stream)
    taking = _turns(stream, consumer, ["calm-a", "calm-b"])
    taking.commit([], [TopicPartition(stream.topics.states, 0, 5)])
    assert complete_hanging_offsets(_config(stream), consumer, taking) is False
    assert last_committed(stream.bootstrap, stream.group, [TopicPartition(stream.topics.dead_letter, 0)])[0].offset < 0
    taking.close()
    consumer.close()


def test_start_commits_on_every_id_when_the_committed_offsets_do_not_answer(stream, monkeypatch):
    """Offsets pending in a transaction nobody ends (another producer's, open for its whole timeout) make the stable
    committed offsets time out, as a transaction whose marker a restarted broker skipped does. The worker then
    commits a transaction on each of its ids holding only the dead-letter topic's end offset (its marker is what
    completes such offsets when they are its own ids'); the input's last committed offsets are untouched."""
    monkeypatch.setattr(turns, "HANGING_CHECK_S", 1.0)
    consumer = _group_consumer(stream)
    taking = _turns(stream, consumer, ["heal-a", "heal-b"])
    taking.commit([], [TopicPartition(stream.topics.states, 0, 4)])
    stuck = Producer({**_producer(stream, "abandoned"), "transaction.timeout.ms": 600_000})
    stuck.init_transactions(10)
    stuck.begin_transaction()
    stuck.send_offsets_to_transaction([TopicPartition(stream.topics.states, 1, 7)], consumer.consumer_group_metadata(), 10)
    with pytest.raises(KafkaException) as stable:
        consumer.committed([TopicPartition(stream.topics.states, 1)], timeout=1)
    assert stable.value.args[0].code() in (KafkaError._TIMED_OUT, KafkaError.UNSTABLE_OFFSET_COMMIT)
    monkeypatch.setattr(turns, "_committed_answer",
                        _answers_after(turns._committed_answer, first=1))  # the check after the heal: at once
    started = time.monotonic()
    assert complete_hanging_offsets(_config(stream), consumer, taking) is True
    assert time.monotonic() - started < 20
    dead_letter = last_committed(stream.bootstrap, stream.group, [TopicPartition(stream.topics.dead_letter, 0)])
    assert dead_letter[0].offset == 0                      # the topic's end: it holds nothing
    assert stream.committed_offsets()[0] == 4              # the input's offsets as they were
    stuck.abort_transaction(10)
    taking.close()
    consumer.close()


def test_partitions_assigned_after_a_loss_get_the_same_heal_when_their_offsets_do_not_answer(stream, monkeypatch):
    """A broker outage can outlast the group session: the worker's partitions are lost and come back in the same
    process, after its last transaction may have been committing while the broker restarted. Their offsets then hang
    as at a restart, and librdkafka would retry their fetch forever without a word (a CI run saw a worker silent for
    120 s after lost -> assigned). So the assignment that follows a loss checks them, and heals as at start; an
    assignment that follows no loss does not wait on them."""
    monkeypatch.setattr(turns, "HANGING_CHECK_S", 1.0)
    consumer = Consumer({"bootstrap.servers": stream.bootstrap, "group.id": stream.group, "enable.auto.commit": False,
                         "isolation.level": "read_committed", "log_level": 0})
    taking = _turns(stream, consumer, ["lost-a", "lost-b"])
    dropped: list[str] = []
    assignment = GroupAssignment(_config(stream))
    assignment.start(consumer, taking, lambda why, partitions: dropped.append(why))   # nothing hangs yet: no heal
    consumer.unsubscribe()   # the test plays the rebalance callbacks itself
    partitions = [TopicPartition(stream.topics.states, p) for p in range(stream.partitions)]
    dead_letter = [TopicPartition(stream.topics.dead_letter, 0)]
    stuck = Producer({**_producer(stream, "abandoned-lost"), "transaction.timeout.ms": 600_000})
    stuck.init_transactions(10)
    stuck.begin_transaction()
    stuck.send_offsets_to_transaction([TopicPartition(stream.topics.states, 1, 7)], consumer.consumer_group_metadata(), 10)
    started = time.monotonic()
    assignment._on_assign(consumer, partitions)                               # no loss before it: no check, no heal
    assert time.monotonic() - started < 1.0
    assert last_committed(stream.bootstrap, stream.group, dead_letter)[0].offset < 0
    assignment._on_lost(consumer, partitions)
    assert dropped == ["partitions lost"]
    monkeypatch.setattr(turns, "_committed_answer", _answers_after(turns._committed_answer, first=1))
    assignment._on_assign(consumer, partitions)
    assert last_committed(stream.bootstrap, stream.group, dead_letter)[0].offset == 0   # a transaction on each id
    assert sorted(tp.partition for tp in consumer.assignment()) == list(range(stream.partitions))
    stuck.abort_transaction(10)
    taking.close()
    consumer.close()


def _answers_after(check, first: int):
    """`_committed_answer` as it is for the first `first` calls, then a quick True: the test's stuck offsets belong to
    a producer the heal cannot complete (only a skipped marker of the worker's own ids can be), so the wait after the
    heal would last its whole timeout."""
    calls = []

    def answered(consumer: Consumer, partitions, timeout_s: float) -> bool:
        calls.append(timeout_s)
        return check(consumer, partitions, timeout_s) if len(calls) <= first else True
    return answered


def test_start_aborts_a_transaction_left_open_on_an_id_the_worker_no_longer_uses(stream):
    """A worker ran with two ids and died with a transaction open on the second; it comes back with one
    (--transactional-ids lowered). Its start fences the second id too, so that transaction is aborted at once: what
    it commits next is visible to read_committed readers now, not after the broker's transaction timeout (60 s
    here, while the output partition's stable offset stays before the open transaction)."""
    config = replace(_config(stream), transactional_ids=1)
    assert config.retired_transactional_ids[0] == f"{config.transactional_id}.t1"
    left_open = Producer({**_producer(stream, config.retired_transactional_ids[0]), "transaction.timeout.ms": 60_000})
    left_open.init_transactions(10)
    left_open.begin_transaction()
    for p in range(stream.partitions):
        left_open.produce(stream.topics.probabilities, key=b"open", value=b"never visible", partition=p)
    left_open.flush(10)
    consumer = _group_consumer(stream)
    txns = turns.worker_transactions(config, consumer)
    txns.init()
    txns.commit(_records(stream, 4, "after"), [TopicPartition(stream.topics.states, 0, 1)])
    assert _read_keys(stream) == [f"after-{i}" for i in range(4)]
    txns.close()
    consumer.close()


def test_the_retired_ids_are_those_a_larger_setting_would_add():
    config = WorkerConfig(bootstrap="b", model_dir="m", worker_id="w", group="g", transactional_ids=2)
    assert config.transactional_id_turns == ["decider.g.w", "decider.g.w.t1"]
    assert config.retired_transactional_ids == ["decider.g.w.t2", "decider.g.w.t3"]
    assert replace(config, transactional_ids=4).retired_transactional_ids == []
