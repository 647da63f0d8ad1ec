"""A second worker started with the same --worker-id takes over; the first exits non-zero with a message
saying why, and no state is output twice: on every consumer group protocol the broker has (the producer's epoch
fences the older one whatever the group does: on the classic protocol the newer takes the older's static id, on the
consumer protocol both are members of their own until the older's next transaction fails)."""

from __future__ import annotations

from collections import Counter

import pytest

from tests import brokers
from tests.worker.conftest import QUESTIONS, state_texts


@pytest.mark.parametrize("protocol", brokers.group_protocols())
def test_duplicate_worker_id_fences_the_older_instance(stream, model_dir, protocol):
    stream.put_schema("tickets", QUESTIONS)
    stream.produce_states([(f"a-{i}", t) for i, t in enumerate(state_texts(10, seed=2))], "tickets")
    older = stream.start_worker(model_dir, "twin", "--group-protocol", protocol)
    stream.collect(10, settle_s=0)
    newer = stream.start_worker(model_dir, "twin", "--group-protocol", protocol)
    newer.wait_for_log("assigned", timeout_s=90)
    stream.produce_states([(f"b-{i}", t) for i, t in enumerate(state_texts(10, seed=3))], "tickets")

    assert older.process.wait(60) == 3, older.log()
    assert "fenced" in older.log() and "--worker-id twin" in older.log()
    assert "Traceback" not in older.log()
    probabilities, dead = stream.collect(20, settle_s=1.0)
    counts = Counter(r["state_id"] for r in probabilities)
    assert len(counts) == 20 and set(counts.values()) == {1} and not dead
    assert newer.stop() == 0, newer.log()
