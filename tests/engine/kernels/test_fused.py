"""engine.kernels.fused against the PyTorch norms the CPU path uses (transformers' semantics), on strided views like
the forward passes them. Runs on the GPU; on a CPU through Triton's interpreter, which Triton reads when it is first
imported (before this module, by transformers): `TRITON_INTERPRET=1 pytest -m gpu tests/engine/test_triton_kernels.py`
with triton installed and fla not (where fla imports, transformers' CPU forward dispatches to its GPU kernels)."""

import pytest
import torch

from tests.engine.kernels.triton_device import require

ON_GPU, DEV = require()

from engine.kernels.pytorch import torch_gated_rms_norm, torch_rms_norm  # noqa: E402
from engine.kernels.fused import GATED, row_norm  # noqa: E402

pytestmark = pytest.mark.gpu


def _same_across_tiles(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Results of one kernel at two tile shapes. On the GPU: the same bits (each tile sums in the same order). In the
    interpreter `tl.dot` is numpy's matmul of the tile, and the host BLAS may sum a tile of another shape in another
    order (OpenBLAS on an AMD EPYC did, by 1 float32 ulp): there, equal to float32 rounding."""
    if DEV == "cuda":
        return torch.equal(a, b)
    return torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def _fused(tokens, widths, dtype, seed=0):
    """Pieces of one fused projection output [tokens, sum(widths)]: strided views, as the forward sees them."""
    g = torch.Generator().manual_seed(seed)
    full = (torch.randn(tokens, sum(widths), generator=g) * 3).to(DEV, dtype)
    return full.split(widths, dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_on_hidden_rows_and_strided_heads(dtype):
    hidden, heads = _fused(37, [64, 4 * 32], dtype)
    w64 = torch.rand(64, device=DEV) + 0.5
    w32 = torch.rand(32, device=DEV) + 0.5
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(row_norm(hidden, w64, 1e-6), torch_rms_norm(hidden, w64, 1e-6), atol=tol, rtol=tol)
    per_head = heads.view(37, 4, 32)                               # rows (token, head), token stride 192
    torch.testing.assert_close(row_norm(per_head, w32, 1e-6), torch_rms_norm(per_head, w32, 1e-6), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm_rounds_like_transformers(dtype):
    x, z = _fused(29, [3 * 16, 3 * 16], dtype, seed=1)
    x = x.contiguous().view(29, 3, 16)
    z = z.view(29, 3, 16)
    w = (torch.rand(16) + 0.5).to(DEV, dtype)
    got, want = row_norm(x, w, 1e-6, GATED, z), torch_gated_rms_norm(x, z, w, 1e-6)
    assert got.shape == x.shape and got.is_contiguous()
    # bf16: a one-ulp difference of the rounded normalised value is multiplied by weight x silu(gate) (~10 here)
    atol, rtol = (1e-5, 1e-5) if dtype == torch.float32 else (1e-2, 3e-2)
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("P", [0, 1, 3], ids=["no-prefix", "packed", "independent"])
@pytest.mark.parametrize("by_slot", [False, True], ids=["per-row", "by-slot"])
def test_conv_qkv_continues_the_prefix_state_and_l2_normalises_q_and_k(dtype, P, by_slot):
    """The qkv piece of the fused projection (strided) through the causal conv + SiLU, continuing a prefix's conv
    state as the suffix pass passes it (the bank's states read by slot inside the kernel, or per row: expanded in place
    for one prefix, repeated for several), q and k L2-normalised per head, and the delta rule's b and a copied out of
    the same projection: against the PyTorch conv and transformers' l2norm."""
    from engine.kernels.causal_conv import conv_qkv
    from engine.kernels.pytorch import torch_conv_qkv

    B, T, Hk, Dk, Hv, Dv, KW = 6, 37, 2, 16, 4, 16, 4
    C = 2 * Hk * Dk + Hv * Dv
    qkv, _z, gates = _fused(B * T, [C, Hv * Dv, 2 * Hv], dtype, seed=3)
    qkv, gates = qkv.view(B, T, C), gates.view(B, T, 2 * Hv)
    g = torch.Generator().manual_seed(4)
    weight = (torch.randn(C, KW, generator=g) * 0.5).to(DEV, dtype).t().contiguous().t()   # tap-major, as the model
    prev, index = None, None
    if P:
        state = torch.randn(P, C, KW - 1, generator=g).to(DEV, dtype)
        if by_slot:          # a bank of 5 slots, the prefixes in slots 4, 1, 2
            prev = torch.randn(5, C, KW - 1, generator=g).to(DEV, dtype)
            prev[[4, 1, 2][:P]] = state
            index = torch.tensor([[4, 1, 2][b % P] for b in range(B)], device=DEV)
        else:
            prev = state.expand(B, C, KW - 1) if P == 1 else state.repeat(B // P, 1, 1)
    args = (qkv, weight, prev, Hk * Dk, Dk, Dv, gates, index)
    got, want = conv_qkv(*args), torch_conv_qkv(*args)
    shapes = [(B, T, Hk, Dk), (B, T, Hk, Dk), (B, T, Hv, Dv), (B, T, Hv), (B, T, Hv)]
    for g_t, w_t, shape in zip(got, want, shapes):
        assert g_t.shape == shape and g_t.is_contiguous()
        # bf16: the conv's output is rounded once (then normalised and rounded again): up to 2 ulps apart
        tol = 1e-5 if dtype == torch.float32 else 2 ** -6
        torch.testing.assert_close(g_t, w_t.to(dtype), atol=tol, rtol=tol)
    assert torch.equal(got[3], gates[..., :Hv]) and torch.equal(got[4], gates[..., Hv:])     # copied, bit for bit
    assert got[0].norm(dim=-1).sub(1).abs().max().item() < (1e-4 if dtype == torch.float32 else 1e-2)


def test_conv_qkv_gives_the_same_bits_at_its_small_grid_launch_and_with_weight_tiles(monkeypatch):
    """`CONV_SMALL_CONFIG` (batch 1) and `CONV_CONFIG` at the 0.8B shape (128-wide heads, whose L2 norms sum a row's
    channels across a warp's threads): a row scored alone must get the bits it gets inside a batch. And
    `CONV_WEIGHT_TILE`, which changes only the layout the weights load in, must not change a bit either."""
    from engine.kernels import causal_conv
    from engine.kernels.causal_conv import conv_qkv

    B, T, Hk, D, Hv, KW = 1, 40, 16, 128, 16, 4
    C = 2 * Hk * D + Hv * D
    qkv, _z, gates = _fused(B * T, [C, Hv * D, 2 * Hv], torch.bfloat16, seed=8)
    g = torch.Generator().manual_seed(9)
    weight = (torch.randn(C, KW, generator=g) * 0.5).to(DEV, torch.bfloat16).t().contiguous().t()
    prev = torch.randn(3, KW - 1, C, generator=g).to(DEV, torch.bfloat16).transpose(1, 2)   # time-major, as the bank
    args = (qkv.view(B, T, C), weight, prev, Hk * D, D, D, gates.view(B, T, 2 * Hv), torch.tensor([2], device=DEV))
    outs = []
    for tile in (False, True):
        monkeypatch.setattr(causal_conv, "CONV_WEIGHT_TILE", tile)
        for fill in (0, 10 ** 9):               # never the small launch, always it
            monkeypatch.setattr(causal_conv, "CONV_FILL_PROGRAMS", fill)
            outs.append(conv_qkv(*args))
    assert causal_conv.CONV_SMALL_CONFIG != causal_conv.CONV_CONFIG
    assert all(torch.equal(a, b) for out in outs[1:] for a, b in zip(outs[0], out))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_on_the_halves_of_the_fused_gate_up_projection(dtype):
    import torch.nn.functional as F

    from engine.kernels.fused import swiglu

    gate, up = _fused(2 * 19, [1536, 1536], dtype, seed=9)         # 1536: two column blocks, the second partial
    gate, up = gate.view(2, 19, 1536), up.view(2, 19, 1536)
    got = swiglu(gate, up)
    assert got.shape == gate.shape and got.is_contiguous()
    # transformers' act_fn(gate) * up; bf16: the interpreter truncates where the GPU rounds, 1 ulp of each rounding
    tol = 1e-5 if dtype == torch.float32 else 2 ** -6
    torch.testing.assert_close(got, F.silu(gate) * up, atol=tol, rtol=tol)
    # into a given output (the deterministic table's block-padded storage: engine.kernels.blocked_linear.block_padded)
    storage = torch.empty(64, 1536, dtype=dtype, device=gate.device)
    into = swiglu(gate, up, out=storage[:38].view(2, 19, 1536))
    assert into.data_ptr() == storage.data_ptr() and torch.equal(into, got)
    with pytest.raises(ValueError, match="contiguous"):
        swiglu(gate, up, out=torch.empty(2, 1536, 19, dtype=dtype, device=gate.device).transpose(1, 2))


def test_rows_that_cannot_merge_are_copied_not_misread():
    x = torch.randn(6, 5, 16, device=DEV).transpose(0, 1)          # [5, 6, 16]: tokens not mergeable by view
    w = torch.ones(16, device=DEV)
    torch.testing.assert_close(row_norm(x[:, :, None, :], w, 1e-6), torch_rms_norm(x[:, :, None, :], w, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_updates_the_residual_then_normalises_the_rounded_sum(dtype):
    from engine.kernels.pytorch import torch_add_rms_norm
    from engine.kernels.fused import add_rms_norm

    h, x = (t.contiguous() for t in _fused(3 * 7, [64, 64], dtype, seed=5))
    h, x = h.view(3, 7, 64), x.view(3, 7, 64)
    w = torch.rand(64, device=DEV) + 0.5
    want_normed, want_h = torch_add_rms_norm(h.clone(), x, w, 1e-6)
    got_normed, got_h = add_rms_norm(h, x, w, 1e-6)
    assert got_h.data_ptr() == h.data_ptr()                       # in place: no new residual tensor per layer
    # the same rounded sum; Triton's interpreter casts to bf16 by truncation (the GPU rounds to nearest even): 1 ulp
    exact = DEV == "cuda" or dtype == torch.float32
    torch.testing.assert_close(got_h, want_h, atol=0, rtol=0 if exact else 2 ** -7)
    # bf16: the normalised sum is rounded once more; with the interpreter's truncated sum that is up to 2 ulps
    atol, rtol = (1e-5, 1e-5) if dtype == torch.float32 else (1e-2, 2 ** -6)
    torch.testing.assert_close(got_normed, want_normed, atol=atol, rtol=rtol)


def test_norms_give_the_same_bits_with_weight_tiles(monkeypatch):
    """`NORM_WEIGHT_TILE` changes only the layout the norm's weights load in: the residual add + RMS norm of 1,024-wide
    rows (4 a program, as the 0.8B model's) and the gated norm of 128-wide heads, bf16, must keep every bit."""
    from engine.kernels import fused
    from engine.kernels.fused import add_rms_norm

    h, x = (t.contiguous() for t in _fused(2 * 9, [1024, 1024], torch.bfloat16, seed=11))
    w = torch.rand(1024, device=DEV) + 0.5
    heads, gate = _fused(2 * 9 * 3, [128, 128], torch.bfloat16, seed=12)
    w_head = torch.rand(128, device=DEV) + 0.5
    outs = []
    for tile in (False, True):
        monkeypatch.setattr(fused, "NORM_WEIGHT_TILE", tile)
        normed, summed = add_rms_norm(h.clone(), x, w, 1e-6)
        outs.append((normed, summed, row_norm(heads, w_head, 1e-6, GATED, gate)))
    assert all(torch.equal(a, b) for a, b in zip(*outs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_norm_rope_matches_transformers_apply_rotary_pos_emb(dtype):
    """The attention's q (a strided half of the gated q projection) and k (a slice of the fused q|k|v output) with
    partial rotary (8 of 32 columns, as Qwen3.5), written as [B, H, T, D]."""
    from engine.kernels.pytorch import torch_qk_norm_rope
    from engine.kernels.fused import rms_norm_rope

    B, T, Hq, Hkv, D, rot = 2, 7, 4, 2, 32, 8
    qg, k, _v = _fused(B * T, [Hq * 2 * D, Hkv * D, Hkv * D], dtype, seed=7)
    q = torch.chunk(qg.view(B, T, Hq, 2 * D), 2, dim=-1)[0]
    k = k.view(B, T, Hkv, D)
    g = torch.Generator().manual_seed(8)
    angles = torch.rand(B, T, rot // 2, generator=g) * 6
    cos = torch.cat([angles.cos()] * 2, -1).to(DEV, dtype)
    sin = torch.cat([angles.sin()] * 2, -1).to(DEV, dtype)
    qw, kw = torch.rand(D, device=DEV) + 0.5, torch.rand(D, device=DEV) + 0.5
    want_q, want_k = torch_qk_norm_rope(q, k, qw, kw, cos, sin, 1e-6)
    got_q, got_k = rms_norm_rope(q, qw, cos, sin, 1e-6), rms_norm_rope(k, kw, cos, sin, 1e-6)
    assert got_q.shape == (B, Hq, T, D) and got_q.is_contiguous() and got_k.shape == (B, Hkv, T, D)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got_q, want_q, atol=tol, rtol=tol)
    torch.testing.assert_close(got_k, want_k, atol=tol, rtol=tol)


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("P", [1, 3])
def test_gate_attention_merges_prefix_and_suffix_halves_like_the_torch_path(dtype, P):
    from engine.kernels.pytorch import torch_gate_attention
    from engine.kernels.attention import AttentionOut
    from engine.kernels.fused import gate_attention

    R, Hkv, G, T, D = 2, 2, 2, 5, 16
    B, Hq = R * P, Hkv * G
    g = torch.Generator().manual_seed(9)
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(DEV)
    o = rnd(B, T, Hq, D).to(dtype).transpose(1, 2)                   # flash attention's [B, H, T, D] is a transposed view
    lse = rnd(B, Hq, T) * 2
    o_pre = rnd(P, R * G * T, Hkv, D).to(dtype).transpose(1, 2)       # prefix-major [P, Hkv, R*G*T, D]
    lse_pre = rnd(P, Hkv, R * G * T) * 2
    gate = torch.chunk(rnd(B, T, Hq, 2 * D).to(dtype), 2, dim=-1)[1]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a in (AttentionOut(o, lse, o_pre, lse_pre, R, P), AttentionOut(o.contiguous())):
        got, want = gate_attention(a, gate), torch_gate_attention(a, gate)
        assert got.shape == (B, T, Hq * D)
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the key loop's bound is a loaded length, which Triton's "
                    "interpreter cannot iterate to")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_indexed_attention_reads_each_rows_prefix_from_the_bank(dtype):
    """The prefix half for rows of many schemas: query entry z attends to bank entry kv_index[z], only up to its own
    length, and its result does not depend on the other rows."""
    from engine.kernels.cuda_deterministic import indexed_attention

    g = torch.Generator().manual_seed(7)
    S, Hkv, N, D, B, GT = 5, 2, 300, 64, 9, 3 * 41
    bank_k, bank_v = ((torch.randn(S, Hkv, N, D, generator=g)).to(DEV, dtype) for _ in range(2))
    lengths = torch.tensor([300, 17, 129, 64, 1], dtype=torch.int32, device=DEV)
    index = torch.tensor([1, 0, 4, 2, 2, 3, 0, 1, 4], device=DEV)
    q = torch.randn(B, Hkv, GT, D, generator=g).to(DEV, dtype)
    out, lse = indexed_attention(q, bank_k, bank_v, 0.125, lengths, index)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    for z in range(B):
        s, n = index[z].item(), lengths[index[z]].item()
        scores = (q[z].float() @ bank_k[s, :, :n].float().transpose(-1, -2)) * 0.125
        want = torch.softmax(scores, -1) @ bank_v[s, :, :n].float()
        torch.testing.assert_close(out[z].float(), want, atol=tol, rtol=tol)
        torch.testing.assert_close(lse[z], torch.logsumexp(scores, -1), atol=1e-4, rtol=1e-4)
        alone = indexed_attention(q[z:z + 1], bank_k, bank_v, 0.125, lengths, index[z:z + 1])
        assert torch.equal(alone[0], out[z:z + 1]) and torch.equal(alone[1], lse[z:z + 1])


def _chunk_states_reference(k, w, u, g, bank, index, chunk):
    """fla's chunked state recurrence written out in PyTorch, one (row, value head) at a time, with its roundings:
    the state stored per chunk and multiplied in k's dtype, the new values rounded before the state update."""
    B, T, H, K = k.shape
    HV, V = u.shape[2], u.shape[3]
    NT = -(-T // chunk)
    h = torch.empty(B, NT, HV, K, V, dtype=k.dtype)
    v_new = torch.empty(B, T, HV, V, dtype=u.dtype)
    for b in range(B):
        for hv in range(HV):
            state = bank[index[b], hv].float().clone()
            kh = k[b, :, hv // (HV // H)]
            for c in range(NT):
                t = slice(c * chunk, min((c + 1) * chunk, T))
                h[b, c, hv] = state.to(k.dtype)
                nv = u[b, t, hv].float() - w[b, t, hv].float() @ state.to(k.dtype).float()
                v_new[b, t, hv] = nv.to(u.dtype)
                g_c = g[b, t, hv].float()
                g_last = g_c[-1]
                scaled = (nv * torch.exp2(g_last - g_c)[:, None]).to(k.dtype).float()
                state = state * torch.exp2(g_last) + kh[t].float().T @ scaled
    return h, v_new


def _wy_inputs(B, K, dtype, seed, T=70, H=2, HV=4, V=64, S=4):
    """Random inputs of the delta rule's state kernel, on the CPU: q, k [B, T, H, K] (L2-normalised), the WY
    representation w [B, T, HV, K] and u [B, T, HV, V], the chunked log2 decay [B, T, HV] (a cumulative sum of
    negative steps restarting every chunk; T = 70: a last chunk cut short) and a bank of S float32 states."""
    from engine.kernels.indexed_delta_rule import CHUNK

    g = torch.Generator().manual_seed(seed)
    q, k = (torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g), dim=-1).to(dtype) for _ in range(2))
    w = (torch.randn(B, T, HV, K, generator=g) * 0.1).to(dtype)
    u = torch.randn(B, T, HV, V, generator=g).to(dtype)
    steps = -torch.rand(B, T, HV, generator=g) * 0.3
    decay = torch.cat([c.cumsum(1) for c in steps.split(CHUNK, dim=1)], dim=1)
    return q, k, w, u, decay, torch.randn(S, HV, K, V, generator=g) * 0.5


@pytest.mark.parametrize("dtype", [
    torch.float32,
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton 3.6's "
                 "interpreter multiplies bf16 tiles wrongly (tl.dot of two bf16 16 x 16 tiles is off by 3e10)"))])
@pytest.mark.parametrize("K", [16, 64, 128])
def test_chunk_states_indexed_starts_each_row_from_its_bank_entry(K, dtype):
    """The delta rule's state kernel for a suffix pass: row b starts from prefix bank entry index[b], read in place
    (rows sharing an entry, entries no row reads), grouped value heads, a last chunk cut short; against the
    recurrence in PyTorch, and bit for bit against the same kernel given each row's state copied out."""
    from engine.kernels.indexed_delta_rule import CHUNK, chunk_states_indexed

    B = 3
    _, k, w, u, decay, bank = _wy_inputs(B, K, dtype, seed=11)
    index = torch.tensor([2, 0, 2])
    on = lambda *ts: [t.to(DEV) for t in ts]  # noqa: E731
    h, v_new = chunk_states_indexed(*on(k, w, u, decay, bank, index))
    want_h, want_v = _chunk_states_reference(k, w, u, decay, bank, index, CHUNK)
    torch.testing.assert_close(h.cpu().float(), want_h.float(), atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(v_new.cpu().float(), want_v.float(), atol=3e-2, rtol=2e-2)
    copied = chunk_states_indexed(*on(k, w, u, decay, bank[index].contiguous(), torch.arange(B)))
    assert torch.equal(copied[0], h) and torch.equal(copied[1], v_new)
    # the launch configuration (fla autotunes it) does not change how a column is summed: the same bits
    for config in ((32, 2, 2), (64, 2, 2), (32, 4, 2), (16, 2, 2)):
        other = chunk_states_indexed(*on(k, w, u, decay, bank, index), config=config)
        assert _same_across_tiles(other[0], h) and _same_across_tiles(other[1], v_new), config


def test_delta_rule_indexed_is_flas_delta_rule_from_the_copied_states(monkeypatch):
    """The suffix pass's delta rule (fla's forward with the indexed state kernel) against fla's
    `chunk_gated_delta_rule` given the per-row copies of the bank's states it avoids."""
    pytest.importorskip("fla")
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    from engine.kernels import cuda_fast

    g = torch.Generator().manual_seed(12)
    B, T, H, HV, K, V, S = 5, 184, 16, 16, 128, 128, 3
    dtype = torch.bfloat16
    q, k = (torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g), dim=-1).to(DEV, dtype)
            for _ in range(2))
    v = torch.randn(B, T, HV, V, generator=g).to(DEV, dtype)
    a, b = (torch.randn(B, T, HV, generator=g).to(DEV, dtype) for _ in range(2))
    A_log = torch.randn(HV, generator=g).to(DEV)
    dt_bias = torch.randn(HV, generator=g).to(DEV)
    bank = (torch.randn(S, HV, K, V, generator=g) * 0.5).to(DEV)
    index = torch.tensor([1, 1, 0, 2, 1], device=DEV)

    want, _ = chunk_gated_delta_rule(q, k, v, g=a, beta=b, initial_state=bank[index], output_final_state=False,
                                     use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                                     use_beta_sigmoid_in_kernel=True)

    def indexed(fused_output, wy_launch):
        monkeypatch.setattr(cuda_fast, "FUSED_OUTPUT", fused_output)
        monkeypatch.setattr(cuda_fast, "WY_LAUNCH", wy_launch)
        return cuda_fast.delta_rule_indexed(q, k, v, a, b, A_log, dt_bias, bank, index)

    # fla's WY kernels through its entry point and its output kernel: the same arithmetic in the same order as fla's
    # whole forward, at whatever launches its autotuners hold (the state kernel's launch does not change a column's
    # sums), so the same bits
    got = indexed(False, None)
    assert torch.equal(got, want), f"max |diff| {(got.float() - want.float()).abs().max().item():.3g}"
    # fused, the output's sums over the key dimension run in 64-wide steps (fla's output kernel may take 128 at once);
    # the fixed WY launches may split K K^T's sums otherwise than the launch fla's autotuner holds
    for name, fused_output, wy_launch in (("fused", True, None), ("fixed WY", False, cuda_fast.WY_LAUNCH),
                                          ("as run", True, cuda_fast.WY_LAUNCH)):
        other = indexed(fused_output, wy_launch)
        print(f"{name} against fla: max |diff| {(other.float() - want.float()).abs().max():.3g}")
        torch.testing.assert_close(other.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_decay_and_beta_are_flas_gate_cumsum_and_sigmoid_in_one_kernel():
    """`delta_rule_inputs.decay_and_beta` against the formulas (a last chunk cut short, several heads and rows), and
    on a GPU with fla bit for bit against fla's two kernels it replaces."""
    from engine.kernels.delta_rule_inputs import decay_and_beta

    g = torch.Generator().manual_seed(21)
    B, T, H, chunk, scale = 2, 150, 3, 64, 1.4426950408889634
    a, b = (torch.randn(B, T, H, generator=g).to(torch.bfloat16) for _ in range(2))
    A_log, dt_bias = torch.randn(H, generator=g), torch.randn(H, generator=g)
    decay, beta = decay_and_beta(a.to(DEV), b.to(DEV), A_log.to(DEV), dt_bias.to(DEV), chunk, scale)
    assert decay.dtype == beta.dtype == torch.float32
    gate = -A_log.exp() * torch.nn.functional.softplus(a.float() + dt_bias)
    want = torch.cat([c.cumsum(1) for c in gate.split(chunk, dim=1)], dim=1) * scale
    torch.testing.assert_close(decay.cpu(), want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(beta.cpu(), b.float().sigmoid(), atol=1e-6, rtol=1e-6)
    if torch.cuda.is_available() and _has_fla():
        from fla.ops.common.gate import fused_beta_sigmoid
        from fla.ops.gated_delta_rule.gate import gdn_gate_chunk_cumsum
        from engine.kernels.table import fla_kernels
        fla_kernels()           # fla's gate kernel pinned to its first launch, as the engine runs it
        on = lambda t: t.to(DEV)  # noqa: E731
        assert torch.equal(decay, gdn_gate_chunk_cumsum(g=on(a), A_log=on(A_log), chunk_size=chunk, scale=scale,
                                                        dt_bias=on(dt_bias)))
        assert torch.equal(beta, fused_beta_sigmoid(on(b)))


@pytest.mark.parametrize("T", [100, 40], ids=["chunk-cut-short", "one-short-chunk"])
def test_merged_solve_inverts_each_chunks_decayed_kkt(T):
    """`delta_rule_inputs.solve_into` (fla's fused K K^T + solve, its four substitutions in one loop) against the
    inverse computed in PyTorch, chunk by chunk, grouped value heads, the last chunk cut short (40 tokens: the fourth
    diagonal block has no token at all); on a GPU with fla, bit for bit against fla's kernel at the same launches."""
    from engine.kernels.delta_rule_inputs import solve_into

    g = torch.Generator().manual_seed(23)
    B, H, HV, K, chunk = 2, 2, 4, 128, 64
    dtype = torch.float32 if not torch.cuda.is_available() else torch.bfloat16
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g), dim=-1)
    beta, decay = torch.rand(B, T, HV, generator=g), -torch.rand(B, T, HV, generator=g).cumsum(1) * 0.1
    A = torch.zeros(B, T, HV, chunk, device=DEV, dtype=dtype)
    solve_into(A, k.to(DEV, dtype), decay.to(DEV), beta.to(DEV), chunk, (64, 2))
    kv = k.to(dtype).float().repeat_interleave(HV // H, dim=2)
    for start in range(0, T, chunk):
        c = slice(start, min(start + chunk, T))
        n = c.stop - start
        kc = kv[:, c].permute(0, 2, 1, 3)                                   # [B, HV, n, K]
        gc = decay[:, c].permute(0, 2, 1)                                   # [B, HV, n]
        a = (kc @ kc.transpose(-1, -2)) * torch.exp2(gc[..., :, None] - gc[..., None, :])
        a = a.tril(-1) * beta[:, c].permute(0, 2, 1)[..., :, None]
        want = torch.linalg.inv(torch.eye(n) + a)
        got = A[:, c, :, :n].permute(0, 2, 1, 3).cpu().float().tril()
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    if torch.cuda.is_available() and _has_fla():
        from engine.kernels import cuda_fast
        for launch in (cuda_fast.WY_LAUNCH[0], cuda_fast.WY_SMALL_LAUNCH[0]):
            ours, theirs = torch.zeros_like(A), torch.zeros_like(A)
            solve_into(ours, k.to(DEV, dtype), decay.to(DEV), beta.to(DEV), chunk, launch)
            cuda_fast.solve_into(theirs, k.to(DEV, dtype), decay.to(DEV), beta.to(DEV), launch)
            assert torch.equal(ours, theirs), launch


def _has_fla() -> bool:
    try:
        import fla  # noqa: F401
    except ImportError:
        return False
    return True


def test_w_u_reads_only_the_lower_triangle_of_the_solved_matrix():
    """`delta_rule_inputs.w_u_into` with NaN above each chunk's diagonal of A (memory the solve never writes) gives
    w and u of the lower triangle (grouped value heads, a last chunk cut short); on a GPU with fla, the bits of fla's
    w/u kernel given the zero-filled A at the same launch."""
    from engine.kernels.delta_rule_inputs import w_u_into

    g = torch.Generator().manual_seed(22)
    B, T, H, HV, K, V, chunk = 2, 100, 2, 4, 32, 16, 64
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g), dim=-1)
    v = torch.randn(B, T, HV, V, generator=g)
    beta, decay = torch.rand(B, T, HV, generator=g), -torch.rand(B, T, HV, generator=g).cumsum(1) * 0.1
    lower = torch.randn(B, T, HV, chunk, generator=g) * 0.1
    rows = torch.arange(T) % chunk                                   # a token's row inside its chunk
    above = torch.arange(chunk)[None, :] > rows[:, None]             # [T, chunk]
    A = lower.masked_fill(above[None, :, None, :], float("nan"))
    zeroed = lower.masked_fill(above[None, :, None, :], 0.0)
    dtype = torch.float32 if not torch.cuda.is_available() else torch.bfloat16
    on = lambda *ts: [t.to(DEV, dtype) for t in ts]  # noqa: E731
    k_, v_, A_, zeroed_ = on(k, v, A, zeroed)
    beta_, decay_ = beta.to(DEV), decay.to(DEV)
    w, u = torch.empty(B, T, HV, K, device=DEV, dtype=dtype), torch.empty(B, T, HV, V, device=DEV, dtype=dtype)
    w_u_into(w, u, k_, v_, beta_, A_, decay_, chunk, (4, 3))
    kv = k.repeat_interleave(HV // H, dim=2)
    want_w, want_u = torch.empty(B, T, HV, K), torch.empty(B, T, HV, V)
    for start in range(0, T, chunk):
        c = slice(start, min(start + chunk, T))
        n = c.stop - start
        a_c = zeroed[:, c, :, :n].permute(0, 2, 1, 3)                 # [B, HV, n, n]
        bv = (v[:, c] * beta[:, c, :, None]).permute(0, 2, 1, 3)
        bk = (kv[:, c] * (beta[:, c] * torch.exp2(decay[:, c]))[..., None]).permute(0, 2, 1, 3)
        want_u[:, c] = (a_c @ bv).permute(0, 2, 1, 3)
        want_w[:, c] = (a_c @ bk).permute(0, 2, 1, 3)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(w.cpu().float(), want_w, atol=tol, rtol=tol)
    torch.testing.assert_close(u.cpu().float(), want_u, atol=tol, rtol=tol)
    if torch.cuda.is_available() and _has_fla():
        from engine.kernels import cuda_fast
        fla_w, fla_u = torch.empty_like(w), torch.empty_like(u)
        cuda_fast.w_u_into(fla_w, fla_u, k_, v_, beta_, zeroed_, decay_, (4, 3))
        assert torch.equal(w, fla_w) and torch.equal(u, fla_u)


@pytest.mark.parametrize("rows", [1, 8], ids=["small-grid", "large-grid"])
def test_fixed_wy_launches_give_flas_w_and_u(rows):
    """`cuda_fast.WY_LAUNCH` / `WY_SMALL_LAUNCH` (batch 1 starts 48 solve programs, batch 8 384) against fla's
    `chunk_gated_delta_rule_fwd_intra` (autotuned, or pinned if an engine was built); and the same bits from one call
    to the next."""
    pytest.importorskip("fla")
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
    from fla.ops.gated_delta_rule.gate import gdn_gate_chunk_cumsum
    from fla.ops.utils.constant import RCP_LN2

    from engine.kernels import cuda_fast

    g = torch.Generator().manual_seed(5)
    T, H, HV, K, V = 184, 16, 16, 128, 128
    k = torch.nn.functional.normalize(torch.randn(rows, T, H, K, generator=g), dim=-1).to(DEV, torch.bfloat16)
    v = torch.randn(rows, T, HV, V, generator=g).to(DEV, torch.bfloat16)
    beta = torch.rand(rows, T, HV, generator=g).to(DEV, torch.bfloat16)
    a = torch.randn(rows, T, HV, generator=g).to(DEV, torch.bfloat16)
    decay = gdn_gate_chunk_cumsum(g=a, A_log=torch.randn(HV, generator=g).to(DEV), chunk_size=64, scale=RCP_LN2,
                                  dt_bias=torch.randn(HV, generator=g).to(DEV))
    want_w, want_u, _ = chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=decay, beta=beta, chunk_size=64)
    w, u = cuda_fast._wy_representation(k, v, decay, beta)
    for got, want in ((w, want_w), (u, want_u)):
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    again = cuda_fast._wy_representation(k, v, decay, beta)
    assert torch.equal(again[0], w) and torch.equal(again[1], u)


def test_flas_autotuned_kernels_run_one_pinned_launch_untimed():
    """`cuda_fast.pin_autotuned_launches`: each autotuned fla kernel on the engine's paths keeps one candidate, the
    one asked for where fla offers it, and fla's whole forward then runs without timing any (what makes two
    processes compute a prefix with the same bits)."""
    pytest.importorskip("fla")
    from engine.kernels import cuda_fast

    launches = cuda_fast.pin_autotuned_launches()
    assert launches == cuda_fast.pin_autotuned_launches()            # idempotent
    for kernel, settings in cuda_fast.PINNED_LAUNCHES:
        (config,) = kernel.fn.configs
        assert launches[kernel.fn.base_fn.__name__] == str(config)
        candidates = cuda_fast._CANDIDATES[kernel]
        offered = [c for c in candidates if all((getattr(c, key) if key.startswith("num_") else c.kwargs.get(key))
                                                == value for key, value in settings.items())]
        # the launch asked for where fla offers it on this device, else fla's first candidate
        assert config is (offered or candidates)[0], kernel
    if DEV != "cuda":
        return          # Triton's interpreter cannot run fla's loops
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    g = torch.Generator().manual_seed(3)
    q, k = (torch.nn.functional.normalize(torch.randn(2, 130, 4, 64, generator=g), dim=-1).to(DEV, torch.bfloat16)
            for _ in range(2))
    v = torch.randn(2, 130, 8, 64, generator=g).to(DEV, torch.bfloat16)
    a, b = (torch.randn(2, 130, 8, generator=g).to(DEV, torch.bfloat16) for _ in range(2))
    chunk_gated_delta_rule(q, k, v, g=a, beta=b, output_final_state=True, use_gate_in_kernel=True,
                           A_log=torch.randn(8, device=DEV), dt_bias=torch.randn(8, device=DEV),
                           use_beta_sigmoid_in_kernel=True)
    assert all(not kernel.fn.cache for kernel, _ in cuda_fast.PINNED_LAUNCHES)


def _chunk_outputs_reference(q, k, h, v_new, g, scale, chunk):
    """fla's output kernel written out in PyTorch: per chunk, q h (the state entering it) and the chunk's own causal
    q k^T applied to its new values, both decayed by the gate."""
    B, T, H, K = q.shape
    HV, V = v_new.shape[2], v_new.shape[3]
    o = torch.empty(B, T, HV, V, dtype=v_new.dtype)
    for b in range(B):
        for hv in range(HV):
            qh, kh = q[b, :, hv // (HV // H)].float(), k[b, :, hv // (HV // H)].float()
            for c in range(-(-T // chunk)):
                t = slice(c * chunk, min((c + 1) * chunk, T))
                g_c = g[b, t, hv].float()
                inter = (qh[t] @ h[b, c, hv].float()) * torch.exp2(g_c)[:, None]
                A = (qh[t] @ kh[t].T) * torch.exp2(g_c[:, None] - g_c[None, :])
                A = torch.tril(A).to(v_new.dtype).float()
                o[b, t, hv] = (inter * scale + (A @ v_new[b, t, hv].float()) * scale).to(v_new.dtype)
    return o


@pytest.mark.parametrize("dtype", [
    torch.float32,
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton 3.6's "
                 "interpreter multiplies bf16 tiles wrongly"))])
@pytest.mark.parametrize("K", [16, 128])
def test_chunk_outputs_indexed_fuses_the_state_and_output_kernels(K, dtype):
    """The delta rule's fused state-and-output kernel: the output of the state kernel followed by fla's output
    kernel (written out in PyTorch), rows starting from their bank entries."""
    from engine.kernels.indexed_delta_rule import CHUNK, chunk_outputs_indexed, chunk_states_indexed

    q, k, w, u, decay, bank = _wy_inputs(3, K, dtype, seed=13)
    index = torch.tensor([3, 0, 3])
    on = lambda *ts: [t.to(DEV) for t in ts]  # noqa: E731
    scale = K ** -0.5
    got = chunk_outputs_indexed(*on(q, k, w, u, decay, bank, index), scale).cpu()
    h, v_new = (t.cpu() for t in chunk_states_indexed(*on(k, w, u, decay, bank, index)))
    want = _chunk_outputs_reference(q, k, h, v_new, decay, scale, CHUNK)
    tol = 1e-4 if dtype == torch.float32 and DEV == "cpu" else 3e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    # (128, 8, 2) needs more shared memory than the H200 has for float32 tiles
    for config in ((32, 4, 2), (32, 2, 2), (16, 2, 2)) + (((128, 8, 2),) if dtype == torch.bfloat16 else ()):
        assert _same_across_tiles(chunk_outputs_indexed(*on(q, k, w, u, decay, bank, index), scale,
                                                        config=config).cpu(), got), config


def _suffix_attention_inputs(dtype, seed: int):
    """q [B, Hq, T, D], k [B, Hkv, T, D], v (a strided view, as the forward's), a bank of 4 prefixes' K/V of lengths
    80, 5, 33 and 1, the rows' slots and the gate [B, T, Hq, D] (a strided half): B = 3, T = 70, G = 2, D = 32."""
    g = torch.Generator().manual_seed(seed)
    S, Hkv, G, N, D, B, T = 4, 2, 2, 80, 32, 3, 70
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(DEV, dtype)  # noqa: E731
    bank_k, bank_v = rnd(S, Hkv, N, D), rnd(S, Hkv, N, D)
    lengths = torch.tensor([80, 5, 33, 1], dtype=torch.int32, device=DEV)
    slots = torch.tensor([2, 0, 3], device=DEV)
    q, k = rnd(B, Hkv * G, T, D), rnd(B, Hkv, T, D)
    v = rnd(B, T, Hkv, 2 * D)[..., D:].transpose(1, 2)
    gate = torch.chunk(rnd(B, T, Hkv * G, 2 * D), 2, dim=-1)[1]
    return q, k, v, bank_k, bank_v, lengths, slots, gate


def _suffix_attention_reference(q, k, v, bank_k, bank_v, lengths, slots, gate, scale):
    """One softmax per row over [its prefix's keys from its bank entry | its causal suffix keys], in float32, then
    transformers' rounding of the output and its sigmoid gate."""
    B, Hq, T, D = q.shape
    G = Hq // k.shape[1]
    out = torch.empty(B, T, Hq, D)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for b in range(B):
        s, n = slots[b].item(), lengths[slots[b]].item()
        keys = torch.cat([bank_k[s, :, :n], k[b]], 1).float().repeat_interleave(G, 0)        # [Hq, n + T, D]
        values = torch.cat([bank_v[s, :, :n], v[b]], 1).float().repeat_interleave(G, 0)
        scores = (q[b].float() @ keys.transpose(-1, -2)) * scale                               # [Hq, T, n + T]
        keep = torch.cat([torch.ones(T, n, dtype=torch.bool), causal], 1)
        o = torch.softmax(scores.masked_fill(~keep, float("-inf")), -1) @ values                 # [Hq, T, D]
        out[b] = o.to(q.dtype).float().transpose(0, 1) * torch.sigmoid(gate[b].float()).to(q.dtype).float()
    return out.reshape(B, T, Hq * D).to(q.dtype)


@pytest.mark.parametrize("dtype", [
    torch.float32,
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton 3.6's "
                 "interpreter multiplies bf16 tiles wrongly"))])
