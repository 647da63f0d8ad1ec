"""Which group protocol a worker joins with: the one asked for, else the best one the broker offers, unless a setting
only the classic protocol has was given; asking for one the broker lacks is a user error, not a silent hang."""

from __future__ import annotations

import pytest

from worker.config import WorkerConfig
from worker.exceptions import ConfigError
from worker.kafka_clients import CONSUMER_GROUP_HEARTBEAT_API
from worker.stream.assignment import choose_group_protocol

CLASSIC_BROKER = {11, 12, 14, 28}
KIP_848_BROKER = CLASSIC_BROKER | {CONSUMER_GROUP_HEARTBEAT_API}


def _config(**fields) -> WorkerConfig:
    return WorkerConfig(bootstrap="kafka:9092", model_dir="m", worker_id="w", **fields)


@pytest.mark.parametrize("fields, api_keys, protocol", [
    ({}, KIP_848_BROKER, "consumer"),
    ({}, CLASSIC_BROKER, "classic"),
    ({}, None, "classic"),                                                   # the broker's list could not be read
    ({"group_protocol": "classic"}, KIP_848_BROKER, "classic"),
    ({"group_protocol": "consumer"}, None, "consumer"),                      # asked for: librdkafka will tell
    ({"kafka": {"group.protocol": "consumer"}}, KIP_848_BROKER, "consumer"),
    ({"session_timeout_ms": 6000}, KIP_848_BROKER, "classic"),               # settings only classic has
    ({"kafka": {"partition.assignment.strategy": "range"}}, KIP_848_BROKER, "classic"),
])
def test_the_protocol_asked_for_else_the_brokers_best(fields, api_keys, protocol):
    chosen, why = choose_group_protocol(_config(**fields), api_keys)
    assert chosen == protocol and why


def test_asking_for_the_consumer_protocol_on_a_broker_without_it_is_a_user_error():
    with pytest.raises(ConfigError, match="does not offer KIP-848's consumer group protocol"):
        choose_group_protocol(_config(group_protocol="consumer"), CLASSIC_BROKER)


def _timed_revoke(assignment, leaving: bool = False) -> float:
    """Seconds ``assignment``'s revoke callback took, on a consumer that never connects (it unassigns all the same)."""
    import time

    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": "127.0.0.1:1", "group.id": "revoke", "log_level": 0})
    partitions = [TopicPartition("states", 0)]
    try:
        consumer.incremental_assign(partitions) if assignment.incremental else consumer.assign(partitions)
        assignment._leaving = leaving
        started = time.monotonic()
        assignment._on_revoke(consumer, partitions)
        return time.monotonic() - started
    finally:
        consumer.close()


@pytest.mark.parametrize("pause_s, leaving, pauses", [
    (0.05, False, True),    # the embedded broker, cooperative: the worker rejoins when the callback returns
    (0.05, True, False),    # leaving the group: no rejoin follows
    (0.0, False, False),    # Apache Kafka: no pause
])
def test_a_revoke_waits_before_the_rejoin_only_where_a_pause_is_set(pause_s, leaving, pauses):
    from worker.stream.assignment import GroupAssignment

    assignment = GroupAssignment(_config())
    assignment.protocol, assignment.incremental, assignment.rejoin_pause_s = "classic", True, pause_s
    dropped = []
    assignment._drop_uncommitted = lambda why, partitions: dropped.append(partitions)
    took = _timed_revoke(assignment, leaving)
    assert (took >= 0.05) == pauses, took
    assert [[tp.partition for tp in p] for p in dropped] == [[0]]  # incremental: only the revoked partitions' work


@pytest.mark.parametrize("strategy, incremental", [("cooperative-sticky", True), ("range", False)])
def test_an_eager_revoke_drops_all_uncommitted_work(strategy, incremental):
    from worker.stream.assignment import GroupAssignment

    assignment = GroupAssignment(_config())
    assignment.protocol, assignment.incremental = "classic", incremental
    dropped = []
    assignment._drop_uncommitted = lambda why, partitions: dropped.append(partitions)
    _timed_revoke(assignment)
    assert [None if p is None else [tp.partition for tp in p] for p in dropped] == [[0] if incremental else None]


def test_only_the_embedded_broker_gets_the_rejoin_pause(kafka_bootstrap, test_broker):
    """Asked of the session's real broker: noida-db is told by its cluster id, Apache Kafka gets no pause."""
    from worker.stream.assignment import EMBEDDED_BROKER_REJOIN_PAUSE_S, GroupAssignment

    assignment = GroupAssignment(WorkerConfig(bootstrap=kafka_bootstrap, model_dir="m", worker_id="w",
                                              group_protocol="classic"))
    assignment.consumer().close()
    assert assignment.incremental
    expected = EMBEDDED_BROKER_REJOIN_PAUSE_S if test_broker.kind == "embedded" else 0.0
    assert assignment.rejoin_pause_s == expected


# ---- partitions lost (a session that expired), through the worker's own wiring ------------------------------------
class _Scorer:
    """Takes the cycles' batches (their scores never come) and counts the pins given back."""

    def __init__(self):
        self.released = []

    def submit(self, jobs, on_launched):
        from concurrent.futures import Future

        return Future()

    def release_pin(self, key):
        self.released.append(key)


def _stats(topic: str, partitions: dict[int, tuple[int, int]]) -> str:
    """librdkafka statistics with each partition's last stable offset and committed offset (``liveness.PARTITION_ENDS``)."""
    import json

    return json.dumps({"topics": {topic: {"partitions": {
        str(p): {"fetch_state": "active", "ls_offset": end, "committed_offset": committed}
        for p, (end, committed) in partitions.items()}}}})


