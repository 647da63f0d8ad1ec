"""The full vocabulary's log-sum-exp at the answer slots in one GEMM kernel, the logits never written to memory:
`Kernels.vocab_logsumexp` on CUDA, behind the label mass (`engine.label_mass`).

`_block_logsumexp_kernel` computes a [BM, BN] tile of logits x @ W^T over the whole hidden size (float32
accumulation, `tl.dot` in BK steps from the first) and, in its epilogue, each row's log-sum-exp over the tile's BN
vocabulary columns (columns past the vocabulary masked to -inf), into a [S, blocks] float32 table; `_combine_kernel`
then reduces each row's table in one fixed tree. The chunked path (`FullVocabulary`'s 31 GEMMs of 8,192 rows through
the table's `linear`, each written as a [S, 8192] block of logits and reduced by `Kernels.row_logsumexp`: 62 launches)
remains for the CPU and with `engine.label_mass.FUSED` off.

Batch-invariant by construction, as `engine.kernels.cuda_deterministic.matmul` is: the tile (BM, BN, BK), warps and
stages are functions of the weight's shape alone (`vocab_config`), never of the row count S; K is never split; a row's
logit is the same dot product in the same BK steps whatever the rows beside it, its block's max and sum take the same
tree over the same BN columns, and its blocks are combined in one order. So the fast table uses it too.

Arithmetic at Qwen3.5's vocabulary (V = 248,320, hidden 1,024, bf16; W is 508.6 MB), `CONFIG` (128, 256; BK 64):
970 vocabulary blocks, ceil(S / 128) x 970 programs, the row block varying fastest (the programs of one vocabulary
block run side by side and read its W tile from HBM once, then from L2). The MMA work is padded to whole row blocks.

    S      programs   MMA GFLOP   L2->SM GB   bound by
    10        970        65.1        0.53     the W read: 508.6 MB, 0.106 ms at 4.8 TB/s (the MMAs, 0.066 ms at
                                              989 TFLOPS, hide under it); 7.35 waves of one program per SM
    80        970        65.1        0.67     the same
    320     2,910       195.3        2.29
    1,280   9,700       651.0        7.63     the MMAs: 0.66 ms at peak (cuBLAS does the same FLOPs in the chunked
                                              path, then writes and re-reads 636 MB of bf16 logits)

(64, 128) would halve the MMA work at S <= 64 (32.5 GFLOP), which hides under the W read either way, and double the
L2 traffic at 1,280 rows (15.3 GB): (128, 256) is `engine.kernels.cuda_deterministic.matmul_config`'s large tile.
The combine kernel reads S x 976 float32 (5 MB at 1,280 rows). Nothing syncs with the host: a CUDA graph captures both.
These are estimates from the H200's peaks, not timings. Compiled for sm_90 by Triton 3.6
(tests/engine/kernels/test_triton_ptx.py): wgmma fed by cp.async, 144 KB of shared memory (one program per SM), 185
registers, no spills. The row count is never specialised on (`do_not_specialize`): one compiled kernel for 1 row and for
1,300.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.cuda_deterministic import tile_dot
from engine.kernels.pdl import await_previous_kernel, pdl_launch

CONFIG = (128, 256, 8, 3)
"""(BM, BN, warps, stages) of the fused kernel at every row count (BK from the hidden size: `vocab_config`). Read at
each call, so a CUDA graph keeps the tile it was captured with and `bench/probes/variant_ab.py` can time another in the
same process (e.g. "tile-64:engine.kernels.vocab_logsumexp.CONFIG=(64, 128, 4, 4)"); any one tile is batch-invariant,
two tiles need not give the same bits."""

TABLE_ALIGN = 16
"""The partial table's row width is the vocabulary block count rounded up to this (a function of V alone): rows start
64 bytes apart, so the combine kernel's loads are vectorised."""