@pytest.mark.parametrize("config", ["large", "small"])
def test_suffix_attention_is_one_softmax_over_the_rows_prefix_and_causal_suffix(dtype, config, monkeypatch):
    """The one-kernel attention of a suffix pass: row b's queries against bank entry slots[b]'s keys up to that
    prefix's length and its own suffix keys up to its position (key blocks crossing both the prefix's end and the
    causal diagonal), gated; strided suffix values and gate as the forward passes them. A row's output is the same
    bits whatever rows share its launch."""
    from engine.kernels import suffix_attention as sa

    monkeypatch.setattr(sa, "FILL_PROGRAMS", 0 if config == "large" else 10 ** 9)
    q, k, v, bank_k, bank_v, lengths, slots, gate = _suffix_attention_inputs(dtype, seed=17)
    B, Hq, T, D = q.shape
    got = sa.suffix_attention(q, k, v, bank_k, bank_v, lengths, slots, gate, 0.2)
    want = _suffix_attention_reference(*(t.cpu() for t in (q, k, v, bank_k, bank_v, lengths, slots, gate)), 0.2)
    assert got.shape == (B, T, Hq * D)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.cpu(), want, atol=tol, rtol=tol)
    alone = sa.suffix_attention(q[1:2], k[1:2], v[1:2], bank_k, bank_v, lengths, slots[1:2], gate[1:2], 0.2)
    assert torch.equal(alone, got[1:2])


