"""A suffix pass's delta-rule inputs in fewer launches than fla's forward makes them
(`engine.kernels.cuda_fast.decayed_delta_rule` calls these when `engine.kernels.cuda_fast.FUSED_INPUTS` is on):

- `solve_into`: fla 0.6.0's fused K K^T + triangular solve (MIT licence, (c) 2023-2026 Songlin Yang, Yu Zhang,
  Zhiyuan Li and contributors) with its four forward substitutions run as one loop, so that their steps overlap;
- `w_u_into`: fla 0.6.0's `recompute_w_u_fwd_kernel` (MIT licence, (c) 2023-2026 Songlin Yang, Yu Zhang, Zhiyuan Li
  and contributors), cut down to equal-length rows with a decay, reading only the lower triangle of the solve's
  matrix A. fla's K K^T + solve kernel writes A's lower blocks only, so fla zero-fills A first (one more kernel a
  layer, and at batch 128 a 48 MB write); here the blocks above the diagonal are masked on load instead, so A can be
  left unwritten there.
- `solve_w_u_into`: the two in one launch, each program solving its chunk and then computing its w and u from the
  blocks it just wrote (the same jit bodies, so the same bits), for grids too small for the launch gap between two
  kernels to hide (`engine.kernels.cuda_fast.FUSED_WY_SMALL_LAUNCH`).

The decay and beta they read come from `engine.kernels.decay`. The arithmetic is fla's, in fla's order: the same dots
and reductions. On the GPU the suffix pass's delta rule is checked against fla's own forward bit for bit
(`tests/engine/kernels/test_delta_rule.py`). Triton's interpreter runs these on a CPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.pdl import await_previous_kernel, pdl_launch

W_U_BLOCK = 64
"""Key and value columns a w/u program computes at a time (fla's `recompute_w_u_fwd` block), in both w/u launches."""


@triton.jit(do_not_specialize=["T"])
def _w_u_kernel(k, v, beta, w, u, A, g, T, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PDL: tl.constexpr = False):
    await_previous_kernel(PDL)
    _w_u_chunk(k, v, beta, w, u, A, g, T, tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64), H, HV, K, V,
               BT, BK, BV)


