"""The stream benchmark's phases: a phase's topics, schema and worker processes on the shared broker (`Stream`), its
read_committed reader (`Reader`), the load (`produce`), the warmed-up stream (`running_stream`), and what is measured on
it: the throughput phase, a latency phase and its measured window (`latency_window`), each ending with the exactly-once
check. `bench/stream_bench.py` runs them in turn; `bench/capacity.py` runs the throughput phase and latency windows at
several loads.
"""
from __future__ import annotations

import contextlib
import datetime
import functools
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from urllib.request import urlopen

from confluent_kafka import OFFSET_BEGINNING, KafkaError, TopicPartition
from prometheus_client.parser import text_string_to_metric_families

import schemas
from bench import cgroup_cpu, gil_profile, tail_causes
from bench.host_stages import stand_in_command
from bench.stream_windows import (all_workers_window, budget_plan_errors, cycle_timelines, gpu_pipeline,
                                  held_partitions, read_log_events)
from worker.cli.commands import put_schema
from worker.config import Topics
from worker.devbroker.processes import free_port
from worker.kafka_clients import create_topics, plain_producer, reader_consumer


REPO = Path(__file__).resolve().parents[1]
class Stream:
    """One phase's topics, schema and workers on the shared broker."""

    def __init__(self, args, bootstrap: str, model_dir: Path, schema_file: Path, name: str, max_wait_ms: int, logs: Path,
                 latency_budget_ms: int | None = None):
        self.args, self.bootstrap, self.model_dir, self.max_wait_ms, self.logs = args, bootstrap, model_dir, max_wait_ms, logs
        self.latency_budget_ms = latency_budget_ms
        # the workers' way to the broker: through the latency proxy with --broker-delay-ms; the bench's own clients
        # (topics, load, reader) always go straight to it, so that only the worker's round trips pay the delay
        self.worker_bootstrap = getattr(args, "worker_bootstrap", None) or bootstrap
        self.topics = Topics(states=f"{name}.states", schemas=f"{name}.schemas", probabilities=f"{name}.probabilities",
                             dead_letter=f"{name}.dead-letter")
        self.name = name
        create_topics(bootstrap, self.topics, args.partitions)
        put_schema(bootstrap, self.topics, "bench", schema_file)
        self.workers: dict[int, subprocess.Popen] = {}
        self.metrics_ports: dict[int, int] = {}

    def start_worker(self, i: int) -> None:
        args, env = self.worker_args(i)
        log = open(self.log_path(i), "ab")
        if getattr(self.args, "engine", "model") == "stand-in":
            # the worker under bench/host_stages.py, whose stand-in makes each batch's scores ready when the modelled
            # GPU would have them (--device-ms), on a CPU; its snapshots are not read here
            command = stand_in_command(self.args.device_ms, self.logs / f"{self.name}-w{i}.snapshots.jsonl", args)
            env = {**env, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        else:
            command = [sys.executable, "-m", "worker", *args]
        self.workers[i] = subprocess.Popen(command, env=env, cwd=REPO, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                           start_new_session=True)

    def worker_args(self, i: int) -> tuple[list[str], dict[str, str]]:
        """Worker i's ``decider`` arguments (what follows ``python -m worker``) and its environment."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        device, gpu_flags = self.args.device, []
        if device.startswith("cuda"):
            env["CUDA_VISIBLE_DEVICES"] = str(i % max(1, self.args.gpus))
            device = "cuda:0"
            # capture every batch size's graph at the states' lengths when the schema is prepared
            gpu_flags = ["--warmup-state-tokens", self.args.warmup_state_tokens]
        budget_flags = [] if self.latency_budget_ms is None else ["--latency-budget-ms", str(self.latency_budget_ms)]
        t = self.topics
        args = ["worker", "-b", self.worker_bootstrap, "--model", str(self.model_dir),
               "--device", device, "--worker-id", f"{self.name}-w{i}", "--group", f"{self.name}-group",
               "--max-batch", str(self.args.max_batch), "--max-wait-ms", str(self.max_wait_ms),
               "--states-topic", t.states, "--schemas-topic", t.schemas, "--probabilities-topic", t.probabilities,
               "--dead-letter-topic", t.dead_letter, "--log-level", "info", "--log-format", "json",
               "--metrics-port", str(self.metrics_ports.setdefault(i, free_port())), *gpu_flags, *budget_flags]
        return args, env

    def log_path(self, i: int) -> Path:
        """Worker i's log (a restarted worker appends to it)."""
        return self.logs / f"{self.name}-w{i}.log"

    def worker_events(self) -> list[list[dict]]:
        """Each worker's logged events so far (``bench.stream_windows.log_events``)."""
        return [read_log_events(self.log_path(i)) for i in sorted(self.workers)]

    def wait_for_group(self, timeout_s: float) -> None:
        """Wait until every worker holds partitions, so that a phase's load meets the whole group (a worker that
        joins later triggers a rebalance inside the phase)."""
        deadline = time.time() + timeout_s
        while not all(held_partitions(events) for events in self.worker_events()):
            exited = [i for i, p in self.workers.items() if p.poll() is not None]
            if exited or time.time() > deadline:
                why = f"worker(s) {exited} exited" if exited else f"not every worker held partitions within {timeout_s} s"
                raise SystemExit(f"{why}; see {self.logs}")
            time.sleep(0.2)

    def worker_stage_totals(self, i: int) -> dict[str, tuple[float, float]]:
        """Worker i's Prometheus histograms of its stages: name -> (sum of seconds or states, count)."""
        text = urlopen(f"http://127.0.0.1:{self.metrics_ports[i]}/metrics", timeout=5).read().decode()
        totals = {}
        for family in text_string_to_metric_families(text):
            if family.name in STAGES:
                # the GC histogram has one series per generation: only full (generation 2) collections matter here
                values = {sample.name.rsplit("_", 1)[-1]: sample.value for sample in family.samples
                          if sample.name.endswith(("_sum", "_count")) and sample.labels.get("generation", "2") == "2"}
                totals[family.name] = (values.get("sum", 0.0), values.get("count", 0.0))
            elif family.name in COUNTERS:
                totals[family.name] = (sum(s.value for s in family.samples if s.name.endswith("_total")
                                           and s.labels.get("outcome", "committed") == "committed"), 1.0)
            elif family.name == "decider_engine_batches":
                # graph captures so far: a capture inside a measured phase is a stall of ~0.1-0.5 s
                totals["captures"] = next((s.value for s in family.samples if s.labels.get("path") == "captures"), 0.0)
        return totals

    def kill_worker(self, i: int) -> None:
        os.killpg(self.workers[i].pid, signal.SIGKILL)
        self.workers[i].wait()

    def stop(self) -> None:
        for p in self.workers.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.workers.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)


