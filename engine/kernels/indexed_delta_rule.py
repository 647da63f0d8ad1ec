"""The state kernel of fla's chunked Gated DeltaNet forward for a suffix pass whose rows start from prefix states
read by index (`engine.kernels.cuda_fast.delta_rule_indexed` runs the rest of fla's forward around it).

fla's `chunk_gated_delta_rule` takes one initial state per row, and its `input_guard` makes it contiguous: a batch of
rows continuing the same prefix first copies that prefix's [Hv, Dk, Dv] float32 state once per row (64 KiB per head,
16 MiB a layer at batch 16) and the state kernel then reads the copies back. Here the state kernel reads row b's
initial state from the prefix bank's entry `index[b]` in place, so rows sharing a prefix share its reads in L2 and no
copy is made.

The kernel is fla 0.6.0's `chunk_gated_delta_rule_fwd_kernel_h_blockdim64` (MIT licence, (c) 2023-2026 Songlin Yang,
Yu Zhang, Zhiyuan Li and contributors) cut down to this engine's case: key heads of up to 128, a scalar decay per
head, no final state (suffix passes do not keep one), equal-length rows. The changes are the initial state's address
and the chunk count, a compile-time constant here. Its arithmetic is fla's in the same order: on the H200 its output
was fla's bit for bit (`tests/engine/kernels/test_delta_rule.py`). Its launch configuration is fixed (`FWD_H_CONFIG`)
rather than autotuned.

It does not import fla, so Triton's interpreter runs it on a CPU (`tests/engine/kernels/test_delta_rule.py`); fla's own
`exp2` is `tl.math.exp2` unless FLA_USE_FAST_OPS=1.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.pdl import await_previous_kernel, pdl_launch

CHUNK = 64
"""Tokens per chunk, fla's default for the Gated Delta Rule."""

FWD_H_CONFIG = (64, 4, 2)
"""(value columns per program, warps, stages) of the state kernel, one of fla's autotuning candidates. The value
columns a program holds do not change how a column is summed: other candidates give the same bits
(`tests/engine/kernels/test_delta_rule.py`). On the H200 (`bench/probes/variant_ab.py`) (64, 2, 4) ran batches 4 to 32
slower, and 32 columns (twice the programs) for batches 1 and 2 were no faster."""


@triton.jit
def _program(HV: tl.constexpr, V: tl.constexpr, BV: tl.constexpr):
    # this program's row, value head and value columns (with their mask): value blocks fastest, as fla numbers them
    pid = tl.program_id(0).to(tl.int64)
    NV = tl.cdiv(V, BV)
    i_v, i_nh = pid % NV, pid // NV
    o_v = i_v * BV + tl.arange(0, BV)
    return i_nh // HV, i_nh % HV, o_v, o_v < V


@triton.jit
def _key_blocks(K: tl.constexpr):
    # the state's key rows in two blocks of 64, with their masks (the second empty where K <= 64)
    o_k1 = tl.arange(0, 64)
    o_k2 = 64 + o_k1
    return o_k1, o_k1 < K, o_k2, o_k2 < K


