"""Which Kafka (and Schema Registry) the test session runs against; the whole suite is written once for all three.

- ``KAFKA_BOOTSTRAP`` set: that external Kafka (``SCHEMA_REGISTRY_URL`` for its registry if set, else the
  registry test double).
- ``DECIDER_TEST_BROKER=kafka``: real Apache Kafka (``apache/kafka``, KRaft, one node: transaction state
  log replication 1, min ISR 1) plus ``confluentinc/cp-schema-registry`` on one Docker network, started with
  testcontainers. No Docker engine answering is a usage error with one line, never a skip: a run that asked
  for real Kafka and silently got less would report a pass it did not earn.
- otherwise: the embedded noida-db broker (``worker.devbroker.embedded_broker``) and the registry test double
  (``tests/registry_double.py``).

conftest calls ``check_selection`` from ``pytest_configure`` (so a bad selection fails before collection) and
``started_broker`` from its session fixture.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping

import pytest

BROKER_ENV, BOOTSTRAP_ENV, REGISTRY_ENV = "DECIDER_TEST_BROKER", "KAFKA_BOOTSTRAP", "SCHEMA_REGISTRY_URL"
CHOICES = ("embedded", "kafka")
KAFKA_IMAGE = "apache/kafka:4.1.0"
REGISTRY_IMAGE = "confluentinc/cp-schema-registry:7.9.0"
STARTUP_TIMEOUT_S = 120


@dataclass(frozen=True)
class TestBroker:
    """What the session's tests talk to. ``registry_url`` is reachable from worker subprocesses too."""

    __test__ = False  # not a test class, despite the name

    kind: str  # "external", "kafka" or "embedded"
    bootstrap: str
    registry_url: str


def selection(environ: Mapping[str, str] = os.environ) -> str:
    """``external``, ``kafka`` or ``embedded``; ``pytest.UsageError`` (one line) for an unknown choice."""
    if environ.get(BOOTSTRAP_ENV):
        return "external"
    choice = environ.get(BROKER_ENV, "embedded").strip().lower() or "embedded"
    if choice not in CHOICES:
        raise pytest.UsageError(f"{BROKER_ENV}={choice!r}: use kafka (testcontainers) or embedded (noida-db), "
                                f"or set {BOOTSTRAP_ENV} for an external Kafka")
    return choice


def group_protocols(environ: Mapping[str, str] = os.environ) -> tuple[str, ...]:
    """The consumer group protocols the selected broker runs: noida-db 0.2.3 has only the classic one (no KIP-848
    ConsumerGroupHeartbeat); the Kafka testcontainers starts has both; an external Kafka says (its ApiVersions)."""
    choice = selection(environ)
    if choice == "embedded":
        return ("classic",)
    if choice == "kafka":
        return ("classic", "consumer")
    from worker.kafka_clients import CONSUMER_GROUP_HEARTBEAT_API, broker_api_keys

    keys = broker_api_keys(environ[BOOTSTRAP_ENV]) or set()
    return ("classic", "consumer") if CONSUMER_GROUP_HEARTBEAT_API in keys else ("classic",)


def docker_engine_problem() -> str | None:
    """Why no Docker engine answers (None if one does)."""
    try:
        import docker
    except ImportError:
        return "the docker package is missing (pip install -e '.[test]')"
    try:
        client = docker.from_env(timeout=5)
        client.ping()
        client.close()
    except Exception as exc:  # noqa: BLE001 - docker raises DockerException, ConnectionError, ... when absent
        return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return None


def check_selection(environ: Mapping[str, str] = os.environ) -> str:
    """The selection, after checking that it can run here; ``pytest.UsageError`` with one line if it cannot."""
    choice = selection(environ)
    if choice == "kafka":
        problem = docker_engine_problem()
        if problem is not None:
            raise pytest.UsageError(f"{BROKER_ENV}=kafka starts Kafka and a Schema Registry with testcontainers, "
                                    f"but no Docker engine answers ({problem}); start Docker, or unset {BROKER_ENV} "
                                    f"for the embedded broker")
    return choice


@contextlib.contextmanager
def started_broker(workdir: Path, environ: Mapping[str, str] = os.environ) -> Iterator[TestBroker]:
    """The selected broker and registry, running for the ``with`` block, stopped after it."""
    choice = check_selection(environ)
    if choice == "kafka":
        with kafka_containers() as broker:
            yield broker
        return
    with contextlib.ExitStack() as stack:
        registry_url = environ.get(REGISTRY_ENV) if choice == "external" else None
        if not registry_url:
            from tests.registry_double import registry_double_process

            registry_url = stack.enter_context(registry_double_process())
        if choice == "external":
            yield TestBroker("external", environ[BOOTSTRAP_ENV], registry_url)
            return
        from worker.devbroker.embedded_broker import EmbeddedBroker, free_port

        log = stack.enter_context(open(workdir / "broker.log", "w"))
        embedded = stack.enter_context(EmbeddedBroker(port=free_port(), data_dir=str(workdir / "data"), log=log))
        yield TestBroker("embedded", embedded.bootstrap, registry_url)


