"""Broker selection: the environment picks an external Kafka, the pinned Apache Kafka or the embedded broker;
``auto`` falls back to the embedded broker only off CI, and says so; asking for Apache Kafka where it cannot
start is a one-line usage error, never a skip."""

from __future__ import annotations

import pytest
from confluent_kafka.schema_registry import SchemaRegistryClient

from tests import brokers


@pytest.fixture
def kafka_can_start(monkeypatch):
    def set_problem(problem: str | None) -> None:
        monkeypatch.setattr(brokers, "kafka_problem", lambda: problem)
    return set_problem


@pytest.mark.parametrize("environ, problem, choice", [
    ({}, None, "kafka"),
    ({}, "no java on PATH", "embedded"),
    ({"CI": "true"}, "no java on PATH", "kafka"),  # ... and check_selection fails: never a silent fallback in CI
    ({"DECIDER_TEST_BROKER": "embedded"}, None, "embedded"),
    ({"DECIDER_TEST_BROKER": "Kafka"}, "no java on PATH", "kafka"),
    ({"DECIDER_TEST_BROKER": "auto"}, None, "kafka"),
    ({"KAFKA_BOOTSTRAP": "k:9092", "DECIDER_TEST_BROKER": "kafka"}, None, "external"),
])
def test_selection(environ, problem, choice, kafka_can_start):
    kafka_can_start(problem)
    assert brokers.selection(environ) == choice


def test_unknown_selection_is_a_usage_error():
    with pytest.raises(pytest.UsageError, match="use kafka .* embedded .* or auto"):
        brokers.selection({"DECIDER_TEST_BROKER": "redpanda"})


@pytest.mark.parametrize("environ, starts", [({"CI": "true"}, "CI runs every broker test on Apache Kafka"),
                                              ({"DECIDER_TEST_BROKER": "kafka"}, "DECIDER_TEST_BROKER=kafka")])
def test_kafka_that_cannot_start_fails_with_one_line(environ, starts, kafka_can_start):
    kafka_can_start("no java on PATH (Apache Kafka needs Java 17 or newer)")
    with pytest.raises(pytest.UsageError) as caught:
        brokers.check_selection(environ)
    message = str(caught.value)
    assert message.startswith(starts) and "no java on PATH" in message and "\n" not in message
    kafka_can_start(None)
    assert brokers.check_selection(environ) == "kafka"


def test_the_fallback_is_said_in_the_header(kafka_can_start):
    kafka_can_start("no java on PATH")
    assert "the embedded noida-db broker, not Apache Kafka (no java on PATH)" in brokers.fallback_notice({})
    assert brokers.fallback_notice({"DECIDER_TEST_BROKER": "embedded"}) is None  # asked for: nothing to say
    kafka_can_start(None)
    assert brokers.fallback_notice({}) is None


def test_external_kafka_gets_the_registry_double_unless_told(tmp_path):
    with brokers.started_broker(tmp_path, {"KAFKA_BOOTSTRAP": "k:9092"}) as broker:
        assert (broker.kind, broker.bootstrap) == ("external", "k:9092")
        assert SchemaRegistryClient({"url": broker.registry_url}).get_subjects() == []
    with brokers.started_broker(tmp_path, {"KAFKA_BOOTSTRAP": "k:9092", "SCHEMA_REGISTRY_URL": "http://sr:8081"}) as broker:
        assert broker.registry_url == "http://sr:8081"


def test_session_fixtures(kafka_bootstrap, schema_registry_url, test_broker):
    from confluent_kafka.admin import AdminClient

    assert test_broker.kind == brokers.selection()
    assert test_broker.registry == brokers.registry_choice(test_broker.kind)
    assert AdminClient({"bootstrap.servers": kafka_bootstrap}).list_topics(timeout=10).brokers
    assert SchemaRegistryClient({"url": schema_registry_url}).get_subjects() is not None


def test_the_registry_beside_apache_kafka_is_apicurio_and_ci_requires_it(monkeypatch):
    import tests.registry_apicurio as apicurio

    monkeypatch.setattr(apicurio, "problem", lambda: "no Java 21+ for Apicurio Registry")
    assert brokers.registry_choice("kafka", {}) == "test double"
    with pytest.raises(pytest.UsageError, match="^CI runs the registry tests on Apicurio Registry, .*no Java 21"):
        brokers.registry_choice("kafka", {"CI": "true"})
    assert brokers.registry_choice("embedded", {"CI": "true"}) == "test double"
    assert brokers.registry_choice("kafka", {"SCHEMA_REGISTRY_URL": "http://sr:8081"}) == "external"
    monkeypatch.setattr(apicurio, "problem", lambda: None)
    assert brokers.registry_choice("kafka", {"CI": "true"}) == "apicurio"