@pytest.mark.parametrize("dtype", [
    torch.float32,
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton 3.6's "
                 "interpreter multiplies bf16 tiles wrongly"))])
def test_answer_attention_is_the_suffix_attention_at_the_answer_rows(dtype):
    """The last layer's attention at the answer slots alone: each answer of row b (rows of different answer counts,
    one with none, the step's padding answers pointing at token 0) against bank entry slots[b]'s prefix keys and its
    own suffix keys up to its position, gated: the whole-row reference at those tokens, and zero at the padding. A
    row's answers get the same bits whatever rows share the launch."""
    from engine.kernels import suffix_attention as sa

    q_all, k, v, bank_k, bank_v, lengths, slots, gate_all = _suffix_attention_inputs(dtype, seed=23)
    B, Hq, T, D = q_all.shape
    positions = [[3, 40, 69], [], [0, 8, 64, 65, 66]]                        # row 1 has no answers
    per_row = 8
    tokens = [b * T + t for b, ts in enumerate(positions) for t in ts]
    rows = torch.zeros(B * per_row, dtype=torch.int64)                        # padding answers: token 0
    rows[:len(tokens)] = torch.tensor(tokens)
    counts = torch.tensor([len(ts) for ts in positions])
    starts = counts.cumsum(0) - counts
    q = q_all.permute(0, 2, 1, 3).reshape(B * T, Hq, D)[rows.to(DEV)]        # [S, Hq, D] at the answer rows
    gate = gate_all.reshape(B * T, Hq, D)[rows.to(DEV)]
    args = (bank_k, bank_v, lengths, slots, rows.to(DEV), starts.to(DEV), counts.to(DEV))
    got = sa.answer_attention(q, k, v, *args[:4], *args[4:], gate, 0.2)
    want = _suffix_attention_reference(*(t.cpu() for t in (q_all, k, v, bank_k, bank_v, lengths, slots, gate_all)),
                                       0.2).reshape(B * T, Hq * D)[rows[:len(tokens)]]
    assert got.shape == (B * per_row, Hq * D)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got[:len(tokens)].cpu(), want, atol=tol, rtol=tol)
    assert not got[len(tokens):].any()
    # row 2 alone: its answers first, in a batch of one row
    alone_rows = rows[3:8] - 2 * T
    alone = sa.answer_attention(q[3:8], k[2:3], v[2:3], bank_k, bank_v, lengths, slots[2:3], alone_rows.to(DEV),
                                torch.zeros(1, dtype=torch.int64, device=DEV), counts[2:3].to(DEV), gate[3:8], 0.2)
    assert torch.equal(alone, got[3:8])