STAGES = {"decider_batch_fill_wait_seconds": "fill_wait_ms", "decider_batch_launch_seconds": "launch_ms",
          "decider_engine_seconds": "engine_ms",
          "decider_transaction_commit_seconds": "commit_ms", "decider_cycle_seconds": "cycle_ms", "decider_batch_states": "batch_states",
          "decider_gc_pause_seconds": "full_gc_ms"}


COUNTERS = {"decider_latency_budget_misses": "budget_misses", "decider_transactions": "transactions"}


def stage_means(before: dict, after: dict) -> dict[str, float]:
    """Mean of each worker stage between two scrapes (ms for times, states for batch sizes), and the graph captures
    between them."""
    means = {}
    for name, label in STAGES.items():
        (s0, c0), (s1, c1) = before.get(name, (0.0, 0.0)), after.get(name, (0.0, 0.0))
        if c1 > c0:
            means[label] = round((s1 - s0) / (c1 - c0) * (1 if label == "batch_states" else 1000), 2)
    means["graph_captures"] = int(after.get("captures", 0) - before.get("captures", 0))
    for name, label in COUNTERS.items():
        means[label] = int(after.get(name, (0.0, 0.0))[0] - before.get(name, (0.0, 0.0))[0])
    gc0, gc1 = before.get("decider_gc_pause_seconds", (0.0, 0.0)), after.get("decider_gc_pause_seconds", (0.0, 0.0))
    means["full_gc_collections"] = int(gc1[1] - gc0[1])
    return means


