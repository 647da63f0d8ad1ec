"""The states consumer's group settings per protocol, and what the broker says it offers (its ApiVersions answer, read
from librdkafka's own connection)."""

from __future__ import annotations

from confluent_kafka import Consumer

from tests import brokers
from worker.config import WorkerConfig
from worker.kafka_clients import (CONSUMER_GROUP_HEARTBEAT_API, broker_api_keys, incremental_rebalancing,
                                  worker_consumer_config)

JOIN_GROUP, HEARTBEAT, SYNC_GROUP, TXN_OFFSET_COMMIT = 11, 12, 14, 28


def _config(**fields) -> WorkerConfig:
    return WorkerConfig(bootstrap="127.0.0.1:1", model_dir="m", worker_id="w", **fields)


def _accepted_by_librdkafka(settings: dict) -> None:
    Consumer({**settings, "log_level": 0}).close()  # construction checks every setting; nothing connects


def test_the_classic_protocol_rebalances_cooperatively_unless_the_kafka_table_names_an_eager_assignor():
    settings = worker_consumer_config(_config(), "classic")
    assert settings["partition.assignment.strategy"] == "cooperative-sticky" and settings["group.protocol"] == "classic"
    assert settings["session.timeout.ms"] == 10_000 and settings["heartbeat.interval.ms"] == 2_000
    assert incremental_rebalancing(settings) and settings["group.instance.id"] == "w"  # static membership
    _accepted_by_librdkafka(settings)
    eager = worker_consumer_config(_config(session_timeout_ms=6000, kafka={"partition.assignment.strategy": "range"}))
    assert eager["partition.assignment.strategy"] == "range" and eager["session.timeout.ms"] == 6000
    assert not incremental_rebalancing(eager)
    _accepted_by_librdkafka(eager)


def test_the_consumer_protocol_leaves_assignment_and_the_session_to_the_broker():
    settings = worker_consumer_config(_config(kafka={"group.remote.assignor": "uniform"}), "consumer")
    assert settings["group.protocol"] == "consumer" and settings["group.remote.assignor"] == "uniform"
    assert not {"partition.assignment.strategy", "session.timeout.ms", "heartbeat.interval.ms"} & settings.keys()
    # no static membership: Kafka refuses a second member of one static id while the first heartbeats
    assert "group.instance.id" not in settings
    assert incremental_rebalancing(settings)
    _accepted_by_librdkafka(settings)


def test_the_broker_lists_its_apis_and_whether_it_has_kip_848(kafka_bootstrap):
    keys = broker_api_keys(kafka_bootstrap)
    assert keys is not None and {JOIN_GROUP, HEARTBEAT, SYNC_GROUP, TXN_OFFSET_COMMIT} <= keys
    if brokers.selection() == "embedded":   # noida-db 0.2.3 has the classic protocol only
        assert CONSUMER_GROUP_HEARTBEAT_API not in keys
    elif brokers.selection() == "kafka":    # Apache Kafka 4.4 has both
        assert CONSUMER_GROUP_HEARTBEAT_API in keys


def test_no_answer_is_no_list():
    assert broker_api_keys("127.0.0.1:1", timeout_s=1.0) is None