@triton.jit
def _row_heads(k, v, w, i_n, i_h, T, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr):
    # row i_n's first token, and its pointers into k (key head i_h // (HV // H)), v and w (value head i_h)
    bos = i_n * T
    return bos, k + (bos * H + i_h // (HV // H)) * K, v + (bos * HV + i_h) * V, w + (bos * HV + i_h) * K


@triton.jit
def _initial_state(h0, h0_index, i_n, i_h, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                   o_v, m_v, o_k1, m_k1, o_k2, m_k2):
    # the change from fla's kernel that matters: row i_n's initial state is bank entry h0_index[i_n], not entry i_n.
    # Keys in the two blocks of `_key_blocks` (the second all zeros where K <= 64), value columns o_v, float32
    h0 += (tl.load(h0_index + i_n).to(tl.int64) * HV + i_h) * K * V
    b_h1 = tl.zeros([64, BV], dtype=tl.float32)
    b_h1 += tl.load(h0 + o_k1[:, None] * V + o_v[None, :], mask=m_k1[:, None] & m_v[None, :], other=0.0).to(tl.float32)
    b_h2 = tl.zeros([64, BV], dtype=tl.float32)
    if K > 64:
        b_h2 += tl.load(h0 + o_k2[:, None] * V + o_v[None, :], mask=m_k2[:, None] & m_v[None, :],
                        other=0.0).to(tl.float32)
    return b_h1, b_h2


@triton.jit(do_not_specialize=["T"])
def _fwd_h_indexed_kernel(k, v, w, v_new, g, h, h0, h0_index, T, NT: tl.constexpr, H: tl.constexpr, HV: tl.constexpr,
                          K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
                          PDL: tl.constexpr = False):
    # one program: BV value columns of one (row, value head)'s state, carried through the row's chunks in order. The
    # chunk count is a constant (fla's is not): one compile per length bucket's count, and Triton's interpreter, which
    # cannot loop to a run-time bound, runs it
    await_previous_kernel(PDL)
    i_n, i_h, o_v, m_v = _program(HV, V, BV)
    bos, k, v, w = _row_heads(k, v, w, i_n, i_h, T, H, HV, K, V)
    h += (i_n * NT * HV + i_h) * K * V
    v_new += (bos * HV + i_h) * V
    o_k1, m_k1, o_k2, m_k2 = _key_blocks(K)
    b_h1, b_h2 = _initial_state(h0, h0_index, i_n, i_h, HV, K, V, BV, o_v, m_v, o_k1, m_k1, o_k2, m_k2)

    for i_t in range(NT):
        o_t = i_t * BT + tl.arange(0, BT)
        m_t = o_t < T
        # the state entering chunk i_t, for the output kernel
        tl.store(h + i_t * (HV * K * V) + o_k1[:, None] * V + o_v[None, :], b_h1.to(h.dtype.element_ty),
                 mask=m_k1[:, None] & m_v[None, :])
        if K > 64:
            tl.store(h + i_t * (HV * K * V) + o_k2[:, None] * V + o_v[None, :], b_h2.to(h.dtype.element_ty),
                     mask=m_k2[:, None] & m_v[None, :])

        b_w = tl.load(w + o_t[:, None] * (HV * K) + o_k1[None, :], mask=m_t[:, None] & m_k1[None, :], other=0.0)
        b_v = tl.dot(b_w, b_h1.to(b_w.dtype))
        if K > 64:
            b_w = tl.load(w + o_t[:, None] * (HV * K) + o_k2[None, :], mask=m_t[:, None] & m_k2[None, :], other=0.0)
            b_v = tl.dot(b_w, b_h2.to(b_w.dtype), b_v)
        b_v = tl.load(v + o_t[:, None] * (HV * V) + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0) - b_v
        tl.store(v_new + o_t[:, None] * (HV * V) + o_v[None, :], b_v.to(v_new.dtype.element_ty),
                 mask=m_t[:, None] & m_v[None, :])

        last_idx = tl.minimum((i_t + 1) * BT, T) - 1
        b_g_last = tl.load(g + bos * HV + last_idx * HV + i_h).to(tl.float32)
        b_g = tl.load(g + bos * HV + i_h + o_t * HV, mask=m_t, other=0.0).to(tl.float32)
        b_v = b_v * tl.where(m_t, tl.math.exp2(b_g_last - b_g), 0)[:, None]
        b_g_last = tl.math.exp2(b_g_last)
        b_h1 *= b_g_last
        if K > 64:
            b_h2 *= b_g_last
        b_v = b_v.to(k.dtype.element_ty)

        b_k = tl.load(k + o_k1[:, None] + o_t[None, :] * (H * K), mask=m_k1[:, None] & m_t[None, :], other=0.0)
        b_h1 = tl.dot(b_k, b_v, b_h1)
        if K > 64:
            b_k = tl.load(k + o_k2[:, None] + o_t[None, :] * (H * K), mask=m_k2[:, None] & m_t[None, :], other=0.0)
            b_h2 = tl.dot(b_k, b_v, b_h2)


FUSED_CONFIG = (64, 4, 2)
"""(value columns per program, warps, stages) of the fused state-and-output kernel. The columns a program holds do not
change a column's sums: other configurations give the same bits (`tests/engine/kernels/test_delta_rule.py`). On the H200
in one process (`bench/probes/variant_ab.py`, run AD) (64, 4, 2) ran batch 32 in 16.6 ms and batch 128 in 63.6 ms
against (32, 4, 2)'s 17.2 and 65.7; (64, 8, 2), (32, 2, 2), (32, 8, 2) and (16, 2, 2) were slower at both."""


FUSED_SMALL_CONFIG = (16, 2, 2)
"""The fused kernel's launch where `FUSED_CONFIG` would start fewer than `FUSED_FILL_PROGRAMS` programs (batch 1: 32
programs): a batch-1 step on the H200 ran in 2.351 ms at (16, 2, 2) against 2.424 at (64, 4, 2) (run AD). At batch 4
(128 programs) it was slower: 3.35 ms against 3.28 (run AS). The same bits, as every configuration."""
FUSED_FILL_PROGRAMS = 64


@triton.jit(do_not_specialize=["T"])
def _fwd_h_o_indexed_kernel(q, k, v, w, g, o, h0, h0_index, scale, T, NT: tl.constexpr, H: tl.constexpr,
                            HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
                            PDL: tl.constexpr = False):
    # `_fwd_h_indexed_kernel` with fla's output kernel (`chunk_fwd_kernel_o`) computed in the same pass: the state
    # entering each chunk and the chunk's new values stay in registers instead of going through memory (at batch 128,
    # 200 MB of states and 100 MB of values a layer, written once and read back). Each program recomputes its chunk's
    # q k^T, which fla's output kernel computes once per value block too.
    await_previous_kernel(PDL)
    i_n, i_h, o_v, m_v = _program(HV, V, BV)
    bos, k, v, w = _row_heads(k, v, w, i_n, i_h, T, H, HV, K, V)
    q += (bos * H + i_h // (HV // H)) * K
    o += (bos * HV + i_h) * V
    o_k1, m_k1, o_k2, m_k2 = _key_blocks(K)
    b_h1, b_h2 = _initial_state(h0, h0_index, i_n, i_h, HV, K, V, BV, o_v, m_v, o_k1, m_k1, o_k2, m_k2)

    for i_t in range(NT):
        o_t = i_t * BT + tl.arange(0, BT)
        m_t = o_t < T
        # the state entering the chunk, rounded as fla stores it for its output kernel
        b_hr1 = b_h1.to(k.dtype.element_ty)
        b_w = tl.load(w + o_t[:, None] * (HV * K) + o_k1[None, :], mask=m_t[:, None] & m_k1[None, :], other=0.0)
        b_v = tl.dot(b_w, b_hr1)
        b_q = tl.load(q + o_t[:, None] * (H * K) + o_k1[None, :], mask=m_t[:, None] & m_k1[None, :], other=0.0)
        b_k1 = tl.load(k + o_k1[:, None] + o_t[None, :] * (H * K), mask=m_k1[:, None] & m_t[None, :], other=0.0)
        b_o = tl.dot(b_q, b_hr1)
        b_A = tl.dot(b_q, b_k1)
        if K > 64:
            b_hr2 = b_h2.to(k.dtype.element_ty)
            b_w = tl.load(w + o_t[:, None] * (HV * K) + o_k2[None, :], mask=m_t[:, None] & m_k2[None, :], other=0.0)
            b_v = tl.dot(b_w, b_hr2, b_v)
            b_q = tl.load(q + o_t[:, None] * (H * K) + o_k2[None, :], mask=m_t[:, None] & m_k2[None, :], other=0.0)
            b_k2 = tl.load(k + o_k2[:, None] + o_t[None, :] * (H * K), mask=m_k2[:, None] & m_t[None, :], other=0.0)
            b_o = tl.dot(b_q, b_hr2, b_o)
            b_A = tl.dot(b_q, b_k2, b_A)
        b_v = tl.load(v + o_t[:, None] * (HV * V) + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0) - b_v
        b_vn = b_v.to(k.dtype.element_ty)        # the new values as fla stores them for its output kernel

        # the chunk's output: fla's output kernel on the state entering the chunk and the new values
        b_g = tl.load(g + bos * HV + i_h + o_t * HV, mask=m_t, other=0.0).to(tl.float32)
        b_o = b_o * tl.math.exp2(b_g)[:, None]
        b_A = b_A * tl.math.exp2(b_g[:, None] - b_g[None, :])
        b_A = tl.where((o_t[:, None] >= o_t[None, :]) & (m_t[:, None] & m_t), b_A, 0)
        b_o = b_o * scale + tl.dot(b_A.to(b_vn.dtype), b_vn) * scale
        tl.store(o + o_t[:, None] * (HV * V) + o_v[None, :], b_o.to(o.dtype.element_ty),
                 mask=m_t[:, None] & m_v[None, :])

        # the state leaving the chunk, as `_fwd_h_indexed_kernel` carries it
        last_idx = tl.minimum((i_t + 1) * BT, T) - 1
        b_g_last = tl.load(g + bos * HV + last_idx * HV + i_h).to(tl.float32)
        b_v = b_v * tl.where(m_t, tl.math.exp2(b_g_last - b_g), 0)[:, None]
        b_g_last = tl.math.exp2(b_g_last)
        b_h1 *= b_g_last
        b_v = b_v.to(k.dtype.element_ty)
        b_h1 = tl.dot(b_k1, b_v, b_h1)
        if K > 64:
            b_h2 *= b_g_last
            b_h2 = tl.dot(b_k2, b_v, b_h2)


def chunk_outputs_indexed(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, u: torch.Tensor, g: torch.Tensor,
                          bank: torch.Tensor, index: torch.Tensor, scale: float,
                          config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """fla's `chunk_gated_delta_rule_fwd_h` (as `chunk_states_indexed`, row b from bank[index[b]]) and `chunk_fwd_o`
    in one pass, without materialising the per-chunk states or the new values: q, k [B, T, H, K], w [B, T, Hv, K],
    u [B, T, Hv, V], g [B, T, Hv] float32 (the chunked log2 decay), bank [S, Hv, K, V] float32 -> o [B, T, Hv, V].
    config: (BV, warps, stages), `FUSED_CONFIG` (read at the call) by default."""
    B, T, H, K = k.shape
    HV, V = u.shape[2], u.shape[3]
    _check(K, HV, V, bank)
    if config is None:
        config = FUSED_CONFIG
        if triton.cdiv(V, config[0]) * B * HV < FUSED_FILL_PROGRAMS:
            config = FUSED_SMALL_CONFIG
    BV, warps, stages = config
    o = torch.empty_like(u)
    if B:
        _fwd_h_o_indexed_kernel[(triton.cdiv(V, BV) * B * HV,)](q, k, u, w, g, o, bank, index, scale, T,
                                                                NT=triton.cdiv(T, CHUNK), H=H, HV=HV, K=K, V=V,
                                                                BT=CHUNK, BV=BV, num_warps=warps, num_stages=stages,
                                                                **pdl_launch())
    return o


def _check(K: int, HV: int, V: int, bank: torch.Tensor) -> None:
    if K > 128:
        raise ValueError(f"indexed delta rule: key head size {K} (up to 128 supported)")
    if not bank.is_contiguous() or bank.shape[1:] != (HV, K, V):
        raise ValueError(f"indexed delta rule: the bank must be contiguous [S, {HV}, {K}, {V}], got "
                         f"{tuple(bank.shape)}")


def chunk_states_indexed(k: torch.Tensor, w: torch.Tensor, u: torch.Tensor, g: torch.Tensor, bank: torch.Tensor,
                         index: torch.Tensor, config: tuple[int, int, int] | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's `chunk_gated_delta_rule_fwd_h` with row b's initial state read from bank[index[b]]: k [B, T, H, K],
    w [B, T, Hv, K], u [B, T, Hv, V] (the WY representation), g [B, T, Hv] float32 (the chunked log2 decay),
    bank [S, Hv, K, V] float32 (contiguous), index [B] int64 -> (h [B, NT, Hv, K, V] in k's dtype: the state entering
    each chunk, v_new [B, T, Hv, V]). config: (BV, warps, stages), `FWD_H_CONFIG` (read at the call) by default."""
    B, T, H, K = k.shape
    HV, V = u.shape[2], u.shape[3]
    _check(K, HV, V, bank)
    BV, warps, stages = config or FWD_H_CONFIG
    NT = triton.cdiv(T, CHUNK)
    h = k.new_empty(B, NT, HV, K, V)
    v_new = torch.empty_like(u)
    if B:
        _fwd_h_indexed_kernel[(triton.cdiv(V, BV) * B * HV,)](k, u, w, v_new, g, h, bank, index, T, NT=NT, H=H, HV=HV,
                                                              K=K, V=V, BT=CHUNK, BV=BV, num_warps=warps,
                                                              num_stages=stages, **pdl_launch())
    return h, v_new