class Reader(threading.Thread):
    """read_committed reader of a phase's outputs: when each record became visible, and how often each id shows."""

    def __init__(self, bootstrap: str, topics: Topics, partitions: int):
        super().__init__(daemon=True)
        self.consumer = reader_consumer(bootstrap)
        self.consumer.assign([TopicPartition(t, p, OFFSET_BEGINNING) for t in (topics.probabilities, topics.dead_letter)
                              for p in range(partitions)])
        self.topics = topics
        self.seen: Counter = Counter()
        self.visible: list[tuple[float, str, int | None]] = []     # (wall time, state id, event time ms)
        self.scored_at: dict[str, int] = {}                          # state id -> when its record was built (ms)
        self.source: dict[str, tuple[int, int]] = {}                 # state id -> its input (partition, offset)
        self.dead = 0
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            msg = self.consumer.poll(0.05)
            if msg is None or msg.error() is not None:
                if msg is not None and msg.error().code() != KafkaError._PARTITION_EOF:
                    raise RuntimeError(msg.error().str())
                continue
            now = time.time()
            if msg.topic() == self.topics.probabilities:
                rec = schemas.decode_probability(msg.value())
                sid, event = rec["state_id"], _ms(rec.get("event_time"))
                self.scored_at[sid] = _ms(rec.get("scored_at"))
                self.source[sid] = (rec["source_partition"], rec["source_offset"])
            else:
                sid, event = (msg.key() or b"").decode(), None
                self.dead += 1
            self.seen[sid] += 1
            self.visible.append((now, sid, event))
        self.consumer.close()

    def wait_for(self, n: int, timeout_s: float) -> bool:
        deadline = time.time() + timeout_s
        while len(self.visible) < n and time.time() < deadline:
            time.sleep(0.05)
        return len(self.visible) >= n


def _ms(value) -> int | None:
    if value is None:
        return None
    return int(value.timestamp() * 1000) if isinstance(value, datetime.datetime) else int(value)


def state_event(state_id: str, text: str, event_time_ms: int) -> bytes:
    """decider's own input: a StateEvent of the bench's schema, in Avro."""
    return schemas.encode_state({"state_id": state_id, "schema_id": "bench", "state": text, "event_time": event_time_ms,
                                 "metadata": None})


def produce(bootstrap: str, topic: str, ids: list[str], texts: list[str], rate: float | None = None,
            on_progress=None, value_of=state_event) -> None:
    """Produce states (event time = now) as ``value_of(state id, text, event time ms)`` makes them; `rate` states/s, or
    as fast as possible. Paced at a rate, each record is sent at once (linger.ms 0, as a latency-sensitive producer
    would): the producer's linger would otherwise be part of every measured latency, before the worker could see the
    record."""
    producer = _paced_producer(bootstrap) if rate else plain_producer(bootstrap, linger_ms=5)
    if rate:
        producer.list_topics(topic, timeout=10)
    t0 = time.time()
    for k, (sid, text) in enumerate(zip(ids, texts)):
        if rate:
            delay = t0 + k / rate - time.time()
            if delay > 0:
                time.sleep(delay)
        producer.produce(topic, key=sid.encode(), value=value_of(sid, text, int(time.time() * 1000)))
        producer.poll(0)
        if on_progress:
            on_progress(k + 1)
    producer.flush(30)


@functools.cache
def _paced_producer(bootstrap: str):
    """One producer per broker for every paced window, the topic's metadata fetched before each (``produce``): a new
    one holds its first ~0.5 s of records until it is ready, then sends them at once, half a second old (bench/README.md,
    runs DI and DJ)."""
    return plain_producer(bootstrap, linger_ms=0)


def exactly_once(reader: Reader, ids: list[str]) -> dict:
    expected = set(ids)
    dupes = sum(1 for s, c in reader.seen.items() if c > 1)
    missing = len(expected - reader.seen.keys())
    extra = len(reader.seen.keys() - expected)
    return dict(ok=dupes == 0 and missing == 0 and extra == 0, duplicates=dupes, missing=missing, unexpected=extra,
                dead_letters=reader.dead)


def warm_up(args, stream: Stream, reader: Reader, texts: list[str]) -> list[str]:
    ids = [f"warm-{i}" for i in range(2 * args.max_batch)]
    produce(stream.bootstrap, stream.topics.states, ids, texts[:len(ids)])
    if not reader.wait_for(len(ids), args.start_timeout):
        raise SystemExit(f"workers did not score the warm-up states within {args.start_timeout} s; see {stream.logs}")
    return ids