@pytest.fixture
def lost_worker():
    """A worker (``loop.Worker``: its assignment, drop path and progress watch as ``run`` wires them; a committer with
    no transaction running) that was assigned partitions 0 and 1 of ``states``, consumed states of both (an open
    cycle and two cycles being scored) while records wait in both, then lost both. -> (worker, pins taken)."""
    import time

    from confluent_kafka import Consumer, TopicPartition

    from tests.worker.stream.test_revocation import _cycle
    from worker.config import Topics
    from worker.ops import liveness
    from worker.stream import loop
    from worker.stream.committer import Committer

    worker = loop.Worker(_config(topics=Topics(states="states"), stall_after_s=60))
    worker._scorer, worker._committer = _Scorer(), Committer(None, worker._inflight.wake)
    consumer = Consumer({"bootstrap.servers": "127.0.0.1:1", "group.id": "lost", "log_level": 0})
    assignment, partitions = worker._assignment, [TopicPartition("states", 0), TopicPartition("states", 1)]
    assignment.protocol, assignment.incremental = "classic", True
    try:
        assignment.start(consumer, None, worker._drop_uncommitted)
        assignment._on_assign(consumer, partitions)
        liveness.PARTITION_ENDS.on_stats(_stats("states", {0: (50, 20), 1: (40, 10)}))
        for cycle in (_cycle((0, 20), (1, 10)), _cycle((1, 11))):
            worker._inflight.submit(cycle, 0.0, worker._closing.budget, worker._scorer)
        worker._cycle = _cycle((0, 21), (1, 12))
        taken = sorted(key for c in [worker._cycle, *(f.cycle for f in worker._inflight)] for key in c.pins())
        # held still, both would be stalled partitions long after --stall-after-s
        assert len(worker._watch.check(time.monotonic() + 600)) == 2 and liveness.PROGRESS.readiness_problem()
        assignment._on_lost(consumer, partitions)
        yield worker, taken
    finally:
        worker._committer.close()
        consumer.close()
        liveness.PARTITION_ENDS.on_stats("{}")
        liveness.PROGRESS.report(None)


def test_partitions_lost_leave_nothing_of_theirs_to_commit_and_give_their_pins_back(lost_worker):
    """Another worker may already own them: whatever this one had of them uncommitted is dropped, never committed."""
    worker, taken = lost_worker
    assert not len(worker._cycle) and not worker._inflight and worker._cycle.offsets() == []
    assert sorted(worker._scorer.released) == taken


def test_partitions_lost_are_no_longer_watched_for_stalls(lost_worker):
    """Records still wait in both partitions, uncommitted, long past --stall-after-s: not this worker's stall any more,
    so /readyz is ready again."""
    import time

    from worker.ops import liveness

    worker, _ = lost_worker
    assert worker._watch.check(time.monotonic() + 600) == []
    assert liveness.PROGRESS.readiness_problem() is None


@pytest.mark.parametrize("lost_s_ago, raised", [(None, "FencedError"), (5.0, "BrokerOutageError"), (600.0, "FencedError")])
def test_a_static_members_fencing_right_after_its_session_expired_is_an_outage_not_a_twin(lost_s_ago, raised):
    """librdkafka's classic protocol fences a static member that rejoined after its session expired (a broker outage
    or overload longer than the session): a restart recovers, so exit 5; otherwise another worker has its id: exit 3."""
    import time

    from confluent_kafka import KafkaError

    from worker.stream.assignment import check_consumer_error

    error = KafkaError(KafkaError.FENCED_INSTANCE_ID, "Fatal consumer error: Broker: Static consumer fenced by other "
                       "consumer with same group.instance.id", fatal=True)
    lost_at = None if lost_s_ago is None else time.monotonic() - lost_s_ago
    with pytest.raises(Exception) as caught:
        check_consumer_error(error, _config(), lost_at)
    assert type(caught.value).__name__ == raised
    assert caught.value.exit_code == (5 if raised == "BrokerOutageError" else 3)


def test_a_heal_the_broker_refuses_after_a_loss_still_assigns_the_partitions(monkeypatch, caplog):
    """Partitions come back after a loss, and the broker, just back, refuses the check of their offsets: the worker
    assigns them anyway (the consumer's own fetch of the offsets retries, as it would without the check), says so, and
    checks only once after a loss."""
    from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

    from worker.config import Topics
    from worker.stream import assignment as assignment_module

    checked: list = []

    def refused(config, consumer, txns, partitions=None):
        checked.append(partitions)
        if partitions is not None:
            raise KafkaException(KafkaError(KafkaError.COORDINATOR_NOT_AVAILABLE))
        return False
    monkeypatch.setattr(assignment_module, "complete_hanging_offsets", refused)
    assignment = assignment_module.GroupAssignment(_config(topics=Topics(states="states")))
    consumer = Consumer({"bootstrap.servers": "127.0.0.1:1", "group.id": "heal", "log_level": 0})
    partitions = [TopicPartition("states", 0), TopicPartition("states", 1)]
    try:
        assignment.start(consumer, object(), lambda why, lost: None)   # any transactions: the check is replaced
        assignment._on_lost(consumer, partitions)
        with caplog.at_level("WARNING", logger="worker.stream.assignment"):
            assignment._on_assign(consumer, partitions)
        assignment._on_assign(consumer, partitions)
        assert sorted(tp.partition for tp in consumer.assignment()) == [0, 1]
    finally:
        consumer.close()
    assert checked == [None, partitions]      # at start, then once after the loss
    assert "could not check the committed offsets of partitions [0, 1] after their loss" in caplog.text
