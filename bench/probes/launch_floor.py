"""The device's floor for a chain of dependent kernels replayed from one CUDA graph: what a step of N kernels
costs before any of them does work (issue 33: batch 1's step is ~330 kernels).

Captures N launches of a one-program Triton kernel that adds 1 to one float (each reads what the one before it wrote),
with and without programmatic dependent launch, and N tiny cuBLAS GEMMs, and reports the graph replay time per kernel
(`bench/probes/kernel_probe.gpu_ms`: the median replay).

    python bench/probes/launch_floor.py [--kernels 330] [--iters 50]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.probes.kernel_probe import gpu_ms  # noqa: E402


@triton.jit
def _bump_kernel(X, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(X, tl.load(X) + 1.0)


def chain(launch, n: int):
    """A function that calls `launch` n times: what one graph captures."""
    def run():
        for _ in range(n):
            launch()
    return run


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", type=int, default=330)
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args(argv)
    x = torch.zeros(1, device="cuda")
    a, w = torch.randn(16, 1024, device="cuda", dtype=torch.bfloat16), torch.randn(1024, 1024, device="cuda",
                                                                                     dtype=torch.bfloat16)
    out = torch.empty(16, 1024, device="cuda", dtype=torch.bfloat16)
    chains = {
        "triton, one program": lambda: _bump_kernel[(1,)](x, PDL=False),
        "triton, one program, PDL": lambda: _bump_kernel[(1,)](x, PDL=True, launch_pdl=True),
        "cuBLAS 16 x 1024 x 1024": lambda: torch.mm(a, w.t(), out=out),
    }
    result = {"kernels": args.kernels, "device": torch.cuda.get_device_name(0)}
    for name, launch in chains.items():
        per_kernel_us = 1000 * gpu_ms(chain(launch, args.kernels), iters=args.iters, graph=True) / args.kernels
        result[name] = per_kernel_us
        print(f"{name}: {per_kernel_us:.2f} us a kernel in a graph of {args.kernels} "
              f"({per_kernel_us * args.kernels / 1000:.3f} ms a replay)", flush=True)
    return result


if __name__ == "__main__":
    print(json.dumps(main()))
