"""The Apache Kafka broker's collector under a worker's kind of load: its pauses and its CPU, by collector.

    python bench/probes/broker_gc_probe.py --gc g1,zgc --seconds 40 --out /tmp/broker-gc.json

For each collector (`worker.devbroker.apache_kafka.GC_FLAGS`) a fresh broker confined to one core, as the benches run
it (`bench.bench_broker`), takes `--rate` JSON-sized states a second into the states topic (4 partitions), and the
worker's own transactions (`worker.stream.turns.worker_transactions`: its producer settings, its two transactional ids
in turn) commit them in cycles of up to 9, each cycle's records (500-byte values) with its input offsets. Reported: the JVM's pauses from the broker's log
(`bench.tail_causes.broker_pauses`), the broker's CPU seconds per thousand states, and the transactions' times. A pause
stops every request of the broker, so on a 25 ms budget a 10-26 ms one (G1 on the H100 machine, run EQ) is most of a
state's time.
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from tempfile import TemporaryDirectory

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.tail_causes import broker_pauses  # noqa: E402
from bench.thread_cpu import process_cpu_s  # noqa: E402
from worker.config import Topics, WorkerConfig  # noqa: E402
from worker.devbroker.apache_kafka import GC_FLAGS, ApacheKafka  # noqa: E402
from worker.formats.records import OutgoingRecord  # noqa: E402
from worker.kafka_clients import create_topics, plain_producer  # noqa: E402
from worker.stream.turns import worker_transactions  # noqa: E402

CYCLE = 9
"""States a cycle takes at most: the capacity runs' cycles at 25 ms held 8-9."""


def _feed(bootstrap: str, topic: str, rate: int, until: float) -> None:
    producer = plain_producer(bootstrap, linger_ms=2)
    payload = b'{"id": "%d", "text": "' + b"x" * 700 + b'"}'
    sent, started = 0, time.monotonic()
    while time.monotonic() < until:
        wait = started + sent / rate - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        producer.produce(topic, payload % sent, key=str(sent % 97).encode())
        producer.poll(0)
        sent += 1
    producer.flush()


def _cycles(bootstrap: str, topics: Topics, until: float) -> tuple[int, list[float]]:
    """Read-process-write transactions until `until`: (states committed, each transaction's ms)."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "probe", "enable.auto.commit": False,
                         "isolation.level": "read_committed", "auto.offset.reset": "earliest"})
    consumer.subscribe([topics.states])
    config = WorkerConfig(bootstrap=bootstrap, model_dir="unused", worker_id="probe", group="probe", topics=topics)
    transactions = worker_transactions(config, consumer)
    transactions.init()
    states, took = 0, []
    try:
        while time.monotonic() < until:
            messages = consumer.consume(CYCLE, timeout=0.01)
            if not messages:
                continue
            started = time.monotonic()
            transactions.commit([OutgoingRecord(topics.probabilities, m.key(), b"\0" * 500) for m in messages],
                                [TopicPartition(m.topic(), m.partition(), m.offset() + 1) for m in messages],
                                consumer.consumer_group_metadata())
            took.append((time.monotonic() - started) * 1000)
            states += len(messages)
    finally:
        transactions.close()
        consumer.close()
    return states, took


def _quantile(values: list[float], q: float) -> float | None:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3) if ordered else None


def run(gc: str, seconds: float, rate: int) -> dict:
    """One broker with collector `gc` under the load for `seconds`."""
    topics = Topics()
    with TemporaryDirectory() as tmp, ApacheKafka(directory=tmp, cpus=1, gc=gc) as broker:
        create_topics(broker.bootstrap, topics, partitions=4)
        until = time.monotonic() + seconds
        feeder = threading.Thread(target=_feed, args=(broker.bootstrap, topics.states, rate, until), daemon=True)
        feeder.start()
        states, took = _cycles(broker.bootstrap, topics, until)
        feeder.join()
        cpu_s = process_cpu_s(broker.process.pid)
        pauses = [end - start for start, end in broker_pauses(broker.log_path)]
    return {"gc": gc, "seconds": seconds, "states": states, "transactions": len(took),
            "broker_cpu_ms_per_1000_states": round(cpu_s * 1e6 / max(states, 1), 1),
            "pauses": len(pauses), "pause_ms_p50": _quantile(pauses, 0.5), "pause_ms_max": _quantile(pauses, 1.0),
            "paused_ms_total": round(sum(pauses), 1),
            "transaction_ms_p50": _quantile(took, 0.5), "transaction_ms_p99": _quantile(took, 0.99)}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gc", default=",".join(GC_FLAGS), help="collectors to run, in order (default: %(default)s)")
    ap.add_argument("--seconds", type=float, default=40.0, help="load per collector (default: %(default)s)")
    ap.add_argument("--rate", type=int, default=1000, help="states offered a second (default: %(default)s)")
    ap.add_argument("--out", help="write the results here as JSON")
    args = ap.parse_args(argv)
    unknown = sorted(set(args.gc.split(",")) - set(GC_FLAGS))
    if unknown:
        ap.error(f"--gc: {', '.join(unknown)} (known: {', '.join(GC_FLAGS)})")
    results = []
    for gc in args.gc.split(","):
        results.append(run(gc, args.seconds, args.rate))
        print(json.dumps(results[-1]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
