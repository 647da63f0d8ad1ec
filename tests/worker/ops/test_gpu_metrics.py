"""Engine-path metrics on a CUDA device (run on the GPU machine: pytest -m gpu): batches go through captured
CUDA graphs, so /metrics counts graph captures and replays (on CPU both stay 0: tests/worker/ops/test_metrics.py), and
a capture on the stream's path is logged."""

from __future__ import annotations

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

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    paths = {s.labels["path"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
             if s.name == "decider_engine_batches"}
    assert paths["captures"] >= 1 and paths["replays"] >= 1, paths
    # no --warmup-state-tokens: the captures happened on the stream's path, and the log says what they cost
    assert "captured a CUDA graph on the stream's path" in worker.log(), worker.log()
    assert worker.stop() == 0, worker.log()
