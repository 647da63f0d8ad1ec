"""Two workers in one consumer group on a topic with several partitions: every state is scored exactly
once while one worker stops mid-stream and the other takes over its partitions, and a worker joining takes only the
partitions that move (incremental rebalancing), while the worker that keeps the others goes on scoring them."""

from __future__ import annotations

import threading
import time
from collections import Counter

from confluent_kafka import Consumer, TopicPartition

import pytest

from bench.stream_windows import held_partitions
from tests import brokers
from tests.worker.conftest import QUESTIONS, encode_state, feed_states, state_texts
from worker.config import Topics, WorkerConfig
from worker.ops.logs import HumanFormatter, log_event
from worker.stream.assignment import GroupAssignment


def test_rebalance_lines_name_the_topic_and_the_group(caplog):
    """A second worker started without --group joins the first one's group: the lines say which group and topic."""
    config = WorkerConfig(bootstrap="k:9092", model_dir="m", worker_id="gpu1", topics=Topics(states="tickets"))
    assignment = GroupAssignment(config, on_event=log_event)
    partitions = [TopicPartition("tickets", 0), TopicPartition("tickets", 2)]
    # a consumer that never connects: the callbacks (un)assign on it as librdkafka's rebalance would
    consumer = Consumer({"bootstrap.servers": "127.0.0.1:1", "group.id": "lines", "log_level": 0})
    try:
        with caplog.at_level("INFO", logger="decider.events"):
            assignment._on_assign(consumer, partitions)
            assignment._on_revoke(consumer, partitions)
            assignment._on_lost(consumer, partitions)
    finally:
        consumer.close()
    lines = [HumanFormatter().format(record) for record in caplog.records]
    assert len(lines) == 3, lines
    for line, kind in zip(lines, ("assigned", "revoked", "lost")):
        assert f": {kind} topic=tickets group=decider worker_id=gpu1 partitions=[0, 2]" in line, line


