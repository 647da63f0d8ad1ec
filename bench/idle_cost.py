"""Idle cost (issue 32, item 4): the CPU an idle consumer or worker burns, split by thread, and the broker's.

    python bench/idle_cost.py consumers --variants worker@embedded,wait500@embedded,worker@mock --rounds 3
    python bench/idle_cost.py worker --variants worker@embedded,worker@mock --rounds 3   # a whole idle `decider worker`
    python bench/idle_cost.py latency --samples 200 --variants worker,wait500           # produce -> consume, embedded

A variant is ``NAME@BROKER``: NAME picks client settings (``VARIANTS``, ``WORKER_VARIANTS``), BROKER is ``embedded``
(noida-db, which answers an empty Fetch at once) or ``mock`` (librdkafka's mock cluster, which holds it for the
request's max wait, as Kafka does); a bare NAME takes --broker. Every variant gets its own broker process, so the
broker's CPU is attributable, and all variants run at the same time (side by side), so a loaded machine slows them
alike. CPU = utime + stime deltas of every thread (``bench/thread_cpu.py``) in
``/proc/PID/task/*/stat`` over the window, as a fraction of one core, summed by thread name (``rdk:broker1`` is
librdkafka's thread for broker 1, ``rdk:main`` its main thread, ``python`` the interpreter's own thread, ...).

``consumers``: one bare confluent-kafka consumer per variant, subscribed through a group to an empty topic with the
worker's states-consumer settings (``worker.kafka_clients.worker_consumer_config``) plus the variant's overrides,
polling as the worker's loop does when idle (``poll(0.1)``). Fetch requests/s come from librdkafka's statistics
(``brokers.*.req.Fetch``), so "the broker answers at once" shows as far more fetches/s than 1000 /
``fetch.wait.max.ms``, and the client's CPU per fetch round trip gives what the same consumer costs against a broker
that waits (real Kafka): that cost x (1000 / fetch.wait.max.ms) fetches/s.

``latency``: the same consumers; one record is produced to every variant's broker at the same instant (in a random
order), at random times (gaps uniform in 50-250 ms), and each consumer reports produce -> consume latency (p50/p99
over --samples). Embedded brokers only: the mock cluster is not woken by a produce, so it is no latency reference.

``worker``: a `decider worker` (tiny random model, CPU) on an idle stream per variant; variant overrides are given to
the worker's client settings through DECIDER_BENCH_CLIENT_OVERRIDES (read only by this script's launcher).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.thread_cpu import measure, summary  # noqa: E402
from worker.config import Topics  # noqa: E402
from worker.devbroker.embedded_broker import EmbeddedBroker  # noqa: E402
from worker.devbroker.processes import free_port  # noqa: E402
from worker.kafka_clients import create_topics  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

# Overrides of the consumers' librdkafka settings, per variant name.
VARIANTS: dict[str, dict] = {
    "worker": {},                                                   # the states consumer exactly as the worker builds it
    "wait500": {"fetch.wait.max.ms": 500, "fetch.min.bytes": 1},    # a long wait, return on the first byte
    "reader": {"fetch.wait.max.ms": 50},                            # the schema table reader's wait
}


# ------------------------------------------------------------------------------------------------- a bare consumer

def consumer_child(bootstrap: str, topic: str, group: str, overrides: dict) -> None:
    """Runs in a child process: subscribe, poll like the idle worker loop, report on stdout (one JSON per line)."""
    from confluent_kafka import Consumer

    from worker.config import WorkerConfig
    from worker.kafka_clients import worker_consumer_config

    config = worker_consumer_config(WorkerConfig(bootstrap=bootstrap, model_dir="unused", worker_id=group, group=group))
    lock = threading.Lock()

    def out(obj) -> None:
        with lock:
            sys.stdout.write(json.dumps(obj) + "\n")
            sys.stdout.flush()

    def on_stats(stats_json: str) -> None:
        stats = json.loads(stats_json)
        fetches = sum(b.get("req", {}).get("Fetch", 0) for b in stats.get("brokers", {}).values())
        out({"fetches": fetches, "t": time.monotonic()})

    config.update({"statistics.interval.ms": 1000, "stats_cb": on_stats, **overrides})
    consumer = Consumer(config)
    consumer.subscribe([topic], on_assign=lambda c, parts: out({"assigned": len(parts)}))
    while True:
        message = consumer.poll(0.1)
        if message is None or message.error() is not None or message.value() is None:
            continue  # nothing, an error, or the mock cluster's topic-creating tombstone
        now = time.time_ns()
        out({"latency_ms": (now - int(message.value())) / 1e6})


def mock_child(topics: list[str]) -> None:
    """Runs in a child process: librdkafka's mock cluster (one broker), kept up until killed. It answers an empty
    Fetch after the request's MaxWait, as Kafka does, but is not woken by a produce meanwhile (so it is a reference
    for idle cost only, never for latency). Topics are auto-created by producing one record to each (a tombstone
    with a key, so a schema table reading it ignores it)."""
    from confluent_kafka import Producer

    holder = Producer({"bootstrap.servers": "unused", "test.mock.num.brokers": 1, "log_level": 0})
    bootstrap: list[str] = []
    while not bootstrap:
        # The mock's address: its brokers' names in the holder's own metadata.
        bootstrap = [f"{b.host}:{b.port}" for b in holder.list_topics(timeout=10).brokers.values()]
    producer = Producer({"bootstrap.servers": bootstrap[0], "log_level": 0})
    for topic in topics:
        producer.produce(topic, key=b"idle-cost", value=None)
    if producer.flush(10):
        raise SystemExit("mock cluster: could not create the topics")
    print(json.dumps({"bootstrap": bootstrap[0]}), flush=True)
    while True:
        time.sleep(3600)


class MockBroker:
    """A ``mock_child`` process: the same surface as ``EmbeddedBroker`` for this script."""

    def __init__(self, topics: list[str]) -> None:
        self.process = subprocess.Popen([sys.executable, __file__, "_mock", *topics], stdout=subprocess.PIPE, text=True,
                                        cwd=REPO)
        line = self.process.stdout.readline()
        if not line:
            raise SystemExit("the mock cluster did not start")
        self.bootstrap = json.loads(line)["bootstrap"]

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()


def start_broker(kind: str, topics: Topics, partitions: int, log: Path):
    """An embedded broker (noida-db) or librdkafka's mock cluster, with ``topics`` created."""
    names = [topics.states, topics.schemas, topics.probabilities, topics.dead_letter]
    if kind == "mock":
        return MockBroker(names)
    broker = EmbeddedBroker(port=free_port(), log=open(log, "ab")).start()
    create_topics(broker.bootstrap, topics, partitions)
    return broker


