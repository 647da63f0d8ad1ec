"""End-to-end stream benchmark: embedded broker + N `decider worker` processes + a load generator.

    python bench/stream_bench.py                      # GPU: 0.8B-shaped model, 1 worker, max-wait 5/20/50 ms
    python bench/stream_bench.py --workers 2          # one worker per GPU (CUDA_VISIBLE_DEVICES=i each)
    python bench/stream_bench.py --workers 2 --kill-one   # SIGKILL worker 0 mid-stream, restart it, verify exactly-once
    python bench/stream_bench.py --quick              # CPU, tiny model, small (tests/bench runs it)
    python bench/stream_bench.py --scale-out          # workers 1 -> 3 -> 1 under load, eager vs incremental
                                                      # rebalancing (bench/scale_out.py), one worker per GPU

Phases, each on its own set of topics so they never mix; each starts its workers, waits until every one holds
partitions (from their `--log-format json` logs), then scores a warm-up before anything is measured:
1. engine only: the same model and shape scored in-process by `SchemaEngine.score_rows` at --max-batch (the ceiling
   the stream should approach);
2. throughput: N states produced as fast as the producer goes; sustained states/s = the rate at which scored
   records become visible to a read_committed reader, between 10% and 90% of them (start-up and tail excluded);
   with --kill-one, worker 0 is SIGKILLed at 40% and restarted with the same --worker-id. Inside that window, the
   all-workers window starts once every worker has committed since its last assignment (from the workers' logs,
   `bench.stream_windows`): the aggregate rate there, each worker's own committed records per second there, and the
   time between the first and the last worker getting partitions;
3. latency, once per --max-wait-ms: states produced at --latency-load x the measured throughput; latency of a state =
   the moment its record becomes visible to a read_committed reader - its event time (set when it was produced);
   then once per --latency-budget-ms B, the same with workers run with `--latency-budget-ms B --max-wait-ms B`:
   how many states were visible later than B after their event time, and how many cycles the worker itself counted
   as over the budget (it measures from when it consumed a cycle's first state, so it cannot see time in Kafka).
   With --gil-profile, py-spy samples worker 0's GIL holder over each budget phase's measured window
   (`bench/gil_profile.py`): which thread held the GIL for what share of the time, and where;
4. with --replay: `decider replay` of the first latency phase's states topic (live, small deadline-cut batches) into
   new topics at full batches: its scoring rate as it reports it (from `replay_started`, so schema preparation and
   graph capture count), its steady rate from its first commit to its last and the seconds before that first commit
   (from its own log), and whether every replayed record's probabilities equal the live record's bit for bit (what
   deterministic scoring promises).
Every phase ends with the exactly-once check: each input state id appears exactly once across the probabilities
and dead-letter topics, and nothing else does.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import signal
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from urllib.request import urlopen

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import schemas  # noqa: E402
from bench import capacity, gil_profile  # noqa: E402
from bench.engine_bench import QWEN35_08B, questions, states  # noqa: E402
from bench.stream_windows import (all_workers_window, budget_plan_errors, cycle_timelines, gpu_pipeline,  # noqa: E402
                                  held_partitions, log_events, read_log_events, replay_timing)
from worker.cli.commands import put_schema  # noqa: E402
from worker.config import Topics  # noqa: E402
from worker.devbroker.embedded_broker import EmbeddedBroker, free_port  # noqa: E402
from worker.kafka_clients import create_topics, plain_producer, reader_consumer  # noqa: E402

from confluent_kafka import OFFSET_BEGINNING, KafkaError, TopicPartition  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

# The engine benchmark's Qwen3.5-0.8B shape with the offline test tokenizer's vocabulary (the worker loads a tokenizer
# from the model directory, and the real Qwen3.5 BPE ships only in tiktoken form). Token counts of the shape (state,
# prefix) are measured with that tokenizer, so the work per state matches the engine benchmark.
SHAPE_08B = {**{k: v for k, v in QWEN35_08B.items() if k != "vocab_size"}, "initializer_range": 0.02}


def write_model(args, root: Path) -> Path:
    from engine.testing import write_tiny_model
    return write_tiny_model(root / "model", seed=0, **({} if args.quick else SHAPE_08B))


def schema_document(tok, n_questions: int, n_options: int, prefix_tokens: int) -> dict:
    """The engine benchmark's questions (padded to `prefix_tokens`) as a schema file, with question ids."""
    return {"mode": "packed", "questions": [{"id": f"q{i}", **q} for i, q in
                                            enumerate(questions(tok, n_questions, n_options, prefix_tokens))]}


