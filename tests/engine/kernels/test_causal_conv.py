"""engine.kernels.causal_conv: the Gated DeltaNet's causal conv fused with the q/k L2 norms, against the PyTorch conv
the CPU path runs. Runs on the GPU, or on a CPU through Triton's interpreter (`tests/engine/kernels/test_fused.py` says
how)."""

import pytest
import torch

from tests.engine.kernels.triton_device import fused_pieces, require

ON_GPU, DEV = require()

pytestmark = pytest.mark.gpu


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
    qkv, _z, gates = fused_pieces(B * T, [C, Hv * Dv, 2 * Hv], dtype, seed=3)
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
    qkv, _z, gates = fused_pieces(B * T, [C, Hv * D, 2 * Hv], torch.bfloat16, seed=8)
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


@pytest.mark.parametrize("small", [(4, 1), (16, 1), None], ids=["batch-1-launch", "fewer-programs-than-chunks",
                                                                 "large-launch"])
def test_conv_qkv_decay_gives_the_conv_and_the_decay_kernels_bits(monkeypatch, small):
    """`conv_qkv_decay`: q, k, v as `conv_qkv` gives them, and beta and g as `decay.decay_and_beta` makes them from the
    gates, bit for bit, whether they are made by the conv launch's extra programs (its small launch at one warp, as
    the decay's own kernel; with more chunks than programs, several chunks a program) or by the decay's kernel reading
    the gates in place (the large launch): a row scored alone must get the bits it gets in a batch."""
    from engine.kernels import causal_conv
    from engine.kernels.causal_conv import conv_qkv, conv_qkv_decay
    from engine.kernels.decay import decay_and_beta

    B, T, Hk, D, Hv, KW, chunk, scale = 2, 150, 2, 16, 4, 4, 64, 1.4426950408889634
    C = 2 * Hk * D + Hv * D
    qkv, _z, gates = fused_pieces(B * T, [C, Hv * D, 2 * Hv], torch.bfloat16, seed=12)
    g = torch.Generator().manual_seed(13)
    weight = (torch.randn(C, KW, generator=g) * 0.5).to(DEV, torch.bfloat16).t().contiguous().t()
    prev = torch.randn(3, KW - 1, C, generator=g).to(DEV, torch.bfloat16).transpose(1, 2)
    A_log, dt_bias = torch.randn(Hv, generator=g).to(DEV), torch.randn(Hv, generator=g).to(DEV, torch.bfloat16)
    args = (qkv.view(B, T, C), weight, prev, Hk * D, D, D, gates.view(B, T, 2 * Hv), torch.tensor([2, 0], device=DEV))
    if small is not None:
        monkeypatch.setattr(causal_conv, "CONV_SMALL_CONFIG", small)
    monkeypatch.setattr(causal_conv, "CONV_FILL_PROGRAMS", 10 ** 9 if small else 0)
    q, k, v, b, a = conv_qkv(*args)
    want_g, want_beta = decay_and_beta(a, b, A_log, dt_bias, chunk, scale)
    got = conv_qkv_decay(*args, A_log, dt_bias, chunk, scale)
    for got_t, want_t in zip(got, (q, k, v, want_beta, want_g)):
        assert got_t.shape == want_t.shape and got_t.dtype == want_t.dtype and got_t.is_contiguous()
        assert torch.equal(got_t, want_t)
