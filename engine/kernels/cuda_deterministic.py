"""Batch-invariant Triton kernels: a row's result never depends on how many rows share its launch.

cuBLAS picks its GEMM kernel (tile shape, split-K, stream-K) from the problem's M, and flash attention splits the
keys across blocks when too few query blocks would fill the GPU; both change the order in which a row's sums are
accumulated, so the same state scored in batches of different sizes differs in its last bits, and through 24
layers by up to 1e-2 in a probability. These kernels fix the order by construction:

- `matmul`: one tiling for every M (the tile depends only on the weight's N and K), no split over K: every output
  element is the same dot product, in the same order, whatever M, the row's position and its neighbours
  (`InvariantLinear` takes a smaller tile for few rows only where the device shows it gives the same bits);
- `attention`: each query row reads the keys in blocks of a fixed size from the first, never split: the row's
  running max, sum and output see the same values in the same order whatever the batch, and masked (causal or
  padded) keys add exact zeros;
- `InvariantSuffixAttention`: the one-kernel suffix attention (`engine.kernels.suffix_attention`), which reads keys the
  same way, at launch configurations the device shows to give a row the same bits.
"""
from __future__ import annotations

import random

import torch
import triton
import triton.language as tl

from engine.kernels.blocked_linear import blocked_is_invariant, blocked_linear
from engine.kernels.pdl import await_previous_kernel, pdl_launch


