"""The Triton kernels wired into whole forwards of the tiny model: the fast table's kernels against the oracle, and the
deterministic table's attention giving a state the same bits in any batch. Runs on the GPU, or on a CPU through Triton's
interpreter (`tests/engine/kernels/test_fused.py` says how)."""

import pytest
import torch

from tests.engine.kernels.triton_device import require

ON_GPU, DEV = require()

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("answer_queries", [False, True], ids=["every-query", "answer-queries"])
def test_the_forward_with_these_kernels_matches_the_oracle(tiny_dir, answer_queries, monkeypatch):
    """The Triton kernels wired into the whole forward (in-place residual stream, the conv continuing the prefix's
    state, [B, H, T, D] attention inputs, the one-kernel suffix attention, gated norm on strided z; and with
    `ANSWER_QUERIES`, the last layer's queries at the answer rows alone): the cached engine against transformers'
    forward, float32. The recurrence stays PyTorch here so that it runs in the interpreter too."""
    import dataclasses

    from engine import Engine, SchemaEngine, model
    from engine.kernels.table import torch_kernels
    from engine.reference import score_full
    from engine.kernels.suffix_attention import answer_attention, suffix_attention
    from engine.kernels.causal_conv import conv_qkv
    from engine.kernels.fused import GATED, add_rms_norm, gate_attention, rms_norm_rope, row_norm, swiglu

    from ..conftest import make_questions, make_states

    monkeypatch.setattr(model, "ANSWER_QUERIES", answer_queries)
    eng = Engine.load(tiny_dir, device=DEV, dtype="float32")

    def qk_norm_rope(q, k, qw, kw, cos, sin, eps, q_cos=None, q_sin=None):
        q_cos, q_sin = (cos, sin) if q_cos is None else (q_cos, q_sin)
        return rms_norm_rope(q, qw, q_cos, q_sin, eps), rms_norm_rope(k, kw, cos, sin, eps)

    eng.forward.kernels = dataclasses.replace(
        torch_kernels(), name="triton", conv_qkv=conv_qkv, swiglu=swiglu, rms_norm=row_norm, add_rms_norm=add_rms_norm,
        gated_rms_norm=lambda x, gate, weight, eps: row_norm(x, weight, eps, GATED, gate), qk_norm_rope=qk_norm_rope,
        gate_attention=gate_attention, suffix_attention=suffix_attention,
        answer_attention=_counted(answer_attention, calls := []))
    qs = make_questions([2, 4, 8], temperatures=[0.7, 1.0, 1.5])
    states = make_states(6, seed=11)
    se = SchemaEngine(eng, use_graphs=False)
    for independent in (False, True):
        got = torch.stack(se.score(se.prepare(qs, independent=independent), states))
        want = torch.stack(score_full(eng, qs, states, independent=independent))
        # on CUDA transformers' forward runs fla's kernels, whose tf32 dots are ~1e-3 off (test_gpu.py's float32 test)
        assert (got - want).abs().max().item() < (1e-4 if DEV == "cpu" else 5e-3)
    assert bool(calls) == answer_queries


def _counted(fn, calls: list):
    def counted(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)
    return counted


@pytest.mark.parametrize("answer_split", [1, 2], ids=["answers", "answers-d-split"])
def test_the_deterministic_forward_with_triton_attention_scores_a_state_the_same_in_any_batch(tmp_path, answer_split,
                                                                                              monkeypatch):
    """The deterministic table's attention in a whole forward: the CPU's batch-invariant table with the one-kernel
    suffix attention (launched as the deterministic CUDA table launches it) and the answers' attention in place of its
    row-by-row attention, on an 8-layer tiny model (two full-attention layers: the first runs the suffix kernel, the
    last the answers' kernel, at every batch size, one row included), the answers' launch at a D split too. A state's
    probabilities are the same bits alone and in shuffled batches of other states (other lengths, so other padded
    lengths), packed and independent; and they match the oracle."""
    import dataclasses
    import random

    from engine import Engine, SchemaEngine
    from engine.kernels import suffix_attention as sa
    from engine.kernels.suffix_attention import InvariantSuffixAttention
    from engine.reference import score_full
    from engine.kernels.suffix_attention import answer_attention
    from engine.testing import write_tiny_model

    from ..conftest import make_questions, make_states

    monkeypatch.setattr(sa, "ANSWER_CONFIG", (*sa.ANSWER_CONFIG[:4], answer_split))
    eng = Engine.load(write_tiny_model(tmp_path / "tiny8", seed=3, num_hidden_layers=8), device=DEV, dtype="float32",
                      deterministic=True)
    assert eng.forward.kernels.batch_invariant
    calls = {"suffix": 0, "answers": 0}

    def counted(name, fn):
        def run(*args):
            calls[name] += 1
            return fn(*args)
        return run

    eng.forward.kernels = dataclasses.replace(
        eng.forward.kernels, name="torch-invariant+triton-attention", attend_by_request=False,
        suffix_attention=counted("suffix", InvariantSuffixAttention(None, torch.float32, DEV)),
        answer_attention=counted("answers", answer_attention))
    se = SchemaEngine(eng, use_graphs=False)
    states = make_states(7, seed=31, max_words=25)
    qs = make_questions([2, 3, 5], temperatures=[0.7, 1.0, 1.5])
    for independent in (False, True):
        h = se.prepare(qs, independent=independent)
        alone = [se.score(h, [s])[0] for s in states]
        assert calls["suffix"] and calls["answers"]               # one row: both kernels, as in a batch
        for size in (3, 7):
            order = list(range(len(states)))
            random.Random(size).shuffle(order)
            for start in range(0, len(order), size):
                chunk = order[start:start + size]
                for i, p in zip(chunk, se.score(h, [states[i] for i in chunk])):
                    assert torch.equal(p, alone[i]), (independent, size, i)
        want = torch.stack(score_full(eng, qs, states, independent=independent))
        # on CUDA the rest of the table is fla's, whose tf32 dots are ~1e-3 off (as in the forward test above)
        assert (torch.stack(alone) - want).abs().max().item() < (1e-4 if DEV == "cpu" else 5e-3)
