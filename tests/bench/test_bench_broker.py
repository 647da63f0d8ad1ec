"""The benches' Apache Kafka: on a machine of 8 cores or more it runs on a quarter of them, its JVM sized to them, as
a broker of its own machine would leave the rest to the worker; every collection's pause is in its log."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from bench.bench_broker import broker_cpus
from tests import brokers


def test_a_quarter_of_a_large_machines_cores_and_all_of_a_small_ones():
    assert broker_cpus(16) == 4 and broker_cpus(8) == 2 and broker_cpus(128) == 32
    assert broker_cpus(2) is None and broker_cpus(7) is None


@pytest.mark.skipif(brokers.kafka_problem() is not None, reason="needs Java and the Kafka jars (bash dev/setup.sh)")
@pytest.mark.parametrize("gc", ["zgc", "g1"])
def test_a_confined_broker_runs_on_its_cores_only_and_logs_its_collections(tmp_path, gc):
    from confluent_kafka.admin import AdminClient

    from bench.tail_causes import broker_pauses
    from worker.devbroker.apache_kafka import GC_FLAGS, ApacheKafka

    with ApacheKafka(directory=str(tmp_path / "kafka"), cpus=1, gc=gc) as broker:
        assert AdminClient({"bootstrap.servers": broker.bootstrap}).list_topics(timeout=30).brokers
        status = Path(f"/proc/{broker.process.pid}/status").read_text()
        allowed = re.search(r"^Cpus_allowed_list:\s*(\S+)$", status, re.M).group(1)
        # the last core of this process's own: every thread of the JVM inherited it (set before Java started)
        last = str(max(os.sched_getaffinity(0)))
        assert allowed == last, status
        threads = list(Path(f"/proc/{broker.process.pid}/task").iterdir())
        assert len(threads) > 10 and all(
            re.search(r"^Cpus_allowed_list:\s*(\S+)$", (t / "status").read_text(), re.M).group(1) == last
            for t in threads)
        command = Path(f"/proc/{broker.process.pid}/cmdline").read_bytes().split(b"\0")
        flags, tags = GC_FLAGS[gc]
        assert b"-XX:ActiveProcessorCount=1" in command and f"-Xlog:{tags}:stdout:utctime".encode() in command
        assert all(flag.encode() in command for flag in flags)
    # at least the start's collections (the metadata's threshold), each pause on a line the tail's causes read
    log = broker.log_path.read_text()
    pauses = broker_pauses(broker.log_path)
    assert pauses and all(0 <= end - start < 1000 for start, end in pauses), log[-2000:]
    if gc == "zgc":
        assert max(end - start for start, end in pauses) < 5, log[-2000:]      # concurrent: its pauses are short


def test_an_unknown_collector_is_refused():
    from worker.devbroker.apache_kafka import ApacheKafka

    with pytest.raises(ValueError, match="zgc"):
        ApacheKafka(gc="parallel")


@pytest.mark.skipif(brokers.kafka_problem() is not None, reason="needs Java and the Kafka jars (bash dev/setup.sh)")
def test_the_benches_collector_comes_from_the_environment(tmp_path, monkeypatch):
    from bench.bench_broker import BROKER_GC_ENV, bench_broker

    (tmp_path / "logs").mkdir()
    monkeypatch.setenv(BROKER_GC_ENV, "parallel")
    with pytest.raises(SystemExit, match="DECIDER_BENCH_BROKER_GC=parallel: .* one of g1, zgc"):
        with bench_broker("kafka", tmp_path / "logs"):
            pass
    monkeypatch.setenv(BROKER_GC_ENV, "g1")
    with bench_broker("kafka", tmp_path / "logs") as broker:
        command = Path(f"/proc/{broker.process.pid}/cmdline").read_bytes().split(b"\0")
        assert b"-XX:+UseG1GC" in command and b"-XX:+UseZGC" not in command
