"""The worker on a CUDA device (run on the GPU machine: pytest -m gpu): the same end-to-end contract as the
CPU test, with the engine's CUDA-graph path under the Kafka loop."""

from __future__ import annotations

import pytest
import torch

from tests.worker.conftest import QUESTIONS, state_texts


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_worker_on_cuda_scores_like_schema_engine(stream, model_dir):
    from engine import Engine, SchemaEngine
    from worker.formats.records import engine_questions, question_schema_record

    n = 48
    texts = state_texts(n, seed=13)
    stream.put_schema("tickets", QUESTIONS)
    stream.produce_states([(f"s-{i}", t) for i, t in enumerate(texts)], "tickets")
    worker = stream.start_worker(model_dir, "gpu-0", "--device", "cuda", "--dtype", "float32", "--max-batch", "16",
                                 "--warmup-state-tokens", "32,64")
    probabilities, dead = stream.collect(n, timeout_s=180, settle_s=1.0)
    assert not dead and sorted(r["state_id"] for r in probabilities) == sorted(f"s-{i}" for i in range(n)), worker.log()

    se = SchemaEngine(Engine.load(model_dir, device="cuda", dtype="float32"))
    handle = se.prepare(engine_questions(question_schema_record(QUESTIONS, "ref", 1)))
    expected = [[row[:k] for row, k in zip(p.tolist(), handle.n_options)] for p in se.score(handle, texts)]
    for record in probabilities:
        i = int(record["state_id"].split("-")[1])
        for question, want in zip(record["questions"], expected[i]):
            assert question["probabilities"] == pytest.approx(want, abs=1e-4)
    # the worker's first schema: its graphs (batches 1-16 at 32 and 64 tokens) captured when it was prepared
    assert "CUDA graphs captured before its first batch" in worker.log(), worker.log()
    assert "on the stream's path" not in worker.log(), worker.log()
    assert worker.stop() == 0, worker.log()