@contextlib.contextmanager
def running_stream(args, bootstrap, model_dir, schema_file, texts, logs, name: str, max_wait_ms: int,
                   latency_budget_ms: int | None = None):
    """A phase's topics, its reader and its warmed-up workers -> (stream, reader, warm-up ids); stops them after."""
    stream = Stream(args, bootstrap, model_dir, schema_file, name, max_wait_ms, logs, latency_budget_ms)
    reader = Reader(bootstrap, stream.topics, args.partitions)
    reader.start()
    for i in range(args.workers):
        stream.start_worker(i)
    try:
        stream.wait_for_group(args.start_timeout)
        yield stream, reader, warm_up(args, stream, reader, texts)
    finally:
        reader.halt.set()
        stream.stop()
        _paced_producer.cache_clear()     # its broker may stop with the phase: no producer retrying it for ever


def throughput_phase(args, bootstrap, model_dir, schema_file, texts, logs) -> dict:
    with running_stream(args, bootstrap, model_dir, schema_file, texts, logs, "tput", args.max_wait_ms[-1]) as (
            stream, reader, warm_ids):
        ids = [f"s-{i}" for i in range(args.states)]
        start_seen = len(reader.visible)
        before = stream.worker_stage_totals(0)
        killed = threading.Event()

        def maybe_kill(k: int) -> None:
            if args.kill_one and not killed.is_set() and k >= 0.4 * args.states:
                killed.set()
                stream.kill_worker(0)
                threading.Timer(1.0, stream.start_worker, args=(0,)).start()

        produce(bootstrap, stream.topics.states, ids, [texts[i % len(texts)] for i in range(args.states)],
                on_progress=maybe_kill)
        reader.wait_for(start_seen + args.states, args.states / 5 + 120)
        time.sleep(1.0)                      # anything extra (a duplicate) would show up by now
        times = sorted(t for t, sid, _ in reader.visible[start_seen:])
        lo, hi = times[int(0.1 * (len(times) - 1))], times[int(0.9 * (len(times) - 1))]
        rate = (0.8 * (len(times) - 1)) / (hi - lo) if hi > lo else float("nan")
        # the part of the 10%-90% window in which every worker was in steady state, from the workers' own logs
        window = all_workers_window(stream.worker_events(), times, lo, hi)
        # a killed worker 0 restarts with fresh metrics: its stage means are not comparable then
        stages = {} if args.kill_one else stage_means(before, stream.worker_stage_totals(0))
        return dict(phase="throughput", workers=args.workers, states=args.states, states_per_s=rate, **window,
                    killed_and_restarted=bool(args.kill_one), worker0_stage_means=stages,
                    **exactly_once(reader, warm_ids + ids))


class GilSampler(threading.Thread):
    """py-spy on worker 0 over a latency phase's measured window (after its warm-up), in the background."""

    def __init__(self, stream: Stream, args) -> None:
        super().__init__(daemon=True)
        self.pid, self.delay_s, self.seconds = stream.workers[0].pid, args.latency_warmup_seconds, args.latency_seconds
        self.raw_path = stream.logs / f"{stream.name}-w0.gil.txt"
        self.summary: dict = {"error": "not sampled"}
        self.start()

    def run(self) -> None:
        time.sleep(self.delay_s)
        self.summary = gil_profile.finish(gil_profile.record(self.pid, self.seconds, self.raw_path), self.raw_path,
                                          self.seconds)

    def result(self) -> dict:
        self.join(self.seconds + self.delay_s + 90)
        return self.summary


def latency_phase(args, bootstrap, model_dir, schema_file, texts, logs, max_wait_ms: int, rate: float,
                  latency_budget_ms: int | None = None) -> dict:
    """States at `rate`; with `latency_budget_ms`, workers run with that budget and --max-wait-ms as its cap."""
    name = f"lat{max_wait_ms}" if latency_budget_ms is None else f"budget{latency_budget_ms}"
    with running_stream(args, bootstrap, model_dir, schema_file, texts, logs, name, max_wait_ms, latency_budget_ms) as (
            stream, reader, warm_ids):
        window = latency_window(args, stream, reader, texts, rate, "l", latency_budget_ms,
                                gil_profile=args.gil_profile and latency_budget_ms is not None)
        ids = window.pop("ids")
        return dict(phase="latency", workers=args.workers, max_wait_ms=max_wait_ms, **window,
                    **exactly_once(reader, warm_ids + ids))


