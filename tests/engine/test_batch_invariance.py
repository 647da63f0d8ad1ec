"""Deterministic scoring on the CPU: with `Engine.load(..., deterministic=True)` a state's probabilities are
bit-identical (torch.equal) whatever batch it is scored in: its size, the state's position, its neighbours and the
padded length they give it; packed and independent schemas. Then one test per source of batch dependence found
(`engine.kernels.cpu_deterministic` names them): each fixed kernel gives a row the same bits alone and inside a padded
batch."""
import random

import pytest
import torch
import torch.nn.functional as F

from engine import Engine, SchemaEngine
from engine.kernels import cpu_deterministic as inv
from engine.kernels.table import select_kernels
from engine.reference import score_full

from .conftest import make_questions, make_states

N_STATES = 24


@pytest.fixture(scope="module")
def det_se(tiny_dir):
    return SchemaEngine(Engine.load(tiny_dir, device="cpu", dtype="float32", deterministic=True))


def scored_in_batches(se, h, states, batch: int, seed: int) -> list[torch.Tensor]:
    """Every state scored once, in shuffled batches of `batch` (random neighbours and positions), in input order."""
    order = list(range(len(states)))
    random.Random(seed).shuffle(order)
    out = [None] * len(states)
    for start in range(0, len(order), batch):
        idx = order[start:start + batch]
        for i, p in zip(idx, se.score(h, [states[i] for i in idx])):
            out[i] = p
    return out


@pytest.mark.parametrize("independent", [False, True], ids=["packed", "independent"])
def test_a_state_scores_the_same_bits_in_any_batch(det_se, independent):
    states = make_states(N_STATES, seed=21, max_words=30)          # 1-30 words: padded lengths differ per batch
    h = det_se.prepare(make_questions([2, 3, 5, 8], temperatures=[0.5, 1.0, 1.0, 2.0]), independent=independent)
    alone = [det_se.score(h, [s])[0] for s in states]
    for batch in (2, 7, 13, N_STATES):
        got = scored_in_batches(det_se, h, states, batch, seed=batch)
        differ = [i for i in range(N_STATES) if not torch.equal(got[i], alone[i])]
        assert not differ, f"batches of {batch}: states {differ} differ from their scores alone"


def test_the_deterministic_path_still_matches_the_oracle(tiny_dir, det_se):
    qs = make_questions([2, 4, 8], temperatures=[0.7, 1.0, 1.5])
    states = make_states(9, seed=5)
    for independent in (False, True):
        got = torch.stack(det_se.score(det_se.prepare(qs, independent=independent), states))
        want = torch.stack(score_full(det_se.e, qs, states, independent=independent))
        assert (got - want).abs().max().item() < 1e-4


def test_deterministic_selects_the_invariant_table(det_se):
    assert det_se.e.deterministic and det_se.fwd.kernels.name == "torch-invariant"
    assert select_kernels("cpu", deterministic=True).attend_by_request
    assert select_kernels("cpu").name == "torch" and not select_kernels("cpu").attend_by_request


# ---- one test per source --------------------------------------------------------------------------------------------

