"""Back-to-back transactions through the worker's own transactions (``worker.stream.turns.worker_transactions``, the
committer's path: begin, produce the records, send the input offsets, flush, commit), timed per step, with settings
of the transactional producer alternated in blocks on one broker, so that the figures of each setting share the
machine's load.

    python bench/probes/transaction_probe.py                    # Kafka 4.4: decider's settings vs librdkafka's retry backoff
    python bench/probes/transaction_probe.py --broker embedded
    python bench/probes/transaction_probe.py --variant "fast:retry.backoff.ms=5,retry.backoff.max.ms=25" --variant "slow:retry.backoff.ms=100"
    python bench/probes/transaction_probe.py --variant "one-id:" --variant "two-ids:probe.ids=2"   # ids taking turns
    python bench/probes/transaction_probe.py --variant "nagle:socket.nagle.disable=false,probe.ids=2" --variant "decider:probe.ids=2"

(``probe.ids`` is the worker's --transactional-ids: that many ids taking turns, one transaction each
(``worker.stream.turns``); the steps of every transaction after each id's first are timed.)

What it showed (2026-12-04, this 2-core machine loaded by other work): Apache Kafka answers EndTxn before it has
written the transaction's markers and refuses the next AddOffsetsToTxn with CONCURRENT_TRANSACTIONS until it has;
at librdkafka's retry backoff (100 ms) the offsets step of a back-to-back transaction took ~110 ms. Two ids taking
turns do not wait for it at all: 31.3 -> 11.6 ms a transaction at the median (three: 11.9). Through the worker's
``--transactional-ids`` (2026-12-05, 90 transactions each): one id 27.2 ms at the median (p99 59.1), two 8.0 (20.9).
Nagle's algorithm on (librdkafka's default) against off (decider's since 2026-12-06), 300 transactions each: two ids
11.4 -> 9.6 ms at the median (p99 45.4 -> 30.2), one id 28.7 -> 27.2 (and 27.7 -> 13.0, 13.6 -> 9.6 in two shorter
runs before it).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from confluent_kafka import Consumer, TopicPartition  # noqa: E402

from bench.bench_broker import add_broker_option, bench_broker  # noqa: E402
from worker.config import Topics, WorkerConfig  # noqa: E402
from worker.formats.records import OutgoingRecord  # noqa: E402
from worker.kafka_clients import create_topics  # noqa: E402
from worker.stream.turns import worker_transactions  # noqa: E402

DEFAULT_VARIANTS = ("decider:", "librdkafka-backoff:retry.backoff.ms=100,retry.backoff.max.ms=1000")


def variant(spec: str) -> tuple[str, dict[str, str]]:
    """"name:key=value,key=value" (nothing after the colon: decider's own settings)."""
    name, _, settings = spec.partition(":")
    return name, dict(pair.split("=", 1) for pair in settings.split(",") if pair)


def run_block(bootstrap: str, name: str, settings: dict[str, str], transactions: int, records: int,
              offset: int) -> list[dict[str, float]]:
    """``transactions`` back to back, each with ``records`` records and one input offset; their steps in ms."""
    settings = dict(settings)
    ids = int(settings.pop("probe.ids", 1))  # the worker's --transactional-ids: ids taking turns, one transaction each
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "probe"})
    config = WorkerConfig(bootstrap=bootstrap, model_dir="unused", worker_id=f"probe-{name}", group="probe",
                          transactional_ids=ids, kafka=settings)
    txns = worker_transactions(config, consumer)
    txns.init()
    steps = []
    try:
        for i in range(transactions + ids):
            outgoing = [OutgoingRecord("probe.out", f"k{j}".encode(), b"x" * 200) for j in range(records)]
            txns.commit(outgoing, [TopicPartition("probe.in", 0, offset + i)], consumer.consumer_group_metadata())
            if i >= ids:  # each id's first follows its init, not a commit
                steps.append(dict(txns.last_steps_ms))
    finally:
        txns.close()
        consumer.close()
    return steps


def summary(steps: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """p50 and p99 per step and of the whole transaction."""
    rows = {key: [s[key] for s in steps] for key in steps[0]}
    rows["total"] = [sum(s.values()) for s in steps]
    return {key: {"p50": round(statistics.median(v), 2), "p99": round(statistics.quantiles(v, n=100)[98], 2)}
            for key, v in rows.items()}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_broker_option(ap)
    ap.add_argument("--variant", action="append", help="name:key=value,... (repeatable; default: decider's settings "
                                                       "beside librdkafka's retry backoff)")
    ap.add_argument("--transactions", type=int, default=30, help="per block")
    ap.add_argument("--blocks", type=int, default=3, help="blocks per variant, alternated")
    ap.add_argument("--records", type=int, default=8, help="records per transaction")
    ap.add_argument("--out", type=Path, default=None, help="write the JSON here")
    args = ap.parse_args(argv)
    variants = [variant(spec) for spec in (args.variant or DEFAULT_VARIANTS)]
    collected: dict[str, list] = {name: [] for name, _ in variants}
    with tempfile.TemporaryDirectory() as tmp, bench_broker(args.broker, Path(tmp)) as broker:
        create_topics(broker.bootstrap, Topics(states="probe.in", schemas="probe.schemas", probabilities="probe.out",
                                               dead_letter="probe.dead"), partitions=1)
        offset = 0
        for _ in range(args.blocks):
            for name, settings in variants:
                collected[name] += run_block(broker.bootstrap, name, settings, args.transactions, args.records, offset)
                offset += args.transactions + int(settings.get("probe.ids", 1))  # every transaction of the block
    result = {"broker": args.broker, "transactions_per_variant": args.transactions * args.blocks,
              "records": args.records, "variants": {name: {"settings": dict(settings), **summary(collected[name])}
                                                    for name, settings in variants}}
    for name, row in result["variants"].items():
        print(f"{name:>20}: " + "  ".join(f"{k} {v['p50']}/{v['p99']}" for k, v in row.items() if k != "settings"))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
