"""Session fixtures shared by every test package: the Kafka broker and the Schema Registry.

``tests.brokers`` picks them: ``KAFKA_BOOTSTRAP`` (an external Kafka), the pinned Apache Kafka 4.4 where Java and
its jars are here (always under CI, where it not starting fails the run at once with one line), else the embedded
noida-db broker, said in pytest's header; the registry test double unless ``SCHEMA_REGISTRY_URL`` names one. Tests
that need the broker isolate themselves with unique topic and group names, so they can share it.
"""

from __future__ import annotations

import uuid

import pytest

from tests import brokers


def pytest_configure(config: pytest.Config) -> None:
    brokers.check_selection()


def pytest_report_header(config: pytest.Config) -> list[str]:
    notice = brokers.fallback_notice()
    if notice is not None:
        return [notice]
    if brokers.selection() == "kafka":
        from worker.devbroker.apache_kafka import KAFKA_VERSION, kafka_home

        return [f"broker: Apache Kafka {KAFKA_VERSION} (KRaft, one node; jars in {kafka_home()}); "
                f"registry: {brokers.registry_choice('kafka')}"]
    return [f"broker: {brokers.selection()}"]


@pytest.fixture(scope="session")
def test_broker(tmp_path_factory) -> brokers.TestBroker:
    """The session's broker and registry (started on first use, stopped at the end of the session)."""
    with brokers.started_broker(tmp_path_factory.mktemp("broker")) as broker:
        yield broker


@pytest.fixture(scope="session")
def kafka_bootstrap(test_broker) -> str:
    """Bootstrap servers of a running broker for this test session."""
    return test_broker.bootstrap


@pytest.fixture(scope="session")
def schema_registry_url(test_broker) -> str:
    """URL of a Schema Registry that worker subprocesses can reach (the container, or the test double)."""
    return test_broker.registry_url


@pytest.fixture
def mock_registry_url() -> str:
    """A fresh ``mock://`` URL: confluent-kafka's in-process registry, for tests that run in one process
    (each client built from it has its own store, so share one client between writer and reader)."""
    return f"mock://{uuid.uuid4().hex}"
