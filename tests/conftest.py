"""Session fixtures shared by every test package: the Kafka broker.

``KAFKA_BOOTSTRAP`` set: tests use that (real) Kafka. Otherwise the embedded noida-db broker is started
once per session on a free port and stopped by PID at the end (``worker.embedded_broker``). Tests that
need the broker isolate themselves with unique topic and group names, so they can share it.
"""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def kafka_bootstrap(tmp_path_factory) -> str:
    """Bootstrap servers of a running broker for this test session."""
    external = os.environ.get("KAFKA_BOOTSTRAP")
    if external:
        yield external
        return
    from worker.embedded_broker import EmbeddedBroker, free_port

    log_path = tmp_path_factory.mktemp("broker") / "broker.log"
    with open(log_path, "w") as log, EmbeddedBroker(port=free_port(), data_dir=str(log_path.parent / "data"), log=log) as broker:
        yield broker.bootstrap
