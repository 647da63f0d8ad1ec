"""The suffix pass's GEMM shapes at few rows: cuBLAS (F.linear) against `engine.skinny_gemm`'s split-K launches.

    python bench/gemm_probe.py --rows 184,736,1472 [--out gemm_probe.json]

Each launch is timed in a CUDA graph of one call per weight copy, with enough copies (of the same shape) that the
weights do not fit in L2, as in a step, where every layer reads its own weights. Reports, per shape and row count, the
time of cuBLAS and of the fastest split-K configurations, their error against a float32 product, and whether two calls
gave the same bits; then the step's sum over the model's layers for cuBLAS and for the fastest configuration of each
shape.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.skinny_gemm import split_k_matmul  # noqa: E402

# (name, N, K, layers of the 0.8B shape that run it)
SHAPES = [("in_proj", 8224, 1024, 18), ("qkv", 5120, 1024, 6), ("mlp_in", 7168, 1024, 24), ("down", 1024, 3584, 24),
          ("out_proj", 1024, 2048, 24)]
L2_BYTES = 60 << 20


def configs(K: int):
    for BM, BN, BK, splits in itertools.product((64, 128), (32, 64, 128), (64, 128), (1, 2, 4, 8)):
        if K % (BK * splits) == 0:
            yield BM, BN, BK, splits, 4 if BM == 64 else 8, 4


def graph_time_us(fn, x, weights, replays: int = 20) -> float:
    """Microseconds a call, from a CUDA graph of one call per weight."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for w in weights[:2]:
            fn(x, w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(x, w)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (replays * len(weights))


def probe_shape(name: str, N: int, K: int, rows: int, top: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    copies = max(2, -(-L2_BYTES // (N * K * 2)))
    weights = [(torch.randn(N, K, device="cuda", generator=gen) / K ** 0.5).bfloat16() for _ in range(copies)]
    x = torch.randn(rows, K, device="cuda", generator=gen).bfloat16()
    exact = F.linear(x.float(), weights[0].float())
    cublas_us = graph_time_us(F.linear, x, weights)
    cublas_err = (F.linear(x, weights[0]).float() - exact).abs().max().item()
    results = []
    for cfg in configs(K):
        try:
            first = split_k_matmul(x, weights[0], cfg)
            again = split_k_matmul(x, weights[0], cfg)
            us = graph_time_us(lambda a, w: split_k_matmul(a, w, cfg), x, weights)
        except Exception as exc:  # noqa: BLE001 - a config the compiler rejects (shared memory): skip it
            print(f"  {name} {cfg}: {type(exc).__name__}: {str(exc)[:120]}")
            continue
        results.append({"config": cfg, "us": us, "max_err": (first.float() - exact).abs().max().item(),
                        "same_bits": torch.equal(first, again)})
    results.sort(key=lambda r: r["us"])
    weight_mb = N * K * 2 / 1e6
    print(f"{name} N={N} K={K} rows={rows}: cuBLAS {cublas_us:.2f} us ({weight_mb / cublas_us:.2f} TB/s, err "
          f"{cublas_err:.4f})")
    for r in results[:top]:
        print(f"  {r['config']}: {r['us']:.2f} us ({weight_mb / r['us']:.2f} TB/s), err {r['max_err']:.4f}, "
              f"same bits {r['same_bits']}")
    return {"name": name, "N": N, "K": K, "rows": rows, "cublas_us": cublas_us, "cublas_err": cublas_err,
            "split_k": results}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="184,736,1472")
    ap.add_argument("--top", type=int, default=4)
    ap.add_argument("--out")
    args = ap.parse_args()
    report = []
    for rows in (int(r) for r in args.rows.split(",")):
        per_shape = [probe_shape(name, N, K, rows, args.top) for name, N, K, _ in SHAPES]
        report.extend(per_shape)
        layers = {name: n for name, _, _, n in SHAPES}
        cublas = sum(s["cublas_us"] * layers[s["name"]] for s in per_shape)
        best = sum(min([s["cublas_us"]] + [r["us"] for r in s["split_k"]]) * layers[s["name"]] for s in per_shape)
        print(f"rows {rows}: a step's GEMMs {cublas / 1000:.3f} ms by cuBLAS, {best / 1000:.3f} ms with the fastest "
              f"of each shape")
    if args.out:
        Path(args.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "shapes": report}, indent=1))


if __name__ == "__main__":
    main()
