"""The cached path equals the full-forward oracle (tiny model, CPU float32)."""
import pytest
import torch

from engine import MAX_OPTIONS
from engine.reference import score_full

from .conftest import make_questions, make_states

ATOL = 1e-4          # on probabilities; measured ~1e-5 (the chunked delta rule splits at other points)
ALL_OPTION_COUNTS = list(range(2, 9))   # 2..8 at every batch size here; 9..26 and 64 questions: test_wide_schemas.py


def assert_valid(probs: torch.Tensor, n_options: list[int]) -> None:
    assert torch.allclose(probs.sum(-1), torch.ones(probs.shape[:-1]), atol=1e-5)
    for q, k in enumerate(n_options):
        assert (probs[..., q, k:] == 0).all(), "options past a question's count must be exactly 0"
        assert (probs[..., q, :k] > 0).all()


@pytest.mark.parametrize("independent", [False, True], ids=["packed", "independent"])
@pytest.mark.parametrize("batch", [1, 5, 70])
def test_cached_equals_oracle(eng, se, independent, batch):
    qs = make_questions(ALL_OPTION_COUNTS, temperatures=[0.5, 1.0, 2.0, 0.8, 1.3, 1.0, 0.3])
    states = make_states(batch, seed=batch)
    h = se.prepare(qs, independent=independent)
    got = torch.stack(se.score(h, states))
    want = torch.stack(score_full(eng, qs, states, independent=independent))
    assert got.shape == (batch, len(qs), MAX_OPTIONS)
    assert (got - want).abs().max().item() < ATOL
    assert_valid(got, ALL_OPTION_COUNTS)


def test_probabilities_depend_on_the_state(se):
    """Guards the tiny model's usefulness for parity: a cache bug must move probabilities visibly."""
    h = se.prepare(make_questions([2, 4]))
    a, b = se.score(h, ["the box was damaged and nobody answered", "login failed latency spike"])
    assert (a - b).abs().max().item() > 1e-2


def test_explicit_temperatures_override_the_schema(eng, se):
    qs = make_questions([3, 4], temperatures=[0.5, 2.0])
    states = make_states(4, seed=7)
    h = se.prepare(qs)
    for t in (0.25, [3.0, 0.7]):
        got = torch.stack(se.score(h, states, temperature=t))
        want = torch.stack(score_full(eng, qs, states, temperature=t))
        assert (got - want).abs().max().item() < ATOL
    sharp, flat = se.score(h, states[:1], temperature=0.1)[0], se.score(h, states[:1], temperature=10.0)[0]
    assert sharp[0].max() > flat[0].max()


def test_chat_template_layout(eng):
    from engine import QWEN_CHAT, SchemaEngine

    se_chat = SchemaEngine(eng, chat=QWEN_CHAT)
    qs = make_questions([2, 5])
    states = make_states(6, seed=3)
    got = torch.stack(se_chat.score(se_chat.prepare(qs), states))
    want = torch.stack(score_full(eng, qs, states, chat=QWEN_CHAT))
    assert (got - want).abs().max().item() < ATOL


def test_truncated_states_match_the_oracle(eng, se):
    qs = make_questions([2, 3])
    states = make_states(3, seed=11, max_words=200)
    h = se.prepare(qs)
    assert any(se.tokenize(h, s, max_ctx_tokens=40).truncated for s in states)
    got = torch.stack(se.score(h, states, max_ctx_tokens=40))
    want = torch.stack(score_full(eng, qs, states, max_ctx_tokens=40))
    assert (got - want).abs().max().item() < ATOL


def test_tokenizing_through_the_rust_backend_gives_transformers_ids(eng):
    """`engine.prompt` encodes with the fast tokenizer's Rust backend (half the per-state cost); it must give what
    transformers' `encode` gives, special tokens and unusual text included, or the cache and the oracle would
    both drift from what users' own code tokenizes."""
    from engine.prompt import _encode

    texts = [*make_states(20, seed=5), "", " ", "a  b\t\nc", "naïve café — “quotes” 🙂 日本語",
             "user wrote <|im_start|>system\nignore this<|im_end|> inside a state", "<|endoftext|>", "x" * 3000]
    for text in texts:
        assert _encode(eng.tok, text) == eng.tok.encode(text, add_special_tokens=False), text


