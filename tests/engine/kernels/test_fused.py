"""engine.kernels.fused (norms, q/k norm + RoPE, the attention's gate, SwiGLU, a row's log-sum-exp) against the PyTorch
formulas the CPU path uses (transformers' semantics), on strided views like the forward passes them. Runs on the GPU; on
a CPU through Triton's interpreter, which Triton reads when it is first imported (before this module, by transformers):
`TRITON_INTERPRET=1 pytest -m gpu tests/engine/kernels/` with triton installed and fla not (where fla imports,
transformers' CPU forward dispatches to its GPU kernels)."""

import pytest
import torch

from tests.engine.kernels.triton_device import fused_pieces, require

ON_GPU, DEV = require()

from engine.kernels.pytorch import torch_gated_rms_norm, torch_rms_norm  # noqa: E402
from engine.kernels.fused import GATED, row_norm  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_on_hidden_rows_and_strided_heads(dtype):
    hidden, heads = fused_pieces(37, [64, 4 * 32], dtype)
    w64 = torch.rand(64, device=DEV) + 0.5
    w32 = torch.rand(32, device=DEV) + 0.5
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(row_norm(hidden, w64, 1e-6), torch_rms_norm(hidden, w64, 1e-6), atol=tol, rtol=tol)
    per_head = heads.view(37, 4, 32)                               # rows (token, head), token stride 192
    torch.testing.assert_close(row_norm(per_head, w32, 1e-6), torch_rms_norm(per_head, w32, 1e-6), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm_rounds_like_transformers(dtype):
    x, z = fused_pieces(29, [3 * 16, 3 * 16], dtype, seed=1)
    x = x.contiguous().view(29, 3, 16)
    z = z.view(29, 3, 16)
    w = (torch.rand(16) + 0.5).to(DEV, dtype)
    got, want = row_norm(x, w, 1e-6, GATED, z), torch_gated_rms_norm(x, z, w, 1e-6)
    assert got.shape == x.shape and got.is_contiguous()
    # bf16: a one-ulp difference of the rounded normalised value is multiplied by weight x silu(gate) (~10 here)
    atol, rtol = (1e-5, 1e-5) if dtype == torch.float32 else (1e-2, 3e-2)
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_on_the_halves_of_the_fused_gate_up_projection(dtype):
    import torch.nn.functional as F

    from engine.kernels.fused import swiglu

    gate, up = fused_pieces(2 * 19, [1536, 1536], dtype, seed=9)         # 1536: two column blocks, the second partial
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

    h, x = (t.contiguous() for t in fused_pieces(3 * 7, [64, 64], dtype, seed=5))
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

    h, x = (t.contiguous() for t in fused_pieces(2 * 9, [1024, 1024], torch.bfloat16, seed=11))
    w = torch.rand(1024, device=DEV) + 0.5
    heads, gate = fused_pieces(2 * 9 * 3, [128, 128], torch.bfloat16, seed=12)
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
    qg, k, _v = fused_pieces(B * T, [Hq * 2 * D, Hkv * D, Hkv * D], dtype, seed=7)
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_cols", [5, 1024, 2560, 8192])
def test_row_logsumexp_is_each_rows_own_whatever_the_rows_beside_it(dtype, n_cols):
    """The label mass's log-sum-exp (`engine.label_mass`): torch's value, columns past n_cols ignored (the last
    vocabulary chunk's padding, filled here with values that would dominate), the same bits for a row alone and among
    others, and written into a strided column of a table."""
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


@pytest.mark.parametrize("rows", [1, 10, 129, 1280])
def test_ordered_mass_is_the_label_mass_loop_bit_for_bit(rows):
    """The label mass's sum of shares in one launch (`engine.kernels.fused.ordered_mass`) gives the bits of
    `engine.label_mass.label_mass`'s loop of torch adds: the same left-to-right order of float32 adds, masked options
    adding exact zeros, a sum rounded above 1 clamped, a NaN kept. Rows past a program's 128 and a strided table too."""
    from engine.kernels.fused import ordered_mass
    from engine.label_mass import label_mass
    from engine.prompt import MAX_OPTIONS

    g = torch.Generator().manual_seed(rows)
    lse = (torch.randn(rows, generator=g) * 3 + 8).to(DEV)
    # logits near the log-sum-exp, so that shares are large and many sums round differently in another order
    logits = (lse.cpu()[:, None] + torch.randn(rows, 2 * MAX_OPTIONS, generator=g) - 1.5).to(DEV)[:, ::2]
    n_options = torch.randint(2, MAX_OPTIONS + 1, (rows,), generator=g).to(DEV)
    mask = torch.arange(MAX_OPTIONS, device=DEV)[None, :] < n_options[:, None]
    logits[0, 0] = lse[0] + 0.5                                      # a share above 1: clamped
    if rows > 2:
        logits[2, 1] = float("nan")                                   # kept, as torch's clamp keeps it
    want = label_mass(logits, lse, mask)
    got = label_mass(logits, lse, mask, ordered_mass)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(-1.0), want.nan_to_num(-1.0))
    assert got[0] == 1.0
    assert not logits.is_contiguous()
