"""The label mass on a CUDA device (pytest -m gpu): the 0.8B shape in bf16 with Qwen3.5's whole vocabulary (248,320
tokens), with graphs; its log-sum-exp by the fused kernel (`engine.kernels.vocab_logsumexp`, the default) and by 31
chunks, the last one padded (`engine.label_mass.FUSED` off).

With the deterministic kernels a state's label mass is bit-identical alone and in shuffled batches of other sizes, and
graph replays equal eager steps, on either path; a step that computes the mass gives the probabilities the step
without it gives; the mass agrees with the oracle's full softmax to bf16 rounding. The fused kernel's log-sum-exp is
torch's of the float32 logits, agrees with the chunks' (bf16 logits), and gives a row its bits at any row count from
1 to 1,300 and any position."""
import random

import pytest
import torch

from engine import Engine, SchemaEngine
from engine import label_mass as lm

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from bench.workload import QWEN35_08B, questions, states  # noqa: E402
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


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "chunked"])
def test_label_mass_is_bit_identical_in_any_batch_and_in_graphs(engine, texts, fused, monkeypatch):
    monkeypatch.setattr(lm, "FUSED", fused)
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


def _normed_rows(engine, S: int, seed: int) -> torch.Tensor:
    """Final-normed hidden rows [S, hidden] in bf16, as the read-out passes them (scaled up: logits of std ~2.5)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(S, engine.cfg.hidden_size, device="cuda", generator=g, dtype=torch.bfloat16) * 4
    return engine.forward.final_norm(h) * 4


def test_the_fused_logsumexp_is_torchs_and_agrees_with_the_chunks(engine):
    kernels = engine.forward.kernels
    assert kernels.vocab_logsumexp is not None
    x = _normed_rows(engine, 1300, seed=5)
    fused = engine.vocab.logsumexp(x, kernels.linear, kernels.row_logsumexp, kernels.vocab_logsumexp)
    chunked = engine.vocab.logsumexp(x, kernels.linear, kernels.row_logsumexp)
    w = engine.vocab.weight.float()
    want = torch.cat([torch.logsumexp(part.float() @ w.T, -1) for part in x.split(256)])
    torch.testing.assert_close(fused, want, rtol=1e-5, atol=1e-4)          # float32 logits, another summation order
    torch.testing.assert_close(chunked, want, rtol=1e-3, atol=1e-3)        # bf16 logits
    assert (fused - want).abs().max() <= (chunked - want).abs().max()


def test_the_fused_logsumexp_gives_a_row_its_bits_at_any_row_count_and_position(engine):
    """One tile at every row count (`engine.kernels.vocab_logsumexp.vocab_config`): probe rows alone and among random
    neighbours at row counts around the 128-row block and up to batch 128's 1,280 answers and beyond."""
    fused, w = engine.forward.kernels.vocab_logsumexp, engine.vocab.weight
    probe = _normed_rows(engine, 4, seed=7)
    alone = torch.cat([fused(probe[i:i + 1], w, w.shape[0]) for i in range(4)])
    positions = random.Random(8)
    for S in (4, 10, 80, 127, 128, 129, 320, 640, 1280, 1300):
        block = _normed_rows(engine, S, seed=S)
        for at in {0, S - 4, positions.randrange(S - 3), positions.randrange(S - 3)}:
            neighbours = block[at:at + 4].clone()
            block[at:at + 4] = probe
            assert torch.equal(fused(block, w, w.shape[0])[at:at + 4], alone), (S, at)
            block[at:at + 4] = neighbours


def test_the_fused_and_chunked_label_mass_agree(engine, texts, monkeypatch):
    qs = questions(engine.tok, 10, 4, 400)
    got = {}
    for fused in (True, False):
        monkeypatch.setattr(lm, "FUSED", fused)
        se = SchemaEngine(engine)
        got[fused] = torch.stack([d.label_mass for d in se.score_details(se.prepare(qs), texts[:16])])
    torch.testing.assert_close(got[True], got[False], rtol=5e-3, atol=1e-7)   # the chunks' logits are bf16
