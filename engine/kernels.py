"""The kernels behind the forward, chosen once per device.

On CUDA with flash-linear-attention (fla) installed: fla's Triton kernels for the Gated DeltaNet recurrence, the
causal conv (with an initial state: no per-row concatenation of the prefix's conv inputs), fused RMSNorms and SwiGLU.
Elsewhere: PyTorch code that computes exactly what transformers' modules compute (what CPU tests run).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Kernels:
    """name; delta_rule(q, k, v, g=, beta=, initial_state=, output_final_state=, use_qk_l2norm_in_kernel=) with
    q, k, v [B, T, H, D] and a [B, H, Dk, Dv] float32 state; causal_conv(x [B, T, C], weight [C, K],
    prev [B, C, K-1] | None) -> silu(conv) [B, T, C]; rms_norm(x, weight, eps) (weight already 1 + w for
    Qwen3.5's zero-centred norms, float32); gated_rms_norm(x, gate, weight, eps) = norm(x) * weight * silu(gate);
    swiglu(gate, up) = silu(gate) * up."""
    name: str
    delta_rule: Callable
    causal_conv: Callable
    rms_norm: Callable
    gated_rms_norm: Callable
    swiglu: Callable


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
    return Kernels("torch", reference, torch_causal_conv, torch_rms_norm, torch_gated_rms_norm,
                   lambda gate, up: F.silu(gate) * up)


def torch_causal_conv(x: torch.Tensor, weight: torch.Tensor, prev: torch.Tensor | None) -> torch.Tensor:
    K = weight.shape[1]
    xt = x.transpose(1, 2)                                                             # [B, C, T]
    full = F.pad(xt, (K - 1, 0)) if prev is None else torch.cat([prev.to(x.dtype), xt], -1)
    return F.silu(F.conv1d(full, weight[:, None, :], groups=weight.shape[0])).transpose(1, 2)


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)


def torch_gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # transformers' order: normalise in float32, cast, scale, then gate in float32
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return ((weight * normed) * F.silu(gate.float())).to(x.dtype)


def _fla_kernels() -> Kernels:
    from fla.modules.activations import swiglu
    from fla.modules.causal_conv1d import causal_conv1d
    from fla.modules.norm.fused_norm_gate import rms_norm_gated
    from fla.modules.norm.layernorm import rms_norm
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    def conv(x, weight, prev):
        # fla's state holds K columns of which the last K-1 are the previous inputs
        state = None if prev is None else F.pad(prev.to(x.dtype), (1, 0))
        return causal_conv1d(x, weight=weight, initial_state=state, activation="silu")[0]

    def norm(x, weight, eps):
        return rms_norm(x, weight, None, eps=eps)

    def gated(x, gate, weight, eps):
        return rms_norm_gated(x, gate, weight, None, activation="swish", eps=eps)

    return Kernels("fla", chunk_gated_delta_rule, conv, norm, gated, swiglu)