def test_one_worker_stops_mid_stream_and_the_other_takes_its_partitions(stream_factory, model_dir):
    stream = stream_factory(partitions=4)
    stream.put_schema("tickets", QUESTIONS)
    first = stream.start_worker(model_dir, "member-a")
    # One join at a time: noida-db 0.2.3 has been seen to stall two static members joining in the same instant.
    first.wait_for_log("assigned", timeout_s=90)
    second = stream.start_worker(model_dir, "member-b")
    second.wait_for_log("assigned", timeout_s=90)

    n = 240
    inputs = [(f"g-{i}", encode_state(f"g-{i}", "tickets", text)) for i, text in enumerate(state_texts(n, seed=7))]
    first_half, second_half = inputs[:n // 2], inputs[n // 2:]
    feed_states(stream, first_half, threading.Event(), chunk=50, pause_s=0)
    _wait_for_outputs(stream, 40)
    # Mid-stream: the second half keeps arriving while the first worker stops.
    fed = threading.Event()
    feeder = threading.Thread(target=feed_states, args=(stream, second_half, fed), kwargs={"pause_s": 0.05}, daemon=True)
    feeder.start()
    assert first.stop() == 0, first.log()
    feeder.join(120)
    assert fed.is_set()

    probabilities, dead = stream.collect(n, timeout_s=120, settle_s=2.0)
    assert dead == []
    counts = Counter(r["state_id"] for r in probabilities)
    assert not {k: v for k, v in counts.items() if v > 1}, "a state was scored twice"
    assert set(counts) == {state_id for state_id, _ in inputs}
    by_worker = Counter(r["worker_id"] for r in probabilities)
    assert by_worker["member-a"] > 0 and by_worker["member-b"] > 0, by_worker
    # incremental rebalancing: the second worker got its share, then the first one's, and never gave anything up
    assert "revoked" not in second.log() and second.log().count("assigned") >= 2, second.log()
    revoked = next(line for line in first.log().splitlines() if " revoked " in line)
    assert f"topic={stream.topics.states}" in revoked and f"group={stream.group}" in revoked, revoked
    assert stream.committed_offsets() == stream.end_offsets()
    assert second.stop() == 0, second.log()


def test_a_rebalance_among_transactions_on_the_committers_thread_scores_each_state_once(stream_factory, model_dir):
    """Scored cycles commit on the committer's thread while the loop consumes. A second worker joining revokes the
    first one's partitions, often while a transaction runs there and cycles wait for the next (the loop lets the one
    running end and drops the others: checked in tests/worker/stream/test_loop_steps.py, without the timing): every
    state is scored exactly once."""
    stream = stream_factory(partitions=4)
    stream.put_schema("tickets", QUESTIONS)
    # each batch's scores half a second after its launch, and states arriving faster than that drains them: until the
    # revoke the first worker is mostly waiting on a cycle, with its transaction open once the batch is launched
    first = stream.start_worker(model_dir, "late-a", scores_late_s=0.5)
    first.wait_for_log("assigned", timeout_s=90)
    texts = iter(state_texts(2000, seed=11))
    inputs: list[tuple[str, bytes]] = []

    def feed(count: int) -> None:
        chunk = [(f"r-{len(inputs) + i}", next(texts)) for i in range(count)]
        chunk = [(state_id, encode_state(state_id, "tickets", text)) for state_id, text in chunk]
        inputs.extend(chunk)
        feed_states(stream, chunk, threading.Event(), chunk=count, pause_s=0.2)

    while len(inputs) < 40:
        feed(4)
    second = stream.start_worker(model_dir, "late-b", scores_late_s=0.5)
    deadline = time.monotonic() + 90
    while "assigned" not in second.log() and time.monotonic() < deadline:
        feed(4)
    assert "assigned" in second.log(), second.log()
    for _ in range(5):
        feed(4)

    probabilities, dead = stream.collect(len(inputs), timeout_s=120, settle_s=2.0)
    assert dead == []
    counts = Counter(r["state_id"] for r in probabilities)
    assert not {k: v for k, v in counts.items() if v > 1}, "a state was scored twice"
    assert set(counts) == {state_id for state_id, _ in inputs}
    assert "cycles_in_transaction=" in first.log(), first.log()
    assert stream.committed_offsets() == stream.end_offsets()
    assert first.stop() == 0, first.log()
    assert second.stop() == 0, second.log()


def _wait_for_outputs(stream, at_least: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        probabilities, dead = stream.collect(at_least, timeout_s=1.0, settle_s=0)
        if len(probabilities) + len(dead) >= at_least:
            return
    raise AssertionError(f"fewer than {at_least} outputs after {timeout_s} s")


@pytest.mark.parametrize("protocol", brokers.group_protocols())
def test_a_joining_worker_takes_only_the_partitions_that_move(stream_factory, model_dir, protocol):
    """The first worker gives up only the partitions the second one takes, keeps the others without a revoke or a new
    assignment, and commits states of them after the second one joined; every state once. (Eager rebalancing, which
    revokes everything, is measured against it in tests/bench/test_scale_out.py.)"""
    stream = stream_factory(partitions=4)
    stream.put_schema("tickets", QUESTIONS)
    flags = ["--group-protocol", protocol, "--log-format", "json"]
    first = stream.start_worker(model_dir, "join-a", *flags)
    _wait_for_holdings(stream, {first: 4})
    inputs, stop_feeding = [], threading.Event()
    feeder = threading.Thread(target=_feed_until, args=(stream, inputs, stop_feeding), daemon=True)
    feeder.start()
    _wait_for_outputs(stream, 20)
    second = stream.start_worker(model_dir, "join-b", *flags)
    _wait_for_holdings(stream, {first: 1, second: 1})
    joined_at = max(e["t"] for e in second.events() if e["event"] == "assigned" and e["partitions"])
    time.sleep(2.0)  # load on both after the rebalance
    stop_feeding.set()
    feeder.join(30)

    probabilities, dead = stream.collect(len(inputs), timeout_s=120, settle_s=2.0)
    assert dead == [] and sorted(r["state_id"] for r in probabilities) == sorted(state_id for state_id, _ in inputs)
    assert stream.committed_offsets() == stream.end_offsets()
    events = first.events()
    chosen = next(e for e in events if e["event"] == "group_protocol")
    assert (chosen["protocol"], chosen["rebalancing"]) == (protocol, "incremental"), chosen
    revoked = {p for e in events if e["event"] == "revoked" for p in e["partitions"]}
    kept, taken = held_partitions(events), held_partitions(second.events())
    assigned = [e for e in events if e["event"] == "assigned" and e["partitions"]]
    assert revoked == taken and kept == {0, 1, 2, 3} - taken and len(assigned) == 1, events
    after_join = {p for e in events if e["event"] == "committed" and e["t"] > joined_at for p, _ in e["offsets"]}
    assert after_join & kept, "the first worker committed nothing of the partitions it kept after the join"
    assert first.stop() == 0 and second.stop() == 0


def _feed_until(stream, inputs: list, stop: threading.Event) -> None:
    """Publish a few states every 50 ms until ``stop`` is set; ``inputs`` collects (state id, value)."""
    texts = iter(state_texts(100_000, seed=21))
    while not stop.is_set():
        chunk = [(f"j-{len(inputs) + i}", next(texts)) for i in range(4)]
        chunk = [(state_id, encode_state(state_id, "tickets", text)) for state_id, text in chunk]
        feed_states(stream, chunk, threading.Event(), chunk=4, pause_s=0.05)
        inputs.extend(chunk)


def _wait_for_holdings(stream, at_least: dict, timeout_s: float = 120.0) -> None:
    """Wait until each worker in ``at_least`` holds that many partitions, and between them every partition, once."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        held = {worker: held_partitions(worker.events()) for worker in at_least}
        union = set().union(*held.values())
        if (all(len(held[w]) >= n for w, n in at_least.items()) and len(union) == stream.partitions
                and sum(map(len, held.values())) == stream.partitions):
            return
        assert all(w.process.poll() is None for w in at_least), [w.log()[-3000:] for w in at_least]
        time.sleep(0.2)
    raise AssertionError(f"partitions not settled in {timeout_s} s: {held}")
