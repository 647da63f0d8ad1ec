"""The device's floor for a chain of dependent kernels replayed from one CUDA graph: what a step of N kernels
costs before any of them does work (issue 33: batch 1's step is ~330 kernels).

Captures N launches of a one-program Triton kernel that adds 1 to one float (each reads what the one before it wrote),
with and without programmatic dependent launch, and N tiny cuBLAS GEMMs, and reports the graph replay time per kernel.

    python bench/launch_floor.py [--kernels 330] [--iters 50]
"""
from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl


@triton.jit
def _bump_kernel(X, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(X, tl.load(X) + 1.0)


def graph_ms(launch, n: int, iters: int) -> float:
    """Milliseconds per replay of a graph of `n` calls of `launch`, after a warm-up replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        launch()                                           # compile and load outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n):
            launch()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


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
        per_kernel_us = 1000 * graph_ms(launch, args.kernels, args.iters) / args.kernels
        result[name] = per_kernel_us
        print(f"{name}: {per_kernel_us:.2f} us a kernel in a graph of {args.kernels} "
              f"({per_kernel_us * args.kernels / 1000:.3f} ms a replay)", flush=True)
    return result


if __name__ == "__main__":
    print(json.dumps(main()))