@pytest.mark.parametrize("launch", ["large", "small"])
def test_suffix_and_answer_attention_give_a_row_the_same_bits_in_any_batch(launch):
    """What the batch-invariant table relies on: at one launch configuration, a row's suffix attention and its
    answers' attention are the same bits alone (R = 1, T = its length) and placed among random neighbours (other
    prefixes of other lengths, other answer counts and positions, random padding) in batches of other sizes padded
    to other lengths; and they agree with the reference."""
    from engine.kernels import suffix_attention as sa

    from .attention_cases import Case, answer_args, probe_in_placements

    config = sa.CONFIG if launch == "large" else sa.SMALL_CONFIG
    case = Case((4, 2, 32), (80, 5, 33, 1), 80, torch.float32, DEV, seed=5)

    def attention(*args):
        return sa.suffix_attention(*args, configs=(config, None))

    rows = probe_in_placements(case, attention, sa.answer_attention, [(2, 37), (3, 45), (5, 70), (4, 64)], L=37,
                               slot=2, probe_answers=[3, 20, 36], per_row=4, scale=0.2)
    assert all(r["suffix_equal"] and r["answers_equal"] for r in rows), rows
    # and the kernels compute the attention: one placement against the reference
    import random
    batch = case.batch(case.row(30), 0, 3, 41, 1, random.Random(1))
    want = _suffix_attention_reference(*(t.cpu() for t in case.suffix_args(batch)), 0.2)
    torch.testing.assert_close(attention(*case.suffix_args(batch), 0.2).cpu(), want, atol=2e-5, rtol=2e-5)
    kw, _ = case.answers(batch, [0, 29], 4, 1, random.Random(2))
    got = sa.answer_attention(*answer_args(kw), 0.2)
    n = int(kw["counts"].sum())
    torch.testing.assert_close(got[:n].cpu(), want.reshape(-1, want.shape[-1])[kw["rows"][:n].cpu()], atol=2e-5,
                               rtol=2e-5)


