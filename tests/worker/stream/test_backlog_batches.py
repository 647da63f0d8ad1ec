"""--max-wait-ms bounds how long a batch waits for more states, not how many already-fetched states it takes: a worker
that starts behind a backlog scores it in full batches. (Stopping at the deadline capped batches at what one
deadline's worth of routing allowed: with --max-wait-ms 0, one state per transaction.)"""

from __future__ import annotations

import json

from tests.worker.conftest import QUESTIONS, state_texts


def test_a_backlog_is_scored_in_full_batches_even_with_no_wait(stream, model_dir):
    n = 48
    stream.put_schema("tickets", QUESTIONS)
    stream.produce_states([(f"b-{i}", t) for i, t in enumerate(state_texts(n, seed=21))], "tickets")
    worker = stream.start_worker(model_dir, "backlog", "--max-wait-ms", "0", "--max-batch", "16", "--log-format", "json")
    probabilities, dead = stream.collect(n, timeout_s=120)
    assert len(probabilities) == n and not dead, worker.log()
    assert worker.stop() == 0, worker.log()
    committed = [e for e in (json.loads(line) for line in worker.log().splitlines() if line.startswith("{"))
                 if e.get("event") == "committed" and e.get("scored")]
    sizes = [e["scored"] for e in committed]
    assert sum(sizes) == n
    # the states were fetched before the first cycle closed: batches fill up (the old loop took one state per cycle)
    assert max(sizes) >= 8 and len(sizes) <= n // 4, sizes