class Variant:
    """One variant: its own broker, topic and bare consumer child."""

    def __init__(self, label: str, logs: Path, default_kind: str) -> None:
        name, kind = split_label(label, default_kind)
        self.name, self.overrides = label, VARIANTS[name]
        self.topic = f"idle-{name}-{kind}"
        self.broker = start_broker(kind, Topics(states=self.topic, schemas=f"{self.topic}.schemas",
                                                       probabilities=f"{self.topic}.out", dead_letter=f"{self.topic}.dlq"),
                                   1, logs / f"broker-{self.topic}.log")
        self.assigned = threading.Event()
        self.fetches: list[tuple[float, int]] = []
        self.latencies: list[float] = []
        self.child = subprocess.Popen(
            [sys.executable, __file__, "_consumer", self.broker.bootstrap, self.topic, f"g-{self.topic}",
             json.dumps(self.overrides)],
            stdout=subprocess.PIPE, text=True, cwd=REPO)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.child.stdout:
            msg = json.loads(line)
            if "assigned" in msg and msg["assigned"]:
                self.assigned.set()
            elif "fetches" in msg:
                self.fetches.append((msg["t"], msg["fetches"]))
            elif "latency_ms" in msg:
                self.latencies.append(msg["latency_ms"])

    def fetch_rate(self, t0: float, t1: float) -> float | None:
        """Fetch requests per second between two monotonic instants, from the statistics reports inside them."""
        inside = [(t, n) for t, n in self.fetches if t0 <= t <= t1]
        if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
            return None
        return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])

    def stop(self) -> None:
        self.child.kill()
        self.child.wait()
        self.broker.stop()


