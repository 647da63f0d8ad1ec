"""The 0.8B model's projections as GEMMs alone, at a step's row counts, against their floors (issue 33: at batch 1 the
99 GEMMs of a step take 752 us, 7.6 us each, where their FLOPs and weight reads take 2-4 us).

For each weight shape and row count, the microseconds one GEMM takes inside a CUDA graph (20 in a row, the median of
20 replays, so no host launch is timed) by: cuBLAS as the engine calls it (`F.linear`); cuBLAS with bf16 reduced-precision
reductions forbidden (`torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False`, which rules out
the split-K kernels that zero their output first); the MLP's down projection in blocks of 256 rows
(`engine.kernels.blocked_linear`); the batch-invariant Triton matmul (`engine.kernels.cuda_deterministic.matmul`, its
tile for the shape); and the floor: the larger of the FLOPs at 790 TFLOP/s and the bytes at 4.8 TB/s.

    python bench/probes/gemm_probe.py [--rows 184,1472,5888,23552] [--out results/X.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.probes.kernel_probe import gpu_ms  # noqa: E402
from bench.probes.launch_floor import chain  # noqa: E402
from engine.kernels import cuda_deterministic as bi  # noqa: E402
from engine.kernels import blocked_linear as blocked  # noqa: E402

# (name, N, K) of Qwen3.5-0.8B's projections: GDN in|out, MLP gate|up and down, attention q|k|v, o, q|gate, k|v
SHAPES = [("gdn_in", 8224, 1024), ("gdn_out / attn_o", 1024, 2048), ("mlp_in", 7168, 1024), ("mlp_down", 1024, 3584),
          ("attn_qkv", 5120, 1024), ("attn_q", 4096, 1024), ("attn_kv", 1024, 1024)]
PEAK_FLOPS, PEAK_BYTES = 790e12, 4.8e12


def floor_us(M: int, N: int, K: int) -> float:
    """The larger of the GEMM's FLOPs at the bf16 peak and its bytes (x, weight, y once each) at HBM speed."""
    return 1e6 * max(2 * M * N * K / PEAK_FLOPS, 2 * (M * K + N * K + M * N) / PEAK_BYTES)


def _exact_mm(x, w):
    saved = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    try:
        return F.linear(x, w)
    finally:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = saved


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="184,1472,5888,23552")
    ap.add_argument("--calls", type=int, default=20, help="GEMMs a graph replays")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    gen = torch.Generator(device="cuda").manual_seed(0)
    result = {"device": torch.cuda.get_device_name(0), "unit": "us per GEMM", "shapes": {}}
    print("| shape | rows | cuBLAS | cuBLAS, no reduced-precision split-K | blocked 256 | Triton invariant | floor |")
    print("|---|---|---|---|---|---|---|")
    for name, N, K in SHAPES:
        w = torch.randn(N, K, device="cuda", generator=gen).to(torch.bfloat16)
        for M in rows:
            x = torch.randn(M, K, device="cuda", generator=gen).to(torch.bfloat16)
            ways = {"cublas": lambda: F.linear(x, w), "cublas_exact": lambda: _exact_mm(x, w),
                    "blocked": lambda: blocked.blocked_linear(x, w), "triton": lambda: bi.matmul(x, w)}
            times = {way: 1000 * gpu_ms(chain(call, args.calls), iters=20, graph=True) / args.calls
                     for way, call in ways.items()}
            times["floor"] = floor_us(M, N, K)
            result["shapes"].setdefault(name, {})[M] = times
            print(f"| {name} {N}x{K} | {M} | " + " | ".join(f"{times[k]:.1f}" for k in
                  ("cublas", "cublas_exact", "blocked", "triton", "floor")) + " |", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
