"""Fused Triton kernels of the CUDA forward, each with a fixed launch configuration (no autotuning).

- `row_norm`: RMSNorm and gated RMSNorm of rows; `add_rms_norm`: the residual add fused into the norm after it.
- `rms_norm_rope`: the attention's per-head q/k RMSNorm and RoPE, written as [B, H, T, D].
- `gate_attention`: the log-sum-exp merge of the prefix and suffix halves of the attention and the output gate.
- `swiglu`: the MLP's silu(gate) * up over the two halves of the fused gate|up projection (fla's kernel addresses
  them flat, so it loads and stores 2 bytes at a time).
- The Gated DeltaNet's causal conv (`conv_qkv`) is `engine.kernels.causal_conv`'s, on the helpers here.
- `row_logsumexp`: the log-sum-exp of each row (the full vocabulary's logits at the answer slots, for their label
  mass: `engine.label_mass`), one program a row reading it in blocks of one size from the first, so a row's sum is
  the same whatever the rows beside it (batch-invariant by construction).
- `ordered_mass`: the label mass's sum of a row's label shares, column after column as `engine.label_mass`'s loop of
  adds sums them, and its clamp, in one launch instead of 26.

Counts (rows, heads, tokens) are never specialised on; the strides of the bf16 tensors are: Triton then knows
they are multiples of 16 (they are, for every layer shape here) and loads 16 bytes at a time. Unspecialised, it
cannot prove a row's alignment and loads 2 bytes at a time (the PTX shows `ld.global.b16` instead of
`ld.global.v4.b32`: tests/engine/kernels/test_triton_ptx.py); a stride's divisibility takes one of two values, so it
costs at most a second compile.

Why not fla's norm kernels: they autotune and specialise on the number of row blocks (`NB`), so every new
(batch bucket, length bucket) shape compiles and benchmarks them afresh: seconds per new shape, a multi-second
latency spike in the stream whenever a batch of a new size arrives. These kernels' only compile-time
constants are row widths and flags, so they compile once per layer shape and never tune. Each reproduces
transformers' rounding steps (the CPU path runs transformers' own formulas), so bf16 results match its modules.

Inputs may be strided views (the q/k/z/gate pieces of a fused projection): a row is the last dimension, contiguous;
rows are addressed as (token, head) with one stride per level, so no copy is made before the kernel.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.pdl import await_previous_kernel, pdl_launch

RMS, GATED = 0, 1

NORM_WEIGHT_TILE = True
"""`engine.kernels.causal_conv.CONV_WEIGHT_TILE` for the norms' weights (`row_norm`). Compiled as launched for the
1,024-wide residual norm (4 rows a program, 4 warps): 2 barriers a program instead of 4 (the other 2 sum a row across
its 4 warps); for the gated norm of 128-wide heads: none instead of 1. Same bits. On the H200: 59.84 against 59.91 ms at
batch 128 alone (run BK), 59.24 against 59.39 with `engine.model.ANSWER_QUERIES` (run BL, 8 rounds); on with
`CONV_WEIGHT_TILE` (its docstring gives the three together)."""

_BLOCK_ELEMENTS = 1024
"""Elements a `row_norm` program takes: one row of the 1,024-wide residual norms, 8 heads of the 128-wide gated norm.
With 4 warps, a row's sum of squares is split over the threads alike at 1 and at 4 rows a program (4,096 elements, the
setting before): the same bits (`bench/probes/variant_ab.py --deterministic`, run CF: diff 0 at every batch size), and 4
times the programs for batch 1's 184 rows. On the H200 (run CF, 4 rounds, p50 ms): batch 1 2.650 against 2.725, batch 8
5.169 against 5.335 (faster in each round), 128 60.700 against 60.907 (within the spread); 8,192 was slower at every
size, and so were 2 warps (which also changed the bits) and 8 (no faster)."""
NORM_WARPS = 4
"""Warps of a `row_norm` program. It and `_BLOCK_ELEMENTS` are read at each call (so `bench/probes/variant_ab.py` can
time other launches in one process); both fix how a row's sum of squares is split over threads, so they are constants of
the process, never chosen by the row count."""


@triton.jit
def per_column(P, rows, offsets, col_ok, TILE: tl.constexpr):
    # one value per column (at P + offsets), float32, to multiply a [rows, columns] tile by. TILE loads it as a whole
    # tile, every row the same addresses, so it lands in the tile's own layout; a 1-D load lands in a 1-D layout, which
    # broadcasting over the rows converts through shared memory, behind a barrier
    if TILE:
        return tl.load(P + rows[:, None] * 0 + offsets[None, :], mask=col_ok[None, :], other=0.0).to(tl.float32)
    else:
        return tl.load(P + offsets, mask=col_ok, other=0.0).to(tl.float32)[None, :]


@triton.jit(do_not_specialize=["n_rows", "heads"])
def _row_norm_kernel(X, G, W, Y, R, n_rows, heads, x_outer, x_inner, g_outer, g_inner, eps,
                     D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr, KIND: tl.constexpr,
                     ADD_RESIDUAL: tl.constexpr, W_TILE: tl.constexpr = False, PDL: tl.constexpr = False):
    await_previous_kernel(PDL)
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BD)
    in_cols = cols < D
    mask = (rows < n_rows)[:, None] & in_cols[None, :]
    token, head = rows // heads, rows % heads
    x = tl.load(X + (token * x_outer + head * x_inner)[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if ADD_RESIDUAL:
        # the decoder's `h = h + x`, rounded to the stream's dtype as transformers does, written back in place to R,
        # then normalised
        p_res = R + rows[:, None] * D + cols[None, :]
        x = (x + tl.load(p_res, mask=mask, other=0.0).to(tl.float32)).to(R.dtype.element_ty)
        tl.store(p_res, x, mask=mask)
        x = x.to(tl.float32)
    y = x * (1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps))[:, None]
    w = per_column(W, rows, cols, in_cols, W_TILE)
    if KIND == 1:
        # transformers' gated norm rounds to the input dtype after normalising and after the weight, then gates
        # in float32
        y = (y.to(Y.dtype.element_ty).to(tl.float32) * w).to(Y.dtype.element_ty).to(tl.float32)
        g = tl.load(G + (token * g_outer + head * g_inner)[:, None] + cols[None, :], mask=mask, other=0.0)
        g = g.to(tl.float32)
        y = y * (g * tl.sigmoid(g))
    else:
        y = y * w
    tl.store(Y + rows[:, None] * D + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


def _blocks(D: int) -> tuple[int, int]:
    """(BD, BR): a row's width padded to a power of two, and the rows one program handles."""
    BD = triton.next_power_of_2(D)
    return BD, max(1, _BLOCK_ELEMENTS // BD)


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """A [tokens, heads, D] view of t (..., [heads,] D) without copying when its strides allow it."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    shape = (-1, t.shape[-2], t.shape[-1]) if t.dim() >= 3 else (-1, 1, t.shape[-1])
    try:
        return t.view(shape)
    except RuntimeError:        # token dimensions that cannot merge: one copy
        return t.contiguous().view(shape)


def row_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, kind: int = RMS,
             gate: torch.Tensor | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """Normalise each row (last dimension) of x; returns a contiguous tensor of x's shape and dtype.

    kind RMS: rms_norm(x) * weight (weight already 1 + w for Qwen3.5's zero-centred norms, float32);
    GATED: rms_norm(x) * weight * silu(gate) in transformers' order of rounding.
    residual (contiguous, x's shape): first residual += x (in place), then the norm is of the new residual.
    """
    rows = _as_rows(x)
    tokens, heads, D = rows.shape
    n_rows = tokens * heads
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if n_rows == 0:
        return out
    g = _as_rows(gate) if gate is not None else rows
    BD, BR = _blocks(D)
    if residual is not None and not (residual.is_contiguous() and residual.shape == x.shape):
        raise ValueError("residual must be contiguous and of x's shape")
    _row_norm_kernel[(triton.cdiv(n_rows, BR),)](
        rows, g, weight, out, residual if residual is not None else out, n_rows, heads,
        rows.stride(0), rows.stride(1), g.stride(0), g.stride(1), eps, D=D, BD=BD, BR=BR, KIND=kind,
        ADD_RESIDUAL=residual is not None, W_TILE=NORM_WEIGHT_TILE, num_warps=NORM_WARPS, **pdl_launch())
    return out


def add_rms_norm(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float):
    """-> (rms_norm(residual + x) * weight, residual + x): one pass; the residual stream is updated in place."""
    return row_norm(x, weight, eps, RMS, residual=residual), residual


@triton.jit(do_not_specialize=["n_rows", "heads", "T"])
def _rms_norm_rope_kernel(X, W, COS, SIN, Y, n_rows, heads, T, x_outer, x_inner, c_batch, c_time, eps,
                          D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr, ROT: tl.constexpr,
                          PDL: tl.constexpr = False):
    await_previous_kernel(PDL)
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BD)
    in_cols = cols < D
    row_ok = rows < n_rows
    mask = row_ok[:, None] & in_cols[None, :]
    token, head = rows // heads, rows % heads
    src = X + (token * x_outer + head * x_inner)[:, None]
    x = tl.load(src + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
    w = tl.load(W + cols, mask=in_cols, other=0.0).to(tl.float32)
    n = (x * rstd[:, None] * w[None, :]).to(Y.dtype.element_ty).to(tl.float32)       # the norm's output, rounded
    # rotate_half over the first ROT columns: [-x2, x1]; the same row's other half, normalised and rounded alike
    half = ROT // 2
    partner = tl.where(cols < half, cols + half, cols - half)
    in_rot = cols < ROT
    rot_mask = row_ok[:, None] & in_rot[None, :]
    xp = tl.load(src + partner[None, :], mask=rot_mask, other=0.0).to(tl.float32)
    wp = tl.load(W + partner, mask=in_rot, other=0.0).to(tl.float32)
    n_partner = (xp * rstd[:, None] * wp[None, :]).to(Y.dtype.element_ty).to(tl.float32)
    rotated = tl.where((cols < half)[None, :], -n_partner, n_partner)
    b, t = token // T, token % T
    trig = (b * c_batch + t * c_time)[:, None] + cols[None, :]
    cos = tl.load(COS + trig, mask=rot_mask, other=0.0).to(tl.float32)
    sin = tl.load(SIN + trig, mask=rot_mask, other=0.0).to(tl.float32)
    # transformers: (x * cos) + (rotate_half(x) * sin), each product and the sum rounded to the dtype
    ty = Y.dtype.element_ty
    roped = ((n * cos).to(ty).to(tl.float32) + (rotated * sin).to(ty).to(tl.float32))
    y = tl.where(in_rot[None, :], roped, n)
    dst = Y + ((b * heads + head) * T + t)[:, None] * D + cols[None, :]
    tl.store(dst, y.to(ty), mask=mask)


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  eps: float) -> torch.Tensor:
    """x [B, T, H, D] (rows may be strided views) -> RoPE(rms_norm(x) * weight) as a contiguous [B, H, T, D], with
    transformers' `apply_rotary_pos_emb` on the first cos.shape[-1] columns (cos, sin: [B, T, rot])."""
    B, T, H, D = x.shape
    rows = _as_rows(x)
    out = torch.empty(B, H, T, D, dtype=x.dtype, device=x.device)
    n_rows = B * T * H
    if n_rows == 0:
        return out
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    BD, BR = _blocks(D)
    _rms_norm_rope_kernel[(triton.cdiv(n_rows, BR),)](
        rows, weight, cos, sin, out, n_rows, H, T, rows.stride(0), rows.stride(1), cos.stride(0), cos.stride(1), eps,
        D=D, BD=BD, BR=BR, ROT=cos.shape[-1], num_warps=4, **pdl_launch())
    return out


@triton.jit(do_not_specialize=["n_rows", "T", "Hq", "G", "P", "l_b", "l_h", "l_t", "m_p", "m_h", "m_m"])
def _gate_attention_kernel(O, LSE, OP, LSEP, GATE, Y, n_rows, T, Hq, G, P, s_b, s_h, s_t, l_b, l_h, l_t,
                           p_p, p_h, p_m, m_p, m_h, m_m, g_outer, g_inner,
                           D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr, MERGE: tl.constexpr,
                           PDL: tl.constexpr = False):
    await_previous_kernel(PDL)
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)       # output rows (b, t, h): [B, T, Hq] order
    cols = tl.arange(0, BD)
    row_ok = rows < n_rows
    mask = row_ok[:, None] & (cols < D)[None, :]
    token, h = rows // Hq, rows % Hq
    b, t = token // T, token % T
    ty = Y.dtype.element_ty
    o = tl.load(O + (b * s_b + h * s_h + t * s_t)[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if MERGE:
        # row b continues prefix p = b % P as request r = b // P; query head h reads kv head h // G
        r, p = b // P, b % P
        m = r * G * T + (h % G) * T + t
        hkv = h // G
        o_pre = tl.load(OP + (p * p_p + hkv * p_h + m * p_m)[:, None] + cols[None, :], mask=mask, other=0.0)
        lse_pre = tl.load(LSEP + p * m_p + hkv * m_h + m * m_m, mask=row_ok, other=0.0)
        lse = tl.load(LSE + b * l_b + h * l_h + t * l_t, mask=row_ok, other=0.0)
        w_pre = tl.sigmoid(lse_pre - lse)                                  # the prefix keys' share of the softmax
        diff = (o_pre.to(tl.float32) - o).to(ty).to(tl.float32)
        o = (o + diff * w_pre[:, None]).to(ty).to(tl.float32)
    g = tl.load(GATE + (token * g_outer + h * g_inner)[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y = o * tl.sigmoid(g).to(ty).to(tl.float32)
    tl.store(Y + rows[:, None] * D + cols[None, :], y.to(ty), mask=mask)


def gate_attention(a, gate: torch.Tensor) -> torch.Tensor:
    """`engine.kernels.attention.AttentionOut` and the output gate [B, T, Hq, D] (a strided view) -> [B, T, Hq * D]: the
    log-sum-exp merge of the prefix and suffix halves (when split), then o * sigmoid(gate), in one pass with
    transformers' rounding (no row-major copies of the prefix half, no transposed copy of the output)."""
    o = a.o
    B, Hq, T, D = o.shape
    out = torch.empty(B, T, Hq * D, dtype=o.dtype, device=o.device)
    n_rows = B * T * Hq
    if n_rows == 0:
        return out
    rows_gate = _as_rows(gate)
    merge = a.o_pre is not None
    op, lsep, lse = (a.o_pre, a.lse_pre, a.lse) if merge else (o, o, o)
    G = Hq // (op.shape[1] if merge else Hq)
    BD, BR = _blocks(D)
    _gate_attention_kernel[(triton.cdiv(n_rows, BR),)](
        o, lse, op, lsep, rows_gate, out, n_rows, T, Hq, G, a.P, o.stride(0), o.stride(1), o.stride(2),
        lse.stride(0), lse.stride(1), lse.stride(2), op.stride(0), op.stride(1), op.stride(2),
        lsep.stride(0), lsep.stride(1), lsep.stride(2), rows_gate.stride(0), rows_gate.stride(1),
        D=D, BD=BD, BR=BR, MERGE=merge, num_warps=4, **pdl_launch())
    return out


@triton.jit(do_not_specialize=["n_rows"])
def _swiglu_kernel(G, U, Y, n_rows, g_row, u_row, D: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    await_previous_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    g = tl.load(G + row * g_row + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * u_row + cols, mask=mask, other=0.0).to(tl.float32)
    ty = Y.dtype.element_ty
    act = (g * tl.sigmoid(g)).to(ty).to(tl.float32)          # transformers rounds silu(gate), then the product
    tl.store(Y + row * D + cols, (act * u).to(ty), mask=mask)


def swiglu(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up for gate, up [..., D] (row-strided views, e.g. the halves of a fused projection) -> a contiguous
    [..., D], rounded as transformers' `act_fn(gate) * up`; into `out` (contiguous, gate's shape) when given."""
    D = gate.shape[-1]
    if out is None:
        out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    elif not out.is_contiguous() or out.shape != gate.shape:
        raise ValueError("swiglu: out must be contiguous and of gate's shape")
    g, u = gate.reshape(-1, D), up.reshape(-1, D)          # views when the leading dimensions merge, else copies
    n_rows = g.shape[0]
    if n_rows == 0:
        return out
    if g.stride(-1) != 1 or u.stride(-1) != 1:
        g, u = g.contiguous(), u.contiguous()
    block = min(1024, triton.next_power_of_2(D))
    _swiglu_kernel[(n_rows, triton.cdiv(D, block))](g, u, out, n_rows, g.stride(0), u.stride(0), D=D, BLOCK=block,
                                                     num_warps=4, **pdl_launch())
    return out


LOGSUMEXP_BLOCK = 1024
"""Columns one step of `row_logsumexp` reads (4 warps, 8 a thread): a row's order of summation; never varies."""


@triton.jit(do_not_specialize=["n_cols"])
def _row_logsumexp_kernel(X, Y, n_cols, sx, sy, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    # one row: a running max and sum per lane over the blocks, from the first; then the lanes' in one fixed tree.
    # Lanes start at a finite floor, not -inf, so that a lane no column reaches adds exp(floor - max) = 0, not NaN
    await_previous_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = tl.full((BLOCK,), -1.0e30, dtype=tl.float32)
    s = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        x = tl.load(X + row * sx + start + cols, mask=start + cols < n_cols, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        s = s * tl.exp(m - m_new) + tl.exp(x - m_new)
        m = m_new
    top = tl.max(m, axis=0)
    tl.store(Y + row * sy, top + tl.log(tl.sum(s * tl.exp(m - top), axis=0)))


def row_logsumexp(x: torch.Tensor, n_cols: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [S, N] (rows may be strided, columns contiguous) -> [S] float32: log(sum(exp(x[:, :n_cols]))) per row, into
    `out` ([S] float32, may be a strided column) when given."""
    S = x.shape[0]
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(S, dtype=torch.float32, device=x.device) if out is None else out
    if S:
        _row_logsumexp_kernel[(S,)](x, out, n_cols, x.stride(0), out.stride(0), BLOCK=LOGSUMEXP_BLOCK, num_warps=4,
                                    **pdl_launch())
    return out


ORDERED_MASS_ROWS = 128
"""Rows of `ordered_mass`'s program (one a thread). A row's sum is its own thread's, column by column, whatever this
is."""


@triton.jit(do_not_specialize=["n_rows"])
def _ordered_mass_kernel(X, Y, n_rows, sx, N: tl.constexpr, BR: tl.constexpr, PDL: tl.constexpr = False):
    # one thread a row: x[:, 0] + x[:, 1] + ... + x[:, N-1] left to right, each add rounded to float32 (the loop of
    # torch adds it replaces, bit for bit), then min(total, 1) keeping a NaN as torch's clamp does
    await_previous_kernel(PDL)
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    ok = rows < n_rows
    total = tl.load(X + rows * sx, mask=ok, other=0.0)
    for k in tl.static_range(1, N):
        total += tl.load(X + rows * sx + k, mask=ok, other=0.0)
    tl.store(Y + rows, tl.where(total > 1.0, 1.0, total), mask=ok)


def ordered_mass(share: torch.Tensor) -> torch.Tensor:
    """share [S, N] float32 -> [S] float32: each row's columns summed left to right, clamped at 1 (the label mass of
    `engine.label_mass.label_mass`, whose loop of N - 1 adds it runs in one launch: the same bits)."""
    S, N = share.shape
    if share.stride(-1) != 1:
        share = share.contiguous()
    out = torch.empty(S, dtype=torch.float32, device=share.device)
    if S:
        _ordered_mass_kernel[(triton.cdiv(S, ORDERED_MASS_ROWS),)](share, out, S, share.stride(0), N=N,
                                                                    BR=ORDERED_MASS_ROWS, num_warps=4, **pdl_launch())
    return out
