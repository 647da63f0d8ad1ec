"""Session fixtures shared by every test package: the Kafka broker and the Schema Registry.

``tests.brokers`` picks them: ``KAFKA_BOOTSTRAP`` (an external Kafka), ``DECIDER_TEST_BROKER=kafka`` (Apache
Kafka and a Schema Registry in Docker, via testcontainers; no Docker engine fails the run at once with one
line), else the embedded noida-db broker with the registry test double. Tests that need the broker isolate
themselves with unique topic and group names, so they can share it.
"""

from __future__ import annotations

import uuid

import pytest

from tests import brokers


def pytest_configure(config: pytest.Config) -> None:
    brokers.check_selection()


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