@pytest.mark.parametrize("answer_rows_only", [True, False], ids=["answer-rows", "every-token"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_last_layer_on_the_answer_rows_equals_the_whole_pass_at_those_rows(tiny_dir, deterministic, answer_rows_only,
                                                                           monkeypatch):
    """`layers(..., rows=)` runs the last layer's MLP on the given tokens alone: their hidden states are the whole
    pass's at those tokens (bit for bit with the batch-invariant kernels, whose rows do not depend on the row count)."""
    from engine import Engine, model
    from engine.model import CausalContext

    monkeypatch.setattr(model, "ANSWER_ROWS_ONLY", answer_rows_only)
    fwd = Engine.load(tiny_dir, device="cpu", dtype="float32", deterministic=deterministic).forward
    g = torch.Generator().manual_seed(5)
    B, T = 3, 23
    ids = torch.randint(0, fwd.core.embed_tokens.num_embeddings, (B, T), generator=g)
    pos = torch.arange(T)[None].expand(B, -1)
    rows = torch.tensor([4, 22, 23 + 7, 2 * 23 + 22, 2 * 23 + 3])
    whole = fwd.layers(ids, pos, CausalContext())
    some = fwd.layers(ids, pos, CausalContext(), rows=rows)
    assert some.shape == (len(rows), whole.shape[-1])
    want = whole.reshape(-1, whole.shape[-1])[rows]
    if deterministic:
        assert torch.equal(some, want)
    else:
        torch.testing.assert_close(some, want, atol=1e-5, rtol=1e-5)


def test_residual_adds_fused_into_the_projections_still_equal_the_oracle(tiny_dir, monkeypatch):
    """`engine.model.FUSED_RESIDUAL` with a table that has `add_linear` (the CUDA table's, here on the CPU): each
    residual add goes into the projection before it, two a layer, and the scores stay within the oracle's tolerance;
    a table without `add_linear` ignores the setting."""
    from dataclasses import replace

    from engine import Engine, SchemaEngine, model
    from engine.kernels.pytorch import torch_add_linear

    qs = make_questions([2, 3, 4])
    states = make_states(6, seed=3)
    eng = Engine.load(tiny_dir, device="cpu", dtype="float32")
    se = SchemaEngine(eng)
    plain = torch.stack(se.score(se.prepare(qs), states))
    monkeypatch.setattr(model, "FUSED_RESIDUAL", True)
    ignored = SchemaEngine(eng)
    assert torch.equal(torch.stack(ignored.score(ignored.prepare(qs), states)), plain)   # no add_linear: unchanged
    calls = []

    def add_linear(h, x, weight):
        calls.append(x.shape[:-1])
        return torch_add_linear(h, x, weight)

    eng.forward.kernels = replace(eng.forward.kernels, add_linear=add_linear)
    fused = SchemaEngine(eng)
    handle = fused.prepare(qs)
    calls.clear()
    got = torch.stack(fused.score(handle, states))
    assert len(calls) == 2 * len(eng.forward.core.layers)                 # one suffix pass: both adds of every layer
    assert (got - torch.stack(score_full(eng, qs, states))).abs().max().item() < ATOL


def test_add_linear_adds_the_projection_into_the_residual_in_place_rounding_once():
    from engine.kernels.pytorch import torch_add_linear

    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 5, 16, generator=g).bfloat16()
    x, w = torch.randn(2, 5, 24, generator=g).bfloat16(), torch.randn(16, 24, generator=g).bfloat16()
    want = (h.float() + x.float() @ w.float().t())
    out = torch_add_linear(h, x, w)
    assert out.data_ptr() == h.data_ptr() and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), want, atol=0.05, rtol=1e-2)       # one bf16 rounding of the exact sum
