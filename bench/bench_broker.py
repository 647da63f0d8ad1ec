"""The broker a benchmark runs on: the pinned Apache Kafka 4.4 (``--broker kafka``, the default) or the embedded
development broker (``--broker embedded``, noida-db: for side-by-side figures, and machines without Java).

One place, so that every bench starts it alike and its results say which it was (``broker`` in their JSON)."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Iterator

BROKERS = ("kafka", "embedded")
BROKER_GC_ENV = "DECIDER_BENCH_BROKER_GC"
"""The environment variable that picks the benches' Apache Kafka collector (a key of
``worker.devbroker.apache_kafka.GC_FLAGS``; unset: ZGC, the default): ``g1`` runs Kafka's own flags, so that
``bench/gpu_session.sh gc-ab`` can time the capacity on both in one tree."""


def add_broker_option(parser) -> None:
    """``--broker kafka|embedded`` on an argparse parser."""
    parser.add_argument("--broker", choices=BROKERS, default="kafka",
                        help="the pinned Apache Kafka 4.4 (default; needs Java 17+ and its jars: bash dev/setup.sh) or "
                             "the embedded development broker (noida-db)")


def broker_cpus(cores: int | None = None) -> int | None:
    """The cores a bench's Apache Kafka may use: a quarter of this machine's where it has 8 or more (the GPU machine's
    16: 4), so that the broker, which production runs on machines of its own, does not take the worker's cores for its
    collections (run DN: G1's pauses on every core every ~1.5 s); all of them on a smaller machine (this project's
    2-core one), where confining it would starve it."""
    cores = cores or len(os.sched_getaffinity(0))
    return cores // 4 if cores >= 8 else None


@contextlib.contextmanager
def bench_broker(kind: str, logs: Path, name: str = "broker") -> Iterator:
    """A fresh broker of ``kind`` for the ``with`` block (``.bootstrap``, ``.port``), its log under ``logs``; stopped
    after it. A Kafka that cannot start here is one line that names ``--broker embedded``."""
    if kind == "kafka":
        from worker.devbroker.apache_kafka import ApacheKafka, kafka_problem

        problem = kafka_problem()
        if problem is not None:
            raise SystemExit(f"--broker kafka: {problem}; or run on the embedded broker with --broker embedded")
        gc = os.environ.get(BROKER_GC_ENV) or ApacheKafka.gc
        # Its log directory beside the logs, not in them (the logs are kept with the results), its own log copied in.
        try:
            broker = ApacheKafka(directory=str(logs.parent / f"{name}-kafka"), cpus=broker_cpus(), gc=gc)
        except ValueError as exc:       # the collector is the only setting it checks on construction
            raise SystemExit(f"{BROKER_GC_ENV}={gc}: {exc}") from None
        try:
            with broker:
                yield broker
        finally:
            if broker.log_path.is_file():
                shutil.copy(broker.log_path, logs / f"{name}-kafka.log")
        return
    from worker.devbroker.embedded_broker import EmbeddedBroker
    from worker.devbroker.processes import free_port

    with EmbeddedBroker(port=free_port(), log=open(logs / f"{name}.log", "ab")) as broker:
        yield broker
