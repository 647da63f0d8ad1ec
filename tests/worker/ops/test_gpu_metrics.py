"""Engine-path metrics on a CUDA device (run on the GPU machine: pytest -m gpu): batches go through captured
CUDA graphs, so /metrics counts graph captures and replays (on CPU both stay 0: tests/worker/ops/test_metrics.py), and
no capture happens on the stream's path: the worker's engine captures beside it."""

from __future__ import annotations

import time
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from tests.worker.conftest import QUESTIONS, state_texts
from worker.devbroker.processes import free_port


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graph_captures_and_replays_are_exported(stream, model_dir):
    port = free_port()
    n = 64
    stream.put_schema("tickets", QUESTIONS)
    stream.produce_states([(f"g-{i}", t) for i, t in enumerate(state_texts(n, seed=21))], "tickets")
    worker = stream.start_worker(model_dir, "gpu-metrics", "--device", "cuda", "--max-batch", "16", "--metrics-port", str(port))
    probabilities, dead = stream.collect(n, timeout_s=180, settle_s=1.0)
    assert len(probabilities) == n and not dead, worker.log()
    # no --warmup-state-tokens: nothing was captured when the schema was prepared; the first batches of each shape
    # ran eagerly, and their graphs were captured beside the stream, never on its path
    more, total = [(f"h-{i}", t) for i, t in enumerate(state_texts(n, seed=21))], n
    paths = _engine_paths(port)
    while paths.get("replays", 0) < 1 and more:
        time.sleep(1.0)
        batch, more = more[:16], more[16:]
        stream.produce_states(batch, "tickets")             # the same lengths again, now on their graphs
        total += len(batch)
        assert len(stream.collect(total, timeout_s=60, settle_s=0.2)[0]) == total, worker.log()
        paths = _engine_paths(port)
    assert paths["captures"] >= 1 and paths["replays"] >= 1 and paths["eager"] >= 1, paths
    assert paths["inline"] == 0, paths
    assert "captured a CUDA graph on the stream's path" not in worker.log(), worker.log()
    assert "CUDA graphs in the background" in worker.log(), worker.log()
    assert worker.stop() == 0, worker.log()


def _engine_paths(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {s.labels["path"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "decider_engine_batches"}
