"""The Apache Kafka broker's collector under a worker's kind of load: its pauses and its CPU, by collector.

    python bench/probes/broker_gc_probe.py --gc g1,zgc --seconds 40 --out /tmp/broker-gc.json

For each collector (`worker.devbroker.apache_kafka.GC_FLAGS`) a fresh broker confined to one core, as the benches run
it (`bench.bench_broker`), takes `--rate` JSON-sized states a second into a 4-partition topic, and one transactional
producer reads them in cycles of up to 9 and commits each cycle's records (500-byte values) with its input offsets, as
the worker does (its retry backoff too). Reported: the JVM's pauses from the broker's log
(`bench.tail_causes.broker_pauses`), the broker's CPU seconds per thousand states, and the transactions' times. A pause
stops every request of the broker, so on a 25 ms budget a 10-26 ms one (G1 on the H100 machine, run EQ) is most of a
state's time.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path
from tempfile import TemporaryDirectory

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.tail_causes import broker_pauses  # noqa: E402
from worker.devbroker.apache_kafka import GC_FLAGS, ApacheKafka  # noqa: E402

CYCLE = 9
"""States a cycle takes at most: the capacity runs' cycles at 25 ms held 8-9."""


def _feed(bootstrap: str, rate: int, until: float) -> None:
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 2})
    payload = b'{"id": "%d", "text": "' + b"x" * 700 + b'"}'
    sent, started = 0, time.monotonic()
    while time.monotonic() < until:
        wait = started + sent / rate - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        producer.produce("states", payload % sent, key=str(sent % 97).encode())
        producer.poll(0)
        sent += 1
    producer.flush()


def _cycles(bootstrap: str, until: float) -> tuple[int, list[float]]:
    """Read-process-write transactions until `until`: (states committed, each transaction's ms)."""
    from confluent_kafka import Consumer, Producer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "probe", "enable.auto.commit": False,
                         "isolation.level": "read_committed", "auto.offset.reset": "earliest"})
    consumer.subscribe(["states"])
    producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": "probe-0", "linger.ms": 2,
                         "retry.backoff.ms": 2, "retry.backoff.max.ms": 10})
    producer.init_transactions()
    states, took = 0, []
    while time.monotonic() < until:
        messages = consumer.consume(CYCLE, timeout=0.01)
        if not messages:
            continue
        started = time.monotonic()
        producer.begin_transaction()
        for m in messages:
            producer.produce("probabilities", b"\0" * 500, key=m.key(), partition=m.partition())
        offsets = [TopicPartition(m.topic(), m.partition(), m.offset() + 1) for m in messages]
        producer.send_offsets_to_transaction(offsets, consumer.consumer_group_metadata())
        producer.commit_transaction()
        took.append((time.monotonic() - started) * 1000)
        states += len(messages)
    consumer.close()
    return states, took


def _quantile(values: list[float], q: float) -> float | None:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3) if ordered else None


def run(gc: str, seconds: float, rate: int) -> dict:
    """One broker with collector `gc` under the load for `seconds`."""
    from confluent_kafka.admin import AdminClient, NewTopic

    with TemporaryDirectory() as tmp, ApacheKafka(directory=tmp, cpus=1, gc=gc) as broker:
        admin = AdminClient({"bootstrap.servers": broker.bootstrap})     # kept until the topics exist
        for created in admin.create_topics([NewTopic("states", 4, 1), NewTopic("probabilities", 4, 1)]).values():
            created.result()
        until = time.monotonic() + seconds
        feeder = threading.Thread(target=_feed, args=(broker.bootstrap, rate, until), daemon=True)
        feeder.start()
        states, took = _cycles(broker.bootstrap, until)
        feeder.join()
        stat = Path(f"/proc/{broker.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        cpu_s = (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")       # utime, stime
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