def latency_window(args, stream: Stream, reader: Reader, texts: list[str], rate: float, tag: str,
                   latency_budget_ms: int | None = None, gil_profile: bool = False) -> dict:
    """One measured window on a running stream: --latency-warmup-seconds of states at `rate` (not measured), then
    --latency-seconds more (ids `tag-i`, measured); returns when all of them are visible (or after 120 s).

    The result's "ids" are every id it produced, for the caller's exactly-once check."""
    # The first --latency-warmup-seconds at the offered rate are not measured: small batches of new sizes are
    # first seen there, and each new (batch, length) bucket captures a CUDA graph once (~0.1-0.5 s).
    steady = [f"{tag}w-{i}" for i in range(int(rate * args.latency_warmup_seconds))]
    n = max(20, int(rate * args.latency_seconds))
    ids = [f"{tag}-{i}" for i in range(n)]
    start_seen = len(reader.visible)
    before = stream.worker_stage_totals(0)
    throttled_before = cgroup_cpu.throttling()
    measured_from = time.time() + args.latency_warmup_seconds
    gil = GilSampler(stream, args) if gil_profile else None
    produce(stream.bootstrap, stream.topics.states, steady + ids, [texts[i % len(texts)] for i in range(len(steady) + n)],
            rate=rate)
    reader.wait_for(start_seen + len(steady) + n, 120)
    # the whole window, warm-up included: the counters are the container's, read from here
    throttled = cgroup_cpu.throttled_between(throttled_before, cgroup_cpu.throttling())
    stages = stage_means(before, stream.worker_stage_totals(0))
    measured = [(1000 * t, sid, ev) for t, sid, ev in reader.visible[start_seen:] if ev is not None
                and sid.startswith(f"{tag}-")]
    lat = sorted(t - ev for t, _, ev in measured)
    # where the time goes: event -> record built (consume, batch fill, scoring), built -> visible (commit, reader)
    to_scored = [reader.scored_at[sid] - ev for _, sid, ev in measured]
    to_visible = [t - reader.scored_at[sid] for t, sid, _ in measured]
    events = stream.worker_events() if latency_budget_ms is not None else []   # every worker's log, read once
    budget = {} if latency_budget_ms is None else dict(
        latency_budget_ms=latency_budget_ms, over_budget=sum(t > latency_budget_ms for t in lat),
        worker0_cycles_over_budget=stages.get("budget_misses"), worker0_cycles=stages.get("transactions"),
        worker0_plans=budget_plan_errors(events[0], latency_budget_ms, since=measured_from),
        worker0_timelines=cycle_timelines(events[0], latency_budget_ms, since=measured_from),
        worker0_pipeline=gpu_pipeline(events[0], since=measured_from),
        tail_causes=window_tail(events, reader, start_seen, tag, latency_budget_ms, stream.args),
        **({"worker0_gil": gil.result()} if gil is not None else {}))
    if not lat:
        raise SystemExit(f"window {tag}: none of its {n} measured states became visible within 120 s; see {stream.logs}")
    return dict(offered_states_per_s=rate, states=n, measured_visible=len(lat), unmeasured_warmup_states=len(steady),
                p50_ms=statistics.median(lat), p99_ms=lat[int(0.99 * (len(lat) - 1))], max_ms=lat[-1], **budget,
                over_target=sum(t > stream.max_wait_ms + 30 for t in lat), p50_to_scored_ms=statistics.median(to_scored),
                p50_scored_to_visible_ms=statistics.median(to_visible), worker0_stage_means=stages,
                **({"cpu_throttled": throttled} if throttled is not None else {}), ids=steady + ids)


def window_tail(events: list[list[dict]], reader: Reader, start_seen: int, tag: str, budget_ms: float, args) -> dict:
    """``bench.tail_causes``' table of a window's states over the budget (those the reader saw since ``start_seen``
    with ids ``tag-i``), from every worker's ``events`` and the JVM's pauses in ``args.broker_log`` (Apache Kafka's)."""
    states = [tail_causes.LateState(ev, 1000 * t, *reader.source[sid], measured=sid.startswith(f"{tag}-"))
              for t, sid, ev in reader.visible[start_seen:] if ev is not None and sid in reader.source]
    return tail_causes.window_causes(events, states, budget_ms, not args.device.startswith("cuda"),
                                     tail_causes.broker_pauses(getattr(args, "broker_log", None)))
