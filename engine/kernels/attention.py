"""The pieces of a suffix pass's attention that every kernel table shares: the fused attention call with its
log-sum-exp, the layout of the prefix half, and `AttentionOut`, what a context's attention hands to
`Kernels.gate_attention`.

The prefix half is laid out prefix-major, [P, Hkv, R*G*T, D]: the queries of the R rows continuing prefix p, one
matrix per kv head. A suffix pass over the prefix bank gives every row its own prefix entry (R = 1, P = rows), which
is the row-major layout itself; the merge kernels take any R and P.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionOut:
    """A context's attention before the output gate: `o` [B, Hq, T, D] alone, or the causal suffix half (`o`, `lse`)
    of a merged attention plus its prefix half (`o_pre`, `lse_pre`, prefix-major over R requests and P prefixes),
    which `Kernels.gate_attention` merges by log-sum-exp while it applies the gate."""
    o: torch.Tensor
    lse: torch.Tensor | None = None
    o_pre: torch.Tensor | None = None
    lse_pre: torch.Tensor | None = None
    R: int = 1
    P: int = 1


def row_major(t: torch.Tensor, R: int) -> torch.Tensor:
    """A prefix-major [P, Hkv, R*G*T, X] -> row-major [R*P, Hkv, G*T, X] (row r * P + p)."""
    P, Hkv, RGT, X = t.shape
    return t.reshape(P, Hkv, R, RGT // R, X).permute(2, 0, 1, 3, 4).reshape(R * P, Hkv, RGT // R, X)


def sdpa_with_lse(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused attention that also returns each query's log-sum-exp: -> (out [N, H, M, D], lse [N, H, M] float32).

    k, v may hold fewer heads than q (grouped-query: head h reads kv head h // (H / Hkv)). The flash ops read the
    groups themselves (checked on the H200: identical output and log-sum-exp, 0.065 ms against 0.110 ms with
    `repeat_interleave`d copies at 32 x 144 tokens); only the float32 CUDA op needs the copies."""
    M = q.shape[2]
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)[:2]
    elif q.dtype in (torch.bfloat16, torch.float16):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
    else:
        G = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal,
                                                                          scale=scale)[:2]
    return out, lse[..., :M].float()
