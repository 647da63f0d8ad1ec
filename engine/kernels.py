"""The kernels behind the forward, chosen once per device.

On CUDA with flash-linear-attention (fla) installed: fla's Triton kernels for the Gated DeltaNet recurrence (with
the decay gate and beta's sigmoid computed inside it); from `engine.triton_kernels` (fixed launch configuration:
no per-shape autotuning, 16-byte loads) SwiGLU, the causal conv fused with the q/k L2 norms (continuing the
prefix's conv state in place: no per-row concatenation of the prefix's conv inputs, no copies of q, k, v), the
RMS/gated norms, the residual adds fused into them, q/k norm + RoPE, and the attention's merge with its output
gate. Elsewhere: PyTorch code that computes exactly what transformers' modules compute (what CPU tests run).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb, l2norm

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Kernels:
    """name;
    delta_rule(q, k, v, a, b, A_log, dt_bias, initial_state, output_final_state) -> (out, final state | None): the Gated
        DeltaNet recurrence, q and k already L2-normalised, decay g = -exp(A_log) * softplus(a + dt_bias) and
        beta = sigmoid(b), for q, k [B, T, Hk, Dk], v [B, T, Hv, Dv], a, b [B, T, Hv] and a [B, Hv, Dk, Dv] float32
        state;
    conv_qkv(x [B, T, C], weight [C, K], prev [B, C, K-1] | None, key_dim, head_k_dim, head_v_dim) -> (q, k, v):
        silu(causal conv) split into q, k [B, T, Hk, Dk] (each head L2-normalised, transformers' `l2norm`) and
        v [B, T, Hv, Dv]; prev: the previous K-1 inputs, oldest first;
    rms_norm(x, weight, eps), weight already 1 + w for Qwen3.5's zero-centred norms, float32;
    gated_rms_norm(x, gate, weight, eps) = norm(x) * weight * silu(gate);
    swiglu(gate, up) = silu(gate) * up;
    add_rms_norm(h, x, weight, eps) -> (rms_norm(h + x), h + x), the sum rounded to h's dtype before the norm as
        transformers does (h may be updated in place);
    qk_norm_rope(q [B, T, Hq, D], k [B, T, Hkv, D], q_weight, k_weight, cos, sin, eps) -> (q, k) as [B, H, T, D]: the
        attention's per-head RMSNorms, then transformers' `apply_rotary_pos_emb`;
    gate_attention(engine.model.AttentionOut, gate [B, T, Hq, D]) -> [B, T, Hq * D]: the merge of a prefix/suffix
        split attention (if any), then transformers' sigmoid output gate."""
    name: str
    delta_rule: Callable
    conv_qkv: Callable
    rms_norm: Callable
    gated_rms_norm: Callable
    swiglu: Callable
    add_rms_norm: Callable
    qk_norm_rope: Callable
    gate_attention: Callable


def select_kernels(device_type: str) -> Kernels:
    if device_type == "cuda":
        try:
            return _fla_kernels()
        except ImportError:
            log.warning("flash-linear-attention is not installed: the Gated DeltaNet layers run PyTorch fallbacks, "
                        "several times slower (pip install 'decider[gpu]')")
    return _torch_kernels()


def _torch_kernels() -> Kernels:
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule
    # transformers wraps its reference function to dispatch to fla whenever fla imports, whatever the device; the
    # CPU path needs the PyTorch original underneath.
    reference = getattr(torch_chunk_gated_delta_rule, "__wrapped__", torch_chunk_gated_delta_rule)

    def delta_rule(q, k, v, a, b, A_log, dt_bias, initial_state, output_final_state):
        # transformers' Gated DeltaNet: the gate and beta in float32 / the input dtype, q and k repeated per value head
        g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
        if v.shape[2] > q.shape[2]:
            rep = v.shape[2] // q.shape[2]
            q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
        return reference(q, k, v, g=g, beta=b.sigmoid(), initial_state=initial_state,
                         output_final_state=output_final_state)

    return Kernels("torch", delta_rule, torch_conv_qkv, torch_rms_norm, torch_gated_rms_norm,
                   lambda gate, up: F.silu(gate) * up, torch_add_rms_norm, torch_qk_norm_rope,
                   torch_gate_attention)


def torch_causal_conv(x: torch.Tensor, weight: torch.Tensor, prev: torch.Tensor | None) -> torch.Tensor:
    K = weight.shape[1]
    xt = x.transpose(1, 2)                                                             # [B, C, T]
    full = F.pad(xt, (K - 1, 0)) if prev is None else torch.cat([prev.to(x.dtype), xt], -1)
    return F.silu(F.conv1d(full, weight[:, None, :], groups=weight.shape[0])).transpose(1, 2)


def torch_conv_qkv(x: torch.Tensor, weight: torch.Tensor, prev: torch.Tensor | None, key_dim: int, head_k_dim: int,
                   head_v_dim: int):
    B, T, _ = x.shape
    q, k, v = torch_causal_conv(x, weight, prev).split([key_dim, key_dim, x.shape[-1] - 2 * key_dim], dim=-1)
    # transformers normalises q and k in float32 (inside its delta rule, to match fla): the same numbers
    q, k = (l2norm(t.reshape(B, T, -1, head_k_dim).float(), dim=-1, eps=1e-6).to(x.dtype) for t in (q, k))
    return q, k, v.reshape(B, T, -1, head_v_dim)


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)