@triton.jit
def _tile(M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    # this program's rows and columns of Y, in grouped order: programs running together share rows of X and
    # columns of W in L2
    tile = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    per_group = GROUP_M * num_n
    first_m = (tile // per_group) * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    pm = first_m + (tile % per_group) % size_m
    pn = (tile % per_group) // size_m
    return pm * BM + tl.arange(0, BM), pn * BN + tl.arange(0, BN)


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(X, W, Y, M, N, K: tl.constexpr, sx, sw, sy, BM: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr, GROUP_M: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr = False):
    # Y[M, N] = X[M, K] @ W[N, K]^T, one BM x BN tile a program, the whole of K in BK steps
    await_previous_kernel(PDL)
    rm, rn = _tile(M, N, BM, BN, GROUP_M)
    acc = tile_dot(X, W, rm, rn, M, N, K, sx, sw, BM, BN, BK, PRECISION)
    tl.store(Y + rm[:, None].to(tl.int64) * sy + rn[None, :], acc.to(Y.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def tile_dot(X, W, rm, rn, M, N, K: tl.constexpr, sx, sw, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
             PRECISION: tl.constexpr):
    """The float32 [BM, BN] tile X[rm] @ W[rn]^T (rows past M and columns past N read as 0), the whole of K in BK
    steps in order: every element the same dot product, in the same order, whatever M. Shared by the kernels whose
    invariance rests on it (`_matmul_kernel`, `engine.kernels.vocab_logsumexp`)."""
    rk = tl.arange(0, BK)
    x_ptr = X + rm[:, None].to(tl.int64) * sx + rk[None, :]
    w_ptr = W + rn[None, :].to(tl.int64) * sw + rk[:, None]                     # [BK, BN]: a tile of W^T
    m_ok = rm[:, None] < M
    n_ok = rn[None, :] < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for _ in range(0, K, BK):
        acc = tl.dot(tl.load(x_ptr, mask=m_ok, other=0.0), tl.load(w_ptr, mask=n_ok, other=0.0), acc,
                     input_precision=PRECISION)
        x_ptr += BK
        w_ptr += BK
    return acc


Config = tuple[int, int, int, int, int]
"""(BM, BN, BK, warps, stages) of a matmul launch."""

SMALL_TILE = (64, 64, 4, 4)
"""(BM, BN, warps, stages) of `small_tile_config`: at 184 rows (batch 1) the 1024-column down projection gets 3 x 16
programs of it on the H200's 132 SMs, against 2 x 4 of the 128 x 256 tile."""

SMALL_TILE_ROWS = 2048
"""Row counts below this may take `small_tile_config` (where `small_tile_is_identical` holds); from it up the large
tile gives every SM work."""


def matmul_config(N: int, K: int) -> Config:
    """(BM, BN, BK, warps, stages) for a weight of N x K: a function of the weight alone, never of M."""
    BK = next((b for b in (64, 32, 16) if K % b == 0), None)
    if BK is None:
        raise ValueError(f"batch-invariant matmul: K={K} must be a multiple of 16")
    if N < 64:
        return 64, 16, BK, 4, 3                      # the label projection: a handful of columns
    return 128, 256, BK, 8, 3


def small_tile_config(N: int, K: int, tile: tuple[int, int, int, int] = SMALL_TILE) -> Config | None:
    """A smaller tile than `matmul_config`'s, with its BK (so the same K steps), for few rows; None where the large
    one is already small (N < 64). A row's sum keeps its order, but whether the MMA instruction a tile shape
    compiles to (wgmma, mma.sync) adds a BK step's products in the same order is the hardware's: only
    `small_tile_is_identical` can tell."""
    if N < 64:
        return None
    return tile[0], tile[1], matmul_config(N, K)[2], tile[2], tile[3]


def matmul(x: torch.Tensor, weight: torch.Tensor, config: Config | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T -> [..., N], in x's dtype (float32 accumulation), batch-invariant."""
    K = x.shape[-1]
    N = weight.shape[0]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    M = x2.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    BM, BN, BK, warps, stages = config or matmul_config(N, K)
    if M:
        grid = (triton.cdiv(M, BM) * triton.cdiv(N, BN),)
        _matmul_kernel[grid](x2, weight, y, M, N, K, x2.stride(0), weight.stride(0), y.stride(0), BM=BM, BN=BN,
                             BK=BK, GROUP_M=8, PRECISION=_precision(x.dtype), num_warps=warps, num_stages=stages,
                             **pdl_launch())
    return y.view(*x.shape[:-1], N)


def _precision(dtype: torch.dtype) -> str:
    # float32 inputs: full-precision products (tl.dot's default for them is tf32); ignored for bf16 and fp16
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit(do_not_specialize=["M", "N_CTX", "H", "G"])
def _attention_kernel(Q, K, V, O, LSE, LENS, KV_IDX, M, N_CTX, H, G, sq_z, sq_h, sq_m, sk_z, sk_h, sk_n, sv_z, sv_h,
                      sv_n, so_z, so_h, so_m, sl_z, sl_h, scale, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                      CAUSAL: tl.constexpr, HAS_LENS: tl.constexpr, HAS_IDX: tl.constexpr, PRECISION: tl.constexpr,
                      PDL: tl.constexpr = False):
    # one program: BM query rows of one (batch, query head); keys of kv head h // G, BN at a time from the first
    await_previous_kernel(PDL)
    start_m = tl.program_id(0) * BM
    zh = tl.program_id(1)
    z = zh // H
    h = zh % H
    kvh = h // G
    zk = z                           # the K/V entry (and key length) this batch entry reads
    if HAS_IDX:
        zk = tl.load(KV_IDX + z)
    if HAS_LENS:                     # keys past this entry's length are padding
        N_CTX = tl.load(LENS + zk)
    rm = start_m + tl.arange(0, BM)
    rd = tl.arange(0, D)
    q = tl.load(Q + z.to(tl.int64) * sq_z + h * sq_h + rm[:, None].to(tl.int64) * sq_m + rd[None, :],
                mask=rm[:, None] < M, other=0.0)
    k_base = K + zk.to(tl.int64) * sk_z + kvh * sk_h
    v_base = V + zk.to(tl.int64) * sv_z + kvh * sv_h
    m_i = tl.full((BM,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BM,), dtype=tl.float32)
    acc = tl.zeros((BM, D), dtype=tl.float32)
    qk_scale = scale * 1.4426950408889634          # exp2 instead of exp
    end = tl.minimum(start_m + BM, N_CTX) if CAUSAL else N_CTX
    for start_n in range(0, end, BN):
        rn = start_n + tl.arange(0, BN)
        k = tl.load(k_base + rn[None, :].to(tl.int64) * sk_n + rd[:, None], mask=rn[None, :] < N_CTX, other=0.0)
        s = tl.dot(q, k, input_precision=PRECISION) * qk_scale                                                  # [BM, BN]
        keep = rn[None, :] < N_CTX
        if CAUSAL:
            keep = keep & (rn[None, :] <= rm[:, None])
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + rn[:, None].to(tl.int64) * sv_n + rd[None, :], mask=rn[:, None] < N_CTX, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(O + z.to(tl.int64) * so_z + h * so_h + rm[:, None].to(tl.int64) * so_m + rd[None, :],
             out.to(O.dtype.element_ty), mask=rm[:, None] < M)
    # natural-log log-sum-exp, as the flash ops return it
    tl.store(LSE + z.to(tl.int64) * sl_z + h * sl_h + rm, (m_i + tl.log2(l_i)) * 0.6931471805599453, mask=rm < M)


ATTENTION_CONFIG = (128, 64, 8, 2)
"""(query rows, keys, warps, stages) of every attention launch. The key block fixes a row's summation order, so it
never varies; on the H200 this one ran the prefix half faster than torch's flash op at batch 32 and 128 (0.076 vs
0.087 ms, 0.273 vs 0.301 ms a layer) and the causal suffix half slower (0.057 vs 0.045, 0.201 vs 0.133 ms):
bench/results/2026-11-30-nvidia-h200-invariance-probe.json."""


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
              key_lengths: torch.Tensor | None = None, kv_index: torch.Tensor | None = None,
              block_m: int | None = None, block_n: int | None = None, warps: int | None = None,
              stages: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [Z, H, M, D], k, v [Zk, Hkv, N, D] (query head h reads kv head h // (H / Hkv)) -> (out [Z, H, M, D],
    lse [Z, H, M] float32). causal: query i sees keys 0..i (M == N). kv_index: [Z] int64, the K/V entry query entry z
    reads (default z). key_lengths: [Zk] int32, the keys of K/V entry j past key_lengths[j] are ignored (prefixes of
    unequal lengths, right-padded); an entry of length 0 gives NaN rows."""
    cfg = ATTENTION_CONFIG
    block_m, block_n, warps, stages = (block_m or cfg[0], block_n or cfg[1], warps or cfg[2], stages or cfg[3])
    Z, H, M, D = q.shape
    Hkv, N_CTX = k.shape[1], k.shape[2]
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("attention: the last dimension of q, k and v must be contiguous")
    out = torch.empty(Z, H, M, D, dtype=q.dtype, device=q.device)
    lse = torch.empty(Z, H, M, dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(M, block_m), Z * H)
    lens = key_lengths if key_lengths is not None else lse          # any pointer: not read without HAS_LENS
    index = kv_index if kv_index is not None else lse               # nor this one without HAS_IDX
    _attention_kernel[grid](q, k, v, out, lse, lens, index, M, N_CTX, H, H // Hkv, *q.stride()[:3], *k.stride()[:3],
                            *v.stride()[:3], *out.stride()[:3], *lse.stride()[:2], scale, D=D, BM=block_m,
                            BN=block_n, CAUSAL=causal, HAS_LENS=key_lengths is not None,
                            HAS_IDX=kv_index is not None, PRECISION=_precision(q.dtype), num_warps=warps,
                            num_stages=stages, **pdl_launch())
    return out, lse


def indexed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, key_lengths: torch.Tensor,
                      kv_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-causal attention of query entry z against K/V entry kv_index[z] (a bank of prefixes, each of its own
    length): `Kernels.indexed_attention`."""
    return attention(q, k, v, False, scale, key_lengths, kv_index)


def cublas_is_invariant(weight: torch.Tensor, row_counts: list[int], probe_rows: int = 16, seed: int = 0) -> bool:
    """Whether F.linear (cuBLAS) gives a probe's rows the same bits at every row count in `row_counts` and at any
    position among random neighbours. cuBLAS chooses its kernel by M; on the H200 with CUDA 13's cuBLAS the kernels it
    chose for this model's layer shapes summed a row in the same order from 184 rows up
    (bench/results/2026-11-30-nvidia-h200-invariance-probe.json), but a narrow weight or a small M can get a split-K
    kernel, and another library or GPU may choose otherwise: so it is checked, weight shape by weight shape."""
    gen = torch.Generator(device=weight.device).manual_seed(seed)
    positions = random.Random(seed)
    block = torch.randn(max(row_counts), weight.shape[1], device=weight.device, generator=gen).to(weight.dtype)
    w = torch.randn(weight.shape, device=weight.device, generator=gen).to(weight.dtype) / weight.shape[1] ** 0.5
    probe = block[:probe_rows].clone()
    ref = torch.nn.functional.linear(probe, w)
    for M in row_counts:
        at = positions.randrange(M - probe_rows + 1)
        neighbours = block[at:at + probe_rows].clone()
        block[at:at + probe_rows] = probe
        same = torch.equal(torch.nn.functional.linear(block[:M], w)[at:at + probe_rows], ref)
        block[at:at + probe_rows] = neighbours
        if not same:
            return False
    return True


def small_tile_is_identical(weight: torch.Tensor, row_counts: list[int], small: Config | None = None,
                            seed: int = 0) -> bool:
    """Whether `matmul` with the `small` tile (default `small_tile_config`) gives every row the bits the
    `matmul_config` tile gives it, at every row count in `row_counts`, for random data of the weight's shape and
    dtype. Each tile sums a row in BK steps from the first; whether a step's products are added in the same order
    depends on the MMA instruction each tile shape compiles to (on Hopper wgmma for 64-row warp groups, mma.sync
    below), which the hardware, not the code, decides: so it is checked on the device, shape by shape."""
    N, K = weight.shape
    small = small or small_tile_config(N, K)
    if small is None or not row_counts:
        return False
    gen = torch.Generator(device=weight.device).manual_seed(seed)
    block = torch.randn(max(row_counts), K, device=weight.device, generator=gen).to(weight.dtype)
    w = torch.randn(weight.shape, device=weight.device, generator=gen).to(weight.dtype) / K ** 0.5
    ref = matmul(block, w)
    return all(torch.equal(matmul(block[:M], w, small), ref[:M]) for M in row_counts)


BLOCKED_CUBLAS = True
"""Whether `InvariantLinear` runs the shapes it found batch-invariant as `blocked_linear` that way (False: the Triton
matmul, as before it had the choice). Read at each call, so a CUDA graph keeps the setting it was captured under and
`bench/probes/variant_ab.py` can time both in one process."""

CUBLAS_FLOOR_MIN = 0
"""A floor under the floors `InvariantLinear` found (each found floor is checked for every row count from it up, so a
higher one stays batch-invariant where it is a checked row count: 256 is): 256 runs as before the 128-row floor was a
candidate. Read at each call, like `BLOCKED_CUBLAS`."""


class InvariantLinear:
    """`F.linear` with a summation order that does not depend on the row count. Per weight shape, the first of:
    - cuBLAS with fewer rows than a floor zero-padded up to it, at the lowest floor of `MIN_ROWS` from which
      `cublas_is_invariant` holds (cuBLAS switches to split-K kernels at small row counts, and where that happens
      depends on the shape; below the floor a GEMM's time is mostly the weight's read, which the padding does not
      change; `CUBLAS_FLOOR_MIN` raises it);
    - `blocked_linear` (cuBLAS on blocks of `BLOCK_ROWS` rows) where `blocked_is_invariant` holds (`blocked`; with
      `BLOCKED_CUBLAS` on): the MLP's down projection at the 0.8B shape is invariant at no floor, and the Triton
      matmul ran it 1.3 to 1.5 times slower than cuBLAS;
    - `matmul`: with `small_tile_config` below `SMALL_TILE_ROWS` rows where `small_tile_is_identical` holds for the
      shape (`small`), else `matmul_config` at every row count.

    (Fusing the MLP's swiglu into the down projection's A tiles was tried and kept the bits, but ran slower than the
    two kernels at every row count on the H200, 0.069 against 0.025 ms at 184 rows and 0.74 against 0.44 at 23,552:
    run M of `bench/probes/mlp_probe.py`, bench/README.md.)"""

    MIN_ROWS = (128, 256, 1024, 4096)

    def __init__(self, weights: list[torch.Tensor], row_counts: list[int]):
        shapes = {tuple(w.shape): w for w in weights}
        self.floors = {shape: floor for shape, w in shapes.items()
                       if (floor := _invariant_floor(w, row_counts, self.MIN_ROWS)) is not None}
        self.triton = set(shapes) - set(self.floors)
        self.blocked = {shape for shape in self.triton if blocked_is_invariant(shapes[shape], row_counts)}
        few = sorted({m for m in row_counts if m < SMALL_TILE_ROWS})
        self.small = {shape: cfg for shape in sorted(self.triton) if (cfg := small_tile_config(*shape)) is not None
                      and small_tile_is_identical(shapes[shape], few, cfg)}

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        shape = tuple(weight.shape)
        floor = self.floors.get(shape)
        if floor is None:
            if BLOCKED_CUBLAS and shape in self.blocked:
                return blocked_linear(x, weight)
            return matmul(x, weight, self._tile(shape, x))
        floor = max(floor, CUBLAS_FLOOR_MIN)
        rows = x.reshape(-1, x.shape[-1])                                              # [M, K]
        M = rows.shape[0]
        if M >= floor:
            return torch.nn.functional.linear(x, weight)
        padded = torch.nn.functional.pad(rows, (0, 0, 0, floor - M))                   # [floor, K]
        return torch.nn.functional.linear(padded, weight)[:M].view(*x.shape[:-1], weight.shape[0])

    def _tile(self, shape: tuple[int, int], x: torch.Tensor) -> Config | None:
        # a function of the row count, the same for every row: the two tiles give a row the same bits (checked)
        few = x.numel() < SMALL_TILE_ROWS * x.shape[-1]
        return self.small.get(shape) if few else None


def _invariant_floor(weight: torch.Tensor, row_counts: list[int], floors: tuple[int, ...]) -> int | None:
    for floor in floors:
        if cublas_is_invariant(weight, sorted({max(floor, m) for m in row_counts})):
            return floor
    return None
