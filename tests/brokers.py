"""Which Kafka (and Schema Registry) the test session runs against; the whole suite is written once for all three.

- ``KAFKA_BOOTSTRAP`` set: that external Kafka (``SCHEMA_REGISTRY_URL`` for its registry if set, else the
  registry test double).
- ``DECIDER_TEST_BROKER=kafka``: the pinned Apache Kafka 4.4 (``worker.devbroker.apache_kafka``: KRaft, one node,
  started from the jars ``dev/setup.sh`` fetched). It not starting is a usage error with one line, never a skip: a
  run that asked for real Kafka and silently got less would report a pass it did not earn.
- ``DECIDER_TEST_BROKER=embedded``: the embedded noida-db broker (``worker.devbroker.embedded_broker``).
- unset (``auto``): Apache Kafka where Java and its jars are here, else the embedded broker, said in pytest's
  header. Under CI (``CI`` set) there is no such fallback: ``auto`` means Apache Kafka, and a machine that cannot
  run it fails the run at once.

The Schema Registry: the one ``SCHEMA_REGISTRY_URL`` names; else, beside the pinned Apache Kafka, Apicurio Registry
3.3.3 through its Confluent-compatible API (``tests/registry_apicurio.py``; required under CI, like Kafka); else the
in-process test double (``tests/registry_double.py``). conftest
calls ``check_selection`` from ``pytest_configure`` (so a bad selection fails before collection) and
``started_broker`` from its session fixture; tests that kill or restart a broker start their own with
``own_broker``, of the session's kind.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping

import pytest

BROKER_ENV, BOOTSTRAP_ENV, REGISTRY_ENV = "DECIDER_TEST_BROKER", "KAFKA_BOOTSTRAP", "SCHEMA_REGISTRY_URL"
CHOICES = ("auto", "kafka", "embedded")


@dataclass(frozen=True)
class TestBroker:
    """What the session's tests talk to. ``registry_url`` is reachable from worker subprocesses too."""

    __test__ = False  # not a test class, despite the name

    kind: str  # "external", "kafka" or "embedded"
    bootstrap: str
    registry_url: str
    registry: str = "test double"  # "apicurio", "test double" or "external"


@functools.lru_cache(maxsize=1)
def kafka_problem() -> str | None:
    """Why the pinned Apache Kafka cannot start here (None if it can); asked once a session (it runs ``java``)."""
    from worker.devbroker.apache_kafka import kafka_problem as problem

    return problem()


def selection(environ: Mapping[str, str] = os.environ) -> str:
    """``external``, ``kafka`` or ``embedded``; ``pytest.UsageError`` (one line) for an unknown choice."""
    if environ.get(BOOTSTRAP_ENV):
        return "external"
    choice = environ.get(BROKER_ENV, "auto").strip().lower() or "auto"
    if choice not in CHOICES:
        raise pytest.UsageError(f"{BROKER_ENV}={choice!r}: use kafka (the pinned Apache Kafka), embedded (noida-db) "
                                f"or auto, or set {BOOTSTRAP_ENV} for an external Kafka")
    if choice == "auto":
        return "kafka" if environ.get("CI") or kafka_problem() is None else "embedded"
    return choice


def fallback_notice(environ: Mapping[str, str] = os.environ) -> str | None:
    """pytest's header line when ``auto`` fell back to the embedded broker (None when it did not)."""
    asked = environ.get(BROKER_ENV, "auto").strip().lower() or "auto"
    if environ.get(BOOTSTRAP_ENV) or asked != "auto" or selection(environ) != "embedded":
        return None
    return (f"broker: the embedded noida-db broker, not Apache Kafka ({kafka_problem()}); CI runs every broker test "
            f"on Apache Kafka: bash dev/setup.sh with Java 17+ and Maven gets it")