def test_the_invariant_suffix_attention_takes_the_small_launch_only_where_it_gives_the_large_ones_bits(monkeypatch):
    """`InvariantSuffixAttention` runs `CONFIG` at every batch size unless the check on the device
    (`suffix_configs_agree`) shows a small launch giving its bits; then that one where the large launch gives too few
    programs, as the fast table does. Without heads (no check possible) the large launch always."""
    from engine.kernels import cuda_deterministic as bi
    from engine.kernels import suffix_attention as sa

    from .attention_cases import Case

    assert sa.InvariantSuffixAttention(None, torch.float32, DEV).small is None
    checked = []
    monkeypatch.setattr(sa, "suffix_configs_agree",
                        lambda heads, dtype, device, large, small: checked.append(small) or small == (64, 64, 4, 2))
    attention = sa.InvariantSuffixAttention((4, 2, 32), torch.float32, DEV)
    assert checked == list(sa.SUFFIX_SMALL_CANDIDATES) and attention.small == (64, 64, 4, 2)
    assert attention.large == sa.CONFIG and "(64, 64, 4, 2)" in repr(attention)
    monkeypatch.setattr(sa, "suffix_configs_agree", lambda *a: False)
    attention = sa.InvariantSuffixAttention((4, 2, 32), torch.float32, DEV)
    assert attention.small is None and "always" in repr(attention)
    # its launch at one row is the large one, where the fast table's would be the small one
    launches = []
    monkeypatch.setattr(sa, "_suffix_attention_kernel", _LaunchSpy(sa._suffix_attention_kernel, launches))
    case = Case((4, 2, 32), (80, 5, 33, 1), 80, torch.float32, DEV, seed=7)
    import random
    args = case.suffix_args(case.batch(case.row(9), 1, 1, 9, 0, random.Random(0)))
    attention(*args, 0.2)
    sa.suffix_attention(*args, 0.2)
    assert [bm for bm, _ in launches] == [sa.CONFIG[0], sa.SMALL_CONFIG[0]]


