"""GEMMs with few rows (a batch of one to a few states): split over K, so that the weight is read by every SM.

At batch 1 a suffix pass has about 184 token rows. cuBLAS then tiles a 1024-column projection (the MLP's down
projection, the linear attention's out_proj, the attention's o_proj) into 16 programs of 64 x 184, for the H200's 132
SMs: 16 SMs stream the whole weight while the others idle (run AN's batch-1 profile: 0.77 ms of a 2.02 ms step in
GEMMs, the weights read at about 1.3 TB/s). Splitting K over SPLITS programs per output tile gives SPLITS times the
programs. Each program stores its float32 partial tile; the last of a tile's programs to finish (an arrival counter)
adds the SPLITS partials in split order, so the sum, and the bits, do not depend on which program finished last, and
writes the tile. No second kernel: at batch 1 a launch costs about as much as the GEMM saves.

The arrival counters live in one zeroed buffer per device, and the kernel sets each back to zero when it has used it,
so a CUDA graph replays without a memset node. Two of these GEMMs must therefore never run at the same time on one
device (the engine makes every device call from one thread, on one stream).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.batch_invariant import _precision
from engine.triton_kernels import await_previous_kernel, pdl_launch

Config = tuple[int, int, int, int, int, int]
"""(BM, BN, BK, SPLITS, warps, stages) of a launch."""


@triton.jit(do_not_specialize=["M"])
def _split_k_kernel(X, W, Y, PARTIALS, ARRIVED, M, N, K: tl.constexpr, sx, sw, sy, BM: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr, SPLITS: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr = False):
    # Y[M, N] = X[M, K] @ W[N, K]^T; program (tile, split) sums K's split-th slice for one BM x BN tile of Y
    await_previous_kernel(PDL)
    tile = tl.program_id(0)
    split = tl.program_id(1)
    num_m = tl.cdiv(M, BM)
    # a column block's row tiles are neighbours in launch order, so W's tile comes from DRAM once and then from L2
    rm = (tile % num_m) * BM + tl.arange(0, BM)
    rn = (tile // num_m) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    k_slice = K // SPLITS
    x_ptr = X + rm[:, None].to(tl.int64) * sx + split * k_slice + rk[None, :]
    w_ptr = W + rn[None, :].to(tl.int64) * sw + split * k_slice + rk[:, None]          # [BK, BN]: a tile of W^T
    m_ok = rm[:, None] < M
    n_ok = rn[None, :] < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for _ in range(0, K, BK * SPLITS):                                       # k_slice / BK steps
        acc = tl.dot(tl.load(x_ptr, mask=m_ok, other=0.0), tl.load(w_ptr, mask=n_ok, other=0.0), acc,
                     input_precision=PRECISION)
        x_ptr += BK
        w_ptr += BK
    y_ptr = Y + rm[:, None].to(tl.int64) * sy + rn[None, :]
    if SPLITS == 1:
        tl.store(y_ptr, acc.to(Y.dtype.element_ty), mask=m_ok & n_ok)
    else:
        in_tile = tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]
        tiles = tl.num_programs(0)
        tl.store(PARTIALS + (split * tiles + tile).to(tl.int64) * (BM * BN) + in_tile, acc)
        # every thread's partial is stored before the counter moves: the barrier orders them before the release
        tl.debug_barrier()
        arrived = tl.atomic_add(ARRIVED + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLITS - 1:
            total = tl.zeros((BM, BN), dtype=tl.float32)
            for s in tl.static_range(SPLITS):
                # .cg: from L2, where the other programs' stores are, never a stale L1 line
                total += tl.load(PARTIALS + (s * tiles + tile).to(tl.int64) * (BM * BN) + in_tile,
                                 cache_modifier=".cg")
            tl.store(y_ptr, total.to(Y.dtype.element_ty), mask=m_ok & n_ok)
            tl.atomic_xchg(ARRIVED + tile, 0)                               # zero again for the next launch


_ARRIVED: dict[torch.device, torch.Tensor] = {}
MAX_TILES = 1 << 16


def _arrival_counters(device: torch.device) -> torch.Tensor:
    counters = _ARRIVED.get(device)
    if counters is None:
        counters = _ARRIVED[device] = torch.zeros(MAX_TILES, dtype=torch.int32, device=device)
    return counters


def split_k_matmul(x: torch.Tensor, weight: torch.Tensor, config: Config) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T -> [..., N] in x's dtype (float32 accumulation), K split SPLITS ways; the same
    bits on every call for the same config and row count. K must be a multiple of BK * SPLITS."""
    BM, BN, BK, splits, warps, stages = config
    K = x.shape[-1]
    N = weight.shape[0]
    if K % (BK * splits):
        raise ValueError(f"split-K matmul: K={K} is not a multiple of BK * SPLITS = {BK * splits}")
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    M = x2.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    tiles = triton.cdiv(M, BM) * triton.cdiv(N, BN)
    if M and tiles > MAX_TILES:
        raise ValueError(f"split-K matmul: {tiles} tiles, over the {MAX_TILES} arrival counters")
    if M:
        partials = torch.empty(splits * tiles * BM * BN if splits > 1 else 1, dtype=torch.float32, device=x.device)
        _split_k_kernel[(tiles, splits)](x2, weight, y, partials, _arrival_counters(x.device), M, N, K,
                                         x2.stride(0), weight.stride(0), y.stride(0), BM=BM, BN=BN, BK=BK,
                                         SPLITS=splits, PRECISION=_precision(x.dtype),
                                         num_warps=warps, num_stages=stages, **pdl_launch())
    return y.view(*x.shape[:-1], N)
