"""``decider broker``: a local broker in the foreground, the embedded development broker (noida-db) or, with
``--kafka``, the pinned Apache Kafka 4.4 (``worker.devbroker.apache_kafka``)."""

from __future__ import annotations

import contextlib
from typing import Iterator

import typer

from worker.cli.operated import stop_on_signals
from worker.exceptions import ConfigError, FatalError


def run_local_broker(kafka: bool, port: int, data_dir: str | None) -> None:
    """Start the broker, say where it listens and keeps its data, and run until Ctrl-C (or SIGTERM)."""
    stop = stop_on_signals()
    with _started(kafka, port, data_dir) as (running, description, path):
        kept = "kept" if data_dir else "deleted on exit"
        typer.echo(f"{description} (pid {running.process.pid}) listening on {running.bootstrap}; data in {path} "
                   f"({kept}); Ctrl-C stops it")
        typer.echo(f"next: decider topics create -b {running.bootstrap}")
        while not stop.wait(0.5):
            if running.process.poll() is not None:
                raise FatalError(f"the broker exited with code {running.process.returncode}")
    typer.echo("broker stopped")


@contextlib.contextmanager
def _started(kafka: bool, port: int, data_dir: str | None) -> Iterator[tuple[object, str, str]]:
    """(the running broker, what it is, where its data is) for the ``with`` block."""
    if kafka:
        from worker.devbroker.apache_kafka import KAFKA_VERSION, ApacheKafka, java_problem, resolve_kafka

        problem = java_problem()
        if problem is not None:
            raise ConfigError(f"--kafka: {problem}; leave --kafka out for the embedded broker, which needs no Java")
        resolve_kafka(quiet=False)  # Maven's progress, once: the jars are kept for the next start
        with ApacheKafka(port=port, directory=data_dir) as running:
            yield running, f"Apache Kafka {KAFKA_VERSION} (KRaft, one node)", str(running.path / "data")
        return
    from worker.devbroker.embedded_broker import EmbeddedBroker

    with EmbeddedBroker(port=port, data_dir=data_dir) as running:
        yield running, "embedded Kafka broker (noida-db: a development broker, not crash-durable)", running.data_path
