"""Scale-out under load: the workers of one consumer group go 1 -> 3 -> 1 while states keep arriving.

Worker 0 starts alone; worker 1 joins; worker 2 joins; worker 1 is stopped (SIGTERM: it commits what it can and
leaves the group); worker 2 is killed (SIGKILL: its partitions wait for the group's session timeout). After each step
the run waits until the group has settled (every partition held by exactly one live worker, each live worker holding
some), then lets the load run for ``dwell_s`` more. At the end, once worker 0 has committed everything, every state
must be visible exactly once to a read_committed reader, and ``bench.rebalances`` reads from the workers' logs what
each rebalance cost: partitions moved, seconds each partition had no owner, states read twice.

Rebalancing: ``incremental`` (classic protocol, cooperative-sticky), ``eager`` (classic, the range assignor, set in
``[kafka]``) or ``consumer`` (KIP-848; a broker that has it: Kafka 4.0+).

    python bench/stream_bench.py --scale-out                 # GPU: a worker per GPU, 0.8B-shaped model
    pytest tests/bench/test_scale_out.py                      # CPU, tiny model, the tests' broker
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, Producer, TopicPartition

import schemas
from bench.rebalances import Step, dropped_states, rebalance_table
from bench.stream_windows import held_partitions, read_log_events
from worker.cli.commands import put_schema
from worker.config import Topics
from worker.kafka_clients import create_topics, last_committed, plain_producer, reader_consumer, whole_pass_reader

REBALANCING = ("incremental", "eager", "consumer")
STEPS = (("worker 1 joins", "start", 1), ("worker 2 joins", "start", 2), ("worker 1 SIGTERM", "stop", 1),
         ("worker 2 SIGKILL", "kill", 2))
SESSION_TIMEOUT_MS = 6000  # classic protocol: how long a killed worker's partitions wait for it


@dataclass
class ScaleOut:
    """One run's setup. ``texts`` are cycled through as the states' texts; ``schema_file`` holds their questions."""

    bootstrap: str
    model_dir: Path
    schema_file: Path
    workdir: Path
    texts: list[str]
    rebalancing: str = "incremental"
    device: str = "cpu"
    gpus: int = 1
    partitions: int = 8
    rate: float = 40.0  # states/s offered, all along
    dwell_s: float = 3.0
    # The embedded broker (noida-db 0.2.3) never expires a member whose heartbeats stopped: there the run ends a killed
    # worker's membership itself once its session timeout has passed, as Kafka's coordinator would (``_expire``).
    expire_killed_members: bool = False
    settle_timeout_s: float = 180.0
    worker_flags: list[str] = field(default_factory=lambda: ["--max-batch", "8", "--max-wait-ms", "50"])


class Pool:
    """The run's worker processes, each logging JSON to its own file."""

    def __init__(self, setup: ScaleOut, name: str, topics: Topics) -> None:
        self.setup, self.name, self.topics = setup, name, topics
        self.processes: dict[int, subprocess.Popen] = {}
        self.alive: set[int] = set()

    def worker_id(self, i: int) -> str:
        return f"{self.name}-w{i}"

    def log_path(self, i: int) -> Path:
        return self.setup.workdir / f"{self.worker_id(i)}.log"

    def events(self) -> dict[str, list[dict]]:
        return {self.worker_id(i): read_log_events(self.log_path(i)) for i in self.processes}

    def start(self, i: int) -> None:
        setup, t = self.setup, self.topics
        env, device = {**os.environ, "PYTHONUNBUFFERED": "1"}, setup.device
        if device.startswith("cuda"):
            env["CUDA_VISIBLE_DEVICES"], device = str(i % max(1, setup.gpus)), "cuda:0"
        args = [sys.executable, "-m", "worker", "worker", "-b", setup.bootstrap, "--model", str(setup.model_dir),
                "--device", device, "--worker-id", self.worker_id(i), "--group", f"{self.name}-group",
                "--states-topic", t.states, "--schemas-topic", t.schemas, "--probabilities-topic", t.probabilities,
                "--dead-letter-topic", t.dead_letter, "--log-format", "json", *self._group_flags(), *setup.worker_flags]
        log = open(self.log_path(i), "ab")
        self.processes[i] = subprocess.Popen(args, env=env, stdout=log, stderr=log, start_new_session=True)
        log.close()
        self.alive.add(i)

    def _group_flags(self) -> list[str]:
        if self.setup.rebalancing == "consumer":
            return ["--group-protocol", "consumer"]
        flags = ["--group-protocol", "classic", "--session-timeout-ms", str(SESSION_TIMEOUT_MS)]
        if self.setup.rebalancing == "eager":
            config = self.setup.workdir / f"{self.name}-eager.toml"
            config.write_text('[kafka]\n"partition.assignment.strategy" = "range"\n')
            flags += ["--config", str(config)]
        return flags

    def signal(self, i: int, sig: int, timeout_s: float = 60.0) -> None:
        os.killpg(self.processes[i].pid, sig)
        self.processes[i].wait(timeout_s)
        self.alive.discard(i)

    def held(self) -> dict[int, set[int]]:
        """The partitions each live worker holds now."""
        events = self.events()
        return {i: held_partitions(events[self.worker_id(i)]) for i in self.alive}

    def wait_settled(self, timeout_s: float) -> None:
        """Until every partition is held by exactly one live worker and each live worker holds some."""
        deadline = time.monotonic() + timeout_s
        while True:
            held = self.held()
            owned = [p for partitions in held.values() for p in partitions]
            if all(held.values()) and sorted(owned) == list(range(self.setup.partitions)):
                return
            dead = [i for i in self.alive if self.processes[i].poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f"worker(s) {dead} exited" if dead else f"the group did not settle in {timeout_s:.0f} s ({held})"
                raise RuntimeError(f"{why}; logs in {self.setup.workdir}")
            time.sleep(0.2)

    def stop_all(self) -> None:
        for i in list(self.alive):
            try:
                self.signal(i, signal.SIGTERM, 30)
            except subprocess.TimeoutExpired:
                self.signal(i, signal.SIGKILL)


class Feeder(threading.Thread):
    """Offers states at a steady rate until stopped; ``ids`` are the states published."""

    def __init__(self, bootstrap: str, topic: str, texts: list[str], rate: float) -> None:
        super().__init__(daemon=True)
        self.bootstrap, self.topic, self.texts, self.rate = bootstrap, topic, texts, rate
        self.ids: list[str] = []
        self.halt = threading.Event()

    def run(self) -> None:
        producer, started = plain_producer(self.bootstrap, linger_ms=5), time.monotonic()
        while not self.halt.is_set():
            due = started + len(self.ids) / self.rate
            if due > time.monotonic():
                time.sleep(min(0.05, due - time.monotonic()))
                continue
            state_id = f"s-{len(self.ids)}"
            value = schemas.encode_state({"state_id": state_id, "schema_id": "scale", "metadata": None,
                                          "state": self.texts[len(self.ids) % len(self.texts)], "event_time": None})
            producer.produce(self.topic, key=state_id.encode(), value=value)
            producer.poll(0)
            self.ids.append(state_id)
        producer.flush(30)


def run_scale_out(setup: ScaleOut) -> dict:
    """Run the steps under load; returns the exactly-once check and ``bench.rebalances.rebalance_table``'s rows."""
    name = f"scale-{setup.rebalancing}-{uuid.uuid4().hex[:8]}"
    topics = Topics(states=f"{name}.states", schemas=f"{name}.schemas", probabilities=f"{name}.probabilities",
                    dead_letter=f"{name}.dead-letter")
    create_topics(setup.bootstrap, topics, setup.partitions)
    put_schema(setup.bootstrap, topics, "scale", setup.schema_file)
    pool, feeder = Pool(setup, name, topics), Feeder(setup.bootstrap, topics.states, setup.texts, setup.rate)
    steps: list[Step] = []
    try:
        steps.append(Step("worker 0 starts", "start", pool.worker_id(0), time.time()))
        pool.start(0)
        pool.wait_settled(setup.settle_timeout_s)
        feeder.start()
        time.sleep(setup.dwell_s)
        for label, action, i in STEPS:
            steps.append(_take_step(pool, label, action, i, setup))
            pool.wait_settled(setup.settle_timeout_s)
            time.sleep(setup.dwell_s)
        end = time.time()
        feeder.halt.set()
        feeder.join(60)
        _wait_committed(setup, pool, topics, f"{name}-group", setup.settle_timeout_s)
        _end_transactions_of_the_killed(setup, pool, [s for s in steps if s.action == "kill"])
        seen = _read_outputs(setup.bootstrap, topics, setup.partitions)
    finally:
        feeder.halt.set()
        pool.stop_all()
    drops = [d for i in pool.processes for d in dropped_states(pool.log_path(i).read_text(errors="replace"))]
    duplicates = sum(1 for count in seen.values() if count > 1)
    return {"rebalancing": setup.rebalancing, "states": len(feeder.ids), "rate": setup.rate,
            "exactly_once": {"ok": not duplicates and seen.keys() == set(feeder.ids), "duplicates": duplicates,
                             "missing": len(set(feeder.ids) - seen.keys()), "unexpected": len(seen.keys() - set(feeder.ids))},
            "rebalances": rebalance_table(pool.events(), drops, steps, end, setup.partitions),
            "logs": str(setup.workdir)}


def _take_step(pool: Pool, label: str, action: str, i: int, setup: ScaleOut) -> Step:
    step = Step(label, action, pool.worker_id(i), time.time())
    if action == "start":
        pool.start(i)
    elif action == "stop":
        pool.signal(i, signal.SIGTERM)
    else:
        step.held_at_kill = pool.held()[i]
        pool.signal(i, signal.SIGKILL)
        step.t = time.time()
        step.unread_bound = _uncommitted(setup, pool.topics, f"{pool.name}-group", step.held_at_kill)
        if setup.expire_killed_members:
            _expire(pool, step)
    return step


def _expire(pool: Pool, killed: Step) -> None:
    """End a killed worker's group membership when its session timeout has passed: a consumer with its static
    membership id (``group.instance.id``) takes its place in the group, which fences the dead member, then leaves."""
    time.sleep(max(0.0, killed.t + SESSION_TIMEOUT_MS / 1000 - time.time()))
    strategy = "range" if pool.setup.rebalancing == "eager" else "cooperative-sticky"
    stand_in = Consumer({"bootstrap.servers": pool.setup.bootstrap, "group.id": f"{pool.name}-group", "log_level": 0,
                         "group.instance.id": killed.worker, "partition.assignment.strategy": strategy,
                         "session.timeout.ms": SESSION_TIMEOUT_MS, "enable.auto.commit": False})
    try:
        stand_in.subscribe([pool.topics.states])
        deadline = time.monotonic() + pool.setup.settle_timeout_s
        while not stand_in.assignment() and time.monotonic() < deadline:
            stand_in.poll(0.05)
        stand_in.unsubscribe()  # a static member leaves the group only by unsubscribing (decider's workers do the same)
        for _ in range(10):
            stand_in.poll(0.05)
    finally:
        stand_in.close()


def _uncommitted(setup: ScaleOut, topics: Topics, group: str, partitions: set[int]) -> int:
    """States of ``partitions`` past the group's committed offsets."""
    # A killed worker's offsets stay in its open transaction until it times out: read past it, not wait on it.
    committed = last_committed(setup.bootstrap, group, [TopicPartition(topics.states, p) for p in partitions])
    consumer = reader_consumer(setup.bootstrap)
    try:
        ends = {p: consumer.get_watermark_offsets(TopicPartition(topics.states, p), timeout=10)[1] for p in partitions}
        return sum(max(0, ends[tp.partition] - max(tp.offset, 0)) for tp in committed)
    finally:
        consumer.close()


def _wait_committed(setup: ScaleOut, pool: Pool, topics: Topics, group: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while _uncommitted(setup, topics, group, set(range(setup.partitions))):
        if time.monotonic() > deadline or not pool.alive:
            raise RuntimeError(f"the live workers did not commit every state in {timeout_s:.0f} s; logs in {setup.workdir}")
        time.sleep(0.5)


def _end_transactions_of_the_killed(setup: ScaleOut, pool: Pool, kills: list[Step]) -> None:
    """Abort a killed worker's open transaction, as Kafka does once its transaction.timeout.ms passes (the embedded
    broker never does: until then read_committed readers stop at it): a producer with its transactional id fences it,
    as the worker restarted with its --worker-id would."""
    for step in kills:
        producer = Producer({"bootstrap.servers": setup.bootstrap, "log_level": 0,
                             "transactional.id": f"decider.{pool.name}-group.{step.worker}"})
        producer.init_transactions(30)
        producer.flush(0)


def _read_outputs(bootstrap: str, topics: Topics, partitions: int, timeout_s: float = 60.0) -> Counter:
    """How often each state id is in the output topics, read whole from offset 0 by a fresh read_committed reader with
    large fetches (the embedded broker's aborted-transaction list makes a reader that starts later skip records)."""
    consumer = whole_pass_reader(bootstrap)
    assigned = [TopicPartition(t, p, OFFSET_BEGINNING) for t in (topics.probabilities, topics.dead_letter)
                for p in range(partitions)]
    consumer.assign(assigned)
    seen, at_end, deadline = Counter(), set(), time.monotonic() + timeout_s
    try:
        while len(at_end) < len(assigned) and time.monotonic() < deadline:
            message = consumer.poll(0.1)
            if message is None:
                continue
            if message.error() is not None:
                if message.error().code() != KafkaError._PARTITION_EOF:
                    raise RuntimeError(message.error().str())
                at_end.add((message.topic(), message.partition()))
                continue
            seen[(message.key() or b"").decode()] += 1
        return seen
    finally:
        consumer.close()


def bench_runs(args, env: dict, model_dir: Path, schema_file: Path, texts: list[str], root: Path) -> dict:
    """``bench/stream_bench.py --scale-out``: one run per rebalancing named, on ``--broker``'s broker, a worker per GPU
    (``args``: the bench's, for the device, GPUs, batch and the states' lengths); prints the table, writes the results."""
    import datetime
    import json

    from bench.rebalances import markdown
    from bench.bench_broker import bench_broker

    wait_ms = args.max_wait_ms[0] if len(args.max_wait_ms) == 1 else 20  # the phases' default list: 20 ms
    flags = ["--max-batch", str(args.max_batch), "--max-wait-ms", str(wait_ms)]
    if args.device.startswith("cuda"):
        flags += ["--warmup-state-tokens", args.warmup_state_tokens]
    results = []
    with bench_broker(args.broker, root / "logs") as broker:
        for rebalancing in args.scale_out.split(","):
            workdir = root / "logs" / rebalancing
            workdir.mkdir(parents=True)
            setup = ScaleOut(broker.bootstrap, model_dir, schema_file, workdir, texts, rebalancing=rebalancing,
                             device=args.device, gpus=args.gpus, partitions=max(8, args.partitions or 0),
                             rate=args.scale_out_rate or (20.0 if args.quick else 1500.0),
                             dwell_s=2.0 if args.quick else 20.0,
                             settle_timeout_s=args.start_timeout, worker_flags=flags,
                             expire_killed_members=args.broker == "embedded")
            results.append(run_scale_out(setup))
            print(json.dumps(results[-1]), flush=True)
    result = {"env": env, "scale_out": results}
    print(markdown(results))
    if not args.quick:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"{datetime.date.today().isoformat()}-{env['gpu'].replace(' ', '-').lower()}-scale-out.json"
        path.write_text(json.dumps(result, indent=1, default=str))
        print(f"wrote {path}")
    return result
