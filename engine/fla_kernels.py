"""The CUDA kernels (`engine.kernels.fla_kernels` is their table): fla's Triton kernels for the Gated DeltaNet
recurrence (with the decay gate and beta's sigmoid computed inside it) and, from `engine.triton_kernels` (fixed
launch configuration: no per-shape autotuning, 16-byte loads), SwiGLU, the causal conv fused with the q/k L2 norms
(continuing the prefix's conv state in place: no per-row concatenation of the prefix's conv inputs, no copies of q,
k, v), the RMS/gated norms, the residual adds fused into them, q/k norm + RoPE, and the attention's merge with its
output gate.

Importing this module imports fla and triton: ImportError where they are not installed.
"""
from __future__ import annotations

from fla.ops.gated_delta_rule import chunk_gated_delta_rule
from torch.nn.functional import linear

from engine.triton_kernels import GATED, add_rms_norm, conv_qkv, gate_attention, rms_norm_rope, row_norm, swiglu

__all__ = ["delta_rule", "conv_qkv", "row_norm", "gated_rms_norm", "swiglu", "add_rms_norm", "qk_norm_rope",
           "gate_attention", "linear"]


def delta_rule(q, k, v, a, b, A_log, dt_bias, initial_state, output_final_state):
    # fla reads grouped value heads (Hv > Hk) without repeating q and k; q and k come L2-normalised from conv_qkv
    # (fla's own L2 norm would be one more kernel, specialised on the row-block count per shape)
    return chunk_gated_delta_rule(q, k, v, g=a, beta=b, initial_state=initial_state,
                                  output_final_state=output_final_state, use_gate_in_kernel=True, A_log=A_log,
                                  dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True)


def gated_rms_norm(x, gate, weight, eps):
    return row_norm(x, weight, eps, GATED, gate)


def qk_norm_rope(q, k, q_weight, k_weight, cos, sin, eps):
    return rms_norm_rope(q, q_weight, cos, sin, eps), rms_norm_rope(k, k_weight, cos, sin, eps)