def test_suffix_configs_agree_compares_two_launches_on_the_device():
    """The load-time check runs (in the interpreter: numpy's tile products may or may not round alike, so only its
    type is asserted; on the GPU its answer is what the deterministic table logs), and refuses a key block that
    differs."""
    from engine.kernels import cuda_deterministic as bi
    from engine.kernels import suffix_attention as sa

    assert isinstance(sa.suffix_configs_agree((4, 2, 32), torch.float32, DEV, sa.CONFIG, sa.SMALL_CONFIG), bool)
    assert not sa.suffix_configs_agree((4, 2, 32), torch.float32, DEV, sa.CONFIG, (16, 32, 4, 2))


class _LaunchSpy:
    """A Triton kernel's `kernel[grid](...)`, recording each launch's (BM, grid) before running it."""

    def __init__(self, kernel, launches: list):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((kwargs["BM"], grid))
            return self.kernel[grid](*args, **kwargs)
        return launch


def test_the_deterministic_forward_with_triton_attention_scores_a_state_the_same_in_any_batch(tmp_path):
    """The deterministic table's attention in a whole forward: the CPU's batch-invariant table with the one-kernel
    suffix attention (launched as the deterministic CUDA table launches it) and the answers' attention in place of its
    row-by-row attention, on an 8-layer tiny model (two full-attention layers: the first runs the suffix kernel, the
    last the answers' kernel, at every batch size, one row included). A state's probabilities are the same bits alone
    and in shuffled batches of other states (other lengths, so other padded lengths), packed and independent; and
    they match the oracle."""
    import dataclasses
    import random

    from engine import Engine, SchemaEngine
    from engine.kernels.suffix_attention import InvariantSuffixAttention
    from engine.reference import score_full
    from engine.kernels.suffix_attention import answer_attention
    from engine.testing import write_tiny_model

    from ..conftest import make_questions, make_states

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_cols", [5, 1024, 2560, 8192])
def test_row_logsumexp_is_each_rows_own_whatever_the_rows_beside_it(dtype, n_cols):
    """The label mass's log-sum-exp (`engine.label_mass`): torch's value, columns past n_cols ignored (the last vocabulary
    chunk's padding, filled here with values that would dominate), the same bits for a row alone and among others, and
    written into a strided column of a table."""
    from engine.kernels.pytorch import torch_row_logsumexp
    from engine.kernels.fused import row_logsumexp

    g = torch.Generator().manual_seed(n_cols)
    x = (torch.randn(37, n_cols + 64, generator=g) * 4).to(DEV, dtype)
    x[:, n_cols:] = 1e4
    got = row_logsumexp(x, n_cols)
    torch.testing.assert_close(got, torch_row_logsumexp(x, n_cols), atol=1e-5, rtol=1e-5)
    alone = torch.cat([row_logsumexp(x[i:i + 1], n_cols) for i in range(0, 37, 6)])
    assert torch.equal(alone, got[0:37:6])
    table = torch.full((37, 3), -1.0, device=DEV)
    row_logsumexp(x, n_cols, out=table[:, 1])
    assert torch.equal(table[:, 1], got) and (table[:, [0, 2]] == -1).all()