def _alone_and_in_batches(fn, make, t: int = 37, padded=(37, 40, 64, 100), batches=(1, 2, 7), token_dim: int = 1):
    """fn's result for one row of t tokens alone, against the same row at every position of padded batches."""
    g = torch.Generator().manual_seed(0)
    row = make(1, t, g)
    want = fn(*row)
    for B in batches:
        for T in padded:
            for pos in sorted({0, B // 2, B - 1}):
                batch = make(B, T, g)
                for x, r in zip(batch, row):
                    x[pos:pos + 1].narrow(token_dim, 0, t).copy_(r)
                got = fn(*batch)[pos:pos + 1].narrow(token_dim, 0, t)
                assert torch.equal(got, want), f"batch {B}, padded to {T}, row at {pos}"


@pytest.mark.parametrize("K,N", [(64, 200), (1024, 3584), (3584, 1024)])
def test_gemm_rows_are_the_same_whatever_the_row_count(K, N):
    """MKL's GEMM rounds a row differently with the row count M; blocks of a fixed M do not."""
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(N, K, generator=g), torch.randn(300, K, generator=g)
    full = inv.linear(x, w)
    for M in (1, 2, 3, 5, 17, 64, 65, 130):
        idx = torch.randperm(300, generator=g)[:M]
        assert torch.equal(inv.linear(x[idx], w), full[idx]), f"M = {M}"
    torch.testing.assert_close(full, F.linear(x, w), rtol=1e-5, atol=1e-4)
    assert inv.linear(x.view(3, 100, K), w).shape == (3, 100, N)


@pytest.mark.parametrize("name", ["sigmoid", "silu", "softplus"])
def test_activations_do_not_depend_on_an_elements_offset(name):
    """PyTorch's vector and scalar code paths round sigmoid, SiLU and softplus differently, so an element's value
    follows its offset in the tensor; the exp-based forms give every element the scalar path's bits."""
    fn, ref = getattr(inv, name), {"sigmoid": torch.sigmoid, "silu": F.silu, "softplus": F.softplus}[name]
    x = torch.cat([torch.randn(4000, generator=torch.Generator().manual_seed(2)) * 8, torch.tensor([-90.0, 30.0, 90.0])])
    whole = fn(x)
    one_by_one = torch.stack([fn(x[i:i + 1])[0] for i in range(len(x))])
    assert torch.equal(whole, one_by_one)
    torch.testing.assert_close(whole, ref(x), rtol=2e-6, atol=1e-7)


def test_attention_by_request_is_the_requests_own(det_se):
    """The CPU flash attention blocks its work by the padded length; row by row, a row's attention is what it
    computes alone, and equals the batched (gathered-keys) attention up to rounding. Rows read prefixes of unequal
    lengths (two schemas)."""
    from engine.model import SuffixContext

    h1, h2 = det_se.prepare(make_questions([2, 3])), det_se.prepare(make_questions([4]))
    fwd, bank = det_se.fwd, det_se.bank
    layer = next(i for i, l in enumerate(fwd.core.layers) if l.block_type == "full_attention")
    attn = fwd.core.layers[layer].self_attn
    Hq, Hkv, D = fwd.cfg.num_attention_heads, fwd.cfg.num_key_value_heads, attn.head_dim
    g = torch.Generator().manual_seed(3)

    def attend(q, k, v, slots, lengths):
        R, T = q.shape[0], q.shape[2]
        span = max(bank.host_lengths[s] for s in slots)
        ctx = SuffixContext(bank, torch.tensor(slots), T, span, lengths, slots if lengths else None)
        a = ctx.attend(layer, q, k, v, attn.scaling, fwd.kernels)
        return fwd.kernels.gate_attention(a, torch.zeros(R, T, Hq, D))

    T, R = 50, 5
    q, k, v = (torch.randn(R, H, T, D, generator=g) for H in (Hq, Hkv, Hkv))
    lengths = [19, 50, 7, 33, 50]
    slots = [h1.prefix_slots[0], h2.prefix_slots[0], h1.prefix_slots[0], h2.prefix_slots[0], h2.prefix_slots[0]]
    assert h1.prefix_lengths != h2.prefix_lengths
    batched = attend(q, k, v, slots, lengths)
    for r, L in enumerate(lengths):
        alone = attend(q[r:r + 1, :, :L], k[r:r + 1, :, :L], v[r:r + 1, :, :L], slots[r:r + 1], [L])
        assert torch.equal(batched[r:r + 1, :L], alone)
    plain = attend(q, k, v, slots, None)
    for r, L in enumerate(lengths):
        torch.testing.assert_close(batched[r, :L], plain[r, :L], rtol=1e-5, atol=1e-6)


def test_norms_conv_and_delta_rule_are_invariant_as_they_are():
    """Found invariant without changes: each row's norm, its causal conv and transformers' chunked delta rule."""
    w = torch.rand(64, generator=torch.Generator().manual_seed(4)) + 0.5
    _alone_and_in_batches(lambda x: inv.rms_norm(x, w, 1e-6), lambda B, T, g: [torch.randn(B, T, 64, generator=g)])
    cw = torch.randn(128, 4, generator=torch.Generator().manual_seed(5))
    prev = torch.randn(1, 128, 3, generator=torch.Generator().manual_seed(6))
    _alone_and_in_batches(lambda x: inv.conv_qkv(x, cw, prev.expand(x.shape[0], -1, -1), 32, 16, 16, x[..., :8])[2],
                          lambda B, T, g: [torch.randn(B, T, 128, generator=g)])
    A_log, dt_bias = torch.full((4,), 0.3), torch.full((4,), 0.1)

    def delta(q, k, v, a, b):
        s0 = torch.ones(q.shape[0], 4, 16, 16) * 0.01
        return inv.delta_rule(q, k, v, a, b, A_log, dt_bias, s0, False)[0]

    def make(B, T, g):
        qk = [F.normalize(torch.randn(B, T, 2, 16, generator=g), dim=-1) for _ in range(2)]
        return [*qk, torch.randn(B, T, 4, 16, generator=g), torch.randn(B, T, 4, generator=g),
                torch.randn(B, T, 4, generator=g)]

    _alone_and_in_batches(delta, make, t=70, padded=(70, 71, 129, 200))


def _answer_attention_by_answer(q, k, v, bank_k, bank_v, key_lengths, slots, rows, starts, counts, gate, scale):
    """`Kernels.answer_attention` one answer at a time in PyTorch, from that answer's own keys alone (contiguous copies,
    elementwise products and sums whose order follows the answer's own key count): batch-invariant by construction."""
    S, Hq, D = q.shape
    B, Hkv, T, _ = k.shape
    out = q.new_zeros(S, Hq * D)
    for b in range(B):
        slot, n = int(slots[b]), int(key_lengths[slots[b]])
        for s in range(int(starts[b]), int(starts[b]) + int(counts[b])):
            t = int(rows[s]) - b * T
            keys = torch.cat([bank_k[slot, :, :n], k[b, :, :t + 1]], 1).repeat_interleave(Hq // Hkv, 0).contiguous()
            values = torch.cat([bank_v[slot, :, :n], v[b, :, :t + 1]], 1).repeat_interleave(Hq // Hkv, 0).contiguous()
            p = torch.softmax((q[s][:, None, :] * keys).sum(-1) * scale, -1)                  # [Hq, n + t + 1]
            o = (p[:, :, None] * values).sum(1)                                                # [Hq, D]
            out[s] = (o * inv.sigmoid(gate[s])).reshape(-1)
    return out


def test_a_batch_invariant_table_takes_the_answers_path_at_every_batch_size(tiny_dir, monkeypatch):
    """`engine.model.ANSWER_QUERIES_MIN_ROWS` keeps one-row steps of the fast table on the whole-row attention; a
    batch-invariant table (`Kernels.batch_invariant`) takes the answers' attention at one row too, since a state scored
    alone must take the path it takes in a batch: with an answers' attention here, a state's probabilities are the
    same bits alone and in batches, and the kernel ran for the one-row steps."""
    import dataclasses

    from engine import model

    monkeypatch.setattr(model, "ANSWER_QUERIES", True)
    monkeypatch.setattr(model, "ANSWER_QUERIES_MIN_ROWS", 2)
    eng = Engine.load(tiny_dir, device="cpu", dtype="float32", deterministic=True)
    calls = []
    eng.forward.kernels = dataclasses.replace(
        eng.forward.kernels, answer_attention=lambda *a: calls.append(a[0].shape[0]) or _answer_attention_by_answer(*a))
    assert eng.forward.kernels.batch_invariant
    se = SchemaEngine(eng)
    states = make_states(9, seed=23, max_words=30)
    h = se.prepare(make_questions([2, 3, 5], temperatures=[0.5, 1.0, 2.0]))
    alone = [se.score(h, [s])[0] for s in states]
    assert len(calls) == len(states)                  # every one-row step: the answers' attention
    for batch in (4, 9):
        got = scored_in_batches(se, h, states, batch, seed=batch)
        assert all(torch.equal(g, a) for g, a in zip(got, alone))
    want = torch.stack(score_full(eng, make_questions([2, 3, 5], temperatures=[0.5, 1.0, 2.0]), states))
    assert (torch.stack(alone) - want).abs().max().item() < 1e-4
    # the fast table's rule, for contrast: a one-row step skips it
    eng.forward.kernels = dataclasses.replace(eng.forward.kernels, batch_invariant=False)
    calls.clear()
    se.score(h, states[:1])
    assert not calls
