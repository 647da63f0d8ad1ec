"""Does a Triton tile give cuBLAS's bits? (issue 48: "a few-row batch-invariant GEMM tile that gives cuBLAS's bits").

The deterministic table runs most projections by cuBLAS, which sums a row in one order from 128 rows up for these
shapes (`engine.kernels.cuda_deterministic.cublas_is_invariant`), but at a step's few rows (184 at batch 1, 1,472 at
batch 8) cuBLAS takes 4-9 us a GEMM, 2-8 times the weight's read (run CJ). A Triton tile that chains its k16 MMAs from
the first K step to the last, as cuBLAS's kernels without split-K do, may add a row's products in cuBLAS's order: then
few rows could run through Triton and many through cuBLAS with no bit changed. Only the device can tell, so this
probe asks it, for each of the 0.8B model's projection shapes and each candidate tile: whether `matmul` with the tile
gives `F.linear`'s bits (at the same row count, and at the largest row count, where cuBLAS runs another kernel), and
for the MLP's down projection `blocked_linear`'s; and how long one GEMM takes inside a CUDA graph, beside cuBLAS.

    python bench/probes/cublas_bits_probe.py [--rows 184,368,736,1472,2944,5888] [--out results/X.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.probes.gemm_probe import SHAPES, floor_us  # noqa: E402
from bench.probes.kernel_probe import gpu_ms  # noqa: E402
from bench.probes.launch_floor import chain  # noqa: E402
from engine.kernels import blocked_linear as blocked  # noqa: E402
from engine.kernels import cuda_deterministic as bi  # noqa: E402

# (BM, BN, BK, warps, stages): wgmma tiles of 64 to 256 rows, narrow to wide, BK 64 (cuBLAS's K tile on these shapes)
# and two others (a chained MMA sums a row in the same order whatever BK, if the compiler keeps one accumulator)
TILES = [(64, 32, 64, 4, 4), (64, 64, 64, 4, 4), (64, 128, 64, 4, 4), (64, 256, 64, 8, 3), (128, 32, 64, 4, 4),
         (128, 64, 64, 4, 4), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (256, 32, 64, 8, 3), (256, 64, 64, 8, 3),
         (256, 128, 64, 8, 3), (64, 64, 128, 4, 3), (128, 64, 128, 8, 3), (64, 64, 32, 4, 5)]
LARGE_ROWS = 23552


def tile_name(tile: tuple[int, ...]) -> str:
    return "x".join(str(t) for t in tile)


def probe_shape(N: int, K: int, rows: list[int], calls: int, gen: torch.Generator) -> dict:
    """For one weight shape: per row count, cuBLAS's (and for the down projection the blocked path's) time, and per
    tile its time and whether it gave the reference's bits at that row count and at LARGE_ROWS."""
    w = (torch.randn(N, K, device="cuda", generator=gen) / K ** 0.5).to(torch.bfloat16)
    x = (torch.randn(LARGE_ROWS, K, device="cuda", generator=gen) * 2).to(torch.bfloat16)
    reference = blocked.blocked_linear if (N, K) == (1024, 3584) else F.linear
    large = reference(x, w)
    out = {"reference": reference.__name__, "rows": {}}
    for M in rows:
        xm = x[:M].contiguous()
        ref = reference(xm, w)
        row = {"floor_us": floor_us(M, N, K),
               "cublas_us": 1000 * gpu_ms(chain(lambda: F.linear(xm, w), calls), iters=20, graph=True) / calls,
               "reference_invariant": bool(torch.equal(ref, large[:M])), "tiles": {}}
        if reference is not F.linear:
            row["reference_us"] = 1000 * gpu_ms(chain(lambda: reference(xm, w), calls), iters=20, graph=True) / calls
        for tile in TILES:
            try:
                y = bi.matmul(xm, w, tile)
                entry = {"same_bits": bool(torch.equal(y, ref)), "same_bits_as_large": bool(torch.equal(y, large[:M])),
                         "max_diff": float((y.float() - ref.float()).abs().max()),
                         "us": 1000 * gpu_ms(chain(lambda: bi.matmul(xm, w, tile), calls), iters=20, graph=True) / calls}
            except Exception as exc:  # noqa: BLE001 - a tile the device refuses (shared memory) is reported, not fatal
                entry = {"error": f"{type(exc).__name__}: {str(exc)[:160]}"}
            row["tiles"][tile_name(tile)] = entry
        out["rows"][M] = row
    return out


def report(name: str, N: int, K: int, shape: dict) -> list[str]:
    lines = [f"### {name} {N}x{K} (reference: {shape['reference']})", "",
             "| tile (BM x BN x BK x warps x stages) | " + " | ".join(f"{M} rows" for M in shape["rows"]) + " |",
             "|---|" + "---|" * len(shape["rows"])]
    cells = [f"{r['cublas_us']:.1f}" + (f" (blocked {r['reference_us']:.1f})" if "reference_us" in r else "")
             for r in shape["rows"].values()]
    lines.append("| cuBLAS us | " + " | ".join(cells) + " |")
    lines.append("| floor us | " + " | ".join(f"{r['floor_us']:.1f}" for r in shape["rows"].values()) + " |")
    for tile in TILES:
        tn = tile_name(tile)
        cells = []
        for r in shape["rows"].values():
            e = r["tiles"][tn]
            if "error" in e:
                cells.append("refused")
            else:
                bits = "=" if e["same_bits"] and e["same_bits_as_large"] else ("~" if e["same_bits"] else "x")
                cells.append(f"{e['us']:.1f} {bits}")
        lines.append(f"| {tn} | " + " | ".join(cells) + " |")
    lines.append("")
    return lines


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="184,368,736,1472,2944,5888")
    ap.add_argument("--calls", type=int, default=20, help="GEMMs a graph replays")
    ap.add_argument("--shapes", default=None, help="comma-separated names of gemm_probe.SHAPES (default all)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    wanted = set(args.shapes.split(",")) if args.shapes else None
    gen = torch.Generator(device="cuda").manual_seed(0)
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "unit": "us per GEMM",
              "legend": "= same bits as cuBLAS at that row count and at 23,552 rows; ~ at that row count only; x differ",
              "shapes": {}}
    print(result["legend"])
    for name, N, K in SHAPES:
        if wanted and name not in wanted:
            continue
        shape = probe_shape(N, K, rows, args.calls, gen)
        result["shapes"][name] = {"N": N, "K": K, **shape}
        print("\n".join(report(name, N, K, shape)), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
