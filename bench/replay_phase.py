"""The stream benchmark's replay phase (`stream_bench.py --replay`): `decider replay` of a live phase's states topic
into new topics at full batches, its rate, and whether every replayed record's probabilities equal the live record's
bit for bit.
"""
from __future__ import annotations

import subprocess
import sys
import time

from confluent_kafka import OFFSET_BEGINNING, TopicPartition

import schemas
from bench.stream_windows import log_events, replay_timing
from worker.config import Topics
from worker.kafka_clients import create_topics, reader_consumer


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
    """Replay a live phase's states at full batches into new topics; its rate and its agreement with the live
    records."""
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
           "--max-batch", str(args.max_batch), "--log-format", "json", "--no-progress", *gpu_flags]  # commits at info
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
