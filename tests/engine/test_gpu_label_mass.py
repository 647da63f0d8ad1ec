"""The label mass on a CUDA device (pytest -m gpu): the 0.8B shape in bf16 with Qwen3.5's whole vocabulary (248,320
tokens: 31 chunks of the log-sum-exp, the last one padded), with graphs.

With the deterministic kernels a state's label mass is bit-identical alone and in shuffled batches of other sizes, and
graph replays equal eager steps; a step that computes the mass gives the probabilities the step without it gives;
the mass agrees with the oracle's full softmax to bf16 rounding."""
import random

import pytest
import torch

from engine import Engine, SchemaEngine

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from bench.engine_bench import QWEN35_08B, questions, states  # noqa: E402
from engine.reference import score_full_details  # noqa: E402

BATCHES = (2, 7, 32)


@pytest.fixture(scope="module")
def engine():
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from engine.testing import build_tokenizer
    tok = build_tokenizer()                        # ids below its size; the model's vocabulary is the real one's
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**QWEN35_08B, pad_token_id=tok.pad_token_id))
    return Engine(model.to(torch.bfloat16).eval(), tok, model_id="0.8b-shaped", deterministic=True)


@pytest.fixture(scope="module")
def texts(engine):
    return [t for n, seed in ((64, 1), (128, 2)) for t in states(engine.tok, 24, n, seed)]


def test_the_whole_vocabulary_is_read_in_padded_chunks(engine):
    assert len(engine.vocab.chunks) == 31 and engine.vocab.valid[-1] == 248_320 - 30 * 8192


def test_label_mass_is_bit_identical_in_any_batch_and_in_graphs(engine, texts):
    se = SchemaEngine(engine)
    h = se.prepare(questions(engine.tok, 10, 4, 400))
    alone = [se.score_details(h, [t])[0] for t in texts]
    assert se.graph_stats()["replays"] > 0
    for size in BATCHES:
        order = list(range(len(texts)))
        random.Random(size).shuffle(order)
        for start in range(0, len(order), size):
            chunk = order[start:start + size]
            for i, got in zip(chunk, se.score_details(h, [texts[i] for i in chunk])):
                assert torch.equal(got.label_mass, alone[i].label_mass), f"batch {size}, state {i}"
                assert torch.equal(got.probabilities, alone[i].probabilities), f"batch {size}, state {i}"
    eager = SchemaEngine(engine, use_graphs=False)
    he = eager.prepare(questions(engine.tok, 10, 4, 400))
    for t, a in zip(texts[:8], alone):
        assert torch.equal(eager.score_details(he, [t])[0].label_mass, a.label_mass)


def test_the_label_mass_leaves_the_probabilities_and_matches_the_oracle(engine, texts):
    qs = questions(engine.tok, 10, 4, 400)
    with_mass, without = SchemaEngine(engine), SchemaEngine(engine, label_mass=False)
    h1, h2 = with_mass.prepare(qs), without.prepare(qs)
    got = with_mass.score_details(h1, texts[:16])
    plain = without.score(h2, texts[:16])
    assert all(torch.equal(g.probabilities, p) for g, p in zip(got, plain))
    want = score_full_details(engine, qs, texts[:16])
    mass, oracle = torch.stack([g.label_mass for g in got]), torch.stack([w.label_mass for w in want])
    assert ((mass > 0) & (mass <= 1)).all()
    torch.testing.assert_close(mass, oracle, rtol=0.1, atol=1e-7)         # bf16 logits: ~1% on exp(logit - lse)