def engine_only(args, model_dir: Path, document: dict, texts: list[str]) -> float:
    """States/s of the engine alone at --max-batch on this device, warmed up."""
    import torch
    from engine import Engine, SchemaEngine
    eng = Engine.load(model_dir, device="cuda" if args.device.startswith("cuda") else "cpu")
    se = SchemaEngine(eng)
    h = se.prepare(document["questions"])
    rows = [se.tokenize(h, t) for t in texts[:args.max_batch]]
    for _ in range(2):
        se.score_rows(h, rows)
    n, t = 0, time.perf_counter()
    while time.perf_counter() - t < args.engine_seconds:
        se.score_rows(h, rows)
        n += len(rows)
    rate = n / (time.perf_counter() - t)
    del se, h, eng
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rate


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
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        device, gpu_flags = self.args.device, []
        if device.startswith("cuda"):
            env["CUDA_VISIBLE_DEVICES"] = str(i % max(1, self.args.gpus))
            device = "cuda:0"
            # capture every batch size's graph at the states' lengths when the schema is prepared
            gpu_flags = ["--warmup-state-tokens", self.args.warmup_state_tokens]
        budget_flags = [] if self.latency_budget_ms is None else ["--latency-budget-ms", str(self.latency_budget_ms)]
        t = self.topics
        cmd = [sys.executable, "-m", "worker", "worker", "-b", self.worker_bootstrap, "--model", str(self.model_dir),
               "--device", device, "--worker-id", f"{self.name}-w{i}", "--group", f"{self.name}-group",
               "--max-batch", str(self.args.max_batch), "--max-wait-ms", str(self.max_wait_ms),
               "--states-topic", t.states, "--schemas-topic", t.schemas, "--probabilities-topic", t.probabilities,
               "--dead-letter-topic", t.dead_letter, "--log-level", "info", "--log-format", "json",
               "--metrics-port", str(self.metrics_ports.setdefault(i, free_port())), *gpu_flags, *budget_flags]
        log = open(self.log_path(i), "ab")
        self.workers[i] = subprocess.Popen(cmd, env=env, stdout=log, stderr=log, start_new_session=True)

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


def produce(bootstrap: str, topic: str, ids: list[str], texts: list[str], rate: float | None = None,
            on_progress=None) -> None:
    """Produce states (event time = now); `rate` states/s, or as fast as possible. Paced at a rate, each record is
    sent at once (linger.ms 0, as a latency-sensitive producer would): the producer's linger would otherwise be part
    of every measured latency, before the worker could see the record."""
    producer = plain_producer(bootstrap, linger_ms=0 if rate else 5)
    t0 = time.time()
    for k, (sid, text) in enumerate(zip(ids, texts)):
        if rate:
            delay = t0 + k / rate - time.time()
            if delay > 0:
                time.sleep(delay)
        value = schemas.encode_state({"state_id": sid, "schema_id": "bench", "state": text,
                                      "event_time": int(time.time() * 1000), "metadata": None})
        producer.produce(topic, key=sid.encode(), value=value)
        producer.poll(0)
        if on_progress:
            on_progress(k + 1)
    producer.flush(30)


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
    measured_from = time.time() + args.latency_warmup_seconds
    gil = GilSampler(stream, args) if gil_profile else None
    produce(stream.bootstrap, stream.topics.states, steady + ids, [texts[i % len(texts)] for i in range(len(steady) + n)],
            rate=rate)
    reader.wait_for(start_seen + len(steady) + n, 120)
    stages = stage_means(before, stream.worker_stage_totals(0))
    measured = [(1000 * t, sid, ev) for t, sid, ev in reader.visible[start_seen:] if ev is not None
                and sid.startswith(f"{tag}-")]
    lat = sorted(t - ev for t, _, ev in measured)
    # where the time goes: event -> record built (consume, batch fill, scoring), built -> visible (commit, reader)
    to_scored = [reader.scored_at[sid] - ev for _, sid, ev in measured]
    to_visible = [t - reader.scored_at[sid] for t, sid, _ in measured]
    budget = {} if latency_budget_ms is None else dict(
        latency_budget_ms=latency_budget_ms, over_budget=sum(t > latency_budget_ms for t in lat),
        worker0_cycles_over_budget=stages.get("budget_misses"), worker0_cycles=stages.get("transactions"),
        worker0_plans=budget_plan_errors(stream.worker_events()[0], latency_budget_ms, since=measured_from),
        worker0_timelines=cycle_timelines(stream.worker_events()[0], latency_budget_ms, since=measured_from),
        worker0_pipeline=gpu_pipeline(stream.worker_events()[0], since=measured_from),
        **({"worker0_gil": gil.result()} if gil is not None else {}))
    if not lat:
        raise SystemExit(f"window {tag}: none of its {n} measured states became visible within 120 s; see {stream.logs}")
    return dict(offered_states_per_s=rate, states=n, measured_visible=len(lat), unmeasured_warmup_states=len(steady),
                p50_ms=statistics.median(lat), p99_ms=lat[int(0.99 * (len(lat) - 1))], max_ms=lat[-1], **budget,
                over_target=sum(t > stream.max_wait_ms + 30 for t in lat), p50_to_scored_ms=statistics.median(to_scored),
                p50_scored_to_visible_ms=statistics.median(to_visible), worker0_stage_means=stages, ids=steady + ids)


