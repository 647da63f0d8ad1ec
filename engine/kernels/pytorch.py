"""The PyTorch kernels: exactly what transformers' Qwen3.5 modules compute, in their order of rounding.

What the CPU path (tests, the demo) runs (`engine.kernels.table.torch_kernels` is their table), and the reference the
Triton kernels are tested against.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb, l2norm, torch_chunk_gated_delta_rule

from engine.kernels.attention import AttentionOut, row_major

# transformers wraps its reference function to dispatch to fla whenever fla imports, whatever the device; the CPU
# path needs the PyTorch original underneath.
_chunk_gated_delta_rule = getattr(torch_chunk_gated_delta_rule, "__wrapped__", torch_chunk_gated_delta_rule)


def by_index(states: torch.Tensor | None, index: torch.Tensor | None) -> torch.Tensor | None:
    """Row b's entry of ``states`` (e.g. the prefix bank's [S, ...]) for each b of ``index`` [B], gathered as
    [B, ...]; ``states`` itself where there is no index (already one entry per row, or None)."""
    return states if index is None else states.index_select(0, index)


def torch_delta_rule(q, k, v, a, b, A_log, dt_bias, initial_state, output_final_state, initial_index=None):
    initial_state = by_index(initial_state, initial_index)
    # transformers' Gated DeltaNet: the gate and beta in float32 / the input dtype, q and k repeated per value head
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)                          # [B, T, Hv]
    if v.shape[2] > q.shape[2]:
        rep = v.shape[2] // q.shape[2]
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)       # [B, T, Hv, Dk]
    return _chunk_gated_delta_rule(q, k, v, g=g, beta=b.sigmoid(), initial_state=initial_state,
                                   output_final_state=output_final_state)


def torch_causal_conv(x: torch.Tensor, weight: torch.Tensor, prev: torch.Tensor | None) -> torch.Tensor:
    """x [B, T, C], weight [C, K], prev [B, C, K-1] | None -> silu(depthwise causal conv) [B, T, C]."""
    K = weight.shape[1]
    xt = x.transpose(1, 2)                                                             # [B, C, T]
    full = F.pad(xt, (K - 1, 0)) if prev is None else torch.cat([prev.to(x.dtype), xt], -1)   # [B, C, K-1+T]
    return F.silu(F.conv1d(full, weight[:, None, :], groups=weight.shape[0])).transpose(1, 2)


def torch_conv_qkv(x: torch.Tensor, weight: torch.Tensor, prev: torch.Tensor | None, key_dim: int, head_k_dim: int,
                   head_v_dim: int, gates: torch.Tensor, prev_index: torch.Tensor | None = None):
    B, T, _ = x.shape
    prev = by_index(prev, prev_index)
    q, k, v = torch_causal_conv(x, weight, prev).split([key_dim, key_dim, x.shape[-1] - 2 * key_dim], dim=-1)
    # transformers normalises q and k in float32 (inside its delta rule, to match fla): the same numbers
    q, k = (l2norm(t.reshape(B, T, -1, head_k_dim).float(), dim=-1, eps=1e-6).to(x.dtype) for t in (q, k))
    return (q, k, v.reshape(B, T, -1, head_v_dim), *gates.chunk(2, dim=-1))           # [B, T, H, D] each; b, a


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)


def torch_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight)


def torch_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def torch_qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps, q_cos=None, q_sin=None):
    q = torch_rms_norm(q, q_weight, eps).transpose(1, 2)                               # [B, Hq, T, D]
    k = torch_rms_norm(k, k_weight, eps).transpose(1, 2)                               # [B, Hkv, T, D]
    if q_cos is None:
        return apply_rotary_pos_emb(q, k, cos, sin)
    return apply_rotary_pos_emb(q, q, q_cos, q_sin)[0], apply_rotary_pos_emb(k, k, cos, sin)[0]


def torch_gate_attention(a: AttentionOut, gate: torch.Tensor, sigmoid=torch.sigmoid) -> torch.Tensor:
    """sigmoid: the batch-invariant table passes its own (`engine.kernels.cpu_deterministic.sigmoid`)."""
    o = a.o
    B, Hq, T, D = o.shape
    if a.o_pre is not None:
        o_pre = row_major(a.o_pre, a.R).reshape(B, Hq, T, D)
        lse_pre = row_major(a.lse_pre[..., None], a.R).reshape(B, Hq, T)
        w_pre = sigmoid(lse_pre - a.lse)[..., None]                                 # share of the prefix keys
        o = (o + (o_pre - o) * w_pre).to(o.dtype)
    return o.transpose(1, 2).reshape(B, T, -1) * sigmoid(gate.reshape(B, T, -1))   # [B, T, Hq * D]


def torch_add_rms_norm(h: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float):
    h = h + x
    return torch_rms_norm(h, weight, eps), h


def torch_add_linear(h: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """h += x @ weight^T in place, by one GEMM whose epilogue adds h (cuBLAS's beta = 1): the sum is rounded once,
    where transformers rounds the projection, then the sum. `Kernels.add_linear`; h contiguous."""
    rows = h.view(-1, h.shape[-1])
    rows.addmm_(x.reshape(-1, x.shape[-1]), weight.t())
    return h


def torch_gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # transformers' order: normalise in float32, cast, scale, then gate in float32
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return ((weight * normed) * F.silu(gate.float())).to(x.dtype)


def torch_row_logsumexp(x: torch.Tensor, n_cols: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [S, N] -> [S] float32: log(sum(exp(x[:, :n_cols]))) per row (into `out` when given)."""
    lse = torch.logsumexp(x[:, :n_cols].float(), -1)
    return lse if out is None else out.copy_(lse)