@triton.jit
def _w_u_chunk(k, v, beta, w, u, A, g, T, i_t, i_bh, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
               V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    # chunk i_t of row i_bh // HV's value head i_bh % HV: fla's `recompute_w_u_fwd_kernel` (2^g read after u, as there)
    bos, i_h, o_t, m_t, b_b, b_A = _w_u_chunk_loads(beta, A, T, i_t, i_bh, HV, BT)
    for i_v in range(tl.cdiv(V, BV)):
        _u_block(v, u, b_A, b_b, bos, i_h, o_t, m_t, i_v, HV, V, BV)
    b_g = _decay_factors(g, bos, i_h, o_t, m_t, HV)
    for i_k in range(tl.cdiv(K, BK)):
        _w_block(k, w, b_A, b_b, b_g, bos, i_h, o_t, m_t, i_k, H, HV, K, BK)


@triton.jit
def _w_u_chunk_loads(beta, A, T, i_t, i_bh, HV: tl.constexpr, BT: tl.constexpr):
    # what every column block of chunk i_t of row i_bh // HV's value head i_bh % HV reads (w's read 2^g too): beta
    # and A's lower triangle, diagonal included (above it A may hold anything: it is never written)
    i_b, i_h = i_bh // HV, i_bh % HV
    bos = i_b * T
    o_t = i_t * BT + tl.arange(0, BT)
    o_A = tl.arange(0, BT)
    m_t = o_t < T
    m_A = m_t[:, None] & (o_A[None, :] <= o_A[:, None])
    b_b = tl.load(beta + bos * HV + i_h + o_t * HV, mask=m_t, other=0.0)
    b_A = tl.load(A + (bos * HV + i_h) * BT + o_t[:, None] * (HV * BT) + o_A[None, :], mask=m_A, other=0.0)
    return bos, i_h, o_t, m_t, b_b, b_A


@triton.jit
def _u_block(v, u, b_A, b_b, bos, i_h, o_t, m_t, i_v, HV: tl.constexpr, V: tl.constexpr, BV: tl.constexpr):
    # value columns i_v * BV.. of the chunk's u = A (v * beta)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = m_t[:, None] & (o_v[None, :] < V)
    p_v = v + (bos * HV + i_h) * V + o_t[:, None] * (HV * V) + o_v[None, :]
    p_u = u + (bos * HV + i_h) * V + o_t[:, None] * (HV * V) + o_v[None, :]
    b_v = tl.load(p_v, mask=m_v, other=0.0)
    b_vb = (b_v * b_b[:, None]).to(b_v.dtype)
    b_u = tl.dot(b_A, b_vb, allow_tf32=False)
    tl.store(p_u, b_u.to(p_u.dtype.element_ty), mask=m_v)


@triton.jit
def _w_block(k, w, b_A, b_b, b_g, bos, i_h, o_t, m_t, i_k, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
             BK: tl.constexpr):
    # key columns i_k * BK.. of the chunk's w = A (k * beta * 2^g)
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = m_t[:, None] & (o_k[None, :] < K)
    p_k = k + (bos * H + i_h // (HV // H)) * K + o_t[:, None] * (H * K) + o_k[None, :]
    p_w = w + (bos * HV + i_h) * K + o_t[:, None] * (HV * K) + o_k[None, :]
    b_k = tl.load(p_k, mask=m_k, other=0.0)
    b_kb = b_k * b_b[:, None] * b_g[:, None]
    b_w = tl.dot(b_A, b_kb.to(b_k.dtype))
    tl.store(p_w, b_w.to(p_w.dtype.element_ty), mask=m_k)


@triton.jit
def _decay_factors(g, bos, i_h, o_t, m_t, HV: tl.constexpr):
    # 2^g at the chunk's tokens, what w's key blocks scale k by (each caller reads it where fla's kernel does)
    return tl.math.exp2(tl.load(g + (bos * HV + i_h) + o_t * HV, mask=m_t, other=0.0).to(tl.float32))


@triton.jit
def _w_u_part(k, v, beta, w, u, A, g, T, i_t, i_bh, first, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
              V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, COUNT: tl.constexpr):
    # column blocks first .. first + COUNT - 1 of the chunk's u (its value blocks, first) and w (its key blocks):
    # `_w_u_chunk`'s blocks, so programs sharing a chunk give its bits
    bos, i_h, o_t, m_t, b_b, b_A = _w_u_chunk_loads(beta, A, T, i_t, i_bh, HV, BT)
    b_g = _decay_factors(g, bos, i_h, o_t, m_t, HV)
    NVB: tl.constexpr = (V + BV - 1) // BV
    for j in tl.static_range(COUNT):
        if first + j < NVB:
            _u_block(v, u, b_A, b_b, bos, i_h, o_t, m_t, first + j, HV, V, BV)
        else:
            _w_block(k, w, b_A, b_b, b_g, bos, i_h, o_t, m_t, first + j - NVB, H, HV, K, BK)


def w_u_into(w: torch.Tensor, u: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, A: torch.Tensor,
             g: torch.Tensor, chunk: int, launch: tuple[int, int]) -> None:
    """w [B, T, Hv, K] = A (k * beta * 2^g) and u [B, T, Hv, V] = A (v * beta), chunk by chunk, as fla's
    `recompute_w_u_fwd` computes them, at launch (warps, stages): k [B, T, H, K], v [B, T, Hv, V], beta and g
    [B, T, Hv], A [B, T, Hv, chunk] whose entries above each chunk's diagonal are ignored."""
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    if B * T:
        _w_u_kernel[(triton.cdiv(T, chunk), B * HV)](k, v, beta, w, u, A, g, T, H=H, HV=HV, K=K, V=V, BT=chunk,
                                                     BK=W_U_BLOCK, BV=W_U_BLOCK, num_warps=launch[0], num_stages=launch[1],
                                                     **pdl_launch())


@triton.jit
def _kkt_scaled(b_A, b_gr, b_gc, m_r, m_c, b_br, DIAGONAL: tl.constexpr):
    # one [BC, BC] block of beta * K K^T decayed by 2^(g_row - g_col) (strictly lower on the diagonal), as fla scales
    # it: masked to real tokens, so that an out-of-range decay cannot make 0 * inf
    o_i = tl.arange(0, b_A.shape[0])
    m = m_r[:, None] & m_c[None, :]
    if DIAGONAL:
        m = m & (o_i[:, None] > o_i[None, :])
    b_A *= tl.where(m, tl.math.exp2(b_gr[:, None] - b_gc[None, :]), 0.)
    return b_A * b_br[:, None]


@triton.jit
def _key_rows(k, row0, m_r, o_k, m_k, row_stride: tl.constexpr):
    # one 16-token block's keys, columns o_k (rows past the row's last token load as zeros)
    o_i = tl.arange(0, m_r.shape[0])
    return tl.load(k + (row0 + o_i)[:, None] * row_stride + o_k[None, :], mask=m_r[:, None] & m_k, other=0.0)


@triton.jit
def _substitute_row(i, b_A, b_Ai):
    # one step of fla's forward substitution on a diagonal block: row i of (I + A)^-1 - I from the rows above it
    o_i = tl.arange(0, b_A.shape[0])
    b_a = tl.sum(tl.where((o_i == i)[:, None], -b_A, 0.), 0)
    b_a = tl.where(o_i < i, b_a, 0.)
    b_a = b_a + tl.sum(b_a[:, None] * b_Ai, 0)
    return tl.where((o_i == i)[:, None], b_a, b_Ai)


@triton.jit
def _store_block(A, b, row0, col0, m_r, HV: tl.constexpr, BT: tl.constexpr):
    o_i = tl.arange(0, b.shape[0])
    tl.store(A + (row0 + o_i)[:, None] * (HV * BT) + (col0 + o_i)[None, :], b.to(A.dtype.element_ty),
             mask=m_r[:, None] & ((col0 + o_i)[None, :] < BT))


@triton.jit(do_not_specialize=["T"])
def _solve_kernel(k, g, beta, A, T, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                  BC: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr = False):
    await_previous_kernel(PDL)
    _solve_chunk(k, g, beta, A, T, tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64), H, HV, K, BT, BC, BK,
                 PRECISION)


@triton.jit(do_not_specialize=["T"])
def _solve_w_u_kernel(k, v, g, beta, A, w, u, T, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                      BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr,
                      W_U_BK: tl.constexpr, PARTS: tl.constexpr = 1, COUNT: tl.constexpr = 0, a_part_stride=0,
                      PDL: tl.constexpr = False):
    # the two kernels' programs for one chunk of one value head, one after the other in one program: the chunk's
    # solved blocks go to A and are read back by the same program (the barrier makes every thread's stores visible to
    # all of its threads), so the arithmetic, the roundings and the bits are the two kernels'. With PARTS > 1 each of
    # a chunk's PARTS programs (program_id 2) solves it into scratch of its own (A + part * a_part_stride) and computes
    # its COUNT of w's and u's column blocks: the solve is latency, so repeating it costs SMs that would idle anyway
    await_previous_kernel(PDL)
    i_t, i_bh = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    if PARTS == 1:
        _solve_chunk(k, g, beta, A, T, i_t, i_bh, H, HV, K, BT, BC, BK, PRECISION)
        tl.debug_barrier()
        _w_u_chunk(k, v, beta, w, u, A, g, T, i_t, i_bh, H, HV, K, V, BT, W_U_BK, W_U_BK)
    else:
        part = tl.program_id(2)
        A += part.to(tl.int64) * a_part_stride
        _solve_chunk(k, g, beta, A, T, i_t, i_bh, H, HV, K, BT, BC, BK, PRECISION)
        tl.debug_barrier()
        _w_u_part(k, v, beta, w, u, A, g, T, i_t, i_bh, part * COUNT, H, HV, K, V, BT, W_U_BK, W_U_BK, COUNT)


@triton.jit
def _solve_chunk(k, g, beta, A, T, i_t, i_bh, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                 BC: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr):
    # chunk i_t of row i_bh // HV's value head i_bh % HV: fla's `chunk_gated_delta_rule_fwd_kkt_solve_kernel`
    # (equal-length rows, a decay) with its four forward substitutions, one per diagonal block, run as one loop: the
    # four chains are independent, so each step's reductions overlap instead of running 4 x 14 steps one after another
    # (what a chunk's solve waits on at batch 1)
    i_b, i_h = i_bh // HV, i_bh % HV
    bos = i_b * T
    i_tc0 = i_t * BT
    i_tc1 = i_tc0 + BC
    i_tc2 = i_tc0 + 2 * BC
    i_tc3 = i_tc0 + 3 * BC
    k += (bos * H + i_h // (HV // H)) * K
    A += (bos * HV + i_h) * BT
    o_i = tl.arange(0, BC)
    m_tc0 = (i_tc0 + o_i) < T
    m_tc1 = (i_tc1 + o_i) < T
    m_tc2 = (i_tc2 + o_i) < T
    m_tc3 = (i_tc3 + o_i) < T
    p_bg = bos * HV + i_h + o_i * HV
    b_b0 = tl.load(beta + p_bg + i_tc0 * HV, mask=m_tc0, other=0.0).to(tl.float32)
    b_b1 = tl.load(beta + p_bg + i_tc1 * HV, mask=m_tc1, other=0.0).to(tl.float32)
    b_b2 = tl.load(beta + p_bg + i_tc2 * HV, mask=m_tc2, other=0.0).to(tl.float32)
    b_b3 = tl.load(beta + p_bg + i_tc3 * HV, mask=m_tc3, other=0.0).to(tl.float32)
    b_g0 = tl.load(g + p_bg + i_tc0 * HV, mask=m_tc0, other=0.0).to(tl.float32)
    b_g1 = tl.load(g + p_bg + i_tc1 * HV, mask=m_tc1, other=0.0).to(tl.float32)
    b_g2 = tl.load(g + p_bg + i_tc2 * HV, mask=m_tc2, other=0.0).to(tl.float32)
    b_g3 = tl.load(g + p_bg + i_tc3 * HV, mask=m_tc3, other=0.0).to(tl.float32)

    # K K^T's ten lower blocks, summed over the key blocks in fla's order
    b_A00 = tl.zeros([BC, BC], dtype=tl.float32)
    b_A11 = tl.zeros([BC, BC], dtype=tl.float32)
    b_A22 = tl.zeros([BC, BC], dtype=tl.float32)
    b_A33 = tl.zeros([BC, BC], dtype=tl.float32)
    b_A10 = tl.zeros([BC, BC], dtype=tl.float32)
    b_A20 = tl.zeros([BC, BC], dtype=tl.float32)
    b_A21 = tl.zeros([BC, BC], dtype=tl.float32)
    b_A30 = tl.zeros([BC, BC], dtype=tl.float32)
    b_A31 = tl.zeros([BC, BC], dtype=tl.float32)
    b_A32 = tl.zeros([BC, BC], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = (o_k < K)[None, :]
        b_k0 = _key_rows(k, i_tc0, m_tc0, o_k, m_k, H * K)
        b_A00 = tl.dot(b_k0, tl.trans(b_k0), b_A00)
        if i_tc1 < T:
            b_k1 = _key_rows(k, i_tc1, m_tc1, o_k, m_k, H * K)
            b_A11 = tl.dot(b_k1, tl.trans(b_k1), b_A11)
            b_A10 = tl.dot(b_k1, tl.trans(b_k0), b_A10)
            if i_tc2 < T:
                b_k2 = _key_rows(k, i_tc2, m_tc2, o_k, m_k, H * K)
                b_A22 = tl.dot(b_k2, tl.trans(b_k2), b_A22)
                b_A20 = tl.dot(b_k2, tl.trans(b_k0), b_A20)
                b_A21 = tl.dot(b_k2, tl.trans(b_k1), b_A21)
                if i_tc3 < T:
                    b_k3 = _key_rows(k, i_tc3, m_tc3, o_k, m_k, H * K)
                    b_A33 = tl.dot(b_k3, tl.trans(b_k3), b_A33)
                    b_A30 = tl.dot(b_k3, tl.trans(b_k0), b_A30)
                    b_A31 = tl.dot(b_k3, tl.trans(b_k1), b_A31)
                    b_A32 = tl.dot(b_k3, tl.trans(b_k2), b_A32)

    b_A00 = _kkt_scaled(b_A00, b_g0, b_g0, m_tc0, m_tc0, b_b0, True)
    b_A11 = _kkt_scaled(b_A11, b_g1, b_g1, m_tc1, m_tc1, b_b1, True)
    b_A22 = _kkt_scaled(b_A22, b_g2, b_g2, m_tc2, m_tc2, b_b2, True)
    b_A33 = _kkt_scaled(b_A33, b_g3, b_g3, m_tc3, m_tc3, b_b3, True)
    b_A10 = _kkt_scaled(b_A10, b_g1, b_g0, m_tc1, m_tc0, b_b1, False)
    b_A20 = _kkt_scaled(b_A20, b_g2, b_g0, m_tc2, m_tc0, b_b2, False)
    b_A21 = _kkt_scaled(b_A21, b_g2, b_g1, m_tc2, m_tc1, b_b2, False)
    b_A30 = _kkt_scaled(b_A30, b_g3, b_g0, m_tc3, m_tc0, b_b3, False)
    b_A31 = _kkt_scaled(b_A31, b_g3, b_g1, m_tc3, m_tc1, b_b3, False)
    b_A32 = _kkt_scaled(b_A32, b_g3, b_g2, m_tc3, m_tc2, b_b3, False)

    # forward substitution on the four diagonal blocks at once. Rows past the row's last token are zero in A, so
    # running their steps too (fla stops each block at its last token) leaves every real row as fla computes it
    b_Ai00 = -b_A00
    b_Ai11 = -b_A11
    b_Ai22 = -b_A22
    b_Ai33 = -b_A33
    for i in range(2, min(BC, T - i_tc0)):
        b_Ai00 = _substitute_row(i, b_A00, b_Ai00)
        b_Ai11 = _substitute_row(i, b_A11, b_Ai11)
        b_Ai22 = _substitute_row(i, b_A22, b_Ai22)
        b_Ai33 = _substitute_row(i, b_A33, b_Ai33)
    m_I = o_i[:, None] == o_i[None, :]
    b_Ai00 += m_I
    b_Ai11 += m_I
    b_Ai22 += m_I
    b_Ai33 += m_I

    # the blocks below the diagonal of (I + A)^-1, merged as fla merges them
    b_Ai10 = -tl.dot(tl.dot(b_Ai11, b_A10, input_precision=PRECISION), b_Ai00, input_precision=PRECISION)
    b_Ai21 = -tl.dot(tl.dot(b_Ai22, b_A21, input_precision=PRECISION), b_Ai11, input_precision=PRECISION)
    b_Ai32 = -tl.dot(tl.dot(b_Ai33, b_A32, input_precision=PRECISION), b_Ai22, input_precision=PRECISION)
    b_Ai20 = -tl.dot(b_Ai22, tl.dot(b_A20, b_Ai00, input_precision=PRECISION) +
                     tl.dot(b_A21, b_Ai10, input_precision=PRECISION), input_precision=PRECISION)
    b_Ai31 = -tl.dot(b_Ai33, tl.dot(b_A31, b_Ai11, input_precision=PRECISION) +
                     tl.dot(b_A32, b_Ai21, input_precision=PRECISION), input_precision=PRECISION)
    b_Ai30 = -tl.dot(b_Ai33, tl.dot(b_A30, b_Ai00, input_precision=PRECISION) +
                     tl.dot(b_A31, b_Ai10, input_precision=PRECISION) +
                     tl.dot(b_A32, b_Ai20, input_precision=PRECISION), input_precision=PRECISION)

    _store_block(A, b_Ai00, i_tc0, 0, m_tc0, HV, BT)
    _store_block(A, b_Ai10, i_tc1, 0, m_tc1, HV, BT)
    _store_block(A, b_Ai11, i_tc1, BC, m_tc1, HV, BT)
    _store_block(A, b_Ai20, i_tc2, 0, m_tc2, HV, BT)
    _store_block(A, b_Ai21, i_tc2, BC, m_tc2, HV, BT)
    _store_block(A, b_Ai22, i_tc2, 2 * BC, m_tc2, HV, BT)
    _store_block(A, b_Ai30, i_tc3, 0, m_tc3, HV, BT)
    _store_block(A, b_Ai31, i_tc3, BC, m_tc3, HV, BT)
    _store_block(A, b_Ai32, i_tc3, 2 * BC, m_tc3, HV, BT)
    _store_block(A, b_Ai33, i_tc3, 3 * BC, m_tc3, HV, BT)


SOLVE_PRECISION = "tf32" if torch.cuda.is_available() and torch.cuda.get_device_capability(0)[0] >= 8 else "ieee"
"""The merges' dot precision, as fla picks it (`fla.utils.IS_TF32_SUPPORTED`)."""


def solve_into(A: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, chunk: int,
               launch: tuple[int, int]) -> None:
    """(I + strictly_lower(beta K K^T 2^(g_i - g_j)))^-1 of each chunk into A [B, T, Hv, chunk]'s lower triangle
    (above each chunk's diagonal A is not written), as fla's fused K K^T + solve computes it, at launch (BK, warps):
    k [B, T, H, K], g and beta [B, T, Hv] float32."""
    B, T, H, K = k.shape
    HV = beta.shape[2]
    if B * T:
        _solve_kernel[(triton.cdiv(T, chunk), B * HV)](k, g, beta, A, T, H=H, HV=HV, K=K, BT=chunk, BC=16,
                                                       BK=launch[0], PRECISION=SOLVE_PRECISION, num_warps=launch[1],
                                                       **pdl_launch())


W_U_SPLIT_BELOW = 64
"""Where `engine.kernels.cuda_fast.FUSED_WY_SMALL_LAUNCH` solves a grid of fewer programs than this (batch 1's 48 at
128-token states, on 132 SMs), a chunk's w and u column blocks go to as many programs as divide them, up to 4
(`solve_w_u_into`'s parts, each repeating the solve on SMs that idle anyway). The same bits. H200, run EV: batch 1
2.109 -> 2.068 ms; batch 2 in 2 parts 2.433 -> 2.447 (so not split). 0: off. Read at each call, for variant_ab."""


def w_u_parts(programs: int, blocks: int) -> int:
    """Programs a chunk for `solve_w_u_into` where the solve starts `programs` (`W_U_SPLIT_BELOW`)."""
    return 1 if programs >= W_U_SPLIT_BELOW else next(p for p in (4, 2, 1) if blocks % p == 0)


def w_u_blocks(k: torch.Tensor, v: torch.Tensor) -> int:
    """How many column blocks of `W_U_BLOCK` a chunk's w and u have together (`solve_w_u_into`'s parts divide it)."""
    return triton.cdiv(k.shape[-1], W_U_BLOCK) + triton.cdiv(v.shape[-1], W_U_BLOCK)


def solve_w_u_into(w: torch.Tensor, u: torch.Tensor, A: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   g: torch.Tensor, beta: torch.Tensor, chunk: int, launch: tuple[int, int, int],
                   parts: int = 1) -> None:
    """`solve_into` then `w_u_into` in one launch of (BK, warps, stages), with their bits: A [parts * B, T, Hv, chunk]
    is the solve's scratch, each of a chunk's `parts` programs (dividing `w_u_blocks`) solving it into its own B rows
    and computing its share of w's and u's column blocks."""
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    blocks = w_u_blocks(k, v)
    if blocks % parts or A.shape[0] != parts * B:
        raise ValueError(f"solve_w_u_into: {parts} parts of {blocks} column blocks, A of {A.shape[0]} rows for {B}")
    if B * T:
        _solve_w_u_kernel[(triton.cdiv(T, chunk), B * HV, parts)](
            k, v, g, beta, A, w, u, T, H=H, HV=HV, K=K, V=V, BT=chunk, BC=16, BK=launch[0], PRECISION=SOLVE_PRECISION,
            W_U_BK=W_U_BLOCK, PARTS=parts, COUNT=blocks // parts, a_part_stride=A[0].numel() * B, num_warps=launch[1],
            num_stages=launch[2], **pdl_launch())