def split_label(label: str, default_kind: str) -> tuple[str, str]:
    """``name@kind`` (or ``name``: the --broker kind) -> (variant name, broker kind)."""
    name, _, kind = label.partition("@")
    return name, kind or default_kind


def start_variants(labels: list[str], logs: Path, default_kind: str) -> list[Variant]:
    variants = [Variant(label, logs, default_kind) for label in labels]
    for v in variants:
        if not v.assigned.wait(30):
            raise SystemExit(f"variant {v.name}: no partition assigned within 30 s")
    time.sleep(3)  # past the group join and the first fetches
    return variants



def consumers(args, logs: Path) -> dict:
    variants = start_variants(args.variants, logs, args.broker)
    try:
        pids = {}
        for v in variants:
            pids[f"{v.name}/client"] = v.child.pid
            pids[f"{v.name}/broker"] = v.broker.process.pid
        result: dict = {v.name: {"overrides": v.overrides, "rounds": []} for v in variants}
        for _ in range(args.rounds):
            t0 = time.monotonic()
            cpu = measure(pids, args.window)
            t1 = time.monotonic()
            time.sleep(1.2)  # the statistics report after the window
            for v in variants:
                rate = v.fetch_rate(t0 - 1.1, t1 + 1.1)
                client = summary(cpu[f"{v.name}/client"])
                result[v.name]["rounds"].append({
                    "client": client,
                    "broker": summary(cpu[f"{v.name}/broker"]),
                    "fetches_per_s": round(rate, 1) if rate else None,
                    "client_us_per_fetch": round(client["total"] / rate * 1e6, 1) if rate else None,
                })
        return result
    finally:
        for v in variants:
            v.stop()


