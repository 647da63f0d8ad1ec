"""The read-out's tail in one launch (`engine.readout.read_rows`, after the labels' GEMM): per answer row the calibrated
and the raw softmax over its question's options and its label mass, where the PyTorch path takes 17 small kernels (the
float copy, the temperature's multiplies, the masks, two softmaxes, the bias, `exp`, the concatenation: ~27 us of a
step on the H100 at every batch size, run EM).

One thread a row, reading its columns left to right: the maxima, then the sums of the shifted exponentials and of the
label shares in column order, then the stores. A row's result is its own thread's arithmetic in a fixed order, so it
does not depend on the rows beside it or on how many there are (batch-invariant by construction, in both CUDA tables).
Its bits are not PyTorch's: Triton's `exp` and this order of the softmax's sum are not torch's kernels'; the
probabilities agree with the PyTorch path to float32 rounding (`tests/engine/kernels/test_score_rows.py`).

On the H100 at batch 1 (run ER) it takes 5.6 us, and torch's own kernels in a step fell from 35 (79.5 us) to 15 (23.1).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.pdl import await_previous_kernel, pdl_launch

SCORE_ROWS = 128
"""Rows of a program (one a thread). A row's arithmetic is its own thread's whatever this is."""


@triton.jit
def _scaled(Z, BIAS, MASK, rows, ok, k, inv_t, sz, sb, sm):
    # column k's calibrated and raw logits at temperature 1 / inv_t (-inf where the question lacks the option), and its
    # label logit at temperature 1
    z = tl.load(Z + rows * sz + k, mask=ok, other=0.0).to(tl.float32)
    keep = tl.load(MASK + rows * sm + k, mask=ok, other=0) != 0
    b = tl.load(BIAS + rows * sb + k, mask=ok, other=0.0)
    calibrated = tl.where(keep, (z - b) * inv_t, float("-inf"))
    raw = tl.where(keep, z * inv_t, float("-inf"))
    return calibrated, raw, z, keep


@triton.jit(do_not_specialize=["n_rows"])
def _score_rows_kernel(Z, INV_T, BIAS, MASK, LSE, Y, n_rows, sz, st, sb, sm, N: tl.constexpr, BR: tl.constexpr,
                       HAS_LSE: tl.constexpr, PDL: tl.constexpr = False):
    await_previous_kernel(PDL)
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    ok = rows < n_rows
    inv_t = tl.load(INV_T + rows * st, mask=ok, other=1.0)
    lse = tl.load(LSE + rows, mask=ok, other=0.0) if HAS_LSE else tl.zeros((BR,), tl.float32)
    top_c = tl.full((BR,), float("-inf"), tl.float32)
    top_r = tl.full((BR,), float("-inf"), tl.float32)
    for k in tl.static_range(N):
        calibrated, raw, z, keep = _scaled(Z, BIAS, MASK, rows, ok, k, inv_t, sz, sb, sm)
        top_c = tl.maximum(top_c, calibrated)
        top_r = tl.maximum(top_r, raw)
    sum_c = tl.zeros((BR,), tl.float32)
    sum_r = tl.zeros((BR,), tl.float32)
    mass = tl.zeros((BR,), tl.float32)
    for k in tl.static_range(N):
        calibrated, raw, z, keep = _scaled(Z, BIAS, MASK, rows, ok, k, inv_t, sz, sb, sm)
        sum_c += tl.exp(calibrated - top_c)
        sum_r += tl.exp(raw - top_r)
        if HAS_LSE:
            mass += tl.where(keep, tl.exp(z - lse), 0.0)
    out = Y + rows * (2 * N + 1)
    for k in tl.static_range(N):
        calibrated, raw, z, keep = _scaled(Z, BIAS, MASK, rows, ok, k, inv_t, sz, sb, sm)
        tl.store(out + k, tl.exp(calibrated - top_c) / sum_c, mask=ok)
        tl.store(out + N + k, tl.exp(raw - top_r) / sum_r, mask=ok)
    # a share rounded above 1 is clamped, a NaN kept (torch's clamp); no vocabulary log-sum-exp: NaN
    if HAS_LSE:
        mass = tl.where(mass > 1.0, 1.0, mass)
    else:
        mass = tl.full((BR,), float("nan"), tl.float32)
    tl.store(out + 2 * N, mass, mask=ok)


def score_rows(z: torch.Tensor, inv_temp: torch.Tensor, bias: torch.Tensor, mask: torch.Tensor,
               lse: torch.Tensor | None) -> torch.Tensor:
    """z [S, N] (the labels' logits, any float dtype), inv_temp [S, 1] float32, bias [S, N] float32, mask [S, N] bool,
    lse [S] float32 or None -> [S, 2N + 1] float32: softmax((z - bias) * inv_temp) and softmax(z * inv_temp) over each
    row's options (the others exactly 0), and the label mass min(sum of exp(z - lse) over the options, 1), NaN without
    `lse` (`engine.readout.read_rows`'s columns)."""
    S, N = z.shape
    out = torch.empty(S, 2 * N + 1, dtype=torch.float32, device=z.device)
    if S:
        z, bias, mask = (t if t.stride(-1) == 1 else t.contiguous() for t in (z, bias, mask))
        lse_arg = lse.contiguous() if lse is not None else out       # never read without HAS_LSE
        _score_rows_kernel[(triton.cdiv(S, SCORE_ROWS),)](z, inv_temp, bias, mask.view(torch.uint8), lse_arg, out, S,
                                                          z.stride(0), inv_temp.stride(0), bias.stride(0),
                                                          mask.stride(0), N=N, BR=SCORE_ROWS, HAS_LSE=lse is not None,
                                                          num_warps=4, **pdl_launch())
    return out
