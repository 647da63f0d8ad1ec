"""Batch-invariant PyTorch kernels (the CPU table `Engine.load(..., deterministic=True)` selects): a row's result does
not depend on how many rows run beside it, where it sits among them, or how far the batch is padded.

What makes PyTorch's CPU kernels batch-dependent, found one family at a time (bench/README.md, "Batch invariance";
tests/engine/test_batch_invariance.py holds a test per family):
- GEMMs: MKL picks its kernel and blocking by the row count M (rows = batch x padded length), so a row's dot
  products round differently at M = 1, 2, ... and, with a wide K, at most M. `linear` runs every GEMM as one batched
  GEMM of blocks of exactly `ROW_BLOCK` rows (the last one zero-padded): every row goes through the same M.
- sigmoid, SiLU and softplus: PyTorch computes a tensor's elements in vector registers and its last few (past the last
  full pair of vectors, and per thread's share) with scalar code that rounds differently, so an element's value depends
  on its offset in the batch's tensor. Written here as `exp`, `log1p` and IEEE division, whose vector and scalar code
  agree bit for bit.
- The CPU flash attention splits queries and keys into blocks whose sizes follow the padded length, so the
  reduction over keys changes with the batch's longest row: the engine runs attention one request at a time on its
  own length (`attend_by_request`, read by `engine.model.SuffixContext`).
- A reduction over one row (the log-sum-exp over the vocabulary behind the label mass): with one row alone PyTorch
  splits the row's sum across threads (two passes), with more it sums each row whole in one thread; `row_logsumexp`
  always gives it at least two rows, and takes the log as `log1p`.
Norms, the causal conv and transformers' chunked delta rule (given its gate and beta) were found invariant as they are.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.qwen3_5.modeling_qwen3_5 import l2norm

from engine.kernels.attention import AttentionOut
from engine.kernels.pytorch import _chunk_gated_delta_rule, by_index, torch_gate_attention, torch_rms_norm

ROW_BLOCK = 64
"""Rows per GEMM block: a fixed M, so every row goes through one kernel and one blocking whatever the batch."""


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight[N, K].T -> [..., N], as blocks of `ROW_BLOCK` rows in one `bmm` (at least two blocks: a
    batch of one block takes the plain GEMM's path, which rounds differently from the batched one)."""
    lead, (N, K) = x.shape[:-1], weight.shape
    rows = x.reshape(-1, K)                                                            # [M, K]
    M = rows.shape[0]
    blocks = max(2, -(-M // ROW_BLOCK))
    rows = F.pad(rows, (0, 0, 0, blocks * ROW_BLOCK - M))                              # [blocks * ROW_BLOCK, K]
    out = torch.bmm(rows.view(blocks, ROW_BLOCK, K), weight.t().expand(blocks, K, N))  # [blocks, ROW_BLOCK, N]
    return out.view(-1, N)[:M].view(*lead, N)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-x))


def silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1.0 + torch.exp(-x))


def softplus(x: torch.Tensor) -> torch.Tensor:
    """F.softplus (beta 1, threshold 20)."""
    return torch.where(x > 20.0, x, torch.log1p(torch.exp(x.clamp(max=20.0))))


def delta_rule(q, k, v, a, b, A_log, dt_bias, initial_state, output_final_state, initial_index=None):
    initial_state = by_index(initial_state, initial_index)
    g = -A_log.float().exp() * softplus(a.float() + dt_bias)                            # [B, T, Hv]
    if v.shape[2] > q.shape[2]:
        rep = v.shape[2] // q.shape[2]
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)       # [B, T, Hv, Dk]
    return _chunk_gated_delta_rule(q, k, v, g=g, beta=sigmoid(b), initial_state=initial_state,
                                   output_final_state=output_final_state)


def conv_qkv(x: torch.Tensor, weight: torch.Tensor, prev: torch.Tensor | None, key_dim: int, head_k_dim: int,
             head_v_dim: int, gates: torch.Tensor, prev_index: torch.Tensor | None = None):
    B, T, C = x.shape
    prev = by_index(prev, prev_index)
    K = weight.shape[1]
    xt = x.transpose(1, 2)                                                             # [B, C, T]
    full = F.pad(xt, (K - 1, 0)) if prev is None else torch.cat([prev.to(x.dtype), xt], -1)   # [B, C, K-1+T]
    conv = silu(F.conv1d(full, weight[:, None, :], groups=C)).transpose(1, 2)          # [B, T, C]
    q, k, v = conv.split([key_dim, key_dim, C - 2 * key_dim], dim=-1)
    q, k = (l2norm(t.reshape(B, T, -1, head_k_dim).float(), dim=-1, eps=1e-6).to(x.dtype) for t in (q, k))
    return (q, k, v.reshape(B, T, -1, head_v_dim), *gates.chunk(2, dim=-1))           # [B, T, H, D] each; b, a


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return silu(gate) * up


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return ((weight * normed) * silu(gate.float())).to(x.dtype)


def gate_attention(a: AttentionOut, gate: torch.Tensor) -> torch.Tensor:
    return torch_gate_attention(a, gate, sigmoid=sigmoid)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch_rms_norm(x, weight, eps)


def row_logsumexp(x: torch.Tensor, n_cols: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [S, N] -> [S] float32: log(sum(exp(x[:, :n_cols]))) per row, each row summed whole in one thread (never the
    two-pass split PyTorch takes for a lone row), into `out` when given."""
    S = x.shape[0]
    rows = F.pad(x[:, :n_cols].float(), (0, 0, 0, max(0, 2 - S)))                     # [max(S, 2), n_cols]
    top = rows.amax(-1, keepdim=True)                                                  # exact in any order
    total = (rows - top).exp().sum(-1)                                                 # >= 1: the top adds exp(0)
    lse = (top[:, 0] + torch.log1p(total - 1.0))[:S]
    return lse if out is None else out.copy_(lse)