def latency(args, logs: Path) -> dict:
    from confluent_kafka import Producer

    variants = start_variants(args.variants, logs, args.broker)
    try:
        producers = [Producer({"bootstrap.servers": v.broker.bootstrap, "linger.ms": 0, "log_level": 0}) for v in variants]
        rnd = random.Random(1)
        for _ in range(args.samples):
            time.sleep(rnd.uniform(0.05, 0.25))
            pairs = list(zip(producers, variants))
            rnd.shuffle(pairs)  # no variant is always produced to first
            for p, v in pairs:
                p.produce(v.topic, value=str(time.time_ns()).encode())
                p.poll(0)
        for p in producers:
            p.flush(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(len(v.latencies) < args.samples for v in variants):
            time.sleep(0.1)
        result = {}
        for v in variants:
            lat = sorted(v.latencies)
            q = statistics.quantiles(lat, n=100) if len(lat) >= 2 else [float("nan")] * 99
            result[v.name] = {"overrides": v.overrides, "n": len(lat), "p50_ms": round(q[49], 2),
                              "p99_ms": round(q[98], 2), "max_ms": round(lat[-1], 2) if lat else None}
        return result
    finally:
        for v in variants:
            v.stop()


# ---------------------------------------------------------------------------------------------------- a whole worker

def worker_child(argv: list[str]) -> None:
    """Runs in a child process: `decider worker` with the variant's client overrides patched into kafka_clients."""
    overrides = json.loads(os.environ.get("DECIDER_BENCH_CLIENT_OVERRIDES") or "{}")
    if overrides:
        from worker import kafka_clients

        for fn_name, extra in overrides.items():  # e.g. {"worker_consumer_config": {...}, "reader_consumer_config": {...}}
            original = getattr(kafka_clients, fn_name)

            def patched(*a, _original=original, _extra=extra, **kw):
                return {**_original(*a, **kw), **_extra}
            setattr(kafka_clients, fn_name, patched)
    from worker.cli.app import main

    sys.argv = ["decider", "worker", *argv]
    main()


WORKER_VARIANTS: dict[str, dict] = {
    "worker": {},
    "wait500": {"worker_consumer_config": {"fetch.wait.max.ms": 500}, "reader_consumer_config": {"fetch.wait.max.ms": 500}},
}


def worker(args, logs: Path) -> dict:
    from engine.testing import write_tiny_model

    model = write_tiny_model(logs / "tiny", seed=0)
    runs = []
    try:
        for label in args.variants:
            name, kind = split_label(label, args.broker)
            broker = start_broker(kind, Topics(), 2, logs / f"broker-w-{name}-{kind}.log")
            log = open(logs / f"worker-{name}-{kind}.log", "ab")
            env = {**os.environ, "DECIDER_BENCH_CLIENT_OVERRIDES": json.dumps(WORKER_VARIANTS[name])}
            proc = subprocess.Popen([sys.executable, __file__, "_worker", "-b", broker.bootstrap, "--model", str(model),
                                     "--device", "cpu", "--worker-id", f"w-{name}", "--log-format", "json"],
                                    stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
            runs.append((label, broker, proc, logs / f"worker-{name}-{kind}.log"))
        deadline = time.monotonic() + 120
        for name, _, proc, log_path in runs:
            while "assigned" not in log_path.read_text(errors="replace"):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"worker {name} never got partitions; see {log_path}")
                time.sleep(0.5)
        time.sleep(5)  # past start-up
        pids = {}
        for name, broker, proc, _ in runs:
            pids[f"{name}/worker"] = proc.pid
            pids[f"{name}/broker"] = broker.process.pid
        result: dict = {label: {"overrides": WORKER_VARIANTS[split_label(label, args.broker)[0]], "rounds": []}
                        for label, *_ in runs}
        for _ in range(args.rounds):
            cpu = measure(pids, args.window)
            for label, *_ in runs:
                result[label]["rounds"].append({"worker": summary(cpu[f"{label}/worker"]),
                                                "broker": summary(cpu[f"{label}/broker"])})
        return result
    finally:
        for _, broker, proc, _ in runs:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
            broker.stop()


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_consumer":
        consumer_child(argv[1], argv[2], argv[3], json.loads(argv[4]))
        return {}
    if argv and argv[0] == "_mock":
        mock_child(argv[1:])
        return {}
    if argv and argv[0] == "_worker":
        worker_child(argv[1:])
        return {}
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["consumers", "latency", "worker"])
    parser.add_argument("--window", type=float, default=20.0, help="CPU measurement window, seconds")
    parser.add_argument("--rounds", type=int, default=1, help="consecutive measurement windows (CPU modes)")
    parser.add_argument("--logs", help="keep the brokers' and workers' logs here (default: a temporary directory)")
    parser.add_argument("--samples", type=int, default=200, help="latency samples per variant")
    parser.add_argument("--broker", choices=["embedded", "mock"], default="embedded",
                        help="embedded: noida-db (answers an empty fetch at once); mock: librdkafka's mock cluster "
                             "(answers it after fetch.wait.max.ms, as Kafka does)")
    parser.add_argument("--variants", type=lambda s: s.split(","), default=["worker", "wait500"])
    args = parser.parse_args(argv)
    known = WORKER_VARIANTS if args.mode == "worker" else VARIANTS
    for label in args.variants:
        name, kind = split_label(label, args.broker)
        if name not in known or kind not in ("embedded", "mock"):
            parser.error(f"unknown variant {label!r} (known: {', '.join(known)}, each optionally @embedded or @mock)")
    if args.mode == "latency" and any(split_label(label, args.broker)[1] == "mock" for label in args.variants):
        parser.error("the mock cluster is not woken by a produce: it is no reference for latency")
    with tempfile.TemporaryDirectory(prefix="idle-cost-") as tmp:
        logs = Path(args.logs) if args.logs else Path(tmp)
        logs.mkdir(parents=True, exist_ok=True)
        result = {"consumers": consumers, "latency": latency, "worker": worker}[args.mode](args, logs)
    print(json.dumps({"mode": args.mode, "broker": args.broker, "window_s": args.window, **result}, indent=1))
    return result


if __name__ == "__main__":
    main()
