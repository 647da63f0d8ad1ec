"""The batch-invariant GEMM in cuBLAS's own kernels: every row through a GEMM of exactly `BLOCK_ROWS` rows.

cuBLAS picks its kernel (split-K among them) by the row count M, so one GEMM of all a batch's rows sums a row in an
order that depends on the batch. Cut into blocks of a fixed row count, run as one strided batched GEMM (the last
partial block padded), each row meets the same GEMM shape wherever it sits; whether the batched kernel cuBLAS picks for
another number of blocks sums a row in the same order is the library's, so `blocked_is_invariant` checks it on the
device, and `engine.kernels.cuda_deterministic.InvariantLinear` takes this path only for the weight shapes where it
holds (the MLP's down projection at the 0.8B shape, where the Triton matmul ran 1.3-1.5x slower).
"""
from __future__ import annotations

import math
import random
from typing import Callable

import torch

BLOCK_ROWS = 256
"""Rows of each GEMM of `blocked_linear`: every row goes through a GEMM of exactly this many rows."""

PADDING_IN_PLACE = True
"""Whether `blocked_linear` reads a partial last block's padding in place where its input's storage has it
(`block_padded`; the deterministic table's SwiGLU writes such storage), running every block in one batched GEMM, rather
than zero-padding a copy of the last block for a GEMM of its own. The same bits (`blocked_is_invariant` checks the two
against each other). Read at each call, so a CUDA graph keeps the setting it was captured under and
`bench/probes/variant_ab.py` can time both in one process."""


def blocked_linear(x: torch.Tensor, weight: torch.Tensor, rows: int = BLOCK_ROWS) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T -> [..., N] by cuBLAS, as GEMMs of exactly `rows` rows each: the whole blocks in one
    strided batched GEMM (the weight broadcast, not copied), the last partial block zero-padded to `rows` in a batch
    of one, or, where x's storage runs on to a whole block (`block_padded`), every block in one batched GEMM. Every
    row goes through a GEMM of the same M wherever it sits, which a single GEMM of all the rows does not give (cuBLAS
    picks its kernel, split-K among them, by M); whether the batched kernel cuBLAS picks for another batch count sums
    a row in the same order is the library's, so `blocked_is_invariant` checks it."""
    K, N = x.shape[-1], weight.shape[0]
    flat = x.reshape(-1, K)                                                            # [M, K]
    if flat.stride(0) != K or flat.stride(-1) != 1:
        flat = flat.contiguous()
    M = flat.shape[0]
    blocks = -(-M // rows)
    if PADDING_IN_PLACE and M and _has_rows(flat, blocks * rows):
        # the storage runs on past the last row to a whole block (`block_padded`): every block in one batched GEMM,
        # the padding read in place (what it holds reaches only its own rows of y, which are dropped)
        y = torch.empty(blocks * rows, N, dtype=x.dtype, device=x.device)
        torch.bmm(flat.as_strided((blocks, rows, K), (rows * K, K, 1)), weight.t().expand(blocks, K, N),
                  out=y.view(blocks, rows, N))
        return y[:M].view(*x.shape[:-1], N)
    full, rest = divmod(M, rows)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    wt = weight.t()                                                                    # [K, N], a view
    if full:
        torch.bmm(flat[:full * rows].view(full, rows, K), wt.expand(full, K, N),
                  out=y[:full * rows].view(full, rows, N))
    if rest:
        tail = torch.nn.functional.pad(flat[full * rows:], (0, 0, 0, rows - rest))      # [rows, K]
        y[full * rows:] = torch.bmm(tail[None], wt[None])[0, :rest]
    return y.view(*x.shape[:-1], N)


def _has_rows(flat: torch.Tensor, n_rows: int) -> bool:
    """Whether the storage under `flat` (contiguous rows) holds `n_rows` rows from its first."""
    return flat.storage_offset() + n_rows * flat.shape[1] <= flat.untyped_storage().nbytes() // flat.element_size()


def block_padded(shape: torch.Size, dtype: torch.dtype, device: torch.device, rows: int = BLOCK_ROWS) -> torch.Tensor:
    """An uninitialised contiguous tensor of `shape` ([..., K]) whose storage runs on to a whole number of blocks of
    `rows` rows, for a producer whose output `blocked_linear` reads: it then takes the last block's padding in place
    instead of zero-padding a copy (at batch 1, 184 rows, that is a fill, a copy and a GEMM fewer per projection)."""
    n_rows = math.prod(shape[:-1])
    storage = torch.empty(-(-n_rows // rows) * rows, shape[-1], dtype=dtype, device=device)
    return storage[:n_rows].view(shape)


def block_padded_output(producer: Callable) -> Callable:
    """`producer(a, b, out=...)` (e.g. `engine.kernels.fused.swiglu`) writing into `block_padded` storage of a's
    shape and dtype."""
    def padded(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if not PADDING_IN_PLACE:
            return producer(a, b)
        return producer(a, b, out=block_padded(a.shape, a.dtype, a.device))
    return padded


def blocked_is_invariant(weight: torch.Tensor, row_counts: list[int], probe_rows: int = 16, seed: int = 0) -> bool:
    """Whether `blocked_linear` gives a probe's rows the bits it gives them alone (a partial block, batch of one) at
    every row count in `row_counts`, placed in a whole block (a batch of all of them) and in the last partial block,
    among random neighbours."""
    gen = torch.Generator(device=weight.device).manual_seed(seed)
    positions = random.Random(seed)
    block = torch.randn(max(row_counts), weight.shape[1], device=weight.device, generator=gen).to(weight.dtype)
    w = torch.randn(weight.shape, device=weight.device, generator=gen).to(weight.dtype) / weight.shape[1] ** 0.5
    probe = block[:probe_rows].clone()
    ref = blocked_linear(probe, w)
    for M in row_counts:
        if M < probe_rows:
            continue
        full = M // BLOCK_ROWS * BLOCK_ROWS
        starts = {positions.randrange(M - probe_rows + 1)}
        if full >= probe_rows:
            starts.add(positions.randrange(full - probe_rows + 1))                     # inside the whole blocks
        if M - full >= probe_rows:
            starts.add(full + positions.randrange(M - full - probe_rows + 1))          # inside the padded tail
        for at in starts:
            neighbours = block[at:at + probe_rows].clone()
            block[at:at + probe_rows] = probe
            same = torch.equal(blocked_linear(block[:M], w)[at:at + probe_rows], ref)
            block[at:at + probe_rows] = neighbours
            if not same:
                return False
    return True
