"""Broker selection: the environment picks external Kafka, testcontainers or the embedded broker, and asking for
testcontainers without a Docker engine is a one-line usage error, never a skip."""

from __future__ import annotations

import pytest
from confluent_kafka.schema_registry import SchemaRegistryClient

from tests import brokers


@pytest.mark.parametrize("environ, choice", [
    ({}, "embedded"),
    ({"DECIDER_TEST_BROKER": "embedded"}, "embedded"),
    ({"DECIDER_TEST_BROKER": "Kafka"}, "kafka"),
    ({"KAFKA_BOOTSTRAP": "k:9092", "DECIDER_TEST_BROKER": "kafka"}, "external"),
])
def test_selection(environ, choice):
    assert brokers.selection(environ) == choice


def test_unknown_selection_is_a_usage_error():
    with pytest.raises(pytest.UsageError, match="use kafka .* or embedded"):
        brokers.selection({"DECIDER_TEST_BROKER": "redpanda"})


def test_kafka_without_docker_fails_with_one_line(monkeypatch):
    monkeypatch.setattr(brokers, "docker_engine_problem", lambda: "Connection refused")
    with pytest.raises(pytest.UsageError) as caught:
        brokers.check_selection({"DECIDER_TEST_BROKER": "kafka"})
    assert "no Docker engine answers (Connection refused)" in str(caught.value) and "\n" not in str(caught.value)
    monkeypatch.setattr(brokers, "docker_engine_problem", lambda: None)
    assert brokers.check_selection({"DECIDER_TEST_BROKER": "kafka"}) == "kafka"


def test_kafka_container_settings_run_transactions_on_one_node():
    env = brokers.kafka_environment("docker-host", 40123)
    assert env["KAFKA_PROCESS_ROLES"] == "broker,controller"
    assert env["KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR"] == "1"
    assert env["KAFKA_TRANSACTION_STATE_LOG_MIN_ISR"] == "1"
    assert env["KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR"] == "1"
    assert "PLAINTEXT://docker-host:40123" in env["KAFKA_ADVERTISED_LISTENERS"]
    assert "INTERNAL://kafka:19092" in env["KAFKA_ADVERTISED_LISTENERS"]  # what the registry container uses
    assert brokers.KAFKA_IMAGE.startswith("apache/kafka:") and brokers.REGISTRY_IMAGE.startswith("confluentinc/cp-schema-registry:")


def test_external_kafka_gets_the_registry_double_unless_told(tmp_path):
    with brokers.started_broker(tmp_path, {"KAFKA_BOOTSTRAP": "k:9092"}) as broker:
        assert (broker.kind, broker.bootstrap) == ("external", "k:9092")
        assert SchemaRegistryClient({"url": broker.registry_url}).get_subjects() == []
    with brokers.started_broker(tmp_path, {"KAFKA_BOOTSTRAP": "k:9092", "SCHEMA_REGISTRY_URL": "http://sr:8081"}) as broker:
        assert broker.registry_url == "http://sr:8081"


def test_session_fixtures(kafka_bootstrap, schema_registry_url, test_broker):
    from confluent_kafka.admin import AdminClient

    assert AdminClient({"bootstrap.servers": kafka_bootstrap}).list_topics(timeout=10).brokers
    assert SchemaRegistryClient({"url": schema_registry_url}).get_subjects() is not None
