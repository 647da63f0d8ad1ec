"""The MLP's down projection in deterministic scoring (H200, bf16, the 0.8B shape: weight 1024 x 3584): what fusing
swiglu into the GEMM and a smaller tile for few rows save, and whether they keep the bits.

For M rows (batch 1 / 8 / 32 / 128 x 184 suffix tokens by default) of a fused gate|up projection output [M, 7168]:
- time (CUDA events around each launch, the L2 cache flushed before each as the layer's weight is cold in a forward,
  median of --reps after --warmup): `engine.kernels.fused.swiglu` then `engine.kernels.cuda_deterministic.matmul`, and
  `swiglu_matmul` (this file: the experiment of fusing swiglu into the GEMM's A tiles, which lost at every M and
  is not in the engine), with the large tile (`matmul_config`) and each candidate small tile;
  cuBLAS's F.linear alone and after swiglu, for reference;
- check bit for bit: fused against unfused with the same tile, and each small tile against the large one;
- report what `InvariantLinear` chooses for this shape at the row counts the engine checks (Triton or cuBLAS, the
  small tile, the fusion).

    python bench/probes/mlp_probe.py --out DIR/mlp_probe.json     (prints a table)
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from bench.probes.kernel_probe import gpu_ms
from engine.kernels import cuda_deterministic as bi
from engine.kernels.fused import swiglu

@triton.jit(do_not_specialize=["M"])
def _swiglu_matmul_kernel(GU, W, Y, M, N, K: tl.constexpr, sgu, sw, sy, BM: tl.constexpr, BN: tl.constexpr,
                          BK: tl.constexpr, GROUP_M: tl.constexpr, PRECISION: tl.constexpr):
    # _matmul_kernel with X = swiglu(GU[:, :K], GU[:, K:]) made tile by tile in registers, rounded as
    # engine.kernels.fused._swiglu_kernel rounds it, so the dot sees the bits the unfused kernels would store
    rm, rn = bi._tile(M, N, BM, BN, GROUP_M)
    rk = tl.arange(0, BK)
    g_ptr = GU + rm[:, None].to(tl.int64) * sgu + rk[None, :]
    w_ptr = W + rn[None, :].to(tl.int64) * sw + rk[:, None]                     # [BK, BN]: a tile of W^T
    m_ok = rm[:, None] < M
    n_ok = rn[None, :] < N
    ty = Y.dtype.element_ty
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for _ in range(0, K, BK):
        g = tl.load(g_ptr, mask=m_ok, other=0.0).to(tl.float32)
        u = tl.load(g_ptr + K, mask=m_ok, other=0.0).to(tl.float32)
        act = (g * tl.sigmoid(g)).to(ty).to(tl.float32)
        acc = tl.dot((act * u).to(ty), tl.load(w_ptr, mask=n_ok, other=0.0), acc, input_precision=PRECISION)
        g_ptr += BK
        w_ptr += BK
    tl.store(Y + rm[:, None].to(tl.int64) * sy + rn[None, :], acc.to(ty), mask=m_ok & n_ok)



def swiglu_matmul(gate_up: torch.Tensor, weight: torch.Tensor, config: bi.Config | None = None) -> torch.Tensor:
    """swiglu(gate, up) @ weight[N, I]^T -> [..., N] for gate_up [..., 2I] = gate | up (the fused gate|up
    projection's output), without writing swiglu's [..., I] out: bit-identical to
    `matmul(engine.kernels.fused.swiglu(gate, up), weight, config)`, so batch-invariant too."""
    K = weight.shape[1]
    N = weight.shape[0]
    if gate_up.shape[-1] != 2 * K:
        raise ValueError(f"swiglu_matmul: gate_up has {gate_up.shape[-1]} columns, the weight {K} (needs 2 x {K})")
    gu = gate_up.reshape(-1, 2 * K)
    if gu.stride(-1) != 1:
        gu = gu.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    M = gu.shape[0]
    y = torch.empty(M, N, dtype=gate_up.dtype, device=gate_up.device)
    BM, BN, BK, warps, stages = config or bi.matmul_config(N, K)
    if M:
        grid = (triton.cdiv(M, BM) * triton.cdiv(N, BN),)
        _swiglu_matmul_kernel[grid](gu, weight, y, M, N, K, gu.stride(0), weight.stride(0), y.stride(0), BM=BM,
                                    BN=BN, BK=BK, GROUP_M=8, PRECISION=bi._precision(gate_up.dtype), num_warps=warps,
                                    num_stages=stages)
    return y.view(*gate_up.shape[:-1], N)


N, I = 1024, 3584
SMALL_TILES = [(64, 64, 4, 4), (64, 128, 4, 4), (64, 32, 4, 4), (32, 64, 4, 4), (64, 64, 4, 3), (32, 32, 4, 4)]
"""(BM, BN, warps, stages) candidates for `engine.kernels.cuda_deterministic.SMALL_TILE`."""


def name(config: tuple) -> str:
    return "x".join(map(str, config))


def probe_rows(M: int, w: torch.Tensor, args, flush) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(M)
    gate_up = torch.randn(M, 2 * I, device="cuda", generator=gen).to(torch.bfloat16)
    gate, up = gate_up.split(I, dim=-1)
    act = swiglu(gate, up)
    large = bi.matmul_config(N, I)
    ref = bi.matmul(act, w, large)
    ms = lambda fn: gpu_ms(fn, args.reps, args.warmup, flush)          # noqa: E731
    cublas = ms(lambda: F.linear(act, w))
    row = {"cublas_linear_ms": cublas, "tflops_cublas": 2 * M * N * I / cublas / 1e9,
           "swiglu_ms": ms(lambda: swiglu(gate, up)),
           "swiglu_then_cublas_ms": ms(lambda: F.linear(swiglu(gate, up), w)),
           "tiles": {}}
    for config in [large] + [bi.small_tile_config(N, I, tile) for tile in SMALL_TILES]:
        entry = {}
        try:
            unfused = bi.matmul(act, w, config)
            fused = swiglu_matmul(gate_up, w, config)
            torch.cuda.synchronize()
        except Exception as exc:                          # a tile that does not fit (shared memory, registers)
            row["tiles"][name(config)] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            continue
        entry["fused_equals_unfused"] = bool(torch.equal(fused, unfused))
        entry["equals_large_tile"] = bool(torch.equal(unfused, ref))
        entry["fused_equals_large_tile_unfused"] = bool(torch.equal(fused, ref))
        entry["unfused_ms"] = ms(lambda: bi.matmul(swiglu(gate, up), w, config))
        entry["matmul_only_ms"] = ms(lambda: bi.matmul(act, w, config))
        entry["fused_ms"] = ms(lambda: swiglu_matmul(gate_up, w, config))
        row["tiles"][name(config)] = entry
    return row


def engine_choice(w: torch.Tensor) -> dict:
    """What InvariantLinear decides for this shape, at the row counts `engine.kernels.table.batch_invariant_kernels`
    passes it (the same formula)."""
    from engine.buckets import B_BUCKETS
    rows = sorted({r * t for r in B_BUCKETS for t in (1, 10, 32, 64, 128, 184, 256, 512, 1024)})
    started = time.perf_counter()
    linear = bi.InvariantLinear([w], rows)
    shape = tuple(w.shape)
    return {"cublas_floor": linear.floors.get(shape), "blocked_cublas": shape in linear.blocked,
            "triton": shape in linear.triton,
            "small_tile": linear.small.get(shape), 
            "small_tile_rows": bi.SMALL_TILE_ROWS,
            "checked_s": time.perf_counter() - started}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="path of the JSON to write")
    ap.add_argument("--rows", default="184,1472,5888,23552", help="row counts M, comma-separated")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--no-flush", action="store_true", help="keep the L2 cache between launches (weight warm)")
    args = ap.parse_args()
    torch.manual_seed(0)
    w = (torch.randn(N, I, device="cuda") / I ** 0.5).to(torch.bfloat16)
    flush = None if args.no_flush else torch.empty(256 * 2 ** 20, dtype=torch.int8, device="cuda")
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
              "weight": [N, I], "dtype": "bfloat16", "l2_flushed": flush is not None, "reps": args.reps,
              "large_tile": name(bi.matmul_config(N, I)), "default_small_tile": name(bi.small_tile_config(N, I)),
              "rows": {}}
    for M in map(int, args.rows.split(",")):
        row = result["rows"][str(M)] = probe_rows(M, w, args, flush)
        print(f"M={M}: cuBLAS {row['cublas_linear_ms']:.4f} ms ({row['tflops_cublas']:.0f} TFLOP/s), swiglu "
              f"{row['swiglu_ms']:.4f}, swiglu+cuBLAS {row['swiglu_then_cublas_ms']:.4f}", flush=True)
        for tile, e in row["tiles"].items():
            if "error" in e:
                print(f"  {tile:16s} {e['error'][:80]}", flush=True)
                continue
            print(f"  {tile:16s} unfused {e['unfused_ms']:.4f} (matmul {e['matmul_only_ms']:.4f})  fused "
                  f"{e['fused_ms']:.4f}  fused==unfused {e['fused_equals_unfused']}  ==large tile "
                  f"{e['equals_large_tile']}", flush=True)
    result["engine_choice"] = engine_choice(w)
    print(f"InvariantLinear for {N}x{I}: {result['engine_choice']}", flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