def read_records(bootstrap: str, topic: str, partitions: int, expected: int, timeout_s: float = 60) -> dict:
    """state id -> the probability record, for `expected` records of a topic (read_committed)."""
    consumer = reader_consumer(bootstrap)
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)])
    records, deadline = {}, time.time() + timeout_s
    try:
        while len(records) < expected and time.time() < deadline:
            msg = consumer.poll(0.2)
            if msg is not None and msg.error() is None:
                rec = schemas.decode_probability(msg.value())
                records[rec["state_id"]] = rec
    finally:
        consumer.close()
    return records


def compare_probabilities(live: dict, replayed: dict) -> dict:
    """Bit-for-bit comparison of the probabilities of the states present in both."""
    common = live.keys() & replayed.keys()
    equal, max_abs = 0, 0.0
    for sid in common:
        a = [p for q in live[sid]["questions"] for p in q["probabilities"]]
        b = [p for q in replayed[sid]["questions"] for p in q["probabilities"]]
        equal += a == b
        max_abs = max(max_abs, max(abs(x - y) for x, y in zip(a, b)))
    return dict(compared=len(common), bit_identical=equal, max_abs_diff=max_abs)


def replay_phase(args, bootstrap, model_dir, live_name: str, logs) -> dict:
    """Replay a live phase's states at full batches into new topics; its rate and its agreement with the live records."""
    live = Topics(states=f"{live_name}.states", schemas=f"{live_name}.schemas",
                  probabilities=f"{live_name}.probabilities", dead_letter=f"{live_name}.dead-letter")
    out = Topics(states=live.states, schemas=live.schemas, probabilities=f"{live_name}.replay.probabilities",
                 dead_letter=f"{live_name}.replay.dead-letter")
    create_topics(bootstrap, out, args.partitions)
    device = "cuda:0" if args.device.startswith("cuda") else "cpu"
    gpu_flags = ["--warmup-state-tokens", args.warmup_state_tokens] if device != "cpu" else []
    cmd = [sys.executable, "-m", "worker", "replay", "-b", bootstrap, "--model", str(model_dir), "--device", device,
           "--name", f"bench-{live_name}", "--states-topic", live.states, "--schemas-topic", live.schemas,
           "--output-topic", out.probabilities, "--dead-letter-topic", out.dead_letter,
           "--max-batch", str(args.max_batch), "--log-format", "json", *gpu_flags]
    launched = time.time()
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=args.states / 5 + 300)
    process_s = time.time() - launched
    (logs / f"replay-{live_name}.log").write_bytes(done.stdout)
    # the last line is the replay's summary: "replay NAME: complete; N states scored, ... (R states/s) -> topic"
    summary = next((line for line in reversed(done.stdout.decode(errors="replace").splitlines())
                    if line.startswith(f"replay bench-{live_name}: ")), "")
    rate = float(summary.rsplit("(", 1)[1].split(" states/s")[0]) if "states/s" in summary else float("nan")
    scored = int(summary.split("; ", 1)[1].split(" states scored")[0]) if "states scored" in summary else 0
    live_records = read_records(bootstrap, live.probabilities, args.partitions, scored)
    replayed = read_records(bootstrap, out.probabilities, args.partitions, scored)
    # states_per_s is the replay's own figure (from replay_started: schema preparation and graph capture included);
    # steady_states_per_s counts from its first commit to its last
    timing = replay_timing(log_events(done.stdout.decode(errors="replace")))
    return dict(phase="replay", of=live_name, exit_code=done.returncode, summary=summary, states_per_s=rate,
                **timing, process_s=process_s, states=scored, **compare_probabilities(live_records, replayed))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="CPU, tiny model, a few hundred states")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--gpus", type=int, default=None, help="GPUs to spread workers over (default: all visible)")
    ap.add_argument("--kill-one", action="store_true", help="SIGKILL worker 0 at 40%% of the throughput phase, restart it")
    ap.add_argument("--states", type=int, default=None)
    ap.add_argument("--state-tokens", type=int, default=128)
    ap.add_argument("--questions", type=int, default=10)
    ap.add_argument("--options", type=int, default=4)
    ap.add_argument("--prefix-tokens", type=int, default=400)
    ap.add_argument("--max-batch", type=int, default=None)
    ap.add_argument("--max-wait-ms", default=None, help="comma-separated; the latency phase runs once per value")
    ap.add_argument("--latency-budget-ms", default=None,
                    help="comma-separated; after the --max-wait-ms phases, a latency phase per value with workers run "
                         "with --latency-budget-ms B --max-wait-ms B (default: 25,50,100; none with --quick)")
    ap.add_argument("--latency-load", type=float, default=0.5, help="offered load as a fraction of the throughput")
    ap.add_argument("--latency-rate", type=float, default=None, help="offered states/s (instead of --latency-load)")
    ap.add_argument("--latency-seconds", type=float, default=None)
    ap.add_argument("--latency-warmup-seconds", type=float, default=None,
                    help="load at the offered rate before latencies are measured (first-sight graph captures)")
    ap.add_argument("--partitions", type=int, default=None)
    ap.add_argument("--gil-profile", action="store_true",
                    help="sample worker 0's GIL holder with py-spy during each budget phase's measured window "
                         "(bench/gil_profile.py): worker0_gil in the phase's result, the raw samples beside its log")
    ap.add_argument("--replay", action="store_true",
                    help="after the latency phases, replay the first one's states at full batches and compare records")
    ap.add_argument("--engine-seconds", type=float, default=None)
    ap.add_argument("--capacity", action="store_true",
                    help="measure each --latency-budget-ms's capacity instead of the phases above (bench/capacity.py)")
    ap.add_argument("--capacity-loads", default=None,
                    help="comma-separated offered loads, fractions of the full-load rate (default 0.3,0.4,...,0.9,0.95)")
    ap.add_argument("--capacity-samples", type=int, default=2, help="measured windows per load")
    ap.add_argument("--broker-delay-ms", type=float, default=0.0,
                    help="with --capacity: the workers reach the broker through bench/latency_proxy.py, this much each way")
    ap.add_argument("--start-timeout", type=float, default=300)
    ap.add_argument("--scale-out", default=None, metavar="REBALANCING",
                    help="instead of the phases above: bench/scale_out.py's run (workers 1 -> 3 -> 1 under load) once "
                         "per comma-separated rebalancing, e.g. eager,incremental")
    ap.add_argument("--scale-out-rate", type=float, default=None,
                    help="states/s offered during --scale-out (default 1500: 75%% of one H200; 20 with --quick)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    import torch
    cuda = torch.cuda.is_available() and not args.quick
    args.device = args.device or ("cuda" if cuda else "cpu")
    args.gpus = args.gpus or (torch.cuda.device_count() if args.device.startswith("cuda") else 1)
    args.states = args.states or (120 if args.quick else 20000)
    args.max_batch = args.max_batch or (16 if args.quick else 128)
    args.max_wait_ms = [int(x) for x in (args.max_wait_ms or ("20" if args.quick else "5,20,50")).split(",")]
    budgets = args.latency_budget_ms if args.latency_budget_ms is not None else (
        "50" if args.quick and args.capacity else "" if args.quick else "25,50,100")
    args.latency_budget_ms = [int(x) for x in budgets.split(",") if x.strip()]
    for flag, values in (("--max-wait-ms", args.max_wait_ms), ("--latency-budget-ms", args.latency_budget_ms)):
        if len(set(values)) != len(values):
            # a phase's topics and consumer group are named by its value: a repeat would read the earlier phase's
            # topics and count its records as duplicates
            ap.error(f"{flag}: each value at most once ({values}); run the bench again for another sample")
    args.capacity_loads = ([float(x) for x in args.capacity_loads.split(",")] if args.capacity_loads
                           else [0.3, 0.6] if args.quick else list(capacity.DEFAULT_LOADS))
    if args.broker_delay_ms and not args.capacity:
        ap.error("--broker-delay-ms is measured by --capacity runs only")
    args.latency_seconds = args.latency_seconds or (3 if args.quick else 8 if args.capacity else 15)
    args.latency_warmup_seconds = (args.latency_warmup_seconds if args.latency_warmup_seconds is not None
                                   else (1 if args.quick else 2 if args.capacity else 5))
    args.partitions = args.partitions or max(4, 2 * args.workers)
    if args.partitions < args.workers:
        print(f"stream_bench: --partitions {args.partitions} is fewer than --workers {args.workers}: a worker without "
              "partitions idles and every phase waits for all of them to hold some; give at least one per worker",
              file=sys.stderr)
        raise SystemExit(2)
    args.engine_seconds = args.engine_seconds or (2 if args.quick else 5)
    if args.quick:
        args.state_tokens, args.questions, args.prefix_tokens = 24, 3, 60

    root = Path(tempfile.mkdtemp(prefix="decider-stream-bench-"))
    logs = root / "logs"
    logs.mkdir()
    model_dir = write_model(args, root)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    document = schema_document(tok, args.questions, args.options, args.prefix_tokens)
    schema_file = root / "schema.json"
    schema_file.write_text(json.dumps(document))
    texts = states(tok, 256, args.state_tokens, seed=3)
    # up to --state-tokens each (a few tokens short where a word would not fit): their suffixes can fall into two
    # length buckets, and a graph first captured mid-phase stalls the stream (with kernels compiled for a new length,
    # for seconds), so the workers warm up both ends
    lengths = [len(tok.encode(t, add_special_tokens=False)) for t in texts]
    args.warmup_state_tokens = ",".join(str(n) for n in sorted({min(lengths), max(lengths)}))
    env = dict(date=datetime.date.today().isoformat(), device=args.device,
               gpu=torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu",
               workers=args.workers, gpus=args.gpus, partitions=args.partitions, max_batch=args.max_batch,
               state_tokens=args.state_tokens, questions=args.questions, options=args.options,
               model="tiny (engine.testing)" if args.quick else "Qwen3.5-0.8B-shaped random weights, test tokenizer")
    print(json.dumps(env), flush=True)
    if args.scale_out:
        from bench.scale_out import bench_runs
        return bench_runs(args, env, model_dir, schema_file, texts, root)
    one_engine = engine_only(args, model_dir, document, texts)
    engine_rate = one_engine * (args.workers if args.device.startswith("cuda") else 1)
    print(f"engine only: {engine_rate:,.1f} states/s (x{args.workers} workers on GPUs)", flush=True)
    # The reader thread stamps when each record becomes visible; a full collection walking torch's and transformers'
    # objects in this process (~0.2 s) would stamp late and count as latency. Same remedy as the worker's, its young
    # threshold included (the reader's records would otherwise be promoted and trigger full collections).
    from worker.stream.gc_pauses import freeze_loaded_objects
    freeze_loaded_objects()
    if args.capacity:
        return capacity_result(args, capacity.capacity_run(args, env, engine_rate, model_dir, schema_file, texts, logs))
    runs = []
    with EmbeddedBroker(port=free_port(), log=open(logs / "broker.log", "ab")) as broker:
        tput = throughput_phase(args, broker.bootstrap, model_dir, schema_file, texts, logs)
        tput["fraction_of_engine"] = tput["states_per_s"] / engine_rate
        if tput["all_workers_states_per_s"] is not None:
            tput["all_workers_fraction_of_engine"] = tput["all_workers_states_per_s"] / engine_rate
        # the latency phases' load is a fraction of what the whole group sustains
        sustained = tput["all_workers_states_per_s"] or tput["states_per_s"]
        runs.append(tput)
        print(json.dumps(tput), flush=True)
        for mw in args.max_wait_ms:
            lat = latency_phase(args, broker.bootstrap, model_dir, schema_file, texts, logs, mw,
                                args.latency_rate or args.latency_load * sustained)
            runs.append(lat)
            print(json.dumps(lat), flush=True)
        for budget in args.latency_budget_ms:
            lat = latency_phase(args, broker.bootstrap, model_dir, schema_file, texts, logs, budget,
                                args.latency_rate or args.latency_load * sustained, latency_budget_ms=budget)
            runs.append(lat)
            print(json.dumps(lat), flush=True)
        if args.replay:
            rep = replay_phase(args, broker.bootstrap, model_dir, f"lat{args.max_wait_ms[0]}", logs)
            # one replay process on one GPU, whatever the live phases' worker count
            rep["fraction_of_engine"] = rep["states_per_s"] / one_engine
            if rep["steady_states_per_s"] is not None:
                rep["steady_fraction_of_engine"] = rep["steady_states_per_s"] / one_engine
            runs.append(rep)
            print(json.dumps(rep), flush=True)
    result = dict(env=env, engine_only_states_per_s=engine_rate, runs=runs, logs=str(logs))
    print(markdown(result))
    if not args.quick:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        kill = "-kill" if args.kill_one else ""
        path = out / f"{env['date']}-{env['gpu'].replace(' ', '-').lower()}-stream-{args.workers}w{kill}.json"
        path.write_text(json.dumps(result, indent=1))
        shutil.copytree(logs, path.with_suffix(".logs"), dirs_exist_ok=True)   # the workers' and broker's own account
        print(f"wrote {path} and its logs")
    return result


def capacity_result(args, result: dict) -> dict:
    """Print a capacity run's table; on a GPU keep its JSON, its PNG (where matplotlib is installed) and its logs."""
    print(capacity.markdown(result))
    if args.quick:
        return result
    env, out = result["env"], Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{env['date']}-{env['gpu'].replace(' ', '-').lower()}-capacity-delay{args.broker_delay_ms:g}ms.json"
    path.write_text(json.dumps(result, indent=1))
    shutil.copytree(result["logs"], path.with_suffix(".logs"), dirs_exist_ok=True)
    try:
        capacity.plot(result, path.with_suffix(".png"))
    except ImportError:
        print("matplotlib is not installed here: render the PNG with python bench/capacity.py --plot", path)
    print(f"wrote {path}")
    return result


def markdown(result: dict) -> str:
    env = result["env"]
    lines = [f"{env['gpu']}, {env['workers']} worker(s), {env['partitions']} partitions, max batch {env['max_batch']}, "
             f"{env['state_tokens']}-token states, {env['questions']} questions x {env['options']} options; "
             f"engine only: {result['engine_only_states_per_s']:,.1f} states/s", "",
             "| phase | max wait ms | budget ms | states/s | steady states/s | p50 ms | p99 ms | over budget | exactly once "
             "| dead letters |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for r in result["runs"]:
        if r["phase"] == "replay":
            lines.append(f"| replay of {r['of']} | | | {r['states_per_s']:,.1f} | {_num(r['steady_states_per_s'])} | | | "
                         f"| bit-identical to live: {r['bit_identical']}/{r['compared']} (max diff "
                         f"{r['max_abs_diff']:.3g}) | exit {r['exit_code']} |")
            notes.append(f"replay: {_num(r['startup_s'], 2)} s from replay_started to its first commit, then "
                         f"{_num(r['steady_states_per_s'])} states/s over {_num(r['first_to_last_commit_s'], 2)} s "
                         f"to its last; the process ran {r['process_s']:.1f} s")
            continue
        if r["phase"] == "throughput":
            per_worker = ", ".join(_num(x) for x in r["per_worker_states_per_s"] or [])
            notes.append(f"throughput: all {r['workers']} worker(s) steady over {_num(r['all_workers_window_s'], 2)} s "
                         f"of the 10-90% window ({_num(r['all_workers_window_cut_s'], 2)} s cut before it; "
                         f"{r['rebalances_in_window']} rebalance events in it); per worker: [{per_worker}] states/s; "
                         f"partitions reached the last worker {_num(r['assignment_spread_s'], 2)} s after the first")
        rate = r.get("states_per_s", r.get("offered_states_per_s"))
        over = f"{r['over_budget']}/{r['states']}" if "over_budget" in r else ""
        lines.append(f"| {r['phase']}{' (kill+restart)' if r.get('killed_and_restarted') else ''} | {r.get('max_wait_ms', '')} "
                     f"| {r.get('latency_budget_ms', '')} | {rate:,.1f} | {_num(r.get('all_workers_states_per_s'))} "
                     f"| {r.get('p50_ms', float('nan')):.1f} "
                     f"| {r.get('p99_ms', float('nan')):.1f} | {over} "
                     f"| {'yes' if r['ok'] else 'NO: ' + json.dumps(r)} | {r['dead_letters']} |")
    return "\n".join(lines + [""] + notes)


def _num(value: float | None, digits: int = 1) -> str:
    """A figure for the table; empty when not measured."""
    return "" if value is None else f"{value:,.{digits}f}"


if __name__ == "__main__":
    main()