def vocab_config(V: int, K: int, itemsize: int = 2) -> tuple[int, int, int, int, int]:
    """(BM, BN, BK, warps, stages) for a vocabulary of V rows of K elements of `itemsize` bytes (a function of the
    weight alone): `CONFIG` and the largest of 64, 32, 16 dividing K, 32 at most for float32 (3 stages of the
    128 x 256 tile's float32 operands at BK 64 would take 295 KB of shared memory; the H200 has 227)."""
    BK = next((b for b in (64, 32, 16) if K % b == 0 and b * itemsize <= 128), None)
    if BK is None:
        raise ValueError(f"vocab_logsumexp: the hidden size {K} must be a multiple of 16")
    BM, BN, warps, stages = CONFIG
    return BM, BN, BK, warps, stages


@triton.jit(do_not_specialize=["M"])
def _block_logsumexp_kernel(X, W, P, M, N, K: tl.constexpr, sx, sw, sp, BM: tl.constexpr, BN: tl.constexpr,
                            BK: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr = False):
    # P[m, j] = log(sum(exp(X[m] @ W[j * BN : (j + 1) * BN]^T))) over the block's columns below N; one BM x BN tile a
    # program, row blocks fastest
    await_previous_kernel(PDL)
    num_m = tl.cdiv(M, BM)
    pm = tl.program_id(0) % num_m
    pn = tl.program_id(0) // num_m
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    acc = tile_dot(X, W, rm, rn, M, N, K, sx, sw, BM, BN, BK, PRECISION)
    n_ok = rn[None, :] < N
    logits = tl.where(n_ok, acc, float("-inf"))            # a block holds at least one column below N: finite max
    top = tl.max(logits, axis=1)
    total = tl.sum(tl.exp(logits - top[:, None]), axis=1)
    tl.store(P + rm.to(tl.int64) * sp + pn, top + tl.log(total), mask=rm < M)


@triton.jit
def _combine_kernel(P, Y, sp, NB: tl.constexpr, WIDTH: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    # one row: the log-sum-exp of its NB block log-sum-exps, all loaded at once and reduced in one tree. The load runs
    # to the table's WIDTH (a multiple of TABLE_ALIGN: 16-byte loads), the columns from NB on (never written) dropped
    await_previous_kernel(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    p = tl.load(P + row * sp + cols, mask=cols < WIDTH, other=float("-inf"))
    p = tl.where(cols < NB, p, float("-inf"))
    top = tl.max(p, axis=0)
    tl.store(Y + row, top + tl.log(tl.sum(tl.exp(p - top), axis=0)))


def vocab_logsumexp(x: torch.Tensor, weight: torch.Tensor, n_valid: int | None = None,
                    config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """x [S, K] (final-normed hidden states) and the unembedding weight [V, K] -> [S] float32:
    log(sum(exp(x @ weight[:n_valid]^T))) per row (n_valid default V), batch-invariant. config: (BM, BN, BK, warps,
    stages), default `vocab_config`'s."""
    S, K = x.shape
    V = weight.shape[0] if n_valid is None else n_valid
    if x.stride(-1) != 1:
        x = x.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    BM, BN, BK, warps, stages = config or vocab_config(V, K, weight.element_size())
    blocks = triton.cdiv(V, BN)
    width = triton.cdiv(blocks, TABLE_ALIGN) * TABLE_ALIGN
    partial = torch.empty(S, width, dtype=torch.float32, device=x.device)
    out = torch.empty(S, dtype=torch.float32, device=x.device)
    if S:
        _block_logsumexp_kernel[(triton.cdiv(S, BM) * blocks,)](
            x, weight, partial, S, V, K, x.stride(0), weight.stride(0), partial.stride(0), BM=BM, BN=BN, BK=BK,
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=warps, num_stages=stages,
            **pdl_launch())
        _combine_kernel[(S,)](partial, out, partial.stride(0), NB=blocks, WIDTH=width,
                              BLOCK=triton.next_power_of_2(width), num_warps=4, **pdl_launch())
    return out
