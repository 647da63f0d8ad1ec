"""Exactly once under failure: SIGKILL the worker at random points (mid-batch, mid-commit) while states keep
arriving, restart it with the same --worker-id, and check what a read_committed reader sees: every input
exactly once across the probabilities and dead-letter topics, and nothing else."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter

import pytest

from tests import brokers
from tests.worker.conftest import QUESTIONS, Stream, encode_state, feed_states, state_texts


def _inputs(n: int, seed: int) -> list[tuple[str, bytes]]:
    rnd = random.Random(seed)
    inputs = []
    for i, text in enumerate(state_texts(n, seed=seed)):
        state_id = f"x-{i}"
        if rnd.random() < 0.05:  # a few dead letters in the mix: they are outputs too
            inputs.append((state_id, encode_state(state_id, "no-such-schema", text)))
        else:
            inputs.append((state_id, encode_state(state_id, "tickets", text)))
    return inputs


def run_chaos(stream: Stream, model_dir, n_states: int, kills: int, seed: int, protocol: str = "classic") -> None:
    rnd = random.Random(seed)
    stream.put_schema("tickets", QUESTIONS)
    inputs = _inputs(n_states, seed)
    fed = threading.Event()
    feeder = threading.Thread(target=feed_states, args=(stream, inputs, fed), daemon=True)
    feeder.start()
    flags = ("--schema-wait-ms", "200", "--log-level", "debug", "--max-batch", str(rnd.choice([4, 8, 16])),
             "--group-protocol", protocol)
    for attempt in range(kills):
        worker = stream.start_worker(model_dir, "chaos", *flags)
        worker.wait_for_log("assigned", timeout_s=90)
        time.sleep(rnd.uniform(0.1, 2.5))  # somewhere in consuming, scoring or committing
        worker.kill()
    feeder.join(120)
    assert fed.is_set()
    survivor = stream.start_worker(model_dir, "chaos", *flags)
    probabilities, dead = stream.collect(n_states, timeout_s=120 + 0.25 * n_states, settle_s=2.0)

    seen = Counter([r["state_id"] for r in probabilities] + [d["state_id"] for d in dead])
    duplicates = {k: v for k, v in seen.items() if v > 1}
    assert not duplicates, f"states output more than once: {duplicates}"
    assert set(seen) == {state_id for state_id, _ in inputs}, f"missing: {sorted(set(s for s, _ in inputs) - set(seen))[:10]}"
    assert {d["reason"] for d in dead} <= {"unknown_schema"}
    assert stream.committed_offsets() == stream.end_offsets()
    assert survivor.stop() == 0, survivor.log()


@pytest.mark.parametrize("protocol", brokers.group_protocols())
def test_sigkill_at_random_points_then_restart_outputs_each_state_exactly_once(stream, model_dir, protocol):
    """With the same --worker-id the restarted worker is the same static member: it takes its partitions back."""
    run_chaos(stream, model_dir, n_states=240, kills=3, seed=11, protocol=protocol)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [21, 22, 23])
def test_sigkill_soak(stream_factory, model_dir, seed):
    run_chaos(stream_factory(partitions=3), model_dir, n_states=1500, kills=10, seed=seed)