def torch_qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps):
    q = torch_rms_norm(q, q_weight, eps).transpose(1, 2)
    k = torch_rms_norm(k, k_weight, eps).transpose(1, 2)
    return apply_rotary_pos_emb(q, k, cos, sin)


def torch_gate_attention(a, gate: torch.Tensor) -> torch.Tensor:
    from engine.model import row_major
    o = a.o
    B, Hq, T, D = o.shape
    if a.o_pre is not None:
        o_pre = row_major(a.o_pre, a.R).reshape(B, Hq, T, D)
        lse_pre = row_major(a.lse_pre[..., None], a.R).reshape(B, Hq, T)
        w_pre = torch.sigmoid(lse_pre - a.lse)[..., None]                                 # share of the prefix keys
        o = (o + (o_pre - o) * w_pre).to(o.dtype)
    return o.transpose(1, 2).reshape(B, T, -1) * torch.sigmoid(gate.reshape(B, T, -1))


def torch_add_rms_norm(h: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float):
    h = h + x
    return torch_rms_norm(h, weight, eps), h


def torch_gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # transformers' order: normalise in float32, cast, scale, then gate in float32
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return ((weight * normed) * F.silu(gate.float())).to(x.dtype)


def _fla_kernels() -> Kernels:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    from engine.triton_kernels import GATED, add_rms_norm, conv_qkv, gate_attention, rms_norm_rope, row_norm, swiglu

    def delta_rule(q, k, v, a, b, A_log, dt_bias, initial_state, output_final_state):
        # fla reads grouped value heads (Hv > Hk) without repeating q and k; q and k come L2-normalised from
        # conv_qkv (fla's own L2 norm would be one more kernel, specialised on the row-block count per shape)
        return chunk_gated_delta_rule(q, k, v, g=a, beta=b, initial_state=initial_state,
                                      output_final_state=output_final_state, use_gate_in_kernel=True, A_log=A_log,
                                      dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True)

    def gated(x, gate, weight, eps):
        return row_norm(x, weight, eps, GATED, gate)

    def qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps):
        return rms_norm_rope(q, q_weight, cos, sin, eps), rms_norm_rope(k, k_weight, cos, sin, eps)

    return Kernels("fla", delta_rule, conv_qkv, row_norm, gated, swiglu, add_rms_norm, qk_norm_rope, gate_attention)
