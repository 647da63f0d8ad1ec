"""The Gated DeltaNet's causal conv as one fused Triton kernel, `conv_qkv`: the causal conv + SiLU over the q|k|v
channels, continuing a prefix's conv state read from the prefix bank by index, with the q/k L2 norms, written as
contiguous tensors with the delta rule's b and a (what fla's delta rule reads without copying).

Its launch configuration is fixed (no autotuning) and it reproduces transformers' rounding steps, like the kernels of
`engine.kernels.fused`, whose notes on strides and alignment apply here too.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.decay import DECAY_WARPS, decay_and_beta, decay_chunk
from engine.kernels.fused import per_column
from engine.kernels.pdl import await_previous_kernel, pdl_launch

CONV_CONFIG = (8, 2)
"""`conv_qkv`'s launch: (tokens per program, warps); one program takes one head's channels. Read at each call, so
`bench/probes/variant_ab.py` can time others in one process. (8, 2) was the fastest of 20 configurations on the H200 for
32 x 144 tokens of the 0.8B shape (bench/probes/kernel_probe.py: 0.097 ms against 0.130 ms for 32 tokens x 4 warps; a
copy of the same bytes takes 0.074 ms). In whole steps at batches 32 and 128 (run AD, `variant_ab.py`), (16, 2), (16,
4), (32, 4), (4, 1) and (8, 1) were all slower. With the bank's conv states time-major, (8, 1) ran the kernel alone
faster at batch 128 (0.280 ms against 0.297 to 0.313, `kernel_probe.py --only conv`, run AR) but whole batch-128 steps
slower (60.75 ms against 59.92, run AS)."""

CONV_SMALL_CONFIG = (4, 1)
"""The launch where `CONV_CONFIG` would start fewer than `CONV_FILL_PROGRAMS` programs (batch 1): there the conv is
latency-bound, and smaller programs spread it over more of the SMs. Whole batch-1 steps on the H200: 2.346 ms at (4, 1)
against 2.461 at (8, 2) (run AD); with the delta rule's small launch too, 2.184 against 2.238 (run AU, the order of the
variants rotated each round). Differences of this size are near the run-to-run spread at batch 1. Every launch here
splits a row's channels over a warp's threads alike, so the L2 norms sum in the same order and the launches give the
same bits (`tests/engine/kernels/test_causal_conv.py` checks the two launches; `bench/probes/kernel_probe.py --only
conv` reports every launch's)."""
CONV_FILL_PROGRAMS = 2048
CONV_WEIGHT_TILE = True
"""Whether `conv_qkv` loads each tap's weights as a [tokens, channels] tile in its inputs' layout (True) or as a
vector broadcast over the tokens (False). Compiled for sm_90 by Triton 3.6 as launched at (8, 2), each vector load is
converted through shared memory: 7 conversions and 13 barriers a program; the tile load leaves none of either
(`tests/engine/kernels/test_triton_ptx.py`), for 30 global load instructions instead of 23 (each thread loads the
weights of its own channels, which L1 holds). The same arithmetic in the same order: the same bits
(`tests/engine/kernels/test_causal_conv.py`). At (4, 1), batch 1's launch, one warp converts without barriers. On the
H200 alone it was no faster (run BK: 60.17 against 59.91 ms at batch 128 over 4 rounds); with
`engine.kernels.fused.NORM_WEIGHT_TILE` and `engine.model.ANSWER_QUERIES`, the three together were the fastest variant
at batch 128 in both runs that timed them (run BK: 59.10 against base 59.91, answers alone 59.67; run BL: 59.09 against
59.97, answers with the norm tiles 59.24), within the spread at batches 1 and 32: on, as the configuration timed best.
Read at each call, so `bench/probes/variant_ab.py` can time it either way."""


@triton.jit(do_not_specialize=["T"])
def _conv_qkv_kernel(X, W, PREV, PREV_INDEX, GATES, Q, K, V, BETA, ALPHA, A_LOG, DT_BIAS, T, x_b, x_t, w_c, w_k, p_b,
                     p_c, p_k, g_b, g_t, eps, scale, HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr,
                     DV: tl.constexpr, KW: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, NG: tl.constexpr,
                     BG: tl.constexpr, HAS_PREV: tl.constexpr, HAS_INDEX: tl.constexpr, W_TILE: tl.constexpr = False,
                     GATE_COPY: tl.constexpr = True, DECAY: tl.constexpr = False, CHUNK: tl.constexpr = 64,
                     PDL: tl.constexpr = False):
    # segments 0 .. 2 HK + HV - 1: the conv (`_conv_segment`); with DECAY one more, whose programs make the delta rule's
    # decay and beta from the gates (into ALPHA and BETA): the work of `engine.kernels.decay`'s kernel in this launch
    await_previous_kernel(PDL)
    if _in_decay_segment(HK, HV, DECAY):
        _decay_segment(GATES, A_LOG, DT_BIAS, ALPHA, BETA, T, g_b, g_t, scale, NG, CHUNK)
    else:
        _conv_segment(X, W, PREV, PREV_INDEX, GATES, Q, K, V, BETA, ALPHA, T, x_b, x_t, w_c, w_k, p_b, p_c, p_k, g_b,
                      g_t, eps, HK, HV, DK, DV, KW, BT, BD, NG, BG, HAS_PREV, HAS_INDEX, W_TILE, GATE_COPY)


@triton.jit
def _in_decay_segment(HK: tl.constexpr, HV: tl.constexpr, DECAY: tl.constexpr):
    # whether this program is one of the decay's; without DECAY a compile-time False, so that the launch compiles the
    # conv alone, as it did before the decay's segment existed
    if DECAY:
        return tl.program_id(1) == 2 * HK + HV
    else:
        return False


@triton.jit
def _decay_segment(GATES, A_LOG, DT_BIAS, G, BETA, T, g_b, g_t, scale, NG: tl.constexpr, CHUNK: tl.constexpr):
    # row b's decay chunks (one per chunk and head), dealt round the segment's programs; gates: b | a
    b = tl.program_id(2).to(tl.int64)
    items = tl.cdiv(T, CHUNK) * NG
    for item in range(tl.program_id(0), items, tl.num_programs(0)):
        decay_chunk(GATES + NG, GATES, A_LOG, DT_BIAS, G, BETA, T, g_b, g_t, scale, item // NG, b, item % NG, NG,
                    CHUNK)


@triton.jit
def _conv_segment(X, W, PREV, PREV_INDEX, GATES, Q, K, V, BETA, ALPHA, T, x_b, x_t, w_c, w_k, p_b, p_c, p_k, g_b, g_t,
                  eps, HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, KW: tl.constexpr,
                  BT: tl.constexpr, BD: tl.constexpr, NG: tl.constexpr, BG: tl.constexpr, HAS_PREV: tl.constexpr,
                  HAS_INDEX: tl.constexpr, W_TILE: tl.constexpr, GATE_COPY: tl.constexpr):
    # one program: BT tokens of one row (b) x one head's channels (seg: q heads, then k heads, then v heads)
    seg = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.arange(0, BD)
    is_qk = seg < 2 * HK
    width = tl.where(is_qk, DK, DV)
    c = tl.where(is_qk, seg * DK, 2 * HK * DK + (seg - 2 * HK) * DV) + cols
    col_ok = cols < width
    t_ok = t < T
    acc = tl.zeros([BT, BD], dtype=tl.float32)
    # y[t] = sum_j w[c, j] * x[t - (KW-1) + j]
    for j in tl.static_range(KW):
        src_t = t - (KW - 1) + j
        m = (t_ok & (src_t >= 0))[:, None] & col_ok[None, :]
        x = tl.load(X + b * x_b + src_t[:, None] * x_t + c[None, :], mask=m, other=0.0).to(tl.float32)
        acc += x * per_column(W + j * w_k, t, c * w_c, col_ok, W_TILE)
    if HAS_PREV:
        if tl.program_id(0) == 0:
            # times before the row's first token come from the prefix's state, whose columns 0..KW-2 hold the inputs
            # at times -(KW-1)..-1; only the first KW-1 tokens reach back that far. With an index, row b's state is
            # entry PREV_INDEX[b] of the prefix bank's (read in place: no per-row gather before the kernel)
            if HAS_INDEX:
                state = tl.load(PREV_INDEX + b).to(tl.int64)
            else:
                state = b
            for j in tl.static_range(KW - 1):
                src_t = t - (KW - 1) + j
                mp = (t_ok & (src_t < 0))[:, None] & col_ok[None, :]
                x_prev = tl.load(PREV + state * p_b + c[None, :] * p_c + (KW - 1 + src_t)[:, None] * p_k, mask=mp,
                                 other=0.0)
                acc += x_prev.to(tl.float32) * per_column(W + j * w_k, t, c * w_c, col_ok, W_TILE)
    ty = Q.dtype.element_ty
    y = (acc * (1.0 / (1.0 + tl.exp(-acc)))).to(ty).to(tl.float32)      # SiLU, rounded as the conv's output
    mask = t_ok[:, None] & col_ok[None, :]
    token = (b * T + t)[:, None]
    if is_qk:
        # transformers' l2norm of the rounded conv output: x * rsqrt(sum(x^2) + eps)
        y = y * (1.0 / tl.sqrt(tl.sum(y * y, axis=1) + eps))[:, None]
    if seg < HK:
        tl.store(Q + (token * HK + seg) * DK + cols[None, :], y.to(ty), mask=mask)
        if GATE_COPY:
            if seg == 0:
                # the delta rule's beta and decay inputs (b | a, NG each), copied contiguous in the same pass: fla makes
                # its inputs contiguous, which for these views of the fused projection is two more kernels per layer
                g_cols = tl.arange(0, BG)
                g_mask = t_ok[:, None] & (g_cols < 2 * NG)[None, :]
                gates = tl.load(GATES + b * g_b + t[:, None] * g_t + g_cols[None, :], mask=g_mask, other=0.0)
                is_beta = (g_cols < NG)[None, :]
                tl.store(BETA + token * NG + g_cols[None, :], gates, mask=g_mask & is_beta)
                tl.store(ALPHA + token * NG + (g_cols - NG)[None, :], gates, mask=g_mask & (g_cols >= NG)[None, :])
    elif is_qk:
        tl.store(K + (token * HK + seg - HK) * DK + cols[None, :], y.to(ty), mask=mask)
    else:
        tl.store(V + (token * HV + seg - 2 * HK) * DV + cols[None, :], y.to(ty), mask=mask)


def conv_qkv(x: torch.Tensor, weight: torch.Tensor, prev: torch.Tensor | None, key_dim: int, head_k_dim: int,
             head_v_dim: int, gates: torch.Tensor, prev_index: torch.Tensor | None = None, eps: float = 1e-6
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Gated DeltaNet's conv in one pass: x [B, T, C] (C = q|k|v channels; may be a strided view of the fused
    projection), weight [C, KW] (any strides: `HybridForward` keeps it tap-major, so a tap's weights load as one
    contiguous vector), prev the previous KW-1 inputs, oldest first, or None: [B, C, KW-1] (any strides, so an
    expanded prefix state is read in place), or with prev_index [B] int64 the prefix bank's [S, C, KW-1], row b
    continuing entry prev_index[b]; gates [B, T, 2H] (the delta rule's b | a, a strided view) -> q, k [B, T, Hk, Dk]
    (L2-normalised per head) and v [B, T, Hv, Dv] of silu(causal_conv(x)), and b, a [B, T, H]: all contiguous."""
    NG = gates.shape[-1] // 2
    b, a = (torch.empty(*gates.shape[:-1], NG, dtype=x.dtype, device=x.device) for _ in range(2))
    q, k, v = _conv(x, weight, prev, key_dim, head_k_dim, head_v_dim, gates, prev_index, eps, b, a)
    return q, k, v, b, a


def conv_qkv_decay(x: torch.Tensor, weight: torch.Tensor, prev: torch.Tensor | None, key_dim: int, head_k_dim: int,
                   head_v_dim: int, gates: torch.Tensor, prev_index: torch.Tensor | None, A_log: torch.Tensor,
                   dt_bias: torch.Tensor, chunk: int, scale: float, eps: float = 1e-6
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`conv_qkv`, with the delta rule's beta and decay in place of its b and a: (q, k, v, beta, g), beta and g as
    `engine.kernels.decay.decay_and_beta` makes them from the gates ([B, T, H] float32, contiguous). At the small
    launch (`CONV_SMALL_CONFIG`, one warp, as the decay's own kernel) they are made by extra programs of the conv's
    launch: one launch a layer fewer at batch 1; elsewhere by `decay_and_beta`, reading the gates in place."""
    NG = gates.shape[-1] // 2
    if gates.stride(-1) != 1:
        gates = gates.contiguous()
    if _small(x, key_dim, head_k_dim, head_v_dim) and CONV_SMALL_CONFIG[1] == DECAY_WARPS:
        g, beta = (torch.empty(*gates.shape[:-1], NG, dtype=torch.float32, device=x.device) for _ in range(2))
        q, k, v = _conv(x, weight, prev, key_dim, head_k_dim, head_v_dim, gates, prev_index, eps, beta, g,
                        decay=(A_log, dt_bias, chunk, scale))
        return q, k, v, beta, g
    q, k, v = _conv(x, weight, prev, key_dim, head_k_dim, head_v_dim, gates, prev_index, eps, None, None)
    g, beta = decay_and_beta(gates[..., NG:], gates[..., :NG], A_log, dt_bias, chunk, scale)
    return q, k, v, beta, g


def _small(x: torch.Tensor, key_dim: int, head_k_dim: int, head_v_dim: int) -> bool:
    """Whether `CONV_CONFIG` would start fewer than `CONV_FILL_PROGRAMS` programs for x, so the conv runs at
    `CONV_SMALL_CONFIG` (both read at the call)."""
    B, T, C = x.shape
    segments = 2 * (key_dim // head_k_dim) + (C - 2 * key_dim) // head_v_dim
    return triton.cdiv(T, CONV_CONFIG[0]) * segments * B < CONV_FILL_PROGRAMS


def _conv(x, weight, prev, key_dim, head_k_dim, head_v_dim, gates, prev_index, eps, beta, alpha, decay=None):
    # q, k, v; the gates' b | a copied into beta and alpha (None: not copied), or with decay (A_log, dt_bias, chunk,
    # scale) the decay and beta made into alpha and beta by the launch's extra segment
    B, T, C = x.shape
    HK, HV = key_dim // head_k_dim, (C - 2 * key_dim) // head_v_dim
    NG = gates.shape[-1] // 2
    new = lambda *shape: torch.empty(B, T, *shape, dtype=x.dtype, device=x.device)  # noqa: E731
    q, k, v = new(HK, head_k_dim), new(HK, head_k_dim), new(HV, head_v_dim)
    if B * T == 0:
        return q, k, v
    if x.stride(-1) != 1:
        x = x.contiguous()
    if gates.stride(-1) != 1:
        gates = gates.contiguous()
    BD = triton.next_power_of_2(max(head_k_dim, head_v_dim))
    tokens, warps = CONV_SMALL_CONFIG if _small(x, key_dim, head_k_dim, head_v_dim) else CONV_CONFIG
    # the prefix state is read in the first token block only, so BT >= KW - 1
    KW = weight.shape[1]
    BT = max(tokens, triton.next_power_of_2(KW - 1))
    state, state_strides = (prev, prev.stride()) if prev is not None else (x, (0, 0, 0))
    index = prev_index if prev_index is not None else x
    A_log, dt_bias, chunk, scale = decay if decay is not None else (x, x, 64, 1.0)
    _conv_qkv_kernel[(triton.cdiv(T, BT), 2 * HK + HV + (decay is not None), B)](
        x, weight, state, index, gates, q, k, v, beta if beta is not None else x, alpha if alpha is not None else x,
        A_log, dt_bias, T, x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), *state_strides,
        gates.stride(0), gates.stride(1), eps, scale, HK=HK, HV=HV, DK=head_k_dim, DV=head_v_dim, KW=KW, BT=BT, BD=BD,
        NG=NG, BG=triton.next_power_of_2(2 * NG), HAS_PREV=prev is not None, HAS_INDEX=prev_index is not None,
        W_TILE=CONV_WEIGHT_TILE, GATE_COPY=beta is not None and decay is None, DECAY=decay is not None, CHUNK=chunk,
        num_warps=warps, **pdl_launch())
    return q, k, v
