"""The Gated DeltaNet's decay and beta for a suffix pass: beta = sigmoid(b) and the chunk-local cumulative log2 decay g
in one kernel (`decay_and_beta`), where fla launches `fused_beta_sigmoid` and `gdn_gate_chunk_cumsum` (two kernels a
layer), and the same chunk's work as a jit body (`decay_chunk`) that the causal conv's small launch runs in extra
programs of its own (`engine.kernels.causal_conv.conv_qkv_decay`, batch 1: one launch a layer fewer).

The arithmetic is fla's, in fla's order: the sigmoid, fla's `softplus` and `exp`, the same scan over a chunk's 64 decays
at fla's pinned launch (1 warp: the scan's tree follows the warps). Every launch that runs `decay_chunk` runs it at one
warp, so g has the same bits wherever it is made (`tests/engine/kernels/test_causal_conv.py`, and on the GPU
`tests/engine/kernels/test_delta_rule.py` against fla's own kernels).

Triton's interpreter runs these on a CPU: without fla installed, `softplus` is the formula fla itself uses off
NVIDIA GPUs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.pdl import await_previous_kernel, pdl_launch

try:   # fla's softplus: inline PTX on NVIDIA GPUs, so that the decay has the bits of fla's own gate kernel
    from fla.ops.utils.softplus import softplus as _softplus
except ImportError:
    @triton.jit
    def _softplus(x):
        return tl.where(x < 20.0, tl.math.log(1 + tl.math.exp(x)), x)

DECAY_WARPS = 1
"""Warps of every launch that runs `decay_chunk`: fla's first candidate for its gate kernel, the one
`engine.kernels.cuda_fast` pins (the scan's summation tree follows the warps, so a launch at other warps would give
other bits)."""


@triton.jit
def decay_chunk(a, b, A_log, dt_bias, g, beta, T, row_stride, token_stride, scale, i_t, i_b, i_h, H: tl.constexpr,
                BT: tl.constexpr):
    # chunk i_t of row i_b's head i_h: fla's `gdn_gate_chunk_cumsum_scalar_kernel` plus the sigmoid; a, b read at
    # i_b * row_stride + token * token_stride + i_h (a strided view of the fused projection, or contiguous), g and beta
    # written contiguous [B, T, H]
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    src = i_b * row_stride + o_t * token_stride + i_h
    at = (i_b * T + o_t) * H + i_h
    b_b = tl.load(b + src, mask=m_t, other=0.0).to(tl.float32)
    tl.store(beta + at, tl.sigmoid(b_b).to(beta.dtype.element_ty), mask=m_t)
    b_a = tl.load(a + src, mask=m_t, other=0.0).to(tl.float32) + tl.load(dt_bias + i_h).to(tl.float32)
    b_gate = -tl.exp(tl.load(A_log + i_h).to(tl.float32)) * _softplus(b_a)
    b_o = tl.cumsum(b_gate, axis=0)
    b_o *= scale
    tl.store(g + at, b_o.to(g.dtype.element_ty), mask=m_t)


@triton.jit(do_not_specialize=["T"])
def _decay_and_beta_kernel(a, b, A_log, dt_bias, g, beta, T, row_stride, token_stride, scale, H: tl.constexpr,
                           BT: tl.constexpr, PDL: tl.constexpr = False):
    # one program: one chunk of one row's head
    await_previous_kernel(PDL)
    i_t, i_bh = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    decay_chunk(a, b, A_log, dt_bias, g, beta, T, row_stride, token_stride, scale, i_t, i_bh // H, i_bh % H, H, BT)


def decay_and_beta(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, chunk: int,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """a, b [B, T, H] (contiguous along H, and of the same strides: contiguous, or views of one projection's output)
    -> (g, beta), both [B, T, H] float32 and contiguous: g the cumulative sum, within each chunk of `chunk` tokens, of
    -exp(A_log) * softplus(a + dt_bias), times scale (fla's `gdn_gate_chunk_cumsum`); beta = sigmoid(b) (fla's
    `fused_beta_sigmoid`)."""
    B, T, H = a.shape
    if a.stride() != b.stride() or a.stride(-1) != 1:
        raise ValueError(f"a and b need one layout, contiguous along the heads: strides {a.stride()}, {b.stride()}")
    g, beta = (torch.empty(B, T, H, dtype=torch.float32, device=a.device) for _ in range(2))
    if B * T:
        _decay_and_beta_kernel[(triton.cdiv(T, chunk), B * H)](a, b, A_log, dt_bias, g, beta, T, a.stride(0),
                                                               a.stride(1), scale, H=H, BT=chunk,
                                                               num_warps=DECAY_WARPS, **pdl_launch())
    return g, beta
