"""Deterministic scoring on a CUDA device (run on the GPU machine: pytest -m gpu): with
`Engine.load(..., deterministic=True)` in bfloat16 with CUDA graphs, a state's probabilities are bit-identical
(torch.equal) whatever batch it is scored in: batches of 1/2/7/32/61/128, shuffled (random neighbours and positions),
64/128/256-token states mixed (so its length bucket follows its neighbours), packed and independent schemas.
It holds once the deterministic CUDA kernel table is batch-invariant (`engine.kernels.select_kernels`)."""
import random

import pytest
import torch

from engine import Engine, SchemaEngine

from .conftest import make_questions

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

TOKENS = (64, 128, 256)
PER_LENGTH = 70                       # 210 states
BATCHES = (2, 7, 32, 61, 128)


@pytest.fixture(scope="module")
def det_se(tiny_dir):
    return SchemaEngine(Engine.load(tiny_dir, device="cuda", dtype="bfloat16", deterministic=True), use_graphs=True)


def exact_states(tok, n: int, tokens: int, seed: int) -> list[str]:
    """n texts of `tokens` tokens each under this tokenizer."""
    from bench.engine_bench import states
    return states(tok, n, tokens, seed)


@pytest.mark.parametrize("independent", [False, True], ids=["packed", "independent"])
def test_a_state_scores_the_same_bits_in_any_batch_on_the_gpu(det_se, independent):
    tok = det_se.e.tok
    states = [s for n in TOKENS for s in exact_states(tok, PER_LENGTH, n, seed=n)]
    h = det_se.prepare(make_questions([2, 3, 4, 4, 8], temperatures=[0.5, 1.0, 1.0, 1.3, 2.0]), independent=independent)
    rows = [det_se.tokenize(h, s) for s in states]
    alone = [det_se.score_rows(h, [r])[0] for r in rows]
    for batch in BATCHES:
        order = list(range(len(rows)))
        random.Random(batch).shuffle(order)
        differ, worst = [], 0.0
        for start in range(0, len(order), batch):
            idx = order[start:start + batch]
            for i, p in zip(idx, det_se.score_rows(h, [rows[i] for i in idx])):
                if not torch.equal(p, alone[i]):
                    differ.append(i)
                    worst = max(worst, (p - alone[i]).abs().max().item())
        assert not differ, f"batches of {batch}: {len(differ)} of {len(rows)} states differ from alone (max {worst:.2e})"
    stats = det_se.graph_stats()
    assert stats["replays"] > 0 and stats["eager"] == 0, stats