def group_protocols(environ: Mapping[str, str] = os.environ) -> tuple[str, ...]:
    """The consumer group protocols the selected broker runs: noida-db 0.2.3 has only the classic one (no KIP-848
    ConsumerGroupHeartbeat); Apache Kafka 4.4 has both; an external Kafka says (its ApiVersions)."""
    choice = selection(environ)
    if choice == "embedded":
        return ("classic",)
    if choice == "kafka":
        return ("classic", "consumer")
    from worker.kafka_clients import CONSUMER_GROUP_HEARTBEAT_API, broker_api_keys

    keys = broker_api_keys(environ[BOOTSTRAP_ENV]) or set()
    return ("classic", "consumer") if CONSUMER_GROUP_HEARTBEAT_API in keys else ("classic",)


def check_selection(environ: Mapping[str, str] = os.environ) -> str:
    """The selection, after checking that it can run here; ``pytest.UsageError`` with one line if it cannot."""
    choice = selection(environ)
    if choice == "kafka":
        problem = kafka_problem()
        if problem is not None:
            why = "CI runs every broker test on Apache Kafka" if environ.get("CI") else f"{BROKER_ENV}=kafka"
            raise pytest.UsageError(f"{why}, but it cannot start here: {problem}; or set {BROKER_ENV}=embedded")
    return choice


def registry_choice(choice: str, environ: Mapping[str, str] = os.environ) -> str:
    """``external``, ``apicurio`` or ``test double``: the registry beside broker ``choice``; ``pytest.UsageError``
    (one line) under CI when Apicurio cannot start beside Apache Kafka."""
    if environ.get(REGISTRY_ENV):
        return "external"
    if choice != "kafka":
        return "test double"
    from tests.registry_apicurio import problem

    why = problem()
    if why is None:
        return "apicurio"
    if environ.get("CI"):
        raise pytest.UsageError(f"CI runs the registry tests on Apicurio Registry, but it cannot start here: {why}")
    return "test double"


@contextlib.contextmanager
def started_broker(workdir: Path, environ: Mapping[str, str] = os.environ) -> Iterator[TestBroker]:
    """The selected broker and registry, running for the ``with`` block, stopped after it."""
    choice = check_selection(environ)
    registry = registry_choice(choice, environ)
    with contextlib.ExitStack() as stack:
        if registry == "external":
            registry_url = environ[REGISTRY_ENV]
        elif registry == "apicurio":
            from tests.registry_apicurio import apicurio_process

            registry_url = stack.enter_context(apicurio_process(workdir / "apicurio.log"))
        else:
            from tests.registry_double import registry_double_process

            registry_url = stack.enter_context(registry_double_process())
        if choice == "external":
            yield TestBroker("external", environ[BOOTSTRAP_ENV], registry_url, registry)
            return
        broker = stack.enter_context(own_broker(workdir, choice))
        yield TestBroker(choice, broker.bootstrap, registry_url, registry)


@contextlib.contextmanager
def own_broker(workdir: Path, choice: str | None = None) -> Iterator:
    """A broker of the session's kind (``choice`` names another) for the ``with`` block, on a directory of its own
    under ``workdir``: ``start()``, ``stop()`` and ``kill()`` (SIGKILL, the directory kept) restart it on the same
    port and log. An external Kafka is not ours to kill: the test is skipped there."""
    choice = choice or selection()
    if choice == "external":
        pytest.skip("kills and restarts a broker of its own, not the external Kafka")
    if choice == "kafka":
        from worker.devbroker.apache_kafka import ApacheKafka

        broker = ApacheKafka(directory=str(workdir / "kafka"))
    else:
        from worker.devbroker.embedded_broker import EmbeddedBroker
        from worker.devbroker.processes import free_port

        broker = EmbeddedBroker(port=free_port(), data_dir=str(workdir / "embedded-data"),
                                log=open(workdir / "embedded-broker.log", "a"))
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


def bench_broker_args() -> list[str]:
    """The ``--broker`` flag a benchmark run in a test takes: the session's kind (an external Kafka: the pinned one)."""
    return ["--broker", "embedded" if selection() == "embedded" else "kafka"]