@contextlib.contextmanager
def kafka_containers() -> Iterator[TestBroker]:
    """Apache Kafka (KRaft) and cp-schema-registry on one Docker network (needs a Docker engine).

    testcontainers' ``KafkaContainer`` drives Confluent's cp-kafka start scripts, which the ``apache/kafka``
    image lacks, so the broker is a plain container configured through the image's ``KAFKA_*`` variables.
    Clients on the host reach it on a fixed free port (its advertised address must be known before it
    starts); the registry reaches it on the network alias ``kafka``."""
    from testcontainers.core.container import DockerContainer
    from testcontainers.core.docker_client import DockerClient
    from testcontainers.core.network import Network
    from testcontainers.core.wait_strategies import LogMessageWaitStrategy

    from worker.devbroker.embedded_broker import free_port

    host, port = DockerClient().host(), free_port()
    with Network() as network:
        kafka = (
            DockerContainer(KAFKA_IMAGE)
            .with_network(network).with_network_aliases("kafka")
            .with_bind_ports(9092, port)
            .with_envs(**kafka_environment(host, port))
            .waiting_for(LogMessageWaitStrategy("Kafka Server started").with_startup_timeout(STARTUP_TIMEOUT_S))
        )
        registry = (
            DockerContainer(REGISTRY_IMAGE)
            .with_network(network).with_network_aliases("schema-registry")
            .with_exposed_ports(8081)
            .with_envs(SCHEMA_REGISTRY_HOST_NAME="schema-registry", SCHEMA_REGISTRY_LISTENERS="http://0.0.0.0:8081",
                       SCHEMA_REGISTRY_KAFKASTORE_BOOTSTRAP_SERVERS="PLAINTEXT://kafka:19092")
            .waiting_for(LogMessageWaitStrategy("Server started, listening for requests").with_startup_timeout(STARTUP_TIMEOUT_S))
        )
        with kafka, registry:
            url = f"http://{registry.get_container_host_ip()}:{registry.get_exposed_port(8081)}"
            yield TestBroker("kafka", f"{host}:{port}", url)


def kafka_environment(host: str, port: int) -> dict[str, str]:
    """The ``apache/kafka`` settings of a one-node KRaft cluster that runs transactions."""
    return {
        "KAFKA_NODE_ID": "1",
        "KAFKA_PROCESS_ROLES": "broker,controller",
        "KAFKA_CONTROLLER_QUORUM_VOTERS": "1@localhost:9093",
        "KAFKA_CONTROLLER_LISTENER_NAMES": "CONTROLLER",
        # PLAINTEXT for clients on the host, INTERNAL for the registry container.
        "KAFKA_LISTENERS": "PLAINTEXT://:9092,INTERNAL://:19092,CONTROLLER://:9093",
        "KAFKA_ADVERTISED_LISTENERS": f"PLAINTEXT://{host}:{port},INTERNAL://kafka:19092",
        "KAFKA_LISTENER_SECURITY_PROTOCOL_MAP": "PLAINTEXT:PLAINTEXT,INTERNAL:PLAINTEXT,CONTROLLER:PLAINTEXT",
        "KAFKA_INTER_BROKER_LISTENER_NAME": "INTERNAL",
        # One node: the internal topics cannot be replicated, and transactions need their state log.
        "KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR": "1",
        "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR": "1",
        "KAFKA_TRANSACTION_STATE_LOG_MIN_ISR": "1",
        "KAFKA_GROUP_INITIAL_REBALANCE_DELAY_MS": "0",
        # KIP-848's consumer protocol: the broker owns the session timeout (45 s by default, and no less). The tests
        # move a killed worker's partitions after 6 s, as their --session-timeout-ms does on the classic protocol.
        "KAFKA_GROUP_CONSUMER_MIN_SESSION_TIMEOUT_MS": "6000",
        "KAFKA_GROUP_CONSUMER_SESSION_TIMEOUT_MS": "6000",
        "KAFKA_GROUP_CONSUMER_MIN_HEARTBEAT_INTERVAL_MS": "1000",
        "KAFKA_GROUP_CONSUMER_HEARTBEAT_INTERVAL_MS": "1000",
        "KAFKA_AUTO_CREATE_TOPICS_ENABLE": "false",
    }
